"""create / delete / list / describe a pod, on whichever control plane holds it.

Operations check state first and are idempotent: creating a READY node of the same type only
makes sure the tpufab SSH key is in its metadata; deleting a missing node says so. Waiting is
a poll with a live status line (state and elapsed time), bounded by settings.wait_timeout.
What is printed goes to the ``console`` the caller hands in (its sink); the tables of `list`
and `describe` are tpufab/views/nodes.py's.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from tpufab.cloud.names import validate_name
from tpufab.cloud.nodes import MultisliceInfo, Node, QueuedResourceInfo
from tpufab.cloud.planes import PLANES, control_plane
from tpufab.cloud.planes.any import ambiguous, quietly
from tpufab.cloud.planes.calls import Stockout
from tpufab.cloud.waiting import console_or_stdout, elapsed, escape, wait_for, wait_retry
from tpufab.config import Settings
from tpufab.durations import human_duration
from tpufab.errors import ConfigError, NotFound, TpufabError
from tpufab.topology import parse_accelerator_type

if TYPE_CHECKING:
    from rich.console import Console

    from tpufab.cloud.planes.base import ControlPlane


# ---------------------------------------------------------------------------------------------
# create


def stockout_delay(attempt: int, base: float, cap: float = 300.0) -> float:
    """Seconds before retry round ``attempt`` (0, 1, ...): base, 2*base, ... at most ``cap``."""
    return min(cap, base * 2 ** attempt)


def _maker(control: ControlPlane, settings: Settings) -> ControlPlane:
    """The plane of ``control`` a create of ``settings.type`` goes to."""
    choose = getattr(control, "maker", None)
    return choose(settings.type) if choose is not None else control


def refuse_rivals(plane: ControlPlane, name: str) -> None:
    """One sentence when another plane already holds ``name``: a name is one pod's, on one
    plane (every verb refuses a name two planes hold)."""
    holders = [r for r in plane.rivals if quietly(r.holds, name, default=False)
               or quietly(r.has_multislice, name, default=False)]
    if holders:
        raise ambiguous(name, plane.zone, [plane, *holders]) if \
            quietly(plane.holds, name, default=False) else ConfigError(
            f"{name!r} is already a {holders[0].node_kind} in {plane.zone}, and a name is one "
            f"pod's: pick another --name (or delete that one first, `tpufab delete --name "
            f"{name}`).")


def create(settings: Settings, *, queued: bool = False, num_slices: int = 1, async_: bool = False,
           console: Console | None = None, control: ControlPlane | None = None,
           zones: Sequence[str] | None = None, retry_for: float | None = None,
           reservation: str | None = None, topology: str | None = None,
           retry_base: float = 30.0,
           clock: Callable[[], float] = time.monotonic,
           sleep: Callable[[float], None] = time.sleep) -> list[Node]:
    """Create node ``settings.name`` (or a queued resource, or a multislice) on the plane that
    makes its type, and wait until it is READY.

    Returns the node(s) as last seen (several for a multislice; possibly none with
    ``async_``). On a stockout, ``zones`` are tried in order (``settings.zone`` is left at the
    zone that had capacity); ``retry_for`` seconds keeps going round them with backoff (from
    ``retry_base``) and a live status line. Quota and every other error stop at once.
    ``reservation`` consumes that named reservation (through a queued resource where the
    plane does it so). ``topology`` (``"4x4x4"``): a custom chip shape, checked against the
    generation's rules before any API call. A name another plane holds is refused.
    """
    console = console_or_stdout(console)
    maker = _maker(control_plane(settings, control), settings)
    if settings.type and not maker.offers(parse_accelerator_type(settings.type)):
        raise ConfigError(maker.not_offered(parse_accelerator_type(settings.type)))
    zone_list = list(dict.fromkeys(z.strip() for z in (zones or ()) if z and z.strip()))
    if reservation and maker.reservations_queue:
        if not queued and num_slices <= 1:
            console.print("A reservation is consumed through a queued resource: creating one "
                          "(as with --queued).")
        queued = True
    if (len(zone_list) > 1 or retry_for) and (queued or num_slices > 1):
        raise ConfigError("--zones and --retry-for work for TPU nodes; a queued resource "
                          "already waits in line for capacity in its zone: drop --queued "
                          "(and --num-slices/--reservation) or drop --zones/--retry-for.")

    def create_in(here: Settings, mine: ControlPlane | None) -> list[Node]:
        plane = _maker(control_plane(here, mine), here)
        refuse_rivals(plane, validate_name(here.name, num_slices=num_slices))
        return plane.create_pod(here, queued=queued, num_slices=num_slices, async_=async_,
                                console=console, reservation=reservation, topology=topology)

    if not zone_list and not retry_for:
        return create_in(settings, control)
    zone_list = zone_list or [settings.zone]
    deadline = clock() + (retry_for or 0.0)
    attempt = 0
    while True:
        last: Stockout | None = None
        for i, zone in enumerate(zone_list):
            here = replace(settings, zone=zone)
            try:
                nodes = create_in(here, control if control is not None and
                                  control.zone == zone else None)
            except Stockout as err:
                last = err
                if i + 1 < len(zone_list):
                    console.print(f"[yellow]No {escape(here.type)} capacity in {zone} right "
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
                f"{attempt + 1}, giving up in {{left}})")  # placeholders filled by wait_retry
        wait_retry(console, delay, line=line, deadline=deadline, clock=clock, sleep=sleep)


# ---------------------------------------------------------------------------------------------
# delete


def confirm_on_terminal(question: str, console: Console) -> bool:
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


def read_slices(control: ControlPlane, names: Sequence[str]) -> list[Slice]:
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


def read_doomed(control: ControlPlane, kind: str, name: str) -> Doomed | None:
    """What deleting ``kind`` ``name`` would take now; None when it is gone."""
    if kind == "node":
        node = control.find_node(name)
        return Doomed("node", name, (Slice.of(node),), node.state, node.accelerator_type) \
            if node is not None else None
    qr = control.find_queued_resource(name)
    if qr is None:
        return None
    return Doomed("queued resource", name, tuple(read_slices(control, qr.node_ids)), qr.state,
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
        gone = read_doomed(control, doomed.kind, doomed.name)
        return (gone.state, False) if gone else ("DELETED", True)

    wait_for(probe, what=label, timeout=settings.wait_timeout, console=console,
             check_hint=f"check it with `tpufab describe --name {check_name}`, ")
    if control.removed:  # what the plane made for the node went with it
        console.print(f"Deleted with it: {escape(', '.join(control.removed))}.")
    if control.left_alone:
        console.print(f"[yellow]Left alone: {escape(', '.join(control.left_alone))}.[/yellow]")
    return time.monotonic() - started


def delete(settings: Settings, *, yes: bool = False, console: Console | None = None,
           control: ControlPlane | None = None,
           confirm: Callable[[str, Console], bool] = confirm_on_terminal,
           deletable: Callable[[Doomed], str | None] | None = None) -> bool:
    """Delete node ``settings.name`` (or the queued resource it belongs to, or the multislice
    of that name) and wait until gone.

    What goes is re-read just before the delete: a node recreated under the name since it was
    shown (another id), or one ``deletable`` refuses (its sentence), is left alone and said
    so. Returns False when there was nothing to delete, it was left alone or the user said no.
    """
    console = console_or_stdout(console)
    name = validate_name(settings.name)
    settings.project = settings.require("project")
    control = control_plane(settings, control)
    node = control.find_node(name)
    qr_name = node.queued_resource if node is not None else None
    qr = control.find_queued_resource(qr_name or name) if node is None or qr_name else None
    where = f"{settings.zone} (project {settings.project})"
    if node is None and qr is None:
        slices = control.multislice(name)
        if slices:  # a multislice of the plane's own: each slice, as `delete --name NAME-i`
            text = ", ".join(n.name for n in slices)
            if not yes and not confirm(f"Delete multislice {name} ({escape(text)}) in "
                                       f"{escape(where)}?", console):
                console.print("Not deleted.")
                return False
            return all([delete(replace(settings, name=n.name), yes=True,
                               console=console, control=control, deletable=deletable)
                        for n in slices])
        console.print(f"No TPU node named {name} in {escape(where)}; nothing to delete.")
        return False

    if qr is not None:
        listed = Doomed("queued resource", qr.name, tuple(read_slices(control, qr.node_ids)),
                        qr.state, qr.accelerator_type)
    else:
        assert node is not None
        listed = Doomed("node", name, (Slice.of(node),), node.state, node.accelerator_type)
    if not yes and not confirm(f"Delete {escape(listed.text)} in {escape(where)}?", console):
        console.print("Not deleted.")
        return False
    return delete_listed(control, listed, settings=settings, console=console,
                         check_name=name, deletable=deletable)


def delete_listed(control: ControlPlane, listed: Doomed, *, settings: Settings,
                  console: Console, check_name: str,
                  deletable: Callable[[Doomed], str | None] | None = None) -> bool:
    """Re-read ``listed``, delete it if it is still what was listed, say exactly what went."""
    now = read_doomed(control, listed.kind, listed.name)
    why = changed_since(listed, now, deletable)
    if why:
        console.print(f"[yellow]{escape(why)}[/yellow]")
        return False
    assert now is not None
    seconds = _delete_and_wait(control, now, settings=settings, console=console,
                               check_name=check_name)
    console.print(f"[green]Deleted {escape(now.text)}[/green] in {elapsed(seconds)}.")
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
                console.print(f"The jump host {escape(bastion.key_alias)} went with it: "
                              f"forgot its pinned host key ({escape(known.path)}); the next "
                              "one is pinned afresh, its fingerprint shown.")
    except (OSError, ConfigError) as err:
        console.print(f"[yellow]Could not forget the host keys pinned for it "
                      f"({escape(err)}).[/yellow]")


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
    it; else the multislice of that name a plane groups itself (Compute Engine's ``create
    --num-slices N``), as verbs given the name find them (hosts.connect.resolve_nodes). A
    name that is both a node (or queued resource) and a multislice, or a node on two planes,
    is one sentence."""
    name = validate_name(name or settings.name)
    settings.project = settings.require("project")
    control = control_plane(settings, control)
    try:
        node = control.get_node(name)   # on every plane, when nothing says which: a name
    except NotFound:                    # on two is one sentence here
        node = None
    qr = control.find_queued_resource(name) if node is None else None
    slices = control.multislice(name) if control.has_multislice(name) else []
    if slices and (node is not None or qr is not None):
        raise ConfigError(two_things(name, node, qr, slices))
    if node is not None:
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


def two_things(name: str, node: Node | None, qr: QueuedResourceInfo | None,
               slices: Sequence[Node]) -> str:
    """The sentence for a name that is a node (or queued resource) and a multislice too."""
    kind = _node_kind(node) if node is not None else "queued resource"
    multi = f"{slices[0].plane_title} multislice"
    return (f"{name!r} names both the {kind} {name} and the {multi} "
            f"{name} ({', '.join(n.name for n in slices)}), and tpufab does not guess which "
            f"one is meant; delete or rename one of them (`tpufab delete --name {name}` "
            f"deletes the {kind}), or name one slice of the multislice "
            f"(`--name {slices[0].name}`).")


def _node_kind(node: Node) -> str:
    """What a node is called on its plane ("Compute Engine TPU slice", "Cloud TPU API
    node")."""
    plane = PLANES.get(node.plane)
    return plane.node_kind if plane is not None else "TPU node"


# ---------------------------------------------------------------------------------------------
# The listing (`tpufab list`; tpufab.views.nodes shows it)


@dataclass
class Listing:
    """`tpufab list`: the zone's nodes, and (when asked for) queued resources still waiting."""

    settings: Settings
    nodes: list[Node]
    waiting: list[QueuedResourceInfo]

    def to_json(self) -> list[dict]:
        return [n.to_json() for n in self.nodes]


def listing(settings: Settings, *, waiting: bool = True,
            control: ControlPlane | None = None) -> Listing:
    """The nodes of the zone and, with ``waiting``, the queued resources without nodes yet."""
    nodes = list_nodes(settings, control=control)
    queued = list_waiting_queued_resources(settings, control=control) if waiting else []
    return Listing(settings, nodes, queued)
