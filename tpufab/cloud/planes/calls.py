"""What the control planes that use google-api-core share: one retry policy (tenacity), and
one sentence a user can act on for every failure (``translate``: exception in, sentence out)."""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from tpufab.config import Settings
from tpufab.errors import ApiError, ConfigError, NotFound, TpufabError

DEFAULT_ENDPOINT = "https://tpu.googleapis.com"

T = TypeVar("T")


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
    if is_connection_error(exc):
        text = _chain_text(exc)
        if _REFUSED_RE.search(text) or _DNS_RE.search(text) or _NOT_HTTP_RE.search(text):
            return False
        return bool(_RESET_RE.search(text)) or is_timeout(exc)
    return False


def _chain_text(exc: BaseException) -> str:
    parts, seen = [], set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        parts.append(f"{type(exc).__name__}: {exc}")
        exc = exc.__cause__ or exc.__context__
    return " | ".join(parts)


def is_connection_error(exc: BaseException) -> bool:
    import requests

    return isinstance(exc, requests.exceptions.ConnectionError | requests.exceptions.Timeout
                      | ConnectionError | TimeoutError)


def is_timeout(exc: BaseException) -> bool:
    import requests

    return isinstance(exc, requests.exceptions.Timeout | TimeoutError)


def unreachable_hint(endpoint: str) -> str:
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
    if is_timeout(exc):
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
    if is_connection_error(exc) and _NOT_HTTP_RE.search(_chain_text(exc)):
        return ApiError(f"The TPU API endpoint {endpoint} answered, but not in HTTP(S) (is it "
                        "another service's port?); set TPUFAB_API_ENDPOINT (api_endpoint) to the "
                        "API's URL, e.g. the one `tpufab sim status` prints for the simulated "
                        "pod.")
    if is_connection_error(exc) and not is_transient(exc):
        return ApiError(f"Cannot reach the TPU API at {endpoint} ({_connection_reason(exc)}); "
                        f"{unreachable_hint(endpoint)}.")
    if is_connection_error(exc):
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


def credentials_error(exc: BaseException) -> TpufabError | None:
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


def exhausted_sentence(err: RetriesExhausted, endpoint: str) -> ApiError:
    last = err.__cause__
    status = status_name(last) if last is not None else "errors"
    if last is not None and is_connection_error(last):
        status = _connection_reason(last)
    return ApiError(
        f"The TPU API at {endpoint} kept failing with {status} ({err.attempts} attempts over "
        f"{err.elapsed:.0f}s); it is overloaded or having an outage, so wait a few minutes and "
        "rerun (TPUFAB_API_RETRIES and TPUFAB_API_RETRY_SECONDS set how long tpufab keeps trying).")
