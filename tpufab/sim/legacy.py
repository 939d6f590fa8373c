"""Legacy TPU Nodes (Cloud TPU API v1 ``nodes``): the architecture where a user VM talks to the
TPU over gRPC (port 8470) and the TPU hosts are not the user's (SkyPilot's ``tpu_vm: False``,
``gcloud compute tpus create|list|describe|delete``). Control plane only: such a node has no
workers to SSH into, so the emulator starts none. A handler of the emulator over the shared
store; its nodes live in its table ``legacyNodes`` and its operations in the shared operations."""

from __future__ import annotations

import ipaddress
import json
from typing import Any

from tpufab.errors import ConfigError
from tpufab.sim._model import (
    ApiFailure,
    check_id,
    not_found,
    page,
    rfc3339,
    split_name,
    v1_node_in_v2,
)
from tpufab.sim.store import SimStore
from tpufab.topology import parse_accelerator_type

GRPC_PORT = "8470"
DEFAULT_CIDR = "10.240.0.0/29"


class LegacyNodes:
    """API v1 nodes: made, listed, got and deleted; no workers."""

    def __init__(self, store: SimStore):
        self.store = store

    @property
    def _nodes(self) -> dict[str, dict[str, Any]]:
        return self.store.table("legacyNodes")

    def handle(self, method: str, rest: str, query: dict[str, str],
               body: dict[str, Any]) -> dict[str, Any]:
        """``rest``: the path after ``/v1/`` (projects/P/locations/Z/{nodes|operations}...)."""
        parts = rest.split("/")
        if len(parts) < 5 or parts[0] != "projects" or parts[2] != "locations":
            raise ApiFailure("NOT_FOUND", f"The requested URL /v1/{rest} was not found.")
        parent = "/".join(parts[:4])
        collection = parts[4]
        if collection == "operations" and len(parts) == 6 and method == "GET":
            return self.store.operation(f"{parent}/operations/{parts[5]}")
        if collection == "nodes" and len(parts) == 5:
            if method == "GET":
                return self.list(parent, query)
            if method == "POST":
                return self.create(parent, query, body)
        if collection == "nodes" and len(parts) == 6 and ":" not in parts[5]:
            name = f"{parent}/nodes/{parts[5]}"
            if method == "GET":
                return self.get(name)
            if method == "DELETE":
                return self.delete(name)
        raise ApiFailure("UNIMPLEMENTED", f"Method {method} /v1/{rest} of legacy TPU Nodes is "
                         "not emulated (create, list, get and delete are).")

    def get(self, name: str) -> dict[str, Any]:
        with self.store.lock:
            node = self._nodes.get(name)
            if node is None:
                raise not_found(name)
            return json.loads(json.dumps(node))

    def list(self, parent: str, query: dict[str, str]) -> dict[str, Any]:
        prefix = parent[:-1] if parent.endswith("/locations/-") else parent + "/nodes/"
        with self.store.lock:
            nodes = [json.loads(json.dumps(n)) for k, n in self._nodes.items()
                     if k.startswith(prefix)]
        items, token = page(nodes, query)
        out: dict[str, Any] = {"nodes": items}
        if token:
            out["nextPageToken"] = token
        return out

    def create(self, parent: str, query: dict[str, str], body: dict[str, Any]) -> dict[str, Any]:
        node_id = check_id("node", query.get("nodeId") or query.get("node_id"))
        name = f"{parent}/nodes/{node_id}"
        try:
            topo = parse_accelerator_type(str(body.get("acceleratorType") or ""))
        except ConfigError as err:
            raise ApiFailure("INVALID_ARGUMENT", str(err)) from None
        version = body.get("tensorflowVersion")
        if not version:
            raise ApiFailure("INVALID_ARGUMENT", "tensorflowVersion is required.")
        try:
            cidr = ipaddress.ip_network(body.get("cidrBlock") or DEFAULT_CIDR)
        except ValueError:
            raise ApiFailure("INVALID_ARGUMENT",
                             f"cidrBlock {body.get('cidrBlock')!r} is not a network.") from None
        project = split_name(name)[0]
        ip = str(next(cidr.hosts()))
        node = {
            "name": name, "acceleratorType": topo.name, "tensorflowVersion": version,
            "network": body.get("network") or "default", "cidrBlock": str(cidr),
            "state": "CREATING", "createTime": rfc3339(), "apiVersion": "V1",
            "ipAddress": ip, "port": GRPC_PORT,
            "networkEndpoints": [{"ipAddress": ip, "port": int(GRPC_PORT)}],
            "schedulingConfig": dict(body.get("schedulingConfig") or {}),
            "serviceAccount": f"service-{project}@cloud-tpu.iam.gserviceaccount.com",
            "useServiceNetworking": bool(body.get("useServiceNetworking", False)),
        }
        for key in ("description", "labels"):
            if key in body:
                node[key] = body[key]
        with self.store.lock:
            if name in self._nodes or name in self.store.nodes:
                raise ApiFailure("ALREADY_EXISTS", f"Resource '{name}' already exists")
            self._nodes[name] = node
            op = self.store.new_operation("v1", name, "create")
            self.store.save()
            op = json.loads(json.dumps(op))
        self.store.spawn(self._finish_create, name, op["name"])
        return op

    def _finish_create(self, name: str, op_name: str) -> None:
        if self.store.wait(self.store.settings.create_delay):
            return
        with self.store.lock:
            node = self._nodes.get(name)
            if node is None or node["state"] != "CREATING":
                return
            node.update(state="READY", health="HEALTHY")
            self.store.finish_operation(op_name, response=node)
            self.store.save()

    def v2_view(self, name: str) -> dict[str, Any] | None:
        """The node as API v2 shows a node the v1 API created (apiVersion V1), or None."""
        with self.store.lock:
            node = self._nodes.get(name)
            return None if node is None else v1_node_in_v2(json.loads(json.dumps(node)))

    def v2_list(self, prefix: str) -> list[dict[str, Any]]:
        with self.store.lock:
            names = [n for n in self._nodes if n.startswith(prefix)]
        return [v for v in (self.v2_view(n) for n in names) if v is not None]

    def delete(self, name: str, version: str = "v1") -> dict[str, Any]:
        with self.store.lock:
            node = self._nodes.get(name)
            if node is None:
                raise not_found(name)
            node["state"] = "DELETING"
            node.pop("health", None)
            op = self.store.new_operation(version, name, "delete")
            self.store.save()
            op = json.loads(json.dumps(op))
        self.store.spawn(self._finish_delete, name, op["name"])
        return op

    def _finish_delete(self, name: str, op_name: str) -> None:
        if self.store.wait(self.store.settings.operation_delay):
            return
        with self.store.lock:
            if self._nodes.pop(name, None) is None:
                return
            self.store.finish_operation(op_name, response_type="Empty")
            self.store.save()

    def resume(self) -> set[str]:
        """After a daemon restart (caller holds the lock): finish what was in flight; returns
        the operations it owns."""
        owned = set()
        for op_name, op in self.store.operations.items():
            target = op["metadata"].get("target", "")
            node = self._nodes.get(target)
            if op.get("done") or node is None:
                continue
            owned.add(op_name)
            if node["state"] == "CREATING":
                node.update(state="READY", health="HEALTHY")
                self.store.finish_operation(op_name, response=node)
            elif node["state"] == "DELETING":
                del self._nodes[target]
                self.store.finish_operation(op_name, response_type="Empty")
        return owned
