#!/usr/bin/env python3
"""tpufab deploy, worker side (stdlib only; shipped once per content hash).

    deploy_worker.py status --dir DIR
    deploy_worker.py hold --token T --owner TEXT --purpose TEXT
    deploy_worker.py release --token T
    deploy_worker.py checkout --dir DIR --source URL|BUNDLE --commit SHA
                     [--fetch-ref REF] [--branch NAME] [--origin URL] [--remove-source]

``checkout`` does the whole job in one process: clone if absent, fetch only if the commit is
missing, check out exactly that commit (on ``--branch`` or detached), update submodules, and
report. If ``TPUFAB_GIT_TOKEN`` is in the environment (tpufab sends it as a secret on the
fan-out agent's stdin), git gets it from a credential helper that reads the environment, so
the token never reaches argv, a file or a log.

Prints exactly one JSON object on stdout:
  {"ok": true, "commit": SHA, "before": SHA|null, "action": "clone"|"update"|"noop", ...}
  {"ok": false, "error": KIND, "message": TEXT, ...}
with KIND one of unreachable, auth_failed, disk_full, not_a_repo, local_changes, missing_commit,
no_git, git_failed, busy. Exit status: 0 ok, 3 failure.

``hold``: the pod's code has one writer at a time. A lease (``~/.tpufab/locks/code.json``)
names its holder: this very process, which answers once it holds the lease and then runs as
long as the tpufab command that took it holds it: ``release`` (or a signal) ends it. Its
command stops it when it ends or dies: its own connection closing, or the connection keeper
stopping what a SIGKILLed client ran (the keeper's connections outlive the client, so
the lease must not name them). A holder whose parent (the agent) is gone lets go too.
Another token's lease whose holder lives is ``busy``; ``release`` drops one's own.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import resource
import signal
import subprocess
import sys
import time

from tpufab.remote.workerlib import alive, answer, proc_stat, read_json, write_atomic

UNREACHABLE = ("could not read from remote", "unable to connect", "connection refused",
               "could not resolve host", "connection timed out", "failed to connect",
               "does not appear to be a git repository", "repository not found",
               "unable to access", "no route to host", "access denied", "not exported")
AUTH_FAILED = ("authentication failed", "could not read username", "could not read password",
               "permission denied (publickey", "error: 403", "returned error: 401")
DISK_FULL = ("no space left on device", "disk quota exceeded")
# Worth another try: the remote (or a proxy in front of it) shed load, e.g. 64 workers at once.
TRANSIENT = ("connection reset", "early eof", "the remote end hung up unexpectedly",
             "operation timed out", "error: 429", "error: 502", "error: 503", "error: 504",
             "rpc failed", "temporary failure", "unexpected disconnect")
FETCH_ATTEMPTS = 5
LOCAL_CHANGES = ("would be overwritten", "please commit your changes or stash them")
# The helper text is argv, but the secret is only in the environment of git's own processes.
# It answers only a request for origin's host (TPUFAB_GIT_HOST, host[:port] as git sends it)
# over https, and prints nothing for any other (a submodule's host, http): git then asks no
# one else (GIT_ASKPASS=true) and that fetch fails without the token. Git itself calls it
# only for that URL (the helper is configured as credential.https://HOST.helper).
CREDENTIAL_HELPER = ('!f() { test "$1" = get || exit 0; p=; h=; '
                     'while IFS== read -r k v; do case "$k" in protocol) p=$v;; '
                     'host) h=$v;; esac; done; '
                     'test "$p" = https && test -n "$h" && test "$h" = "$TPUFAB_GIT_HOST" '
                     '|| exit 0; '
                     'echo "username=${TPUFAB_GIT_USERNAME:-x-access-token}"; '
                     'echo "password=$TPUFAB_GIT_TOKEN"; }; f')


def credential_host(url):
    """The host[:port] git names in a credential request for ``url`` when it is https (the
    only scheme a token is ever offered on), else None."""
    from urllib.parse import urlsplit

    try:
        parts = urlsplit(url or "")
    except ValueError:
        return None
    if parts.scheme.lower() != "https":
        return None
    host = parts.netloc.rpartition("@")[2]
    return host or None


class Failure(Exception):
    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind
        self.message = message


class Git:
    def __init__(self, token: str | None = None, url: str | None = None):
        """``token``: offered only to ``url``'s host, and only when ``url`` is https."""
        self.env = dict(os.environ, GIT_TERMINAL_PROMPT="0", LC_ALL="C",
                        GIT_ASKPASS="true", SSH_ASKPASS="true")
        self.env.pop("TPUFAB_GIT_TOKEN", None)
        # no background gc/maintenance after each fetch on a worker
        self.config: list[str] = ["-c", "gc.auto=0", "-c", "maintenance.auto=false"]
        host = credential_host(url)
        if token is not None and host is not None:
            self.env.update(TPUFAB_GIT_TOKEN=token, TPUFAB_GIT_HOST=host)
            self.config += ["-c", "credential.helper=",
                            "-c", f"credential.https://{host}.helper=" + CREDENTIAL_HELPER]

    def __call__(self, *args: str, cwd: str | None = None, check: bool = True,
                 what: str = "git") -> str:
        argv = ["git", *self.config, *args]
        try:
            proc = subprocess.run(argv, cwd=cwd, env=self.env, capture_output=True, text=True,
                                  stdin=subprocess.DEVNULL)
        except FileNotFoundError:
            raise Failure("no_git", "git is not installed on this worker") from None
        if check and proc.returncode != 0:
            raise classify(proc.stderr or proc.stdout, what)
        return proc.stdout.strip() if proc.returncode == 0 else ""

    def fetch(self, *args: str, cwd: str) -> None:
        """``git fetch`` with a few jittered retries on transient network errors."""
        for attempt in range(FETCH_ATTEMPTS):
            argv = ["git", *self.config, "fetch", *args]
            proc = subprocess.run(argv, cwd=cwd, env=self.env, capture_output=True, text=True,
                                  stdin=subprocess.DEVNULL)
            if proc.returncode == 0:
                return
            text = proc.stderr or proc.stdout
            if attempt + 1 == FETCH_ATTEMPTS or not any(
                    s in text.lower() for s in TRANSIENT):
                raise classify(text, "fetch")
            time.sleep((0.1 + os.urandom(1)[0] / 1275) * 2 ** attempt)  # 0.1-0.3 s, doubling

    def ok(self, *args: str, cwd: str | None = None) -> bool:
        argv = ["git", *self.config, *args]
        return subprocess.run(argv, cwd=cwd, env=self.env, capture_output=True,
                              stdin=subprocess.DEVNULL).returncode == 0


def classify(text: str, what: str) -> Failure:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    last = lines[-1] if lines else "no output"
    lower = text.lower()
    if any(s in lower for s in DISK_FULL):
        return Failure("disk_full", f"{what}: no space left on device ({last})")
    if any(s in lower for s in LOCAL_CHANGES):
        return Failure("local_changes", f"{what}: local changes would be overwritten ({last})")
    if what in ("clone", "fetch") and any(s in lower for s in AUTH_FAILED):
        return Failure("auth_failed", f"{what}: the remote refused our credentials ({last})")
    if what in ("clone", "fetch") and any(s in lower for s in UNREACHABLE):
        return Failure("unreachable", f"{what}: cannot reach the remote ({last})")
    return Failure("git_failed", f"{what}: {last}")


def head_of(git: Git, path: str) -> str | None:
    if not os.path.isdir(os.path.join(path, ".git")) and not os.path.isfile(
            os.path.join(path, ".git")):
        return None
    return git("rev-parse", "--verify", "--quiet", "HEAD^{commit}", cwd=path, check=False) or None


def status(args: argparse.Namespace) -> dict:
    path = os.path.expanduser(args.dir)
    git = Git()
    return {"ok": True, "dir": path, "exists": os.path.exists(path), "commit": head_of(git, path)}


def has_commit(git: Git, path: str, sha: str) -> bool:
    return git.ok("cat-file", "-e", f"{sha}^{{commit}}", cwd=path)


# A checkout in progress, in the checkout's own .git: written before git starts writing the
# tree, removed when it is done. One left by a process that is gone (the deploy's client was
# killed, so the agent stopped it mid-write) names the paths that checkout was changing.
JOURNAL = "tpufab-checkout.json"


def journal_of(path: str) -> str | None:
    """The checkout's journal file; None where .git is a file (a git worktree's: no journal)."""
    folder = os.path.join(path, ".git")
    return os.path.join(folder, JOURNAL) if os.path.isdir(folder) else None


def mend_interrupted(git: Git, path: str) -> bool:
    """Undo what an interrupted checkout left half-written, so the next one is not refused
    with "local changes" that are ours. Only the paths that differ between the two commits
    of the journal are put back to the commit HEAD still names: git checks those for local
    changes before it writes any of them, so nothing of the user's is among them. A user's
    edit elsewhere stays, and a journal whose writer still runs is left alone. True when one
    was found: the checkout is then done again even at the same commit (its submodules or
    its hook may not have run)."""
    journal = journal_of(path)
    entry = read_json(journal) if journal else None
    if not isinstance(entry, dict):
        return False
    if entry.get("pid") and entry.get("start") and alive(entry["pid"], entry["start"]):
        return False
    head = head_of(git, path)
    before, to = entry.get("before"), entry.get("to")
    if to and head == before and has_commit(git, path, to):
        # git removes its index.lock on SIGTERM but not on SIGKILL; its writer is dead, and
        # the code lease keeps every other deploy out
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(path, ".git", "index.lock"))
        if before is None:   # a first checkout into an empty directory: all of it is ours
            listed = git("ls-tree", "-r", "-z", "--name-only", to, cwd=path)
        else:
            listed = git("diff", "--name-only", "-z", "--no-renames", before, to, cwd=path)
        changed = [p for p in listed.split("\0") if p]
        kept = [p for p in changed if before is not None
                and git.ok("cat-file", "-e", f"{before}:{p}", cwd=path)]
        for name in set(changed) - set(kept):
            with contextlib.suppress(FileNotFoundError, IsADirectoryError):
                os.unlink(os.path.join(path, name))
        if kept:
            git("checkout", "--quiet", before, "--", *kept, cwd=path, what="checkout")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(journal)
    return True


def checkout(args: argparse.Namespace) -> dict:
    start = time.monotonic()
    if os.path.isfile(args.source):  # a shipped bundle, relative to the login directory
        args.source = os.path.abspath(args.source)
    git = Git(os.environ.get("TPUFAB_GIT_TOKEN") or None, args.source)
    path = os.path.expanduser(args.dir)
    sha = args.commit
    before = head_of(git, path)
    mended = mend_interrupted(git, path)
    action = "update"
    if before is None:
        if os.path.exists(path) and not os.path.isdir(path):
            raise Failure("not_a_repo", f"{path} exists and is not a directory")
        if os.path.isdir(path) and os.listdir(path) and not os.path.exists(
                os.path.join(path, ".git")):
            raise Failure("not_a_repo", f"{path} is not empty and is not a git checkout")
        os.makedirs(path, exist_ok=True)
        if not os.path.exists(os.path.join(path, ".git")):
            git("init", "--quiet", path, what="init")
        action = "clone"
    elif before == sha and not args.force and not mended:
        return {"ok": True, "dir": path, "commit": sha, "before": before, "action": "noop",
                "seconds": round(time.monotonic() - start, 3)}
    if args.origin:
        current = git("remote", "get-url", "origin", cwd=path, check=False)
        if not current:
            git("remote", "add", "origin", args.origin, cwd=path)
        elif current != args.origin:
            git("remote", "set-url", "origin", args.origin, cwd=path)
    fetched = False
    if not has_commit(git, path, sha):
        refspec = f"+{args.fetch_ref}:refs/tpufab/deployed" if args.fetch_ref else sha
        git.fetch("--quiet", "--no-tags", args.source, refspec, cwd=path)
        fetched = True
        if not has_commit(git, path, sha):
            # the ref moved on the remote since our push: ask for the commit itself
            git.fetch("--quiet", "--no-tags", args.source, sha, cwd=path)
    if not has_commit(git, path, sha):
        raise Failure("missing_commit", f"commit {sha[:12]} is not on the remote")
    journal = journal_of(path)
    if journal:
        me = proc_stat(os.getpid())
        write_atomic(journal, json.dumps({"before": head_of(git, path), "to": sha,
                                          "pid": os.getpid(), "start": me and me.start_time}))
    if args.branch:
        git("checkout", "--quiet", "-B", args.branch, sha, cwd=path, what="checkout")
    else:
        git("checkout", "--quiet", "--detach", sha, cwd=path, what="checkout")
    if os.path.exists(os.path.join(path, ".gitmodules")):
        git("submodule", "update", "--quiet", "--init", "--recursive", cwd=path,
            what="submodule update")
    if journal:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(journal)
    after = git("rev-parse", "HEAD", cwd=path)
    return {"ok": True, "dir": path, "commit": after, "before": before, "action": action,
            "fetched": fetched, "seconds": round(time.monotonic() - start, 3)}


LOCK_DIR = "~/.tpufab/locks"
HOLD_TICK = 1.0   # s: how often a lease's holder looks whether its agent still lives


def _locked(fn):
    """Run ``fn(path of the lease)`` holding the lease file's flock (a short critical section)."""
    folder = os.path.expanduser(LOCK_DIR)
    os.makedirs(folder, mode=0o700, exist_ok=True)
    with open(os.path.join(folder, "code.lock"), "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        return fn(os.path.join(folder, "code.json"))


def _read_lease(path: str) -> dict | None:
    lease = read_json(path)
    if not isinstance(lease, dict):
        return None
    pid, started = lease.get("pid"), lease.get("start_time")
    if not isinstance(pid, int) or not alive(pid, started):
        return None  # its holder is gone (a finished or killed tpufab): the lease is stale
    return lease


class _Released(Exception):
    """A signal told the holder to let go."""


def _let_go(*_):
    raise _Released


def hold(args: argparse.Namespace) -> dict:
    """Take the lease (or say who has it) and answer at once; then hold it until told to let
    go (a signal: ``release``, or the agent stopping this command) or the agent is gone."""
    def take(path: str) -> None:
        current = _read_lease(path)
        if current is not None and current.get("token") != args.token:
            age = max(0.0, time.time() - float(current.get("since") or time.time()))
            raise Failure("busy", f"{current.get('purpose')} by {current.get('owner')}, "
                                  f"under way for {age:.0f} s")
        me = proc_stat(os.getpid())
        record = {"token": args.token, "owner": args.owner, "purpose": args.purpose,
                  "pid": os.getpid(), "start_time": me.start_time if me else None,
                  "since": time.time()}
        write_atomic(path, json.dumps(record))

    def drop(path: str) -> None:
        current = _read_lease(path)
        if current is not None and current.get("token") == args.token:
            os.unlink(path)

    for signum in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        signal.signal(signum, _let_go)
    parent = os.getppid()
    try:
        _locked(take)
        answer("answer", {"ok": True, "action": "leased", "home": os.path.expanduser("~")})
        while os.getppid() == parent:
            time.sleep(HOLD_TICK)
    except _Released:
        pass
    finally:
        for signum in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
            signal.signal(signum, signal.SIG_IGN)   # one letting go lets go once
        _locked(drop)
    return {"ok": True, "action": "released"}


def release(args: argparse.Namespace) -> dict:
    """Let go of one's own lease: its holder is told to (and the lease goes with it)."""
    def drop(path: str) -> dict:
        current = _read_lease(path)
        if current is not None and current.get("token") == args.token:
            os.unlink(path)
            with contextlib.suppress(OSError):
                os.kill(current["pid"], signal.SIGTERM)
        return {"ok": True, "action": "released"}

    return _locked(drop)


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="deploy_worker.py")
    sub = parser.add_subparsers(dest="verb", required=True)
    st = sub.add_parser("status")
    st.add_argument("--dir", required=True)
    le = sub.add_parser("hold")
    le.add_argument("--token", required=True)
    le.add_argument("--owner", required=True)
    le.add_argument("--purpose", required=True)
    re_ = sub.add_parser("release")
    re_.add_argument("--token", required=True)
    co = sub.add_parser("checkout")
    co.add_argument("--dir", required=True)
    co.add_argument("--source", required=True, help="URL or bundle path to fetch from")
    co.add_argument("--commit", required=True)
    co.add_argument("--fetch-ref")
    co.add_argument("--branch")
    co.add_argument("--origin", help="set the checkout's origin to this URL")
    co.add_argument("--force", action="store_true", help="redo the checkout even if at commit")
    co.add_argument("--remove-source", action="store_true",
                    help="delete --source afterwards (a shipped bundle)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    try:
        verbs = {"status": status, "hold": hold, "release": release, "checkout": checkout}
        result = verbs[args.verb](args)
        code = 0
    except Failure as err:
        result = {"ok": False, "error": err.kind, "message": err.message}
        code = 3
    except OSError as err:
        kind = "disk_full" if err.errno in (28, 122) else "git_failed"
        result = {"ok": False, "error": kind, "message": str(err)}
        code = 3
    finally:
        if getattr(args, "remove_source", False) and os.path.isfile(args.source):
            os.unlink(args.source)
    result["host"] = os.uname().nodename
    usage = [resource.getrusage(who) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
    result["cpu_seconds"] = round(sum(u.ru_utime + u.ru_stime for u in usage), 3)
    answer("answer", result)
    return code


if __name__ == "__main__":
    sys.exit(main())
