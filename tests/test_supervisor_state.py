"""The supervisor's records (tpufab.flows.supervisor.state): the pure transitions and decisions
as data, the job spec that never holds a secret value, and the records in a bucket (the
simulated Cloud Storage, in-process) written with generation preconditions."""

from __future__ import annotations

import inspect
import json
import threading
from dataclasses import replace

import pytest
from helpers import storage_emulator

from tpufab.config import load_settings
from tpufab.errors import ConfigError
from tpufab.flows.supervisor import state as st
from tpufab.flows.supervisor.lease import free, granted, holder_of, renew_due

AT = "2026-12-01T22:00:00Z"


def job_with(*attempts: st.Attempt, **fields) -> st.JobState:
    return st.JobState(job="job-20261201-220000-ab12", attempts=tuple(attempts), **fields)


def ended(number: int, reason: str, outcome: str = "preempted") -> st.Attempt:
    return st.Attempt(number=number, run_id=f"r{number}", reason=reason, phase="ended",
                      outcome=outcome)


# -- the transitions, as data

def test_an_attempt_goes_planned_then_running_then_ended():
    job = st.queued("job-20261201-220000-ab12", AT)
    assert job.state == "queued" and job.last_event.text == "handed over"
    job = st.plan_attempt(job, "r1", "first", AT, workers=[0, 1])
    assert (job.state, job.current.phase, job.current.run_id, job.current.workers) == \
        ("starting", "planned", "r1", (0, 1))
    job = st.attempt_started(job, "r1", AT)
    assert (job.state, job.current.phase) == ("running", "running")
    assert st.attempt_started(job, "r1", AT) == job          # again: nothing changes
    assert st.attempt_started(job, "other", AT) == job       # not the current run: ignored
    job = st.attempt_ended(job, "r1", "preempted", AT)
    assert (job.current.phase, job.current.outcome) == ("ended", "preempted")
    job = st.plan_attempt(job, "r2", "preempted", AT)
    assert (job.state, job.current.number, job.current.reason) == ("recovering", 2, "preempted")
    with pytest.raises(ValueError, match="attempt 2 .* has not ended"):
        st.plan_attempt(job, "r3", "error", AT)
    assert [e.text for e in job.events] == [
        "handed over", "attempt 1 planned (run r1, first)", "attempt 1 running (run r1)",
        "attempt 1 preempted", "attempt 2 planned (run r2, preempted)"]


@pytest.mark.parametrize(("reasons", "preemptions", "errors", "restarts"), [
    (["first"], 0, 0, {}),
    (["first", "preempted", "maintenance"], 2, 0, {"preempted": 1, "maintenance": 1}),
    (["first", "error", "host failure", "error"], 1, 2, {"error": 2, "host failure": 1}),
    (["first", "exit 42", "stalled", "flex-start end"], 1, 0,
     {"exit 42": 1, "stalled": 1, "flex-start end": 1}),
])
def test_restarts_count_against_the_budget_they_belong_to(reasons, preemptions, errors, restarts):
    job = job_with(*(ended(i + 1, r) for i, r in enumerate(reasons)))
    assert (job.preemptions, job.errors, job.restarts) == (preemptions, errors, restarts)


def test_a_job_over_or_asked_to_stop_gets_no_new_attempt():
    over = replace(job_with(ended(1, "first", "finished")), state="finished")
    assert st.plan_attempt(over, "r2", "preempted", AT) == over
    asked = job_with(ended(1, "first"), cancel_requested=True)
    assert st.plan_attempt(asked, "r2", "preempted", AT) == asked
    assert st.finish(over, "cancelled", AT) == over                  # over stays over
    with pytest.raises(ValueError):
        st.finish(asked, "running", AT)


def test_events_are_bounded():
    job = job_with()
    for i in range(st.EVENTS_KEPT + 7):
        job = st.with_event(job, f"e{i}", AT)
    assert len(job.events) == st.EVENTS_KEPT and job.events[-1].text == f"e{st.EVENTS_KEPT + 6}"


PLANNED = st.Attempt(number=2, run_id="r2", reason="preempted", phase="planned")
RUNNING = replace(PLANNED, phase="running")


@pytest.mark.parametrize(("job", "action", "attempt"), [
    (replace(job_with(ended(1, "first", "finished")), state="finished"), "nothing", None),
    (job_with(ended(1, "first"), RUNNING, cancel_requested=True), "cancel", RUNNING),
    (job_with(), "first", None),
    (job_with(ended(1, "first"), PLANNED), "resume", PLANNED),     # start r2 unless it started
    (job_with(ended(1, "first"), RUNNING), "resume", RUNNING),     # re-attach to r2
    (job_with(ended(1, "first")), "next", ended(1, "first")),
])
def test_what_a_supervisor_does_first_with_a_job_it_takes_over(job, action, attempt):
    assert st.on_takeover(job) == st.Resume(action, attempt)


@pytest.mark.parametrize(("job", "holder", "action"), [
    (replace(job_with(), state="cancelled"), None, "ended"),
    (job_with(RUNNING, cancel_requested=True), "sup-a", "asked"),
    (job_with(RUNNING, cancel_requested=True), None, "asked"),
    (job_with(ended(1, "first"), cancel_requested=True), None, "cancel-now"),   # nothing runs
    (job_with(RUNNING), "sup-a", "ask-holder"),
    (job_with(), "sup-a", "ask-holder"),
    (job_with(), None, "cancel-now"),
    (job_with(ended(1, "first")), None, "cancel-now"),
    (job_with(ended(1, "first"), PLANNED), None, "mark"),          # it may have started
    (job_with(RUNNING), None, "mark"),
])
def test_what_cancel_does_by_state_and_holder(job, holder, action):
    assert st.cancel_plan(job, holder).action == action


def test_cancel_now_ends_the_job_and_mark_only_marks_it():
    now = st.request_cancel(job_with(), None, AT, "alice")
    assert (now.state, now.cancel_requested, now.cancel_requested_by) == ("cancelled", True,
                                                                          "alice")
    marked = st.request_cancel(job_with(RUNNING), None, AT, "alice")
    assert (marked.state, marked.cancel_requested) == ("queued", True)
    assert st.request_cancel(marked, "sup-a", AT, "bob") == marked   # asked once is enough


def test_the_lease_decisions():
    held = granted("sup-a", "t1", now=1000.0, ttl=60.0)
    assert (held.expires_at, held.renewed_at) == (1060.0, 1000.0)
    assert free(None, 0.0)
    assert not free(held, 1060.0 + 10.0, margin=10.0)            # within the margin: still held
    assert free(held, 1060.0 + 10.5, margin=10.0)
    assert holder_of(held, 1030.0) == "sup-a" and holder_of(held, 2000.0) is None
    assert not renew_due(held, 1019.0) and renew_due(held, 1020.0)


# -- the records' shapes

def test_records_read_back_as_written_and_unknown_versions_are_refused():
    job = st.plan_attempt(st.queued("job-20261201-220000-ab12", AT), "r1", "first", AT, [0, 1])
    job = replace(job, owner=st.Owner("sup-a", "tok"))
    assert st.JobState.from_record(job.to_record()) == job
    spec = st.JobSpec(job=job.job, pod=st.PodRef("demo", "us-central2-b", "p"),
                      recipe="recipes/x.sh", code=st.Code.of("abc"), args=("--n", "1"),
                      options={"max_restarts": 5}, env={"A": "1"}, secrets=("HF_TOKEN",))
    assert st.JobSpec.from_record(spec.to_record()) == spec
    with pytest.raises(Exception, match="state version 1.* upgrade tpufab"):
        st.JobState.from_record({**job.to_record(), "version": 2})
    with pytest.raises(Exception, match="spec version 2.* upgrade tpufab"):
        st.JobSpec.from_record({**spec.to_record(), "version": 9})
    with pytest.raises(Exception, match="spec version 2.* upgrade tpufab"):
        st.JobSpec.from_record({**spec.to_record(), "version": "1"})


def test_a_spec_carries_its_environment_and_only_then_is_version_2():
    from tpufab.config import Settings
    from tpufab.steps.host.environment import EnvSpec
    from tpufab.steps.runs.env import virtual_env

    settings = Settings(name="demo", project="p", zone="us-central2-b")
    env = EnvSpec("requirements", "requirements.txt",
                  {"requirements.txt": b"-r base.txt\nnumpy\n", "base.txt": b"rich\n"},
                  "3.11", "~/envs/train", None)
    plain = st.job_spec(settings, "job-20261201-220000-ab12", "x.sh", code=st.Code.of("abc"))
    carried = st.job_spec(settings, "job-20261201-220000-cd34", "x.sh", code=st.Code.of("abc"),
                          environment=env)
    assert (plain.to_record()["version"], plain.env_spec()) == (1, None)  # old readers read it
    record = carried.to_record()
    assert record["version"] == 2
    assert record["environment"]["files"] == {"requirements.txt": "-r base.txt\nnumpy\n",
                                              "base.txt": "rich\n"}
    back = st.JobSpec.from_record(json.loads(json.dumps(record)))
    assert back.env_spec() == env
    assert st.JobSpec.from_record(json.loads(json.dumps(plain.to_record()))) == plain
    assert virtual_env(replace(settings, environment=env.setting())) == "~/envs/train"


def test_the_job_carries_every_babysit_option_with_babysits_defaults():
    from tpufab.pod.api import Pod
    from tpufab.verbs.declare import HOOKS

    params = inspect.signature(Pod.babysit).parameters
    options = {n: p.default for n, p in params.items()    # the sinks are the caller's, not the job's
               if n not in ("self", "recipe", "args", "env", "poll", "remote", *HOOKS)}
    assert options == st.BABYSIT_OPTIONS
    with pytest.raises(ValueError, match="not babysit options: colour"):
        st.JobSpec(job="j", pod=st.PodRef("p", "z"), recipe="r", code=st.Code.of("c"),
                   options={"colour": True})


@pytest.mark.parametrize(("given", "project", "bucket"), [
    ("gs://my-records/", None, "my-records"),
    ("my-records", "p", "my-records"),
    (None, "my-project", "my-project-tpufab"),
    (None, "example.com:big-proj", "example-com-big-proj-tpufab"),
])
def test_the_bucket_is_the_setting_else_named_after_the_project(given, project, bucket):
    settings = load_settings({"supervisor_bucket": given, "project": project}, env={})
    assert st.bucket_for(settings) == bucket


def test_bad_supervisor_settings_are_one_sentence():
    with pytest.raises(ConfigError, match="No project given.*supervisor_bucket"):
        st.bucket_for(load_settings({}, env={}))
    with pytest.raises(ConfigError, match="not a Cloud Storage bucket name"):
        st.bucket_for(load_settings({"supervisor_bucket": "Bad_Name!"}, env={}))
    assert st.idle_seconds(load_settings({}, env={})) == 3600.0
    with pytest.raises(ConfigError, match="supervisor_idle"):
        st.idle_seconds(load_settings({"supervisor_idle": "soon"}, env={}))
    assert st.check_supervisor_name("tpufab-supervisor") == "tpufab-supervisor"
    with pytest.raises(ConfigError, match="not a Compute Engine instance name"):
        st.check_supervisor_name("Supervisor_1")
    with pytest.raises(ConfigError, match="is not a job id"):
        st.check_job_id("job-1")


# -- the spec never holds a secret value

SECRETS = {"HF_TOKEN": "hf_abcdefghijklmnop", "WANDB_API_KEY": "wandb-0123456789abcdef",
           "MY_TOKEN": "tok-value-0123456789", "OPAQUE": "opaque-value-0123456789"}
GIT_TOKEN = "ghp_notreallyatoken0123456789"


def test_a_handed_over_job_leaves_no_secret_value_in_the_bucket(records, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", SECRETS["HF_TOKEN"])           # always forwarded
    monkeypatch.setenv("WANDB_API_KEY", SECRETS["WANDB_API_KEY"])
    monkeypatch.setenv("PUBLIC_FLAG", "visible-value")
    settings = load_settings({"name": "demo", "project": "p"}, env={})
    spec = st.job_spec(settings, st.new_job_id(), "recipes/train.sh",
                       code=st.Code.of("abc123", remote=f"https://x:{GIT_TOKEN}@github.com/o/r"),
                       env=["WANDB_API_KEY", f"MY_TOKEN={SECRETS['MY_TOKEN']}", "PUBLIC_FLAG",
                            "STEPS=10"],
                       secret=[f"OPAQUE={SECRETS['OPAQUE']}"], args=["--steps", "10"],
                       options={"max_restarts": 5, "stall": "15m"})
    records.create(spec)
    assert spec.secrets == ("HF_TOKEN", "MY_TOKEN", "OPAQUE", "WANDB_API_KEY")
    assert spec.env == {"PUBLIC_FLAG": "visible-value", "STEPS": "10"}
    assert spec.code.remote == "https://github.com/o/r"
    assert spec.options == {"max_restarts": 5, "stall": "15m"}   # defaults are not written
    stored = records.store.list(records.bucket, st.job_prefix(spec.job)).blobs
    assert {b.name for b in stored} == {st.spec_name(spec.job), st.state_name(spec.job)}
    for blob in stored:
        data = records.store.read(records.bucket, blob.name)[0].decode()
        for value in (*SECRETS.values(), GIT_TOKEN):
            assert value not in data, (blob.name, value)
    assert "visible-value" in records.store.read(records.bucket, st.spec_name(spec.job))[0].decode()


def test_a_spec_refuses_a_secret_value_and_a_url_with_credentials():
    with pytest.raises(ValueError, match="secret values do not go into a job's spec: HF_TOKEN"):
        st.JobSpec(job="j", pod=st.PodRef("p", "z"), recipe="r", code=st.Code.of("c"),
                   env={"HF_TOKEN": "x"})
    with pytest.raises(ValueError, match="secret values .*: OPAQUE"):
        st.JobSpec(job="j", pod=st.PodRef("p", "z"), recipe="r", code=st.Code.of("c"),
                   env={"OPAQUE": "x"}, secrets=("OPAQUE",))
    with pytest.raises(ValueError, match="without credentials"):
        st.Code(commit="c", remote=f"https://{GIT_TOKEN}@github.com/o/r")


# -- the records in a bucket

@pytest.fixture(scope="module")
def gcs():
    with storage_emulator("sup-records") as emulator:
        yield emulator


@pytest.fixture()
def records(gcs):
    from tpufab.cloud.storage import Storage

    return st.Records(Storage(gcs.url), "sup-records")


def new_job(records) -> str:
    spec = st.JobSpec(job=st.new_job_id(), pod=st.PodRef("demo", "z"), recipe="r",
                      code=st.Code.of("c"))
    records.create(spec)
    return spec.job


def test_a_job_is_created_once(records):
    from tpufab.cloud.storage import PreconditionFailed

    job = new_job(records)
    spec = records.spec(job)
    with pytest.raises(PreconditionFailed, match="exists already"):
        records.create(spec)
    assert records.state(job)[0].state == "queued"
    assert job in records.job_ids()


def test_concurrent_updates_lose_nothing(records):
    """Four writers at once, ten changes each: every one of the 40 is in the record (each
    write is over the generation it was computed from; a 412 computes again)."""
    job = new_job(records)
    start = threading.Barrier(4)
    failures = []

    def writer(w: int) -> None:
        start.wait()
        try:
            for k in range(10):
                records.update(job, lambda s, w=w, k=k: st.with_event(s, f"w{w}-{k}", AT))
        except Exception as exc:  # noqa: BLE001 - the test reports it
            failures.append(exc)

    threads = [threading.Thread(target=writer, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not failures
    texts = [e.text for e in records.state(job)[0].events]
    assert sorted(texts[1:]) == sorted(f"w{w}-{k}" for w in range(4) for k in range(10))
    for w in range(4):      # each writer's own changes in its order
        mine = [t for t in texts if t.startswith(f"w{w}-")]
        assert mine == [f"w{w}-{k}" for k in range(10)]


def test_a_write_whose_answer_was_lost_is_not_applied_twice(gcs, records):
    """A conditional write lands but its answer is lost; the retry gets 412. The update sees
    its own write id in the record and stops there, rather than applying the change again."""
    from tpufab.cloud.storage import PreconditionFailed, Storage

    class LosesAnswers(Storage):
        lost = 0

        def put_json(self, bucket, name, value, **conditions):
            blob = super().put_json(bucket, name, value, **conditions)
            if name.endswith("state.json") and not self.lost:
                self.lost += 1
                raise PreconditionFailed("the retry of a write that landed")
            return blob

    job = new_job(records)
    flaky = st.Records(LosesAnswers(gcs.url), records.bucket)
    after = flaky.update(job, lambda s: st.with_event(s, "once", AT))
    assert [e.text for e in records.state(job)[0].events] == ["handed over", "once"]
    assert after.write == records.state(job)[0].write


def test_an_update_of_a_job_that_is_not_there_is_one_sentence(records):
    with pytest.raises(st.UnknownJob, match="No job job-20991231-000000-0000 in "
                                            "gs://sup-records"):
        records.update("job-20991231-000000-0000", lambda s: s)


def test_a_job_is_found_by_its_id_or_a_unique_part_of_it(records):
    job = new_job(records)
    assert records.find(job) == job
    assert records.find(job[-4:]) == job
    with pytest.raises(st.UnknownJob, match="No job nothing-like-it in gs://sup-records; "
                                            "`tpufab jobs` lists"):
        records.find("nothing-like-it")
    with pytest.raises(st.UnknownJob, match="names .* jobs .* give more of the id"):
        records.find("job-")


def test_a_missing_bucket_says_so(gcs):
    from tpufab.cloud.storage import Storage

    missing = st.Records(Storage(gcs.url), "sup-never-made")
    with pytest.raises(st.BucketMissing, match="gs://sup-never-made does not exist"):
        missing.job_ids()
