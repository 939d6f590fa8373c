"""Node lifecycle verbs: create, delete, list, describe, types, known-hosts forget."""

from __future__ import annotations

from collections.abc import Iterable

from tpufab.verbs.common import count, print_json, settings_from_flags


def create(*, name: str | None = None, type: str | None = None,
           accelerator_type: str | None = None, zone: str | None = None,
           project: str | None = None, version: str | None = None, spot: bool = False,
           preemptible: bool = False, reserved: bool = False, queued: bool = False,
           num_slices: int = 1, async_: bool = False,
           labels: Iterable[str] | None = None) -> None:
    from tpufab import lifecycle

    settings = settings_from_flags(name=name, type=type, accelerator_type=accelerator_type,
                                   zone=zone, project=project, version=version, spot=spot,
                                   preemptible=preemptible, reserved=reserved, labels=labels)
    lifecycle.create(settings, queued=queued, num_slices=num_slices, async_=async_)


def delete(*, name: str | None = None, yes: bool = False, zone: str | None = None,
           project: str | None = None) -> None:
    from tpufab import lifecycle

    settings = settings_from_flags(name=name, zone=zone, project=project)
    lifecycle.delete(settings, yes=yes)


def list_(*, as_json: bool = False, zone: str | None = None, project: str | None = None) -> None:
    from tpufab import lifecycle
    from tpufab.console import stdout

    settings = settings_from_flags(zone=zone, project=project)
    nodes = lifecycle.list_nodes(settings)
    if as_json:
        print_json([n.to_json() for n in nodes])
        return
    console = stdout()
    waiting = lifecycle.list_waiting_queued_resources(settings)
    if not nodes and not waiting:
        console.print(f"No TPU nodes in {settings.zone} (project {settings.project}).")
        return
    if nodes:
        console.print(lifecycle.nodes_table(nodes))
    if waiting:
        console.print()
        console.print(lifecycle.queued_table(waiting))
    for note in lifecycle.preempted_notes(nodes):
        console.print(note)


def describe(*, name: str | None = None, as_json: bool = False, zone: str | None = None,
             project: str | None = None) -> None:
    from tpufab import lifecycle
    from tpufab.console import stdout

    settings = settings_from_flags(name=name, zone=zone, project=project)
    item = lifecycle.describe(settings)
    if as_json:
        print_json(item.to_json())
        return
    console = stdout()
    console.print(lifecycle.details_table(item))
    if isinstance(item, lifecycle.Node):
        for note in lifecycle.preempted_notes([item]):
            console.print(note)


def types(*, as_json: bool = False) -> None:
    """Every accelerator type tpufab knows: hosts, chips, default runtime, device files."""
    from tpufab.topology import all_accelerator_types, parse_accelerator_type

    shapes = [parse_accelerator_type(t) for t in all_accelerator_types()]
    if as_json:
        print_json([{"type": s.name, "generation": s.generation, "chips": s.chips,
                      "cores": s.cores, "hosts": s.hosts, "chips_per_host": s.chips_per_host,
                      "default_runtime": s.default_runtime, "device_files": list(s.device_files)}
                     for s in shapes])
        return
    from rich.table import Table

    from tpufab.console import stdout

    table = Table(box=None, pad_edge=False, header_style="bold")
    for column in ("TYPE", "HOSTS", "CHIPS", "CHIPS/HOST", "DEFAULT RUNTIME", "DEVICE FILES"):
        table.add_column(column)
    for s in shapes:
        files = s.device_files
        shown = files[0] if len(files) == 1 else f"{files[0]} .. {files[-1]}"
        table.add_row(s.name, str(s.hosts), str(s.chips), str(s.chips_per_host),
                      s.default_runtime, shown)
    stdout().print(table)


def known_hosts_forget(*, node: str, zone: str | None = None, project: str | None = None) -> None:
    """Drop the host keys tpufab pinned for a node (by node id, or by name via the API)."""
    from tpufab.console import stdout
    from tpufab.hostkeys import KnownHosts

    settings = settings_from_flags(zone=zone, project=project)
    node_id = node
    if not node.isdigit():
        from tpufab import lifecycle

        node_id = lifecycle.control_plane(settings).get_node(lifecycle.validate_name(node)).id
    removed = KnownHosts(settings.known_hosts_path).forget(node_id)
    stdout().print(f"Forgot {count(removed, 'pinned host key')} of node {node} "
                   f"({settings.known_hosts_path}); the next connection pins the keys again.",
                   markup=False)
