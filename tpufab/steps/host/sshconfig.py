"""`tpufab config-ssh`, and the create, delete and recreate hooks that keep it current.

A pod's entries are made from the pod as tpufab connects to it (tpufab.hosts.connect:
the same checks, OS Login user, key in metadata, pinned host keys and bastion), so `ssh
mypod-w3`, scp, rsync, VS Code and Fabric reach exactly the worker, as the user, with the
key and the host key every tpufab verb uses. Workers whose host keys the API did not publish
are reached once here, which pins them (``StrictHostKeyChecking yes`` then holds). The file
itself is tpufab.hosts.sshconfig's.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from tpufab.config import Settings
from tpufab.errors import ConfigError, TpufabError
from tpufab.hosts import sshconfig as files


@dataclass
class SshConfigResult:
    """What config-ssh did to ``path``: the pods whose entries it wrote (``written``, each
    a PodEntries), the pods whose entries it took out (``removed``), the pods it left alone
    and why (``skipped``), and ``notes`` (what OpenSSH will do differently)."""

    path: Path
    written: list[files.PodEntries] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    declined: bool = False  # asked first and told no: nothing written


def configure(settings: Settings, *, name: str | None = None, remove: bool = False,
              confirm: Callable[[str], bool] | None = None, console: Any = None
              ) -> SshConfigResult:
    """Write the entries of pod ``name`` (None: every READY pod in the settings' zone and
    project, and drop the entries of that zone's pods that are gone) into ~/.ssh/config;
    ``remove``: take ``name``'s (None: all of tpufab's) out instead. ``confirm(question)``
    is asked before tpufab's section is first added to the file (None: no question)."""
    path = files.config_path()
    layout = files.parse(files.read_config(path), str(path))  # refused before connecting
    result = SshConfigResult(path=path)
    if remove:
        _apply(settings, path, result, {name: None} if name else {}, remove_all=not name)
        return result
    if not layout.present and confirm is not None and not confirm(
            f"Add SSH entries for your TPU pods (ssh POD, ssh POD-w0 ...) to {path}? Your own "
            "entries stay as they are."):
        result.declined = True
        return result
    changes: dict[str, files.PodEntries | None] = {}
    drop: list[str] = []
    if name:
        changes[name] = pod_entries(replace(settings, name=name), console)
    else:
        from tpufab.cloud import planes

        settings.project = settings.require("project")
        control = planes.control_plane(settings)
        listed = control.list_nodes()
        for node in listed:
            if not node.ready or node.legacy:
                result.skipped.append((node.name, f"it is {node.state}, not READY"))
                continue
            try:
                changes[node.name] = pod_entries(replace(settings, name=node.name), console,
                                                 control=control, nodes=[node])
            except TpufabError as err:
                result.skipped.append((node.name, err.message))
        if not changes and not result.skipped:
            raise ConfigError(f"No TPU node in {settings.zone} (project {settings.project}) "
                              "to write SSH entries for: create one with `tpufab create`, "
                              "or name another zone with --zone.")
        if not changes:
            raise ConfigError(f"No READY TPU node in {settings.zone} (project "
                              f"{settings.project}): "
                              + "; ".join(f"{n}: {why}" for n, why in result.skipped)
                              + ". Wait for one, or pass --name.")
        names = {n.name for n in listed}
        drop = [pod for pod, (project, zone, _lines) in layout.pods.items()
                if project == settings.project and zone == settings.zone and pod not in names]
    _apply(settings, path, result, changes, drop=drop)
    return result


def _apply(settings: Settings, path: Path, result: SshConfigResult,
           changes: dict[str, files.PodEntries | None], *, drop=(),
           remove_all: bool = False) -> None:
    with files.Locked(settings.state_path):
        original = files.read_config(path)  # as it is now
        layout = files.parse(original, str(path))
        gone = sorted(layout.pods) if remove_all else \
            [n for n, e in changes.items() if e is None and n in layout.pods] + \
            [n for n in drop if n in layout.pods]
        text = files.rewrite(layout, changes, drop=drop, remove_all=remove_all)
        if text != original:
            files.write_config(path, text)
    result.removed += gone
    written = [e for e in changes.values() if e is not None]
    result.written += written
    if written:
        result.notes += notes(path, written)


def pod_entries(settings: Settings, console: Any = None, **connect_kwargs: Any
                ) -> files.PodEntries:
    """The entries of pod ``settings.name`` as tpufab connects to it now; its workers'
    host keys pinned (those the API did not publish: by reaching each once)."""
    from tpufab.hosts import connect
    from tpufab.ssh.hostkeys import KnownHosts
    from tpufab.term.console import stderr

    settings = replace(settings, keep_alive="0")  # nothing kept for a config file
    hosts = connect.connect(settings, console=console or stderr(), **connect_kwargs)
    try:
        known = KnownHosts(settings.known_hosts_path)
        targets = hosts.fanout.targets
        unpinned = [w for w, t in targets.items() if not known.lookup(t.key_alias)]
        if unpinned:
            failed = hosts.fanout.open(unpinned).failed
            if failed:
                raise TpufabError(f"Could not reach {hosts.name}'s {failed.summary()} to pin "
                                  "its host key (the API publishes none for it), so `ssh` "
                                  "would refuse it; check `tpufab status`, then run `tpufab "
                                  "config-ssh` again.")
        return files.pod_entries(hosts.name, settings.project or "", settings.zone,
                                 list(targets.values()), known_hosts=settings.known_hosts_path,
                                 key=settings.ssh_key_path)
    finally:
        hosts.close()


def notes(path: Path, written: list[files.PodEntries]) -> list[str]:
    """What the user should know about the file just written: OpenSSH reading another
    file (the passwd entry's home is not $HOME), and values of the user's own entries that
    OpenSSH takes before tpufab's (it keeps the first value it reads)."""
    out = []
    home = files.openssh_home()
    if home is not None and Path(home) / ".ssh" / "config" != path:
        out.append(f"OpenSSH reads {home}/.ssh/config, not {path} ($HOME is {Path.home()}, "
                   f"your passwd entry says {home}): use `ssh -F {path} ...` there; Python "
                   "tools (Fabric, paramiko) read this one.")
    ssh = shutil.which("ssh")
    for pod in written if ssh else ():
        entry = pod.workers[0]
        said = _resolved(ssh, path, pod.name)
        if said is None:
            continue
        wanted = {"hostname": entry.hostname, "user": entry.user, "port": str(entry.port)}
        if entry.host_key_alias:
            wanted["hostkeyalias"] = entry.host_key_alias
        differ = [f"{key} {said.get(key, '(none)')} (tpufab wrote {value})"
                  for key, value in wanted.items() if said.get(key) != value]
        if differ:
            out.append(f"Entries of your own in {path} come before tpufab's for `ssh "
                       f"{pod.name}`: OpenSSH resolves it to {', '.join(differ)}, since it "
                       "keeps the first value it reads; move those lines below tpufab's "
                       "section or under a narrower Host.")
    return out


def _resolved(ssh: str, path: Path, alias: str) -> dict[str, str] | None:
    """``ssh -G``: what OpenSSH makes of ``alias`` with this file (nothing is dialled)."""
    try:
        done = subprocess.run([ssh, "-G", "-F", str(path), alias], capture_output=True,
                              text=True, timeout=10, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if done.returncode != 0:
        return None
    said: dict[str, str] = {}
    for line in done.stdout.splitlines():
        key, _, value = line.partition(" ")
        said.setdefault(key.lower(), value.strip())
    return said


def keep_current(settings: Settings, console: Any = None, *, gone: bool = False) -> None:
    """After a create, a recreate (``gone`` False) or a delete (``gone``): the pod's entries
    in ~/.ssh/config follow it, where `tpufab config-ssh` put tpufab's section there and the
    ``ssh_config`` setting is ``auto``. Never fails the create or delete: a problem is one
    line saying so."""
    if str(settings.ssh_config).lower() == "off" or not settings.name:
        return
    from tpufab.term.console import stderr

    console = console or stderr()
    path = files.config_path()
    try:
        layout = files.parse(files.read_config(path), str(path))
        if not layout.present or (gone and settings.name not in layout.pods):
            return
        result = SshConfigResult(path=path)
        entries = None if gone else pod_entries(settings, console)
        _apply(settings, path, result, {settings.name: entries})
    except (TpufabError, OSError) as err:
        console.print(f"Did not update {path} for {settings.name}: "
                      f"{getattr(err, 'message', None) or err}", style="yellow", markup=False,
                      highlight=False)
        return
    if gone:
        said = f"Removed {settings.name}'s SSH entries from {path}."
    else:
        said = (f"Updated {settings.name}'s SSH entries in {path}: "
                f"{' '.join(entries.aliases)}.")
    console.print(said, style="dim", markup=False, highlight=False)
    for line in result.notes:
        console.print(line, style="yellow", markup=False, highlight=False)
