"""`tpufab` and `invoke` as a user runs them: subprocesses against the simulated pod."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from helpers import invoke, one_sentence, tpufab, unique_name

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
TPUFAB = str(BIN / "tpufab")
INVOKE = str(BIN / "invoke")


@pytest.fixture
def user_env(tmp_path):
    """A clean environment: own HOME (so a fresh tpufab key), no TPUFAB_* from outside."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TPUFAB_")}
    home = tmp_path / "home"
    home.mkdir()
    env.update(HOME=str(home), TPUFAB_USER_CONFIG=str(tmp_path / "no-user-config.yaml"),
               TPUFAB_SSH_USER="alice", TPUFAB_API_RETRIES="4", TPUFAB_API_RETRY_SECONDS="20",
               TPUFAB_WAIT_TIMEOUT="120", COLUMNS="200")
    env.pop("TPUFAB_DEBUG", None)
    return env


@pytest.fixture
def sim_env(sim, user_env):
    return {**user_env, **sim.env()}


# Outside the checkout: a verb that remembers a current pod writes it where it runs, and
# tpufab's own checkout must not become a test's project.
OUTSIDE = Path(tempfile.mkdtemp(prefix="tpufab-cli-cwd-"))


# ---------------------------------------------------------------------------------------------
# start-up


MODULES_PROBE = """
import json, sys
{body}
heavy = [m for m in ("google.cloud.tpu_v2", "google.api_core", "fabric", "paramiko",
                   "pydantic") if m in sys.modules]
print(json.dumps(heavy))
"""


def imported_heavy_modules(body: str, cwd: Path) -> list[str]:
    result = subprocess.run([sys.executable, "-c", MODULES_PROBE.format(body=body)], cwd=cwd,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_tpufab_help_imports_no_cloud_sdk_or_fabric(tmp_path):
    body = ("from tpufab.cli import build_app\napp = build_app()\n"
            "try:\n    app(['--help'])\nexcept SystemExit:\n    pass\n"
            "try:\n    app(['create', '--help'])\nexcept SystemExit:\n    pass\n")
    assert imported_heavy_modules(body, tmp_path) == []


def test_a_verb_reading_its_flags_imports_no_pydantic(tmp_path):
    """typer 0.29 coerces every flag through a pydantic TypeAdapter: +0.25 s of CPU on every
    command (docs/benchmarks.md), so pyproject.toml keeps typer below it. A command that reads
    its flags and stops at its first sentence (no pod named) imports none of the above."""
    body = (f"import os\nos.environ['TPUFAB_USER_CONFIG'] = {str(tmp_path / 'none.yaml')!r}\n"
            "import contextlib, io\nfrom tpufab.cli import build_app\napp = build_app()\n"
            "said = io.StringIO()\n"
            "with contextlib.redirect_stderr(said):\n    try:\n"
            "        app(['exec', '--timeout', '5', '--worker', '0', 'true'])\n"
            "    except SystemExit:\n        pass\n"
            "assert 'No node name given' in said.getvalue(), said.getvalue()\n")
    assert imported_heavy_modules(body, tmp_path) == []


def test_invoke_list_imports_no_cloud_sdk_or_fabric():
    body = ("from invoke.main import program\n"
            "try:\n    program.run(['invoke', '--list'])\nexcept SystemExit:\n    pass\n")
    assert imported_heavy_modules(body, REPO) == []


VERBS = ("init", "use", "launch", "autostop", "gc", "create", "delete", "list", "describe",
         "types", "topology", "exec", "setup", "ssh", "deploy", "mount", "umount", "run", "logs",
         "runs", "kill", "status", "babysit", "check", "top")
SIM_VERBS = ("up", "down", "status", "preempt", "unreachable", "fail-create", "burst", "zombie",
             "bucket", "os-login", "maintenance", "end-run", "slow", "registry", "image")


def listed_commands(text: str, section: str = "Commands:") -> list[str]:
    """The first word of each entry under `section` in a --help or --list output."""
    body = text.split(section, 1)[1] if section in text else ""
    return [line.split()[0] for line in body.splitlines()
            if line.startswith("  ") and not line.startswith("   ") and line.strip()]


def test_help_lists_every_verb(user_env, tmp_path):
    result = tpufab("--help", env=user_env, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    listed = listed_commands(result.stdout)
    assert set(VERBS) | {"sim"} <= set(listed), listed
    sim = tpufab("sim", "--help", env=user_env, cwd=tmp_path)
    assert set(listed_commands(sim.stdout)) == set(SIM_VERBS), sim.stdout

    result = invoke("--list", env=user_env, cwd=OUTSIDE)
    assert result.returncode == 0, result.stderr
    tasks = set(listed_commands(result.stdout, "Available tasks:"))
    assert {*VERBS, *(f"sim.{v}" for v in SIM_VERBS)} <= tasks, sorted(tasks)


def test_types_table(user_env, tmp_path):
    result = tpufab("types", env=user_env, cwd=tmp_path)
    assert result.returncode == 0
    row = next(line.split() for line in result.stdout.splitlines() if line.startswith("v4-32 "))
    assert row[:5] == ["v4-32", "4", "16", "4", "tpu-ubuntu2204-base"]
    data = json.loads(invoke("types", "--json", env=user_env, cwd=OUTSIDE).stdout)
    v6e = next(t for t in data if t["type"] == "v6e-8")
    assert v6e["hosts"] == 1 and v6e["device_files"][-1] == "/dev/vfio/7"


# ---------------------------------------------------------------------------------------------
# bad input: one sentence, no traceback, before any API call


BAD_CREATES = [
    (["--name", "demo", "--type", "v4-7"], ["Unknown TPU accelerator type 'v4-7'", "v4-8"]),
    (["--name", "demo", "--type", "v9-8"], ["Unknown TPU accelerator type 'v9-8'"]),
    (["--name", "demo"], ["No type given", "--type"]),
    (["--name", "my node", "--type", "v4-8"], ["Invalid node name 'my node'"]),
    (["--name", "tpu;reboot", "--type", "v4-8"], ["Invalid node name 'tpu;reboot'"]),
    (["--name", "demo", "--type", "v4-8", "--spot", "--reserved"], ["cannot be combined"]),
    (["--name", "demo", "--type", "v4-8", "--label", "oops"], ["--label takes key=value"]),
]


@pytest.mark.parametrize("args, fragments", BAD_CREATES,
                         ids=[" ".join(a) for a, _ in BAD_CREATES])
def test_bad_create_input(user_env, tmp_path, args, fragments):
    # the endpoint answers nothing: a bad input must be refused before any API call
    env = {**user_env, "TPUFAB_API_ENDPOINT": "http://127.0.0.1:9", "TPUFAB_PROJECT": "p"}
    one_sentence(tpufab("create", *args, env=env, cwd=tmp_path), *fragments)
    one_sentence(invoke("create", *args, env=env, cwd=OUTSIDE), *fragments)


def test_unreachable_endpoint(user_env, tmp_path):
    env = {**user_env, "TPUFAB_API_ENDPOINT": "http://127.0.0.1:9", "TPUFAB_PROJECT": "p"}
    sentence = ("Cannot reach the TPU API at http://127.0.0.1:9 (connection refused); is the "
                "simulated pod up? run `tpufab sim up`")
    one_sentence(tpufab("list", env=env, cwd=tmp_path), sentence)
    one_sentence(invoke("describe", "--name", "demo", env=env, cwd=OUTSIDE), sentence)
    one_sentence(tpufab("create", "--name", "demo", "--type", "v4-8", env=env,
                                       cwd=tmp_path), sentence)


def test_no_project(user_env, tmp_path):
    env = {**user_env, "TPUFAB_API_ENDPOINT": "http://127.0.0.1:9"}
    one_sentence(tpufab("list", env=env, cwd=tmp_path),
                                "No project given: pass --project")


def test_debug_shows_the_traceback(user_env, tmp_path):
    env = {**user_env, "TPUFAB_API_ENDPOINT": "http://127.0.0.1:9", "TPUFAB_PROJECT": "p"}
    result = tpufab("--debug", "list", env=env, cwd=tmp_path)
    assert result.returncode != 0 and "Traceback" in result.stderr
    assert "Cannot reach the TPU API" in result.stderr


# ---------------------------------------------------------------------------------------------
# on the simulated pod


@pytest.mark.sim
def test_tpufab_create_list_describe_delete(sim_env, tmp_path):
    name = unique_name("cli")
    result = tpufab("create", "--name", name, "--accelerator-type", "tpu-v4-32",
                    "--label", "team=ml", env=sim_env, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert f"TPU node {name} is READY" in result.stdout and "4 hosts" in result.stdout
    key = Path(sim_env["HOME"]) / ".ssh" / "tpufab_ed25519"
    assert key.exists() and (key.stat().st_mode & 0o777) == 0o600   # generated on first use

    result = tpufab("list", env=sim_env, cwd=tmp_path)
    row = next(line.split() for line in result.stdout.splitlines() if line.startswith(name))
    assert row[1:5] == ["v4-32", "READY", "HEALTHY", "4"]

    data = json.loads(tpufab("describe", "--name", name, "--json", env=sim_env,
                             cwd=tmp_path).stdout)
    assert data["name"] == name and data["state"] == "READY" and data["hosts"] == 4
    assert len({w["external_ip"] for w in data["workers"]}) == 4
    assert data["labels"] == {"team": "ml"}
    listed = json.loads(tpufab("list", "--json", env=sim_env, cwd=tmp_path).stdout)
    assert name in [n["name"] for n in listed]

    again = tpufab("create", "--name", name, "--type", "v4-32", env=sim_env, cwd=tmp_path)
    assert again.returncode == 0 and "already exists and is READY" in again.stdout

    refused = tpufab("delete", "--name", name, env=sim_env, cwd=tmp_path)
    one_sentence(refused, "pass --yes")

    result = tpufab("delete", "--name", name, "--yes", env=sim_env, cwd=tmp_path)
    assert result.returncode == 0 and f"Deleted TPU node {name}" in result.stdout
    result = tpufab("delete", "--name", name, "--yes", env=sim_env, cwd=tmp_path)
    assert result.returncode == 0 and "nothing to delete" in result.stdout
    one_sentence(tpufab("describe", "--name", name, env=sim_env, cwd=tmp_path),
                                f"No node named '{name}'")


@pytest.mark.sim
def test_invoke_create_list_describe_delete(sim_env):
    name = unique_name("inv")
    result = invoke("create", "--name", name, "--type", "v6e-8", "--spot", env=sim_env, cwd=OUTSIDE)
    assert result.returncode == 0, result.stderr
    assert f"TPU node {name} is READY" in result.stdout
    assert name in invoke("list", env=sim_env, cwd=OUTSIDE).stdout
    data = json.loads(invoke("describe", "--name", name, "--json", env=sim_env, cwd=OUTSIDE).stdout)
    assert data["accelerator_type"] == "v6e-8" and data["spot"] is True
    assert data["runtime_version"] == "v2-alpha-tpuv6e" and data["hosts"] == 1
    result = invoke("delete", "--name", name, "--yes", env=sim_env, cwd=OUTSIDE)
    assert result.returncode == 0 and f"Deleted TPU node {name}" in result.stdout
    assert name not in invoke("list", env=sim_env, cwd=OUTSIDE).stdout


@pytest.mark.sim
def test_queued_multislice_from_the_command_line(sim_env, tmp_path):
    name = unique_name("qcli")
    result = invoke("create", "--name", name, "--type", "v4-16", "--queued", "--num-slices", "2",
                    env=sim_env, cwd=OUTSIDE)
    assert result.returncode == 0, result.stderr
    assert f"Queued resource {name} is ACTIVE" in result.stdout
    listed = json.loads(tpufab("list", "--json", env=sim_env, cwd=tmp_path).stdout)
    assert {f"{name}-0", f"{name}-1"} <= {n["name"] for n in listed}
    result = tpufab("delete", "--name", name, "--yes", env=sim_env, cwd=tmp_path)
    assert result.returncode == 0 and f"Deleted queued resource {name}" in result.stdout


@pytest.mark.sim
def test_sim_fault_commands(sim_env, tmp_path, sim_admin):
    name = unique_name("fault")
    assert tpufab("sim", "fail-create", env=sim_env, cwd=tmp_path).returncode == 0
    one_sentence(
        tpufab("create", "--name", name, "--type", "v4-8", env=sim_env, cwd=tmp_path),
        "No v4-8 capacity is available", "--spot")
    assert invoke("sim.fail-create", "--quota", env=sim_env, cwd=OUTSIDE).returncode == 0
    one_sentence(invoke("create", "--name", name, "--type", "v4-8", env=sim_env, cwd=OUTSIDE),
                                "Not enough quota")

    assert tpufab("sim", "burst", "--count", "2", env=sim_env, cwd=tmp_path).returncode == 0
    result = tpufab("list", env=sim_env, cwd=tmp_path)
    assert result.returncode == 0 and result.stderr.count("TPU API busy (503") == 2

    assert tpufab("create", "--name", name, "--type", "v4-8", env=sim_env,
                  cwd=tmp_path).returncode == 0
    try:
        assert tpufab("sim", "unreachable", name, "--worker", "0", env=sim_env,
                      cwd=tmp_path).returncode == 0
        assert invoke("sim.unreachable", "--name", name, "--worker", "0", "--restore",
                      env=sim_env, cwd=OUTSIDE).returncode == 0
        result = invoke("sim.preempt", "--name", name, env=sim_env, cwd=OUTSIDE)
        assert result.returncode == 0 and "PREEMPTED" in result.stdout
        result = tpufab("list", env=sim_env, cwd=tmp_path)
        assert f"{name} was PREEMPTED" in result.stdout
        one_sentence(
            tpufab("create", "--name", name, "--type", "v4-8", env=sim_env, cwd=tmp_path),
            "was PREEMPTED", f"tpufab delete --name {name} --yes")
    finally:
        tpufab("delete", "--name", name, "--yes", env=sim_env, cwd=tmp_path)


@pytest.mark.sim
def test_sim_up_prints_the_lines_to_export(sim, user_env, tmp_path):
    # the session's pod is already running in this state dir: `up` finds it and says so
    result = tpufab("sim", "up", "--state-dir", str(sim.state_dir), env=user_env, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    lines = [line.strip() for line in result.stdout.splitlines()]
    assert f"export TPUFAB_API_ENDPOINT={sim.endpoint}" in lines
    assert f"export TPUFAB_PROJECT={sim.project}" in lines
    assert f"export TPUFAB_ZONE={sim.zone}" in lines
    status = invoke("sim.status", "--state-dir", str(sim.state_dir), env=user_env, cwd=OUTSIDE)
    assert status.returncode == 0 and sim.endpoint in status.stdout
    gone = tpufab("sim", "status", "--state-dir", str(tmp_path / "none"), env=user_env,
                  cwd=tmp_path)
    assert gone.returncode == 3 and "not running" in gone.stdout
