"""`tpufab babysit RECIPE`: run a recipe on the pod and keep it running through preemptions.

Each attempt is an ordinary run (``tpufab.steps.runs.running``: plan, start, follow). While it runs, the
API is polled; a node that is PREEMPTED or TERMINATED, gone, or whose queued resource is
SUSPENDED or FAILED (or workers that stay unreachable while the API still says READY) means
the attempt was lost to the platform: whatever logs are reachable are copied to
``./.tpufab/runs/<run-id>/attempt-<k>/`` (they were being copied all along), the node is
deleted (a preempted node still eats quota), created again with the same spec, set up with
the same setup script, given the same commit and the same mounts, and the recipe starts again
with ``TPUFAB_RESTART_COUNT=k``, after a backoff, at most ``max_restarts`` times. A recipe that
fails on its own is not a preemption: babysit stops and says so, unless its error budget
(``max_restarts_on_errors``, default 0) has restarts left, or its exit code is one of
``restart_on_exit`` (always restarted, without using the error budget; every restart, whatever
its reason, counts against ``max_restarts``), or ``restart_on_failure``. Each restart says
why (``preempted``, ``maintenance``, ``host failure``, ``exit 1 (error budget 1 of 2 used)``,
``exit 42 (--restart-on-exit)``, ``stalled``) and the end counts them by reason. A worker
killed by a signal counts as exit 128+N (SIGTERM: 143), as a shell says. With ``stall`` the
stall watchdog (steps/start/stall.py) watches each attempt: on a stall every worker's stacks go into
the attempt's logs and the folded summary is printed; then ``stall_action`` wait (the
default), kill (babysit ends, exit 124) or restart (the attempt is stopped and the next one
starts, counted as ``stalled``: not against the error budget, only ``max_restarts``). One
babysit per node: a lock file holds the babysitter's pid.

The decisions (``NodeSpec``, ``Restore``, ``api_reason``, ``decide``, ``backoff_delay``) are
pure and tested as data; ``Babysitter`` applies them.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import socket
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tpufab import nodeset
from tpufab.errors import ApiError, ConfigError, TpufabError, shown
from tpufab.steps.host.sshconfig import keep_current

if TYPE_CHECKING:
    from rich.console import Console

    from tpufab.cloud.nodes import Node, QueuedResourceInfo
    from tpufab.cloud.planes.base import ControlPlane
    from tpufab.config import Settings
    from tpufab.steps.health.status import StatusRow
    from tpufab.steps.runs.running import WorkerState

PREEMPTED_STATES = frozenset({"PREEMPTED", "TERMINATED"})
QUEUED_LOST_STATES = frozenset({"SUSPENDED", "FAILED"})
RESTART_VARIABLE = "TPUFAB_RESTART_COUNT"
NOTICE_MARK = "tpufab: notice:"  # tpufab/remote/run_worker.py's log line for a relayed notice
BABYSIT_VARIABLE = "TPUFAB_BABYSIT_RUN"      # the first attempt's run id, the same every time
DEFAULT_POLL = 10.0
DEFAULT_UNREACHABLE_GRACE = 300.0
DEFAULT_FAILURE_GRACE = 30.0
DEFAULT_BACKOFF = (10.0, 300.0)
DEFAULT_CREATE_ATTEMPTS = 5
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


# The restarts the platform causes (the preemption budget's; tpufab.flows.supervisor counts them)
RECOVERY_REASONS = ("preempted", "maintenance", "host failure", "flex-start end")
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


# ---------------------------------------------------------------------------------------------
# What to recreate and restore (pure)


@dataclass(frozen=True)
class NodeSpec:
    """The shape of the pod to recreate after a preemption."""

    name: str
    accelerator_type: str
    runtime_version: str
    tier: str                      # spot | preemptible | reserved | on-demand
    queued: bool = False
    num_slices: int = 1
    labels: Mapping[str, str] = field(default_factory=dict)
    # read from the node (None: not known, the settings decide): a node created with
    # --internal-ips comes back without external IPs, an OS Login node with enable-oslogin
    external_ips: bool | None = None
    metadata: Mapping[str, str] | None = None
    network: str = ""
    subnetwork: str = ""
    flex_start: int = 0            # Compute Engine flex-start: its maximum run duration (s)

    @classmethod
    def from_api(cls, name: str, nodes: Sequence[Node], qr: QueuedResourceInfo | None
                 ) -> NodeSpec:
        if not nodes:
            if qr is None:
                raise ConfigError(f"Nothing to babysit: there is no TPU node or queued resource "
                                  f"named {name!r}; create it first (`tpufab create`).")
            tier = "spot" if qr.tier == "spot" else ("reserved" if qr.tier == "reserved"
                                                     else "on-demand")
            return cls(name, qr.accelerator_type, qr.runtime_version, tier, True,
                       qr.node_count or 1)
        from tpufab.cloud.nodes import AUTOSTOP_KEY

        node = nodes[0]
        queued = qr is not None or node.queued_resource is not None
        slices = (qr.node_count if qr is not None else len(nodes)) or 1
        # autostop's marker goes: the recreated node has no watchdog until armed again
        metadata = {k: v for k, v in node.metadata.items() if k != AUTOSTOP_KEY}
        flex = node.max_run_duration if node.provisioning_model == "FLEX_START" else 0
        return cls(name, node.accelerator_type, node.runtime_version,
                   "flex-start" if flex else node.tier, queued, slices,
                   dict(node.labels), external_ips=node.external_ips, metadata=metadata,
                   network=node.network, subnetwork=node.subnetwork, flex_start=flex)

    def settings(self, base: Settings) -> Settings:
        """``base`` with this spec's type, runtime, tier, labels, metadata and network (a
        copy; what ``base`` sets itself wins for labels, metadata and network)."""
        return replace(base, name=self.name, type=self.accelerator_type,
                       runtime_version=self.runtime_version or None,
                       spot=self.tier == "spot", preemptible=self.tier == "preemptible",
                       reserved=self.tier == "reserved",
                       labels={**self.labels, **base.labels},
                       metadata={**(self.metadata or {}), **base.metadata},
                       internal_ip=base.internal_ip if self.external_ips is None
                       else not self.external_ips,
                       network=base.network or self.network or None,
                       subnetwork=base.subnetwork or self.subnetwork or None,
                       flex_start=bool(self.flex_start),
                       max_run_duration=f"{self.flex_start}s" if self.flex_start
                       else base.max_run_duration)

    def describe(self) -> str:
        slices = f" x {self.num_slices} slices" if self.num_slices > 1 else ""
        queued = ", queued" if self.queued else ""
        internal = ", no external IPs" if self.external_ips is False else ""
        return (f"{self.accelerator_type}{slices} ({self.tier}{queued}{internal}, "
                f"{self.runtime_version})")


@dataclass(frozen=True)
class MountPoint:
    url: str
    at: str
    driver: str
    options: tuple[str, ...] = ()


@dataclass
class Restore:
    """What a recreated node needs before the recipe starts again."""

    setup_hash: str | None = None          # the script the workers last ran with `setup`
    setup_script: bytes | None = None
    setup_name: str | None = None
    commit: str | None = None
    deploy_dir: str | None = None
    mounts: list[MountPoint] = field(default_factory=list)

    @classmethod
    def from_facts(cls, facts: Mapping[int, StatusRow]) -> Restore:
        """What worker 0 (or the first that answered) has: setup, commit, mounts."""
        answered = [facts[w] for w in sorted(facts) if facts[w].reachable]
        if not answered:
            return cls()
        first = answered[0]
        done = [s for s in first.setup if s.done]
        mounts = []
        for m in first.mounts:
            if m.driver in ("gcsfuse", "rclone") and m.url:
                mounts.append(MountPoint(m.url, m.at, m.driver))
        return cls(setup_hash=done[-1].hash if done else None, commit=first.commit,
                   deploy_dir=first.deploy_dir, mounts=mounts)

    def describe(self) -> str:
        parts = []
        if self.setup_script is not None:
            parts.append(f"setup {self.setup_name or self.setup_hash}")
        if self.commit:
            parts.append(f"commit {self.commit[:12]} in {self.deploy_dir}")
        parts += [f"{m.url} at {m.at} ({m.driver})" for m in self.mounts]
        return ", ".join(parts) or "nothing"


def setup_hash(content: bytes) -> str:
    """The name `tpufab setup` gives a script on the workers (tpufab.steps.host.setup)."""
    return hashlib.sha256(content).hexdigest()[:16]


# ---------------------------------------------------------------------------------------------
# Deciding (pure)


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


# ---------------------------------------------------------------------------------------------
# One babysitter per node


class Lock:
    """``<state_dir>/babysit/<project>.<zone>.<name>.lock``, held with flock for the life of the
    babysitter: a crashed or killed babysitter's lock is free again (the file only says who
    held it last)."""

    def __init__(self, path: Path):
        self.path = path
        self._fd: int | None = None

    @classmethod
    def for_node(cls, settings: Settings) -> Lock:
        key = f"{settings.project}.{settings.zone}.{settings.name}"
        return cls(settings.state_path / "babysit" / f"{key}.lock")

    def holder(self) -> dict:
        try:
            return json.loads(self.path.read_text() or "{}")
        except (OSError, ValueError):
            return {}

    def acquire(self, what: str) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            held = self.holder()
            who = f"pid {held.get('pid', '?')} on {held.get('host', '?')}"
            since = held.get("started")
            when = f" since {time.strftime('%H:%M:%S', time.localtime(since))}" if since else ""
            raise BabysitError(f"Another babysit ({who}{when}, {held.get('what', '?')}) is "
                               f"already watching this node; stop it first (kill "
                               f"{held.get('pid', 'its pid')}) or babysit another node. "
                               f"Lock: {self.path}.") from None
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                 "started": time.time(), "what": what}).encode())
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            try:
                os.ftruncate(self._fd, 0)
            finally:
                os.close(self._fd)   # closing drops the flock
                self._fd = None

    def __enter__(self) -> Lock:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


# ---------------------------------------------------------------------------------------------
# Records


@dataclass
class Attempt:
    number: int
    run_id: str
    outcome: str   # finished | failed | preempted | lost | maintenance | stalled | interrupted
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


# ---------------------------------------------------------------------------------------------
# The babysitter


class Babysitter:
    """Runs the attempts; every side effect goes through the pod's fan-out, the control plane
    and the library verbs (lifecycle, deploy, mount, jobs)."""

    def __init__(self, settings: Settings, recipe: str | Path, *, args: Sequence[str] = (),
                 max_restarts: int = 3, restart_on_failure: bool = False,
                 max_restarts_on_errors: int | str = 0,
                 restart_on_exit: str | Sequence[int | str] = (),
                 before_maintenance: str | None = None,
                 maintenance_margin: float | str = DEFAULT_MAINTENANCE_MARGIN,
                 maintenance_poll: float = DEFAULT_MAINTENANCE_POLL,
                 env: Sequence[str] = (), setup_script: str | Path | None = None,
                 no_deploy: bool = False, direct: bool = False, poll: float = DEFAULT_POLL,
                 unreachable_grace: float = DEFAULT_UNREACHABLE_GRACE,
                 failure_grace: float = DEFAULT_FAILURE_GRACE,
                 backoff: tuple[float, float] = DEFAULT_BACKOFF,
                 create_attempts: int = DEFAULT_CREATE_ATTEMPTS,
                 control: ControlPlane | None = None, console: Console | None = None,
                 out=None, base_dir: Path | None = None,
                 sleep: Callable[[float], None] | None = None, timeout: float | None = None,
                 stall: str | float | None = None, stall_action: str | None = None,
                 stall_progress_file: str | None = None,
                 ray: bool = False, ray_options: Sequence[str] = ()):
        from tpufab.cloud import names, planes
        from tpufab.steps.start import stall as stalls

        self.recipe = Path(recipe)
        if not self.recipe.is_file():
            raise ConfigError(f"No recipe at {shown(recipe)}: pass an executable file such as "
                              "recipes/jax_hello.sh.")
        if max_restarts < 0:
            raise ConfigError(f"--max-restarts must be 0 or more, not {max_restarts}.")
        self.stall = stalls.check_stall(stall, stall_action, restart=True)
        self.stall_action = stall_action or "wait"
        self.stall_progress_file = stalls.check_progress_file(stall_progress_file)
        if self.stall_progress_file is not None and self.stall is None:
            raise ConfigError("--stall-progress-file says what progress means for the stall "
                              "watchdog, which only --stall DURATION starts; add --stall "
                              "(e.g. --stall 15m).")
        self.max_restarts_on_errors = restart_budget(max_restarts_on_errors)
        self.restart_on_exit = exit_codes(restart_on_exit)
        self.errors_used = 0
        self.before_maintenance = signal_name(before_maintenance) if before_maintenance \
            else None
        from tpufab.durations import parse_duration

        self.maintenance_margin = parse_duration(maintenance_margin, "--maintenance-margin") \
            or DEFAULT_MAINTENANCE_MARGIN
        self.maintenance_poll = maintenance_poll
        self._signalled_windows: set[tuple[str, str]] = set()  # (node, window start)
        if no_deploy and direct:
            raise ConfigError("--no-deploy skips deploy, while --direct says how to deploy: "
                              "give one or the other.")
        if ray and self.before_maintenance:
            raise ConfigError("--before-maintenance signals a recipe tpufab runs, and --ray "
                              "hands the recipe to Ray: give one or the other.")
        if ray and self.stall is not None:
            raise ConfigError("--stall watches the output of a recipe tpufab runs, and --ray "
                              "hands the recipe to Ray: give one or the other.")
        if ray_options and not ray:
            raise ConfigError("--ray-options are `ray start` options for babysit --ray, and "
                              "this babysit runs the recipe itself: add --ray, or drop "
                              "--ray-options.")
        self.ray = ray
        self.ray_options = list(ray_options)
        self.name = names.validate_name(settings.name)
        settings.project = settings.require("project")
        self.settings = settings
        self.args = list(args)
        self.max_restarts = max_restarts
        self.restart_on_failure = restart_on_failure
        self.env = list(env)
        self.setup_path = Path(setup_script) if setup_script else None
        if self.setup_path is not None and not self.setup_path.is_file():
            raise ConfigError(f"Setup script {setup_script} does not exist.")
        self.no_deploy = no_deploy
        self.direct = direct
        self.poll = poll
        self.unreachable_grace = unreachable_grace
        self.failure_grace = failure_grace
        self.backoff = backoff
        self.create_attempts = max(1, create_attempts)
        # seconds each step on the workers may take (None: the fan-out's default)
        self.timeout = timeout
        self.control = planes.control_plane(settings, control)
        if console is None:
            from tpufab.term.console import stderr

            console = stderr()
        self.console = console
        self.out = out
        self.base_dir = base_dir
        self._stop = threading.Event()
        self.sleep = sleep or (lambda s: self._stop.wait(s))
        self.spec: NodeSpec | None = None
        self._watched_ids: set[str] = set()   # node ids a recovery may delete
        self.restore = Restore()
        self.root: Path | None = None
        self.attempts: list[Attempt] = []
        self.log_dir: Path | None = None

    # -- small helpers ------------------------------------------------------------------------
    def note(self, text: str, style: str | None = None) -> None:
        self.console.print(text, markup=False, style=style)

    def _pod(self):
        from tpufab.hosts import connect as pods

        pod = pods.shared(self.settings, control=self.control, console=self.console)
        self._watched_ids = {n.id for n in pod.nodes if n.id}   # what a recovery may delete
        return pod

    def _forget_pod(self) -> None:
        from tpufab.hosts import connect as pods

        pods.forget(self.settings)

    def _api(self) -> tuple[list[Node], QueuedResourceInfo | None]:
        from tpufab.steps.health.status import find_nodes

        return find_nodes(self.control, self.name)

    def _expected(self) -> list[str]:
        spec = self.spec
        if spec is None:
            return [self.name]
        if spec.num_slices > 1:
            return [f"{self.name}-{i}" for i in range(spec.num_slices)]
        return [self.name]

    def api_reason(self) -> str | None:
        """The API's verdict; a failing API is reported and treated as "no news"."""
        try:
            nodes, qr = self._api()
        except ApiError as err:
            self.note(f"babysit: could not ask the TPU API ({err}); trying again in "
                      f"{self.poll:g} s.", "yellow")
            return None
        return api_reason(self.name, nodes, qr, self._expected())

    # -- the whole thing ----------------------------------------------------------------------
    def run(self) -> BabysitResult:
        with Lock.for_node(self.settings) as lock:
            lock.acquire(f"babysit {self.recipe.name} on {self.name}")
            return self._run()

    def _run(self) -> BabysitResult:
        nodes, qr = self._api()
        self.spec = NodeSpec.from_api(self.name, nodes, qr)
        self._watched_ids = {n.id for n in nodes if n.id}
        reason = api_reason(self.name, nodes, qr, self._expected()) if nodes or qr else None
        if self.setup_path is not None:
            self.restore.setup_script = self.setup_path.read_bytes()
            self.restore.setup_name = self.setup_path.name
            self.restore.setup_hash = setup_hash(self.restore.setup_script)
        if reason is None and not all(n.ready for n in nodes):
            raise BabysitError(f"TPU node {self.name} is "
                               f"{', '.join(sorted({n.state for n in nodes})) or 'not there'}, "
                               "not READY; wait for it (`tpufab describe`) and babysit again.")
        if reason is None:
            self._capture()
        else:
            self.note(f"babysit: {reason} before the first attempt; recovering it first.",
                      "yellow")
            self._recover(reason)
        self._deploy_first()
        self.note(f"babysit: after a preemption {self.name} is recreated as "
                  f"{self.spec.describe()} and gets {self.restore.describe()}.", "dim")
        restarts = 0
        needs_recovery = False
        while True:
            if needs_recovery:
                self._recover(self.attempts[-1].reason)
            attempt = self._attempt(len(self.attempts), restarts)
            self.attempts.append(attempt)
            self._write_summary()
            if attempt.outcome == "finished":
                self.note(f"babysit: run {self.base_run_id} finished after "
                          f"{counts_text(self.attempts)}. Logs: {_relative(self.log_dir)}/.")
                return BabysitResult(self.base_run_id, self.attempts, 0, self.log_dir)
            why, kind = self._why_restart(attempt)
            if restarts >= self.max_restarts:
                self._write_summary()
                raise BabysitError(
                    f"Gave up after {restarts} restart{'s' if restarts != 1 else ''} "
                    f"(--max-restarts {self.max_restarts}; {by_reason(self.attempts)}): the "
                    f"last attempt "
                    f"{attempt.outcome} ({attempt.reason}). Logs: {_relative(self.log_dir)}/.",
                    exit_code=self._exit_code(attempt))
            restarts += 1
            attempt.restart, attempt.restart_kind = why, kind
            self._write_summary()
            needs_recovery = attempt.outcome in ("preempted", "lost")
            delay = backoff_delay(restarts, *self.backoff)
            what = "recovering the node" if needs_recovery else "restarting"
            self.note(f"babysit: {why}: attempt {attempt.number} {attempt.outcome} "
                      f"({attempt.reason}); {what} in {delay:g} s (restart {restarts} of "
                      f"{self.max_restarts}).", "yellow")
            self.sleep(delay)

    def _why_restart(self, attempt: Attempt) -> tuple[str, str]:
        """Why babysit restarts after ``attempt`` (the words, the kind counted at the end);
        raises BabysitError when a failure of the recipe's own is not to be restarted."""
        if attempt.outcome == "maintenance":
            return "maintenance", "maintenance"
        if attempt.outcome in ("preempted", "lost"):
            kind = recovery_reason(attempt.outcome, attempt.reason, attempt.notices)
            return kind, kind
        if attempt.outcome == "stalled":
            if self.stall_action == "restart":   # asked for: not the error budget's to pay
                return "stalled (--stall-action restart)", "stalled"
            self._write_summary()
            raise BabysitError(
                f"Run {attempt.run_id} stalled: {attempt.reason}; it was stopped on "
                f"{nodeset.fold(attempt.states) or 'every worker'} (--stall-action "
                f"{self.stall_action}), so babysit stops here after "
                f"{counts_text(self.attempts)} (--stall-action restart starts the next attempt "
                f"instead). Logs: {_relative(attempt.log_dir)}/.",
                exit_code=EXIT_STALLED)
        codes = sorted(set(attempt.own_codes.values())) or [self._exit_code(attempt)]
        code = "/".join(str(c) for c in codes)
        if self.restart_on_exit and all(c in self.restart_on_exit for c in codes):
            return f"exit {code} (--restart-on-exit)", f"exit {code}"
        if self.restart_on_failure:
            return f"exit {code} (--restart-on-failure)", "error"
        budget = self.max_restarts_on_errors
        if self.errors_used < budget:
            self.errors_used += 1
            return f"exit {code} (error budget {self.errors_used} of {budget} used)", "error"
        self._write_summary()
        spent = (f"its error budget is spent ({self.errors_used} of {budget} used)" if budget
                 else "that is not a preemption")
        raise BabysitError(
            f"Run {attempt.run_id} failed on its own ({attempt.reason}) and {spent}, so babysit "
            f"stops here after {counts_text(self.attempts)} (pass --max-restarts-on-errors N, "
            f"--restart-on-exit {code} or --restart-on-failure to restart on failures too). "
            f"Logs: {_relative(attempt.log_dir)}/.", exit_code=self._exit_code(attempt))

    @staticmethod
    def _exit_code(attempt: Attempt) -> int:
        codes = {int(c.split()[1]) for c in attempt.states.values()
                 if c.startswith("exited ") and c.split()[1].isdigit() and c != "exited 0"}
        return codes.pop() if len(codes) == 1 else 1

    # -- before the first attempt -------------------------------------------------------------
    def _capture(self) -> None:
        """Read what the workers have now (setup, commit, mounts) to restore it later."""
        from tpufab.steps.health import status

        pod = self._pod()
        facts = status.gather_facts(pod.fanout, deploy_dirs=status.default_deploy_dirs(
            self.settings), timeout=self.timeout)
        silent = {w: f.error or "no answer" for w, f in facts.items() if not f.reachable}
        if silent:  # as `run`: a recipe needs every worker (asking again would wait again)
            from tpufab.steps.runs.running import unreachable_error

            raise unreachable_error(silent, f"babysit {self.recipe.name}")
        found = Restore.from_facts(facts)
        if self.restore.setup_script is None and found.setup_hash:
            first = min(w for w, f in facts.items() if f.reachable)
            got = pod.fanout.run(["cat", f".cache/tpufab/remote/{found.setup_hash}/setup.sh"],
                                 workers=[first], timeout=self.timeout)
            try:
                content = got[first].stdout_bytes if got[first].ok else None
            finally:
                got.close()
            if content is not None and setup_hash(content) == found.setup_hash:
                self.restore.setup_script = content
                self.restore.setup_hash = found.setup_hash
                self.restore.setup_name = f"the setup script the workers ran ({found.setup_hash})"
        self.restore.commit = found.commit
        self.restore.deploy_dir = found.deploy_dir
        self.restore.mounts = found.mounts

    def _deploy_first(self) -> None:
        """Like `run`: deploy this checkout's HEAD first (unless no_deploy); remember it."""
        from tpufab import nodeset
        from tpufab.steps.code import deploy, gitops

        if self.no_deploy:
            if self.restore.commit:
                try:
                    self.root = gitops.repo_root()
                except gitops.GitError:
                    self.root = None
            return
        try:
            self.root = gitops.repo_root()
        except gitops.GitError:
            raise ConfigError(f"{Path.cwd()} is not inside a git repository, so there is "
                              "nothing to deploy: run from your project's checkout, or pass "
                              f"--no-deploy to run {self.recipe.name} in the workers' home "
                              "directories.") from None
        pod = self._pod()
        report = deploy.deploy(pod.fanout, dir=self.settings.remote_dir, direct=self.direct,
                               cwd=self.root,
                               progress=lambda msg: self.note(f"deploy: {msg}", "dim"))
        self.restore.commit, self.restore.deploy_dir = report.commit, report.dir
        self.note(f"Deployed {report.commit[:12]} to {report.dir} on "
                  f"{nodeset.fold(pod.workers)}.")

    # -- recovery -----------------------------------------------------------------------------
    def _recover(self, reason: str) -> None:
        if "maximum run duration" in reason and not self.settings.flex_start_renew:
            self._write_summary()
            raise BabysitError(
                f"babysit stops: flex-start slice {self.name} ended (its maximum run duration "
                f"ran out and Compute Engine deleted its VMs) after "
                f"{counts_text(self.attempts)}; set flex_start_renew: true (tpufab.yaml, or "
                "TPUFAB_FLEX_START_RENEW=1) to have babysit make a new flex-start request "
                f"instead. Logs: {_relative(self.log_dir)}/.")
        if "maximum run duration" in reason:
            self.note(f"babysit: {reason}: making a new flex-start request for {self.name} "
                      "(flex_start_renew).", "yellow")
        self._recreate(reason)
        self._restore()

    def _recreate(self, reason: str) -> None:
        """Delete the node and create it again in the shape it had (``self.spec``)."""
        from tpufab.cloud import lifecycle

        assert self.spec is not None
        self._forget_pod()
        self.note(f"babysit: {reason}: deleting {self.name} (a preempted node still counts "
                  "against quota) ...", "yellow")
        lifecycle.delete(self.settings, yes=True, console=self.console, control=self.control,
                         deletable=self._still_lost)
        wanted = self.spec.settings(self.settings)
        for attempt in range(1, self.create_attempts + 1):
            try:
                lifecycle.create(wanted, queued=self.spec.queued,
                                 num_slices=self.spec.num_slices, console=self.console,
                                 control=self.control)
                keep_current(wanted, self.console)  # new IPs and host keys in ~/.ssh/config
                break
            except ApiError as err:
                if attempt == self.create_attempts:
                    raise BabysitError(f"Could not recreate {self.name} after {attempt} tries: "
                                       f"{err}") from None
                delay = backoff_delay(attempt, *self.backoff)
                self.note(f"babysit: creating {self.name} failed ({err}); trying again in "
                          f"{delay:g} s.", "yellow")
                if "Queued resource" in str(err) or "vanished" in str(err):
                    lifecycle.delete(self.settings, yes=True, console=self.console,
                                     control=self.control)
                self.sleep(delay)

    def _still_lost(self, now) -> str | None:
        """Re-read just before babysit deletes: nodes that are not the ones it watched (another
        id: recreated by someone else meanwhile) are used, not deleted."""
        strangers = [s for s in now.slices if self._watched_ids and s.id
                     and s.id not in self._watched_ids]
        if strangers:
            from tpufab.cloud.lifecycle import slices_text

            return (f"{slices_text(strangers)} is not the node babysit watched (it was "
                    "recreated meanwhile); using it as it is.")
        return None

    def _restore(self) -> None:
        from tpufab import nodeset

        pod = self._pod()
        r = self.restore
        if r.setup_script is not None:
            self.note(f"babysit: setup ({r.setup_name}) on {nodeset.fold(pod.workers)} ...")
            restore_setup(pod, r, timeout=self.timeout)
        if r.commit and self.root is not None:
            report = restore_commit(pod, r, root=self.root, direct=self.direct,
                                    progress=lambda msg: self.note(f"deploy: {msg}", "dim"))
            self.note(f"babysit: deployed {report.commit[:12]} to {report.dir} again.")
        elif r.commit:
            self.note(f"babysit: commit {r.commit[:12]} was deployed, but this directory is "
                      "not its repository: not deploying it again.", "yellow")
        for m in r.mounts:
            restore_mount(pod, m, endpoint=self.settings.storage_endpoint)
            self.note(f"babysit: mounted {m.url} at {m.at} again.")

    # -- one attempt --------------------------------------------------------------------------
    @property
    def base_run_id(self) -> str:
        return self.attempts[0].run_id if self.attempts else self._first_run_id

    def _attempt(self, number: int, restarts: int) -> Attempt:
        from tpufab.ssh.remote_files import RemoteFile
        from tpufab.ssh.results import FanoutInterrupted
        from tpufab.steps.runs import running as jobs
        from tpufab.steps.runs.env import Forwarded, new_run_id

        pod = self._pod()
        run_id = new_run_id()
        if self.ray:
            return self._ray_attempt(pod, run_id, number, restarts)
        attempt_dir = self._attempt_dir(run_id, number)
        forwarded = self._forwarded()
        forwarded = Forwarded({**forwarded.public, RESTART_VARIABLE: str(restarts),
                               BABYSIT_VARIABLE: self.base_run_id}, forwarded.secrets)
        from tpufab.steps.code.deploy import default_cwd
        cwd = self.restore.deploy_dir or default_cwd(self.settings.remote_dir)
        plan = jobs.plan_run(RemoteFile.from_path(self.recipe), slices=pod.slices,
                             ips=pod.internal_ips(), run_id=run_id, args=self.args, cwd=cwd,
                             commit=self.restore.commit, forwarded=forwarded,
                             tpu=jobs.slice_facts(pod.nodes))
        try:
            jobs.start(pod.fanout, plan)
        except FanoutInterrupted:
            jobs.stop(pod.fanout, run_id, plan.workers, grace=2.0)
            raise BabysitError(f"Interrupted while starting run {run_id}; stopped it on "
                               f"{nodeset.fold(plan.workers)}.", exit_code=130) from None
        except jobs.RunError:
            reason = self.api_reason()
            if reason is None:
                raise
            return Attempt(number, run_id, "preempted", reason, attempt_dir)
        self.note(f"babysit: attempt {number} is run {run_id} ({self.recipe.name}, "
                  f"{RESTART_VARIABLE}={restarts}) on {nodeset.fold(plan.workers)}; logs "
                  f"copied to {_relative(attempt_dir)}/.")
        return self._watch(pod, plan, number, attempt_dir)

    def _attempt_dir(self, run_id: str, number: int) -> Path:
        from tpufab.steps.runs import running as jobs

        if number == 0:
            self._first_run_id = run_id
            if self.base_dir is not None:
                self.base_dir.mkdir(parents=True, exist_ok=True)
            self.log_dir = jobs.local_log_dir(run_id, self.base_dir,
                                              keep_runs=self.settings.keep_runs,
                                              keep_gib=self.settings.keep_logs_gib)
        assert self.log_dir is not None
        attempt_dir = self.log_dir / f"attempt-{number}"
        jobs.private_dir(attempt_dir)
        return attempt_dir

    def _ray_attempt(self, pod, run_id: str, number: int, restarts: int) -> Attempt:
        """One attempt through Ray (``--ray``): Ray brought up (a no-op where it runs; on a
        recreated node the whole cluster starts again), the recipe submitted as a Ray job
        (`tpufab ray submit`'s path) and followed, while the API is polled; a preemption
        cancels the follow. The job's log is copied to ``attempt-<k>/job.log``."""
        import sys

        from tpufab.reports import up_sentence
        from tpufab.steps.code.deploy import default_cwd
        from tpufab.steps.runs.running import open_private
        from tpufab.steps.start import raycluster

        attempt_dir = self._attempt_dir(run_id, number)
        head = pod.workers[0]
        self.note(f"babysit: Ray on {self.name} before attempt {number} (`tpufab ray up`) ...")
        try:
            started = raycluster.up(pod, extra=self.ray_options, timeout=self.timeout,
                                    progress=lambda text, style=None: self.note(text, "dim"))
        except raycluster.RayError as err:
            reason = self.api_reason()
            if reason is None:
                raise BabysitError(f"Could not start Ray for attempt {number}: {err}") from None
            return Attempt(number, run_id, "preempted", reason, attempt_dir)
        self.note(f"babysit: {up_sentence(started, self.name)}")
        job = f"tpufab-{run_id}"
        public = {RESTART_VARIABLE: str(restarts), BABYSIT_VARIABLE: self.base_run_id}
        cancel = threading.Event()
        box: dict[str, Any] = {}
        sink = self.out if self.out is not None else sys.stdout
        copy = open_private(attempt_dir / "job.log", "ab")

        def line(text: str) -> None:
            sink.write(text + "\n")
            sink.flush()
            copy.write((text + "\n").encode())
            copy.flush()

        def submit() -> None:
            try:
                box["done"] = raycluster.submit(
                    pod, self.settings, self.recipe, self.args, env=self.env,
                    cwd=self.restore.deploy_dir or default_cwd(self.settings.remote_dir),
                    extra_env=public, job_id=job,
                    timeout=self.timeout, out=line, cancel=cancel,
                    progress=lambda text, style=None: self.note(f"babysit: {text}", "dim"))
            except BaseException as err:  # noqa: BLE001 - judged below
                box["error"] = err

        self.note(f"babysit: attempt {number} is Ray job {job} ({self.recipe.name}, "
                  f"{RESTART_VARIABLE}={restarts}); its log copied to "
                  f"{_relative(attempt_dir)}/job.log.")
        follower = threading.Thread(target=submit, name="tpufab-babysit-ray", daemon=True)
        follower.start()
        reason = None
        try:
            while follower.is_alive():
                follower.join(self.poll)
                if follower.is_alive():
                    reason = self.api_reason()
                    if reason is not None:
                        break
        except KeyboardInterrupt:
            self._stop.set()
            cancel.set()
            follower.join(30)
            copy.close()
            self.attempts.append(Attempt(number, job, "interrupted", "Ctrl-C", attempt_dir))
            self._write_summary()
            raise BabysitError(f"Interrupted: asked Ray to stop job {job}; babysit ended. "
                               f"Logs: {_relative(attempt_dir)}/.", exit_code=130) from None
        if reason is not None:   # lost under the job: stop following (the head may not answer)
            cancel.set()
            follower.join(10)
            copy.close()
            self.note(f"babysit: {reason} during Ray job {job}.", "yellow")
            return Attempt(number, job, "preempted", reason, attempt_dir, {head: "lost"})
        copy.close()
        if "error" in box:
            reason = self.api_reason()
            if reason is not None:
                return Attempt(number, job, "preempted", reason, attempt_dir, {head: "lost"})
            err = box["error"]
            if isinstance(err, TpufabError):   # Ray failed us, the node is fine: a failure
                return Attempt(number, job, "failed", str(err).rstrip("."), attempt_dir,
                               {head: "lost"})
            raise err
        done = box["done"]
        if done.exit_code == 0:
            return Attempt(number, job, "finished", f"Ray job {job} succeeded", attempt_dir,
                           {head: "exited 0"})
        why = f"Ray job {job} {done.status.lower()}: exit {done.exit_code}" + (
            f" ({done.message})" if done.message else "")
        return Attempt(number, job, "failed", why, attempt_dir,
                       {head: f"exited {done.exit_code}"}, {}, {head: done.exit_code})

    def _forwarded(self):
        from tpufab.steps.runs.env import forwarded_for

        return forwarded_for(self.settings, self.env)

    def _watch(self, pod, plan, number: int, attempt_dir: Path) -> Attempt:
        from tpufab.steps.runs import running as jobs
        from tpufab.views.live import LiveView

        workers = plan.workers
        ended: dict[int, WorkerState] = {}
        lock = threading.Lock()

        def on_end(worker: int, state: WorkerState) -> None:
            with lock:
                ended[worker] = state

        view = LiveView(out=self.out, workers=workers) if self.out is not None else \
            LiveView(workers=workers)
        stalled = None
        if self.stall is not None:
            view, stalled = self._stall_watch(pod, plan.run_id, workers, view, attempt_dir)
        sink = jobs.FollowSink(view, secrets=plan.secrets.values(), copy_dir=attempt_dir,
                               on_end=on_end)
        box: dict[str, Any] = {}

        def follow() -> None:
            try:
                jobs.follow(pod.fanout, plan.run_id, workers, sink)
            except BaseException as err:  # noqa: BLE001 - reported by the watcher
                box["error"] = err

        follower = threading.Thread(target=follow, name="tpufab-babysit-follow", daemon=True)
        follower.start()
        states: dict[int, WorkerState] = {}
        followed_end: dict[int, WorkerState] = {}
        confirmed_lost: set[int] = set()
        unreachable_since: dict[int, float] = {}
        first_failure: float | None = None
        own_codes: dict[int, int] = {}
        stopped = False
        signalled: str | None = None      # the maintenance notice sent to this attempt
        looked_at = 0.0                   # when upcomingMaintenance was last read
        decision = Decision("wait")
        try:
            while True:
                follower.join(self.poll)
                now = time.monotonic()
                with lock:
                    fresh = {w: s for w, s in ended.items() if w not in followed_end}
                    followed_end.update(fresh)
                states.update(fresh)
                if stalled is not None and stalled.killed:
                    stopped = True             # what ends now was stopped by the watchdog
                # ask again where nobody follows any more, and where a follower said "lost"
                # (it can read the instant between the recipe's exit and its record so)
                unfollowed = [w for w, s in states.items() if not finished(s) or
                              (s.state == "lost" and w not in confirmed_lost)]
                if unfollowed:
                    probed = self._probe(pod, plan.run_id, unfollowed)
                    confirmed_lost.update(w for w, s in probed.items() if s.state == "lost")
                    states.update(probed)
                for w, s in states.items():
                    if s.state == "unreachable":
                        unreachable_since.setdefault(w, now)
                    else:
                        unreachable_since.pop(w, None)
                    if finished(s) and not s.ok and first_failure is None:
                        first_failure = now
                    if finished(s) and not s.ok and not stopped and w not in own_codes:
                        code = state_exit_code(s)   # failed on its own, before babysit stopped
                        if code is not None:        # the others
                            own_codes[w] = code
                if self.before_maintenance and signalled is None and \
                        now - looked_at >= self.maintenance_poll:
                    looked_at = now
                    signalled = self._before_maintenance(pod, plan.run_id, workers)
                decision = decide(workers, states, api=self.api_reason(),
                                  unreachable_since=unreachable_since, now=now,
                                  unreachable_grace=self.unreachable_grace,
                                  first_failure_at=first_failure, failure_grace=self.failure_grace)
                if decision.action == "stop-others" and not stopped:
                    running = [w for w in workers if not (w in states and finished(states[w]))]
                    self.note(f"babysit: {decision.reason}; stopping the run on "
                              f"{nodeset.fold(running)} (a job without a peer only hangs).",
                              "yellow")
                    jobs.stop(pod.fanout, plan.run_id, running, grace=2.0)
                    stopped = True
                    continue
                if stalled is not None and stalled.killed and \
                        decision.action in ("finished", "failed"):
                    decision = Decision("stalled", stalled.reason(stacks="; stacks: {}"))
                if decision.action not in ("wait", "stop-others"):
                    break
                if not follower.is_alive() and "error" in box:
                    raise box["error"]
        except KeyboardInterrupt:
            self._stop.set()
            self.note(f"babysit: interrupted; stopping run {plan.run_id} ...", "yellow")
            try:
                jobs.stop(pod.fanout, plan.run_id, workers, grace=2.0)
            finally:
                self._end_follower(pod, follower, sink)
                self._keep_logs(pod, plan.run_id, states, attempt_dir)
                self.attempts.append(Attempt(number, plan.run_id, "interrupted", "Ctrl-C",
                                             attempt_dir, {w: s.label for w, s in states.items()}))
                self._write_summary()
            raise BabysitError(f"Interrupted: stopped run {plan.run_id} on "
                               f"{nodeset.fold(workers)}; babysit ended. Logs: "
                               f"{_relative(attempt_dir)}/.", exit_code=130) from None
        self._end_follower(pod, follower, sink)
        if decision.action in ("preempted", "lost"):
            self.note(f"babysit: {decision.reason}; keeping whatever logs are reachable ...",
                      "yellow")
        self._keep_logs(pod, plan.run_id, states, attempt_dir)
        if signalled is not None and decision.action in ("finished", "failed"):
            # it ended after babysit asked it to checkpoint: a maintenance restart, whatever
            # its exit code (the error budget is for failures of its own)
            decision = Decision("maintenance", f"{signalled}; {decision.reason}")
            own_codes = {}
        return Attempt(number, plan.run_id, decision.action, decision.reason, attempt_dir,
                       {w: s.label for w, s in sorted(states.items())},
                       notices_in(attempt_dir), own_codes)

    def _stall_watch(self, pod, run_id: str, workers: Sequence[int], view, attempt_dir: Path):
        """``view`` under the stall watchdog: on a stall, every worker's stacks saved into
        ``attempt_dir`` and printed folded, then wait, or stop the run (kill, restart: the
        watch loop sees ``.killed`` and ends the attempt as stalled). Returns (the view,
        the handler)."""
        from tpufab.steps.health import stacks
        from tpufab.steps.runs import running as jobs
        from tpufab.steps.start import stall as stalls

        def take_stacks():
            report = stacks.capture(pod.fanout, workers, run=run_id,
                                    device_globs=pod.device_globs(),
                                    timeout=min(self.timeout or stacks.TIMEOUT, stacks.TIMEOUT),
                                    progress=lambda text, style=None: self.note(
                                        f"babysit: {text}", style))
            if report.dumped and report.processes:
                try:
                    report.save(attempt_dir)
                except OSError as err:
                    self.note(f"babysit: could not save the stacks in {attempt_dir} ({err}).",
                              "yellow")
            return report

        def show(lines: Sequence[str]) -> None:
            for line in lines:
                self.note(line)

        progress = None if self.stall_progress_file is None else stalls.ProgressFile(
            pod.fanout, run_id, workers, self.stall_progress_file,
            timeout=min(self.timeout or 30.0, 30.0))
        handler = stalls.StallHandler(
            run_id, workers, self.stall, self.stall_action,
            lambda text, style=None: self.note(f"babysit: {text[:1].lower()}{text[1:]}",
                                               style), show,
            take_stacks=take_stacks, progress=progress,
            stop=lambda: jobs.stop(pod.fanout, run_id, list(workers), grace=2.0))
        return stalls.StallWatch(view, self.stall, handler, progress=progress), handler

    def _before_maintenance(self, pod, run_id: str, workers: Sequence[int]) -> str | None:
        """When a node's announced maintenance window starts within the margin (and this
        window was not signalled yet): send the recipe the checkpoint signal on every worker,
        with the notice in TPUFAB_PREEMPT_NOTICE and its log; the notice, or None."""
        from tpufab.cloud.nodes import _utc
        from tpufab.durations import human_duration

        for node in self._expected():
            try:
                upcoming = self.control.upcoming_maintenance(node)
            except TpufabError as err:
                self.note(f"babysit: could not read {node}'s upcoming maintenance ({err}).",
                          "yellow")
                return None
            if upcoming is None or upcoming.window_start is None:
                continue
            key = (node, upcoming.window_start.isoformat())
            left = upcoming.seconds_to_start() or 0.0
            if key in self._signalled_windows or left > self.maintenance_margin:
                continue
            self._signalled_windows.add(key)
            when = _utc(upcoming.window_start, "%Y-%m-%d %H:%M:%S UTC")
            notice = (f"maintenance: {upcoming.type or 'scheduled'} window on {node} at {when} "
                      f"(babysit --before-maintenance, margin "
                      f"{human_duration(self.maintenance_margin)})")
            got = pod.fanout.run(signal_command(run_id, self.before_maintenance, notice),
                                 workers=list(workers), timeout=self.timeout or 60)
            try:
                failed = [w for w, r in got.items() if not r.ok]
            finally:
                got.close()
            where = nodeset.fold(w for w in workers if w not in failed)
            self.note(f"babysit: maintenance window on {node} at {when} "
                      f"(in {human_duration(max(0.0, left))}): sent SIG{self.before_maintenance} "
                      f"to run {run_id} on {where} to checkpoint; it restarts when it ends"
                      + (f" (could not signal {nodeset.fold(failed)})" if failed else "") + ".",
                      "yellow")
            return notice
        return None

    def _probe(self, pod, run_id: str, workers: Sequence[int]) -> dict[int, WorkerState]:
        """Ask workers nobody follows any more (their follower's connection broke) how the run
        stands there, over a fresh connection."""
        from tpufab.steps.runs import running as jobs
        from tpufab.steps.runs.running import WorkerState, state_from_status

        out = {}
        for w, answer in jobs.statuses(pod.fanout, list(workers), timeout=self.timeout).items():
            if answer.error is not None:
                out[w] = WorkerState(w, "unreachable", detail=answer.error)
                continue
            entry = next((e for e in answer.runs if e.get("run") == run_id), None)
            out[w] = state_from_status(w, entry) if entry else WorkerState(w, "no record")
        return out

    def _end_follower(self, pod, follower: threading.Thread, sink) -> None:
        if follower.is_alive():
            follower.join(2.0)
        if follower.is_alive():
            # connections that hang (a vanished VM): closing them ends the followers
            pod.fanout.close()
            follower.join(10.0)
        sink.close()

    def _keep_logs(self, pod, run_id: str, states: Mapping[int, WorkerState],
                   attempt_dir: Path) -> None:
        """The whole log of every worker that still answers (the copy made while following
        stops where a connection broke)."""
        from tpufab.steps.runs import running as jobs

        reachable = [w for w in pod.workers
                     if not (w in states and states[w].state == "unreachable")]
        if not reachable:
            return
        try:
            jobs.save_logs(pod.fanout, run_id, reachable, attempt_dir, self._secret_values())
        except (TpufabError, OSError) as err:
            self.note(f"babysit: could not fetch the logs ({err}).", "yellow")

    def _secret_values(self) -> list[str]:
        return list(self._forwarded().secrets.values())

    def _write_summary(self) -> None:
        if self.log_dir is None:
            return
        data = {"run": self.base_run_id, "node": self.name, "recipe": str(self.recipe),
                "args": self.args, "spec": self.spec.describe() if self.spec else None,
                "restore": self.restore.describe(),
                "attempts": [a.to_json() for a in self.attempts],
                "restarts": restart_counts(self.attempts),
                "max_restarts": self.max_restarts,
                "max_restarts_on_errors": self.max_restarts_on_errors,
                "errors_used": self.errors_used,
                "restart_on_exit": sorted(self.restart_on_exit),
                "stall": None if self.stall is None else {
                    "seconds": self.stall, "action": self.stall_action,
                    "progress_file": self.stall_progress_file}}
        from tpufab.steps.runs.running import open_private

        tmp = self.log_dir / "babysit.json.tmp"
        with open_private(tmp, "wb") as fh:
            fh.write((json.dumps(data, indent=2) + "\n").encode())
        tmp.replace(self.log_dir / "babysit.json")


# ---------------------------------------------------------------------------------------------
# Bringing a pod to a Restore (babysit after a preemption, launch on a new or reused pod)


def restore_setup(pod, r: Restore, *, sink=None, env: Mapping[str, str] | None = None,
                  secrets: Mapping[str, str] | None = None,
                  timeout: float | None = None, force: bool = False) -> dict:
    """Run ``r.setup_script`` on every worker (once per content unless ``force``; ``env`` and
    ``secrets``, the latter on stdin only, do not count as content); {worker: SetupRow}."""
    from tpufab.steps.host.setup import run_setup

    result, outcomes = run_setup(pod.fanout, r.setup_script, sink=sink, env=env,
                                 secrets=secrets, timeout=timeout, force=force,
                                 name=_setup_words(r.setup_name))
    result.close()
    return outcomes


def _setup_words(name: str | None) -> str:
    """How a failure names the setup: ``the task.yaml setup``, ``the setup.sh``."""
    if not name:
        return "setup"
    return name if name.startswith("the ") else f"the {name}"


def restore_commit(pod, r: Restore, *, root: Path, direct: bool = False,
                   progress: Callable[[str], None] | None = None):
    """Deploy ``r.commit`` of the repository at ``root`` into ``r.deploy_dir``; the report."""
    from tpufab.steps.code import deploy

    return deploy.deploy(pod.fanout, ref=r.commit or "HEAD", dir=r.deploy_dir, direct=direct,
                         cwd=root, progress=progress)


def restore_mount(pod, m: MountPoint, *, endpoint: str | None = None,
                  for_task: bool = False):
    """Mount ``m`` on every worker (a verified no-op where it is mounted); the report.
    ``for_task``: a task file's mount (the advice of an error names the task's fields)."""
    from tpufab.steps.host import mount

    return mount.mount(pod.fanout, m.url, at=m.at, driver=m.driver, options=m.options,
                       endpoint=endpoint, for_task=for_task)


def _relative(path: Path | None) -> str:
    if path is None:
        return "-"
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def babysit(settings: Settings, recipe: str | Path, **options: Any) -> BabysitResult:
    """Run ``recipe`` on the pod named by ``settings.name`` through preemptions (see the
    module docstring); raises BabysitError when it ends any other way than finished."""
    return Babysitter(settings, recipe, **options).run()
