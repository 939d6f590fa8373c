"""Task files (tpufab's schema and SkyPilot's), the launch plan, gc's choice, autostop's
decisions and the capacity helpers, as data: no pod needed."""

from __future__ import annotations

import importlib.util
import re
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from tpufab import durations
from tpufab.cloud import gc as collecting
from tpufab.cloud import lifecycle
from tpufab.cloud.bodies import queued_resource_body
from tpufab.cloud.nodes import Node, QueuedResourceInfo, WorkerEndpoint, autostop_cell
from tpufab.config import load_settings
from tpufab.errors import ConfigError
from tpufab.flows import launch as launching
from tpufab.flows.taskfile import FileCopy, Mount, load_task, parse_task, resolve_envs
from tpufab.steps.host import autostop
from tpufab.steps.runs.env import JobLayout, job_environment, skypilot_variables

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


# ---------------------------------------------------------------------------------------------
# a task file is untrusted data (issue 23, finding 8): capped, parsed with a budget, typed

LAUGHS = """\
a: &a [lol, lol, lol, lol, lol, lol, lol, lol, lol]
b: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a]
c: &c [*b, *b, *b, *b, *b, *b, *b, *b, *b]
d: &d [*c, *c, *c, *c, *c, *c, *c, *c, *c]
e: &e [*d, *d, *d, *d, *d, *d, *d, *d, *d]
f: &f [*e, *e, *e, *e, *e, *e, *e, *e, *e]
g: &g [*f, *f, *f, *f, *f, *f, *f, *f, *f]
h: &h [*g, *g, *g, *g, *g, *g, *g, *g, *g]
i: &i [*h, *h, *h, *h, *h, *h, *h, *h, *h]
"""
BILLION_LAUGHS = "run: echo hi\nfiles:\n" + "".join(f"  {line}\n" for line in LAUGHS.splitlines())


@pytest.mark.parametrize(("content", "sentence"), [
    (LAUGHS + "run: *i\n", "expands, through its aliases (*name), to more than 100000 values"),
    (BILLION_LAUGHS, "expands, through its aliases (*name), to more than 100000 values"),
    ("s: &s '" + "x" * 200_000 + "'\nl: &l [*s, *s, *s, *s, *s, *s, *s, *s, *s, *s]\n"
     "run: [*l, *l, *l, *l, *l]\n", "to more than 100000 values or 8 MiB of text"),
    ("a: &a [*a]\nrun: x\n", "refers to itself (an alias inside its own anchor, line 1)"),
    ("run: " + "[" * 500 + "]" * 500 + "\n", "nests values more than 64 deep (at line 1)"),
    (b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\xff\xfe", "is not UTF-8 text (a binary file?)"),
    (b"run: echo hi\x00\n", "is not UTF-8 text (a binary file?)"),
    ("run: x\n" + "#" * (1 << 20) + "\n", "is larger than 1 MiB"),
    ("run: echo one\nsetup: x\nrun: echo two\n", "gives the key 'run' twice (lines 1 and 3)"),
    ("run: x\nenvs:\n  A: 1\n  B: 2\n  A: 3\n", "gives the key 'A' twice (lines 3 and 5)"),
    ("resources:\n  accelerators: tpu-v4-8\n  zone: a\n  zone: b\nrun: x\n",
     "gives the key 'zone' twice (lines 3 and 4)"),
])
def test_hostile_task_files_are_one_sentence(tmp_path, content, sentence):
    f = tmp_path / "t.yaml"
    f.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(ConfigError) as err:
        load_task(f)
    assert sentence in str(err.value)
    assert str(err.value).startswith(str(f)) and "\n" not in str(err.value)


def test_a_task_file_s_own_aliases_still_work(tmp_path):
    f = tmp_path / "t.yaml"
    f.write_text("run: &cmd echo hi\nsetup: *cmd\nenvs: &e {A: 1}\nfiles: {~/a: a, ~/b: b}\n")
    t = load_task(f)
    assert (t.run, t.setup, t.envs) == ("echo hi", "echo hi", {"A": "1"})


SKY_BASE = {"resources": {"accelerators": "tpu-v4-8"}, "run": "x"}


def sky(**over):
    resources = {**SKY_BASE["resources"], **over.pop("resources", {})}
    return {**SKY_BASE, **over, "resources": resources}


@pytest.mark.parametrize(("data", "sentence"), [
    ({"run": "x", "name": ["a"]}, "name must be text, not a list"),
    ({"run": "x", "type": {"v4": 8}}, "type must be text, not a mapping"),
    ({"run": "x", "zone": True}, "zone must be text, not true (true/false)"),
    ({"run": "x", "spot": "yes"}, "spot must be true or false, not 'yes'"),
    ({"run": "x", "runtime_version": [1]}, "runtime_version must be text, not a list"),
    ({"run": "x", "envs": ["A=1"]}, "envs must be a mapping of NAME: value, not a list"),
    ({"run": "x", "envs": {"A": [1]}}, "envs.A must be text, not a list"),
    ({"run": "x", "envs": {1: "a"}}, "envs has 1 (a number), which is not a variable name"),
    ({"run": "x", "setup": {"a": 1}}, "setup must be text (a script) or a list of lines, not "
                                      "a mapping"),
    ({"run": ["echo", {"a": 1}]}, "run[1] must be text, not a mapping"),
    ({"run": ["echo", None]}, "run[1] must be text (a line of the script), not nothing"),
    ({"run": "x", "workdir": ["."]}, "workdir must be text, not a list"),
    ({"run": "x", "mounts": ["gs://b"]}, "mounts must be a mapping of mount point: bucket"),
    ({"run": "x", "mounts": {"/m": {"bucket": ["b"]}}}, "mounts./m.bucket must be text, not "
                                                        "a list"),
    ({"run": "x", "mounts": {"/m": {"bucket": "b", "driver": ["x"]}}},
     "mounts./m.driver must be text, not a list"),
    ({"run": "x", "mounts": {"/m": {"bucket": "b", "options": {"a": 1}}}},
     "mounts./m.options must be text or a list of text, not a mapping"),
    ({"run": "x", "mounts": {"/m": {"bucket": "b", "options": "'open"}}},
     "mounts./m.options cannot be split like a shell would"),
    ({"run": "x", "mounts": {"/m": 5}}, "mounts./m must be gs://BUCKET or a mapping with "
                                        "bucket (and optionally driver, options), not 5"),
    ({"run": "x", "files": ["a"]}, "files must be a mapping of a path on the workers to a "
                                   "local path, not a list"),
    ({"run": "x", "files": {"~/a": ["b"]}}, "files.~/a must be text, not a list"),
    ({"run": "x", "files": {"~/a": None}}, "files.~/a must be text, not nothing (null)"),
    (sky(num_nodes="two"), "num_nodes must be a whole number (1), not 'two'"),
    ({**SKY_BASE, "resources": "tpu-v4-8"}, "resources must be a mapping, not 'tpu-v4-8'"),
    (sky(resources={"accelerators": {"tpu-v4-8": [1]}}),
     "resources.accelerators.tpu-v4-8 must be text, not a list"),
    (sky(resources={"accelerators": True}), "resources.accelerators must be text, not true"),
    (sky(resources={"accelerator_args": ["x"]}), "resources.accelerator_args must be a mapping"),
    (sky(resources={"accelerator_args": {"runtime_version": ["v"]}}),
     "resources.accelerator_args.runtime_version must be text, not a list"),
    (sky(resources={"accelerator_args": {"tpu_vm": 3}}),
     "resources.accelerator_args.tpu_vm must be true or false, not 3 (a number)"),
    (sky(resources={"use_spot": "no"}), "resources.use_spot must be true or false, not 'no'"),
    (sky(resources={"zone": ["a", "b"]}), "resources.zone must be text, not a list"),
    (sky(resources={"cloud": ["gcp"]}), "resources.cloud must be text, not a list"),
    (sky(resources={"region": {"r": 1}}), "resources.region must be text, not a mapping"),
    (sky(resources={"labels": ["a"]}), "resources.labels must be a mapping, not a list"),
    (sky(resources={"labels": {"team": {"a": 1}}}),
     "resources.labels.team must be text, not a mapping"),
    (sky(secrets=["TOKEN"]), "secrets must be a mapping of NAME: value, not a list"),
    (sky(file_mounts=["/d"]), "file_mounts must be a mapping of a path on the workers to a "
                              "source, not a list"),
    (sky(file_mounts={"/d": 3}), "file_mounts./d must be a local path or a storage mapping "
                                 "(name, store, mode), not 3"),
    (sky(file_mounts={"/d": {"name": "b", "mode": ["MOUNT"]}}),
     "file_mounts./d.mode must be text, not a list"),
    (sky(file_mounts={"/d": {"name": "b", "store": ["gcs"]}}),
     "file_mounts./d.store must be text, not a list"),
    (sky(file_mounts={"/d": {"name": ["b"]}}), "file_mounts./d.name must be text, not a list"),
    (sky(file_mounts={"/d": {"source": {"gs": 1}}}),
     "file_mounts./d.source must be text, not a mapping"),
    (sky(file_mounts={"/d": {"name": "b", "persistent": "yes"}}),
     "file_mounts./d.persistent must be true or false, not 'yes'"),
])
def test_every_field_s_type_is_checked_in_one_sentence(data, sentence):
    with pytest.raises(ConfigError) as err:
        parse_task(data, "t.yaml")
    assert sentence in str(err.value)
    assert str(err.value).startswith("t.yaml: ") and "\n" not in str(err.value)


def test_launch_dry_run_of_a_billion_laughs_is_one_sentence(tmp_path):
    """`launch --dry-run` is how a user looks at a task before trusting it: an alias bomb is
    refused at once, well under a 1 GiB address-space cap (it once grew to MemoryError)."""
    import os
    import resource
    import sys

    bomb = tmp_path / "bomb.yaml"
    bomb.write_text(BILLION_LAUGHS)
    env = {k: v for k, v in os.environ.items() if not k.startswith("TPUFAB_")}
    env.update(HOME=str(tmp_path), TPUFAB_USER_CONFIG=str(tmp_path / "none.yaml"),
               TPUFAB_PROJECT="p", COLUMNS="200")

    def cap():
        resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))

    shown = subprocess.run([str(Path(sys.executable).parent / "tpufab"), "launch", str(bomb),
                            "--dry-run"], env=env, cwd=tmp_path, capture_output=True, text=True,
                           timeout=120, stdin=subprocess.DEVNULL, preexec_fn=cap)
    assert shown.returncode != 0 and "Traceback" not in shown.stderr, shown.stderr
    lines = [line for line in shown.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "expands, through its aliases" in lines[0], shown.stderr


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
    # errexit and the ERR trap that names a failed line (issue 25), then the workdir
    assert p.setup_script.startswith(b"#!/bin/bash\nset -eE\ntrap '")
    assert p.setup_script.endswith(b'\ncd "$HOME"/proj/src || exit 1\npip install x\n')
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
    found = collecting.find_garbage(nodes, queued, "z")
    assert [(g.kind, g.name) for g in found] == [
        ("queued resource", "q-failed"), ("queued resource", "q-susp"),
        ("node", "gone"), ("queued resource", "q-live"), ("node", "term")]


@pytest.mark.parametrize(("text", "seconds"), [
    ("90", 90), ("90s", 90), ("30m", 1800), ("2h", 7200), ("1h30m", 5400), ("1d", 86400),
    ("0.5s", 0.5), (45, 45)])
def test_durations(text, seconds):
    assert durations.parse_duration(text, "--idle") == seconds


@pytest.mark.parametrize("text", ["soon", "5x", "-3m", "0", "m"])
def test_bad_durations_are_one_sentence(text):
    with pytest.raises(ConfigError, match="--ttl"):
        durations.parse_duration(text, "--ttl")


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
                                                  REPO / "tpufab" / "remote" / "autostop_worker.py")
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


def test_a_watchdog_answers_only_a_peer_that_knows_the_pods_token():
    """issue 37, the siblings of Ray's open listener: each worker's watchdog listens on its
    internal IP, and answered anyone who connected with what keeps the pod busy (runs,
    commands). It now answers only a question carrying the arm's peer token."""
    import socket
    import threading

    side = worker_side()
    config = {"peer_token": "a" * 32}
    for sent, answered in (("a" * 32, True), ("b" * 32, False), ("", False)):
        ours, theirs = socket.socketpair()
        with ours, theirs:
            box: dict = {}

            def serve(conn=theirs, into=box):
                into["ok"] = side.answer_peer(conn, config, lambda: ["run R (train.py)"])

            thread = threading.Thread(target=serve)
            thread.start()
            ours.sendall(f"{sent}\n".encode())
            thread.join(10)
            ours.settimeout(2)
            theirs.close()
            data = ours.recv(4096)
        assert box["ok"] is answered
        assert (b"train.py" in data) is answered, (sent, data)


@pytest.mark.parametrize(("change", "sentence"), [
    ({"port": 70000}, "the autostop port must be between 1 and 65535, not 70000"),
    ({"port": "x"}, "the autostop port 'x' is not a number"),
    ({"check_every": -1}, "autostop's check_every must be a number of seconds above 0, not -1"),
    ({"idle": 0, "ttl": None}, "autostop's idle must be a number of seconds above 0"),
])
def test_watchdog_refuses_a_bad_config_before_touching_the_running_one(change, sentence):
    good = {"port": 8479, "check_every": 30, "idle": 60}
    assert worker_side().config_problem(good) is None
    assert worker_side().config_problem({**good, **change}).startswith(sentence)


def test_watchdog_deletes_the_node_or_its_queued_resource():
    w = worker_side()
    base = {"endpoint": "http://127.0.0.1:9/", "project": "p", "zone": "z", "node": "n"}
    assert w.delete_request(base) == ("DELETE",
                                      "http://127.0.0.1:9/v2/projects/p/locations/z/nodes/n")
    assert w.delete_request({**base, "queued_resource": "q"}) == (
        "DELETE", "http://127.0.0.1:9/v2/projects/p/locations/z/queuedResources/q?force=true")


def test_worker_configs_lead_from_worker_0_and_pick_the_auth():
    pol = autostop.policy(idle=60, ttl=3600)
    assert pol == {"idle": 60.0, "ttl": 3600.0}      # durations: deadlines on the worker
    configs = autostop.worker_configs(pol, ips=["10.0.0.1", "10.0.0.2"],
                                      endpoint="https://tpu.googleapis.com", project="p",
                                      zone="z", node="n", queued_resource=None, port=8479,
                                      check_every=30)
    assert configs[0]["peers"] == ["10.0.0.1", "10.0.0.2"] and "peers" not in configs[1]
    assert [c["listen"] for c in configs.values()] == ["10.0.0.1", "10.0.0.2"]
    assert {c["auth"] for c in configs.values()} == {"metadata"}
    [token] = {c["peer_token"] for c in configs.values()}       # one per arm, every worker
    assert len(token) == 32
    sim = autostop.worker_configs(pol, ips=["127.16.1.1"], endpoint="http://127.0.0.1:1",
                                  project="p", zone="z", node="n", queued_resource="q",
                                  port=1, check_every=1)
    assert sim[0]["auth"] == "anonymous" and sim[0]["queued_resource"] == "q"
    assert autostop_cell({"tpufab-autostop": '{"idle": 1800}'}) == "idle 30m"
    assert autostop_cell({}) == "-"


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


# ---------------------------------------------------------------------------------------------
# the files a task copies from this machine (issue 37, High 3)


def files_task(local: str, key: str = "file_mounts") -> str:
    """A SkyPilot task (``file_mounts``) or tpufab's (``files``) copying ``local``."""
    kind = "resources: {accelerators: tpu-v4-8}" if key == "file_mounts" else "type: v4-8"
    return f"{kind}\nrun: x\n{key}:\n  ~/dest: {local!r}\n"


@pytest.fixture
def laptop(tmp_path, monkeypatch):
    """A home directory with credential stores and a project beside them."""
    home = tmp_path / "home"
    for store in (".ssh", ".tpufab", ".config/gcloud", ".aws"):
        (home / store).mkdir(parents=True)
        (home / store / "cred").write_text("secret\n")
        (home / store / "cred").chmod(0o644)       # readable: refused as a store, not a mode
    monkeypatch.setenv("HOME", str(home))
    project = tmp_path / "proj"
    project.mkdir()
    (project / "cfg.json").write_text("{}\n")
    return SimpleNamespace(home=home, project=project, tmp=tmp_path)


def plan_files(laptop, local: str, key: str = "file_mounts", **kw):
    return launching.plan(task(files_task(local, key)), settings=settings(laptop.tmp),
                          name="n", cwd=laptop.project, **kw)


@pytest.mark.parametrize(("local", "key"), [
    ("~/.ssh/cred", "file_mounts"), ("~/.tpufab/cred", "file_mounts"),
    ("~/.config/gcloud/cred", "file_mounts"), ("~/.aws/cred", "files"),
    ("../home/.ssh/cred", "files")])
def test_a_file_in_a_credential_store_is_copied_only_when_named(laptop, local, key):
    with pytest.raises(ConfigError) as err:
        plan_files(laptop, local, key)
    text = str(err.value)
    real = (laptop.project / Path(local).expanduser()).resolve()
    assert text.startswith("t.yaml: ") and "\n" not in text
    assert "where credentials live" in text and f"--allow-file {real}" in text
    assert "a task file comes from other people" in text
    p = plan_files(laptop, local, key, allow_files=[str(real)])
    assert p.files == (("~/dest", real),)
    assert any(f"put {real} at ~/dest (allowed by --allow-file)" in s for s in p.steps)


def test_tpufab_s_own_key_is_a_credential_wherever_it_lives(laptop):
    key = laptop.tmp / "keys" / "mine"
    key.parent.mkdir()
    key.write_text("PRIVATE KEY\n")
    key.chmod(0o644)
    base = settings(laptop.tmp, ssh_key=str(key))
    with pytest.raises(ConfigError, match=f"lies in {key}, where credentials live"):
        launching.plan(task(files_task(str(key))), settings=base, name="n", cwd=laptop.project)


def test_a_symlink_out_of_the_task_directory_is_resolved_and_shown(laptop):
    outside = laptop.tmp / "outside.txt"
    outside.write_text("data\n")
    (laptop.project / "link.txt").symlink_to(outside)
    p = plan_files(laptop, "link.txt")
    assert p.files == (("~/dest", outside),)
    assert any(f"put {outside} (the task names {laptop.project / 'link.txt'}, a symlink to "
               f"it) at ~/dest" in s for s in p.steps), p.steps
    # a symlink into a credential store is refused by where it leads
    (laptop.project / "innocent.txt").symlink_to(laptop.home / ".ssh" / "cred")
    with pytest.raises(ConfigError, match=r"innocent.txt \(for ~/dest\), a symlink to "
                       r".*/home/.ssh/cred, lies in ~/.ssh"):
        plan_files(laptop, "innocent.txt")


def test_a_file_others_cannot_read_is_copied_only_when_named(laptop):
    private = laptop.tmp / "root-only"
    private.write_text("only me\n")
    private.chmod(0o600)
    with pytest.raises(ConfigError, match=r"only its owner may read it \(mode 0600\); a task "
                       "file comes from other people"):
        plan_files(laptop, "../root-only")
    p = plan_files(laptop, "../root-only", allow_files=[str(private)])
    assert p.files == (("~/dest", private),)


@pytest.mark.parametrize(("local", "sentence"), [
    ("/dev/null", "/dev/null (for ~/dest) is a character device here, not a regular file; "
                  "launch copies regular files only."),
    ("nope.txt", "nope.txt (for ~/dest) does not exist here."),
    ("dangling", "does not exist here (", ),
])
def test_a_source_that_is_no_regular_file_is_named_as_what_it_is(laptop, local, sentence):
    (laptop.project / "dangling").symlink_to(laptop.tmp / "gone")
    with pytest.raises(ConfigError, match=re.escape(sentence)):
        plan_files(laptop, local)


def test_allow_file_must_name_a_file_the_task_copies(laptop):
    with pytest.raises(ConfigError, match="--allow-file .*/elsewhere names no file that t.yaml "
                       "copies"):
        plan_files(laptop, "cfg.json", allow_files=[str(laptop.tmp / "elsewhere")])
    p = plan_files(laptop, "cfg.json")      # an ordinary file of the project needs no flag
    assert p.files == (("~/dest", laptop.project / "cfg.json"),)


def test_launch_dry_run_shows_where_a_symlinked_file_leads(laptop):
    """`launch --dry-run` (how a user looks at a task before trusting it) shows the file
    resolved and the symlink's target; a credential is refused in one sentence there too."""
    import os
    import sys

    outside = laptop.tmp / "outside.txt"
    outside.write_text("data\n")
    (laptop.project / "link.txt").symlink_to(outside)
    (laptop.project / "t.yaml").write_text(files_task("link.txt"))
    (laptop.project / "k.yaml").write_text(files_task("~/.ssh/cred"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("TPUFAB_")}
    env.update(HOME=str(laptop.home), TPUFAB_USER_CONFIG=str(laptop.tmp / "none.yaml"),
               TPUFAB_PROJECT="p", COLUMNS="300")
    cmd = [str(Path(sys.executable).parent / "tpufab"), "launch", "--dry-run", "--name", "n"]
    shown = subprocess.run([*cmd, "t.yaml"], env=env, cwd=laptop.project, capture_output=True,
                           text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert shown.returncode == 0, shown.stderr
    assert (f"put {outside} (the task names {laptop.project / 'link.txt'}, a symlink to it) "
            "at ~/dest") in shown.stdout + shown.stderr
    refused = subprocess.run([*cmd, "k.yaml"], env=env, cwd=laptop.project, capture_output=True,
                             text=True, timeout=120, stdin=subprocess.DEVNULL)
    lines = [line for line in refused.stderr.splitlines() if line.strip()]
    assert refused.returncode == 2 and len(lines) == 1 and "--allow-file" in lines[0], \
        refused.stderr
    allowed = subprocess.run([*cmd, "k.yaml", "--allow-file", str(laptop.home / ".ssh/cred")],
                             env=env, cwd=laptop.project, capture_output=True, text=True,
                             timeout=120, stdin=subprocess.DEVNULL)
    assert allowed.returncode == 0, allowed.stderr


def test_a_workdir_whose_commit_holds_a_credential_is_deployed_only_when_named(laptop):
    """The other files a task sends: a workdir of the home directory's dotfiles repository
    would deploy ~/.ssh to every worker."""
    for argv in (["init", "-q"], ["add", "-A"],
                 ["-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "x"]):
        subprocess.run(["git", *argv], cwd=laptop.home, check=True)
    text = "resources: {accelerators: tpu-v4-8}\nworkdir: ~/\nrun: x\n"
    cred = laptop.home / ".aws" / "cred"      # the first in git's order
    with pytest.raises(ConfigError, match=f"whose commit holds {cred} .*--allow-file {cred}"
                       " if you mean to"):
        launching.plan(task(text), settings=settings(laptop.tmp), name="n", cwd=laptop.project)
    p = launching.plan(task(text), settings=settings(laptop.tmp), name="n", cwd=laptop.project,
                       allow_files=[str(laptop.home / ".ssh"), str(laptop.home / ".aws"),
                                    str(laptop.home / ".config/gcloud"),
                                    str(laptop.home / ".tpufab")])
    assert p.root == laptop.home


@pytest.mark.parametrize("text", [
    "resources: {accelerators: tpu-v4-8}\nworkdir: .\nsecrets: {WANDB_API_KEY: wandb-inline-1}"
    "\nrun: x\n",
    "type: v4-8\nworkdir: .\nenvs: {HF_TOKEN: hf_inline_value_1}\nrun: x\n"])
def test_a_secret_whose_value_the_deployed_task_file_holds_is_refused(checkout, tmp_path, text):
    """issue 37, Low 14: launch deploys the committed checkout, task file and all, so an
    inline `secrets:` value (or an HF_TOKEN: value) sat in clear on every worker."""
    path = checkout / "task.yaml"
    path.write_text(text)
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "add", "task.yaml"], cwd=checkout, check=True)
    subprocess.run([*git, "commit", "-qm", "task"], cwd=checkout, check=True)
    name = "WANDB_API_KEY" if "WANDB" in text else "HF_TOKEN"
    with pytest.raises(ConfigError) as err:
        launching.plan(load_task(path), settings=settings(tmp_path), name="n", cwd=checkout)
    assert f"gives the value of the secret {name} itself" in str(err.value)
    assert f"`{name}:`" in str(err.value) and f"--env {name}=VALUE" in str(err.value)
    assert "inline" not in str(err.value)               # the value itself is never said
    # the same task file outside the deployed repository (or git-ignored) is not deployed
    outside = tmp_path / "task.yaml"
    outside.write_text(text)
    launching.plan(load_task(outside), settings=settings(tmp_path), name="n", cwd=checkout)
