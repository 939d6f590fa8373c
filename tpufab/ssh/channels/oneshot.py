"""The cold path of a run: the crew of threads that connects cold workers, and the one-shot
command that some of them then read on a plain exec channel (``remote/oneshot.sh``: no agent
started; Ctrl-C, a timeout or a dropped connection still stop it). docs/fanout.md.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import queue
import threading
import time
from collections.abc import Callable

from tpufab import quoting
from tpufab.ssh.channels.agent_protocol import Task, remote_file
from tpufab.ssh.transport import SETTLE


class Wake:
    """One event for both of a channel's buffers. paramiko clears a buffer's event when that
    buffer runs empty, which would lose a wake-up of the other stream; clearing is ours."""

    def __init__(self):
        self.event = threading.Event()

    def set(self) -> None:
        self.event.set()

    def clear(self) -> None:
        pass


@functools.cache
def oneshot_line() -> str:
    """The exec request of every one-shot channel (the same for all: built once)."""
    return quoting.command(quoting.Raw("exec"), "sh", "-c", remote_file("oneshot.sh").decode(),
                           "tpufab-oneshot")


def _waited(event: threading.Event, timeout: float | None) -> bool:
    return event.wait(timeout)


class Slots:
    """A counting semaphore waited on in C (``queue.SimpleQueue`` of tokens): ``threading``'s
    is Python around a Condition, a cost every cold worker paid twice."""

    def __init__(self, count: int):
        self.tokens: queue.SimpleQueue[None] = queue.SimpleQueue()
        for _ in range(max(1, count)):
            self.tokens.put(None)

    def __enter__(self) -> None:
        self.tokens.get()

    def __exit__(self, *exc) -> None:
        self.tokens.put(None)


class Crew:
    """The threads that connect a run's cold workers: at most ``size`` of them free to take the
    next worker at once (a handshake each). One that goes on to read a one-shot command
    (:class:`Plain`) first starts a replacement if workers still wait, and takes the next one
    itself once its command ended: a thread per worker only while their commands all run."""

    def __init__(self, work: Callable[[Task, Crew], None], size: int):
        self.work = work
        self.size = max(1, size)
        self.pending: collections.deque[Task] = collections.deque()
        self.lock = threading.Lock()
        self.free = 0  # threads not reading a command: taking workers, or about to

    def add(self, task: Task) -> None:
        self.pending.append(task)

    def start(self) -> None:
        for _ in range(min(self.size, len(self.pending))):
            self._spawn()

    def _spawn(self) -> None:
        with self.lock:
            self.free += 1
        try:
            threading.Thread(target=self._loop, daemon=True, name="tpufab-connect").start()
        except RuntimeError:  # no thread to be had: the others take the workers left
            with self.lock:
                self.free -= 1

    def _loop(self) -> None:
        while True:
            with self.lock:
                if not self.pending:
                    self.free -= 1
                    return
                task = self.pending.popleft()
            self.work(task, self)

    @contextlib.contextmanager
    def serving(self):
        """Around reading one command: a replacement takes the next workers meanwhile."""
        with self.lock:
            self.free -= 1
            more = bool(self.pending) and self.free < self.size
        if more:
            self._spawn()
        try:
            yield
        finally:
            with self.lock:
                self.free += 1


class Plain:
    """One command line on its own exec channel (``remote/oneshot.sh``), read by the thread that
    connected. Ctrl-C, a timeout or a failed sink send EOF, and the wrapper on the worker then
    stops the command's process group and every process carrying its marker (TERM, then KILL)."""

    def __init__(self, transport, task: Task, command: str, open_timeout: float):
        self.task = task
        self.stopped = False
        self.chan = transport.open_session(timeout=open_timeout)
        self.wake = Wake()
        self.chan.in_buffer.set_event(self.wake)
        self.chan.in_stderr_buffer.set_event(self.wake)
        # libssh2's channel reads the socket in this thread while it waits (no second thread)
        self.pause = getattr(self.chan, "drive", None) or _waited
        self.chan.exec_command(oneshot_line())
        # The command line on stdin (not on the wrapper's argv, which lives longer than it).
        lines = command.split("\n")
        self.chan.sendall(f"{len(lines)}\n{command}\n".encode("utf-8", "surrogateescape"))
        task.agent = self

    def kill(self, task: Task, signal_name: str = "SIGTERM") -> None:
        self.stopped = True
        try:
            self.chan.shutdown_write()  # EOF: the wrapper's watcher stops the command
        except Exception:  # noqa: BLE001 - the channel is gone: so is the wrapper's stdin
            pass

    def serve(self, timeout: float | None) -> None:
        chan, task, event = self.chan, self.task, self.wake.event
        deadline = None if timeout is None else time.monotonic() + timeout
        timed_out = False

        def left() -> float | None:
            """How long to wait now; past the deadline, the command is stopped (once)."""
            nonlocal timed_out
            if deadline is None or timed_out:
                return None
            wait = deadline - time.monotonic()
            if wait > 0:
                return wait
            timed_out = True
            self.kill(task)
            return None

        try:
            settle = getattr(chan, "settle", None)  # libssh2: a quick command ends in C
            if settle is not None:
                settle(SETTLE if timeout is None else min(SETTLE, timeout / 2))
            while True:
                self.pause(event, left())
                event.clear()
                while chan.recv_ready():
                    task.feed("stdout", chan.recv(1 << 18))
                while chan.recv_stderr_ready():
                    task.feed("stderr", chan.recv_stderr(1 << 18))
                if (chan.eof_received or chan.closed) and not chan.recv_ready() \
                        and not chan.recv_stderr_ready():
                    break
            # ``pause`` may come back before the status (libssh2's ``drive`` does after any
            # read, say the exit status read before the worker's close): only the deadline
            # stops the command, never an early return.
            while not chan.status_event.is_set():
                self.pause(chan.status_event, left())
            code = chan.exit_status
        except Exception as err:  # noqa: BLE001 - becomes this worker's result
            task.finish(None, f"connection lost ({type(err).__name__}: {err})")
            return
        finally:
            try:
                chan.close()
            except Exception:  # noqa: BLE001
                pass
        if code < 0:
            task.finish(None, "connection lost (the worker's sshd or session ended)")
            return
        signal = code - 128 if self.stopped and 128 < code < 192 else None
        task.finish(code, f"timed out after {timeout:g} s" if timed_out else None, signal)

    def close(self) -> None:
        try:
            self.chan.close()
        except Exception:  # noqa: BLE001
            pass
