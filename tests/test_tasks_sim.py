"""issue 25: tasks and scripts from other tools run as written, on the simulated pod.

Setup caching is honest (a failed command is never recorded as done; launch --force-setup;
the failure names the line, the log on the worker and its local copy, --down or not).
Every launch here is a v4-8 (one worker) unless the point needs more.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest
from helpers import no_traceback, one_sentence, tpufab, unique_name

pytestmark = pytest.mark.sim   # every test here drives the simulated pod

SKY = Path(__file__).parent / "data" / "skypilot"   # the SkyPilot TPU docs' tasks (README.md)
HF = "hf_issue25-token-7781"


@pytest.fixture(scope="module")
def world(sim, tmp_path_factory):
    """The environment naming the simulated pod's API and a committed project checkout."""
    base = tmp_path_factory.mktemp("tasks-sim")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TPUFAB_", "HF_"))}
    env.update(sim.env(), TPUFAB_USER_CONFIG=str(base / "none.yaml"),
               TPUFAB_SSH_KEY=str(base / "key" / "tpufab_ed25519"),
               TPUFAB_KNOWN_HOSTS=str(base / "known_hosts"), COLUMNS="200")
    project = base / "proj"
    (project / "code").mkdir(parents=True)
    (project / "code" / "train.py").write_text("print('training')\n")
    commit(project)
    return {"env": env, "project": project, "base": base}


def commit(project: Path) -> None:
    for argv in (["init", "-q"], ["add", "-A"],
                 ["-c", "user.name=t", "-c", "user.email=t@t.invalid", "commit", "-qm", "code",
                  "--allow-empty"]):
        subprocess.run(["git", *argv], cwd=project, check=True, capture_output=True)


def launch(world, task: str, text: str, *args: str, **kw) -> subprocess.CompletedProcess:
    """`tpufab launch TASK` of ``text`` written outside the checkout (so it stays clean)."""
    path = world["base"] / task
    path.write_text(text)
    return tpufab("launch", str(path), *args, env=world["env"], cwd=world["project"], **kw)


def delete(world, name: str) -> None:
    tpufab("delete", "--name", name, "--yes", env=world["env"], cwd=world["project"])


def last_line(result) -> str:
    return [line for line in result.stderr.splitlines() if line.strip()][-1]


# ---------------------------------------------------------------------------------------------
# finding 4: setup that failed is not cached as done


SKY_SETUP_FAILS = """\
resources:
  accelerators: tpu-v4-8
workdir: code
setup: |
  echo setup-start
  git clone /no/such/repository.git
  false || echo handled-failure-is-fine
  echo setup-last-line
run: |
  echo run-ran
"""


def test_a_skypilot_setup_with_a_failed_command_runs_on_but_is_not_recorded_done(world):
    """SkyPilot runs a setup to the end (its exit status is its last command's), so the run
    starts; but the failed clone is named (line, command, log) and the setup runs again next
    launch, until --force-setup is not even needed."""
    name = unique_name("sky-setup")
    try:
        first = launch(world, "sky-fail.yaml", SKY_SETUP_FAILS, "--name", name)
        assert first.returncode == 0, first.stdout + first.stderr
        assert "run-ran" in first.stdout and "setup-last-line" in first.stdout
        warning = next(line for line in first.stderr.splitlines() if "Setup failed" in line)
        assert "Setup failed on w0 at line 2 (`git clone /no/such/repository.git` exited 128)" \
            in warning
        log = warning.split("its log is ")[1].split(" on the worker")[0]
        assert log.startswith("/home/tpufab/.tpufab/setup/") and log.endswith(".log")
        copy = world["project"] / warning.split("copied to ")[1].split(";")[0]
        assert "tpufab: setup line 2: `git clone /no/such/repository.git` exited 128" in \
            copy.read_text()
        assert oct(copy.stat().st_mode & 0o777) == "0o600"
        assert "not recorded as done: the next launch runs it again" in warning
        assert "line 3" not in warning           # `false || ...` is a handled failure

        again = launch(world, "sky-fail.yaml", SKY_SETUP_FAILS, "--name", name)
        assert again.returncode == 0, again.stdout + again.stderr
        assert "already done" not in again.stderr
        assert "setup-start" in again.stdout       # it ran again
    finally:
        delete(world, name)


TPUFAB_SETUP = """\
type: v4-8
workdir: code
setup: |
  echo tpufab-setup-start
  {middle}
  echo tpufab-setup-end
run: |
  echo run-ran
"""


def test_a_tpufab_setup_stops_at_the_first_failure_and_down_keeps_its_log(world):
    name = unique_name("tfb-setup")
    got = launch(world, "fail.yaml", TPUFAB_SETUP.format(middle="ls /no/such/dir"),
                 "--name", name, "--down")
    no_traceback(got)
    assert got.returncode != 0
    assert "tpufab-setup-end" not in got.stdout + got.stderr     # errexit
    assert "run-ran" not in got.stdout
    sentence = next(line for line in got.stderr.splitlines() if "launch failed at" in line)
    assert sentence.startswith("launch failed at setup: the fail.yaml setup failed on w0 at "
                               "line 2 (`ls /no/such/dir` exited 2); its log is "
                               "/home/tpufab/.tpufab/setup/"), sentence
    copy = world["project"] / sentence.split("copied to ")[1].rstrip(".")
    assert "ls: cannot access '/no/such/dir'" in copy.read_text()   # the pod is gone, the log not
    assert f"Deleted TPU node {name}" in got.stderr


def test_launch_force_setup_runs_a_done_setup_again(world):
    name = unique_name("force")
    text = TPUFAB_SETUP.format(middle="true")
    try:
        first = launch(world, "ok.yaml", text, "--name", name)
        assert first.returncode == 0, first.stdout + first.stderr
        assert "Setup: ran on w0." in first.stderr
        second = launch(world, "ok.yaml", text, "--name", name)
        assert "Setup: already done on w0 (this content ran there before; --force-setup runs " \
            "it again)." in second.stderr
        forced = launch(world, "ok.yaml", text, "--name", name, "--force-setup")
        assert forced.returncode == 0, forced.stdout + forced.stderr
        assert "Setup: ran on w0." in forced.stderr and "tpufab-setup-start" in forced.stdout
    finally:
        delete(world, name)


# ---------------------------------------------------------------------------------------------
# finding 5: `run` keeps $0 meaningful


@pytest.fixture(scope="module")
def pod8(sim, tmp_path_factory):
    """A READY v4-8 (one worker), connected, with a user's environment naming it."""
    from harness import connected_pod

    with connected_pod(sim, tmp_path_factory, "recipe", "v4-8") as pod:
        yield pod


SCRIPT_DIR_RECIPE = """\
#!/bin/bash
set -e
SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"   # Levanter's way
echo "script-dir=$SCRIPT_DIR"
cd "$(dirname "$0")"                                          # the walkthrough's way
cat ./config.txt
"""


def test_a_recipe_in_the_checkout_runs_from_its_path_there(pod8, tmp_path):
    """`tpufab run t5x/run.sh`: $0 is the deployed checkout's t5x/run.sh, so cd "$(dirname
    "$0")" and SCRIPT_DIR reach config.txt beside it."""
    project = tmp_path / "walk"
    (project / "t5x").mkdir(parents=True)
    (project / "t5x" / "run.sh").write_text(SCRIPT_DIR_RECIPE)
    (project / "t5x" / "config.txt").write_text("config-beside-the-script\n")
    commit(project)
    got = tpufab("run", "./t5x/run.sh", "--direct", env=pod8.env, cwd=project)
    assert got.returncode == 0, got.stdout + got.stderr
    assert f"script-dir=/home/tpufab/{project.name}/t5x" in got.stdout    # the checkout
    assert "config-beside-the-script" in got.stdout
    assert "shipped copy" not in got.stderr


def test_a_shipped_copy_that_needs_its_folder_fails_saying_why(pod8, tmp_path):
    """--no-deploy of a file outside any repository: the shipped copy runs, and the failure
    says that its folder is not the project's."""
    (tmp_path / "run.sh").write_text(SCRIPT_DIR_RECIPE)
    (tmp_path / "config.txt").write_text("only here\n")
    got = tpufab("run", str(tmp_path / "run.sh"), "--no-deploy", env=pod8.env, cwd=tmp_path)
    no_traceback(got)
    assert got.returncode == 1, got.stdout + got.stderr
    assert "config.txt: No such file or directory" in got.stdout + got.stderr
    end = last_line(got)
    assert "Run " in end and "failed on w0" in end
    assert "The recipe run.sh ran as a shipped copy (/home/tpufab/.tpufab/runs/" in end
    assert "because it is outside the repository, so its own folder" in end
    assert end.endswith("put it in the repository and run it with deploy (or deploy the "
                        "checkout it expects first).")


# ---------------------------------------------------------------------------------------------
# findings 1-3 with the SkyPilot TPU docs' task files: planned as written, run offline


LLAMA_TRAIN = """\
import argparse, json, os
p = argparse.ArgumentParser()
for flag in ("--output_dir", "--config_name", "--fsdp_config"):
    p.add_argument(flag)
p.add_argument("--max_steps", type=int)
a = p.parse_args()
config = json.load(open(a.config_name))
fsdp = json.load(open(a.fsdp_config))
print("clm", config["model"], "fsdp", fsdp["fsdp"], "steps", a.max_steps,
      "rank", os.environ["SKYPILOT_NODE_RANK"], "of", os.environ["SKYPILOT_NUM_NODES"],
      "token", os.environ["HF_TOKEN"])
"""


@pytest.fixture(scope="module")
def sky_project(world):
    """A checkout laid out as the Llama task expects: its json configs beside the task."""
    project = world["base"] / "llama"
    project.mkdir()
    (project / "config-8B.json").write_text('{"model": "llama-3-8b-tiny"}\n')
    (project / "fsdp_config.json").write_text('{"fsdp": "full_shard"}\n')
    (project / "train_clm.py").write_text(LLAMA_TRAIN)
    commit(project)
    return project


def sky_launch(world, cwd: Path, task: Path, *args: str) -> subprocess.CompletedProcess:
    return tpufab("launch", str(task), *args, env=world["env"], cwd=cwd,
                  extra_env={"HF_TOKEN": HF})


def plan_lines(got) -> list[str]:
    assert got.returncode == 0, got.stdout + got.stderr
    return got.stdout.splitlines()


def test_the_docs_tasks_plan_as_written(world, sky_project):
    """--dry-run of the three task files as the docs write them: ~/sky_workdir linked and
    entered, /home/gcpuser in envs given the worker's home, the zone shown, the MNIST task's
    name made a node name."""
    llama = plan_lines(sky_launch(world, sky_project, SKY / "llama3_train_v6e.yaml", "--name",
                                  "llama-dry", "--dry-run"))
    assert "  3. link ~/sky_workdir to ~/llama on every worker (SkyPilot's workdir: setup and " \
        "run start there)" in llama
    assert any(line.startswith("  4. setup (") and
               line.endswith("lines, once per content) in ~/sky_workdir") for line in llama), llama
    assert any("on every worker in ~/sky_workdir; env: HF_TOKEN=*** + SKYPILOT_* variables "
               "and TPU_NAME" in line for line in llama), llama
    assert "in us-central2-b (project" in llama[1]
    serve = plan_lines(sky_launch(world, sky_project, SKY / "jetstream_serve_v6e.yaml",
                                  "--name", "serve-dry", "--dry-run"))
    assert any("(/home/gcpuser in input_ckpt_dir, output_ckpt_dir, tokenizer_path: the "
               "worker's home)" in line for line in serve), serve
    mnist = plan_lines(sky_launch(world, sky_project, SKY / "mnist_tpuvm.yaml", "--dry-run"))
    assert mnist[0].endswith("(SkyPilot task) on tpuvm-mnist:")
    assert mnist[1] == ("  (The task's name tpuvm_mnist is not a valid TPU node name; the pod "
                        "is tpuvm-mnist (--name picks another).)")
    assert "v2-8 (1 host" in mnist[2]
    assert HF not in "".join(llama + serve + mnist)


def test_the_llama_task_offline_runs_in_sky_workdir_to_the_end(world, sky_project):
    """/home/$USER/sky_workdir/config-8B.json is the deployed checkout's file; setup's clone of
    ~/sky_workdir and the run both start in ~/sky_workdir."""
    name = unique_name("llama")
    got = sky_launch(world, sky_project, SKY / "offline" / "llama3_train_v6e.yaml",
                     "--name", name, "--down")
    assert got.returncode == 0, got.stdout + got.stderr
    assert "setup done in /home/tpufab/sky_workdir/transformers" in got.stdout
    assert "clm llama-3-8b-tiny fsdp full_shard steps 3 rank 0 of 1 token ***" in got.stdout
    assert HF not in got.stdout + got.stderr
    assert f"Deleted TPU node {name}" in got.stderr


def test_the_jetstream_task_offline_finds_gcpuser_paths_in_its_home(world, sky_project):
    name = unique_name("serve")
    got = sky_launch(world, sky_project, SKY / "offline" / "jetstream_serve_v6e.yaml",
                     "--name", name, "--down")
    assert got.returncode == 0, got.stdout + got.stderr
    assert "converted into /home/tpufab/sky_workdir/ckpt/llama2-7b/converted" in got.stdout
    assert (f"serving llama-2 from /home/tpufab/sky_workdir/ckpt/llama2-7b/converted on {name}"
            in got.stdout)
    assert "weights: weights of llama-2" in got.stdout and "tokenizer: a tokenizer" in got.stdout


def test_the_mnist_task_offline_runs_on_the_pod_its_name_gives(world, sky_project):
    got = sky_launch(world, sky_project, SKY / "offline" / "mnist_tpuvm.yaml", "--down")
    assert got.returncode == 0, got.stdout + got.stderr
    assert "the pod is tpuvm-mnist" in got.stderr
    assert "mnist epoch 1 on tpuvm-mnist rank 0 python /home/tpufab/flax-env" in got.stdout
    assert "Deleted TPU node tpuvm-mnist" in got.stderr


def test_a_task_naming_gcpuser_in_its_run_is_refused_in_one_sentence(world):
    got = launch(world, "gcp.yaml", "resources: {accelerators: tpu-v4-8}\nrun: |\n  echo hi\n"
                 "  mkdir -p /home/gcpuser/ckpt\n", "--name", unique_name("gcp"))
    sentence = one_sentence(got)
    assert sentence.endswith(
        "/gcp.yaml: line 2 of run names /home/gcpuser, the home of SkyPilot's own login user "
        "on its VMs, while tpufab logs in as tpufab: write $HOME/... there (tpufab gives an env "
        "value that names /home/gcpuser the worker's home; see docs/launch.md)."), sentence


# ---------------------------------------------------------------------------------------------
# finding 2: the zone a task names is the zone it runs in


def test_infra_zone_is_where_the_pod_is_created(world, sim_admin):
    name = unique_name("zone")
    text = ("resources:\n  accelerators: tpu-v4-8\n  infra: gcp/us-east5/us-east5-a\n"
            "run: |\n  echo ran in $TPU_NAME\n")
    dry = launch(world, "zone.yaml", text, "--name", name, "--dry-run")
    assert f"1. create {name}: v4-8 (1 host, on-demand, runtime tpu-ubuntu2204-base) in " \
        "us-east5-a" in dry.stdout, dry.stdout
    try:
        got = launch(world, "zone.yaml", text, "--name", name)
        assert got.returncode == 0, got.stdout + got.stderr
        assert f"ran in {name}" in got.stdout
        zones = {n["name"].rsplit("/", 1)[-1]: n["name"].split("/")[3]
                 for n in sim_admin.state()["nodes"]}
        assert zones[name] == "us-east5-a"
    finally:
        tpufab("delete", "--name", name, "--zone", "us-east5-a", "--yes", env=world["env"],
               cwd=world["project"])


def test_a_region_without_a_zone_is_refused_unless_the_zone_setting_lies_in_it(world):
    text = "resources:\n  accelerators: tpu-v4-8\n  infra: gcp/us-east5\nrun: x\n"
    got = launch(world, "region.yaml", text, "--name", unique_name("rg"), "--dry-run")
    assert one_sentence(got).endswith(
        "/region.yaml names region us-east5 but no zone, and tpufab creates TPUs in a zone: "
        "name one (infra: gcp/us-east5/us-east5-b, or resources.zone) or pass --zone (the zone "
        "setting, us-central2-b, is not in us-east5).")
    ok = tpufab("launch", str(world["base"] / "region.yaml"), "--name", "rg", "--dry-run",
                env={**world["env"], "TPUFAB_ZONE": "us-east5-a"}, cwd=world["project"])
    assert "in us-east5-a (project" in ok.stdout, ok.stdout + ok.stderr


# ---------------------------------------------------------------------------------------------
# finding 3: `sky exec`-style task files


def test_a_run_only_task_runs_on_the_current_ready_pod_with_skypilot_s_environment(world):
    name = unique_name("exec")
    created = tpufab("create", "--name", name, "--type", "v4-16", env=world["env"],
                     cwd=world["project"])
    assert created.returncode == 0, created.stdout + created.stderr
    try:
        got = launch(world, "exec.yaml", "run: |\n  echo rank=$SKYPILOT_NODE_RANK "
                     "nodes=$SKYPILOT_NUM_NODES tpu=$TPU_NAME\n",
                     extra_env={"TPUFAB_NAME": name})
        assert got.returncode == 0, got.stdout + got.stderr
        assert (f"exec.yaml names no pod (no `name:`), so it runs on {name}, from TPUFAB_NAME "
                "(--name picks another).") in got.stderr
        assert f"TPU node {name} already exists and is READY" in got.stderr
        # folded or not, as the two workers' lines arrive: each rank once, the same pod
        ranks = set(re.findall(rf"rank=(\S+) nodes=2 tpu={name}$", got.stdout, re.M))
        assert ranks in ({"{0,1}"}, {"0", "1"}), got.stdout
    finally:
        delete(world, name)


# ---------------------------------------------------------------------------------------------
# finding 7: `tpufab setup --env` passes a secret as `run -e` does

WANDB = "wandb-key-issue25-55821"

ENV_SETUP = """\
#!/bin/bash
echo "key=$WANDB_API_KEY mode=$MODE"
n=0
for f in /proc/[0-9]*/cmdline; do
  if tr '\\0' ' ' < "$f" 2>/dev/null | grep -q "$WANDB_API_KEY"; then n=$((n + 1)); fi
done
echo "argv-holding-the-key=$n"
"""


def test_setup_env_passes_a_secret_masked_and_never_in_argv(pod8, tmp_path):
    script = tmp_path / "env-setup.sh"
    script.write_text(ENV_SETUP)
    got = tpufab("setup", "--script", str(script), "-e", "WANDB_API_KEY", "--env", "MODE=fast",
                 env=pod8.env, cwd=tmp_path, extra_env={"WANDB_API_KEY": WANDB})
    assert got.returncode == 0, got.stdout + got.stderr
    assert "key=*** mode=fast" in got.stdout
    assert "argv-holding-the-key=0" in got.stdout
    assert WANDB not in got.stdout + got.stderr
    logs = tpufab("exec", "cat ~/.tpufab/setup/*.log", env=pod8.env, cwd=tmp_path)
    assert "key=*** mode=fast" in logs.stdout and WANDB not in logs.stdout


# ---------------------------------------------------------------------------------------------
# finding 6: the shared site carries what JAX's pod discovery imports


def test_jax_pod_discovery_reads_the_metadata_server_with_the_shared_site(sim,
                                                                          tmp_path_factory):
    """JAX's Cloud TPU cluster detection (what a bare jax.distributed.initialize() runs on a
    TPU VM) reads the metadata server through `requests`, which the shared site now carries:
    under ~/.venv it gets the worker's number as on a TPU VM."""
    from harness import connected_pod

    probe = ("from jax._src.clusters import cloud_tpu_cluster as c; "
             "print('agent-worker-number', c.get_metadata('agent-worker-number'))")
    bare = ("import jax; jax.distributed.initialize(); "
            "print('procs', jax.process_count(), 'index', jax.process_index())")
    with connected_pod(sim, tmp_path_factory, "jaxd", "v4-8", site="jax", setup=True) as pod:
        got = tpufab("exec", f"~/.venv/bin/python -c {shlex.quote(probe)}", env=pod.env,
                     cwd=pod.base)
        assert got.returncode == 0, got.stdout + got.stderr
        assert "agent-worker-number ('0', 200)" in got.stdout
        # the whole discovery (JAX_FORCE_TPU_INIT stands in for libtpu: docs/simulated-pod.md)
        got = tpufab("exec", "JAX_PLATFORMS=cpu JAX_FORCE_TPU_INIT=1 ~/.venv/bin/python -c "
                     + shlex.quote(bare), env=pod.env, cwd=pod.base)
        assert got.returncode == 0, got.stdout + got.stderr
        assert "procs 1 index 0" in got.stdout

