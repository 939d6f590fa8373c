"""What the laptop does with the supervisor's bucket alone (no supervisor VM needed): list the
jobs, read a job's output back across its attempts, ask for a job to be cancelled."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from tpufab.flows.supervisor.lease import LeaseRecord, holder_of
from tpufab.flows.supervisor.state import (
    Attempt,
    CancelPlan,
    JobSpec,
    JobState,
    Records,
    cancel_plan,
    lease_name,
    logs_prefix,
    request_cancel,
)

READERS = 8          # jobs read at once by `jobs`
FOLLOW_POLL = 2.0    # seconds between looks at the bucket while following


# -- jobs -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class JobRow:
    """One job as `tpufab jobs` shows it."""

    job: str
    spec: JobSpec | None
    state: JobState | None          # None: handed over only halfway (no state record)
    lease: LeaseRecord | None
    holder: str | None              # the supervisor holding it now, by this clock

    @property
    def state_name(self) -> str:
        return self.state.state if self.state else "incomplete"

    @property
    def live(self) -> bool:
        return self.state is not None and not self.state.terminal


def list_jobs(records: Records, *, now: float | None = None) -> list[JobRow]:
    """Every job in the bucket, oldest first, each read whole (spec, state, lease)."""
    ids = records.job_ids()
    now = time.time() if now is None else now

    def row(job: str) -> JobRow:
        state, lease = records.state(job), read_lease(records, job)
        return JobRow(job=job, spec=records.spec(job), state=state[0] if state else None,
                      lease=lease, holder=holder_of(lease, now))

    if not ids:
        records.check_bucket()      # an empty listing of a bucket that is not there
        return []
    with ThreadPoolExecutor(max_workers=min(READERS, len(ids))) as pool:
        return list(pool.map(row, ids))


# -- logs -------------------------------------------------------------------------------------


class BucketLog:
    """One worker's output of one attempt, read back chunk by chunk, in order (the object
    tpufab.views.runlogs.print_logs reads a worker's log from)."""

    def __init__(self, records: Records, prefix: str):
        self.records = records
        self.prefix = prefix

    def chunks(self) -> Iterator[bytes]:
        from tpufab.cloud.storage import chunks

        for _, data in chunks(self.records.store, self.records.bucket, self.prefix):
            yield data


@dataclass(frozen=True)
class AttemptLogs:
    number: int
    attempt: Attempt | None         # the state's record of it (None: logs without one)
    logs: dict[int, BucketLog]      # worker -> its output


@dataclass
class JobLogs:
    job: str
    spec: JobSpec | None
    state: JobState
    attempts: list[AttemptLogs] = field(default_factory=list)
    interrupted: bool = False

    @property
    def secrets(self) -> list[str]:
        """Local values of the job's secret names, masked once more where the output shows
        them (the supervisor masks them as it uploads)."""
        names = self.spec.secrets if self.spec else ()
        return [os.environ[n] for n in names if os.environ.get(n)]


def _numbers(records: Records, job: str, state: JobState) -> list[int]:
    found = {a.number for a in state.attempts}
    base = logs_prefix(job)
    for prefix in records.store.list(records.bucket, base, delimiter="/").prefixes:
        rest = prefix[len(base):].rstrip("/")
        if rest.isdigit():
            found.add(int(rest))
    return sorted(found)


def _workers(records: Records, job: str, number: int, attempt: Attempt | None) -> list[int]:
    found = set(attempt.workers if attempt else ())
    base = logs_prefix(job, number)
    for prefix in records.store.list(records.bucket, base, delimiter="/").prefixes:
        rest = prefix[len(base):].rstrip("/")
        if rest.startswith("w") and rest[1:].isdigit():
            found.add(int(rest[1:]))
    return sorted(found)


def _state(records: Records, job: str) -> JobState:
    from tpufab.flows.supervisor.state import UnknownJob

    found = records.state(job)
    if found is None:
        raise UnknownJob(f"No job {job} in {records.url}; `tpufab jobs` lists the jobs there.")
    return found[0]


def job_logs(records: Records, job: str) -> JobLogs:
    """Every attempt's output as it is in the bucket now."""
    current = _state(records, job)
    by_number = {a.number: a for a in current.attempts}
    out = JobLogs(job=job, spec=records.spec(job), state=current)
    for n in _numbers(records, job, current):
        workers = _workers(records, job, n, by_number.get(n))
        out.attempts.append(AttemptLogs(n, by_number.get(n), {
            w: BucketLog(records, logs_prefix(job, n, w)) for w in workers}))
    return out


@dataclass(frozen=True)
class Ended:
    """A worker's stream of one attempt is over (what a view's ``done`` reads)."""

    worker: int
    error: str | None = None


def follow_logs(records: Records, job: str, *, sink: Callable[[Sequence[int]], Any],
                on_attempt: Callable[[int, Attempt | None], None] | None = None,
                poll: float = FOLLOW_POLL, stop: threading.Event | None = None) -> JobLogs:
    """Every attempt's output, as it comes, until the job is over: each attempt through a view
    of its own (``sink(workers)``: ``lines(worker, stream, data)``, ``done(result)``,
    ``close()``), opened when the attempt shows up (``on_attempt(number, attempt)`` first) and
    closed once it ended and its last chunks were read (a supervisor writes an attempt's
    chunks before it marks the attempt ended, and each look reads the state first). ``stop``
    set: stop following (``interrupted``)."""
    from tpufab.cloud.storage import chunks

    stop = stop or threading.Event()
    out = JobLogs(job=job, spec=records.spec(job), state=_state(records, job))
    cursors: dict[tuple[int, int], str] = {}
    closed: set[int] = set()
    view: Any = None
    view_of: int | None = None
    view_workers: set[int] = set()
    try:
        while True:
            found = records.state(job)
            state = found[0] if found else out.state
            out.state = state
            by_number = {a.number: a for a in state.attempts}
            numbers = [n for n in _numbers(records, job, state) if n not in closed]
            for k, n in enumerate(numbers):
                attempt = by_number.get(n)
                workers = _workers(records, job, n, attempt)
                if view_of != n:
                    if on_attempt is not None:
                        on_attempt(n, attempt)
                    view, view_of, view_workers = sink(workers), n, set(workers)
                elif not set(workers) <= view_workers:  # a worker whose output came late:
                    view.close()                        # fold from here with it too
                    view, view_workers = sink(workers), set(workers)
                for w in workers:
                    prefix = logs_prefix(job, n, w)
                    for name, data in chunks(records.store, records.bucket, prefix,
                                             after=cursors.get((n, w))):
                        view.lines(w, "stdout", data)
                        cursors[(n, w)] = name
                over = (attempt is not None and attempt.phase == "ended") or k < len(numbers) - 1 \
                    or state.terminal
                if not over:
                    break                           # the live attempt: look again later
                for w in sorted(view_workers):
                    view.done(Ended(w))
                view.close()
                closed.add(n)
                view, view_of = None, None
            if state.terminal and all(n in closed for n in _numbers(records, job, state)):
                return out
            if stop.wait(poll):
                out.interrupted = True
                return out
    finally:
        if view is not None:
            view.close()


# -- cancel -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class CancelOutcome:
    job: str
    plan: CancelPlan
    state: JobState
    spec: JobSpec | None
    bucket: str

    def summary(self) -> str:
        """What was done, and what happens next, in one sentence."""
        plan, state = self.plan, self.state
        pod = self.spec.pod if self.spec else None
        on = f" on pod {pod.name}" if pod else ""
        run = plan.run
        if plan.action == "ended":
            return f"Job {self.job} already ended ({state.state}); there is nothing to cancel."
        if plan.action == "cancel-now":
            return (f"Cancelled job {self.job}: no attempt of it was running, so nothing of it "
                    f"is left{on}.")
        running = f"its run {run.run_id}{on}" if run else f"what it runs{on}"
        if plan.action == "ask-holder" or (plan.action == "asked" and plan.holder):
            again = "was already asked to stop; " if plan.action == "asked" else ""
            return (f"Job {self.job} {again}asked supervisor {plan.holder} to cancel it: the "
                    f"supervisor stops {running} and marks the job cancelled (`tpufab jobs` "
                    "shows it).")
        kill = ""
        if run is not None and pod is not None:
            from tpufab import quoting

            kill = ("; to stop the run now: tpufab kill --run "
                    f"{quoting.quote(run.run_id)} --name {quoting.quote(pod.name)} --zone "
                    f"{quoting.quote(pod.zone)}")
        again = "was already marked" if plan.action == "asked" else "is marked"
        return (f"No supervisor holds job {self.job} now, so it {again} for cancelling: the "
                f"next supervisor to take it stops {running} (if it still runs) and marks it "
                f"cancelled{kill}.")


def read_lease(records: Records, job: str) -> LeaseRecord | None:
    found = records.store.read_json(records.bucket, lease_name(job))
    return LeaseRecord.from_record(found[0]) if found else None


def cancel_job(records: Records, job: str, *, by: str, now: float | None = None) -> CancelOutcome:
    """Ask for ``job`` to stop (state.request_cancel), written over the generation read; if a
    supervisor holds it, it stops the run; if none does and nothing can be running, the job
    is cancelled at once."""
    holder = holder_of(read_lease(records, job), time.time() if now is None else now)
    seen: list[CancelPlan] = []

    def change(state: JobState) -> JobState:
        seen.append(cancel_plan(state, holder))
        return request_cancel(state, holder, records.now(), by)

    after = records.update(job, change)
    return CancelOutcome(job=job, plan=seen[-1], state=after, spec=records.spec(job),
                         bucket=records.bucket)
