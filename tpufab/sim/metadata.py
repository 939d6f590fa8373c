"""The GCE metadata server of every simulated worker.

On a real TPU VM, ``http://metadata.google.internal/computeMetadata/v1/...`` (169.254.169.254)
answers with that VM's own values; JAX, libtpu, torch_xla, google-auth and the guest agent read
it. Here one server in the sim daemon listens on every running worker's own loopback address,
port 80, and knows which worker asks by the address it was reached on; each worker's
/etc/hosts maps ``metadata.google.internal`` (and ``metadata``) to that address, so code reaches
it exactly as on a real VM. Values come from a ``MetadataSource`` (the emulator).

What a client sees, as on GCE:

- the header ``Metadata-Flavor: Google`` is required (403 without it), and every answer
  carries it; a request with ``X-Forwarded-For`` is refused (403);
- a path ending in ``/`` lists its entries (``name/`` for directories), ``?recursive=true``
  answers a directory as JSON, ``?alt=json`` a leaf as JSON, ``?alt=text`` is the default;
- ``?wait_for_change=true`` [``&last_etag=E``] [``&timeout_sec=N``] blocks until the value
  differs from the one with ETag ``E`` (default: the current one), or the timeout (then it
  answers the unchanged value);
- ``instance/service-accounts/default/token`` issues a Bearer token (``access_token``,
  ``expires_in``, ``token_type``) that the emulator's API accepts.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import selectors
import socket
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler
from typing import Any, Protocol
from urllib.parse import parse_qs, urlsplit

log = logging.getLogger("tpufab.sim.metadata")

METADATA_PORT = 80
ROOT = "/computeMetadata/v1/"
MAX_WAIT = 3600.0
# A leaf whose value is produced on request (a fresh token) rather than stored.
Dynamic = Callable[[], Any]


class JsonLeaf(str):
    """A leaf whose text is JSON (a token): answered as application/json, as GCE does."""


class MetadataSource(Protocol):
    def metadata_tree(self, node_id: str, worker: int) -> dict[str, Any] | None:
        """The whole ``computeMetadata/v1`` tree of one worker, or None if it is gone."""


def lookup(tree: Any, parts: list[str]) -> Any:
    """The subtree at ``parts`` (KeyError if there is none); dynamic leaves are evaluated."""
    node = tree
    for part in parts:
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            raise KeyError(part)
    return node() if callable(node) else node


def _materialize(value: Any) -> Any:
    """A subtree with dynamic leaves left out (recursive answers never mint tokens)."""
    if isinstance(value, dict):
        return {k: _materialize(v) for k, v in value.items() if not callable(v)}
    if isinstance(value, list):
        return [_materialize(v) for v in value]
    return value


def render(value: Any, *, directory: bool, recursive: bool, alt: str) -> tuple[str, str]:
    """(content type, body) of one answer."""
    if isinstance(value, JsonLeaf):
        return "application/json", str(value)
    if isinstance(value, dict | list) and (recursive or alt == "json"):
        return "application/json", json.dumps(_materialize(value))
    if isinstance(value, dict):
        names = [f"{k}/" if isinstance(v, dict | list) else k for k, v in value.items()]
        return "application/text", "\n".join(names) + ("\n" if names else "")
    if isinstance(value, list):
        if directory:
            return "application/text", "".join(f"{i}/\n" if isinstance(v, dict) else f"{i}\n"
                                               for i, v in enumerate(value))
        return "application/text", "\n".join(str(v) for v in value) + "\n"
    if alt == "json":
        return "application/json", json.dumps(value)
    return "application/text", value if isinstance(value, str) else json.dumps(value)


def etag_of(content: str) -> str:
    return hashlib.sha256(content.encode()).hexdigest()[:16]


class MetadataServer:
    """Listens on (ip, 80) of every running worker; one thread accepts, one per connection."""

    def __init__(self, source: MetadataSource, port: int = METADATA_PORT):
        self.source = source
        self.port = port
        self._selector = selectors.DefaultSelector()
        self._lock = threading.Lock()
        self._changed = threading.Condition()
        self._generation = 0
        self._listeners: dict[str, list[socket.socket]] = {}  # node id -> its sockets
        self._closed = False
        self._wake_r, self._wake_w = socket.socketpair()
        self._selector.register(self._wake_r, selectors.EVENT_READ, None)
        self._thread = threading.Thread(target=self._accept_loop, name="sim-metadata",
                                        daemon=True)
        self._thread.start()

    def open(self, node_id: str, workers: list[tuple[int, str]] | list[tuple[int, str, str]]
             ) -> None:
        """Serve ``(worker index, ip[, network namespace])`` of a node (idempotent: a node is
        opened once). A worker in a namespace of its own (an internal-IP node) is served there."""
        from tpufab.sim.network import socket_in

        self.close(node_id)
        sockets = []
        for index, ip, *netns in workers:
            sock = socket_in(netns[0] if netns and netns[0] else None)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind((ip, self.port))
            except OSError as err:
                sock.close()
                log.warning("metadata server cannot listen on %s:%d (%s); worker %d of %s has "
                            "no metadata server", ip, self.port, err, index, node_id)
                continue
            sock.listen(64)
            sock.setblocking(False)
            sockets.append(sock)
            with self._lock:
                self._selector.register(sock, selectors.EVENT_READ, (node_id, index))
        with self._lock:
            self._listeners[node_id] = sockets
        self._wake()

    def close(self, node_id: str) -> None:
        with self._lock:
            sockets = self._listeners.pop(node_id, [])
            for sock in sockets:
                with contextlib.suppress(KeyError, ValueError):
                    self._selector.unregister(sock)
                sock.close()

    def shutdown(self) -> None:
        for node_id in list(self._listeners):
            self.close(node_id)
        self._closed = True
        self._wake()
        self.changed()
        self._thread.join(5)

    def changed(self) -> None:
        """Something a worker may be waiting for changed (wakes ``wait_for_change`` requests)."""
        with self._changed:
            self._generation += 1
            self._changed.notify_all()

    def wait_changed(self, generation: int, until: float) -> int:
        with self._changed:
            while self._generation == generation and not self._closed:
                left = until - time.monotonic()
                if left <= 0:
                    break
                self._changed.wait(left)
            return self._generation

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def generation(self) -> int:
        with self._changed:
            return self._generation

    def _wake(self) -> None:
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")

    def _accept_loop(self) -> None:
        while not self._closed:
            for key, _ in self._selector.select(timeout=1.0):
                if key.data is None:
                    with contextlib.suppress(OSError):
                        self._wake_r.recv(4096)
                    continue
                try:
                    conn, peer = key.fileobj.accept()  # type: ignore[union-attr]
                except OSError:
                    continue
                conn.setblocking(True)
                threading.Thread(target=self._serve, args=(conn, peer, key.data),
                                 name="sim-metadata-conn", daemon=True).start()

    def _serve(self, conn: socket.socket, peer: Any, worker: tuple[str, int]) -> None:
        try:
            _Handler(conn, peer, _Context(self, *worker))
        except Exception:  # noqa: BLE001 - one broken connection never stops the server
            log.exception("metadata request from %s failed", peer)
        finally:
            with contextlib.suppress(OSError):
                conn.close()


class _Context:
    def __init__(self, server: MetadataServer, node_id: str, worker: int):
        self.server = server
        self.node_id = node_id
        self.worker = worker


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "Metadata Server for VM"
    sys_version = ""
    server: _Context  # type: ignore[assignment]

    def do_GET(self) -> None:
        self._answer()

    def _send(self, code: int, body: str, content_type: str = "text/html",
              etag: str | None = None) -> None:
        data = body.encode()
        self.send_response(code)
        self.send_header("Metadata-Flavor", "Google")
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        if etag:
            self.send_header("ETag", etag)
        self.end_headers()
        self.wfile.write(data)

    def _answer(self) -> None:
        if self.headers.get("X-Forwarded-For"):
            return self._send(403, "Request denied: X-Forwarded-For is not allowed.\n")
        if self.headers.get("Metadata-Flavor") != "Google":
            return self._send(403, "Missing required header: \"Metadata-Flavor\": \"Google\"\n")
        split = urlsplit(self.path)
        query = {k: v[-1] for k, v in parse_qs(split.query, keep_blank_values=True).items()}
        path = split.path
        if path in ("/computeMetadata/v1", "/computeMetadata"):
            path = ROOT if path.endswith("v1") else "/computeMetadata/"
        if path == "/computeMetadata/":
            return self._send(200, "v1/\n", "application/text")
        if not path.startswith(ROOT):
            return self._send(404, "Not found\n")
        rest = path[len(ROOT):]
        directory = rest == "" or rest.endswith("/")
        parts = [p for p in rest.split("/") if p]
        if parts[:1] == ["oslogin"] and hasattr(self.server.server.source, "oslogin"):
            return self._oslogin(parts[1:], query)
        recursive = query.get("recursive", "").lower() == "true"
        alt = query.get("alt", "text")
        ctx = self.server
        wait = query.get("wait_for_change", "").lower() == "true"
        deadline = time.monotonic() + min(float(query.get("timeout_sec") or MAX_WAIT), MAX_WAIT)
        last_etag = query.get("last_etag")
        while True:
            generation = ctx.server.generation
            tree = ctx.server.source.metadata_tree(ctx.node_id, ctx.worker)
            if tree is None:
                return self._send(503, "The worker is not running.\n")
            try:
                value = lookup(tree, parts)
            except KeyError:
                return self._send(404, "Not found\n")
            if isinstance(value, dict | list) and not directory and not recursive and \
                    alt != "json":
                # GCE redirects a directory asked without its slash
                self.send_response(301)
                self.send_header("Metadata-Flavor", "Google")
                self.send_header("Location", path + "/")
                self.send_header("Content-Length", "0")
                self.end_headers()
                return None
            content_type, body = render(value, directory=directory, recursive=recursive,
                                        alt=alt)
            etag = etag_of(body)
            if not wait:
                return self._send(200, body, content_type, etag)
            if last_etag is None:
                last_etag = etag
            if etag != last_etag or time.monotonic() >= deadline or ctx.server.closed:
                return self._send(200, body, content_type, etag)
            ctx.server.wait_changed(generation, deadline)

    def _oslogin(self, parts: list[str], query: dict[str, str]) -> None:
        """``oslogin/users?username=`` and ``oslogin/authorize?email=&policy=``: what the
        guest's OS Login tools ask (answered by the source, not from the tree)."""
        ctx = self.server
        code, body = ctx.server.source.oslogin_answer(ctx.node_id, ctx.worker, parts, query)
        if isinstance(body, str):
            return self._send(code, body, "text/html")
        return self._send(code, json.dumps(body), "application/json")

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib signature
        log.debug(format, *args)
