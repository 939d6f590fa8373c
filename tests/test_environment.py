"""The environment built once (tpufab.steps.host.environment, docs/environment.md), its pure
parts: the ``environment:`` setting (one sentence per bad value), the spec files read, the
hash, VIRTUAL_ENV in the job environment; and the worker script, env_worker.py as shipped,
run here in a home of its own against a package index on loopback (no root, no pod)."""

from __future__ import annotations

import json
import os
import subprocess
import tarfile
from pathlib import Path

import pytest
from helpers import WORKER_PYTHON, shipped
from pyindex import PackageIndex

from tpufab.config import load_settings
from tpufab.errors import ConfigError
from tpufab.steps.host.environment import EnvSpec, env_spec, environment_hash
from tpufab.steps.runs.env import JobLayout, job_environment, virtual_env


def _settings(tmp_path: Path, yaml: str):
    (tmp_path / "tpufab.yaml").write_text(yaml)
    return load_settings(cwd=tmp_path, env={"TPUFAB_USER_CONFIG": str(tmp_path / "none")})


@pytest.mark.parametrize("yaml, fragment", [
    ("environment: {requirement: r.txt}", "environment has no key 'requirement' (did you "
                                          "mean 'requirements'?)"),
    ("environment: {python: '3.12'}", "exactly one of requirements: FILE"),
    ("environment: {requirements: r.txt, lock: uv.lock}", "not requirements and lock"),
    ("environment: {lock: poetry.lock}", "must be a uv.lock"),
    ("environment: {requirements: r.txt, python: 3.10}", "not '3.1'"),   # YAML's 3.10
    ("environment: {requirements: r.txt, python: 'py; rm -rf ~'}", "must be a version"),
    ("environment: {requirements: r.txt, path: venv}", "under ~/ or an absolute path"),
    ("environment: {requirements: r.txt, path: '~/../etc'}", "under ~/ or an absolute path"),
    ("environment: {requirements: r.txt, path: '~'}", "a folder of its own"),
])
def test_a_bad_environment_setting_is_one_sentence_naming_the_file(tmp_path, yaml, fragment):
    with pytest.raises(ConfigError) as err:
        _settings(tmp_path, yaml)
    text = str(err.value)
    assert fragment in text and text.startswith(str(tmp_path / "tpufab.yaml")), text
    assert text.endswith(".") and "\n" not in text


def test_a_good_setting_reads_its_files_beside_the_project_file(tmp_path, monkeypatch):
    (tmp_path / "requirements.txt").write_text("tfa-alpha\n")
    settings = _settings(tmp_path, "environment: {requirements: requirements.txt, "
                                   "python: '3.12'}\n")
    (tmp_path / "sub").mkdir()
    monkeypatch.chdir(tmp_path / "sub")          # a verb run from a folder below
    spec = env_spec(settings)
    assert spec == EnvSpec("requirements", "requirements.txt",
                           {"requirements.txt": b"tfa-alpha\n"}, "3.12", "~/.venv")
    assert virtual_env(settings) == "~/.venv"
    assert virtual_env(load_settings(cwd=tmp_path / "sub", env={})) == "~/.venv"


def test_a_lock_takes_its_pyproject_and_a_missing_file_is_one_sentence(tmp_path):
    (tmp_path / "uv.lock").write_text("version = 1\n")
    settings = _settings(tmp_path, "environment: {lock: uv.lock, path: /opt/env}\n")
    with pytest.raises(ConfigError, match=r"the pyproject.toml beside the lock .* does not "
                                          r"exist; fix `environment: lock:`"):
        env_spec(settings, cwd=tmp_path)
    (tmp_path / "pyproject.toml").write_text("[project]\nname = 'x'\n")
    spec = env_spec(settings, cwd=tmp_path)
    assert spec.kind == "lock" and sorted(spec.files) == ["pyproject.toml", "uv.lock"]
    assert spec.path == "/opt/env"
    settings = _settings(tmp_path, "environment: {requirements: gone.txt}\n")
    with pytest.raises(ConfigError, match="environment's requirements file .*gone.txt does "
                                          "not exist"):
        env_spec(settings)


def test_no_environment_configured_is_none():
    settings = load_settings(cwd=Path("/"), env={})
    assert env_spec(settings) is None and virtual_env(settings) is None


def test_the_hash_changes_with_each_thing_that_makes_the_environment():
    spec = EnvSpec("requirements", "r.txt", {"r.txt": b"a\n"})
    base = environment_hash(spec, arch="x86_64", python="3.11.2")
    assert base == environment_hash(EnvSpec("requirements", "r.txt", {"r.txt": b"a\n"}),
                                    arch="x86_64", python="3.11.2")
    others = [
        environment_hash(EnvSpec("requirements", "r.txt", {"r.txt": b"a\nb\n"}),
                         arch="x86_64", python="3.11.2"),
        environment_hash(spec, arch="aarch64", python="3.11.2"),
        environment_hash(spec, arch="x86_64", python="3.12"),
        environment_hash(EnvSpec("requirements", "r.txt", {"r.txt": b"a\n"}, path="/opt/v"),
                         arch="x86_64", python="3.11.2"),
    ]
    assert len({base, *others}) == 5 and len(base) == 64


def test_a_job_gets_virtual_env_and_a_forwarded_one_wins():
    from tpufab.steps.runs.env import Forwarded

    layout = JobLayout.single(["10.0.0.1", "10.0.0.2"])
    assert "VIRTUAL_ENV" not in job_environment("20261202-000000-abcd", layout, 1).public
    env = job_environment("20261202-000000-abcd", layout, 1, virtual_env="~/.venv").public
    assert env["VIRTUAL_ENV"] == "~/.venv"
    mine = job_environment("20261202-000000-abcd", layout, 0, virtual_env="~/.venv",
                           forwarded=Forwarded({"VIRTUAL_ENV": "/opt/mine"})).public
    assert mine["VIRTUAL_ENV"] == "/opt/mine"


# -- env_worker.py, as shipped, in a home of its own ----------------------------------------


def _uv() -> str:
    import shutil
    import sys

    found = Path(sys.executable).parent / "uv"
    return str(found) if found.is_file() else shutil.which("uv")


def _op(home: Path, op: str, request: dict) -> dict:
    env = {"HOME": str(home), "PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}
    out = subprocess.run([WORKER_PYTHON, "-I", "-S", str(shipped("env_worker.py")), op],
                         input=json.dumps(request), capture_output=True, text=True, env=env,
                         cwd=home, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.rsplit("@tpufab-answer answer ", 1)[1])


@pytest.mark.skipif(not _uv(), reason="needs uv (the dev extra)")
def test_the_worker_builds_once_packs_and_installs_a_verified_tree(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    with PackageIndex(tmp_path / "wheels") as index:
        index.add("tfa-alpha", "1.0", requires=["tfa-beta>=1"])
        index.add("tfa-beta", "1.0")
        index.add("tfa-beta", "2.0")
        requirements = f"--index-url {index.url}\ntfa-alpha\n"
        facts = _op(home, "probe", {"path": "~/.venv"})
        assert facts["marker"] is None and facts["uv"] is None and facts["python"]
        build = _op(home, "build", {"hash": "h1", "path": "~/.venv", "python": None,
                                    "kind": "requirements", "spec": "requirements.txt",
                                    "uv": _uv(), "files": {"requirements.txt": requirements}})
        assert build["error"] is None, build
        assert "tfa-beta==2.0" in build["resolved"]          # resolved once, the newest
        served = index.served()
        assert {n: c for n, c in served.items() if n.endswith(".whl")} == {
            "tfa_alpha-1.0-py3-none-any.whl": 1, "tfa_beta-2.0-py3-none-any.whl": 1}
    archive = home / build["archive"]
    assert archive.is_file() and not (home / ".venv").exists()
    request = {"hash": "h1", "path": "~/.venv", "archive": build["archive"],
               "sha256": build["sha256"], "tree": build["tree"], "keep": True,
               "build": {k: build[k] for k in ("archive", "sha256", "size", "tree")}}
    assert _op(home, "install", request) == {"error": None, "tree": build["tree"]}
    python = home / ".venv" / "bin" / "python"
    got = subprocess.run([python, "-c", "import sys, tfa_alpha, tfa_beta; "
                          "print(tfa_beta.VERSION, sys.prefix)"], capture_output=True, text=True)
    assert got.stdout.split() == ["2.0", str(home / ".venv")], got.stderr
    again = _op(home, "probe", {"path": "~/.venv"})
    assert again["marker"]["hash"] == "h1" and again["archive_present"]

    # an archive that is not the build's is refused, and the tree in place stays
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(tmp_path / "wheels", arcname="bin")
    refused = _op(home, "install", request)
    assert refused["retry"] and "sha256 differs" in refused["error"]
    assert python.exists()


@pytest.mark.skipif(not _uv(), reason="needs uv (the dev extra)")
def test_a_requirement_that_does_not_resolve_answers_the_resolvers_reason(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    with PackageIndex(tmp_path / "wheels") as index:
        index.add("tfa-alpha", "1.0")
        build = _op(home, "build", {"hash": "h2", "path": "~/.venv", "python": None,
                                    "kind": "requirements", "spec": "requirements.txt",
                                    "uv": _uv(), "files": {
                                        "requirements.txt": f"--index-url {index.url}\n"
                                                            "tfa-alpha>=3\n"}})
    assert build["stage"] == "resolve"
    assert "tfa-alpha>=3" in build["error"] and "unsatisfiable" in build["error"]
    assert not (home / ".tpufab" / "env" / "build-h2").exists()
    assert os.listdir(home / ".tpufab" / "env") == []


@pytest.mark.skipif(not _uv(), reason="needs uv (the dev extra)")
def test_a_lock_installs_as_locked_and_one_out_of_date_is_uvs_reason(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    project = tmp_path / "proj"
    project.mkdir()
    with PackageIndex(tmp_path / "wheels") as index:
        index.add("tfa-alpha", "1.0", requires=["tfa-beta>=1"])
        index.add("tfa-beta", "1.0")
        pyproject = ('[project]\nname = "proj"\nversion = "0.1"\nrequires-python = ">=3.8"\n'
                     'dependencies = ["tfa-alpha"]\n\n[[tool.uv.index]]\n'
                     f'url = "{index.url}"\ndefault = true\n')
        (project / "pyproject.toml").write_text(pyproject)
        locked = subprocess.run([_uv(), "lock", "--python", WORKER_PYTHON], cwd=project,
                                capture_output=True, text=True, timeout=120,
                                env={**os.environ, "UV_CACHE_DIR": str(tmp_path / "cache")})
        assert locked.returncode == 0, locked.stderr
        files = {"uv.lock": (project / "uv.lock").read_text(), "pyproject.toml": pyproject}
        request = {"hash": "l1", "path": "~/.venv", "python": None, "kind": "lock",
                   "spec": "uv.lock", "uv": _uv(), "files": files}
        build = _op(home, "build", request)
        assert build["error"] is None, build
        assert _op(home, "install", {"hash": "l1", "path": "~/.venv", "archive": build["archive"],
                                     "sha256": build["sha256"], "tree": build["tree"],
                                     "keep": False})["error"] is None
        got = subprocess.run([home / ".venv" / "bin" / "python", "-c", "import tfa_alpha, "
                              "tfa_beta"], capture_output=True, text=True)
        assert got.returncode == 0, got.stderr
        stale = dict(files, **{"pyproject.toml": pyproject.replace('["tfa-alpha"]',
                                                                  '["tfa-alpha", "tfa-beta"]')})
        late = _op(home, "build", dict(request, hash="l2", files=stale))
    assert late["stage"] == "resolve" and "needs to be updated" in late["error"]
