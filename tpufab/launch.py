"""`tpufab launch TASK.yaml`: from a task file to a finished run in one command.

``plan`` turns a task (``tpufab.taskfile``), the flags and the settings into a ``LaunchPlan``:
the node spec, the environment, the steps. It only reads (the task file, your checkout's
HEAD); ``--dry-run`` prints it. The steps then reuse what the other verbs and babysit do:
``lifecycle.create`` (a READY node of the same spec is reused, another spec under the name is
refused), babysit's ``restore_commit`` / ``restore_mount`` / ``restore_setup`` (deploy, mounts,
setup: each idempotent), a put per file, and a run (``jobs.plan_run``) whose environment also
carries SkyPilot's variables for a SkyPilot task. The order follows SkyPilot's: code and mounts
are in place before ``setup`` runs, in the workdir, so ``pip install -r requirements.txt``
works there.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING

from tpufab.babysit import MountPoint, Restore, setup_hash
from tpufab.config import Settings
from tpufab.errors import ConfigError, TpufabError
from tpufab.quoting import quote
from tpufab.remote_files import RemoteFile
from tpufab.runs import (
    ALWAYS_FORWARDED,
    Forwarded,
    forwarded_environment,
    skypilot_variables,
)
from tpufab.taskfile import Task, resolve_envs

if TYPE_CHECKING:
    from tpufab.jobs import RunPlan
    from tpufab.nodes import Node

RUN_SCRIPT = "task-run.sh"
SETUP_SCRIPT = "task-setup.sh"


class StepFailed(TpufabError):
    """A launch step failed; the message names the step."""


@dataclass(frozen=True)
class LaunchPlan:
    task: Task
    settings: Settings                        # name, type, zone, spot, runtime resolved
    env_specs: tuple[str, ...]                # --env specs for the run (task envs first)
    forwarded: Forwarded
    root: Path | None = None                  # the workdir's git repository
    commit: str | None = None                 # its HEAD, deployed
    branch: str | None = None
    deploy_dir: str | None = None             # where the repository lands on the workers
    run_cwd: str | None = None                # the workdir inside it
    mounts: tuple[MountPoint, ...] = ()
    files: tuple[tuple[str, Path], ...] = ()  # (path on the workers, local file)
    down: bool = False
    detach: bool = False
    idle: float | None = None
    direct: bool = False
    steps: tuple[str, ...] = field(default=())

    @property
    def tier(self) -> str:
        return "spot" if self.settings.spot else "on-demand"

    @property
    def setup_script(self) -> bytes | None:
        if not self.task.setup:
            return None
        lines = ["#!/bin/bash"]
        if self.run_cwd:
            lines.append(f"cd {_shell_path(self.run_cwd)} || exit 1")
        return ("\n".join(lines) + "\n" + self.task.setup.rstrip("\n") + "\n").encode()

    @property
    def run_script(self) -> RemoteFile | None:
        if not self.task.run:
            return None
        data = ("#!/bin/bash\n" + self.task.run.rstrip("\n") + "\n").encode()
        return RemoteFile(RUN_SCRIPT, data, 0o755)

    def restore(self) -> Restore:
        script = self.setup_script
        return Restore(setup_hash=setup_hash(script) if script else None, setup_script=script,
                       setup_name=f"{Path(self.task.path).name} setup" if script else None,
                       commit=self.commit, deploy_dir=self.deploy_dir, mounts=list(self.mounts))


def _shell_path(path: str) -> str:
    """A worker path for a shell line: ``~/x y`` -> ``"$HOME"/'x y'`` (quoted, ~ expanded)."""
    if path == "~":
        return '"$HOME"'
    if path.startswith("~/"):
        return '"$HOME"/' + quote(path[2:])
    return quote(path)


def plan(task: Task, *, settings: Settings, name: str | None = None, type: str | None = None,
         zone: str | None = None, spot: bool = False, version: str | None = None,
         env: Iterable[str] = (), local_env: Mapping[str, str] | None = None,
         cwd: Path | None = None, down: bool = False, detach: bool = False,
         idle: float | None = None, direct: bool = False) -> LaunchPlan:
    """Everything launch will do, decided before anything is touched.

    Flags win, then the task, then the settings (tpufab.yaml, TPUFAB_*): the node is
    ``--name``, else the task's ``name``, else the ``name`` setting.
    """
    from tpufab import gitops, lifecycle
    from tpufab.topology import parse_accelerator_type

    local_env = os.environ if local_env is None else local_env
    cwd = cwd or Path.cwd()
    if down and detach:
        raise ConfigError("--down deletes the node once the run ends, which --detach does not "
                          "wait for: drop one of them (--detach --idle 30m deletes it once "
                          "idle).")
    if not task.run:
        raise ConfigError(f"{task.path} has no run section; a task needs `run:` (the command "
                          "every worker runs).")
    spec = replace(settings, labels={**task.labels, **settings.labels})
    wanted = type or task.type or settings.type
    if not wanted:
        raise ConfigError(f"{task.path} names no TPU type; add `type: v4-32` (SkyPilot: "
                          "resources.accelerators: tpu-v4-32) or pass --type.")
    spec.type = parse_accelerator_type(wanted).name
    spec.zone = zone or task.zone or settings.zone
    spec.spot = True if spot else (task.spot if task.spot is not None else settings.spot)
    spec.runtime_version = version or task.runtime_version or settings.runtime_version
    spec.name = lifecycle.validate_name(name or task.name or settings.name)
    specs = resolve_envs(task, env, local_env)
    configured = [e for e in (*ALWAYS_FORWARDED, *spec.env) if "=" in e or e in local_env]
    forwarded = forwarded_environment([*configured, *specs], local_env,
                                      [*spec.secrets, *task.secret_envs])

    root = commit = branch = deploy_dir = run_cwd = None
    if task.workdir:
        workdir = (cwd / Path(task.workdir).expanduser()).resolve()
        if not workdir.is_dir():
            raise ConfigError(f"{task.path}: workdir {task.workdir} is not a directory here "
                              f"({workdir}).")
        try:
            root = gitops.repo_root(workdir)
        except gitops.GitError:
            raise ConfigError(f"{task.path}: workdir {task.workdir} is not inside a git "
                              "repository; tpufab deploys a commit: `git init && git add -A && "
                              "git commit -m code` there first.") from None
        gitops.refuse_dirty(root)
        resolved = gitops.resolve(root, "HEAD")
        commit, branch = resolved.commit, resolved.branch
        from tpufab import deploy

        deploy_dir = spec.remote_dir or deploy.default_dir(root)
        if not direct and not gitops.git(root, "remote").stdout.split():
            direct = True   # no remote to push to: the commit travels over SSH
        relative = workdir.relative_to(root)
        run_cwd = deploy_dir if str(relative) == "." else \
            str(PurePosixPath(deploy_dir) / relative.as_posix())

    from tpufab import mount as mounting

    mounts = []
    for m in task.mounts:
        driver = m.driver or spec.mount_driver
        checked = mounting.mount_spec(m.source, at=m.at, driver=driver, options=m.options,
                                      endpoint=spec.storage_endpoint)
        mounts.append(MountPoint(checked.url, checked.at, driver, tuple(m.options)))
    files = []
    for f in task.files:
        local = (cwd / Path(f.local).expanduser())
        if local.is_dir():
            raise ConfigError(f"{task.path}: {f.local} (for {f.remote}) is a directory; launch "
                              "copies single files: put the directory in the workdir (it is "
                              "deployed with git) or in a bucket mount.")
        if not local.is_file():
            raise ConfigError(f"{task.path}: {f.local} (for {f.remote}) does not exist here.")
        if not (f.remote.startswith("/") or f.remote.startswith("~")):
            raise ConfigError(f"{task.path}: {f.remote} must be an absolute path on the workers "
                              "(or start with ~/).")
        files.append((f.remote, local))
    result = LaunchPlan(task, spec, tuple(specs), forwarded, root, commit, branch, deploy_dir,
                        run_cwd, tuple(mounts), tuple(files), down, detach, idle, direct)
    return replace(result, steps=tuple(describe_steps(result)))


def describe_steps(p: LaunchPlan) -> list[str]:
    """The plan as numbered lines (``--dry-run``), secrets masked."""
    from tpufab.lifecycle import human_duration
    from tpufab.topology import parse_accelerator_type

    s = p.settings
    shape = parse_accelerator_type(s.type)
    runtime = s.runtime_version or shape.default_runtime
    steps = [f"create {s.name}: {s.type} ({shape.hosts} host{'s' if shape.hosts != 1 else ''}, "
             f"{p.tier}, runtime {runtime}) in {s.zone} (project {s.project}), or reuse it if "
             "it is READY with this spec"]
    if p.idle:
        steps.append(f"autostop: delete {s.name} after {human_duration(p.idle)} idle (a "
                     "watchdog on worker 0)")
    if p.commit:
        how = "over SSH (direct)" if p.direct else "through origin"
        steps.append(f"deploy {p.commit[:12]}" + (f" ({p.branch})" if p.branch else "") +
                     f" of {p.root} to {p.deploy_dir} {how}")
    for m in p.mounts:
        steps.append(f"mount {m.url} at {m.at} ({m.driver})")
    for remote, local in p.files:
        steps.append(f"put {local} at {remote}")
    if p.task.setup:
        steps.append(f"setup ({_lines(p.task.setup)}, once per content) in "
                     f"{p.run_cwd or '~'}")
    env = {**p.forwarded.public, **{k: "***" for k in p.forwarded.secrets}}
    shown = " ".join(f"{k}={v}" for k, v in sorted(env.items())) or "none"
    flavor = " + SKYPILOT_* variables" if p.task.source == "skypilot" else ""
    steps.append(f"run ({_lines(p.task.run)}) on every worker in "
                 f"{p.run_cwd or '~'}; env: {shown}{flavor}")
    if p.detach:
        steps.append("detach: leave it running (follow with `tpufab logs --follow`)")
    else:
        steps.append("follow the logs, exit with the run's exit code")
    if p.down:
        steps.append(f"down: save the logs locally, then delete {s.name}")
    return steps


def _lines(text: str) -> str:
    n = len(text.splitlines())
    return f"{n} line{'s' if n != 1 else ''}"


@contextmanager
def step(name: str):
    """A failure inside names the step (and keeps its exit code)."""
    try:
        yield
    except StepFailed:
        raise
    except TpufabError as err:
        raise StepFailed(f"launch failed at {name}: {err}", details=err.details,
                         exit_code=err.exit_code) from err


def existing_spec_problem(node: Node, p: LaunchPlan) -> str | None:
    """Why an existing node of the same name is not the one the task asks for (pure)."""
    s = p.settings
    wanted_tier = p.tier
    differences = []
    if node.accelerator_type != s.type:
        differences.append(f"it is a {node.accelerator_type}, the task asks for {s.type}")
    have_tier = "spot" if node.tier in ("spot", "preemptible") else "on-demand"
    if node.tier != "reserved" and have_tier != wanted_tier:
        differences.append(f"it is {node.tier}, the task asks for {wanted_tier}")
    if s.runtime_version and node.runtime_version and node.runtime_version != s.runtime_version:
        differences.append(f"it runs {node.runtime_version}, the task asks for "
                           f"{s.runtime_version}")
    if not differences:
        return None
    return (f"TPU node {node.name!r} already exists with another spec ({'; '.join(differences)}); "
            f"launch with another --name, or delete it first (`tpufab delete --name {node.name}`).")


def provision(p: LaunchPlan, *, console=None, control=None, zones: Sequence[str] | None = None,
              retry_for: float | None = None) -> list[Node]:
    """Create the node, or reuse a READY one of the same spec."""
    from tpufab import lifecycle

    control = lifecycle.control_plane(p.settings, control)
    existing = control.find_node(p.settings.name)
    if existing is not None:
        problem = existing_spec_problem(existing, p)
        if problem:
            raise ConfigError(problem)
    return lifecycle.create(p.settings, console=console, control=control, zones=zones,
                            retry_for=retry_for)


def put_file(pod, remote: str, local: Path) -> None:
    """``local`` at ``remote`` on every worker, with its permission bits (at least u+rw)."""
    mode = local.stat().st_mode & 0o777
    pod.fanout.put(local.read_bytes(), remote, mode=mode | 0o600)


def run_plan(pod, p: LaunchPlan) -> RunPlan:
    """The run: the task's ``run`` as a recipe, SkyPilot's variables for a SkyPilot task."""
    from tpufab import jobs
    from tpufab.runs import JobEnvironment

    recipe = p.run_script
    assert recipe is not None
    planned = jobs.plan_run(recipe, slices=pod.slices, ips=pod.internal_ips(), cwd=p.run_cwd,
                            commit=p.commit, forwarded=p.forwarded)
    if p.task.source != "skypilot":
        return planned
    envs = {}
    for w, e in planned.environments.items():
        extra = skypilot_variables(e.public, task_id=planned.run_id, node_name=pod.name)
        extra = {k: v for k, v in extra.items() if k not in p.forwarded.public}
        envs[w] = JobEnvironment({**e.public, **extra}, e.secrets)
    return replace(planned, environments=envs)


def save_logs(pod, run_id: str, workers: Sequence[int], into: Path,
              secrets: Iterable[str] = ()) -> list[int]:
    """Every reachable worker's whole log into ``into/w<N>.log`` (masked); the workers saved."""
    from tpufab import jobs

    return jobs.save_logs(pod.fanout, run_id, list(workers), into, secrets)
