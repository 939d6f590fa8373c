"""What a node record means on this machine: its addresses (slots), its workers brought up,
stopped, preempted and torn down, its bastion, and the faults that reach its workers.

A handler of the emulator over the shared store (tpufab/sim/store.py): the Cloud TPU API's
nodes (nodes.py), queued resources (queued.py) and the records behind Compute Engine VMs
(backing.py) all place and run their workers through it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from tpufab.sim._model import (
    CONFIG_TYPE_OF_GENERATION,
    TPU_PCI_DEVICE,
    ApiFailure,
    accelerator_type_of,
    new_node_id,
    rfc3339,
    split_name,
    topology_string,
    worker_address,
    worker_hostname,
)
from tpufab.sim._slots import node_slots, slots_for
from tpufab.sim.guest import GuestEnvironment
from tpufab.sim.network import BASTION_SUFFIX, bastion_address, is_internal
from tpufab.sim.oslogin import OsLoginService
from tpufab.sim.store import SimStore, copy
from tpufab.topology import Topology, parse_accelerator_type

log = logging.getLogger("tpufab.sim")

BRING_UP_STATES = ("CREATING", "STARTING", "RESTARTING")
OUTPUT_ONLY_NODE_FIELDS = ("name", "id", "state", "health", "healthDescription", "createTime",
                           "networkEndpoints", "apiVersion", "symptoms", "queuedResource",
                           "multisliceNode")


def endpoints(slot: int, hosts: int, external: bool = True) -> list[dict[str, Any]]:
    """The networkEndpoints of a node of ``hosts`` workers whose first slot is ``slot``."""
    return [{"ipAddress": worker_address(slot, w), "port": 22,
             **({"accessConfig": {"externalIp": worker_address(slot, w)}} if external else {})}
            for w in range(hosts)]


def validate_node(name: str, node_in: dict[str, Any]) -> Topology:
    """The type of a requested node, or the INVALID_ARGUMENT a create answers."""
    zone = split_name(name)[1]
    topo = accelerator_type_of(node_in, zone)
    if not node_in.get("runtimeVersion"):
        raise ApiFailure("INVALID_ARGUMENT",
                         f"runtimeVersion is required (for {topo.name} the usual one is "
                         f"{topo.default_runtime}).")
    for key in ("metadata", "labels"):
        value = node_in.get(key)
        if value is not None and (not isinstance(value, dict) or
                                  not all(isinstance(v, str) for v in value.values())):
            raise ApiFailure("INVALID_ARGUMENT", f"Node {key} must map strings to strings.")
    return topo


def bastion_of(node: dict[str, Any]) -> dict[str, Any]:
    """``{"bastion": address}`` for a node without external IPs (its jump host)."""
    nodes_endpoints = node.get("networkEndpoints") or []
    if not is_internal(node) or not nodes_endpoints:
        return {}
    return {"bastion": bastion_address(nodes_endpoints[0]["ipAddress"])}


class Machines:
    """Places node records on this machine and runs their workers (see the module docstring)."""

    def __init__(self, store: SimStore, guest: GuestEnvironment, oslogin: OsLoginService, *,
                 spec_factory: Callable[..., Any] | None = None):
        self.store = store
        self.guest = guest
        self.oslogin = oslogin
        self._spec_factory = spec_factory or getattr(store.workers, "spec_factory", None)
        self.resuming = 0  # restarts of READY nodes' workers still under way

    # ------------------------------------------------------------------ placing a record

    def check_capacity(self, topos: list[Topology]) -> None:
        """Refuse, before anything starts, workers this machine cannot hold."""
        hosts = sum(t.hosts for t in topos)
        names = sorted({t.name for t in topos})
        what = names[0] if len(topos) == 1 else \
            f"{len(topos)} slices of {' and '.join(names)}"
        problem = self.store.workers.capacity_problem(what, hosts)
        if problem:
            raise ApiFailure("FAILED_PRECONDITION", problem)

    def new_node(self, name: str, node_in: dict[str, Any], version: str,
                 topo: Topology | None = None, *, machine_type: str | None = None
                 ) -> tuple[Topology | None, dict[str, Any]]:
        """Validate a requested node and build its API record, its slots claimed (caller
        holds the lock); ``topo`` given: a Compute Engine VM's backing record, validated;
        ``machine_type`` given: a general-purpose VM's (one worker, no TPU: its record's
        ``acceleratorType`` is empty and ``machineType`` names it)."""
        store = self.store
        project, zone, _, _ = split_name(name)
        if machine_type is None:
            topo = topo or validate_node(name, node_in)
        hosts = 1 if topo is None else topo.hosts
        runtime = node_in["runtimeVersion"]
        slot = store.slots.claim(store.used_slots(), slots_for(hosts),
                                 prefer=store.last_slot.get(name))
        node = {k: v for k, v in node_in.items() if k not in OUTPUT_ONLY_NODE_FIELDS}
        region = zone.rsplit("-", 1)[0]
        network = dict(node.get("networkConfig") or {})
        # proto3 JSON leaves a false bool out: a networkConfig without enableExternalIps asks
        # for none (the official client's --internal-ips); no networkConfig at all gets them.
        network["enableExternalIps"] = bool(network.get("enableExternalIps",
                                                        "networkConfig" not in node))
        network.setdefault("network", f"projects/{project}/global/networks/default")
        network.setdefault("subnetwork",
                           f"projects/{project}/regions/{region}/subnetworks/default")
        account = dict(node.get("serviceAccount") or {})
        account.setdefault("email", "default")
        account.setdefault("scope", ["https://www.googleapis.com/auth/cloud-platform"])
        node.update({
            "name": name,
            "id": new_node_id(),
            "acceleratorType": "" if topo is None else topo.name,
            "runtimeVersion": runtime,
            "state": "CREATING",
            "createTime": rfc3339(),
            "apiVersion": "V2" if version == "v2" else "V2_ALPHA1",
            "networkConfig": network,
            "serviceAccount": account,
            "schedulingConfig": dict(node.get("schedulingConfig") or {}),
            "cidrBlock": node.get("cidrBlock") or "10.128.0.0/20",
            "networkEndpoints": endpoints(slot, hosts, external=network["enableExternalIps"]),
            "metadata": dict(node.get("metadata") or {}),
        })
        if topo is None:
            node["machineType"] = machine_type
            return None, node
        topology = topology_string(topo) if topo.generation in CONFIG_TYPE_OF_GENERATION \
            else None
        if topology and "acceleratorConfig" not in node_in:
            node["acceleratorConfig"] = {"type": CONFIG_TYPE_OF_GENERATION[topo.generation],
                                         "topology": topology}
        return topo, node

    @staticmethod
    def sim_fields(node: dict[str, Any], op_name: str | None,
                   failure: str | None) -> dict[str, Any]:
        """The emulator's own part of a new node record."""
        parts = node["networkEndpoints"][0]["ipAddress"].split(".")
        return {"slot": (int(parts[1]) - 16) * 256 + int(parts[2]), "op": op_name,
                "failure": failure, "hostKeys": {}}

    def specs(self, node: dict[str, Any]) -> list[Any]:
        """The worker specs of a node (its addresses, hostnames, TPU device files)."""
        factory = self._spec_factory
        if factory is None:
            from tpufab.sim.worker_files import WorkerSpec

            factory = self._spec_factory = WorkerSpec
        names = node.get("instanceNames") or []  # a Compute Engine VM: its instance name
        if not node.get("acceleratorType"):  # a general-purpose VM: no TPU, its own init
            specs = [factory(node_id=node["id"], index=w, ip=e["ipAddress"],
                             hostname=names[w] if w < len(names) else
                             worker_hostname(node["id"], w), device_files=(), vm=True)
                     for w, e in enumerate(node["networkEndpoints"])]
        else:
            topo = parse_accelerator_type(node["acceleratorType"])
            specs = [factory(node_id=node["id"], index=w, ip=e["ipAddress"],
                             hostname=names[w] if w < len(names) else
                             worker_hostname(node["id"], w),
                             device_files=tuple(topo.device_files),
                             pci_device=TPU_PCI_DEVICE.get(topo.generation, ""))
                     for w, e in enumerate(node["networkEndpoints"])]
        network = self.store.network
        return specs if network is None else network.place(node, specs)

    def reclaim_slot(self, name: str, record: dict[str, Any]) -> None:
        """Keep a node's addresses across restarts unless another pod took them meanwhile
        (caller holds the lock)."""
        store = self.store
        span = node_slots(record)
        if store.slots.reclaim(span.start, len(span)):
            return
        used = {s for r in store.nodes.values() if r is not record for s in node_slots(r)}
        slot = store.slots.claim(used, len(span))
        log.warning("slot %d of %s is used by another simulated pod; moved it to slot %d",
                    record["sim"]["slot"], name, slot)
        record["sim"]["slot"] = slot
        record["node"]["networkEndpoints"] = endpoints(
            slot, len(record["node"]["networkEndpoints"]),
            external=(record["node"].get("networkConfig") or {}).get("enableExternalIps", True))

    # ------------------------------------------------------------------ bringing up

    def bring_up(self, name: str, delay: float) -> None:
        """CREATING/STARTING -> workers launched and listening -> READY (or the op fails)."""
        store = self.store
        if store.wait(delay):
            return
        with store.lock:
            record = store.nodes.get(name)
            if record is None or record["node"]["state"] not in BRING_UP_STATES:
                return
            failure = record["sim"].pop("failure", None)
            if failure:
                store.finish_operation(record["sim"].get("op"), error=(8, failure))
                store.forget_node(name)
                store.refresh_queued(record["node"].get("queuedResource"))
                store.save()
                return
            node_id = record["node"]["id"]
            specs = self.specs(record["node"])
            keys = self.oslogin.login_keys(record)
            snapshot = copy(record)
        try:
            with store.node_lock(node_id):
                with store.lock:  # a delete or preempt may have come first
                    current = store.nodes.get(name)
                    if current is None or current["node"]["id"] != node_id or \
                            current["node"]["state"] not in BRING_UP_STATES:
                        return
                self.oslogin.apply(snapshot)  # before sshd starts: its config depends on it
                store.workers.start_node(node_id, specs, keys,
                                         delay=store.settings.worker_start_delay)
                self.guest.open_metadata(node_id, specs)
                store.workers.wait_listening(node_id, timeout=store.settings.listen_timeout)
                self.start_bastion(name, specs, snapshot)
                host_keys = store.workers.host_keys(node_id)
                for _ in range(5):  # metadata may have changed while the workers started
                    with store.lock:
                        current = self.oslogin.login_keys(store.nodes.get(name, record))
                    if current == keys:
                        break
                    store.workers.sync_keys(node_id, current)
                    keys = current
        except Exception as exc:
            if store.stopping.is_set():
                return  # the daemon is going down; resume() finishes this next time
            log.exception("workers of %s did not start", name)
            with store.lock:
                record = store.nodes.get(name)
                if record is None or record["node"]["id"] != node_id or \
                        record["node"]["state"] not in BRING_UP_STATES:
                    return
                record["node"]["state"] = "UNKNOWN"
                record["node"]["health"] = "TIMEOUT"
                record["node"]["healthDescription"] = f"The simulated workers did not start: {exc}"
                store.finish_operation(record["sim"].pop("op", None), error=(
                    13, f"The simulated workers of {name} did not start: {exc}"))
                store.save()
            return
        with store.lock:
            record = store.nodes.get(name)
            if record is None or record["node"]["id"] != node_id or \
                    record["node"]["state"] not in BRING_UP_STATES:
                return  # deleted or changed meanwhile; that operation owns the workers now
            record["sim"]["hostKeys"] = {str(i): k for i, k in host_keys.items()}
            record["sim"].pop("notices", None)  # a new boot: no notice pending
            record["node"]["state"] = "READY"
            record["node"]["health"] = "HEALTHY"
            record["node"].pop("healthDescription", None)
            store.finish_operation(record["sim"].pop("op", None), response=record["node"])
            store.refresh_queued(record["node"].get("queuedResource"))
            store.save()
        self.guest.booted(name, node_id, specs)

    def restart_workers(self, name: str) -> None:
        """After a daemon restart: a READY node's workers again (same addresses, host keys)."""
        store = self.store
        try:
            with store.lock:
                record = store.nodes.get(name)
                if record is None or record["node"]["state"] != "READY":
                    return
                node_id = record["node"]["id"]
                specs = self.specs(record["node"])
                keys = self.oslogin.login_keys(record)
                snapshot = copy(record)
            with store.node_lock(node_id):
                self.oslogin.apply(snapshot)
                store.workers.start_node(node_id, specs, keys, delay=0.0)
                self.guest.open_metadata(node_id, specs)
                store.workers.wait_listening(node_id, timeout=store.settings.listen_timeout)
                self.start_bastion(name, specs, snapshot)
                host_keys = store.workers.host_keys(node_id)
            with store.lock:
                record = store.nodes.get(name)
                if record is not None:
                    record["sim"]["hostKeys"] = {str(i): k for i, k in host_keys.items()}
                    store.save()
            self.guest.booted(name, node_id, specs)
        except Exception:
            log.exception("could not restart the workers of %s", name)
        finally:
            with store.lock:
                self.resuming -= 1

    # ------------------------------------------------------------------ stopping, deleting

    def finish_stop(self, name: str) -> None:
        """STOPPING -> the workers stopped (disks kept) -> STOPPED."""
        store = self.store
        if store.wait(store.settings.operation_delay):
            return
        with store.lock:
            record = store.nodes.get(name)
            if record is None or record["node"]["state"] != "STOPPING":
                return
            node_id = record["node"]["id"]
        with store.node_lock(node_id):
            self.guest.close_metadata(node_id)
            store.workers.stop_node(node_id)
            self.network_down(node_id)
        with store.lock:
            record = store.nodes.get(name)
            if record is None or record["node"]["state"] != "STOPPING":
                return
            record["node"]["state"] = "STOPPED"
            record["node"].pop("health", None)
            store.finish_operation(record["sim"].pop("op", None), response=record["node"])
            store.save()

    def tear_down(self, node_id: str) -> None:
        """What a deleted node leaves on this machine: its metadata servers, workers, network."""
        with self.store.node_lock(node_id):
            self.guest.close_metadata(node_id)
            self.store.workers.delete_node(node_id)
            self.network_down(node_id, delete=True)

    def finish_delete(self, name: str) -> None:
        """DELETING -> the workers torn down -> the record gone, its operation done."""
        store = self.store
        if store.wait(store.settings.operation_delay):
            return
        with store.lock:
            record = store.nodes.get(name)
            if record is None or record["node"]["state"] != "DELETING":
                return
            node_id = record["node"]["id"]
        self.tear_down(node_id)
        with store.lock:
            current = store.nodes.get(name)
            if current is None or current["node"]["id"] != node_id:
                return  # made again meanwhile (backing.py sets a deleting one aside)
            record = store.forget_node(name)
            if record is None:
                return
            store.finish_operation(record["sim"].get("op"), response_type="Empty")
            store.refresh_queued(record["node"].get("queuedResource"))
            store.save()

    def finish_update(self, name: str, op_name: str, keys_changed: bool) -> None:
        """After a metadata change: the workers' keys (and OS Login) synced, then the
        operation ``op_name`` done."""
        store = self.store
        if store.wait(store.settings.operation_delay):
            return
        with store.lock:
            record = store.nodes.get(name)
            if record is None:
                store.finish_operation(op_name, error=(5, f"Resource '{name}' was not found"))
                store.save()
                return
            node_id = record["node"]["id"]
            ready = record["node"]["state"] == "READY"
            keys = self.oslogin.login_keys(record)
            snapshot = copy(record)
        if keys_changed and ready:
            with store.node_lock(node_id):
                self.oslogin.apply(snapshot)  # enable-oslogin may have changed
                store.workers.sync_keys(node_id, keys)
                if store.network is not None:
                    store.network.sync_keys(snapshot["node"],
                                            self.oslogin.bastion_keys(snapshot))
        with store.lock:
            record = store.nodes.get(name)
            store.finish_operation(op_name, response=record["node"] if record else {})
            store.save()

    # ------------------------------------------------------------------ preemption, faults

    def preempt(self, name: str, notice: float = 0.0) -> dict[str, Any]:
        """Preempt a node: PREEMPTED, workers stopped; it stays until deleted.

        With ``notice`` seconds, the workers' metadata says ``instance/preempted: TRUE`` at
        once, and the preemption follows after the notice; the call returns at once with the
        node still READY.
        """
        store = self.store
        if notice > 0:
            with store.lock:
                record = store.require_node(name)
                if record["node"]["state"] != "READY":
                    raise ApiFailure("FAILED_PRECONDITION",
                                     f"Node {name} is {record['node']['state']}; only a READY "
                                     "node can be given a preemption notice.")
                notices = record["sim"].setdefault("notices", {})
                notices.update(preempted=True, preemptAt=time.time() + notice)
                store.save()
            store.spawn(self._preempt_after_notice, name, notice)
            return store.node(name)["node"]
        with store.lock:
            record = store.require_node(name)
            state = record["node"]["state"]
            if state not in ("READY", *BRING_UP_STATES):
                raise ApiFailure("FAILED_PRECONDITION",
                                 f"Node {name} is {state}; only a running node can be "
                                 "preempted.")
            record["node"]["state"] = "PREEMPTED"
            record["node"].pop("health", None)
            store.finish_operation(record["sim"].pop("op", None),
                                   error=(10, f"Node {name} was preempted."))
            node_id = record["node"]["id"]
            store.refresh_queued(record["node"].get("queuedResource"))
            store.save()
        with store.node_lock(node_id):
            self.guest.close_metadata(node_id)
            store.workers.stop_node(node_id)
            self.network_down(node_id)
        return store.node(name)["node"]

    def _preempt_after_notice(self, name: str, notice: float) -> None:
        store = self.store
        if store.wait(notice):
            return
        with store.lock:
            record = store.nodes.get(name)
            if record is None or record["node"]["state"] != "READY" or \
                    not (record["sim"].get("notices") or {}).get("preempted"):
                return
        self.preempt(name)

    def worker_of(self, name: str, body: dict[str, Any]) -> tuple[str, int]:
        """(node id, worker) of an admin request's ``worker`` on node ``name``."""
        with self.store.lock:
            record = self.store.require_node(name)
            hosts = len(record["node"]["networkEndpoints"])
            node_id = record["node"]["id"]
        try:
            worker = int(body.get("worker"))
        except (TypeError, ValueError):
            raise ApiFailure("INVALID_ARGUMENT", "worker (an integer) is required.") from None
        if not 0 <= worker < hosts:
            raise ApiFailure("INVALID_ARGUMENT",
                             f"Worker {worker} is out of range; node {name} has workers "
                             f"0..{hosts - 1}.")
        return node_id, worker

    def set_reachable(self, name: str, body: dict[str, Any]) -> dict[str, Any]:
        node_id, worker = self.worker_of(name, body)
        reachable = bool(body.get("reachable", False))
        self.store.workers.set_reachable(node_id, worker, reachable)
        return {"node": name, "worker": worker, "reachable": reachable}

    def set_slow(self, name: str, body: dict[str, Any]) -> dict[str, Any]:
        from tpufab.sim import slow

        node_id, worker = self.worker_of(name, body)
        share = float(body.get("share") or 0.0)
        if not 0 <= share <= slow.MAX_SHARE:
            raise ApiFailure("INVALID_ARGUMENT", f"share {share} is outside 0-{slow.MAX_SHARE}.")
        slow.set_slow(self.store.workers, node_id, worker, share)
        return {"node": name, "worker": worker, "share": share}

    def kill_sshd(self, name: str, body: dict[str, Any]) -> dict[str, Any]:
        node_id, worker = self.worker_of(name, body)
        self.store.workers.kill_sshd(node_id, worker)
        return {"node": name, "worker": worker, "sshd": "killed"}

    def admin_view(self, name: str) -> dict[str, Any]:
        """/sim/v1/<node>: the record with each worker's address, hostname and liveness."""
        record = self.store.node(name)
        running = self.store.workers.running(record["node"]["id"])
        return {"node": record["node"], "slot": record["sim"]["slot"],
                "workers": [{"index": w, "ip": e["ipAddress"],
                             "hostname": worker_hostname(record["node"]["id"], w),
                             "running": bool(running.get(w, False))}
                            for w, e in enumerate(record["node"]["networkEndpoints"])]}

    # ------------------------------------------------------------------ internal IPs

    def start_bastion(self, name: str, specs: list[Any], snapshot: dict[str, Any]) -> None:
        """An internal-IP node's jump host (sim/network.py), once its workers listen: a VM of
        the node's project, so the project's OS Login decides which keys it takes, asked
        through its own metadata server as on the workers."""
        store = self.store
        if store.network is None:
            return
        with store.lock:
            record = store.nodes.get(name)
            node = copy(record["node"]) if record else None
        spec = store.network.bastion_spec(node, specs) if node is not None else None
        if spec is None:
            return
        bastion = self.oslogin.bastion_record(snapshot)
        accounts = (self.oslogin.accounts(node["name"].split("/")[1])
                    if self.oslogin.enabled_for(bastion) else None)
        self.guest.open_metadata(node["id"] + BASTION_SUFFIX, [spec])
        store.network.start_bastion(node, specs, self.oslogin.bastion_keys(snapshot),
                                    os_login=accounts)

    def network_down(self, node_id: str, *, delete: bool = False) -> None:
        """After a node's workers stopped: its bastion and network namespace, if it has them."""
        if self.store.network is not None:
            self.guest.close_metadata(node_id + BASTION_SUFFIX)
            self.store.network.stop(node_id, delete=delete)
