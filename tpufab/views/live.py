"""The fan-out's terminal views: every worker's lines live, prefixed ``w3 │`` (``LiveView``),
several sinks fed at once (``Tee``), and the gathered view of a finished run
(``print_gathered``, clush -b). Worker output is shown through
:func:`tpufab.term.terminal.neutralise` (control sequences made visible)."""

from __future__ import annotations

import io
import sys
import threading
from collections.abc import Iterable, Sequence
from typing import IO

from tpufab import nodeset
from tpufab.ssh.results import GroupResult, OutputSink, WorkerResult
from tpufab.term.terminal import Lines, colors_for, neutralise

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


class Tee:
    """One sink feeding every one of ``sinks``, in order (a view and a progress line)."""

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
