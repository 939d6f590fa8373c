"""Every deploy reads the HTTPS token: a private remote that answers only with
``TPUFAB_GIT_TOKEN`` works inside `run`, `babysit` and `launch` as it does with `tpufab deploy`
(issue 37, finding 11: only `Pod.deploy` read the token, so the workers' fetch inside the other
verbs was refused). Through the real `tpufab` command on a simulated v4-16 whose origin is an
HTTPS `git http-backend` that refuses without the token; `ray submit` is in test_ray_sim.py.
The token reaches the workers as deploy sends it (the credential helper, on stdin): never on
their disks."""

from __future__ import annotations

import subprocess

import pytest
from gitremote import LAPTOP_HELPER, make_tls, token_remote, trust
from harness import sim_node
from helpers import LOGIN, in_worker, tpufab, unique_name

pytestmark = pytest.mark.sim

GIT_ENV = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t"}
HELLO = "#!/bin/sh\necho \"hello from $(basename \"$PWD\") at $(cat version.txt) on w$TPUFAB_WORKER_ID\"\n"
TASK = "workdir: .\nrun: |\n  ./hello.sh\n"


def git(repo, *args: str, env: dict) -> str:
    return subprocess.run(["git", *args], cwd=repo, env=env, check=True, capture_output=True,
                          text=True).stdout.strip()


@pytest.fixture(scope="module")
def pod(sim, tmp_path_factory):
    with sim_node(sim, tmp_path_factory, "tok", "v4-16") as node:
        tls = make_tls(node.home)
        srv = node.home / "srv"
        srv.mkdir()
        subprocess.run(["git", "init", "-q", "--bare", "-b", "main", str(srv / "proj.git")],
                       check=True)
        with token_remote(srv, tls) as remote:
            trust(lambda w, script: in_worker(sim, node.node, w, script, user=LOGIN), (0, 1),
                  tls)
            node.env.update(GIT_ENV, GIT_SSL_CAINFO=str(tls.cert),
                            LAPTOP_GIT_TOKEN=remote.token, TPUFAB_GIT_TOKEN=remote.token)
            repo = node.home / "proj"
            repo.mkdir()
            git(repo, "init", "-q", "-b", "main", env=node.env)
            git(repo, "config", "credential.helper", LAPTOP_HELPER, env=node.env)
            git(repo, "remote", "add", "origin", f"{remote.url}/proj.git", env=node.env)
            (repo / "hello.sh").write_text(HELLO)
            (repo / "hello.sh").chmod(0o755)
            (repo / "task.yaml").write_text(TASK)
            node.repo, node.remote = repo, remote
            yield node


def new_commit(pod) -> str:
    version = unique_name("v")
    (pod.repo / "version.txt").write_text(version + "\n")
    git(pod.repo, "add", "-A", env=pod.env)
    git(pod.repo, "commit", "-q", "-m", version, env=pod.env)
    return git(pod.repo, "rev-parse", "HEAD", env=pod.env)


def heads(pod) -> set[str]:
    return {in_worker(pod.sim, pod.node, w, "git -C ~/proj rev-parse HEAD", user=LOGIN).strip()
            for w in (0, 1)}


def test_the_remote_refuses_the_workers_without_the_token(pod):
    """The remote really is token-only: without TPUFAB_GIT_TOKEN, `deploy` pushes (this
    machine's own credentials) and every worker's fetch is refused."""
    new_commit(pod)
    env = {k: v for k, v in pod.env.items() if k != "TPUFAB_GIT_TOKEN"}
    refused = tpufab("deploy", env=env, cwd=pod.repo)
    assert refused.returncode != 0
    assert "refused workers w[0-1] (authentication failed)" in refused.stderr, refused.stderr


@pytest.mark.parametrize("verb", [
    ["run", "hello.sh"],
    ["babysit", "hello.sh", "--max-restarts", "0"],
    ["launch", "task.yaml"],
], ids=["run", "babysit", "launch"])
def test_every_verb_that_deploys_sends_the_token(pod, verb):
    """Before: `run`, `babysit` and `launch` deployed without the token, and the workers'
    fetch was refused (`The remote https://... refused workers w[0-1] (authentication
    failed)`)."""
    commit = new_commit(pod)
    done = tpufab(*verb, env=pod.env, cwd=pod.repo)
    assert done.returncode == 0, done.stdout + done.stderr
    assert heads(pod) == {commit}
    version = (pod.repo / "version.txt").read_text().strip()
    assert f"hello from proj at {version} on w" in done.stdout, done.stdout
    token = pod.remote.token
    assert token not in done.stdout + done.stderr
    for w in (0, 1):   # nothing on a worker's disk holds it
        assert in_worker(pod.sim, pod.node, w, f"grep -rl {token} ~ /tmp 2>/dev/null || true",
                         user=LOGIN).strip() == ""
