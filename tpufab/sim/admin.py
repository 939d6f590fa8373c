"""Fault injection and knobs of a running simulated pod (its `/sim/v1/` endpoints).

    admin = SimAdmin.from_info(info)            # or SimAdmin("http://127.0.0.1:8475")
    admin.preempt("my-tpu")                     # PREEMPTED, workers stopped, node kept
    admin.set_reachable("my-tpu", 2, False)     # worker 2 refuses connections
    admin.kill_sshd("my-tpu", 0)                # sshd and its sessions killed, restarts
    admin.fail_next_create("stockout")          # or "quota"; immediate=True -> HTTP 429
    admin.error_burst(3, code=503)              # the next 3 API requests fail
    admin.settings(create_delay=2.0)            # timing knobs; quota_chips=N
    admin.os_login(enabled=True)                # project metadata enable-oslogin=TRUE
    admin.os_login(role="none")                 # your account loses its OS Login roles

    gcs = StorageClient(info.storage_endpoint)  # the pod's Cloud Storage (JSON API)
    gcs.create_bucket("data")                   # idempotent: False if it existed
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any
from urllib.error import HTTPError, URLError
from urllib.request import ProxyHandler, Request, build_opener

from tpufab.errors import SimError
from tpufab.sim._model import DEFAULT_PROJECT, DEFAULT_ZONE
from tpufab.sim.gcs import StorageClient  # noqa: F401  (re-exported: admin's clients in one place)

if TYPE_CHECKING:
    from tpufab.sim.daemon import SimInfo

_DIRECT = build_opener(ProxyHandler({}))


class SimAdmin:
    """Client of one simulated pod's admin API; node arguments are ids or full names."""

    def __init__(self, endpoint: str, *, project: str = DEFAULT_PROJECT,
                 zone: str = DEFAULT_ZONE, timeout: float = 60.0):
        self.endpoint = endpoint.rstrip("/")
        self.project = project
        self.zone = zone
        self.timeout = timeout

    @classmethod
    def from_info(cls, info: SimInfo, **kw: Any) -> SimAdmin:
        kw.setdefault("project", info.project)
        kw.setdefault("zone", info.zone)
        return cls(info.endpoint, **kw)

    def node_name(self, node: str) -> str:
        if node.startswith("projects/"):
            return node
        return f"projects/{self.project}/locations/{self.zone}/nodes/{node}"

    def resolve(self, node: str) -> str:
        """A bare name -> the full name of the record behind it: a TPU API node, else a
        Compute Engine slice (a MIG: ``ceGroups/N``) or VM (``ceInstances/N``)."""
        if node.startswith("projects/"):
            return node
        names = {n["name"] for n in self.state().get("nodes") or []}
        for kind in ("nodes", "ceGroups", "ceInstances"):
            full = f"projects/{self.project}/locations/{self.zone}/{kind}/{node}"
            if full in names:
                return full
        return self.node_name(node)

    # reads

    def health(self) -> dict[str, Any]:
        return self._call("GET", "health")

    def state(self) -> dict[str, Any]:
        """Every node (name, id, state, type, worker addresses) and queued resource."""
        return self._call("GET", "state")

    def node(self, node: str) -> dict[str, Any]:
        """The node as the API shows it, plus each worker's ip, hostname and `running`."""
        return self._call("GET", self.node_name(node))

    # knobs

    def settings(self, **changes: float | int | None) -> dict[str, Any]:
        """Change timing knobs (create_delay, worker_start_delay, operation_delay,
        listen_timeout, quota_chips); returns them all."""
        if not changes:
            return self._call("GET", "settings")
        return self._call("PATCH", "settings", changes)

    # faults

    def preempt(self, node: str, notice: float = 0.0) -> dict[str, Any]:
        """Preempt a node: state PREEMPTED, workers stopped; it stays until deleted.

        ``notice`` > 0: the workers' metadata server says ``instance/preempted: TRUE`` now and
        the preemption follows ``notice`` seconds later (this call returns at once).
        """
        body = {"noticeSeconds": notice} if notice > 0 else None
        return self._call("POST", f"{self.node_name(node)}:preempt", body)

    def end_run(self, node: str) -> dict[str, Any]:
        """End a Compute Engine slice's or VM's run now, as its maxRunDuration would
        (``instanceTerminationAction``: DELETE deletes the VMs, STOP stops them)."""
        return self._call("POST", f"{self.resolve(node)}:endRun")

    def schedule_maintenance(self, node: str, in_seconds: float, *, window: float = 3600.0,
                             clear: bool = False) -> dict[str, Any]:
        """Announce a maintenance window in the node's ``upcomingMaintenance`` (API v2alpha1):
        starting ``in_seconds`` from now, ``window`` seconds long; ``clear`` takes it back."""
        body = {"clear": True} if clear else {"inSeconds": in_seconds, "windowSeconds": window}
        return self._call("POST", f"{self.node_name(node)}:scheduleMaintenance", body)

    def set_reachable(self, node: str, worker: int, reachable: bool) -> dict[str, Any]:
        """Make a worker refuse connections (False) or listen again (True)."""
        return self._call("POST", f"{self.node_name(node)}:setReachable",
                          {"worker": worker, "reachable": reachable})

    def set_slow(self, node: str, worker: int, share: float) -> dict[str, Any]:
        """Stop a worker's processes for ``share`` of every short period (0: no more)."""
        return self._call("POST", f"{self.node_name(node)}:setSlow",
                          {"worker": worker, "share": share})

    def kill_sshd(self, node: str, worker: int) -> dict[str, Any]:
        """SIGKILL a worker's sshd and its sessions; the worker starts a new listener."""
        return self._call("POST", f"{self.node_name(node)}:killSshd", {"worker": worker})

    def fail_next_create(self, reason: str = "stockout", *, count: int = 1,
                         immediate: bool = False, zone: str | None = None,
                         vms: int = 0) -> dict[str, Any]:
        """The next `count` creates (in ``zone``, or anywhere) fail with RESOURCE_EXHAUSTED: a
        stockout or a quota message; as a failed operation (code 8), or with immediate=True
        as HTTP 429. ``vms`` > 0 (Compute Engine): the next ``count`` multi-host MIGs each
        get all but ``vms`` VMs; those stay missing with a stockout, as the MIG retries."""
        return self._call("POST", "faults:failNextCreate",
                          {"reason": reason, "count": count, "immediate": immediate,
                           "zone": zone, "vms": vms})

    def error_burst(self, count: int, *, code: int = 503, match: str = "") -> dict[str, Any]:
        """The next `count` API requests (whose path contains `match`) fail with 503 or 429."""
        return self._call("POST", "faults:errorBurst",
                          {"count": count, "code": code, "match": match})

    def registry(self, **changes: Any) -> dict[str, Any]:
        """The pod's registry (``address``, ``failAuth``, ``failTimes``, ``slowSeconds``,
        ``refused`` per host, ``pushTokenFile``); ``changes`` (failAuth=0.25, failTimes=2,
        slowSeconds=1.0) set its faults first."""
        return self._call("POST" if changes else "GET", "registry", changes or None)

    def clear_faults(self) -> None:
        self._call("DELETE", "faults")

    def deny_permission(self, permission: str, *, allow: bool = False) -> list[str]:
        """Cloud Resource Manager's projects:testIamPermissions answers ``permission`` as not
        granted (``allow``: granted again); clear_faults grants every one again."""
        return self._call("POST", "iam:denyPermission",
                          {"permission": permission, "allow": allow})["deniedPermissions"]

    # OS Login (tpufab.sim.oslogin)

    _UNCHANGED: Any = object()

    def os_login(self, *, enabled: Any = _UNCHANGED, role: str | None = None,
                 account: str | None = None, project: str | None = None) -> dict[str, Any]:
        """The project's OS Login settings; ``enabled`` sets project metadata enable-oslogin
        (True, False, or None to remove it), ``role`` gives ``account`` (default: the
        simulated pod's) admin, login or none (importSshPublicKey then answers 403)."""
        body: dict[str, Any] = {"project": project or self.project}
        if enabled is not self._UNCHANGED:
            body["enabled"] = enabled
        if role is not None:
            body.update(role=role, account=account)
        if len(body) == 1:
            return self._call("GET", f"osLogin?project={body['project']}")
        return self._call("PATCH", "osLogin", body)

    # transport

    def _call(self, method: str, path: str, body: dict[str, Any] | None = None
              ) -> dict[str, Any]:
        url = f"{self.endpoint}/sim/v1/{path}"
        data = json.dumps(body).encode() if body is not None else None
        request = Request(url, data=data, method=method,
                          headers={"Content-Type": "application/json"})
        try:
            with _DIRECT.open(request, timeout=self.timeout) as resp:
                return json.loads(resp.read() or b"{}")
        except HTTPError as err:
            try:
                message = json.loads(err.read())["error"]["message"]
            except (ValueError, KeyError, TypeError):
                message = f"HTTP {err.code}"
            raise SimError(f"The simulated pod refused {method} /sim/v1/{path}: {message}") \
                from None
        except (URLError, OSError) as err:
            raise SimError(f"The simulated pod at {self.endpoint} does not answer ({err}); "
                           "start it with `tpufab sim up`.") from None
