"""The babysit hooks the supervisor plugs in (flows/babysit/hooks.py), on a babysitter whose
steps on the pod are scripted (no pod): each attempt planned with its run id before it is
started (and before the node is recovered for it), the attempt before it handed along so
that "ended" and "planned" are one write; a resumed babysit continues the budgets and the
run id it was given; "should I go on" stops it before a step that acts. Then the service's
side against the simulated Cloud Storage: the hooks' writes (fenced on the lease), the
output uploaded as chunks (a re-attached follower's repeated bytes skipped), the attempts
before a resumed one as babysit's records."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import storage_emulator

from tpufab.cloud.nodes import Node
from tpufab.config import Settings
from tpufab.flows.babysit import hooks, loop, records
from tpufab.flows.babysit.policy import BabysitError
from tpufab.flows.supervisor import service as sv
from tpufab.flows.supervisor import state as st
from tpufab.flows.supervisor.lease import Lease, LeaseLost, take_job


class Recording(hooks.Hooks):
    def __init__(self, log: list, stop_after: int | None = None):
        self.log = log
        self.stop_after = stop_after

    def planned(self, number, run_id, reason, ended):
        self.log.append(("planned", number, run_id, reason,
                         None if ended is None else (ended.number, ended.outcome)))

    def ended(self, attempt, final):
        self.log.append(("ended", attempt.number, final))

    def go_on(self):
        attempts = sum(1 for e in self.log if e[0] == "attempt")
        return "cancel" if self.stop_after is not None and attempts >= self.stop_after else None


class Scripted(loop.Babysitter):
    """A babysitter whose pod steps are scripted: each attempt ends as ``outcomes`` says."""

    def __init__(self, *args, outcomes, log, **kw):
        super().__init__(*args, sleep=lambda _s: None, **kw)
        self.outcomes = list(outcomes)
        self.log = log

    def _api(self):
        return [Node(name=self.name, project="p", zone="z", accelerator_type="v4-8",
                     state="READY", runtime_version="rt")], None

    def _capture(self):
        pass

    def _deploy_first(self):
        self.log.append(("deploy",))

    def _recover(self, reason):
        self.go_on("recovering the node")
        self.log.append(("recover",))

    def _attempt(self, number, restarts, run_id, *, attach=None):
        self.log.append(("attempt", number, restarts, run_id, attach))
        outcome = self.outcomes.pop(0)
        why = f"TPU node {self.name} was PREEMPTED" if outcome == "preempted" else "scripted"
        return records.Attempt(number, run_id, outcome, why, Path("/nonexistent"),
                               {0: "exited 1" if outcome == "failed" else "lost"},
                               own_codes={0: 1} if outcome == "failed" else {})


@pytest.fixture
def recipe(tmp_path) -> Path:
    path = tmp_path / "train.sh"
    path.write_text("#!/bin/sh\necho hi\n")
    return path


def sitter(tmp_path, recipe, log, outcomes, **kw) -> Scripted:
    settings = Settings(name="pod-a", project="p", zone="us-central2-b",
                        state_dir=str(tmp_path / "state"))
    return Scripted(settings, recipe, outcomes=outcomes, log=log, base_dir=tmp_path / "runs",
                    backoff=(0.0, 0.0), **kw)


def test_each_attempt_is_planned_with_its_run_id_before_it_starts_and_before_recovery(
        tmp_path, recipe):
    log: list = []
    result = sitter(tmp_path, recipe, log, ["preempted", "finished"],
                    hooks=Recording(log)).run()
    kinds = [e[0] for e in log]
    assert kinds == ["deploy", "planned", "attempt", "planned", "recover", "attempt", "ended"]
    first, second = log[1], log[3]
    assert first[1:4] == (0, log[2][3], "first") and first[4] is None
    # attempt 1's run id is the one planned, planned with attempt 0 as it ended
    assert second[1] == 1 and second[2] == log[5][3] and second[3] == "preempted"
    assert second[4] == (0, "preempted")
    assert log[-1] == ("ended", 1, "finished")
    assert [a.run_id for a in result.attempts] == [first[2], second[2]]


def test_without_hooks_babysit_plans_nothing_and_runs_as_before(tmp_path, recipe):
    log: list = []
    result = sitter(tmp_path, recipe, log, ["preempted", "finished"]).run()
    assert [e[0] for e in log] == ["deploy", "attempt", "recover", "attempt"]
    assert result.restart_counts == {"preempted": 1}


def test_a_resumed_babysit_keeps_the_run_id_and_the_budgets_spent(tmp_path, recipe):
    log: list = []
    done = [records.Attempt(0, "r0", "preempted", "x", tmp_path, restart="preempted",
                            restart_kind="preempted"),
            records.Attempt(1, "r1", "failed", "x", tmp_path, restart="error",
                            restart_kind="error")]
    s = sitter(tmp_path, recipe, log, ["failed"], hooks=Recording(log),
               resume=hooks.Resume("r2", done), max_restarts_on_errors=1)
    with pytest.raises(BabysitError, match=r"error budget is spent \(1 of 1 used\)"):
        s.run()
    # no new plan for the resumed attempt: it is attempt 2, restart 2, run r2, attached to
    assert [e for e in log if e[0] in ("planned", "attempt")] == [("attempt", 2, 2, "r2", "r2")]


def test_go_on_stops_the_babysit_before_the_next_step_that_acts(tmp_path, recipe):
    log: list = []
    s = sitter(tmp_path, recipe, log, ["preempted", "finished"],
               hooks=Recording(log, stop_after=1))
    with pytest.raises(hooks.Stopped) as stopped:
        s.run()
    assert stopped.value.why == "cancel" and stopped.value.step == "recovering the node"
    assert [e[0] for e in log] == ["deploy", "planned", "attempt", "planned"]


# -- the service's side of the hooks, against the simulated Cloud Storage ---------------------


@pytest.fixture()
def gcs():
    with storage_emulator("sup-hooks") as emulator:
        yield emulator


@pytest.fixture()
def held(gcs):
    from tpufab.cloud.storage import Storage

    recs = st.Records(Storage(gcs.url), "sup-hooks")
    spec = st.JobSpec(job=st.new_job_id(), pod=st.PodRef("demo", "z"), recipe="r",
                      code=st.Code.of("c"))
    recs.create(spec)
    lease = Lease(recs.store, recs.bucket, spec.job, "sup-a", ttl=30, margin=2)
    assert take_job(recs, lease) is not None
    return recs, lease, spec.job


def test_the_hooks_write_plan_start_and_end_fenced_on_the_lease(held):
    import threading

    recs, lease, job = held
    h = sv.JobHooks(recs, lease, job, shutdown=threading.Event(), log=lambda _t: None)
    h.planned(0, "20261202-010000-aaaa", "first", None)
    s = recs.state(job)[0]
    assert (s.state, s.current.phase, s.current.run_id) == ("starting", "planned",
                                                            "20261202-010000-aaaa")
    h.started(0, "20261202-010000-aaaa", [0], attached=False)
    assert recs.state(job)[0].current.phase == "running"
    lost = records.Attempt(0, "20261202-010000-aaaa", "preempted", "node PREEMPTED", Path("."))
    h.planned(1, "20261202-010100-bbbb", "preempted", lost)
    s = recs.state(job)[0]       # one write: attempt 1 ended, attempt 2 planned
    assert [(a.number, a.phase, a.outcome) for a in s.attempts] == [
        (1, "ended", "preempted"), (2, "planned", None)]
    assert (s.preemptions, s.errors) == (1, 0)
    # a supervisor that lost the lease writes nothing more
    lease.lost = True
    assert h.go_on() == "lost"
    with pytest.raises(LeaseLost):
        h.started(1, "20261202-010100-bbbb", [0], attached=False)
    assert recs.state(job)[0].current.phase == "planned"


def test_a_cancel_asked_refuses_the_next_plan(held):
    import threading

    recs, lease, job = held
    h = sv.JobHooks(recs, lease, job, shutdown=threading.Event(), log=lambda _t: None)
    h.planned(0, "20261202-010000-aaaa", "first", None)
    recs.update(job, lambda s: st.request_cancel(s, "sup-a", recs.now(), "me"))
    ended = records.Attempt(0, "20261202-010000-aaaa", "failed", "exit 1", Path("."),
                            own_codes={0: 1})
    with pytest.raises(hooks.Stopped):
        h.planned(1, "20261202-010100-bbbb", "error", ended)
    s = recs.state(job)[0]
    assert [(a.phase, a.exit) for a in s.attempts] == [("ended", 1)] and h.cancel.is_set()


def test_the_output_goes_up_as_chunks_and_a_reattached_follower_skips_what_is_there(held):
    from tpufab.cloud.storage import chunks

    recs, _, job = held
    up = sv.Upload(recs, job, 1, [0], every=60)
    up.lines(0, "stdout", b"step 1\n")
    up.lines(0, "stdout", b"step 2\n")
    up.close()
    again = sv.Upload(recs, job, 1, [0], every=60)      # the follower streams from the start
    again.lines(0, "stdout", b"step 1\nst")
    again.lines(0, "stdout", b"ep 2\nstep 3\n")
    again.lines(1, "stdout", b"worker 1\n")              # a worker seen late
    again.close()
    got = b"".join(d for _, d in chunks(recs.store, recs.bucket, st.logs_prefix(job, 1, 0)))
    assert got == b"step 1\nstep 2\nstep 3\n"
    assert b"".join(d for _, d in chunks(recs.store, recs.bucket,
                                         st.logs_prefix(job, 1, 1))) == b"worker 1\n"


def test_the_attempts_before_a_resumed_one_count_as_babysits_restarts():
    at = "2026-12-02T01:00:00Z"
    s = st.queued("job-20261202-010000-abcd", at)
    s = st.plan_attempt(s, "r1", "first", at)
    s = st.attempt_ended(s, "r1", "preempted", at)
    s = st.plan_attempt(s, "r2", "preempted", at)
    s = st.attempt_ended(s, "r2", "failed", at, exit=1)
    s = st.plan_attempt(s, "r3", "error", at)
    done = sv.history_of(s, Path("/runs"))
    assert [(a.number, a.run_id, a.restart_kind) for a in done] == [
        (0, "r1", "preempted"), (1, "r2", "error")]
    assert records.restart_counts(done) == {"preempted": 1, "error": 1}


def test_a_supervisor_that_lost_the_job_uploads_nothing_more(held):
    recs, _, job = held
    up = sv.Upload(recs, job, 1, [0], every=60, may_write=lambda: False)
    up.lines(0, "stdout", b"late line\n")
    up.close()
    assert recs.store.list(recs.bucket, st.logs_prefix(job, 1)).blobs == []
