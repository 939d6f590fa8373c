"""The one per-worker report and its one renderer (tpufab.reports.Report,
tpufab.views.report), as data: folding, failures, lines and tables, --json."""

from __future__ import annotations

import io
import json
from dataclasses import dataclass

from rich.console import Console

from tpufab.reports import Column, Report, folded, seconds_range, text
from tpufab.steps.host.killing import KillReport, WorkerReport
from tpufab.views.report import show


@dataclass
class Row:
    worker: int
    ok: bool = True
    action: str | None = None
    seconds: float | None = None
    error: str | None = None
    message: str | None = None


@dataclass(kw_only=True)
class StepReport(Report):
    step: str = "step"
    columns: tuple[Column, ...] = (Column("RESULT", lambda r: r.action),
                                   Column("TIME", over=seconds_range))
    where: str = "~/proj"


def report() -> StepReport:
    rows = [Row(w, action="clone", seconds=0.5 + w / 100) for w in (0, 1, 2, 5)]
    rows += [Row(3, action="noop", seconds=0.1),
             Row(4, ok=False, error="disk_full", message="No space left on device"),
             Row(6, ok=False, error="disk_full", message="No space left on device")]
    return StepReport(rows=rows, summary="Done on 7 workers.", notes=["see ~/log"])


def shown(r: Report, **kw) -> tuple[str, str]:
    out = Console(file=io.StringIO(), width=120, highlight=False)
    err = Console(file=io.StringIO(), width=120, highlight=False)
    show(r, console=out, errors=err, **kw)
    return out.file.getvalue(), err.file.getvalue()


def test_rows_that_agree_fold_under_their_workers_and_failures_are_named():
    assert folded(report()) == [("w[0-2,5]", ["clone", "0.50-0.55s"], True),
                                ("w3", ["noop", "0.10s"], True),
                                ("w[4,6]", ["failed: disk_full: No space left on device", "-"],
                                 False)]
    assert text(report()) == ["w[0-2,5]  clone  0.50-0.55s", "w3        noop  0.10s",
                              "w[4,6]    failed: disk_full: No space left on device"]
    r = report()
    assert not r.ok and [f.worker for f in r.failed] == [4, 6] and r.by_worker[3].action == "noop"


def test_show_prints_a_table_under_workers_then_the_summary_and_notes_on_stderr():
    out, err = shown(report())
    lines = out.splitlines()
    assert lines[0].split() == ["WORKERS", "RESULT", "TIME"]
    assert lines[1].split() == ["w[0-2,5]", "clone", "0.50-0.55s"]
    assert lines[3].split()[:3] == ["w[4,6]", "failed:", "disk_full:"]
    assert lines[-1] == "Done on 7 workers." and err == "see ~/log\n"


def test_lines_carry_the_prefix_and_join_their_cells():
    r = StepReport(rows=[Row(0, action="1 file"), Row(1, action="1 file")], lines=True,
                   prefix="put: ", columns=(Column("WHAT", lambda r: r.action),
                                            Column("TIME", over=lambda rows: "0.2 s")))
    assert shown(r)[0] == "put: w[0-1]  1 file, 0.2 s\n"


def test_json_is_the_step_its_fields_and_every_row():
    data = json.loads(shown(report(), as_json=True)[0])
    assert data["step"] == "step" and data["ok"] is False and data["workers"] == "w[0-6]"
    assert data["where"] == "~/proj" and data["summary"] == "Done on 7 workers."
    assert [r["worker"] for r in data["rows"]] == list(range(7))
    assert data["rows"][4] == {"worker": 4, "ok": False, "action": None, "seconds": None,
                               "error": "disk_full", "message": "No space left on device"}


def test_kill_rows_fold_each_workers_pid_into_one_line():
    answer = {"dry_run": False, "device_free": True, "killed": [
        {"pid": 0, "name": "python3", "command": "python3 train.py", "reason": "holds /dev/accel0"}],
        "lockfiles": [], "protected": [], "holders_left": [], "failed": [], "runs": []}
    result = KillReport({w: WorkerReport(w, {**answer, "killed": [
        {**answer["killed"][0], "pid": 100 + w}]}) for w in range(3)})
    assert text(result) == ["w[0-2]  killed     pids 100,101,102 python3 `python3 train.py` "
                            "(holds /dev/accel0)"]
    assert result.ok and result.summary.startswith("Killed 3 processes on w[0-2].")


def test_runs_are_the_pods_own_rows_under_their_columns_and_json():
    from tpufab.steps.runs.history import RunsReport
    from tpufab.steps.runs.running import WorkerRuns

    entry = {"run": "20261122-113148-b627", "recipe": "fail.sh", "state": "exited",
             "exit_code": 0, "started_at": 1000.0, "ended_at": 1000.1}
    report = RunsReport(statuses={0: WorkerRuns(0, (entry,)),
                                  1: WorkerRuns(1, ({**entry, "exit_code": 3},)),
                                  2: WorkerRuns(2, error="connection refused")})
    out, _ = shown(report)
    header, row = out.splitlines()
    assert header.split() == ["RUN", "RECIPE", "STARTED", "TIME", "COMMIT", "WORKERS"]
    assert row.split()[:2] == ["20261122-113148-b627", "fail.sh"] and " 0.1s " in row
    assert "  w0 exited 0; w1 exited 3; w2 unreachable" in row, row   # the states, folded
    data = json.loads(shown(report, as_json=True)[0])
    assert data["step"] == "runs" and data["ok"] is False and data["workers"] == "w[0-2]"
    [run] = data["rows"]
    assert run == {"run": entry["run"], "recipe": "fail.sh", "started_at": 1000.0,
                   "ended_at": 1000.1, "commit": None,
                   "workers": {"0": "exited 0", "1": "exited 3",
                               "2": "unreachable (connection refused)"},
                   "job": None}      # not an attempt of a supervised job
    assert [u["worker"] for u in data["unreachable"]] == [2]
    empty = RunsReport(statuses={0: WorkerRuns(0)})
    assert shown(empty)[0] == "No runs on w0 yet; start one with `tpufab run RECIPE`.\n"


def test_a_report_with_a_view_is_printed_by_its_view_human_and_json():
    from tpufab.steps.health.top import TopReport, TopRow

    frame = TopReport("demo", 1000.0, 1.5, 1.0,
                     rows=[TopRow(0, True), TopRow(1, True),
                           TopRow(2, False, error="connection refused")])
    assert not frame.ok and [r.label for r in frame.folded] == ["w[0-1]", "w2"]
    out, err = shown(frame)
    lines = out.splitlines()
    assert lines[0].startswith("demo: 3 workers at ") and not err
    assert lines[1].split()[:2] == ["WORKERS", "STATE"]
    assert [line.split()[:2] for line in lines[2:]] == [["w[0-1]", "idle"],
                                                         ["w2", "unreachable"]]
    data = json.loads(shown(frame, as_json=True)[0])
    assert [r["workers"] for r in data["rows"]] == ["w[0-1]", "w2"]     # the documented shape
    assert [w["worker"] for w in data["workers"]] == [0, 1, 2] and "step" not in data


def test_top_follow_draws_each_frame_until_ctrl_c_and_returns_the_last():
    from tpufab.steps.health.top import TopReport, TopRow
    from tpufab.views.top import follow

    frames = [TopReport("demo", 1000.0 + n, 1.0, 1.0, rows=[TopRow(0, True)])
              for n in range(3)]

    def watch(on_frame):
        for frame in frames:
            on_frame(frame)
        raise KeyboardInterrupt

    out = Console(file=io.StringIO(), width=120)
    assert follow(watch, as_json=True, console=out) is frames[-1]
    lines = out.file.getvalue().splitlines()
    assert [json.loads(line)["taken_at"] for line in lines] == [1000.0, 1001.0, 1002.0]
    live = Console(file=io.StringIO(), width=120, force_terminal=True)
    assert follow(watch, as_json=False, console=live) is frames[-1]
    assert "Ctrl-C to stop." in live.file.getvalue()
    assert follow(lambda on_frame: None, as_json=True, console=out) is None


def test_ray_status_is_a_report_printed_by_its_view_and_ray_up_down_say_what_they_did():
    from tpufab.reports import down_sentence, up_sentence
    from tpufab.steps.start.raycluster import Host, RayDown, RayStatusReport, RayUp

    hosts = [Host(w, f"10.0.0.{w + 2}", "pod-a", w, "v4-16", "2x2x2", 4) for w in (0, 1)]
    head_node = {"ip": "10.0.0.2", "head": True, "labels": {"ray.io/tpu-slice-name": "pod-a",
                 "ray.io/tpu-worker-id": "0", "ray.io/tpu-pod-type": "v4-16",
                 "ray.io/tpu-topology": "2x2x2"},
                 "resources": {"TPU": 4.0, "CPU": 8.0, "TPU-v4-16-head": 1.0}}
    status = RayStatusReport(name="pod", address="10.0.0.2:6379", head=0, rows=hosts,
                       states={0: {"head": True}, 1: {}}, nodes=[head_node],
                       jobs=[{"id": "raysubmit_1", "status": "RUNNING", "entrypoint": "x.py"}])
    assert status.hosts == hosts and status.missing == [1] and not status.ok
    out, err = shown(status)
    assert out.splitlines() == [
        "Ray on pod: head on w0 at 10.0.0.2:6379; 1/2 hosts joined.",
        "  w0 10.0.0.2: TPU 4, CPU 8, TPU-v4-16-head; slice pod-a, worker-id 0, pod-type "
        "v4-16, topology 2x2x2 (head)",
        "  not joined: w1 (`tpufab ray up` rejoins them)",
        "Jobs (1):",
        "  raysubmit_1: RUNNING  x.py"] and not err
    data = json.loads(shown(status, as_json=True)[0])
    assert data == {"up": True, "address": "10.0.0.2:6379", "head": 0, "missing": [1],
                    "nodes": [head_node], "jobs": status.jobs, "error": None}   # docs/ray.md
    down = RayStatusReport(name="pod", address="10.0.0.2:6379", head=0, rows=hosts,
                     states={0: {}, 1: {"processes": [123]}})
    assert shown(down)[0].splitlines() == [
        "Ray is not running on pod (Ray processes are left on w1: `tpufab ray down` stops "
        "them); `tpufab ray up` starts it."]
    up = RayUp(address="10.0.0.2:6379", head=0, hosts=2, started=[1], seconds=3.0)
    assert up_sentence(up, "pod") == (
        "Ray is up on pod: head on w0 at 10.0.0.2:6379, 2 hosts joined (started on w1 (the "
        "others were up), 3.0 s). Jobs: `tpufab ray submit RECIPE`; dashboard: `tpufab "
        "forward 8265` (its token: `~/.ray/auth_token` on the head).")
    # a Ray without token authentication is named: its job API is open (issue 37, High 1)
    old = RayUp(address="10.0.0.2:6379", head=0, hosts=2, already=True, seconds=1.0,
                open_hosts=[0, 1])
    assert up_sentence(old, "pod").endswith(
        "nothing to do (1.0 s). Warning: Ray on w[0-1] has no token authentication (Ray 2.52 "
        "and later have it): anyone who can reach those hosts can run commands through Ray; "
        "install a newer Ray (`TPUFAB_RAY_SPEC`).")
    assert down_sentence(RayDown({0: {"stopped": True}, 1: {"stopped": True, "forced": True}}),
                         "pod") == ("Ray stopped on w[0-1] of pod (forced on w1); no Ray "
                                    "process is left on any host.")
