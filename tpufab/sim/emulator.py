"""Cloud TPU API v2 over HTTP on 127.0.0.1, backed by real workers.

`Emulator.handle()` answers one request (method, path, query, JSON body) with a status and a
JSON body; `make_server()` puts it behind a stdlib ThreadingHTTPServer. The emulator routes;
its handlers do the work over one shared store (tpufab/sim/store.py: the lock, the state in
`<state_dir>/api-state.json`, operations, faults): nodes.py (TPU API nodes), machines.py (their
workers on this machine), queued.py, legacy.py, guest.py (metadata, startup scripts,
maintenance), oslogin.py, backing.py and compute_engine.py (Compute Engine). Workers are
started, stopped and keyed through an injected pool (`tpufab.sim.workers.WorkerPool`, or
`PaperWorkers` for the API alone). Fault injection lives under `/sim/v1/`. See
docs/simulated-pod.md.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import parse_qs, unquote, urlsplit

from tpufab.sim import catalog
from tpufab.sim._model import ApiFailure, operation_view, version_view
from tpufab.sim.backing import BackingNodes
from tpufab.sim.compute_engine import ComputeEngineEmulator
from tpufab.sim.compute_shapes import as_compute
from tpufab.sim.guest import GuestEnvironment, Tokens
from tpufab.sim.legacy import LegacyNodes
from tpufab.sim.machines import BRING_UP_STATES, Machines, bastion_of
from tpufab.sim.nodes import TpuNodes
from tpufab.sim.oslogin import OsLoginService
from tpufab.sim.queued import QueuedResources
from tpufab.sim.store import SimStore

log = logging.getLogger("tpufab.sim")


class Workers(Protocol):
    """What the emulator needs from a worker pool (tpufab.sim.workers.WorkerPool)."""

    def start_node(self, node_id: str, specs: Any, ssh_keys: str, *,
                   delay: float = 0.0) -> None: ...
    def wait_listening(self, node_id: str, timeout: float = 30.0) -> None: ...
    def stop_node(self, node_id: str) -> None: ...
    def delete_node(self, node_id: str) -> None: ...
    def sync_keys(self, node_id: str, ssh_keys: str) -> None: ...
    def remove_worker(self, node_id: str, index: int) -> None: ...
    def end_worker(self, node_id: str, index: int) -> None: ...
    def console_log(self, node_id: str, index: int) -> str: ...
    def set_os_login(self, node_id: str, accounts: list[dict] | None) -> None: ...
    def host_keys(self, node_id: str) -> dict[int, str]: ...
    def set_reachable(self, node_id: str, index: int, reachable: bool) -> None: ...
    def kill_sshd(self, node_id: str, index: int) -> None: ...
    def running(self, node_id: str) -> dict[int, bool]: ...
    def stop_all(self) -> None: ...
    def exec_in(self, node_id: str, index: int, argv: list[str], **popen_kw: Any) -> Any: ...
    def capacity_problem(self, what: str, workers: int) -> str | None: ...


@dataclass
class SimSettings:
    """Timing knobs (seconds). Real TPUs take minutes; the defaults keep tests fast."""

    create_delay: float = 0.2         # create / queued-resource request -> workers launched
    worker_start_delay: float = 0.3   # passed to WorkerPool.start_node(delay=)
    operation_delay: float = 0.1      # stop / delete / update / reset before they act
    listen_timeout: float = 60.0      # bound on waiting for a node's sshd to listen
    quota_chips: int | None = None    # chips per project, zone and generation; None = no limit
    maintenance_notice: float = 30.0  # simulateMaintenanceEvent: how long the event is announced

    def update(self, changes: dict[str, Any]) -> None:
        known = {f.name: f for f in fields(self)}
        for key, value in camel_to_snake_keys(changes).items():
            if key not in known:
                raise ApiFailure("INVALID_ARGUMENT",
                                 f"Unknown setting {key!r}; known: {', '.join(sorted(known))}.")
            if value is not None and not isinstance(value, int | float):
                raise ApiFailure("INVALID_ARGUMENT", f"Setting {key} takes a number.")
            if value is not None and value < 0:
                raise ApiFailure("INVALID_ARGUMENT", f"Setting {key} cannot be negative.")
            if key == "quota_chips":
                value = None if value is None else int(value)
            setattr(self, key, value)

    def as_json(self) -> dict[str, Any]:
        return {snake_to_camel(k): v for k, v in asdict(self).items()}


def snake_to_camel(key: str) -> str:
    head, *rest = key.split("_")
    return head + "".join(p[:1].upper() + p[1:] for p in rest)


def camel_to_snake_keys(d: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for key, value in d.items():
        out["".join("_" + c.lower() if c.isupper() else c for c in key)] = value
    return out


RECORD_ENV = "TPUFAB_SIM_RECORD"


class AnswerRecorder:
    """Keeps a sample of the API's answers, one JSON line each (method, path, code, body), in
    a file: at most ``per_shape`` of each method, path shape (names and ids as ``*``) and
    status, so a long session costs a few hundred lines. tests/conftest.py turns it on
    (TPUFAB_SIM_RECORD) and checks them against Google's schemas at the end."""

    def __init__(self, path: Path, per_shape: int = 3):
        self.path = path
        self.per_shape = per_shape
        self.seen: dict[tuple[str, str, int], int] = {}
        self.lock = threading.Lock()

    def record(self, method: str, path: str, code: int, answer: Any) -> None:
        if not path.startswith(("/v1/", "/v2/", "/v2alpha1/", "/compute/v1/")):
            return
        parts = path.split("/")
        head = 3 if path.startswith("/compute/") else 2  # /compute/v1/ or /v2/
        shape = "/".join(parts[:head] + [p if i % 2 == 0 else "*" if ":" not in p else
                                          "*:" + p.split(":", 1)[1]
                                          for i, p in enumerate(parts[head:])])
        key = (method, shape, code)
        with self.lock:
            if self.seen.get(key, 0) >= self.per_shape:
                return
            self.seen[key] = self.seen.get(key, 0) + 1
            with open(self.path, "a") as f:
                f.write(json.dumps({"method": method, "path": path, "code": code,
                                    "body": answer}) + "\n")


def _json_object(body: Any) -> dict[str, Any]:
    if body is not None and not isinstance(body, dict):
        raise ApiFailure("INVALID_ARGUMENT", "The request body must be a JSON object.")
    return body or {}


class Emulator:
    """The simulated pod's APIs: routes each request to its handler (module docstring)."""

    def __init__(self, state_dir: Path, workers: Workers, *,
                 settings: SimSettings | None = None,
                 spec_factory: Callable[..., Any] | None = None):
        self.store = SimStore(state_dir, workers, settings or SimSettings())
        self.started = time.time()
        self.tokens = Tokens(self.store.state_dir / "tokens.json")
        self.oslogin = OsLoginService(self.store)  # OS Login API, project metadata, roles
        self.guest = GuestEnvironment(self.store, self.tokens, self.oslogin)  # metadata, ...
        self.machines = Machines(self.store, self.guest, self.oslogin, spec_factory=spec_factory)
        self.nodes = TpuNodes(self.store, self.machines)  # TPU API nodes
        self.queued = QueuedResources(self.store, self.machines)  # queued resources, multislice
        self.legacy = LegacyNodes(self.store)  # API v1 nodes: control plane only, no workers
        self.backing = BackingNodes(self.store, self.machines)  # records behind Compute Engine VMs
        self.compute = ComputeEngineEmulator(self.store, self.backing, self.guest,
                                             self.oslogin)  # Compute Engine v1
        self.registry: Any = None  # tpufab.sim.registry.Registry, set by the daemon
        self.served: dict[str, int] = {}  # "v2 tpu.projects.locations.nodes.get" -> answered
        record = os.environ.get(RECORD_ENV)  # the tests' conformance check of what they see
        self.recorder = AnswerRecorder(Path(record)) if record else None

    # what the daemon and the tests set and read

    @property
    def state_dir(self) -> Path:
        return self.store.state_dir

    @property
    def workers(self) -> Workers:
        return self.store.workers

    @property
    def settings(self) -> SimSettings:
        return self.store.settings

    @property
    def metadata(self) -> Any:
        return self.store.metadata

    @metadata.setter
    def metadata(self, server: Any) -> None:
        self.store.metadata = server

    @property
    def network(self) -> Any:
        return self.store.network

    @network.setter
    def network(self, networks: Any) -> None:
        self.store.network = networks

    @property
    def base_url(self) -> str:
        return self.store.base_url

    @base_url.setter
    def base_url(self, url: str) -> None:
        self.store.base_url = url

    def preempt(self, name: str, notice: float = 0.0) -> dict[str, Any]:
        return self.machines.preempt(name, notice)

    # ------------------------------------------------------------------ request entry

    def handle(self, method: str, path: str, query: dict[str, str],
               body: Any, authorization: str | None = None) -> tuple[int, dict[str, Any]]:
        """Answer one request: (HTTP status, JSON body).

        No credentials are anonymous (as before); ``Bearer`` tokens must be ones a worker's
        metadata server issued and that have not expired.
        """
        code, answer = self._answer(method, unquote(path), query, body, authorization)
        if self.recorder is not None:
            self.recorder.record(method, unquote(path), code, answer)
        return code, answer

    def _answer(self, method: str, path: str, query: dict[str, str], body: Any,
                authorization: str | None) -> tuple[int, dict[str, Any]]:
        compute = path.startswith(("/compute/v1/", "/batch/compute/"))
        try:
            self._check_credentials(authorization)
            if path.startswith("/sim/v1/"):
                return 200, self._admin(method, path[len("/sim/v1/"):], query, body or {})
            if path.startswith(("/v2/", "/v2alpha1/", "/v1/", "/compute/v1/")):
                self._maybe_inject_error(path)
            if path.startswith("/compute/v1/"):
                return 200, self.compute.handle(method, path[len("/compute/v1/"):], query,
                                                _json_object(body))
            if path.startswith("/v3/projects/") and path.endswith(":testIamPermissions") \
                    and method == "POST":  # Cloud Resource Manager: every one granted but
                asked = _json_object(body).get("permissions") or []   # those a test denied
                with self.store.lock:
                    denied = set(self.store.denied_permissions)
                return 200, {"permissions": [p for p in asked if p not in denied]}
            if path.startswith("/v1/users/"):  # Cloud OS Login (oslogin.googleapis.com)
                return 200, self.oslogin.handle(method, path[len("/v1/users/"):], query,
                                                _json_object(body))
            if path.startswith("/v1/") and path.count("/") > 5:  # legacy TPU Nodes
                return 200, self.legacy.handle(method, path[len("/v1/"):], query,
                                               _json_object(body))
            for version in ("v2", "v2alpha1", "v1"):  # v1: locations only (gcloud locations)
                if path.startswith(f"/{version}/"):
                    rest = path[len(version) + 2:]
                    answer = self._api(method, version, rest, query, _json_object(body))
                    if isinstance(answer.get("metadata"), dict) and "done" in answer:
                        answer = operation_view(answer, version)  # its types in this version
                    return 200, answer
            raise ApiFailure("NOT_FOUND", f"The requested URL {path} was not found on this "
                             "server.")
        except ApiFailure as failure:
            failure = as_compute(failure) if compute else failure
            return failure.http_code, failure.body()
        except Exception as exc:  # a bug in the emulator: say so, keep serving
            log.exception("internal error on %s %s", method, path)
            failure = ApiFailure("INTERNAL", f"Internal error in the TPU emulator: {exc!r}")
            failure = as_compute(failure) if compute else failure
            return failure.http_code, failure.body()

    def handle_batch(self, body: bytes, content_type: str,
                     authorization: str | None = None) -> tuple[int, str, bytes]:
        """``POST /batch/compute/v1``: (HTTP status, content type, body) of a multipart
        batch of Compute Engine requests; each part is answered as on its own."""
        try:
            self._check_credentials(authorization)
            self._maybe_inject_error("/batch/compute/v1")

            def answer(method: str, path: str, query: dict[str, str],
                       part: Any) -> tuple[int, dict[str, Any]]:
                if not path.startswith("/compute/v1/"):
                    failure = as_compute(ApiFailure("NOT_FOUND", f"The batch part {path} is "
                                                    "not a Compute Engine v1 request."))
                    return failure.http_code, failure.body()
                return self.handle(method, path, query, part, authorization)

            kind, data = self.compute.batch(body, content_type, answer)
            return 200, kind, data
        except ApiFailure as failure:
            failure = as_compute(failure)
            return failure.http_code, "application/json; charset=UTF-8", \
                json.dumps(failure.body()).encode()

    def _check_credentials(self, authorization: str | None) -> None:
        if not authorization:
            return
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() == "bearer" and self.tokens.holder(token.strip()) is not None:
            return
        raise ApiFailure("UNAUTHENTICATED", "Request had invalid authentication credentials. "
                         "Expected OAuth 2 access token, login cookie or other valid "
                         "authentication credential.")

    def _maybe_inject_error(self, path: str) -> None:
        code = self.store.take_error_burst(path)
        if code is None:
            return
        if code == 429:
            raise ApiFailure(
                "RESOURCE_EXHAUSTED",
                "Quota exceeded for quota metric 'Requests' and limit 'Requests per minute' of "
                "service 'tpu.googleapis.com' for consumer 'project_number:0'.")
        raise ApiFailure("UNAVAILABLE", "The service is currently unavailable.")

    # ------------------------------------------------------------------ API routing

    def _api(self, method: str, version: str, rest: str, query: dict[str, str],
             body: dict[str, Any]) -> dict[str, Any]:
        parts = rest.split("/")
        verb = None
        if ":" in parts[-1]:
            parts[-1], verb = parts[-1].split(":", 1)
        if len(parts) < 3 or parts[0] != "projects" or parts[2] != "locations" or \
                not parts[1]:
            raise ApiFailure("NOT_FOUND", f"The requested URL /{version}/{rest} was not found.")
        project = parts[1]
        if len(parts) == 3 and method == "GET" and verb is None:
            self._served(version, "", "list")
            return catalog.list_locations(project, query)
        zone = parts[3]
        parent = f"projects/{project}/locations/{zone}"
        nodes, queued, store = self.nodes, self.queued, self.store
        if len(parts) == 4:
            if verb is None and method == "GET":
                self._served(version, "", "get")
                return catalog.location(project, zone)
            if verb == "generateServiceIdentity" and method == "POST":
                self._served(version, "", "generateServiceIdentity")
                return {"identity": {"email": "service-0@cloud-tpu.iam.gserviceaccount.com"}}
        elif len(parts) == 5:
            collection = parts[4]
            handler = {
                ("GET", "nodes"): lambda: self._list_nodes(parent, query, version),
                ("POST", "nodes"): lambda: nodes.create(version, parent, query, body),
                ("GET", "acceleratorTypes"): lambda: catalog.list_accelerator_types(parent,
                                                                                    query),
                ("GET", "runtimeVersions"): lambda: catalog.list_runtime_versions(parent, query),
                ("GET", "queuedResources"): lambda: queued.list(parent, query, version),
                ("POST", "queuedResources"): lambda: queued.create(version, parent, query,
                                                                   body),
                ("GET", "operations"): lambda: store.list_operations(parent, query, version),
            }.get((method, collection))
            if handler and verb is None:
                self._served(version, collection, "list" if method == "GET" else "create")
                return handler()
        elif len(parts) == 6 and parts[5]:
            collection = parts[4]
            name = f"{parent}/{collection}/{parts[5]}"
            handler = {
                ("GET", "nodes", None): lambda: self.legacy.v2_view(name) or
                    nodes.get(name, version),
                ("DELETE", "nodes", None): lambda: self.legacy.delete(name, version)
                    if self.legacy.v2_view(name) else nodes.delete(version, name),
                ("PATCH", "nodes", None): lambda: nodes.update(version, name, query, body),
                ("POST", "nodes", "stop"): lambda: nodes.stop(version, name),
                ("POST", "nodes", "start"): lambda: nodes.start(version, name),
                ("POST", "nodes", "getGuestAttributes"): lambda: nodes.guest_attributes(name,
                                                                                        body),
                ("POST", "nodes", "simulateMaintenanceEvent"):
                    lambda: self.guest.simulate_maintenance(version, name, body),
                ("POST", "nodes", "performMaintenance"):  # v2alpha1 only, as the API
                    lambda: self.guest.perform_maintenance(version, name)
                    if version == "v2alpha1" else self._not_in(version, method, rest),
                ("GET", "acceleratorTypes", None): lambda: catalog.accelerator_type(name),
                ("GET", "runtimeVersions", None): lambda: catalog.runtime_version(name),
                ("GET", "queuedResources", None): lambda: version_view(
                    queued.get(name)["qr"], "QueuedResource", version),
                ("DELETE", "queuedResources", None): lambda: queued.delete(version, name,
                                                                           query),
                ("POST", "queuedResources", "reset"): lambda: queued.reset(version, name),
                ("POST", "queuedResources", "performMaintenanceQueuedResource"):  # v2alpha1
                    lambda: self.guest.perform_maintenance_queued(version, name, body)
                    if version == "v2alpha1" else self._not_in(version, method, rest),
                ("GET", "operations", None): lambda: operation_view(store.operation(name),
                                                                    version),
                ("DELETE", "operations", None): lambda: store.delete_operation(name),
                ("POST", "operations", "cancel"): lambda: store.cancel_operation(name),
            }.get((method, collection, verb))
            if handler:
                self._served(version, collection, verb or {"GET": "get", "DELETE": "delete",
                                                           "PATCH": "patch"}[method])
                return handler()
        self._not_in(version, method, rest)

    def _served(self, version: str, collection: str, method: str) -> None:
        """Count a TPU API method answered (``tpu.projects.locations.nodes.get`` of v2)."""
        name = ".".join(p for p in ("tpu.projects.locations", collection, method) if p)
        key = f"{version} {name}"
        with self.store.lock:
            self.served[key] = self.served.get(key, 0) + 1

    def _list_nodes(self, parent: str, query: dict[str, str], version: str) -> dict[str, Any]:
        """TPU API nodes and the nodes the v1 API made (apiVersion V1), one page."""
        prefix = parent[:-1] if parent.endswith("/locations/-") else parent + "/nodes/"
        return self.nodes.page(self.nodes.list(parent, version) + self.legacy.v2_list(prefix),
                               query)

    @staticmethod
    def _not_in(version: str, method: str, rest: str) -> dict[str, Any]:
        raise ApiFailure("NOT_FOUND", f"Method {method} /{version}/{rest} is not part of the "
                         "Cloud TPU API (or not emulated).")

    # ------------------------------------------------------------------ admin (/sim/v1/)

    def _admin(self, method: str, rest: str, query: dict[str, str],
               body: dict[str, Any]) -> dict[str, Any]:
        store = self.store
        if rest == "health" and method == "GET":
            return self.health()
        if rest == "state" and method == "GET":
            return self.describe()
        if rest == "settings":
            if method in ("PATCH", "POST"):
                with store.lock:
                    store.settings.update(body)
            return store.settings.as_json()
        if rest == "faults" and method == "GET":
            return store.faults()
        if rest == "faults" and method == "DELETE":
            store.clear_faults()
            return {}
        if rest == "faults:failNextCreate" and method == "POST":
            return store.arm_create_failure(body)
        if rest == "faults:errorBurst" and method == "POST":
            return store.arm_error_burst(body)
        if rest == "iam:denyPermission" and method == "POST":
            with store.lock:
                permission = str(body.get("permission") or "")
                if body.get("allow"):
                    store.denied_permissions.discard(permission)
                elif permission:
                    store.denied_permissions.add(permission)
                return {"deniedPermissions": sorted(store.denied_permissions)}
        if rest == "registry":
            if self.registry is None:
                raise ApiFailure("FAILED_PRECONDITION", "This simulated pod has no registry "
                                 "(docker-registry is not installed, or it runs without workers).")
            return self.registry.admin(method, body)
        if rest == "osLogin":
            return self.oslogin.admin(method, {**query, **body})
        machines = self.machines
        if rest.startswith("projects/") and ":" in rest and method == "POST":
            name, verb = rest.rsplit(":", 1)
            name = self._backing_name(name)
            action = {"preempt": lambda: machines.preempt(name, float(body.get("noticeSeconds")
                                                                      or 0)),
                      "setReachable": lambda: machines.set_reachable(name, body),
                      "killSshd": lambda: machines.kill_sshd(name, body),
                      "setSlow": lambda: machines.set_slow(name, body),
                      "scheduleMaintenance": lambda: self.guest.schedule_maintenance(
                          name, body),
                      "endRun": lambda: self.compute.end_run(name)}.get(verb)
            if action:
                return action()
        if rest.startswith("projects/") and method == "GET":
            return machines.admin_view(self._backing_name(rest))
        raise ApiFailure("NOT_FOUND", f"No admin endpoint {method} /sim/v1/{rest}.")

    def _backing_name(self, name: str) -> str:
        """``.../nodes/N`` of no TPU API node: the Compute Engine instance or MIG called N
        (its backing node), so `tpufab sim preempt N` and the other faults reach a TPU VM
        on either plane."""
        store = self.store
        with store.lock:
            if name in store.nodes or "/nodes/" not in name:
                return name
            for kind in ("ceInstances", "ceGroups"):
                other = name.replace("/nodes/", f"/{kind}/", 1)
                if other in store.nodes:
                    return other
            return name

    def health(self) -> dict[str, Any]:
        store = self.store
        with store.lock:
            return {"ok": True, "pid": os.getpid(), "stateDir": str(store.state_dir),
                    "resuming": self.machines.resuming,
                    "uptime": round(time.time() - self.started, 3), "nodes": len(store.nodes)}

    def describe(self) -> dict[str, Any]:
        store = self.store
        with store.lock:
            nodes = [{"name": n, "id": r["node"]["id"], "state": r["node"]["state"],
                      "acceleratorType": r["node"]["acceleratorType"],
                      "workers": [e["ipAddress"] for e in r["node"]["networkEndpoints"]],
                      **bastion_of(r["node"])}
                     for n, r in store.nodes.items()]
            qrs = [{"name": n, "state": r["qr"]["state"]["state"],
                    "nodes": [p["name"] for p in r["sim"]["plan"]]}
                   for n, r in store.queued_resources.items()]
            return {"nodes": nodes, "queuedResources": qrs,
                    "settings": store.settings.as_json()}

    # ------------------------------------------------------------------ lifecycle

    def resume(self) -> None:
        """After a restart: relaunch workers of READY nodes, finish interrupted operations."""
        store, machines = self.store, self.machines
        with store.lock:
            owned = set()
            for name, record in store.nodes.items():
                machines.reclaim_slot(name, record)
                state = record["node"]["state"]
                owned.add(record["sim"].get("op"))
                if state == "READY":
                    machines.resuming += 1
                    store.spawn(machines.restart_workers, name)
                    for worker in record["sim"].get("recreating") or {}:  # cut short by the
                        store.spawn(self.backing.finish_recreate, name,  # restart: again
                                    record["node"]["id"], int(worker))
                    for worker in record["sim"].get("resetting") or {}:
                        store.spawn(self.backing.finish_recreate, name, record["node"]["id"],
                                    int(worker), False)
                elif state in BRING_UP_STATES:
                    store.spawn(machines.bring_up, name, 0.0)
                elif state == "STOPPING":
                    store.spawn(machines.finish_stop, name)
                elif state == "DELETING" and not record["node"].get("queuedResource"):
                    store.spawn(machines.finish_delete, name)
            for name, record in store.queued_resources.items():
                state = record["qr"]["state"]["state"]
                owned.add(record["sim"].get("op"))
                if state == "WAITING_FOR_RESOURCES":
                    store.spawn(self.queued.provision, name, 0.0)
                elif state == "DELETING":
                    store.spawn(self.queued.finish_delete, name)
                elif state == "SUSPENDING":
                    store.spawn(self.queued.finish_reset, name)
            owned |= self.legacy.resume()
            for name, op in store.operations.items():  # updates in flight
                if op.get("done") or name in owned:
                    continue
                target = op["metadata"].get("target", "")
                record = store.nodes.get(target)
                if record is None:
                    store.finish_operation(name, error=(5, f"Resource '{target}' was not "
                                                        "found"))
                else:
                    store.finish_operation(name, response=record["node"])
            store.save()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop background work and every worker; the state file keeps the nodes."""
        store = self.store
        store.join(timeout)
        try:
            if store.metadata is not None:
                store.metadata.shutdown()
            store.workers.stop_all()
            if store.network is not None:
                store.network.close()
        finally:
            with store.lock:
                store.save()


# ---------------------------------------------------------------------- HTTP


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "tpufab-sim/1"
    server: _Server

    def do_GET(self) -> None:
        self._serve()

    def do_POST(self) -> None:
        self._serve()

    def do_PATCH(self) -> None:
        self._serve()

    def do_DELETE(self) -> None:
        self._serve()

    def do_PUT(self) -> None:
        self._serve()

    def _read_body(self) -> bytes:
        if "chunked" in (self.headers.get("Transfer-Encoding") or "").lower():
            chunks = []
            while True:
                size = int(self.rfile.readline().strip().split(b";")[0] or b"0", 16)
                if size == 0:
                    self.rfile.readline()
                    return b"".join(chunks)
                chunks.append(self.rfile.read(size))
                self.rfile.readline()
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length else b""

    def _serve(self) -> None:
        started = time.monotonic()
        split = urlsplit(self.path)
        query = {k: v[-1] for k, v in parse_qs(split.query, keep_blank_values=True).items()}
        raw = self._read_body()
        if split.path.startswith("/batch/") and self.command == "POST":
            code, kind, data = self.server.emulator.handle_batch(
                raw, self.headers.get("Content-Type") or "", self.headers.get("Authorization"))
            self._send(code, kind, data, started)
            return
        try:
            body = json.loads(raw) if raw.strip() else None
        except ValueError:
            failure = ApiFailure("INVALID_ARGUMENT", "The request body is not valid JSON.")
            code, payload = failure.http_code, failure.body()
        else:
            code, payload = self.server.emulator.handle(self.command, split.path, query, body,
                                                        self.headers.get("Authorization"))
        self._send(code, "application/json; charset=UTF-8", json.dumps(payload).encode(),
                   started)

    def _send(self, code: int, kind: str, data: bytes, started: float) -> None:
        self.send_response(code)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
        log.info("%s %s -> %d (%.0f ms)", self.command, self.path, code,
                 (time.monotonic() - started) * 1000)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib signature
        log.debug(format, *args)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, address: tuple[str, int], emulator: Emulator):
        self.emulator = emulator
        super().__init__(address, _Handler)


def make_server(emulator: Emulator, port: int = 0, host: str = "127.0.0.1") -> _Server:
    """An HTTP server for the emulator on host:port (port 0 = any free port)."""
    server = _Server((host, port), emulator)
    emulator.base_url = f"http://{host}:{server.server_address[1]}"
    return server
