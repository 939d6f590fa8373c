"""A private HTTPS git remote for the tests: `git http-backend` behind HTTP basic auth that
answers only with its token (``SmartHttp``), served over TLS with a throwaway certificate for
127.0.0.1 and 127.0.0.2 (``make_tls``), and ``Recorder``, a server that asks for credentials
and records what it is sent. ``token_remote(base, tls)`` serves the bare repositories
under ``base``; ``trust(run_on_worker, workers, tls)`` makes the workers' git trust the
certificate, as a private CA would be set up; ``LAPTOP_HELPER`` is this machine's own
credentials for such a remote (``LAPTOP_GIT_TOKEN``), as a credential manager would answer
the push. A plain helper module (tests/README.md)."""

from __future__ import annotations

import base64
import contextlib
import os
import subprocess
import threading
from collections.abc import Callable, Iterable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace

# `git config credential.helper LAPTOP_HELPER`: the push answered with $LAPTOP_GIT_TOKEN; the
# workers get only what tpufab sends them (TPUFAB_GIT_TOKEN)
LAPTOP_HELPER = '!f() { test "$1" = get && echo username=x-access-token && ' \
                'echo "password=$LAPTOP_GIT_TOKEN"; }; f'


class SmartHttp(BaseHTTPRequestHandler):
    """`git http-backend` behind HTTP basic auth: a private remote that wants a token."""

    def _serve(self) -> None:
        hook = getattr(self.server, "on_request", None)
        if hook is not None:
            hook()      # while the client waits for this answer
        expected = "Basic " + base64.b64encode(f"x-access-token:{self.server.token}".encode()
                                               ).decode()
        if self.headers.get("Authorization") != expected:
            self.send_response(401)
            self.send_header("WWW-Authenticate", 'Basic realm="tpufab-test"')
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        path, _, query = self.path.partition("?")
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        env = {"GIT_PROJECT_ROOT": str(self.server.root), "GIT_HTTP_EXPORT_ALL": "1",
               "PATH_INFO": path, "QUERY_STRING": query, "REQUEST_METHOD": self.command,
               "CONTENT_TYPE": self.headers.get("Content-Type", ""),
               "CONTENT_LENGTH": str(len(body)), "REMOTE_USER": "x-access-token",
               "PATH": os.environ["PATH"]}
        if self.headers.get("Git-Protocol"):
            env["GIT_PROTOCOL"] = self.headers["Git-Protocol"]
        out = subprocess.run(["git", "http-backend"], input=body, env=env,
                             capture_output=True).stdout
        head, _, payload = out.partition(b"\r\n\r\n")
        headers = [line.split(": ", 1) for line in head.decode().split("\r\n") if line]
        status = next((int(v.split()[0]) for k, v in headers if k == "Status"), 200)
        self.send_response(status)
        for key, value in headers:
            if key != "Status":
                self.send_header(key, value)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    do_GET = do_POST = _serve

    def log_message(self, *args) -> None:
        pass


class Recorder(BaseHTTPRequestHandler):
    """Asks for credentials (401) and records every Authorization header it is sent."""

    def _serve(self) -> None:
        self.server.seen.append(self.headers.get("Authorization"))
        self.send_response(401)
        self.send_header("WWW-Authenticate", 'Basic realm="not-origin"')
        self.send_header("Content-Length", "0")
        self.end_headers()

    do_GET = do_POST = _serve

    def log_message(self, *args) -> None:
        pass


def make_tls(where: Path) -> SimpleNamespace:
    """A self-signed certificate for 127.0.0.1 and 127.0.0.2 in ``where`` (``cert``, ``key``,
    ``pem``)."""
    cert, key = where / "cert.pem", where / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt",
                    "ec_paramgen_curve:prime256v1", "-nodes", "-days", "2", "-subj",
                    "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1,IP:127.0.0.2",
                    "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True)
    return SimpleNamespace(cert=cert, key=key, pem=cert.read_text())


@contextlib.contextmanager
def serving(handler, host: str = "127.0.0.1", tls: SimpleNamespace | None = None, **attrs):
    """``handler`` on a free port of ``host`` (https with ``tls``); yields the server, whose
    ``url`` is its base URL."""
    import ssl

    server = ThreadingHTTPServer((host, 0), handler)
    server.daemon_threads = True
    for name, value in attrs.items():
        setattr(server, name, value)
    scheme = "http"
    if tls is not None:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(tls.cert, tls.key)
        server.socket = context.wrap_socket(server.socket, server_side=True)
        scheme = "https"
    server.url = f"{scheme}://{host}:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


@contextlib.contextmanager
def token_remote(base: Path, tls: SimpleNamespace) -> Iterator:
    """An HTTPS remote over the bare repositories under ``base`` that answers only with its
    token (``.url``, ``.token``)."""
    with serving(SmartHttp, tls=tls, root=base, token="s3cr3t-" + os.urandom(6).hex()) as server:
        yield server


def trust(run_on_worker: Callable[[int, str], object], workers: Iterable[int],
          tls: SimpleNamespace) -> None:
    """The workers' git trusts the test certificate (``run_on_worker(w, script)`` runs a shell
    script as the login user there)."""
    for w in workers:
        run_on_worker(w, f"cat > ~/test-ca.pem <<'EOF'\n{tls.pem}EOF\n"
                         "git config --global http.sslCAInfo ~/test-ca.pem")
