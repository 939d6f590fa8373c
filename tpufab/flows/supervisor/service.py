"""The supervisor's service: one process that keeps every job of its bucket going
(`python -m tpufab.flows.supervisor serve --bucket B --name N`; on the supervisor VM a
systemd unit restarts it, docs/supervisor.md).

Every ``poll`` seconds it writes its heartbeat, lists the bucket's jobs, takes the lease of
each live job nobody holds (lease.take_job: one taker wins, its token goes into the state's
``owner``) and runs that job in a thread of its own: the SAME babysit loop as `tpufab
babysit` (flows/babysit/loop.py), with the hooks of flows/babysit/hooks.py wired to the
bucket:

- an attempt is ``planned`` (its run id written, fenced on the lease) before anything of it
  happens on the pod; the attempt before it is marked ended in the same write;
- ``started`` marks it running; ``ended`` marks the job finished;
- ``output`` uploads each worker's lines as chunk objects (the layout `tpufab jobs logs`
  reads), the last chunks before the attempt is marked ended;
- ``go_on`` says stop when the lease is no longer valid (``lost``: touch nothing) or the job
  is asked to stop (``cancel``: stop the run, mark it cancelled).

A job taken over with an attempt planned or running resumes it (hooks.Resume): the run
followed where it is going on the pod, started where it never started. The job's code is a
clone of its commit in a directory of the service's own (from the job's remote, with
TPUFAB_GIT_TOKEN when the job names it as a secret it was handed; for --direct from the
bundle in the bucket), and babysit deploys it from there over SSH (the same deploy path as
the laptop's). None of it prints: the service's log lines go to ``log``.
"""

from __future__ import annotations

import os
import socket
import subprocess
import threading
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tpufab.errors import TpufabError
from tpufab.flows.babysit.hooks import Hooks, Resume, Stopped
from tpufab.flows.supervisor import state as records_
from tpufab.flows.supervisor.lease import (
    DEFAULT_MARGIN,
    DEFAULT_TTL,
    Lease,
    LeaseLost,
    free,
    take_job,
)
from tpufab.flows.supervisor.state import JobSpec, JobState, Records

if TYPE_CHECKING:
    from tpufab.cloud.storage import Storage
    from tpufab.config import Settings
    from tpufab.flows.babysit.records import Attempt as BabysitAttempt

POLL = 5.0              # seconds between looks at the bucket
FLUSH = 2.0             # seconds between uploads of a worker's output
UPLOAD_MAX = 1 << 20    # bytes of output uploaded as one chunk at most
SECRETS_DIR = "/run/tpufab-supervisor/secrets"   # a tmpfs: values handed over, read once
SUPERVISED_JOB = "TPUFAB_SUPERVISED_JOB"   # in every run's environment: the job's id


# -- the output of an attempt, uploaded as chunks -----------------------------------------------


class Upload:
    """One attempt's output sink (``lines``, ``done``, ``close``): each worker's bytes buffered
    and appended as chunk objects every ``every`` seconds and at ``close``. A re-attached
    follower streams the run's log from its start again: the bytes already in the bucket are
    skipped (counted from the chunks' sizes)."""

    def __init__(self, records: Records, job: str, number: int, workers: Sequence[int], *,
                 every: float = FLUSH, log: Callable[[str], None] = lambda _t: None,
                 may_write: Callable[[], bool] = lambda: True):
        from tpufab.cloud.storage import Appender

        self.records = records
        self.may_write = may_write    # False once the job is not ours: nothing more goes up
        self.job = job
        self.number = number
        self.log = log
        self.every = every
        self._lock = threading.Lock()
        self._appenders: dict[int, Appender] = {}
        self._skip: dict[int, int] = {}
        self._buffers: dict[int, bytearray] = {}
        self._refused = False
        for w in workers:
            self._open(w)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True,
                                        name=f"tpufab-upload-{job}-{number}")
        self._thread.start()

    def _open(self, worker: int) -> None:
        from tpufab.cloud.storage import Appender

        prefix = records_.logs_prefix(self.job, self.number, worker)
        blobs = self.records.store.list(self.records.bucket, prefix).blobs
        self._skip[worker] = sum(b.size for b in blobs)
        self._appenders[worker] = Appender(self.records.store, self.records.bucket, prefix)
        self._buffers[worker] = bytearray()

    def lines(self, worker: int, stream: str, data: bytes) -> None:
        if stream != "stdout":
            return        # the follower's own words, not the run's log (they differ per follower)
        with self._lock:
            if worker not in self._appenders:
                self._open(worker)
            skip = self._skip[worker]
            if skip:
                self._skip[worker] = max(0, skip - len(data))
                data = data[skip:]
            self._buffers[worker] += data

    def done(self, result: Any) -> None:
        pass

    def flush(self) -> None:
        from tpufab.cloud.storage import PreconditionFailed, StorageError

        with self._lock:
            pending = {w: bytes(b) for w, b in self._buffers.items() if b}
            for w in pending:
                self._buffers[w].clear()
        if pending and not self.may_write():
            return                    # the next holder uploads them (it skips what is there)
        for w, data in pending.items():
            if self._refused:
                return
            for start in range(0, len(data), UPLOAD_MAX):
                piece = data[start:start + UPLOAD_MAX]
                try:
                    self._appenders[w].append(piece)
                except PreconditionFailed as err:     # another writer: not ours any more
                    self._refused = True
                    self.log(f"output upload stopped: {err}")
                    return
                except StorageError as err:           # an outage: kept for the next flush
                    with self._lock:
                        self._buffers[w][:0] = data[start:]
                    self.log(f"output upload failed, kept for the next try: {err}")
                    break

    def _loop(self) -> None:
        while not self._stop.wait(self.every):
            self.flush()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)
        self.flush()


class LogLines:
    """A file whose whole lines go to ``log`` (babysit's console, into the service's log)."""

    def __init__(self, log: Callable[[str], None]):
        self.log = log
        self._part = ""

    def write(self, text: str) -> int:
        self._part += text
        *lines, self._part = self._part.split("\n")
        for line in lines:
            if line.strip():
                self.log(line.rstrip())
        return len(text)

    def flush(self) -> None:
        pass

    def isatty(self) -> bool:
        return False


# -- the hooks: babysit's steps written to the bucket -------------------------------------------


class JobHooks(Hooks):
    """The babysit hooks of one held job (flows/babysit/hooks.py)."""

    def __init__(self, records: Records, lease: Lease, job: str, *, shutdown: threading.Event,
                 log: Callable[[str], None], flush: float = FLUSH):
        self.records = records
        self.lease = lease
        self.job = job
        self.shutdown = shutdown
        self.cancel = threading.Event()
        self.log = log
        self.flush = flush

    def _update(self, change: Callable[[JobState], JobState]) -> JobState:
        return self.records.update(self.job, change, fence=self.lease.fence)

    def planned(self, number: int, run_id: str, reason: str,
                ended: BabysitAttempt | None) -> None:
        at = self.records.now()

        def change(s: JobState) -> JobState:
            if ended is not None:
                s = ended_in(s, ended, at)
            return records_.plan_attempt(s, run_id, reason, at)

        after = self._update(change)
        if after.current is None or after.current.run_id != run_id:
            self.cancel.set()                  # refused: the job was asked to stop
            raise Stopped("cancel", f"planning attempt {number + 1}")
        self.log(f"{self.job}: attempt {number + 1} planned (run {run_id}, {reason})")

    def started(self, number: int, run_id: str, workers: Sequence[int],
                attached: bool) -> None:
        at = self.records.now()

        def change(s: JobState) -> JobState:
            s = records_.attempt_started(s, run_id, at)
            current = s.current
            if current is not None and current.run_id == run_id and not current.workers:
                s = replace(s, attempts=(*s.attempts[:-1],
                                         replace(current, workers=tuple(workers))))
            if attached:
                s = records_.with_event(s, f"re-attached to run {run_id}", at)
            return s

        self._update(change)
        self.log(f"{self.job}: run {run_id} {'re-attached' if attached else 'started'}")

    def ended(self, attempt: BabysitAttempt, final: str) -> None:
        at = self.records.now()
        self._update(lambda s: records_.finish(ended_in(s, attempt, at), final, at))
        self.log(f"{self.job}: {final}")

    def output(self, number: int, run_id: str, workers: Sequence[int]) -> Upload:
        return Upload(self.records, self.job, number + 1, workers, every=self.flush,
                      log=lambda t: self.log(f"{self.job}: {t}"), may_write=self.lease.valid)

    def go_on(self) -> str | None:
        if self.shutdown.is_set() or not self.lease.valid():
            return "lost"
        if self.cancel.is_set():
            return "cancel"
        return None


def ended_in(state: JobState, attempt: BabysitAttempt, at: str) -> JobState:
    """``state`` with babysit's ``attempt`` (its run) marked ended as it ended."""
    codes = sorted(set(attempt.own_codes.values()))
    exit = codes[0] if len(codes) == 1 else (0 if attempt.outcome == "finished" else None)
    return records_.attempt_ended(state, attempt.run_id, attempt.outcome, at, exit=exit)


def history_of(state: JobState, base: Path) -> list[BabysitAttempt]:
    """The attempts before the current one, as babysit's records (each restart's kind is the
    reason the next one started): a resumed babysit counts them against its budgets."""
    from tpufab.flows.babysit.records import Attempt as BabysitAttempt

    out = []
    done = state.attempts[:-1]
    for i, a in enumerate(done):
        kind = state.attempts[i + 1].reason
        out.append(BabysitAttempt(a.number - 1, a.run_id, a.outcome or "lost", a.reason,
                                  base / f"attempt-{a.number - 1}", restart=kind,
                                  restart_kind=kind))
    return out


# -- the job's code -----------------------------------------------------------------------------


def _git(args: Sequence[str], *, cwd: Path | None = None, env: Mapping[str, str] | None = None,
         what: str) -> None:
    from tpufab.steps.code.gitops import _env

    proc = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True,
                          env=_env(dict(env or {})), timeout=600)
    if proc.returncode != 0:
        why = (proc.stderr or proc.stdout).strip().splitlines()
        raise TpufabError(f"Could not {what}: {why[-1] if why else f'git exit {proc.returncode}'}.")


def token_env(token: str | None) -> dict[str, str]:
    """git's configuration for an HTTPS token, through the environment (never argv)."""
    if not token:
        return {}
    import base64

    basic = base64.b64encode(f"x-access-token:{token}".encode()).decode()
    return {"GIT_CONFIG_COUNT": "1", "GIT_CONFIG_KEY_0": "http.extraHeader",
            "GIT_CONFIG_VALUE_0": f"Authorization: Basic {basic}"}


def checkout(records: Records, spec: JobSpec, base: Path, *, token: str | None = None) -> Path:
    """A clone of the job's commit at ``base/<job>/<repository name>`` (the name the
    laptop's checkout has, so babysit deploys to the same directory on the workers): from the
    bundle in the bucket (--direct) or the job's remote. Reused when it is there already."""
    code = spec.code
    name = code.name or "code"
    target = base / spec.job / name
    if (target / ".git").is_dir():
        head = subprocess.run(["git", "-C", str(target), "rev-parse", "HEAD"],
                              capture_output=True, text=True).stdout.strip()
        if head == code.commit:
            return target
    target.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    partial = target.parent / (name + ".partial")
    if partial.exists():
        import shutil

        shutil.rmtree(partial)
    if target.exists():
        import shutil

        shutil.rmtree(target)
    if code.bundle:
        data, _ = records.store.read(records.bucket, code.bundle)
        bundle = target.parent / "code.bundle"
        bundle.write_bytes(data)
        _git(["init", "--quiet", str(partial)], what=f"make a clone for job {spec.job}")
        _git(["fetch", "--quiet", str(bundle), "+refs/*:refs/remotes/bundle/*"], cwd=partial,
             what=f"fetch job {spec.job}'s bundle")
    elif code.remote:
        _git(["clone", "--quiet", "--no-checkout", code.remote, str(partial)],
             env=token_env(token), what=f"clone {code.remote} for job {spec.job}")
    else:
        raise TpufabError(f"Job {spec.job} names neither a remote nor a bundle for its code.")
    _git(["-c", "advice.detachedHead=false", "checkout", "--quiet", "--detach", code.commit],
         cwd=partial, what=f"check out {code.commit[:12]} for job {spec.job}")
    partial.rename(target)
    return target


# -- one job ----------------------------------------------------------------------------------


@dataclass
class Options:
    poll: float = POLL
    ttl: float = DEFAULT_TTL
    margin: float = DEFAULT_MARGIN
    babysit_poll: float | None = None    # babysit's own poll (None: its default)
    backoff: tuple[float, float] | None = None   # babysit's backoff (None: its default)
    flush: float = FLUSH
    secrets_dir: Path | None = None
    on_vm: bool = False     # the supervisor VM's one service (its unit): see Service


class JobRunner:
    """One held job, in a thread: the lease kept, the babysit loop run with the hooks."""

    def __init__(self, service: Service, lease: Lease, state: JobState):
        self.service = service
        self.lease = lease
        self.job = lease.job
        self.taken = state
        self.hooks = JobHooks(service.records, lease, self.job, shutdown=service.shutdown,
                              log=service.log, flush=service.options.flush)
        self.thread = threading.Thread(target=self._run, daemon=True,
                                       name=f"tpufab-job-{self.job}")
        self.failed = False           # it ended by an error of the supervisor's own

    @property
    def alive(self) -> bool:
        return self.thread.is_alive()

    def start(self) -> None:
        self.thread.start()

    def seen(self, state: JobState) -> None:
        """The service's look at the job's state: a cancel asked is passed on."""
        if state.cancel_requested:
            self.hooks.cancel.set()

    def _run(self) -> None:
        log = self.service.log
        try:
            with self.lease.kept():
                self._babysit()
        except (LeaseLost, Stopped) as err:
            log(f"{self.job}: left ({err})")
        except Exception:  # noqa: BLE001 - the service goes on; the job is taken again
            self.failed = True
            log(f"{self.job}: failed inside the supervisor; released for the next look:\n"
                f"{traceback.format_exc()}")

    def _babysit(self) -> None:
        from tpufab.flows.babysit.loop import Babysitter
        from tpufab.flows.babysit.policy import BabysitError

        records = self.service.records
        take = records_.on_takeover(self.taken)
        if take.action == "nothing":
            return
        spec = records.spec(self.job)
        if spec is None:
            raise TpufabError(f"Job {self.job} has a state but no spec.")
        if take.action == "cancel":
            self._cancel(spec)
            return
        if take.action == "next":
            # unreachable by construction: an attempt's end is written with the next
            # attempt's plan or the job's end, in one write
            self._fail(spec, "the last attempt ended without a decision recorded")
            return
        secrets = self.service.secrets_for(spec)
        if secrets is None:
            self._update(lambda s: records_.with_event(
                s, f"needs secrets ({', '.join(spec.secrets)}): this supervisor keeps them in "
                   "memory only and does not hold them; it waits until they are handed to it "
                   "(docs/supervisor.md, Secrets)", records.now()) if not _waiting(s) else s)
            self.service.log(f"{self.job}: waits for its secrets "
                             f"({', '.join(spec.secrets)})")
            self._wait_for_secrets(spec)
            secrets = self.service.secrets_for(spec)
            if secrets is None:
                return
        base = self.service.workdir
        try:
            code = checkout(records, spec, base / "code", token=secrets.get("TPUFAB_GIT_TOKEN"))
        except TpufabError as err:
            self._fail(spec, str(err))
            return
        settings = self.service.settings_for(spec)
        runs = base / "runs" / self.job
        resume = None
        if take.action == "resume":
            resume = Resume(take.attempt.run_id, history_of(self.taken, runs))
        options = {k: spec.option(k) for k in records_.BABYSIT_OPTIONS
                   if k not in ("direct", "no_deploy", "ray", "ray_options", "setup_script")}
        setup = spec.option("setup_script")
        env = job_env(spec, secrets)
        given = self.service.options
        extra: dict[str, Any] = {} if given.babysit_poll is None else {
            "poll": given.babysit_poll}
        if given.backoff is not None:
            extra["backoff"] = given.backoff
        sitter = Babysitter(settings, code / spec.recipe, args=spec.args, env=env,
                            environment=spec.env_spec(),
                            setup_script=code / setup if setup else None,
                            no_deploy=bool(spec.option("no_deploy")), direct=True,
                            hooks=self.hooks, resume=resume, checkout=code,
                            base_dir=runs, console=self._console(), **options, **extra)
        try:
            sitter.run()
        except Stopped as err:
            if err.why == "cancel":
                self._cancel(spec, sitter.attempts[-1] if sitter.attempts else None)
                return
            raise
        except BabysitError as err:
            if not self.lease.valid():
                raise LeaseLost(str(err)) from None
            self._fail(spec, str(err), sitter.attempts[-1] if sitter.attempts else None)
        except TpufabError as err:
            if not self.lease.valid():
                raise LeaseLost(str(err)) from None
            self._fail(spec, str(err), sitter.attempts[-1] if sitter.attempts else None)

    def _console(self) -> Any:
        """Babysit's notes, into the service's log, each line naming the job."""
        from rich.console import Console

        return Console(file=LogLines(lambda t: self.service.log(f"{self.job}: {t}")),
                       width=200, color_system=None, soft_wrap=True)

    def _wait_for_secrets(self, spec: JobSpec) -> None:
        while not self.service.shutdown.is_set() and self.lease.valid():
            if self.hooks.cancel.is_set():
                self._cancel(spec)
                return
            if self.service.secrets_for(spec) is not None:
                return
            self.service.shutdown.wait(self.service.options.poll)

    def _update(self, change: Callable[[JobState], JobState]) -> JobState:
        return self.service.records.update(self.job, change, fence=self.lease.fence)

    def _fail(self, spec: JobSpec, why: str, last: BabysitAttempt | None = None) -> None:
        at = self.service.records.now()

        def change(s: JobState) -> JobState:
            s = _end_current(s, last, at, "not started")
            return records_.finish(s, "failed", at, why)

        self._update(change)
        self.service.log(f"{self.job}: failed: {why}")

    def _cancel(self, spec: JobSpec, last: BabysitAttempt | None = None) -> None:
        """Stop the job's run on the pod if one may be going, then mark it cancelled."""
        current = self.service.records.state(self.job)
        attempt = current[0].current if current else None
        if attempt is not None and attempt.phase != "ended" and \
                (last is None or last.run_id != attempt.run_id or last.outcome != "cancelled"):
            self.lease.check()
            self.service.stop_run(spec, attempt.run_id)
        at = self.service.records.now()

        def change(s: JobState) -> JobState:
            s = _end_current(s, last, at, "cancelled")
            return records_.finish(s, "cancelled", at, "cancelled as asked")

        self._update(change)
        self.service.log(f"{self.job}: cancelled")


def job_env(spec: JobSpec, secrets: Mapping[str, str]) -> list[str]:
    """The ``--env`` specs of the job's runs: its public variables, its secrets (but the git
    token, the clone's alone) and SUPERVISED_JOB, the job's id, which the run's record on the
    workers keeps, so `tpufab runs`, `logs`, `status` and `kill` name the job (pure)."""
    return [f"{k}={v}" for k, v in spec.env.items() if k != SUPERVISED_JOB] + [
        f"{k}={v}" for k, v in secrets.items() if k != "TPUFAB_GIT_TOKEN"] + [
        f"{SUPERVISED_JOB}={spec.job}"]


def _waiting(state: JobState) -> bool:
    return state.last_event is not None and state.last_event.text.startswith("needs secrets")


def _end_current(state: JobState, last: BabysitAttempt | None, at: str,
                 otherwise: str) -> JobState:
    """The current attempt ended: as babysit's ``last`` says where that is it, else as
    ``otherwise`` (an attempt planned that never ran, or stopped on the way)."""
    current = state.current
    if current is None or current.phase == "ended":
        return state
    if last is not None and last.run_id == current.run_id:
        return ended_in(state, last, at)
    return records_.attempt_ended(state, current.run_id, otherwise, at)


# -- the service ------------------------------------------------------------------------------


class Service:
    """The supervisor process: ``serve()`` until ``shutdown`` is set (SIGTERM).

    ``options.on_vm``: this is the supervisor VM's one service (its systemd unit runs it,
    one main process at a time). Then its lease tokens name the VM (its instance id, which a
    VM recreated under the same name does not share), so that after a crash or a reboot of
    the VM the new process takes its earlier self's leases at once, without waiting for
    them to run out (that process is gone: the unit starts a new one only after the old one
    ended, and a reboot ends them all); and after ``supervisor_idle`` with no live job in
    the bucket it deletes its own VM (vm.IdleWatch, vm.delete_self)."""

    def __init__(self, settings: Settings, bucket: str, name: str, *, store: Storage | None = None,
                 workdir: Path, options: Options | None = None,
                 log: Callable[[str], None] = lambda _t: None):
        from tpufab.cloud.storage import Storage

        self.settings = settings
        self.name = records_.check_supervisor_name(name)
        self.records = Records(store or Storage.from_settings(settings), bucket)
        self.workdir = workdir
        self.options = options or Options()
        self.log = log
        self.shutdown = threading.Event()
        self.jobs: dict[str, JobRunner] = {}
        self.since = time.time()
        self._secrets: dict[str, dict[str, str]] = {}
        self._lock = threading.Lock()
        self._over: set[str] = set()                  # jobs seen final: never read again
        self._retry: dict[str, tuple[int, float]] = {}  # job -> (failures, not before)
        self.instance: str | None = None      # the VM's instance id (options.on_vm)
        self._prefix = ""                     # this process's lease tokens begin so
        self.idle: Any = None                 # vm.IdleWatch (options.on_vm)
        self.deleting: float | None = None
        self.live = 0
        if self.options.on_vm:
            from tpufab.flows.supervisor import vm
            from tpufab.flows.supervisor.state import idle_seconds

            self.instance = vm.instance_id()
            self._prefix = f"vm{self.instance}.{os.urandom(4).hex()}."
            self.idle = vm.IdleWatch(idle_seconds(settings))

    def new_lease(self, job: str) -> Lease:
        token = f"{self._prefix}{os.urandom(12).hex()}" if self._prefix else None
        return Lease(self.records.store, self.records.bucket, job, self.name,
                     ttl=self.options.ttl, margin=self.options.margin, token=token)

    def predecessor(self, record: Any) -> bool:
        """Is ``record`` (a lease) one of an earlier process of this VM's service, which is
        gone (options.on_vm)? Never true off a VM, nor of a lease of another VM."""
        if self.instance is None or record.holder != self.name:
            return False
        return record.token.startswith(f"vm{self.instance}.") and \
            not record.token.startswith(self._prefix)

    # secrets: handed over in files of a tmpfs, read once, kept in memory only
    def read_handed_secrets(self) -> None:
        import json

        folder = self.options.secrets_dir
        if folder is None or not folder.is_dir():
            return
        for path in sorted(folder.glob("job-*.json")):
            try:
                values = json.loads(path.read_text())
            except (OSError, ValueError):
                continue
            finally:
                path.unlink(missing_ok=True)
            if isinstance(values, dict):
                with self._lock:
                    self._secrets[path.stem] = {str(k): str(v) for k, v in values.items()}

    def secrets_for(self, spec: JobSpec) -> dict[str, str] | None:
        """The values of the secrets the job names, or None while any is missing."""
        if not spec.secrets:
            return {}
        self.read_handed_secrets()
        with self._lock:
            held = self._secrets.get(spec.job, {})
        if all(n in held for n in spec.secrets):
            return {n: held[n] for n in spec.secrets}
        return None

    def settings_for(self, spec: JobSpec) -> Settings:
        """The service's settings for the job's pod, logging in there as the laptop does
        (its ``ssh_user``, with the service's own key: the job's runs are the laptop user's,
        so `tpufab runs`, `logs` and `kill` there see them; where OS Login is on, the
        service account's own login); the job's secret names are secrets whatever they look
        like (their values go to the run masked, through stdin)."""
        pod = spec.pod
        environment = spec.env_spec()
        return replace(self.settings, name=pod.name, zone=pod.zone,
                       environment={} if environment is None else environment.setting(),
                       project=pod.project or self.settings.project, control_plane=pod.plane,
                       type=pod.type, ssh_user=pod.ssh_user or self.settings.ssh_user,
                       secrets=[*self.settings.secrets,
                                *(n for n in spec.secrets if n not in self.settings.secrets)])

    def stop_run(self, spec: JobSpec, run_id: str) -> None:
        """Stop ``run_id`` on the job's pod (a cancel), wherever it runs."""
        from tpufab.hosts import connect as pods
        from tpufab.steps.runs import running as jobs

        settings = self.settings_for(spec)
        try:
            pod = pods.shared(settings)
            jobs.stop(pod.fanout, run_id, pod.workers, grace=2.0)
        except TpufabError as err:
            self.log(f"{spec.job}: could not stop run {run_id} ({err}); the pod may be gone")
        finally:
            pods.forget(settings)

    def heartbeat(self) -> None:
        from tpufab import __version__

        with self._lock:
            held = sorted(j for j, r in self.jobs.items() if r.alive)
        self.records.store.put_json(self.records.bucket, records_.heartbeat_name(self.name), {
            "name": self.name, "version": __version__, "host": socket.gethostname(),
            "pid": os.getpid(), "since": self.since, "at": time.time(), "jobs": held,
            "live": self.live, "instance": self.instance, "deleting": self.deleting,
            # where handed secrets go (`tpufab jobs secrets` on this host writes there)
            "secrets_dir": None if self.options.secrets_dir is None else
            str(Path(self.options.secrets_dir).resolve())})

    def tick(self) -> None:
        """One look at the bucket: the heartbeat, cancels passed on, free jobs taken."""
        from tpufab.cloud.storage import StorageError

        try:
            self.heartbeat()
            ids = self.records.job_ids()
        except StorageError as err:
            self.log(f"could not read the bucket ({err}); trying again")
            return
        live, unread = 0, False
        for job in ids:
            if self.shutdown.is_set():
                return
            try:
                live += self._look(job)
            except StorageError as err:
                unread = True
                self.log(f"{job}: could not read it ({err}); trying again")
        self.live = live
        if self.idle is not None and not unread:
            self._idle_end(live)

    def _idle_end(self, live: int) -> None:
        """The VM deleted after ``supervisor_idle`` with no live job (options.on_vm)."""
        from tpufab.flows.supervisor import vm

        if not self.idle.update(live) or self.deleting is not None:
            return
        self.deleting = time.time()
        self.log(f"no live job for {self.idle.idle:g} s (supervisor_idle): deleting this VM")
        try:
            self.heartbeat()            # said before the VM (and this process) goes
            vm.delete_self(self.settings)
        except Exception as err:  # noqa: BLE001 - tried again at the next idle look
            self.deleting = None
            self.log(f"could not delete this VM ({err}); trying again")

    def _look(self, job: str) -> int:
        """One look at ``job``: 1 when it is live (not over), else 0."""
        if job in self._over:
            return 0
        with self._lock:
            runner = self.jobs.get(job)
        found = self.records.state(job)
        if found is None:
            return 0
        state = found[0]
        if runner is not None and runner.alive:
            runner.seen(state)
            return 1
        if state.terminal:
            self._over.add(job)
            return 0
        if runner is not None and runner.failed:   # failed inside: taken again, later
            failures = self._retry.get(job, (0, 0.0))[0] + 1
            self._retry[job] = (failures, time.monotonic() + min(300.0, 2.0 ** failures))
            runner.failed = False
        if time.monotonic() < self._retry.get(job, (0, 0.0))[1]:
            return 1
        lease = self.new_lease(job)
        there = lease.read()
        earlier = there is not None and self.predecessor(there[0])
        if there is not None and not earlier and \
                not free(there[0], lease.clock(), lease.margin):
            return 1
        taken = take_job(self.records, lease, dead=self.predecessor)
        if taken is None:
            return 1
        since = ", from this VM's earlier service" if earlier else ""
        self.log(f"{job}: taken ({records_.on_takeover(taken).action}{since})")
        runner = JobRunner(self, lease, taken)
        with self._lock:
            self.jobs[job] = runner
        runner.start()
        return 1

    def serve(self) -> None:
        self.log(f"supervisor {self.name} serving gs://{self.records.bucket}")
        while not self.shutdown.is_set():
            self.tick()
            self.shutdown.wait(self.options.poll)
        with self._lock:
            runners = list(self.jobs.values())
        for runner in runners:
            runner.thread.join(timeout=self.options.ttl)
        self.log(f"supervisor {self.name} stopped")
