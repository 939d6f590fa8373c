"""Run commands on many workers at once over paramiko, with one result per worker.

One paramiko Transport per worker, on a socket we open ourselves (:func:`open_socket`, the
seam a jump host would replace), cheapest key exchange first. Each connection starts one
small agent (``tpufab/remote/agent.py``) on one channel the first time a command needs it,
and every command is a frame on that channel: no new sshd session per command, stdout/stderr
read as they arrive (no polling), secrets sent on stdin, and every remote process killed
when a command is cancelled or the channel closes. A one-shot command on a fresh connection
(``run(one_shot=True)``, what ``exec`` does) runs on a plain exec channel instead, through
``remote/oneshot.sh``, which still stops everything on Ctrl-C, timeout or disconnect. Large
pods spread their connections over client processes (:mod:`tpufab.ssh.fanshard`). See
docs/fanout.md.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import functools
import hashlib
import io
import os
import queue
import socket
import statistics
import struct
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import IO, TYPE_CHECKING, Protocol

from tpufab import nodeset, quoting
from tpufab.errors import TpufabError
from tpufab.quoting import Secret
from tpufab.ssh.transport import (
    SETTLE,
    ConnectError,
    KeyUnusable,
    Libssh2Connection,
    WorkerSilent,
    libssh2_auth_error,
    libssh2_available,
    libssh2_connect,
    libssh2_timeout,
    libssh2_transient,
    quiet_paramiko,
)
from tpufab.term.terminal import Lines, colors_for, neutralise

if TYPE_CHECKING:
    from tpufab.config import Jump

HEADER = struct.Struct(">BII")
DEFAULT_CONCURRENCY = 64
SPOOL_BYTES = 256 * 1024  # per worker and stream, then spill to a temp file
KILL_GRACE = 2.0
# How long past a command's timeout, the kill grace and a connect the worker's answer may take
# before the worker counts as not answering (the agent's SIGKILL is answered within ms).
ANSWER_MARGIN = 2.0
LINE_LIMIT = 1 << 20  # a partial line longer than this is passed on without waiting for "\n"
DETAIL_ROWS = 16
IDLE_TICK = 2.0  # s: how often an idle connection's paramiko thread wakes up  # per-worker rows in a failure's details; above, folded by outcome


# ---------------------------------------------------------------------------------------------
# Records
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Target:
    """Where one worker is reached. ``host_key_alias`` names its pinned key (hostkeys.alias)."""

    worker: int
    host: str
    user: str
    key_filename: str | None = None
    port: int = 22
    host_key_alias: str | None = None
    jump: Jump | None = None  # reached through this bastion (tpufab.ssh.jump), else dialled directly
    auth_hint: str | None = None  # what a refused login means here (e.g. OS Login's roles)

    @property
    def key_alias(self) -> str:
        return self.host_key_alias or (self.host if self.port == 22 else f"[{self.host}]:{self.port}")


class FanoutError(TpufabError):
    """One or more workers failed; ``.result`` holds every worker's result, not only the
    failures (Fabric's GroupException; the API's ``tpufab.PodError`` is this class)."""

    def __init__(self, message: str, result: GroupResult, *, details: str | None = None,
                 exit_code: int | None = None):
        super().__init__(message, details=details, exit_code=exit_code)
        self.result = result


class FanoutInterrupted(FanoutError):
    """Ctrl-C: the remote commands were stopped on every worker."""

    exit_code = 130


class Output:
    """One stream of one worker: bytes spooled in memory up to a cap, then to a temp file. The
    spool and its hash are made by the first write (most workers' stderr stays empty)."""

    __slots__ = ("_spool", "_hash", "size", "_max")

    def __init__(self, max_memory: int = SPOOL_BYTES):
        self._spool: tempfile.SpooledTemporaryFile | None = None
        self._hash = None
        self._max = max_memory
        self.size = 0

    def write(self, data: bytes) -> None:
        if self._spool is None:
            self._spool = tempfile.SpooledTemporaryFile(max_size=self._max)
            self._hash = hashlib.sha256()
        self._spool.write(data)
        self._hash.update(data)
        self.size += len(data)

    @property
    def digest(self) -> str:
        return (self._hash or hashlib.sha256()).hexdigest()

    def chunks(self, size: int = 1 << 16) -> Iterable[bytes]:
        if self._spool is None:
            return
        self._spool.seek(0)
        while chunk := self._spool.read(size):
            yield chunk
        self._spool.seek(0, os.SEEK_END)

    def read(self) -> bytes:
        return b"".join(self.chunks())

    def close(self) -> None:
        if self._spool is not None:
            self._spool.close()


class WorkerResult:
    """What happened on one worker: exit code, output, duration, or the connection error."""

    __slots__ = ("worker", "exit_code", "duration", "error", "signal", "stdout_output", "stderr_output")

    def __init__(self, worker: int, exit_code: int | None = None, duration: float = 0.0,
                 error: str | None = None, signal: int | None = None,
                 stdout: Output | None = None, stderr: Output | None = None):
        self.worker = worker
        self.exit_code = exit_code
        self.duration = duration
        self.error = error
        self.signal = signal
        self.stdout_output = stdout or Output()
        self.stderr_output = stderr or Output()

    @property
    def ok(self) -> bool:
        return self.error is None and self.exit_code == 0

    @property
    def exited(self) -> int | None:
        """The exit code, as Fabric's Result calls it (None when the worker was not reached)."""
        return self.exit_code

    @property
    def stdout_bytes(self) -> bytes:
        return self.stdout_output.read()

    @property
    def stdout(self) -> str:
        return self.stdout_bytes.decode("utf-8", "replace")

    @property
    def stderr(self) -> str:
        return self.stderr_output.read().decode("utf-8", "replace")

    @property
    def outcome(self) -> str:
        """``exit 0`` / ``exit 1`` / ``timed out after 5s`` / ``connection refused``..."""
        if self.error:
            return self.error
        return f"exit {self.exit_code}"

    def __repr__(self) -> str:
        return f"<WorkerResult w{self.worker} {self.outcome} {self.duration * 1e3:.1f} ms>"


class GroupResult(Mapping[int, WorkerResult]):
    """One :class:`WorkerResult` per selected worker, in worker order (Fabric's GroupResult;
    also the API's ``tpufab.PodResult``): ``.succeeded`` and ``.failed`` are the same mapping
    split by outcome."""

    def __init__(self, results: Mapping[int, WorkerResult], command: str = ""):
        self._results = dict(sorted(results.items()))
        self.command = command

    def __getitem__(self, worker: int) -> WorkerResult:
        return self._results[worker]

    def __iter__(self):
        return iter(self._results)

    def __len__(self) -> int:
        return len(self._results)

    @property
    def succeeded(self) -> GroupResult:
        """The workers whose command succeeded: ``{worker: result}``."""
        return GroupResult({w: r for w, r in self._results.items() if r.ok}, self.command)

    @property
    def failed(self) -> GroupResult:
        """The workers whose command failed (or that were not reached): ``{worker: result}``."""
        return GroupResult({w: r for w, r in self._results.items() if not r.ok}, self.command)

    @property
    def ok(self) -> bool:
        return not self.failed

    @property
    def exit_code(self) -> int:
        """0 if every worker succeeded; the shared exit code if all failures agree; else 1."""
        codes = {r.exit_code for r in self.failed.values()}
        if not codes:
            return 0
        if len(codes) == 1 and None not in codes:
            return codes.pop() or 1
        return 1

    def summary(self) -> str:
        """``w[0-2] exit 0; w3 exit 1; w7 connection refused``."""
        groups: dict[str, list[int]] = {}
        for r in self._results.values():
            groups.setdefault(r.outcome, []).append(r.worker)
        return "; ".join(f"{nodeset.fold(ws)} {outcome}" for outcome, ws in
                         sorted(groups.items(), key=lambda kv: kv[1][0]))

    def details(self) -> str:
        """One row per worker; past ``DETAIL_ROWS`` workers, one row per distinct outcome and
        last stderr line, under the folded set of its workers (median duration)."""
        rows = []
        for r in self._results.values():
            tail = ""
            if not r.ok and r.error is None:
                err = r.stderr.strip().splitlines()
                tail = f"  {err[-1][:200]}" if err else ""
            rows.append((r.worker, r.outcome, r.duration, tail))
        if len(rows) <= DETAIL_ROWS:
            return "\n".join(f"  {nodeset.label(w):>4}  {outcome:<28} {d * 1e3:8.1f} ms{tail}"
                             for w, outcome, d, tail in rows)
        groups: dict[tuple[str, str], list[tuple[int, float]]] = {}
        for w, outcome, d, tail in rows:
            groups.setdefault((outcome, tail), []).append((w, d))
        lines = []
        for (outcome, tail), members in sorted(groups.items(), key=lambda kv: kv[1][0][0]):
            took = statistics.median(d for _w, d in members)
            lines.append(f"  {nodeset.fold(w for w, _d in members)}  {outcome:<28} "
                         f"{took * 1e3:8.1f} ms{' median' if len(members) > 1 else ''}{tail}")
        return "\n".join(lines)

    def check(self) -> GroupResult:
        """Raise :class:`FanoutError` naming every failing worker; else return self."""
        failed = self.failed
        if failed:
            raise FanoutError(
                f"{self._what()} failed on {len(failed)} of {len(self)} workers: "
                f"{failed.summary()}.",
                self, details=self.details(), exit_code=self.exit_code,
            )
        return self

    def _what(self) -> str:
        cmd = self.command.strip().splitlines()[0] if self.command.strip() else "The command"
        if len(cmd) > 60:
            cmd = cmd[:57] + "..."
        return f"`{cmd}`" if self.command.strip() else cmd

    def close(self) -> None:
        for r in self._results.values():
            r.stdout_output.close()
            r.stderr_output.close()


# ---------------------------------------------------------------------------------------------
# Output views
# ---------------------------------------------------------------------------------------------


class OutputSink(Protocol):
    """Receives complete lines (masked, each ending in ``\\n``) as they arrive."""

    def lines(self, worker: int, stream: str, data: bytes) -> None: ...

    def done(self, result: WorkerResult) -> None: ...


_COLORS = [36, 33, 35, 32, 34, 31, 96, 93, 95, 92, 94, 91]


class _BytesTo:
    """Write bytes to a binary stream, a text stream's buffer, or a plain text stream."""

    def __init__(self, stream: IO):
        buffer = getattr(stream, "buffer", None)
        self.stream = buffer if buffer is not None else stream
        self.text = buffer is None and isinstance(stream, io.TextIOBase)

    def write(self, data: bytes) -> None:
        self.stream.write(data.decode("utf-8", "replace") if self.text else data)

    def flush(self) -> None:
        self.stream.flush()


def _binary(stream: IO) -> _BytesTo:
    return _BytesTo(stream)


class LiveView:
    """Lines as they arrive, each prefixed ``w3 │``, colored per worker, never split mid-line.

    Worker output is shown through :func:`tpufab.term.terminal.neutralise`: control sequences
    are made visible; the workers' own colours pass only with ``worker_colors``.
    """

    def __init__(self, out: IO | None = None, err: IO | None = None, *, color: bool | None = None,
                 workers: Iterable[int] = (), worker_colors: bool = False):
        self.out = out if out is not None else sys.stdout
        self.err = err if err is not None else sys.stderr
        self.color = colors_for(self.out, color)
        self.worker_colors = worker_colors
        self.width = max((len(nodeset.label(w)) for w in workers), default=2)
        self._prefixes: dict[int, bytes] = {}
        self._lock = threading.Lock()

    def prefix(self, worker: int) -> bytes:
        found = self._prefixes.get(worker)
        if found is None:
            text = f"{nodeset.label(worker):<{self.width}} │ "
            if self.color:
                text = f"\x1b[{_COLORS[worker % len(_COLORS)]}m{text}\x1b[0m"
            found = self._prefixes[worker] = text.encode()
        return found

    def lines(self, worker: int, stream: str, data: bytes) -> None:
        prefix = self.prefix(worker)
        data = neutralise(data, color=self.worker_colors)
        # One replace per chunk instead of a Python loop per line.
        rendered = prefix + data[:-1].replace(b"\n", b"\n" + prefix) + b"\n"
        target = self.out if stream == "stdout" else self.err
        with self._lock:
            out = _binary(target)
            out.write(rendered)
            out.flush()

    def done(self, result: WorkerResult) -> None:
        if result.error:
            with self._lock:
                out = _binary(self.err)
                out.write(self.prefix(result.worker)
                          + neutralise(f"{result.error}\n".encode()))
                out.flush()


class LineCallback:
    """Adapts ``on_line(worker, stream, line)`` (str, without newline) to an OutputSink."""

    def __init__(self, callback: Callable[[int, str, str], None]):
        self.callback = callback

    def lines(self, worker: int, stream: str, data: bytes) -> None:
        for line in data.decode("utf-8", "replace").split("\n")[:-1]:
            self.callback(worker, stream, line)

    def done(self, result: WorkerResult) -> None:
        pass


class Tee:
    def __init__(self, sinks: Sequence[OutputSink]):
        self.sinks = sinks

    def lines(self, worker, stream, data):
        for sink in self.sinks:
            sink.lines(worker, stream, data)

    def done(self, result):
        for sink in self.sinks:
            sink.done(result)


def print_gathered(result: GroupResult, out: IO | None = None, err: IO | None = None, *,
                   color: bool | None = None, worker_colors: bool = False) -> None:
    """``clush -b``: each distinct output once, under the folded set of workers, by exit code.

    Reads from the spooled outputs line by line (a line at most ``terminal.LINE_LIMIT``), so
    memory stays bounded whatever the size; shown through ``terminal.neutralise``.
    """
    out = out if out is not None else sys.stdout
    err = err if err is not None else sys.stderr
    use_color = colors_for(out, color)
    for stream_name, target in (("stdout", out), ("stderr", err)):
        groups: dict[tuple, list[WorkerResult]] = {}
        for r in result.values():
            output = r.stdout_output if stream_name == "stdout" else r.stderr_output
            if r.error and stream_name == "stdout":
                continue
            if output.size == 0 and not (stream_name == "stderr" and r.error):
                continue
            key = (r.error or "", r.exit_code if r.exit_code is not None else -1, output.digest)
            groups.setdefault(key, []).append(r)
        binary = _binary(target)
        for (error, _code, _digest), members in sorted(
            groups.items(), key=lambda kv: (kv[0][0] != "", kv[0][1], kv[1][0].worker)
        ):
            header = f"{nodeset.fold(m.worker for m in members)} ({members[0].outcome})"
            rule = "-" * max(16, len(header))
            text = f"{rule}\n{header}\n{rule}\n"
            if use_color:
                text = f"\x1b[1;{32 if members[0].ok else 31}m{text}\x1b[0m"
            binary.write(text.encode())
            body = members[0].stdout_output if stream_name == "stdout" else members[0].stderr_output
            cutter = Lines()
            for chunk in body.chunks():
                for run in cutter.feed(chunk):
                    binary.write(neutralise(run, color=worker_colors))
            for run in cutter.end():
                binary.write(neutralise(run, color=worker_colors))
            if error and stream_name == "stderr":
                binary.write(neutralise(f"{error}\n".encode()))
        binary.flush()


# ---------------------------------------------------------------------------------------------
# Client side of the worker agent
# ---------------------------------------------------------------------------------------------


def _remote_file(name: str) -> bytes:
    """A worker-side file shipped with tpufab (``tpufab/remote/NAME``) as the one seam ships
    it (``RemoteFile.bundled``: read once, a script standing alone)."""
    from tpufab.ssh.remote_files import RemoteFile

    return RemoteFile.bundled(name).data


_LOADER = "import sys;exec(compile(sys.stdin.buffer.read({size}),'tpufab-agent','exec'))"


def _fields(items: Iterable[tuple[str, str]]) -> bytes:
    """NUL-separated tagged fields (the agent's request format); NUL itself is refused."""
    parts = []
    for tag, value in items:
        if "\0" in value:
            raise TpufabError("A command, argument or environment value contains a NUL byte.")
        parts.append(tag + value)
    return "\0".join(parts).encode("utf-8", "surrogateescape")


def _encode_request(request: dict) -> bytes:
    items: list[tuple[str, str]] = []
    if "argv" in request:
        items += [("a", arg) for arg in request["argv"]]
    else:
        items.append(("c", request["command"]))
    items += [("e", f"{name}={value}") for name, value in (request.get("env") or {}).items()]
    if request.get("timeout") is not None:
        items.append(("t", repr(float(request["timeout"]))))
    if request.get("cwd"):
        items.append(("d", request["cwd"]))
    if request.get("stdin"):
        items.append(("s", ""))
    return _fields(items)


class _Task:
    """Client-side state of one command on one worker."""

    def __init__(self, task_id: int, worker: int, sink: OutputSink | None, secrets: list[bytes],
                 capture: bool = True):
        self.id = task_id
        self.worker = worker
        self.sink = sink
        self.exact = getattr(sink, "exact", False)  # takes a last line without its newline as is
        self.secrets = secrets
        self.capture = capture
        self.result = WorkerResult(worker)
        self.partial = {"stdout": bytearray(), "stderr": bytearray()}
        self.done = threading.Event()
        self.started = time.perf_counter()
        self.on_done: Callable[[_Task], None] | None = None
        self.timeout: float | None = None
        self.sink_error: str | None = None
        self.agent: _Agent | None = None

    def feed(self, stream: str, data: bytes) -> None:
        buffered = self.partial[stream]
        cut = data.rfind(b"\n")
        if cut < 0:
            buffered += data
            if len(buffered) > LINE_LIMIT:  # a giant "line" (binary data): pass it on in pieces
                self._emit(stream, bytes(buffered))
                buffered.clear()
            return
        if buffered:
            buffered += data[: cut + 1]
            complete = bytes(buffered)
            buffered.clear()
        else:
            complete = data[: cut + 1]
        buffered += data[cut + 1:]
        self._emit(stream, complete)

    def _emit(self, stream: str, data: bytes) -> None:
        if self.secrets:
            data = quoting.mask_bytes(data, self.secrets)
        if self.capture:
            (self.result.stdout_output if stream == "stdout" else self.result.stderr_output).write(data)
        if self.sink is not None:
            try:
                self.sink.lines(self.worker, stream,
                                data if self.exact or data.endswith(b"\n") else data + b"\n")
            except Exception as err:  # noqa: BLE001 - e.g. `tpufab exec ... | head` closed stdout
                self._sink_failed(err)

    def _sink_failed(self, err: Exception) -> None:
        """Nobody can see this output any more: stop the command rather than run blind."""
        self.sink = None
        self.sink_error = f"stopped: writing its output failed ({type(err).__name__}: {err})"
        if self.agent is not None:
            self.agent.kill(self)

    def finish(self, exit_code: int | None = None, error: str | None = None,
               signal: int | None = None) -> None:
        if self.done.is_set():
            return
        for stream in ("stdout", "stderr"):
            if self.partial[stream]:
                rest = bytes(self.partial[stream])
                self.partial[stream].clear()
                self._emit(stream, rest)
        self.result.exit_code = exit_code
        self.result.error = error or self.sink_error
        self.result.signal = signal
        self.result.duration = time.perf_counter() - self.started
        if self.sink is not None:
            try:
                self.sink.done(self.result)
            except Exception:  # noqa: BLE001 - the result carries what happened
                pass
        self.done.set()
        if self.on_done is not None:
            self.on_done(self)


class _Agent:
    """One agent process on one SSH channel; commands are frames on it."""

    def __init__(self, transport, worker: int, python: str, open_timeout: float):
        source = _remote_file("agent.py")
        self.worker = worker
        self.tasks: dict[int, _Task] = {}
        self.lock = threading.Lock()
        self.send_lock = threading.Lock()
        self.closed = False
        self.hello: dict | None = None
        self.chan = transport.open_session(timeout=open_timeout)
        loader = _LOADER.format(size=len(source))
        self.chan.exec_command(quoting.command(quoting.Raw("exec"), python, "-I", "-S", "-c", loader))
        # Pipelined: the source goes out right behind the exec request; no round trip waited.
        self.chan.sendall(source)
        self.reader = threading.Thread(target=self._read_loop, name=f"tpufab-w{worker}", daemon=True)
        self.reader.start()

    # -- sending -------------------------------------------------------------------------
    def _send(self, kind: bytes, task_id: int, payload: bytes = b"") -> None:
        frame = HEADER.pack(kind[0], task_id, len(payload)) + payload
        with self.send_lock:
            self.chan.sendall(frame)

    def submit(self, task: _Task, request: dict, stdin: bytes | None = None,
               put_data: bytes | None = None) -> None:
        with self.lock:
            if self.closed:
                raise ConnectError(f"The connection to worker {self.worker} is closed.")
            self.tasks[task.id] = task
        task.agent = self
        if put_data is not None:
            head = _fields([("p", request["path"]), ("m", str(request["mode"]))])
            self._send(b"P", task.id, head + b"\0\0" + put_data)
            return
        self._send(b"R", task.id, _encode_request(request))
        if stdin is not None:
            for start in range(0, len(stdin), 1 << 18):
                self._send(b"I", task.id, stdin[start:start + (1 << 18)])
            self._send(b"E", task.id)

    def kill(self, task: _Task, signal_name: str = "SIGTERM") -> None:
        try:
            self._send(b"K", task.id, signal_name.encode())
        except Exception:  # noqa: BLE001 - the channel is gone; the agent kills on EOF
            pass

    # -- receiving -----------------------------------------------------------------------
    def _read_loop(self) -> None:
        buf = bytearray()
        chan = self.chan
        size = HEADER.size
        try:
            while True:
                data = chan.recv(1 << 18)
                if not data:
                    break
                buf += data
                pos = 0
                end = len(buf)
                while end - pos >= size:
                    kind, task_id, length = HEADER.unpack_from(buf, pos)
                    if end - pos - size < length:
                        break
                    payload = bytes(buf[pos + size: pos + size + length])
                    pos += size + length
                    self._dispatch(kind, task_id, payload)
                del buf[:pos]
        except Exception as err:  # noqa: BLE001 - any failure ends the agent; tasks get the error
            self.close()  # the agent sees EOF and stops whatever still runs
            self._close(f"connection lost ({type(err).__name__}: {err})")
            return
        self._close(None)

    def _dispatch(self, kind: int, task_id: int, payload: bytes) -> None:
        if kind == 79:  # O
            task = self.tasks.get(task_id)
            if task:
                task.feed("stdout", payload)
        elif kind == 88:  # X
            task = self.tasks.get(task_id)
            if task:
                task.feed("stderr", payload)
        elif kind == 68:  # D: "<exit code> <signal> <timed out>"
            code, sig, timed_out = (int(x) for x in payload.split())
            with self.lock:
                task = self.tasks.pop(task_id, None)
            if task:
                error = f"timed out after {task.timeout:g} s" if timed_out else None
                task.finish(code, error, sig or None)
        elif kind == 70:  # F
            with self.lock:
                task = self.tasks.pop(task_id, None)
            if task:
                task.finish(None, f"could not start: {payload.decode('utf-8', 'replace')}")
        elif kind == 72:  # H: "<pid> <python version>"
            pid, version = payload.decode().split()
            self.hello = {"pid": int(pid), "python": version}

    def _close(self, reason: str | None) -> None:
        with self.lock:
            self.closed = True
            pending = list(self.tasks.values())
            self.tasks.clear()
        if not pending:
            return
        if reason is None:
            stderr = b""
            try:
                while self.chan.recv_stderr_ready():
                    stderr += self.chan.recv_stderr(65536)
            except Exception:  # noqa: BLE001
                pass
            text = stderr.decode("utf-8", "replace").strip().splitlines()
            reason = ("connection lost (the worker's sshd or session ended)"
                      + (f": {text[-1]}" if text else ""))
            if "not found" in reason and "python" in reason:
                reason += " (tpufab needs python3 on every worker)"
        for task in pending:
            task.finish(None, reason)

    @property
    def alive(self) -> bool:
        return not self.closed and not self.chan.closed

    def close(self) -> None:
        try:
            self.chan.close()
        except Exception:  # noqa: BLE001
            pass


# ---------------------------------------------------------------------------------------------
# The one-shot path: one command on a plain exec channel, no agent started
# ---------------------------------------------------------------------------------------------


class _Wake:
    """One event for both of a channel's buffers. paramiko clears a buffer's event when that
    buffer runs empty, which would lose a wake-up of the other stream; clearing is ours."""

    def __init__(self):
        self.event = threading.Event()

    def set(self) -> None:
        self.event.set()

    def clear(self) -> None:
        pass


@functools.cache
def _oneshot_line() -> str:
    """The exec request of every one-shot channel (the same for all: built once)."""
    return quoting.command(quoting.Raw("exec"), "sh", "-c", _remote_file("oneshot.sh").decode(),
                           "tpufab-oneshot")


def _waited(event: threading.Event, timeout: float | None) -> bool:
    return event.wait(timeout)


class _Slots:
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


class _Crew:
    """The threads that connect a run's cold workers: at most ``size`` of them free to take the
    next worker at once (a handshake each). One that goes on to read a one-shot command
    (:class:`_Plain`) first starts a replacement if workers still wait, and takes the next one
    itself once its command ended: a thread per worker only while their commands all run."""

    def __init__(self, work: Callable[[_Task, _Crew], None], size: int):
        self.work = work
        self.size = max(1, size)
        self.pending: collections.deque[_Task] = collections.deque()
        self.lock = threading.Lock()
        self.free = 0  # threads not reading a command: taking workers, or about to

    def add(self, task: _Task) -> None:
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


class _Plain:
    """One command line on its own exec channel (``remote/oneshot.sh``), read by the thread that
    connected. Ctrl-C, a timeout or a failed sink send EOF, and the wrapper on the worker then
    stops the command's process group and every process carrying its marker (TERM, then KILL)."""

    def __init__(self, transport, task: _Task, command: str, open_timeout: float):
        self.task = task
        self.stopped = False
        self.chan = transport.open_session(timeout=open_timeout)
        self.wake = _Wake()
        self.chan.in_buffer.set_event(self.wake)
        self.chan.in_stderr_buffer.set_event(self.wake)
        # libssh2's channel reads the socket in this thread while it waits (no second thread)
        self.pause = getattr(self.chan, "drive", None) or _waited
        self.chan.exec_command(_oneshot_line())
        # The command line on stdin (not on the wrapper's argv, which lives longer than it).
        lines = command.split("\n")
        self.chan.sendall(f"{len(lines)}\n{command}\n".encode("utf-8", "surrogateescape"))
        task.agent = self

    def kill(self, task: _Task, signal_name: str = "SIGTERM") -> None:
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


# ---------------------------------------------------------------------------------------------
# Connections
# ---------------------------------------------------------------------------------------------


class _QuickAckSocket(socket.socket):
    """A TCP socket that re-arms TCP_QUICKACK after every read.

    sshd writes small packets without TCP_NODELAY for non-tty sessions; with the client's
    delayed ACK that costs 40 ms at the first channel open (Nagle waiting on an unacked
    packet). Acking at once removes the stall.
    """

    def recv(self, bufsize: int, flags: int = 0) -> bytes:  # type: ignore[override]
        data = super().recv(bufsize, flags)
        try:
            self.setsockopt(socket.IPPROTO_TCP, socket.TCP_QUICKACK, 1)
        except OSError:
            pass
        return data


def _addresses(host: str, port: int) -> list[tuple]:
    """Where to dial ``host``: an IP address as it is (a pod's workers: no resolver call per
    worker), a name through getaddrinfo."""
    for family in (socket.AF_INET, socket.AF_INET6):
        try:
            socket.inet_pton(family, host)
        except OSError:
            continue
        return [(family, socket.SOCK_STREAM, socket.IPPROTO_TCP, "", (host, port))]
    return socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)


def _open_socket(host: str, port: int, timeout: float) -> socket.socket:
    last: Exception | None = None
    for family, kind, proto, _name, address in _addresses(host, port):
        sock = _QuickAckSocket(family, kind, proto)
        try:
            sock.settimeout(timeout)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.connect(address)
            return sock
        except OSError as err:
            sock.close()
            last = err
    raise last or OSError(errno.EHOSTUNREACH, f"no address for {host}")


# Cheapest first: paramiko 5 puts the post-quantum mlkem768x25519 hybrid first, several times
# dearer in client CPU than curve25519; we take it only from a server that offers nothing else
# on this list.
KEX_ORDER = ("curve25519-sha256@libssh.org", "ecdh-sha2-nistp256")


def kex_preference(offered: Sequence[str]) -> tuple[str, ...]:
    """paramiko's kex list reordered cheapest first (pure)."""
    first = [k for k in KEX_ORDER if k in offered]
    return tuple(first + [k for k in offered if k not in first])


def open_socket(target: Target, timeout: float, known_hosts) -> socket.socket:
    """The byte stream a worker's SSH connection runs over: a TCP connection, or a channel
    through the target's jump host (its own bastion connection in each process)."""
    if target.jump is not None:
        from tpufab.ssh import jump

        return jump.open_channel(target.jump, known_hosts, target.host, target.port, timeout)
    return _open_socket(target.host, target.port, timeout)


def _timed_out(err: BaseException) -> bool:
    """The worker accepted the connection (or not) but never answered within the timeout."""
    text = str(err)
    if _from_libssh2(err):
        return libssh2_timeout(err)
    return isinstance(err, socket.timeout | TimeoutError) or "protocol banner" in text \
        or "timed out" in text.lower()


def _from_libssh2(err: BaseException) -> bool:
    return type(err).__module__.startswith("ssh2.")


def _transient(err: BaseException) -> bool:
    """Connection-level failures worth retrying: quick ones (refused, reset). Auth and host-key
    failures are not, and neither is a timeout: a frozen worker would cost the timeout again
    per attempt (82 s for 4 attempts of 20 s)."""
    import paramiko

    if _from_libssh2(err):
        return libssh2_transient(err)
    if isinstance(err, TpufabError | paramiko.AuthenticationException | paramiko.BadHostKeyException):
        return False
    if _timed_out(err):
        return False
    return isinstance(err, OSError | EOFError | paramiko.SSHException)


def _describe(err: BaseException, target: Target | None = None) -> str:
    import paramiko

    if isinstance(err, ConnectionRefusedError):
        return "connection refused"
    if isinstance(err, ConnectionResetError):
        return "connection reset"
    if _timed_out(err):
        return "connection timed out"
    if isinstance(err, paramiko.AuthenticationException) or \
            (_from_libssh2(err) and libssh2_auth_error(err)):
        hint = (target and target.auth_hint) or "is the tpufab key in the worker's authorized_keys?"
        return f"authentication failed ({hint})"
    if isinstance(err, TpufabError):
        return str(err)
    text = str(err) or type(err).__name__
    if _from_libssh2(err):
        text = f"{type(err).__name__}{': ' + str(err) if str(err) else ''}"
    return f"connection failed: {text}"


class _Conn:
    """An authenticated SSH connection (a paramiko Transport) to one worker."""

    __slots__ = ("transport",)

    def __init__(self, transport):
        self.transport = transport

    def close(self) -> None:
        try:
            self.transport.sock.shutdown(socket.SHUT_RDWR)  # wakes its thread's read now
        except OSError:
            pass
        self.transport.close()


class _Link:
    """The connection of one worker, and its agent once a command needed one."""

    def __init__(self, target: Target):
        self.target = target
        self.conn: _Conn | None = None
        self.agent: _Agent | None = None
        self.used = False  # a command ran on this connection (the one-shot path is spent)
        self.side = None   # a paramiko Transport for SFTP and forwards beside a libssh2 one
        self.lock = threading.Lock()

    @property
    def ready(self) -> bool:
        """Connected (the agent starts with the first command that needs it)."""
        return self.conn is not None and self.conn.transport.is_active() and \
            (self.agent is None or self.agent.alive)

    def close(self) -> None:
        if self.agent is not None:
            self.agent.close()
            self.agent = None
        if self.conn is not None:
            try:
                self.conn.close()
            except Exception:  # noqa: BLE001
                pass
            self.conn = None
        if self.side is not None:
            _Conn(self.side).close()
            self.side = None
        self.used = False


# ---------------------------------------------------------------------------------------------
# Limits: file descriptors and client processes
# ---------------------------------------------------------------------------------------------


FDS_PER_CONNECTION = 2  # its socket, and libssh2's eventfd
FDS_PER_WORKER = 2    # the two output spools once they spill to a file
FDS_SPARE = 64        # the interpreter, logs, terminals, the shard processes' pipes


def fd_budget(connections: int, workers: int) -> int:
    """File descriptors a fan-out needs: ``connections`` here, spools for ``workers`` (pure)."""
    return FDS_PER_CONNECTION * connections + FDS_PER_WORKER * workers + FDS_SPARE


def ensure_fds(needed: int, *, limits: tuple[int, int] | None = None, setter=None) -> int:
    """Raise the soft RLIMIT_NOFILE to ``needed`` (up to the hard limit); a ConfigError saying
    what to do when the hard limit is lower. Returns the soft limit now in force."""
    import resource

    soft, hard = limits or resource.getrlimit(resource.RLIMIT_NOFILE)
    if needed <= soft:
        return soft
    if hard != resource.RLIM_INFINITY and needed > hard:
        from tpufab.errors import ConfigError

        raise ConfigError(
            f"Fanning out needs about {needed} open files in this process but its hard limit is "
            f"{hard}: raise it (`ulimit -Hn {needed}` as root, or nofile in "
            "/etc/security/limits.conf), or spread the connections over more client processes "
            "(fanout_processes, TPUFAB_FANOUT_PROCESSES).")
    (setter or resource.setrlimit)(resource.RLIMIT_NOFILE, (needed, hard))
    return needed


TRANSPORTS = ("auto", "libssh2", "paramiko")  # ssh_transport: auto is libssh2 where it can be

KEEPER = -1  # the owner of every worker while the pod's connection keeper serves them
WORKERS_PER_PROCESS = 256   # paramiko, measured: at 256 workers a 2nd process cost 0.3 s more CPU, no faster
# libssh2 runs its handshakes in C outside the GIL: at 1,024 workers one process took less CPU
# and less wall time than two, in every run side by side (docs/benchmarks.md).
WORKERS_PER_LIBSSH2_PROCESS = 1024


def auto_processes(workers: int, cpus: int | None = None,
                   per_process: int = WORKERS_PER_PROCESS) -> int:
    """Client processes for ``workers`` connections when not set (pure): one per core at most,
    and one per ``per_process`` workers (WORKERS_PER_PROCESS over paramiko,
    WORKERS_PER_LIBSSH2_PROCESS over libssh2)."""
    cpus = cpus or os.cpu_count() or 1
    return max(1, min(cpus, workers // per_process))


def shard_of(workers: Sequence[int], processes: int) -> dict[int, int]:
    """Worker -> client process (0 is this one): contiguous blocks of the sorted workers, so
    each process owns a fixed share and keeps its connections warm (pure)."""
    ordered = sorted(workers)
    count = len(ordered)
    processes = max(1, min(processes, count or 1))
    return {w: i * processes // count for i, w in enumerate(ordered)}


# ---------------------------------------------------------------------------------------------
# The fan-out
# ---------------------------------------------------------------------------------------------


class Fanout:
    """Holds one connection per worker and runs commands on any selection of them.

    ``known_hosts`` (a :class:`tpufab.ssh.hostkeys.KnownHosts`) checks every worker's host key.
    ``processes``: client processes sharing the connections (None: :func:`auto_processes`);
    each owns a fixed block of workers and streams their frames back (tpufab.ssh.fanshard).
    """

    def __init__(
        self,
        targets: Sequence[Target],
        *,
        known_hosts=None,
        concurrency: int = DEFAULT_CONCURRENCY,
        connect_timeout: float = 10.0,
        command_timeout: float | None = None,
        connect_attempts: int = 4,
        retry_wait: tuple[float, float] = (0.25, 4.0),
        on_retry: Callable[[Target, int, BaseException], None] | None = None,
        python: str = "python3",
        kill_grace: float = KILL_GRACE,
        processes: int | None = None,
        ssh_transport: str = "auto",
    ):
        if concurrency < 1:
            raise ValueError("concurrency must be at least 1")
        quiet_paramiko()
        if known_hosts is None:
            from tpufab.ssh.hostkeys import KnownHosts

            known_hosts = KnownHosts()
        self.targets = {t.worker: t for t in targets}
        self.links = {t.worker: _Link(t) for t in targets}
        self.known_hosts = known_hosts
        self.concurrency = concurrency
        self._timeouts = (connect_timeout, command_timeout)
        self.connect_attempts = max(1, connect_attempts)
        self.retry_wait = retry_wait
        self.on_retry = on_retry
        self.python = python
        self.kill_grace = kill_grace
        if ssh_transport not in TRANSPORTS:
            raise ValueError(f"ssh_transport must be one of {', '.join(TRANSPORTS)}")
        self.ssh_transport = ssh_transport
        self._libssh2 = ssh_transport != "paramiko" and libssh2_available()
        if ssh_transport == "libssh2" and not self._libssh2:
            raise ConnectError("ssh_transport is libssh2 but ssh2-python is not installed for "
                               "this Python (pip install ssh2-python), or this is not Linux; "
                               "set ssh_transport to auto or paramiko.")
        self.processes = processes or auto_processes(
            len(self.targets),
            per_process=WORKERS_PER_LIBSSH2_PROCESS if self._libssh2 else WORKERS_PER_PROCESS)
        self.owner = shard_of(self.targets, self.processes)
        self._shards: dict[int, object] = {}
        self._shards_lock = threading.Lock()
        own = sum(1 for p in self.owner.values() if p == 0)
        ensure_fds(fd_budget(own, len(self.targets)))
        self._keys: dict[str, object] = {}
        self._keys_lock = threading.Lock()
        self._ids = iter(range(1, 1 << 31))
        self._ids_lock = threading.Lock()
        self.keeper = None  # the pod's connection keeper (tpufab.ssh.keeper.Keeper), if kept
        self._paramiko_keys: set[str] = set()  # key files libssh2 could not read
        self._key_paths: dict[str, str] = {}   # key file setting -> a path found to exist

    # -- context ----------------------------------------------------------------------------
    def __enter__(self) -> Fanout:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        with self._shards_lock:
            shards, self._shards = list(self._shards.values()), {}
        for shard in shards:
            shard.close()
        for link in self.links.values():
            link.close()

    @property
    def connect_timeout(self) -> float:
        """Seconds a connection attempt may take when a call names none (fixed when built;
        a caller with its own passes it per call, or holds a view: :meth:`bound`)."""
        return self._timeouts[0]

    @property
    def command_timeout(self) -> float | None:
        """Seconds a command may run when a call names none (None: no limit); fixed too."""
        return self._timeouts[1]

    @property
    def workers(self) -> list[int]:
        return sorted(self.targets)

    def select(self, workers=None) -> list[int]:
        """Resolve a selection (``None``, ``"all"``, ``"0,3-5"``, ``[1, 2]``) to worker indexes."""
        count = max(self.targets) + 1 if self.targets else 0
        chosen = nodeset.parse_selection(workers, count)
        missing = [w for w in chosen if w not in self.targets]
        if missing:
            raise TpufabError(f"No connection target for {nodeset.fold(missing)}.")
        return chosen

    # -- connecting -------------------------------------------------------------------------
    def _pkey(self, path: str | None):
        if path is None:
            return None
        with self._keys_lock:
            key = self._keys.get(path)
            if key is None:
                import paramiko

                try:
                    key = paramiko.PKey.from_path(os.path.expanduser(path))
                except FileNotFoundError as err:
                    raise ConnectError(
                        f"The SSH key {path} does not exist; point ssh_key (TPUFAB_SSH_KEY) at "
                        "an existing private key, or leave it unset and tpufab makes its own."
                    ) from err
                self._keys[path] = key
            return key

    def _uses_libssh2(self, target: Target) -> bool:
        """libssh2 for this worker: installed, not turned off, a key file it can read, and a
        direct TCP connection (a jump host's channel is paramiko's)."""
        return self._libssh2 and target.jump is None and target.key_filename is not None \
            and target.key_filename not in self._paramiko_keys

    def _handshake(self, target: Target, timeout: float, *, paramiko_only: bool = False):
        """Socket, key exchange (cheapest first), pinned host key, public-key auth, each
        bounded by ``timeout`` seconds: a libssh2 connection where it can be (a quarter of the
        client CPU of paramiko's at 1,024 workers), else a paramiko Transport."""
        if not paramiko_only and self._uses_libssh2(target):
            path = self._key_paths.get(target.key_filename)
            if path is None:
                path = os.path.expanduser(target.key_filename)
                if not os.path.exists(path):
                    self._pkey(target.key_filename)  # says which setting to fix
                self._key_paths[target.key_filename] = path
            pinned = self.known_hosts.lookup(target.key_alias)
            try:
                return libssh2_connect(
                    open_socket(target, timeout, self.known_hosts), target.user, path, timeout,
                    lambda ktype, blob: self.known_hosts.verify_blob(target.key_alias, ktype,
                                                                     blob, pinned),
                    [ktype for ktype, _blob in pinned])
            except KeyUnusable:
                self._paramiko_keys.add(target.key_filename)  # passphrase, format: paramiko
        import paramiko

        pkey = self._pkey(target.key_filename)
        transport = paramiko.Transport(open_socket(target, timeout, self.known_hosts))
        try:
            transport.banner_timeout = transport.handshake_timeout = timeout
            transport.auth_timeout = timeout
            options = transport.get_security_options()
            options.kex = kex_preference(options.kex)
            transport.start_client(timeout=timeout)
            self.known_hosts.verify(target.key_alias, transport.get_remote_server_key())
            keys = [pkey] if pkey is not None else list(paramiko.Agent().get_keys())
            if not keys:
                raise ConnectError("no SSH key to log in with (set ssh_key, TPUFAB_SSH_KEY)")
            for i, key in enumerate(keys):
                try:
                    transport.auth_publickey(target.user, key)
                    break
                except paramiko.AuthenticationException:
                    if i == len(keys) - 1:
                        raise
            # paramiko's thread wakes every 0.1 s to look for a close: 10 wake-ups a second
            # per idle connection (a quarter of a core for 1,024 warm connections). Closing
            # shuts the socket down instead (_Conn.close), which wakes it at once.
            transport.sock.settimeout(IDLE_TICK)
            return transport
        except BaseException:
            transport.close()
            raise

    def _connect_once(self, link: _Link, timeout: float) -> None:
        started = time.monotonic()
        try:
            transport = self._handshake(link.target, timeout)
        except BaseException as err:
            # paramiko says "No existing session" or "Error reading SSH protocol banner" when
            # the worker took the TCP connection and never spoke: a frozen sshd. Another
            # attempt would only wait as long again.
            if not isinstance(err, OSError | EOFError | KeyboardInterrupt | TpufabError) and \
                    time.monotonic() - started >= 0.9 * timeout:
                raise WorkerSilent(
                    f"no answer within {timeout:g} s (the worker accepts "
                    "connections but its sshd does not respond: frozen or overloaded)") from err
            raise
        link.conn = _Conn(transport)

    def _connect(self, link: _Link, timeout: float,
                 cancelled: threading.Event | None = None) -> None:
        """Connect with retries on connection-level failures (tenacity, exponential backoff),
        each attempt bounded by ``timeout`` seconds; none once ``cancelled`` (the run's own
        Ctrl-C: runs sharing these connections, as a keeper's commands do, each have their
        own) is set."""
        if link.ready:
            return
        with link.lock:
            if link.ready:
                return
            link.close()
            try:
                self._connect_once(link, timeout)  # most connect at once: no retry machinery
                return
            except BaseException as err:
                if self.connect_attempts < 2 or not _transient(err) or \
                        (cancelled is not None and cancelled.is_set()):
                    raise
                first = err
            self._retry_connect(link, timeout, cancelled, first)

    def _retry_connect(self, link: _Link, timeout: float, cancelled: threading.Event | None,
                       first: BaseException) -> None:
        """Attempts 2.. of a connection whose first failed with ``first`` (a transient
        failure): tenacity, backing off exponentially (retry_wait) from the first attempt."""
        from tenacity import Retrying, retry_if_exception, stop_after_attempt

        multiplier, longest = self.retry_wait

        def backoff(state) -> float:  # state.attempt_number n here is attempt n + 1 overall
            return min(multiplier * 2 ** state.attempt_number, longest)

        def before_sleep(state):
            if self.on_retry is not None:
                self.on_retry(link.target, state.attempt_number + 1, state.outcome.exception())

        if self.on_retry is not None:
            self.on_retry(link.target, 1, first)
        time.sleep(min(multiplier, longest))  # the backoff after attempt 1
        Retrying(
            stop=stop_after_attempt(self.connect_attempts - 1),
            wait=backoff,
            retry=retry_if_exception(
                lambda e: _transient(e) and not (cancelled and cancelled.is_set())),
            before_sleep=before_sleep,
            reraise=True,
        )(self._connect_once, link, timeout)

    def _agent(self, link: _Link, timeout: float) -> _Agent:
        """The worker's agent, started on its open connection by the first command needing it
        (its channel opening within ``timeout`` seconds)."""
        with link.lock:
            if link.agent is None or not link.agent.alive:
                link.agent = _Agent(link.conn.transport, link.target.worker, self.python,
                                    timeout)
            return link.agent

    def start_agents(self) -> int:
        """Start the agent on every connection this process holds open that has none running
        yet, one after another (each waits for its channel to open, not for the agent to
        answer): a keeper does this once a
        command is done, so the next command finds them started (the first command on a
        connection runs without one). Returns how many were started; a worker where it fails
        is left as it was, and its next command says why."""
        started = 0
        for worker, link in list(self.links.items()):
            if self.owner.get(worker, 0) or not link.ready or \
                    (link.agent is not None and link.agent.alive):
                continue
            try:
                self._agent(link, self.connect_timeout)
                started += 1
            except Exception:  # noqa: BLE001,S112 - the next command meets it and says it
                continue
        return started

    def transport(self, worker: int, *, connect_timeout: float | None = None):
        """An open paramiko Transport to ``worker`` in this process (SFTP, port forwards);
        connects if needed (``connect_timeout`` None: the fan-out's), raising
        :class:`ConnectError` with the reason."""
        link = self.links[worker]
        timeout = self.connect_timeout if connect_timeout is None else connect_timeout
        try:
            if not link.ready:
                self._connect(link, timeout)
            transport = link.conn.transport
            if isinstance(transport, Libssh2Connection):
                # libssh2 runs commands; SFTP and forwards take a paramiko connection of their own
                with link.lock:
                    if link.side is None or not link.side.is_active():
                        link.side = self._handshake(link.target, timeout, paramiko_only=True)
                    transport = link.side
            return transport
        except TpufabError:
            raise
        except Exception as err:  # noqa: BLE001 - one sentence for the caller
            link.close()
            raise ConnectError(f"{nodeset.label(worker)}: {_describe(err, link.target)}") from err

    def open(self, workers=None, *, connect_timeout: float | None = None) -> GroupResult:
        """Connect to the selected workers now (else the first run connects lazily)."""
        return self.run(None, workers=workers, connect_timeout=connect_timeout)

    def _route(self) -> None:
        """Send this run's workers to the pod's connection keeper when one serves them
        (tpufab.ssh.keeper), else to this process and its shards as usual."""
        shard = self.keeper.shard(self) if self.keeper is not None else None
        with self._shards_lock:
            if shard is not None:
                self._shards[KEEPER] = shard
                self.owner = dict.fromkeys(self.targets, KEEPER)
            elif KEEPER in self._shards or KEEPER in self.owner.values():
                self._shards.pop(KEEPER, None)
                self.owner = shard_of(self.targets, self.processes)

    def _shard(self, index: int):
        with self._shards_lock:
            shard = self._shards.get(index)
            if index == KEEPER and shard is not None:
                return shard  # one that died fails its run's tasks with the reason
            if shard is None or not shard.alive:
                from tpufab.ssh.fanshard import Shard

                mine = [self.targets[w] for w, p in self.owner.items() if p == index]
                shard = self._shards[index] = Shard(index, mine, self)
            return shard

    # -- running ----------------------------------------------------------------------------
    def run(
        self,
        command: str | Sequence[str] | None,
        *,
        workers=None,
        env: Mapping[str, str | Secret] | None = None,
        secrets: Mapping[str, str | Secret] | None = None,
        stdin: bytes | str | None = None,
        timeout: float | None = None,
        connect_timeout: float | None = None,
        sink: OutputSink | None = None,
        on_line: Callable[[int, str, str], None] | None = None,
        capture: bool = True,
        cwd: str | None = None,
        check: bool = False,
        one_shot: bool = False,
        _put: tuple[dict, bytes] | None = None,
        _cancel: threading.Event | None = None,
        _tasks: dict | None = None,
    ) -> GroupResult:
        """Run ``command`` on the selected workers; one :class:`WorkerResult` each.

        ``command`` is a shell command line (run by the worker user's shell, exactly once, as
        ``ssh`` would) or an argv list (run without a shell). ``timeout`` None means the
        fan-out's ``command_timeout``, ``math.inf`` no limit at all. ``env`` values are plain; any
        :class:`Secret` there or in ``secrets`` travels on stdin, is masked as ``***`` in
        output and results, and never appears in argv on the worker. ``timeout`` is per
        command: the worker kills it (TERM, then KILL) and the result says "timed out".
        ``connect_timeout``: seconds each connection attempt (and an agent's channel) may take
        for this call (None: the fan-out's ``connect_timeout``); timeouts are per call, so two
        callers sharing these connections never see each other's (tpufab.hosts.connect).
        Ctrl-C stops the command on every worker, then raises :class:`FanoutInterrupted`.

        ``one_shot``: the caller runs this one command and is done (``tpufab exec``). On a
        connection that ran nothing yet, a shell command line without stdin, environment or
        cwd then runs on a plain exec channel (``remote/oneshot.sh``) instead of starting the
        agent; Ctrl-C, timeouts and a dropped connection still stop it (docs/fanout.md).
        """
        chosen = self.select(workers)
        self._route()
        if connect_timeout is None:
            connect_timeout = self.connect_timeout
        if timeout is None:
            timeout = self.command_timeout
        elif timeout == float("inf"):
            timeout = None  # explicitly unbounded (a log follower), whatever the default
        all_env = dict(env or {})
        all_env.update(secrets or {})
        masked = quoting.secret_bytes(
            [v for v in all_env.values() if isinstance(v, Secret)] + list((secrets or {}).values())
        )
        request: dict = {}
        if command is not None and _put is None:
            if isinstance(command, str):
                request["command"] = str(command)
            else:
                request["argv"] = [str(a) for a in command]
            if all_env:
                request["env"] = quoting.reveal_env(all_env)
            if stdin is not None:
                request["stdin"] = True
            if timeout is not None:
                request["timeout"] = timeout
            if cwd is not None:
                request["cwd"] = cwd
            _encode_request(request)  # bad input (a NUL) fails once here, not per worker
        elif _put is not None:
            request = _put[0]
        plain = one_shot and set(request) <= {"command", "timeout"} and "command" in request
        if plain:
            _oneshot_line()  # built here once, not by the first connections racing for it
        stdin_bytes = stdin.encode() if isinstance(stdin, str) else stdin
        sinks = [s for s in (sink, LineCallback(on_line) if on_line else None) if s is not None]
        view = sinks[0] if len(sinks) == 1 else (Tee(sinks) if sinks else None)
        label = command if isinstance(command, str) else " ".join(command or [])

        tasks: dict[int, _Task] = {} if _tasks is None else _tasks
        slots = _Slots(self.concurrency)
        remaining = [len(chosen)]
        counter = threading.Lock()
        wake = threading.Event()
        cancelled = threading.Event()  # this run's Ctrl-C, not another run's on the same links

        def finished(_task: _Task) -> None:
            with counter:
                remaining[0] -= 1
                if remaining[0] == 0:
                    wake.set()

        def submit(task: _Task, link: _Link, crew: _Crew | None = None) -> None:
            if command is None and _put is None:
                task.finish(0)
                return
            if plain and not link.used:  # a cold connection: a crew's thread reads it
                link.used = True
                plain_channel = _Plain(link.conn.transport, task, request["command"],
                                       connect_timeout)
                with crew.serving():
                    plain_channel.serve(timeout)
                return
            link.used = True
            self._agent(link, connect_timeout).submit(task, request, stdin_bytes,
                                                      _put[1] if _put else None)

        def cold(task: _Task, crew: _Crew) -> None:
            link = self.links[task.worker]
            try:
                with slots:  # at most `concurrency` handshakes in flight
                    if task.done.is_set() or cancelled.is_set():
                        return  # interrupted while this worker waited for its turn
                    self._connect(link, connect_timeout, cancelled)
                if task.done.is_set() or cancelled.is_set():
                    return
                submit(task, link, crew)
            except BaseException as err:  # noqa: BLE001 - becomes this worker's result
                link.close()
                task.finish(None, _describe(err, link.target))

        crew = _Crew(cold, self.concurrency)

        remote: dict[int, list[_Task]] = {}
        try:
            for worker in chosen:
                with self._ids_lock:
                    task_id = next(self._ids)
                task = _Task(task_id, worker, view, masked, capture)
                task.timeout = timeout
                task.on_done = finished
                tasks[worker] = task
                owner = self.owner.get(worker, 0)
                link = self.links[worker]
                if owner:
                    remote.setdefault(owner, []).append(task)
                elif link.ready and not (plain and not link.used):
                    try:
                        submit(task, link)  # warm: a frame on an open channel, no thread hop
                    except BaseException as err:  # noqa: BLE001 - this worker's result
                        link.close()
                        task.finish(None, _describe(err, link.target))
                else:
                    crew.add(task)
            crew.start()
            for owner, owned in remote.items():
                try:
                    shard = self._shard(owner)
                except OSError as err:  # no process to run them in: their result says so
                    for task in owned:
                        task.finish(None, f"could not start fan-out process {owner} ({err})")
                    continue
                shard.run(owned, command, request, stdin_bytes, masked, timeout, one_shot, _put,
                          connect_timeout=connect_timeout)
            self._wait(tasks, timeout, connect_timeout, wake, _cancel)
        except KeyboardInterrupt:
            cancelled.set()
            self._interrupt(tasks, remote)
            group = GroupResult({w: t.result for w, t in tasks.items()}, label)
            raise FanoutInterrupted(
                f"Interrupted: stopped {label or 'the command'!r} on "
                f"{nodeset.fold(tasks)}.", group, details=group.details(),
            ) from None
        group = GroupResult({w: t.result for w, t in tasks.items()}, label)
        return group.check() if check else group

    def _wait(self, tasks: Mapping[int, _Task], timeout: float | None, connect_timeout: float,
              wake: threading.Event, cancel: threading.Event | None) -> None:
        # The worker enforces ``timeout``; this guard only covers a worker that stops answering.
        guard = None if timeout is None else \
            timeout + self.kill_grace + connect_timeout + ANSWER_MARGIN
        while True:
            if cancel is not None and cancel.is_set():
                raise KeyboardInterrupt  # a shard told to stop by its parent
            if wake.wait(1.0 if guard is None else min(1.0, guard)):
                return
            if guard is None:
                continue
            now = time.perf_counter()
            for task in tasks.values():
                if not task.done.is_set() and now - task.started > guard:
                    if task.agent is not None:
                        task.agent.kill(task, "SIGKILL")
                    task.finish(None, f"no answer from the worker {guard:.0f} s after the "
                                      f"command started (its timeout: {timeout:g} s)")

    def _interrupt(self, tasks: Mapping[int, _Task], remote: Mapping[int, list[_Task]]) -> None:
        """Stop every running command and wait (bounded) until the workers confirm."""
        running = [t for t in tasks.values() if not t.done.is_set()]
        for owner in remote:
            shard = self._shards.get(owner)
            if shard is not None:
                shard.interrupt(remote[owner])
        for task in running:
            if task.agent is not None and not self.owner.get(task.worker, 0):
                task.agent.kill(task, "SIGTERM")
        deadline = time.perf_counter() + self.kill_grace + 3
        for task in running:
            try:
                owner = self.owner.get(task.worker, 0)
                # A shard process runs its own interrupt first: give it its grace too.
                wait = max(0.0, deadline + (2 if owner else 0) - time.perf_counter())
                if (task.agent is None and not owner) or not task.done.wait(wait):
                    # Unconfirmed: closing the channel makes the worker kill everything it runs.
                    if owner:
                        shard = self._shards.get(owner)
                        if shard is not None:
                            shard.close_worker(task.worker)
                    else:
                        self.links[task.worker].close()
                    task.finish(None, "interrupted")
            except KeyboardInterrupt:
                self.close()
                break
        for task in tasks.values():
            if not task.done.is_set():
                task.finish(None, "interrupted")
            elif task.result.error is None and task.result.signal:
                task.result.error = "interrupted"

    # -- files ------------------------------------------------------------------------------
    def put(self, data: bytes | str | os.PathLike[str], remote_path: str, *, workers=None,
            mode: int = 0o644, check: bool = True) -> GroupResult:
        """Write a file on every selected worker (atomically, ``~`` expanded on the worker).

        ``data`` is the content (bytes) or a local path (str / PathLike).
        """
        if not isinstance(data, bytes):
            with open(data, "rb") as fh:
                data = fh.read()
        request = {"path": remote_path, "mode": mode}
        return self.run(f"put {remote_path}", workers=workers, check=check, _put=(request, data))

    def get(self, remote_path: str, local_dir: str | os.PathLike[str], *, workers=None,
            check: bool = True) -> dict[int, str]:
        """Copy ``remote_path`` from every selected worker to ``local_dir/w{N}-{name}``."""
        result = self.run(["cat", "--", remote_path], workers=workers, check=check)
        os.makedirs(local_dir, exist_ok=True)
        paths = {}
        for worker, r in result.items():
            if not r.ok:
                continue
            path = os.path.join(local_dir, f"{nodeset.label(worker)}-{os.path.basename(remote_path)}")
            with open(path, "wb") as fh:
                for chunk in r.stdout_output.chunks():
                    fh.write(chunk)
            paths[worker] = path
        return paths

    def bound(self, *, connect_timeout: float, command_timeout: float | None) -> FanoutView:
        """This fan-out's connections seen with one caller's timeouts (a :class:`FanoutView`)."""
        return FanoutView(self, connect_timeout=connect_timeout, command_timeout=command_timeout)


class FanoutView:
    """A :class:`Fanout`'s connections with one caller's own timeouts, fixed when it is made.

    Two Pods in one process share a node's warm connections but not their settings: each
    holds a view whose ``run``/``open``/``transport``/``put``/``get`` pass its
    ``connect_timeout`` and ``command_timeout`` (None: no limit) per call; everything else
    (targets, selection, closing) is the fan-out's. A view cannot be changed: the one road
    for a timeout is Settings -> the Pod -> a call (docs/architecture.md)."""

    __slots__ = ("fanout", "connect_timeout", "command_timeout")

    def __init__(self, fanout: Fanout, *, connect_timeout: float,
                 command_timeout: float | None):
        object.__setattr__(self, "fanout", fanout)
        object.__setattr__(self, "connect_timeout", connect_timeout)
        object.__setattr__(self, "command_timeout", command_timeout)

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"a FanoutView is read-only ({name}): make a new one with "
                             "Fanout.bound")

    def __getattr__(self, name: str):
        return getattr(self.fanout, name)

    def __repr__(self) -> str:
        return (f"<FanoutView of {len(self.fanout.targets)} workers, connect "
                f"{self.connect_timeout:g} s, command {self.command_timeout} s>")

    def run(self, command, *, timeout: float | None = None,
            connect_timeout: float | None = None, **kwargs) -> GroupResult:
        if timeout is None:
            timeout = float("inf") if self.command_timeout is None else self.command_timeout
        return self.fanout.run(command, timeout=timeout, connect_timeout=(
            self.connect_timeout if connect_timeout is None else connect_timeout), **kwargs)

    def open(self, workers=None, *, connect_timeout: float | None = None) -> GroupResult:
        return self.run(None, workers=workers, connect_timeout=connect_timeout)

    def transport(self, worker: int, *, connect_timeout: float | None = None):
        return self.fanout.transport(worker, connect_timeout=(
            self.connect_timeout if connect_timeout is None else connect_timeout))

    put = Fanout.put  # both only call self.run: this view's timeouts
    get = Fanout.get
