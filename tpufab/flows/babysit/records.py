"""Babysit's records: each attempt (``Attempt``, written into ``babysit.json`` as it goes:
the one record that renders itself, as its state file) and the whole (``BabysitResult``)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tpufab.term.terminal import relative_path

NOTICE_MARK = "tpufab: notice:"  # tpufab/remote/run_worker.py's log line for a relayed notice


@dataclass
class Attempt:
    number: int
    run_id: str
    outcome: str   # finished | failed | preempted | lost | maintenance | stalled | interrupted
    #              | cancelled (the caller's hooks said stop: flows/babysit/hooks.py)
    reason: str
    log_dir: Path
    states: dict[int, str] = field(default_factory=dict)
    # worker -> the preemption/maintenance notice relayed to the recipe (from its log copy)
    notices: dict[int, str] = field(default_factory=dict)
    # worker -> exit code (128+N for signal N) of the workers that failed on their own (not
    # the ones babysit stopped after them)
    own_codes: dict[int, int] = field(default_factory=dict)
    restart: str = ""            # why babysit restarted after this attempt ("" : it did not)
    restart_kind: str = ""       # preempted | maintenance | host failure | error | exit N
    #                              | stalled

    def to_json(self) -> dict:
        out = {"attempt": self.number, "run": self.run_id, "outcome": self.outcome,
               "reason": self.reason, "log_dir": str(self.log_dir), "states": self.states}
        if self.notices:
            out["notices"] = {str(w): n for w, n in sorted(self.notices.items())}
        if self.own_codes:
            out["exit_codes"] = {str(w): c for w, c in sorted(self.own_codes.items())}
        if self.restart:
            out["restart"] = self.restart
            out["restart_kind"] = self.restart_kind
        return out


def notices_in(attempt_dir: Path) -> dict[int, str]:
    """worker -> the notice line tpufab's run supervisor wrote into that worker's log copy."""
    found = {}
    for log in sorted(attempt_dir.glob("w*.log")):
        if not log.stem[1:].isdigit():
            continue
        for line in log.read_text(errors="replace").splitlines():
            if line.startswith(NOTICE_MARK):
                found[int(log.stem[1:])] = line[len(NOTICE_MARK):].strip()
                break
    return found


@dataclass
class BabysitResult:
    run_id: str                  # the first attempt's run id: ./.tpufab/runs/<run_id>/
    attempts: list[Attempt]
    exit_code: int
    log_dir: Path

    @property
    def restarts(self) -> int:
        return max(0, len(self.attempts) - 1)

    @property
    def restart_counts(self) -> dict[str, int]:
        """Restarts by reason: {"preempted": 1, "error": 1, "exit 42": 2, ...}."""
        return restart_counts(self.attempts)


def restart_counts(attempts: Sequence[Attempt]) -> dict[str, int]:
    """Restarts by reason ("preempted", "error", "exit 42", ...), in the order first seen."""
    counts: dict[str, int] = {}
    for a in attempts:
        if a.restart:
            counts[a.restart_kind] = counts.get(a.restart_kind, 0) + 1
    return counts


def by_reason(attempts: Sequence[Attempt]) -> str:
    """"by reason: 1 preempted, 2 error" (or "none")."""
    counts = restart_counts(attempts)
    return "by reason: " + (", ".join(f"{n} {k}" for k, n in counts.items()) or "none")


def counts_text(attempts: Sequence[Attempt]) -> str:
    counts = restart_counts(attempts)
    total = sum(counts.values())
    if not total:
        return "0 restarts"
    return (f"{total} restart{'s' if total != 1 else ''}: "
            + ", ".join(f"{n} {kind}" for kind, n in counts.items()))


def shown_path(path: Path | None) -> str:
    """A local path as babysit names it: from here when below here ("-" for none)."""
    return relative_path(path) or "-"
