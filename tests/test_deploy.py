"""Deploy against a real remote: a bare repository served by `git daemon` on loopback, which
workers fetch from over the network."""

from __future__ import annotations

import base64
import hashlib
import itertools
import os
import subprocess
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from conftest import free_port, git_daemon

from tpufab import deploy as deploy_mod
from tpufab.deploy import DeployError, deploy
from tpufab.gitops import GitError
from tpufab.remote_files import RemoteFile, python_command

GIT_ENV = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t"}


def sh(cwd: Path, *argv: str) -> str:
    return subprocess.run(argv, cwd=cwd, check=True, capture_output=True, text=True,
                          env={**os.environ, **GIT_ENV}).stdout.strip()



def dead_url() -> str:
    return f"git://127.0.0.1:{free_port()}/gone.git"


# --- the simulated pod: real sshd workers in their own namespaces, reached by the fan-out ---

ACCEL = tuple(f"/dev/accel{i}" for i in range(4))
USER = "tpufab"  # the login user: not root, passwordless sudo (google-sudoers)


class SimPod:
    """``count`` simulated workers (own /home, /tmp, /dev, PID and mount namespaces) and a
    Fanout logged in as an ordinary user with sudo (as on a real TPU VM), host keys pinned."""

    def __init__(self, root: Path, count: int, node_id: str, octet: int, user: str = USER):
        from tpufab.fanout import Fanout, Target
        from tpufab.hostkeys import KnownHosts, alias
        from tpufab.sim.workers import WorkerPool, WorkerSpec

        self.node_id = node_id
        self.user = user
        self.home = "/root" if user == "root" else f"/home/{user}"
        self.pool = WorkerPool(root / "state")
        key = root / "client"
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)],
                       check=True)
        sub = 20 + os.getpid() % 200
        specs = [WorkerSpec(node_id, w, f"127.{octet}.{sub}.{w + 1}",
                            f"t1v-n-{int(node_id):08x}-w-{w}", ACCEL) for w in range(count)]
        self.pool.start_node(node_id, specs,
                             f"{user}:{key.with_suffix('.pub').read_text().strip()}")
        try:
            self.pool.wait_listening(node_id, 60)
            known = KnownHosts(root / "known_hosts")
            known.pin(node_id, self.pool.host_keys(node_id))
            self.fanout = Fanout([Target(s.index, s.ip, user, str(key), 22,
                                         alias(node_id, s.index)) for s in specs],
                                 known_hosts=known)
        except BaseException:
            self.pool.stop_all()
            raise
        self.commands: list[str] = []

    # the Workers surface deploy and mount use, recording each command
    @property
    def workers(self) -> list[int]:
        return self.fanout.workers

    def run(self, command, **kw):
        self.commands.append(command)
        return self.fanout.run(command, **kw)

    def put(self, data, remote_path, **kw):
        return self.fanout.put(data, remote_path, **kw)

    # looking inside a worker without SSH, as the login user (or root)
    def sh(self, w: int, script: str, check: bool = True, as_root: bool = False) -> str:
        argv = ["sh", "-c", script]
        env = None
        if not as_root:
            argv = ["runuser", "-u", self.user, "--", *argv]
            env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "HOME": self.home,
                   "LANG": "C.UTF-8"}
        proc = self.pool.exec_in(self.node_id, w, argv, **({"env": env} if env else {}))
        if check and proc.returncode != 0:
            raise AssertionError(f"w{w}: {script!r} failed: {proc.stderr}")
        return proc.stdout.strip()

    def read(self, w: int, path: str) -> str:
        return self.sh(w, f"cat {path}")

    def git(self, w: int, dir: str, *args: str) -> str:
        return self.sh(w, "cd " + dir + " && git " + " ".join(args))

    def close(self) -> None:
        self.fanout.close()
        self.pool.stop_all()


@pytest.fixture(scope="module")
def pod(tmp_path_factory) -> SimPod:
    if os.geteuid() != 0:
        pytest.skip("the simulated pod needs root (sshd workers in namespaces)")
    pod = SimPod(tmp_path_factory.mktemp("pod"), 4, "7101", 61)
    try:
        yield pod
    finally:
        pod.close()


@pytest.fixture
def daemon(tmp_path: Path):
    """`git daemon` serving tmp/srv on a free loopback port; yields (base, URL)."""
    base = tmp_path / "srv"
    base.mkdir()
    with git_daemon(base) as url:
        yield base, url


class _SmartHttp(BaseHTTPRequestHandler):
    """`git http-backend` behind HTTP basic auth: a private remote that wants a token."""

    def _serve(self) -> None:
        expected = "Basic " + base64.b64encode(f"x-access-token:{self.server.token}".encode()
                                               ).decode()
        if self.headers.get("Authorization") != expected:
            self.send_response(401)
            self.send_header("WWW-Authenticate", 'Basic realm="tpufab-test"')
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        path, _, query = self.path.partition("?")
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        env = {"GIT_PROJECT_ROOT": str(self.server.root), "GIT_HTTP_EXPORT_ALL": "1",
               "PATH_INFO": path, "QUERY_STRING": query, "REQUEST_METHOD": self.command,
               "CONTENT_TYPE": self.headers.get("Content-Type", ""),
               "CONTENT_LENGTH": str(len(body)), "REMOTE_USER": "x-access-token",
               "PATH": os.environ["PATH"]}
        if self.headers.get("Git-Protocol"):
            env["GIT_PROTOCOL"] = self.headers["Git-Protocol"]
        out = subprocess.run(["git", "http-backend"], input=body, env=env,
                             capture_output=True).stdout
        head, _, payload = out.partition(b"\r\n\r\n")
        headers = [line.split(": ", 1) for line in head.decode().split("\r\n") if line]
        status = next((int(v.split()[0]) for k, v in headers if k == "Status"), 200)
        self.send_response(status)
        for key, value in headers:
            if key != "Status":
                self.send_header(key, value)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    do_GET = do_POST = _serve

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def private_remote(daemon):
    """An HTTP remote over the same bare repositories that answers only with the token."""
    base, _ = daemon
    server = ThreadingHTTPServer(("127.0.0.1", 0), _SmartHttp)
    server.root, server.token, server.daemon_threads = base, "s3cr3t-" + os.urandom(6).hex(), True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", server.token
    finally:
        server.shutdown()
        server.server_close()


NAMES = itertools.count()


@pytest.fixture
def repo(tmp_path: Path, daemon) -> Path:
    """The user's checkout (a fresh name per test, so each deploys to its own ~/NAME on the
    shared pod), with origin = a bare repository behind git daemon."""
    base, url = daemon
    name = f"proj{next(NAMES)}"
    sh(base, "git", "init", "-q", "--bare", "-b", "main", f"{name}.git")
    root = tmp_path / "user" / name
    root.mkdir(parents=True)
    sh(root, "git", "init", "-q", "-b", "main")
    (root / "train.py").write_text("print('v1')\n")
    (root / ".gitignore").write_text("*.log\n")
    sh(root, "git", "add", ".")
    sh(root, "git", "commit", "-q", "-m", "v1")
    sh(root, "git", "remote", "add", "origin", f"{url}/{name}.git")
    return root


def commit(root: Path, name: str, text: str) -> str:
    (root / name).write_text(text)
    sh(root, "git", "add", name)
    sh(root, "git", "commit", "-q", "-m", f"edit {name}")
    return sh(root, "git", "rev-parse", "HEAD")


def test_fresh_clone_update_noop(repo: Path, pod: SimPod):
    head = sh(repo, "git", "rev-parse", "HEAD")
    where = f"~/{repo.name}"
    report = deploy(pod, cwd=repo)
    assert report.dir == where and report.pushed == "pushed" and report.commit == head
    assert [(r.worker, r.action, r.commit) for r in report.rows] == [
        (w, "clone", head) for w in range(4)]
    for w in pod.workers:
        assert pod.git(w, where, "rev-parse", "HEAD") == head
        assert pod.git(w, where, "rev-parse", "--abbrev-ref", "HEAD") == "main"
        assert pod.read(w, f"{where}/train.py") == "print('v1')"
        # the checkout's origin is the remote, so `git pull` by hand works too
        assert pod.git(w, where, "remote", "get-url", "origin").endswith(f"/{repo.name}.git")
    assert "changed" in report.table() and "FAILED" not in report.table()

    new = commit(repo, "train.py", "print('v2')\n")
    report = deploy(pod, cwd=repo)
    assert {(r.action, r.before, r.commit) for r in report.rows} == {("update", head, new)}
    assert pod.read(2, f"{where}/train.py") == "print('v2')"

    report = deploy(pod, cwd=repo)
    assert report.pushed == "up to date"
    assert {r.action for r in report.rows} == {"noop"} and not any(r.changed for r in report.rows)
    assert "unchanged" in report.table()


def test_submodules_and_explicit_dir(repo: Path, pod: SimPod, daemon):
    base, url = daemon
    lib = f"lib{next(NAMES)}"
    sh(base, "git", "init", "-q", "--bare", "-b", "main", f"{lib}.git")
    work = repo.parent / lib
    work.mkdir()
    sh(work, "git", "init", "-q", "-b", "main")
    (work / "util.py").write_text("X = 1\n")
    sh(work, "git", "add", ".")
    sh(work, "git", "commit", "-q", "-m", "lib")
    sh(work, "git", "push", "-q", str(base / f"{lib}.git"), "main")
    sh(repo, "git", "submodule", "add", "-q", f"{url}/{lib}.git", "lib")
    sh(repo, "git", "commit", "-q", "-m", "add lib")
    where = f"/tmp/{repo.name} here"  # any path (each worker has its own /tmp), spaces too
    report = deploy(pod, cwd=repo, dir=where)
    assert report.dir == where
    assert pod.read(1, f"'{where}/lib/util.py'") == "X = 1"


def test_other_ref_is_checked_out_detached(repo: Path, pod: SimPod):
    first = sh(repo, "git", "rev-parse", "HEAD")
    commit(repo, "train.py", "print('v2')\n")
    sh(repo, "git", "tag", "old", first)
    report = deploy(pod, cwd=repo, ref="old")
    assert {r.commit for r in report.rows} == {first}
    assert pod.git(0, f"~/{repo.name}", "rev-parse", "--abbrev-ref", "HEAD") == "HEAD"


def tree_state(root: Path) -> dict[str, str]:
    state = {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
             for p in sorted(root.rglob("*")) if p.is_file() and ".git" not in p.parts}
    state["<index>"] = hashlib.sha256((root / ".git" / "index").read_bytes()).hexdigest()
    state["<HEAD>"] = (root / ".git" / "HEAD").read_text()
    state["<refs>"] = sh(root, "git", "for-each-ref", "refs/heads", "refs/remotes")
    return state


def test_dirty_tree_refused_and_wip(repo: Path, pod: SimPod, daemon):
    (repo / "train.py").write_text("print('edited')\n")
    (repo / "notes.txt").write_text("untracked\n")
    (repo / "run.log").write_text("ignored\n")
    with pytest.raises(GitError, match="uncommitted changes.*--wip"):
        deploy(pod, cwd=repo)
    before = tree_state(repo)
    report = deploy(pod, cwd=repo, wip=True)
    assert tree_state(repo) == before  # branch, index and files byte-for-byte
    assert report.wip_ref == "refs/tpufab/wip/1"
    where = f"~/{repo.name}"
    assert pod.read(3, f"{where}/train.py") == "print('edited')"
    assert pod.read(3, f"{where}/notes.txt") == "untracked"
    assert pod.sh(3, f"test -e {where}/run.log", check=False) == ""
    assert "run.log" not in pod.sh(3, f"ls {where}")
    # the snapshot went to a side ref on the remote, never to the user's branch
    base, _ = daemon
    remote_refs = sh(base / f"{repo.name}.git", "git", "for-each-ref", "--format=%(refname)")
    assert "refs/tpufab/wip/1" in remote_refs and "refs/heads/main" not in remote_refs
    again = deploy(pod, cwd=repo, wip=True)
    assert again.commit == report.commit and {r.action for r in again.rows} == {"noop"}


def test_direct_needs_no_remote(repo: Path, pod: SimPod):
    sh(repo, "git", "remote", "set-url", "origin", dead_url())
    head = sh(repo, "git", "rev-parse", "HEAD")
    where = f"~/{repo.name}"
    report = deploy(pod, cwd=repo, direct=True)
    assert report.pushed is None
    assert {(r.action, r.commit) for r in report.rows} == {("clone", head)}
    new = commit(repo, "train.py", "print('v2')\n")
    report = deploy(pod, cwd=repo, direct=True)
    assert {(r.action, r.commit) for r in report.rows} == {("update", new)}
    assert pod.read(0, f"{where}/train.py") == "print('v2')"
    assert pod.sh(0, "ls ~/.cache/tpufab/remote/*/ | grep -c bundle", check=False) == "0"
    report = deploy(pod, cwd=repo, direct=True)
    assert {r.action for r in report.rows} == {"noop"}


def test_one_round_trip_once_the_script_is_there(repo: Path, pod: SimPod):
    deploy(pod, cwd=repo)
    assert pod.sh(0, "ls ~/.cache/tpufab/remote/*/deploy_worker.py | wc -l") == "1"
    pod.commands.clear()
    commit(repo, "train.py", "print('v2')\n")
    deploy(pod, cwd=repo)
    # one round trip for the checkout itself (the code lease and the check for live runs
    # are their own short ones)
    assert len([c for c in pod.commands if " checkout " in c]) == 1


def test_not_a_repo(tmp_path: Path, pod: SimPod):
    with pytest.raises(GitError, match="is not inside a git repository"):
        deploy(pod, cwd=tmp_path)


def test_no_remote(repo: Path, pod: SimPod):
    with pytest.raises(GitError, match="No git remote named 'upstream'"):
        deploy(pod, cwd=repo, remote="upstream")


def test_push_rejected(repo: Path, pod: SimPod, daemon, tmp_path: Path):
    deploy(pod, cwd=repo)
    _, url = daemon
    other = tmp_path / "other"
    sh(tmp_path, "git", "clone", "-q", f"{url}/{repo.name}.git", str(other))
    commit(other, "theirs.txt", "x")
    sh(other, "git", "push", "-q", "origin", "main")
    commit(repo, "mine.txt", "y")
    with pytest.raises(GitError, match="rejected.*non-fast-forward.*pull or rebase"):
        deploy(pod, cwd=repo)


def test_worker_cannot_reach_remote(repo: Path, pod: SimPod):
    with pytest.raises(DeployError) as err:
        deploy(pod, cwd=repo, worker_url=dead_url())
    assert "Workers w[0-3] cannot reach the remote git://127.0.0.1:" in str(err.value)
    assert "--direct" in str(err.value)
    assert err.value.details.count("unreachable") == 4


def test_disk_full_on_a_worker(repo: Path, pod: SimPod):
    commit(repo, "big.bin", os.urandom(512 * 1024).hex())
    for w in pod.workers:
        pod.sh(w, "mkdir -p ~/tiny")
    pod.sh(2, f"mount -t tmpfs -o size=64k,uid=$(id -u {USER}) tmpfs /home/{USER}/tiny",
           as_root=True)
    try:
        with pytest.raises(DeployError, match="Worker w2 ran out of disk space in ~/tiny") as err:
            deploy(pod, cwd=repo, dir=f"~/tiny/{repo.name}")
        assert "disk_full" in err.value.details
        # the workers that had room are at the commit; w2 is not
        head = sh(repo, "git", "rev-parse", "HEAD")
        assert pod.git(0, f"~/tiny/{repo.name}", "rev-parse", "HEAD").strip() == head
    finally:
        pod.sh(2, f"umount /home/{USER}/tiny", as_root=True)


def test_divergent_commits_detected(repo: Path, pod: SimPod):
    first = sh(repo, "git", "rev-parse", "HEAD")
    deploy(pod, cwd=repo)
    # something on worker 1 moves the checkout back right after every checkout
    hook = f"~/{repo.name}/.git/hooks/post-checkout"
    pod.sh(1, f"printf '#!/bin/sh\\n[ $(git rev-parse HEAD) = {first} ] || "
              f"git checkout -q --detach {first}\\n' > {hook} && chmod +x {hook}")
    new = commit(repo, "train.py", "print('v2')\n")
    with pytest.raises(DeployError, match=r"Workers disagree.*w1 .*at " + first[:12]) as err:
        deploy(pod, cwd=repo)
    assert new[:12] in str(err.value)


def test_worker_dir_in_the_way(repo: Path, pod: SimPod):
    pod.sh(0, f"mkdir ~/{repo.name} && echo precious > ~/{repo.name}/data.bin")
    with pytest.raises(DeployError, match=f"Worker w0 already has ~/{repo.name} and it is not"):
        deploy(pod, cwd=repo)
    assert pod.read(0, f"~/{repo.name}/data.bin") == "precious"


def test_failure_sentence_and_fold():
    rows = [deploy_mod.WorkerDeploy(w, False, error="unreachable", message="x") for w in (0, 1, 2, 5)]
    rows.append(deploy_mod.WorkerDeploy(6, False, error="disk_full", message="y"))
    text = deploy_mod.failure_sentence(rows, source="git://r", dir="~/p", commit="a" * 40)
    assert text.startswith("Workers w[0-2,5] cannot reach the remote git://r")
    assert text.endswith("(1 more failed otherwise; see below.)")


def test_worker_command_is_data():
    args = deploy_mod.worker_command(dir="~/p q", source="git://h/p.git", commit="c" * 40,
                                     fetch_ref="refs/heads/main", branch="main",
                                     origin="git://h/p.git")
    assert args == ["checkout", "--dir", "~/p q", "--source", "git://h/p.git", "--commit",
                    "c" * 40, "--fetch-ref", "refs/heads/main", "--branch", "main",
                    "--origin", "git://h/p.git"]
    command = python_command(RemoteFile.bundled("deploy_worker.py"), args)
    assert "'~/p q'" in command and command.startswith("test -f .cache/tpufab/remote/")


def test_a_script_from_stdin_needs_nothing_on_disk():
    """What runs where the disk is too full to ship a script (kill, status): no guard, no
    path, `python3 -` reads the source from stdin, as root through sudo where asked."""
    from tpufab.killing import kill_command

    shipped = RemoteFile.bundled("tpukill.py")
    command = kill_command(grace=1, from_stdin=True)
    assert "exit 97" not in command and shipped.path not in command
    assert "then exec sudo -n python3 -I -S - --grace 1 " in command
    assert python_command(shipped, ["a b"], from_stdin=True) == "exec python3 -I -S - 'a b'"


def test_private_remote_with_a_token(repo: Path, pod: SimPod, private_remote):
    url, token = private_remote
    http_url = f"{url}/{repo.name}.git"
    with pytest.raises(DeployError, match=r"refused workers w\[0-3\] \(authentication failed\)"):
        deploy(pod, cwd=repo, worker_url=http_url)  # no token: refused
    report = deploy(pod, cwd=repo, worker_url=http_url, token=token)
    assert {r.commit for r in report.rows} == {sh(repo, "git", "rev-parse", "HEAD")}
    where = f"~/{repo.name}"
    assert pod.git(2, where, "remote", "get-url", "origin") == http_url
    # the token went through the environment only: nothing on the worker's disk has it
    for w in pod.workers:
        assert pod.sh(w, f"grep -rl {token} ~ /tmp || true") == ""
    with pytest.raises(DeployError, match="authentication failed") as err:
        commit(repo, "train.py", "print('v2')\n")
        deploy(pod, cwd=repo, worker_url=http_url, token="wrong")
    assert token not in str(err.value) + err.value.details


def test_unreachable_worker_is_named_and_the_others_deploy(repo: Path, pod: SimPod):
    from tpufab.fanout import Fanout

    pod.pool.set_reachable(pod.node_id, 3, False)
    try:
        with Fanout(list(pod.fanout.targets.values()), known_hosts=pod.fanout.known_hosts,
                    connect_attempts=1, connect_timeout=5) as fresh:
            with pytest.raises(DeployError, match=r"Worker w3 could not run the deploy step "
                                                  r"over SSH") as err:
                deploy(fresh, cwd=repo)
        assert "connection refused" in err.value.details
        assert err.value.details.count("changed") == 3
    finally:
        pod.pool.set_reachable(pod.node_id, 3, True)
