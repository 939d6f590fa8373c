"""`tpufab babysit --remote` and the supervisor's service on a simulated v4-8 (1 worker),
the service run as a plain local process (what the supervisor VM's systemd unit runs):

- the job handed over from a checkout (--direct: its commit bundled into the bucket), the
  command returns; two services race for it and one launches; the holder is SIGKILLed in
  the middle of the attempt and started again; whichever takes the job once the lease ran
  out re-attaches to the run (started once on the worker: the recipe counts its starts
  there); then `jobs cancel` stops the run on the pod and the job is cancelled, its records
  kept;
- a job preempted under the service: relaunched, counted as a preemption (the error budget
  untouched), finished; `jobs --json` and `jobs logs` show both attempts; its project's
  `environment:` (a package from an index on loopback, tests/pyindex.py) is the laptop's,
  not the service's: both attempts run inside it, the recovered node's built by the service
  before the recipe;
- a job with a secret, handed over while no service runs: it waits ("needs secrets") under
  the service until `tpufab jobs secrets JOB` hands the value from the laptop's environment
  (refused in one sentence while it is not set there); then its run is named by `runs`,
  `status` and `logs` as the job's, and `kill` of it says that `tpufab jobs cancel JOB` stops
  the job (the kill fails the job: no error budget); the value is in no object of the job.

(What `--remote` refuses before anything is made: tests/test_supervisor_service.py.)"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from harness import sim_node
from helpers import in_worker, tpufab, unique_name, wait_for
from pyindex import PackageIndex

from tpufab.cloud.storage import Storage
from tpufab.flows.supervisor import state as st

pytestmark = pytest.mark.sim

RECIPE = """#!/bin/sh
echo "$TPUFAB_RUN_ID" >> "$HOME/starts-$JOB_TAG.log"
echo "attempt $TPUFAB_RESTART_COUNT of $JOB_TAG in $(basename "$PWD") at $(cat version.txt)"
if [ -n "$HF_TOKEN" ]; then echo "a token of ${#HF_TOKEN} characters"; fi
if [ -n "$VIRTUAL_ENV" ]; then
    "$VIRTUAL_ENV/bin/python" -c 'import sys, tfa_alpha; print("tfa_alpha", tfa_alpha.VERSION, "in", sys.prefix)'
fi
if [ "$TPUFAB_RESTART_COUNT" = 0 ]; then
    while [ ! -f "$HOME/release-$JOB_TAG" ]; do sleep 0.1; done
    echo "released"
fi
echo "finished attempt $TPUFAB_RESTART_COUNT"
"""


def git(cwd: Path, *args: str) -> str:
    env = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t", "PATH": "/usr/bin:/bin", "HOME": str(cwd)}
    return subprocess.run(["git", *args], cwd=cwd, env=env, check=True, capture_output=True,
                          text=True).stdout.strip()


@pytest.fixture(scope="module")
def pod1(sim, tmp_path_factory):
    with sim_node(sim, tmp_path_factory, "sup", "v4-8") as pod:
        repo = pod.home / "model"
        repo.mkdir()
        git(repo, "init", "-q", "-b", "main")
        (repo / "version.txt").write_text("v1\n")
        (repo / "train.sh").write_text(RECIPE)
        (repo / "train.sh").chmod(0o755)
        git(repo, "add", ".")
        git(repo, "commit", "-q", "-m", "v1")
        pod.repo = repo
        yield pod


@pytest.fixture
def bucket(pod1):
    name = unique_name("sup-b")
    Storage(pod1.sim.storage_endpoint).create_bucket(name, project=pod1.sim.project)
    return name


class Services:
    """Supervisor services as local processes; each its own state dir (no shared babysit
    lock: only the lease keeps them apart); every one still running is killed at the end."""

    def __init__(self, pod, bucket: str, tmp: Path):
        self.pod, self.bucket, self.tmp = pod, bucket, tmp
        self.procs: dict[str, subprocess.Popen] = {}

    def start(self, name: str) -> subprocess.Popen:
        env = {**self.pod.env, "TPUFAB_STATE_DIR": str(self.tmp / f"{name}-state")}
        log = open(self.tmp / f"{name}.log", "ab")   # noqa: SIM115 - the child holds it
        proc = subprocess.Popen(
            [sys.executable, "-m", "tpufab.flows.supervisor", "serve", "--bucket",
             self.bucket, "--name", name, "--workdir", str(self.tmp / f"{name}-work"),
             "--poll", "0.5", "--lease-ttl", "6", "--lease-margin", "1",
             "--babysit-poll", "0.3", "--flush", "0.3", "--backoff", "0",
             "--secrets-dir", str(self.tmp / f"{name}-secrets")],
            env=env, stdout=log, stderr=log, cwd=self.tmp)
        self.procs[name] = proc
        return proc

    def log(self, name: str) -> str:
        return (self.tmp / f"{name}.log").read_text(errors="replace")

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)


@pytest.fixture
def services(pod1, bucket, tmp_path):
    made = Services(pod1, bucket, tmp_path)
    yield made
    made.stop()


def records(pod1, bucket) -> st.Records:
    return st.Records(Storage(pod1.sim.storage_endpoint), bucket)


def hand_over(pod1, bucket: str, tag: str, *extra: str, extra_env: dict | None = None,
              said: str = "") -> str:
    out = tpufab("babysit", "train.sh", "--remote", "--env", f"JOB_TAG={tag}", *extra, env=pod1.env, cwd=pod1.repo,
                 extra_env={"TPUFAB_SUPERVISOR_BUCKET": bucket, "TPUFAB_SUPERVISOR_VM": "0",
                            **(extra_env or {})})
    assert out.returncode == 0, out.stderr
    assert said in out.stderr, out.stderr
    job = out.stdout.strip().splitlines()[-1]
    assert f"tpufab jobs logs {job} --follow" in out.stderr
    assert f"tpufab jobs cancel {job}" in out.stderr
    return job


def state_of(pod1, bucket, job) -> st.JobState:
    return records(pod1, bucket).state(job)[0]


def starts(pod1, tag: str) -> list[str]:
    from tpufab.cloud.planes.tpu import TpuApi

    node = TpuApi(pod1.settings).get_node(pod1.name)
    return in_worker(pod1.sim, node, 0, f"cat /home/tpufab/starts-{tag}.log 2>/dev/null",
                     check=False).split()


def uploaded(pod1, bucket, job: str, attempt: int) -> bytes:
    from tpufab.cloud.storage import chunks

    recs = records(pod1, bucket)
    return b"".join(d for _, d in chunks(recs.store, recs.bucket,
                                         st.logs_prefix(job, attempt, 0)))


def run_ended(pod1, run_id: str) -> bool:
    """The worker's own record of ``run_id`` says it is over (stopped, not running)."""
    from tpufab.flows.babysit.policy import finished
    from tpufab.hosts import connect as pods
    from tpufab.steps.runs import running as jobs

    try:
        pod = pods.shared(pod1.settings)
        answer = jobs.statuses(pod.fanout, [0])[0]
        entry = next(e for e in answer.runs if e.get("run") == run_id)
        return finished(jobs.state_from_status(0, entry))
    finally:
        pods.forget(pod1.settings)


def jobs_cli(pod1, bucket, *args: str):
    return tpufab("jobs", *args, env=pod1.env,
                  extra_env={"TPUFAB_SUPERVISOR_BUCKET": bucket, "TPUFAB_SUPERVISOR_VM": "0"})


def test_two_supervisors_race_one_launches_and_the_other_reattaches_after_a_kill(
        pod1, bucket, services):
    tag = unique_name("race")
    job = hand_over(pod1, bucket, tag)
    assert state_of(pod1, bucket, job).state == "queued"   # nothing runs it yet
    a, b = services.start("sup-a"), services.start("sup-b")
    running = wait_for(lambda: (s := state_of(pod1, bucket, job)).current is not None and
                       s.current.phase == "running" and s, 60,
                       what=lambda: f"the job running: {state_of(pod1, bucket, job)}")
    holder = running.owner.holder
    wait_for(lambda: starts(pod1, tag), 20, what="the recipe to start on the worker")
    # the holder dies in the middle of the attempt and its VM's init starts it again (a new
    # process, a new lease token): whichever of the two takes the job once the lease ran out
    # (ttl 6 s + margin 1 s) follows the run that is still going
    killed = a if holder == "sup-a" else b
    killed.send_signal(signal.SIGKILL)
    killed.wait(10)
    services.start(holder)
    wait_for(lambda: any(e.text == f"re-attached to run {running.current.run_id}"
                         for e in state_of(pod1, bucket, job).events), 40,
             what=lambda: f"a re-attach; logs: {services.log('sup-a')[-1500:]} "
                          f"{services.log('sup-b')[-1500:]}")
    after = state_of(pod1, bucket, job)
    assert after.owner.token != running.owner.token and len(after.attempts) == 1
    other = after.owner.holder
    assert starts(pod1, tag) == [running.current.run_id]     # started once, never again
    # its output is in the bucket, once, whoever uploaded it (the holder uploads what it
    # follows every --flush 0.3 s: on a loaded machine a little later, so it is waited for)
    def uploaded_once():
        logs = jobs_cli(pod1, bucket, "logs", job, "--raw")
        assert logs.returncode == 0, logs.stderr
        return logs.stdout.count(f"attempt 0 of {tag} in model at v1") == 1 or logs.stdout
    assert wait_for(lambda: uploaded_once() is True, 60, 0.5,
                    what=lambda: f"attempt 0's output in the bucket once: {uploaded_once()!r}")

    # cancel: the run stopped on the pod, the job cancelled, its records kept
    out = jobs_cli(pod1, bucket, "cancel", job)
    assert out.returncode == 0, out.stderr
    assert f"asked supervisor {other} to cancel it" in out.stdout + out.stderr
    wait_for(lambda: state_of(pod1, bucket, job).state == "cancelled", 40,
             what=lambda: f"the job cancelled: {state_of(pod1, bucket, job).events[-3:]}")
    final = state_of(pod1, bucket, job)
    assert [(x.phase, x.outcome) for x in final.attempts] == [("ended", "cancelled")]
    assert run_ended(pod1, running.current.run_id)
    assert starts(pod1, tag) == [running.current.run_id]
    listed = json.loads(jobs_cli(pod1, bucket, "--json").stdout)
    assert [(j["id"], j["state"], j["attempts"]) for j in listed] == [(job, "cancelled", 1)]


@pytest.fixture
def environment(pod1, tmp_path):
    """The project configures an environment (committed: the hand-over runs a commit), built
    on the pod from the laptop, as `tpufab setup` would; taken out of the project after."""
    with PackageIndex(tmp_path / "wheels") as index:
        index.add("tfa-alpha", "1.0")
        (pod1.repo / "tpufab.yaml").write_text("environment:\n  requirements: requirements.txt\n")
        (pod1.repo / "requirements.txt").write_text(f"--index-url {index.url}\ntfa-alpha\n")
        git(pod1.repo, "add", "tpufab.yaml", "requirements.txt")
        git(pod1.repo, "commit", "-q", "-m", "environment")
        try:
            built = tpufab("env", "build", env=pod1.env, cwd=pod1.repo, timeout=300)
            assert built.returncode == 0, built.stdout + built.stderr
            yield index
        finally:
            git(pod1.repo, "rm", "-q", "tpufab.yaml", "requirements.txt")
            git(pod1.repo, "commit", "-q", "-m", "no environment")


def test_a_preempted_job_is_relaunched_by_the_supervisor_and_counted_as_a_preemption(
        pod1, bucket, services, sim_admin, environment):
    tag = unique_name("pre")
    job = hand_over(pod1, bucket, tag, "--max-restarts-on-errors", "1")
    wheels = environment.served().get("tfa_alpha-1.0-py3-none-any.whl", 0)
    services.start("sup-a")
    wait_for(lambda: starts(pod1, tag), 60,
             what=lambda: f"attempt 0 to start: {services.log('sup-a')[-2000:]}")
    wait_for(lambda: state_of(pod1, bucket, job).state == "running", 20, what="running")
    # preempted once its first lines are in the bucket (as babysit's fault 5 waits for them
    # in its local copies): what was followed before the preemption is kept
    wait_for(lambda: f"attempt 0 of {tag}".encode() in uploaded(pod1, bucket, job, 1), 20,
             what="attempt 1's first lines in the bucket")
    sim_admin.preempt(pod1.name)
    wait_for(lambda: state_of(pod1, bucket, job).terminal, 150,
             what=lambda: f"the job to end: {state_of(pod1, bucket, job).events[-4:]}; "
                          f"{services.log('sup-a')[-2000:]}")
    final = state_of(pod1, bucket, job)
    assert final.state == "finished", final.events
    assert [(a.reason, a.outcome) for a in final.attempts] == [("first", "preempted"),
                                                               ("preempted", "finished")]
    assert (final.preemptions, final.errors) == (1, 0)
    [row] = json.loads(jobs_cli(pod1, bucket, "--json").stdout)
    assert (row["state"], row["attempts"], row["preemptions"], row["errors"]) == \
        ("finished", 2, 1, 0)
    logs = jobs_cli(pod1, bucket, "logs", job, "--raw")
    assert logs.returncode == 0, logs.stderr
    assert f"attempt 0 of {tag} in model at v1" in logs.stdout
    assert "finished attempt 1" in logs.stdout
    # both attempts inside the project's environment (the service configures none): the
    # recovered node's built by the service, from the index, before attempt 1's recipe
    assert logs.stdout.count("tfa_alpha 1.0 in /home/tpufab/.venv") == 2, logs.stdout
    assert environment.served().get("tfa_alpha-1.0-py3-none-any.whl", 0) == wheels + 1


def test_a_job_waits_for_its_secret_until_jobs_secrets_hands_it_and_its_run_is_named(
        pod1, bucket, services):
    tag = unique_name("sec")
    token = "hf_" + unique_name("value").replace("-", "")
    job = hand_over(pod1, bucket, tag, "--env", "HF_TOKEN", extra_env={"HF_TOKEN": token},
                    said="No supervisor service runs for")   # none yet: it waits

    services.start("sup-a")
    wait_for(lambda: (e := state_of(pod1, bucket, job).last_event) and
             e.text.startswith("needs secrets (HF_TOKEN)"), 40,
             what=lambda: f"the job to wait for its secret: {services.log('sup-a')[-1500:]}")
    out = jobs_cli(pod1, bucket, "secrets", job)
    assert out.returncode == 2 and "HF_TOKEN is not set: export HF_TOKEN here" in out.stderr
    assert "Traceback" not in out.stderr
    out = tpufab("jobs", "secrets", job[-4:], env=pod1.env,
                 extra_env={"TPUFAB_SUPERVISOR_BUCKET": bucket, "TPUFAB_SUPERVISOR_VM": "0",
                            "HF_TOKEN": token})
    assert out.returncode == 0, out.stderr
    assert f"Handed HF_TOKEN of job {job} to supervisor sup-a on this machine" in out.stderr
    assert token not in out.stdout + out.stderr
    running = wait_for(lambda: (s := state_of(pod1, bucket, job)).state == "running" and s, 60,
                       what=lambda: f"the job running: {services.log('sup-a')[-1500:]}")
    run_id = running.current.run_id
    wait_for(lambda: starts(pod1, tag), 20, what="the recipe to start on the worker")

    runs = tpufab("runs", env=pod1.env)
    assert runs.returncode == 0, runs.stderr
    header, *lines = runs.stdout.splitlines()
    assert header.split()[-1] == "JOB"
    assert next(x for x in lines if run_id in x).split()[-1] == job
    note = runs.stderr.strip()           # the earlier tests' jobs are on this pod too
    assert note.startswith("Runs with a JOB are attempts of supervised job") and job in note
    status = tpufab("status", env=pod1.env)
    assert f"supervised job {job}" in status.stdout, status.stdout
    logs = tpufab("logs", "--run", run_id, env=pod1.env)
    assert f"Run {run_id} is an attempt of supervised job {job}" in logs.stderr
    assert f"a token of {len(token)} characters" in logs.stdout

    kill = tpufab("kill", "--run", run_id, env=pod1.env)
    assert kill.returncode == 0, kill.stdout + kill.stderr
    assert (f"is an attempt of supervised job {job}: its supervisor takes the kill for the "
            "recipe failing (exit 143)") in kill.stderr
    assert f"`tpufab jobs cancel {job}`" in kill.stderr
    wait_for(lambda: state_of(pod1, bucket, job).terminal, 40,
             what=lambda: f"the job to end: {state_of(pod1, bucket, job).events[-3:]}")
    final = state_of(pod1, bucket, job)
    assert final.state == "failed"
    assert [(a.run_id, a.outcome, a.exit) for a in final.attempts] == [(run_id, "failed", 143)]
    assert starts(pod1, tag) == [run_id]                   # no budget: not relaunched
    recs = records(pod1, bucket)
    for blob in recs.store.list(recs.bucket, st.job_prefix(job)).blobs:
        assert token.encode() not in recs.store.read(recs.bucket, blob.name)[0], blob.name
