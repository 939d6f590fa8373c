"""sshd's AuthorizedKeysCommand on a simulated worker with OS Login on (stdlib only).

Does what the guest's google_authorized_keys does, against the worker's metadata server:
``oslogin/users?username=USER`` gives the login profile (its email and SSH keys), then
``oslogin/authorize?email=E&policy=login`` must succeed; ``policy=adminLogin`` decides
whether the user gets passwordless sudo (a rule in /etc/sudoers.d, written or removed at each
login). Prints the profile's unexpired keys, one per line; prints nothing to refuse.

Run by sshd as root: ``python3 -I -S authorized_keys_command.py %u``.
"""

import json
import os
import re
import socket
import sys
import time
from urllib.parse import quote

METADATA = ("metadata.google.internal", 80)
PREFIX = "/computeMetadata/v1/oslogin/"
USER_NAME = re.compile(r"[a-z_][a-z0-9_.-]{0,31}")
SUDOERS = "/etc/sudoers.d/google_oslogin_{}"  # no '.' in it: sudo reads such files


def get(path):
    """(status, parsed JSON or None) of one metadata request (HTTP/1.0, no proxies)."""
    with socket.create_connection(METADATA, timeout=5) as sock:
        sock.sendall(f"GET {PREFIX}{path} HTTP/1.0\r\nHost: metadata.google.internal\r\n"
                     "Metadata-Flavor: Google\r\n\r\n".encode())
        data = b""
        while True:
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    try:
        return status, json.loads(body)
    except ValueError:
        return status, None


def allowed(email, policy):
    status, answer = get(f"authorize?email={quote(email)}&policy={policy}")
    return status == 200 and isinstance(answer, dict) and answer.get("success") is True


def main(argv):
    if len(argv) != 2 or not USER_NAME.fullmatch(argv[1]):
        return 1
    user = argv[1]
    status, answer = get(f"users?username={quote(user)}")
    if status != 200 or not isinstance(answer, dict) or not answer.get("loginProfiles"):
        return 0  # not an OS Login user (or OS Login is off): no keys from here
    profile = answer["loginProfiles"][0]
    email = profile.get("name", "")
    if not email or not allowed(email, "login"):
        return 0
    sudoers = SUDOERS.format(user)
    if allowed(email, "adminLogin"):
        fd = os.open(sudoers, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o440)
        with os.fdopen(fd, "w") as f:
            f.write(f"{user} ALL=(ALL:ALL) NOPASSWD:ALL\n")
    else:
        try:
            os.unlink(sudoers)
        except FileNotFoundError:
            pass
    now_usec = int(time.time() * 1e6)
    for key in (profile.get("sshPublicKeys") or {}).values():
        expiry = int(key.get("expirationTimeUsec") or 0)
        if key.get("key") and (not expiry or expiry > now_usec):
            print(key["key"].strip())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
