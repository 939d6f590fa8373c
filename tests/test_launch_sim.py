"""launch, autostop, gc and create's capacity options on the simulated pod (real sshd workers,
real git, real rclone mounts of the pod's Cloud Storage).

The verbs run as a user runs them, through the real `tpufab` command (exit code and output
included); the test checks the pod through the TPU API and its own connections to the workers.
"""

from __future__ import annotations

import io
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import unique_name, wait_for

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
               TPUFAB_AUTOSTOP_CHECK="0.3", TPUFAB_AUTOSTOP_PORT=str(_free_port()),
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


def _free_port() -> int:
    from conftest import free_port

    return free_port()


def tpufab(world, *args: str, timeout: float = 300, extra_env=None):
    """The real `tpufab` command, run from the project checkout."""
    return subprocess.run([TPUFAB, *args], env={**world["env"], **(extra_env or {})},
                          cwd=world["project"], capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL)


def settings_of(world, **over):
    from tpufab.config import load_settings

    return load_settings(over, env=world["env"], cwd=world["base"])


def node_names(world, zone: str | None = None) -> set[str]:
    from tpufab import lifecycle

    s = settings_of(world, zone=zone) if zone else settings_of(world)
    return {n.name for n in lifecycle.list_nodes(s)}


def quiet():
    from rich.console import Console

    return Console(file=io.StringIO(), width=200)


def delete(world, name: str, zone: str | None = None) -> None:
    from tpufab import lifecycle

    over = {"name": name, **({"zone": zone} if zone else {})}
    lifecycle.delete(settings_of(world, **over), yes=True, console=quiet())


def one_sentence(err: str) -> str:
    """The error: the last line on stderr, one line, no traceback (a progress line may come
    first)."""
    lines = [line for line in err.strip().splitlines() if line.strip()]
    assert lines and len(lines) <= 2 and "Traceback" not in err, err
    return lines[-1]


# ---------------------------------------------------------------------------------------------
# launch


def test_skypilot_task_launches_end_to_end_and_down_leaves_no_node(world):
    name = unique_name("sky")
    got = tpufab(world, "launch", "sky.yaml", "--name", name, "--down",
                 extra_env={"HF_TOKEN": SECRET})
    out, err = got.stdout, got.stderr
    assert got.returncode == 0, out + err
    # setup ran once per worker in the workdir, shown once (every worker printed it)
    assert out.splitlines().count(f"setup ran in /root/{world['project'].name}/code for tiny "
                                  "with token=***") == 1
    # SkyPilot's variables from tpufab's job environment; lines that differ keep their worker
    for w in range(4):
        assert f"w{w}: train rank {w} model tiny" in out
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
        first = tpufab(world, "launch", "task.yaml", "--name", name, "--env", "EXTRA=from-the-flag")
        assert first.returncode == 0, first.stdout + first.stderr
        assert "hello from the bucket" in first.stdout.splitlines()
        for w in range(4):
            assert f"w{w}: rank={w} greeting=hello-from-the-task extra=from-the-flag" in \
                first.stdout
        assert first.stdout.splitlines().count(
            f"tpufab setup in /root/{world['project'].name}/code") == 1
        assert "Environment: EXTRA=from-the-flag GREETING=hello-from-the-task" in first.stderr

        again = tpufab(world, "launch", "task.yaml", "--name", name,
                       extra_env={"EXTRA": "from-my-shell"})
        assert again.returncode == 0, again.stdout + again.stderr
        assert f"TPU node {name} already exists and is READY" in again.stderr
        assert "already there" in again.stderr
        assert "Setup: already done on w[0-3] (this content ran there before)." in again.stderr
        assert "4 already had it" in again.stderr
        assert "extra=from-my-shell" in again.stdout

        other = tpufab(world, "launch", "task.yaml", "-n", name, "--type", "v4-16", "-e", "EXTRA=x")
        assert other.returncode == 2
        assert one_sentence(other.stderr).endswith(
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
        got = tpufab(world, "launch", "short.yaml", "--name", name, "--detach", "--idle", "2s")
    finally:
        (world["project"] / "short.yaml").unlink()
    assert got.returncode == 0, got.stdout + got.stderr
    assert "Autostop: deletes the pod after 2s idle." in got.stderr
    assert "Detached." in got.stderr
    wait_for(lambda: name not in node_names(world), 60, what="the idle pod to delete itself")


def test_a_failing_run_exits_with_its_code_and_down_still_deletes(world, tmp_path):
    name = unique_name("fail")
    (world["project"] / "fail.yaml").write_text("type: v4-16\nrun: |\n  echo bye\n  exit 7\n")
    got = tpufab(world, "launch", "fail.yaml", "--name", name, "--down")
    (world["project"] / "fail.yaml").unlink()
    assert got.returncode == 7, got.stdout + got.stderr
    assert "failed on w[0-1]" in got.stderr and f"Deleted TPU node {name}" in got.stderr
    assert name not in node_names(world)


def test_dry_run_prints_the_plan_and_touches_nothing(world, sim_admin):
    name = unique_name("dry")
    before = sim_admin.state()
    got = tpufab(world, "launch", "sky.yaml", "--name", name, "--dry-run",
                 extra_env={"HF_TOKEN": SECRET})
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
        got = tpufab(world, "launch", "bad.yaml", "--name", unique_name("bad"), extra_env=env)
    finally:
        (world["project"] / "bad.yaml").unlink()
    assert got.returncode == 2
    assert sentence in one_sentence(got.stderr)
    assert sim_admin.state()["nodes"] == before


# ---------------------------------------------------------------------------------------------
# create: --zones and --retry-for on stockouts, quota stops at once


def test_stockout_falls_through_to_the_next_zone(world, sim_admin):
    name = unique_name("zone")
    sim_admin.fail_next_create("stockout", zone="us-central2-b")
    got = tpufab(world, "create", "--name", name, "--type", "v4-8",
                 "--zones", "us-central2-b,us-east5-a")
    try:
        assert got.returncode == 0, got.stderr
        assert "No v4-8 capacity in us-central2-b right now; trying us-east5-a." in got.stdout
        assert name in node_names(world, zone="us-east5-a")
        assert name not in node_names(world)
    finally:
        delete(world, name, zone="us-east5-a")


def test_retry_for_keeps_trying_stockouts_until_capacity_comes(world, sim_admin):
    from tpufab import lifecycle

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
    from tpufab import lifecycle
    from tpufab.controlplane import QuotaExceeded, Stockout

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
    from tpufab import lifecycle
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
        got = tpufab(world, "gc", "--yes")
        assert got.returncode == 0, got.stderr
        assert f"TPU node {preempted} (v4-8, PREEMPTED) in us-central2-b" in got.stdout
        assert f"queued resource {failed} (v4-8, FAILED) in us-central2-b" in got.stdout
        assert "Deleted 2 of 2." in got.stdout
        names = node_names(world)
        assert healthy in names and preempted not in names
        qrs = {q.name for q in lifecycle.control_plane(settings_of(world))
               .list_queued_resources()}
        assert failed not in qrs
        again = tpufab(world, "gc", "--yes")
        assert again.returncode == 0 and "Nothing to collect" in again.stdout
    finally:
        delete(world, healthy)


def test_gc_all_zones_reaches_the_other_zones(world, sim_admin):
    from tpufab import lifecycle

    elsewhere = unique_name("far")
    lifecycle.create(settings_of(world, name=elsewhere, type="v4-8", zone="us-east5-b"),
                     console=quiet())
    sim_admin.preempt(f"projects/{sim_admin.project}/locations/us-east5-b/nodes/{elsewhere}")
    here = tpufab(world, "gc", "--yes")
    assert here.returncode == 0 and elsewhere not in here.stdout
    assert elsewhere in node_names(world, zone="us-east5-b")
    everywhere = tpufab(world, "gc", "--yes", "--all-zones")
    assert everywhere.returncode == 0, everywhere.stderr
    assert f"TPU node {elsewhere} (v4-8, PREEMPTED) in us-east5-b" in everywhere.stdout
    assert elsewhere not in node_names(world, zone="us-east5-b")


# ---------------------------------------------------------------------------------------------
# autostop


@pytest.fixture
def pod16(world):
    """A fresh v4-16 (two workers) and its connected pod; deleted afterwards if still there."""
    from tpufab import lifecycle
    from tpufab import pod as pods

    name = unique_name("auto")
    s = settings_of(world, name=name, type="v4-16")
    lifecycle.create(s, console=quiet())
    p = pods.connect(s, console=quiet())
    try:
        yield name, s, p
    finally:
        p.close()
        if name in node_names(world):
            delete(world, name)


def gone(world, name: str) -> bool:
    return name not in node_names(world)


def leader_state(p) -> dict:
    from tpufab import autostop

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


def hold_device(p, worker: int, device: str, release: str) -> None:
    """A process outside tpufab that holds ``device`` on ``worker`` until ``release`` exists."""
    p.fanout.run(f"env -u TPUFAB_TASK setsid sh -c 'exec 3<{device}; while [ ! -e {release} ]; "
                 "do sleep 0.1; done' >/dev/null 2>&1 &", workers=[worker]).close()


def test_autostop_deletes_an_idle_pod_and_list_and_status_show_it_first(world, pod16):
    name, _, p = pod16
    hold_device(p, 1, "/dev/accel2", "/tmp/release-2")   # busy while we look
    got = tpufab(world, "autostop", "--name", name, "--idle", "3s")
    assert got.returncode == 0, got.stderr
    assert f"Autostop of {name}: deletes the pod after 3s idle." in got.stdout
    listed = tpufab(world, "list")
    row = next(line for line in listed.stdout.splitlines() if line.startswith(name))
    assert "idle 3s" in row and "AUTOSTOP" in listed.stdout
    checks_past(p, 0.5)
    status = tpufab(world, "status", "--name", name)
    assert "Autostop: deletes the pod after 3s idle; busy now (w1: TPU held by pid" in \
        status.stdout, status.stdout
    assert " armed (idle=3s)" in status.stdout and " busy (reasons=w1: TPU held" in status.stdout
    p.fanout.run("touch /tmp/release-2", workers=[1]).close()
    wait_for(lambda: gone(world, name), 60, what="the idle pod to be deleted")


def test_autostop_waits_for_a_run_and_for_a_device_holder_on_any_worker(world, pod16):
    from tpufab import pod as pods

    name, s, p = pod16
    trigger = "/tmp/autostop-run-may-end"
    script = world["base"] / "long.sh"
    script.write_text(f"#!/bin/sh\nwhile [ ! -e {trigger} ]; do sleep 0.1; done\necho done\n")
    started = tpufab(world, "run", str(script), "--name", name, "--no-deploy", "--detach")
    assert started.returncode == 0, started.stderr
    hold_device(p, 1, "/dev/accel0", "/tmp/release")   # worker 1, not the leader
    armed = tpufab(world, "autostop", "--name", name, "--idle", "2s")
    assert armed.returncode == 0, armed.stderr
    state = checks_past(p, 4)
    assert any(b.startswith("w0: run ") for b in state["busy"]), state
    assert any(b.startswith("w1: TPU held by pid") for b in state["busy"]), state
    assert not gone(world, name)
    p.fanout.run(f"touch {trigger}", workers=[0, 1]).close()            # the run ends
    state = checks_past(p, 4 + 3)
    assert state["busy"] and all(b.startswith("w1: TPU held") for b in state["busy"]), state
    assert not gone(world, name)                                         # the holder remains
    p.fanout.run("touch /tmp/release", workers=[1]).close()
    pods.forget(s)
    wait_for(lambda: gone(world, name), 60, what="the pod to be deleted once idle")


def test_autostop_ttl_fires_even_while_busy(world, pod16):
    name, _, p = pod16
    hold_device(p, 0, "/dev/accel1", "/tmp/never")
    got = tpufab(world, "autostop", "--name", name, "--ttl", "3s", "--idle", "1s")
    assert got.returncode == 0, got.stderr
    assert "at the latest (TTL)" in got.stdout
    wait_for(lambda: gone(world, name), 60, what="the TTL to delete the busy pod")


def test_autostop_cancel_holds(world, pod16):
    name, _, p = pod16
    assert tpufab(world, "autostop", "--name", name, "--idle", "8s").returncode == 0
    armed_at = leader_state(p)["config"]["armed_at"]
    got = tpufab(world, "autostop", "--name", name, "--cancel")
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
    listed = tpufab(world, "list")
    assert "idle 8s" not in listed.stdout
