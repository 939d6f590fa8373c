"""`tpufab exec|setup|ssh` and `invoke exec|setup` as a user runs them, on a simulated v4-32."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from helpers import invoke, tpufab, unique_name

pytestmark = pytest.mark.sim

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


OUTSIDE = Path(tempfile.mkdtemp(prefix="tpufab-exec-cwd-"))  # not a project: no current pod


@pytest.fixture(scope="module")
def pod_env(sim, tmp_path_factory):
    """A v4-32 created with `tpufab create`, and the environment that names it."""
    home = tmp_path_factory.mktemp("home")
    env = {k: v for k, v in os.environ.items() if not k.startswith("TPUFAB_")}
    env.update(sim.env(), HOME=str(home), TPUFAB_USER_CONFIG=str(home / "none.yaml"),
               TPUFAB_NAME=unique_name("exec"), COLUMNS="200")
    created = tpufab("create", "--type", "v4-32", env=env, cwd=OUTSIDE)
    assert created.returncode == 0, created.stderr
    yield env
    tpufab("delete", "--yes", env=env, cwd=OUTSIDE)


def test_exec_runs_on_every_worker_with_prefixed_lines(pod_env):
    result = tpufab("exec", "hostname", env=pod_env, cwd=OUTSIDE)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert len(lines) == 4
    by_worker = dict(line.split(" │ ", 1) for line in lines)
    assert sorted(k.strip() for k in by_worker) == ["w0", "w1", "w2", "w3"]
    assert len(set(by_worker.values())) == 4  # four distinct hosts
    assert all(v.endswith(f"-w-{k.strip()[1:]}") for k, v in by_worker.items())


@pytest.mark.parametrize("selection,expected", [
    ("0", ["w0"]), ("1,3", ["w1", "w3"]), ("w[1-2]", ["w1", "w2"]), ("2-3", ["w2", "w3"]),
])
def test_exec_on_a_subset(pod_env, selection, expected):
    result = tpufab("exec", "--worker", selection, "echo hi", env=pod_env, cwd=OUTSIDE)
    assert result.returncode == 0, result.stderr
    # lines arrive as workers answer; each worker's own lines stay in order
    assert sorted(line.split(" │ ")[0].strip() for line in result.stdout.splitlines()) == expected


def test_gather_folds_identical_output(pod_env):
    result = tpufab("exec", "--gather", "echo same; test -e /etc/hostname", env=pod_env,
                    cwd=OUTSIDE)
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("same") == 1
    assert "w[0-3] (exit 0)" in result.stdout


def test_a_failing_worker_fails_the_command_and_is_named(pod_env):
    result = invoke("exec", "--gather", "echo ok; hostname | grep -q 'w-2$' && exit 3; true",
                    env=pod_env, cwd=OUTSIDE)
    assert result.returncode == 3
    assert "w[0-1,3] (exit 0)" in result.stdout and "w2 (exit 3)" in result.stdout
    assert "failed on 1 of 4 workers: w2 exit 3" in result.stderr
    assert "Traceback" not in result.stderr


def test_quotes_and_shell_characters_run_literally(pod_env, tmp_path):
    text = "it's \"quoted\" $(touch /tmp/canary) `touch /tmp/canary`; and\nnewline"
    result = tpufab("exec", "--worker", "0", f"printf '%s\\n' {_sh_quote(text)}", env=pod_env,
                    cwd=OUTSIDE)
    assert result.returncode == 0, result.stderr
    assert result.stdout.replace("w0 │ ", "") == text + "\n"
    assert tpufab("exec", "test ! -e /tmp/canary", env=pod_env, cwd=OUTSIDE).returncode == 0


def test_bad_selection_is_one_sentence(pod_env):
    result = tpufab("exec", "--worker", "7", "true", env=pod_env, cwd=OUTSIDE)
    assert result.returncode != 0
    assert "0-3" in result.stderr and "Traceback" not in result.stderr


API_RUN = """
from tpufab import Pod, PodError, PodResult
result = Pod().run('echo "$MY_TOKEN $PLAIN"', workers="0",
                   env={"MY_TOKEN": "s3cr3t-value", "PLAIN": "visible"})
assert isinstance(result, PodResult) and sorted(result.succeeded) == [0], result
print(result[0].stdout, end="")
try:
    Pod().run("exit 4", workers="1,2")
except PodError as err:
    print("PodError", err.exit_code, sorted(err.result.failed), err.message)
"""


def test_exec_env_and_pod_run_env_mask_the_same_variables(pod_env):
    # one rule for both doors (tpufab.steps.runs.env.forwarded_for): a name like *TOKEN* is a
    # secret whether it comes from `exec -e` or from Pod.run(env=...)
    cli = tpufab("exec", "-w", "0", "-e", "MY_TOKEN=s3cr3t-value", "-e", "PLAIN=visible",
                 'echo "$MY_TOKEN $PLAIN"', env=pod_env)
    assert cli.returncode == 0, cli.stderr
    api = subprocess.run([sys.executable, "-c", API_RUN], env=pod_env, cwd=tempfile.gettempdir(),
                         capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert api.returncode == 0, api.stderr
    assert cli.stdout.replace("w0 │ ", "") == "*** visible\n"
    assert api.stdout.splitlines()[0] == "*** visible"
    assert "s3cr3t-value" not in cli.stdout + cli.stderr + api.stdout + api.stderr
    # PodError is the one exception of a failed run, with every worker's result
    assert api.stdout.splitlines()[1] == ("PodError 4 [1, 2] `exit 4` failed on 2 of 2 "
                                          "workers: w[1-2] exit 4.")


def test_setup_runs_once_then_skips(pod_env, tmp_path):
    script = tmp_path / "setup.sh"
    script.write_text("#!/bin/sh\nset -e\necho setting up on $(hostname)\ndate +%s%N >> ~/setup-count\n")
    first = tpufab("setup", "--script", str(script), env=pod_env, cwd=OUTSIDE)
    assert first.returncode == 0, first.stderr
    assert "w[0-3] ran" in first.stdout
    second = invoke("setup", "--script", str(script), env=pod_env, cwd=OUTSIDE)
    assert second.returncode == 0, second.stderr
    assert "w[0-3] skipped" in second.stdout
    counts = tpufab("exec", "--gather", "wc -l < ~/setup-count", env=pod_env, cwd=OUTSIDE)
    assert "w[0-3] (exit 0)" in counts.stdout and "\n1\n" in counts.stdout
    forced = tpufab("setup", "--script", str(script), "--force", "--worker", "0", env=pod_env,
                    cwd=OUTSIDE)
    assert "w0 ran" in forced.stdout


def test_missing_setup_script_is_one_sentence(pod_env):
    result = tpufab("setup", "--script", "no/such/script.sh", env=pod_env, cwd=OUTSIDE)
    assert result.returncode != 0
    assert "no/such/script.sh does not exist" in result.stderr


def test_ssh_runs_on_the_chosen_worker_with_pinned_host_keys(pod_env):
    result = tpufab("ssh", "--worker", "3", "--", "hostname", env=pod_env, cwd=OUTSIDE)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().endswith("-w-3")
    known = Path(pod_env["HOME"]) / ".tpufab" / "known_hosts"
    assert len(known.read_text().splitlines()) == 4  # pinned from the API, one per worker


def _sh_quote(text: str) -> str:
    import shlex

    return shlex.quote(text)


def test_known_hosts_forget_then_keys_are_pinned_again(pod_env):
    known = Path(pod_env["HOME"]) / ".tpufab" / "known_hosts"
    assert tpufab("exec", "true", env=pod_env, cwd=OUTSIDE).returncode == 0
    before = known.read_text()
    forgot = tpufab("known-hosts", "forget", pod_env["TPUFAB_NAME"], env=pod_env, cwd=OUTSIDE)
    assert forgot.returncode == 0, forgot.stderr
    assert "Forgot 4 pinned host keys" in forgot.stdout
    assert known.read_text() == ""
    assert tpufab("exec", "true", env=pod_env, cwd=OUTSIDE).returncode == 0
    assert sorted(known.read_text().splitlines()) == sorted(before.splitlines())


def test_a_changed_host_key_is_refused_with_the_fix(pod_env):
    known = Path(pod_env["HOME"]) / ".tpufab" / "known_hosts"
    assert tpufab("exec", "true", env=pod_env, cwd=OUTSIDE).returncode == 0
    original = known.read_text()
    alias, ktype = original.splitlines()[0].split()[:2]   # (its key, and how it was learned)
    other = "AAAAC3NzaC1lZDI1NTE5AAAAIBzHhEcA0HVGvC0YQ1lYg6bJvHk8m5C7Yk6dHZ0n5ZbJ"
    known.write_text(original.replace(original.splitlines()[0], f"{alias} {ktype} {other}"))
    try:
        result = tpufab("exec", "true", env=pod_env, cwd=OUTSIDE)
        assert result.returncode != 0
        assert "differs from the one pinned" in result.stderr
        assert "tpufab known-hosts forget" in result.stderr
    finally:
        known.write_text(original)
