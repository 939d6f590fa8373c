"""A simulated worker's installs stay inside it (issue 25, 6): /usr, /etc, /var and /opt are
overlays on the host's, so `sudo pip install`, dpkg's database and /etc change that worker
only; pip installs as on an Ubuntu 22.04 TPU VM (no PEP 668 refusal)."""

from __future__ import annotations

import base64
import hashlib
import io
import os
import shlex
import zipfile

import pytest
from helpers import metadata_keys, ssh_run, unique_name

pytestmark = pytest.mark.sim

PROBES = ("/usr/local/lib/{tag}", "/usr/local/bin/{tag}", "/etc/{tag}",
          "/var/lib/dpkg/info/{tag}.list", "/opt/{tag}", "/srv/{tag}", "/{tag}")


def wheel(name: str) -> bytes:
    """A minimal pure-Python wheel of package ``name`` (import name the same)."""
    files = {f"{name}/__init__.py": b"WHERE = 'installed'\n",
             f"{name}-0.1.dist-info/METADATA":
                 f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n".encode(),
             f"{name}-0.1.dist-info/WHEEL":
                 b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    record = []
    for path, data in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record.append(f"{path},sha256={digest},{len(data)}")
    record.append(f"{name}-0.1.dist-info/RECORD,,")
    files[f"{name}-0.1.dist-info/RECORD"] = ("\n".join(record) + "\n").encode()
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as zf:
        for path, data in files.items():
            zf.writestr(path, data)
    return out.getvalue()


def test_installs_on_a_worker_change_that_worker_only(make_node, ssh_key):
    node = make_node("v4-16", metadata={"ssh-keys": metadata_keys("alice", ssh_key)})
    ips = [e.ip_address for e in node.network_endpoints]
    tag = unique_name("rootfs")
    package = tag.replace("-", "_")

    def on(worker: int, command: str) -> str:
        done = ssh_run(ips[worker], ssh_key, "alice", command, timeout=120)
        assert done.returncode == 0, f"w{worker} {command}: {done.stderr}"
        return done.stdout

    writes = " && ".join(f"sudo -n touch {shlex.quote(p.format(tag=tag))}" for p in PROBES)
    on(0, writes)
    # pip as on Ubuntu 22.04: a wheel installs system-wide with sudo, and for the user without
    whl = f"/tmp/{package}-0.1-py3-none-any.whl"
    shipped = f"echo {base64.b64encode(wheel(package)).decode()} | base64 -d > {whl}"
    on(0, shipped)
    on(0, f"sudo -n python3 -m pip install --no-index --no-deps -q {whl}")
    assert on(0, f"cd / && python3 -c 'import {package}; print({package}.WHERE)'").strip() == \
        "installed"
    on(1, shipped)
    on(1, f"python3 -m pip install --user --no-index --no-deps -q {whl}")

    for path in PROBES:
        path = path.format(tag=tag)
        assert on(0, f"test -e {path} && echo yes").strip() == "yes", path
        assert on(1, f"test -e {path} && echo yes || echo no").strip() == "no", path
        assert not os.path.exists(path), f"{path} reached the host"
    assert on(1, f"cd / && sudo -n python3 -c 'import {package}' 2>&1 || true").find(
        "ModuleNotFoundError") >= 0  # w0's system-wide install is not w1's
    host = __import__("subprocess").run(["/usr/bin/python3", "-c", f"import {package}"],
                                        capture_output=True, text=True, cwd="/")
    assert host.returncode != 0, "a worker's pip install reached the host"
    assert os.path.exists("/usr/lib/python3.11/EXTERNALLY-MANAGED") or not os.path.exists(
        "/usr/lib/python3.11")  # the host keeps its own PEP 668 marker
