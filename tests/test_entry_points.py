"""Verbs through the doors users open: `invoke` in a project whose tasks.py is tpufab's, for the
tasks no other test drives that way (ssh, run, logs, runs, kill, status, babysit, sim.up,
sim.down, sim.burst, sim.zombie), `tpufab sim up`/`down` on a pod of their own, and babysit's
recovery from a preemption with `tpufab babysit` as its own process."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import threading

import pytest
from harness import sim_node
from helpers import (
    INVOKE,
    POD_USER,
    REPO,
    TPUFAB,
    free_port,
    one_sentence,
    tpufab,
    unique_name,
    wait_for,
)

pytestmark = pytest.mark.sim

RECIPE = """#!/bin/sh
# attempt 0 waits for /tmp/$GO (or ends at once without GO); later attempts end at once
echo "attempt $TPUFAB_RESTART_COUNT on w$TPUFAB_WORKER_ID"
if [ -n "$GO" ] && [ "${TPUFAB_RESTART_COUNT:-0}" = 0 ]; then
    while [ ! -e "/tmp/$GO" ]; do sleep 0.05; done
fi
echo "recipe done"
"""


@pytest.fixture(scope="module")
def pod1(sim, tmp_path_factory):
    """A READY v4-8 (one worker) and a project dir whose tasks.py is tpufab's."""
    with sim_node(sim, tmp_path_factory, "ep", "v4-8", ssh_user=POD_USER) as pod:
        pod.project = pod.home / "project"
        pod.project.mkdir()
        shutil.copy(REPO / "tasks.py", pod.project / "tasks.py")
        (pod.project / "recipe.sh").write_text(RECIPE)
        (pod.project / "recipe.sh").chmod(0o755)
        yield pod


def inv(pod1, *args: str, timeout: float = 180, input: str | None = None
        ) -> subprocess.CompletedProcess:
    return subprocess.run([INVOKE, *args], env=pod1.env, cwd=pod1.project,
                          capture_output=True, text=True, timeout=timeout, input=input,
                          stdin=None if input is not None else subprocess.DEVNULL)


def ok(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Traceback" not in result.stdout + result.stderr
    return result.stdout + result.stderr


def test_invoke_tasks_in_a_project(pod1):
    # a crashed job's mess, reported by a dry run, cleared by kill, seen by status
    made = ok(inv(pod1, "sim.zombie"))
    assert "w0" in made and "ignores SIGTERM" in made
    dry = ok(inv(pod1, "kill", "--dry-run"))
    assert "would kill" in dry and "nothing was signalled" in dry
    killed = ok(inv(pod1, "kill", "--force", "--grace", "1"))
    assert "TPU free on w0: yes." in killed
    status = ok(inv(pod1, "status"))
    assert f"TPU node {pod1.name}: v4-8 READY" in status and "4 free" in status

    # a run, its logs (folded and raw), the runs table
    ran = ok(inv(pod1, "run", "recipe.sh", "--no-deploy"))
    run_id = re.search(r"Run (\S+) finished on w0: exit 0", ran).group(1)
    assert "recipe done" in ran
    assert "recipe done" in ok(inv(pod1, "logs"))
    assert "w0 │ recipe done" in ok(inv(pod1, "logs", "--raw", "--run", run_id))
    assert "recipe done" in ok(inv(pod1, "logs", "--follow", "--run", run_id))
    listed = ok(inv(pod1, "runs"))
    assert run_id in listed and "exited 0" in listed

    # a shell on one worker over the system ssh, with the pinned host key (stdin: no tty)
    shell = inv(pod1, "ssh", "--worker", "0", input="hostname\n")
    assert shell.returncode == 0, shell.stderr
    assert shell.stdout.strip().endswith("-w-0"), shell.stdout

    # babysit of a recipe that ends by itself: one attempt, exit 0
    sat = ok(inv(pod1, "babysit", "recipe.sh", "--no-deploy", "--max-restarts", "0"))
    assert "recipe done" in sat

    # a 503 burst is retried with a note, then the verb works
    ok(inv(pod1, "sim.burst", "--count", "2"))
    busy = inv(pod1, "status")
    assert busy.returncode == 0 and busy.stderr.count("TPU API busy (503") == 2, busy.stderr


def test_sim_up_status_down_through_the_command_line(tmp_path):
    """`tpufab sim up` / `invoke sim.down` on a state dir and port of their own."""
    state = tmp_path / "sim"
    env = {k: v for k, v in os.environ.items() if not k.startswith("TPUFAB_")}
    env.update(HOME=str(tmp_path), TPUFAB_USER_CONFIG=str(tmp_path / "none.yaml"))
    port = free_port()
    try:
        up = tpufab("sim", "up", "--port", str(port), "--state-dir", str(state), env=env)
        assert up.returncode == 0, up.stderr
        assert f"export TPUFAB_API_ENDPOINT=http://127.0.0.1:{port}" in up.stdout
        listed = tpufab("list", env={**env, "TPUFAB_API_ENDPOINT": f"http://127.0.0.1:{port}",
                                     "TPUFAB_PROJECT": "p", "TPUFAB_ZONE": "us-central2-b"})
        assert listed.returncode == 0, listed.stderr
        down = subprocess.run([INVOKE, "sim.down", "--state-dir", str(state)], env=env,
                              cwd=REPO, capture_output=True, text=True, timeout=120)
        assert down.returncode == 0, down.stderr
        gone = tpufab("sim", "status", "--state-dir", str(state), env=env)
        assert gone.returncode == 3 and "not running" in gone.stdout
        # `sim down` twice is a quiet no-op
        assert tpufab("sim", "down", "--state-dir", str(state), env=env).returncode == 0
    finally:
        tpufab("sim", "down", "--state-dir", str(state), env=env)


def test_sim_up_again_on_the_same_port_at_once(tmp_path):
    """Finding 10: `sim up` on the port `sim down` just freed, after client traffic (closed
    connections in TIME_WAIT), works at once."""
    state = tmp_path / "sim"
    env = {k: v for k, v in os.environ.items() if not k.startswith("TPUFAB_")}
    env.update(HOME=str(tmp_path), TPUFAB_USER_CONFIG=str(tmp_path / "none.yaml"))
    port = free_port()
    api = {"TPUFAB_API_ENDPOINT": f"http://127.0.0.1:{port}", "TPUFAB_PROJECT": "p",
           "TPUFAB_ZONE": "us-central2-b"}
    try:
        assert tpufab("sim", "up", "--port", str(port), "--state-dir", str(state),
                      env=env).returncode == 0
        assert tpufab("list", env={**env, **api}).returncode == 0     # client traffic
        assert tpufab("sim", "down", "--state-dir", str(state), env=env).returncode == 0
        again = tpufab("sim", "up", "--port", str(port), "--state-dir", str(state), env=env)
        assert again.returncode == 0, again.stderr
        assert tpufab("list", env={**env, **api}).returncode == 0
    finally:
        tpufab("sim", "down", "--state-dir", str(state), env=env)


def test_babysit_recovers_from_a_preemption_as_its_own_process(pod1, tmp_path):
    """`tpufab babysit` (a process of its own, not a thread): the node is preempted while
    attempt 0 runs; babysit recreates it, runs the recipe again, and exits 0."""
    go = unique_name("go")
    proc = subprocess.Popen([TPUFAB, "babysit", "recipe.sh", "--no-deploy", "--env", f"GO={go}",
                             "--max-restarts", "1"], env=pod1.env, cwd=pod1.project,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            stdin=subprocess.DEVNULL)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    try:
        wait_for(lambda: any("attempt 0 on w0" in line for line in lines), 90,
                 what="attempt 0 to start")
        preempted = tpufab("sim", "preempt", pod1.name, env=pod1.env)
        assert preempted.returncode == 0, preempted.stderr
        assert proc.wait(timeout=240) == 0, "".join(lines)
        reader.join(10)
        out = "".join(lines)
        assert "attempt 1 on w0" in out and "recipe done" in out, out
        assert "Traceback" not in out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    status = ok(tpufab("status", env=pod1.env))
    assert f"TPU node {pod1.name}: v4-8 READY" in status


def test_a_bad_flag_value_is_one_sentence_through_invoke(pod1):
    one_sentence(inv(pod1, "exec", "--worker", "7", "true"), "Worker 7", "does not exist")



def test_deploy_ref_and_wip_through_the_command_line(pod1):
    """`tpufab deploy --direct --ref OLD` puts that commit on the workers, and `--wip` the
    working tree as it is (uncommitted change included), both as the worker then shows it."""
    repo = pod1.home / "ep-repo"
    repo.mkdir()
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t.invalid"]

    def sh(*argv: str) -> str:
        return subprocess.run([*git, *argv], cwd=repo, check=True, capture_output=True,
                              text=True).stdout.strip()

    sh("init", "-q", "-b", "main")
    for text in ("one", "two"):
        (repo / "data.txt").write_text(f"{text}\n")
        sh("add", "data.txt")
        sh("commit", "-q", "-m", text)
    old = sh("rev-parse", "HEAD~1")

    def on_worker(command: str) -> str:
        return ok(tpufab("exec", command, env=pod1.env, cwd=repo))

    deployed = ok(tpufab("deploy", "--direct", "--ref", "HEAD~1", "--dir", "~/ep-code",
                         env=pod1.env, cwd=repo))
    assert f"Deployed {old[:12]}" in deployed, deployed
    assert old in on_worker("git -C ~/ep-code rev-parse HEAD")
    assert "one" in on_worker("cat ~/ep-code/data.txt")

    (repo / "data.txt").write_text("not committed\n")
    refused = tpufab("deploy", "--direct", "--dir", "~/ep-code", env=pod1.env, cwd=repo)
    one_sentence(refused, "uncommitted changes", "--wip")
    ok(tpufab("deploy", "--direct", "--wip", "--dir", "~/ep-code", env=pod1.env, cwd=repo))
    assert "not committed" in on_worker("cat ~/ep-code/data.txt")
    assert sh("status", "--porcelain") == "M data.txt"       # the local tree is left as it was
