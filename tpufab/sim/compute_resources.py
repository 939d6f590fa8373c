"""The Compute Engine emulator's project resources beside instances and MIGs: the project
itself (and its common instance metadata), zones and regions, machine types and accelerator
types of the TPU families, images and networks a VM names, regional resource policies
(workload policies), global instance templates and zonal reservations."""

from __future__ import annotations

import zlib
from typing import Any

from tpufab.sim._model import LOCATIONS, rfc3339
from tpufab.sim.catalog import project_number
from tpufab.sim.compute_shapes import (
    GENERAL_MACHINE_TYPES,
    HOST_SIZE,
    MACHINE_TYPES,
    check_name,
    default_account,
    error,
    metadata_items,
    new_id,
    not_found,
    region_of,
    scheduling_of,
    short,
    topology_of,
)
from tpufab.sim.compute_state import ComputeState
from tpufab.sim.oslogin import OsLoginService
from tpufab.sim.store import copy

# What Compute Engine says of resources that have always existed (zones, machine types...).
EPOCH = "1969-12-31T16:00:00.000-08:00"
PROJECT_CREATED = "2024-01-01T00:00:00.000-08:00"  # the simulated projects' birthday
REGIONS = sorted({region_of(z) for z in LOCATIONS})


def stable_id(*parts: str) -> str:
    """A uint64 id (as Compute Engine's JSON writes them: a string) stable across runs."""
    return str(zlib.crc32("/".join(parts).encode()) * 1000003 + 17)


ALL_MACHINE_TYPES = (*GENERAL_MACHINE_TYPES, *MACHINE_TYPES)

# accelerator name (what a TPU machine type's ``accelerators`` names) -> chips on its VMs
ACCELERATORS: dict[str, int] = {}
for _machine, (_generation, _chips) in MACHINE_TYPES.items():
    ACCELERATORS[_generation] = max(ACCELERATORS.get(_generation, 0), _chips)


class ProjectResources:
    """The project, zones, regions, types, images, policies, templates and reservations
    (caller holds the store's lock)."""

    def __init__(self, state: ComputeState, oslogin: OsLoginService):
        self.state = state
        self.oslogin = oslogin

    # ---------------------------------------------------------------- the project

    def project(self, project: str) -> dict[str, Any]:
        """projects.get: what gcloud reads before `compute ssh` (commonInstanceMetadata:
        enable-oslogin, ssh-keys)."""
        items = self.oslogin.project_metadata(project)
        return {
            "kind": "compute#project", "id": project_number(project), "name": project,
            "creationTimestamp": PROJECT_CREATED, "description": "",
            "commonInstanceMetadata": {
                "kind": "compute#metadata",
                "fingerprint": self.oslogin.project_fingerprint(project),
                "items": [{"key": k, "value": v} for k, v in sorted(items.items())]},
            "defaultServiceAccount": default_account(project),
            "defaultNetworkTier": "PREMIUM",
            "xpnProjectStatus": "UNSPECIFIED_XPN_PROJECT_STATUS",
            "selfLink": self.state.link(f"projects/{project}"),
        }

    def set_common_metadata(self, project: str, body: dict[str, Any]) -> dict[str, Any]:
        """projects.setCommonInstanceMetadata: the project's metadata, replaced as a whole
        (its ``ssh-keys`` reach every VM of the project that does not block them, as the guest
        agent merges them). A stale ``fingerprint`` is the API's 412."""
        wanted = body.get("fingerprint")
        current = self.oslogin.project_fingerprint(project)
        if wanted and wanted != current:
            raise error(412, "conditionNotMet", "Supplied fingerprint does not match current "
                        "metadata fingerprint.")
        self.oslogin.set_project_metadata(project, metadata_items(body))
        return self.state.operation(project, "global", "", "setCommonInstanceMetadata",
                                    f"projects/{project}", project_number(project))

    # ---------------------------------------------------------------- zones, regions

    def zone(self, project: str, zone: str) -> dict[str, Any]:
        if zone not in LOCATIONS:
            raise not_found("zone", f"{project}/zones/{zone}")
        return {"kind": "compute#zone", "id": stable_id("zone", zone), "name": zone,
                "creationTimestamp": EPOCH, "description": zone, "status": "UP",
                "region": self.state.link(f"projects/{project}/regions/{region_of(zone)}"),
                "selfLink": self.state.link(f"projects/{project}/zones/{zone}"),
                "availableCpuPlatforms": ["Simulated CPU"], "supportsPzs": False}

    def zones(self, project: str, query: dict[str, str]) -> dict[str, Any]:
        return self.state.list("compute#zoneList", [self.zone(project, z) for z in LOCATIONS],
                               project, "zones", query)

    def region(self, project: str, region: str) -> dict[str, Any]:
        if region not in REGIONS:
            raise not_found("region", f"{project}/regions/{region}")
        return {"kind": "compute#region", "id": stable_id("region", region), "name": region,
                "creationTimestamp": EPOCH, "description": region, "status": "UP",
                "zones": [self.state.link(f"projects/{project}/zones/{z}")
                          for z in LOCATIONS if region_of(z) == region],
                "quotas": [], "selfLink": self.state.link(f"projects/{project}/regions/{region}"),
                "supportsPzs": False}

    def regions(self, project: str, query: dict[str, str]) -> dict[str, Any]:
        return self.state.list("compute#regionList", [self.region(project, r) for r in REGIONS],
                               project, "regions", query)

    # ---------------------------------------------------------------- machine, accelerator types

    def machine_type(self, project: str, zone: str, machine: str) -> dict[str, Any]:
        if machine in GENERAL_MACHINE_TYPES:
            cpus, memory, shared = GENERAL_MACHINE_TYPES[machine]
            return {"kind": "compute#machineType", "id": stable_id("machineType", machine),
                    "creationTimestamp": EPOCH, "name": machine,
                    "description": (f"Efficient Instance, {cpus} vCPU(s) for a fraction of the "
                                    f"time, {memory / 1024:g} GB RAM" if shared else
                                    f"{cpus} vCPUs, {memory / 1024:g} GB RAM"),
                    "guestCpus": cpus, "memoryMb": memory, "maximumPersistentDisks": 16
                    if shared else 128, "maximumPersistentDisksSizeGb": "3072" if shared
                    else "263168", "zone": zone, "isSharedCpu": shared,
                    "architecture": "X86_64",
                    "selfLink": self.state.link(f"projects/{project}/zones/{zone}/"
                                                f"machineTypes/{machine}")}
        if machine not in MACHINE_TYPES:
            raise not_found("machineType", f"{project}/zones/{zone}/machineTypes/{machine}")
        generation, chips = MACHINE_TYPES[machine]
        cpus, memory = HOST_SIZE.get(chips, (chips * 24, chips * 96 * 1024))
        return {"kind": "compute#machineType", "id": stable_id("machineType", machine),
                "creationTimestamp": EPOCH, "name": machine,
                "description": f"{cpus} vCPUs, {chips} {generation} TPU chips",
                "guestCpus": cpus, "memoryMb": memory, "maximumPersistentDisks": 128,
                "maximumPersistentDisksSizeGb": "263168", "zone": zone, "isSharedCpu": False,
                "accelerators": [{"guestAcceleratorType": generation,
                                  "guestAcceleratorCount": chips}],
                "architecture": "X86_64",
                "selfLink": self.state.link(f"projects/{project}/zones/{zone}/machineTypes/"
                                            f"{machine}")}

    def machine_types(self, project: str, zone: str, query: dict[str, str]) -> dict[str, Any]:
        return self.state.list("compute#machineTypeList",
                               [self.machine_type(project, zone, m) for m in ALL_MACHINE_TYPES],
                               project, f"zones/{zone}/machineTypes", query)

    def aggregated_machine_types(self, project: str, query: dict[str, str]) -> dict[str, Any]:
        scoped = {f"zones/{z}": [self.machine_type(project, z, m) for m in ALL_MACHINE_TYPES]
                  for z in LOCATIONS}
        return self.state.aggregated("compute#machineTypeAggregatedList", "machineTypes",
                                     scoped, project, "machineTypes", query)

    def accelerator_type(self, project: str, zone: str, name: str) -> dict[str, Any]:
        """The TPU accelerators the machine types name (the emulator's names: which
        accelerator types Compute Engine lists for TPU machine types is not established)."""
        if name not in ACCELERATORS:
            raise not_found("acceleratorType", f"{project}/zones/{zone}/acceleratorTypes/{name}")
        return {"kind": "compute#acceleratorType", "id": stable_id("acceleratorType", name),
                "creationTimestamp": EPOCH, "name": name, "description": f"TPU {name}",
                "zone": self.state.link(f"projects/{project}/zones/{zone}"),
                "maximumCardsPerInstance": ACCELERATORS[name],
                "selfLink": self.state.link(f"projects/{project}/zones/{zone}/acceleratorTypes/"
                                            f"{name}")}

    def accelerator_types(self, project: str, zone: str,
                          query: dict[str, str]) -> dict[str, Any]:
        return self.state.list("compute#acceleratorTypeList",
                               [self.accelerator_type(project, zone, a) for a in ACCELERATORS],
                               project, f"zones/{zone}/acceleratorTypes", query)

    def aggregated_accelerator_types(self, project: str,
                                     query: dict[str, str]) -> dict[str, Any]:
        scoped = {f"zones/{z}": [self.accelerator_type(project, z, a) for a in ACCELERATORS]
                  for z in LOCATIONS}
        return self.state.aggregated("compute#acceleratorTypeAggregatedList",
                                     "acceleratorTypes", scoped, project, "acceleratorTypes",
                                     query)

    # ---------------------------------------------------------------- images, networks

    def image(self, project: str, name: str, family: str = "") -> dict[str, Any]:
        """Any image a boot disk names (the TPU VM software); by family: that family's."""
        name = name or f"{family}-v20240101"
        return {"kind": "compute#image", "id": stable_id("image", project, name), "name": name,
                "creationTimestamp": PROJECT_CREATED, "description": "", "status": "READY",
                "family": family, "sourceType": "RAW", "diskSizeGb": "100",
                "architecture": "X86_64",
                "selfLink": self.state.link(f"projects/{project}/global/images/{name}")}

    def network(self, project: str, name: str) -> dict[str, Any]:
        return {"kind": "compute#network", "id": stable_id("network", project, name),
                "name": name, "creationTimestamp": PROJECT_CREATED, "description": "",
                "autoCreateSubnetworks": True, "routingConfig": {"routingMode": "REGIONAL"},
                "selfLink": self.state.link(f"projects/{project}/global/networks/{name}")}

    # ---------------------------------------------------------------- reservations

    def _by_scope(self, table: str, project: str, field: str = "zone"
                  ) -> dict[str, list[dict[str, Any]]]:
        scoped: dict[str, list[dict[str, Any]]] = {}
        for key, value in self.state[table].items():
            parts = key.split("/")
            if parts[1] != project:
                continue
            scope = "global" if parts[2] == "global" else f"{parts[2]}/{parts[3]}"
            scoped.setdefault(scope, []).append(copy(value))
        return scoped

    def list_reservations(self, project: str, zone: str, query: dict[str, str]) -> dict[str, Any]:
        prefix = f"projects/{project}/zones/{zone}/reservations/"
        items = [copy(v) for k, v in self.state["reservations"].items() if k.startswith(prefix)]
        return self.state.list("compute#reservationList", items, project,
                               f"zones/{zone}/reservations", query)

    def aggregated_reservations(self, project: str, query: dict[str, str]) -> dict[str, Any]:
        return self.state.aggregated("compute#reservationAggregatedList", "reservations",
                                     self._by_scope("reservations", project), project,
                                     "reservations", query)

    def insert_reservation(self, project: str, zone: str, body: dict[str, Any]) -> dict[str, Any]:
        """Specific reservations: made and listed; VMs that name one consume it (the sim
        keeps no count)."""
        name = check_name("reservation", body.get("name"))
        key = f"projects/{project}/zones/{zone}/reservations/{name}"
        if key in self.state["reservations"]:
            raise error(409, "alreadyExists", f"The resource '{key}' already exists")
        self.state["reservations"][key] = {
            "kind": "compute#reservation", "id": new_id(), "name": name,
            "creationTimestamp": rfc3339(), "description": body.get("description", ""),
            "zone": self.state.link(f"projects/{project}/zones/{zone}"),
            "selfLink": self.state.link(key), "status": "READY",
            "specificReservationRequired": bool(body.get("specificReservationRequired", True)),
            "specificReservation": body.get("specificReservation") or {}}
        return self.state.operation(project, "zones", zone, "insert", key,
                                    self.state["reservations"][key]["id"])

    def _record(self, table: str, key: str, kind: str) -> dict[str, Any]:
        found = self.state[table].get(key)
        if found is None:
            raise not_found(kind, key)
        return found

    def get_reservation(self, project: str, zone: str, name: str) -> dict[str, Any]:
        return copy(self._record("reservations",
                                 f"projects/{project}/zones/{zone}/reservations/{name}",
                                 "reservation"))

    def delete_reservation(self, project: str, zone: str, name: str) -> dict[str, Any]:
        key = f"projects/{project}/zones/{zone}/reservations/{name}"
        found = self._record("reservations", key, "reservation")
        del self.state["reservations"][key]
        return self.state.operation(project, "zones", zone, "delete", key, found["id"])

    # ---------------------------------------------------------------- resource policies

    def list_policies(self, project: str, region: str, query: dict[str, str]) -> dict[str, Any]:
        prefix = f"projects/{project}/regions/{region}/resourcePolicies/"
        items = [copy(v) for k, v in self.state["policies"].items() if k.startswith(prefix)]
        return self.state.list("compute#resourcePolicyList", items, project,
                               f"regions/{region}/resourcePolicies", query)

    def aggregated_policies(self, project: str, query: dict[str, str]) -> dict[str, Any]:
        return self.state.aggregated("compute#resourcePolicyAggregatedList",
                                     "resourcePolicies", self._by_scope("policies", project),
                                     project, "resourcePolicies", query)

    def get_policy(self, project: str, region: str, name: str) -> dict[str, Any]:
        return copy(self._record("policies",
                                 f"projects/{project}/regions/{region}/resourcePolicies/{name}",
                                 "resourcePolicy"))

    def delete_policy(self, project: str, region: str, name: str) -> dict[str, Any]:
        key = f"projects/{project}/regions/{region}/resourcePolicies/{name}"
        found = self._record("policies", key, "resourcePolicy")
        self.state.refuse_in_use(key, "workloadPolicy")
        del self.state["policies"][key]
        return self.state.operation(project, "regions", region, "delete", key, found["id"])

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
        return self.state.operation(project, "regions", region, "insert", key,
                                    self.state["policies"][key]["id"])

    # ---------------------------------------------------------------- instance templates

    def list_templates(self, project: str, query: dict[str, str]) -> dict[str, Any]:
        prefix = f"projects/{project}/global/instanceTemplates/"
        items = [copy(v) for k, v in self.state["templates"].items() if k.startswith(prefix)]
        return self.state.list("compute#instanceTemplateList", items, project,
                               "global/instanceTemplates", query)

    def aggregated_templates(self, project: str, query: dict[str, str]) -> dict[str, Any]:
        return self.state.aggregated("compute#instanceTemplateAggregatedList",
                                     "instanceTemplates", self._by_scope("templates", project),
                                     project, "instanceTemplates", query)

    def get_template(self, project: str, name: str) -> dict[str, Any]:
        return copy(self._record("templates",
                                 f"projects/{project}/global/instanceTemplates/{name}",
                                 "instanceTemplate"))

    def delete_template(self, project: str, name: str) -> dict[str, Any]:
        key = f"projects/{project}/global/instanceTemplates/{name}"
        found = self._record("templates", key, "instanceTemplate")
        self.state.refuse_in_use(key, "instanceTemplate")
        del self.state["templates"][key]
        return self.state.operation(project, "global", "", "delete", key, found["id"])

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
        return self.state.operation(project, "global", "", "insert", key,
                                    self.state["templates"][key]["id"])

