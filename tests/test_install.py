"""Install like a tool (issue 26): `uv tool install` of the built wheel, as a user who is not
root, on nothing but the system's Python, and the commands a new user runs first work there.

The sdist is built from the checkout's tracked files and the wheel from the sdist (what a
release would publish), then installed by `uv tool install` for the `nobody` user into a
fresh home, with no dev extras, no venv of ours and no access to this checkout.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.sim   # root: the install runs as another user (setpriv)
REPO = Path(__file__).resolve().parents[1]
NOBODY = 65534
SYSTEM_PYTHON = "/usr/bin/python3"
TASK = """name: hello
resources:
  accelerators: tpu-v6e-8
setup: pip install -U "jax[tpu]"
run: python3 -c "import jax; print(jax.device_count())"
"""


def as_nobody(argv: list[str], home: Path, cwd: Path, timeout: float = 300, **env: str):
    base = {"PATH": f"{home}/.local/bin:/usr/bin:/bin", "HOME": str(home), "LANG": "C.UTF-8"}
    return subprocess.run(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}",
                           "--clear-groups", "env", "-i", *(f"{k}={v}" for k, v in
                                                            {**base, **env}.items()), *argv],
                          cwd=cwd, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def installed():
    uv = shutil.which("uv", path=str(Path(sys.executable).parent)) or shutil.which("uv")
    if not Path(SYSTEM_PYTHON).exists() or not uv:
        pytest.fail("needs /usr/bin/python3 and uv (scripts/bootstrap.sh installs uv)")
    root = Path(tempfile.mkdtemp(prefix="tpufab-install-"))
    try:
        source = root / "source"
        tracked = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True,
                                 check=True).stdout.decode().split("\0")
        for name in filter(None, tracked):
            if (REPO / name).is_file():
                (source / name).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(REPO / name, source / name)
        certs = {"SSL_CERT_FILE": "/etc/ssl/certs/ca-certificates.crt", "UV_NATIVE_TLS": "1",
                 "UV_PYTHON_DOWNLOADS": "never"}
        built = subprocess.run([uv, "build", "--out-dir", str(root / "dist"), str(source)],
                               capture_output=True, text=True, timeout=300,
                               env={**os.environ, **certs, "UV_CACHE_DIR": str(root / "cache")})
        assert built.returncode == 0, built.stderr[-3000:]
        wheel = next((root / "dist").glob("tpufab-*.whl"))
        home = root / "home"
        (home / "project").mkdir(parents=True)
        uv_copy = root / "uv"           # nobody cannot read root's venv: a copy of the binary
        shutil.copy2(uv, uv_copy)
        for path in (root, root / "dist", wheel, uv_copy):
            path.chmod(0o755 if path.is_dir() or path == uv_copy else 0o644)
        subprocess.run(["chown", "-R", f"{NOBODY}:{NOBODY}", str(home)], check=True)
        done = as_nobody([str(uv_copy), "tool", "install", "--python", SYSTEM_PYTHON, str(wheel)],
                         home, home, **certs)
        assert done.returncode == 0, done.stdout + done.stderr[-3000:]
        yield home
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_the_wheel_installs_as_a_tool_for_a_user_who_is_not_root(installed):
    tool = installed / ".local" / "bin" / "tpufab"
    assert tool.exists() and tool.stat().st_uid == NOBODY
    version = as_nobody(["tpufab", "--version"], installed, installed)
    assert version.returncode == 0 and version.stdout.startswith("tpufab "), version.stderr
    # its own interpreter, not ours: the tool's venv under the user's home
    where = as_nobody(["tpufab", "version", "--json"], installed, installed)
    assert where.returncode == 0, where.stderr
    assert str(REPO) not in where.stdout


def test_the_first_commands_work_from_the_installed_tool(installed):
    project = installed / "project"
    topology = as_nobody(["tpufab", "topology", "v4-32"], installed, project)
    assert topology.returncode == 0 and "jax.process_count(): 4" in topology.stdout, \
        topology.stdout + topology.stderr
    init = as_nobody(["tpufab", "init"], installed, project)
    assert init.returncode == 0, init.stderr
    assert {"tasks.py", "tpufab.yaml"} <= {p.name for p in project.iterdir()}
    assert (project / "recipes" / "hello.sh").exists()
    (project / "task.yaml").write_text(TASK)
    (project / "task.yaml").chmod(0o644)
    plan = as_nobody(["tpufab", "launch", "--dry-run", "task.yaml"], installed, project)
    assert plan.returncode == 0, plan.stdout + plan.stderr
    assert "v6e-8" in plan.stdout and "Dry run: nothing was created" in plan.stdout
    assert "(project not set: pass --project or set TPUFAB_PROJECT)" in plan.stdout  # not "None"
    assert "Traceback" not in plan.stdout + plan.stderr
