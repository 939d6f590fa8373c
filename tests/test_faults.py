"""The named fault scenarios of docs/reliability.md, on the simulated pod: one test per fault.

Every test name starts with ``test_fault_<n>_``, where n is the row of the table in
docs/reliability.md. Most drive `tpufab` as a subprocess, the way a user meets the fault.
"""

from __future__ import annotations

import re
import subprocess
import threading
from pathlib import Path

import pytest
from harness import sim_node
from helpers import (
    LOGIN,
    TPUFAB,
    Running,
    in_worker,
    interrupted_when,
    one_sentence,
    quiet_console,
    sim_settings,
    tpufab,
    unique_name,
    wait_for,
)

pytestmark = pytest.mark.sim


# ---------------------------------------------------------------------------------------------
# helpers


def processes(sim, node, worker: int, pattern: str) -> list[str]:
    out = in_worker(sim, node, worker, "ps -eo pid=,args=")
    return [line for line in out.splitlines() if pattern in line and "ps -eo" not in line]


def no_orphans(sim, node, pattern: str, workers=range(4)) -> None:
    """Wait (bounded) until no process matching ``pattern`` is left on any worker."""
    for w in workers:
        wait_for(lambda w=w: not processes(sim, node, w, pattern), 15,
                 what=f"no {pattern!r} left on w{w}")


@pytest.fixture(scope="module")
def pod4(sim, tmp_path_factory):
    """A READY v4-32 (4 workers), its Settings, and the environment of a user's shell."""
    with sim_node(sim, tmp_path_factory, "flt", "v4-32") as pod:
        yield pod


def release(sim, pod4, marker: str, workers=range(4)) -> None:
    for w in workers:
        in_worker(sim, pod4.node, w, f"touch /tmp/{marker}")


def wait_loop(marker: str) -> str:
    """A worker command that blocks until /tmp/<marker> exists (the test releases it)."""
    return f"while [ ! -e /tmp/{marker} ]; do sleep 0.05; done"


# ---------------------------------------------------------------------------------------------
# 1. a worker's sshd dies in the middle of a command


def test_fault_1_sshd_dies_mid_exec(sim, sim_admin, pod4):
    marker = unique_name("go1")
    command = f"echo started; {wait_loop(marker)}; echo finished"
    running = Running([TPUFAB, "exec", command], pod4.env)
    try:
        wait_for(lambda: sum(running.saw(f"w{w} │ started") for w in range(4)) == 4, 30,
                 what="the command to start on every worker")
        sim_admin.kill_sshd(pod4.name, 2)
        release(sim, pod4, marker, [0, 1, 3])
        result = running.wait(60)
    finally:
        running.kill()
    assert result.returncode == 1
    for w in (0, 1, 3):   # the others finished, their output intact and in order
        lines = [line for line in result.stdout.splitlines() if line.startswith(f"w{w} │")]
        assert lines == [f"w{w} │ started", f"w{w} │ finished"]
    assert "w2 │ finished" not in result.stdout
    assert "failed on 1 of 4 workers: w2 " in result.stderr          # the lost worker is named
    assert re.search(r"w2\s+the worker agent exited|w2\s+connection lost", result.stderr)
    assert "Traceback" not in result.stderr
    no_orphans(sim, pod4.node, f"/tmp/{marker}", [2])   # nothing left behind on w2
    again = tpufab("exec", "--worker", "2", "echo back", env=pod4.env)
    assert again.returncode == 0 and "w2 │ back" in again.stdout


# ---------------------------------------------------------------------------------------------
# 2. connection refused on the first attempts


def test_fault_2_connection_refused_then_retried(sim, sim_admin, pod4):
    from tpufab.hosts import connect as pods

    pod = pods.connect(pod4.settings, console=quiet_console())
    retries: list[tuple[int, int, str]] = []

    def on_retry(target, attempt, error):
        retries.append((target.worker, attempt, type(error).__name__))
        sim_admin.set_reachable(pod4.name, target.worker, True)   # back before the next try

    pod.fanout.on_retry = on_retry
    for w in (1, 3):
        sim_admin.set_reachable(pod4.name, w, False)
    try:
        result = pod.fanout.run("hostname")
        assert result.ok, result.summary()
        assert [result[w].stdout.strip()[-4:] for w in range(4)] == ["-w-0", "-w-1", "-w-2", "-w-3"]
        assert sorted(retries) == [(1, 1, "ConnectionRefusedError"),
                                   (3, 1, "ConnectionRefusedError")]
        # a worker that stays refused is named; the others still run
        pod.close()
        pod.fanout.on_retry = None
        sim_admin.set_reachable(pod4.name, 0, False)
        result = pod.fanout.run("true")
        assert result.summary() == "w0 connection refused; w[1-3] exit 0"
    finally:
        for w in range(4):
            sim_admin.set_reachable(pod4.name, w, True)
        pod.close()


# ---------------------------------------------------------------------------------------------
# 3. the API answers 503 or 429 in bursts


@pytest.mark.parametrize("code,why", [(503, "503"), (429, "429")])
def test_fault_3_api_burst_is_retried_with_backoff(sim_admin, pod4, code, why):
    sim_admin.error_burst(3, code=code)
    result = tpufab("list", env=pod4.env)
    assert result.returncode == 0, result.stderr
    notes = [line for line in result.stderr.splitlines() if "TPU API busy" in line]
    assert len(notes) == 3 and all(why in note for note in notes), result.stderr
    delays = [float(m) for m in re.findall(r"retrying in ([0-9.]+)s", result.stderr)]
    assert len(delays) == 3 and all(d > 0 for d in delays)
    assert [int(a) for a in re.findall(r"\(attempt (\d+)\)", result.stderr)] == [2, 3, 4]
    assert pod4.name in result.stdout and "Traceback" not in result.stderr


def test_fault_3_long_api_burst_is_one_sentence(sim_admin, pod4):
    sim_admin.error_burst(1000, code=503)
    env = {**pod4.env, "TPUFAB_API_RETRIES": "3"}
    result = tpufab("list", env=env)
    sentence = one_sentence(result, "kept failing with 503", "3 attempts")
    assert sentence.endswith(".")
    sim_admin.clear_faults()
    assert tpufab("list", env=pod4.env).returncode == 0   # and the next command works


# ---------------------------------------------------------------------------------------------
# 4. create hits RESOURCE_EXHAUSTED


@pytest.mark.parametrize("reason,immediate,fragments", [
    ("stockout", False, ["No v4-8 capacity is available", "stockout", "--spot", "--queued",
                         "--zone"]),
    ("stockout", True, ["No v4-8 capacity is available", "--spot", "--queued", "--zone"]),
    ("quota", False, ["Not enough quota", "--spot", "--zone"]),
    ("quota", True, ["Not enough quota", "--spot", "--zone"]),
])
def test_fault_4_resource_exhausted_is_one_sentence(sim_admin, pod4, reason, immediate,
                                                    fragments):
    name = unique_name("rx")
    sim_admin.fail_next_create(reason, immediate=immediate)
    result = tpufab("create", "--name", name, "--type", "v4-8", env=pod4.env)
    one_sentence(result, *fragments)
    listed = tpufab("list", env=pod4.env)
    assert listed.returncode == 0 and name not in listed.stdout   # nothing left behind


def test_fault_4_queued_resource_stockout_is_one_sentence(sim_admin, pod4):
    name = unique_name("rxq")
    sim_admin.fail_next_create("stockout")
    result = tpufab("create", "--name", name, "--type", "v4-8", "--queued", env=pod4.env)
    try:
        one_sentence(result, f"Queued resource {name!r} is FAILED", "no more capacity",
                     "--spot", "another --zone")
    finally:
        tpufab("delete", "--name", name, "--yes", env=pod4.env)


# ---------------------------------------------------------------------------------------------
# 6. Ctrl-C at the worst moment


def interrupted(result) -> None:
    assert result.returncode == 130, (result.returncode, result.stdout, result.stderr)
    assert "Traceback" not in result.stdout + result.stderr


def test_fault_6_ctrl_c_during_create(sim_admin, pod4, tmp_path):
    name = unique_name("cc")
    sim_admin.settings(create_delay=3.0)
    result = interrupted_when([TPUFAB, "create", "--name", name, "--type", "v4-8"], pod4.env,
                              lambda r: r.saw("CREATING"), "the create to be under way",
                              cwd=tmp_path)  # a create that ran on names its project's pod
    interrupted(result)
    assert "Interrupted" in result.stderr
    sim_admin.settings(create_delay=0.2)
    try:
        # the node carries on in the background; the next create waits for it, then says so
        again = tpufab("create", "--name", name, "--type", "v4-8", env=pod4.env, cwd=tmp_path)
        assert again.returncode == 0, again.stderr
        assert "already exists" in again.stdout and "READY" in again.stdout
        assert tpufab("exec", "--name", name, "echo fine", env=pod4.env).returncode == 0
    finally:
        tpufab("delete", "--name", name, "--yes", env=pod4.env)


def test_fault_6_ctrl_c_during_setup(sim, pod4, tmp_path):
    marker = unique_name("setup")
    script = tmp_path / "setup.sh"
    script.write_text(f"#!/bin/sh\necho setting-up\n{wait_loop(marker)}\necho done-setting-up\n")
    result = interrupted_when([TPUFAB, "setup", "--raw", "--script", str(script)], pod4.env,
                              lambda r: all(r.saw(f"w{w} │ setting-up") for w in range(4)),
                              "setup to run on every worker")
    interrupted(result)
    no_orphans(sim, pod4.node, f"/tmp/{marker}")
    # nothing marked done: the next setup runs the script again, to the end
    release(sim, pod4, marker)
    again = tpufab("setup", "--script", str(script), env=pod4.env)
    assert again.returncode == 0, again.stderr
    assert "w[0-3] ran" in again.stdout


def test_fault_6_ctrl_c_during_exec(sim, pod4):
    marker = unique_name("exec")
    result = interrupted_when([TPUFAB, "exec", f"echo started; {wait_loop(marker)}"], pod4.env,
                              lambda r: all(r.saw(f"w{w} │ started") for w in range(4)),
                              "the command to start on every worker")
    interrupted(result)
    assert "Interrupted: stopped" in result.stderr
    no_orphans(sim, pod4.node, f"/tmp/{marker}")
    again = tpufab("exec", "--gather", "echo fine", env=pod4.env)
    assert again.returncode == 0 and "w[0-3] (exit 0)" in again.stdout


@pytest.mark.parametrize("how", ["one-shot", "agent", "timeout"])
def test_fault_6_ctrl_c_during_exec_of_a_root_command(sim, pod4, how):
    """What a command runs under sudo is root, out of the user's reach: sudo relays no SIGKILL
    (and drops a SIGTERM that comes while it starts its command). Interrupted or timed out, a
    root process that ignores SIGTERM still goes, on the one-shot path and through the agent."""
    marker = unique_name("root")
    command = (f"sudo -n sh -c 'trap \"\" TERM; echo started $(id -u); "
               f"{wait_loop(marker)}'")
    argv = [TPUFAB, "exec", command]
    env = pod4.env
    if how == "agent":      # an environment to pass: the agent runs it, not the one-shot wrapper
        env = {**env, "GO": marker}
        argv[2:2] = ["--env", "GO"]
    if how == "timeout":
        result = tpufab(*argv[1:2], "--timeout", "2", command, env=env)
        assert result.returncode != 0
        assert "timed out after 2 s" in result.stdout + result.stderr
    else:
        result = interrupted_when(argv, env,
                                  lambda r: all(r.saw(f"w{w} │ started 0") for w in range(4)),
                                  "the root command to start on every worker")
        interrupted(result)
    no_orphans(sim, pod4.node, f"/tmp/{marker}")


DEPLOY_DRIVER = """
import sys
from tpufab.steps.code import deploy
from tpufab.hosts import connect as pod
from tpufab.term.console import run
from tpufab.verbs.common import settings_from_flags

def main():
    group = pod.shared(settings_from_flags()).fanout
    report = deploy.deploy(group, direct=True, dir="~/proj", cwd=sys.argv[1])
    print("deployed", report.commit, flush=True)

sys.exit(run(main))
"""


def git(cwd: Path, *args: str) -> str:
    env = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t", "PATH": "/usr/bin:/bin", "HOME": str(cwd)}
    return subprocess.run(["git", *args], cwd=cwd, env=env, check=True, capture_output=True,
                          text=True).stdout.strip()


def test_fault_6_ctrl_c_during_deploy(sim, pod4, tmp_path):
    import sys

    repo = tmp_path / "proj"
    repo.mkdir()
    git(repo, "init", "-q", "-b", "main")
    (repo / "a.txt").write_text("one\n")
    git(repo, "add", "a.txt")
    git(repo, "commit", "-q", "-m", "one")
    driver = tmp_path / "deploy_driver.py"
    driver.write_text(DEPLOY_DRIVER)
    argv = [sys.executable, str(driver), str(repo)]
    first = subprocess.run(argv, env=pod4.env, capture_output=True, text=True, timeout=120)
    assert first.returncode == 0, first.stderr
    # a post-checkout hook on every worker makes the next checkout hang until released
    marker = unique_name("deploy")
    for w in range(4):
        in_worker(sim, pod4.node, w, f"printf '#!/bin/sh\\necho hook >&2\\n{wait_loop(marker)}\\n' "
                  "> ~/proj/.git/hooks/post-checkout && chmod +x ~/proj/.git/hooks/post-checkout",
                  user=LOGIN)
    (repo / "a.txt").write_text("two\n")
    git(repo, "commit", "-q", "-am", "two")
    second = git(repo, "rev-parse", "HEAD")
    result = interrupted_when(
        argv, pod4.env,
        lambda _: all(processes(sim, pod4.node, w, "hooks/post-checkout") for w in range(4)),
        "the checkout to hang in its hook on every worker")
    interrupted(result)
    no_orphans(sim, pod4.node, "hooks/post-checkout")
    no_orphans(sim, pod4.node, "deploy_worker.py")
    # the next deploy finishes (the hook no longer blocks) and every worker is at `second`
    release(sim, pod4, marker)
    again = subprocess.run(argv, env=pod4.env, capture_output=True, text=True, timeout=120)
    assert again.returncode == 0, again.stderr
    assert f"deployed {second}" in again.stdout
    for w in range(4):
        assert in_worker(sim, pod4.node, w, "git -C ~/proj rev-parse HEAD",
                         user=LOGIN).strip() == second


# ---------------------------------------------------------------------------------------------
# 5. preemption in the middle of a babysat run

BABYSAT = """#!/bin/sh
echo "attempt $TPUFAB_RESTART_COUNT on w$TPUFAB_WORKER_ID in $(basename "$PWD") at $(cat version.txt)"
echo "setup: $(cat ~/setup-marker 2>/dev/null || echo missing)"
echo "bucket: $(cat /tmp/bkt/hello.txt 2>/dev/null || echo missing)"
if [ "$TPUFAB_RESTART_COUNT" = 0 ]; then
    while true; do sleep 0.05; done     # until the node is preempted under it
fi
echo "finished attempt $TPUFAB_RESTART_COUNT"
"""


def test_fault_5_preemption_mid_babysat_run(sim, sim_admin, tmp_path, monkeypatch):
    import shutil

    from tpufab.cloud import lifecycle
    from tpufab.cloud.planes.tpu import TpuApi
    from tpufab.flows.babysit import loop
    from tpufab.hosts import connect as pods
    from tpufab.sim.admin import StorageClient
    from tpufab.steps.host import mount
    from tpufab.steps.host.setup import run_setup

    home = tmp_path / "home"
    home.mkdir()
    settings = sim_settings(sim, home, name=unique_name("pre"), type="v4-16", spot=True)
    with_bucket = bool(sim.storage_endpoint) and shutil.which("rclone") is not None
    lifecycle.create(settings, console=quiet_console())
    try:
        # the pod as a user left it: set up, a bucket mounted, and babysit deploys the repo
        pod = pods.shared(settings)
        run_setup(pod.fanout, b"#!/bin/sh\necho ran >> ~/setup-marker\n")[0].close()
        if with_bucket:
            bucket = unique_name("bkt")
            StorageClient(sim.storage_endpoint).create_bucket(bucket)
            mount.mount(pod.fanout, f"gs://{bucket}", at="/tmp/bkt", driver="rclone",
                        endpoint=sim.storage_endpoint,
                        options=["--dir-cache-time", "1s", "--vfs-write-back", "0s"])
            pod.fanout.run("echo from-the-bucket > /tmp/bkt/hello.txt", workers=[0],
                           check=True)
        repo = tmp_path / "proj"
        repo.mkdir()
        git(repo, "init", "-q", "-b", "main")
        (repo / "version.txt").write_text("v1\n")
        recipe = repo / "babysat.sh"
        recipe.write_text(BABYSAT)
        recipe.chmod(0o755)
        git(repo, "add", ".")
        git(repo, "commit", "-q", "-m", "v1")
        commit = git(repo, "rev-parse", "HEAD")
        monkeypatch.chdir(repo)
        before = TpuApi(settings).get_node(settings.name)

        sitter = loop.Babysitter(settings, recipe, direct=True, poll=0.3, backoff=(0.0, 0.0),
                                 console=quiet_console(), base_dir=tmp_path / "local")
        outcome: dict = {}
        thread = threading.Thread(target=lambda: outcome.update(
            result=_catch(sitter.run)), daemon=True)
        thread.start()
        first_logs = lambda: sitter.log_dir / "attempt-0"  # noqa: E731
        wait_for(lambda: "result" in outcome or sitter.log_dir is not None and all(
            "attempt 0" in _read(first_logs() / f"w{w}.log") for w in (0, 1)), 60,
            what="attempt 0 to be running (its logs copied locally)")
        if "result" in outcome:
            raise outcome["result"]
        sim_admin.preempt(settings.name)
        thread.join(120)
        assert not thread.is_alive(), "babysit did not finish"
        result = outcome["result"]
        assert not isinstance(result, BaseException), result

        # recovered: a new node of the same spec, and the recipe ran again to the end
        after = TpuApi(settings).get_node(settings.name)
        assert after.id != before.id and after.state == "READY"
        assert (after.accelerator_type, after.spot, after.runtime_version) == \
            (before.accelerator_type, before.spot, before.runtime_version)
        assert [a.outcome for a in result.attempts] == ["preempted", "finished"]
        assert result.attempts[0].reason == f"TPU node {settings.name} was PREEMPTED"
        # the old attempt's logs are on disk locally
        for w in (0, 1):
            old = (result.log_dir / "attempt-0" / f"w{w}.log").read_text()
            assert f"attempt 0 on w{w} in proj at v1" in old
            new = (result.log_dir / "attempt-1" / f"w{w}.log").read_text()
            assert f"attempt 1 on w{w} in proj at v1" in new     # same commit, deployed again
            assert "setup: ran" in new                           # same setup script, run again
            if with_bucket:
                assert "bucket: from-the-bucket" in new          # same bucket, mounted again
            assert "finished attempt 1" in new
        assert result.log_dir == tmp_path / "local" / ".tpufab" / "runs" / result.run_id
        pod = pods.shared(settings)
        heads = pod.fanout.run("git -C ~/proj rev-parse HEAD", check=True)
        assert {r.stdout.strip() for r in heads.values()} == {commit}
    finally:
        if with_bucket:
            try:
                mount.umount(pods.shared(settings).fanout, "/tmp/bkt", lazy=True)
            except Exception:  # noqa: BLE001 - the node goes anyway
                pass
        pods.forget(settings)
        lifecycle.delete(settings, yes=True, console=quiet_console())


def _catch(fn):
    try:
        return fn()
    except BaseException as err:  # noqa: BLE001 - the test thread reports it
        return err


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


# ---------------------------------------------------------------------------------------------
# the same faults during `run` and `kill`

WAITING = """#!/bin/sh
echo "started w$TPUFAB_WORKER_ID"
while [ ! -e "/tmp/$GO" ]; do sleep 0.05; done
echo "finished w$TPUFAB_WORKER_ID"
"""


@pytest.fixture
def waiting_recipe(tmp_path):
    recipe = tmp_path / "waiting.sh"
    recipe.write_text(WAITING)
    recipe.chmod(0o755)
    return recipe


RECIPE_RUNNING = "recipe/waiting.sh"


def test_fault_1_sshd_dies_mid_run(sim, sim_admin, pod4, tmp_path, waiting_recipe):
    go = unique_name("go")
    env = {**pod4.env, "GO": go}
    running = Running([TPUFAB, "run", str(waiting_recipe), "--raw", "--no-deploy", "--env",
                       "GO"], env,
                      cwd=tmp_path)
    try:
        wait_for(lambda: sum(running.saw(f"w{w} │ started w{w}") for w in range(4)) == 4, 60,
                 what="the run to start on every worker")
        sim_admin.kill_sshd(pod4.name, 2)
        release(sim, pod4, go)
        result = running.wait(60)
    finally:
        running.kill()
    assert result.returncode != 0
    for w in (0, 1, 3):
        assert f"w{w} │ finished w{w}" in result.stdout
    assert "Lost w2 while following" in result.stderr and "Traceback" not in result.stderr
    [copy] = list((tmp_path / ".tpufab" / "runs").iterdir())
    for w in (0, 1, 3):   # their logs are intact locally
        assert (copy / f"w{w}.log").read_text() == f"started w{w}\nfinished w{w}\n"
    # the run itself went on on w2 (it is detached) and finished there
    wait_for(lambda: "exit_code" in in_worker(sim, pod4.node, 2,
                                              f"ls ~/.tpufab/runs/{copy.name}/", user=LOGIN),
             20,
             what="the run to end on w2")


@pytest.mark.parametrize("choice", ["kill", "detach"])
def test_fault_6_ctrl_c_during_run(sim, pod4, tmp_path, waiting_recipe, choice):
    go = unique_name("go")
    env = {**pod4.env, "GO": go}
    result = interrupted_when(
        [TPUFAB, "run", str(waiting_recipe), "--raw", "--no-deploy", "--env", "GO",
         "--on-interrupt", choice], env,
        lambda r: sum(r.saw(f"w{w} │ started w{w}") for w in range(4)) == 4,
        "the run to start on every worker", timeout=60, cwd=tmp_path)
    interrupted(result)
    [copy] = list((tmp_path / ".tpufab" / "runs").iterdir())
    run_id = copy.name
    if choice == "kill":
        no_orphans(sim, pod4.node, RECIPE_RUNNING)
    else:
        # detached on purpose: still recorded and running, and `kill --run` ends it
        assert f"tpufab kill --run {run_id}" in result.stderr
        listed = tpufab("runs", "--json", env=env, cwd=tmp_path)
        assert listed.returncode == 0, listed.stderr
        assert f'"{run_id}"' in listed.stdout and "running" in listed.stdout
        killed = tpufab("kill", "--run", run_id, env=env, cwd=tmp_path)
        assert killed.returncode == 0, killed.stderr
        no_orphans(sim, pod4.node, RECIPE_RUNNING)
    release(sim, pod4, go)
    again = tpufab("run", str(waiting_recipe), "--no-deploy", "--env", "GO", env=env,
                   cwd=tmp_path)
    assert again.returncode == 0, again.stderr


STUBBORN = """#!/bin/sh
trap '' TERM
echo "stubborn w$TPUFAB_WORKER_ID"
while true; do sleep 0.05; done
"""


def test_fault_6_ctrl_c_during_kill(sim, pod4, tmp_path):
    recipe = tmp_path / "stubborn.sh"
    recipe.write_text(STUBBORN)
    recipe.chmod(0o755)
    started = tpufab("run", str(recipe), "--no-deploy", "--detach", env=pod4.env, cwd=tmp_path)
    assert started.returncode == 0, started.stderr
    try:
        wait_for(lambda: all(processes(sim, pod4.node, w, "recipe/stubborn.sh")
                             for w in range(4)), 30, what="the stubborn run on every worker")
        # kill waits out a long grace for processes that ignore SIGTERM: interrupt it then
        # (as soon as its command line shows, so at times while sudo is still starting it)
        result = interrupted_when(
            [TPUFAB, "kill", "--grace", "30"], pod4.env,
            lambda _: all(processes(sim, pod4.node, w, "kill_worker") for w in range(4)),
            "kill to be waiting on every worker", cwd=tmp_path)
        interrupted(result)
        no_orphans(sim, pod4.node, "kill_worker")       # the kill itself left nothing behind
        again = tpufab("kill", "--grace", "1", env=pod4.env, cwd=tmp_path)
        assert again.returncode == 0, again.stderr       # and the next kill finishes the job
        no_orphans(sim, pod4.node, "recipe/stubborn.sh")
    finally:  # whatever failed above, the next tests on this pod start from a quiet pod
        tpufab("kill", "--grace", "1", env=pod4.env, cwd=tmp_path)


# ---------------------------------------------------------------------------------------------
# 8. a forwarded secret never shows


SECRET_RECIPE = """#!/bin/sh
echo "token sha256 $(printf %s "$HF_TOKEN" | sha256sum | cut -c1-16)"
while [ ! -e "/tmp/$GO" ]; do sleep 0.05; done
echo "done"
"""


def test_fault_8_forwarded_hf_token_never_appears(sim, pod4, tmp_path):
    import hashlib

    token = "hf_" + unique_name("SeCrEt").replace("-", "")
    recipe = tmp_path / "secret.sh"
    recipe.write_text(SECRET_RECIPE)
    recipe.chmod(0o755)
    go = unique_name("go")
    env = {**pod4.env, "GO": go, "HF_TOKEN": token}
    running = Running([TPUFAB, "run", str(recipe), "--raw", "--no-deploy", "--env", "GO", "--env",
                       "HF_TOKEN"], env, cwd=tmp_path)
    digest = hashlib.sha256(token.encode()).hexdigest()[:16]
    try:
        wait_for(lambda: sum(running.saw(f"w{w} │ token sha256 {digest}") for w in range(4))
                 == 4 or running.proc.poll() is not None, 60,
                 what="the recipe to see the token on every worker")
        assert running.proc.poll() is None, "".join(running.out + running.err)
        for w in range(4):   # while it runs: not in any process's argv on the worker
            argv = in_worker(sim, pod4.node, w, "cat /proc/[0-9]*/cmdline 2>/dev/null | "
                             "tr '\\0' ' '; ps -eo args")
            assert token not in argv
            # nor in any file tpufab keeps on the worker (records, env files, logs, scripts)
            found = in_worker(sim, pod4.node, w, f"grep -rl -- '{token}' /home /root /tmp "
                              "2>/dev/null || true")
            assert found.strip() == "", found
        release(sim, pod4, go)
        result = running.wait(60)
    finally:
        running.kill()
    assert result.returncode == 0, result.stderr
    assert token not in result.stdout + result.stderr
    assert "HF_TOKEN=***" in result.stderr                       # shown masked
    for path in (tmp_path / ".tpufab").rglob("*"):
        if path.is_file():
            assert token not in path.read_text(errors="replace"), path

