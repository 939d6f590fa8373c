"""Local git for deploy: find the repository, resolve a ref, refuse a dirty tree, snapshot it
(`--wip`) without touching the user's branch, index or files, push, and build bundles.

Every function runs git in the user's repository with ``GIT_OPTIONAL_LOCKS=0`` so that even
``git status`` never rewrites ``.git/index``.
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from tpufab.errors import TpufabError
from tpufab.reports import last_line

WIP_REFS = "refs/tpufab/wip/"
DIRECT_REF = "refs/tpufab/direct"
DETACHED_REF = "refs/tpufab/deploy"


class GitError(TpufabError):
    """Local git refused (no repository, no remote, dirty tree, rejected push...)."""


@dataclass(frozen=True)
class Resolved:
    """What deploy ships: the commit, the ref pushed to the remote, and the worker branch."""

    commit: str
    push_ref: str          # e.g. refs/heads/main, or a side ref for --wip / detached HEAD
    branch: str | None     # checked out on workers with `checkout -B`; None: detached
    wip: bool = False


def _env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env["GIT_OPTIONAL_LOCKS"] = "0"
    env["GIT_TERMINAL_PROMPT"] = "0"
    env.setdefault("LC_ALL", "C")
    env.update(extra or {})
    return env


def git(root: Path, *args: str, env: dict[str, str] | None = None, check: bool = True,
        input: bytes | None = None) -> subprocess.CompletedProcess:
    """Run git in ``root``; text output, stripped of nothing."""
    proc = subprocess.run(["git", "-C", str(root), *args], capture_output=True, input=input,
                          env=_env(env))
    out = subprocess.CompletedProcess(proc.args, proc.returncode,
                                      proc.stdout.decode(errors="replace"),
                                      proc.stderr.decode(errors="replace"))
    if check and out.returncode != 0:
        raise GitError(f"git {' '.join(args[:2])} failed in {root}: {_why(out.stderr)}")
    return out


def _why(text: str) -> str:
    """Git's last line of output, or "no output"."""
    return last_line(text) or "no output"


def repo_root(cwd: Path | str | None = None) -> Path:
    """The top of the work tree containing ``cwd``."""
    cwd = Path(cwd or Path.cwd())
    proc = subprocess.run(["git", "-C", str(cwd), "rev-parse", "--show-toplevel"],
                          capture_output=True, text=True, env=_env())
    if proc.returncode != 0:
        raise GitError(f"{cwd} is not inside a git repository: run deploy from your project's "
                       f"checkout (or create one with `git init` and a first commit).")
    return Path(proc.stdout.strip())


def repo_name(root: Path) -> str:
    return root.name


def resolve(root: Path, ref: str = "HEAD") -> Resolved:
    """The commit ``ref`` names and where to push it: its branch if ``ref`` is (or HEAD points
    at) a branch, else a side ref so the user's remote branches are never moved by surprise."""
    proc = git(root, "rev-parse", "--verify", "--quiet", f"{ref}^{{commit}}", check=False)
    if proc.returncode != 0:
        if ref == "HEAD":
            raise GitError(f"{root} has no commits yet: commit something, then deploy.")
        raise GitError(f"{ref!r} is not a commit in {root}: pass a branch, tag or commit "
                       f"with --ref.")
    commit = proc.stdout.strip()
    full = git(root, "rev-parse", "--symbolic-full-name", ref, check=False).stdout.strip()
    if full.startswith("refs/heads/"):
        return Resolved(commit, full, full[len("refs/heads/"):])
    if full.startswith("refs/remotes/"):
        # origin/main: push nothing new to that branch, just make sure the commit is there
        branch = full.split("/", 3)[3]
        return Resolved(commit, "refs/heads/" + branch, branch)
    return Resolved(commit, DETACHED_REF, None)


def dirty_paths(root: Path) -> list[str]:
    """Tracked changes (staged or not) and untracked, not ignored, files."""
    out = git(root, "status", "--porcelain=v1", "-z", "--untracked-files=all").stdout
    entries = [e for e in out.split("\0") if e]
    paths, skip = [], False
    for entry in entries:
        if skip:  # the source path of a rename
            skip = False
            continue
        if entry[0] in "RC":
            skip = True
        paths.append(entry[3:])
    return paths


def refuse_dirty(root: Path) -> None:
    paths = dirty_paths(root)
    if paths:
        shown = ", ".join(paths[:3]) + (f" and {len(paths) - 3} more" if len(paths) > 3 else "")
        raise GitError(f"Your working tree has uncommitted changes ({shown}): commit them, or "
                       f"deploy a snapshot of the tree as it is with --wip.")


def wip_snapshot(root: Path) -> Resolved:
    """Commit the working tree (tracked + untracked, not ignored) onto a side ref
    ``refs/tpufab/wip/<n>`` whose parent is HEAD. The user's branch, index and files are not
    touched: the tree is built in a temporary index. The same tree on the same HEAD reuses the
    last snapshot, so deploying it again is a no-op."""
    head = git(root, "rev-parse", "--verify", "--quiet", "HEAD^{commit}", check=False)
    parent = head.stdout.strip() if head.returncode == 0 else None
    git_dir = Path(git(root, "rev-parse", "--absolute-git-dir").stdout.strip())
    with tempfile.TemporaryDirectory(prefix="tpufab-wip-") as tmp:
        index = Path(tmp) / "index"
        real_index = git_dir / "index"
        if real_index.exists():  # start from it so unchanged files hash fast (stat cache)
            index.write_bytes(real_index.read_bytes())
        env = {"GIT_INDEX_FILE": str(index)}
        git(root, "add", "--all", "--", ".", env=env)
        tree = git(root, "write-tree", env=env).stdout.strip()
    if parent and git(root, "rev-parse", f"{parent}^{{tree}}").stdout.strip() == tree:
        resolved = resolve(root, "HEAD")
        return Resolved(parent, resolved.push_ref, resolved.branch)
    existing = wip_refs(root)
    if existing:
        last_ref, last_commit = existing[-1]
        info = git(root, "show", "-s", "--format=%T %P", last_commit).stdout.split()
        if info and info[0] == tree and info[1:] == ([parent] if parent else []):
            return Resolved(last_commit, last_ref, None, wip=True)
    number = (int(existing[-1][0].rsplit("/", 1)[1]) + 1) if existing else 1
    args = ["commit-tree", tree, "-m", f"tpufab wip snapshot {number}"]
    if parent:
        args[2:2] = ["-p", parent]
    commit = git(root, *args, env=_identity(root)).stdout.strip()
    ref = f"{WIP_REFS}{number}"
    git(root, "update-ref", ref, commit)
    return Resolved(commit, ref, None, wip=True)


def _identity(root: Path) -> dict[str, str]:
    """A fallback author for snapshots on machines where git has no user configured."""
    env = {}
    for kind in ("AUTHOR", "COMMITTER"):
        if git(root, "var", f"GIT_{kind}_IDENT", check=False).returncode != 0:
            env.update({f"GIT_{kind}_NAME": "tpufab", f"GIT_{kind}_EMAIL": "tpufab@localhost"})
    return env


def wip_refs(root: Path) -> list[tuple[str, str]]:
    """(ref, commit) of every wip snapshot, oldest first."""
    out = git(root, "for-each-ref", "--format=%(refname) %(objectname)", WIP_REFS).stdout
    pairs = [tuple(line.split()) for line in out.splitlines() if line.strip()]
    numbered = [(r, c) for r, c in pairs if r.rsplit("/", 1)[1].isdigit()]
    return sorted(numbered, key=lambda rc: int(rc[0].rsplit("/", 1)[1]))


def has_remote(root: Path, remote: str) -> bool:
    return git(root, "remote", "get-url", remote, check=False).returncode == 0


def remote_url(root: Path, remote: str) -> str:
    proc = git(root, "remote", "get-url", remote, check=False)
    if proc.returncode != 0:
        names = git(root, "remote").stdout.split()
        have = f" (this repository has: {', '.join(names)})" if names else ""
        raise GitError(f"No git remote named {remote!r}{have}: add it with `git remote add "
                       f"{remote} URL`, pick another with --remote, or use --direct.")
    return proc.stdout.strip()


def without_credentials(url: str) -> tuple[str, tuple[str | None, str] | None]:
    """``url`` without the userinfo an http(s) URL may carry (``https://tok:ghp_x@host/r``,
    the form CI tools write), and that userinfo as (username or None, token): a password is
    the token; a username alone (``https://ghp_x@host/r``) is. Other URLs (ssh, scp-like
    ``git@host:r``, paths) are returned as they are: their user is no secret."""
    from urllib.parse import unquote, urlsplit, urlunsplit

    try:
        parts = urlsplit(url)
    except ValueError:
        return url, None
    if parts.scheme.lower() not in ("http", "https") or "@" not in parts.netloc:
        return url, None
    userinfo, _, host = parts.netloc.rpartition("@")
    user, has_password, password = userinfo.partition(":")
    clean = urlunsplit(parts._replace(netloc=host))
    if has_password and password:
        return clean, (unquote(user) or None, unquote(password))
    return clean, (None, unquote(user)) if user else None


def push(root: Path, remote: str, commit: str, ref: str) -> str:
    """``git push remote commit:ref``; returns git's one-line summary. Rejections and
    unreachable remotes become one sentence."""
    force = "+" if ref.startswith("refs/tpufab/") else ""
    proc = git(root, "push", "--porcelain", remote, f"{force}{commit}:{ref}", check=False)
    text = proc.stdout + proc.stderr
    if proc.returncode == 0:
        return "up to date" if "[up to date]" in text else "pushed"
    short = ref.removeprefix("refs/heads/")
    if re.search(r"non-fast-forward|\[rejected\]|fetch first", text):
        raise GitError(f"The push to {remote} was rejected: {remote}/{short} has commits that "
                       f"{commit[:12]} does not contain (non-fast-forward); pull or rebase, "
                       f"then deploy again.")
    refused = re.search(r"\[remote rejected\] \(([^)\n]*)\)|(cannot lock ref[^\n]*)", text)
    if refused:
        why = (refused.group(1) or refused.group(2) or "").strip()
        raise GitError(f"{remote} refused to move {short} to {commit[:12]} ({why}): another push "
                       f"to {remote}/{short} was under way at the same moment; deploy again "
                       "once it is done.")
    if re.search(r"Could not read from remote|unable to connect|Connection refused|"
                 r"Could not resolve host|does not appear to be a git repository|not found",
                 text, re.I):
        raise GitError(f"Cannot push to {remote} ({_why(text)}): check the remote's URL "
                       f"and your access, or deploy with --direct.")
    raise GitError(f"git push to {remote} failed: {_why(text)}.")


def bundle(root: Path, commit: str, path: Path, exclude: list[str] = ()) -> Path:
    """A git bundle holding ``commit`` (as ``refs/tpufab/direct``), minus everything reachable
    from the ``exclude`` commits that exist locally."""
    git(root, "update-ref", DIRECT_REF, commit)
    known = []
    for sha in exclude:
        if git(root, "cat-file", "-e", f"{sha}^{{commit}}", check=False).returncode == 0:
            known.append(f"^{sha}")
    proc = git(root, "bundle", "create", "--quiet", str(path), DIRECT_REF, *known, check=False)
    if proc.returncode != 0 and known:
        # the worker already has every object (e.g. commit is an ancestor of its HEAD)
        git(root, "bundle", "create", "--quiet", str(path), DIRECT_REF)
    elif proc.returncode != 0:
        raise GitError(f"git bundle failed in {root}: {_why(proc.stderr)}.")
    return path
