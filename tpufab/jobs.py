"""Runs on the pod: start a recipe on every worker at once, follow its logs, list runs, stop.

The decisions are pure (``plan_run``, the command builders, the parsers, ``run_rows``, the
folding of live logs); the apply steps talk to workers only through the fan-out group and
the worker-side ``tpufab/remote/launch.py`` (shipped once per content hash, see
``tpufab.remote_files``).

How a run starts, in three round trips at most: the connections are opened (free when they
are warm); each worker gets its own non-secret environment (its rank and the job's layout) in a
0600 file, all workers at once; then one fan-out runs ``launch.py start`` everywhere with
the secrets on stdin (never argv, never a file), so every worker starts the recipe in the same
instant. ``launch.py`` detaches the recipe (own session, supervisor) and records it under
``~/.tpufab/runs/<run-id>/``.
"""

from __future__ import annotations

import json
import os
import signal as signals
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING

from tpufab import nodeset
from tpufab.errors import TpufabError
from tpufab.quoting import Command, mask, mask_bytes, secret_bytes
from tpufab.remote_files import (
    RemoteFile,
    last_json,
    missing_files,
    python_command,
    run_script,
    run_with_files,
)
from tpufab.runs import (
    RESERVED,
    Forwarded,
    JobEnvironment,
    JobLayout,
    job_environments,
    new_run_id,
)
from tpufab.terminal import neutralise_text

if TYPE_CHECKING:
    from tpufab.fanout import Output

LAUNCH = "launch.py"
ENV_FILE = ".tpufab/runs/.{run_id}.env.json"     # relative to the worker's home
STOP_GRACE = 5.0


class RunError(TpufabError):
    """A run could not start, failed on some workers, or cannot be found."""


def launch_file() -> RemoteFile:
    return RemoteFile.bundled(LAUNCH)


# -- planning (pure) ----------------------------------------------------------------------------


@dataclass(frozen=True)
class RunPlan:
    """Everything that decides what starts where."""

    run_id: str
    recipe: RemoteFile
    args: tuple[str, ...]
    environments: Mapping[int, JobEnvironment]        # worker -> its environment
    cwd: str | None = None
    commit: str | None = None

    @property
    def workers(self) -> list[int]:
        return sorted(self.environments)

    @property
    def secrets(self) -> dict[str, str]:
        """The same on every worker; they travel on stdin only."""
        first = self.environments[self.workers[0]]
        return dict(first.secrets)

    def env_file(self) -> str:
        return ENV_FILE.format(run_id=self.run_id)


def plan_run(recipe: RemoteFile, *, slices: Sequence[Sequence[int]], ips: Sequence[str],
             run_id: str | None = None, args: Sequence[str] = (), cwd: str | None = None,
             commit: str | None = None, forwarded: Forwarded | None = None,
             spmd: bool = False) -> RunPlan:
    """Each worker's environment, for a pod whose global worker ids per slice are ``slices``
    (slice 0's workers first, so a worker's id is its rank) and whose internal IPs, indexed
    by worker id, are ``ips``."""
    run_id = run_id or new_run_id()
    layout = JobLayout.multislice([[ips[w] for w in ids] for ids in slices])
    ranks = [w for ids in slices for w in ids]
    envs = job_environments(run_id, layout, spmd=spmd, forwarded=forwarded)
    return RunPlan(run_id, recipe, tuple(args), dict(zip(ranks, envs, strict=True)), cwd, commit)


def start_command(plan: RunPlan) -> Command:
    from tpufab.mount import STATE_DIR as MOUNTS_DIR

    args: list = ["start", "--run", plan.run_id, "--recipe", plan.recipe.path,
                  "--recipe-sha256", plan.recipe.sha256, "--env-file", plan.env_file(),
                  "--mounts-dir", MOUNTS_DIR]
    if plan.cwd:
        args += ["--cwd", plan.cwd]
    if plan.commit:
        args += ["--commit", plan.commit]
    if plan.secrets:
        args.append("--env-stdin")
    return python_command(launch_file(), [*args, "--", *plan.args], needs=[plan.recipe])


def tail_command(run_id: str, *, follow: bool = False) -> Command:
    return python_command(launch_file(), ["tail", "--run", run_id,
                                          *(["--follow"] if follow else [])])


def status_command() -> Command:
    return python_command(launch_file(), ["status"])


def stop_command(run_id: str, grace: float = STOP_GRACE) -> Command:
    return python_command(launch_file(), ["stop", "--run", run_id, "--grace", f"{grace:g}"])


# -- what workers answer (pure) -------------------------------------------------------------------


def failure_reason(result) -> str:
    """Why a worker's command failed, in a few words."""
    if result.error:
        return result.error
    data = last_json(result.stdout)
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
    info: Mapping = field(default_factory=dict, compare=False, repr=False)

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
    """One run entry of ``launch.py status`` (or tail's closing line) as a WorkerState."""
    return WorkerState(worker, str(entry.get("state", "lost")), entry.get("exit_code"),
                       entry.get("signal"), info=dict(entry))


def parse_tail(result) -> WorkerState:
    """A ``launch.py tail`` result: its closing JSON status line on stderr says how it ended."""
    worker = result.worker
    if result.error:
        return WorkerState(worker, "unreachable", detail=result.error)
    status = last_json(result.stderr)
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
    """``launch.py status`` of one worker: every run it has, or why it could not answer."""

    worker: int
    runs: tuple[Mapping, ...] = ()
    error: str | None = None


def parse_status(result) -> WorkerRuns:
    if not result.ok:
        return WorkerRuns(result.worker, error=failure_reason(result))
    data = last_json(result.stdout) or {}
    return WorkerRuns(result.worker, tuple(data.get("runs") or ()))


@dataclass(frozen=True)
class RunRow:
    """One run across the pod, for ``runs``."""

    run: str
    recipe: str | None
    started_at: float | None
    ended_at: float | None
    commit: str | None
    states: tuple[WorkerState, ...]

    @property
    def workers(self) -> str:
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
                           first.get("commit"), tuple(states)))
    return sorted(rows, key=lambda r: r.run, reverse=True)


def latest_run(statuses: Mapping[int, WorkerRuns]) -> str | None:
    runs = [str(e.get("run")) for s in statuses.values() for e in s.runs if e.get("run")]
    return max(runs) if runs else None


# -- talking to workers -----------------------------------------------------------------------------


def open_workers(group, workers: Sequence[int], what: str) -> None:
    """Connect now, so a worker that cannot be reached stops ``what`` before anything starts."""
    opened = group.open(workers)
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


def start(group, plan: RunPlan) -> dict[int, dict]:
    """Start ``plan`` on every one of its workers at once; ``{worker: launch.py's report}``.

    All or nothing: if any worker cannot start it, it is stopped on the others (a job that
    waits for a missing peer would only hang) and RunError names the workers and why.
    """
    from tpufab.remote_files import put_each

    workers = plan.workers
    open_workers(group, workers, f"start run {plan.run_id}")
    contents = {w: json.dumps(plan.environments[w].public).encode() for w in workers}
    puts = put_each(group, contents, plan.env_file(), mode=0o600)
    failed = {w: r.outcome for w, r in puts.items() if not r.ok}
    started: dict[int, dict] = {}
    if not failed:
        secrets = plan.secrets
        stdin = json.dumps(secrets).encode() if secrets else None
        results = run_with_files(group, [launch_file(), plan.recipe], start_command(plan),
                                 workers, stdin=stdin)
        for w, r in results.items():
            data = last_json(r.stdout) if r.ok else None
            if data and data.get("pid"):
                started[w] = data
            else:
                failed[w] = failure_reason(r)
    if failed:
        if started:
            group.run(stop_command(plan.run_id, 2.0), workers=sorted(started))
        # where the env file was written and the start failed (a worker whose put failed
        # has none, and may not answer: asking it again would cost its timeout again)
        leftover = [w for w in workers if w not in started and puts[w].ok]
        group.run(["rm", "-f", plan.env_file()], workers=leftover)
        reasons = {}
        for w, why in failed.items():
            reasons.setdefault(why, []).append(w)
        detail = mask("; ".join(f"{nodeset.fold(ws)}: {why}" for why, ws in reasons.items()),
                      plan.secrets)
        tail = (f" It was stopped on {nodeset.fold(started)} so no worker waits for a missing "
                "peer." if started else "")
        raise RunError(f"Run {plan.run_id} could not start on {nodeset.fold(failed)} "
                       f"({detail}).{tail}")
    return started


def statuses(group, workers: Sequence[int]) -> dict[int, WorkerRuns]:
    """``launch.py status`` on every worker (unreachable ones say so instead of raising)."""
    results = run_with_files(group, [launch_file()], status_command(), workers)
    return {w: parse_status(r) for w, r in sorted(results.items())}


def fetch_logs(group, run_id: str, workers: Sequence[int]) -> tuple[dict[int, Output],
                                                                     dict[int, WorkerState]]:
    """Each worker's whole log so far, and how the run stands there.

    The logs are the fan-out's spooled outputs (in memory up to a small cap, then in a temp
    file): read them with ``.chunks()`` (or ``terminal.lines_of``) and ``close()`` them.
    """
    results = run_with_files(group, [launch_file()], tail_command(run_id), workers)
    logs, states = {}, {}
    for w, r in sorted(results.items()):
        states[w] = parse_tail(r)
        if states[w].state not in ("unreachable", "no record"):
            logs[w] = r.stdout_output
        else:
            r.stdout_output.close()
        r.stderr_output.close()
    return logs, states


def save_logs(group, run_id: str, workers: Sequence[int], into: Path,
              secrets: Iterable[str] = ()) -> list[int]:
    """Each worker's whole log into ``into/w<N>.log``, masked line by line as it streams from
    the spooled output (a copy already there that is longer, made while following, stays);
    the workers saved."""
    from tpufab.terminal import lines_of

    masked = secret_bytes(list(secrets))
    logs, _ = fetch_logs(group, run_id, workers)
    into.mkdir(parents=True, exist_ok=True)
    try:
        for w, output in logs.items():
            path = into / f"w{w}.log"
            if path.exists() and path.stat().st_size > output.size:
                continue
            tmp = path.with_name(path.name + ".tmp")
            with open(tmp, "wb") as fh:
                for line in lines_of(output.chunks()):
                    fh.write(mask_bytes(line, masked))
            tmp.replace(path)
    finally:
        for output in logs.values():
            output.close()
    return sorted(logs)


def follow(group, run_id: str, workers: Sequence[int], sink,
           timeout: float = float("inf")) -> dict[int, WorkerState]:
    """Stream the run's log from every worker into ``sink`` until it ends everywhere (or
    ``timeout`` seconds pass: no limit by default, whatever the fan-out's command timeout,
    since a training run may last days).

    Only the followers (``launch.py tail --follow``) are stopped by Ctrl-C (FanoutInterrupted
    propagates) or the timeout: the run itself never is.
    """
    results = run_with_files(group, [launch_file()], tail_command(run_id, follow=True),
                             workers, sink=sink, timeout=timeout)
    return {w: parse_tail(r) for w, r in sorted(results.items())}


def stop(group, run_id: str, workers: Sequence[int],
         grace: float = STOP_GRACE) -> dict[int, dict]:
    """Stop the run on ``workers`` (TERM its process group, KILL after ``grace``)."""
    results = run_with_files(group, [launch_file()], stop_command(run_id, grace), workers,
                             timeout=grace + 30)
    out = {}
    for w, r in sorted(results.items()):
        data = last_json(r.stdout) if r.error is None else None
        out[w] = data if data is not None else {"error": failure_reason(r)}
    return out


def wait_port(group, run_id: str, port: int, *, worker: int = 0, timeout: float = 600.0,
              probe: float = 5.0) -> tuple[bool, str]:
    """Wait (at most ``timeout`` s) until ``port`` answers on ``worker`` while the run lives.

    Each round asks the worker to try for up to ``probe`` s (``remote/ports.py``), then checks
    that the run is still running there. Returns ``(True, "after N s")`` or ``(False, why)``.
    """
    began = time.monotonic()
    while True:
        left = timeout - (time.monotonic() - began)
        result = run_script(group, "ports.py", ["wait", int(port), max(0.1, min(probe, left))],
                            [worker])[worker]
        answer = last_json(result.stdout) if result.ok else None
        if answer and answer.get("open"):
            return True, f"after {time.monotonic() - began:.1f} s"
        why = (answer or {}).get("error") or failure_reason(result)
        state = statuses(group, [worker])[worker]
        entry = next((e for e in state.runs if e.get("run") == run_id), None)
        if entry is not None and entry.get("state") != "running":
            return False, f"the run ended on {nodeset.label(worker)} ({entry.get('state')}" + (
                f", exit {entry['exit_code']}" if entry.get("exit_code") is not None else "") \
                + f") before port {port} answered"
        if time.monotonic() - began >= timeout:
            return False, f"port {port} did not answer on {nodeset.label(worker)} within " \
                          f"{timeout:g} s ({why})"


# -- live views ---------------------------------------------------------------------------------


KEEP_RUNS = 20
KEEP_LOGS_GIB = 5.0


def local_log_dir(run_id: str, base: Path | None = None, *, keep_runs: int = KEEP_RUNS,
                  keep_gib: float = KEEP_LOGS_GIB) -> Path:
    """``./.tpufab/runs/<run-id>/`` (with a .gitignore, so it never dirties a checkout).

    Older copies are pruned first (see :func:`prune_local_runs`).
    """
    root = (base or Path.cwd()) / ".tpufab"
    root.mkdir(exist_ok=True)
    ignore = root / ".gitignore"
    if not ignore.exists():
        ignore.write_text("*\n")
    path = root / "runs" / run_id
    path.mkdir(parents=True, exist_ok=True)
    prune_local_runs(root / "runs", keep_runs=keep_runs, keep_bytes=int(keep_gib * 2**30),
                     current=run_id)
    return path


def prune_local_runs(runs_dir: Path, *, keep_runs: int, keep_bytes: int,
                     current: str | None = None) -> list[str]:
    """Delete local run copies beyond the newest ``keep_runs``, and the oldest of those
    while they take more than ``keep_bytes`` together; ``current`` always stays. Only
    directories named like run ids are touched. Returns the run ids removed."""
    import shutil

    from tpufab.runs import is_run_id

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

    A follower's own closing status line (JSON on stderr) is kept out of the view; secrets are
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
        if self.secrets:
            data = mask_bytes(data, self.secrets)
        if stream == "stderr":
            shown = b"".join(line + b"\n" for line in data.split(b"\n")[:-1]
                             if not _status_line(line))
            if shown:
                self.view.lines(worker, "stderr", shown)
            return
        if self.copy_dir is not None:
            with self._lock:
                fh = self._files.get(worker)
                if fh is None:
                    fh = self._files[worker] = open(self.copy_dir / f"w{worker}.log", "ab")
            fh.write(data)
            fh.flush()
        self.view.lines(worker, "stdout", data)

    def done(self, result) -> None:
        if missing_files(result):
            return      # the guard: launch.py is shipped and the follower starts again
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
    if not line.startswith(b"{"):
        return False
    try:
        data = json.loads(line)
    except ValueError:
        return False
    return isinstance(data, dict) and "state" in data


class FoldingView:
    """The folded log view, live: what ``logs`` shows (``runs.fold_logs``), as lines come.

    The lowest worker still running is the reference: its lines make the common stream, each
    shown once, with the workers that printed it when they are not all of them. Every other
    worker has a cursor into that stream: a line of its that matches one of the next
    ``lookahead`` common lines moves its cursor there, and the lines it printed before it
    (which replaced the common lines it skipped) are shown under their workers
    (``w[1-3]: text``) just before that line, in the order ``logs`` gives them. A line that
    matches nothing yet waits: the common line it will match may still be on its way, since
    each worker's lines reach the view through its own follower, and a worker's common lines
    often arrive before the reference's own copy of them.

    The bound (``delay``, 3 s): a common line is shown once every live worker got past it, or
    ``delay`` seconds after its first copy arrived; a line that waited ``delay`` seconds
    without matching is placed where its worker stands: at the end of the common lines it
    becomes one (the reference is silent or dead: the lowest waiting worker stands in for it),
    elsewhere it is the worker's own line, in place of the common line at its cursor. So a
    dead or lagging worker, the reference included, delays the view by at most ``delay``, and
    what a worker says later than that is shown on its own (a late copy of a line already
    shown is not shown again).

    Cost per line: O(1) to place a line (waiting lines are indexed by text), O(workers) at
    most to decide whether a common line can be shown.
    """

    def __init__(self, workers: Iterable[int], out: IO[str] | None = None, *,
                 delay: float = 3.0, lookahead: int = 8,
                 clock: Callable[[], float] = time.monotonic, color: bool = False):
        self.workers = frozenset(workers)
        self.color = color
        self.out = out
        self.delay = delay
        self.lookahead = lookahead
        self.clock = clock
        self.base = 0                                   # index of canon[0] in the stream
        self.canon: list[str] = []
        self.holders: list[set[int]] = []
        self.arrived: list[float] = []                  # when a copy of it first arrived
        self.extras: dict[int, dict[str, list[_Own]]] = {}   # anchor -> text -> lines there
        self.emitted = 0
        self.cursor = {w: 0 for w in self.workers}
        self.queue: dict[int, deque[tuple[str, float]]] = {}  # lines that match nothing yet
        self.waiting: dict[str, dict[int, int]] = {}    # text -> {worker: copies queued}
        self.finished: set[int] = set()
        self.live = set(self.workers)                   # the workers whose follower runs
        self.reference = min(self.workers, default=None)
        self._due = float("inf")                        # when a queued line may be ripe
        self.errors: dict[str, set[int]] = {}        # outcome -> workers, until shown
        self._errors_due = 0.0
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._ticker: threading.Thread | None = None

    # -- the sink interface
    def lines(self, worker: int, stream: str, data: bytes) -> None:
        text = data.decode("utf-8", "replace")
        with self._lock:
            if stream == "stderr":
                for line in text.split("\n")[:-1]:
                    self._write(f"{nodeset.label(worker)}: {line}")
                return
            now = self.clock()
            for line in text.split("\n")[:-1]:
                self._add(worker, line, now)
            self._emit()

    def done(self, result) -> None:
        with self._lock:
            self.finished.add(result.worker)
            self.live.discard(result.worker)
            if result.error:
                # Folded: a thousand refused connections are one line (shown at the next tick).
                if not self.errors:
                    self._errors_due = self.clock() + (self.delay / 4 if self._ticker else 0)
                self.errors.setdefault(result.error, set()).add(result.worker)
            if result.worker == self.reference:
                self.reference = min(self.live, default=None)
                if self.reference is not None:
                    self._extend(self.reference)
            self._emit()

    # -- lifecycle
    def start(self) -> FoldingView:
        """Emit lines held for a lagging worker on time, even when nothing else arrives."""
        def tick():
            while not self._stop.wait(max(0.05, self.delay / 4)):
                with self._lock:
                    self._emit()

        self._ticker = threading.Thread(target=tick, name="tpufab-fold", daemon=True)
        self._ticker.start()
        return self

    def close(self) -> None:
        self._stop.set()
        if self._ticker is not None:
            self._ticker.join(timeout=2)
        with self._lock:
            self._emit(final=True)

    # -- alignment
    @property
    def _end(self) -> int:
        return self.base + len(self.canon)

    def _match(self, cursor: int, line: str) -> int | None:
        for j in range(max(cursor, self.base), min(cursor + self.lookahead, self._end)):
            if self.canon[j - self.base] == line:
                return j
        return None

    def _add(self, worker: int, line: str, now: float) -> None:
        cursor = self.cursor.setdefault(worker, self.base)
        queued = self.queue.get(worker)
        at, known = cursor - self.base, len(self.canon)
        if at >= known:                             # past the last common line
            if not queued and worker == self.reference:
                self._append(worker, line, now)
            else:
                self._enqueue(worker, line, now)
            return
        if not queued and at >= 0 and self.canon[at] == line:
            self.holders[at].add(worker)             # the common case: the next common line
            self.cursor[worker] = cursor + 1
            return
        j = self._match(cursor, line)
        if j is not None:
            self._settle(worker, self._dequeue(worker, len(queued)) if queued else [], j, now)
        else:
            # It may match a common line still on its way: it waits (see _ripen).
            self._enqueue(worker, line, now)

    def _settle(self, worker: int, own: list[tuple[str, float]], j: int, when: float, *,
                shown: bool = True) -> None:
        """``worker`` printed common line ``j`` (a copy arrived at ``when``) after its lines
        ``own``; with ``shown=False`` it did not print line ``j``: ``own`` replaced it."""
        anchor = j if shown else j + 1
        if own:
            if anchor < self.emitted:
                for text, _ in own:
                    self._write(f"{nodeset.label(worker)}: {text}")
            else:
                entries = self.extras.setdefault(anchor, {})
                for offset, (text, _) in enumerate(own):
                    _place(entries, text, worker, offset)
        if shown and j >= self.base:
            self.holders[j - self.base].add(worker)
            self.arrived[j - self.base] = min(self.arrived[j - self.base], when)
        self.cursor[worker] = j + 1

    def _append(self, worker: int, line: str, when: float) -> None:
        """A new common line; the workers whose lines waited for it move on."""
        e = self._end
        self.canon.append(line)
        self.holders.append({worker})
        self.arrived.append(when)
        self.cursor[worker] = e + 1
        waiting = self.waiting.get(line)
        for other in list(waiting) if waiting else ():
            cursor = self.cursor[other]
            if other == worker or not cursor <= e < cursor + self.lookahead:
                continue
            queued = self.queue[other]
            if queued[0][0] == line:                 # the common case: the next one waiting
                _, at = self._pop(other)
                self.holders[-1].add(other)
                if at < self.arrived[-1]:
                    self.arrived[-1] = at
                self.cursor[other] = e + 1
            else:
                i = next(n for n, (text, _) in enumerate(queued) if text == line)
                own = self._dequeue(other, i)
                _, at = self._pop(other)
                self._settle(other, own, e, at)
            if queued:
                due = queued[0][1] + self.delay
                if due < self._due:
                    self._due = due
        if self.reference != worker and self.reference in self.queue:
            self._extend(self.reference)

    def _extend(self, worker: int) -> None:
        """``worker``'s waiting lines become common lines while it is at the end of them."""
        while self.queue.get(worker) and self.cursor[worker] >= self._end:
            line, at = self._pop(worker)
            self._append(worker, line, at)

    def _ripen(self, now: float, force: bool) -> None:
        """Lines that waited ``delay`` (or every line, at the end) are placed as they stand,
        the lowest worker's first: at the end of the common lines they become common lines
        (the reference said nothing in time); elsewhere they are the worker's own, in place
        of the common line at its cursor."""
        if not force and now < self._due:
            return
        while True:
            ripe = [w for w, q in self.queue.items() if force or q[0][1] + self.delay <= now]
            if not ripe:
                break
            worker = min(ripe)
            cursor = self.cursor[worker]
            line, at = self._pop(worker)
            if cursor >= self._end or worker in self.finished:
                self._append(worker, line, at)      # a finished worker's last word: at the end
                continue
            self._settle(worker, [(line, at)], cursor, at, shown=False)
            self._rematch(worker, cursor + self.lookahead)
            if worker == self.reference:
                self._extend(worker)
        self._due = min((q[0][1] + self.delay for q in self.queue.values()),
                        default=float("inf"))

    def _rematch(self, worker: int, start: int) -> None:
        """``worker``'s window gained the common lines from ``start`` on: the first of its
        waiting lines that matches one of them settles there."""
        while self.queue.get(worker):
            cursor = self.cursor[worker]
            hits = [j for j in range(max(start, cursor, self.base),
                                     min(cursor + self.lookahead, self._end))
                    if worker in self.waiting.get(self.canon[j - self.base], ())]
            if not hits:
                return
            queued = self.queue[worker]
            first = {}
            for n, (text, _) in enumerate(queued):
                first.setdefault(text, n)
            i, j = min((first[self.canon[j - self.base]], j) for j in hits)
            own = self._dequeue(worker, i)
            _, at = self._pop(worker)
            self._settle(worker, own, j, at)
            start = cursor + self.lookahead

    def _enqueue(self, worker: int, line: str, now: float) -> None:
        queued = self.queue.get(worker)
        if queued is None:
            queued = self.queue[worker] = deque()
            if now + self.delay < self._due:
                self._due = now + self.delay
        queued.append((line, now))
        copies = self.waiting.get(line)
        if copies is None:
            self.waiting[line] = {worker: 1}
        else:
            copies[worker] = copies.get(worker, 0) + 1

    def _pop(self, worker: int) -> tuple[str, float]:
        queued = self.queue[worker]
        line, at = queued.popleft()
        self._unwait(worker, line)
        if not queued:
            del self.queue[worker]
        return line, at

    def _dequeue(self, worker: int, count: int) -> list[tuple[str, float]]:
        queued = self.queue[worker]
        taken = [queued.popleft() for _ in range(min(count, len(queued)))]
        for line, _ in taken:
            self._unwait(worker, line)
        if not queued:
            del self.queue[worker]
        return taken

    def _unwait(self, worker: int, line: str) -> None:
        """One copy of ``line`` fewer waiting from ``worker`` (the text index of _enqueue)."""
        copies = self.waiting[line]
        left = copies[worker] - 1
        if left:
            copies[worker] = left
        else:
            del copies[worker]
            if not copies:
                del self.waiting[line]

    def _emit(self, final: bool = False) -> None:
        now = self.clock()
        if self.errors and (final or now >= self._errors_due):
            for error, who in sorted(self.errors.items(), key=lambda kv: min(kv[1])):
                self._write(f"{nodeset.fold(who)}: {error}")
            self.errors.clear()
        live = self.live
        self._ripen(now, force=final or not live)
        while self.emitted < self._end:
            k = self.emitted
            ready = final or now - self.arrived[k - self.base] >= self.delay or \
                all(self.cursor.get(w, 0) > k for w in live)
            if not ready:
                break
            if k in self.extras:
                self._show(self.extras.pop(k))
            who = self.holders[k - self.base]
            text = self.canon[k - self.base]
            self._write(text if who == self.workers else f"{nodeset.fold(who)}: {text}")
            self.emitted += 1
        if self.emitted == self._end and self.emitted in self.extras:
            # a worker's own lines after the last common line (they waited ``delay``)
            self._show(self.extras.pop(self.emitted))
        self._trim()

    def _show(self, anchor: Mapping[str, list[_Own]]) -> None:
        for own in sorted((o for entries in anchor.values() for o in entries),
                          key=lambda o: o.order):
            self._write(f"{nodeset.fold(own.who)}: {own.text}")

    def _trim(self) -> None:
        # A worker more than ``lookahead`` lines behind what was shown can only match lines
        # already shown: it does not hold them in memory (its lines show as its own).
        if self.emitted - self.base <= 256:
            return          # nothing worth dropping: no look at every worker's cursor
        live = self.live
        floor = self.emitted - self.lookahead
        keep_from = min([self.emitted, *(c for c in (self.cursor.get(w, 0) for w in live)
                                         if c >= floor)])
        drop = keep_from - self.base
        if drop > 256:
            del self.canon[:drop], self.holders[:drop], self.arrived[:drop]
            self.base = keep_from

    def _write(self, text: str) -> None:
        import sys

        out = self.out if self.out is not None else sys.stdout
        out.write(neutralise_text(text, color=self.color) + "\n")
        out.flush()


@dataclass
class _Own:
    """Lines only some workers printed at one place in the folded view."""

    text: str
    who: set[int]
    order: tuple[int, int]          # (offset in its lowest worker's run of them, that worker)


def _place(anchor: dict[str, list[_Own]], text: str, worker: int, offset: int) -> None:
    """Add ``worker``'s line at ``anchor``, merged with the same line of other workers."""
    entries = anchor.setdefault(text, [])
    for own in entries:
        if worker not in own.who:
            own.who.add(worker)
            if worker < own.order[1]:
                own.order = (offset, worker)     # as logs orders them: by its lowest worker
            return
    entries.append(_Own(text, {worker}, (offset, worker)))


def environment_summary(plan: RunPlan) -> str:
    """The forwarded and framework variables of a run, secrets masked (for display)."""
    first = plan.environments[plan.workers[0]]
    shown = {k: v for k, v in first.masked().items()
             if not k.startswith(("TPUFAB_", "SKYPILOT_")) and k not in RESERVED
             and k not in ("TPU_WORKER_ID", "MASTER_PORT")}
    return " ".join(f"{k}={v}" for k, v in sorted(shown.items()))


def default_cwd(settings_dir: str | None, cwd: Path | None = None) -> str | None:
    """Where a ``--no-deploy`` run starts: the deploy directory of this checkout, if any."""
    if settings_dir:
        return settings_dir
    from tpufab import deploy, gitops

    try:
        return deploy.default_dir(gitops.repo_root(cwd))
    except gitops.GitError:
        return None

