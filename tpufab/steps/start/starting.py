"""Starting a job on a pod: the one path every job takes (`tpufab run` and `Pod.start`,
babysit's attempts, launch's run, `ray submit`, check's collective).

``start_job`` is that path: under the pod's code lease (one writer for the code, one job at a
time) a running run is refused in one sentence, the commit is deployed if asked (through the
one deploy call, ``tpufab.steps.code.deploy.deploy_checkout``, which reads the HTTPS token),
and the job is started: ``start_plan`` starts a run's plan on every worker at once, a Ray job
is submitted to Ray's Job API (``raycluster.submit``). Following the job is the caller's,
once the lease is released (the verb's live view, or ``Run.wait``).

`run`'s own part (``start_run``) comes first: the checks that need no pod (the recipe, the
flags that do not go together, the environment to forward), the quick checks if asked; with
``wait_port``, the wait for that port on worker 0 afterwards. ``--local`` runs the recipe as
processes on this machine instead (``localrun``).
"""

from __future__ import annotations

import json
import shlex
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from tpufab import nodeset
from tpufab.config import TIMEOUTS
from tpufab.errors import ConfigError, TpufabError, shown
from tpufab.quoting import mask
from tpufab.ssh.remote_files import read_answer, run_script, run_with_files
from tpufab.steps.runs.running import (
    RunError,
    failure_reason,
    launch_file,
    open_workers,
    statuses,
    stop_command,
)
from tpufab.steps.start.plan import RunPlan, start_command

if TYPE_CHECKING:
    from tpufab.steps.code.codelock import Lease
    from tpufab.steps.code.deploy import DeployReport

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
    from tpufab.steps.start.plan import environment_summary

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
    for note in dict.fromkeys(n for s in started.values() for n in s.get("container_notes") or ()):
        out.append((f"Image: {note}.", "yellow"))
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
              timeout: float | None = RUN_TIMEOUT, progress: Progress | None = None,
              image: str | None = None):
    """`tpufab run` up to the start: a Started (or, ``local``, the LocalRunResult).

    ``pod`` is opened only once the checks that need no pod passed; ``progress(text,
    style)`` hears each step (deploy, the image on every host, the start, the wait for
    ``wait_port``). ``image`` (else the ``image`` setting): the recipe runs inside it on
    every host, pulled where it is missing and pinned by digest; refused (ImageError) where
    the hosts' digests differ."""
    from tpufab.steps.runs.env import forwarded_for

    say = progress or _silent
    path = check_recipe(recipe)
    if no_deploy and (direct or wip):
        raise ConfigError("--no-deploy skips deploy, while --direct and --wip say how to "
                          "deploy: give one or the other.")
    argv = recipe_args(args, extra)
    forwarded = forwarded_for(settings, env_specs(env), secret)
    image = image or getattr(settings, "image", None)
    if image and local:
        raise ConfigError("--image runs the recipe in an image on every host of a pod and "
                          "does not go with --local; drop one of them.")
    if image:
        from tpufab.steps.host.images import check_image

        image = check_image(image)
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
    ask = deploy_ask(settings, direct=direct, wip=wip, what=path.name, progress=say) \
        if not no_deploy else None
    if check:
        preflight(pod, settings, compare_commits=no_deploy, progress=say)

    def begin(report: DeployReport | None) -> tuple[RunPlan, dict[int, dict]]:
        plan = plan_for(pod, settings, path, argv, forwarded, spmd, report=report,
                        root=ask.root if ask else None)
        if image:
            from dataclasses import replace

            plan = replace(plan, image=image_for_run(pod, image, timeout=timeout,
                                                     progress=say))
        return plan, start_plan(pod, plan, timeout=timeout)

    plan, started = start_job(pod, begin, verb="run", what=path.name, deploy=ask,
                              timeout=timeout, progress=say)
    for text, style in started_notes(plan, started):
        say(text, style)
    if wait_port is not None:
        wait_for_port(pod, plan, int(wait_port), wait_timeout, progress=say)
    return Started(plan, started)


def image_for_run(pod, image: str, *, timeout: float | None = None,
                  progress: Progress = _silent) -> str:
    """``image`` on every host of ``pod`` (pulled where missing; a host that has it is not
    asked to pull again), pinned by its one digest; ImageError naming the hosts that could
    not get it or whose digest differs."""
    from tpufab.steps.host import images

    login = images.registry_login(getattr(getattr(pod, "settings", None), "registry_login",
                                          None))
    report = images.pull(pod.fanout, pod.workers, image, if_missing=True, timeout=timeout,
                         login=login)
    for note in report.notes:
        progress(note, "dim")
    if not report.ok:
        raise images.ImageError(f"Not starting: {images.problem(report)}")
    pulled = [r.worker for r in report.rows if r.pulled]
    progress(f"Image {report.pinned} on {nodeset.fold(pod.workers)}"
             + (f" (pulled on {nodeset.fold(pulled)})" if pulled else "") + ".", "dim")
    return report.pinned


@dataclass(frozen=True)
class DeployAsk:
    """What a job's start deploys first: the checkout at ``root``'s ``ref`` into ``dir`` (None:
    ``~/<repository name>``), over SSH with ``direct``, uncommitted work with ``wip``."""

    root: Path
    dir: str | None = None
    direct: bool = False
    wip: bool = False
    ref: str = "HEAD"


def deploy_ask(settings, *, direct: bool = False, wip: bool = False, what: str,
               progress: Progress = _silent) -> DeployAsk:
    """What `run` (babysit, `ray submit`) deploys from here: this checkout (ConfigError in one
    sentence outside one), over SSH when it has no remote yet (said)."""
    from tpufab.steps.code import gitops

    try:
        root = gitops.repo_root()
    except gitops.GitError:
        raise ConfigError(f"{Path.cwd()} is not inside a git repository, so there is "
                          "nothing to deploy: run from your project's checkout, or pass "
                          f"--no-deploy to run {what} in the workers' home "
                          "directories.") from None
    if not direct and not wip and not gitops.has_remote(root, "origin"):
        progress("This repository has no git remote yet: deploying over SSH (--direct).")
        direct = True
    return DeployAsk(root, settings.remote_dir, direct, wip)


T = TypeVar("T")


@contextmanager
def job_lease(pod, *, verb: str, what: str, timeout: float | None = None) -> Iterator[Lease]:
    """What every job's start holds (``start_job``, and a deploy made to start one: babysit's
    first, launch's): the pod's code lease (one writer for the code, one job at a time: until
    the block ends, no other tpufab deploys or starts a job there) with a running run refused
    (CodeBusy, one sentence naming it and saying to ``verb`` again) and a worker the lease could
    not reach refused (RunError), before anything starts. ``what`` names the job in the lease
    (``run train.sh``) and in those sentences."""
    from tpufab.steps.code import codelock

    fanout = pod.fanout
    with codelock.hold(fanout, pod.workers, purpose=f"{verb} {what}", verb=verb,
                       timeout=timeout) as lease:
        codelock.refuse_a_second_run(fanout, pod.workers, lease, verb=verb, timeout=timeout)
        yield lease


def start_job(pod, begin: Callable[[DeployReport | None], T], *, verb: str, what: str,
              deploy: DeployAsk | None = None, timeout: float | None = None,
              progress: Progress = _silent) -> T:
    """The one way a job starts on ``pod`` (run, babysit, launch, ray submit, check's
    collective): under ``job_lease``, ``deploy`` deployed (if given), then ``begin(report)``
    (the deploy's report, None without one) starts the job: ``start_plan`` for a run, a Ray
    submission; its answer is returned. Following the job is the caller's, once the lease is
    released."""
    with job_lease(pod, verb=verb, what=what, timeout=timeout):
        report = None if deploy is None else deploy_for_job(pod, deploy, timeout=timeout,
                                                            progress=progress)
        return begin(report)


def deploy_for_job(pod, ask: DeployAsk, *, timeout: float | None = None,
                   progress: Progress = _silent) -> DeployReport:
    """Deploy ``ask`` under the lease the caller holds (``start_job``), and say so."""
    from tpufab.steps.code import deploy

    report = deploy.deploy_checkout(pod, cwd=ask.root, ref=ask.ref, dir=ask.dir,
                                    direct=ask.direct, wip=ask.wip, lease=False,
                                    timeout=timeout,
                                    progress=lambda msg: progress(f"deploy: {msg}", "dim"))
    changed = [r.worker for r in report.rows if r.changed]
    how = f"updated {nodeset.fold(changed)}" if changed else "already there"
    progress(f"Deployed {report.commit[:12]} to {report.dir} on {nodeset.fold(pod.workers)} "
             f"({how}, {report.seconds:.1f} s).")
    return report


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


def plan_for(pod, settings, path: Path, argv, forwarded, spmd, *,
             report: DeployReport | None, root: Path | None) -> RunPlan:
    """The run's plan on ``pod``, in the checkout ``report`` deployed (None: --no-deploy, the
    deploy directory of this checkout, if any)."""
    from dataclasses import replace

    from tpufab.ssh.remote_files import RemoteFile
    from tpufab.steps.code.deploy import default_cwd
    from tpufab.steps.runs.env import virtual_env
    from tpufab.steps.start import plan

    if report is not None:
        commit, cwd = report.commit, report.dir
    else:
        commit, cwd = None, default_cwd(settings.remote_dir)
    planned = plan.plan_run(RemoteFile.from_path(path), slices=pod.slices,
                            ips=pod.internal_ips(), args=argv, cwd=cwd, commit=commit,
                            forwarded=forwarded, spmd=spmd, tpu=plan.slice_facts(pod.nodes),
                            virtual_env=virtual_env(settings))
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


def start_on_workers(fanout, plan: RunPlan, *,
                     timeout: float | None = None) -> dict[int, dict]:
    """Start ``plan`` on every one of its workers at once; ``{worker: run_worker.py's report}``.

    All or nothing: if any worker cannot start it, it is stopped on the others (a job that
    waits for a missing peer would only hang) and RunError names the workers and why.
    ``timeout``: seconds each worker's start may take (None: the fan-out's). Only under the
    lease ``start_job`` holds (``start_plan``).
    """
    from tpufab.ssh.remote_files import put_each

    workers = plan.workers
    open_workers(fanout, workers, f"start run {plan.run_id}")
    contents = {w: json.dumps(plan.environments[w].public).encode() for w in workers}
    puts = put_each(fanout, contents, plan.env_file(), mode=0o600)
    failed = {w: r.outcome for w, r in puts.items() if not r.ok}
    started: dict[int, dict] = {}
    if not failed:
        secrets = plan.secrets
        stdin = json.dumps(secrets).encode() if secrets else None
        results = run_with_files(fanout, [launch_file(), plan.recipe], start_command(plan),
                                 workers, stdin=stdin, timeout=timeout)
        for w, r in results.items():
            data = read_answer(r.stdout) if r.ok else None
            if data and data.get("pid"):
                started[w] = data
            else:
                failed[w] = failure_reason(r)
    if failed:
        if started:
            fanout.run(stop_command(plan.run_id, 2.0), workers=sorted(started), timeout=timeout)
        # where the env file was written and the start failed (a worker whose put failed
        # has none, and may not answer: asking it again would cost its timeout again)
        leftover = [w for w in workers if w not in started and puts[w].ok]
        fanout.run(["rm", "-f", plan.env_file()], workers=leftover, timeout=timeout)
        reasons = {}
        for w, why in failed.items():
            reasons.setdefault(why, []).append(w)
        detail = mask("; ".join(f"{nodeset.fold(ws)}: {why}" for why, ws in reasons.items()),
                      plan.secrets)
        tail = (f" It was stopped on {nodeset.fold(started)} so no worker waits for a missing "
                "peer." if started else "")
        raise RunError(f"Run {plan.run_id} could not start on {nodeset.fold(failed)} "
                       f"({detail}).{tail}")
    return started


def start_plan(pod, plan: RunPlan, *, timeout: float | None = None) -> dict[int, dict]:
    """Start ``plan`` everywhere; Ctrl-C while starting stops it again, in one sentence.
    A plan without an image gets the pod's ``image`` setting (tpufab.yaml's ``image:``), so
    babysit's attempts and launch's run use it as `run` does."""
    from dataclasses import replace

    from tpufab.ssh.results import FanoutInterrupted
    from tpufab.steps.runs import running as jobs

    image = None if plan.image else getattr(getattr(pod, "settings", None), "image", None)
    if image:
        from tpufab.steps.host.images import check_image

        plan = replace(plan, image=image_for_run(pod, check_image(image), timeout=timeout))

    try:
        return start_on_workers(pod.fanout, plan, timeout=timeout)
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


# what each command of wait_port's rounds may take (to connect, and to run) past the time left:
# near the end a status only picks the sentence (the port did not answer either way), so a
# slow answer there costs nothing but a worse reason
ROUND_SLACK = 5.0


def wait_port(fanout, run_id: str, port: int, *, worker: int = 0, timeout: float = WAIT_TIMEOUT,
              probe: float = 5.0, slack: float = ROUND_SLACK) -> tuple[bool, str]:
    """Wait (at most ``timeout`` s) until ``port`` answers on ``worker`` while the run lives.

    Each round asks the worker to try for up to ``probe`` s (``remote/ports.py``), then checks
    that the run is still running there. Connecting may take what is left of ``timeout`` plus
    ``slack``, and each command as long (the probe: ``probe`` at most, plus ``slack``); the
    fan-out gives up on a worker that stops answering at those two plus 4 s. So a worker that
    freezes mid-round ends the wait at most ``probe + 4 * slack + 8`` s (33 s by default)
    past ``timeout``, not never. Returns ``(True, "after N s")`` or ``(False, why)``.
    """
    began = time.monotonic()

    def left() -> float:
        return timeout - (time.monotonic() - began)

    def within(run: float):
        """``fanout`` with the command bounded by ``run`` s, and connecting by what is left of
        the wait (a loaded worker may be slow to let us in while there is time) plus slack."""
        return fanout.bound(connect_timeout=min(fanout.connect_timeout, max(0.0, left()) + slack),
                           command_timeout=run)

    while True:
        trying = max(0.1, min(probe, left()))
        result = run_script(within(trying + slack), "ports.py", ["wait", int(port), trying],
                            [worker])[worker]
        answer = read_answer(result.stdout) if result.ok else None
        if answer and answer.get("open"):
            return True, f"after {time.monotonic() - began:.1f} s"
        why = (answer or {}).get("error") or failure_reason(result)
        state = statuses(within(max(0.0, left()) + slack), [worker])[worker]
        entry = next((e for e in state.runs if e.get("run") == run_id), None)
        if entry is not None and entry.get("state") != "running":
            return False, f"the run ended on {nodeset.label(worker)} ({entry.get('state')}" + (
                f", exit {entry['exit_code']}" if entry.get("exit_code") is not None else "") \
                + f") before port {port} answered"
        if left() <= 0:
            return False, f"port {port} did not answer on {nodeset.label(worker)} within " \
                          f"{timeout:g} s ({why})"


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
        ok, how = wait_port(pod.fanout, plan.run_id, port, worker=worker, timeout=timeout)
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
