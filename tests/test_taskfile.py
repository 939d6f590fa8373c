"""Task files (tpufab's schema and SkyPilot's), the launch plan, gc's choice, autostop's
decisions and the capacity helpers, as data: no pod needed."""

from __future__ import annotations

import importlib.util
import subprocess
from pathlib import Path

import pytest
import yaml

from tpufab import autostop, lifecycle
from tpufab import launch as launching
from tpufab.config import load_settings
from tpufab.controlplane import queued_resource_body
from tpufab.errors import ConfigError
from tpufab.nodes import Node, QueuedResourceInfo, WorkerEndpoint
from tpufab.runs import JobLayout, job_environment, skypilot_variables
from tpufab.taskfile import FileCopy, Mount, load_task, parse_task, resolve_envs

REPO = Path(__file__).resolve().parents[1]


def task(text: str):
    return parse_task(yaml.safe_load(text), "t.yaml")


# ---------------------------------------------------------------------------------------------
# tpufab's schema and SkyPilot's, mapped to one Task

SKY = """
name: train
resources:
  accelerators: tpu-v6e-8
  accelerator_args:
    runtime_version: v2-alpha-tpuv6e
    tpu_vm: True
  use_spot: true
  zone: us-east5-b
workdir: .
envs:
  MODEL: llama
  HF_TOKEN:
secrets:
  WANDB_API_KEY:
file_mounts:
  /data:
    name: my-bucket
    store: gcs
    mode: MOUNT
  /ckpt:
    source: gs://ckpts/run1
  /remote/config.json: ./config.json
setup: |
  pip install -r requirements.txt
run: |
  python train.py
"""


def test_skypilot_task_maps_to_the_tpufab_task():
    t = task(SKY)
    assert t.source == "skypilot"
    assert (t.name, t.type, t.zone, t.spot, t.runtime_version) == (
        "train", "tpu-v6e-8", "us-east5-b", True, "v2-alpha-tpuv6e")
    assert t.envs == {"MODEL": "llama", "HF_TOKEN": None, "WANDB_API_KEY": None}
    assert t.secret_envs == ("WANDB_API_KEY",)
    assert t.mounts == (Mount("/data", "gs://my-bucket"), Mount("/ckpt", "gs://ckpts/run1"))
    assert t.files == (FileCopy("/remote/config.json", "./config.json"),)
    assert t.setup.startswith("pip install") and t.run.strip() == "python train.py"
    assert t.workdir == "."


def test_tpufab_task_maps_to_the_same_fields():
    t = task("""
type: v4-32
zone: us-central2-b
spot: false
runtime_version: tpu-ubuntu2204-base
envs: {A: "1", B: null, FLAG: true}
setup: [echo one, echo two]
run: echo go
workdir: src
mounts:
  /mnt/d: gs://data/prefix
  /mnt/e: {bucket: other, driver: rclone, options: "--dir-cache-time 5s"}
files:
  ~/cfg.json: cfg.json
""")
    assert t.source == "tpufab"
    assert (t.type, t.zone, t.spot, t.runtime_version) == ("v4-32", "us-central2-b", False,
                                                          "tpu-ubuntu2204-base")
    assert t.envs == {"A": "1", "B": None, "FLAG": "true"}
    assert t.setup == "echo one\necho two"
    assert t.mounts == (Mount("/mnt/d", "gs://data/prefix"),
                        Mount("/mnt/e", "gs://other", "rclone", ("--dir-cache-time", "5s")))
    assert t.files == (FileCopy("~/cfg.json", "cfg.json"),)


@pytest.mark.parametrize(("accelerators", "expected"), [
    ("tpu-v4-32", "tpu-v4-32"), ("tpu-v6e-8:1", "tpu-v6e-8"), ({"tpu-v5p-8": 1}, "tpu-v5p-8")])
def test_skypilot_accelerator_spellings(accelerators, expected):
    t = parse_task({"resources": {"accelerators": accelerators}, "run": "x"})
    assert t.type == expected


@pytest.mark.parametrize(("data", "sentence"), [
    ({"run": "x", "gpus": 1}, "unknown key 'gpus' in a tpufab task file"),
    ({"run": "x", "mounts": {"/m": {"bucket": "b", "mode": "MOUNT"}}},
     "unknown key 'mode' in mounts./m"),
    ({"resources": {"accelerators": "tpu-v4-8", "cpus": 4}, "run": "x"},
     "unknown key 'cpus' in resources"),
    ({"resources": {"accelerators": "tpu-v4-8"}, "run": "x", "service": {}},
     "unknown key 'service' in a SkyPilot task"),
    ({"resources": {"accelerators": "tpu-v4-8", "accelerator_args": {"tpu_vm": False}},
      "run": "x"}, "legacy TPU Node architecture; tpufab launch supports TPU VMs only"),
    ({"resources": {"accelerators": "A100:8"}, "run": "x"}, "tpufab launches Cloud TPUs only"),
    ({"resources": {"accelerators": "tpu-v4-8:2"}, "run": "x"}, "asks for 2 x tpu-v4-8"),
    ({"resources": {"accelerators": "tpu-v4-8", "cloud": "aws"}, "run": "x"},
     "Cloud TPUs are on gcp"),
    ({"num_nodes": 2, "run": "x"}, "num_nodes is 2"),
    ({"file_mounts": {"/d": {"name": "b", "store": "s3"}}, "run": "x"}, "store: s3"),
    ({"file_mounts": {"/d": {"name": "b", "mode": "COPY"}}, "run": "x"}, "mode: COPY"),
    ({"file_mounts": {"/d": "s3://x"}, "run": "x"}, "does not copy from buckets"),
    ({"file_mounts": {"/d": {"source": "./local"}}, "run": "x"}, "existing buckets only"),
])
def test_bad_task_files_get_one_sentence_naming_the_problem(data, sentence):
    with pytest.raises(ConfigError) as err:
        parse_task(data, "t.yaml")
    assert sentence in str(err.value)
    assert str(err.value).startswith("t.yaml")


def test_unknown_key_suggests_the_near_one():
    with pytest.raises(ConfigError, match="did you mean 'workdir'"):
        parse_task({"run": "x", "workdri": "."})


def test_load_task_errors(tmp_path):
    with pytest.raises(ConfigError, match="No task file at"):
        load_task(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("run: [\n")
    with pytest.raises(ConfigError, match="is not valid YAML at line"):
        load_task(bad)
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    with pytest.raises(ConfigError, match="is empty"):
        load_task(empty)


def test_env_without_value_comes_from_flags_or_local_env_else_one_sentence():
    t = task(SKY)
    assert resolve_envs(t, ["HF_TOKEN=x"], {"WANDB_API_KEY": "w"}) == [
        "MODEL=llama", "WANDB_API_KEY", "HF_TOKEN=x"]
    assert resolve_envs(t, [], {"HF_TOKEN": "h", "WANDB_API_KEY": "w"}) == [
        "MODEL=llama", "HF_TOKEN", "WANDB_API_KEY"]
    with pytest.raises(ConfigError) as err:
        resolve_envs(t, [], {"HF_TOKEN": "h"})
    assert str(err.value) == ("t.yaml: env WANDB_API_KEY has no value; pass --env "
                              "WANDB_API_KEY=VALUE or export WANDB_API_KEY before launching.")


def test_skypilot_variables_come_from_the_job_environment():
    layout = JobLayout.single(["10.0.0.1", "10.0.0.2", "10.0.0.3"])
    env = job_environment("20261123-000000-abcd", layout, 2).public
    assert skypilot_variables(env, task_id="20261123-000000-abcd", node_name="pod") == {
        "SKYPILOT_NODE_RANK": "2", "SKYPILOT_NUM_NODES": "3",
        "SKYPILOT_NODE_IPS": "10.0.0.1\n10.0.0.2\n10.0.0.3",
        "SKYPILOT_TASK_ID": "20261123-000000-abcd", "SKYPILOT_NUM_GPUS_PER_NODE": "0",
        "TPU_NAME": "pod"}


# ---------------------------------------------------------------------------------------------
# the plan


@pytest.fixture
def checkout(tmp_path):
    root = tmp_path / "proj"
    (root / "src").mkdir(parents=True)
    (root / "src" / "train.py").write_text("print('hi')\n")
    (root / "cfg.json").write_text("{}\n")
    for argv in (["init", "-q"], ["add", "-A"],
                 ["-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "x"]):
        subprocess.run(["git", *argv], cwd=root, check=True)
    return root


def settings(tmp_path, **over):
    env = {"TPUFAB_PROJECT": "p", "TPUFAB_USER_CONFIG": str(tmp_path / "none.yaml"),
           **{f"TPUFAB_{k.upper()}": v for k, v in over.items()}}
    return load_settings(env=env, cwd=tmp_path)


def test_plan_resolves_the_spec_flags_over_task_over_settings(checkout, tmp_path):
    t = task(SKY.replace("./config.json", "cfg.json"))
    base = settings(tmp_path, name="from-settings", zone="us-central2-b")
    p = launching.plan(t, settings=base, env=["HF_TOKEN=hf_secret_1"], cwd=checkout,
                       local_env={"WANDB_API_KEY": "wandb-secret"})
    s = p.settings
    assert (s.name, s.type, s.zone, s.spot, s.runtime_version) == (
        "train", "v6e-8", "us-east5-b", True, "v2-alpha-tpuv6e")
    assert p.forwarded.public == {"MODEL": "llama"}
    assert p.forwarded.secrets == {"HF_TOKEN": "hf_secret_1", "WANDB_API_KEY": "wandb-secret"}
    assert p.deploy_dir == "~/proj" and p.run_cwd == "~/proj" and len(p.commit) == 40
    assert p.direct   # no remote to push to
    text = "\n".join(p.steps)
    assert "hf_secret_1" not in text and "wandb-secret" not in text
    assert "HF_TOKEN=*** MODEL=llama WANDB_API_KEY=***" in text
    assert p.steps[0].startswith("create train: v6e-8 (1 host, spot, runtime v2-alpha-tpuv6e) "
                                 "in us-east5-b")
    flagged = launching.plan(t, settings=base, name="mine", type="tpu-v4-32", zone="z-a",
                             env=["HF_TOKEN=x", "WANDB_API_KEY=y"], cwd=checkout)
    assert (flagged.settings.name, flagged.settings.type, flagged.settings.zone) == (
        "mine", "v4-32", "z-a")


def test_plan_runs_setup_in_the_workdir(checkout, tmp_path):
    t = task("type: v4-8\nworkdir: src\nsetup: pip install x\nrun: python train.py\n")
    p = launching.plan(t, settings=settings(tmp_path), name="n", cwd=checkout)
    assert p.run_cwd == "~/proj/src"
    assert p.setup_script == b'#!/bin/bash\ncd "$HOME"/src || exit 1\npip install x\n' \
        .replace(b'"$HOME"/src', b'"$HOME"/proj/src')
    assert p.run_script.data == b"#!/bin/bash\npython train.py\n"


@pytest.mark.parametrize(("text", "kw", "sentence"), [
    ("type: v4-7\nrun: x\n", {}, "Unknown TPU accelerator type 'v4-7'; did you mean"),
    ("run: x\n", {}, "names no TPU type"),
    ("type: v4-8\n", {}, "has no run section"),
    ("type: v4-8\nrun: x\nworkdir: nope\n", {}, "workdir nope is not a directory"),
    ("type: v4-8\nrun: x\nfiles: {/a: src}\n", {}, "is a directory; launch copies single"),
    ("type: v4-8\nrun: x\n", {"down": True, "detach": True}, "--down deletes the node"),
])
def test_plan_refusals(checkout, tmp_path, text, kw, sentence):
    with pytest.raises(ConfigError, match=sentence.replace("(", r"\(").replace("?", r"\?")):
        launching.plan(task(text), settings=settings(tmp_path), name="n", cwd=checkout, **kw)


def test_dirty_workdir_is_refused_before_anything(checkout, tmp_path):
    (checkout / "src" / "train.py").write_text("changed\n")
    from tpufab.errors import TpufabError

    with pytest.raises(TpufabError, match="uncommitted|dirty"):
        launching.plan(task("type: v4-8\nrun: x\nworkdir: .\n"), settings=settings(tmp_path),
                       name="n", cwd=checkout)


def node(name="n", type_="v4-32", **kw) -> Node:
    return Node(name=name, id="1", project="p", zone="z", accelerator_type=type_,
                runtime_version=kw.pop("runtime", "tpu-ubuntu2204-base"),
                state=kw.pop("state", "READY"),
                workers=[WorkerEndpoint(0, "10.0.0.1", None, 22)], **kw)


def test_an_existing_node_of_another_spec_is_one_sentence(checkout, tmp_path):
    p = launching.plan(task("type: v4-32\nspot: true\nrun: x\n"), settings=settings(tmp_path),
                       name="n", cwd=checkout)
    assert launching.existing_spec_problem(node(spot=True), p) is None
    problem = launching.existing_spec_problem(node(type_="v4-8"), p)
    assert problem == ("TPU node 'n' already exists with another spec (it is a v4-8, the task "
                       "asks for v4-32; it is on-demand, the task asks for spot); launch with "
                       "another --name, or delete it first (`tpufab delete --name n`).")


# ---------------------------------------------------------------------------------------------
# gc, capacity, reservations


def qr(name, state, nodes=()):
    return QueuedResourceInfo(name=name, project="p", zone="z", state=state, tier="spot",
                              accelerator_type="v4-8", node_ids=list(nodes))


def test_gc_picks_dead_nodes_and_failed_or_suspended_queued_resources_only():
    nodes = [node("ok"), node("gone", state="PREEMPTED"), node("term", state="TERMINATED"),
             node("qn", state="PREEMPTED", queued_resource="q-live"),
             node("qs", state="PREEMPTED", queued_resource="q-susp"),
             node("stopped", state="STOPPED"), node("new", state="CREATING")]
    queued = [qr("q-live", "ACTIVE", ["qn"]), qr("q-susp", "SUSPENDED", ["qs"]),
              qr("q-failed", "FAILED"), qr("q-wait", "WAITING_FOR_RESOURCES")]
    found = lifecycle.find_garbage(nodes, queued, "z")
    assert [(g.kind, g.name) for g in found] == [
        ("queued resource", "q-failed"), ("queued resource", "q-susp"),
        ("node", "gone"), ("queued resource", "q-live"), ("node", "term")]


@pytest.mark.parametrize(("text", "seconds"), [
    ("90", 90), ("90s", 90), ("30m", 1800), ("2h", 7200), ("1h30m", 5400), ("1d", 86400),
    ("0.5s", 0.5), (45, 45)])
def test_durations(text, seconds):
    assert lifecycle.parse_duration(text, "--idle") == seconds


@pytest.mark.parametrize("text", ["soon", "5x", "-3m", "0", "m"])
def test_bad_durations_are_one_sentence(text):
    with pytest.raises(ConfigError, match="--ttl"):
        lifecycle.parse_duration(text, "--ttl")


def test_stockout_backoff_doubles_to_a_cap():
    assert [lifecycle.stockout_delay(a, 30) for a in range(6)] == [30, 60, 120, 240, 300, 300]


def test_reservation_goes_into_the_queued_resource(tmp_path):
    s = settings(tmp_path, name="n", type="v5p-8", zone="us-east5-a")
    body = queued_resource_body(s, reservation="my-res")
    assert body["reservation_name"] == "projects/p/locations/us-east5-a/reservations/my-res"
    assert body["tpu"]["node_spec"][0]["node"]["scheduling_config"] == {"reserved": True}
    full = "projects/q/locations/z/reservations/r"
    assert queued_resource_body(s, reservation=full)["reservation_name"] == full
    s.spot = True
    with pytest.raises(ConfigError, match="--reservation and --spot cannot be combined"):
        queued_resource_body(s, reservation="my-res")


# ---------------------------------------------------------------------------------------------
# autostop


def worker_side():
    spec = importlib.util.spec_from_file_location("autostop_worker",
                                                  REPO / "tpufab" / "remote" / "autostop.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(("config", "now", "idle_since", "expected"), [
    ({"idle": 60}, 100, None, (None, None)),             # busy: no idle clock
    ({"idle": 60}, 100, 50, (None, 110)),
    ({"idle": 60}, 110, 50, ("idle", 110)),
    ({"ttl_at": 500}, 100, None, (None, 500)),           # TTL fires busy or not
    ({"ttl_at": 500}, 500, None, ("ttl", 500)),
    ({"idle": 60, "ttl_at": 130}, 120, 100, (None, 130)),
    ({"idle": 60, "ttl_at": 130}, 130, 100, ("ttl", 130)),
])
def test_watchdog_decides_idle_and_ttl(config, now, idle_since, expected):
    assert worker_side().decide(config, now, idle_since) == expected


def test_watchdog_deletes_the_node_or_its_queued_resource():
    w = worker_side()
    base = {"endpoint": "http://127.0.0.1:9/", "project": "p", "zone": "z", "node": "n"}
    assert w.delete_request(base) == ("DELETE",
                                      "http://127.0.0.1:9/v2/projects/p/locations/z/nodes/n")
    assert w.delete_request({**base, "queued_resource": "q"}) == (
        "DELETE", "http://127.0.0.1:9/v2/projects/p/locations/z/queuedResources/q?force=true")


def test_worker_configs_lead_from_worker_0_and_pick_the_auth():
    pol = autostop.policy(idle=60, ttl=3600, now=1000)
    assert pol == {"armed_at": 1000, "idle": 60.0, "ttl_at": 4600}
    configs = autostop.worker_configs(pol, ips=["10.0.0.1", "10.0.0.2"],
                                      endpoint="https://tpu.googleapis.com", project="p",
                                      zone="z", node="n", queued_resource=None, port=8479,
                                      check_every=30)
    assert configs[0]["peers"] == ["10.0.0.1", "10.0.0.2"] and "peers" not in configs[1]
    assert [c["listen"] for c in configs.values()] == ["10.0.0.1", "10.0.0.2"]
    assert {c["auth"] for c in configs.values()} == {"metadata"}
    sim = autostop.worker_configs(pol, ips=["127.16.1.1"], endpoint="http://127.0.0.1:1",
                                  project="p", zone="z", node="n", queued_resource="q",
                                  port=1, check_every=1)
    assert sim[0]["auth"] == "anonymous" and sim[0]["queued_resource"] == "q"
    assert autostop.list_cell({"tpufab-autostop": '{"idle": 1800}'}) == "idle 30m"
    assert autostop.list_cell({}) == "-"


def test_watchdog_gets_a_token_from_the_metadata_server():
    import http.server
    import json
    import threading

    seen = []

    class Metadata(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            seen.append((self.path, self.headers.get("Metadata-Flavor")))
            body = json.dumps({"access_token": "ya29.tok", "expires_in": 3599}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Metadata)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        host = f"127.0.0.1:{server.server_address[1]}"
        assert worker_side().token({"metadata_host": host}) == "ya29.tok"
    finally:
        server.shutdown()
    assert seen == [("/computeMetadata/v1/instance/service-accounts/default/token", "Google")]
