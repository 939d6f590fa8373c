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

import json
import re
import threading
from functools import cache, partial
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from tpufab.errors import SimError
from tpufab.sim.gcs import StorageClient

BUCKET_IN_PATH = re.compile(r"^(?:/upload|/download)?(?:/storage/v1)?/b/([^/?]+)")
PACKAGE = "gcp-storage-emulator"


@cache
def _handler_class() -> type:
    """The emulator's request handler, one request at a time, with a deny list in front."""
    try:
        from gcp_storage_emulator.server import RequestHandler
    except ImportError:
        raise SimError(f"The simulated pod's Cloud Storage needs the {PACKAGE} package: "
                       f"pip install {PACKAGE} (it comes with tpufab's dev extra).") from None

    class Handler(RequestHandler):
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

        def log_message(self, format, *args):  # one line per object request is too many
            pass

    return Handler


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

    # the client side, for tests and the daemon

    def create_bucket(self, name: str) -> bool:
        return self.client.create_bucket(name)

    def upload(self, bucket: str, name: str, data: bytes) -> None:
        self.client.upload(bucket, name, data)

    def objects(self, bucket: str) -> dict[str, bytes]:
        return self.client.objects(bucket)

    def exists(self, bucket: str) -> bool:
        return self.client.exists(bucket)
