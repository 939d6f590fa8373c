"""Host-side process plumbing of the simulated workers: reading /proc (processes, namespaces,
listening sockets), signals, bounded waits, small JSON files, the background removal of
deleted nodes' files, and the launcher thread and spawner that fork every worker's PID 1."""

from __future__ import annotations

import contextlib
import json
import os
import queue
import selectors
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path

from tpufab.sim.worker_files import INIT_SCRIPT, SSH_PORT, STD_PATH, HostTools, WorkerSpec


def proc_stat(pid: int) -> tuple[str, int, int] | None:
    """(state, ppid, start time in ticks) of a host pid, or None if it does not exist."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rpartition(b")")[2].split()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return fields[0].decode(), int(fields[1]), int(fields[19])


def alive(pid: int, start_time: int) -> bool:
    stat = proc_stat(pid)
    return stat is not None and stat[0] != "Z" and stat[2] == start_time


def send_signal(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)


def namespace_processes(init_pid: int) -> dict[int, tuple[int, int]]:
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
        stat = proc_stat(int(name))
        if stat is not None and stat[0] != "Z":
            found[int(name)] = (stat[1], stat[2])
    return found


def tcp_table(spec: WorkerSpec) -> str:
    """The /proc TCP table of the network namespace the worker listens in."""
    if spec.netns:  # /proc/<pid>/ns/net -> /proc/<pid>/net/tcp
        return spec.netns.rpartition("/ns/")[0] + "/net/tcp"
    return "/proc/net/tcp"


def listening_addresses(port: int = SSH_PORT, *, table: str = "/proc/net/tcp",
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


def wait_for(condition: Callable[[], bool], timeout: float, interval: float = 0.02) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval)
    return True


def tail(path: Path, lines: int = 3) -> str:
    try:
        text = path.read_text(errors="replace").strip().splitlines()
    except FileNotFoundError:
        return ""
    return " | ".join(text[-lines:])


def write_json(path: Path, data: object) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    os.replace(tmp, path)


def read_json(path: Path, default: object) -> object:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return default


TRASH = "trash"  # under state_dir: deleted nodes' files, being removed in the background
_emptying: set[str] = set()
_emptying_guard = threading.Lock()


def empty_in_background(trash: Path) -> None:
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


class Launcher:
    """Forks worker processes from one thread that lives as long as the process.

    PR_SET_PDEATHSIG fires when the *thread* that forked a child exits, so workers must not be
    forked by a short-lived caller thread (an HTTP request handler, say).
    """

    _instance: Launcher | None = None
    _guard = threading.Lock()

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.spawner: Spawner | None = None  # used on the launcher thread only
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
    def current_spawner(cls, tools: HostTools) -> Spawner:
        """The process's spawner (started when first needed); on the launcher thread only."""
        launcher = cls._instance
        assert launcher is not None and threading.current_thread().name == \
            "tpufab-worker-launcher"
        if launcher.spawner is None or not launcher.spawner.alive():
            launcher.spawner = Spawner(tools)
        return launcher.spawner

    def _run(self) -> None:
        while True:
            fn, args, future = self.jobs.get()
            try:
                future.set_result(fn(*args))
            except BaseException as err:  # noqa: BLE001 - handed to the caller
                future.set_exception(err)


class Spawner:
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
