"""The state every handler of the emulator shares: one lock, the state dict and its file, the
Cloud TPU API's operations, background tasks, the armed faults, and what runs on this machine
(the worker pool, the metadata servers, the node networks).

The emulator (tpufab/sim/emulator.py) routes requests; its handlers (nodes, machines, queued
resources, legacy nodes, guest, OS Login, Compute Engine) each hold this store and use it
through these public methods, never through each other's internals. Its tables are plain
dicts kept in ``<state_dir>/api-state.json`` (rewritten atomically by ``save``).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tpufab.sim._model import (
    ApiFailure,
    new_operation_id,
    not_found,
    operation_view,
    page,
    quota_message,
    rfc3339,
    split_name,
    stockout_message,
)
from tpufab.sim._slots import SlotRegistry, node_slots
from tpufab.topology import Topology, parse_accelerator_type

log = logging.getLogger("tpufab.sim")

STATE_FILE = "api-state.json"
TYPE_PREFIX = "type.googleapis.com/"
KEPT_OPERATIONS = 1000  # the newest finished TPU API operations kept in the state file


def copy(value: Any) -> Any:
    """A deep copy of JSON data (what a handler hands out of the lock)."""
    return json.loads(json.dumps(value))


def behind_compute_engine(name: str) -> bool:
    """Whether ``name`` is the record behind Compute Engine VMs (``.../ceInstances/N``,
    ``.../ceGroups/N``): not a node of the Cloud TPU API, whose lists never show it (nor the
    operations on it: a TPU7x record's acceleratorConfig is no enum the TPU API has)."""
    parts = name.split("/")
    return len(parts) > 4 and parts[4] in ("ceInstances", "ceGroups")


class SimStore:
    """The emulator's shared state (see the module docstring).

    ``lock`` (re-entrant) guards every table; a handler holds it while it reads or changes
    them and calls ``save()`` before it lets go of a change. ``workers`` is the worker pool
    (tpufab.sim.workers.WorkerPool or the paper one), ``metadata`` and ``network`` are set by
    the daemon when workers are real (None otherwise), ``base_url`` once the HTTP server is up.
    """

    def __init__(self, state_dir: Path, workers: Any, settings: Any):
        self.state_dir = Path(state_dir)
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.workers = workers
        self.settings = settings
        self.metadata: Any = None  # a tpufab.sim.metadata.MetadataServer when workers are real
        self.network: Any = None  # a tpufab.sim.network.NodeNetworks when workers are real
        self.base_url = ""  # http://127.0.0.1:PORT once served (Compute Engine selfLinks)
        self.lock = threading.RLock()
        self.stopping = threading.Event()
        self.slots = SlotRegistry(self.state_dir)
        self.last_slot: dict[str, int] = {}  # a deleted node's first slot, by its name
        self.create_failures: list[dict[str, Any]] = []
        # IAM permissions testIamPermissions answers as not granted (a test's knob)
        self.denied_permissions: set[str] = set()
        self.error_burst: dict[str, Any] | None = None
        self._threads: set[threading.Thread] = set()
        self._node_locks: dict[str, threading.Lock] = {}
        self._path = self.state_dir / STATE_FILE
        self.data = self._load()

    # ------------------------------------------------------------------ persistence

    def _load(self) -> dict[str, Any]:
        empty: dict[str, Any] = {"version": 1, "nodes": {}, "queuedResources": {},
                                 "operations": {}}
        if not self._path.exists():
            return empty
        try:
            state = json.loads(self._path.read_text())
        except (OSError, ValueError) as exc:
            broken = self._path.with_suffix(f".broken-{int(time.time())}")
            self._path.rename(broken)
            log.error("state file %s unreadable (%s); kept it as %s", self._path, exc, broken)
            return empty
        for key, value in empty.items():
            state.setdefault(key, value)
        return state

    def save(self) -> None:
        """Write every table to the state file (caller holds the lock)."""
        ops = self.data["operations"]
        if len(ops) > KEPT_OPERATIONS:  # keep the newest finished operations
            done = [n for n, op in ops.items() if op.get("done")]
            for name in done[: len(ops) - KEPT_OPERATIONS]:
                del ops[name]
        tmp = self._path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=1, sort_keys=True))
        os.replace(tmp, self._path)
        if self.metadata is not None:  # wakes metadata requests waiting for a change
            self.metadata.changed()

    def table(self, key: str, default: Callable[[], Any] = dict) -> Any:
        """The state's table ``key`` (made with ``default()`` the first time)."""
        return self.data.setdefault(key, default())

    @property
    def nodes(self) -> dict[str, dict[str, Any]]:
        """Node records by full name: ``{"node": <the API resource>, "sim": <the emulator's
        own fields>}``, TPU API nodes and the records behind Compute Engine VMs alike."""
        return self.data["nodes"]

    @property
    def queued_resources(self) -> dict[str, dict[str, Any]]:
        return self.data["queuedResources"]

    @property
    def operations(self) -> dict[str, dict[str, Any]]:
        """The TPU API's long-running operations, by full name."""
        return self.data["operations"]

    # ------------------------------------------------------------------ background work

    def spawn(self, target: Callable[..., None], *args: Any) -> None:
        """Run ``target(*args)`` on a daemon thread that ``join`` waits for."""
        def run() -> None:
            try:
                target(*args)
            except Exception:
                log.exception("background task %s%r failed", target.__name__, args)
            finally:
                self._threads.discard(threading.current_thread())

        thread = threading.Thread(target=run, name=f"sim-{target.__name__}", daemon=True)
        self._threads.add(thread)
        thread.start()

    def wait(self, seconds: float) -> bool:
        """Sleep ``seconds`` unless the emulator stops first; True if it is stopping."""
        return self.stopping.wait(seconds)

    def join(self, timeout: float) -> None:
        """Stop background work: tell it to stop and wait for it (bounded)."""
        self.stopping.set()
        deadline = time.monotonic() + timeout
        for thread in list(self._threads):
            thread.join(max(0.0, deadline - time.monotonic()))

    def node_lock(self, node_id: str) -> threading.Lock:
        """The lock that serializes what happens to one node's workers on this machine."""
        with self.lock:
            return self._node_locks.setdefault(node_id, threading.Lock())

    # ------------------------------------------------------------------ node records

    def node(self, name: str) -> dict[str, Any]:
        """A copy of node record ``name``, or NOT_FOUND."""
        with self.lock:
            return copy(self.require_node(name))

    def require_node(self, name: str) -> dict[str, Any]:
        """Node record ``name`` itself (caller holds the lock), or NOT_FOUND."""
        record = self.nodes.get(name)
        if record is None:
            raise not_found(name)
        return record

    def record_of_id(self, node_id: str) -> tuple[str, dict[str, Any]] | None:
        """(name, record) of the node whose id is ``node_id`` (caller holds the lock)."""
        for name, record in self.nodes.items():
            if record["node"]["id"] == node_id:
                return name, record
        return None

    def used_slots(self) -> set[int]:
        """Every slot this pod's nodes cover (caller holds the lock)."""
        return {s for r in self.nodes.values() for s in node_slots(r)}

    def forget_node(self, name: str) -> dict[str, Any] | None:
        """Drop a node's record and free its slots (caller holds the lock)."""
        record = self.nodes.pop(name, None)
        if record is not None:
            span = node_slots(record)
            self.slots.release(span.start, len(span))
            self.last_slot[name] = span.start
        return record

    # ------------------------------------------------------------------ queued resources

    def queued_node_names(self, record: dict[str, Any]) -> list[str]:
        """The nodes a queued resource record still has (caller holds the lock)."""
        qr_name = record["qr"]["name"]
        return [p["name"] for p in record["sim"]["plan"]
                if self.nodes.get(p["name"], {}).get("node", {}).get(
                    "queuedResource") == qr_name]

    def refresh_queued(self, name: str | None) -> None:
        """Derive a queued resource's state from its nodes (caller holds the lock)."""
        record = self.queued_resources.get(name or "")
        if record is None:
            return
        state = record["qr"]["state"]["state"]
        if state not in ("PROVISIONING", "ACTIVE"):
            return
        nodes = [self.nodes.get(p["name"]) for p in record["sim"]["plan"]]
        states = [n["node"]["state"] if n else None for n in nodes]
        if any(s == "PREEMPTED" for s in states):
            record["qr"]["state"] = {"state": "SUSPENDED", "suspendedData": {},
                                     "stateInitiator": "SERVICE"}
        elif any(s is None or s == "DELETING" for s in states):
            record["qr"]["state"] = {"state": "SUSPENDED", "suspendedData": {},
                                     "stateInitiator": "USER"}
        elif all(s == "READY" for s in states):
            record["qr"]["state"] = {"state": "ACTIVE", "activeData": {}}

    # ------------------------------------------------------------------ TPU API operations

    def new_operation(self, version: str, target: str, verb: str) -> dict[str, Any]:
        """A new long-running operation on ``target`` (caller holds the lock and saves)."""
        project, zone, _, _ = split_name(target)
        name = f"projects/{project}/locations/{zone}/operations/{new_operation_id()}"
        op = {
            "name": name,
            "metadata": {
                "@type": f"{TYPE_PREFIX}google.cloud.tpu.{version}.OperationMetadata",
                "createTime": rfc3339(),
                "target": target,
                "verb": verb,
                "cancelRequested": False,
                "apiVersion": version,
            },
            "done": False,
        }
        self.operations[name] = op
        return op

    def finish_operation(self, name: str | None, *, response: dict[str, Any] | None = None,
                         response_type: str = "Node",
                         error: tuple[int, str] | None = None) -> None:
        """Mark an operation done (caller holds the lock and saves)."""
        op = self.operations.get(name or "")
        if op is None or op.get("done"):
            return
        version = op["metadata"].get("apiVersion", "v2")
        op["done"] = True
        op["metadata"]["endTime"] = rfc3339()
        if error is not None:
            op["error"] = {"code": error[0], "message": error[1]}
        elif response_type == "Empty":
            op["response"] = {"@type": f"{TYPE_PREFIX}google.protobuf.Empty"}
        else:
            op["response"] = {"@type": f"{TYPE_PREFIX}google.cloud.tpu.{version}.{response_type}",
                              **(response or {})}

    def operation(self, name: str) -> dict[str, Any]:
        """A copy of operation ``name``, or NOT_FOUND."""
        with self.lock:
            op = self.operations.get(name)
            if op is None:
                raise not_found(name)
            return copy(op)

    def list_operations(self, parent: str, query: dict[str, str],
                        version: str = "v2") -> dict[str, Any]:
        with self.lock:
            ops = [operation_view(op, version) for n, op in self.operations.items()
                   if n.startswith(parent + "/")
                   and not behind_compute_engine(op["metadata"].get("target", ""))]
            items, token = page(copy(ops), query)
        out: dict[str, Any] = {"operations": items}
        if token:
            out["nextPageToken"] = token
        return out

    def delete_operation(self, name: str) -> dict[str, Any]:
        with self.lock:
            if self.operations.pop(name, None) is None:
                raise not_found(name)
            self.save()
        return {}

    def cancel_operation(self, name: str) -> dict[str, Any]:
        with self.lock:
            op = self.operations.get(name)
            if op is None:
                raise not_found(name)
            op["metadata"]["cancelRequested"] = True  # like the real API: best effort, ignored
            self.save()
        return {}

    # ------------------------------------------------------------------ faults

    def arm_create_failure(self, body: dict[str, Any]) -> dict[str, Any]:
        """/sim/v1/faults:failNextCreate: the next ``count`` creates fail (stockout or quota)."""
        reason = body.get("reason", "stockout")
        if reason not in ("stockout", "quota"):
            raise ApiFailure("INVALID_ARGUMENT", 'reason must be "stockout" or "quota".')
        count = int(body.get("count", 1))
        if count < 1:
            raise ApiFailure("INVALID_ARGUMENT", "count must be at least 1.")
        zone = body.get("zone") or None
        fault = {"reason": reason, "count": count, "zone": zone,
                 "immediate": bool(body.get("immediate", False))}
        if body.get("vms"):   # Compute Engine: that many VMs of the next MIG stay missing
            fault["vms"] = int(body["vms"])
        with self.lock:
            self.create_failures.append(fault)
            return {"createFailures": list(self.create_failures)}

    def arm_error_burst(self, body: dict[str, Any]) -> dict[str, Any]:
        """/sim/v1/faults:errorBurst: the next ``count`` requests answer 503 or 429."""
        code = int(body.get("code", 503))
        count = int(body.get("count", 1))
        if code not in (429, 503):
            raise ApiFailure("INVALID_ARGUMENT", "code must be 503 or 429.")
        if count < 1:
            raise ApiFailure("INVALID_ARGUMENT", "count must be at least 1.")
        with self.lock:
            self.error_burst = {"code": code, "count": count, "match": body.get("match") or ""}
            return {"errorBurst": dict(self.error_burst)}

    def faults(self) -> dict[str, Any]:
        with self.lock:
            return {"createFailures": list(self.create_failures),
                    "errorBurst": self.error_burst,
                    "deniedPermissions": sorted(self.denied_permissions)}

    def clear_faults(self) -> None:
        with self.lock:
            self.create_failures.clear()
            self.error_burst = None
            self.denied_permissions.clear()

    def take_error_burst(self, path: str) -> int | None:
        """The HTTP code a burst answers request ``path`` with (one of its count), or None."""
        with self.lock:
            burst = self.error_burst
            if not burst or burst["count"] <= 0:
                return None
            if burst.get("match") and burst["match"] not in path:
                return None
            burst["count"] -= 1
            if burst["count"] <= 0:
                self.error_burst = None
            return int(burst["code"])

    def take_short_vms(self, zone: str) -> int:
        """VMs the next multi-host MIG in ``zone`` cannot get (an armed ``vms`` fault; caller
        holds the lock)."""
        fault = next((f for f in self.create_failures
                      if f.get("vms") and f.get("zone") in (None, zone)), None)
        if fault is None:
            return 0
        fault["count"] -= 1
        if fault["count"] <= 0:
            self.create_failures.remove(fault)
        return int(fault["vms"])

    def take_create_failure(self, name: str, topo: Topology) -> tuple[str, str] | None:
        """(reason, message) a create of node ``name`` will end with, if a fault is armed or
        quota is exceeded (caller holds the lock); reason is ``stockout`` or ``quota``."""
        project, zone, _, _ = split_name(name)
        failure = None
        fault = next((f for f in self.create_failures if f.get("zone") in (None, zone)
                      and not f.get("vms")), None)
        if fault is not None:  # the first armed fault for this zone (or for every zone)
            fault["count"] -= 1
            if fault["count"] <= 0:
                self.create_failures.remove(fault)
            if fault["reason"] == "quota":
                failure = ("quota", quota_message(topo, zone, self.settings.quota_chips or 0))
            else:
                failure = ("stockout", stockout_message(zone))
            if fault.get("immediate"):
                raise ApiFailure("RESOURCE_EXHAUSTED", failure[1])
        limit = self.settings.quota_chips
        if failure is None and limit is not None:
            prefix = f"projects/{project}/locations/{zone}/nodes/"
            used = 0
            for other_name, other in self.nodes.items():
                if other_name.startswith(prefix):
                    other_topo = parse_accelerator_type(other["node"]["acceleratorType"])
                    if other_topo.generation == topo.generation:
                        used += other_topo.chips
            if used + topo.chips > limit:
                failure = ("quota", quota_message(topo, zone, limit))
        return failure
