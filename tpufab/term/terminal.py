"""Worker output made safe to show on a terminal (pure).

A worker's output is data, not instructions for the user's terminal. Before it is shown,
control characters are made visible in caret notation (ESC as ``^[``, BEL as ``^G``), so
no worker can set the window title, write the clipboard (OSC 52), clear the screen, move
the cursor or ring the bell. A carriage return keeps what a terminal would have left on the
line (the text after the last one: a progress bar shows its last state), so no worker can
return to the start of a line and forge another worker's prefix (``w9 │ forged``).
Bidirectional overrides and C1 controls show as ``<U+202E>``; bytes that are not UTF-8
show as U+FFFD. Colours (SGR, ``ESC [ ... m``) are dropped, or kept with ``color=True``
(then every line that had one ends with a reset, so a colour never bleeds into the next
worker's line). Tabs and newlines pass.

:class:`Lines` cuts a stream of chunks into whole lines with a bound on a line's length, so
a worker printing gigabytes without a newline costs at most ``limit`` bytes of memory.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Iterator
from typing import IO, Any

LINE_LIMIT = 1 << 20
_DANGER = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]")
_SGR = re.compile("\x1b\\[[0-9;:]{0,64}m")
RESET = "\x1b[0m"


def colors_for(stream: IO[Any] | None, asked: bool | None = None) -> bool:
    """Whether tpufab's own colours go to ``stream``: as asked, else only on a terminal and
    never when NO_COLOR is set (https://no-color.org), so pipes and logs get no ANSI."""
    if asked is not None:
        return bool(asked)
    if os.environ.get("NO_COLOR"):
        return False
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())


def _visible(match: re.Match) -> str:
    code = ord(match.group(0))
    if code < 0x20:
        return "^" + chr(code + 64)
    if code == 0x7F:
        return "^?"
    return f"<U+{code:04X}>"


def _line(line: str, color: bool) -> str:
    if "\r" in line:
        line = line.rstrip("\r")
        line = line[line.rfind("\r") + 1:]
    if "\x1b" in line:
        if color:
            parts, kept, end = [], False, 0
            for match in _SGR.finditer(line):
                parts.append(_DANGER.sub(_visible, line[end:match.start()]))
                parts.append(match.group(0))
                kept, end = True, match.end()
            parts.append(_DANGER.sub(_visible, line[end:]))
            return "".join(parts) + (RESET if kept else "")
        line = _SGR.sub("", line)
    return _DANGER.sub(_visible, line)


def relative_path(path: Any) -> str:
    """``path`` from the current directory when it is below it, else as it is ("" for
    None): how tpufab names a local file it wrote."""
    from pathlib import Path

    if path is None:
        return ""
    try:
        return str(Path(path).relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def neutralise_text(text: str, *, color: bool = False) -> str:
    """``text`` (any number of lines) with control sequences made harmless."""
    if not _DANGER.search(text):
        return text
    return "\n".join(_line(line, color) for line in text.split("\n"))


def neutralise(data: bytes, *, color: bool = False) -> bytes:
    """Bytes of worker output (whole lines, or a piece of an over-long line) made harmless;
    returned unchanged (the same object) when there is nothing to do."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        text = data.decode("utf-8", "replace")
    else:
        if not _DANGER.search(text):
            return data
    return neutralise_text(text, color=color).encode("utf-8")


class Lines:
    """Whole lines (each ending in ``\\n``) from a stream of chunks; a line longer than
    ``limit`` is passed on in ``limit``-sized pieces (each given a ``\\n``)."""

    def __init__(self, limit: int = LINE_LIMIT):
        self.limit = limit
        self.partial = bytearray()

    def feed(self, chunk: bytes) -> Iterator[bytes]:
        """Runs of whole lines completed by ``chunk``."""
        cut = chunk.rfind(b"\n")
        if cut < 0:
            self.partial += chunk
            while len(self.partial) >= self.limit:
                piece = bytes(self.partial[:self.limit])
                del self.partial[:self.limit]
                yield piece + b"\n"
            return
        if self.partial:
            self.partial += chunk[:cut + 1]
            done = bytes(self.partial)
            self.partial.clear()
        else:
            done = chunk[:cut + 1]
        self.partial += chunk[cut + 1:]
        if len(done) <= self.limit:
            yield done
            return
        start = 0
        while start < len(done):     # a run with an over-long line: cut that line up
            end = done.find(b"\n", start, start + self.limit)
            if end < 0:
                yield done[start:start + self.limit] + b"\n"
                start += self.limit
            else:
                yield done[start:end + 1]
                start = end + 1

    def end(self) -> Iterator[bytes]:
        """The last line, when the stream did not end with a newline."""
        if self.partial:
            rest = bytes(self.partial)
            self.partial.clear()
            yield rest + b"\n"


def lines_of(chunks: Iterable[bytes], limit: int = LINE_LIMIT) -> Iterator[bytes]:
    """Every line of a stream of chunks (each ending in ``\\n``, at most ``limit`` + 1 bytes)."""
    cutter = Lines(limit)
    for chunk in chunks:
        for run in cutter.feed(chunk):
            for line in run.split(b"\n")[:-1]:
                yield line + b"\n"
    yield from cutter.end()
