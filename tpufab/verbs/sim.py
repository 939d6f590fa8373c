"""The simulated pod's verbs: sim up/down/status, faults, zombie, bucket."""

from __future__ import annotations

from typing import Any

from tpufab.config import load_settings
from tpufab.errors import ConfigError
from tpufab.verbs.common import pod_for, print_json, say, settings_from_flags
from tpufab.verbs.declare import Opt, verb

PLACE = 10   # where this family's verbs show in `tpufab --help`
GROUPS = {"sim": "The simulated TPU pod: a local TPU API with real SSH workers."}


@verb(name="up", group="sim", options={"port": "API port."})
def sim_up(*, port: int | None = None, state_dir: str | None = None) -> None:
    """Start the simulated pod in the background and print the lines to export."""
    from tpufab.sim import daemon
    from tpufab.term.console import stdout

    info = daemon.up(state_dir=state_dir, port=port)
    already = " (it was already running)" if info.already_running else ""
    stdout().print(f"[green]The simulated TPU pod is up[/green]{already}: TPU API at "
                   f"{info.endpoint} (pid {info.pid}, state in {info.state_dir}).")
    _print_exports(info)


def _print_exports(info: Any) -> None:
    from tpufab.term.console import stdout

    stdout().print("Point tpufab at it by pasting these lines into your shell:")
    # plain print: no wrapping or markup, so the lines copy and paste as they are
    print()
    for line in info.exports().splitlines():
        print(f"  {line}")
    print(flush=True)


@verb(name="down", group="sim")
def sim_down(*, state_dir: str | None = None) -> None:
    """Stop the simulated pod (its nodes are kept on disk)."""
    from tpufab.sim import daemon
    from tpufab.term.console import stdout

    stdout().print(daemon.down(state_dir=state_dir), markup=False)


@verb(name="status", group="sim")
def sim_status(*, state_dir: str | None = None, as_json: bool = False) -> int:
    """Is the simulated pod up, and where."""
    from tpufab.sim import daemon
    from tpufab.term.console import stdout

    status = daemon.status(state_dir=state_dir)
    if as_json:
        print_json({"running": status.running, "state_dir": str(status.state_dir),
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
        bastion = (f"; no external IPs, jump host {node['bastion']}: --jump {node['bastion']}"
                   if node.get("bastion") else "")
        console.print(f"  node {node['name'].rsplit('/', 1)[-1]}: {node.get('acceleratorType')} "
                      f"{node.get('state')} ({workers} workers{bastion})", markup=False)
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


def parse_seconds(text: str | float | None) -> float:
    """'10s', '2m', '1.5', 30 -> seconds; bad input is a ConfigError with the fix."""
    if text in (None, ""):
        return 0.0
    if isinstance(text, int | float):
        value = float(text)
    else:
        raw = str(text).strip().lower()
        scale = {"s": 1, "m": 60, "h": 3600}.get(raw[-1:], None)
        try:
            value = float(raw[:-1] if scale else raw) * (scale or 1)
        except ValueError:
            raise ConfigError(f"--notice takes a duration such as 30s, 2m or 10, not "
                              f"{text!r}.") from None
    if value < 0:
        raise ConfigError(f"--notice cannot be negative ({text!r}).")
    return value


@verb(name="preempt", group="sim",
      options={"name": "Node to preempt.",
               "notice": "Announce it this long before (10s, 2m): meanwhile the workers' "
                         "metadata server says instance/preempted=TRUE, as spot VMs get."})
def sim_preempt(*, name: str, notice: str | None = None) -> None:
    """Preempt a node: state PREEMPTED, workers stopped (with --notice, announced first)."""
    import time

    from tpufab.cloud.names import validate_name
    from tpufab.term.console import stdout

    seconds = parse_seconds(notice)
    admin = sim_admin()
    node = admin.resolve(validate_name(name))   # a TPU API node or a Compute Engine slice
    if seconds <= 0:
        admin.preempt(node)
        stdout().print(f"Preempted TPU node {name}: it is PREEMPTED and its workers are stopped.")
        return
    admin.preempt(node, notice=seconds)
    stdout().print(f"Preemption notice given to {name}: its workers' metadata server says "
                   f"instance/preempted=TRUE; preempting in {seconds:g} s.")
    deadline = time.monotonic() + seconds + 60
    while admin.node(node)["node"]["state"] != "PREEMPTED":
        if time.monotonic() > deadline:
            raise ConfigError(f"{name} was not preempted within {seconds + 60:g} s of the "
                              "notice; see the simulated pod's daemon.log.")
        time.sleep(0.2)
    stdout().print(f"Preempted TPU node {name}: it is PREEMPTED and its workers are stopped.")


@verb(name="unreachable", group="sim",
      options={"name": "Node.", "worker": Opt("Worker index.", short="-w", required=True),
               "restore": "Make it reachable again."})
def sim_unreachable(*, name: str, worker: int, restore: bool = False) -> None:
    """Make one worker unreachable over SSH (or reachable again)."""
    from tpufab.cloud.names import validate_name
    from tpufab.term.console import stdout

    sim_admin().set_reachable(validate_name(name), worker, restore)
    state = "reachable again" if restore else (
        "unreachable (new connections refused; connections kept open stay: `tpufab "
        "disconnect` drops them)")
    stdout().print(f"Worker {worker} of {name} is {state}.")


@verb(name="slow", group="sim",
      options={"name": "Node.", "worker": Opt("Worker index.", short="-w", required=True),
               "by": Opt("Share of time its processes are stopped: 15% (0 undoes it).",
                         required=True)})
def sim_slow(*, name: str, worker: int, by: str) -> None:
    """Make one worker's processes really slower (stopped for that share of every 0.1 s)."""
    from tpufab.cloud.names import validate_name
    from tpufab.sim.slow import parse_share
    from tpufab.term.console import stdout

    share = parse_share(by)
    sim_admin().set_slow(validate_name(name), worker, share)
    stdout().print(f"Worker {worker} of {name} is slowed by {share:.0%}." if share else
                   f"Worker {worker} of {name} runs at full speed again.")


@verb(name="registry", group="sim",
      options={"fail_auth": "Share of each node's hosts whose first authenticated requests "
                            "are refused: 25% (0 undoes it).",
               "fail_times": Opt("How many requests of each such host are refused.", min=0),
               "slow": "Seconds every answer is delayed (0 undoes it)."})
def sim_registry(*, fail_auth: str | None = None, fail_times: int | None = None,
                 slow: float | None = None, as_json: bool = False) -> None:
    """Where the simulated Artifact Registry is, and its faults (auth failures, slowness)."""
    from tpufab.sim.slow import parse_share
    from tpufab.term.console import stdout

    changes: dict[str, Any] = {}
    if fail_auth is not None:
        changes["failAuth"] = parse_share(fail_auth, limit=1.0, flag="--fail-auth")
    if fail_times is not None:
        changes["failTimes"] = fail_times
    if slow is not None:
        if slow < 0:
            raise ConfigError(f"--slow takes seconds (0 or more), not {slow}.")
        changes["slowSeconds"] = slow
    state = sim_admin().registry(**changes)
    if as_json:
        print_json(state)
        return
    faults = []
    if state["failAuth"]:
        faults.append(f"{state['failAuth']:.0%} of each node's hosts have their first "
                      f"{state['failTimes']} authenticated requests refused")
    if state["slowSeconds"]:
        faults.append(f"every answer waits {state['slowSeconds']:g} s")
    stdout().print(f"The simulated Artifact Registry is at {state['address']} (workers reach "
                   f"it as {', '.join(state['hosts'][:3])}, ...; user oauth2accesstoken, "
                   "password: the VM's access token from its metadata server; as "
                   f"{state['otherHost']}, a registry that is not Artifact Registry, with the "
                   f"account in {state['accountFile']}); "
                   + ("; ".join(faults) if faults else "no faults") + ".", markup=False,
                   highlight=False)


@verb(name="image", group="sim",
      options={"cache": "Folder holding the shared site (site/) and the built image "
                        "(image/); default: the pod's share.",
               "tag": "Tag to push.",
               "slim": "The OS and Python alone (~50 MB), pushed as tpufab/slim: no JAX."})
def sim_image(*, cache: str | None = None, tag: str = "latest", slim: bool = False,
              state_dir: str | None = None) -> None:
    """Build the base image (Python and the workers' JAX) once, push it to the simulated
    registry, print its reference as the last line."""
    from pathlib import Path

    from tpufab.sim import daemon
    from tpufab.sim.image import publish
    from tpufab.term.console import stdout

    admin = sim_admin()
    state = admin.registry()
    share = Path(cache) if cache else daemon.status(state_dir=state_dir).state_dir / "share"
    reference, digest = publish(state, share, project=admin.project, tag=tag, jax=not slim,
                                name="slim" if slim else "base")
    stdout().print(f"Pushed {reference} ({digest}) to {state['address']}.", markup=False,
                   highlight=False)
    print(reference, flush=True)


@verb(name="fail-create", group="sim",
      options={"quota": "Quota exceeded, not stockout.",
               "zone": "Only creates in this zone (default: any zone).",
               "count": Opt("How many creates fail.", min=1)})
def sim_fail_create(*, quota: bool = False, zone: str | None = None, count: int = 1) -> None:
    """Make the next create (or COUNT creates, in ZONE) fail with RESOURCE_EXHAUSTED."""
    from tpufab.term.console import stdout

    if count < 1:
        raise ConfigError(f"--count must be 1 or more, not {count}.")
    reason = "quota" if quota else "stockout"
    sim_admin().fail_next_create(reason, zone=zone, count=count)
    which = "create" if count == 1 else f"{count} creates"
    where = f" in {zone}" if zone else ""
    stdout().print(f"The next {which}{where} will fail with RESOURCE_EXHAUSTED ({reason}).")


@verb(name="burst", group="sim",
      options={"count": Opt("How many calls fail.", min=1, required=True), "code": "503 or 429."})
def sim_burst(*, count: int, code: int = 503) -> None:
    """Make the next COUNT API calls fail with 503 (or 429)."""
    from tpufab.term.console import stdout

    if code not in (429, 503):
        raise ConfigError(f"--code must be 503 or 429, not {code}.")
    sim_admin().error_burst(count, code=code)
    stdout().print(f"The next {count} TPU API requests will fail with {code}.")


@verb(name="zombie", group="sim")
def sim_zombie(*, name: str | None = None, worker: str = "all", zone: str | None = None,
               project: str | None = None) -> int:
    """Leave a crashed job's mess on workers: TPU holders (some ignore TERM), the lockfile,
    and a protected system process."""
    from tpufab import nodeset
    from tpufab.errors import SimError
    from tpufab.steps.host.killing import make_zombies, zombie_lines

    pod = pod_for(settings_from_flags(name=name, zone=zone, project=project))
    chosen = pod.select(worker)
    reports = make_zombies(pod.fanout, chosen, device_globs=pod.device_globs())
    for line in zombie_lines(reports):
        say(line)
    failed = [w for w, r in reports.items() if r.report is None or any(
        "error" in z for z in r.report.get("zombies", ()))]
    done = [w for w in chosen if w not in failed]
    if done:
        say(f"Left a crashed job's mess on {nodeset.fold(done)}: processes holding the TPU "
             "(one ignores SIGTERM), the libtpu lockfile held, and a protected tpu-runtime "
             f"holder. Clear it with `tpufab kill --name {pod.name}`.")
    if failed:
        raise SimError(f"Could not make the mess on {nodeset.fold(failed)} (see above).")
    return 0


@verb(name="bucket", group="sim", options={"name": "Bucket name."})
def sim_bucket(*, name: str) -> None:
    """Create a bucket in the simulated pod's Cloud Storage (a no-op if it exists)."""
    from tpufab.config import load_settings
    from tpufab.sim import daemon
    from tpufab.sim.admin import StorageClient
    from tpufab.steps.host.mount import parse_bucket
    from tpufab.term.console import stdout

    bucket, prefix = parse_bucket(name)
    if prefix:
        raise ConfigError(f"Give a bucket name without a prefix ({bucket}, not {name}); "
                          "prefixes need no creating.")
    endpoint = load_settings().storage_endpoint
    if not endpoint:
        status = daemon.status()
        if not status.running or status.info is None:
            raise ConfigError("No simulated Cloud Storage to talk to: TPUFAB_STORAGE_ENDPOINT "
                              "is not set and no simulated pod is running; start one with "
                              "`tpufab sim up`.")
        endpoint = status.info.storage_endpoint
        if not endpoint:
            raise ConfigError("The simulated pod runs without Cloud Storage (the "
                              "gcp-storage-emulator package is missing): pip install "
                              "gcp-storage-emulator, then `tpufab sim down && tpufab sim up`.")
    created = StorageClient(endpoint).create_bucket(bucket)
    state = "Created bucket" if created else "Bucket"
    tail = "" if created else " already exists"
    stdout().print(f"{state} gs://{bucket}{tail} in the Cloud Storage at {endpoint}.",
                   markup=False)


@verb(name="os-login", group="sim",
      options={"enable": "Turn OS Login on for the project (metadata enable-oslogin=TRUE).",
               "disable": "Turn it off for the project (enable-oslogin=FALSE).",
               "unset": "Remove the project's enable-oslogin (nodes decide alone).",
               "role": "Give --account this OS Login role: admin (roles/compute."
                       "osAdminLogin), login (roles/compute.osLogin) or none (the API then "
                       "refuses its keys).",
               "account": "The account --role is for (default: TPUFAB_OS_LOGIN_ACCOUNT, the "
                          "simulated pod's own)."})
def sim_os_login(*, enable: bool = False, disable: bool = False, unset: bool = False,
                 role: str | None = None, account: str | None = None) -> None:
    """Show or change OS Login in the simulated pod's project (its metadata and roles)."""
    from tpufab.term.console import stdout

    if enable + disable + unset > 1:
        raise ConfigError("Give one of --enable, --disable and --unset.")
    if role is not None and role not in ("admin", "login", "none"):
        raise ConfigError(f"--role takes admin, login or none, not {role!r}.")
    admin = sim_admin()
    changes: dict[str, Any] = {}
    if enable or disable or unset:
        changes["enabled"] = True if enable else False if disable else None
    if role is not None:
        changes.update(role=role, account=account or load_settings().os_login_account)
    state = admin.os_login(**changes)
    flag = state["metadata"].get("enable-oslogin", "not set")
    roles = ", ".join(f"{who}: {what}" for who, what in sorted(state["roles"].items()))
    stdout().print(f"OS Login in project {state['project']}: enable-oslogin={flag}; roles: "
                   f"{roles or 'every account is admin (the default)'}.", markup=False)


# -- maintenance windows and the end of a Compute Engine run
@verb(name="maintenance", group="sim",
      options={"name": "Node.",
               "in_": Opt("When the window starts (30s, 2h, 1d).", flag="--in",
                          metavar="DURATION"),
               "window": Opt("How long the window lasts (default 1h).", metavar="DURATION"),
               "clear": "Take the announced window back."})
def sim_maintenance(*, name: str, in_: str | None = None, window: str = "1h",
                    clear: bool = False) -> None:
    """Announce an upcoming maintenance window on a node (the API's upcomingMaintenance)."""
    from tpufab.cloud.names import validate_name
    from tpufab.durations import parse_duration
    from tpufab.term.console import stdout

    node = validate_name(name)
    if clear:
        sim_admin().schedule_maintenance(node, 0, clear=True)
        stdout().print(f"No maintenance announced on {name} any more.")
        return
    if not in_:
        raise ConfigError("Say when the window starts with --in DURATION (such as --in 2h), "
                          "or take one back with --clear.")
    start = parse_duration(in_, "--in")
    length = parse_duration(window, "--window")
    got = sim_admin().schedule_maintenance(node, start, window=length)
    when = got.get("upcomingMaintenance", {}).get("windowStartTime", "?")
    stdout().print(f"Maintenance announced on {name}: SCHEDULED, window starts {when} "
                   f"(in {in_}) and lasts {window}; `tpufab status` shows it.")


@verb(name="end-run", group="sim", options={"name": "Compute Engine slice or VM."})
def sim_end_run(*, name: str) -> None:
    """End a flex-start slice's run now, as its --max-run-duration would (Compute Engine's
    instanceTerminationAction: DELETE deletes its VMs)."""
    from tpufab.cloud.names import validate_name
    from tpufab.term.console import stdout

    got = sim_admin().end_run(validate_name(name))
    what = "deleted" if got.get("instanceTerminationAction") == "DELETE" else "stopped"
    stdout().print(f"The run of {name} ended: Compute Engine {what} its VMs.")
