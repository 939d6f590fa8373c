"""Deploy against a real remote: a bare repository served by `git daemon` on loopback, which
workers fetch from over the network."""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import os
import shlex
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
from gitremote import Recorder, SmartHttp, make_tls, serving, token_remote
from gitremote import trust as trust_on_workers
from harness import USER, SimPod, needs_root
from helpers import WORKER_PYTHON, free_port, git_daemon, sh, shipped

from tpufab.errors import ConfigError
from tpufab.reports import text
from tpufab.ssh.remote_files import RemoteFile, python_command, read_answer, verify_loader
from tpufab.steps.code import deploy as deploy_mod
from tpufab.steps.code.deploy import DeployError, deploy
from tpufab.steps.code.gitops import GitError


def dead_url() -> str:
    return f"git://127.0.0.1:{free_port()}/gone.git"


@pytest.fixture(scope="module")
@needs_root
def pod(tmp_path_factory) -> SimPod:
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


@pytest.fixture(scope="module")
def tls(tmp_path_factory) -> SimpleNamespace:
    """A self-signed certificate for 127.0.0.1 and 127.0.0.2 (``cert``, ``key``, ``pem``)."""
    return make_tls(tmp_path_factory.mktemp("tls"))


@pytest.fixture
def private_server(daemon, tls):
    """An HTTPS remote over the same bare repositories that answers only with the token."""
    base, _ = daemon
    with token_remote(base, tls) as server:
        yield server


@pytest.fixture
def private_remote(private_server):
    """(its URL, its token)"""
    return private_server.url, private_server.token


def trust(pod: SimPod, tls: SimpleNamespace) -> None:
    """The workers' git trusts the test certificate (as a private CA would be set up)."""
    trust_on_workers(pod.sh, pod.workers, tls)


def test_the_token_goes_only_to_origin_over_https(daemon, tls, monkeypatch):
    """The worker's credential helper, driven by real git: origin (https) gets the token; the
    same host over http, another host, another port (a .gitmodules URL) get nothing."""
    from tpufab.remote import deploy_worker

    base, _ = daemon
    sh(base, "git", "init", "-q", "--bare", "-b", "main", "cred.git")
    monkeypatch.setenv("GIT_SSL_CAINFO", str(tls.cert))
    token = "ghp_" + os.urandom(8).hex()
    with contextlib.ExitStack() as stack:
        origin = stack.enter_context(serving(SmartHttp, tls=tls, root=base, token=token))
        others = [stack.enter_context(serving(Recorder, host, tls=t, seen=[]))
                  for host, t in (("127.0.0.2", tls), ("127.0.0.1", tls), ("127.0.0.1", None))]
        git = deploy_worker.Git(token, f"{origin.url}/cred.git")
        assert git.ok("ls-remote", f"{origin.url}/cred.git")          # origin: the token works
        for other in others:
            assert not git.ok("ls-remote", f"{other.url}/x.git"), other.url
            assert other.seen and not any(other.seen), (other.url, other.seen)  # asked; no answer
        # a token for an http origin is offered to no one, origin included
        plain = deploy_worker.Git(token, f"{others[2].url}/x.git")
        assert not plain.ok("ls-remote", f"{others[2].url}/x.git")
        assert not any(others[2].seen)
    # the helper's own decision, as git asks it (protocol and host on stdin)
    helper = deploy_worker.CREDENTIAL_HELPER[1:]
    env = {**os.environ, "TPUFAB_GIT_TOKEN": token, "TPUFAB_GIT_HOST": "git.example:8443"}
    for request, answers in ((b"protocol=https\nhost=git.example:8443\n", True),
                             (b"protocol=http\nhost=git.example:8443\n", False),
                             (b"protocol=https\nhost=evil.example\n", False),
                             (b"protocol=https\nhost=git.example\n", False)):
        out = subprocess.run(["sh", "-c", helper + " get", "helper"], input=request, env=env,
                             capture_output=True, check=True).stdout.decode()
        assert (f"password={token}" in out) is answers and (out == "") is not answers, request


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


@pytest.mark.sim
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
    assert all(r.changed for r in report.rows) and report.ok
    [line] = text(report)                                      # the one renderer, as text
    assert line.startswith(f"w[0-3]  {head[:12]}  clone  ")

    new = commit(repo, "train.py", "print('v2')\n")
    report = deploy(pod, cwd=repo)
    assert {(r.action, r.before, r.commit) for r in report.rows} == {("update", head, new)}
    assert pod.read(2, f"{where}/train.py") == "print('v2')"

    report = deploy(pod, cwd=repo)
    assert report.pushed == "up to date"
    assert {r.action for r in report.rows} == {"noop"} and not any(r.changed for r in report.rows)
    assert report.summary.endswith(f"every worker was already there ({report.seconds:.1f}s).")


@pytest.mark.sim
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


@pytest.mark.sim
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


@pytest.mark.sim
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


@pytest.mark.sim
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


@pytest.mark.sim
def test_one_round_trip_once_the_script_is_there(repo: Path, pod: SimPod):
    deploy(pod, cwd=repo)
    assert pod.sh(0, "ls ~/.cache/tpufab/remote/*/deploy_worker.py | wc -l") == "1"
    pod.commands.clear()
    commit(repo, "train.py", "print('v2')\n")
    deploy(pod, cwd=repo)
    # one round trip for the checkout itself (the code lease and the check for live runs
    # are their own short ones)
    assert len([c for c in pod.commands if " checkout " in c]) == 1


@pytest.mark.sim
def test_not_a_repo(tmp_path: Path, pod: SimPod):
    with pytest.raises(GitError, match="is not inside a git repository"):
        deploy(pod, cwd=tmp_path)


@pytest.mark.sim
def test_no_remote(repo: Path, pod: SimPod):
    with pytest.raises(GitError, match="No git remote named 'upstream'"):
        deploy(pod, cwd=repo, remote="upstream")


@pytest.mark.sim
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


@pytest.mark.sim
def test_worker_cannot_reach_remote(repo: Path, pod: SimPod):
    with pytest.raises(DeployError) as err:
        deploy(pod, cwd=repo, worker_url=dead_url())
    assert "Workers w[0-3] cannot reach the remote git://127.0.0.1:" in str(err.value)
    assert "--direct" in str(err.value)
    # every worker's outcome, folded by the one renderer: the four failed alike
    assert err.value.details.startswith("w[0-3]  failed: unreachable: ")


@pytest.mark.sim
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


@pytest.mark.sim
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


@pytest.mark.sim
def test_worker_dir_in_the_way(repo: Path, pod: SimPod):
    pod.sh(0, f"mkdir ~/{repo.name} && echo precious > ~/{repo.name}/data.bin")
    with pytest.raises(DeployError, match=f"Worker w0 already has ~/{repo.name} and it is not"):
        deploy(pod, cwd=repo)
    assert pod.read(0, f"~/{repo.name}/data.bin") == "precious"


def test_failure_sentence_and_fold():
    rows = [deploy_mod.DeployRow(w, False, error="unreachable", message="x") for w in (0, 1, 2, 5)]
    rows.append(deploy_mod.DeployRow(6, False, error="disk_full", message="y"))
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
    shipped = RemoteFile.bundled("deploy_worker.py")
    command = python_command(shipped, args)
    assert "'~/p q'" in command and command.startswith(
        f"exec python3 -I -S -c {shlex.quote(verify_loader())} 1 {shipped.sha256} {shipped.path} "
        "checkout ")


def test_a_script_from_stdin_needs_nothing_on_disk():
    """What runs where the disk is too full to ship a script (kill, status): no guard, no
    path, `python3 -` reads the source from stdin, as root through sudo where asked."""
    from tpufab.steps.host.killing import kill_command

    shipped = RemoteFile.bundled("kill_worker.py")
    command = kill_command(grace=1, from_stdin=True)
    assert "exit 97" not in command and shipped.path not in command
    assert "then exec sudo -n python3 -I -S - --grace 1 " in command
    assert python_command(shipped, ["a b"], from_stdin=True) == "exec python3 -I -S - 'a b'"


@pytest.mark.sim
def test_private_remote_with_a_token(repo: Path, pod: SimPod, private_remote, tls):
    url, token = private_remote
    trust(pod, tls)
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


@pytest.mark.sim
def test_credentials_in_the_origin_url_never_reach_a_worker(repo: Path, pod: SimPod,
                                                            private_server, tls, monkeypatch):
    """origin = https://x-access-token:TOKEN@host/r.git (as CI tools write it): workers fetch
    the URL without userinfo and get the token through the credential helper; no worker argv
    (sampled while each request of theirs waits), .git/config or tpufab output holds it."""
    url, token = private_server.url, private_server.token
    trust(pod, tls)
    monkeypatch.setenv("GIT_SSL_CAINFO", str(tls.cert))        # the local push trusts it too
    clean = f"{url}/{repo.name}.git"
    sh(repo, "git", "remote", "set-url", "origin",
       clean.replace("://", f"://x-access-token:{token}@"))
    argv: list[str] = []
    scan = "for f in /proc/[0-9]*/cmdline; do tr '\\0' ' ' < $f; echo; done"
    said: list[str] = []

    def sample() -> None:
        argv.extend(pod.sh(w, scan, as_root=True, check=False) for w in pod.workers)

    private_server.on_request = sample
    try:
        report = deploy(pod, cwd=repo, progress=said.append)
    finally:
        private_server.on_request = None
    assert {r.commit for r in report.rows} == {sh(repo, "git", "rev-parse", "HEAD")}
    assert any("deploy_worker" in a for a in argv)              # sampled during the checkout
    assert not any(token in a for a in argv)
    for w in pod.workers:
        assert pod.git(w, f"~/{repo.name}", "remote", "get-url", "origin") == clean
        assert token not in pod.sh(w, f"cat ~/{repo.name}/.git/config")
    assert token not in " ".join(said) + "\n".join(text(report)) + report.summary
    # credentials over plain http: refused in one sentence, before anything is sent
    with pytest.raises(ConfigError, match=r"only over https: use an https URL") as err:
        deploy(pod, cwd=repo, worker_url=f"http://tok:{token}@127.0.0.1:9/x.git")
    assert token not in str(err.value)


@pytest.mark.sim
def test_unreachable_worker_is_named_and_the_others_deploy(repo: Path, pod: SimPod):
    from tpufab.ssh.fanout import Fanout

    pod.pool.set_reachable(pod.node_id, 3, False)
    try:
        with Fanout(list(pod.fanout.targets.values()), known_hosts=pod.fanout.known_hosts,
                    connect_attempts=1, connect_timeout=5) as fresh:
            with pytest.raises(DeployError, match=r"Worker w3 could not run the deploy step "
                                                  r"over SSH") as err:
                deploy(fresh, cwd=repo)
        # every worker's outcome, folded: the three that deployed, then the one that failed
        deployed, failed = err.value.details.splitlines()
        assert deployed.startswith("w[0-2]  ") and " clone " in deployed
        assert failed == "w3      failed: ssh: connection refused"
    finally:
        pod.pool.set_reachable(pod.node_id, 3, True)


def _deploy_checkout(script: Path, work: Path, source: Path, sha: str):
    done = subprocess.run([WORKER_PYTHON, "-I", "-S", str(script), "checkout", "--dir",
                           str(work), "--source", str(source), "--commit", sha],
                          capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    return read_answer(done.stdout, "answer")


def _local_source(root: Path) -> Path:
    root.mkdir()
    sh(root, "git", "init", "-q")
    return root


def test_a_checkout_killed_mid_write_is_mended_by_the_next_deploy(tmp_path: Path):
    """A deploy whose client is killed while a worker's git writes the tree (the agent stops
    what the closed connection ran) leaves the new commit's files on disk, HEAD and the index
    at the old one. Before: every later deploy of that worker was refused with "local changes
    would be overwritten" (issue 37's killed-deployer scenario on CI). Now the checkout's
    journal names those paths and the next checkout puts them back first; a user's own edit
    elsewhere survives."""
    src = _local_source(tmp_path / "src")
    commit(src, "mine.txt", "user\n")
    a = commit(src, "kept.txt", "v1\n")
    commit(src, "kept.txt", "v2\n")
    b = commit(src, "new.txt", "new\n")
    c = commit(src, "later.txt", "later\n")
    script = shipped("deploy_worker.py")
    work = tmp_path / "work"
    assert _deploy_checkout(script, work, src, a)["commit"] == a
    sh(work, "git", "fetch", "-q", str(src), "HEAD")
    # what the killed checkout A -> B left: B's files written, HEAD and index still at A,
    # its journal naming a writer that is gone (a pid that never matches its start time)
    (work / "kept.txt").write_text("v2\n")
    (work / "new.txt").write_text("new\n")
    (work / ".git" / "tpufab-checkout.json").write_text(
        json.dumps({"before": a, "to": b, "pid": os.getpid(), "start": -1}))
    (work / "mine.txt").write_text("user edit\n")   # the user's, after the kill
    answer = _deploy_checkout(script, work, src, c)
    assert answer["ok"], answer
    assert answer["commit"] == c
    assert (work / "kept.txt").read_text() == "v2\n"
    assert (work / "later.txt").exists()
    assert (work / "mine.txt").read_text() == "user edit\n"
    assert not (work / ".git" / "tpufab-checkout.json").exists()


def test_a_half_written_tree_without_a_journal_is_still_refused(tmp_path: Path):
    """Local changes nobody's checkout left (no journal) are the user's: still refused."""
    src = _local_source(tmp_path / "src")
    a = commit(src, "f.txt", "1\n")
    b = commit(src, "f.txt", "2\n")
    script = shipped("deploy_worker.py")
    work = tmp_path / "work"
    assert _deploy_checkout(script, work, src, a)["ok"]
    (work / "f.txt").write_text("the user's\n")
    answer = _deploy_checkout(script, work, src, b)
    assert answer["error"] == "local_changes", answer
    assert (work / "f.txt").read_text() == "the user's\n"
