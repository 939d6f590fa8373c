"""The supervisor's records in its bucket: where each lives, what each holds, how each changes.

    gs://BUCKET/tpufab/jobs/<job>/spec.json        what to run; written once (ifGenerationMatch=0)
    gs://BUCKET/tpufab/jobs/<job>/state.json       how it goes; each write conditional on the
                                                   generation it was computed from
    gs://BUCKET/tpufab/jobs/<job>/lease.json       the supervisor holding the job (lease.py)
    gs://BUCKET/tpufab/jobs/<job>/logs/<attempt>/w<N>/<chunk>.log   each worker's output
    gs://BUCKET/tpufab/jobs/<job>/code.bundle      --direct: a git bundle of the commit
    gs://BUCKET/tpufab/supervisor/<name>.json      a supervisor's heartbeat
    gs://BUCKET/tpufab/supervisor/wheels/<wheel>   the laptop's own tpufab

The spec (``JobSpec``) holds public values only: environment variables whose names are
secrets (tpufab.quoting.is_secret_name, ``--secret``, the ``secrets`` setting) are kept by
name, a repository URL without its credentials, and it refuses to be built otherwise. The
state (``JobState``) changes only through the pure transitions below, each a function of the
record read, and ``Records.update`` writes the result only over the generation it was
computed from: a writer that read an older record gets 412 and computes again from the newer
one (or stops, when its ``fence`` says the job is no longer its own: the lease's token in
``owner`` is the fencing token, lease.py).
"""

from __future__ import annotations

import re
import secrets as _random
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

from tpufab.errors import ConfigError, TpufabError, shown

if TYPE_CHECKING:
    from tpufab.cloud.storage import Storage
    from tpufab.config import Settings
    from tpufab.steps.host.environment import EnvSpec

ROOT = "tpufab/"
JOBS = ROOT + "jobs/"
SUPERVISORS = ROOT + "supervisor/"
WHEELS = SUPERVISORS + "wheels/"
SPEC_VERSION = 2        # 2: the spec carries the job's environment; one without is still 1
STATE_VERSION = 1
BUCKET_SUFFIX = "-tpufab"
STATES = ("queued", "starting", "running", "recovering", "finished", "failed", "cancelled")
TERMINAL = frozenset({"finished", "failed", "cancelled"})
PHASES = ("planned", "running", "ended")    # an attempt's: its run id is kept before it starts
EVENTS_KEPT = 50
UPDATE_TRIES = 20
_JOB_ID = re.compile(r"^job-\d{8}-\d{6}-[0-9a-f]{4}$")
_INSTANCE_NAME = re.compile(r"^[a-z]([-a-z0-9]{0,61}[a-z0-9])?$")

# Every babysit option a job carries, with babysit's default (tpufab.Pod.babysit's; a test
# keeps the two the same). The recipe, its arguments and the environment are fields of their own.
BABYSIT_OPTIONS: dict[str, Any] = {
    "max_restarts": 3, "restart_on_failure": False, "max_restarts_on_errors": 0,
    "restart_on_exit": "", "before_maintenance": None, "maintenance_margin": "10m",
    "setup_script": None, "no_deploy": False, "direct": False, "timeout": None,
    "stall": None, "stall_action": "wait", "stall_progress_file": None, "ray": False,
    "ray_options": "", "step_pattern": None,
}


class UnknownJob(ConfigError):
    """No such job in the bucket."""


class BucketMissing(TpufabError):
    """The supervisor's bucket does not exist (no job was ever handed over there)."""


def now_text(now: datetime | None = None) -> str:
    """An instant as the records write it: ``2026-12-01T22:10:00Z`` (UTC, seconds)."""
    return (now or datetime.now(timezone.utc)).astimezone(timezone.utc).strftime(
        "%Y-%m-%dT%H:%M:%SZ")


# -- the layout -------------------------------------------------------------------------------


def job_prefix(job: str) -> str:
    return f"{JOBS}{job}/"


def spec_name(job: str) -> str:
    return job_prefix(job) + "spec.json"


def state_name(job: str) -> str:
    return job_prefix(job) + "state.json"


def lease_name(job: str) -> str:
    return job_prefix(job) + "lease.json"


def bundle_name(job: str) -> str:
    return job_prefix(job) + "code.bundle"


def logs_prefix(job: str, attempt: int | None = None, worker: int | None = None) -> str:
    """``.../logs/``, one attempt's ``.../logs/<attempt>/``, or one worker's chunks'."""
    out = job_prefix(job) + "logs/"
    if attempt is not None:
        out += f"{attempt}/"
        if worker is not None:
            out += f"w{worker}/"
    return out


def heartbeat_name(supervisor: str) -> str:
    return f"{SUPERVISORS}{supervisor}.json"


def wheel_name(filename: str) -> str:
    return WHEELS + filename


def new_job_id(now: datetime | None = None) -> str:
    """``job-20261201-221000-ab12``: sortable by when it was handed over."""
    from tpufab.steps.runs.env import new_run_id

    return "job-" + new_run_id(now)


def check_job_id(text: str) -> str:
    if not _JOB_ID.match(text or ""):
        raise ConfigError(f"{shown(text)} is not a job id (they look like "
                          "job-20261201-221000-ab12; `tpufab jobs` lists them).")
    return text


def bucket_for(settings: Settings) -> str:
    """The supervisor's bucket: ``supervisor_bucket`` (``gs://`` optional), else one named
    after the project (``<project>-tpufab``)."""
    from tpufab.cloud.storage import check_bucket_name

    given = settings.supervisor_bucket
    if given:
        name = given.strip()
        name = name[len("gs://"):] if name.startswith("gs://") else name
        return check_bucket_name(name.rstrip("/"), "supervisor_bucket")
    project = settings.project
    if not project:
        raise ConfigError("No project given, so there is no supervisor bucket to read: pass "
                          "--project, set TPUFAB_PROJECT, or name the bucket with "
                          "supervisor_bucket (TPUFAB_SUPERVISOR_BUCKET).")
    # a domain-scoped project (example.com:proj) has characters a bucket name cannot
    name = re.sub(r"[^a-z0-9-]+", "-", project.lower()).strip("-") + BUCKET_SUFFIX
    return check_bucket_name(name, f"the bucket named after project {project} ({name}); "
                                   "set supervisor_bucket instead")


def idle_seconds(settings: Settings) -> float:
    """``supervisor_idle`` in seconds (how long the supervisor stays with no live job)."""
    from tpufab.durations import parse_duration

    seconds = parse_duration(str(settings.supervisor_idle), "supervisor_idle")
    if not seconds or seconds <= 0:
        raise ConfigError(f"supervisor_idle must be a duration above 0 such as 30m or 1h, "
                          f"not {shown(settings.supervisor_idle)}.")
    return seconds


def check_supervisor_name(name: str) -> str:
    if not _INSTANCE_NAME.match(name or ""):
        raise ConfigError(f"supervisor_name: {shown(name)} is not a Compute Engine instance "
                          "name (1-63 lower-case letters, digits and dashes, starting with a "
                          "letter, not ending with a dash).")
    return name


# -- the spec ---------------------------------------------------------------------------------


def _readable(data: Mapping[str, Any], kind: str, version: int, oldest: int | None = None
              ) -> None:
    found = data.get("version")
    if not isinstance(found, int) or not (oldest or version) <= found <= version:
        raise TpufabError(f"Job {data.get('job')}'s {kind} is version {data.get('version')}, "
                          f"which this tpufab ({kind} version {version}) cannot read; "
                          "upgrade tpufab.")


@dataclass(frozen=True)
class PodRef:
    """The pod a job runs on."""

    name: str
    zone: str
    project: str | None = None
    plane: str | None = None        # "tpu" or "compute"; None: by the accelerator type
    type: str | None = None
    ssh_user: str | None = None     # the laptop's login there: the supervisor's runs are its


@dataclass(frozen=True)
class Code:
    """The exact commit a job deploys: fetched from ``remote`` (a URL without credentials),
    or for --direct from ``bundle`` (an object of the job's)."""

    commit: str
    remote: str | None = None
    bundle: str | None = None
    name: str | None = None     # the checkout's folder name (the workers' deploy directory)

    def __post_init__(self) -> None:
        if self.remote is not None:
            from tpufab.steps.code.gitops import without_credentials

            if without_credentials(self.remote)[1] is not None:
                raise ValueError("a job's code names its remote without credentials")

    @classmethod
    def of(cls, commit: str, *, remote: str | None = None, bundle: str | None = None,
           name: str | None = None) -> Code:
        """Its remote's URL without any userinfo (a token there would go into the bucket)."""
        if remote is not None:
            from tpufab.steps.code.gitops import without_credentials

            remote = without_credentials(remote)[0]
        return cls(commit=commit, remote=remote, bundle=bundle, name=name)


@dataclass(frozen=True)
class JobSpec:
    """What a supervisor runs: written once when the job is handed over."""

    job: str
    pod: PodRef
    recipe: str
    code: Code
    args: tuple[str, ...] = ()
    options: Mapping[str, Any] = field(default_factory=dict)
    env: Mapping[str, str] = field(default_factory=dict)     # public values only
    secrets: tuple[str, ...] = ()                             # names only, never values
    tpufab_version: str = ""
    created_at: str = ""
    user: str = ""
    # the `environment:` the laptop configured, read at the hand-over
    # (tpufab.steps.host.environment.EnvSpec.to_record): its runs get VIRTUAL_ENV, and a
    # recovery builds it on the new workers before the recipe, as babysit's does
    environment: Mapping[str, Any] | None = None
    version: int = SPEC_VERSION

    def __post_init__(self) -> None:
        from tpufab.quoting import is_secret_name

        unknown = sorted(set(self.options) - set(BABYSIT_OPTIONS))
        if unknown:
            raise ValueError(f"not babysit options: {', '.join(unknown)}")
        hidden = [k for k in self.env if is_secret_name(k, self.secrets)]
        if hidden:
            raise ValueError(f"secret values do not go into a job's spec: {', '.join(hidden)}")

    def option(self, name: str) -> Any:
        return self.options.get(name, BABYSIT_OPTIONS[name])

    def to_record(self) -> dict:
        out = asdict(self)
        out["args"] = list(self.args)
        out["secrets"] = list(self.secrets)
        out["options"] = dict(self.options)
        out["env"] = dict(self.env)
        return out

    @classmethod
    def from_record(cls, data: Mapping[str, Any]) -> JobSpec:
        _readable(data, "spec", SPEC_VERSION, oldest=1)
        return cls(job=data["job"], pod=PodRef(**data["pod"]), recipe=data["recipe"],
                   code=Code(**data["code"]), args=tuple(data.get("args") or ()),
                   options=dict(data.get("options") or {}), env=dict(data.get("env") or {}),
                   secrets=tuple(data.get("secrets") or ()),
                   tpufab_version=data.get("tpufab_version", ""),
                   created_at=data.get("created_at", ""), user=data.get("user", ""),
                   environment=data.get("environment"), version=data["version"])

    def env_spec(self) -> EnvSpec | None:
        """The job's environment (None: it has none)."""
        from tpufab.steps.host.environment import EnvSpec

        return None if self.environment is None else EnvSpec.from_record(self.environment)


def job_spec(settings: Settings, job: str, recipe: str, *, code: Code,
             args: Sequence[str] = (), env: Iterable[str] | None = None,
             secret: Iterable[str] | None = None, options: Mapping[str, Any] | None = None,
             now: datetime | None = None, user: str | None = None,
             environment: EnvSpec | None = None) -> JobSpec:
    """A job's spec from babysit's flags: ``env``/``secret`` as ``--env``/``--secret`` take
    them (with the ``env`` setting's and the always-forwarded variables), split by the one
    secret rule into the public values kept and the secret names kept without their values."""
    import getpass

    from tpufab import __version__
    from tpufab.steps.runs.env import forwarded_for

    forwarded = forwarded_for(settings, env, secret)
    if user is None:
        try:
            user = getpass.getuser()
        except Exception:  # noqa: BLE001 - no passwd entry (containers)
            user = ""
    return JobSpec(job=job, pod=PodRef(name=settings.require("name"), zone=settings.zone,
                                       project=settings.project,
                                       plane=settings.control_plane, type=settings.type,
                                       ssh_user=settings.ssh_user),
                   recipe=str(recipe), code=code, args=tuple(args),
                   options={k: v for k, v in (options or {}).items()
                            if v != BABYSIT_OPTIONS.get(k, object())},
                   env=dict(forwarded.public), secrets=tuple(sorted(forwarded.secrets)),
                   tpufab_version=__version__, created_at=now_text(now), user=user,
                   environment=None if environment is None else environment.to_record(),
                   # a job without an environment stays readable by a supervisor of before
                   version=SPEC_VERSION if environment is not None else 1)


# -- the state --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Attempt:
    """One run of the recipe: planned (its run id kept) before it is started on the pod."""

    number: int
    run_id: str
    reason: str                 # why it started: "first", or the restart's kind (preempted,
    #                             maintenance, host failure, error, exit 42, stalled)
    phase: str = "planned"      # planned | running | ended
    planned_at: str = ""
    started_at: str | None = None
    ended_at: str | None = None
    outcome: str | None = None  # finished | failed | preempted | maintenance | stalled | ...
    exit: int | None = None
    workers: tuple[int, ...] = ()


@dataclass(frozen=True)
class Event:
    at: str
    text: str


@dataclass(frozen=True)
class Owner:
    """The supervisor that took the job last, with its lease's token (the fencing token)."""

    holder: str
    token: str


@dataclass(frozen=True)
class JobState:
    job: str
    state: str = "queued"
    attempts: tuple[Attempt, ...] = ()
    cancel_requested: bool = False
    cancel_requested_at: str | None = None
    cancel_requested_by: str | None = None
    owner: Owner | None = None
    events: tuple[Event, ...] = ()
    updated_at: str = ""
    write: str = ""             # the id of the write that made this record (a retried write
    #                             that landed is known by it)
    version: int = STATE_VERSION

    @property
    def terminal(self) -> bool:
        return self.state in TERMINAL

    @property
    def current(self) -> Attempt | None:
        return self.attempts[-1] if self.attempts else None

    @property
    def last_event(self) -> Event | None:
        return self.events[-1] if self.events else None

    @property
    def restarts(self) -> dict[str, int]:
        """Restarts by kind, in the order first seen (babysit's restart_counts)."""
        counts: dict[str, int] = {}
        for a in self.attempts[1:]:
            counts[a.reason] = counts.get(a.reason, 0) + 1
        return counts

    @property
    def preemptions(self) -> int:
        """Restarts the platform caused (preemption, maintenance, host failure, the end of
        a flex-start run): the preemption budget's."""
        from tpufab.flows.babysit.policy import RECOVERY_REASONS

        return sum(n for kind, n in self.restarts.items() if kind in RECOVERY_REASONS)

    @property
    def errors(self) -> int:
        """Restarts after the recipe failed by itself: the error budget's."""
        return self.restarts.get("error", 0)

    def to_record(self) -> dict:
        out = asdict(self)
        out["attempts"] = [{**asdict(a), "workers": list(a.workers)} for a in self.attempts]
        out["events"] = [asdict(e) for e in self.events]
        return out

    @classmethod
    def from_record(cls, data: Mapping[str, Any]) -> JobState:
        _readable(data, "state", STATE_VERSION)
        owner = data.get("owner")
        return cls(job=data["job"], state=data.get("state", "queued"),
                   attempts=tuple(Attempt(**{**a, "workers": tuple(a.get("workers") or ())})
                                  for a in data.get("attempts") or ()),
                   cancel_requested=bool(data.get("cancel_requested")),
                   cancel_requested_at=data.get("cancel_requested_at"),
                   cancel_requested_by=data.get("cancel_requested_by"),
                   owner=Owner(**owner) if owner else None,
                   events=tuple(Event(**e) for e in data.get("events") or ()),
                   updated_at=data.get("updated_at", ""), write=data.get("write", ""))


# -- the transitions (pure: a state in, a state out) --------------------------------------------


def with_event(state: JobState, text: str, at: str) -> JobState:
    """``state`` with one more event; the last EVENTS_KEPT are kept."""
    return replace(state, events=(*state.events, Event(at, text))[-EVENTS_KEPT:])


def queued(job: str, at: str) -> JobState:
    return with_event(JobState(job=job), "handed over", at)


def take_ownership(state: JobState, owner: Owner, at: str) -> JobState:
    """The job is ``owner``'s from now on (it took the lease); a state write of any other
    holder fails its fence from here on."""
    if state.owner == owner:
        return state
    return with_event(replace(state, owner=owner), f"taken by {owner.holder}", at)


def plan_attempt(state: JobState, run_id: str, reason: str, at: str,
                 workers: Sequence[int] = ()) -> JobState:
    """Attempt k+1, with its run id, BEFORE it is started on the pod: whoever takes the job
    after a crash starts or re-attaches to exactly that run. A job that is over or that was
    asked to stop gets no new attempt (the state comes back unchanged)."""
    if state.terminal or state.cancel_requested:
        return state
    current = state.current
    if current is not None and current.phase != "ended":
        raise ValueError(f"attempt {current.number} of {state.job} has not ended")
    attempt = Attempt(number=len(state.attempts) + 1, run_id=run_id, reason=reason,
                      planned_at=at, workers=tuple(workers))
    text = f"attempt {attempt.number} planned (run {run_id}, {reason})"
    return with_event(replace(state, state="starting" if reason == "first" else "recovering",
                              attempts=(*state.attempts, attempt)), text, at)


def attempt_started(state: JobState, run_id: str, at: str) -> JobState:
    current = state.current
    if current is None or current.run_id != run_id or current.phase != "planned":
        return state
    started = replace(current, phase="running", started_at=at)
    return with_event(replace(state, state="running", attempts=(*state.attempts[:-1], started)),
                      f"attempt {current.number} running (run {run_id})", at)


def attempt_ended(state: JobState, run_id: str, outcome: str, at: str, *,
                  exit: int | None = None) -> JobState:
    current = state.current
    if current is None or current.run_id != run_id or current.phase == "ended":
        return state
    ended = replace(current, phase="ended", ended_at=at, outcome=outcome, exit=exit)
    text = f"attempt {current.number} {outcome}" + (f" (exit {exit})" if exit is not None else "")
    return with_event(replace(state, attempts=(*state.attempts[:-1], ended)), text, at)


def finish(state: JobState, final: str, at: str, why: str = "") -> JobState:
    """The job is over: finished, failed or cancelled (a job already over stays as it was)."""
    if final not in TERMINAL:
        raise ValueError(f"{final} is not a final state")
    if state.terminal:
        return state
    return with_event(replace(state, state=final), final + (f": {why}" if why else ""), at)


@dataclass(frozen=True)
class Resume:
    """What a supervisor that takes a job over does first."""

    action: str                 # nothing | cancel | first | resume | next
    attempt: Attempt | None = None


def on_takeover(state: JobState) -> Resume:
    """A job just taken (after a crash, a restart, another supervisor's lease ran out):

    - over: nothing;  asked to stop: cancel (its run stopped first, if one may be running);
    - no attempt yet: the first;
    - the last attempt planned or running: resume it, run id and all (start that run if it
      never started: the worker side refuses a second start of one run id; else re-attach);
    - the last attempt ended: decide on the next as babysit does after an attempt."""
    if state.terminal:
        return Resume("nothing")
    if state.cancel_requested:
        return Resume("cancel", state.current)
    current = state.current
    if current is None:
        return Resume("first")
    if current.phase in ("planned", "running"):
        return Resume("resume", current)
    return Resume("next", current)


@dataclass(frozen=True)
class CancelPlan:
    """What `jobs cancel` does to a job, decided from its state and whether a supervisor
    holds it."""

    action: str         # ended | asked | cancel-now | ask-holder | mark
    holder: str | None = None
    run: Attempt | None = None      # the attempt whose run may still be going on the pod


def cancel_plan(state: JobState, holder: str | None) -> CancelPlan:
    """- over: nothing to do;
    - nothing can be running (no attempt, or the last one ended) and no holder: cancelled now
      (no run starts without a planned attempt, and none is planned once cancel is asked);
    - already asked: nothing more;
    - a holder: ask it (it stops the run on the pod, then marks the job cancelled);
    - no holder but a run may be going: mark it, for the next supervisor to stop."""
    if state.terminal:
        return CancelPlan("ended")
    if holder is None and _live(state) is None:
        return CancelPlan("cancel-now")
    if state.cancel_requested:
        return CancelPlan("asked", holder, _live(state))
    if holder is not None:
        return CancelPlan("ask-holder", holder, _live(state))
    return CancelPlan("mark", None, _live(state))


def _live(state: JobState) -> Attempt | None:
    current = state.current
    return current if current is not None and current.phase != "ended" else None


def request_cancel(state: JobState, holder: str | None, at: str, by: str) -> JobState:
    """``state`` as `jobs cancel` leaves it (cancel_plan decides)."""
    plan = cancel_plan(state, holder)
    if plan.action in ("ended", "asked"):
        return state
    marked = with_event(replace(state, cancel_requested=True, cancel_requested_at=at,
                                cancel_requested_by=by), f"cancel asked by {by}", at)
    if plan.action == "cancel-now":
        return finish(marked, "cancelled", at, "nothing was running")
    return marked


# -- the records in the bucket ------------------------------------------------------------------


class Records:
    """One bucket's supervisor records, read and written with generation preconditions."""

    def __init__(self, store: Storage, bucket: str, *, clock: Callable[[], datetime] | None = None):
        self.store = store
        self.bucket = bucket
        self.clock = clock or (lambda: datetime.now(timezone.utc))

    @classmethod
    def from_settings(cls, settings: Settings) -> Records:
        from tpufab.cloud.storage import Storage

        return cls(Storage.from_settings(settings), bucket_for(settings))

    @property
    def url(self) -> str:
        return f"gs://{self.bucket}"

    def now(self) -> str:
        return now_text(self.clock())

    def check_bucket(self) -> None:
        """BucketMissing when the bucket is not there (a refusal is the storage's sentence)."""
        if self.store.bucket(self.bucket) is None:
            raise BucketMissing(f"The supervisor bucket {self.url} does not exist, so no job "
                                "was handed over there; set supervisor_bucket "
                                "(TPUFAB_SUPERVISOR_BUCKET) if your jobs are in another "
                                "bucket, or pass --project for another project's.")

    def job_ids(self) -> list[str]:
        """Every job in the bucket, oldest first (the ids sort by when they were made)."""
        from tpufab.cloud.storage import StorageNotFound

        try:
            listing = self.store.list(self.bucket, JOBS, delimiter="/")
        except StorageNotFound:
            self.check_bucket()
            raise
        return sorted(p[len(JOBS):].rstrip("/") for p in listing.prefixes)

    def find(self, text: str) -> str:
        """The job ``text`` names: its id, or the unique job whose id it begins or ends
        (``ab12``); else UnknownJob, one sentence."""
        if _JOB_ID.match(text or "") and self.state(text) is not None:
            return text
        ids = self.job_ids()
        found = [j for j in ids if text and (j.startswith(text) or j.endswith(text))]
        if len(found) == 1:
            return found[0]
        if len(found) > 1:
            raise UnknownJob(f"{shown(text)} names {len(found)} jobs in {self.url} "
                             f"({', '.join(found[:3])}{', ...' if len(found) > 3 else ''}); "
                             "give more of the id.")
        raise UnknownJob(f"No job {shown(text)} in {self.url}; `tpufab jobs` lists the jobs "
                         "there.")

    def spec(self, job: str) -> JobSpec | None:
        found = self.store.read_json(self.bucket, spec_name(job))
        return JobSpec.from_record(found[0]) if found else None

    def state(self, job: str) -> tuple[JobState, int] | None:
        """The job's state and the generation it is at, or None."""
        found = self.store.read_json(self.bucket, state_name(job))
        return (JobState.from_record(found[0]), found[1].generation) if found else None

    def create(self, spec: JobSpec) -> JobState:
        """Write a new job's spec, then its state (queued): each only if it does not exist."""
        self.store.put_json(self.bucket, spec_name(spec.job), spec.to_record(),
                            if_generation_match=0)
        first = replace(queued(spec.job, self.now()), updated_at=self.now(),
                        write=_random.token_hex(8))
        self.store.put_json(self.bucket, state_name(spec.job), first.to_record(),
                            if_generation_match=0)
        return first

    def update(self, job: str, change: Callable[[JobState], JobState], *,
               fence: Callable[[JobState], None] | None = None,
               tries: int = UPDATE_TRIES) -> JobState:
        """Read the state, ``change`` it, write it over the generation read; if another writer
        wrote meanwhile (412), read again and change that: no write is ever lost or written
        over a newer one. ``fence(state)`` runs on every record read before anything is
        computed from it: it raises to stop (a supervisor whose lease is gone). Returns the
        state written (or the unchanged one)."""
        from tpufab.cloud.storage import PreconditionFailed, StorageError

        write = _random.token_hex(8)
        for _ in range(tries):
            found = self.state(job)
            if found is None:
                raise UnknownJob(f"No job {job} in {self.url}; `tpufab jobs` lists the jobs "
                                 "there.")
            current, generation = found
            if fence is not None:
                fence(current)
            new = change(current)
            if new == current:
                return current
            new = replace(new, updated_at=self.now(), write=write)
            try:
                self.store.put_json(self.bucket, state_name(job), new.to_record(),
                                    if_generation_match=generation)
                return new
            except PreconditionFailed:
                again = self.state(job)
                if again is not None and again[0].write == write:
                    return again[0]          # ours landed; its answer was lost on the way
        raise StorageError(f"gs://{self.bucket}/{state_name(job)} kept changing under tpufab "
                           f"({tries} tries): other writers change it as fast; try again.")
