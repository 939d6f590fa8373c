"""Simulated TPU pod workers: a real sshd per worker, each in its own PID/mount/UTS namespace.

A worker is a PID 1 forked by one spawner per process (``setpriv --pdeathsig KILL --
/usr/bin/python3 -I -S worker_init.py --spawner``) into new PID, mount, UTS and time
namespaces, with its sshd under it (see worker_init.py). The network namespace is shared: each
worker's sshd listens on its own loopback address.

State under ``state_dir``::

    uids.json                   user name -> uid, the same on every node and worker
    nodes/<node_id>/node.json   the worker specs of the last start
    nodes/<node_id>/keys.json   users whose keys came from metadata (so removed keys go away)
    nodes/<node_id>/w<i>/       one worker's disk: home/ root/ tmp/ etc/, host key, sshd_config,
                                config.json (for worker_init), init.json (its PID 1 on the host),
                                sshd.log, init.log, and the ``unreachable`` fault flag
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import fcntl
import grp
import json
import os
import pwd
import queue
import re
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path

from tpufab.errors import SimError
from tpufab.sim import tpumetrics

INIT_SCRIPT = Path(__file__).with_name("worker_init.py")
# sshd's AuthorizedKeysCommand where OS Login is on (the guest's google_authorized_keys)
KEYS_COMMAND = Path(__file__).with_name("authorized_keys_command.py")
SYSTEM_PYTHON = "/usr/bin/python3"
STD_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
FIRST_UID = 2000
SSH_PORT = 22
BOOT_TIMEOUT = 30.0  # one worker's namespace setup; normally tens of milliseconds
MANAGED_KEY_MARK = "# Added by tpufab sim from metadata ssh-keys"
KEY_TYPES = frozenset({
    "ssh-ed25519", "ssh-rsa", "ssh-dss", "ecdsa-sha2-nistp256", "ecdsa-sha2-nistp384",
    "ecdsa-sha2-nistp521", "sk-ssh-ed25519@openssh.com", "sk-ecdsa-sha2-nistp256@openssh.com",
})
SUDOERS_GROUP = "google-sudoers"  # as the guest environment names it on real TPU VMs
SUDOERS_RULE = f"%{SUDOERS_GROUP} ALL=(ALL:ALL) NOPASSWD:ALL\n"
TPU_PCI_VENDOR = "0x1ae0"
USER_NAME = re.compile(r"[a-z_][a-z0-9_.-]{0,31}")
NODE_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")


@dataclass(frozen=True)
class WorkerSpec:
    node_id: str  # API node id (a digits string)
    index: int  # worker id, 0-based
    ip: str  # loopback address; sshd listens on ip:22
    hostname: str  # t1v-n-<8 hex>-w-<index>
    device_files: tuple[str, ...]  # ("/dev/accel0", ...) or ("/dev/vfio/0", ...)
    pci_device: str = ""  # PCI device id of its TPU chips ("0x005e" for v4); "" = no chips
    netns: str = ""  # a network namespace to start in (sim/network.py); "" = the host's


# --- host requirements -------------------------------------------------------------------


@dataclass(frozen=True)
class HostTools:
    unshare: str
    nsenter: str
    setpriv: str
    sshd: str
    sudo: str  # workers use the host's; users from metadata ssh-keys get passwordless sudo
    python: str


_TOOL_PACKAGES = (
    ("unshare", "util-linux"),
    ("nsenter", "util-linux"),
    ("setpriv", "util-linux"),
    ("sshd", "openssh-server"),
    ("sudo", "sudo"),
)


def find_host_tools(
    *, euid: int | None = None, which: Callable[..., str | None] = shutil.which,
    python: str = SYSTEM_PYTHON,
) -> HostTools:
    """The programs workers need, or a SimError saying what is missing and how to get it."""
    if (os.geteuid() if euid is None else euid) != 0:
        raise SimError("The simulated pod needs root for namespaces, mounts and sshd: "
                       "run it as root (for example with sudo).")
    found = {}
    for name, package in _TOOL_PACKAGES:
        path = which(name, path=STD_PATH)
        if path is None:
            raise SimError(f"The simulated pod needs {name}, which is not installed: "
                           f"apt-get install {package}.")
        found[name] = os.path.realpath(path)
    if which(python) is None:
        raise SimError(f"The simulated pod runs {python} inside each worker, which is missing: "
                       "apt-get install python3.")
    return HostTools(python=python, **found)


# --- pure builders -------------------------------------------------------------------------


def parse_ssh_keys(text: str, *, now: datetime | None = None) -> dict[str, list[str]]:
    """Metadata ``ssh-keys`` text -> {user: [public key line, ...]}, in order.

    Lines are ``user:ssh-ed25519 AAAA... comment``; blank, malformed and expired
    (``google-ssh {"expireOn": ...}``) lines are skipped, like the guest agent does.
    """
    now = now or datetime.now(timezone.utc)
    keys: dict[str, list[str]] = {}
    for raw in text.splitlines():
        user, sep, key = raw.strip().partition(":")
        parts = key.split()
        if not sep or not USER_NAME.fullmatch(user) or len(parts) < 2:
            continue
        if parts[0] not in KEY_TYPES or not _is_base64(parts[1]) or _expired(key, now):
            continue
        line = " ".join(parts)
        if line not in keys.setdefault(user, []):
            keys[user].append(line)
    return keys


def _is_base64(text: str) -> bool:
    try:
        return bool(base64.b64decode(text, validate=True))
    except (binascii.Error, ValueError):
        return False


def _expired(key: str, now: datetime) -> bool:
    _, mark, tail = key.partition(" google-ssh ")
    if not mark:
        return False
    try:
        expire_on = json.loads(tail)["expireOn"]
        return datetime.strptime(expire_on, "%Y-%m-%dT%H:%M:%S%z") < now
    except (ValueError, KeyError, TypeError):
        return False


def sshd_config_text(spec: WorkerSpec, *, os_login: bool = False) -> str:
    """The worker's sshd_config; HostKey points into the worker's private /run. With OS Login
    on, keys also come from the OS Login profile (as the guest environment configures it)."""
    keys_command = [
        f"AuthorizedKeysCommand {SYSTEM_PYTHON} -I -S /run/tpufab-worker/{KEYS_COMMAND.name} %u",
        "AuthorizedKeysCommandUser root",
    ] if os_login else []
    return "\n".join([
        f"# tpufab simulated worker {spec.hostname}",
        f"ListenAddress {spec.ip}:{SSH_PORT}",
        "HostKey /run/tpufab-worker/ssh_host_ed25519_key",
        "PidFile none",
        "UsePAM no",
        "PermitRootLogin prohibit-password",
        "PubkeyAuthentication yes",
        "PasswordAuthentication no",
        "KbdInteractiveAuthentication no",
        "AuthorizedKeysFile .ssh/authorized_keys",
        *keys_command,
        "StrictModes yes",
        "UseDNS no",
        "MaxStartups 200",
        "MaxSessions 100",
        "LogLevel ERROR",
        "PrintMotd no",
        "PrintLastLog no",
        "X11Forwarding no",
        "Subsystem sftp internal-sftp",
        "",
    ])


def hosts_text(spec: WorkerSpec, node_specs: Iterable[WorkerSpec]) -> str:
    """/etc/hosts: the worker's own name first, then its node's other workers, then the
    metadata server."""
    # localhost is the worker's own address: the network namespace is shared, and what a TPU VM
    # serves on localhost (libtpu's metrics on :8431, sim/tpumetrics.py) is per worker.
    lines = [f"{spec.ip}\tlocalhost", "::1\tlocalhost ip6-localhost ip6-loopback",
             f"{spec.ip}\t{spec.hostname}"]
    lines += [f"{s.ip}\t{s.hostname}" for s in node_specs if s.index != spec.index]
    # The worker's metadata server (169.254.169.254 on GCE) answers on its own address, port 80.
    lines.append(f"{spec.ip}\tmetadata.google.internal metadata")
    return "\n".join(lines) + "\n"


def fold_workers(indexes: Iterable[int]) -> str:
    """[0, 1, 2, 5] -> 'w[0-2,5]'; [3] -> 'w3'."""
    nums = sorted(set(indexes))
    if len(nums) == 1:
        return f"w{nums[0]}"
    runs: list[str] = []
    start = prev = None
    for n in [*nums, None]:
        if start is not None and n == prev + 1:
            prev = n
            continue
        if start is not None:
            runs.append(str(start) if start == prev else f"{start}-{prev}")
        start = prev = n
    return f"w[{','.join(runs)}]"


def strip_managed_keys(text: str) -> str:
    """authorized_keys without the lines we added (each follows MANAGED_KEY_MARK)."""
    kept, skip = [], False
    for line in text.splitlines():
        if skip:
            skip = False
        elif line == MANAGED_KEY_MARK:
            skip = True
        else:
            kept.append(line)
    return "".join(f"{line}\n" for line in kept)


# --- host-side process helpers -------------------------------------------------------------


def _proc_stat(pid: int) -> tuple[str, int, int] | None:
    """(state, ppid, start time in ticks) of a host pid, or None if it does not exist."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rpartition(b")")[2].split()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return fields[0].decode(), int(fields[1]), int(fields[19])


def _alive(pid: int, start_time: int) -> bool:
    stat = _proc_stat(pid)
    return stat is not None and stat[0] != "Z" and stat[2] == start_time


def _signal(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)


def _namespace_processes(init_pid: int) -> dict[int, tuple[int, int]]:
    """Host pid -> (ppid, start time) for every process in init_pid's PID namespace."""
    try:
        ns = os.readlink(f"/proc/{init_pid}/ns/pid")
    except FileNotFoundError:
        return {}
    found = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            if os.readlink(f"/proc/{name}/ns/pid") != ns:
                continue
        except OSError:
            continue
        stat = _proc_stat(int(name))
        if stat is not None and stat[0] != "Z":
            found[int(name)] = (stat[1], stat[2])
    return found


def _tcp_table(spec: WorkerSpec) -> str:
    """The /proc TCP table of the network namespace the worker listens in."""
    if spec.netns:  # /proc/<pid>/ns/net -> /proc/<pid>/net/tcp
        return spec.netns.rpartition("/ns/")[0] + "/net/tcp"
    return "/proc/net/tcp"


def _listening_addresses(port: int = SSH_PORT, *, table: str = "/proc/net/tcp",
                         seen: set[str] | None = None) -> set[str]:
    """IPv4 addresses with a socket in LISTEN on ``port`` (read from /proc, no connection made);
    ``seen``: the host table's answer, already read."""
    if seen is not None and table == "/proc/net/tcp":
        return seen
    found = set()
    with open(table) as f:
        next(f)
        for line in f:
            fields = line.split()
            address, _, hex_port = fields[1].partition(":")
            if fields[3] == "0A" and int(hex_port, 16) == port:
                found.add(socket.inet_ntoa(int(address, 16).to_bytes(4, sys.byteorder)))
    return found


def _host_uptime() -> float:
    with open("/proc/uptime") as f:
        return float(f.read().split()[0])


def _wait_for(condition: Callable[[], bool], timeout: float, interval: float = 0.02) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval)
    return True


def _tail(path: Path, lines: int = 3) -> str:
    try:
        text = path.read_text(errors="replace").strip().splitlines()
    except FileNotFoundError:
        return ""
    return " | ".join(text[-lines:])


def _write_json(path: Path, data: object) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    os.replace(tmp, path)


def _read_json(path: Path, default: object) -> object:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return default


TRASH = "trash"  # under state_dir: deleted nodes' files, being removed in the background
_emptying: set[str] = set()
_emptying_guard = threading.Lock()


def _empty_in_background(trash: Path) -> None:
    """Remove everything in ``trash`` on a daemon thread (one per folder at a time)."""
    key = str(trash)
    with _emptying_guard:
        if key in _emptying:
            return
        _emptying.add(key)

    def empty() -> None:
        tried: list[Path] = []
        while True:
            with _emptying_guard:  # a folder moved in after this look starts a new thread
                try:
                    left = sorted(trash.iterdir())
                except OSError:
                    left = []
                if not left or left == tried:  # done, or what is left cannot be removed
                    _emptying.discard(key)
                    return
            tried = left
            for path in left:
                shutil.rmtree(path, ignore_errors=True)

    threading.Thread(target=empty, name="tpufab-sim-trash", daemon=True).start()


class _Launcher:
    """Forks worker processes from one thread that lives as long as the process.

    PR_SET_PDEATHSIG fires when the *thread* that forked a child exits, so workers must not be
    forked by a short-lived caller thread (an HTTP request handler, say).
    """

    _instance: _Launcher | None = None
    _guard = threading.Lock()

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.spawner: _Spawner | None = None  # used on the launcher thread only
        threading.Thread(target=self._run, name="tpufab-worker-launcher", daemon=True).start()

    @classmethod
    def call(cls, fn: Callable, *args):
        with cls._guard:
            if cls._instance is None or cls._instance.pid != os.getpid():  # new after fork()
                cls._instance = cls()
            launcher = cls._instance
        future: Future = Future()
        launcher.jobs.put((fn, args, future))
        return future.result()

    @classmethod
    def current_spawner(cls, tools: HostTools) -> _Spawner:
        """The process's spawner (started when first needed); on the launcher thread only."""
        launcher = cls._instance
        assert launcher is not None and threading.current_thread().name == \
            "tpufab-worker-launcher"
        if launcher.spawner is None or not launcher.spawner.alive():
            launcher.spawner = _Spawner(tools)
        return launcher.spawner

    def _run(self) -> None:
        while True:
            fn, args, future = self.jobs.get()
            try:
                future.set_result(fn(*args))
            except BaseException as err:  # noqa: BLE001 - handed to the caller
                future.set_exception(err)


class _Spawner:
    """worker_init.py --spawner: forks each worker's PID 1 from one warm interpreter.

    Requests go to its stdin as JSON lines; answers come back on its stdout (see
    worker_init.py). It dies with this process (pdeathsig), and every worker with it.
    """

    def __init__(self, tools: HostTools):
        self.proc = subprocess.Popen(
            [tools.setpriv, "--pdeathsig", "KILL", "--",
             tools.python, "-I", "-S", str(INIT_SCRIPT), "--spawner"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, start_new_session=True,
            env={"PATH": STD_PATH, "LANG": "C.UTF-8"})
        self.buffer = b""
        self.next_id = 0

    def alive(self) -> bool:
        return self.proc.poll() is None

    def request(self, worker_dir: Path, netns: str = "") -> int:
        """Fork a worker from ``worker_dir`` (in the network namespace at ``netns``, if any)."""
        self.next_id += 1
        line = json.dumps({"id": self.next_id, "dir": str(worker_dir), "netns": netns}) + "\n"
        self.proc.stdin.write(line.encode())  # type: ignore[union-attr]
        self.proc.stdin.flush()  # type: ignore[union-attr]
        return self.next_id

    def answers(self, timeout: float) -> list[dict] | None:
        """Answers that arrived within ``timeout`` s ([] if none); None once it has exited."""
        fd = self.proc.stdout.fileno()  # type: ignore[union-attr]
        with selectors.DefaultSelector() as selector:
            selector.register(fd, selectors.EVENT_READ)
            if not selector.select(timeout):
                return []
        chunk = os.read(fd, 65536)
        if not chunk:
            return None
        self.buffer += chunk
        *lines, self.buffer = self.buffer.split(b"\n")
        out = []
        for line in lines:
            with contextlib.suppress(ValueError):
                out.append(json.loads(line))
        return out


# --- the pool ------------------------------------------------------------------------------


class WorkerPool:
    """The simulated pod's workers, kept under ``state_dir`` (see the module docstring)."""

    stop_grace = 2.0  # seconds a worker's processes get between SIGTERM and the end
    boot_window = 8  # workers setting up their namespaces at once (a bounded start rate)

    def __init__(self, state_dir: Path, share_dir: Path | None = None):
        self.state_dir = Path(state_dir)
        # Read-only on every worker at /opt/tpufab-sim/share (scripts/sim-wheels.sh fills it).
        self.share_dir = Path(share_dir) if share_dir is not None else self.state_dir / "share"
        self.share_dir.mkdir(parents=True, exist_ok=True)
        self._guard = threading.Lock()  # the dict below
        self._node_locks: dict[str, threading.RLock] = {}
        self._uid_lock = threading.Lock()
        if (self.state_dir / TRASH).is_dir():  # left by a daemon that stopped mid-removal
            _empty_in_background(self.state_dir / TRASH)

    def _node_lock(self, node_id: str) -> threading.RLock:
        """Serializes changes to one node; other nodes (and read-only calls) go on meanwhile."""
        with self._guard:
            return self._node_locks.setdefault(node_id, threading.RLock())

    def capacity_problem(self, what: str, workers: int) -> str | None:
        """Why ``workers`` more workers would not fit on this machine (None: they would)."""
        from tpufab.sim import capacity

        return capacity.check(what, workers)

    # paths and records

    def _node_dir(self, node_id: str) -> Path:
        if not NODE_ID.fullmatch(node_id):
            raise SimError(f"Node id {node_id!r} is not valid: use letters, digits, '-', '_', '.'.")
        return self.state_dir / "nodes" / node_id

    def _worker_dir(self, node_id: str, index: int) -> Path:
        return self._node_dir(node_id) / f"w{index}"

    def keep_host_key(self, node_id: str, index: int, store: Path, comment: str) -> None:
        """Worker ``index`` of ``node_id`` (before it starts) gets the host key kept in
        ``store``, made there first if missing: a VM whose identity outlives the node records
        it is started for (an internal node's bastion, which a real project keeps while its
        TPU nodes are preempted and recreated)."""
        key = store / "ssh_host_ed25519_key"
        if not key.exists():
            store.mkdir(mode=0o700, parents=True, exist_ok=True)
            _make_host_key(key, comment)
        wdir = self._worker_dir(node_id, index)
        wdir.mkdir(parents=True, exist_ok=True)
        for name in (key.name, key.name + ".pub"):
            if not (wdir / name).exists():
                shutil.copy2(store / name, wdir / name)

    def _specs(self, node_id: str) -> list[WorkerSpec]:
        data = _read_json(self._node_dir(node_id) / "node.json", {"workers": []})
        return [WorkerSpec(**{**w, "device_files": tuple(w["device_files"])})
                for w in data["workers"]]

    def _spec(self, node_id: str, index: int) -> WorkerSpec:
        for spec in self._specs(node_id):
            if spec.index == index:
                return spec
        raise SimError(f"Node {node_id} has no worker {index}.")

    def _init_pid(self, node_id: str, index: int) -> int | None:
        """Host pid of the worker's PID 1 if it is running (also after a daemon restart)."""
        record = _read_json(self._worker_dir(node_id, index) / "init.json", None)
        if record and _alive(record["pid"], record["start_time"]):
            return record["pid"]
        return None

    def _require_init(self, node_id: str, index: int) -> int:
        pid = self._init_pid(node_id, index)
        if pid is None:
            raise SimError(f"Worker {index} of node {node_id} is not running; start the node first.")
        return pid

    # lifecycle

    def start_node(self, node_id: str, specs: list[WorkerSpec], ssh_keys: str, *,
                   delay: float = 0.0) -> None:
        """Start every worker not already running; their sshd comes up ``delay`` s from now."""
        tools = find_host_tools()
        node_dir = self._node_dir(node_id)
        with self._node_lock(node_id):
            node_dir.mkdir(parents=True, exist_ok=True)
            _write_json(node_dir / "node.json", {"workers": [asdict(s) for s in specs]})
            to_start = [s for s in specs if self._init_pid(node_id, s.index) is None]
            busy = _listening_addresses()
            if "0.0.0.0" in busy and any(not s.netns for s in to_start):
                raise SimError("Something listens on 0.0.0.0:22, so workers cannot listen on their "
                               "own addresses: make that sshd listen on a specific address.")
            for spec in to_start:
                if spec.ip in _listening_addresses(table=_tcp_table(spec), seen=busy):
                    raise SimError(f"Worker {spec.index} of node {node_id} cannot listen on "
                                   f"{spec.ip}:22 because something else already does; stop it "
                                   "or use another address.")
            sshd_at = time.monotonic() + max(0.0, delay)
            for spec in to_start:
                self._prepare_worker(node_id, spec, specs, tools, sshd_at)
            self.sync_keys(node_id, ssh_keys)
            if not to_start:
                return
            failures = _Launcher.call(self._boot_all, node_id, to_start, tools, sshd_at)
        tpumetrics.serve(self)  # each worker's localhost:8431, as libtpu's (sim/tpumetrics.py)
        if failures:  # the failed ones are gone already; the others keep running
            details = "\n".join(f"w{i}: {why}" for i, why in sorted(failures.items()))
            raise SimError(f"Worker(s) {fold_workers(failures)} of node {node_id} failed to start; "
                           f"see init.log under {node_dir}.", details=details)

    def _prepare_worker(self, node_id: str, spec: WorkerSpec, node_specs: list[WorkerSpec],
                        tools: HostTools, sshd_at: float) -> None:
        wdir = self._worker_dir(node_id, spec.index)
        (wdir / "etc").mkdir(parents=True, exist_ok=True)
        for sub, mode in (("home", 0o755), ("root", 0o700), ("mnt", 0o755), ("log", 0o755)):
            (wdir / sub).mkdir(exist_ok=True)
            os.chmod(wdir / sub, mode)
        tmp = wdir / "tmp"  # cleared at every start, like a reboot
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
        os.chmod(tmp, 0o1777)
        for name in ("passwd", "group", "shadow"):
            if not (wdir / "etc" / name).exists():
                shutil.copy2(f"/etc/{name}", wdir / "etc" / name)
        (wdir / "log" / "apt").mkdir(exist_ok=True)  # apt (setup scripts) logs there
        sudoers = wdir / "etc" / "sudoers.d"
        sudoers.mkdir(mode=0o755, exist_ok=True)
        rule = sudoers / "google_sudoers"
        rule.write_text(SUDOERS_RULE)
        os.chmod(rule, 0o440)  # sudo ignores rule files that others may write
        (wdir / "etc" / "hostname").write_text(spec.hostname + "\n")
        (wdir / "etc" / "hosts").write_text(hosts_text(spec, node_specs))
        if not (wdir / "ssh_host_ed25519_key").exists():
            _make_host_key(wdir / "ssh_host_ed25519_key", f"root@{spec.hostname}")
        os_login = self._os_login(node_id)
        if os_login["enabled"]:
            _ensure_os_login_users(wdir, os_login["accounts"])
        shutil.copyfile(KEYS_COMMAND, wdir / KEYS_COMMAND.name)
        (wdir / "sshd_config").write_text(sshd_config_text(spec, os_login=os_login["enabled"]))
        _write_json(wdir / "config.json", {
            "hostname": spec.hostname,
            "devices": list(spec.device_files),
            "sshd": tools.sshd,
            "sshd_at": sshd_at,
            "stop_grace": self.stop_grace,
            "tty_gid": grp.getgrnam("tty").gr_gid,
            "share": str(self.share_dir),
            "pci": [{"vendor": TPU_PCI_VENDOR, "device": spec.pci_device}
                    for _ in spec.device_files] if spec.pci_device else [],
        })
        (wdir / "init.json").unlink(missing_ok=True)

    def _boot_all(self, node_id: str, specs: list[WorkerSpec], tools: HostTools,
                  sshd_at: float) -> dict[int, str]:
        """Runs on the launcher thread: have the spawner fork the workers, at most boot_window
        setting up at once; returns {worker: why} for those that failed."""
        spawner = _Launcher.current_spawner(tools)
        pending = list(specs)
        booting: dict[int, tuple[WorkerSpec, float]] = {}  # request id -> (spec, deadline)
        forked: dict[int, int] = {}  # request id -> its PID 1's host pid, once forked
        failures: dict[int, str] = {}
        while pending or booting:
            while pending and len(booting) < self.boot_window:
                spec = pending.pop(0)
                try:
                    request = spawner.request(self._worker_dir(node_id, spec.index), spec.netns)
                except OSError as err:  # the spawner is gone (it died, or so did we)
                    failures[spec.index] = f"cannot start: {err}"
                    continue
                booting[request] = (spec, time.monotonic() + BOOT_TIMEOUT)
            answers = spawner.answers(0.5)
            if answers is None:
                for spec, _ in booting.values():
                    failures[spec.index] = "the worker spawner exited; see the daemon's log"
                booting.clear()
                for spec in pending:
                    failures[spec.index] = "the worker spawner exited; see the daemon's log"
                pending.clear()
                break
            for answer in answers:
                request = answer.get("id")
                if request not in booting:
                    continue  # a late answer to a request given up on before
                if "forked" in answer:
                    forked[request] = answer["forked"]
                if "pid" not in answer and "error" not in answer:
                    continue
                spec, _ = booting.pop(request)
                error = self._booted(node_id, spec, answer, sshd_at)
                if error:
                    failures[spec.index] = error
            now = time.monotonic()
            for request, (spec, deadline) in list(booting.items()):
                if now > deadline:
                    del booting[request]
                    if request in forked:  # its namespace goes with it
                        _signal(forked[request], signal.SIGKILL)
                    failures[spec.index] = f"no ready report within {BOOT_TIMEOUT:g} s"
        return failures

    def _booted(self, node_id: str, spec: WorkerSpec, answer: dict, sshd_at: float
                ) -> str | None:
        wdir = self._worker_dir(node_id, spec.index)
        stat = _proc_stat(answer["pid"]) if "pid" in answer else None
        if stat is None:
            if "forked" in answer:
                _signal(answer["forked"], signal.SIGKILL)
            error = answer.get("error", "PID 1 vanished right after setup")
            tail = _tail(wdir / "init.log")
            return f"{error} ({tail})" if tail and tail not in error else error
        _write_json(wdir / "init.json", {"pid": answer["pid"], "start_time": stat[2],
                                         "owner_pid": os.getpid(), "sshd_at": sshd_at})
        return None

    def wait_listening(self, node_id: str, timeout: float = 30.0) -> None:
        """Wait (bounded) until every reachable worker's sshd listens on ip:22."""
        deadline = time.monotonic() + timeout
        waiting = self._specs(node_id)
        while True:
            # Only the workers still waiting are looked at again: a round costs what is left.
            tables = {t: _listening_addresses(table=t) for t in {_tcp_table(s) for s in waiting}}
            waiting = [s for s in waiting if s.ip not in tables[_tcp_table(s)] and not
                       (self._worker_dir(node_id, s.index) / "unreachable").exists()]
            down = [s.index for s in waiting if self._init_pid(node_id, s.index) is None]
            if down:
                raise SimError(f"Worker(s) {fold_workers(down)} of node {node_id} are not running, "
                               "so their sshd will never listen; start the node first.")
            if not waiting:
                return
            if time.monotonic() >= deadline:
                names = fold_workers(s.index for s in waiting)
                last = _tail(self._worker_dir(node_id, waiting[0].index) / "sshd.log", 1)
                raise SimError(f"sshd on worker(s) {names} of node {node_id} did not listen within "
                               f"{timeout:g} s; see sshd.log under {self._node_dir(node_id)}"
                               + (f" (w{waiting[0].index}: {last})." if last else "."))
            time.sleep(0.02)

    def stop_node(self, node_id: str) -> None:
        """End every process of the node's workers (whole PID namespaces); disks stay."""
        node_dir = self._node_dir(node_id)
        with self._node_lock(node_id):
            records = {}
            for spec in self._specs(node_id):
                pid = self._init_pid(node_id, spec.index)
                if pid is not None:
                    records[spec.index] = _read_json(node_dir / f"w{spec.index}" / "init.json", {})
                    _signal(pid, signal.SIGTERM)

            def all_gone() -> bool:
                return not any(_alive(r["pid"], r["start_time"]) for r in records.values())

            if not _wait_for(all_gone, self.stop_grace + 3.0):
                for record in records.values():
                    if _alive(record["pid"], record["start_time"]):
                        _signal(record["pid"], signal.SIGKILL)  # takes the namespace with it
                if not _wait_for(all_gone, 10.0):
                    raise SimError(f"Workers of node {node_id} did not stop even after SIGKILL.")
            for index in records:
                (node_dir / f"w{index}" / "init.json").unlink(missing_ok=True)

    def remove_worker(self, node_id: str, index: int) -> None:
        """End worker ``index`` of ``node_id`` (its whole PID namespace) and remove its files:
        a VM that Compute Engine recreates comes back from a new boot disk (a new host key, an
        empty home and /tmp). ``start_node`` brings it up again."""
        with self._node_lock(node_id):
            wdir = self._worker_dir(node_id, index)
            record = _read_json(wdir / "init.json", None)
            if self._init_pid(node_id, index) is not None and record:
                _signal(record["pid"], signal.SIGTERM)

                def gone() -> bool:
                    return not _alive(record["pid"], record["start_time"])

                if not _wait_for(gone, self.stop_grace + 3.0):
                    _signal(record["pid"], signal.SIGKILL)  # takes the namespace with it
                    if not _wait_for(gone, 10.0):
                        raise SimError(f"Worker {index} of node {node_id} did not stop even "
                                       "after SIGKILL.")
            trash = self.state_dir / TRASH / f"{node_id}-w{index}-{time.time_ns()}"
            try:
                trash.parent.mkdir(parents=True, exist_ok=True)
                os.rename(wdir, trash)
            except FileNotFoundError:
                return
            except OSError:
                shutil.rmtree(wdir, ignore_errors=True)
                return
            _empty_in_background(trash.parent)

    def delete_node(self, node_id: str) -> None:
        """Stop the node's workers, then remove all their files: moved aside at once, removed
        in the background (a used 1,024-worker node holds ~10^5 files: minutes on a busy
        disk, which a delete need not wait for)."""
        with self._node_lock(node_id):
            self.stop_node(node_id)
            node_dir = self._node_dir(node_id)
            trash = self.state_dir / TRASH / f"{node_id}-{time.time_ns()}"
            try:
                trash.parent.mkdir(parents=True, exist_ok=True)
                os.rename(node_dir, trash)
            except FileNotFoundError:
                return
            except OSError:  # e.g. another filesystem: remove it where it is
                shutil.rmtree(node_dir, ignore_errors=True)
                return
            _empty_in_background(trash.parent)

    def stop_all(self) -> None:
        """Stop every node under state_dir, including workers left by an earlier owner."""
        errors = []
        nodes = self.state_dir / "nodes"
        for node_dir in sorted(nodes.iterdir()) if nodes.is_dir() else []:
            try:
                self.stop_node(node_dir.name)
            except SimError as err:
                errors.append(str(err))
        if errors:
            raise SimError(errors[0], details="\n".join(errors[1:]) or None)

    def running(self, node_id: str) -> dict[int, bool]:
        return {s.index: self._init_pid(node_id, s.index) is not None for s in self._specs(node_id)}

    def pids(self, node_id: str, index: int) -> list[int]:
        """Host pids of every process in the worker (its PID 1 first); [] if it is not running."""
        init = self._init_pid(node_id, index)
        if init is None:
            return []
        return [init, *sorted(p for p in _namespace_processes(init) if p != init)]

    def host_keys(self, node_id: str) -> dict[int, str]:
        """Worker -> ``ssh-ed25519 AAAA...``; made at a worker's first start, kept until delete."""
        keys = {}
        for spec in self._specs(node_id):
            pub = self._worker_dir(node_id, spec.index) / "ssh_host_ed25519_key.pub"
            if pub.exists():
                keys[spec.index] = " ".join(pub.read_text().split()[:2])
        return keys

    def sshd_log(self, node_id: str, index: int) -> Path:
        """The worker's sshd log file on the host (LogLevel ERROR)."""
        return self._worker_dir(node_id, index) / "sshd.log"

    # users and keys

    def sync_keys(self, node_id: str, ssh_keys: str) -> None:
        """Metadata ``ssh-keys`` -> each user's authorized_keys on every worker of the node."""
        keys = parse_ssh_keys(ssh_keys)
        node_dir = self._node_dir(node_id)
        with self._node_lock(node_id):
            specs = self._specs(node_id)
            if not specs:
                return  # never started: start_node applies the keys
            managed = set(_read_json(node_dir / "keys.json", {"users": []})["users"])
            users = sorted(set(keys) | managed)
            uids = self._allocate_uids([*sorted(keys), SUDOERS_GROUP])

            for spec in specs:
                wdir = self._worker_dir(node_id, spec.index)
                if not (wdir / "etc" / "passwd").exists():
                    continue
                accounts = _ensure_users(wdir / "etc", sorted(keys), uids)
                _ensure_sudoers(wdir / "etc", sorted(set(keys) - {"root"}), uids[SUDOERS_GROUP])
                for user in users:
                    if user in accounts:
                        _sync_authorized_keys(wdir, accounts[user], keys.get(user, []))
            _write_json(node_dir / "keys.json", {"users": users})

    def _allocate_uids(self, users: list[str]) -> dict[str, int]:
        """Stable uid per new user name (from FIRST_UID), shared by all nodes and workers."""
        self.state_dir.mkdir(parents=True, exist_ok=True)
        with self._uid_lock, open(self.state_dir / "uids.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            table: dict[str, int] = _read_json(self.state_dir / "uids.json", {})
            taken = set(table.values())
            taken |= {p.pw_uid for p in pwd.getpwall()} | {g.gr_gid for g in grp.getgrall()}
            next_uid = FIRST_UID
            for user in users:
                if user in table or _host_user(user):
                    continue
                while next_uid in taken:
                    next_uid += 1
                table[user] = next_uid
                taken.add(next_uid)
            _write_json(self.state_dir / "uids.json", table)
        return table

    # OS Login (what the guest environment does when enable-oslogin is on)

    def _os_login(self, node_id: str) -> dict:
        return _read_json(self._node_dir(node_id) / "oslogin.json",
                          {"enabled": False, "accounts": []})

    def set_os_login(self, node_id: str, accounts: list[dict] | None) -> None:
        """OS Login on (``accounts``: the project's POSIX accounts, from its profiles) or off
        (None) for a node's workers: sshd asks the metadata server for an OS Login user's keys
        (AuthorizedKeysCommand), and the accounts exist (the guest's NSS module lists them).
        Running workers reload sshd when this changes; it persists across restarts."""
        node_dir = self._node_dir(node_id)
        wanted = {"enabled": accounts is not None, "accounts": accounts or []}
        with self._node_lock(node_id):
            node_dir.mkdir(parents=True, exist_ok=True)
            _write_json(node_dir / "oslogin.json", wanted)
            for spec in self._specs(node_id):
                wdir = self._worker_dir(node_id, spec.index)
                if not (wdir / "etc" / "passwd").exists():
                    continue
                if accounts:
                    _ensure_os_login_users(wdir, accounts)
                text = sshd_config_text(spec, os_login=accounts is not None)
                config = wdir / "sshd_config"
                if config.exists() and config.read_text() == text:
                    continue
                config.write_text(text)
                pid = self._init_pid(node_id, spec.index)
                if pid is not None:
                    _signal(pid, signal.SIGUSR1)  # its PID 1 reloads sshd with the new config

    # faults and access

    def set_reachable(self, node_id: str, index: int, reachable: bool) -> None:
        """Fault: unreachable = nothing listens on ip:22 (refused); other processes keep running.

        Persists across worker restarts until set back to True.
        """
        with self._node_lock(node_id):
            spec = self._spec(node_id, index)
            flag = self._worker_dir(node_id, index) / "unreachable"
            if reachable:
                flag.unlink(missing_ok=True)
            else:
                flag.touch()
            pid = self._init_pid(node_id, index)
            if pid is None:
                return
            _signal(pid, signal.SIGUSR1)
            record = _read_json(self._worker_dir(node_id, index) / "init.json", {})
            if reachable and time.monotonic() < record.get("sshd_at", 0):
                return  # its start delay has not passed yet; wait_listening covers it
            if not _wait_for(lambda: (spec.ip in _listening_addresses(table=_tcp_table(spec)))
                             == reachable, 10.0):
                state = "listen" if reachable else "stop listening"
                raise SimError(f"sshd on worker {index} of node {node_id} did not {state} within "
                               f"10 s; see {self.sshd_log(node_id, index)}.")

    def kill_sshd(self, node_id: str, index: int) -> None:
        """Fault: SIGKILL the worker's sshd and every session under it (mid-command).

        Processes that detached from their session (setsid, nohup ... &) survive, and the
        worker's PID 1 starts a new listener at once (as systemd would) unless the worker is
        unreachable.
        """
        sshd = find_host_tools().sshd
        with self._node_lock(node_id):
            init = self._require_init(node_id, index)
            victims: dict[int, int] = {}
            for _ in range(50):  # SIGSTOP the tree first so nothing forks away from us
                procs = _namespace_processes(init)
                tree = {p for p, (ppid, _) in procs.items() if ppid == init and _exe(p) == sshd}
                grew = True
                while grew:
                    more = {p for p, (ppid, _) in procs.items() if ppid in tree} - tree
                    tree |= more
                    grew = bool(more)
                new = {p: procs[p][1] for p in tree if p not in victims}
                if not new:
                    break
                for pid in new:
                    _signal(pid, signal.SIGSTOP)
                victims.update(new)
            for pid in victims:
                _signal(pid, signal.SIGKILL)
            if not _wait_for(lambda: not any(_alive(p, t) for p, t in victims.items()), 10.0):
                raise SimError(f"sshd on worker {index} of node {node_id} survived SIGKILL.")

    def exec_in(self, node_id: str, index: int, argv: list[str], **popen_kw
                ) -> subprocess.CompletedProcess:
        """Run argv as root inside the worker (nsenter); output captured as text by default."""
        init = self._require_init(node_id, index)
        popen_kw.setdefault("env", {"PATH": STD_PATH, "HOME": "/root", "LANG": "C.UTF-8"})
        if not {"stdout", "stderr", "capture_output"} & popen_kw.keys():
            popen_kw["capture_output"] = True
        popen_kw.setdefault("text", True)
        nsenter = find_host_tools().nsenter
        return subprocess.run([nsenter, "--target", str(init), "--pid", "--mount", "--uts",
                               "--net", "--", *argv], **popen_kw)


# --- worker accounts (files on the worker's disk, changed in place) --------------------------


@dataclass(frozen=True)
class _Account:
    name: str
    uid: int
    gid: int
    home: str


def _host_user(name: str) -> bool:
    try:
        pwd.getpwnam(name)
        return True
    except KeyError:
        return False


def _read_passwd(path: Path) -> dict[str, _Account]:
    accounts = {}
    for line in path.read_text().splitlines():
        fields = line.split(":")
        if len(fields) >= 7 and fields[2].isdigit() and fields[3].isdigit():
            accounts[fields[0]] = _Account(fields[0], int(fields[2]), int(fields[3]), fields[5])
    return accounts


def _append(path: Path, line: str) -> None:
    # Append, never replace: the file is bind-mounted into the running worker by inode.
    with open(path, "a") as f:
        f.write(line + "\n")


def _ensure_users(etc: Path, users: list[str], uids: dict[str, int]) -> dict[str, _Account]:
    accounts = _read_passwd(etc / "passwd")
    groups = {line.split(":")[0] for line in (etc / "group").read_text().splitlines()}
    for user in users:
        if user in accounts or user not in uids:
            continue
        uid = uids[user]
        _append(etc / "passwd", f"{user}:x:{uid}:{uid}::/home/{user}:/bin/bash")
        if user not in groups:
            _append(etc / "group", f"{user}:x:{uid}:")
        # '*' (no password) rather than '!' (locked): without PAM, sshd refuses locked accounts.
        _append(etc / "shadow", f"{user}:*:{int(time.time() // 86400)}:0:99999:7:::")
        accounts[user] = _Account(user, uid, uid, f"/home/{user}")
    return accounts


def _ensure_os_login_users(wdir: Path, accounts: list[dict]) -> None:
    """The POSIX accounts of OS Login profiles, with their uid and a home (pam_mkhomedir's
    job on a real VM); sudo is decided at each login (authorized_keys_command.py)."""
    etc = wdir / "etc"
    existing = _read_passwd(etc / "passwd")
    for account in accounts:
        name = str(account.get("username", ""))
        if not USER_NAME.fullmatch(name) or not str(account.get("uid", "")).isdigit():
            continue
        if name not in existing:
            existing.update(_ensure_users(etc, [name], {name: int(account["uid"])}))
        home = _host_home(wdir, existing[name].home)
        if home is not None and not home.exists():
            _make_home(home, existing[name])


def _make_home(home: Path, account: _Account) -> None:
    shutil.copytree("/etc/skel", home, symlinks=True)
    for path in (home, *home.rglob("*")):
        os.lchown(path, account.uid, account.gid)
    os.chmod(home, 0o750)


def _ensure_sudoers(etc: Path, users: list[str], gid: int) -> None:
    """Every metadata user is in google-sudoers (passwordless sudo), as on a real TPU VM."""
    path = etc / "group"
    lines = path.read_text().splitlines()
    for i, line in enumerate(lines):
        fields = line.split(":")
        if fields[0] == SUDOERS_GROUP and len(fields) == 4:
            members = [m for m in fields[3].split(",") if m]
            missing = [u for u in users if u not in members]
            if not missing:
                return
            fields[3] = ",".join(members + missing)
            lines[i] = ":".join(fields)
            break
    else:
        lines.append(f"{SUDOERS_GROUP}:x:{gid}:{','.join(users)}")
    # Rewrite in place (same inode): the file is bind-mounted into the running worker.
    with open(path, "r+") as f:
        f.write("".join(f"{line}\n" for line in lines))
        f.truncate()


def _host_home(wdir: Path, home: str) -> Path | None:
    if home == "/root":
        return wdir / "root"
    if home.startswith("/home/") and "/" not in home[6:] and home[6:] not in ("", ".", ".."):
        return wdir / "home" / home[6:]
    return None  # e.g. /nonexistent: not on the worker's own disk


def _sync_authorized_keys(wdir: Path, account: _Account, keys: list[str]) -> None:
    home = _host_home(wdir, account.home)
    if home is None:
        return
    # Users own these directories inside the worker: never follow a link they may have planted.
    if not home.exists():
        if not keys:
            return
        _make_home(home, account)
    ssh_dir = home / ".ssh"
    if home.is_symlink() or ssh_dir.is_symlink():
        return
    if not ssh_dir.exists():
        if not keys:
            return
        ssh_dir.mkdir(mode=0o700)
        os.chown(ssh_dir, account.uid, account.gid)
    target = ssh_dir / "authorized_keys"
    old = "" if not target.exists() or target.is_symlink() else target.read_text()
    new = strip_managed_keys(old) + "".join(f"{MANAGED_KEY_MARK}\n{k}\n" for k in keys)
    if new == old and target.exists() and not target.is_symlink():
        return
    tmp = ssh_dir / ".authorized_keys.tpufab"
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(new)
    os.chown(tmp, account.uid, account.gid)
    os.replace(tmp, target)


def _make_host_key(path: Path, comment: str) -> None:
    # cryptography comes with paramiko (fabric); in-process, this is 200x faster than ssh-keygen
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    key = Ed25519PrivateKey.generate()
    private = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH,
                                serialization.NoEncryption())
    public = key.public_key().public_bytes(serialization.Encoding.OpenSSH,
                                           serialization.PublicFormat.OpenSSH)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(private)
    path.with_name(path.name + ".pub").write_bytes(public + f" {comment}\n".encode())


def _exe(pid: int) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/exe")
    except OSError:
        return None
