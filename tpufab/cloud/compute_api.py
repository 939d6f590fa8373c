"""The second control plane: Compute Engine, where TPU7x and later exist (and v5p/v6e by
choice), through the official client (`google-cloud-compute`, imported on first call).

A TPU VM there is an ordinary instance of a TPU machine type; a multi-host slice is a zonal
managed instance group (MIG) whose workload policy (HIGH_THROUGHPUT, acceleratorTopology)
sets the ICI shape, its VMs made from an instance template. To the rest of tpufab each is a
``Node`` (``plane="compute"``): a lone instance is a one-worker node named after it; a MIG is
a node named after the group whose workers are its VMs, in worker order. ``create_node``
takes the TPU API's body (``controlplane.node_body``) and translates it; the policy and
template it makes are named ``NAME-tpufab-wp`` / ``NAME-tpufab-tt`` and described as made by
tpufab for NAME, so ``delete_node`` removes them only then, and never while another group
uses them. Every failure leaves as one sentence (``controlplane.translate``) under the one
retry policy. Make one with ``tpufab.cloud.lifecycle.control_plane(settings)``.
"""

from __future__ import annotations

import ipaddress
import re
import time
from collections.abc import Callable
from datetime import datetime
from typing import Any, TypeVar

from tpufab.cloud.controlplane import (
    Action,
    ControlPlane,
    QuotaExceeded,
    RetriesExhausted,
    RetryPolicy,
    Stockout,
    _credentials_error,
    _exhausted_sentence,
    call_with_retries,
    translate,
)
from tpufab.cloud.nodes import Node, QueuedResourceInfo, WorkerEndpoint
from tpufab.config import Settings
from tpufab.errors import ApiError, ConfigError, NotFound, TpufabError
from tpufab.topology import GENERATIONS, all_accelerator_types, parse_accelerator_type

T = TypeVar("T")
GOOGLE_COMPUTE = "https://compute.googleapis.com"
MADE_BY = "Made by tpufab for slice "   # the description of a policy/template tpufab made
WORKER_KEY = "tpufab-worker"  # a MIG VM's worker number, kept in its per-instance config
DEFAULT_IMAGE = "projects/ubuntu-os-accelerator-images/global/images/family/" \
                "ubuntu-accel-2204-amd64-tpu-tpu7x"
MACHINE_TYPES = {machine: (gen.name, chips) for gen in GENERATIONS.values()
                 for chips, machine in gen.machine_types}
STATES = {"PROVISIONING": "CREATING", "STAGING": "CREATING", "RUNNING": "READY",
          "STOPPING": "STOPPING", "SUSPENDING": "STOPPING", "SUSPENDED": "STOPPED",
          "TERMINATED": "STOPPED", "REPAIRING": "REPAIRING"}


def compute_endpoint(settings: Settings) -> str:
    """The Compute Engine endpoint (host only): compute_endpoint, else beside api_endpoint
    (an emulator serves both, as the simulated pod does), else Google's."""
    if settings.compute_endpoint:
        return settings.compute_endpoint.rstrip("/").removesuffix("/compute/v1")
    if settings.api_endpoint:
        return settings.api_endpoint.rstrip("/")
    return GOOGLE_COMPUTE


def machine_type_of(type_name: str) -> str:
    topo = parse_accelerator_type(type_name)
    if "compute" not in topo.planes or not topo.machine_type:
        raise ConfigError(f"{topo.name} is not offered on Compute Engine (it has no TPU machine "
                          "type there); drop --on compute, or pick a v5p, v6e or TPU7x type of "
                          "`tpufab types` (ON: compute).")
    return topo.machine_type


def type_of(machine_type: str, accelerator_topology: str | None, vms: int) -> str:
    """The accelerator type of ``vms`` VMs of ``machine_type`` (shaped ``accelerator_topology``)."""
    if machine_type not in MACHINE_TYPES:
        return ""
    generation, chips = MACHINE_TYPES[machine_type]
    gen = GENERATIONS[generation]
    if accelerator_topology:
        total = 1
        for d in accelerator_topology.split("x"):
            total *= int(d) if d.isdigit() else 1
    else:
        total = chips * max(1, vms)
    return f"{generation}-{total * gen.cores_per_chip}"


def _short(url: str) -> str:
    return (url or "").rstrip("/").rsplit("/", 1)[-1]


def _created(text: str) -> datetime | None:
    try:
        return datetime.fromisoformat(text.replace("Z", "+00:00")) if text else None
    except ValueError:
        return None


def _ip_key(ip: str) -> tuple:
    try:
        return (0, int(ipaddress.ip_address(ip)))
    except ValueError:
        return (1, ip)


def parse_run_duration(value: Any) -> int:
    """``"8h"``, ``"90m"``, ``28800`` -> seconds; one sentence otherwise."""
    from tpufab.durations import parse_duration

    seconds = parse_duration(value if isinstance(value, str) else float(value),
                             "--max-run-duration")
    if not seconds or seconds <= 0:
        raise ConfigError("--max-run-duration must be a positive duration such as 8h.")
    return int(seconds)


class ComputeEngine(ControlPlane):
    """Compute Engine v1 for one project and zone. ``clients`` and ``sleep`` are test seams."""

    plane = "compute"

    def __init__(self, settings: Settings, *, clients: Any = None,
                 retry: RetryPolicy | None = None,
                 on_retry: Callable[[BaseException, int, float], None] | None = None,
                 sleep: Callable[[float], None] = time.sleep):
        super().__init__(settings)
        self.endpoint = compute_endpoint(settings)
        self.region = self.zone.rsplit("-", 1)[0]
        self.retry = retry or RetryPolicy.from_settings(settings)
        self.on_retry = on_retry
        self._sleep = sleep
        self._clients = clients
        self.removed: list[str] = []     # what the last delete_node removed beside the MIG
        self.missing: dict[str, list[tuple[str, str]]] = {}   # MIG -> [(VM, why)] (_members)
        self.numbers: dict[str, dict[str, int]] = {}  # MIG -> {VM: worker} (_members)
        self.left_alone: list[str] = []  # ... and what it left, with why

    # -- plumbing

    @property
    def c(self) -> Any:
        if self._clients is None:
            self._clients = self._make_clients()
        return self._clients

    def _make_clients(self) -> Any:
        from google.api_core.client_options import ClientOptions
        from google.cloud import compute_v1

        kw: dict[str, Any] = {"transport": "rest",
                              "client_options": ClientOptions(api_endpoint=self.endpoint)}
        try:
            if self.endpoint.startswith("http://"):
                from google.auth.credentials import AnonymousCredentials

                kw["credentials"] = AnonymousCredentials()

            class Clients:
                v1 = compute_v1
                instances = compute_v1.InstancesClient(**kw)
                groups = compute_v1.InstanceGroupManagersClient(**kw)
                templates = compute_v1.InstanceTemplatesClient(**kw)
                policies = compute_v1.ResourcePoliciesClient(**kw)
                zone_ops = compute_v1.ZoneOperationsClient(**kw)
                region_ops = compute_v1.RegionOperationsClient(**kw)
                global_ops = compute_v1.GlobalOperationsClient(**kw)

            return Clients()
        except Exception as exc:
            translated = _credentials_error(exc)
            if translated is not None:
                raise translated from exc
            raise

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
            raise _reword(_exhausted_sentence(err, self.endpoint)) from err.__cause__
        except TpufabError:
            raise
        except Exception as exc:
            translated = _credentials_error(exc) or translate(exc, action, self.endpoint)
            raise _reword(translated) from exc

    def _op_name(self, op: Any) -> str:
        if op.zone:
            return f"zones/{_short(op.zone)}/operations/{op.name}"
        if op.region:
            return f"regions/{_short(op.region)}/operations/{op.name}"
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

    def _policy_topology(self, url: str) -> str:
        if not url:
            return ""
        policy = self._call(self._action("get"), self.c.policies.get, project=self.project,
                            region=_region_of(url) or self.region, resource_policy=_short(url))
        return policy.workload_policy.accelerator_topology or ""

    def _instances(self) -> list[Any]:
        def fetch(**kw: Any) -> list:
            return list(self.c.instances.list(project=self.project, zone=self.zone, **kw))

        return self._call(self._action("list"), fetch)

    def _instance_node(self, inst: Any) -> Node:
        machine = _short(inst.machine_type)
        accel = type_of(machine, None, 1)
        state = STATES.get(inst.status, inst.status)
        if inst.status == "TERMINATED" and inst.scheduling.provisioning_model == "SPOT":
            state = "PREEMPTED"  # a spot VM Compute Engine stopped: preempted
        return self._node(inst.name, str(inst.id), accel, "", [inst], inst,
                          created=inst.creation_timestamp, state=state)

    def _group_node(self, group: Any, members: list[Any]) -> Node:
        template_url = group.instance_template
        topology = self._policy_topology(group.resource_policies.workload_policy
                                         if group.resource_policies else "")
        sample = members[0] if members else None
        machine = _short(sample.machine_type) if sample is not None else ""
        scheduling = sample.scheduling if sample is not None else None
        if not machine and template_url:
            template = self._call(self._action("get"), self.c.templates.get,
                                  project=self.project, instance_template=_short(template_url))
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
        ordered = worker_order(members, self.numbers.get(group.name, {}))
        node = self._node(group.name, str(group.id), accel, topology, ordered, sample,
                          created=group.creation_timestamp, state=state, per_vm=True)
        node.compute_group = group.name
        node.compute_template = _short(template_url)
        node.compute_policy = _short(group.resource_policies.workload_policy
                                     if group.resource_policies else "")
        node.provisioning_model = model or node.provisioning_model
        node.max_run_duration = run
        if ended:
            node.condition = flex_start_ended(group.name, accel, run)
        missing = [(vm, why) for vm, why in self.missing.get(group.name, []) if why]
        if missing and state != "READY":
            node.condition = mig_short(group.name, len(members), group.target_size, missing)
        return node

    def _node(self, name: str, ident: str, accel: str, topology: str, members: list[Any],
              sample: Any, *, created: str, state: str, per_vm: bool = False) -> Node:
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
                    metadata=metadata, created=_created(created),
                    external_ips=any(w.external_ip for w in workers) or not workers,
                    runtime_version=_short(sample.machine_type) if sample is not None else "")
        node.plane = "compute"
        node.provisioning_model = model or "STANDARD"
        return node

    def _members(self, group_name: str, instances: list[Any] | None = None) -> list[Any]:
        def fetch(**kw: Any) -> list:
            return list(self.c.groups.list_managed_instances(
                project=self.project, zone=self.zone, instance_group_manager=group_name, **kw))

        managed = self._call(self._action("get", group_name), fetch)
        names = {m.name or _short(m.instance) for m in managed}
        pool = instances if instances is not None else self._instances()
        found = [i for i in pool if i.name in names]
        have = {i.name for i in found}
        self.numbers[group_name] = {}   # the worker numbers tpufab recorded at create
        for m in managed:
            kept = m.preserved_state_from_config.metadata \
                if m.preserved_state_from_config else {}
            if str(kept.get(WORKER_KEY, "")).isdigit():
                self.numbers[group_name][m.name or _short(m.instance)] = int(kept[WORKER_KEY])
        self.missing[group_name] = [   # VMs the MIG is still trying to create, and why
            (m.name or _short(m.instance), "; ".join(
                e.message or e.code for e in m.last_attempt.errors.errors)
             if m.last_attempt and m.last_attempt.errors else "")
            for m in managed if (m.name or _short(m.instance)) not in have]
        return found

    def get_node(self, name: str) -> Node:
        group = self._group_safe(name)
        if group is not None:
            return self._group_node(group, self._members(name))
        inst = self._call(self._action("get", name), self.c.instances.get,
                          project=self.project, zone=self.zone, instance=name)
        if _short(inst.machine_type) not in MACHINE_TYPES:
            raise NotFound(f"Compute Engine instance {name!r} in {self.zone} is no TPU VM "
                           f"(machine type {_short(inst.machine_type)}); name a TPU VM or "
                           "a TPU slice's managed instance group.")
        return self._instance_node(inst)

    def _group_safe(self, name: str) -> Any | None:
        from google.api_core import exceptions as gexc

        def fetch(**kw: Any) -> Any:
            try:
                return self.c.groups.get(project=self.project, zone=self.zone,
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
            if members and _short(members[0].machine_type) not in MACHINE_TYPES:
                continue
            nodes.append(self._group_node(group, members))
        for inst in instances:
            created_by = next((i.value for i in inst.metadata.items if i.key == "created-by"),
                              "") if inst.metadata else ""
            if inst.name in in_groups or created_by or \
                    _short(inst.machine_type) not in MACHINE_TYPES:
                continue
            nodes.append(self._instance_node(inst))
        return nodes

    # -- creating

    def _instance_properties(self, name: str, body: dict) -> Any:
        v1 = self.c.v1
        type_name = body.get("accelerator_type") or _config_type(body)
        machine = machine_type_of(type_name)
        metadata = dict(body.get("metadata") or {})
        network = body.get("network_config") or {}
        nic = v1.NetworkInterface()
        if network.get("network"):
            nic.network = network["network"]
        if network.get("subnetwork"):
            nic.subnetwork = network["subnetwork"]
        if network.get("enable_external_ips", True):
            nic.access_configs = [v1.AccessConfig(name="External NAT", type_="ONE_TO_ONE_NAT")]
        scheduling = v1.Scheduling(on_host_maintenance="TERMINATE", automatic_restart=False)
        if (body.get("scheduling_config") or {}).get("spot"):
            scheduling.provisioning_model = "SPOT"
            scheduling.instance_termination_action = "DELETE"
        if body.get("flex_start"):
            scheduling.provisioning_model = "FLEX_START"
            scheduling.max_run_duration = v1.Duration(
                seconds=parse_run_duration(body.get("max_run_duration")))
            scheduling.instance_termination_action = "DELETE"
        props = v1.InstanceProperties(
            machine_type=machine, labels={**dict(body.get("labels") or {}), "tpufab": "yes"},
            metadata=v1.Metadata(items=[v1.Items(key=k, value=v)
                                        for k, v in sorted(metadata.items())]),
            network_interfaces=[nic], scheduling=scheduling,
            disks=[v1.AttachedDisk(boot=True, auto_delete=True, initialize_params=(
                v1.AttachedDiskInitializeParams(source_image=DEFAULT_IMAGE,
                                                disk_size_gb=100)))])
        if body.get("reservation"):
            props.reservation_affinity = v1.ReservationAffinity(
                consume_reservation_type="SPECIFIC_RESERVATION",
                key="compute.googleapis.com/reservation-name",
                values=[body["reservation"]])
        if body.get("service_account"):
            props.service_accounts = [v1.ServiceAccount(
                email=body["service_account"]["email"],
                scopes=list(body["service_account"].get("scope") or []))]
        return props, machine, type_name

    def create_node(self, name: str, body: dict) -> str:
        """Create a TPU VM (one host) or a slice (workload policy + template + MIG); returns
        the operation to wait for."""
        v1 = self.c.v1
        props, machine, type_name = self._instance_properties(name, body)
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
        made = MADE_BY + name
        self.removed = []   # what an earlier slice of the name left (autostop deletes the MIG)
        self._delete_template(template, name)
        self._delete_policy(policy, name)
        op = self._call(action, self.c.policies.insert_unary, project=self.project,
                        region=self.region, resource_policy_resource=v1.ResourcePolicy(
                            name=policy, description=made,
                            workload_policy=v1.ResourcePolicyWorkloadPolicy(
                                type_="HIGH_THROUGHPUT", accelerator_topology=shape)))
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
        """Keep each VM's worker number of MIG ``name`` (its order now: by internal IP, as
        the VMs came up) in the MIG's per-instance configs (stateful metadata
        ``tpufab-worker``), which a MIG keeps for a VM through recreation and autohealing, so
        a VM recreated at another internal IP keeps its number. False for a lone VM."""
        node = self.get_node(name)
        if not node.compute_group or not node.workers:
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

    # -- deleting

    def delete_node(self, name: str) -> str:
        """Delete the VM, or the MIG and then the template and policy tpufab made for it
        (left alone when not tpufab's, or another group still uses them)."""
        group = self._group_safe(name)
        action = self._action("delete", name)
        self.removed, self.left_alone = [], []
        if group is None:
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
        template = _short(group.instance_template)
        policy = _short(group.resource_policies.workload_policy
                        if group.resource_policies else "")
        op = self._call(action, self.c.groups.delete_unary, project=self.project,
                        zone=self.zone, instance_group_manager=name)
        op_name = self._op_name(op)
        self._wait(op_name, action)
        self.left_alone = [x for x in (self._delete_template(template, name),
                                       self._delete_policy(policy, name)) if x]
        return op_name

    def _delete_template(self, template: str, slice_name: str) -> str | None:
        """Delete a template tpufab made for ``slice_name``; else why it stays (a phrase)."""
        from google.api_core import exceptions as gexc

        if not template:
            return None
        try:
            found = self.c.templates.get(project=self.project, instance_template=template)
            if found.description != MADE_BY + slice_name:
                return f"instance template {template} (not made by tpufab for it)"
            op = self.c.templates.delete_unary(project=self.project,
                                               instance_template=template)
            self._wait(self._op_name(op), self._action("delete", slice_name), timeout=120)
            self.removed.append(f"instance template {template}")
        except gexc.NotFound:
            return None
        except (gexc.GoogleAPICallError, TpufabError) as err:
            return f"instance template {template} ({_reword_text(str(err))})"
        return None

    def _delete_policy(self, policy: str, slice_name: str) -> str | None:
        from google.api_core import exceptions as gexc

        if not policy:
            return None
        try:
            found = self.c.policies.get(project=self.project, region=self.region,
                                        resource_policy=policy)
            if found.description != MADE_BY + slice_name:
                return f"workload policy {policy} (not made by tpufab for it)"
            op = self.c.policies.delete_unary(project=self.project, region=self.region,
                                              resource_policy=policy)
            self._wait(self._op_name(op), self._action("delete", slice_name), timeout=120)
            self.removed.append(f"workload policy {policy}")
        except gexc.NotFound:
            return None
        except (gexc.GoogleAPICallError, TpufabError) as err:
            return f"workload policy {policy} ({_reword_text(str(err))})"
        return None

    def leftovers(self) -> list[tuple[str, str, str]]:
        """Instance templates and workload policies tpufab made for a slice whose MIG is gone
        (autostop deletes the MIG from one of its VMs, which goes with it):
        ``(kind, name, slice)``, kind ``instance template`` or ``workload policy``."""
        def fetch(client: Any, **where: Any) -> Callable[..., list]:
            return lambda **kw: list(client.list(project=self.project, **where, **kw))

        listing = self._action("list")
        groups = {g.name for g in self._call(listing, fetch(self.c.groups, zone=self.zone))}
        found = []
        templates = self._call(listing, fetch(self.c.templates))
        policies = self._call(listing, fetch(self.c.policies, region=self.region))
        for kind, items in (("instance template", templates), ("workload policy", policies)):
            for item in items:
                owner = (item.description or "").removeprefix(MADE_BY)
                if (item.description or "").startswith(MADE_BY) and owner not in groups and \
                        item.name == f"{owner}-tpufab-{'tt' if 'template' in kind else 'wp'}":
                    found.append((kind, item.name, owner))
        return sorted(found)

    def delete_leftover(self, kind: str, name: str, slice_name: str) -> str | None:
        """Delete one of ``leftovers()``; None when deleted, else why it stays (a phrase)."""
        self.removed = []
        if kind == "instance template":
            return self._delete_template(name, slice_name)
        return self._delete_policy(name, slice_name)

    # -- metadata and host keys

    def _vm_names(self, name: str) -> list[str]:
        node = self.get_node(name)
        if getattr(node, "compute_group", None):
            members = self._members(name)
            ips = [w.internal_ip for w in node.workers]
            by_ip = {m.network_interfaces[0].network_i_p: m.name for m in members}
            return [by_ip[ip] for ip in ips if ip in by_ip]
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
            if first.code == "QUOTA_EXCEEDED" or re.search("quota", first.message, re.I):
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
        return all_accelerator_types("compute")


def worker_order(members: list[Any], numbers: dict[str, int]) -> list[Any]:
    """A MIG's VMs in worker order: by the worker number tpufab kept for each in the MIG's
    per-instance configs (``record_worker_order``), else, for a VM without one (a slice
    made by hand), by internal IP after them."""
    def key(m: Any) -> tuple:
        ip = m.network_interfaces[0].network_i_p if m.network_interfaces else ""
        number = numbers.get(m.name)
        return (0, number, _ip_key(ip)) if number is not None else (1, 0, _ip_key(ip))

    return sorted(members, key=key)


def mig_short(name: str, have: int, want: int, missing: list[tuple[str, str]]) -> str:
    """The sentence for a MIG stuck below its size (Compute Engine could not create VMs)."""
    vms = ", ".join(vm for vm, _ in missing)
    why = missing[0][1].rstrip(".")
    stockout = "resources" in why or "RESOURCE_POOL_EXHAUSTED" in why
    fix = ("wait for capacity (the MIG keeps trying), or `tpufab delete --name "
           f"{name} --yes` and create it in another --zone or with --spot" if stockout else
           f"see `gcloud compute instance-groups managed list-instances {name}`, or `tpufab "
           f"delete --name {name} --yes` and create it again")
    return (f"{name} has {have}/{want} VMs: Compute Engine could not create {vms} ({why}); "
            f"{fix}.")


def flex_start_ended(name: str, accel: str, seconds: int) -> str:
    """The sentence for a flex-start slice whose maximum run duration ran out."""
    from tpufab.durations import human_duration

    run = human_duration(seconds) if seconds else "?"
    return (f"Flex-start slice {name} ended: its maximum run duration ({run}) ran out and "
            f"Compute Engine deleted its VMs; for another run, `tpufab delete --name {name} "
            f"--yes`, then `tpufab create --name {name} --type {accel} --flex-start "
            f"--max-run-duration {run}`.")


def _config_type(body: dict) -> str:
    config = body.get("accelerator_config") or {}
    raise ConfigError(f"No accelerator type in the request ({config}).")


def _region_of(url: str) -> str:
    m = re.search(r"/regions/([^/]+)/", url or "")
    return m.group(1) if m else ""


def _reword_text(text: str) -> str:
    return (text.replace("The TPU API", "Compute Engine").replace("the TPU API", "Compute "
                                                                  "Engine")
            .replace("TPU API", "Compute Engine API"))


def _reword(err: TpufabError) -> TpufabError:
    """The shared sentences name the TPU API; these calls went to Compute Engine."""
    text = _reword_text(str(err))
    if text == str(err):
        return err
    new = type(err)(text)
    if hasattr(err, "exit_code"):
        try:
            new.exit_code = err.exit_code
        except AttributeError:
            pass
    return new
