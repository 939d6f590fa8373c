"""Workers that exist only on paper: the emulator's API without sshd (no root needed)."""

from __future__ import annotations

import subprocess
import threading
from dataclasses import dataclass
from pathlib import Path

from tpufab.sim._model import fake_host_key


@dataclass(frozen=True)
class PaperSpec:
    node_id: str
    index: int
    ip: str
    hostname: str
    device_files: tuple[str, ...]
    pci_device: str = ""
    vm: bool = False


class PaperWorkers:
    """Same methods as WorkerPool; records calls, starts nothing.

    Used by `serve(..., workers=False)` and by tests of the API shapes.
    """

    spec_factory = PaperSpec

    def __init__(self, state_dir: Path | None = None):
        self._lock = threading.Lock()
        self.nodes: dict[str, dict[int, PaperSpec]] = {}
        self.up: dict[str, bool] = {}
        self.keys: dict[str, str] = {}
        self.os_login: dict[str, list[dict] | None] = {}  # node -> POSIX accounts, None = off
        self.reachable: dict[tuple[str, int], bool] = {}
        self.calls: list[tuple[str, str]] = []

    def capacity_problem(self, what: str, workers: int) -> str | None:
        return None  # paper costs nothing

    def _record(self, what: str, node_id: str) -> None:
        with self._lock:
            self.calls.append((what, node_id))

    def start_node(self, node_id, specs, ssh_keys: str, *, delay: float = 0.0) -> None:
        self._record("start_node", node_id)
        with self._lock:
            self.nodes[node_id] = {s.index: s for s in specs}
            self.up[node_id] = True
            self.keys[node_id] = ssh_keys

    def wait_listening(self, node_id, timeout: float = 30.0) -> None:
        self._record("wait_listening", node_id)

    def stop_node(self, node_id) -> None:
        self._record("stop_node", node_id)
        with self._lock:
            self.up[node_id] = False

    def delete_node(self, node_id) -> None:
        self._record("delete_node", node_id)
        with self._lock:
            self.nodes.pop(node_id, None)
            self.up.pop(node_id, None)

    def remove_worker(self, node_id, index) -> None:
        self._record("remove_worker", node_id)

    def end_worker(self, node_id, index) -> None:
        self._record("end_worker", node_id)

    def console_log(self, node_id, index) -> str:
        spec = self.nodes.get(node_id, {}).get(index)
        return f"[    0.000000] {spec.hostname} booted (paper)\n" if spec else ""

    def sync_keys(self, node_id, ssh_keys: str) -> None:
        self._record("sync_keys", node_id)
        with self._lock:
            self.keys[node_id] = ssh_keys

    def set_os_login(self, node_id, accounts: list[dict] | None) -> None:
        self._record("set_os_login", node_id)
        with self._lock:
            self.os_login[node_id] = accounts

    def host_keys(self, node_id) -> dict[int, str]:
        with self._lock:
            return {i: fake_host_key(f"{node_id}-{i}") for i in self.nodes.get(node_id, {})}

    def set_reachable(self, node_id, index, reachable: bool) -> None:
        self._record("set_reachable", node_id)
        with self._lock:
            self.reachable[(node_id, index)] = reachable

    def kill_sshd(self, node_id, index) -> None:
        self._record("kill_sshd", node_id)

    def exec_in(self, node_id, index, argv, **kw) -> subprocess.CompletedProcess:
        raise NotImplementedError("paper workers cannot run commands")

    def running(self, node_id) -> dict[int, bool]:
        with self._lock:
            state = self.up.get(node_id, False)
            return {i: state for i in self.nodes.get(node_id, {})}

    def stop_all(self) -> None:
        self._record("stop_all", "*")
        with self._lock:
            for node_id in self.up:
                self.up[node_id] = False
