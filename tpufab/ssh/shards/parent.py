"""Client processes of a fan-out: each owns a fixed block of workers (limits.shard_of).

A handshake costs the client a few ms of CPU under one GIL; past a hundred or so workers a
fan-out spreads its connections over ``processes`` client processes. This process keeps the
first block; every other block lives in a child (``python -m tpufab.ssh.shards.child``) that
runs an ordinary :class:`tpufab.ssh.fanout.Fanout` over its share and streams per-worker frames
back: complete, masked output lines and each worker's outcome. The parent feeds them into the
same per-worker tasks as its own workers, so results, sinks, masking and Ctrl-C look the same.

Messages on the child's stdin/stdout are frames (tpufab.ssh.shards.frames: a 4-byte length
and a pickle of plain data; Targets are frozen dataclasses; no live objects cross). The child
is in its own session (a terminal's Ctrl-C reaches the parent only, which stops the
children's commands itself) and exits,
closing every connection (so every agent kills what it runs), when its stdin ends: the
parent closed it, or the parent died.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from dataclasses import replace
from typing import Any

from tpufab.ssh.shards.frames import read_frame, write_frame

# A shard answers every message as it reads it; one that says nothing while a run waits on it
# is asked ("ping") after PING_AFTER seconds and given up after SILENT: stopped (which closes
# its connections, so the workers stop what it ran) and named in each worker's result, rather
# than blaming the worker or waiting forever (a frozen keeper or child process).
PING_AFTER = 2.0
SILENT = 10.0


class Shard:
    """One child process and the parent's tasks it serves."""

    what = "the fan-out process"  # how a lost child is named in the workers' results
    heard = 0.0                   # when it last said anything (time.monotonic())
    pinged = False                # asked whether it lives since it last said anything
    asked = 0                     # the number of the last ping sent
    answered = 0                  # the number of the last ping it answered
    ending: str | None = None     # why it ends, once known: its tasks' result, whatever follows

    def __init__(self, index: int, targets: list, fanout):
        self.index = index
        self.workers = {t.worker for t in targets}
        self.fanout = fanout
        self.tasks: dict[tuple[int, int], Any] = {}
        self.lock = threading.Lock()
        self.send_lock = threading.Lock()
        # cwd "/": `-m` puts the working directory on sys.path, where a user's project may
        # hold modules of any name; so paths cross as absolute ones.
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tpufab.ssh.shards.child"], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, start_new_session=True,
            cwd="/", env={**os.environ, "PYTHONWARNINGS": "ignore"})
        self.inbox, self.outbox = self.proc.stdout, self.proc.stdin
        targets = [replace(t, key_filename=os.path.abspath(os.path.expanduser(t.key_filename)))
                   if t.key_filename else t for t in targets]
        known = fanout.known_hosts
        self._send(("init", {
            "targets": targets, "known_hosts": str(known.path.absolute()),
            "forget_hint": known.forget_hint,
            "concurrency": fanout.concurrency, "connect_attempts": fanout.connect_attempts,
            "retry_wait": fanout.retry_wait, "python": fanout.python,
            "kill_grace": fanout.kill_grace, "ssh_transport": fanout.ssh_transport,
        }))
        self.alive = True
        self.heard = time.monotonic()
        self.reader = threading.Thread(target=self._read_loop, daemon=True,
                                       name=f"tpufab-shard{index}")
        self.reader.start()

    @property
    def name(self) -> str:
        """How the workers' results name it: ``the fan-out process 1 (pid 4242)``."""
        return f"{self.what} {self.index} (pid {self.proc.pid})"

    def _send(self, message: tuple) -> None:
        write_frame(self.outbox, self.send_lock, message)

    def run(self, tasks: list, command, request: dict, stdin: bytes | None, masked: list,
            timeout: float | None, one_shot: bool, put, *,
            connect_timeout: float | None = None) -> None:
        """Start ``tasks`` (parent-side tasks of this shard's workers) as one run, connecting
        within ``connect_timeout`` (None: the fan-out's)."""
        run_id = tasks[0].id
        proxy = _ShardProxy(self, run_id)
        with self.lock:
            if not self.tasks:   # quiet between runs is no silence: the clock starts now
                self.heard, self.pinged = time.monotonic(), False
            for task in tasks:
                task.agent = proxy
                self.tasks[(run_id, task.worker)] = task
        try:
            self._send(("run", run_id, {
                "workers": [t.worker for t in tasks], "command": command,
                "env": request.get("env"), "stdin": stdin, "timeout": timeout,
                "cwd": request.get("cwd"), "one_shot": one_shot, "put": put,
                "secrets": [s.decode("utf-8", "surrogateescape") for s in masked],
                "connect_timeout": self.fanout.connect_timeout if connect_timeout is None
                else connect_timeout,
            }))
        except OSError as err:
            self._lost(f"{self.what} {self.index} is gone ({err})")

    def interrupt(self, tasks: list) -> None:
        """Ctrl-C: the child stops the run on its workers and waits for them to confirm."""
        if tasks:
            self._try_send(("interrupt", tasks[0].id))

    def kill(self, run_id: int, worker: int, signal_name: str) -> None:
        self._try_send(("kill", run_id, worker, signal_name))

    def close_worker(self, worker: int) -> None:
        self._try_send(("close_worker", worker))

    def set_in_use(self, used: bool) -> None:
        self._try_send(("use", used))

    def _try_send(self, message: tuple) -> None:
        try:
            self._send(message)
        except (OSError, ValueError):
            pass

    def watch(self) -> None:
        """About once a second while a run waits on this shard: ask it whether it lives once
        it has been quiet for PING_AFTER seconds, give it up after SILENT."""
        if not self.alive:
            return
        with self.lock:
            if not self.tasks:
                return
        quiet = time.monotonic() - self.heard
        if quiet >= SILENT:
            self.give_up(f"did not answer for {quiet:.0f} s")
        elif quiet >= PING_AFTER and not self.pinged:
            self.ping()

    def ping(self) -> int:
        """Ask it to answer at once (its answer, like anything it says, sets ``heard``): the
        ping's number, which ``answered`` reaches once this very ping is answered (something
        it said before, still in the pipe, is no answer to it)."""
        self.pinged = True
        with self.lock:
            self.asked += 1
            number = self.asked
        self._try_send(("ping", number))
        return number

    def give_up(self, why: str, *, then: str = "; run the command again") -> None:
        """Stop the process (its connections close, and with them what it ran on the
        workers: an agent kills its commands when its channel closes) and fail its tasks
        with one sentence naming it: ``NAME WHY; tpufab stopped it, ...THEN``."""
        self.ending = f"{self.name} {why}; tpufab stopped it, which stops the command on " \
            f"the worker{then}"
        self._stop_process()
        self._lost(self.ending, said=True)

    def _stop_process(self) -> None:
        self.alive = False
        try:
            self.proc.kill()
        except OSError:
            pass

    def _read_loop(self) -> None:
        stream = self.inbox
        try:
            while (message := read_frame(stream)) is not None:
                self.heard, self.pinged = time.monotonic(), False
                self._dispatch(message)
        except Exception as err:  # noqa: BLE001 - the child's tasks get the reason
            self._lost(f"{self.what} {self.index} failed ({type(err).__name__}: {err})")
            return
        self._lost(f"{self.what} {self.index} exited")

    def _dispatch(self, message: tuple) -> None:
        kind = message[0]
        if kind == "lines":
            _, run_id, worker, stream, data = message
            task = self.tasks.get((run_id, worker))
            if task is not None:
                task.feed(stream, data)
        elif kind == "done":
            _, run_id, worker, exit_code, error, signal, duration = message
            with self.lock:
                task = self.tasks.pop((run_id, worker), None)
            if task is not None:
                task.finish(exit_code, error, signal)
                task.result.duration = duration
        elif kind == "pong":
            with self.lock:
                self.answered = max(self.answered, message[1])
        elif kind == "retry":
            _, worker, attempt, error = message
            if self.fanout.on_retry is not None:
                self.fanout.on_retry(self.fanout.targets[worker], attempt, error)

    def _lost(self, reason: str, *, said: bool = False) -> None:
        """Fail every task still waiting on this shard: ``connection lost (REASON)``, or the
        reason as it is when ``said`` (a whole sentence already); why it ends, once known,
        whatever its reader then meets (the end of its pipe)."""
        if self.ending:
            reason, said = self.ending, True
        self.alive = False
        with self.lock:
            pending = list(self.tasks.values())
            self.tasks.clear()
        for task in pending:
            task.finish(None, reason if said else f"connection lost ({reason})")

    def close(self) -> None:
        self.alive = False
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(self.fanout.kill_grace + 5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.reader.join(5)


class _ShardProxy:
    """Stands in for a task's agent: kills go to the child that runs it."""

    def __init__(self, shard: Shard, run_id: int):
        self.shard, self.run_id = shard, run_id

    def kill(self, task, signal_name: str = "SIGTERM") -> None:
        self.shard.kill(self.run_id, task.worker, signal_name)
