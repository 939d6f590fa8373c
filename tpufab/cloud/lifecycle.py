"""create / delete / list / describe TPU nodes, with rich output.

Operations check state first and are idempotent: creating a READY node of the same type only
makes sure the tpufab SSH key is in its metadata; deleting a missing node says so. Waiting is
a poll with a live status line (state and elapsed time), bounded by settings.wait_timeout.
"""

from __future__ import annotations

import re
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from tpufab.cloud.controlplane import (
    AlreadyExists,
    ControlPlane,
    Stockout,
    node_body,
    queued_resource_body,
    scheduling_tier,
)
from tpufab.cloud.nodes import DEAD_STATES, MultisliceInfo, Node, QueuedResourceInfo
from tpufab.config import Settings
from tpufab.durations import human_duration
from tpufab.errors import ApiError, ConfigError, TpufabError
from tpufab.ssh import keys as sshkeys
from tpufab.topology import default_dims, format_dims, parse_accelerator_type, slice_shape

if TYPE_CHECKING:
    from rich.console import Console, RenderableType

NAME_RE = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
MAX_NAME = 63


def validate_name(name: str | None, *, num_slices: int = 1) -> str:
    """A valid node name, or one sentence saying what is wrong with it."""
    if name == "":
        raise ConfigError("The node name is empty (--name '' or an empty TPUFAB_NAME): pass a "
                          "name such as --name my-tpu, or leave --name out to use this "
                          "project's current pod.")
    if name is None:
        raise ConfigError("No node name given and this project has no current pod: pass --name, "
                          "choose one with `tpufab use NAME`, or create one with `tpufab create "
                          "--type TYPE`.")
    longest = name if num_slices <= 1 else f"{name}-{num_slices - 1}"
    if not NAME_RE.match(name) or len(longest) > MAX_NAME:
        reason = (f"is longer than {MAX_NAME} characters" if NAME_RE.match(name)
                  else "may only hold lowercase letters, digits and hyphens, start with a letter "
                       "and not end with a hyphen (no spaces or shell characters)")
        raise ConfigError(f"Invalid node name {name!r}: a TPU node name {reason}; "
                          "for example --name my-tpu.")
    return name


PROJECT_RE = re.compile(r"^(?:[a-z][-a-z0-9.]*[a-z0-9]:)?[a-z][-a-z0-9]{4,28}[a-z0-9]$")


def validate_project(project: str) -> str:
    """A well-formed Google Cloud project ID (``domain.com:`` prefix allowed), or one
    sentence."""
    if not PROJECT_RE.match(project or ""):
        raise ConfigError(f"Invalid project {project!r}: a Google Cloud project ID has 6 to 30 "
                          "lowercase letters, digits and hyphens, starts with a letter and does "
                          "not end with a hyphen (for example my-project-123); pass --project "
                          "or set TPUFAB_PROJECT.")
    return project


def _console(console: Console | None) -> Console:
    if console is not None:
        return console
    from tpufab.term.console import stdout

    return stdout()


def _escape(text: object) -> str:
    from rich.markup import escape

    return escape(str(text))


def _elapsed(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"


def plane_of(settings: Settings) -> str | None:
    """"compute", "tpu", or None (either: look on both): ``control_plane`` if set, else
    "compute" for a type only Compute Engine offers (TPU7x and later)."""
    chosen = (settings.control_plane or "").strip().lower() or None
    if chosen in ("gce", "compute-engine", "ce"):
        chosen = "compute"
    if chosen not in (None, "tpu", "compute"):
        raise ConfigError(f"control_plane (--on) must be tpu or compute, not "
                          f"{settings.control_plane!r}.")
    if chosen is None and settings.type:
        if "tpu" not in parse_accelerator_type(settings.type).planes:
            return "compute"
    return chosen


def retry_note(exc: BaseException, attempt: int, delay: float) -> str:
    """The line (rich markup) a command prints on stderr when the API is retried."""
    from tpufab.cloud.controlplane import status_name

    return (f"[dim]TPU API busy ({_escape(status_name(exc))}); retrying in {delay:.1f}s "
            f"(attempt {attempt + 1}).[/dim]")


def control_plane(settings: Settings, control: ControlPlane | None = None, *,
                  plane: str | None = "auto", on_retry=None) -> ControlPlane:
    """``control`` if given, else the control plane ``settings`` calls for (``plane_of``):
    the Cloud TPU API (``TpuApi``), Compute Engine (``ComputeEngine``) or, when nothing says
    which, both side by side (``BothPlanes``), noting each retry on stderr (or calling
    ``on_retry(exc, attempt, delay)``). Everything that talks to the cloud gets its
    ControlPlane here (docs/control-plane.md)."""
    if control is not None:
        return control
    from tpufab.cloud.tpu_api import TpuApi

    if on_retry is None:
        def on_retry(exc: BaseException, attempt: int, delay: float) -> None:
            from tpufab.term.console import stderr

            stderr().print(retry_note(exc, attempt, delay))

    which = plane_of(settings) if plane == "auto" else plane
    if which == "tpu":
        return TpuApi(settings, on_retry=on_retry)
    from tpufab.cloud.compute_api import ComputeEngine

    compute = ComputeEngine(settings, on_retry=on_retry)
    if which == "compute":
        return compute
    from tpufab.cloud.controlplane import BothPlanes

    return BothPlanes(settings, TpuApi(settings, on_retry=on_retry), compute)


# ---------------------------------------------------------------------------------------------
# waiting


def wait_for(probe: Callable[[], tuple[str, bool]], *, what: str, timeout: float,
             console: Console, check_hint: str = "",
             clock: Callable[[], float] = time.monotonic,
             sleep: Callable[[float], None] = time.sleep) -> str:
    """Poll ``probe() -> (state, done)`` until done, showing a live status line.

    Each state change is printed as a line of its own (`CREATING -> READY after 12s`); the
    poll interval grows from 0.25 s to 5 s. Past ``timeout`` seconds raise an ApiError that says
    the operation goes on in the background.
    """
    started = clock()
    state, done = probe()
    console.print(f"{_escape(what)}: {_escape(state)}")
    interval = 0.25
    with console.status(f"{_escape(what)}: {_escape(state)}") as status:
        while not done:
            elapsed = clock() - started
            if elapsed > timeout:
                raise ApiError(f"Gave up waiting after {_elapsed(elapsed)}: {what} is still "
                               f"{state} and carries on in the background; {check_hint}or raise "
                               "TPUFAB_WAIT_TIMEOUT.")
            sleep(min(interval, max(0.0, timeout - elapsed) + 0.01))
            interval = min(interval * 1.5, 5.0)
            new_state, done = probe()
            elapsed = clock() - started
            if new_state != state:
                console.print(f"{_escape(what)}: {_escape(state)} -> {_escape(new_state)} "
                              f"after {_elapsed(elapsed)}")
                state, interval = new_state, 0.25
            status.update(f"{_escape(what)}: {_escape(state)} ({_elapsed(elapsed)})")
    return state


def _wait_operation(control: ControlPlane, op: str, *, what: str, settings: Settings,
                    console: Console, verb: str, name: str) -> None:
    def probe() -> tuple[str, bool]:
        done = control.operation_done(op, verb, name=name)
        return ("DONE" if done else "RUNNING"), done

    wait_for(probe, what=what, timeout=settings.wait_timeout, console=console)


# ---------------------------------------------------------------------------------------------
# create


def stockout_delay(attempt: int, base: float, cap: float = 300.0) -> float:
    """Seconds before retry round ``attempt`` (0, 1, ...): base, 2*base, ... at most ``cap``."""
    return min(cap, base * 2 ** attempt)


def offered_only_on_compute_engine(type_text: str | None) -> None:
    """One sentence for a type the Cloud TPU API does not offer, asked of it (--on tpu)."""
    if not type_text:
        return
    topo = parse_accelerator_type(type_text)
    if "tpu" not in topo.planes:
        raise ConfigError(
            f"{topo.name} is offered only through Compute Engine (TPU7x and later are not in "
            "the Cloud TPU API); drop --on tpu (TPUFAB_CONTROL_PLANE=tpu) to create it there "
            f"as VMs of machine type {topo.machine_type}.")


def _create_on_compute(settings: Settings, *, queued: bool, num_slices: int, async_: bool,
                       console: Console, control: ControlPlane | None,
                       zones: Sequence[str] | None, retry_for: float | None,
                       reservation: str | None, topology: str | None) -> Node:
    """Create a Compute Engine TPU VM or slice (policy + template + MIG) and wait until every
    VM is RUNNING and reachable; on failure or Ctrl-C delete what this create made, and say
    so (tpufab/cloud/compute_api.py; docs/control-plane.md)."""
    from tpufab.cloud.compute_api import machine_type_of, parse_run_duration

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
    control = control_plane(settings, control, plane="compute")
    where = f"{settings.zone} (project {settings.project})"
    existing = control.find_node(name)
    if existing is not None:
        _same_topology(existing, chip_topology)
        return _existing_node(control, existing, settings, shape.name, entry, async_=async_,
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
                  f"{_escape(made)} of {machine}, {how}) in {_escape(where)}.")
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
            return control.find_node(name) or Node(name, settings.project, settings.zone,
                                                   shape.name, "CREATING", plane="compute")
        node = _wait_node(control, name, settings, console=console, op=op,
                          accelerator_type=shape.name)
        _keep_worker_order(control, node, console)
        return node
    except KeyboardInterrupt:  # perhaps half-way through the policy, template and MIG
        gone = _discard(control, name, True)
        raise TpufabError(f"Interrupted: {gone[0].upper()}{gone[1:]}", exit_code=130) from None
    except TpufabError as err:
        if not started:
            raise
        gone = _discard(control, name, started)
        raise type(err)(f"{str(err).rstrip('.')}; {gone[0].lower()}{gone[1:]}") from None


def _keep_worker_order(control: ControlPlane, node: Node, console: Console) -> None:
    """A new MIG's worker numbers, kept in its per-instance configs so that a VM the MIG
    recreates (at another internal IP) keeps its number (ComputeEngine.record_worker_order).
    A refusal leaves the slice as it is, numbered by internal IP, and says so."""
    keep = getattr(control, "record_worker_order", None)
    if keep is None or not node.compute_group or node.hosts < 2:
        return
    try:
        keep(node.name)
    except TpufabError as err:
        console.print(f"[yellow]Could not keep {_escape(node.name)}'s worker numbers in its "
                      f"per-instance configs ({_escape(err)}); its workers stay numbered by "
                      "internal IP, which a recreated VM can change.[/yellow]")


MULTISLICE_LABEL = "tpufab-multislice"   # on every VM of a Compute Engine multislice slice
SLICE_LABEL = "tpufab-slice"             # its slice index, 0..N-1


def _create_multislice_on_compute(settings: Settings, *, num_slices: int,
                                  **options: object) -> list[Node]:
    """Several Compute Engine slices as one job (``--num-slices N``): ``NAME-0 .. NAME-(N-1)``
    (the Cloud TPU API's multislice names), each its own workload policy, template and MIG,
    labelled ``tpufab-multislice=NAME`` and ``tpufab-slice=i`` so that ``NAME`` finds them
    again as one pod (``compute_multislice``). Compute Engine has no resource that ties
    MIGs into a multislice; the MEGASCALE_* wiring is tpufab's job environment. A failure
    or Ctrl-C deletes the slices this create made."""
    from rich.console import Console

    name = validate_name(settings.name, num_slices=num_slices)
    shape = parse_accelerator_type(settings.require("type", "--type"))
    if shape.hosts < 2:
        raise ConfigError(
            f"Multislice joins multi-host slices only (Google's multislice documents rule out "
            f"single-host slices such as {shape.name}); use a type of 2 or more VMs (e.g. "
            f"{shape.generation}-{shape.cores // shape.hosts * 2}) with "
            "--num-slices.")
    console: Console = options["console"]  # type: ignore[assignment]
    made: list[Node] = []
    try:
        for index in range(num_slices):
            one = replace(settings, name=f"{name}-{index}", labels={
                **settings.labels, MULTISLICE_LABEL: name, SLICE_LABEL: str(index)})
            made.append(_create_on_compute(one, queued=False, num_slices=1,
                                           **options))  # type: ignore[arg-type]
    except (TpufabError, KeyboardInterrupt) as err:
        quiet = Console(quiet=True)
        for node in made:
            delete(replace(settings, name=node.name), yes=True, console=quiet)
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


def compute_multislice(control: ControlPlane, name: str) -> list[Node]:
    """The slices of the Compute Engine multislice called ``name`` (labelled by
    ``_create_multislice_on_compute``), in slice order; [] if there is none."""
    try:
        nodes = [n for n in control.list_nodes()
                 if n.plane == "compute" and n.labels.get(MULTISLICE_LABEL) == name]
    except TpufabError:
        return []
    for node in nodes:
        node.multislice = True
        node.slice_index = int(node.labels.get(SLICE_LABEL, "0") or 0)
    return sorted(nodes, key=lambda n: (n.slice_index or 0, n.name))


def _discard(control: ControlPlane, name: str, started: bool) -> str:
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
    left = getattr(control, "left_alone", None)
    extra = f" (left alone: {', '.join(left)})" if left else ""
    return f"deleted what this create made of {name}{extra}."


def create(settings: Settings, *, queued: bool = False, num_slices: int = 1, async_: bool = False,
           console: Console | None = None, control: ControlPlane | None = None,
           zones: Sequence[str] | None = None, retry_for: float | None = None,
           reservation: str | None = None, topology: str | None = None,
           retry_base: float = 30.0,
           clock: Callable[[], float] = time.monotonic,
           sleep: Callable[[float], None] = time.sleep) -> list[Node]:
    """Create node ``settings.name`` (or a queued resource) and wait until it is READY.

    Returns the node(s) as last seen (several for a multislice queued resource; possibly none
    with ``async_``). On a stockout, ``zones`` are tried in order (``settings.zone`` is left at
    the zone that had capacity); ``retry_for`` seconds keeps going round them with backoff
    (from ``retry_base``) and a live status line. Quota and every other error stop at once.
    ``reservation`` creates a queued resource that consumes that named reservation.
    ``topology`` (``"4x4x4"``): a custom chip shape, checked against the generation's rules
    before any API call and sent as ``acceleratorConfig``.
    """
    console = _console(console)
    on_compute = control is None and plane_of(settings) == "compute" or \
        getattr(control, "plane", "tpu") == "compute"

    def create_in(here: Settings, **kw) -> list[Node]:   # the plane's create in one zone
        if on_compute:   # --zones/--retry-for: the same loop below, one zone at a time
            if (kw.get("num_slices") or 1) > 1 and not kw.get("queued"):
                kw.pop("queued", None)
                return _create_multislice_on_compute(here, zones=None, retry_for=None, **kw)
            return [_create_on_compute(here, zones=None, retry_for=None, **kw)]
        return _create(here, **kw)

    if not on_compute:
        offered_only_on_compute_engine(settings.type)
    zone_list = list(dict.fromkeys(z.strip() for z in (zones or ()) if z and z.strip()))
    if reservation and not on_compute:
        if not queued and num_slices <= 1:
            console.print("A reservation is consumed through a queued resource: creating one "
                          "(as with --queued).")
        queued = True
    if (len(zone_list) > 1 or retry_for) and (queued or num_slices > 1):
        raise ConfigError("--zones and --retry-for work for TPU nodes; a queued resource "
                          "already waits in line for capacity in its zone: drop --queued "
                          "(and --num-slices/--reservation) or drop --zones/--retry-for.")
    if not zone_list and not retry_for:
        return create_in(settings, queued=queued, num_slices=num_slices, async_=async_,
                         console=console, control=control, reservation=reservation,
                         topology=topology)
    zone_list = zone_list or [settings.zone]
    deadline = clock() + (retry_for or 0.0)
    attempt = 0
    while True:
        last: Stockout | None = None
        for i, zone in enumerate(zone_list):
            here = replace(settings, zone=zone)
            mine = control if control is not None and control.zone == zone else None
            try:
                nodes = create_in(here, queued=queued, num_slices=num_slices, async_=async_,
                                  console=console, control=mine, reservation=reservation,
                                  topology=topology)
            except Stockout as err:
                last = err
                if i + 1 < len(zone_list):
                    console.print(f"[yellow]No {_escape(here.type)} capacity in {zone} right "
                                  f"now; trying {zone_list[i + 1]}.[/yellow]")
                continue
            settings.zone = zone
            return nodes
        assert last is not None
        left = deadline - clock()
        where = ", ".join(zone_list)
        if not retry_for or left <= 0:
            if retry_for:
                raise Stockout(f"No {settings.type} capacity in {where} after retrying for "
                               f"{human_duration(retry_for)}; try --spot, --queued, other "
                               "--zones or a longer --retry-for.") from last
            raise Stockout(f"No {settings.type} capacity in any of {where} right now; try "
                           "--spot, --queued, other --zones, or --retry-for 2h to keep "
                           "trying.") from last
        delay = min(stockout_delay(attempt, retry_base), left)
        attempt += 1
        line = (f"No {settings.type} capacity in {where}; trying again in {{rest}} (attempt "
                f"{attempt + 1}, giving up in {{left}})")  # placeholders filled by _wait_retry
        _wait_retry(console, delay, line=line, deadline=deadline, clock=clock, sleep=sleep)


def _wait_retry(console: Console, delay: float, *, line: str, deadline: float,
                clock: Callable[[], float], sleep: Callable[[float], None]) -> None:
    """Sleep ``delay`` seconds behind a live status line that counts down (``line`` has
    ``{rest}`` and ``{left}``: until the next try, until the deadline)."""
    end = clock() + delay

    def text() -> str:
        now = clock()
        return _escape(line.replace("{rest}", human_duration(max(0.0, end - now)))
                       .replace("{left}", human_duration(max(0.0, deadline - now))))

    console.print(f"[yellow]{text()}.[/yellow]")
    with console.status(text()) as status:
        while (rest := end - clock()) > 0:
            sleep(min(1.0, rest))
            status.update(text())


def _create(settings: Settings, *, queued: bool = False, num_slices: int = 1,
            async_: bool = False, console: Console, control: ControlPlane | None = None,
            reservation: str | None = None, topology: str | None = None) -> list[Node]:
    num_slices = num_slices or 1
    queued = queued or num_slices > 1   # several slices only exist as a queued resource
    name = validate_name(settings.name, num_slices=num_slices)
    accelerator = settings.require("type", "--type")
    chip_topology = slice_shape(accelerator, topology).text if topology else None
    topology = parse_accelerator_type(accelerator)
    settings.project = settings.require("project")
    scheduling_tier(settings)
    entry = sshkeys.metadata_entry(settings.ssh_user, sshkeys.ensure_key(settings.ssh_key_path))
    control = control_plane(settings, control)
    where = f"{settings.zone} (project {settings.project})"

    kind = "queued resource" if queued else "TPU node"
    if queued:
        existing_qr = control.find_queued_resource(name)
        if existing_qr is not None:
            try:
                return _existing_queued(control, existing_qr, settings, topology.name, entry,
                                        async_=async_, console=console)
            except KeyboardInterrupt:
                raise _interrupted_create(kind, name, where, topology.name) from None
    existing = control.find_node(name)
    if existing is not None:
        _same_topology(existing, chip_topology)
        try:
            return _existing_node(control, existing, settings, topology.name, entry,
                                  async_=async_, console=console)
        except KeyboardInterrupt:
            raise _interrupted_create("TPU node", name, where, topology.name) from None

    slices = f" x {num_slices} slices" if num_slices > 1 else ""
    shape = f" as {chip_topology}" if chip_topology else ""
    console.print(f"Creating {kind} [bold]{name}[/bold] ({topology.name}{shape}{slices}, "
                  f"{_hosts(topology.hosts)}{' per slice' if num_slices > 1 else ''}, "
                  f"{scheduling_tier(settings)}) "
                  f"in {_escape(where)}.")
    try:
        return _create_and_wait(control, settings, name, topology.name, entry, queued=queued,
                                num_slices=num_slices, async_=async_, console=console,
                                reservation=reservation, chip_topology=chip_topology)
    except KeyboardInterrupt:
        raise _interrupted_create(kind, name, where, topology.name) from None


def _interrupted_create(kind: str, name: str, where: str, type_name: str) -> TpufabError:
    """Ctrl-C while a create is under way: the node goes on coming up (and is billed once
    READY) whether we wait or not. Say so, and how to be rid of it."""
    return TpufabError(
        f"Interrupted: {kind} {name} may still be coming up in {where} (billed once it is "
        f"READY). Delete it with `tpufab delete --name {name} --yes`, or wait for it with "
        f"`tpufab create --name {name} --type {type_name}` again.", exit_code=130)


def _create_and_wait(control: ControlPlane, settings: Settings, name: str, type_name: str,
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
            return _existing_queued(control, existing_qr, settings, type_name, entry,
                                    async_=async_, console=console)
        if (existing := control.find_node(name)) is not None:
            return _existing_node(control, existing, settings, type_name, entry,
                                  async_=async_, console=console)
        raise

    if async_:
        console.print(f"Not waiting (--async); follow it with `tpufab describe --name {name}`.")
        node = control.find_node(name) if not queued or num_slices == 1 else None
        return [node] if node else []
    if queued:
        return _wait_queued(control, name, op, settings, console=console)
    return [_wait_node(control, name, settings, console=console, op=op,
                       accelerator_type=type_name)]


def _same_topology(node: Node, chip_topology: str | None) -> None:
    if chip_topology and node.chip_topology and node.chip_topology != chip_topology:
        raise ConfigError(f"TPU node {node.name!r} already exists with topology "
                          f"{node.chip_topology}, not {chip_topology}; delete it first "
                          f"(`tpufab delete --name {node.name}`) or pick another --name.")


def _wait_node(control: ControlPlane, name: str, settings: Settings, *, console: Console,
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
        if getattr(node, "condition", "") and not node.ready:   # a MIG short of VMs
            short.setdefault("since", time.monotonic())
            if time.monotonic() - short["since"] > settings.mig_short_wait:
                raise ApiError(f"{node.condition.rstrip('.')} (gave up after "
                               f"{_elapsed(time.monotonic() - started)}; TPUFAB_MIG_SHORT_WAIT "
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
                  f"{_elapsed(time.monotonic() - started)}: {_summary(node)}.")
    return node


def _wait_queued(control: ControlPlane, name: str, op: str | None, settings: Settings, *,
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
                  f"{_elapsed(time.monotonic() - started)}: "
                  + "; ".join(f"{n.name}: {_summary(n)}" for n in nodes) + ".")
    return nodes


def _hosts(count: int) -> str:
    return f"{count} host{'s' if count != 1 else ''}"


def _summary(node: Node) -> str:
    addresses = node.addresses()
    if len(addresses) > 4:  # a 64-host pod: first and last, not a wall of addresses
        ips = f"{addresses[0]} .. {addresses[-1]}; `tpufab describe` lists all"
    else:
        ips = ", ".join(addresses) or "no workers"
    return f"{node.accelerator_type}, {_hosts(node.hosts)} ({ips})"


def ensure_key(control: ControlPlane, node: Node, entry: str, settings: Settings,
                console: Console) -> bool:
    op = control.add_ssh_key(node, entry)
    if op is None:
        return False
    _wait_operation(control, op, what=f"Adding your SSH key to {node.name}", settings=settings,
                    console=console, verb="update", name=node.name)
    node.metadata[sshkeys.SSH_KEYS] = sshkeys.merge_entry(node.metadata.get(sshkeys.SSH_KEYS),
                                                          entry)
    return True


def _existing_node(control: ControlPlane, node: Node, settings: Settings, wanted_type: str,
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
        node = _wait_node(control, name, settings, console=console)
    added = ensure_key(control, node, entry, settings, console)
    note = "added your SSH key to its metadata" if added else "nothing to do"
    console.print(f"TPU node [bold]{name}[/bold] already exists and is READY "
                  f"({_summary(node)}); {note}.")
    return [node]


def _existing_queued(control: ControlPlane, qr: QueuedResourceInfo, settings: Settings,
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
        nodes = _wait_queued(control, name, None, settings, console=console)
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


# ---------------------------------------------------------------------------------------------
# delete


def _confirm(question: str, console: Console) -> bool:
    if not sys.stdin or not sys.stdin.isatty():
        raise ConfigError("Refusing to delete without confirmation: stdin is not a terminal; "
                          "pass --yes to delete non-interactively.")
    from rich.prompt import Confirm

    return Confirm.ask(question, console=console, default=False)


@dataclass(frozen=True)
class Slice:
    """One node a delete takes, as it was read: name, id, state."""

    name: str
    id: str
    state: str

    @classmethod
    def of(cls, node: Node) -> Slice:
        return cls(node.name, node.id, node.state)

    @property
    def text(self) -> str:
        return f"{self.name} (id {self.id or '?'}, {self.state})"


def slices_text(slices: Sequence[Slice]) -> str:
    return ", ".join(s.text for s in slices) or "no nodes"


def _read_slices(control: ControlPlane, names: Sequence[str]) -> list[Slice]:
    """The nodes of ``names`` that exist now, as Slices."""
    found = []
    for node_name in names:
        node = control.find_node(node_name)
        if node is not None:
            found.append(Slice.of(node))
    return found


@dataclass(frozen=True)
class Doomed:
    """What one delete takes with it: a node, or a queued resource and all its slices."""

    kind: str                        # "node" or "queued resource"
    name: str
    slices: tuple[Slice, ...]
    state: str = ""                  # the queued resource's state
    accelerator_type: str = ""

    @property
    def text(self) -> str:
        if self.kind == "node":
            if not self.slices:
                return f"TPU node {self.name}"
            node = self.slices[0]
            return (f"TPU node {node.name} ({self.accelerator_type}, id {node.id or '?'}, "
                    f"{node.state})")
        return (f"queued resource {self.name} ({self.accelerator_type}, {self.state}) with "
                f"{'its slice' if len(self.slices) == 1 else 'all its slices'} "
                f"{slices_text(self.slices)}")


def _read_doomed(control: ControlPlane, kind: str, name: str) -> Doomed | None:
    """What deleting ``kind`` ``name`` would take now; None when it is gone."""
    if kind == "node":
        node = control.find_node(name)
        return Doomed("node", name, (Slice.of(node),), node.state, node.accelerator_type) \
            if node is not None else None
    qr = control.find_queued_resource(name)
    if qr is None:
        return None
    return Doomed("queued resource", name, tuple(_read_slices(control, qr.node_ids)), qr.state,
                  qr.accelerator_type)


def changed_since(listed: Doomed, now: Doomed | None,
                  deletable: Callable[[Doomed], str | None] | None = None) -> str | None:
    """Why ``now`` (re-read just before deleting) is not what was listed, or not deletable any
    more: one sentence; None when it may go (pure)."""
    what = f"{'TPU node' if listed.kind == 'node' else 'queued resource'} {listed.name}"
    if now is None:
        return f"{what} is already gone."
    before = {s.name: s for s in listed.slices}
    for s in now.slices:
        old = before.get(s.name)
        if old is None or (old.id and s.id and old.id != s.id):
            was = f"id {old.id}" if old is not None else "not there"
            return (f"Not deleting {what}: {s.name} is not the node that was listed (it was "
                    f"{was}, it is now id {s.id}, {s.state}): it was recreated meanwhile.")
    if deletable is not None:
        why = deletable(now)
        if why:
            return f"Not deleting {what}: {why}"
    return None


def _delete_and_wait(control: ControlPlane, doomed: Doomed, *, settings: Settings,
                     console: Console, check_name: str) -> float:
    started = time.monotonic()
    if doomed.kind == "node":
        control.delete_node(doomed.name)
        label = f"TPU node {doomed.name}"
    else:
        control.delete_queued_resource(doomed.name, force=True)
        label = f"Queued resource {doomed.name}"

    def probe() -> tuple[str, bool]:
        gone = _read_doomed(control, doomed.kind, doomed.name)
        return (gone.state, False) if gone else ("DELETED", True)

    wait_for(probe, what=label, timeout=settings.wait_timeout, console=console,
             check_hint=f"check it with `tpufab describe --name {check_name}`, ")
    removed, left = getattr(control, "removed", None), getattr(control, "left_alone", None)
    if removed:  # Compute Engine: what tpufab made for the slice went with its MIG
        console.print(f"Deleted with it: {_escape(', '.join(removed))}.")
    if left:
        console.print(f"[yellow]Left alone: {_escape(', '.join(left))}.[/yellow]")
    return time.monotonic() - started


def delete(settings: Settings, *, yes: bool = False, console: Console | None = None,
           control: ControlPlane | None = None,
           confirm: Callable[[str, Console], bool] = _confirm,
           deletable: Callable[[Doomed], str | None] | None = None) -> bool:
    """Delete node ``settings.name`` (or the queued resource it belongs to) and wait until gone.

    What goes is re-read just before the delete: a node recreated under the name since it was
    shown (another id), or one ``deletable`` refuses (its sentence), is left alone and said
    so. Returns False when there was nothing to delete, it was left alone or the user said no.
    """
    console = _console(console)
    name = validate_name(settings.name)
    settings.project = settings.require("project")
    control = control_plane(settings, control)
    node = control.find_node(name)
    qr_name = node.queued_resource if node is not None else None
    qr = control.find_queued_resource(qr_name or name) if node is None or qr_name else None
    where = f"{settings.zone} (project {settings.project})"
    if node is None and qr is None:
        slices = compute_multislice(control, name)
        if slices:  # a Compute Engine multislice: each slice, as `delete --name NAME-i`
            text = ", ".join(n.name for n in slices)
            if not yes and not confirm(f"Delete multislice {name} ({_escape(text)}) in "
                                       f"{_escape(where)}?", console):
                console.print("Not deleted.")
                return False
            return all([delete(replace(settings, name=n.name), yes=True,
                               console=console, control=control, deletable=deletable)
                        for n in slices])
        console.print(f"No TPU node named {name} in {_escape(where)}; nothing to delete.")
        return False

    if qr is not None:
        listed = Doomed("queued resource", qr.name, tuple(_read_slices(control, qr.node_ids)),
                        qr.state, qr.accelerator_type)
    else:
        assert node is not None
        listed = Doomed("node", name, (Slice.of(node),), node.state, node.accelerator_type)
    if not yes and not confirm(f"Delete {_escape(listed.text)} in {_escape(where)}?", console):
        console.print("Not deleted.")
        return False
    return _delete_listed(control, listed, settings=settings, console=console,
                          check_name=name, deletable=deletable)


def _delete_listed(control: ControlPlane, listed: Doomed, *, settings: Settings,
                   console: Console, check_name: str,
                   deletable: Callable[[Doomed], str | None] | None = None) -> bool:
    """Re-read ``listed``, delete it if it is still what was listed, say exactly what went."""
    now = _read_doomed(control, listed.kind, listed.name)
    why = changed_since(listed, now, deletable)
    if why:
        console.print(f"[yellow]{_escape(why)}[/yellow]")
        return False
    assert now is not None
    seconds = _delete_and_wait(control, now, settings=settings, console=console,
                               check_name=check_name)
    console.print(f"[green]Deleted {_escape(now.text)}[/green] in {_elapsed(seconds)}.")
    _forget_pins(settings, now, console)
    return True


def _forget_pins(settings: Settings, gone: Doomed, console: Console) -> None:
    """The host keys pinned for what was deleted: its workers' (by node id: a new node has
    another), and the jump host's when it went with the node (it no longer answers)."""
    from tpufab.ssh.hostkeys import KnownHosts

    known = KnownHosts(settings.known_hosts_path)
    try:
        for s in gone.slices:
            if s.id:
                known.forget(s.id)
        if settings.jump:
            from tpufab.config import parse_jump
            from tpufab.ssh import jump

            bastion = parse_jump(settings.jump)
            if jump.forget_if_gone(bastion, known):
                console.print(f"The jump host {_escape(bastion.key_alias)} went with it: "
                              f"forgot its pinned host key ({_escape(known.path)}); the next "
                              "one is pinned afresh, its fingerprint shown.")
    except (OSError, ConfigError) as err:
        console.print(f"[yellow]Could not forget the host keys pinned for it "
                      f"({_escape(err)}).[/yellow]")


# ---------------------------------------------------------------------------------------------
# gc

GC_NODE_STATES = frozenset({"PREEMPTED", "TERMINATED", "FAILED"})
GC_QUEUED_STATES = frozenset({"SUSPENDED", "FAILED"})


@dataclass(frozen=True)
class Garbage:
    """A node or queued resource that only costs quota: what `gc` deletes."""

    kind: str                  # "node" or "queued resource"
    name: str
    zone: str
    state: str
    accelerator_type: str
    detail: str = ""
    slices: tuple[Slice, ...] = ()   # every node its delete takes, as listed
    dead: str = ""             # a live queued resource's dead node that makes it garbage

    @property
    def label(self) -> str:
        what = "TPU node" if self.kind == "node" else "queued resource"
        text = f"{what} {self.name} ({self.accelerator_type}, {self.state}) in {self.zone}"
        if self.kind == "node" and self.slices:
            text += f", id {self.slices[0].id or '?'}"
        elif self.kind != "node":
            live = [s.name for s in self.slices if s.state not in GC_NODE_STATES]
            text += (f"; deleting it deletes {'its slice' if len(self.slices) == 1 else 'all its slices'}"
                     f" {slices_text(self.slices)}" if self.slices else "; it has no nodes")
            if live:
                text += f" ({', '.join(live)} not dead: deleted too)"
        return text

    @property
    def doomed(self) -> Doomed:
        return Doomed(self.kind, self.name, self.slices, self.state, self.accelerator_type)

    def deletable(self, now: Doomed) -> str | None:
        """Why ``now`` (re-read) is no longer garbage, or None."""
        if self.kind == "node":
            state = now.slices[0].state
            return None if state in GC_NODE_STATES else \
                f"it is now {state}, no longer something gc deletes."
        if not self.dead:
            return None if now.state in GC_QUEUED_STATES else \
                f"it is now {now.state}, no longer something gc deletes."
        dead = next((s for s in now.slices if s.name == self.dead), None)
        if dead is not None and dead.state not in GC_NODE_STATES:
            return f"its node {dead.name} is now {dead.state}, no longer something gc deletes."
        return None


def find_garbage(nodes: Sequence[Node], queued: Sequence[QueuedResourceInfo],
                 zone: str) -> list[Garbage]:
    """Dead nodes and failed or suspended queued resources (pure). A node that belongs to a
    queued resource in the list goes with it (deleting the queued resource deletes it); a
    queued resource names every slice its delete takes, READY ones included."""
    out: list[Garbage] = []
    by_qr: dict[str, list[Slice]] = {}
    for node in sorted(nodes, key=lambda n: n.name):
        if node.queued_resource:
            by_qr.setdefault(node.queued_resource, []).append(Slice.of(node))
    dead_qrs = {qr.name for qr in queued if qr.state in GC_QUEUED_STATES}
    for qr in sorted(queued, key=lambda q: q.name):
        if qr.name in dead_qrs:
            out.append(Garbage("queued resource", qr.name, zone, qr.state, qr.accelerator_type,
                               qr.failure or "", slices=tuple(by_qr.get(qr.name, ()))))
    for node in sorted(nodes, key=lambda n: n.name):
        if node.state in GC_NODE_STATES and node.queued_resource not in dead_qrs:
            if node.queued_resource:  # a dead node of a live queued resource: delete them both
                out.append(Garbage("queued resource", node.queued_resource, zone,
                                   f"node {node.name} {node.state}", node.accelerator_type,
                                   slices=tuple(by_qr.get(node.queued_resource, ())),
                                   dead=node.name))
            else:
                out.append(Garbage("node", node.name, zone, node.state, node.accelerator_type,
                                   slices=(Slice.of(node),)))
    seen: set[tuple[str, str]] = set()
    return [g for g in out if (g.kind, g.name) not in seen and not seen.add((g.kind, g.name))]


def gc(settings: Settings, *, yes: bool = False, all_zones: bool = False,
       console: Console | None = None, control: ControlPlane | None = None,
       confirm: Callable[[str, Console], bool] = _confirm) -> list[Garbage]:
    """Delete PREEMPTED/TERMINATED/FAILED nodes and SUSPENDED/FAILED queued resources in the
    zone (every zone with ``all_zones``), after asking; returns what was deleted.

    Each one is read again just before its delete: one recreated since the listing (another
    node id) or no longer dead is left alone, with a sentence."""
    console = _console(console)
    settings.project = validate_project(settings.require("project"))
    control = control_plane(settings, control)
    zones = control.zones() if all_zones else [settings.zone]
    found: list[Garbage] = []
    left: list[tuple[ControlPlane, tuple[str, str, str]]] = []   # Compute Engine leftovers
    for zone in zones:
        here = control if zone == control.zone else control_plane(replace(settings, zone=zone))
        found += find_garbage(here.list_nodes(), here.list_queued_resources(), zone)
        left += [(here, item) for item in (here.leftovers() if hasattr(here, "leftovers")
                                           else [])]
    where = "any zone" if all_zones else f"{settings.zone}"
    if left:
        _gc_leftovers(left, yes=yes, console=console, confirm=confirm, more=bool(found))
    if not found and left:
        return []
    if not found:
        console.print(f"Nothing to collect in {_escape(where)} (project {settings.project}): no "
                      "preempted, terminated or failed nodes, no suspended or failed queued "
                      "resources.")
        return []
    console.print(f"Found {len(found)} thing{'s' if len(found) != 1 else ''} that only cost "
                  "quota:")
    for g in found:
        console.print(f"  {_escape(g.label)}" + (f": {_escape(g.detail)}" if g.detail else ""))
    live = [s.name for g in found if g.kind != "node" for s in g.slices
            if s.state not in GC_NODE_STATES]
    if live:
        console.print(f"[yellow]Deleting a queued resource deletes all its slices: "
                      f"{_escape(', '.join(live))} {'is' if len(live) == 1 else 'are'} not "
                      "dead and will be deleted too.[/yellow]")
    if not yes and not confirm(f"Delete {'them' if len(found) > 1 else 'it'}?", console):
        console.print("Nothing deleted.")
        return []
    deleted, skipped = [], 0
    for g in found:
        here = replace(settings, zone=g.zone, name=g.name)
        mine = control if g.zone == control.zone else control_plane(here)
        try:
            gone = _delete_listed(mine, g.doomed, settings=here, console=console,
                                  check_name=g.name, deletable=g.deletable)
        except ApiError as err:
            console.print(f"[red]Could not delete {_escape(g.label)}: {_escape(err)}[/red]")
            continue
        if gone:
            deleted.append(g)
        else:
            skipped += 1
    failed = len(found) - len(deleted) - skipped
    console.print(f"Deleted {len(deleted)} of {len(found)}" +
                  (f"; {skipped} left alone (see above)" if skipped else "") +
                  (f"; {failed} could not be deleted (see above)." if failed else "."))
    if failed:
        raise ApiError(f"gc could not delete {failed} of {len(found)}; run `tpufab gc` again "
                       "or delete them with `tpufab delete --name NAME --yes`.")
    return deleted


def _gc_leftovers(left: Sequence[tuple[ControlPlane, tuple[str, str, str]]], *, yes: bool,
                  console: Console, confirm: Callable[[str, Console], bool],
                  more: bool) -> None:
    """Instance templates and workload policies tpufab made for Compute Engine slices whose
    MIG is gone (autostop deleted it): free, but they keep the names; delete after asking."""
    console.print(f"Found {len(left)} Compute Engine leftover{'s' if len(left) != 1 else ''} "
                  "of slices that are gone:")
    for _, (kind, name, owner) in left:
        console.print(f"  {kind} {_escape(name)} (made by tpufab for slice {_escape(owner)})")
    if not yes and not confirm(f"Delete {'them' if len(left) > 1 else 'it'}?", console):
        console.print("No leftover deleted.")
        return
    gone = 0
    for plane, (kind, name, owner) in left:
        why = plane.delete_leftover(kind, name, owner)
        if why:
            console.print(f"[yellow]Left alone: {_escape(why)}.[/yellow]")
        else:
            gone += 1
    console.print(f"Deleted {gone} of {len(left)} leftover{'s' if len(left) != 1 else ''}." +
                  (" Now the nodes:" if more else ""))


# ---------------------------------------------------------------------------------------------
# list / describe


def list_nodes(settings: Settings, *, control: ControlPlane | None = None) -> list[Node]:
    """Every TPU node in the zone, by name."""
    settings.project = settings.require("project")
    control = control_plane(settings, control)
    return sorted(control.list_nodes(), key=lambda n: n.name)


def list_waiting_queued_resources(settings: Settings, *,
                                  control: ControlPlane | None = None) -> list[QueuedResourceInfo]:
    """Queued resources that have no nodes yet (waiting, provisioning, failed)."""
    control = control_plane(settings, control)
    return [qr for qr in control.list_queued_resources() if not qr.active]


def vanished_note(control, name: str) -> str | None:
    """``deleted_by_autostop`` from the API's operations; None when it cannot tell."""
    from tpufab.cloud.nodes import deleted_by_autostop

    try:
        return deleted_by_autostop(control.list_operations(), name)
    except TpufabError:
        return None


def describe(settings: Settings, name: str | None = None, *,
             control: ControlPlane | None = None) -> Node | QueuedResourceInfo | MultisliceInfo:
    """Node ``name`` (default settings.name); a queued resource of that name if no node has
    it; else the Compute Engine multislice of that name (``create --num-slices N``), as
    verbs given the name find them (pod.connection.resolve_nodes). A name that is both a
    node (or queued resource) and a multislice is one sentence."""
    name = validate_name(name or settings.name)
    settings.project = settings.require("project")
    control = control_plane(settings, control)
    from tpufab.errors import NotFound

    try:
        node = control.get_node(name)   # both planes, when nothing says which: a name on
    except NotFound:                    # both is one sentence here (BothPlanes.get_node)
        node = None
    qr = control.find_queued_resource(name) if node is None else None
    slices = compute_multislice(control, name) if _multislice_named(control, name) else []
    if slices and (node is not None or qr is not None):
        raise ConfigError(_two_things(name, node, qr, slices))
    if node is not None:
        if node.plane == "compute" and node.labels.get(MULTISLICE_LABEL):
            node.multislice = True  # one slice of a multislice (`describe --name NAME-0`)
            node.slice_index = int(node.labels.get(SLICE_LABEL, "0") or 0)
        return node
    if qr is not None:
        return qr
    if slices:
        return MultisliceInfo(name, settings.project, settings.zone, slices)
    how = vanished_note(control, name)
    if how:
        raise NotFound(f"No node named {name!r} in {settings.zone} (project "
                       f"{settings.project}): it was {how}; create it again with `tpufab "
                       f"create --name {name} --type TYPE`.")
    return control.get_node(name)  # raises the NotFound sentence


def _multislice_named(control: ControlPlane, name: str) -> bool:
    """Whether Compute Engine holds slice 0 of a multislice ``name`` (``NAME-0`` labelled
    with it): one lookup, so `describe` of any other name never lists every MIG of the zone
    (``compute_multislice`` does, once this says there is one)."""
    plane = getattr(control, "compute", control)   # BothPlanes: its Compute Engine side
    if getattr(plane, "plane", "") != "compute":
        return False
    try:
        first = plane.find_node(f"{name}-0")
    except TpufabError:   # only looking: a project without the Compute Engine API has none
        return False
    return first is not None and first.labels.get(MULTISLICE_LABEL) == name


def _two_things(name: str, node: Node | None, qr: QueuedResourceInfo | None,
                slices: Sequence[Node]) -> str:
    """The sentence for a name that is a node (or queued resource) and a multislice too."""
    if node is not None:
        kind = ("Compute Engine TPU slice" if node.plane == "compute" else
                "Cloud TPU API node")
    else:
        kind = "queued resource"
    return (f"{name!r} names both the {kind} {name} and the Compute Engine multislice "
            f"{name} ({', '.join(n.name for n in slices)}), and verbs given {name} reach the "
            f"{kind}; delete or rename one of them (`tpufab delete --name {name}` deletes the "
            f"{kind}), or name one slice of the multislice (`--name {slices[0].name}`).")


_STATE_STYLE = {"READY": "green", "ACTIVE": "green", "PREEMPTED": "bold red", "FAILED": "bold red",
                "TERMINATED": "red", "STOPPED": "yellow", "CREATING": "yellow",
                "DELETING": "yellow", "PROVISIONING": "yellow",
                "WAITING_FOR_RESOURCES": "yellow"}


def _state_text(state: str) -> str:
    style = _STATE_STYLE.get(state)
    return f"[{style}]{state}[/{style}]" if style else state


def _created(node: Node | QueuedResourceInfo) -> str:
    return node.created.strftime("%Y-%m-%d %H:%M") if node.created else "-"


def nodes_table(nodes: list[Node], console: Console) -> RenderableType:
    """The `tpufab list` table, fitted to ``console`` (tpufab.term.tables)."""
    from tpufab.cloud.nodes import AUTOSTOP_KEY, autostop_cell
    from tpufab.term.tables import fitted

    autostop = any(AUTOSTOP_KEY in node.metadata for node in nodes)
    planes = any(node.plane != "tpu" for node in nodes)  # ON: which control plane
    columns = ["NAME", "TYPE", "STATE", "HEALTH", "HOSTS", "WORKER IPS", "SPOT", "CREATED"]
    rows = []
    for node in nodes:
        cells = [_escape(node.name), node.accelerator_type, _state_text(node.state),
                 node.health or "-", str(node.hosts), " ".join(node.addresses()) or "-",
                 "yes" if node.spot or node.preemptible else "no", _created(node)]
        if planes:
            cells.append(node.plane_text)
        if autostop:
            cells.append(autostop_cell(node.metadata))
        rows.append(cells)
    return fitted(columns + (["ON"] if planes else []) + (["AUTOSTOP"] if autostop else []),
                  rows, console)


def queued_table(resources: list[QueuedResourceInfo], console: Console) -> RenderableType:
    from tpufab.term.tables import fitted

    return fitted(("QUEUED RESOURCE", "TYPE", "STATE", "TIER", "NODES", "CREATED"),
                  [(_escape(qr.name), qr.accelerator_type, _state_text(qr.state), qr.tier,
                    ", ".join(qr.node_ids), _created(qr)) for qr in resources], console)


def preempted_notes(nodes: list[Node]) -> list[str]:
    return [f"[bold red]{n.name} was PREEMPTED[/bold red] (it still counts against quota); "
            f"recover with `tpufab delete --name {n.name} --yes`, then create it again."
            for n in nodes if n.preempted] + \
        [f"[yellow]{_escape(n.condition)}[/yellow]" for n in nodes
         if getattr(n, "condition", "")]   # Compute Engine: a flex-start end, a short MIG


def details_table(item: Node | QueuedResourceInfo | MultisliceInfo) -> RenderableType:
    """The `tpufab describe` view: fields, then one row per worker."""
    from rich.console import Group
    from rich.table import Table

    fields = Table(box=None, show_header=False, pad_edge=False)
    fields.add_column(style="bold")
    fields.add_column(overflow="fold")
    if isinstance(item, MultisliceInfo):
        shape = item.slices[0].topology if item.slices else None
        rows = [("multislice", _escape(item.name)), ("control plane", item.plane_text),
                ("type", f"{len(item.slices)} x {item.accelerator_type}"),
                ("state", _state_text(item.state)), ("hosts", str(item.hosts)),
                ("chips", str(shape.chips * len(item.slices)) if shape else "-"),
                ("slices", _escape(", ".join(f"{n.name} ({n.state})" for n in item.slices))),
                ("zone", item.zone), ("project", item.project),
                ("created", _created(item.slices[0]) if item.slices else "-")]
        for key, value in rows:
            fields.add_row(key, value)
        workers = Table(box=None, pad_edge=False, header_style="bold")
        for column in ("WORKER", "SLICE", "SLICE WORKER", "INTERNAL IP", "EXTERNAL IP"):
            workers.add_column(column)
        for index, slice_index, w in item.workers():
            workers.add_row(str(index), str(slice_index), str(w.index), w.internal_ip,
                            w.external_ip or "-")
        return Group(fields, "", workers)
    if isinstance(item, QueuedResourceInfo):
        rows = [("queued resource", item.name), ("type", item.accelerator_type),
                ("state", _state_text(item.state)), ("tier", item.tier),
                ("nodes", ", ".join(item.node_ids)), ("runtime", item.runtime_version),
                ("zone", item.zone), ("project", item.project), ("created", _created(item))]
        if item.failure:
            rows.append(("failure", _escape(item.failure)))
        for key, value in rows:
            fields.add_row(key, value)
        return fields
    node = item
    shape = node.topology
    rows = [("name", _escape(node.name)), ("type", node.accelerator_type),
            ("state", _state_text(node.state)), ("health", node.health or "-"),
            ("hosts", str(node.hosts)),
            ("chips", f"{shape.chips} ({shape.chips_per_host} per host)" if shape else "-"),
            ("machine type" if node.plane == "compute" else "runtime", node.runtime_version),
            ("tier", node.tier),
            ("zone", node.zone), ("project", node.project), ("created", _created(node)),
            ("id", node.id or "-")]
    if node.chip_topology:
        rows.insert(5, ("topology", node.chip_topology))
    rows.insert(1, ("control plane", node.plane_text))
    if node.plane == "compute":
        rows += [(k, _escape(v)) for k, v in (
            ("provisioning", node.provisioning_model), ("instance group", node.compute_group),
            ("instance template", node.compute_template),
            ("workload policy", node.compute_policy)) if v]
    if node.queued_resource:
        rows.append(("queued resource", _escape(node.queued_resource)))
    if node.multislice:
        rows.append(("slice", str(node.slice_index) if node.slice_index is not None else "yes"))
    if node.labels:
        rows.append(("labels", _escape(", ".join(f"{k}={v}" for k, v in sorted(node.labels.items())))))
    if node.health_description:
        rows.append(("health detail", _escape(node.health_description)))
    for key, value in rows:
        fields.add_row(key, value)
    workers = Table(box=None, pad_edge=False, header_style="bold")
    for column in ("WORKER", "INTERNAL IP", "EXTERNAL IP", "PORT"):
        workers.add_column(column)
    for w in node.workers:
        workers.add_row(str(w.index), w.internal_ip, w.external_ip or "-", str(w.port))
    return Group(fields, "", workers)


# ---------------------------------------------------------------------------------------------
# The listing and naming verbs (`tpufab list`, `describe`, `create` without a name)


@dataclass
class Listing:
    """`tpufab list`: the zone's nodes, and (when asked for) queued resources still waiting."""

    settings: Settings
    nodes: list[Node]
    waiting: list[QueuedResourceInfo]

    def to_json(self) -> list[dict]:
        return [n.to_json() for n in self.nodes]

    def render(self, console: Console) -> None:
        if not self.nodes and not self.waiting:
            console.print(f"No TPU nodes in {self.settings.zone} (project "
                          f"{self.settings.project}).")
            return
        if self.nodes:
            console.print(nodes_table(self.nodes, console))
        if self.waiting:
            console.print()
            console.print(queued_table(self.waiting, console))
        for line in preempted_notes(self.nodes):
            console.print(line)


def listing(settings: Settings, *, waiting: bool = True,
            control: ControlPlane | None = None) -> Listing:
    """The nodes of the zone and, with ``waiting``, the queued resources without nodes yet."""
    nodes = list_nodes(settings, control=control)
    queued = list_waiting_queued_resources(settings, control=control) if waiting else []
    return Listing(settings, nodes, queued)


def render_details(item: Node | QueuedResourceInfo | MultisliceInfo, console: Console) -> None:
    """The `tpufab describe` view, and a line on what to do about a preempted node."""
    console.print(details_table(item))
    if isinstance(item, (Node, MultisliceInfo)):
        for line in preempted_notes(item.slices if isinstance(item, MultisliceInfo)
                                    else [item]):
            console.print(line)


def default_name(user: str, accelerator_type: str) -> str:
    """`<user>-<type>` as a valid node name: `alice-v4-512`; `tpu-v6e-8` for odd user names."""
    person = re.sub(r"[^a-z0-9-]+", "-", user.lower()).strip("-")
    name = f"{person}-{accelerator_type}" if person[:1].isalpha() else f"tpu-{accelerator_type}"
    return name if NAME_RE.match(name) and len(name) <= 40 else f"tpu-{accelerator_type}"
