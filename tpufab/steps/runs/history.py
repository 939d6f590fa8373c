"""What the workers know of their runs, asked on behalf of `Pod.runs` and `Pod.logs`: the
runs each worker has (with its state there), and one run's logs so far."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from tpufab import nodeset
from tpufab.errors import ConfigError
from tpufab.reports import Column, Report
from tpufab.steps.runs.env import is_run_id
from tpufab.steps.runs.running import (
    RunError,
    RunRow,
    WorkerRuns,
    WorkerState,
    fetch_logs,
    fold_states,
    latest_run,
    run_rows,
    statuses,
)


def unreachable_states(found: dict[int, WorkerRuns]) -> list[WorkerState]:
    return [WorkerState(w, "unreachable", detail=s.error) for w, s in found.items()
            if s.error is not None]


def _started(row: RunRow) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(row.started_at)) \
        if row.started_at else "-"


def _took(row: RunRow) -> str:
    """``3.7s``, or ``2.8s+`` while it runs (counted to now)."""
    if row.started_at and row.ended_at:
        return duration_text(row.ended_at - row.started_at)
    if row.started_at and row.running:
        return duration_text(time.time() - row.started_at) + "+"
    return "-"


def duration_text(seconds: float) -> str:
    seconds = max(0.0, seconds)
    if seconds < 60:
        return f"{seconds:.1f}s"
    minutes, secs = divmod(int(seconds), 60)
    if minutes < 60:
        return f"{minutes}m{secs:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m"


RUNS_COLUMNS = (Column("RUN", lambda r: r.run), Column("RECIPE", lambda r: r.recipe),
                Column("STARTED", _started), Column("TIME", _took),
                Column("COMMIT", lambda r: (r.commit or "-")[:12]),
                Column("WORKERS", lambda r: r.folded_states))
# shown only when a listed run is an attempt of a supervised job (docs/supervisor.md)
JOB_COLUMN = Column("JOB", lambda r: r.job or "-")


@dataclass(kw_only=True)
class RunsReport(Report):
    """Every run the chosen workers know (``.rows``, newest first, each with every worker's
    state: a ``tpufab.reports.Report`` of the pod's own rows), and the workers that did not
    answer (``.unreachable``)."""

    step: str = "runs"
    columns: tuple[Column, ...] = RUNS_COLUMNS
    per_worker: bool = False
    statuses: dict[int, WorkerRuns] = field(default_factory=dict, metadata={"json": False})
    workers: str = ""
    unreachable: list[WorkerState] = field(default_factory=list)   # did not answer

    def __post_init__(self) -> None:
        self.rows = run_rows(self.statuses)
        if any(r.job for r in self.rows) and JOB_COLUMN not in self.columns:
            self.columns = (*self.columns, JOB_COLUMN)
            self.notes = [*self.notes, supervised_note(self.rows)]
        self.workers = nodeset.fold(self.statuses)
        self.unreachable = unreachable_states(self.statuses)
        if not self.rows and self.reachable:
            self.summary = (f"No runs on {nodeset.fold(self.reachable)} yet; start one with "
                            "`tpufab run RECIPE`.")

    @property
    def reachable(self) -> list[int]:
        return [w for w, s in self.statuses.items() if s.error is None]

    @property
    def ok(self) -> bool:
        return not self.unreachable

    def check(self) -> RunsReport:
        """This report, or RunError naming the workers that did not answer."""
        if self.unreachable:
            raise RunError(f"Could not list runs on {fold_states(self.unreachable)}.")
        return self


def supervised_note(rows: Sequence[RunRow]) -> str:
    """What `runs` says under a table holding attempts of supervised jobs."""
    jobs = sorted({r.job for r in rows if r.job})
    return (f"Runs with a JOB are attempts of supervised job{'s' if len(jobs) > 1 else ''} "
            f"{', '.join(jobs)}: `tpufab jobs` shows {'them' if len(jobs) > 1 else 'it'}, "
            "`tpufab jobs logs JOB` every attempt's output.")


def supervised_line(row: RunRow) -> str | None:
    """`logs`' line naming the supervised job of the run, or None for a run of its own."""
    if not row.job:
        return None
    return (f"Run {row.run} is an attempt of supervised job {row.job}: `tpufab jobs logs "
            f"{row.job}` shows every attempt, `tpufab jobs cancel {row.job}` stops it.")


def list_runs(fanout, workers: Sequence[int], *, timeout: float | None) -> RunsReport:
    """``run_worker.py status`` on ``workers``, as one report."""
    return RunsReport(statuses=statuses(fanout, workers, timeout=timeout))


def find_run(fanout, chosen: Sequence[int], run: str | None, *,
             timeout: float | None) -> tuple[str, dict[int, WorkerRuns], list[int]]:
    """(run id, statuses, workers that have it) of ``run``, or of the latest run any chosen
    worker knows; RunError in one sentence when there is none."""
    if run is not None and not is_run_id(run):
        raise ConfigError(f"{run!r} is not a run id (they look like 20261122-104455-ab12); "
                          "`tpufab runs` lists them.")
    found = statuses(fanout, chosen, timeout=timeout)
    reachable = [w for w, s in found.items() if s.error is None]
    if not reachable:
        raise RunError(f"No worker answered ({fold_states(unreachable_states(found))}).")
    run_id = run or latest_run(found)
    if run_id is None:
        raise RunError(f"No runs on {nodeset.fold(reachable)} yet; start one with "
                       "`tpufab run RECIPE`.")
    have = [w for w in reachable if any(e.get("run") == run_id for e in found[w].runs)]
    if not have:
        raise RunError(f"No run {run_id} on {nodeset.fold(reachable)}; `tpufab runs` "
                       "lists the runs there.")
    return run_id, found, have


@dataclass
class LogsReport:
    """One run's logs: ``.logs`` (each worker's spooled output so far: ``.chunks()``, then
    ``close()`` the report) and ``.states`` (how the run stands, or, followed, how it ended
    on each worker); ``.check()`` raises what the logs verb says when they are not the whole
    story."""

    run_id: str
    row: RunRow
    have: list[int]                       # the chosen workers that know the run
    absent: list[int]                     # chosen, reachable, no record of it
    unreachable: list[WorkerState]        # chosen workers that did not answer
    secrets: list[str] = field(default_factory=list)
    logs: dict = field(default_factory=dict)
    states: dict[int, WorkerState] = field(default_factory=dict)
    followed: bool = False
    interrupted: bool = False             # following stopped by Ctrl-C (the run goes on)
    follow_timeout: float = float("inf")

    @property
    def gone(self) -> list[WorkerState]:
        """Workers whose log could not be read."""
        return [s for s in self.states.values() if s.state in ("unreachable", "no record")]

    @property
    def timed_out(self) -> list[int]:
        return [s.worker for s in self.states.values()
                if (s.detail or "").startswith("timed out")]

    @property
    def ok(self) -> bool:
        return bool(self.states) and all(s.ok for s in self.states.values())

    def summary(self) -> str:
        return f"Run {self.run_id}: {fold_states(self.states.values())}."

    def gone_text(self) -> str:
        """``w2 unreachable (...)``: the workers whose log could not be read, folded."""
        return fold_states(self.gone)

    def close(self) -> None:
        for output in self.logs.values():
            output.close()
        self.logs = {}

    def check(self) -> LogsReport:
        """This report, or RunError: a follow that timed out (exit 124), a run that failed
        (its exit status), or logs that miss a worker that did not answer."""
        if self.followed and not self.interrupted:
            if self.timed_out:
                raise RunError(f"Stopped following run {self.run_id} on "
                               f"{nodeset.fold(self.timed_out)} after {self.follow_timeout:g} s "
                               "(--timeout); the run itself is untouched: `tpufab runs`, "
                               f"`tpufab logs --run {self.run_id} --follow`.", exit_code=124)
            if not self.ok:
                codes = {s.exit_status for s in self.states.values() if not s.ok}
                code = codes.pop() if len(codes) == 1 else 1
                raise RunError(self.summary(), exit_code=code if 0 < code < 256 else 1)
        missing = list(self.unreachable)
        if not self.followed:
            missing += [s for s in self.gone if s.state == "unreachable"]
        if missing:
            raise RunError(f"No log from {fold_states(missing)}: the logs above miss "
                           f"{'that worker' if len(missing) == 1 else 'those workers'}; check "
                           f"it with `tpufab status`, then `tpufab logs --run {self.run_id}` "
                           "again.")
        return self


def run_logs(fanout, chosen: Sequence[int], run: str | None, *, timeout: float | None,
             follow: bool = False, follow_timeout: float = float("inf"), sink=None,
             secrets: Sequence[str] = (), progress=None) -> LogsReport:
    """The logs of ``run`` (default: the latest) on the chosen workers that have it: fetched
    whole, or (``follow``) streamed into ``sink`` until the run ends there, masked with
    ``secrets`` either way. ``sink`` may be a function of the followed workers that returns
    the sink (a folded view needs them). ``progress(text, style)`` hears which run it is."""
    from tpufab.ssh.results import FanoutInterrupted
    from tpufab.steps.runs import running

    run_id, found, have = find_run(fanout, chosen, run, timeout=timeout)
    rows = {r.run: r for r in run_rows({w: found[w] for w in chosen})}
    report = LogsReport(run_id, rows[run_id], have,
                        [w for w in chosen if w not in have and found[w].error is None],
                        unreachable_states({w: found[w] for w in chosen}),
                        secrets=list(secrets), followed=follow, follow_timeout=follow_timeout)
    if progress is not None:
        progress(f"Run {run_id}: {report.row.recipe} - {report.row.folded_states}", "dim")
        job_line = supervised_line(report.row)
        if job_line:
            progress(job_line, "dim")
        if report.absent:
            progress(f"({nodeset.fold(report.absent)} "
                     f"{'has' if len(report.absent) == 1 else 'have'} no record of it.)", "dim")
    if not follow:
        report.logs, report.states = fetch_logs(fanout, run_id, have, timeout=timeout)
        return report
    if callable(sink) and not hasattr(sink, "lines"):
        sink = sink(have)
    follower = running.FollowSink(sink if sink is not None else _Silent(), secrets=secrets)
    try:
        report.states = running.follow(fanout, run_id, have, follower, timeout=follow_timeout)
    except FanoutInterrupted:
        report.interrupted = True
    finally:
        follower.close()
    return report


class _Silent:
    """A view that shows nothing."""

    def lines(self, worker: int, stream: str, data: bytes) -> None:
        pass

    def done(self, result) -> None:
        pass
