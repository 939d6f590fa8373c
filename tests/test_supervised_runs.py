"""Runs that are attempts of a supervised job, as the verbs that read runs show them (no pod):
the supervisor puts the job's id into each run's environment (TPUFAB_SUPERVISED_JOB), the
worker side keeps it in the run's record (meta.json), and `runs` (a JOB column and a note),
`logs` (a line naming the job), `status` (the running run's cell) and `kill` (one sentence:
the supervisor may relaunch it, `tpufab jobs cancel JOB` stops the job) say so; a run of its
own shows none of it."""

from __future__ import annotations

import io
import json
import subprocess
from pathlib import Path

from helpers import WORKER_PYTHON, shipped, wait_for
from rich.console import Console

from tpufab.flows.supervisor import service
from tpufab.flows.supervisor import state as st
from tpufab.remote import facts_worker, kill_worker
from tpufab.ssh.remote_files import read_answer
from tpufab.steps.health.status import RunFact, StatusRow, runs_cell
from tpufab.steps.host.killing import KillReport, WorkerReport
from tpufab.steps.runs.history import RunsReport, supervised_line
from tpufab.steps.runs.running import WorkerRuns, run_rows
from tpufab.views.report import show

JOB = "job-20261202-041500-ab12"
RUN = "20261202-041510-9c41"


def worker(*args: str, stdin: str | None = None) -> dict:
    done = subprocess.run([WORKER_PYTHON, str(shipped("run_worker.py")), *args], input=stdin,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    return read_answer(done.stdout)


def start(runs: Path, run_id: str, env: dict) -> None:
    recipe = runs.parent / "r.sh"
    recipe.write_text("#!/bin/sh\necho hi\n")
    recipe.chmod(0o755)
    worker("start", "--run-dir", str(runs), "--run", run_id, "--recipe", str(recipe),
           "--env-stdin", stdin=json.dumps(env))


def test_the_runs_record_on_the_worker_keeps_the_job_of_its_environment(tmp_path):
    runs = tmp_path / "runs"
    spec = st.JobSpec(job=JOB, pod=st.PodRef("p", "z"), recipe="r.sh", code=st.Code.of("c"),
                      env={"BATCH": "8"})
    env = dict(e.split("=", 1) for e in service.job_env(
        spec, {"TPUFAB_GIT_TOKEN": "ghp_x", "HF_TOKEN": "hf_x"}))
    assert env == {"BATCH": "8", "HF_TOKEN": "hf_x", "TPUFAB_SUPERVISED_JOB": JOB}  # no git token
    start(runs, RUN, env)
    start(runs, "20261202-041511-0000", {"BATCH": "8"})           # a run of its own
    answer = wait_for(lambda: (a := worker("status", "--run-dir", str(runs))) and all(
        r["state"] == "exited" for r in a["runs"]) and a, 20, what="both runs to end")
    by_run = {r["run"]: r for r in answer["runs"]}
    assert by_run[RUN]["job"] == JOB and "job" not in by_run["20261202-041511-0000"]
    facts = {r["run"]: r for r in facts_worker.runs(str(runs), 5)[0]}
    assert facts[RUN]["job"] == JOB and "job" not in facts["20261202-041511-0000"]
    assert kill_worker.supervised_job(str(runs / RUN)) == JOB
    assert kill_worker.supervised_job(str(runs / "20261202-041511-0000")) is None


def shown(report) -> tuple[str, str]:
    out, err = io.StringIO(), io.StringIO()
    show(report, console=Console(file=out, width=200), errors=Console(file=err, width=300))
    return out.getvalue(), err.getvalue()


def test_runs_shows_the_job_column_and_says_what_it_means_only_when_there_is_one():
    entry = {"run": RUN, "recipe": "train.sh", "state": "running", "started_at": 1.0,
             "job": JOB}
    other = {"run": "20261202-041511-0000", "recipe": "x.sh", "state": "exited",
             "exit_code": 0, "started_at": 1.0, "ended_at": 2.0}
    report = RunsReport(statuses={0: WorkerRuns(0, (entry, other)),
                                  1: WorkerRuns(1, ({**entry},))})
    out, err = shown(report)
    header = out.splitlines()[0]
    assert header.split()[-1] == "JOB"
    line = next(x for x in out.splitlines() if RUN in x)
    assert line.split()[-1] == JOB
    assert f"attempts of supervised job {JOB}" in err and "`tpufab jobs logs JOB`" in err
    assert [r.job for r in report.rows] == [None, JOB]
    assert json.loads(json.dumps(report.rows[1].job)) == JOB
    plain, plain_err = shown(RunsReport(statuses={0: WorkerRuns(0, (other,))}))
    assert "JOB" not in plain and "supervised" not in plain_err


def test_logs_names_the_job_of_a_supervised_run():
    [row] = run_rows({0: WorkerRuns(0, ({"run": RUN, "recipe": "t.sh", "state": "running",
                                         "job": JOB},))})
    line = supervised_line(row)
    assert line == (f"Run {RUN} is an attempt of supervised job {JOB}: `tpufab jobs logs {JOB}` "
                    f"shows every attempt, `tpufab jobs cancel {JOB}` stops it.")
    [plain] = run_rows({0: WorkerRuns(0, ({"run": RUN, "recipe": "t.sh", "state": "running"},))})
    assert supervised_line(plain) is None


def test_status_names_the_job_of_the_running_run():
    row = StatusRow(0, True, runs=(RunFact(RUN, "running", recipe="train.sh", job=JOB),),
                    runs_total=1)
    assert runs_cell(row) == f"running {RUN} (train.sh; supervised job {JOB})"
    plain = StatusRow(0, True, runs=(RunFact(RUN, "running", recipe="train.sh"),), runs_total=1)
    assert runs_cell(plain) == f"running {RUN} (train.sh)"


def kill_report(state: str, *, dry_run: bool = False, job: str | None = JOB) -> KillReport:
    run = {"run": RUN, "state": state, **({"job": job} if job else {})}
    reports = {w: WorkerReport(w, {"devices": [], "device_free": True, "runs": [run],
                                   "killed": [] if dry_run else [
                                       {"pid": 10 + w, "name": "t.sh", "command": "t.sh",
                                        "reason": f"run {RUN}", "signal": "TERM"}],
                                   "would_kill": [], "failed": [], "protected": [],
                                   "holders_left": [], "lockfiles": [], "dry_run": dry_run})
               for w in (0, 1)}
    return KillReport(reports, dry_run, 5.0)


def test_kill_of_a_supervised_run_says_the_supervisor_may_relaunch_it_and_how_to_stop_it():
    report = kill_report("stopped")
    assert report.notes == [
        f"Run {RUN} (stopped here) is an attempt of supervised job {JOB}: its supervisor takes "
        "the kill for the recipe failing (exit 143) and relaunches the job if its error budget "
        "or --restart-on-exit allows (else the job fails), so to stop the job for good cancel "
        f"it with `tpufab jobs cancel {JOB}`."]
    out, err = shown(report)
    assert f"`tpufab jobs cancel {JOB}`" in err and "Killed 2 processes" in out
    assert "would stop here" in kill_report("would stop", dry_run=True).notes[0]
    assert kill_report("ended").notes == []              # nothing of it stopped
    assert kill_report("stopped", job=None).notes == []   # a run of its own
    assert kill_report("still running").notes             # signalled, not gone yet
