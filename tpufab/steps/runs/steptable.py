"""`tpufab stragglers`: the per-host step table of a running or finished run, slowest first.

Each worker's log comes through the logs path (``Pod.logs``); its step lines (the step pattern
of :mod:`tpufab.steps.runs.stragglers`) say how far each host got, and, where they start with a
timestamp, how long each step took by that host's clock. Where this machine followed the run
(`run`, `launch`), the steps it timed then, with each host's time outside collectives from
libtpu's metrics, are in ``./.tpufab/runs/<run>/steps.json`` (steps/runs/livesteps.py), and
the table is theirs. A finished run's table is the same as a running one's, so far.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tpufab import nodeset
from tpufab.reports import Column, Report
from tpufab.steps.runs import stragglers
from tpufab.steps.runs.livesteps import StepLines


@dataclass
class StragglerRow:
    """One host's line: its step lines, the last step, its median and slowest step (work
    where metrics were read, else step time; seconds), against the hosts' median (%)."""

    worker: int
    steps: int
    last_step: int | None
    median_seconds: float | None
    slowest_seconds: float | None
    vs_median_percent: float | None
    duty_percent: float | None
    ok: bool = True

    @property
    def host(self) -> str:
        return nodeset.label(self.worker)


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}s"


COLUMNS = (Column("HOST", lambda r: r.host), Column("STEPS", lambda r: str(r.steps)),
           Column("LAST", lambda r: "-" if r.last_step is None else str(r.last_step)),
           Column("MEDIAN", lambda r: _seconds(r.median_seconds)),
           Column("SLOWEST", lambda r: _seconds(r.slowest_seconds)),
           Column("VS MEDIAN", lambda r: "-" if r.vs_median_percent is None
                  else f"{r.vs_median_percent:+.0f}%"),
           Column("DUTY", lambda r: "-" if r.duty_percent is None else f"{r.duty_percent:.0f}%"))


@dataclass(kw_only=True)
class StragglersReport(Report):
    """The table (a row per host, slowest first), what its times are (``measure``: "time
    outside collectives", "step time" or None) and where they come from (``source``)."""

    run_id: str
    pattern: str
    measure: str | None = None
    source: str = ""
    step: str = field(default="stragglers")
    per_worker: bool = False

    def __post_init__(self) -> None:
        self.columns = COLUMNS


def checked(pattern: str | None) -> str | None:
    """``--step-pattern`` as given (None: the default), or ConfigError in one sentence."""
    if pattern is not None:
        stragglers.check_pattern(pattern)
    return pattern


def of_logs(pattern: str | None, fetch: Callable[[], Any]) -> StragglersReport:
    """The report from ``fetch()`` (a LogsReport: ``run_id``, ``logs``, ``unreachable``;
    closed here)."""
    found = fetch()
    try:
        return table_of(found.run_id, found.logs, pattern,
                        missing=[s.worker for s in found.unreachable])
    finally:
        found.close()


def saved_steps(run_id: str, base: Path | None = None) -> dict | None:
    """What livesteps saved while this machine followed the run, or None."""
    path = (base or Path.cwd()) / ".tpufab" / "runs" / run_id / "steps.json"
    try:
        found = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return found if isinstance(found, dict) and isinstance(found.get("workers"), dict) else None


def from_logs(logs: Mapping[int, Any], pattern: str) -> tuple[StepLines, list[stragglers.Step]]:
    """Every worker's step lines (spooled outputs: ``.chunks()``); the Steps whose lines carry
    their own time."""
    tap = StepLines(pattern)
    steps = []
    for worker in sorted(logs):
        for chunk in logs[worker].chunks():
            for w, n, at, own in tap.feed(worker, chunk, 0.0):
                if own:
                    steps.append(stragglers.Step(w, n, at))
        for w, n, at, own in tap.feed(worker, b"\n", 0.0):
            if own:
                steps.append(stragglers.Step(w, n, at))
    return tap, sorted(steps, key=lambda s: (s.at, s.worker))


def table_of(run_id: str, logs: Mapping[int, Any], pattern: str | None = None, *,
             missing: Sequence[int] = (), base: Path | None = None) -> StragglersReport:
    """The report of ``run_id`` from its workers' logs (and this machine's saved steps);
    ``missing``: workers whose log could not be read (a note)."""
    pattern = stragglers.check_pattern(pattern)
    workers = sorted(logs)
    tap, timed = from_logs(logs, pattern)
    counts = tap.counts
    saved = saved_steps(run_id, base)
    steps = stragglers.parse_steps(saved["workers"]) if saved else []
    source = f".tpufab/runs/{run_id}/steps.json (timed while this machine followed the run)"
    if not steps:
        steps, source = timed, "the timestamps of the step lines"
    stepping = [w for w in workers if counts.get(w)] or workers
    rows = stragglers.table(steps, stepping) if steps else []
    measure = None
    if rows and any(r.median is not None for r in rows):
        measure = "time outside collectives" if any(s.work is not None for s in steps) \
            else "step time"
    by_worker = {r.worker: r for r in rows}
    out = []
    for w in workers:
        r = by_worker.get(w)
        out.append(StragglerRow(w, counts.get(w, 0), tap.last.get(w),
                                None if r is None else r.median,
                                None if r is None else r.slowest,
                                None if r is None else r.vs_median,
                                None if r is None else r.duty))
    if measure is not None:
        out.sort(key=lambda r: (r.vs_median_percent is None, -(r.vs_median_percent or 0),
                                r.worker))
    else:
        out.sort(key=lambda r: (r.last_step is None, r.last_step or 0, r.worker))
    report = StragglersReport(run_id=run_id, pattern=pattern, measure=measure,
                              source=source if measure else "", rows=out)
    report.summary = summary(report)
    if missing:
        report.notes.append(f"No log from {nodeset.fold(missing)} (unreachable): the table "
                            "is the other hosts'.")
    return report


def summary(report: StragglersReport) -> str:
    rows = report.rows
    run = report.run_id
    if not rows:
        return f"No worker's log of run {run} could be read, so there are no steps to show."
    if not any(r.steps for r in rows):
        return (f"No line of run {run} matched the step pattern {report.pattern!r}; give "
                "--step-pattern REGEX (a group named step is the step's number).")
    if report.measure is None:
        behind = rows[0]
        return (f"Run {run}: no step times (its step lines carry no timestamp and this machine "
                "did not follow it; `run`, `launch` and `babysit` time the steps they follow); "
                f"furthest behind: {behind.host} at step {behind.last_step}.")
    timed = [r for r in rows if r.vs_median_percent is not None]
    slowest = timed[0]
    hosts = sorted(r.median_seconds for r in timed if r.median_seconds is not None)
    median = hosts[len(hosts) // 2] if len(hosts) % 2 else sum(hosts[len(hosts) // 2 - 1:
                                                                     len(hosts) // 2 + 1]) / 2
    return (f"Run {run}: {slowest.host} is the slowest, its median {report.measure} "
            f"{slowest.median_seconds:.2f} s a step, {slowest.vs_median_percent:+.0f}% against "
            f"the hosts' median of {median:.2f} s (from {report.source}).")
