"""What a simulated worker is made of, as data: its spec, the host programs it needs, and the
text of its files (sshd_config, /etc/hosts, authorized_keys from metadata ``ssh-keys``). Pure
builders, tested as data; tpufab/sim/workers.py writes them and runs the workers."""

from __future__ import annotations

import base64
import binascii
import json
import os
import re
import shutil
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from tpufab.errors import SimError

INIT_SCRIPT = Path(__file__).with_name("worker_init.py")
# sshd's AuthorizedKeysCommand where OS Login is on (the guest's google_authorized_keys)
KEYS_COMMAND = Path(__file__).with_name("authorized_keys_command.py")
# systemctl and journalctl of a general-purpose VM, whose PID 1 plays systemd (worker_init.py)
VM_SYSTEMCTL = Path(__file__).with_name("vm_systemctl.py")
SYSTEM_PYTHON = "/usr/bin/python3"
STD_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
SSH_PORT = 22
MANAGED_KEY_MARK = "# Added by tpufab sim from metadata ssh-keys"
KEY_TYPES = frozenset({
    "ssh-ed25519", "ssh-rsa", "ssh-dss", "ecdsa-sha2-nistp256", "ecdsa-sha2-nistp384",
    "ecdsa-sha2-nistp521", "sk-ssh-ed25519@openssh.com", "sk-ecdsa-sha2-nistp256@openssh.com",
})
USER_NAME = re.compile(r"[a-z_][a-z0-9_.-]{0,31}")
TPU_PCI_VENDOR = "0x1ae0"  # Google: the vendor of every TPU chip on the PCI bus


@dataclass(frozen=True)
class WorkerSpec:
    node_id: str  # API node id (a digits string)
    index: int  # worker id, 0-based
    ip: str  # loopback address; sshd listens on ip:22
    hostname: str  # t1v-n-<8 hex>-w-<index>
    device_files: tuple[str, ...]  # ("/dev/accel0", ...) or ("/dev/vfio/0", ...)
    pci_device: str = ""  # PCI device id of its TPU chips ("0x005e" for v4); "" = no chips
    netns: str = ""  # a network namespace to start in (sim/network.py); "" = the host's
    vm: bool = False  # a general-purpose VM: no TPU, an init honouring its systemd units


# --- host requirements -------------------------------------------------------------------


@dataclass(frozen=True)
class HostTools:
    unshare: str
    nsenter: str
    setpriv: str
    sshd: str
    sudo: str  # workers use the host's; users from metadata ssh-keys get passwordless sudo
    python: str


_TOOL_PACKAGES = (
    ("unshare", "util-linux"),
    ("nsenter", "util-linux"),
    ("setpriv", "util-linux"),
    ("sshd", "openssh-server"),
    ("sudo", "sudo"),
)


def find_host_tools(
    *, euid: int | None = None, which: Callable[..., str | None] = shutil.which,
    python: str = SYSTEM_PYTHON,
) -> HostTools:
    """The programs workers need, or a SimError saying what is missing and how to get it."""
    if (os.geteuid() if euid is None else euid) != 0:
        raise SimError("The simulated pod needs root for namespaces, mounts and sshd: "
                       "run it as root (for example with sudo).")
    found = {}
    for name, package in _TOOL_PACKAGES:
        path = which(name, path=STD_PATH)
        if path is None:
            raise SimError(f"The simulated pod needs {name}, which is not installed: "
                           f"apt-get install {package}.")
        found[name] = os.path.realpath(path)
    if which(python) is None:
        raise SimError(f"The simulated pod runs {python} inside each worker, which is missing: "
                       "apt-get install python3.")
    return HostTools(python=python, **found)


# --- pure builders -------------------------------------------------------------------------


def parse_ssh_keys(text: str, *, now: datetime | None = None) -> dict[str, list[str]]:
    """Metadata ``ssh-keys`` text -> {user: [public key line, ...]}, in order.

    Lines are ``user:ssh-ed25519 AAAA... comment``; blank, malformed and expired
    (``google-ssh {"expireOn": ...}``) lines are skipped, like the guest agent does.
    """
    now = now or datetime.now(timezone.utc)
    keys: dict[str, list[str]] = {}
    for raw in text.splitlines():
        user, sep, key = raw.strip().partition(":")
        parts = key.split()
        if not sep or not USER_NAME.fullmatch(user) or len(parts) < 2:
            continue
        if parts[0] not in KEY_TYPES or not _is_base64(parts[1]) or _expired(key, now):
            continue
        line = " ".join(parts)
        if line not in keys.setdefault(user, []):
            keys[user].append(line)
    return keys


def _is_base64(text: str) -> bool:
    try:
        return bool(base64.b64decode(text, validate=True))
    except (binascii.Error, ValueError):
        return False


def _expired(key: str, now: datetime) -> bool:
    _, mark, tail = key.partition(" google-ssh ")
    if not mark:
        return False
    try:
        expire_on = json.loads(tail)["expireOn"]
        return datetime.strptime(expire_on, "%Y-%m-%dT%H:%M:%S%z") < now
    except (ValueError, KeyError, TypeError):
        return False


def sshd_config_text(spec: WorkerSpec, *, os_login: bool = False) -> str:
    """The worker's sshd_config; HostKey points into the worker's private /run. With OS Login
    on, keys also come from the OS Login profile (as the guest environment configures it)."""
    keys_command = [
        f"AuthorizedKeysCommand {SYSTEM_PYTHON} -I -S /run/tpufab-worker/{KEYS_COMMAND.name} %u",
        "AuthorizedKeysCommandUser root",
    ] if os_login else []
    return "\n".join([
        f"# tpufab simulated worker {spec.hostname}",
        f"ListenAddress {spec.ip}:{SSH_PORT}",
        "HostKey /run/tpufab-worker/ssh_host_ed25519_key",
        "PidFile none",
        "UsePAM no",
        "PermitRootLogin prohibit-password",
        "PubkeyAuthentication yes",
        "PasswordAuthentication no",
        "KbdInteractiveAuthentication no",
        "AuthorizedKeysFile .ssh/authorized_keys",
        *keys_command,
        "StrictModes yes",
        "UseDNS no",
        "MaxStartups 200",
        "MaxSessions 100",
        "LogLevel ERROR",
        "PrintMotd no",
        "PrintLastLog no",
        "X11Forwarding no",
        "Subsystem sftp internal-sftp",
        "",
    ])


def hosts_text(spec: WorkerSpec, node_specs: Iterable[WorkerSpec]) -> str:
    """/etc/hosts: the worker's own name first, then its node's other workers, then the
    metadata server."""
    # localhost is the worker's own address: the network namespace is shared, and what a TPU VM
    # serves on localhost (libtpu's metrics on :8431, sim/tpumetrics.py) is per worker.
    lines = [f"{spec.ip}\tlocalhost", "::1\tlocalhost ip6-localhost ip6-loopback",
             f"{spec.ip}\t{spec.hostname}"]
    lines += [f"{s.ip}\t{s.hostname}" for s in node_specs if s.index != spec.index]
    # The worker's metadata server (169.254.169.254 on GCE) answers on its own address, port 80.
    lines.append(f"{spec.ip}\tmetadata.google.internal metadata")
    return "\n".join(lines) + "\n"


def fold_workers(indexes: Iterable[int]) -> str:
    """[0, 1, 2, 5] -> 'w[0-2,5]'; [3] -> 'w3'."""
    nums = sorted(set(indexes))
    if len(nums) == 1:
        return f"w{nums[0]}"
    runs: list[str] = []
    start = prev = None
    for n in [*nums, None]:
        if start is not None and n == prev + 1:
            prev = n
            continue
        if start is not None:
            runs.append(str(start) if start == prev else f"{start}-{prev}")
        start = prev = n
    return f"w[{','.join(runs)}]"


def strip_managed_keys(text: str) -> str:
    """authorized_keys without the lines we added (each follows MANAGED_KEY_MARK)."""
    kept, skip = [], False
    for line in text.splitlines():
        if skip:
            skip = False
        elif line == MANAGED_KEY_MARK:
            skip = True
        else:
            kept.append(line)
    return "".join(f"{line}\n" for line in kept)
