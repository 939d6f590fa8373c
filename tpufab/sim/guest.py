"""What a simulated worker sees of its VM beyond SSH: its metadata, service-account tokens,
preemption and maintenance notices, and startup scripts.

The emulator owns the node records; this module turns one record into a worker's
``computeMetadata/v1`` tree (served by tpufab.sim.metadata), keeps the tokens it issued (the
emulator's API accepts them as ``Authorization: Bearer``), and runs ``startup-script`` metadata
inside each worker as root (tpufab/sim/startup_runner.py, which fetches the script from the
metadata server as Google's guest agent does).
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import threading
import time
from pathlib import Path
from typing import Any

from tpufab.sim._model import ApiFailure, rfc3339, topology_string, worker_hostname
from tpufab.sim.catalog import project_number
from tpufab.sim.metadata import JsonLeaf
from tpufab.sim.network import BASTION_SUFFIX
from tpufab.sim.oslogin import OsLoginService
from tpufab.sim.store import SimStore, behind_compute_engine
from tpufab.topology import parse_accelerator_type

log = logging.getLogger("tpufab.sim")

TOKEN_LIFETIME = 3600  # seconds, as GCE's metadata server issues them
TOKEN_PREFIX = "ya29.sim-"
STARTUP_RUNNER = Path(__file__).with_name("startup_runner.py")
STARTUP_LOG = "/var/log/google-startup-scripts.log"
MEGASCALE_PORT = 8080
JAX_COORDINATOR_PORT = 8482
# GCE's values of instance/maintenance-event
NO_EVENT = "NONE"
TERMINATE = "TERMINATE_ON_HOST_MAINTENANCE"
# chips per host as a 3D box (x,y,z) by chips per host, as tpu-env's CHIPS_PER_HOST_BOUNDS says
CHIPS_PER_HOST_BOUNDS = {1: (1, 1, 1), 4: (2, 2, 1), 8: (2, 4, 1)}


def host_bounds(topo_text: str | None, chips_per_host: int, hosts: int) -> tuple[str, str]:
    """(CHIPS_PER_HOST_BOUNDS, HOST_BOUNDS) of tpu-env, e.g. v4-32 -> ("2,2,1", "1,1,4")."""
    per_host = CHIPS_PER_HOST_BOUNDS.get(chips_per_host, (chips_per_host, 1, 1))
    dims = [int(d) for d in topo_text.split("x")] if topo_text else [chips_per_host, 1]
    dims = (dims + [1, 1, 1])[:3]
    if all(d % p == 0 for d, p in zip(dims, per_host, strict=True)):
        bounds = [d // p for d, p in zip(dims, per_host, strict=True)]
    else:
        bounds = [1, 1, hosts]
    return ",".join(map(str, per_host)), ",".join(map(str, bounds))


def tpu_env(node: dict[str, Any], worker: int, slice_info: dict[str, Any] | None) -> str:
    """instance/attributes/tpu-env: lines ``KEY: 'value'`` (what libtpu and JAX read)."""
    project, zone = node["name"].split("/")[1], node["name"].split("/")[3]
    topo = parse_accelerator_type(node["acceleratorType"])
    topo_text = (node.get("acceleratorConfig") or {}).get("topology") or topology_string(topo)
    per_host, bounds = host_bounds(topo_text, topo.chips_per_host, topo.hosts)
    values = {
        "ACCELERATOR_TYPE": topo.name,
        "CHIPS_PER_HOST_BOUNDS": per_host,
        "HOST_BOUNDS": bounds,
        "NODE_ID": node["name"].rsplit("/", 1)[1],
        "PROJECT_ID": project,
        "RUNTIME_VERSION": node.get("runtimeVersion", ""),
        "TOPOLOGY": topo_text or "",
        "TPU_PROCESS_BOUNDS": bounds,
        "WORKER_ID": str(worker),
        "ZONE": zone,
    }
    if slice_info:
        values.update({
            "MEGASCALE_COORDINATOR_ADDRESS": f"{slice_info['coordinator']}:{MEGASCALE_PORT}",
            "MEGASCALE_NUM_SLICES": str(slice_info["count"]),
            "MEGASCALE_PORT": str(MEGASCALE_PORT),
            "MEGASCALE_SLICE_ID": str(slice_info["id"]),
        })
    return "".join(f"{k}: '{v}'\n" for k, v in sorted(values.items()))


class Tokens:
    """Service-account access tokens issued by the metadata servers; kept in a 0600 file so
    they stay valid across a daemon restart, like real tokens outlive a metadata server."""

    def __init__(self, path: Path):
        self.path = path
        self._lock = threading.Lock()
        try:
            self._tokens: dict[str, dict[str, Any]] = json.loads(path.read_text())
        except (OSError, ValueError):
            self._tokens = {}

    def issue(self, node: str, worker: int, email: str) -> dict[str, Any]:
        token = TOKEN_PREFIX + secrets.token_urlsafe(32)
        now = time.time()
        with self._lock:
            self._tokens = {t: v for t, v in self._tokens.items() if v["expires"] > now}
            self._tokens[token] = {"node": node, "worker": worker, "email": email,
                                   "expires": now + TOKEN_LIFETIME}
            self._write()
        return {"access_token": token, "expires_in": TOKEN_LIFETIME - 1, "token_type": "Bearer"}

    def holder(self, token: str) -> dict[str, Any] | None:
        """Who the token was issued to (node, worker, email), or None if unknown or expired."""
        with self._lock:
            found = self._tokens.get(token)
        if found is None or found["expires"] <= time.time():
            return None
        return dict(found)

    def _write(self) -> None:
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(self._tokens, f)
        os.replace(tmp, self.path)


def compute_engine_tpu_env(node: dict[str, Any], worker: int) -> str:
    r"""tpu-env of a Compute Engine TPU VM: the keys a TPU7x MIG's VMs were seen to carry
    (GoogleCloudPlatform/cluster-toolkit#6351: ``TOPOLOGY``, ``TPU_WORKER_ID``,
    ``CHIPS_PER_HOST_BOUNDS``) and ``ACCELERATOR_TYPE``, which PyTorch/XLA reads from tpu-env
    on every TPU VM it finds chips on, TPU7x's spelling included (torch_xla/_internal/tpu.py
    ``version()``: ``^(?:v|tpu)(\d)...``); which others Compute Engine sets is not
    established, so no more are made up (docs/simulated-pod.md)."""
    topo = parse_accelerator_type(node["acceleratorType"])
    topo_text = (node.get("acceleratorConfig") or {}).get("topology") or topology_string(topo)
    per_host, _ = host_bounds(topo_text, topo.chips_per_host, topo.hosts)
    values = {"ACCELERATOR_TYPE": topo.name, "CHIPS_PER_HOST_BOUNDS": per_host,
              "TOPOLOGY": topo_text or "", "TPU_WORKER_ID": str(worker)}
    return "".join(f"{k}: '{v}'\n" for k, v in values.items())


def metadata_tree(record: dict[str, Any], worker: int, *, slice_info: dict[str, Any] | None,
                  tokens: Tokens) -> dict[str, Any]:
    """The ``computeMetadata/v1`` tree of one worker of a node record (emulator state)."""
    node, sim = record["node"], record["sim"]
    name = node["name"]
    project, zone = name.split("/")[1], name.split("/")[3]
    endpoints = node.get("networkEndpoints") or []
    names = node.get("instanceNames") or []  # a Compute Engine VM: its instance name
    hostname = names[worker] if worker < len(names) else worker_hostname(node["id"], worker)
    notices = sim.get("notices") or {}
    account = node.get("serviceAccount") or {}
    email = account.get("email") or "default"
    if email == "default":
        email = f"{project_number(project)}-compute@developer.gserviceaccount.com"
    scopes = list(account.get("scope") or ["https://www.googleapis.com/auth/cloud-platform"])
    attributes: dict[str, Any] = dict(node.get("metadata") or {})
    if not node.get("acceleratorType"):
        pass  # a general-purpose VM: no TPU attributes at all
    elif behind_compute_engine(name):  # a Compute Engine TPU VM: its VMs' names, bare
        attributes.update({
            "accelerator-type": node["acceleratorType"],
            "agent-worker-number": str(worker),
            "tpu-env": compute_engine_tpu_env(node, worker),
            "worker-network-endpoints": ",".join(names[:len(endpoints)]),
        })
    else:
        attributes.update({
            "accelerator-type": node["acceleratorType"],
            "agent-worker-number": str(worker),
            "tpu-env": tpu_env(node, worker, slice_info),
            # name:id:ip triples (the older of the two formats JAX accepts)
            "worker-network-endpoints": ",".join(
                f"{names[w] if w < len(names) else worker_hostname(node['id'], w)}:{w}:"
                f"{e['ipAddress']}"
                for w, e in enumerate(endpoints)),
            "instance-id": node["id"],
            "zone": zone,
        })
    account_tree = {
        "aliases": ["default"],
        "email": email,
        "scopes": scopes,
        "token": lambda: JsonLeaf(json.dumps(tokens.issue(name, worker, email))),
    }
    return {
        "instance": {
            "attributes": attributes,
            "cpu-platform": "Simulated CPU",
            "description": node.get("description", ""),
            "guest-attributes": {},
            "hostname": f"{hostname}.{zone}.c.{project}.internal",
            "id": int(node["id"]) if str(node["id"]).isdigit() else node["id"],
            "maintenance-event": (notices.get("maintenance") or {}).get(str(worker), NO_EVENT),
            "name": hostname,
            **({"machine-type": f"projects/{project_number(project)}/machineTypes/"
                                f"{node['machineType']}"} if node.get("machineType") else {}),
            "network-interfaces": [{
                "ip": endpoints[worker]["ipAddress"] if worker < len(endpoints) else "",
                "network": f"projects/{project_number(project)}/networks/default",
                "access-configs": [{"external-ip": (endpoints[worker].get("accessConfig") or {})
                                    .get("externalIp", "") if worker < len(endpoints) else "",
                                    "type": "ONE_TO_ONE_NAT"}],
            }],
            "preempted": "TRUE" if notices.get("preempted") else "FALSE",
            "scheduling": {
                "preemptible": "TRUE" if (node.get("schedulingConfig") or {}).get("preemptible")
                or (node.get("schedulingConfig") or {}).get("spot") else "FALSE",
                "on-host-maintenance": "TERMINATE",
            },
            "service-accounts": {"default": account_tree, email: dict(account_tree)},
            "tags": list(node.get("tags") or []),
            "zone": f"projects/{project_number(project)}/zones/{zone}",
        },
        "project": {
            "attributes": {},
            "numeric-project-id": int(project_number(project)),
            "project-id": project,
        },
    }


class GuestEnvironment:
    """The emulator's handler for what runs inside a node's VMs: metadata servers, startup
    scripts, maintenance events. It reads and changes the node records under the shared
    store's lock; machines.py calls it when workers boot and stop."""

    def __init__(self, store: SimStore, tokens: Tokens, oslogin: OsLoginService):
        self.store = store
        self.tokens = tokens
        self.oslogin = oslogin

    def metadata_tree(self, node_id: str, worker: int) -> dict[str, Any] | None:
        """A worker's computeMetadata/v1 tree (tpufab.sim.metadata asks for it per request)."""
        if node_id.endswith(BASTION_SUFFIX):
            return self._bastion_tree(node_id)
        with self.store.lock:
            found = [(n, r) for n, r in self.store.nodes.items() if r["node"]["id"] == node_id]
            if not found:
                return None
            name, record = found[0]
            record = json.loads(json.dumps(record))
            slice_info = self._slice_info(name, record)
        tree = metadata_tree(record, worker, slice_info=slice_info, tokens=self.tokens)
        tree["project"]["attributes"] = self.oslogin.project_metadata(name.split("/")[1])
        return tree

    def oslogin_answer(self, node_id: str, worker: int, parts: list[str],
                       query: dict[str, str]) -> tuple[int, Any]:
        """A worker's (or a bastion's) ``computeMetadata/v1/oslogin/...`` answer
        (tpufab.sim.oslogin)."""
        bastion = node_id.endswith(BASTION_SUFFIX)
        record = self._record(node_id.removesuffix(BASTION_SUFFIX))
        if record is None:
            return 503, "The worker is not running.\n"
        if bastion:
            record = self.oslogin.bastion_record(record)
        return self.oslogin.metadata_answer(record, parts, query)

    def _record(self, node_id: str) -> dict[str, Any] | None:
        with self.store.lock:
            found = [r for r in self.store.nodes.values() if r["node"]["id"] == node_id]
            return json.loads(json.dumps(found[0])) if found else None

    def _bastion_tree(self, bastion_id: str) -> dict[str, Any] | None:
        """An internal-IP node's bastion: a plain VM of the node's project (none of the
        node's TPU attributes), with the project's metadata."""
        record = self._record(bastion_id.removesuffix(BASTION_SUFFIX))
        if record is None:
            return None
        name = record["node"]["name"]
        project, zone = name.split("/")[1], name.split("/")[3]
        hostname = worker_hostname(record["node"]["id"], 0)[:14] + "-bastion"
        return {
            "instance": {"attributes": {}, "hostname": f"{hostname}.{zone}.c.{project}.internal",
                         "name": hostname, "zone": f"projects/{project_number(project)}/zones/{zone}"},
            "project": {"attributes": self.oslogin.project_metadata(project),
                        "numeric-project-id": int(project_number(project)),
                        "project-id": project},
        }

    def _slice_info(self, name: str, record: dict[str, Any]) -> dict[str, Any] | None:
        """Multislice facts for tpu-env (caller holds the lock), None for a single slice."""
        qr = self.store.queued_resources.get(record["node"].get("queuedResource") or "")
        if qr is None or not record["node"].get("multisliceNode"):
            return None
        names = [p["name"] for p in qr["sim"]["plan"]]
        first = self.store.nodes.get(names[0])
        if name not in names or first is None:
            return None
        return {"id": names.index(name), "count": len(names),
                "coordinator": first["node"]["networkEndpoints"][0]["ipAddress"]}

    def open_metadata(self, node_id: str, specs: list[Any]) -> None:
        if self.store.metadata is not None:
            self.store.metadata.open(node_id, [(s.index, s.ip, getattr(s, "netns", ""))
                                               for s in specs])

    def close_metadata(self, node_id: str) -> None:
        if self.store.metadata is not None:
            self.store.metadata.close(node_id)

    def booted(self, name: str, node_id: str, specs: list[Any]) -> None:
        """After every boot (create, start, daemon restart): run startup-script metadata."""
        if self.store.metadata is None:
            return  # paper workers (no root): nothing to run on
        with self.store.lock:
            record = self.store.nodes.get(name)
            if record is None or "startup-script" not in (record["node"].get("metadata") or {}):
                return
            record["sim"].setdefault("startup", {}).update({str(s.index): {} for s in specs})
            self.store.save()
        for spec in specs:
            self.store.spawn(self._run_startup_script, name, node_id, spec.index)

    def _run_startup_script(self, name: str, node_id: str, worker: int) -> None:
        started = time.time()
        try:
            proc = self.store.workers.exec_in(node_id, worker,
                                              ["/usr/bin/python3", "-I", "-S", "-"],
                                              input=STARTUP_RUNNER.read_text(), timeout=3600)
            outcome = json.loads(proc.stdout.strip().splitlines()[-1]) if proc.stdout.strip() \
                else {"error": proc.stderr.strip()[-500:] or f"runner exited {proc.returncode}"}
        except Exception as exc:  # noqa: BLE001 - recorded where a user looks
            outcome = {"error": str(exc)}
        outcome["startedAt"] = rfc3339(started)
        outcome["endedAt"] = rfc3339()
        with self.store.lock:
            record = self.store.nodes.get(name)
            if record is None or record["node"]["id"] != node_id:
                return
            record["sim"].setdefault("startup", {})[str(worker)] = outcome
            self.store.save()

    def simulate_maintenance(self, version: str, name: str,
                             body: dict[str, Any]) -> dict[str, Any]:
        """nodes:simulateMaintenanceEvent: the workers' metadata announces host maintenance
        (``instance/maintenance-event: TERMINATE_ON_HOST_MAINTENANCE``) for
        ``maintenance_notice`` seconds, then the event is over and it says NONE again. As the
        API says: without ``workerIds``, worker 0."""
        return self._maintenance(version, name, body, "simulateMaintenanceEvent")

    def perform_maintenance(self, version: str, name: str) -> dict[str, Any]:
        """nodes:performMaintenance (v2alpha1): the node's pending maintenance now, on every
        worker (announced as a simulated event is), and no longer upcoming."""
        with self.store.lock:
            hosts = len(self.store.require_node(name)["node"]["networkEndpoints"])
        op = self._maintenance(version, name, {"workerIds": list(range(hosts))},
                               "performMaintenance")
        with self.store.lock:
            record = self.store.nodes.get(name)
            if record is not None and record["node"].pop("upcomingMaintenance", None):
                self.store.save()
        return op

    def perform_maintenance_queued(self, version: str, name: str,
                                   body: dict[str, Any]) -> dict[str, Any]:
        """queuedResources:performMaintenanceQueuedResource (v2alpha1): performMaintenance on
        the queued resource's nodes (``nodeNames``, short or full names; none: every node);
        the operation's response is the QueuedResource, as the API's."""
        with self.store.lock:
            record = self.store.queued_resources.get(name)
            if record is None:
                raise ApiFailure("NOT_FOUND", f"Resource '{name}' was not found")
            state = record["qr"]["state"]["state"]
            if state != "ACTIVE":
                raise ApiFailure("FAILED_PRECONDITION", f"Queued resource {name} is {state}; "
                                 "maintenance is performed on an ACTIVE one's nodes.")
            nodes = self.store.queued_node_names(record)
        wanted = body.get("nodeNames") or body.get("node_names") or []
        if wanted:
            short = {n.rsplit("/", 1)[-1]: n for n in nodes}
            unknown = [w for w in wanted if w not in nodes and w not in short]
            if unknown:
                raise ApiFailure("INVALID_ARGUMENT", f"Nodes {unknown} are not part of queued "
                                 f"resource {name}.")
            nodes = [short.get(w, w) for w in wanted]
        for node in nodes:
            self.perform_maintenance(version, node)
        with self.store.lock:
            record = self.store.queued_resources[name]
            op = self.store.new_operation(version, name, "performMaintenanceQueuedResource")
            self.store.finish_operation(op["name"], response=record["qr"],
                                        response_type="QueuedResource")
            self.store.save()
            return json.loads(json.dumps(self.store.operations[op["name"]]))

    def schedule_maintenance(self, name: str, body: dict[str, Any]) -> dict[str, Any]:
        """Admin: announce a maintenance window on the node as the API does, in its
        ``upcomingMaintenance`` (v2alpha1 only; /v2/ leaves it out, as Google's): it starts
        ``inSeconds`` from now and lasts ``windowSeconds`` (default 1 h), SCHEDULED, PENDING,
        reschedulable up to a week later. ``clear``: take it back. Nothing happens by itself
        at the window: `performMaintenance` (or a simulated event) is the maintenance."""
        with self.store.lock:
            record = self.store.require_node(name)
            if body.get("clear"):
                record["node"].pop("upcomingMaintenance", None)
                self.store.save()
                return record["node"]
            if record["node"]["state"] != "READY":
                raise ApiFailure("FAILED_PRECONDITION", f"Node {name} is "
                                 f"{record['node']['state']}; only a READY node can have "
                                 "maintenance scheduled.")
            try:
                start = time.time() + float(body.get("inSeconds", 0))
                length = float(body.get("windowSeconds") or 3600)
            except (TypeError, ValueError):
                raise ApiFailure("INVALID_ARGUMENT", "inSeconds and windowSeconds are "
                                 "numbers of seconds.") from None
            record["node"]["upcomingMaintenance"] = {
                "type": str(body.get("type") or "SCHEDULED"),
                "canReschedule": bool(body.get("canReschedule", True)),
                "windowStartTime": rfc3339(start),
                "windowEndTime": rfc3339(start + length),
                "latestWindowStartTime": rfc3339(start + 7 * 86400),
                "maintenanceStatus": "PENDING",
            }
            self.store.save()
            return record["node"]

    def _maintenance(self, version: str, name: str, body: dict[str, Any],
                     verb: str) -> dict[str, Any]:
        with self.store.lock:
            record = self.store.require_node(name)
            if record["node"]["state"] != "READY":
                raise ApiFailure("FAILED_PRECONDITION", f"Node {name} is "
                                 f"{record['node']['state']}; only a READY node can have a "
                                 "maintenance event.")
            hosts = len(record["node"]["networkEndpoints"])
            wanted = [w for w in (body.get("workerIds") or body.get("worker_ids") or [])
                      if str(w) != ""]
            try:
                workers = sorted({int(w) for w in wanted}) if wanted else [0]
            except ValueError:
                raise ApiFailure("INVALID_ARGUMENT", f"Invalid worker ids {wanted}.") from None
            if any(not 0 <= w < hosts for w in workers):
                raise ApiFailure("INVALID_ARGUMENT", f"Worker ids {workers} are out of range; "
                                 f"node {name} has workers 0..{hosts - 1}.")
            notices = record["sim"].setdefault("notices", {})
            events = notices.setdefault("maintenance", {})
            for w in workers:
                events[str(w)] = TERMINATE
            record["node"]["health"] = "UNHEALTHY_MAINTENANCE"
            op = self.store.new_operation(version, name, verb)
            self.store.finish_operation(op["name"], response=record["node"])
            self.store.save()
            op = json.loads(json.dumps(self.store.operations[op["name"]]))
        self.store.spawn(self._end_maintenance, name, workers)
        return op

    def _end_maintenance(self, name: str, workers: list[int]) -> None:
        if self.store.wait(self.store.settings.maintenance_notice):
            return
        with self.store.lock:
            record = self.store.nodes.get(name)
            if record is None or record["node"]["state"] != "READY":
                return
            notices = record["sim"].get("notices") or {}
            if notices.get("preempted"):
                return  # a preemption notice took over
            events = notices.get("maintenance") or {}
            for w in workers:
                events[str(w)] = NO_EVENT
            if all(v == NO_EVENT for v in events.values()):
                record["node"]["health"] = "HEALTHY"
            self.store.save()
