"""`tpufab sim slow NAME --worker N --by 15%`: one simulated worker's processes really slower.

Not a flag a recipe reads, and not a CPU cap (a busy 2-core machine never reaches one): every
PERIOD the worker's processes (everything in its PID namespace but its PID 1) are stopped with
SIGSTOP for that share of the period (timed from the moment every one of them is seen
stopped) and continued with SIGCONT, so whatever the worker runs takes 1/(1 - share) as long
in wall time, as on a host with a slower chip or a throttled CPU.
``--by 0`` ends it (the processes are continued). The list of processes is refreshed every
second, so what starts later is slowed too.

Each worker's stops are counted (``stops``: how many, and for how long in all, the one under
way included): the simulated chip's metrics (sim/tpumetrics.py) add the time a program was
stopped to the program, and do not take the context switch a stop costs the process for a
wait of its own.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from typing import Any

from tpufab.errors import ConfigError

PERIOD = 0.1      # seconds: short against a step, long against a scheduler tick
MAX_SHARE = 0.9   # more is a hung worker: `tpufab sim unreachable`, or SIGSTOP yourself
REFRESH = 1.0     # seconds between two looks at the worker's processes


def parse_share(text: str | float, *, limit: float | None = None, flag: str = "--by") -> float:
    """``15%``, ``15`` or ``0.15``... as a share of time (0-0.9), or ConfigError in one sentence.
    ``limit``: another upper bound (``flag`` names the option in the sentence)."""
    raw = str(text).strip()
    try:
        value = float(raw.rstrip("%"))
    except ValueError:
        raise ConfigError(f"{flag} takes a percentage such as 15%, not {raw!r}.") from None
    share = value / 100 if raw.endswith("%") or value > 1 else value
    if limit is not None:
        if not 0 <= share <= limit:
            raise ConfigError(f"{flag} {raw} is outside 0%-{limit:.0%}.")
        return share
    if not 0 <= share <= MAX_SHARE:
        raise ConfigError(f"--by {raw} is outside 0%-{MAX_SHARE:.0%}: a worker stopped for all "
                          "of its time is a hung one, not a slow one (`tpufab sim unreachable` "
                          "rehearses that).")
    return share


class Stops:
    """One worker's stops so far: ``count`` signalled, ``seconds`` stopped (from the moment
    every process was seen stopped to SIGCONT: a SIGSTOP lands only once its process gets a
    CPU, which on a busy machine can take longer than the stop lasts, and a SIGCONT before
    that cancels it), ``began`` (monotonic) of the one under way, if any."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.count = 0
        self.seconds = 0.0
        self.began: float | None = None

    def signalled(self) -> None:
        with self.lock:   # counted before the signal: a look after it never sees fewer
            self.count += 1

    def begin(self) -> None:
        with self.lock:
            self.began = time.monotonic()

    def end(self) -> None:
        with self.lock:
            if self.began is not None:
                self.seconds += time.monotonic() - self.began
                self.began = None

    def read(self) -> tuple[int, float]:
        """(stops begun, seconds stopped), the stop under way counted up to now."""
        with self.lock:
            now = 0.0 if self.began is None else time.monotonic() - self.began
            return self.count, self.seconds + now


class Slowdown:
    """The thread that stops and continues one worker's processes."""

    def __init__(self, pool: Any, node_id: str, index: int, share: float, stops: Stops):
        self.pool, self.node_id, self.index, self.share = pool, node_id, index, share
        self.stops = stops
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name=f"tpufab-slow-w{index}",
                                       daemon=True)
        self.thread.start()

    def _pids(self) -> list[int]:
        return self.pool.pids(self.node_id, self.index)[1:]  # PID 1 keeps running

    def _signal(self, pids: list[int], sig: int) -> None:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)

    @staticmethod
    def _until_stopped(pids: list[int], deadline: float) -> None:
        """Until every one of ``pids`` is stopped (or gone), at most until ``deadline``."""
        left = list(pids)
        while left and time.monotonic() < deadline:
            left = [pid for pid in left if not _stopped(pid)]
            if left:
                time.sleep(0.001)

    def _run(self) -> None:
        pids, looked = self._pids(), time.monotonic()
        try:
            while not self.stop.is_set():
                if time.monotonic() - looked >= REFRESH:
                    pids, looked = self._pids(), time.monotonic()
                began = time.monotonic()
                self.stops.signalled()
                self._signal(pids, signal.SIGSTOP)
                self._until_stopped(pids, began + PERIOD)
                self.stops.begin()
                time.sleep(self.share * PERIOD)
                self._signal(pids, signal.SIGCONT)
                self.stops.end()
                self.stop.wait(max(0.0, PERIOD - (time.monotonic() - began)))
        finally:
            self._signal(self._pids(), signal.SIGCONT)
            self.stops.end()


def _stopped(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True   # gone
    return state in (b"T", b"t", b"Z", b"X")


_slowed: dict[tuple[int, str, int], Slowdown] = {}
_stops: dict[tuple[int, str, int], Stops] = {}   # kept across --by changes: counts only grow
_lock = threading.Lock()


def set_slow(pool: Any, node_id: str, index: int, share: float) -> None:
    """Slow worker ``index`` of ``node_id`` by ``share`` (0: not any more)."""
    key = (id(pool), node_id, index)
    with _lock:
        old = _slowed.pop(key, None)
        if old is not None:
            old.stop.set()
            old.thread.join(5)
        if share > 0:
            pool.require_init(node_id, index)
            _slowed[key] = Slowdown(pool, node_id, index, share,
                                    _stops.setdefault(key, Stops()))


def slowed(pool: Any, node_id: str) -> dict[int, float]:
    with _lock:
        return {i: s.share for (p, n, i), s in _slowed.items() if p == id(pool) and n == node_id}


def stops(pool: Any, node_id: str, index: int) -> tuple[int, float]:
    """Worker ``index``'s stops so far: (how many, seconds in all); (0, 0.0) if never slowed."""
    with _lock:
        found = _stops.get((id(pool), node_id, index))
    return (0, 0.0) if found is None else found.read()
