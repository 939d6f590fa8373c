"""One supervisor at a time per job (tpufab.flows.supervisor.lease) against the simulated
Cloud Storage: take, renew, release, expiry, fencing; and the worst moments: takers racing
in separate processes (exactly one wins), a taker killed before it wrote its ownership, a
writer killed between reading and writing, a writer paused there while another takes over."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest
from helpers import storage_emulator, wait_for

from tpufab.flows.supervisor import state as st
from tpufab.flows.supervisor.lease import Lease, LeaseLost, granted, take_job

AT = "2026-12-01T22:00:00Z"
TTL, MARGIN = 60.0, 10.0


@pytest.fixture(scope="module")
def gcs():
    with storage_emulator("sup-lease") as emulator:
        yield emulator


@pytest.fixture()
def records(gcs):
    from tpufab.cloud.storage import Storage

    return st.Records(Storage(gcs.url), "sup-lease")


@pytest.fixture()
def job(records) -> str:
    spec = st.JobSpec(job=st.new_job_id(), pod=st.PodRef("demo", "z"), recipe="r",
                      code=st.Code.of("c"))
    records.create(spec)
    return spec.job


class Clock:
    """A supervisor's own clock, moved by the test."""

    def __init__(self, at: float | None = None):
        self.at = time.time() if at is None else at

    def __call__(self) -> float:
        return self.at


def lease(records, job, holder, clock=None, **kw) -> Lease:
    return Lease(records.store, records.bucket, job, holder, ttl=kw.get("ttl", TTL),
                 margin=kw.get("margin", MARGIN), clock=clock or Clock())


def test_a_job_is_taken_by_one_supervisor_until_its_lease_runs_out(records, job):
    clock_a, clock_b = Clock(), Clock()
    a, b = lease(records, job, "sup-a", clock_a), lease(records, job, "sup-b", clock_b)
    assert a.take() and a.valid()
    assert not b.take()                                    # held
    assert take_job(records, b) is None
    clock_b.at += TTL + MARGIN - 1
    assert not b.take()                                    # expired, but within the margin
    clock_a.at += TTL / 3
    assert a.renew()                                       # renewed: a later expiry
    clock_b.at = clock_a.at + TTL + MARGIN - 1
    assert not b.take()
    clock_b.at = clock_a.at + TTL + MARGIN + 1
    assert b.take() and b.valid()                          # a stopped renewing: taken over
    assert not a.renew() and not a.valid()                 # and a knows it at once
    with pytest.raises(LeaseLost, match="sup-a.*no longer holds"):
        a.check()


def test_a_job_taken_only_halfway_is_given_back(records):
    """take_job takes the lease, then writes the owner; if that write fails (here: the job
    has no state), the lease is released rather than left to run out."""
    missing = "job-20991231-000000-0000"
    with pytest.raises(st.UnknownJob):
        take_job(records, lease(records, missing, "sup-a"))
    assert records.store.stat(records.bucket, st.lease_name(missing)) is None


def test_a_holder_stops_acting_a_margin_before_its_lease_runs_out(records, job):
    clock = Clock()
    a = lease(records, job, "sup-a", clock)
    assert a.take()
    clock.at += TTL - MARGIN - 0.5
    assert a.valid()
    clock.at += 1
    assert not a.valid()                  # within the margin: no more acting ...
    assert not a.renew() and a.lost      # ... and too late to renew: a taker may be there


def test_release_frees_the_job_at_once_but_never_takes_anothers_lease(records, job):
    a, b = lease(records, job, "sup-a"), lease(records, job, "sup-b")
    assert a.take()
    a.release()
    assert not a.valid() and b.take()
    a.release()                           # a again: b's lease stays
    assert b.read()[0].token == b.token and b.valid()


def test_a_stale_holder_can_never_write_over_the_new_holders_state(records, job):
    clock_a = Clock()
    a = lease(records, job, "sup-a", clock_a)
    assert take_job(records, a).owner.holder == "sup-a"
    planned = records.update(job, lambda s: st.plan_attempt(s, "r1", "first", AT), fence=a.fence)
    assert planned.current.run_id == "r1"
    # sup-a stalls (a paused VM): its lease runs out and sup-b takes the job over
    b = lease(records, job, "sup-b", Clock(clock_a.at + TTL + MARGIN + 1))
    taken = take_job(records, b)
    assert taken.owner.holder == "sup-b"
    assert st.on_takeover(taken) == st.Resume("resume", taken.current)   # r1 itself, again
    # sup-a wakes, its clock not yet past the expiry: its lease looks valid to it ...
    assert a.valid()
    with pytest.raises(LeaseLost, match="held by sup-b now"):     # ... but the fence holds
        records.update(job, lambda s: st.attempt_ended(s, "r1", "failed", AT), fence=a.fence)
    after = records.state(job)[0]
    assert after.owner.holder == "sup-b" and after.current.phase == "planned"
    assert not a.valid()


def test_a_lease_kept_by_its_thread_and_lost_to_a_taker_calls_back_once(records, job):
    lost = threading.Event()
    calls = []
    a = Lease(records.store, records.bucket, job, "sup-a", ttl=3.0, margin=0.5)
    assert a.take()

    def on_lost():
        calls.append(1)
        lost.set()

    with a.kept(on_lost=on_lost):
        first = a.record.expires_at
        wait_for(lambda: a.record.expires_at > first, timeout=10, what="a renewal")
        assert a.valid()
        # a taker whose clock is far ahead takes it: the next renewal fails
        b = Lease(records.store, records.bucket, job, "sup-b", ttl=3.0, margin=0.5,
                  clock=lambda: time.time() + 100)
        assert b.take()
        assert lost.wait(timeout=10)
        assert not a.valid()
    assert calls == [1]
    assert b.read()[0].token == b.token          # leaving the keeper did not delete b's lease


# -- the worst moments, in processes of their own

CHILD = r"""
import sys, time
from tpufab.cloud.storage import Storage
from tpufab.flows.supervisor import state as st
from tpufab.flows.supervisor.lease import Lease, LeaseLost, take_job

endpoint, bucket, job, mode, holder = sys.argv[1:6]
records = st.Records(Storage(endpoint), bucket)
lease = Lease(records.store, bucket, job, holder, ttl=60, margin=10)
print("READY", flush=True)
if mode == "take":                         # a race per two lines: the job, then "go"
    from tpufab.flows.supervisor.lease import free
    for line in sys.stdin:
        racing = Lease(records.store, bucket, line.strip(), holder, ttl=60, margin=10)
        sys.stdin.readline()
        seen = racing.read()               # free when read: a loss is a refused write
        was_free = seen is None or free(seen[0], time.time(), 10)
        won = racing.take()
        print("WON" if won else "LOST-AT-WRITE" if was_free else "LOST-HELD", flush=True)
    sys.exit(0)
sys.stdin.readline()                       # the start signal (or the kill comes first)
if mode == "take-then-hang":             # killed after taking, before writing ownership
    print("TOOK" if lease.take() else "LOST", flush=True)
    sys.stdin.readline()
elif mode == "update-paused":              # read, then wait (killed, or let go late)
    assert take_job(records, lease) is not None

    def change(state):
        print("READ", flush=True)
        sys.stdin.readline()
        return st.plan_attempt(state, "r-" + holder, "first", "t")

    try:
        records.update(job, change, fence=lease.fence)
        print("WROTE", flush=True)
    except LeaseLost:
        print("FENCED", flush=True)
"""


class Child:
    def __init__(self, gcs, records, job, mode, holder):
        self.proc = subprocess.Popen([sys.executable, "-c", CHILD, gcs.url, records.bucket,
                                      job, mode, holder], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def expect(self, word: str) -> None:
        line = self.proc.stdout.readline().strip()
        assert line == word, (line, self.proc.stderr.read() if not line else "")

    def say(self, line: str = "go") -> None:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def answer(self) -> str:
        return self.proc.stdout.readline().strip()

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(timeout=30)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.kill()
        for stream in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            stream.close()


@pytest.fixture()
def children():
    made: list[Child] = []
    yield made
    for child in made:
        child.close()


def test_of_takers_racing_in_processes_exactly_one_wins(gcs, records, children):
    """Six supervisors in processes of their own race for a job: one with no lease yet
    (ifGenerationMatch=0), then one whose lease ran out long ago (ifGenerationMatch=G);
    twice each. Every time exactly one takes it, and the lease names that one."""
    racers = [Child(gcs, records, "-", "take", f"sup-{i}") for i in range(6)]
    children.extend(racers)
    for racer in racers:
        racer.expect("READY")
    at_write = 0
    for lease_there in ("none", "expired", "none", "expired"):
        spec = st.JobSpec(job=st.new_job_id(), pod=st.PodRef("demo", "z"), recipe="r",
                          code=st.Code.of("c"))
        records.create(spec)
        if lease_there == "expired":      # a dead supervisor's lease, long run out
            old = granted("sup-dead", "t-dead", time.time() - 1000, 60.0)
            records.store.put_json(records.bucket, st.lease_name(spec.job), old.to_record(),
                                   if_generation_match=0)
        for racer in racers:
            racer.say(spec.job)
        for racer in racers:
            racer.say()
        answers = [racer.answer() for racer in racers]
        assert answers.count("WON") == 1, (lease_there, answers)
        at_write += answers.count("LOST-AT-WRITE")
        winner = f"sup-{answers.index('WON')}"
        assert records.store.read_json(records.bucket, st.lease_name(spec.job))[0]["holder"] \
            == winner
    assert at_write > 0, "no racer lost at the write: they did not race"


def test_a_taker_killed_before_writing_its_ownership_blocks_nobody_past_the_expiry(
        gcs, records, job, children):
    doomed = Child(gcs, records, job, "take-then-hang", "sup-doomed")
    children.append(doomed)
    doomed.expect("READY")
    doomed.say()
    doomed.expect("TOOK")
    doomed.kill()                                       # SIGKILL: no release, no ownership
    now = time.time()
    assert not lease(records, job, "sup-next", Clock(now)).take()     # its lease still runs
    after = lease(records, job, "sup-next", Clock(now + TTL + MARGIN + 1))
    state = take_job(records, after)
    assert state.owner.holder == "sup-next" and st.on_takeover(state) == st.Resume("first")


def test_a_writer_killed_between_reading_and_writing_leaves_the_record_whole(
        gcs, records, job, children):
    writer = Child(gcs, records, job, "update-paused", "sup-w")
    children.append(writer)
    writer.expect("READY")
    writer.say()
    writer.expect("READ")                       # it has read the state and computed nothing yet
    before = records.state(job)
    writer.kill()
    assert records.state(job) == before         # nothing half-written
    taker = lease(records, job, "sup-next", Clock(time.time() + TTL + MARGIN + 1))
    assert take_job(records, taker).owner.token == taker.token
    done = records.update(job, lambda s: st.plan_attempt(s, "r-next", "first", AT),
                          fence=taker.fence)
    assert [a.run_id for a in done.attempts] == ["r-next"]


def test_a_writer_paused_between_reading_and_writing_is_fenced_when_it_wakes(
        gcs, records, job, children):
    """The worst moment: a supervisor reads the state to plan attempt 1, stalls there while
    its lease runs out and another supervisor takes the job and plans its own attempt 1,
    then wakes and writes. Its write is refused (412), it reads again, sees the new owner's
    token and stops: one attempt 1, the new owner's."""
    writer = Child(gcs, records, job, "update-paused", "sup-w")
    children.append(writer)
    writer.expect("READY")
    writer.say()
    writer.expect("READ")
    taker = lease(records, job, "sup-next", Clock(time.time() + TTL + MARGIN + 1))
    assert take_job(records, taker).owner.token == taker.token
    records.update(job, lambda s: st.plan_attempt(s, "r-next", "first", AT), fence=taker.fence)
    writer.say()                                # wake up and write
    assert writer.answer() == "FENCED"
    final = records.state(job)[0]
    assert [a.run_id for a in final.attempts] == ["r-next"]
    assert final.owner.holder == "sup-next"
