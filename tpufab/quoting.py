"""Shell quoting as a type, ``env K=V`` prefixes, and secrets that print as ``***``.

Pure: nothing here runs anything. A command is built from pieces; every piece is quoted with
:func:`shlex.quote` unless it is explicitly :class:`Raw`. A :class:`Secret` can never be
rendered into a command line (``ps`` shows argv to every user on a worker): secrets travel to
the worker through the fan-out agent's stdin as environment, or through a 0600 file written
from :func:`export_lines`.
"""

from __future__ import annotations

import json
import re
import shlex
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from tpufab.errors import ConfigError

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


def shell(text: str) -> Command:
    """Mark a whole user-written shell command line (``tpufab exec "CMD"``) as intended."""
    return Command(Raw(text))


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


def secret_forms(values: Iterable[str]) -> list[str]:
    """Each value in every form worth masking, longest first: as is, URL-encoded (``quote``,
    ``quote`` keeping ``/``, ``quote_plus``; upper- and lower-case hex) and JSON-escaped.
    The worker-side supervisor (remote/launch.py ``secret_forms``) masks the same forms."""
    from urllib.parse import quote as url_quote
    from urllib.parse import quote_plus

    forms: set[str] = set()
    for value in values:
        if not value:
            continue
        for form in (value, url_quote(value, safe=""), url_quote(value), quote_plus(value),
                     json.dumps(value)[1:-1]):
            forms.add(form)
            forms.add(re.sub("%[0-9A-F]{2}", lambda m: m.group(0).lower(), form))
    return sorted((f for f in forms if f), key=lambda f: (-len(f.encode()), f.encode()))


def secret_values(values: Iterable[str | Secret] | Mapping[str, str | Secret] | None) -> list[str]:
    """The strings to mask (every form of every value, see :func:`secret_forms`), longest
    first (so a secret containing another masks whole)."""
    if values is None:
        return []
    if isinstance(values, Mapping):
        values = values.values()
    return secret_forms({v.reveal() if isinstance(v, Secret) else str(v) for v in values})


def secret_bytes(values: Iterable[str | Secret] | Mapping[str, str | Secret] | None) -> list[bytes]:
    """:func:`secret_values` encoded, for :func:`mask_bytes`."""
    return [v.encode() for v in secret_values(values)]


def mask(text: str, secrets: Iterable[str | Secret] | Mapping[str, str | Secret] | None) -> str:
    """Replace every occurrence of every secret value in ``text`` with ``***``."""
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
