"""The laptop's side of `tpufab babysit --remote` (``Pod.babysit(..., remote=True)``): the job
checked as babysit checks it, its exact commit made reachable without the laptop (on its
remote, or for --direct a bundle in the bucket), the bucket made if missing, the supervisor
made sure of (tpufab.flows.supervisor.vm, where it exists), then the job's spec and state
written; nothing else is left behind when a step fails (nothing half-made)."""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tpufab.errors import ConfigError, shown
from tpufab.flows.supervisor import state as records_

if TYPE_CHECKING:
    from tpufab.config import Settings
    from tpufab.flows.supervisor.state import JobSpec


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
    spec = records_.job_spec(settings, job, recipe_in, code=code, args=args, env=env,
                             options={**options, "direct": direct})
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
    handed = _hand_secrets(settings, spec, env, console) if spec.secrets else True
    return HandedOver(job=job, bucket=bucket, spec=spec, supervisor=supervisor,
                      created_bucket=created, secrets_handed=handed)


def hand_over_call(settings: Settings, recipe: str | Path, args: Sequence[str],
                   env: Sequence[str] | None, console: Any,
                   given: Mapping[str, Any]) -> HandedOver:
    """``Pod.babysit(..., remote=True)``: its parameters (``given``) as babysit's options."""
    return hand_over(settings, recipe, args=args, env=list(env or ()), console=console,
                     options={k: given[k] for k in records_.BABYSIT_OPTIONS if k in given})


def _hand_secrets(settings: Settings, spec: JobSpec, env: Sequence[str],
                  console: Any) -> bool:
    """The values of the job's secrets, from here, to the supervisor over its own channel
    (tpufab.flows.supervisor.vm.hand_secrets: SSH into a tmpfs file the service reads once
    and deletes); never into the bucket. False where there is no such channel here."""
    from tpufab.steps.runs.env import forwarded_for

    try:
        from tpufab.flows.supervisor import vm  # type: ignore[attr-defined]
    except ImportError:
        return False
    give = getattr(vm, "hand_secrets", None)
    if give is None:
        return False
    values = dict(forwarded_for(settings, env).secrets)
    give(settings, spec.job, values, console=console)
    return True


def _ensure_supervisor(settings: Settings, console: Any) -> str | None:
    """The supervisor VM made sure of (tpufab.flows.supervisor.vm.ensure); None with the
    setting ``supervisor_vm: false`` (a service the user runs on a machine of their own,
    `python -m tpufab.flows.supervisor serve`, takes the job from the bucket)."""
    if not settings.supervisor_vm:
        return None
    from tpufab.flows.supervisor import vm

    vm.ensure(settings, console=console)
    return settings.supervisor_name
