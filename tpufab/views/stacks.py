"""How `tpufab stacks` shows (the view ``stacks`` of tpufab.views.report.show): a headline,
the folded stacks (the odd workers' first, the frame where each leaves the others' stack
marked), the processes py-spy could not read and the workers with nothing to read, on
stdout, then where they were saved on stderr; ``--json`` the shape docs/hangs.md gives. The
saved ``stacks-TIME.txt`` and ``.json`` are the same ``lines`` and ``to_json`` (the report's
pure text, tpufab.steps.health.stacks)."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from tpufab.steps.health.stacks import lines, to_json
from tpufab.term.terminal import neutralise_text, relative_path

if TYPE_CHECKING:
    from rich.console import Console

    from tpufab.steps.health.stacks import StacksReport

def show(report: StacksReport, *, as_json: bool, console: Console, errors: Console) -> None:
    """The folded view on ``console`` when there are stacks (otherwise the one sentence of
    ``report.check()`` says it all), and where it was saved on ``errors``; or the JSON
    (keys sorted, as in the saved file)."""
    if as_json:
        console.print(json.dumps(to_json(report), indent=2, sort_keys=True), markup=False,
                      highlight=False, emoji=False, soft_wrap=True)
        return
    if report.processes:
        out = console.file      # as written: the frames' text is not rich's to reflow
        for line in lines(report):
            out.write(neutralise_text(line) + "\n")
        out.flush()
    if report.saved:
        errors.print(neutralise_text(f"Saved to {relative_path(report.saved[0])} (and .json)."),
                     markup=False, style="dim")
