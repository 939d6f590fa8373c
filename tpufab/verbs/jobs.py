"""Job verbs: run, logs, runs, kill. Recipe output goes to stdout, tpufab's own notes to
stderr, so ``tpufab run x.sh > out.txt`` keeps only what the recipe printed."""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from pathlib import Path

from tpufab.errors import ConfigError, TpufabError, shown
from tpufab.verbs.common import note, pod_for, say, settings_from_flags, split_args
from tpufab.verbs.declare import Opt, verb

INTERRUPT_CHOICES = ("kill", "detach")
RUN_TIMEOUT = 600.0     # seconds per step before the recipe starts (deploy, start); following
                        # the logs afterwards has no limit: a training run may last days
LOGS_TIMEOUT = 300.0    # seconds for plain `logs` to fetch every worker's log
LIST_TIMEOUT = 60.0     # `runs`: seconds for every worker to answer

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
    "wait_timeout": Opt("With --wait-port: seconds to wait before showing the logs.", min=1),
}


@verb(options=RUN_OPTIONS)
def run(recipe: str, extra: Sequence[str] = (), *, name: str | None = None, args: str = "",
        detach: bool = False, no_deploy: bool = False, direct: bool = False,
        wip: bool = False, env: Sequence[str] | None = None, local: bool = False,
        workers: int | None = None, on_interrupt: str | None = None, spmd: bool = False,
        raw: bool = False, check: bool = False, wait_port: int | None = None,
        wait_timeout: float = 600.0, color: bool = False, timeout: float = RUN_TIMEOUT,
        zone: str | None = None,
        project: str | None = None,
        no_os_login: bool = False, jump: str | None = None) -> int:
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
    start; default 600); following the logs afterwards has no limit. One job at a time: a
    run while another one runs on the pod is refused with one sentence.
    """
    from tpufab.runs import forwarded_for

    path = Path(recipe)
    if not path.is_file():
        raise ConfigError(f"No recipe at {shown(recipe)}: pass an executable file such as "
                          "recipes/jax_hello.sh.")
    if on_interrupt is not None and on_interrupt not in INTERRUPT_CHOICES:
        raise ConfigError(f"--on-interrupt takes kill or detach, not {on_interrupt!r}.")
    if no_deploy and (direct or wip):
        raise ConfigError("--no-deploy skips deploy, while --direct and --wip say how to "
                          "deploy: give one or the other.")
    argv = [*split_args(args), *(str(item) for item in extra or ())]
    settings = settings_from_flags(name=name, zone=zone, project=project,
                                   no_os_login=no_os_login,
                                   jump=jump, timeout=timeout)
    forwarded = forwarded_for(settings, env)
    if local and check:
        raise ConfigError("--check checks a pod; drop it with --local.")
    if local and wait_port is not None:
        raise ConfigError("--wait-port waits for a port on worker 0 of a pod and does not go "
                          "with --local; drop one of them.")
    if local:
        return _run_local(path, workers if workers is not None else 1, argv, forwarded, spmd)
    if wait_port is not None and not 1 <= int(wait_port) <= 65535:
        raise ConfigError(f"--wait-port takes a TCP port (1-65535), not {wait_port}.")
    if workers is not None:
        raise ConfigError("--workers N goes with --local (N processes on this machine); on a "
                          "pod the recipe runs on every worker.")
    root = None
    if not no_deploy:
        from tpufab import gitops

        try:
            root = gitops.repo_root()
        except gitops.GitError:
            raise ConfigError(f"{Path.cwd()} is not inside a git repository, so there is "
                              "nothing to deploy: run from your project's checkout, or pass "
                              f"--no-deploy to run {path.name} in the workers' home "
                              "directories.") from None
        if not direct and not wip and not gitops.has_remote(root, "origin"):
            note("This repository has no git remote yet: deploying over SSH (--direct).")
            direct = True
    from tpufab import codelock

    pod = pod_for(settings)
    if check:
        _preflight(pod, settings, compare_commits=no_deploy)
    # One writer for the code and one job at a time: from the check for a live run until
    # the recipe has started, no other tpufab deploys or starts a run on this pod.
    with codelock.hold(pod.fanout, pod.workers, purpose=f"run {path.name}") as lease:
        codelock.refuse_a_second_run(pod.fanout, pod.workers, lease)
        plan = _plan(pod, settings, path, argv, forwarded, spmd, root=root, direct=direct,
                     wip=wip)
        started = _start(pod, plan)
    if wait_port is not None:
        code = _start_and_follow(pod, plan, detach=True, on_interrupt=on_interrupt, quiet=True,
                                 settings=settings, started=started)
        return code or _wait_for_port(pod, plan, int(wait_port), wait_timeout)
    return _start_and_follow(pod, plan, detach=detach, on_interrupt=on_interrupt, raw=raw,
                             color=color, settings=settings, started=started)


def _preflight(pod, settings, *, compare_commits: bool) -> None:
    """The quick checks; a problem stops the run before anything starts."""
    from tpufab import check as checking

    report = checking.run_check(settings, pod, quick=True, compare_commits=compare_commits)
    if report.ok:
        note(f"Checked {report.accelerator} ({len(report.workers)} workers): every quick "
             f"check passed ({report.seconds:.1f} s).", "dim")
        return
    n = len(report.problems)
    raise checking.CheckError(
        f"Not starting: `tpufab check --quick` found {n} problem{'s' if n != 1 else ''} on "
        f"{report.name}.", details="\n".join(p.line() for p in report.problems))


def _wait_for_port(pod, plan, port: int, timeout: float) -> int:
    from tpufab import jobs
    from tpufab.runs import fold_logs, render_folded

    worker = plan.workers[0]
    note(f"Waiting (up to {timeout:g} s) for port {port} to answer on w{worker}...", "dim")
    try:
        ok, how = jobs.wait_port(pod.fanout, plan.run_id, port, worker=worker, timeout=timeout)
    except KeyboardInterrupt:
        raise TpufabError(f"Stopped waiting for port {port}; run {plan.run_id} goes on (stop "
                          f"it with `tpufab kill --run {plan.run_id}`).", exit_code=130) from None
    if ok:
        note(f"Port {port} answers on w{worker} ({how}); run {plan.run_id} goes on. Reach it "
             f"with `tpufab forward {port}`; stop it with `tpufab kill --run {plan.run_id}`.")
        return 0
    from collections import deque

    from tpufab.terminal import lines_of, neutralise_text

    logs, _states = jobs.fetch_logs(pod.fanout, plan.run_id, plan.workers)
    try:
        per_worker = {w: [line[:-1].decode("utf-8", "replace")
                          for line in deque(lines_of(output.chunks()), maxlen=40)]
                      for w, output in logs.items()}
    finally:
        for output in logs.values():
            output.close()
    for line in render_folded(fold_logs(per_worker), per_worker):
        sys.stdout.write(neutralise_text(line) + "\n")
    sys.stdout.flush()
    raise TpufabError(f"Run {plan.run_id}: {how}; its logs are above (last 40 lines per "
                      f"worker; `tpufab logs --run {plan.run_id}` has them all).")


def _plan(pod, settings, path: Path, argv, forwarded, spmd, *, root, direct, wip):
    from tpufab import deploy, jobs, nodeset
    from tpufab.remote_files import RemoteFile

    workers = pod.workers
    commit = cwd = None
    if root is not None:
        report = deploy.deploy(pod.fanout, dir=settings.remote_dir, direct=direct, wip=wip,
                               cwd=root, progress=lambda msg: note(f"deploy: {msg}", "dim"),
                               lease=False)  # run holds the lease already
        commit, cwd = report.commit, report.dir
        changed = [r.worker for r in report.rows if r.changed]
        how = f"updated {nodeset.fold(changed)}" if changed else "already there"
        note(f"Deployed {commit[:12]} to {cwd} on {nodeset.fold(workers)} ({how}, "
              f"{report.seconds:.1f} s).")
    else:
        cwd = jobs.default_cwd(settings.remote_dir)
    return jobs.plan_run(RemoteFile.from_path(path), slices=pod.slices, ips=pod.internal_ips(),
                         args=argv, cwd=cwd, commit=commit, forwarded=forwarded, spmd=spmd)


def _start(pod, plan) -> dict[int, dict]:
    from tpufab import jobs, nodeset
    from tpufab.fanout import FanoutInterrupted

    try:
        return jobs.start(pod.fanout, plan)
    except FanoutInterrupted:
        jobs.stop(pod.fanout, plan.run_id, plan.workers, grace=2.0)
        raise TpufabError(f"Interrupted while starting run {plan.run_id}; stopped it on "
                          f"{nodeset.fold(plan.workers)}.", exit_code=130) from None


def _start_and_follow(pod, plan, *, detach: bool, on_interrupt: str | None,
                      raw: bool = False, quiet: bool = False, color: bool = False,
                      settings=None, started: dict[int, dict] | None = None) -> int:
    from tpufab import jobs, nodeset

    workers = plan.workers
    if started is None:
        started = _start(pod, plan)
    first = started[workers[0]]
    where = first.get("cwd") or "~"
    missing = [w for w, s in started.items() if s.get("cwd_missing")]
    note(f"Run {plan.run_id}: {plan.recipe.name} (sha256 {plan.recipe.sha256[:12]}"
          f"{', commit ' + plan.commit[:12] if plan.commit else ''}) started on "
          f"{nodeset.fold(workers)} in {where}.")
    if missing:
        note(f"{plan.cwd} does not exist on {nodeset.fold(missing)}; the recipe runs in the "
              "home directory there (deploy first, or drop --no-deploy).", "yellow")
    summary = jobs.environment_summary(plan)
    if summary:
        note(f"Environment: {summary}", "dim")
    if detach and quiet:
        return 0
    if first.get("output_dir"):
        note(f"Output: {first['output_dir']} (profiles: {first.get('profile_dir')})", "dim")
    if detach:
        note(f"Detached. Follow it with `tpufab logs --run {plan.run_id} --follow`, list "
              f"runs with `tpufab runs`, stop it with `tpufab kill --run {plan.run_id}`.")
        return 0
    return _follow_run(pod, plan, on_interrupt, raw, color=color, settings=settings)


def _follow_run(pod, plan, on_interrupt: str | None, raw: bool = False, *,
                color: bool = False, settings=None) -> int:
    from tpufab import jobs, nodeset
    from tpufab.fanout import FanoutInterrupted, LiveView

    workers = plan.workers
    keep = {} if settings is None else {"keep_runs": settings.keep_runs,
                                        "keep_gib": settings.keep_logs_gib}
    try:
        copy_dir = jobs.local_log_dir(plan.run_id, **keep)
    except OSError:
        copy_dir = None
    ended: dict[int, object] = {}

    def on_end(worker, state):
        ended[worker] = state
        # Only a recipe that ended: followers stopped by Ctrl-C or a lost connection say
        # nothing about the run.
        if state.ended and not state.ok and len(ended) < len(workers):
            running = [w for w in workers if w not in ended]
            note(f"{nodeset.label(worker)}: {plan.recipe.name} {state.label}; "
                  f"{nodeset.fold(running)} still running (Ctrl-C to stop following or to "
                  "stop the run).", "yellow")

    view = LiveView(workers=workers, worker_colors=color) if raw else \
        jobs.FoldingView(workers, color=color).start()
    sink = jobs.FollowSink(view, secrets=plan.secrets.values(),
                           copy_dir=copy_dir, on_end=on_end)
    began = time.monotonic()
    try:
        states = jobs.follow(pod.fanout, plan.run_id, workers, sink)
    except FanoutInterrupted:
        sink.close()
        return _interrupted(pod, plan.run_id, workers, on_interrupt)
    finally:
        sink.close()
    return _finish(plan.run_id, states, time.monotonic() - began, copy_dir)


def _finish(run_id: str, states, seconds: float, copy_dir: Path | None) -> int:
    from tpufab import jobs, nodeset

    lost = [s for s in states.values() if s.state in ("unreachable", "no record")]
    failed = [s for s in states.values() if not s.ok and s not in lost]
    kept = f" Logs: `tpufab logs --run {run_id}`" + (
        f" (a copy is in {_relative(copy_dir)}/)." if copy_dir else ".")
    if not failed and not lost:
        note(f"Run {run_id} finished on {nodeset.fold(states)}: exit 0 ({seconds:.1f} s).")
        return 0
    parts = []
    if failed:
        parts.append(f"Run {run_id} failed on {nodeset.fold(s.worker for s in failed)}: "
                     f"{jobs.fold_states(states.values())}.")
    if lost:
        parts.append(f"Lost {nodeset.fold(s.worker for s in lost)} while following "
                     f"({'; '.join(sorted({s.detail or s.state for s in lost}))}); the run may "
                     f"still be going there: `tpufab runs`, `tpufab logs --run {run_id} "
                     "--follow`.")
    codes = {s.exit_status for s in failed}
    code = codes.pop() if len(codes) == 1 else 1
    raise jobs.RunError(" ".join(parts) + kept, exit_code=code if 0 < code < 256 else 1)


def _relative(path: Path | None) -> str:
    if path is None:
        return ""
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


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


def _interrupted(pod, run_id: str, workers, on_interrupt: str | None) -> int:
    from tpufab import jobs, nodeset

    choice = on_interrupt or ask_on_interrupt(run_id)
    if choice != "kill":
        note(f"Stopped following; run {run_id} keeps running on {nodeset.fold(workers)}. Follow it "
              f"again with `tpufab logs --run {run_id} --follow`; stop it with "
              f"`tpufab kill --run {run_id}`.")
        return 130
    note(f"Stopping run {run_id} on {nodeset.fold(workers)} ...")
    outcome = jobs.stop(pod.fanout, run_id, workers, grace=jobs.STOP_GRACE)
    errors = {w: o["error"] for w, o in outcome.items() if "error" in o}
    alive = [w for w, o in outcome.items() if o.get("still_running")]
    signals = {o.get("signal") for o in outcome.values() if o.get("signal")}
    if errors or alive:
        detail = "; ".join(f"{nodeset.label(w)}: {why}" for w, why in errors.items())
        if alive:
            detail += ("; " if detail else "") + f"still running on {nodeset.fold(alive)}"
        raise jobs.RunError(f"Could not stop run {run_id} everywhere ({detail}); try "
                            f"`tpufab kill --run {run_id}`.", exit_code=130)
    how = f" (SIG{'/SIG'.join(sorted(signals))})" if signals else " (it had already ended)"
    note(f"Stopped run {run_id} on {nodeset.fold(workers)}{how}.")
    return 130


def _run_local(path: Path, workers: int, argv, forwarded, spmd: bool) -> int:
    from tpufab.localrun import run_local

    result = run_local(path, workers=workers, args=argv, forwarded=forwarded, spmd=spmd)
    if result.ok:
        note(f"Local run {result.run_id}: {result.summary()}")
        return 0
    raise TpufabError(f"Local run {result.run_id}: {result.summary()}",
                      exit_code=1)


def _find_run(pod, chosen, run: str | None):
    """(run id, statuses) of ``run`` or of the latest run any chosen worker knows."""
    from tpufab import jobs, nodeset
    from tpufab.runs import is_run_id

    if run is not None and not is_run_id(run):
        raise ConfigError(f"{run!r} is not a run id (they look like 20261122-104455-ab12); "
                          "`tpufab runs` lists them.")
    statuses = jobs.statuses(pod.fanout, chosen)
    reachable = [w for w, s in statuses.items() if s.error is None]
    if not reachable:
        raise jobs.RunError(f"No worker answered ({jobs.fold_states(_unreachable(statuses))}).")
    run_id = run or jobs.latest_run(statuses)
    if run_id is None:
        raise jobs.RunError(f"No runs on {nodeset.fold(reachable)} yet; start one with "
                            "`tpufab run RECIPE`.")
    have = [w for w in reachable if any(e.get("run") == run_id for e in statuses[w].runs)]
    if not have:
        raise jobs.RunError(f"No run {run_id} on {nodeset.fold(reachable)}; `tpufab runs` "
                            "lists the runs there.")
    return run_id, statuses, have


def _unreachable(statuses):
    from tpufab.jobs import WorkerState

    return [WorkerState(w, "unreachable", detail=s.error) for w, s in statuses.items()
            if s.error is not None]


@verb(options={"run": "Run id (default: the latest).", "follow": Opt("Keep following.", short="-f"),
                 "raw": "Every line, prefixed by its worker."})
def logs(*, run: str | None = None, follow: bool = False, worker: str = "all",
         raw: bool = False, color: bool = False, timeout: float | None = None,
         name: str | None = None, zone: str | None = None, project: str | None = None,
        no_os_login: bool = False,
         jump: str | None = None) -> int:
    """A run's logs: worker 0's lines once, plus only the lines where others differ.

    ``timeout``: seconds to wait for the workers (default 300 for the logs so far; with
    --follow, no limit: following stops when the run ends, or after ``timeout`` if given).
    A worker that cannot be reached is named and makes logs fail.
    """
    from tpufab import jobs, nodeset

    follow_for = float("inf") if timeout is None else timeout
    if timeout is None:
        timeout = LOGS_TIMEOUT
    settings = settings_from_flags(name=name, zone=zone, project=project,
                                   no_os_login=no_os_login,
                                   jump=jump, timeout=timeout)
    pod = pod_for(settings)
    chosen = pod.fanout.select(worker)
    run_id, statuses, have = _find_run(pod, chosen, run)
    rows = {r.run: r for r in jobs.run_rows({w: statuses[w] for w in chosen})}
    row = rows[run_id]
    unreachable = _unreachable({w: statuses[w] for w in chosen})
    absent = [w for w in chosen if w not in have and statuses[w].error is None]
    note(f"Run {run_id}: {row.recipe} - {row.workers}", "dim")
    if absent:
        note(f"({nodeset.fold(absent)} {'has' if len(absent) == 1 else 'have'} no record of "
              "it.)", "dim")
    # The workers masked the run's secrets as they wrote the log; the ones this machine
    # would forward are masked again (a log written by an older tpufab).
    secrets = _local_secrets(settings)
    if follow:
        code = _follow_logs(pod, run_id, have, raw, color, secrets, timeout=follow_for)
        _refuse_partial(run_id, unreachable)
        return code
    logs, states = jobs.fetch_logs(pod.fanout, run_id, have)
    try:
        _print_logs(logs, raw=raw, color=color, secrets=secrets)
    finally:
        for output in logs.values():
            output.close()
    gone = [s for s in states.values() if s.state in ("unreachable", "no record")]
    _refuse_partial(run_id, unreachable + [s for s in gone if s.state == "unreachable"])
    if gone:
        note(f"No log from {jobs.fold_states(gone)}.", "yellow")
    return 0


def _refuse_partial(run_id: str, unreachable) -> None:
    """Logs missing a worker that did not answer are not the whole story: say so, fail."""
    from tpufab import jobs

    if unreachable:
        raise jobs.RunError(f"No log from {jobs.fold_states(unreachable)}: the logs above "
                            f"miss {'that worker' if len(unreachable) == 1 else 'those workers'}"
                            f"; check it with `tpufab status`, then `tpufab logs --run {run_id}` "
                            "again.")


def _local_secrets(settings) -> list[str]:
    from tpufab.runs import forwarded_for

    try:
        return list(forwarded_for(settings, None).secrets.values())
    except ConfigError:
        return []


def _print_logs(logs, *, raw: bool, color: bool, secrets: Sequence[str], out=None) -> None:
    """Every worker's log, prefixed (raw) or folded, streamed from the spooled outputs: a
    window of lines per worker in memory at a time (runs.fold_stream)."""
    from tpufab import nodeset
    from tpufab.quoting import mask_bytes, secret_bytes
    from tpufab.runs import fold_stream
    from tpufab.terminal import Lines, neutralise

    masked = secret_bytes(secrets)

    def blocks(output):
        """Runs of whole lines, masked."""
        cutter = Lines()
        for chunk in output.chunks():
            for block in cutter.feed(chunk):
                yield mask_bytes(block, masked)
        for block in cutter.end():
            yield mask_bytes(block, masked)

    out = out if out is not None else sys.stdout.buffer
    if raw:
        width = max((len(nodeset.label(w)) for w in logs), default=2)
        for w in sorted(logs):
            prefix = f"{nodeset.label(w):<{width}} │ ".encode()
            for block in blocks(logs[w]):
                block = neutralise(block, color=color)
                out.write(prefix + block[:-1].replace(b"\n", b"\n" + prefix) + b"\n")
        out.flush()
        return

    def text(w):
        for block in blocks(logs[w]):
            yield from block.decode("utf-8", "replace").split("\n")[:-1]

    everyone = tuple(sorted(logs))
    for folded in fold_stream({w: text(w) for w in logs}):
        shown = folded.text if folded.workers == everyone else f"{folded.label}: {folded.text}"
        out.write(neutralise(shown.encode("utf-8", "replace") + b"\n", color=color))
    out.flush()


def _follow_logs(pod, run_id: str, workers, raw: bool, color: bool = False,
                 secrets: Sequence[str] = (), *, timeout: float = float("inf")) -> int:
    from tpufab import jobs, nodeset
    from tpufab.fanout import FanoutInterrupted, LiveView

    view = LiveView(workers=workers, worker_colors=color) if raw else \
        jobs.FoldingView(workers, color=color).start()
    sink = jobs.FollowSink(view, secrets=secrets)
    try:
        states = jobs.follow(pod.fanout, run_id, workers, sink, timeout=timeout)
    except FanoutInterrupted:
        sink.close()
        note(f"Stopped following; run {run_id} keeps running.")
        return 130
    finally:
        sink.close()
    waited = [s.worker for s in states.values() if (s.detail or "").startswith("timed out")]
    if waited:
        raise jobs.RunError(f"Stopped following run {run_id} on {nodeset.fold(waited)} after "
                            f"{timeout:g} s (--timeout); the run itself is untouched: "
                            f"`tpufab runs`, `tpufab logs --run {run_id} --follow`.",
                            exit_code=124)
    text = f"Run {run_id}: {jobs.fold_states(states.values())}."
    if all(s.ok for s in states.values()):
        note(text)
        return 0
    codes = {s.exit_status for s in states.values() if not s.ok}
    code = codes.pop() if len(codes) == 1 else 1
    raise jobs.RunError(text, exit_code=code if 0 < code < 256 else 1)


@verb()
def runs(*, name: str | None = None, worker: str = "all", as_json: bool = False,
         timeout: float = LIST_TIMEOUT, zone: str | None = None,
         project: str | None = None,
        no_os_login: bool = False, jump: str | None = None) -> int:
    """The runs the workers know, with each worker's state.

    ``timeout``: seconds for every worker to answer (default 60)."""
    import json

    from tpufab import jobs, nodeset

    pod = pod_for(settings_from_flags(name=name, zone=zone, project=project,
                                   no_os_login=no_os_login,
                                      jump=jump, timeout=timeout))
    chosen = pod.fanout.select(worker)
    statuses = jobs.statuses(pod.fanout, chosen)
    rows = jobs.run_rows(statuses)
    if as_json:
        print(json.dumps([{"run": r.run, "recipe": r.recipe, "started_at": r.started_at,
                           "ended_at": r.ended_at, "commit": r.commit,
                           "workers": {str(s.worker): s.label for s in r.states}}
                          for r in rows], indent=2))
        return 0
    unreachable = _unreachable(statuses)
    if not rows:
        reachable = [w for w, s in statuses.items() if s.error is None]
        if reachable:
            say(f"No runs on {nodeset.fold(reachable)} yet; start one with "
                 "`tpufab run RECIPE`.")
    else:
        _say_table(rows)
    if unreachable:
        raise jobs.RunError(f"Could not list runs on {jobs.fold_states(unreachable)}.")
    return 0


def _say_table(rows) -> None:
    from rich.table import Table

    from tpufab.console import stdout
    from tpufab.terminal import neutralise_text

    table = Table(box=None, pad_edge=False, header_style="bold")
    for column in ("RUN", "RECIPE", "STARTED", "TIME", "COMMIT", "WORKERS"):
        table.add_column(column, no_wrap=column != "WORKERS")
    now = time.time()
    for r in rows:
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(r.started_at)) \
            if r.started_at else "-"
        if r.started_at and r.ended_at:
            took = _duration(r.ended_at - r.started_at)
        elif r.started_at and r.running:
            took = _duration(now - r.started_at) + "+"
        else:
            took = "-"
        table.add_row(*(neutralise_text(cell) for cell in (
            r.run, r.recipe or "-", started, took, (r.commit or "-")[:12], r.workers)))
    stdout().print(table)


def _duration(seconds: float) -> str:
    seconds = max(0.0, seconds)
    if seconds < 60:
        return f"{seconds:.1f}s"
    minutes, secs = divmod(int(seconds), 60)
    if minutes < 60:
        return f"{minutes}m{secs:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m"


@verb(options={"run": "Only this run.", "grace": Opt("Seconds between TERM and KILL.", min=0),
                 "dry_run": "Only report.", "force": "Also stop protected holders."})
def kill(*, name: str | None = None, run: str | None = None, grace: float = 5.0,
         dry_run: bool = False, force: bool = False, worker: str = "all",
         timeout: float | None = None, zone: str | None = None,
         project: str | None = None,
        no_os_login: bool = False, jump: str | None = None) -> int:
    """Free the TPU everywhere: stop runs and stale holders, then remove the lockfile.

    ``timeout``: seconds the kill may take on each worker (default: the grace period plus
    34 s, enough for TERM, the grace, KILL and the lockfile's settle time). A protected
    process (tpu-runtime, ...) still holding a device is named, with what to do about it
    (the same words `status` uses), and kill fails until it is gone."""
    from tpufab import killing
    from tpufab.runs import is_run_id

    if grace < 0:
        raise ConfigError(f"--grace must be 0 or more seconds, not {grace:g}.")
    if run is not None and not is_run_id(run):
        raise ConfigError(f"{run!r} is not a run id (they look like 20261122-104455-ab12); "
                          "`tpufab runs` lists them.")
    pod = pod_for(settings_from_flags(name=name, zone=zone, project=project,
                                   no_os_login=no_os_login,
                                      jump=jump, timeout=timeout))
    chosen = pod.fanout.select(worker)
    result = killing.kill(pod.fanout, chosen, run=run, grace=grace, dry_run=dry_run,
                          force=force, device_globs=pod.device_globs(), timeout=timeout)
    for line in killing.report_lines(result):
        say(line)
    text = killing.summary(result)
    if result.ok:
        say(text)
        return 0
    raise killing.KillError(text)
