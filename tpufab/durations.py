"""Durations as users write them (``90s``, ``30m``, ``1h30m``) and as tpufab prints them."""

from __future__ import annotations

import re

from tpufab.errors import ConfigError

LONGEST = 366 * 86400.0     # no duration tpufab takes (a TTL, an idle time, a run) needs a year


def parse_duration(text: str | float | int | None, flag: str, *,
                   at_most: float = LONGEST) -> float | None:
    """``90``, ``90s``, ``30m``, ``2h``, ``1d``, ``1h30m`` -> seconds; None stays None. At
    most ``at_most`` seconds (a year): ``99999999999d`` is a typo, not a plan."""
    import math

    if text is None or text == "":
        return None
    if isinstance(text, int | float) and not isinstance(text, bool):
        seconds = float(text)
        if not math.isfinite(seconds):
            raise ConfigError(f"{flag} takes a duration such as 90s, 30m, 2h or 1h30m, not "
                              f"{text!r}.")
    else:
        raw = str(text).strip().lower()
        parts = re.findall(r"(\d+(?:\.\d+)?)\s*([smhd]?)", raw)
        if not parts or re.sub(r"(\d+(?:\.\d+)?)\s*([smhd]?)", "", raw).strip():
            raise ConfigError(f"{flag} takes a duration such as 90s, 30m, 2h or 1h30m, not "
                              f"{text!r}.")
        unit = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}
        seconds = sum(float(n) * unit[u] for n, u in parts)
    if seconds <= 0:
        raise ConfigError(f"{flag} must be longer than 0, not {text!r}.")
    if seconds > at_most:
        raise ConfigError(f"{flag} must be at most {human_duration(at_most)} "
                          f"({at_most / 86400:g} days), not {text!r}.")
    return seconds


def human_duration(seconds: float) -> str:
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m" + (f"{seconds % 60:02d}s" if seconds % 60 else "")
    hours, rest = divmod(seconds, 3600)
    return f"{hours}h" + (f"{rest // 60:02d}m" if rest // 60 else "")
