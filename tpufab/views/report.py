"""The one renderer of a step's per-worker report (``tpufab.reports.Report``).

Every worker verb prints its report here and nowhere else: rows that agree on every cell
fold into one line under their workers (``w[0-3]``, first worker first), a failed row shows
as ``failed: ERROR: MESSAGE`` under its own workers, then the summary sentence on stdout and
the notes on stderr. ``--json`` is the same report as data: the step, ``ok``, the step's own
fields, the summary, the notes and every row in full (``folded``, ``text`` and ``to_json``
are the pure text of a report, tpufab.reports). A step whose output has a layout of its own
(status's node lines above its table, check's lines and problems, top's frame, the
folded stacks, `ray status`'s nodes and jobs) names it as its report's ``view``: the module of
tpufab.views of that name prints it, human and ``--json`` (its ``show``), and ``show`` here
reaches it all the same.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from tpufab.reports import WORKERS, Report, folded, text, to_json

if TYPE_CHECKING:
    from rich.console import Console


def view_of(name: str) -> Callable[..., None]:
    """The function that prints a report whose ``view`` is ``name``: ``show(report,
    as_json=, console=, errors=)`` of the module tpufab.views.<name>."""
    return importlib.import_module(f"{__package__}.{name}").show


def show(report: Report, *, as_json: bool = False, console: Console | None = None,
         errors: Console | None = None, **view_options: Any) -> None:
    """Print ``report``: its rows folded (a table under WORKERS, or lines), its summary on
    stdout and its notes on stderr; or, ``as_json``, the whole of it as JSON on stdout.
    ``console``/``errors``: other consoles than tpufab's stdout and stderr (tests).

    The one way to a layout of a step's own: a report whose class sets ``view`` (status, check,
    top, stacks, ray) is printed, human and ``as_json``, by the ``show`` of that name's module
    under tpufab/views (tpufab/views/status.py, check.py, ...), given the same consoles (and
    ``view_options``: top's ``tpu``). A stream of reports (top's live frames) is drawn by its view's ``follow``."""
    from tpufab.term.console import print_json, stderr, stdout
    from tpufab.term.terminal import neutralise_text

    console = console or stdout()
    if report.view:
        view_of(report.view)(report, as_json=as_json, console=console, errors=errors or stderr(),
                             **view_options)
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
