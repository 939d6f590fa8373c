"""A pod has one writer at a time for its code (issue 11, findings 3 and 4): a deploy while a
run reads the checkout is refused, a second run while one runs is refused, two deploys at once
never both report success, a killed deployer leaves no lease behind, and a push race says why.
Everything through the real `tpufab` command on a simulated v4-32 with a `git daemon` remote.
"""

from __future__ import annotations

import signal
import subprocess
from pathlib import Path

import pytest
from harness import sim_node
from helpers import LOGIN, TPUFAB, git_daemon, tpufab, tpufab_within, unique_name, wait_for
from helpers import in_worker as _in_worker

from tpufab.steps.code import gitops

GIT_ENV = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t", "PATH": "/usr/bin:/bin"}

# Waits (bounded) for /tmp/<its first argument> on its worker; says which code it runs.
READER = """#!/bin/sh
echo "start $(cat version.txt)"
n=0
while [ ! -e "/tmp/$1" ]; do
    n=$((n + 1)); [ $n -gt 1200 ] && exit 9
    sleep 0.1
done
echo "end $(cat version.txt)"
"""


def in_worker(sim, node, worker: int, script: str, **kw) -> str:
    """A script inside a worker as the login user (its ~ is where tpufab deploys)."""
    return _in_worker(sim, node, worker, script, user=kw.pop("user", LOGIN), **kw)


def git(repo: Path, *args: str) -> str:
    env = {**GIT_ENV, "HOME": str(repo)}
    return subprocess.run(["git", *args], cwd=repo, env=env, check=True, capture_output=True,
                          text=True).stdout.strip()


def start(*args: str, env: dict, cwd: Path) -> subprocess.Popen:
    return subprocess.Popen([TPUFAB, *args], env=env, cwd=cwd, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True)


def refused(result, *fragments: str) -> str:
    """Non-zero, one sentence on stderr holding every fragment, no traceback."""
    assert result.returncode != 0, result.stdout + result.stderr
    lines = [line for line in result.stderr.splitlines()
             if line.strip() and not line.startswith("deploy: ")]
    assert len(lines) == 1, result.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    assert "Traceback" not in result.stderr
    return lines[0]


def commit(repo: Path, version: str) -> str:
    (repo / "version.txt").write_text(version + "\n")
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", version)
    return git(repo, "rev-parse", "HEAD")


def heads(sim, pod, dir: str = "~/proj") -> set[str]:
    return {in_worker(sim, pod.node, w, f"git -C {dir} rev-parse HEAD").strip()
            for w in range(4)}


def test_a_push_race_gets_its_reason(tmp_path):
    """Two pushes to one branch at once: the loser finds the ref locked by the winner."""
    bare = tmp_path / "srv.git"
    subprocess.run(["git", "init", "-q", "--bare", "-b", "main", str(bare)], check=True)
    repo = tmp_path / "proj"
    repo.mkdir()
    git(repo, "init", "-q", "-b", "main")
    git(repo, "remote", "add", "origin", str(bare))
    sha = commit(repo, "one")
    (bare / "refs" / "heads" / "main.lock").write_text("")  # the other push, mid-update
    with pytest.raises(gitops.GitError) as err:
        gitops.push(repo, "origin", sha, "refs/heads/main")
    text = str(err.value)
    # before: "git push to origin failed: error: failed to push some refs to ..."
    assert "failed to update ref" in text or "cannot lock ref" in text, text
    assert "another push" in text and "deploy again" in text


@pytest.fixture(scope="module")
def pod4(sim, tmp_path_factory):
    with sim_node(sim, tmp_path_factory, "one", "v4-32") as pod:
        yield from _with_a_remote(pod)


def _with_a_remote(pod):
    home = pod.home
    srv = home / "srv"
    srv.mkdir()
    subprocess.run(["git", "init", "-q", "--bare", "-b", "main", str(srv / "proj.git")],
                   check=True)
    with git_daemon(srv) as url:
        repo = home / "proj"
        repo.mkdir()
        git(repo, "init", "-q", "-b", "main")
        git(repo, "remote", "add", "origin", f"{url}/proj.git")
        (repo / "reader.sh").write_text(READER)
        (repo / "reader.sh").chmod(0o755)
        commit(repo, "A")
        pod.env.update({k: v for k, v in GIT_ENV.items() if k != "PATH"})
        pod.repo = repo
        yield pod


@pytest.mark.sim
def test_a_deploy_or_a_second_run_while_a_run_reads_the_checkout_is_refused(sim, pod4):
    repo, env = pod4.repo, pod4.env
    first = git(repo, "rev-parse", "HEAD")
    trigger = unique_name("end")
    started = tpufab("run", "reader.sh", "--args", trigger, "--detach", env=env, cwd=repo)
    assert started.returncode == 0, started.stderr
    run_id = started.stderr.split("Run ", 1)[1].split(":", 1)[0]
    second = commit(repo, "B")
    # before: the checkout was swapped under the run ("start A", then "end B")
    deploy = tpufab("deploy", env=env, cwd=repo)
    refused(deploy, f"Run {run_id} (reader.sh) is running in ~/proj on w[0-3]",
            "would change its code under it", f"tpufab kill --run {run_id}")
    # before: a second run started without a word (on a TPU: "TPU in use")
    again = tpufab("run", "reader.sh", "--args", trigger, "--detach", env=env, cwd=repo)
    refused(again, f"Run {run_id} (reader.sh) is still running on w[0-3]",
            "one job at a time", f"tpufab kill --run {run_id}")
    assert heads(sim, pod4) == {first}
    for w in range(4):
        in_worker(sim, pod4.node, w, f"touch /tmp/{trigger}")
    logs = tpufab("logs", "--run", run_id, "--follow", env=env, cwd=repo)
    assert logs.returncode == 0, logs.stderr
    assert "start A" in logs.stdout and "end A" in logs.stdout and "B" not in logs.stdout
    # once it ended, the deploy goes through
    deploy = tpufab("deploy", env=env, cwd=repo)
    assert deploy.returncode == 0, deploy.stderr
    assert heads(sim, pod4) == {second}


@pytest.mark.sim
@pytest.mark.parametrize("loser", [["deploy"], ["deploy", "--direct"]])
def test_two_deploys_at_once_never_both_report_success(sim, pod4, loser):
    repo, env = pod4.repo, pod4.env
    assert tpufab("deploy", env=env, cwd=repo).returncode == 0
    marker = unique_name("hook")
    for w in range(4):  # the next checkout hangs in a hook until the test releases it
        in_worker(sim, pod4.node, w, "printf '#!/bin/sh\\nwhile [ ! -e /tmp/%s ]; do sleep "
                  "0.05; done\\n' " + marker + " > ~/proj/.git/hooks/post-checkout && chmod +x "
                  "~/proj/.git/hooks/post-checkout")
    winner_commit = commit(repo, unique_name("W"))
    winner = start("deploy", env=env, cwd=repo)
    try:
        wait_for(lambda: "hooks/post-checkout" in in_worker(sim, pod4.node, 3, "ps -eo args="),
                 60, what="the first deploy to hang in its hook")
        loser_commit = commit(repo, unique_name("L"))
        # refused, not waiting for the first (which waits for the test; it takes seconds, the
        # bound leaves room for a loaded machine): a loser still running then fails with every
        # thread's stack
        second = tpufab_within(120, *loser, env=env, cwd=repo)
        # before: both exited 0, the loser for a commit the workers did not hold
        refused(second, "Another tpufab is changing the code on w0",
                f"deploy {winner_commit[:12]} by ", "wait for it to finish, then deploy again")
        for w in range(4):
            in_worker(sim, pod4.node, w, f"touch /tmp/{marker}")
        out, err = winner.communicate(timeout=120)
    finally:
        if winner.poll() is None:
            winner.kill()
        for w in range(4):
            in_worker(sim, pod4.node, w, f"touch /tmp/{marker}; rm -f "
                      "~/proj/.git/hooks/post-checkout")
    assert winner.returncode == 0, err
    assert f"Deployed {winner_commit[:12]}" in out
    assert heads(sim, pod4) == {winner_commit} != {loser_commit}


@pytest.mark.sim
def test_a_killed_deployer_leaves_no_lease_behind(sim, pod4):
    repo, env = pod4.repo, pod4.env
    assert tpufab("deploy", env=env, cwd=repo).returncode == 0
    marker = unique_name("hook")
    for w in range(4):
        in_worker(sim, pod4.node, w, "printf '#!/bin/sh\\nwhile [ ! -e /tmp/%s ]; do sleep "
                  "0.05; done\\n' " + marker + " > ~/proj/.git/hooks/post-checkout && chmod +x "
                  "~/proj/.git/hooks/post-checkout")
    commit(repo, unique_name("K"))
    victim = start("deploy", env=env, cwd=repo)
    try:
        wait_for(lambda: "hooks/post-checkout" in in_worker(sim, pod4.node, 0, "ps -eo args="),
                 60, what="the deploy to hang in its hook")
        victim.send_signal(signal.SIGKILL)
        victim.wait(30)
    finally:
        for w in range(4):
            in_worker(sim, pod4.node, w, f"touch /tmp/{marker}; rm -f "
                      "~/proj/.git/hooks/post-checkout")
    latest = commit(repo, unique_name("after"))
    # the lease died with the killed process's connection: the next deploy goes through
    again = wait_for(lambda: (lambda r: r if r.returncode == 0 else None)(
        tpufab("deploy", env=env, cwd=repo)), 60, interval=0.5, what="the next deploy")
    assert f"Deployed {latest[:12]}" in again.stdout
    assert heads(sim, pod4) == {latest}


def running_runs(env: dict, cwd: Path) -> list[str]:
    """The runs `tpufab runs` finds running (or starting) on the pod."""
    import json

    listed = tpufab("runs", "--json", env=env, cwd=cwd)
    assert listed.returncode == 0, listed.stderr
    rows = json.loads(listed.stdout)["rows"]
    return [r["run"] for r in rows if any(s in ("running", "starting")
                                          for s in r["workers"].values())]


def end_reader(sim, pod, trigger: str) -> None:
    for w in range(4):
        in_worker(sim, pod.node, w, f"touch /tmp/{trigger}")


@pytest.mark.sim
def test_babysit_and_launch_beside_a_running_run_are_refused(sim, pod4):
    """One job at a time, whichever way it starts (issue 37, finding 12b): babysit and launch
    take the start path `run` takes (the code lease, the check for a live run). Before:
    `babysit --no-deploy` started a second job beside the run without a word, and babysit
    and launch deployed first (into another checkout, or refused by deploy's own check)."""
    repo, env = pod4.repo, pod4.env
    trigger = unique_name("end")
    started = tpufab("run", "reader.sh", "--args", trigger, "--detach", env=env, cwd=repo)
    assert started.returncode == 0, started.stderr
    run_id = started.stderr.split("Run ", 1)[1].split(":", 1)[0]
    first = git(repo, "rev-parse", "HEAD")
    (repo / "task.yaml").write_text("workdir: .\nrun: |\n  ./reader.sh never\n")
    commit(repo, unique_name("T"))
    busy = (f"Run {run_id} (reader.sh) is still running on w[0-3]", "one job at a time",
            f"tpufab kill --run {run_id}")
    try:
        for argv in (["babysit", "reader.sh", "--no-deploy", "--max-restarts", "0"],
                     ["babysit", "reader.sh", "--max-restarts", "0"]):
            refused(tpufab(*argv, env=env, cwd=repo), *busy, "then babysit again")
        launched = tpufab("launch", "task.yaml", env=env, cwd=repo)
        assert launched.returncode != 0 and "Traceback" not in launched.stderr
        assert all(f in launched.stderr for f in (*busy, "then launch again")), \
            launched.stderr
        assert running_runs(env, repo) == [run_id]        # no second job on the pod
        assert heads(sim, pod4) == {first}                # and nothing deployed
    finally:
        end_reader(sim, pod4, trigger)
    wait_for(lambda: not running_runs(env, repo), 60, what=f"run {run_id} to end")


@pytest.mark.sim
def test_a_second_laptop_babysitting_the_pod_is_refused(sim, pod4, tmp_path):
    """Two laptops babysitting one pod (each its own babysit lock, which is local): the
    second is refused on the pod, before it deploys or starts anything; the first goes on."""
    repo, env = pod4.repo, pod4.env
    trigger = unique_name("end")
    first = start("babysit", "reader.sh", "--args", trigger, "--max-restarts", "0",
                  env=env, cwd=repo)
    try:
        [run_id] = wait_for(lambda: running_runs(env, repo), 120,
                            what="the first laptop's babysit to start its run")
        deployed = heads(sim, pod4)
        commit(repo, unique_name("L2"))
        laptop2 = {**env, "TPUFAB_STATE_DIR": str(tmp_path / "laptop2")}
        for extra in (["--no-deploy"], []):
            refused(tpufab("babysit", "reader.sh", "--max-restarts", "0", *extra, env=laptop2,
                           cwd=repo),
                    f"Run {run_id} (reader.sh) is still running on w[0-3]",
                    "one job at a time", "then babysit again")
        assert running_runs(env, repo) == [run_id] and heads(sim, pod4) == deployed
        end_reader(sim, pod4, trigger)
        out, err = first.communicate(timeout=120)
    finally:
        end_reader(sim, pod4, trigger)
        if first.poll() is None:
            first.kill()
            first.wait(30)
    assert first.returncode == 0, err
    assert f"babysit: run {run_id} finished after 0 restarts" in err, err
