"""A local GCS (JSON API) for tests: PyPI ``gcp-storage-emulator`` served in-process on
loopback, plus a list of buckets that answer 403 (to test "access denied").

    with GcsEmulator() as gcs:
        gcs.create_bucket("data")
        gcs.rclone_config   # {"endpoint": ..., "anonymous": "true", ...} for the rclone driver
        gcs.objects("data") # {name: bytes}
"""

from __future__ import annotations

import json
import re
import threading
import urllib.error
import urllib.request
from functools import partial
from http.server import ThreadingHTTPServer
from urllib.parse import quote, urlparse

from gcp_storage_emulator.server import RequestHandler
from gcp_storage_emulator.storage import Storage

BUCKET_IN_PATH = re.compile(r"^(?:/upload)?(?:/storage/v1)?/b/([^/?]+)")


class _Handler(RequestHandler):
    """The emulator's handler, one request at a time, with a deny list in front."""

    def _dispatch(self, verb: str) -> None:
        match = BUCKET_IN_PATH.match(urlparse(self.path).path)
        if match and match.group(1) in self.server.denied:
            body = json.dumps({"error": {"code": 403, "message": "Access denied.",
                                         "errors": [{"reason": "forbidden"}]}}).encode()
            self.send_response(403)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return
        with self.server.lock:  # the emulator's storage is not thread-safe
            getattr(super(), f"do_{verb}")()

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

    def log_message(self, format, *args):
        pass


class GcsEmulator:
    def __init__(self, host: str = "127.0.0.1", port: int = 0):
        self.storage = Storage(use_memory_fs=True)
        self.httpd = ThreadingHTTPServer((host, port), partial(_Handler, self.storage))
        self.httpd.daemon_threads = True
        self.httpd.denied = set()
        self.httpd.lock = threading.Lock()
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True,
                                       name="gcs-emulator")

    @property
    def url(self) -> str:
        host, port = self.httpd.server_address[:2]
        return f"http://{host}:{port}"

    @property
    def rclone_config(self) -> dict[str, str]:
        """rclone GCS backend options that point at this emulator, without credentials."""
        return {"endpoint": f"{self.url}/storage/v1/", "anonymous": "true",
                "bucket_policy_only": "true"}

    def start(self) -> GcsEmulator:
        self.thread.start()
        return self

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(timeout=5)

    def __enter__(self) -> GcsEmulator:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def deny(self, bucket: str) -> None:
        self.httpd.denied.add(bucket)

    def _call(self, method: str, path: str, body: bytes | None = None,
              content_type: str = "application/json") -> bytes:
        request = urllib.request.Request(self.url + path, data=body, method=method,
                                         headers={"Content-Type": content_type})
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.read()

    def create_bucket(self, name: str) -> None:
        self._call("POST", "/storage/v1/b?project=test", json.dumps({"name": name}).encode())

    def upload(self, bucket: str, name: str, data: bytes) -> None:
        self._call("POST", f"/upload/storage/v1/b/{bucket}/o?uploadType=media&name="
                   f"{quote(name, safe='')}", data, "application/octet-stream")

    def objects(self, bucket: str) -> dict[str, bytes]:
        listing = json.loads(self._call("GET", f"/storage/v1/b/{bucket}/o"))
        out = {}
        for item in listing.get("items", []):
            name = item["name"]
            out[name] = self._call("GET", f"/storage/v1/b/{bucket}/o/{quote(name, safe='')}"
                                   f"?alt=media")
        return out

    def exists(self, bucket: str) -> bool:
        try:
            self._call("GET", f"/storage/v1/b/{bucket}")
            return True
        except urllib.error.HTTPError:
            return False
