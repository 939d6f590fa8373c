"""Cloud TPU API v2 over HTTP on 127.0.0.1, backed by real workers.

`Emulator.handle()` answers one request (method, path, query, JSON body) with a status and a
JSON body; `make_server()` puts it behind a stdlib ThreadingHTTPServer. Nodes, queued
resources and operations live in `<state_dir>/api-state.json`; workers are started, stopped
and keyed through an injected pool (`tpufab.sim.workers.WorkerPool`, or `PaperWorkers` for
the API alone). Fault injection lives under `/sim/v1/`. See docs/simulated-pod.md.
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
from tpufab.sim._model import (
    CONFIG_TYPE_OF_GENERATION,
    TPU_PCI_DEVICE,
    UPDATABLE_FIELDS,
    ApiFailure,
    accelerator_type_of,
    check_id,
    new_node_id,
    new_operation_id,
    normalize_node_input,
    not_found,
    operation_view,
    page,
    quota_message,
    rfc3339,
    split_name,
    stockout_message,
    topology_string,
    version_view,
    worker_address,
    worker_hostname,
)
from tpufab.sim._slots import WORKERS_PER_SLOT, SlotRegistry, node_slots, slots_for
from tpufab.sim.compute_api import ComputeEngine
from tpufab.sim.guest import GuestEnvironment, Tokens
from tpufab.sim.legacy import LegacyNodes
from tpufab.sim.oslogin import OsLoginService
from tpufab.sim.queued import QueuedResources
from tpufab.topology import Topology, parse_accelerator_type

log = logging.getLogger("tpufab.sim")

STATE_FILE = "api-state.json"
BRING_UP_STATES = ("CREATING", "STARTING", "RESTARTING")
OUTPUT_ONLY_NODE_FIELDS = ("name", "id", "state", "health", "healthDescription", "createTime",
                           "networkEndpoints", "apiVersion", "symptoms", "queuedResource",
                           "multisliceNode")
TYPE_PREFIX = "type.googleapis.com/"


def behind_compute_engine(name: str) -> bool:
    """Whether ``name`` is the record behind Compute Engine VMs (``.../ceInstances/N``,
    ``.../ceGroups/N``): not a node of the Cloud TPU API, whose lists never show it (nor the
    operations on it: a TPU7x record's acceleratorConfig is no enum the TPU API has)."""
    parts = name.split("/")
    return len(parts) > 4 and parts[4] in ("ceInstances", "ceGroups")

class Workers(Protocol):
    """What the emulator needs from a worker pool (tpufab.sim.workers.WorkerPool)."""

    def start_node(self, node_id: str, specs: Any, ssh_keys: str, *,
                   delay: float = 0.0) -> None: ...
    def wait_listening(self, node_id: str, timeout: float = 30.0) -> None: ...
    def stop_node(self, node_id: str) -> None: ...
    def delete_node(self, node_id: str) -> None: ...
    def sync_keys(self, node_id: str, ssh_keys: str) -> None: ...
    def remove_worker(self, node_id: str, index: int) -> None: ...
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


class Emulator:
    def __init__(self, state_dir: Path, workers: Workers, *,
                 settings: SimSettings | None = None,
                 spec_factory: Callable[..., Any] | None = None):
        self.state_dir = Path(state_dir)
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.workers = workers
        self.settings = settings or SimSettings()
        self._spec_factory = spec_factory or getattr(workers, "spec_factory", None)
        self._lock = threading.RLock()
        self._stopping = threading.Event()
        self._threads: set[threading.Thread] = set()
        self._node_locks: dict[str, threading.Lock] = {}
        self._create_failures: list[dict[str, Any]] = []
        self._error_burst: dict[str, Any] | None = None
        self._resuming = 0
        self._path = self.state_dir / STATE_FILE
        self._slots = SlotRegistry(self.state_dir)
        self._last_slot: dict[str, int] = {}   # a deleted node's first slot, by its name
        self._state = self._load()
        self.started = time.time()
        self.tokens = Tokens(self.state_dir / "tokens.json")
        self.metadata: Any = None  # a tpufab.sim.metadata.MetadataServer when workers are real
        self.network: Any = None  # a tpufab.sim.network.NodeNetworks when workers are real
        self.guest = GuestEnvironment(self)  # metadata values, startup scripts, maintenance
        self.queued = QueuedResources(self)  # queued resources (and multislice)
        self.legacy = LegacyNodes(self)  # API v1 nodes: control plane only, no workers
        self.oslogin = OsLoginService(self)  # OS Login API, project metadata, roles
        self.compute = ComputeEngine(self)  # Compute Engine v1: TPU VM instances, MIGs
        self.base_url = ""  # http://127.0.0.1:PORT once served (Compute Engine selfLinks)

    # ------------------------------------------------------------------ persistence

    def _load(self) -> dict[str, Any]:
        empty: dict[str, Any] = {"version": 1, "nodes": {}, "queuedResources": {},
                                 "operations": {}}
        if not self._path.exists():
            return empty
        try:
            state = json.loads(self._path.read_text())
        except (OSError, ValueError) as exc:
            broken = self._path.with_suffix(f".broken-{int(time.time())}")
            self._path.rename(broken)
            log.error("state file %s unreadable (%s); kept it as %s", self._path, exc, broken)
            return empty
        for key, value in empty.items():
            state.setdefault(key, value)
        return state

    def _save(self) -> None:
        ops = self._state["operations"]
        if len(ops) > 1000:  # keep the newest finished operations
            done = [n for n, op in ops.items() if op.get("done")]
            for name in done[: len(ops) - 1000]:
                del ops[name]
        tmp = self._path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self._state, indent=1, sort_keys=True))
        os.replace(tmp, self._path)
        if self.metadata is not None:  # wakes metadata requests waiting for a change
            self.metadata.changed()

    # ------------------------------------------------------------------ request entry

    def handle(self, method: str, path: str, query: dict[str, str],
               body: Any, authorization: str | None = None) -> tuple[int, dict[str, Any]]:
        """Answer one request: (HTTP status, JSON body).

        No credentials are anonymous (as before); ``Bearer`` tokens must be ones a worker's
        metadata server issued and that have not expired.
        """
        try:
            path = unquote(path)
            self._check_credentials(authorization)
            if path.startswith("/sim/v1/"):
                return 200, self._admin(method, path[len("/sim/v1/"):], query, body or {})
            if path.startswith(("/v2/", "/v2alpha1/", "/v1/", "/compute/v1/")):
                self._maybe_inject_error(path)
            if path.startswith("/compute/v1/"):
                if body is not None and not isinstance(body, dict):
                    raise ApiFailure("INVALID_ARGUMENT", "The request body must be a JSON "
                                     "object.")
                try:
                    return 200, self.compute.handle(method, path[len("/compute/v1/"):], query,
                                                    body or {})
                except LookupError:  # the project itself
                    return 200, self._compute(method, path[len("/compute/v1/"):])
            if path.startswith("/v1/users/"):  # Cloud OS Login (oslogin.googleapis.com)
                if body is not None and not isinstance(body, dict):
                    raise ApiFailure("INVALID_ARGUMENT", "The request body must be a JSON "
                                     "object.")
                return 200, self.oslogin.handle(method, path[len("/v1/users/"):], query,
                                                body or {})
            if path.startswith("/v1/") and path.count("/") > 5:  # legacy TPU Nodes
                if body is not None and not isinstance(body, dict):
                    raise ApiFailure("INVALID_ARGUMENT", "The request body must be a JSON "
                                     "object.")
                return 200, self.legacy.handle(method, path[len("/v1/"):], query, body or {})
            for version in ("v2", "v2alpha1", "v1"):  # v1: locations only (gcloud locations)
                if path.startswith(f"/{version}/"):
                    if body is not None and not isinstance(body, dict):
                        raise ApiFailure("INVALID_ARGUMENT", "The request body must be a JSON "
                                         "object.")
                    rest = path[len(version) + 2:]
                    return 200, self._api(method, version, rest, query, body or {})
            raise ApiFailure("NOT_FOUND", f"The requested URL {path} was not found on this "
                             "server.")
        except ApiFailure as failure:
            return failure.http_code, failure.body()
        except Exception as exc:  # a bug in the emulator: say so, keep serving
            log.exception("internal error on %s %s", method, path)
            failure = ApiFailure("INTERNAL", f"Internal error in the TPU emulator: {exc!r}")
            return failure.http_code, failure.body()

    def _compute(self, method: str, rest: str) -> dict[str, Any]:
        """The Compute API's project (gcloud reads commonInstanceMetadata: enable-oslogin)."""
        answer = catalog.compute(method, rest)
        if answer.get("kind") == "compute#project":
            items = self.oslogin.project_metadata(answer["name"])
            answer["commonInstanceMetadata"]["items"] = [{"key": k, "value": v}
                                                         for k, v in sorted(items.items())]
        return answer

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
        with self._lock:
            burst = self._error_burst
            if not burst or burst["count"] <= 0:
                return
            if burst.get("match") and burst["match"] not in path:
                return
            burst["count"] -= 1
            if burst["count"] <= 0:
                self._error_burst = None
        if burst["code"] == 429:
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
            return catalog.list_locations(project, query)
        zone = parts[3]
        parent = f"projects/{project}/locations/{zone}"
        if len(parts) == 4:
            if verb is None and method == "GET":
                return catalog.location(project, zone)
            if verb == "generateServiceIdentity" and method == "POST":
                return {"identity": {"email": "service-0@cloud-tpu.iam.gserviceaccount.com"}}
        elif len(parts) == 5:
            collection = parts[4]
            handler = {
                ("GET", "nodes"): lambda: self._list_nodes(parent, query, version),
                ("POST", "nodes"): lambda: self._create_node(version, parent, query, body),
                ("GET", "acceleratorTypes"): lambda: catalog.list_accelerator_types(parent,
                                                                                  query),
                ("GET", "runtimeVersions"): lambda: catalog.list_runtime_versions(parent, query),
                ("GET", "queuedResources"): lambda: self.queued.list(parent, query, version),
                ("POST", "queuedResources"): lambda: self.queued.create(version, parent, query,
                                                                     body),
                ("GET", "operations"): lambda: self._list_operations(parent, query, version),
            }.get((method, collection))
            if handler and verb is None:
                return handler()
        elif len(parts) == 6 and parts[5]:
            collection = parts[4]
            name = f"{parent}/{collection}/{parts[5]}"
            handler = {
                ("GET", "nodes", None): lambda: self.legacy.v2_view(name) or
                    version_view(self._node(name)["node"], "Node", version),
                ("DELETE", "nodes", None): lambda: self.legacy.delete(name, version)
                    if self.legacy.v2_view(name) else self._delete_node(version, name),
                ("PATCH", "nodes", None): lambda: self._update_node(version, name, query, body),
                ("POST", "nodes", "stop"): lambda: self._stop_node(version, name),
                ("POST", "nodes", "start"): lambda: self._start_node(version, name),
                ("POST", "nodes", "getGuestAttributes"): lambda: self._guest_attributes(name,
                                                                                         body),
                ("POST", "nodes", "simulateMaintenanceEvent"):
                    lambda: self.guest.simulate_maintenance(version, name, body),
                ("POST", "nodes", "performMaintenance"):  # v2alpha1 only, as the API
                    lambda: self.guest.perform_maintenance(version, name)
                    if version == "v2alpha1" else self._not_in(version, method, rest),
                ("GET", "acceleratorTypes", None): lambda: catalog.accelerator_type(name),
                ("GET", "runtimeVersions", None): lambda: catalog.runtime_version(name),
                ("GET", "queuedResources", None): lambda: version_view(
                    self.queued.get(name)["qr"], "QueuedResource", version),
                ("DELETE", "queuedResources", None): lambda: self.queued.delete(version, name,
                                                                             query),
                ("POST", "queuedResources", "reset"): lambda: self.queued.reset(version, name),
                ("POST", "queuedResources", "performMaintenanceQueuedResource"):  # v2alpha1
                    lambda: self.guest.perform_maintenance_queued(version, name, body)
                    if version == "v2alpha1" else self._not_in(version, method, rest),
                ("GET", "operations", None): lambda: operation_view(self._operation(name),
                                                                    version),
                ("DELETE", "operations", None): lambda: self._delete_operation(name),
                ("POST", "operations", "cancel"): lambda: self._cancel_operation(name),
            }.get((method, collection, verb))
            if handler:
                return handler()
        self._not_in(version, method, rest)

    @staticmethod
    def _not_in(version: str, method: str, rest: str) -> dict[str, Any]:
        raise ApiFailure("NOT_FOUND", f"Method {method} /{version}/{rest} is not part of the "
                         "Cloud TPU API (or not emulated).")

    # ------------------------------------------------------------------ operations

    def _new_operation(self, version: str, target: str, verb: str) -> dict[str, Any]:
        project, zone, _, _ = split_name(target)
        name = f"projects/{project}/locations/{zone}/operations/{new_operation_id()}"
        op = {
            "name": name,
            "metadata": {
                "@type": f"{TYPE_PREFIX}google.cloud.tpu.{version}.OperationMetadata",
                "createTime": rfc3339(),
                "target": target,
                "verb": verb,
                "cancelRequested": False,
                "apiVersion": version,
            },
            "done": False,
        }
        self._state["operations"][name] = op
        return op

    def _finish_operation(self, name: str | None, *, response: dict[str, Any] | None = None,
                          response_type: str = "Node",
                          error: tuple[int, str] | None = None) -> None:
        """Mark an operation done (caller holds the lock and saves)."""
        op = self._state["operations"].get(name or "")
        if op is None or op.get("done"):
            return
        version = op["metadata"].get("apiVersion", "v2")
        op["done"] = True
        op["metadata"]["endTime"] = rfc3339()
        if error is not None:
            op["error"] = {"code": error[0], "message": error[1]}
        elif response_type == "Empty":
            op["response"] = {"@type": f"{TYPE_PREFIX}google.protobuf.Empty"}
        else:
            op["response"] = {"@type": f"{TYPE_PREFIX}google.cloud.tpu.{version}.{response_type}",
                              **(response or {})}

    def _operation(self, name: str) -> dict[str, Any]:
        with self._lock:
            op = self._state["operations"].get(name)
            if op is None:
                raise not_found(name)
            return json.loads(json.dumps(op))

    def _list_operations(self, parent: str, query: dict[str, str],
                         version: str = "v2") -> dict[str, Any]:
        with self._lock:
            ops = [operation_view(op, version) for n, op in self._state["operations"].items()
                   if n.startswith(parent + "/")
                   and not behind_compute_engine(op["metadata"].get("target", ""))]
            items, token = page(json.loads(json.dumps(ops)), query)
        out: dict[str, Any] = {"operations": items}
        if token:
            out["nextPageToken"] = token
        return out

    def _delete_operation(self, name: str) -> dict[str, Any]:
        with self._lock:
            if self._state["operations"].pop(name, None) is None:
                raise not_found(name)
            self._save()
        return {}

    def _cancel_operation(self, name: str) -> dict[str, Any]:
        with self._lock:
            op = self._state["operations"].get(name)
            if op is None:
                raise not_found(name)
            op["metadata"]["cancelRequested"] = True  # like the real API: best effort, ignored
            self._save()
        return {}

    # ------------------------------------------------------------------ nodes: reads

    def _node(self, name: str) -> dict[str, Any]:
        with self._lock:
            record = self._state["nodes"].get(name)
            if record is None:
                raise not_found(name)
            return json.loads(json.dumps(record))

    def _list_nodes(self, parent: str, query: dict[str, str],
                    version: str = "v2") -> dict[str, Any]:
        prefix = parent + "/nodes/"
        if parent.endswith("/locations/-"):  # every zone of the project
            prefix = parent[:-1]
        with self._lock:
            nodes = [version_view(json.loads(json.dumps(r["node"])), "Node", version)
                     for n, r in self._state["nodes"].items() if n.startswith(prefix)
                     and n.split("/")[4] == "nodes"]  # not Compute Engine VMs' records
        nodes += self.legacy.v2_list(prefix)  # nodes the v1 API made (apiVersion V1)
        items, token = page(nodes, query)
        out: dict[str, Any] = {"nodes": items}
        if token:
            out["nextPageToken"] = token
        return out

    def _guest_attributes(self, name: str, body: dict[str, Any]) -> dict[str, Any]:
        record = self._node(name)
        node = record["node"]
        hosts = len(node.get("networkEndpoints") or [])
        wanted = [w for w in (body.get("workerIds") or body.get("worker_ids") or [])
                  if str(w) != ""]
        try:
            workers = [int(w) for w in wanted] if wanted else list(range(hosts))
        except ValueError:
            raise ApiFailure("INVALID_ARGUMENT", f"Invalid worker ids {wanted}.") from None
        bad = [w for w in workers if not 0 <= w < hosts]
        if bad:
            raise ApiFailure("INVALID_ARGUMENT",
                             f"Worker id {bad[0]} is out of range; node {name} has workers "
                             f"0..{hosts - 1}.")
        query_path = str(body.get("queryPath") or body.get("query_path") or "")
        host_keys = record["sim"].get("hostKeys") or {}
        out = []
        for w in workers:
            items = []
            key = host_keys.get(str(w))
            if key:
                key_type, _, blob = key.partition(" ")
                items.append({"namespace": "hostkeys", "key": key_type,
                              "value": blob.split()[0] if blob else ""})
            items.append({"namespace": "", "key": "hostname",
                          "value": worker_hostname(node["id"], w)})
            startup = (record["sim"].get("startup") or {}).get(str(w))
            if startup is not None:  # the boot's startup-script: running, its exit code, or why not
                if "exitCode" in startup:
                    status = f"exit {startup['exitCode']}"
                elif "error" in startup:
                    status = f"error: {startup['error']}"
                elif startup.get("ran") is False:
                    status = "none"
                else:
                    status = "running"
                items.append({"namespace": "startup-script", "key": "status", "value": status})
            items = [i for i in items
                     if f"{i['namespace']}/{i['key']}".startswith(query_path)
                     or (i["namespace"] + "/").startswith(query_path)]
            out.append({"queryPath": query_path, "queryValue": {"items": items}})
        return {"guestAttributes": out}

    # ------------------------------------------------------------------ nodes: writes

    def _create_node(self, version: str, parent: str, query: dict[str, str],
                     body: dict[str, Any]) -> dict[str, Any]:
        node_id = check_id("node", query.get("nodeId") or query.get("node_id"))
        node_in = normalize_node_input(body)
        name = f"{parent}/nodes/{node_id}"
        with self._lock:
            if name in self._state["nodes"]:
                raise ApiFailure("ALREADY_EXISTS", f"Resource '{name}' already exists")
            self._check_capacity([self._validate_node(name, node_in)])
            topo, node = self._new_node(name, node_in, version)
            failure = self._take_create_failure(name, topo)
            op = self._new_operation(version, name, "create")
            self._state["nodes"][name] = {"node": node, "sim": self._sim_fields(
                node, op["name"], failure)}
            self._save()
            op = json.loads(json.dumps(op))
        self._spawn(self._bring_up, name, self.settings.create_delay)
        return op

    def _sim_fields(self, node: dict[str, Any], op_name: str | None,
                    failure: str | None) -> dict[str, Any]:
        return {"slot": self._slot_of(node), "op": op_name, "failure": failure,
                "hostKeys": {}}

    @staticmethod
    def _slot_of(node: dict[str, Any]) -> int:
        parts = node["networkEndpoints"][0]["ipAddress"].split(".")
        return (int(parts[1]) - 16) * 256 + int(parts[2])

    @staticmethod
    def _validate_node(name: str, node_in: dict[str, Any]) -> Topology:
        zone = split_name(name)[1]
        topo = accelerator_type_of(node_in, zone)
        if not node_in.get("runtimeVersion"):
            raise ApiFailure("INVALID_ARGUMENT",
                             f"runtimeVersion is required (for {topo.name} the usual one is "
                             f"{topo.default_runtime}).")
        for key in ("metadata", "labels"):
            value = node_in.get(key)
            if value is not None and (not isinstance(value, dict) or
                                      not all(isinstance(v, str) for v in value.values())):
                raise ApiFailure("INVALID_ARGUMENT", f"Node {key} must map strings to strings.")
        return topo

    def _new_node(self, name: str, node_in: dict[str, Any], version: str,
                  topo: Topology | None = None) -> tuple[Topology, dict[str, Any]]:
        """Validate a requested node and build its API record (caller holds the lock);
        ``topo`` given: a Compute Engine VM's backing record, already validated."""
        project, zone, _, _ = split_name(name)
        topo = topo or self._validate_node(name, node_in)
        runtime = node_in["runtimeVersion"]
        slot = self._slots.claim(self._used_slots(), slots_for(topo.hosts),
                                 prefer=self._last_slot.get(name))
        node_id = new_node_id()
        node = {k: v for k, v in node_in.items() if k not in OUTPUT_ONLY_NODE_FIELDS}
        region = zone.rsplit("-", 1)[0]
        network = dict(node.get("networkConfig") or {})
        # proto3 JSON leaves a false bool out: a networkConfig without enableExternalIps asks
        # for none (the official client's --internal-ips); no networkConfig at all gets them.
        network["enableExternalIps"] = bool(network.get("enableExternalIps",
                                                        "networkConfig" not in node))
        network.setdefault("network", f"projects/{project}/global/networks/default")
        network.setdefault("subnetwork",
                           f"projects/{project}/regions/{region}/subnetworks/default")
        account = dict(node.get("serviceAccount") or {})
        account.setdefault("email", "default")
        account.setdefault("scope", ["https://www.googleapis.com/auth/cloud-platform"])
        node.update({
            "name": name,
            "id": node_id,
            "acceleratorType": topo.name,
            "runtimeVersion": runtime,
            "state": "CREATING",
            "createTime": rfc3339(),
            "apiVersion": "V2" if version == "v2" else "V2_ALPHA1",
            "networkConfig": network,
            "serviceAccount": account,
            "schedulingConfig": dict(node.get("schedulingConfig") or {}),
            "cidrBlock": node.get("cidrBlock") or "10.128.0.0/20",
            "networkEndpoints": self._endpoints(slot, topo.hosts,
                                                external=network["enableExternalIps"]),
            "metadata": dict(node.get("metadata") or {}),
        })
        topology = topology_string(topo) if topo.generation in CONFIG_TYPE_OF_GENERATION \
            else None
        if topology and "acceleratorConfig" not in node_in:
            node["acceleratorConfig"] = {"type": CONFIG_TYPE_OF_GENERATION[topo.generation],
                                         "topology": topology}
        return topo, node

    @staticmethod
    def _endpoints(slot: int, hosts: int, external: bool = True) -> list[dict[str, Any]]:
        return [{"ipAddress": worker_address(slot, w), "port": 22,
                 **({"accessConfig": {"externalIp": worker_address(slot, w)}} if external else {})}
                for w in range(hosts)]

    def _check_capacity(self, topos: list[Topology]) -> None:
        """Refuse, before anything starts, workers this machine cannot hold."""
        hosts = sum(t.hosts for t in topos)
        names = sorted({t.name for t in topos})
        what = names[0] if len(topos) == 1 else \
            f"{len(topos)} slices of {' and '.join(names)}"
        problem = self.workers.capacity_problem(what, hosts)
        if problem:
            raise ApiFailure("FAILED_PRECONDITION", problem)

    def _used_slots(self) -> set[int]:
        """Every slot this pod's nodes cover (caller holds the lock)."""
        return {s for r in self._state["nodes"].values() for s in node_slots(r)}

    def _forget_node(self, name: str) -> dict[str, Any] | None:
        """Drop a node's record and free its slots (caller holds the lock)."""
        record = self._state["nodes"].pop(name, None)
        if record is not None:
            span = node_slots(record)
            self._slots.release(span.start, len(span))
            self._last_slot[name] = span.start
        return record

    def _take_create_failure(self, name: str, topo: Topology) -> str | None:
        """The error a create will end with, if a fault is armed or quota is exceeded."""
        project, zone, _, _ = split_name(name)
        failure = None
        fault = next((f for f in self._create_failures if f.get("zone") in (None, zone)
                      and not f.get("vms")), None)
        if fault is not None:  # the first armed fault for this zone (or for every zone)
            fault["count"] -= 1
            if fault["count"] <= 0:
                self._create_failures.remove(fault)
            if fault["reason"] == "quota":
                failure = quota_message(topo, zone, self.settings.quota_chips or 0)
            else:
                failure = stockout_message(zone)
            if fault.get("immediate"):
                raise ApiFailure("RESOURCE_EXHAUSTED", failure)
        limit = self.settings.quota_chips
        if failure is None and limit is not None:
            prefix = f"projects/{project}/locations/{zone}/nodes/"
            used = 0
            for other_name, other in self._state["nodes"].items():
                if other_name.startswith(prefix):
                    other_topo = parse_accelerator_type(other["node"]["acceleratorType"])
                    if other_topo.generation == topo.generation:
                        used += other_topo.chips
            if used + topo.chips > limit:
                failure = quota_message(topo, zone, limit)
        return failure

    def _bring_up(self, name: str, delay: float) -> None:
        """CREATING/STARTING -> workers launched and listening -> READY (or the op fails)."""
        if self._stopping.wait(delay):
            return
        with self._lock:
            record = self._state["nodes"].get(name)
            if record is None or record["node"]["state"] not in BRING_UP_STATES:
                return
            failure = record["sim"].pop("failure", None)
            if failure:
                self._finish_operation(record["sim"].get("op"), error=(8, failure))
                self._forget_node(name)
                self.queued.refresh(record["node"].get("queuedResource"))
                self._save()
                return
            node_id = record["node"]["id"]
            specs = self._specs(record["node"])
            keys = self.oslogin.login_keys(record)
            snapshot = json.loads(json.dumps(record))
        try:
            with self._node_lock(node_id):
                with self._lock:  # a delete or preempt may have come first
                    current = self._state["nodes"].get(name)
                    if current is None or current["node"]["id"] != node_id or \
                            current["node"]["state"] not in BRING_UP_STATES:
                        return
                self.oslogin.apply(snapshot)  # before sshd starts: its config depends on it
                self.workers.start_node(node_id, specs, keys,
                                        delay=self.settings.worker_start_delay)
                self.guest.open_metadata(node_id, specs)
                self.workers.wait_listening(node_id, timeout=self.settings.listen_timeout)
                self._start_bastion(name, specs, snapshot)
                host_keys = self.workers.host_keys(node_id)
                for _ in range(5):  # metadata may have changed while the workers started
                    with self._lock:
                        current = self.oslogin.login_keys(self._state["nodes"].get(name,
                                                                                   record))
                    if current == keys:
                        break
                    self.workers.sync_keys(node_id, current)
                    keys = current
        except Exception as exc:
            if self._stopping.is_set():
                return  # the daemon is going down; resume() finishes this next time
            log.exception("workers of %s did not start", name)
            with self._lock:
                record = self._state["nodes"].get(name)
                if record is None or record["node"]["id"] != node_id or \
                        record["node"]["state"] not in BRING_UP_STATES:
                    return
                record["node"]["state"] = "UNKNOWN"
                record["node"]["health"] = "TIMEOUT"
                record["node"]["healthDescription"] = f"The simulated workers did not start: {exc}"
                self._finish_operation(record["sim"].pop("op", None), error=(
                    13, f"The simulated workers of {name} did not start: {exc}"))
                self._save()
            return
        with self._lock:
            record = self._state["nodes"].get(name)
            if record is None or record["node"]["id"] != node_id or \
                    record["node"]["state"] not in BRING_UP_STATES:
                return  # deleted or changed meanwhile; that operation owns the workers now
            record["sim"]["hostKeys"] = {str(i): k for i, k in host_keys.items()}
            record["sim"].pop("notices", None)  # a new boot: no notice pending
            record["node"]["state"] = "READY"
            record["node"]["health"] = "HEALTHY"
            record["node"].pop("healthDescription", None)
            self._finish_operation(record["sim"].pop("op", None),
                                   response=record["node"])
            self.queued.refresh(record["node"].get("queuedResource"))
            self._save()
        self.guest.booted(name, node_id, specs)

    def _specs(self, node: dict[str, Any]) -> list[Any]:
        factory = self._spec_factory
        if factory is None:
            from tpufab.sim.workers import WorkerSpec

            factory = self._spec_factory = WorkerSpec
        topo = parse_accelerator_type(node["acceleratorType"])
        names = node.get("instanceNames") or []  # a Compute Engine VM: its instance name
        specs = [factory(node_id=node["id"], index=w, ip=e["ipAddress"],
                         hostname=names[w] if w < len(names) else
                         worker_hostname(node["id"], w),
                         device_files=tuple(topo.device_files),
                         pci_device=TPU_PCI_DEVICE.get(topo.generation, ""))
                 for w, e in enumerate(node["networkEndpoints"])]
        return specs if self.network is None else self.network.place(node, specs)

    def _stop_node(self, version: str, name: str) -> dict[str, Any]:
        with self._lock:
            record = self._require_node(name)
            state = record["node"]["state"]
            if state != "READY":
                raise ApiFailure("FAILED_PRECONDITION",
                                 f"Node {name} is {state}; only a READY node can be stopped.")
            record["node"]["state"] = "STOPPING"
            op = self._new_operation(version, name, "stop")
            record["sim"]["op"] = op["name"]
            self._save()
            op = json.loads(json.dumps(op))
        self._spawn(self._finish_stop, name)
        return op

    def _finish_stop(self, name: str) -> None:
        if self._stopping.wait(self.settings.operation_delay):
            return
        with self._lock:
            record = self._state["nodes"].get(name)
            if record is None or record["node"]["state"] != "STOPPING":
                return
            node_id = record["node"]["id"]
        with self._node_lock(node_id):
            self.guest.close_metadata(node_id)
            self.workers.stop_node(node_id)
            self.network_down(node_id)
        with self._lock:
            record = self._state["nodes"].get(name)
            if record is None or record["node"]["state"] != "STOPPING":
                return
            record["node"]["state"] = "STOPPED"
            record["node"].pop("health", None)
            self._finish_operation(record["sim"].pop("op", None), response=record["node"])
            self._save()

    def _start_node(self, version: str, name: str) -> dict[str, Any]:
        with self._lock:
            record = self._require_node(name)
            state = record["node"]["state"]
            if state != "STOPPED":
                raise ApiFailure("FAILED_PRECONDITION",
                                 f"Node {name} is {state}; only a STOPPED node can be started.")
            record["node"]["state"] = "STARTING"
            op = self._new_operation(version, name, "start")
            record["sim"]["op"] = op["name"]
            self._save()
            op = json.loads(json.dumps(op))
        self._spawn(self._bring_up, name, self.settings.operation_delay)
        return op

    def _delete_node(self, version: str, name: str) -> dict[str, Any]:
        with self._lock:
            record = self._require_node(name)
            if record["node"]["state"] == "DELETING":
                raise ApiFailure("FAILED_PRECONDITION", f"Node {name} is already being deleted.")
            previous = record["sim"].get("op")
            self._finish_operation(previous, error=(10, f"Node {name} was deleted."))
            record["node"]["state"] = "DELETING"
            op = self._new_operation(version, name, "delete")
            record["sim"]["op"] = op["name"]
            self._save()
            op = json.loads(json.dumps(op))
        self._spawn(self._finish_delete, name)
        return op

    def tear_down(self, node_id: str) -> None:
        """What a deleted node leaves on this machine: its metadata servers, workers, network."""
        with self._node_lock(node_id):
            self.guest.close_metadata(node_id)
            self.workers.delete_node(node_id)
            self.network_down(node_id, delete=True)

    def _finish_delete(self, name: str) -> None:
        if self._stopping.wait(self.settings.operation_delay):
            return
        with self._lock:
            record = self._state["nodes"].get(name)
            if record is None or record["node"]["state"] != "DELETING":
                return
            node_id = record["node"]["id"]
        self.tear_down(node_id)
        with self._lock:
            record = self._forget_node(name)
            if record is None:
                return
            self._finish_operation(record["sim"].get("op"), response_type="Empty")
            self.queued.refresh(record["node"].get("queuedResource"))
            self._save()

    def _update_node(self, version: str, name: str, query: dict[str, str],
                     body: dict[str, Any]) -> dict[str, Any]:
        mask = query.get("updateMask") or query.get("update_mask") or ""
        paths = [p.strip() for p in mask.split(",") if p.strip()]
        if not paths:
            raise ApiFailure("INVALID_ARGUMENT", "updateMask is required; name the fields to "
                             "update, e.g. updateMask=metadata.")
        resolved = []
        for path in paths:
            field = UPDATABLE_FIELDS.get(path.replace("_", "").lower()) or \
                UPDATABLE_FIELDS.get(path.lower())
            if field is None:
                raise ApiFailure("INVALID_ARGUMENT",
                                 f"Field '{path}' cannot be updated; updatable fields: "
                                 "description, metadata, labels, tags, data_disks, "
                                 "network_config.enable_external_ips, scheduling_config, "
                                 "shielded_instance_config.")
            resolved.append(field)
        node_in = normalize_node_input(body)
        with self._lock:
            record = self._require_node(name)
            node = record["node"]
            if node["state"] == "DELETING":
                raise ApiFailure("FAILED_PRECONDITION", f"Node {name} is being deleted.")
            for field in resolved:
                head, _, tail = field.partition(".")
                if tail:
                    sub = dict(node.get(head) or {})
                    value = (node_in.get(head) or {}).get(tail)
                    if value is None:
                        sub.pop(tail, None)
                    else:
                        sub[tail] = value
                    node[head] = sub
                elif node_in.get(head) is None:
                    node.pop(head, None)
                else:
                    node[head] = node_in[head]
            op = self._new_operation(version, name, "update")
            self._save()
            op = json.loads(json.dumps(op))
        self._spawn(self._finish_update, name, op["name"], "metadata" in resolved)
        return op

    def _finish_update(self, name: str, op_name: str, keys_changed: bool) -> None:
        if self._stopping.wait(self.settings.operation_delay):
            return
        with self._lock:
            record = self._state["nodes"].get(name)
            if record is None:
                self._finish_operation(op_name, error=(5, f"Resource '{name}' was not found"))
                self._save()
                return
            node_id = record["node"]["id"]
            ready = record["node"]["state"] == "READY"
            keys = self.oslogin.login_keys(record)
            snapshot = json.loads(json.dumps(record))
        if keys_changed and ready:
            with self._node_lock(node_id):
                self.oslogin.apply(snapshot)  # enable-oslogin may have changed
                self.workers.sync_keys(node_id, keys)
                if self.network is not None:
                    self.network.sync_keys(snapshot["node"], self.oslogin.bastion_keys(snapshot))
        with self._lock:
            record = self._state["nodes"].get(name)
            self._finish_operation(op_name, response=record["node"] if record else {})
            self._save()

    def _require_node(self, name: str) -> dict[str, Any]:
        record = self._state["nodes"].get(name)
        if record is None:
            raise not_found(name)
        return record

    # ------------------------------------------------------------------ Compute Engine VMs

    def create_backing_node(self, name: str, topo: Topology, *, metadata: dict[str, str],
                            labels: dict[str, str], scheduling: dict[str, Any],
                            external: bool, names: list[str],
                            accelerator_topology: str | None = None) -> str | None:
        """The node record behind Compute Engine VMs (sim/compute_api.py; caller holds the
        lock): workers brought up as for a TPU API node. Returns the error the create will
        end with (an injected stockout or quota), else None."""
        model = scheduling.get("provisioningModel")
        node_in = {"acceleratorType": topo.name, "runtimeVersion": "compute-engine-vm",
                   "metadata": dict(metadata), "labels": dict(labels),
                   "networkConfig": {"enableExternalIps": external},
                   "schedulingConfig": {"spot": True} if model == "SPOT" else {},
                   "instanceNames": list(names)}
        if not accelerator_topology and topo.generation not in CONFIG_TYPE_OF_GENERATION:
            from tpufab.topology import default_dims, format_dims

            accelerator_topology = format_dims(default_dims(topo))  # TPU7x: 2x2x1 ...
        if accelerator_topology:  # what the VMs' tpu-env says (TOPOLOGY, HOST_BOUNDS)
            node_in["acceleratorConfig"] = {"type": topo.generation.upper(),
                                            "topology": accelerator_topology}
        self._check_capacity([topo])
        _, node = self._new_node(name, node_in, "v2", topo=topo)
        failure = self._take_create_failure(name, topo)
        self._state["nodes"][name] = {"node": node, "sim": self._sim_fields(node, None,
                                                                             failure)}
        self._save()
        self._spawn(self._bring_up, name, self.settings.create_delay)
        return failure

    def delete_backing_node(self, name: str) -> None:
        """Delete a VM's backing node (caller holds the lock); gone once torn down."""
        record = self._state["nodes"].get(name)
        if record is None or record["node"]["state"] == "DELETING":
            return
        record["node"]["state"] = "DELETING"
        self._save()
        self._spawn(self._finish_delete, name)

    def stop_backing_node(self, name: str) -> None:
        record = self._require_node(name)
        if record["node"]["state"] != "READY":
            raise ApiFailure("FAILED_PRECONDITION", f"The instance is "
                             f"{record['node']['state']}; only a running one can be stopped.")
        record["node"]["state"] = "STOPPING"
        self._save()
        self._spawn(self._finish_stop, name)

    def start_backing_node(self, name: str) -> None:
        record = self._require_node(name)
        if record["node"]["state"] not in ("STOPPED", "PREEMPTED"):
            raise ApiFailure("FAILED_PRECONDITION", f"The instance is "
                             f"{record['node']['state']}; only a stopped one can be started.")
        record["node"]["state"] = "STARTING"
        self._save()
        self._spawn(self._bring_up, name, self.settings.operation_delay)

    def recreate_backing_worker(self, name: str, worker: int) -> None:
        """Recreate the VM that is worker ``worker`` of backing node ``name`` (a MIG's
        recreateInstances; caller holds the lock). It keeps its place in the slice (its worker
        number, what its metadata server's agent-worker-number and tpu-env say) and comes back
        from a new boot disk (a new host key) at another internal IP: a MIG VM without a
        stateful IP gets a new ephemeral one (Google's "Configuring stateful IP addresses in
        MIGs"). Here that is the next free address of the node's own slots."""
        record = self._require_node(name)
        if record["node"]["state"] != "READY":
            raise ApiFailure("FAILED_PRECONDITION", f"The instance is "
                             f"{record['node']['state']}; only a running one is recreated.")
        endpoints = record["node"]["networkEndpoints"]
        used = {e["ipAddress"] for e in endpoints}
        span = node_slots(record)
        fresh = next((worker_address(span.start, k)
                      for k in range(len(endpoints), len(span) * WORKERS_PER_SLOT)
                      if worker_address(span.start, k) not in used),
                     endpoints[worker]["ipAddress"])  # a full slot: the address it had
        endpoints[worker]["ipAddress"] = fresh
        if endpoints[worker].get("accessConfig"):
            endpoints[worker]["accessConfig"]["externalIp"] = fresh
        record["sim"].setdefault("recreating", {})[str(worker)] = True
        record["sim"].get("hostKeys", {}).pop(str(worker), None)
        self._save()
        self._spawn(self._recreate_worker, name, record["node"]["id"], worker)

    def _recreate_worker(self, name: str, node_id: str, worker: int) -> None:
        if self._stopping.wait(self.settings.operation_delay):
            return
        with self._lock:
            record = self._state["nodes"].get(name)
            if record is None or record["node"]["id"] != node_id:
                return
            specs = self._specs(record["node"])
            keys = self.oslogin.login_keys(record)
        try:
            with self._node_lock(node_id):
                self.workers.remove_worker(node_id, worker)
                self.workers.start_node(node_id, specs, keys,
                                        delay=self.settings.worker_start_delay)
                self.guest.open_metadata(node_id, specs)  # the worker's new address
                self.workers.wait_listening(node_id, timeout=self.settings.listen_timeout)
                host_keys = self.workers.host_keys(node_id)
        except Exception as exc:
            if self._stopping.is_set():
                return
            log.exception("worker %d of %s was not recreated", worker, name)
            with self._lock:
                record = self._state["nodes"].get(name)
                if record is not None and record["node"]["id"] == node_id:
                    record["node"]["state"] = "UNKNOWN"
                    record["node"]["healthDescription"] = (
                        f"The simulated worker {worker} was not recreated: {exc}")
                    self._save()
            return
        with self._lock:
            record = self._state["nodes"].get(name)
            if record is None or record["node"]["id"] != node_id:
                return
            record["sim"]["hostKeys"] = {str(i): k for i, k in host_keys.items()}
            record["sim"].get("recreating", {}).pop(str(worker), None)
            self._save()

    def set_backing_metadata(self, name: str, items: dict[str, str],
                             done: Callable[[], None]) -> None:
        """Replace a VM's metadata (caller holds the lock); ``done()`` once keys synced."""
        record = self._require_node(name)
        record["node"]["metadata"] = dict(items)
        self._save()

        def sync() -> None:
            self._finish_update(name, "", True)
            done()

        self._spawn(sync)

    # ------------------------------------------------------------------ admin (/sim/v1/)

    def _admin(self, method: str, rest: str, query: dict[str, str],
               body: dict[str, Any]) -> dict[str, Any]:
        if rest == "health" and method == "GET":
            return self.health()
        if rest == "state" and method == "GET":
            return self.describe()
        if rest == "settings":
            if method in ("PATCH", "POST"):
                with self._lock:
                    self.settings.update(body)
            return self.settings.as_json()
        if rest == "faults" and method == "GET":
            with self._lock:
                return {"createFailures": list(self._create_failures),
                        "errorBurst": self._error_burst}
        if rest == "faults" and method == "DELETE":
            with self._lock:
                self._create_failures.clear()
                self._error_burst = None
            return {}
        if rest == "faults:failNextCreate" and method == "POST":
            return self._arm_create_failure(body)
        if rest == "faults:errorBurst" and method == "POST":
            return self._arm_error_burst(body)
        if rest == "osLogin":
            return self.oslogin.admin(method, {**query, **body})
        if rest.startswith("projects/") and ":" in rest and method == "POST":
            name, verb = rest.rsplit(":", 1)
            name = self._backing_name(name)
            action = {"preempt": lambda: self.preempt(name, float(body.get("noticeSeconds")
                                                                    or 0)),
                      "setReachable": lambda: self._set_reachable(name, body),
                      "killSshd": lambda: self._kill_sshd(name, body),
                      "setSlow": lambda: self._set_slow(name, body),
                      "scheduleMaintenance": lambda: self.guest.schedule_maintenance(
                          name, body),
                      "endRun": lambda: self.compute.end_run(name)}.get(verb)
            if action:
                return action()
        if rest.startswith("projects/") and method == "GET":
            return self._admin_node(self._backing_name(rest))
        raise ApiFailure("NOT_FOUND", f"No admin endpoint {method} /sim/v1/{rest}.")

    def _backing_name(self, name: str) -> str:
        """``.../nodes/N`` of no TPU API node: the Compute Engine instance or MIG called N
        (its backing node), so `tpufab sim preempt N` and the other faults reach a TPU VM
        on either plane."""
        with self._lock:
            if name in self._state["nodes"] or "/nodes/" not in name:
                return name
            for kind in ("ceInstances", "ceGroups"):
                other = name.replace("/nodes/", f"/{kind}/", 1)
                if other in self._state["nodes"]:
                    return other
            return name

    def health(self) -> dict[str, Any]:
        with self._lock:
            return {"ok": True, "pid": os.getpid(), "stateDir": str(self.state_dir),
                    "resuming": self._resuming, "uptime": round(time.time() - self.started, 3),
                    "nodes": len(self._state["nodes"])}

    def describe(self) -> dict[str, Any]:
        with self._lock:
            nodes = [{"name": n, "id": r["node"]["id"], "state": r["node"]["state"],
                      "acceleratorType": r["node"]["acceleratorType"],
                      "workers": [e["ipAddress"] for e in r["node"]["networkEndpoints"]],
                      **self._bastion_of(r["node"])}
                     for n, r in self._state["nodes"].items()]
            qrs = [{"name": n, "state": r["qr"]["state"]["state"],
                    "nodes": [p["name"] for p in r["sim"]["plan"]]}
                   for n, r in self._state["queuedResources"].items()]
            return {"nodes": nodes, "queuedResources": qrs,
                    "settings": self.settings.as_json()}

    # ------------------------------------------------------------------ internal IPs

    @staticmethod
    def _bastion_of(node: dict[str, Any]) -> dict[str, Any]:
        """``{"bastion": address}`` for a node without external IPs (its jump host)."""
        from tpufab.sim.network import bastion_address, is_internal

        endpoints = node.get("networkEndpoints") or []
        if not is_internal(node) or not endpoints:
            return {}
        return {"bastion": bastion_address(endpoints[0]["ipAddress"])}

    def _start_bastion(self, name: str, specs: list[Any], snapshot: dict[str, Any]) -> None:
        """An internal-IP node's jump host (sim/network.py), once its workers listen: a VM of
        the node's project, so the project's OS Login decides which keys it takes, asked
        through its own metadata server as on the workers."""
        if self.network is None:
            return
        from tpufab.sim.network import BASTION_SUFFIX

        with self._lock:
            record = self._state["nodes"].get(name)
            node = json.loads(json.dumps(record["node"])) if record else None
        spec = self.network.bastion_spec(node, specs) if node is not None else None
        if spec is None:
            return
        bastion = self.oslogin.bastion_record(snapshot)
        accounts = (self.oslogin.accounts(node["name"].split("/")[1])
                    if self.oslogin.enabled_for(bastion) else None)
        self.guest.open_metadata(node["id"] + BASTION_SUFFIX, [spec])
        self.network.start_bastion(node, specs, self.oslogin.bastion_keys(snapshot),
                                   os_login=accounts)

    def network_down(self, node_id: str, *, delete: bool = False) -> None:
        """After a node's workers stopped: its bastion and network namespace, if it has them."""
        if self.network is not None:
            from tpufab.sim.network import BASTION_SUFFIX

            self.guest.close_metadata(node_id + BASTION_SUFFIX)
            self.network.stop(node_id, delete=delete)

    def _arm_create_failure(self, body: dict[str, Any]) -> dict[str, Any]:
        reason = body.get("reason", "stockout")
        if reason not in ("stockout", "quota"):
            raise ApiFailure("INVALID_ARGUMENT", 'reason must be "stockout" or "quota".')
        count = int(body.get("count", 1))
        if count < 1:
            raise ApiFailure("INVALID_ARGUMENT", "count must be at least 1.")
        zone = body.get("zone") or None
        fault = {"reason": reason, "count": count, "zone": zone,
                 "immediate": bool(body.get("immediate", False))}
        if body.get("vms"):   # Compute Engine: that many VMs of the next MIG stay missing
            fault["vms"] = int(body["vms"])
        with self._lock:
            self._create_failures.append(fault)
            return {"createFailures": list(self._create_failures)}

    def _arm_error_burst(self, body: dict[str, Any]) -> dict[str, Any]:
        code = int(body.get("code", 503))
        count = int(body.get("count", 1))
        if code not in (429, 503):
            raise ApiFailure("INVALID_ARGUMENT", "code must be 503 or 429.")
        if count < 1:
            raise ApiFailure("INVALID_ARGUMENT", "count must be at least 1.")
        with self._lock:
            self._error_burst = {"code": code, "count": count, "match": body.get("match") or ""}
            return {"errorBurst": dict(self._error_burst)}

    def preempt(self, name: str, notice: float = 0.0) -> dict[str, Any]:
        """Preempt a node: PREEMPTED, workers stopped; it stays until deleted.

        With ``notice`` seconds, the workers' metadata says ``instance/preempted: TRUE`` at
        once, and the preemption follows after the notice; the call returns at once with the
        node still READY.
        """
        if notice > 0:
            with self._lock:
                record = self._require_node(name)
                if record["node"]["state"] != "READY":
                    raise ApiFailure("FAILED_PRECONDITION",
                                     f"Node {name} is {record['node']['state']}; only a READY "
                                     "node can be given a preemption notice.")
                notices = record["sim"].setdefault("notices", {})
                notices.update(preempted=True, preemptAt=time.time() + notice)
                self._save()
            self._spawn(self._preempt_after_notice, name, notice)
            return self._node(name)["node"]
        with self._lock:
            record = self._require_node(name)
            state = record["node"]["state"]
            if state not in ("READY", *BRING_UP_STATES):
                raise ApiFailure("FAILED_PRECONDITION",
                                 f"Node {name} is {state}; only a running node can be "
                                 "preempted.")
            record["node"]["state"] = "PREEMPTED"
            record["node"].pop("health", None)
            self._finish_operation(record["sim"].pop("op", None),
                                   error=(10, f"Node {name} was preempted."))
            node_id = record["node"]["id"]
            self.queued.refresh(record["node"].get("queuedResource"))
            self._save()
        with self._node_lock(node_id):
            self.guest.close_metadata(node_id)
            self.workers.stop_node(node_id)
            self.network_down(node_id)
        return self._node(name)["node"]

    def _preempt_after_notice(self, name: str, notice: float) -> None:
        if self._stopping.wait(notice):
            return
        with self._lock:
            record = self._state["nodes"].get(name)
            if record is None or record["node"]["state"] != "READY" or \
                    not (record["sim"].get("notices") or {}).get("preempted"):
                return
        self.preempt(name)

    def _worker_of(self, name: str, body: dict[str, Any]) -> tuple[str, int]:
        with self._lock:
            record = self._require_node(name)
            hosts = len(record["node"]["networkEndpoints"])
            node_id = record["node"]["id"]
        try:
            worker = int(body.get("worker"))
        except (TypeError, ValueError):
            raise ApiFailure("INVALID_ARGUMENT", "worker (an integer) is required.") from None
        if not 0 <= worker < hosts:
            raise ApiFailure("INVALID_ARGUMENT",
                             f"Worker {worker} is out of range; node {name} has workers "
                             f"0..{hosts - 1}.")
        return node_id, worker

    def _set_reachable(self, name: str, body: dict[str, Any]) -> dict[str, Any]:
        node_id, worker = self._worker_of(name, body)
        reachable = bool(body.get("reachable", False))
        self.workers.set_reachable(node_id, worker, reachable)
        return {"node": name, "worker": worker, "reachable": reachable}

    def _set_slow(self, name: str, body: dict[str, Any]) -> dict[str, Any]:
        from tpufab.sim import slow

        node_id, worker = self._worker_of(name, body)
        share = float(body.get("share") or 0.0)
        if not 0 <= share <= slow.MAX_SHARE:
            raise ApiFailure("INVALID_ARGUMENT", f"share {share} is outside 0-{slow.MAX_SHARE}.")
        slow.set_slow(self.workers, node_id, worker, share)
        return {"node": name, "worker": worker, "share": share}

    def _kill_sshd(self, name: str, body: dict[str, Any]) -> dict[str, Any]:
        node_id, worker = self._worker_of(name, body)
        self.workers.kill_sshd(node_id, worker)
        return {"node": name, "worker": worker, "sshd": "killed"}

    def _admin_node(self, name: str) -> dict[str, Any]:
        record = self._node(name)
        running = self.workers.running(record["node"]["id"])
        return {"node": record["node"], "slot": record["sim"]["slot"],
                "workers": [{"index": w, "ip": e["ipAddress"],
                             "hostname": worker_hostname(record["node"]["id"], w),
                             "running": bool(running.get(w, False))}
                            for w, e in enumerate(record["node"]["networkEndpoints"])]}

    # ------------------------------------------------------------------ lifecycle

    def resume(self) -> None:
        """After a restart: relaunch workers of READY nodes, finish interrupted operations."""
        with self._lock:
            owned = set()
            for name, record in self._state["nodes"].items():
                self._reclaim_slot(name, record)
                state = record["node"]["state"]
                owned.add(record["sim"].get("op"))
                if state == "READY":
                    self._resuming += 1
                    self._spawn(self._restart_workers, name)
                    for worker in record["sim"].get("recreating") or {}:  # cut short by the
                        self._spawn(self._recreate_worker, name,       # restart: again
                                    record["node"]["id"], int(worker))
                elif state in BRING_UP_STATES:
                    self._spawn(self._bring_up, name, 0.0)
                elif state == "STOPPING":
                    self._spawn(self._finish_stop, name)
                elif state == "DELETING" and not record["node"].get("queuedResource"):
                    self._spawn(self._finish_delete, name)
            for name, record in self._state["queuedResources"].items():
                state = record["qr"]["state"]["state"]
                owned.add(record["sim"].get("op"))
                if state == "WAITING_FOR_RESOURCES":
                    self._spawn(self.queued.provision, name, 0.0)
                elif state == "DELETING":
                    self._spawn(self.queued.finish_delete, name)
                elif state == "SUSPENDING":
                    self._spawn(self.queued.finish_reset, name)
            owned |= self.legacy.resume()
            for name, op in self._state["operations"].items():  # updates in flight
                if op.get("done") or name in owned:
                    continue
                target = op["metadata"].get("target", "")
                record = self._state["nodes"].get(target)
                if record is None:
                    self._finish_operation(name, error=(5, f"Resource '{target}' was not "
                                                        "found"))
                else:
                    self._finish_operation(name, response=record["node"])
            self._save()

    def _reclaim_slot(self, name: str, record: dict[str, Any]) -> None:
        """Keep a node's addresses across restarts unless another pod took them meanwhile."""
        span = node_slots(record)
        if self._slots.reclaim(span.start, len(span)):
            return
        used = {s for r in self._state["nodes"].values() if r is not record
                for s in node_slots(r)}
        slot = self._slots.claim(used, len(span))
        log.warning("slot %d of %s is used by another simulated pod; moved it to slot %d",
                    record["sim"]["slot"], name, slot)
        record["sim"]["slot"] = slot
        record["node"]["networkEndpoints"] = self._endpoints(
            slot, len(record["node"]["networkEndpoints"]),
            external=(record["node"].get("networkConfig") or {}).get("enableExternalIps", True))

    def _restart_workers(self, name: str) -> None:
        try:
            with self._lock:
                record = self._state["nodes"].get(name)
                if record is None or record["node"]["state"] != "READY":
                    return
                node_id = record["node"]["id"]
                specs = self._specs(record["node"])
                keys = self.oslogin.login_keys(record)
                snapshot = json.loads(json.dumps(record))
            with self._node_lock(node_id):
                self.oslogin.apply(snapshot)
                self.workers.start_node(node_id, specs, keys, delay=0.0)
                self.guest.open_metadata(node_id, specs)
                self.workers.wait_listening(node_id, timeout=self.settings.listen_timeout)
                self._start_bastion(name, specs, snapshot)
                host_keys = self.workers.host_keys(node_id)
            with self._lock:
                record = self._state["nodes"].get(name)
                if record is not None:
                    record["sim"]["hostKeys"] = {str(i): k for i, k in host_keys.items()}
                    self._save()
            self.guest.booted(name, node_id, specs)
        except Exception:
            log.exception("could not restart the workers of %s", name)
        finally:
            with self._lock:
                self._resuming -= 1

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop background work and every worker; the state file keeps the nodes."""
        self._stopping.set()
        deadline = time.monotonic() + timeout
        for thread in list(self._threads):
            thread.join(max(0.0, deadline - time.monotonic()))
        try:
            if self.metadata is not None:
                self.metadata.shutdown()
            self.workers.stop_all()
            if self.network is not None:
                self.network.close()
        finally:
            with self._lock:
                self._save()

    def _spawn(self, target: Callable[..., None], *args: Any) -> None:
        def run() -> None:
            try:
                target(*args)
            except Exception:
                log.exception("background task %s%r failed", target.__name__, args)
            finally:
                self._threads.discard(threading.current_thread())

        thread = threading.Thread(target=run, name=f"sim-{target.__name__}", daemon=True)
        self._threads.add(thread)
        thread.start()

    def _node_lock(self, node_id: str) -> threading.Lock:
        with self._lock:
            return self._node_locks.setdefault(node_id, threading.Lock())


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
        try:
            body = json.loads(raw) if raw.strip() else None
        except ValueError:
            failure = ApiFailure("INVALID_ARGUMENT", "The request body is not valid JSON.")
            code, payload = failure.http_code, failure.body()
        else:
            code, payload = self.server.emulator.handle(self.command, split.path, query, body,
                                                        self.headers.get("Authorization"))
        data = json.dumps(payload).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json; charset=UTF-8")
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
