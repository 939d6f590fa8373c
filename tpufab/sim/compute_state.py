"""What the Compute Engine emulator's handlers share: its tables (instances, templates, MIGs,
resource policies, reservations, resize requests, operations) in the store under ``compute``,
its links, its lists (Compute Engine's ``filter`` and paging, aggregated lists), and its
operations (zonal, regional and global; one that waits on a backing node finishes when the
node gets there)."""

from __future__ import annotations

import secrets
import time
from typing import Any

from tpufab.sim._model import rfc3339
from tpufab.sim.backing import BackingNodes
from tpufab.sim.catalog import project_number
from tpufab.sim.compute_filter import FilterError, page, parse
from tpufab.sim.compute_shapes import error, new_id, not_found
from tpufab.sim.store import SimStore, copy

TABLES = ("instances", "templates", "groups", "policies", "operations", "reservations",
          "resizeRequests")
HTTP_REASONS = {400: "BAD REQUEST", 403: "FORBIDDEN", 404: "NOT FOUND", 409: "CONFLICT",
                412: "PRECONDITION FAILED", 429: "TOO MANY REQUESTS", 500: "INTERNAL ERROR",
                503: "SERVICE UNAVAILABLE"}
ERROR_STATUS = {"ZONE_RESOURCE_POOL_EXHAUSTED": 503, "QUOTA_EXCEEDED": 403,
                "RESOURCE_NOT_FOUND": 404, "INTERNAL_ERROR": 500}


def operation_user(project: str) -> str:
    """Who an operation says made it: the emulator's callers are anonymous, so the project's
    default compute service account."""
    return f"{project_number(project)}-compute@developer.gserviceaccount.com"


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

    # ---------------------------------------------------------------- lists

    def list(self, kind: str, items: list[dict[str, Any]], project: str, where: str,
             query: dict[str, str] | None = None) -> dict[str, Any]:
        """A ``...List`` answer: ``items`` kept by the request's ``filter``, one page of them
        per ``maxResults``/``pageToken``."""
        query = query or {}
        kept, token = page(self.filtered(items, query), query)
        out: dict[str, Any] = {"kind": kind, "id": f"projects/{project}/{where}",
                               "items": kept, "selfLink": self.link(f"projects/{project}/{where}")}
        if token:
            out["nextPageToken"] = token
        return out

    def aggregated(self, kind: str, field: str, scoped: dict[str, list[dict[str, Any]]],
                   project: str, what: str, query: dict[str, str]) -> dict[str, Any]:
        """An ``...AggregatedList`` answer: ``{scope: {field: [...]}}`` for every scope
        (``zones/Z``, ``regions/R``, ``global``) holding items that the filter keeps, paged
        over all of them in scope order."""
        pairs = [(scope, item) for scope in sorted(scoped)
                 for item in self.filtered(scoped[scope], query)]
        kept, token = page(pairs, query)
        items: dict[str, Any] = {}
        for scope, item in kept:
            items.setdefault(scope, {field: []})[field].append(item)
        out: dict[str, Any] = {"kind": kind, "id": f"projects/{project}/aggregated/{what}",
                               "items": items,
                               "selfLink": self.link(f"projects/{project}/aggregated/{what}")}
        if token:
            out["nextPageToken"] = token
        return out

    @staticmethod
    def filtered(items: list[dict[str, Any]], query: dict[str, str]) -> list[dict[str, Any]]:
        try:
            keep = parse(query.get("filter"))
        except FilterError as err:
            raise error(400, "invalid", str(err)) from None
        return [item for item in items if keep(item)]

    # ---------------------------------------------------------------- operations

    def operation(self, project: str, scope: str, where: str, kind: str, target: str,
                  target_id: str = "", *, wait_node: str | None = None,
                  until: str = "done", failure: tuple[str, str] | None = None,
                  worker: int | None = None) -> dict[str, Any]:
        """A new operation on ``target`` (``scope`` zones, regions or global); ``wait_node``
        and ``until`` make it finish when the backing node gets there ("READY", "gone",
        "STOPPED"; "worker": when ``worker`` of it is recreated or reset), else it is DONE
        at once. ``failure``: the (reason, message) an insert ends with if its node never
        comes up."""
        name = f"operation-{int(time.time() * 1000)}-{secrets.token_hex(6)}"
        path = f"projects/{project}/global/operations/{name}" if scope == "global" else \
            f"projects/{project}/{scope}/{where}/operations/{name}"
        op = {
            "kind": "compute#operation", "id": new_id(), "name": name,
            "operationType": kind, "targetLink": self.link(target), "targetId": target_id or None,
            "status": "RUNNING", "progress": 0, "insertTime": rfc3339(),
            "startTime": rfc3339(), "selfLink": self.link(path), "user": operation_user(project),
            ("zone" if scope == "zones" else "region"): self.link(
                f"projects/{project}/{scope}/{where}") if scope != "global" else None,
        }
        op = {k: v for k, v in op.items() if v is not None}
        self.tables["operations"][path] = {"op": op, "node": wait_node, "until": until,
                                           "failure": failure[1] if failure else None,
                                           "failureReason": failure[0] if failure else None,
                                           "worker": worker}
        if wait_node is None and until == "done":
            self.finish(path)
        self.store.save()
        return self.op_view(path)

    def finish(self, path: str, failed: tuple[str, str] | None = None) -> None:
        record = self.tables["operations"][path]
        op = record["op"]
        if op["status"] == "DONE":
            return
        op.update(status="DONE", progress=100, endTime=rfc3339())
        if failed:
            op["error"] = {"errors": [{"code": failed[0], "message": failed[1]}]}
            status = ERROR_STATUS.get(failed[0], 400)
            op["httpErrorStatusCode"] = status
            op["httpErrorMessage"] = HTTP_REASONS.get(status, "BAD REQUEST")

    def op_view(self, path: str) -> dict[str, Any]:
        record = self.tables["operations"].get(path)
        if record is None:
            raise not_found("operation", path.removeprefix("projects/"))
        op = record["op"]
        if op["status"] != "DONE" and record.get("node"):
            node = self.store.nodes.get(record["node"])
            until = record["until"]
            if until == "READY":
                if node is None:  # the create failed: no VM is left behind
                    self.reap()
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
            elif until == "gone" and node is None:
                self.finish(path)
            elif until == "STOPPED" and (node is None or node["node"]["state"] in (
                    "STOPPED", "PREEMPTED")):
                self.finish(path)
            elif until == "worker" and (node is None or str(record.get("worker")) not in
                                        {**(node["sim"].get("recreating") or {}),
                                         **(node["sim"].get("resetting") or {})}):
                self.finish(path)
        if record.get("done_check") == "metadata" and record.get("synced"):
            self.finish(path)
        return copy(op)

    def wait_op(self, path: str, timeout: float = 30.0) -> dict[str, Any]:
        """operations.wait: the operation once DONE, or as it is after about 30 s."""
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

    def op_path(self, project: str, scope: str, where: str, name: str) -> str:
        if scope == "global":
            return f"projects/{project}/global/operations/{name}"
        return f"projects/{project}/{scope}/{where}/operations/{name}"

    def delete_op(self, path: str) -> dict[str, Any]:
        if self.tables["operations"].pop(path, None) is None:
            raise not_found("operation", path.removeprefix("projects/"))
        self.store.save()
        return {}

    def list_ops(self, project: str, scope: str, where: str,
                 query: dict[str, str]) -> dict[str, Any]:
        prefix = self.op_path(project, scope, where, "")
        items = [self.op_view(p) for p in list(self.tables["operations"])
                 if p.startswith(prefix)]
        return self.list("compute#operationList", items, project,
                         prefix.removeprefix(f"projects/{project}/").rstrip("/"), query)

    def aggregated_ops(self, project: str, query: dict[str, str]) -> dict[str, Any]:
        scoped: dict[str, list[dict[str, Any]]] = {}
        for path in list(self.tables["operations"]):
            parts = path.split("/")
            if parts[1] != project:
                continue
            scope = "global" if parts[2] == "global" else f"{parts[2]}/{parts[3]}"
            scoped.setdefault(scope, []).append(self.op_view(path))
        return self.aggregated("compute#operationAggregatedList", "operations", scoped,
                               project, "operations", query)

    # ---------------------------------------------------------------- records

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

    def reap(self) -> None:
        """Instances whose backing node is gone (its create failed: a stockout, quota, or the
        workers did not start) are not VMs: a standalone one vanishes, as a failed insert
        leaves none behind; a MIG's is one the MIG is still trying to create (listErrors and
        listManagedInstances say why)."""
        gone = [(k, r) for k, r in self.tables["instances"].items()
                if r.get("node") and r["node"] not in self.store.nodes]
        for key, record in gone:
            del self.tables["instances"][key]
            group = self.tables["groups"].get(record.get("group") or "")
            if group is None:
                continue
            if key in group["members"]:
                group["members"].remove(key)
            group.setdefault("missing", {})[key.rsplit("/", 1)[1]] = \
                group.get("failure") or "The VM could not be created."
            if record["node"] in group["nodes"]:
                group["nodes"].remove(record["node"])
        if gone:
            self.store.save()

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
