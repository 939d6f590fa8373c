"""Every registered control plane side by side, for verbs that name a pod without saying where
it lives (``AnyPlane``): a name is looked up on each (on two: one sentence), a list shows them
all, and each call goes to the plane that holds the node. The first plane is asked first and
its failures always count; the others are only looked at (an API failure of theirs while
looking is left out, so a project without the Compute Engine API works as it always did), and
each answers "is the name yours" its cheapest way (``ControlPlane.holds``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tpufab.cloud.nodes import Node, QueuedResourceInfo, UpcomingMaintenance
from tpufab.cloud.planes.base import ControlPlane
from tpufab.config import Settings
from tpufab.errors import ApiError, ConfigError
from tpufab.topology import parse_accelerator_type

if TYPE_CHECKING:
    from rich.console import Console


def ambiguous(name: str, zone: str, holders: list[ControlPlane]) -> ConfigError:
    """The sentence for a name two planes hold (describe, every verb, create)."""
    kinds = " and ".join(f"a {p.node_kind}" for p in holders)
    which = " or =".join(p.name for p in holders)
    return ConfigError(
        f"{name!r} names both {kinds} in {zone}; say which with TPUFAB_CONTROL_PLANE={which} "
        "(or `control_plane:` in tpufab.yaml, `--on` for create).")


def quietly(fn, *args: Any, default: Any = None) -> Any:
    """``fn(*args)``, or ``default`` when its API fails: a plane that is only looked at."""
    try:
        return fn(*args)
    except ApiError:
        return default


class AnyPlane(ControlPlane):
    """``planes``: every registered plane for these settings, the first asked first."""

    name = "any"
    title = full_title = "any control plane"

    def __init__(self, settings: Settings, planes: list[ControlPlane]):
        super().__init__(settings)
        self.planes = planes
        self.primary = planes[0]
        self.endpoint = self.primary.endpoint
        self._home: dict[str, ControlPlane] = {}   # a name -> the plane found holding it
        self._ops: dict[str, ControlPlane] = {}    # an operation -> the plane that started it
        self._left: dict[tuple[str, str, str], ControlPlane] = {}
        for plane in planes:
            plane.rivals = [p for p in planes if p is not plane]

    @property
    def others(self) -> list[ControlPlane]:
        return self.planes[1:]

    def maker(self, type_name: str | None) -> ControlPlane:
        """The plane a create of ``type_name`` goes to: the first that offers it."""
        if type_name:
            shape = parse_accelerator_type(type_name)
            return next((p for p in self.planes if p.offers(shape)), self.primary)
        return self.primary

    # -- finding

    def _find(self, name: str) -> Node | None:
        """The node ``name`` on the one plane that holds it (two: one sentence). The first
        plane's find, then for a node there a cheap ``holds`` of the others; else a find
        on each of the others."""
        found = self.primary.find_node(name)
        if found is not None:
            rivals = [p for p in self.others if quietly(p.holds, name, default=False)]
            if rivals:
                raise ambiguous(name, self.zone, [self.primary, *rivals])
            self._home[name] = self.primary
            return found
        hits = [(p, n) for p in self.others
                if (n := quietly(p.find_node, name)) is not None]
        if len(hits) > 1:
            raise ambiguous(name, self.zone, [p for p, _ in hits])
        if hits:
            self._home[name] = hits[0][0]
            return hits[0][1]
        return None

    def _where(self, name: str) -> ControlPlane:
        """The plane holding ``name`` (found earlier, else looked up now)."""
        if name not in self._home:
            self._find(name)
        return self._home.get(name, self.primary)

    def find_node(self, name: str) -> Node | None:
        return self._find(name)

    def get_node(self, name: str) -> Node:
        found = self._find(name)
        return found if found is not None else self.primary.get_node(name)  # NotFound

    def holds(self, name: str) -> bool:
        return any(quietly(p.holds, name, default=False) for p in self.planes)

    def list_nodes(self) -> list[Node]:
        nodes = self.primary.list_nodes()
        for plane in self.others:
            nodes += quietly(plane.list_nodes, default=[])
        return nodes

    def multislice(self, name: str) -> list[Node]:
        for plane in self.planes:
            if quietly(plane.has_multislice, name, default=False):
                return quietly(plane.multislice, name, default=[])
        return []

    def has_multislice(self, name: str) -> bool:
        return any(quietly(p.has_multislice, name, default=False) for p in self.planes)

    # -- acting on the node's own plane

    def _started(self, plane: ControlPlane, op: str) -> str:
        self._ops[op] = plane
        self.removed, self.left_alone = list(plane.removed), list(plane.left_alone)
        return op

    def create_pod(self, settings: Settings, *, queued: bool, num_slices: int, async_: bool,
                   console: Console, reservation: str | None,
                   topology: str | None) -> list[Node]:
        return self.maker(settings.type).create_pod(
            settings, queued=queued, num_slices=num_slices, async_=async_, console=console,
            reservation=reservation, topology=topology)

    def create_node(self, name: str, body: dict) -> str:
        plane = self.maker(body.get("accelerator_type"))
        return self._started(plane, plane.create_node(name, body))

    def delete_node(self, name: str) -> str:
        self._find(name)   # on two planes: the sentence, before anything goes
        plane = self._where(name)
        return self._started(plane, plane.delete_node(name))

    def update_metadata(self, name: str, metadata: dict[str, str]) -> str:
        plane = self._where(name)
        return self._started(plane, plane.update_metadata(name, metadata))

    def upcoming_maintenance(self, name: str) -> UpcomingMaintenance | None:
        return self._where(name).upcoming_maintenance(name)

    def host_keys(self, name: str, workers: list[int] | None = None) -> dict[int, dict[str, str]]:
        return self._where(name).host_keys(name, workers)

    def restore_worker_order(self, node: Node) -> bool:
        return self._where(node.name).restore_worker_order(node)

    def watchdog(self, node: Node) -> dict[str, Any]:
        return self._where(node.name).watchdog(node)

    def leftovers(self) -> list[tuple[str, str, str]]:
        found = []
        for plane in self.planes:
            items = plane.leftovers() if plane is self.primary else \
                quietly(plane.leftovers, default=[])
            for item in items:
                self._left[item] = plane
                found.append(item)
        return found

    def delete_leftover(self, kind: str, name: str, owner: str) -> str | None:
        plane = self._left.get((kind, name, owner), self.primary)
        return plane.delete_leftover(kind, name, owner)

    # -- queued capacity: the planes that have it

    def create_queued_resource(self, name: str, body: dict) -> str:
        return self._started(self.primary, self.primary.create_queued_resource(name, body))

    def find_queued_resource(self, name: str) -> QueuedResourceInfo | None:
        found = self.primary.find_queued_resource(name)
        for plane in self.others:
            if found is not None:
                break
            found = quietly(plane.find_queued_resource, name)
        return found

    def get_queued_resource(self, name: str) -> QueuedResourceInfo:
        found = self.find_queued_resource(name)
        return found if found is not None else self.primary.get_queued_resource(name)

    def list_queued_resources(self) -> list[QueuedResourceInfo]:
        found = self.primary.list_queued_resources()
        for plane in self.others:
            found += quietly(plane.list_queued_resources, default=[])
        return found

    def delete_queued_resource(self, name: str, *, force: bool = True) -> str:
        plane = next((p for p in self.planes
                      if quietly(p.find_queued_resource, name) is not None), self.primary)
        return self._started(plane, plane.delete_queued_resource(name, force=force))

    # -- operations and catalogue

    def operation_done(self, op_name: str, verb: str = "create", *,
                       kind: str = "node", name: str | None = None,
                       accelerator_type: str | None = None) -> bool:
        plane = self._ops.get(op_name) or (self._where(name) if name else self.primary)
        return plane.operation_done(op_name, verb, kind=kind, name=name,
                                    accelerator_type=accelerator_type)

    def list_operations(self) -> list[dict[str, Any]]:
        found = self.primary.list_operations()
        for plane in self.others:
            found += quietly(plane.list_operations, default=[])
        return found

    def zones(self) -> list[str]:
        return self.primary.zones()

    def accelerator_types(self) -> list[str]:
        found = set(self.primary.accelerator_types())
        for plane in self.others:
            found |= set(quietly(plane.accelerator_types, default=[]))
        return sorted(found)
