"""`tpufab status`: one fan-out gathers every worker's facts; workers that agree fold into a row.

``facts_args`` (what to ask), ``parse_facts`` (a worker's answer as a record),
``worker_cells`` and ``fold_rows`` (the table) are pure and tested as data; ``collect`` is the
only step with side effects: the node's API state, then one round trip per worker running
``remote/facts_worker.py`` (shipped once per content hash). The StatusReport it returns is a
``tpufab.reports.Report``; tpufab.views.status prints it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from tpufab import nodeset
from tpufab.errors import ApiError, ConfigError, TpufabError
from tpufab.reports import Report, last_line
from tpufab.ssh.remote_files import read_answer
from tpufab.term.commands import short_command

if TYPE_CHECKING:
    from tpufab.cloud.nodes import Node, QueuedResourceInfo
    from tpufab.cloud.planes.base import ControlPlane
    from tpufab.config import Settings

SCRIPT = "facts_worker.py"
GiB = 1 << 30
LOW_DISK_FRACTION = 0.05       # less free than this (or LOW_DISK_BYTES) is flagged
LOW_DISK_BYTES = 2 * GiB
LOW_MEMORY_FRACTION = 0.05
FULL_DISK_BYTES = 64 << 20      # less free than this: full (a deploy or a setup fails there)
# Workers whose uptimes differ by more than this (seconds, or fraction) did not boot together.
REBOOT_GAP_SECONDS = 600.0
REBOOT_GAP_FRACTION = 0.25
# API states in which a node's workers are gone or going.
GONE_STATES = frozenset({"PREEMPTED", "TERMINATED", "STOPPED", "STOPPING", "DELETING",
                         "HIDDEN", "HIDING"})


# ---------------------------------------------------------------------------------------------
# Records (pure)


@dataclass(frozen=True)
class Holder:
    pid: int
    command: str
    protected: str = ""   # the protected name (tpu-runtime, ...) `tpufab kill` leaves running


def protected_holder(names: object) -> str:
    """The name by which `tpufab kill` would leave this holder running ("" if it would not):
    the same rule (tpukill's PROTECTED_NAMES), so status and kill agree."""
    from tpufab.remote.kill_worker import protected_name

    if not isinstance(names, list):
        return ""
    return protected_name([str(n) for n in names])


@dataclass(frozen=True)
class Device:
    path: str
    holders: tuple[Holder, ...] = ()

    @property
    def busy(self) -> bool:
        return bool(self.holders)


@dataclass(frozen=True)
class RunFact:
    run: str
    state: str                    # running | starting | exited | killed | lost
    exit_code: int | None = None
    signal: str | None = None
    recipe: str | None = None
    started_at: float | None = None
    ended_at: float | None = None
    job: str | None = None        # the supervised job it is an attempt of (docs/supervisor.md)

    @property
    def live(self) -> bool:
        return self.state in ("running", "starting")

    @property
    def outcome(self) -> str:
        if self.state == "exited":
            return f"exit {self.exit_code}"
        if self.state == "killed":
            return f"killed ({self.signal})"
        return self.state


@dataclass(frozen=True)
class MountFact:
    at: str
    fstype: str
    source: str
    url: str | None = None

    @property
    def driver(self) -> str:
        return self.fstype.removeprefix("fuse.") if self.fstype.startswith("fuse.") else self.fstype

    @property
    def what(self) -> str:
        return self.url or (f"gs://{self.source}" if self.driver == "gcsfuse" else self.source)


@dataclass(frozen=True)
class MountProbe:
    at: str
    ok: bool
    error: str | None = None
    seconds: float | None = None


@dataclass(frozen=True)
class Deployed:
    dir: str
    exists: bool
    commit: str | None = None
    branch: str | None = None


@dataclass(frozen=True)
class SetupFact:
    hash: str
    done: bool
    mtime: float


@dataclass(frozen=True)
class Disk:
    path: str
    free_bytes: int
    total_bytes: int

    @property
    def low(self) -> bool:
        return self.free_bytes < max(LOW_DISK_BYTES, self.total_bytes * LOW_DISK_FRACTION) \
            and self.total_bytes > 0

    @property
    def full(self) -> bool:
        return bool(self.total_bytes) and self.free_bytes < FULL_DISK_BYTES


@dataclass
class StatusRow:
    """What one worker said (or why it said nothing): `status`'s row for it (``ok``: it
    answered; else ``error`` says why not)."""

    worker: int
    reachable: bool
    error: str | None = None
    host: str | None = None
    uptime_s: float | None = None
    boot_id: str | None = None
    devices: tuple[Device, ...] = ()
    unreadable_processes: int = 0
    runs: tuple[RunFact, ...] = ()
    runs_total: int = 0
    deploys: tuple[Deployed, ...] = ()
    mounts: tuple[MountFact, ...] = ()
    setup: tuple[SetupFact, ...] = ()
    disk: tuple[Disk, ...] = ()
    memory_total: int | None = None
    memory_available: int | None = None
    python: str | None = None
    time: float | None = None                     # the worker's clock when it answered
    packages: dict[str, Any] = field(default_factory=dict)      # asked with --python
    mount_probes: tuple[MountProbe, ...] = ()     # asked with --probe-mounts
    # the metadata server's preemption/maintenance notices in force (None: no server answered)
    notices: tuple[str, ...] | None = None
    # Ray's daemons here (raylet, head, gcs_address, node_ip); None: no raylet nor GCS runs
    ray: dict[str, Any] | None = None

    @property
    def ok(self) -> bool:
        return self.reachable

    @property
    def commit(self) -> str | None:
        return next((d.commit for d in self.deploys if d.commit), None)

    @property
    def deploy_dir(self) -> str | None:
        return next((d.dir for d in self.deploys if d.commit), None)

    @property
    def running(self) -> list[RunFact]:
        return [r for r in self.runs if r.live]

    @property
    def busy_devices(self) -> list[Device]:
        return [d for d in self.devices if d.busy]

    @property
    def memory_low(self) -> bool:
        if not self.memory_total or self.memory_available is None:
            return False
        return self.memory_available < self.memory_total * LOW_MEMORY_FRACTION


def facts_args(*, deploy_dirs: Sequence[str] = (), run_dir: str | None = None,
               device_globs: Sequence[str] = (), max_runs: int | None = None,
               pythons: Sequence[str] = (), probe_mounts: float | None = None) -> list[str]:
    """Arguments of ``facts_worker.py`` (pure)."""
    args: list[str] = []
    for python in pythons:
        args += ["--python", python]
    if probe_mounts:
        args += ["--probe-mounts", f"{probe_mounts:g}"]
    if run_dir:
        args += ["--run-dir", run_dir]
    for path in deploy_dirs:
        args += ["--deploy-dir", path]
    for pattern in device_globs:
        args += ["--devices-glob", pattern]
    if max_runs is not None:
        args += ["--max-runs", str(max_runs)]
    return args


def _int(value: Any, default: int | None = None) -> int | None:
    try:
        return int(value) if value is not None else default
    except (TypeError, ValueError):
        return default


def _float(value: Any) -> float | None:
    try:
        return float(value) if value is not None else None
    except (TypeError, ValueError):
        return None


def _text(value: Any) -> str | None:
    return None if value is None else str(value)


def parse_facts(worker: int, outcome: Any) -> StatusRow:
    """A worker's ``facts_worker.py`` output (a fan-out result) as a record; never raises.

    ``outcome`` has ``exit_code``, ``stdout``, ``stderr`` and ``error`` (a WorkerResult).
    Anything that is not the expected JSON makes the worker unreachable-with-a-reason, and
    malformed fields are dropped one by one rather than failing the whole status.
    """
    error = getattr(outcome, "error", None)
    if error:
        return StatusRow(worker, False, error=str(error))
    data = read_answer(getattr(outcome, "stdout", ""))
    if data is None:
        code = getattr(outcome, "exit_code", None)
        reason = last_line(getattr(outcome, "stderr", "")) or f"exit status {code}"
        if code == 127 or "python3: not found" in reason:
            reason = "python3 is not installed on this worker"
        return StatusRow(worker, False, error=f"no facts: {reason}")

    def items(key: str) -> list[dict]:
        value = data.get(key)
        return [v for v in value if isinstance(v, dict)] if isinstance(value, list) else []

    devices = []
    for d in items("devices"):
        holders = tuple(Holder(_int(h.get("pid"), 0) or 0, str(h.get("command") or "?"),
                               protected_holder(h.get("names")))
                        for h in d.get("holders") or [] if isinstance(h, dict))
        if d.get("path"):
            devices.append(Device(str(d["path"]), tuple(sorted(holders, key=lambda h: h.pid))))
    runs = tuple(RunFact(str(r["run"]), str(r.get("state") or "lost"), _int(r.get("exit_code")),
                         _text(r.get("signal")), _text(r.get("recipe")),
                         _float(r.get("started_at")), _float(r.get("ended_at")),
                         _text(r.get("job")))
                 for r in items("runs") if r.get("run"))
    deploys = tuple(Deployed(str(d["dir"]), bool(d.get("exists")), _text(d.get("commit")),
                             _text(d.get("branch"))) for d in items("deploys") if d.get("dir"))
    mounts = tuple(MountFact(str(m["at"]), str(m.get("fstype") or "fuse"),
                             str(m.get("source") or ""), _text(m.get("url")))
                   for m in items("mounts") if m.get("at"))
    setup = tuple(SetupFact(str(s["hash"]), bool(s.get("done")), _float(s.get("mtime")) or 0.0)
                  for s in items("setup") if s.get("hash"))
    disk = tuple(Disk(str(d["path"]), _int(d.get("free_bytes"), 0) or 0,
                      _int(d.get("total_bytes"), 0) or 0) for d in items("disk") if d.get("path"))
    memory = data.get("memory") if isinstance(data.get("memory"), dict) else {}
    found = data.get("packages")
    packages = {str(k): v for k, v in found.items() if v is None or isinstance(v, str)} \
        if isinstance(found, dict) else {}
    probes = tuple(MountProbe(str(p["at"]), bool(p.get("ok")), _text(p.get("error")),
                              _float(p.get("seconds")))
                   for p in items("mount_probes") if p.get("at"))
    return StatusRow(
        worker, True, host=_text(data.get("host")), uptime_s=_float(data.get("uptime_s")),
        boot_id=_text(data.get("boot_id")), devices=tuple(devices),
        unreadable_processes=_int(data.get("unreadable_processes"), 0) or 0, runs=runs,
        runs_total=_int(data.get("runs_total"), len(runs)) or 0, deploys=deploys, mounts=mounts,
        setup=setup, disk=disk, memory_total=_int(memory.get("total_bytes")),
        memory_available=_int(memory.get("available_bytes")), python=_text(data.get("python")),
        time=_float(data.get("time")), packages=packages, mount_probes=probes,
        notices=tuple(str(n) for n in data["notices"])
        if isinstance(data.get("notices"), list) else None,
        ray=data["ray"] if isinstance(data.get("ray"), dict) else None)


# ---------------------------------------------------------------------------------------------
# The folded table (pure)


def human_bytes(n: int | None) -> str:
    if n is None:
        return "?"
    for unit, size in (("T", 1 << 40), ("G", GiB), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= size:
            value = n / size
            return f"{value:.1f}{unit}" if value < 10 else f"{value:.0f}{unit}"
    return f"{n}B"


def human_seconds(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    s = int(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m"
    if s < 86400:
        return f"{s // 3600}h{(s % 3600) // 60:02d}m"
    return f"{s // 86400}d{(s % 86400) // 3600}h"


def _span(values: Sequence[str]) -> str:
    uniq = sorted(set(values), key=values.index)
    return uniq[0] if len(uniq) == 1 else f"{uniq[0]}..{uniq[-1]}"


def _short(command: str, width: int = 40) -> str:
    """A command fit for a table cell: what names it (tpufab.term.commands)."""
    return short_command(command, width)


def tpu_cell(f: StatusRow) -> str:
    if not f.devices:
        return "no TPU devices"
    busy = f.busy_devices
    unread = f" ({f.unreadable_processes} processes unreadable)" if f.unreadable_processes else ""
    if not busy:
        return f"{len(f.devices)} free{unread}"
    commands = sorted({_short(h.command) for d in busy for h in d.holders})
    shown = "; ".join(commands[:2]) + (f" +{len(commands) - 2}" if len(commands) > 2 else "")
    if all(h.protected for d in busy for h in d.holders):
        names = sorted({h.protected for d in busy for h in d.holders})
        return f"{len(busy)}/{len(f.devices)} held by protected {', '.join(names)}{unread}"
    return f"{len(busy)}/{len(f.devices)} busy: {shown}{unread}"


def runs_cell(f: StatusRow) -> str:
    if not f.runs:
        return "-"
    parts = [f"running {r.run} ({r.recipe or '?'}"
             + (f"; supervised job {r.job})" if r.job else ")") for r in f.running]
    ended = [r for r in f.runs if not r.live]
    if ended:
        last = ended[-1]
        parts.append(f"last {last.run} {last.outcome}")
    finished = f.runs_total - len(f.running)
    if finished > 1:
        parts.append(f"{finished} finished")
    return "; ".join(parts)


def commit_cell(f: StatusRow) -> str:
    if f.commit:
        return f.commit[:12]
    if any(d.exists for d in f.deploys):
        return "not a checkout"
    return "-"


def mounts_cell(f: StatusRow) -> str:
    return ", ".join(f"{m.at} {m.what}" for m in f.mounts) or "-"


def worker_cells(f: StatusRow) -> tuple[str, ...]:
    """The cells that must agree for workers to share a row (pure)."""
    if not f.reachable:
        return ("unreachable", f.error or "?", "", "", "", "", "")
    disk_low = any(d.low for d in f.disk)
    return ("up", tpu_cell(f), runs_cell(f), commit_cell(f), mounts_cell(f),
            "LOW" if disk_low else "", "LOW" if f.memory_low else "")


@dataclass
class StatusFolded:
    """Workers that agree, and what they agree on."""

    workers: list[int]
    state: str
    tpu: str
    runs: str
    commit: str
    mounts: str
    disk: str
    memory: str
    ok: bool = True

    @property
    def label(self) -> str:
        return nodeset.fold(self.workers)


def _boot_clusters(members: list[StatusRow]) -> list[list[StatusRow]]:
    """Split workers whose uptimes are far apart (one rebooted) into separate groups."""
    known = sorted((f for f in members if f.uptime_s is not None), key=lambda f: f.uptime_s)
    clusters: list[list[StatusRow]] = []
    for f in known:
        if clusters:
            prev = clusters[-1][-1].uptime_s or 0.0
            gap = f.uptime_s - prev
            if gap <= max(REBOOT_GAP_SECONDS, prev * REBOOT_GAP_FRACTION):
                clusters[-1].append(f)
                continue
        clusters.append([f])
    unknown = [f for f in members if f.uptime_s is None]
    if unknown:
        clusters.append(unknown)
    return clusters


def fold_rows(facts: Mapping[int, StatusRow]) -> list[StatusFolded]:
    """Workers that agree on everything that matters share one row (``w[0-62]``); the odd one
    out gets its own. Numbers that drift between healthy workers (uptime, disk, memory) are not
    compared, only flagged when low or far apart, and shown as ranges."""
    groups: dict[tuple[str, ...], list[StatusRow]] = {}
    for w in sorted(facts):
        groups.setdefault(worker_cells(facts[w]), []).append(facts[w])
    rows = []
    for cells, members in groups.items():
        if cells[0] == "unreachable":
            rows.append(StatusFolded([f.worker for f in members], f"unreachable: {cells[1]}", "-", "-",
                            "-", "-", "-", "-", ok=False))
            continue
        for cluster in _boot_clusters(members):
            cluster.sort(key=lambda f: f.worker)
            uptimes = sorted(f.uptime_s for f in cluster if f.uptime_s is not None)
            state = "up " + (_span([human_seconds(uptimes[0]), human_seconds(uptimes[-1])])
                             if uptimes else "?")
            home = [f.disk[0] for f in cluster if f.disk]
            disk = _span([human_bytes(d.free_bytes) for d in sorted(home, key=lambda d: d.free_bytes)]) \
                if home else "?"
            if cells[5]:
                disk += " LOW"
            mem = sorted(f.memory_available for f in cluster if f.memory_available is not None)
            total = next((f.memory_total for f in cluster if f.memory_total), None)
            memory = (_span([human_bytes(mem[0]), human_bytes(mem[-1])]) + f" of {human_bytes(total)}"
                      if mem else "?")
            if cells[6]:
                memory += " LOW"
            rows.append(StatusFolded([f.worker for f in cluster], state, cells[1], cells[2], cells[3],
                            cells[4], disk, memory, ok=not (cells[5] or cells[6])))
    rows.sort(key=lambda r: r.workers[0])
    return rows


# ---------------------------------------------------------------------------------------------
# The whole picture


@dataclass
class StatusReport(Report):
    """`tpufab status`: the node(s) as the API sees them and every worker's facts (``rows``:
    a StatusRow per worker, ``.workers`` by index; ``.folded``: the table's rows, workers
    that agree folded). Printed by tpufab.views.status (the view ``status``)."""

    name: str
    nodes: list[Node] = field(default_factory=list)
    queued: QueuedResourceInfo | None = None
    note: str | None = None       # why workers were not asked, if they were not
    autostop: dict | None = None  # worker 0's autostop view, when one is armed (or its error)
    kept: str | None = None       # whether the connections are kept between commands (a line)
    image: Any = None             # the image setting on every host (an ImageReport), if set
    step: str = field(default="status", kw_only=True)

    view: ClassVar[str] = "status"

    @property
    def workers(self) -> dict[int, StatusRow]:
        return {f.worker: f for f in sorted(self.rows, key=lambda f: f.worker)}

    @property
    def folded(self) -> list[StatusFolded]:
        return fold_rows(self.workers)

    @property
    def unreachable(self) -> list[int]:
        return [w for w, f in self.workers.items() if not f.reachable]

    @property
    def healthy(self) -> bool:
        return (bool(self.nodes) and all(n.ready for n in self.nodes) and bool(self.rows)
                and not self.unreachable)

    @property
    def gone(self) -> list[Node]:
        """Nodes whose workers are gone (preempted, terminated, stopped...)."""
        return [n for n in self.nodes if n.state in GONE_STATES]

    @property
    def maintenance(self) -> list[str]:
        return maintenance_lines(self.nodes, self.workers)

    @property
    def ray(self) -> RayView | None:
        return ray_view(self.workers)


PodStatus = StatusReport   # the 0.1 name (docs/api.md), until 0.2


def find_nodes(control: ControlPlane, name: str) -> tuple[list[Node], QueuedResourceInfo | None]:
    """The node called ``name`` (and its queued resource), or the slices of the queued resource
    called ``name``; ``([], None)`` when there is neither."""
    node = control.find_node(name)
    if node is not None:
        qr = control.find_queued_resource(node.queued_resource) if node.queued_resource else None
        return [node], qr
    qr = control.find_queued_resource(name)
    if qr is None:
        return [], None
    nodes = [n for n in control.list_nodes() if n.queued_resource == name]
    return sorted(nodes, key=lambda n: (n.slice_index or 0, n.name)), qr


def fill_upcoming_maintenance(control: ControlPlane, nodes: Sequence[Node]) -> None:
    """Set each node's ``upcoming_maintenance`` (the API's announced window; one more call a
    node: it is only in API v2alpha1). A failing call leaves it unknown (None)."""
    for node in nodes:
        if node.ready or node.state in ("CREATING", "REPAIRING", "RESTARTING"):
            try:
                node.upcoming_maintenance = control.upcoming_maintenance(node.name)
            except TpufabError:
                node.upcoming_maintenance = None


def notice_groups(facts: Mapping[int, StatusRow]) -> list[tuple[list[int], str]]:
    """[(workers, notice)] for the metadata notices in force, workers folded per notice."""
    by_notice: dict[str, list[int]] = {}
    for w in sorted(facts):
        for notice in facts[w].notices or ():
            by_notice.setdefault(notice, []).append(w)
    return [(ws, n) for n, ws in by_notice.items()]


def maintenance_lines(nodes: Sequence[Node], facts: Mapping[int, StatusRow]) -> list[str]:
    """Plain text: each node's upcoming maintenance window, then the notices the workers'
    metadata servers hold (what `status` and `check` print)."""
    from tpufab import nodeset

    lines = [f"Maintenance ahead on {n.name}: {n.upcoming_maintenance.describe()}"
             for n in nodes if n.upcoming_maintenance is not None]
    lines += [f"Notice on {nodeset.fold(ws)}: {notice}" for ws, notice in notice_groups(facts)]
    return lines


def default_deploy_dirs(settings: Settings) -> list[str]:
    """Where deploy puts the checkout: ``remote_dir`` if set, and ``~/<repo>`` of the local
    repository when there is one."""
    dirs = [settings.remote_dir] if settings.remote_dir else []
    try:
        from tpufab.steps.code import deploy, gitops

        dirs.append(deploy.default_dir(gitops.repo_root()))
    except Exception:  # noqa: BLE001 - not in a repository: nothing deployed from here
        pass
    return list(dict.fromkeys(dirs))


def gather_facts(fanout: Any, *, workers: Iterable[int] | None = None,
                 deploy_dirs: Sequence[str] = (), max_runs: int | None = None,
                 pythons: Sequence[str] = (), probe_mounts: float | None = None,
                 device_globs: Sequence[str] = (),
                 timeout: float | None = None) -> dict[int, StatusRow]:
    """One round trip per worker (the fan-out runs them all at once): facts_worker.py's answer;
    ``timeout``: seconds each worker has to answer (None: the fan-out's default)."""
    from tpufab.ssh.remote_files import run_script

    chosen = list(workers if workers is not None else fanout.workers)
    args = facts_args(deploy_dirs=deploy_dirs, max_runs=max_runs, pythons=pythons,
                      probe_mounts=probe_mounts, device_globs=device_globs)
    outcomes = run_script(fanout, SCRIPT, args, chosen, from_memory=True,  # a full disk too
                          timeout=timeout)
    return {w: parse_facts(w, outcomes[w]) for w in chosen}


def collect(settings: Settings, *, control: ControlPlane | None = None, pod: Any = None,
            deploy_dirs: Sequence[str] | None = None,
            timeout: float | None = None) -> StatusReport:
    """The node's API state, then (if its workers should be up) every worker's facts
    (``timeout``: seconds each worker has to answer)."""
    from tpufab.cloud import lifecycle, planes
    from tpufab.cloud.names import validate_name
    from tpufab.hosts import connect as pods

    name = validate_name(settings.name)
    settings.project = settings.require("project")
    kept = None
    if control is None and pod is None:   # the API asked through the pod's keeper, if kept
        found = pods.kept_api(settings)
        if found is not None:
            kept, control = found
    control = planes.control_plane(settings, control)
    nodes, qr = find_nodes(control, name)
    if (nodes or qr is not None) and control.has_multislice(name):   # as describe says it
        node = nodes[0] if nodes and nodes[0].name == name else None
        raise ConfigError(lifecycle.two_things(name, node, None if node else qr,
                                               control.multislice(name)))
    if not nodes and qr is None:  # a plane's own multislice, as the worker verbs find it
        nodes = control.multislice(name)
    if not nodes and qr is None:
        how = lifecycle.vanished_note(control, name)
        raise ApiError(f"No TPU node or queued resource named {name!r} in {settings.zone} "
                       f"(project {settings.project})" + (f": it was {how}" if how else "") +
                       "; see `tpufab list`.")
    fill_upcoming_maintenance(control, nodes)
    if not nodes:
        return StatusReport(name, nodes, qr, note=f"Queued resource {name} has no nodes yet "
                         f"({qr.state if qr else '?'}).")
    not_ready = [n for n in nodes if not n.ready]
    if not_ready:
        count = sum(len(n.workers) for n in nodes) or sum(n.hosts for n in nodes)
        return StatusReport(name, nodes, qr, note="; ".join(
            f"TPU node {n.name} is {n.state}" for n in not_ready) + ": its workers were not asked.",
            rows=[StatusRow(w, False, error=f"node {_node_of(nodes, w).state}")
                  for w in range(count)])
    if pod is None:
        if kept is not None and not pods.same_nodes(kept.nodes, nodes):
            pods.forget(settings)   # recreated since: never through the old connections
        pod = pods.shared(settings, control=control, nodes=nodes)
    dirs = default_deploy_dirs(settings) if deploy_dirs is None else list(deploy_dirs)
    facts = gather_facts(pod.fanout, deploy_dirs=dirs, timeout=timeout)
    return StatusReport(name, nodes, qr, rows=[facts[w] for w in sorted(facts)],
                        image=image_on_hosts(settings, pod, facts, timeout=timeout))


def image_on_hosts(settings: Settings, pod: Any, facts: Mapping[int, StatusRow], *,
                   timeout: float | None = None) -> Any:
    """The ``image`` setting's digest on every reachable host, whether it has it (an
    ImageReport: a second round trip, only with the setting); None without it."""
    from tpufab.steps.host import images

    reachable = [w for w, f in sorted(facts.items()) if f.reachable]
    if not getattr(settings, "image", None) or not reachable:
        return None
    try:
        return images.on_hosts(pod.fanout, reachable, settings.image, timeout=timeout)
    except ConfigError:   # not an image reference: `run` says so in one sentence
        return None


def pod_status(settings: Settings, *, timeout: float | None = None, pod: Any = None,
               deploy_dirs: Sequence[str] | None = None) -> StatusReport:
    """`tpufab status` (and ``Pod.status``): ``collect``, then worker 0's autostop view when
    the node says one is armed or the worker has events (``.autostop``)."""
    from tpufab.hosts import connect as pods
    from tpufab.steps.host import autostop

    found = collect(settings, pod=pod, deploy_dirs=deploy_dirs, timeout=timeout)
    ready = [n for n in found.nodes if n.ready]
    if ready:
        found.kept = pods.kept(settings)
    if not ready or 0 not in found.workers or not found.workers[0].reachable:
        return found
    try:
        state = autostop.worker_state(pod or pods.shared(settings), timeout=timeout)
    except TpufabError as err:
        found.autostop = {"error": str(err)}
        return found
    found.autostop = state if state.get("config") or state.get("events") else None
    return found


def _node_of(nodes: Sequence[Node], worker: int) -> Node:
    for node in nodes:
        if worker < len(node.workers):
            return node
        worker -= len(node.workers)
    return nodes[-1]


# ---------------------------------------------------------------------------------------------
# Ray, as the facts show it (pure)


@dataclass(frozen=True)
class RayView:
    """Ray as the workers' own processes show it (a raylet, the GCS it talks to), read in
    the facts fan-out: no `ray status`, no dashboard."""

    head: int | None              # the worker running Ray's GCS (None: none does)
    joined: tuple[int, ...]       # workers whose raylet talks to that head's GCS
    missing: tuple[int, ...]      # the other workers
    stray: tuple[int, ...]        # workers with a raylet talking to another GCS (or none)

    @property
    def up(self) -> bool:
        return self.head is not None and not self.missing

    def line(self) -> str:
        total = len(self.joined) + len(self.missing)
        if self.head is None:
            return (f"Ray: not up (raylets on {nodeset.fold(self.stray)} without a head); "
                    "`tpufab ray up` restarts it.")
        if not self.missing:
            return f"Ray: up, head {nodeset.label(self.head)}, {total}/{total} hosts joined."
        return (f"Ray: head {nodeset.label(self.head)}, {len(self.joined)}/{total} hosts "
                f"joined ({nodeset.fold(self.missing)} missing); `tpufab ray up` rejoins them.")


def ray_view(facts: Mapping[int, StatusRow]) -> RayView | None:
    """Whether Ray is up and joined on every worker, from the facts; None when no worker runs
    any Ray daemon (Ray is not used there: nothing to say) (pure)."""
    where = {w: f.ray for w, f in sorted(facts.items()) if f.ray}
    if not where:
        return None
    heads = [w for w, r in where.items() if r.get("head")]
    if not heads:
        return RayView(None, (), tuple(sorted(facts)), tuple(where))
    head = heads[0]
    address = where[head].get("gcs_address")
    joined = tuple(w for w, r in where.items() if r.get("raylet") and address
                   and r.get("gcs_address") == address)
    missing = tuple(w for w in sorted(facts) if w not in joined)
    stray = tuple(w for w in missing if w in where)
    return RayView(head, joined, missing, stray)
