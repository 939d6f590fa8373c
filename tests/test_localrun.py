"""run_local: real recipes as N local processes with the pod's environment contract."""

from __future__ import annotations

import importlib.util
import io
import os
import re
import sys
from pathlib import Path

import pytest
from helpers import process_alive

from tpufab.errors import ConfigError, TpufabError
from tpufab.ssh.results import FanoutError, GroupResult
from tpufab.steps.runs.env import Forwarded
from tpufab.steps.start.localrun import run_local

REPO = Path(__file__).resolve().parents[1]
RECIPES = REPO / "recipes"
HAS_JAX = importlib.util.find_spec("jax") is not None


def recipe(tmp_path, body, name="r.sh"):
    path = tmp_path / name
    path.write_text("#!/bin/bash\nset -eu\n" + body)
    path.chmod(0o755)
    return path


def fail_after_peers_start(worker, peers):
    """Recipe lines: `worker` exits 1 once every peer has written ready.<id> (60 s bound)."""
    ready = " ".join(f"ready.{p}" for p in peers)
    return (f'if [ "$TPUFAB_WORKER_ID" = {worker} ]; then\n'
            f"  for _ in $(seq 600); do ls {ready} >/dev/null 2>&1 && exit 1; sleep 0.1; done\n"
            "  exit 2\nfi\n")


@pytest.mark.skipif(not HAS_JAX, reason="jax is not installed in this venv "
                    "(.venv/bin/pip install jax)")
def test_jax_hello_on_four_local_processes():
    out = io.StringIO()
    result = run_local(RECIPES / "jax_hello.sh", workers=4, out=out, timeout=240)
    assert result.ok, (result.summary(), out.getvalue())
    assert result.exit_codes == (0, 0, 0, 0)
    views = [[line for line in result.output[w] if line.startswith("jax_hello:")]
             for w in range(4)]
    assert all(view == views[0] for view in views)           # the same collective result
    text = "\n".join(views[0])
    assert re.search(r"backend=cpu processes=4 devices=4 local_devices=1", text)
    assert "all-gather of process ids = [0, 1, 2, 3]" in text
    assert "over all devices = 10 (expected 10)" in text
    assert views[0][-1] == "jax_hello: OK"
    assert "w3: jax_hello: OK" in out.getvalue()


@pytest.mark.skipif(not HAS_JAX, reason="jax is not installed in this venv")
def test_jax_training_recipe_runs_on_two_local_processes():
    result = run_local(RECIPES / "jax_train.sh", workers=2, echo=False, timeout=300,
                       args=["--steps", "20", "--log-every", "10", "--batch", "4",
                             "--seq", "32", "--dim", "32", "--layers", "1", "--fsdp"])
    assert result.ok, (result.summary(), result.output)
    steps = [[line for line in result.output[w] if line.startswith("step")] for w in (0, 1)]
    assert steps[0] == steps[1] and len(steps[0]) == 2      # both processes, same numbers
    losses = [float(re.search(r"loss ([0-9.]+)", line).group(1)) for line in steps[0]]
    assert losses[-1] < losses[0]


def test_environment_contract(tmp_path):
    path = recipe(tmp_path, 'echo "$TPUFAB_WORKER_ID/$TPUFAB_NUM_WORKERS $TPU_WORKER_ID '
                            '$TPUFAB_COORDINATOR $JAX_PLATFORMS $TPUFAB_RUN_ID $FOO ${#HF_TOKEN} '
                            '$1"\n')
    result = run_local(path, workers=3, args=["arg1"], echo=False, coordinator_port=4567,
                       run_id="20260101-000000-abcd",
                       forwarded=Forwarded({"FOO": "bar"}, {"HF_TOKEN": "hf_x"}))
    assert result.ok
    for w in range(3):
        assert result.output[w] == (
            f"{w}/3 {w} 127.0.0.1:4567 cpu 20260101-000000-abcd bar 4 arg1",)


def test_a_failing_worker_is_named(tmp_path):
    path = recipe(tmp_path, 'if [ "$TPUFAB_WORKER_ID" = 2 ]; then echo boom >&2; exit 3; fi\n'
                            'echo fine\n')
    out = io.StringIO()
    result = run_local(path, workers=4, out=out)
    assert not result.ok and list(result.failed) == [2]
    assert result.exit_codes == (0, 0, 3, 0)
    assert result.summary() == "Worker 2 failed (exit code 3)."
    assert "w2: boom" in out.getvalue().splitlines()
    with pytest.raises(TpufabError, match="Worker 2 failed"):
        result.raise_for_failure()
    # the one command-result container, as a pod's run returns it: {worker: result}
    assert isinstance(result, GroupResult) and list(result.succeeded) == [0, 1, 3]
    assert result[2].exit_code == 3 and result[2].stdout == "boom\n" and result[0].stdout == "fine\n"
    with pytest.raises(FanoutError, match=r"failed on 1 of 4 workers: w2 exit 3"):
        result.check()


def test_peers_of_a_failed_worker_are_stopped(tmp_path):
    # Workers 0 and 2 wait for a peer that died, as collective code does; a child too.
    path = recipe(tmp_path, fail_after_peers_start(1, [0, 2]) +
                  'sleep 300 &\necho "child $!"\ntouch "ready.$TPUFAB_WORKER_ID"\nwait\n')
    result = run_local(path, workers=3, echo=False, failure_grace=0.2, cwd=tmp_path)
    assert result.first_failure == 1 and result.exit_codes[1] == 1
    assert result.exit_codes[0] < 0 and result.exit_codes[2] < 0
    assert result.summary() == "Worker 1 failed (exit code 1); stopped after it: workers 0,2."
    children = [int(result.output[w][0].split()[1]) for w in (0, 2)]
    assert not any(process_alive(pid) for pid in children)


def test_a_child_that_ignores_term_is_killed_too(tmp_path):
    # The worker's shell dies on TERM at once; its child does not. Stopping waits for the
    # whole process group, so the child gets KILL instead of outliving the run.
    path = recipe(tmp_path, fail_after_peers_start(1, [0]) +
                  "(trap '' TERM; exec sleep 300) &\n"
                  'echo "child $!"\ntouch "ready.$TPUFAB_WORKER_ID"\nwait\n')
    result = run_local(path, workers=2, echo=False, failure_grace=0.1, cwd=tmp_path)
    assert result.summary() == "Worker 1 failed (exit code 1); stopped after it: workers 0."
    child = int(result.output[0][0].split()[1])
    assert not process_alive(child)


def test_timeout_stops_everything(tmp_path):
    path = recipe(tmp_path, "sleep 300 &\nwait\n")
    result = run_local(path, workers=2, echo=False, timeout=0.3)
    assert result.timed_out and not result.ok
    assert "timed out" in result.summary()


def test_single_worker_output_is_not_prefixed(tmp_path):
    out = io.StringIO()
    run_local(recipe(tmp_path, "echo hi\n"), workers=1, out=out)
    assert out.getvalue() == "hi\n"


def test_bad_input(tmp_path):
    with pytest.raises(ConfigError, match="No recipe"):
        run_local(tmp_path / "missing.sh")
    with pytest.raises(ConfigError, match="at least 1"):
        run_local(recipe(tmp_path, "true\n"), workers=0)


@pytest.mark.skipif(importlib.util.find_spec("torch_xla") is not None,
                    reason="torch_xla is installed: the missing-package message cannot show")
def test_torch_xla_hello_says_clearly_that_torch_xla_is_missing():
    result = run_local(RECIPES / "torch_xla_hello.sh", workers=1, echo=False,
                       env={**os.environ, "TPUFAB_PYTHON": sys.executable})
    assert result.exit_codes == (2,)
    lines = [line for line in result.output[0] if line.strip()]
    assert len(lines) == 1 and "torch_xla is not installed" in lines[0]


def test_run_passes_the_trailing_arguments_through_after_args(tmp_path, capsys, monkeypatch):
    from tpufab.verbs.jobs import run

    monkeypatch.chdir(tmp_path)
    path = recipe(tmp_path, 'printf "%s|" "$@"; echo\n')
    code = run(str(path), ["--steps", "10", "two words", "x;y"], args="--lr '0.1 0.2'",
               local=True, workers=2)
    assert code == 0
    lines = capsys.readouterr().out.splitlines()
    assert sorted(lines) == [f"w{w}: --lr|0.1 0.2|--steps|10|two words|x;y|" for w in (0, 1)]


def test_a_python_file_runs_with_the_jobs_python_and_gets_the_torch_contract(tmp_path):
    path = tmp_path / "train.py"                       # no shebang, not executable
    path.write_text("import os, sys\n"
                    "keys = ('RANK', 'NODE_RANK', 'LOCAL_RANK', 'WORLD_SIZE', 'MASTER_ADDR')\n"
                    "print(sys.executable, sys.argv[1:], [os.environ[k] for k in keys],\n"
                    "      os.path.isdir(os.environ['TPUFAB_OUTPUT_DIR']),\n"
                    "      os.path.isdir(os.environ['TPUFAB_PROFILE_DIR']))\n")
    result = run_local(path, workers=2, args=["model=tiny", "global_batch_size=8"],
                       echo=False, cwd=tmp_path,
                       env={**os.environ, "TPUFAB_PYTHON": sys.executable})
    assert result.ok, result.output
    for w in (0, 1):
        assert result.output[w] == (
            f"{sys.executable} ['model=tiny', 'global_batch_size=8'] "
            f"['{w}', '{w}', '0', '2', '127.0.0.1'] True True",)
    runs = list((tmp_path / ".tpufab" / "runs").iterdir())
    assert [r.name for r in runs] == [result.run_id]
    assert (runs[0] / "output").is_dir() and (runs[0] / "profile").is_dir()
