"""The laptop's own tpufab as a wheel, for the supervisor VM (docs/supervisor.md, "The VM").

Never a guess from a package index: the wheel is made from the tpufab this process runs.

- An editable install (``pip install -e``, ``uv pip install -e``: ``direct_url.json`` says
  ``"dir_info": {"editable": true}``) is built from the source folder it names, with
  ``uv build --wheel`` (else ``python -m pip wheel --no-deps``).
- Any other install is repacked from the files its ``RECORD`` lists (the installed package
  and its ``.dist-info``; no ``.pyc``, no scripts outside site-packages: the VM's installer
  makes its own).

``code_id`` names the code, not just its version number: a hash of the package's files (the
source tree's for an editable install, RECORD's hashes otherwise), so a laptop whose code
changed under the same version is told apart from its supervisor's.
"""

from __future__ import annotations

import base64
import hashlib
import json
import shutil
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

from tpufab.errors import ConfigError

DIST = "tpufab"
SKIPPED_PARTS = ("__pycache__",)
SKIPPED_SUFFIXES = (".pyc", ".pyo")
NOT_REPACKED = ("INSTALLER", "REQUESTED", "direct_url.json", "RECORD")


@dataclass(frozen=True)
class Wheel:
    path: Path          # the .whl file (in a temporary folder of the caller's)
    version: str        # tpufab's version
    code_id: str        # hash of the code (see the module docstring), 16 hex digits
    how: str            # "built from /src" or "repacked from the installed files"

    @property
    def filename(self) -> str:
        return self.path.name


def _distribution():
    """The installed distribution this process's tpufab comes from (not a stray
    ``tpufab.egg-info`` of a checkout the current folder happens to be)."""
    from importlib import metadata

    here = Path(__file__).resolve().parents[2]   # the tpufab package this module is part of
    found = [d for d in metadata.distributions(name=DIST)
             if d.read_text("RECORD") is not None]   # installed (not a checkout's .egg-info)
    for dist in found:
        source = editable_source(dist)
        if source is not None and here.is_relative_to(source.resolve()):
            return dist
    for dist in found:
        init = next((f for f in dist.files or () if str(f) == f"{DIST}/__init__.py"), None)
        if init is not None and Path(str(dist.locate_file(init))).resolve().parent == here:
            return dist
    else:
        raise ConfigError("tpufab is not installed as a package here (no tpufab .dist-info), "
                          "so there is no wheel of it to give the supervisor: install it "
                          "(pip install -e . in its checkout, or pip install tpufab).") from None


def editable_source(dist=None) -> Path | None:
    """The source folder of an editable install (direct_url.json), else None."""
    dist = dist or _distribution()
    text = dist.read_text("direct_url.json") if hasattr(dist, "read_text") else None
    if not text:
        return None
    try:
        info = json.loads(text)
    except ValueError:
        return None
    url = str(info.get("url") or "")
    if not (info.get("dir_info") or {}).get("editable") or not url.startswith("file://"):
        return None
    from urllib.parse import unquote, urlparse

    path = Path(unquote(urlparse(url).path))
    return path if (path / "pyproject.toml").exists() else None


def _source_files(source: Path) -> list[Path]:
    files = [source / "pyproject.toml"]
    for path in sorted((source / DIST).rglob("*")):
        if path.is_file() and not any(p in SKIPPED_PARTS for p in path.parts) \
                and path.suffix not in SKIPPED_SUFFIXES:
            files.append(path)
    return files


def code_id(dist=None) -> str:
    """A hash naming the code of the installed tpufab (see the module docstring)."""
    dist = dist or _distribution()
    digest = hashlib.sha256()
    source = editable_source(dist)
    if source is not None:
        for path in _source_files(source):
            digest.update(str(path.relative_to(source)).encode() + b"\0")
            digest.update(path.read_bytes() + b"\0")
    else:
        digest.update((dist.read_text("RECORD") or "").encode())
    return digest.hexdigest()[:16]


def build(folder: Path) -> Wheel:
    """The wheel of the tpufab this process runs, in ``folder``."""
    dist = _distribution()
    source = editable_source(dist)
    ident = code_id(dist)
    if source is not None:
        return Wheel(_build_from_source(source, folder), dist.version, ident,
                     f"built from {source}")
    return Wheel(repack(dist, folder), dist.version, ident, "repacked from the installed files")


def _build_from_source(source: Path, folder: Path) -> Path:
    uv = shutil.which("uv") or shutil.which("uv", path=str(Path(sys.executable).parent))
    argv = [uv, "build", "--wheel", "--quiet", "--out-dir", str(folder), str(source)] if uv \
        else [sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "--wheel-dir",
              str(folder), str(source)]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        last = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
        raise ConfigError(f"Could not build the wheel of this tpufab from {source} "
                          f"({' '.join(argv[:2])} exited {proc.returncode}: {last[0]}); the "
                          "supervisor runs the laptop's own tpufab, so fix the build first.")
    found = sorted(folder.glob(f"{DIST}-*.whl"), key=lambda p: p.stat().st_mtime)
    if not found:
        raise ConfigError(f"Building {source} made no {DIST} wheel in {folder}.")
    return found[-1]


def _record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(
        b"=").decode()


def repack(dist, folder: Path) -> Path:
    """A wheel of an installed (not editable) distribution, from the files its RECORD lists."""
    root = Path(str(dist.locate_file("")))
    info_dir = next((str(f).split("/")[0] for f in dist.files or ()
                     if str(f).endswith(".dist-info/METADATA")), None)
    if info_dir is None:
        raise ConfigError(f"The installed {DIST} has no .dist-info/METADATA in its RECORD, so "
                          "it cannot be repacked as a wheel: reinstall it.")
    tag = "py3-none-any"
    wheel_text = dist.read_text("WHEEL") or ""
    for line in wheel_text.splitlines():
        if line.startswith("Tag:"):
            tag = line.split(":", 1)[1].strip()
            break
    name = f"{DIST}-{dist.version}-{tag}.whl"
    path = folder / name
    record: list[str] = []
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        for entry in dist.files or ():
            rel = str(entry)
            if rel.startswith("..") or rel.startswith("/") or \
                    any(p in SKIPPED_PARTS for p in Path(rel).parts) or \
                    rel.endswith(SKIPPED_SUFFIXES) or \
                    (rel.startswith(info_dir + "/") and rel.split("/")[-1] in NOT_REPACKED):
                continue
            data = (root / rel).read_bytes()
            zf.writestr(rel, data)
            record.append(f"{rel},{_record_hash(data)},{len(data)}")
        if not wheel_text:
            wheel_text = f"Wheel-Version: 1.0\nGenerator: tpufab\nRoot-Is-Purelib: true\nTag: {tag}\n"
            zf.writestr(f"{info_dir}/WHEEL", wheel_text)
            record.append(f"{info_dir}/WHEEL,{_record_hash(wheel_text.encode())},"
                          f"{len(wheel_text.encode())}")
        record.append(f"{info_dir}/RECORD,,")
        zf.writestr(f"{info_dir}/RECORD", "\n".join(record) + "\n")
    return path
