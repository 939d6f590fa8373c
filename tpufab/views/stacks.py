"""How `tpufab stacks` shows (the view ``stacks`` of tpufab.views.report.show): a headline,
the folded stacks (the odd workers' first, the frame where each leaves the others' stack
marked), the processes py-spy could not read and the workers with nothing to read, on
stdout, then where they were saved on stderr; ``--json`` the shape docs/hangs.md gives. The
saved ``stacks-TIME.txt`` and ``.json`` are the same ``lines`` and ``to_json``."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from tpufab import nodeset
from tpufab.term.commands import short_command
from tpufab.term.terminal import neutralise_text, relative_path

if TYPE_CHECKING:
    from rich.console import Console

    from tpufab.steps.health.stacks import Folded, StacksReport

MARK = "<-- differs"


def _short(command: str, width: int = 70) -> str:
    return short_command(command, width)


def render(entries: Sequence[Folded], odd: Sequence[int], *, total: int) -> list[str]:
    """The folded stacks as text lines (``total``: how many workers answered with stacks)."""
    lines: list[str] = []
    for entry in entries:
        head = entry.label
        if entry.odd:
            head += " (differs)"
        if len(entry.workers) == 1:
            [pid] = entry.pids.values()
            head += f" · pid {pid}"
        head += f" · `{_short(entry.key.command)}` · thread {entry.key.thread}"
        lines.append(head)
        for i, frame in enumerate(entry.key.frames or ("(no Python frames)",)):
            text = f"    {frame}"
            if entry.differs_at == i:
                text += f"   {MARK}: {entry.others} are in {entry.others_frame}"
            lines.append(text)
        lines.append("")
    return lines


def headline(report: StacksReport) -> str:
    entries, odd = report.fold()
    what = f"run {report.run}" if report.run else (
        "the runs" if report.source == "run" else "the TPU's Python holders")
    there = nodeset.fold(report.dumped) or "no worker"
    text = (f"Stacks of {what} on {there}: {report.processes} process"
            f"{'es' if report.processes != 1 else ''}, {len(entries)} distinct "
            f"stack{'s' if len(entries) != 1 else ''}")
    if odd:
        text += f"; {nodeset.fold(odd)} differ{'s' if len(odd) == 1 else ''} (shown first)"
    elif entries and len(report.dumped) > 1:
        text += "; no worker differs"
    return text + "."


def lines(report: StacksReport) -> list[str]:
    """The folded view: a headline, odd workers' stacks first, then the rest, then the
    processes py-spy could not read and the workers with nothing to read (pure)."""
    entries, odd = report.fold()
    out = [headline(report), ""]
    out += render(entries, odd, total=len(report.dumped))
    for item in report.unattached:
        pids = ", ".join(str(p) for p in item.pids.values())
        out.append(f"{nodeset.fold(item.workers)} · pid {pids} `{_short(item.command)}`: "
                   f"py-spy cannot attach: {item.reason}; fix: {item.fix}.")
    idle = [w for w, a in report.dumped.items() if not a.get("processes")]
    if idle:
        out.append(f"{nodeset.fold(idle)}: {report.nothing_text(idle)}.")
    for why, ws in report.errors_by_reason.items():
        out.append(f"{nodeset.fold(ws)}: no stacks ({why}).")
    return out


def folded_json(entry: Folded) -> dict[str, Any]:
    return {"workers": entry.workers, "label": entry.label, "odd": entry.odd,
            "command": entry.key.command, "thread": entry.key.thread,
            "frames": list(entry.key.frames), "pids": {str(w): p for w, p in entry.pids.items()},
            "differs_at": entry.differs_at, "others": entry.others or None,
            "others_frame": entry.others_frame or None}


def to_json(report: StacksReport) -> dict[str, Any]:
    entries, odd = report.fold()
    return {"run": report.run, "source": report.source, "native": report.native,
            "taken_at": report.taken_at, "odd_workers": odd,
            "stacks": [folded_json(e) for e in entries],
            "unattached": [{"workers": u.workers, "command": u.command, "reason": u.reason,
                            "fix": u.fix, "pids": {str(w): p for w, p in u.pids.items()}}
                           for u in report.unattached],
            "workers": {str(w): a for w, a in report.answers.items()},
            "errors": {str(w): e for w, e in report.errors.items()},
            "saved": [str(p) for p in report.saved]}


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
