"""Compute Engine's create path (``ComputeEngine.create_pod``): a TPU VM, a slice (workload
policy + instance template + MIG) or several slices as one multislice, checked before any
call, waited for until every VM is RUNNING; a failure or Ctrl-C deletes what this create made,
and says so (docs/control-plane.md)."""

from __future__ import annotations

import re
import time
from dataclasses import replace
from typing import TYPE_CHECKING

from tpufab.cloud.bodies import node_body, scheduling_tier
from tpufab.cloud.create import existing_node, same_topology, wait_node
from tpufab.cloud.names import validate_name
from tpufab.cloud.nodes import Node
from tpufab.cloud.planes.compute_parts import (
    MULTISLICE_LABEL,
    SLICE_LABEL,
    machine_type_of,
    parse_run_duration,
)
from tpufab.cloud.waiting import escape
from tpufab.config import Settings
from tpufab.errors import ApiError, ConfigError, TpufabError
from tpufab.ssh import keys as sshkeys
from tpufab.topology import default_dims, format_dims, parse_accelerator_type, slice_shape

if TYPE_CHECKING:
    from rich.console import Console

    from tpufab.cloud.planes.base import ControlPlane as ComputeEngine  # the plane of VMs


def create(control: ComputeEngine, settings: Settings, *, queued: bool, num_slices: int,
           async_: bool, console: Console, reservation: str | None,
           topology: str | None) -> list[Node]:
    if (num_slices or 1) > 1 and not queued:
        return create_multislice(control, settings, num_slices=num_slices, async_=async_,
                                 console=console, reservation=reservation, topology=topology)
    return [create_one(control, settings, queued=queued, num_slices=num_slices,
                       async_=async_, console=console, reservation=reservation,
                       topology=topology)]


def create_one(control: ComputeEngine, settings: Settings, *, queued: bool, num_slices: int,
               async_: bool, console: Console, reservation: str | None,
               topology: str | None) -> Node:
    """Create a Compute Engine TPU VM or slice (policy + template + MIG) and wait until every
    VM is RUNNING and reachable; on failure or Ctrl-C delete what this create made, and say
    so."""
    if queued or (num_slices or 1) > 1:
        raise ConfigError("Queued resources belong to the Cloud TPU API; on Compute Engine "
                          "capacity that waits in line is --flex-start --max-run-duration 8h "
                          "(and --num-slices N makes N slices as one multislice).")
    name = validate_name(settings.name)
    accelerator = settings.require("type", "--type")
    machine = machine_type_of(accelerator)
    chip_topology = slice_shape(accelerator, topology).text if topology else None
    shape = parse_accelerator_type(accelerator)
    settings.project = settings.require("project")
    tier = scheduling_tier(settings)
    if tier in ("preemptible", "reserved") and not (tier == "reserved" and reservation):
        raise ConfigError(f"--{tier} is a Cloud TPU API tier; on Compute Engine use --spot, "
                          "--flex-start or --reservation NAME.")
    if settings.flex_start and not settings.max_run_duration:
        raise ConfigError("--flex-start needs --max-run-duration (how long the slice may run, "
                          "e.g. --max-run-duration 8h); Compute Engine deletes it at the end.")
    if settings.max_run_duration and not settings.flex_start:
        raise ConfigError("--max-run-duration goes with --flex-start; add --flex-start or "
                          "drop --max-run-duration.")
    if settings.flex_start:
        parse_run_duration(settings.max_run_duration)
    paid = [f for f, on in (("--spot", settings.spot), ("--flex-start", settings.flex_start),
                            ("--reservation", bool(reservation))) if on]
    if len(paid) > 1:
        raise ConfigError(f"{' and '.join(paid)} cannot be combined; pick one way to pay for "
                          "the TPU.")
    entry = sshkeys.metadata_entry(settings.ssh_user, sshkeys.ensure_key(settings.ssh_key_path))
    where = f"{settings.zone} (project {settings.project})"
    existing = control.find_node(name)
    if existing is not None:
        same_topology(existing, chip_topology)
        return existing_node(control, existing, settings, shape.name, entry, async_=async_,
                             console=console)[0]
    body = node_body(settings, ssh_entry=entry)
    body.update(chip_topology=chip_topology, flex_start=settings.flex_start,
                max_run_duration=settings.max_run_duration, reservation=reservation)
    how = "FLEX_START" if settings.flex_start else "SPOT" if settings.spot else \
        f"reservation {reservation}" if reservation else "on-demand"
    made = (f"a managed instance group of {shape.hosts} VMs with workload policy "
            f"{chip_topology or format_dims(default_dims(shape))}" if shape.hosts > 1
            else "one VM instance")
    console.print(f"Creating Compute Engine TPU slice [bold]{name}[/bold] ({shape.name}, "
                  f"{escape(made)} of {machine}, {how}) in {escape(where)}.")
    started = False
    try:
        try:
            op = control.create_node(name, body)
        except ApiError as err:
            if reservation and re.search(r"reservations/\S+' was not found", str(err)):
                raise ConfigError(
                    f"No reservation named {reservation!r} in {where}; list yours with "
                    "`gcloud compute reservations list`, or drop --reservation.") from None
            raise
        started = True
        if async_:
            console.print(f"Not waiting (--async); follow it with `tpufab describe --name "
                          f"{name}`.")
            return control.find_node(name) or control.stamp(
                Node(name, settings.project, settings.zone, shape.name, "CREATING"))
        node = wait_node(control, name, settings, console=console, op=op,
                         accelerator_type=shape.name)
        keep_worker_order(control, node, console)
        return node
    except KeyboardInterrupt:  # perhaps half-way through the policy, template and MIG
        gone = discard(control, name, True)
        raise TpufabError(f"Interrupted: {gone[0].upper()}{gone[1:]}", exit_code=130) from None
    except TpufabError as err:
        if not started:
            raise
        gone = discard(control, name, started)
        raise type(err)(f"{str(err).rstrip('.')}; {gone[0].lower()}{gone[1:]}") from None


def keep_worker_order(control: ComputeEngine, node: Node, console: Console) -> None:
    """A new MIG's worker numbers, kept in its per-instance configs so that a VM the MIG
    recreates (at another internal IP) keeps its number (``restore_worker_order``: none
    is kept yet). A refusal leaves the slice as it is, numbered by internal IP, and says
    so."""
    try:
        if control.restore_worker_order(node):
            node.order_note = ""
    except TpufabError as err:
        console.print(f"[yellow]Could not keep {escape(node.name)}'s worker numbers in its "
                      f"per-instance configs ({escape(err)}); its workers stay numbered by "
                      "internal IP, which a recreated VM can change.[/yellow]")


def create_multislice(control: ComputeEngine, settings: Settings, *, num_slices: int,
                      async_: bool, console: Console, reservation: str | None,
                      topology: str | None) -> list[Node]:
    """Several Compute Engine slices as one job (``--num-slices N``): ``NAME-0 .. NAME-(N-1)``
    (the Cloud TPU API's multislice names), each its own workload policy, template and MIG,
    labelled ``tpufab-multislice=NAME`` and ``tpufab-slice=i`` so that ``NAME`` finds them
    again as one pod (``ComputeEngine.multislice``). Compute Engine has no resource that ties
    MIGs into a multislice; the MEGASCALE_* wiring is tpufab's job environment. A failure
    or Ctrl-C deletes the slices this create made."""
    name = validate_name(settings.name, num_slices=num_slices)
    shape = parse_accelerator_type(settings.require("type", "--type"))
    if shape.hosts < 2:
        raise ConfigError(
            f"Multislice joins multi-host slices only (Google's multislice documents rule out "
            f"single-host slices such as {shape.name}); use a type of 2 or more VMs (e.g. "
            f"{shape.generation}-{shape.cores // shape.hosts * 2}) with "
            "--num-slices.")
    made: list[Node] = []
    try:
        for index in range(num_slices):
            one = replace(settings, name=f"{name}-{index}", labels={
                **settings.labels, MULTISLICE_LABEL: name, SLICE_LABEL: str(index)})
            made.append(create_one(control, one, queued=False, num_slices=1, async_=async_,
                                   console=console, reservation=reservation,
                                   topology=topology))
    except (TpufabError, KeyboardInterrupt) as err:
        for node in made:
            discard(control, node.name, True)
        gone = (f"deleted slice{'s' if len(made) > 1 else ''} "
                f"{', '.join(n.name for n in made)} made by this create") if made else ""
        if not gone:
            raise
        if isinstance(err, KeyboardInterrupt):
            raise TpufabError(f"Interrupted: {gone[0].upper()}{gone[1:]}.",
                              exit_code=130) from None
        raise type(err)(f"{str(err).rstrip('.')}; {gone}.",
                        exit_code=err.exit_code) from None  # 130 for a Ctrl-C inside a slice
    for index, node in enumerate(made):
        node.multislice, node.slice_index = True, index
    console.print(f"Multislice {name}: {num_slices} slices of {shape.name} "
                  f"({', '.join(n.name for n in made)}); its jobs get MEGASCALE_* variables.")
    return made


def discard(control: ComputeEngine, name: str, started: bool) -> str:
    """Delete what a failed or interrupted Compute Engine create made; what happened."""
    if not started:
        return "nothing was created."
    try:
        op = control.delete_node(name)
        deadline = time.monotonic() + 300
        while not control.operation_done(op, "delete", name=name):
            if time.monotonic() > deadline:
                break
            time.sleep(0.5)
    except KeyboardInterrupt:
        return (f"deleting {name} was interrupted too; delete it with `tpufab delete --name "
                f"{name} --yes`.")
    except TpufabError as err:
        if "No " in str(err) and "named" in str(err):
            return f"nothing of {name} was left to delete."
        return (f"could not delete what it made of {name} ({err}); delete it with `tpufab "
                f"delete --name {name} --yes`.")
    extra = f" (left alone: {', '.join(control.left_alone)})" if control.left_alone else ""
    return f"deleted what this create made of {name}{extra}."
