"""Code and data on every worker: deploy, mount, umount."""

from __future__ import annotations

from collections.abc import Iterable

from tpufab.verbs.common import pod_for, progress, settings_from_flags
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
    from tpufab.views.progress import WorkerProgress

    pod = pod_for(settings_from_flags(name=name, zone=zone, project=project,
                                   no_os_login=no_os_login,
                                      jump=jump, timeout=timeout))
    with WorkerProgress("deploy") as shown:  # the local checks come first, before any SSH
        report = pod.deploy(ref, remote=remote, dir=dir, direct=direct, wip=wip,
                            timeout=timeout, progress=progress, sink=shown)
    from tpufab.views.report import show

    show(report)


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
    from tpufab.views.progress import WorkerProgress

    pod = pod_for(settings_from_flags(name=name, zone=zone, project=project,
                                      no_os_login=no_os_login, jump=jump, timeout=timeout))
    spec = pod.mount_spec(bucket, at=at, driver=driver, options=options)  # before connecting
    with WorkerProgress(f"mount {spec.url}", len(pod.workers)) as shown:
        report = pod.mount(bucket, at=at, driver=driver, options=options, install=install,
                           timeout=timeout, sink=shown)
    from tpufab.views.report import show

    show(report)


@verb(options={"at": "Mount point (default: every mount tpufab made).",
                 "lazy": "Detach now even if files are open there."},
      pod_method="umount")
def umount(*, name: str | None = None, at: str | None = None, lazy: bool = False,
           timeout: float = MOUNT_TIMEOUT, zone: str | None = None,
           project: str | None = None,
        no_os_login: bool = False, jump: str | None = None) -> None:
    """Unmount --at (or every mount tpufab made) on every worker.

    ``timeout``: seconds each step on the workers may take (default 300)."""
    pod = pod_for(settings_from_flags(name=name, zone=zone, project=project,
                                   no_os_login=no_os_login,
                                      jump=jump, timeout=timeout))
    report = pod.umount(at, lazy=lazy, timeout=timeout)  # a bad --at: refused before connecting
    from tpufab.views.report import show

    show(report)
