"""`tpufab jobs`, `jobs logs` and `jobs cancel`: the supervisor's bucket read from the laptop
alone (no supervisor VM, no pod), against the simulated Cloud Storage (in-process)."""

from __future__ import annotations

import io
import json
import os
import time

import pytest
from helpers import (
    TPUFAB,
    Running,
    interrupted_when,
    no_traceback,
    ok,
    one_sentence,
    storage_emulator,
    tpufab,
    wait_for,
)

from tpufab.cloud.storage import Appender
from tpufab.flows.supervisor import state as st
from tpufab.flows.supervisor.lease import granted

AT = "2026-12-01T22:00:00Z"


@pytest.fixture(scope="module")
def gcs():
    with storage_emulator() as emulator:
        yield emulator


@pytest.fixture()
def bucket(gcs, request):
    """A bucket of the test's own, as supervisor_bucket."""
    name = "jobs-" + request.node.name.replace("_", "-").lower()[5:40].strip("-")
    gcs.create_bucket(name)
    return name


@pytest.fixture()
def records(gcs, bucket):
    from tpufab.cloud.storage import Storage

    return st.Records(Storage(gcs.url), bucket)


@pytest.fixture()
def env(gcs, bucket, tmp_path):
    base = {k: v for k, v in os.environ.items() if not k.startswith("TPUFAB_")}
    return {**base, "HOME": str(tmp_path), "COLUMNS": "200", "TPUFAB_KEEP_ALIVE": "0",
            "TPUFAB_USER_CONFIG": str(tmp_path / "none.yaml"), "TPUFAB_PROJECT": "proj",
            "TPUFAB_STORAGE_ENDPOINT": gcs.url, "TPUFAB_SUPERVISOR_BUCKET": bucket,
            "TPUFAB_API_RETRIES": "2", "TPUFAB_API_RETRY_SECONDS": "5"}


def hand_over(records, pod="demo", recipe="recipes/train.sh") -> str:
    spec = st.JobSpec(job=st.new_job_id(), pod=st.PodRef(pod, "us-central2-b", "proj"),
                      recipe=recipe, code=st.Code.of("abc123"), args=("--steps", "10"))
    records.create(spec)
    return spec.job


def run_attempts(records, job, *attempts, final=None):
    """Each attempt as (reason, outcome, exit), in turn; ``final``: the job's end."""
    for i, (reason, outcome, code) in enumerate(attempts, start=1):
        records.update(job, lambda s, i=i, r=reason: st.plan_attempt(s, f"r{i}", r, AT, [0, 1]))
        records.update(job, lambda s, i=i: st.attempt_started(s, f"r{i}", AT))
        if outcome is not None:
            records.update(job, lambda s, i=i, o=outcome, c=code: st.attempt_ended(
                s, f"r{i}", o, AT, exit=c))
    if final:
        records.update(job, lambda s: st.finish(s, final, AT))


def append(records, job, attempt, worker, *chunks: bytes) -> None:
    log = Appender(records.store, records.bucket, st.logs_prefix(job, attempt, worker))
    for chunk in chunks:
        log.append(chunk)


# -- jobs

def test_jobs_lists_every_job_with_its_counts(records, env):
    first = hand_over(records)
    run_attempts(records, first, ("first", "preempted", None), ("preempted", "maintenance", None),
                 ("maintenance", "failed", 3), ("error", None, None))
    second = hand_over(records, pod="other", recipe="recipes/eval.sh")
    held = granted("sup-a", "tok", time.time(), 60.0)
    records.store.put_json(records.bucket, st.lease_name(first), held.to_record(),
                           if_generation_match=0)
    table = ok(tpufab("jobs", env=env))
    assert ok(tpufab("jobs", "list", env=env)).splitlines()[0] == table.splitlines()[0]
    lines = {line.split()[0]: line.split() for line in table.splitlines()[1:]}
    assert lines[first][:8] == [first, "demo", "recipes/train.sh", "running", "4", "2", "1",
                                "sup-a"]
    assert lines[second][:8] == [second, "other", "recipes/eval.sh", "queued", "0", "0", "0",
                                 "-"]
    data = {j["id"]: j for j in json.loads(ok(tpufab("jobs", "--json", env=env)))}
    assert {k: data[first][k] for k in ("id", "pod", "recipe", "state", "attempts",
                                        "preemptions", "errors", "supervisor")} == {
        "id": first, "pod": "demo", "recipe": "recipes/train.sh", "state": "running",
        "attempts": 4, "preemptions": 2, "errors": 1, "supervisor": "sup-a"}
    assert data[first]["restarts"] == {"preempted": 1, "maintenance": 1, "error": 1}
    assert [r["run_id"] for r in data[first]["runs"]] == ["r1", "r2", "r3", "r4"]
    assert data[second]["state"] == "queued" and data[second]["supervisor"] is None


def test_jobs_in_an_empty_bucket_and_buckets_that_cannot_be_read(gcs, env, bucket):
    result = tpufab("jobs", env=env)
    assert ok(result) == "" and "No supervised jobs" in result.stderr
    assert json.loads(ok(tpufab("jobs", "--json", env=env))) == []
    one_sentence(tpufab("jobs", env={**env, "TPUFAB_SUPERVISOR_BUCKET": "jobs-never-made"}),
                 "The supervisor bucket gs://jobs-never-made does not exist",
                 "supervisor_bucket")
    gcs.deny(bucket)
    try:
        one_sentence(tpufab("jobs", env=env), f"Cloud Storage refused to list gs://{bucket}",
                     "403", "roles/storage.objectViewer")
    finally:
        gcs.allow(bucket)
    no_project = {k: v for k, v in env.items()
                  if k not in ("TPUFAB_PROJECT", "TPUFAB_SUPERVISOR_BUCKET")}
    result = tpufab("jobs", env=no_project)
    one_sentence(result, "No project given", "supervisor_bucket")
    assert result.returncode == 2


# -- jobs logs

def folded(per_worker: dict[int, list[bytes]], raw: bool = False) -> str:
    """What `tpufab logs` prints for these chunks (the one printer, fed the same chunks)."""
    from tpufab.views.runlogs import print_logs

    class Log:
        def __init__(self, chunks):
            self._chunks = chunks

        def chunks(self):
            return iter(self._chunks)

    out = io.BytesIO()
    print_logs({w: Log(c) for w, c in per_worker.items()}, raw=raw, color=False, secrets=[],
               out=out)
    return out.getvalue().decode()


ATTEMPT_1 = {0: [b"loading\nrank ", b"0 ready\nstep 1\n", b"preempted\n"],
             1: [b"loading\nrank 1 ready\nstep 1\n", b"preempted\n"]}
ATTEMPT_2 = {0: [b"restored\nstep 2\ndone\n"], 1: [b"restored\nstep 2\n", b"done\n"]}


def test_jobs_logs_prints_every_attempt_folded_as_logs_folds(records, env):
    job = hand_over(records)
    run_attempts(records, job, ("first", "preempted", None), ("preempted", "finished", 0),
                 final="finished")
    for attempt, logs in ((1, ATTEMPT_1), (2, ATTEMPT_2)):
        for worker, chunks in logs.items():
            append(records, job, attempt, worker, *chunks)
    result = tpufab("jobs", "logs", job[-4:], env=env)       # a unique end of the id will do
    assert ok(result) == folded(ATTEMPT_1) + folded(ATTEMPT_2)
    assert "rank {0,1} ready" in result.stdout and result.stdout.count("step 1") == 1
    headers = [line for line in result.stderr.splitlines() if line.startswith("attempt")]
    assert headers == ["attempt 1: run r1 (first; preempted)",
                       "attempt 2: run r2 (preempted; finished, exit 0)"]
    raw = ok(tpufab("jobs", "logs", job, "--raw", env=env))
    assert raw == folded(ATTEMPT_1, raw=True) + folded(ATTEMPT_2, raw=True)


def test_jobs_logs_of_a_job_without_output_and_of_an_unknown_job(records, env):
    job = hand_over(records)
    result = tpufab("jobs", "logs", job, env=env)
    assert ok(result) == "" and f"Job {job} has no output yet (queued)." in result.stderr
    result = tpufab("jobs", "logs", "job-20991231-000000-ffff", env=env)
    one_sentence(result, "No job job-20991231-000000-ffff in gs://", "`tpufab jobs` lists")
    assert result.returncode == 2


def test_jobs_logs_follow_goes_on_across_attempts_until_the_job_is_over(records, env):
    job = hand_over(records)
    run_attempts(records, job, ("first", None, None))
    append(records, job, 1, 0, b"a1 line 1\n")
    append(records, job, 1, 1, b"a1 line 1\n")
    follower = Running([TPUFAB, "jobs", "logs", job, "--follow"], env=env)
    try:
        wait_for(lambda: follower.saw("a1 line 1"), timeout=60, what="the first line")
        append(records, job, 1, 0, b"a1 line 2\n")       # written while it follows
        append(records, job, 1, 1, b"a1 line 2\n")
        wait_for(lambda: follower.saw("a1 line 2"), timeout=60, what="a line written later")
        records.update(job, lambda s: st.attempt_ended(s, "r1", "preempted", AT))
        records.update(job, lambda s: st.plan_attempt(s, "r2", "preempted", AT, [0, 1]))
        append(records, job, 2, 0, b"a2 line 1\n")
        append(records, job, 2, 1, b"a2 line 1\n")
        wait_for(lambda: follower.saw("a2 line 1"), timeout=60, what="attempt 2's line")
        records.update(job, lambda s: st.attempt_ended(s, "r2", "finished", AT, exit=0))
        records.update(job, lambda s: st.finish(s, "finished", AT))
        result = follower.wait(timeout=60)
    finally:
        follower.kill()
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["a1", "line", "1", "a1", "line", "2", "a2", "line", "1"]
    assert "attempt 2: run r2 (preempted" in result.stderr
    assert f"Job {job} finished." in result.stderr


def test_jobs_logs_follow_stops_on_ctrl_c_and_the_job_goes_on(records, env):
    job = hand_over(records)
    run_attempts(records, job, ("first", None, None))
    append(records, job, 1, 0, b"working\n")
    result = interrupted_when([TPUFAB, "jobs", "logs", job, "-f"], env,
                              lambda running: running.saw("working"), "the first line")
    assert result.returncode == 130, result.stderr
    no_traceback(result)
    assert f"Stopped following job {job}; it goes on under its supervisor." in result.stderr
    assert records.state(job)[0].state == "running"


# -- jobs cancel

def test_cancel_of_a_job_with_nothing_running_and_nobody_holding_it_cancels_it(records, env):
    job = hand_over(records)
    result = tpufab("jobs", "cancel", job, env=env)
    ok(result)
    assert f"Cancelled job {job}: no attempt of it was running" in result.stderr
    state = records.state(job)[0]
    assert (state.state, state.cancel_requested) == ("cancelled", True)
    again = tpufab("jobs", "cancel", job, env=env)
    assert f"Job {job} already ended (cancelled)" in ok(again) + again.stderr


def test_cancel_with_no_supervisor_marks_the_job_and_says_how_to_stop_the_run(records, env):
    job = hand_over(records)
    run_attempts(records, job, ("first", None, None))
    result = tpufab("jobs", "cancel", job, env=env)
    ok(result)
    assert f"No supervisor holds job {job} now, so it is marked for cancelling" in result.stderr
    assert "tpufab kill --run r1 --name demo --zone us-central2-b" in result.stderr
    state = records.state(job)[0]
    assert (state.state, state.cancel_requested) == ("running", True)
    again = tpufab("jobs", "cancel", job, env=env)
    assert "was already marked for cancelling" in ok(again) + again.stderr
    listed = json.loads(ok(tpufab("jobs", "--json", env=env)))
    assert listed[0]["cancel_requested"] is True


def test_cancel_of_a_held_job_asks_its_supervisor(records, env):
    job = hand_over(records)
    run_attempts(records, job, ("first", None, None))
    held = granted("sup-a", "tok", time.time(), 60.0)
    records.store.put_json(records.bucket, st.lease_name(job), held.to_record(),
                           if_generation_match=0)
    result = tpufab("jobs", "cancel", job, env=env)
    ok(result)
    assert f"Job {job} asked supervisor sup-a to cancel it: the supervisor stops its run r1 " \
           "on pod demo" in result.stderr
    assert records.state(job)[0].cancel_requested


def test_cancel_of_an_unknown_job_is_one_sentence(records, env):
    hand_over(records)
    result = tpufab("jobs", "cancel", "nope", env=env)
    one_sentence(result, "No job nope in gs://")
    assert result.returncode == 2
