"""Pure pieces of the Compute Engine emulator (compute_*.py): its errors, machine types, names
and the small conversions every resource handler shares (no state, no I/O)."""

from __future__ import annotations

import base64
import secrets
from typing import Any

from tpufab.errors import ConfigError
from tpufab.sim._model import ID_RE, ApiFailure
from tpufab.topology import GENERATIONS, Topology, check_topology, parse_accelerator_type

# Compute Engine machine type -> (generation, chips per VM), from tpufab.topology.
MACHINE_TYPES: dict[str, tuple[str, int]] = {
    machine: (gen.name, chips) for gen in GENERATIONS.values()
    for chips, machine in gen.machine_types
}
# General-purpose machine types (no TPU): (vCPUs, memory MiB, shared core), Compute Engine's
# published shapes. Their VMs are simulated VMs with sshd, a metadata server and a service
# account, and no TPU (docs/simulated-pod.md, "General-purpose VMs").
GENERAL_MACHINE_TYPES: dict[str, tuple[int, int, bool]] = {
    "e2-micro": (2, 1024, True), "e2-small": (2, 2048, True), "e2-medium": (2, 4096, True),
    "e2-standard-2": (2, 8192, False), "e2-standard-4": (4, 16384, False),
    "n2-standard-2": (2, 8192, False), "n2-standard-4": (4, 16384, False),
}
# Made-up but plausible host sizes (vCPUs, memory MiB) per chips on the VM.
HOST_SIZE = {1: (44, 180 * 1024), 4: (224, 960 * 1024), 8: (180, 1440 * 1024)}

INSTANCE_STATUS = {  # backing node state -> instance status
    "CREATING": "STAGING", "STARTING": "STAGING", "RESTARTING": "STAGING", "READY": "RUNNING",
    "STOPPING": "STOPPING", "STOPPED": "TERMINATED", "PREEMPTED": "TERMINATED",
    "DELETING": "STOPPING", "UNKNOWN": "RUNNING", "TERMINATED": "TERMINATED",
}
PROVISIONING_MODELS = ("STANDARD", "SPOT", "FLEX_START", "RESERVATION_BOUND")
RESERVATION_KEY = "compute.googleapis.com/reservation-name"


class ComputeFailure(ApiFailure):
    """A Compute Engine error: ``{"error": {code, message, errors: [{message, domain,
    reason}]}}`` (the shape google-api-core and gcloud read; ``code`` is the HTTP status)."""

    def __init__(self, code: int, message: str, reason: str):
        super().__init__(COMPUTE_STATUS.get(code, "INTERNAL"), message)
        self.code = code
        self.reason = reason

    @property
    def http_code(self) -> int:
        return self.code

    def body(self) -> dict[str, Any]:
        return {"error": {"code": self.code, "message": self.message,
                          "errors": [{"message": self.message, "domain": "global",
                                      "reason": self.reason}]}}


# HTTP status -> the canonical status (what ApiFailure knows)
COMPUTE_STATUS = {400: "INVALID_ARGUMENT", 401: "UNAUTHENTICATED", 403: "PERMISSION_DENIED",
                  404: "NOT_FOUND", 409: "ALREADY_EXISTS", 412: "FAILED_PRECONDITION",
                  429: "RESOURCE_EXHAUSTED", 500: "INTERNAL", 501: "UNIMPLEMENTED",
                  503: "UNAVAILABLE"}
# a canonical status -> Compute Engine's ``reason`` for it
REASONS = {"INVALID_ARGUMENT": "invalid", "FAILED_PRECONDITION": "conditionNotMet",
           "NOT_FOUND": "notFound", "ALREADY_EXISTS": "alreadyExists",
           "PERMISSION_DENIED": "forbidden", "UNAUTHENTICATED": "authError",
           "RESOURCE_EXHAUSTED": "rateLimitExceeded", "UNAVAILABLE": "backendError",
           "INTERNAL": "backendError", "UNIMPLEMENTED": "notImplemented", "ABORTED": "aborted"}


def error(code: int, reason: str, message: str) -> ComputeFailure:
    return ComputeFailure(code, message, reason)


def as_compute(failure: ApiFailure) -> ComputeFailure:
    """Any failure of a Compute Engine request in Compute Engine's error shape (a TPU-shaped
    one raised by shared code, an injected burst, bad credentials)."""
    if isinstance(failure, ComputeFailure):
        return failure
    return ComputeFailure(failure.http_code, failure.message,
                          REASONS.get(failure.status, "backendError"))


def not_found(kind: str, path: str) -> ApiFailure:
    """Compute Engine's 404 for the resource at ``path`` (``kind`` names it for readers)."""
    path = path if path.startswith("projects/") else f"projects/{path}"
    return error(404, "notFound", f"The resource '{path}' was not found")


def is_general(machine_type: str) -> bool:
    """A general-purpose machine type (a VM without TPU)."""
    return machine_type in GENERAL_MACHINE_TYPES


def topology_of(machine_type: str, accelerator_topology: str | None = None) -> Topology:
    """The TPU shape of VMs of ``machine_type`` (one VM, or a slice of ``accelerator_topology``)."""
    if machine_type in GENERAL_MACHINE_TYPES:
        raise error(400, "invalid", f"Machine type {machine_type} has no TPU: a managed "
                    "instance group of TPU slices, or a TPU VM, needs a TPU machine type.")
    if machine_type not in MACHINE_TYPES:
        raise error(400, "invalid", f"Invalid value for field 'resource.machineType': "
                     f"'{machine_type}'. Machine type with name '{machine_type}' does not "
                     "exist in zone.")
    generation, chips_per_vm = MACHINE_TYPES[machine_type]
    gen = GENERATIONS[generation]
    chips = chips_per_vm
    dims: tuple[int, ...] | None = None
    if accelerator_topology:
        try:
            dims = tuple(int(d) for d in accelerator_topology.lower().split("x"))
        except ValueError:
            raise error(400, "invalid", f"Invalid accelerator topology "
                         f"'{accelerator_topology}'.") from None
        chips = 1
        for d in dims:
            chips *= d
    try:
        topo = parse_accelerator_type(f"{generation}-{chips * gen.cores_per_chip}")
        if dims is not None:
            check_topology(topo, dims)
    except ConfigError as err:
        raise error(400, "invalid", f"Accelerator topology '{accelerator_topology}' is not "
                     f"valid for machine type {machine_type}: {err}") from None
    if topo.chips_per_host != chips_per_vm and topo.hosts > 1:
        raise error(400, "invalid", f"Machine type {machine_type} has {chips_per_vm} chips "
                     f"per VM; a {accelerator_topology} slice needs "
                     f"{topo.chips_per_host}-chip VMs.")
    return topo


def short(url: str | None) -> str:
    return (url or "").rstrip("/").rsplit("/", 1)[-1]


def region_of(zone: str) -> str:
    return zone.rsplit("-", 1)[0]


def fingerprint() -> str:
    return base64.b64encode(secrets.token_bytes(8)).decode()


def new_id() -> str:
    return str(10**18 + secrets.randbelow(2**63 - 10**18))


def stockout_text(project: str, zone: str) -> str:
    """Compute Engine's words for VMs it has no capacity for (error code
    ZONE_RESOURCE_POOL_EXHAUSTED), as its API answers them."""
    return (f"The zone 'projects/{project}/zones/{zone}' does not have enough resources "
            "available to fulfill the request.  Try a different zone, or try again later.")


def quota_text(topo: Topology, zone: str, limit: int) -> str:
    """Compute Engine's words for a TPU quota a create exceeds (error code QUOTA_EXCEEDED).
    The metric's name is the emulator's: Compute Engine's TPU quota metrics per generation
    are not established here (docs/simulated-pod.md)."""
    metric = f"TPU_{topo.generation.upper()}_CHIPS"
    return (f"Quota '{metric}' exceeded.  Limit: {float(limit)} in region "
            f"{region_of(zone)}.")


def compute_failure(failure: tuple[str, str] | None, project: str, zone: str, topo: Topology,
                    limit: int | None = None) -> tuple[str, str] | None:
    """A backing node's create failure (``stockout`` or ``quota``) in Compute Engine's words."""
    if failure is None:
        return None
    reason, _ = failure
    if reason == "stockout":
        return reason, stockout_text(project, zone)
    return reason, quota_text(topo, zone, limit or 0)


def default_account(project: str) -> str:
    """The project's Compute Engine default service account (what ``default`` means)."""
    from tpufab.sim.catalog import project_number

    return f"{project_number(project)}-compute@developer.gserviceaccount.com"


def _opaque(*parts: object) -> str:
    import hashlib

    return hashlib.sha256("/".join(map(str, parts)).encode()).hexdigest()[:16]


def physical_host_topology(node_id: str, worker: int) -> dict[str, str]:
    """Where a VM of a HIGH_THROUGHPUT slice sits (``resourceStatus.physicalHostTopology``):
    one cluster, block and sub-block for the slice, a host of its own; opaque ids, stable for
    the slice's lifetime, as Compute Engine's are."""
    return {"cluster": _opaque("cluster", node_id), "block": _opaque("block", node_id),
            "subblock": _opaque("subblock", node_id), "host": _opaque("host", node_id, worker)}


def physical_host(node_id: str, worker: int) -> str:
    """``resourceStatus.physicalHost``: ``/CLUSTER/BLOCK/HOST`` of the same ids."""
    where = physical_host_topology(node_id, worker)
    return f"/{where['cluster']}/{where['block']}/{where['host']}"


def check_name(kind: str, name: str | None) -> str:
    """A resource name as Compute Engine accepts it, or its 400."""
    if not name or not ID_RE.match(name):
        raise error(400, "invalid", f"Invalid value for field 'resource.name': "
                    f"'{name}'. Must be a match of regex '(?:[a-z](?:[-a-z0-9]{{0,61}}"
                    "[a-z0-9])?)'")
    return name


def metadata_items(metadata: dict[str, Any] | None) -> dict[str, str]:
    """A Metadata message's ``items`` as a dict, or the 400 for a malformed item."""
    out = {}
    for item in (metadata or {}).get("items") or []:
        if not isinstance(item, dict) or "key" not in item:
            raise error(400, "invalid", "Each metadata item needs a key and a value.")
        out[str(item["key"])] = str(item.get("value") or "")
    return out


def scheduling_of(props: dict[str, Any]) -> dict[str, Any]:
    """An instance's (or template's) scheduling with Compute Engine's defaults filled in."""
    scheduling = dict(props.get("scheduling") or {})
    model = scheduling.get("provisioningModel") or (
        "SPOT" if scheduling.get("preemptible") else "STANDARD")
    if model not in PROVISIONING_MODELS:
        raise error(400, "invalid", f"Invalid value for field "
                    f"'resource.scheduling.provisioningModel': '{model}'.")
    if model == "FLEX_START" and not scheduling.get("maxRunDuration"):
        raise error(400, "invalid", "Flex-start VMs need scheduling.maxRunDuration.")
    scheduling["provisioningModel"] = model
    scheduling.setdefault("onHostMaintenance", "TERMINATE")
    scheduling.setdefault("automaticRestart", False)
    return scheduling


def external_ips(props: dict[str, Any]) -> bool:
    """Whether an instance's first network interface asks for an external IP."""
    nics = props.get("networkInterfaces")
    if not nics:
        return True
    return bool(nics[0].get("accessConfigs"))


def missing_code(message: str) -> str:
    """The error code of a VM a MIG could not create, from its message."""
    return "QUOTA_EXCEEDED" if message.startswith("Quota ") else "ZONE_RESOURCE_POOL_EXHAUSTED"
