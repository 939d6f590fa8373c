"""Code and data on every worker: deploy, mount, umount."""

from __future__ import annotations

from tpufab.verbs.common import progress
from tpufab.verbs.declare import Call, Opt, verb

PLACE = 6   # where this family's verbs show in `tpufab --help`


@verb(options={"ref": "Commit, branch or tag to deploy.",
               "remote": "Git remote the workers fetch from.",
               "dir": "Checkout on the workers (default: remote_dir, else ~/<repo name>).",
               "direct": "Send the commit over SSH; no remote, no credentials on workers.",
               "wip": "Deploy the working tree as it is (a snapshot commit on a side ref)."},
      pod_method="deploy", api_only=("cwd",))
def deploy(call: Call) -> None:
    """Put exactly one commit of this repository on every worker, verified.

    ``timeout``: seconds each step on the workers may take. One writer at a time: a deploy
    while a run reads the checkout, or while another deploy is under way, is refused with one
    sentence (docs/reliability.md)."""
    from tpufab.views.progress import WorkerProgress
    from tpufab.views.report import show

    with WorkerProgress("deploy") as shown:  # the local checks come first, before any SSH
        report = call(progress=progress, sink=shown)
    show(report)


@verb(options={"bucket": "gs://BUCKET[/PREFIX] or BUCKET[/PREFIX].",
               "at": "Mount point on the workers (default /mnt/gcs/BUCKET).",
               "driver": "gcsfuse (default: mount_driver) or rclone.",
               "options": Opt("Extra driver flags, quoted (repeatable).", metavar="'FLAGS'"),
               "install": "Install a missing driver on the workers."},
      pod_method="mount")
def mount(call: Call) -> None:
    """Mount a Cloud Storage bucket (or a prefix of it) on every worker, verified.

    ``timeout``: seconds each step on the workers may take."""
    from tpufab.views.progress import WorkerProgress
    from tpufab.views.report import show

    a = call.args
    spec = call.pod.mount_spec(a["bucket"], at=a["at"], driver=a["driver"],
                               options=a["options"])  # checked before connecting
    with WorkerProgress(f"mount {spec.url}", len(call.pod.workers)) as shown:
        report = call(sink=shown)
    show(report)


@verb(options={"at": "Mount point (default: every mount tpufab made).",
               "lazy": "Detach now even if files are open there."},
      pod_method="umount")
def umount(call: Call) -> None:
    """Unmount --at (or every mount tpufab made) on every worker.

    ``timeout``: seconds each step on the workers may take."""
    from tpufab.views.report import show

    show(call())  # a bad --at: refused before connecting
