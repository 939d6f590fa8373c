"""The one renderer of a step's per-worker report (``tpufab.reports.Report``).

Every worker verb prints its report here and nowhere else: rows that agree on every cell
fold into one line under their workers (``w[0-3]``, first worker first), a failed row shows
as ``failed: ERROR: MESSAGE`` under its own workers, then the summary sentence on stdout and
the notes on stderr. ``--json`` is the same report as data: the step, ``ok``, the step's own
fields, the summary, the notes and every row in full. ``folded`` and ``text`` are pure (the
error details of a failed step are ``text``). A step whose output has a layout of its own
(status's node lines above its table, check's lines and problems, top's frame, the
folded stacks, `ray status`'s nodes and jobs) names it as its report's ``view``: that module of
tpufab.display prints it, human and ``--json`` (``VIEWS``), and ``show`` reaches it all the same.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from tpufab.nodeset import fold
from tpufab.reports import Report
from tpufab.views import check, ray, stacks, status, top

if TYPE_CHECKING:
    from rich.console import Console

WORKERS = "WORKERS"
# A report's ``view`` -> the module function that prints it: show(report, as_json=, console=,
# errors=)
VIEWS: dict[str, Callable[..., None]] = {"status": status.show, "check": check.show,
                                         "top": top.show, "stacks": stacks.show,
                                         "ray": ray.show}


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


def show(report: Report, *, as_json: bool = False, console: Console | None = None,
         errors: Console | None = None) -> None:
    """Print ``report``: its rows folded (a table under WORKERS, or lines), its summary on
    stdout and its notes on stderr; or, ``as_json``, the whole of it as JSON on stdout.
    ``console``/``errors``: other consoles than tpufab's stdout and stderr (tests).

    The one way to a layout of a step's own: a report whose class sets ``view`` (status, check,
    top, stacks) is
    printed, human and ``as_json``, by ``VIEWS[view]``, the function of that name's module
    under tpufab/display (tpufab/views/status.py, check.py, top.py, stacks.py), given the same
    consoles. A stream of reports (top's live frames) is drawn by its view's ``follow``."""
    from tpufab.term.console import print_json, stderr, stdout
    from tpufab.term.terminal import neutralise_text

    console = console or stdout()
    if report.view:
        VIEWS[report.view](report, as_json=as_json, console=console, errors=errors or stderr())
        return
    if as_json:
        print_json(to_json(report), console)
        return
    if report.columns and report.rows:
        if report.lines:
            for line in text(report):
                console.print(neutralise_text(line), markup=False, highlight=False, emoji=False)
        else:
            from tpufab.term.tables import fitted

            lead = (WORKERS,) if report.per_worker else ()
            console.print(fitted((*lead, *(c.header for c in report.columns)),
                                 [[*((who,) if lead else ()), *map(neutralise_text, cells)]
                                  for who, cells, _ in folded(report)], console, markup=False))
    if report.summary:
        console.print(neutralise_text(report.summary), markup=False, highlight=False, emoji=False)
    for note in report.notes:
        (errors or stderr()).print(neutralise_text(note), markup=False, highlight=False, emoji=False)
