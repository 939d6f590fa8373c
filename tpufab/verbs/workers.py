"""Verbs on the workers: exec, setup, ssh."""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from pathlib import Path

from tpufab.errors import ConfigError
from tpufab.verbs.common import pod_for, settings_from_flags
from tpufab.verbs.declare import Opt, verb

# Above this many workers exec's live view folds (each identical line once) unless --raw.
FOLD_ABOVE = 32


@verb(options={"command": "Shell command, quoted as one argument.",
                 "gather": Opt("Print each distinct output once under its workers.", short="-b"),
                 "raw": f"Every worker's lines, prefixed (the default up to {FOLD_ABOVE} "
                        "workers; above, lines are folded live)."})
def exec_(*, command: str, name: str | None = None, worker: str = "all", gather: bool = False,
          raw: bool = False, timeout: float | None = None, env: Sequence[str] | None = None,
          color: bool = False, zone: str | None = None, project: str | None = None,
          no_os_login: bool = False, jump: str | None = None) -> None:
    """Run a shell command on every (or the selected) worker.

    ``timeout``: seconds the command may run on each worker (then it is stopped there and
    that worker fails); connecting waits at most connect_timeout (20 s) or this, if
    shorter. Default: the command_timeout setting (none)."""
    from tpufab.fanout import LiveView, print_gathered
    from tpufab.jobs import FoldingView
    from tpufab.quoting import Secret
    from tpufab.runs import forwarded_for

    if not command or not command.strip():
        raise ConfigError("No command given: tpufab exec 'CMD' (quote it as one argument).")
    settings = settings_from_flags(name=name, zone=zone, project=project,
                                   no_os_login=no_os_login,
                                   jump=jump, timeout=timeout)
    # --env as for run: secrets travel in the request (never argv) and are masked in output.
    forwarded = forwarded_for(settings, env) if env else None
    pod = pod_for(settings)
    chosen = pod.fanout.select(worker)
    folding = None
    if gather:
        sink = None
    elif raw or len(chosen) <= FOLD_ABOVE:
        sink = LiveView(workers=chosen, worker_colors=color)
    else:
        sink = folding = FoldingView(chosen, color=color).start()
    try:
        # one_shot: on fresh connections a plain exec channel, no agent (docs/fanout.md)
        result = pod.fanout.run(command, workers=chosen, timeout=timeout, sink=sink,
                                env=dict(forwarded.public) if forwarded else None,
                                secrets={k: Secret(v) for k, v in forwarded.secrets.items()}
                                if forwarded else None, one_shot=True)
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
               "raw": "Every worker's lines, prefixed (default: folded, each line once)."})
def setup(*, name: str | None = None, script: str = "scripts/setup.sh", force: bool = False,
          worker: str = "all", timeout: float | None = None, raw: bool = False,
          zone: str | None = None, project: str | None = None,
        no_os_login: bool = False, jump: str | None = None) -> None:
    """Ship a setup script and run it on every worker (once per script content).

    The workers' output is folded live (each identical line once; lines where workers differ
    under their workers), with a progress line on a terminal. ``timeout``: seconds each step
    on a worker may take (connecting at most connect_timeout); default: no limit, since
    installing a framework may take long.
    """
    from tpufab.console import stdout
    from tpufab.fanout import LiveView, Tee
    from tpufab.jobs import FoldingView
    from tpufab.nodeset import fold
    from tpufab.progress import WorkerProgress

    path = Path(script)
    if not path.is_file():
        raise ConfigError(f"Setup script {script} does not exist; pass --script PATH "
                          "(default scripts/setup.sh).")
    pod = pod_for(settings_from_flags(name=name, zone=zone, project=project,
                                   no_os_login=no_os_login,
                                      jump=jump, timeout=timeout))
    chosen = pod.select(worker)
    folding = None if raw else FoldingView(chosen).start()
    try:
        with WorkerProgress(f"setup {path.name}", len(chosen)) as progress:
            view = folding or LiveView(workers=chosen)
            outcomes = pod.setup(path, force=force, workers=chosen, timeout=timeout,
                                 sink=Tee([view, progress]))
    finally:
        if folding is not None:
            folding.close()
    by_status: dict[str, list[int]] = {}
    for w, outcome in outcomes.items():
        by_status.setdefault(outcome.status, []).append(w)
    parts = [f"{fold(ws)} {status}" for status, ws in sorted(by_status.items())]
    log = next((o.log for o in outcomes.values() if o.log), None)
    stdout().print(f"Setup {path.name}: {'; '.join(parts)}" + (f" (log: {log})" if log else "")
                   + ".", markup=False)


@verb(options={"worker": Opt("Worker index.", short="-w"),
                 "command": Opt("Command (default: a shell; with invoke, after --).", rest=True),
                 "forward": Opt("Forward a local port: PORT, LOCAL:REMOTE or LOCAL:HOST:REMOTE "
                                "(repeatable).", short="-L")})
def ssh(*, name: str | None = None, worker: int = 0, command: list[str] | None = None,
        forward: list[str] | None = None, zone: str | None = None,
        project: str | None = None,
        no_os_login: bool = False, jump: str | None = None) -> None:
    """An interactive shell (or one command) on one worker, with the right key and host key.

    ``--forward`` adds ``-L``-style port forwards (PORT, LOCAL:REMOTE or LOCAL:HOST:REMOTE),
    bound to 127.0.0.1 here.
    """
    import shutil

    from tpufab import pod as pods
    from tpufab.forward import parse_forward
    from tpufab.hostkeys import KnownHosts

    forwards = [parse_forward(spec) for spec in forward or ()]
    settings = settings_from_flags(name=name, zone=zone, project=project,
                                   no_os_login=no_os_login, jump=jump)
    pod = pods.connect(settings)
    try:
        if worker not in pod.fanout.targets:
            raise ConfigError(f"Worker {worker} does not exist; {pod.name} has workers "
                              f"0-{len(pod.workers) - 1}.")
        target = pod.fanout.targets[worker]
    finally:
        pod.close()
    ssh_bin = shutil.which("ssh")
    if ssh_bin is None:
        raise ConfigError("The system ssh client is missing; install openssh-client.")
    known_hosts = KnownHosts(settings.known_hosts_path)
    argv = ["ssh", "-i", str(settings.ssh_key_path), "-o", "IdentitiesOnly=yes",
            *known_hosts.ssh_options(target.host_key_alias), "-p", str(target.port)]
    if target.jump is not None:  # -J would not pass our key and known_hosts on to the jump
        from tpufab.jump import proxy_command

        argv += ["-o", "ProxyCommand=" + proxy_command(
            target.jump, known_hosts.ssh_options(target.jump.key_alias), str(settings.ssh_key_path))]
    for f in forwards:
        argv += ["-L", f.ssh_option()]
    if forwards:
        argv += ["-o", "ExitOnForwardFailure=yes"]
    argv.append(f"{target.user}@{target.host}")
    if command:
        argv += ["--", *command]
    elif sys.stdin.isatty():
        argv.insert(1, "-t")
    sys.stdout.flush()
    os.execv(ssh_bin, argv)
