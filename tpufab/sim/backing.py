"""The node records behind Compute Engine VMs: a standalone TPU VM is backed by
``projects/P/locations/Z/ceInstances/NAME`` (one worker), a MIG slice by ``.../ceGroups/MIG``
(one worker per VM). Their workers come up, stop, are recreated and deleted as a TPU API
node's do (machines.py); the Cloud TPU API never shows these records.

A handler of the emulator over the shared store; the Compute Engine emulator
(tpufab/sim/compute_*.py) drives it, always holding the store's lock.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from tpufab.sim._model import CONFIG_TYPE_OF_GENERATION, ApiFailure, worker_address
from tpufab.sim._slots import WORKERS_PER_SLOT, node_slots
from tpufab.sim.machines import Machines
from tpufab.sim.store import SimStore
from tpufab.topology import Topology, default_dims, format_dims

log = logging.getLogger("tpufab.sim")


class BackingNodes:
    """Create, stop, start, recreate and delete the records behind Compute Engine VMs."""

    def __init__(self, store: SimStore, machines: Machines):
        self.store = store
        self.machines = machines

    def create(self, name: str, topo: Topology, *, metadata: dict[str, str],
               labels: dict[str, str], scheduling: dict[str, Any], external: bool,
               names: list[str], accelerator_topology: str | None = None
               ) -> tuple[str, str] | None:
        """The node record behind Compute Engine VMs (caller holds the lock): workers
        brought up as for a TPU API node. Returns the (reason, message) the create will end
        with (an injected stockout, or quota), else None."""
        store = self.store
        model = scheduling.get("provisioningModel")
        node_in = {"acceleratorType": topo.name, "runtimeVersion": "compute-engine-vm",
                   "metadata": dict(metadata), "labels": dict(labels),
                   "networkConfig": {"enableExternalIps": external},
                   "schedulingConfig": {"spot": True} if model == "SPOT" else {},
                   "instanceNames": list(names)}
        if not accelerator_topology and topo.generation not in CONFIG_TYPE_OF_GENERATION:
            accelerator_topology = format_dims(default_dims(topo))  # TPU7x: 2x2x1 ...
        if accelerator_topology:  # what the VMs' tpu-env says (TOPOLOGY, HOST_BOUNDS)
            node_in["acceleratorConfig"] = {"type": topo.generation.upper(),
                                            "topology": accelerator_topology}
        self.machines.check_capacity([topo])
        self._set_aside(name)
        _, node = self.machines.new_node(name, node_in, "v2", topo=topo)
        failure = store.take_create_failure(name, topo)
        store.nodes[name] = {"node": node, "sim": self.machines.sim_fields(
            node, None, failure[1] if failure else None)}
        store.save()
        store.spawn(self.machines.bring_up, name, store.settings.create_delay)
        return failure

    def create_vm(self, name: str, machine_type: str, *, metadata: dict[str, str],
                  labels: dict[str, str], scheduling: dict[str, Any], external: bool,
                  names: list[str], account: dict[str, Any] | None = None) -> None:
        """The node record behind a general-purpose VM (caller holds the lock): one worker
        with sshd, a metadata server and a service account, and no TPU (no device files,
        no TPU attributes), whose init honours its own systemd units (worker_init.py)."""
        store = self.store
        model = scheduling.get("provisioningModel")
        node_in = {"runtimeVersion": "compute-engine-vm", "metadata": dict(metadata),
                   "labels": dict(labels), "networkConfig": {"enableExternalIps": external},
                   "schedulingConfig": {"spot": True} if model == "SPOT" else {},
                   "instanceNames": list(names)}
        if account:  # the instance's service account: what its metadata server names
            node_in["serviceAccount"] = {"email": account.get("email") or "default",
                                         "scope": list(account.get("scopes") or [])}
        problem = store.workers.capacity_problem(machine_type, 1)
        if problem:
            raise ApiFailure("FAILED_PRECONDITION", problem)
        self._set_aside(name)
        _, node = self.machines.new_node(name, node_in, "v2", machine_type=machine_type)
        store.nodes[name] = {"node": node, "sim": self.machines.sim_fields(node, None, None)}
        store.save()
        store.spawn(self.machines.bring_up, name, store.settings.create_delay)

    def _set_aside(self, name: str) -> None:
        """A record of this name still being deleted (a MIG resized to 0, then up again at
        once) moves to a name of its own, so its teardown still finds it and its addresses
        stay taken until its workers are gone: the new record gets others, and nothing is
        left listening (caller holds the lock)."""
        store = self.store
        old = store.nodes.get(name)
        if old is None:
            return
        if old["node"]["state"] != "DELETING":
            raise ApiFailure("ALREADY_EXISTS", f"Resource '{name}' already exists")
        aside = f"{name}~{old['node']['id']}"
        store.nodes[aside] = store.nodes.pop(name)
        store.spawn(self.machines.finish_delete, aside)

    def delete(self, name: str) -> None:
        """Delete a VM's backing node (caller holds the lock); gone once torn down."""
        store = self.store
        record = store.nodes.get(name)
        if record is None or record["node"]["state"] == "DELETING":
            return
        record["node"]["state"] = "DELETING"
        store.save()
        store.spawn(self.machines.finish_delete, name)

    def stop(self, name: str) -> None:
        store = self.store
        record = store.require_node(name)
        if record["node"]["state"] != "READY":
            raise ApiFailure("FAILED_PRECONDITION", f"The instance is "
                             f"{record['node']['state']}; only a running one can be stopped.")
        record["node"]["state"] = "STOPPING"
        store.save()
        store.spawn(self.machines.finish_stop, name)

    def start(self, name: str) -> None:
        store = self.store
        record = store.require_node(name)
        if record["node"]["state"] not in ("STOPPED", "PREEMPTED"):
            raise ApiFailure("FAILED_PRECONDITION", f"The instance is "
                             f"{record['node']['state']}; only a stopped one can be started.")
        record["node"]["state"] = "STARTING"
        store.save()
        store.spawn(self.machines.bring_up, name, store.settings.operation_delay)

    def set_metadata(self, name: str, items: dict[str, str],
                     done: Callable[[], None]) -> None:
        """Replace a VM's metadata (caller holds the lock); ``done()`` once keys synced."""
        store = self.store
        record = store.require_node(name)
        record["node"]["metadata"] = dict(items)
        store.save()

        def sync() -> None:
            self.machines.finish_update(name, "", True)
            done()

        store.spawn(sync)

    def recreate_worker(self, name: str, worker: int) -> None:
        """Recreate the VM that is worker ``worker`` of backing node ``name`` (a MIG's
        recreateInstances; caller holds the lock). It keeps its place in the slice (its worker
        number, what its metadata server's agent-worker-number and tpu-env say) and comes back
        from a new boot disk (a new host key) at another internal IP: a MIG VM without a
        stateful IP gets a new ephemeral one (Google's "Configuring stateful IP addresses in
        MIGs"). Here that is the next free address of the node's own slots."""
        store = self.store
        record = store.require_node(name)
        if record["node"]["state"] != "READY":
            raise ApiFailure("FAILED_PRECONDITION", f"The instance is "
                             f"{record['node']['state']}; only a running one is recreated.")
        node_endpoints = record["node"]["networkEndpoints"]
        used = {e["ipAddress"] for e in node_endpoints}
        span = node_slots(record)
        fresh = next((worker_address(span.start, k)
                      for k in range(len(node_endpoints), len(span) * WORKERS_PER_SLOT)
                      if worker_address(span.start, k) not in used),
                     node_endpoints[worker]["ipAddress"])  # a full slot: the address it had
        node_endpoints[worker]["ipAddress"] = fresh
        if node_endpoints[worker].get("accessConfig"):
            node_endpoints[worker]["accessConfig"]["externalIp"] = fresh
        record["sim"].setdefault("recreating", {})[str(worker)] = True
        record["sim"].get("hostKeys", {}).pop(str(worker), None)
        store.save()
        store.spawn(self.finish_recreate, name, record["node"]["id"], worker)

    def reset_worker(self, name: str, worker: int) -> None:
        """Reset the VM that is worker ``worker`` of backing node ``name`` (instances.reset;
        caller holds the lock): its processes end and it boots again, with its files, address
        and host key."""
        store = self.store
        record = store.require_node(name)
        record["sim"].setdefault("resetting", {})[str(worker)] = True
        store.save()
        store.spawn(self.finish_recreate, name, record["node"]["id"], worker, False)

    def finish_recreate(self, name: str, node_id: str, worker: int,
                        new_disk: bool = True) -> None:
        """The recreated VM's worker: its old files gone (``new_disk``; a reset keeps them),
        started again at its address."""
        store = self.store
        if store.wait(store.settings.operation_delay):
            return
        with store.lock:
            record = store.nodes.get(name)
            if record is None or record["node"]["id"] != node_id:
                return
            specs = self.machines.specs(record["node"])
            keys = self.machines.oslogin.login_keys(record)
        try:
            with store.node_lock(node_id):
                if new_disk:
                    store.workers.remove_worker(node_id, worker)
                else:
                    store.workers.end_worker(node_id, worker)
                store.workers.start_node(node_id, specs, keys,
                                         delay=store.settings.worker_start_delay)
                self.machines.guest.open_metadata(node_id, specs)  # the worker's new address
                store.workers.wait_listening(node_id, timeout=store.settings.listen_timeout)
                host_keys = store.workers.host_keys(node_id)
        except Exception as exc:
            if store.stopping.is_set():
                return
            log.exception("worker %d of %s was not recreated", worker, name)
            with store.lock:
                record = store.nodes.get(name)
                if record is not None and record["node"]["id"] == node_id:
                    record["node"]["state"] = "UNKNOWN"
                    record["node"]["healthDescription"] = (
                        f"The simulated worker {worker} was not recreated: {exc}")
                    store.save()
            return
        with store.lock:
            record = store.nodes.get(name)
            if record is None or record["node"]["id"] != node_id:
                return
            record["sim"]["hostKeys"] = {str(i): k for i, k in host_keys.items()}
            done = "recreating" if new_disk else "resetting"
            record["sim"].get(done, {}).pop(str(worker), None)
            store.save()
        self.machines.guest.booted(name, node_id, [s for s in specs if s.index == worker])
