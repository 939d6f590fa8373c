#!/usr/bin/env python3
"""tpufab setup's environment, worker side (stdlib only): probe, build, install, status.

    env_worker.py OP     (the request is a JSON object on stdin; one answer on stdout)

- ``probe {path, python, uv}``: this host's architecture, the Python the environment would
  use, the environment installed at ``path`` (its marker), the uv found, free disk; makes
  ``~/.tpufab/env`` (where archives land).
- ``build {hash, path, python, kind, files, uv}``: on the build host only (``files``: the
  spec files by their paths in the project, a requirements file's includes beside it). ``uv venv
  --relocatable``, then the resolution once (``uv pip compile`` of the requirements, its
  result kept, then ``uv pip sync``; or ``uv sync --locked`` of a uv.lock and its
  pyproject.toml), packed as ``~/.tpufab/env/<hash>.tar.gz``; answers its sha256, size and
  the tree's hash. A resolver failure answers ``{"stage": "resolve", "error": its reason}``.
- ``install {hash, path, archive, sha256, tree, keep}``: the archive checked, unpacked next to
  ``path``, its tree hashed and compared with the build's, then swapped into place with a
  marker (``<path>/.tpufab-env.json``); an existing tree at ``path`` is replaced only then.
- ``status {path}``: the marker at ``path``.
- ``upload`` / ``fetch {archive, sha256, endpoint, bucket, object}``: the build's archive
  into the environment's bucket (the build host), and from it (every other host, at once),
  with the VM's own token from its metadata server; a fetched archive is checked by sha256.

Every tree hash is over the sorted paths, each with its kind, mode and content (a file's
sha256, a symlink's target), the marker left out: two hosts with the same hash hold the same
environment byte for byte.
"""

import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tarfile
import time

from tpufab.remote.workerlib import serve_ops

ENV_DIR = os.path.expanduser("~/.tpufab/env")
MARKER = ".tpufab-env.json"
UV_PLACES = ("~/.local/bin/uv", "~/.cargo/bin/uv", "~/.cache/tpufab/uv/uv")


def home_path(path):
    return os.path.abspath(os.path.expanduser(path))


def read_marker(path):
    try:
        with open(os.path.join(home_path(path), MARKER)) as fh:
            data = json.load(fh)
        return data if isinstance(data, dict) else None
    except (OSError, ValueError):
        return None


def find_uv(given=None):
    for candidate in (given, shutil.which("uv"), *UV_PLACES):
        if candidate:
            full = os.path.abspath(os.path.expanduser(candidate))   # relative: to home
            if os.path.isfile(full) and os.access(full, os.X_OK):
                return full
    return None


def python_version(python):
    """The version the environment's interpreter has (or the one asked for): "3.11.2"."""
    if not python:
        return "{}.{}.{}".format(*sys.version_info[:3])
    if python.startswith("/"):
        try:
            out = subprocess.run([python, "-c", "import sys; print('%d.%d.%d' % "
                                  "sys.version_info[:3])"], capture_output=True, text=True,
                                 timeout=30)
            return out.stdout.strip() or None
        except OSError:
            return None
    return python


def free_bytes(path):
    folder = home_path(path)
    while not os.path.isdir(folder):
        folder = os.path.dirname(folder)
    st = os.statvfs(folder)
    return st.f_bavail * st.f_frsize


def probe(request):
    os.makedirs(ENV_DIR, mode=0o700, exist_ok=True)
    marker = read_marker(request["path"])
    build = (marker or {}).get("build") or {}
    present = bool(build.get("archive")) and os.path.isfile(
        home_path(os.path.join("~", build["archive"])))
    return {"archive_present": present, "arch": platform.machine(), "system": platform.system(),
            "python": python_version(request.get("python")),
            "marker": marker, "uv": find_uv(request.get("uv")),
            "free": free_bytes(request["path"]), "error": None}


def tree_hash(root):
    digest = hashlib.sha256()
    for folder, dirs, files in os.walk(root):
        dirs.sort()
        rel = os.path.relpath(folder, root)
        for name in sorted(dirs + files):
            full = os.path.join(folder, name)
            path = os.path.normpath(os.path.join(rel, name))
            if path == MARKER:
                continue
            st = os.lstat(full)
            if os.path.islink(full):
                line = f"l {path} {os.readlink(full)}"
            elif os.path.isdir(full):
                line = f"d {path} {st.st_mode & 0o777:o}"
            else:
                with open(full, "rb") as fh:
                    line = f"f {path} {st.st_mode & 0o777:o} {sha256_stream(fh)}"
            digest.update(line.encode("utf-8", "surrogateescape") + b"\n")
    return digest.hexdigest()


def sha256_stream(fh):
    digest = hashlib.sha256()
    while True:
        block = fh.read(1 << 20)
        if not block:
            return digest.hexdigest()
        digest.update(block)


def sha256_of(path):
    with open(path, "rb") as fh:
        return sha256_stream(fh)


def reason(out):
    """uv's own words: its error and causes, one line each, at most 1,500 characters."""
    lines = [line.strip() for line in (out.stderr or out.stdout or "").splitlines()
             if line.strip() and not line.startswith(("Using ", "Resolved ", "Creating ",
                                                      "Activate "))]
    return " ".join(lines)[-1500:] or f"exit {out.returncode}"


def run_uv(argv, cwd, env, stage):
    out = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True)
    if out.returncode != 0:
        raise Failed(stage, reason(out))
    return out


class Failed(Exception):
    def __init__(self, stage, error):
        super().__init__(error)
        self.stage = stage
        self.error = error


def inside(folder, name):
    """``folder/name`` where ``name`` is a relative path that stays inside it, else None."""
    if not name or name.startswith("/") or ".." in name.split("/"):
        return None
    return os.path.join(folder, *name.split("/"))


def build(request):
    started = time.time()
    uv = find_uv(request.get("uv"))
    if uv is None:
        return {"stage": "uv", "error": "no uv on this host"}
    digest = request["hash"]
    work = os.path.join(ENV_DIR, "build-" + digest)
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work, mode=0o700)
    project = os.path.join(work, "project")     # the spec files, as in the project
    for name, text in request["files"].items():
        place = inside(project, name)
        if place is None:
            shutil.rmtree(work, ignore_errors=True)
            return {"stage": "build", "error": f"a spec file's name {name!r} is not a path "
                                               "inside the project"}
        os.makedirs(os.path.dirname(place), mode=0o700, exist_ok=True)
        with open(place, "w") as fh:
            fh.write(text)
    venv = os.path.join(work, "venv")
    env = dict(os.environ, NO_COLOR="1", UV_NO_PROGRESS="1")
    python = request.get("python")
    if not python:   # the host's own interpreter, never one downloaded
        env["UV_PYTHON_DOWNLOADS"] = "never"
    try:
        run_uv([uv, "venv", "--relocatable", "--python", python or sys.executable, venv],
               work, env, "python")
        interpreter = os.path.join(venv, "bin", "python")
        resolved = None
        if request["kind"] == "requirements":
            spec = request["spec"]       # its includes beside it, as in the project
            if inside(project, spec) is None:
                shutil.rmtree(work, ignore_errors=True)
                return {"stage": "build", "error": f"{spec!r} is not a path inside the project"}
            resolution = os.path.join(work, "resolved.txt")
            run_uv([uv, "pip", "compile", spec, "-o", resolution, "--emit-index-url",
                    "--no-header", "--quiet", "--python", interpreter], project, env, "resolve")
            run_uv([uv, "pip", "sync", resolution, "--python", interpreter], project, env,
                   "install")
            with open(resolution) as fh:
                resolved = fh.read()
        else:
            run_uv([uv, "sync", "--locked", "--no-install-project", "--python", interpreter],
                   project, dict(env, UV_PROJECT_ENVIRONMENT=venv), "resolve")
    except OSError as err:
        return {"stage": "build", "error": f"{type(err).__name__}: {err}"}
    except Failed as failed:
        shutil.rmtree(work, ignore_errors=True)
        return {"stage": failed.stage, "error": failed.error}
    tree = tree_hash(venv)
    archive = os.path.join(ENV_DIR, digest + ".tar.gz")
    part = archive + ".part"
    try:
        with tarfile.open(part, "w:gz", compresslevel=1) as tar:
            for name in sorted(os.listdir(venv)):
                tar.add(os.path.join(venv, name), arcname=name)
        os.replace(part, archive)
    except OSError as err:
        for path in (part, archive):
            if os.path.exists(path):
                os.unlink(path)
        return {"stage": "pack", "error": f"{err.strerror or err}: {err.filename or ''}"}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    for name in os.listdir(ENV_DIR):   # the archive of an earlier build is not served again
        if name.endswith(".tar.gz") and name != digest + ".tar.gz":
            os.unlink(os.path.join(ENV_DIR, name))
    return {"stage": None, "error": None, "archive": os.path.relpath(archive, home_path("~")),
            "sha256": sha256_of(archive), "size": os.path.getsize(archive), "tree": tree,
            "resolved": resolved, "seconds": round(time.time() - started, 2)}


def install(request):
    path = home_path(request["path"])
    archive = home_path(os.path.join("~", request["archive"]))
    if not os.path.isfile(archive) or sha256_of(archive) != request["sha256"]:
        return {"error": "the archive is missing or not the build's (sha256 differs)",
                "retry": True}
    parent = os.path.dirname(path)
    os.makedirs(parent, exist_ok=True)
    token = f"{os.getpid()}-{int(time.time() * 1000)}"
    new = f"{path}.tpufab-new-{token}"
    old = f"{path}.tpufab-old-{token}"
    try:
        with tarfile.open(archive, "r:gz") as tar:
            if hasattr(tarfile, "fully_trusted_filter"):
                # the build's own archive, its sha256 checked; a venv's bin/python is an
                # absolute symlink and every mode must stay the build's (the tree's hash)
                tar.extractall(new, filter="fully_trusted")
            else:
                tar.extractall(new)
        tree = tree_hash(new)
        if tree != request["tree"]:
            shutil.rmtree(new, ignore_errors=True)
            return {"error": f"the unpacked tree's hash {tree[:12]} is not the build's "
                             f"{request['tree'][:12]}", "retry": True}
        interpreter = os.path.join(new, "bin", "python")
        try:
            runs = subprocess.run([interpreter, "-c", "pass"], capture_output=True,
                                  timeout=60).returncode == 0
        except OSError:
            runs = False
        if not runs:
            target = os.path.realpath(interpreter)
            shutil.rmtree(new, ignore_errors=True)
            return {"error": f"its Python ({target}) does not run on this host: the "
                             "interpreter must be at the same path on every host (in the "
                             "image, or name one with python:)", "retry": False}
        marker = {"hash": request["hash"], "tree": tree, "python": request.get("python"),
                  "python_version": python_version(request.get("python")),
                  "installed_at": time.time()}
        if request.get("keep"):      # the build host serves this archive to hosts added later
            marker["build"] = request.get("build")
        with open(os.path.join(new, MARKER), "w") as fh:
            json.dump(marker, fh)
        if os.path.lexists(path):
            os.rename(path, old)
        os.rename(new, path)
    except OSError as err:
        shutil.rmtree(new, ignore_errors=True)
        no_space = getattr(err, "errno", None) in (28, 122)
        return {"error": (f"no space left under {parent}") if no_space else
                f"{err.strerror or err}: {err.filename or path}", "retry": not no_space}
    finally:
        if os.path.lexists(old):
            shutil.rmtree(old, ignore_errors=True)
    if not request.get("keep"):
        os.unlink(archive)
    return {"error": None, "tree": tree}


METADATA_TOKEN = "http://{}/computeMetadata/v1/instance/service-accounts/default/token"
STATUS_WORDS = {403: "permission denied", 404: "no such bucket or object"}


def storage_call(method, url, *, body=None, size=None):
    """One Cloud Storage JSON API call with the VM's own token (its metadata server); the
    response, or OSError with the reason in words (HTTP status and message)."""
    import urllib.error
    import urllib.request

    host = os.environ.get("GCE_METADATA_HOST") or "metadata.google.internal"   # google-auth's
    try:
        got = urllib.request.Request(METADATA_TOKEN.format(host),
                                     headers={"Metadata-Flavor": "Google"})
        with urllib.request.urlopen(got, timeout=30) as resp:
            token = json.loads(resp.read())["access_token"]
    except (OSError, ValueError, KeyError) as err:
        raise OSError(f"no token from this VM's metadata server ({err})") from None
    headers = {"Authorization": "Bearer " + token}
    if body is not None:
        headers.update({"Content-Type": "application/gzip", "Content-Length": str(size)})
    request = urllib.request.Request(url, data=body, method=method, headers=headers)
    try:
        return urllib.request.urlopen(request, timeout=120)
    except urllib.error.HTTPError as err:
        try:
            message = json.loads(err.read() or b"{}").get("error", {}).get("message", "")
        except (ValueError, AttributeError):
            message = ""
        message = message or STATUS_WORDS.get(err.code, "")
        raise OSError(f"Cloud Storage answered {err.code}"
                      + (f": {message}" if message else "")) from None
    except urllib.error.URLError as err:
        raise OSError(f"cannot reach Cloud Storage at {url.split('/storage/')[0]} "
                      f"({err.reason})") from None


def object_url(request, media=False):
    from urllib.parse import quote

    bucket, name = quote(request["bucket"], safe=""), quote(request["object"], safe="")
    if media:
        return f"{request['endpoint']}/upload/storage/v1/b/{bucket}/o?uploadType=media&name={name}"
    return f"{request['endpoint']}/storage/v1/b/{bucket}/o/{name}?alt=media"


def upload(request):
    """``upload {archive, endpoint, bucket, object}``: the build's archive into the bucket."""
    archive = home_path(os.path.join("~", request["archive"]))
    try:
        with open(archive, "rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            with storage_call("POST", object_url(request, media=True), body=fh, size=size):
                pass
    except OSError as err:
        return {"error": str(err) if not err.filename else f"{err.strerror}: {err.filename}"}
    return {"error": None, "bytes": size}


def fetch(request):
    """``fetch {archive, sha256, endpoint, bucket, object}``: the archive from the bucket to
    a part file beside ``archive``, its sha256 checked, renamed into place."""
    archive = home_path(os.path.join("~", request["archive"]))
    part = f"{archive}.{os.getpid()}.part"
    digest, moved = hashlib.sha256(), 0
    try:
        with storage_call("GET", object_url(request)) as resp, open(part, "wb") as out:
            while True:
                block = resp.read(1 << 20)
                if not block:
                    break
                out.write(block)
                digest.update(block)
                moved += len(block)
        if digest.hexdigest() != request["sha256"]:
            os.unlink(part)
            return {"error": f"the archive in gs://{request['bucket']}/{request['object']} is "
                             "not the build's (sha256 differs)"}
        os.replace(part, archive)
    except OSError as err:
        if os.path.exists(part):
            os.unlink(part)
        why = str(err) if not err.filename else f"{err.strerror}: {err.filename}"
        return {"error": why + (f" after {moved} bytes" if moved else "")}
    return {"error": None, "bytes": moved}


def status(request):
    marker = read_marker(request["path"])
    return {"error": None, "marker": marker,
            "exists": os.path.isdir(home_path(request["path"]))}


OPS = {"probe": probe, "build": build, "install": install, "status": status, "upload": upload,
       "fetch": fetch}


if __name__ == "__main__":
    sys.exit(serve_ops("env_worker", OPS))
