"""Verbs on the workers: exec, setup, ssh."""

from __future__ import annotations

from collections.abc import Sequence

from tpufab.errors import ConfigError
from tpufab.verbs.common import pod_for, settings_from_flags
from tpufab.verbs.declare import Opt, verb

# Above this many workers exec's live view folds (each identical line once) unless --raw.
FOLD_ABOVE = 32


@verb(options={"command": "Shell command, quoted as one argument.",
                 "gather": Opt("Print each distinct output once under its workers.", short="-b"),
                 "raw": f"Every worker's lines, prefixed (the default up to {FOLD_ABOVE} "
                        "workers; above, lines are folded live)."},
      pod_method="run", view=("gather", "raw", "color"))
def exec_(*, command: str, name: str | None = None, worker: str = "all", gather: bool = False,
          raw: bool = False, timeout: float | None = None, env: Sequence[str] | None = None,
          secret: Sequence[str] | None = None, color: bool = False, zone: str | None = None, project: str | None = None,
          no_os_login: bool = False, jump: str | None = None) -> None:
    """Run a shell command on every (or the selected) worker.

    ``timeout``: seconds the command may run on each worker (then it is stopped there and
    that worker fails); connecting waits at most connect_timeout (20 s) or this, if
    shorter. Default: the command_timeout setting (none)."""
    from tpufab.pod.api import LiveView, print_gathered
    from tpufab.views.folding import FoldingView

    if not command or not command.strip():
        raise ConfigError("No command given: tpufab exec 'CMD' (quote it as one argument).")
    pod = pod_for(settings_from_flags(name=name, zone=zone, project=project,
                                      no_os_login=no_os_login, jump=jump, timeout=timeout))
    chosen = pod.select(worker)
    folding = None
    if gather:
        sink = None
    elif raw or len(chosen) <= FOLD_ABOVE:
        sink = LiveView(workers=chosen, worker_colors=color)
    else:
        sink = folding = FoldingView(chosen, color=color).start()
    try:
        # --env as for run: secrets travel in the request (never argv) and are masked in
        # output; one_shot: on fresh connections a plain exec channel, no agent (docs/fanout.md)
        result = pod.run(command, workers=chosen, env=env, secret=secret, timeout=timeout,
                         sink=sink, one_shot=True, warn=True)
    finally:
        if folding is not None:
            folding.close()
    try:
        if gather:
            print_gathered(result, worker_colors=color)
        result.check()
    finally:
        result.close()


@verb(options={"script": "Setup script to run.", "force": "Run even where it already ran.",
               "raw": "Every worker's lines, prefixed (default: folded, each line once)."},
      pod_method="setup", view=("raw",))
def setup(*, name: str | None = None, script: str = "scripts/setup.sh", force: bool = False,
          worker: str = "all", timeout: float | None = None, raw: bool = False,
          env: Sequence[str] | None = None, secret: Sequence[str] | None = None,
          zone: str | None = None, project: str | None = None,
        no_os_login: bool = False, jump: str | None = None) -> None:
    """Ship a setup script and run it on every worker (once per script content).

    The workers' output is folded live (each identical line once; lines where workers differ
    under their workers), with a progress line on a terminal. ``timeout``: seconds each step
    on a worker may take (connecting at most connect_timeout); default: no limit, since
    installing a framework may take long. ``env``/``secret`` as for run: a secret (by name,
    such as WANDB_API_KEY, or --secret) reaches the script on stdin only and is masked in its
    output and log; neither counts as the script's content.
    """
    from tpufab.pod.api import LiveView, Tee
    from tpufab.views.folding import FoldingView
    from tpufab.views.progress import WorkerProgress
    from tpufab.views.report import show

    pod = pod_for(settings_from_flags(name=name, zone=zone, project=project,
                                   no_os_login=no_os_login,
                                      jump=jump, timeout=timeout))
    path = pod.setup_script(script)  # a missing script is said before connecting
    chosen = pod.select(worker)
    folding = None if raw else FoldingView(chosen).start()
    try:
        with WorkerProgress(f"setup {path.name}", len(chosen)) as progress:
            view = folding or LiveView(workers=chosen)
            report = pod.setup(path, force=force, workers=chosen, timeout=timeout,
                                 sink=Tee([view, progress]), env=env, secret=secret)
    finally:
        if folding is not None:
            folding.close()
    show(report)


@verb(options={"worker": Opt("Worker index.", short="-w"),
                 "command": Opt("Command (default: a shell; with invoke, after --).", rest=True),
                 "forward": Opt("Forward a local port: PORT, LOCAL:REMOTE or LOCAL:HOST:REMOTE "
                                "(repeatable).", short="-L")},
      pod_method="ssh")
def ssh(*, name: str | None = None, worker: int = 0, command: list[str] | None = None,
        forward: list[str] | None = None, zone: str | None = None,
        project: str | None = None,
        no_os_login: bool = False, jump: str | None = None) -> None:
    """An interactive shell (or one command) on one worker, with the right key and host key.

    ``--forward`` adds ``-L``-style port forwards (PORT, LOCAL:REMOTE or LOCAL:HOST:REMOTE),
    bound to 127.0.0.1 here.
    """
    pod = pod_for(settings_from_flags(name=name, zone=zone, project=project,
                                      no_os_login=no_os_login, jump=jump))
    pod.ssh(worker, command, forward, replace=True)


@verb(pod_method="disconnect")
def disconnect(*, name: str | None = None, zone: str | None = None,
               project: str | None = None) -> None:
    """Close the pod's kept connections (the background process holding them between
    commands); the next command connects again."""
    from tpufab.term.console import stdout

    settings = settings_from_flags(name=name, zone=zone, project=project)
    found = pod_for(settings)
    stopped = found.disconnect()
    pod = found.name
    stdout().print(f"Closed {pod}'s kept connections." if stopped else
                   f"{pod} had no kept connections.", markup=False, highlight=False)
