"""The supervisor's VM (docs/supervisor.md, "The VM"): one small Compute Engine VM per project
running tpufab's supervisor service under systemd, with the laptop's own tpufab.

    vm = ensure(settings)          # made if missing (and waited for), else checked; SupervisorVM
    status(settings)               # SupervisorStatus: the VM, its install, heartbeat, jobs, cost
    down(settings, force=False)    # refused while jobs are live, unless forced

The VM's startup script is vm_startup.py (stdlib only). On the VM, for the service:
``live_jobs``, ``IdleWatch`` and ``delete_self`` (the VM deletes itself through the API with
its own token after ``supervisor_idle`` with no live job). None of it prints.
"""

from __future__ import annotations

import json
import secrets
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tpufab.cloud.planes.vms import InstanceCalls
from tpufab.config import Settings, timeout_for
from tpufab.errors import ApiError, ConfigError, NotFound, TpufabError
from tpufab.flows.supervisor.state import SUPERVISORS, TERMINAL

MODULE = "tpufab.flows.supervisor"   # the service: python -m MODULE serve --bucket B --name N
IMAGE = "projects/debian-cloud/global/images/family/debian-12"
SCOPES = ("https://www.googleapis.com/auth/cloud-platform",)
LABEL = "tpufab-supervisor"
ATTRIBUTE = "tpufab-supervisor"      # the instance attribute the startup script reads
STARTUP = Path(__file__).with_name("vm_startup.py")
METADATA = "http://metadata.google.internal/computeMetadata/v1/"
GOOGLE_COMPUTE = "https://compute.googleapis.com"
GOOGLE_CRM = "https://cloudresourcemanager.googleapis.com"
ENV_SETTINGS = ("api_endpoint", "compute_endpoint", "storage_endpoint", "os_login_endpoint",
                "project", "zone", "supervisor_idle")
# What the service account needs, and the role that grants each (docs/supervisor.md).
PROJECT_PERMISSIONS: dict[str, str] = {
    "tpu.nodes.create": "roles/tpu.admin", "tpu.nodes.delete": "roles/tpu.admin",
    "tpu.nodes.get": "roles/tpu.admin", "tpu.nodes.list": "roles/tpu.admin",
    "tpu.operations.get": "roles/tpu.admin", "tpu.queuedResources.create": "roles/tpu.admin",
    "tpu.queuedResources.delete": "roles/tpu.admin",
    "compute.instances.create": "roles/compute.instanceAdmin.v1",
    "compute.instances.delete": "roles/compute.instanceAdmin.v1",
    "compute.instances.get": "roles/compute.instanceAdmin.v1",
    "compute.instances.list": "roles/compute.instanceAdmin.v1",
    "compute.instances.setMetadata": "roles/compute.instanceAdmin.v1",
    "compute.instanceGroupManagers.create": "roles/compute.instanceAdmin.v1",
    "compute.instanceGroupManagers.delete": "roles/compute.instanceAdmin.v1",
    "compute.projects.get": "roles/compute.instanceAdmin.v1",
    "iam.serviceAccounts.actAs": "roles/iam.serviceAccountUser",
}
BUCKET_PERMISSIONS: dict[str, str] = {
    "storage.objects.get": "roles/storage.objectUser",
    "storage.objects.create": "roles/storage.objectUser",
    "storage.objects.delete": "roles/storage.objectUser",
    "storage.objects.list": "roles/storage.objectUser",
}
# On-demand list prices of the VMs in us-central1, USD an hour (docs/supervisor.md, "Cost":
# the dated table these come from); hourly_cost adds the 10 GB balanced boot disk.
HOURLY_USD = {"e2-micro": 0.0084, "e2-small": 0.0168, "e2-medium": 0.0335,
              "e2-standard-2": 0.0670, "e2-standard-4": 0.1340, "n2-standard-2": 0.0971,
              "n2-standard-4": 0.1942}
DISK_GB, DISK_USD_GB_MONTH = 10, 0.10
PRICES_DATED = "2026-12-02"
STOPPED = ("TERMINATED", "STOPPED", "SUSPENDED")   # Compute Engine statuses `up` starts from


def install_record_name(name: str) -> str:
    """What the VM's startup script says it did (vm_startup.py writes it)."""
    return f"{SUPERVISORS}{name}-install.json"


@dataclass
class SupervisorVM:
    name: str
    zone: str
    project: str
    machine_type: str
    status: str                 # Compute Engine's: RUNNING, STAGING, TERMINATED...
    since: str                  # its creation time (RFC 3339)
    ip: str = ""
    created: bool = False       # made by this call
    upgraded: bool = False      # its tpufab replaced by this call
    version: str | None = None  # the tpufab its startup script installed
    code_id: str | None = None
    booted_at: float | None = None


@dataclass
class SupervisorStatus:
    vm: SupervisorVM | None
    bucket: str
    install: dict[str, Any] | None
    heartbeat: dict[str, Any] | None
    jobs: list[Any] = field(default_factory=list)     # flows.supervisor.jobs.JobRow
    hourly_usd: float | None = None
    now: float = 0.0

    @property
    def live(self) -> list[Any]:
        return [r for r in self.jobs if r.state is not None and r.state.state not in TERMINAL]

    @property
    def uptime(self) -> float | None:
        booted = (self.install or {}).get("booted_at")
        return None if booted is None or self.vm is None else max(0.0, self.now - booted)


def hourly_cost(machine_type: str) -> float | None:
    """The list price an hour of the VM and its boot disk (HOURLY_USD), or None if unlisted."""
    price = HOURLY_USD.get(machine_type)
    return None if price is None else round(price + DISK_GB * DISK_USD_GB_MONTH / 730, 4)


# -- the Compute Engine calls ------------------------------------------------------------


def _rest_view(inst: dict[str, Any], project: str, zone: str, **extra: Any) -> SupervisorVM:
    """A SupervisorVM of the instance as the REST API gives it (InstanceCalls.read)."""
    nic = (inst.get("networkInterfaces") or [{}])[0]
    ip = next((a["natIP"] for a in nic.get("accessConfigs") or [] if a.get("natIP")), "") \
        or nic.get("networkIP", "")
    return SupervisorVM(name=inst["name"], zone=zone, project=project,
                        machine_type=str(inst.get("machineType", "")).rsplit("/", 1)[-1],
                        status=str(inst.get("status", "")),
                        since=inst.get("creationTimestamp", ""), ip=ip, **extra)


def _view(inst: Any, project: str, zone: str, **extra: Any) -> SupervisorVM:
    nic = inst.network_interfaces[0] if inst.network_interfaces else None
    ip = ""
    if nic is not None:
        ip = next((a.nat_i_p for a in nic.access_configs if a.nat_i_p), "") or nic.network_i_p
    return SupervisorVM(name=inst.name, zone=zone, project=project,
                        machine_type=inst.machine_type.rsplit("/", 1)[-1],
                        status=str(inst.status), since=inst.creation_timestamp, ip=ip, **extra)


# -- the laptop side ---------------------------------------------------------------------


def _records(settings: Settings):
    from tpufab.flows.supervisor.state import Records

    return Records.from_settings(settings)


def _service_env(settings: Settings) -> dict[str, str]:
    """The settings the service runs with (endpoints, project, zone: never a secret)."""
    env = {}
    for key in ENV_SETTINGS:
        value = getattr(settings, key, None)
        if value not in (None, ""):
            env[f"TPUFAB_{key.upper()}"] = str(value)
    return env


def _config(settings: Settings, bucket: str, wheels: Sequence[str], version: str,
            code_id: str, module: str) -> dict[str, Any]:
    from tpufab.flows.supervisor.state import check_supervisor_name

    name = check_supervisor_name(settings.supervisor_name)
    return {"bucket": bucket, "name": name, "record": install_record_name(name),
            "wheels": list(wheels), "version": version, "code_id": code_id, "module": module,
            "storage_endpoint": settings.storage_endpoint or "",
            "env": _service_env(settings), "install_id": secrets.token_hex(8),
            "project": settings.project,
            # the product's service is the VM's one (its unit): `--on-vm` (service.Service)
            "args": ["--on-vm"] if module == MODULE else [],
            "crm_endpoint": (settings.api_endpoint or GOOGLE_CRM).rstrip("/"),
            "permissions": {"project": PROJECT_PERMISSIONS, "bucket": BUCKET_PERMISSIONS}}


def _body(settings: Settings, config: dict[str, Any]) -> dict[str, Any]:
    from tpufab.ssh import keys as sshkeys

    zone, machine = settings.zone, settings.supervisor_machine_type
    entry = sshkeys.metadata_entry(settings.ssh_user, sshkeys.ensure_key(settings.ssh_key_path))
    return {
        "name": config["name"], "machine_type": f"zones/{zone}/machineTypes/{machine}",
        "description": "tpufab's supervisor: keeps supervised jobs going (docs/supervisor.md)",
        "labels": {LABEL: "true"},
        "disks": [{"boot": True, "auto_delete": True,
                   "initialize_params": {"source_image": IMAGE, "disk_size_gb": DISK_GB}}],
        "network_interfaces": [{"network": "global/networks/default",
                                "access_configs": [{"name": "External NAT",
                                                    "type_": "ONE_TO_ONE_NAT"}]}],
        "service_accounts": [{"email": "default", "scopes": list(SCOPES)}],
        "scheduling": {"automatic_restart": True, "on_host_maintenance": "MIGRATE"},
        "metadata": {"items": [{"key": "startup-script", "value": STARTUP.read_text()},
                               {"key": ATTRIBUTE, "value": json.dumps(config)},
                               {"key": "ssh-keys", "value": entry}]},
    }


def _upload_wheels(settings: Settings, bucket: str, extra_wheels: Sequence[Path]):
    """Build this tpufab's wheel and put it (and ``extra_wheels``) in the bucket, keyed by
    its code id; returns (wheel, object names)."""
    from tpufab.cloud.storage import Storage
    from tpufab.flows.supervisor import wheel as wheels
    from tpufab.flows.supervisor.state import WHEELS

    store = Storage.from_settings(settings)
    ident = wheels.code_id()
    names = []
    with tempfile.TemporaryDirectory(prefix="tpufab-supervisor-") as folder:
        built = wheels.build(Path(folder))
        for path in [built.path, *map(Path, extra_wheels)]:
            name = f"{WHEELS}{ident}/{path.name}"
            if store.stat(bucket, name) is None:
                store.put(bucket, name, path.read_bytes())
            names.append(name)
    return built, names


def live_jobs(settings: Settings, *, strict: bool = False) -> list[Any]:
    """The jobs of the bucket that are not over (none when it cannot be read, unless
    ``strict``: then its error)."""
    from tpufab.flows.supervisor.jobs import list_jobs
    from tpufab.flows.supervisor.state import BucketMissing

    try:
        rows = list_jobs(_records(settings))
    except BucketMissing:
        return []
    except TpufabError:
        if strict:
            raise
        return []
    return [r for r in rows if r.state is not None and r.state.state not in TERMINAL]


def _wait_install(settings: Settings, bucket: str, name: str, install_id: str,
                  timeout: float) -> dict[str, Any]:
    from tpufab.cloud.storage import Storage

    store = Storage.from_settings(settings)
    deadline = time.monotonic() + timeout
    while True:
        found = store.read_json(bucket, install_record_name(name))
        if found is not None and found[0].get("install_id") == install_id:
            return found[0]
        if time.monotonic() > deadline:
            raise ApiError(f"The supervisor VM {name!r} did not finish installing tpufab within "
                           f"{timeout:g} s; see its startup script's output with `gcloud compute "
                           f"instances get-serial-port-output {name} --zone {settings.zone}`.")
        time.sleep(1.0)


def _refusal(record: dict[str, Any], name: str) -> str | None:
    """The one sentence for an install that did not end with the service running."""
    missing = record.get("missing") or {}
    if missing:
        roles = sorted(set(missing.values()))
        return (f"The supervisor VM's service account lacks {', '.join(sorted(missing))}, so it "
                f"could not keep jobs going: grant it {' and '.join(roles)} (gcloud projects "
                "add-iam-policy-binding PROJECT --member serviceAccount:EMAIL --role ROLE), "
                "then run `tpufab supervisor up` again.")
    if not record.get("ok"):
        return (f"The supervisor VM {name!r} could not start its service: "
                f"{record.get('error') or 'no reason given'}.")
    return None


def _tell(console: Any, text: str) -> None:
    """A progress line to ``console`` (a rich Console the caller gave), if any."""
    if console is not None:
        console.print(text, markup=False, highlight=False)


def ensure(settings: Settings, *, console: Any = None, module: str = MODULE,
           extra_wheels: Sequence[Path] = (), timeout: float | None = None) -> SupervisorVM:
    """The project's supervisor VM, made if missing: the laptop's own tpufab installed in a
    venv of its own and the service running under systemd. One that runs another tpufab is
    upgraded in place (its VM reset, its startup script installing this one) when no job is
    live, else refused in one sentence. ``module`` and ``extra_wheels``: the service's module
    and wheels installed beside tpufab (tests use a stand-in service; the product's is
    MODULE). A stopped one is started (its install checked again). A VM made here whose
    install fails is deleted again (nothing half-made)."""
    from tpufab.cloud.storage import Storage
    from tpufab.flows.supervisor import wheel as wheels
    from tpufab.flows.supervisor.state import bucket_for, check_supervisor_name

    install_timeout = timeout_for("supervisor up", timeout)
    name = check_supervisor_name(settings.supervisor_name)
    compute = InstanceCalls(settings)
    bucket = bucket_for(settings)
    store = Storage.from_settings(settings)
    store.ensure_bucket(bucket, project=settings.project)
    # warm (the VM up with this tpufab): told by REST GETs alone, no client library loaded
    look = compute.read(name)
    if look is not None and LABEL in (look.get("labels") or {}) and \
            str(look.get("status")) not in STOPPED:
        found = store.read_json(bucket, install_record_name(name))
        record = found[0] if found else {}
        if record.get("code_id") == wheels.code_id() and record.get("ok"):
            return _rest_view(look, compute.project, compute.zone,
                              version=record.get("version"), code_id=record.get("code_id"),
                              booted_at=record.get("booted_at"))
    inst = compute.get(name) if look is not None else None
    if inst is not None and LABEL not in dict(inst.labels):
        raise ConfigError(f"A VM named {name!r} exists in {compute.zone} and is no tpufab "
                          f"supervisor (it has no label {LABEL}), so tpufab leaves it alone: "
                          "set supervisor_name to another name.")
    if inst is not None:
        found = store.read_json(bucket, install_record_name(name))
        record = found[0] if found else {}
        same = record.get("code_id") == wheels.code_id() and bool(record.get("ok"))
        stopped = str(inst.status) in STOPPED
        if same and not stopped:
            return _view(inst, compute.project, compute.zone, version=record.get("version"),
                         code_id=record.get("code_id"), booted_at=record.get("booted_at"))
        live = [] if same else live_jobs(settings, strict=True)
        if live and record.get("ok"):
            raise ConfigError(
                f"The supervisor VM {name!r} runs another tpufab ({record.get('version')}, "
                f"code {record.get('code_id')}) and holds {len(live)} live job(s) "
                f"({', '.join(r.job for r in live[:3])}): it is upgraded only between jobs, so "
                "wait for them (or cancel them with `tpufab jobs cancel JOB`) and run this "
                "again, or run this laptop's jobs under that tpufab.")
        _tell(console, f"The supervisor VM {name} is stopped: starting it." if same and
              stopped else f"The supervisor VM {name} runs another tpufab "
              f"({record.get('version')}, code {record.get('code_id')}): upgrading it.")
        built, names = _upload_wheels(settings, bucket, extra_wheels)
        config = _config(settings, bucket, names, built.version, built.code_id, module)
        compute.set_attribute(inst, ATTRIBUTE, json.dumps(config), settings.api_timeout * 2)
        if stopped:   # a stopped supervisor: started, its startup script checks the install
            compute.start(name, install_timeout)
        else:         # another tpufab: the VM reset, its startup script installs this one
            compute.reset(name, install_timeout)
        record = _wait_install(settings, bucket, name, config["install_id"], install_timeout)
        refusal = _refusal(record, name)
        if refusal:
            raise ConfigError(refusal)
        inst = compute.get(name) or inst
        return _view(inst, compute.project, compute.zone, upgraded=not same,
                     version=record.get("version"), code_id=record.get("code_id"),
                     booted_at=record.get("booted_at"))
    _tell(console, f"Making the supervisor VM {name} ({settings.supervisor_machine_type}, "
          f"{settings.zone}) with this tpufab...")
    built, names = _upload_wheels(settings, bucket, extra_wheels)
    config = _config(settings, bucket, names, built.version, built.code_id, module)
    compute.insert(_body(settings, config), install_timeout)
    _tell(console, f"Waiting for {name} to install tpufab {built.version} and start its "
          "service (a minute or two)...")
    try:
        record = _wait_install(settings, bucket, name, config["install_id"], install_timeout)
        refusal = _refusal(record, name)
        if refusal:
            raise ConfigError(refusal)
    except BaseException:
        try:
            compute.delete(name, install_timeout)   # nothing half-made
        except TpufabError:
            pass
        raise
    inst = compute.get(name)
    if inst is None:
        raise NotFound(f"The supervisor VM {name!r} vanished right after it was made.")
    return _view(inst, compute.project, compute.zone, created=True,
                 version=record.get("version"), code_id=record.get("code_id"),
                 booted_at=record.get("booted_at"))


def status(settings: Settings) -> SupervisorStatus:
    """The supervisor VM (None when there is none), what its startup script installed, its
    service's heartbeat, every job in the bucket and the VM's hourly list price."""
    from tpufab.cloud.storage import Storage
    from tpufab.flows.supervisor.jobs import list_jobs
    from tpufab.flows.supervisor.state import BucketMissing, bucket_for, heartbeat_name

    name = settings.supervisor_name
    compute = InstanceCalls(settings)
    bucket = bucket_for(settings)
    inst = compute.get(name)
    store = Storage.from_settings(settings)
    install = heartbeat = None
    rows: list[Any] = []
    try:
        found = store.read_json(bucket, install_record_name(name))
        install = found[0] if found else None
        found = store.read_json(bucket, heartbeat_name(name))
        heartbeat = found[0] if found else None
        rows = list_jobs(_records(settings))
    except (BucketMissing, NotFound):
        pass
    vm = None if inst is None else _view(inst, compute.project, compute.zone,
                                         version=(install or {}).get("version"),
                                         code_id=(install or {}).get("code_id"),
                                         booted_at=(install or {}).get("booted_at"))
    return SupervisorStatus(vm=vm, bucket=bucket, install=install, heartbeat=heartbeat,
                            jobs=rows, now=time.time(),
                            hourly_usd=None if vm is None else hourly_cost(vm.machine_type))


def idle_supervisor(settings: Settings) -> SupervisorVM | None:
    """The supervisor VM when it holds no live job (what `tpufab gc` lists), else None; None
    too when it cannot be told (no project or zone, an API that does not answer)."""
    try:
        compute = InstanceCalls(settings)
        inst = compute.read(settings.supervisor_name)   # REST: no client to import
        if inst is None or live_jobs(settings, strict=True):
            return None
    except Exception:   # noqa: BLE001 - gc goes on without this line
        return None
    return SupervisorVM(name=inst["name"], zone=compute.zone, project=compute.project,
                        machine_type=str(inst.get("machineType", "")).rsplit("/", 1)[-1],
                        status=inst.get("status", ""), since=inst.get("creationTimestamp", ""))


def ssh_argv(settings: Settings, command: Sequence[str] = (), *,
             known_hosts: Path) -> list[str]:
    """OpenSSH's argv into the supervisor VM as ``ssh_user`` with tpufab's key (the one its
    metadata ``ssh-keys`` holds), its host key pinned from its guest attributes into
    ``known_hosts``; ``command`` run there (one piece: a command line as typed, as ssh takes
    it; several: each quoted), else a login shell."""
    from tpufab.quoting import command as quoted

    name = settings.supervisor_name
    compute = InstanceCalls(settings)
    inst = compute.get(name)
    if inst is None:
        raise NotFound(f"There is no supervisor VM {name!r} in {compute.zone} (project "
                       f"{compute.project}): `tpufab supervisor up` makes one.")
    vm = _view(inst, compute.project, compute.zone)

    def fetch(**kw: Any) -> Any:
        return compute.c.instances.get_guest_attributes(request={
            "project": compute.project, "zone": compute.zone, "instance": name,
            "query_path": "hostkeys/"}, **kw)

    attrs = compute.call("get", name, fetch)
    lines = [f"{vm.ip} {item.key} {item.value.strip().split()[-1]}"
             for item in attrs.query_value.items if item.key.startswith(("ssh-", "ecdsa-"))]
    if not lines:
        raise ApiError(f"The supervisor VM {name!r} publishes no host key yet (guest "
                       "attributes hostkeys/); try again once it has booted.")
    known_hosts.write_text("".join(f"{line}\n" for line in lines))
    argv = ["ssh", "-i", str(settings.ssh_key_path), "-o", "IdentitiesOnly=yes",
            "-o", f"UserKnownHostsFile={known_hosts}", "-o", "StrictHostKeyChecking=yes",
            "-o", "BatchMode=yes", "-o", "ConnectTimeout=20", f"{settings.ssh_user}@{vm.ip}"]
    if not command:
        return argv
    return [*argv, command[0] if len(command) == 1 else str(quoted(*command))]


def down(settings: Settings, *, force: bool = False, timeout: float | None = None) -> str:
    """Delete the supervisor VM (the bucket keeps every record). Refused while jobs are live,
    unless ``force`` (they wait in the bucket for the next supervisor). Returns a sentence."""
    name = settings.supervisor_name
    compute = InstanceCalls(settings)
    inst = compute.get(name)
    if inst is None:
        return f"There is no supervisor VM {name!r} in {compute.zone}; nothing to delete."
    if LABEL not in dict(inst.labels):
        raise ConfigError(f"The VM {name!r} in {compute.zone} is no tpufab supervisor (it has "
                          f"no label {LABEL}), so `supervisor down` leaves it alone.")
    live = live_jobs(settings, strict=not force)
    if live and not force:
        raise ConfigError(
            f"The supervisor VM {name!r} has {len(live)} live job(s) "
            f"({', '.join(r.job for r in live[:3])}{', ...' if len(live) > 3 else ''}): "
            "cancel them first (`tpufab jobs cancel JOB`), or pass --force to delete it anyway "
            "(the jobs then wait in the bucket until the next `supervisor up`).")
    compute.delete(name, timeout_for("supervisor down", timeout))
    left = f"; {len(live)} live job(s) wait in the bucket for the next supervisor" if live \
        else ""
    return f"Deleted the supervisor VM {name!r} in {compute.zone}{left}."


# -- on the VM ---------------------------------------------------------------------------


def _metadata(path: str) -> str:
    import urllib.request

    request = urllib.request.Request(METADATA + path, headers={"Metadata-Flavor": "Google"})
    with urllib.request.urlopen(request, timeout=10) as answer:
        return answer.read().decode()


def instance_id() -> str:
    """This VM's instance id (its metadata server's): unique to the VM, not to its name."""
    return _metadata("instance/id").strip()


def own_token() -> str:
    """This VM's service-account token (its metadata server's)."""
    return json.loads(_metadata("instance/service-accounts/default/token"))["access_token"]


def _request(method: str, url: str, body: Any = None, token: str | None = None) -> dict:
    import urllib.request

    data = None if body is None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    request = urllib.request.Request(url, data=data, method=method, headers=headers)
    with urllib.request.urlopen(request, timeout=60) as answer:
        return json.loads(answer.read() or b"{}")


def delete_self(settings: Settings) -> None:
    """Delete this VM through the Compute Engine API with its own token (the idle end)."""
    name = _metadata("instance/name")
    zone = _metadata("instance/zone").rsplit("/", 1)[-1]
    project = _metadata("project/project-id")
    endpoint = (settings.compute_endpoint or settings.api_endpoint or GOOGLE_COMPUTE)
    endpoint = endpoint.rstrip("/").removesuffix("/compute/v1")
    _request("DELETE", f"{endpoint}/compute/v1/projects/{project}/zones/{zone}/instances/{name}",
             token=own_token())


class IdleWatch:
    """When the service has had no live job for ``idle`` seconds (``supervisor_idle``)."""

    def __init__(self, idle: float, clock: Callable[[], float] = time.monotonic):
        self.idle = idle
        self.clock = clock
        self.since: float | None = clock()

    def update(self, live: int) -> bool:
        """Feed the number of live jobs now; True once idle long enough."""
        now = self.clock()
        if live:
            self.since = None
            return False
        if self.since is None:
            self.since = now
        return now - self.since >= self.idle
