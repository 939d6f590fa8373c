"""Issue 27 on a simulated v4-32: a maintenance window announced ahead (the API's
upcomingMaintenance) and a worker's metadata notice, shown by `status` and `check`; `top`
folding idle workers and naming the busy one."""

from __future__ import annotations

import json
import subprocess

import pytest
import requests
from harness import sim_node
from helpers import tpufab

pytestmark = pytest.mark.sim


@pytest.fixture(scope="module")
def pod4(sim, tmp_path_factory):
    """A READY v4-32 (4 workers) for this module."""
    with sim_node(sim, tmp_path_factory, "tm", "v4-32") as pod:
        yield pod


def test_upcoming_maintenance_and_a_notice_show_in_status_and_check(pod4, sim_admin,
                                                                    tmp_path):
    from tpufab.cloud.planes.tpu import TpuApi

    said = tpufab("sim", "maintenance", pod4.name, "--in", "2h", env=pod4.env)
    assert said.returncode == 0, said.stderr
    assert f"Maintenance announced on {pod4.name}: SCHEDULED" in said.stdout
    try:
        # worker 2's metadata server announces a maintenance event (as simulateMaintenanceEvent)
        sim_admin.settings(maintenance_notice=300.0)
        path = TpuApi(pod4.settings).node_path(pod4.name)
        event = requests.post(f"{pod4.sim.endpoint}/v2alpha1/{path}:simulateMaintenanceEvent",
                              json={"workerIds": ["2"]}, timeout=30)
        assert event.status_code == 200, event.text

        shown = tpufab("status", env=pod4.env, cwd=tmp_path)
        ahead = f"Maintenance ahead on {pod4.name}: SCHEDULED maintenance PENDING, window "
        assert ahead in shown.stdout, shown.stdout + shown.stderr
        line = next(x for x in shown.stdout.splitlines() if ahead in x)
        assert "UTC (in 1h59m" in line or "UTC (in 2h)" in line, line
        assert "can be rescheduled until" in line
        assert "Notice on w2: maintenance: TERMINATE_ON_HOST_MAINTENANCE " \
               "(instance/maintenance-event)" in shown.stdout
        assert "Notice on w0" not in shown.stdout       # only the worker that holds one

        as_json = json.loads(tpufab("status", "--json", env=pod4.env, cwd=tmp_path).stdout)
        upcoming = as_json["nodes"][0]["upcoming_maintenance"]
        assert (upcoming["type"], upcoming["maintenance_status"], upcoming["can_reschedule"]) \
            == ("SCHEDULED", "PENDING", True)
        assert upcoming["window_start_time"] and upcoming["window_end_time"]
        assert [w["notices"] for w in as_json["workers"]] == \
            [[], [], ["maintenance: TERMINATE_ON_HOST_MAINTENANCE (instance/maintenance-event)"],
             []]

        checked = tpufab("check", "--quick", env=pod4.env, cwd=tmp_path)
        row = next((x for x in checked.stdout.splitlines() if x.split()[1:2] == ["notices"]),
                   "")
        assert row.startswith("ok") and ahead in row, checked.stdout + checked.stderr
        assert "Notice on w2: maintenance: TERMINATE_ON_HOST_MAINTENANCE" in row
    finally:
        cleared = tpufab("sim", "maintenance", pod4.name, "--clear", env=pod4.env)
    assert cleared.returncode == 0, cleared.stderr
    assert "upcomingMaintenance" not in sim_admin.node(pod4.name)["node"]


@pytest.mark.gcloud
def test_gcloud_alpha_describe_shows_the_window(pod4, gcloud_env):
    said = tpufab("sim", "maintenance", pod4.name, "--in", "30m", "--window", "2h",
                  env=pod4.env)
    assert said.returncode == 0, said.stderr
    try:
        described = subprocess.run(
            ["gcloud", "alpha", "compute", "tpus", "tpu-vm", "describe", pod4.name,
             "--format=json"], env=gcloud_env, capture_output=True, text=True, timeout=120)
        assert described.returncode == 0, described.stderr
        upcoming = json.loads(described.stdout)["upcomingMaintenance"]
        assert upcoming["type"] == "SCHEDULED" and upcoming["maintenanceStatus"] == "PENDING"
        assert upcoming["canReschedule"] is True
        assert upcoming["windowStartTime"] < upcoming["windowEndTime"]
    finally:
        tpufab("sim", "maintenance", pod4.name, "--clear", env=pod4.env)


def test_sim_maintenance_bad_input_is_one_sentence(pod4):
    from helpers import one_sentence

    one_sentence(tpufab("sim", "maintenance", pod4.name, "--in", "soon", env=pod4.env),
                 "--in takes a duration such as 90s, 30m, 2h or 1h30m, not 'soon'.")
    one_sentence(tpufab("sim", "maintenance", pod4.name, env=pod4.env),
                 "--in DURATION")


# ---------------------------------------------------------------------------------------------
# top


def test_top_once_folds_the_idle_workers_and_shows_the_busy_one(pod4, tmp_path):
    from helpers import in_worker, wait_for

    pid = in_worker(pod4.sim, pod4.node, 2, "python3 -c 'while True: pass' "
                    ">/dev/null 2>&1 </dev/null & echo $!").strip()
    assert pid.isdigit(), pid
    frames = []

    def folded() -> bool:
        shown = tpufab("top", "--once", "--json", "--interval", "1", env=pod4.env,
                       cwd=tmp_path, timeout=120)
        assert shown.returncode == 0, shown.stderr
        frames.append(json.loads(shown.stdout))
        return [(r["workers"], r["state"]) for r in frames[-1]["rows"]] == \
            [("w[0-1,3]", "idle"), ("w2", "busy")]

    try:
        # a loaded 2-core host can starve the loop for a moment: ask again, within a bound
        wait_for(folded, 90, what="a frame with w[0-1,3] idle and w2 busy")
        frame = frames[-1]
        idle, busy = frame["rows"]
        assert busy["outlier"] and not idle["outlier"]
        assert "while True: pass" in busy["processes"]
        w2 = next(w for w in frame["workers"] if w["worker"] == 2)
        assert w2["busiest"][0]["pid"] == int(pid) and w2["core_percent"] >= 10
        assert frame["tpu"] == "TPU use: idle: no process holds the TPU"   # docs/tpu.md

        tables = []

        def shown_as_table() -> bool:
            table = tpufab("top", "--once", env=pod4.env, cwd=tmp_path, timeout=120)
            assert table.returncode == 0, table.stderr
            tables.append(table.stdout)
            rows = [x.split() for x in table.stdout.splitlines() if x.startswith("w")]
            return [r[:2] for r in rows] == [["w[0-1,3]", "idle"], ["w2", "busy"]]

        wait_for(shown_as_table, 90, what="the table to fold w[0-1,3] and show w2 busy")
        assert "TPU use: idle: no process holds the TPU" in tables[-1]
        assert "WORKERS" in tables[-1] and "CPU" in tables[-1]
    finally:
        in_worker(pod4.sim, pod4.node, 2, f"kill {pid}", check=False)


def test_top_bad_input_is_one_sentence(pod4):
    from helpers import one_sentence

    one_sentence(tpufab("top", "--once", "--interval", "0", env=pod4.env),
                 "--interval must be above 0 and at most 30 seconds, not 0.")
    one_sentence(tpufab("top", "--every", "0.2", env=pod4.env),
                 "--every must be at least 1 second and at most 3600 (an hour), not 0.2.")


def test_near_equal_workers_fold_and_the_odd_ones_stand_out():
    from tpufab.steps.health.top import TopRow, fold_rows

    def idle(w, cpu):
        return TopRow(w, True, cpu_percent=cpu / 2, core_percent=cpu, cores=2,
                          load=(0.5,), memory_total=100, memory_available=88,
                          tpu={"available": False, "why": "simulated: x"})

    loads = {w: idle(w, 1.0 + (w % 5) * 0.5) for w in range(64)}
    assert [(r.label, r.state, r.cpu) for r in fold_rows(loads)] == [("w[0-63]", "idle", "0-2%")]
    loads[7] = TopRow(7, True, cpu_percent=48.0, core_percent=96.0, cores=2, load=(0.5,),
                          memory_total=100, memory_available=88,
                          busiest=({"command": "python3 train.py", "cpu_percent": 96.0},),
                          tpu={"available": False, "why": "simulated: x"})
    loads[9] = TopRow(9, False, error="connection refused")
    rows = fold_rows(loads)
    assert [(r.label, r.state, r.odd) for r in rows] == [
        ("w[0-6,8,10-63]", "idle", False), ("w7", "busy", True), ("w9", "unreachable", True)]
    assert rows[1].processes == "python3 train.py 96%" and rows[1].cpu == "48%"


def test_the_live_view_gives_a_frame_every_few_seconds_until_ctrl_c(pod4):
    from tpufab.pod.api import Pod

    frames = []

    def on_frame(frame) -> None:
        frames.append(frame.taken_at - frame.seconds)     # when the frame began
        if len(frames) == 2:
            raise KeyboardInterrupt

    with Pod.from_settings(pod4.settings) as pod, pytest.raises(KeyboardInterrupt):
        pod.top(every=2.0, interval=0.5, on_frame=on_frame, workers="0,1")
    assert len(frames) == 2 and frames[1] - frames[0] >= 2.0 - 0.1   # every 2 s, from the start
