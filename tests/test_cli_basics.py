"""What every CLI has: --version and `version`, shell completion of cheap values, no ANSI in
pipes or under NO_COLOR, and the exit codes in one table (README)."""

from __future__ import annotations

import io
import json
import os
import re
from pathlib import Path

import pytest
from helpers import REPO, TPUFAB

import tpufab
from tpufab.errors import ConfigError, TpufabError
from tpufab.term.terminal import colors_for

ANSI = re.compile("\x1b\\[")


@pytest.fixture
def env(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("TPUFAB_")}
    env.update(HOME=str(tmp_path / "home"), TPUFAB_USER_CONFIG=str(tmp_path / "none.yaml"))
    (tmp_path / "home").mkdir()
    return env


def run(*args: str, env: dict, cwd: Path, extra: dict | None = None):
    import subprocess

    return subprocess.run([TPUFAB, *args], env={**env, **(extra or {})}, cwd=cwd,
                          capture_output=True, text=True, timeout=60,
                          stdin=subprocess.DEVNULL)


def test_version_flag_and_verb(env, tmp_path):
    flag = run("--version", env=env, cwd=tmp_path)
    assert flag.returncode == 0 and flag.stdout.strip() == f"tpufab {tpufab.__version__}"
    table = run("version", env=env, cwd=tmp_path)
    assert table.returncode == 0
    assert re.search(rf"^tpufab\s+{re.escape(tpufab.__version__)}$", table.stdout, re.M)
    assert re.search(r"^paramiko\s+\d", table.stdout, re.M)
    data = json.loads(run("version", "--json", env=env, cwd=tmp_path).stdout)
    assert data["tpufab"] == tpufab.__version__ and data["google-cloud-tpu"]
    assert data["python"].startswith(".".join(map(str, __import__("sys").version_info[:2])))


def complete(words: str, env: dict, cwd: Path) -> list[str]:
    parts = words.split(" ")
    result = run(env=env, cwd=cwd, extra={"_TPUFAB_COMPLETE": "complete_bash",
                                          "COMP_WORDS": words, "COMP_CWORD": str(len(parts) - 1)})
    assert result.returncode == 0, result.stderr
    return result.stdout.split()


def test_shell_completion_of_run_ids_recipes_and_pods(env, tmp_path):
    project = tmp_path / "project"
    (project / ".tpufab" / "runs" / "r-20261124-aaaa").mkdir(parents=True)
    (project / ".tpufab" / "runs" / "r-20261124-bbbb").mkdir()
    (project / "recipes").mkdir()
    (project / "recipes" / "train.sh").write_text("#!/bin/sh\n")
    (project / "recipes" / "notes.txt").write_text("")
    (project / "tpufab.yaml").write_text("name: my-v4-32\n")
    assert sorted(complete("tpufab logs --run r-", env, project)) == ["r-20261124-aaaa",
                                                                    "r-20261124-bbbb"]
    assert complete("tpufab kill --run r-20261124-b", env, project) == ["r-20261124-bbbb"]
    assert complete("tpufab run recipes/", env, project) == ["recipes/train.sh"]
    assert complete("tpufab status --name my", env, project) == ["my-v4-32"]
    script = run("--show-completion", "bash", env=env, cwd=tmp_path,
                 extra={"SHELL": "/bin/bash"})
    assert "_TPUFAB_COMPLETE" in script.stdout


class Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_colours_only_on_a_terminal_and_never_under_no_color(monkeypatch):
    monkeypatch.delenv("NO_COLOR", raising=False)
    assert colors_for(Tty()) and not colors_for(io.StringIO())
    monkeypatch.setenv("NO_COLOR", "1")
    assert not colors_for(Tty())
    assert colors_for(Tty(), asked=True)  # an explicit choice wins


def test_no_ansi_in_pipes(env, tmp_path):
    for args in (["--help"], ["types"], ["topology", "v4-32"], ["version"], ["nope"],
                 ["create", "--type", "v9-8", "--name", "x", "--project", "p", "--zone", "z"]):
        result = run(*args, env=env, cwd=tmp_path)
        assert not ANSI.search(result.stdout + result.stderr), args


def test_the_exit_codes_are_one_table_in_the_readme():
    readme = (REPO / "README.md").read_text()
    section = readme.split("## Exit codes", 1)[1].split("\n## ", 1)[0]
    for code in (0, TpufabError.exit_code, ConfigError.exit_code, 124, 130):
        assert re.search(rf"^\| {code} \|", section, re.M), code


def test_a_command_builds_only_its_own_verb_and_still_reads_what_comes_before_it(env, tmp_path):
    """`tpufab exec ...` builds exec's click parameters only (the whole table of verbs costs
    every command ~60 ms of CPU); options before the verb, help and bad verbs are as before."""
    import typer

    from tpufab.cli import build_app, command_named

    assert command_named(["--keep-alive", "0", "--debug", "exec", "true"]) == "exec"
    assert command_named(["--keep-alive=0", "sim", "up"]) == "sim"
    assert command_named(["--help"]) is None and command_named([]) is None
    assert command_named(["exce", "true"]) is None           # no such verb: the whole table
    assert command_named(["--", "exec"]) is None
    narrowed = typer.main.get_command(build_app("exec"))
    assert sorted(narrowed.commands) == ["exec"]
    assert sorted(typer.main.get_command(build_app("sim")).commands) == ["sim"]

    helped = run("--keep-alive", "0", "exec", "--help", env=env, cwd=tmp_path)
    assert helped.returncode == 0 and "Usage: tpufab exec [OPTIONS]" in helped.stdout
    wrong = run("exce", "true", env=env, cwd=tmp_path)
    assert wrong.returncode == 2 and "No such command 'exce'" in wrong.stderr, wrong.stderr
    whole = run("--help", env=env, cwd=tmp_path)
    assert all(f" {verb} " in whole.stdout for verb in ("exec", "status", "sim", "run"))
    bad = run("--keep-alive", "soon", "exec", "true", env=env, cwd=tmp_path)
    assert bad.returncode != 0 and "--keep-alive" in bad.stderr, bad.stderr
