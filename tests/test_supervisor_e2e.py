"""The supervisor end to end on a simulated v4-8 (1 worker), through the real supervisor VM:
`tpufab babysit train.sh --remote` (the default `supervisor_vm: true`) makes an e2-micro VM,
installs the laptop's own tpufab on it from its wheel and starts the product's service
(`python -m tpufab.flows.supervisor serve`) under the VM's init; from inside that VM the
service reaches the TPU API, Cloud Storage and the pod's worker over SSH with only what tpufab
shipped to it (its metadata, the bucket) and keeps the job going:

- every local tpufab process (the command following the job, the keeper, the resident
  server) is SIGKILLed right after the hand-over: nothing of the job runs on the laptop;
- the pod is preempted twice: the job is relaunched after each, counted as preemptions (the
  error budget untouched), and finishes;
- between the two, in the middle of attempt 2, the service is SIGKILLed (the VM's init starts
  it again and it takes its earlier self's lease at once), then the supervisor VM is reset
  (instances.reset): each time the service re-attaches to the run that is still going (the
  recipe's own count of its starts on the worker: one);
- `tpufab jobs --json` shows the job, `tpufab jobs logs JOB` the three attempts' output.

(The service as a local process: tests/test_supervisor_remote.py; the VM with a stand-in
service: tests/test_supervisor_vm.py.)"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import pytest
from harness import sim_node
from helpers import (
    TPUFAB,
    compute_clients,
    in_worker,
    keepers,
    kept_connections,
    ok,
    residents,
    storage_emulator,
    tpufab,
    unique_name,
    wait_for,
)

from tpufab.cloud.storage import Storage
from tpufab.flows.supervisor import state as st

# Attempts 0 and 1 run until the pod under them is preempted; attempt 2 finishes. Each start
# is counted on the worker, in a file every login can write (the supervisor logs in as its
# own user, so not under one user's home).
RECIPE = """#!/bin/sh
echo "$TPUFAB_RUN_ID" >> "/tmp/starts-$JOB_TAG.log"
echo "attempt $TPUFAB_RESTART_COUNT of $JOB_TAG at $(cat version.txt)"
if [ "$TPUFAB_RESTART_COUNT" -lt 2 ]; then
    sleep 900
fi
echo "finished attempt $TPUFAB_RESTART_COUNT"
"""


def git(cwd, *args: str) -> str:
    env = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t", "PATH": "/usr/bin:/bin", "HOME": str(cwd)}
    return subprocess.run(["git", *args], cwd=cwd, env=env, check=True, capture_output=True,
                          text=True).stdout.strip()


@pytest.fixture(scope="module")
def story(sim, tmp_path_factory):
    """A v4-8 with a checkout of a recipe, and the supervisor's settings (a bucket and a VM
    name of their own, an e2-micro); the VM is deleted at the end."""
    from tpufab.flows.supervisor import vm

    with sim_node(sim, tmp_path_factory, "e2e", "v4-8") as pod:
        repo = pod.home / "model"
        repo.mkdir()
        git(repo, "init", "-q", "-b", "main")
        (repo / "version.txt").write_text("v1\n")
        (repo / "train.sh").write_text(RECIPE)
        (repo / "train.sh").chmod(0o755)
        git(repo, "add", ".")
        git(repo, "commit", "-q", "-m", "v1")
        name, bucket = unique_name("sup"), unique_name("sup-e2e")
        supervisor = {"TPUFAB_SUPERVISOR_NAME": name, "TPUFAB_SUPERVISOR_BUCKET": bucket,
                      "TPUFAB_SUPERVISOR_MACHINE_TYPE": "e2-micro"}
        pod.repo, pod.supervisor, pod.bucket, pod.vm_name = repo, supervisor, bucket, name
        pod.records = st.Records(Storage(sim.storage_endpoint), bucket)
        from dataclasses import replace

        try:
            yield pod
        finally:
            vm.down(replace(pod.settings, supervisor_name=name, supervisor_bucket=bucket),
                    force=True)


def state_of(pod, job: str) -> st.JobState:
    return pod.records.state(job)[0]


def starts(pod, tag: str) -> list[str]:
    """The run ids the recipe counted starting on the pod's worker (of the pod as it is now:
    a preempted pod is recreated with a disk of its own)."""
    from tpufab.cloud.planes.tpu import TpuApi

    node = TpuApi(pod.settings).get_node(pod.name)
    return in_worker(pod.sim, node, 0, f"cat /tmp/starts-{tag}.log 2>/dev/null",
                     check=False).split()


def uploaded(pod, job: str, attempt: int) -> bytes:
    from tpufab.cloud.storage import chunks

    return b"".join(d for _, d in chunks(pod.records.store, pod.bucket,
                                         st.logs_prefix(job, attempt, 0)))


def heartbeat(pod) -> dict | None:
    found = pod.records.store.read_json(pod.bucket, st.heartbeat_name(pod.vm_name))
    return found[0] if found else None


def attempt_running(pod, job: str, number: int, tag: str):
    """Attempt ``number`` running, its first line in the bucket: the attempt."""
    s = state_of(pod, job)
    if len(s.attempts) != number or s.current.phase != "running":
        return None
    line = f"attempt {number - 1} of {tag} at v1".encode()
    return s.current if line in uploaded(pod, job, number) else None


def events(pod, job: str) -> str:
    return "; ".join(e.text for e in state_of(pod, job).events[-6:])


@pytest.mark.sim
@pytest.mark.timeout(600)
def test_a_job_handed_to_the_supervisor_vm_outlives_the_laptop_two_preemptions_and_a_reset(
        story, sim, sim_admin):
    pod, tag = story, unique_name("e2e")
    with kept_connections({**pod.env, **pod.supervisor}) as env:
        # a user's laptop: a command that kept the pod's connections (its keeper, and the
        # resident command server with it)
        ok(tpufab("exec", "true", env=env, timeout=120))
        assert keepers(env) and residents(env)
        handed = tpufab("babysit", "train.sh", "--remote", "--env", f"JOB_TAG={tag}",
                        "--max-restarts-on-errors", "1", env=env, cwd=pod.repo, timeout=420)
        assert handed.returncode == 0, handed.stdout + handed.stderr
        job = handed.stdout.strip().splitlines()[-1]
        assert f"Making the supervisor VM {pod.vm_name} (e2-micro" in handed.stderr
        assert f"tpufab jobs logs {job} --follow" in handed.stderr
        # the laptop goes away: the follower, the keeper and the resident server SIGKILLed
        follower = subprocess.Popen([TPUFAB, "jobs", "logs", job, "--follow"], env=env,
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        local = [follower.pid, *keepers(env), *residents(env)]
        for pid in local:
            os.kill(pid, signal.SIGKILL)
        follower.wait(10)
        wait_for(lambda: not keepers(env) and not residents(env), 10,
                 what="no local tpufab process left")

        # the service on the VM, in the laptop's own tpufab (its venv, as its own user)
        beat = wait_for(lambda: heartbeat(pod), 60, 0.5, "the service's heartbeat")
        assert beat["host"] == pod.vm_name
        first = wait_for(lambda: attempt_running(pod, job, 1, tag), 120, 0.5,
                         lambda: f"attempt 1 running: {events(pod, job)}")
        assert starts(pod, tag) == [first.run_id]

        # preemption 1: relaunched by the supervisor
        sim_admin.preempt(pod.name)
        second = wait_for(lambda: attempt_running(pod, job, 2, tag), 150, 0.5,
                          lambda: f"attempt 2 running: {events(pod, job)}")
        assert second.reason == "preempted" and starts(pod, tag) == [second.run_id]

        # in the middle of attempt 2 the service is SIGKILLed: the VM's init starts it again
        # and it takes its earlier self's lease at once (not waiting for it to run out),
        # re-attaching to the run still going
        def reattached(count: int) -> bool:
            return [e.text for e in state_of(pod, job).events].count(
                f"re-attached to run {second.run_id}") >= count

        killed = heartbeat(pod)
        ok(tpufab("supervisor", "ssh", "--", f"sudo kill -KILL {killed['pid']}", env=env,
                  timeout=60))
        wait_for(lambda: reattached(1), 90, 0.5,
                 lambda: f"a re-attach to {second.run_id}: {events(pod, job)}")
        journal = ok(tpufab("supervisor", "ssh", "--", "sudo journalctl -u "
                            "tpufab-supervisor.service", env=env, timeout=60))
        assert f"{job}: taken (resume, from this VM's earlier service)" in journal, journal
        # then the supervisor VM is reset (its processes end, it boots again): its service
        # comes back under the VM's init and re-attaches again, never starting the run twice
        before = heartbeat(pod)
        clients = compute_clients(sim)
        clients.wait(clients.instances.reset_unary(project=sim.project, zone=sim.zone,
                                                   instance=pod.vm_name))
        wait_for(lambda: (b := heartbeat(pod)) and b["since"] > before["since"], 90, 0.5,
                 "the service started again after the reset")
        wait_for(lambda: reattached(2), 120, 0.5,
                 lambda: f"a second re-attach to {second.run_id}: {events(pod, job)}")
        assert len(state_of(pod, job).attempts) == 2
        assert starts(pod, tag) == [second.run_id]      # 0 duplicate launches

        # preemption 2: relaunched again; attempt 3 finishes
        sim_admin.preempt(pod.name)
        wait_for(lambda: state_of(pod, job).terminal, 150, 0.5,
                 lambda: f"the job to end: {events(pod, job)}")
        final = state_of(pod, job)
        assert final.state == "finished", final.events
        assert [(a.reason, a.outcome) for a in final.attempts] == [
            ("first", "preempted"), ("preempted", "preempted"), ("preempted", "finished")]
        assert (final.preemptions, final.errors) == (2, 0)

        # from the laptop again: the bucket tells it all
        [row] = json.loads(ok(tpufab("jobs", "--json", env=env)))
        assert (row["id"], row["state"], row["attempts"], row["preemptions"],
                row["errors"]) == (job, "finished", 3, 2, 0)
        logs = ok(tpufab("jobs", "logs", job, "--raw", env=env))
        for n in range(3):
            assert logs.count(f"attempt {n} of {tag} at v1") == 1, logs
        assert "finished attempt 2" in logs



# -- the VM's one service, without a pod (against the simulated Cloud Storage) ----------------


@pytest.fixture()
def vm_service(monkeypatch, tmp_path):
    """A Service as the VM's unit runs it (--on-vm), on VM instance 4242 (its metadata server
    stood in for), its VM's deletion recorded instead of made; and the bucket."""
    from tpufab.config import Settings
    from tpufab.flows.supervisor import service, vm

    deleted: list[float] = []
    monkeypatch.setattr(vm, "instance_id", lambda: "4242")
    monkeypatch.setattr(vm, "delete_self", lambda settings: deleted.append(time.time()))
    with storage_emulator("sup-vm") as gcs:
        store = Storage(gcs.url)

        def make(name: str = "sup-one", **options):
            opts = service.Options(poll=0.1, ttl=30, margin=5, on_vm=True, **options)
            return service.Service(Settings(project="p", supervisor_idle="1s"), "sup-vm", name,
                                   store=store, workdir=tmp_path / "work", options=opts)

        yield make, st.Records(store, "sup-vm"), deleted


def new_job(records: st.Records) -> str:
    job = st.new_job_id()
    records.create(st.JobSpec(job=job, pod=st.PodRef("pod-a", "us-central2-b"),
                              recipe="train.sh", code=st.Code.of("0" * 40, bundle="b")))
    return job


def test_the_vms_service_takes_its_earlier_selfs_leases_at_once_and_no_one_elses(
        vm_service, monkeypatch):
    from tpufab.flows.supervisor import vm

    make, records, _ = vm_service
    from tpufab.flows.supervisor.lease import take_job

    earlier = make()                    # the process before a crash or a reboot of the VM
    job = new_job(records)
    assert take_job(records, earlier.new_lease(job)) is not None
    held = records.store.read_json(records.bucket, st.lease_name(job))[0]
    assert held["token"].startswith("vm4242.") and held["expires_at"] > time.time() + 20
    # a service of another VM of the same name (one recreated while this one still runs),
    # and one that is no VM's unit: both wait for the lease to run out
    monkeypatch.setattr(vm, "instance_id", lambda: "777")
    other_vm = make()
    assert other_vm._look(job) == 1 and job not in other_vm.jobs
    from tpufab.flows.supervisor import service

    plain = service.Service(earlier.settings, "sup-vm", "sup-one", store=records.store,
                            workdir=earlier.workdir, options=service.Options(ttl=30, margin=5))
    assert plain._look(job) == 1 and job not in plain.jobs
    assert records.state(job)[0].owner.token == held["token"]
    # the VM's own next process takes it now, its token in the state's owner
    monkeypatch.setattr(vm, "instance_id", lambda: "4242")
    again = make()
    monkeypatch.setattr(service.JobRunner, "start", lambda self: None)   # no babysit here
    assert again._look(job) == 1 and job in again.jobs
    after = records.state(job)[0]
    assert after.owner.token != held["token"] and after.owner.token.startswith("vm4242.")
    # and that one's lease is not its own earlier self's: it is left to run out
    assert not again.predecessor(again.jobs[job].lease.record)


def test_the_vms_service_deletes_its_vm_after_supervisor_idle_with_no_live_job(vm_service):
    make, records, deleted = vm_service
    job = new_job(records)
    records.update(job, lambda s: st.finish(s, "cancelled", records.now(), "over"))
    svc = make()
    svc.tick()
    assert not deleted                                  # idle, not yet for supervisor_idle
    wait_for(lambda: (svc.tick(), deleted)[1], 10, 0.1, "the idle end")
    beat = records.store.read_json(records.bucket, st.heartbeat_name("sup-one"))[0]
    assert beat["deleting"] is not None and beat["live"] == 0 and beat["instance"] == "4242"
    svc.tick()
    assert len(deleted) == 1                            # asked once
