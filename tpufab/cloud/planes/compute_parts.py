"""What ``ComputeEngine`` (tpufab/cloud/planes/compute.py) is built of, apart from its calls:
the names and constants of tpufab's Compute Engine resources, the pure translations (machine
types and accelerator types, worker order, the request body of a VM, the sentences of a short
MIG and an ended flex-start slice), the official client's factory, and a plain REST read that
needs no google-cloud-compute (3 s of CPU to import) for the one question every verb asks of
Compute Engine about a Cloud TPU API node: does it hold the name too."""

from __future__ import annotations

import ipaddress
import re
from datetime import datetime
from typing import Any

from tpufab.cloud.planes.calls import credentials_error
from tpufab.config import Settings
from tpufab.errors import ConfigError, TpufabError
from tpufab.topology import GENERATIONS, parse_accelerator_type

GOOGLE_COMPUTE = "https://compute.googleapis.com"
MADE_BY = "Made by tpufab for slice "   # the description of a policy/template tpufab made
WORKER_KEY = "tpufab-worker"  # a MIG VM's worker number, kept in its per-instance config
MULTISLICE_LABEL = "tpufab-multislice"   # on every VM of a Compute Engine multislice slice
SLICE_LABEL = "tpufab-slice"             # its slice index, 0..N-1
SLICE_POLICY = "HIGH_THROUGHPUT"         # the workload policy type that makes a MIG one slice
DEFAULT_IMAGE = "projects/ubuntu-os-accelerator-images/global/images/family/" \
                "ubuntu-accel-2204-amd64-tpu-tpu7x"
MACHINE_TYPES = {machine: (gen.name, chips) for gen in GENERATIONS.values()
                 for chips, machine in gen.machine_types}
STATES = {"PROVISIONING": "CREATING", "STAGING": "CREATING", "RUNNING": "READY",
          "STOPPING": "STOPPING", "SUSPENDING": "STOPPING", "SUSPENDED": "STOPPED",
          "TERMINATED": "STOPPED", "REPAIRING": "REPAIRING"}


def compute_endpoint(settings: Settings) -> str:
    """The Compute Engine endpoint (host only): compute_endpoint, else beside api_endpoint
    (an emulator serves both, as the simulated pod does), else Google's."""
    if settings.compute_endpoint:
        return settings.compute_endpoint.rstrip("/").removesuffix("/compute/v1")
    if settings.api_endpoint:
        return settings.api_endpoint.rstrip("/")
    return GOOGLE_COMPUTE


def machine_type_of(type_name: str) -> str:
    topo = parse_accelerator_type(type_name)
    if "compute" not in topo.planes or not topo.machine_type:
        raise ConfigError(f"{topo.name} is not offered on Compute Engine (it has no TPU machine "
                          "type there); drop --on compute, or pick a v5p, v6e or TPU7x type of "
                          "`tpufab types` (ON: compute).")
    return topo.machine_type


def type_of(machine_type: str, accelerator_topology: str | None, vms: int) -> str:
    """The accelerator type of ``vms`` VMs of ``machine_type`` (shaped ``accelerator_topology``)."""
    if machine_type not in MACHINE_TYPES:
        return ""
    generation, chips = MACHINE_TYPES[machine_type]
    gen = GENERATIONS[generation]
    if accelerator_topology:
        total = 1
        for d in accelerator_topology.split("x"):
            total *= int(d) if d.isdigit() else 1
    else:
        total = chips * max(1, vms)
    return f"{generation}-{total * gen.cores_per_chip}"


def short(url: str) -> str:
    return (url or "").rstrip("/").rsplit("/", 1)[-1]


def created(text: str) -> datetime | None:
    try:
        return datetime.fromisoformat(text.replace("Z", "+00:00")) if text else None
    except ValueError:
        return None


def ip_key(ip: str) -> tuple:
    try:
        return (0, int(ipaddress.ip_address(ip)))
    except ValueError:
        return (1, ip)


def parse_run_duration(value: Any) -> int:
    """``"8h"``, ``"90m"``, ``28800`` -> seconds; one sentence otherwise."""
    from tpufab.durations import parse_duration

    seconds = parse_duration(value if isinstance(value, str) else float(value),
                             "--max-run-duration")
    if not seconds or seconds <= 0:
        raise ConfigError("--max-run-duration must be a positive duration such as 8h.")
    return int(seconds)


def worker_order(members: list[Any], numbers: dict[str, int]) -> list[Any]:
    """A MIG's VMs in worker order: by the worker number tpufab kept for each in the MIG's
    per-instance configs (``record_worker_order``), else, for a VM without one (a slice
    made by hand), by internal IP after them."""
    def key(m: Any) -> tuple:
        ip = m.network_interfaces[0].network_i_p if m.network_interfaces else ""
        number = numbers.get(m.name)
        return (0, number, ip_key(ip)) if number is not None else (1, 0, ip_key(ip))

    return sorted(members, key=key)


def mig_short(name: str, have: int, want: int, missing: list[tuple[str, str]]) -> str:
    """The sentence for a MIG stuck below its size (Compute Engine could not create VMs)."""
    vms = ", ".join(vm for vm, _ in missing)
    why = missing[0][1].rstrip(".")
    stockout = "resources" in why or "RESOURCE_POOL_EXHAUSTED" in why
    fix = ("wait for capacity (the MIG keeps trying), or `tpufab delete --name "
           f"{name} --yes` and create it in another --zone or with --spot" if stockout else
           f"see `gcloud compute instance-groups managed list-instances {name}`, or `tpufab "
           f"delete --name {name} --yes` and create it again")
    return (f"{name} has {have}/{want} VMs: Compute Engine could not create {vms} ({why}); "
            f"{fix}.")


def flex_start_ended(name: str, accel: str, seconds: int) -> str:
    """The sentence for a flex-start slice whose maximum run duration ran out."""
    from tpufab.durations import human_duration

    run = human_duration(seconds) if seconds else "?"
    return (f"Flex-start slice {name} ended: its maximum run duration ({run}) ran out and "
            f"Compute Engine deleted its VMs; for another run, `tpufab delete --name {name} "
            f"--yes`, then `tpufab create --name {name} --type {accel} --flex-start "
            f"--max-run-duration {run}`.")


def config_type(body: dict) -> str:
    config = body.get("accelerator_config") or {}
    raise ConfigError(f"No accelerator type in the request ({config}).")


def region_of(url: str) -> str:
    m = re.search(r"/regions/([^/]+)/", url or "")
    return m.group(1) if m else ""


def reword_text(text: str) -> str:
    return (text.replace("The TPU API", "Compute Engine").replace("the TPU API", "Compute "
                                                                  "Engine")
            .replace("TPU API", "Compute Engine API"))


def reword(err: TpufabError) -> TpufabError:
    """The shared sentences name the TPU API; these calls went to Compute Engine."""
    text = reword_text(str(err))
    if text == str(err):
        return err
    new = type(err)(text)
    if hasattr(err, "exit_code"):
        try:
            new.exit_code = err.exit_code
        except AttributeError:
            pass
    return new


def instance_properties(v1: Any, body: dict) -> tuple[Any, str, str]:
    """The ``InstanceProperties`` of a VM for ``body`` (the TPU API's node body, as
    ``bodies.node_body`` builds it, plus ``flex_start``, ``max_run_duration`` and
    ``reservation``), its machine type and accelerator type (``v1``: compute_v1)."""
    type_name = body.get("accelerator_type") or config_type(body)
    machine = machine_type_of(type_name)
    metadata = dict(body.get("metadata") or {})
    network = body.get("network_config") or {}
    nic = v1.NetworkInterface()
    if network.get("network"):
        nic.network = network["network"]
    if network.get("subnetwork"):
        nic.subnetwork = network["subnetwork"]
    if network.get("enable_external_ips", True):
        nic.access_configs = [v1.AccessConfig(name="External NAT", type_="ONE_TO_ONE_NAT")]
    scheduling = v1.Scheduling(on_host_maintenance="TERMINATE", automatic_restart=False)
    if (body.get("scheduling_config") or {}).get("spot"):
        scheduling.provisioning_model = "SPOT"
        scheduling.instance_termination_action = "DELETE"
    if body.get("flex_start"):
        scheduling.provisioning_model = "FLEX_START"
        scheduling.max_run_duration = v1.Duration(
            seconds=parse_run_duration(body.get("max_run_duration")))
        scheduling.instance_termination_action = "DELETE"
    props = v1.InstanceProperties(
        machine_type=machine, labels={**dict(body.get("labels") or {}), "tpufab": "yes"},
        metadata=v1.Metadata(items=[v1.Items(key=k, value=v)
                                    for k, v in sorted(metadata.items())]),
        network_interfaces=[nic], scheduling=scheduling,
        disks=[v1.AttachedDisk(boot=True, auto_delete=True, initialize_params=(
            v1.AttachedDiskInitializeParams(source_image=DEFAULT_IMAGE,
                                            disk_size_gb=100)))])
    if body.get("reservation"):
        props.reservation_affinity = v1.ReservationAffinity(
            consume_reservation_type="SPECIFIC_RESERVATION",
            key="compute.googleapis.com/reservation-name",
            values=[body["reservation"]])
    if body.get("service_account"):
        props.service_accounts = [v1.ServiceAccount(
            email=body["service_account"]["email"],
            scopes=list(body["service_account"].get("scope") or []))]
    return props, machine, type_name


def made_by(name: str, zone: str) -> str:
    """The description of a policy or template tpufab makes for slice ``name`` in ``zone``."""
    return f"{MADE_BY}{name} in {zone}"


def made_for(description: str | None) -> tuple[str, str] | None:
    """(slice, zone) of a description ``made_by`` wrote (zone "" in one written before tpufab
    kept the zone there); None when tpufab did not make it."""
    if not (description or "").startswith(MADE_BY):
        return None
    owner, _, zone = (description or "")[len(MADE_BY):].partition(" in ")
    return owner, zone


def make_clients(endpoint: str) -> Any:
    """The official client's services for ``endpoint`` (REST; anonymous for an http://
    endpoint, else Application Default Credentials)."""
    from google.api_core.client_options import ClientOptions
    from google.cloud import compute_v1

    kw: dict[str, Any] = {"transport": "rest",
                          "client_options": ClientOptions(api_endpoint=endpoint)}
    try:
        if endpoint.startswith("http://"):
            from google.auth.credentials import AnonymousCredentials

            kw["credentials"] = AnonymousCredentials()

        class Clients:
            v1 = compute_v1
            instances = compute_v1.InstancesClient(**kw)
            groups = compute_v1.InstanceGroupManagersClient(**kw)
            templates = compute_v1.InstanceTemplatesClient(**kw)
            policies = compute_v1.ResourcePoliciesClient(**kw)
            zone_ops = compute_v1.ZoneOperationsClient(**kw)
            region_ops = compute_v1.RegionOperationsClient(**kw)
            global_ops = compute_v1.GlobalOperationsClient(**kw)

        return Clients()
    except Exception as exc:
        translated = credentials_error(exc)
        if translated is not None:
            raise translated from exc
        raise


class RestReader:
    """GETs of Compute Engine resources as JSON through requests, without the official client:
    anonymous for an http:// endpoint, else Application Default Credentials. An HTTP error
    leaves as google.api_core's exception (so the plane's retry policy and sentences apply);
    404 is None."""

    def __init__(self, endpoint: str, project: str):
        self.base = f"{endpoint.rstrip('/')}/compute/v1/projects/{project}"
        self._session: Any = None

    def get(self, path: str, *, retry: Any = None, timeout: float | None = None) -> dict | None:
        from google.api_core import exceptions as gexc

        if self._session is None:
            if self.base.startswith("http://"):
                import requests

                self._session = requests.Session()
            else:
                import google.auth
                from google.auth.transport.requests import AuthorizedSession

                credentials, _ = google.auth.default(
                    scopes=["https://www.googleapis.com/auth/cloud-platform"])
                self._session = AuthorizedSession(credentials)
        answer = self._session.get(f"{self.base}/{path}", timeout=timeout)
        if answer.status_code == 404:
            return None
        if answer.status_code >= 400:
            raise gexc.from_http_response(answer)
        return answer.json()


def independent_vms(name: str, zone: str, vms: list[str]) -> ConfigError:
    """The sentence for a MIG's name when the MIG is no slice (no HIGH_THROUGHPUT policy)."""
    listed = ", ".join(sorted(vms)) or "none yet"
    first = min(vms, default="VM")
    return ConfigError(
        f"{name!r} is a managed instance group without a HIGH_THROUGHPUT workload policy, "
        f"so its TPU VMs ({listed}) are independent single-host slices, not connected by "
        "ICI, and tpufab does not drive them as one pod: name one VM (`--name "
        f"{first}`), or make a multi-host slice with `tpufab create --name NAME --type "
        f"TYPE`; delete the group with `gcloud compute instance-groups managed delete "
        f"{name} --zone {zone}`.")


def owner_of(inst: Any) -> str:
    """The MIG that made VM ``inst`` (its ``created-by`` metadata), or ""."""
    made = next((i.value for i in inst.metadata.items if i.key == "created-by"), "") \
        if inst.metadata else ""
    return short(made) if "/instanceGroupManagers/" in made else ""
