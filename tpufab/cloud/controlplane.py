"""The control plane seam: the ``ControlPlane`` interface (create, delete, get, list, wait,
metadata, queued capacity) that lifecycle and everything above it talk to, with what its
implementations share: one retry policy, one sentence per error, and the request bodies.

Its first implementation is ``tpufab.cloud.tpu_api.TpuApi`` (the Cloud TPU API v2 through
``google-cloud-tpu``, imported only on its first call so the CLI starts fast);
``tpufab.cloud.lifecycle.control_plane(settings)`` makes the one a pod needs. Request bodies
are built by pure functions (`node_body`, `queued_resource_body`) returning dicts in the TPU
API's field names, so they are tested as data; an implementation for another API translates
them.
"""

from __future__ import annotations

import re
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from tpufab.cloud.nodes import Node, QueuedResourceInfo, UpcomingMaintenance
from tpufab.config import Settings
from tpufab.errors import ApiError, ConfigError, NotFound, TpufabError
from tpufab.ssh.keys import SSH_KEYS, merge_entry
from tpufab.topology import accelerator_config, parse_accelerator_type

DEFAULT_ENDPOINT = "https://tpu.googleapis.com"
CLOUD_PLATFORM_SCOPE = "https://www.googleapis.com/auth/cloud-platform"

T = TypeVar("T")


# ---------------------------------------------------------------------------------------------
# Request bodies (pure)


def scheduling_tier(settings: Settings) -> str:
    """"spot", "preemptible", "reserved" or "on-demand"; a clear error if several are asked."""
    chosen = [t for t in ("spot", "preemptible", "reserved") if getattr(settings, t)]
    if len(chosen) > 1:
        flags = " and ".join(f"--{t}" for t in chosen)
        raise ConfigError(f"{flags} cannot be combined; pick one way to pay for the TPU.")
    return chosen[0] if chosen else "on-demand"


def node_body(settings: Settings, *, ssh_entry: str | None = None,
              chip_topology: str | None = None) -> dict:
    """The `Node` to create for ``settings`` (accelerator type, runtime, tier, network, keys).

    With ``chip_topology`` (``--topology 4x4x4``) the node asks for ``acceleratorConfig``
    (generation + shape) instead of ``acceleratorType``, as gcloud's --type/--topology do.
    """
    topology = parse_accelerator_type(settings.require("type", "--type"))
    tier = scheduling_tier(settings)
    metadata = dict(settings.metadata)
    if ssh_entry:
        metadata[SSH_KEYS] = merge_entry(metadata.get(SSH_KEYS), ssh_entry)
    network: dict[str, Any] = {"enable_external_ips": not settings.internal_ip}
    if settings.network:
        network["network"] = settings.network
    if settings.subnetwork:
        network["subnetwork"] = settings.subnetwork
    body: dict[str, Any] = {
        "accelerator_type": topology.name,
        "runtime_version": settings.runtime_version or topology.default_runtime,
        "network_config": network,
        "labels": dict(settings.labels),
        "metadata": metadata,
    }
    if chip_topology:
        del body["accelerator_type"]
        config = accelerator_config(topology.name, chip_topology)
        # proto-plus spells the field type_ (type is a Python builtin)
        body["accelerator_config"] = {"type_": config["type"], "topology": config["topology"]}
    if tier != "on-demand":
        body["scheduling_config"] = {tier: True}
    if settings.service_account:
        body["service_account"] = {"email": settings.service_account,
                                   "scope": [CLOUD_PLATFORM_SCOPE]}
    return body


def reservation_path(settings: Settings, reservation: str) -> str:
    """``NAME`` -> ``projects/P/locations/Z/reservations/NAME``; a full path stays as it is."""
    if reservation.startswith("projects/"):
        return reservation
    if not reservation or "/" in reservation:
        raise ConfigError(f"--reservation takes a reservation name or its full path "
                          f"(projects/P/locations/Z/reservations/NAME), not {reservation!r}.")
    return f"projects/{settings.project}/locations/{settings.zone}/reservations/{reservation}"


def queued_resource_body(settings: Settings, *, num_slices: int = 1,
                         ssh_entry: str | None = None, reservation: str | None = None,
                         chip_topology: str | None = None) -> dict:
    """The `QueuedResource` asking for ``num_slices`` nodes named after settings.name.

    Spot requests use the spot tier; everything else the guaranteed tier (reserved capacity
    is asked for on the node). Several slices become `multisliceParams`, which names the
    nodes `NAME-0 .. NAME-(n-1)`. ``reservation`` consumes that named reservation
    (`reservationName`, the nodes scheduled as reserved).
    """
    name = settings.require("name")
    if num_slices < 1:
        raise ConfigError(f"--num-slices must be 1 or more, not {num_slices}.")
    tier = scheduling_tier(settings)
    if tier == "preemptible":
        raise ConfigError("Queued resources cannot be preemptible; use --spot instead.")
    if reservation and tier == "spot":
        raise ConfigError("--reservation and --spot cannot be combined: a reservation is "
                          "capacity you already hold; drop one of them.")
    if reservation:
        tier = "reserved"
    node = node_body(settings, ssh_entry=ssh_entry, chip_topology=chip_topology)
    node.pop("scheduling_config", None)
    if tier == "reserved":
        node["scheduling_config"] = {"reserved": True}
    spec: dict[str, Any] = {"parent": f"projects/{settings.project}/locations/{settings.zone}",
                            "node": node}
    if num_slices > 1:
        spec["multislice_params"] = {"node_count": num_slices, "node_id_prefix": name}
    else:
        spec["node_id"] = name
    body: dict[str, Any] = {"tpu": {"node_spec": [spec]}}
    if tier == "spot":
        body["spot"] = {}
    else:
        body["guaranteed"] = {}
    if reservation:
        body["reservation_name"] = reservation_path(settings, reservation)
    return body


def _config_text(config: dict | None) -> str | None:
    """``{"type": "V4", "topology": "4x4x4"}`` -> "v4 4x4x4" (for error sentences)."""
    if not config:
        return None
    kind = config.get("type_") or config.get("type") or ""
    return f"{str(kind).lower()} {config.get('topology', '')}".strip()


# ---------------------------------------------------------------------------------------------
# Errors (pure: exception in, sentence out)


class AlreadyExists(ApiError):
    """The node or queued resource to create is already there."""


class Stockout(ApiError):
    """No capacity for the accelerator type in the zone right now (worth another zone)."""


class QuotaExceeded(ApiError):
    """The project's quota does not allow it (another try will not help)."""


@dataclass(frozen=True)
class Action:
    """What a call was doing, for the error sentence."""

    verb: str                          # "create", "get", "list", ...
    target: str                        # "TPU node 'x'", "queued resource 'x'", "TPU nodes"
    permission: str                    # the IAM permission the call needs
    name: str | None = None            # the short resource name, if there is one
    kind: str = "node"                 # "node" or "queued resource"
    accelerator_type: str | None = None
    zone: str = ""
    project: str = ""


_RATE_RE = re.compile(r"per.minute|per.second|per.user|per.100|rate.?limit|too many requests|"
                      r"requests per", re.I)
_QUOTA_RE = re.compile(r"quota|limit exceeded|exceeds.*limit", re.I)
_CAPACITY_RE = re.compile(r"capacity|stock.?out|no more|insufficient|not enough|"
                          r"resources? (?:are |is )?(?:not |un)available", re.I)
_REST_PREFIX_RE = re.compile(r"^(?:GET|POST|PATCH|PUT|DELETE) \S+: ")
_REFUSED_RE = re.compile(r"Connection refused|Errno 111|ECONNREFUSED", re.I)
_DNS_RE = re.compile(r"Name or service not known|name resolution|nodename nor servname|"
                     r"getaddrinfo failed|No address associated", re.I)
# The port answered, but not in HTTP (an sshd, a database ...): no retry will change that.
_NOT_HTTP_RE = re.compile(r"BadStatusLine|LineTooLong|UnknownProtocol|WRONG_VERSION_NUMBER|"
                          r"wrong version number", re.I)
_RESET_RE = re.compile(r"Connection reset|Connection aborted|RemoteDisconnected|Broken ?pipe|"
                       r"Errno 104|Errno 32|IncompleteRead|ProtocolError", re.I)


def api_message(exc: BaseException) -> str:
    """The API's own message, without the `METHOD URL:` prefix the REST transport adds."""
    message = getattr(exc, "message", None) or str(exc)
    return _REST_PREFIX_RE.sub("", str(message)).strip()


def exhausted_kind(exc: BaseException) -> str:
    """Tell apart a RESOURCE_EXHAUSTED / 429 answer: "rate" (retry), "quota" or "stockout".

    An HTTP 429 with no word about quota or capacity is rate limiting; a failed operation
    with RESOURCE_EXHAUSTED and no word about quota is a stockout.
    """
    from google.api_core import exceptions as gexc

    message = api_message(exc)
    if _RATE_RE.search(message):
        return "rate"
    if _QUOTA_RE.search(message):
        return "quota"
    if _CAPACITY_RE.search(message):
        return "stockout"
    return "rate" if type(exc) is gexc.TooManyRequests else "stockout"


def is_transient(exc: BaseException) -> bool:
    """Worth retrying: 429 rate limits, 502/503/504, deadline exceeded, dropped connections."""
    from google.api_core import exceptions as gexc

    if isinstance(exc, gexc.ServiceUnavailable | gexc.DeadlineExceeded | gexc.GatewayTimeout
                  | gexc.BadGateway):
        return True
    if isinstance(exc, gexc.TooManyRequests):
        return exhausted_kind(exc) == "rate"
    if _is_connection_error(exc):
        text = _chain_text(exc)
        if _REFUSED_RE.search(text) or _DNS_RE.search(text) or _NOT_HTTP_RE.search(text):
            return False
        return bool(_RESET_RE.search(text)) or _is_timeout(exc)
    return False


def _chain_text(exc: BaseException) -> str:
    parts, seen = [], set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        parts.append(f"{type(exc).__name__}: {exc}")
        exc = exc.__cause__ or exc.__context__
    return " | ".join(parts)


def _is_connection_error(exc: BaseException) -> bool:
    import requests

    return isinstance(exc, requests.exceptions.ConnectionError | requests.exceptions.Timeout
                      | ConnectionError | TimeoutError)


def _is_timeout(exc: BaseException) -> bool:
    import requests

    return isinstance(exc, requests.exceptions.Timeout | TimeoutError)


def _unreachable_hint(endpoint: str) -> str:
    if re.match(r"^http://(127\.|localhost|\[::1\])", endpoint):
        return "is the simulated pod up? run `tpufab sim up`"
    if endpoint.rstrip("/") == DEFAULT_ENDPOINT:
        return "check your network connection"
    return "check TPUFAB_API_ENDPOINT (api_endpoint)"


def _connection_reason(exc: BaseException) -> str:
    text = _chain_text(exc)
    if _REFUSED_RE.search(text):
        return "connection refused"
    if _DNS_RE.search(text):
        return "host name not found"
    if _is_timeout(exc):
        return "timed out"
    if _RESET_RE.search(text):
        return "connection reset"
    return "connection failed"


def status_name(exc: BaseException) -> str:
    code = getattr(exc, "code", None)
    reason = {429: "429 Too Many Requests", 502: "502 Bad Gateway", 503: "503 Service Unavailable",
              504: "504 Gateway Timeout"}.get(int(code) if isinstance(code, int) else 0)
    if reason:
        return reason
    grpc = getattr(exc, "grpc_status_code", None)
    return getattr(grpc, "name", None) or type(exc).__name__


def translate(exc: BaseException, action: Action, endpoint: str) -> TpufabError:
    """One sentence a user can act on, for an exception raised by the TPU API client."""
    from google.api_core import exceptions as gexc

    if isinstance(exc, TpufabError):
        return exc
    where = f"in {action.zone} (project {action.project})" if action.zone else ""
    message = api_message(exc).rstrip(". ")
    if _is_connection_error(exc) and _NOT_HTTP_RE.search(_chain_text(exc)):
        return ApiError(f"The TPU API endpoint {endpoint} answered, but not in HTTP(S) (is it "
                        "another service's port?); set TPUFAB_API_ENDPOINT (api_endpoint) to the "
                        "API's URL, e.g. the one `tpufab sim status` prints for the simulated "
                        "pod.")
    if _is_connection_error(exc) and not is_transient(exc):
        return ApiError(f"Cannot reach the TPU API at {endpoint} ({_connection_reason(exc)}); "
                        f"{_unreachable_hint(endpoint)}.")
    if _is_connection_error(exc):
        return ApiError(f"The TPU API at {endpoint} kept dropping the connection "
                        f"({_connection_reason(exc)}); check your network and try again.")
    if isinstance(exc, gexc.TooManyRequests):
        kind = exhausted_kind(exc)
        shape = action.accelerator_type or "TPU"
        if kind == "quota":
            return QuotaExceeded(
                f"Not enough quota to {action.verb} {action.target} ({shape}) {where}: {message}; "
                "request more TPU quota for this zone in the Cloud console (IAM & Admin > Quotas), "
                "delete unused or preempted nodes, or try --spot or another --zone.")
        if kind == "stockout":
            return Stockout(
                f"No {shape} capacity is available {where} right now (stockout: {message}); "
                "try --spot, --queued to wait in line for capacity, or another --zone.")
        return ApiError(f"The TPU API is rate-limiting requests ({message}); wait a minute and "
                        "try again.")
    if isinstance(exc, gexc.PermissionDenied | gexc.Forbidden):
        if re.search(r"has not been used|is disabled|SERVICE_DISABLED|not been enabled",
                     message, re.I):
            return ApiError(
                f"The Cloud TPU API is not enabled for project {action.project}; run "
                f"`gcloud services enable tpu.googleapis.com --project {action.project}` and retry.")
        return ApiError(
            f"Permission denied to {action.verb} {action.target} {where}: {message}; your "
            f"account needs {action.permission} (e.g. role roles/tpu.admin) and the Cloud TPU API "
            "enabled; log in with `gcloud auth application-default login`.")
    if isinstance(exc, gexc.Unauthenticated | gexc.Unauthorized):
        return ApiError(f"The TPU API did not accept your credentials ({message}); run "
                        "`gcloud auth application-default login`.")
    if isinstance(exc, gexc.NotFound):
        if action.name:
            return NotFound(f"No {action.kind} named {action.name!r} {where}; see `tpufab list` "
                            "(or check --project/--zone).")
        return NotFound(f"The TPU API found nothing at {endpoint} for project {action.project} "
                        f"zone {action.zone} ({message}); check --project and --zone.")
    if isinstance(exc, gexc.AlreadyExists) or type(exc) is gexc.Conflict:  # not ABORTED
        return AlreadyExists(f"A {action.kind} named {action.name!r} already exists {where}; pick "
                        f"another --name or remove it with `tpufab delete --name {action.name}`.")
    if isinstance(exc, gexc.BadRequest):
        return ApiError(f"The TPU API rejected the request to {action.verb} {action.target}: "
                        f"{message}.")
    if is_transient(exc):
        return ApiError(f"The TPU API at {endpoint} is unavailable ({status_name(exc)}: "
                        f"{message}); try again in a few minutes.")
    if isinstance(exc, gexc.GoogleAPICallError):
        return ApiError(f"The TPU API failed to {action.verb} {action.target} "
                        f"({status_name(exc)}: {message}).")
    return ApiError(f"Calling the TPU API to {action.verb} {action.target} failed "
                    f"({type(exc).__name__}: {exc}).")


def _credentials_error(exc: BaseException) -> TpufabError | None:
    try:
        from google.auth import exceptions as auth_exc
    except ImportError:  # pragma: no cover
        return None
    if isinstance(exc, auth_exc.DefaultCredentialsError):
        return ConfigError(
            "No Google Cloud credentials found; run `gcloud auth application-default login`, "
            "or set TPUFAB_API_ENDPOINT to use a simulated pod.")
    if isinstance(exc, auth_exc.RefreshError):
        return ApiError(f"Your Google Cloud credentials could not be refreshed ({exc}); run "
                        "`gcloud auth application-default login`.")
    if isinstance(exc, auth_exc.TransportError):
        return None  # a network failure while refreshing: treated like any connection error
    return None


# ---------------------------------------------------------------------------------------------
# Retries


@dataclass(frozen=True)
class RetryPolicy:
    """Exponential backoff with jitter for transient failures, bounded in attempts and time."""

    attempts: int = 8
    total_seconds: float = 120.0
    initial: float = 0.5
    maximum: float = 16.0
    jitter: float = 0.5

    @classmethod
    def from_settings(cls, settings: Settings) -> RetryPolicy:
        return cls(attempts=max(1, settings.api_retries), total_seconds=settings.api_retry_seconds)


class RetriesExhausted(ApiError):
    """Transient failures went on past the retry policy's bounds."""


def call_with_retries(fn: Callable[[], T], policy: RetryPolicy, *,
                      on_retry: Callable[[BaseException, int, float], None] | None = None,
                      sleep: Callable[[float], None] = time.sleep) -> T:
    """``fn()``, retried on transient failures; after the last attempt raise RetriesExhausted
    (its ``__cause__`` is the last failure, its ``attempts``/``elapsed`` say how long it tried)."""
    import tenacity

    started = time.monotonic()

    def before_sleep(state: tenacity.RetryCallState) -> None:
        if on_retry is not None and state.outcome is not None:
            on_retry(state.outcome.exception(), state.attempt_number,
                     state.next_action.sleep if state.next_action else 0.0)

    retrying = tenacity.Retrying(
        retry=tenacity.retry_if_exception(is_transient),
        stop=(tenacity.stop_after_attempt(policy.attempts)
              | tenacity.stop_before_delay(policy.total_seconds)),
        wait=tenacity.wait_exponential_jitter(multiplier=policy.initial, max=policy.maximum,
                                              jitter=policy.jitter),
        before_sleep=before_sleep,
        sleep=sleep,
        reraise=False,
    )
    try:
        return retrying(fn)
    except tenacity.RetryError as err:
        last = err.last_attempt.exception()
        exhausted = RetriesExhausted("retries exhausted")
        exhausted.attempts = err.last_attempt.attempt_number
        exhausted.elapsed = time.monotonic() - started
        raise exhausted from last


def _exhausted_sentence(err: RetriesExhausted, endpoint: str) -> ApiError:
    last = err.__cause__
    status = status_name(last) if last is not None else "errors"
    if last is not None and _is_connection_error(last):
        status = _connection_reason(last)
    return ApiError(
        f"The TPU API at {endpoint} kept failing with {status} ({err.attempts} attempts over "
        f"{err.elapsed:.0f}s); it is overloaded or having an outage, so wait a few minutes and "
        "rerun (TPUFAB_API_RETRIES and TPUFAB_API_RETRY_SECONDS set how long tpufab keeps trying).")


# ---------------------------------------------------------------------------------------------
# The interface


class ControlPlane(ABC):
    """What tpufab asks of a control plane, for one project and zone: the seam between the
    cloud and everything above it. lifecycle, the Pod API, status, babysit, autostop and gc
    call only these methods, and get one from ``tpufab.cloud.lifecycle.control_plane``.

    Implementations: ``tpufab.cloud.tpu_api.TpuApi`` (the Cloud TPU API v2: TPU VMs and
    queued resources). A second one (Compute Engine, for TPU7x) subclasses this and provides
    every abstract method below with the same meaning, names and records:

    - nodes: ``get_node`` (NotFound when there is none), ``list_nodes``, ``create_node(name,
      body)`` (``body`` in the TPU API's field names, as ``node_body`` builds it: the
      implementation translates it), ``delete_node``, ``update_metadata(name, metadata)``
      (replaces the node's metadata: SSH keys, the autostop cell), ``host_keys(name)``
      (the workers' SSH host keys, {worker: {"ssh-ed25519": ...}});
    - queued (flex) capacity: ``create_queued_resource(name, body)`` (``queued_resource_body``),
      ``get_queued_resource``, ``list_queued_resources``, ``delete_queued_resource(name,
      force=)``; an implementation without queued capacity raises ApiError in one sentence;
    - waiting: the create/delete/update calls return an operation name;
      ``operation_done(op, verb, kind=, name=, accelerator_type=)`` says whether it finished
      and raises its error as one sentence (Stockout, QuotaExceeded, AlreadyExists, ApiError);
      ``list_operations()`` (the recent ones, with the node an update left);
    - catalogue: ``zones()`` (every zone of the project that answers), ``accelerator_types()``.

    Records are ``tpufab.cloud.nodes.Node`` and ``QueuedResourceInfo``; every failure leaves
    as a TpufabError whose message is one sentence with the fix (``translate`` and
    ``call_with_retries`` here are shared by implementations that use google-api-core).
    ``find_node``, ``find_queued_resource`` and ``add_ssh_key`` are built on the above.
    """

    endpoint: str = ""

    def __init__(self, settings: Settings):
        self.settings = settings
        self.project: str = settings.require("project")
        self.zone: str = settings.require("zone")

    # -- nodes
    def upcoming_maintenance(self, name: str) -> UpcomingMaintenance | None:
        """Node ``name``'s announced maintenance window, or None (none announced, or this
        control plane cannot say: the default)."""
        return None

    @abstractmethod
    def get_node(self, name: str) -> Node:
        """Node ``name``; NotFound (an ApiError) when there is none."""

    @abstractmethod
    def list_nodes(self) -> list[Node]:
        """Every node in the zone."""

    @abstractmethod
    def create_node(self, name: str, body: dict) -> str:
        """Start creating node ``name``; returns the long-running operation's name."""

    @abstractmethod
    def delete_node(self, name: str) -> str:
        """Start deleting node ``name``; returns the operation's name."""

    @abstractmethod
    def update_metadata(self, name: str, metadata: dict[str, str]) -> str:
        """Replace node ``name``'s metadata; returns the operation's name."""

    @abstractmethod
    def host_keys(self, name: str, workers: list[int] | None = None) -> dict[int, dict[str, str]]:
        """Each worker's SSH host keys: {worker: {"ssh-ed25519": "ssh-ed25519 AAAA..."}}."""

    def find_node(self, name: str) -> Node | None:
        try:
            return self.get_node(name)
        except NotFound:
            return None

    def add_ssh_key(self, node: Node, entry: str) -> str | None:
        """Add an `ssh-keys` entry to a node that lacks it; the operation name, or None if present."""
        current = node.metadata.get(SSH_KEYS)
        merged = merge_entry(current, entry)
        if merged == (current or ""):
            return None
        return self.update_metadata(node.name, {**node.metadata, SSH_KEYS: merged})

    # -- queued (flex-start, reserved, multislice) capacity
    @abstractmethod
    def create_queued_resource(self, name: str, body: dict) -> str:
        """Ask for queued capacity ``name``; returns the operation's name."""

    @abstractmethod
    def get_queued_resource(self, name: str) -> QueuedResourceInfo:
        """Queued resource ``name``; NotFound when there is none."""

    @abstractmethod
    def list_queued_resources(self) -> list[QueuedResourceInfo]:
        """Every queued resource in the zone."""

    @abstractmethod
    def delete_queued_resource(self, name: str, *, force: bool = True) -> str:
        """Delete a queued resource (``force``: and the nodes it made); the operation's name."""

    def find_queued_resource(self, name: str) -> QueuedResourceInfo | None:
        try:
            return self.get_queued_resource(name)
        except NotFound:
            return None

    # -- operations and catalogue
    @abstractmethod
    def operation_done(self, op_name: str, verb: str = "create", *,
                       kind: str = "node", name: str | None = None,
                       accelerator_type: str | None = None) -> bool:
        """Whether a long-running operation finished; if it failed, its error as a sentence."""

    @abstractmethod
    def list_operations(self) -> list[dict[str, Any]]:
        """The zone's long-running operations the control plane still keeps, newest first:
        each ``{"name", "verb", "target", "created" (unix time), "done", "node"}`` where
        ``node`` is the response of an update or create (a node record), else None (how
        ``lifecycle.vanished_note`` tells that autostop deleted a node)."""

    @abstractmethod
    def zones(self) -> list[str]:
        """Every zone of the project where this control plane answers."""

    @abstractmethod
    def accelerator_types(self) -> list[str]:
        """The accelerator types the zone offers."""


# ---------------------------------------------------------------------------------------------
# Both planes at once


class BothPlanes(ControlPlane):
    """The Cloud TPU API and Compute Engine side by side, for verbs that name a pod without
    saying where it lives: a name is looked up on both (on both: one sentence), a list shows
    both, and each call goes to the plane that holds the node. Compute Engine failures while
    only looking (get/list) are left out when the TPU API answered, so a project without the
    Compute Engine API works exactly as before."""

    def __init__(self, settings: Settings, tpu: ControlPlane, compute: ControlPlane):
        super().__init__(settings)
        self.tpu, self.compute = tpu, compute
        self.endpoint = tpu.endpoint

    def _compute_find(self, name: str) -> Node | None:
        try:
            return self.compute.find_node(name)
        except TpufabError:
            return None

    def find_both(self, name: str) -> tuple[Node | None, Node | None]:
        return self.tpu.find_node(name), self._compute_find(name)

    def _owner(self, name: str) -> ControlPlane:
        tpu, compute = self.find_both(name)
        if tpu is not None and compute is not None:
            raise ConfigError(
                f"{name!r} names both a Cloud TPU API node and a Compute Engine TPU slice in "
                f"{self.zone}; say which with TPUFAB_CONTROL_PLANE=tpu or =compute (or "
                "`control_plane:` in tpufab.yaml, `--on` for create).")
        return self.compute if compute is not None else self.tpu

    def _where(self, name: str) -> ControlPlane:
        """The plane holding ``name``, the Cloud TPU API asked first: the paths every worker
        verb takes never load the Compute Engine client (3 s of CPU to import) for a TPU API
        node. `describe` (get_node), `delete` and `list` ask both."""
        if self.tpu.find_node(name) is not None:
            return self.tpu
        return self.compute if self._compute_find(name) is not None else self.tpu

    def find_node(self, name: str) -> Node | None:
        found = self.tpu.find_node(name)
        return found if found is not None else self._compute_find(name)

    def get_node(self, name: str) -> Node:
        tpu, compute = self.find_both(name)
        if tpu is not None and compute is not None:
            self._owner(name)
        if tpu is not None:
            return tpu
        if compute is not None:
            return compute
        return self.tpu.get_node(name)  # raises the NotFound sentence

    def list_nodes(self) -> list[Node]:
        nodes = self.tpu.list_nodes()
        try:
            nodes += self.compute.list_nodes()
        except TpufabError:
            pass
        return nodes

    def create_node(self, name: str, body: dict) -> str:
        return self.tpu.create_node(name, body)

    def delete_node(self, name: str) -> str:
        plane = self._owner(name)
        op = plane.delete_node(name)
        self.removed = list(getattr(plane, "removed", []))
        self.left_alone = list(getattr(plane, "left_alone", []))
        return op

    def update_metadata(self, name: str, metadata: dict[str, str]) -> str:
        return self._where(name).update_metadata(name, metadata)

    def leftovers(self) -> list[tuple[str, str, str]]:
        try:   # only looking: a project without the Compute Engine API has none
            return self.compute.leftovers()
        except TpufabError:
            return []

    def delete_leftover(self, kind: str, name: str, slice_name: str) -> str | None:
        return self.compute.delete_leftover(kind, name, slice_name)

    def upcoming_maintenance(self, name: str) -> UpcomingMaintenance | None:
        return self._where(name).upcoming_maintenance(name)

    def host_keys(self, name: str, workers: list[int] | None = None) -> dict[int, dict[str, str]]:
        return self._where(name).host_keys(name, workers)

    def create_queued_resource(self, name: str, body: dict) -> str:
        return self.tpu.create_queued_resource(name, body)

    def get_queued_resource(self, name: str) -> QueuedResourceInfo:
        return self.tpu.get_queued_resource(name)

    def list_queued_resources(self) -> list[QueuedResourceInfo]:
        return self.tpu.list_queued_resources()

    def delete_queued_resource(self, name: str, *, force: bool = True) -> str:
        return self.tpu.delete_queued_resource(name, force=force)

    def operation_done(self, op_name: str, verb: str = "create", *,
                       kind: str = "node", name: str | None = None,
                       accelerator_type: str | None = None) -> bool:
        plane = self.tpu if op_name.startswith("projects/") else self.compute
        return plane.operation_done(op_name, verb, kind=kind, name=name,
                                    accelerator_type=accelerator_type)

    def list_operations(self) -> list[dict[str, Any]]:
        return self.tpu.list_operations()

    def zones(self) -> list[str]:
        return self.tpu.zones()

    def accelerator_types(self) -> list[str]:
        return sorted(set(self.tpu.accelerator_types()) | set(self.compute.accelerator_types()))
