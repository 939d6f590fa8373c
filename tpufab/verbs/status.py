"""status and babysit."""

from __future__ import annotations

from collections.abc import Sequence

from tpufab.term import tables
from tpufab.verbs.common import WIDE_HELP, chosen_name_note, pod_for, progress, settings_from_flags
from tpufab.verbs.declare import Opt, verb
from tpufab.verbs.jobs import RUN_OPTIONS

STATUS_TIMEOUT = 60.0     # seconds for every worker to answer
BABYSIT_TIMEOUT = 600.0   # seconds per step (setup, deploy, start, a check); never the follow


@verb(pod_method="status", view=("as_json", "wide"), options={"wide": WIDE_HELP})
def status(*, name: str | None = None, as_json: bool = False, wide: bool = False,
           timeout: float = STATUS_TIMEOUT,
           zone: str | None = None, project: str | None = None,
        no_os_login: bool = False, jump: str | None = None) -> int:
    """The node and every worker: reachable, TPU free or busy, runs, commit, mounts, disk.

    Exit code 0 when the node is READY and every worker answered, 1 otherwise. ``timeout``:
    seconds a worker has to answer (default 60; connecting at most connect_timeout).
    """
    from tpufab.term.console import stdout
    from tpufab.views.report import show

    settings = settings_from_flags(name=name, zone=zone, project=project,
                                   no_os_login=no_os_login,
                                   jump=jump, timeout=timeout)
    if not as_json and settings.name:   # which pod is asked, while it is asked
        progress(f"Pod {chosen_name_note(settings)}")
    found = pod_for(settings).status(timeout=timeout)
    if wide and not as_json:
        tables.wide(stdout())
    show(found, as_json=as_json)
    return 0 if found.healthy else 1


@verb(pod_method="babysit", options={"recipe": RUN_OPTIONS["recipe"], "args": RUN_OPTIONS["args"],
                 "max_restarts": Opt("Recoveries allowed.", min=0),
                 "restart_on_failure": "Also restart when the recipe itself fails.",
                 "max_restarts_on_errors": Opt("Restarts allowed when the recipe exits "
                                               "non-zero by itself (preemption, maintenance "
                                               "and host failure do not use them).",
                                               metavar="N"),
                 "restart_on_exit": Opt("Exit codes always restarted, without using the error "
                                        "budget (e.g. 42,143; 143 = killed by SIGTERM).",
                                        metavar="CODES"),
                 "before_maintenance": Opt("Send the recipe this signal (e.g. USR1) before an "
                                           "announced maintenance window, then restart it.",
                                           metavar="SIGNAL"),
                 "maintenance_margin": Opt("How long before the window to signal.",
                                           metavar="DURATION"),
                 "setup_script": "Setup a recreated node runs (default: the last one).",
                 "no_deploy": "Skip deploying.", "direct": "Deploy straight to the workers.",
                 "stall": RUN_OPTIONS["stall"],
                 "stall_action": Opt("After a stall: wait (keep following; the default), kill "
                                     "(babysit ends) or restart (the next attempt).",
                                     metavar="wait|kill|restart"),
                 "stall_progress_file": RUN_OPTIONS["stall_progress_file"],
                 "poll": Opt("Seconds between checks (tests).", hidden=True),
                 "ray": "Run the recipe as a Ray job on the pod's Ray cluster (`tpufab ray "
                        "up` before each attempt, then `tpufab ray submit`'s path).",
                 "ray_options": Opt("With --ray: more `ray start` options for every host, as "
                                    "one string (e.g. \"--num-cpus=8\").", metavar="OPTIONS")})
def babysit(recipe: str, *, name: str | None = None, max_restarts: int = 3, args: str = "",
            restart_on_failure: bool = False, max_restarts_on_errors: int = 0,
            restart_on_exit: str = "", before_maintenance: str | None = None,
            maintenance_margin: str = "10m", env: Sequence[str] | None = None,
            setup_script: str | None = None, no_deploy: bool = False, direct: bool = False,
            poll: float | None = None, timeout: float = BABYSIT_TIMEOUT,
            zone: str | None = None, project: str | None = None,
        no_os_login: bool = False, jump: str | None = None, stall: str | None = None,
            stall_action: str = "wait", stall_progress_file: str | None = None,
            ray: bool = False, ray_options: str = "") -> int:
    """Run a recipe and keep it running through preemptions (recreate, set up, restart).

    ``args``: the recipe's arguments as one string, split like a shell would (as `run`).
    ``env``: ``K=V`` or ``K`` (forward the local value), as `run`. ``setup_script``: what a
    recreated node runs first (default: the script the workers last ran with `tpufab setup`).
    ``timeout``: seconds each step on the workers may take (setup, deploy, start, each
    check; default 600); following the recipe's logs has no limit.
    ``max_restarts_on_errors``: how often a recipe that exits non-zero by itself is restarted
    (default 0); ``restart_on_exit``: codes restarted always (they count against
    --max-restarts only). Each restart says why; the end counts them by reason.
    ``before_maintenance``: a signal sent to the recipe ``maintenance_margin`` before a
    node's announced maintenance window (upcomingMaintenance); the attempt that ends after it
    restarts as a maintenance restart.
    ``stall``: the stall watchdog on every attempt (as `run --stall`; stacks into the
    attempt's logs), then ``stall_action``: wait, kill, or restart (counted as "stalled",
    not against the error budget).
    ``ray``: the recipe runs as a Ray job (see docs/ray.md); after a preemption the Ray
    cluster is started again on the recreated node before the job is resubmitted.
    Returns 0 when the recipe finished on every worker; otherwise BabysitError says why.
    """

    from tpufab.term.console import stderr
    from tpufab.views.runlogs import follow_view

    settings = settings_from_flags(name=name, zone=zone, project=project,
                                   no_os_login=no_os_login,
                                   jump=jump, timeout=timeout)
    result = pod_for(settings).babysit(
        recipe, args=args, max_restarts=max_restarts,
        restart_on_failure=restart_on_failure, max_restarts_on_errors=max_restarts_on_errors,
        restart_on_exit=restart_on_exit, before_maintenance=before_maintenance,
        maintenance_margin=maintenance_margin, env=list(env or ()), setup_script=setup_script,
        no_deploy=no_deploy, direct=direct, poll=poll, timeout=timeout, stall=stall,
        stall_action=stall_action, stall_progress_file=stall_progress_file, ray=ray,
        ray_options=ray_options, console=stderr(),
        view=lambda workers: follow_view(workers, raw=True),
        out=lambda line: print(line, flush=True))
    return result.exit_code


# --- issue 27: budgets, maintenance, top
@verb(pod_method="top", view=("as_json",),
      options={"once": "Print one frame and exit (for scripts).",
               "every": Opt("Seconds between frames (at least 1).", metavar="SECONDS"),
               "interval": Opt("Seconds each frame samples /proc over (at most 30).",
                               metavar="SECONDS"),
               "as_json": Opt("Print JSON (with --once one object; else one line a frame).",
                              flag="--json")})
def top(*, once: bool = False, every: float = 3.0, interval: float = 1.0, worker: str = "all",
        as_json: bool = False, timeout: float = 30.0, name: str | None = None,
        zone: str | None = None, project: str | None = None, no_os_login: bool = False,
        jump: str | None = None) -> int:
    """Every worker's CPU, memory, load, run processes and TPU use, live, folded.

    One fan-out a frame; workers whose values agree share a row, the outliers get their own.
    Ctrl-C stops it. Exit code 0 when every worker answered (the last frame), 1 otherwise.
    """
    from tpufab.views.report import show
    from tpufab.views.top import follow

    settings = settings_from_flags(name=name, zone=zone, project=project,
                                   no_os_login=no_os_login, jump=jump, timeout=timeout)
    pod = pod_for(settings)
    if once:
        frame = pod.top(once=True, every=every, interval=interval, workers=worker,
                        timeout=timeout)
        show(frame, as_json=as_json)
        return 0 if frame.ok else 1
    last = follow(lambda on_frame: pod.top(every=every, interval=interval, workers=worker,
                                           timeout=timeout, on_frame=on_frame),
                  as_json=as_json)
    return 0 if last is None or last.ok else 1
