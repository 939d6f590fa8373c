"""`tpufab launch TASK.yaml`: from a task file to a finished run in one command.

``plan`` turns a task (``tpufab.flows.taskfile``), the flags and the settings into a ``LaunchPlan``:
the node spec, the environment, the steps. It only reads (the task file, your checkout's
HEAD); ``--dry-run`` prints it. The steps then reuse what the other verbs and babysit do:
``lifecycle.create`` (a READY node of the same spec is reused, another spec under the name is
refused), babysit's ``restore_commit`` / ``restore_mount`` / ``restore_setup`` (deploy, mounts,
setup: each idempotent), a put per file, and a run (``plan.plan_run``) whose environment also
carries SkyPilot's variables for a SkyPilot task, started the one way every job starts
(``starting.start_job``; the deploy before it under the same lease and one-job check). The order follows SkyPilot's: code and mounts
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

from tpufab.config import Settings
from tpufab.errors import ConfigError, TpufabError
from tpufab.flows.babysit.recover import MountPoint, Restore, setup_hash
from tpufab.flows.taskfile import Task, resolve_envs
from tpufab.quoting import quote
from tpufab.ssh.remote_files import RemoteFile
from tpufab.steps.host.sshconfig import keep_current
from tpufab.steps.runs.env import (
    ALWAYS_FORWARDED,
    Forwarded,
    forwarded_environment,
    secret_specs,
    skypilot_variables,
)

if TYPE_CHECKING:
    from tpufab.cloud.nodes import Node
    from tpufab.steps.host.environment import EnvSpec
    from tpufab.steps.start.plan import RunPlan

RUN_SCRIPT = "task-run.sh"
GCPUSER_HOME = "/home/gcpuser"   # SkyPilot's login user's home on its VMs


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
    force_setup: bool = False                 # run the setup even where it is done
    name_note: str | None = None              # which pod a task without a name runs on
    ray: bool = False                         # run `run` as a Ray job (Ray brought up first)
    links: Mapping[Path, str] = field(default_factory=dict)   # a file's path as the task wrote
    #                                           it, where a symlink led elsewhere (shown)
    allowed: tuple[Path, ...] = ()            # files --allow-file named (private ones copied)
    environment: EnvSpec | None = None        # the configured environment (tpufab.yaml's)

    @property
    def tier(self) -> str:
        return "spot" if self.settings.spot else "on-demand"

    @property
    def setup_script(self) -> bytes | None:
        """The task's setup under bash, in the workdir, with an ERR trap that records every
        command `set -e` would stop at (its line in the setup section, status, text) in
        ``$TPUFAB_SETUP_FAILED`` and says it in the log. A tpufab task's setup runs with
        errexit (the first failure stops it); a SkyPilot setup runs as SkyPilot runs it (to
        the end, its exit status its last command's), and either is recorded as done only
        when it exited 0 with no failure recorded (remote/setup_runner.sh). A failure the
        script handles (``cmd || true``, ``if cmd``) is not one."""
        if not self.task.setup:
            return None
        lines = ["#!/bin/bash", "set -eE" if self.task.source != "skypilot" else "set -E",
                 *self.prelude()]
        if self.run_cwd and not self.sky_workdir:
            lines.append(f"cd {_shell_path(self.run_cwd)} || exit 1")
        offset = len(lines) + 1     # the trap's own line
        lines.insert(2, _ERR_TRAP.replace("OFFSET", str(offset)))
        return ("\n".join(lines) + "\n" + self.task.setup.rstrip("\n") + "\n").encode()

    @property
    def run_script(self) -> RemoteFile | None:
        if not self.task.run:
            return None
        head = "\n".join(["#!/bin/bash", *self.prelude()]) + "\n"
        data = (head + self.task.run.rstrip("\n") + "\n").encode()
        return RemoteFile(RUN_SCRIPT, data, 0o755)

    @property
    def sky_workdir(self) -> str | None:
        """Where ``~/sky_workdir`` points on every worker (a SkyPilot task with a workdir:
        the workdir in the deployed checkout); None: no link."""
        return self.run_cwd if self.task.source == "skypilot" and self.run_cwd else None

    def prelude(self) -> list[str]:
        """The lines before a SkyPilot task's setup and run: ``~/sky_workdir`` linked to the
        deployed workdir and entered (SkyPilot runs both there), and the envs' values that
        name SkyPilot's user's home (/home/gcpuser) given this worker's home instead."""
        lines = []
        if self.sky_workdir:
            link = '"$HOME"/sky_workdir'
            target = _shell_path(self.sky_workdir)
            lines.append(f"if [ -e {link} ] && [ ! -L {link} ]; then echo \"tpufab: ~/sky_workdir "
                         f"is a directory of its own on $(hostname), not a link to "
                         f"{quote(self.sky_workdir)}: move it away so tpufab can link "
                         "SkyPilot's workdir there.\" >&2; exit 1; fi")
            lines.append(f"ln -sfn {target} {link} && cd {link} || exit 1")
        mapped = sorted(k for k in self.forwarded.public if GCPUSER_HOME in
                        self.forwarded.public[k]) if self.forwarded else []
        for name in mapped:
            pattern = GCPUSER_HOME.replace("/", "\\/")
            lines.append(f'export {name}="${{{name}//{pattern}/$HOME}}"')
        return lines

    def restore(self) -> Restore:
        script = self.setup_script
        return Restore(setup_hash=setup_hash(script) if script else None, setup_script=script,
                       setup_name=f"{Path(self.task.path).name} setup" if script else None,
                       commit=self.commit, deploy_dir=self.deploy_dir, mounts=list(self.mounts),
                       environment=self.environment)


# bash, one line: LINENO - OFFSET is the line in the task's setup section
_ERR_TRAP = ("trap '__tpufab_rc=$?; __tpufab_cmd=${BASH_COMMAND//[[:cntrl:]]/ }; "
             "printf \"%s\\t%s\\t%s\\n\" \"$((LINENO - OFFSET))\" \"$__tpufab_rc\" \"$__tpufab_cmd\" "
             ">> \"${TPUFAB_SETUP_FAILED:-/dev/null}\"; "
             "printf \"tpufab: setup line %s: \\`%s\\` exited %s\\n\" \"$((LINENO - OFFSET))\" "
             "\"$__tpufab_cmd\" \"$__tpufab_rc\" >&2' ERR")


def _shell_path(path: str) -> str:
    """A worker path for a shell line: ``~/x y`` -> ``"$HOME"/'x y'`` (quoted, ~ expanded)."""
    if path == "~":
        return '"$HOME"'
    if path.startswith("~/"):
        return '"$HOME"/' + quote(path[2:])
    return quote(path)


def plan(task: Task, *, settings: Settings, name: str | None = None, type: str | None = None,
         zone: str | None = None, spot: bool = False, version: str | None = None,
         env: Iterable[str] = (), secret: Iterable[str] = (),
         local_env: Mapping[str, str] | None = None,
         cwd: Path | None = None, down: bool = False, detach: bool = False,
         idle: float | None = None, direct: bool = False,
         force_setup: bool = False, find_node=None, ray: bool = False,
         allow_files: Iterable[str] = ()) -> LaunchPlan:
    """Everything launch will do, decided before anything is touched.

    Flags win, then the task, then the settings (tpufab.yaml, TPUFAB_*): the node is
    ``--name``, else the task's ``name`` (a SkyPilot task's name made a valid node name),
    else the ``name`` setting (this project's current pod), said in ``name_note``. A task
    that names no type runs on the READY node of that name as it is (``find_node(name)``,
    a read: SkyPilot's ``sky exec``), its type and tier taken from it. Each file the task
    copies is resolved here (symlinks followed; ``local_source``): a credential store or a
    file others cannot read is copied only when ``allow_files`` names it.
    """
    from tpufab.cloud.names import validate_name
    from tpufab.steps.code import gitops
    from tpufab.topology import parse_accelerator_type

    local_env = os.environ if local_env is None else local_env
    cwd = cwd or Path.cwd()
    if down and detach:
        raise ConfigError("--down deletes the node once the run ends, which --detach does not "
                          "wait for: drop one of them (--detach --idle 30m deletes it once "
                          "idle).")
    if ray and detach:
        raise ConfigError("--ray follows the Ray job to its end, which --detach does not wait "
                          "for: drop --detach (or launch without --ray, then `tpufab ray "
                          "submit`).")
    if not task.run:
        raise ConfigError(f"{task.path} has no run section; a task needs `run:` (the command "
                          "every worker runs).")
    for section, text in (("setup", task.setup), ("run", task.run)):
        line = next((n for n, t in enumerate((text or "").splitlines(), 1)
                     if GCPUSER_HOME in t), None)
        if line is not None and settings.ssh_user != "gcpuser":
            raise ConfigError(
                f"{task.path}: line {line} of {section} names {GCPUSER_HOME}, the home of "
                "SkyPilot's own login user on its VMs, while tpufab logs in as "
                f"{settings.ssh_user or 'your user'}: write $HOME/... there (tpufab gives an "
                f"env value that names {GCPUSER_HOME} the worker's home; see docs/launch.md).")
    spec = replace(settings, labels={**task.labels, **settings.labels})
    spec.zone = zone or task.zone or _zone_of_region(task, settings)
    task_name = node_name_of(task)
    spec.name = validate_name(name or task_name or settings.name)
    name_note = None
    if not name and task.name and task_name != task.name:
        name_note = (f"The task's name {task.name} is not a valid TPU node name; the pod is "
                     f"{task_name} (--name picks another).")
    elif not name and not task.name:
        name_note = (f"{Path(task.path).name} names no pod (no `name:`), so it runs on "
                     f"{spec.name}, {_name_source(settings)} (--name picks another).")
    wanted = type or task.type or settings.type
    existing = None
    if not wanted and find_node is not None:
        existing = find_node(spec.name)
        if existing is not None and existing.state == "READY":
            wanted = existing.accelerator_type
        else:
            existing = None
    if not wanted:
        raise ConfigError(f"{task.path} names no TPU type and no READY pod {spec.name} exists "
                          "to run it on; add `type: v4-32` (SkyPilot: resources.accelerators: "
                          "tpu-v4-32) or pass --type.")
    spec.type = parse_accelerator_type(wanted).name
    spec.spot = True if spot else (task.spot if task.spot is not None else settings.spot)
    if existing is not None and not spot and task.spot is None:
        spec.spot = existing.tier in ("spot", "preemptible")
    spec.runtime_version = version or task.runtime_version or settings.runtime_version
    specs = resolve_envs(task, env, local_env)
    configured = [e for e in (*ALWAYS_FORWARDED, *spec.env) if "=" in e or e in local_env]
    extra, secret_names = secret_specs(secret)
    forwarded = forwarded_environment([*configured, *specs, *extra], local_env,
                                      [*spec.secrets, *task.secret_envs, *secret_names])

    allowed = {_resolved(cwd, a) for a in allow_files}
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
        try:
            gitops.refuse_dirty(root)
        except gitops.GitError as err:     # its advice names `deploy --wip`; launch has none
            raise ConfigError(str(err).split(": commit them")[0] + ": commit them first "
                              "(launch deploys the checkout's HEAD).") from None
        deployed_secrets(task, root)
        tracked = tracked_credentials(root, spec, allowed)
        if tracked:
            raise ConfigError(
                f"{task.path}: workdir {task.workdir} deploys {root}, whose commit holds "
                f"{tracked[0]} (in a credential store); a task file comes from other people, "
                f"so launch deploys such a file only when you name it: pass --allow-file "
                f"{tracked[0]} if you mean to, or remove it from the repository.")
        resolved = gitops.resolve(root, "HEAD")
        commit, branch = resolved.commit, resolved.branch
        from tpufab.steps.code import deploy

        deploy_dir = spec.remote_dir or deploy.default_dir(root)
        if not direct and not gitops.git(root, "remote").stdout.split():
            direct = True   # no remote to push to: the commit travels over SSH
        relative = workdir.relative_to(root)
        run_cwd = deploy_dir if str(relative) == "." else \
            str(PurePosixPath(deploy_dir) / relative.as_posix())

    from tpufab.steps.host import mount as mounting

    mounts = []
    for m in task.mounts:
        driver = m.driver or spec.mount_driver
        checked = mounting.mount_spec(m.source, at=m.at, driver=driver, options=m.options,
                                      endpoint=spec.storage_endpoint)
        mounts.append(MountPoint(checked.url, checked.at, driver, tuple(m.options)))
    files, links = [], {}
    for f in task.files:
        local, link = local_source(task.path, f, cwd, settings=spec, allowed=allowed)
        files.append((f.remote, local))
        if link is not None:
            links[local] = link
    used = {local for _, local in files} | set(tracked_credentials(root, spec, ()) if root
                                                 else ())
    unused = sorted(str(a) for a in allowed if not any(a == u or a in u.parents for u in used))
    if unused:
        raise ConfigError(f"--allow-file {unused[0]} names no file that {task.path} copies "
                          "(it copies " + (", ".join(sorted({str(f) for _, f in files}))
                                           or "none") + "); name the file as the plan shows it.")
    from tpufab.steps.host.environment import env_spec

    result = LaunchPlan(task, spec, tuple(specs), forwarded, root, commit, branch, deploy_dir,
                        run_cwd, tuple(mounts), tuple(files), down, detach, idle, direct,
                        force_setup=force_setup, name_note=name_note, ray=ray,
                        links=links, allowed=tuple(sorted(allowed)),
                        environment=env_spec(spec, cwd=cwd))
    return replace(result, steps=tuple(describe_steps(result)))

# Where credentials live on this machine: a task file comes from other people, and a file
# under one of these (or one only you can read) reaches the pod only when you name it.
CREDENTIAL_STORES = ("~/.ssh", "~/.tpufab", "~/.config/gcloud", "~/.aws", "~/.azure",
                     "~/.kube", "~/.docker", "~/.gnupg", "~/.password-store", "~/.netrc",
                     "~/.git-credentials", "~/.config/gh", "~/.config/git/credentials",
                     "~/.pypirc", "~/.boto", "~/.npmrc", "~/.cache/huggingface/token",
                     "~/.huggingface", "~/.config/rclone", "/etc/shadow", "/etc/gshadow",
                     "/etc/ssh", "/etc/sudoers", "/etc/sudoers.d")


def _resolved(cwd: Path, path: str | Path) -> Path:
    """``path`` as this machine finds it: ~ expanded, relative to ``cwd``, symlinks followed
    (as far as they exist)."""
    return (cwd / Path(path).expanduser()).resolve()


def _credential_store(real: Path, settings: Settings | None) -> str | None:
    """The credential store ``real`` lies in (as written, ``~/.ssh``), or None."""
    stores = list(CREDENTIAL_STORES)
    if settings is not None and settings.ssh_key:
        stores.append(settings.ssh_key)           # tpufab's own key, wherever it is
        stores.append(settings.ssh_key + ".pub")
    for store in stores:
        where = Path(store).expanduser()
        try:
            where = where.resolve()
        except OSError:
            continue
        if real == where or where in real.parents:
            return store
    return None


def _private_why(real: Path) -> str | None:
    """Why others on this machine may not read ``real`` (its mode), or None when they may."""
    import stat

    mode = real.stat().st_mode
    if not mode & stat.S_IROTH:
        return f"only its owner may read it (mode {stat.S_IMODE(mode):04o})"
    return None


def deployed_secrets(task: Task, root: Path) -> None:
    """A task file in the repository launch deploys, giving a secret's value itself, would
    put that value in clear in the checkout on every worker: one sentence naming it."""
    from tpufab.steps.code import gitops

    if not task.inline_secrets:
        return
    try:
        rel = Path(task.path).resolve().relative_to(root.resolve())
    except (OSError, ValueError):
        return                                   # not deployed with the checkout
    if not gitops.git(root, "ls-files", "--", rel.as_posix(), check=False).stdout.strip():
        return                                   # git-ignored: not deployed either
    name = task.inline_secrets[0]
    raise ConfigError(
        f"{task.path} gives the value of the secret {name} itself, and launch deploys that "
        f"file with {root} to every worker, where the value would sit in clear: leave it "
        f"empty in the file (`{name}:`) and pass it with --env {name}=VALUE, or export "
        f"{name} before launching (tpufab sends it on stdin and masks it).")


def tracked_credentials(root: Path, settings: Settings | None,
                        allowed: Iterable[Path]) -> list[Path]:
    """Files of ``root``'s commit that lie in a credential store (a workdir whose repository
    is the home directory's dotfiles, say), but those ``allowed`` names."""
    from tpufab.steps.code import gitops

    allowed = set(allowed)
    stores = [Path(s).expanduser() for s in CREDENTIAL_STORES] + (
        [Path(settings.ssh_key).expanduser()] if settings is not None and settings.ssh_key
        else [])
    inside = []
    for store in stores:
        try:
            rel = store.resolve().relative_to(root.resolve())
        except (OSError, ValueError):
            continue
        inside.append(rel.as_posix())
    if not inside:
        return []
    listed = gitops.git(root, "ls-tree", "-r", "-z", "--name-only", "HEAD", "--", *inside,
                        check=False).stdout
    found = [root / name for name in listed.split("\0") if name]
    return [f for f in found if not any(a == f or a in f.parents for a in allowed)]


def local_source(task_path: str, f, cwd: Path, *, settings: Settings | None = None,
                 allowed: Iterable[Path] = ()) -> tuple[Path, str | None]:
    """A file a task copies (``f``: a FileCopy) as this machine resolves it: (the real file,
    the path the task wrote where a symlink led elsewhere, else None). One sentence for a
    directory, a missing file, a device or FIFO, and (unless ``allowed`` names it) a file in a
    credential store or one others cannot read."""
    import stat

    given = cwd / Path(f.local).expanduser()
    if "\0" in f.local:
        raise ConfigError(f"{task_path}: the file for {f.remote} has a NUL byte in its name; "
                          "name a file of this machine.")
    if not (f.remote.startswith("/") or f.remote.startswith("~")):
        raise ConfigError(f"{task_path}: {f.remote} must be an absolute path on the workers "
                          "(or start with ~/).")
    try:
        real = given.resolve(strict=True)
        mode = real.stat().st_mode
    except FileNotFoundError:
        raise ConfigError(f"{task_path}: {f.local} (for {f.remote}) does not exist here"
                          + (f" ({given} is a symlink to {given.resolve()}, which does not)"
                             if given.is_symlink() else "") + ".") from None
    except (OSError, RuntimeError) as err:
        why = getattr(err, "strerror", None) or "a symlink loop"
        raise ConfigError(f"{task_path}: {f.local} (for {f.remote}) cannot be read here "
                          f"({why}).") from None
    if stat.S_ISDIR(mode):
        raise ConfigError(f"{task_path}: {f.local} (for {f.remote}) is a directory; launch "
                          "copies single files: put the directory in the workdir (it is "
                          "deployed with git) or in a bucket mount.")
    if not stat.S_ISREG(mode):
        kind = ("a character device" if stat.S_ISCHR(mode) else "a block device"
                if stat.S_ISBLK(mode) else "a FIFO" if stat.S_ISFIFO(mode) else "a socket"
                if stat.S_ISSOCK(mode) else "not a regular file")
        raise ConfigError(f"{task_path}: {f.local} (for {f.remote}) is {kind} here, not a "
                          "regular file; launch copies regular files only.")
    link = str(given) if real != Path(os.path.normpath(given.absolute())) else None
    if real not in set(allowed):
        store = _credential_store(real, settings)
        private = None if store else _private_why(real)
        if store or private:
            what = (f"lies in {store}, where credentials live" if store else private)
            shown = f"{f.local} (for {f.remote})" + (f", a symlink to {real}," if link else
                                                     f", {real},")
            raise ConfigError(
                f"{task_path}: {shown} {what}; a task file comes from other people, so launch "
                f"copies such a file to the pod only when you name it: pass --allow-file "
                f"{real} if you mean to.")
    return real, link


def node_name_of(task: Task) -> str | None:
    """The node a task names: tpufab's ``name`` as it is; a SkyPilot task's name (a task
    name to SkyPilot, where the cluster is ``-c``) lowercased, other characters hyphens."""
    import re

    if not task.name or task.source != "skypilot":
        return task.name
    made = re.sub(r"[^a-z0-9-]+", "-", task.name.lower()).strip("-")
    if made and not made[0].isalpha():
        made = "t-" + made
    return made[:63].rstrip("-") or None


def _name_source(settings: Settings) -> str:
    where = settings.source_of("name")
    if where.startswith("current pod"):
        return "this project's current pod"
    if where == "environment":
        return "from TPUFAB_NAME"
    return f"the name setting of {where}"


def _zone_of_region(task: Task, settings: Settings) -> str | None:
    """The zone for a task that names a region only (SkyPilot's ``infra: gcp/REGION`` or
    ``region:``): the zone setting when it lies in that region, else one sentence (tpufab has
    no catalog of which zone of a region has the type, so it does not guess)."""
    from tpufab.flows.taskfile import zone_region

    if not task.region:
        return settings.zone
    if settings.zone and zone_region(settings.zone) == task.region:
        return settings.zone
    raise ConfigError(f"{task.path} names region {task.region} but no zone, and tpufab creates "
                      f"TPUs in a zone: name one (infra: gcp/{task.region}/{task.region}-b, or "
                      f"resources.zone) or pass --zone (the zone setting, "
                      f"{settings.zone or 'none'}, is not in {task.region}).")


def describe_steps(p: LaunchPlan) -> list[str]:
    """The plan as numbered lines (``--dry-run``), secrets masked."""
    from tpufab.durations import human_duration
    from tpufab.topology import parse_accelerator_type

    s = p.settings
    shape = parse_accelerator_type(s.type)
    runtime = s.runtime_version or shape.default_runtime
    steps = [f"create {s.name}: {s.type} ({shape.hosts} host{'s' if shape.hosts != 1 else ''}, "
             f"{p.tier}, runtime {runtime}) in {s.zone} (project "
             f"{s.project or 'not set: pass --project or set TPUFAB_PROJECT'}), or reuse it if "
             "it is READY with this spec"]
    if p.commit:
        how = "over SSH (direct)" if p.direct else "through origin"
        steps.append(f"deploy {p.commit[:12]}" + (f" ({p.branch})" if p.branch else "") +
                     f" of {p.root} to {p.deploy_dir} {how}")
    if p.sky_workdir:
        steps.append(f"link ~/sky_workdir to {p.sky_workdir} on every worker (SkyPilot's "
                     "workdir: setup and run start there)")
    for m in p.mounts:
        steps.append(f"mount {m.url} at {m.at} ({m.driver})")
    for remote, local in p.files:
        via = f" (the task names {p.links[local]}, a symlink to it)" if local in p.links else ""
        why = " (allowed by --allow-file)" if local in p.allowed else ""
        steps.append(f"put {local}{via} at {remote}{why}")
    where = "~/sky_workdir" if p.sky_workdir else (p.run_cwd or "~")
    if p.environment is not None:
        steps.append(f"environment at {p.environment.path} from {p.environment.spec}: built "
                     "once on w0 and copied to every other host, skipped where its hash is "
                     "(as `tpufab setup`)")
    if p.task.setup:
        steps.append(f"setup ({_lines(p.task.setup)}, "
                     + ("again (--force-setup)" if p.force_setup else "once per content")
                     + f") in {where}")
    if p.idle:
        steps.append(f"autostop: delete {s.name} after {human_duration(p.idle)} idle (a "
                     "watchdog on every worker, armed once the pod is set up; any tpufab "
                     "session counts as busy)")
    env = {**p.forwarded.public, **{k: "***" for k in p.forwarded.secrets}}
    shown = " ".join(f"{k}={v}" for k, v in sorted(env.items())) or "none"
    flavor = " + SKYPILOT_* variables and TPU_NAME"
    mapped = [k for k, v in p.forwarded.public.items() if GCPUSER_HOME in v]
    if mapped:
        flavor += f" ({GCPUSER_HOME} in {', '.join(sorted(mapped))}: the worker's home)"
    if p.ray:
        steps.append("ray up: Ray's head on worker 0, every other host joined (a no-op where "
                     "Ray is up)")
        steps.append(f"run ({_lines(p.task.run)}) once, as a Ray job on the head, in {where}; "
                     f"env: {shown}{flavor}")
    else:
        steps.append(f"run ({_lines(p.task.run)}) on every worker in "
                     f"{where}; env: {shown}{flavor}")
    if p.ray:
        steps.append("follow the Ray job's logs, exit with its exit code")
    elif p.detach:
        steps.append("detach: leave it running (follow with `tpufab logs --follow`)")
    else:
        steps.append("follow the logs, exit with the run's exit code")
    if p.down:
        steps.append(f"down: save the logs locally, then delete {s.name}")
    return steps


def _lines(text: str) -> str:
    n = len(text.splitlines())
    return f"{n} line{'s' if n != 1 else ''}"


# Advice the shared steps give in their own verbs' words, said in launch's (launch has no
# --queued or --dir; tests/test_tasks.py checks every flag an error names against launch's)
_LAUNCH_WORDS = (
    ("--spot, --queued, other --zones", "--spot, other --zones"),
    ("(or pick another --dir)", "(or set remote_dir in tpufab.yaml to deploy elsewhere)"),
    ("deploy to another --dir", "set remote_dir in tpufab.yaml to deploy elsewhere"),
    ("(maybe --spot or another --zone)", "(maybe with --spot or in another --zone)"),
)


def in_launch_words(text: str) -> str:
    """An error of a shared step (create, deploy) with its advice in launch's flags."""
    for theirs, ours in _LAUNCH_WORDS:
        text = text.replace(theirs, ours)
    return text


@contextmanager
def step(name: str):
    """A failure inside names the step (and keeps its exit code)."""
    try:
        yield
    except StepFailed:
        raise
    except TpufabError as err:
        raise StepFailed(f"launch failed at {name}: {in_launch_words(str(err))}",
                         details=err.details, exit_code=err.exit_code) from err


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
    from tpufab.cloud import lifecycle, planes

    control = planes.control_plane(p.settings, control)
    existing = control.find_node(p.settings.name)
    if existing is not None:
        problem = existing_spec_problem(existing, p)
        if problem:
            raise ConfigError(problem)
    nodes = lifecycle.create(p.settings, console=console, control=control, zones=zones,
                             retry_for=retry_for)
    keep_current(p.settings, console)  # its entries in ~/.ssh/config, once config-ssh made them
    return nodes


def put_file(pod, remote: str, local: Path) -> None:
    """``local`` at ``remote`` on every worker, with its permission bits (at least u+rw)."""
    mode = local.stat().st_mode & 0o777
    pod.fanout.put(local.read_bytes(), remote, mode=mode | 0o600)


def run_plan(pod, p: LaunchPlan) -> RunPlan:
    """The run: the task's ``run`` as a recipe, with SkyPilot's variables (and TPU_NAME)."""
    from tpufab.steps.runs.env import JobEnvironment, virtual_env
    from tpufab.steps.start import plan as plans

    recipe = p.run_script
    assert recipe is not None
    planned = plans.plan_run(recipe, slices=pod.slices, ips=pod.internal_ips(), cwd=p.run_cwd,
                             commit=p.commit, forwarded=p.forwarded,
                             tpu=plans.slice_facts(pod.nodes),
                             virtual_env=virtual_env(pod.settings))
    envs = {}   # every launch's run (either schema: a `run:`-only file is both) as SkyPilot's
    for w, e in planned.environments.items():
        extra = skypilot_variables(e.public, task_id=planned.run_id, node_name=pod.name)
        # what the run already sets per worker wins (TPU_NAME: each slice's own node name)
        extra = {k: v for k, v in extra.items() if k not in p.forwarded.public
                 and k not in e.public}
        envs[w] = JobEnvironment({**e.public, **extra}, e.secrets)
    return replace(planned, environments=envs)


def save_logs(pod, run_id: str, workers: Sequence[int], into: Path,
              secrets: Iterable[str] = ()) -> list[int]:
    """Every reachable worker's whole log into ``into/w<N>.log`` (masked); the workers saved."""
    from tpufab.steps.runs import running as jobs

    return jobs.save_logs(pod.fanout, run_id, list(workers), into, secrets)


# -- the steps, in order (the Pod API's `launch`) -------------------------------------------------


@dataclass
class Launch:
    """A launch under way: its plan, the pod once connected, the run once started (a
    ``tpufab.pod.api.Run``) and every run started, for ``down``."""

    plan: LaunchPlan
    created: bool = False                           # the node is there (created or reused)
    pod: object = None
    run: object = None
    started: list = field(default_factory=list)     # (run id, workers, secrets)


def _silent(text: str, style: str | None = None) -> None:
    pass


def execute(p: LaunchPlan, launch: Launch, open_pod, *, zones: Sequence[str] | None = None,
            retry_for: float | None = None, console=None, progress=None,
            setup_view=None) -> None:
    """Create (or reuse) the node, connect (``open_pod(settings)``), deploy, mount, put, set
    up, arm autostop (after the setup: those steps are not idle) and start the run, each step
    named when it fails (``step``).
    ``progress(text, style)`` hears each step; ``setup_view(workers)`` is a context manager
    giving the setup's sink. The run is started, not followed (``launch.run``)."""
    from tpufab import current, nodeset
    from tpufab.flows.babysit import recover
    from tpufab.steps.host import autostop
    from tpufab.steps.start import starting

    say = progress or _silent
    if p.name_note:
        say(p.name_note)
    if p.idle:
        autostop.check_settings(p.settings)   # a bad setting stops launch before it works
    with step("create"):
        provision(p, console=console, zones=zones, retry_for=retry_for)
    launch.created = True
    if not p.down:
        before = current.read()
        path = current.remember(p.settings.name, zone=p.settings.zone,
                                project=p.settings.project, set_by="launch")
        if before is not None and before.name != p.settings.name:
            say(current.became(p.settings.name, before, path))
    with step("connect"):
        pod = launch.pod = open_pod(p.settings)
    everyone = nodeset.fold(pod.workers)
    restore = p.restore()
    what = Path(p.task.path).name
    if p.commit:
        with step("deploy"), starting.job_lease(pod, verb="launch", what=what):
            # as `run`: refused beside a running run, before anything changes on the pod
            report = recover.restore_commit(pod, restore, root=p.root, direct=p.direct,
                                            lease=False,
                                            progress=lambda msg: say(f"deploy: {msg}", "dim"))
            changed = [r.worker for r in report.rows if r.changed]
            how = f"updated {nodeset.fold(changed)}" if changed else "already there"
            say(f"Deployed {report.commit[:12]} to {report.dir} on {everyone} ({how}, "
                f"{report.seconds:.1f} s).")
    for m in p.mounts:
        with step(f"mount {m.url}"):
            report = recover.restore_mount(pod, m, endpoint=p.settings.storage_endpoint,
                                           for_task=True)
            fresh = sum(r.action == "mounted" for r in report.rows)
            say(f"Mounted {m.url} at {m.at} on {everyone} ({m.driver}; "
                f"{fresh} mounted now, {len(report.rows) - fresh} already had it).")
    for remote, local in p.files:
        with step(f"put {remote}"):
            put_file(pod, remote, local)
            say(f"Put {local} at {remote} on {everyone}.")
    if restore.environment is not None:
        with step("environment"):
            built = recover.restore_environment(pod, restore)
            say(built.summary)
    if restore.setup_script is not None:
        with step("setup"):
            with (setup_view(pod.workers) if setup_view is not None
                  else _no_view()) as sink:
                outcomes = recover.restore_setup(pod, restore, sink=sink,
                                                 env=p.forwarded.public,
                                                 secrets=p.forwarded.secrets,
                                                 force=p.force_setup)
            ran = [w for w, o in outcomes.items() if o.status == "ran"]
            skipped = [w for w, o in outcomes.items() if o.status == "skipped"]
            parts = ([f"ran on {nodeset.fold(ran)}"] if ran else []) + (
                [f"already done on {nodeset.fold(skipped)} (this content ran there before; "
                 "--force-setup runs it again)"] if skipped else [])
            if parts:
                say(f"Setup: {'; '.join(parts)}.")
            if any(o.status == "incomplete" for o in outcomes.values()):
                from tpufab.steps.host.setup import failure_sentence

                say(failure_sentence(outcomes, "Setup") + "; it went on to the end and exited "
                    "0 (a SkyPilot setup runs as SkyPilot runs it), so the run starts, but the "
                    "setup is not recorded as done: the next launch runs it again.", "yellow")
    if p.idle:   # armed once the pod is set up: deploy, mounts and setup are not idle
        from tpufab.cloud.nodes import describe_autostop

        with step("autostop"):
            state = autostop.arm(pod, p.settings, idle=p.idle)
            say(f"Autostop: {describe_autostop(state)}.")
    if p.ray:   # the run is the Ray job that `ray_job` submits and follows
        from tpufab.reports import up_sentence
        from tpufab.steps.start import raycluster

        with step("ray up"):
            ray = raycluster.up(pod, progress=say)
            say(up_sentence(ray, pod.name))
        return
    with step("run"):
        planned = run_plan(pod, p)
    launch.started.append((planned.run_id, planned.workers, list(planned.secrets.values())))
    image = p.task.image     # SkyPilot's image_id: docker:IMAGE (else the image setting)

    def begin(_deployed):
        pinned = starting.image_for_run(pod, image, progress=say) if image else None
        return starting.start_plan(pod, replace(planned, image=pinned) if pinned else planned)

    started = starting.start_job(pod, begin, verb="launch", what=what)
    for text, style in starting.started_notes(planned, started):
        say(text, style)
    launch.run = starting.Started(planned, started)


@contextmanager
def _no_view():
    yield None


def down(p: LaunchPlan, started: Sequence[tuple], open_pod, *, console=None,
         progress=None) -> None:
    """Save every log, then delete the node, whatever happened before (``--down``)."""
    from tpufab import current
    from tpufab.cloud import lifecycle
    from tpufab.hosts import connect as pods
    from tpufab.steps.runs.running import local_log_dir

    say = progress or _silent
    for run_id, workers, secrets in started:
        try:
            into = local_log_dir(run_id)
            pod = open_pod(p.settings)
            saved = save_logs(pod, run_id, workers, into, secrets)
            say(f"Saved the logs of run {run_id} from {len(saved)} workers in {into}/.")
        except (TpufabError, OSError) as err:
            say(f"Could not save every log of run {run_id} ({err}); deleting the node "
                "anyway (--down).", "yellow")
    pods.forget(p.settings)
    if lifecycle.delete(p.settings, yes=True, console=console):
        keep_current(p.settings, console, gone=True)
    current.forget(p.settings.name)


def ray_job(p: LaunchPlan, pod, *, out=None, progress=None) -> int:
    """``--ray``: the task's ``run`` submitted once as a Ray job on the head (`ray submit`'s
    path: its public environment in the job's runtime_env, its secrets only in the
    entrypoint's), in the workdir, followed; the job's exit code. Ray places the work: the
    run section is the Ray driver, not a command every worker runs."""
    from tpufab.steps.start import raycluster

    recipe = p.run_script
    assert recipe is not None
    with step("run"):
        done = raycluster.submit(pod, p.settings, recipe, cwd=p.run_cwd or "",
                                 forwarded=p.forwarded, out=out, progress=progress or _silent)
    (progress or _silent)(f"Ray job {done.job} {done.status.lower()}: exit {done.exit_code} "
                          f"({done.seconds:.1f} s).", None if done.exit_code == 0 else "red")
    return done.exit_code
