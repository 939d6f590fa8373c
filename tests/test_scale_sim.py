"""A 256-worker simulated node (v4-2048: a node of more than 254 workers, so it spans two
address slots), made through the emulator as users make one, and exec, status and kill on it
through the real `tpufab` command: every worker answers and the views stay folded.

Lean on purpose (CI runs it on 2 cores): one node for the module, one call per verb.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from conftest import unique_name
from helpers import TPUFAB, cli_env

pytestmark = pytest.mark.sim

WORKERS = 256
ALL = f"w[0-{WORKERS - 1}]"


def flat(text: str) -> list[str]:
    """Lines with runs of spaces as one (column widths depend on the widest worker set)."""
    return [" ".join(line.split()) for line in text.splitlines()]


def tpufab(env: dict, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([TPUFAB, *args], env=env, cwd=env["HOME"], capture_output=True,
                          text=True, timeout=timeout, stdin=subprocess.DEVNULL)


@pytest.fixture(scope="module")
def big(sim, tmp_path_factory):
    home = tmp_path_factory.mktemp("scale-home")
    env = cli_env(sim, Path(home), unique_name("scale"))
    env["TPUFAB_WAIT_TIMEOUT"] = "600"
    created = tpufab(env, "create", "--type", "v4-2048")
    try:
        assert created.returncode == 0, created.stdout + created.stderr
        yield env
    finally:
        tpufab(env, "delete", "--yes")


def test_the_node_spans_two_address_slots(big, sim):
    from tpufab.sim.admin import SimAdmin

    workers = SimAdmin.from_info(sim).node(big["TPUFAB_NAME"])["workers"]
    assert len(workers) == WORKERS and all(w["running"] for w in workers)
    ips = [w["ip"] for w in workers]
    assert len(set(ips)) == WORKERS
    # workers 0-253 on the node's first slot, 254-255 on the next one
    first, second = ips[0].rsplit(".", 1)[0], ips[254].rsplit(".", 1)[0]
    assert first != second and ips[253] == f"{first}.254" and ips[254] == f"{second}.1"


def test_exec_reaches_every_worker_and_folds_identical_output(big):
    result = tpufab(big, "exec", "--gather", "echo same; test -e /dev/accel3")
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("same") == 1
    assert f"{ALL} (exit 0)" in result.stdout
    assert len(result.stdout.splitlines()) < 10  # one group, not 256 copies


def test_status_counts_every_worker_in_one_row(big):
    result = tpufab(big, "status")
    assert result.returncode == 0, result.stdout + result.stderr
    lines = flat(result.stdout)
    assert any("v4-2048 READY HEALTHY, 256 workers" in line for line in lines), lines
    rows = [line for line in lines if line.startswith("w[")]
    assert len(rows) == 1 and rows[0].startswith(f"{ALL} up "), lines
    assert "4 free" in rows[0]


def test_kill_clears_a_few_workers_and_folds_the_rest(big):
    made = tpufab(big, "sim", "zombie", "--worker", "3,200")
    assert made.returncode == 0, made.stdout + made.stderr
    killed = tpufab(big, "kill", "--grace", "1", "--force")
    assert killed.returncode == 0, killed.stdout + killed.stderr
    lines = flat(killed.stdout)
    assert any(line.startswith("w[3,200] killed") for line in lines), lines
    assert f"w[0-2,4-199,201-{WORKERS - 1}] nothing to kill" in lines
    assert len(lines) < 20  # folded rows, not a row per worker
    summary = (flat(killed.stderr) or lines)[-1]  # the last line says it all
    assert summary.startswith("Killed 6 processes on w[3,200]"), lines
    assert f"TPU free on {ALL}: yes." in summary, summary
