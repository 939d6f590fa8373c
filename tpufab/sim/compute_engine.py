"""Compute Engine v1, the subset TPU VMs use, served by the emulator under ``/compute/v1/``.

Every method served is one row of ``ROUTES`` (its HTTP method, its path under
``projects/{project}/``, its name in the API's discovery document, e.g.
``compute.instances.insert``); ``COMPUTE_METHODS`` lists them (docs/simulated-pod.md shows the
table, tests/test_sim_conformance.py drives each). The handlers: compute_instances.py
(instances), compute_groups.py (MIGs and their instance groups), compute_resize.py (resize
requests), compute_resources.py (the project, zones, regions, types, images, networks,
policies, templates, reservations), over compute_state.py (tables, lists, operations). Lists
take the API's ``filter``, ``maxResults`` and ``pageToken`` (compute_filter.py); errors have
its shape (``{error: {code, message, errors: [{domain, reason, message}]}}``).
``POST /batch/compute/v1`` (``batch``) answers the multipart batches gcloud sends when a
command names several resources.

Every TPU VM is backed by a node record of the emulator (backing.py: its workers, metadata
server, host keys, preemption): a standalone instance by the node
``projects/P/locations/Z/ceInstances/N`` (one worker), a MIG with a workload policy by
``.../ceGroups/MIG`` (one worker per VM, in the order the slice numbers them). Those records
never show in the Cloud TPU API. See docs/control-plane.md.
"""

from __future__ import annotations

import email.parser
import email.policy
import json
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

from tpufab.sim.backing import BackingNodes
from tpufab.sim.compute_groups import InstanceGroups
from tpufab.sim.compute_instances import Instances
from tpufab.sim.compute_resize import ResizeRequests
from tpufab.sim.compute_resources import ProjectResources
from tpufab.sim.compute_shapes import error, not_found
from tpufab.sim.compute_state import ComputeState
from tpufab.sim.guest import GuestEnvironment
from tpufab.sim.oslogin import OsLoginService
from tpufab.sim.store import SimStore, copy

MAX_BATCH = 1000  # requests in one batch, as Compute Engine caps it


@dataclass(frozen=True)
class Call:
    """One request to a route: the project, the path's named parts, the query, the body."""

    project: str
    params: dict[str, str]
    query: dict[str, str]
    body: dict[str, Any]

    def __getitem__(self, name: str) -> str:
        return self.params[name]


@dataclass(frozen=True)
class Route:
    method: str
    pattern: str  # under projects/{project}/, "" for the project itself
    name: str  # the API method, as its discovery document names it
    returns: str  # the message it answers with (the discovery document's name)
    answer: Callable[[ComputeEngineEmulator, Call], dict[str, Any]]

    def match(self, method: str, parts: list[str]) -> dict[str, str] | None:
        wanted = self.pattern.split("/") if self.pattern else []
        if method != self.method or len(wanted) != len(parts):
            return None
        params = {}
        for want, got in zip(wanted, parts, strict=True):
            if want.startswith("{"):
                if not got:
                    return None
                params[want[1:-1]] = got
            elif want != got:
                return None
        return params


def _r(method: str, pattern: str, name: str, returns: str,
       answer: Callable[[ComputeEngineEmulator, Call], dict[str, Any]]) -> Route:
    return Route(method, pattern, name, returns, answer)


Z = "zones/{zone}"
R = "regions/{region}"
I = f"{Z}/instances/{{instance}}"  # noqa: E741 - the instance path, as the API writes it
M = f"{Z}/instanceGroupManagers/{{igm}}"

ROUTES: tuple[Route, ...] = (
    # the project, zones, regions
    _r("GET", "", "compute.projects.get", "Project", lambda e, c: e.resources.project(c.project)),
    _r("POST", "setCommonInstanceMetadata", "compute.projects.setCommonInstanceMetadata",
       "Operation", lambda e, c: e.resources.set_common_metadata(c.project, c.body)),
    _r("GET", "zones", "compute.zones.list", "ZoneList",
       lambda e, c: e.resources.zones(c.project, c.query)),
    _r("GET", Z, "compute.zones.get", "Zone", lambda e, c: e.resources.zone(c.project, c["zone"])),
    _r("GET", "regions", "compute.regions.list", "RegionList",
       lambda e, c: e.resources.regions(c.project, c.query)),
    _r("GET", R, "compute.regions.get", "Region",
       lambda e, c: e.resources.region(c.project, c["region"])),
    # operations
    _r("GET", f"{Z}/operations", "compute.zoneOperations.list", "OperationList",
       lambda e, c: e.state.list_ops(c.project, "zones", c["zone"], c.query)),
    _r("GET", f"{Z}/operations/{{op}}", "compute.zoneOperations.get", "Operation",
       lambda e, c: e.state.op_view(e.state.op_path(c.project, "zones", c["zone"], c["op"]))),
    _r("POST", f"{Z}/operations/{{op}}/wait", "compute.zoneOperations.wait", "Operation",
       lambda e, c: e.state.wait_op(e.state.op_path(c.project, "zones", c["zone"], c["op"]))),
    _r("DELETE", f"{Z}/operations/{{op}}", "compute.zoneOperations.delete",
       "ComputeZoneOperationsDeleteResponse",
       lambda e, c: e.state.delete_op(e.state.op_path(c.project, "zones", c["zone"], c["op"]))),
    _r("GET", f"{R}/operations", "compute.regionOperations.list", "OperationList",
       lambda e, c: e.state.list_ops(c.project, "regions", c["region"], c.query)),
    _r("GET", f"{R}/operations/{{op}}", "compute.regionOperations.get", "Operation",
       lambda e, c: e.state.op_view(e.state.op_path(c.project, "regions", c["region"],
                                                    c["op"]))),
    _r("POST", f"{R}/operations/{{op}}/wait", "compute.regionOperations.wait", "Operation",
       lambda e, c: e.state.wait_op(e.state.op_path(c.project, "regions", c["region"],
                                                    c["op"]))),
    _r("DELETE", f"{R}/operations/{{op}}", "compute.regionOperations.delete",
       "ComputeRegionOperationsDeleteResponse",
       lambda e, c: e.state.delete_op(e.state.op_path(c.project, "regions", c["region"],
                                                      c["op"]))),
    _r("GET", "global/operations", "compute.globalOperations.list", "OperationList",
       lambda e, c: e.state.list_ops(c.project, "global", "", c.query)),
    _r("GET", "global/operations/{op}", "compute.globalOperations.get", "Operation",
       lambda e, c: e.state.op_view(e.state.op_path(c.project, "global", "", c["op"]))),
    _r("POST", "global/operations/{op}/wait", "compute.globalOperations.wait", "Operation",
       lambda e, c: e.state.wait_op(e.state.op_path(c.project, "global", "", c["op"]))),
    _r("DELETE", "global/operations/{op}", "compute.globalOperations.delete",
       "ComputeGlobalOperationsDeleteResponse",
       lambda e, c: e.state.delete_op(e.state.op_path(c.project, "global", "", c["op"]))),
    _r("GET", "aggregated/operations", "compute.globalOperations.aggregatedList",
       "OperationAggregatedList", lambda e, c: e.state.aggregated_ops(c.project, c.query)),
    # machine types, accelerator types, images, networks
    _r("GET", f"{Z}/machineTypes", "compute.machineTypes.list", "MachineTypeList",
       lambda e, c: e.resources.machine_types(c.project, c["zone"], c.query)),
    _r("GET", f"{Z}/machineTypes/{{machineType}}", "compute.machineTypes.get", "MachineType",
       lambda e, c: e.resources.machine_type(c.project, c["zone"], c["machineType"])),
    _r("GET", "aggregated/machineTypes", "compute.machineTypes.aggregatedList",
       "MachineTypeAggregatedList",
       lambda e, c: e.resources.aggregated_machine_types(c.project, c.query)),
    _r("GET", f"{Z}/acceleratorTypes", "compute.acceleratorTypes.list", "AcceleratorTypeList",
       lambda e, c: e.resources.accelerator_types(c.project, c["zone"], c.query)),
    _r("GET", f"{Z}/acceleratorTypes/{{acceleratorType}}", "compute.acceleratorTypes.get",
       "AcceleratorType",
       lambda e, c: e.resources.accelerator_type(c.project, c["zone"], c["acceleratorType"])),
    _r("GET", "aggregated/acceleratorTypes", "compute.acceleratorTypes.aggregatedList",
       "AcceleratorTypeAggregatedList",
       lambda e, c: e.resources.aggregated_accelerator_types(c.project, c.query)),
    _r("GET", "global/images/{image}", "compute.images.get", "Image",
       lambda e, c: e.resources.image(c.project, c["image"])),
    _r("GET", "global/images/family/{family}", "compute.images.getFromFamily", "Image",
       lambda e, c: e.resources.image(c.project, "", c["family"])),
    _r("GET", "global/networks/{network}", "compute.networks.get", "Network",
       lambda e, c: e.resources.network(c.project, c["network"])),
    # instances
    _r("GET", f"{Z}/instances", "compute.instances.list", "InstanceList",
       lambda e, c: e.instances.list(c.project, c["zone"], c.query)),
    _r("POST", f"{Z}/instances", "compute.instances.insert", "Operation",
       lambda e, c: e.instances.insert(c.project, c["zone"], c.body)),
    _r("GET", "aggregated/instances", "compute.instances.aggregatedList", "InstanceAggregatedList",
       lambda e, c: e.instances.aggregated(c.project, c.query)),
    _r("GET", I, "compute.instances.get", "Instance",
       lambda e, c: e.instances.get(c.project, c["zone"], c["instance"])),
    _r("DELETE", I, "compute.instances.delete", "Operation",
       lambda e, c: e.instances.delete(c.project, c["zone"], c["instance"])),
    _r("POST", f"{I}/setMetadata", "compute.instances.setMetadata", "Operation",
       lambda e, c: e.instances.set_metadata(c.project, c["zone"], c["instance"], c.body)),
    _r("POST", f"{I}/setLabels", "compute.instances.setLabels", "Operation",
       lambda e, c: e.instances.set_labels(c.project, c["zone"], c["instance"], c.body)),
    _r("POST", f"{I}/stop", "compute.instances.stop", "Operation",
       lambda e, c: e.instances.stop(c.project, c["zone"], c["instance"])),
    _r("POST", f"{I}/start", "compute.instances.start", "Operation",
       lambda e, c: e.instances.start(c.project, c["zone"], c["instance"])),
    _r("POST", f"{I}/reset", "compute.instances.reset", "Operation",
       lambda e, c: e.instances.reset(c.project, c["zone"], c["instance"])),
    _r("POST", f"{I}/simulateMaintenanceEvent", "compute.instances.simulateMaintenanceEvent",
       "Operation",
       lambda e, c: e.instances.simulate_maintenance(c.project, c["zone"], c["instance"])),
    _r("GET", f"{I}/getGuestAttributes", "compute.instances.getGuestAttributes", "GuestAttributes",
       lambda e, c: e.instances.guest_attributes(c.project, c["zone"], c["instance"], c.query)),
    _r("GET", f"{I}/serialPort", "compute.instances.getSerialPortOutput", "SerialPortOutput",
       lambda e, c: e.instances.serial_port_output(c.project, c["zone"], c["instance"],
                                                   c.query)),
    # managed instance groups, their instance groups and resize requests
    _r("GET", f"{Z}/instanceGroupManagers", "compute.instanceGroupManagers.list",
       "InstanceGroupManagerList", lambda e, c: e.groups.list(c.project, c["zone"], c.query)),
    _r("POST", f"{Z}/instanceGroupManagers", "compute.instanceGroupManagers.insert", "Operation",
       lambda e, c: e.groups.insert(c.project, c["zone"], c.body)),
    _r("GET", "aggregated/instanceGroupManagers", "compute.instanceGroupManagers.aggregatedList",
       "InstanceGroupManagerAggregatedList", lambda e, c: e.groups.aggregated(c.project, c.query)),
    _r("GET", M, "compute.instanceGroupManagers.get", "InstanceGroupManager",
       lambda e, c: e.groups.get(c.project, c["zone"], c["igm"])),
    _r("DELETE", M, "compute.instanceGroupManagers.delete", "Operation",
       lambda e, c: e.groups.delete(c.project, c["zone"], c["igm"])),
    _r("POST", f"{M}/listManagedInstances", "compute.instanceGroupManagers.listManagedInstances",
       "InstanceGroupManagersListManagedInstancesResponse",
       lambda e, c: {"managedInstances": e.groups.managed_instances(
           e.state.group_key(c.project, c["zone"], c["igm"]))}),
    _r("GET", f"{M}/listErrors", "compute.instanceGroupManagers.listErrors",
       "InstanceGroupManagersListErrorsResponse",
       lambda e, c: e.groups.list_errors(c.project, c["zone"], c["igm"], c.query)),
    _r("POST", f"{M}/resize", "compute.instanceGroupManagers.resize", "Operation",
       lambda e, c: e.groups.resize(c.project, c["zone"], c["igm"], c.query.get("size"))),
    _r("POST", f"{M}/createInstances", "compute.instanceGroupManagers.createInstances", "Operation",
       lambda e, c: e.groups.create_instances(c.project, c["zone"], c["igm"], c.body)),
    _r("POST", f"{M}/recreateInstances", "compute.instanceGroupManagers.recreateInstances",
       "Operation",
       lambda e, c: e.groups.recreate_instances(c.project, c["zone"], c["igm"], c.body)),
    _r("POST", f"{M}/updatePerInstanceConfigs",
       "compute.instanceGroupManagers.updatePerInstanceConfigs", "Operation",
       lambda e, c: e.groups.update_instance_configs(c.project, c["zone"], c["igm"], c.body)),
    _r("POST", f"{M}/listPerInstanceConfigs",
       "compute.instanceGroupManagers.listPerInstanceConfigs",
       "InstanceGroupManagersListPerInstanceConfigsResp",
       lambda e, c: e.groups.list_instance_configs(c.project, c["zone"], c["igm"])),
    _r("GET", f"{M}/resizeRequests", "compute.instanceGroupManagerResizeRequests.list",
       "InstanceGroupManagerResizeRequestsListResponse",
       lambda e, c: e.resize.list(c.project, c["zone"], c["igm"], c.query)),
    _r("POST", f"{M}/resizeRequests", "compute.instanceGroupManagerResizeRequests.insert",
       "Operation", lambda e, c: e.resize.insert(c.project, c["zone"], c["igm"], c.body)),
    _r("GET", f"{M}/resizeRequests/{{request}}", "compute.instanceGroupManagerResizeRequests.get",
       "InstanceGroupManagerResizeRequest",
       lambda e, c: e.resize.get(c.project, c["zone"], c["igm"], c["request"])),
    _r("POST", f"{M}/resizeRequests/{{request}}/cancel",
       "compute.instanceGroupManagerResizeRequests.cancel", "Operation",
       lambda e, c: e.resize.cancel(c.project, c["zone"], c["igm"], c["request"])),
    _r("DELETE", f"{M}/resizeRequests/{{request}}",
       "compute.instanceGroupManagerResizeRequests.delete", "Operation",
       lambda e, c: e.resize.delete(c.project, c["zone"], c["igm"], c["request"])),
    _r("GET", f"{Z}/instanceGroups", "compute.instanceGroups.list", "InstanceGroupList",
       lambda e, c: e.groups.list_instance_groups(c.project, c["zone"], c.query)),
    _r("GET", "aggregated/instanceGroups", "compute.instanceGroups.aggregatedList",
       "InstanceGroupAggregatedList",
       lambda e, c: e.groups.aggregated_instance_groups(c.project, c.query)),
    _r("GET", f"{Z}/instanceGroups/{{group}}", "compute.instanceGroups.get", "InstanceGroup",
       lambda e, c: e.groups.get_instance_group(c.project, c["zone"], c["group"])),
    _r("POST", f"{Z}/instanceGroups/{{group}}/listInstances",
       "compute.instanceGroups.listInstances", "InstanceGroupsListInstances",
       lambda e, c: e.groups.list_group_instances(c.project, c["zone"], c["group"], c.query)),
    _r("GET", f"{Z}/autoscalers", "compute.autoscalers.list", "AutoscalerList",  # none: gcloud asks
       lambda e, c: e.state.list("compute#autoscalerList", [], c.project,
                                 f"zones/{c['zone']}/autoscalers", c.query)),
    _r("GET", "aggregated/autoscalers", "compute.autoscalers.aggregatedList",
       "AutoscalerAggregatedList",
       lambda e, c: e.state.aggregated("compute#autoscalerAggregatedList", "autoscalers", {},
                                       c.project, "autoscalers", c.query)),
    # resource policies, instance templates, reservations
    _r("GET", f"{R}/resourcePolicies", "compute.resourcePolicies.list", "ResourcePolicyList",
       lambda e, c: e.resources.list_policies(c.project, c["region"], c.query)),
    _r("POST", f"{R}/resourcePolicies", "compute.resourcePolicies.insert", "Operation",
       lambda e, c: e.resources.insert_policy(c.project, c["region"], c.body)),
    _r("GET", "aggregated/resourcePolicies", "compute.resourcePolicies.aggregatedList",
       "ResourcePolicyAggregatedList",
       lambda e, c: e.resources.aggregated_policies(c.project, c.query)),
    _r("GET", f"{R}/resourcePolicies/{{policy}}", "compute.resourcePolicies.get", "ResourcePolicy",
       lambda e, c: e.resources.get_policy(c.project, c["region"], c["policy"])),
    _r("DELETE", f"{R}/resourcePolicies/{{policy}}", "compute.resourcePolicies.delete", "Operation",
       lambda e, c: e.resources.delete_policy(c.project, c["region"], c["policy"])),
    _r("GET", "global/instanceTemplates", "compute.instanceTemplates.list", "InstanceTemplateList",
       lambda e, c: e.resources.list_templates(c.project, c.query)),
    _r("POST", "global/instanceTemplates", "compute.instanceTemplates.insert", "Operation",
       lambda e, c: e.resources.insert_template(c.project, c.body)),
    _r("GET", "aggregated/instanceTemplates", "compute.instanceTemplates.aggregatedList",
       "InstanceTemplateAggregatedList",
       lambda e, c: e.resources.aggregated_templates(c.project, c.query)),
    _r("GET", "global/instanceTemplates/{template}", "compute.instanceTemplates.get",
       "InstanceTemplate", lambda e, c: e.resources.get_template(c.project, c["template"])),
    _r("DELETE", "global/instanceTemplates/{template}", "compute.instanceTemplates.delete",
       "Operation", lambda e, c: e.resources.delete_template(c.project, c["template"])),
    _r("GET", f"{Z}/reservations", "compute.reservations.list", "ReservationList",
       lambda e, c: e.resources.list_reservations(c.project, c["zone"], c.query)),
    _r("POST", f"{Z}/reservations", "compute.reservations.insert", "Operation",
       lambda e, c: e.resources.insert_reservation(c.project, c["zone"], c.body)),
    _r("GET", "aggregated/reservations", "compute.reservations.aggregatedList",
       "ReservationAggregatedList",
       lambda e, c: e.resources.aggregated_reservations(c.project, c.query)),
    _r("GET", f"{Z}/reservations/{{reservation}}", "compute.reservations.get", "Reservation",
       lambda e, c: e.resources.get_reservation(c.project, c["zone"], c["reservation"])),
    _r("DELETE", f"{Z}/reservations/{{reservation}}", "compute.reservations.delete", "Operation",
       lambda e, c: e.resources.delete_reservation(c.project, c["zone"], c["reservation"])),
)
COMPUTE_METHODS = tuple(r.name for r in ROUTES)


class ComputeEngineEmulator:
    """The Compute Engine v1 handler of the emulator (state under the store's ``compute``)."""

    def __init__(self, store: SimStore, backing: BackingNodes, guest: GuestEnvironment,
                 oslogin: OsLoginService):
        self.store = store
        self.state = ComputeState(store, backing)
        self.instances = Instances(self.state, guest)
        self.groups = InstanceGroups(self.state, self.instances)
        self.resize = ResizeRequests(self.state, self.groups)
        self.resources = ProjectResources(self.state, oslogin)
        self.served: dict[str, int] = {}  # route name -> requests answered (conformance)

    def end_run(self, node_name: str) -> dict[str, Any]:
        """/sim/v1/<backing node>:endRun: the VMs' maxRunDuration is over now."""
        return self.instances.end_run(node_name)

    def handle(self, method: str, rest: str, query: dict[str, str],
               body: dict[str, Any]) -> dict[str, Any]:
        """One request under ``/compute/v1/`` (``rest``: the path after it)."""
        parts = rest.split("/")
        if len(parts) < 2 or parts[0] != "projects" or not parts[1]:
            raise not_found("", rest)
        for route in ROUTES:
            params = route.match(method, parts[2:])
            if params is None:
                continue
            with self.store.lock:
                self.state.reap()
                self.served[route.name] = self.served.get(route.name, 0) + 1
                return route.answer(self, Call(parts[1], params, query, body))
        if any(r.match(m, parts[2:]) is not None for r in ROUTES
               for m in ("GET", "POST", "DELETE", "PATCH")):
            raise error(405, "methodNotAllowed", f"Method {method} is not allowed on "
                        f"{rest}.")
        raise not_found("", rest)

    # ---------------------------------------------------------------- batches

    def batch(self, body: bytes, content_type: str,
              answer: Callable[[str, str, dict[str, str], Any], tuple[int, dict[str, Any]]]
              ) -> tuple[str, bytes]:
        """``POST /batch/compute/v1``: a multipart/mixed batch of Compute Engine requests
        (what gcloud sends when a command names several resources). Each part is answered by
        ``answer(method, path, query, body)`` (the emulator's own entry, so each part is
        routed, authorized and shaped as on its own); the reply is a multipart/mixed of
        ``application/http`` parts, each ``Content-ID: <response-ID>`` of its request's."""
        if "multipart/mixed" not in content_type or "boundary=" not in content_type:
            raise error(400, "invalid", "A batch request must be multipart/mixed with a "
                        "boundary.")
        parsed = email.parser.BytesParser(policy=email.policy.compat32).parsebytes(
            b"Content-Type: " + content_type.encode() + b"\r\n\r\n" + body)
        parts = parsed.get_payload() if parsed.is_multipart() else []
        if not isinstance(parts, list) or not parts:
            raise error(400, "invalid", "The batch request has no parts.")
        if len(parts) > MAX_BATCH:
            raise error(400, "invalid", f"A batch request may hold at most {MAX_BATCH} "
                        "requests.")
        boundary = f"batch_{secrets.token_hex(12)}"
        out = []
        for part in parts:
            content_id = part.get("Content-ID", "")
            inner = part.get_payload(decode=False)
            if isinstance(inner, list):  # a part whose payload parsed as a message
                inner = inner[0].as_string()
            code, payload = self._one(str(inner), answer)
            reply = json.dumps(payload)
            response_id = f"<response-{content_id.strip('<>')}>" if content_id else ""
            out.append(f"--{boundary}\r\nContent-Type: application/http\r\n"
                       + (f"Content-ID: {response_id}\r\n" if response_id else "")
                       + f"\r\nHTTP/1.1 {code} {_reason(code)}\r\n"
                       "Content-Type: application/json; charset=UTF-8\r\n"
                       f"Content-Length: {len(reply.encode())}\r\n\r\n{reply}\r\n")
        text = "".join(out) + f"--{boundary}--\r\n"
        return f"multipart/mixed; boundary={boundary}", text.encode()

    @staticmethod
    def _one(text: str, answer: Callable[..., tuple[int, dict[str, Any]]]
             ) -> tuple[int, dict[str, Any]]:
        """One part of a batch: ``METHOD /compute/v1/PATH?QUERY HTTP/1.1``, headers, body."""
        request_line, _, rest = text.lstrip("\r\n").partition("\n")
        words = request_line.split()
        if len(words) < 2:
            failure = error(400, "invalid", "A batch part is not an HTTP request.")
            return failure.http_code, failure.body()
        method, target = words[0].upper(), words[1]
        _, _, payload = rest.replace("\r\n", "\n").partition("\n\n")
        split = urlsplit(target)
        query = {k: v[-1] for k, v in parse_qs(split.query, keep_blank_values=True).items()}
        try:
            body = json.loads(payload) if payload.strip() else None
        except ValueError:
            failure = error(400, "parseError", "A batch part's body is not valid JSON.")
            return failure.http_code, failure.body()
        return answer(method, unquote(split.path), query, body)

    def methods_served(self) -> dict[str, int]:
        with self.store.lock:
            return copy(self.served)


def _reason(code: int) -> str:
    from http import HTTPStatus

    try:
        return HTTPStatus(code).phrase
    except ValueError:
        return "Unknown"
