"""Deploy against a real remote: a bare repository served by `git daemon` on loopback, which
workers fetch from over the network."""

from __future__ import annotations

import hashlib
import os
import shutil
import socket
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from tpufab import deploy as deploy_mod
from tpufab.deploy import DeployError, deploy
from tpufab.gitops import GitError

GIT_ENV = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t"}


def sh(cwd: Path, *argv: str) -> str:
    return subprocess.run(argv, cwd=cwd, check=True, capture_output=True, text=True,
                          env={**os.environ, **GIT_ENV}).stdout.strip()


def wait_for(condition, timeout: float = 10.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def dead_url() -> str:
    return f"git://127.0.0.1:{free_port()}/gone.git"


# --- a transport that runs each "worker" as a separate home directory on this machine -------

@dataclass
class Result:
    exit_code: int | None
    stdout: str = ""
    stderr: str = ""
    error: str | None = None
    duration: float = 0.0


class LocalWorkers:
    """Workers as home directories here: the same `Workers` surface deploy uses, no SSH."""

    def __init__(self, homes: list[Path]):
        self.homes = homes
        self.commands: list[str] = []

    @property
    def ids(self) -> list[int]:
        return list(range(len(self.homes)))

    def _run_one(self, w: int, command: str, stdin: str | None) -> Result:
        env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
        env.update(HOME=str(self.homes[w]), **GIT_ENV)
        start = time.monotonic()
        proc = subprocess.run(["sh", "-c", command], cwd=self.homes[w], env=env, text=True,
                              input=stdin or "", capture_output=True)
        return Result(proc.returncode, proc.stdout, proc.stderr,
                      duration=time.monotonic() - start)

    def run(self, command, *, workers=None, stdin=None):
        self.commands.append(command)
        ids = self.ids if workers is None else list(workers)
        with ThreadPoolExecutor(max(1, len(ids))) as pool:
            return dict(zip(ids, pool.map(lambda w: self._run_one(w, command, stdin), ids),
                            strict=True))

    def put(self, local, remote, *, workers=None):
        out = {}
        for w in self.ids if workers is None else workers:
            target = self.homes[w] / remote
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(local, target)
            out[w] = Result(0)
        return out

    def git(self, w: int, *args: str) -> str:
        return sh(self.homes[w] / "proj", "git", *args)


@pytest.fixture
def daemon(tmp_path: Path):
    """`git daemon` serving tmp/srv on a free loopback port; yields its base URL."""
    base = tmp_path / "srv"
    base.mkdir()
    port = free_port()
    proc = subprocess.Popen(
        ["git", "daemon", "--export-all", "--enable=receive-pack", f"--base-path={base}",
         "--listen=127.0.0.1", f"--port={port}", "--reuseaddr", str(base)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def listening():
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return True
        except OSError:
            return False

    try:
        wait_for(listening, what="git daemon")
        yield base, f"git://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(timeout=10)


@pytest.fixture
def repo(tmp_path: Path, daemon) -> Path:
    """The user's checkout, with origin = the bare repository behind git daemon."""
    base, url = daemon
    sh(base, "git", "init", "-q", "--bare", "-b", "main", "proj.git")
    root = tmp_path / "user" / "proj"
    root.mkdir(parents=True)
    sh(root, "git", "init", "-q", "-b", "main")
    (root / "train.py").write_text("print('v1')\n")
    (root / ".gitignore").write_text("*.log\n")
    sh(root, "git", "add", ".")
    sh(root, "git", "commit", "-q", "-m", "v1")
    sh(root, "git", "remote", "add", "origin", f"{url}/proj.git")
    return root


@pytest.fixture
def pod(tmp_path: Path) -> LocalWorkers:
    homes = [tmp_path / f"w{i}" for i in range(4)]
    for home in homes:
        home.mkdir()
    return LocalWorkers(homes)


def commit(root: Path, name: str, text: str) -> str:
    (root / name).write_text(text)
    sh(root, "git", "add", name)
    sh(root, "git", "commit", "-q", "-m", f"edit {name}")
    return sh(root, "git", "rev-parse", "HEAD")


def test_fresh_clone_update_noop(repo: Path, pod: LocalWorkers):
    head = sh(repo, "git", "rev-parse", "HEAD")
    report = deploy(pod, cwd=repo, dir="~/proj")
    assert report.pushed == "pushed" and report.commit == head
    assert [(r.worker, r.action, r.commit) for r in report.rows] == [
        (w, "clone", head) for w in range(4)]
    for w in pod.ids:
        assert pod.git(w, "rev-parse", "HEAD") == head
        assert pod.git(w, "rev-parse", "--abbrev-ref", "HEAD") == "main"
        assert (pod.homes[w] / "proj" / "train.py").read_text() == "print('v1')\n"
        # the checkout's origin is the remote, so `git pull` by hand works too
        assert pod.git(w, "remote", "get-url", "origin").endswith("/proj.git")
    assert "changed" in report.table() and "FAILED" not in report.table()

    new = commit(repo, "train.py", "print('v2')\n")
    report = deploy(pod, cwd=repo, dir="~/proj")
    assert {(r.action, r.before, r.commit) for r in report.rows} == {("update", head, new)}
    assert (pod.homes[2] / "proj" / "train.py").read_text() == "print('v2')\n"

    report = deploy(pod, cwd=repo, dir="~/proj")
    assert report.pushed == "up to date"
    assert {r.action for r in report.rows} == {"noop"} and not any(r.changed for r in report.rows)
    assert "unchanged" in report.table()


def test_default_dir_is_repo_name_and_submodules(repo: Path, pod: LocalWorkers, daemon):
    base, url = daemon
    lib = base / "lib.git"
    sh(base, "git", "init", "-q", "--bare", "-b", "main", "lib.git")
    work = repo.parent / "lib"
    work.mkdir()
    sh(work, "git", "init", "-q", "-b", "main")
    (work / "util.py").write_text("X = 1\n")
    sh(work, "git", "add", ".")
    sh(work, "git", "commit", "-q", "-m", "lib")
    sh(work, "git", "push", "-q", str(lib), "main")
    sh(repo, "git", "-c", "protocol.file.allow=always", "submodule", "add", "-q",
       f"{url}/lib.git", "lib")
    sh(repo, "git", "commit", "-q", "-m", "add lib")
    report = deploy(pod, cwd=repo)
    assert report.dir == "~/proj"
    assert (pod.homes[1] / "proj" / "lib" / "util.py").read_text() == "X = 1\n"


def test_checkout_other_ref_detached(repo: Path, pod: LocalWorkers):
    first = sh(repo, "git", "rev-parse", "HEAD")
    commit(repo, "train.py", "print('v2')\n")
    sh(repo, "git", "tag", "old", first)
    report = deploy(pod, cwd=repo, ref="old", dir="~/proj")
    assert {r.commit for r in report.rows} == {first}
    assert pod.git(0, "rev-parse", "--abbrev-ref", "HEAD") == "HEAD"  # detached


def tree_state(root: Path) -> dict[str, str]:
    state = {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
             for p in sorted(root.rglob("*")) if p.is_file() and ".git" not in p.parts}
    state["<index>"] = hashlib.sha256((root / ".git" / "index").read_bytes()).hexdigest()
    state["<HEAD>"] = (root / ".git" / "HEAD").read_text()
    state["<refs>"] = sh(root, "git", "for-each-ref", "refs/heads", "refs/remotes")
    return state


def test_dirty_tree_refused_and_wip(repo: Path, pod: LocalWorkers, daemon):
    (repo / "train.py").write_text("print('edited')\n")
    (repo / "notes.txt").write_text("untracked\n")
    (repo / "run.log").write_text("ignored\n")
    with pytest.raises(GitError, match="uncommitted changes.*--wip"):
        deploy(pod, cwd=repo, dir="~/proj")
    before = tree_state(repo)
    report = deploy(pod, cwd=repo, dir="~/proj", wip=True)
    assert tree_state(repo) == before  # branch, index and files byte-for-byte
    assert report.wip_ref == "refs/tpufab/wip/1"
    checkout = pod.homes[3] / "proj"
    assert (checkout / "train.py").read_text() == "print('edited')\n"
    assert (checkout / "notes.txt").read_text() == "untracked\n"
    assert not (checkout / "run.log").exists()
    # the snapshot went to a side ref on the remote, never to the user's branch
    base, _ = daemon
    remote_refs = sh(base / "proj.git", "git", "for-each-ref", "--format=%(refname)")
    assert "refs/tpufab/wip/1" in remote_refs and "refs/heads/main" not in remote_refs
    again = deploy(pod, cwd=repo, dir="~/proj", wip=True)
    assert again.commit == report.commit and {r.action for r in again.rows} == {"noop"}


def test_direct_needs_no_remote(repo: Path, pod: LocalWorkers):
    sh(repo, "git", "remote", "set-url", "origin", dead_url())
    head = sh(repo, "git", "rev-parse", "HEAD")
    report = deploy(pod, cwd=repo, dir="~/proj", direct=True)
    assert report.pushed is None
    assert {(r.action, r.commit) for r in report.rows} == {("clone", head)}
    new = commit(repo, "train.py", "print('v2')\n")
    report = deploy(pod, cwd=repo, dir="~/proj", direct=True)
    assert {(r.action, r.commit) for r in report.rows} == {("update", new)}
    assert (pod.homes[0] / "proj" / "train.py").read_text() == "print('v2')\n"
    # bundles are removed after use
    assert not list(pod.homes[0].glob(".cache/tpufab/remote/*/*.bundle"))
    report = deploy(pod, cwd=repo, dir="~/proj", direct=True)
    assert {r.action for r in report.rows} == {"noop"}


def test_script_shipped_once(repo: Path, pod: LocalWorkers):
    deploy(pod, cwd=repo, dir="~/proj")
    shipped = list(pod.homes[0].glob(".cache/tpufab/remote/*/deploy_worker.py"))
    assert len(shipped) == 1
    pod.commands.clear()
    commit(repo, "train.py", "print('v2')\n")
    deploy(pod, cwd=repo, dir="~/proj")
    assert len(pod.commands) == 1  # one round trip per worker once the script is there


def test_not_a_repo(tmp_path: Path, pod: LocalWorkers):
    with pytest.raises(GitError, match="is not inside a git repository"):
        deploy(pod, cwd=tmp_path)


def test_no_remote(repo: Path, pod: LocalWorkers):
    with pytest.raises(GitError, match="No git remote named 'upstream'"):
        deploy(pod, cwd=repo, remote="upstream")


def test_push_rejected(repo: Path, pod: LocalWorkers, daemon, tmp_path: Path):
    deploy(pod, cwd=repo, dir="~/proj")
    _, url = daemon
    other = tmp_path / "other"
    sh(tmp_path, "git", "clone", "-q", f"{url}/proj.git", str(other))
    commit(other, "theirs.txt", "x")
    sh(other, "git", "push", "-q", "origin", "main")
    commit(repo, "mine.txt", "y")
    with pytest.raises(GitError, match="rejected.*non-fast-forward.*pull or rebase"):
        deploy(pod, cwd=repo, dir="~/proj")


def test_worker_cannot_reach_remote(repo: Path, pod: LocalWorkers):
    with pytest.raises(DeployError) as err:
        deploy(pod, cwd=repo, dir="~/proj", worker_url=dead_url())
    assert "Workers w[0-3] cannot reach the remote" in str(err.value)
    assert "--direct" in str(err.value)
    assert err.value.details.count("unreachable") == 4


def test_disk_full_on_a_worker(repo: Path, pod: LocalWorkers):
    commit(repo, "big.bin", os.urandom(512 * 1024).hex())
    tiny = pod.homes[2] / "tiny"
    tiny.mkdir()
    mount = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(tiny)])
    if mount.returncode != 0:
        pytest.skip("needs root to mount a small tmpfs")
    try:
        for w in pod.ids:
            (pod.homes[w] / "tiny").mkdir(exist_ok=True)
        with pytest.raises(DeployError, match="Worker w2 ran out of disk space") as err:
            deploy(pod, cwd=repo, dir="~/tiny/proj")
        assert "disk_full" in err.value.details
        assert sh(pod.homes[0] / "tiny" / "proj", "git", "rev-parse", "HEAD")
    finally:
        subprocess.run(["umount", str(tiny)], check=True)


def test_divergent_commits_detected(repo: Path, pod: LocalWorkers):
    first = sh(repo, "git", "rev-parse", "HEAD")
    deploy(pod, cwd=repo, dir="~/proj")
    # something on worker 1 moves the checkout back right after every checkout
    hook = pod.homes[1] / "proj" / ".git" / "hooks" / "post-checkout"
    hook.write_text(f'#!/bin/sh\n[ "$(git rev-parse HEAD)" = {first} ] || '
                    f'git checkout -q --detach {first}\n')
    hook.chmod(0o755)
    new = commit(repo, "train.py", "print('v2')\n")
    with pytest.raises(DeployError, match=r"Workers disagree.*w1 .*at " + first[:12]) as err:
        deploy(pod, cwd=repo, dir="~/proj")
    assert new[:12] in str(err.value)


def test_worker_dir_in_the_way(repo: Path, pod: LocalWorkers):
    (pod.homes[0] / "proj").mkdir()
    (pod.homes[0] / "proj" / "data.bin").write_text("precious")
    with pytest.raises(DeployError, match="Worker w0 already has ~/proj and it is not a git"):
        deploy(pod, cwd=repo, dir="~/proj")
    assert (pod.homes[0] / "proj" / "data.bin").read_text() == "precious"


def test_failure_sentence_and_fold():
    rows = [deploy_mod.WorkerDeploy(w, False, error="unreachable", message="x") for w in (0, 1, 2, 5)]
    rows.append(deploy_mod.WorkerDeploy(6, False, error="disk_full", message="y"))
    text = deploy_mod.failure_sentence(rows, source="git://r", dir="~/p", commit="a" * 40)
    assert text.startswith("Workers w[0-2,5] cannot reach the remote git://r")
    assert text.endswith("(1 more failed otherwise; see below.)")
    assert deploy_mod.fold([3]) == "w3"


def test_worker_command_is_data():
    args = deploy_mod.worker_command(dir="~/p q", source="git://h/p.git", commit="c" * 40,
                                     fetch_ref="refs/heads/main", branch="main",
                                     origin="git://h/p.git", token=True)
    assert args == ["checkout", "--dir", "~/p q", "--source", "git://h/p.git", "--commit",
                    "c" * 40, "--fetch-ref", "refs/heads/main", "--branch", "main",
                    "--origin", "git://h/p.git", "--token-stdin"]
    command = deploy_mod.script_command("deploy_worker.py", args)
    assert "'~/p q'" in command and command.startswith("test -f .cache/tpufab/remote/")
