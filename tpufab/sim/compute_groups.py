"""Compute Engine managed instance groups in the emulator: insert, get, list, delete,
listManagedInstances, resize, recreateInstances, updatePerInstanceConfigs and
listPerInstanceConfigs. A MIG with a workload policy is one multi-host slice, backed by one
node record (``.../ceGroups/MIG``, one worker per VM in the slice's order); without one, each VM
is a single-host slice of its own (``.../ceInstances/VM``)."""

from __future__ import annotations

import json
import secrets
from typing import Any

from tpufab.sim._model import rfc3339
from tpufab.sim.backing import BackingNodes
from tpufab.sim.compute_filter import page
from tpufab.sim.compute_instances import Instances
from tpufab.sim.compute_shapes import (
    check_name,
    compute_failure,
    error,
    external_ips,
    fingerprint,
    metadata_items,
    missing_code,
    new_id,
    not_found,
    region_of,
    scheduling_of,
    short,
    stockout_text,
    topology_of,
)
from tpufab.sim.compute_state import ComputeState
from tpufab.sim.machines import Machines
from tpufab.sim.store import SimStore


class InstanceGroups:
    """The zonal MIGs of the Compute Engine emulator (caller holds the store's lock)."""

    def __init__(self, state: ComputeState, instances: Instances):
        self.state = state
        self.instances = instances

    @property
    def store(self) -> SimStore:
        return self.state.store

    @property
    def backing(self) -> BackingNodes:
        return self.state.backing

    @property
    def machines(self) -> Machines:
        return self.state.backing.machines

    def list(self, project: str, zone: str, query: dict[str, str]) -> dict[str, Any]:
        items = [self.view(k) for k in self.state["groups"]
                 if k.startswith(f"projects/{project}/zones/{zone}/")]
        return self.state.list("compute#instanceGroupManagerList", items, project,
                               f"zones/{zone}/instanceGroupManagers", query)

    def aggregated(self, project: str, query: dict[str, str]) -> dict[str, Any]:
        return self.state.aggregated("compute#instanceGroupManagerAggregatedList",
                                     "instanceGroupManagers", self._by_zone(project, self.view),
                                     project, "instanceGroupManagers", query)

    def _by_zone(self, project: str, view: Any) -> dict[str, list[dict[str, Any]]]:
        scoped: dict[str, list[dict[str, Any]]] = {}
        for key in self.state["groups"]:
            parts = key.split("/")
            if parts[1] == project:
                scoped.setdefault(f"zones/{parts[3]}", []).append(view(key))
        return scoped

    def get(self, project: str, zone: str, name: str) -> dict[str, Any]:
        return self.view(self.state.group_key(project, zone, name))

    def insert(self, project: str, zone: str, body: dict[str, Any]) -> dict[str, Any]:
        name = check_name("instanceGroupManager", body.get("name"))
        key = f"projects/{project}/zones/{zone}/instanceGroupManagers/{name}"
        if key in self.state["groups"]:
            raise error(409, "alreadyExists", f"The resource '{key}' already exists")
        template_key, template = self.state.lookup("templates", body.get("instanceTemplate") or "",
                                                   project, "global/instanceTemplates")
        size = int(body.get("targetSize") or 0)
        policy_url = (body.get("resourcePolicies") or {}).get("workloadPolicy") or ""
        accel = None
        policy_key = None
        if policy_url:
            policy_key, policy = self.state.lookup("policies", policy_url, project,
                                                   f"regions/{region_of(zone)}/resourcePolicies")
            accel = (policy.get("workloadPolicy") or {}).get("acceleratorTopology")
        props = template["properties"]
        machine = short(props.get("machineType"))
        topo = topology_of(machine, accel)
        if accel and size not in (0, topo.hosts):
            raise error(400, "invalid", f"A managed instance group with workload policy "
                        f"'{short(policy_url)}' (accelerator topology {accel}) must have "
                        f"a target size of {topo.hosts} VMs, not {size}.")
        self.instances.reservation_check(project, zone, props)
        if size:  # refused before anything is recorded or starts, as a too-big TPU API node
            self.machines.check_capacity([topo] if accel else [topo] * size)
        base = body.get("baseInstanceName") or name
        group = {
            "kind": "compute#instanceGroupManager", "id": new_id(), "name": name,
            "creationTimestamp": rfc3339(), "description": body.get("description", ""),
            "zone": self.state.link(f"projects/{project}/zones/{zone}"),
            "instanceTemplate": self.state.link(template_key), "baseInstanceName": base,
            "targetSize": size, "selfLink": self.state.link(key),
            "instanceGroup": self.state.link(
                f"projects/{project}/zones/{zone}/instanceGroups/{name}"),
            "fingerprint": fingerprint(),
            "updatePolicy": {"type": "OPPORTUNISTIC"},
        }
        if policy_key:
            group["resourcePolicies"] = {"workloadPolicy": self.state.link(policy_key)}
        self.state["groups"][key] = {"group": group, "nodes": [], "members": [],
                                     "instanceGroupId": new_id()}
        node = self.grow(key, size)
        return self.state.operation(project, "zones", zone, "insert", key, group["id"],
                                    wait_node=node, until="READY" if node else "done",
                                    failure=self._failure(key))

    def _failure(self, key: str) -> tuple[str, str] | None:
        record = self.state["groups"][key]
        if not record.get("failure"):
            return None
        return record.get("failureReason") or "stockout", record["failure"]

    def slice_topology(self, key: str) -> str | None:
        """The accelerator topology of MIG ``key``'s workload policy (None: no policy)."""
        group = self.state["groups"][key]["group"]
        if not group.get("resourcePolicies"):
            return None
        project, zone = key.split("/")[1], key.split("/")[3]
        policy = self.state.lookup("policies", group["resourcePolicies"]["workloadPolicy"],
                                   project, f"regions/{region_of(zone)}/resourcePolicies")[1]
        return policy["workloadPolicy"].get("acceleratorTopology")

    def grow(self, key: str, size: int, *, names: list[str] | None = None,
             run_duration: dict[str, Any] | None = None) -> str | None:
        """Create the VMs of group ``key`` up to ``size`` (named ``names``, else the base
        name and a suffix; ``run_duration``: a resize request's requestedRunDuration, each
        VM's maxRunDuration); the backing node to wait for."""
        record = self.state["groups"][key]
        group = record["group"]
        project, zone = key.split("/")[1], key.split("/")[3]
        template = self.state.lookup("templates", group["instanceTemplate"], project,
                                     "global/instanceTemplates")[1]
        props = template["properties"]
        machine = short(props.get("machineType"))
        accel = self.slice_topology(key)
        members = record["members"]
        if size <= len(members):
            return None
        new = list(names or [f"{group['baseInstanceName']}-{secrets.token_hex(2)}"
                             for _ in range(size - len(members))])
        metadata = metadata_items(props.get("metadata"))
        scheduling = scheduling_of(props)
        if run_duration:
            scheduling["maxRunDuration"] = dict(run_duration)
        wait = None
        record.pop("missing", None)
        lacking = self.store.take_short_vms(zone) if accel else 0
        if lacking:  # a stockout on some VMs: the MIG keeps trying to create them
            record["missing"] = {n: stockout_text(project, zone)
                                 for n in new[len(new) - lacking:]}
        labels = dict(props.get("labels") or {})
        limit = self.store.settings.quota_chips
        if accel:  # one slice: one backing node, worker i = VM i
            topo = topology_of(machine, accel)
            node_name = f"projects/{project}/locations/{zone}/ceGroups/{group['name']}"
            made = self.backing.create(
                node_name, topo, metadata=metadata, labels=labels, scheduling=scheduling,
                external=external_ips(props), names=new, accelerator_topology=accel)
            self._record_failure(record, compute_failure(made, project, zone, topo, limit))
            record["nodes"] = [node_name]
            wait = node_name
            pairs = [(n, node_name, i) for i, n in enumerate(new)]
        else:  # independent single-host VMs
            topo = topology_of(machine)
            pairs = []
            for n in new:
                node_name = f"projects/{project}/locations/{zone}/ceInstances/{n}"
                made = self.backing.create(
                    node_name, topo, metadata=metadata, labels=labels, scheduling=scheduling,
                    external=external_ips(props), names=[n])
                self._record_failure(record, compute_failure(made, project, zone, topo, limit))
                record["nodes"].append(node_name)
                pairs.append((n, node_name, 0))
                wait = node_name
        for n, node_name, worker in pairs:
            if n in (record.get("missing") or {}):
                continue
            inst_key = f"projects/{project}/zones/{zone}/instances/{n}"
            instance = self.instances.record(project, zone, n, {**props,
                                                                "scheduling": scheduling},
                                             machine)
            items = instance["metadata"]["items"]
            items += [{"key": "created-by", "value": group["selfLink"]},
                      {"key": "instance-template", "value": group["instanceTemplate"]}]
            self.state["instances"][inst_key] = {"instance": instance, "node": node_name,
                                                 "worker": worker, "group": key,
                                                 "slice": bool(accel)}
            members.append(inst_key)
        for node_name in sorted({n for _, n, _ in pairs}):
            self.instances.run_timer(node_name, scheduling)
        return wait

    @staticmethod
    def _record_failure(record: dict[str, Any], failure: tuple[str, str] | None) -> None:
        if failure:
            record["failureReason"], record["failure"] = failure
        elif "failure" not in record:
            record["failure"] = None

    def view(self, key: str) -> dict[str, Any]:
        record = self.state["groups"][key]
        group = json.loads(json.dumps(record["group"]))
        statuses = [self.instances.instance_view(self.state["instances"][m])["status"]
                    for m in record["members"] if m in self.state["instances"]]
        creating = sum(1 for s in statuses if s in ("PROVISIONING", "STAGING")) + \
            len(record.get("missing") or {})
        recreating = sum(1 for m in record["members"] if m in self.state["instances"] and
                         str(self.state["instances"][m].get("worker", 0)) in
                         ((self.store.nodes.get(self.state["instances"][m].get("node")
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
            view = self.instances.instance_view(inst)
            node = self.store.nodes.get(inst.get("node") or "") or {"sim": {}}
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
            link = self.state.link(f"projects/{project}/zones/{zone}/instances/{name}")
            out.append({"instance": link, "name": name, "currentAction": "CREATING",
                        "lastAttempt": {"errors": {"errors": [
                            {"code": missing_code(message), "message": message}]}}})
        return out

    def list_errors(self, project: str, zone: str, name: str,
                    query: dict[str, str]) -> dict[str, Any]:
        """instanceGroupManagers.listErrors: why the MIG could not create VMs it wants."""
        key = self.state.group_key(project, zone, name)
        record = self.state["groups"][key]
        stamp = record["group"]["creationTimestamp"]
        items = [{"error": {"code": missing_code(message), "message": message},
                  "instanceActionDetails": {
                      "action": "CREATING", "instance": self.state.link(
                          f"projects/{project}/zones/{zone}/instances/{vm}"),
                      "version": {"instanceTemplate": record["group"]["instanceTemplate"]}},
                  "timestamp": stamp}
                 for vm, message in sorted((record.get("missing") or {}).items())]
        kept, token = page(items, query)
        out: dict[str, Any] = {"items": kept}
        if token:
            out["nextPageToken"] = token
        return out

    def create_instances(self, project: str, zone: str, name: str,
                         body: dict[str, Any]) -> dict[str, Any]:
        """instanceGroupManagers.createInstances: VMs of these names join the MIG (its target
        size grows by as many). A slice MIG (workload policy) takes them only all at once,
        from 0 to its slice size."""
        key = self.state.group_key(project, zone, name)
        record = self.state["groups"][key]
        wanted = [check_name("instance", (i or {}).get("name"))
                  for i in body.get("instances") or []]
        if not wanted:
            raise error(400, "required", "Required field 'instances' not specified")
        taken = [w for w in wanted if f"projects/{project}/zones/{zone}/instances/{w}" in
                 self.state["instances"] or wanted.count(w) > 1]
        if taken:
            raise error(409, "alreadyExists", f"The resource 'projects/{project}/zones/{zone}/"
                        f"instances/{taken[0]}' already exists")
        accel = self.slice_topology(key)
        size = len(record["members"]) + len(wanted)
        if accel:
            hosts = self.slice_hosts(key)
            if record["members"] or len(wanted) != hosts:
                raise error(400, "invalid", f"A managed instance group of a multi-host TPU "
                            f"slice ({accel}) creates all {hosts} of its VMs at once, from "
                            "none.")
        record["group"]["targetSize"] = size
        node = self.grow(key, size, names=wanted)
        return self.state.operation(project, "zones", zone, "createInstances", key,
                                    record["group"]["id"], wait_node=node,
                                    until="READY" if node else "done", failure=self._failure(key))

    def slice_hosts(self, key: str) -> int:
        group = self.state["groups"][key]["group"]
        project = key.split("/")[1]
        template = self.state.lookup("templates", group["instanceTemplate"], project,
                                     "global/instanceTemplates")[1]
        return topology_of(short(template["properties"].get("machineType")),
                           self.slice_topology(key)).hosts

    def resize(self, project: str, zone: str, name: str,
               size_text: str | None) -> dict[str, Any]:
        key = self.state.group_key(project, zone, name)
        try:
            size = int(size_text or "")
        except ValueError:
            raise error(400, "required", "Required field 'size' not specified") from None
        record = self.state["groups"][key]
        group = record["group"]
        sliced = bool(group.get("resourcePolicies"))
        current = len(record["members"])
        if sliced and size not in (0, self.slice_hosts(key)):
            raise error(400, "invalid", "A managed instance group of a multi-host TPU slice "
                         "can only be resized to 0 or back to its slice size.")
        group["targetSize"] = size
        wait, until = None, "done"
        if size == 0:
            wait, until = self.state.shrink_group(key), "gone"
        elif size > current:
            wait, until = self.grow(key, size), "READY"
        elif size < current:
            for member in record["members"][size:]:
                inst = self.state["instances"].pop(member, None)
                if inst:
                    self.backing.delete(inst["node"])
                    record["nodes"].remove(inst["node"])
                    wait, until = inst["node"], "gone"
            record["members"] = record["members"][:size]
        return self.state.operation(project, "zones", zone, "resize", key, group["id"],
                                    wait_node=wait, until=until if wait else "done")

    def recreate_instances(self, project: str, zone: str, name: str,
                           body: dict[str, Any]) -> dict[str, Any]:
        """instanceGroupManagers.recreateInstances: each VM named in ``instances`` is deleted
        and created again from the group's template under the same name (a new instance id,
        boot disk and host key; another internal IP: BackingNodes.recreate_worker). As
        on Compute Engine the operation is DONE once the recreation is scheduled; the VM
        shows ``currentAction: RECREATING`` (and status STAGING) until it runs again."""
        key = self.state.group_key(project, zone, name)
        record = self.state["groups"][key]
        urls = body.get("instances") or []
        if not urls:
            raise error(400, "required", "Required field 'instances' not specified")
        targets = []
        for url in urls:
            inst_key = f"projects/{project}/zones/{zone}/instances/{short(url)}"
            if inst_key not in record["members"] or inst_key not in self.state["instances"]:
                raise error(400, "invalid", f"The instance '{inst_key}' is not a member of "
                             f"the managed instance group '{key}'.")
            targets.append(self.state["instances"][inst_key])
        for inst in targets:
            self.backing.recreate_worker(inst["node"], inst.get("worker", 0))
            inst["instance"]["id"] = new_id()
            inst["instance"]["creationTimestamp"] = rfc3339()
            inst["instance"]["fingerprint"] = fingerprint()
        return self.state.operation(project, "zones", zone, "recreateInstances", key,
                                    record["group"]["id"])

    def update_instance_configs(self, project: str, zone: str, name: str,
                                body: dict[str, Any]) -> dict[str, Any]:
        """instanceGroupManagers.updatePerInstanceConfigs: per-instance configs (stateful
        metadata in ``preservedState.metadata``), kept by VM name, so they outlive a
        recreation; listManagedInstances shows them as ``preservedStateFromConfig``."""
        key = self.state.group_key(project, zone, name)
        record = self.state["groups"][key]
        configs = record.setdefault("configs", {})
        for config in body.get("perInstanceConfigs") or []:
            vm = check_name("instance", (config or {}).get("name"))
            metadata = ((config.get("preservedState") or {}).get("metadata") or {})
            if not isinstance(metadata, dict) or \
                    not all(isinstance(v, str) for v in metadata.values()):
                raise error(400, "invalid", "preservedState.metadata must map strings to "
                             "strings.")
            configs[vm] = {"name": vm, "fingerprint": fingerprint(), "status": "EFFECTIVE",
                           "preservedState": {"metadata": dict(metadata)}}
        self.store.save()
        return self.state.operation(project, "zones", zone, "updatePerInstanceConfigs", key,
                                    record["group"]["id"])

    def delete(self, project: str, zone: str, name: str) -> dict[str, Any]:
        key = self.state.group_key(project, zone, name)
        last = self.state.shrink_group(key)
        group = self.state["groups"].pop(key)["group"]
        return self.state.operation(project, "zones", zone, "delete", key, group["id"],
                                    wait_node=last, until="gone" if last else "done")

    # ---------------------------------------------------------------- instanceGroups

    def instance_group_view(self, key: str) -> dict[str, Any]:
        """The instance group a MIG manages (``zones/Z/instanceGroups/NAME``)."""
        record = self.state["groups"][key]
        group = record["group"]
        project, zone = key.split("/")[1], key.split("/")[3]
        link = group["instanceGroup"]
        return {"kind": "compute#instanceGroup", "id": record.get("instanceGroupId") or
                group["id"], "name": group["name"], "creationTimestamp":
                group["creationTimestamp"], "description": "This instance group is controlled "
                f"by Instance Group Manager '{group['name']}'. To modify instances in this "
                "group, use the Instance Group Manager API: "
                "https://cloud.google.com/compute/docs/reference/latest/instanceGroupManagers",
                "zone": group["zone"], "fingerprint": group["fingerprint"],
                "network": self.state.link(f"projects/{project}/global/networks/default"),
                "subnetwork": self.state.link(f"projects/{project}/regions/{region_of(zone)}/"
                                              "subnetworks/default"),
                "size": len([m for m in record["members"] if m in self.state["instances"]]),
                "selfLink": link}

    def _instance_group_key(self, project: str, zone: str, name: str) -> str:
        key = f"projects/{project}/zones/{zone}/instanceGroupManagers/{name}"
        if key not in self.state["groups"]:
            raise not_found("instanceGroup", f"{project}/zones/{zone}/instanceGroups/{name}")
        return key

    def list_instance_groups(self, project: str, zone: str,
                             query: dict[str, str]) -> dict[str, Any]:
        items = [self.instance_group_view(k) for k in self.state["groups"]
                 if k.startswith(f"projects/{project}/zones/{zone}/")]
        return self.state.list("compute#instanceGroupList", items, project,
                               f"zones/{zone}/instanceGroups", query)

    def aggregated_instance_groups(self, project: str, query: dict[str, str]) -> dict[str, Any]:
        return self.state.aggregated("compute#instanceGroupAggregatedList", "instanceGroups",
                                     self._by_zone(project, self.instance_group_view),
                                     project, "instanceGroups", query)

    def get_instance_group(self, project: str, zone: str, name: str) -> dict[str, Any]:
        return self.instance_group_view(self._instance_group_key(project, zone, name))

    def list_group_instances(self, project: str, zone: str, name: str,
                             query: dict[str, str]) -> dict[str, Any]:
        """instanceGroups.listInstances: each member VM and its status."""
        key = self._instance_group_key(project, zone, name)
        items = [{"instance": view["selfLink"], "status": view["status"]}
                 for view in (self.instances.instance_view(self.state["instances"][m])
                              for m in self.state["groups"][key]["members"]
                              if m in self.state["instances"])]
        out = self.state.list("compute#instanceGroupsListInstances", items, project,
                              f"zones/{zone}/instanceGroups/{name}/listInstances", query)
        return out

    def list_instance_configs(self, project: str, zone: str, name: str) -> dict[str, Any]:
        """instanceGroupManagers.listPerInstanceConfigs: the configs kept by VM name."""
        key = self.state.group_key(project, zone, name)
        return {"items": [json.loads(json.dumps(c)) for _, c in sorted(
            (self.state["groups"][key].get("configs") or {}).items())]}
