import os
import subprocess

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tpufab.errors import ConfigError
from tpufab.quoting import (
    MASK,
    MIN_SECRET_LENGTH,
    Command,
    Raw,
    Secret,
    command,
    env_prefix,
    export_lines,
    is_secret_name,
    mask,
    mask_bytes,
    quote,
    render,
    reveal_env,
    secret_values,
    split_secrets,
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
    secrets = {"A": Secret("abcdefgh"), "B": Secret("abcdefghij"), "C": ""}
    assert secret_values(secrets) == ["abcdefghij", "abcdefgh"]
    assert mask("x abcdefghij y abcdefgh", secrets) == "x *** y ***"
    assert mask("nothing", None) == "nothing"
    assert mask_bytes(b"token=abc\n", [b"abc"]) == b"token=***\n"


# -- the one rule: which names are secrets, which values are masked (issue 23, finding 11) --


@pytest.mark.parametrize(("name", "secret"), [
    # whole words at the end of the name, any case
    ("DB_PASS", True), ("OPENAI_KEY", True), ("HF_TOKEN", True), ("WANDB_API_KEY", True),
    ("MY_SECRET", True), ("GITHUB_TOKEN", True), ("AWS_SECRET_ACCESS_KEY", True),
    ("DB_PASSWORD", True), ("SSH_PASSPHRASE", True), ("db_pass", True), ("TOKEN", True),
    ("HUGGING_FACE_HUB_TOKEN", True), ("TPUFAB_GIT_TOKEN", True),
    # a word inside the name, a longer word, or a switch/count about a secret
    ("MAX_NEW_TOKENS", False), ("tokenizer_path", False), ("USE_AUTH_TOKEN", False),
    ("TOKENIZERS_PARALLELISM", False), ("KEY_PATH", False), ("PASSTHROUGH", False),
    ("SECRETS_DIR", False), ("ENABLE_API_KEY", False), ("MAX_TOKEN", False), ("PLAIN", False),
])
def test_secret_names_are_matched_as_whole_words(name, secret):
    assert is_secret_name(name) is secret


def test_explicit_secret_names_always_count():
    assert is_secret_name("MAX_NEW_TOKENS", ["MAX_NEW_TOKENS"])
    assert is_secret_name("run_label", ["RUN_*"])            # fnmatch, any case
    env = {"DB_PASS": "pw-long-enough", "MAX_NEW_TOKENS": "128", "USE_AUTH_TOKEN": "1",
           "PIN": "1234"}
    assert split_secrets(env, ["PIN"]) == ({"MAX_NEW_TOKENS": "128", "USE_AUTH_TOKEN": "1"},
                                           {"DB_PASS": "pw-long-enough", "PIN": "1234"})


@pytest.mark.parametrize(("value", "masked"), [
    ("1", False), ("128", False), ("2.5", False), ("seven77", False),      # < 8 characters
    ("eight888", True), ("hf_abcdefghijklmnop", True),
])
def test_only_values_long_enough_to_be_secrets_are_masked_in_output(value, masked):
    assert MIN_SECRET_LENGTH == 8
    line = f"step {value} loss 2.{value}1 done"
    shown = mask(line, {"DB_PASS": Secret(value)})
    assert (value not in shown) is masked
    if not masked:
        assert shown == line                                # not garbled: "step *** loss 2.***"
