"""Babysit's decisions, pure and tested as data: the options read (budgets, exit codes,
signals), why the platform took an attempt (``api_reason``, ``recovery_reason``), what to do
with an attempt (``decide``), how long to wait before the next (``backoff_delay``)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tpufab import nodeset
from tpufab.errors import ConfigError, TpufabError, shown
from tpufab.flows.babysit.records import NOTICE_MARK

if TYPE_CHECKING:
    from tpufab.cloud.nodes import Node, QueuedResourceInfo
    from tpufab.steps.runs.running import WorkerState

PREEMPTED_STATES = frozenset({"PREEMPTED", "TERMINATED"})
QUEUED_LOST_STATES = frozenset({"SUSPENDED", "FAILED"})
RESTART_VARIABLE = "TPUFAB_RESTART_COUNT"
BABYSIT_VARIABLE = "TPUFAB_BABYSIT_RUN"      # the first attempt's run id, the same every time
DEFAULT_POLL = 10.0
DEFAULT_UNREACHABLE_GRACE = 300.0
DEFAULT_FAILURE_GRACE = 30.0
DEFAULT_BACKOFF = (10.0, 300.0)
DEFAULT_CREATE_ATTEMPTS = 5
# The restarts the platform causes (the preemption budget's; tpufab.flows.supervisor counts them)
RECOVERY_REASONS = ("preempted", "maintenance", "host failure", "flex-start end")
EXIT_STALLED = 124        # as `run --stall-action kill` (and timeout(1))


class BabysitError(TpufabError):
    """Babysitting ended without the recipe finishing everywhere."""


def restart_budget(value: Any) -> int:
    """--max-restarts-on-errors: a whole number, 0 or more (ConfigError otherwise)."""
    try:
        n = int(str(value).strip()) if not isinstance(value, int) else value
    except ValueError:
        n = None
    if n is None or isinstance(value, bool) or n < 0:
        raise ConfigError(f"--max-restarts-on-errors takes a whole number of restarts, 0 or "
                          f"more, not {shown(str(value))}.")
    return n


def exit_codes(value: Any) -> frozenset[int]:
    """--restart-on-exit: "42,143" (or a list of ints or such strings) -> {42, 143}; codes are
    1-255 (ConfigError naming the bad one otherwise)."""
    if value in (None, ""):
        return frozenset()
    items = value.split(",") if isinstance(value, str) else \
        [p for v in value for p in (str(v).split(",") if not isinstance(v, int) else [v])]
    codes = set()
    for item in items:
        text = str(item).strip()
        if not text.isdigit() or not 1 <= int(text) <= 255:
            raise ConfigError(f"--restart-on-exit takes exit codes from 1 to 255 separated by "
                              f"commas, such as 42,143, not {shown(str(text or value))}.")
        codes.add(int(text))
    return frozenset(codes)


def state_exit_code(state: WorkerState) -> int | None:
    """The code a shell would report: the exit status, or 128+N for a death by signal N."""
    import signal as signals

    if state.state == "exited":
        return state.exit_code
    if state.state == "killed" and state.signal:
        try:
            return 128 + int(signals.Signals[state.signal])
        except KeyError:
            return None
    return None


DEFAULT_MAINTENANCE_MARGIN = 600.0
DEFAULT_MAINTENANCE_POLL = 60.0    # seconds between looks at upcomingMaintenance


def signal_name(value: Any) -> str:
    """--before-maintenance: "USR1", "SIGUSR1", "term" or a number -> "USR1" (ConfigError
    otherwise)."""
    import signal as signals

    text = str(value or "").strip().upper()
    if text.isdigit():
        try:
            return signals.Signals(int(text)).name[3:]
        except ValueError:
            pass
    name = text if text.startswith("SIG") else f"SIG{text}"
    if name in signals.Signals.__members__ and name not in ("SIGKILL", "SIGSTOP"):
        return name[3:]
    raise ConfigError(f"--before-maintenance takes the signal the recipe checkpoints on, such "
                      f"as TERM, USR1 or INT, not {shown(str(value))}.")


def signal_command(run_id: str, sig: str, notice: str) -> str:
    """Shell: write the notice where the recipe reads it (TPUFAB_PREEMPT_NOTICE), log it as
    the run supervisor logs a relayed notice, and signal the recipe's process group."""
    import shlex

    line = f"{NOTICE_MARK} {notice}; sent SIG{sig} to the recipe"
    d = '"$HOME/.tpufab/runs/"' + shlex.quote(run_id)
    return (f"d={d}; printf '%s\\n' {shlex.quote(notice)} > \"$d/notice\" && "
            f"printf '%s\\n' {shlex.quote(line)} >> \"$d/log\" && "
            f"kill -s {shlex.quote(sig)} -- -\"$(cat \"$d/pid\")\"")


def recovery_reason(outcome: str, reason: str, notices: Mapping[int, str]) -> str:
    """preempted | maintenance | host failure: why the platform took an attempt."""
    if any(n.startswith("maintenance") for n in notices.values()):
        return "maintenance"
    if "maximum run duration" in reason:   # a Compute Engine flex-start slice's end
        return "flex-start end"
    if outcome == "preempted" and ("PREEMPTED" in reason or "SUSPENDED" in reason
                                   or any(n.startswith("preempt") for n in notices.values())):
        return "preempted"
    return "host failure"


def api_reason(name: str, nodes: Sequence[Node] | None, qr: QueuedResourceInfo | None,
               expected: Iterable[str]) -> str | None:
    """Why the API says the pod's workers are gone, or None while they should be up."""
    expected = list(expected)
    found = {n.name: n for n in nodes or ()}
    if qr is not None and qr.state in QUEUED_LOST_STATES:
        why = f" ({qr.failure})" if qr.failure else ""
        return f"queued resource {qr.name} is {qr.state}{why}"
    for node_name in expected:
        node = found.get(node_name)
        if node is None:
            return f"TPU node {node_name} is gone"
        if node.condition.startswith("Flex-start slice"):
            return f"flex-start slice {node_name} ended (its maximum run duration ran out)"
        if node.state in PREEMPTED_STATES:
            return f"TPU node {node_name} was {node.state}"
    return None


def finished(state: WorkerState) -> bool:
    """The run is over on that worker (a worker with no record of it never runs it)."""
    return state.ended or state.state == "no record"


@dataclass(frozen=True)
class Decision:
    action: str        # wait | finished | failed | preempted | lost | stop-others
    reason: str = ""


def decide(workers: Sequence[int], states: Mapping[int, WorkerState], *,
           api: str | None, unreachable_since: Mapping[int, float], now: float,
           unreachable_grace: float, first_failure_at: float | None,
           failure_grace: float) -> Decision:
    """What to do with an attempt, given the API's verdict and each worker's run state."""
    from tpufab.steps.runs.running import fold_states

    if api:
        return Decision("preempted", api)
    unreachable = [w for w in workers if w in states and states[w].state == "unreachable"]
    if unreachable:
        waited = min(now - unreachable_since.get(w, now) for w in unreachable)
        if waited >= unreachable_grace:
            return Decision("lost", f"{nodeset.fold(unreachable)} unreachable for "
                                    f"{waited:.0f} s while the API says the node is READY")
        return Decision("wait")
    ended = [states[w] for w in workers if w in states and finished(states[w])]
    if len(ended) == len(workers):
        if all(s.ok for s in ended):
            return Decision("finished", fold_states(ended))
        return Decision("failed", fold_states(ended))
    if any(not s.ok for s in ended) and first_failure_at is not None \
            and now - first_failure_at >= failure_grace:
        return Decision("stop-others", fold_states(states[w] for w in workers if w in states))
    return Decision("wait")


def backoff_delay(restart: int, base: float, cap: float) -> float:
    """Seconds to wait before restart number ``restart`` (1, 2, ...): base, 2*base, ... cap."""
    if restart < 1 or base <= 0:
        return 0.0
    return min(cap, base * 2 ** (restart - 1))
