"""The Cloud TPU API's nodes (``/v2/projects/P/locations/Z/nodes``): create, get, list, stop,
start, delete, update and getGuestAttributes, in the API's shapes. A handler of the emulator
over the shared store; their workers run through machines.py."""

from __future__ import annotations

from typing import Any

from tpufab.sim._model import (
    UPDATABLE_FIELDS,
    ApiFailure,
    check_id,
    normalize_node_input,
    page,
    version_view,
    worker_hostname,
)
from tpufab.sim.machines import Machines, validate_node
from tpufab.sim.store import SimStore, copy


class TpuNodes:
    """TPU API v2 (and v2alpha1) node methods."""

    def __init__(self, store: SimStore, machines: Machines):
        self.store = store
        self.machines = machines

    # ------------------------------------------------------------------ reads

    def get(self, name: str, version: str) -> dict[str, Any]:
        return version_view(self.store.node(name)["node"], "Node", version)

    def list(self, parent: str, version: str = "v2") -> list[dict[str, Any]]:
        """Every TPU API node under ``parent`` (``locations/-``: every zone), as ``version``
        shows them; not the records behind Compute Engine VMs."""
        prefix = parent + "/nodes/"
        if parent.endswith("/locations/-"):  # every zone of the project
            prefix = parent[:-1]
        with self.store.lock:
            return [version_view(copy(r["node"]), "Node", version)
                    for n, r in self.store.nodes.items() if n.startswith(prefix)
                    and n.split("/")[4] == "nodes"]

    @staticmethod
    def page(nodes: list[dict[str, Any]], query: dict[str, str]) -> dict[str, Any]:
        items, token = page(nodes, query)
        out: dict[str, Any] = {"nodes": items}
        if token:
            out["nextPageToken"] = token
        return out

    def guest_attributes(self, name: str, body: dict[str, Any]) -> dict[str, Any]:
        record = self.store.node(name)
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

    # ------------------------------------------------------------------ writes

    def create(self, version: str, parent: str, query: dict[str, str],
               body: dict[str, Any]) -> dict[str, Any]:
        store = self.store
        node_id = check_id("node", query.get("nodeId") or query.get("node_id"))
        node_in = normalize_node_input(body)
        name = f"{parent}/nodes/{node_id}"
        with store.lock:
            if name in store.nodes:
                raise ApiFailure("ALREADY_EXISTS", f"Resource '{name}' already exists")
            self.machines.check_capacity([validate_node(name, node_in)])
            topo, node = self.machines.new_node(name, node_in, version)
            failure = store.take_create_failure(name, topo)
            op = store.new_operation(version, name, "create")
            store.nodes[name] = {"node": node, "sim": self.machines.sim_fields(
                node, op["name"], failure[1] if failure else None)}
            store.save()
            op = copy(op)
        store.spawn(self.machines.bring_up, name, store.settings.create_delay)
        return op

    def stop(self, version: str, name: str) -> dict[str, Any]:
        store = self.store
        with store.lock:
            record = store.require_node(name)
            state = record["node"]["state"]
            if state != "READY":
                raise ApiFailure("FAILED_PRECONDITION",
                                 f"Node {name} is {state}; only a READY node can be stopped.")
            record["node"]["state"] = "STOPPING"
            op = store.new_operation(version, name, "stop")
            record["sim"]["op"] = op["name"]
            store.save()
            op = copy(op)
        store.spawn(self.machines.finish_stop, name)
        return op

    def start(self, version: str, name: str) -> dict[str, Any]:
        store = self.store
        with store.lock:
            record = store.require_node(name)
            state = record["node"]["state"]
            if state != "STOPPED":
                raise ApiFailure("FAILED_PRECONDITION",
                                 f"Node {name} is {state}; only a STOPPED node can be started.")
            record["node"]["state"] = "STARTING"
            op = store.new_operation(version, name, "start")
            record["sim"]["op"] = op["name"]
            store.save()
            op = copy(op)
        store.spawn(self.machines.bring_up, name, store.settings.operation_delay)
        return op

    def delete(self, version: str, name: str) -> dict[str, Any]:
        store = self.store
        with store.lock:
            record = store.require_node(name)
            if record["node"]["state"] == "DELETING":
                raise ApiFailure("FAILED_PRECONDITION", f"Node {name} is already being deleted.")
            previous = record["sim"].get("op")
            store.finish_operation(previous, error=(10, f"Node {name} was deleted."))
            record["node"]["state"] = "DELETING"
            op = store.new_operation(version, name, "delete")
            record["sim"]["op"] = op["name"]
            store.save()
            op = copy(op)
        store.spawn(self.machines.finish_delete, name)
        return op

    def update(self, version: str, name: str, query: dict[str, str],
               body: dict[str, Any]) -> dict[str, Any]:
        store = self.store
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
        with store.lock:
            record = store.require_node(name)
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
            op = store.new_operation(version, name, "update")
            store.save()
            op = copy(op)
        store.spawn(self.machines.finish_update, name, op["name"], "metadata" in resolved)
        return op
