"""Local ports tunnelled to a worker over the fan-out's SSH transport (``ssh -L``, in-process).

Each listener sits on 127.0.0.1 here; every connection it accepts becomes a
``direct-tcpip`` channel on the worker's already-open, host-key-pinned paramiko transport,
and bytes are pumped both ways until either side closes. A connection the worker refuses
is reported (one line per connection) and the listener keeps going. See docs/files.md.
"""

from __future__ import annotations

import errno
import re
import selectors
import socket
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from tpufab.errors import ConfigError, TpufabError

PUMP_CHUNK = 1 << 16
_SPEC = re.compile(r"^(?:(?P<local>\d+):)?(?:(?P<host>[A-Za-z0-9._-]+|\[[0-9A-Fa-f:]+\]):)?"
                   r"(?P<remote>\d+)$")


@dataclass(frozen=True)
class PortForward:
    """127.0.0.1:``local`` here -> ``remote_host``:``remote`` as seen from the worker."""

    local: int
    remote: int
    remote_host: str = "127.0.0.1"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.local}"

    def ssh_option(self) -> str:
        """The same forward for the system ssh (``-L``)."""
        return f"127.0.0.1:{self.local}:{self.remote_host}:{self.remote}"


def parse_forward(spec: str) -> PortForward:
    """``8080`` / ``8080:9000`` / ``8080:localhost:9000`` (ssh -L style) -> PortForward."""
    text = str(spec).strip()
    match = _SPEC.match(text)
    if not match:
        raise ConfigError(f"Cannot read the port forward {spec!r}: give PORT, "
                          "LOCAL_PORT:REMOTE_PORT or LOCAL_PORT:HOST:REMOTE_PORT "
                          "(e.g. 8080 or 8080:6006).")
    if match["host"] and not match["local"]:
        raise ConfigError(f"Cannot read the port forward {spec!r}: HOST:PORT needs a local "
                          "port first (LOCAL_PORT:HOST:REMOTE_PORT).")
    remote = int(match["remote"])
    local = int(match["local"]) if match["local"] else remote
    for port in (local, remote):
        if not 1 <= port <= 65535:
            raise ConfigError(f"Port {port} in {spec!r} is out of range (1-65535).")
    return PortForward(local, remote, (match["host"] or "127.0.0.1").strip("[]"))


def parse_forwards(specs: Iterable[str]) -> list[PortForward]:
    forwards = [parse_forward(s) for s in specs]
    if not forwards:
        raise ConfigError("No port given: tpufab forward PORT[:REMOTE_PORT]... (e.g. 8080 or "
                          "8080:6006).")
    seen: set[int] = set()
    for f in forwards:
        if f.local in seen:
            raise ConfigError(f"Local port {f.local} is given twice; each forward needs its "
                              "own local port.")
        seen.add(f.local)
    return forwards


class Forwarder:
    """Listeners for ``forwards`` tunnelling over ``transport()`` (a paramiko Transport).

    ``transport`` is a callable so a dropped connection can be reopened between accepts.
    ``on_event(text)`` hears each refused or failed connection.
    """

    def __init__(self, transport: Callable[[], object], forwards: Iterable[PortForward], *,
                 worker_label: str = "the worker",
                 on_event: Callable[[str], None] | None = None):
        self.transport = transport
        self.forwards = list(forwards)
        self.worker_label = worker_label
        self.on_event = on_event or (lambda text: None)
        self.listeners: list[tuple[PortForward, socket.socket]] = []
        self.stopped = threading.Event()
        self._threads: list[threading.Thread] = []
        self._open: set[socket.socket] = set()
        self._lock = threading.Lock()
        self.connections = 0
        self.refused = 0

    def start(self) -> Forwarder:
        try:
            for f in self.forwards:
                self.listeners.append((f, _listen(f.local)))
        except BaseException:
            self.close()
            raise
        for f, sock in self.listeners:
            thread = threading.Thread(target=self._accept_loop, args=(f, sock), daemon=True,
                                      name=f"tpufab-forward-{f.local}")
            thread.start()
            self._threads.append(thread)
        return self

    def __enter__(self) -> Forwarder:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until ``close`` (or Ctrl-C in the caller); True once stopped."""
        return self.stopped.wait(timeout)

    def close(self) -> None:
        self.stopped.set()
        for _f, sock in self.listeners:
            try:
                sock.close()
            except OSError:
                pass
        with self._lock:
            for sock in list(self._open):
                try:
                    sock.close()
                except OSError:
                    pass
        for thread in self._threads:
            thread.join(timeout=2)

    # -- internals ------------------------------------------------------------------------
    def _accept_loop(self, f: PortForward, listener: socket.socket) -> None:
        while not self.stopped.is_set():
            try:
                client, peer = listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            client.settimeout(None)
            threading.Thread(target=self._serve, args=(f, client, peer), daemon=True,
                             name=f"tpufab-forward-{f.local}-conn").start()

    def _serve(self, f: PortForward, client: socket.socket, peer) -> None:
        import paramiko

        with self._lock:
            self.connections += 1
            self._open.add(client)
        where = f"{self.worker_label} {f.remote_host}:{f.remote}"
        try:
            try:
                channel = self.transport().open_channel(
                    "direct-tcpip", (f.remote_host, f.remote), peer, timeout=10)
            except paramiko.ChannelException as err:
                with self._lock:
                    self.refused += 1
                reason = "connection refused" if err.code == 2 else (err.text or str(err))
                self.on_event(f"127.0.0.1:{f.local} -> {where}: {reason} (nothing listening "
                              "there yet?); still listening")
                return
            except Exception as err:  # noqa: BLE001 - reported, the listener keeps going
                self.on_event(f"127.0.0.1:{f.local} -> {where}: {type(err).__name__}: {err}; "
                              "still listening")
                return
            with channel:
                try:
                    _pump(client, channel, self.stopped)
                except (OSError, ValueError, EOFError):
                    # the program here reset its connection, or close() shut it under the
                    # pump: this connection is over, quietly (never a thread's traceback)
                    pass
        finally:
            with self._lock:
                self._open.discard(client)
            try:
                client.close()
            except OSError:
                pass


def _listen(port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(("127.0.0.1", port))
    except OSError as err:
        sock.close()
        if err.errno == errno.EADDRINUSE:
            raise TpufabError(f"Local port {port} is already in use on this machine (another "
                              f"program listens there); pick another local port, e.g. "
                              f"{port + 1}:{port}.") from None
        if err.errno == errno.EACCES:
            raise TpufabError(f"Local port {port} needs privileges here; use a port above "
                              f"1023, e.g. 8{port:03d}:{port}.") from None
        raise
    sock.listen(64)
    sock.settimeout(0.5)   # the accept loop looks at `stopped` between connections
    return sock


def _pump(client: socket.socket, channel, stopped: threading.Event) -> None:
    """Copy bytes both ways until either side closes (half-closes are passed on)."""
    with selectors.DefaultSelector() as selector:
        selector.register(client, selectors.EVENT_READ, "client")
        selector.register(channel, selectors.EVENT_READ, "channel")
        open_sides = 2
        while open_sides and not stopped.is_set() and not channel.closed:
            for key, _mask in selector.select(0.5):
                if key.data == "client":
                    data = client.recv(PUMP_CHUNK)
                    if data:
                        channel.sendall(data)
                        continue
                    selector.unregister(client)
                    channel.shutdown_write()
                else:
                    data = channel.recv(PUMP_CHUNK)
                    if data:
                        client.sendall(data)
                        continue
                    selector.unregister(channel)
                    try:
                        client.shutdown(socket.SHUT_WR)
                    except OSError:
                        pass
                open_sides -= 1


class ForwardError(TpufabError):
    """The worker to forward to cannot be reached (the sentence names it)."""


def forward(fanout, specs: Iterable[str | PortForward], *, worker: int = 0,
            on_event: Callable[[str], None] | None = None) -> Forwarder:
    """Start forwarding ``specs`` to ``worker`` over its fan-out connection; returns the
    started :class:`Forwarder` (``close()`` it, or use it as a context manager)."""
    from tpufab import nodeset

    forwards = [s if isinstance(s, PortForward) else parse_forward(s) for s in specs]
    if not forwards:
        parse_forwards([])
    if worker not in fanout.targets:
        raise ConfigError(f"Worker {worker} does not exist; valid workers are "
                          f"{nodeset.fold(fanout.workers)}.")

    def transport():
        return fanout.transport(worker)

    label = nodeset.label(worker)
    try:
        transport()
    except TpufabError as err:     # one sentence naming the worker, whatever failed
        text = str(err).rstrip(".")
        raise ForwardError(f"Cannot forward to {label}: "
                           f"{text.removeprefix(label + ': ')}.") from None
    return Forwarder(transport, forwards, worker_label=nodeset.label(worker),
                     on_event=on_event).start()
