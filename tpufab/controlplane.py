"""The Cloud TPU API v2 through the official client: one retry policy, one sentence per error.

`google.cloud.tpu_v2` is imported only when a ControlPlane makes its first call, so the CLI
starts fast. A plain `http://` endpoint (the simulated pod, any emulator) gets the REST
transport and anonymous credentials; anything else uses Application Default Credentials.
Request bodies are built by pure functions (`node_body`, `queued_resource_body`) returning
dicts in the API's field names, so they are tested as data.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from tpufab.config import Settings
from tpufab.errors import ApiError, ConfigError, NotFound, TpufabError
from tpufab.nodes import Node, QueuedResourceInfo
from tpufab.sshkeys import SSH_KEYS, merge_entry
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
# The client


class ControlPlane:
    """The TPU API for one project and zone. ``client`` and ``sleep`` are test seams."""

    def __init__(self, settings: Settings, *, client: Any = None, retry: RetryPolicy | None = None,
                 on_retry: Callable[[BaseException, int, float], None] | None = None,
                 sleep: Callable[[float], None] = time.sleep):
        self.settings = settings
        self.project: str = settings.require("project")
        self.zone: str = settings.require("zone")
        self.endpoint = (settings.api_endpoint or DEFAULT_ENDPOINT).rstrip("/")
        self.retry = retry or RetryPolicy.from_settings(settings)
        self.on_retry = on_retry
        self._sleep = sleep
        self._client = client

    # -- plumbing

    @property
    def parent(self) -> str:
        return f"projects/{self.project}/locations/{self.zone}"

    def node_path(self, name: str) -> str:
        return f"{self.parent}/nodes/{name}"

    def queued_resource_path(self, name: str) -> str:
        return f"{self.parent}/queuedResources/{name}"

    @property
    def client(self) -> Any:
        if self._client is None:
            self._client = self._make_client()
        return self._client

    def _make_client(self) -> Any:
        from google.api_core.client_options import ClientOptions
        from google.cloud import tpu_v2

        options = ClientOptions(api_endpoint=self.endpoint)
        try:
            if self.endpoint.startswith("http://"):
                from google.auth.credentials import AnonymousCredentials

                return tpu_v2.TpuClient(transport="rest", credentials=AnonymousCredentials(),
                                        client_options=options)
            return tpu_v2.TpuClient(transport="rest", client_options=options)
        except Exception as exc:
            translated = _credentials_error(exc)
            if translated is not None:
                raise translated from exc
            raise

    def _action(self, verb: str, kind: str = "node", name: str | None = None,
                accelerator_type: str | None = None) -> Action:
        plural = {"node": "nodes", "queued resource": "queuedResources"}[kind]
        permission = f"tpu.{plural}.{verb}"
        target = f"{'TPU ' if kind == 'node' else ''}{kind} {name!r}" if name else (
            f"TPU {plural}" if kind == "node" else "queued resources")
        return Action(verb=verb, target=target, permission=permission, name=name, kind=kind,
                      accelerator_type=accelerator_type, zone=self.zone, project=self.project)

    def _call(self, action: Action, fn: Callable[..., T], /, **kwargs: Any) -> T:
        """One API call under the retry policy; every failure leaves as one sentence."""
        def attempt() -> T:
            return fn(**kwargs, retry=None, timeout=self.settings.api_timeout)

        try:
            return call_with_retries(attempt, self.retry, on_retry=self.on_retry,
                                     sleep=self._sleep)
        except RetriesExhausted as err:
            raise _exhausted_sentence(err, self.endpoint) from err.__cause__
        except TpufabError:
            raise
        except Exception as exc:
            translated = _credentials_error(exc) or translate(exc, action, self.endpoint)
            raise translated from exc

    # -- nodes

    def get_node(self, name: str) -> Node:
        proto = self._call(self._action("get", name=name), self.client.get_node,
                           name=self.node_path(name))
        return Node.from_proto(proto)

    def find_node(self, name: str) -> Node | None:
        try:
            return self.get_node(name)
        except NotFound:
            return None

    def list_nodes(self) -> list[Node]:
        def fetch(**kw: Any) -> list:
            return list(self.client.list_nodes(parent=self.parent, **kw))

        return [Node.from_proto(p) for p in self._call(self._action("list"), fetch)]

    def create_node(self, name: str, body: dict) -> str:
        """Start creating node ``name``; returns the long-running operation's name."""
        from google.cloud import tpu_v2

        shape = body.get("accelerator_type") or _config_text(body.get("accelerator_config"))
        op = self._call(self._action("create", name=name, accelerator_type=shape),
                        self.client.create_node, parent=self.parent, node_id=name,
                        node=tpu_v2.Node(body))
        return op.operation.name

    def delete_node(self, name: str) -> str:
        op = self._call(self._action("delete", name=name), self.client.delete_node,
                        name=self.node_path(name))
        return op.operation.name

    def update_metadata(self, name: str, metadata: dict[str, str]) -> str:
        """Replace node ``name``'s metadata (PATCH updateMask=metadata, as gcloud does)."""
        from google.cloud import tpu_v2
        from google.protobuf import field_mask_pb2

        node = tpu_v2.Node(name=self.node_path(name), metadata=metadata)
        op = self._call(self._action("update", name=name), self.client.update_node,
                        node=node, update_mask=field_mask_pb2.FieldMask(paths=["metadata"]))
        return op.operation.name

    def add_ssh_key(self, node: Node, entry: str) -> str | None:
        """Add an `ssh-keys` entry to a node that lacks it; the operation name, or None if present."""
        current = node.metadata.get(SSH_KEYS)
        merged = merge_entry(current, entry)
        if merged == (current or ""):
            return None
        return self.update_metadata(node.name, {**node.metadata, SSH_KEYS: merged})

    def host_keys(self, name: str, workers: list[int] | None = None) -> dict[int, dict[str, str]]:
        """Each worker's SSH host keys from guest attributes: {worker: {"ssh-ed25519": "ssh-ed25519 AAAA..."}}."""
        kwargs: dict[str, Any] = {"name": self.node_path(name), "query_path": ""}
        if workers is not None:
            kwargs["worker_ids"] = [str(w) for w in workers]
        response = self._call(self._action("get", name=name), self.client.get_guest_attributes,
                              request=kwargs)
        indexes = workers if workers is not None else list(range(len(response.guest_attributes)))
        keys: dict[int, dict[str, str]] = {}
        for index, attrs in zip(indexes, response.guest_attributes, strict=False):
            found = {}
            for item in attrs.query_value.items if attrs.query_value else []:
                if item.key.startswith(("ssh-", "ecdsa-")):
                    value = item.value.strip()
                    found[item.key] = value if value.startswith(item.key) else f"{item.key} {value}"
            keys[index] = found
        return keys

    # -- queued resources

    def create_queued_resource(self, name: str, body: dict) -> str:
        from google.cloud import tpu_v2

        spec = body.get("tpu", {}).get("node_spec", [{}])[0]
        op = self._call(
            self._action("create", "queued resource", name,
                         spec.get("node", {}).get("accelerator_type")
                         or _config_text(spec.get("node", {}).get("accelerator_config"))),
            self.client.create_queued_resource, parent=self.parent, queued_resource_id=name,
            queued_resource=tpu_v2.QueuedResource(body))
        return op.operation.name

    def get_queued_resource(self, name: str) -> QueuedResourceInfo:
        proto = self._call(self._action("get", "queued resource", name),
                           self.client.get_queued_resource, name=self.queued_resource_path(name))
        return QueuedResourceInfo.from_proto(proto)

    def find_queued_resource(self, name: str) -> QueuedResourceInfo | None:
        try:
            return self.get_queued_resource(name)
        except NotFound:
            return None

    def list_queued_resources(self) -> list[QueuedResourceInfo]:
        def fetch(**kw: Any) -> list:
            return list(self.client.list_queued_resources(parent=self.parent, **kw))

        protos = self._call(self._action("list", "queued resource"), fetch)
        return [QueuedResourceInfo.from_proto(p) for p in protos]

    def delete_queued_resource(self, name: str, *, force: bool = True) -> str:
        """Delete a queued resource; ``force`` also deletes the nodes it created (as gcloud does)."""
        op = self._call(self._action("delete", "queued resource", name),
                        self.client.delete_queued_resource,
                        request={"name": self.queued_resource_path(name), "force": force})
        return op.operation.name

    # -- operations and catalogue

    def operation_done(self, op_name: str, verb: str = "create", *,
                       kind: str = "node", name: str | None = None,
                       accelerator_type: str | None = None) -> bool:
        """Whether a long-running operation finished; if it failed, its error as a sentence."""
        from google.api_core import exceptions as gexc

        action = self._action(verb, kind, name, accelerator_type)
        op = self._call(action, self.client.get_operation, request={"name": op_name})
        if op.done and op.HasField("error") and op.error.code:
            raise translate(gexc.from_grpc_status(op.error.code, op.error.message),
                            action, self.endpoint)
        return bool(op.done)

    def zones(self) -> list[str]:
        """Every zone of the project where the TPU API answers."""
        def fetch(**kw: Any) -> list:
            response = self.client.list_locations(request={"name": f"projects/{self.project}"},
                                                  **kw)
            return list(response.locations)

        locations = self._call(Action("list", "locations", "tpu.locations.list",
                                      zone=self.zone, project=self.project), fetch)
        return sorted({loc.location_id or loc.name.rsplit("/", 1)[-1] for loc in locations})

    def accelerator_types(self) -> list[str]:
        def fetch(**kw: Any) -> list:
            return list(self.client.list_accelerator_types(parent=self.parent, **kw))

        types = self._call(Action("list", "accelerator types", "tpu.acceleratorTypes.list",
                                  zone=self.zone, project=self.project), fetch)
        return sorted({t.type_ for t in types})
