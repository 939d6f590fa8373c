"""Node lifecycle verbs: create, delete, list, describe, types, known-hosts forget, and
config-ssh (every worker in ~/.ssh/config, for the SSH tools a user already has)."""

from __future__ import annotations

from collections.abc import Iterable

from tpufab.config import load_settings, parse_zones
from tpufab.errors import ConfigError
from tpufab.verbs.common import WIDE_HELP, count, note, print_json, say, settings_from_flags
from tpufab.verbs.declare import Opt, verb

PLACE = 3   # where this family's verbs show in `tpufab --help`
GROUPS = {"known-hosts": "tpufab's pinned worker host keys."}


@verb(options={"type": Opt("Accelerator type: v4-32, v6e-8, tpu-v6e-8 ...", short="-t",
                           aliases=("--accelerator-type",)),
                 "version": "Runtime version (default: by generation).",
                 "spot": "Spot capacity.", "preemptible": "Preemptible.",
                 "reserved": "Reserved capacity.", "queued": "Create a queued resource.",
                 "num_slices": Opt("Slices of a multislice queued resource.", min=1),
                 "async_": "Return without waiting.",
                 "labels": Opt("Label (repeatable).", flag="--label", metavar="KEY=VALUE"),
                 "zones": Opt("Zones to try in order on a stockout.", metavar="Z1,Z2"),
                 "retry_for": Opt("Keep retrying stockouts this long (30m, 2h).",
                                  metavar="DURATION"),
                 "reservation": "Consume this reservation (a queued resource).",
                 "topology": Opt("Custom chip shape, e.g. 4x4x4 (v4, v5p, v5e, v6e).",
                                 metavar="AxBxC"),
                 "internal_ips": "No external IPs on the workers (reach them with --jump).",
                 "on": Opt("Control plane: tpu (the Cloud TPU API) or compute (Compute "
                           "Engine; always for TPU7x).", metavar="tpu|compute"),
                 "flex_start": "Compute Engine flex-start capacity (with --max-run-duration).",
                 "max_run_duration": Opt("How long a flex-start slice may run (8h).",
                                         metavar="DURATION")})
def create(*, name: str | None = None, type: str | None = None, zone: str | None = None,
           project: str | None = None, version: str | None = None, spot: bool = False,
           preemptible: bool = False, reserved: bool = False, queued: bool = False,
           num_slices: int = 1, async_: bool = False,
           labels: Iterable[str] | None = None, zones: str | None = None,
           retry_for: str | None = None, reservation: str | None = None,
           topology: str | None = None, internal_ips: bool = False, on: str | None = None,
           flex_start: bool = False, max_run_duration: str | None = None) -> None:
    """Create a TPU VM node (or queued resource) and wait until it is READY.

    Without a name (no --name, TPUFAB_NAME or `name:`) it picks <user>-<type> and says so.
    The node becomes this project's current pod either way. On a stockout it tries the next
    of --zones, and keeps retrying with backoff for --retry-for; quota errors stop at once.
    --topology asks for a custom chip shape (v4, v5p, v5e, v6e, TPU7x), checked before any
    API call. TPU7x (and v5p/v6e with --on compute) are made on Compute Engine: one VM
    instance, or a workload policy, an instance template and a managed instance group.
    """
    from tpufab import current, durations
    from tpufab.cloud.names import default_name
    from tpufab.pod.pods import create_node

    zone_list = parse_zones(zones)
    if zone_list and zone and zone_list[0] != zone:
        raise ConfigError("--zone and --zones disagree; give the zones to try in order with "
                          "--zones only.")
    retry_s = durations.parse_duration(retry_for, "--retry-for")
    settings = settings_from_flags(name=name, type=type,
                                   zone=zone or (zone_list[0] if zone_list else None),
                                   project=project, version=version, spot=spot,
                                   preemptible=preemptible, reserved=reserved, labels=labels,
                                   control_plane=on, flex_start=flex_start,
                                   max_run_duration=max_run_duration)
    if internal_ips:  # the API's networkConfig.enableExternalIps=false
        settings.internal_ip = True
    source = settings.source_of("name")
    if source == "default" or source.startswith("current pod"):
        settings.name = default_name(settings.ssh_user, settings.require("type", "--type"))
        note(f"No node name given: calling it {settings.name} (pass --name to choose).")
    create_node(settings, queued=queued, num_slices=num_slices, async_=async_,
                zones=zone_list or None, retry_for=retry_s, reservation=reservation,
                topology=topology)
    before = current.read()
    path = current.remember(settings.name, zone=settings.zone, project=settings.project,
                            set_by="create")
    later = load_settings()      # the pod a later command without --name goes to
    if later.name and later.name != settings.name:
        where = {"environment": "TPUFAB_NAME"}.get(later.source_of("name"),
                                                   later.source_of("name"))
        note(f"Created {settings.name} and remembered it as this project's current pod, but "
             f"{where} names {later.name}, which wins over the current pod: "
             f"later commands without --name go to {later.name}; pass --name "
             f"{settings.name} to them, or remove that name.", "yellow")
        return
    moved = current.became(settings.name, before, path)
    note(moved, "dim" if before is None or before.name == settings.name else None)


@verb(options={"yes": Opt("Do not ask for confirmation.", short="-y")})
def delete(*, name: str | None = None, yes: bool = False, zone: str | None = None,
           project: str | None = None) -> None:
    """Delete a TPU node (or its queued resource)."""
    from tpufab import current
    from tpufab.pod import pods

    settings = settings_from_flags(name=name, zone=zone, project=project)
    # False: said no, or left a node recreated under the name alone
    deleted = pods.delete(settings.name, zone=settings.zone, project=settings.project, yes=yes)
    if deleted and current.forget(settings.name):
        note(f"{settings.name} was this project's current pod; there is none now.", "dim")


@verb(options={"wide": WIDE_HELP})
def list_(*, as_json: bool = False, wide: bool = False, zone: str | None = None,
          project: str | None = None) -> None:
    """List the TPU nodes in a zone."""
    from tpufab.pod.pods import list_pods
    from tpufab.term import tables
    from tpufab.term.console import stdout
    from tpufab.views.nodes import show_listing

    found = list_pods(zone=zone, project=project, waiting=not as_json)
    if as_json:
        print_json(found.to_json())
        return
    if wide:
        tables.wide(stdout())
    show_listing(found, stdout())


@verb()
def describe(*, name: str | None = None, as_json: bool = False, zone: str | None = None,
             project: str | None = None) -> None:
    """Show one TPU node: state, health, workers and their IPs (or the queued resource, or
    the Compute Engine multislice, of that name)."""
    from tpufab.pod.pods import describe as described
    from tpufab.term.console import stdout
    from tpufab.views.nodes import render_details

    item = described(name, zone=zone, project=project)
    if as_json:
        print_json(item.to_json())
        return
    render_details(item, stdout())


@verb()
def types(*, as_json: bool = False) -> None:
    """The accelerator types tpufab knows: hosts, chips, runtime, device files, and which
    control plane offers each (the Cloud TPU API, Compute Engine and its machine type)."""
    from tpufab.topology import all_accelerator_types, parse_accelerator_type

    shapes = [parse_accelerator_type(t) for t in all_accelerator_types()]
    if as_json:
        print_json([{"type": s.name, "generation": s.generation, "chips": s.chips,
                      "cores": s.cores, "hosts": s.hosts, "chips_per_host": s.chips_per_host,
                      "default_runtime": s.default_runtime, "device_files": list(s.device_files),
                      "control_planes": list(s.planes), "machine_type": s.machine_type}
                     for s in shapes])
        return
    from rich.table import Table

    from tpufab.term.console import stdout

    table = Table(box=None, pad_edge=False, header_style="bold")
    for column in ("TYPE", "HOSTS", "CHIPS", "CHIPS/HOST", "DEFAULT RUNTIME", "DEVICE FILES",
                   "ON", "MACHINE TYPE"):
        table.add_column(column)
    skipped = 0
    for s in shapes:
        cubes = s.chips // 64
        if s.generation == "tpu7x" and cubes > 1 and cubes & (cubes - 1) and cubes != 144:
            skipped += 1  # every whole number of cubes is a type; the powers of two show
            continue
        files = s.device_files
        shown = files[0] if len(files) == 1 else f"{files[0]} .. {files[-1]}"
        table.add_row(s.name, str(s.hosts), str(s.chips), str(s.chips_per_host),
                      s.default_runtime or "-", shown, "+".join(s.planes), s.machine_type or "-")
    stdout().print(table)
    if skipped:
        stdout().print(f"(and {skipped} more TPU7x types: tpu7x-128 times any number of 4x4x4 "
                       "cubes up to 144; `tpufab topology TYPE`, or --json for all)",
                       markup=False)


@verb(name="forget", group="known-hosts",
      options={"node": "Node name, or the node id an error named."})
def known_hosts_forget(*, node: str, zone: str | None = None, project: str | None = None) -> None:
    """Forget a node's pinned host keys (after a rebuild you trust)."""
    from tpufab.pod.pods import forget_host_keys
    from tpufab.term.console import stdout

    settings = settings_from_flags(zone=zone, project=project)
    removed = forget_host_keys(node, zone=zone, project=project)
    stdout().print(f"Forgot {count(removed, 'pinned host key')} of node {node} "
                   f"({settings.known_hosts_path}); the next connection pins the keys again.",
                   markup=False)


@verb(name="config-ssh",
      options={"name": Opt("Only this pod (default: every READY pod in the zone).",
                           short="-n"),
               "remove": "Take the entries out (of --name's pod, else all of tpufab's).",
               "yes": Opt("Do not ask before adding tpufab's section to ~/.ssh/config.",
                          short="-y")})
def config_ssh(*, name: str | None = None, remove: bool = False, yes: bool = False,
               zone: str | None = None, project: str | None = None,
               no_os_login: bool = False, jump: str | None = None) -> None:
    """Write a Host entry per worker into ~/.ssh/config: `ssh POD`, `ssh POD-w3`, `scp f
    POD-w3:`, `rsync -a d/ POD-w0:d/`, VS Code Remote-SSH and `fab -H POD-w0,POD-w1` reach
    the workers as tpufab does (its key, the pinned host keys, the OS Login user, --jump).

    The entries go between tpufab's own marker lines, in the file itself (paramiko, so
    Fabric, ignores Include); your own entries are never touched. It asks the first time
    (--yes where there is no terminal). create, delete and a recreate keep them current
    (the ssh_config setting: auto, or off).
    """
    import sys

    from tpufab.errors import ConfigError
    from tpufab.pod.sshconfig import config_ssh as configure
    from tpufab.term.console import stderr

    settings = settings_from_flags(zone=zone, project=project, no_os_login=no_os_login,
                                   jump=jump)

    def confirm(question: str) -> bool:
        if not sys.stdin or not sys.stdin.isatty():
            raise ConfigError("config-ssh writes into ~/.ssh/config and asks first, but stdin "
                              "is not a terminal: pass --yes to write without asking.")
        from rich.prompt import Confirm

        return Confirm.ask(question, console=stderr(), default=False)

    result = configure(settings, name=name, remove=remove, confirm=None if yes else confirm,
                       console=stderr())
    if result.declined:
        note("Not written.")
        return
    for pod, why in result.skipped:
        note(f"Skipped {pod}: {why}", "yellow")
    for pods in result.written:
        aliases = [a for e in pods.workers for a in e.names]
        shown = " ".join(aliases) if len(aliases) <= 6 else \
            f"{' '.join(aliases[:3])} ... {aliases[-1]}"
        say(f"{pods.name}: {shown} ({len(pods.workers)} worker"
            f"{'s' if len(pods.workers) != 1 else ''}"
            f"{', through ' + pods.jump.names[0] if pods.jump else ''}) in {result.path}.")
    for pod in result.removed:
        say(f"Removed {pod}'s entries from {result.path}.")
    if remove and not result.removed:
        say(f"No tpufab entries{' for ' + name if name else ''} in {result.path}; nothing to "
            "remove.")
    for line in result.notes:
        note(line, "yellow")


@verb(options={"type": "Accelerator type: v4-512, v6e-8, tpu-v5p-128 ...",
               "model_parallel": Opt("Rank the submeshes of M devices for M-way model "
                                     "parallelism.", min=1, metavar="M"),
               "topology": Opt("A custom chip shape to describe instead, e.g. 4x4x16.",
                               metavar="AxBxC"),
               "limit": Opt("How many submeshes to list.", min=1)})
def topology(type: str, *, model_parallel: int | None = None, topology: str | None = None,
             limit: int = 6, as_json: bool = False) -> None:
    """The physical shape of TYPE (chips, hosts, what jax.device_count() returns, torus axes)
    and, with --model-parallel M, the submeshes that tile it, best first (no cloud calls)."""
    from tpufab import topology as shapes

    shape = shapes.slice_shape(type, topology)
    ranked = shapes.submeshes(shape, model_parallel) if model_parallel is not None else []
    if as_json:
        data = shape.to_json()
        if model_parallel is not None:
            data["model_parallel"] = model_parallel
            data["submeshes"] = [s.to_json() for s in ranked]
        print_json(data)
        return
    for line in topology_lines(shape, ranked, limit=limit):
        print(line)


def topology_lines(shape, ranked, *, limit: int = 6) -> list[str]:
    """The `tpufab topology` report (pure)."""
    from tpufab.topology import CONTROL_PLANES, format_dims

    t = shape.topology
    per_chip = "one per chip, megacore" if shape.jax_device_count == t.chips and \
        t.cores != t.chips else ("one per chip" if t.cores == t.chips else "one per TensorCore")
    if shape.wrap_axes:
        links = f"wraparound (torus) on {', '.join(shape.wrap_axes)}"
        if shape.twisted:
            links += "; a twisted torus can be asked for"
    else:
        links = "no wraparound links (a mesh)"
    lines = [f"{t.name}: {shape.text} chips{' (custom topology)' if shape.custom else ''}, "
             f"{len(shape.dims)}D, {links}",
             f"  hosts:              {t.hosts} ({format_dims(shape.host_grid)} hosts of "
             f"{format_dims(shape.host_block)} chips each)",
             f"  chips:              {t.chips} ({t.chips_per_host} per host)",
             f"  TensorCores:        {t.cores}",
             f"  jax.device_count(): {shape.jax_device_count} ({per_chip}); "
             f"jax.process_count(): {t.hosts}"]
    if shape.cubes:
        lines.insert(1, f"  cubes:              {shape.cubes} (4x4x4 chips each)")
    planes = " and ".join(CONTROL_PLANES[p] for p in t.planes)
    lines.append(f"  offered by:         {planes}"
                 + (f" (machine type {t.machine_type})" if t.machine_type else ""))
    if not ranked:
        return lines
    size = ranked[0].size
    lines += ["", f"{size}-way model parallelism: {len(ranked)} submesh"
              f"{'es tile' if len(ranked) != 1 else ' tiles'} {shape.text}"
              f"{', best first' if len(ranked) > 1 else ''} (a heuristic: docs/topology.md)"]
    header = ("RANK", "t5x model_parallel_submesh", "JAX mesh (data, model)", "HOSTS/TILE",
              "WHOLE AXES")
    rows = []
    for n, s in enumerate(ranked[:limit], 1):
        whole = f"{s.whole_axes}" + (f" ({s.whole_wrapping_axes} wrapping)"
                                     if s.whole_wrapping_axes else "")
        rows.append((str(n), str(s.t5x), str(s.mesh_shape), str(s.hosts_per_tile), whole))
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    for r in [header, *rows]:
        lines.append("  " + "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())
    if len(ranked) > limit:
        lines.append(f"  ... {len(ranked) - limit} more (--limit N, or --json for all)")
    best = ranked[0]
    reshape, transpose = best.reshape_recipe()
    if shape.core_axis > 1:
        physical = (f"jax.devices() in an array of shape {tuple(shape.dims) + (shape.core_axis,)}"
                    " indexed by (*device.coords[:2], device.core_on_chip)")
    else:
        physical = (f"jax.devices() in an array of shape {tuple(shape.dims)} indexed by "
                    f"device.coords (mesh_utils.create_device_mesh({tuple(shape.dims)}) "
                    "gives one)")
    lines += ["", f"Rank 1 in JAX: physical = {physical}; then",
              f"  mesh = Mesh(physical.reshape{reshape}.transpose{transpose}"
              f".reshape{best.mesh_shape}, ('data', 'model'))"]
    if best.direct_mesh:
        lines.append(f"  or simply Mesh(mesh_utils.create_device_mesh({best.mesh_shape}), "
                     "('data', 'model')).")
    lines.append(f"In t5x: model_parallel_submesh={best.t5x}.")
    return lines
