"""`tpufab babysit RECIPE`: run a recipe on the pod and keep it running through preemptions.

Each attempt is an ordinary run (started the one way every job starts, then followed). While
it runs, the API is polled; a node that is PREEMPTED or TERMINATED, gone, or whose queued
resource is SUSPENDED or FAILED (or workers that stay unreachable while the API still says
READY) means the attempt was lost to the platform: whatever logs are reachable are copied to
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
stall watchdog (steps/start/stall.py) watches each attempt: on a stall every worker's stacks
go into the attempt's logs and the folded summary is printed; then ``stall_action`` wait (the
default), kill (babysit ends, exit 124) or restart (the attempt is stopped and the next one
starts, counted as ``stalled``: not against the error budget, only ``max_restarts``). One
babysit per node on this machine (a lock file holds the babysitter's pid), and, as for every
job, none beside a running run on the pod (the code lease and the one-job check of the start
path: another machine's babysit is refused there).

The decisions are pure (``policy``); the records are ``records``; ``Babysitter`` applies the
decisions in this loop, with its ``recover`` part (recreate, restore) and its ``attempt``
part (start, watch).
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tpufab import nodeset
from tpufab.errors import ApiError, ConfigError, shown
from tpufab.flows.babysit.attempt import Attempts
from tpufab.flows.babysit.hooks import Hooks, Resume, Stopped
from tpufab.flows.babysit.policy import (
    DEFAULT_BACKOFF,
    DEFAULT_CREATE_ATTEMPTS,
    DEFAULT_FAILURE_GRACE,
    DEFAULT_MAINTENANCE_MARGIN,
    DEFAULT_MAINTENANCE_POLL,
    DEFAULT_POLL,
    DEFAULT_UNREACHABLE_GRACE,
    EXIT_STALLED,
    BabysitError,
    api_reason,
    backoff_delay,
    exit_codes,
    recovery_reason,
    restart_budget,
    signal_name,
)
from tpufab.flows.babysit.records import (
    Attempt,
    BabysitResult,
    by_reason,
    counts_text,
    restart_counts,
    shown_path,
)
from tpufab.flows.babysit.recover import NodeSpec, Recovery, Restore, setup_hash

if TYPE_CHECKING:
    from rich.console import Console

    from tpufab.cloud.nodes import Node, QueuedResourceInfo
    from tpufab.cloud.planes.base import ControlPlane
    from tpufab.config import Settings
    from tpufab.steps.host.environment import EnvSpec


# One babysitter per node (on this machine)


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


class Babysitter(Recovery, Attempts):
    """Runs the attempts; every side effect goes through the pod's fan-out, the control plane
    and the library steps (lifecycle, the one start path, deploy, mount, jobs). What it
    shows goes to the caller's sinks: ``console`` hears its notes (and lifecycle's), ``view``
    (``workers -> sink``) gives the live view of each attempt's lines, ``out(line)`` hears a
    Ray job's; none given: nothing is shown (the logs are copied under ``base_dir`` either
    way)."""

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
                 view: Callable[[Sequence[int]], Any] | None = None,
                 out: Callable[[str], None] | None = None, base_dir: Path | None = None,
                 sleep: Callable[[float], None] | None = None, timeout: float | None = None,
                 stall: str | float | None = None, stall_action: str | None = None,
                 stall_progress_file: str | None = None,
                 ray: bool = False, ray_options: Sequence[str] = (),
                 hooks: Hooks | None = None, resume: Resume | None = None,
                 checkout: Path | None = None, step_pattern: str | None = None,
                 environment: EnvSpec | None | str = "configured"):
        from tpufab.cloud import names, planes
        from tpufab.steps.runs.stragglers import check_pattern
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
        self.step_pattern = None if step_pattern is None else check_pattern(step_pattern)
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
            from rich.console import Console

            console = Console(quiet=True)
        self.console = console
        self.view = view
        self.out = out
        self.base_dir = base_dir
        self._stop = threading.Event()
        self.sleep = sleep or (lambda s: self._stop.wait(s))
        self.spec: NodeSpec | None = None
        self._watched_ids: set[str] = set()   # node ids a recovery may delete
        self.restore = Restore()
        from tpufab.steps.host.environment import env_spec

        # the environment is read now (a file not there is a sentence before anything runs),
        # and a recovery builds that one, whatever the files say by then; ``environment``
        # given: that one, read elsewhere (a supervised job's, as its laptop read it)
        self.restore.environment = env_spec(settings) if isinstance(environment, str) \
            else environment
        self.root: Path | None = None
        self.attempts: list[Attempt] = list(resume.history) if resume else []
        self.log_dir: Path | None = None
        # the caller's hooks (hooks.py: the supervisor's); none: babysit as it always was
        self.hooks = hooks or Hooks()
        self.resume = resume
        self.checkout = checkout          # the checkout to deploy (None: the one here)
        if resume is not None:            # the restarts so far count against the budgets
            self.errors_used = sum(1 for a in self.attempts if a.restart_kind == "error")

    # -- small helpers ------------------------------------------------------------------------
    def note(self, text: str, style: str | None = None) -> None:
        self.console.print(text, markup=False, style=style)

    def go_on(self, step: str) -> None:
        """Before each step that acts on the pod: Stopped when the caller's hooks say stop."""
        why = self.hooks.go_on()
        if why is not None:
            raise Stopped(why, step)

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
        from tpufab.steps.runs.env import new_run_id

        restarts = len(self.attempts)     # resumed: the attempts before it were restarts
        needs_recovery = False
        attach = self.resume.run_id if self.resume is not None else None
        run_id = attach or new_run_id()
        if attach is None:
            self.hooks.planned(len(self.attempts), run_id, "first", None)
        self._first_run_id = self.attempts[0].run_id if self.attempts else run_id
        while True:
            if needs_recovery:
                self._recover(self.attempts[-1].reason)
            attempt = self._attempt(len(self.attempts), restarts, run_id, attach=attach)
            attach = None
            self.attempts.append(attempt)
            self._write_summary()
            if attempt.outcome == "cancelled":
                raise Stopped("cancel", f"attempt {attempt.number}'s end")
            if attempt.outcome == "finished":
                self.hooks.ended(attempt, "finished")
                self.note(f"babysit: run {self.base_run_id} finished after "
                          f"{counts_text(self.attempts)}. Logs: {shown_path(self.log_dir)}/.")
                return BabysitResult(self.base_run_id, self.attempts, 0, self.log_dir)
            why, kind = self._why_restart(attempt)
            if restarts >= self.max_restarts:
                self._write_summary()
                raise BabysitError(
                    f"Gave up after {restarts} restart{'s' if restarts != 1 else ''} "
                    f"(--max-restarts {self.max_restarts}; {by_reason(self.attempts)}): the "
                    f"last attempt "
                    f"{attempt.outcome} ({attempt.reason}). Logs: {shown_path(self.log_dir)}/.",
                    exit_code=self._exit_code(attempt))
            restarts += 1
            attempt.restart, attempt.restart_kind = why, kind
            self._write_summary()
            run_id = new_run_id()         # kept (planned) before the node is recovered for it
            self.hooks.planned(len(self.attempts), run_id, kind, attempt)
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
                f"instead). Logs: {shown_path(attempt.log_dir)}/.",
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
            f"Logs: {shown_path(attempt.log_dir)}/.", exit_code=self._exit_code(attempt))

    @staticmethod
    def _exit_code(attempt: Attempt) -> int:
        codes = {int(c.split()[1]) for c in attempt.states.values()
                 if c.startswith("exited ") and c.split()[1].isdigit() and c != "exited 0"}
        return codes.pop() if len(codes) == 1 else 1

    # -- before the first attempt -------------------------------------------------------------
    def _deploy_first(self) -> None:
        """Like `run`: under the lease every job's start holds, refused beside a running run
        (before anything is said or changed), this checkout's HEAD deployed (unless
        no_deploy); remember it."""
        from tpufab.steps.code import gitops
        from tpufab.steps.start import starting

        ask = None
        if self.resume is not None:
            pod = self._pod()
            if self._going(pod, self.resume.run_id, pod.workers):
                # re-attaching: the run has its code (captured); a recovery redeploys it
                self.root = gitops.repo_root(self.checkout) if self.checkout else None
                return
        if not self.no_deploy and self.checkout is not None:   # a checkout of the caller's
            ask = starting.DeployAsk(gitops.repo_root(self.checkout), self.settings.remote_dir,
                                     self.direct)
            self.root = ask.root
        elif not self.no_deploy:
            ask = starting.deploy_ask(self.settings, direct=self.direct, what=self.recipe.name,
                                      progress=self.note)
            self.root, self.direct = ask.root, ask.direct
        elif self.restore.commit:
            try:
                self.root = gitops.repo_root()
            except gitops.GitError:
                self.root = None
        pod = self._pod()
        with starting.job_lease(pod, verb="babysit", what=self.recipe.name,
                                timeout=self.timeout):
            if ask is not None:
                self.go_on("deploy")
                report = starting.deploy_for_job(pod, ask, timeout=self.timeout,
                                                 progress=self.note)
                self.restore.commit, self.restore.deploy_dir = report.commit, report.dir

    # -- recovery: the Recovery part recreates and restores ----------------------------------
    def _recover(self, reason: str) -> None:
        if "maximum run duration" in reason and not self.settings.flex_start_renew:
            self._write_summary()
            raise BabysitError(
                f"babysit stops: flex-start slice {self.name} ended (its maximum run duration "
                f"ran out and Compute Engine deleted its VMs) after "
                f"{counts_text(self.attempts)}; set flex_start_renew: true (tpufab.yaml, or "
                "TPUFAB_FLEX_START_RENEW=1) to have babysit make a new flex-start request "
                f"instead. Logs: {shown_path(self.log_dir)}/.")
        self.go_on("recovering the node")
        if "maximum run duration" in reason:
            self.note(f"babysit: {reason}: making a new flex-start request for {self.name} "
                      "(flex_start_renew).", "yellow")
        self._recreate(reason)
        self._restore()

    # -- the attempts: the Attempts part runs and watches each ----------------------------
    @property
    def base_run_id(self) -> str:
        return self.attempts[0].run_id if self.attempts else self._first_run_id

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


def babysit(settings: Settings, recipe: str | Path, **options: Any) -> BabysitResult:
    """Run ``recipe`` on the pod named by ``settings.name`` through preemptions (see the
    module docstring); raises BabysitError when it ends any other way than finished."""
    return Babysitter(settings, recipe, **options).run()
