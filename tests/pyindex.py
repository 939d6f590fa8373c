"""A package index on loopback for tests: tiny pure-Python wheels built here, served as a
PEP 503 simple index, every file it serves counted.

    with PackageIndex(tmp_path) as index:
        index.add("tfa-alpha", "1.0", requires=["tfa-beta>=1"])
        index.add("tfa-beta", "1.0")
        index.url            # http://127.0.0.1:PORT/simple/ (for --index-url)
        index.served()       # {"tfa_alpha-1.0-py3-none-any.whl": 1, ...}

A wheel is a zip with a module ``<name>.py`` (``VERSION = "..."``) and its dist-info (METADATA,
WHEEL, RECORD with every file's sha256), as a build backend writes it; no build tool is needed.
The server is a ThreadingHTTPServer on 127.0.0.1 (the simulated workers share this machine's
network), GET and HEAD only, no Range: every wheel a client wants is served whole and counted.
Each wheel's METADATA is served beside it (PEP 658, ``<wheel>.metadata``), as PyPI does, so a
resolver (``uv pip compile``) reads metadata without fetching wheels.
"""

from __future__ import annotations

import base64
import hashlib
import html
import re
import threading
import zipfile
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path


def normalize(name: str) -> str:
    """PEP 503's normalized project name."""
    return re.sub(r"[-_.]+", "-", name).lower()


def build_wheel(folder: Path, name: str, version: str, requires: list[str] = (),
                payload: int = 0) -> Path:
    """A pure-Python wheel ``<dist>-<version>-py3-none-any.whl`` in ``folder``: one module
    named after the project (``import tfa_alpha``) holding ``VERSION``; ``payload``: that
    many random bytes more, stored (a wheel of a size, for bench/env_build.py)."""
    dist = re.sub(r"[-_.]+", "_", name)
    info = f"{dist}-{version}.dist-info"
    files = {
        f"{dist}.py": f'VERSION = "{version}"\n'.encode(),
        f"{info}/METADATA": ("Metadata-Version: 2.1\n"
                             f"Name: {name}\nVersion: {version}\n"
                             + "".join(f"Requires-Dist: {r}\n" for r in requires)).encode(),
        f"{info}/WHEEL": (b"Wheel-Version: 1.0\nGenerator: tests.pyindex\n"
                          b"Root-Is-Purelib: true\nTag: py3-none-any\n"),
    }
    if payload:
        import os

        files[f"{dist}_data.bin"] = os.urandom(payload)
    record = []
    for path, data in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record.append(f"{path},sha256={digest},{len(data)}")
    record.append(f"{info}/RECORD,,")
    files[f"{info}/RECORD"] = ("\n".join(record) + "\n").encode()
    out = folder / f"{dist}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as zf:
        for path, data in files.items():
            zf.writestr(zipfile.ZipInfo(path, (2026, 1, 1, 0, 0, 0)), data,
                        zipfile.ZIP_STORED if path.endswith(".bin") else zipfile.ZIP_DEFLATED)
    return out


class PackageIndex:
    """A PEP 503 simple index over a directory of wheels, on 127.0.0.1, counting what it
    serves (``served()``: file name -> times its bytes were sent)."""

    def __init__(self, root: Path, host: str = "127.0.0.1"):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self._counts: Counter[str] = Counter()
        self._pages: Counter[str] = Counter()
        self._lock = threading.Lock()
        index = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def do_HEAD(self) -> None:
                self._answer(body=False)

            def do_GET(self) -> None:
                self._answer(body=True)

            def _answer(self, *, body: bool) -> None:
                status, kind, data, counted = index._route(self.path)
                self.send_response(status)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if body:
                    if counted:   # before the bytes go: a client that has them sees the count
                        with index._lock:
                            index._counts[counted] += 1
                    self.wfile.write(data)

        self._server = ThreadingHTTPServer((host, 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True,
                                        name="pyindex")

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}/simple/"

    def add(self, name: str, version: str, requires: list[str] = (), payload: int = 0) -> Path:
        return build_wheel(self.root, name, version, list(requires), payload)

    def wheels(self) -> list[Path]:
        return sorted(self.root.glob("*.whl"))

    def served(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)

    def pages(self) -> dict[str, int]:
        """Project pages asked for (``/simple/<project>/``), counted."""
        with self._lock:
            return dict(self._pages)

    def _route(self, path: str) -> tuple[int, str, bytes, str | None]:
        path = path.split("?", 1)[0]
        parts = [p for p in path.split("/") if p]
        if parts[:1] != ["simple"]:
            if parts[:1] == ["files"] and len(parts) == 2:
                name = parts[1]
                wheel = self.root / name.removesuffix(".metadata")
                if wheel.is_file() and wheel.suffix == ".whl":
                    data = metadata_of(wheel) if name.endswith(".metadata") else \
                        wheel.read_bytes()
                    return 200, "application/octet-stream", data, name
            return 404, "text/plain", b"not found\n", None
        by_project: dict[str, list[Path]] = {}
        for wheel in self.wheels():
            by_project.setdefault(normalize(wheel.name.split("-")[0]), []).append(wheel)
        if len(parts) == 1:
            links = "".join(f'<a href="/simple/{p}/">{p}</a>\n' for p in sorted(by_project))
            return 200, "text/html", _page(links), None
        project = normalize(parts[1])
        with self._lock:
            self._pages[project] += 1
        if project not in by_project:
            return 404, "text/plain", b"no such project\n", None
        links = "".join(
            f'<a href="/files/{html.escape(w.name)}#sha256={_sha256(w.read_bytes())}" '
            f'data-dist-info-metadata="sha256={_sha256(metadata_of(w))}" '
            f'data-core-metadata="sha256={_sha256(metadata_of(w))}">{html.escape(w.name)}</a>\n'
            for w in by_project[project])
        return 200, "text/html", _page(links), None

    def __enter__(self) -> PackageIndex:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()


def metadata_of(wheel: Path) -> bytes:
    """The wheel's METADATA, served beside it as ``<wheel>.metadata`` (PEP 658, as PyPI does):
    a resolver reads it without downloading the wheel."""
    with zipfile.ZipFile(wheel) as zf:
        return zf.read(next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA")))


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _page(links: str) -> bytes:
    return f"<!DOCTYPE html>\n<html><body>\n{links}</body></html>\n".encode()
