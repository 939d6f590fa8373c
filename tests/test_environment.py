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
    ("environment: {requirements: r.txt, bucket: my-bucket}", "bucket must be gs://BUCKET or "
                                                              "gs://BUCKET/PREFIX"),
    ("environment: {requirements: r.txt, bucket: 'gs://b/../x'}", "not 'gs://b/../x'"),
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


def test_a_bucket_is_where_the_archive_goes_and_not_part_of_the_hash(tmp_path):
    (tmp_path / "requirements.txt").write_text("tfa-alpha\n")
    plain = env_spec(_settings(tmp_path, "environment: {requirements: requirements.txt}\n"))
    spec = env_spec(_settings(tmp_path, "environment: {requirements: requirements.txt, "
                                        "bucket: 'gs://my-bucket/envs'}\n"))
    assert spec.bucket == "gs://my-bucket/envs" and plain.bucket is None
    assert environment_hash(spec, arch="x86_64", python="3.11.2") == \
        environment_hash(plain, arch="x86_64", python="3.11.2")


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


def _op(home: Path, op: str, request: dict, **more: str) -> dict:
    env = {"HOME": str(home), "PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", **more}
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


# -- a requirements file's includes ---------------------------------------------------------


@pytest.mark.parametrize("text, found", [
    ("-r more.txt\n", [("-r", "more.txt")]),
    ("--requirement=sub/more.txt  # shared pins\n", [("-r", "sub/more.txt")]),
    ("  --requirement  'with space.txt'\n", [("-r", "with space.txt")]),
    ("-rmore.txt\n-c ../constraints.txt\n", [("-r", "more.txt"), ("-c", "../constraints.txt")]),
    ("--constraint c.txt\t# why\n", [("-c", "c.txt")]),
    ("# -r commented.txt\ntfa-alpha  # -r not.txt\n--index-url http://x/simple/\n", []),
    ("--requirements-are-not-an-option x\n-e ./local\n", []),
    ("-r \\\n  continued.txt\n", [("-r", "continued.txt")]),
])
def test_the_includes_of_a_requirements_file_are_read_as_pip_reads_them(text, found):
    from tpufab.steps.host.environment import requirement_includes

    assert requirement_includes(text) == found


def _project(tmp_path: Path, files: dict[str, str], main: str = "env/requirements.txt"):
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    return _settings(tmp_path, f"environment: {{requirements: {main}}}\n")


def test_the_included_files_ship_by_their_path_in_the_project_and_are_hashed(tmp_path):
    settings = _project(tmp_path, {
        "env/requirements.txt": "-r more.txt\n--constraint=../constraints.txt\ntfa-alpha\n",
        "env/more.txt": "-c ../constraints.txt\ntfa-gamma\n",   # included twice: shipped once
        "constraints.txt": "tfa-beta<2\n"})
    spec = env_spec(settings)
    assert spec.spec == "env/requirements.txt"
    assert spec.files == {"env/requirements.txt": (tmp_path / "env/requirements.txt")
                          .read_bytes(), "env/more.txt": b"-c ../constraints.txt\ntfa-gamma\n",
                          "constraints.txt": b"tfa-beta<2\n"}
    first = environment_hash(spec, arch="x86_64", python="3.11.2")
    (tmp_path / "constraints.txt").write_text("tfa-beta<3\n")    # an included file changed
    assert environment_hash(env_spec(settings), arch="x86_64", python="3.11.2") != first


@pytest.mark.parametrize("files, fragment", [
    ({"env/requirements.txt": "-r ../../outside.txt\n"},
     "The environment's env/requirements.txt includes ../../outside.txt (-r), which is "
     "outside the project ({root}): tpufab ships only the files under it; copy it into the "
     "project and include that instead."),
    ({"env/requirements.txt": "-c /etc/constraints.txt\n"},
     "includes /etc/constraints.txt (-c), which is outside the project"),
    ({"env/requirements.txt": "-r more.txt\n", "env/more.txt": "-r https://x.invalid/r.txt\n"},
     "The environment's env/more.txt includes https://x.invalid/r.txt (-r), a URL: tpufab "
     "ships only the project's files"),
    ({"env/requirements.txt": "-r gone.txt\n"},
     "The environment's env/requirements.txt includes gone.txt (-r), which does not exist at "
     "{root}/env/gone.txt; add it or fix that line."),
])
def test_an_include_outside_the_project_or_not_there_is_one_sentence(tmp_path, files, fragment):
    settings = _project(tmp_path, files)
    with pytest.raises(ConfigError) as err:
        env_spec(settings)
    text = str(err.value)
    assert fragment.format(root=tmp_path) in text and "\n" not in text, text
    assert text.endswith(".")


@pytest.mark.skipif(not _uv(), reason="needs uv (the dev extra)")
def test_the_worker_builds_a_requirements_file_with_its_includes_beside_it(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    with PackageIndex(tmp_path / "wheels") as index:
        index.add("tfa-alpha", "1.0", requires=["tfa-beta>=1"])
        index.add("tfa-beta", "1.0")
        index.add("tfa-beta", "2.0")
        index.add("tfa-gamma", "1.0")
        settings = _project(tmp_path / "proj", {
            "env/requirements.txt": f"--index-url {index.url}\n-r more.txt\ntfa-alpha\n",
            "env/more.txt": "-c ../constraints.txt\ntfa-gamma\n",
            "constraints.txt": "tfa-beta<2\n"})
        spec = env_spec(settings)
        build = _op(home, "build", {"hash": "i1", "path": "~/.venv", "python": None,
                                    "kind": "requirements", "spec": spec.spec, "uv": _uv(),
                                    "files": {n: d.decode() for n, d in spec.files.items()}})
    assert build["error"] is None, build
    assert "tfa-beta==1.0" in build["resolved"] and "tfa-gamma==1.0" in build["resolved"]
    # a name that would leave the build's folder is refused
    bad = _op(home, "build", {"hash": "i2", "path": "~/.venv", "python": None,
                              "kind": "requirements", "spec": "r.txt", "uv": _uv(),
                              "files": {"../r.txt": "x\n"}})
    assert bad["stage"] == "build" and "not a path inside the project" in bad["error"]


# -- check, babysit and launch ---------------------------------------------------------------


def test_check_names_a_host_whose_environment_differs_or_is_missing_with_its_fix():
    from tpufab.steps.health.check import check_environment
    from tpufab.steps.host.environment import EnvStatusReport, EnvStatusRow

    good, old = "a" * 64, "b" * 64
    same = EnvStatusReport(rows=[EnvStatusRow(w, hash=good) for w in range(4)], expected=good)
    result = check_environment(same)
    assert result.ok and result.detail == f"{good[:12]} at ~/.venv on w[0-3]"
    mixed = EnvStatusReport(rows=[EnvStatusRow(0, hash=good), EnvStatusRow(1, hash=""),
                                  EnvStatusRow(2, hash=old), EnvStatusRow(3, hash="")],
                            expected=good)
    lines = [p.line() for p in check_environment(mixed).problems]
    assert lines == [
        f"w[1,3]: no environment at ~/.venv ({good[:12]} is on w0); build it there with "
        "`tpufab env build`.",
        f"w2: environment {old[:12]} at ~/.venv, not the configured one ({good[:12]} is on "
        "w0); build it there with `tpufab env build`."]
    nobody = EnvStatusReport(rows=[EnvStatusRow(0, hash=old), EnvStatusRow(1, hash=old)],
                             expected=good)
    [problem] = check_environment(nobody).problems
    assert problem.workers == (0, 1) and f"({good[:12]} is on no host)" in problem.text


def test_babysit_and_launch_carry_the_environment_read_at_the_start(tmp_path):
    from tpufab.flows import launch as launching
    from tpufab.flows.babysit.recover import Restore
    from tpufab.flows.taskfile import parse_task

    settings = _project(tmp_path, {"requirements.txt": "tfa-alpha\n"}, "requirements.txt")
    spec = env_spec(settings)
    assert Restore(environment=spec).describe() == \
        "the environment at ~/.venv (requirements.txt)"
    task = parse_task({"type": "v4-8", "setup": "echo hi", "run": "python x.py"}, "t.yaml")
    planned = launching.plan(task, settings=settings, name="n", cwd=tmp_path)
    assert planned.environment == spec and planned.restore().environment == spec
    assert ("environment at ~/.venv from requirements.txt: built once on w0 and copied to "
            "every other host, skipped where its hash is (as `tpufab setup`)") in planned.steps
    assert planned.steps.index(next(s for s in planned.steps if s.startswith("environment"))) \
        < planned.steps.index(next(s for s in planned.steps if s.startswith("setup")))
    (tmp_path / "requirements.txt").unlink()      # refused before anything is touched
    with pytest.raises(ConfigError, match="requirements file .* does not exist"):
        launching.plan(task, settings=settings, name="n", cwd=tmp_path)


def test_the_archive_goes_through_a_bucket_with_the_vms_own_token(tmp_path):
    """upload and fetch against the simulated pod's Cloud Storage, the token from a metadata
    server stand-in (GCE_METADATA_HOST, as google-auth reads it): every call carries it."""
    import hashlib
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from tpufab.sim.admin import StorageClient
    from tpufab.sim.storage import StorageEmulator

    asked = []

    class Metadata(BaseHTTPRequestHandler):
        def do_GET(self):
            asked.append((self.path, self.headers.get("Metadata-Flavor")))
            body = json.dumps({"access_token": "vm-token", "expires_in": 3600,
                               "token_type": "Bearer"}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    builder, other, third = tmp_path / "w0", tmp_path / "w1", tmp_path / "w2"
    for home in (builder, other, third):
        (home / ".tpufab" / "env").mkdir(parents=True)
    data = os.urandom(3 << 20)                 # more than one block of the fetch
    (builder / ".tpufab/env/h.tar.gz").write_bytes(data)
    metadata = ThreadingHTTPServer(("127.0.0.1", 0), Metadata)
    threading.Thread(target=metadata.serve_forever, daemon=True).start()
    host = f"127.0.0.1:{metadata.server_address[1]}"
    try:
        with StorageEmulator(data_dir=None) as gcs:
            StorageClient(gcs.url).create_bucket("envs-b")
            where = {"endpoint": gcs.url, "bucket": "envs-b", "object": "p/h.tar.gz",
                     "archive": ".tpufab/env/h.tar.gz",
                     "sha256": hashlib.sha256(data).hexdigest()}
            assert _op(builder, "upload", where, GCE_METADATA_HOST=host) == {
                "error": None, "bytes": len(data)}
            assert StorageClient(gcs.url).objects("envs-b") == {"p/h.tar.gz": data}
            assert _op(other, "fetch", where, GCE_METADATA_HOST=host)["error"] is None
            assert (other / ".tpufab/env/h.tar.gz").read_bytes() == data
            wrong = _op(third, "fetch", dict(where, sha256="0" * 64),
                        GCE_METADATA_HOST=host)
            assert "is not the build's (sha256 differs)" in wrong["error"]
            missing = _op(builder, "upload", dict(where, bucket="no-such-b"),
                          GCE_METADATA_HOST=host)
            assert missing["error"] == "Cloud Storage answered 404: no such bucket or object"
    finally:
        metadata.shutdown()
    assert len(asked) == 4 and set(asked) == {
        ("/computeMetadata/v1/instance/service-accounts/default/token", "Google")}
    assert os.listdir(third / ".tpufab" / "env") == []        # no part file left behind
