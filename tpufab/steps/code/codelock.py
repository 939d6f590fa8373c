"""One writer at a time for a pod's code (docs/reliability.md, "One writer for the code").

``hold`` takes the pod's code lease on every worker (worker 0 first, so two tpufabs racing
for the same pod meet on one worker and exactly one of them goes on), yields, and releases it.
The lease lives in ``~/.tpufab/locks/code.json`` on each worker and belongs to the fan-out
agent of the process that took it, so it ends with that process's SSH connection even if the
process is SIGKILLed (see ``remote/deploy_worker.py``). ``deploy`` holds it while it pushes,
checks out and verifies; every job's start (``tpufab.steps.start.starting.start_job``: run,
babysit, launch, ray submit, check's collective) holds it from its check for a live run until
the job has started. Under the lease, ``live_runs`` says which runs would read the code.
"""

from __future__ import annotations

import getpass
import os
import secrets
import socket
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

from tpufab import nodeset
from tpufab.errors import CodeBusy
from tpufab.reports import answer_row
from tpufab.ssh.remote_files import run_script
from tpufab.steps.runs import running as jobs

# The lease's worker side is a subcommand of the deploy script (it checks out under it).
SCRIPT = "deploy_worker.py"


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


@contextmanager
def hold(group, workers: Sequence[int], *, purpose: str, verb: str | None = None,
         timeout: float | None = None) -> Iterator[Lease]:
    """The pod's code lease on ``workers`` for the block, or CodeBusy naming who has it and
    saying to ``verb`` again (default: the first word of ``purpose``; ``timeout``: seconds
    each worker has to answer; None: the fan-out's)."""
    workers = sorted(workers)
    token = secrets.token_hex(8)
    args = ["lease", "--token", token, "--owner", _owner(), "--purpose", purpose]
    rows, homes, lost = {}, {}, {}
    for batch in (workers[:1], workers[1:]):
        if not batch:
            continue
        outcomes = run_script(group, SCRIPT, args, batch, timeout=timeout)
        for w in batch:
            rows[w] = answer_row(LeaseAnswer, w, outcomes[w])
            homes[w] = rows[w].home or "~"
            if getattr(outcomes[w], "error", None) is not None:
                lost[w] = outcomes[w]
        if any(r.error == "busy" for r in rows.values()):
            break
    held = [w for w, r in rows.items() if r.ok]
    try:
        busy = [r for r in rows.values() if not r.ok and r.error == "busy"]
        if busy:
            holders = sorted({r.message for r in busy if r.message})
            raise CodeBusy(f"Another tpufab is changing the code on "
                           f"{nodeset.fold(r.worker for r in busy)} ({'; '.join(holders)}); "
                           f"wait for it to finish, then {verb or purpose.split()[0]} again.")
        # A worker that could not be asked (unreachable, hung) holds no lease; the caller
        # reports it (Lease.lost) and leaves it out of the later steps; the others go on.
        yield Lease(token, homes, lost, purpose)
    finally:
        if held:
            try:
                run_script(group, SCRIPT, ["release", "--token", token], held,
                           timeout=timeout)
            except Exception:  # noqa: BLE001 - the lease dies with our connection anyway
                pass


@dataclass(frozen=True)
class LiveRun:
    run: str
    recipe: str | None
    workers: tuple[int, ...]
    cwds: tuple[str, ...]


def live_runs(group, workers: Sequence[int], *,
              timeout: float | None = None) -> list[LiveRun]:
    """Runs that are running (or starting) on any of ``workers``."""
    found: dict[str, dict] = {}
    for w, status in jobs.statuses(group, list(workers), timeout=timeout).items():
        for entry in status.runs:
            if entry.get("state") in ("running", "starting"):
                info = found.setdefault(str(entry.get("run")), {
                    "recipe": entry.get("recipe"), "workers": [], "cwds": set()})
                info["workers"].append(w)
                if entry.get("cwd"):
                    info["cwds"].add(str(entry["cwd"]).rstrip("/"))
    return [LiveRun(run, info["recipe"], tuple(sorted(info["workers"])),
                    tuple(sorted(info["cwds"]))) for run, info in sorted(found.items())]


def refuse_a_second_run(group, workers: Sequence[int], lease: Lease | None = None, *,
                        verb: str = "run", timeout: float | None = None) -> None:
    """A pod runs one job at a time: on a TPU the second would fail with "TPU in use"
    (CodeBusy, saying to ``verb`` again once it is over).

    A run needs every worker: one the lease could not reach stops it here, before anything
    starts (and before another step waits on that worker again)."""
    if lease is not None and lease.lost:
        raise jobs.unreachable_error({w: r.outcome for w, r in lease.lost.items()},
                                    f"start {lease.purpose or 'the run'}")
    running = live_runs(group, workers, timeout=timeout)
    if running:
        r = running[0]
        raise CodeBusy(f"Run {r.run} ({r.recipe or 'a recipe'}) is still running on "
                       f"{nodeset.fold(r.workers)}, and a pod runs one job at a time (a second "
                       f"would find the TPU in use): wait for it (`tpufab logs --run {r.run} "
                       f"--follow`) or stop it (`tpufab kill --run {r.run}`), then {verb} "
                       "again.")


def refuse_deploy_under_a_run(group, workers: Sequence[int], lease: Lease, dir: str) -> None:
    """Deploying into a checkout a live run reads would swap its code under it."""
    for r in live_runs(group, workers):
        inside = [w for w in r.workers if any(
            cwd == lease.expand(w, dir) or cwd.startswith(lease.expand(w, dir) + "/")
            for cwd in r.cwds)]
        if inside:
            raise CodeBusy(f"Run {r.run} ({r.recipe or 'a recipe'}) is running in {dir} on "
                           f"{nodeset.fold(inside)}, and deploying now would change its code "
                           f"under it: wait for it to end (`tpufab logs --run {r.run} "
                           f"--follow`), stop it (`tpufab kill --run {r.run}`), or deploy to "
                           "another --dir.")
