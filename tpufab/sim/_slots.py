"""Node slots (-> worker addresses 127.{16 + s // 256}.{s % 256}.{w + 1}) unique per machine.

Several simulated pods may run at once (a user's, a test session's), each with its own state
dir. A small registry file, under a file lock, says which state dir holds which slot; a claim
whose state dir no longer lists a node on that slot (deleted, or the dir is gone) is free.
"""

from __future__ import annotations

import fcntl
import json
import os
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

MAX_SLOT = 239 * 256 + 255  # keeps the second octet <= 255
FRESH = 120.0  # seconds a claim holds before its node must show up in the holder's state


def registry_path() -> Path:
    explicit = os.environ.get("TPUFAB_SIM_SLOTS")
    if explicit:
        return Path(explicit)
    run = Path("/run")
    if os.access(run, os.W_OK):
        return run / "tpufab-sim" / "slots.json"
    return Path(tempfile.gettempdir()) / f"tpufab-sim-{os.geteuid()}" / "slots.json"


def _holds(state_dir: str, slot: int) -> bool:
    """Whether another pod's state dir still has a node on this slot."""
    try:
        state = json.loads((Path(state_dir) / "api-state.json").read_text())
    except (OSError, ValueError):
        return False
    return any(r.get("sim", {}).get("slot") == slot for r in state.get("nodes", {}).values())


class SlotRegistry:
    def __init__(self, state_dir: Path, path: Path | None = None):
        self.owner = str(Path(state_dir).resolve())
        self.path = path or registry_path()

    @contextmanager
    def _locked(self) -> Iterator[dict[str, dict]]:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path.with_suffix(".lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                table = json.loads(self.path.read_text())
            except (OSError, ValueError):
                table = {}
            yield table
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text(json.dumps(table, indent=1, sort_keys=True))
            os.replace(tmp, self.path)

    def _taken(self, table: dict[str, dict], slot: int) -> bool:
        claim = table.get(str(slot))
        if not isinstance(claim, dict) or claim.get("owner") == self.owner:
            return False
        fresh = time.time() - float(claim.get("at", 0)) < FRESH
        return fresh or _holds(str(claim.get("owner")), slot)

    def _mark(self, table: dict[str, dict], slot: int) -> None:
        table[str(slot)] = {"owner": self.owner, "at": time.time()}

    def claim(self, own: set[int]) -> int:
        """The lowest slot used neither by this pod (`own`) nor by another live pod."""
        with self._locked() as table:
            for slot in range(1, MAX_SLOT + 1):
                if slot not in own and not self._taken(table, slot):
                    self._mark(table, slot)
                    return slot
        raise RuntimeError("every simulated node slot on this machine is taken")

    def reclaim(self, slot: int) -> bool:
        """Take `slot` back after a restart; False if another live pod holds it now."""
        with self._locked() as table:
            if self._taken(table, slot):
                return False
            self._mark(table, slot)
            return True

    def release(self, slot: int) -> None:
        with self._locked() as table:
            claim = table.get(str(slot))
            if isinstance(claim, dict) and claim.get("owner") == self.owner:
                del table[str(slot)]
