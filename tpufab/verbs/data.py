"""Code and data on every worker: deploy, mount, umount."""

from __future__ import annotations

from collections.abc import Iterable

from tpufab.verbs.common import (
    count,
    folded,
    pod_for,
    print_table,
    progress,
    seconds_range,
    settings_from_flags,
)
from tpufab.verbs.declare import Opt, verb

DEPLOY_TIMEOUT = 600.0   # seconds per step on the workers (a big clone over a slow link)
MOUNT_TIMEOUT = 300.0    # seconds per step (installing gcsfuse included)


@verb(options={"ref": "Commit, branch or tag to deploy.", "remote": "Git remote the workers fetch from.",
                 "dir": "Checkout on the workers (default: remote_dir, else ~/<repo name>).",
                 "direct": "Send the commit over SSH; no remote, no credentials on workers.",
                 "wip": "Deploy the working tree as it is (a snapshot commit on a side ref)."},
      pod_method="deploy")
def deploy(*, name: str | None = None, ref: str = "HEAD", remote: str = "origin",
           dir: str | None = None, direct: bool = False, wip: bool = False,
           timeout: float = DEPLOY_TIMEOUT, zone: str | None = None,
           project: str | None = None,
        no_os_login: bool = False, jump: str | None = None) -> None:
    """Put exactly one commit of this repository on every worker, verified.

    ``timeout``: seconds each step on the workers may take (default 600). One writer at a
    time: a deploy while a run reads the checkout, or while another deploy is under way, is
    refused with one sentence (docs/reliability.md)."""
    from tpufab.display.console import stdout
    from tpufab.display.progress import WorkerProgress

    pod = pod_for(settings_from_flags(name=name, zone=zone, project=project,
                                   no_os_login=no_os_login,
                                      jump=jump, timeout=timeout))
    with WorkerProgress("deploy") as shown:  # the local checks come first, before any SSH
        report = pod.deploy(ref, remote=remote, dir=dir, direct=direct, wip=wip,
                            timeout=timeout, progress=progress, sink=shown)
    print_table(("WORKERS", "COMMIT", "RESULT", "TIME"), (
        (workers, (group[0].commit or "-")[:12], group[0].action or "-", seconds_range(group))
        for workers, group in folded(report.rows, lambda r: (r.commit, r.action))))
    changed = sum(r.changed for r in report.rows)
    what = report.commit[:12] + (f" ({report.branch})" if report.branch else "")
    if report.wip_ref:
        what += f" (work-in-progress snapshot, {report.wip_ref})"
    how = ("over SSH (--direct)" if direct
           else f"through {remote} ({'pushed' if report.pushed == 'pushed' else 'already there'})")
    same = len(report.rows) - changed
    outcome = ("every worker was already there" if not changed
               else f"{changed} changed" + (f", {same} already there" if same else ""))
    stdout().print(f"Deployed {what} to {count(len(report.rows), 'worker')} in {report.dir} "
                   f"{how}: {outcome} ({report.seconds:.1f}s).", markup=False)


@verb(options={"bucket": "gs://BUCKET[/PREFIX] or BUCKET[/PREFIX].",
                 "at": "Mount point on the workers (default /mnt/gcs/BUCKET).",
                 "driver": "gcsfuse (default: mount_driver) or rclone.",
                 "options": Opt("Extra driver flags, quoted (repeatable).", metavar="'FLAGS'"),
                 "install": "Install a missing driver on the workers."},
      pod_method="mount")
def mount(*, bucket: str, name: str | None = None, at: str | None = None,
          driver: str | None = None, options: Iterable[str] | None = None,
          install: bool = False, timeout: float = MOUNT_TIMEOUT, zone: str | None = None,
          project: str | None = None,
        no_os_login: bool = False, jump: str | None = None) -> None:
    """Mount a Cloud Storage bucket (or a prefix of it) on every worker, verified.

    ``timeout``: seconds each step on the workers may take (default 300)."""
    from tpufab.display.console import stdout
    from tpufab.display.progress import WorkerProgress

    pod = pod_for(settings_from_flags(name=name, zone=zone, project=project,
                                      no_os_login=no_os_login, jump=jump, timeout=timeout))
    spec = pod.mount_spec(bucket, at=at, driver=driver, options=options)  # before connecting
    with WorkerProgress(f"mount {spec.url}", len(pod.workers)) as shown:
        report = pod.mount(bucket, at=at, driver=driver, options=options, install=install,
                           timeout=timeout, sink=shown)
    print_table(("WORKERS", "RESULT", "ENTRIES", "TIME"), (
        (workers, group[0].action or "-", "-" if group[0].entries is None
         else str(group[0].entries), seconds_range(group))
        for workers, group in folded(report.rows, lambda r: (r.action, r.entries))))
    fresh = sum(r.action == "mounted" for r in report.rows)
    had = len(report.rows) - fresh
    outcome = ("every worker already had it" if not fresh
               else f"{fresh} mounted now" + (f", {had} already had it" if had else ""))
    where = f" from {spec.endpoint}" if spec.endpoint else ""
    stdout().print(f"{spec.url}{where} is mounted at {spec.at} on "
                   f"{count(len(report.rows), 'worker')} ({spec.driver}): {outcome}.",
                   markup=False)


@verb(options={"at": "Mount point (default: every mount tpufab made).",
                 "lazy": "Detach now even if files are open there."},
      pod_method="umount")
def umount(*, name: str | None = None, at: str | None = None, lazy: bool = False,
           timeout: float = MOUNT_TIMEOUT, zone: str | None = None,
           project: str | None = None,
        no_os_login: bool = False, jump: str | None = None) -> None:
    """Unmount --at (or every mount tpufab made) on every worker.

    ``timeout``: seconds each step on the workers may take (default 300)."""
    from tpufab.display.console import stdout

    pod = pod_for(settings_from_flags(name=name, zone=zone, project=project,
                                   no_os_login=no_os_login,
                                      jump=jump, timeout=timeout))
    report = pod.umount(at, lazy=lazy, timeout=timeout)  # a bad --at: refused before connecting
    if at is None:
        print_table(("WORKERS", "RESULT", "MOUNT POINTS"), (
            (workers, group[0].action or "-", ", ".join(group[0].unmounted) or "-")
            for workers, group in folded(report.rows, lambda r: (r.action, *r.unmounted))))
        points = sorted({p for r in report.rows for p in r.unmounted})
        text = (f"Unmounted {', '.join(points)}" if points
                else "Nothing tpufab mounted was mounted")
        stdout().print(f"{text} on {count(len(report.rows), 'worker')}.", markup=False)
        return
    print_table(("WORKERS", "RESULT", "TIME"), (
        (workers, group[0].action or "-", seconds_range(group))
        for workers, group in folded(report.rows, lambda r: (r.action,))))
    gone = sum(r.action == "unmounted" for r in report.rows)
    text = (f"Unmounted {report.at} on {count(gone, 'worker')}" if gone
            else f"{report.at} was not mounted on any of the {len(report.rows)} workers")
    stdout().print(text + ".", markup=False)
