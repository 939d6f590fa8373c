"""tpufab runs on Python 3.10-3.13: bootstrap's version rule, pyproject and ruff agree, and
nothing in the code needs a newer Python than the oldest supported (issue 11, finding 13)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BOOTSTRAP = REPO / "scripts" / "bootstrap.sh"
# A stand-in interpreter: answers bootstrap's `python -c CHECK` as Python 3.MINOR would.
FAKE = ("#!/bin/sh\nexec {python} -c 'import sys; sys.version_info = (3, {minor}, 0); "
        "exec(sys.argv.pop(1))' \"$2\"\n")


def version_rule() -> tuple[int, int]:
    text = BOOTSTRAP.read_text()
    return (int(re.search(r"^PY_MIN=(\d+)$", text, re.M).group(1)),
            int(re.search(r"^PY_MAX=(\d+)$", text, re.M).group(1)))


def test_bootstrap_pyproject_and_ruff_agree_on_3_10_to_3_13():
    low, high = version_rule()
    assert (low, high) == (10, 13)
    pyproject = (REPO / "pyproject.toml").read_text()
    assert re.search(rf'^requires-python = ">=3\.{low}"', pyproject, re.M)
    assert re.search(rf'^target-version = "py3{low}"', pyproject, re.M)


def which_python(tmp_path: Path, pythons: dict[str, int], env_python: str | None = None):
    """Run bootstrap's version rule with only ``pythons`` ({name: minor}) on PATH."""
    root = tmp_path / "repo"
    (root / "scripts").mkdir(parents=True)
    shutil.copy(BOOTSTRAP, root / "scripts" / "bootstrap.sh")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "dirname").symlink_to(shutil.which("dirname"))
    for name, minor in pythons.items():
        fake = bin_dir / name
        fake.write_text(FAKE.format(python=sys.executable, minor=minor))
        fake.chmod(0o755)
    env = {"PATH": str(bin_dir)}
    if env_python:
        env["PYTHON"] = str(bin_dir / env_python)
    return subprocess.run(["/bin/bash", str(root / "scripts" / "bootstrap.sh"),
                           "--which-python"], env=env, capture_output=True, text=True,
                          timeout=60)


@pytest.mark.parametrize("minor", [10, 11, 12, 13])
def test_bootstrap_takes_python3_from_3_10_to_3_13(tmp_path, minor):
    result = which_python(tmp_path, {"python3": minor})
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(tmp_path / "bin" / "python3")


def test_bootstrap_looks_past_an_unsupported_python3(tmp_path):
    result = which_python(tmp_path, {"python3": 9, "python3.14": 14, "python3.12": 12})
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(tmp_path / "bin" / "python3.12")


def test_bootstrap_without_a_supported_python_says_which_it_needs(tmp_path):
    result = which_python(tmp_path, {"python3": 9, "python3.14": 14})
    assert result.returncode == 1
    assert result.stderr.strip() == ("tpufab needs Python 3.10 to 3.13: install one (apt-get "
                                     "install python3) or set PYTHON=/path/to/python3.X")


def test_bootstrap_refuses_an_unsupported_PYTHON(tmp_path):
    result = which_python(tmp_path, {"python3": 12, "python3.14": 14}, env_python="python3.14")
    assert result.returncode == 1
    assert "is not Python 3.10 to 3.13" in result.stderr


def test_no_code_needs_more_than_the_oldest_supported_python():
    vermin = shutil.which("vermin", path=str(Path(sys.executable).parent))
    if vermin is None:
        pytest.skip("vermin is not installed (pip install -e '.[dev]')")
    low, _ = version_rule()
    result = subprocess.run([vermin, "--no-tips", "--violations", "--eval-annotations", "-q",
                             f"--target=3.{low}-", "tpufab", "tests", "tasks.py", "bench"],
                            cwd=REPO, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stdout + result.stderr


def test_google_s_python_version_warning_does_not_precede_every_answer():
    """On 3.10, google-api-core warns (FutureWarning, on stderr) at every import: every verb's
    output started with two lines of it (seen running the suite under 3.10). `--debug` keeps it."""
    import warnings

    from tpufab.term import console

    def verb():
        warnings.warn_explicit("You are using a non-supported Python version (3.10.13).",
                               FutureWarning, "_python_version_support.py", 212,
                               module="google.api_core._python_version_support")
        warnings.warn("a warning of tpufab's own", UserWarning, stacklevel=1)

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert console.run(verb) == 0
    assert [str(w.message) for w in seen] == ["a warning of tpufab's own"]
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert console.run(verb, debug=True) == 0
    assert len(seen) == 2
