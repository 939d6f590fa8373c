"""tpufab's entries in ``~/.ssh/config``: every SSH tool a user already has reaches the pod.

`tpufab config-ssh` writes one ``Host`` block per worker (``<pod>-w<N>``, and ``<pod>`` for
worker 0) between tpufab's own marker lines, as `gcloud compute config-ssh` does: into the
file itself, not through an ``Include`` (paramiko, so Fabric, ignores ``Include``:
paramiko#1609). Everything outside the markers is the user's and is written back byte for
byte. Each block says exactly how tpufab connects (tpufab.hosts.connect's targets): the
address, the login user (the OS Login user where OS Login is on), tpufab's key, the host key
pinned for that worker in tpufab's known_hosts (``StrictHostKeyChecking yes``), the jump host
as a ``ProxyJump`` of its own block, and a keepalive. Paths are absolute: OpenSSH takes
``~`` from the passwd entry, Python from ``$HOME``, and they can differ.

Here: the blocks as data (``pod_entries``, ``block_lines``), the file parsed into the user's
text and tpufab's section (``parse``), the section rewritten (``rewrite``), all pure; then the
checks that make a write safe and the write itself (``read_config``, ``write_config``).
"""

from __future__ import annotations

import fcntl
import glob
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tpufab.errors import ConfigError

BEGIN = "# >>> tpufab: SSH entries of your TPU pods, written by `tpufab config-ssh`; " \
        "edits between these lines are replaced >>>"
END = "# <<< tpufab <<<"
_BEGIN_RE = re.compile(r"^\s*#\s*>>>\s*tpufab\b")
_END_RE = re.compile(r"^\s*#\s*<<<\s*tpufab\b")
_POD_RE = re.compile(r"^# tpufab pod (?P<name>\S+) project=(?P<project>\S*) zone=(?P<zone>\S*)")
_KEYWORD_RE = re.compile(r"^\s*([A-Za-z]+)(?:\s*=\s*|\s+|$)(.*)$")
SERVER_ALIVE_INTERVAL = 30  # as tpufab's own connections to a bastion (tpufab.ssh.jump)


@dataclass(frozen=True)
class HostEntry:
    """One ``Host`` block: the names it answers to and how to reach that machine."""

    names: tuple[str, ...]
    hostname: str
    user: str
    port: int
    identity_file: str
    known_hosts: str
    host_key_alias: str | None = None   # the worker's pin in tpufab's known_hosts
    proxy_jump: str | None = None       # the jump host's own block's name


@dataclass(frozen=True)
class PodEntries:
    """A pod's blocks: its workers in tpufab's worker order, and its jump host's."""

    name: str
    project: str
    zone: str
    workers: tuple[HostEntry, ...]
    jump: HostEntry | None = None

    @property
    def aliases(self) -> list[str]:
        return [n for e in self.entries for n in e.names]

    @property
    def entries(self) -> tuple[HostEntry, ...]:
        return ((self.jump,) if self.jump else ()) + self.workers


def worker_alias(pod: str, worker: int) -> str:
    return f"{pod}-w{worker}"


def jump_alias(pod: str) -> str:
    return f"{pod}-jump"


def pod_entries(name: str, project: str, zone: str, targets: Sequence, *, known_hosts: Path,
                key: Path | None = None) -> PodEntries:
    """The blocks of pod ``name`` from the targets tpufab connects to (tpufab.ssh.fanout's
    Target: ``worker``, ``host``, ``user``, ``port``, ``key_filename``, ``host_key_alias``,
    ``jump``), in worker order; paths made absolute."""
    known = str(Path(known_hosts).expanduser().absolute())
    ordered = sorted(targets, key=lambda t: t.worker)
    jump = next((t.jump for t in ordered if t.jump is not None), None)
    jump_entry = None
    if jump is not None:
        jump_entry = HostEntry(names=(jump_alias(name),), hostname=jump.host, user=jump.user,
                               port=jump.port, identity_file=_absolute(jump.key_filename, key),
                               known_hosts=known)
    workers = tuple(HostEntry(
        names=((name,) if i == 0 else ()) + (worker_alias(name, t.worker),),
        hostname=t.host, user=t.user, port=t.port,
        identity_file=_absolute(t.key_filename, key), known_hosts=known,
        host_key_alias=t.host_key_alias,
        proxy_jump=jump_alias(name) if t.jump is not None else None)
        for i, t in enumerate(ordered))
    return PodEntries(name=name, project=project, zone=zone, workers=workers, jump=jump_entry)


def _absolute(path: str | None, default: Path | None) -> str:
    chosen = path or (str(default) if default else None)
    if not chosen:
        raise ConfigError("No SSH key to write into ~/.ssh/config; set ssh_key (default "
                          "~/.ssh/tpufab_ed25519).")
    return str(Path(chosen).expanduser().absolute())


def _value(text: str) -> str:
    """One ssh_config value: ``%`` doubled (ssh expands %-tokens in paths), quoted when it
    holds a space; a value no ssh_config can hold is one sentence."""
    if any(c in text for c in '"\n\r\t\0'):
        raise ConfigError(f"{text!r} cannot be written into ~/.ssh/config (a quote or control "
                          "character in it); choose a path without one (the ssh_key and "
                          "known_hosts settings).")
    text = text.replace("%", "%%")
    return f'"{text}"' if " " in text else text


def entry_lines(entry: HostEntry) -> list[str]:
    lines = [f"Host {' '.join(entry.names)}",
             f"    HostName {entry.hostname}",
             f"    Port {entry.port}",
             f"    User {entry.user}",
             f"    IdentityFile {_value(entry.identity_file)}",
             "    IdentitiesOnly yes"]
    if entry.host_key_alias:
        lines.append(f"    HostKeyAlias {entry.host_key_alias}")
    lines += [f"    UserKnownHostsFile {_value(entry.known_hosts)}",
              "    StrictHostKeyChecking yes",
              f"    ServerAliveInterval {SERVER_ALIVE_INTERVAL}"]
    if entry.proxy_jump:
        lines.append(f"    ProxyJump {entry.proxy_jump}")
    return lines


def block_lines(pod: PodEntries) -> list[str]:
    """A pod's part of tpufab's section: its header line, then each block."""
    count = len(pod.workers)
    lines = [f"# tpufab pod {pod.name} project={pod.project} zone={pod.zone}: "
             f"{count} worker{'s' if count != 1 else ''}"]
    for entry in pod.entries:
        lines += entry_lines(entry)
    return lines


# ---------------------------------------------------------------------------------------------
# The file: the user's lines, tpufab's section, and where a new section goes
# ---------------------------------------------------------------------------------------------


@dataclass
class Layout:
    """``~/.ssh/config`` as the user's lines before and after tpufab's section (kept as they
    are, line endings too) and the section's pods: {name: (project, zone, lines)}."""

    before: list[str]
    after: list[str]
    pods: dict[str, tuple[str, str, list[str]]] = field(default_factory=dict)
    present: bool = False  # the file has tpufab's section (config-ssh ran here)

    def where(self, name: str) -> tuple[str, str] | None:
        found = self.pods.get(name)
        return (found[0], found[1]) if found else None


def _keyword(line: str) -> str:
    stripped = line.strip()
    if not stripped or stripped.startswith("#"):
        return ""
    m = _KEYWORD_RE.match(stripped)
    return m.group(1).lower() if m else ""


def parse(text: str, path: str = "~/.ssh/config") -> Layout:
    """The file's layout; ConfigError (one sentence, naming lines) where tpufab's markers are
    broken, doubled or out of order, or where the user's own directives follow the section
    with no Host line of their own (OpenSSH would read them as part of tpufab's last entry)."""
    lines = text.splitlines(keepends=True)
    begins = [i for i, line in enumerate(lines) if _BEGIN_RE.match(line)]
    ends = [i for i, line in enumerate(lines) if _END_RE.match(line)]
    fix = (f"fix or delete tpufab's marker lines in {path} by hand (or the whole section, "
           "then run `tpufab config-ssh` again)")
    if len(begins) > 1 or len(ends) > 1:
        which = begins if len(begins) > 1 else ends
        raise ConfigError(f"{path} has tpufab's {'begin' if which is begins else 'end'} "
                          f"marker more than once (lines {', '.join(str(i + 1) for i in which)}), "
                          f"so tpufab cannot tell its entries from yours: {fix}.")
    if bool(begins) != bool(ends):
        line, what = (begins[0], "begin marker has no end marker") if begins else \
            (ends[0], "end marker has no begin marker")
        raise ConfigError(f"In {path}, tpufab's {what} (line {line + 1}), so tpufab cannot "
                          f"tell its entries from yours: {fix}.")
    if not begins:
        return Layout(before=lines, after=[])
    start, end = begins[0], ends[0]
    if end < start:
        raise ConfigError(f"In {path}, tpufab's end marker (line {end + 1}) comes before its "
                          f"begin marker (line {start + 1}): {fix}.")
    layout = Layout(before=lines[:start], after=lines[end + 1:], present=True)
    current: list[str] | None = None
    for line in lines[start + 1:end]:
        m = _POD_RE.match(line)
        if m:
            current = []
            layout.pods[m.group("name")] = (m.group("project"), m.group("zone"), current)
        if current is not None:
            current.append(line.rstrip("\r\n"))
    for offset, line in enumerate(layout.after):
        word = _keyword(line)
        if word in ("host", "match"):
            break
        if word:
            raise ConfigError(
                f"Line {end + 2 + offset} of {path} ({line.strip()!r}) follows tpufab's "
                "section without a Host line of its own, so OpenSSH reads it as part of "
                "tpufab's last entry: move it above the section, or under a Host line.")
    return layout


def _insert_at(lines: Sequence[str]) -> int:
    """Where a new section goes: before the user's first Host or Match block (and the
    comments right above it), after the global lines, so the user's global options stay
    global and tpufab's entries come before any catch-all ``Host *``."""
    for i, line in enumerate(lines):
        if _keyword(line) in ("host", "match"):
            while i > 0 and lines[i - 1].strip().startswith("#"):
                i -= 1
            return i
    return len(lines)


def rewrite(layout: Layout, changes: Mapping[str, PodEntries | None], *,
            drop: Iterable[str] = (), remove_all: bool = False) -> str:
    """The file's new text: ``changes`` {pod: its entries, or None to take them out}, the
    pods in ``drop`` taken out too; ``remove_all`` takes the whole section out. The user's
    lines are kept exactly; a section left without pods goes, markers and all, with the
    blank line that set it off."""
    pods = {} if remove_all else {n: p for n, p in layout.pods.items() if n not in set(drop)}
    for name, entries in changes.items():
        if entries is None:
            pods.pop(name, None)
        else:
            pods[name] = (entries.project, entries.zone, block_lines(entries))
    _refuse_clashes(pods)
    before, after = list(layout.before), list(layout.after)
    if not layout.present:
        at = _insert_at(before)
        before, after = before[:at], before[at:]
        if before and not before[-1].endswith(("\n", "\r")):
            before[-1] += "\n"
    if not pods:  # the section goes, and the blank line it was set off with
        if layout.present and after and not after[0].strip() and \
                (not before or not before[-1].strip()):
            after = after[1:]
        elif layout.present and not after and before and not before[-1].strip():
            before = before[:-1]
        return "".join(before + after)
    section = [BEGIN]
    for name in sorted(pods):
        section += pods[name][2]
    section.append(END)
    if before and before[-1].strip() and not layout.present:
        section.insert(0, "")
    if after and after[0].strip() and not layout.present:
        section.append("")
    return "".join(before) + "\n".join(section) + "\n" + "".join(after)


def _refuse_clashes(pods: Mapping[str, tuple[str, str, list[str]]]) -> None:
    """Two pods whose names collide (pod ``a``'s ``a-w1`` and a pod called ``a-w1``)."""
    seen: dict[str, str] = {}
    for name, (_project, _zone, lines) in pods.items():
        for line in lines:
            if line.startswith("Host "):
                for alias in line.split()[1:]:
                    if alias in seen and seen[alias] != name:
                        raise ConfigError(
                            f"Pods {seen[alias]} and {name} would both be `ssh {alias}`; "
                            f"remove one's entries (`tpufab config-ssh --remove --name "
                            f"{name}`) or rename a pod.")
                    seen[alias] = name


# ---------------------------------------------------------------------------------------------
# Reading and writing the file safely
# ---------------------------------------------------------------------------------------------


def config_path() -> Path:
    """``$HOME/.ssh/config``: the file paramiko (Fabric) and tpufab read."""
    return Path.home() / ".ssh" / "config"


def openssh_home() -> Path | None:
    """The passwd entry's home (OpenSSH's ``~``), when it is not ``$HOME``."""
    import pwd

    try:
        home = Path(pwd.getpwuid(os.getuid()).pw_dir)
    except KeyError:
        return None
    return None if home.absolute() == Path.home().absolute() else home


def read_config(path: Path) -> str:
    """The file's text ("" when there is none); ConfigError, one sentence, where tpufab
    cannot write into it safely: a symlink (it would write into the file it points to, often
    a dotfiles repository's), not a regular file, unreadable, not UTF-8, or tpufab's
    section inside a file it ``Include``s (tpufab only writes ~/.ssh/config itself)."""
    off = "or set `ssh_config: off` and keep your own entries"
    if path.is_symlink():
        raise ConfigError(f"{path} is a symlink (to {os.readlink(path)}), so tpufab does not "
                          f"write into it: make it a regular file to let `tpufab config-ssh` "
                          f"keep its entries there, {off}.")
    if not path.exists():
        return ""
    if not path.is_file():
        raise ConfigError(f"{path} is not a regular file; move it aside to let tpufab write "
                          f"its SSH entries there, {off}.")
    try:
        text = path.read_bytes().decode("utf-8")
    except PermissionError:
        raise ConfigError(f"{path} cannot be read ({_mode(path)}); fix its permissions "
                          f"(chmod 600 {path}), {off}.") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{path} is not UTF-8 text, so tpufab cannot rewrite it safely: "
                          f"convert it, {off}.") from None
    for included in _included(text, path.parent):
        try:
            inner = included.read_text(encoding="utf-8", errors="replace")
        except OSError:
            continue
        if any(_BEGIN_RE.match(line) for line in inner.splitlines()):
            raise ConfigError(
                f"tpufab's entries are in {included}, which {path} Includes, and paramiko "
                "(Fabric) ignores Include (paramiko#1609): delete tpufab's section there and "
                f"run `tpufab config-ssh` again to have them in {path} itself.")
    return text


def _included(text: str, base: Path) -> list[Path]:
    """The files an ``Include`` line names (globs expanded, relative to ~/.ssh)."""
    import shlex

    found = []
    for line in text.splitlines():
        if _keyword(line) != "include":
            continue
        try:
            words = shlex.split(_KEYWORD_RE.match(line.strip()).group(2))
        except ValueError:
            continue
        for word in words:
            pattern = os.path.expanduser(word)
            if not os.path.isabs(pattern):
                pattern = str(base / pattern)
            found += [Path(p) for p in sorted(glob.glob(pattern)) if os.path.isfile(p)]
    return found


def _mode(path: Path) -> str:
    try:
        return f"mode {path.stat().st_mode & 0o777:o}"
    except OSError as err:
        return err.strerror or str(err)


def write_config(path: Path, text: str) -> None:
    """Replace ``path`` with ``text`` at once (a temporary file beside it, renamed), keeping
    its mode (0600 for a new file, in a 0700 ~/.ssh)."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    try:
        mode = path.stat().st_mode & 0o7777
    except FileNotFoundError:
        mode = 0o600
    tmp = path.with_name(f".{path.name}.tpufab-{os.getpid()}")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8", newline="") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except OSError as err:
        tmp.unlink(missing_ok=True)
        raise ConfigError(f"Could not write {path} ({err.strerror or err}); check that "
                          f"{path.parent} is yours and writable.") from None


class Locked:
    """One writer of ~/.ssh/config at a time among tpufab processes (a create's refresh and
    a `config-ssh` in another terminal): an flock on a file in tpufab's state dir."""

    def __init__(self, state_dir: Path):
        self.path = Path(state_dir) / "ssh-config.lock"

    def __enter__(self) -> Locked:
        self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._fh = open(self.path, "a")  # noqa: SIM115 - held until __exit__
        fcntl.flock(self._fh, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc) -> None:
        self._fh.close()
