"""Tables that fit the terminal: one line per row, long cells shortened, never wrapped.

A cell that wraps spills into the next row's columns (a busy worker's TPU holder, `4/4 busy:
python3 -I -S .cache/tpufab/remote/5d...`, used to take two lines of `tpufab status`). So
every cell stays on one line, and when a table is wider than the console the widest columns
that may shrink are shortened, widest first, each down to its header's width at least, with
``…`` where text was cut. The columns that name a row (``keep``: WORKERS, NAME, RUN) are
never shortened. Off a terminal the console is 160 columns wide (display.console); `--wide`
(:func:`wide`) lifts the limit, and `--json` always has every value in full.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rich.console import Console
    from rich.table import Table

GAP = 2          # rich's padding between two columns of a box=None, pad_edge=False table
FLOOR = 6        # a shortened column keeps at least this many cells (or its header's width)
WIDE = 1 << 20   # --wide: the console's width, so that nothing is shortened


def wide(console: Console) -> None:
    """Nothing printed on ``console`` from now on is shortened to fit (`--wide`)."""
    console.width = WIDE


def widths(natural: Sequence[int], floors: Sequence[int], keep: Iterable[int],
           room: int) -> list[int]:
    """Column widths that fit ``room`` cells (with GAP between columns): the widest column
    not in ``keep`` is shortened first, one cell at a time, never below its floor (pure).
    When even the floors do not fit, the floors are returned (the terminal wraps the line:
    better than a column that vanishes)."""
    out = list(natural)
    keep = set(keep)
    excess = sum(out) + GAP * max(len(out) - 1, 0) - room
    while excess > 0:
        candidates = [i for i in range(len(out)) if i not in keep and out[i] > floors[i]]
        if not candidates:
            break
        i = max(candidates, key=lambda c: (out[c], -c))   # the widest; the leftmost of equals
        out[i] -= 1
        excess -= 1
    return out


def fitted(columns: Sequence[str], rows: Sequence[Sequence[Any]], console: Console, *,
           keep: Iterable[int] = (0,), styles: Sequence[str | None] | None = None,
           markup: bool = True) -> Table:
    """A rich table of ``rows`` under ``columns`` that fits ``console``: every cell on one
    line, the columns not in ``keep`` shortened (widest first) when it is too wide. Cells
    are rich markup (escaped by the caller) unless ``markup`` is False."""
    from rich.table import Table
    from rich.text import Text

    def text(cell: Any) -> Any:
        if isinstance(cell, str):
            return Text.from_markup(cell) if markup else Text(cell)
        return cell

    cells = [[text(c) for c in row] for row in rows]
    natural = [max([len(h), *(c.cell_len if isinstance(c, Text) else len(str(c))
                              for c in (row[i] for row in cells))])
               for i, h in enumerate(columns)]
    floors = [min(n, max(len(h), FLOOR)) for n, h in zip(natural, columns, strict=True)]
    fit = widths(natural, floors, keep, console.width)
    table = Table(box=None, pad_edge=False, header_style="bold")
    total = sum(fit) + GAP * max(len(fit) - 1, 0)
    if total > console.width:
        # even the floors do not fit: the table keeps them (the terminal wraps the line)
        # rather than let rich shrink the WORKERS/NAME column or drop a column
        table.width = total
    for header, width, full in zip(columns, fit, natural, strict=True):
        table.add_column(header, no_wrap=True, overflow="ellipsis",
                         width=width if width < full else None)
    for n, row in enumerate(cells):
        table.add_row(*row, style=styles[n] if styles else None)
    return table
