"""Workers without external IPs, reached through an SSH jump host (a bastion in their VPC).

``--jump user@host[:port]`` (the ``jump`` setting): tpufab opens ONE SSH connection to the
bastion per process and one ``direct-tcpip`` channel per worker through it; each channel is
the socket of that worker's own SSH connection (``fanout`` dials nothing else), so a fan-out
through one bastion keeps its concurrency (channels are not sessions: sshd's MaxSessions does
not apply to them). The bastion's host key is pinned in tpufab's known_hosts under its
OpenSSH name (``host`` or ``[host]:port``), trusted on first use, and a changed key is refused
with one sentence.

A :class:`Jump` is a plain picklable description, so a Target can carry it into another
process, which then opens its own bastion connection (the cache is per process).
"""

from __future__ import annotations

import atexit
import errno
import os
import threading
from typing import Any

from tpufab.config import Jump
from tpufab.errors import ConfigError, TpufabError

KEEPALIVE = 30  # seconds: keeps NAT and firewall state of an idle bastion connection


class JumpError(TpufabError):
    """The jump host could not be reached, logged into, or would not forward."""


def pinned_notes(jump: Jump, known_hosts) -> list[str]:
    """What a first connection pinned for the jump host, as ssh says it on first use."""
    from tpufab.ssh.hostkeys import fingerprint

    return [f"Pinned the {ktype} host key of the jump host {jump.key_alias} "
            f"({fingerprint(blob)}) in {known_hosts.path}: a different key is refused from now "
            "on." for ktype, blob in known_hosts.lookup(jump.key_alias)]


def forget_if_gone(jump: Jump, known_hosts, timeout: float = 3.0) -> int:
    """Forget the jump host's pinned key when it no longer answers (it went with a deleted
    node, as an internal-IP node's own bastion does); a bastion that still answers keeps its
    pin. Returns how many keys were forgotten."""
    import socket

    if not known_hosts.lookup(jump.key_alias):
        return 0
    try:
        with socket.create_connection((jump.host, jump.port), timeout=timeout):
            return 0
    except OSError:
        return known_hosts.forget_alias(jump.key_alias)


# ---------------------------------------------------------------------------------------------
# One connection per bastion per process
# ---------------------------------------------------------------------------------------------

_lock = threading.Lock()
_clients: dict[tuple[int, Jump], Any] = {}       # (pid, jump) -> paramiko.SSHClient
_holds: dict[Jump, int] = {}
_connecting: dict[Jump, threading.Lock] = {}


def _describe(err: BaseException) -> str:
    import socket

    import paramiko

    if isinstance(err, ConnectionRefusedError):
        return "connection refused"
    if isinstance(err, ConnectionResetError | EOFError) or "reset by peer" in str(err):
        return "the connection closed before an SSH server answered"
    if isinstance(err, socket.timeout | TimeoutError) or "timed out" in str(err).lower():
        return "no answer (timed out)"
    if isinstance(err, paramiko.AuthenticationException):
        return "authentication failed"
    return str(err) or type(err).__name__


def _connect(jump: Jump, known_hosts, timeout: float, refused: str | None = None):
    import paramiko

    from tpufab.ssh.hostkeys import HostKeyChanged
    from tpufab.ssh.transport import quiet_paramiko

    quiet_paramiko()
    client = paramiko.SSHClient()
    client.set_missing_host_key_policy(known_hosts.policy(jump.key_alias))
    pkey = None
    if jump.key_filename:
        try:
            pkey = paramiko.PKey.from_path(os.path.expanduser(jump.key_filename))
        except FileNotFoundError:
            raise ConfigError(f"The SSH key {jump.key_filename} for the jump host {jump} does "
                              "not exist; point ssh_key (TPUFAB_SSH_KEY) at an existing "
                              "private key.") from None
    try:
        client.connect(jump.host, port=jump.port, username=jump.user, pkey=pkey,
                       look_for_keys=pkey is None, allow_agent=pkey is None, timeout=timeout,
                       banner_timeout=timeout, auth_timeout=timeout, channel_timeout=timeout)
    except HostKeyChanged:
        client.close()
        raise HostKeyChanged(
            f"The host key of the jump host {jump} differs from the one pinned in "
            f"{known_hosts.path} (someone may be intercepting the connection, or the bastion "
            f"was rebuilt); if the change is expected, run `ssh-keygen -f {known_hosts.path} "
            f"-R '{jump.key_alias}'`.") from None
    except paramiko.AuthenticationException:
        client.close()
        raise JumpError(f"The jump host {jump} refused the login (authentication failed); " + (
            refused or f"put your public key ({jump.key_filename or 'your SSH key'}.pub) in "
                       f"{jump.user}'s authorized_keys there, or name another user in --jump.")
        ) from None
    except (OSError, EOFError, paramiko.SSHException) as err:
        client.close()
        raise JumpError(f"Cannot reach the jump host {jump} ({_describe(err)}); check that it is "
                        "up and reachable from here, and that --jump (or `jump:` in tpufab.yaml) "
                        "names it as user@host[:port].") from None
    transport = client.get_transport()
    transport.set_keepalive(KEEPALIVE)
    return client


def client(jump: Jump, known_hosts, timeout: float, *, refused: str | None = None):
    """The process's connection to ``jump`` (opened now if there is none, or it died);
    ``refused`` is what to advise if the bastion refuses the login (OS Login's own advice)."""
    key = (os.getpid(), jump)
    with _lock:
        lock = _connecting.setdefault(jump, threading.Lock())
    with lock:  # one handshake per bastion, however many workers ask at once
        existing = _clients.get(key)
        if existing is not None and existing.get_transport() is not None and \
                existing.get_transport().is_active():
            return existing
        fresh = _connect(jump, known_hosts, timeout, refused)
        with _lock:
            _clients[key] = fresh
        if existing is not None:
            existing.close()
        return fresh


def open_channel(jump: Jump, known_hosts, host: str, port: int, timeout: float, *,
                 connect=None):
    """A ``direct-tcpip`` channel to ``host:port`` through the bastion: a socket for paramiko.

    A worker the bastion cannot reach is ConnectionRefusedError (a transient failure the
    fan-out retries, then reports as "connection refused"), like a direct connection; one the
    bastion's connect hangs on (no firewall rule from the bastion, say) fails after
    ``timeout``, once. ``connect(jump, known_hosts, timeout)`` gives the bastion's client
    (default :func:`client`; a seam for tests)."""
    import paramiko

    from tpufab.ssh.transport import ConnectError

    connect = connect or client
    for attempt in (1, 2):
        transport = connect(jump, known_hosts, timeout).get_transport()
        try:
            return ChannelSocket(transport.open_channel("direct-tcpip", (host, port),
                                                        ("127.0.0.1", 0), timeout=timeout))
        except paramiko.ChannelException as err:
            if err.code == paramiko.common.OPEN_FAILED_CONNECT_FAILED:
                raise ConnectionRefusedError(errno.ECONNREFUSED, "connection refused "
                                             f"(the jump host {jump} could not connect)") from None
            raise JumpError(f"The jump host {jump} will not forward to {host}:{port} "
                            f"({err.text or err.code}); its sshd needs AllowTcpForwarding "
                            "yes for your user.") from None
        except (EOFError, paramiko.SSHException) as err:
            if "Timeout opening channel" in str(err):
                raise ConnectError(
                    f"connection timed out: the jump host {jump} did not reach {host}:{port} "
                    f"within {timeout:g} s (does a firewall rule let port 22 in from the "
                    "bastion?)") from None
            if attempt == 2 or (transport is not None and transport.is_active()):
                raise
            # the bastion connection died (a restart, a network blip): open it again once


class ChannelSocket:
    """A ``direct-tcpip`` channel as the socket of a worker's SSH connection, whose ``close``
    never raises. paramiko's transport thread closes its socket on the way out and re-raises
    anything that close raises as an uncaught thread exception; closing a channel sends a
    message on the bastion's connection, which may be closing at the same moment (at exit, or
    when the last Pod lets it go), so that close can meet a dead socket. By then the channel is
    finished either way: nothing is lost by not saying so."""

    def __init__(self, channel):
        self.channel = channel

    def __getattr__(self, name: str) -> Any:
        return getattr(self.channel, name)

    def close(self) -> None:
        try:
            self.channel.close()
        except Exception:  # noqa: BLE001 - a closing bastion connection: see the docstring
            pass


def hold(jump: Jump) -> None:
    """A user of ``jump`` (a Pod) begins; :func:`release` closes the connection after the last."""
    with _lock:
        _holds[jump] = _holds.get(jump, 0) + 1


def release(jump: Jump) -> None:
    with _lock:
        left = _holds.get(jump, 1) - 1
        if left > 0:
            _holds[jump] = left
            return
        _holds.pop(jump, None)
        found = _clients.pop((os.getpid(), jump), None)
    if found is not None:
        found.close()


def close_all() -> None:
    with _lock:
        found = [c for (pid, _), c in _clients.items() if pid == os.getpid()]
        _clients.clear()
        _holds.clear()
    for c in found:
        c.close()


atexit.register(close_all)


def proxy_command(jump: Jump, known_hosts_options: list[str], key_path: str) -> str:
    """The OpenSSH ProxyCommand that goes through ``jump`` with the same key and pinned
    known_hosts (``-J`` would not pass those options on to the jump connection)."""
    from tpufab import quoting

    argv = ["ssh", "-i", key_path, "-o", "IdentitiesOnly=yes", "-o", "BatchMode=yes",
            *known_hosts_options, "-p", str(jump.port), "-W"]
    # ssh expands %-tokens in a ProxyCommand: literal % in our pieces are doubled.
    escaped = [str(p).replace("%", "%%") for p in argv]
    return str(quoting.command(*escaped, quoting.Raw("%h:%p"),
                               f"{jump.user}@{jump.host}".replace("%", "%%")))
