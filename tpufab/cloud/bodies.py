"""Request bodies, built by pure functions returning dicts in the Cloud TPU API's field names
(the one vocabulary every control plane takes and translates), so they are tested as data."""

from __future__ import annotations

from typing import Any

from tpufab.config import Settings
from tpufab.errors import ConfigError
from tpufab.ssh.keys import SSH_KEYS, merge_entry
from tpufab.topology import accelerator_config, parse_accelerator_type

CLOUD_PLATFORM_SCOPE = "https://www.googleapis.com/auth/cloud-platform"


def scheduling_tier(settings: Settings) -> str:
    """"spot", "preemptible", "reserved" or "on-demand"; a clear error if several are asked."""
    chosen = [t for t in ("spot", "preemptible", "reserved") if getattr(settings, t)]
    if len(chosen) > 1:
        flags = " and ".join(f"--{t}" for t in chosen)
        raise ConfigError(f"{flags} cannot be combined; pick one way to pay for the TPU.")
    return chosen[0] if chosen else "on-demand"


def node_body(settings: Settings, *, ssh_entry: str | None = None,
              chip_topology: str | None = None) -> dict:
    """The `Node` to create for ``settings`` (accelerator type, runtime, tier, network, keys).

    With ``chip_topology`` (``--topology 4x4x4``) the node asks for ``acceleratorConfig``
    (generation + shape) instead of ``acceleratorType``, as gcloud's --type/--topology do.
    """
    topology = parse_accelerator_type(settings.require("type", "--type"))
    tier = scheduling_tier(settings)
    metadata = dict(settings.metadata)
    if ssh_entry:
        metadata[SSH_KEYS] = merge_entry(metadata.get(SSH_KEYS), ssh_entry)
    network: dict[str, Any] = {"enable_external_ips": not settings.internal_ip}
    if settings.network:
        network["network"] = settings.network
    if settings.subnetwork:
        network["subnetwork"] = settings.subnetwork
    body: dict[str, Any] = {
        "accelerator_type": topology.name,
        "runtime_version": settings.runtime_version or topology.default_runtime,
        "network_config": network,
        "labels": dict(settings.labels),
        "metadata": metadata,
    }
    if chip_topology:
        del body["accelerator_type"]
        config = accelerator_config(topology.name, chip_topology)
        # proto-plus spells the field type_ (type is a Python builtin)
        body["accelerator_config"] = {"type_": config["type"], "topology": config["topology"]}
    if tier != "on-demand":
        body["scheduling_config"] = {tier: True}
    if settings.service_account:
        body["service_account"] = {"email": settings.service_account,
                                   "scope": [CLOUD_PLATFORM_SCOPE]}
    return body


def reservation_path(settings: Settings, reservation: str) -> str:
    """``NAME`` -> ``projects/P/locations/Z/reservations/NAME``; a full path stays as it is."""
    if reservation.startswith("projects/"):
        return reservation
    if not reservation or "/" in reservation:
        raise ConfigError(f"--reservation takes a reservation name or its full path "
                          f"(projects/P/locations/Z/reservations/NAME), not {reservation!r}.")
    return f"projects/{settings.project}/locations/{settings.zone}/reservations/{reservation}"


def queued_resource_body(settings: Settings, *, num_slices: int = 1,
                         ssh_entry: str | None = None, reservation: str | None = None,
                         chip_topology: str | None = None) -> dict:
    """The `QueuedResource` asking for ``num_slices`` nodes named after settings.name.

    Spot requests use the spot tier; everything else the guaranteed tier (reserved capacity
    is asked for on the node). Several slices become `multisliceParams`, which names the
    nodes `NAME-0 .. NAME-(n-1)`. ``reservation`` consumes that named reservation
    (`reservationName`, the nodes scheduled as reserved).
    """
    name = settings.require("name")
    if num_slices < 1:
        raise ConfigError(f"--num-slices must be 1 or more, not {num_slices}.")
    tier = scheduling_tier(settings)
    if tier == "preemptible":
        raise ConfigError("Queued resources cannot be preemptible; use --spot instead.")
    if reservation and tier == "spot":
        raise ConfigError("--reservation and --spot cannot be combined: a reservation is "
                          "capacity you already hold; drop one of them.")
    if reservation:
        tier = "reserved"
    node = node_body(settings, ssh_entry=ssh_entry, chip_topology=chip_topology)
    node.pop("scheduling_config", None)
    if tier == "reserved":
        node["scheduling_config"] = {"reserved": True}
    spec: dict[str, Any] = {"parent": f"projects/{settings.project}/locations/{settings.zone}",
                            "node": node}
    if num_slices > 1:
        spec["multislice_params"] = {"node_count": num_slices, "node_id_prefix": name}
    else:
        spec["node_id"] = name
    body: dict[str, Any] = {"tpu": {"node_spec": [spec]}}
    if tier == "spot":
        body["spot"] = {}
    else:
        body["guaranteed"] = {}
    if reservation:
        body["reservation_name"] = reservation_path(settings, reservation)
    return body


def config_text(config: dict | None) -> str | None:
    """``{"type": "V4", "topology": "4x4x4"}`` -> "v4 4x4x4" (for error sentences)."""
    if not config:
        return None
    kind = config.get("type_") or config.get("type") or ""
    return f"{str(kind).lower()} {config.get('topology', '')}".strip()

