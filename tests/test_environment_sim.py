"""The environment built once, on a simulated v4-16 (2 workers), as a user runs it: `tpufab
setup` with `environment:` in tpufab.yaml, requirements pointing at a package index on
loopback (tests/pyindex.py) that counts every file it serves.

The workers have no uv, so tpufab ships this machine's to worker 0 (docs/environment.md);
interpreters cannot be downloaded here, so the environment uses the workers' own python3.
The tests run in order on one pod: each starts from what the one before it left.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from harness import USER, sim_node
from helpers import in_worker, one_sentence, tpufab
from pyindex import PackageIndex

pytestmark = pytest.mark.sim

WORKERS = (0, 1)


@pytest.fixture(scope="module")
def project(sim, tmp_path_factory):
    """A v4-16, a package index and a project folder naming both."""
    root = tmp_path_factory.mktemp("envs-project")
    with PackageIndex(root / "wheels") as index, \
            sim_node(sim, tmp_path_factory, "envs", "v4-16") as node:
        index.add("tfa-alpha", "1.0", requires=["tfa-beta>=1"])
        index.add("tfa-beta", "1.0")
        index.add("tfa-gamma", "1.0")
        folder = root / "proj"
        folder.mkdir()
        (folder / "tpufab.yaml").write_text("environment:\n  requirements: requirements.txt\n")
        yield node, index, folder


def requirements(folder: Path, index: PackageIndex, *lines: str) -> None:
    (folder / "requirements.txt").write_text(f"--index-url {index.url}\n"
                                             + "".join(f"{line}\n" for line in lines))


def wheels_served(index: PackageIndex) -> dict[str, int]:
    return {n.split("-")[0]: c for n, c in index.served().items() if n.endswith(".whl")}


def marker(sim, node, worker: int) -> dict | None:
    text = in_worker(sim, node.node, worker, "cat ~/.venv/.tpufab-env.json 2>/dev/null || :",
                     user=USER)
    return json.loads(text) if text.strip() else None


def imports(sim, node, worker: int, modules: str) -> str:
    return in_worker(sim, node.node, worker, f"~/.venv/bin/python -c 'import sys, {modules}; "
                     "print(sys.prefix)'", user=USER).strip()


def test_a_first_setup_builds_once_and_every_host_gets_that_build(sim, project):
    node, index, folder = project
    requirements(folder, index, "tfa-alpha")
    result = tpufab("setup", env=node.env, cwd=folder)
    assert result.returncode == 0, result.stdout + result.stderr
    assert wheels_served(index) == {"tfa_alpha": 1, "tfa_beta": 1}   # one download per wheel
    markers = [marker(sim, node, w) for w in WORKERS]
    assert markers[0]["hash"] == markers[1]["hash"] and markers[0]["tree"] == markers[1]["tree"]
    short = markers[0]["hash"][:12]
    assert f"Environment {short} at ~/.venv: w0 built; w1 copied from w0." in result.stdout
    for w in WORKERS:
        assert imports(sim, node, w, "tfa_alpha, tfa_beta") == f"/home/{USER}/.venv"


def test_a_second_setup_is_skipped_and_env_status_folds_the_hosts(sim, project):
    node, index, folder = project
    before = index.served()
    result = tpufab("setup", env=node.env, cwd=folder)
    assert result.returncode == 0, result.stderr
    assert "w[0-1] already had it." in result.stdout
    assert index.served() == before
    status = tpufab("env", "status", env=node.env, cwd=folder)
    assert status.returncode == 0, status.stderr
    short = marker(sim, node, 0)["hash"][:12]
    rows = [line for line in status.stdout.splitlines() if line.startswith("w")]
    assert len(rows) == 1 and rows[0].split()[:2] == ["w[0-1]", short], status.stdout
    assert f"Every host has the environment {short} at ~/.venv." in status.stdout

    # a host that lost it: status names it (exit 3), env build gives it the same build again
    in_worker(sim, node.node, 1, "rm -rf ~/.venv", user=USER)
    status = tpufab("env", "status", env=node.env, cwd=folder)
    assert status.returncode == 3 and "w1 lacks the environment" in status.stdout
    built = tpufab("env", "build", env=node.env, cwd=folder)
    assert built.returncode == 0, built.stderr
    assert "w0 already had it; w1 copied from w0." in built.stdout
    assert index.served() == before                       # nothing built, nothing downloaded
    assert marker(sim, node, 1)["tree"] == marker(sim, node, 0)["tree"]


def test_a_changed_requirement_builds_again_downloading_only_what_is_new(sim, project):
    node, index, folder = project
    first = marker(sim, node, 0)["hash"]
    requirements(folder, index, "tfa-alpha", "tfa-gamma")
    result = tpufab("setup", env=node.env, cwd=folder)
    assert result.returncode == 0, result.stderr
    assert "w0 built; w1 copied from w0." in result.stdout
    assert wheels_served(index) == {"tfa_alpha": 1, "tfa_beta": 1, "tfa_gamma": 1}
    hashes = {marker(sim, node, w)["hash"] for w in WORKERS}
    assert len(hashes) == 1 and first not in hashes
    for w in WORKERS:
        imports(sim, node, w, "tfa_gamma")


def test_a_host_that_cannot_take_it_is_retried_then_named_and_the_others_keep_theirs(
        sim, project):
    node, index, folder = project
    requirements(folder, index, "tfa-alpha", "tfa-gamma", "tfa-beta<2")
    in_worker(sim, node.node, 1, "chmod 500 ~/.tpufab/env", user=USER)  # no pull lands
    try:
        result = tpufab("env", "build", env=node.env, cwd=folder)
    finally:
        in_worker(sim, node.node, 1, "chmod 700 ~/.tpufab/env", user=USER)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "did not reach 1 of 2 hosts: w1: " in result.stderr
    assert "(tried 2 times)" in result.stderr and "Traceback" not in result.stderr
    assert marker(sim, node, 0)["hash"] != marker(sim, node, 1)["hash"]
    again = tpufab("env", "build", env=node.env, cwd=folder)
    assert again.returncode == 0, again.stderr
    assert "w0 already had it; w1 copied from w0." in again.stdout
    assert marker(sim, node, 0)["tree"] == marker(sim, node, 1)["tree"]


def test_the_setup_script_and_a_recipe_run_inside_the_environment(sim, project):
    node, _index, folder = project
    (folder / "scripts").mkdir(exist_ok=True)
    (folder / "scripts" / "setup.sh").write_text(
        "#!/bin/sh\necho \"setup python: $(command -v python) VIRTUAL_ENV=$VIRTUAL_ENV\"\n")
    result = tpufab("setup", env=node.env, cwd=folder)
    assert result.returncode == 0, result.stderr
    home = f"/home/{USER}"
    assert f"setup python: {home}/.venv/bin/python VIRTUAL_ENV={home}/.venv" in result.stdout
    assert "already had it." in result.stdout and "Setup setup.sh: w[0-1] ran" in result.stdout
    recipe = folder / "venv.sh"
    recipe.write_text("#!/bin/sh\necho \"recipe VIRTUAL_ENV=$VIRTUAL_ENV python=$(command -v "
                      "python)\"\npython -c 'import tfa_gamma; print(\"gamma\", "
                      "tfa_gamma.VERSION)'\n")
    run = tpufab("run", str(recipe), "--no-deploy", env=node.env, cwd=folder)
    assert run.returncode == 0, run.stdout + run.stderr
    lines = run.stdout.splitlines()
    assert f"recipe VIRTUAL_ENV={home}/.venv python={home}/.venv/bin/python" in lines
    assert "gamma 1.0" in lines                     # folded: every worker printed it


def test_a_requirement_that_does_not_resolve_is_said_once(sim, project):
    node, index, folder = project
    before = marker(sim, node, 1)
    requirements(folder, index, "tfa-alpha>=3")
    result = tpufab("setup", env=node.env, cwd=folder)
    sentence = one_sentence(result, "requirements.txt does not resolve (w0 asked uv)",
                            "tfa-alpha>=3", "fix requirements.txt")
    assert result.returncode == 1
    assert (result.stdout + result.stderr).count("does not resolve") == 1, sentence
    assert marker(sim, node, 1) == before           # the hosts keep what they had
