"""Nodes without external IPs: a network namespace per node, and a bastion to reach it.

A node created with ``networkConfig.enableExternalIps=false`` (``tpufab create --internal-ips``,
``gcloud ... --internal-ips``) gets a network namespace of its own, held by one process
(``unshare --net sleep infinity``, killed with its owner like the workers). Its workers start
inside it (``WorkerSpec.netns``), so their addresses exist only there: from this machine a
connection to a worker's address is refused. What the workers need from the host is brought
in on their side of the fence, as Private Google Access and the VM's own metadata server do
on a real VPC:

- each worker's metadata server listens inside the namespace (sockets made there, served by
  the sim daemon, see :func:`socket_in`);
- the TPU API emulator and the pod's Cloud Storage answer at the same ``127.0.0.1:PORT``
  inside the namespace through a relay (:class:`Relay`), so autostop and mounts work.

The **bastion** is one more simulated VM in that namespace (a real sshd under WorkerPool, with
its own users and the node's metadata ``ssh-keys``), at ``127.X.Y.255`` (the node's address
block; worker w uses ``.w+1``). Its external leg is a relay on the same address in the host's
namespace: a one-to-one NAT, as a VM's external IP is on GCE. ``tpufab --jump
USER@127.X.Y.255`` opens one SSH connection to it and one ``direct-tcpip`` channel per worker;
sshd's forwarding connects inside the namespace.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import selectors
import signal
import socket
import struct
import subprocess
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from typing import Any

from tpufab.errors import SimError

log = logging.getLogger("tpufab.sim.network")

CLONE_NEWNET = 0x40000000
SIOCGIFFLAGS, SIOCSIFFLAGS, IFF_UP = 0x8913, 0x8914, 0x1
BASTION_HOST = 255  # the last octet of the bastion's address in its node's block
BASTION_SUFFIX = "-bastion"  # the bastion's WorkerPool node id: <node id>-bastion
SSH_PORT = 22


def is_internal(node: dict[str, Any]) -> bool:
    """Whether a node record asked for no external IPs."""
    return (node.get("networkConfig") or {}).get("enableExternalIps") is False


def bastion_address(worker_ip: str) -> str:
    """The bastion of the node whose worker 0 is at ``worker_ip``: ``127.16.3.1`` -> ``.255``."""
    return worker_ip.rpartition(".")[0] + f".{BASTION_HOST}"


def _setns(fd: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.setns(fd, CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def in_netns(path: str, fn: Callable[[], Any]) -> Any:
    """``fn()`` run by a thread inside the network namespace at ``path`` (setns is per thread;
    a socket keeps the namespace it was made in, wherever it is used later)."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            try:
                _setns(fd)
            finally:
                os.close(fd)
            box["value"] = fn()
        except BaseException as err:  # noqa: BLE001 - handed to the caller
            box["error"] = err

    thread = threading.Thread(target=run, name="tpufab-netns", daemon=True)
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box.get("value")


def socket_in(path: str | None) -> socket.socket:
    """A TCP socket in the network namespace at ``path`` (None: this process's own)."""
    if path is None:
        return socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    return in_netns(path, lambda: socket.socket(socket.AF_INET, socket.SOCK_STREAM))


def listener(path: str | None, address: tuple[str, int], backlog: int = 64) -> socket.socket:
    sock = socket_in(path)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(backlog)
    except OSError:
        sock.close()
        raise
    return sock


def connect_in(path: str | None, address: tuple[str, int], timeout: float = 10.0) -> socket.socket:
    sock = socket_in(path)
    try:
        sock.settimeout(timeout)
        sock.connect(address)
        sock.settimeout(None)
    except OSError:
        sock.close()
        raise
    return sock


class Relay:
    """Accepts on one socket; per connection, dials ``target`` in namespace ``to`` and copies
    bytes both ways until either side closes. One thread per connection."""

    def __init__(self, sock: socket.socket, to: str | None, target: tuple[str, int], name: str):
        self.sock, self.to, self.target, self.name = sock, to, target, name
        self._closed = threading.Event()
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self.sock.settimeout(0.5)
        threading.Thread(target=self._accept, name=f"relay-{name}", daemon=True).start()

    @property
    def address(self) -> tuple[str, int]:
        return self.sock.getsockname()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            threading.Thread(target=self._pump, args=(conn,), name=f"relay-{self.name}-conn",
                             daemon=True).start()

    def _pump(self, conn: socket.socket) -> None:
        try:
            peer = connect_in(self.to, self.target)
        except OSError:
            # The far side refuses: the relay answers with a reset, as the VM's kernel would.
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            conn.close()
            return
        with self._lock:
            self._conns.update((conn, peer))
        for s in (conn, peer):
            s.setblocking(False)
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        other = {conn: peer, peer: conn}
        try:
            with selectors.DefaultSelector() as sel:
                sel.register(conn, selectors.EVENT_READ)
                sel.register(peer, selectors.EVENT_READ)
                open_ends = 2
                while open_ends and not self._closed.is_set():
                    for key, _ in sel.select(timeout=1.0):
                        src = key.fileobj
                        try:
                            data = src.recv(1 << 16)  # type: ignore[union-attr]
                        except BlockingIOError:
                            continue
                        except OSError:
                            data = b""
                        if not data:  # half-close: pass the EOF on, keep the other way
                            sel.unregister(src)
                            open_ends -= 1
                            with contextlib.suppress(OSError):
                                other[src].shutdown(socket.SHUT_WR)  # type: ignore[index]
                            continue
                        dst = other[src]  # type: ignore[index]
                        dst.setblocking(True)
                        try:
                            dst.sendall(data)
                        except OSError:
                            open_ends = 0
                            break
                        finally:
                            dst.setblocking(False)
        finally:
            with self._lock:
                self._conns.difference_update((conn, peer))
            conn.close()
            peer.close()

    def close(self) -> None:
        self._closed.set()
        # shutdown first: a listener closed while the accept thread polls it keeps listening
        # until the poll returns, and what connects meanwhile is reset rather than refused
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()
        with self._lock:
            conns = list(self._conns)
        for s in conns:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)


@dataclass
class _Net:
    holder: subprocess.Popen
    path: str  # /proc/<holder>/ns/net
    relays: list[Relay]
    bastion: Relay | None = None


class NodeNetworks:
    """The namespaces of the pod's internal-IP nodes, their relays and bastions.

    ``pool`` is the WorkerPool (the bastion is one of its VMs); ``host_ports`` are the
    loopback ports (TPU API, Cloud Storage) relayed into every namespace.
    """

    def __init__(self, pool: Any, host_ports: Iterable[int] = ()):
        self.pool = pool
        self.host_ports = list(host_ports)
        self._nets: dict[str, _Net] = {}
        self._lock = threading.RLock()

    # the namespace

    def path(self, node_id: str) -> str:
        """The node's namespace (made on first use): ``/proc/<holder pid>/ns/net``."""
        with self._lock:
            net = self._nets.get(node_id)
            if net is not None and net.holder.poll() is None:
                return net.path
            if net is not None:
                self._drop(node_id)
            net = self._nets[node_id] = self._make()
            return net.path

    def _make(self) -> _Net:
        from tpufab.sim.worker_files import STD_PATH, find_host_tools
        from tpufab.sim.worker_procs import Launcher

        tools = find_host_tools()
        # Forked by the pool's long-lived launcher thread: PR_SET_PDEATHSIG follows the thread.
        holder = Launcher.call(lambda: subprocess.Popen(
            [tools.setpriv, "--pdeathsig", "KILL", "--", tools.unshare, "--net", "--",
             "sleep", "infinity"], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL, start_new_session=True, env={"PATH": STD_PATH}))
        path = f"/proc/{holder.pid}/ns/net"
        own = os.readlink("/proc/self/ns/net")
        deadline = time.monotonic() + 10.0
        while True:  # until unshare has made the namespace and exec'd sleep
            try:
                if os.readlink(path) != own and os.readlink(f"/proc/{holder.pid}/exe").endswith(
                        "/sleep"):
                    break
            except OSError:
                pass
            if holder.poll() is not None or time.monotonic() > deadline:
                holder.kill()
                holder.wait()
                raise SimError("Could not make a network namespace for an internal-IP node "
                               "(unshare --net failed); the simulated pod needs root and "
                               "network namespaces.")
            time.sleep(0.005)
        in_netns(path, _loopback_up)
        relays = []
        for port in self.host_ports:
            try:
                relays.append(Relay(listener(path, ("127.0.0.1", port)), None,
                                    ("127.0.0.1", port), f"port-{port}"))
            except OSError as err:
                log.warning("cannot relay port %d into an internal node's namespace: %s", port, err)
        return _Net(holder=holder, path=path, relays=relays)

    def _drop(self, node_id: str) -> None:
        net = self._nets.pop(node_id, None)
        if net is None:
            return
        if net.bastion is not None:
            net.bastion.close()
        for relay in net.relays:
            relay.close()
        if net.holder.poll() is None:
            net.holder.send_signal(signal.SIGKILL)
        net.holder.wait(timeout=10)

    # what the emulator calls

    def place(self, node: dict[str, Any], specs: list[Any]) -> list[Any]:
        """The specs of a node's workers, inside its namespace if it has no external IPs."""
        if not is_internal(node):
            return specs
        path = self.path(node["id"])
        return [replace(s, netns=path) for s in specs]

    def netns_of(self, node_id: str) -> str | None:
        with self._lock:
            net = self._nets.get(node_id)
            return net.path if net is not None and net.holder.poll() is None else None

    def bastion_spec(self, node: dict[str, Any], specs: list[Any]) -> Any:
        """The bastion VM of an internal-IP node (a WorkerSpec in its namespace), or None."""
        if not is_internal(node) or not specs:
            return None
        from tpufab.sim.worker_files import WorkerSpec

        return WorkerSpec(node_id=node["id"], index=0, ip=bastion_address(specs[0].ip),
                          hostname=f"{specs[0].hostname[:14]}-bastion", device_files=(),
                          netns=self.path(node["id"]))

    def start_bastion(self, node: dict[str, Any], specs: list[Any], ssh_keys: str, *,
                      os_login: list[dict] | None = None) -> str | None:
        """Start the node's bastion (idempotent); returns its address, or None for a node
        with external IPs. ``os_login``: the project's POSIX accounts when the project's OS
        Login is on (the bastion then takes keys from OS Login only, like the workers)."""
        spec = self.bastion_spec(node, specs)
        if spec is None:
            return None
        node_id, path, ip = node["id"], spec.netns, spec.ip
        # Its host key is kept per node name: recreated after a preemption (babysit), the node
        # finds the same bastion, whose key tpufab pinned, as on a real project.
        self.pool.keep_host_key(node_id + BASTION_SUFFIX, 0,
                                self.pool.state_dir / "bastions" / node["name"],
                                f"root@{spec.hostname}")
        self.pool.set_os_login(node_id + BASTION_SUFFIX, os_login)
        self.pool.start_node(node_id + BASTION_SUFFIX, [spec], ssh_keys)
        self.pool.wait_listening(node_id + BASTION_SUFFIX, timeout=30.0)
        with self._lock:
            net = self._nets[node_id]
            if net.bastion is None:
                net.bastion = Relay(listener(None, (ip, SSH_PORT)), path, (ip, SSH_PORT),
                                    f"bastion-{node_id}")
        return ip

    def set_os_login(self, node: dict[str, Any], accounts: list[dict] | None) -> None:
        """OS Login on (the project's POSIX accounts) or off (None) for the node's bastion."""
        if is_internal(node) and self.netns_of(node["id"]) is not None:
            self.pool.set_os_login(node["id"] + BASTION_SUFFIX, accounts)

    def sync_keys(self, node: dict[str, Any], ssh_keys: str) -> None:
        if is_internal(node) and self.netns_of(node["id"]) is not None:
            self.pool.sync_keys(node["id"] + BASTION_SUFFIX, ssh_keys)

    def bastion_host_key(self, node_id: str) -> str | None:
        return self.pool.host_keys(node_id + BASTION_SUFFIX).get(0)

    def stop(self, node_id: str, *, delete: bool = False) -> None:
        """After the node's workers stopped: the bastion, relays and namespace go too."""
        with self._lock:
            if node_id not in self._nets and not (
                    self.pool.state_dir / "nodes" / (node_id + BASTION_SUFFIX)).exists():
                return
            net = self._nets.get(node_id)
            if net is not None and net.bastion is not None:
                net.bastion.close()
                net.bastion = None
            if delete:
                self.pool.delete_node(node_id + BASTION_SUFFIX)
            else:
                self.pool.stop_node(node_id + BASTION_SUFFIX)
            self._drop(node_id)

    def close(self) -> None:
        with self._lock:
            for node_id in list(self._nets):
                self.stop(node_id)


def _loopback_up() -> None:
    import fcntl

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        request = struct.pack("16sH14x", b"lo", 0)
        flags = struct.unpack("16sH14x", fcntl.ioctl(s, SIOCGIFFLAGS, request))[1]
        fcntl.ioctl(s, SIOCSIFFLAGS, struct.pack("16sH14x", b"lo", flags | IFF_UP))
