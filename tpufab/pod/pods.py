"""Pods as cloud resources: what the node verbs (create, delete, gc, list, describe,
known-hosts forget) call; each reaches the cloud only through the control plane seam
(tpufab.cloud.lifecycle, docs/control-plane.md)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from tpufab.config import Settings, load_settings
from tpufab.pod.api import Pod

if TYPE_CHECKING:
    from rich.console import Console

    from tpufab.cloud.gc import Garbage
    from tpufab.cloud.lifecycle import Listing
    from tpufab.cloud.nodes import MultisliceInfo, Node, QueuedResourceInfo


def _settings(name: str | None, zone: str | None, project: str | None,
              overrides: Mapping[str, Any]) -> Settings:
    return load_settings({"name": name, "zone": zone, "project": project, **overrides})


def create(name: str | None = None, *, type: str | None = None, zone: str | None = None,
           project: str | None = None, queued: bool = False, num_slices: int = 1,
           **settings: Any) -> Pod:
    """Create a TPU VM node (idempotent for an existing READY node of the same type), wait
    until it is READY, and return it as a Pod."""
    from tpufab.cloud import lifecycle

    chosen = _settings(name, zone, project, {"type": type, **settings})
    lifecycle.create(chosen, queued=queued, num_slices=num_slices)
    _keep_ssh_config(chosen)
    return Pod(chosen.name, zone=chosen.zone, project=chosen.project, **settings)


def create_node(settings: Settings, *, queued: bool = False, num_slices: int = 1,
                async_: bool = False, zones: Sequence[str] | None = None,
                retry_for: float | None = None, reservation: str | None = None,
                topology: str | None = None, console: Console | None = None) -> list[Node]:
    """`tpufab create` with exactly these settings (name, type, tier, labels ...): create the
    node (or queued resource), trying ``zones`` in order on a stockout and retrying for
    ``retry_for`` seconds, and wait until READY (unless ``async_``). Returns the nodes;
    raises ApiError (quota, stockout, bad request) or ConfigError in one sentence."""
    from tpufab.cloud import lifecycle

    nodes = lifecycle.create(settings, queued=queued, num_slices=num_slices, async_=async_,
                             zones=zones, retry_for=retry_for, reservation=reservation,
                             topology=topology, console=console)
    if not async_:
        _keep_ssh_config(settings, console)
    return nodes


def gc(*, zone: str | None = None, project: str | None = None, all_zones: bool = False,
       yes: bool = True, console: Console | None = None, **settings: Any) -> list[Garbage]:
    """`tpufab gc`: delete preempted, terminated and failed nodes and suspended and failed
    queued resources (in the zone, or every zone); ``yes=False`` asks first (on a terminal),
    ``console`` hears what is found and deleted. Returns what was deleted."""
    from dataclasses import replace

    from tpufab.cloud import gc as garbage

    chosen = _settings(None, zone, project, settings)
    deleted = garbage.gc(chosen, yes=yes, all_zones=all_zones, console=console)
    for gone in deleted:
        _keep_ssh_config(replace(chosen, name=gone.name, zone=gone.zone), console, gone=True)
    if console is not None:
        from tpufab.flows.supervisor.vm import idle_supervisor

        idle = idle_supervisor(chosen)   # listed, not deleted: it may get a job any moment
        if idle is not None:
            console.print(f"The supervisor VM {idle.name} ({idle.machine_type}, {idle.zone}) "
                          "holds no live job: `tpufab supervisor down` deletes it (it also "
                          "deletes itself after supervisor_idle).")
    return deleted


def delete(name: str | None = None, *, zone: str | None = None,
           project: str | None = None, yes: bool = True, console: Console | None = None) -> bool:
    """`tpufab delete`: delete a TPU node (or its queued resource) and wait until it is gone
    (a no-op if there is none); ``yes=False`` asks first on a terminal. Returns whether
    something was deleted."""
    from tpufab.cloud import lifecycle
    from tpufab.hosts import connect

    chosen = _settings(name, zone, project, {})
    connect.forget(chosen)
    connect.stop_keepers(chosen, "`tpufab delete` is deleting the pod")  # its connections go
    deleted = lifecycle.delete(chosen, yes=yes, console=console)
    if deleted:
        _keep_ssh_config(chosen, console, gone=True)
    return deleted


def _keep_ssh_config(settings: Settings, console: Console | None = None, *,
                     gone: bool = False) -> None:
    """A created or deleted pod's entries in ~/.ssh/config follow it (`tpufab config-ssh`)."""
    from tpufab.steps.host.sshconfig import keep_current

    keep_current(settings, console, gone=gone)


def list_pods(*, zone: str | None = None, project: str | None = None, waiting: bool = True,
              **settings: Any) -> Listing:
    """`tpufab list`: the zone's TPU nodes (``.nodes``) and, with ``waiting``, its queued
    resources that have no nodes yet (``.waiting``); ``.to_json()``, ``.render(console)``."""
    from tpufab.cloud import lifecycle

    return lifecycle.listing(_settings(None, zone, project, settings), waiting=waiting)


def describe(name: str | None = None, *, zone: str | None = None, project: str | None = None,
             **settings: Any) -> Node | QueuedResourceInfo | MultisliceInfo:
    """`tpufab describe`: the node called ``name`` (a Node: state, health, workers and their
    IPs), or the queued resource of that name if no node has it, or the Compute Engine
    multislice of that name (a MultisliceInfo: ``.slices``); ``.to_json()``. Raises ApiError
    when there is none, ConfigError when the name is both a node and a multislice."""
    from tpufab.cloud import lifecycle

    return lifecycle.describe(_settings(name, zone, project, settings))


def forget_host_keys(node: str, *, zone: str | None = None, project: str | None = None,
                     **settings: Any) -> int:
    """`tpufab known-hosts forget`: drop the pinned host keys of ``node`` (a name, or the
    node id an error named); how many were removed."""
    from tpufab.hosts import connect

    return connect.forget_host_keys(_settings(None, zone, project, settings), node)
