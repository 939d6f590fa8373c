"""Shell quoting as a type, ``env K=V`` prefixes, and secrets that print as ``***``.

Pure: nothing here runs anything. A command is built from pieces; every piece is quoted with
:func:`shlex.quote` unless it is explicitly :class:`Raw`. A :class:`Secret` can never be
rendered into a command line (``ps`` shows argv to every user on a worker): secrets travel to
the worker through the fan-out agent's stdin as environment, or through a 0600 file written
from :func:`export_lines`.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from tpufab.errors import ConfigError
from tpufab.remote.workerlib import MIN_SECRET_LENGTH, secret_forms  # noqa: F401 - one rule

MASK = "***"
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class Raw(str):
    """A piece of shell syntax that is used as written (``Raw("&&")``, ``Raw("$HOME")``)."""

    __slots__ = ()


@dataclass(frozen=True, eq=False)
class Secret:
    """A value that must not be logged or put on a command line. Renders as ``***``."""

    _value: str

    def reveal(self) -> str:
        return self._value

    def __str__(self) -> str:
        return MASK

    def __repr__(self) -> str:
        return f"Secret({MASK!r})"

    def __format__(self, spec: str) -> str:
        return MASK

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Secret) and other._value == self._value

    def __hash__(self) -> int:
        return hash(("Secret", self._value))


Piece = str | Raw | int | float


def quote(piece: Piece | Secret) -> str:
    """Quote one piece for a POSIX shell; :class:`Raw` passes through; secrets are refused."""
    if isinstance(piece, Secret):
        raise ConfigError(
            "A secret cannot be part of a command line (every user on the worker can read it "
            "with ps); pass it as a secret environment variable instead."
        )
    if isinstance(piece, Raw):
        return str(piece)
    if isinstance(piece, bool) or not isinstance(piece, str | int | float):
        raise TypeError(f"cannot quote {type(piece).__name__} {piece!r}")
    return shlex.quote(str(piece))


class Command(str):
    """A shell command line built from quoted pieces. It *is* the string the worker runs."""

    __slots__ = ()


def command(*pieces: Piece) -> Command:
    """Join pieces into a :class:`Command`, quoting each unless it is :class:`Raw`.

    ``command("echo", "it's $(here)", Raw("&&"), "ls")`` -> ``echo 'it'"'"'s $(here)' && ls``.
    """
    if not pieces:
        raise ValueError("a command needs at least one piece")
    return Command(" ".join(quote(piece) for piece in pieces))


def check_env_name(name: str) -> str:
    if not _ENV_NAME.match(name):
        raise ConfigError(
            f"{name!r} is not a valid environment variable name; use letters, digits and "
            "underscores, not starting with a digit."
        )
    return name


def env_prefix(env: Mapping[str, Piece]) -> Command:
    """``env K=V ...`` with every value quoted; empty mapping -> empty command. No secrets."""
    if not env:
        return Command("")
    parts = ["env"]
    for name, value in env.items():
        check_env_name(name)
        if isinstance(value, Secret):
            raise ConfigError(
                f"Environment variable {name} holds a secret; pass it through the secrets "
                "channel, never as an `env` prefix on the command line."
            )
        parts.append(f"{name}={quote(str(value))}")
    return Command(" ".join(parts))


def with_env(env: Mapping[str, Piece], cmd: str) -> Command:
    """Prefix ``cmd`` with a quoted ``env K=V`` (run through ``sh -c`` so builtins work)."""
    if not env:
        return Command(cmd)
    return Command(f"{env_prefix(env)} sh -c {quote(cmd)}")


def export_lines(env: Mapping[str, str | Secret]) -> str:
    """``export K='v'`` lines, secrets revealed: only for stdin or a 0600 file, never argv."""
    lines = []
    for name, value in env.items():
        check_env_name(name)
        raw = value.reveal() if isinstance(value, Secret) else str(value)
        lines.append(f"export {name}={shlex.quote(raw)}\n")
    return "".join(lines)


def reveal_env(env: Mapping[str, str | Secret] | None) -> dict[str, str]:
    """Plain ``{name: value}`` for sending over the agent's stdin."""
    return {
        check_env_name(name): value.reveal() if isinstance(value, Secret) else str(value)
        for name, value in (env or {}).items()
    }


# -- which variables are secrets, and which values are masked ---------------------------------

# The last word of a variable's name (split on "_") that makes it a secret: HF_TOKEN, DB_PASS,
# OPENAI_KEY, WANDB_API_KEY, MY_SECRET, AWS_SECRET_ACCESS_KEY. A word inside the name or a
# longer word does not (MAX_NEW_TOKENS, tokenizer_path, TOKENIZERS_PARALLELISM, KEY_PATH).
SECRET_WORDS = ("TOKEN", "KEY", "PASS", "PASSWORD", "PASSWD", "PASSPHRASE", "SECRET")
# A first word that makes the name a setting about a secret rather than one: a switch or a
# count (USE_AUTH_TOKEN=1, ENABLE_API_KEY, MAX_TOKEN, NUM_KEY). An explicit name still counts.
NOT_SECRET_FIRST_WORDS = ("USE", "ENABLE", "DISABLE", "NO", "WITH", "MAX", "MIN", "NUM")


def is_secret_name(name: str, explicit: Iterable[str] = ()) -> bool:
    """THE rule of which variables are secrets, for every door (``exec``/``run``/``launch``
    ``-e`` and ``--secret``, ``Pod.run``/``Pod.start`` ``env``, task ``envs``/``secrets:``):
    a name listed in ``explicit`` (the ``secrets`` setting, ``--secret NAME``, a task's
    ``secrets:``; fnmatch patterns allowed), or a name whose last word (split on ``_``, any
    case) is one of :data:`SECRET_WORDS` and whose first word is not one of
    :data:`NOT_SECRET_FIRST_WORDS`. A secret travels on stdin only and shows as ``***``
    wherever tpufab shows the environment; its value is masked inside output only when it has
    at least ``MIN_SECRET_LENGTH`` (8) characters (:func:`secret_forms`)."""
    import fnmatch

    upper = name.upper()
    if any(fnmatch.fnmatchcase(upper, pattern.upper()) for pattern in explicit):
        return True
    words = [w for w in upper.split("_") if w]
    return bool(words) and words[-1] in SECRET_WORDS and \
        (len(words) == 1 or words[0] not in NOT_SECRET_FIRST_WORDS)


def split_secrets(env: Mapping[str, str], explicit: Iterable[str] = ()
                  ) -> tuple[dict[str, str], dict[str, str]]:
    """``env`` as (public, secret) by :func:`is_secret_name`."""
    explicit = tuple(explicit)
    public: dict[str, str] = {}
    hidden: dict[str, str] = {}
    for name, value in env.items():
        (hidden if is_secret_name(name, explicit) else public)[name] = value
    return public, hidden


def secret_values(values: Iterable[str | Secret] | Mapping[str, str | Secret] | None) -> list[str]:
    """The strings to mask (every form of every value long enough to be masked, see
    :func:`secret_forms`), longest first (so a secret containing another masks whole)."""
    if values is None:
        return []
    if isinstance(values, Mapping):
        values = values.values()
    return secret_forms({v.reveal() if isinstance(v, Secret) else str(v) for v in values})


def secret_bytes(values: Iterable[str | Secret] | Mapping[str, str | Secret] | None) -> list[bytes]:
    """:func:`secret_values` encoded, for :func:`mask_bytes`."""
    return [v.encode() for v in secret_values(values)]


def mask(text: str, secrets: Iterable[str | Secret] | Mapping[str, str | Secret] | None) -> str:
    """Replace every occurrence of every secret value (of at least ``MIN_SECRET_LENGTH``
    characters) in ``text`` with ``***``."""
    for value in secret_values(secrets):
        text = text.replace(value, MASK)
    return text


def mask_bytes(data: bytes, secrets: Iterable[bytes]) -> bytes:
    """Byte-level :func:`mask` for output streams (``secrets`` already encoded, longest first)."""
    for value in secrets:
        if value in data:
            data = data.replace(value, MASK.encode())
    return data


def render(pieces: Iterable[Piece | Secret]) -> str:
    """A loggable rendering of pieces where secrets show as ``***`` (never for execution)."""
    return " ".join(MASK if isinstance(p, Secret) else quote(p) for p in pieces)
