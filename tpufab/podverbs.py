"""The worker verbs both front ends call: exec, setup, ssh, deploy, mount, umount (and, later,
the rest), plus `sim bucket`.

Like verbs.py: turn flags into Settings, call the library, print. Heavy modules are imported
inside each verb so `tpufab --help` and `invoke --list` stay instant.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from tpufab.errors import ConfigError
from tpufab.verbs import settings_from_flags


def _pod(name, zone, project, **flags):
    from tpufab import pod

    settings = settings_from_flags(name=name, zone=zone, project=project, **flags)
    return pod.shared(settings)


def exec_(*, command: str, name: str | None = None, worker: str = "all", gather: bool = False,
          timeout: float | None = None, zone: str | None = None,
          project: str | None = None) -> None:
    """Run a shell command on the selected workers; non-zero if any of them fails."""
    from tpufab.fanout import LiveView, print_gathered

    if not command or not command.strip():
        raise ConfigError("No command given: tpufab exec 'CMD' (quote it as one argument).")
    pod = _pod(name, zone, project)
    chosen = pod.fanout.select(worker)
    sink = None if gather else LiveView(workers=chosen)
    result = pod.fanout.run(command, workers=chosen, timeout=timeout, sink=sink)
    try:
        if gather:
            print_gathered(result)
        result.check()
    finally:
        result.close()


def setup(*, name: str | None = None, script: str = "scripts/setup.sh", force: bool = False,
          worker: str = "all", timeout: float | None = None, zone: str | None = None,
          project: str | None = None) -> None:
    """Ship a setup script and run it on every worker, once per script content."""
    from tpufab.console import stdout
    from tpufab.fanout import LiveView, run_setup
    from tpufab.nodeset import fold

    path = Path(script)
    if not path.is_file():
        raise ConfigError(f"Setup script {script} does not exist; pass --script PATH "
                          "(default scripts/setup.sh).")
    pod = _pod(name, zone, project)
    chosen = pod.fanout.select(worker)
    result, outcomes = run_setup(pod.fanout, path, workers=chosen, force=force,
                                 sink=LiveView(workers=chosen), timeout=timeout)
    result.close()
    by_status: dict[str, list[int]] = {}
    for w, outcome in outcomes.items():
        by_status.setdefault(outcome.status, []).append(w)
    parts = [f"{fold(ws)} {status}" for status, ws in sorted(by_status.items())]
    log = next((o.log for o in outcomes.values() if o.log), None)
    stdout().print(f"Setup {path.name}: {'; '.join(parts)}" + (f" (log: {log})" if log else "")
                   + ".", markup=False)


def ssh(*, name: str | None = None, worker: int = 0, command: list[str] | None = None,
        zone: str | None = None, project: str | None = None) -> None:
    """Replace this process with the system ssh to one worker (interactive when no command)."""
    import shutil

    from tpufab import pod as pods
    from tpufab.hostkeys import KnownHosts

    settings = settings_from_flags(name=name, zone=zone, project=project)
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
    argv = ["ssh", "-i", str(settings.ssh_key_path), "-o", "IdentitiesOnly=yes",
            *KnownHosts(settings.known_hosts_path).ssh_options(target.host_key_alias),
            "-p", str(target.port), f"{target.user}@{target.host}"]
    if command:
        argv += ["--", *command]
    elif sys.stdin.isatty():
        argv.insert(1, "-t")
    sys.stdout.flush()
    os.execv(ssh_bin, argv)


# ---------------------------------------------------------------------------------------------
# code and data on every worker


def _folded(rows: Iterable[Any], key: Callable[[Any], tuple]) -> list[tuple[str, list[Any]]]:
    """Rows that agree on ``key`` as one line each: [(folded workers, rows)], first worker first."""
    from tpufab.nodeset import fold

    groups: dict[tuple, list[Any]] = {}
    for row in sorted(rows, key=lambda r: r.worker):
        groups.setdefault(key(row), []).append(row)
    return [(fold(r.worker for r in group), group) for group in groups.values()]


def _seconds(rows: Sequence[Any]) -> str:
    times = sorted(r.seconds for r in rows if r.seconds is not None)
    if not times:
        return "-"
    if len(times) == 1 or times[-1] - times[0] < 0.01:
        return f"{times[-1]:.2f}s"
    return f"{times[0]:.2f}-{times[-1]:.2f}s"


def _print_table(columns: Sequence[str], lines: Iterable[Sequence[str]]) -> None:
    from rich.table import Table

    from tpufab.console import stdout

    table = Table(box=None, pad_edge=False, header_style="bold")
    for column in columns:
        table.add_column(column)
    for line in lines:
        table.add_row(*line)
    stdout().print(table)


def _say(message: str) -> None:
    from rich.text import Text

    from tpufab.console import stderr

    stderr().print(Text(message, style="dim"))


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


def deploy(*, name: str | None = None, ref: str = "HEAD", remote: str = "origin",
           dir: str | None = None, direct: bool = False, wip: bool = False,
           zone: str | None = None, project: str | None = None) -> None:
    """Put one commit of this repository on every worker, verified, and print who changed."""
    from tpufab import deploy as deploying
    from tpufab import gitops
    from tpufab.console import stdout
    from tpufab.quoting import Secret

    # the local checks first: a dirty tree or a missing remote needs no pod to be refused
    root = gitops.repo_root(None)
    if not wip:
        gitops.refuse_dirty(root)
        gitops.resolve(root, ref)
    if not direct:
        gitops.remote_url(root, remote)
    settings = settings_from_flags(name=name, zone=zone, project=project)
    token = os.environ.get(deploying.TOKEN_ENV)  # an HTTPS token for a private remote
    pod = _pod_for(settings)
    report = deploying.deploy(pod.fanout, ref=ref, remote=remote,
                              dir=dir or settings.remote_dir, direct=direct, wip=wip, cwd=root,
                              token=Secret(token) if token else None, progress=_say)
    _print_table(("WORKERS", "COMMIT", "RESULT", "TIME"), (
        (workers, (group[0].commit or "-")[:12], group[0].action or "-", _seconds(group))
        for workers, group in _folded(report.rows, lambda r: (r.commit, r.action))))
    changed = sum(r.changed for r in report.rows)
    what = report.commit[:12] + (f" ({report.branch})" if report.branch else "")
    if report.wip_ref:
        what += f" (work-in-progress snapshot, {report.wip_ref})"
    how = ("over SSH (--direct)" if direct
           else f"through {remote} ({'pushed' if report.pushed == 'pushed' else 'already there'})")
    same = len(report.rows) - changed
    outcome = ("every worker was already there" if not changed
               else f"{changed} changed" + (f", {same} already there" if same else ""))
    stdout().print(f"Deployed {what} to {_count(len(report.rows), 'worker')} in {report.dir} "
                   f"{how}: {outcome} ({report.seconds:.1f}s).", markup=False)


def _pod_for(settings: Any) -> Any:
    from tpufab import pod

    return pod.shared(settings)


def _driver_options(options: Iterable[str] | None) -> list[str]:
    """``--options '--dir-cache-time 10s' --options --read-only`` -> the driver's argv."""
    import shlex

    out: list[str] = []
    for item in options or ():
        try:
            out += shlex.split(item)
        except ValueError as err:
            raise ConfigError(f"Cannot read --options {item!r} ({err}); quote each driver "
                              "option string once, e.g. --options '--dir-cache-time 10s'.") \
                from None
    return out


def mount(*, bucket: str, name: str | None = None, at: str | None = None,
          driver: str | None = None, options: Iterable[str] | None = None,
          install: bool = False, zone: str | None = None, project: str | None = None) -> None:
    """Mount gs://BUCKET[/PREFIX] on every worker and print what each one has there."""
    from tpufab import mount as mounting
    from tpufab.console import stdout

    settings = settings_from_flags(name=name, zone=zone, project=project)
    spec = mounting.mount_spec(bucket, at=at, driver=driver or settings.mount_driver,
                               options=_driver_options(options),
                               endpoint=settings.storage_endpoint)
    pod = _pod_for(settings)
    report = mounting.apply_mount(pod.fanout, spec, install=install)
    _print_table(("WORKERS", "RESULT", "ENTRIES", "TIME"), (
        (workers, group[0].action or "-", "-" if group[0].entries is None
         else str(group[0].entries), _seconds(group))
        for workers, group in _folded(report.rows, lambda r: (r.action, r.entries))))
    fresh = sum(r.action == "mounted" for r in report.rows)
    had = len(report.rows) - fresh
    outcome = ("every worker already had it" if not fresh
               else f"{fresh} mounted now" + (f", {had} already had it" if had else ""))
    where = f" from {spec.endpoint}" if spec.endpoint else ""
    stdout().print(f"{spec.url}{where} is mounted at {spec.at} on "
                   f"{_count(len(report.rows), 'worker')} ({spec.driver}): {outcome}.",
                   markup=False)


def umount(*, name: str | None = None, at: str | None = None, lazy: bool = False,
           zone: str | None = None, project: str | None = None) -> None:
    """Unmount --at (or, without it, every mount tpufab made) on every worker."""
    from tpufab import mount as mounting
    from tpufab.console import stdout

    mounting.umount_args(at, lazy=lazy)  # a bad --at is refused before connecting
    pod = _pod_for(settings_from_flags(name=name, zone=zone, project=project))
    report = mounting.umount(pod.fanout, at, lazy=lazy)
    if at is None:
        _print_table(("WORKERS", "RESULT", "MOUNT POINTS"), (
            (workers, group[0].action or "-", ", ".join(group[0].unmounted) or "-")
            for workers, group in _folded(report.rows, lambda r: (r.action, *r.unmounted))))
        points = sorted({p for r in report.rows for p in r.unmounted})
        text = (f"Unmounted {', '.join(points)}" if points
                else "Nothing tpufab mounted was mounted")
        stdout().print(f"{text} on {_count(len(report.rows), 'worker')}.", markup=False)
        return
    _print_table(("WORKERS", "RESULT", "TIME"), (
        (workers, group[0].action or "-", _seconds(group))
        for workers, group in _folded(report.rows, lambda r: (r.action,))))
    gone = sum(r.action == "unmounted" for r in report.rows)
    text = (f"Unmounted {report.at} on {_count(gone, 'worker')}" if gone
            else f"{report.at} was not mounted on any of the {len(report.rows)} workers")
    stdout().print(text + ".", markup=False)


# ---------------------------------------------------------------------------------------------
# tpufab sim bucket (here rather than in verbs.py: it serves mount)


def sim_bucket(*, name: str) -> None:
    """Create a bucket in the simulated pod's Cloud Storage (no-op if it exists)."""
    from tpufab.config import load_settings
    from tpufab.console import stdout
    from tpufab.mount import parse_bucket
    from tpufab.sim import daemon
    from tpufab.sim.admin import StorageClient

    bucket, prefix = parse_bucket(name)
    if prefix:
        raise ConfigError(f"Give a bucket name without a prefix ({bucket}, not {name}); "
                          "prefixes need no creating.")
    endpoint = load_settings().storage_endpoint
    if not endpoint:
        status = daemon.status()
        if not status.running or status.info is None:
            raise ConfigError("No simulated Cloud Storage to talk to: TPUFAB_STORAGE_ENDPOINT "
                              "is not set and no simulated pod is running; start one with "
                              "`tpufab sim up`.")
        endpoint = status.info.storage_endpoint
        if not endpoint:
            raise ConfigError("The simulated pod runs without Cloud Storage (the "
                              "gcp-storage-emulator package is missing): pip install "
                              "gcp-storage-emulator, then `tpufab sim down && tpufab sim up`.")
    created = StorageClient(endpoint).create_bucket(bucket)
    state = "Created bucket" if created else "Bucket"
    tail = "" if created else " already exists"
    stdout().print(f"{state} gs://{bucket}{tail} in the Cloud Storage at {endpoint}.",
                   markup=False)


def known_hosts_forget(*, node: str, zone: str | None = None, project: str | None = None) -> None:
    """Drop the host keys tpufab pinned for a node (by node id, or by name via the API)."""
    from tpufab.console import stdout
    from tpufab.hostkeys import KnownHosts

    settings = settings_from_flags(zone=zone, project=project)
    node_id = node
    if not node.isdigit():
        from tpufab import lifecycle

        node_id = lifecycle.control_plane(settings).get_node(lifecycle.validate_name(node)).id
    removed = KnownHosts(settings.known_hosts_path).forget(node_id)
    stdout().print(f"Forgot {_count(removed, 'pinned host key')} of node {node} "
                   f"({settings.known_hosts_path}); the next connection pins the keys again.",
                   markup=False)
