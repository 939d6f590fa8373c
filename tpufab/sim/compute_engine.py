"""Compute Engine v1, the subset TPU VMs use, served by the emulator under ``/compute/v1/``.

Instances (compute_instances.py: insert, get, list, aggregatedList, delete, setMetadata,
setLabels, stop, start, getGuestAttributes), zone/region/global operations (get, wait;
compute_state.py), machine types of the TPU families, global instance templates, regional
resource policies (workload policies: ``workloadPolicy {type: HIGH_THROUGHPUT,
acceleratorTopology}``) and zonal reservations (compute_resources.py), zonal managed instance
groups (compute_groups.py: insert, get, list, listManagedInstances, resize, recreateInstances,
updatePerInstanceConfigs, listPerInstanceConfigs, delete), in the JSON shapes of the real API
(field names of google-cloud-compute's ``compute_v1`` messages).

Every TPU VM is backed by a node record of the emulator (backing.py: its workers, metadata
server, host keys, preemption): a standalone instance by the node
``projects/P/locations/Z/ceInstances/N`` (one worker), a MIG with a workload policy by
``.../ceGroups/MIG`` (one worker per VM, in the order the slice numbers them). Those records
never show in the Cloud TPU API. See docs/control-plane.md.
"""

from __future__ import annotations

import json
from typing import Any

from tpufab.sim.backing import BackingNodes
from tpufab.sim.compute_groups import InstanceGroups
from tpufab.sim.compute_instances import Instances
from tpufab.sim.compute_resources import ProjectResources
from tpufab.sim.compute_shapes import not_found, region_of
from tpufab.sim.compute_state import ComputeState
from tpufab.sim.guest import GuestEnvironment
from tpufab.sim.oslogin import OsLoginService
from tpufab.sim.store import SimStore


class ComputeEngineEmulator:
    """The Compute Engine v1 handler of the emulator (state under the store's ``compute``)."""

    def __init__(self, store: SimStore, backing: BackingNodes, guest: GuestEnvironment,
                 oslogin: OsLoginService):
        self.store = store
        self.oslogin = oslogin
        self.state = ComputeState(store, backing)
        self.instances = Instances(self.state, guest)
        self.groups = InstanceGroups(self.state, self.instances)
        self.resources = ProjectResources(self.state)

    def end_run(self, node_name: str) -> dict[str, Any]:
        """/sim/v1/<backing node>:endRun: the VMs' maxRunDuration is over now."""
        return self.instances.end_run(node_name)

    def handle(self, method: str, rest: str, query: dict[str, str],
               body: dict[str, Any]) -> dict[str, Any]:
        parts = rest.split("/")
        if len(parts) < 2 or parts[0] != "projects":
            raise not_found("", rest)
        project = parts[1]
        p = parts[2:]
        with self.store.lock:
            if not p:
                raise LookupError  # the project itself: the catalog answers
            if p[0] == "zones" and len(p) >= 2:
                return self._zonal(method, project, p[1], p[2:], query, body, rest)
            if p[0] == "regions" and len(p) >= 2:
                return self._regional(method, project, p[1], p[2:], query, body, rest)
            if p[0] == "global":
                return self._global(method, project, p[1:], query, body, rest)
            if p[0] == "aggregated" and p[1:] == ["instances"] and method == "GET":
                return self.instances.aggregated(project)
        raise not_found("", rest)

    # ---------------------------------------------------------------- routing

    def _zonal(self, method: str, project: str, zone: str, p: list[str],
               query: dict[str, str], body: dict[str, Any], rest: str) -> dict[str, Any]:
        if not p:
            return {"kind": "compute#zone", "name": zone, "status": "UP",
                    "region": self.state.link(f"projects/{project}/regions/{region_of(zone)}"),
                    "selfLink": self.state.link(f"projects/{project}/zones/{zone}")}
        kind, tail = p[0], p[1:]
        if kind == "operations" and tail:
            return self.state.operations(method, project, "zones", zone, tail)
        if kind == "reservations":
            return self.resources.reservations(method, project, zone, tail, body, rest)
        if kind == "autoscalers" and not tail and method == "GET":  # none: gcloud asks
            return self.state.list("compute#autoscalerList", [], project,
                                   f"zones/{zone}/autoscalers")
        if kind == "machineTypes":
            return self.resources.machine_types(project, zone, tail[0] if tail else None)
        if kind == "instances":
            if not tail:
                if method == "GET":
                    return self.state.list("compute#instanceList",
                                           self.instances.in_zone(project, zone),
                                           project, f"zones/{zone}/instances")
                if method == "POST":
                    return self.instances.insert(project, zone, body)
            elif len(tail) == 1:
                if method == "GET":
                    return self.instances.instance_view(self.state.instance(project, zone, tail[0]))
                if method == "DELETE":
                    return self.instances.delete(project, zone, tail[0])
            elif len(tail) == 2 and method in ("POST", "GET"):
                action = {"setMetadata": lambda: self.instances.set_metadata(project, zone, tail[0],
                                                                             body),
                          "setLabels": lambda: self.instances.set_labels(project, zone,
                                                                         tail[0], body),
                          "stop": lambda: self.instances.stop(project, zone, tail[0]),
                          "start": lambda: self.instances.start(project, zone, tail[0]),
                          "getGuestAttributes": lambda: self.instances.guest_attributes(
                              project, zone, tail[0], query),
                          "simulateMaintenanceEvent": lambda: self.instances.simulate_maintenance(
                              project, zone, tail[0])}.get(tail[1])
                if action:
                    return action()
        if kind == "instanceGroupManagers":
            if not tail:
                if method == "GET":
                    items = [self.groups.view(k) for k in self.state["groups"]
                             if k.startswith(f"projects/{project}/zones/{zone}/")]
                    return self.state.list("compute#instanceGroupManagerList", items, project,
                                      f"zones/{zone}/instanceGroupManagers")
                if method == "POST":
                    return self.groups.insert(project, zone, body)
            elif len(tail) == 1:
                if method == "GET":
                    return self.groups.view(self.state.group_key(project, zone, tail[0]))
                if method == "DELETE":
                    return self.groups.delete(project, zone, tail[0])
            elif len(tail) == 2 and tail[1] == "listManagedInstances" and method == "POST":
                return {"managedInstances": self.groups.managed_instances(
                    self.state.group_key(project, zone, tail[0]))}
            elif len(tail) == 2 and tail[1] == "resize" and method == "POST":
                return self.groups.resize(project, zone, tail[0], query.get("size"))
            elif len(tail) == 2 and tail[1] == "recreateInstances" and method == "POST":
                return self.groups.recreate_instances(project, zone, tail[0], body)
            elif len(tail) == 2 and tail[1] == "updatePerInstanceConfigs" and method == "POST":
                return self.groups.update_instance_configs(project, zone, tail[0], body)
            elif len(tail) == 2 and tail[1] == "listPerInstanceConfigs" and method == "POST":
                key = self.state.group_key(project, zone, tail[0])
                return {"items": [json.loads(json.dumps(c)) for _, c in sorted(
                    (self.state["groups"][key].get("configs") or {}).items())]}
        raise not_found("", rest)

    def _regional(self, method: str, project: str, region: str, p: list[str],
                  query: dict[str, str], body: dict[str, Any], rest: str) -> dict[str, Any]:
        if not p:
            return {"kind": "compute#region", "name": region, "status": "UP",
                    "selfLink": self.state.link(f"projects/{project}/regions/{region}")}
        kind, tail = p[0], p[1:]
        if kind == "operations" and tail:
            return self.state.operations(method, project, "regions", region, tail)
        if kind == "resourcePolicies":
            prefix = f"projects/{project}/regions/{region}/resourcePolicies/"
            if not tail and method == "GET":
                items = [json.loads(json.dumps(v)) for k, v in self.state["policies"].items()
                         if k.startswith(prefix)]
                return self.state.list("compute#resourcePolicyList", items, project,
                                  f"regions/{region}/resourcePolicies")
            if not tail and method == "POST":
                return self.resources.insert_policy(project, region, body)
            if len(tail) == 1:
                key = prefix + tail[0]
                if key not in self.state["policies"]:
                    raise not_found("resourcePolicy", key.removeprefix("projects/"))
                if method == "GET":
                    return json.loads(json.dumps(self.state["policies"][key]))
                if method == "DELETE":
                    self.state.refuse_in_use(key, "workloadPolicy")
                    del self.state["policies"][key]
                    return self.state.operation(project, "regions", region, "delete",
                                                key)
        raise not_found("", rest)

    def _global(self, method: str, project: str, p: list[str], query: dict[str, str],
                body: dict[str, Any], rest: str) -> dict[str, Any]:
        if not p:
            raise not_found("", rest)
        kind, tail = p[0], p[1:]
        if kind == "operations" and tail:
            return self.state.global_operation(method, project, tail)
        if kind == "images":  # any image a boot disk names: the TPU VM software
            name = tail[-1] if tail else "image"
            return {"kind": "compute#image", "name": name, "id": "1", "status": "READY",
                    "family": tail[-1] if tail[:1] == ["family"] else "",
                    "selfLink": self.state.link(f"projects/{project}/global/images/{name}"),
                    "diskSizeGb": "100", "architecture": "X86_64"}
        if kind == "networks" and tail:
            return {"kind": "compute#network", "name": tail[0],
                    "selfLink": self.state.link(f"projects/{project}/global/networks/{tail[0]}")}
        if kind == "instanceTemplates":
            prefix = f"projects/{project}/global/instanceTemplates/"
            if not tail and method == "GET":
                items = [json.loads(json.dumps(v)) for k, v in self.state["templates"].items()
                         if k.startswith(prefix)]
                return self.state.list("compute#instanceTemplateList", items, project,
                                  "global/instanceTemplates")
            if not tail and method == "POST":
                return self.resources.insert_template(project, body)
            if len(tail) == 1:
                key = prefix + tail[0]
                if key not in self.state["templates"]:
                    raise not_found("instanceTemplate", key.removeprefix("projects/"))
                if method == "GET":
                    return json.loads(json.dumps(self.state["templates"][key]))
                if method == "DELETE":
                    self.state.refuse_in_use(key, "instanceTemplate")
                    del self.state["templates"][key]
                    return self.state.global_op(project, "delete", key)
        raise not_found("", rest)
