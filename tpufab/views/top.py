"""How `tpufab top` shows (the view ``top`` of tpufab.views.report.show): a frame as a
header line, the folded table of the workers (CPU, memory, load, processes, TPU) and the TPU
line; ``--json`` the frame as docs/status.md gives it. ``follow`` draws the live frames: one
table redrawn in place, or one line of JSON a frame."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from tpufab.term.terminal import neutralise_text

if TYPE_CHECKING:
    from rich.console import Console, RenderableType
    from rich.table import Table

    from tpufab.steps.health.top import TopFolded, TopReport, TopRow, TpuRow


def load_json(load: TopRow) -> dict[str, Any]:
    return {"worker": load.worker, "reachable": load.reachable, "error": load.error,
            "cpu_percent": load.cpu_percent, "core_percent": load.core_percent,
            "cores": load.cores, "load": list(load.load),
            "memory_total_bytes": load.memory_total,
            "memory_available_bytes": load.memory_available,
            "memory_percent": None if load.memory_percent is None
            else round(load.memory_percent, 1),
            "runs": list(load.runs), "busiest": list(load.busiest), "tpu": load.tpu}


def row_json(row: TopFolded) -> dict[str, Any]:
    return {"workers": row.label, "indexes": row.workers, "state": row.state,
            "cpu": row.cpu, "memory": row.memory, "load": row.load,
            "processes": row.processes, "tpu": row.tpu, "outlier": row.odd}


def tpu_row_json(row: TpuRow) -> dict[str, Any]:
    return {"workers": row.label, "indexes": row.workers, "kind": row.kind, "text": row.text,
            "duty_cycle_percent": None if row.duty is None else round(row.duty, 1),
            "outlier": row.odd, "mark": row.mark or None}


def to_json(frame: TopReport) -> dict[str, Any]:
    return {"name": frame.name, "taken_at": frame.taken_at, "seconds": round(frame.seconds, 3),
            "interval": frame.interval, "tpu": frame.tpu_note,
            "rows": [row_json(r) for r in frame.folded],
            "tpu_rows": [tpu_row_json(r) for r in frame.tpu_rows],
            "workers": [load_json(w) for w in frame.loads.values()]}


def tpu_table(frame: TopReport) -> Table:
    """The TPU rows (``--tpu``): per host, folded, the outliers first."""
    from rich.markup import escape
    from rich.table import Table

    t = Table(box=None, pad_edge=False, header_style="bold")
    for column in ("WORKERS", "TPU", ""):
        t.add_column(column, overflow="fold")
    for row in frame.tpu_rows:
        style = "red" if row.kind == "unreachable" else ("yellow" if row.odd else None)
        t.add_row(*(escape(neutralise_text(c)) for c in (row.label, row.text, row.mark)),
                  style=style)
    return t


def table(frame: TopReport) -> Table:
    """The folded rows; the TPU column only when the workers' TPU lines differ."""
    from rich.markup import escape
    from rich.table import Table

    note = frame.tpu_note
    columns = ["WORKERS", "STATE", "CPU", "MEMORY", "LOAD", "PROCESSES"]
    if note is None:
        columns.append("TPU")
    t = Table(box=None, pad_edge=False, header_style="bold")
    for column in columns:
        t.add_column(column, overflow="fold")
    for row in frame.folded:
        cells = [row.label, row.state, row.cpu, row.memory, row.load, row.processes]
        if note is None:
            cells.append(row.tpu)
        style = "red" if row.state == "unreachable" else ("yellow" if row.odd else None)
        t.add_row(*(escape(neutralise_text(c)) for c in cells), style=style)
    return t


def renderable(frame: TopReport, *, live: bool = False, tpu: bool = False) -> RenderableType:
    """The frame as one rich renderable (a header, the table, the TPU line)."""
    from rich.console import Group
    from rich.markup import escape
    from rich.text import Text

    when = time.strftime("%H:%M:%S", time.localtime(frame.taken_at))
    head = (f"[bold]{escape(frame.name)}[/bold]: {len(frame.rows)} workers at {when} "
            f"(sampled {frame.interval:g} s; frame {frame.seconds:.1f} s)")
    parts: list[Any] = [head, tpu_table(frame) if tpu else table(frame)]
    if frame.tpu_note and not tpu:
        parts.append(Text(frame.tpu_note, style="dim"))
    if live:
        parts.append(Text("Ctrl-C to stop.", style="dim"))
    return Group(*parts)


def show(frame: TopReport, *, as_json: bool, console: Console, errors: Console,
         tpu: bool = False) -> None:
    """One frame on ``console`` (``errors``: unused, a frame has no notes; ``tpu``: the TPU
    rows instead of the load table)."""
    from tpufab.term.console import print_json

    if as_json:
        print_json(to_json(frame), console)
    else:
        console.print(renderable(frame, tpu=tpu))


def follow(watch: Callable[[Callable[[TopReport], None]], Any], *, as_json: bool,
           console: Console | None = None, tpu: bool = False) -> TopReport | None:
    """The live view: ``watch(on_frame)`` takes frames until Ctrl-C; each is drawn as it
    comes (``as_json``: one line of JSON a frame, else the table redrawn in place). Returns
    the last frame (None: none came)."""
    from tpufab.term.console import stdout

    console = console or stdout()
    last: list[TopReport] = []
    if as_json:
        def on_frame(frame: TopReport) -> None:
            last[:] = [frame]
            console.print(json.dumps(to_json(frame), separators=(",", ":")), markup=False,
                          highlight=False, emoji=False, soft_wrap=True)
            console.file.flush()

        try:
            watch(on_frame)
        except KeyboardInterrupt:
            pass
        return last[0] if last else None
    from rich.live import Live

    with Live(console=console, auto_refresh=False, transient=False) as live:
        def draw(frame: TopReport) -> None:
            last[:] = [frame]
            live.update(renderable(frame, live=True, tpu=tpu), refresh=True)

        try:
            watch(draw)
        except KeyboardInterrupt:
            pass
    return last[0] if last else None
