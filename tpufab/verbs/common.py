"""Shared by the verb modules: flags into Settings, the shared pod, printing helpers."""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from tpufab.config import Settings, check_labels, load_settings
from tpufab.errors import ConfigError


def parse_labels(labels: Iterable[str] | None) -> dict[str, str]:
    """`["team=ml", "env=dev,owner=me"]` -> {"team": "ml", "env": "dev", "owner": "me"}."""
    out: dict[str, str] = {}
    for item in labels or ():
        for pair in str(item).split(","):
            if not pair.strip():
                continue
            key, sep, value = pair.partition("=")
            if not sep or not key.strip():
                raise ConfigError(f"--label takes key=value, not {pair.strip()!r}.")
            out[key.strip()] = value.strip()
    check_labels(out, "--label")
    return out


def check_timeout(timeout: float | None, flag: str = "--timeout") -> float | None:
    """A verb's ``--timeout`` in seconds (None: the verb's default), or one sentence."""
    if timeout is None:
        return None
    try:
        value = float(timeout)
    except (TypeError, ValueError):
        value = float("nan")
    if not 0 < value <= MAX_TIMEOUT:  # also NaN and inf
        raise ConfigError(f"{flag} takes a number of seconds above 0 and at most "
                          f"{MAX_TIMEOUT:g} (a week), not {timeout}; leave it out for the "
                          "verb's default (docs/reliability.md lists them).")
    return value


MAX_TIMEOUT = 7 * 86400.0       # a --timeout past a week is a typo (inf, 1e308)


def settings_from_flags(*, type: str | None = None, accelerator_type: str | None = None,
                        version: str | None = None, labels: Iterable[str] | None = None,
                        timeout: float | None = None, **flags: Any) -> Settings:
    """Settings with the command-line flags on top. A False/None flag means "not given".

    ``timeout`` (a verb's --timeout): connecting to a worker waits at most that long
    (or connect_timeout, if shorter) and every command on the workers too.
    """
    if type and accelerator_type and type != accelerator_type:
        raise ConfigError(f"--type {type} and --accelerator-type {accelerator_type} disagree; "
                          "give one of them.")
    if flags.pop("no_os_login", False):
        flags["os_login"] = "false"
    overrides = {k: v for k, v in flags.items() if v is not None and v is not False}
    overrides["type"] = type or accelerator_type
    overrides["runtime_version"] = version
    timeout = check_timeout(timeout)
    settings = load_settings(overrides)
    settings.labels = {**settings.labels, **parse_labels(labels)}
    return settings.bounded(timeout)


def print_json(data: Any) -> None:
    print(json.dumps(data, indent=2, sort_keys=False))


WIDE_HELP = "Every value in full (long cells are shortened to fit the terminal)."


def count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


def pod_for(settings: Settings) -> Any:
    """The pod named by ``settings`` (a tpufab.Pod: the API the verbs are built on); its
    connections open once per process and later verbs reuse them."""
    from tpufab.pod.api import Pod

    return Pod.from_settings(settings)


def note(text: str, style: str | None = None) -> None:
    """tpufab's own words, on stderr (stdout stays the workers' output)."""
    from tpufab.term.console import stderr
    from tpufab.term.terminal import neutralise_text

    stderr().print(neutralise_text(text), markup=False, style=style)


def say(text: str) -> None:
    """A result line on stdout, printed as it is."""
    from tpufab.term.console import stdout
    from tpufab.term.terminal import neutralise_text

    stdout().print(neutralise_text(text), markup=False)


def progress(message: str) -> None:
    """A step's progress, dim on stderr."""
    note(message, "dim")


def chosen_name_note(settings) -> str:
    """Which pod a verb works on and why, e.g. `demo (--name)`."""
    from tpufab import current

    source = settings.source_of("name")
    if source == "command line":
        why = "--name"
    elif source == "environment":
        why = "TPUFAB_NAME"
    elif source.startswith("current pod"):
        found = current.read()
        why = found.reason() if found else source
    else:
        why = f"name: in {source}"
    return f"{settings.name} ({why})"
