"""Compute Engine instances in the emulator: insert, get, list (and aggregated), delete,
setMetadata, setLabels, stop, start, reset, simulateMaintenanceEvent, getGuestAttributes,
getSerialPortOutput, and a flex-start VM's end at maxRunDuration. Each TPU VM is backed by a node record (backing.py):
its status, addresses and host keys are read from it."""

from __future__ import annotations

import json
from typing import Any

from tpufab.sim._model import rfc3339
from tpufab.sim.backing import BackingNodes
from tpufab.sim.compute_shapes import (
    INSTANCE_STATUS,
    check_name,
    compute_failure,
    default_account,
    error,
    external_ips,
    fingerprint,
    is_general,
    metadata_items,
    new_id,
    not_found,
    physical_host,
    physical_host_topology,
    region_of,
    scheduling_of,
    short,
    topology_of,
)
from tpufab.sim.compute_state import ComputeState
from tpufab.sim.guest import GuestEnvironment
from tpufab.sim.store import SimStore


class Instances:
    """The instances of the Compute Engine emulator (caller holds the store's lock)."""

    def __init__(self, state: ComputeState, guest: GuestEnvironment):
        self.state = state
        self.guest = guest

    @property
    def store(self) -> SimStore:
        return self.state.store

    @property
    def backing(self) -> BackingNodes:
        return self.state.backing

    def in_zone(self, project: str, zone: str) -> list[dict[str, Any]]:
        prefix = f"projects/{project}/zones/{zone}/instances/"
        return [self.instance_view(r) for k, r in self.state["instances"].items()
                if k.startswith(prefix)]

    def list(self, project: str, zone: str, query: dict[str, str]) -> dict[str, Any]:
        return self.state.list("compute#instanceList", self.in_zone(project, zone), project,
                               f"zones/{zone}/instances", query)

    def aggregated(self, project: str, query: dict[str, str]) -> dict[str, Any]:
        zones: dict[str, list[dict[str, Any]]] = {}
        for key, record in self.state["instances"].items():
            if key.startswith(f"projects/{project}/zones/"):
                zones.setdefault(f"zones/{key.split('/')[3]}", []).append(
                    self.instance_view(record))
        return self.state.aggregated("compute#instanceAggregatedList", "instances", zones,
                                     project, "instances", query)

    def get(self, project: str, zone: str, name: str) -> dict[str, Any]:
        return self.instance_view(self.state.instance(project, zone, name))

    def instance_view(self, record: dict[str, Any]) -> dict[str, Any]:
        inst = json.loads(json.dumps(record["instance"]))
        node = self.store.nodes.get(record.get("node") or "")
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
        if record.get("slice"):  # a VM of a HIGH_THROUGHPUT MIG: where it sits in the slice
            inst["resourceStatus"] = {"physicalHost": physical_host(node["node"]["id"], worker),
                                      "physicalHostTopology": physical_host_topology(
                                          node["node"]["id"], worker)}
        return inst

    def reservation_check(self, project: str, zone: str, props: dict[str, Any]) -> None:
        affinity = props.get("reservationAffinity") or {}
        if affinity.get("consumeReservationType") != "SPECIFIC_RESERVATION":
            return
        for value in affinity.get("values") or []:
            name = short(value)
            if f"projects/{project}/zones/{zone}/reservations/{name}" not in \
                    self.state["reservations"]:
                raise error(400, "invalid", f"The resource 'projects/{project}/zones/{zone}/"
                             f"reservations/{name}' was not found")

    def insert(self, project: str, zone: str, body: dict[str, Any]) -> dict[str, Any]:
        name = check_name("instance", body.get("name"))
        key = f"projects/{project}/zones/{zone}/instances/{name}"
        if key in self.state["instances"]:
            raise error(409, "alreadyExists", f"The resource '{key}' already exists")
        machine = short(body.get("machineType"))
        general = is_general(machine)
        topo = None if general else topology_of(machine)
        self.reservation_check(project, zone, body)
        node_name = f"projects/{project}/locations/{zone}/ceInstances/{name}"
        instance = self.record(project, zone, name, body, machine)
        made = dict(metadata=metadata_items(body.get("metadata")),
                    labels=dict(body.get("labels") or {}), scheduling=instance["scheduling"],
                    external=external_ips(body), names=[name])
        if topo is None:  # a general-purpose VM: sshd, a metadata server, no TPU
            accounts = instance.get("serviceAccounts") or []
            failure = self.backing.create_vm(node_name, machine, **made,
                                             account=accounts[0] if accounts else None)
        else:
            failure = compute_failure(self.backing.create(node_name, topo, **made), project,
                                      zone, topo, self.store.settings.quota_chips)
        self.state["instances"][key] = {"instance": instance, "node": node_name, "worker": 0}
        self.run_timer(node_name, instance["scheduling"])
        return self.state.operation(project, "zones", zone, "insert", key, instance["id"],
                                    wait_node=node_name, until="READY", failure=failure)

    def record(self, project: str, zone: str, name: str, props: dict[str, Any],
               machine: str) -> dict[str, Any]:
        nic = dict((props.get("networkInterfaces") or [{}])[0])
        nic.setdefault("network", self.state.link(f"projects/{project}/global/networks/default"))
        nic.setdefault("subnetwork", self.state.link(
            f"projects/{project}/regions/{region_of(zone)}/subnetworks/default"))
        nic["name"] = "nic0"
        nic["kind"] = "compute#networkInterface"
        if nic.get("accessConfigs"):
            nic["accessConfigs"] = [{"kind": "compute#accessConfig", "type": "ONE_TO_ONE_NAT",
                                     "name": "External NAT", "networkTier": "PREMIUM"}]
        items = metadata_items(props.get("metadata"))
        instance = {
            "kind": "compute#instance", "id": new_id(), "name": name,
            "creationTimestamp": rfc3339(), "description": props.get("description", ""),
            "zone": self.state.link(f"projects/{project}/zones/{zone}"),
            "machineType": self.state.link(
                f"projects/{project}/zones/{zone}/machineTypes/{machine}"),
            "networkInterfaces": [nic],
            "disks": [{"kind": "compute#attachedDisk", "boot": True, "autoDelete": True,
                       "deviceName": "persistent-disk-0", "index": 0, "mode": "READ_WRITE",
                       "type": "PERSISTENT", "interface": "SCSI",
                       "source": self.state.link(f"projects/{project}/zones/{zone}/disks/{name}")}],
            "metadata": {"kind": "compute#metadata", "fingerprint": fingerprint(),
                         "items": [{"key": k, "value": v} for k, v in sorted(items.items())]},
            "labels": dict(props.get("labels") or {}),
            "labelFingerprint": fingerprint(),
            "scheduling": scheduling_of(props),
            "selfLink": self.state.link(f"projects/{project}/zones/{zone}/instances/{name}"),
            "cpuPlatform": "Simulated CPU", "startRestricted": False,
            "deletionProtection": False, "fingerprint": fingerprint(),
        }
        for field in ("reservationAffinity", "tags", "resourcePolicies"):
            if props.get(field):
                instance[field] = props[field]
        if props.get("serviceAccounts"):  # "default" is the project's default account
            instance["serviceAccounts"] = [
                {**account, "email": default_account(project)
                 if account.get("email") in (None, "", "default") else account["email"]}
                for account in props["serviceAccounts"]]
        return instance

    def delete(self, project: str, zone: str, name: str) -> dict[str, Any]:
        record = self.state.instance(project, zone, name)
        key = f"projects/{project}/zones/{zone}/instances/{name}"
        if record.get("group"):
            raise error(400, "resourceInUseByAnotherResource",
                         f"The instance '{key}' belongs to managed instance group "
                         f"'{short(record['group'])}'; resize or delete the group instead.")
        node_name = record["node"]
        del self.state["instances"][key]
        self.backing.delete(node_name)
        return self.state.operation(project, "zones", zone, "delete", key,
                                    record["instance"]["id"], wait_node=node_name, until="gone")

    def set_metadata(self, project: str, zone: str, name: str,
                     body: dict[str, Any]) -> dict[str, Any]:
        record = self.state.instance(project, zone, name)
        items = metadata_items(body)
        record["instance"]["metadata"] = {"kind": "compute#metadata",
                                          "fingerprint": fingerprint(),
                                          "items": [{"key": k, "value": v}
                                                    for k, v in sorted(items.items())]}
        key = f"projects/{project}/zones/{zone}/instances/{name}"
        op = self.state.operation(project, "zones", zone, "setMetadata", key,
                                  record["instance"]["id"], until="metadata")
        path = f"projects/{project}/zones/{zone}/operations/{op['name']}"
        self.state["operations"][path]["done_check"] = "metadata"
        self.backing.set_metadata(record["node"], items,
                                  done=lambda: self._synced(path))
        return op

    def _synced(self, path: str) -> None:
        with self.store.lock:
            record = self.state["operations"].get(path)
            if record is not None:
                record["synced"] = True
                self.state.finish(path)
                self.store.save()

    def set_labels(self, project: str, zone: str, name: str,
                   body: dict[str, Any]) -> dict[str, Any]:
        record = self.state.instance(project, zone, name)
        record["instance"]["labels"] = dict(body.get("labels") or {})
        record["instance"]["labelFingerprint"] = fingerprint()
        key = f"projects/{project}/zones/{zone}/instances/{name}"
        return self.state.operation(project, "zones", zone, "setLabels", key,
                                    record["instance"]["id"])

    def stop(self, project: str, zone: str, name: str) -> dict[str, Any]:
        """instances.stop; a VM already stopped (or stopping) is a DONE operation, as on
        Compute Engine."""
        record = self.state.instance(project, zone, name)
        key = f"projects/{project}/zones/{zone}/instances/{name}"
        if record.get("slice"):
            raise error(400, "invalid", "A VM of a multi-host TPU slice cannot be stopped "
                        "on its own; resize its managed instance group to 0 instead.")
        if self._node_state(record) not in ("STOPPED", "PREEMPTED", "STOPPING"):
            self._require(record, ("READY",), "stopped", "running")
            self.backing.stop(record["node"])
        return self.state.operation(project, "zones", zone, "stop", key, record["instance"]["id"],
                                    wait_node=record["node"], until="STOPPED")

    def start(self, project: str, zone: str, name: str) -> dict[str, Any]:
        """instances.start; a VM already running (or starting) is a DONE operation once it
        runs, as on Compute Engine."""
        record = self.state.instance(project, zone, name)
        key = f"projects/{project}/zones/{zone}/instances/{name}"
        if self._node_state(record) in ("STOPPED", "PREEMPTED"):
            self.backing.start(record["node"])
        else:
            self._require(record, ("READY", "CREATING", "STARTING", "RESTARTING"), "started",
                          "stopped")
        return self.state.operation(project, "zones", zone, "start", key, record["instance"]["id"],
                                    wait_node=record["node"], until="READY")

    def reset(self, project: str, zone: str, name: str) -> dict[str, Any]:
        """instances.reset: a hard reset of a running VM (its processes end, it boots again
        with its disk, address and host key); DONE once it runs again."""
        record = self.state.instance(project, zone, name)
        self._require(record, ("READY",), "reset", "running")
        worker = record.get("worker", 0)
        self.backing.reset_worker(record["node"], worker)
        key = f"projects/{project}/zones/{zone}/instances/{name}"
        return self.state.operation(project, "zones", zone, "reset", key,
                                    record["instance"]["id"], wait_node=record["node"],
                                    until="worker", worker=worker)

    def serial_port_output(self, project: str, zone: str, name: str,
                           query: dict[str, str]) -> dict[str, Any]:
        """instances.getSerialPortOutput (port 1): the VM's console since it booted, the
        startup-script runner's lines included, from byte ``start`` on."""
        record = self.state.instance(project, zone, name)
        port = query.get("port") or "1"
        if port not in ("1", "2", "3", "4"):
            raise error(400, "invalid", f"Invalid value for field 'port': '{port}'. Must be "
                        "between 1 and 4.")
        node = self.store.nodes.get(record["node"])
        text = "" if node is None or port != "1" else \
            self.store.workers.console_log(node["node"]["id"], record.get("worker", 0))
        data = text.encode()
        try:
            start = int(query.get("start") or 0)
        except ValueError:
            raise error(400, "invalid", "Invalid value for field 'start'.") from None
        start = max(0, min(len(data) + start if start < 0 else start, len(data)))
        link = self.state.link(f"projects/{project}/zones/{zone}/instances/{name}")
        return {"kind": "compute#serialPortOutput",
                "contents": data[start:].decode(errors="replace"),
                "start": str(start), "next": str(len(data)),
                "selfLink": f"{link}/serialPort?port={port}"}

    def _node_state(self, record: dict[str, Any]) -> str | None:
        node = self.store.nodes.get(record["node"])
        return node["node"]["state"] if node else None

    def _require(self, record: dict[str, Any], states: tuple[str, ...], verb: str,
                 wanted: str) -> None:
        """Compute Engine's 400 for a VM not in a state that allows ``verb``."""
        state = self._node_state(record)
        if state not in states:
            status = INSTANCE_STATUS.get(state or "", "PROVISIONING")
            path = record["instance"]["selfLink"].split("/compute/v1/")[-1]
            raise error(400, "resourceNotReady", f"The resource '{path}' is not ready: it is "
                        f"{status}, and only a {wanted} instance can be {verb}.")

    def simulate_maintenance(self, project: str, zone: str, name: str) -> dict[str, Any]:
        """instances.simulateMaintenanceEvent: the VM's metadata server says
        ``instance/maintenance-event: TERMINATE_ON_HOST_MAINTENANCE`` for a while (the
        emulator's maintenance_notice), as a TPU API node's worker does."""
        record = self.state.instance(project, zone, name)
        self.guest.simulate_maintenance("v2", record["node"],
                                            {"workerIds": [record.get("worker", 0)]})
        key = f"projects/{project}/zones/{zone}/instances/{name}"
        return self.state.operation(project, "zones", zone, "simulateMaintenanceEvent", key,
                                    record["instance"]["id"])

    def guest_attributes(self, project: str, zone: str, name: str,
                         query: dict[str, str]) -> dict[str, Any]:
        record = self.state.instance(project, zone, name)
        node = self.store.nodes.get(record["node"])
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
            raise not_found("guestAttributes", f"{project}/zones/{zone}/instances/{name}/"
                             f"guestAttributes/{query_path}")
        return {"kind": "compute#guestAttributes", "queryPath": query_path,
                "queryValue": {"items": items},
                "selfLink": self.state.link(f"projects/{project}/zones/{zone}/instances/{name}/"
                                      "getGuestAttributes")}

    # ---------------------------------------------------------------- maxRunDuration

    def run_timer(self, node_name: str, scheduling: dict[str, Any]) -> None:
        """A VM with ``scheduling.maxRunDuration`` (flex-start) ends after it: Compute
        Engine performs its ``instanceTerminationAction`` (tpufab/docs/control-plane.md).
        The timer counts from the create and does not survive a restart of the daemon;
        `sim end-run` (``end_run``) ends it at once."""
        run = scheduling.get("maxRunDuration")
        if not run:
            return
        seconds = float(run.get("seconds") or 0) if isinstance(run, dict) else \
            float(str(run).rstrip("s") or 0)
        node = self.store.nodes.get(node_name)
        if node is not None and seconds > 0:
            self.store.spawn(self._end_after, node_name, node["node"]["id"], seconds)

    def _end_after(self, node_name: str, node_id: str, seconds: float) -> None:
        if self.store.wait(seconds):
            return
        with self.store.lock:
            record = self.store.nodes.get(node_name)
            if record is None or record["node"]["id"] != node_id:
                return
        self.end_run(node_name)

    def end_run(self, node_name: str) -> dict[str, Any]:
        """End the run of the VMs behind backing node ``node_name`` (a MIG's ``ceGroups/N``
        or a VM's ``ceInstances/N``) as Compute Engine does at maxRunDuration:
        ``instanceTerminationAction`` DELETE deletes the VMs (a MIG's target size drops to 0,
        as for a MIG's flex-start resize request), STOP stops them."""
        with self.store.lock:
            owners = [(k, r) for k, r in self.state["instances"].items()
                      if r.get("node") == node_name]
            if not owners:
                raise error(404, "notFound", f"No Compute Engine VM is backed by {node_name}.")
            scheduling = owners[0][1]["instance"].get("scheduling") or {}
            action = scheduling.get("instanceTerminationAction") or "STOP"
            group_key = owners[0][1].get("group")
            if action != "DELETE":
                state = self.store.nodes[node_name]["node"]["state"]
                if state == "READY":
                    self.backing.stop(node_name)
            elif group_key:
                self.state.shrink_group(group_key)
                self.state["groups"][group_key]["group"]["targetSize"] = 0
            else:
                for key, _ in owners:
                    del self.state["instances"][key]
                self.backing.delete(node_name)
            self.store.save()
        return {"name": node_name, "instanceTerminationAction": action}
