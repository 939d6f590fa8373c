"""A 256-worker simulated node (v4-2048: a node of more than 254 workers, so it spans two
address slots), made through the emulator as users make one, and exec, status and kill on it
through the real `tpufab` command: every worker answers and the views stay folded.

Lean on purpose (CI runs it on 2 cores): one node for the module, one call per verb.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import cli_env, tpufab, unique_name

pytestmark = pytest.mark.sim

WORKERS = 256
ALL = f"w[0-{WORKERS - 1}]"


def flat(text: str) -> list[str]:
    """Lines with runs of spaces as one (column widths depend on the widest worker set)."""
    return [" ".join(line.split()) for line in text.splitlines()]


@pytest.fixture(scope="module")
def big(sim, tmp_path_factory):
    home = tmp_path_factory.mktemp("scale-home")
    env = cli_env(sim, Path(home), unique_name("scale"))
    env["TPUFAB_WAIT_TIMEOUT"] = "600"
    created = tpufab("create", "--type", "v4-2048", env=env, cwd=env["HOME"], timeout=600)
    try:
        assert created.returncode == 0, created.stdout + created.stderr
        yield env
    finally:
        tpufab("delete", "--yes", env=env, cwd=env["HOME"], timeout=600)


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
    result = tpufab("exec", "--gather", "echo same; test -e /dev/accel3", env=big,
                    cwd=big["HOME"], timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("same") == 1
    assert f"{ALL} (exit 0)" in result.stdout
    assert len(result.stdout.splitlines()) < 10  # one group, not 256 copies


def test_status_counts_every_worker_in_one_row(big):
    result = tpufab("status", env=big, cwd=big["HOME"], timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = flat(result.stdout)
    assert any("v4-2048 READY HEALTHY, 256 workers" in line for line in lines), lines
    rows = [line for line in lines if line.startswith("w[")]
    assert len(rows) == 1 and rows[0].startswith(f"{ALL} up "), lines
    assert "4 free" in rows[0]


def test_kill_clears_a_few_workers_and_folds_the_rest(big):
    made = tpufab("sim", "zombie", "--worker", "3,200", env=big, cwd=big["HOME"], timeout=600)
    assert made.returncode == 0, made.stdout + made.stderr
    killed = tpufab("kill", "--grace", "1", "--force", env=big, cwd=big["HOME"], timeout=600)
    assert killed.returncode == 0, killed.stdout + killed.stderr
    lines = flat(killed.stdout)
    assert any(line.startswith("w[3,200] killed") for line in lines), lines
    assert f"w[0-2,4-199,201-{WORKERS - 1}] nothing to kill" in lines
    assert len(lines) < 20  # folded rows, not a row per worker
    summary = (flat(killed.stderr) or lines)[-1]  # the last line says it all
    assert summary.startswith("Killed 6 processes on w[3,200]"), lines
    assert f"TPU free on {ALL}: yes." in summary, summary
