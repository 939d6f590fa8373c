"""Stragglers while a run is followed (`run`, `babysit`, `launch`): the followed lines and each
host's TPU metrics fed to the detector of :mod:`tpufab.steps.runs.stragglers`.

Every line a worker prints that matches the step pattern is a step of that worker, timed by
the worker's own clock where the line starts with a timestamp (``2026-12-02 01:02:03,456``,
ISO 8601, absl's ``I1202 01:02:03.456789``), else by when it reached this machine. Meanwhile
one long command a worker (``top_worker.py --stream``) samples libtpu's metrics service every
``SAMPLE_EVERY`` seconds (the chips' duty cycle and their program count and time; the same
service `top --tpu` reads) and streams each sample back. A step's *work* is then the host's
mean program time, less the time in collectives where served, over the samples that span the
step (count and time are cumulative, so each program is counted once and whole, whenever it
ends), times the programs a step runs (the pod's median); without metrics the detector uses
step times. A row of steps is judged once every host that prints steps has printed it and
its samples cover it. What the detector says goes to ``say(sentence)``: the caller's view
shows it; nothing here prints.
"""

from __future__ import annotations

import calendar
import json
import re
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tpufab.errors import shown
from tpufab.steps.runs import stragglers

SAMPLE_EVERY = 0.5     # s between two samples of a worker's metrics (the worker's floor: 0.25)
HOLD = 5.0             # s a step waits for a sample that covers it before it goes without
SILENT_HOSTS = 5       # steps a host may print before hosts that printed none are left out
KEEP_SAMPLES = 2048    # a worker's samples kept (a bounded history, however long the run)
KEEP_STEPS = 20000     # a worker's judged steps kept for steps.json and the table
RATE_EVERY = 16        # rows between two estimates of the programs a step runs

_ISO = re.compile(r"^\W{0,3}(\d{4})-(\d{2})-(\d{2})[T ](\d{2}):(\d{2}):(\d{2})([.,]\d+)?"
                  r"(Z|[+-]\d{2}:?\d{2})?")
_ABSL = re.compile(r"^[IWEF](\d{2})(\d{2}) (\d{2}):(\d{2}):(\d{2})(\.\d+)?\s")


def line_time(text: str, *, now: float | None = None) -> float | None:
    """The time a line says it was written (seconds since the epoch, by the worker's clock),
    or None. A time without a zone is local time; absl's has no year (this year's)."""
    found = _ISO.match(text)
    if found:
        y, mo, d, h, mi, s, frac, zone = found.groups()
        parts = (int(y), int(mo), int(d), int(h), int(mi), int(s))
    else:
        found = _ABSL.match(text)
        if not found:
            return None
        mo, d, h, mi, s, frac = found.groups()
        zone = None
        year = time.localtime(now if now is not None else time.time()).tm_year
        parts = (year, int(mo), int(d), int(h), int(mi), int(s))
    _, month, day, hour, minute, second = parts
    if not (1 <= month <= 12 and 1 <= day <= 31 and hour < 24 and minute < 60 and second <= 60):
        return None
    try:
        if zone:
            offset = 0 if zone == "Z" else (1 if zone[0] == "+" else -1) * (
                int(zone[1:3]) * 3600 + int(zone[-2:]) * 60)
            base = calendar.timegm((*parts, 0, 0, 0)) - offset
        else:
            base = time.mktime((*parts, 0, 0, -1))
    except (OverflowError, ValueError):
        return None
    return base + (float("0." + frac[1:]) if frac else 0.0)


def step_number(found: re.Match) -> int | None:
    """The step a match names: its ``step`` group, else its first group of digits."""
    groups = found.groupdict()
    if "step" in groups:
        value = groups["step"]
        return int(value) if value is not None and value.isdigit() else None
    for value in found.groups():
        if value is not None and value.isdigit():
            return int(value)
    return None


class StepLines:
    """Each worker's output cut into lines; the lines that match the step pattern become
    (worker, n, at, own clock) steps. ``n``: the step the line names, else the count of step
    lines so far; a line naming a step the worker already passed is no new step."""

    def __init__(self, pattern: str):
        self.regex = re.compile(pattern)
        self.partial: dict[int, bytes] = {}
        self.last: dict[int, int] = {}
        self.counts: dict[int, int] = {}      # new steps per worker
        self.matched = 0

    def feed(self, worker: int, data: bytes, now: float) -> list[tuple[int, int, float, bool]]:
        text = self.partial.pop(worker, b"") + data
        *whole, rest = text.split(b"\n")
        if rest:
            self.partial[worker] = rest[-4096:]
        return [s for line in whole if (s := self.line(worker, line.decode("utf-8", "replace"),
                                                        now)) is not None]

    def line(self, worker: int, text: str, now: float) -> tuple[int, int, float, bool] | None:
        found = self.regex.search(text)
        if found is None:
            return None
        self.matched += 1
        last = self.last.get(worker, 0)
        n = step_number(found)
        n = last + 1 if n is None else n
        if worker in self.last and n <= last:
            return None
        self.last[worker] = n
        self.counts[worker] = self.counts.get(worker, 0) + 1
        own = line_time(text, now=now)
        return worker, n, own if own is not None else now, own is not None


@dataclass(frozen=True)
class Sample:
    """One answer of ``top_worker.py --stream``: when (the worker's clock, and when it reached
    this machine), and the chips' cumulative programs or why there are none."""

    at: float
    seen: float
    available: bool
    programs: float = 0.0          # programs run so far, mean over chips
    work: float = 0.0              # their seconds outside collectives, mean over chips
    duty: float | None = None
    why: str = ""

    @classmethod
    def of(cls, data: dict, seen: float) -> Sample:
        try:
            at = float(data.get("at"))
        except (TypeError, ValueError):
            at = seen
        chips = [c for c in data.get("chips") or () if isinstance(c, dict)]
        if not data.get("available") or not chips:
            return cls(at, seen, False, why=str(data.get("why") or "no metrics"))
        try:
            duty = statistics.fmean(float(c.get("duty_cycle_percent") or 0) for c in chips)
            if not all("programs" in c for c in chips):
                return cls(at, seen, True, duty=duty, programs=-1.0)
            programs = statistics.fmean(float(c["programs"]) for c in chips)
            work = statistics.fmean(float(c.get("programs_seconds") or 0)
                                    - float(c.get("collectives_seconds") or 0) for c in chips)
        except (TypeError, ValueError):
            return cls(at, seen, False, why="the metrics service answered garbage")
        return cls(at, seen, True, programs, work, duty)

    def when(self, own: bool) -> float:
        return self.at if own else self.seen


@dataclass
class HostSteps:
    """One worker's samples while followed, and whether its step lines carry their time."""

    samples: list[Sample] = field(default_factory=list)
    own: bool = False
    sampler_ended: bool = False

    def add(self, sample: Sample) -> None:
        self.samples.append(sample)
        if len(self.samples) > 2 * KEEP_SAMPLES:
            del self.samples[:KEEP_SAMPLES]

    def covering(self, at: float, own: bool) -> int | None:
        """The index of the first sample taken at or after ``at``."""
        for i in range(len(self.samples) - 1, -1, -1):
            if self.samples[i].when(own) < at:
                return i + 1 if i + 1 < len(self.samples) else None
        return 0 if self.samples else None

    def window(self, t0: float, t1: float, own: bool) -> tuple[Sample, Sample] | None:
        """The samples that close the steps at t0 and t1 (the first taken at or after each:
        a step's line follows its programs), widened backwards until a program ended
        between them."""
        b = self.covering(t1, own)
        if b is None:
            return None
        a = self.covering(t0, own)
        if a is None or a >= b:
            a = b - 1
        while a > 0 and self.samples[b].programs - self.samples[a].programs <= 0:
            a -= 1
        if a < 0 or not self.samples[a].available or not self.samples[b].available:
            return None
        return self.samples[a], self.samples[b]


class StragglerWatch:
    """A follower's view (``lines``/``done``/``close``) that passes everything on to ``view``
    and feeds every worker's steps, and its metrics where ``fanout`` is given (one streaming
    ``top_worker.py --stream`` per worker, stopped at close), to the straggler detector;
    ``say(sentence)`` hears each verdict, and at close (with ``pattern_given``) that the
    pattern matched no line of the run. ``records()``: every step with its work, as
    stragglers.parse_steps reads them; with ``save_to``, written there as steps.json."""

    def __init__(self, view, workers: Sequence[int], *, pattern: str | None,
                 say: Callable[[str], None], fanout: Any = None, run_id: str = "",
                 save_to: Path | None = None, every: float = SAMPLE_EVERY,
                 clock: Callable[[], float] = time.time):
        self.view = view
        self.workers = list(workers)
        self.pattern = stragglers.check_pattern(pattern)
        self.pattern_given = pattern is not None
        self.say = say
        self.clock = clock
        self.save_to = save_to
        self.tap = StepLines(self.pattern)
        self.hosts = {w: HostSteps() for w in self.workers}
        self.expected = list(self.workers)
        self.detector: stragglers.Detector | None = None
        self.judged = -1
        self.verdicts: list[stragglers.Verdict] = []
        self.done_steps: dict[int, deque[dict]] = {w: deque(maxlen=KEEP_STEPS)
                                                   for w in self.workers}
        self.pending: dict[int, dict[int, tuple[float, bool, float]]] = {}  # unjudged rows
        self.per_step: float | None = None
        self.rated = 0
        self.metrics = fanout is not None
        self._lock = threading.RLock()
        self._cancel = threading.Event()
        self._closed = False
        self._sampler: threading.Thread | None = None
        self._sampling = (fanout, run_id, every)

    def _start_sampler(self) -> None:
        """At the first step line: a run that prints no steps costs no sampler."""
        fanout, run_id, every = self._sampling
        if self._sampler is None and fanout is not None and not self._closed:
            self._sampler = threading.Thread(target=self._sample, args=(fanout, run_id, every),
                                             name="tpufab-stragglers", daemon=True)
            self._sampler.start()

    # -- the view ------------------------------------------------------------------------------
    def lines(self, worker: int, stream: str, data: bytes) -> None:
        self.view.lines(worker, stream, data)
        if stream != "stdout" or worker not in self.hosts:
            return
        try:
            with self._lock:
                now = self.clock()
                stepped = False
                for w, n, at, own in self.tap.feed(worker, data, now):
                    self.hosts[w].own = own
                    if n > self.judged:
                        self.pending.setdefault(n, {})[w] = (at, own, now)
                    stepped = True
                if stepped:
                    self._start_sampler()
                    self._judge()
        except Exception:  # noqa: BLE001 - the detector never stops a follow
            pass

    def done(self, result: Any) -> None:
        self.view.done(result)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._cancel.set()
            if self._sampler is not None:
                self._sampler.join(5)
            with self._lock:
                for host in self.hosts.values():
                    host.sampler_ended = True
                self._judge(final=True)
            if self.pattern_given and self.tap.matched == 0:
                self.say(f"--step-pattern '{shown(self.pattern)}' matched no line of the run, so "
                         "no step was timed; give a pattern that matches your step lines, e.g. "
                         "'step (?P<step>\\d+)'.")
            if self.save_to is not None:
                self._save()
        close = getattr(self.view, "close", None)
        if close is not None:
            close()

    # -- metrics -------------------------------------------------------------------------------
    def _sample(self, fanout, run_id: str, every: float) -> None:
        from tpufab.ssh.remote_files import run_script

        watch = self

        class Samples:
            def __init__(self):
                self.partial: dict[int, bytes] = {}

            def lines(self, worker: int, stream: str, data: bytes) -> None:
                if stream != "stdout":
                    return
                text = self.partial.pop(worker, b"") + data
                *whole, rest = text.split(b"\n")
                if rest:
                    self.partial[worker] = rest[-65536:]
                for line in whole:
                    watch.sampled(worker, line.decode("utf-8", "replace"))

            def done(self, result: Any) -> None:
                from tpufab.ssh.remote_files import missing_files

                if not missing_files(result):  # (else shipped, and started again)
                    watch.sampler_ended(result.worker)

        try:
            got = run_script(fanout, "top_worker.py",
                             ["--stream", "--run", run_id, "--every", f"{every:g}"],
                             self.workers, sink=Samples(), timeout=float("inf"),
                             cancel=self._cancel)
            close = getattr(got, "close", None)
            if close is not None:
                close()
        except Exception:  # noqa: BLE001 - no metrics: step times decide
            pass
        finally:
            with self._lock:
                for host in self.hosts.values():
                    host.sampler_ended = True
                self._judge()

    def sampler_ended(self, worker: int) -> None:
        """A worker's sampler is over (the run ended there, or it has no metrics client):
        its steps wait for no sample any more."""
        with self._lock:
            host = self.hosts.get(worker)
            if host is not None:
                host.sampler_ended = True
                if self.pending:
                    self._judge()

    def sampled(self, worker: int, line: str) -> None:
        """One line of a worker's sampler (a sample, or anything else, ignored)."""
        from tpufab.ssh.remote_files import parse_answer

        found = parse_answer(line)
        if found is None or found[0] != "sample" or not isinstance(found[1], dict):
            return
        with self._lock:
            host = self.hosts.get(worker)
            if host is None:
                return
            host.add(Sample.of(found[1], self.clock()))
            if self.pending:
                self._judge()

    # -- judging -------------------------------------------------------------------------------
    def _ready(self, w: int, at: float, own: bool, arrived: float, final: bool) -> bool:
        """Whether worker ``w``'s step can be judged: a sample covers it, or none will (the
        sampler ended, or none came for HOLD seconds)."""
        host = self.hosts[w]
        if not self.metrics or final or host.sampler_ended:
            return True
        return host.covering(at, own) is not None or self.clock() - arrived > HOLD

    def _judge(self, final: bool = False) -> None:
        counts = self.tap.counts
        if len(self.expected) == len(self.workers) and len(counts) < len(self.workers) and \
                max(counts.values(), default=0) >= SILENT_HOSTS:
            self.expected = [w for w in self.workers if counts.get(w)]
        while len(self.pending) > 1000:          # a host that never prints some steps
            del self.pending[min(self.pending)]
        for n in sorted(self.pending):
            row = self.pending[n]
            if len(row) < len(self.expected) or any(w not in row for w in self.expected):
                continue
            if not all(self._ready(w, *row[w], final) for w in self.expected):
                break
            self._feed(n, {w: row[w] for w in self.expected})
            for k in [k for k in self.pending if k <= n]:
                del self.pending[k]

    def _feed(self, n: int, row: dict[int, tuple[float, bool, float]]) -> None:
        if self.detector is None or list(self.detector.workers) != self.expected:
            self.detector = stragglers.Detector(list(self.expected), keep=False)
        if self.per_step is None or self.rated % RATE_EVERY == 0:
            self.per_step = self._programs_per_step()
        self.rated += 1
        per_step = self.per_step
        for w, (at, own, _arrived) in sorted(row.items()):
            work, duty = self._work(w, n, at, own, per_step)
            self.done_steps[w].append({"n": n, "at": at, "work": work, "duty": duty})
            for verdict in self.detector.add(stragglers.Step(w, n, at, work, duty)):
                self.verdicts.append(verdict)
                self.say(verdict.sentence())
        self.judged = n

    def _previous(self, w: int, n: int) -> float | None:
        """When worker ``w``'s step before ``n`` appeared (rows are judged in order)."""
        done = self.done_steps[w]
        return done[-1]["at"] if done and done[-1]["n"] < n else None

    def _work(self, w: int, n: int, at: float, own: bool,
              per_step: float | None) -> tuple[float | None, float | None]:
        host = self.hosts[w]
        before = self._previous(w, n)
        if not host.samples or before is None:
            return None, None
        found = host.window(before, at, own)
        if found is None:
            return None, None
        a, b = found
        if b.programs < 0:             # a service without program timing: the duty cycle
            return (None if b.duty is None else b.duty / 100 * (at - before)), b.duty
        ran = b.programs - a.programs
        if ran <= 0 or per_step is None:
            return None, b.duty
        return (b.work - a.work) / ran * per_step, b.duty

    def _programs_per_step(self) -> float:
        """Programs a step runs: over each host's recent samples, programs per step; the
        median of the hosts', to the nearest whole number (at least 1)."""
        rates = []
        for w in self.expected:
            host = self.hosts[w]
            done = list(self.done_steps[w])[-64:]
            usable = [s for s in host.samples[-64:] if s.available and s.programs >= 0]
            if len(usable) < 2 or len(done) < 2:
                continue
            first, last = usable[0], usable[-1]
            steps = sum(1 for s in done if first.when(host.own) < s["at"] <= last.when(host.own))
            if steps:
                rates.append((last.programs - first.programs) / steps)
        if not rates:
            return 1.0
        return max(1.0, float(round(statistics.median(rates))))

    # -- what stays ---------------------------------------------------------------------------
    def records(self) -> dict[str, list[dict]]:
        with self._lock:
            return {str(w): list(steps) for w, steps in self.done_steps.items()}

    def _save(self) -> None:
        try:
            from tpufab.steps.runs.running import open_private

            with open_private(self.save_to / "steps.json", "wb") as fh:
                fh.write(json.dumps({"pattern": self.pattern, "workers": self.records(),
                                     "verdicts": [v.sentence() for v in self.verdicts]}
                                    ).encode())
        except OSError:
            pass

