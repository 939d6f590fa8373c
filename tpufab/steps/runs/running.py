"""Runs on the pod once started: follow their logs, fetch them, list runs, stop them.

The command builders and the parsers of what workers answer are pure (``run_rows``,
``parse_tail``, ``parse_status``); the apply steps talk to workers only through the fan-out
group and the worker-side ``tpufab/remote/run_worker.py`` (shipped once per content hash, see
``tpufab.ssh.remote_files``), which records each run under ``~/.tpufab/runs/<run-id>/``.
Starting one is ``tpufab.steps.start`` (the plan, the start on every worker at once, the
code lease); the live views of a followed run are ``tpufab.views``.
"""

from __future__ import annotations

import os
import signal as signals
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING

from tpufab import nodeset
from tpufab.errors import TpufabError
from tpufab.quoting import Command, mask_bytes, secret_bytes
from tpufab.ssh.remote_files import (
    RemoteFile,
    missing_files,
    parse_answer,
    python_command,
    read_answer,
    run_with_files,
)

if TYPE_CHECKING:
    from tpufab.ssh.results import Output

LAUNCH = "run_worker.py"
STOP_GRACE = 5.0


class RunError(TpufabError):
    """A run could not start, failed on some workers, or cannot be found."""


def launch_file() -> RemoteFile:
    return RemoteFile.bundled(LAUNCH)


# -- commands (pure) ---------------------------------------------------------------------------


def tail_command(run_id: str, *, follow: bool = False) -> Command:
    return python_command(launch_file(), ["tail", "--run", run_id,
                                          *(["--follow"] if follow else [])])


def status_command(runs: Sequence[str] = ()) -> Command:
    """``run_worker.py status``: every run the worker has, or only ``runs``."""
    return python_command(launch_file(), ["status", *(a for r in runs for a in ("--run", r))])


def stop_command(run_id: str, grace: float = STOP_GRACE) -> Command:
    return python_command(launch_file(), ["stop", "--run", run_id, "--grace", f"{grace:g}"])


# -- what workers answer (pure) -------------------------------------------------------------------


def failure_reason(result) -> str:
    """Why a worker's command failed, in a few words."""
    if result.error:
        return result.error
    data = read_answer(result.stdout)
    if data and data.get("error"):
        return str(data["error"])
    lines = [line for line in result.stderr.strip().splitlines() if line.strip()]
    if lines:
        return lines[-1].strip()[:200]
    return f"exit status {result.exit_code}"


@dataclass(frozen=True)
class WorkerState:
    """How a run stands on one worker."""

    worker: int
    state: str              # running | starting | exited | killed | lost | no record | unreachable
    exit_code: int | None = None
    signal: str | None = None
    detail: str | None = None
    # the worker's whole record of the run (--json has the fields above)
    info: Mapping = field(default_factory=dict, compare=False, repr=False,
                          metadata={"json": False})

    @property
    def disk_full(self) -> Mapping | None:
        """What the worker's supervisor recorded when the disk filled up during the run."""
        found = self.info.get("disk_full")
        return found if isinstance(found, Mapping) else None

    @property
    def label(self) -> str:
        if self.disk_full:
            return f"{self._label} ({disk_full_text(self.disk_full)})"
        return self._label

    @property
    def _label(self) -> str:
        if self.state == "exited":
            return f"exited {self.exit_code}"
        if self.state == "killed":
            return f"killed ({self.signal})" if self.signal else "killed"
        if self.state == "unreachable" and self.detail:
            return f"unreachable ({self.detail})"
        return self.state

    @property
    def ok(self) -> bool:
        return self.state == "exited" and self.exit_code == 0 and not self.disk_full

    @property
    def ended(self) -> bool:
        return self.state in ("exited", "killed", "lost")

    @property
    def exit_status(self) -> int:
        """A shell-style exit status: N, 128+signal, 255 when lost."""
        if self.state == "exited" and self.exit_code is not None:
            return self.exit_code or (1 if self.disk_full else 0)
        if self.state == "killed":
            try:
                return 128 + signals.Signals[self.signal or ""].value
            except KeyError:
                return 128
        return 255


def disk_full_text(record: Mapping) -> str:
    """``disk full: the log stops at 1.2 MiB, 3.4 MiB of output lost (no space left on
    device in ~/.tpufab/runs/ID)``."""
    kept = _size(record.get("log_bytes"))
    lost = _size(record.get("lost_bytes"))
    where = f" in {record['dir']}" if record.get("dir") else ""
    why = record.get("error") or "no space left on device"
    return f"disk full: the log stops at {kept}, {lost} of output lost ({why}{where})"


def _size(n) -> str:
    n = int(n or 0)
    for unit in ("bytes", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def state_from_status(worker: int, entry: Mapping) -> WorkerState:
    """One run entry of ``run_worker.py status`` (or tail's closing line) as a WorkerState."""
    return WorkerState(worker, str(entry.get("state", "lost")), entry.get("exit_code"),
                       entry.get("signal"), info=dict(entry))


def parse_tail(result) -> WorkerState:
    """A ``run_worker.py tail`` result: its closing JSON status line on stderr says how it ended."""
    worker = result.worker
    if result.error:
        return WorkerState(worker, "unreachable", detail=result.error)
    status = read_answer(result.stderr, "state")
    if status and "state" in status:
        return state_from_status(worker, status)
    return WorkerState(worker, "no record", detail=failure_reason(result))


def fold_states(states: Iterable[WorkerState]) -> str:
    """``w[0-1,3] exited 0; w2 exited 1``, ordered by first worker."""
    groups: dict[str, list[int]] = {}
    for s in states:
        groups.setdefault(s.label, []).append(s.worker)
    return "; ".join(f"{nodeset.fold(ws)} {label}" for label, ws in
                     sorted(groups.items(), key=lambda kv: min(kv[1])))


@dataclass(frozen=True)
class WorkerRuns:
    """``run_worker.py status`` of one worker: every run it has, or why it could not answer."""

    worker: int
    runs: tuple[Mapping, ...] = ()
    error: str | None = None


def parse_status(result) -> WorkerRuns:
    if not result.ok:
        return WorkerRuns(result.worker, error=failure_reason(result))
    data = read_answer(result.stdout) or {}
    return WorkerRuns(result.worker, tuple(data.get("runs") or ()))


@dataclass(frozen=True)
class RunRow:
    """One run across the pod, for ``runs``."""

    run: str
    recipe: str | None
    started_at: float | None
    ended_at: float | None
    commit: str | None
    states: tuple[WorkerState, ...] = field(metadata={"json": False})
    # each worker's state in words, {"0": "exited 0"}: what --json says of the states
    workers: dict[str, str] = field(init=False, default_factory=dict)
    job: str | None = None        # the supervised job it is an attempt of (docs/supervisor.md)

    def __post_init__(self) -> None:
        object.__setattr__(self, "workers", {str(s.worker): s.label for s in self.states})

    @property
    def folded_states(self) -> str:
        """``w[0-1] running; w2 killed (SIGTERM)``."""
        return fold_states(self.states)

    @property
    def running(self) -> bool:
        return any(s.state in ("running", "starting") for s in self.states)


def run_rows(statuses: Mapping[int, WorkerRuns]) -> list[RunRow]:
    """Every run any worker knows, newest first, with each worker's state (pure).

    A worker that does not know a run says "no record"; one that did not answer,
    "unreachable".
    """
    entries: dict[str, dict[int, Mapping]] = {}
    for worker, status in statuses.items():
        for entry in status.runs:
            entries.setdefault(str(entry.get("run")), {})[worker] = entry
    rows = []
    for run, by_worker in entries.items():
        states = []
        for worker in sorted(statuses):
            status = statuses[worker]
            if status.error is not None:
                states.append(WorkerState(worker, "unreachable", detail=status.error))
            elif worker in by_worker:
                states.append(state_from_status(worker, by_worker[worker]))
            else:
                states.append(WorkerState(worker, "no record"))
        first = by_worker[min(by_worker)]
        started = [e.get("started_at") for e in by_worker.values() if e.get("started_at")]
        ended = [e.get("ended_at") for e in by_worker.values() if e.get("ended_at")]
        rows.append(RunRow(run, first.get("recipe"), min(started) if started else None,
                           max(ended) if ended and all(
                               s.ended for s in states
                               if s.state not in ("no record", "unreachable")) else None,
                           first.get("commit"), tuple(states),
                           job=next((str(e["job"]) for e in by_worker.values()
                                     if e.get("job")), None)))
    return sorted(rows, key=lambda r: r.run, reverse=True)


def latest_run(statuses: Mapping[int, WorkerRuns]) -> str | None:
    runs = [str(e.get("run")) for s in statuses.values() for e in s.runs if e.get("run")]
    return max(runs) if runs else None


# -- talking to workers -----------------------------------------------------------------------------


def open_workers(fanout, workers: Sequence[int], what: str) -> None:
    """Connect now, so a worker that cannot be reached stops ``what`` before anything starts."""
    opened = fanout.open(workers)
    failed = [r for r in opened.values() if not r.ok]
    if failed:
        raise unreachable_error({r.worker: r.outcome for r in failed}, what)


def unreachable_error(reasons: Mapping[int, str], what: str) -> RunError:
    """One sentence naming the workers that stop ``what`` ({worker: why}), before anything
    starts."""
    reasons = dict(sorted(reasons.items()))
    detail = "; ".join(f"{nodeset.label(w)} {why}" for w, why in reasons.items())
    verb = "is" if len(reasons) == 1 else "are"
    if all("No space left" in why for why in reasons.values()):
        return RunError(f"Cannot {what}: {nodeset.fold(reasons)} {verb} out of disk space "
                        f"({detail}); free space there and try again.")
    return RunError(f"Cannot {what}: {nodeset.fold(reasons)} {verb} unreachable ({detail}); "
                    "check `tpufab describe` and try again.")



def statuses(fanout, workers: Sequence[int], *, timeout: float | None = None,
             runs: Sequence[str] = ()) -> dict[int, WorkerRuns]:
    """``run_worker.py status`` on every worker (unreachable ones say so instead of raising),
    of every run or only ``runs`` (a worker without one of them answers an error);
    ``timeout``: seconds each worker has to answer (None: the fan-out's default)."""
    results = run_with_files(fanout, [launch_file()], status_command(runs), workers,
                             timeout=timeout)
    return {w: parse_status(r) for w, r in sorted(results.items())}


def fetch_logs(fanout, run_id: str, workers: Sequence[int], *,
               timeout: float | None = None) -> tuple[dict[int, Output],
                                                      dict[int, WorkerState]]:
    """Each worker's whole log so far, and how the run stands there.

    The logs are the fan-out's spooled outputs (in memory up to a small cap, then in a temp
    file): read them with ``.chunks()`` (or ``terminal.lines_of``) and ``close()`` them.
    """
    results = run_with_files(fanout, [launch_file()], tail_command(run_id), workers,
                             timeout=timeout)
    logs, states = {}, {}
    for w, r in sorted(results.items()):
        states[w] = parse_tail(r)
        if states[w].state not in ("unreachable", "no record"):
            logs[w] = r.stdout_output
        else:
            r.stdout_output.close()
        r.stderr_output.close()
    return logs, states


def save_logs(fanout, run_id: str, workers: Sequence[int], into: Path,
              secrets: Iterable[str] = ()) -> list[int]:
    """Each worker's whole log into ``into/w<N>.log``, masked line by line as it streams from
    the spooled output (a copy already there that is longer, made while following, stays);
    the workers saved."""
    from tpufab.term.terminal import lines_of

    masked = secret_bytes(list(secrets))
    logs, _ = fetch_logs(fanout, run_id, workers)
    private_dir(into)
    try:
        for w, output in logs.items():
            path = into / f"w{w}.log"
            if path.exists() and path.stat().st_size > output.size:
                continue
            tmp = path.with_name(path.name + ".tmp")
            with open_private(tmp, "wb") as fh:
                for line in lines_of(output.chunks()):
                    fh.write(mask_bytes(line, masked))
            tmp.replace(path)
    finally:
        for output in logs.values():
            output.close()
    return sorted(logs)


def follow(fanout, run_id: str, workers: Sequence[int], sink,
           timeout: float = float("inf")) -> dict[int, WorkerState]:
    """Stream the run's log from every worker into ``sink`` until it ends everywhere (or
    ``timeout`` seconds pass: no limit by default, whatever the fan-out's command timeout,
    since a training run may last days).

    Only the followers (``run_worker.py tail --follow``) are stopped by Ctrl-C (FanoutInterrupted
    propagates) or the timeout: the run itself never is.
    """
    results = run_with_files(fanout, [launch_file()], tail_command(run_id, follow=True),
                             workers, sink=sink, timeout=timeout)
    return {w: parse_tail(r) for w, r in sorted(results.items())}


def stop(fanout, run_id: str, workers: Sequence[int],
         grace: float = STOP_GRACE) -> dict[int, dict]:
    """Stop the run on ``workers`` (TERM its process group, KILL after ``grace``)."""
    results = run_with_files(fanout, [launch_file()], stop_command(run_id, grace), workers,
                             timeout=grace + 30)
    out = {}
    for w, r in sorted(results.items()):
        data = read_answer(r.stdout) if r.error is None else None
        out[w] = data if data is not None else {"error": failure_reason(r)}
    return out


# -- local copies ------------------------------------------------------------------------------


KEEP_RUNS = 20
KEEP_LOGS_GIB = 5.0


def private_dir(path: Path) -> Path:
    """``path`` made (with its parents) a directory only its owner can enter (0700): every
    local copy of output lives in one, in files of mode 0600 (:func:`open_private`)."""
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(path, 0o700)
    return path


def open_private(path: Path, mode: str = "ab") -> IO[bytes]:
    """``path`` opened for writing bytes (``ab`` appends, ``wb`` truncates), mode 0600 even
    when it existed with another."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC | (os.O_APPEND if "a" in mode else os.O_TRUNC)
    fd = os.open(path, flags, 0o600)
    try:
        os.fchmod(fd, 0o600)
    except OSError:
        os.close(fd)
        raise
    return os.fdopen(fd, mode)


def local_log_dir(run_id: str, base: Path | None = None, *, keep_runs: int = KEEP_RUNS,
                  keep_gib: float = KEEP_LOGS_GIB) -> Path:
    """``./.tpufab/runs/<run-id>/`` (with a .gitignore, so it never dirties a checkout).

    Older copies are pruned first (see :func:`prune_local_runs`).
    """
    root = private_dir((base or Path.cwd()) / ".tpufab")
    ignore = root / ".gitignore"
    if not ignore.exists():
        ignore.write_text("*\n")
    path = private_dir(private_dir(root / "runs") / run_id)
    prune_local_runs(root / "runs", keep_runs=keep_runs, keep_bytes=int(keep_gib * 2**30),
                     current=run_id)
    return path


def prune_local_runs(runs_dir: Path, *, keep_runs: int, keep_bytes: int,
                     current: str | None = None) -> list[str]:
    """Delete local run copies beyond the newest ``keep_runs``, and the oldest of those
    while they take more than ``keep_bytes`` together; ``current`` always stays. Only
    directories named like run ids are touched. Returns the run ids removed."""
    import shutil

    from tpufab.steps.runs.env import is_run_id

    try:
        names = sorted((p.name for p in runs_dir.iterdir() if p.is_dir() and is_run_id(p.name)),
                       reverse=True)
    except OSError:
        return []
    removed, total, kept, full = [], 0, 0, False
    for name in names:
        size = _tree_size(runs_dir / name)
        full = full or kept >= keep_runs or (total + size > keep_bytes and name != current)
        if name == current or not full:
            kept += 1
            total += size
            continue
        shutil.rmtree(runs_dir / name, ignore_errors=True)
        removed.append(name)
    return removed


def _tree_size(path: Path) -> int:
    total = 0
    for folder, _dirs, files in os.walk(path):
        for name in files:
            try:
                total += (Path(folder) / name).lstat().st_size
            except OSError:
                pass
    return total


class FollowSink:
    """Feeds a view (``LiveView`` or ``FoldingView``) with the log lines the followers stream.

    A follower's own closing status (a "state" answer on stderr) is kept out of the view; secrets are
    masked before anything is shown or written; ``copy_dir`` gets ``w<N>.log`` per worker;
    ``on_end(worker, state)`` is called as each worker's follower ends.
    """

    def __init__(self, view, *, secrets: Iterable[str] = (), copy_dir: Path | None = None,
                 on_end: Callable[[int, WorkerState], None] | None = None):
        self.view = view
        self.secrets = secret_bytes(list(secrets))
        self.copy_dir = copy_dir
        self.on_end = on_end
        self._files: dict[int, IO[bytes]] = {}
        self._lock = threading.Lock()

    def lines(self, worker: int, stream: str, data: bytes) -> None:
        if stream == "stderr":
            # tpufab's own record is recognised before masking (a mask inside it would make
            # it text to show), and never shown, so it is never masked
            shown = b"".join(line + b"\n" for line in data.split(b"\n")[:-1]
                             if not _status_line(line))
            if shown:
                self.view.lines(worker, "stderr",
                                mask_bytes(shown, self.secrets) if self.secrets else shown)
            return
        if self.secrets:
            data = mask_bytes(data, self.secrets)
        if self.copy_dir is not None:
            with self._lock:
                fh = self._files.get(worker)
                if fh is None:
                    fh = self._files[worker] = open_private(self.copy_dir / f"w{worker}.log")
            fh.write(data)
            fh.flush()
        self.view.lines(worker, "stdout", data)

    def done(self, result) -> None:
        if missing_files(result):
            return      # the guard: run_worker.py is shipped and the follower starts again
        self.view.done(result)
        if self.on_end is not None:
            self.on_end(result.worker, parse_tail(result))

    def close(self) -> None:
        with self._lock:
            for fh in self._files.values():
                fh.close()
            self._files.clear()
        close = getattr(self.view, "close", None)
        if close is not None:
            close()


def _status_line(line: bytes) -> bool:
    found = parse_answer(line)
    return found is not None and found[0] == "state"
