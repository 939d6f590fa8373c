"""Verbs and scripts that must work when run again at once (issue 11, finding 10)."""

from __future__ import annotations

import os
import sys
import urllib.request
from pathlib import Path

import pytest
from helpers import free_port, interrupted_when, tpufab

TPUFAB = str(Path(sys.executable).parent / "tpufab")


@pytest.mark.sim
def test_sim_down_then_up_on_the_same_port_after_traffic(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("the simulated pod needs root")
    env = {k: v for k, v in os.environ.items() if not k.startswith("TPUFAB_")}
    port = free_port()
    state = str(tmp_path / "sim")
    up = tpufab("sim", "up", "--port", str(port), "--state-dir", state, env=env)
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        # client traffic: the server closes these connections first, so its side of each
        # sits in TIME_WAIT on `port` for a minute after `sim down`
        for _ in range(3):
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/v2/projects/p/locations/"
                                        "z/nodes", timeout=10) as answer:
                assert answer.status == 200
        down = tpufab("sim", "down", "--state-dir", state, env=env)
        assert down.returncode == 0, down.stderr
        again = tpufab("sim", "up", "--port", str(port), "--state-dir", state, env=env)
        assert again.returncode == 0, again.stdout + again.stderr
        assert f"http://127.0.0.1:{port}" in again.stdout
    finally:
        tpufab("sim", "down", "--state-dir", state, env=env)


@pytest.mark.sim
def test_ctrl_c_during_create_says_how_to_delete_and_delete_of_a_creating_node_works(
        sim, sim_admin, tmp_path):
    from helpers import cli_env, unique_name

    name = unique_name("cc")
    env = cli_env(sim, tmp_path, name)
    # it stays CREATING while the test looks at it (30 s was once too short on a loaded CI: the
    # bring-up of a node deleted meanwhile just ends, so a long delay costs nothing)
    sim_admin.settings(create_delay=120.0)
    try:
        result = interrupted_when([TPUFAB, "create", "--name", name, "--type", "v4-8"], env,
                                  lambda r: r.saw("CREATING"), "the create to be under way",
                                  cwd=tmp_path)
        # before: only "Interrupted."
        assert result.returncode == 130, result.stderr
        assert "Traceback" not in result.stderr
        lines = [line for line in result.stderr.splitlines() if line.strip()]
        assert any(f"TPU node {name} may still be coming up" in line
                   and f"`tpufab delete --name {name} --yes`" in line for line in lines), lines
        described = tpufab("describe", "--name", name, "--json", env=env)
        assert '"CREATING"' in described.stdout, described.stdout + described.stderr
        # the node being created can be deleted at once
        deleted = tpufab("delete", "--name", name, "--yes", env=env, timeout=180)
        assert deleted.returncode == 0, deleted.stdout + deleted.stderr
        gone = tpufab("describe", "--name", name, env=env)
        assert gone.returncode != 0 and f"No node named {name!r}" in gone.stderr, gone.stderr
    finally:
        sim_admin.settings(create_delay=0.2)
        tpufab("delete", "--name", name, "--yes", env=env)
