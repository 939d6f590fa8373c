"""Stragglers: which host sets the pace of a synchronous job (pure; tested as data).

A step is a line of the run's output that matches the step pattern (:data:`DEFAULT_PATTERN`
recognises ``step 120``, ``Step 120/1000``, ``[step=120]``, ``12.3 it/s``; ``--step-pattern
REGEX`` replaces it). For every host and step, :mod:`tpufab.steps.runs.livesteps` records when
the line appeared and, where libtpu's metrics service answers, how long that host's chips ran
programs since its previous step minus the time in collectives where those are served: its
*work*, the time outside collectives. A barrier (an all-reduce) makes every host's step take
the same wall time, so the step lines of a synchronous job appear together and say nothing
about who was slow; the work does. Without metrics the step time (from one line to the next)
is used: that finds a straggler only where steps are not synchronised.

A host is a straggler when its work (or step time) is at least ``THRESHOLD`` (10 %) above the
median of all hosts' for ``STREAK`` (3) steps in a row. It is said once, naming the host, by how
much, over which steps and the evidence; again only when the verdict changes (another host,
or the straggler caught up for ``STREAK`` steps).
"""

from __future__ import annotations

import re
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from tpufab import nodeset
from tpufab.errors import ConfigError, shown

DEFAULT_PATTERN = (r"(?i)(?:\bstep\b\s*[=:#]?\s*(?P<step>\d+)(?:\s*/\s*\d+)?"
                   r"|(?P<rate>\d+(?:\.\d+)?)\s*it/s)")
THRESHOLD = 0.10
STREAK = 3


def check_pattern(pattern: str | None) -> str:
    """The step pattern to use, or ConfigError in one sentence when it is no regular expression."""
    if pattern is None:
        return DEFAULT_PATTERN
    try:
        re.compile(pattern)
    except re.error as err:
        raise ConfigError(f"--step-pattern {shown(pattern)} is no regular expression ({err}); "
                          "give one that matches your step lines, e.g. 'step (?P<step>\\d+)'.") \
            from None
    if not pattern.strip():
        raise ConfigError("--step-pattern is empty; give a regular expression that matches your "
                          "step lines, e.g. 'step (?P<step>\\d+)'.")
    return pattern


@dataclass(frozen=True)
class Step:
    """One host's step: its number (``n``: the step group if the pattern has one, else the
    count of step lines so far), when its line appeared (worker clock, seconds), its work
    (seconds outside collectives since the previous step; None without metrics) and its
    chips' duty cycle (%; None without metrics)."""

    worker: int
    n: int
    at: float
    work: float | None = None
    duty: float | None = None


@dataclass(frozen=True)
class Verdict:
    worker: int | None          # None: no straggler (any more)
    percent: float = 0.0
    first: int = 0
    last: int = 0
    evidence: str = ""

    def sentence(self) -> str:
        if self.worker is None:
            return (f"No straggler any more: every host is within {THRESHOLD:.0%} of the "
                    f"median over steps {self.first}-{self.last}.")
        return (f"{nodeset.label(self.worker)} is {self.percent:.0f}% slower than the median "
                f"over steps {self.first}-{self.last}: {self.evidence}.")


@dataclass
class Detector:
    """Feeds on Steps (any order of hosts), says a Verdict when one is due."""

    workers: Sequence[int]
    threshold: float = THRESHOLD
    streak: int = STREAK
    steps: dict[int, dict[int, Step]] = field(default_factory=dict)   # n -> worker -> Step
    last_step: dict[int, Step] = field(default_factory=dict)
    runs: dict[int, list[tuple[int, float, Step, float, bool]]] = field(default_factory=dict)
    judged: int = -1
    current: int | None = None
    calm: int = 0
    times: dict[tuple[int, int], float] = field(default_factory=dict)  # step time, no metrics
    keep: bool = True        # keep every row (the table reads them); False: judged ones go

    def add(self, step: Step) -> list[Verdict]:
        """Record a step; the verdicts it completes (usually none)."""
        prev = self.last_step.get(step.worker)
        self.last_step[step.worker] = step
        if prev is not None:
            self.times[(step.worker, step.n)] = step.at - prev.at
        self.steps.setdefault(step.n, {})[step.worker] = step
        out = []
        for n in sorted(k for k in self.steps if k > self.judged):
            if len(self.steps[n]) < len(self.workers):
                break
            verdict = self._judge(n)
            self.judged = n
            if verdict is not None:
                out.append(verdict)
            if not self.keep:
                del self.steps[n]
                for w in self.workers:
                    self.times.pop((w, n), None)
        return out

    def _value(self, step: Step) -> float | None:
        if step.work is not None:
            return step.work
        return self.times.get((step.worker, step.n))

    def _judge(self, n: int) -> Verdict | None:
        row = self.steps[n]
        # work where every host has it, else step times: never the one against the other
        worked = all(s.work is not None for s in row.values())
        values = {w: s.work if worked else self.times.get((w, s.n)) for w, s in row.items()}
        if any(v is None for v in values.values()) or len(values) < 2:
            return None
        median = statistics.median(values.values())
        if median <= 0:
            return None
        slow = [w for w, v in values.items() if v >= median * (1 + self.threshold)]
        for w in self.workers:
            if w in slow:
                run = self.runs.setdefault(w, [])
                run.append((n, values[w] / median - 1, row[w], values[w], worked))
                del run[:-self.streak]
            else:
                self.runs.pop(w, None)
        candidates = [w for w, run in self.runs.items() if len(run) >= self.streak]
        if candidates:
            self.calm = 0
            worst = max(candidates, key=lambda w: sum(r[1] for r in self.runs[w][-self.streak:]))
            if worst == self.current:
                return None
            self.current = worst
            return self._verdict(worst, median, row)
        if self.current is not None and self.current not in self.runs:
            self.calm += 1
            if self.calm >= self.streak:
                first = n - self.streak + 1
                self.current, self.calm = None, 0
                return Verdict(None, first=first, last=n)
        return None

    def _verdict(self, worker: int, median: float, row: Mapping[int, Step]) -> Verdict:
        run = self.runs[worker][-self.streak:]
        percent = 100 * sum(r[1] for r in run) / len(run)
        first, last = run[0][0], run[-1][0]
        mine = sum(r[3] for r in run) / len(run)
        what = "time outside collectives" if run[-1][4] else "step time"
        others = [s for w, s in row.items() if w != worker]
        evidence = f"{what} {mine:.2f} s a step against a median of {median:.2f} s"
        duties = [s.duty for s in others if s.duty is not None]
        if run[-1][2].duty is not None and duties:
            evidence += (f"; its chips' duty cycle {run[-1][2].duty:.0f}% against "
                         f"{statistics.median(duties):.0f}%")
        return Verdict(worker, percent, first, last, evidence)


def detect(steps: Iterable[Step], workers: Sequence[int]) -> list[Verdict]:
    """Every verdict over ``steps`` (in order of arrival)."""
    d = Detector(workers)
    out: list[Verdict] = []
    for s in steps:
        out += d.add(s)
    return out


@dataclass(frozen=True)
class HostRow:
    """A host's line of `tpufab stragglers`."""

    worker: int
    steps: int
    median: float | None      # its median work (or step time), seconds
    slowest: float | None
    vs_median: float | None   # its median against the hosts' median, percent
    duty: float | None


def table(steps: Iterable[Step], workers: Sequence[int]) -> list[HostRow]:
    """The per-host step table, slowest first."""
    d = Detector(workers)
    for s in steps:
        d.add(s)
    per: dict[int, list[float]] = {w: [] for w in workers}
    duty: dict[int, list[float]] = {w: [] for w in workers}
    counts = {w: 0 for w in workers}
    for row in d.steps.values():
        for w, s in row.items():
            counts[w] = counts.get(w, 0) + 1
            v = d._value(s)
            if v is not None:
                per.setdefault(w, []).append(v)
            if s.duty is not None:
                duty.setdefault(w, []).append(s.duty)
    medians = {w: statistics.median(v) for w, v in per.items() if v}
    overall = statistics.median(medians.values()) if medians else None
    rows = [HostRow(w, counts.get(w, 0), medians.get(w), max(per[w]) if per.get(w) else None,
                    None if overall in (None, 0) or w not in medians
                    else 100 * (medians[w] / overall - 1),
                    statistics.median(duty[w]) if duty.get(w) else None) for w in workers]
    return sorted(rows, key=lambda r: (-(r.vs_median if r.vs_median is not None else -1e9),
                                       r.worker))


def parse_steps(records: Mapping[int, Iterable[Mapping]]) -> list[Step]:
    """livesteps' records (steps.json) ({worker: [{"n", "at", "work"?, "duty"?}, ...]}) as Steps in
    order of time; malformed records are skipped."""
    out = []
    for worker, items in records.items():
        for item in items:
            try:
                out.append(Step(int(worker), int(item["n"]), float(item["at"]),
                                None if item.get("work") is None else float(item["work"]),
                                None if item.get("duty") is None else float(item["duty"])))
            except (KeyError, TypeError, ValueError):
                continue
    return sorted(out, key=lambda s: (s.at, s.worker))
