"""Worker selections (``all``, ``0``, ``0,3-5``, ``w[0-3,7]``) and folding back to ``w[0-3,7]``.

Pure functions: no I/O. A selection is parsed against the worker count of a node, so every
error can name the valid range.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from tpufab.errors import ConfigError

PREFIX = "w"

# ASCII digits only (\d also matches '٣'), and no more than a worker number needs.
_RANGE = re.compile(r"^([0-9]{1,9})(?:-([0-9]{1,9}))?$")
_BRACKETED = re.compile(r"^w\[(.*)\]$")


def _shown(text: str, width: int = 40) -> str:
    """User input quoted for an error sentence, cut short if it is long."""
    return repr(text if len(text) <= width else text[:width - 3] + "...")


def _valid_range(count: int) -> str:
    if count == 1:
        return "the only worker is 0"
    return f"valid workers are 0-{count - 1}"


def _parse_ranges(text: str, count: int, original: str) -> set[int]:
    workers: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        single = re.fullmatch(r"w([0-9]{1,9})", part)
        if single:
            part = single.group(1)
        match = _RANGE.match(part)
        if not match:
            raise ConfigError(
                f"Cannot read worker selection {_shown(original)}: {_shown(part)} is not a worker number "
                f"or range; use 'all', '0', '0,3-5' or 'w[0-3,7]' ({_valid_range(count)})."
            )
        low = int(match.group(1))
        high = int(match.group(2)) if match.group(2) is not None else low
        if high < low:
            raise ConfigError(
                f"Worker range {_shown(part)} in {_shown(original)} runs backwards; write it as "
                f"'{high}-{low}' ({_valid_range(count)})."
            )
        if high >= count:
            raise ConfigError(
                f"Worker {high} in {_shown(original)} does not exist: the node has {count} "
                f"worker{'s' if count != 1 else ''}, {_valid_range(count)}."
            )
        workers.update(range(low, high + 1))
    return workers


def parse_selection(selection: str | int | Iterable[int] | None, count: int) -> list[int]:
    """Return the sorted worker indexes named by ``selection`` on a node with ``count`` workers.

    ``None`` and ``"all"`` select every worker. Raises ConfigError naming the valid range.
    """
    if count < 1:
        raise ConfigError("The node has no workers to select from.")
    if selection is None:
        return list(range(count))
    if isinstance(selection, bool):
        raise ConfigError(f"Cannot read worker selection {selection!r}.")
    if isinstance(selection, int):
        return parse_selection(str(selection), count)
    if not isinstance(selection, str):
        workers = sorted(set(selection))
        for worker in workers:
            if not isinstance(worker, int) or isinstance(worker, bool) or not 0 <= worker < count:
                raise ConfigError(
                    f"Worker {worker!r} does not exist: {_valid_range(count)}."
                )
        return workers
    text = selection.strip()
    if text.lower() in ("all", "*", ""):
        if text == "":
            raise ConfigError(
                f"Empty worker selection; use 'all', '0', '0,3-5' or 'w[0-3,7]' "
                f"({_valid_range(count)})."
            )
        return list(range(count))
    workers: set[int] = set()
    # Split on commas that are outside brackets: "w[0-3,7],9" -> ["w[0-3,7]", "9"].
    for group in re.findall(r"w\[[^\]]*\]|[^,]+", text):
        group = group.strip()
        if not group:
            continue
        bracketed = _BRACKETED.match(group)
        if bracketed:
            workers |= _parse_ranges(bracketed.group(1), count, selection)
        else:
            workers |= _parse_ranges(group, count, selection)
    if not workers:
        raise ConfigError(
            f"Cannot read worker selection {_shown(selection)}; use 'all', '0', '0,3-5' or "
            f"'w[0-3,7]' ({_valid_range(count)})."
        )
    return sorted(workers)


def fold(workers: Iterable[int], prefix: str = PREFIX) -> str:
    """Fold worker indexes into ClusterShell notation: ``{0,1,2,3,7} -> 'w[0-3,7]'``, ``{5} -> 'w5'``."""
    ordered = sorted(set(workers))
    if not ordered:
        return ""
    if len(ordered) == 1:
        return f"{prefix}{ordered[0]}"
    parts: list[str] = []
    start = previous = ordered[0]
    for worker in ordered[1:] + [None]:
        if worker is not None and worker == previous + 1:
            previous = worker
            continue
        parts.append(str(start) if start == previous else f"{start}-{previous}")
        if worker is not None:
            start = previous = worker
    return f"{prefix}[{','.join(parts)}]"


def label(worker: int, prefix: str = PREFIX) -> str:
    """The display name of one worker: ``w3``."""
    return f"{prefix}{worker}"
