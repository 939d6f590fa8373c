"""From a task file to results, and what an idle pod costs: launch, autostop, gc."""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import contextmanager

from tpufab.errors import ConfigError
from tpufab.verbs.common import note, say
from tpufab.verbs.declare import Call, Opt, verb

PLACE = 2   # where this family's verbs show in `tpufab --help`
GROUPS = {"ray": "Ray on the pod: up, status, submit, down (docs/ray.md)."}


@verb(options={
    "task": Opt("Task file: tpufab's schema or a SkyPilot task YAML.", metavar="TASK.yaml"),
    "type": Opt("Accelerator type (overrides the task's).", short="-t"),
    "spot": "Spot capacity (overrides the task's).",
    "version": "Runtime version (overrides the task's).",
    "down": "Delete the node after the run (logs saved locally first), success or failure.",
    "detach": "Start the run and return without following it.",
    "idle": Opt("Arm autostop: delete the node after this long idle (30m, 2h).",
                metavar="DURATION"),
    "dry_run": "Print the plan (spec, steps, envs masked) and touch nothing.",
    "direct": "Deploy the commit over SSH instead of through the git remote.",
    "force_setup": "Run the task's setup even where it is recorded as done (as `tpufab "
                   "setup --force`).",
    "zones": Opt("Zones to try in order on a stockout.", metavar="Z1,Z2"),
    "retry_for": Opt("Keep retrying stockouts this long (30m, 2h).", metavar="DURATION"),
    "on_interrupt": Opt("On Ctrl-C: kill or detach (default: ask).", metavar="kill|detach"),
    "stall": Opt("As `run --stall`: no new output for this long: stacks, then --stall-action.",
                 metavar="DURATION"),
    "stall_action": "After a stall: wait (the default) or kill the run.",
    "stall_progress_file": Opt("As `run --stall-progress-file`: progress is this file's mtime "
                               "advancing (relative to $TPUFAB_RUN_DIR, or absolute).",
                               metavar="PATH"),
    "step_pattern": Opt("As `run --step-pattern`: what a step line looks like (the straggler "
                        "detector's).", metavar="REGEX"),
    "ray": "Run the task's run once, as a Ray job on the pod's Ray cluster (brought up "
           "first), and follow it.",
    "allow_file": Opt("Copy this file the task names although it is private or in a "
                      "credential store (~/.ssh, ~/.tpufab, ~/.config/gcloud, ...); once per "
                      "file, as the plan shows it.", metavar="PATH")})
def launch(task: str, *, name: str | None = None, type: str | None = None,
           zone: str | None = None, project: str | None = None, spot: bool = False,
           version: str | None = None, env: Sequence[str] | None = None,
           secret: Sequence[str] | None = None, down: bool = False,
           detach: bool = False, idle: str | None = None, dry_run: bool = False,
           direct: bool = False, zones: str | None = None, retry_for: str | None = None,
           on_interrupt: str | None = None, force_setup: bool = False,
           stall: str | None = None, stall_action: str = "wait",
           stall_progress_file: str | None = None, ray: bool = False,
           allow_file: Sequence[str] | None = None, step_pattern: str | None = None) -> int:
    """Create (or reuse) a pod, deploy, mount, set up and run TASK.yaml, and follow it."""
    from tpufab.pod.launched import launch as launching
    from tpufab.pod.run import Run
    from tpufab.term.console import stderr
    from tpufab.verbs.jobs import INTERRUPT_CHOICES, check_stall_flags, follow_started

    if on_interrupt is not None and on_interrupt not in INTERRUPT_CHOICES:
        raise ConfigError(f"--on-interrupt takes kill or detach, not {on_interrupt!r}.")
    if ray and stall:
        raise ConfigError("--stall watches the output of a run tpufab follows, and --ray hands "
                          "the run to Ray: give one or the other.")
    stall_seconds = check_stall_flags(stall, stall_action, detach=detach, local=False,
                                      wait_port=None, progress_file=stall_progress_file)
    step_pattern = Run.check_step_pattern(step_pattern)    # before anything starts
    launched = launching(task, name=name, type=type, zone=zone, project=project, spot=spot,
                         version=version, env=env, secret=secret, down=down, detach=detach,
                         idle=idle, dry_run=dry_run, direct=direct, zones=zones,
                         retry_for=retry_for, console=stderr(), progress=note,
                         setup_view=_setup_view, force_setup=force_setup, ray=ray,
                         allow_file=allow_file)
    plan = launched.plan
    if dry_run:
        kind = "SkyPilot task" if plan.task.source == "skypilot" else "task"
        say(f"Plan for {task} ({kind}) on {plan.settings.name}:")
        if plan.name_note:
            say(f"  ({plan.name_note})")
        for n, line in enumerate(plan.steps, 1):
            say(f"  {n}. {line}")
        say("Dry run: nothing was created, deployed, mounted or started.")
        return 0
    try:
        if plan.ray:
            return launched.ray_job()
        return follow_started(launched.run, detach=plan.detach,
                               on_interrupt="kill" if down else on_interrupt,
                               stall=stall_seconds, stall_action=stall_action,
                               stall_progress_file=stall_progress_file,
                               step_pattern=step_pattern)
    finally:
        if down:
            launched.down()


@contextmanager
def _setup_view(workers):
    """The setup's output, folded, with a progress line (as `tpufab setup` shows it)."""
    from tpufab.views.progress import WorkerProgress
    from tpufab.views.runlogs import follow_view, tee

    view = follow_view(workers)
    try:
        with WorkerProgress("setup", len(workers)) as progress:
            yield tee(view, progress)
    finally:
        view.close()


@verb(pod_method="autostop", options={
    "idle": Opt("Delete the pod after this long idle: no run, no TPU holder, no tpufab "
                "session (30m, 2h).", metavar="DURATION"),
    "ttl": Opt("Delete the pod this long from now, busy or not (8h).", metavar="DURATION"),
    "cancel": "Remove the watchdog."})
def autostop(call: Call) -> None:
    """Delete the pod once idle (no run, TPU holder or tpufab session on any worker) or at a
    TTL (counted on worker 0's clock); --cancel.

    ``timeout``: seconds every worker has to answer."""
    from tpufab.views.report import show

    show(call())


@verb(options={"yes": Opt("Do not ask for confirmation.", short="-y"),
               "all_zones": "Every zone of the project, not only the current one."})
def gc(*, yes: bool = False, all_zones: bool = False, zone: str | None = None,
       project: str | None = None) -> None:
    """Delete preempted/terminated/failed nodes and suspended/failed queued resources."""
    from tpufab.pod.pods import gc as collect
    from tpufab.term.console import stdout

    collect(zone=zone, project=project, all_zones=all_zones, yes=yes, console=stdout())


@verb(name="up", group="ray", pod_method="ray_up",
      options={"options": Opt("More `ray start` options for every host, after -- (e.g. -- "
                              "--num-cpus=8).", rest=True, metavar="RAY_START_OPTIONS..."),
               "join_batch": Opt("Join this many hosts at a time, each batch seen by the head "
                                 "before the next (default 0: all at once).", metavar="N")})
def ray_up(call: Call) -> None:
    """Start Ray on the pod: the head on worker 0, every other host joined; prints the address.

    Each host gets the TPU environment Ray labels its node from (TPU_NAME, TPU_WORKER_ID,
    TPU_ACCELERATOR_TYPE, TPU_TOPOLOGY); Ray is installed where it is missing. Again on a pod
    where Ray is up: a quick no-op; a host where Ray died is rejoined. See docs/ray.md."""
    from tpufab.reports import up_sentence

    say(up_sentence(call(progress=note), call.pod.name))


@verb(name="status", group="ray", pod_method="ray_status")
def ray_status(call: Call, *, as_json: bool = False) -> int:
    """Ray on the pod: the nodes the head sees (TPU, head resource, slice labels), and jobs.

    Exits 0 when every host joined, 3 when Ray is not up or a host is missing."""
    from tpufab.views.report import show

    report = call()
    show(report, as_json=as_json)
    return 0 if report.healthy else 3


@verb(name="submit", group="ray", pod_method="ray_submit",
      options={"recipe": "Recipe: a Python file (run with the workers' Python) or an "
                         "executable.",
               "extra": Opt("The recipe's arguments, as given (after -- when one starts with "
                            "a dash).", rest=True, metavar="ARGS..."),
               "no_deploy": "Skip deploying the current commit.",
               "direct": "Deploy straight to the workers over SSH."})
def ray_submit(call: Call) -> int:
    """Run a recipe as a Ray job from this commit and follow its logs; exits with its status.

    Deploys the commit as `tpufab run` does, submits through Ray's Job API over a port
    forwarded to the head's 127.0.0.1 (the dashboard is never exposed), prints the job's
    output on stdout with secrets masked. `--env` values reach every Ray worker of the job;
    `--secret` values only the job's entrypoint (from a 0600 file, never Ray's job record)."""
    done = call(out=lambda line: print(line, flush=True), progress=note)
    text = (f"Ray job {done.job} {done.status.lower()}: exit {done.exit_code} "
            f"({done.seconds:.1f} s).")
    note(text if done.exit_code == 0 else f"{text} {done.message}".strip(),
         None if done.exit_code == 0 else "red")
    return done.exit_code


@verb(name="down", group="ray", pod_method="ray_down",
      options={"grace": Opt("Seconds Ray's processes get to stop before they are killed.",
                            min=0)})
def ray_down(call: Call) -> None:
    """Stop Ray on every host (ray stop, then forced); nothing is left holding the TPU."""
    from tpufab.reports import down_sentence

    say(down_sentence(call(), call.pod.name))
