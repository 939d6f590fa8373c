import os
import subprocess

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tpufab.errors import ConfigError
from tpufab.quoting import (
    MASK,
    Command,
    Raw,
    Secret,
    command,
    env_prefix,
    export_lines,
    mask,
    mask_bytes,
    quote,
    render,
    reveal_env,
    secret_values,
    shell,
    with_env,
)


@pytest.mark.parametrize(
    ("pieces", "expected"),
    [
        (("ls",), "ls"),
        (("echo", "a b"), "echo 'a b'"),
        (("echo", "it's"), "echo 'it'\"'\"'s'"),
        (("echo", "$(rm -rf /)", ";", "x"), "echo '$(rm -rf /)' ';' x"),
        (("cd", "/tmp", Raw("&&"), "ls"), "cd /tmp && ls"),
        (("seq", 3), "seq 3"),
        (("printf", "a\nb"), "printf 'a\nb'"),
    ],
)
def test_command_quotes_pieces_unless_raw(pieces, expected):
    built = command(*pieces)
    assert built == expected
    assert isinstance(built, Command)


@given(st.lists(st.text(alphabet=st.characters(blacklist_characters="\x00", blacklist_categories=("Cs",))), min_size=1, max_size=4))
def test_command_round_trips_through_a_real_shell(words):
    out = subprocess.run(
        ["sh", "-c", command("printf", "%s\\0", *words)], capture_output=True, check=True
    ).stdout
    assert out.split(b"\0")[:-1] == [w.encode() for w in words]


def test_secret_renders_masked_everywhere():
    token = Secret("hunter2")
    assert str(token) == MASK
    assert repr(token) == "Secret('***')"
    assert f"{token}" == MASK
    assert "hunter2" not in render(["curl", "-H", token])
    assert token.reveal() == "hunter2"
    assert token == Secret("hunter2")


def test_secret_never_enters_a_command_line():
    with pytest.raises(ConfigError, match="cannot be part of a command line"):
        command("echo", Secret("x"))
    with pytest.raises(ConfigError, match="holds a secret"):
        env_prefix({"TOKEN": Secret("x")})
    with pytest.raises(ConfigError):
        quote(Secret("x"))


def test_env_prefix_quotes_values_and_checks_names():
    assert env_prefix({}) == ""
    assert env_prefix({"A": "1", "B": "x y", "C": "$(id)"}) == "env A=1 B='x y' C='$(id)'"
    with pytest.raises(ConfigError, match="not a valid environment variable name"):
        env_prefix({"A B": "1"})
    with pytest.raises(ConfigError):
        env_prefix({"1A": "1"})


def test_with_env_runs_literally():
    cmd = with_env({"GREETING": "it's $(not run)"}, 'printf "%s" "$GREETING"')
    out = subprocess.run(["sh", "-c", cmd], capture_output=True, text=True, check=True).stdout
    assert out == "it's $(not run)"
    assert with_env({}, "true") == "true"


def test_export_lines_reveal_for_stdin_only():
    text = export_lines({"A": "1", "TOKEN": Secret("s'ecret")})
    assert text == "export A=1\nexport TOKEN='s'\"'\"'ecret'\n"
    out = subprocess.run(
        ["sh", "-c", '. /dev/stdin; printf "%s" "$TOKEN"'], input=text, capture_output=True, text=True,
        env={"PATH": os.environ["PATH"]},
    ).stdout
    assert out == "s'ecret"
    assert reveal_env({"T": Secret("v"), "U": 3}) == {"T": "v", "U": "3"}


def test_mask():
    secrets = {"A": Secret("abc"), "B": Secret("abcdef"), "C": ""}
    assert secret_values(secrets) == ["abcdef", "abc"]
    assert mask("x abcdef y abc", secrets) == "x *** y ***"
    assert mask("nothing", None) == "nothing"
    assert mask_bytes(b"token=abc\n", [b"abc"]) == b"token=***\n"


def test_shell_marks_user_text_as_is():
    assert shell("echo 'a'; ls") == "echo 'a'; ls"
