"""`tpufab top`: every worker's CPU, memory, load, the run's processes and TPU use, folded.

One frame is one fan-out over the pod's open connections: ``top_worker.py`` samples /proc on
every worker for ``interval`` seconds at once and answers one JSON line. Workers whose values
fall in the same buckets fold into one row (``w[0-62]  idle  1-2%``); a worker that differs
(busy, unreachable, another run) gets its own row. A worker's CPU is the sum of its own
processes' use over the interval, as a share of all its cores (on a TPU VM that is the host's;
on the simulated pod, whose workers share one machine, it is that worker's alone); memory and
load are what the worker's /proc says. A frame is a Report; tpufab.views.top shows it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from tpufab import nodeset
from tpufab.errors import ConfigError
from tpufab.reports import Report
from tpufab.term.commands import short_command

SCRIPT = "top_worker.py"
IDLE_BELOW = 10.0        # % of ONE core: below it a worker is idle (robust on a busy host)
BUSY_BUCKET = 20.0       # % CPU: busy workers fold when in the same bucket of this width
MEMORY_BUCKET = 10.0     # % memory used
MIN_EVERY = 1.0          # s between frames, at least


@dataclass
class WorkerLoad:
    """One worker's answer (or why there is none): its row of a frame."""

    worker: int
    reachable: bool
    error: str | None = None
    cpu_percent: float = 0.0      # its processes' use, as a share of all its cores
    core_percent: float = 0.0     # the same in one core's units (100 = one core busy)
    cores: int = 1
    load: tuple[float, ...] = ()
    memory_total: int | None = None
    memory_available: int | None = None
    runs: tuple[dict, ...] = ()
    busiest: tuple[dict, ...] = ()
    tpu: dict = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.reachable

    @property
    def memory_percent(self) -> float | None:
        if not self.memory_total or self.memory_available is None:
            return None
        return 100.0 * (self.memory_total - self.memory_available) / self.memory_total

    @property
    def state(self) -> str:
        if not self.reachable:
            return "unreachable"
        if self.runs:
            return "run " + ",".join(r["run"] for r in self.runs)
        return "idle" if self.core_percent < IDLE_BELOW else "busy"

    @property
    def top_process(self) -> str:
        """The busiest process when the worker is not idle ("" otherwise)."""
        if self.core_percent < IDLE_BELOW or not self.busiest:
            return ""
        return short_command(str(self.busiest[0].get("command") or "?"))

    @property
    def tpu_text(self) -> str:
        t = self.tpu or {}
        if not t:
            return ""
        if not t.get("available"):
            return f"not available ({t.get('why') or 'unknown'})"
        parts = []
        if t.get("duty_cycle_percent") is not None:
            parts.append(f"duty {t['duty_cycle_percent']:.0f}%")
        if t.get("hbm_total_bytes"):
            parts.append(f"HBM {t['hbm_used_bytes'] / (1 << 30):.1f}/"
                         f"{t['hbm_total_bytes'] / (1 << 30):.0f} GiB")
        return ", ".join(parts) or "available"

    def key(self) -> tuple:
        """What must agree for two workers to share a row (bucketed values)."""
        if not self.reachable:
            return ("unreachable", self.error)
        cpu = "idle" if self.core_percent < IDLE_BELOW else int(self.cpu_percent // BUSY_BUCKET)
        memory = self.memory_percent
        tpu = self.tpu or {}
        duty = tpu.get("duty_cycle_percent")
        return (self.state, cpu, None if memory is None else int(memory // MEMORY_BUCKET),
                self.top_process, bool(tpu.get("available")),
                None if duty is None else int(duty // BUSY_BUCKET),
                None if tpu.get("available") else tpu.get("why"))


def parse(worker: int, outcome: Any) -> WorkerLoad:
    """A worker's ``top_worker.py`` answer as a record; never raises."""
    from tpufab.ssh.remote_files import last_line, read_answer

    error = getattr(outcome, "error", None)
    if error:
        return WorkerLoad(worker, False, error=str(error))
    data = read_answer(getattr(outcome, "stdout", ""))
    if not isinstance(data, dict):
        reason = last_line(getattr(outcome, "stderr", "")) or \
            f"exit status {getattr(outcome, 'exit_code', None)}"
        return WorkerLoad(worker, False, error=f"no answer: {reason}")

    def number(value: Any, default: float = 0.0) -> float:
        try:
            return float(value)
        except (TypeError, ValueError):
            return default

    memory = data.get("memory") if isinstance(data.get("memory"), dict) else {}
    load = data.get("load") if isinstance(data.get("load"), list) else []
    cores = max(1, int(number(data.get("cores"), 1)))
    busiest = tuple(b for b in data.get("busiest") or () if isinstance(b, dict))
    runs = tuple(r for r in data.get("runs") or () if isinstance(r, dict) and r.get("run"))
    # the worker's own processes, as a share of all its cores
    own = sum(number(b.get("cpu_percent")) for b in busiest)
    own = max(own, sum(number(r.get("cpu_percent")) for r in runs))
    total = number(data.get("processes_cpu_percent"), own)
    return WorkerLoad(worker, True, cpu_percent=round(min(100.0, total / cores), 1),
                      core_percent=round(total, 1), cores=cores, load=tuple(number(x) for x in load[:3]),
                      memory_total=memory.get("total_bytes"),
                      memory_available=memory.get("available_bytes"), runs=runs,
                      busiest=busiest, tpu=data.get("tpu") if isinstance(data.get("tpu"), dict)
                      else {})


@dataclass
class Row:
    """Workers that agree, and what they show."""

    workers: list[int]
    state: str
    cpu: str
    memory: str
    load: str
    processes: str
    tpu: str
    odd: bool = False        # not the largest group: an outlier

    @property
    def label(self) -> str:
        return nodeset.fold(self.workers)


def _span(values: Sequence[float], fmt: str, suffix: str = "") -> str:
    if not values:
        return "-"
    low, high = fmt.format(min(values)), fmt.format(max(values))
    return f"{low}{suffix}" if low == high else f"{low}-{high}{suffix}"


def fold_rows(loads: Mapping[int, WorkerLoad]) -> list[Row]:
    """Workers grouped by their bucketed values; the largest group first, then the outliers
    (each group's own values shown as spans, so nothing is rounded away)."""
    groups: dict[tuple, list[WorkerLoad]] = {}
    for w in sorted(loads):
        groups.setdefault(loads[w].key(), []).append(loads[w])
    ordered = sorted(groups.values(), key=lambda g: (-len(g), g[0].worker))
    rows = []
    for i, members in enumerate(ordered):
        first = members[0]
        odd = i > 0 and len(ordered) > 1
        if not first.reachable:
            rows.append(Row([m.worker for m in members], "unreachable", "-", "-", "-",
                            first.error or "", "", odd))
            continue
        memory = [m.memory_percent for m in members if m.memory_percent is not None]
        runs = sorted({f"{r['run']} ({r.get('processes', 0)} procs)"
                       for m in members for r in m.runs})
        procs = "; ".join(runs)
        if first.top_process:
            top = [m.busiest[0] for m in members]
            procs = (procs + "; " if procs else "") + \
                f"{first.top_process} {_span([float(t.get('cpu_percent') or 0) for t in top], '{:.0f}', '%')}"
        rows.append(Row([m.worker for m in members], first.state,
                        _span([m.cpu_percent for m in members], "{:.0f}", "%"),
                        _span(memory, "{:.0f}", "%"),
                        _span([m.load[0] for m in members if m.load], "{:.2f}"),
                        procs, first.tpu_text, odd))
    return rows


@dataclass
class TopFrame(Report):
    """One frame: a ``tpufab.reports.Report`` whose rows are every worker's load (``ok``: it
    answered; ``.loads`` by index, ``.folded`` the table's rows), when it was taken and what it
    cost. Printed by tpufab.views.top (the view ``top``)."""

    name: str
    taken_at: float
    seconds: float            # wall time of the fan-out (the interval included)
    interval: float
    step: str = field(default="top", kw_only=True)

    view: ClassVar[str] = "top"

    @property
    def loads(self) -> dict[int, WorkerLoad]:
        return {w.worker: w for w in sorted(self.rows, key=lambda w: w.worker)}

    @property
    def folded(self) -> list[Row]:
        return fold_rows(self.loads)

    @property
    def tpu_note(self) -> str | None:
        """The one TPU line when every worker says the same (e.g. simulated), else None."""
        texts = {w.tpu_text for w in self.rows if w.reachable}
        if len(texts) == 1:
            only = texts.pop()
            return f"TPU use: {only}" if only else None
        return None


def frame(pod: Any, *, workers: Iterable[int] | None = None, interval: float = 1.0,
          timeout: float | None = 30.0) -> TopFrame:
    """One frame: ``top_worker.py`` on every chosen worker at once (one fan-out)."""
    from tpufab.ssh.remote_files import run_script

    chosen = list(workers if workers is not None else pod.workers)
    started = time.monotonic()
    outcomes = run_script(pod.fanout, SCRIPT, ["--interval", f"{interval:g}"], chosen,
                          timeout=timeout)
    try:
        loads = {w: parse(w, outcomes[w]) for w in chosen}
    finally:
        close = getattr(outcomes, "close", None)
        if close is not None:
            close()
    return TopFrame(pod.name, time.time(), time.monotonic() - started, interval,
                    rows=[loads[w] for w in chosen])


def check_every(every: float, interval: float) -> None:
    if interval <= 0 or interval > 30:
        raise ConfigError(f"--interval must be above 0 and at most 30 seconds, not {interval:g}.")
    if every < MIN_EVERY:
        raise ConfigError(f"--every must be at least {MIN_EVERY:g} second, not {every:g}.")


def watch(pod: Any, *, on_frame: Callable[[TopFrame], None], every: float = 3.0,
          interval: float = 1.0, workers: Iterable[int] | None = None,
          timeout: float | None = 30.0, frames: int | None = None,
          sleep: Callable[[float], None] = time.sleep) -> TopFrame:
    """Frames every ``every`` seconds (counted from each frame's start) until Ctrl-C or
    ``frames`` of them; each goes to ``on_frame``. Returns the last."""
    from tpufab.ssh.fanout import FanoutInterrupted

    chosen = list(workers) if workers is not None else None
    count = 0
    while True:
        began = time.monotonic()
        try:
            last = frame(pod, workers=chosen, interval=interval, timeout=timeout)
        except FanoutInterrupted:   # Ctrl-C during a frame: as during the pause between
            raise KeyboardInterrupt from None
        on_frame(last)
        count += 1
        if frames is not None and count >= frames:
            return last
        sleep(max(0.0, every - (time.monotonic() - began)))
