"""What the workers know of their runs, asked on behalf of `Pod.runs` and `Pod.logs`: the
runs each worker has (with its state there), and one run's logs so far."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property

from tpufab import nodeset
from tpufab.errors import ConfigError
from tpufab.jobs.running import (
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
from tpufab.jobs.runs import is_run_id

LIST_TIMEOUT = 60.0     # `runs`: seconds for every worker to answer
LOGS_TIMEOUT = 300.0    # plain `logs`: seconds for every worker's log


def unreachable_states(found: dict[int, WorkerRuns]) -> list[WorkerState]:
    return [WorkerState(w, "unreachable", detail=s.error) for w, s in found.items()
            if s.error is not None]


@dataclass
class RunsReport:
    """Every run the chosen workers know (``.rows``, newest first), and the workers that did
    not answer (``.unreachable``)."""

    statuses: dict[int, WorkerRuns]

    @cached_property
    def rows(self) -> list[RunRow]:
        return run_rows(self.statuses)

    @property
    def unreachable(self) -> list[WorkerState]:
        return unreachable_states(self.statuses)

    @property
    def reachable(self) -> list[int]:
        return [w for w, s in self.statuses.items() if s.error is None]

    @property
    def ok(self) -> bool:
        return not self.unreachable

    def to_json(self) -> list[dict]:
        return [{"run": r.run, "recipe": r.recipe, "started_at": r.started_at,
                 "ended_at": r.ended_at, "commit": r.commit,
                 "workers": {str(s.worker): s.label for s in r.states}} for r in self.rows]

    def check(self) -> RunsReport:
        """This report, or RunError naming the workers that did not answer."""
        if self.unreachable:
            raise RunError(f"Could not list runs on {fold_states(self.unreachable)}.")
        return self


def list_runs(group, workers: Sequence[int], *, timeout: float | None) -> RunsReport:
    """``launch.py status`` on ``workers``, as one report."""
    return RunsReport(statuses(group, workers, timeout=timeout))


def find_run(group, chosen: Sequence[int], run: str | None, *,
             timeout: float | None) -> tuple[str, dict[int, WorkerRuns], list[int]]:
    """(run id, statuses, workers that have it) of ``run``, or of the latest run any chosen
    worker knows; RunError in one sentence when there is none."""
    if run is not None and not is_run_id(run):
        raise ConfigError(f"{run!r} is not a run id (they look like 20261122-104455-ab12); "
                          "`tpufab runs` lists them.")
    found = statuses(group, chosen, timeout=timeout)
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


def run_logs(group, chosen: Sequence[int], run: str | None, *, timeout: float | None,
             follow: bool = False, follow_timeout: float = float("inf"), sink=None,
             secrets: Sequence[str] = (), progress=None) -> LogsReport:
    """The logs of ``run`` (default: the latest) on the chosen workers that have it: fetched
    whole, or (``follow``) streamed into ``sink`` until the run ends there, masked with
    ``secrets`` either way. ``sink`` may be a function of the followed workers that returns
    the sink (a folded view needs them). ``progress(text, style)`` hears which run it is."""
    from tpufab.jobs import running
    from tpufab.ssh.fanout import FanoutInterrupted

    run_id, found, have = find_run(group, chosen, run, timeout=timeout)
    rows = {r.run: r for r in run_rows({w: found[w] for w in chosen})}
    report = LogsReport(run_id, rows[run_id], have,
                        [w for w in chosen if w not in have and found[w].error is None],
                        unreachable_states({w: found[w] for w in chosen}),
                        secrets=list(secrets), followed=follow, follow_timeout=follow_timeout)
    if progress is not None:
        progress(f"Run {run_id}: {report.row.recipe} - {report.row.workers}", "dim")
        if report.absent:
            progress(f"({nodeset.fold(report.absent)} "
                     f"{'has' if len(report.absent) == 1 else 'have'} no record of it.)", "dim")
    if not follow:
        report.logs, report.states = fetch_logs(group, run_id, have, timeout=timeout)
        return report
    if callable(sink) and not hasattr(sink, "lines"):
        sink = sink(have)
    follower = running.FollowSink(sink if sink is not None else _Silent(), secrets=secrets)
    try:
        report.states = running.follow(group, run_id, have, follower, timeout=follow_timeout)
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
