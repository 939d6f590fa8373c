"""Worker host keys pinned per node id in tpufab's own known_hosts.

Each worker is stored under the alias ``tpufab-{node_id}-w{worker}`` in OpenSSH known_hosts
format, so the system ``ssh`` can use the same file (:meth:`KnownHosts.ssh_options`). Keys come
from the API's guest attributes (:meth:`KnownHosts.pin`) or, failing that, are trusted on
first use. A different key under the same alias is an error that says how to clear it; a
recreated node has a new id and therefore starts fresh. Nothing is ever accepted blindly.
"""

from __future__ import annotations

import base64
import fcntl
import functools
import os
import re
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from tpufab.errors import TpufabError

if TYPE_CHECKING:  # paramiko loads with the first handshake, not with the pins (a command
    import paramiko  # through kept connections never needs it: tpufab.ssh.keeper)

DEFAULT_PATH = "~/.tpufab/known_hosts"
FROM_API = "from-cloud-api"    # the comment of a line whose key the API published
_SAFE = re.compile(r"[^A-Za-z0-9_.-]")


class HostKeyChanged(TpufabError):
    """A worker presented a key that differs from the one pinned for its node id."""


def alias(node_id: str, worker: int, host_id: str = "") -> str:
    """The known_hosts name of one worker of one node: ``tpufab-1234-w3``; of a Compute
    Engine MIG's VM, by its own instance id (``tpufab-1234-vm5678``), since a MIG recreates
    a VM (a new disk, a new host key) under the same group id and may renumber it."""
    if host_id:
        return f"tpufab-{_SAFE.sub('_', str(node_id))}-vm{_SAFE.sub('_', str(host_id))}"
    return f"tpufab-{_SAFE.sub('_', str(node_id))}-w{worker}"


def _parse_key(text: str) -> tuple[str, str]:
    parts = text.split()
    if len(parts) < 2:
        raise ValueError(f"not a public key line: {text!r}")
    base64.b64decode(parts[1], validate=True)
    return parts[0], parts[1]


def fingerprint(blob: str) -> str:
    """OpenSSH's fingerprint of a base64 key blob: ``SHA256:...`` (no padding)."""
    import hashlib

    digest = hashlib.sha256(base64.b64decode(blob)).digest()
    return "SHA256:" + base64.b64encode(digest).decode().rstrip("=")


class KnownHosts:
    """A known_hosts file owned by tpufab. Thread- and process-safe (lock + atomic rewrite)."""

    def __init__(self, path: str | os.PathLike[str] | None = None, *, forget_hint: str | None = None):
        self.path = Path(os.path.expanduser(str(path or DEFAULT_PATH)))
        self.forget_hint = forget_hint or "tpufab known-hosts forget {node}"
        self._lock = threading.Lock()
        # The file parsed once per version of it (inode, size, mtime): every worker's
        # connection looks its key up, so reading the whole file each time would make a
        # connect to N workers cost N x (every worker of every node pinned here).
        self._cache_guard = threading.Lock()
        self._cached: tuple[tuple[int, int, int], list, dict] | None = None

    # -- storage -------------------------------------------------------------------------
    def _parsed(self) -> tuple[list[tuple[str, str, str]], dict[str, list[tuple[str, str]]]]:
        """(entries in file order, alias -> [(keytype, base64)]) of the file as it is now."""
        try:
            st = self.path.stat()
        except FileNotFoundError:
            return [], {}
        version = (st.st_ino, st.st_size, st.st_mtime_ns)
        with self._cache_guard:
            if self._cached is not None and self._cached[0] == version:
                return self._cached[1], self._cached[2]
        try:
            text = self.path.read_text()
        except FileNotFoundError:
            return [], {}
        entries: list[tuple[str, str, str]] = []
        index: dict[str, list[tuple[str, str]]] = {}
        origins: dict[str, str] = {}
        for line in text.splitlines():
            parts = line.split()
            if len(parts) >= 3 and not line.startswith("#"):
                entries.append((parts[0], parts[1], parts[2]))
                index.setdefault(parts[0], []).append((parts[1], parts[2]))
                if len(parts) >= 4 and parts[3] == FROM_API:
                    origins[parts[0]] = FROM_API
        with self._cache_guard:  # stat before read: a change meanwhile shows as a new version
            self._cached = (version, entries, index)
            self._origins = origins
        return entries, index

    def _origin(self, host_alias: str) -> str | None:
        """How the key pinned for ``host_alias`` was learned: FROM_API, or None (first use)."""
        self._parsed()
        return getattr(self, "_origins", {}).get(host_alias)

    def _read(self) -> list[tuple[str, str, str]]:
        return list(self._parsed()[0])

    def _update(self, change, learned: Mapping[str, str] | None = None) -> None:
        """Apply ``change(entries) -> entries`` under a thread lock and an flock
        (``learned``: alias -> how its new key was learned, kept as the line's comment)."""
        self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        with self._lock, open(self.path.with_suffix(".lock"), "a") as lock_file:
            fcntl.flock(lock_file, fcntl.LOCK_EX)
            entries = self._read()
            origins = {**getattr(self, "_origins", {}), **(learned or {})}
            updated = change(entries)
            if updated is None or updated == entries:
                return
            tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.{threading.get_ident()}")
            tmp.write_text("".join(f"{a} {t} {k}" + (f" {origins[a]}" if a in origins else "")
                                   + "\n" for a, t, k in updated))
            os.chmod(tmp, 0o600)
            os.replace(tmp, self.path)

    def lookup(self, host_alias: str) -> list[tuple[str, str]]:
        """``[(keytype, base64)]`` pinned for ``host_alias``."""
        return list(self._parsed()[1].get(host_alias, ()))

    # -- operations ----------------------------------------------------------------------
    def pin(self, node_id: str, keys: Mapping[int, str]) -> None:
        """Pin keys learned from the API (``{worker: "ssh-ed25519 AAAA..."}``)."""
        self.pin_aliases({alias(node_id, w): k for w, k in keys.items()})

    def pin_aliases(self, keys: Mapping[str, str]) -> None:
        """Pin keys learned from the API (``{alias: "ssh-ed25519 AAAA..."}``)."""
        wanted = {name: _parse_key(k) for name, k in keys.items()}

        def change(entries):
            current = {}
            for a, t, k in entries:
                current.setdefault((a, t), k)
            for name, (ktype, key) in wanted.items():
                old = current.get((name, ktype))
                if old is not None and old != key:
                    raise self._changed_error(name, ktype)
            new = [(n, t, k) for n, (t, k) in wanted.items() if (n, t) not in current]
            return entries + new if new else None

        self._update(change, learned={name: FROM_API for name in wanted})

    def forget(self, node_id: str) -> int:
        """Drop every key pinned for ``node_id`` (its workers' and its VMs'); returns how
        many lines were removed."""
        prefix = alias(node_id, 0)[: -len("w0")]
        removed = 0

        def change(entries):
            nonlocal removed
            kept = [e for e in entries if not e[0].startswith(prefix)]
            removed = len(entries) - len(kept)
            return kept

        self._update(change)
        return removed

    def forget_alias(self, host_alias: str) -> int:
        """Drop every key pinned under exactly ``host_alias``; how many lines went."""
        removed = 0

        def change(entries):
            nonlocal removed
            kept = [e for e in entries if e[0] != host_alias]
            removed = len(entries) - len(kept)
            return kept if removed else None

        self._update(change)
        return removed

    def verify(self, host_alias: str, key: paramiko.PKey) -> None:
        """Accept ``key`` for ``host_alias`` if pinned, pin it if unknown (TOFU), else raise."""
        self.verify_blob(host_alias, key.get_name(), key.get_base64())

    def verify_blob(self, host_alias: str, ktype: str, blob: str,
                    pinned: list[tuple[str, str]] | None = None) -> None:
        """:meth:`verify` for a key given as its type and base64 blob (libssh2's). ``pinned``:
        what :meth:`lookup` said for ``host_alias`` a moment ago (a match there needs no
        second look at the file)."""
        if pinned and (ktype, blob) in pinned:
            return

        def change(entries):
            current = [(t, k) for a, t, k in entries if a == host_alias]
            if (ktype, blob) in current:
                return None
            if current:
                raise self._changed_error(host_alias, ktype)
            return entries + [(host_alias, ktype, blob)]

        # Fast path without the file lock: a pinned match needs no write.
        if (ktype, blob) in self.lookup(host_alias):
            return
        self._update(change)

    def policy(self, host_alias: str) -> paramiko.MissingHostKeyPolicy:
        """A paramiko policy that checks the server's key against ``host_alias``."""
        return _policy_class()(self, host_alias)

    def ssh_options(self, host_alias: str) -> list[str]:
        """OpenSSH ``-o`` options that make the system ``ssh`` use this file and alias."""
        return [
            "-o", f"HostKeyAlias={host_alias}",
            "-o", f"UserKnownHostsFile={self.path}",
            "-o", "GlobalKnownHostsFile=/dev/null",
            "-o", "StrictHostKeyChecking=accept-new",
            "-o", "HashKnownHosts=no",  # Debian hashes by default; forget() matches plain names
        ]

    def _changed_error(self, host_alias: str, ktype: str) -> HostKeyChanged:
        node, _, worker = host_alias.removeprefix("tpufab-").rpartition("-w")
        who = f"worker {worker} of node {node}" if node else host_alias
        if "-vm" in host_alias and not worker.isdigit():
            node, _, vm = host_alias.removeprefix("tpufab-").rpartition("-vm")
            who = f"VM {vm} of node {node}"
        pinned = (f"the one the cloud API published for it (its guest attributes), pinned "
                  f"in {self.path}") if self._origin(host_alias) == FROM_API else \
            f"the one pinned in {self.path}"
        return HostKeyChanged(
            f"The {ktype} host key of {who} differs from {pinned} "
            "(someone may be intercepting the connection, or the worker was rebuilt under the "
            f"same node id); if the change is expected, run `{self.forget_hint.format(node=node or host_alias)}` "
            f"or delete the lines starting with {host_alias.rpartition('-w')[0] or host_alias} from {self.path}."
        )


@functools.cache
def _policy_class():
    import paramiko

    class PinnedKeyPolicy(paramiko.MissingHostKeyPolicy):
        """paramiko calls this for every connection (the client's own host-key table is
        empty)."""

        def __init__(self, known_hosts: KnownHosts, host_alias: str):
            self.known_hosts = known_hosts
            self.host_alias = host_alias

        def missing_host_key(self, client, hostname, key) -> None:
            self.known_hosts.verify(self.host_alias, key)

    return PinnedKeyPolicy
