"""From a task file to results, and what an idle pod costs: launch, autostop, gc."""

from __future__ import annotations

from collections.abc import Sequence

from tpufab.errors import ConfigError, TpufabError
from tpufab.verbs.common import note, pod_for, say, settings_from_flags
from tpufab.verbs.declare import Opt, verb

AUTOSTOP_TIMEOUT = 60.0   # seconds for every worker to answer arming or cancelling


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
    "zones": Opt("Zones to try in order on a stockout.", metavar="Z1,Z2"),
    "retry_for": Opt("Keep retrying stockouts this long (30m, 2h).", metavar="DURATION"),
    "on_interrupt": Opt("On Ctrl-C: kill or detach (default: ask).", metavar="kill|detach")})
def launch(task: str, *, name: str | None = None, type: str | None = None,
           zone: str | None = None, project: str | None = None, spot: bool = False,
           version: str | None = None, env: Sequence[str] | None = None, down: bool = False,
           detach: bool = False, idle: str | None = None, dry_run: bool = False,
           direct: bool = False, zones: str | None = None, retry_for: str | None = None,
           on_interrupt: str | None = None) -> int:
    """Create (or reuse) a pod, deploy, mount, set up and run TASK.yaml, and follow it."""
    from tpufab import launch as launching
    from tpufab import lifecycle
    from tpufab.launch import step
    from tpufab.taskfile import load_task
    from tpufab.verbs.jobs import INTERRUPT_CHOICES

    if on_interrupt is not None and on_interrupt not in INTERRUPT_CHOICES:
        raise ConfigError(f"--on-interrupt takes kill or detach, not {on_interrupt!r}.")
    idle_s = lifecycle.parse_duration(idle, "--idle")
    retry_s = lifecycle.parse_duration(retry_for, "--retry-for")
    zone_list = [z.strip() for z in (zones or "").split(",") if z.strip()]
    if zone_list and zone and zone_list[0] != zone:
        raise ConfigError("--zone and --zones disagree; give the zones to try in order with "
                          "--zones only.")
    task_file = load_task(task)
    settings = settings_from_flags(project=project)
    plan = launching.plan(task_file, settings=settings, name=name, type=type,
                          zone=zone or (zone_list[0] if zone_list else None), spot=spot,
                          version=version, env=env or (), down=down, detach=detach, idle=idle_s,
                          direct=direct)
    s = plan.settings
    kind = "SkyPilot task" if task_file.source == "skypilot" else "task"
    if dry_run:
        say(f"Plan for {task} ({kind}) on {s.name}:")
        for n, line in enumerate(plan.steps, 1):
            say(f"  {n}. {line}")
        say("Dry run: nothing was created, deployed, mounted or started.")
        return 0
    note(f"Launching {task} ({kind}) on {s.name}: {len(plan.steps)} steps.")
    from tpufab.console import stderr

    with step("create"):
        launching.provision(plan, console=stderr(), zones=zone_list or None, retry_for=retry_s)
    if not down:
        from tpufab import current

        current.remember(s.name, zone=s.zone, project=s.project, set_by="launch")
    started: list = []        # (run id, workers, secrets) of the run, for --down
    try:
        return _after_create(plan, started, on_interrupt="kill" if down else on_interrupt)
    finally:
        if down:
            _down(plan, started)


def _after_create(plan, started: list, *, on_interrupt: str | None) -> int:
    from tpufab import autostop, babysit, nodeset
    from tpufab import launch as launching
    from tpufab.fanout import Tee
    from tpufab.jobs import FoldingView
    from tpufab.launch import step
    from tpufab.progress import WorkerProgress
    from tpufab.verbs.jobs import _start_and_follow

    with step("connect"):
        pod = pod_for(plan.settings)
    everyone = nodeset.fold(pod.workers)
    if plan.idle:
        with step("autostop"):
            state = autostop.arm(pod, plan.settings, idle=plan.idle)
            note(f"Autostop: {autostop.describe(state)}.")
    restore = plan.restore()
    if plan.commit:
        with step("deploy"):
            report = babysit.restore_commit(pod, restore, root=plan.root, direct=plan.direct,
                                            progress=lambda msg: note(f"deploy: {msg}", "dim"))
            changed = [r.worker for r in report.rows if r.changed]
            how = f"updated {nodeset.fold(changed)}" if changed else "already there"
            note(f"Deployed {report.commit[:12]} to {report.dir} on {everyone} ({how}, "
                 f"{report.seconds:.1f} s).")
    for m in plan.mounts:
        with step(f"mount {m.url}"):
            report = babysit.restore_mount(pod, m, endpoint=plan.settings.storage_endpoint)
            fresh = sum(r.action == "mounted" for r in report.rows)
            note(f"Mounted {m.url} at {m.at} on {everyone} ({m.driver}; "
                 f"{fresh} mounted now, {len(report.rows) - fresh} already had it).")
    for remote, local in plan.files:
        with step(f"put {remote}"):
            launching.put_file(pod, remote, local)
            note(f"Put {local} at {remote} on {everyone}.")
    if restore.setup_script is not None:
        with step("setup"):
            view = FoldingView(pod.workers).start()
            try:
                with WorkerProgress("setup", len(pod.workers)) as progress:
                    outcomes = babysit.restore_setup(pod, restore, sink=Tee([view, progress]),
                                                     env=plan.forwarded.public,
                                                     secrets=plan.forwarded.secrets)
            finally:
                view.close()
            ran = [w for w, o in outcomes.items() if o.status == "ran"]
            skipped = [w for w in outcomes if w not in ran]
            parts = ([f"ran on {nodeset.fold(ran)}"] if ran else []) + (
                [f"already done on {nodeset.fold(skipped)} (this content ran there before)"]
                if skipped else [])
            note(f"Setup: {'; '.join(parts)}.")
    with step("run"):
        run = launching.run_plan(pod, plan)
    started.append((run.run_id, run.workers, list(run.secrets.values())))
    return _start_and_follow(pod, run, detach=plan.detach, on_interrupt=on_interrupt)


def _down(plan, started: list) -> None:
    """Save every log, then delete the node, whatever happened before."""
    from tpufab import launch as launching
    from tpufab import lifecycle
    from tpufab import pod as pods
    from tpufab.jobs import local_log_dir

    for run_id, workers, secrets in started:
        try:
            into = local_log_dir(run_id)
            pod = pod_for(plan.settings)
            saved = launching.save_logs(pod, run_id, workers, into, secrets)
            note(f"Saved the logs of run {run_id} from {len(saved)} workers in {into}/.")
        except (TpufabError, OSError) as err:
            note(f"Could not save every log of run {run_id} ({err}); deleting the node "
                 "anyway (--down).", "yellow")
    pods.forget(plan.settings)
    from tpufab import current
    from tpufab.console import stderr

    lifecycle.delete(plan.settings, yes=True, console=stderr())
    current.forget(plan.settings.name)


@verb(options={
    "idle": Opt("Delete the pod after this long idle: no run, no TPU holder (30m, 2h).",
                metavar="DURATION"),
    "ttl": Opt("Delete the pod this long from now, busy or not (8h).", metavar="DURATION"),
    "cancel": "Remove the watchdog."})
def autostop(*, name: str | None = None, idle: str | None = None, ttl: str | None = None,
             cancel: bool = False, timeout: float = AUTOSTOP_TIMEOUT, zone: str | None = None,
             project: str | None = None, jump: str | None = None) -> None:
    """Delete the pod once idle (no run, no TPU holder on any worker) or at a TTL; --cancel.

    ``timeout``: seconds every worker has to answer (default 60)."""
    from tpufab import autostop as stopping
    from tpufab import lifecycle

    idle_s = lifecycle.parse_duration(idle, "--idle")
    ttl_s = lifecycle.parse_duration(ttl, "--ttl")
    if cancel and (idle_s or ttl_s):
        raise ConfigError("--cancel removes the autostop; it takes no --idle or --ttl.")
    if not cancel and not idle_s and not ttl_s:
        raise ConfigError("Say when to stop: --idle 30m (after 30 idle minutes), --ttl 8h (8 "
                          "hours from now), both, or --cancel.")
    settings = settings_from_flags(name=name, zone=zone, project=project, timeout=timeout,
                                   jump=jump)
    pod = pod_for(settings)
    if cancel:
        was = stopping.cancel(pod, settings)
        say(f"Autostop of {pod.name} cancelled" + (f" (it was: {was})." if was else
                                                    "; none was armed."))
        return
    state = stopping.arm(pod, settings, idle=idle_s, ttl=ttl_s)
    say(f"Autostop of {pod.name}: {stopping.describe(state)}. `tpufab status` shows it; "
        "`tpufab autostop --cancel` removes it.")


@verb(options={"yes": Opt("Do not ask for confirmation.", short="-y"),
               "all_zones": "Every zone of the project, not only the current one."})
def gc(*, yes: bool = False, all_zones: bool = False, zone: str | None = None,
       project: str | None = None) -> None:
    """Delete preempted/terminated/failed nodes and suspended/failed queued resources."""
    from tpufab import lifecycle
    from tpufab.console import stdout

    lifecycle.gc(settings_from_flags(zone=zone, project=project), yes=yes, all_zones=all_zones,
                 console=stdout())

