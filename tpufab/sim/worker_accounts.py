"""A simulated worker's accounts, as files on its disk changed in place (they are bind-mounted
into the running worker by inode): users from metadata ``ssh-keys`` and OS Login profiles, the
``google-sudoers`` group, each user's authorized_keys, the worker's host key."""

from __future__ import annotations

import os
import pwd
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from tpufab.sim.worker_files import MANAGED_KEY_MARK, USER_NAME, strip_managed_keys

SUDOERS_GROUP = "google-sudoers"  # as the guest environment names it on real TPU VMs
SUDOERS_RULE = f"%{SUDOERS_GROUP} ALL=(ALL:ALL) NOPASSWD:ALL\n"


@dataclass(frozen=True)
class Account:
    name: str
    uid: int
    gid: int
    home: str


def host_user(name: str) -> bool:
    try:
        pwd.getpwnam(name)
        return True
    except KeyError:
        return False


def read_passwd(path: Path) -> dict[str, Account]:
    accounts = {}
    for line in path.read_text().splitlines():
        fields = line.split(":")
        if len(fields) >= 7 and fields[2].isdigit() and fields[3].isdigit():
            accounts[fields[0]] = Account(fields[0], int(fields[2]), int(fields[3]), fields[5])
    return accounts


def _append(path: Path, line: str) -> None:
    # Append, never replace: the file is bind-mounted into the running worker by inode.
    with open(path, "a") as f:
        f.write(line + "\n")


def ensure_users(etc: Path, users: list[str], uids: dict[str, int]) -> dict[str, Account]:
    accounts = read_passwd(etc / "passwd")
    groups = {line.split(":")[0] for line in (etc / "group").read_text().splitlines()}
    for user in users:
        if user in accounts or user not in uids:
            continue
        uid = uids[user]
        _append(etc / "passwd", f"{user}:x:{uid}:{uid}::/home/{user}:/bin/bash")
        if user not in groups:
            _append(etc / "group", f"{user}:x:{uid}:")
        # '*' (no password) rather than '!' (locked): without PAM, sshd refuses locked accounts.
        _append(etc / "shadow", f"{user}:*:{int(time.time() // 86400)}:0:99999:7:::")
        accounts[user] = Account(user, uid, uid, f"/home/{user}")
    return accounts


def ensure_os_login_users(wdir: Path, accounts: list[dict]) -> None:
    """The POSIX accounts of OS Login profiles, with their uid and a home (pam_mkhomedir's
    job on a real VM); sudo is decided at each login (authorized_keys_command.py)."""
    etc = wdir / "etc"
    existing = read_passwd(etc / "passwd")
    for account in accounts:
        name = str(account.get("username", ""))
        if not USER_NAME.fullmatch(name) or not str(account.get("uid", "")).isdigit():
            continue
        if name not in existing:
            existing.update(ensure_users(etc, [name], {name: int(account["uid"])}))
        home = host_home(wdir, existing[name].home)
        if home is not None and not home.exists():
            make_home(home, existing[name])


def make_home(home: Path, account: Account) -> None:
    shutil.copytree("/etc/skel", home, symlinks=True)
    for path in (home, *home.rglob("*")):
        os.lchown(path, account.uid, account.gid)
    os.chmod(home, 0o750)


def ensure_sudoers(etc: Path, users: list[str], gid: int) -> None:
    """Every metadata user is in google-sudoers (passwordless sudo), as on a real TPU VM."""
    path = etc / "group"
    lines = path.read_text().splitlines()
    for i, line in enumerate(lines):
        fields = line.split(":")
        if fields[0] == SUDOERS_GROUP and len(fields) == 4:
            members = [m for m in fields[3].split(",") if m]
            missing = [u for u in users if u not in members]
            if not missing:
                return
            fields[3] = ",".join(members + missing)
            lines[i] = ":".join(fields)
            break
    else:
        lines.append(f"{SUDOERS_GROUP}:x:{gid}:{','.join(users)}")
    # Rewrite in place (same inode): the file is bind-mounted into the running worker.
    with open(path, "r+") as f:
        f.write("".join(f"{line}\n" for line in lines))
        f.truncate()


def host_home(wdir: Path, home: str) -> Path | None:
    if home == "/root":
        return wdir / "root"
    if home.startswith("/home/") and "/" not in home[6:] and home[6:] not in ("", ".", ".."):
        return wdir / "home" / home[6:]
    return None  # e.g. /nonexistent: not on the worker's own disk


def sync_authorized_keys(wdir: Path, account: Account, keys: list[str]) -> None:
    home = host_home(wdir, account.home)
    if home is None:
        return
    # Users own these directories inside the worker: never follow a link they may have planted.
    if not home.exists():
        if not keys:
            return
        make_home(home, account)
    ssh_dir = home / ".ssh"
    if home.is_symlink() or ssh_dir.is_symlink():
        return
    if not ssh_dir.exists():
        if not keys:
            return
        ssh_dir.mkdir(mode=0o700)
        os.chown(ssh_dir, account.uid, account.gid)
    target = ssh_dir / "authorized_keys"
    old = "" if not target.exists() or target.is_symlink() else target.read_text()
    new = strip_managed_keys(old) + "".join(f"{MANAGED_KEY_MARK}\n{k}\n" for k in keys)
    if new == old and target.exists() and not target.is_symlink():
        return
    tmp = ssh_dir / ".authorized_keys.tpufab"
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(new)
    os.chown(tmp, account.uid, account.gid)
    os.replace(tmp, target)


def make_host_key(path: Path, comment: str) -> None:
    # cryptography comes with paramiko (fabric); in-process, this is 200x faster than ssh-keygen
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    key = Ed25519PrivateKey.generate()
    private = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH,
                                serialization.NoEncryption())
    public = key.public_key().public_bytes(serialization.Encoding.OpenSSH,
                                           serialization.PublicFormat.OpenSSH)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(private)
    path.with_name(path.name + ".pub").write_bytes(public + f" {comment}\n".encode())


def exe(pid: int) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/exe")
    except OSError:
        return None
