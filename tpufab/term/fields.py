"""Lines that differ only in their fields: one line with the fields that vary in braces.

Most of what a multi-host job prints differs between hosts only in a rank, a worker id, a
host name, an IP, a time or a loss in its last digits. A line's *shape* is its text with every
field replaced by a placeholder; lines of one shape fold into one, and each field that varies
is shown in braces, in bash's brace notation:

    [Gloo] Rank 0 is connected to 63 peer ranks.      (w0)
    [Gloo] Rank 63 is connected to 63 peer ranks.     (w63)
    -> [Gloo] Rank {0..63} is connected to 63 peer ranks.

A field is a run of digits (``17``; with one decimal point, ``2.31``; dotted quads and dates
split at their dots and dashes, so ``127.16.4.1`` is four fields), a word of hex digits that
holds a digit (``17ffbce8``, a commit, a hash), or an address (``0x7fca722f05b6``: a native
stack's frames differ per host only there). Everything else is text and must match
exactly: a secret's mask (``***``), a word, a path's names. So `step 100 loss 2.31` and
`step 100 loss 2.34` fold (``step 100 loss {2.31..2.34}``), `Traceback (most recent call
last):` never folds with `Epoch 3 done`, and a hash that differs per host shows as a set.

How a varying field is shown, from its values (in whatever order): consecutive integers as a
range (``{0..63}``, ``{0..3,8..11}``), integers with one step as ``{0..126..2}``, two values or
up to ``SET_LIMIT`` integers or words as a set (``{1.0,9.9}``, ``{a,b,c}``), more numbers as
their span (``{2.31..2.34}``), more words as the first few and a count (``{a1,b2,c3,...} (64
distinct)``).
The folded line keeps every worker's own text (``FieldFold.texts``): nothing is lost, and
``--raw`` shows each as it was printed.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from operator import itemgetter

SET_LIMIT = 4
PLACEHOLDER = "\x00"

FIELD = re.compile(
    r"(?<![0-9A-Za-z_])0[xX][0-9a-fA-F]+(?![0-9A-Za-z_])"  # 0x7fca722f05b6 (an address)
    r"|(?<![\d.])\d+\.\d+(?![.\d])"         # 2.31 (not part of 127.16.4.1)
    r"|(?<![0-9A-Za-z_])(?=[0-9a-fA-F]*\d)[0-9a-fA-F]{6,}(?![0-9A-Za-z_])"  # 17ffbce8
    r"|\d+")                                 # 17


_DIGIT = re.compile(r"\d")

# Where FIELD matches depends on which characters are digits, not on which digits they are
# (every class in it treats 1-9 alike; only 0 is special, in ``0x``): a line with its digits
# 2-9 made 1 has the fields where the line has them, and the same text between them (every
# digit is in a field). So the regex runs once per such *key* (``step 111 loss 1.1111``), not
# once per line: the lines of one shape printed on a thousand workers, step after step,
# mostly share a key. The key is made on the line's UTF-8 bytes (``bytes.translate`` is ~10x
# cheaper than ``str.translate``; no byte of a multi-byte character is an ASCII digit).
_KEY = bytes.maketrans(b"23456789", b"11111111")
_PARSED: dict[bytes, tuple[str, Callable[[str], tuple[str, ...]]]] = {}
_PARSED_LIMIT = 4096        # keys remembered (a log of hashes would otherwise grow it)


def _parse(line: str) -> tuple[str, Callable[[str], tuple[str, ...]]]:
    """``line``'s shape and a function giving its fields from it (or any line of its key)."""
    key = line.encode("utf-8", "surrogatepass").translate(_KEY)
    parsed = _PARSED.get(key)
    return parsed if parsed is not None else _parse_key(key)


def _parse_key(key: bytes) -> tuple[str, Callable[[str], tuple[str, ...]]]:
    text = key.decode("utf-8", "surrogatepass")     # the line, its digits 2-9 made 1
    spans = [m.span() for m in FIELD.finditer(text)]
    literal = [text[a:b] for a, b in zip([0] + [e for _, e in spans],
                                         [s for s, _ in spans] + [len(text)], strict=True)]
    if not spans:
        getter: Callable[[str], tuple[str, ...]] = _no_fields
    elif len(spans) == 1:
        one = slice(*spans[0])
        getter = lambda text: (text[one],)  # noqa: E731
    else:
        getter = itemgetter(*(slice(a, b) for a, b in spans))
    parsed = (PLACEHOLDER.join(literal), getter)
    if len(_PARSED) >= _PARSED_LIMIT:
        _PARSED.clear()
    _PARSED[key] = parsed
    return parsed


def _no_fields(text: str) -> tuple[str, ...]:
    return ()


def shape(line: str) -> str:
    """``line`` with each field a placeholder: lines that fold share it."""
    key = line.encode("utf-8", "surrogatepass").translate(_KEY)
    if b"1" not in key and b"0" not in key and (key.isascii() or not _DIGIT.search(line)):
        return line         # no digit (an ASCII line needs no regex to tell): no field
    parsed = _PARSED.get(key)
    return (parsed if parsed is not None else _parse_key(key))[0]


def fields(line: str) -> list[str]:
    return list(_parse(line)[1](line))


def _number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


def show_values(values: Sequence[str]) -> str:
    """One varying field's values as they read best, in braces (the same for the same values
    in any order)."""
    distinct = list(dict.fromkeys(values))
    if len(distinct) == 1:
        return distinct[0]
    ints = _integers(distinct)
    if None not in ints:
        nums = sorted(set(ints))  # type: ignore[arg-type]
        if len(nums) > 2 and nums[-1] - nums[0] == len(nums) - 1:
            return f"{{{nums[0]}..{nums[-1]}}}"    # one run (the loop below, at once)
        runs: list[tuple[int, int]] = []
        for n in nums:
            if runs and n == runs[-1][1] + 1:
                runs[-1] = (runs[-1][0], n)
            else:
                runs.append((n, n))
        if len(runs) <= 2 and len(nums) > 2:
            return "{" + ",".join(f"{a}..{b}" if a != b else f"{a}" for a, b in runs) + "}"
        steps = {b - a for a, b in zip(nums, nums[1:], strict=False)}
        if len(steps) == 1 and len(nums) > SET_LIMIT:
            return f"{{{nums[0]}..{nums[-1]}..{steps.pop()}}}"
    numbers = [_number(v) for v in distinct]
    span = all(n is not None for n in numbers) and (len(distinct) > SET_LIMIT or (
        len(distinct) > 2 and None in ints))
    if len(distinct) <= SET_LIMIT and not span:
        return "{" + ",".join(sorted(distinct, key=_order)) + "}"
    if span:
        low = min(distinct, key=lambda v: (_number(v), v))
        high = max(distinct, key=lambda v: (_number(v), v))
        return f"{{{low}..{high}}}"
    first = sorted(distinct, key=_order)[:3]
    return "{" + ",".join(first) + f",...}} ({len(distinct)} distinct)"


_LEADING_ZERO = re.compile(r"^0.", re.MULTILINE)


def _integers(values: list[str]) -> list[int | None]:
    """Each value as an integer if it is printed as one (``05`` is not), else None."""
    joined = "\n".join(values)
    if joined.count("\n") == len(values) - 1 and joined.replace("\n", "").isdigit() and \
            not _LEADING_ZERO.search(joined):
        try:
            return list(map(int, values))   # all integers (a thousand ranks): C loops
        except ValueError:
            pass                            # one is empty
    return [int(v) if v.isdigit() and (v == "0" or not v.startswith("0")) else None
            for v in values]


def _order(value: str) -> tuple:
    number = _number(value)
    return (0, number, value) if number is not None else (1, 0.0, value)


def merge(texts: Mapping[int, str]) -> str:
    """Lines of one shape (by worker) as one line, varying fields in braces."""
    distinct = set(texts.values())
    if len(distinct) == 1:
        return next(iter(distinct))
    # a field's values in any order: show_values shows the same for the same set of values,
    # so each distinct text is read once (a thousand workers often print a few)
    parsed = _PARSED
    lines = list(distinct)
    key = lines[0].encode("utf-8", "surrogatepass").translate(_KEY)
    joined = "\n".join(lines)
    if joined.count("\n") == len(lines) - 1 and \
            joined.encode("utf-8", "surrogatepass").translate(_KEY) == \
            b"\n".join([key] * len(lines)):
        # one key (the usual case: lines of one shape printed by a thousand workers): one
        # function reads every line's fields, a key made once for them all
        found = parsed.get(key)
        rows = list(map((found if found is not None else _parse_key(key))[1], lines))
    else:
        rows = []
        for text in lines:
            key = text.encode("utf-8", "surrogatepass").translate(_KEY)
            found = parsed.get(key)
            rows.append((found if found is not None else _parse_key(key))[1](text))
    literal = FIELD.split(texts[min(texts)])
    out = [literal[0]]
    for i, column in enumerate(zip(*rows, strict=True)):
        out.append(show_values(column))
        out.append(literal[i + 1])
    return "".join(out)
