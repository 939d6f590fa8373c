"""Tables fit the terminal (issue 26): one line per row, long cells shortened, `--wide` full."""

from __future__ import annotations

import io

from helpers import facts_of
from rich.console import Console

from tpufab.cloud.nodes import Node, WorkerEndpoint
from tpufab.steps.health import status as st
from tpufab.term import tables
from tpufab.views import nodes as node_views
from tpufab.views import status as status_view

LONG = ("python3 -I -S /home/me/.cache/tpufab/remote/5d41402abc4b2a76b9719d911017c592/"
        "{script}.py --config configs/llama3-8b.yaml --steps 100000")
# three holders of one worker: the TPU cell names each (program and script), a long cell
SCRIPTS = ("pretrain_llama3_8b_on_the_pile", "evaluate_llama3_8b_checkpoints", "export_weights")


def printed(renderable_of, width: int, *, wide: bool = False) -> list[str]:
    console = Console(file=io.StringIO(), width=width, soft_wrap=True, highlight=False)
    if wide:
        tables.wide(console)
    console.print(renderable_of(console))
    return console.file.getvalue().splitlines()


def busy_status() -> st.StatusReport:
    busy = [{"path": "/dev/accel0", "holders": [
                {"pid": 812 + i, "command": LONG.format(script=name)}
                for i, name in enumerate(SCRIPTS)]},
            {"path": "/dev/accel1", "holders": []}]
    workers = {w: facts_of(w) for w in range(4)}
    workers[2] = facts_of(2, devices=busy)
    return st.StatusReport(name="pod", rows=list(workers.values()))


def test_a_busy_workers_long_holder_stays_on_its_row():
    status = busy_status()
    assert [r.label for r in status.folded] == ["w[0-1,3]", "w2"]
    for width in (100, 120, 160):
        lines = printed(lambda c: status_view.table(status, c), width)
        assert len(lines) == 3, lines            # the header and one line per row: no wrap
        assert all(len(line) <= width for line in lines), lines
        assert lines[1].startswith("w[0-1,3] ") and lines[2].startswith("w2 ")
        assert "…" in lines[2] and status.folded[1].tpu not in lines[2]
        assert lines[0].split()[:3] == ["WORKERS", "STATE", "TPU"]


def test_wide_shows_every_value_in_full():
    status = busy_status()
    cell = status.folded[1].tpu          # the holders' commands as status words them
    assert cell == "1/2 busy: python3 evaluate_llama3_8b_checkpoint...; python3 " \
        "export_weights.py +1"  # each cut at 40 characters, two named, the count of the rest
    assert ".cache/tpufab" not in cell   # what names them, not the path
    lines = printed(lambda c: status_view.table(status, c), 100, wide=True)
    assert len(lines) == 3 and cell in lines[2] and "…" not in "".join(lines)


def test_list_of_a_v4_512_fits_with_its_64_addresses_shortened():
    workers = [WorkerEndpoint(i, f"10.0.{i // 250}.{i % 250 + 2}", f"34.1.{i // 250}.{i % 250}", 22)
               for i in range(64)]
    node = Node(name="my-v4-512", project="p", zone="z", accelerator_type="v4-512",
                state="READY", health="HEALTHY", workers=workers)
    lines = printed(lambda c: node_views.nodes_table([node], c), 120)
    assert len(lines) == 2 and all(len(line) <= 120 for line in lines), lines
    assert lines[1].startswith("my-v4-512 ") and "READY" in lines[1] and "HEALTHY" in lines[1]
    full = printed(lambda c: node_views.nodes_table([node], c), 120, wide=True)
    assert " ".join(node.addresses()) in full[1]


def test_a_table_that_fits_is_left_alone_and_the_widest_column_gives_first():
    assert tables.widths([7, 10, 40], [7, 6, 6], keep=(0,), room=80) == [7, 10, 40]
    # 7 + 2 + 10 + 2 + 40 = 61 cells in 50: the widest (40) gives 11, the others nothing
    assert tables.widths([7, 10, 40], [7, 6, 6], keep=(0,), room=50) == [7, 10, 29]
    # both long columns shrink toward each other, the kept one never
    assert tables.widths([20, 30, 30], [7, 6, 6], keep=(0,), room=50) == [20, 13, 13]
    # nothing more to give: the floors (the terminal wraps the line; no column vanishes)
    assert tables.widths([20, 30, 30], [7, 6, 6], keep=(0,), room=10) == [20, 6, 6]


def test_a_terminal_too_narrow_for_the_floors_keeps_every_column_and_the_names_whole():
    status = busy_status()
    lines = printed(lambda c: status_view.table(status, c), 40)
    assert len(lines) == 3 and lines[0].startswith("WORKERS ") and lines[1].startswith("w[0-1,3] ")
    assert lines[0].split()[-1] == "MEMORY"           # no column dropped
