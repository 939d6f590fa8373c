"""What a gone keeper or resident server left is pruned whatever order the directory lists it
in (as data: a folder of files, no server)."""

from __future__ import annotations

import os
import time

import pytest

from tpufab.ssh.keeper import server


@pytest.mark.parametrize("log_first", [True, False], ids=["log-listed-first", "lock-listed-first"])
def test_a_gone_servers_old_log_goes_with_its_lock_in_one_pass(tmp_path, monkeypatch,
                                                              log_first):
    """Before: the log was checked against the listing taken before the pass, which still
    held the lock the same pass removed, so it stayed until a later server started (the fault
    matrix's pruning test failed in whole-suite runs, where no later server came)."""
    old = time.time() - 3 * 86400
    for name in ("0123456789ab-dead.lock", "0123456789ab-dead.log", "fresh-beef.log"):
        (tmp_path / name).write_text("")
    for name in ("0123456789ab-dead.lock", "0123456789ab-dead.log"):
        os.utime(tmp_path / name, (old, old))
    real = os.scandir

    def listed(path):
        entries = sorted(real(path), key=lambda e: e.name.endswith(".log") != log_first)
        return iter(entries)

    monkeypatch.setattr(server.os, "scandir", listed)
    server.prune(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fresh-beef.log"]
