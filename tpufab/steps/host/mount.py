"""Mount a bucket (or a prefix of it) on every worker with gcsfuse or rclone, verified.

Pure builders (``parse_bucket``, ``mount_spec``, ``gcsfuse_argv``, ``rclone_argv``,
``rclone_env``, ``expected_mount``) decide what runs; ``mount`` and ``umount`` apply it with
one round trip per worker through the worker script ``remote/mount_worker.py``.

``endpoint`` (the ``storage_endpoint`` setting) points both drivers at any GCS-compatible JSON
API instead of storage.googleapis.com, e.g. the simulated pod's; a plain-http endpoint is
used without credentials, an https one with the VM's.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from urllib.parse import urlparse

from tpufab import nodeset
from tpufab.errors import ConfigError, TpufabError
from tpufab.quoting import Secret
from tpufab.remote.workerlib import MOUNTS_DIR
from tpufab.reports import Column, Outcome, Report, Workers, answer_row, count, seconds_range, text
from tpufab.ssh.remote_files import run_script

SCRIPT = "mount_worker.py"
DRIVERS = ("gcsfuse", "rclone")
RCLONE_REMOTE = "tpufab"
# rclone's GCS backend on a TPU VM: credentials from the VM's service account (metadata server)
RCLONE_DEFAULTS = {"type": "google cloud storage", "env_auth": "true",
                   "bucket_policy_only": "true"}
RCLONE_SECRET_KEYS = ("service_account_credentials", "client_secret", "token")
BUCKET_NAME = re.compile(r"^[a-z0-9][a-z0-9._-]{1,220}[a-z0-9]$")
INSTALL_HINT = {
    "gcsfuse": "install it with --install (from Google's apt repository, as scripts/setup.sh "
               "does; see docs/mount.md) or mount with --driver rclone",
    "rclone": "install it with --install (apt-get install rclone) or mount with "
              "--driver gcsfuse",
}


class MountError(TpufabError):
    """Mounting or unmounting failed on some workers; ``details`` has every worker."""


@dataclass(frozen=True)
class MountSpec:
    """What to mount where, and how. ``at`` is an absolute path on the workers."""

    bucket: str
    prefix: str = ""
    at: str = ""
    driver: str = "gcsfuse"
    implicit_dirs: bool = True
    file_mode: str | None = None     # octal, e.g. "644"
    dir_mode: str | None = None      # octal, e.g. "755"
    cache_dir: str | None = None
    allow_other: bool = False
    read_only: bool = False
    options: tuple[str, ...] = ()    # extra driver flags, passed through as given
    endpoint: str | None = None      # a GCS-compatible endpoint, http(s)://HOST:PORT

    @property
    def url(self) -> str:
        return f"gs://{self.bucket}/{self.prefix}" if self.prefix else f"gs://{self.bucket}"


def parse_bucket(text: str) -> tuple[str, str]:
    """``gs://bucket/some/prefix/`` (or ``bucket/some/prefix``) -> ("bucket", "some/prefix")."""
    raw = text.strip()
    if raw.startswith("gs://"):
        raw = raw[len("gs://"):]
    elif "://" in raw:
        raise ConfigError(f"{text!r} is not a GCS bucket: give gs://BUCKET[/PREFIX] or "
                          f"BUCKET[/PREFIX].")
    bucket, _, prefix = raw.partition("/")
    prefix = "/".join(p for p in prefix.split("/") if p)
    if not BUCKET_NAME.match(bucket) or ".." in bucket:
        raise ConfigError(f"{bucket!r} is not a valid bucket name: use 3-63 lower-case letters, "
                          f"digits, dashes, dots or underscores, e.g. gs://my-data/prefix.")
    return bucket, prefix


def default_mount_point(bucket: str, prefix: str = "") -> str:
    leaf = prefix.rsplit("/", 1)[-1] if prefix else ""
    return f"/mnt/gcs/{bucket}" + (f"-{leaf}" if leaf else "")


def _octal(value: str | int | None, what: str) -> str | None:
    if value is None:
        return None
    text = value if isinstance(value, str) else format(value, "o")
    text = text.removeprefix("0o")
    if not re.fullmatch(r"0?[0-7]{3}", text):
        raise ConfigError(f"{what} must be octal permission bits like 644, not {value!r}.")
    return text


def json_api_url(endpoint: str) -> str:
    """``http://h:p`` (or ``http://h:p/storage/v1``) -> ``http://h:p/storage/v1/``: the JSON
    API base both drivers take, like their default https://storage.googleapis.com/storage/v1/."""
    base = endpoint.strip().rstrip("/")
    base = base.removesuffix("/storage/v1")
    return f"{base}/storage/v1/"


def anonymous(endpoint: str | None) -> bool:
    """A plain-http endpoint is an emulator or test server: no credentials are sent to it."""
    return bool(endpoint) and endpoint.strip().lower().startswith("http://")


def check_endpoint(endpoint: str | None) -> str | None:
    if endpoint is None or not endpoint.strip():
        return None
    parsed = urlparse(endpoint.strip())
    if parsed.scheme not in ("http", "https") or not parsed.netloc:
        raise ConfigError(f"The storage endpoint must be an http(s) URL like "
                          f"http://127.0.0.1:9023, not {endpoint!r} (TPUFAB_STORAGE_ENDPOINT "
                          "or storage_endpoint in tpufab.yaml).")
    return endpoint.strip()


def driver_options(options: Iterable[str] | None) -> list[str]:
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


def mount_spec(source: str, *, at: str | None = None, driver: str = "gcsfuse",
               options: Sequence[str] = (), implicit_dirs: bool = True,
               file_mode: str | int | None = None, dir_mode: str | int | None = None,
               cache_dir: str | None = None, allow_other: bool = False,
               read_only: bool = False, endpoint: str | None = None) -> MountSpec:
    """Validate the user's input into a MountSpec (pure)."""
    if driver not in DRIVERS:
        raise ConfigError(f"Unknown mount driver {driver!r}: use one of {', '.join(DRIVERS)}.")
    bucket, prefix = parse_bucket(source)
    at = at or default_mount_point(bucket, prefix)
    if not at.startswith("/") or "\0" in at:
        raise ConfigError(f"--at must be an absolute path on the workers, not {at!r}.")
    at = "/" + "/".join(p for p in at.split("/") if p)
    if at == "/":
        raise ConfigError("--at / would hide the whole file system: pick a directory.")
    return MountSpec(bucket, prefix, at, driver, implicit_dirs, _octal(file_mode, "--file-mode"),
                     _octal(dir_mode, "--dir-mode"), cache_dir, allow_other, read_only,
                     tuple(str(o) for o in options), check_endpoint(endpoint))


def gcsfuse_argv(spec: MountSpec) -> list[str]:
    """``gcsfuse [flags] BUCKET MOUNT_POINT`` (gcsfuse daemonizes once the mount is up)."""
    argv = ["gcsfuse"]
    if spec.implicit_dirs:
        argv.append("--implicit-dirs")
    if spec.prefix:
        argv += ["--only-dir", spec.prefix]
    if spec.file_mode:
        argv += ["--file-mode", spec.file_mode]
    if spec.dir_mode:
        argv += ["--dir-mode", spec.dir_mode]
    if spec.cache_dir:
        argv += ["--cache-dir", spec.cache_dir]
    if spec.allow_other:
        argv += ["-o", "allow_other"]
    if spec.read_only:
        argv += ["-o", "ro"]
    if spec.endpoint:
        argv += ["--custom-endpoint", json_api_url(spec.endpoint)]
        if anonymous(spec.endpoint):
            argv.append("--anonymous-access")
    return [*argv, *spec.options, spec.bucket, spec.at]


def rclone_source(spec: MountSpec) -> str:
    return f"{RCLONE_REMOTE}:{spec.bucket}" + (f"/{spec.prefix}" if spec.prefix else "")


def rclone_argv(spec: MountSpec) -> list[str]:
    """``rclone mount tpufab:BUCKET[/PREFIX] MOUNT_POINT --daemon ...``; the remote is defined
    by ``rclone_env`` (environment), so no credentials ever appear here."""
    argv = ["rclone", "mount", rclone_source(spec), spec.at, "--daemon",
            "--vfs-cache-mode", "writes"]
    if spec.file_mode:
        argv += ["--file-perms", "0" + spec.file_mode.lstrip("0").rjust(3, "0")]
    if spec.dir_mode:
        argv += ["--dir-perms", "0" + spec.dir_mode.lstrip("0").rjust(3, "0")]
    if spec.cache_dir:
        argv += ["--cache-dir", spec.cache_dir]
    if spec.allow_other:
        argv.append("--allow-other")
    if spec.read_only:
        argv.append("--read-only")
    return [*argv, *spec.options]


def rclone_endpoint_config(endpoint: str | None) -> dict[str, str]:
    """rclone GCS backend options for a custom endpoint (none for storage.googleapis.com)."""
    if not endpoint:
        return {}
    config = {"endpoint": json_api_url(endpoint), "bucket_policy_only": "true"}
    if anonymous(endpoint):
        config.update(anonymous="true", env_auth="false")
    return config


def rclone_env(config: Mapping[str, str | Secret] | None = None
               ) -> tuple[dict[str, str], dict[str, Secret]]:
    """rclone's ``RCLONE_CONFIG_TPUFAB_*`` variables for the GCS remote: (plain, secret).
    Credentials (``RCLONE_SECRET_KEYS`` or any Secret value) go in the secret half."""
    merged: dict[str, str | Secret] = {**RCLONE_DEFAULTS, **(config or {})}
    plain, secret = {}, {}
    for key, value in merged.items():
        name = f"RCLONE_CONFIG_{RCLONE_REMOTE.upper()}_{key.upper().replace('-', '_')}"
        if isinstance(value, Secret) or key in RCLONE_SECRET_KEYS:
            secret[name] = value if isinstance(value, Secret) else Secret(str(value))
        else:
            plain[name] = str(value)
    return plain, secret


def expected_mount(spec: MountSpec) -> tuple[str, str]:
    """(fstype, source) as /proc/self/mountinfo shows the finished mount."""
    if spec.driver == "rclone":
        return "fuse.rclone", rclone_source(spec)
    return "fuse.gcsfuse", spec.bucket


def worker_args(spec: MountSpec, *, install: bool = False,
                log_file: str | None = None) -> list[str]:
    """Arguments of ``mount_worker.py mount`` (pure)."""
    fstype, source = expected_mount(spec)
    args = ["mount", "--at", spec.at, "--fstype", fstype, "--source", source,
            "--url", spec.url, "--state-file", state_path(spec.at)]
    if spec.driver == "rclone":
        # rclone mounts a missing bucket without complaint: look at the bucket first
        probe = ["rclone", "lsjson", "--stat", f"{RCLONE_REMOTE}:{spec.bucket}"]
        args += ["--check-argv", json.dumps(probe)]
    if install:
        args.append("--install")
    if log_file:
        args += ["--log-file", log_file]
    driver_argv = rclone_argv(spec) if spec.driver == "rclone" else gcsfuse_argv(spec)
    return [*args, "--", *driver_argv]


def _slug(at: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", at.strip("/"))


STATE_DIR = MOUNTS_DIR  # on each worker: one record and one log per mount point (workerlib)
ALL_MOUNTS = "every tpufab mount"


def log_path(spec: MountSpec) -> str:
    return f"{STATE_DIR}/{_slug(spec.at)}.log"


def state_path(at: str) -> str:
    return f"{STATE_DIR}/{_slug(at)}.json"


# --- reports --------------------------------------------------------------------------------

@dataclass
class MountRow:
    worker: int
    ok: bool
    action: str | None = None     # mounted | noop | unmounted
    entries: int | None = None
    error: str | None = None
    message: str | None = None
    seconds: float | None = None
    at: str | None = None                 # where, when the worker says (umount of every mount)
    unmounted: list[str] = field(default_factory=list)


MOUNT_COLUMNS = (Column("RESULT", lambda r: r.action or "-"),
                 Column("ENTRIES", lambda r: r.entries),
                 Column("TIME", over=seconds_range))
UMOUNT_COLUMNS = (Column("RESULT", lambda r: r.action or "-"), Column("TIME", over=seconds_range))
UMOUNT_ALL_COLUMNS = (Column("RESULT", lambda r: r.action or "-"),
                      Column("MOUNT POINTS", lambda r: ", ".join(r.unmounted) or "-"))


@dataclass(kw_only=True)
class MountReport(Report):
    """The per-worker rows of a mount or umount (``tpufab.reports.Report``)."""

    step: str = "mount"
    columns: tuple[Column, ...] = MOUNT_COLUMNS
    at: str
    source: str = ""
    seconds: float = 0.0


def mount_summary(report: MountReport, spec: MountSpec) -> str:
    """``gs://b is mounted at /mnt/gcs/b on 4 workers (gcsfuse): 4 mounted now.``"""
    fresh = sum(r.action == "mounted" for r in report.rows)
    had = len(report.rows) - fresh
    outcome = ("every worker already had it" if not fresh
               else f"{fresh} mounted now" + (f", {had} already had it" if had else ""))
    where = f" from {spec.endpoint}" if spec.endpoint else ""
    return (f"{spec.url}{where} is mounted at {spec.at} on "
            f"{count(len(report.rows), 'worker')} ({spec.driver}): {outcome}.")


def umount_summary(report: MountReport, at: str | None) -> str:
    """``Unmounted /mnt/gcs/b on 4 workers.`` (or that it was not mounted)."""
    if at is None:
        points = sorted({p for r in report.rows for p in r.unmounted})
        text = (f"Unmounted {', '.join(points)}" if points
                else "Nothing tpufab mounted was mounted")
        return f"{text} on {count(len(report.rows), 'worker')}."
    gone = sum(r.action == "unmounted" for r in report.rows)
    return (f"Unmounted {report.at} on {count(gone, 'worker')}" if gone
            else f"{report.at} was not mounted on any of the {len(report.rows)} workers") + "."


def parse_outcome(worker: int, outcome: Outcome) -> MountRow:
    return answer_row(MountRow, worker, outcome, seconds=getattr(outcome, "duration", None))


MOUNT_SENTENCES = {
    "driver_missing": "{driver} is not installed on {who}: {hint}.",
    "fuse_unavailable": "FUSE is not available on {who} ({message}): install fuse3 and make "
                        "sure /dev/fuse exists and is usable there.",
    "busy": "{at} is busy on {who} ({message}): unmount it first (tpufab umount --at {at}) "
            "or pick another --at.",
    "not_empty": "{at} is not empty on {who}: mount somewhere else with --at, or empty it.",
    "bucket_missing": "Bucket gs://{bucket} does not exist (as seen from {who}): check the "
                      "name, or create it {create}.",
    "access_denied": "{who} may not read gs://{bucket} (access denied): grant the TPU VM's "
                     "service account roles/storage.objectUser (or objectViewer) on the bucket.",
    "permission": "{who} cannot create {at}: allow passwordless sudo for the SSH user there, "
                  "or mount under the home directory with --at.",
    "timeout": "Mounting timed out on {who} ({message}): see the driver log under "
               "~/.cache/tpufab/mounts/ on those workers.",
    "ssh": "{who} could not run the mount step over SSH: check that the workers are up "
           "(tpufab status) and try again.",
    "driver_failed": "{driver} failed on {who}: see the per-worker messages below.",
    "no_python": "python3 is not installed on {who}: install it there (apt-get install "
                 "python3), then mount again.",
    "disk_full": "{who} ran out of disk space ({message}): free space there, then mount again.",
}
# The same sentences for a mount a task file asks for (`tpufab launch`): the advice names what
# the task can change, and `tpufab mount` where only that verb can help (launch has no --at).
TASK_MOUNT_SENTENCES = {
    **MOUNT_SENTENCES,
    "driver_missing": "{driver} is not installed on {who}: install it once with `tpufab mount "
                      "gs://{bucket} --at {at} --driver {driver} --install`, or give the "
                      "mount `driver: {other}` in the task (tpufab's schema) or set the "
                      "mount_driver setting to {other}.",
    "busy": "{at} is busy on {who} ({message}): unmount it first (`tpufab umount --at {at}`) "
            "or mount at another path in the task.",
    "not_empty": "{at} is not empty on {who}: mount at another path in the task, or empty it.",
    "permission": "{who} cannot create {at}: allow passwordless sudo for the SSH user there, "
                  "or mount under the home directory (~/...) in the task.",
}

UMOUNT_SENTENCES = {
    "busy": "{at} is busy on {who} (a process still has files open there): stop it "
            "(tpufab kill) and try again, or unmount lazily with --lazy.",
    "ssh": MOUNT_SENTENCES["ssh"],
    "driver_failed": "Unmounting {at} failed on {who}: see the per-worker messages below.",
}


def _sentence(rows: Sequence[MountRow], table: Mapping[str, str], **facts: str) -> str:
    failed = [r for r in rows if not r.ok]
    kinds: dict[str, list[MountRow]] = {}
    for row in failed:
        kinds.setdefault(row.error if row.error in table else "driver_failed", []).append(row)
    kind, members = max(kinds.items(), key=lambda kv: len(kv[1]))
    who = nodeset.fold(r.worker for r in members)
    who = ("worker " if len(members) == 1 else "workers ") + who
    text = table[kind].format(who=who, message=members[0].message or "", **facts)
    if text.startswith("worker"):
        text = "W" + text[1:]
    if len(failed) > len(members):
        text += f" ({len(failed) - len(members)} more failed otherwise; see below.)"
    return text


def create_hint(spec: MountSpec) -> str:
    """How to create the bucket: with gcloud, or on the custom endpoint the mount used."""
    if spec.endpoint:
        return (f"at {spec.endpoint} (on the simulated pod: `tpufab sim bucket "
                f"{spec.bucket}`)")
    return f"with `gcloud storage buckets create gs://{spec.bucket}`"


# --- the operations -------------------------------------------------------------------------

def mount(fanout: Workers, source: str, *, at: str | None = None, driver: str = "gcsfuse",
          options: Sequence[str] = (), install: bool = False,
          rclone_config: Mapping[str, str | Secret] | None = None, implicit_dirs: bool = True,
          file_mode: str | int | None = None, dir_mode: str | int | None = None,
          cache_dir: str | None = None, allow_other: bool = False,
          read_only: bool = False, endpoint: str | None = None,
          for_task: bool = False) -> MountReport:
    """Mount ``gs://BUCKET[/PREFIX]`` at ``at`` on every worker of ``fanout``; a worker that
    already has it mounted is a verified no-op. Raises MountError naming every failure.

    ``endpoint``: a GCS-compatible endpoint instead of Google's (see ``json_api_url``).
    ``for_task``: a task file's mount (launch): the advice names the task, not --at.
    ``rclone_config``: rclone GCS backend options (``service_account_credentials``...) on top
    of ``RCLONE_DEFAULTS`` and the endpoint's; sent as environment, credentials as secrets on
    the fan-out's stdin, never in argv or files.
    """
    spec = mount_spec(source, at=at, driver=driver, options=options,
                      implicit_dirs=implicit_dirs, file_mode=file_mode, dir_mode=dir_mode,
                      cache_dir=cache_dir, allow_other=allow_other, read_only=read_only,
                      endpoint=endpoint)
    return apply_mount(fanout, spec, install=install, rclone_config=rclone_config,
                       for_task=for_task)


def apply_mount(fanout: Workers, spec: MountSpec, *, install: bool = False,
                rclone_config: Mapping[str, str | Secret] | None = None,
                sink=None, timeout: float | None = None,
                for_task: bool = False) -> MountReport:
    """Mount ``spec`` on every worker of ``fanout``; ``timeout``: seconds each step on a worker
    may take (None: the fan-out's command_timeout). Raises MountError naming every failure."""
    start = time.monotonic()
    env: dict[str, str] = {}
    secrets: dict[str, Secret] = {}
    if spec.driver == "rclone":
        env, secrets = rclone_env({**rclone_endpoint_config(spec.endpoint),
                                   **(rclone_config or {})})
    workers = list(fanout.workers)
    args = worker_args(spec, install=install, log_file=log_path(spec))
    outcomes = run_script(fanout, SCRIPT, args, workers, secrets=secrets or None, env=env or None,
                          sink=sink, timeout=timeout)
    report = MountReport(at=spec.at, source=spec.url,
                         rows=[parse_outcome(w, outcomes[w]) for w in workers])
    report.seconds = round(time.monotonic() - start, 3)
    if any(not r.ok for r in report.rows):
        other = "rclone" if spec.driver == "gcsfuse" else "gcsfuse"
        hint = INSTALL_HINT[spec.driver].replace("--driver rclone", f"--driver {other}")
        raise MountError(_sentence(report.rows,
                                   TASK_MOUNT_SENTENCES if for_task else MOUNT_SENTENCES,
                                   driver=spec.driver, at=spec.at, bucket=spec.bucket,
                                   hint=hint, create=create_hint(spec), other=other),
                         details="\n".join(text(report)))
    report.summary = mount_summary(report, spec)
    return report


def umount_args(at: str | None, *, lazy: bool = False) -> list[str]:
    """Arguments of ``mount_worker.py umount`` (pure); ``at=None``: every tpufab mount."""
    if at is None:
        where = ["--all", "--state-dir", STATE_DIR]
    else:
        if not at.startswith("/"):
            raise ConfigError(f"--at must be an absolute path on the workers, not {at!r}.")
        at = "/" + "/".join(p for p in at.split("/") if p)
        where = ["--at", at, "--state-file", state_path(at)]
    return ["umount", *where, *(["--lazy"] if lazy else [])]


def umount(fanout: Workers, at: str | None, *, lazy: bool = False,
           timeout: float | None = None) -> MountReport:
    """Unmount ``at`` on every worker (lazily only if asked); not mounted is a no-op.
    ``at=None`` unmounts every mount point tpufab mounted there (and still mounted).
    ``timeout``: seconds each step on a worker may take (None: the fan-out's default)."""
    args = umount_args(at, lazy=lazy)
    start = time.monotonic()
    workers = list(fanout.workers)
    outcomes = run_script(fanout, SCRIPT, args, workers, timeout=timeout)
    report = MountReport(step="umount", at=at or ALL_MOUNTS,
                         columns=UMOUNT_COLUMNS if at else UMOUNT_ALL_COLUMNS,
                         rows=[parse_outcome(w, outcomes[w]) for w in workers])
    report.seconds = round(time.monotonic() - start, 3)
    if any(not r.ok for r in report.rows):
        failed_at = next((r.at for r in report.rows if not r.ok and r.at), None)
        raise MountError(_sentence(report.rows, UMOUNT_SENTENCES, at=failed_at or at or "a mount"),
                         details="\n".join(text(report)))
    report.summary = umount_summary(report, at)
    return report
