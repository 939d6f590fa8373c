"""Compute Engine's list ``filter`` and paging, as its API reference describes them (the
``filter`` parameter of every ``list`` and ``aggregatedList`` method), pure.

Two kinds of expression are accepted, as Compute Engine accepts them:

- comparisons ``FIELD OP VALUE`` with ``=``, ``!=``, ``>``, ``<``, ``>=``, ``<=`` and ``:``
  (a substring of a string field, or presence with ``:*``); a nested field is dotted
  (``labels.team = infra``, ``scheduling.automaticRestart = false``); several are joined by
  ``AND`` (also by juxtaposition: ``(a = 1) (b = 2)``) and ``OR``, which binds tighter, as in
  Google's filtering syntax (AIP-160), and ``NOT`` or a leading ``-`` negates one;
- the older regular-expression form ``FIELD eq RE`` and ``FIELD ne RE`` (what gcloud sends for
  most ``--filter`` expressions, e.g. ``region eq ".*\\bus\\-central2\\b.*"``): the value is a
  regular expression that must match the whole field.

A field holding a resource URL (``zone``, ``region``, ``machineType``) matches a plain
comparison by its full URL or by its last segment (``zone = us-central2-b``). A repeated field
matches when any element does. A malformed filter is the API's 400 ``invalid``.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

Predicate = Callable[[dict[str, Any]], bool]
OPERATORS = ("!=", ">=", "<=", "=", ">", "<", ":")
TOKEN = re.compile(r'\s*(?:(?P<open>\()|(?P<close>\))|(?P<string>"(?:[^"\\]|\\.)*"|'
                   r"'(?:[^'\\]|\\.)*')|(?P<op>!=|>=|<=|=|>|<|:)|(?P<word>[^\s()=!<>:]+))")


class FilterError(ValueError):
    """A filter Compute Engine would refuse (its message is the API's sentence)."""


def page(items: list[Any], query: dict[str, str], default: int = 500) -> tuple[list[Any], str]:
    """One page of ``items`` per ``maxResults`` (at most 500, as the API caps it) and
    ``pageToken``; the next page's token, or "" at the end."""
    try:
        start = int(query.get("pageToken") or 0)
        size = int(query.get("maxResults") or default)
    except ValueError:
        raise FilterError("Invalid value for pageToken or maxResults.") from None
    size = max(1, min(size, 500))
    chunk = items[start:start + size]
    return chunk, str(start + size) if start + size < len(items) else ""


def parse(text: str | None) -> Predicate:
    """A predicate for Compute Engine's ``filter`` text (an empty filter keeps everything)."""
    text = (text or "").strip()
    if not text:
        return lambda resource: True
    tokens = _tokens(text)
    if _is_regex_form(tokens):
        return _regex_form(tokens)
    parser = _Parser(tokens, text)
    predicate = parser.conjunction()
    if parser.pos != len(tokens):
        raise FilterError(f"Invalid list filter expression: {text!r}.")
    return predicate


def _tokens(text: str) -> list[tuple[str, str]]:
    out, pos = [], 0
    while pos < len(text):
        if text[pos:].strip() == "":
            break
        match = TOKEN.match(text, pos)
        if not match:
            raise FilterError(f"Invalid list filter expression: {text!r}.")
        pos = match.end()
        kind = match.lastgroup or ""
        value = match.group(kind)
        if kind == "string":
            value = re.sub(r"\\(.)", r"\1", value[1:-1]) if value[0] == "'" else \
                value[1:-1].replace('\\"', '"')
        out.append((kind, value))
    return out


def _is_regex_form(tokens: list[tuple[str, str]]) -> bool:
    return any(k == "word" and v in ("eq", "ne") for k, v in tokens)


def _regex_form(tokens: list[tuple[str, str]]) -> Predicate:
    """``f eq RE`` or ``(f eq RE) (g ne RE2)`` (every part must hold)."""
    parts = [t for t in tokens if t[0] not in ("open", "close")]
    if len(parts) % 3:
        raise FilterError("Invalid list filter expression: each part is FIELD eq|ne VALUE.")
    tests = []
    for i in range(0, len(parts), 3):
        (fk, field), (_, op), (_, value) = parts[i:i + 3]
        if fk != "word" or op not in ("eq", "ne"):
            raise FilterError("Invalid list filter expression: each part is FIELD eq|ne VALUE.")
        try:
            pattern = re.compile(value)
        except re.error as err:
            raise FilterError(f"Invalid regular expression {value!r} in the filter: "
                              f"{err}.") from None
        tests.append((field, op == "eq", pattern))

    def predicate(resource: dict[str, Any]) -> bool:
        for field, wanted, pattern in tests:
            values = [_text(v) for v in _values(resource, field)] or [""]
            if any(pattern.fullmatch(v) for v in values) != wanted:
                return False
        return True

    return predicate


class _Parser:
    """AIP-160 expressions: a conjunction of disjunctions of (negated) terms."""

    def __init__(self, tokens: list[tuple[str, str]], text: str):
        self.tokens = tokens
        self.text = text
        self.pos = 0

    def peek(self) -> tuple[str, str] | None:
        return self.tokens[self.pos] if self.pos < len(self.tokens) else None

    def take(self) -> tuple[str, str]:
        token = self.peek()
        if token is None:
            raise FilterError(f"Invalid list filter expression: {self.text!r} ends too soon.")
        self.pos += 1
        return token

    def conjunction(self) -> Predicate:
        parts = [self.disjunction()]
        while (token := self.peek()) is not None and token[0] != "close":
            if token == ("word", "AND"):
                self.take()
            parts.append(self.disjunction())
        return lambda r: all(p(r) for p in parts)

    def disjunction(self) -> Predicate:
        parts = [self.term()]
        while self.peek() == ("word", "OR"):
            self.take()
            parts.append(self.term())
        return lambda r: any(p(r) for p in parts)

    def term(self) -> Predicate:
        token = self.take()
        if token == ("word", "NOT") or token == ("word", "-"):
            inner = self.term()
            return lambda r: not inner(r)
        if token[0] == "open":
            inner = self.conjunction()
            if self.take()[0] != "close":
                raise FilterError(f"Invalid list filter expression: {self.text!r}: an "
                                  "unclosed parenthesis.")
            return inner
        if token[0] != "word":
            raise FilterError(f"Invalid list filter expression: {self.text!r}.")
        field = token[1]
        negate = field.startswith("-")
        field = field.lstrip("-")
        op_token = self.take()
        if op_token[0] != "op":
            raise FilterError(f"Invalid list filter expression: {self.text!r}: expected an "
                              f"operator after {field!r}.")
        value = self.take()
        if value[0] not in ("word", "string"):
            raise FilterError(f"Invalid list filter expression: {self.text!r}: expected a "
                              f"value after {field} {op_token[1]}.")
        test = _comparison(field, op_token[1], value[1])
        return (lambda r: not test(r)) if negate else test


def _comparison(field: str, op: str, value: str) -> Predicate:
    def predicate(resource: dict[str, Any]) -> bool:
        values = _values(resource, field)
        if op == ":":
            if value == "*":
                return bool(values)
            return any(_has(v, value) for v in values)
        if op == "!=":
            return not any(_equal(v, value) for v in values)
        if op == "=":
            return any(_equal(v, value) for v in values)
        return any(_ordered(v, op, value) for v in values)

    return predicate


def _values(resource: Any, field: str) -> list[Any]:
    """Every value at dotted ``field`` (repeated fields fan out), [] where it is absent."""
    current = [resource]
    for part in field.split("."):
        nxt = []
        for item in current:
            if isinstance(item, list):
                item_list = item
            else:
                item_list = [item]
            for element in item_list:
                if isinstance(element, dict) and part in element:
                    nxt.append(element[part])
        current = nxt
    flat = []
    for item in current:
        flat.extend(item if isinstance(item, list) else [item])
    return flat


def _text(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def _equal(value: Any, wanted: str) -> bool:
    text = _text(value)
    if text == wanted or text.lower() == wanted.lower() and isinstance(value, bool):
        return True
    if "*" in wanted:  # a literal with wildcards, as Google's "=" allows on strings
        return re.fullmatch(".*".join(map(re.escape, wanted.split("*"))), text) is not None
    return "/" in text and text.rstrip("/").rsplit("/", 1)[-1] == wanted  # a URL's name


def _has(value: Any, wanted: str) -> bool:
    text = _text(value)
    if "*" in wanted:
        return re.search(".*".join(map(re.escape, wanted.split("*"))), text) is not None
    return wanted in text


def _ordered(value: Any, op: str, wanted: str) -> bool:
    try:
        left: Any = float(_text(value))
        right: Any = float(wanted)
    except ValueError:
        left, right = _text(value), wanted
    return {">": left > right, "<": left < right, ">=": left >= right,
            "<=": left <= right}[op]
