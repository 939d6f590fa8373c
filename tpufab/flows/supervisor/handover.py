"""The laptop's side of `tpufab babysit --remote` (``Pod.babysit(..., remote=True)``): the job
checked as babysit checks it, its exact commit made reachable without the laptop (on its
remote, or for --direct a bundle in the bucket), the bucket made if missing, the supervisor
made sure of (tpufab.flows.supervisor.vm, where it exists), then the job's spec and state
written; nothing else is left behind when a step fails (nothing half-made). Then the job's
secret values go to its supervisor (never to the bucket): ``deliver``, which `tpufab jobs
secrets JOB` (``hand_secrets``) calls again after a supervisor restarted."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tpufab.errors import ConfigError, TpufabError, shown
from tpufab.flows.supervisor import state as records_

if TYPE_CHECKING:
    from tpufab.config import Settings
    from tpufab.flows.supervisor.state import JobSpec, Records


@dataclass(frozen=True)
class HandedOver:
    """What `babysit --remote` did: the job, its bucket, and the supervisor made sure of
    (None: no supervisor module here, so none is running for it yet)."""

    job: str
    bucket: str
    spec: JobSpec
    supervisor: str | None
    created_bucket: bool = False
    secrets_handed: bool = True     # False: the job waits (needs secrets) for their values
    secrets_why: str | None = None  # why they were not handed (the sentence that said so)
    exit_code: int = 0

    @property
    def follow(self) -> str:
        return f"tpufab jobs logs {self.job} --follow"

    @property
    def cancel(self) -> str:
        return f"tpufab jobs cancel {self.job}"


def _relative(path: str | Path, root: Path, flag: str) -> str:
    """``path`` as a path inside the checkout ``root`` (the supervisor runs it from its clone
    of the commit), else ConfigError."""
    try:
        return Path(path).resolve().relative_to(root.resolve()).as_posix()
    except ValueError:
        raise ConfigError(f"{flag} {shown(str(path))} is outside the repository {root}, and a "
                          "supervised job runs only what its commit holds: move it into the "
                          "repository and commit it.") from None


def _on_remote(root: Path, commit: str, remote: str) -> bool:
    """Is ``commit`` on ``remote`` (a branch or tag there points at it or at a commit that
    contains it)? Asked with `git ls-remote`; nothing is pushed."""
    from tpufab.steps.code import gitops

    proc = gitops.git(root, "ls-remote", remote, check=False)
    if proc.returncode != 0:
        raise ConfigError(f"Cannot read the git remote {remote} ({proc.stderr.strip()[:200]}), "
                          "so the supervisor could not fetch the job's commit from it: fix "
                          "access, or hand over with --direct (the commit goes into the "
                          "bucket as a bundle).")
    for line in proc.stdout.splitlines():
        sha = line.split("\t", 1)[0].strip()
        if sha == commit:
            return True
        if gitops.git(root, "merge-base", "--is-ancestor", commit, sha,
                      check=False).returncode == 0:
            return True
    return False


def hand_over(settings: Settings, recipe: str | Path, *, args: Sequence[str] = (),
              env: Sequence[str] = (), options: Mapping[str, Any] | None = None,
              console: Any = None, progress: Callable[[str], None] = lambda _t: None,
              cwd: Path | None = None) -> HandedOver:
    """Hand ``recipe`` on the pod ``settings.name`` to the project's supervisor; ``options``
    are babysit's (state.BABYSIT_OPTIONS)."""
    from tpufab.cloud.storage import PreconditionFailed, Storage, StorageError
    from tpufab.flows.babysit.loop import Babysitter
    from tpufab.flows.babysit.recover import NodeSpec
    from tpufab.steps.code import gitops
    from tpufab.steps.health.status import find_nodes

    options = dict(options or {})
    if options.get("ray"):
        raise ConfigError("babysit --remote does not take --ray yet (the supervisor cannot "
                          "re-attach to a Ray job after a restart): babysit --ray from the "
                          "laptop, or drop --ray.")
    if options.get("no_deploy"):
        raise ConfigError("babysit --remote deploys the job's commit from the supervisor (after "
                          "a preemption too), so it does not take --no-deploy: drop it.")
    # babysit's own checks, before anything is made (the same constructor validates)
    sitter = Babysitter(settings, recipe, args=list(args), env=list(env), **options)
    try:
        root = gitops.repo_root(cwd)
    except gitops.GitError:
        raise ConfigError(f"{cwd or Path.cwd()} is not inside a git repository, and a "
                          "supervised job runs a commit: run babysit --remote from your "
                          "project's checkout.") from None
    dirty = gitops.dirty_paths(root)
    if dirty:
        more = f" and {len(dirty) - 3} more" if len(dirty) > 3 else ""
        raise ConfigError(f"Your working tree has uncommitted changes "
                          f"({', '.join(dirty[:3])}{more}), and the supervisor runs a commit, "
                          "never this tree: commit them (and push), then babysit --remote "
                          "again.")
    commit = gitops.resolve(root).commit
    recipe_in = _relative(recipe, root, "The recipe")
    if options.get("setup_script"):
        options["setup_script"] = _relative(options["setup_script"], root, "--setup-script")
    direct = bool(options.get("direct")) or not gitops.has_remote(root, "origin")
    remote = None
    if not direct:
        remote = gitops.remote_url(root, "origin")
        if not _on_remote(root, commit, "origin"):
            raise ConfigError(f"Commit {commit[:12]} is not on the git remote origin, so the "
                              "supervisor could not fetch it: push it (git push), or hand "
                              "over with --direct (the commit goes into the bucket as a "
                              "bundle).")
    nodes, qr = find_nodes(sitter.control, sitter.name)
    NodeSpec.from_api(sitter.name, nodes, qr)      # the pod must exist: one sentence if not
    options.pop("direct", None)

    bucket = records_.bucket_for(settings)
    store = Storage.from_settings(settings)
    records = records_.Records(store, bucket)
    _, created = store.ensure_bucket(bucket, project=settings.require("project"),
                                     location=None)
    if created:
        progress(f"Made the supervisor's bucket gs://{bucket}.")
    supervisor = _ensure_supervisor(settings, console)

    job = records_.new_job_id()
    bundle = records_.bundle_name(job) if direct else None
    code = records_.Code.of(commit, remote=remote, bundle=bundle, name=root.name)
    # the environment as babysit reads it (at its start: here), carried to the supervisor
    spec = records_.job_spec(settings, job, recipe_in, code=code, args=args, env=env,
                             options={**options, "direct": direct},
                             environment=sitter.restore.environment)
    made: list[str] = []
    try:
        if bundle is not None:
            with tempfile.TemporaryDirectory(prefix="tpufab-bundle-") as tmp:
                path = gitops.bundle(root, commit, Path(tmp) / "code.bundle")
                store.put(bucket, bundle, path.read_bytes(),
                          content_type="application/octet-stream", if_generation_match=0)
            made.append(bundle)
        made.append(records_.spec_name(job))
        made.append(records_.state_name(job))
        records.create(spec)
    except BaseException:
        for name in reversed(made):                 # nothing half-made
            try:
                store.delete(bucket, name)
            except (StorageError, PreconditionFailed):
                pass
        raise
    handed, why = _hand_secrets(settings, spec, env, console) if spec.secrets else (True, None)
    return HandedOver(job=job, bucket=bucket, spec=spec, supervisor=supervisor,
                      created_bucket=created, secrets_handed=handed, secrets_why=why)


def hand_over_call(settings: Settings, recipe: str | Path, args: Sequence[str],
                   env: Sequence[str] | None, console: Any,
                   given: Mapping[str, Any]) -> HandedOver:
    """``Pod.babysit(..., remote=True)``: its parameters (``given``) as babysit's options."""
    return hand_over(settings, recipe, args=args, env=list(env or ()), console=console,
                     options={k: given[k] for k in records_.BABYSIT_OPTIONS if k in given})


def _hand_secrets(settings: Settings, spec: JobSpec, env: Sequence[str],
                  console: Any) -> tuple[bool, str | None]:
    """The values of the job's secrets, from here (its ``--env``, the config's env, this
    environment), to its supervisor (``deliver``); never into the bucket. (False, why) when
    they could not be handed now: the job waits for `tpufab jobs secrets JOB`."""
    from tpufab.steps.runs.env import forwarded_for

    known = {**{k: v for k, v in os.environ.items() if k in spec.secrets},
             **forwarded_for(settings, env).secrets}
    values = {n: known[n] for n in spec.secrets if n in known}
    if len(values) < len(spec.secrets):
        missing = [n for n in spec.secrets if n not in values]
        return False, f"{', '.join(missing)} not set here"
    records = records_.Records.from_settings(settings)
    try:
        deliver(settings, records, spec.job, values, holder=None)
    except TpufabError as err:
        return False, str(err)
    return True, None


# -- secrets: handed to the supervisor that holds the job, never to the bucket ----------------

LIVE_BEAT = 60.0        # seconds: a heartbeat older than this is a supervisor that is gone
SERVICE_USER = "tpufab-supervisor"   # the supervisor VM's service user (vm_startup.py)

# On the supervisor VM: the values (JSON on stdin) into a 0600 file of the service's user in
# its tmpfs folder, under a dot name first, then renamed, so the service (which reads
# ``job-*.json`` once and deletes it) never reads half a file. Only the folder and the job id
# are in argv.
_WRITE = 'umask 077 && cat > "$1/.$2.part" && mv -f "$1/.$2.part" "$1/$2.json"'


def secrets_command(job: str, folder: str, *, user: str = SERVICE_USER) -> str:
    """The command line that writes a job's handed secrets on the supervisor VM (pure)."""
    from tpufab.quoting import command

    records_.check_job_id(job)
    make = command("sudo", "-n", "install", "-d", "-m", "0700", "-o", user, "-g", user,
                   folder)
    write = command("sudo", "-n", "-u", user, "sh", "-c", _WRITE, "sh", folder, job)
    return f"{make} && {write}"


@dataclass(frozen=True)
class SecretsHanded:
    """What `tpufab jobs secrets JOB` did: the names handed (never the values), and where."""

    job: str
    names: tuple[str, ...] = ()
    to: str = ""                    # "the supervisor VM tpufab-supervisor", "supervisor s1 ..."
    over: bool = False              # the job is over: nothing handed
    state: str = ""

    def summary(self) -> str:
        if self.over:
            return f"Job {self.job} is {self.state}, so it needs no secrets any more."
        if not self.names:
            return (f"Job {self.job} needs no secrets (its spec names none), so there is "
                    "nothing to hand.")
        return (f"Handed {', '.join(self.names)} of job {self.job} to {self.to}, which keeps "
                "them in memory only; a job waiting for them goes on at its next look.")


def secret_values(job: str, names: Sequence[str], environ: Mapping[str, str]) -> dict[str, str]:
    """The values of the job's secrets from ``environ``, or ConfigError naming the missing."""
    missing = [n for n in names if not environ.get(n)]
    if missing:
        raise ConfigError(f"Job {job} needs {', '.join(names)} from this machine's environment, "
                          f"and {', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not "
                          f"set: export {' and '.join(missing)} here, then run `tpufab jobs "
                          f"secrets {job}` again.")
    return {n: environ[n] for n in names}


def hand_secrets(settings: Settings, job: str, *,
                 environ: Mapping[str, str] | None = None) -> SecretsHanded:
    """`tpufab jobs secrets JOB`: the values of the secrets the job's spec names, read from
    ``environ`` (this process's environment), handed to its supervisor again (after a
    restart it keeps none and the job waits, "needs secrets")."""
    records = records_.Records.from_settings(settings)
    found = records.find(job)
    spec = records.spec(found)
    state = records.state(found)
    if spec is None or state is None:
        raise records_.UnknownJob(f"Job {found} was handed over only halfway (no "
                                  f"{'spec' if spec is None else 'state'} in {records.url}), "
                                  "so nothing runs it: hand it over again.")
    if state[0].terminal:
        return SecretsHanded(found, over=True, state=state[0].state)
    if not spec.secrets:
        return SecretsHanded(found)
    values = secret_values(found, spec.secrets, os.environ if environ is None else environ)
    holder = state[0].owner.holder if state[0].owner else None
    to = deliver(settings, records, found, values, holder=holder)
    return SecretsHanded(found, tuple(spec.secrets), to=to, state=state[0].state)


def deliver(settings: Settings, records: Records, job: str, values: Mapping[str, str], *,
            holder: str | None) -> str:
    """The values to the supervisor: over SSH into the supervisor VM's tmpfs (``supervisor_vm``),
    else into the secrets folder of the service on this machine that holds the job (its
    heartbeat names its host and folder; with no holder, every live one here). Returns whom;
    TpufabError (one sentence) when no supervisor can be reached from here."""
    if settings.supervisor_vm:
        _over_ssh(settings, job, values)
        return f"the supervisor VM {settings.supervisor_name}"
    beats = _live_heartbeats(records)
    here = socket.gethostname()
    if holder is not None and holder in beats:
        chosen = [beats[holder]]
    else:
        chosen = list(beats.values())
    local = [b for b in chosen if b.get("host") == here and b.get("secrets_dir")]
    if not local:
        elsewhere = sorted({str(b.get("host")) for b in chosen})
        if elsewhere:
            raise TpufabError(
                f"Job {job}'s supervisor runs on {', '.join(elsewhere)}, not on this machine, "
                "and with supervisor_vm false tpufab reaches a service only on its own host: "
                f"run `tpufab jobs secrets {job}` there, with the values in its environment.")
        raise TpufabError(
            f"No supervisor service runs for {records.url} (no heartbeat in the last "
            f"{LIVE_BEAT:g} s), so there is none to hand job {job}'s secrets to: start one "
            f"(`python -m tpufab.flows.supervisor serve --bucket {records.bucket} --name NAME`), "
            f"then run `tpufab jobs secrets {job}` again.")
    for beat in local:
        _into_folder(Path(str(beat["secrets_dir"])), job, values)
    names = ", ".join(str(b.get("name")) for b in local)
    return f"supervisor {names} on this machine"


def _live_heartbeats(records: Records) -> dict[str, dict[str, Any]]:
    """Each supervisor's last heartbeat, of those written in the last LIVE_BEAT seconds."""
    import time

    out: dict[str, dict[str, Any]] = {}
    for blob in records.store.list(records.bucket, records_.SUPERVISORS, delimiter="/").blobs:
        if not blob.name.endswith(".json"):
            continue
        found = records.store.read_json(records.bucket, blob.name)
        beat = found[0] if found else None
        if isinstance(beat, dict) and "pid" in beat and isinstance(beat.get("at"), (int, float)) \
                and time.time() - beat["at"] < LIVE_BEAT and beat.get("name"):
            out[str(beat["name"])] = beat
    return out


def _into_folder(folder: Path, job: str, values: Mapping[str, str]) -> None:
    """A local service's secrets folder: a 0600 file, written whole under a dot name and
    renamed (the service reads ``job-*.json`` once and deletes it)."""
    records_.check_job_id(job)
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    part = folder / f".{job}.{os.getpid()}.part"
    fd = os.open(part, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        with os.fdopen(fd, "w") as fh:
            json.dump(dict(values), fh)
        os.replace(part, folder / f"{job}.json")
    except BaseException:
        part.unlink(missing_ok=True)
        raise


def _over_ssh(settings: Settings, job: str, values: Mapping[str, str]) -> None:
    """The values to the supervisor VM: OpenSSH (its host key pinned), the JSON on stdin."""
    from tpufab.config import timeout_for
    from tpufab.flows.supervisor import vm
    from tpufab.flows.supervisor.service import SECRETS_DIR

    line = secrets_command(job, SECRETS_DIR)
    seconds = timeout_for("jobs secrets")
    with tempfile.TemporaryDirectory(prefix="tpufab-supervisor-ssh-") as folder:
        argv = vm.ssh_argv(settings, [line], known_hosts=Path(folder) / "known_hosts")
        try:
            done = subprocess.run(argv, input=json.dumps(dict(values)), capture_output=True,
                                  text=True, timeout=seconds)
        except subprocess.TimeoutExpired:
            raise TpufabError(f"The supervisor VM {settings.supervisor_name} did not take job "
                              f"{job}'s secrets within {seconds:g} s over SSH: check it "
                              "with `tpufab supervisor status`, then run `tpufab jobs secrets "
                              f"{job}` again.") from None
    if done.returncode != 0:
        why = (done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[-1][:200]
        raise TpufabError(f"Could not hand job {job}'s secrets to the supervisor VM "
                          f"{settings.supervisor_name} over SSH ({why}): check `tpufab "
                          f"supervisor ssh`, then run `tpufab jobs secrets {job}` again.")



def _ensure_supervisor(settings: Settings, console: Any) -> str | None:
    """The supervisor VM made sure of (tpufab.flows.supervisor.vm.ensure); None with the
    setting ``supervisor_vm: false`` (a service the user runs on a machine of their own,
    `python -m tpufab.flows.supervisor serve`, takes the job from the bucket)."""
    if not settings.supervisor_vm:
        return None
    from tpufab.flows.supervisor import vm

    vm.ensure(settings, console=console)
    return settings.supervisor_name
