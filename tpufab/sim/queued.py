"""The emulator's queued resources: create (one node or a multislice of them), provision after
`create_delay`, follow their nodes' states (ACTIVE, SUSPENDED, FAILED), delete (with `force`),
reset. A handler of the emulator over the shared store (store.py); its nodes are placed and
brought up through machines.py."""

from __future__ import annotations

import json
from typing import Any

from tpufab.sim._model import (
    ApiFailure,
    camel_keys,
    check_id,
    normalize_node_input,
    not_found,
    page,
    rfc3339,
    version_view,
)
from tpufab.sim.machines import Machines, validate_node
from tpufab.sim.store import SimStore


class QueuedResources:
    """Queued resources of the Cloud TPU API (v2 and v2alpha1)."""

    def __init__(self, store: SimStore, machines: Machines):
        self.store = store
        self.machines = machines

    def get(self, name: str) -> dict[str, Any]:
        with self.store.lock:
            record = self.store.queued_resources.get(name)
            if record is None:
                raise not_found(name)
            return json.loads(json.dumps(record))

    def list(self, parent: str, query: dict[str, str], version: str = "v2") -> dict[str, Any]:
        with self.store.lock:
            qrs = [version_view(json.loads(json.dumps(r["qr"])), "QueuedResource", version)
                   for n, r in self.store.queued_resources.items()
                   if n.startswith(parent + "/queuedResources/")]
        items, token = page(qrs, query)
        out: dict[str, Any] = {"queuedResources": items}
        if token:
            out["nextPageToken"] = token
        return out

    def create(self, version: str, parent: str, query: dict[str, str],
               body: dict[str, Any]) -> dict[str, Any]:
        qr_id = check_id("queued resource",
                         query.get("queuedResourceId") or query.get("queued_resource_id"))
        body = camel_keys(body)
        name = f"{parent}/queuedResources/{qr_id}"
        specs = (body.get("tpu") or {}).get("nodeSpec") or []
        if not specs:
            raise ApiFailure("INVALID_ARGUMENT", "tpu.nodeSpec is required: a queued resource "
                             "needs at least one node spec.")
        plan = []
        for spec in specs:
            spec_parent = spec.get("parent") or parent
            if spec_parent != parent:
                raise ApiFailure("INVALID_ARGUMENT", f"nodeSpec.parent {spec_parent} must be "
                                 f"the queued resource's location {parent}.")
            node_in = normalize_node_input(spec.get("node") or {})
            if body.get("spot") is not None:
                node_in.setdefault("schedulingConfig", {})["spot"] = True
            multi = spec.get("multisliceParams") or spec.get("multiNodeParams")
            if multi:
                count = int(multi.get("nodeCount") or 0)
                if count < 1:
                    raise ApiFailure("INVALID_ARGUMENT", "multisliceParams.nodeCount must be "
                                     "at least 1.")
                prefix = multi.get("nodeIdPrefix") or qr_id
                node_ids = [check_id("node", f"{prefix}-{i}") for i in range(count)]
            else:
                node_ids = [check_id("node", spec.get("nodeId"))]
            for node_id in node_ids:
                plan.append({"name": f"{parent}/nodes/{node_id}", "node": node_in,
                             "multislice": bool(multi)})
        names = [p["name"] for p in plan]
        with self.store.lock:
            if name in self.store.queued_resources:
                raise ApiFailure("ALREADY_EXISTS", f"Resource '{name}' already exists")
            for node_name in names:
                if node_name in self.store.nodes or names.count(node_name) > 1:
                    raise ApiFailure("ALREADY_EXISTS", f"Resource '{node_name}' already exists")
            failure = None
            topos = [validate_node(item["name"], item["node"]) for item in plan]
            self.machines.check_capacity(topos)
            for item, topo in zip(plan, topos, strict=True):  # the first failure wins
                taken = self.store.take_create_failure(item["name"], topo)
                failure = failure or (taken[1] if taken else None)
            qr = {k: v for k, v in body.items() if k not in ("name", "state", "createTime")}
            qr.update({"name": name, "createTime": rfc3339(),
                       "state": {"state": "WAITING_FOR_RESOURCES"}})
            record = {"qr": qr, "sim": {"plan": plan, "failure": failure, "op": None,
                                        "version": version}}
            self.store.queued_resources[name] = record
            op = self.store.new_operation(version, name, "create")
            self.store.finish_operation(op["name"], response=qr, response_type="QueuedResource")
            self.store.save()
            op = json.loads(json.dumps(op))
        self.store.spawn(self.provision, name, self.store.settings.create_delay)
        return op

    def provision(self, name: str, delay: float) -> None:
        if self.store.wait(delay):
            return
        with self.store.lock:
            record = self.store.queued_resources.get(name)
            if record is None or record["qr"]["state"]["state"] != "WAITING_FOR_RESOURCES":
                return
            failure = record["sim"].pop("failure", None)
            taken = [p["name"] for p in record["sim"]["plan"] if p["name"] in self.store.nodes]
            if taken and not failure:
                failure = f"Resource '{taken[0]}' already exists"
            if failure:
                record["qr"]["state"] = {"state": "FAILED", "failedData": {
                    "error": {"code": 8, "message": failure}}}
                self.store.save()
                return
            version = record["sim"].get("version", "v2")
            for item in record["sim"]["plan"]:
                _, node = self.machines.new_node(item["name"], item["node"], version)
                node["queuedResource"] = name
                if item["multislice"]:
                    node["multisliceNode"] = True
                self.store.nodes[item["name"]] = {"node": node, "sim": self.machines.sim_fields(
                    node, None, None)}
            record["qr"]["state"] = {"state": "PROVISIONING", "provisioningData": {}}
            self.store.save()
            names = [p["name"] for p in record["sim"]["plan"]]
        for node_name in names:
            self.store.spawn(self.machines.bring_up, node_name, 0.0)

    def delete(self, version: str, name: str, query: dict[str, str]) -> dict[str, Any]:
        force = str(query.get("force", "")).lower() == "true"
        with self.store.lock:
            record = self.store.queued_resources.get(name)
            if record is None:
                raise not_found(name)
            state = record["qr"]["state"]["state"]
            if state == "DELETING":
                raise ApiFailure("FAILED_PRECONDITION",
                                 f"Queued resource {name} is already being deleted.")
            nodes = self.store.queued_node_names(record)
            if nodes and not force:
                raise ApiFailure(
                    "FAILED_PRECONDITION",
                    f"Queued resource {name} is {state} and still has {len(nodes)} node(s); "
                    "delete them first, or delete with force=true (gcloud: --force) to delete "
                    "them with it.")
            record["qr"]["state"] = {"state": "DELETING", "deletingData": {}}
            for node_name in nodes:
                self.store.nodes[node_name]["node"]["state"] = "DELETING"
            op = self.store.new_operation(version, name, "delete")
            record["sim"]["op"] = op["name"]
            self.store.save()
            op = json.loads(json.dumps(op))
        self.store.spawn(self.finish_delete, name)
        return op

    def _drop_nodes(self, name: str) -> None:
        """Delete every node of a queued resource, workers first."""
        with self.store.lock:
            record = self.store.queued_resources.get(name)
            if record is None:
                return
            nodes = [(n, self.store.nodes[n]["node"]["id"])
                     for n in self.store.queued_node_names(record)]
            for node_name, _ in nodes:
                self.store.nodes[node_name]["node"]["state"] = "DELETING"
        for node_name, node_id in nodes:
            self.machines.tear_down(node_id)
            with self.store.lock:
                self.store.forget_node(node_name)
                self.store.save()

    def finish_delete(self, name: str) -> None:
        if self.store.wait(self.store.settings.operation_delay):
            return
        self._drop_nodes(name)
        with self.store.lock:
            record = self.store.queued_resources.pop(name, None)
            if record is not None:
                self.store.finish_operation(record["sim"].get("op"), response_type="Empty")
            self.store.save()

    def reset(self, version: str, name: str) -> dict[str, Any]:
        with self.store.lock:
            record = self.store.queued_resources.get(name)
            if record is None:
                raise not_found(name)
            state = record["qr"]["state"]["state"]
            if state not in ("FAILED", "SUSPENDED", "ACTIVE", "PROVISIONING"):
                raise ApiFailure("FAILED_PRECONDITION",
                                 f"Queued resource {name} is {state}; it cannot be reset.")
            record["qr"]["state"] = {"state": "SUSPENDING", "suspendingData": {}}
            op = self.store.new_operation(version, name, "reset")
            record["sim"]["op"] = op["name"]
            self.store.save()
            op = json.loads(json.dumps(op))
        self.store.spawn(self.finish_reset, name)
        return op

    def finish_reset(self, name: str) -> None:
        if self.store.wait(self.store.settings.operation_delay):
            return
        self._drop_nodes(name)
        with self.store.lock:
            record = self.store.queued_resources.get(name)
            if record is None:
                return
            record["qr"]["state"] = {"state": "WAITING_FOR_RESOURCES"}
            self.store.finish_operation(record["sim"].pop("op", None), response=record["qr"],
                                        response_type="QueuedResource")
            self.store.save()
        self.store.spawn(self.provision, name, self.store.settings.create_delay)
