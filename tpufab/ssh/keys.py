"""The tpufab SSH key and node metadata `ssh-keys` entries.

On a TPU VM the guest agent copies the node metadata `ssh-keys` (lines
`user:ssh-ed25519 AAAA... comment`) into `~user/.ssh/authorized_keys`; putting our key there is
how workers become reachable without `gcloud ssh`.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from tpufab.errors import ConfigError

SSH_KEYS = "ssh-keys"


def ensure_key(path: Path | str) -> str:
    """The public key (`ssh-ed25519 AAAA... comment`) of the key at ``path``, generating it if absent.

    The private key is written 0600 and atomically (two tpufab processes starting at once
    end up with the same key); the `.pub` file sits beside it.
    """
    path = Path(path).expanduser()
    pub_path = path.with_name(path.name + ".pub")
    if not path.exists():
        _generate(path)
    if pub_path.is_file():
        text = pub_path.read_text().strip()
        if text:
            return text
    public = _public_from_private(path)
    _write_atomic(pub_path, (public + "\n").encode(), 0o644)
    return public


def _generate(path: Path) -> None:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    key = Ed25519PrivateKey.generate()
    private = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH,
                                serialization.NoEncryption())
    public = key.public_key().public_bytes(serialization.Encoding.OpenSSH,
                                           serialization.PublicFormat.OpenSSH).decode()
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        # link() refuses to replace: whoever links first wins and everyone uses that key.
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
        try:
            os.fchmod(fd, 0o600)
            os.write(fd, private)
            os.close(fd)
            os.link(tmp, path)
        except FileExistsError:
            return
        finally:
            os.unlink(tmp)
        _write_atomic(path.with_name(path.name + ".pub"), f"{public} tpufab\n".encode(), 0o644)
    except PermissionError as err:
        raise ConfigError(f"Cannot create the tpufab SSH key at {path} ({err.strerror}); "
                          "set ssh_key (TPUFAB_SSH_KEY) to a writable path.") from None


def _public_from_private(path: Path) -> str:
    from cryptography.hazmat.primitives import serialization

    try:
        key = serialization.load_ssh_private_key(path.read_bytes(), password=None)
    except (ValueError, TypeError) as err:
        raise ConfigError(f"Cannot read the SSH key {path} ({err}); it must be an unencrypted "
                          "OpenSSH private key with a .pub file beside it.") from None
    return key.public_key().public_bytes(serialization.Encoding.OpenSSH,
                                         serialization.PublicFormat.OpenSSH).decode()


def _write_atomic(path: Path, data: bytes, mode: int) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        os.fchmod(fd, mode)
        os.write(fd, data)
        os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def metadata_entry(user: str, pubkey: str) -> str:
    """`user:ssh-ed25519 AAAA... user`, the line format of node metadata `ssh-keys`."""
    parts = pubkey.split()
    if len(parts) < 2:
        raise ConfigError(f"{pubkey[:40]!r} is not an SSH public key (expected `TYPE BASE64 ...`).")
    return f"{user}:{parts[0]} {parts[1]} {user}"


def _identity(line: str) -> tuple[str, str] | None:
    """(user, key blob) of one `ssh-keys` line, or None for blank/garbled lines."""
    user, sep, rest = line.strip().partition(":")
    parts = rest.split()
    if not sep or len(parts) < 2:
        return None
    return user, parts[1]


def has_entry(ssh_keys: str | None, entry: str) -> bool:
    """Is ``entry`` (same user, same key) already in an `ssh-keys` value?"""
    wanted = _identity(entry)
    return any(_identity(line) == wanted for line in (ssh_keys or "").splitlines())


def merge_entry(ssh_keys: str | None, entry: str) -> str:
    """``ssh_keys`` with ``entry`` appended unless already there; other keys are kept as they are."""
    if has_entry(ssh_keys, entry):
        return ssh_keys or ""
    lines = [line for line in (ssh_keys or "").splitlines() if line.strip()]
    return "\n".join([*lines, entry])
