"""Each unclear error of issue 11's finding 12 is one sentence with the fix, through the real
`tpufab` command; setup, logs and runs say what a user needs and nothing internal."""

from __future__ import annotations

import os
import re
import socket
import threading
import time

import pytest
from harness import sim_node
from helpers import one_sentence, tpufab


@pytest.fixture
def bare_env(tmp_path):
    """A user's shell with no tpufab settings, in an empty directory."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TPUFAB_")}
    env.update(HOME=str(tmp_path), TPUFAB_USER_CONFIG=str(tmp_path / "none.yaml"),
               TPUFAB_PROJECT="p", COLUMNS="200")
    return env


def test_concurrency_zero_in_the_environment(bare_env, tmp_path):
    result = tpufab("list", env={**bare_env, "TPUFAB_CONCURRENCY": "0"}, cwd=tmp_path)
    one_sentence(result, "TPUFAB_CONCURRENCY", "must be at least 1", "not 0")


def test_negative_concurrency_in_tpufab_yaml(bare_env, tmp_path):
    (tmp_path / "tpufab.yaml").write_text("concurrency: -3\n")
    result = tpufab("list", env=bare_env, cwd=tmp_path)
    one_sentence(result, "tpufab.yaml (concurrency)", "must be at least 1", "not -3")


def test_a_binary_tpufab_yaml(bare_env, tmp_path):
    (tmp_path / "tpufab.yaml").write_bytes(bytes(range(256)) * 4)
    result = tpufab("list", env=bare_env, cwd=tmp_path)
    one_sentence(result, "tpufab.yaml is not a text file", "fix or remove it")


def test_an_api_endpoint_that_is_no_url(bare_env, tmp_path):
    result = tpufab("list", env={**bare_env, "TPUFAB_API_ENDPOINT": "not-a-url"}, cwd=tmp_path)
    one_sentence(result, "TPUFAB_API_ENDPOINT", "must be a URL such as", "'not-a-url'")


def test_an_api_endpoint_on_a_port_that_does_not_speak_http_fails_fast(bare_env, tmp_path):
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    port = listener.getsockname()[1]

    def serve():  # an sshd's greeting, as on a worker's port 22
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            conn.sendall(b"SSH-2.0-OpenSSH_9.2p1 Debian-2\r\n")
            threading.Timer(2, conn.close).start()

    threading.Thread(target=serve, daemon=True).start()
    try:
        began = time.monotonic()
        result = tpufab("list", env={**bare_env, "TPUFAB_API_ENDPOINT":
                                     f"http://127.0.0.1:{port}"}, cwd=tmp_path)
        took = time.monotonic() - began
    finally:
        listener.close()
    # before: 8 attempts over ~50 s, then "overloaded or having an outage"
    line = one_sentence(result, f"http://127.0.0.1:{port}", "not in HTTP",
                        "TPUFAB_API_ENDPOINT")
    assert "outage" not in line
    assert took < 20, took


def test_a_misspelt_setting_in_the_environment(bare_env, tmp_path):
    result = tpufab("list", env={**bare_env, "TPUFAB_ZOME": "europe-west4-a"}, cwd=tmp_path)
    one_sentence(result, "TPUFAB_ZOME is not a tpufab setting", "did you mean TPUFAB_ZONE?")


def test_job_variables_and_unrelated_names_are_not_settings_but_pass(bare_env, tmp_path):
    # a recipe may call tpufab: the job contract's variables are no typo
    env = {**bare_env, "TPUFAB_WORKER_ID": "0", "TPUFAB_RUN_ID": "x", "TPUFAB_SIM_DIR": "/x",
           "TPUFAB_SOMETHING_ELSE": "1", "TPUFAB_API_ENDPOINT": "http://127.0.0.1:9"}
    result = tpufab("list", env=env, cwd=tmp_path)
    # the settings were accepted: it got as far as the (absent) API
    assert "Cannot reach the TPU API at http://127.0.0.1:9" in result.stderr, result.stderr
    assert "ignoring TPUFAB_SOMETHING_ELSE" in result.stderr
    assert "WORKER_ID" not in result.stderr and "RUN_ID" not in result.stderr


# ---------------------------------------------------------------------------------------------
# on a simulated pod: setup, logs and runs


@pytest.fixture(scope="module")
def pod2(sim, tmp_path_factory):
    with sim_node(sim, tmp_path_factory, "err", "v4-16") as pod:
        yield pod


@pytest.mark.sim
def test_setup_shows_the_script_output_and_no_internal_json(pod2):
    script = pod2.home / "setup.sh"
    script.write_text("#!/bin/sh\necho installing things\n")
    first = tpufab("setup", "--script", str(script), env=pod2.env, cwd=pod2.home)
    assert first.returncode == 0, first.stderr
    assert "installing things" in first.stdout, first.stdout
    again = tpufab("setup", "--script", str(script), env=pod2.env, cwd=pod2.home)
    assert again.returncode == 0 and "skipped" in again.stdout
    for result in (first, again):
        assert '"status"' not in result.stdout + result.stderr, result.stdout
        assert "tpufab_setup" not in result.stdout + result.stderr


@pytest.mark.sim
def test_logs_and_runs_with_a_worker_unreachable(sim_admin, pod2):
    recipe = pod2.home / "quick.sh"
    recipe.write_text("#!/bin/sh\necho hello from $TPUFAB_WORKER_ID\n")
    recipe.chmod(0o755)
    ran = tpufab("run", str(recipe), "--no-deploy", env=pod2.env, cwd=pod2.home)
    assert ran.returncode == 0, ran.stderr
    sim_admin.set_reachable(pod2.name, 1, False)
    try:
        logs = tpufab("logs", env=pod2.env, cwd=pod2.home)
        runs = tpufab("runs", env=pod2.env, cwd=pod2.home)
    finally:
        sim_admin.set_reachable(pod2.name, 1, True)
    # before: "(w1 has no record of it.)" and exit 0
    assert logs.returncode != 0, logs.stdout + logs.stderr
    assert "hello from 0" in logs.stdout
    assert "no record" not in logs.stderr
    assert "No log from w1 unreachable" in logs.stderr, logs.stderr
    assert "Traceback" not in logs.stderr
    # before: TIME was "-" for every run once a worker did not answer
    row = next(line for line in runs.stdout.splitlines() if "quick.sh" in line)
    columns = re.split(r"\s{2,}", row.strip())  # RUN RECIPE STARTED TIME COMMIT WORKERS
    assert re.fullmatch(r"\d+\.\ds", columns[3]), row
    assert "w1 unreachable" in columns[-1]
