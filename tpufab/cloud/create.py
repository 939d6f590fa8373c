"""Creating on a control plane that makes nodes and queued resources (the Cloud TPU API's
way, and any plane built the same way): check what is there, send the request, wait until
READY (ACTIVE for a queued resource) with a live status line. Operations are idempotent: a
READY node of the same type only gets the tpufab SSH key into its metadata. What another
plane's own create path shares comes from here too (``existing_node``, ``wait_node``)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from tpufab.cloud.bodies import node_body, queued_resource_body, scheduling_tier
from tpufab.cloud.names import validate_name
from tpufab.cloud.nodes import DEAD_STATES, Node, QueuedResourceInfo
from tpufab.cloud.planes.calls import AlreadyExists
from tpufab.cloud.waiting import elapsed, escape, wait_for
from tpufab.config import Settings
from tpufab.errors import ApiError, ConfigError, TpufabError
from tpufab.ssh import keys as sshkeys
from tpufab.topology import parse_accelerator_type, slice_shape

if TYPE_CHECKING:
    from rich.console import Console

    from tpufab.cloud.planes.base import ControlPlane


def create_nodes(control: ControlPlane, settings: Settings, *, queued: bool = False,
                 num_slices: int = 1, async_: bool = False, console: Console,
                 reservation: str | None = None, topology: str | None = None) -> list[Node]:
    """Node ``settings.name`` (or a queued resource: ``queued``, several slices, a
    reservation) on ``control``, waited for; the node(s) as last seen."""
    num_slices = num_slices or 1
    queued = queued or num_slices > 1   # several slices only exist as a queued resource
    name = validate_name(settings.name, num_slices=num_slices)
    accelerator = settings.require("type", "--type")
    chip_topology = slice_shape(accelerator, topology).text if topology else None
    shape = parse_accelerator_type(accelerator)
    settings.project = settings.require("project")
    scheduling_tier(settings)
    entry = sshkeys.metadata_entry(settings.ssh_user, sshkeys.ensure_key(settings.ssh_key_path))
    where = f"{settings.zone} (project {settings.project})"

    kind = "queued resource" if queued else "TPU node"
    if queued:
        existing_qr = control.find_queued_resource(name)
        if existing_qr is not None:
            try:
                return existing_queued(control, existing_qr, settings, shape.name, entry,
                                       async_=async_, console=console)
            except KeyboardInterrupt:
                raise interrupted_create(kind, name, where, shape.name) from None
    existing = control.find_node(name)
    if existing is not None:
        same_topology(existing, chip_topology)
        try:
            return existing_node(control, existing, settings, shape.name, entry,
                                 async_=async_, console=console)
        except KeyboardInterrupt:
            raise interrupted_create("TPU node", name, where, shape.name) from None

    slices = f" x {num_slices} slices" if num_slices > 1 else ""
    as_shape = f" as {chip_topology}" if chip_topology else ""
    console.print(f"Creating {kind} [bold]{name}[/bold] ({shape.name}{as_shape}{slices}, "
                  f"{hosts_text(shape.hosts)}{' per slice' if num_slices > 1 else ''}, "
                  f"{scheduling_tier(settings)}) "
                  f"in {escape(where)}.")
    try:
        return create_and_wait(control, settings, name, shape.name, entry, queued=queued,
                               num_slices=num_slices, async_=async_, console=console,
                               reservation=reservation, chip_topology=chip_topology)
    except KeyboardInterrupt:
        raise interrupted_create(kind, name, where, shape.name) from None


def interrupted_create(kind: str, name: str, where: str, type_name: str) -> TpufabError:
    """Ctrl-C while a create is under way: the node goes on coming up (and is billed once
    READY) whether we wait or not. Say so, and how to be rid of it."""
    return TpufabError(
        f"Interrupted: {kind} {name} may still be coming up in {where} (billed once it is "
        f"READY). Delete it with `tpufab delete --name {name} --yes`, or wait for it with "
        f"`tpufab create --name {name} --type {type_name}` again.", exit_code=130)


def create_and_wait(control: ControlPlane, settings: Settings, name: str, type_name: str,
                    entry: str, *, queued: bool, num_slices: int, async_: bool,
                    console: Console, reservation: str | None = None,
                    chip_topology: str | None = None) -> list[Node]:
    """Send the create request, then wait for READY/ACTIVE (unless ``async_``)."""
    try:
        if queued:
            body = queued_resource_body(settings, num_slices=num_slices, ssh_entry=entry,
                                        reservation=reservation,
                                        chip_topology=chip_topology)
            op = control.create_queued_resource(name, body)
        else:
            op = control.create_node(name, node_body(settings, ssh_entry=entry,
                                                     chip_topology=chip_topology))
    except AlreadyExists:
        # created meanwhile (by another tpufab, or by our own request before a retried 503)
        if queued and (existing_qr := control.find_queued_resource(name)) is not None:
            return existing_queued(control, existing_qr, settings, type_name, entry,
                                   async_=async_, console=console)
        if (existing := control.find_node(name)) is not None:
            return existing_node(control, existing, settings, type_name, entry,
                                 async_=async_, console=console)
        raise

    if async_:
        console.print(f"Not waiting (--async); follow it with `tpufab describe --name {name}`.")
        node = control.find_node(name) if not queued or num_slices == 1 else None
        return [node] if node else []
    if queued:
        return wait_queued(control, name, op, settings, console=console)
    return [wait_node(control, name, settings, console=console, op=op,
                      accelerator_type=type_name)]


def same_topology(node: Node, chip_topology: str | None) -> None:
    if chip_topology and node.chip_topology and node.chip_topology != chip_topology:
        raise ConfigError(f"TPU node {node.name!r} already exists with topology "
                          f"{node.chip_topology}, not {chip_topology}; delete it first "
                          f"(`tpufab delete --name {node.name}`) or pick another --name.")


def wait_node(control: ControlPlane, name: str, settings: Settings, *, console: Console,
              op: str | None = None, accelerator_type: str | None = None) -> Node:
    started = time.monotonic()
    seen: dict[str, Node | None] = {"node": None}
    op_done = op is None

    def dead(node: Node | None) -> None:
        if node is not None and node.state in DEAD_STATES:
            raise ApiError(f"TPU node {name!r} became {node.state} while being created; delete "
                           f"it with `tpufab delete --name {name} --yes` and create it again.")

    def probe() -> tuple[str, bool]:
        nonlocal op_done
        if not op_done:
            try:
                op_done = control.operation_done(op, "create", name=name,
                                                 accelerator_type=accelerator_type)
            except ApiError:
                dead(control.find_node(name))  # say "preempted" rather than "aborted"
                raise
        node = control.find_node(name)
        seen["node"] = node
        if node is None:
            if op_done:
                raise ApiError(f"TPU node {name!r} vanished while being created; run "
                               "`tpufab create` again.")
            return "PENDING", False
        dead(node)
        if node.condition and not node.ready:   # a MIG short of VMs
            short.setdefault("since", time.monotonic())
            if time.monotonic() - short["since"] > settings.mig_short_wait:
                raise ApiError(f"{node.condition.rstrip('.')} (gave up after "
                               f"{elapsed(time.monotonic() - started)}; TPUFAB_MIG_SHORT_WAIT "
                               f"is {settings.mig_short_wait:g} s).")
            want = node.topology.hosts if node.topology else "?"
            return f"{node.state} ({len(node.workers)}/{want} VMs)", False
        short.pop("since", None)
        return node.state, node.ready

    short: dict[str, float] = {}
    wait_for(probe, what=f"TPU node {name}", timeout=settings.wait_timeout, console=console,
             check_hint=f"check it with `tpufab describe --name {name}`, ")
    node = seen["node"]
    assert node is not None
    console.print(f"[green]TPU node [bold]{name}[/bold] is READY[/green] after "
                  f"{elapsed(time.monotonic() - started)}: {summary(node)}.")
    return node


def wait_queued(control: ControlPlane, name: str, op: str | None, settings: Settings, *,
                console: Console) -> list[Node]:
    started = time.monotonic()
    op_done = op is None

    def probe() -> tuple[str, bool]:
        nonlocal op_done
        if not op_done:
            op_done = control.operation_done(op, "create", kind="queued resource", name=name)
        qr = control.find_queued_resource(name)
        if qr is None:
            return "PENDING", False
        if qr.state in ("FAILED", "SUSPENDED"):
            why = f": {qr.failure}" if qr.failure else ""
            raise ApiError(f"Queued resource {name!r} is {qr.state}{why}; delete it with "
                           f"`tpufab delete --name {name} --yes` and try again (maybe --spot or "
                           "another --zone).")
        return qr.state, qr.active

    wait_for(probe, what=f"Queued resource {name}", timeout=settings.wait_timeout,
             console=console, check_hint=f"check it with `tpufab describe --name {name}`, ")
    qr = control.get_queued_resource(name)
    nodes = [control.get_node(node_id) for node_id in qr.node_ids]
    console.print(f"[green]Queued resource [bold]{name}[/bold] is ACTIVE[/green] after "
                  f"{elapsed(time.monotonic() - started)}: "
                  + "; ".join(f"{n.name}: {summary(n)}" for n in nodes) + ".")
    return nodes


def hosts_text(count: int) -> str:
    return f"{count} host{'s' if count != 1 else ''}"


def summary(node: Node) -> str:
    addresses = node.addresses()
    if len(addresses) > 4:  # a 64-host pod: first and last, not a wall of addresses
        ips = f"{addresses[0]} .. {addresses[-1]}; `tpufab describe` lists all"
    else:
        ips = ", ".join(addresses) or "no workers"
    return f"{node.accelerator_type}, {hosts_text(node.hosts)} ({ips})"


def ensure_key(control: ControlPlane, node: Node, entry: str, settings: Settings,
               console: Console) -> bool:
    """Put the ``ssh-keys`` entry into ``node``'s metadata if it lacks it; whether it did."""
    op = control.add_ssh_key(node, entry)
    if op is None:
        return False

    def probe() -> tuple[str, bool]:
        done = control.operation_done(op, "update", name=node.name)
        return ("DONE" if done else "RUNNING"), done

    wait_for(probe, what=f"Adding your SSH key to {node.name}",
             timeout=settings.wait_timeout, console=console)
    node.metadata[sshkeys.SSH_KEYS] = sshkeys.merge_entry(node.metadata.get(sshkeys.SSH_KEYS),
                                                          entry)
    return True


def existing_node(control: ControlPlane, node: Node, settings: Settings, wanted_type: str,
                  entry: str, *, async_: bool, console: Console) -> list[Node]:
    name = node.name
    if node.accelerator_type != wanted_type:
        raise ConfigError(f"TPU node {name!r} already exists as a {node.accelerator_type}, not a "
                          f"{wanted_type}; delete it first (`tpufab delete --name {name}`) or "
                          "pick another --name.")
    if node.preempted:
        raise ApiError(f"TPU node {name!r} exists but was PREEMPTED (it still counts against "
                       f"quota); recover with `tpufab delete --name {name} --yes`, then create it "
                       "again.")
    if node.state in DEAD_STATES:
        raise ApiError(f"TPU node {name!r} exists but is {node.state}; start it with `gcloud "
                       f"compute tpus tpu-vm start {name} --zone {settings.zone}`, or delete it "
                       f"(`tpufab delete --name {name} --yes`) and create it again.")
    if not node.ready:
        console.print(f"TPU node {name} already exists and is {node.state}.")
        if async_:
            return [node]
        node = wait_node(control, name, settings, console=console)
    done = []
    if ensure_key(control, node, entry, settings, console):
        done.append("added your SSH key to its metadata")
    if node.order_note and restore_order(control, node, console):
        node = control.get_node(name)
        done.append("kept its workers' numbers, which it had lost (per-instance configs)")
    console.print(f"TPU node [bold]{name}[/bold] already exists and is READY "
                  f"({summary(node)}); {' and '.join(done) or 'nothing to do'}.")
    return [node]


def restore_order(control: ControlPlane, node: Node, console: Console) -> bool:
    """Have the plane keep ``node``'s worker numbers (``restore_worker_order``); a refusal
    leaves its workers numbered by internal IP, and says so."""
    try:
        return control.restore_worker_order(node)
    except TpufabError as err:
        console.print(f"[yellow]Could not keep {escape(node.name)}'s worker numbers "
                      f"({escape(err)}); its workers stay numbered by internal IP, which a "
                      "recreated VM can change.[/yellow]")
        return False


def existing_queued(control: ControlPlane, qr: QueuedResourceInfo, settings: Settings,
                    wanted_type: str, entry: str, *, async_: bool,
                    console: Console) -> list[Node]:
    name = qr.name
    if qr.accelerator_type and qr.accelerator_type != wanted_type:
        raise ConfigError(f"Queued resource {name!r} already exists for {qr.accelerator_type}, "
                          f"not {wanted_type}; delete it first (`tpufab delete --name {name}`) or "
                          "pick another --name.")
    if qr.state in ("FAILED", "SUSPENDED"):
        why = f" ({qr.failure})" if qr.failure else ""
        raise ApiError(f"Queued resource {name!r} exists but is {qr.state}{why}; delete it with "
                       f"`tpufab delete --name {name} --yes` and create it again.")
    if not qr.active:
        console.print(f"Queued resource {name} already exists and is {qr.state}.")
        if async_:
            return []
        nodes = wait_queued(control, name, None, settings, console=console)
    else:
        nodes = [control.get_node(node_id) for node_id in qr.node_ids]
    preempted = [n.name for n in nodes if n.preempted]
    if preempted:
        raise ApiError(f"Queued resource {name!r} has preempted nodes ({', '.join(preempted)}); "
                       f"recover with `tpufab delete --name {name} --yes`, then create it again.")
    added = [n.name for n in nodes if ensure_key(control, n, entry, settings, console)]
    note = f"added your SSH key to {', '.join(added)}" if added else "nothing to do"
    console.print(f"Queued resource [bold]{name}[/bold] already exists and is ACTIVE "
                  f"({len(nodes)} node{'s' if len(nodes) != 1 else ''}); {note}.")
    return nodes
