"""Node slots (-> worker addresses, see ``_model.worker_address``) unique per machine.

A slot is 254 loopback addresses (``127.{16 + s // 256}.{s % 256}.1-254``); a node with more
hosts holds a run of consecutive slots (v5p-12288's 1,536 workers: 7). Several simulated pods
may run at once (a user's, a test session's), each with its own state dir. A small registry
file, under a file lock, says which state dir holds which slot; a claim whose state dir no
longer lists a node covering that slot (deleted, or the dir is gone) is free.
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
WORKERS_PER_SLOT = 254  # last octets .1-.254; .0 and .255 stay unused


def slots_for(hosts: int) -> int:
    """How many consecutive slots a node of ``hosts`` workers holds (at least one)."""
    return max(1, -(-hosts // WORKERS_PER_SLOT))


def node_slots(record: dict) -> range:
    """The slots a node's emulator record covers: its first slot and as many as it needs."""
    first = int(record["sim"]["slot"])
    return range(first, first + slots_for(len(record["node"].get("networkEndpoints") or [])))
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
    """Whether another pod's state dir still has a node covering this slot."""
    try:
        state = json.loads((Path(state_dir) / "api-state.json").read_text())
    except (OSError, ValueError):
        return False
    for record in state.get("nodes", {}).values():
        try:
            if slot in node_slots(record):
                return True
        except (KeyError, TypeError, ValueError):
            continue
    return False


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

    def claim(self, own: set[int], count: int = 1, prefer: int | None = None) -> int:
        """The first of the lowest ``count`` consecutive slots used neither by this pod
        (`own`) nor by another live pod; all of them are marked as this pod's. ``prefer``:
        that run of slots when it is free (a node made again under its old name keeps its
        addresses, and an internal-IP node its bastion's, as a VPC's bastion outlives it)."""
        with self._locked() as table:
            if prefer is not None and 1 <= prefer <= MAX_SLOT - count + 1:
                span = range(prefer, prefer + count)
                if all(s not in own and not self._taken(table, s) for s in span):
                    for s in span:
                        self._mark(table, s)
                    return prefer
            run = 0
            for slot in range(1, MAX_SLOT + 1):
                free = slot not in own and not self._taken(table, slot)
                run = run + 1 if free else 0
                if run == count:
                    first = slot - count + 1
                    for taken in range(first, slot + 1):
                        self._mark(table, taken)
                    return first
        raise RuntimeError(f"no {count} consecutive simulated node slots are free on this "
                           "machine")

    def reclaim(self, slot: int, count: int = 1) -> bool:
        """Take slots ``slot..slot+count-1`` back after a restart; False if another live pod
        holds any of them now."""
        with self._locked() as table:
            span = range(slot, slot + count)
            if any(self._taken(table, s) for s in span):
                return False
            for s in span:
                self._mark(table, s)
            return True

    def release(self, slot: int, count: int = 1) -> None:
        """Free slots this pod no longer uses: for this pod at once; for other pods once the
        claim is no longer fresh (FRESH seconds from now), so a node this pod makes again
        under the same name finds its slots still there (``claim(prefer=...)``)."""
        with self._locked() as table:
            for s in range(slot, slot + count):
                claim = table.get(str(s))
                if isinstance(claim, dict) and claim.get("owner") == self.owner:
                    self._mark(table, s)
