"""Pure pieces of the Cloud TPU API emulator: names, enums, errors, shapes (no I/O)."""

from __future__ import annotations

import base64
import json
import re
import secrets
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from tpufab.errors import ConfigError
from tpufab.sim._slots import WORKERS_PER_SLOT
from tpufab.topology import (
    Topology,
    all_accelerator_types,
    check_topology,
    parse_accelerator_type,
)

DEFAULT_PROJECT = "sim-project"
DEFAULT_ZONE = "us-central2-b"
LOCATIONS = (
    "us-central1-a", "us-central1-b", "us-central1-c", "us-central1-f", "us-central2-b",
    "us-east1-c", "us-east1-d", "us-east5-a", "us-east5-b", "us-south1-a", "us-west1-c",
    "us-west4-a", "europe-west4-a", "europe-west4-b", "asia-east1-c", "asia-northeast1-b",
)
RUNTIME_VERSIONS = (
    "tpu-ubuntu2204-base", "tpu-vm-base", "tpu-vm-tf-2.16.1-pjrt", "tpu-vm-tf-2.17.0-pjrt",
    "tpu-vm-pt-2.0", "tpu-vm-v4-base", "tpu-vm-v4-pt-2.0", "v2-alpha", "v2-alpha-tpuv5",
    "v2-alpha-tpuv5-lite", "v2-alpha-tpuv6e",
)
ID_RE = re.compile(r"^[a-z]([-a-z0-9]{0,61}[a-z0-9])?$")

# Enums: the Python client sends integers (`enum-encoding=int`), gcloud sends names.
ENUMS: dict[str, dict[int, str]] = {
    "node.state": {0: "STATE_UNSPECIFIED", 1: "CREATING", 2: "READY", 3: "RESTARTING",
                   4: "REIMAGING", 5: "DELETING", 6: "REPAIRING", 8: "STOPPED", 9: "STOPPING",
                   10: "STARTING", 11: "PREEMPTED", 12: "TERMINATED", 13: "HIDING",
                   14: "HIDDEN", 15: "UNHIDING", 16: "UNKNOWN"},
    "node.health": {0: "HEALTH_UNSPECIFIED", 1: "HEALTHY", 3: "TIMEOUT",
                    4: "UNHEALTHY_TENSORFLOW", 5: "UNHEALTHY_MAINTENANCE"},
    "node.apiVersion": {0: "API_VERSION_UNSPECIFIED", 1: "V1_ALPHA1", 2: "V1", 3: "V2_ALPHA1",
                        4: "V2"},
    "disk.mode": {0: "DISK_MODE_UNSPECIFIED", 1: "READ_WRITE", 2: "READ_ONLY"},
    "accelerator.type": {0: "TYPE_UNSPECIFIED", 2: "V2", 4: "V3", 7: "V4", 9: "V5LITE_POD",
                         10: "V5P", 11: "V6E"},
}
GENERATION_OF_CONFIG_TYPE = {"V2": "v2", "V3": "v3", "V4": "v4", "V5LITE_POD": "v5litepod",
                             "V5P": "v5p", "V6E": "v6e"}
CONFIG_TYPE_OF_GENERATION = {v: k for k, v in GENERATION_OF_CONFIG_TYPE.items()}

# HTTP status and gRPC code of each canonical error status.
STATUS_CODES: dict[str, tuple[int, int]] = {
    "INVALID_ARGUMENT": (400, 3),
    "UNAUTHENTICATED": (401, 16),
    "PERMISSION_DENIED": (403, 7),
    "FAILED_PRECONDITION": (400, 9),
    "NOT_FOUND": (404, 5),
    "ALREADY_EXISTS": (409, 6),
    "ABORTED": (409, 10),
    "RESOURCE_EXHAUSTED": (429, 8),
    "INTERNAL": (500, 13),
    "UNIMPLEMENTED": (501, 12),
    "UNAVAILABLE": (503, 14),
}

# PCI device id of one chip per generation (vendor 0x1ae0, Google), as JAX and libtpu read them
# from /sys/bus/pci/devices to decide that they run on a TPU VM.
TPU_PCI_VENDOR = "0x1ae0"
TPU_PCI_DEVICE = {"v2": "0x0027", "v3": "0x0027", "v4": "0x005e", "v5p": "0x0062",
                  "v5litepod": "0x0063", "v6e": "0x006f",
                  "tpu7x": "0x0076"}  # JAX's jax/_src/hardware_utils.py (0.10) knows it so

MAP_FIELDS = frozenset({"metadata", "labels"})
UPDATABLE_FIELDS = {
    "description": "description",
    "metadata": "metadata",
    "labels": "labels",
    "tags": "tags",
    "data_disks": "dataDisks",
    "datadisks": "dataDisks",
    "network_config.enable_external_ips": "networkConfig.enableExternalIps",
    "networkconfig.enableexternalips": "networkConfig.enableExternalIps",
    "scheduling_config": "schedulingConfig",
    "schedulingconfig": "schedulingConfig",
    "shielded_instance_config": "shieldedInstanceConfig",
    "shieldedinstanceconfig": "shieldedInstanceConfig",
}


class ApiFailure(Exception):
    """An API error, answered as `{"error": {"code", "message", "status"}}`."""

    def __init__(self, status: str, message: str):
        super().__init__(message)
        self.status = status
        self.message = message

    @property
    def http_code(self) -> int:
        return STATUS_CODES[self.status][0]

    @property
    def grpc_code(self) -> int:
        return STATUS_CODES[self.status][1]

    def body(self) -> dict[str, Any]:
        return {"error": {"code": self.http_code, "message": self.message,
                          "status": self.status}}


def not_found(name: str) -> ApiFailure:
    return ApiFailure("NOT_FOUND", f"Resource '{name}' was not found")


def rfc3339(ts: float | None = None) -> str:
    moment = datetime.fromtimestamp(time.time() if ts is None else ts, tz=timezone.utc)
    return moment.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def snake_to_camel(key: str) -> str:
    head, *rest = key.split("_")
    return head + "".join(part[:1].upper() + part[1:] for part in rest)


def camel_keys(value: Any) -> Any:
    """Accept snake_case field names too; map fields keep their keys as given."""
    if isinstance(value, list):
        return [camel_keys(v) for v in value]
    if not isinstance(value, dict):
        return value
    out = {}
    for key, item in value.items():
        name = snake_to_camel(key) if "_" in key and not key.startswith("@") else key
        out[name] = item if name in MAP_FIELDS else camel_keys(item)
    return out


def enum_name(kind: str, value: Any) -> Any:
    """Integer or name -> name; an unknown integer becomes the UNSPECIFIED name."""
    table = ENUMS[kind]
    if isinstance(value, bool):
        return value
    if isinstance(value, int):
        return table.get(value, table[0])
    if isinstance(value, str) and value.isdigit():
        return table.get(int(value), table[0])
    return value


def normalize_node_input(node: dict[str, Any]) -> dict[str, Any]:
    """A request Node in camelCase with enum names."""
    node = camel_keys(node or {})
    for disk in node.get("dataDisks") or []:
        if "mode" in disk:
            disk["mode"] = enum_name("disk.mode", disk["mode"])
    config = node.get("acceleratorConfig")
    if isinstance(config, dict) and "type" in config:
        config["type"] = enum_name("accelerator.type", config["type"])
    return node


def check_id(kind: str, value: str | None) -> str:
    if not value:
        raise ApiFailure("INVALID_ARGUMENT", f"The {kind} id is required.")
    if not ID_RE.match(value):
        raise ApiFailure(
            "INVALID_ARGUMENT",
            f'Invalid {kind} id "{value}": it must be 1-63 characters of lowercase letters, '
            "digits and hyphens, start with a letter and not end with a hyphen "
            "(regular expression [a-z]([-a-z0-9]*[a-z0-9])?).",
        )
    return value


def topology_string(topo: Topology) -> str | None:
    """The chip topology of a type, e.g. v4-32 -> "2x2x4", v6e-8 -> "2x4"."""
    three_d = topo.generation in ("v4", "v5p")
    dims = [2, 2, 1] if three_d else [1, 1]
    if three_d and topo.chips < 4:
        return None
    while _product(dims) < topo.chips:
        smallest = min(dims)
        index = max(i for i, d in enumerate(dims) if d == smallest)
        dims[index] *= 2
    if _product(dims) != topo.chips:
        return None
    return "x".join(str(d) for d in dims)


def _product(dims: list[int]) -> int:
    out = 1
    for d in dims:
        out *= d
    return out


def accelerator_type_of(node: dict[str, Any], zone: str) -> Topology:
    """The topology a create request asks for (acceleratorType or acceleratorConfig)."""
    given = node.get("acceleratorType")
    config = node.get("acceleratorConfig")
    if not given and isinstance(config, dict) and config.get("type"):
        given = _type_from_config(config)
    if not given:
        raise ApiFailure("INVALID_ARGUMENT",
                         "Either acceleratorType or acceleratorConfig is required.")
    try:
        topo = parse_accelerator_type(given)
    except ConfigError:
        raise ApiFailure(
            "INVALID_ARGUMENT",
            f'Accelerator type "{given}" is not available in zone {zone}; '
            "list the valid types with acceleratorTypes.list.",
        ) from None
    if topo.name != given:
        raise ApiFailure("INVALID_ARGUMENT",
                         f'Invalid accelerator type "{given}"; the API spells it "{topo.name}".')
    if "tpu" not in topo.planes:  # TPU7x and later: Compute Engine only
        raise ApiFailure("INVALID_ARGUMENT",
                         f'Accelerator type "{given}" is not available in zone {zone}; '
                         "list the valid types with acceleratorTypes.list.")
    return topo


def _type_from_config(config: dict[str, Any]) -> str:
    generation = GENERATION_OF_CONFIG_TYPE.get(str(config.get("type")))
    topology = str(config.get("topology") or "")
    if generation is None or not re.fullmatch(r"\d+(x\d+)*", topology):
        raise ApiFailure(
            "INVALID_ARGUMENT",
            f"Invalid acceleratorConfig {{type: {config.get('type')}, topology: {topology}}}.",
        )
    dims = tuple(int(d) for d in topology.split("x"))
    cores_per_chip = 2 if generation in ("v2", "v3", "v4", "v5p") else 1
    name = f"{generation}-{_product(list(dims)) * cores_per_chip}"
    try:
        check_topology(parse_accelerator_type(name), dims)
    except ConfigError as err:
        raise ApiFailure("INVALID_ARGUMENT",
                         f"Invalid acceleratorConfig {{type: {config.get('type')}, topology: "
                         f"{topology}}}: {err}") from None
    return name


def accelerator_type_resource(parent: str, name: str) -> dict[str, Any]:
    topo = parse_accelerator_type(name)
    out: dict[str, Any] = {"name": f"{parent}/acceleratorTypes/{name}", "type": name}
    topology = topology_string(topo)
    if topology:
        out["acceleratorConfigs"] = [
            {"type": CONFIG_TYPE_OF_GENERATION[topo.generation], "topology": topology}]
    return out


def accelerator_types() -> list[str]:
    return all_accelerator_types("tpu")


def worker_address(slot: int, worker: int) -> str:
    """Worker ``worker`` of the node whose first slot is ``slot``: 254 workers per slot, then
    the next slot (a node of more than 254 hosts holds consecutive slots, see _slots)."""
    slot += worker // WORKERS_PER_SLOT
    return f"127.{16 + slot // 256}.{slot % 256}.{worker % WORKERS_PER_SLOT + 1}"


def worker_hostname(node_id: str, worker: int) -> str:
    return f"t1v-n-{int(node_id):016x}"[:14] + f"-w-{worker}"


def new_node_id() -> str:
    return str(10**18 + secrets.randbelow(2**63 - 10**18))


def new_operation_id() -> str:
    return f"operation-{int(time.time() * 1000)}-{secrets.token_hex(7)}-{secrets.token_hex(4)}"


def stockout_message(zone: str) -> str:
    return (f'There is no more capacity in the zone "{zone}"; you can try in another zone '
            "where Cloud TPU Nodes are offered (see https://cloud.google.com/tpu/docs/regions) "
            f"[EID: 0x{secrets.token_hex(8)}]")


def quota_message(topo: Topology, zone: str, limit: int) -> str:
    metric = {
        "v2": "TPUV2sPerProjectPerZoneForTPUAPI",
        "v3": "TPUV3sPerProjectPerZoneForTPUAPI",
        "v4": "TPUV4sPodPerProjectPerZoneForTPUAPI",
        "v5litepod": "TPUV5sLitepodPerProjectPerZoneForTPUAPI",
        "v5p": "TPUV5sPerProjectPerZoneForTPUAPI",
        "v6e": "TPUV6EPerProjectPerZoneForTPUAPI",
    }.get(topo.generation, f"TPU{topo.generation.upper()}PerProjectPerZone")
    return f"Quota limit '{metric}' has been exceeded. Limit: {limit} in zone {zone}."


def fake_host_key(seed: str) -> str:
    """A well-formed ssh-ed25519 public key line (for API-only emulation)."""
    import hashlib

    def field(data: bytes) -> bytes:
        return len(data).to_bytes(4, "big") + data

    blob = field(b"ssh-ed25519") + field(hashlib.sha256(seed.encode()).digest())
    return "ssh-ed25519 " + base64.b64encode(blob).decode()


@dataclass(frozen=True)
class NodeName:
    project: str
    zone: str
    node: str

    @property
    def parent(self) -> str:
        return f"projects/{self.project}/locations/{self.zone}"

    @property
    def full(self) -> str:
        return f"{self.parent}/nodes/{self.node}"


def split_name(name: str) -> tuple[str, str, str, str]:
    """`projects/p/locations/z/KIND/id` -> (p, z, KIND, id)."""
    parts = name.split("/")
    if len(parts) != 6 or parts[0] != "projects" or parts[2] != "locations":
        raise ApiFailure("INVALID_ARGUMENT", f"Malformed resource name '{name}'.")
    return parts[1], parts[3], parts[4], parts[5]


def page(items: list[Any], query: dict[str, str]) -> tuple[list[Any], str]:
    """A page of a list and the next page token ("" at the end)."""
    try:
        start = int(query.get("pageToken") or 0)
        size = int(query.get("pageSize") or 0)
    except ValueError:
        raise ApiFailure("INVALID_ARGUMENT", "Invalid pageToken or pageSize.") from None
    if size <= 0:
        size = 1000
    chunk = items[start:start + size]
    return chunk, str(start + size) if start + size < len(items) else ""


# What API v2 knows of a node and a queued resource (google-cloud-tpu's tpu_v2 messages):
# through /v2/ the emulator shows only these, as the real API does, so a resource a v2alpha1
# client (gcloud alpha) made, with fields of its own, still parses in a v2 client.
V2_FIELDS = {
    "Node": frozenset({
        "acceleratorConfig", "acceleratorType", "apiVersion", "cidrBlock", "createTime",
        "dataDisks", "description", "health", "healthDescription", "id", "labels", "metadata",
        "multisliceNode", "name", "networkConfig", "networkConfigs", "networkEndpoints",
        "queuedResource", "runtimeVersion", "schedulingConfig", "serviceAccount",
        "shieldedInstanceConfig", "state", "symptoms", "tags"}),
    "QueuedResource": frozenset({"createTime", "guaranteed", "name", "queueingPolicy",
                                 "reservationName", "spot", "state", "tpu"}),
}
V2_SCHEDULING = frozenset({"preemptible", "reserved", "spot"})


def version_view(resource: dict[str, Any], kind: str, version: str) -> dict[str, Any]:
    """``resource`` (a Node or QueuedResource record) as API ``version`` shows it: through
    v2 only v2's fields, through v2alpha1 its enum values and field names (a v2 node's
    ``apiVersion: V2`` is not in v2alpha1's enum; a multislice node spec is
    ``multisliceParams`` in v2 and ``multiNodeParams`` in v2alpha1)."""
    if kind == "QueuedResource" and version in ("v2", "v2alpha1"):
        resource = _queued_view(resource, version)
    if kind == "Node" and version == "v2alpha1" and resource.get("apiVersion") == "V2":
        resource = {**resource, "apiVersion": "V2_ALPHA1"}
    if version != "v2" or kind not in V2_FIELDS:
        return resource
    view = {k: v for k, v in resource.items() if k in V2_FIELDS[kind]}
    if isinstance(view.get("schedulingConfig"), dict):
        view["schedulingConfig"] = {k: v for k, v in view["schedulingConfig"].items()
                                    if k in V2_SCHEDULING}
    return view


MULTISLICE_FIELD = {"v2": "multisliceParams", "v2alpha1": "multiNodeParams"}


def _queued_view(resource: dict[str, Any], version: str) -> dict[str, Any]:
    tpu = resource.get("tpu")
    if not isinstance(tpu, dict) or not isinstance(tpu.get("nodeSpec"), list):
        return resource
    wanted = MULTISLICE_FIELD[version]
    specs = []
    for spec in tpu["nodeSpec"]:
        spec = dict(spec) if isinstance(spec, dict) else spec
        if isinstance(spec, dict):
            params = spec.pop("multisliceParams", None) or spec.pop("multiNodeParams", None)
            if params is not None:
                spec[wanted] = params
            if isinstance(spec.get("node"), dict):
                spec["node"] = version_view(spec["node"], "Node", version)
        specs.append(spec)
    return {**resource, "tpu": {**tpu, "nodeSpec": specs}}


V1_NODE_IN_V2 = ("name", "acceleratorType", "state", "health", "createTime",
                 "networkEndpoints", "cidrBlock", "schedulingConfig", "description", "labels",
                 "apiVersion")


def v1_node_in_v2(node: dict[str, Any]) -> dict[str, Any]:
    """A legacy (API v1) node as API v2 and v2alpha1 show it: its runtime is its TensorFlow
    version, its network a networkConfig; fields only v1 has are left out."""
    view = {k: v for k, v in node.items() if k in V1_NODE_IN_V2}
    if "tensorflowVersion" in node:
        view["runtimeVersion"] = node["tensorflowVersion"]
    if "network" in node:
        view["networkConfig"] = {"network": node["network"]}
    return view


TPU_TYPE = re.compile(r"\.tpu\.v(?:1|2|2alpha1)\.")


def operation_view(op: dict[str, Any], version: str) -> dict[str, Any]:
    """An operation as API ``version`` shows it: its types in that version (an operation the
    v1 or v2alpha1 API started, listed through v2, says ``google.cloud.tpu.v2....``: a v2
    client has no other types), its response resource as that version knows it."""
    op = json.loads(json.dumps(op))
    for part in ("metadata", "response"):
        value = op.get(part)
        if isinstance(value, dict) and isinstance(value.get("@type"), str):
            type_url = TPU_TYPE.sub(f".tpu.{version}.", value["@type"])
            kind = type_url.rsplit(".", 1)[-1]
            rest = {k: v for k, v in value.items() if k != "@type"}
            if part == "response":
                if ".tpu.v1." in value["@type"] and version != "v1" and kind == "Node":
                    rest = v1_node_in_v2(rest)
                rest = version_view(rest, kind, version)
            op[part] = {"@type": type_url, **rest}
    return op
