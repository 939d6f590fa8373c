"""Compute Engine v1, the subset TPU VMs use, served by the emulator under ``/compute/v1/``.

Instances (insert, get, list, aggregatedList, delete, setMetadata, setLabels, stop, start,
getGuestAttributes), zone/region/global operations (get, wait), machine types of the TPU
families, global instance templates, zonal managed instance groups (insert, get, list,
listManagedInstances, resize, recreateInstances, updatePerInstanceConfigs,
listPerInstanceConfigs, delete) and regional resource policies (workload policies:
``workloadPolicy {type: HIGH_THROUGHPUT, acceleratorTopology}``), in the JSON shapes of the
real API (field names of google-cloud-compute's ``compute_v1`` messages).

Every TPU VM is backed by a node record of the emulator (its workers, metadata server, host
keys, preemption): a standalone instance by the node ``projects/P/locations/Z/ceInstances/N``
(one worker), a MIG with a workload policy by ``.../ceGroups/MIG`` (one worker per VM, in
the order the slice numbers them). Those records never show in the Cloud TPU API. See
docs/control-plane.md.
"""

from __future__ import annotations

import base64
import json
import secrets
import time
from typing import TYPE_CHECKING, Any

from tpufab.errors import ConfigError
from tpufab.sim._model import ID_RE, ApiFailure, rfc3339, worker_hostname
from tpufab.topology import GENERATIONS, Topology, check_topology, parse_accelerator_type

if TYPE_CHECKING:
    from tpufab.sim.emulator import Emulator

# Compute Engine machine type -> (generation, chips per VM), from tpufab.topology.
MACHINE_TYPES: dict[str, tuple[str, int]] = {
    machine: (gen.name, chips) for gen in GENERATIONS.values()
    for chips, machine in gen.machine_types
}
# Made-up but plausible host sizes (vCPUs, memory MiB) per chips on the VM.
HOST_SIZE = {1: (44, 180 * 1024), 4: (224, 960 * 1024), 8: (180, 1440 * 1024)}

INSTANCE_STATUS = {  # backing node state -> instance status
    "CREATING": "STAGING", "STARTING": "STAGING", "RESTARTING": "STAGING", "READY": "RUNNING",
    "STOPPING": "STOPPING", "STOPPED": "TERMINATED", "PREEMPTED": "TERMINATED",
    "DELETING": "STOPPING", "UNKNOWN": "RUNNING", "TERMINATED": "TERMINATED",
}
PROVISIONING_MODELS = ("STANDARD", "SPOT", "FLEX_START", "RESERVATION_BOUND")
RESERVATION_KEY = "compute.googleapis.com/reservation-name"


class ComputeFailure(ApiFailure):
    """A Compute Engine error: ``{"error": {code, message, errors: [{message, domain,
    reason}]}}`` (the shape google-api-core and gcloud read)."""

    def __init__(self, status: str, message: str, reason: str):
        super().__init__(status, message)
        self.reason = reason

    def body(self) -> dict[str, Any]:
        return {"error": {"code": self.http_code, "message": self.message,
                          "errors": [{"message": self.message, "domain": "global",
                                      "reason": self.reason}]}}


def _error(code: int, reason: str, message: str) -> ComputeFailure:
    status = {400: "INVALID_ARGUMENT", 404: "NOT_FOUND", 409: "ALREADY_EXISTS",
              429: "RESOURCE_EXHAUSTED"}.get(code, "INTERNAL")
    return ComputeFailure(status, message, reason)


def _not_found(kind: str, path: str) -> ApiFailure:
    path = path if path.startswith("projects/") else f"projects/{path}"
    return _error(404, "notFound", f"The resource '{path}' was not found")


def topology_of(machine_type: str, accelerator_topology: str | None = None) -> Topology:
    """The TPU shape of VMs of ``machine_type`` (one VM, or a slice of ``accelerator_topology``)."""
    if machine_type not in MACHINE_TYPES:
        raise _error(400, "invalid", f"Invalid value for field 'resource.machineType': "
                     f"'{machine_type}'. Machine type with name '{machine_type}' does not "
                     "exist in zone.")
    generation, chips_per_vm = MACHINE_TYPES[machine_type]
    gen = GENERATIONS[generation]
    chips = chips_per_vm
    dims: tuple[int, ...] | None = None
    if accelerator_topology:
        try:
            dims = tuple(int(d) for d in accelerator_topology.lower().split("x"))
        except ValueError:
            raise _error(400, "invalid", f"Invalid accelerator topology "
                         f"'{accelerator_topology}'.") from None
        chips = 1
        for d in dims:
            chips *= d
    try:
        topo = parse_accelerator_type(f"{generation}-{chips * gen.cores_per_chip}")
        if dims is not None:
            check_topology(topo, dims)
    except ConfigError as err:
        raise _error(400, "invalid", f"Accelerator topology '{accelerator_topology}' is not "
                     f"valid for machine type {machine_type}: {err}") from None
    if topo.chips_per_host != chips_per_vm and topo.hosts > 1:
        raise _error(400, "invalid", f"Machine type {machine_type} has {chips_per_vm} chips "
                     f"per VM; a {accelerator_topology} slice needs "
                     f"{topo.chips_per_host}-chip VMs.")
    return topo


def _short(url: str | None) -> str:
    return (url or "").rstrip("/").rsplit("/", 1)[-1]


def _region(zone: str) -> str:
    return zone.rsplit("-", 1)[0]


def _fingerprint() -> str:
    return base64.b64encode(secrets.token_bytes(8)).decode()


def _new_id() -> str:
    return str(10**18 + secrets.randbelow(2**63 - 10**18))


class ComputeEngine:
    """The Compute Engine v1 handler of the emulator (state under ``state["compute"]``)."""

    def __init__(self, emu: Emulator):
        self.emu = emu

    # ---------------------------------------------------------------- plumbing

    @property
    def state(self) -> dict[str, Any]:
        state = self.emu._state.setdefault("compute", {})
        for key in ("instances", "templates", "groups", "policies", "operations",
                    "reservations"):
            state.setdefault(key, {})
        return state

    def base(self) -> str:
        return f"{getattr(self.emu, 'base_url', '') or 'https://compute.googleapis.com'}" \
               "/compute/v1/"

    def link(self, path: str) -> str:
        return self.base() + path

    def handle(self, method: str, rest: str, query: dict[str, str],
               body: dict[str, Any]) -> dict[str, Any]:
        parts = rest.split("/")
        if len(parts) < 2 or parts[0] != "projects":
            raise _not_found("", rest)
        project = parts[1]
        p = parts[2:]
        with self.emu._lock:
            if not p:
                raise LookupError  # the project itself: the catalog answers
            if p[0] == "zones" and len(p) >= 2:
                return self._zonal(method, project, p[1], p[2:], query, body, rest)
            if p[0] == "regions" and len(p) >= 2:
                return self._regional(method, project, p[1], p[2:], query, body, rest)
            if p[0] == "global":
                return self._global(method, project, p[1:], query, body, rest)
            if p[0] == "aggregated" and p[1:] == ["instances"] and method == "GET":
                return self._aggregated_instances(project)
        raise _not_found("", rest)

    # ---------------------------------------------------------------- operations

    def _operation(self, project: str, scope: str, where: str, kind: str, target: str,
                   target_id: str = "", *, wait_node: str | None = None,
                   until: str = "done", failure: str | None = None) -> dict[str, Any]:
        """A new operation; ``wait_node``/``until`` ("READY" or "gone") make it finish when
        the backing node gets there, else it is DONE at once."""
        name = f"operation-{int(time.time() * 1000)}-{secrets.token_hex(6)}"
        path = f"projects/{project}/{scope}/{where}/operations/{name}"
        op = {
            "kind": "compute#operation", "id": _new_id(), "name": name,
            "operationType": kind, "targetLink": self.link(target), "targetId": target_id or None,
            "status": "RUNNING", "progress": 0, "insertTime": rfc3339(),
            "startTime": rfc3339(), "selfLink": self.link(path),
            "user": "sim@sim-project.iam.gserviceaccount.com",
            ("zone" if scope == "zones" else "region"): self.link(
                f"projects/{project}/{scope}/{where}") if scope != "global" else None,
        }
        op = {k: v for k, v in op.items() if v is not None}
        self.state["operations"][path] = {"op": op, "node": wait_node, "until": until,
                                          "failure": failure}
        if wait_node is None and until == "done":
            self._finish(path)
        self.emu._save()
        return self._op_view(path)

    def _finish(self, path: str, error: tuple[str, str] | None = None) -> None:
        record = self.state["operations"][path]
        op = record["op"]
        if op["status"] == "DONE":
            return
        op.update(status="DONE", progress=100, endTime=rfc3339())
        if error:
            op["error"] = {"errors": [{"code": error[0], "message": error[1]}]}
            op["httpErrorStatusCode"] = 400 if error[0] != "ZONE_RESOURCE_POOL_EXHAUSTED" \
                else 503
            op["httpErrorMessage"] = "BAD REQUEST"

    def _op_view(self, path: str) -> dict[str, Any]:
        record = self.state["operations"].get(path)
        if record is None:
            raise _not_found("operation", path.removeprefix("projects/"))
        op = record["op"]
        if op["status"] != "DONE" and record.get("node"):
            nodes = self.emu._state["nodes"]
            node = nodes.get(record["node"])
            if record["until"] == "READY":
                if node is None:  # the create failed: no VM is left behind
                    for key in [k for k, r in self.state["instances"].items()
                                if r.get("node") == record["node"]]:
                        del self.state["instances"][key]
                    self._finish(path, (("ZONE_RESOURCE_POOL_EXHAUSTED" if record.get("failure")
                                         and "capacity" in record["failure"] else
                                         "QUOTA_EXCEEDED" if record.get("failure") else
                                         "RESOURCE_NOT_FOUND"),
                                        record.get("failure") or "The VM was deleted."))
                elif node["node"]["state"] == "READY":
                    self._finish(path)
                elif node["node"]["state"] == "UNKNOWN":
                    self._finish(path, ("INTERNAL_ERROR", node["node"].get(
                        "healthDescription", "The simulated workers did not start.")))
            elif record["until"] == "gone" and node is None:
                self._finish(path)
            elif record["until"] == "STOPPED" and (node is None or node["node"]["state"] in (
                    "STOPPED", "PREEMPTED")):
                self._finish(path)
        if record.get("done_check") == "metadata" and record.get("synced"):
            self._finish(path)
        return json.loads(json.dumps(op))

    def _wait_op(self, path: str, timeout: float = 30.0) -> dict[str, Any]:
        deadline = time.monotonic() + min(timeout, 120.0)
        while True:
            view = self._op_view(path)
            if view["status"] == "DONE" or time.monotonic() >= deadline:
                return view
            self.emu._lock.release()
            try:
                time.sleep(0.05)
            finally:
                self.emu._lock.acquire()

    def _operations(self, method: str, project: str, scope: str, where: str,
                    rest: list[str]) -> dict[str, Any]:
        path = f"projects/{project}/{scope}/{where}/operations/{rest[0]}"
        if method == "GET" and len(rest) == 1:
            return self._op_view(path)
        if method == "POST" and rest[1:] == ["wait"]:
            return self._wait_op(path)
        if method == "DELETE" and len(rest) == 1:
            self.state["operations"].pop(path, None)
            return {}
        raise _not_found("operation", path.removeprefix("projects/"))

    # ---------------------------------------------------------------- routing

    def _zonal(self, method: str, project: str, zone: str, p: list[str],
               query: dict[str, str], body: dict[str, Any], rest: str) -> dict[str, Any]:
        if not p:
            return {"kind": "compute#zone", "name": zone, "status": "UP",
                    "region": self.link(f"projects/{project}/regions/{_region(zone)}"),
                    "selfLink": self.link(f"projects/{project}/zones/{zone}")}
        kind, tail = p[0], p[1:]
        if kind == "operations" and tail:
            return self._operations(method, project, "zones", zone, tail)
        if kind == "reservations":
            return self._reservations(method, project, zone, tail, body, rest)
        if kind == "autoscalers" and not tail and method == "GET":  # none: gcloud asks
            return self._list("compute#autoscalerList", [], project, f"zones/{zone}/autoscalers")
        if kind == "machineTypes":
            return self._machine_types(project, zone, tail[0] if tail else None)
        if kind == "instances":
            if not tail:
                if method == "GET":
                    return self._list("compute#instanceList", self._instances(project, zone),
                                      project, f"zones/{zone}/instances")
                if method == "POST":
                    return self.insert_instance(project, zone, body)
            elif len(tail) == 1:
                if method == "GET":
                    return self.instance_view(self._instance(project, zone, tail[0]))
                if method == "DELETE":
                    return self.delete_instance(project, zone, tail[0])
            elif len(tail) == 2 and method in ("POST", "GET"):
                action = {"setMetadata": lambda: self._set_metadata(project, zone, tail[0],
                                                                    body),
                          "setLabels": lambda: self._set_labels(project, zone, tail[0], body),
                          "stop": lambda: self._stop(project, zone, tail[0]),
                          "start": lambda: self._start(project, zone, tail[0]),
                          "getGuestAttributes": lambda: self._guest_attributes(
                              project, zone, tail[0], query),
                          "simulateMaintenanceEvent": lambda: self._simulate_maintenance(
                              project, zone, tail[0])}.get(tail[1])
                if action:
                    return action()
        if kind == "instanceGroupManagers":
            if not tail:
                if method == "GET":
                    items = [self.group_view(k) for k in self.state["groups"]
                             if k.startswith(f"projects/{project}/zones/{zone}/")]
                    return self._list("compute#instanceGroupManagerList", items, project,
                                      f"zones/{zone}/instanceGroupManagers")
                if method == "POST":
                    return self.insert_group(project, zone, body)
            elif len(tail) == 1:
                if method == "GET":
                    return self.group_view(self._group_key(project, zone, tail[0]))
                if method == "DELETE":
                    return self.delete_group(project, zone, tail[0])
            elif len(tail) == 2 and tail[1] == "listManagedInstances" and method == "POST":
                return {"managedInstances": self.managed_instances(
                    self._group_key(project, zone, tail[0]))}
            elif len(tail) == 2 and tail[1] == "resize" and method == "POST":
                return self.resize_group(project, zone, tail[0], query.get("size"))
            elif len(tail) == 2 and tail[1] == "recreateInstances" and method == "POST":
                return self.recreate_instances(project, zone, tail[0], body)
            elif len(tail) == 2 and tail[1] == "updatePerInstanceConfigs" and method == "POST":
                return self.update_instance_configs(project, zone, tail[0], body)
            elif len(tail) == 2 and tail[1] == "listPerInstanceConfigs" and method == "POST":
                key = self._group_key(project, zone, tail[0])
                return {"items": [json.loads(json.dumps(c)) for _, c in sorted(
                    (self.state["groups"][key].get("configs") or {}).items())]}
        raise _not_found("", rest)

    def _regional(self, method: str, project: str, region: str, p: list[str],
                  query: dict[str, str], body: dict[str, Any], rest: str) -> dict[str, Any]:
        if not p:
            return {"kind": "compute#region", "name": region, "status": "UP",
                    "selfLink": self.link(f"projects/{project}/regions/{region}")}
        kind, tail = p[0], p[1:]
        if kind == "operations" and tail:
            return self._operations(method, project, "regions", region, tail)
        if kind == "resourcePolicies":
            prefix = f"projects/{project}/regions/{region}/resourcePolicies/"
            if not tail and method == "GET":
                items = [json.loads(json.dumps(v)) for k, v in self.state["policies"].items()
                         if k.startswith(prefix)]
                return self._list("compute#resourcePolicyList", items, project,
                                  f"regions/{region}/resourcePolicies")
            if not tail and method == "POST":
                return self.insert_policy(project, region, body)
            if len(tail) == 1:
                key = prefix + tail[0]
                if key not in self.state["policies"]:
                    raise _not_found("resourcePolicy", key.removeprefix("projects/"))
                if method == "GET":
                    return json.loads(json.dumps(self.state["policies"][key]))
                if method == "DELETE":
                    self._refuse_in_use(key, "workloadPolicy")
                    del self.state["policies"][key]
                    return self._operation(project, "regions", region, "delete",
                                           key)
        raise _not_found("", rest)

    def _global(self, method: str, project: str, p: list[str], query: dict[str, str],
                body: dict[str, Any], rest: str) -> dict[str, Any]:
        if not p:
            raise _not_found("", rest)
        kind, tail = p[0], p[1:]
        if kind == "operations" and tail:
            return self._global_operation(method, project, tail)
        if kind == "images":  # any image a boot disk names: the TPU VM software
            name = tail[-1] if tail else "image"
            return {"kind": "compute#image", "name": name, "id": "1", "status": "READY",
                    "family": tail[-1] if tail[:1] == ["family"] else "",
                    "selfLink": self.link(f"projects/{project}/global/images/{name}"),
                    "diskSizeGb": "100", "architecture": "X86_64"}
        if kind == "networks" and tail:
            return {"kind": "compute#network", "name": tail[0],
                    "selfLink": self.link(f"projects/{project}/global/networks/{tail[0]}")}
        if kind == "instanceTemplates":
            prefix = f"projects/{project}/global/instanceTemplates/"
            if not tail and method == "GET":
                items = [json.loads(json.dumps(v)) for k, v in self.state["templates"].items()
                         if k.startswith(prefix)]
                return self._list("compute#instanceTemplateList", items, project,
                                  "global/instanceTemplates")
            if not tail and method == "POST":
                return self.insert_template(project, body)
            if len(tail) == 1:
                key = prefix + tail[0]
                if key not in self.state["templates"]:
                    raise _not_found("instanceTemplate", key.removeprefix("projects/"))
                if method == "GET":
                    return json.loads(json.dumps(self.state["templates"][key]))
                if method == "DELETE":
                    self._refuse_in_use(key, "instanceTemplate")
                    del self.state["templates"][key]
                    return self._global_op(project, "delete", key)
        raise _not_found("", rest)

    def _global_operation(self, method: str, project: str, tail: list[str]) -> dict[str, Any]:
        path = f"projects/{project}/global/operations/{tail[0]}"
        if method == "GET" and len(tail) == 1:
            return self._op_view(path)
        if method == "POST" and tail[1:] == ["wait"]:
            return self._wait_op(path)
        raise _not_found("operation", path.removeprefix("projects/"))

    def _global_op(self, project: str, kind: str, target: str) -> dict[str, Any]:
        name = f"operation-{int(time.time() * 1000)}-{secrets.token_hex(6)}"
        path = f"projects/{project}/global/operations/{name}"
        op = {"kind": "compute#operation", "id": _new_id(), "name": name,
              "operationType": kind, "targetLink": self.link(target), "status": "DONE",
              "progress": 100, "insertTime": rfc3339(), "startTime": rfc3339(),
              "endTime": rfc3339(), "selfLink": self.link(path)}
        self.state["operations"][path] = {"op": op, "node": None, "until": "done"}
        self.emu._save()
        return json.loads(json.dumps(op))

    def _list(self, kind: str, items: list[dict[str, Any]], project: str,
              where: str) -> dict[str, Any]:
        return {"kind": kind, "id": f"projects/{project}/{where}", "items": items,
                "selfLink": self.link(f"projects/{project}/{where}")}

    def _refuse_in_use(self, key: str, field: str) -> None:
        for group_key, group in self.state["groups"].items():
            used = group["group"].get("instanceTemplate", "") if field == "instanceTemplate" \
                else (group["group"].get("resourcePolicies") or {}).get("workloadPolicy", "")
            if used and used.endswith(key.split("/", 2)[2]):
                raise _error(400, "resourceInUseByAnotherResource",
                             f"The resource '{key}' is already being used by '{group_key}'")

    # ---------------------------------------------------------------- reservations

    def _reservations(self, method: str, project: str, zone: str, tail: list[str],
                      body: dict[str, Any], rest: str) -> dict[str, Any]:
        """Specific reservations: made and listed; VMs that name one consume it (the sim
        keeps no count)."""
        prefix = f"projects/{project}/zones/{zone}/reservations/"
        if not tail and method == "GET":
            items = [json.loads(json.dumps(v)) for k, v in self.state["reservations"].items()
                     if k.startswith(prefix)]
            return self._list("compute#reservationList", items, project,
                              f"zones/{zone}/reservations")
        if not tail and method == "POST":
            name = self._check_name("reservation", body.get("name"))
            key = prefix + name
            if key in self.state["reservations"]:
                raise _error(409, "alreadyExists", f"The resource '{key}' already exists")
            self.state["reservations"][key] = {
                "kind": "compute#reservation", "id": _new_id(), "name": name,
                "creationTimestamp": rfc3339(), "zone": self.link(
                    f"projects/{project}/zones/{zone}"), "selfLink": self.link(key),
                "status": "READY", "specificReservationRequired": bool(
                    body.get("specificReservationRequired", True)),
                "specificReservation": body.get("specificReservation") or {}}
            return self._operation(project, "zones", zone, "insert", key)
        if len(tail) == 1:
            key = prefix + tail[0]
            if key not in self.state["reservations"]:
                raise _not_found("reservation", key)
            if method == "GET":
                return json.loads(json.dumps(self.state["reservations"][key]))
            if method == "DELETE":
                del self.state["reservations"][key]
                return self._operation(project, "zones", zone, "delete", key)
        raise _not_found("", rest)

    # ---------------------------------------------------------------- machine types

    def _machine_types(self, project: str, zone: str, name: str | None) -> dict[str, Any]:
        def view(machine: str) -> dict[str, Any]:
            generation, chips = MACHINE_TYPES[machine]
            cpus, memory = HOST_SIZE.get(chips, (chips * 24, chips * 96 * 1024))
            return {"kind": "compute#machineType", "id": str(abs(hash(machine)) % 10**12),
                    "name": machine, "description": f"{cpus} vCPUs, {chips} {generation} "
                    "TPU chips", "guestCpus": cpus, "memoryMb": memory,
                    "maximumPersistentDisks": 128, "maximumPersistentDisksSizeGb": "263168",
                    "zone": zone, "isSharedCpu": False,
                    "accelerators": [{"guestAcceleratorType": generation,
                                      "guestAcceleratorCount": chips}],
                    "selfLink": self.link(f"projects/{project}/zones/{zone}/machineTypes/"
                                          f"{machine}")}

        if name is None:
            return self._list("compute#machineTypeList", [view(m) for m in MACHINE_TYPES],
                              project, f"zones/{zone}/machineTypes")
        if name not in MACHINE_TYPES:
            raise _not_found("machineType", f"{project}/zones/{zone}/machineTypes/{name}")
        return view(name)

    # ---------------------------------------------------------------- instances

    def _instances(self, project: str, zone: str) -> list[dict[str, Any]]:
        prefix = f"projects/{project}/zones/{zone}/instances/"
        return [self.instance_view(r) for k, r in self.state["instances"].items()
                if k.startswith(prefix)]

    def _aggregated_instances(self, project: str) -> dict[str, Any]:
        zones: dict[str, list[dict[str, Any]]] = {}
        for key, record in self.state["instances"].items():
            if key.startswith(f"projects/{project}/zones/"):
                zones.setdefault(f"zones/{key.split('/')[3]}", []).append(
                    self.instance_view(record))
        return {"kind": "compute#instanceAggregatedList", "id": f"projects/{project}/"
                "aggregated/instances",
                "items": {z: {"instances": v} for z, v in sorted(zones.items())},
                "selfLink": self.link(f"projects/{project}/aggregated/instances")}

    def _instance(self, project: str, zone: str, name: str) -> dict[str, Any]:
        key = f"projects/{project}/zones/{zone}/instances/{name}"
        record = self.state["instances"].get(key)
        if record is None:
            raise _not_found("instance", key.removeprefix("projects/"))
        return record

    def instance_view(self, record: dict[str, Any]) -> dict[str, Any]:
        inst = json.loads(json.dumps(record["instance"]))
        node = self.emu._state["nodes"].get(record.get("node") or "")
        worker = record.get("worker", 0)
        if node is None:
            inst["status"] = record.get("status", "PROVISIONING")
            return inst
        state = node["node"]["state"]
        inst["status"] = INSTANCE_STATUS.get(state, "RUNNING")
        if str(worker) in (node["sim"].get("recreating") or {}):
            inst["status"] = "STAGING"  # a MIG recreating this VM: it boots again
        endpoints = node["node"].get("networkEndpoints") or []
        if worker < len(endpoints):
            nic = inst["networkInterfaces"][0]
            nic["networkIP"] = endpoints[worker]["ipAddress"]
            external = (endpoints[worker].get("accessConfig") or {}).get("externalIp")
            if external and nic.get("accessConfigs"):
                nic["accessConfigs"][0]["natIP"] = external
            elif not external:
                nic.pop("accessConfigs", None)
        if record.get("group"):  # a MIG's VM: its metadata is the slice's (setMetadata on any),
            own = {i["key"]: i["value"] for i in inst["metadata"]["items"]   # but the keys
                   if i["key"] in ("created-by", "instance-template")}      # the MIG set on it
            inst["metadata"]["items"] = [{"key": k, "value": v} for k, v in sorted(
                {**(node["node"].get("metadata") or {}), **own}.items())]
        if (node["sim"].get("notices") or {}).get("preempted") or state == "PREEMPTED":
            inst["lastStopTimestamp"] = inst.get("lastStopTimestamp") or rfc3339()
        return inst

    @staticmethod
    def _check_name(kind: str, name: str | None) -> str:
        if not name or not ID_RE.match(name):
            raise _error(400, "invalid", f"Invalid value for field 'resource.name': "
                         f"'{name}'. Must be a match of regex '(?:[a-z](?:[-a-z0-9]{{0,61}}"
                         "[a-z0-9])?)'")
        return name

    @staticmethod
    def _items(metadata: dict[str, Any] | None) -> dict[str, str]:
        out = {}
        for item in (metadata or {}).get("items") or []:
            if not isinstance(item, dict) or "key" not in item:
                raise _error(400, "invalid", "Each metadata item needs a key and a value.")
            out[str(item["key"])] = str(item.get("value") or "")
        return out

    def _reservation_check(self, project: str, zone: str, props: dict[str, Any]) -> None:
        affinity = props.get("reservationAffinity") or {}
        if affinity.get("consumeReservationType") != "SPECIFIC_RESERVATION":
            return
        for value in affinity.get("values") or []:
            name = _short(value)
            if f"projects/{project}/zones/{zone}/reservations/{name}" not in \
                    self.state["reservations"]:
                raise _error(400, "invalid", f"The resource 'projects/{project}/zones/{zone}/"
                             f"reservations/{name}' was not found")

    def _scheduling(self, props: dict[str, Any]) -> dict[str, Any]:
        scheduling = dict(props.get("scheduling") or {})
        model = scheduling.get("provisioningModel") or (
            "SPOT" if scheduling.get("preemptible") else "STANDARD")
        if model not in PROVISIONING_MODELS:
            raise _error(400, "invalid", f"Invalid value for field "
                         f"'resource.scheduling.provisioningModel': '{model}'.")
        if model == "FLEX_START" and not scheduling.get("maxRunDuration"):
            raise _error(400, "invalid", "Flex-start VMs need scheduling.maxRunDuration.")
        scheduling["provisioningModel"] = model
        scheduling.setdefault("onHostMaintenance", "TERMINATE")
        scheduling.setdefault("automaticRestart", False)
        return scheduling

    def insert_instance(self, project: str, zone: str, body: dict[str, Any]) -> dict[str, Any]:
        name = self._check_name("instance", body.get("name"))
        key = f"projects/{project}/zones/{zone}/instances/{name}"
        if key in self.state["instances"]:
            raise _error(409, "alreadyExists", f"The resource '{key}' already exists")
        machine = _short(body.get("machineType"))
        topo = topology_of(machine)
        self._reservation_check(project, zone, body)
        node_name = f"projects/{project}/locations/{zone}/ceInstances/{name}"
        instance = self._instance_record(project, zone, name, body, machine)
        failure = self.emu.create_backing_node(
            node_name, topo, metadata=self._items(body.get("metadata")),
            labels=dict(body.get("labels") or {}), scheduling=instance["scheduling"],
            external=self._external(body), names=[name])
        self.state["instances"][key] = {"instance": instance, "node": node_name, "worker": 0}
        self._run_timer(node_name, instance["scheduling"])
        return self._operation(project, "zones", zone, "insert", key, instance["id"],
                               wait_node=node_name, until="READY", failure=failure)

    @staticmethod
    def _external(props: dict[str, Any]) -> bool:
        nics = props.get("networkInterfaces")
        if not nics:
            return True
        return bool(nics[0].get("accessConfigs"))

    def _instance_record(self, project: str, zone: str, name: str, props: dict[str, Any],
                         machine: str) -> dict[str, Any]:
        nic = dict((props.get("networkInterfaces") or [{}])[0])
        nic.setdefault("network", self.link(f"projects/{project}/global/networks/default"))
        nic.setdefault("subnetwork", self.link(
            f"projects/{project}/regions/{_region(zone)}/subnetworks/default"))
        nic["name"] = "nic0"
        nic["kind"] = "compute#networkInterface"
        if nic.get("accessConfigs"):
            nic["accessConfigs"] = [{"kind": "compute#accessConfig", "type": "ONE_TO_ONE_NAT",
                                     "name": "External NAT", "networkTier": "PREMIUM"}]
        items = self._items(props.get("metadata"))
        instance = {
            "kind": "compute#instance", "id": _new_id(), "name": name,
            "creationTimestamp": rfc3339(), "description": props.get("description", ""),
            "zone": self.link(f"projects/{project}/zones/{zone}"),
            "machineType": self.link(f"projects/{project}/zones/{zone}/machineTypes/{machine}"),
            "networkInterfaces": [nic],
            "disks": [{"kind": "compute#attachedDisk", "boot": True, "autoDelete": True,
                       "deviceName": "persistent-disk-0", "index": 0, "mode": "READ_WRITE",
                       "type": "PERSISTENT", "interface": "SCSI",
                       "source": self.link(f"projects/{project}/zones/{zone}/disks/{name}")}],
            "metadata": {"kind": "compute#metadata", "fingerprint": _fingerprint(),
                         "items": [{"key": k, "value": v} for k, v in sorted(items.items())]},
            "labels": dict(props.get("labels") or {}),
            "labelFingerprint": _fingerprint(),
            "scheduling": self._scheduling(props),
            "selfLink": self.link(f"projects/{project}/zones/{zone}/instances/{name}"),
            "cpuPlatform": "Simulated CPU", "startRestricted": False,
            "deletionProtection": False, "fingerprint": _fingerprint(),
        }
        for field in ("reservationAffinity", "serviceAccounts", "tags", "resourcePolicies"):
            if props.get(field):
                instance[field] = props[field]
        return instance

    def delete_instance(self, project: str, zone: str, name: str) -> dict[str, Any]:
        record = self._instance(project, zone, name)
        key = f"projects/{project}/zones/{zone}/instances/{name}"
        if record.get("group"):
            raise _error(400, "resourceInUseByAnotherResource",
                         f"The instance '{key}' belongs to managed instance group "
                         f"'{_short(record['group'])}'; resize or delete the group instead.")
        node_name = record["node"]
        del self.state["instances"][key]
        self.emu.delete_backing_node(node_name)
        return self._operation(project, "zones", zone, "delete", key,
                               record["instance"]["id"], wait_node=node_name, until="gone")

    def _set_metadata(self, project: str, zone: str, name: str,
                      body: dict[str, Any]) -> dict[str, Any]:
        record = self._instance(project, zone, name)
        items = self._items(body)
        record["instance"]["metadata"] = {"kind": "compute#metadata",
                                          "fingerprint": _fingerprint(),
                                          "items": [{"key": k, "value": v}
                                                    for k, v in sorted(items.items())]}
        key = f"projects/{project}/zones/{zone}/instances/{name}"
        op = self._operation(project, "zones", zone, "setMetadata", key,
                             record["instance"]["id"], until="metadata")
        path = f"projects/{project}/zones/{zone}/operations/{op['name']}"
        self.state["operations"][path]["done_check"] = "metadata"
        self.emu.set_backing_metadata(record["node"], items,
                                      done=lambda: self._synced(path))
        return op

    def _synced(self, path: str) -> None:
        with self.emu._lock:
            record = self.state["operations"].get(path)
            if record is not None:
                record["synced"] = True
                self._finish(path)
                self.emu._save()

    def _set_labels(self, project: str, zone: str, name: str,
                    body: dict[str, Any]) -> dict[str, Any]:
        record = self._instance(project, zone, name)
        record["instance"]["labels"] = dict(body.get("labels") or {})
        record["instance"]["labelFingerprint"] = _fingerprint()
        key = f"projects/{project}/zones/{zone}/instances/{name}"
        return self._operation(project, "zones", zone, "setLabels", key,
                               record["instance"]["id"])

    def _stop(self, project: str, zone: str, name: str) -> dict[str, Any]:
        record = self._instance(project, zone, name)
        if record.get("group"):
            raise _error(400, "invalid", "A VM of a multi-host TPU slice cannot be stopped "
                         "on its own.")
        self.emu.stop_backing_node(record["node"])
        key = f"projects/{project}/zones/{zone}/instances/{name}"
        return self._operation(project, "zones", zone, "stop", key, record["instance"]["id"],
                               wait_node=record["node"], until="STOPPED")

    def _start(self, project: str, zone: str, name: str) -> dict[str, Any]:
        record = self._instance(project, zone, name)
        self.emu.start_backing_node(record["node"])
        key = f"projects/{project}/zones/{zone}/instances/{name}"
        return self._operation(project, "zones", zone, "start", key, record["instance"]["id"],
                               wait_node=record["node"], until="READY")

    def _simulate_maintenance(self, project: str, zone: str, name: str) -> dict[str, Any]:
        """instances.simulateMaintenanceEvent: the VM's metadata server says
        ``instance/maintenance-event: TERMINATE_ON_HOST_MAINTENANCE`` for a while (the
        emulator's maintenance_notice), as a TPU API node's worker does."""
        record = self._instance(project, zone, name)
        self.emu.guest.simulate_maintenance("v2", record["node"],
                                            {"workerIds": [record.get("worker", 0)]})
        key = f"projects/{project}/zones/{zone}/instances/{name}"
        return self._operation(project, "zones", zone, "simulateMaintenanceEvent", key,
                               record["instance"]["id"])

    def _guest_attributes(self, project: str, zone: str, name: str,
                          query: dict[str, str]) -> dict[str, Any]:
        record = self._instance(project, zone, name)
        node = self.emu._state["nodes"].get(record["node"])
        query_path = query.get("queryPath") or ""
        items = []
        if node is not None:
            key = (node["sim"].get("hostKeys") or {}).get(str(record.get("worker", 0)))
            if key:
                key_type, _, blob = key.partition(" ")
                items.append({"namespace": "hostkeys", "key": key_type,
                              "value": blob.split()[0] if blob else ""})
        items = [i for i in items if f"{i['namespace']}/{i['key']}".startswith(query_path)
                 or (i["namespace"] + "/").startswith(query_path)]
        if not items:
            raise _not_found("guestAttributes", f"{project}/zones/{zone}/instances/{name}/"
                             f"guestAttributes/{query_path}")
        return {"kind": "compute#guestAttributes", "queryPath": query_path,
                "queryValue": {"items": items},
                "selfLink": self.link(f"projects/{project}/zones/{zone}/instances/{name}/"
                                      "getGuestAttributes")}

    # ---------------------------------------------------------------- policies, templates

    def insert_policy(self, project: str, region: str, body: dict[str, Any]) -> dict[str, Any]:
        name = self._check_name("resourcePolicy", body.get("name"))
        key = f"projects/{project}/regions/{region}/resourcePolicies/{name}"
        if key in self.state["policies"]:
            raise _error(409, "alreadyExists", f"The resource '{key}' already exists")
        workload = body.get("workloadPolicy")
        if not isinstance(workload, dict):
            raise _error(400, "invalid", "Only workload policies (workloadPolicy) are "
                         "emulated.")
        if workload.get("type") not in ("HIGH_THROUGHPUT", "HIGH_AVAILABILITY"):
            raise _error(400, "invalid", "Invalid value for field "
                         f"'resource.workloadPolicy.type': '{workload.get('type')}'.")
        self.state["policies"][key] = {
            "kind": "compute#resourcePolicy", "id": _new_id(), "name": name,
            "creationTimestamp": rfc3339(), "description": body.get("description", ""),
            "region": self.link(f"projects/{project}/regions/{region}"),
            "selfLink": self.link(key), "status": "READY",
            "workloadPolicy": {k: v for k, v in workload.items()
                               if k in ("type", "acceleratorTopology", "maxTopologyDistance")},
        }
        return self._operation(project, "regions", region, "insert", key)

    def insert_template(self, project: str, body: dict[str, Any]) -> dict[str, Any]:
        name = self._check_name("instanceTemplate", body.get("name"))
        key = f"projects/{project}/global/instanceTemplates/{name}"
        if key in self.state["templates"]:
            raise _error(409, "alreadyExists", f"The resource '{key}' already exists")
        props = dict(body.get("properties") or {})
        topology_of(_short(props.get("machineType")))
        self._scheduling(props)
        self.state["templates"][key] = {
            "kind": "compute#instanceTemplate", "id": _new_id(), "name": name,
            "creationTimestamp": rfc3339(), "description": body.get("description", ""),
            "properties": props, "selfLink": self.link(key),
        }
        return self._global_op(project, "insert", key)

    # ---------------------------------------------------------------- groups

    def _group_key(self, project: str, zone: str, name: str) -> str:
        key = f"projects/{project}/zones/{zone}/instanceGroupManagers/{name}"
        if key not in self.state["groups"]:
            raise _not_found("instanceGroupManager", key.removeprefix("projects/"))
        return key

    def _lookup(self, table: str, url: str, project: str, scope: str) -> tuple[str, dict]:
        """A full URL, a partial one (``projects/P/...``, ``regions/R/...``,
        ``global/...``) or a bare name -> (state key, record)."""
        path = url.split("/compute/v1/", 1)[-1].strip("/")
        if path.startswith("projects/"):
            key = path
        elif "/" in path:
            key = f"projects/{project}/{path}"
        else:
            key = f"projects/{project}/{scope}/{path}"
        found = self.state[table].get(key)
        if found is None:
            raise _error(404, "notFound", f"The resource '{key}' was not found")
        return key, found

    def insert_group(self, project: str, zone: str, body: dict[str, Any]) -> dict[str, Any]:
        name = self._check_name("instanceGroupManager", body.get("name"))
        key = f"projects/{project}/zones/{zone}/instanceGroupManagers/{name}"
        if key in self.state["groups"]:
            raise _error(409, "alreadyExists", f"The resource '{key}' already exists")
        template_key, template = self._lookup("templates", body.get("instanceTemplate") or "",
                                              project, "global/instanceTemplates")
        size = int(body.get("targetSize") or 0)
        policy_url = (body.get("resourcePolicies") or {}).get("workloadPolicy") or ""
        accel = None
        policy_key = None
        if policy_url:
            policy_key, policy = self._lookup("policies", policy_url, project,
                                              f"regions/{_region(zone)}/resourcePolicies")
            accel = (policy.get("workloadPolicy") or {}).get("acceleratorTopology")
        props = template["properties"]
        machine = _short(props.get("machineType"))
        topo = topology_of(machine, accel)
        if accel and size not in (0, topo.hosts):
            raise _error(400, "invalid", f"A managed instance group with workload policy "
                         f"'{_short(policy_url)}' (accelerator topology {accel}) must have "
                         f"a target size of {topo.hosts} VMs, not {size}.")
        self._reservation_check(project, zone, props)
        if size:  # refused before anything is recorded or starts, as a too-big TPU API node
            self.emu._check_capacity([topo] if accel else [topo] * size)
        base = body.get("baseInstanceName") or name
        group = {
            "kind": "compute#instanceGroupManager", "id": _new_id(), "name": name,
            "creationTimestamp": rfc3339(), "description": body.get("description", ""),
            "zone": self.link(f"projects/{project}/zones/{zone}"),
            "instanceTemplate": self.link(template_key), "baseInstanceName": base,
            "targetSize": size, "selfLink": self.link(key),
            "instanceGroup": self.link(f"projects/{project}/zones/{zone}/instanceGroups/{name}"),
            "fingerprint": _fingerprint(),
            "updatePolicy": {"type": "OPPORTUNISTIC"},
        }
        if policy_key:
            group["resourcePolicies"] = {"workloadPolicy": self.link(policy_key)}
        self.state["groups"][key] = {"group": group, "nodes": [], "members": []}
        node = self._grow(key, size)
        return self._operation(project, "zones", zone, "insert", key, group["id"],
                               wait_node=node, until="READY" if node else "done",
                               failure=self.state["groups"][key].get("failure"))

    def _grow(self, key: str, size: int) -> str | None:
        """Create the VMs of group ``key`` up to ``size``; the backing node to wait for."""
        record = self.state["groups"][key]
        group = record["group"]
        project, zone = key.split("/")[1], key.split("/")[3]
        template = self._lookup("templates", group["instanceTemplate"], project,
                                "global/instanceTemplates")[1]
        props = template["properties"]
        machine = _short(props.get("machineType"))
        accel = None
        if group.get("resourcePolicies"):
            policy = self._lookup("policies", group["resourcePolicies"]["workloadPolicy"],
                                  project, f"regions/{_region(zone)}/resourcePolicies")[1]
            accel = policy["workloadPolicy"].get("acceleratorTopology")
        members = record["members"]
        if size <= len(members):
            return None
        new = [f"{group['baseInstanceName']}-{secrets.token_hex(2)}"
               for _ in range(size - len(members))]
        metadata = self._items(props.get("metadata"))
        scheduling = self._scheduling(props)
        wait = None
        short = self._take_short(zone) if accel else 0
        if short:  # a stockout on some VMs: the MIG keeps trying to create them
            record["missing"] = {n: stockout_text(zone) for n in new[len(new) - short:]}
        if accel:  # one slice: one backing node, worker i = VM i
            topo = topology_of(machine, accel)
            node_name = f"projects/{project}/locations/{zone}/ceGroups/{group['name']}"
            record["failure"] = self.emu.create_backing_node(
                node_name, topo, metadata=metadata, labels=dict(props.get("labels") or {}),
                scheduling=scheduling, external=self._external(props), names=new,
                accelerator_topology=accel)
            record["nodes"] = [node_name]
            wait = node_name
            pairs = [(n, node_name, i) for i, n in enumerate(new)]
        else:  # independent single-host VMs
            topo = topology_of(machine)
            pairs = []
            for n in new:
                node_name = f"projects/{project}/locations/{zone}/ceInstances/{n}"
                record["failure"] = self.emu.create_backing_node(
                    node_name, topo, metadata=metadata, labels=dict(props.get("labels") or {}),
                    scheduling=scheduling, external=self._external(props), names=[n])
                record["nodes"].append(node_name)
                pairs.append((n, node_name, 0))
                wait = node_name
        for n, node_name, worker in pairs:
            if n in (record.get("missing") or {}):
                continue
            inst_key = f"projects/{project}/zones/{zone}/instances/{n}"
            instance = self._instance_record(project, zone, n, props, machine)
            items = instance["metadata"]["items"]
            items += [{"key": "created-by", "value": group["selfLink"]},
                      {"key": "instance-template", "value": group["instanceTemplate"]}]
            self.state["instances"][inst_key] = {"instance": instance, "node": node_name,
                                                 "worker": worker, "group": key}
            members.append(inst_key)
        for node_name in sorted({n for _, n, _ in pairs}):
            self._run_timer(node_name, scheduling)
        return wait

    # ---------------------------------------------------------------- maxRunDuration

    def _run_timer(self, node_name: str, scheduling: dict[str, Any]) -> None:
        """A VM with ``scheduling.maxRunDuration`` (flex-start) ends after it: Compute
        Engine performs its ``instanceTerminationAction`` (tpufab/docs/control-plane.md).
        The timer counts from the create and does not survive a restart of the daemon;
        `sim end-run` (``end_run``) ends it at once."""
        run = scheduling.get("maxRunDuration")
        if not run:
            return
        seconds = float(run.get("seconds") or 0) if isinstance(run, dict) else \
            float(str(run).rstrip("s") or 0)
        node = self.emu._state["nodes"].get(node_name)
        if node is not None and seconds > 0:
            self.emu._spawn(self._end_after, node_name, node["node"]["id"], seconds)

    def _end_after(self, node_name: str, node_id: str, seconds: float) -> None:
        if self.emu._stopping.wait(seconds):
            return
        with self.emu._lock:
            record = self.emu._state["nodes"].get(node_name)
            if record is None or record["node"]["id"] != node_id:
                return
        self.end_run(node_name)

    def end_run(self, node_name: str) -> dict[str, Any]:
        """End the run of the VMs behind backing node ``node_name`` (a MIG's ``ceGroups/N``
        or a VM's ``ceInstances/N``) as Compute Engine does at maxRunDuration:
        ``instanceTerminationAction`` DELETE deletes the VMs (a MIG's target size drops to 0,
        as for a MIG's flex-start resize request), STOP stops them."""
        with self.emu._lock:
            owners = [(k, r) for k, r in self.state["instances"].items()
                      if r.get("node") == node_name]
            if not owners:
                raise _error(404, "notFound", f"No Compute Engine VM is backed by {node_name}.")
            scheduling = owners[0][1]["instance"].get("scheduling") or {}
            action = scheduling.get("instanceTerminationAction") or "STOP"
            group_key = owners[0][1].get("group")
            if action != "DELETE":
                state = self.emu._state["nodes"][node_name]["node"]["state"]
                if state == "READY":
                    self.emu.stop_backing_node(node_name)
            elif group_key:
                self._shrink_all(group_key)
                self.state["groups"][group_key]["group"]["targetSize"] = 0
            else:
                for key, _ in owners:
                    del self.state["instances"][key]
                self.emu.delete_backing_node(node_name)
            self.emu._save()
        return {"name": node_name, "instanceTerminationAction": action}

    def group_view(self, key: str) -> dict[str, Any]:
        record = self.state["groups"][key]
        group = json.loads(json.dumps(record["group"]))
        statuses = [self.instance_view(self.state["instances"][m])["status"]
                    for m in record["members"] if m in self.state["instances"]]
        creating = sum(1 for s in statuses if s in ("PROVISIONING", "STAGING")) + \
            len(record.get("missing") or {})
        recreating = sum(1 for m in record["members"] if m in self.state["instances"] and
                         str(self.state["instances"][m].get("worker", 0)) in
                         ((self.emu._state["nodes"].get(self.state["instances"][m].get("node")
                                                        or "") or {"sim": {}})["sim"]
                          .get("recreating") or {}))
        creating -= recreating
        group["currentActions"] = {"none": len(statuses) - creating - recreating,
                                   "creating": creating,
                                   "deleting": 0, "recreating": recreating, "restarting": 0,
                                   "abandoning": 0, "refreshing": 0, "verifying": 0,
                                   "creatingWithoutRetries": 0, "suspending": 0,
                                   "resuming": 0, "stopping": 0, "starting": 0}
        group["status"] = {"isStable": creating == 0 and not recreating and
                           len(statuses) == group["targetSize"]}
        return group

    def managed_instances(self, key: str) -> list[dict[str, Any]]:
        record = self.state["groups"][key]
        out = []
        for member in record["members"]:
            inst = self.state["instances"].get(member)
            if inst is None:
                continue
            view = self.instance_view(inst)
            node = self.emu._state["nodes"].get(inst.get("node") or "") or {"sim": {}}
            recreating = str(inst.get("worker", 0)) in (node["sim"].get("recreating") or {})
            entry = {"instance": view["selfLink"], "id": view["id"], "name": view["name"],
                     "instanceStatus": view["status"],
                     "currentAction": "RECREATING" if recreating else "CREATING" if
                     view["status"] in ("PROVISIONING", "STAGING") else "NONE"}
            config = (record.get("configs") or {}).get(view["name"])
            if config and config.get("preservedState"):
                entry["preservedStateFromConfig"] = json.loads(json.dumps(
                    config["preservedState"]))
            out.append(entry)
        project, zone = key.split("/")[1], key.split("/")[3]
        for name, message in sorted((record.get("missing") or {}).items()):
            out.append({"instance": self.link(f"projects/{project}/zones/{zone}/instances/{name}"),
                        "name": name, "currentAction": "CREATING",
                        "lastAttempt": {"errors": {"errors": [
                            {"code": "ZONE_RESOURCE_POOL_EXHAUSTED", "message": message}]}}})
        return out

    def _take_short(self, zone: str) -> int:
        """VMs the next multi-host MIG in ``zone`` cannot get (an armed ``vms`` fault)."""
        faults = self.emu._create_failures
        fault = next((f for f in faults if f.get("vms") and f.get("zone") in (None, zone)),
                     None)
        if fault is None:
            return 0
        fault["count"] -= 1
        if fault["count"] <= 0:
            faults.remove(fault)
        return int(fault["vms"])

    def _shrink_all(self, key: str) -> str | None:
        record = self.state["groups"][key]
        for member in record["members"]:
            self.state["instances"].pop(member, None)
        record["members"] = []
        record.pop("missing", None)
        last = None
        for node_name in record["nodes"]:
            self.emu.delete_backing_node(node_name)
            last = node_name
        record["nodes"] = []
        return last

    def resize_group(self, project: str, zone: str, name: str,
                     size_text: str | None) -> dict[str, Any]:
        key = self._group_key(project, zone, name)
        try:
            size = int(size_text or "")
        except ValueError:
            raise _error(400, "required", "Required field 'size' not specified") from None
        record = self.state["groups"][key]
        group = record["group"]
        sliced = bool(group.get("resourcePolicies"))
        current = len(record["members"])
        if sliced and size not in (0, current) and current:
            raise _error(400, "invalid", "A managed instance group of a multi-host TPU slice "
                         "can only be resized to 0 or back to its slice size.")
        group["targetSize"] = size
        wait, until = None, "done"
        if size == 0:
            wait, until = self._shrink_all(key), "gone"
        elif size > current:
            wait, until = self._grow(key, size), "READY"
        elif size < current:
            for member in record["members"][size:]:
                inst = self.state["instances"].pop(member, None)
                if inst:
                    self.emu.delete_backing_node(inst["node"])
                    record["nodes"].remove(inst["node"])
                    wait, until = inst["node"], "gone"
            record["members"] = record["members"][:size]
        return self._operation(project, "zones", zone, "resize", key, group["id"],
                               wait_node=wait, until=until if wait else "done")

    def recreate_instances(self, project: str, zone: str, name: str,
                           body: dict[str, Any]) -> dict[str, Any]:
        """instanceGroupManagers.recreateInstances: each VM named in ``instances`` is deleted
        and created again from the group's template under the same name (a new instance id,
        boot disk and host key; another internal IP: Emulator.recreate_backing_worker). As
        on Compute Engine the operation is DONE once the recreation is scheduled; the VM
        shows ``currentAction: RECREATING`` (and status STAGING) until it runs again."""
        key = self._group_key(project, zone, name)
        record = self.state["groups"][key]
        urls = body.get("instances") or []
        if not urls:
            raise _error(400, "required", "Required field 'instances' not specified")
        targets = []
        for url in urls:
            inst_key = f"projects/{project}/zones/{zone}/instances/{_short(url)}"
            if inst_key not in record["members"] or inst_key not in self.state["instances"]:
                raise _error(400, "invalid", f"The instance '{inst_key}' is not a member of "
                             f"the managed instance group '{key}'.")
            targets.append(self.state["instances"][inst_key])
        for inst in targets:
            self.emu.recreate_backing_worker(inst["node"], inst.get("worker", 0))
            inst["instance"]["id"] = _new_id()
            inst["instance"]["creationTimestamp"] = rfc3339()
            inst["instance"]["fingerprint"] = _fingerprint()
        return self._operation(project, "zones", zone, "recreateInstances", key,
                               record["group"]["id"])

    def update_instance_configs(self, project: str, zone: str, name: str,
                                body: dict[str, Any]) -> dict[str, Any]:
        """instanceGroupManagers.updatePerInstanceConfigs: per-instance configs (stateful
        metadata in ``preservedState.metadata``), kept by VM name, so they outlive a
        recreation; listManagedInstances shows them as ``preservedStateFromConfig``."""
        key = self._group_key(project, zone, name)
        record = self.state["groups"][key]
        configs = record.setdefault("configs", {})
        for config in body.get("perInstanceConfigs") or []:
            vm = self._check_name("instance", (config or {}).get("name"))
            metadata = ((config.get("preservedState") or {}).get("metadata") or {})
            if not isinstance(metadata, dict) or \
                    not all(isinstance(v, str) for v in metadata.values()):
                raise _error(400, "invalid", "preservedState.metadata must map strings to "
                             "strings.")
            configs[vm] = {"name": vm, "fingerprint": _fingerprint(), "status": "EFFECTIVE",
                           "preservedState": {"metadata": dict(metadata)}}
        self.emu._save()
        return self._operation(project, "zones", zone, "updatePerInstanceConfigs", key,
                               record["group"]["id"])

    def delete_group(self, project: str, zone: str, name: str) -> dict[str, Any]:
        key = self._group_key(project, zone, name)
        last = self._shrink_all(key)
        group = self.state["groups"].pop(key)["group"]
        return self._operation(project, "zones", zone, "delete", key, group["id"],
                               wait_node=last, until="gone" if last else "done")


def stockout_text(zone: str) -> str:
    """Compute Engine's words for a VM it has no capacity for (the error code is
    ZONE_RESOURCE_POOL_EXHAUSTED; the wording is the emulator's)."""
    return (f"The zone '{zone}' does not have enough resources available to fulfill the "
            "request. Try a different zone, or try again later.")


def hostname_of(record: dict[str, Any], worker: int) -> str:
    """A backing node's worker hostname: the VM's instance name on Compute Engine."""
    names = (record.get("sim") or {}).get("instanceNames") or []
    if worker < len(names):
        return names[worker]
    return worker_hostname(record["node"]["id"], worker)
