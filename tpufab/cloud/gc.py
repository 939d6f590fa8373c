"""`tpufab gc`: what only costs quota (preempted, terminated and failed nodes; suspended and
failed queued resources), and what tpufab made for a node that is gone and only holds its name
(a plane's ``leftovers``), deleted after asking, each re-read just before its delete."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from tpufab.cloud.lifecycle import Doomed, Slice, confirm_on_terminal, delete_listed, slices_text
from tpufab.cloud.names import validate_project
from tpufab.cloud.nodes import Node, QueuedResourceInfo
from tpufab.cloud.planes import control_plane
from tpufab.cloud.waiting import console_or_stdout, escape
from tpufab.config import Settings
from tpufab.errors import ApiError

if TYPE_CHECKING:
    from rich.console import Console

    from tpufab.cloud.planes.base import ControlPlane

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
       confirm: Callable[[str, Console], bool] = confirm_on_terminal) -> list[Garbage]:
    """Delete PREEMPTED/TERMINATED/FAILED nodes and SUSPENDED/FAILED queued resources in the
    zone (every zone with ``all_zones``), after asking; returns what was deleted.

    Each one is read again just before its delete: one recreated since the listing (another
    node id) or no longer dead is left alone, with a sentence."""
    console = console_or_stdout(console)
    settings.project = validate_project(settings.require("project"))
    control = control_plane(settings, control)
    zones = control.zones() if all_zones else [settings.zone]
    found: list[Garbage] = []
    left: list[tuple[ControlPlane, tuple[str, str, str]]] = []   # Compute Engine leftovers
    for zone in zones:
        here = control if zone == control.zone else control_plane(replace(settings, zone=zone))
        found += find_garbage(here.list_nodes(), here.list_queued_resources(), zone)
        left += [(here, item) for item in here.leftovers()]
    where = "any zone" if all_zones else f"{settings.zone}"
    if left:
        _gc_leftovers(left, yes=yes, console=console, confirm=confirm, more=bool(found))
    if not found and left:
        return []
    if not found:
        console.print(f"Nothing to collect in {escape(where)} (project {settings.project}): no "
                      "preempted, terminated or failed nodes, no suspended or failed queued "
                      "resources.")
        return []
    console.print(f"Found {len(found)} thing{'s' if len(found) != 1 else ''} that only cost "
                  "quota:")
    for g in found:
        console.print(f"  {escape(g.label)}" + (f": {escape(g.detail)}" if g.detail else ""))
    live = [s.name for g in found if g.kind != "node" for s in g.slices
            if s.state not in GC_NODE_STATES]
    if live:
        console.print(f"[yellow]Deleting a queued resource deletes all its slices: "
                      f"{escape(', '.join(live))} {'is' if len(live) == 1 else 'are'} not "
                      "dead and will be deleted too.[/yellow]")
    if not yes and not confirm(f"Delete {'them' if len(found) > 1 else 'it'}?", console):
        console.print("Nothing deleted.")
        return []
    deleted, skipped = [], 0
    for g in found:
        here = replace(settings, zone=g.zone, name=g.name)
        mine = control if g.zone == control.zone else control_plane(here)
        try:
            gone = delete_listed(mine, g.doomed, settings=here, console=console,
                                  check_name=g.name, deletable=g.deletable)
        except ApiError as err:
            console.print(f"[red]Could not delete {escape(g.label)}: {escape(err)}[/red]")
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
        console.print(f"  {kind} {escape(name)} (made by tpufab for slice {escape(owner)})")
    if not yes and not confirm(f"Delete {'them' if len(left) > 1 else 'it'}?", console):
        console.print("No leftover deleted.")
        return
    gone = 0
    for plane, (kind, name, owner) in left:
        why = plane.delete_leftover(kind, name, owner)
        if why:
            console.print(f"[yellow]Left alone: {escape(why)}.[/yellow]")
        else:
            gone += 1
    console.print(f"Deleted {gone} of {len(left)} leftover{'s' if len(left) != 1 else ''}." +
                  (" Now the nodes:" if more else ""))
