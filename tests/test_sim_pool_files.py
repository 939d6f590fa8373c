"""A deleted node's files leave its place at once and are removed in the background."""

from helpers import wait_for

from tpufab.sim.workers import TRASH, WorkerPool


def test_delete_moves_the_files_aside_and_empties_them(tmp_path):
    pool = WorkerPool(tmp_path / "state")
    node = tmp_path / "state" / "nodes" / "4242"
    for w in range(3):
        (node / f"w{w}" / "home" / "u").mkdir(parents=True)
        (node / f"w{w}" / "home" / "u" / "f").write_text("x")
    pool.delete_node("4242")
    assert not node.exists()  # at once: the node's place is free
    trash = tmp_path / "state" / TRASH
    wait_for(lambda: not any(trash.iterdir()), 30, what="the deleted files to go")


def test_files_left_by_a_stopped_daemon_are_removed_by_the_next_pool(tmp_path):
    leftover = tmp_path / "state" / TRASH / "1-2" / "w0"
    leftover.mkdir(parents=True)
    (leftover / "f").write_text("x")
    WorkerPool(tmp_path / "state")
    wait_for(lambda: not (tmp_path / "state" / TRASH / "1-2").exists(), 30,
             what="the leftover to go")
