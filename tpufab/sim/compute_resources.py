"""The Compute Engine emulator's project resources beside instances and MIGs: machine types of
the TPU families, regional resource policies (workload policies), global instance templates
and zonal reservations."""

from __future__ import annotations

import json
from typing import Any

from tpufab.sim._model import rfc3339
from tpufab.sim.compute_shapes import (
    HOST_SIZE,
    MACHINE_TYPES,
    check_name,
    error,
    new_id,
    not_found,
    scheduling_of,
    short,
    topology_of,
)
from tpufab.sim.compute_state import ComputeState


class ProjectResources:
    """Machine types, resource policies, instance templates and reservations (caller holds
    the store's lock)."""

    def __init__(self, state: ComputeState):
        self.state = state

    def reservations(self, method: str, project: str, zone: str, tail: list[str],
                     body: dict[str, Any], rest: str) -> dict[str, Any]:
        """Specific reservations: made and listed; VMs that name one consume it (the sim
        keeps no count)."""
        prefix = f"projects/{project}/zones/{zone}/reservations/"
        if not tail and method == "GET":
            items = [json.loads(json.dumps(v)) for k, v in self.state["reservations"].items()
                     if k.startswith(prefix)]
            return self.state.list("compute#reservationList", items, project,
                              f"zones/{zone}/reservations")
        if not tail and method == "POST":
            name = check_name("reservation", body.get("name"))
            key = prefix + name
            if key in self.state["reservations"]:
                raise error(409, "alreadyExists", f"The resource '{key}' already exists")
            self.state["reservations"][key] = {
                "kind": "compute#reservation", "id": new_id(), "name": name,
                "creationTimestamp": rfc3339(), "zone": self.state.link(
                    f"projects/{project}/zones/{zone}"), "selfLink": self.state.link(key),
                "status": "READY", "specificReservationRequired": bool(
                    body.get("specificReservationRequired", True)),
                "specificReservation": body.get("specificReservation") or {}}
            return self.state.operation(project, "zones", zone, "insert", key)
        if len(tail) == 1:
            key = prefix + tail[0]
            if key not in self.state["reservations"]:
                raise not_found("reservation", key)
            if method == "GET":
                return json.loads(json.dumps(self.state["reservations"][key]))
            if method == "DELETE":
                del self.state["reservations"][key]
                return self.state.operation(project, "zones", zone, "delete", key)
        raise not_found("", rest)

    # ---------------------------------------------------------------- machine types

    def machine_types(self, project: str, zone: str, name: str | None) -> dict[str, Any]:
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
                    "selfLink": self.state.link(f"projects/{project}/zones/{zone}/machineTypes/"
                                          f"{machine}")}

        if name is None:
            return self.state.list("compute#machineTypeList", [view(m) for m in MACHINE_TYPES],
                                   project, f"zones/{zone}/machineTypes")
        if name not in MACHINE_TYPES:
            raise not_found("machineType", f"{project}/zones/{zone}/machineTypes/{name}")
        return view(name)

    def insert_policy(self, project: str, region: str, body: dict[str, Any]) -> dict[str, Any]:
        name = check_name("resourcePolicy", body.get("name"))
        key = f"projects/{project}/regions/{region}/resourcePolicies/{name}"
        if key in self.state["policies"]:
            raise error(409, "alreadyExists", f"The resource '{key}' already exists")
        workload = body.get("workloadPolicy")
        if not isinstance(workload, dict):
            raise error(400, "invalid", "Only workload policies (workloadPolicy) are "
                         "emulated.")
        if workload.get("type") not in ("HIGH_THROUGHPUT", "HIGH_AVAILABILITY"):
            raise error(400, "invalid", "Invalid value for field "
                         f"'resource.workloadPolicy.type': '{workload.get('type')}'.")
        self.state["policies"][key] = {
            "kind": "compute#resourcePolicy", "id": new_id(), "name": name,
            "creationTimestamp": rfc3339(), "description": body.get("description", ""),
            "region": self.state.link(f"projects/{project}/regions/{region}"),
            "selfLink": self.state.link(key), "status": "READY",
            "workloadPolicy": {k: v for k, v in workload.items()
                               if k in ("type", "acceleratorTopology", "maxTopologyDistance")},
        }
        return self.state.operation(project, "regions", region, "insert", key)

    def insert_template(self, project: str, body: dict[str, Any]) -> dict[str, Any]:
        name = check_name("instanceTemplate", body.get("name"))
        key = f"projects/{project}/global/instanceTemplates/{name}"
        if key in self.state["templates"]:
            raise error(409, "alreadyExists", f"The resource '{key}' already exists")
        props = dict(body.get("properties") or {})
        topology_of(short(props.get("machineType")))
        scheduling_of(props)
        self.state["templates"][key] = {
            "kind": "compute#instanceTemplate", "id": new_id(), "name": name,
            "creationTimestamp": rfc3339(), "description": body.get("description", ""),
            "properties": props, "selfLink": self.state.link(key),
        }
        return self.state.global_op(project, "insert", key)
