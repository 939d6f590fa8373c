"""Durations as users write them (``90s``, ``30m``, ``1h30m``) and as tpufab prints them."""

from __future__ import annotations

import re

from tpufab.errors import ConfigError


def parse_duration(text: str | float | int | None, flag: str) -> float | None:
    """``90``, ``90s``, ``30m``, ``2h``, ``1d``, ``1h30m`` -> seconds; None stays None."""
    if text is None or text == "":
        return None
    if isinstance(text, int | float) and not isinstance(text, bool):
        seconds = float(text)
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
    return seconds


def human_duration(seconds: float) -> str:
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m" + (f"{seconds % 60:02d}s" if seconds % 60 else "")
    hours, rest = divmod(seconds, 3600)
    return f"{hours}h" + (f"{rest // 60:02d}m" if rest // 60 else "")
