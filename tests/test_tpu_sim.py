"""Issue 42 on a simulated v4-32 (4 workers): libtpu's runtime metrics served on every worker
(sim/tpumetrics.py) and read by the real tpu-info, by `top --tpu`; stragglers named during a
run; a stall judged after the queued output; a profile of every worker."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
from harness import connected_pod
from helpers import wait_for

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
