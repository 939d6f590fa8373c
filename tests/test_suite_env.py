"""The suite does not depend on the caller's environment (issue 37, 16): run from a shell
where another virtualenv is active and the simulated pod's TPUFAB_* lines are exported (as
the README has a user paste them), `./scripts/test.sh` and the fixtures start from a clean
one. Before, 4 tests failed there (`run --local` took that virtualenv's Python, which has no
JAX; the masking test saw the exported settings)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ME = "tests/test_suite_env.py::test_the_suite_starts_from_a_clean_environment"


def test_the_suite_starts_from_a_clean_environment():
    from tpufab.steps.start.localrun import recipe_command

    leftover = sorted(n for n in os.environ if n.startswith("TPUFAB_")
                      and not n.startswith("TPUFAB_TEST_") and n != "TPUFAB_KEEP_ALIVE")
    assert leftover == [], leftover
    assert "VIRTUAL_ENV" not in os.environ
    assert os.environ["PATH"].split(os.pathsep)[0] == os.path.dirname(sys.executable)
    # `run --local` runs a Python recipe with the suite's own Python (it has JAX)
    assert recipe_command(Path("x.py"), [])[0] == sys.executable


def polluted(tmp_path: Path) -> dict[str, str]:
    """A shell with another virtualenv active (its python3 first on PATH, no JAX: it fails)
    and a simulated pod's settings exported."""
    venv = tmp_path / "other-venv"
    (venv / "bin").mkdir(parents=True)
    for name in ("python", "python3"):
        fake = venv / "bin" / name
        fake.write_text("#!/bin/sh\necho 'ModuleNotFoundError: No module named jax' >&2\nexit 1\n")
        fake.chmod(0o755)
    return {**os.environ, "VIRTUAL_ENV": str(venv), "PATH": f"{venv}/bin:{os.environ['PATH']}",
            "TPUFAB_API_ENDPOINT": "http://127.0.0.1:9", "TPUFAB_PROJECT": "someone-else",
            "TPUFAB_NAME": "their-pod", "TPUFAB_SECRETS": "PLAIN,MODEL",
            "TPUFAB_KEEP_ALIVE": "5m", "TPUFAB_TEST_SSH_USER": "kept"}


def test_the_fixtures_clean_a_callers_virtualenv_and_exported_settings(tmp_path):
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", ME],
                          env=polluted(tmp_path), cwd=REPO, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr


def test_test_sh_cleans_them_before_anything_runs(tmp_path):
    """scripts/test.sh with arguments (one pytest process): bootstrap, ruff and pytest all
    start from the clean environment."""
    done = subprocess.run(["bash", "scripts/test.sh", "-p", "no:cacheprovider", ME],
                          env=polluted(tmp_path), cwd=REPO, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "1 passed" in done.stdout, done.stdout
