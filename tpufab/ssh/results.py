"""What a fan-out run returns: one result per worker, and the one container of them.

``WorkerResult`` is one worker's outcome (exit code, spooled output, duration, or the
connection error); ``GroupResult`` is every selected worker's, ``{worker: result}`` with
``.succeeded``, ``.failed``, ``.ok`` and ``.check()`` (fabric's GroupResult; the API's
``tpufab.PodResult``), and ``FanoutError`` the exception carrying it (fabric's GroupException;
``tpufab.PodError``). An ``OutputSink`` receives each worker's lines as they arrive; the
terminal's sinks are views (tpufab.views.live).
"""

from __future__ import annotations

import hashlib
import os
import statistics
import tempfile
from collections.abc import Callable, Iterable, Mapping
from typing import Protocol

from tpufab import nodeset
from tpufab.errors import TpufabError

SPOOL_BYTES = 256 * 1024  # per worker and stream, then spill to a temp file
DETAIL_ROWS = 16  # per-worker rows in a failure's details; above, folded by outcome


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


class OutputSink(Protocol):
    """Receives complete lines (masked, each ending in ``\\n``) as they arrive."""

    def lines(self, worker: int, stream: str, data: bytes) -> None: ...

    def done(self, result: WorkerResult) -> None: ...


class LineCallback:
    """Adapts ``on_line(worker, stream, line)`` (str, without newline) to an OutputSink;
    ``then``: a sink that gets every chunk and outcome first (a run's own ``sink``)."""

    def __init__(self, callback: Callable[[int, str, str], None], then: OutputSink | None = None):
        self.callback = callback
        self.then = then

    def lines(self, worker: int, stream: str, data: bytes) -> None:
        if self.then is not None:
            self.then.lines(worker, stream, data)
        for line in data.decode("utf-8", "replace").split("\n")[:-1]:
            self.callback(worker, stream, line)

    def done(self, result: WorkerResult) -> None:
        if self.then is not None:
            self.then.done(result)
