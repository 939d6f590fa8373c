"""Which pod a verb means: flags, TPUFAB_NAME, tpufab.yaml, invoke's config, the current pod."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tpufab import current
from tpufab.cloud.names import default_name
from tpufab.config import invoke_layer, load_settings

BIN = Path(sys.executable).parent


@pytest.fixture
def project(tmp_path):
    (tmp_path / ".git").mkdir()
    (tmp_path / "sub").mkdir()
    return tmp_path


def env_for(tmp_path):
    return {"TPUFAB_USER_CONFIG": str(tmp_path / "none.yaml")}


def test_the_current_pod_names_the_node_below_every_other_source(project):
    path = current.remember("cur-pod", zone="europe-west4-a", project="p1", set_by="use",
                            cwd=project / "sub")
    assert path == project / ".tpufab" / "current-pod.json"
    settings = load_settings(cwd=project / "sub", env=env_for(project))
    assert (settings.name, settings.zone, settings.project) == ("cur-pod", "europe-west4-a", "p1")
    assert settings.source_of("name").startswith("current pod")
    (project / "tpufab.yaml").write_text("name: pinned\n")
    assert load_settings(cwd=project, env=env_for(project)).name == "pinned"
    assert load_settings(cwd=project, env={**env_for(project), "TPUFAB_NAME": "envname"}).name \
        == "envname"
    flagged = load_settings({"name": "flag"}, cwd=project,
                            env={**env_for(project), "TPUFAB_NAME": "envname"})
    assert (flagged.name, flagged.source_of("name")) == ("flag", "command line")


def test_invoke_config_sits_between_the_project_file_and_the_environment(project):
    (project / "tpufab.yaml").write_text("zone: from-file\nspot: false\n")
    with invoke_layer({"zone": "from-invoke", "spot": True}):
        settings = load_settings(cwd=project, env=env_for(project))
        assert (settings.zone, settings.spot) == ("from-invoke", True)
        env = {**env_for(project), "TPUFAB_ZONE": "from-env"}
        assert load_settings(cwd=project, env=env).zone == "from-env"
    assert load_settings(cwd=project, env=env_for(project)).zone == "from-file"


def test_forgetting_only_forgets_that_pod(project):
    current.remember("a-pod", zone=None, project=None, set_by="create", cwd=project)
    assert not current.forget("other", cwd=project)
    assert current.read(project).name == "a-pod"
    assert current.forget("a-pod", cwd=project)
    assert current.read(project) is None


def test_an_unreadable_current_pod_file_is_as_if_none(project):
    (project / ".tpufab").mkdir()
    (project / ".tpufab" / "current-pod.json").write_text("{not json")
    assert current.read(project) is None
    assert load_settings(cwd=project, env=env_for(project)).name is None


@pytest.mark.parametrize("user, kind, name", [
    ("alice", "v4-512", "alice-v4-512"), ("Bob.Smith", "v6e-8", "bob-smith-v6e-8"),
    ("root", "v5p-128", "root-v5p-128"), ("4ever", "v4-8", "tpu-v4-8"),
    ("_", "v4-8", "tpu-v4-8"), ("x" * 60, "v4-8", "tpu-v4-8"),
])
def test_a_created_node_without_a_name_is_named_for_its_user_and_type(user, kind, name):
    assert default_name(user, kind) == name


def test_use_without_a_name_says_there_is_none_and_how_to_get_one(project):
    out = subprocess.run([str(BIN / "tpufab"), "use"], cwd=project, env=env_for(project) | {
        "PATH": str(BIN)}, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0
    assert "no current pod" in out.stdout and "tpufab create --type TYPE" in out.stdout


def test_invoke_reads_a_tpufab_section_from_its_own_config_file(project, tmp_path):
    (project / "tasks.py").write_text("from tpufab.tasks import ns  # noqa: F401\n")
    conf = tmp_path / "extra.yaml"
    conf.write_text(json.dumps({"tpufab": {"api_endpoint": "http://127.0.0.1:9",
                                           "project": "p"}}))
    out = subprocess.run([str(BIN / "invoke"), "-f", str(conf), "list"], cwd=project,
                         env=env_for(project) | {"PATH": str(BIN), "HOME": str(tmp_path)},
                         capture_output=True, text=True, timeout=60)
    assert out.returncode != 0
    assert "Cannot reach the TPU API at http://127.0.0.1:9" in out.stderr, out.stderr


def test_an_empty_name_says_it_is_empty_not_that_there_is_no_current_pod(project):
    """(issue 23) `--name ''` said "this project has no current pod" when there was one."""
    current.remember("cur-pod", zone="us-central2-b", project="sim-project", set_by="use",
                     cwd=project)
    import os

    here = {k: v for k, v in os.environ.items() if k == "PYTHONPATH"}   # this checkout's
    out = subprocess.run([str(BIN / "tpufab"), "describe", "--name", ""], cwd=project,
                         env=env_for(project) | {"PATH": str(BIN)} | here, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode != 0
    assert "The node name is empty (--name ''" in out.stderr and "current pod" in out.stderr
    assert "no current pod" not in out.stderr and "Traceback" not in out.stderr
