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
from tpufab.config import timeout_for
from tpufab.errors import ConfigError
from tpufab.reports import Report
from tpufab.term.commands import short_command

SCRIPT = "top_worker.py"
IDLE_BELOW = 10.0        # % of ONE core: below it a worker is idle (robust on a busy host)
BUSY_BUCKET = 20.0       # % CPU: busy workers fold when in the same bucket of this width
MEMORY_BUCKET = 10.0     # % memory used
MAX_EVERY = 3600.0     # seconds between frames: more is no live view
MIN_EVERY = 1.0          # s between frames, at least
DUTY_BUCKET = 10.0       # % duty cycle: TPU rows fold within buckets of this width
GIB = 1 << 30


def _gib(value: float) -> str:
    if value < GIB:
        return f"{value / GIB:.2f}"
    return f"{value / GIB:.1f}" if value < 10 * GIB else f"{value / GIB:.0f}"


def tpu_summary(loads: Sequence[TopRow]) -> str:
    """``4 chips  duty 97-99%  HBM 14.1-14.3/16 GiB`` over the chips of ``loads`` (spans)."""
    chips = [c for w in loads for c in w.chips]
    if not chips:
        return ""
    counts = sorted({len(w.chips) for w in loads})
    duty = [float(c.get("duty_cycle_percent") or 0) for c in chips]
    used = [float(c.get("hbm_used_bytes") or 0) for c in chips]
    total = max(float(c.get("hbm_total_bytes") or 0) for c in chips)
    low, high = _gib(min(used)), _gib(max(used))
    hbm = low if low == high else f"{low}-{high}"
    number = "-".join(str(n) for n in (counts[0], counts[-1]) if n is not None) \
        if counts[0] != counts[-1] else str(counts[0])
    return (f"{number} chip{'s' if counts[-1] != 1 else ''}  "
            f"duty {_span(duty, '{:.0f}', '%')}  HBM {hbm}/{_gib(total)} GiB")


@dataclass
class TpuRow:
    """Workers whose TPUs agree (kind, chips, duty within DUTY_BUCKET), and what they show."""

    workers: list[int]
    kind: str
    text: str
    duty: float | None = None
    odd: bool = False
    mark: str = ""           # "<- lowest" / "<- highest": the outlier's duty against the rest

    @property
    def label(self) -> str:
        return nodeset.fold(self.workers)


def _by_duty(groups: dict[tuple, list[TopRow]]) -> dict[tuple, list[TopRow]]:
    """Busy hosts with the same chips regrouped by duty cycle: sorted, a new group wherever
    a host's duty is more than DUTY_BUCKET above its group's lowest (so 89% and 96% share a
    row, and 41% stands out, wherever the bucket edges fall)."""
    out: dict[tuple, list[TopRow]] = {}
    busy: dict[tuple, list[TopRow]] = {}
    for key, members in groups.items():
        if key[0] == "busy":
            busy.setdefault(key[:2], []).extend(members)
        else:
            out[key] = members
    for key, members in busy.items():
        members.sort(key=lambda m: (m.duty_percent or 0.0, m.worker))
        cluster: list[TopRow] = []
        for m in [*members, None]:
            if cluster and (m is None or (m.duty_percent or 0.0) -
                            (cluster[0].duty_percent or 0.0) > DUTY_BUCKET):
                out[(*key, cluster[0].worker)] = sorted(cluster, key=lambda c: c.worker)
                cluster = []
            if m is not None:
                cluster.append(m)
    return out


def fold_tpu(loads: Mapping[int, TopRow]) -> list[TpuRow]:
    """Every worker's TPU, folded; the outlier rows first (fewest workers, lowest duty), the
    largest group last, so the host that differs is the first line read."""
    groups: dict[tuple, list[TopRow]] = {}
    for w in sorted(loads):
        load = loads[w]
        key = ("unreachable", load.error) if not load.reachable else load.tpu_key()
        groups.setdefault(key, []).append(load)
    groups = _by_duty(groups)
    if not groups:
        return []
    largest = max(groups.values(), key=lambda g: (len(g), -g[0].worker))
    busy = [w.duty_percent for g in groups.values() for w in g if w.tpu_kind == "busy"
            and w.duty_percent is not None]
    rows = []
    for members in groups.values():
        first = members[0]
        if not first.reachable:
            rows.append(TpuRow([m.worker for m in members], "unreachable",
                               f"worker unreachable ({first.error})"))
            continue
        kind = first.tpu_kind
        text = tpu_summary(members) if kind == "busy" else first.tpu_text
        duty = None
        if kind == "busy":
            values = [m.duty_percent or 0.0 for m in members]
            duty = sum(values) / len(values)
        rows.append(TpuRow([m.worker for m in members], kind, text, duty,
                           odd=members is not largest and len(groups) > 1))
    if len(busy) > 1:
        for row in rows:
            if row.odd and row.duty is not None:
                if row.duty <= min(busy) + 1e-9:
                    row.mark = "<- lowest"
                elif row.duty >= max(busy) - 1e-9:
                    row.mark = "<- highest"
    return sorted(rows, key=lambda r: (not r.odd, len(r.workers),
                                       r.duty if r.duty is not None else -1, r.workers[0]))


@dataclass
class TopRow:
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
    def chips(self) -> list[dict]:
        return [c for c in (self.tpu or {}).get("chips") or () if isinstance(c, dict)]

    @property
    def tpu_kind(self) -> str:
        """busy (metrics answered), idle (no holder), unreachable (holder, no metrics),
        none (no device files), or "" (nothing said)."""
        t = self.tpu or {}
        if not t:
            return ""
        if t.get("available") and self.chips:
            return "busy"
        if t.get("idle"):
            return "idle"
        if not t.get("devices"):
            return "none"
        return "unreachable"

    @property
    def duty_percent(self) -> float | None:
        duty = [float(c.get("duty_cycle_percent") or 0) for c in self.chips]
        return sum(duty) / len(duty) if duty else None

    @property
    def tpu_text(self) -> str:
        t = self.tpu or {}
        kind = self.tpu_kind
        if kind == "busy":
            return tpu_summary([self])
        if kind == "idle":
            return "idle: no process holds the TPU"
        if kind == "unreachable":
            return f"metrics service not reachable ({t.get('why') or 'no answer'})"
        if kind == "none":
            return f"not available ({t.get('why') or 'unknown'})"
        return ""

    def key(self) -> tuple:
        """What must agree for two workers to share a row (bucketed values)."""
        if not self.reachable:
            return ("unreachable", self.error)
        cpu = "idle" if self.core_percent < IDLE_BELOW else int(self.cpu_percent // BUSY_BUCKET)
        memory = self.memory_percent
        return (self.state, cpu, None if memory is None else int(memory // MEMORY_BUCKET),
                self.top_process, *self.tpu_key())

    def tpu_key(self) -> tuple:
        """What must agree for two workers to share a TPU row."""
        kind = self.tpu_kind
        if kind != "busy":
            return (kind, None, None, self.tpu_text if kind != "idle" else None)
        duty = self.duty_percent or 0.0
        return (kind, len(self.chips), int(duty // DUTY_BUCKET), None)


def parse(worker: int, outcome: Any) -> TopRow:
    """A worker's ``top_worker.py`` answer as a record; never raises."""
    from tpufab.reports import last_line
    from tpufab.ssh.remote_files import read_answer

    error = getattr(outcome, "error", None)
    if error:
        return TopRow(worker, False, error=str(error))
    data = read_answer(getattr(outcome, "stdout", ""))
    if not isinstance(data, dict):
        reason = last_line(getattr(outcome, "stderr", "")) or \
            f"exit status {getattr(outcome, 'exit_code', None)}"
        return TopRow(worker, False, error=f"no answer: {reason}")

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
    return TopRow(worker, True, cpu_percent=round(min(100.0, total / cores), 1),
                      core_percent=round(total, 1), cores=cores, load=tuple(number(x) for x in load[:3]),
                      memory_total=memory.get("total_bytes"),
                      memory_available=memory.get("available_bytes"), runs=runs,
                      busiest=busiest, tpu=data.get("tpu") if isinstance(data.get("tpu"), dict)
                      else {})


@dataclass
class TopFolded:
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


def fold_rows(loads: Mapping[int, TopRow]) -> list[TopFolded]:
    """Workers grouped by their bucketed values; the largest group first, then the outliers
    (each group's own values shown as spans, so nothing is rounded away)."""
    groups: dict[tuple, list[TopRow]] = {}
    for w in sorted(loads):
        groups.setdefault(loads[w].key(), []).append(loads[w])
    ordered = sorted(groups.values(), key=lambda g: (-len(g), g[0].worker))
    rows = []
    for i, members in enumerate(ordered):
        first = members[0]
        odd = i > 0 and len(ordered) > 1
        if not first.reachable:
            rows.append(TopFolded([m.worker for m in members], "unreachable", "-", "-", "-",
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
        rows.append(TopFolded([m.worker for m in members], first.state,
                        _span([m.cpu_percent for m in members], "{:.0f}", "%"),
                        _span(memory, "{:.0f}", "%"),
                        _span([m.load[0] for m in members if m.load], "{:.2f}"),
                        procs, first.tpu_text, odd))
    return rows


@dataclass
class TopReport(Report):
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
    def loads(self) -> dict[int, TopRow]:
        return {w.worker: w for w in sorted(self.rows, key=lambda w: w.worker)}

    @property
    def folded(self) -> list[TopFolded]:
        return fold_rows(self.loads)

    @property
    def tpu_rows(self) -> list[TpuRow]:
        return fold_tpu(self.loads)

    @property
    def tpu_note(self) -> str | None:
        """The one TPU line when every worker says the same (e.g. simulated), else None."""
        texts = {w.tpu_text for w in self.rows if w.reachable}
        if len(texts) == 1:
            only = texts.pop()
            return f"TPU use: {only}" if only else None
        return None


def frame(hosts: Any, *, workers: Iterable[int] | None = None, interval: float = 1.0,
          timeout: float | None = None) -> TopReport:
    """One frame: ``top_worker.py`` on every chosen worker at once (one fan-out);
    ``timeout``: TIMEOUTS["top"]."""
    from tpufab.ssh.remote_files import run_script

    chosen = list(workers if workers is not None else hosts.workers)
    started = time.monotonic()
    outcomes = run_script(hosts.fanout, SCRIPT, ["--interval", f"{interval:g}"], chosen,
                          timeout=timeout_for("top", timeout))
    try:
        loads = {w: parse(w, outcomes[w]) for w in chosen}
    finally:
        close = getattr(outcomes, "close", None)
        if close is not None:
            close()
    return TopReport(hosts.name, time.time(), time.monotonic() - started, interval,
                    rows=[loads[w] for w in chosen])


def check_every(every: float, interval: float) -> None:
    if not 0 < interval <= 30:       # (NaN too)
        raise ConfigError(f"--interval must be above 0 and at most 30 seconds, not {interval:g}.")
    if not MIN_EVERY <= every <= MAX_EVERY:
        raise ConfigError(f"--every must be at least {MIN_EVERY:g} second and at most "
                          f"{MAX_EVERY:g} (an hour), not {every:g}.")


def watch(hosts: Any, *, on_frame: Callable[[TopReport], None], every: float = 3.0,
          interval: float = 1.0, workers: Iterable[int] | None = None,
          timeout: float | None = None, frames: int | None = None,
          sleep: Callable[[float], None] = time.sleep) -> TopReport:
    """Frames every ``every`` seconds (counted from each frame's start) until Ctrl-C or
    ``frames`` of them; each goes to ``on_frame``. Returns the last."""
    from tpufab.ssh.results import FanoutInterrupted

    chosen = list(workers) if workers is not None else None
    count = 0
    while True:
        began = time.monotonic()
        try:
            last = frame(hosts, workers=chosen, interval=interval, timeout=timeout)
        except FanoutInterrupted:   # Ctrl-C during a frame: as during the pause between
            raise KeyboardInterrupt from None
        on_frame(last)
        count += 1
        if frames is not None and count >= frames:
            return last
        sleep(max(0.0, every - (time.monotonic() - began)))
