"""Runs on the pod: start a recipe on every worker at once, follow its logs, list runs, stop.

The decisions are pure (``plan_run``, the command builders, the parsers, ``run_rows``, the
folding of live logs); the apply steps talk to workers only through the fan-out group and
the worker-side ``tpufab/remote/run_worker.py`` (shipped once per content hash, see
``tpufab.ssh.remote_files``).

How a run starts, in three round trips at most: the connections are opened (free when they
are warm); each worker gets its own non-secret environment (its rank and the job's layout) in a
0600 file, all workers at once; then one fan-out runs ``run_worker.py start`` everywhere with
the secrets on stdin (never argv, never a file), so every worker starts the recipe in the same
instant. ``run_worker.py`` detaches the recipe (own session, supervisor) and records it under
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
from tpufab.config import TIMEOUTS
from tpufab.errors import TpufabError
from tpufab.quoting import Command, mask, mask_bytes, secret_bytes
from tpufab.ssh.remote_files import (
    RemoteFile,
    missing_files,
    parse_answer,
    python_command,
    read_answer,
    run_script,
    run_with_files,
)
from tpufab.steps.runs.env import (
    RESERVED,
    Forwarded,
    JobEnvironment,
    JobLayout,
    SliceFacts,
    job_environments,
    new_run_id,
    paired_by_shape,
)
from tpufab.term.fields import merge as merge_fields
from tpufab.term.fields import shape
from tpufab.term.terminal import neutralise_text

if TYPE_CHECKING:
    from tpufab.ssh.results import Output

LAUNCH = "run_worker.py"
ENV_FILE = ".tpufab/runs/.{run_id}.env.json"     # relative to the worker's home
STOP_GRACE = 5.0
# What the live fold may hold (queued, not yet shown, shown later under their workers): this
# many lines and bytes, plus as many per worker; past that the oldest are placed and shown as
# if their ``delay`` had passed, so memory is bounded whatever the rate of output.
HOLD_LINES = 32768
HOLD_LINES_PER_WORKER = 256
HOLD_BYTES = 8 << 20
HOLD_BYTES_PER_WORKER = 128 << 10


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
    # the recipe's own path in the deployed checkout (`run` runs it there when it holds the
    # same bytes, so `$(dirname "$0")` is the checkout's folder); None: the shipped copy
    in_checkout: str | None = None

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


def slice_facts(nodes: Sequence) -> list[SliceFacts]:
    """Each slice's name, type and chip shape (tpufab.cloud.nodes.Node, one per slice)."""
    from tpufab.topology import default_dims, format_dims

    out = []
    for node in nodes:
        topo = node.topology
        shape = node.chip_topology or (format_dims(default_dims(topo)) if topo else "")
        out.append(SliceFacts(node.name, node.accelerator_type, shape))
    return out


def plan_run(recipe: RemoteFile, *, slices: Sequence[Sequence[int]], ips: Sequence[str],
             run_id: str | None = None, args: Sequence[str] = (), cwd: str | None = None,
             commit: str | None = None, forwarded: Forwarded | None = None,
             spmd: bool = False, tpu: Sequence[SliceFacts] = ()) -> RunPlan:
    """Each worker's environment, for a pod whose global worker ids per slice are ``slices``
    (slice 0's workers first, so a worker's id is its rank) and whose internal IPs, indexed
    by worker id, are ``ips``; ``tpu``: each slice's facts (``slice_facts(pod.nodes)``)."""
    run_id = run_id or new_run_id()
    layout = JobLayout.multislice([[ips[w] for w in ids] for ids in slices], tpu)
    ranks = [w for ids in slices for w in ids]
    envs = job_environments(run_id, layout, spmd=spmd, forwarded=forwarded)
    return RunPlan(run_id, recipe, tuple(args), dict(zip(ranks, envs, strict=True)), cwd, commit)


def start_command(plan: RunPlan) -> Command:
    from tpufab.remote.workerlib import MOUNTS_DIR

    args: list = ["start", "--run", plan.run_id, "--recipe", plan.recipe.path,
                  "--recipe-sha256", plan.recipe.sha256, "--env-file", plan.env_file(),
                  "--mounts-dir", MOUNTS_DIR]
    if plan.cwd:
        args += ["--cwd", plan.cwd]
    if plan.commit:
        args += ["--commit", plan.commit]
    if plan.in_checkout:
        args += ["--in-checkout", plan.in_checkout]
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
                           first.get("commit"), tuple(states)))
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


def start(fanout, plan: RunPlan, *, timeout: float | None = None) -> dict[int, dict]:
    """Start ``plan`` on every one of its workers at once; ``{worker: run_worker.py's report}``.

    All or nothing: if any worker cannot start it, it is stopped on the others (a job that
    waits for a missing peer would only hang) and RunError names the workers and why.
    ``timeout``: seconds each worker's start may take (None: the fan-out's).
    """
    from tpufab.ssh.remote_files import put_each

    workers = plan.workers
    open_workers(fanout, workers, f"start run {plan.run_id}")
    contents = {w: json.dumps(plan.environments[w].public).encode() for w in workers}
    puts = put_each(fanout, contents, plan.env_file(), mode=0o600)
    failed = {w: r.outcome for w, r in puts.items() if not r.ok}
    started: dict[int, dict] = {}
    if not failed:
        secrets = plan.secrets
        stdin = json.dumps(secrets).encode() if secrets else None
        results = run_with_files(fanout, [launch_file(), plan.recipe], start_command(plan),
                                 workers, stdin=stdin, timeout=timeout)
        for w, r in results.items():
            data = read_answer(r.stdout) if r.ok else None
            if data and data.get("pid"):
                started[w] = data
            else:
                failed[w] = failure_reason(r)
    if failed:
        if started:
            fanout.run(stop_command(plan.run_id, 2.0), workers=sorted(started), timeout=timeout)
        # where the env file was written and the start failed (a worker whose put failed
        # has none, and may not answer: asking it again would cost its timeout again)
        leftover = [w for w in workers if w not in started and puts[w].ok]
        fanout.run(["rm", "-f", plan.env_file()], workers=leftover, timeout=timeout)
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


def statuses(fanout, workers: Sequence[int], *,
             timeout: float | None = None) -> dict[int, WorkerRuns]:
    """``run_worker.py status`` on every worker (unreachable ones say so instead of raising);
    ``timeout``: seconds each worker has to answer (None: the fan-out's default)."""
    results = run_with_files(fanout, [launch_file()], status_command(), workers,
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


# what each command of wait_port's rounds may take (to connect, and to run) past the time left:
# near the end a status only picks the sentence (the port did not answer either way), so a
# slow answer there costs nothing but a worse reason
ROUND_SLACK = 5.0


def wait_port(fanout, run_id: str, port: int, *, worker: int = 0,
              timeout: float = TIMEOUTS["run --wait-port"].seconds,
              probe: float = 5.0, slack: float = ROUND_SLACK) -> tuple[bool, str]:
    """Wait (at most ``timeout`` s) until ``port`` answers on ``worker`` while the run lives.

    Each round asks the worker to try for up to ``probe`` s (``remote/ports.py``), then checks
    that the run is still running there. Connecting may take what is left of ``timeout`` plus
    ``slack``, and each command as long (the probe: ``probe`` at most, plus ``slack``); the
    fan-out gives up on a worker that stops answering at those two plus 4 s. So a worker that
    freezes mid-round ends the wait at most ``probe + 4 * slack + 8`` s (33 s by default)
    past ``timeout``, not never. Returns ``(True, "after N s")`` or ``(False, why)``.
    """
    began = time.monotonic()

    def left() -> float:
        return timeout - (time.monotonic() - began)

    def within(run: float):
        """``fanout`` with the command bounded by ``run`` s, and connecting by what is left of
        the wait (a loaded worker may be slow to let us in while there is time) plus slack."""
        return fanout.bound(connect_timeout=min(fanout.connect_timeout, max(0.0, left()) + slack),
                            command_timeout=run)

    while True:
        trying = max(0.1, min(probe, left()))
        result = run_script(within(trying + slack), "ports.py", ["wait", int(port), trying],
                            [worker])[worker]
        answer = read_answer(result.stdout) if result.ok else None
        if answer and answer.get("open"):
            return True, f"after {time.monotonic() - began:.1f} s"
        why = (answer or {}).get("error") or failure_reason(result)
        state = statuses(within(max(0.0, left()) + slack), [worker])[worker]
        entry = next((e for e in state.runs if e.get("run") == run_id), None)
        if entry is not None and entry.get("state") != "running":
            return False, f"the run ended on {nodeset.label(worker)} ({entry.get('state')}" + (
                f", exit {entry['exit_code']}" if entry.get("exit_code") is not None else "") \
                + f") before port {port} answered"
        if left() <= 0:
            return False, f"port {port} did not answer on {nodeset.label(worker)} within " \
                          f"{timeout:g} s ({why})"


# -- live views ---------------------------------------------------------------------------------


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


RIPE_REACH = 4   # a line that waited its delay is paired up to this many look-aheads on


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

    Memory: a line is held at most ``delay`` seconds, and at most ``hold_lines`` lines and
    ``hold_bytes`` bytes of text are held at once (by default HOLD_LINES + HOLD_LINES_PER_WORKER
    per worker, HOLD_BYTES + HOLD_BYTES_PER_WORKER per worker): past that, the oldest held
    lines are placed and shown as if their delay had passed. So what the view keeps is
    bounded by the delay and the number of workers, never by the rate or size of the output
    (``held_lines`` and ``held_bytes`` count it). Live (``start()``), while the workers' lines
    fold and the view holds more than half of that, a worker ahead of the slowest one waits
    (its follower stops reading, for ``delay`` at most) rather than have lines shown before
    the others got to them: a big log streamed fast still folds, at the slowest's pace.

    Cost per line: O(1) to place a line (waiting lines are indexed by text), O(workers) at
    most to decide whether a common line can be shown.
    """

    def __init__(self, workers: Iterable[int], out: IO[str] | None = None, *,
                 delay: float = 3.0, lookahead: int = 8,
                 clock: Callable[[], float] = time.monotonic, color: bool = False,
                 hold_lines: int | None = None, hold_bytes: int | None = None):
        self.workers = frozenset(workers)
        n = len(self.workers)
        self.hold_lines = hold_lines if hold_lines is not None else \
            HOLD_LINES + HOLD_LINES_PER_WORKER * n
        self.hold_bytes = hold_bytes if hold_bytes is not None else \
            HOLD_BYTES + HOLD_BYTES_PER_WORKER * n
        self.held_lines = 0             # lines queued, common but not shown, or own ones placed
        self.held_bytes = 0             # and their text (characters)
        self._slack = 1.0               # the share of the bound that counts as over
        self.color = color
        self.out = out
        self.delay = delay
        self.lookahead = lookahead
        self.clock = clock
        self.base = 0                                   # index of canon[0] in the stream
        self.canon: list[str] = []
        self.texts: list[str] = []      # canon's texts (searched in C: list.index)
        self.holders: list[dict[int, str]] = []     # per common line: worker -> its text
        self.arrived: list[float] = []                  # when a copy of it first arrived
        self.shown: dict[int, set[str]] = {}     # per common line shown: the texts shown there
        self.extras: dict[int, dict[str, list[_Own]]] = {}   # anchor -> text -> lines there
        self.emitted = 0
        self.cursor = {w: 0 for w in self.workers}
        self.queue: dict[int, deque[tuple[str, float]]] = {}  # lines that match nothing yet
        self.exact: dict[str, dict[int, int]] = {}      # text -> {worker: copies queued}
        self.finished: set[int] = set()
        self.live = set(self.workers)                   # the workers whose follower runs
        self.reference = min(self.workers, default=None)
        self._due = float("inf")                        # when a queued line may be ripe
        self.errors: dict[str, set[int]] = {}        # outcome -> workers, until shown
        self._errors_due = 0.0
        self.late: dict[int, dict[int, str]] = {}   # shown line -> late variants, until shown
        self._late_due = float("inf")
        self._lock = threading.RLock()
        self._room = threading.Condition(self._lock)    # the hold went down (see _wait_room)
        self._waiters = 0
        self._patient = True    # False after a wait that did not help, until the view drains
        self._folds = 1.0       # how much recent lines fold (moving average of 1: shown once
        # for several workers, 0: for one), so that waiting can help
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
            if self._ticker is not None and self._full and self._patient:
                self._wait_room(worker)
            now = self.clock()
            for line in text.split("\n")[:-1]:
                self._add(worker, _Line(line), now)
                if self.held_lines > self.hold_lines or self.held_bytes > self.hold_bytes:
                    self._emit()        # the bound holds line by line, whatever the chunk
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

    def _match(self, cursor: int, line: _Line, *, variant: bool = True) -> int | None:
        """The common line ``line`` is a copy of: the same text within the look-ahead, else
        (a field variant: tpufab.term.fields) the one at the cursor if of its shape, as
        ``logs`` pairs lines (``runs.fold_logs``)."""
        base, end, reach = self.base, self.base + len(self.canon), cursor + self.lookahead
        start = (cursor if cursor > base else base) - base
        stop = (reach if reach < end else end) - base
        window = self.texts[start:stop] if start < stop else ()
        text = line.text
        if text in window:
            return window.index(text) + start + base
        # a field variant only once no copy of the same text can still come in the window
        # (and so not the same text: its shape)
        if variant and base <= cursor and reach <= end:
            common = self.canon[cursor - base]
            if (common._shape or common.shape) == line.shape:
                return cursor
        return None

    def _copy_at(self, worker: int, queued, j: int) -> int | None:
        """Which of a worker's waiting lines is its copy of common line ``j``: the first of
        the same text."""
        common = self.canon[j - self.base]
        if worker not in self.exact.get(common.text, ()):
            return None
        for n, (text, _) in enumerate(queued):
            if text.text == common.text:
                return n
        return None

    def _variant_at(self, worker: int, now: float | None = None, force: bool = False) -> bool:
        """Its waiting lines hold one of the shape of the common line at its cursor (and no
        copy of a common line in its window): that one is a field variant of it, the lines
        before it the worker's own (as logs pairs them). Else its oldest waiting line may have
        the shape of a common line further on in its window: it is a variant of that one,
        and the worker did not print the common lines before it (rank 0 often prints lines
        of its own first: `GPU available: ...`, then `Initializing distributed: GLOBAL_RANK:
        0` where the others start). Settles it; True if it did.

        With ``now`` (from ``_ripen``), while its next waiting line is ripe too (``force``:
        all are) and a variant of the common line its cursor then stands at, that one
        settles as well, in this same pass: what a run of ``_ripen_one`` calls would do,
        with the window checked once and then only the line that enters it a step."""
        cursor = self.cursor[worker]
        queued = self.queue.get(worker)
        base, end, canon, exact = self.base, self._end, self.canon, self.exact
        if not queued or not base <= cursor < end:
            return False
        lookahead = self.lookahead
        window = range(cursor - base, min(cursor + lookahead, end) - base)
        for j in window:
            if worker in exact.get(canon[j].text, ()):
                return False
        common = canon[cursor - base]
        head, at = queued[0]
        if head == common:
            # the common case: its oldest line is the variant, no lines of its own before it
            # (the _dequeue/_pop/_settle/_rematch below, for i == 0, inline)
            delay, holders, arrived = self.delay, self.holders, self.arrived
            while True:
                queued.popleft()
                text = head.text
                self.held_lines -= 1                # _unwait, inline
                self.held_bytes -= len(text)
                copies = exact[text]
                left = copies[worker] - 1
                if left:
                    copies[worker] = left
                else:
                    del copies[worker]
                    if not copies:
                        del exact[text]
                if cursor < self.emitted:
                    self._variant(worker, cursor, text)
                else:
                    holders[cursor - base][worker] = text
                if at < arrived[cursor - base]:
                    arrived[cursor - base] = at
                cursor += 1
                self.cursor[worker] = cursor
                if not queued:
                    del self.queue[worker]
                    return True
                # its window gained one common line (none before it has a copy waiting)
                j = cursor + lookahead - 1
                if j < end and worker in exact.get(canon[j - base].text, ()):
                    self._rematch(worker, j)
                    return True
                if now is None or cursor >= end:
                    return True
                head, at = queued[0]
                # (not the same text: a copy of a line in its window would be in ``exact``)
                if not (force or at + delay <= now) or \
                        head.shape != canon[cursor - base].shape:
                    return True
        i = next((n for n, (text, _) in enumerate(queued) if text == common), None)
        if i is not None:
            own = self._dequeue(worker, i)
            copy, at = self._pop(worker)
            self._settle(worker, own, cursor, at, line=copy)
            self._rematch(worker, cursor + 1)
            return True
        # its oldest line: a variant of a common line in its window, else a copy or a variant
        # of one further on (up to RIPE_REACH windows: rank 0 may print a page of its own
        # first); only a line that waited its delay looks that far
        oldest = queued[0][0]
        j = next((j for j in window if canon[j] == oldest), None)
        if j is None:
            far = range(window.stop, min(cursor + RIPE_REACH * self.lookahead, end) - base)
            j = next((j for j in far if canon[j] == oldest), None)
        if j is None:
            return False
        copy, at = self._pop(worker)
        self._settle(worker, [], base + j, at, line=copy)
        self._rematch(worker, base + j + 1)
        return True

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
        if not queued and at >= 0 and self.canon[at].text == line.text:
            self.holders[at][worker] = line.text     # the common case: the next common line
            self.cursor[worker] = cursor + 1
            return
        j = self._match(cursor, line, variant=not queued)
        if j is not None and not queued and j >= self.emitted:
            # a copy or a field variant of a common line not shown yet, nothing of its own
            # before it: _settle's part for that, inline (every line of a field log is one)
            self.holders[j - self.base][worker] = line.text
            if now < self.arrived[j - self.base]:
                self.arrived[j - self.base] = now
            self.cursor[worker] = j + 1
        elif j is not None:
            self._settle(worker, self._dequeue(worker, len(queued)) if queued else [], j, now,
                         line=line)
        else:
            # It may match a common line still on its way: it waits (see _ripen).
            self._enqueue(worker, line, now)

    def _settle(self, worker: int, own: list[tuple[str, float]], j: int, when: float, *,
                shown: bool = True, line: _Line | None = None) -> None:
        """``worker`` printed common line ``j`` (its copy ``line``, arrived at ``when``) after
        its lines ``own``; with ``shown=False`` it did not print line ``j``: ``own`` replaced
        it."""
        anchor = j if shown else j + 1
        if own and shown:
            # as logs pairs them: its lines of the shape of a common line it skipped are that
            # line (a field variant); the others are its own, before the next one it printed
            start = max(self.cursor.get(worker, self.base), self.base)
            skipped = list(range(start, j))
            pairs = paired_by_shape([self.canon[k - self.base] for k in skipped],
                                    [text for text, _ in own]) if skipped else {}
            if pairs:
                for a, b in pairs.items():
                    self._variant(worker, skipped[a], own[b][0].text)
                after = sorted((b, skipped[a]) for a, b in pairs.items())
                rest: dict[int, list[tuple[str, float]]] = {}
                for b, entry in enumerate(own):
                    if all(b != pb for pb, _ in after):
                        at = next((k for pb, k in after if pb > b), j)
                        rest.setdefault(at, []).append(entry)
                for at, entries in rest.items():
                    self._own(worker, entries, at)
                own = []
        if own:
            self._own(worker, own, anchor)
        if shown and j >= self.base:
            self._variant(worker, j, line.text if line is not None else
                          self.canon[j - self.base].text)
            self.arrived[j - self.base] = min(self.arrived[j - self.base], when)
        self.cursor[worker] = j + 1

    def _variant(self, worker: int, k: int, text: str) -> None:
        """``worker`` printed ``text`` as common line ``k``. Once ``k`` is shown, a copy of a
        text shown there is not shown again; a field variant that is not is shown on its own
        (``w3: ...``), so a late worker's own values are never lost."""
        if k < self.emitted:
            seen = self.shown.setdefault(k, set())
            if text not in seen:   # a set: a late worker's line costs O(1), not O(workers)
                seen.add(text)
                # live, shown a moment later, folded with the other late workers' variants
                # of it (a thousand workers a delay late are one line, not a thousand)
                if not self.late:
                    self._late_due = self.clock() + (self.delay / 4 if self._ticker else 0)
                self.late.setdefault(k, {})[worker] = text
        self.holders[k - self.base][worker] = text

    def _own(self, worker: int, own: list[tuple[str, float]], anchor: int) -> None:
        """``worker``'s own lines, shown just before common line ``anchor``."""
        if anchor < self.emitted:
            for text, _ in own:
                self._write(f"{nodeset.label(worker)}: {text.text}")
            return
        entries = self.extras.setdefault(anchor, {})
        for offset, (text, _) in enumerate(own):
            if _place(entries, text, worker, offset):
                self._hold(text)

    def _append(self, worker: int, line: str, when: float) -> None:
        """A new common line; the workers whose lines waited for it move on."""
        e = self._end
        self.canon.append(line)
        self.texts.append(line.text)
        self.holders.append({worker: line.text})
        self.arrived.append(when)
        self._hold(line)
        self.cursor[worker] = e + 1
        waiting = self.exact.get(line.text)       # workers with a copy of it waiting
        for other in list(waiting) if waiting else ():
            cursor = self.cursor[other]
            if other == worker or not cursor <= e < cursor + self.lookahead:
                continue
            queued = self.queue[other]
            if queued[0][0].text == line.text:
                copy, at = self._pop(other)          # the common case: the next one waiting
                self.holders[-1][other] = copy.text
                if at < self.arrived[-1]:
                    self.arrived[-1] = at
                self.cursor[other] = e + 1
            else:
                i = self._copy_at(other, queued, e)
                if i is None:
                    continue
                own = self._dequeue(other, i)
                copy, at = self._pop(other)
                self._settle(other, own, e, at, line=copy)
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

        def ripe(w: int) -> bool:
            q = self.queue.get(w)
            return bool(q) and (force or q[0][1] + self.delay <= now)

        # Placing a line only removes waiting lines (a queue's head becomes a later line), so
        # no worker that is not ripe now becomes ripe: one pass, the lowest worker first, in
        # O(workers + lines placed) rather than a scan of every queue per line placed.
        for worker in sorted(w for w in self.queue if ripe(w)):
            while ripe(worker):
                self._ripen_one(worker, now, force)
        self._due = min((q[0][1] + self.delay for q in self.queue.values()),
                        default=float("inf"))

    def _ripen_one(self, worker: int, now: float | None = None, force: bool = False) -> None:
        """``worker``'s oldest waiting line is placed where the worker stands (with the lines
        up to a field variant of the common line there, if it waits for one; with ``now``,
        the ripe variants after it too: ``_variant_at``)."""
        if self._variant_at(worker, now, force):
            return
        cursor = self.cursor[worker]
        line, at = self._pop(worker)
        if cursor >= self._end or worker in self.finished:
            self._append(worker, line, at)      # a finished worker's last word: at the end
            return
        self._settle(worker, [(line, at)], cursor, at, shown=False)
        self._rematch(worker, cursor + self.lookahead)
        if worker == self.reference:
            self._extend(worker)

    def _rematch(self, worker: int, start: int) -> None:
        """``worker``'s window gained the common lines from ``start`` on: the first of its
        waiting lines that is a copy of one of them (``_copy_at``) settles there."""
        while self.queue.get(worker):
            cursor = self.cursor[worker]
            queued = self.queue[worker]
            found = []
            base, canon, exact = self.base, self.canon, self.exact
            for j in range(max(start, cursor, base), min(cursor + self.lookahead, self._end)):
                if worker in exact.get(canon[j - base].text, ()):
                    i = self._copy_at(worker, queued, j)
                    if i is not None:
                        found.append((i, j))
            if not found:
                return
            i, j = min(found)
            own = self._dequeue(worker, i)
            copy, at = self._pop(worker)
            self._settle(worker, own, j, at, line=copy)
            start = cursor + self.lookahead

    def _enqueue(self, worker: int, line: str, now: float) -> None:
        queued = self.queue.get(worker)
        if queued is None:
            queued = self.queue[worker] = deque()
            if now + self.delay < self._due:
                self._due = now + self.delay
        queued.append((line, now))
        self._hold(line)
        copies = self.exact.get(line.text)
        if copies is None:
            self.exact[line.text] = {worker: 1}
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
        self._release(line)
        copies = self.exact[line.text]
        left = copies[worker] - 1
        if left:
            copies[worker] = left
        else:
            del copies[worker]
            if not copies:
                del self.exact[line.text]

    def _emit(self, final: bool = False) -> None:
        now = self.clock()
        if self.errors and (final or now >= self._errors_due):
            for error, who in sorted(self.errors.items(), key=lambda kv: min(kv[1])):
                self._write(f"{nodeset.fold(who)}: {error}")
            self.errors.clear()
        self._ripen(now, force=final or not self.live)
        self._show_ready(now, final)
        if self.late and (final or now >= self._late_due):
            for k in sorted(self.late):
                who = self.late[k]
                self._write(f"{nodeset.fold(who)}: {merge_fields(who)}")
            self.late.clear()
        if self._over:
            self._squeeze(now)
        self._trim()
        if not self._patient and self.held_lines * 4 < self.hold_lines and \
                self.held_bytes * 4 < self.hold_bytes:
            self._patient = True
        if self._waiters:
            self._room.notify_all()

    def _show_ready(self, now: float, final: bool) -> None:
        """Show the common lines that are ready (every live worker got past them, or they
        waited ``delay``, or the view holds more than its bound), with the lines shown
        before them."""
        live = self.live
        while self.emitted < self._end:
            k = self.emitted
            passed = all(self.cursor.get(w, 0) > k for w in live)
            ready = final or passed or now - self.arrived[k - self.base] >= self.delay or \
                self._over
            if not ready:
                break
            if not passed:   # its delay: the field variants waiting at it join it first
                for w in sorted(w for w in self.queue if self.cursor.get(w, 0) == k):
                    self._variant_at(w)
            if k in self.extras:
                self._show(self.extras.pop(k))
            who = self.holders[k - self.base]
            self._release(self.canon[k - self.base])
            self._folds += ((len(who) > 1) - self._folds) / 64
            text = merge_fields(who)     # fields that differ between workers in braces
            self.shown[k] = set(who.values())
            self._write(text if who.keys() == self.workers else f"{nodeset.fold(who)}: {text}")
            self.emitted += 1
        if self.emitted == self._end and self.emitted in self.extras:
            # a worker's own lines after the last common line (they waited ``delay``)
            self._show(self.extras.pop(self.emitted))

    def _show(self, anchor: Mapping[str, list[_Own]]) -> None:
        for own in sorted((o for entries in anchor.values() for o in entries),
                          key=lambda o: o.order):
            self._release(own.text)
            self._folds += ((len(own.who) > 1) - self._folds) / 64
            self._write(f"{nodeset.fold(own.who)}: {merge_fields(own.who)}")

    def _hold(self, line: _Line) -> None:
        self.held_lines += 1
        self.held_bytes += len(line.text)

    def _release(self, line: _Line) -> None:
        self.held_lines -= 1
        self.held_bytes -= len(line.text)

    @property
    def _over(self) -> bool:
        return (self.held_lines > self.hold_lines * self._slack
                or self.held_bytes > self.hold_bytes * self._slack)

    @property
    def _full(self) -> bool:
        """Holding more than half the bound: a worker ahead waits, if lines fold."""
        return self.held_lines * 2 > self.hold_lines or self.held_bytes * 2 > self.hold_bytes

    def _ahead(self, worker: int) -> bool:
        """``worker`` is past the slowest live worker that still folds (is within its
        look-ahead of what was shown)."""
        floor = self.emitted - self.lookahead
        at = {w: self.cursor.get(w, 0) + len(self.queue.get(w, ())) for w in self.live}
        folding = [p for w, p in at.items() if self.cursor.get(w, 0) >= floor]
        return worker in at and bool(folding) and at[worker] > min(folding)

    def _wait_room(self, worker: int) -> None:
        """Hold ``worker``'s follower (for ``delay`` at most) while the view is full and the
        slowest worker can still fold what is held."""
        deadline = time.monotonic() + self.delay
        self._waiters += 1
        try:
            while (self._full and self._folds > 0.5 and not self._stop.is_set()
                   and self._ahead(worker)):
                left = deadline - time.monotonic()
                if left <= 0:
                    # The slowest did not catch up within the delay (it is stuck, or its
                    # lines come through this same thread): no more waiting until the view
                    # has drained to a quarter, so a stall costs one delay, not one a chunk.
                    self._patient = False
                    break
                self._room.wait(left)
        finally:
            self._waiters -= 1

    def _squeeze(self, now: float) -> None:
        """Over the hold: the oldest waiting line is placed (as if its delay had passed), so
        that what is placed can be shown, until the view holds no more than its bound."""
        self._slack = 0.875         # down to 7/8 of the bound: not again at the next line
        try:
            self._show_ready(now, final=False)
            while self._over and self.queue:
                worker = min(self.queue, key=lambda w: (self.queue[w][0][1], w))
                self._ripen_one(worker)
                self._show_ready(now, final=False)
        finally:
            self._slack = 1.0
        self._due = min((q[0][1] + self.delay for q in self.queue.values()),
                        default=float("inf"))

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
            del self.canon[:drop], self.texts[:drop], self.holders[:drop], self.arrived[:drop]
            for k in [k for k in self.shown if k < keep_from]:
                del self.shown[k]
            self.base = keep_from

    def _write(self, text: str) -> None:
        import sys

        out = self.out if self.out is not None else sys.stdout
        out.write(neutralise_text(text, color=self.color) + "\n")
        out.flush()


class _Line:
    """A line as the live fold compares it: by its shape (tpufab.term.fields: fields such as
    a rank, an address, a loss as placeholders), with the text the worker printed in
    ``.text``. Lines of one shape fold; the view shows their texts merged. The shape is found
    only when a comparison needs it: lines identical on every worker (most of a log) match by
    their text and never pay for it."""

    __slots__ = ("text", "_shape")

    def __init__(self, text: str):
        self.text = text
        self._shape: str | None = None

    @property
    def shape(self) -> str:
        found = self._shape
        if found is None:
            found = self._shape = shape(self.text)
        return found

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, _Line):
            return NotImplemented
        return self.text == other.text or self.shape == other.shape

    def __hash__(self) -> int:
        return hash(self.shape)

    def __repr__(self) -> str:
        return f"_Line({self.text!r})"


@dataclass
class _Own:
    """Lines only some workers printed at one place in the folded view."""

    text: _Line
    who: dict[int, str]             # worker -> its text
    order: tuple[int, int]          # (offset in its lowest worker's run of them, that worker)


def _place(anchor: dict[str, list[_Own]], text: _Line, worker: int, offset: int) -> bool:
    """Add ``worker``'s line at ``anchor``, merged with the lines of that shape of other
    workers; True when it is a new entry (False: merged into one already there)."""
    entries = anchor.setdefault(text, [])
    for own in entries:
        if worker not in own.who:
            own.who[worker] = text.text
            if worker < own.order[1]:
                own.order = (offset, worker)     # as logs orders them: by its lowest worker
            return False
    entries.append(_Own(text, {worker: text.text}, (offset, worker)))
    return True


def environment_summary(plan: RunPlan) -> str:
    """The forwarded and framework variables of a run, secrets masked (for display)."""
    first = plan.environments[plan.workers[0]]
    shown = {k: v for k, v in first.masked().items()
             if not k.startswith(("TPUFAB_", "SKYPILOT_")) and k not in RESERVED
             and k not in ("TPU_WORKER_ID", "MASTER_PORT")}
    return " ".join(f"{k}={v}" for k, v in sorted(shown.items()))
