"""What the Compute Engine emulator's handlers share: its tables (instances, templates, MIGs,
resource policies, reservations, operations) in the store under ``compute``, its links, and its
operations (zonal, regional and global; one that waits on a backing node finishes when the
node gets there)."""

from __future__ import annotations

import json
import secrets
import time
from typing import Any

from tpufab.sim._model import rfc3339
from tpufab.sim.backing import BackingNodes
from tpufab.sim.compute_shapes import error, new_id, not_found
from tpufab.sim.store import SimStore

TABLES = ("instances", "templates", "groups", "policies", "operations", "reservations")


class ComputeState:
    """The Compute Engine tables and operations, over the shared store (caller holds its
    lock for every method)."""

    def __init__(self, store: SimStore, backing: BackingNodes):
        self.store = store
        self.backing = backing

    @property
    def tables(self) -> dict[str, Any]:
        tables = self.store.table("compute")
        for key in TABLES:
            tables.setdefault(key, {})
        return tables

    def __getitem__(self, table: str) -> dict[str, Any]:
        return self.tables[table]

    def base(self) -> str:
        return f"{self.store.base_url or 'https://compute.googleapis.com'}/compute/v1/"

    def link(self, path: str) -> str:
        return self.base() + path

    def node(self, name: str | None) -> dict[str, Any] | None:
        """The backing node record ``name`` (None if gone)."""
        return self.store.nodes.get(name or "")

    def operation(self, project: str, scope: str, where: str, kind: str, target: str,
                  target_id: str = "", *, wait_node: str | None = None,
                  until: str = "done", failure: tuple[str, str] | None = None
                  ) -> dict[str, Any]:
        """A new operation; ``wait_node``/``until`` ("READY" or "gone") make it finish when
        the backing node gets there, else it is DONE at once. ``failure``: the (reason,
        message) an insert waiting on a node ends with if the node never comes up."""
        name = f"operation-{int(time.time() * 1000)}-{secrets.token_hex(6)}"
        path = f"projects/{project}/{scope}/{where}/operations/{name}"
        op = {
            "kind": "compute#operation", "id": new_id(), "name": name,
            "operationType": kind, "targetLink": self.link(target), "targetId": target_id or None,
            "status": "RUNNING", "progress": 0, "insertTime": rfc3339(),
            "startTime": rfc3339(), "selfLink": self.link(path),
            "user": "sim@sim-project.iam.gserviceaccount.com",
            ("zone" if scope == "zones" else "region"): self.link(
                f"projects/{project}/{scope}/{where}") if scope != "global" else None,
        }
        op = {k: v for k, v in op.items() if v is not None}
        self.tables["operations"][path] = {"op": op, "node": wait_node, "until": until,
                                           "failure": failure[1] if failure else None,
                                           "failureReason": failure[0] if failure else None}
        if wait_node is None and until == "done":
            self.finish(path)
        self.store.save()
        return self.op_view(path)

    def finish(self, path: str, error: tuple[str, str] | None = None) -> None:
        record = self.tables["operations"][path]
        op = record["op"]
        if op["status"] == "DONE":
            return
        op.update(status="DONE", progress=100, endTime=rfc3339())
        if error:
            op["error"] = {"errors": [{"code": error[0], "message": error[1]}]}
            op["httpErrorStatusCode"] = 400 if error[0] != "ZONE_RESOURCE_POOL_EXHAUSTED" \
                else 503
            op["httpErrorMessage"] = "BAD REQUEST"

    def op_view(self, path: str) -> dict[str, Any]:
        record = self.tables["operations"].get(path)
        if record is None:
            raise not_found("operation", path.removeprefix("projects/"))
        op = record["op"]
        if op["status"] != "DONE" and record.get("node"):
            nodes = self.store.nodes
            node = nodes.get(record["node"])
            if record["until"] == "READY":
                if node is None:  # the create failed: no VM is left behind
                    for key in [k for k, r in self.tables["instances"].items()
                                if r.get("node") == record["node"]]:
                        del self.tables["instances"][key]
                    reason = record.get("failureReason")
                    self.finish(path, ("ZONE_RESOURCE_POOL_EXHAUSTED" if reason == "stockout"
                                       else "QUOTA_EXCEEDED" if reason == "quota" else
                                       "RESOURCE_NOT_FOUND",
                                       record.get("failure") or "The VM was deleted."))
                elif node["node"]["state"] == "READY":
                    self.finish(path)
                elif node["node"]["state"] == "UNKNOWN":
                    self.finish(path, ("INTERNAL_ERROR", node["node"].get(
                        "healthDescription", "The simulated workers did not start.")))
            elif record["until"] == "gone" and node is None:
                self.finish(path)
            elif record["until"] == "STOPPED" and (node is None or node["node"]["state"] in (
                    "STOPPED", "PREEMPTED")):
                self.finish(path)
        if record.get("done_check") == "metadata" and record.get("synced"):
            self.finish(path)
        return json.loads(json.dumps(op))

    def wait_op(self, path: str, timeout: float = 30.0) -> dict[str, Any]:
        deadline = time.monotonic() + min(timeout, 120.0)
        while True:
            view = self.op_view(path)
            if view["status"] == "DONE" or time.monotonic() >= deadline:
                return view
            self.store.lock.release()
            try:
                time.sleep(0.05)
            finally:
                self.store.lock.acquire()

    def operations(self, method: str, project: str, scope: str, where: str,
                   rest: list[str]) -> dict[str, Any]:
        path = f"projects/{project}/{scope}/{where}/operations/{rest[0]}"
        if method == "GET" and len(rest) == 1:
            return self.op_view(path)
        if method == "POST" and rest[1:] == ["wait"]:
            return self.wait_op(path)
        if method == "DELETE" and len(rest) == 1:
            self.tables["operations"].pop(path, None)
            return {}
        raise not_found("operation", path.removeprefix("projects/"))

    def global_operation(self, method: str, project: str, tail: list[str]) -> dict[str, Any]:
        path = f"projects/{project}/global/operations/{tail[0]}"
        if method == "GET" and len(tail) == 1:
            return self.op_view(path)
        if method == "POST" and tail[1:] == ["wait"]:
            return self.wait_op(path)
        raise not_found("operation", path.removeprefix("projects/"))

    def global_op(self, project: str, kind: str, target: str) -> dict[str, Any]:
        name = f"operation-{int(time.time() * 1000)}-{secrets.token_hex(6)}"
        path = f"projects/{project}/global/operations/{name}"
        op = {"kind": "compute#operation", "id": new_id(), "name": name,
              "operationType": kind, "targetLink": self.link(target), "status": "DONE",
              "progress": 100, "insertTime": rfc3339(), "startTime": rfc3339(),
              "endTime": rfc3339(), "selfLink": self.link(path)}
        self.tables["operations"][path] = {"op": op, "node": None, "until": "done"}
        self.store.save()
        return json.loads(json.dumps(op))

    def list(self, kind: str, items: list[dict[str, Any]], project: str,
             where: str) -> dict[str, Any]:
        return {"kind": kind, "id": f"projects/{project}/{where}", "items": items,
                "selfLink": self.link(f"projects/{project}/{where}")}

    def refuse_in_use(self, key: str, field: str) -> None:
        for group_key, group in self.tables["groups"].items():
            used = group["group"].get("instanceTemplate", "") if field == "instanceTemplate" \
                else (group["group"].get("resourcePolicies") or {}).get("workloadPolicy", "")
            if used and used.endswith(key.split("/", 2)[2]):
                raise error(400, "resourceInUseByAnotherResource",
                            f"The resource '{key}' is already being used by '{group_key}'")

    def group_key(self, project: str, zone: str, name: str) -> str:
        key = f"projects/{project}/zones/{zone}/instanceGroupManagers/{name}"
        if key not in self.tables["groups"]:
            raise not_found("instanceGroupManager", key.removeprefix("projects/"))
        return key

    def lookup(self, table: str, url: str, project: str, scope: str) -> tuple[str, dict]:
        """A full URL, a partial one (``projects/P/...``, ``regions/R/...``,
        ``global/...``) or a bare name -> (state key, record)."""
        path = url.split("/compute/v1/", 1)[-1].strip("/")
        if path.startswith("projects/"):
            key = path
        elif "/" in path:
            key = f"projects/{project}/{path}"
        else:
            key = f"projects/{project}/{scope}/{path}"
        found = self.tables[table].get(key)
        if found is None:
            raise error(404, "notFound", f"The resource '{key}' was not found")
        return key, found

    def instance(self, project: str, zone: str, name: str) -> dict[str, Any]:
        key = f"projects/{project}/zones/{zone}/instances/{name}"
        record = self.tables["instances"].get(key)
        if record is None:
            raise not_found("instance", key.removeprefix("projects/"))
        return record

    def shrink_group(self, key: str) -> str | None:
        """Every VM of MIG ``key`` gone (their backing nodes deleted); the last node to wait
        for."""
        record = self.tables["groups"][key]
        for member in record["members"]:
            self.tables["instances"].pop(member, None)
        record["members"] = []
        record.pop("missing", None)
        last = None
        for node_name in record["nodes"]:
            self.backing.delete(node_name)
            last = node_name
        record["nodes"] = []
        return last
