"""TPU nodes and queued resources as plain records, built from the API's protos (pure).

One TPU node maps to many workers: `networkEndpoints[i]` is worker i. Nothing here talks to
the network; `from_proto` takes whatever `google.cloud.tpu_v2` returned (proto-plus messages).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from tpufab.errors import ConfigError
from tpufab.topology import Topology, parse_accelerator_type

_RESOURCE_RE = re.compile(
    r"^projects/(?P<project>[^/]+)/locations/(?P<zone>[^/]+)/(?P<kind>[A-Za-z]+)/(?P<id>[^/]+)$")

# States in which a node will not become READY by itself.
DEAD_STATES = frozenset({"PREEMPTED", "TERMINATED", "STOPPED", "STOPPING", "HIDDEN", "HIDING"})


def split_resource_name(name: str) -> tuple[str, str, str]:
    """`projects/P/locations/Z/nodes/ID` -> (P, Z, ID); a bare ID -> ("", "", ID)."""
    m = _RESOURCE_RE.match(name or "")
    if not m:
        return "", "", (name or "").rsplit("/", 1)[-1]
    return m.group("project"), m.group("zone"), m.group("id")


def _enum_name(value: Any) -> str:
    name = getattr(value, "name", None)
    return name if isinstance(name, str) else str(value)


def _timestamp(value: Any) -> datetime | None:
    if value is None or not isinstance(value, datetime):
        return None
    return value if value.timestamp() > 0 else None


def _topology(accelerator_type: str) -> Topology | None:
    try:
        return parse_accelerator_type(accelerator_type)
    except ConfigError:  # a type newer than tpufab: keep the record, lose the shape
        return None


@dataclass(frozen=True)
class WorkerEndpoint:
    """One TPU VM host of a node; `index` is the worker id (`--worker N`)."""

    index: int
    internal_ip: str
    external_ip: str | None
    port: int = 22

    def address(self, internal_ip: bool = False) -> str:
        """The address to reach this worker at: external unless asked for internal (or none)."""
        if internal_ip or not self.external_ip:
            return self.internal_ip
        return self.external_ip

    def to_json(self) -> dict:
        return {"index": self.index, "internal_ip": self.internal_ip,
                "external_ip": self.external_ip, "port": self.port}


@dataclass
class Node:
    """A TPU VM node (one slice): its shape, state and workers."""

    name: str
    project: str
    zone: str
    accelerator_type: str
    state: str
    id: str = ""
    runtime_version: str = ""
    health: str | None = None
    health_description: str = ""
    topology: Topology | None = None     # tpufab's shape of accelerator_type
    chip_topology: str = ""              # the API's acceleratorConfig.topology, e.g. "2x2x4"
    workers: list[WorkerEndpoint] = field(default_factory=list)
    spot: bool = False
    preemptible: bool = False
    reserved: bool = False
    labels: dict[str, str] = field(default_factory=dict)
    metadata: dict[str, str] = field(default_factory=dict)
    created: datetime | None = None
    queued_resource: str | None = None   # the queued resource's short name, if any
    multislice: bool = False
    slice_index: int | None = None       # for multislice nodes named PREFIX-<i>
    api_version: str = ""                # "V1" for a legacy TPU Node (no workers to SSH into)
    external_ips: bool = True            # networkConfig.enableExternalIps (else: any worker's)
    network: str = ""                    # networkConfig.network / .subnetwork, as the API says
    subnetwork: str = ""

    def __post_init__(self) -> None:
        if self.topology is None and self.accelerator_type:
            self.topology = _topology(self.accelerator_type)

    @classmethod
    def from_proto(cls, proto: Any) -> Node:
        project, zone, short = split_resource_name(proto.name)
        workers = [
            WorkerEndpoint(
                index=i,
                internal_ip=ep.ip_address,
                external_ip=(ep.access_config.external_ip or None) if ep.access_config else None,
                port=ep.port or 22,
            )
            for i, ep in enumerate(proto.network_endpoints)
        ]
        health = _enum_name(proto.health)
        sched = proto.scheduling_config
        qr = split_resource_name(proto.queued_resource)[2] if proto.queued_resource else None
        multislice = bool(proto.multislice_node)
        slice_index = None
        if multislice:
            m = re.search(r"-(\d+)$", short)
            slice_index = int(m.group(1)) if m else None
        # A worker with an external IP settles it; else networkConfig (proto3 leaves a false
        # enableExternalIps out of the JSON, so a networkConfig without it asks for none).
        network = proto.network_config if "network_config" in proto else None
        external = any(w.external_ip for w in workers) or (
            bool(network.enable_external_ips) if network is not None else not workers)
        return cls(
            name=short,
            project=project,
            zone=zone,
            id=str(proto.id or ""),
            external_ips=external,
            network=network.network if network is not None else "",
            subnetwork=network.subnetwork if network is not None else "",
            accelerator_type=proto.accelerator_type,
            chip_topology=proto.accelerator_config.topology if proto.accelerator_config else "",
            runtime_version=proto.runtime_version,
            state=_enum_name(proto.state),
            health=None if health == "HEALTH_UNSPECIFIED" else health,
            health_description=proto.health_description,
            workers=workers,
            spot=bool(sched and sched.spot),
            preemptible=bool(sched and sched.preemptible),
            reserved=bool(sched and sched.reserved),
            labels=dict(proto.labels),
            metadata=dict(proto.metadata),
            created=_timestamp(proto.create_time),
            queued_resource=qr,
            multislice=multislice,
            slice_index=slice_index,
            api_version=_enum_name(proto.api_version),
        )

    @property
    def hosts(self) -> int:
        return len(self.workers) or (self.topology.hosts if self.topology else 0)

    @property
    def ready(self) -> bool:
        return self.state == "READY"

    @property
    def legacy(self) -> bool:
        """A TPU Node of the legacy architecture (API v1): reached over gRPC, no TPU VMs."""
        return self.api_version in ("V1", "V1_ALPHA1")

    @property
    def preempted(self) -> bool:
        return self.state == "PREEMPTED"

    @property
    def tier(self) -> str:
        return ("spot" if self.spot else "preemptible" if self.preemptible
                else "reserved" if self.reserved else "on-demand")

    def addresses(self, internal_ip: bool = False) -> list[str]:
        """Worker addresses in worker order (what the SSH fan-out connects to)."""
        return [w.address(internal_ip) for w in self.workers]

    def to_json(self) -> dict:
        return {
            "name": self.name,
            "id": self.id,
            "project": self.project,
            "zone": self.zone,
            "accelerator_type": self.accelerator_type,
            "chip_topology": self.chip_topology,
            "chips": self.topology.chips if self.topology else None,
            "hosts": self.hosts,
            "runtime_version": self.runtime_version,
            "state": self.state,
            "health": self.health,
            "health_description": self.health_description,
            "workers": [w.to_json() for w in self.workers],
            "spot": self.spot,
            "preemptible": self.preemptible,
            "reserved": self.reserved,
            "labels": dict(self.labels),
            "metadata_keys": sorted(self.metadata),
            "created": self.created.isoformat() if self.created else None,
            "queued_resource": self.queued_resource,
            "multislice": self.multislice,
            "slice_index": self.slice_index,
        }


@dataclass
class QueuedResourceInfo:
    """A queued resource: a request for one node or, with multislice, several."""

    name: str
    project: str
    zone: str
    state: str
    tier: str                             # "spot", "guaranteed" or "reserved"
    accelerator_type: str = ""
    runtime_version: str = ""
    node_ids: list[str] = field(default_factory=list)
    node_count: int = 1
    node_id_prefix: str | None = None
    created: datetime | None = None
    failure: str = ""                     # the API's reason when state is FAILED

    @classmethod
    def from_proto(cls, proto: Any) -> QueuedResourceInfo:
        project, zone, short = split_resource_name(proto.name)
        node_ids: list[str] = []
        accel = runtime = ""
        node_count, prefix, reserved = 0, None, False
        for spec in proto.tpu.node_spec if proto.tpu else []:
            accel = accel or spec.node.accelerator_type
            runtime = runtime or spec.node.runtime_version
            reserved = reserved or bool(spec.node.scheduling_config.reserved)
            params = spec.multislice_params
            if params and params.node_count:
                prefix = params.node_id_prefix or short
                node_ids += [f"{prefix}-{i}" for i in range(params.node_count)]
                node_count += params.node_count
            else:
                node_ids.append(spec.node_id or short)
                node_count += 1
        tier_field = proto._pb.WhichOneof("tier") if hasattr(proto, "_pb") else None
        tier = "spot" if tier_field == "spot" else ("reserved" if reserved else "guaranteed")
        state = proto.state
        failure = ""
        if state and state.failed_data and state.failed_data.error:
            failure = state.failed_data.error.message
        return cls(
            name=short,
            project=project,
            zone=zone,
            state=_enum_name(state.state) if state else "STATE_UNSPECIFIED",
            tier=tier,
            accelerator_type=accel,
            runtime_version=runtime,
            node_ids=node_ids,
            node_count=node_count or 1,
            node_id_prefix=prefix,
            created=_timestamp(proto.create_time),
            failure=failure,
        )

    @property
    def active(self) -> bool:
        return self.state == "ACTIVE"

    def to_json(self) -> dict:
        return {
            "name": self.name,
            "project": self.project,
            "zone": self.zone,
            "state": self.state,
            "tier": self.tier,
            "accelerator_type": self.accelerator_type,
            "runtime_version": self.runtime_version,
            "node_ids": list(self.node_ids),
            "node_count": self.node_count,
            "node_id_prefix": self.node_id_prefix,
            "created": self.created.isoformat() if self.created else None,
            "failure": self.failure or None,
        }
