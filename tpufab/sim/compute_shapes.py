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
    reason}]}}`` (the shape google-api-core and gcloud read)."""

    def __init__(self, status: str, message: str, reason: str):
        super().__init__(status, message)
        self.reason = reason

    def body(self) -> dict[str, Any]:
        return {"error": {"code": self.http_code, "message": self.message,
                          "errors": [{"message": self.message, "domain": "global",
                                      "reason": self.reason}]}}


def error(code: int, reason: str, message: str) -> ComputeFailure:
    status = {400: "INVALID_ARGUMENT", 404: "NOT_FOUND", 409: "ALREADY_EXISTS",
              429: "RESOURCE_EXHAUSTED"}.get(code, "INTERNAL")
    return ComputeFailure(status, message, reason)


def not_found(kind: str, path: str) -> ApiFailure:
    """Compute Engine's 404 for the resource at ``path`` (``kind`` names it for readers)."""
    path = path if path.startswith("projects/") else f"projects/{path}"
    return error(404, "notFound", f"The resource '{path}' was not found")


def topology_of(machine_type: str, accelerator_topology: str | None = None) -> Topology:
    """The TPU shape of VMs of ``machine_type`` (one VM, or a slice of ``accelerator_topology``)."""
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


def stockout_text(zone: str) -> str:
    """Compute Engine's words for a VM it has no capacity for (the error code is
    ZONE_RESOURCE_POOL_EXHAUSTED; the wording is the emulator's)."""
    return (f"The zone '{zone}' does not have enough resources available to fulfill the "
            "request. Try a different zone, or try again later.")


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
