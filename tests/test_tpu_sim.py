"""Issue 42 on a simulated v4-32 (4 workers): libtpu's runtime metrics served on every worker
(sim/tpumetrics.py) and read by the real tpu-info, by `top --tpu`; a worker slowed by `sim
slow` named as the straggler of a synchronous run, and nobody before (the detector's rules
as data: tests/test_stragglers.py; the chip's bookkeeping: tests/test_sim_chip.py)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
from harness import connected_pod
from helpers import TPUFAB, Running, tpufab, wait_for, write_recipe

pytestmark = pytest.mark.sim
DATA = Path(__file__).parent / "data"


@pytest.fixture(scope="module")
def pod4(sim, tmp_path_factory):
    with connected_pod(sim, tmp_path_factory, "tpu", "v4-32", site="jax", setup=True) as pod:
        yield pod


def on(pod, worker: int, command: str, timeout: float = 60):
    got = pod.pod.fanout.run(command, workers=[worker], timeout=timeout)
    try:
        r = got[worker]
        return SimpleNamespace(ok=r.ok, stdout=r.stdout, stderr=r.stderr)
    finally:
        got.close()


def hold_chips(pod, workers, seconds: float = 120):
    """Start holds_tpu.py (in the background) on ``workers``; wait until it holds the chips."""
    script = (DATA / "holds_tpu.py").read_text()
    for w in workers:
        r = on(pod, w, f"cat > /tmp/holds_tpu.py <<'EOF'\n{script}EOF\n"
                       f"setsid python3 /tmp/holds_tpu.py {seconds} >/tmp/holds.log 2>&1 "
                       "</dev/null & echo started")
        assert r.ok, r.stderr

    def holding():
        return all("holding 4 chips" in on(pod, w, "cat /tmp/holds.log").stdout for w in workers)
    assert wait_for(holding, 30), "the holder never held the chips"


def release_chips(pod, workers):
    for w in workers:
        on(pod, w, "pkill -f holds_tpu.py || true")


def test_tpu_info_unmodified_reads_the_simulated_metrics(pod4):
    hold_chips(pod4, [1])
    try:
        busy = on(pod4, 1, "COLUMNS=200 ~/.venv/bin/tpu-info")
        assert busy.ok, busy.stdout + busy.stderr
        out = busy.stdout
        assert "TPU Runtime Utilization" in out, out
        table = out.split("TPU Runtime Utilization", 1)[1]
        rows = [line for line in table.splitlines() if "GiB /" in line]
        assert len(rows) == 4, out          # 4 chips, each with HBM used / 32 GiB and a duty
        assert all("32.00 GiB" in r for r in rows), rows
        duties = [float(r.rsplit("|", 2)[-2].strip().rstrip("%")) for r in rows]
        assert all(d > 20 for d in duties), rows
        assert "/dev/accel0" in out or "TPU v4 chip" in out, out
        idle = on(pod4, 2, "COLUMNS=200 ~/.venv/bin/tpu-info")
        assert idle.ok, idle.stdout + idle.stderr
        assert "Libtpu metrics unavailable" in idle.stdout, idle.stdout
        timing = on(pod4, 1, "COLUMNS=200 ~/.venv/bin/tpu-info --metric hlo_exec_timing "
                             "--metric tensorcore_idle_duration")
        assert "HLO Execution Timing" in timing.stdout, timing.stdout + timing.stderr
    finally:
        release_chips(pod4, [1])


def test_top_tpu_shows_the_job_holding_the_chips_and_the_idle_host_first(pod4):
    hold_chips(pod4, [0, 1, 2])
    try:
        got = tpufab("top", "--tpu", "--once", "--json", env=pod4.env, cwd=pod4.base)
        assert got.returncode == 0, got.stdout + got.stderr
        frame = json.loads(got.stdout)
        rows = frame["tpu_rows"]
        assert [r["workers"] for r in rows] == ["w3", "w[0-2]"], rows  # the outlier first
        assert rows[0]["kind"] == "idle" and "no process holds the TPU" in rows[0]["text"]
        busy = rows[1]
        assert busy["kind"] == "busy" and busy["text"].startswith("4 chips  duty "), busy
        assert "/32 GiB" in busy["text"] and busy["duty_cycle_percent"] > 20, busy
        chips = {w["worker"]: w["tpu"]["chips"] for w in frame["workers"]}
        assert [len(chips[w]) for w in range(3)] == [4, 4, 4] and chips[3] == []
        assert all(c["hbm_used_bytes"] >= 16 << 20 for w in range(3) for c in chips[w])
        human = tpufab("top", "--tpu", "--once", env=pod4.env, cwd=pod4.base)
        assert human.returncode == 0, human.stderr
        lines = [x for x in human.stdout.splitlines() if x.startswith("w")]
        assert lines[0].split()[0] == "w3" and "idle: no process holds the TPU" in lines[0]
        assert lines[1].split()[0] == "w[0-2]" and "4 chips" in lines[1], human.stdout
    finally:
        release_chips(pod4, [0, 1, 2])


STEPS, SLOWED_AT = 62, 50


def test_a_worker_slowed_15_percent_is_named_within_3_steps_and_nobody_before(pod4):
    """A synchronous job (a barrier each step: every host's step line appears together) of
    programs of a fixed size on the simulated chips: 50 steps with nobody slowed name
    nobody; then `sim slow --worker 2 --by 15%` and the run names w2, once, within 3 steps
    (one more for the moment the slowdown lands between two step lines), from the chips'
    time outside collectives."""
    write_recipe(pod4.base, "collective_steps.py", (DATA / "collective_steps.py").read_text())
    node = pod4.env["TPUFAB_NAME"]
    running = Running([TPUFAB, "run", "collective_steps.py", "--no-deploy", str(STEPS), "0.4"],
                      pod4.env, cwd=pod4.base)

    def last_step() -> int:
        seen = [int(m.group(1)) for line in list(running.out)
                if (m := re.search(r"\bstep (\d+)$", line))]
        return max(seen, default=0)

    try:
        wait_for(lambda: last_step() >= SLOWED_AT or running.proc.poll() is not None, 240,
                 what=lambda: f"step {SLOWED_AT} (at step {last_step()}; "
                              f"{''.join(running.err)[-1500:]})")
        early = [line for line in running.err if "slower than the median" in line]
        slowed = tpufab("sim", "slow", node, "--worker", "2", "--by", "15%", env=pod4.env)
        assert slowed.returncode == 0, slowed.stdout + slowed.stderr
        at = last_step()
        done = running.wait(240)
    finally:
        running.kill()
        tpufab("sim", "slow", node, "--worker", "2", "--by", "0", env=pod4.env)
    said = done.stdout + done.stderr
    assert done.returncode == 0, said
    assert early == [], early                    # 50 steps, nobody slowed: nobody named
    verdicts = [line for line in done.stderr.splitlines() if "slower than the median" in line]
    assert len(verdicts) == 1, said
    found = re.match(r"w2 is (\d+)% slower than the median over steps (\d+)-(\d+): ", verdicts[0])
    assert found, verdicts
    percent, first, last = map(int, found.groups())
    assert percent >= 10 and at - 1 <= first and last <= at + 4, (verdicts, at)


QUIET_BUSY = '''import glob, os, sys
held = [open(p, "rb") for p in glob.glob("/dev/accel*")]
stat = f"/proc/self/task/{os.getpid()}/schedstat"
def chip_seconds():
    with open(stat, "rb") as f:
        return sum(int(v) for v in f.read().split()[:2]) / 1e9
start, x = chip_seconds(), 0
while chip_seconds() - start < float(sys.argv[1]):   # one long program, nothing printed
    for _ in range(2000):
        x = (x * 31 + 7) % 1000003
print("done", flush=True)
'''

CHATTY_IDLE = '''import glob, time
held = [open(p, "rb") for p in glob.glob("/dev/accel*")]
for n in range(240):                                 # printing, the chips held and idle
    print(f"waiting for data {n}", flush=True)
    time.sleep(0.5)
'''


def test_a_stall_counts_the_tpus_busy_though_quiet_and_idle_though_printing(pod4):
    """--stall 10s: a job that prints nothing for 24 s while its chips compute is no stall
    (it ends by itself, exit 0); a job that prints every half second while every host's chips
    sit idle is one ("every host's TensorCores were idle"), stopped by --stall-action kill."""
    write_recipe(pod4.base, "quiet_busy.py", QUIET_BUSY)
    write_recipe(pod4.base, "chatty_idle.py", CHATTY_IDLE)
    stall = ["--no-deploy", "--stall", "10s", "--stall-action", "kill"]
    busy = tpufab("run", "quiet_busy.py", *stall, "24", env=pod4.env, cwd=pod4.base,
                  timeout=180)
    assert busy.returncode == 0, busy.stdout + busy.stderr
    assert "done" in busy.stdout and "stall" not in busy.stderr.lower(), busy.stderr
    idle = tpufab("run", "chatty_idle.py", *stall, env=pod4.env, cwd=pod4.base, timeout=180)
    said = idle.stdout + idle.stderr
    assert idle.returncode == 124, said
    assert re.search(r"Every host's TensorCores were idle for 1\ds while the job printed "
                     r"\(--stall 10s\): taking every worker's stacks", idle.stderr), idle.stderr
    assert "stopped on w[0-3] (--stall-action kill)." in idle.stderr, idle.stderr
    assert "waiting for data 239" not in idle.stdout      # stopped, not run to its end
