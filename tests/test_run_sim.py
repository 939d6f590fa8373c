"""run / logs / runs on a simulated v4-32 (real sshd workers, JAX on CPU), and their pure parts.

The verbs run as a user runs them: a small `python -c` that calls `tpufab.verbs.jobs` the way
the CLI does (exit code and output included); the test looks inside the workers through its
own connections.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from harness import connected_pod
from helpers import (
    Follower,
    call,
    on_workers,
    unique_name,
    wait_for,
    write_recipe,
)

from tpufab.ssh.remote_files import RemoteFile, verify_loader
from tpufab.steps.runs.env import Forwarded
from tpufab.steps.runs.running import (
    FollowSink,
    WorkerRuns,
    WorkerState,
    fold_states,
    latest_run,
    run_rows,
)
from tpufab.steps.start.plan import plan_run, start_command
from tpufab.views.folding import FoldingView

REPO = Path(__file__).resolve().parents[1]
SECRET = "hf_Zq8-must-never-leak-7431"
LONG = """#!/bin/sh
# Waits (bounded) for a trigger file named by its first argument.
echo "worker $TPUFAB_WORKER_ID of $TPUFAB_NUM_WORKERS started"
n=0
while [ ! -e "$1" ]; do
    n=$((n + 1))
    if [ $n -gt 1200 ]; then echo "no trigger" >&2; exit 9; fi
    echo "waiting"
    sleep 0.1
done
echo "worker $TPUFAB_WORKER_ID done"
"""

FAILS_ON_2 = """#!/bin/sh
echo "hello from $TPUFAB_WORKER_ID"
if [ "$TPUFAB_WORKER_ID" = 2 ]; then echo "worker 2 gives up" >&2; exit 3; fi
echo "bye"
"""

SECRET_PROBE = """#!/usr/bin/env python3
import hashlib, os, sys, time
token = os.environ.get("HF_TOKEN", "")
print("token sha256", hashlib.sha256(token.encode()).hexdigest(), flush=True)
deadline = time.monotonic() + 120
while not os.path.exists(sys.argv[1]) and time.monotonic() < deadline:
    time.sleep(0.1)
print("done", flush=True)
"""

# Run on a worker with NEEDLE (a secret, so it travels on stdin) in its environment.
FIND_NEEDLE = r"""
import os, sys
needle = os.environ["NEEDLE"].encode()
hits = []
for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            if needle in fh.read():
                hits.append("cmdline of " + pid)
    except OSError:
        pass
for root in sys.argv[1:]:
    for folder, _, files in os.walk(os.path.expanduser(root)):
        for name in files:
            with open(os.path.join(folder, name), "rb") as fh:
                if needle in fh.read():
                    hits.append(os.path.join(folder, name))
print(hits)
"""

# Processes on a worker that carry a run's id (whatever group or session they are in).
RUN_PROCESSES = r"""
import os, sys
needle = ("TPUFAB_RUN_ID=" + sys.argv[1]).encode()
pids = []
for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
        with open(f"/proc/{pid}/environ", "rb") as fh:
            if needle in fh.read().split(b"\0"):
                pids.append(int(pid))
    except OSError:
        pass
print(pids)
"""


# ---------------------------------------------------------------------------------------------
# pure parts


def test_plan_gives_each_worker_its_rank_and_the_same_secrets():
    recipe = RemoteFile("hello.sh", b"#!/bin/sh\necho hi\n", 0o755)
    plan = plan_run(recipe, slices=[[0, 1], [2, 3]], ips=["10.0.0.2", "10.0.0.3", "10.1.0.2",
                                                          "10.1.0.3"],
                    run_id="20261122-104455-ab12", args=["--steps", "3"], cwd="~/proj",
                    commit="c0ffee", forwarded=Forwarded({"XLA_FLAGS": "--x"},
                                                         {"HF_TOKEN": SECRET}))
    assert plan.workers == [0, 1, 2, 3]
    env = plan.environments[3].public
    assert env["TPUFAB_WORKER_ID"] == "3" and env["TPU_WORKER_ID"] == "1"
    assert env["MEGASCALE_SLICE_ID"] == "1" and env["MEGASCALE_NUM_SLICES"] == "2"
    # the coordinator's port is the run's (0xab12 % 500 = 294 past 8476), as MASTER_PORT is
    assert env["TPUFAB_COORDINATOR"] == "10.0.0.2:8770" and env["XLA_FLAGS"] == "--x"
    assert "HF_TOKEN" not in env and plan.secrets == {"HF_TOKEN": SECRET}
    line = start_command(plan)
    assert SECRET not in line
    launch = RemoteFile.bundled("run_worker.py")
    assert line.startswith(" ".join(["exec", "python3", "-I", "-S", "-c",
                                     shlex.quote(verify_loader()), "2", launch.sha256,
                                     launch.path, recipe.sha256, recipe.path, "start"]))
    assert "--env-stdin" in line and f"--env-file .tpufab/runs/.{plan.run_id}.env.json" in line
    assert "--recipe-sha256 " + hashlib.sha256(recipe.data).hexdigest() in line
    assert line.endswith("-- --steps 3") and "--cwd '~/proj'" in line


def test_runs_table_folds_worker_states():
    def entry(run, state, **more):
        return {"run": run, "state": state, "recipe": "x.sh", "started_at": 10.0, **more}

    statuses = {
        0: WorkerRuns(0, (entry("20261122-000001-aaaa", "exited", exit_code=0, ended_at=12.0),
                          entry("20261122-000002-bbbb", "running"))),
        1: WorkerRuns(1, (entry("20261122-000001-aaaa", "exited", exit_code=1, ended_at=13.0),
                          entry("20261122-000002-bbbb", "running"))),
        2: WorkerRuns(2, (entry("20261122-000002-bbbb", "killed", signal="SIGTERM"),)),
        3: WorkerRuns(3, error="connection refused"),
    }
    rows = run_rows(statuses)
    assert [r.run for r in rows] == ["20261122-000002-bbbb", "20261122-000001-aaaa"]
    assert rows[0].folded_states == "w[0-1] running; w2 killed (SIGTERM); " \
                              "w3 unreachable (connection refused)"
    assert rows[0].running and rows[0].ended_at is None
    assert rows[1].folded_states == "w0 exited 0; w1 exited 1; w2 no record; " \
                              "w3 unreachable (connection refused)"
    assert latest_run(statuses) == "20261122-000002-bbbb"
    assert fold_states([WorkerState(0, "lost"), WorkerState(1, "lost")]) == "w[0-1] lost"


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def fold_live(feed, workers=(0, 1, 2, 3), delay=1.0):
    """Feed (worker, line) pairs (None: advance the clock by `delay`) through a FoldingView."""
    out, clock = io.StringIO(), FakeClock()
    view = FoldingView(workers, out, delay=delay, clock=clock)
    for item in feed:
        if item is None:
            clock.now += delay
            view._emit()
        else:
            worker, line = item
            view.lines(worker, "stdout", (line + "\n").encode())
    view._emit(final=True)
    return out.getvalue().splitlines()


def test_live_fold_shows_common_lines_once_and_differences_with_their_workers():
    feed = []
    for w in range(4):
        feed += [(w, "start"), (w, f"rank {w}" if w else "rank 0"), (w, "step 1 loss 2.0")]
    feed += [(0, "done"), (1, "done"), (2, "warning: slow disk"), (2, "done"), (3, "done")]
    assert fold_live(feed) == ["start", "rank {0..3}", "step 1 loss 2.0",
                               "w2: warning: slow disk", "done"]


def test_live_fold_waits_for_a_lagging_worker_at_most_the_delay():
    out, clock = io.StringIO(), FakeClock()
    view = FoldingView([0, 1], out, delay=1.0, clock=clock)
    view.lines(0, "stdout", b"a\nb\n")
    assert out.getvalue() == ""                  # w1 has not got there yet
    view.lines(1, "stdout", b"a\n")
    assert out.getvalue() == "a\n"
    clock.now = 1.5
    view._emit()
    assert out.getvalue() == "a\nw0: b\n"          # shown with only the workers that printed it
    view.lines(1, "stdout", b"b\nc\n")              # late but identical: not shown again
    view.close()
    assert out.getvalue() == "a\nw0: b\nw1: c\n"


def test_live_fold_of_one_worker_is_its_log():
    assert fold_live([(0, "x"), (0, "y"), (0, "x")], workers=(0,)) == ["x", "y", "x"]


class Recorder:
    def __init__(self):
        self.seen, self.ended = [], []

    def lines(self, worker, stream, data):
        self.seen.append((worker, stream, data))

    def done(self, result):
        self.ended.append(result.worker)


def answered(kind: str, payload: dict) -> str:
    """What a worker script writes through the answer codec (workerlib.answer)."""
    import io

    from tpufab.remote.workerlib import answer

    out = io.StringIO()
    answer(kind, payload, out)
    return out.getvalue()


class FakeResult:
    """A follower's result as the fan-out reports it."""

    def __init__(self, worker, status, exit_code=0):
        from tpufab.ssh.results import WorkerResult

        self.inner = WorkerResult(worker, exit_code)
        self.inner.stderr_output.write(answered("state", status).encode())  # run_worker.py's

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_follow_sink_masks_secrets_keeps_status_lines_out_and_copies_logs(tmp_path):
    view, ended = Recorder(), []
    sink = FollowSink(view, secrets=[SECRET], copy_dir=tmp_path,
                      on_end=lambda w, state: ended.append((w, state.label)))
    sink.lines(2, "stdout", f"token={SECRET}\nstep 1\n".encode())
    status = {"state": "exited", "exit_code": 3, "run": "r"}
    sink.lines(2, "stderr", answered("state", status).encode() + b"Traceback\n")
    sink.done(FakeResult(2, {"state": "exited", "exit_code": 3}, exit_code=3))
    sink.close()
    assert view.seen == [(2, "stdout", b"token=***\nstep 1\n"), (2, "stderr", b"Traceback\n")]
    assert (tmp_path / "w2.log").read_text() == "token=***\nstep 1\n"
    assert view.ended == [2] and ended == [(2, "exited 3")]


# ---------------------------------------------------------------------------------------------
# on the simulated pod

@pytest.fixture(scope="module")
def pod_env(sim, tmp_path_factory):
    """A v4-32 with JAX set up (scripts/setup-sim.sh) and the environment naming it."""
    with connected_pod(sim, tmp_path_factory, "run", drop=("HF_TOKEN",), site="jax",
                       setup=True) as pod:
        yield pod.env, pod.pod, pod.base


def run_processes(pod, run_id: str) -> dict[int, list[int]]:
    return {w: json.loads(out) for w, out in
            on_workers(pod, ["python3", "-c", RUN_PROCESSES, run_id]).items()}


def run_states(env, cwd, run_id: str) -> dict[str, str]:
    listed = call(env, "runs", cwd=cwd, as_json=True)
    assert listed.returncode == 0, listed.stderr
    return next((r["workers"] for r in json.loads(listed.stdout)["rows"] if r["run"] == run_id),
                {})


def git_repo(folder: Path) -> str:
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t",
           "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"}
    for argv in (["git", "init", "-q", "-b", "main"], ["git", "add", "-A"],
                 ["git", "commit", "-q", "-m", "recipes"]):
        subprocess.run(argv, cwd=folder, check=True, env=env, capture_output=True)
    return subprocess.run(["git", "rev-parse", "HEAD"], cwd=folder, check=True, text=True,
                          capture_output=True).stdout.strip()


@pytest.mark.sim
def test_jax_hello_runs_on_every_worker_and_logs_fold(pod_env, tmp_path):
    env, pod, _ = pod_env
    project = tmp_path / "proj"
    (project / "recipes").mkdir(parents=True)
    shutil.copy(REPO / "recipes" / "jax_hello.sh", project / "recipes" / "jax_hello.sh")
    commit = git_repo(project)

    result = call(env, "run", cwd=project, recipe="recipes/jax_hello.sh", direct=True,
                  raw=True)
    assert result.returncode == 0, result.stdout + result.stderr
    for w in range(4):
        assert f"w{w} │ jax_hello: all-gather of process ids = [0, 1, 2, 3]" in result.stdout
        assert f"w{w} │ jax_hello: sum of (process index + 1) over all devices = 10 " \
               "(expected 10)" in result.stdout
        assert f"w{w} │ jax_hello: OK" in result.stdout
    assert f"Deployed {commit[:12]} to ~/proj on w[0-3]" in result.stderr
    assert "finished on w[0-3]: exit 0" in result.stderr
    run_id = result.stderr.split("Run ", 1)[1].split(":", 1)[0]
    # the run ran inside the deployed checkout, with the commit and the recipe's hash recorded
    records = on_workers(pod, f"cat ~/.tpufab/runs/{run_id}/meta.json")
    for text in records.values():
        meta = json.loads(text)
        assert meta["commit"] == commit and meta["cwd"] == "/home/tpufab/proj"
        assert meta["recipe_sha256"] == hashlib.sha256(
            (REPO / "recipes" / "jax_hello.sh").read_bytes()).hexdigest()
    # a local copy of every worker's log, in a folder git ignores
    assert (project / ".tpufab" / "runs" / run_id / "w3.log").read_text().endswith(
        "jax_hello: OK\n")
    assert subprocess.run(["git", "status", "--porcelain"], cwd=project, text=True,
                          capture_output=True).stdout == ""

    folded = call(env, "logs", cwd=project)                  # the latest run, folded
    assert folded.returncode == 0, folded.stderr
    lines = folded.stdout.splitlines()
    assert lines.count("jax_hello: OK") == 1
    assert lines.count("jax_hello: all-gather of process ids = [0, 1, 2, 3]") == 1
    assert not any(line.startswith("w") and "jax_hello: OK" in line for line in lines)
    assert f"Run {run_id}: jax_hello.sh - w[0-3] exited 0" in folded.stderr

    raw = call(env, "logs", cwd=project, run=run_id, raw=True, worker="1,3")
    assert raw.returncode == 0, raw.stderr
    assert [line for line in raw.stdout.splitlines() if line.endswith("jax_hello: OK")] == \
        ["w1 │ jax_hello: OK", "w3 │ jax_hello: OK"]


@pytest.mark.sim
def test_jax_hello_on_four_local_processes(pod_env, tmp_path):
    env, _, _ = pod_env
    result = call(env, "run", cwd=tmp_path, recipe=str(REPO / "recipes" / "jax_hello.sh"),
                  local=True, workers=4)
    assert result.returncode == 0, result.stdout + result.stderr
    for w in range(4):
        assert f"w{w}: jax_hello: sum of (process index + 1) over all devices = 10 " \
               "(expected 10)" in result.stdout
    assert "All 4 workers exited 0." in result.stderr


@pytest.mark.sim
def test_a_worker_that_fails_makes_run_fail_and_is_named(pod_env, tmp_path):
    env, _, _ = pod_env
    recipe = write_recipe(tmp_path, "fails.sh", FAILS_ON_2)
    result = call(env, "run", cwd=tmp_path, recipe=str(recipe), no_deploy=True, raw=True)
    assert result.returncode == 3, result.stdout + result.stderr
    assert "w2 │ worker 2 gives up" in result.stdout
    assert "failed on w2: w[0-1,3] exited 0; w2 exited 3." in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.sim
def test_secrets_never_reach_output_files_or_command_lines(pod_env, tmp_path):
    from tpufab.quoting import Secret

    env, pod, _ = pod_env
    recipe = write_recipe(tmp_path, "probe.py", SECRET_PROBE)
    trigger = f"/tmp/go-{unique_name()}"
    started = call(env, "run", cwd=tmp_path, recipe=str(recipe), no_deploy=True, detach=True,
                   args=trigger, env=["HF_TOKEN", "XLA_FLAGS=--xla_dump_to=/tmp/x"],
                   extra_env={"HF_TOKEN": SECRET})
    assert started.returncode == 0, started.stderr
    assert "HF_TOKEN=*** " in started.stderr and "XLA_FLAGS=--xla_dump_to=/tmp/x" in started.stderr
    run_id = started.stderr.split("Run ", 1)[1].split(":", 1)[0]
    # while the recipe runs: no argv on any worker holds the token, nor does any run file
    needle = {"secrets": {"NEEDLE": Secret(SECRET)}}
    found = on_workers(pod, ["python3", "-c", FIND_NEEDLE, "~/.tpufab/runs"], **needle)
    assert set(found.values()) == {"[]"}, found
    consumed = on_workers(pod, f"test ! -e ~/.tpufab/runs/.{run_id}.env.json && echo gone")
    assert set(consumed.values()) == {"gone"}                 # the env file was read and removed

    on_workers(pod, ["touch", trigger])
    followed = call(env, "logs", cwd=tmp_path, run=run_id, follow=True)
    assert followed.returncode == 0, followed.stderr
    digest = hashlib.sha256(SECRET.encode()).hexdigest()
    assert followed.stdout.splitlines() == [f"token sha256 {digest}", "done"]
    assert f"Run {run_id}: w[0-3] exited 0." in followed.stderr
    for text in (started.stdout, started.stderr, followed.stdout, followed.stderr):
        assert SECRET not in text
    found = on_workers(pod, ["python3", "-c", FIND_NEEDLE, "~/.tpufab/runs"], **needle)
    assert set(found.values()) == {"[]"}, found


@pytest.mark.sim
def test_a_run_survives_its_follower_being_killed(pod_env, tmp_path):
    env, pod, _ = pod_env
    recipe = write_recipe(tmp_path, "long.sh", LONG)
    trigger = f"/tmp/go-{unique_name()}"
    follower = Follower(env, tmp_path, recipe=str(recipe), no_deploy=True, args=trigger)
    run_id = follower.run_id()
    follower.wait_lines("worker {0..3} of 4 started", 1)   # folded: one line
    follower.proc.kill()                                      # SIGKILL: no goodbye
    assert follower.finish() == -signal.SIGKILL

    assert run_states(env, tmp_path, run_id) == {str(w): "running" for w in range(4)}
    assert all(run_processes(pod, run_id).values())
    on_workers(pod, ["touch", trigger])
    wait_for(lambda: run_states(env, tmp_path, run_id) == {str(w): "exited 0" for w in range(4)},
             60, 0.2, "the run to end and its exit code to be recorded")
    logs = call(env, "logs", cwd=tmp_path, run=run_id).stdout.splitlines()
    assert "worker {0..3} done" in logs, "\n".join(logs)       # every worker's, folded (the ranks in braces)


@pytest.mark.sim
def test_ctrl_c_with_kill_stops_the_run_everywhere(pod_env, tmp_path):
    env, pod, _ = pod_env
    recipe = write_recipe(tmp_path, "long.sh", LONG)
    follower = Follower(env, tmp_path, recipe=str(recipe), no_deploy=True,
                        args=f"/tmp/never-{unique_name()}", on_interrupt="kill")
    run_id = follower.run_id()
    follower.wait_lines("worker {0..3} of 4 started", 1)   # folded: one line
    assert all(run_processes(pod, run_id).values())
    follower.proc.send_signal(signal.SIGINT)
    assert follower.finish() == 130
    assert any(f"Stopped run {run_id} on w[0-3] (SIGTERM)." in line for line in follower.err), \
        follower.err
    assert run_processes(pod, run_id) == {w: [] for w in range(4)}
    assert run_states(env, tmp_path, run_id) == {str(w): "killed (SIGTERM)" for w in range(4)}


@pytest.mark.sim
def test_ctrl_c_without_a_terminal_detaches_and_kill_stops_the_run(pod_env, tmp_path):
    env, pod, _ = pod_env
    recipe = write_recipe(tmp_path, "long.sh", LONG)
    follower = Follower(env, tmp_path, recipe=str(recipe), no_deploy=True,
                        args=f"/tmp/never-{unique_name()}")
    run_id = follower.run_id()
    follower.wait_lines("worker {0..3} of 4 started", 1)   # folded: one line
    follower.proc.send_signal(signal.SIGINT)
    assert follower.finish() == 130
    said = "\n".join(follower.err)
    assert f"run {run_id} keeps running on w[0-3]" in said
    assert f"tpufab kill --run {run_id}" in said
    assert run_states(env, tmp_path, run_id) == {str(w): "running" for w in range(4)}

    killed = call(env, "kill", cwd=tmp_path, run=run_id, grace=2)
    assert killed.returncode == 0, killed.stdout + killed.stderr
    assert any(line.startswith("w[0-3]") and f"run        {run_id}: stopped" in line
               for line in killed.stdout.splitlines()), killed.stdout
    assert "Nothing to kill" not in killed.stdout
    assert run_processes(pod, run_id) == {w: [] for w in range(4)}


@pytest.mark.sim
def test_an_unreachable_worker_stops_the_run_before_anything_starts(pod_env, sim_admin,
                                                                     tmp_path):
    env, _, _ = pod_env
    recipe = write_recipe(tmp_path, "x.sh", "#!/bin/sh\necho hi\n")
    before = call(env, "runs", cwd=tmp_path, as_json=True).stdout
    sim_admin.set_reachable(env["TPUFAB_NAME"], 3, False)
    try:
        result = call(env, "run", cwd=tmp_path, recipe=str(recipe), no_deploy=True, raw=True)
    finally:
        sim_admin.set_reachable(env["TPUFAB_NAME"], 3, True)
    assert result.returncode == 1
    assert "Cannot start run" in result.stderr and "w3 is unreachable (w3 connection refused)" \
        in result.stderr, result.stderr
    assert call(env, "runs", cwd=tmp_path, as_json=True).stdout == before


@pytest.mark.sim
def test_run_outside_a_git_checkout_says_to_pass_no_deploy(pod_env, tmp_path):
    env, _, _ = pod_env
    recipe = write_recipe(tmp_path, "x.sh", "#!/bin/sh\necho hi\n")
    result = call(env, "run", cwd=tmp_path, recipe=str(recipe), raw=True)
    assert result.returncode == 2
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "not inside a git repository" in lines[0]
    assert "--no-deploy" in lines[0]



# The Python API as a user calls it: the sentence of each refusal on stdout.
START_API = """\
import sys
from tpufab import Pod
from tpufab.errors import TpufabError
try:
    Pod().start(sys.argv[1], no_deploy=sys.argv[2] == "no-deploy")
except TpufabError as err:
    print(err.message)
    sys.exit(err.exit_code)
"""


def api_start(env, cwd: Path, recipe: Path, how: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", START_API, str(recipe), how], env=env,
                          cwd=cwd, capture_output=True, text=True, timeout=120,
                          stdin=subprocess.DEVNULL)


def sentence(text: str) -> str:
    return " ".join(text.split())


@pytest.mark.sim
def test_pod_start_refuses_as_tpufab_run_does(pod_env, tmp_path):
    """Pod.start and `tpufab run` are one path: the same refusals in the same words (before:
    Pod.start had its own checks, e.g. outside a git checkout it failed at deploy with
    git's words after taking the lease, and it took no no_deploy)."""
    env, pod, _ = pod_env
    recipe = write_recipe(tmp_path, "x.sh", "#!/bin/sh\necho hi\n")
    cli = call(env, "run", cwd=tmp_path, recipe=str(recipe), raw=True)
    api = api_start(env, tmp_path, recipe, "deploy")
    assert cli.returncode == api.returncode == 2, cli.stderr + api.stdout + api.stderr
    assert "not inside a git repository" in api.stdout
    assert sentence(api.stdout) in sentence(cli.stderr), (api.stdout, cli.stderr)

    long = write_recipe(tmp_path, "long.sh", LONG)
    trigger = f"/tmp/go-{unique_name()}"
    first = call(env, "run", cwd=tmp_path, recipe=str(long), no_deploy=True, detach=True,
                 args=trigger)
    assert first.returncode == 0, first.stdout + first.stderr
    try:
        cli = call(env, "run", cwd=tmp_path, recipe=str(recipe), no_deploy=True, raw=True)
        api = api_start(env, tmp_path, recipe, "no-deploy")
        assert cli.returncode == api.returncode == 1, cli.stderr + api.stdout + api.stderr
        assert "a pod runs one job at a time" in api.stdout, api.stdout + api.stderr
        assert sentence(api.stdout) in sentence(cli.stderr), (api.stdout, cli.stderr)
    finally:
        on_workers(pod, ["touch", trigger])
    run_id = first.stderr.split("Run ", 1)[1].split(":", 1)[0]
    wait_for(lambda: run_states(env, tmp_path, run_id) == {str(w): "exited 0" for w in range(4)},
             60, 0.2, "the first run to end")
