"""Compute Engine, where TPU7x and later exist (and v5p/v6e by choice), through the official
client (`google-cloud-compute`, imported on first call).

A TPU VM there is an ordinary instance of a TPU machine type; a multi-host slice is a zonal
managed instance group (MIG) whose workload policy (HIGH_THROUGHPUT, acceleratorTopology)
sets the ICI shape, its VMs made from an instance template. To the rest of tpufab each is a
``Node``: a lone instance is a one-worker node named after it; a MIG with such a policy is a
node named after the group whose workers are its VMs, in worker order; a MIG without one is
independent single-host slices (Google's "TPU instances in MIGs"), so each of its VMs is a
one-worker node and the group's name is refused in one sentence. ``create_node`` takes the TPU
API's body (``bodies.node_body``) and translates it; the policy and template it makes are
named ``NAME-tpufab-wp`` / ``NAME-tpufab-tt`` and described as made by tpufab for NAME in its
zone, so ``delete_node`` removes them only then, never while another group uses them, and
``leftovers`` only when no slice of that name exists in any zone. Every failure leaves as one
sentence (``calls.translate``) under the one retry policy.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from tpufab.cloud.nodes import Node, QueuedResourceInfo, WorkerEndpoint
from tpufab.cloud.planes.base import ControlPlane
from tpufab.cloud.planes.calls import (
    Action,
    QuotaExceeded,
    RetriesExhausted,
    RetryPolicy,
    Stockout,
    call_with_retries,
    credentials_error,
    exhausted_sentence,
    translate,
)
from tpufab.cloud.planes.compute_made import MadeForSlices
from tpufab.cloud.planes.compute_parts import (
    MACHINE_TYPES,
    MULTISLICE_LABEL,
    SLICE_LABEL,
    SLICE_POLICY,
    STATES,
    WORKER_KEY,
    RestReader,
    compute_endpoint,
    created,
    flex_start_ended,
    independent_vms,
    instance_properties,
    made_by,
    make_clients,
    mig_short,
    owner_of,
    region_of,
    reword,
    short,
    type_of,
    worker_order,
)
from tpufab.config import Settings
from tpufab.errors import ApiError, ConfigError, NotFound, TpufabError
from tpufab.topology import all_accelerator_types, parse_accelerator_type

if TYPE_CHECKING:
    from rich.console import Console

    from tpufab.topology import Topology

T = TypeVar("T")


class ComputeEngine(MadeForSlices, ControlPlane):
    """Compute Engine v1 for one project and zone. ``clients`` and ``sleep`` are test seams."""

    name = "compute"
    aliases = ("gce", "compute-engine", "ce")
    title = full_title = "Compute Engine"
    node_kind = "Compute Engine TPU slice"

    def __init__(self, settings: Settings, *, clients: Any = None,
                 retry: RetryPolicy | None = None,
                 on_retry: Callable[[BaseException, int, float], None] | None = None,
                 sleep: Callable[[float], None] = time.sleep):
        super().__init__(settings, on_retry=on_retry)
        self.endpoint = compute_endpoint(settings)
        self.region = self.zone.rsplit("-", 1)[0]
        self.retry = retry or RetryPolicy.from_settings(settings)
        self._sleep = sleep
        self._clients = clients
        self.rest = RestReader(self.endpoint, self.project)
        self.missing: dict[str, list[tuple[str, str]]] = {}   # MIG -> [(VM, why)] (_members)
        self.numbers: dict[str, dict[str, int]] = {}  # MIG -> {VM: worker} (_members)

    @classmethod
    def offers(cls, topology: Topology) -> bool:
        return cls.name in topology.planes and bool(topology.machine_type)

    @classmethod
    def not_offered(cls, topology: Topology) -> str:
        return (f"{topology.name} is not offered on Compute Engine (it has no TPU machine type "
                "there); drop --on compute, or pick a v5p, v6e or TPU7x type of `tpufab "
                "types` (ON: compute).")

    # -- plumbing

    @property
    def c(self) -> Any:
        if self._clients is None:
            self._clients = make_clients(self.endpoint)
        return self._clients

    def _action(self, verb: str, name: str | None = None,
                accelerator_type: str | None = None, kind: str = "node") -> Action:
        target = f"Compute Engine TPU slice {name!r}" if name else "Compute Engine TPU VMs"
        return Action(verb=verb, target=target, permission=f"compute.instances.{verb}",
                      name=name, kind=kind, accelerator_type=accelerator_type, zone=self.zone,
                      project=self.project)

    def _call(self, action: Action, fn: Callable[..., T], /, **kwargs: Any) -> T:
        """One API call under the retry policy; every failure leaves as one sentence."""
        def attempt() -> T:
            return fn(**kwargs, retry=None, timeout=float(self.settings.api_timeout))

        try:
            return call_with_retries(attempt, self.retry, on_retry=self.on_retry,
                                     sleep=self._sleep)
        except RetriesExhausted as err:
            raise reword(exhausted_sentence(err, self.endpoint)) from err.__cause__
        except TpufabError:
            raise
        except Exception as exc:
            translated = credentials_error(exc) or translate(exc, action, self.endpoint)
            raise reword(translated) from exc

    def _op_name(self, op: Any) -> str:
        if op.zone:
            return f"zones/{short(op.zone)}/operations/{op.name}"
        if op.region:
            return f"regions/{short(op.region)}/operations/{op.name}"
        return f"global/operations/{op.name}"

    def _get_op(self, op_name: str, action: Action) -> Any:
        scope, where, _, name = (op_name.split("/") + ["", "", "", ""])[:4]
        if scope == "zones":
            return self._call(action, self.c.zone_ops.get, project=self.project, zone=where,
                              operation=name)
        if scope == "regions":
            return self._call(action, self.c.region_ops.get, project=self.project,
                              region=where, operation=name)
        return self._call(action, self.c.global_ops.get, project=self.project,
                          operation=op_name.rsplit("/", 1)[-1])

    def _wait(self, op_name: str, action: Action, timeout: float | None = None) -> None:
        """Wait (bounded) for an operation; its error as one sentence."""
        deadline = time.monotonic() + (timeout or self.settings.wait_timeout)
        delay = 0.1
        while not self.operation_done(op_name, action.verb, name=action.name,
                                      accelerator_type=action.accelerator_type):
            if time.monotonic() > deadline:
                raise ApiError(f"Compute Engine did not finish {action.verb} of "
                               f"{action.target} in time; check it with `tpufab describe "
                               f"--name {action.name}`.")
            self._sleep(delay)
            delay = min(2.0, delay * 1.5)

    # -- reading

    def _slice_shape(self, group: Any) -> str | None:
        """The chip shape of a MIG that is one multi-host slice: its workload policy is
        HIGH_THROUGHPUT with an accelerator topology. None for any other MIG: its VMs are
        independent single-host slices, not connected by ICI (docs/control-plane.md)."""
        url = group.resource_policies.workload_policy if group.resource_policies else ""
        if not url:
            return None
        policy = self._call(self._action("get"), self.c.policies.get, project=self.project,
                            region=region_of(url) or self.region, resource_policy=short(url))
        workload = policy.workload_policy
        if workload.type_ != SLICE_POLICY or not workload.accelerator_topology:
            return None
        return workload.accelerator_topology

    def _instances(self) -> list[Any]:
        def fetch(**kw: Any) -> list:
            return list(self.c.instances.list(project=self.project, zone=self.zone, **kw))

        return self._call(self._action("list"), fetch)

    def _instance_node(self, inst: Any, group: str = "") -> Node:
        """A lone VM as a one-worker node; ``group``: the MIG without a slice's workload
        policy it belongs to (one of its independent single-host slices)."""
        machine = short(inst.machine_type)
        accel = type_of(machine, None, 1)
        state = STATES.get(inst.status, inst.status)
        if inst.status == "TERMINATED" and inst.scheduling.provisioning_model == "SPOT":
            state = "PREEMPTED"  # a spot VM Compute Engine stopped: preempted
        node = self._node(inst.name, str(inst.id), accel, "", [inst], inst,
                          created_at=inst.creation_timestamp, state=state)
        node.compute_group = group
        return node

    def _group_node(self, group: Any, members: list[Any], topology: str) -> Node:
        template_url = group.instance_template
        sample = members[0] if members else None
        machine = short(sample.machine_type) if sample is not None else ""
        scheduling = sample.scheduling if sample is not None else None
        if not machine and template_url:
            template = self._call(self._action("get"), self.c.templates.get,
                                  project=self.project, instance_template=short(template_url))
            machine = template.properties.machine_type
            scheduling = template.properties.scheduling
        model = scheduling.provisioning_model if scheduling is not None else ""
        run = int(scheduling.max_run_duration.seconds) \
            if scheduling is not None and scheduling.max_run_duration else 0
        ended = not members and not group.target_size and model == "FLEX_START"
        accel = type_of(machine, topology, group.target_size)
        running = [m for m in members if m.status == "RUNNING"]
        if not members and group.target_size:
            state = "CREATING"
        elif len(running) == group.target_size and members:
            state = "READY"
        elif any(m.status == "TERMINATED" for m in members):
            state = "PREEMPTED" if any(m.scheduling.provisioning_model == "SPOT"
                                       for m in members) else "STOPPED"
        elif ended:   # its maxRunDuration ran out: Compute Engine deleted the VMs
            state = "TERMINATED"
        elif group.target_size == 0:
            state = "STOPPED"
        else:
            state = "CREATING"
        numbers = self.numbers.get(group.name, {})
        ordered = worker_order(members, numbers)
        node = self._node(group.name, str(group.id), accel, topology, ordered, sample,
                          created_at=group.creation_timestamp, state=state, per_vm=True)
        node.compute_group = group.name
        node.compute_template = short(template_url)
        node.compute_policy = short(group.resource_policies.workload_policy)
        node.provisioning_model = model or node.provisioning_model
        node.max_run_duration = run
        if ended:
            node.condition = flex_start_ended(group.name, accel, run)
        missing = [(vm, why) for vm, why in self.missing.get(group.name, []) if why]
        if missing and state != "READY":
            node.condition = mig_short(group.name, len(members), group.target_size, missing)
        unnumbered = [m.name for m in ordered if m.name not in numbers]
        if len(ordered) > 1 and unnumbered:
            node.order_note = (
                f"{group.name}'s workers are numbered by internal IP: its MIG keeps no worker "
                f"number for {', '.join(unnumbered)} (the per-instance configs `tpufab "
                "create` writes once the slice is up; a create stopped before that, or a "
                "slice made by hand, has none), so a VM the MIG recreates at another IP "
                f"can change places; `tpufab create --name {group.name} --type {accel}` "
                "keeps the numbers they have now.")
        return node

    def _node(self, name: str, ident: str, accel: str, topology: str, members: list[Any],
              sample: Any, *, created_at: str, state: str, per_vm: bool = False) -> Node:
        """``per_vm``: a MIG's VMs, each worker carrying its instance id (``host_id``: its
        host key is pinned by it; a lone VM's id is the node's)."""
        workers = []
        for i, m in enumerate(members):
            nic = m.network_interfaces[0] if m.network_interfaces else None
            internal = nic.network_i_p if nic else ""
            external = (nic.access_configs[0].nat_i_p or None) if nic and nic.access_configs \
                else None
            workers.append(WorkerEndpoint(index=i, internal_ip=internal, external_ip=external,
                                          host_id=str(m.id or "") if per_vm else ""))
        metadata = {item.key: item.value for item in sample.metadata.items} \
            if sample is not None and sample.metadata else {}
        model = sample.scheduling.provisioning_model if sample is not None else ""
        reserved = bool(sample is not None and sample.reservation_affinity and
                        sample.reservation_affinity.consume_reservation_type ==
                        "SPECIFIC_RESERVATION")
        node = Node(name=name, project=self.project, zone=self.zone, accelerator_type=accel,
                    state=state, id=ident, chip_topology=topology, workers=workers,
                    spot=model == "SPOT", reserved=reserved,
                    labels=dict(sample.labels) if sample is not None else {},
                    metadata=metadata, created=created(created_at),
                    external_ips=any(w.external_ip for w in workers) or not workers,
                    runtime_version=short(sample.machine_type) if sample is not None else "",
                    runtime_label="machine type")
        node.provisioning_model = model or "STANDARD"
        if node.labels.get(MULTISLICE_LABEL):   # one slice of a multislice (`--name NAME-0`)
            node.multislice = True
            node.slice_index = int(node.labels.get(SLICE_LABEL, "0") or 0)
        return self.stamp(node)

    def _members(self, group_name: str, instances: list[Any] | None = None) -> list[Any]:
        def fetch(**kw: Any) -> list:
            return list(self.c.groups.list_managed_instances(
                project=self.project, zone=self.zone, instance_group_manager=group_name, **kw))

        managed = self._call(self._action("get", group_name), fetch)
        names = {m.name or short(m.instance) for m in managed}
        pool = instances if instances is not None else self._instances()
        found = [i for i in pool if i.name in names]
        have = {i.name for i in found}
        self.numbers[group_name] = {}   # the worker numbers tpufab recorded at create
        for m in managed:
            kept = m.preserved_state_from_config.metadata \
                if m.preserved_state_from_config else {}
            if str(kept.get(WORKER_KEY, "")).isdigit():
                self.numbers[group_name][m.name or short(m.instance)] = int(kept[WORKER_KEY])
        self.missing[group_name] = [   # VMs the MIG is still trying to create, and why
            (m.name or short(m.instance), "; ".join(
                e.message or e.code for e in m.last_attempt.errors.errors)
             if m.last_attempt and m.last_attempt.errors else "")
            for m in managed if (m.name or short(m.instance)) not in have]
        return found

    def get_node(self, name: str) -> Node:
        group = self._group_safe(name)
        if group is not None:
            topology = self._slice_shape(group)
            members = self._members(name)
            if topology is None:
                raise independent_vms(name, self.zone, [m.name for m in members])
            return self._group_node(group, members, topology)
        inst = self._call(self._action("get", name), self.c.instances.get,
                          project=self.project, zone=self.zone, instance=name)
        if short(inst.machine_type) not in MACHINE_TYPES:
            raise NotFound(f"Compute Engine instance {name!r} in {self.zone} is no TPU VM "
                           f"(machine type {short(inst.machine_type)}); name a TPU VM or "
                           "a TPU slice's managed instance group.")
        owner = owner_of(inst)
        group = self._group_safe(owner) if owner else None
        if group is not None and self._slice_shape(group) is not None:
            raise ConfigError(f"{name!r} is one VM of the Compute Engine TPU slice {owner} "
                              "(its VMs are one ICI-connected slice, driven together): name "
                              f"the slice, `--name {owner}`.")
        return self._instance_node(inst, owner if group is not None else "")

    def _group_safe(self, name: str, zone: str | None = None) -> Any | None:
        from google.api_core import exceptions as gexc

        def fetch(**kw: Any) -> Any:
            try:
                return self.c.groups.get(project=self.project, zone=zone or self.zone,
                                         instance_group_manager=name, **kw)
            except gexc.NotFound:
                return None

        return self._call(self._action("get", name), fetch)

    def list_nodes(self) -> list[Node]:
        instances = self._instances()

        def fetch(**kw: Any) -> list:
            return list(self.c.groups.list(project=self.project, zone=self.zone, **kw))

        groups = self._call(self._action("list"), fetch)
        nodes, in_groups = [], set()
        for group in groups:
            members = self._members(group.name, instances)
            in_groups |= {m.name for m in members}
            if members and short(members[0].machine_type) not in MACHINE_TYPES:
                continue
            topology = self._slice_shape(group)
            if topology is None:   # independent single-host slices: each VM its own pod
                nodes += [self._instance_node(m, group.name) for m in members]
                continue
            nodes.append(self._group_node(group, members, topology))
        for inst in instances:
            if inst.name in in_groups or owner_of(inst) or \
                    short(inst.machine_type) not in MACHINE_TYPES:
                continue
            nodes.append(self._instance_node(inst))
        return nodes

    def holds(self, name: str) -> bool:
        """Whether a TPU VM or a TPU MIG is called ``name``: plain REST reads
        (no google-cloud-compute to import), the check every verb makes of Compute Engine
        for a Cloud TPU API node's name."""
        def tpu_template(url: str) -> bool:
            found = self._call(self._action("get", name), self.rest.get,
                               path=f"global/instanceTemplates/{short(url)}")
            return found is not None and short(
                found.get("properties", {}).get("machineType", "")) in MACHINE_TYPES

        group = self._call(self._action("get", name), self.rest.get,
                           path=f"zones/{self.zone}/instanceGroupManagers/{name}")
        if group is not None:
            return tpu_template(group.get("instanceTemplate", ""))
        inst = self._call(self._action("get", name), self.rest.get,
                          path=f"zones/{self.zone}/instances/{name}")
        return inst is not None and short(inst.get("machineType", "")) in MACHINE_TYPES

    def has_multislice(self, name: str) -> bool:
        """Whether ``NAME-0`` is a MIG whose template says it is slice 0 of multislice
        ``name`` (one or two plain REST reads)."""
        group = self._call(self._action("get", name), self.rest.get,
                           path=f"zones/{self.zone}/instanceGroupManagers/{name}-0")
        if group is None:
            return False
        url = group.get("instanceTemplate", "")
        template = self._call(self._action("get", name), self.rest.get,
                              path=f"global/instanceTemplates/{short(url)}")
        labels = (template or {}).get("properties", {}).get("labels") or {}
        return labels.get(MULTISLICE_LABEL) == name

    def multislice(self, name: str) -> list[Node]:
        """The slices of the multislice called ``name`` (MIGs labelled by ``create
        --num-slices``), in slice order; [] if there is none."""
        nodes = [n for n in self.list_nodes() if n.labels.get(MULTISLICE_LABEL) == name]
        return sorted(nodes, key=lambda n: (n.slice_index or 0, n.name))

    # -- creating

    def create_pod(self, settings: Settings, *, queued: bool, num_slices: int, async_: bool,
                   console: Console, reservation: str | None,
                   topology: str | None) -> list[Node]:
        """A VM, a slice (policy + template + MIG) or a multislice, waited for (tpufab/cloud/
        planes/compute_create.py)."""
        from tpufab.cloud.planes.compute_create import create

        return create(self, settings, queued=queued, num_slices=num_slices, async_=async_,
                      console=console, reservation=reservation, topology=topology)

    def create_node(self, name: str, body: dict) -> str:
        """Create a TPU VM (one host) or a slice (workload policy + template + MIG); returns
        the operation to wait for."""
        v1 = self.c.v1
        props, machine, type_name = instance_properties(v1, body)
        topo = parse_accelerator_type(type_name)
        action = self._action("create", name, type_name)
        if topo.hosts == 1:
            instance = v1.Instance(
                name=name, machine_type=f"zones/{self.zone}/machineTypes/{machine}",
                labels=props.labels, metadata=props.metadata,
                network_interfaces=props.network_interfaces, scheduling=props.scheduling,
                disks=props.disks, reservation_affinity=props.reservation_affinity,
                service_accounts=props.service_accounts)
            op = self._call(action, self.c.instances.insert_unary, project=self.project,
                            zone=self.zone, instance_resource=instance)
            return self._op_name(op)
        from tpufab.topology import default_dims, format_dims

        shape = body.get("chip_topology") or format_dims(default_dims(topo))
        policy, template = f"{name}-tpufab-wp", f"{name}-tpufab-tt"
        made = made_by(name, self.zone)
        self.removed = []   # what an earlier slice of the name left (autostop deletes the MIG)
        self._delete_template(template, name)
        self._delete_policy(policy, name)
        op = self._call(action, self.c.policies.insert_unary, project=self.project,
                        region=self.region, resource_policy_resource=v1.ResourcePolicy(
                            name=policy, description=made,
                            workload_policy=v1.ResourcePolicyWorkloadPolicy(
                                type_=SLICE_POLICY, accelerator_topology=shape)))
        self._wait(self._op_name(op), action, timeout=300)
        try:
            op = self._call(action, self.c.templates.insert_unary, project=self.project,
                            instance_template_resource=v1.InstanceTemplate(
                                name=template, description=made, properties=props))
            self._wait(self._op_name(op), action, timeout=300)
            try:
                op = self._call(action, self.c.groups.insert_unary, project=self.project,
                                zone=self.zone,
                                instance_group_manager_resource=v1.InstanceGroupManager(
                                    name=name, base_instance_name=name, description=made,
                                    instance_template=f"projects/{self.project}/global/"
                                    f"instanceTemplates/{template}",
                                    target_size=topo.hosts,
                                    resource_policies=v1.InstanceGroupManagerResourcePolicies(
                                        workload_policy=f"projects/{self.project}/regions/"
                                        f"{self.region}/resourcePolicies/{policy}")))
            except Exception:
                self._delete_template(template, name)
                raise
        except Exception:
            self._delete_policy(policy, name)
            raise
        return self._op_name(op)

    def record_worker_order(self, name: str) -> bool:
        """Keep each VM's worker number of slice ``name`` (its order now: by internal IP, as
        the VMs came up) in the MIG's per-instance configs (stateful metadata
        ``tpufab-worker``), which a MIG keeps for a VM through recreation and autohealing, so
        a VM recreated at another internal IP keeps its number. False for a lone VM."""
        node = self.get_node(name)
        if node.compute_group != node.name or not node.workers:
            return False
        v1 = self.c.v1
        by_ip = {m.network_interfaces[0].network_i_p: m.name for m in self._members(name)
                 if m.network_interfaces}
        configs = [v1.PerInstanceConfig(name=by_ip[w.internal_ip], preserved_state=(
            v1.PreservedState(metadata={WORKER_KEY: str(w.index)})))
            for w in node.workers if w.internal_ip in by_ip]
        action = self._action("update", name)
        op = self._call(
            action, self.c.groups.update_per_instance_configs_unary, project=self.project,
            zone=self.zone, instance_group_manager=name,
            instance_group_managers_update_per_instance_configs_req_resource=(
                v1.InstanceGroupManagersUpdatePerInstanceConfigsReq(
                    per_instance_configs=configs)))
        self._wait(self._op_name(op), action, timeout=300)
        return True

    def restore_worker_order(self, node: Node) -> bool:
        """A slice whose MIG keeps no worker numbers (``node.order_note``: a create stopped
        before it wrote them, or a slice made by hand): keep the ones it has now."""
        return bool(node.order_note) and self.record_worker_order(node.name)

    def watchdog(self, node: Node) -> dict[str, Any]:
        """The URL autostop's watchdog re-reads and DELETEs: the slice's MIG, else the VM.
        The template and policy tpufab made outlive the MIG (the watchdog's VM goes with it):
        `tpufab gc` and the next create of the name remove them."""
        if node.compute_group and node.compute_group != node.name:
            raise ConfigError(f"{node.name} is one VM of the managed instance group "
                              f"{node.compute_group}, which recreates a VM deleted by itself, "
                              "so autostop cannot stop it alone; resize or delete the group "
                              "with gcloud instead.")
        kind, target = ("instanceGroupManagers", node.compute_group) if node.compute_group \
            else ("instances", node.name)
        return {"target_url": f"{self.rest.base}/zones/{self.zone}/{kind}/{target}",
                "auth": "anonymous" if self.endpoint.startswith("http://") else "metadata"}

    # -- deleting

    def delete_node(self, name: str) -> str:
        """Delete the VM, or the MIG and then the template and policy tpufab made for it
        (left alone when not tpufab's, or another group still uses them)."""
        group = self._group_safe(name)
        action = self._action("delete", name)
        self.removed, self.left_alone = [], []
        if group is None:
            vm = self._call(action, self.rest.get, path=f"zones/{self.zone}/instances/{name}")
            made = next((i.get("value", "") for i in (vm or {}).get("metadata", {})
                         .get("items", []) if i.get("key") == "created-by"), "")
            if "/instanceGroupManagers/" in made:
                raise ConfigError(
                    f"{name} is a VM of the managed instance group {short(made)}, which "
                    "recreates a VM deleted by itself; delete or resize the group with "
                    f"`gcloud compute instance-groups managed delete {short(made)} --zone "
                    f"{self.zone}` (or `resize`).")
            try:
                op = self._call(action, self.c.instances.delete_unary, project=self.project,
                                zone=self.zone, instance=name)
            except NotFound:  # a create interrupted before its MIG: what it made so far
                self._delete_template(f"{name}-tpufab-tt", name)
                self._delete_policy(f"{name}-tpufab-wp", name)
                if self.removed:
                    return ""
                raise
            return self._op_name(op)
        template = short(group.instance_template)
        policy = short(group.resource_policies.workload_policy
                       if group.resource_policies else "")
        op = self._call(action, self.c.groups.delete_unary, project=self.project,
                        zone=self.zone, instance_group_manager=name)
        op_name = self._op_name(op)
        self._wait(op_name, action)
        self.left_alone = [x for x in (self._delete_template(template, name),
                                       self._delete_policy(policy, name)) if x]
        return op_name

    # -- metadata and host keys

    def _vm_names(self, name: str) -> list[str]:
        node = self.get_node(name)
        if node.compute_group == node.name:   # a slice: its VMs, in worker order
            by_ip = {m.network_interfaces[0].network_i_p: m.name for m in self._members(name)}
            return [by_ip[w.internal_ip] for w in node.workers if w.internal_ip in by_ip]
        return [name]

    def update_metadata(self, name: str, metadata: dict[str, str]) -> str:
        v1 = self.c.v1
        op_name = ""
        action = self._action("update", name)
        for vm in self._vm_names(name):
            inst = self._call(action, self.c.instances.get, project=self.project,
                              zone=self.zone, instance=vm)
            keep = {i.key: i.value for i in inst.metadata.items
                    if i.key in ("created-by", "instance-template")}
            items = [v1.Items(key=k, value=v) for k, v in sorted({**metadata, **keep}.items())]
            op = self._call(action, self.c.instances.set_metadata_unary, project=self.project,
                            zone=self.zone, instance=vm, metadata_resource=v1.Metadata(
                                fingerprint=inst.metadata.fingerprint, items=items))
            op_name = self._op_name(op)
            if vm != name:
                self._wait(op_name, action)
        return op_name

    def host_keys(self, name: str, workers: list[int] | None = None) -> dict[int, dict[str, str]]:
        from google.api_core import exceptions as gexc

        vms = self._vm_names(name)
        wanted = workers if workers is not None else list(range(len(vms)))
        keys: dict[int, dict[str, str]] = {}
        for index in wanted:
            if index >= len(vms):
                continue

            def fetch(vm: str = vms[index], **kw: Any) -> Any:
                try:  # query_path is no keyword of the method: only in the request
                    return self.c.instances.get_guest_attributes(request={
                        "project": self.project, "zone": self.zone, "instance": vm,
                        "query_path": "hostkeys/"}, **kw)
                except gexc.NotFound:
                    return None

            found = {}
            attrs = self._call(self._action("get", name), fetch)
            for item in attrs.query_value.items if attrs is not None else []:
                if item.key.startswith(("ssh-", "ecdsa-")):
                    value = item.value.strip()
                    found[item.key] = value if value.startswith(item.key) \
                        else f"{item.key} {value}"
            keys[index] = found
        return keys

    # -- queued resources: none on Compute Engine (flex-start is a provisioning model)

    def create_queued_resource(self, name: str, body: dict) -> str:
        raise ConfigError("Queued resources belong to the Cloud TPU API; on Compute Engine "
                          "ask for flex-start capacity with --flex-start --max-run-duration 8h "
                          "instead.")

    def get_queued_resource(self, name: str) -> QueuedResourceInfo:
        raise NotFound(f"No queued resource named {name!r}: Compute Engine has none.")

    def list_queued_resources(self) -> list[QueuedResourceInfo]:
        return []

    def delete_queued_resource(self, name: str, *, force: bool = True) -> str:
        raise NotFound(f"No queued resource named {name!r}: Compute Engine has none.")

    # -- operations and catalogue

    def operation_done(self, op_name: str, verb: str = "create", *,
                       kind: str = "node", name: str | None = None,
                       accelerator_type: str | None = None) -> bool:
        if not op_name:  # nothing was left to wait for
            return True
        action = self._action(verb, name, accelerator_type)
        op = self._get_op(op_name, action)
        done = op.status == self.c.v1.Operation.Status.DONE
        if done and op.error and op.error.errors:
            first = op.error.errors[0]
            where = f"in {self.zone} (project {self.project})"
            shape = accelerator_type or "TPU"
            if first.code in ("ZONE_RESOURCE_POOL_EXHAUSTED", "STOCKOUT",
                              "ZONE_RESOURCE_POOL_EXHAUSTED_WITH_DETAILS"):
                raise Stockout(f"No {shape} capacity is available {where} right now "
                               f"(stockout: {first.message.rstrip('. ')}); try --spot, "
                               "--flex-start --max-run-duration 8h, or another --zone.")
            if first.code == "QUOTA_EXCEEDED" or "quota" in first.message.lower():
                raise QuotaExceeded(
                    f"Not enough quota to {verb} {action.target} ({shape}) {where}: "
                    f"{first.message.rstrip('. ')}; request more TPU quota for this zone in "
                    "the Cloud console (IAM & Admin > Quotas), or try --spot or another "
                    "--zone.")
            raise ApiError(f"Compute Engine failed to {verb} {action.target} "
                           f"({first.code}: {first.message.rstrip('. ')}).")
        return done

    def list_operations(self) -> list[dict[str, Any]]:
        return []

    def zones(self) -> list[str]:
        return [self.zone]

    def accelerator_types(self) -> list[str]:
        return all_accelerator_types(self.name)
