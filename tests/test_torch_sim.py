"""torch_xla, Lightning and torchprime-style runs on a simulated v4-32 (4 real sshd workers).

The workers import torch 2.9, torch_xla 2.9 and Lightning from the pod's shared site
(scripts/sim-wheels.sh --torch, built once per machine and cached; scripts/setup-sim.sh on
every worker). Everything runs through the real `tpufab` command, as a user types it.
"""

from __future__ import annotations

import ast
import hashlib
import json
import re
from pathlib import Path

import pytest
from harness import connected_pod
from helpers import tpufab

REPO = Path(__file__).resolve().parents[1]
RECIPES = REPO / "recipes"
SECRET = "hf_Tq3-torchprime-never-in-logs-9921"

pytestmark = [pytest.mark.sim, pytest.mark.timeout(1800)]

# A torchprime-style program: no shebang, hydra-style key=value arguments, run as it is.
TRAIN_PY = """import hashlib, json, os, sys
out = os.environ["TPUFAB_OUTPUT_DIR"]
with open(os.path.join(out, f"rank{os.environ['RANK']}.txt"), "w") as fh:
    fh.write("written")
print(json.dumps({
    "argv": sys.argv[1:],
    "python": sys.executable,
    "env": {k: os.environ.get(k) for k in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK",
                                           "NODE_RANK", "LOCAL_RANK", "TPUFAB_WORKER_ID",
                                           "TPUFAB_NUM_WORKERS", "TPUFAB_COORDINATOR",
                                           "XLA_IR_DEBUG", "LIBTPU_INIT_ARGS")},
    "hf_token_sha256": hashlib.sha256(os.environ.get("HF_TOKEN", "").encode()).hexdigest(),
    "output_dir": out, "profile_dir": os.environ["TPUFAB_PROFILE_DIR"],
    "profile_dir_exists": os.path.isdir(os.environ["TPUFAB_PROFILE_DIR"]),
}), flush=True)
"""

ECHO_SH = """#!/bin/sh
printf 'arg:%s\\n' "$@"
"""


@pytest.fixture(scope="module")
def torch_pod(sim, tmp_path_factory):
    """A v4-32 whose workers import torch, torch_xla and Lightning; (env, pod, site)."""
    drop = ("HF_TOKEN", "XLA_IR_DEBUG", "XLA_HLO_DEBUG", "LIBTPU_INIT_ARGS")
    with connected_pod(sim, tmp_path_factory, "torch", ssh_user="root", drop=drop,
                       site="torch", setup=True) as pod:
        yield pod.env, pod.pod, Path(sim.state_dir) / "share" / "site"  # this session's copy


def worker_lines(stdout: str, worker: int, prefix: str) -> list[str]:
    """What worker N printed (`wN │ text`), the lines starting with `prefix`."""
    mark = f"w{worker} │ "
    return [line[len(mark):] for line in stdout.splitlines()
            if line.startswith(mark) and line[len(mark):].startswith(prefix)]


def test_torch_xla_hello_forms_one_world_across_the_workers(torch_pod, tmp_path):
    env, _, _ = torch_pod
    result = tpufab("run", str(RECIPES / "torch_xla_hello.sh"), "--no-deploy", "--raw",
                    cwd=tmp_path, env=env, timeout=900)
    assert result.returncode == 0, result.stdout + result.stderr
    for w in range(4):
        said = worker_lines(result.stdout, w, "torch_xla_hello:")
        assert re.search(r"torch 2\.9\.0\S* torch_xla 2\.9\.0 device=CPU world_size=4 ",
                         said[0]), said
        assert "torch_xla_hello: ranks = [0, 1, 2, 3]" in said
        assert "torch_xla_hello: all-reduce of (rank + 1) = 10 (expected 10)" in said
        assert said[-1] == "torch_xla_hello: OK"
    assert "finished on w[0-3]: exit 0" in result.stderr

    folded = tpufab("logs", cwd=tmp_path, env=env, timeout=900)  # one copy of the common lines
    assert folded.returncode == 0, folded.stderr
    lines = folded.stdout.splitlines()
    assert lines.count("torch_xla_hello: all-reduce of (rank + 1) = 10 (expected 10)") == 1
    assert lines.count("torch_xla_hello: OK") == 1


def test_torch_xla_training_prints_its_metrics_once_and_the_loss_goes_down(torch_pod,
                                                                          tmp_path):
    env, _, _ = torch_pod
    result = tpufab("run", str(RECIPES / "torch_xla_train.sh"), "--no-deploy", "--raw",
                    "--args=--steps 16 --log-every 5", cwd=tmp_path, env=env, timeout=900)
    assert result.returncode == 0, result.stdout + result.stderr
    metric_lines = [line for line in result.stdout.splitlines() if "'train_loss'" in line]
    assert len(metric_lines) == 1 and metric_lines[0].startswith("w0 │ {"), metric_lines
    metrics = ast.literal_eval(metric_lines[0].split("│ ", 1)[1])
    assert metrics["train_runtime"] > 0 and metrics["train_samples_per_second"] > 0
    header = worker_lines(result.stdout, 0, "torch_xla_train:")
    assert header and "4 processes, device=CPU" in header[0] and "global batch 32" in header[0]
    losses = [float(re.search(r"loss ([0-9.]+)", line).group(1))
              for line in worker_lines(result.stdout, 0, "step")]
    assert len(losses) == 4 and losses[-1] < losses[0] * 0.9, losses   # steps 5, 10, 15, 16
    assert metrics["train_loss"] > losses[-1]          # the mean of a falling curve
    for w in (1, 2, 3):                                        # rank 0 alone reports
        assert not worker_lines(result.stdout, w, "step")
        assert not worker_lines(result.stdout, w, "{")


def test_lightning_ddp_finishes_fit_on_every_rank(torch_pod, tmp_path):
    env, _, _ = torch_pod
    result = tpufab("run", str(RECIPES / "lightning_train.sh"), "--no-deploy", "--raw",
                    "--args=--steps 12", cwd=tmp_path, env=env, timeout=900)
    assert result.returncode == 0, result.stdout + result.stderr
    checksums = set()
    for w in range(4):
        said = worker_lines(result.stdout, w, "lightning_train:")
        assert len(said) == 1, said
        found = re.search(rf"rank {w} of 4 \(cpu, DDPStrategy\) finished fit after 12 steps: "
                          r"loss ([0-9.]+) -> ([0-9.]+), weights checksum (-?[0-9.]+)", said[0])
        assert found, said
        assert float(found.group(2)) < float(found.group(1))
        checksums.add(found.group(3))
    assert len(checksums) == 1, checksums                      # DDP kept the replicas equal


def test_torchprime_style_python_file_with_pass_through_arguments(torch_pod, tmp_path):
    env, pod, _ = torch_pod
    train = tmp_path / "train.py"
    train.write_text(TRAIN_PY)                                  # no shebang, not executable
    local = {**env, "HF_TOKEN": SECRET, "XLA_IR_DEBUG": "1",
             "LIBTPU_INIT_ARGS": "--xla_tpu_enable_async_collective_fusion=true"}
    extra = ["model=tiny", "global_batch_size=8", "run.name=a b's", "x;y", "$HOME"]
    result = tpufab("run", "--no-deploy", "--raw", str(train), *extra, cwd=tmp_path, env=local,
                    timeout=900)
    assert result.returncode == 0, result.stdout + result.stderr
    assert SECRET not in result.stdout + result.stderr
    assert "HF_TOKEN=***" in result.stderr and "XLA_IR_DEBUG=1" in result.stderr
    ips = pod.internal_ips()
    reports = {}
    for w in range(4):
        said = worker_lines(result.stdout, w, "{")
        assert len(said) == 1, result.stdout
        reports[w] = json.loads(said[0])
    for w, report in reports.items():
        assert report["argv"] == extra
        assert report["python"] == "/root/.venv/bin/python"     # the job's Python (setup-sim)
        assert report["env"] == {
            "MASTER_ADDR": ips[0], "MASTER_PORT": report["env"]["MASTER_PORT"],
            "WORLD_SIZE": "4", "RANK": str(w), "NODE_RANK": str(w), "LOCAL_RANK": "0",
            "TPUFAB_WORKER_ID": str(w), "TPUFAB_NUM_WORKERS": "4",
            "TPUFAB_COORDINATOR": report["env"]["TPUFAB_COORDINATOR"], "XLA_IR_DEBUG": "1",
            "LIBTPU_INIT_ARGS": "--xla_tpu_enable_async_collective_fusion=true"}
        assert 29500 <= int(report["env"]["MASTER_PORT"]) < 30500
        host, port = report["env"]["TPUFAB_COORDINATOR"].split(":")
        assert host == ips[0] and 8476 <= int(port) < 8976, report["env"]
        assert report["hf_token_sha256"] == hashlib.sha256(SECRET.encode()).hexdigest()
        assert report["profile_dir_exists"]
        assert report["output_dir"].endswith("/output")
    run_id = result.stderr.split("Run ", 1)[1].split(":", 1)[0]
    written = pod.fanout.run(["cat", f"/root/.tpufab/runs/{run_id}/output/rank0.txt"],
                             workers=[0])
    assert written.ok, written.details()
    assert [r.stdout for _, r in written.items()] == ["written"]
    assert reports[0]["output_dir"] == f"/root/.tpufab/runs/{run_id}/output"

    echo = tmp_path / "x.sh"                                  # a recipe: `x.sh -- --steps 10`
    echo.write_text(ECHO_SH)
    echo.chmod(0o755)
    result = tpufab("run", "--no-deploy", "--raw", "--args=--lr 0.1", str(echo), "--", "--steps",
                    "10", "two words", cwd=tmp_path, env=env, timeout=900)
    assert result.returncode == 0, result.stdout + result.stderr
    assert worker_lines(result.stdout, 2, "arg:") == ["arg:--lr", "arg:0.1", "arg:--steps",
                                                      "arg:10", "arg:two words"]


def test_torch_xla_hello_on_four_local_processes(torch_pod, tmp_path):
    env, _, site = torch_pod
    local = {**env, "TPUFAB_PYTHON": "/usr/bin/python3", "PYTHONPATH": str(site)}
    result = tpufab("run", str(RECIPES / "torch_xla_hello.sh"), "--local", "--workers", "4",
                    cwd=tmp_path, env=local, timeout=900)
    assert result.returncode == 0, result.stdout + result.stderr
    for w in range(4):
        assert f"w{w}: torch_xla_hello: all-reduce of (rank + 1) = 10 (expected 10)" \
            in result.stdout
        assert f"w{w}: torch_xla_hello: OK" in result.stdout
    assert "world_size=4" in result.stdout
    assert "All 4 workers exited 0." in result.stderr
