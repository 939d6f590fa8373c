#!/usr/bin/env python3
"""tpufab images, worker side (stdlib only; run as root): pull an image, say its digest.

    image_worker.py pull --image REF [--if-missing] [--attempts N] [--backoff S] [--cap S]
                         [--jitter S] [--login-stdin] [--room-factor F]
    image_worker.py digest --image REF

`pull` waits a random 0..--jitter s first (so a large slice does not hit the registry at one
instant), then tries up to --attempts times: registry auth and pull together, each time anew
(a token that the registry refused is fetched again), --backoff s before the second try,
doubling up to --cap s, each wait drawn from [half, all] of it. Auth: for Artifact Registry
(``*-docker.pkg.dev``, ``*gcr.io``) the VM's own service-account token from its metadata
server, handed to `docker login -u oauth2accesstoken --password-stdin HOST` (on stdin, never
in argv); with --login-stdin, `{"username": ..., "password": ...}` from stdin instead, for
another registry. With --if-missing (or a REF pinned by digest) an image already here is not
pulled again: its digest is read locally. `digest` only reads it.

Room first: where the image is not here yet, once the login worked, its manifest is read
from the registry (the same credentials; the Registry API's token flow) and the host is
refused, before anything is pulled, when the runtime's storage (Docker's data-root, podman's
graphroot) has less free space than --room-factor (3) times the image's compressed size (its
layers and config as the manifest gives them): the compressed layers are held while they
unpack to about twice their size. A manifest that cannot be read leaves the check to the
pull (said in the answer's "room").

Both print one JSON answer: ``{"digest": "sha256:...", "image_id": ..., "present": bool,
"pulled": bool, "attempts": N, "retries": [why, ...], "seconds": S, "room"?: {...}}`` or
``{"error": why, "attempts": N, "retries": [...], "no_room"?: {"path", "free_bytes",
"need_bytes", "compressed_bytes", "factor"}}`` (the registry's own sentence, or the room
missing). A registry that refuses an anonymous pull (no credentials: not Artifact Registry,
no --login-stdin) is not asked again: there is nothing to fetch anew.
"""

from __future__ import annotations

import base64
import json
import os
import platform
import random
import re
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request

from tpufab.remote.workerlib import answer

TOKEN_URL = ("http://metadata.google.internal/computeMetadata/v1/instance/service-accounts/"
             "default/token")
COMMAND_TIMEOUT = 1800.0
ROOM_FACTOR = 3
MANIFEST_TYPES = ("application/vnd.oci.image.index.v1+json",
                  "application/vnd.docker.distribution.manifest.list.v2+json",
                  "application/vnd.oci.image.manifest.v1+json",
                  "application/vnd.docker.distribution.manifest.v2+json")
ARCH = {"x86_64": "amd64", "aarch64": "arm64"}


class ImageError(Exception):
    pass


def registry_of(ref):
    first = ref.split("/", 1)[0]
    if "/" in ref and ("." in first or ":" in first or first == "localhost"):
        return first
    return "docker.io"


def needs_google_token(host):
    return host.endswith("-docker.pkg.dev") or host.endswith("gcr.io")


def docker():
    path = shutil.which("docker")
    if path is None:
        raise ImageError("no container runtime on this host: `docker` is not installed "
                         "(apt-get install docker.io, or podman-docker)")
    return path


def run(argv, *, stdin=None, timeout=COMMAND_TIMEOUT):
    try:
        done = subprocess.run(argv, input=stdin, capture_output=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return 124, f"{argv[1]} took longer than {timeout:g} s"
    err = done.stderr.decode("utf-8", "replace").strip()
    return done.returncode, (done.stdout.decode("utf-8", "replace") if done.returncode == 0
                             else last_sentence(err))


def last_sentence(text):
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    line = lines[-1] if lines else "failed without a message"
    return line.removeprefix("Error: ").removeprefix("Error response from daemon: ")[:400]


def local_digest(ref):
    """(digest, image id) of REF here, or None. The digest is the registry's manifest digest
    for REF's repository (RepoDigests)."""
    code, out = run([docker(), "image", "inspect", "--format",
                     "{{.Id}} {{json .RepoDigests}}", ref], timeout=60)
    if code != 0:
        return None
    image_id, _, digests = out.strip().partition(" ")
    try:
        repo_digests = json.loads(digests) or []
    except ValueError:
        repo_digests = []
    repo = ref.split("@", 1)[0]
    if ":" in repo.rsplit("/", 1)[-1]:
        repo = repo.rsplit(":", 1)[0]
    if "@" in ref:
        return ref.split("@", 1)[1], image_id
    for entry in repo_digests:
        name, _, digest = entry.partition("@")
        if name == repo:
            return digest, image_id
    if repo_digests:
        return repo_digests[0].partition("@")[2], image_id
    return None


def token():
    request = urllib.request.Request(TOKEN_URL, headers={"Metadata-Flavor": "Google"})
    try:
        with urllib.request.urlopen(request, timeout=10) as reply:
            return json.loads(reply.read().decode())["access_token"]
    except (OSError, ValueError, KeyError) as err:
        raise ImageError(f"no access token from the metadata server ({err})") from None


def login(host, credentials):
    """(why it failed or None, the (user, password) used or None)."""
    if credentials is not None:
        user, password = credentials["username"], credentials["password"]
    elif needs_google_token(host):
        try:
            user, password = "oauth2accesstoken", token()
        except ImageError as err:     # retried with the pull: the metadata server may lag
            return str(err), None
    else:
        return None, None
    code, out = run([docker(), "login", "-u", user, "--password-stdin", host],
                    stdin=password.encode(), timeout=60)
    return (None, (user, password)) if code == 0 else (f"login to {host}: {out}", None)


# -- room for the image (its compressed size from the manifest) ---------------------------

DAEMON_JSON = "/etc/docker/daemon.json"
REGISTRIES_CONF = "/etc/containers/registries.conf"


def insecure_registries(daemon_json=DAEMON_JSON, registries_conf=REGISTRIES_CONF):
    """The registries the runtime talks plain HTTP to: Docker's daemon.json
    ``insecure-registries``, podman's registries.conf ``[[registry]]`` with insecure = true."""
    found = set()
    try:
        with open(daemon_json) as fh:
            found.update(json.load(fh).get("insecure-registries") or ())
    except (OSError, ValueError, AttributeError):
        pass
    try:
        with open(registries_conf) as fh:
            text = fh.read()
    except OSError:
        text = ""
    for block in re.split(r"^\s*\[\[registry\]\]\s*$", text, flags=re.M)[1:]:
        block = re.split(r"^\s*\[", block, maxsplit=1, flags=re.M)[0]
        keys = dict(re.findall(r'^\s*(\w+)\s*=\s*"?([^"\n#]*?)"?\s*(?:#.*)?$', block, re.M))
        if keys.get("insecure", "").strip() == "true":
            found.update(keys[k].strip() for k in ("location", "prefix") if keys.get(k))
    return found


def registry_get(url, auth, accept, held):
    """GET ``url`` from a registry with HTTP Basic ``auth`` (user, password) or none,
    following the Registry API's token flow (401 with a Bearer challenge: a token from its
    realm, asked with the same credentials, kept in ``held`` for the next request). The
    reply's bytes; ImageError with why not."""
    basic = None
    if auth:
        basic = "Basic " + base64.b64encode(":".join(auth).encode()).decode()
    headers = {"Accept": ", ".join(accept)}
    if held.get("Authorization") or basic:
        headers["Authorization"] = held.get("Authorization") or basic
    for _ in range(2):
        request = urllib.request.Request(url, headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=30) as reply:
                return reply.read(4 << 20)
        except urllib.error.HTTPError as err:
            challenge = err.headers.get("WWW-Authenticate") or ""
            if err.code != 401 or not challenge.lower().startswith("bearer") or \
                    headers.get("Authorization", "").startswith("Bearer"):
                raise ImageError(f"{url}: {err.code} {err.reason}") from None
            params = dict(re.findall(r'(\w+)="([^"]*)"', challenge))
            realm = params.pop("realm", "")
            query = "&".join(f"{k}={urllib.request.quote(v)}" for k, v in params.items())
            ask = urllib.request.Request(realm + ("?" + query if query else ""),
                                         headers={"Authorization": basic} if basic else {})
            try:
                with urllib.request.urlopen(ask, timeout=30) as reply:
                    got = json.loads(reply.read(1 << 20).decode())
            except (OSError, ValueError) as why:
                raise ImageError(f"no registry token from {realm} ({why})") from None
            headers["Authorization"] = held["Authorization"] = "Bearer " + (
                got.get("token") or got.get("access_token") or "")
        except (OSError, ValueError) as err:
            raise ImageError(f"{url}: {err}") from None
    raise ImageError(f"{url}: refused")


def compressed_size(ref, auth, insecure=None):
    """The bytes a pull of REF downloads: its layers and config, as its manifest says (for an
    index, the entry of this host's platform)."""
    host = registry_of(ref)
    name = ref.split("/", 1)[1] if host != "docker.io" or ref.startswith("docker.io/") \
        else ref
    if host == "docker.io":
        host, name = "registry-1.docker.io", (name if "/" in name else "library/" + name)
    name, _, digest = name.partition("@")
    tag = "latest"
    if ":" in name.rsplit("/", 1)[-1]:
        name, tag = name.rsplit(":", 1)
    scheme = "http" if host in (insecure_registries() if insecure is None else insecure) \
        else "https"
    base = f"{scheme}://{host}/v2/{name}/manifests/"
    held = {}
    manifest = json.loads(registry_get(base + (digest or tag), auth, MANIFEST_TYPES, held))
    if "manifests" in manifest:
        arch = ARCH.get(platform.machine(), platform.machine())
        entries = [m for m in manifest["manifests"]
                   if (m.get("platform") or {}).get("architecture", arch) == arch
                   and (m.get("platform") or {}).get("os", "linux") == "linux"]
        if not entries:
            raise ImageError(f"{ref} has no linux/{arch} image")
        manifest = json.loads(registry_get(base + entries[0]["digest"], auth, MANIFEST_TYPES,
                                           held))
    parts = list(manifest.get("layers") or ()) + [manifest.get("config") or {}]
    return sum(int(p.get("size") or 0) for p in parts)


def storage_dir():
    """Where the runtime keeps images: Docker's data-root, else podman's graphroot."""
    try:
        with open("/etc/docker/daemon.json") as fh:
            root = json.load(fh).get("data-root")
        if root:
            return root
    except (OSError, ValueError, AttributeError):
        pass
    if os.path.isdir("/var/lib/docker"):
        return "/var/lib/docker"
    try:
        with open("/etc/containers/storage.conf") as fh:
            found = re.search(r'^\s*graphroot\s*=\s*"([^"]+)"', fh.read(), re.M)
        if found:
            return found.group(1)
    except OSError:
        pass
    return "/var/lib/containers/storage"


def free_bytes(path):
    """(the existing folder of ``path`` nearest it, its free bytes)."""
    while not os.path.isdir(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    st = os.statvfs(path)
    return path, st.f_bavail * st.f_frsize


def room_for(ref, auth, factor=ROOM_FACTOR):
    """{"path", "free_bytes", "need_bytes", "compressed_bytes", "ok"?: True (there is room)},
    or {"unchecked": why} when REF's size cannot be read (the pull then says what is wrong)."""
    try:
        size = compressed_size(ref, auth)
    except (ImageError, ValueError, KeyError, TypeError) as err:
        return {"unchecked": str(err)[:300]}
    path, free = free_bytes(storage_dir())
    need = int(factor * size)
    info = {"path": path, "free_bytes": free, "need_bytes": need, "compressed_bytes": size,
            "factor": factor}
    return info if free < need else dict(info, ok=True)


def pull(args):
    started = time.monotonic()
    ref = args.image
    if args.jitter > 0:
        time.sleep(random.uniform(0, args.jitter))
    if args.if_missing or "@sha256:" in ref:
        found = local_digest(ref)
        if found:
            return {"digest": found[0], "image_id": found[1], "present": True, "pulled": False,
                    "attempts": 0, "retries": [],
                    "seconds": round(time.monotonic() - started, 3)}
    credentials = json.loads(sys.stdin.read() or "null") if args.login_stdin else None
    before = local_digest(ref)   # a tag here already: the pull re-checks it (no layers move)
    host = registry_of(ref)
    retries = []
    wait = args.backoff
    room = None
    for attempt in range(1, args.attempts + 1):
        why, auth = login(host, credentials)
        if why is None and before is None and (room is None or "unchecked" in room):
            room = room_for(ref, auth, args.room_factor)
            if not room.get("ok") and "unchecked" not in room:
                return {"error": no_room_sentence(ref, room), "no_room": room,
                        "attempts": attempt, "retries": retries,
                        "seconds": round(time.monotonic() - started, 3)}
        if why is None:
            code, out = run([docker(), "pull", "-q", ref])
            if code == 0:
                found = local_digest(ref)
                if found is None:
                    raise ImageError(f"pulled {ref}, but docker image inspect does not know it")
                same = before is not None and before[0] == found[0]
                return {"digest": found[0], "image_id": found[1], "present": same,
                        "checked": same, "pulled": not same, "attempts": attempt,
                        "retries": retries, "seconds": round(time.monotonic() - started, 3),
                        "room": room}
            why = out
            if auth is None and refused_anonymous(out):   # no credentials to fetch again
                return {"error": f"{out} (an anonymous pull was refused: name the registry's "
                                 "credentials with the registry_login setting)",
                        "attempts": attempt, "retries": retries,
                        "seconds": round(time.monotonic() - started, 3)}
        retries.append(why)
        if attempt < args.attempts:
            time.sleep(random.uniform(wait / 2, wait))
            wait = min(args.cap, wait * 2)
    return {"error": retries[-1], "attempts": args.attempts, "retries": retries,
            "seconds": round(time.monotonic() - started, 3)}


def refused_anonymous(message):
    text = message.lower()
    return any(w in text for w in ("authentication required", "unauthorized",
                                   "unauthenticated", "access denied", "denied: requested"))


def size_text(n):
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def no_room_sentence(ref, room):
    return (f"{size_text(room['free_bytes'])} free in {room['path']}, and {ref} needs "
            f"{size_text(room['need_bytes'])} there ({room['factor']:g} x its "
            f"{size_text(room['compressed_bytes'])} compressed)")


def digest(args):
    found = local_digest(args.image)
    if not found:
        return {"present": False}
    return {"present": True, "digest": found[0], "image_id": found[1]}


def parse_args(argv):
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("pull")
    p.add_argument("--image", required=True)
    p.add_argument("--if-missing", action="store_true")
    p.add_argument("--attempts", type=int, default=8)
    p.add_argument("--backoff", type=float, default=1.0)
    p.add_argument("--cap", type=float, default=16.0)
    p.add_argument("--jitter", type=float, default=0.0)
    p.add_argument("--login-stdin", action="store_true")
    p.add_argument("--room-factor", type=float, default=ROOM_FACTOR)
    p = sub.add_parser("digest")
    p.add_argument("--image", required=True)
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        result = {"pull": pull, "digest": digest}[args.command](args)
    except ImageError as err:
        result = {"error": str(err)}
    answer("answer", result)
    return 0 if "error" not in result else 1


if __name__ == "__main__":
    os.umask(0o077)
    sys.exit(main())
