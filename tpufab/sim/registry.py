"""The simulated pod's Artifact Registry: a real OCI registry behind a small auth front.

The registry is Debian's ``docker-registry`` (the CNCF distribution server) on a loopback port
of its own, its blobs in ``<state>/registry/data``. In front of it, on port 80 of a loopback
address of the pod's own (``127.15.0.N``, kept in ``<state>/registry/address``),
the front answers as Artifact Registry does for a VM: HTTP Basic with the user
``oauth2accesstoken`` and as password an access token the simulated metadata server issued
(``Bearer`` with one works too); anonymous requests get 401 with a ``Basic`` challenge and
Artifact Registry's sentence, so a pull without ``docker login`` fails as it does on a VM
without auth. The project's own pushes (``tpufab sim image``) use a push token kept 0600 in
``<state>/registry/push-token`` (the stand-in for a CI's credentials).

Fault knob (``tpufab sim registry --fail-auth 25% --fail-times 2``): of a node's workers,
25% (worker ``w`` fails when ``int((w + 1) * p) > int(w * p)``, so exactly ``round(n * p)``
of ``n`` hosts, the same ones every time) have their first 2 authenticated requests refused
with 401, as a token that the registry does not accept yet (the snap-gcloud race of
marin#6567); ``--slow S`` delays every answer by S seconds. Each refusal is counted per
host (``/sim/v1/registry`` shows them).

The same registry also plays one that is not Artifact Registry, as ``OTHER_HOST``
(``registry.tpufab-sim.test``): there the front takes HTTP Basic with the one account of
``<state>/registry/account`` (``USER:PASSWORD``, 0600, made once), as a private registry
whose credentials a user holds (tpufab's ``registry_login`` setting), and refuses anonymous
requests with "authentication required"; metadata tokens count for nothing there.

Workers reach it as ``LOCATION-docker.pkg.dev`` (and ``OTHER_HOST``): their ``/etc/hosts`` names those hosts at the
registry's address and their ``/etc/containers/registries.conf`` marks them insecure (plain
HTTP): the simulated pod's stand-in for DNS and TLS (a real VM resolves pkg.dev and talks TLS
to it). ``prepare_containers`` writes each worker's podman configuration (docs/images.md).
"""

from __future__ import annotations

import base64
import http.client
import json
import logging
import os
import secrets
import shutil
import socket
import subprocess
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from tpufab.errors import SimError

log = logging.getLogger("tpufab.sim")

USER = "oauth2accesstoken"
CHUNK = 1 << 20
# the Artifact Registry locations routed to the simulated registry (multi-regions and the
# regions of Cloud TPU zones)
LOCATIONS = ("us", "europe", "asia", "us-central1", "us-central2", "us-east1", "us-east5",
             "us-south1", "us-west1", "us-west4", "europe-west4", "asia-east1",
             "asia-northeast1", "asia-southeast1")
DENIED = ("Unauthenticated request. Unauthenticated requests do not have permission "
          "\"artifactregistry.repositories.downloadArtifacts\" on resource {resource} (or it "
          "may not exist)")
OTHER_HOST = "registry.tpufab-sim.test"      # a registry that is not Artifact Registry
OTHER_DENIED = "authentication required"
REFUSED = ("The caller does not have permission: the access token was not accepted "
           "(simulated auth failure {n} of {of} for this host)")


def registry_hosts() -> list[str]:
    return [f"{loc}-docker.pkg.dev" for loc in LOCATIONS] + [OTHER_HOST]


def registry_hosts_line(address: str) -> str:
    """The /etc/hosts line naming every pkg.dev host at the registry's address."""
    return f"{address} {' '.join(registry_hosts())}  # tpufab sim: Artifact Registry\n"


def registries_conf() -> str:
    """A worker's /etc/containers/registries.conf: the registry's hosts over plain HTTP."""
    out = ["# tpufab sim: Artifact Registry's hosts are the simulated registry (/etc/hosts names",
           "# them at its loopback address, port 80, plain HTTP): the simulated pod's stand-in",
           "# for DNS and TLS", "unqualified-search-registries = []", ""]
    for host in registry_hosts():
        out += ["[[registry]]", f'location = "{host}"', "insecure = true", ""]
    return "\n".join(out)


CONTAINERS_CONF = """# tpufab sim: podman on a simulated worker
[containers]
# this sandbox refuses raising rlimits (podman's defaults: nofile, nproc)
default_ulimits = []
log_driver = "k8s-file"

[engine]
cgroup_manager = "cgroupfs"
events_logger = "file"
runtime = "runc"
"""

STORAGE_CONF = """# tpufab sim: the worker's images and containers (WORKER_DIR/containers on the host)
[storage]
driver = "overlay"
runroot = "/run/containers/storage"
graphroot = "/var/lib/containers/storage"
"""


def selected(worker: int, fraction: float) -> bool:
    return fraction > 0 and int((worker + 1) * fraction + 1e-9) > int(worker * fraction + 1e-9)


class Registry:
    """docker-registry and its front; ``start()``/``stop()``; ``address`` (HOST:PORT)."""

    def __init__(self, state_dir: Path, tokens: Any, *, host: str = "127.15.0.1"):
        self.dir = Path(state_dir)
        self.tokens = tokens
        self.fail_auth = 0.0
        self.fail_times = 2
        self.slow = 0.0
        self.refused: dict[str, int] = {}     # "node/worker" -> refusals so far
        self.lock = threading.Lock()
        self.proc: subprocess.Popen | None = None
        self.dir.mkdir(parents=True, exist_ok=True)
        token_file = self.dir / "push-token"
        if not token_file.exists():
            token_file.touch(mode=0o600)
            token_file.write_text(secrets.token_urlsafe(32))
        self.push_token = token_file.read_text().strip()
        account_file = self.dir / "account"
        if not account_file.exists():
            account_file.touch(mode=0o600)
            account_file.write_text(f"tpufab-sim:{secrets.token_urlsafe(24)}")
        self.account = tuple(account_file.read_text().strip().split(":", 1))
        self.server = ThreadingHTTPServer((host, 80), _Handler)
        self.server.daemon_threads = True
        self.server.registry = self  # type: ignore[attr-defined]
        self.host = host
        self.backend = 0

    @property
    def address(self) -> str:
        """Where it answers: port 80 of a loopback address of its own."""
        return self.host

    def start(self) -> None:
        binary = shutil.which("docker-registry")
        if binary is None:
            raise SimError("docker-registry is missing: apt-get install docker-registry "
                           "(scripts/bootstrap.sh does).")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.backend = s.getsockname()[1]
        data = self.dir / "data"
        data.mkdir(exist_ok=True)
        config = self.dir / "config.yml"
        config.write_text(json.dumps({   # YAML is a superset of JSON
            "version": 0.1, "log": {"level": "error", "accesslog": {"disabled": True}},
            "storage": {"filesystem": {"rootdirectory": str(data)}, "delete": {"enabled": True}},
            "http": {"addr": f"127.0.0.1:{self.backend}"}}))
        logf = open(self.dir / "registry.log", "ab")  # noqa: SIM115 - the child keeps it
        self.proc = subprocess.Popen(["setpriv", "--pdeathsig", "KILL", "--", binary, "serve",
                                      str(config)], stdout=logf, stderr=logf,
                                     stdin=subprocess.DEVNULL)
        logf.close()
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.backend), timeout=0.5):
                    break
            except OSError:
                if self.proc.poll() is not None:
                    raise SimError(f"docker-registry exited ({self.dir / 'registry.log'})") \
                        from None
                time.sleep(0.05)
        else:
            raise SimError("docker-registry did not listen within 20 s")
        threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.2},
                         name="tpufab-registry", daemon=True).start()
        (self.dir / "address").write_text(self.host)
        log.info("registry at %s (docker-registry on :%d)", self.address, self.backend)

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()

    def admin(self, method: str, body: dict[str, Any]) -> dict[str, Any]:
        if method in ("POST", "PATCH"):
            with self.lock:
                if "failAuth" in body:
                    self.fail_auth = max(0.0, min(1.0, float(body["failAuth"])))
                    self.refused.clear()
                if "failTimes" in body:
                    self.fail_times = max(0, int(body["failTimes"]))
                if "slowSeconds" in body:
                    self.slow = max(0.0, float(body["slowSeconds"]))
        with self.lock:
            return {"address": self.address, "failAuth": self.fail_auth,
                    "failTimes": self.fail_times, "slowSeconds": self.slow,
                    "refused": dict(self.refused), "hosts": [h for h in registry_hosts() if h != OTHER_HOST],
                    "otherHost": OTHER_HOST, "accountFile": str(self.dir / "account"),
                    "pushTokenFile": str(self.dir / "push-token")}

    def authorize_other(self, header: str | None) -> tuple[bool, str]:
        """(allowed, why not) on OTHER_HOST: Basic with the account alone."""
        scheme, _, value = (header or "").partition(" ")
        if scheme.lower() != "basic":
            return False, OTHER_DENIED
        try:
            user, _, password = base64.b64decode(value.strip()).decode().partition(":")
        except (ValueError, UnicodeDecodeError):
            return False, OTHER_DENIED
        if not user and not password:      # podman answers a Basic challenge with ":"
            return False, OTHER_DENIED
        if (user, password) != self.account:
            return False, "invalid username or password"
        return True, ""

    def authorize(self, header: str | None, host: str | None = None) -> tuple[bool, str]:
        """(allowed, why not) for an Authorization header sent to ``host``."""
        if (host or "").split(":")[0] == OTHER_HOST:
            return self.authorize_other(header)
        if not header:
            return False, "anonymous"
        scheme, _, value = header.partition(" ")
        token = None
        if scheme.lower() == "basic":
            try:
                user, _, password = base64.b64decode(value.strip()).decode().partition(":")
            except (ValueError, UnicodeDecodeError):
                return False, "bad credentials"
            if not user and not password:
                return False, "anonymous"
            if user != USER:
                return False, f"user {user!r} (Artifact Registry takes {USER})"
            token = password
        elif scheme.lower() == "bearer":
            token = value.strip()
        if not token:
            return False, "no token"
        if token == self.push_token:
            return True, ""
        holder = self.tokens.holder(token)
        if holder is None:
            return False, "a token the metadata server did not issue (or expired)"
        worker = int(holder.get("worker", -1))
        key = f"{holder.get('node')}/{worker}"
        with self.lock:
            if selected(worker, self.fail_auth) and self.refused.get(key, 0) < self.fail_times:
                self.refused[key] = self.refused.get(key, 0) + 1
                return False, REFUSED.format(n=self.refused[key], of=self.fail_times)
        return True, ""


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def _any(self) -> None:
        registry: Registry = self.server.registry  # type: ignore[attr-defined]
        if registry.slow:
            time.sleep(registry.slow)
        length = int(self.headers.get("Content-Length") or 0)
        host = self.headers.get("Host")
        ok, why = registry.authorize(self.headers.get("Authorization"), host)
        if not ok:
            if length:
                self.rfile.read(length)
            parts = self.path.split("/")
            resource = "/".join(parts[2:5]) if len(parts) > 4 else "the repository"
            message = DENIED.format(resource=json.dumps(resource)) if why == "anonymous" \
                else why
            other = (host or "").split(":")[0] == OTHER_HOST
            body = json.dumps({"errors": [{"code": "UNAUTHORIZED", "message": message}]}).encode()
            self.send_response(401)
            self.send_header("WWW-Authenticate", 'Basic realm="Registry"' if other
                             else 'Basic realm="Artifact Registry"')
            self.send_header("Docker-Distribution-API-Version", "registry/2.0")
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return
        self._forward(registry, length)

    def _forward(self, registry: Registry, length: int) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", registry.backend, timeout=300)
        headers = [(k, v) for k, v in self.headers.items()
                   if k.lower() not in ("authorization", "connection", "host",
                                        "transfer-encoding")]   # Accept comes many times
        headers.append(("Host", registry.address))
        chunked = "chunked" in (self.headers.get("Transfer-Encoding") or "").lower()
        try:
            conn.putrequest(self.command, self.path, skip_host=True, skip_accept_encoding=True)
            for k, v in headers:
                conn.putheader(k, v)
            if chunked:
                conn.putheader("Transfer-Encoding", "chunked")
            conn.endheaders()
            if chunked:
                self._relay_chunked(conn)
            else:
                left = length
                while left > 0:
                    data = self.rfile.read(min(CHUNK, left))
                    if not data:
                        break
                    conn.send(data)
                    left -= len(data)
            answer = conn.getresponse()
            self.send_response_only(answer.status, answer.reason)
            for k, v in answer.getheaders():
                if k.lower() in ("connection", "transfer-encoding", "keep-alive"):
                    continue
                self.send_header(k, v)
            if self.command == "HEAD" or answer.status in (204, 304) or \
                    answer.getheader("Content-Length") is not None:
                self.end_headers()
                while self.command != "HEAD":
                    data = answer.read(CHUNK)
                    if not data:
                        break
                    self.wfile.write(data)
            else:
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                while True:
                    data = answer.read(CHUNK)
                    if not data:
                        break
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
                self.wfile.write(b"0\r\n\r\n")
        except OSError as err:
            log.warning("registry front: %s %s: %s", self.command, self.path, err)
            self.close_connection = True
        finally:
            conn.close()

    def _relay_chunked(self, conn: http.client.HTTPConnection) -> None:
        while True:
            line = self.rfile.readline()
            size = int(line.split(b";")[0].strip() or b"0", 16)
            if size == 0:
                while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                    pass
                conn.send(b"0\r\n\r\n")
                return
            data = self.rfile.read(size)
            self.rfile.readline()
            conn.send(b"%x\r\n%s\r\n" % (len(data), data))

    do_GET = do_HEAD = do_PUT = do_POST = do_PATCH = do_DELETE = _any

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib signature
        pass


def start_registry(state_dir: Path, tokens: Any) -> Registry | None:
    """The pod's registry on port 80 of its previous address when free, else of the first
    free one of 127.15.0.1-127.15.0.254 (one per pod on this machine); None without
    docker-registry."""
    if shutil.which("docker-registry") is None:
        log.warning("no registry: docker-registry is not installed")
        return None
    try:
        previous = [(Path(state_dir) / "address").read_text().strip()]
    except OSError:
        previous = []
    try:
        registry = None
        for host in [*previous, *(f"127.15.0.{i}" for i in range(1, 255))]:
            try:
                registry = Registry(state_dir, tokens, host=host)
                break
            except OSError:
                continue
        if registry is None:
            raise SimError("no free loopback address in 127.15.0.0/24 for the registry")
        registry.start()
    except (SimError, OSError) as exc:
        log.warning("no registry: %s", exc)
        return None
    os.chmod(registry.dir / "push-token", 0o600)
    return registry


def prepare_containers(worker_dir: Path, registry: str | None) -> None:
    """A worker's container runtime, written into its own root filesystem before it boots:
    podman's containers.conf, storage.conf and registries.conf in the upper layer of its /etc,
    its images and containers in WORKER_DIR/containers (bound at /var/lib/containers: overlay
    storage needs a filesystem that is not itself an overlay), and ``docker`` as podman's
    (podman-docker's /usr/bin/docker; a Docker CLI the host has in /usr/local/bin, with no
    daemon behind it, is shadowed in the worker's /usr)."""
    if shutil.which("podman") is None:
        return
    etc = worker_dir / "rootfs" / "etc" / "upper" / "containers"
    etc.mkdir(parents=True, exist_ok=True)
    (etc / "containers.conf").write_text(CONTAINERS_CONF)
    (etc / "storage.conf").write_text(STORAGE_CONF)
    (etc / "nodocker").write_text("")  # podman-docker's note on every call, quieted
    if registry:
        (etc / "registries.conf").write_text(registries_conf())
    (worker_dir / "containers").mkdir(exist_ok=True)
    (worker_dir / "rootfs" / "var" / "upper" / "lib" / "containers").mkdir(parents=True,
                                                                          exist_ok=True)
    podman_docker = Path("/usr/bin/docker")
    local = Path("/usr/local/bin/docker")
    if podman_docker.exists() and local.exists():
        shadow = worker_dir / "rootfs" / "usr" / "upper" / "local" / "bin" / "docker"
        shadow.parent.mkdir(parents=True, exist_ok=True)
        if not shadow.is_symlink():
            shadow.unlink(missing_ok=True)
            shadow.symlink_to("/usr/bin/docker")
