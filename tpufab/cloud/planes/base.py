"""The control plane seam: ``ControlPlane``, everything tpufab asks of a cloud API for one project
and zone, declared once. lifecycle, gc, the Pod API, status, babysit, autostop and the
connection call only these members, on a plane ``tpufab.cloud.planes.control_plane(settings)``
makes; each plane is one module of this package and one line of its registry
(``tpufab/cloud/planes/__init__.py``; docs/control-plane.md)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar

from tpufab.cloud.nodes import Node, QueuedResourceInfo, UpcomingMaintenance
from tpufab.config import Settings
from tpufab.errors import NotFound
from tpufab.ssh.keys import SSH_KEYS, merge_entry

if TYPE_CHECKING:
    from rich.console import Console

    from tpufab.topology import Topology


class ControlPlane(ABC):
    """What tpufab asks of a control plane, for one project and zone. A plane subclasses this,
    sets the class attributes, and provides every abstract method with the same meaning,
    names and records (Python refuses to make an instance that lacks one, naming it):

    - who it is: ``name`` (what ``--on`` and ``TPUFAB_CONTROL_PLANE`` say, and
      ``Node.plane``), ``aliases``, ``title`` (the ON column), ``full_title`` (sentences),
      ``node_kind`` (what one of its nodes is called), ``offers(topology)`` (the accelerator
      types it has) and ``not_offered(topology)`` (the sentence when it has not);
    - nodes: ``get_node`` (NotFound when there is none), ``list_nodes``, ``create_node(name,
      body)`` (``body`` in the TPU API's field names, as ``bodies.node_body`` builds it: the
      plane translates it), ``delete_node`` (then ``removed`` and ``left_alone`` say what
      went beside the node and what stayed, with why), ``update_metadata(name, metadata)``
      (replaces the node's metadata: SSH keys, the autostop cell), ``host_keys(name)``;
    - creating: ``create_pod(settings, ...)``, the plane's whole create in one zone (a node,
      a queued resource, a multislice), waited for; ``reservations_queue`` says whether a
      reservation is consumed through a queued resource here;
    - queued (flex) capacity: ``create_queued_resource(name, body)``, ``get_queued_resource``,
      ``list_queued_resources``, ``delete_queued_resource(name, force=)``; a plane without it
      raises NotFound or ConfigError in one sentence;
    - waiting: the create/delete/update calls return an operation name;
      ``operation_done(op, verb, kind=, name=, accelerator_type=)`` says whether it finished
      and raises its error as one sentence; ``list_operations()``;
    - catalogue: ``zones()``, ``accelerator_types()``.

    Built on those, each with a default a plane may override: ``find_node``,
    ``find_queued_resource``, ``add_ssh_key``, ``holds`` (a cheap "is the name yours"),
    ``multislice``/``has_multislice`` (slices the plane groups itself under one name),
    ``upcoming_maintenance``, ``restore_worker_order``, ``watchdog`` (what autostop's
    watchdog needs to delete a node), ``leftovers``/``delete_leftover`` (what a gone node
    left that only holds its name). ``rivals`` are the other planes of the same settings,
    which ``create`` asks before it takes a name (set by the factory).

    Records are ``tpufab.cloud.nodes.Node`` and ``QueuedResourceInfo``; every failure leaves
    as a TpufabError whose message is one sentence with the fix (``planes.calls`` holds the
    retry policy and the sentences of the planes that use google-api-core)."""

    name: ClassVar[str] = ""
    aliases: ClassVar[tuple[str, ...]] = ()
    title: ClassVar[str] = ""
    full_title: ClassVar[str] = ""
    node_kind: ClassVar[str] = "TPU node"
    reservations_queue: ClassVar[bool] = False
    endpoint: str = ""

    def __init__(self, settings: Settings, *,
                 on_retry: Callable[[BaseException, int, float], None] | None = None):
        self.settings = settings
        self.on_retry = on_retry   # called before each retry of a call (the factory's note)
        self.project: str = settings.require("project")
        self.zone: str = settings.require("zone")
        self.removed: list[str] = []      # what the last delete_node removed beside the node
        self.left_alone: list[str] = []   # ... and what it left, with why
        self.rivals: list[ControlPlane] = []

    # -- who it is

    @classmethod
    def offers(cls, topology: Topology) -> bool:
        """Whether this plane has the accelerator type ``topology`` (tpufab.topology's table)."""
        return cls.name in topology.planes

    @classmethod
    def not_offered(cls, topology: Topology) -> str:
        """The sentence for a type this plane does not offer."""
        return f"{topology.name} is not offered by {cls.full_title}; drop --on {cls.name}."

    def stamp(self, node: Node) -> Node:
        """``node`` marked as this plane's (its records say where they came from)."""
        node.plane, node.plane_text, node.plane_title = self.name, self.title, self.full_title
        return node

    # -- nodes

    @abstractmethod
    def get_node(self, name: str) -> Node:
        """Node ``name``; NotFound (an ApiError) when there is none."""

    @abstractmethod
    def list_nodes(self) -> list[Node]:
        """Every node in the zone."""

    @abstractmethod
    def create_node(self, name: str, body: dict) -> str:
        """Start creating node ``name``; returns the long-running operation's name."""

    @abstractmethod
    def delete_node(self, name: str) -> str:
        """Start deleting node ``name``; returns the operation's name ("" when nothing is
        left to wait for). Sets ``removed`` and ``left_alone``."""

    @abstractmethod
    def update_metadata(self, name: str, metadata: dict[str, str]) -> str:
        """Replace node ``name``'s metadata; returns the operation's name."""

    @abstractmethod
    def host_keys(self, name: str, workers: list[int] | None = None) -> dict[int, dict[str, str]]:
        """Each worker's SSH host keys: {worker: {"ssh-ed25519": "ssh-ed25519 AAAA..."}}."""

    def find_node(self, name: str) -> Node | None:
        try:
            return self.get_node(name)
        except NotFound:
            return None

    def holds(self, name: str) -> bool:
        """Whether this plane has a node or queued resource called ``name`` (the check create
        and every verb make of the other planes: a plane may answer it more cheaply than
        ``find_node``)."""
        return self.find_node(name) is not None or self.find_queued_resource(name) is not None

    def add_ssh_key(self, node: Node, entry: str) -> str | None:
        """Add an `ssh-keys` entry to a node that lacks it; the operation name, or None if present."""
        current = node.metadata.get(SSH_KEYS)
        merged = merge_entry(current, entry)
        if merged == (current or ""):
            return None
        return self.update_metadata(node.name, {**node.metadata, SSH_KEYS: merged})

    def upcoming_maintenance(self, name: str) -> UpcomingMaintenance | None:
        """Node ``name``'s announced maintenance window, or None (none announced, or this
        control plane cannot say: the default)."""
        return None

    def multislice(self, name: str) -> list[Node]:
        """The slices this plane groups under ``name`` itself (not a queued resource), in
        slice order; [] when there is none (the default)."""
        return []

    def has_multislice(self, name: str) -> bool:
        """Whether ``multislice(name)`` would find slices: a cheap check (default: none)."""
        return False

    def restore_worker_order(self, node: Node) -> bool:
        """Write down the worker numbers of ``node`` where the plane keeps them and they are
        missing (``node.order_note`` says so); whether it did. Default: nothing to keep."""
        return False

    def watchdog(self, node: Node) -> dict[str, Any]:
        """What autostop's watchdog (tpufab/remote/autostop_worker.py) needs beyond the Cloud
        TPU API defaults to delete ``node``: {} for those defaults."""
        return {}

    # -- creating

    @abstractmethod
    def create_pod(self, settings: Settings, *, queued: bool, num_slices: int, async_: bool,
                   console: Console, reservation: str | None,
                   topology: str | None) -> list[Node]:
        """Create ``settings.name`` in this plane's zone and wait until it is READY (unless
        ``async_``): the node(s) as last seen. ``topology``: a custom chip shape."""

    # -- what a gone node left behind

    def leftovers(self) -> list[tuple[str, str, str]]:
        """``(kind, name, owner)`` of what tpufab made for a node that is gone and only holds a
        name (`tpufab gc` deletes them after asking); none by default."""
        return []

    def delete_leftover(self, kind: str, name: str, owner: str) -> str | None:
        """Delete one of ``leftovers()``: None when deleted, else why it stays (a phrase)."""
        return f"{kind} {name} (not something {self.full_title} makes)"

    # -- queued (flex-start, reserved, multislice) capacity

    @abstractmethod
    def create_queued_resource(self, name: str, body: dict) -> str:
        """Ask for queued capacity ``name``; returns the operation's name."""

    @abstractmethod
    def get_queued_resource(self, name: str) -> QueuedResourceInfo:
        """Queued resource ``name``; NotFound when there is none."""

    @abstractmethod
    def list_queued_resources(self) -> list[QueuedResourceInfo]:
        """Every queued resource in the zone."""

    @abstractmethod
    def delete_queued_resource(self, name: str, *, force: bool = True) -> str:
        """Delete a queued resource (``force``: and the nodes it made); the operation's name."""

    def find_queued_resource(self, name: str) -> QueuedResourceInfo | None:
        try:
            return self.get_queued_resource(name)
        except NotFound:
            return None

    # -- operations and catalogue

    @abstractmethod
    def operation_done(self, op_name: str, verb: str = "create", *,
                       kind: str = "node", name: str | None = None,
                       accelerator_type: str | None = None) -> bool:
        """Whether a long-running operation finished; if it failed, its error as a sentence."""

    @abstractmethod
    def list_operations(self) -> list[dict[str, Any]]:
        """The zone's long-running operations the control plane still keeps, newest first:
        each ``{"name", "verb", "target", "created" (unix time), "done", "node"}`` where
        ``node`` is the response of an update or create (a node record), else None (how
        ``lifecycle.vanished_note`` tells that autostop deleted a node)."""

    @abstractmethod
    def zones(self) -> list[str]:
        """Every zone of the project where this control plane answers."""

    @abstractmethod
    def accelerator_types(self) -> list[str]:
        """The accelerator types the zone offers."""
