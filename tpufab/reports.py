"""Per-worker outcomes: what a step's worker scripts answered, read in one place.

A worker script ends with one JSON line (``workerlib.answer``); a step's per-worker row is a
dataclass whose fields are named as that answer's keys (``worker``, ``ok``, ``error``,
``message`` and the step's own). ``answer_row`` turns a transport outcome into such a row,
and the transport's failures (no Python, a full disk, SSH) into the same row with ``ok``
False, so deploy, mount and the code lease read their answers the same way.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Protocol, TypeVar

from tpufab import nodeset
from tpufab.nodeset import fold
from tpufab.quoting import Secret
from tpufab.remote.workerlib import read_answer


def last_line(text: str | None) -> str:
    """The last non-blank line of ``text`` (why a command failed, usually)."""
    lines = [line.strip() for line in (text or "").splitlines() if line.strip()]
    return lines[-1] if lines else ""


class Outcome(Protocol):
    """One worker's result of a command (a ``fanout.WorkerResult``)."""

    exit_code: int | None
    stdout: str
    stderr: str
    error: str | None


class Workers(Protocol):
    """The part of ``fanout.Fanout`` that the workflows use."""

    @property
    def workers(self) -> list[int]: ...

    def run(self, command: str, *, workers: Sequence[int] | None = None,
            env: Mapping[str, str] | None = None,
            secrets: Mapping[str, Secret] | None = None) -> Mapping[int, Outcome]: ...

    def put(self, data: bytes | Path, remote_path: str, *, workers: Sequence[int] | None = None,
            check: bool = False) -> Mapping[int, Outcome]: ...


Row = TypeVar("Row")


def failure_of(outcome: Outcome) -> tuple[str, str]:
    """(error code, message) for an outcome that carries no answer: the transport's words."""
    reason = outcome.error or last_line(outcome.stderr) or f"exit status {outcome.exit_code}"
    stderr = outcome.stderr or ""
    if outcome.exit_code == 127 or "python3: not found" in stderr:
        return "no_python", "python3 is not installed on this worker"
    if "No space left" in stderr + (outcome.error or ""):
        return "disk_full", reason
    return "ssh", reason


def answer_row(row_type: type[Row], worker: int, outcome: Outcome, **extra: Any) -> Row:
    """The worker's answer (``read_answer``, with an ``ok``) as a ``row_type`` row; fields
    the answer does not name keep their defaults, keys the row does not know are ignored.
    ``extra`` fields are set either way (e.g. the time the transport measured)."""
    data = read_answer(outcome.stdout)
    names = {f.name for f in dataclasses.fields(row_type)}  # type: ignore[arg-type]
    if data is not None and "ok" in data:
        fields = {k: v for k, v in data.items() if k in names and k not in ("worker", "ok")}
        return row_type(worker=worker, ok=bool(data["ok"]), **{**fields, **extra})
    error, message = failure_of(outcome)
    return row_type(worker=worker, ok=False, error=error, message=message, **extra)


# ---------------------------------------------------------------------------------------------
# The one per-worker report


@dataclass(frozen=True)
class Column:
    """How a report's rows show, one column of them. Rows that agree on every ``cell`` fold
    into one line under their workers (``w[0-3]``); a column with ``over`` is shown from the
    folded rows (a time range, each worker's pid) and is no part of what they must agree on."""

    header: str
    cell: Callable[[Any], Any] | None = None
    over: Callable[[list[Any]], str] | None = None


@dataclass(kw_only=True)
class Report:
    """One step's outcome on every worker: its typed ``rows`` (a ``worker``, ``ok``, and on
    failure ``error``/``message``; or, not ``per_worker``, the pod's own), how they show (``columns``: a table under WORKERS, or
    ``lines`` of ``prefix who  cells``), one closing ``summary`` sentence on stdout and
    ``notes`` on stderr. A step's report subclasses this to add the fields it knows (deploy's
    commit, mount's mount point): they are the report's ``--json`` beside its rows. Rendered
    by ``tpufab.views.report`` only (human and ``--json``); nothing renders itself."""

    step: str
    rows: list[Any] = field(default_factory=list)
    columns: tuple[Column, ...] = ()
    lines: bool = False           # bare lines, not a table under headers
    prefix: str = ""              # before each line: "put: "
    summary: str = ""
    notes: list[str] = field(default_factory=list)
    # False: the rows are the pod's (a run across the workers), each on its own line under
    # the columns alone; the workers it concerns are in its cells
    per_worker: bool = True

    # A layout of the step's own: its module's name in tpufab/views (views.report.view_of); "":
    # the rows as the table or lines above
    view: ClassVar[str] = ""

    SHAPE: ClassVar[tuple[str, ...]] = ("step", "rows", "columns", "lines", "prefix", "summary",
                                        "notes", "per_worker")

    @property
    def ok(self) -> bool:
        return all(getattr(r, "ok", True) for r in self.rows)

    @property
    def failed(self) -> list[Any]:
        return [r for r in self.rows if not getattr(r, "ok", True)]

    @property
    def by_worker(self) -> dict[int, Any]:
        """``{worker: row}`` (a step with one row per worker)."""
        return {r.worker: r for r in self.rows}

    def data(self) -> dict[str, Any]:
        """The step's own fields (what a subclass adds), for --json; a field declared with
        ``metadata={"json": False}`` (what the rows say already) is left out, in a row too."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if f.name not in self.SHAPE and f.metadata.get("json", True)}


def seconds_range(rows: Sequence[Any]) -> str:
    """``0.41-0.52s`` over rows with ``seconds`` (one value when they agree; ``-`` for none)."""
    times = sorted(r.seconds for r in rows if getattr(r, "seconds", None) is not None)
    if not times:
        return "-"
    if len(times) == 1 or times[-1] - times[0] < 0.01:
        return f"{times[-1]:.2f}s"
    return f"{times[0]:.2f}-{times[-1]:.2f}s"


def count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


# -- the pure text of a report: what the one renderer (tpufab.views.report) shows, and a
# failed step's per-worker details ------------------------------------------------------------
WORKERS = "WORKERS"


def failure(row: Any) -> str:
    """``failed: disk_full: No space left on device`` (the row's error and message)."""
    words = [str(w) for w in (getattr(row, "error", None), getattr(row, "message", None)) if w]
    return "failed: " + (": ".join(dict.fromkeys(words)) or "no answer")


def folded(report: Report) -> list[tuple[str, list[str], bool]]:
    """``[(folded workers, cells, ok)]``: the rows that agree on every keyed cell (a failed
    row: on its failure) as one, in the order of their first worker."""
    if not report.per_worker:   # the pod's rows: each as it is, in its order
        return [("", [_shown(c.cell(row) if c.cell else None) for c in report.columns], True)
                for row in report.rows]
    groups: dict[tuple, list[Any]] = {}
    for row in sorted(report.rows, key=lambda r: r.worker):
        if getattr(row, "ok", True):
            key = ("ok", *(c.cell(row) if c.cell else None for c in report.columns))
        else:
            key = ("failed", failure(row))
        groups.setdefault(key, []).append(row)
    out = []
    for key, rows in groups.items():
        who = fold(r.worker for r in rows)
        if key[0] == "failed":
            cells = [key[1]] + ["-"] * (len(report.columns) - 1 if not report.lines else 0)
        else:
            cells = [c.over(rows) if c.over else _shown(c.cell(rows[0]) if c.cell else None)
                     for c in report.columns]
        out.append((who, cells, key[0] == "ok"))
    return out


def _shown(value: Any) -> str:
    return "-" if value is None or value == "" else str(value)


def text(report: Report) -> list[str]:
    """The rows as plain lines (pure): ``prefix who  cells`` with the workers' column padded;
    a table's cells are joined by two spaces, under no header."""
    groups = folded(report)
    width = max((len(who) for who, _, _ in groups), default=0)
    sep = ", " if report.lines else "  "
    lead = "" if not report.per_worker else "{who:<{width}}  "
    return [f"{report.prefix}{lead.format(who=who, width=width)}"
            f"{sep.join(cells) if ok else cells[0]}".rstrip() for who, cells, ok in groups]


def to_json(report: Report) -> dict[str, Any]:
    """The report as data: the step, ok, its own fields, summary, notes and every row."""
    if not report.per_worker:
        return {"step": report.step, "ok": report.ok, **_plain(report.data()),
                "summary": report.summary, "notes": list(report.notes),
                "rows": [_plain(row) for row in report.rows]}
    rows = [{"worker": row.worker, "ok": getattr(row, "ok", True), **_plain(row)}
            for row in sorted(report.rows, key=lambda r: r.worker)]
    return {"step": report.step, "ok": report.ok, **_plain(report.data()),
            "workers": fold(sorted({r.worker for r in report.rows})),
            "summary": report.summary, "notes": list(report.notes), "rows": rows}


def _plain(value: Any) -> Any:
    """``value`` as JSON data: a dataclass as its fields (those not ``json: False``)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)
                if f.metadata.get("json", True)}
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


# -- what ray up and ray down did, as a sentence (the verbs and the flows say them) ----------
def up_sentence(done: Any, name: str) -> str:
    """What `tpufab ray up` did on pod ``name`` (a RayUp of tpufab.steps.start.raycluster), and
    what to do next (and, where the Ray installed has no token authentication, that its job
    API is open to whoever reaches the host)."""
    warning = (f" Warning: Ray on {nodeset.fold(done.open_hosts)} has no token authentication "
               "(Ray 2.52 and later have it): anyone who can reach those hosts can run "
               "commands through Ray; install a newer Ray (`TPUFAB_RAY_SPEC`).") \
        if done.open_hosts else ""
    if done.already:
        return (f"Ray is already up on {name}: head on {nodeset.label(done.head)} at "
                f"{done.address}, all {done.hosts} hosts joined; nothing to do "
                f"({done.seconds:.1f} s).{warning}")
    how = "started" if len(done.started) == done.hosts else \
        f"started on {nodeset.fold(done.started)} (the others were up)"
    return (f"Ray is up on {name}: head on {nodeset.label(done.head)} at {done.address}, "
            f"{done.hosts} hosts joined ({how}, {done.seconds:.1f} s). Jobs: `tpufab ray "
            f"submit RECIPE`; dashboard: `tpufab forward {done.dashboard_port}` (its token: "
            f"`~/.ray/auth_token` on the head).{warning}")


def down_sentence(done: Any, name: str) -> str:
    """What `tpufab ray down` did on pod ``name`` (a RayDown)."""
    had = [w for w, a in done.answers.items() if a.get("stopped")]
    if not had:
        return f"Ray was not running on {name}; nothing to stop."
    forced = [w for w, a in done.answers.items() if a.get("forced")]
    how = f" (forced on {nodeset.fold(forced)})" if forced else ""
    return (f"Ray stopped on {nodeset.fold(had)} of {name}{how}; no Ray process is left "
            "on any host.")
