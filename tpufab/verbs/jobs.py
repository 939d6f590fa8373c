"""Job verbs: run, logs, runs, kill; supervised jobs and the supervisor VM (`tpufab jobs`,
`tpufab supervisor up | status | ssh | down`, docs/supervisor.md). Recipe output goes to
stdout, tpufab's own notes to stderr, so ``tpufab run x.sh > out.txt`` keeps only what the
recipe printed."""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence

from tpufab.config import TIMEOUTS
from tpufab.errors import ConfigError, TpufabError
from tpufab.term.terminal import relative_path
from tpufab.verbs.common import note, say
from tpufab.verbs.declare import Call, Opt, verb

PLACE = 7   # where this family's verbs show in `tpufab --help`
GROUPS = {"jobs": "Supervised jobs, read from the supervisor's bucket (`tpufab jobs`: list them).",
          "supervisor": "The supervisor VM that keeps supervised jobs going "
                        "(`tpufab supervisor status`)."}

INTERRUPT_CHOICES = ("kill", "detach")   # --on-interrupt: what Ctrl-C while following does


RUN_OPTIONS = {
    "recipe": "Recipe: an executable file, e.g. recipes/jax_hello.sh.",
    "extra": Opt("The program's arguments, passed through as given (after -- when one "
                  "starts with a dash).", rest=True, metavar="ARGS..."),
    "args": "The recipe's arguments, as one quoted string (before ARGS).",
    "detach": "Start it and return.",
    "no_deploy": "Skip deploying the current commit.",
    "direct": "Deploy straight to the workers over SSH.",
    "wip": "Deploy uncommitted work as a snapshot.",
    "local": "Run on this machine instead.",
    "workers": Opt("With --local: how many processes.", min=1),
    "on_interrupt": "Ctrl-C: kill the run everywhere, or detach (default: ask).",
    "spmd": "torch_xla SPMD (XLA_USE_SPMD=1).",
    "raw": "Follow every worker's lines, prefixed (default: folded, each line once).",
    "check": "Run the quick checks of `tpufab check` first; refuse to start on a problem.",
    "wait_port": Opt("Return once this port answers on worker 0 (the run goes on).",
                     min=1),
    "wait_timeout": Opt("With --wait-port: seconds to wait before showing the logs (default: "
                        f"{TIMEOUTS['run --wait-port'].text}).", min=1),
    "stall": Opt("No new output line from any worker for this long (e.g. 15m; at least 10s): "
                 "take every worker's stacks, print them folded, then --stall-action.",
                 metavar="DURATION"),
    "stall_action": "After a stall: wait (keep following; the default) or kill the run.",
    "step_pattern": Opt("A regular expression matching the recipe's step lines (default: "
                        "`step 120`, `Step 120/1000`, `[step=120]`, `12.3 it/s`); a group "
                        "named step (or the first of digits) is the step's number. A host "
                        "10% slower than the median for 3 steps in a row is named.",
                        metavar="REGEX"),
    "stall_progress_file": Opt("With --stall: progress is this file's mtime advancing on any "
                               "worker (the recipe touches it; relative to $TPUFAB_RUN_DIR, "
                               "or absolute), instead of new output lines.", metavar="PATH"),
}


IMAGE_OPTION = Opt("Run the recipe inside this container image on every host (pulled where "
                   "missing, pinned by digest; the image setting by default; docs/images.md).",
                   metavar="IMAGE")


@verb(options={**RUN_OPTIONS, "image": IMAGE_OPTION}, pod_method="start", api_only=("deploy",))
def run(call: Call, *, detach: bool = False, on_interrupt: str | None = None,
        raw: bool = False, color: bool = False, stall: str | None = None,
        stall_action: str = "wait", stall_progress_file: str | None = None,
        step_pattern: str | None = None) -> int:
    """Run a recipe on every worker at once (deploying first) and follow its logs.

    A Python file runs with the workers' Python: `tpufab run train.py model=tiny
    global_batch_size=8`. Everything after the recipe is passed through as its arguments,
    each exactly as given (after `--` when one starts with a dash: `tpufab run x.sh --
    --steps 10`); `--args '...'` (one string, split as a shell would) comes first.

    With --check, the quick checks of `tpufab check` run first and any problem stops the run
    before it starts (the deployed commit is compared only with --no-deploy: otherwise run
    deploys one commit everywhere). With --wait-port, return instead (the run goes on) once
    that port answers on worker 0, e.g. a model server; if it never does within
    --wait-timeout, show the logs and fail.

    ``timeout``: seconds each step before the recipe starts may take on the workers (deploy,
    start); following the logs afterwards has no limit. One job at a time: a run while
    another one runs on the pod is refused with one sentence.
    """
    if on_interrupt is not None and on_interrupt not in INTERRUPT_CHOICES:
        raise ConfigError(f"--on-interrupt takes kill or detach, not {on_interrupt!r}.")
    local, wait_port = call.args["local"], call.args["wait_port"]
    stall_seconds = check_stall_flags(stall, stall_action, detach=detach, local=local,
                                      wait_port=wait_port, progress_file=stall_progress_file)
    from tpufab.pod.run import Run

    step_pattern = Run.check_step_pattern(step_pattern)   # before anything starts
    try:
        run_ = call(progress=note)
    except TpufabError as err:
        tails = getattr(err, "tails", None)      # --wait-port: the port never answered
        if tails is not None:
            from tpufab.views.runlogs import print_folded

            print_folded(tails)
        raise
    if local:
        note(f"Local run {run_.run_id}: {run_.summary()}")
        return 0
    if wait_port is not None:
        return 0
    return follow_started(run_, detach=detach, on_interrupt=on_interrupt, raw=raw,
                          color=color, stall=stall_seconds, stall_action=stall_action,
                          stall_progress_file=stall_progress_file, step_pattern=step_pattern)


def follow_started(run, *, detach: bool, on_interrupt: str | None, raw: bool = False,
                   color: bool = False, stall: float | None = None,
                   stall_action: str = "wait", stall_progress_file: str | None = None,
                   step_pattern: str | None = None) -> int:
    """After the start: where its output goes, then detach or follow (launch too)."""
    if run.output_dir:
        note(f"Output: {run.output_dir} (profiles: {run.profile_dir})", "dim")
    if detach:
        note(f"Detached. Follow it with `tpufab logs --run {run.id} --follow`, list "
              f"runs with `tpufab runs`, stop it with `tpufab kill --run {run.id}`.")
        return 0
    return _follow_run(run, on_interrupt, raw, color=color, stall=stall,
                       stall_action=stall_action, stall_progress_file=stall_progress_file,
                       step_pattern=step_pattern)


def _follow_run(run, on_interrupt: str | None, raw: bool = False, *,
                color: bool = False, stall: float | None = None,
                stall_action: str = "wait", stall_progress_file: str | None = None,
                step_pattern: str | None = None) -> int:
    from tpufab import nodeset
    from tpufab.views.runlogs import follow_view, say_straggler

    workers = run.workers
    try:
        copy_dir = run.log_copy_dir()
    except OSError:
        copy_dir = None
    ended: dict[int, object] = {}
    watch = None

    def on_end(worker, state):
        ended[worker] = state
        # Only a recipe that ended: followers stopped by Ctrl-C or a lost connection say
        # nothing about the run.
        if state.ended and not state.ok and len(ended) < len(workers) and \
                not (watch is not None and watch.killed):     # the stall verdict says it
            running = [w for w in workers if w not in ended]
            note(f"{nodeset.label(worker)}: {run.plan.recipe.name} {state.label}; "
                  f"{nodeset.fold(running)} still running (Ctrl-C to stop following or to "
                  "stop the run).", "yellow")

    began = time.monotonic()
    view = run.watch_stragglers(follow_view(workers, raw=raw, color=color),
                                pattern=step_pattern, say=say_straggler, save_to=copy_dir)
    if stall is not None:
        view, watch = _watch_stall(run, view, stall, stall_action, stall_progress_file)
    states = run.follow(view, copy_dir=copy_dir, on_end=on_end)
    if watch is not None and watch.killed:
        raise watch.verdict()
    if states is None:
        return _interrupted(run, on_interrupt)
    note(run.finished(states, seconds=time.monotonic() - began, kept=relative_path(copy_dir)))
    return 0


def check_stall_flags(stall: str | None, action: str, *, detach: bool, local: bool,
                      wait_port: int | None, progress_file: str | None = None) -> float | None:
    """--stall in seconds, checked before anything starts (one sentence when it cannot be)."""
    from tpufab.pod.run import Run

    seconds = Run.check_stall(stall, action, progress_file=progress_file)
    if seconds is not None and (detach or local or wait_port is not None):
        flag = "--detach" if detach else "--local" if local else "--wait-port"
        raise ConfigError(f"--stall watches a run while tpufab follows it, which {flag} does "
                          "not; leave one of them out.")
    return seconds


def _watch_stall(run, view, seconds: float, action: str, progress_file: str | None = None):
    """The follower's view under the stall watchdog: notes on stderr, stacks folded there."""
    import sys

    def show(lines):
        from tpufab.term.terminal import neutralise_text

        sys.stderr.write("".join(neutralise_text(line) + "\n" for line in lines))
        sys.stderr.flush()

    return run.watch_stall(view, seconds=seconds, action=action, say=note, show=show,
                           progress_file=progress_file)


def ask_on_interrupt(run_id: str) -> str:
    """Interactive: ask; otherwise (or on a second Ctrl-C, or EOF) just stop following."""
    if not (sys.stdin.isatty() and sys.stderr.isatty()):
        return "detach"
    try:
        sys.stderr.write(f"\nStop run {run_id} on every worker [k], or just stop following "
                         "it [D]? ")
        sys.stderr.flush()
        answer = input().strip().lower()
    except (EOFError, KeyboardInterrupt):
        sys.stderr.write("\n")
        return "detach"
    return "kill" if answer in ("k", "kill", "s", "stop", "y", "yes") else "detach"


def _interrupted(run, on_interrupt: str | None) -> int:
    from tpufab import nodeset

    run_id, workers = run.id, run.workers
    choice = on_interrupt or ask_on_interrupt(run_id)
    if choice != "kill":
        note(f"Stopped following; run {run_id} keeps running on {nodeset.fold(workers)}. Follow it "
              f"again with `tpufab logs --run {run_id} --follow`; stop it with "
              f"`tpufab kill --run {run_id}`.")
        return 130
    note(f"Stopping run {run_id} on {nodeset.fold(workers)} ...")
    outcome = run.kill()
    errors = {w: o["error"] for w, o in outcome.items() if "error" in o}
    alive = [w for w, o in outcome.items() if o.get("still_running")]
    signals = {o.get("signal") for o in outcome.values() if o.get("signal")}
    if errors or alive:
        detail = "; ".join(f"{nodeset.label(w)}: {why}" for w, why in errors.items())
        if alive:
            detail += ("; " if detail else "") + f"still running on {nodeset.fold(alive)}"
        raise TpufabError(f"Could not stop run {run_id} everywhere ({detail}); try "
                          f"`tpufab kill --run {run_id}`.", exit_code=130)
    how = f" (SIG{'/SIG'.join(sorted(signals))})" if signals else " (it had already ended)"
    note(f"Stopped run {run_id} on {nodeset.fold(workers)}{how}.")
    return 130


@verb(options={"run": "Run id (default: the latest).",
               "follow": Opt("Keep following.", short="-f"),
               "raw": "Every line, prefixed by its worker."},
      pod_method="logs")
def logs(call: Call, *, raw: bool = False, color: bool = False) -> int:
    """A run's logs: worker 0's lines once, plus only the lines where others differ.

    ``timeout``: seconds to wait for the workers (for the logs so far; with --follow, no
    limit: following stops when the run ends, or after ``timeout`` if given). A worker that
    cannot be reached is named and makes logs fail.
    """
    from tpufab.views.runlogs import follow_view

    follow = call.args["follow"]
    # The workers masked the run's secrets as they wrote the log; the ones this machine
    # would forward are masked again (a log written by an older tpufab): Pod.logs does.
    report = call(progress=note, sink=(lambda workers: follow_view(workers, raw=raw,
                                                                   color=color))
                  if follow else None)
    if follow:
        if report.interrupted:
            note(f"Stopped following; run {report.run_id} keeps running.")
        elif report.ok:
            note(report.summary())
        report.check()
        return 130 if report.interrupted else 0
    try:
        _print_logs(report.logs, raw=raw, color=color, secrets=report.secrets)
    finally:
        report.close()
    report.check()
    if report.gone:
        note(f"No log from {report.gone_text()}.", "yellow")
    return 0


def _print_logs(logs, *, raw: bool, color: bool, secrets: Sequence[str], out=None) -> None:
    """Every worker's log, prefixed (raw) or folded (tpufab.views.runlogs)."""
    from tpufab.views.runlogs import print_logs

    print_logs(logs, raw=raw, color=color, secrets=secrets, out=out)


@verb(pod_method="runs")
def runs(call: Call, *, as_json: bool = False) -> int:
    """The runs the workers know, with each worker's state.

    ``timeout``: seconds for every worker to answer."""
    from tpufab.views.report import show

    report = call()
    show(report, as_json=as_json)
    if not as_json:   # --json says who did not answer in its data, and exits 0
        report.check()
    return 0


@verb(options={"run": "Run id (default: the latest).",
               "step_pattern": Opt("What a step line looks like, as `run --step-pattern`.",
                                   metavar="REGEX")},
      pod_method="stragglers")
def stragglers(call: Call, *, as_json: bool = False) -> int:
    """The per-host step table of a running or finished run, slowest first.

    From each worker's log: its step lines (the step pattern of `run`), how far each host got,
    and each host's median and slowest step, against the hosts' median. The times are those
    this machine measured while `run`, `launch` or `babysit` followed the run (with libtpu's
    metrics: each host's time outside collectives), else the timestamps the step lines start
    with; without either, the table says how far each host got.

    ``timeout``: seconds for every worker's log."""
    from tpufab.views.report import show

    report = call()
    show(report, as_json=as_json)
    return 0


@verb(options={"run": "Only this run.", "grace": Opt("Seconds between TERM and KILL.", min=0),
               "dry_run": "Only report.", "force": "Also stop protected holders."},
      pod_method="kill")
def kill(call: Call) -> int:
    """Free the TPU everywhere: stop runs and stale holders, then remove the lockfile.

    ``timeout``: seconds the kill may take on each worker (by default the grace period plus
    34 s, enough for TERM, the grace, KILL and the lockfile's settle time). A protected
    process (tpu-runtime, ...) still holding a device is named, with what to do about it
    (the same words `status` uses), and kill fails until it is gone."""
    from tpufab.views.report import show

    result = call()
    show(result)
    result.check()
    return 0


@verb(options={"run": "Run id (default: the latest, while it runs; else the TPU's holders).",
               "native": "Also the C/C++ frames (py-spy --native; slower)."},
      pod_method="stacks", api_only=("save",))
def stacks(call: Call, *, as_json: bool = False) -> int:
    """Every worker's Python stacks (py-spy dump), folded: the workers that differ first.

    Against the run's Python processes (default: the latest run while it runs; otherwise every
    Python process holding the TPU), on every chosen worker at once. A thread whose stack is
    the same on several workers is shown once under their folded label (`w[0-62]`); the
    worker whose stack differs is shown first, on its own, with the frame where it leaves the
    others' stack marked. Saved beside the run's logs (.tpufab/runs/ID/stacks-TIME.txt and
    .json). A process py-spy cannot attach to is named with the reason and the fix.

    ``timeout``: seconds each worker may take."""
    from tpufab.views.report import show

    report = call(progress=note)
    show(report, as_json=as_json)
    report.check()
    return 0


# -- supervised jobs (docs/supervisor.md): `tpufab jobs` (list), `jobs logs JOB`,
# `jobs cancel JOB`. Each reads the supervisor's bucket alone, so each works while the
# supervisor VM is down.
SUPERVISED_OPTIONS = {
    "job": Opt("The job: its id (job-20261201-221000-ab12), or the unique beginning or end of "
               "one (ab12).", metavar="JOB"),
    "bucket": Opt("The supervisor's bucket (default: the supervisor_bucket setting, else "
                  "<project>-tpufab).", metavar="BUCKET"),
    "follow": Opt("Keep following, attempt after attempt, until the job is over.",
                  short="-f"),
    "raw": "Every line, prefixed by its worker (default: folded, as `tpufab logs`).",
}


@verb(name="list", group="jobs", default=True, options=SUPERVISED_OPTIONS)
def jobs_list(*, as_json: bool = False, project: str | None = None,
              bucket: str | None = None) -> int:
    """Every supervised job: state, attempts, preemptions, errors, supervisor, last event.

    `tpufab jobs` alone is the same. --json gives, per job: id, pod, zone, project, recipe,
    args, state, attempts, preemptions and errors (restarts counted against each budget),
    restarts by kind, cancel_requested, supervisor (who holds it now, or null), last_event
    and runs (each attempt's run id, reason, phase, outcome, exit)."""
    from tpufab.pod.supervised import jobs
    from tpufab.views.supervised import show_jobs

    show_jobs(jobs(project=project, bucket=bucket), as_json=as_json)
    return 0


@verb(name="logs", group="jobs", options=SUPERVISED_OPTIONS)
def jobs_logs(job: str, *, follow: bool = False, raw: bool = False,
              project: str | None = None, bucket: str | None = None) -> int:
    """A supervised job's output, every attempt in turn, folded across workers as `tpufab logs`.

    Each attempt starts with a line on stderr (its number, run id, why it started, how it
    ended). With --follow it goes on as the supervisor uploads more, into the next attempts,
    until the job is over: exit 0 when it finished, 1 when it failed or was cancelled, 130 on
    Ctrl-C (the job goes on)."""
    from tpufab.pod.supervised import job_logs
    from tpufab.views.runlogs import follow_view, print_logs
    from tpufab.views.supervised import attempt_header

    def header(number: int, attempt) -> None:
        note(attempt_header(number, attempt), "bold")

    if not follow:
        found = job_logs(job, project=project, bucket=bucket)
        if not found.attempts:
            note(f"Job {found.job} has no output yet ({found.state.state}).")
        for part in found.attempts:
            header(part.number, part.attempt)
            print_logs(part.logs, raw=raw, color=False, secrets=found.secrets)
        return 0
    try:
        found = job_logs(job, follow=True, project=project, bucket=bucket, on_attempt=header,
                         sink=lambda workers: follow_view(workers, raw=raw))
    except KeyboardInterrupt:
        note(f"Stopped following job {job}; it goes on under its supervisor.")
        return 130
    state = found.state
    note(f"Job {found.job} {state.state}.")
    if state.state == "finished":
        return 0
    last = state.current
    return last.exit if last is not None and last.exit and state.state == "failed" else 1


@verb(name="cancel", group="jobs", options=SUPERVISED_OPTIONS)
def jobs_cancel(job: str, *, project: str | None = None, bucket: str | None = None) -> int:
    """Stop a supervised job; its record stays in the bucket.

    If a supervisor holds the job, it stops the run on the pod and marks the job cancelled.
    If none does, a job with nothing running is cancelled at once; one whose run may still
    be going is marked, for the next supervisor to stop (and the sentence says how to stop
    the run yourself now)."""
    from tpufab.pod.supervised import cancel_job

    note(cancel_job(job, project=project, bucket=bucket).summary())
    return 0


@verb(name="secrets", group="jobs", options=SUPERVISED_OPTIONS)
def jobs_secrets(job: str, *, project: str | None = None, zone: str | None = None,
                 bucket: str | None = None) -> int:
    """Hand a supervised job's secrets to its supervisor again, from this machine's
    environment (after the supervisor restarted, the job waits: "needs secrets").

    The names are the job's own (`tpufab jobs --json`); each must be set here. The values go
    to the supervisor VM over SSH (a 0600 file in a tmpfs, read once and deleted; in memory
    only from then on), or, with supervisor_vm false, to the service on this machine that
    holds the job; never into the bucket, a command line or a log."""
    from tpufab.pod.supervised import hand_secrets

    note(hand_secrets(job, project=project, zone=zone, bucket=bucket).summary())
    return 0


# --- the supervisor VM (docs/supervisor.md, "The VM") ---------------------------------------

SUPERVISOR_OPTIONS = {
    "bucket": Opt("The supervisor's bucket (default: the supervisor_bucket setting, else "
                  "<project>-tpufab).", metavar="BUCKET"),
    "force": "Delete it even with live jobs (they wait in the bucket for the next supervisor).",
    "command": Opt("A command to run on the VM instead of a login shell (after --).",
                   rest=True, metavar="CMD..."),
}


@verb(name="up", group="supervisor", options=SUPERVISOR_OPTIONS)
def supervisor_up(*, project: str | None = None, zone: str | None = None,
                  bucket: str | None = None) -> int:
    """Make the project's supervisor VM if there is none (the setting supervisor_name, a
    supervisor_machine_type VM running this laptop's own tpufab), or check the one there.

    Its startup script first asks which permissions its service account lacks and stops, named
    in one sentence with the role to grant, if any is missing. A supervisor running another
    tpufab is upgraded in place when it holds no live job, else refused."""
    from tpufab.pod.supervised import supervisor_up as up
    from tpufab.term.console import stderr

    vm = up(project=project, zone=zone, bucket=bucket, console=stderr())
    what = "made" if vm.created else "upgraded to this tpufab" if vm.upgraded else "running"
    say(f"Supervisor {vm.name} ({vm.machine_type}, {vm.zone}) {what}: tpufab {vm.version}.")
    return 0


@verb(name="status", group="supervisor", default=True, options=SUPERVISOR_OPTIONS)
def supervisor_status(*, as_json: bool = False, project: str | None = None,
                      zone: str | None = None, bucket: str | None = None) -> int:
    """The supervisor VM: its machine type, uptime, tpufab, jobs and hourly cost (list price,
    docs/supervisor.md). `tpufab supervisor` alone is the same."""
    from tpufab.pod.supervised import supervisor_status as status
    from tpufab.views.supervised import show_supervisor

    show_supervisor(status(project=project, zone=zone, bucket=bucket), as_json=as_json)
    return 0


@verb(name="ssh", group="supervisor", options=SUPERVISOR_OPTIONS)
def supervisor_ssh(*, command: list[str] | None = None, project: str | None = None,
                   zone: str | None = None) -> int:
    """SSH into the supervisor VM (a login shell), or run CMD there: `tpufab supervisor ssh
    -- sudo journalctl -u tpufab-supervisor -n 50`. One CMD word is a command line as typed
    (as ssh takes it); several are each quoted."""
    from tpufab.pod.supervised import supervisor_ssh as ssh

    return ssh(command or (), project=project, zone=zone)


@verb(name="down", group="supervisor", options=SUPERVISOR_OPTIONS)
def supervisor_down(*, force: bool = False, project: str | None = None,
                    zone: str | None = None, bucket: str | None = None) -> int:
    """Delete the supervisor VM; the bucket keeps every job's record. Refused while a job is
    live, unless --force."""
    from tpufab.pod.supervised import supervisor_down as down

    say(down(force=force, project=project, zone=zone, bucket=bucket))
    return 0
