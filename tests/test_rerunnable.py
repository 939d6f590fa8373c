"""Verbs and scripts that must work when run again at once (issue 11, finding 10)."""

from __future__ import annotations

import os
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
from conftest import free_port

TPUFAB = str(Path(sys.executable).parent / "tpufab")


def tpufab(*args: str, env: dict, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([TPUFAB, *args], env=env, capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL)


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
