"""Local git for deploy: resolve, dirty check, --wip snapshots that touch nothing, push errors."""

from __future__ import annotations

import hashlib
import os
import subprocess
from pathlib import Path

import pytest

from tpufab.steps.code import gitops
from tpufab.steps.code.gitops import GitError


def sh(cwd: Path, *argv: str) -> str:
    env = dict(os.environ, GIT_AUTHOR_NAME="t", GIT_AUTHOR_EMAIL="t@t", GIT_COMMITTER_NAME="t",
               GIT_COMMITTER_EMAIL="t@t")
    return subprocess.run(argv, cwd=cwd, check=True, capture_output=True, text=True,
                          env=env).stdout.strip()


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    root = tmp_path / "proj"
    root.mkdir()
    sh(root, "git", "init", "-q", "-b", "main")
    (root / "a.txt").write_text("one\n")
    (root / ".gitignore").write_text("*.log\n")
    sh(root, "git", "add", ".")
    sh(root, "git", "commit", "-q", "-m", "first")
    return root


def snapshot_state(root: Path) -> dict[str, str]:
    """Bytes of everything a --wip must not touch: work tree files, index, HEAD, branches."""
    state = {}
    for path in sorted(root.rglob("*")):
        if path.is_file() and ".git" not in path.relative_to(root).parts:
            state[str(path.relative_to(root))] = hashlib.sha256(path.read_bytes()).hexdigest()
    git_dir = root / ".git"
    state["<index>"] = hashlib.sha256((git_dir / "index").read_bytes()).hexdigest()
    state["<HEAD>"] = (git_dir / "HEAD").read_text()
    state["<branches>"] = sh(root, "git", "for-each-ref", "refs/heads")
    state["<status>"] = sh(root, "git", "status", "--porcelain")
    return state


def test_repo_root_and_not_a_repo(repo: Path, tmp_path: Path):
    (repo / "sub").mkdir()
    assert gitops.repo_root(repo / "sub") == repo
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    with pytest.raises(GitError, match="not inside a git repository"):
        gitops.repo_root(outside)


def test_resolve_branch_detached_and_unknown(repo: Path):
    head = sh(repo, "git", "rev-parse", "HEAD")
    assert gitops.resolve(repo) == gitops.Resolved(head, "refs/heads/main", "main")
    sh(repo, "git", "tag", "v1")
    assert gitops.resolve(repo, "v1") == gitops.Resolved(head, gitops.DETACHED_REF, None)
    with pytest.raises(GitError, match="'nope' is not a commit"):
        gitops.resolve(repo, "nope")


def test_no_commits_yet(tmp_path: Path):
    sh(tmp_path, "git", "init", "-q")
    with pytest.raises(GitError, match="no commits yet"):
        gitops.resolve(tmp_path)


def test_dirty_paths_and_refusal(repo: Path):
    assert gitops.dirty_paths(repo) == []
    gitops.refuse_dirty(repo)
    (repo / "a.txt").write_text("two\n")
    (repo / "new.txt").write_text("x")
    (repo / "ignored.log").write_text("x")
    assert sorted(gitops.dirty_paths(repo)) == ["a.txt", "new.txt"]
    with pytest.raises(GitError, match=r"uncommitted changes \(.*a\.txt.*\).*--wip"):
        gitops.refuse_dirty(repo)


def test_wip_snapshot_touches_nothing(repo: Path):
    (repo / "a.txt").write_text("changed\n")
    (repo / "staged.txt").write_text("staged\n")
    sh(repo, "git", "add", "staged.txt")
    (repo / "untracked.txt").write_text("untracked\n")
    (repo / "debug.log").write_text("ignored\n")
    before = snapshot_state(repo)
    wip = gitops.wip_snapshot(repo)
    assert snapshot_state(repo) == before
    assert wip.wip and wip.push_ref == "refs/tpufab/wip/1" and wip.branch is None
    files = sh(repo, "git", "ls-tree", "-r", "--name-only", wip.commit).split()
    assert sorted(files) == [".gitignore", "a.txt", "staged.txt", "untracked.txt"]
    assert sh(repo, "git", "show", f"{wip.commit}:a.txt") == "changed"
    assert sh(repo, "git", "rev-parse", f"{wip.commit}^") == sh(repo, "git", "rev-parse", "HEAD")
    # the same tree again reuses the snapshot; a change makes the next one
    assert gitops.wip_snapshot(repo) == wip
    (repo / "untracked.txt").write_text("more\n")
    assert gitops.wip_snapshot(repo).push_ref == "refs/tpufab/wip/2"
    assert snapshot_state(repo)["<index>"] == before["<index>"]


def test_wip_of_clean_tree_is_head(repo: Path):
    head = sh(repo, "git", "rev-parse", "HEAD")
    assert gitops.wip_snapshot(repo) == gitops.Resolved(head, "refs/heads/main", "main")
    assert gitops.wip_refs(repo) == []


def test_remote_missing(repo: Path):
    with pytest.raises(GitError, match="No git remote named 'origin'.*--direct"):
        gitops.remote_url(repo, "origin")
    sh(repo, "git", "remote", "add", "upstream", "/nowhere")
    with pytest.raises(GitError, match=r"\(this repository has: upstream\)"):
        gitops.remote_url(repo, "origin")


def test_push_up_to_date_and_rejected(repo: Path, tmp_path: Path):
    bare = tmp_path / "remote.git"
    sh(tmp_path, "git", "init", "-q", "--bare", "-b", "main", str(bare))
    sh(repo, "git", "remote", "add", "origin", str(bare))
    head = sh(repo, "git", "rev-parse", "HEAD")
    assert gitops.push(repo, "origin", head, "refs/heads/main") == "pushed"
    assert gitops.push(repo, "origin", head, "refs/heads/main") == "up to date"
    other = tmp_path / "other"
    sh(tmp_path, "git", "clone", "-q", str(bare), str(other))
    (other / "b.txt").write_text("theirs")
    sh(other, "git", "add", ".")
    sh(other, "git", "commit", "-q", "-m", "theirs")
    sh(other, "git", "push", "-q", "origin", "main")
    (repo / "c.txt").write_text("mine")
    sh(repo, "git", "add", ".")
    sh(repo, "git", "commit", "-q", "-m", "mine")
    mine = sh(repo, "git", "rev-parse", "HEAD")
    with pytest.raises(GitError, match="rejected.*non-fast-forward"):
        gitops.push(repo, "origin", mine, "refs/heads/main")
    # side refs are forced: a wip snapshot can always be pushed
    assert gitops.push(repo, "origin", mine, "refs/tpufab/wip/1") == "pushed"


def test_push_unreachable(repo: Path):
    sh(repo, "git", "remote", "add", "origin", "git://127.0.0.1:9/nothing.git")
    head = sh(repo, "git", "rev-parse", "HEAD")
    with pytest.raises(GitError, match="Cannot push to origin"):
        gitops.push(repo, "origin", head, "refs/heads/main")


def test_bundle_incremental(repo: Path, tmp_path: Path):
    first = sh(repo, "git", "rev-parse", "HEAD")
    (repo / "b.txt").write_text("b")
    sh(repo, "git", "add", ".")
    sh(repo, "git", "commit", "-q", "-m", "second")
    second = sh(repo, "git", "rev-parse", "HEAD")
    full = gitops.bundle(repo, second, tmp_path / "full.bundle")
    thin = gitops.bundle(repo, second, tmp_path / "thin.bundle", exclude=[first])
    assert thin.stat().st_size < full.stat().st_size
    assert second in sh(repo, "git", "bundle", "list-heads", str(thin))
    # an unknown basis (the worker has a commit we never saw) falls back to a full bundle
    unknown = gitops.bundle(repo, second, tmp_path / "u.bundle", exclude=["0" * 40])
    assert unknown.stat().st_size == full.stat().st_size
    # the commit is an ancestor of the basis: still a valid bundle
    gitops.bundle(repo, first, tmp_path / "back.bundle", exclude=[second])
    assert sh(repo, "git", "bundle", "verify", "-q", str(tmp_path / "back.bundle")) == ""
