"""Checks of the simulated pod's answers against Google's schemas, shared by
tests/test_sim_conformance.py (a sweep of every served method) and tests/conftest.py (a
sample of what the scenario tests saw, recorded by the emulator: TPUFAB_SIM_RECORD)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tpufab.sim.compute_engine import ROUTES

# What real resources always carry (beside what their protos allow): checked on every answer
# of that message type.
ALWAYS = {
    "Instance": ("kind", "id", "name", "creationTimestamp", "zone", "machineType", "status",
                 "selfLink", "networkInterfaces", "disks", "metadata", "scheduling",
                 "fingerprint", "labelFingerprint", "cpuPlatform"),
    "Operation": ("kind", "id", "name", "operationType", "targetLink", "status", "progress",
                  "insertTime", "startTime", "selfLink", "user"),
    "Zone": ("kind", "id", "creationTimestamp", "name", "description", "status", "region",
             "selfLink"),
    "Region": ("kind", "id", "creationTimestamp", "name", "description", "status", "zones",
               "selfLink"),
    "Project": ("kind", "id", "name", "creationTimestamp", "selfLink", "commonInstanceMetadata",
                "defaultServiceAccount"),
    "Image": ("kind", "id", "creationTimestamp", "name", "selfLink", "status"),
    "Network": ("kind", "id", "creationTimestamp", "name", "selfLink"),
    "MachineType": ("kind", "id", "creationTimestamp", "name", "description", "guestCpus",
                    "memoryMb", "zone", "selfLink"),
    "AcceleratorType": ("kind", "id", "creationTimestamp", "name", "description", "zone",
                        "selfLink", "maximumCardsPerInstance"),
    "InstanceGroupManager": ("kind", "id", "name", "creationTimestamp", "zone",
                             "instanceTemplate", "baseInstanceName", "targetSize", "selfLink",
                             "instanceGroup", "fingerprint", "currentActions", "status"),
    "InstanceGroup": ("kind", "id", "name", "creationTimestamp", "zone", "fingerprint",
                      "selfLink", "size", "network"),
    "InstanceTemplate": ("kind", "id", "name", "creationTimestamp", "properties", "selfLink"),
    "ResourcePolicy": ("kind", "id", "name", "creationTimestamp", "region", "selfLink",
                       "status"),
    "Reservation": ("kind", "id", "name", "creationTimestamp", "zone", "selfLink", "status"),
    "InstanceGroupManagerResizeRequest": ("kind", "id", "name", "creationTimestamp",
                                          "resizeBy", "state", "zone", "selfLink"),
    "SerialPortOutput": ("kind", "contents", "start", "next", "selfLink"),
    "GuestAttributes": ("kind", "queryPath", "queryValue", "selfLink"),
    "tpu.Node": ("name", "id", "acceleratorType", "state", "createTime", "runtimeVersion",
                 "apiVersion"),
    "tpu-v1.Node": ("name", "acceleratorType", "state", "createTime", "tensorflowVersion",
                    "apiVersion"),
    "tpu.QueuedResource": ("name", "createTime", "state", "tpu"),
    "tpu.Operation": ("name", "metadata", "done"),
    "tpu.AcceleratorType": ("name", "type", "acceleratorConfigs"),
}
LIST_FIELDS = ("kind", "id", "selfLink")  # every ...List and ...AggregatedList
COMPUTE_DELETES = {"ComputeZoneOperationsDeleteResponse", "ComputeRegionOperationsDeleteResponse",
                   "ComputeGlobalOperationsDeleteResponse"}
# the official client's proto for a message gcloud's discovery names otherwise
PROTO_NAMES = {"ComputeZoneOperationsDeleteResponse": "DeleteZoneOperationResponse",
               "ComputeRegionOperationsDeleteResponse": "DeleteRegionOperationResponse",
               "ComputeGlobalOperationsDeleteResponse": "DeleteGlobalOperationResponse",
               "InstanceGroupManagersListPerInstanceConfigsResp":
                   "InstanceGroupManagersListPerInstanceConfigsResp"}
# (method, collection, verb, path parts after projects/P/locations) -> TPU API message
TPU_TYPES = {
    ("GET", "", None, 0): "location.ListLocationsResponse",
    ("GET", "", None, 1): "location.Location",
    ("POST", "", "generateServiceIdentity", 1): "GenerateServiceIdentityResponse",
    ("GET", "nodes", None, 2): "ListNodesResponse", ("POST", "nodes", None, 2): "Operation",
    ("GET", "nodes", None, 3): "Node", ("DELETE", "nodes", None, 3): "Operation",
    ("PATCH", "nodes", None, 3): "Operation", ("POST", "nodes", "stop", 3): "Operation",
    ("POST", "nodes", "start", 3): "Operation",
    ("POST", "nodes", "getGuestAttributes", 3): "GetGuestAttributesResponse",
    ("POST", "nodes", "simulateMaintenanceEvent", 3): "Operation",
    ("POST", "nodes", "performMaintenance", 3): "Operation",
    ("GET", "acceleratorTypes", None, 2): "ListAcceleratorTypesResponse",
    ("GET", "acceleratorTypes", None, 3): "AcceleratorType",
    ("GET", "runtimeVersions", None, 2): "ListRuntimeVersionsResponse",
    ("GET", "runtimeVersions", None, 3): "RuntimeVersion",
    ("GET", "queuedResources", None, 2): "ListQueuedResourcesResponse",
    ("POST", "queuedResources", None, 2): "Operation",
    ("GET", "queuedResources", None, 3): "QueuedResource",
    ("DELETE", "queuedResources", None, 3): "Operation",
    ("POST", "queuedResources", "reset", 3): "Operation",
    ("POST", "queuedResources", "performMaintenanceQueuedResource", 3): "Operation",
    ("GET", "operations", None, 2): "ListOperationsResponse",
    ("GET", "operations", None, 3): "Operation", ("DELETE", "operations", None, 3): "Empty",
    ("POST", "operations", "cancel", 3): "Empty",
}
OSLOGIN_TYPES = {("GET", "loginProfile"): "LoginProfile",
                 ("POST", "importSshPublicKey"): "ImportSshPublicKeyResponse",
                 ("GET", "sshPublicKeys"): "common.SshPublicKey",
                 ("PATCH", "sshPublicKeys"): "common.SshPublicKey",
                 ("DELETE", "sshPublicKeys"): "Empty", ("DELETE", "projects"): "Empty"}


@dataclass
class Answer:
    api: str  # compute, tpu-v2, tpu-v2alpha1, tpu-v1, oslogin
    method: str
    path: str
    code: int
    body: Any
    message: str  # the message the API answers with ("Empty" for none)


def api_and_message(method: str, path: str) -> tuple[str, str]:
    """Which API answers ``path`` and with which message (what the schemas are keyed by)."""
    if path.startswith("/compute/v1/"):
        parts = path.split("?")[0].split("/")[5:]
        for route in ROUTES:
            if route.match(method, parts) is not None:
                return "compute", route.returns
        return "compute", "?"
    if path.startswith("/v1/users/"):
        head = path[len("/v1/users/"):]
        verb = head.split(":")[1] if ":" in head else ""
        parts = head.split(":")[0].split("/")
        return "oslogin", OSLOGIN_TYPES.get((method, verb or (parts[1] if len(parts) > 1
                                                              else "")), "?")
    version, rest = path[1:].split("/", 1)
    parts = rest.split("/")
    verb = None
    if ":" in parts[-1]:
        parts[-1], verb = parts[-1].split(":", 1)
    depth = len(parts) - 3  # after projects/P/locations
    collection = parts[4] if len(parts) > 4 else ""
    if version == "v1" and collection in ("nodes", "operations"):
        return "tpu-v1", TPU_TYPES.get((method, collection, verb, depth), "?")
    return f"tpu-{version}", TPU_TYPES.get((method, collection, verb, depth), "?")


def proto_class(api: str, name: str):
    """The official client's protobuf class for an API's message name (None: none)."""
    from google.cloud import compute_v1, oslogin_v1, tpu_v1, tpu_v2, tpu_v2alpha1
    from google.cloud.location import locations_pb2
    from google.longrunning import operations_pb2
    from google.protobuf import empty_pb2

    if name == "Empty" or name in COMPUTE_DELETES and not hasattr(
            compute_v1, PROTO_NAMES.get(name, "")):
        return empty_pb2.Empty
    if api == "compute":
        return getattr(compute_v1, PROTO_NAMES.get(name, name)).pb()
    if name == "Operation":
        return operations_pb2.Operation
    if name == "ListOperationsResponse":
        return operations_pb2.ListOperationsResponse
    if name.startswith("location."):
        return getattr(locations_pb2, name.split(".", 1)[1])
    if api == "oslogin":
        module = oslogin_v1 if not name.startswith("common.") else oslogin_v1.common
        return getattr(module, name.split(".")[-1]).pb()
    module = {"tpu-v2": tpu_v2, "tpu-v2alpha1": tpu_v2alpha1, "tpu-v1": tpu_v1}[api]
    return getattr(module, name).pb()


def int64_strings(message_class, value: Any, path: str = "") -> list[str]:
    """Where ``value`` (JSON) writes a 64-bit integer field as a number, not a string."""
    from google.protobuf.descriptor import FieldDescriptor as F

    wide = {F.TYPE_INT64, F.TYPE_UINT64, F.TYPE_FIXED64, F.TYPE_SINT64, F.TYPE_SFIXED64}
    out: list[str] = []
    if not isinstance(value, dict):
        return out
    descriptor = message_class.DESCRIPTOR
    by_json = {f.json_name: f for f in descriptor.fields} | {f.name: f for f in descriptor.fields}
    for key, item in value.items():
        f = by_json.get(key)
        if f is None:
            continue
        items = item if f.is_repeated and isinstance(item, list) else [item]
        if f.message_type is not None and f.message_type.GetOptions().map_entry:
            entry = f.message_type.fields_by_name["value"]
            items = list(item.values()) if isinstance(item, dict) else []
            if entry.message_type is not None:
                sub = message_class_of(entry.message_type)
                for element in items:
                    out += int64_strings(sub, element, f"{path}{key}.*.")
            elif entry.type in wide:
                out += [f"{path}{key}.*" for e in items if not isinstance(e, str)]
            continue
        for element in items:
            if f.type in wide and not isinstance(element, str):
                out.append(f"{path}{key}")
            elif f.message_type is not None and f.message_type.full_name not in (
                    "google.protobuf.Any", "google.protobuf.Struct", "google.protobuf.Value"):
                out += int64_strings(message_class_of(f.message_type), element,
                                     f"{path}{key}.")
    return out


def message_class_of(descriptor):
    from google.protobuf import message_factory

    return message_factory.GetMessageClass(descriptor)


def error_problem(api: str, code: int, body: Any) -> str | None:
    """What is wrong with an error answer's shape for its API (None: nothing)."""
    error = body.get("error") if isinstance(body, dict) else None
    if not isinstance(error, dict) or set(body) != {"error"}:
        return "not {error: {...}}"
    if error.get("code") != code or not isinstance(error.get("message"), str):
        return f"error.code {error.get('code')} is not the HTTP status {code}, or no message"
    if api == "compute":
        errors = error.get("errors")
        if set(error) != {"code", "message", "errors"} or not isinstance(errors, list) or \
                not errors or not all(isinstance(e, dict) and {"domain", "reason", "message"}
                                      <= set(e) for e in errors):
            return "not Compute Engine's {code, message, errors: [{domain, reason, message}]}"
        return None
    if set(error) != {"code", "message", "status"} or not isinstance(error["status"], str):
        return "not {code, message, status}"
    return None


def missing_fields(api: str, message: str, body: Any) -> list[str]:
    key = message if api == "compute" else f"{api}.{message}" if f"{api}.{message}" in \
        ALWAYS else f"tpu.{message}"
    wanted = list(ALWAYS.get(key, ()))
    if api == "compute" and (message.endswith("List") or message.endswith("AggregatedList")):
        wanted = list(LIST_FIELDS)
    if api == "compute" and message == "Operation" and isinstance(body, dict):
        wanted += ["endTime"] if body.get("status") == "DONE" else []
        if "/global/" not in str(body.get("selfLink")):
            wanted += ["zone"] if "/zones/" in str(body.get("selfLink")) else ["region"]
    if api.startswith("tpu") and message == "Operation" and isinstance(body, dict):
        meta = body.get("metadata") or {}
        missing = [f"metadata.{k}" for k in ("@type", "createTime", "target", "verb")
                   if k not in meta]
        if body.get("done") and "response" not in body and "error" not in body:
            missing.append("response|error")
        return [k for k in wanted if k not in body] + missing
    return [k for k in wanted if not isinstance(body, dict) or k not in body]


def violations(answers: list[Answer]) -> tuple[list[str], int, int]:
    """(violations, answers checked, fields checked) of the proto, int64, field and error
    checks."""
    from google.protobuf import json_format

    found, fields = [], 0
    for a in answers:
        where = f"{a.api} {a.method} {a.path} -> {a.code}"
        if a.code >= 400:
            problem = error_problem(a.api, a.code, a.body)
            if problem:
                found.append(f"{where}: error body {problem}: {a.body}")
            continue
        if a.message == "?":
            found.append(f"{where}: no schema known for this method")
            continue
        cls = proto_class(a.api, a.message)
        try:
            json_format.Parse(json.dumps(a.body), cls(), ignore_unknown_fields=False)
        except json_format.ParseError as err:
            found.append(f"{where}: {a.message}: {err}")
            continue
        fields += count_fields(a.body)
        found += [f"{where}: {a.message}.{p} is a 64-bit integer written as a number"
                  for p in int64_strings(cls, a.body)]
        found += [f"{where}: {a.message} without {k}" for k in
                  missing_fields(a.api, a.message, a.body)]
        if a.api == "compute" and isinstance(a.body, dict) and "items" in a.body and \
                isinstance(a.body["items"], list):
            item_type = a.message.removesuffix("List")
            for item in a.body["items"]:
                found += [f"{where}: item {item_type} without {k}"
                          for k in missing_fields("compute", item_type, item)]
    return found, len(answers), fields


def count_fields(value: Any) -> int:
    if isinstance(value, dict):
        return len(value) + sum(count_fields(v) for v in value.values())
    if isinstance(value, list):
        return sum(count_fields(v) for v in value)
    return 0




def recorded(path: Path) -> list[Answer]:
    """The answers an emulator recorded (AnswerRecorder), as Answers."""
    out = []
    for line in path.read_text().splitlines() if path.exists() else []:
        entry = json.loads(line)
        api, message = api_and_message(entry["method"], entry["path"])
        out.append(Answer(api, entry["method"], entry["path"], entry["code"], entry["body"],
                          message))
    return out
