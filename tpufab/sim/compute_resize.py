"""Resize requests of a MIG (``instanceGroupManagers/MIG/resizeRequests``): the flex-start
path Google documents for TPU slices ("Create a MIG with multi-host TPU slice", flex-start):
a request for ``resizeBy`` VMs that run for ``requestedRunDuration``, created all at once or
not at all. insert, get, list, cancel, delete; a request is ACCEPTED, then CREATING while its
VMs come up, SUCCEEDED once they run, FAILED (with the reason in ``status.error``) if they
cannot be created, CANCELLED by cancel."""

from __future__ import annotations

from typing import Any

from tpufab.sim._model import rfc3339
from tpufab.sim.compute_groups import InstanceGroups
from tpufab.sim.compute_shapes import check_name, error, new_id, not_found
from tpufab.sim.compute_state import ComputeState
from tpufab.sim.store import copy


class ResizeRequests:
    """The resize requests of the Compute Engine emulator's MIGs (caller holds the lock)."""

    def __init__(self, state: ComputeState, groups: InstanceGroups):
        self.state = state
        self.groups = groups

    def _key(self, group_key: str, name: str) -> str:
        key = f"{group_key}/resizeRequests/{name}"
        if key not in self.state["resizeRequests"]:
            raise not_found("instanceGroupManagerResizeRequest", key.removeprefix("projects/"))
        return key

    def view(self, key: str) -> dict[str, Any]:
        record = self.state["resizeRequests"][key]
        request = copy(record["request"])
        if request["state"] in ("ACCEPTED", "CREATING"):
            node = self.state.node(record.get("node"))
            if node is None and record.get("node"):
                group = self.state["groups"].get(record["group"]) or {}
                request["state"] = "FAILED"
                request["status"] = {"error": {"errors": [
                    {"code": "ZONE_RESOURCE_POOL_EXHAUSTED" if group.get("failureReason")
                     != "quota" else "QUOTA_EXCEEDED",
                     "message": group.get("failure") or "The VMs could not be created."}]}}
            elif node is not None and node["node"]["state"] == "READY":
                request["state"] = "SUCCEEDED"
            elif node is not None:
                request["state"] = "CREATING"
            record["request"]["state"] = request["state"]
            if "status" in request:
                record["request"]["status"] = request["status"]
        return request

    def list(self, project: str, zone: str, name: str, query: dict[str, str]) -> dict[str, Any]:
        group_key = self.state.group_key(project, zone, name)
        items = [self.view(k) for k in self.state["resizeRequests"]
                 if k.startswith(group_key + "/resizeRequests/")]
        return self.state.list("compute#instanceGroupManagerResizeRequestsListResponse", items,
                               project, f"zones/{zone}/instanceGroupManagers/{name}/"
                               "resizeRequests", query)

    def get(self, project: str, zone: str, name: str, request: str) -> dict[str, Any]:
        return self.view(self._key(self.state.group_key(project, zone, name), request))

    def insert(self, project: str, zone: str, name: str, body: dict[str, Any]) -> dict[str, Any]:
        group_key = self.state.group_key(project, zone, name)
        request_name = check_name("resizeRequest", body.get("name"))
        key = f"{group_key}/resizeRequests/{request_name}"
        if key in self.state["resizeRequests"]:
            raise error(409, "alreadyExists", f"The resource '{key}' already exists")
        try:
            resize_by = int(body.get("resizeBy") or 0)
        except (TypeError, ValueError):
            resize_by = 0
        if resize_by < 1:
            raise error(400, "invalid", "Invalid value for field 'resource.resizeBy': it must "
                        "be at least 1.")
        group = self.state["groups"][group_key]
        if self.groups.slice_topology(group_key) is not None:
            hosts = self.groups.slice_hosts(group_key)
            if group["members"] or resize_by != hosts:
                raise error(400, "invalid", f"A resize request for a multi-host TPU slice "
                            f"creates all {hosts} of its VMs, from none (resizeBy {hosts}).")
        run = body.get("requestedRunDuration") or None
        size = len(group["members"]) + resize_by
        group["group"]["targetSize"] = size
        node = self.groups.grow(group_key, size, run_duration=run)
        link = self.state.link(key)
        request = {"kind": "compute#instanceGroupManagerResizeRequest", "id": new_id(),
                   "name": request_name, "creationTimestamp": rfc3339(),
                   "description": body.get("description", ""), "resizeBy": resize_by,
                   "state": "ACCEPTED", "zone": self.state.link(f"projects/{project}/zones/"
                                                                f"{zone}"),
                   "selfLink": link, "selfLinkWithId": link}
        if run:
            request["requestedRunDuration"] = dict(run)
        self.state["resizeRequests"][key] = {"request": request, "node": node,
                                             "group": group_key}
        self.state.store.save()
        return self.state.operation(project, "zones", zone, "insert", key, request["id"])

    def cancel(self, project: str, zone: str, name: str, request: str) -> dict[str, Any]:
        """Cancel a request still ACCEPTED or CREATING: its VMs go, the MIG shrinks back."""
        group_key = self.state.group_key(project, zone, name)
        key = self._key(group_key, request)
        view = self.view(key)
        if view["state"] not in ("ACCEPTED", "CREATING"):
            raise error(400, "invalid", f"The resize request '{request}' is {view['state']}; "
                        "only an accepted or creating one can be cancelled.")
        record = self.state["resizeRequests"][key]
        group = self.state["groups"][group_key]
        node = record.get("node")
        for member in [m for m in group["members"]
                       if (self.state["instances"].get(m) or {}).get("node") == node]:
            group["members"].remove(member)
            self.state["instances"].pop(member, None)
        if node in group["nodes"]:
            group["nodes"].remove(node)
            self.state.backing.delete(node)
        group["group"]["targetSize"] = len(group["members"])
        record["request"]["state"] = "CANCELLED"
        self.state.store.save()
        return self.state.operation(project, "zones", zone, "cancel", key,
                                    record["request"]["id"])

    def delete(self, project: str, zone: str, name: str, request: str) -> dict[str, Any]:
        """Delete a request that is done (its VMs stay); one in progress is cancelled first."""
        group_key = self.state.group_key(project, zone, name)
        key = self._key(group_key, request)
        if self.view(key)["state"] in ("ACCEPTED", "CREATING"):
            self.cancel(project, zone, name, request)
        record = self.state["resizeRequests"].pop(key)
        return self.state.operation(project, "zones", zone, "delete", key,
                                    record["request"]["id"])
