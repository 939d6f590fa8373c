"""Live progress of a step over many workers: `setup: 12/64 done, 1 failed, 8.2 s`.

A sink for a fan-out (it is told as each worker finishes), shown on stderr only when stderr
is a terminal (a transient rich status line), so logs and pipes stay clean.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import Any


class WorkerProgress:
    def __init__(self, what: str, total: int | None = None, *, stream: Any = None):
        self.what, self.total = what, total
        self.done_count = self.failed = 0
        self.began = time.monotonic()
        self._lock = threading.Lock()
        stream = stream or sys.stderr
        self._status = None
        if stream.isatty():
            from tpufab.console import stderr

            self._status = stderr().status(self.text())

    def text(self) -> str:
        failed = f", {self.failed} failed" if self.failed else ""
        of = f"/{self.total}" if self.total else ""
        return (f"{self.what}: {self.done_count}{of} done{failed}, "
                f"{time.monotonic() - self.began:.1f} s")

    def lines(self, worker: int, stream: str, data: bytes) -> None:
        pass

    def done(self, result: Any) -> None:
        with self._lock:
            self.done_count += 1
            self.failed += not result.ok
            if self._status is not None:
                self._status.update(self.text())

    def __enter__(self) -> WorkerProgress:
        if self._status is not None:
            self._status.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._status is not None:
            self._status.stop()
