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

from tpufab import sshkeys
from tpufab.config import Settings
from tpufab.controlplane import (
    AlreadyExists,
    ControlPlane,
    Stockout,
    node_body,
    queued_resource_body,
    scheduling_tier,
)
from tpufab.errors import ApiError, ConfigError, TpufabError
from tpufab.nodes import DEAD_STATES, Node, QueuedResourceInfo
from tpufab.topology import parse_accelerator_type, slice_shape

if TYPE_CHECKING:
    from rich.console import Console, RenderableType

NAME_RE = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
MAX_NAME = 63


def validate_name(name: str | None, *, num_slices: int = 1) -> str:
    """A valid node name, or one sentence saying what is wrong with it."""
    if name is None or name == "":
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


def _console(console: Console | None) -> Console:
    if console is not None:
        return console
    from tpufab.console import stdout

    return stdout()


def _escape(text: object) -> str:
    from rich.markup import escape

    return escape(str(text))


def _elapsed(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"


def control_plane(settings: Settings, control: ControlPlane | None = None) -> ControlPlane:
    """``control`` if given, else a ControlPlane that notes each retry on stderr."""
    if control is not None:
        return control

    def on_retry(exc: BaseException, attempt: int, delay: float) -> None:
        from tpufab.console import stderr
        from tpufab.controlplane import status_name

        stderr().print(f"[dim]TPU API busy ({_escape(status_name(exc))}); retrying in "
                       f"{delay:.1f}s (attempt {attempt + 1}).[/dim]")

    return ControlPlane(settings, on_retry=on_retry)


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


def parse_duration(text: str | float | int | None, flag: str) -> float | None:
    """``90``, ``90s``, ``30m``, ``2h``, ``1d``, ``1h30m`` -> seconds; None stays None."""
    if text is None or text == "":
        return None
    if isinstance(text, int | float) and not isinstance(text, bool):
        seconds = float(text)
    else:
        raw = str(text).strip().lower()
        parts = re.findall(r"(\d+(?:\.\d+)?)\s*([smhd]?)", raw)
        if not parts or re.sub(r"(\d+(?:\.\d+)?)\s*([smhd]?)", "", raw).strip():
            raise ConfigError(f"{flag} takes a duration such as 90s, 30m, 2h or 1h30m, not "
                              f"{text!r}.")
        unit = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}
        seconds = sum(float(n) * unit[u] for n, u in parts)
    if seconds <= 0:
        raise ConfigError(f"{flag} must be longer than 0, not {text!r}.")
    return seconds


def human_duration(seconds: float) -> str:
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m" + (f"{seconds % 60:02d}s" if seconds % 60 else "")
    hours, rest = divmod(seconds, 3600)
    return f"{hours}h" + (f"{rest // 60:02d}m" if rest // 60 else "")


def stockout_delay(attempt: int, base: float, cap: float = 300.0) -> float:
    """Seconds before retry round ``attempt`` (0, 1, ...): base, 2*base, ... at most ``cap``."""
    return min(cap, base * 2 ** attempt)


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
    zone_list = list(dict.fromkeys(z.strip() for z in (zones or ()) if z and z.strip()))
    if reservation:
        if not queued and num_slices <= 1:
            console.print("A reservation is consumed through a queued resource: creating one "
                          "(as with --queued).")
        queued = True
    if (len(zone_list) > 1 or retry_for) and (queued or num_slices > 1):
        raise ConfigError("--zones and --retry-for work for TPU nodes; a queued resource "
                          "already waits in line for capacity in its zone: drop --queued "
                          "(and --num-slices/--reservation) or drop --zones/--retry-for.")
    if not zone_list and not retry_for:
        return _create(settings, queued=queued, num_slices=num_slices, async_=async_,
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
                nodes = _create(here, queued=queued, num_slices=num_slices, async_=async_,
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
        return node.state, node.ready

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


def delete(settings: Settings, *, yes: bool = False, console: Console | None = None,
           control: ControlPlane | None = None,
           confirm: Callable[[str, Console], bool] = _confirm) -> bool:
    """Delete node ``settings.name`` (or the queued resource it belongs to) and wait until gone.

    Returns False when there was nothing to delete or the user said no.
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
        console.print(f"No TPU node named {name} in {_escape(where)}; nothing to delete.")
        return False

    if qr is not None:
        slices = ", ".join(qr.node_ids) or "no nodes yet"
        what = f"queued resource {qr.name} ({qr.accelerator_type}, {qr.state}; nodes: {slices})"
    else:
        assert node is not None
        what = f"TPU node {name} ({node.accelerator_type}, {_hosts(node.hosts)}, {node.state})"
    if not yes and not confirm(f"Delete {_escape(what)} in {_escape(where)}?", console):
        console.print("Not deleted.")
        return False

    started = time.monotonic()
    if qr is not None:
        control.delete_queued_resource(qr.name, force=True)

        def probe() -> tuple[str, bool]:
            current = control.find_queued_resource(qr.name)
            return (current.state, False) if current else ("DELETED", True)

        label = f"Queued resource {qr.name}"
    else:
        control.delete_node(name)

        def probe() -> tuple[str, bool]:
            current = control.find_node(name)
            return (current.state, False) if current else ("DELETED", True)

        label = f"TPU node {name}"
    wait_for(probe, what=label, timeout=settings.wait_timeout, console=console,
             check_hint=f"check it with `tpufab describe --name {name}`, ")
    console.print(f"[green]Deleted {_escape(what)}[/green] in "
                  f"{_elapsed(time.monotonic() - started)}.")
    return True


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

    @property
    def label(self) -> str:
        what = "TPU node" if self.kind == "node" else "queued resource"
        return f"{what} {self.name} ({self.accelerator_type}, {self.state}) in {self.zone}"


def find_garbage(nodes: Sequence[Node], queued: Sequence[QueuedResourceInfo],
                 zone: str) -> list[Garbage]:
    """Dead nodes and failed or suspended queued resources (pure). A node that belongs to a
    queued resource in the list goes with it (deleting the queued resource deletes it)."""
    out: list[Garbage] = []
    dead_qrs = {qr.name for qr in queued if qr.state in GC_QUEUED_STATES}
    for qr in sorted(queued, key=lambda q: q.name):
        if qr.name in dead_qrs:
            out.append(Garbage("queued resource", qr.name, zone, qr.state, qr.accelerator_type,
                               qr.failure or ""))
    for node in sorted(nodes, key=lambda n: n.name):
        if node.state in GC_NODE_STATES and node.queued_resource not in dead_qrs:
            if node.queued_resource:  # a dead node of a live queued resource: delete them both
                out.append(Garbage("queued resource", node.queued_resource, zone,
                                   f"node {node.name} {node.state}", node.accelerator_type))
            else:
                out.append(Garbage("node", node.name, zone, node.state, node.accelerator_type))
    seen: set[tuple[str, str]] = set()
    return [g for g in out if (g.kind, g.name) not in seen and not seen.add((g.kind, g.name))]


def gc(settings: Settings, *, yes: bool = False, all_zones: bool = False,
       console: Console | None = None, control: ControlPlane | None = None,
       confirm: Callable[[str, Console], bool] = _confirm) -> list[Garbage]:
    """Delete PREEMPTED/TERMINATED/FAILED nodes and SUSPENDED/FAILED queued resources in the
    zone (every zone with ``all_zones``), after asking; returns what was deleted."""
    console = _console(console)
    settings.project = settings.require("project")
    control = control_plane(settings, control)
    zones = control.zones() if all_zones else [settings.zone]
    found: list[Garbage] = []
    for zone in zones:
        here = control if zone == control.zone else control_plane(replace(settings, zone=zone))
        found += find_garbage(here.list_nodes(), here.list_queued_resources(), zone)
    where = "any zone" if all_zones else f"{settings.zone}"
    if not found:
        console.print(f"Nothing to collect in {_escape(where)} (project {settings.project}): no "
                      "preempted, terminated or failed nodes, no suspended or failed queued "
                      "resources.")
        return []
    console.print(f"Found {len(found)} thing{'s' if len(found) != 1 else ''} that only cost "
                  "quota:")
    for g in found:
        console.print(f"  {_escape(g.label)}" + (f": {_escape(g.detail)}" if g.detail else ""))
    if not yes and not confirm(f"Delete {'them' if len(found) > 1 else 'it'}?", console):
        console.print("Nothing deleted.")
        return []
    deleted = []
    for g in found:
        here = replace(settings, zone=g.zone, name=g.name)
        mine = control if g.zone == control.zone else None
        try:
            if g.kind == "node":
                gone = delete(here, yes=True, console=console, control=mine)
            else:
                gone = _delete_queued(here, g.name, console=console, control=mine)
        except ApiError as err:
            console.print(f"[red]Could not delete {_escape(g.label)}: {_escape(err)}[/red]")
            continue
        if gone:
            deleted.append(g)
    failed = len(found) - len(deleted)
    console.print(f"Deleted {len(deleted)} of {len(found)}" +
                  (f"; {failed} could not be deleted (see above)." if failed else "."))
    if failed:
        raise ApiError(f"gc could not delete {failed} of {len(found)}; run `tpufab gc` again "
                       "or delete them with `tpufab delete --name NAME --yes`.")
    return deleted


def _delete_queued(settings: Settings, name: str, *, console: Console,
                   control: ControlPlane | None) -> bool:
    control = control_plane(settings, control)
    if control.find_queued_resource(name) is None:
        return False
    started = time.monotonic()
    control.delete_queued_resource(name, force=True)

    def probe() -> tuple[str, bool]:
        current = control.find_queued_resource(name)
        return (current.state, False) if current else ("DELETED", True)

    wait_for(probe, what=f"Queued resource {name}", timeout=settings.wait_timeout,
             console=console, check_hint=f"check it with `tpufab describe --name {name}`, ")
    console.print(f"[green]Deleted queued resource {_escape(name)}[/green] in "
                  f"{_elapsed(time.monotonic() - started)}.")
    return True


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


def describe(settings: Settings, name: str | None = None, *,
             control: ControlPlane | None = None) -> Node | QueuedResourceInfo:
    """Node ``name`` (default settings.name); a queued resource of that name if no node has it."""
    name = validate_name(name or settings.name)
    settings.project = settings.require("project")
    control = control_plane(settings, control)
    node = control.find_node(name)
    if node is not None:
        return node
    qr = control.find_queued_resource(name)
    if qr is not None:
        return qr
    return control.get_node(name)  # raises the NotFound sentence


_STATE_STYLE = {"READY": "green", "ACTIVE": "green", "PREEMPTED": "bold red", "FAILED": "bold red",
                "TERMINATED": "red", "STOPPED": "yellow", "CREATING": "yellow",
                "DELETING": "yellow", "PROVISIONING": "yellow",
                "WAITING_FOR_RESOURCES": "yellow"}


def _state_text(state: str) -> str:
    style = _STATE_STYLE.get(state)
    return f"[{style}]{state}[/{style}]" if style else state


def _created(node: Node | QueuedResourceInfo) -> str:
    return node.created.strftime("%Y-%m-%d %H:%M") if node.created else "-"


def nodes_table(nodes: list[Node]) -> RenderableType:
    """The `tpufab list` table."""
    from rich.table import Table

    from tpufab.autostop import METADATA_KEY, list_cell

    table = Table(title=None, box=None, pad_edge=False, header_style="bold")
    autostop = any(METADATA_KEY in node.metadata for node in nodes)
    columns = ["NAME", "TYPE", "STATE", "HEALTH", "HOSTS", "WORKER IPS", "SPOT", "CREATED"]
    for column in columns + (["AUTOSTOP"] if autostop else []):
        table.add_column(column, overflow="fold")
    for node in nodes:
        cells = [_escape(node.name), node.accelerator_type, _state_text(node.state),
                 node.health or "-", str(node.hosts), " ".join(node.addresses()) or "-",
                 "yes" if node.spot or node.preemptible else "no", _created(node)]
        if autostop:
            cells.append(list_cell(node.metadata))
        table.add_row(*cells)
    return table


def queued_table(resources: list[QueuedResourceInfo]) -> RenderableType:
    from rich.table import Table

    table = Table(box=None, pad_edge=False, header_style="bold")
    for column in ("QUEUED RESOURCE", "TYPE", "STATE", "TIER", "NODES", "CREATED"):
        table.add_column(column, overflow="fold")
    for qr in resources:
        table.add_row(_escape(qr.name), qr.accelerator_type, _state_text(qr.state), qr.tier,
                      ", ".join(qr.node_ids), _created(qr))
    return table


def preempted_notes(nodes: list[Node]) -> list[str]:
    return [f"[bold red]{n.name} was PREEMPTED[/bold red] (it still counts against quota); "
            f"recover with `tpufab delete --name {n.name} --yes`, then create it again."
            for n in nodes if n.preempted]


def details_table(item: Node | QueuedResourceInfo) -> RenderableType:
    """The `tpufab describe` view: fields, then one row per worker."""
    from rich.console import Group
    from rich.table import Table

    fields = Table(box=None, show_header=False, pad_edge=False)
    fields.add_column(style="bold")
    fields.add_column(overflow="fold")
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
            ("runtime", node.runtime_version), ("tier", node.tier),
            ("zone", node.zone), ("project", node.project), ("created", _created(node)),
            ("id", node.id or "-")]
    if node.chip_topology:
        rows.insert(5, ("topology", node.chip_topology))
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
