"""TPU nodes and queued resources as plain records, built from the API's protos (pure).

One TPU node maps to many workers: `networkEndpoints[i]` is worker i. Nothing here talks to
the network; `from_proto` takes whatever `google.cloud.tpu_v2` returned (proto-plus messages).
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from tpufab.durations import human_duration
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
    if value.timestamp() <= 0:
        return None
    # a plain datetime (the client's is a subclass): a node unpickles without proto
    return datetime(*value.timetuple()[:6], value.microsecond, tzinfo=value.tzinfo)


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
    host_id: str = ""  # Compute Engine: the VM's instance id (a recreated VM has a new one)

    def address(self, internal_ip: bool = False) -> str:
        """The address to reach this worker at: external unless asked for internal (or none)."""
        if internal_ip or not self.external_ip:
            return self.internal_ip
        return self.external_ip

    def to_json(self) -> dict:
        return {"index": self.index, "internal_ip": self.internal_ip,
                "external_ip": self.external_ip, "port": self.port}


def _rfc3339(text: Any) -> datetime | None:
    """The API's RFC 3339 text ("2026-11-25T04:00:00Z") as an aware datetime, else None."""
    if not text or not isinstance(text, str):
        return None
    try:
        return datetime.fromisoformat(text.strip().replace("Z", "+00:00"))
    except ValueError:
        return None


def _utc(t: datetime, fmt: str) -> str:
    from datetime import timezone

    return t.astimezone(timezone.utc).strftime(fmt)


@dataclass(frozen=True)
class UpcomingMaintenance:
    """A node's ``upcomingMaintenance`` (TPU API v2alpha1 ``UpcomingMaintenance``): ``type``
    SCHEDULED | UNSCHEDULED, ``status`` PENDING | ONGOING, the window (RFC 3339 in the API)."""

    type: str = ""
    can_reschedule: bool | None = None
    window_start: datetime | None = None
    window_end: datetime | None = None
    latest_window_start: datetime | None = None
    status: str = ""

    @classmethod
    def from_json(cls, data: Any) -> UpcomingMaintenance | None:
        """From the API's JSON (``{"type", "canReschedule", "windowStartTime", ...}``), or
        None when the node has none."""
        if not isinstance(data, Mapping) or not data:
            return None
        can = data.get("canReschedule")
        found = cls(type=str(data.get("type") or ""),
                    can_reschedule=bool(can) if can is not None else None,
                    window_start=_rfc3339(data.get("windowStartTime")),
                    window_end=_rfc3339(data.get("windowEndTime")),
                    latest_window_start=_rfc3339(data.get("latestWindowStartTime")),
                    status=str(data.get("maintenanceStatus") or ""))
        return found if found != cls() else None

    def seconds_to_start(self, now: float | None = None) -> float | None:
        if self.window_start is None:
            return None
        return self.window_start.timestamp() - (time.time() if now is None else now)

    def describe(self, now: float | None = None) -> str:
        """"SCHEDULED maintenance PENDING, window 2026-11-25 04:00-05:00 UTC (in 2h 0m),
        can be rescheduled until 2026-11-26 04:00 UTC"."""
        kind = f"{self.type} maintenance" if self.type else "maintenance"
        status = f" {self.status}" if self.status else ""
        text = f"{kind}{status}"
        if self.window_start is not None:
            start = _utc(self.window_start, "%Y-%m-%d %H:%M")
            end = f"-{_utc(self.window_end, '%H:%M')}" if self.window_end else ""
            left = self.seconds_to_start(now)
            when = (f"in {human_duration(left)}" if left is not None and left > 0
                    else "started")
            text += f", window {start}{end} UTC ({when})"
        if self.can_reschedule:
            until = (f" until {_utc(self.latest_window_start, '%Y-%m-%d %H:%M')} UTC"
                     if self.latest_window_start else "")
            text += f", can be rescheduled{until}"
        return text

    def to_json(self) -> dict:
        def iso(t: datetime | None) -> str | None:
            return t.isoformat() if t else None

        return {"type": self.type or None, "can_reschedule": self.can_reschedule,
                "window_start_time": iso(self.window_start),
                "window_end_time": iso(self.window_end),
                "latest_window_start_time": iso(self.latest_window_start),
                "maintenance_status": self.status or None}


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
    # v2alpha1's upcomingMaintenance, filled by status/check/babysit (None: none, or not asked)
    upcoming_maintenance: UpcomingMaintenance | None = None
    plane: str = ""                      # the control plane's registry name (set by the plane)
    plane_text: str = ""                 # its title (the ON column, describe's control plane)
    plane_title: str = ""                # its full name, for sentences
    runtime_label: str = "runtime"       # what runtime_version is on this plane (describe)
    order_note: str = ""                 # why its workers are numbered by internal IP, if so
    provisioning_model: str = ""         # Compute Engine: STANDARD, SPOT, FLEX_START ...
    compute_group: str = ""              # Compute Engine: the slice's MIG, its template and
    compute_template: str = ""           # workload policy (short names; "" for one VM)
    compute_policy: str = ""
    max_run_duration: int = 0            # Compute Engine flex-start: seconds it may run
    condition: str = ""                  # Compute Engine: why it is not READY, one sentence

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
            "upcoming_maintenance": self.upcoming_maintenance.to_json()
            if self.upcoming_maintenance else None,
            "control_plane": self.plane,
            **({"provisioning_model": self.provisioning_model,   # a plane with VM fields
                "instance_group": self.compute_group or None,
                "instance_template": self.compute_template or None,
                "workload_policy": self.compute_policy or None,
                "max_run_duration": self.max_run_duration or None,
                "condition": self.condition or None,
                **({"worker_order": self.order_note} if self.order_note else {})}
               if self.provisioning_model else {}),
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


@dataclass
class MultisliceInfo:
    """A Compute Engine multislice: the slices (MIGs ``NAME-0 .. NAME-(N-1)``) tpufab made
    as one job with ``create --num-slices N`` and labelled ``tpufab-multislice=NAME``
    (Compute Engine has no resource that ties them together). Its workers are numbered as
    the verbs number them: slice 0's first, then slice 1's ..."""

    name: str
    project: str
    zone: str
    slices: list[Node]

    @property
    def plane(self) -> str:
        return self.slices[0].plane if self.slices else ""

    @property
    def plane_text(self) -> str:
        return self.slices[0].plane_text if self.slices else ""

    @property
    def plane_title(self) -> str:
        return self.slices[0].plane_title if self.slices else ""

    @property
    def accelerator_type(self) -> str:
        return self.slices[0].accelerator_type if self.slices else ""

    @property
    def state(self) -> str:
        """READY when every slice is; else the first slice's state that is not."""
        return next((s.state for s in self.slices if not s.ready), "READY")

    @property
    def hosts(self) -> int:
        return sum(s.hosts for s in self.slices)

    def workers(self) -> list[tuple[int, int, WorkerEndpoint]]:
        """(worker number across the multislice, slice index, the slice's worker)."""
        rows, base = [], 0
        for index, node in enumerate(self.slices):
            for w in node.workers:
                rows.append((base + w.index, node.slice_index if node.slice_index is not None
                             else index, w))
            base += len(node.workers)
        return rows

    def to_json(self) -> dict:
        return {"name": self.name, "multislice": True, "control_plane": self.plane,
                "project": self.project, "zone": self.zone,
                "accelerator_type": self.accelerator_type, "state": self.state,
                "slice_count": len(self.slices), "hosts": self.hosts,
                "slices": [s.to_json() for s in self.slices],
                "workers": [{**w.to_json(), "index": i, "slice": s, "slice_worker": w.index}
                            for i, s, w in self.workers()]}


# The autostop policy tpufab's watchdog enforces, as the node's metadata carries it
# (written by tpufab.steps.host.autostop; shown by `tpufab list`).
AUTOSTOP_KEY = "tpufab-autostop"


def describe_autostop(pol: Mapping[str, Any] | None, *, fires_at: float | None = None) -> str:
    """An autostop policy (node metadata ``AUTOSTOP_KEY``) in words: ``deletes the pod after
    30m idle, or at 2026-11-28 14:05:00 at the latest (TTL)``."""
    if not pol:
        return "off"
    parts = []
    if pol.get("idle"):
        parts.append(f"deletes the pod after {human_duration(pol['idle'])} idle")
    if pol.get("ttl_at"):
        at = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(pol["ttl_at"]))
        parts.append(f"{'or ' if parts else 'deletes the pod '}at {at} at the latest (TTL)")
    text = ", ".join(parts)
    if fires_at:
        text += f"; fires at {time.strftime('%H:%M:%S', time.localtime(fires_at))} if nothing " \
                "starts"
    return text


def autostop_cell(metadata: Mapping[str, str]) -> str:
    """The AUTOSTOP column of `tpufab list`, from node metadata."""
    raw = metadata.get(AUTOSTOP_KEY)
    if not raw:
        return "-"
    try:
        pol = json.loads(raw)
    except ValueError:
        return "?"
    parts = []
    if pol.get("idle"):
        parts.append(f"idle {human_duration(pol['idle'])}")
    if pol.get("ttl_at"):
        parts.append("at " + time.strftime("%m-%d %H:%M", time.localtime(pol["ttl_at"])))
    return ", ".join(parts) or "-"


# How a node went, when autostop deleted it (its watchdog labels the node first).
FIRED_LABEL = "tpufab-autostop-fired"   # the watchdog's: "<unix time>-<idle|ttl>"
FIRED_WINDOW = 300.0   # seconds between the label and the delete that still tie them


def fired_label(value: str | None) -> tuple[float, str] | None:
    """``"1764000000-idle"`` -> (1764000000.0, "idle"); None for anything else (pure)."""
    when, _, why = (value or "").partition("-")
    try:
        return float(when), why or "?"
    except ValueError:
        return None


def deleted_by_autostop(operations: Sequence[Mapping[str, Any]], name: str) -> str | None:
    """How the pod ``name`` (a node, or a queued resource and its slices) went, when its last
    delete followed autostop's label within FIRED_WINDOW: ``deleted by autostop at
    2026-11-24 23:40:01 (idle)``; None otherwise (pure, on ``ControlPlane.list_operations``).

    The watchdog labels the node just before it deletes it; the node is gone with its labels
    afterwards, but the API keeps the update operation, whose response is the labelled node."""
    import re

    mine = re.compile(rf"/(nodes|queuedResources)/{re.escape(name)}(-\d+)?$")
    deletes = [o for o in operations if o.get("verb") == "delete"
               and mine.search(o.get("target") or "")]
    if not deletes:
        return None
    last = max(deletes, key=lambda o: o["created"])
    for op in operations:
        node = op.get("node")
        if op.get("verb") != "update" or node is None or not mine.search(op.get("target") or ""):
            continue
        fired = fired_label(dict(node.labels).get(FIRED_LABEL))
        if fired and 0 <= last["created"] - fired[0] <= FIRED_WINDOW:
            at = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(fired[0]))
            return f"deleted by autostop at {at} ({fired[1]})"
    return None
