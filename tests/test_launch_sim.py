"""launch, autostop, gc and create's capacity options on the simulated pod (real sshd workers,
real git, real rclone mounts of the pod's Cloud Storage).

The verbs run as a user runs them, through the real `tpufab` command (exit code and output
included); the test checks the pod through the TPU API and its own connections to the workers.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import free_port, in_worker, one_sentence, tpufab, unique_name, wait_for

from tpufab.cloud import planes

pytestmark = pytest.mark.sim   # every test here drives the simulated pod

SECRET = "hf_launch-secret-9931"
TPUFAB = str(Path(sys.executable).parent / "tpufab")

SKY_TASK = """\
name: sky-train
resources:
  accelerators: tpu-v4-32
  accelerator_args:
    runtime_version: tpu-ubuntu2204-base
    tpu_vm: True
workdir: code
envs:
  MODEL: tiny
  HF_TOKEN:
file_mounts:
  /mnt/sky-data:
    name: {bucket}
    store: gcs
    mode: MOUNT
setup: |
  echo "setup ran in $(pwd) for $MODEL with token=$HF_TOKEN"
run: |
  python3 train.py
  echo "nodes=$SKYPILOT_NUM_NODES ips=$(printf '%s\\n' "$SKYPILOT_NODE_IPS" | wc -l) tpu=$TPU_NAME"
  echo "token=$HF_TOKEN"
  cat /mnt/sky-data/hello.txt
"""

TPUFAB_TASK = """\
type: v4-32
envs:
  GREETING: hello-from-the-task
  EXTRA:
workdir: code
mounts:
  /mnt/task-data: gs://{bucket}
setup: |
  echo "tpufab setup in $(pwd)"
run: |
  echo "rank=$TPUFAB_WORKER_ID greeting=$GREETING extra=$EXTRA"
  cat /mnt/task-data/hello.txt
"""

TRAIN = """\
import os
print("train rank", os.environ["SKYPILOT_NODE_RANK"], "model", os.environ["MODEL"])
"""


@pytest.fixture(scope="module")
def world(sim, tmp_path_factory):
    """The environment naming the pod, a project checkout with both task files, a bucket."""
    if shutil.which("rclone") is None:
        pytest.skip("rclone is not installed")
    if not sim.storage_endpoint:
        pytest.skip("the simulated pod runs without Cloud Storage")
    from tpufab.sim.admin import StorageClient

    base = tmp_path_factory.mktemp("launch-sim")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TPUFAB_", "HF_"))}
    env.update(sim.env(), TPUFAB_USER_CONFIG=str(base / "none.yaml"), TPUFAB_SSH_USER="root",
               TPUFAB_SSH_KEY=str(base / "key" / "tpufab_ed25519"),
               TPUFAB_KNOWN_HOSTS=str(base / "known_hosts"), TPUFAB_MOUNT_DRIVER="rclone",
               TPUFAB_AUTOSTOP_CHECK="0.3", TPUFAB_AUTOSTOP_PORT=str(free_port()),
               COLUMNS="200")
    bucket = unique_name("bkt")
    storage = StorageClient(sim.storage_endpoint)
    storage.create_bucket(bucket)
    storage.upload(bucket, "hello.txt", b"hello from the bucket\n")
    project = base / "proj"
    (project / "code").mkdir(parents=True)
    (project / "code" / "train.py").write_text(TRAIN)
    (project / "sky.yaml").write_text(SKY_TASK.format(bucket=bucket))
    (project / "task.yaml").write_text(TPUFAB_TASK.format(bucket=bucket))
    for argv in (["init", "-q"], ["add", "-A"],
                 ["-c", "user.name=t", "-c", "user.email=t@t.invalid", "commit", "-qm", "code"]):
        subprocess.run(["git", *argv], cwd=project, check=True)
    return {"env": env, "project": project, "base": base, "bucket": bucket}


def settings_of(world, **over):
    from tpufab.config import load_settings

    return load_settings(over, env=world["env"], cwd=world["base"])


def node_names(world, zone: str | None = None) -> set[str]:
    from tpufab.cloud import lifecycle

    s = settings_of(world, zone=zone) if zone else settings_of(world)
    return {n.name for n in lifecycle.list_nodes(s)}


def quiet():
    from rich.console import Console

    return Console(file=io.StringIO(), width=200)


def delete(world, name: str, zone: str | None = None) -> None:
    from tpufab.cloud import lifecycle

    over = {"name": name, **({"zone": zone} if zone else {})}
    lifecycle.delete(settings_of(world, **over), yes=True, console=quiet())


# ---------------------------------------------------------------------------------------------
# launch


def test_skypilot_task_launches_end_to_end_and_down_leaves_no_node(world):
    name = unique_name("sky")
    got = tpufab("launch", "sky.yaml", "--name", name, "--down", extra_env={"HF_TOKEN": SECRET},
                 env=world["env"], cwd=world["project"])
    out, err = got.stdout, got.stderr
    assert got.returncode == 0, out + err
    # setup ran once per worker in the workdir, SkyPilot's ~/sky_workdir (a link to the
    # deployed checkout's code/: issue 25), shown once (every worker printed it)
    assert out.splitlines().count("setup ran in /root/sky_workdir for tiny with token=***") == 1
    # SkyPilot's variables from tpufab's job environment; the rank lines differ only in the
    # rank: one line, the ranks in braces (tpufab.term.fields)
    assert "train rank {0..3} model tiny" in out.splitlines()
    assert "nodes=4 ips=4 tpu=" + name in out
    assert "hello from the bucket" in out.splitlines()          # the gcs MOUNT, all workers
    assert "token=***" in out and SECRET not in out + err          # the env, masked
    for step in ("Deployed", "Mounted gs://", "Setup: ran on w[0-3]", "finished on w[0-3]",
                 "Saved the logs", f"Deleted TPU node {name}"):
        assert step in err, err
    assert name not in node_names(world)
    logs = sorted((world["project"] / ".tpufab" / "runs").glob("*/w0.log"))
    assert any("train rank 0 model tiny" in p.read_text() for p in logs)
    assert all(SECRET not in p.read_text() for p in logs)


def test_tpufab_task_launches_then_reuses_the_node_and_refuses_another_spec(world):
    name = unique_name("tfb")
    try:
        first = tpufab("launch", "task.yaml", "--name", name, "--env", "EXTRA=from-the-flag",
                       env=world["env"], cwd=world["project"])
        assert first.returncode == 0, first.stdout + first.stderr
        assert "hello from the bucket" in first.stdout.splitlines()
        assert "rank={0..3} greeting=hello-from-the-task extra=from-the-flag" in \
            first.stdout.splitlines()          # one line, the ranks in braces
        assert first.stdout.splitlines().count(
            f"tpufab setup in /root/{world['project'].name}/code") == 1
        assert "Environment: EXTRA=from-the-flag GREETING=hello-from-the-task" in first.stderr

        again = tpufab("launch", "task.yaml", "--name", name,
                       extra_env={"EXTRA": "from-my-shell"}, env=world["env"], cwd=world["project"])
        assert again.returncode == 0, again.stdout + again.stderr
        assert f"TPU node {name} already exists and is READY" in again.stderr
        assert "already there" in again.stderr
        assert "Setup: already done on w[0-3] (this content ran there before; --force-setup " \
            "runs it again)." in again.stderr
        assert "4 already had it" in again.stderr
        assert "extra=from-my-shell" in again.stdout

        other = tpufab("launch", "task.yaml", "-n", name, "--type", "v4-16", "-e", "EXTRA=x",
                       env=world["env"], cwd=world["project"])
        assert other.returncode == 2
        assert one_sentence(other, progress=1).endswith(
            f"launch failed at create: TPU node '{name}' already exists with another spec (it "
            "is a v4-32, the task asks for v4-16); launch with another --name, or delete it "
            f"first (`tpufab delete --name {name}`).")
    finally:
        delete(world, name)


def test_detach_with_idle_leaves_the_run_going_and_the_pod_deletes_itself_after(world):
    name = unique_name("idle")
    (world["project"] / "short.yaml").write_text(
        "type: v4-16\nrun: |\n  echo short run on $TPUFAB_WORKER_ID\n")
    try:
        got = tpufab("launch", "short.yaml", "--name", name, "--detach", "--idle", "2s",
                     env=world["env"], cwd=world["project"])
    finally:
        (world["project"] / "short.yaml").unlink()
    assert got.returncode == 0, got.stdout + got.stderr
    assert "Autostop: deletes the pod after 2s idle." in got.stderr
    assert "Detached." in got.stderr
    wait_for(lambda: name not in node_names(world), 60, what="the idle pod to delete itself")


def test_a_setup_longer_than_idle_keeps_the_pod(world):
    """launch --idle arms the watchdog once the pod is set up, and a setup is busy anyway: a
    setup three times longer than --idle ends well, and the run after it too."""
    name = unique_name("slow")
    (world["project"] / "slow.yaml").write_text(
        "type: v4-8\nsetup: |\n  sleep 6\n  echo setup-done\nrun: |\n  echo ran-after-setup\n")
    try:
        got = tpufab("launch", "slow.yaml", "--name", name, "--idle", "2s", env=world["env"], cwd=world["project"])
    finally:
        (world["project"] / "slow.yaml").unlink()
    assert got.returncode == 0, got.stdout + got.stderr
    assert "setup-done" in got.stdout + got.stderr and "ran-after-setup" in got.stdout
    assert got.stderr.index("Setup: ran on") < got.stderr.index("Autostop: deletes the pod")
    wait_for(lambda: name not in node_names(world), 60, what="the idle pod to delete itself")


def test_a_failing_run_exits_with_its_code_and_down_still_deletes(world, tmp_path):
    name = unique_name("fail")
    (world["project"] / "fail.yaml").write_text("type: v4-16\nrun: |\n  echo bye\n  exit 7\n")
    got = tpufab("launch", "fail.yaml", "--name", name, "--down", env=world["env"],
                 cwd=world["project"])
    (world["project"] / "fail.yaml").unlink()
    assert got.returncode == 7, got.stdout + got.stderr
    assert "failed on w[0-1]" in got.stderr and f"Deleted TPU node {name}" in got.stderr
    assert name not in node_names(world)


def test_dry_run_prints_the_plan_and_touches_nothing(world, sim_admin):
    name = unique_name("dry")
    before = sim_admin.state()
    got = tpufab("launch", "sky.yaml", "--name", name, "--dry-run",
                 extra_env={"HF_TOKEN": SECRET}, env=world["env"], cwd=world["project"])
    assert got.returncode == 0, got.stderr
    out = got.stdout
    assert out.startswith(f"Plan for sky.yaml (SkyPilot task) on {name}:")
    for text in (f"1. create {name}: v4-32 (4 hosts, on-demand, runtime tpu-ubuntu2204-base)",
                 "deploy ", f"mount gs://{world['bucket']} at /mnt/sky-data (rclone)",
                 "setup (1 line, once per content)",
                 "env: HF_TOKEN=*** MODEL=tiny + SKYPILOT_* variables",
                 "Dry run: nothing was created, deployed, mounted or started."):
        assert text in out, out
    assert SECRET not in out + got.stderr
    after = sim_admin.state()
    assert after["nodes"] == before["nodes"] and after["queuedResources"] == \
        before["queuedResources"]


def test_dry_run_shows_the_environment_by_the_one_masking_rule(world):
    """issue 23, finding 11: DB_PASS is a secret by its last word, --secret makes any name one,
    MAX_NEW_TOKENS is not one (its value shows)."""
    got = tpufab("launch", "sky.yaml", "--name", unique_name("dry"), "--dry-run",
                 "-e", "DB_PASS", "-e", "MAX_NEW_TOKENS=128", "--secret", "RUN_NOTE=note-3381",
                 extra_env={"DB_PASS": "db-pass-must-not-show", "HF_TOKEN": SECRET}, env=world["env"], cwd=world["project"])
    assert got.returncode == 0, got.stderr
    env = next(line for line in got.stdout.splitlines() if "env: " in line)
    for shown in ("DB_PASS=***", "MAX_NEW_TOKENS=128", "RUN_NOTE=***"):
        assert shown in env, env
    assert "db-pass-must-not-show" not in got.stdout + got.stderr
    assert "note-3381" not in got.stdout + got.stderr


@pytest.mark.parametrize(("text", "env", "sentence"), [
    ("type: v4-8\nrun: x\nimage: ubuntu\n", {},
     "bad.yaml: unknown key 'image' in a tpufab task file"),
    ("resources: {accelerators: tpu-v4-8}\nenvs: {WANDB_API_KEY: }\nrun: x\n", {},
     "bad.yaml: env WANDB_API_KEY has no value; pass --env WANDB_API_KEY=VALUE or export "
     "WANDB_API_KEY before launching."),
    ("resources:\n  accelerators: tpu-v4-8\n  accelerator_args: {tpu_vm: False}\nrun: x\n", {},
     "bad.yaml: accelerator_args.tpu_vm is False, which asks for the legacy TPU Node "
     "architecture; tpufab launch supports TPU VMs only"),
    ("resources: {accelerators: tpu-v4-7}\nrun: x\n", {},
     "Unknown TPU accelerator type 'tpu-v4-7'; did you mean"),
])
def test_bad_task_files_get_their_sentence(world, sim_admin, text, env, sentence):
    before = sim_admin.state()["nodes"]
    (world["project"] / "bad.yaml").write_text(text)
    try:
        got = tpufab("launch", "bad.yaml", "--name", unique_name("bad"), extra_env=env,
                     env=world["env"], cwd=world["project"])
    finally:
        (world["project"] / "bad.yaml").unlink()
    assert got.returncode == 2
    assert sentence in one_sentence(got, progress=1)
    assert sim_admin.state()["nodes"] == before


# ---------------------------------------------------------------------------------------------
# create: --zones and --retry-for on stockouts, quota stops at once


def test_stockout_falls_through_to_the_next_zone(world, sim_admin):
    name = unique_name("zone")
    sim_admin.fail_next_create("stockout", zone="us-central2-b")
    got = tpufab("create", "--name", name, "--type", "v4-8", "--zones",
                 "us-central2-b,us-east5-a", env=world["env"], cwd=world["project"])
    try:
        assert got.returncode == 0, got.stderr
        assert "No v4-8 capacity in us-central2-b right now; trying us-east5-a." in got.stdout
        assert name in node_names(world, zone="us-east5-a")
        assert name not in node_names(world)
    finally:
        delete(world, name, zone="us-east5-a")


def test_retry_for_keeps_trying_stockouts_until_capacity_comes(world, sim_admin):
    from tpufab.cloud import lifecycle

    name = unique_name("retry")
    sim_admin.fail_next_create("stockout", count=2)
    out = io.StringIO()
    from rich.console import Console

    s = settings_of(world, name=name, type="v4-8")
    started = time.monotonic()
    try:
        nodes = lifecycle.create(s, retry_for=60, retry_base=0.2,
                                 console=Console(file=out, width=200))
        assert [n.name for n in nodes] == [name] and nodes[0].ready
        text = out.getvalue()
        assert text.count("No v4-8 capacity in us-central2-b; trying again in") == 2
        assert "(attempt 2, giving up in" in text and "(attempt 3, giving up in" in text
        assert time.monotonic() - started < 30
    finally:
        delete(world, name)


def test_retry_for_gives_up_at_the_deadline_and_quota_stops_at_once(world, sim_admin):
    from tpufab.cloud import lifecycle
    from tpufab.cloud.planes.calls import QuotaExceeded, Stockout

    sim_admin.fail_next_create("stockout", count=50)
    s = settings_of(world, name=unique_name("never"), type="v4-8")
    with pytest.raises(Stockout, match=r"after retrying for 1s; try --spot, --queued, other "):
        lifecycle.create(s, retry_for=1, retry_base=0.2, console=quiet())
    sim_admin.clear_faults()
    sim_admin.fail_next_create("quota", count=5)
    started = time.monotonic()
    with pytest.raises(QuotaExceeded, match="Not enough quota"):
        lifecycle.create(settings_of(world, name=unique_name("quota"), type="v4-8"),
                         retry_for=60, retry_base=5, zones=["us-central2-b", "us-east5-a"],
                         console=quiet())
    assert time.monotonic() - started < 20
    remaining = sim_admin._call("GET", "faults")["createFailures"]
    assert remaining[0]["count"] == 4          # one create only: no retry, no other zone


# ---------------------------------------------------------------------------------------------
# gc


def test_gc_removes_a_preempted_node_and_a_failed_queued_resource_and_nothing_else(
        world, sim_admin):
    from tpufab.cloud import lifecycle
    from tpufab.errors import ApiError

    healthy, preempted, failed = (unique_name(p) for p in ("keep", "pre", "qrf"))
    lifecycle.create(settings_of(world, name=healthy, type="v4-8"), console=quiet())
    lifecycle.create(settings_of(world, name=preempted, type="v4-8"), console=quiet())
    sim_admin.preempt(preempted)
    sim_admin.fail_next_create("stockout")
    with pytest.raises(ApiError, match="FAILED"):
        lifecycle.create(settings_of(world, name=failed, type="v4-8"), queued=True,
                         console=quiet())
    try:
        got = tpufab("gc", "--yes", env=world["env"], cwd=world["project"])
        assert got.returncode == 0, got.stderr
        assert f"TPU node {preempted} (v4-8, PREEMPTED) in us-central2-b" in got.stdout
        assert f"queued resource {failed} (v4-8, FAILED) in us-central2-b" in got.stdout
        assert "Deleted 2 of 2." in got.stdout
        names = node_names(world)
        assert healthy in names and preempted not in names
        qrs = {q.name for q in planes.control_plane(settings_of(world))
               .list_queued_resources()}
        assert failed not in qrs
        again = tpufab("gc", "--yes", env=world["env"], cwd=world["project"])
        assert again.returncode == 0 and "Nothing to collect" in again.stdout
    finally:
        delete(world, healthy)


def test_gc_all_zones_reaches_the_other_zones(world, sim_admin):
    from tpufab.cloud import lifecycle

    elsewhere = unique_name("far")
    lifecycle.create(settings_of(world, name=elsewhere, type="v4-8", zone="us-east5-b"),
                     console=quiet())
    sim_admin.preempt(f"projects/{sim_admin.project}/locations/us-east5-b/nodes/{elsewhere}")
    here = tpufab("gc", "--yes", env=world["env"], cwd=world["project"])
    assert here.returncode == 0 and elsewhere not in here.stdout
    assert elsewhere in node_names(world, zone="us-east5-b")
    everywhere = tpufab("gc", "--yes", "--all-zones", env=world["env"], cwd=world["project"])
    assert everywhere.returncode == 0, everywhere.stderr
    assert f"TPU node {elsewhere} (v4-8, PREEMPTED) in us-east5-b" in everywhere.stdout
    assert elsewhere not in node_names(world, zone="us-east5-b")


# ---------------------------------------------------------------------------------------------
# autostop


@pytest.fixture
def pod16(world):
    """A fresh v4-16 (two workers) and its connected pod; deleted afterwards if still there."""
    from tpufab.cloud import lifecycle
    from tpufab.hosts import connect as pods

    name = unique_name("auto")
    s = settings_of(world, name=name, type="v4-16")
    lifecycle.create(s, console=quiet())
    p = pods.connect(s, console=quiet())
    try:
        yield name, s, p
    finally:
        p.close()
        if name in node_names(world):
            try:
                delete(world, name)
            except Exception as err:   # autostop's own delete may be under way
                if "already being deleted" not in str(err):
                    raise
                wait_for(lambda: gone(world, name), 60, what=f"{name}'s deletion to end")


def gone(world, name: str) -> bool:
    return name not in node_names(world)


def leader_state(p) -> dict:
    from tpufab.steps.host import autostop

    return autostop.worker_state(p)


def checks_past(p, seconds: float, timeout: float = 30.0) -> dict:
    """Wait until the leader has checked ``seconds`` after it was armed; its state then."""
    armed = leader_state(p)["config"]["armed_at"]
    found = {}

    def later():
        found.update(leader_state(p)["state"] or {})
        return (found.get("checked_at") or 0) > armed + seconds

    wait_for(later, timeout, what=f"a check {seconds} s after arming")
    return found


def checks_until(p, ok, timeout: float = 30.0) -> dict:
    """Wait for a check by the leader whose busy list satisfies ``ok``; its state then."""
    found = {}

    def seen():
        found.clear()
        found.update(leader_state(p)["state"] or {})
        return found.get("checked_at") and ok(found.get("busy") or [])

    wait_for(seen, timeout, what="the leader's check to see it")
    return found


def hold_device(p, worker: int, device: str, release: str) -> None:
    """A process outside tpufab that holds ``device`` on ``worker`` until ``release`` exists."""
    p.fanout.run(f"env -u TPUFAB_TASK setsid sh -c 'exec 3<{device}; while [ ! -e {release} ]; "
                 "do sleep 0.1; done' >/dev/null 2>&1 &", workers=[worker]).close()


def test_pod_autostop_checks_its_arguments_as_the_verb_does_before_connecting(tmp_path):
    """The Python API gets the verb's checks and sentences (issue 22), before any call."""
    from tpufab import Pod
    from tpufab.errors import ConfigError

    pod = Pod("nowhere", project="p", zone="z", api_endpoint="http://127.0.0.1:9")
    with pytest.raises(ConfigError, match=r"^Say when to stop: --idle 30m"):
        pod.autostop()
    with pytest.raises(ConfigError, match=r"^--cancel removes the autostop; it takes no"):
        pod.autostop(idle="30m", cancel=True)
    with pytest.raises(ConfigError, match=r"^--ttl takes a duration such as 90s"):
        pod.autostop(ttl="soon")
    assert pod._hosts is None


def test_autostop_deletes_an_idle_pod_and_list_and_status_show_it_first(world, pod16):
    name, _, p = pod16
    hold_device(p, 1, "/dev/accel2", "/tmp/release-2")   # busy while we look
    got = tpufab("autostop", "--name", name, "--idle", "3s", env=world["env"], cwd=world["project"])
    assert got.returncode == 0, got.stderr
    assert f"Autostop of {name}: deletes the pod after 3s idle." in got.stdout
    listed = tpufab("list", env=world["env"], cwd=world["project"])
    row = next(line for line in listed.stdout.splitlines() if line.startswith(name))
    assert "idle 3s" in row and "AUTOSTOP" in listed.stdout
    checks_past(p, 0.5)
    status = tpufab("status", "--name", name, env=world["env"], cwd=world["project"])
    assert "Autostop: deletes the pod after 3s idle; busy now (" in status.stdout, status.stdout
    assert "w1: TPU held by pid" in status.stdout
    assert " armed (idle=3s)" in status.stdout and " busy (reasons=" in status.stdout
    p.fanout.run("touch /tmp/release-2", workers=[1]).close()
    p.close()                           # a kept connection counts as busy too
    wait_for(lambda: gone(world, name), 60, what="the idle pod to be deleted")
    # afterwards, status and describe say who deleted it, and when
    for verb in ("status", "describe"):
        after = tpufab(verb, "--name", name, env=world["env"], cwd=world["project"])
        assert after.returncode != 0
        sentence = one_sentence(after, progress=1)     # status first names the pod
        assert f"{name!r}" in sentence and "it was deleted by autostop at " in sentence, sentence
        assert sentence.split("deleted by autostop at ")[1][:10] == time.strftime("%Y-%m-%d")
        assert "(idle)" in sentence


def test_autostop_waits_for_a_run_and_for_a_device_holder_on_any_worker(world, pod16):
    from tpufab.hosts import connect as pods

    name, s, p = pod16
    trigger = "/tmp/autostop-run-may-end"
    script = world["base"] / "long.sh"
    script.write_text(f"#!/bin/sh\nwhile [ ! -e {trigger} ]; do sleep 0.1; done\necho done\n")
    started = tpufab("run", str(script), "--name", name, "--no-deploy", "--detach",
                     env=world["env"], cwd=world["project"])
    assert started.returncode == 0, started.stderr
    hold_device(p, 1, "/dev/accel0", "/tmp/release")   # worker 1, not the leader
    armed = tpufab("autostop", "--name", name, "--idle", "2s", env=world["env"],
                   cwd=world["project"])
    assert armed.returncode == 0, armed.stderr
    state = checks_past(p, 4)
    assert any(b.startswith("w0: run ") for b in state["busy"]), state
    assert any(b.startswith("w1: TPU held by pid") for b in state["busy"]), state
    assert not gone(world, name)
    p.fanout.run(f"touch {trigger}", workers=[0, 1]).close()            # the run ends
    # a check after the run's end finds the device holder alone (not a check at a set time:
    # on a loaded machine the run's end may come after it)
    state = checks_until(p, lambda busy: not any(" run " in b for b in busy))
    assert any(b.startswith("w1: TPU held") for b in state["busy"]), state
    assert not gone(world, name)                                         # the holder remains
    p.fanout.run("touch /tmp/release", workers=[1]).close()
    pods.forget(s)
    p.close()
    wait_for(lambda: gone(world, name), 60, what="the pod to be deleted once idle")


def test_autostop_ttl_fires_even_while_busy(world, pod16):
    name, _, p = pod16
    hold_device(p, 0, "/dev/accel1", "/tmp/never")
    got = tpufab("autostop", "--name", name, "--ttl", "3s", "--idle", "1s", env=world["env"],
                 cwd=world["project"])
    assert got.returncode == 0, got.stderr
    assert "at the latest (TTL)" in got.stdout
    wait_for(lambda: gone(world, name), 60, what="the TTL to delete the busy pod")


def test_autostop_cancel_holds(world, pod16):
    name, _, p = pod16
    assert tpufab("autostop", "--name", name, "--idle", "8s", env=world["env"],
                  cwd=world["project"]).returncode == 0
    armed_at = leader_state(p)["config"]["armed_at"]
    got = tpufab("autostop", "--name", name, "--cancel", env=world["env"], cwd=world["project"])
    assert got.returncode == 0, got.stderr
    assert f"Autostop of {name} cancelled (it was: deletes the pod after 8s idle)." in got.stdout
    # well past the idle period: still there, no watchdog left on any worker
    wait_for(lambda: time.time() > armed_at + 10, 30, what="the idle period to pass")
    assert not gone(world, name)
    state = leader_state(p)
    assert state["config"] is None and not state["running"]
    events = [e["event"] for e in state["events"]]
    assert "armed" in events and events[-1] == "cancelled" and "firing" not in events
    left = p.fanout.run("pgrep -f 'autostop[.]py daemon' || true")
    try:
        assert all(r.stdout.strip() == "" for r in left.values())
    finally:
        left.close()
    listed = tpufab("list", env=world["env"], cwd=world["project"])
    assert "idle 8s" not in listed.stdout


def test_autostop_counts_a_tpufab_command_longer_than_the_idle_period_as_busy(sim, world, pod16):
    """A setup or exec that outlasts --idle (no run, no TPU holder) must not lose the pod.

    The exec waits on the workers for the test to release it, and the test looks only from
    inside the workers (no SSH of its own, which would count as busy): armed once the exec is
    seen running everywhere, still there while the leader has checked well past the idle
    period, deleted once idle after it."""
    name, s, p = pod16
    p.close()
    tag = unique_name("busy")
    started, release = f"/tmp/{tag}-started", f"/tmp/{tag}-release"
    command = subprocess.Popen(
        [TPUFAB, "exec", "--name", name,
         f"touch {started}; while [ ! -e {release} ]; do sleep 0.1; done; echo still-here"],
        env=world["env"], cwd=world["project"], text=True, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, stdin=subprocess.DEVNULL)
    home = f"$(getent passwd {s.ssh_user} | cut -d: -f6)/.tpufab/autostop"

    def on_workers(script: str) -> list[str]:
        return [in_worker(sim, p.node, w, script, check=False) for w in (0, 1)]

    def leader(name_: str) -> dict:
        text = on_workers(f"cat {home}/{name_} 2>/dev/null || true")[0]
        return json.loads(text) if text.strip() else {}

    try:
        def running() -> bool:
            assert command.poll() is None, command.communicate()
            return on_workers(f"test -e {started} && echo yes") == ["yes\n"] * 2

        wait_for(running, 60, what="the exec to run on both workers")
        armed = tpufab("autostop", "--name", name, "--idle", "2s", env=world["env"],
                       cwd=world["project"])
        assert armed.returncode == 0, armed.stderr
        armed_at = leader("config.json")["armed_at"]
        seen = {}

        def checked_past_idle():
            seen.clear()
            seen.update(leader("state.json"))
            return (seen.get("checked_at") or 0) > armed_at + 2 + 1.5

        wait_for(checked_past_idle, 60, what="the leader to check past the idle period")
        assert seen.get("fired_at") is None and not gone(world, name), seen
        busy = seen["busy"]
        assert any(r.startswith("w0: tpufab command") for r in busy), busy
        assert any(r.startswith("w1: tpufab command") for r in busy), busy
        on_workers(f"touch {release}")
        out, err = command.communicate(timeout=60)
    finally:
        command.kill()
    assert command.returncode == 0, err
    assert out.count("still-here") == 2
    wait_for(lambda: gone(world, name), 60, what="the pod to be deleted once idle after it")


def test_autostop_ttl_counts_on_the_worker_s_clock_not_the_client_s(world, pod16):
    """A client clock two hours slow must not give a deadline already past."""
    from tpufab.steps.host import autostop

    name, s, p = pod16
    armed = autostop.arm(p, s, ttl=120, clock=lambda: time.time() - 7200)
    assert abs(armed["ttl_at"] - (time.time() + 120)) < 15, armed
    assert "2h" in autostop.skew_note(armed) and "ahead of" in autostop.skew_note(armed)
    state = checks_past(p, 1)
    assert abs(state["fires_at"] - armed["ttl_at"]) < 1 and not gone(world, name)
    assert "firing" not in [e["event"] for e in leader_state(p)["events"]]


def test_an_arm_whose_ttl_deletes_the_node_before_its_metadata_is_written_is_armed(world, pod16):
    """On a loaded machine a short TTL fires before `autostop` writes the node's metadata: the
    API then refuses the update ("being deleted"). The watchdog did its job; not an error.
    Any other refusal still is one."""
    from tpufab.errors import ApiError
    from tpufab.steps.host import autostop

    name, s, p = pod16
    real = planes.control_plane(s)

    class FiredFirst:       # the real API, with the deletion arriving just before the update
        def __getattr__(self, attr):
            return getattr(real, attr)

        def update_metadata(self, node, metadata):
            real.delete_node(node)
            return real.update_metadata(node, metadata)

    class Refusing(FiredFirst):
        def update_metadata(self, node, metadata):
            raise ApiError("The TPU API rejected the request to update it: no.")

    with pytest.raises(ApiError, match="no[.]$"):
        autostop.arm(p, s, idle=3600, control=Refusing())
    armed = autostop.arm(p, s, ttl=3600, control=FiredFirst())
    assert armed["ttl"] == 3600 and armed["armed_at"], armed
    wait_for(lambda: gone(world, name), 60, what="the deletion to finish")


def test_bad_autostop_settings_leave_the_running_watchdog_alone(world, pod16):
    name, _, p = pod16
    assert tpufab("autostop", "--name", name, "--idle", "1h", env=world["env"], cwd=world["project"]).returncode == 0
    before = leader_state(p)
    assert before["running"] and before["config"]["idle"] == 3600
    for env, sentence in ((
            {"TPUFAB_AUTOSTOP_CHECK": "-1"}, "autostop_check (TPUFAB_AUTOSTOP_CHECK) must be a "
            "number of seconds above 0, not -1.0."), (
            {"TPUFAB_AUTOSTOP_PORT": "70000"}, "autostop_port (TPUFAB_AUTOSTOP_PORT) must be a "
            "TCP port between 1 and 65535, not 70000.")):
        got = tpufab("autostop", "--name", name, "--idle", "2s", extra_env=env, env=world["env"], cwd=world["project"])
        assert got.returncode != 0 and one_sentence(got).endswith(sentence), got.stderr
    # a port another process listens on, on worker 1 only: no worker changes its watchdog
    port = 18000 + os.getpid() % 1000
    launched = p.fanout.run(
        f"env -u TPUFAB_TASK setsid python3 -c 'import socket,os,time; s=socket.socket(); "
        f"s.bind((\"0.0.0.0\", {port})); s.listen(1); [time.sleep(0.1) for _ in "
        f"iter(lambda: os.path.exists(\"/tmp/unbind\"), True)]' >/tmp/listener.log 2>&1 &",
        workers=[1])
    try:
        assert (launched[1].exit_code, launched[1].error) == (0, None), launched[1]
    finally:
        launched.close()
    wait_for(lambda: "LISTEN" in _ss(p, 1, port), 30, what=lambda: "the listener on worker 1 "
             "(its output: " + _on(p, 1, "cat /tmp/listener.log") + ")")
    try:
        got = tpufab("autostop", "--name", name, "--idle", "2s",
                     extra_env={"TPUFAB_AUTOSTOP_PORT": str(port)}, env=world["env"], cwd=world["project"])
        assert got.returncode != 0
        assert "cannot listen on" in got.stderr and "any watchdog running is kept" in got.stderr
    finally:
        p.fanout.run("touch /tmp/unbind", workers=[1]).close()
    after = leader_state(p)
    assert after["running"] and after["config"]["idle"] == 3600
    assert after["config"]["armed_at"] == before["config"]["armed_at"]
    listed = tpufab("list", env=world["env"], cwd=world["project"])
    row = next(line for line in listed.stdout.splitlines() if line.startswith(name))
    assert "idle 1h" in row


def _on(p, worker: int, command: str) -> str:
    """``command``'s output on ``worker`` (its spools closed)."""
    result = p.fanout.run(command, workers=[worker])
    try:
        return result[worker].stdout
    finally:
        result.close()


def _ss(p, worker: int, port: int) -> str:
    return _on(p, worker, f"cat /proc/net/tcp | awk '{{print $2, $4}}' | grep -i "
                          f"':{port:04X} 0A' && echo LISTEN || true")


def test_create_says_when_it_moves_the_current_pod(world):
    """(issue 23) `create --name X` silently made X the current pod in place of another."""
    first, second = unique_name("cura"), unique_name("curb")
    try:
        one = tpufab("create", "--name", first, "--type", "v4-8", env=world["env"], cwd=world["project"])
        assert one.returncode == 0, one.stderr
        two = tpufab("create", "--name", second, "--type", "v4-8", env=world["env"], cwd=world["project"])
        assert two.returncode == 0, two.stderr
        assert f"The current pod is now {second} (was {first};" in two.stderr
        again = tpufab("create", "--name", second, "--type", "v4-8", env=world["env"], cwd=world["project"])
        assert "The current pod is now" not in again.stderr
        assert f"{second} is this project's current pod" in again.stderr
    finally:
        for name in (first, second):
            delete(world, name)
        (world["project"] / ".tpufab" / "current-pod.json").unlink(missing_ok=True)


@pytest.mark.parametrize("project", ["Bad Project!", "x", "ends-with-"])
def test_gc_with_an_invalid_project_fails_in_one_sentence(world, project):
    """(issue 23) gc with an invalid project said "Nothing to collect" and exited 0."""
    got = tpufab("gc", "--yes", "--project", project, env=world["env"], cwd=world["project"])
    assert got.returncode != 0 and "Nothing to collect" not in got.stdout
    assert one_sentence(got).startswith(f"Invalid project {project!r}: a Google Cloud "
                                               "project ID has 6 to 30")
