"""Live progress of a step over many workers: `setup: 12/64 done, 1 failed, 8.2 s`, and of
a transfer (bytes, speed, workers done).

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
            from tpufab.term.console import stderr

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


PROGRESS_AFTER = 0.5   # seconds: a quick transfer prints only its summary


class BytesProgress:
    """A transfer's progress bar: bytes, speed, workers done, time left (transfer.Progress).

    Shown on stderr, only on a terminal, and only once the transfer has taken
    ``PROGRESS_AFTER`` seconds (a quick one prints just its summary).
    """

    def __init__(self, what: str, *, stream: Any = None):
        self.what = what
        self.bar = None
        self.task = None
        self.total = 0
        self.workers = 0
        self.done: set[int] = set()
        self.moved = 0
        self._lock = threading.Lock()
        self._timer: threading.Timer | None = None
        self._tty = (stream or sys.stderr).isatty()

    def start(self, total_bytes: int, workers: int) -> None:
        self.total, self.workers = total_bytes, workers
        if total_bytes and self._tty:
            self._timer = threading.Timer(PROGRESS_AFTER, self._show)
            self._timer.daemon = True
            self._timer.start()

    def _show(self) -> None:
        from rich.progress import (
            BarColumn,
            DownloadColumn,
            Progress,
            TextColumn,
            TimeRemainingColumn,
            TransferSpeedColumn,
        )

        from tpufab.term.console import stderr

        with self._lock:
            if self._timer is None:
                return
            self.bar = Progress(TextColumn("{task.description}"), BarColumn(),
                                DownloadColumn(binary_units=True), TransferSpeedColumn(),
                                TextColumn("{task.fields[workers]}"), TimeRemainingColumn(),
                                console=stderr(), transient=True)
            self.task = self.bar.add_task(self.what, total=self.total, completed=self.moved,
                                          workers=self._workers_text())
            self.bar.start()

    def _workers_text(self) -> str:
        return f"{len(self.done)}/{self.workers} workers done"

    def advance(self, nbytes: int) -> None:
        with self._lock:
            self.moved += nbytes
            if self.bar is not None:
                self.bar.update(self.task, completed=self.moved)

    def worker_done(self, worker: int) -> None:
        with self._lock:
            self.done.add(worker)
            if self.bar is not None:
                self.bar.update(self.task, workers=self._workers_text())

    def stop(self) -> None:
        with self._lock:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            if self.bar is not None:
                self.bar.stop()
                self.bar = None
