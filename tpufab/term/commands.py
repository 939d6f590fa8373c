"""A process's command line as a person names it (pure): ``python3 train.py``, not the
thousand characters of a ``python3 -c`` program or a path a screen wide.

Every view that shows a process (status's TPU column and holder lines, kill's lines, top,
stacks) shows ``short_command(cmd)``; ``--json`` keeps the whole command line.
"""

from __future__ import annotations

import re

LONG = 60  # characters: a command line longer than this (or of several lines) is shortened
INTERPRETERS = re.compile(r"^(python(\d+(\.\d+)*)?|pypy3?|bash|sh|dash|zsh|node|perl|ruby|"
                          r"Rscript|julia)$")
# tpufab's verifying loader: ``python3 -I -S -c L=... N SHA256 PATH ...`` runs PATH
LOADER = re.compile(r"\s\d+\s[0-9a-f]{64}\s(\S+)")
# interpreter options that take a value (the value is not the script)
VALUE_OPTIONS = {"-W", "-X", "-O", "--check-hash-based-pycs", "-o"}


def short_command(command: str, width: int = LONG) -> str:
    """``command`` (argv joined by spaces, as /proc/PID/cmdline reads) when short and on one
    line; else what names it: the program's file name and, for an interpreter, its script's
    (``python3 train.py``, ``python3 -m torch.distributed.run``, ``bash setup.sh``,
    ``python3 -c ...``), else the program's, cut at ``width``."""
    text = command.strip()
    if len(text) <= width and "\n" not in text:
        return text
    words = text.split()
    if not words:
        return ""
    program = _base(words[0])
    named = _script(program, words[1:], text) if INTERPRETERS.match(program) else program
    return named if len(named) <= width else named[:width - 3] + "..."


def _base(word: str) -> str:
    return word.rstrip("/").rsplit("/", 1)[-1] or word


def _script(program: str, args: list[str], text: str) -> str:
    skip = False
    for i, word in enumerate(args):
        if skip:
            skip = False
            continue
        if word == "-c":
            shipped = LOADER.search(text)
            if shipped:  # tpufab's loader: the file it runs
                return f"{program} {_base(shipped.group(1))}"
            return f"{program} -c ..."
        if word == "-m" and i + 1 < len(args):
            return f"{program} -m {args[i + 1]}"
        if word in VALUE_OPTIONS:
            skip = True
            continue
        if word.startswith("-"):
            continue
        return f"{program} {_base(word)}"
    return program
