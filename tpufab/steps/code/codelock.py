"""One writer at a time for a pod's code (docs/reliability.md, "One writer for the code").

``hold`` takes the pod's code lease on every worker (worker 0 first, so two tpufabs racing
for the same pod meet on one worker and exactly one of them goes on), yields, and releases it.
The lease lives in ``~/.tpufab/locks/code.json`` on each worker and belongs to a command of
this process that runs there as long as the lease is held (``deploy_worker.py hold``, run in
the background): it ends when this process releases the lease, and when this process ends or
dies (SIGKILL included), through its own connection or through the pod's connection keeper,
which stops what a client that went away was running (the keeper and its connections outlive
the client: a lease naming them stayed held while the keeper lived). ``deploy`` holds it
while it pushes, checks out and verifies; every job's start
(``tpufab.steps.start.starting.start_job``: run, babysit, launch, ray submit, check's
collective) holds it from its check for a live run until the job has started. Under the
lease, ``live_runs`` says which runs would read the code.
"""

from __future__ import annotations

import getpass
import math
import os
import secrets
import socket
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

from tpufab import nodeset
from tpufab.errors import CodeBusy
from tpufab.reports import answer_row
from tpufab.ssh.remote_files import (
    ANSWER_TAG,
    RemoteFile,
    missing_files,
    python_command,
    run_script,
    ship,
)
from tpufab.ssh.results import WorkerResult
from tpufab.steps.runs import running as jobs

# The lease's worker side is a subcommand of the deploy script (it checks out under it).
SCRIPT = "deploy_worker.py"
RELEASE_WAIT = 5.0   # s: a released holder's command ends within a round trip; then it is stopped


@dataclass
class LeaseAnswer:
    """A worker's answer to ``lease``: held, or busy with the holder in ``message``."""

    worker: int
    ok: bool
    error: str | None = None
    message: str | None = None
    home: str | None = None


@dataclass
class Lease:
    token: str
    homes: dict[int, str] = field(default_factory=dict)  # each worker's home directory
    # Workers that could not be asked (unreachable, or no answer within the timeout): their
    # transport results. They hold no lease, and the steps under it leave them out, so a
    # worker that hangs costs one timeout, not one per step.
    lost: dict[int, object] = field(default_factory=dict)
    purpose: str = ""                                    # "run train.sh", "deploy <commit>"

    def reached(self, workers: Sequence[int]) -> list[int]:
        """``workers`` without the lost ones."""
        return [w for w in workers if w not in self.lost]

    def expand(self, worker: int, path: str) -> str:
        """``path`` as the deploy step sees it on ``worker`` (``~`` and relative: its home)."""
        home = self.homes.get(worker, "~")
        if path == "~":
            return home
        if path.startswith("~/"):
            return f"{home}/{path[2:]}".rstrip("/")
        if not path.startswith("/"):
            return f"{home}/{path}".rstrip("/")
        return path.rstrip("/") or "/"


def _owner() -> str:
    try:
        user = getpass.getuser()
    except Exception:  # noqa: BLE001 - no passwd entry (containers)
        user = "?"
    return f"{user}@{socket.gethostname()} pid {os.getpid()}"


class _Holders:
    """The lease's holders: ``deploy_worker.py hold`` on each worker, a command that answers
    once it holds the lease and then runs there as long as this process holds it. Each batch
    runs in the background (a thread each, one fan-out run); this object is their sink, and
    says each worker's outcome once it answered or its command ended."""

    def __init__(self, fanout, line: str):
        self.fanout, self.line = fanout, line
        self.changed = threading.Condition()
        self.answered: dict[int, WorkerResult] = {}   # worker -> its answer (while it holds)
        self.ended: dict[int, object] = {}            # worker -> its command's result
        self.runs: list[tuple[threading.Thread, threading.Event, list[int]]] = []

    # -- as the runs' sink (their reader threads)
    def lines(self, worker: int, stream: str, data: bytes) -> None:
        if stream == "stdout" and ANSWER_TAG.encode() in data:
            seen = WorkerResult(worker)
            seen.stdout_output.write(data)
            with self.changed:
                self.answered[worker] = seen
                self.changed.notify_all()

    def done(self, result) -> None:
        with self.changed:
            self.ended[result.worker] = result
            self.changed.notify_all()

    def start(self, workers: list[int]) -> None:
        cancel = threading.Event()

        def run() -> None:
            try:
                self.fanout.run(self.line, workers=workers, timeout=math.inf, sink=self,
                               cancel=cancel)
            except Exception:  # noqa: BLE001,S110 - stopped (cancel): each worker's done says
                pass
        thread = threading.Thread(target=run, daemon=True, name="tpufab-lease")
        self.runs.append((thread, cancel, workers))
        thread.start()

    def take(self, workers: list[int], seconds: float | None) -> dict[int, object]:
        """Start holding on ``workers``: each one's outcome (its answer, or its command's
        result), the script shipped first where it was missing; a worker that does not
        answer within ``seconds`` (None: no bound) is "timed out"."""
        self.start(workers)
        got = self._wait(workers, seconds)
        missing = [w for w, r in got.items() if missing_files(r)]
        if missing:
            failed = ship(self.fanout, [RemoteFile.bundled(SCRIPT)], missing)
            got.update(failed)
            again = [w for w in missing if w not in failed]
            if again:
                with self.changed:
                    for w in again:
                        self.ended.pop(w, None)
                self.start(again)
                got.update(self._wait(again, seconds))
        return got

    def _wait(self, workers: list[int], seconds: float | None) -> dict[int, object]:
        deadline = None if seconds is None else time.monotonic() + seconds
        with self.changed:
            while True:
                waiting = [w for w in workers if w not in self.answered and w not in self.ended]
                left = None if deadline is None else deadline - time.monotonic()
                if not waiting or (left is not None and left <= 0):
                    break
                self.changed.wait(left)
            return {w: self.ended.get(w) or self.answered.get(w) or
                    WorkerResult(w, error=f"timed out after {seconds:g} s") for w in workers}

    def release(self, token: str, held: list[int], timeout: float | None) -> None:
        """Let go: ``release`` stops each holder (the lease goes with it); a run whose holders
        did not all end (a worker that did not answer) is stopped as Ctrl-C stops a command."""
        if held:
            try:
                run_script(self.fanout, SCRIPT, ["release", "--token", token], held,
                           timeout=timeout)
            except Exception:  # noqa: BLE001,S110 - stopping its command below lets go too
                pass
        deadline = time.monotonic() + RELEASE_WAIT
        for thread, cancel, workers in self.runs:
            with self.changed:
                lost = [w for w in workers if w not in self.answered and w not in self.ended]
            if not lost:
                thread.join(max(0.0, deadline - time.monotonic()))
            if thread.is_alive():
                cancel.set()
                thread.join(RELEASE_WAIT * 2)


@contextmanager
def hold(fanout, workers: Sequence[int], *, purpose: str, verb: str | None = None,
         timeout: float | None = None) -> Iterator[Lease]:
    """The pod's code lease on ``workers`` for the block, or CodeBusy naming who has it and
    saying to ``verb`` again (default: the first word of ``purpose``; ``timeout``: seconds
    each worker has to answer; None: the fan-out's). The lease is tied to this process (see
    the module's docstring)."""
    workers = sorted(workers)
    token = secrets.token_hex(8)
    args = ["hold", "--token", token, "--owner", _owner(), "--purpose", purpose]
    seconds = timeout if timeout is not None else getattr(fanout, "command_timeout", None)
    holders = _Holders(fanout, python_command(RemoteFile.bundled(SCRIPT), args))
    rows, homes, lost = {}, {}, {}
    try:
        for batch in (workers[:1], workers[1:]):
            if not batch:
                continue
            outcomes = holders.take(batch, seconds)
            for w in batch:
                rows[w] = answer_row(LeaseAnswer, w, outcomes[w])
                homes[w] = rows[w].home or "~"
                if getattr(outcomes[w], "error", None) is not None:
                    lost[w] = outcomes[w]
            if any(r.error == "busy" for r in rows.values()):
                break
        busy = [r for r in rows.values() if not r.ok and r.error == "busy"]
        if busy:
            holders_text = sorted({r.message for r in busy if r.message})
            raise CodeBusy(f"Another tpufab is changing the code on "
                           f"{nodeset.fold(r.worker for r in busy)} ({'; '.join(holders_text)}); "
                           f"wait for it to finish, then {verb or purpose.split()[0]} again.")
        # A worker that could not be asked (unreachable, hung) holds no lease; the caller
        # reports it (Lease.lost) and leaves it out of the later steps; the others go on.
        yield Lease(token, homes, lost, purpose)
    finally:
        holders.release(token, [w for w, r in rows.items() if r.ok], timeout)


@dataclass(frozen=True)
class LiveRun:
    run: str
    recipe: str | None
    workers: tuple[int, ...]
    cwds: tuple[str, ...]


def live_runs(fanout, workers: Sequence[int], *,
              timeout: float | None = None) -> list[LiveRun]:
    """Runs that are running (or starting) on any of ``workers``."""
    found: dict[str, dict] = {}
    for w, status in jobs.statuses(fanout, list(workers), timeout=timeout).items():
        for entry in status.runs:
            if entry.get("state") in ("running", "starting"):
                info = found.setdefault(str(entry.get("run")), {
                    "recipe": entry.get("recipe"), "workers": [], "cwds": set()})
                info["workers"].append(w)
                if entry.get("cwd"):
                    info["cwds"].add(str(entry["cwd"]).rstrip("/"))
    return [LiveRun(run, info["recipe"], tuple(sorted(info["workers"])),
                    tuple(sorted(info["cwds"]))) for run, info in sorted(found.items())]


def refuse_a_second_run(fanout, workers: Sequence[int], lease: Lease | None = None, *,
                        verb: str = "run", timeout: float | None = None) -> None:
    """A pod runs one job at a time: on a TPU the second would fail with "TPU in use"
    (CodeBusy, saying to ``verb`` again once it is over).

    A run needs every worker: one the lease could not reach stops it here, before anything
    starts (and before another step waits on that worker again)."""
    if lease is not None and lease.lost:
        raise jobs.unreachable_error({w: r.outcome for w, r in lease.lost.items()},
                                    f"start {lease.purpose or 'the run'}")
    running = live_runs(fanout, workers, timeout=timeout)
    if running:
        r = running[0]
        raise CodeBusy(f"Run {r.run} ({r.recipe or 'a recipe'}) is still running on "
                       f"{nodeset.fold(r.workers)}, and a pod runs one job at a time (a second "
                       f"would find the TPU in use): wait for it (`tpufab logs --run {r.run} "
                       f"--follow`) or stop it (`tpufab kill --run {r.run}`), then {verb} "
                       "again.")


def refuse_deploy_under_a_run(fanout, workers: Sequence[int], lease: Lease, dir: str) -> None:
    """Deploying into a checkout a live run reads would swap its code under it."""
    for r in live_runs(fanout, workers):
        inside = [w for w in r.workers if any(
            cwd == lease.expand(w, dir) or cwd.startswith(lease.expand(w, dir) + "/")
            for cwd in r.cwds)]
        if inside:
            raise CodeBusy(f"Run {r.run} ({r.recipe or 'a recipe'}) is running in {dir} on "
                           f"{nodeset.fold(inside)}, and deploying now would change its code "
                           f"under it: wait for it to end (`tpufab logs --run {r.run} "
                           f"--follow`), stop it (`tpufab kill --run {r.run}`), or deploy to "
                           "another --dir.")
