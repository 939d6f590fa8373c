"""A client for the simulated pod's Cloud Storage (the GCS JSON API), stdlib only.

Its own module so that the storage emulator host (storage.py) and the admin clients (admin.py)
both use it without importing each other.
"""

from __future__ import annotations

import json
from urllib.error import HTTPError, URLError
from urllib.parse import quote
from urllib.request import ProxyHandler, Request, build_opener

from tpufab.errors import SimError
from tpufab.sim._model import DEFAULT_PROJECT

_DIRECT = build_opener(ProxyHandler({}))


class StorageClient:
    """A few calls of the Cloud Storage JSON API, anonymous, against an emulator's endpoint
    (``http://127.0.0.1:PORT``, the pod's TPUFAB_STORAGE_ENDPOINT)."""

    def __init__(self, endpoint: str, *, project: str = DEFAULT_PROJECT, timeout: float = 30.0):
        self.endpoint = endpoint.rstrip("/")
        self.project = project
        self.timeout = timeout

    def create_bucket(self, name: str) -> bool:
        """Create bucket ``name``; True if it was created, False if it already existed."""
        if self.exists(name):
            return False
        try:
            self._call("POST", f"/storage/v1/b?project={quote(self.project)}",
                       json.dumps({"name": name}).encode())
        except HTTPError as err:
            if err.code == 409:  # created meanwhile
                return False
            raise self._refused(err, f"create bucket {name}") from None
        return True

    def exists(self, bucket: str) -> bool:
        try:
            self._call("GET", f"/storage/v1/b/{quote(bucket, safe='')}")
            return True
        except HTTPError as err:
            if err.code == 404:
                return False
            raise self._refused(err, f"look up bucket {bucket}") from None

    def buckets(self) -> list[str]:
        listing = json.loads(self._call("GET", f"/storage/v1/b?project={quote(self.project)}"))
        return sorted(item["name"] for item in listing.get("items", []))

    def upload(self, bucket: str, name: str, data: bytes) -> None:
        self._call("POST", f"/upload/storage/v1/b/{quote(bucket, safe='')}/o?uploadType=media"
                   f"&name={quote(name, safe='')}", data, "application/octet-stream")

    def objects(self, bucket: str) -> dict[str, bytes]:
        """Every object in ``bucket`` with its content."""
        base = f"/storage/v1/b/{quote(bucket, safe='')}/o"
        listing = json.loads(self._call("GET", base))
        return {item["name"]: self._call("GET", f"{base}/{quote(item['name'], safe='')}"
                                                "?alt=media")
                for item in listing.get("items", [])}

    def _refused(self, err: HTTPError, what: str) -> SimError:
        return SimError(f"The Cloud Storage at {self.endpoint} refused to {what} "
                        f"(HTTP {err.code}).")

    def _call(self, method: str, path: str, body: bytes | None = None,
              content_type: str = "application/json") -> bytes:
        request = Request(self.endpoint + path, data=body, method=method,
                          headers={"Content-Type": content_type})
        try:
            with _DIRECT.open(request, timeout=self.timeout) as resp:
                return resp.read()
        except HTTPError:
            raise
        except (URLError, OSError) as err:
            raise SimError(f"The Cloud Storage at {self.endpoint} does not answer ({err}); "
                           "is the simulated pod up? run `tpufab sim up`.") from None
