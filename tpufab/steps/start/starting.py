"""Starting a run on a pod: the one path `tpufab run` and `Pod.start` share.

Checks first (the recipe, the flags that do not go together, the environment to forward),
then, on a pod: the quick checks if asked, the code lease (one writer for the code and one
job at a time), the refusal of a second run, deploy, the plan, the start on every worker at
once; with ``wait_port``, the wait for that port on worker 0. ``--local`` runs the recipe as
processes on this machine instead (``jobs.localrun``). Following the run afterwards is the
caller's (the verb's live view, or ``Run.wait``).
"""

from __future__ import annotations

import shlex
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tpufab import nodeset
from tpufab.config import TIMEOUTS
from tpufab.errors import ConfigError, TpufabError, shown
from tpufab.steps.runs.running import RunError, RunPlan

# seconds per step before the recipe starts (deploy, start); following the logs afterwards
# has no limit: a training run may last days; and --wait-port's wait (tpufab.config.TIMEOUTS)
RUN_TIMEOUT = TIMEOUTS["run"].seconds
WAIT_TIMEOUT = TIMEOUTS["run --wait-port"].seconds

Progress = Callable[..., None]   # progress(text, style=None): tpufab's notes as steps happen


def _silent(text: str, style: str | None = None) -> None:
    pass


def recipe_args(args: str | Sequence[str], extra: Sequence[str] = ()) -> list[str]:
    """``--args '...'`` (one string, split as a shell would; or already a list) then the
    trailing words, each as given."""
    if isinstance(args, str):
        try:
            first = shlex.split(args)
        except ValueError as err:
            raise ConfigError(f"--args {args!r} is not a valid argument list ({err}); quote it "
                              "as you would in a shell.") from None
    else:
        first = [str(a) for a in args]
    return [*first, *(str(item) for item in extra or ())]


def env_specs(env: Mapping[str, str] | Sequence[str] | None) -> list[str] | None:
    """``{"K": "V"}`` or ``["K=V", "K"]`` -> the ``--env`` specs."""
    if env is None:
        return None
    if isinstance(env, Mapping):
        return [f"{k}={v}" for k, v in env.items()]
    return [str(spec) for spec in env]


def check_recipe(recipe: str | Path) -> Path:
    path = Path(recipe)
    if not path.is_file():
        raise ConfigError(f"No recipe at {shown(str(recipe))}: pass an executable file such as "
                          "recipes/jax_hello.sh.")
    return path


@dataclass
class Started:
    """A run started on a pod: its plan and each worker's start report."""

    plan: RunPlan
    started: dict[int, dict] = field(default_factory=dict)

    @property
    def output_dir(self) -> str | None:
        return self.started[self.plan.workers[0]].get("output_dir") if self.started else None

    @property
    def profile_dir(self) -> str | None:
        return self.started[self.plan.workers[0]].get("profile_dir") if self.started else None


def started_notes(plan: RunPlan, started: Mapping[int, dict]) -> list[tuple[str, str | None]]:
    """What `tpufab run` says once the run started: (text, style) lines."""
    from tpufab.steps.runs.running import environment_summary

    workers = plan.workers
    first = started[workers[0]]
    where = first.get("cwd") or "~"
    missing = [w for w, s in started.items() if s.get("cwd_missing")]
    out: list[tuple[str, str | None]] = [(
        f"Run {plan.run_id}: {plan.recipe.name} (sha256 {plan.recipe.sha256[:12]}"
        f"{', commit ' + plan.commit[:12] if plan.commit else ''}) started on "
        f"{nodeset.fold(workers)} in {where}.", None)]
    if missing:
        out.append((f"{plan.cwd} does not exist on {nodeset.fold(missing)}; the recipe runs in "
                    "the home directory there (deploy first, or drop --no-deploy).", "yellow"))
    shipped = shipped_note(plan, started)
    if shipped:
        out.append((shipped, "yellow"))
    summary = environment_summary(plan)
    if summary:
        out.append((f"Environment: {summary}", "dim"))
    return out


def run_local(settings, recipe: str | Path, *, args: str | Sequence[str] = "",
              extra: Sequence[str] = (), env=None, workers: int | None = None,
              spmd: bool = False, secret: Sequence[str] | None = None):
    """``run --local``: the recipe as ``workers`` processes on this machine; the
    LocalRunResult (RunError with its summary when a process failed)."""
    from tpufab.steps.runs.env import forwarded_for
    from tpufab.steps.start.localrun import run_local as local

    path = check_recipe(recipe)
    argv = recipe_args(args, extra)
    forwarded = forwarded_for(settings, env_specs(env), secret)
    result = local(path, workers=workers if workers is not None else 1, args=argv,
                   forwarded=forwarded, spmd=spmd)
    if not result.ok:
        raise RunError(f"Local run {result.run_id}: {result.summary()}", exit_code=1)
    return result


def start_run(pod, settings, recipe: str | Path, *, args: str | Sequence[str] = "",
              extra: Sequence[str] = (), env=None, secret: Sequence[str] | None = None,
              no_deploy: bool = False, direct: bool = False, wip: bool = False,
              local: bool = False,
              workers: int | None = None, spmd: bool = False, check: bool = False,
              wait_port: int | None = None, wait_timeout: float = WAIT_TIMEOUT,
              timeout: float | None = RUN_TIMEOUT, progress: Progress | None = None):
    """`tpufab run` up to the start: a Started (or, ``local``, the LocalRunResult).

    ``pod`` is opened only once the checks that need no pod passed; ``progress(text,
    style)`` hears each step (deploy, the start, the wait for ``wait_port``)."""
    from tpufab.steps.runs.env import forwarded_for

    say = progress or _silent
    path = check_recipe(recipe)
    if no_deploy and (direct or wip):
        raise ConfigError("--no-deploy skips deploy, while --direct and --wip say how to "
                          "deploy: give one or the other.")
    argv = recipe_args(args, extra)
    forwarded = forwarded_for(settings, env_specs(env), secret)
    if local and check:
        raise ConfigError("--check checks a pod; drop it with --local.")
    if local and wait_port is not None:
        raise ConfigError("--wait-port waits for a port on worker 0 of a pod and does not go "
                          "with --local; drop one of them.")
    if local:
        return run_local(settings, path, args=argv, env=env, workers=workers, spmd=spmd,
                         secret=secret)
    if wait_port is not None and not 1 <= int(wait_port) <= 65535:
        raise ConfigError(f"--wait-port takes a TCP port (1-65535), not {wait_port}.")
    if workers is not None:
        raise ConfigError("--workers N goes with --local (N processes on this machine); on a "
                          "pod the recipe runs on every worker.")
    root = None
    if not no_deploy:
        from tpufab.steps.code import gitops

        try:
            root = gitops.repo_root()
        except gitops.GitError:
            raise ConfigError(f"{Path.cwd()} is not inside a git repository, so there is "
                              "nothing to deploy: run from your project's checkout, or pass "
                              f"--no-deploy to run {path.name} in the workers' home "
                              "directories.") from None
        if not direct and not wip and not gitops.has_remote(root, "origin"):
            say("This repository has no git remote yet: deploying over SSH (--direct).")
            direct = True
    from tpufab.steps.code import codelock

    if check:
        preflight(pod, settings, compare_commits=no_deploy, progress=say)
    fanout = pod.fanout
    # One writer for the code and one job at a time: from the check for a live run until
    # the recipe has started, no other tpufab deploys or starts a run on this pod.
    with codelock.hold(fanout, pod.workers, purpose=f"run {path.name}",
                       timeout=timeout) as lease:
        codelock.refuse_a_second_run(fanout, pod.workers, lease, timeout=timeout)
        plan = plan_run(pod, settings, path, argv, forwarded, spmd, root=root, direct=direct,
                        wip=wip, progress=say, timeout=timeout)
        started = start_plan(pod, plan, timeout=timeout)
    for text, style in started_notes(plan, started):
        say(text, style)
    if wait_port is not None:
        wait_for_port(pod, plan, int(wait_port), wait_timeout, progress=say)
    return Started(plan, started)


def preflight(pod, settings, *, compare_commits: bool, progress: Progress = _silent) -> None:
    """The quick checks; a problem stops the run before anything starts."""
    from tpufab.steps.health import check as checking

    report = checking.run_check(settings, pod, quick=True, compare_commits=compare_commits)
    if report.ok:
        progress(f"Checked {report.accelerator} ({len(report.workers)} workers): every quick "
                 f"check passed ({report.seconds:.1f} s).", "dim")
        return
    n = len(report.problems)
    raise checking.CheckError(
        f"Not starting: `tpufab check --quick` found {n} problem{'s' if n != 1 else ''} on "
        f"{report.name}.", details="\n".join(p.line() for p in report.problems))


def plan_run(pod, settings, path: Path, argv, forwarded, spmd, *, root, direct, wip,
             progress: Progress = _silent, timeout: float | None = None) -> RunPlan:
    """Deploy (unless ``root`` is None: --no-deploy) under the lease the caller holds, then
    plan the run."""
    from tpufab.ssh.remote_files import RemoteFile
    from tpufab.steps.code import deploy
    from tpufab.steps.runs import running as jobs

    workers = pod.workers
    commit = cwd = None
    if root is not None:
        report = deploy.deploy(pod.fanout, dir=settings.remote_dir, direct=direct, wip=wip,
                               cwd=root, progress=lambda msg: progress(f"deploy: {msg}", "dim"),
                               lease=False, timeout=timeout)  # run holds the lease already
        commit, cwd = report.commit, report.dir
        changed = [r.worker for r in report.rows if r.changed]
        how = f"updated {nodeset.fold(changed)}" if changed else "already there"
        progress(f"Deployed {commit[:12]} to {cwd} on {nodeset.fold(workers)} ({how}, "
                 f"{report.seconds:.1f} s).")
    else:
        from tpufab.steps.code.deploy import default_cwd
        cwd = default_cwd(settings.remote_dir)
    planned = jobs.plan_run(RemoteFile.from_path(path), slices=pod.slices,
                            ips=pod.internal_ips(), args=argv, cwd=cwd, commit=commit,
                            forwarded=forwarded, spmd=spmd, tpu=jobs.slice_facts(pod.nodes))
    from dataclasses import replace

    return replace(planned, in_checkout=checkout_path(path, root, cwd))


def checkout_path(path: Path, root: Path | None, cwd: str | None) -> str | None:
    """The recipe's path in the deployed checkout ``cwd`` (of ``root``; --no-deploy: this
    checkout's, if any), where the worker runs it when it holds the same bytes; None for a
    recipe outside the repository."""
    from pathlib import PurePosixPath

    from tpufab.steps.code import gitops

    if cwd is None:
        return None
    try:
        root = root or gitops.repo_root()
        relative = path.resolve().relative_to(root.resolve())
    except (gitops.GitError, ValueError):
        return None
    return str(PurePosixPath(cwd) / relative.as_posix())


_OWN_DIR = ("$0", "${0", "BASH_SOURCE", "__file__", "SCRIPT_DIR")


def shipped_note(plan: RunPlan, started: Mapping[int, dict]) -> str | None:
    """When the recipe ran as the shipped copy and refers to its own folder (``dirname
    "$0"``, ``BASH_SOURCE``, ``__file__``): one sentence saying so and what to do."""
    first = started.get(plan.workers[0], {}) if started else {}
    path = first.get("recipe_path")
    if not path or not first.get("recipe_shipped"):
        return None
    text = plan.recipe.data.decode("utf-8", "replace")
    if not any(word in text for word in _OWN_DIR):
        return None
    why = ("it is outside the repository" if plan.in_checkout is None else
           f"the checkout's copy could not be used ({first.get('in_checkout_missing')})")
    return (f"The recipe {plan.recipe.name} ran as a shipped copy ({path}) because {why}, so its own "
            "folder (`$(dirname \"$0\")`) is not your project's and the files beside it are "
            "not there: put it in the repository and run it with deploy (or deploy the "
            "checkout it expects first).")


def start_plan(pod, plan: RunPlan, *, timeout: float | None = None) -> dict[int, dict]:
    """Start ``plan`` everywhere; Ctrl-C while starting stops it again, in one sentence."""
    from tpufab.ssh.results import FanoutInterrupted
    from tpufab.steps.runs import running as jobs

    try:
        return jobs.start(pod.fanout, plan, timeout=timeout)
    except FanoutInterrupted:
        jobs.stop(pod.fanout, plan.run_id, plan.workers, grace=2.0)
        raise TpufabError(f"Interrupted while starting run {plan.run_id}; stopped it on "
                          f"{nodeset.fold(plan.workers)}.", exit_code=130) from None


class PortNeverAnswered(RunError):
    """--wait-port: the port did not answer (or the run ended first); ``.tails`` holds the
    last lines of each worker's log."""

    def __init__(self, message: str, tails: Mapping[int, Sequence[str]]):
        super().__init__(message)
        self.tails = dict(tails)


def wait_for_port(pod, plan: RunPlan, port: int, timeout: float, *,
                  progress: Progress = _silent) -> str:
    """Until ``port`` answers on the run's first worker (the run goes on): how long it took;
    PortNeverAnswered with the logs' last 40 lines per worker when it never does."""
    from collections import deque

    from tpufab.steps.runs import running as jobs
    from tpufab.term.terminal import lines_of

    worker = plan.workers[0]
    progress(f"Waiting (up to {timeout:g} s) for port {port} to answer on w{worker}...", "dim")
    try:
        ok, how = jobs.wait_port(pod.fanout, plan.run_id, port, worker=worker, timeout=timeout)
    except KeyboardInterrupt:
        raise TpufabError(f"Stopped waiting for port {port}; run {plan.run_id} goes on (stop "
                          f"it with `tpufab kill --run {plan.run_id}`).", exit_code=130) from None
    if ok:
        progress(f"Port {port} answers on w{worker} ({how}); run {plan.run_id} goes on. Reach "
                 f"it with `tpufab forward {port}`; stop it with "
                 f"`tpufab kill --run {plan.run_id}`.")
        return how
    logs, _states = jobs.fetch_logs(pod.fanout, plan.run_id, plan.workers)
    try:
        tails = {w: [line[:-1].decode("utf-8", "replace")
                     for line in deque(lines_of(output.chunks()), maxlen=40)]
                 for w, output in logs.items()}
    finally:
        for output in logs.values():
            output.close()
    raise PortNeverAnswered(f"Run {plan.run_id}: {how}; its logs are above (last 40 lines "
                            f"per worker; `tpufab logs --run {plan.run_id}` has them all).",
                            tails)


def finished(run_id: str, states, seconds: float, kept: str, hint: str | None = None) -> str:
    """How a followed run ended, in one sentence: the text when it ended well everywhere,
    else RunError (exit status: the workers' one, else 1). ``kept``: where the local copy
    of the logs is, as shown ("" for none); ``hint``: said after a failure (the recipe ran as
    a shipped copy, ``shipped_note``)."""
    from tpufab.steps.runs.running import fold_states

    lost = [s for s in states.values() if s.state in ("unreachable", "no record")]
    failed = [s for s in states.values() if not s.ok and s not in lost]
    where = f" Logs: `tpufab logs --run {run_id}`" + (f" (a copy is in {kept}/)." if kept
                                                       else ".")
    if not failed and not lost:
        return f"Run {run_id} finished on {nodeset.fold(states)}: exit 0 ({seconds:.1f} s)."
    parts = []
    if failed:
        parts.append(f"Run {run_id} failed on {nodeset.fold(s.worker for s in failed)}: "
                     f"{fold_states(states.values())}.")
    if lost:
        parts.append(f"Lost {nodeset.fold(s.worker for s in lost)} while following "
                     f"({'; '.join(sorted({s.detail or s.state for s in lost}))}); the run may "
                     f"still be going there: `tpufab runs`, `tpufab logs --run {run_id} "
                     "--follow`.")
    codes = {s.exit_status for s in failed}
    code = codes.pop() if len(codes) == 1 else 1
    if hint and failed:
        where += f" {hint}"
    raise RunError(" ".join(parts) + where, exit_code=code if 0 < code < 256 else 1)
