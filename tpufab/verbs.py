"""The verbs both front ends call: `tpufab X` (cli.py) and `invoke X` (tasks.py).

Each verb turns flags into Settings, calls the library, and prints. Heavy modules
(google-cloud-tpu, fabric, rich tables) are imported inside the verbs, so importing this
module costs next to nothing and `--help`/`--list` stay instant.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from tpufab.config import Settings, load_settings
from tpufab.errors import ConfigError


def parse_labels(labels: Iterable[str] | None) -> dict[str, str]:
    """`["team=ml", "env=dev,owner=me"]` -> {"team": "ml", "env": "dev", "owner": "me"}."""
    out: dict[str, str] = {}
    for item in labels or ():
        for pair in str(item).split(","):
            if not pair.strip():
                continue
            key, sep, value = pair.partition("=")
            if not sep or not key.strip():
                raise ConfigError(f"--label takes key=value, not {pair.strip()!r}.")
            out[key.strip()] = value.strip()
    return out


def settings_from_flags(*, type: str | None = None, accelerator_type: str | None = None,
                        version: str | None = None, labels: Iterable[str] | None = None,
                        **flags: Any) -> Settings:
    """Settings with the command-line flags on top. A False/None flag means "not given"."""
    if type and accelerator_type and type != accelerator_type:
        raise ConfigError(f"--type {type} and --accelerator-type {accelerator_type} disagree; "
                          "give one of them.")
    overrides = {k: v for k, v in flags.items() if v is not None and v is not False}
    overrides["type"] = type or accelerator_type
    overrides["runtime_version"] = version
    settings = load_settings(overrides)
    settings.labels = {**settings.labels, **parse_labels(labels)}
    return settings


def split_args(args: str | None) -> list[str]:
    """A recipe's `--args '...'` string split as a shell would, or one sentence saying why not."""
    import shlex

    try:
        return shlex.split(args or "")
    except ValueError as err:
        raise ConfigError(f"--args {args!r} is not a valid argument list ({err}); quote it "
                          "as you would in a shell.") from None


def _print_json(data: Any) -> None:
    print(json.dumps(data, indent=2, sort_keys=False))


# ---------------------------------------------------------------------------------------------
# TPU lifecycle


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
        _print_json([n.to_json() for n in nodes])
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
        _print_json(item.to_json())
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
        _print_json([{"type": s.name, "generation": s.generation, "chips": s.chips,
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


# ---------------------------------------------------------------------------------------------
# the simulated pod


def sim_up(*, port: int | None = None, state_dir: str | None = None) -> None:
    from tpufab.console import stdout
    from tpufab.sim import daemon

    info = daemon.up(state_dir=state_dir, port=port)
    already = " (it was already running)" if info.already_running else ""
    stdout().print(f"[green]The simulated TPU pod is up[/green]{already}: TPU API at "
                   f"{info.endpoint} (pid {info.pid}, state in {info.state_dir}).")
    _print_exports(info)


def _print_exports(info: Any) -> None:
    from tpufab.console import stdout

    stdout().print("Point tpufab at it by pasting these lines into your shell:")
    # plain print: no wrapping or markup, so the lines copy and paste as they are
    print()
    for line in info.exports().splitlines():
        print(f"  {line}")
    print(flush=True)


def sim_down(*, state_dir: str | None = None) -> None:
    from tpufab.console import stdout
    from tpufab.sim import daemon

    stdout().print(daemon.down(state_dir=state_dir), markup=False)


def sim_status(*, state_dir: str | None = None, as_json: bool = False) -> int:
    """Exit code 0 when the simulated pod is up, 3 when it is not."""
    from tpufab.console import stdout
    from tpufab.sim import daemon

    status = daemon.status(state_dir=state_dir)
    if as_json:
        _print_json({"running": status.running, "state_dir": str(status.state_dir),
                     "endpoint": status.info.endpoint if status.info else None,
                     "pid": status.info.pid if status.info else None,
                     "nodes": status.nodes, "queued_resources": status.queued_resources})
        return 0 if status.running else 3
    console = stdout()
    if status.running and status.info:
        console.print(f"The simulated TPU pod is up: TPU API at {status.info.endpoint} "
                      f"(pid {status.info.pid}, state in {status.state_dir}).", markup=False)
    else:
        console.print(f"The simulated TPU pod is not running (state in {status.state_dir}); "
                      "start it with `tpufab sim up`.", markup=False)
    for node in status.nodes:
        workers = len(node.get("workers", [])) or "?"
        console.print(f"  node {node['name'].rsplit('/', 1)[-1]}: {node.get('acceleratorType')} "
                      f"{node.get('state')} ({workers} workers)", markup=False)
    for qr in status.queued_resources:
        console.print(f"  queued resource {qr['name'].rsplit('/', 1)[-1]}: {qr.get('state')}",
                      markup=False)
    if status.running and status.info:
        _print_exports(status.info)
    return 0 if status.running else 3


def sim_admin() -> Any:
    """The admin client of the simulated pod tpufab points at (TPUFAB_API_ENDPOINT), else of
    the one running from the default state dir."""
    from tpufab.sim import daemon
    from tpufab.sim.admin import SimAdmin

    settings = load_settings()
    endpoint = settings.api_endpoint
    if not endpoint:
        status = daemon.status()
        if not status.running or status.info is None:
            raise ConfigError("No simulated pod to talk to: TPUFAB_API_ENDPOINT is not set and "
                              "none is running; start one with `tpufab sim up`.")
        endpoint = status.info.endpoint
    kw = {"zone": settings.zone}
    if settings.project:
        kw["project"] = settings.project
    return SimAdmin(endpoint, **kw)


def sim_preempt(*, name: str) -> None:
    from tpufab.console import stdout
    from tpufab.lifecycle import validate_name

    sim_admin().preempt(validate_name(name))
    stdout().print(f"Preempted TPU node {name}: it is PREEMPTED and its workers are stopped.")


def sim_unreachable(*, name: str, worker: int, restore: bool = False) -> None:
    from tpufab.console import stdout
    from tpufab.lifecycle import validate_name

    sim_admin().set_reachable(validate_name(name), worker, restore)
    state = "reachable again" if restore else "unreachable (connections refused)"
    stdout().print(f"Worker {worker} of {name} is {state}.")


def sim_fail_create(*, quota: bool = False) -> None:
    from tpufab.console import stdout

    reason = "quota" if quota else "stockout"
    sim_admin().fail_next_create(reason)
    stdout().print(f"The next create will fail with RESOURCE_EXHAUSTED ({reason}).")


def sim_burst(*, count: int, code: int = 503) -> None:
    from tpufab.console import stdout

    if code not in (429, 503):
        raise ConfigError(f"--code must be 503 or 429, not {code}.")
    sim_admin().error_burst(count, code=code)
    stdout().print(f"The next {count} TPU API requests will fail with {code}.")


_VERB_MODULES = ("tpufab.podverbs", "tpufab.jobverbs", "tpufab.statusverbs")


def __getattr__(name: str) -> Any:
    """The worker verbs live in podverbs (exec, setup, deploy, mount ...), jobverbs (run,
    logs, runs, kill) and statusverbs (status, babysit); both front ends find them all here,
    and each module is imported only when one of its verbs is called."""
    import importlib

    for module in _VERB_MODULES:
        found = getattr(importlib.import_module(module), name, None)
        if found is not None and callable(found) and not name.startswith("_"):
            return found
    raise AttributeError(f"module 'tpufab.verbs' has no attribute {name!r}")
