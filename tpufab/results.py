"""Per-worker outcomes: what a step's worker scripts answered, read in one place.

A worker script ends with one JSON line (``workerlib.answer``); a step's per-worker row is a
dataclass whose fields are named as that answer's keys (``worker``, ``ok``, ``error``,
``message`` and the step's own). ``answer_row`` turns a transport outcome into such a row,
and the transport's failures (no Python, a full disk, SSH) into the same row with ``ok``
False, so deploy, mount and the code lease read their answers the same way.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, TypeVar

from tpufab.quoting import Secret
from tpufab.ssh.remote_files import last_line, read_answer


class Outcome(Protocol):
    """One worker's result of a command (a ``fanout.WorkerResult``)."""

    exit_code: int | None
    stdout: str
    stderr: str
    error: str | None


class Workers(Protocol):
    """The part of ``fanout.Fanout`` that the workflows use."""

    @property
    def workers(self) -> list[int]: ...

    def run(self, command: str, *, workers: Sequence[int] | None = None,
            env: Mapping[str, str] | None = None,
            secrets: Mapping[str, Secret] | None = None) -> Mapping[int, Outcome]: ...

    def put(self, data: bytes | Path, remote_path: str, *, workers: Sequence[int] | None = None,
            check: bool = False) -> Mapping[int, Outcome]: ...


Row = TypeVar("Row")


def failure_of(outcome: Outcome) -> tuple[str, str]:
    """(error code, message) for an outcome that carries no answer: the transport's words."""
    reason = outcome.error or last_line(outcome.stderr) or f"exit status {outcome.exit_code}"
    stderr = outcome.stderr or ""
    if outcome.exit_code == 127 or "python3: not found" in stderr:
        return "no_python", "python3 is not installed on this worker"
    if "No space left" in stderr + (outcome.error or ""):
        return "disk_full", reason
    return "ssh", reason


def answer_row(row_type: type[Row], worker: int, outcome: Outcome, **extra: Any) -> Row:
    """The worker's answer (``read_answer``, with an ``ok``) as a ``row_type`` row; fields
    the answer does not name keep their defaults, keys the row does not know are ignored.
    ``extra`` fields are set either way (e.g. the time the transport measured)."""
    data = read_answer(outcome.stdout)
    names = {f.name for f in dataclasses.fields(row_type)}  # type: ignore[arg-type]
    if data is not None and "ok" in data:
        fields = {k: v for k, v in data.items() if k in names and k not in ("worker", "ok")}
        return row_type(worker=worker, ok=bool(data["ok"]), **{**fields, **extra})
    error, message = failure_of(outcome)
    return row_type(worker=worker, ok=False, error=error, message=message, **extra)
