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
import socket
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from conftest import free_port, wait_for
from test_deploy import SimPod

from tpufab import forward as forwarding
from tpufab import transfer
from tpufab.errors import ConfigError, TpufabError

pytestmark = pytest.mark.sim


@pytest.fixture(scope="module")
def pod(tmp_path_factory):
    if os.geteuid() != 0:
        pytest.skip("the simulated workers need root")
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
    assert len(report.lines()) == 1 and report.lines()[0].startswith("w[0-3] 1 file, 48.0 MiB")
    report = transfer.put(pod.fanout, tree, "/root/", peers=peers(pod)).check()
    assert report.lines()[0].startswith("w[0-3] 3 files")
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
    assert report.rows[2].files == 1 and report.rows[2].skipped == 2
    assert all(report.rows[w].files == 0 and report.rows[w].skipped == 3 for w in (0, 1, 3))
    assert pod.sh(2, "cat /root/data/README") == "dataset"


def test_put_without_the_relay_and_to_a_subset(pod, tmp_path):
    src = tmp_path / "config.yaml"
    src.write_text("lr: 0.1\n")
    report = transfer.put(pod.fanout, src, "/root/cfg.yaml", workers="1,3").check()
    assert report.lines()[0].startswith("w[1,3] 1 file")
    assert [pod.sh(w, "cat /root/cfg.yaml 2>/dev/null || echo none", check=False)
            for w in range(4)] == ["none", "lr: 0.1", "none", "lr: 0.1"]


def test_get_brings_each_workers_file_into_its_own_directory(pod, tmp_path):
    for w in range(4):
        pod.sh(w, f"mkdir -p /root/out/logs && echo 'rank {w}' > /root/out/logs/rank.txt "
                  f"&& head -c {100000 + w} /dev/urandom > /root/out/blob && chmod 600 /root/out/blob")
    report = transfer.get(pod.fanout, "/root/out", tmp_path / "back").check()
    assert report.lines()[0].startswith("w[0-3] 2 files") or len(report.lines()) == 4
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
    assert again.rows[1].skipped == 1 and again.rows[1].files == 0
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


# A put in its own process, as `tpufab put` runs: Ctrl-C arrives while bytes are moving.
PUT_DRIVER = r"""
import json, sys
from tpufab import transfer
from tpufab.console import run
from tpufab.fanout import Fanout, Target
from tpufab.hostkeys import KnownHosts, alias
spec = json.loads(sys.argv[1])
targets = [Target(w, h, "root", spec["key"], 22, alias(spec["node"], w))
           for w, h in enumerate(spec["hosts"])]
with Fanout(targets, known_hosts=KnownHosts(spec["known_hosts"])) as fan:
    sys.exit(run(lambda: transfer.put(fan, spec["local"], "/root/big/", workers="1").check()))
"""


def test_ctrl_c_leaves_no_partial_file_under_the_final_name(pod, tmp_path):
    import json
    import signal
    import subprocess
    import sys

    big = tmp_path / "huge.bin"
    with open(big, "wb") as fh:
        fh.truncate(1 << 30)          # 1 GiB (sparse here, real bytes on the wire)
    pod.sh(1, "mkdir -p /root/big && rm -f /root/big/huge.bin")
    spec = {"key": str(pod.root / "client"), "known_hosts": str(pod.root / "known_hosts"),
            "node": pod.node_id, "local": str(big),
            "hosts": [t.host for _w, t in sorted(pod.fanout.targets.items())]}
    proc = subprocess.Popen([sys.executable, "-c", PUT_DRIVER, json.dumps(spec)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
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
        wait_for(lambda: any("connection refused" in e for e in events), 10,
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
    rows = {w: transfer.WorkerTransfer(w, files=3, bytes=int(1.2 * (1 << 30)), seconds=3.9 + w / 100)
            for w in range(64)}
    rows[7] = transfer.WorkerTransfer(7, error="no space left on w7 under /data (0 B free)")
    report = transfer.TransferReport("put", rows)
    assert report.lines() == ["w[0-6,8-63] 3 files, 1.2 GiB, 4.5 s",
                              "w7 failed: no space left on w7 under /data (0 B free)"]
    with pytest.raises(transfer.TransferError, match=r"put failed on 1 of 64 workers: w7: no"):
        report.check()
