#!/usr/bin/env python3
"""tpufab mount, worker side (stdlib only; shipped once per content hash).

    mount_worker.py mount --at DIR --fstype fuse.rclone --source SRC [--url gs://B/P]
                    [--state-file PATH] [--check-argv JSON] [--install] [--log-file PATH]
                    -- DRIVER ARGV...
    mount_worker.py umount --at DIR [--lazy] [--state-file PATH]
    mount_worker.py umount --all --state-dir DIR [--lazy]
    mount_worker.py status --at DIR

``umount --all`` unmounts every mount point recorded in the state files of --state-dir (what
tpufab mounted) that is still mounted, and forgets the others.

``mount``: if DIR already holds SRC (same FUSE type), verify and report "noop"; else check
the driver and FUSE, create DIR (with ``sudo -n`` when needed), refuse a busy or non-empty
DIR, run ``--check-argv`` (a cheap bucket probe) then the driver argv, wait (bounded) for the
mount, and verify it with ``mountpoint`` and a listing. Driver configuration comes from the
environment (tpufab sends it over the fan-out agent, secrets on stdin), never from argv.

Prints one JSON object: {"ok": true, "action": "mounted"|"noop"|"unmounted", ...} or
{"ok": false, "error": KIND, "message": TEXT} with KIND one of driver_missing,
fuse_unavailable, busy, not_empty, bucket_missing, access_denied, permission, timeout,
driver_failed. Exit status: 0 ok, 3 failure.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import re
import shutil
import stat
import subprocess
import sys
import tempfile
import time

from tpufab.remote.workerlib import (
    answer,
    mount_records,
    read_json,
    unescape,
    write_atomic,
)

MOUNT_WAIT = 30.0
POLL = 0.05

BUCKET_MISSING = ("directory not found", "bucket doesn't exist", "bucket does not exist",
                  "notfound", "error 404", "no such bucket")
ACCESS_DENIED = ("error 403", "error 401", "forbidden", "access denied", "accessdenied",
                 "permission denied", "permission_denied", "does not have storage.")
NO_FUSE = ("fuse device not found", "/dev/fuse", "fusermount: not found",
           "fusermount3: not found", "no fusermount", "fuse: device not found")


class Failure(Exception):
    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind
        self.message = message


def plain_source(seen: str) -> str:
    """rclone shows a remote configured from the environment as ``name{hash}:path``."""
    return re.sub(r"^([^:{]*)\{[^}]*\}:", r"\1:", seen)


def mounts_at(path: str) -> list[dict]:
    """Every mount stacked on ``path`` (from /proc/self/mountinfo), bottom first."""
    found = []
    with open("/proc/self/mountinfo") as fh:
        for line in fh:
            left, _, right = line.partition(" - ")
            fields, rest = left.split(), right.split()
            if len(fields) >= 5 and len(rest) >= 2 and unescape(fields[4]) == path:
                found.append({"fstype": rest[0], "source": plain_source(unescape(rest[1]))})
    return found


def is_mountpoint(path: str) -> bool:
    tool = shutil.which("mountpoint")
    if tool:
        return subprocess.run([tool, "-q", path], stdin=subprocess.DEVNULL).returncode == 0
    return bool(mounts_at(path))


def classify(text: str, default: str = "driver_failed") -> str:
    lower = text.lower()
    if any(s in lower for s in NO_FUSE):
        return "fuse_unavailable"
    if any(s in lower for s in ACCESS_DENIED):
        return "access_denied"
    if any(s in lower for s in BUCKET_MISSING):
        return "bucket_missing"
    return default


# rclone's and gcsfuse's log prefix ("2026/11/29 00:40:31 ", "2026-11-29T00:40:31.123Z "): it
# differs between workers by a second and would keep their identical reasons from folding
LOG_TIME = re.compile(r"^\d{4}[/-]\d\d[/-]\d\d[ T]\d\d:\d\d:\d\d(?:[.,]\d+)?Z?\s+")


def telling_line(text: str) -> str:
    """The most telling line (without its log time): the last one that names an error, else
    the last one."""
    lines = [LOG_TIME.sub("", line.strip()) for line in text.strip().splitlines() if line.strip()]
    telling = [line for line in lines if "error" in line.lower() or "fail" in line.lower()]
    return (telling or lines or ["no output"])[-1][:300]


def sudo(argv: list[str]) -> list[str]:
    if os.geteuid() == 0:
        return argv
    return ["sudo", "-n", *argv]


def codename() -> str:
    """The Debian/Ubuntu release codename (gcsfuse's apt repository is per release)."""
    try:
        with open("/etc/os-release") as fh:
            for line in fh:
                if line.startswith("VERSION_CODENAME="):
                    return line.split("=", 1)[1].strip().strip('"')
    except OSError:
        pass
    return "jammy"


def install_steps(driver: str) -> list[tuple[list[str], str | None]]:
    """apt steps that install ``driver`` (gcsfuse from Google's repository, as documented at
    cloud.google.com/storage/docs/cloud-storage-fuse/install)."""
    steps = []
    if driver == "gcsfuse":
        keyring = "/usr/share/keyrings/cloud.google.asc"
        repo = (f"deb [signed-by={keyring}] https://packages.cloud.google.com/apt "
                f"gcsfuse-{codename()} main")
        steps += [(["curl", "-fsSL", "-o", keyring,
                    "https://packages.cloud.google.com/apt/doc/apt-key.gpg"], None),
                  (["tee", "/etc/apt/sources.list.d/gcsfuse.list"], repo + "\n")]
    packages = [driver] if driver == "gcsfuse" else ["fuse3", driver]
    steps += [(["apt-get", "update", "-qq"], None),
              (["env", "DEBIAN_FRONTEND=noninteractive", "apt-get", "install", "-y", "-qq",
                *packages], None)]
    return steps


def ensure_driver(argv: list[str], install: bool) -> None:
    if shutil.which(argv[0]):
        return
    if not install:
        raise Failure("driver_missing", f"{argv[0]} is not installed")
    for step, feed in install_steps(os.path.basename(argv[0])):
        proc = subprocess.run(sudo(step), capture_output=True, text=True,
                              input=feed if feed is not None else "")
        if proc.returncode != 0:
            raise Failure("driver_missing", f"installing {argv[0]} failed at "
                          f"`{' '.join(step[:3])}`: {telling_line(proc.stderr or proc.stdout)}")
    if not shutil.which(argv[0]):
        raise Failure("driver_missing", f"{argv[0]} is still missing after installing it")


def ensure_fuse() -> None:
    if not os.path.exists("/dev/fuse"):
        raise Failure("fuse_unavailable", "/dev/fuse does not exist")
    info = os.stat("/dev/fuse")
    if not stat.S_ISCHR(info.st_mode) or (os.major(info.st_rdev), os.minor(info.st_rdev)) != (
            10, 229):
        raise Failure("fuse_unavailable", "/dev/fuse is not the FUSE device (10, 229)")
    if not (shutil.which("fusermount3") or shutil.which("fusermount")) and os.geteuid() != 0:
        raise Failure("fuse_unavailable", "fusermount is not installed (apt-get install fuse3)")
    try:
        os.close(os.open("/dev/fuse", os.O_RDWR))
    except OSError as err:
        raise Failure("fuse_unavailable", f"cannot open /dev/fuse ({err.strerror})") from None


def ensure_dir(path: str) -> None:
    if os.path.isdir(path):
        if os.listdir(path):
            raise Failure("not_empty", f"{path} is not empty")
        return
    if os.path.exists(path):
        raise Failure("not_empty", f"{path} exists and is not a directory")
    try:
        os.makedirs(path)
    except PermissionError:
        steps = [["mkdir", "-p", path], ["chown", f"{os.getuid()}:{os.getgid()}", path]]
        for step in steps:
            proc = subprocess.run(sudo(step), capture_output=True, text=True,
                                  stdin=subprocess.DEVNULL)
            if proc.returncode != 0:
                raise Failure("permission", f"cannot create {path}: "
                              f"{telling_line(proc.stderr)}") from None


def daemon_env() -> dict[str, str]:
    """The driver outlives this command: drop the fan-out's per-command marker so that
    stopping a later command never takes the mount down with it."""
    return {k: v for k, v in os.environ.items() if k != "TPUFAB_TASK"}


def verify(path: str) -> int:
    if not is_mountpoint(path):
        raise Failure("driver_failed", f"{path} is not a mount point after mounting")
    try:
        return len(os.listdir(path))
    except OSError as err:
        kind = "access_denied" if err.errno in (errno.EACCES, errno.EPERM) else "driver_failed"
        raise Failure(kind, f"listing {path} failed ({err.strerror})") from None


def log_tail(path: str | None) -> str:
    if not path or not os.path.exists(path):
        return ""
    with open(path, errors="replace") as fh:
        return fh.read()[-4000:]


def read_state(path: str | None) -> dict:
    """What tpufab mounted here last (gcsfuse shows only the bucket in mountinfo, not the
    --only-dir prefix, so the full gs:// URL is kept beside the log)."""
    found = read_json(os.path.expanduser(path)) if path else None
    return found if isinstance(found, dict) else {}


def write_state(path: str | None, state: dict | None) -> None:
    if not path:
        return
    path = os.path.expanduser(path)
    if state is None:
        if os.path.exists(path):
            os.unlink(path)
        return
    os.makedirs(os.path.dirname(path), exist_ok=True)
    write_atomic(path, json.dumps(state))


def mount(args: argparse.Namespace) -> dict:
    at = os.path.abspath(os.path.expanduser(args.at))
    stacked = mounts_at(at)
    if stacked:
        top = stacked[-1]
        recorded = read_state(args.state_file).get("url")
        same = top["fstype"] == args.fstype and plain_source(top["source"]) == args.source
        if same and recorded in (None, args.url):
            return {"ok": True, "action": "noop", "at": at, "source": args.source,
                    "entries": verify(at)}
        what = recorded if same and recorded else f"{top['source']} ({top['fstype']})"
        raise Failure("busy", f"{at} already has {what} mounted")
    ensure_driver(args.argv, args.install)
    ensure_fuse()
    ensure_dir(at)
    if args.check_argv:
        check = subprocess.run(json.loads(args.check_argv), capture_output=True, text=True,
                               stdin=subprocess.DEVNULL, timeout=MOUNT_WAIT)
        if check.returncode != 0:
            text = check.stderr + check.stdout
            raise Failure(classify(text), telling_line(text))
    if args.log_file:
        log = os.path.expanduser(args.log_file)
        os.makedirs(os.path.dirname(log) or ".", exist_ok=True)
        if os.path.exists(log):
            os.unlink(log)
        # before the positional arguments: older gcsfuse releases stop parsing flags there
        argv = [args.argv[0], "--log-file", log, *args.argv[1:]]
    else:
        log, argv = None, list(args.argv)
    # Output to a file, not a pipe: a daemonizing driver's child may keep it open for good.
    with tempfile.TemporaryFile("w+") as out:
        try:
            code = subprocess.run(argv, stdout=out, stderr=out, stdin=subprocess.DEVNULL,
                                  env=daemon_env(), timeout=MOUNT_WAIT).returncode
        except subprocess.TimeoutExpired:
            raise Failure("timeout", f"{argv[0]} did not finish mounting within "
                          f"{MOUNT_WAIT:.0f}s") from None
        out.seek(0)
        said = out.read()
    if code != 0:
        text = said + log_tail(log)
        raise Failure(classify(text), telling_line(said or log_tail(log)))
    deadline = time.monotonic() + MOUNT_WAIT
    while not mounts_at(at):
        if time.monotonic() > deadline:
            raise Failure("timeout", f"{at} was not mounted {MOUNT_WAIT:.0f}s after "
                          f"{argv[0]} returned: {telling_line(log_tail(log))}")
        time.sleep(POLL)
    entries = verify(at)
    write_state(args.state_file, {"url": args.url, "at": at, "source": args.source})
    return {"ok": True, "action": "mounted", "at": at, "source": args.source,
            "entries": entries}


def unmount(at: str, lazy: bool, state_file: str | None) -> dict:
    at = os.path.abspath(os.path.expanduser(at))
    stacked = mounts_at(at)
    if not stacked:
        write_state(state_file, None)
        return {"ok": True, "action": "noop", "at": at}
    source = stacked[-1]["source"]
    tool = shutil.which("fusermount3") or shutil.which("fusermount")
    fuse = stacked[-1]["fstype"].startswith("fuse")
    if tool and fuse and os.geteuid() != 0:
        argv = [tool, "-u", *(["-z"] if lazy else []), at]
    else:
        argv = sudo(["umount", *(["-l"] if lazy else []), at])
    proc = subprocess.run(argv, capture_output=True, text=True, stdin=subprocess.DEVNULL)
    if proc.returncode != 0:
        text = proc.stderr + proc.stdout
        kind = "busy" if "busy" in text.lower() else "driver_failed"
        raise Failure(kind, f"{at}: {telling_line(text)}")
    deadline = time.monotonic() + MOUNT_WAIT
    while len(mounts_at(at)) >= len(stacked):
        if time.monotonic() > deadline:
            raise Failure("timeout", f"{at} is still mounted {MOUNT_WAIT:.0f}s after umount")
        time.sleep(POLL)
    write_state(state_file, None)
    return {"ok": True, "action": "unmounted", "at": at, "source": source}


def recorded(state_dir: str) -> dict[str, str]:
    """{mount point: its state file} for every mount tpufab recorded in ``state_dir``."""
    return {record["at"]: state_file for state_file, record in mount_records(state_dir)}


def umount(args: argparse.Namespace) -> dict:
    if not args.all:
        return unmount(args.at, args.lazy, args.state_file)
    done = []
    for at, state_file in recorded(args.state_dir).items():
        try:
            if unmount(at, args.lazy, state_file)["action"] == "unmounted":
                done.append(at)
        except Failure as err:
            err.at = at
            err.done = done
            raise
    return {"ok": True, "action": "unmounted" if done else "noop", "at": ", ".join(done),
            "unmounted": done}


def status(args: argparse.Namespace) -> dict:
    at = os.path.abspath(os.path.expanduser(args.at))
    stacked = mounts_at(at)
    top = stacked[-1] if stacked else {}
    return {"ok": True, "at": at, "mounted": bool(stacked), "source": top.get("source"),
            "fstype": top.get("fstype")}


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="mount_worker.py")
    sub = parser.add_subparsers(dest="verb", required=True)
    mo = sub.add_parser("mount")
    mo.add_argument("--at", required=True)
    mo.add_argument("--fstype", required=True, help="e.g. fuse.rclone, fuse.gcsfuse")
    mo.add_argument("--source", required=True, help="the source as /proc/self/mountinfo shows")
    mo.add_argument("--check-argv", help="JSON argv of a bucket probe run before mounting")
    mo.add_argument("--install", action="store_true", help="apt-get install a missing driver")
    mo.add_argument("--log-file", help="passed to the driver as --log-file PATH")
    mo.add_argument("--url", help="the gs:// URL, recorded in --state-file")
    mo.add_argument("--state-file", help="JSON record of what tpufab mounted at --at")
    mo.add_argument("argv", nargs="+", help="the driver command line (after --)")
    um = sub.add_parser("umount")
    where = um.add_mutually_exclusive_group(required=True)
    where.add_argument("--at")
    where.add_argument("--all", action="store_true", help="every mount in --state-dir")
    um.add_argument("--lazy", action="store_true")
    um.add_argument("--state-file")
    um.add_argument("--state-dir", default="~/.cache/tpufab/mounts")
    st = sub.add_parser("status")
    st.add_argument("--at", required=True)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    try:
        result = {"mount": mount, "umount": umount, "status": status}[args.verb](args)
        code = 0
    except Failure as err:
        result, code = {"ok": False, "error": err.kind, "message": err.message}, 3
        if getattr(err, "at", None):
            result.update(at=err.at, unmounted=err.done)
    except subprocess.TimeoutExpired as err:
        result, code = {"ok": False, "error": "timeout", "message": str(err)}, 3
    result["host"] = os.uname().nodename
    answer("answer", result)
    return code


if __name__ == "__main__":
    sys.exit(main())
