"""The client side of the worker agent (``tpufab/remote/agent.py``): one agent process per
connection on one SSH channel, every command a frame on it.

``Task`` is the client-side state of one command on one worker (whatever runs it: the agent,
a one-shot channel, a fan-out process or the keeper), cutting its output into whole lines,
masking secrets and feeding the run's sink; ``Agent`` starts the agent (its source on the
channel's stdin, never on the worker's disk), sends requests (``encode_request``: NUL-separated
tagged fields) and dispatches its frames to the tasks. The frame format is the agent's
(its module docstring).
"""

from __future__ import annotations

import struct
import threading
import time
from collections.abc import Callable, Iterable

from tpufab import quoting
from tpufab.errors import TpufabError
from tpufab.ssh.results import OutputSink, WorkerResult
from tpufab.ssh.transport import ConnectError

HEADER = struct.Struct(">BII")
LINE_LIMIT = 1 << 20  # a partial line longer than this is passed on without waiting for "\n"


def remote_file(name: str) -> bytes:
    """A worker-side file shipped with tpufab (``tpufab/remote/NAME``) as the one seam ships
    it (``RemoteFile.bundled``: read once, a script standing alone)."""
    from tpufab.ssh.remote_files import RemoteFile

    return RemoteFile.bundled(name).data


LOADER = "import sys;exec(compile(sys.stdin.buffer.read({size}),'tpufab-agent','exec'))"


def fields(items: Iterable[tuple[str, str]]) -> bytes:
    """NUL-separated tagged fields (the agent's request format); NUL itself is refused."""
    parts = []
    for tag, value in items:
        if "\0" in value:
            raise TpufabError("A command, argument or environment value contains a NUL byte.")
        parts.append(tag + value)
    return "\0".join(parts).encode("utf-8", "surrogateescape")


def encode_request(request: dict) -> bytes:
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
    return fields(items)


class Task:
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
        self.on_done: Callable[[Task], None] | None = None
        self.timeout: float | None = None
        self.sink_error: str | None = None
        self.agent = None  # what runs it: an Agent, a one-shot Plain, or a shard's proxy

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


class Agent:
    """One agent process on one SSH channel; commands are frames on it."""

    def __init__(self, transport, worker: int, python: str, open_timeout: float):
        source = remote_file("agent.py")
        self.worker = worker
        self.tasks: dict[int, Task] = {}
        self.lock = threading.Lock()
        self.send_lock = threading.Lock()
        self.closed = False
        self.hello: dict | None = None
        self.chan = transport.open_session(timeout=open_timeout)
        loader = LOADER.format(size=len(source))
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

    def submit(self, task: Task, request: dict, stdin: bytes | None = None,
               put_data: bytes | None = None) -> None:
        with self.lock:
            if self.closed:
                raise ConnectError(f"The connection to worker {self.worker} is closed.")
            self.tasks[task.id] = task
        task.agent = self
        if put_data is not None:
            head = fields([("p", request["path"]), ("m", str(request["mode"]))])
            self._send(b"P", task.id, head + b"\0\0" + put_data)
            return
        self._send(b"R", task.id, encode_request(request))
        if stdin is not None:
            for start in range(0, len(stdin), 1 << 18):
                self._send(b"I", task.id, stdin[start:start + (1 << 18)])
            self._send(b"E", task.id)

    def kill(self, task: Task, signal_name: str = "SIGTERM") -> None:
        try:
            self._send(b"K", task.id, signal_name.encode())
        except Exception:  # noqa: BLE001 - the channel is gone; the agent kills on EOF
            pass

    def use(self, used: bool) -> None:
        """Tell the agent whether a command holds its connection (``False``: kept idle between
        commands, which the worker's autostop does not count as work)."""
        try:
            self._send(b"U", 0, b"1" if used else b"0")
        except Exception:  # noqa: BLE001 - the channel is gone: so is the agent
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
