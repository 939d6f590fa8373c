"""How `tpufab list` and `tpufab describe` show nodes: the list's table (fitted to the
terminal), the queued resources still waiting, the notes on preempted nodes and slices short of
VMs, and describe's fields and workers. Pure text from the cloud's records
(tpufab.cloud.nodes); ``state_text`` is the coloured state every node view shares."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tpufab.cloud.nodes import MultisliceInfo, Node, QueuedResourceInfo

if TYPE_CHECKING:
    from rich.console import Console, RenderableType

    from tpufab.cloud.lifecycle import Listing


def _escape(text: object) -> str:
    from rich.markup import escape

    return escape(str(text))


STATE_STYLE = {"READY": "green", "ACTIVE": "green", "PREEMPTED": "bold red", "FAILED": "bold red",
                "TERMINATED": "red", "STOPPED": "yellow", "CREATING": "yellow",
                "DELETING": "yellow", "PROVISIONING": "yellow",
                "WAITING_FOR_RESOURCES": "yellow"}


def state_text(state: str) -> str:
    style = STATE_STYLE.get(state)
    return f"[{style}]{state}[/{style}]" if style else state


def created_text(node: Node | QueuedResourceInfo) -> str:
    return node.created.strftime("%Y-%m-%d %H:%M") if node.created else "-"


def nodes_table(nodes: list[Node], console: Console) -> RenderableType:
    """The `tpufab list` table, fitted to ``console`` (tpufab.term.tables)."""
    from tpufab.cloud.nodes import AUTOSTOP_KEY, autostop_cell
    from tpufab.cloud.planes import PLANES
    from tpufab.term.tables import fitted

    autostop = any(AUTOSTOP_KEY in node.metadata for node in nodes)
    planes = any(node.plane and node.plane != PLANES.primary.name   # ON: which control
                 for node in nodes)                                 # plane, past the first
    columns = ["NAME", "TYPE", "STATE", "HEALTH", "HOSTS", "WORKER IPS", "SPOT", "CREATED"]
    rows = []
    for node in nodes:
        cells = [_escape(node.name), node.accelerator_type, state_text(node.state),
                 node.health or "-", str(node.hosts), " ".join(node.addresses()) or "-",
                 "yes" if node.spot or node.preemptible else "no", created_text(node)]
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
                  [(_escape(qr.name), qr.accelerator_type, state_text(qr.state), qr.tier,
                    ", ".join(qr.node_ids), created_text(qr)) for qr in resources], console)


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
                ("state", state_text(item.state)), ("hosts", str(item.hosts)),
                ("chips", str(shape.chips * len(item.slices)) if shape else "-"),
                ("slices", _escape(", ".join(f"{n.name} ({n.state})" for n in item.slices))),
                ("zone", item.zone), ("project", item.project),
                ("created", created_text(item.slices[0]) if item.slices else "-")]
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
                ("state", state_text(item.state)), ("tier", item.tier),
                ("nodes", ", ".join(item.node_ids)), ("runtime", item.runtime_version),
                ("zone", item.zone), ("project", item.project), ("created", created_text(item))]
        if item.failure:
            rows.append(("failure", _escape(item.failure)))
        for key, value in rows:
            fields.add_row(key, value)
        return fields
    node = item
    shape = node.topology
    rows = [("name", _escape(node.name)), ("type", node.accelerator_type),
            ("state", state_text(node.state)), ("health", node.health or "-"),
            ("hosts", str(node.hosts)),
            ("chips", f"{shape.chips} ({shape.chips_per_host} per host)" if shape else "-"),
            (node.runtime_label, node.runtime_version),
            ("tier", node.tier),
            ("zone", node.zone), ("project", node.project), ("created", created_text(node)),
            ("id", node.id or "-")]
    if node.chip_topology:
        rows.insert(5, ("topology", node.chip_topology))
    rows.insert(1, ("control plane", node.plane_text))
    rows += [(k, _escape(v)) for k, v in (   # what a plane of VMs says of them
        ("provisioning", node.provisioning_model), ("instance group", node.compute_group),
        ("instance template", node.compute_template),
        ("workload policy", node.compute_policy), ("worker order", node.order_note)) if v]
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


def show_listing(found: Listing, console: Console) -> None:
    """`tpufab list`: the nodes' table, the queued resources still waiting, the notes."""
    if not found.nodes and not found.waiting:
        console.print(f"No TPU nodes in {found.settings.zone} (project "
                      f"{found.settings.project}).")
        return
    if found.nodes:
        console.print(nodes_table(found.nodes, console))
    if found.waiting:
        console.print()
        console.print(queued_table(found.waiting, console))
    for line in preempted_notes(found.nodes):
        console.print(line)


def render_details(item: Node | QueuedResourceInfo | MultisliceInfo, console: Console) -> None:
    """The `tpufab describe` view, and a line on what to do about a preempted node."""
    console.print(details_table(item))
    if isinstance(item, (Node, MultisliceInfo)):
        for line in preempted_notes(item.slices if isinstance(item, MultisliceInfo)
                                    else [item]):
            console.print(line)
