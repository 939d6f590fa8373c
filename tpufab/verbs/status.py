"""status, babysit and top."""

from __future__ import annotations

from tpufab.term import tables
from tpufab.verbs.common import WIDE_HELP, chosen_name_note, progress
from tpufab.verbs.declare import Call, Opt, verb
from tpufab.verbs.jobs import RUN_OPTIONS

PLACE = 8   # where this family's verbs show in `tpufab --help`


@verb(pod_method="status", options={"wide": WIDE_HELP})
def status(call: Call, *, as_json: bool = False, wide: bool = False) -> int:
    """The node and every worker: reachable, TPU free or busy, runs, commit, mounts, disk.

    Exit code 0 when the node is READY and every worker answered, 1 otherwise. ``timeout``:
    seconds a worker has to answer (connecting at most connect_timeout).
    """
    from tpufab.term.console import stdout
    from tpufab.views.report import show

    if not as_json and call.settings.name:   # which pod is asked, while it is asked
        progress(f"Pod {chosen_name_note(call.settings)}")
    found = call()
    if wide and not as_json:
        tables.wide(stdout())
    show(found, as_json=as_json)
    return 0 if found.healthy else 1


@verb(pod_method="babysit", options={
    "recipe": RUN_OPTIONS["recipe"], "args": RUN_OPTIONS["args"],
    "max_restarts": Opt("Recoveries allowed.", min=0),
    "restart_on_failure": "Also restart when the recipe itself fails.",
    "max_restarts_on_errors": Opt("Restarts allowed when the recipe exits non-zero by itself "
                                  "(preemption, maintenance and host failure do not use "
                                  "them).", metavar="N"),
    "restart_on_exit": Opt("Exit codes always restarted, without using the error budget (e.g. "
                           "42,143; 143 = killed by SIGTERM).", metavar="CODES"),
    "before_maintenance": Opt("Send the recipe this signal (e.g. USR1) before an announced "
                              "maintenance window, then restart it.", metavar="SIGNAL"),
    "maintenance_margin": Opt("How long before the window to signal.", metavar="DURATION"),
    "setup_script": "Setup a recreated node runs (default: the last one).",
    "no_deploy": "Skip deploying.", "direct": "Deploy straight to the workers.",
    "stall": RUN_OPTIONS["stall"],
    "stall_action": Opt("After a stall: wait (keep following; the default), kill (babysit "
                        "ends) or restart (the next attempt).", metavar="wait|kill|restart"),
    "stall_progress_file": RUN_OPTIONS["stall_progress_file"],
    "step_pattern": RUN_OPTIONS["step_pattern"],
    "poll": Opt("Seconds between checks (tests).", hidden=True),
    "ray": "Run the recipe as a Ray job on the pod's Ray cluster (`tpufab ray up` before each "
           "attempt, then `tpufab ray submit`'s path).",
    "ray_options": Opt("With --ray: more `ray start` options for every host, as one string "
                       "(e.g. \"--num-cpus=8\").", metavar="OPTIONS"),
    "remote": "Hand the job to the project's supervisor (docs/supervisor.md) and return: it "
              "keeps the job going with the laptop closed."})
def babysit(call: Call) -> int:
    """Run a recipe and keep it running through preemptions (recreate, set up, restart).

    ``args``: the recipe's arguments as one string, split like a shell would (as `run`).
    ``env``: ``K=V`` or ``K`` (forward the local value), as `run`. ``setup_script``: what a
    recreated node runs first (default: the script the workers last ran with `tpufab setup`).
    ``timeout``: seconds each step on the workers may take (setup, deploy, start, each
    check); following the recipe's logs has no limit.
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
    ``remote``: the job goes to the project's supervisor (a small VM, state in Cloud Storage;
    docs/supervisor.md): its id and the commands to follow or cancel it are printed, and the
    command returns; `tpufab jobs` shows it.
    Returns 0 when the recipe finished on every worker; otherwise BabysitError says why.
    """
    from tpufab.term.console import stderr
    from tpufab.views.runlogs import follow_view

    if call.args.get("remote"):
        from tpufab.views.supervised import show_handed_over

        handed = call(console=stderr())
        show_handed_over(handed)
        return handed.exit_code
    return call(console=stderr(), view=lambda workers: follow_view(workers, raw=True),
                out=lambda line: print(line, flush=True)).exit_code


@verb(pod_method="top",
      options={"once": "Print one frame and exit (for scripts).",
               "tpu": "Show the TPU rows: per host, per chip (libtpu's metrics), folded.",
               "every": Opt("Seconds between frames (at least 1).", metavar="SECONDS"),
               "interval": Opt("Seconds each frame samples /proc over (at most 30).",
                               metavar="SECONDS"),
               "as_json": Opt("Print JSON (with --once one object; else one line a frame).",
                              flag="--json")})
def top(call: Call, *, as_json: bool = False, tpu: bool = False) -> int:
    """Every worker's CPU, memory, load, run processes and TPU use, live, folded.

    One fan-out a frame; workers whose values agree share a row, the outliers get their own.
    Ctrl-C stops it. Exit code 0 when every worker answered (the last frame), 1 otherwise.
    """
    from tpufab.views.report import show
    from tpufab.views.top import follow

    if call.args["once"]:
        frame = call()
        show(frame, as_json=as_json, tpu=tpu)
        return 0 if frame.ok else 1
    last = follow(lambda on_frame: call(on_frame=on_frame), as_json=as_json, tpu=tpu)
    return 0 if last is None or last.ok else 1
