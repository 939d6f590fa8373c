"""Mount: pure command builders checked against the drivers' documented flags, then real FUSE
mounts of a bucket in the simulated pod's Cloud Storage (tpufab.sim.storage) on simulated
workers (rclone driver)."""

from __future__ import annotations

import itertools
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from harness import SimPod, needs_root
from helpers import wait_for

from tpufab.errors import ConfigError
from tpufab.quoting import Secret
from tpufab.steps.host import mount as mount_mod
from tpufab.steps.host.mount import MountError, MountSpec, mount, umount

# --- pure builders ----------------------------------------------------------------------------

# gcsfuse's documented options: name -> takes a value. From the gcsfuse CLI reference
# (cloud.google.com/storage/docs/cloud-storage-fuse/cli-options) and gcsfuse's own flag table
# (GoogleCloudPlatform/gcsfuse, cfg/params.yaml). "-o" is the single-dash mount option flag.
GCSFUSE_FLAGS = {
    "--implicit-dirs": False, "--only-dir": True, "--file-mode": True, "--dir-mode": True,
    "--cache-dir": True, "-o": True, "--uid": True, "--gid": True, "--foreground": False,
    "--log-file": True, "--log-format": True, "--log-severity": True, "--key-file": True,
    "--anonymous-access": False, "--custom-endpoint": True, "--billing-project": True,
    "--temp-dir": True, "--metadata-cache-ttl-secs": True, "--stat-cache-max-size-mb": True,
    "--type-cache-max-size-mb": True, "--file-cache-max-size-mb": True,
    "--sequential-read-size-mb": True, "--max-conns-per-host": True, "--rename-dir-limit": True,
    "--limit-ops-per-sec": True, "--limit-bytes-per-sec": True, "--client-protocol": True,
    "--app-name": True, "--config-file": True, "--kernel-list-cache-ttl-secs": True,
}
OCTAL = re.compile(r"^0?[0-7]{3}$")


def check_gcsfuse_argv(argv: list[str], bucket: str, at: str) -> None:
    """``gcsfuse GLOBAL_OPTIONS BUCKET_NAME MOUNT_POINT`` with only documented options."""
    assert argv[0] == "gcsfuse"
    assert argv[-2:] == [bucket, at]
    flags = argv[1:-2]
    i = 0
    while i < len(flags):
        flag = flags[i]
        assert flag in GCSFUSE_FLAGS, f"{flag} is not a documented gcsfuse option"
        if GCSFUSE_FLAGS[flag]:
            assert i + 1 < len(flags) and not flags[i + 1].startswith("-"), f"{flag} needs a value"
            if flag in ("--file-mode", "--dir-mode"):
                assert OCTAL.match(flags[i + 1]), f"{flag} takes octal bits"
            i += 2
        else:
            i += 1


GCSFUSE_TABLE = [
    ("gs://data", {}, ["gcsfuse", "--implicit-dirs", "data", "/mnt/gcs/data"]),
    ("gs://data/ckpt/run1/", {},
     ["gcsfuse", "--implicit-dirs", "--only-dir", "ckpt/run1", "data", "/mnt/gcs/data-run1"]),
    ("data", {"at": "/mnt/d", "implicit_dirs": False, "file_mode": "640", "dir_mode": 0o750,
              "cache_dir": "/tmp/gcs-cache", "allow_other": True, "read_only": True},
     ["gcsfuse", "--file-mode", "640", "--dir-mode", "750", "--cache-dir", "/tmp/gcs-cache",
      "-o", "allow_other", "-o", "ro", "data", "/mnt/d"]),
    ("gs://my.bucket_1/x", {"at": "/data//x/", "options": ["--metadata-cache-ttl-secs", "-1"]},
     ["gcsfuse", "--implicit-dirs", "--only-dir", "x", "--metadata-cache-ttl-secs", "-1",
      "my.bucket_1", "/data/x"]),
    # a custom endpoint: the JSON API base, as gcsfuse's own emulator tests pass it; plain
    # http (an emulator) without credentials
    ("gs://data", {"endpoint": "http://127.0.0.1:9023"},
     ["gcsfuse", "--implicit-dirs", "--custom-endpoint", "http://127.0.0.1:9023/storage/v1/",
      "--anonymous-access", "data", "/mnt/gcs/data"]),
    ("gs://data", {"endpoint": "https://storage.example.com:443/storage/v1/"},
     ["gcsfuse", "--implicit-dirs", "--custom-endpoint",
      "https://storage.example.com:443/storage/v1/", "data", "/mnt/gcs/data"]),
]


@pytest.mark.parametrize(("source", "kw", "expected"), GCSFUSE_TABLE)
def test_gcsfuse_argv_table(source, kw, expected):
    spec = mount_mod.mount_spec(source, **kw)
    argv = mount_mod.gcsfuse_argv(spec)
    assert argv == expected
    if "options" not in kw:  # user options pass through unchecked; ours must be documented
        check_gcsfuse_argv(argv, spec.bucket, spec.at)


def test_gcsfuse_checker_rejects_undocumented_flags():
    with pytest.raises(AssertionError, match="not a documented"):
        check_gcsfuse_argv(["gcsfuse", "--implicit-dir", "b", "/m"], "b", "/m")
    with pytest.raises(AssertionError, match="needs a value"):
        check_gcsfuse_argv(["gcsfuse", "--only-dir", "b", "/m"], "b", "/m")


RCLONE_TABLE = [
    ("gs://data", {}, ["rclone", "mount", "tpufab:data", "/mnt/gcs/data", "--daemon",
                       "--vfs-cache-mode", "writes"]),
    ("gs://data/a/b", {"at": "/mnt/x", "file_mode": "640", "dir_mode": "750",
                       "cache_dir": "/tmp/c", "allow_other": True, "read_only": True,
                       "options": ["--dir-cache-time", "1s"]},
     ["rclone", "mount", "tpufab:data/a/b", "/mnt/x", "--daemon", "--vfs-cache-mode", "writes",
      "--file-perms", "0640", "--dir-perms", "0750", "--cache-dir", "/tmp/c", "--allow-other",
      "--read-only", "--dir-cache-time", "1s"]),
]


@pytest.mark.parametrize(("source", "kw", "expected"), RCLONE_TABLE)
def test_rclone_argv_table(source, kw, expected):
    spec = mount_mod.mount_spec(source, driver="rclone", **kw)
    assert mount_mod.rclone_argv(spec) == expected


@pytest.mark.skipif(shutil.which("rclone") is None, reason="rclone is not installed")
def test_rclone_flags_exist_in_the_installed_rclone():
    spec = mount_mod.mount_spec("gs://bkt/p", driver="rclone", at="/m", file_mode="640",
                                dir_mode="750", cache_dir="/c", allow_other=True,
                                read_only=True)
    known = subprocess.run(["rclone", "mount", "--help"], capture_output=True,
                           text=True).stdout
    for flag in (a for a in mount_mod.rclone_argv(spec) if a.startswith("--")):
        assert re.search(rf"\s{re.escape(flag)}\b", known), flag
    assert "--stat" in subprocess.run(["rclone", "lsjson", "--help"], capture_output=True,
                                      text=True).stdout


@pytest.mark.parametrize(("endpoint", "config"), [
    (None, {}),
    ("http://127.0.0.1:9023", {"endpoint": "http://127.0.0.1:9023/storage/v1/",
                               "bucket_policy_only": "true", "anonymous": "true",
                               "env_auth": "false"}),
    ("https://gcs.internal:8443/", {"endpoint": "https://gcs.internal:8443/storage/v1/",
                                    "bucket_policy_only": "true"}),
])
def test_rclone_endpoint_config(endpoint, config):
    assert mount_mod.rclone_endpoint_config(endpoint) == config


def test_storage_endpoint_must_be_a_url():
    with pytest.raises(ConfigError, match="must be an http\\(s\\) URL"):
        mount_mod.mount_spec("gs://data", endpoint="127.0.0.1:9023")
    assert mount_mod.mount_spec("gs://data", endpoint=" ").endpoint is None


def test_umount_args_are_data():
    assert mount_mod.umount_args("/mnt//d/") == [
        "umount", "--at", "/mnt/d", "--state-file", "~/.cache/tpufab/mounts/mnt_d.json"]
    assert mount_mod.umount_args(None, lazy=True) == [
        "umount", "--all", "--state-dir", "~/.cache/tpufab/mounts", "--lazy"]
    with pytest.raises(ConfigError, match="absolute path"):
        mount_mod.umount_args("mnt/d")


def test_rclone_env_keeps_credentials_out_of_plain_env():
    plain, secret = mount_mod.rclone_env({"endpoint": "http://e/", "service_account_credentials":
                                          "{json}", "anonymous": "true"})
    assert plain == {"RCLONE_CONFIG_TPUFAB_TYPE": "google cloud storage",
                     "RCLONE_CONFIG_TPUFAB_ENV_AUTH": "true",
                     "RCLONE_CONFIG_TPUFAB_BUCKET_POLICY_ONLY": "true",
                     "RCLONE_CONFIG_TPUFAB_ENDPOINT": "http://e/",
                     "RCLONE_CONFIG_TPUFAB_ANONYMOUS": "true"}
    assert secret == {"RCLONE_CONFIG_TPUFAB_SERVICE_ACCOUNT_CREDENTIALS": Secret("{json}")}
    assert str(secret["RCLONE_CONFIG_TPUFAB_SERVICE_ACCOUNT_CREDENTIALS"]) == "***"


@pytest.mark.parametrize(("text", "bucket", "prefix"), [
    ("gs://b-1", "b-1", ""), ("gs://b-1/", "b-1", ""), ("b-1/x//y/", "b-1", "x/y"),
    ("gs://a.b_c/d", "a.b_c", "d"),
])
def test_parse_bucket(text, bucket, prefix):
    assert mount_mod.parse_bucket(text) == (bucket, prefix)


@pytest.mark.parametrize(("source", "kw", "message"), [
    ("s3://b/x", {}, "is not a GCS bucket"),
    ("gs://B", {}, "not a valid bucket name"),
    ("gs://ab", {}, "not a valid bucket name"),
    ("gs://data", {"driver": "s3fs"}, "Unknown mount driver 's3fs'"),
    ("gs://data", {"at": "relative/dir"}, "absolute path"),
    ("gs://data", {"at": "/"}, "whole file system"),
    ("gs://data", {"file_mode": "rw-r--r--"}, "octal permission bits"),
])
def test_mount_spec_errors(source, kw, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        mount_mod.mount_spec(source, **kw)


def test_worker_args_probe_the_bucket_for_rclone_only():
    spec = mount_mod.mount_spec("gs://data/p", driver="rclone", at="/m")
    args = mount_mod.worker_args(spec, log_file="~/l.log")
    assert args[:10] == ["mount", "--at", "/m", "--fstype", "fuse.rclone", "--source",
                         "tpufab:data/p", "--url", "gs://data/p", "--state-file"]
    assert json.loads(args[args.index("--check-argv") + 1]) == [
        "rclone", "lsjson", "--stat", "tpufab:data"]
    assert args[args.index("--") + 1:] == mount_mod.rclone_argv(spec)
    gcs = mount_mod.worker_args(MountSpec("data", "p", "/m"), install=True)
    assert "--check-argv" not in gcs and "--install" in gcs
    assert gcs[gcs.index("--fstype") + 1:gcs.index("--fstype") + 4] == [
        "fuse.gcsfuse", "--source", "data"]


# --- real mounts on the simulated pod ---------------------------------------------------------

AT = itertools.count()
FAST = ["--dir-cache-time", "1s", "--vfs-write-back", "0s"]  # see each other's writes quickly



@pytest.fixture(scope="module")
def gcs():
    # gcp-storage-emulator is a dev dependency; only the real-mount tests need it
    pytest.importorskip("gcp_storage_emulator", reason="pip install gcp-storage-emulator")
    from tpufab.sim.storage import StorageEmulator

    with StorageEmulator() as emulator:
        emulator.create_bucket("data")
        emulator.create_bucket("other")
        emulator.create_bucket("secret")
        emulator.deny("secret")
        emulator.upload("data", "seed/readme.txt", b"seeded\n")
        yield emulator


@pytest.fixture(scope="module")
@needs_root
def pod(tmp_path_factory, gcs):
    if shutil.which("rclone") is None:
        pytest.skip("needs rclone")
    pod = SimPod(tmp_path_factory.mktemp("pod"), 4, "7201", 62)
    try:
        yield pod
    finally:
        for w in pod.workers:  # leave no mount and no rclone behind, whatever failed
            pod.sh(w, "for m in $(awk '$3 ~ /^fuse/ {print $2}' /proc/mounts); do "
                      "umount -l $m; done", check=False, as_root=True)
        pod.close()


@pytest.fixture
def at(pod):
    """A fresh mount point per test; unmounted everywhere afterwards."""
    path = f"/tmp/mnt/t{next(AT)}"  # each simulated worker has its own /tmp (not /mnt)
    yield path
    for w in pod.workers:
        pod.sh(w, f"umount -l {path} 2>/dev/null; true", check=False, as_root=True)


def rclone_mount(pod, gcs, source, at, **kw):
    return mount(pod, source, at=at, driver="rclone", endpoint=gcs.url,
                 options=kw.pop("options", FAST), **kw)


def rclone_processes(pod, w) -> list[str]:
    return [line for line in pod.sh(w, "ps -eo args").splitlines()
            if re.match(r"^(/usr/bin/)?rclone .*\bmount ", line)]


@pytest.mark.sim
def test_write_on_one_worker_is_seen_on_another_and_in_the_bucket(pod, gcs, at):
    report = rclone_mount(pod, gcs, "gs://data", at)
    assert [(r.worker, r.action) for r in report.rows] == [(w, "mounted") for w in range(4)]
    assert all(r.entries == 1 for r in report.rows)  # the seeded "seed/" directory
    for w in pod.workers:
        assert pod.sh(w, f"mountpoint {at}") == f"{at} is a mountpoint"
        assert pod.read(w, f"{at}/seed/readme.txt") == "seeded"
    pod.sh(0, f"echo 'from worker 0' > {at}/hello.txt")
    wait_for(lambda: gcs.objects("data").get("hello.txt") == b"from worker 0\n",
             what="hello.txt in the bucket")
    wait_for(lambda: pod.sh(3, f"cat {at}/hello.txt", check=False) == "from worker 0",
             what="hello.txt through worker 3's mount")
    # the mount lives on after the SSH connections that made it are gone
    pod.fanout.close()
    assert pod.sh(1, f"mountpoint -q {at} && echo yes") == "yes"


@pytest.mark.sim
def test_remount_is_a_verified_noop_and_umount_cleans_up(pod, gcs, at):
    rclone_mount(pod, gcs, "gs://data/seed", at)
    assert pod.read(2, f"{at}/readme.txt") == "seeded"
    again = rclone_mount(pod, gcs, "gs://data/seed", at)
    assert {r.action for r in again.rows} == {"noop"}
    assert all(len(rclone_processes(pod, w)) >= 1 for w in pod.workers)
    gone = umount(pod, at)
    assert {r.action for r in gone.rows} == {"unmounted"}
    for w in pod.workers:
        assert pod.sh(w, f"mountpoint -q {at} || echo no") == "no"
        wait_for(lambda w=w: not any(at in p for p in rclone_processes(pod, w)),
                 what=f"rclone to exit on w{w}")
    assert {r.action for r in umount(pod, at).rows} == {"noop"}


@pytest.mark.sim
def test_prefix_writes_land_under_the_prefix(pod, gcs, at):
    rclone_mount(pod, gcs, "gs://other/runs/1", at)
    pod.sh(2, f"mkdir -p {at}/ckpt && echo step > {at}/ckpt/step.txt")
    wait_for(lambda: gcs.objects("other").get("runs/1/ckpt/step.txt") == b"step\n",
             what="the checkpoint under the prefix")
    # what was mounted is recorded on the worker (gcsfuse's mountinfo shows only the bucket)
    state = json.loads(pod.read(2, "~/.cache/tpufab/mounts/" + at.strip("/").replace("/", "_")
                                + ".json"))
    assert state["url"] == "gs://other/runs/1"
    with pytest.raises(MountError, match=r"already has tpufab:other/runs/1 \(fuse.rclone\)"):
        rclone_mount(pod, gcs, "gs://other/runs/2", at)


@pytest.mark.sim
def test_umount_without_at_unmounts_every_tpufab_mount(pod, gcs, at):
    other = at + "-b"
    rclone_mount(pod, gcs, "gs://data", at)
    rclone_mount(pod, gcs, "gs://other", other)
    pod.sh(1, f"mkdir -p {at}-by-hand && mount -t tmpfs tmpfs {at}-by-hand", as_root=True)  # not tpufab's
    try:
        report = umount(pod, None)
        assert {r.action for r in report.rows} == {"unmounted"}
        assert all(sorted(r.unmounted) == sorted([at, other]) for r in report.rows), [(r.worker, r.unmounted) for r in report.rows]
        for w in pod.workers:
            assert pod.sh(w, f"mountpoint -q {at} || mountpoint -q {other} || echo none") == \
                "none"
        assert pod.sh(1, f"mountpoint -q {at}-by-hand && echo kept") == "kept"
        assert {r.action for r in umount(pod, None).rows} == {"noop"}
    finally:
        pod.sh(1, f"umount {at}-by-hand", check=False, as_root=True)


@pytest.mark.sim
def test_bucket_missing(pod, gcs, at):
    with pytest.raises(MountError, match=r"Bucket gs://nope-nope does not exist \(as seen "
                                         r"from workers w\[0-3\]\)") as err:
        rclone_mount(pod, gcs, "gs://nope-nope", at)
    assert err.value.details.startswith("w[0-3]  failed: bucket_missing: ")   # folded
    assert pod.sh(0, f"mountpoint -q {at} || echo no") == "no"


@pytest.mark.sim
def test_access_denied(pod, gcs, at):
    with pytest.raises(MountError, match=r"Workers w\[0-3\] may not read gs://secret "
                                         r"\(access denied\): grant"):
        rclone_mount(pod, gcs, "gs://secret", at)


@pytest.mark.sim
def test_mount_point_busy_with_another_source(pod, gcs, at):
    rclone_mount(pod, gcs, "gs://data", at)
    with pytest.raises(MountError, match=rf"{at} is busy on workers w\[0-3\] \({at} already "
                                         rf"has tpufab:data \(fuse.rclone\) mounted\)"):
        rclone_mount(pod, gcs, "gs://other", at)


@pytest.mark.sim
def test_mount_point_not_empty(pod, gcs, at):
    pod.sh(1, f"mkdir -p {at} && touch {at}/keep.me")
    with pytest.raises(MountError, match=rf"{at} is not empty on worker w1: mount somewhere") \
            as err:
        rclone_mount(pod, gcs, "gs://data", at)
    assert "mounted" in err.value.details  # the other workers did mount; the table says so
    pod.sh(1, f"rm {at}/keep.me")


@pytest.mark.sim
def test_fuse_unavailable(pod, gcs, at):
    pod.sh(2, "rm /dev/fuse", as_root=True)  # like a container without the device
    try:
        with pytest.raises(MountError, match=r"FUSE is not available on worker w2 "
                                             r"\(/dev/fuse does not exist\)"):
            rclone_mount(pod, gcs, "gs://data", at)
    finally:
        pod.sh(2, "mknod -m 666 /dev/fuse c 10 229", as_root=True)


@pytest.mark.sim
def test_driver_not_installed(pod, at):
    if shutil.which("gcsfuse"):
        pytest.skip("gcsfuse is installed here")
    with pytest.raises(MountError, match=r"gcsfuse is not installed on workers w\[0-3\]: "
                                         r"install it with --install .* or mount with "
                                         r"--driver rclone\."):
        mount(pod, "gs://data", at=at)


@pytest.mark.sim
def test_umount_busy_then_lazy(pod, gcs, at):
    rclone_mount(pod, gcs, "gs://data", at)
    pod.sh(1, f"cd {at} && (sleep 300 </dev/null >/dev/null 2>&1 & echo $! > /tmp/holder)")
    try:
        with pytest.raises(MountError, match=rf"{at} is busy on worker w1 \(a process still "
                                             r"has files open there\)"):
            umount(pod, at)
        assert {r.action for r in umount(pod, at, lazy=True).rows} <= {"unmounted", "noop"}
        assert pod.sh(1, f"mountpoint -q {at} || echo no") == "no"
    finally:
        pod.sh(1, "kill $(cat /tmp/holder)", check=False)


# --- the simulated pod's Cloud Storage ----------------------------------------------------------


def test_storage_keeps_buckets_on_disk_and_denies_on_request(tmp_path):
    pytest.importorskip("gcp_storage_emulator", reason="pip install gcp-storage-emulator")
    from tpufab.errors import SimError
    from tpufab.sim.admin import StorageClient
    from tpufab.sim.storage import StorageEmulator

    with StorageEmulator(tmp_path / "gcs") as gcs:
        assert gcs.create_bucket("kept") is True
        assert gcs.create_bucket("kept") is False  # idempotent
        gcs.upload("kept", "a/b.txt", b"bytes\n")
        gcs.deny("kept")
        with pytest.raises(SimError, match="refused to look up bucket kept \\(HTTP 403\\)"):
            gcs.exists("kept")
    with StorageEmulator(tmp_path / "gcs") as again:  # a restarted pod finds its buckets
        client = StorageClient(again.url)
        assert client.buckets() == ["kept"]
        assert client.objects("kept") == {"a/b.txt": b"bytes\n"}
    with pytest.raises(SimError, match="does not answer"):
        StorageClient(again.url, timeout=2).exists("kept")


def test_sim_daemon_serves_storage_across_restarts(tmp_path):
    pytest.importorskip("gcp_storage_emulator", reason="pip install gcp-storage-emulator")
    from tpufab.sim import daemon
    from tpufab.sim.admin import StorageClient

    state = tmp_path / "sim"
    info = daemon.up(state, port=0, workers=False)
    try:
        assert info.storage_endpoint and info.storage_endpoint != info.endpoint
        assert info.env()["TPUFAB_STORAGE_ENDPOINT"] == info.storage_endpoint
        assert f"export TPUFAB_STORAGE_ENDPOINT={info.storage_endpoint}" in info.exports()
        StorageClient(info.storage_endpoint).create_bucket("survives")
    finally:
        daemon.down(state)
    info2 = daemon.up(state, port=0, workers=False)
    try:
        assert info2.storage_endpoint == info.storage_endpoint  # same port again: exports hold
        assert StorageClient(info2.storage_endpoint).buckets() == ["survives"]
    finally:
        daemon.down(state)


def test_install_steps_are_data():
    import importlib.util

    import tpufab.remote

    remote_dir = Path(tpufab.remote.__file__).parent
    spec = importlib.util.spec_from_file_location("mount_worker", remote_dir / "mount_worker.py")
    worker = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(worker)
    gcsfuse = worker.install_steps("gcsfuse")
    repo_line = gcsfuse[1][1]
    assert gcsfuse[1][0] == ["tee", "/etc/apt/sources.list.d/gcsfuse.list"]
    assert re.fullmatch(r"deb \[signed-by=/usr/share/keyrings/cloud.google.asc\] "
                        r"https://packages.cloud.google.com/apt gcsfuse-\w+ main\n", repo_line)
    assert gcsfuse[-1][0][-1] == "gcsfuse"
    assert worker.install_steps("rclone")[-1][0][-2:] == ["fuse3", "rclone"]
    assert worker.plain_source("tpufab{lqHh4}:data/p") == "tpufab:data/p"
    assert worker.unescape(r"/mnt/a\040b") == "/mnt/a b"
    # a driver's log time differs between workers by a second: the reason shown drops it,
    # so identical reasons fold (CI saw w[0-1] and w[2-3] apart at 00:40:31 / 00:40:32)
    for logged in ("2026/11/29 00:40:31 Failed to lsjson: directory not found",
                   "2026-11-29T00:40:32.123Z Failed to lsjson: directory not found"):
        assert worker.telling_line(f"starting\n{logged}\n") == \
            "Failed to lsjson: directory not found"
