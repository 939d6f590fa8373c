"""stacks and the stall watchdog on a simulated v4-32 (real sshd workers, real py-spy from the
pod's shared site, a real Python job): worker 2 blocks in a function of its own while the
others block in a socket barrier waiting for it."""

from __future__ import annotations

import json
import subprocess
import time

import pytest
from harness import connected_pod
from helpers import (
    Running,
    call,
    cli_argv,
    in_worker,
    no_traceback,
    ok,
    one_sentence,
    wait_for,
    write_recipe,
)

pytestmark = pytest.mark.sim

# A job that hangs the way real ones do: every worker checks in with worker 0's barrier and
# waits for its "go"; worker 2 never gets there, it waits in its data loader for a batch (a
# FIFO nobody writes to until the test does). Worker 0 also serves the barrier (a thread only
# it has).
STUCK = '''\
import os, socket, sys, threading, time

RANK = int(os.environ["TPUFAB_WORKER_ID"])
COUNT = int(os.environ["TPUFAB_NUM_WORKERS"])
IPS = os.environ["TPUFAB_WORKER_IPS"].split(",")
PORT = 29517
BATCHES = os.path.expanduser("~/batches.fifo")


def serve_barrier(listener):
    peers = []
    while len(peers) < COUNT:
        peer, _ = listener.accept()
        peer.recv(8)
        peers.append(peer)
    for peer in peers:
        peer.sendall(b"go")


def barrier():
    deadline = time.monotonic() + 120
    while True:
        try:
            sock = socket.create_connection((IPS[0], PORT), timeout=5)
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
    sock.settimeout(None)
    sock.sendall(b"%d" % RANK)
    return sock.recv(2)


def stuck_in_data_loader():
    with open(BATCHES) as batches:
        return batches.read()


def main():
    if RANK == 0:
        listener = socket.create_server(("0.0.0.0", PORT))
        threading.Thread(target=serve_barrier, args=(listener,), name="barrier-server",
                         daemon=True).start()
    if RANK == 2:
        if not os.path.exists(BATCHES):
            os.mkfifo(BATCHES)
    print(f"step 0 on worker {RANK}", flush=True)
    if RANK == 2:
        stuck_in_data_loader()
    barrier()
    print(f"step 1 on worker {RANK}", flush=True)


main()
'''

SILENT = '''\
import time


def wait_for_nothing():
    time.sleep(600)


print("about to go quiet", flush=True)
wait_for_nothing()
'''


@pytest.fixture(scope="module")
def pod(sim, tmp_path_factory):
    """A v4-32 whose workers find py-spy in the pod's shared site (and JAX: not needed)."""
    with connected_pod(sim, tmp_path_factory, "stacks", site="jax") as made:
        write_recipe(made.base, "stuck.py", STUCK)
        write_recipe(made.base, "silent.py", SILENT)
        yield made


def feed_worker_2(pod) -> None:
    """Write the batch worker 2 waits for (it then joins the barrier and the run ends)."""
    pod.pod.fanout.run("echo batch > ~/batches.fifo", workers=[2], timeout=30).check()


def started_run(pod, recipe: str) -> str:
    started = call(pod.env, "run", cwd=pod.base, recipe=recipe, detach=True, no_deploy=True,
                   timeout=120)
    ok(started)
    for line in started.stderr.splitlines():
        if line.startswith("Run ") and " started on " in line:
            return line.split()[1].rstrip(":")
    raise AssertionError(started.stderr)


def stacks_once(pod, **kwargs):
    return call(pod.env, "stacks", cwd=pod.base, timeout=120, **kwargs)


def test_stacks_fold_the_waiting_workers_and_show_the_stuck_one_first(pod):
    """The stuck job, followed with the stall watchdog (--stall 10s, default action wait):
    stacks shows w2 first, the rest folded; the watchdog says it waits and keeps following
    until worker 2 is fed and the run ends."""
    running = Running(cli_argv("run", recipe="stuck.py", stall="10s", no_deploy=True),
                      pod.env, cwd=pod.base)
    run_id = None
    try:
        def started():
            for line in running.err:
                if line.startswith("Run ") and " started on " in line:
                    return line.split()[1].rstrip(":")
            return None

        run_id = wait_for(started, 120, interval=0.2, what="the run to start")

        def settled():
            # until every waiting worker is inside the barrier's recv (not still connecting)
            done = stacks_once(pod, as_json=True)
            if done.returncode != 0:
                return None
            data = json.loads(done.stdout)
            waiting = [s for s in data["stacks"] if s["thread"] == "MainThread"
                       and s["workers"] == [0, 1, 3]]
            return data if waiting and data["odd_workers"] == [2] else None

        data = wait_for(settled, 90, interval=1, what="w[0-1,3] in the barrier, w2 stuck")
        # --json: the folded stacks, the odd worker first, each worker's raw answer
        assert data["run"] == run_id and data["source"] == "run"
        first = data["stacks"][0]
        assert first["workers"] == [2] and first["odd"] and first["thread"] == "MainThread"
        assert first["frames"][first["differs_at"]].startswith("stuck_in_data_loader (stuck.py:")
        assert first["others"] == "w[0-1,3]" and first["others_frame"].startswith("barrier (")
        [waiting] = [s for s in data["stacks"] if s["workers"] == [0, 1, 3]]
        assert waiting["frames"][0].startswith("barrier (stuck.py:") and not waiting["odd"]
        assert [s["workers"] for s in data["stacks"] if s["thread"] == "barrier-server"] == [[0]]
        assert sorted(data["workers"]) == ["0", "1", "2", "3"]
        assert all(len(data["workers"][w]["processes"]) == 1 for w in data["workers"])

        shown = stacks_once(pod)
        out = ok(shown)
        lines = out.splitlines()
        assert lines[0].startswith(f"Stacks of run {run_id} on w[0-3]: 4 processes, ")
        assert lines[0].endswith("w2 differs (shown first).")
        # w2's own stack first, the function it is stuck in marked; then one stack for the rest
        assert lines[2].startswith("w2 (differs) · pid ") and "thread MainThread" in lines[2]
        marked = [line for line in lines if "<-- differs" in line]
        assert len(marked) == 1 and marked[0].strip().startswith("stuck_in_data_loader (")
        assert "w[0-1,3] are in barrier (stuck.py:" in marked[0]
        assert lines.index(marked[0]) < next(i for i, line in enumerate(lines)
                                             if line.startswith("w[0-1,3] · "))
        assert sum(line.startswith("w[0-1,3] · ") for line in lines) == 1
        # saved beside the run's local logs
        saved = sorted((pod.base / ".tpufab" / "runs" / run_id).glob("stacks-*.txt"))
        assert saved and "stuck_in_data_loader" in saved[-1].read_text()
        assert f"Saved to .tpufab/runs/{run_id}/stacks-" in shown.stderr

        # the watchdog (no new line for 10 s): the same stacks on stderr, then it waits
        wait_for(lambda: running.saw("still waiting for it (--stall-action wait", "err"), 90,
                 interval=0.2, what="the stall note")
        assert running.saw("No new output from any worker for ", "err")
        assert running.saw("w2 (differs) · pid ", "err") and running.proc.poll() is None
        feed_worker_2(pod)
        done = running.wait(timeout=90)
    finally:
        if running.proc.poll() is None:     # a failure above: stop the follower and the run
            running.kill()
            call(pod.env, "kill", cwd=pod.base, grace=1)
    ok(done)
    assert "step 1 on worker" in done.stdout    # the barrier let everyone through
    # the run is over: nothing to dump, said in one sentence
    def ended():
        result = stacks_once(pod, run=run_id)
        return result if result.returncode != 0 else None

    one_sentence(wait_for(ended, 60, interval=1, what="the run's processes to end"),
                 f"Nothing to dump on w[0-3]: no Python process of run {run_id} is running")


def test_stacks_bad_input_one_sentence_each(pod):
    one_sentence(stacks_once(pod, run="20200101-000000-dead"),
                 "No run 20200101-000000-dead on w[0-3]", "`tpufab runs`")
    one_sentence(stacks_once(pod, run="not a run"), "is not a run id")


HOLDER = ("import signal\n"
          "def hold():\n"
          "    f = open('/dev/accel0')\n"
          "    signal.pause()\n"
          "hold()\n")


def test_without_a_running_run_stacks_dumps_the_tpu_holders(sim, pod):
    """No run running (the module's runs have ended): the Python processes holding the TPU,
    here a crashed job's leftover on w3 (a Python process in signal.pause() that still holds
    a chip; `sim zombie`'s holders look like one but are not Python, as docs/kill.md says)."""
    in_worker(sim, pod.pod.node, 3, f"cat > /tmp/holder.py <<'EOF'\n{HOLDER}EOF\n"
              "setsid python3 /tmp/holder.py </dev/null >/dev/null 2>&1 &")
    try:
        wait_for(lambda: "python3 /tmp/holder.py" in in_worker(
            sim, pod.pod.node, 3, "ps -eo args", check=False), 30, what="the holder on w3")
        out = ok(stacks_once(pod)).splitlines()
        assert out[0].startswith("Stacks of the TPU's Python holders on w[0-3]: 1 process, ")
        assert any(line.startswith("w3 · pid ") for line in out)
        assert any(line.strip().startswith("hold (") for line in out), out
        assert out[-1] == "w[0-2]: no run is running and no Python process holds the TPU."
    finally:
        call(pod.env, "kill", cwd=pod.base, worker="3", grace=0, force=True)


@pytest.mark.parametrize(("flags", "sentence"), [
    ({"stall": "3s"}, "--stall 3s is below the floor of 10 s (taking every worker's stacks "
                      "takes seconds); use --stall 10s or more."),
    ({"stall": "10s", "stall_action": "restart"},
     "--stall-action restart needs something to start the next attempt, which only babysit "
     "does: use `tpufab babysit RECIPE --stall DURATION --stall-action restart`, or wait or "
     "kill here."),
    ({"stall": "10s", "stall_action": "later"}, "--stall-action takes wait or kill, not 'later'."),
    ({"stall": "10s", "stall_progress_file": "a/../../b"},
     "--stall-progress-file a/../../b has a '..' part; give a path inside the run's directory "
     "($TPUFAB_RUN_DIR), such as progress, or an absolute one."),
    ({"stall": "10s", "stall_progress_file": " "},
     "--stall-progress-file needs a file the recipe touches, such as progress (in the run's "
     "directory, $TPUFAB_RUN_DIR, on each worker) or an absolute path; it was empty."),
    ({"stall_progress_file": "progress"},
     "--stall-progress-file says what progress means for the stall watchdog, which only "
     "--stall DURATION starts; add --stall (e.g. --stall 15m)."),
    ({"stall": "1m", "detach": True}, "--stall watches a run while tpufab follows it, which "
                                      "--detach does not; leave one of them out."),
])
def test_run_stall_bad_input_is_refused_before_anything_starts(flags, sentence):
    """Checked before settings or connections (the verb as the CLI calls it, no pod needed)."""
    from tpufab.errors import ConfigError
    from tpufab.verbs.jobs import run

    with pytest.raises(ConfigError) as refused:
        run("silent.py", no_deploy=True, **flags)
    assert str(refused.value) == sentence and refused.value.exit_code == 2


def test_stall_takes_stacks_then_kills_with_a_verdict(pod):
    began = time.monotonic()
    running = Running(cli_argv("run", recipe="stuck.py", stall="10s", stall_action="kill",
                               no_deploy=True),
                      pod.env, cwd=pod.base)
    try:
        done = running.wait(timeout=150)
    finally:
        running.kill()
        pod.pod.fanout.run("rm -f ~/batches.fifo", workers=[2], timeout=30)
    took = time.monotonic() - began
    no_traceback(done)
    assert done.returncode == 124, done.stdout + done.stderr
    err = done.stderr
    assert "No new output from any worker for 10s (--stall 10s): taking every worker's stacks" \
        in err
    assert "w2 (differs) · pid " in err and "stuck_in_data_loader (" in err
    assert "(--stall-action kill)" in err
    verdict = err.strip().splitlines()[-1]
    assert verdict.startswith("Run ") and "stalled: no new output for 10s; w2 differed from "\
        "the others (stacks: .tpufab/runs/" in verdict and verdict.endswith(
            "it was stopped on w[0-3] (--stall-action kill).")
    assert took < 120, took


# prints one line, then only worker 3 touches the progress file (for 15 s); then all hang
BEATS = """\
import os, pathlib, time

BEAT = pathlib.Path(os.environ["TPUFAB_RUN_DIR"]) / "beat"


def step():
    end = time.monotonic() + 15
    while time.monotonic() < end:
        BEAT.touch()
        time.sleep(0.5)


def hang():
    time.sleep(600)


print("starting", flush=True)
if os.environ["TPUFAB_WORKER_ID"] == "3":
    step()
hang()
"""


def test_run_stall_watches_the_progress_file_instead_of_output(pod):
    """`run --stall-progress-file beat`: one worker touching $TPUFAB_RUN_DIR/beat keeps the
    10 s watchdog quiet (no output at all meanwhile); it fires once the touching stops, and
    the verdict names the file it watched."""
    write_recipe(pod.base, "beats.py", BEATS)
    running = Running(cli_argv("run", recipe="beats.py", stall="10s", stall_action="kill",
                               stall_progress_file="beat", no_deploy=True),
                      pod.env, cwd=pod.base)
    try:
        done = running.wait(timeout=150)
    finally:
        running.kill()
    no_traceback(done)
    assert done.returncode == 124, done.stdout + done.stderr
    err = done.stderr
    assert "The progress file beat did not advance on any worker for 10s (--stall 10s " \
           "--stall-progress-file beat): taking every worker's stacks" in err
    assert err.count("taking every worker's stacks") == 1
    assert "hang (beats.py:" in err and "step (beats.py:" not in err   # w3 had stopped too
    verdict = err.strip().splitlines()[-1]
    assert verdict.startswith("Run ") and "stalled: the progress file beat did not advance " \
        "on any worker for 10s (stacks: .tpufab/runs/" in verdict
    assert verdict.endswith("it was stopped on w[0-3] (--stall-action kill).")


def test_launch_refuses_a_stall_restart_before_anything_starts():
    from tpufab.errors import ConfigError
    from tpufab.verbs.launch import launch

    with pytest.raises(ConfigError) as refused:
        launch("task.yaml", stall="10s", stall_action="restart")
    assert str(refused.value).startswith("--stall-action restart needs something to start the "
                                         "next attempt, which only babysit does")
    with pytest.raises(ConfigError) as refused:
        launch("task.yaml", stall="10s", ray=True)
    assert str(refused.value) == ("--stall watches the output of a run tpufab follows, and --ray "
                                  "hands the run to Ray: give one or the other.")


TRACER = """\
import ctypes, sys, time
libc = ctypes.CDLL(None, use_errno=True)
if libc.ptrace(0x4206, int(sys.argv[1]), 0, 0) != 0:   # PTRACE_SEIZE, as a debugger does
    sys.exit(ctypes.get_errno())
time.sleep(120)
"""


def test_unreadable_processes_and_a_missing_py_spy_are_named_with_the_fix(pod, sim):
    """One quiet run: a debugger attached on w3 (named, with the fix), then py-spy gone from w1
    with no package index (one sentence, pip's reason)."""
    run_id = started_run(pod, "silent.py")
    node = pod.pod.node
    no_index = "mkdir -p ~/.config/pip && printf '[global]\\nno-index = true\\n' > " \
        "~/.config/pip/pip.conf"
    try:
        pid = wait_for(lambda: in_worker(sim, node, 3, f"cat /home/tpufab/.tpufab/runs/{run_id}"
                                         "/pid 2>/dev/null || true").strip(), 30,
                       what="the run on w3")
        # a debugger already attached to worker 3's process (ptrace allows one tracer)
        in_worker(sim, node, 3, f"cat > /tmp/tracer.py <<'EOF'\n{TRACER}EOF\n"
                  f"setsid /usr/bin/python3 /tmp/tracer.py {pid} >/dev/null 2>&1 &")
        wait_for(lambda: "TracerPid:\t0" not in in_worker(sim, node, 3,
                                                          f"cat /proc/{pid}/status"),
                 30, what="the tracer to attach")
        result = stacks_once(pod, run=run_id)
        one_sentence(result, "py-spy could not read 1 process on w3 (why and the fix above)",
                     progress=2)     # (the first stacks of the module installs py-spy first)
        out = result.stdout
        assert "w[0-2] · `python3 silent.py` · thread (unnamed)" in out
        [line] = [line for line in out.splitlines() if line.startswith("w3 · ")]
        assert f"w3 · pid {pid} `python3 " in line
        assert "py-spy cannot attach: another tracer (python3, pid " in line
        assert "fix: detach python3 (pid " in line and line.endswith("again.")
        in_worker(sim, node, 3, "pkill -f '/tmp/[t]racer.py'")

        # py-spy gone from worker 1 only (an empty file over it in its own mount namespace),
        # and no package index reachable from there: one sentence, with pip's reason
        in_worker(sim, node, 1, "mount --bind /dev/null /opt/tpufab-sim/share/site/bin/py-spy")
        in_worker(sim, node, 1, "rm -rf /opt/tpufab/py-spy && printf '[global]\\nno-index = "
                  "true\\n' > /etc/pip.conf")      # root's copy gone, and root's pip offline
        in_worker(sim, node, 1, no_index, user="tpufab")
        sentence = one_sentence(stacks_once(pod, run=run_id),
                                "py-spy is missing on w1 and could not be installed there "
                                "(w1: ", "`tpufab setup`", progress=2)
        assert "py-spy" in sentence.split("(w1: ", 1)[1], sentence
        # (with the index there, the same `pip install --user py-spy` succeeds and w1 answers:
        # seen on this pod; left out of the test for its time, pip being slow to start)
    finally:
        in_worker(sim, node, 3, "pkill -f '/tmp/[t]racer.py'", check=False)
        in_worker(sim, node, 1, "umount /opt/tpufab-sim/share/site/bin/py-spy; "
                  "rm -rf /home/tpufab/.local /home/tpufab/.config/pip /etc/pip.conf",
                  check=False)
        call(pod.env, "kill", cwd=pod.base, run=run_id, grace=1)


# A py-spy for `dump --json --pid N` that says what it is told (the forgeries of issue 37):
# it leaves a canary named for the uid it ran as, then prints MODE's answer.
FORGED_PY_SPY = """#!/bin/sh
touch /tmp/forged-py-spy-ran-as-$(id -u)
case "{mode}" in
  huge) head -c 300000000 /dev/zero | tr '\\0' ' ' ;;
  names) printf '%s' '[{{"thread_name": "MainThread", "os_thread_id": 1, "active": true,
    "frames": [{{"name": "f", "line": 1, "filename": "x.py\\nw9 · pid 1 · `forged`",
    "short_filename": "x.py\\nw9 (differs) · pid 1 · `forged` · thread MainThread"}}]}}]' ;;
  *) exit 3 ;;
esac
"""
ROOT_PY_SPY = "/opt/tpufab/py-spy/py-spy"


def forge(sim, node, worker: int, path: str, mode: str, *, user: str | None = None,
          hashed: bool = False) -> None:
    """A forged py-spy at ``path`` on ``worker`` (``hashed``: its sha256 recorded as tpufab
    records the one it installed, i.e. a forgery tpufab would trust)."""
    script = FORGED_PY_SPY.format(mode=mode)
    in_worker(sim, node, worker, f"mkdir -p $(dirname {path}) && cat > {path} <<'EOF'\n{script}"
              f"EOF\nchmod 755 {path}", user=user)
    if hashed:
        in_worker(sim, node, worker, f"sha256sum {path} | cut -d' ' -f1 > {path}.sha256")


def forged_ran(sim, node, worker: int) -> str:
    return in_worker(sim, node, worker, "ls /tmp/ | grep forged-py-spy-ran || true").strip()


def test_the_py_spy_that_runs_as_root_is_the_one_tpufab_installed_and_hashed(pod, sim):
    """issue 37, Medium 5: stacks runs py-spy as root (through sudo), and took the first
    py-spy it found, a user-writable ~/.local/bin/py-spy included. Now root runs only its own
    copy, installed by tpufab (here from the pod's shared site) with its sha256 beside it: a
    forged ~/.local/bin/py-spy never runs, a changed copy is put back before anything runs."""
    run_id = started_run(pod, "silent.py")
    node = pod.pod.node
    try:
        ok(stacks_once(pod, run=run_id))
        for w in range(4):          # installed where stacks runs it, with its hash
            assert in_worker(sim, node, w, f"stat -c '%U %a' {ROOT_PY_SPY} {ROOT_PY_SPY}.sha256"
                             ).split() == ["root", "755", "root", "644"], w
        forge(sim, node, 1, "/home/tpufab/.local/bin/py-spy", "names", user="tpufab")
        forge(sim, node, 2, ROOT_PY_SPY, "names")       # root's copy changed, hash not
        out = ok(stacks_once(pod, run=run_id))
        assert "w[0-3] · `python3 silent.py` · thread (unnamed)" in out, out
        assert forged_ran(sim, node, 1) == "" and forged_ran(sim, node, 2) == ""
        assert in_worker(sim, node, 2, f"head -c 2 {ROOT_PY_SPY}") != "#!"   # put back
    finally:
        in_worker(sim, node, 1, "rm -rf /home/tpufab/.local /tmp/forged-py-spy-ran-*",
                  check=False)
        in_worker(sim, node, 2, "rm -rf /opt/tpufab/py-spy /tmp/forged-py-spy-ran-*",
                  check=False)
        call(pod.env, "kill", cwd=pod.base, run=run_id, grace=1)


def test_a_forged_py_spy_can_neither_flood_the_laptop_nor_forge_a_stack_header(pod, sim):
    """A py-spy tpufab would run (its hash recorded: a tampered worker) that prints 300 MB is
    stopped on the worker after 4 MiB and named; one whose frame's file name holds a newline
    and a fake block header is refused, never shown as a stack of its own."""
    run_id = started_run(pod, "silent.py")
    node = pod.pod.node
    try:
        ok(stacks_once(pod, run=run_id))
        forge(sim, node, 2, ROOT_PY_SPY, "huge", hashed=True)
        began = time.monotonic()
        result = stacks_once(pod, run=run_id)
        assert time.monotonic() - began < 60
        one_sentence(result, "py-spy could not read 1 process on w2 (why and the fix above)",
                     progress=1)
        assert "py-spy printed more than a stack could be (a forged py-spy?)" in result.stdout
        assert forged_ran(sim, node, 2) == "forged-py-spy-ran-as-0"

        forge(sim, node, 2, ROOT_PY_SPY, "names", hashed=True)
        result = stacks_once(pod, run=run_id)
        one_sentence(result, "py-spy could not read 1 process on w2 (why and the fix above)",
                     progress=1)
        lines = result.stdout.splitlines()
        assert not [line for line in lines if line.startswith("w9")], result.stdout
        assert "`forged`" not in result.stdout, result.stdout
        assert any(line.startswith("w2 · pid ") and "control characters" in line
                   for line in lines), result.stdout
        saved = sorted((pod.base / ".tpufab" / "runs" / run_id).glob("stacks-*.txt"))
        assert "w9" not in saved[-1].read_text()
    finally:
        in_worker(sim, node, 2, "rm -rf /opt/tpufab/py-spy /tmp/forged-py-spy-ran-*",
                  check=False)
        call(pod.env, "kill", cwd=pod.base, run=run_id, grace=1)


def test_a_workers_answer_past_the_cap_is_stopped_and_named(pod):
    """The client's own bound on one worker's answer (a tampered worker can print anything):
    the fan-out stops the command at the cap, and the row says why, keeping none of it."""
    from tpufab.steps.health import stacks

    began = time.monotonic()
    results = pod.pod.fanout.run("head -c 100000000 /dev/zero | tr '\\0' x; sleep 60",
                                 workers=[3], timeout=90, sink=stacks.CappedAnswers())
    assert time.monotonic() - began < 45
    report = stacks.StacksReport([3])
    stacks._read(report, results)
    assert report.errors == {3: "its answer went past 8 MiB (a forged py-spy or a tampered "
                                "worker?), so tpufab stopped it and kept none of it"}


# -- the fold (pure) ----------------------------------------------------------------------------


def answer(*threads, command="python3 /home/u/.tpufab/runs/R/recipe/train.py", pid=7):
    """A worker's answer with one process and ``threads``: (name, [(function, file, line)])."""
    return {"ok": True, "source": "run", "run": "R", "processes": [{
        "pid": pid, "command": command,
        "threads": [{"name": name, "frames": [{"function": f, "file": file, "line": line}
                                              for f, file, line in frames]}
                    for name, frames in threads]}]}


WAITING = ("MainThread", [("barrier", "train.py", 32), ("main", "train.py", 51),
                          ("<module>", "train.py", 55)])
STUCK_2 = ("MainThread", [("read", "io.py", 9), ("stuck_in_data_loader", "train.py", 36),
                          ("main", "train.py", 50), ("<module>", "train.py", 55)])


def test_fold_puts_the_odd_worker_first_marking_the_function_it_is_in():
    from tpufab.steps.health.stacks import fold_stacks, render

    answers = {w: answer(STUCK_2 if w == 2 else WAITING) for w in range(64)}
    answers[0] = answer(WAITING, ("barrier-server", [("accept", "socket.py", 294)]))
    entries, odd = fold_stacks(answers)
    assert odd == [2]
    first, rest = entries[0], entries[1:]
    assert first.workers == [2] and first.odd and first.others == "w[0-1,3-63]"
    # "main (train.py:50)" vs "(train.py:51)": the function it calls on into is the news
    assert first.key.frames[first.differs_at] == "stuck_in_data_loader (train.py:36)"
    assert first.others_frame == "barrier (train.py:32)"
    assert [e.label for e in rest] == ["w[0-1,3-63]", "w0"]   # a thread only w0 has: not odd
    assert first.key.command == "python3 train.py"             # the run's copy, named plainly
    text = render(entries, odd, total=64)
    assert text[0] == "w2 (differs) · pid 7 · `python3 train.py` · thread MainThread"
    assert text[2] == ("    stuck_in_data_loader (train.py:36)   <-- differs: w[0-1,3-63] are "
                       "in barrier (train.py:32)")


def test_fold_native_addresses_never_split_workers_and_ties_go_to_the_lowest_worker():
    from tpufab.steps.health.stacks import fold_stacks

    def native(address, line):
        return answer(("MainThread", [(address, "libc.so.6", 0), ("step", "train.py", line)]))

    entries, odd = fold_stacks({0: native("0x7f00aa", 10), 1: native("0x7f11bb", 10)})
    assert [(e.label, e.key.frames) for e in entries] == [
        ("w[0-1]", ("? (libc.so.6)", "step (train.py:10)"))] and odd == []
    entries, odd = fold_stacks({0: native("0x1", 10), 1: native("0x2", 12)})
    assert odd == [1] and entries[0].workers == [1] and entries[0].differs_at == 1


def test_a_progress_file_is_read_where_the_recipe_touches_it_quoted():
    """Relative: in the run's directory ($TPUFAB_RUN_DIR); ~/: the login user's home;
    absolute as given. Always one quoted shell word, never the user's text as shell."""
    from tpufab.steps.start.stall import ProgressFile, progress_probe_every

    where = ProgressFile.where
    assert where("20261125-1-ab", "progress") == '"$HOME/.tpufab/runs"/20261125-1-ab/progress'
    assert where("R", "ckpt/step file") == "\"$HOME/.tpufab/runs\"/R/'ckpt/step file'"
    assert where("R", "~/beat") == '"$HOME"/beat'
    assert where("R", "/mnt/d/x; rm -rf ~") == "'/mnt/d/x; rm -rf ~'"
    # read every DURATION/5, at least every 2 s and at most every 30 s
    assert [progress_probe_every(s) for s in (10, 60, 900)] == [2.0, 12.0, 30.0]


# -- the worker side's py-spy call, against a live process and a py-spy that fails as it does --

FLAKY_PY_SPY = '''#!/bin/sh
# fails as py-spy 0.4 does when a read races the process, FAILS times, then answers
n=$(cat "$0.count" 2>/dev/null || echo 0); n=$((n + 1)); echo "$n" > "$0.count"
if [ "$n" -le {fails} ]; then
  printf 'Error: Failed to get stack traces\\n\\nCaused by:\\n    0: {cause}\\n    1: No such process (os error 3)\\n' >&2
  exit 1
fi
echo '[{{"thread_name": "MainThread", "os_thread_id": 1, "active": false, "owns_gil": false, "frames": [{{"name": "wait", "short_filename": "job.py", "filename": "/x/job.py", "line": 3}}]}}]'
'''


@pytest.mark.parametrize("fails, cause, tries, says", [
    (1, "Failed to suspend process", 2, None),
    (2, "Failed to copy PyThreadState", 3, None),
    (9, "Failed to suspend process", 3, "Error: Failed to get stack traces; Caused by:; "
     "0: Failed to suspend process; 1: No such process (os error 3) (tried 3 times)"),
    (9, "Operation not permitted (os error 1)", 1, "0: Operation not permitted (os error 1)"),
])
def test_a_py_spy_read_that_races_the_process_is_tried_again_and_its_causes_kept(
        tmp_path, fails, cause, tries, says):
    """A live process py-spy failed to read (not refused, no tracer) gets up to three tries; a
    refusal gets one. What is said keeps py-spy's causes (it used to drop the numbered ones)."""
    from tpufab.remote.stacks_worker import dump

    py_spy = tmp_path / "py-spy"
    py_spy.write_text(FLAKY_PY_SPY.format(fails=fails, cause=cause))
    py_spy.chmod(0o755)
    job = subprocess.Popen(["sleep", "60"])
    try:
        got = dump(str(py_spy), job.pid, native=False, scope=0, timeout=20)
    finally:
        job.kill()
        job.wait()
    assert (tmp_path / "py-spy.count").read_text().strip() == str(tries)
    if says is None:
        assert got == {"threads": [{"name": "MainThread", "id": 1, "active": False, "gil": False,
                                    "frames": [{"function": "wait", "file": "job.py",
                                                "path": "/x/job.py", "line": 3}]}]}
    else:
        assert says in got["error"] and "threads" not in got, got
        # a raced read is named as py-spy's; a refusal by what refused it (ptrace, a container)
        assert got["reason"].startswith("py-spy could not read it (") == (tries > 1), got


class _Ages:
    """What the workers say (``LastOutput.age``), answer by answer (the last one again)."""

    def __init__(self, answers):
        self.answers = list(answers)
        self.asked = 0

    def age(self):
        self.asked += 1
        answer = self.answers[min(self.asked, len(self.answers)) - 1]
        if isinstance(answer, Exception):
            raise answer
        return answer


class _Nothing:
    def lines(self, worker, stream, data):
        pass

    def done(self, result):
        pass


@pytest.mark.parametrize("answers, asked", [([0.2, 0.2, 0.2, 5.0], 4), ([None], 1),
                                            ([OSError("no answer")], 1)])
def test_the_watchdog_asks_the_workers_before_it_calls_a_silence_a_stall(answers, asked):
    """No line reached the view for `seconds`, as after a client was stopped (Ctrl-Z): the
    watchdog judges only once the workers say they wrote nothing for that long either; while
    one says it wrote since (its lines are on their way), the clock restarts from then. A
    worker that cannot say leaves the silence seen here to decide (issue 37, finding 4; the
    user's side: tests/test_fault_matrix.py's client-paused cells)."""
    from tpufab.steps.start.stall import StallWatch

    fired: list[float] = []
    ages = _Ages(answers)
    watch = StallWatch(_Nothing(), 1.0, fired.append, last_output=ages)
    try:
        wait_for(lambda: fired, 30, what="the stall to be called")
    finally:
        watch.close()
    assert ages.asked == asked and len(fired) == 1 and fired[0] >= 1.0
