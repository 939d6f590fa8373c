"""The simulated pod's Cloud Storage: PyPI ``gcp-storage-emulator`` (the GCS JSON API, media
and multipart uploads included) served on a loopback port, with its state on disk so buckets
survive `tpufab sim down`/`up`, and a deny list of buckets that answer 403 (for tests of
"access denied").

    with StorageEmulator(data_dir=state_dir / "gcs") as gcs:   # data_dir=None: in memory
        gcs.create_bucket("data")      # idempotent; False when it already existed
        gcs.url                        # http://127.0.0.1:PORT (TPUFAB_STORAGE_ENDPOINT)
        gcs.rclone_config              # rclone GCS backend options pointing here
        gcs.objects("data")            # {name: bytes}

The emulator package is imported only when an emulator is built, so importing this module
costs nothing; without the package, building one raises SimError saying how to install it.
"""

from __future__ import annotations

import base64
import io
import json
import re
import threading
from functools import cache, partial
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, quote, unquote, urlparse

from tpufab.errors import SimError
from tpufab.sim.gcs import StorageClient

BUCKET_IN_PATH = re.compile(r"^(?:/upload|/download)?(?:/storage/v1)?/b/([^/?]+)")
PACKAGE = "gcp-storage-emulator"
PRECONDITIONS = ("ifGenerationMatch", "ifGenerationNotMatch", "ifMetagenerationMatch",
                 "ifMetagenerationNotMatch")
NOT_MET = "At least one of the pre-conditions you specified did not hold."
_API = r"(?:/storage/v1)?"
# (method, path pattern, kind): the requests whose object (or bucket) tpufab's layer looks at
# (kind None: passed through as they are)
ROUTES: list[tuple[str, re.Pattern, str | None]] = [
    ("POST", re.compile(rf"^{_API}/b$"), "bucket-create"),
    ("GET", re.compile(rf"^{_API}/b/(?P<b>[^/]+)/iam/testPermissions$"), "permissions"),
    ("GET", re.compile(rf"^{_API}/b/(?P<b>[^/]+)$"), "bucket-get"),
    ("GET", re.compile(rf"^{_API}/b/(?P<b>[^/]+)/o$"), "list"),
    ("POST", re.compile(rf"^{_API}/b/(?P<b>[^/]+)/o/(?P<o>.+)/compose$"), "write"),
    ("POST", re.compile(rf"^{_API}/b/[^/]+/o/.+/(?:copyTo|rewriteTo)/b/(?P<b>[^/]+)/o/(?P<o>.+)$"),
     "write"),
    ("GET", re.compile(rf"^{_API}/b/[^/]+/o/.+/acl$"), None),      # the emulator's own
    ("GET", re.compile(rf"^{_API}/b/(?P<b>[^/]+)/o/(?P<o>.+)$"), "read"),
    ("DELETE", re.compile(rf"^{_API}/b/(?P<b>[^/]+)/o/(?P<o>.+)$"), "delete"),
    ("PATCH", re.compile(rf"^{_API}/b/(?P<b>[^/]+)/o/(?P<o>.+)$"), "update"),
    ("POST", re.compile(r"^/upload/storage/v1/b/(?P<b>[^/]+)/o$"), "write"),
    ("GET", re.compile(r"^/download/storage/v1/b/(?P<b>[^/]+)/o/(?P<o>.+)$"), "read"),
]
# The IAM permission each kind of request needs (an upload over an existing object needs
# storage.objects.delete as well, as on Cloud Storage).
PERMISSION = {"bucket-create": "storage.buckets.create", "bucket-get": "storage.buckets.get",
              "list": "storage.objects.list", "read": "storage.objects.get",
              "write": "storage.objects.create", "delete": "storage.objects.delete",
              "update": "storage.objects.update"}
# Bucket fields a create request may set (the emulator's own insert keeps only the name).
BUCKET_FIELDS = ("iamConfiguration", "labels", "location", "storageClass", "softDeletePolicy",
                 "versioning", "lifecycle")


def route(method: str, path: str) -> tuple[str, str | None, str | None] | None:
    """(kind, bucket, object) of a request, or None for the ones passed through as they are."""
    for verb, pattern, kind in ROUTES:
        if verb == method:
            match = pattern.match(path)
            if match and kind is None:
                return None
            if match:
                found = match.groupdict()
                name = found.get("o")
                return kind, unquote(found["b"]) if "b" in found else None, \
                    unquote(name) if name is not None else None
    return None


def precondition_status(obj: dict | None, query: dict[str, list[str]], kind: str) -> int | None:
    """412 (304 for a read whose *NotMatch* failed) when the request's preconditions do not
    hold for ``obj`` (None: no live object), else None. ifGenerationMatch=0: there must be no
    live object; a NotMatch or metageneration condition fails without one (as on GCS)."""
    named = {k: int(query[k][0]) for k in PRECONDITIONS if k in query}
    if not named:
        return None
    generation = int(obj["generation"]) if obj else None
    meta = int(obj.get("metageneration") or 1) if obj else None
    failed: list[str] = []
    if "ifGenerationMatch" in named:
        want = named["ifGenerationMatch"]
        if (obj is not None) if want == 0 else generation != want:
            failed.append("ifGenerationMatch")
    if "ifGenerationNotMatch" in named and (obj is None or
                                            generation == named["ifGenerationNotMatch"]):
        failed.append("ifGenerationNotMatch")
    if "ifMetagenerationMatch" in named and meta != named["ifMetagenerationMatch"]:
        failed.append("ifMetagenerationMatch")
    if "ifMetagenerationNotMatch" in named and (obj is None or
                                                meta == named["ifMetagenerationNotMatch"]):
        failed.append("ifMetagenerationNotMatch")
    if not failed:
        return None
    if kind == "read" and all(k.endswith("NotMatch") for k in failed):
        return 304
    return 412


def error_body(code: int, reason: str, message: str, **extra: str) -> bytes:
    """An error as the GCS JSON API words it."""
    return json.dumps({"error": {"code": code, "message": message, "errors": [
        {"domain": "global", "reason": reason, "message": message, **extra}]}}).encode()


def listing(storage: Any, bucket: str, query: dict[str, list[str]]) -> dict:
    """objects.list with what the emulator ignores: startOffset, endOffset, maxResults and
    pageToken (items and prefixes in one name order, as GCS pages them)."""
    one = {k: v[0] for k, v in query.items() if v}
    items, prefixes = storage.get_file_list(bucket, one.get("prefix"), one.get("delimiter"),
                                            one.get("matchGlob"))
    start, end = one.get("startOffset"), one.get("endOffset")
    entries = sorted([(item["name"], item) for item in items] +
                     [(p, None) for p in prefixes], key=lambda e: e[0])
    entries = [e for e in entries if (start is None or e[0] >= start)
               and (end is None or e[0] < end)]
    after = one.get("pageToken")
    if after:
        after = base64.urlsafe_b64decode(after.encode()).decode()
        entries = [e for e in entries if e[0] > after]
    size = max(1, min(int(one.get("maxResults") or 1000), 1000))
    page, more = entries[:size], len(entries) > size
    out: dict[str, Any] = {"kind": "storage#objects",
                           "items": [item for _, item in page if item is not None],
                           "prefixes": [name for name, item in page if item is None]}
    if more:
        out["nextPageToken"] = base64.urlsafe_b64encode(page[-1][0].encode()).decode()
    return out


@cache
def _handler_class() -> type:
    """The emulator's request handler, one request at a time, with what tpufab needs in front:
    a deny list (of buckets and of permissions), generation preconditions, testPermissions,
    bucket creation with its settings, paged listings."""
    try:
        from gcp_storage_emulator.handlers import buckets
        from gcp_storage_emulator.server import RequestHandler
    except ImportError:
        raise SimError(f"The simulated pod's Cloud Storage needs the {PACKAGE} package: "
                       f"pip install {PACKAGE} (it comes with tpufab's dev extra).") from None

    class Handler(RequestHandler):
        _extra_headers: dict[str, str] = {}
        _status = 0

        def _dispatch(self, verb: str) -> None:
            parts = urlparse(self.path)
            match = BUCKET_IN_PATH.match(parts.path)
            if match and match.group(1) in self.server.denied:
                self._answer(403, error_body(403, "forbidden", "Access denied."))
                return
            body = self._body()
            query = parse_qs(parts.query)
            found = route(verb, parts.path)
            with self.server.lock:  # the emulator's storage is not thread-safe; the checks
                # and the write they guard are one step
                if found is not None and self._intercepted(found, query, body):
                    return
                socket_file, self.rfile = self.rfile, io.BytesIO(body)
                try:
                    getattr(super(), f"do_{verb}")()
                finally:
                    self.rfile = socket_file

        def _intercepted(self, found: tuple[str, str | None, str | None],
                         query: dict[str, list[str]], body: bytes) -> bool:
            """Answer here (True) what the emulator would get wrong; else let it (False)."""
            kind, bucket, name = found
            storage = self.server.storage
            if kind == "bucket-create":
                try:
                    spec = json.loads(body or b"{}")
                except ValueError:
                    spec = {}
                bucket = spec.get("name") if isinstance(spec, dict) else None
                if not bucket:
                    return False
            if kind == "write" and name is None:          # an upload names it in its query
                name = query.get("name", [None])[0] or _upload_name(body, self.headers)
            obj = None
            if bucket is not None and name is not None:
                obj = storage.objects.get(bucket, {}).get(name)
            denied = self.server.denied_permissions
            wanted = [PERMISSION[kind]] if kind in PERMISSION else []
            if kind == "write" and obj is not None:
                wanted.append("storage.objects.delete")
            for permission in wanted:
                if (bucket, permission) in denied or ("*", permission) in denied:
                    self._answer(403, error_body(
                        403, "forbidden", f"tpufab-sim@example.com does not have {permission} "
                        "access to the Google Cloud Storage "
                        f"{'bucket' if kind.startswith('bucket') else 'object'}. Permission "
                        f"'{permission}' denied on resource (or it may not exist)."))
                    return True
            try:
                status = precondition_status(obj, query, kind) if name is not None else None
            except ValueError:
                self._answer(400, error_body(400, "invalid", "Invalid argument."))
                return True
            if status == 412:
                self._answer(412, error_body(412, "conditionNotMet", NOT_MET,
                                             locationType="header", location="If-Match"))
                return True
            if status == 304:
                self._answer(304, b"")
                return True
            if kind in ("read", "delete", "update") and obj is None and name is not None:
                what = f"No such object: {bucket}/{name}" if bucket in storage.buckets else \
                    "The specified bucket does not exist."
                self._answer(404, error_body(404, "notFound", what))
                return True
            if kind == "permissions":
                if bucket not in storage.buckets:
                    return False                    # the emulator's 404
                granted = [p for p in query.get("permissions", [])
                           if (bucket, p) not in denied and ("*", p) not in denied]
                self._json({"kind": "storage#testIamPermissionsResponse",
                            "permissions": granted})
                return True
            if kind == "list":
                if bucket not in storage.buckets:
                    return False
                self._json(listing(storage, bucket, query))
                return True
            if kind == "bucket-create":
                made = buckets.create_bucket(bucket, storage)
                if not made:
                    self._answer(409, error_body(409, "conflict", "You already own this "
                                                 "bucket. Please select another name."))
                    return True
                for key in BUCKET_FIELDS:
                    if spec.get(key) is not None:
                        made[key] = spec[key]
                uniform = (made.get("iamConfiguration") or {}).get(
                    "uniformBucketLevelAccess")
                if uniform is not None:      # the old name of the same switch, as GCS shows it
                    made["iamConfiguration"]["bucketPolicyOnly"] = dict(uniform)
                storage.create_bucket(bucket, made)
                self._json(made)
                return True
            if kind == "write" and query.get("uploadType") == ["media"] and name:
                if bucket not in storage.buckets:
                    return False                    # the emulator's 404
                # the emulator parses a media upload of JSON as JSON and fails on it: stored here
                made = object_resource(self.server.server_address, bucket, name, body,
                                       self.headers.get("Content-Type"), obj)
                storage.create_file(bucket, name, body, made)
                self._json(made)
                return True
            if kind == "read" and obj is not None and (
                    "media" in query.get("alt", []) or self.path.startswith("/download/")):
                self._extra_headers = {"x-goog-generation": str(obj["generation"]),
                                       "x-goog-metageneration": str(obj.get("metageneration")
                                                                    or 1)}
            return False

        def _body(self) -> bytes:
            """The request body, read before the lock is taken (a slow client holds nothing)."""
            length = self.headers.get("Content-Length")
            if length:
                return self.rfile.read(int(length))
            if (self.headers.get("Transfer-Encoding") or "").lower() != "chunked":
                return b""
            data = b""
            while True:
                size = int(self.rfile.readline().strip() or b"0", 16)
                if size == 0:
                    self.rfile.readline()
                    break
                data += self.rfile.read(size)
                self.rfile.readline()
            del self.headers["Transfer-Encoding"]
            self.headers["Content-Length"] = str(len(data))
            return data

        def _answer(self, code: int, body: bytes, content_type: str = "application/json") -> None:
            self.send_response(code)
            if body:
                self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _json(self, value: Any) -> None:
            self._answer(200, json.dumps(value).encode())

        def send_response(self, code, message=None):
            self._status = code
            super().send_response(code, message)

        def end_headers(self):
            if self._extra_headers and self._status in (200, 206):
                for key, value in self._extra_headers.items():
                    self.send_header(key, value)
            self._extra_headers = {}
            super().end_headers()

        def do_GET(self):
            self._dispatch("GET")

        def do_POST(self):
            self._dispatch("POST")

        def do_PUT(self):
            self._dispatch("PUT")

        def do_PATCH(self):
            self._dispatch("PATCH")

        def do_DELETE(self):
            self._dispatch("DELETE")

        def log_message(self, format, *args):  # one line per object request is too many
            pass

    return Handler


def object_resource(address: tuple, bucket: str, name: str, data: bytes,
                    content_type: str | None, previous: dict | None) -> dict:
    """An object's resource as GCS answers an upload: a new generation (above the one it
    replaces), metageneration 1, size, hashes."""
    import hashlib
    import time
    from datetime import datetime, timezone

    import google_crc32c

    generation = time.time_ns()
    if previous is not None:
        generation = max(generation, int(previous["generation"]) + 1)
    now = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    md5 = base64.b64encode(hashlib.md5(data).digest()).decode()
    host, port = address[:2]
    return {"kind": "storage#object", "id": f"{bucket}/{name}/{generation}",
            "selfLink": f"/storage/v1/b/{bucket}/o/{quote(name, safe='')}", "name": name,
            "bucket": bucket, "generation": str(generation), "metageneration": "1",
            "contentType": content_type or "application/octet-stream", "timeCreated": now,
            "updated": now, "storageClass": "STANDARD", "timeStorageClassUpdated": now,
            "size": str(len(data)), "md5Hash": md5, "etag": md5,
            "crc32c": base64.b64encode(google_crc32c.Checksum(data).digest()).decode(),
            "mediaLink": f"http://{host}:{port}/download/storage/v1/b/{bucket}/o/"
                         f"{quote(name, safe='')}?generation={generation}&alt=media",
            "acl": []}


def _upload_name(body: bytes, headers: Any) -> str | None:
    """The object name a multipart or resumable upload's metadata gives."""
    content_type = headers.get("Content-Type") or ""
    try:
        if content_type.startswith("multipart/"):
            from email.parser import BytesParser

            message = BytesParser().parsebytes(
                b"Content-Type: " + content_type.encode() + b"\r\n\r\n" + body)
            meta = json.loads(message.get_payload()[0].get_payload())
        elif content_type.startswith("application/json") and body:
            meta = json.loads(body)
        else:
            return None
    except (ValueError, IndexError, AttributeError, TypeError):
        return None
    return meta.get("name") if isinstance(meta, dict) else None


class StorageEmulator:
    """A GCS JSON API on ``host:port`` (0: a free port); state in ``data_dir`` or in memory."""

    def __init__(self, data_dir: Path | str | None = None, *, host: str = "127.0.0.1",
                 port: int = 0):
        from http.server import ThreadingHTTPServer

        handler = _handler_class()
        from gcp_storage_emulator.storage import Storage

        if data_dir is None:
            self.storage = Storage(use_memory_fs=True)
        else:
            data_dir = Path(data_dir).resolve()
            data_dir.mkdir(parents=True, exist_ok=True)
            self.storage = Storage(data_dir=str(data_dir))
        self.data_dir = data_dir
        self.httpd = ThreadingHTTPServer((host, port), partial(handler, self.storage))
        self.httpd.daemon_threads = True
        self.httpd.denied = set()
        self.httpd.denied_permissions = set()
        self.httpd.storage = self.storage
        self.httpd.lock = threading.Lock()
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True,
                                       name="gcs-emulator")
        self.client = StorageClient(self.url)

    @property
    def port(self) -> int:
        return self.httpd.server_address[1]

    @property
    def url(self) -> str:
        host, port = self.httpd.server_address[:2]
        return f"http://{host}:{port}"

    @property
    def rclone_config(self) -> dict[str, str]:
        """rclone GCS backend options that point at this emulator, without credentials."""
        return {"endpoint": f"{self.url}/storage/v1/", "anonymous": "true",
                "bucket_policy_only": "true"}

    def start(self) -> StorageEmulator:
        self.thread.start()
        return self

    def stop(self) -> None:
        if self.thread.is_alive():
            self.httpd.shutdown()
            self.thread.join(timeout=5)
        self.httpd.server_close()

    def __enter__(self) -> StorageEmulator:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def deny(self, bucket: str) -> None:
        """Answer 403 for everything about ``bucket`` from now on."""
        self.httpd.denied.add(bucket)

    def allow(self, bucket: str) -> None:
        self.httpd.denied.discard(bucket)

    def deny_permission(self, permission: str, bucket: str = "*") -> None:
        """Refuse ``permission`` (storage.objects.create, ...) on ``bucket`` (``*``: every
        bucket) from now on: testPermissions leaves it out and the requests needing it
        answer 403, as for a service account without the role."""
        self.httpd.denied_permissions.add((bucket, permission))

    def allow_permission(self, permission: str, bucket: str = "*") -> None:
        self.httpd.denied_permissions.discard((bucket, permission))

    # the client side, for tests and the daemon

    def create_bucket(self, name: str) -> bool:
        return self.client.create_bucket(name)

    def upload(self, bucket: str, name: str, data: bytes) -> None:
        self.client.upload(bucket, name, data)

    def objects(self, bucket: str) -> dict[str, bytes]:
        return self.client.objects(bucket)

    def exists(self, bucket: str) -> bool:
        return self.client.exists(bucket)
