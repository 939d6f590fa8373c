#!/usr/bin/env python3
"""tpufab images, worker side (stdlib only; run as root): pull an image, say its digest.

    image_worker.py pull --image REF [--if-missing] [--attempts N] [--backoff S] [--cap S]
                         [--jitter S] [--login-stdin]
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

Both print one JSON answer: ``{"digest": "sha256:...", "image_id": ..., "present": bool,
"pulled": bool, "attempts": N, "retries": [why, ...], "seconds": S}`` or ``{"error": why,
"attempts": N, "retries": [...]}`` (the registry's own sentence).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
import time
import urllib.request

from tpufab.remote.workerlib import answer

TOKEN_URL = ("http://metadata.google.internal/computeMetadata/v1/instance/service-accounts/"
             "default/token")
COMMAND_TIMEOUT = 1800.0


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
    if credentials is not None:
        user, password = credentials["username"], credentials["password"]
    elif needs_google_token(host):
        try:
            user, password = "oauth2accesstoken", token()
        except ImageError as err:     # retried with the pull: the metadata server may lag
            return str(err)
    else:
        return None
    code, out = run([docker(), "login", "-u", user, "--password-stdin", host],
                    stdin=password.encode(), timeout=60)
    return None if code == 0 else f"login to {host}: {out}"


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
    for attempt in range(1, args.attempts + 1):
        why = login(host, credentials)
        if why is None:
            code, out = run([docker(), "pull", "-q", ref])
            if code == 0:
                found = local_digest(ref)
                if found is None:
                    raise ImageError(f"pulled {ref}, but docker image inspect does not know it")
                same = before is not None and before[0] == found[0]
                return {"digest": found[0], "image_id": found[1], "present": same,
                        "checked": same, "pulled": not same, "attempts": attempt,
                        "retries": retries, "seconds": round(time.monotonic() - started, 3)}
            why = out
        retries.append(why)
        if attempt < args.attempts:
            time.sleep(random.uniform(wait / 2, wait))
            wait = min(args.cap, wait * 2)
    return {"error": retries[-1], "attempts": args.attempts, "retries": retries,
            "seconds": round(time.monotonic() - started, 3)}


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
