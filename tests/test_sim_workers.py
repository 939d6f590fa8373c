"""Simulated pod workers: pure builders, then real sshd workers reached with real ssh.

The state dir lives under pytest's tmp_path (under /tmp), which every worker covers with its own
/tmp: the workers must not depend on host paths their own mounts shadow.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
from datetime import datetime, timezone
from pathlib import Path

import pytest
from harness import needs_root
from helpers import port_open, wait_for

from tpufab.errors import SimError
from tpufab.sim.worker_files import (
    WorkerSpec,
    find_host_tools,
    fold_workers,
    hosts_text,
    parse_ssh_keys,
    sshd_config_text,
    strip_managed_keys,
)
from tpufab.sim.workers import WorkerPool

REPO = Path(__file__).resolve().parents[1]
ACCEL = tuple(f"/dev/accel{i}" for i in range(4))
VFIO = tuple(f"/dev/vfio/{i}" for i in range(4))
# A loopback /16 per node slot and a third octet per test run, away from the emulator's 127.16+.
RUN_OCTET = 20 + os.getpid() % 200


def specs_for(node_id: str, slot: int, count: int, devices: tuple[str, ...]) -> list[WorkerSpec]:
    return [WorkerSpec(node_id, w, f"127.{40 + slot}.{RUN_OCTET}.{w + 1}",
                       f"t1v-n-{int(node_id):08x}-w-{w}", devices) for w in range(count)]



def start_time(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rpartition(b")")[2].split()
    except FileNotFoundError:
        return None
    return None if fields[0] == b"Z" else int(fields[19])


# --- pure builders ------------------------------------------------------------------------

KEY_A = "AAAAC3NzaC1lZDI1NTE5AAAAIGq5Yl3oX0pW1q9kq3B0J8mM0Hq9p6r3c8vXxgYw2L1a"
KEY_R = "AAAAB3NzaC1yc2EAAAADAQABAAABAQC7"


@pytest.mark.parametrize(("text", "expected"), [
    (f"alice:ssh-ed25519 {KEY_A} alice@laptop", {"alice": [f"ssh-ed25519 {KEY_A} alice@laptop"]}),
    (f"bob:ssh-rsa {KEY_R} bob", {"bob": [f"ssh-rsa {KEY_R} bob"]}),  # gcloud's form
    (f"\n\n  carol:ssh-ed25519 {KEY_A}  \n", {"carol": [f"ssh-ed25519 {KEY_A}"]}),
    (f"root:ssh-ed25519 {KEY_A} x\nroot:ssh-ed25519 {KEY_A} x", {"root": [f"ssh-ed25519 {KEY_A} x"]}),
    ("garbage\nalice:\n:ssh-ed25519 AAAA\nalice:ssh-ed25519\n", {}),
    (f"Alice:ssh-ed25519 {KEY_A}\n../x:ssh-ed25519 {KEY_A}", {}),  # not a user name
    ("alice:ssh-ed25519 not*base64", {}),
    (f'alice:command="sh" ssh-ed25519 {KEY_A}', {}),  # options are not metadata keys
    (f'dave:ecdsa-sha2-nistp256 {KEY_A} google-ssh {{"userName":"d@x.com",'
     '"expireOn":"2999-01-01T00:00:00+0000"}',
     {"dave": [f'ecdsa-sha2-nistp256 {KEY_A} google-ssh {{"userName":"d@x.com",'
               '"expireOn":"2999-01-01T00:00:00+0000"}']}),
    (f'erin:ssh-ed25519 {KEY_A} google-ssh {{"userName":"e@x.com",'
     '"expireOn":"2020-01-01T00:00:00+0000"}', {}),  # expired
])
def test_parse_ssh_keys(text, expected):
    now = datetime(2025, 6, 1, tzinfo=timezone.utc)
    assert parse_ssh_keys(text, now=now) == expected


def test_strip_managed_keys_keeps_the_users_own_lines():
    text = ("ssh-ed25519 MINE me\n# Added by tpufab sim from metadata ssh-keys\n"
            "ssh-ed25519 THEIRS meta\nssh-rsa ALSO-MINE me\n")
    assert strip_managed_keys(text) == "ssh-ed25519 MINE me\nssh-rsa ALSO-MINE me\n"


@pytest.mark.parametrize(("indexes", "folded"), [
    ([3], "w3"), ([0, 1, 2, 3], "w[0-3]"), ([5, 0, 1, 2, 7, 8], "w[0-2,5,7-8]"),
])
def test_fold_workers(indexes, folded):
    assert fold_workers(indexes) == folded


def test_sshd_config_and_hosts_text():
    specs = specs_for("1234", 0, 2, ACCEL)
    config = sshd_config_text(specs[1])
    for line in (f"ListenAddress {specs[1].ip}:22", "MaxStartups 200", "MaxSessions 100",
                 "UseDNS no", "LogLevel ERROR", "PrintMotd no", "UsePAM no",
                 "PasswordAuthentication no", "PermitRootLogin prohibit-password",
                 "Subsystem sftp internal-sftp",
                 "HostKey /run/tpufab-worker/ssh_host_ed25519_key"):
        assert line in config.splitlines()
    assert "AcceptEnv" not in config
    hosts = hosts_text(specs[1], specs).splitlines()
    assert hosts[2] == f"{specs[1].ip}\t{specs[1].hostname}"  # its own name comes first
    assert f"{specs[0].ip}\t{specs[0].hostname}" in hosts


def test_missing_host_requirements_are_one_sentence_with_the_fix():
    with pytest.raises(SimError, match="run it as root"):
        find_host_tools(euid=1000)

    def which_without(missing):
        return lambda name, path=None: None if name == missing else f"/usr/bin/{name}"

    with pytest.raises(SimError, match=r"needs sshd.*apt-get install openssh-server\.$"):
        find_host_tools(euid=0, which=which_without("sshd"))
    with pytest.raises(SimError, match=r"needs unshare.*apt-get install util-linux\.$"):
        find_host_tools(euid=0, which=which_without("unshare"))


# --- real workers -------------------------------------------------------------------------


def _sim_ready() -> str | None:
    if os.geteuid() != 0:
        return "the simulated pod needs root (namespaces, mounts, sshd)"
    try:
        find_host_tools()
    except SimError as err:
        return str(err)
    return None


SKIP_REASON = _sim_ready()
workers_ready = pytest.mark.skipif(SKIP_REASON is not None, reason=SKIP_REASON or "")


class Pod:
    def __init__(self, root: Path):
        self.root = root
        self.pool = WorkerPool(root / "state")
        self.known_hosts = root / "known_hosts"
        self.keys = {}
        for user in ("alice", "bob"):
            subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", user,
                            "-f", str(root / user)], check=True)
            self.keys[user] = root / user

    def metadata(self, *users: str) -> str:
        return "\n".join(f"{u}:{(self.keys[u].with_suffix('.pub')).read_text().strip()}"
                         for u in users)

    def pin_host_keys(self, *nodes: list[WorkerSpec]) -> None:
        lines = []
        for specs in nodes:
            keys = self.pool.host_keys(specs[0].node_id)
            lines += [f"{s.ip} {keys[s.index]}" for s in specs]
        self.known_hosts.write_text("\n".join(lines) + "\n")

    def ssh_argv(self, spec: WorkerSpec, command: str, user: str = "alice", *extra: str):
        return ["ssh", "-F", "/dev/null", "-i", str(self.keys[user]), "-o", "IdentitiesOnly=yes",
                "-o", f"UserKnownHostsFile={self.known_hosts}", "-o", "StrictHostKeyChecking=yes",
                "-o", "BatchMode=yes", "-o", "ConnectTimeout=5", "-o", "LogLevel=ERROR",
                *extra, f"{user}@{spec.ip}", command]

    def ssh(self, spec: WorkerSpec, command: str, user: str = "alice", *extra: str):
        return subprocess.run(self.ssh_argv(spec, command, user, *extra), capture_output=True,
                              text=True, timeout=30, stdin=subprocess.DEVNULL)

    def worker_dir(self, spec: WorkerSpec) -> Path:
        return self.pool.state_dir / "nodes" / spec.node_id / f"w{spec.index}"


@pytest.fixture(scope="module")
@needs_root
def pod(tmp_path_factory):
    if SKIP_REASON:
        pytest.skip(SKIP_REASON)
    pod = Pod(tmp_path_factory.mktemp("sim"))
    pod.v4 = specs_for("1111", 1, 4, ACCEL)  # like a v4-32: 4 workers, /dev/accel0..3
    pod.v6e = specs_for("2222", 2, 1, VFIO)  # like a v6e-4: 1 worker, /dev/vfio/0..3
    try:
        pod.pool.start_node("1111", pod.v4, pod.metadata("alice"))
        pod.pool.start_node("2222", pod.v6e, pod.metadata("alice"))
        pod.pool.wait_listening("1111", 20)
        pod.pool.wait_listening("2222", 20)
        pod.pin_host_keys(pod.v4, pod.v6e)
        yield pod
    finally:
        pod.pool.stop_all()


@pytest.mark.sim
@workers_ready
def test_workers_answer_ssh_with_their_own_hostnames(pod):
    names = [pod.ssh(s, "hostname").stdout.strip() for s in pod.v4]
    assert names == [s.hostname for s in pod.v4]
    assert len(set(names)) == 4
    # /etc/hosts resolves the worker's own name to its address (JAX, gloo need that)
    out = pod.ssh(pod.v4[2], "getent hosts $(hostname); /usr/bin/python3 -c 'print(6*7)'")
    assert out.stdout.split() == [pod.v4[2].ip, pod.v4[2].hostname, "42"]


@pytest.mark.sim
@workers_ready
def test_tmp_and_processes_are_private_to_each_worker(pod):
    w0, w1 = pod.v4[0], pod.v4[1]
    assert pod.ssh(w0, "echo zero > /tmp/private.txt && stat -c %a /tmp").stdout.strip() == "1777"
    assert pod.ssh(w1, "cat /tmp/private.txt").returncode != 0
    assert (pod.worker_dir(w0) / "tmp" / "private.txt").read_text() == "zero\n"
    assert not Path("/tmp/private.txt").exists()
    # a detached process on w1 is visible on w1 only; each worker's PID 1 is worker_init
    pod.ssh(w1, "setsid sleep 1717 </dev/null >/dev/null 2>&1 &")
    assert "sleep 1717" in pod.ssh(w1, "ps -eo args").stdout
    ps0 = pod.ssh(w0, "ps -eo pid,args").stdout
    assert "sleep 1717" not in ps0
    assert "worker_init.py" in next(line for line in ps0.splitlines() if line.split()[0] == "1")
    # the orphaned sleep's new parent, the worker's PID 1, reaps it: no zombie stays behind
    pod.pool.exec_in("1111", 1, ["pkill", "-f", "sleep 1717"])
    def sleeper_gone_without_zombies() -> bool:
        lines = pod.pool.exec_in("1111", 1, ["ps", "-eo", "stat=,args="]).stdout.splitlines()
        return not any("sleep 1717" in line or line.startswith("Z") for line in lines)

    wait_for(sleeper_gone_without_zombies, what="the sleeper gone, no zombies")


@pytest.mark.sim
@workers_ready
def test_device_files_follow_the_generation(pod):
    ls = "ls /dev/accel* /dev/vfio/* 2>/dev/null; stat -c '%a %F' /dev/fuse"
    accel = pod.ssh(pod.v4[3], ls).stdout.split("\n")
    assert accel[:4] == list(ACCEL) and accel[4] == "666 character special file"  # as on a VM
    vfio = pod.ssh(pod.v6e[0], ls).stdout.split("\n")
    assert vfio[:4] == list(VFIO)
    assert pod.ssh(pod.v6e[0], "stat -c %a /dev/vfio/3").stdout.strip() == "666"
    # a pty works (private devpts)
    tty = pod.ssh(pod.v4[0], "tty", "alice", "-tt")
    assert tty.stdout.strip().startswith("/dev/pts/")


@pytest.mark.sim
@workers_ready
def test_sync_keys_adds_users_and_removing_a_key_denies_login(pod):
    pod.pool.sync_keys("1111", pod.metadata("alice", "bob"))
    ids = {pod.ssh(s, "id -un; id -u", "bob").stdout for s in pod.v4[:2]}
    assert len(ids) == 1  # the same uid on every worker
    name, uid = ids.pop().split()
    assert name == "bob" and int(uid) >= 2000
    ssh_dir = pod.worker_dir(pod.v4[0]) / "home" / "bob" / ".ssh"
    keys = ssh_dir / "authorized_keys"
    assert (ssh_dir.stat().st_mode & 0o777, keys.stat().st_mode & 0o777) == (0o700, 0o600)
    assert keys.stat().st_uid == int(uid)

    pod.pool.sync_keys("1111", pod.metadata("alice"))
    denied = pod.ssh(pod.v4[0], "true", "bob")
    assert denied.returncode == 255 and "Permission denied" in denied.stderr
    assert pod.ssh(pod.v4[0], "true", "alice").returncode == 0


@pytest.mark.sim
@workers_ready
def test_unreachable_worker_refuses_connections_but_keeps_running(pod):
    w3 = pod.v4[3]
    session = subprocess.Popen(  # an established session survives the fault
        pod.ssh_argv(w3, "while [ ! -e /tmp/go ]; do sleep 0.05; done; echo survived"),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True)
    wait_for(lambda: "sleep 0.05" in pod.pool.exec_in("1111", 3, ["ps", "-eo", "args"]).stdout,
             what="the sleep loop on w3")
    pod.pool.set_reachable("1111", 3, False)
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection((w3.ip, 22), timeout=5).close()
    assert pod.pool.running("1111")[3]
    pod.pool.wait_listening("1111", 5)  # unreachable workers are not waited for
    pod.pool.exec_in("1111", 3, ["touch", "/tmp/go"])
    out, _ = session.communicate(timeout=15)
    assert out.strip() == "survived"

    pod.pool.set_reachable("1111", 3, True)
    pod.pool.wait_listening("1111", 10)
    assert pod.ssh(w3, "hostname").stdout.strip() == w3.hostname


@pytest.mark.sim
@workers_ready
def test_kill_sshd_ends_sessions_mid_command_but_not_the_worker(pod):
    w2 = pod.v4[2]

    def args():
        return pod.pool.exec_in("1111", 2, ["ps", "-eo", "args"]).stdout

    pod.ssh(w2, "setsid sleep 2323 </dev/null >/dev/null 2>&1 &")  # detached: survives
    session = subprocess.Popen(pod.ssh_argv(w2, "sleep 4242"), stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, stdin=subprocess.DEVNULL)
    wait_for(lambda: "sleep 4242" in args(), what="sleep 4242")
    init_pid = pod.pool.pids("1111", 2)[0]
    pod.pool.kill_sshd("1111", 2)
    assert session.wait(timeout=15) == 255
    remaining = args()
    assert "sleep 4242" not in remaining and "sleep 2323" in remaining
    assert pod.pool.pids("1111", 2)[0] == init_pid
    pod.pool.wait_listening("1111", 10)  # its PID 1 starts a new listener
    assert pod.ssh(w2, "hostname").stdout.strip() == w2.hostname
    pod.pool.exec_in("1111", 2, ["pkill", "-f", "sleep 2323"])


@pytest.mark.sim
@workers_ready
def test_exec_in_runs_as_root_inside_the_worker(pod):
    out = pod.pool.exec_in("1111", 1, ["sh", "-c", "hostname; id -u; cat /proc/1/cmdline"])
    hostname, uid, cmdline = out.stdout.split("\n", 2)
    assert (hostname, uid) == (pod.v4[1].hostname, "0")
    assert "worker_init.py" in cmdline
    assert pod.pool.exec_in("1111", 1, ["false"]).returncode == 1
    # workers run in their own session: the caller's terminal signals do not reach them
    assert os.getsid(pod.pool.pids("1111", 1)[0]) != os.getsid(0)


@pytest.mark.sim
@workers_ready
def test_the_share_is_the_same_read_only_folder_on_every_worker(pod):
    (pod.pool.share_dir / "wheel.txt").write_text("cached\n")
    # ... while /mnt, like /tmp, is each worker's own
    assert pod.pool.exec_in("1111", 0, ["mkdir", "-p", "/mnt/only-w0"]).returncode == 0
    for spec in pod.v4:
        out = pod.ssh(spec, "cat /opt/tpufab-sim/share/wheel.txt; touch /opt/tpufab-sim/share/x")
        assert out.stdout == "cached\n"
        assert "Read-only file system" in out.stderr
    assert not (pod.pool.share_dir / "x").exists()
    assert pod.pool.exec_in("1111", 1, ["test", "-d", "/mnt/only-w0"]).returncode == 1
    assert not os.path.exists("/mnt/only-w0")


@pytest.mark.sim
@workers_ready
def test_stop_ends_every_process_and_restart_keeps_disks_and_host_keys(pod):
    specs = specs_for("3333", 3, 2, ACCEL)
    pod.pool.start_node("3333", specs, pod.metadata("alice"))
    pod.pool.wait_listening("3333", 20)
    pod.pin_host_keys(pod.v4, pod.v6e, specs)
    host_keys = pod.pool.host_keys("3333")
    assert sorted(host_keys) == [0, 1] and host_keys[0] != host_keys[1]
    assert pod.ssh(specs[0], "echo kept > ~/disk.txt; echo gone > /tmp/scratch.txt; "
                             "setsid sleep 999 </dev/null >/dev/null 2>&1 &").returncode == 0
    pod.pool.exec_in("3333", 1, ["sh", "-c", "echo rootfile > /root/r.txt"])
    pids = {p: start_time(p) for i in (0, 1) for p in pod.pool.pids("3333", i)}
    assert len(pids) >= 5  # 2 x (PID 1 + sshd) + the sleep

    pod.pool.stop_node("3333")
    assert pod.pool.running("3333") == {0: False, 1: False}
    assert [p for p, t in pids.items() if start_time(p) == t] == []
    assert socket.socket().connect_ex((specs[0].ip, 22)) != 0

    restarted = WorkerPool(pod.pool.state_dir)  # as after a daemon restart
    restarted.start_node("3333", specs, pod.metadata("alice"))
    restarted.wait_listening("3333", 20)
    assert restarted.host_keys("3333") == host_keys
    # StrictHostKeyChecking=yes with the keys pinned before the restart
    out = pod.ssh(specs[0], "cat ~/disk.txt; ls /tmp; pgrep -c sleep || true")
    assert out.stdout.split() == ["kept", "0"]
    assert pod.pool.exec_in("3333", 1, ["cat", "/root/r.txt"]).stdout == "rootfile\n"

    # the first pool object still sees (and stops) workers another one started
    assert pod.pool.running("3333") == {0: True, 1: True}
    pod.pool.delete_node("3333")
    assert restarted.running("3333") == {}
    assert not (pod.pool.state_dir / "nodes" / "3333").exists()


@pytest.mark.sim
@workers_ready
def test_wait_listening_is_bounded_and_names_the_late_workers(pod):
    specs = specs_for("4444", 4, 2, VFIO)
    pod.pool.start_node("4444", specs, "", delay=1.5)
    assert pod.pool.running("4444") == {0: True, 1: True}
    with pytest.raises(SimError, match=r"w\[0-1\] of node 4444 did not listen within 0.2 s"):
        pod.pool.wait_listening("4444", 0.2)
    pod.pool.wait_listening("4444", 15)
    # it returns once each sshd listens (not after a fixed time, which a busy machine skews)
    assert [port_open(s.ip, timeout=2.0) for s in specs] == [True, True]
    pod.pool.stop_node("4444")
    with pytest.raises(SimError, match=r"w\[0-1\] of node 4444 are not running"):
        pod.pool.wait_listening("4444", 5)


OWNER = textwrap.dedent("""
    import json, sys, threading
    from pathlib import Path
    from tpufab.sim.worker_files import WorkerSpec
    from tpufab.sim.workers import WorkerPool
    pool = WorkerPool(Path(sys.argv[1]))
    spec = WorkerSpec("5555", 0, sys.argv[2], "t1v-n-000015b3-w-0", ())
    # started from a short-lived thread, like an HTTP request handler
    thread = threading.Thread(target=pool.start_node, args=("5555", [spec], ""))
    thread.start()
    thread.join()
    pool.wait_listening("5555", 20)
    print(json.dumps(pool.pids("5555", 0)), flush=True)
    sys.stdin.read()
""")


@pytest.mark.sim
@workers_ready
def test_workers_die_with_their_owner_process(tmp_path):
    ip = f"127.45.{RUN_OCTET}.1"
    owner = subprocess.Popen([sys.executable, "-c", OWNER, str(tmp_path / "state"), ip],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=REPO,
                             env={**os.environ, "PYTHONPATH": str(REPO)}, text=True)
    try:
        pids = {p: start_time(p) for p in json.loads(owner.stdout.readline())}
        assert len(pids) == 2 and all(pids.values())  # alive after the starting thread ended
        assert WorkerPool(tmp_path / "state").running("5555") == {0: True}
    finally:
        owner.kill()
        owner.wait()
    wait_for(lambda: all(start_time(p) != t for p, t in pids.items()), 30,
             what="every worker process restarted")
    assert WorkerPool(tmp_path / "state").running("5555") == {0: False}
