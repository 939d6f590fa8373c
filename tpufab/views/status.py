"""How `tpufab status` shows (the view ``status`` of tpufab.views.report.show): the node
lines, the folded table of the workers, Ray, the TPU holders and what is wrong; ``--json`` is
the whole StatusReport in the shape docs/status.md gives (the nodes, the folded rows and every
worker's facts). Text from a worker or the API is shown as text (``_escape``)."""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from tpufab import nodeset
from tpufab.steps.host.images import status_line
from tpufab.steps.host.killing import PROTECTED_ADVICE
from tpufab.term.commands import short_command
from tpufab.term.terminal import neutralise_text

if TYPE_CHECKING:
    from rich.console import Console, RenderableType

    from tpufab.steps.health.status import StatusFolded, StatusReport, StatusRow


def _escape(text: object) -> str:
    """Text from a worker or the API, shown as text: no rich markup, no control sequences."""
    from rich.markup import escape

    return escape(neutralise_text(str(text)))


def node_lines(status: StatusReport) -> list[str]:
    """One line per node: type, API state and health, tier, runtime, zone."""
    from tpufab.views.nodes import state_text

    lines = []
    if status.queued is not None:
        q = status.queued
        failure = f" ({_escape(q.failure)})" if q.failure else ""
        lines.append(f"Queued resource [bold]{_escape(q.name)}[/bold]: {state_text(q.state)}"
                     f"{failure}, {q.tier}, {q.node_count} node{'s' if q.node_count != 1 else ''}")
    for n in status.nodes:
        health = f" {_escape(n.health)}" if n.health else ""
        on = f", on {_escape(n.plane_text)} ({_escape(n.provisioning_model)})" \
            if n.provisioning_model else ""   # a plane of VMs: how they are paid for
        lines.append(f"TPU node [bold]{_escape(n.name)}[/bold]: {_escape(n.accelerator_type)} "
                     f"{state_text(n.state)}{health}, {n.hosts} workers, "
                     f"{_escape(n.tier)}, {_escape(n.runtime_version)}, {_escape(n.zone)}{on}")
    return lines


def table(status: StatusReport, console: Console) -> RenderableType:
    """One line per folded row, fitted to ``console`` (tpufab.term.tables)."""
    from tpufab.term.tables import fitted

    rows = status.folded
    return fitted(
        ("WORKERS", "STATE", "TPU", "RUNS", "COMMIT", "MOUNTS", "DISK FREE", "MEMORY"),
        [(row.label, _escape(row.state), _escape(row.tpu), _escape(row.runs),
          _escape(row.commit), _escape(row.mounts), _escape(row.disk), _escape(row.memory))
         for row in rows], console,
        styles=[None if row.ok else ("red" if row.state.startswith("unreachable") else "yellow")
                for row in rows])


def holder_lines(facts: Mapping[int, StatusRow], shown: int = 8) -> list[str]:
    """``python3 train.py: w[0-3] (w0 pid 812, w1 pid 9, ...)``: one line per command (pure)."""
    by_command: dict[str, dict[int, set[int]]] = {}
    protected: dict[str, str] = {}
    for w, f in sorted(facts.items()):
        for device in f.busy_devices:
            for h in device.holders:
                command = short_command(h.command)
                by_command.setdefault(command, {}).setdefault(w, set()).add(h.pid)
                if h.protected:
                    protected[command] = h.protected
    lines = []
    for command, where in sorted(by_command.items(), key=lambda kv: min(kv[1])):
        pids = [f"{nodeset.label(w)} pid {p}" for w, ps in sorted(where.items()) for p in sorted(ps)]
        more = f", +{len(pids) - shown} more (see --json)" if len(pids) > shown else ""
        line = f"{command}: {nodeset.fold(where)} ({', '.join(pids[:shown])}{more})"
        if command in protected:
            line += PROTECTED_ADVICE.format(name=protected[command])
        lines.append(line)
    return lines


def full_disk_line(facts: Mapping[int, StatusRow]) -> str | None:
    """One sentence naming the workers whose disk is full (home or /tmp), or None (pure)."""
    full: dict[int, list[str]] = {}
    for w, f in sorted(facts.items()):
        paths = [d.path for d in f.disk if d.full]
        if paths:
            full[w] = paths
    if not full:
        return None
    where = ", ".join(dict.fromkeys(p for ps in full.values() for p in ps))
    return (f"Disk full on {nodeset.fold(full)} ({where}): setup, deploy and run fail there "
            "until you free space (kill and status still work).")


# Said by `status` under a protected holder and by `kill` about it: the same words.
def render(status: StatusReport, console: Console) -> None:
    """`tpufab status` for people: the nodes, the folded table, Ray, the TPU holders, what is
    wrong; then the autostop lines when one is armed, and whether connections are kept."""
    for line in node_lines(status):
        console.print(line)
    for node in status.gone:
        if node.condition:   # Compute Engine's reason (a flex-start end) and what to do
            console.print(f"[bold red]{_escape(node.condition)}[/bold red]")
            continue
        console.print(f"[bold red]{_escape(node.name)} is {_escape(node.state)}[/bold red]: its workers are "
                      f"gone; `tpufab babysit` recovers it, or `tpufab delete --name "
                      f"{_escape(node.name)} --yes` and create it again.")
    for node in status.nodes:   # Compute Engine: a MIG below its size, and why
        if node.condition and node not in status.gone:
            console.print(f"[yellow]{_escape(node.condition)}[/yellow]")
    for line in status.maintenance:
        console.print(f"[yellow]{_escape(line)}[/yellow]")
    if status.workers:
        console.print()
        console.print(table(status, console))
    elif status.note:
        console.print(_escape(status.note))
    ray = status.ray
    if ray is not None:
        console.print(_escape(ray.line()), style=None if ray.up else "yellow")
    if status.image is not None:
        console.print(_escape(status_line(status.image)),
                      style=None if status.image.ok else "yellow")
    holders = holder_lines(status.workers)
    if holders:
        console.print()
        every = [h for f in status.workers.values() for d in f.busy_devices for h in d.holders]
        console.print("[bold]TPU holders[/bold]:" if all(h.protected for h in every) else
                      "[bold]TPU holders[/bold] (free them with `tpufab kill`):")
        for line in holders:
            console.print(f"  {_escape(line)}")
    full = full_disk_line(status.workers)
    if full:
        console.print(f"[bold red]{_escape(full)}[/bold red]")
    unreachable = status.unreachable
    if unreachable and not status.note:
        console.print(f"[bold red]{len(unreachable)} of {len(status.workers)} workers "
                      f"unreachable[/bold red]: {nodeset.fold(unreachable)}.")
    if status.autostop:
        for line in autostop_lines(status.autostop):   # worker 0's words: shown as text
            console.print(neutralise_text(line), markup=False)
    if status.kept:
        console.print(status.kept, markup=False, highlight=False, style="dim")


def autostop_lines(state: Mapping[str, Any]) -> list[str]:
    """What `tpufab status` prints about autostop (worker 0's view of its watchdog)."""
    from tpufab.cloud.nodes import describe_autostop

    config = state.get("config")
    events = state.get("events") or []
    lines = []
    if config:
        current = state.get("state") or {}
        fires = current.get("fires_at")
        text = "Autostop: " + describe_autostop(
            config, fires_at=fires if not current.get("busy") else None)
        if current.get("busy"):
            text += f"; busy now ({', '.join(current['busy'][:3])})"
        if not state.get("running"):
            text += "; the watchdog is NOT running (arm it again: `tpufab autostop`)"
        lines.append(text + ".")
    elif events:
        lines.append("Autostop: off.")
    for e in events[-5:]:
        when = time.strftime("%H:%M:%S", time.localtime(e.get("time", 0)))
        extra = {k: _event_value(k, v) for k, v in e.items()
                 if k not in ("event", "time", "host") and v not in (None, [], "", False)}
        detail = ", ".join(f"{k}={v}" for k, v in sorted(extra.items()))
        lines.append(f"  {when} {e.get('event')}" + (f" ({detail})" if detail else ""))
    return lines


def _event_value(key: str, value: Any) -> Any:
    """Event fields for people: times as clock times, the idle period as a duration."""
    from tpufab.durations import human_duration

    if isinstance(value, int | float) and (key.endswith("_at") or key.endswith("since")):
        return time.strftime("%H:%M:%S", time.localtime(value))
    if key == "idle" and isinstance(value, int | float):
        return human_duration(value)
    if isinstance(value, list):
        return "; ".join(str(v) for v in value[:3])
    return value


# ---------------------------------------------------------------------------------------------
# --json


def facts_json(facts: StatusRow) -> dict[str, Any]:
    """Every fact of one worker, each device with ``busy``."""
    data = asdict(facts)
    for device in data["devices"]:
        device["busy"] = bool(device["holders"])
    return data


def row_json(row: StatusFolded) -> dict[str, Any]:
    """One folded row of the table, its workers also as indices (``worker_ids``)."""
    return {"workers": row.label, "worker_ids": list(row.workers), "state": row.state,
            "tpu": row.tpu, "runs": row.runs, "commit": row.commit, "mounts": row.mounts,
            "disk": row.disk, "memory": row.memory, "ok": row.ok}


def to_json(status: StatusReport) -> dict[str, Any]:
    """The documented shape (docs/status.md): nodes, queued resource, health, the folded rows,
    maintenance, Ray, every worker's facts and worker 0's autostop view."""
    ray = status.ray
    return {"name": status.name,
            "nodes": [n.to_json() for n in status.nodes],
            "queued_resource": status.queued.to_json() if status.queued else None,
            "healthy": status.healthy,
            "note": status.note,
            "rows": [row_json(r) for r in status.folded],
            "maintenance": status.maintenance,
            "ray": {"up": ray.up, "head": ray.head, "joined": list(ray.joined),
                    "missing": list(ray.missing), "line": ray.line()} if ray else None,
            "workers": [facts_json(f) for f in status.workers.values()],
            "image": image_json(status.image),
            "autostop": status.autostop}


def image_json(report: Any) -> dict[str, Any] | None:
    """The image setting on every host: its digest where it is, null where it is not."""
    if report is None:
        return None
    return {"image": report.image, "digest": report.digest, "ok": report.ok,
            "hosts": {str(r.worker): r.digest for r in report.rows},
            "differs": report.differing, "line": status_line(report)}


def show(status: StatusReport, *, as_json: bool, console: Console, errors: Console) -> None:
    """`tpufab status`'s output on ``console`` (``errors``: unused, status has no notes)."""
    from tpufab.term.console import print_json

    if as_json:
        print_json(to_json(status), console)
    else:
        render(status, console)
