"""put / get / forward on simulated workers (a v4-32's four hosts: real sshd per worker, own
/root and mount namespace), through the library functions the verbs call.

What a user would check by hand: the bytes and modes on each worker, files that were
already there skipped, per-worker directories on the way back, one sentence naming the
worker whose disk is full with nothing partial left there, and pages fetched through a
forwarded port.
"""

from __future__ import annotations

import hashlib
import os
import re
import socket
import stat
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from harness import SimPod, needs_root
from helpers import free_port, wait_for

from tpufab.errors import ConfigError, TpufabError
from tpufab.reports import text
from tpufab.ssh import forward as forwarding
from tpufab.ssh import transfer

pytestmark = pytest.mark.sim


@pytest.fixture(scope="module")
@needs_root
def pod(tmp_path_factory):
    root = tmp_path_factory.mktemp("pod")
    pod = SimPod(root, 4, "7301", 63, user="root")  # writes under /root: the root path
    pod.root = root
    try:
        pod.fanout.open().check()
        yield pod
    finally:
        pod.close()


def peers(pod) -> dict[int, str]:
    return {w: t.host for w, t in pod.fanout.targets.items()}


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def remote_sha(pod, w: int, path: str) -> str:
    return pod.sh(w, f"sha256sum {path}").split()[0]


def leftovers(pod, w: int, folder: str) -> str:
    return pod.sh(w, f"find {folder} -name '*.tpufab-*' 2>/dev/null", check=False)


def test_put_a_large_file_and_a_tree_to_every_worker(pod, tmp_path):
    big = tmp_path / "weights.bin"
    with open(big, "wb") as fh:
        for i in range(48):   # 48 MiB of distinct blocks
            fh.write(hashlib.sha256(str(i).encode()).digest() * (1 << 15))
    big.chmod(0o640)
    tree = tmp_path / "data"   # put into /root/ twice: lands as /root/data both times
    (tree / "train" / "shard").mkdir(parents=True)
    (tree / "empty").mkdir()
    (tree / "README").write_text("dataset\n")
    (tree / "train" / "a.txt").write_text("a" * 1000)
    (tree / "train" / "shard" / "run.sh").write_text("#!/bin/sh\necho hi\n")
    (tree / "train" / "shard" / "run.sh").chmod(0o755)

    report = transfer.put(pod.fanout, big, "/root/models/", peers=peers(pod)).check()
    assert len(text(report)) == 1 and text(report)[0].startswith("put: w[0-3]  1 file, 48.0 MiB")
    report = transfer.put(pod.fanout, tree, "/root/", peers=peers(pod)).check()
    assert text(report)[0].startswith("put: w[0-3]  3 files")
    for w in range(4):
        assert remote_sha(pod, w, "/root/models/weights.bin") == sha(big)
        assert pod.sh(w, "stat -c %a /root/models/weights.bin") == "640"
        assert pod.sh(w, "cat /root/data/train/shard/run.sh") == "#!/bin/sh\necho hi"
        assert pod.sh(w, "stat -c %a /root/data/train/shard/run.sh") == "755"
        assert pod.sh(w, "test -d /root/data/empty && echo yes") == "yes"
        assert pod.sh(w, "find /root/data -type f | sort").splitlines() == [
            "/root/data/README", "/root/data/train/a.txt", "/root/data/train/shard/run.sh"]
        assert leftovers(pod, w, "/root") == ""

    # Identical files are skipped; a worker whose copy differs gets it again.
    pod.sh(2, "echo changed > /root/data/README")
    report = transfer.put(pod.fanout, tree, "/root/", peers=peers(pod)).check()
    assert report.by_worker[2].files == 1 and report.by_worker[2].skipped == 2
    assert all(report.by_worker[w].files == 0 and report.by_worker[w].skipped == 3 for w in (0, 1, 3))
    assert pod.sh(2, "cat /root/data/README") == "dataset"


def test_put_without_the_relay_and_to_a_subset(pod, tmp_path):
    src = tmp_path / "config.yaml"
    src.write_text("lr: 0.1\n")
    report = transfer.put(pod.fanout, src, "/root/cfg.yaml", workers="1,3").check()
    assert text(report)[0].startswith("put: w[1,3]  1 file")
    assert [pod.sh(w, "cat /root/cfg.yaml 2>/dev/null || echo none", check=False)
            for w in range(4)] == ["none", "lr: 0.1", "none", "lr: 0.1"]


def test_get_brings_each_workers_file_into_its_own_directory(pod, tmp_path):
    for w in range(4):
        pod.sh(w, f"mkdir -p /root/out/logs && echo 'rank {w}' > /root/out/logs/rank.txt "
                  f"&& head -c {100000 + w} /dev/urandom > /root/out/blob && chmod 600 /root/out/blob")
    report = transfer.get(pod.fanout, "/root/out", tmp_path / "back").check()
    assert text(report)[0].startswith("get: w[0-3]  2 files") or len(text(report)) == 4
    for w in range(4):
        got = tmp_path / "back" / f"w{w}" / "out"
        assert (got / "logs" / "rank.txt").read_text() == f"rank {w}\n"
        assert sha(got / "blob") == remote_sha(pod, w, "/root/out/blob")
        assert (got / "blob").stat().st_mode & 0o777 == 0o600
    # One worker: straight into LOCAL; a second get finds everything identical.
    report = transfer.get(pod.fanout, "/root/out/logs/rank.txt", tmp_path / "r1.txt",
                          workers="1").check()
    assert (tmp_path / "r1.txt").read_text() == "rank 1\n"
    again = transfer.get(pod.fanout, "/root/out/logs/rank.txt", tmp_path / "r1.txt",
                         workers="1").check()
    assert again.by_worker[1].skipped == 1 and again.by_worker[1].files == 0
    assert not list(tmp_path.rglob("*.tpufab-*"))


def test_bad_paths_get_one_sentence(pod, tmp_path):
    with pytest.raises(ConfigError, match="does not exist here"):
        transfer.put(pod.fanout, tmp_path / "nope", "/root/")
    pod.sh(0, "mkdir -p /root/adir/x.txt")
    src = tmp_path / "x.txt"
    src.write_text("x")
    with pytest.raises(TpufabError, match=r"w0: is a directory: /root/adir/x.txt"):
        transfer.put(pod.fanout, src, "/root/adir/", workers="0").check()
    with pytest.raises(TpufabError, match=r"w\[0-3\]: no such file or directory: /root/missing"):
        transfer.get(pod.fanout, "/root/missing", tmp_path / "m").check()


def test_a_full_disk_fails_naming_the_worker_and_leaves_nothing(pod, tmp_path):
    for w in range(4):
        pod.sh(w, "mkdir -p /root/small")
    # Worker 2's /root/small holds 1 MiB and 3 inodes: the free-space check refuses a 2 MiB
    # file up front; a tree of small files passes it and runs out of inodes mid-transfer.
    pod.sh(2, "mount -t tmpfs -o size=1m,nr_inodes=3 tmpfs /root/small")
    try:
        big = tmp_path / "two.bin"
        big.write_bytes(os.urandom(2 << 20))
        with pytest.raises(TpufabError) as caught:
            transfer.put(pod.fanout, big, "/root/small/", peers=peers(pod)).check()
        assert "w2: no space left" in caught.value.message
        assert caught.value.message.startswith("put failed on 1 of 4 workers")
        assert pod.sh(2, "ls -A /root/small") == ""
        for w in (0, 1, 3):
            assert remote_sha(pod, w, "/root/small/two.bin") == sha(big)

        tree = tmp_path / "many"
        tree.mkdir()
        for i in range(4):
            (tree / f"f{i}").write_text(f"file {i}\n" * 100)
        for relay in (peers(pod), None):
            with pytest.raises(TpufabError) as caught:
                transfer.put(pod.fanout, tree, "/root/small/", peers=relay).check()
            assert "w2: no space left on w2" in caught.value.message, caught.value.message
            assert "partial files were removed" in caught.value.message
            assert leftovers(pod, 2, "/root/small") == ""
            assert pod.sh(2, "find /root/small -type f") == ""
            assert pod.sh(0, "cat /root/small/many/f3 | wc -l") == "100"
    finally:
        pod.sh(2, "umount /root/small", check=False)


# A put in its own process, as `tpufab put` runs (`start_driver`): the fan-out of the pod's
# workers, `spec` the driver's argument.
DRIVER_FANOUT = r"""
import json, sys
from tpufab.ssh import transfer
from tpufab.ssh.connections import Target
from tpufab.ssh.fanout import Fanout
from tpufab.ssh.hostkeys import KnownHosts, alias
spec = json.loads(sys.argv[1])
targets = [Target(w, h, "root", spec["key"], 22, alias(spec["node"], w))
           for w, h in enumerate(spec["hosts"])]
"""


def start_driver(pod, driver: str, local: Path):
    """``DRIVER_FANOUT`` then ``driver`` in a process of its own, putting ``local``."""
    import json
    import subprocess
    import sys

    spec = {"key": str(pod.root / "client"), "known_hosts": str(pod.root / "known_hosts"),
            "node": pod.node_id, "local": str(local),
            "hosts": [t.host for _w, t in sorted(pod.fanout.targets.items())]}
    return subprocess.Popen([sys.executable, "-c", DRIVER_FANOUT + driver, json.dumps(spec)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


# Ctrl-C arrives while bytes are moving.
PUT_DRIVER = r"""
from tpufab.term.console import run
with Fanout(targets, known_hosts=KnownHosts(spec["known_hosts"])) as fan:
    sys.exit(run(lambda: transfer.put(fan, spec["local"], "/root/big/", workers="1").check()))
"""


def test_ctrl_c_leaves_no_partial_file_under_the_final_name(pod, tmp_path):
    import signal

    big = tmp_path / "huge.bin"
    with open(big, "wb") as fh:
        fh.truncate(1 << 30)          # 1 GiB (sparse here, real bytes on the wire)
    pod.sh(1, "mkdir -p /root/big && rm -f /root/big/huge.bin")
    proc = start_driver(pod, PUT_DRIVER, big)
    try:
        wait_for(lambda: pod.sh(1, "find /root/big -name '*.tpufab-*.part' -size +1M",
                                check=False), 120, 0.1, what="the upload to be under way")
        proc.send_signal(signal.SIGINT)
        _out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err
    assert "Interrupted: put stopped on w1; no partial file was left" in err
    assert pod.sh(1, "ls -A /root/big") == ""


# A put whose relayed worker cannot reach the seed (its pull is pointed at a closed port):
# it falls back to a direct copy, and the process ends then, the seed's server with it.
UNREACHABLE_SEED_DRIVER = r"""
import socket
closed = socket.socket()
closed.bind(("127.0.0.1", 0))
closed_port = closed.getsockname()[1]           # bound, never listening: refused
real_call = transfer._call
def call(fanout, op, requests, **kwargs):
    if op == "pull":
        requests = {w: {**r, "source": ["127.0.0.1", closed_port]} for w, r in requests.items()}
    return real_call(fanout, op, requests, **kwargs)
transfer._call = call
with Fanout(targets, known_hosts=KnownHosts(spec["known_hosts"])) as fan:
    report = transfer.put(fan, spec["local"], "/root/unreach/", workers="0,1",
                          peers={0: "127.0.0.1", 1: "127.0.0.1"}).check()
    print(json.dumps({str(r.worker): r.files for r in report.rows}))
"""


def test_a_relay_nobody_reached_ends_with_the_put(pod, tmp_path):
    import json
    import subprocess

    data = tmp_path / "relayed.bin"
    data.write_bytes(os.urandom(64 << 10))
    for w in (0, 1):
        pod.sh(w, "rm -rf /root/unreach && mkdir -p /root/unreach")
    proc = start_driver(pod, UNREACHABLE_SEED_DRIVER, data)
    try:
        # The seed's server would wait 60 s idle for a puller that never came; the put, its
        # copy done, must not wait for it.
        out, err = proc.communicate(timeout=40)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"put did not end after its copy was done:\n{out}\n{err}")
    assert proc.returncode == 0, err
    assert json.loads(out.splitlines()[-1]) == {"0": 1, "1": 1}
    for w in (0, 1):
        assert remote_sha(pod, w, "/root/unreach/relayed.bin") == sha(data)
    assert pod.sh(0, "pgrep -af '[f]iles_worker.* serve' || true") == ""


def fetch(url: str, timeout: float = 10.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as answer:
        return answer.read().decode()


def test_forward_reaches_a_server_on_worker_0_and_survives_refusals(pod, tmp_path):
    # Workers share this machine's network namespace: local and remote ports must differ, or
    # the worker's sshd would connect back to our own listener.
    remote_port, local_port, idle_port, idle_remote = (free_port() for _ in range(4))
    pod.sh(0, "mkdir -p /root/www && echo 'only on w0' > /root/www/index.html")
    started = pod.fanout.run(
        f"cd /root/www && exec python3 -m http.server {remote_port} --bind 127.0.0.1 "
        "> /root/www.log 2>&1 & echo started", workers=[0])
    assert started.ok, started.details()
    wait_for(lambda: pod.sh(0, f"python3 -c \"import socket; socket.create_connection(("
                               f"'127.0.0.1', {remote_port}), 1)\" && echo up", check=False)
             == "up", 20, what="the web server on w0")
    events: list[str] = []
    fwd = forwarding.forward(pod.fanout, [f"{local_port}:{remote_port}", f"{idle_port}:{idle_remote}"],
                             worker=0, on_event=events.append)
    try:
        assert [f.url for f in fwd.forwards] == [f"http://127.0.0.1:{local_port}",
                                                  f"http://127.0.0.1:{idle_port}"]
        assert fetch(f"http://127.0.0.1:{local_port}/index.html") == "only on w0\n"
        # Nothing listens on the worker's idle_remote: that connection is refused and reported,
        # and both listeners keep working.
        with pytest.raises((urllib.error.URLError, ConnectionError, OSError)):
            fetch(f"http://127.0.0.1:{idle_port}/", timeout=5)
        wait_for(lambda: any("connection refused" in e for e in events), 30,
                 what="the refusal to be reported")
        assert f"127.0.0.1:{idle_port} -> w0 127.0.0.1:{idle_remote}: connection refused" \
            in events[0]
        assert fetch(f"http://127.0.0.1:{local_port}/index.html") == "only on w0\n"
        # The same local port again: one sentence, nothing started.
        with pytest.raises(TpufabError, match=f"Local port {local_port} is already in use"):
            forwarding.forward(pod.fanout, [str(local_port)], worker=0)
    finally:
        fwd.close()
        pod.fanout.run(["pkill", "-f", f"http.server {remote_port}"], workers=[0])
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", local_port), timeout=1).close()


@pytest.mark.parametrize("spec, expected", [
    ("8080", (8080, 8080, "127.0.0.1")),
    ("8080:6006", (8080, 6006, "127.0.0.1")),
    ("9000:localhost:9001", (9000, 9001, "localhost")),
    ("9000:[::1]:9001", (9000, 9001, "::1")),
])
def test_forward_specs(spec, expected):
    f = forwarding.parse_forward(spec)
    assert (f.local, f.remote, f.remote_host) == expected


@pytest.mark.parametrize("spec", ["", "x", "80:", "localhost:80", "70000", "1:2:3:4"])
def test_bad_forward_specs_are_one_sentence(spec):
    with pytest.raises(ConfigError):
        forwarding.parse_forward(spec)


def test_transfer_summary_folds_agreeing_workers():
    rows = {w: transfer.TransferRow(w, files=3, bytes=int(1.2 * (1 << 30)), seconds=3.9 + w / 100)
            for w in range(64)}
    rows[7] = transfer.TransferRow(7, error="no space left on w7 under /data (0 B free)")
    report = transfer.TransferReport(step="put", rows=list(rows.values()))
    # the one renderer: workers padded to one column, failures named per worker
    assert text(report) == ["put: w[0-6,8-63]  3 files, 1.2 GiB, 4.5 s",
                            "put: w7           failed: no space left on w7 under /data (0 B free)"]
    with pytest.raises(transfer.TransferError, match=r"put failed on 1 of 64 workers: w7: no"):
        report.check()


# -- a worker's answers are data to check (issue 23) -------------------------------------------


def test_a_hostile_listing_cannot_make_get_write_outside_local(pod, tmp_path):
    """Worker 0's python3 rewrites the files worker's listing (as a patched script, or anything
    the login user runs, could): /root/src/evil.txt becomes ../../evil.txt under /root/src/a/b,
    the same file over SFTP, and beside LOCAL here."""
    pod.sh(0, "mkdir -p /root/src/a/b && echo evil > /root/src/evil.txt")
    warm = tmp_path / "warm"
    warm.mkdir()
    transfer.get(pod.fanout, "/root/src", warm, workers="0").check()   # honest; the cache is warm
    assert (warm / "src" / "evil.txt").read_text() == "evil\n"
    pod.sh(0, r"""mkdir -p /root/hostile && cat > /root/hostile/python3 <<'SH'
#!/bin/sh
case "$*" in *files_worker*) ;; *) exec /usr/bin/python3 "$@" ;; esac
/usr/bin/python3 "$@" | sed -e 's|"root": "/root/src"|"root": "/root/src/a/b"|' \
                            -e 's|"rel": "evil.txt"|"rel": "../../evil.txt"|'
SH
chmod 755 /root/hostile/python3 && mount --bind /root/hostile /usr/local/bin""", as_root=True)
    local = tmp_path / "out"
    local.mkdir()
    try:
        with pytest.raises(TpufabError) as caught:
            transfer.get(pod.fanout, "/root/src", local, workers="0").check()
    finally:
        pod.sh(0, "umount /usr/local/bin", as_root=True, check=False)
    message = caught.value.message
    assert message.startswith("get failed on 1 of 1 workers: w0: refused: w0's listing names "
                              "'../../evil.txt' as a file, which would not stay under LOCAL; "
                              "nothing from w0 was written"), message
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "warm"]   # nothing beside LOCAL
    assert list(local.iterdir()) == []                                    # nor in it


HOSTILE = [
    ({"rel": "/etc/cron.d/x"}, "names '/etc/cron.d/x' as a file"),
    ({"rel": "a/../../x"}, "names 'a/../../x' as a file"),
    ({"rel": "./x"}, "names './x' as a file"),
    ({"rel": "a//x"}, "names 'a//x' as a file"),
    ({"rel": "x\0y"}, r"names 'x\x00y' as a file"),
    ({"rel": 7}, "names 7 as a file"),
    ({"mode": 0o104755}, "a size, mode or checksum that is not one"),
    ({"size": -1}, "a size, mode or checksum that is not one"),
    ({"sha256": "../x"}, "a size, mode or checksum that is not one"),
]


@pytest.mark.parametrize("change, sentence", HOSTILE)
def test_every_path_and_number_in_a_listing_is_checked(tmp_path, change, sentence):
    entry = {"rel": "ok.txt", "size": 3, "mode": 0o644, "sha256": "0" * 64, **change}
    listing = {"root": "/root/src", "is_dir": True, "files": [entry], "dirs": [""]}
    with pytest.raises(transfer._Refused, match=re.escape(sentence)):
        transfer._plan_get(0, listing, tmp_path, several=False, umask=0o022)
    bad_name = {**listing, "root": "/root/..", "files": []}
    with pytest.raises(transfer._Refused, match="names '..' as the name of what it sends"):
        transfer._plan_get(0, bad_name, tmp_path, several=False, umask=0o022)


def test_get_drops_setuid_and_applies_the_umask(pod, tmp_path):
    pod.sh(1, "mkdir -p /root/modes && cd /root/modes && echo a > suid && chmod 4755 suid "
              "&& echo b > open && chmod 0777 open && echo c > sticky && chmod 3770 sticky")
    (tmp_path / "m").mkdir()
    old = os.umask(0o027)
    try:
        transfer.get(pod.fanout, "/root/modes", tmp_path / "m", workers="1").check()
        # skipped (identical) files get the cleaned mode too
        again = transfer.get(pod.fanout, "/root/modes", tmp_path / "m", workers="1").check()
    finally:
        os.umask(old)
    assert again.by_worker[1].skipped == 3
    got = {p.name: p.stat().st_mode & 0o7777 for p in (tmp_path / "m" / "modes").iterdir()}
    assert got == {"suid": 0o750, "open": 0o750, "sticky": 0o750}
    transfer.get(pod.fanout, "/root/modes/suid", tmp_path / "one", workers="1").check()
    assert (tmp_path / "one").stat().st_mode & 0o7777 == 0o755 & ~old


def in_time(call, seconds: float = 30.0):
    """``call()`` in a thread; fails the test if it has not returned within ``seconds``."""
    import threading

    outcome: dict = {}

    def target():
        try:
            outcome["value"] = call()
        except BaseException as err:  # noqa: BLE001 - handed to the test
            outcome["error"] = err

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"still running after {seconds} s"
    if "error" in outcome:
        raise outcome["error"]
    return outcome.get("value")


def test_special_files_are_refused_both_ways(pod, tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for source, kind in ((fifo, "a FIFO"), (Path("/dev/zero"), "a character device")):
        with pytest.raises(ConfigError, match=f"{source} is {kind} here, not a file or a "
                                              "directory; put copies regular files"):
            in_time(lambda s=source: transfer.put(pod.fanout, s, "/root/", workers="0"))
    assert pod.sh(0, "ls /root/fifo /root/zero 2>&1", check=False).count("No such file") == 2
    with pytest.raises(TpufabError, match="w0: not a regular file or directory: /dev/zero is a "
                                          "character device"):
        in_time(lambda: transfer.get(pod.fanout, "/dev/zero", tmp_path / "z", workers="0")
                .check())

    # get never replaces (or writes through) a symlink, a FIFO or a device here
    pod.sh(0, "echo data > /root/plain")
    outside = tmp_path / "outside.txt"
    outside.write_text("mine\n")
    link = tmp_path / "link"
    link.symlink_to(outside)
    device = tmp_path / "full"
    os.mknod(device, 0o600 | stat.S_IFCHR, os.makedev(1, 7))
    for target, kind in ((fifo, "a FIFO"), (link, "a symlink"), (device, "a character device")):
        with pytest.raises(TpufabError, match=f"w0: refused: {target} exists here and is {kind}, "
                                              "which get never writes through or replaces"):
            in_time(lambda t=target: transfer.get(pod.fanout, "/root/plain", t, workers="0")
                    .check())
    assert stat.S_ISFIFO(fifo.lstat().st_mode) and stat.S_ISCHR(device.lstat().st_mode)
    assert link.is_symlink() and outside.read_text() == "mine\n"

    # nor through a symlinked directory inside LOCAL
    pod.sh(0, "mkdir -p /root/tree/sub && echo x > /root/tree/sub/f")
    (tmp_path / "dest" / "tree").mkdir(parents=True)
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "dest" / "tree" / "sub").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(TpufabError, match=r"refused: \S+/dest/tree/sub exists here and is a "
                                          "symlink"):
        transfer.get(pod.fanout, "/root/tree", tmp_path / "dest", workers="0").check()
    assert list((tmp_path / "elsewhere").iterdir()) == []
    # LOCAL itself may be a symlink to a directory: the user named it
    (tmp_path / "realdir").mkdir()
    (tmp_path / "dirlink").symlink_to(tmp_path / "realdir")
    report = transfer.get(pod.fanout, "/root/plain", tmp_path / "dirlink", workers="0").check()
    assert (tmp_path / "realdir" / "plain").read_text() == "data\n"
    assert report.by_worker[0].paths == [str(tmp_path / "dirlink" / "plain")]


def test_get_into_a_full_local_disk_is_one_sentence(pod, tmp_path):
    """A 1 MiB tmpfs here; four workers send 3 MiB each, several times over (the traceback
    of paramiko's prefetch thread showed 1 time in 4)."""
    import subprocess
    import threading

    for w in range(4):
        pod.sh(w, "head -c 3145728 /dev/urandom > /root/three.bin")
    small = tmp_path / "small"
    small.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(small)], check=True)
    seen: list = []
    previous = threading.excepthook
    threading.excepthook = seen.append
    try:
        for _ in range(6):
            with pytest.raises(TpufabError) as caught:
                transfer.get(pod.fanout, "/root/three.bin", small).check()
            assert "no space left on this machine; the partial file was removed" in \
                caught.value.message, caught.value.message
            assert not list(small.rglob("*.tpufab-*"))
    finally:
        threading.excepthook = previous
        subprocess.run(["umount", str(small)], check=False)
    assert [f"{type(e.exc_value).__name__} in {e.thread.name}" for e in seen] == []


def test_put_into_the_checkout_of_a_live_run_is_refused(pod, tmp_path):
    """As deploy: a run on w1 reads /root/checkout; put there is refused in one sentence naming
    the run, put elsewhere goes on, and once the run ends the same put works."""
    from tpufab.errors import CodeBusy
    from tpufab.ssh.remote_files import RemoteFile
    from tpufab.steps.code import codelock
    from tpufab.steps.start import plan as plans
    from tpufab.steps.start.starting import start_on_workers

    pod.sh(1, "mkdir -p /root/checkout && rm -f /tmp/stop-put")
    recipe = RemoteFile("reads.sh", b"#!/bin/sh\nn=0\nwhile [ ! -e /tmp/stop-put ] && "
                                    b"[ $n -lt 1200 ]; do n=$((n + 1)); sleep 0.1; done\n", 0o755)
    ips = [t.host for _w, t in sorted(pod.fanout.targets.items())]
    plan = plans.plan_run(recipe, slices=[[1]], ips=ips, cwd="/root/checkout")
    start_on_workers(pod.fanout, plan)
    src = tmp_path / "config.yaml"
    src.write_text("lr: 0.2\n")
    try:
        with pytest.raises(CodeBusy) as caught:
            transfer.put(pod.fanout, src, "/root/checkout/", workers="0,1")
        assert caught.value.message == (
            f"Run {plan.run_id} (reads.sh) is running in /root/checkout on w1, and putting "
            f"/root/checkout/config.yaml there would change its code under it: wait for it to "
            f"end (`tpufab logs --run {plan.run_id} --follow`), stop it (`tpufab kill --run "
            f"{plan.run_id}`), or put the files elsewhere.")
        assert pod.sh(1, "ls -A /root/checkout") == ""
        assert pod.sh(0, "ls /root/checkout/config.yaml 2>&1", check=False).endswith(
            "No such file or directory")                 # nothing anywhere
        transfer.put(pod.fanout, src, "/root/beside/", workers="1").check()
    finally:
        pod.sh(1, "touch /tmp/stop-put")
    wait_for(lambda: not codelock.live_runs(pod.fanout, [1]), 30, what="the run to end")
    transfer.put(pod.fanout, src, "/root/checkout/", workers="1").check()
    assert pod.sh(1, "cat /root/checkout/config.yaml") == "lr: 0.2"


def test_put_notices_a_remote_that_is_this_machines_home(pod, tmp_path):
    """`tpufab put data/ ~/` in a shell expands ~ here: a path under this machine's $HOME that
    the worker does not have is one sentence, not a new /home/<me> there."""
    src = tmp_path / "note.txt"
    src.write_text("n\n")
    home = tmp_path / "home" / "alice"
    home.mkdir(parents=True)
    old = os.environ.get("HOME")
    os.environ["HOME"] = str(home)
    try:
        with pytest.raises(TpufabError, match=rf"w0: no such directory: {home} \(the home "
                                              r"directory on your machine: quote '~/' so that ~ "
                                              r"means this worker's home, /root\)"):
            transfer.put(pod.fanout, src, f"{home}/", workers="0").check()
    finally:
        os.environ["HOME"] = old
    assert pod.sh(0, f"ls -d {home} 2>&1", check=False).endswith("No such file or directory")


# -- shipped worker scripts are checked before every run (issue 23 finding 1) ------------------


def test_a_tampered_cached_script_is_shipped_again_never_run(pod, tmp_path):
    """Any process of the login user can write ~/.cache/tpufab/remote: a changed files worker
    is found by its sha256 as the command starts, shipped again, and the command runs on the
    shipped bytes; the changed ones never run."""
    script = transfer._worker_script()
    cached = f"/root/{script.path}"
    pod.sh(3, "mkdir -p /root/tamper && echo t > /root/tamper/t.txt && rm -f /root/PWNED")
    transfer.get(pod.fanout, "/root/tamper", tmp_path / "first", workers="3").check()
    assert remote_sha(pod, 3, cached) == script.sha256
    pod.sh(3, f"sed -i '1i import os; open(\"/root/PWNED\", \"w\").close()' {cached}")
    assert remote_sha(pod, 3, cached) != script.sha256
    report = transfer.get(pod.fanout, "/root/tamper", tmp_path / "second", workers="3").check()
    assert report.by_worker[3].files == 1 and (tmp_path / "second" / "t.txt").read_text() == "t\n"
    assert pod.sh(3, "ls /root/PWNED 2>&1", check=False).endswith("No such file or directory")
    assert remote_sha(pod, 3, cached) == script.sha256          # shipped again


def test_a_tampered_setup_runner_or_setup_script_never_runs(pod):
    """The shell side of the seam: setup_runner.sh runs as the bytes that were hashed (sh -c),
    and the user's setup script it runs is a sealed in-memory copy of the checked bytes."""
    from tpufab.ssh.remote_files import RemoteFile
    from tpufab.steps.host.setup import run_setup

    setup = b'echo "setup from $0"\n'
    result, _ = run_setup(pod.fanout, setup, workers=[2], force=True)
    assert result[2].stdout.startswith("setup from /dev/fd/"), result[2].stdout
    runner = RemoteFile.bundled("setup_runner.sh")
    user = RemoteFile("setup.sh", setup, 0o700)
    pod.sh(2, f"rm -f /root/PWNED_sh; sed -i '2i touch /root/PWNED_sh' /root/{runner.path} && "
              f"echo 'touch /root/PWNED_sh' >> /root/{user.path}")
    result, outcomes = run_setup(pod.fanout, setup, workers=[2], force=True)
    assert outcomes[2].status == "ran" and result[2].stdout.startswith("setup from /dev/fd/")
    assert pod.sh(2, "ls /root/PWNED_sh 2>&1", check=False).endswith("No such file or directory")
    assert remote_sha(pod, 2, f"/root/{runner.path}") == runner.sha256
    assert remote_sha(pod, 2, f"/root/{user.path}") == user.sha256


def test_a_copy_joins_only_its_own_prefetch_thread():
    """Four workers' files are fetched at once, each starting paramiko's prefetch thread: a
    copy must wait for its own, never another's (which may not have started yet: joining it
    raised "cannot join thread before it is started" and failed a get in CI)."""
    import threading

    release = threading.Event()

    class File:
        def _prefetch_thread(self, *_):
            release.wait(10)

        def prefetch(self, size):
            # another worker's copy starts its thread at the same moment
            threading.Thread(target=File()._prefetch_thread, daemon=True).start()
            threading.Thread(target=self._prefetch_thread, args=(size,), daemon=True).start()

    mine = File()
    try:
        threads = transfer._prefetch(mine, 10)
        assert [t._target.__self__ for t in threads] == [mine]
    finally:
        release.set()


def test_a_forward_closed_under_a_live_connection_prints_no_traceback(monkeypatch):
    """`close()` (Ctrl-C, `ray down`) shuts the connections it still pumps; a pump that was
    between reading the worker's bytes and writing them here met a closed socket and died
    with "OSError: Bad file descriptor" printed as a thread's traceback (seen under load)."""
    import threading

    failures: list = []
    monkeypatch.setattr(threading, "excepthook", failures.append)
    worker_side, far_end = socket.socketpair()

    class Channel:
        closed = False

        def fileno(self):
            return worker_side.fileno()

        def recv(self, n):
            data = worker_side.recv(n)
            forwarder.close()          # closed meanwhile: the pump writes to a closed socket
            return data

        def sendall(self, data):
            worker_side.sendall(data)

        def shutdown_write(self):
            worker_side.shutdown(socket.SHUT_WR)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.closed = True

    class Transport:
        def open_channel(self, *args, **kwargs):
            return Channel()

    port = free_port()
    forwarder = forwarding.Forwarder(lambda: Transport(),
                                     [forwarding.PortForward(port, 80)]).start()
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=10):
            wait_for(lambda: forwarder.connections == 1, 30, 0.01, "the connection to be served")
            far_end.sendall(b"from the worker")
            wait_for(lambda: forwarder.stopped.is_set() and not forwarder._open, 30, 0.01,
                     "the forwarder to close its connection")
            for thread in threading.enumerate():
                if thread.name.endswith("-conn"):
                    thread.join(10)
    finally:
        forwarder.close()
        worker_side.close()
        far_end.close()
    assert not failures, [f.exc_value for f in failures]
