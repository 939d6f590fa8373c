"""Cloud Storage through its JSON API, for tpufab's own records (the supervisor's bucket).

A small client on urllib (no google-cloud-storage): buckets (get; create with uniform
bucket-level access and public access prevention enforced; testIamPermissions), objects
(read with their generation, list by prefix, write and delete with generation
preconditions, custom metadata) and a log kept as numbered chunk objects (:class:`Appender`,
:func:`chunks`).

    store = Storage.from_settings(settings)   # storage_endpoint, else storage.googleapis.com
    blob = store.put("b", "a.json", b"{}", if_generation_match=0)   # only if it does not exist
    data, blob = store.read("b", "a.json")                           # the bytes and generation
    store.put("b", "a.json", b"[]", if_generation_match=blob.generation)   # else 412

A 412 (or 304 for a read) raises :class:`PreconditionFailed`, a 404 :class:`StorageNotFound`;
refusals (403), quotas and outages are one sentence each (:class:`StorageError`). Calls are
retried on 429, 5xx and dropped connections (tenacity, bounded by api_retries and
api_retry_seconds) when they are safe to repeat: reads, and writes or deletes that carry a
generation precondition (an unconditional write is tried once, as Google's own clients do).
A retried conditional write whose first try landed answers 412 to its retry: the callers
(tpufab.flows.supervisor) tell that from another writer by what they wrote.

Credentials: anonymous for a plain-http endpoint (the simulated pod's), else Application
Default Credentials (on a VM, the metadata server's token), as tpufab.cloud.oslogin reads them.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qsl, quote, urlencode, urlsplit

from tpufab.errors import ApiError, NotFound

if TYPE_CHECKING:
    from tpufab.cloud.planes.calls import RetryPolicy
    from tpufab.config import Settings

GOOGLE_STORAGE = "https://storage.googleapis.com"
TRANSIENT = frozenset({408, 429, 500, 502, 503, 504})
CHUNK_DIGITS = 8
CHUNK_SUFFIX = ".log"
# What to grant for each kind of call, in the refusal's sentence.
ROLES = {"read": "roles/storage.objectViewer", "list": "roles/storage.objectViewer",
         "write": "roles/storage.objectUser", "delete": "roles/storage.objectUser",
         "bucket": "roles/storage.admin"}
_BUCKET_NAME = re.compile(r"^[a-z0-9][a-z0-9._-]{1,61}[a-z0-9]$")


class StorageError(ApiError):
    """Cloud Storage refused or failed a call (the sentence says which and what to do)."""


class StorageNotFound(NotFound, StorageError):
    """The bucket or object does not exist."""


class PreconditionFailed(StorageError):
    """412 (304 for a read): the object was not at the generation the call named."""


@dataclass(frozen=True)
class Blob:
    """One object's metadata: what a generation precondition names."""

    bucket: str
    name: str
    generation: int
    metageneration: int = 1
    size: int = 0
    updated: str = ""
    content_type: str | None = None
    metadata: tuple[tuple[str, str], ...] = ()

    @classmethod
    def from_api(cls, item: dict) -> Blob:
        return cls(bucket=item.get("bucket", ""), name=item["name"],
                   generation=int(item.get("generation") or 0),
                   metageneration=int(item.get("metageneration") or 1),
                   size=int(item.get("size") or 0), updated=item.get("updated", ""),
                   content_type=item.get("contentType"),
                   metadata=tuple(sorted((item.get("metadata") or {}).items())))

    @property
    def url(self) -> str:
        return f"gs://{self.bucket}/{self.name}"


@dataclass(frozen=True)
class Listing:
    blobs: list[Blob]
    prefixes: list[str]


def check_bucket_name(name: str, source: str = "supervisor_bucket") -> str:
    """A bucket name as Cloud Storage takes it (3-63 lower-case letters, digits, -, _ and .),
    else a ConfigError naming ``source``."""
    from tpufab.errors import ConfigError, shown

    if not _BUCKET_NAME.match(name) or ".." in name:
        raise ConfigError(f"{source}: {shown(name)} is not a Cloud Storage bucket name (3-63 "
                          "lower-case letters, digits, dashes, underscores and dots, starting "
                          "and ending with a letter or digit).")
    return name


def _conditions(if_generation_match: int | None, if_generation_not_match: int | None,
                if_metageneration_match: int | None,
                if_metageneration_not_match: int | None) -> dict[str, str]:
    named = {"ifGenerationMatch": if_generation_match,
             "ifGenerationNotMatch": if_generation_not_match,
             "ifMetagenerationMatch": if_metageneration_match,
             "ifMetagenerationNotMatch": if_metageneration_not_match}
    return {k: str(int(v)) for k, v in named.items() if v is not None}


class _Answer(Exception):
    """An HTTP status the retry policy looks at (raised inside the retried call)."""

    def __init__(self, status: int, body: bytes, headers: Any = None, url: str = ""):
        super().__init__(status)
        self.status = status
        self.body = body
        self.headers = headers
        self.url = url


class Storage:
    """The Cloud Storage JSON API at ``endpoint``. ``credentials``, ``opener`` and ``sleep``
    are test seams."""

    def __init__(self, endpoint: str | None = None, *, timeout: float = 60.0,
                 policy: RetryPolicy | None = None, credentials: Any = None,
                 opener: Any = None, sleep: Callable[[float], None] = time.sleep):
        from tpufab.cloud.planes.calls import RetryPolicy

        self.endpoint = (endpoint or GOOGLE_STORAGE).rstrip("/")
        self.timeout = timeout
        self.policy = policy or RetryPolicy()
        self._credentials = credentials
        self._opener = opener
        self._sleep = sleep

    @classmethod
    def from_settings(cls, settings: Settings) -> Storage:
        from tpufab.cloud.planes.calls import RetryPolicy

        return cls(settings.storage_endpoint, timeout=settings.api_timeout,
                   policy=RetryPolicy.from_settings(settings))

    # -- buckets

    def bucket(self, name: str) -> dict | None:
        """The bucket's resource, or None when it does not exist."""
        try:
            return self._json("GET", f"/storage/v1/b/{_seg(name)}", what=("look up", name),
                              role="read")
        except StorageNotFound:
            return None

    def create_bucket(self, name: str, *, project: str, location: str | None = None,
                      labels: dict[str, str] | None = None) -> dict:
        """Create ``name`` with uniform bucket-level access and public access prevention
        enforced, soft delete off (the records are rewritten often; a deleted one is not
        wanted back). A bucket of that name already there raises StorageError saying whose."""
        body: dict[str, Any] = {
            "name": name,
            "iamConfiguration": {"uniformBucketLevelAccess": {"enabled": True},
                                 "publicAccessPrevention": "enforced"},
            "softDeletePolicy": {"retentionDurationSeconds": "0"},
            "labels": dict(labels or {}),
        }
        if location:
            body["location"] = location
        try:
            return self._json("POST", "/storage/v1/b", query={"project": project},
                              body=json.dumps(body).encode(), what=("create", name),
                              role="bucket", retry=True, conflict=True)
        except _Conflict:
            if self.bucket(name) is not None:
                raise StorageError(f"Bucket gs://{name} already exists; use it as it is, or "
                                   "set supervisor_bucket to another name.") from None
            raise StorageError(f"The bucket name {name} is taken by another project; set "
                               "supervisor_bucket (TPUFAB_SUPERVISOR_BUCKET) to a name of "
                               "your own.") from None

    def ensure_bucket(self, name: str, *, project: str, location: str | None = None,
                      labels: dict[str, str] | None = None) -> tuple[dict, bool]:
        """The bucket, created as :meth:`create_bucket` does if missing; (resource, created)."""
        found = self.bucket(name)
        if found is not None:
            return found, False
        try:
            return self.create_bucket(name, project=project, location=location,
                                      labels=labels), True
        except StorageError as refused:
            try:
                found = self.bucket(name)     # made meanwhile (another tpufab): ours to use
            except StorageError:
                found = None
            if found is None:
                raise refused from None
            return found, False

    def test_permissions(self, bucket: str, permissions: Sequence[str]) -> set[str]:
        """Which of ``permissions`` the caller has on ``bucket`` (testIamPermissions)."""
        query = [("permissions", p) for p in permissions]
        answer = self._json("GET", f"/storage/v1/b/{_seg(bucket)}/iam/testPermissions",
                            query=query, what=("test permissions on", bucket), role="read")
        return set(answer.get("permissions") or ())

    # -- objects

    def stat(self, bucket: str, name: str) -> Blob | None:
        """The object's metadata, or None when it does not exist."""
        try:
            return Blob.from_api(self._json("GET", f"/storage/v1/b/{_seg(bucket)}/o/{_seg(name)}",
                                            what=("read", bucket, name), role="read"))
        except StorageNotFound:
            return None

    def read(self, bucket: str, name: str, *, if_generation_match: int | None = None,
             if_generation_not_match: int | None = None) -> tuple[bytes, Blob]:
        """The object's bytes and the generation they are (StorageNotFound if missing)."""
        query = {"alt": "media", **_conditions(if_generation_match, if_generation_not_match,
                                               None, None)}
        path = f"/storage/v1/b/{_seg(bucket)}/o/{_seg(name)}"
        status, headers, data = self._call("GET", path, query=query,
                                           what=("read", bucket, name), role="read")
        generation = headers.get("x-goog-generation")
        if generation is None:      # an endpoint that does not say: ask, then read that one
            blob = self.stat(bucket, name)
            if blob is None:
                raise StorageNotFound(f"gs://{bucket}/{name} does not exist.")
            return self.read(bucket, name, if_generation_match=blob.generation)
        return data, Blob(bucket=bucket, name=name, generation=int(generation),
                          metageneration=int(headers.get("x-goog-metageneration") or 1),
                          size=len(data), content_type=headers.get("content-type"))

    def read_json(self, bucket: str, name: str) -> tuple[Any, Blob] | None:
        """The object parsed as JSON with its generation, or None when it does not exist; an
        object that is not JSON is a StorageError naming it."""
        try:
            data, blob = self.read(bucket, name)
        except StorageNotFound:
            return None
        try:
            return json.loads(data), blob
        except ValueError:
            raise StorageError(f"gs://{bucket}/{name} is not JSON (it was written by "
                               "something other than tpufab); delete or fix it.") from None

    def put(self, bucket: str, name: str, data: bytes, *,
            content_type: str = "application/octet-stream",
            if_generation_match: int | None = None, if_generation_not_match: int | None = None,
            if_metageneration_match: int | None = None) -> Blob:
        """Write the whole object (a media upload). ``if_generation_match=0``: only if it does
        not exist; ``=G``: only if it is at generation G (else PreconditionFailed)."""
        conditions = _conditions(if_generation_match, if_generation_not_match,
                                 if_metageneration_match, None)
        query = {"uploadType": "media", "name": name, **conditions}
        item = self._json("POST", f"/upload/storage/v1/b/{_seg(bucket)}/o", query=query,
                          body=data, content_type=content_type, what=("write", bucket, name),
                          role="write", retry=bool(conditions))
        return Blob.from_api({"bucket": bucket, **item})

    def put_json(self, bucket: str, name: str, value: Any, **conditions: int | None) -> Blob:
        data = json.dumps(value, indent=1, sort_keys=True).encode() + b"\n"
        return self.put(bucket, name, data, content_type="application/json", **conditions)

    def delete(self, bucket: str, name: str, *, if_generation_match: int | None = None,
               if_metageneration_match: int | None = None) -> bool:
        """Delete the object; False if it was not there."""
        conditions = _conditions(if_generation_match, None, if_metageneration_match, None)
        try:
            self._call("DELETE", f"/storage/v1/b/{_seg(bucket)}/o/{_seg(name)}",
                       query=conditions, what=("delete", bucket, name), role="delete",
                       retry=bool(conditions))
        except StorageNotFound:
            return False
        return True

    def set_metadata(self, bucket: str, name: str, metadata: dict[str, str | None], *,
                     if_generation_match: int | None = None,
                     if_metageneration_match: int | None = None) -> Blob:
        """Custom metadata (a None value removes the key), conditionally."""
        conditions = _conditions(if_generation_match, None, if_metageneration_match, None)
        item = self._json("PATCH", f"/storage/v1/b/{_seg(bucket)}/o/{_seg(name)}",
                          query=conditions, body=json.dumps({"metadata": metadata}).encode(),
                          what=("update", bucket, name), role="write", retry=bool(conditions))
        return Blob.from_api({"bucket": bucket, **item})

    def list(self, bucket: str, prefix: str = "", *, delimiter: str | None = None,
             start_offset: str | None = None, page_size: int = 1000) -> Listing:
        """Every object under ``prefix`` (in name order; with ``delimiter``, the
        "sub-folders" as ``prefixes``), from ``start_offset`` on, every page."""
        blobs: list[Blob] = []
        prefixes: list[str] = []
        token = None
        while True:
            query = {"prefix": prefix, "maxResults": str(page_size)}
            if delimiter:
                query["delimiter"] = delimiter
            if start_offset:
                query["startOffset"] = start_offset
            if token:
                query["pageToken"] = token
            page = self._json("GET", f"/storage/v1/b/{_seg(bucket)}/o", query=query,
                              what=("list", bucket, prefix + "*"), role="list")
            blobs += [Blob.from_api({"bucket": bucket, **item})
                      for item in page.get("items") or ()]
            prefixes += page.get("prefixes") or []
            token = page.get("nextPageToken")
            if not token:
                break
        # an endpoint that ignores startOffset returns the earlier names too
        if start_offset:
            blobs = [b for b in blobs if b.name >= start_offset]
        return Listing(sorted(blobs, key=lambda b: b.name), sorted(set(prefixes)))

    # -- the HTTP call

    def _json(self, method: str, path: str, **kwargs: Any) -> dict:
        _, _, data = self._call(method, path, **kwargs)
        return json.loads(data) if data.strip() else {}

    def _call(self, method: str, path: str, *, query: Any = None, body: bytes | None = None,
              content_type: str = "application/json", what: tuple[str, ...] = ("call", ""),
              role: str = "read", retry: bool | None = None,
              conflict: bool = False) -> tuple[int, Any, bytes]:
        import tenacity

        url = self.endpoint + path + ("?" + urlencode(query) if query else "")
        retry = method == "GET" if retry is None else retry
        started = time.monotonic()

        def once() -> tuple[int, Any, bytes]:
            return self._send(method, url, body, content_type)

        def transient(exc: BaseException) -> bool:
            if isinstance(exc, _Answer):
                return exc.status in TRANSIENT
            return isinstance(exc, OSError)          # refused, reset, timed out

        try:
            if not retry:
                return once()
            return tenacity.Retrying(
                retry=tenacity.retry_if_exception(transient),
                stop=(tenacity.stop_after_attempt(self.policy.attempts)
                      | tenacity.stop_before_delay(self.policy.total_seconds)),
                wait=tenacity.wait_exponential_jitter(multiplier=self.policy.initial,
                                                      max=self.policy.maximum,
                                                      jitter=self.policy.jitter),
                sleep=self._sleep, reraise=True)(once)
        except _Answer as answer:
            if answer.status == 409 and conflict:
                raise _Conflict() from None
            raise self._refusal(answer, what, role, method, time.monotonic() - started) from None
        except OSError as exc:
            raise StorageError(f"Cloud Storage at {self.endpoint} does not answer ({exc}); "
                               "check storage_endpoint (TPUFAB_STORAGE_ENDPOINT) and your "
                               "network.") from None

    def _send(self, method: str, url: str, body: bytes | None,
              content_type: str) -> tuple[int, Any, bytes]:
        from urllib.error import HTTPError
        from urllib.request import Request

        headers = {"Content-Type": content_type}
        token = self._token()
        if token:
            headers["Authorization"] = f"Bearer {token}"
        request = Request(url, data=body if body is not None else
                          (b"" if method in ("POST", "PUT", "PATCH") else None),
                          method=method, headers=headers)
        try:
            with self._open(request) as resp:
                return resp.status, _Headers(resp.headers), resp.read()
        except HTTPError as err:
            raise _Answer(err.code, err.read(), err.headers, url) from None

    def _open(self, request: Any) -> Any:
        if self._opener is None:
            from urllib.request import ProxyHandler, build_opener

            # a plain-http endpoint is an emulator on this machine: never through a proxy
            self._opener = build_opener(ProxyHandler({})) if self.endpoint.startswith(
                "http://") else build_opener()
        return self._opener.open(request, timeout=self.timeout)

    def _token(self) -> str | None:
        if self.endpoint.startswith("http://"):
            return None
        if self._credentials is None:
            from tpufab.cloud.oslogin import credentials

            try:
                self._credentials = credentials(self.endpoint)
            except Exception as exc:  # noqa: BLE001 - said in one sentence below
                from tpufab.cloud.planes.calls import credentials_error

                translated = credentials_error(exc)
                if translated is not None:
                    raise translated from None
                raise
        creds = self._credentials
        if not getattr(creds, "valid", True) or getattr(creds, "token", None) is None:
            import google.auth.transport.requests

            creds.refresh(google.auth.transport.requests.Request())
        return getattr(creds, "token", None)

    def _refusal(self, answer: _Answer, what: tuple[str, ...], role: str, method: str,
                 elapsed: float) -> StorageError:
        verb, target = what[0], _target(what[1:])
        reason, message = _reason(answer.body)
        detail = f"{answer.status}{' ' + reason if reason else ''}: {message}" if message else \
            str(answer.status)
        if answer.status in (304, 412):
            expected = dict(parse_qsl(urlsplit(answer.url).query)) if answer.url else {}
            if expected.get("ifGenerationMatch") == "0":
                why = "it exists already"
            elif "ifGenerationMatch" in expected:
                why = f"another writer changed it since generation {expected['ifGenerationMatch']}"
            else:
                why = "it is not in the state the call expected"
            return PreconditionFailed(f"{target} was left as it is: {why} ({detail}).")
        if answer.status == 404:
            if len(what) > 2 and verb not in ("list", "write"):
                return StorageNotFound(f"{target} does not exist.")
            return StorageNotFound(f"Bucket gs://{what[1]} does not exist.")
        if reason in ("quotaExceeded", "rateLimitExceeded", "userRateLimitExceeded") or \
                answer.status == 429:
            return StorageError(f"Cloud Storage would not {verb} {target}: over a quota or "
                                f"rate limit ({detail}) for {elapsed:.0f}s of retries; wait a "
                                "few minutes, or ask for more quota.")
        if answer.status in (401, 403):
            return StorageError(f"Cloud Storage refused to {verb} {target} ({detail}); the "
                                f"account needs {ROLES.get(role, ROLES['read'])} on it (or "
                                "on the project).")
        if answer.status in TRANSIENT:
            return StorageError(f"Cloud Storage at {self.endpoint} kept failing to {verb} "
                                f"{target} ({detail}) for {elapsed:.0f}s; it is overloaded or "
                                "having an outage, so try again in a few minutes.")
        return StorageError(f"Cloud Storage would not {verb} {target} ({detail}).")


class _Conflict(Exception):
    pass


class _Headers:
    """Response headers, case-insensitively (as email.message.Message is)."""

    def __init__(self, headers: Any):
        self._headers = headers

    def get(self, key: str, default: Any = None) -> Any:
        value = self._headers.get(key)
        return default if value is None else value


def _seg(name: str) -> str:
    return quote(name, safe="")


def _target(what: Sequence[str]) -> str:
    if len(what) >= 2:
        return f"gs://{what[0]}/{what[1]}"
    return f"bucket gs://{what[0]}" if what and what[0] else "Cloud Storage"


def _reason(body: bytes) -> tuple[str, str]:
    """The first error reason and the message of a JSON API error body."""
    try:
        error = json.loads(body).get("error") or {}
    except (ValueError, AttributeError):
        return "", body.decode("utf-8", "replace").strip()[:200]
    if not isinstance(error, dict):
        return "", str(error)[:200]
    reasons = [e.get("reason", "") for e in error.get("errors") or () if isinstance(e, dict)]
    return (reasons[0] if reasons else ""), str(error.get("message") or "").rstrip(". ")


# -- a log as numbered chunk objects ------------------------------------------------------------


def chunk_name(prefix: str, index: int) -> str:
    return f"{prefix}{index:0{CHUNK_DIGITS}d}{CHUNK_SUFFIX}"


def chunk_index(prefix: str, name: str) -> int | None:
    """The number of chunk ``name`` under ``prefix``, or None for any other object."""
    rest = name[len(prefix):] if name.startswith(prefix) else ""
    digits = rest[:-len(CHUNK_SUFFIX)] if rest.endswith(CHUNK_SUFFIX) else ""
    return int(digits) if digits.isdigit() else None


class Appender:
    """Appends to a log kept as chunk objects ``<prefix>00000000.log``, ``...01.log``: each
    append writes the next one, only if it does not exist yet (``ifGenerationMatch=0``), so
    two writers never interleave silently: the second gets PreconditionFailed. A retried
    append whose first try landed is recognised by its bytes and counts as done."""

    def __init__(self, store: Storage, bucket: str, prefix: str, *, next_index: int | None = None):
        self.store = store
        self.bucket = bucket
        self.prefix = prefix
        self.next_index = next_index

    def append(self, data: bytes) -> Blob | None:
        if not data:
            return None
        if self.next_index is None:
            found = [chunk_index(self.prefix, b.name)
                     for b in self.store.list(self.bucket, self.prefix).blobs]
            self.next_index = max((i for i in found if i is not None), default=-1) + 1
        name = chunk_name(self.prefix, self.next_index)
        try:
            blob = self.store.put(self.bucket, name, data, content_type="text/plain",
                                  if_generation_match=0)
        except PreconditionFailed:
            try:
                there, blob = self.store.read(self.bucket, name)
            except StorageNotFound:
                there = None
            if there != data:
                raise PreconditionFailed(f"Another writer appends to gs://{self.bucket}/"
                                         f"{self.prefix}: chunk {self.next_index} is "
                                         "already there.") from None
        self.next_index += 1
        return blob


def chunks(store: Storage, bucket: str, prefix: str, *,
           after: str | None = None) -> Iterator[tuple[str, bytes]]:
    """(name, bytes) of every chunk under ``prefix`` in order, those after ``after`` only."""
    start = None
    if after is not None:
        index = chunk_index(prefix, after)
        start = chunk_name(prefix, index + 1) if index is not None else after
    for blob in store.list(bucket, prefix, start_offset=start).blobs:
        if chunk_index(prefix, blob.name) is None or (after is not None and blob.name <= after):
            continue
        try:
            data, _ = store.read(bucket, blob.name)
        except StorageNotFound:
            continue                    # deleted meanwhile (the job's records were removed)
        yield blob.name, data
