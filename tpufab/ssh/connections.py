"""Where each worker is reached and how its SSH connection is opened.

``Target`` names a worker's address, login and pinned host key; ``open_socket`` dials it (a TCP
socket that acks at once, or a channel through its jump host); ``Connector`` makes the
connection (cheapest key exchange first, the pinned host key, public-key auth; libssh2 where
it can be, else paramiko) and retries quick failures; ``describe`` says why one failed in a
few words; a ``Link`` holds one worker's connection and its agent.
"""

from __future__ import annotations

import errno
import os
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tpufab.errors import TpufabError
from tpufab.ssh.transport import (
    ConnectError,
    KeyUnusable,
    WorkerSilent,
    libssh2_auth_error,
    libssh2_connect,
    libssh2_timeout,
    libssh2_transient,
)

if TYPE_CHECKING:
    from tpufab.config import Jump

IDLE_TICK = 2.0  # s: how often an idle connection's paramiko thread wakes up


@dataclass(frozen=True)
class Target:
    """Where one worker is reached. ``host_key_alias`` names its pinned key (hostkeys.alias)."""

    worker: int
    host: str
    user: str
    key_filename: str | None = None
    port: int = 22
    host_key_alias: str | None = None
    jump: Jump | None = None  # reached through this bastion (tpufab.ssh.jump), else dialled directly
    auth_hint: str | None = None  # what a refused login means here (e.g. OS Login's roles)

    @property
    def key_alias(self) -> str:
        return self.host_key_alias or (self.host if self.port == 22 else f"[{self.host}]:{self.port}")


class _QuickAckSocket(socket.socket):
    """A TCP socket that re-arms TCP_QUICKACK after every read.

    sshd writes small packets without TCP_NODELAY for non-tty sessions; with the client's
    delayed ACK that costs 40 ms at the first channel open (Nagle waiting on an unacked
    packet). Acking at once removes the stall.
    """

    def recv(self, bufsize: int, flags: int = 0) -> bytes:  # type: ignore[override]
        data = super().recv(bufsize, flags)
        try:
            self.setsockopt(socket.IPPROTO_TCP, socket.TCP_QUICKACK, 1)
        except OSError:
            pass
        return data


def _addresses(host: str, port: int) -> list[tuple]:
    """Where to dial ``host``: an IP address as it is (a pod's workers: no resolver call per
    worker), a name through getaddrinfo."""
    for family in (socket.AF_INET, socket.AF_INET6):
        try:
            socket.inet_pton(family, host)
        except OSError:
            continue
        return [(family, socket.SOCK_STREAM, socket.IPPROTO_TCP, "", (host, port))]
    return socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)


def _open_socket(host: str, port: int, timeout: float) -> socket.socket:
    last: Exception | None = None
    for family, kind, proto, _name, address in _addresses(host, port):
        sock = _QuickAckSocket(family, kind, proto)
        try:
            sock.settimeout(timeout)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.connect(address)
            return sock
        except OSError as err:
            sock.close()
            last = err
    raise last or OSError(errno.EHOSTUNREACH, f"no address for {host}")


# Cheapest first: paramiko 5 puts the post-quantum mlkem768x25519 hybrid first, several times
# dearer in client CPU than curve25519; we take it only from a server that offers nothing else
# on this list.
KEX_ORDER = ("curve25519-sha256@libssh.org", "ecdh-sha2-nistp256")


def kex_preference(offered: Sequence[str]) -> tuple[str, ...]:
    """paramiko's kex list reordered cheapest first (pure)."""
    first = [k for k in KEX_ORDER if k in offered]
    return tuple(first + [k for k in offered if k not in first])


def open_socket(target: Target, timeout: float, known_hosts) -> socket.socket:
    """The byte stream a worker's SSH connection runs over: a TCP connection, or a channel
    through the target's jump host (its own bastion connection in each process)."""
    if target.jump is not None:
        from tpufab.ssh import jump

        return jump.open_channel(target.jump, known_hosts, target.host, target.port, timeout)
    return _open_socket(target.host, target.port, timeout)


def timed_out(err: BaseException) -> bool:
    """The worker accepted the connection (or not) but never answered within the timeout."""
    text = str(err)
    if _from_libssh2(err):
        return libssh2_timeout(err)
    return isinstance(err, socket.timeout | TimeoutError) or "protocol banner" in text \
        or "timed out" in text.lower()


def _from_libssh2(err: BaseException) -> bool:
    return type(err).__module__.startswith("ssh2.")


def transient(err: BaseException) -> bool:
    """Connection-level failures worth retrying: quick ones (refused, reset). Auth and host-key
    failures are not, and neither is a timeout: a frozen worker would cost the timeout again
    per attempt (82 s for 4 attempts of 20 s)."""
    import paramiko

    if _from_libssh2(err):
        return libssh2_transient(err)
    if isinstance(err, TpufabError | paramiko.AuthenticationException | paramiko.BadHostKeyException):
        return False
    if timed_out(err):
        return False
    return isinstance(err, OSError | EOFError | paramiko.SSHException)


def describe(err: BaseException, target: Target | None = None) -> str:
    """Why a connection failed, in a few words (a worker's result: `connection refused`)."""
    import paramiko

    if isinstance(err, ConnectionRefusedError):
        return "connection refused"
    if isinstance(err, ConnectionResetError):
        return "connection reset"
    if timed_out(err):
        return "connection timed out"
    if isinstance(err, paramiko.AuthenticationException) or \
            (_from_libssh2(err) and libssh2_auth_error(err)):
        hint = (target and target.auth_hint) or "is the tpufab key in the worker's authorized_keys?"
        return f"authentication failed ({hint})"
    if isinstance(err, TpufabError):
        return str(err)
    text = str(err) or type(err).__name__
    if _from_libssh2(err):
        text = f"{type(err).__name__}{': ' + str(err) if str(err) else ''}"
    return f"connection failed: {text}"


def lost_mid_transfer(err: BaseException) -> str | None:
    """An SFTP transfer whose session ended under it, in words (None: another failure):
    paramiko says only ``EOFError``, "Socket is closed" or "Server connection dropped"."""
    import paramiko

    closed = isinstance(err, OSError) and err.errno is None and "closed" in str(err).lower()
    if closed or isinstance(err, EOFError | ConnectionError) or (
            isinstance(err, paramiko.SSHException)
            and not isinstance(err, paramiko.AuthenticationException)):
        detail = str(err).strip()
        if detail.rstrip(".!").lower() in ("socket is closed", "server connection dropped"):
            detail = ""   # paramiko's words for the same thing: the sentence says it
        return ("connection lost during the transfer (the worker's sshd ended the session: it "
                f"restarted, or the worker went away{'; ' + detail if detail else ''}); nothing "
                "was left under a final name, run it again")
    return None


class Conn:
    """An authenticated SSH connection (a paramiko Transport) to one worker."""

    __slots__ = ("transport",)

    def __init__(self, transport):
        self.transport = transport

    def close(self) -> None:
        try:
            self.transport.sock.shutdown(socket.SHUT_RDWR)  # wakes its thread's read now
        except OSError:
            pass
        self.transport.close()


class Link:
    """The connection of one worker, and its agent once a command needed one."""

    def __init__(self, target: Target):
        self.target = target
        self.conn: Conn | None = None
        self.agent = None  # its agent (channels.agent_protocol.Agent), once started
        self.used = False  # a command ran on this connection (the one-shot path is spent)
        self.side = None   # a paramiko Transport for SFTP and forwards beside a libssh2 one
        self.lock = threading.Lock()

    @property
    def ready(self) -> bool:
        """Connected (the agent starts with the first command that needs it)."""
        return self.conn is not None and self.conn.transport.is_active() and \
            (self.agent is None or self.agent.alive)

    def close(self) -> None:
        if self.agent is not None:
            self.agent.close()
            self.agent = None
        if self.conn is not None:
            try:
                self.conn.close()
            except Exception:  # noqa: BLE001
                pass
            self.conn = None
        if self.side is not None:
            Conn(self.side).close()
            self.side = None
        self.used = False


class Connector:
    """Opens one worker's connection at a time for a fan-out: each attempt bounded by its
    timeout, quick failures retried (``connect_attempts``, backing off by ``retry_wait``,
    ``on_retry(target, attempt, error)`` told before each retry). Key files are read once."""

    def __init__(self, known_hosts, *, connect_attempts: int, retry_wait: tuple[float, float],
                 on_retry: Callable[[Target, int, BaseException], None] | None, libssh2: bool):
        self.known_hosts = known_hosts
        self.connect_attempts = max(1, connect_attempts)
        self.retry_wait = retry_wait
        self.on_retry = on_retry
        self.libssh2 = libssh2
        self._keys: dict[str, object] = {}
        self._keys_lock = threading.Lock()
        self._paramiko_keys: set[str] = set()  # key files libssh2 could not read
        self._key_paths: dict[str, str] = {}   # key file setting -> a path found to exist

    def pkey(self, path: str | None):
        if path is None:
            return None
        with self._keys_lock:
            key = self._keys.get(path)
            if key is None:
                import paramiko

                try:
                    key = paramiko.PKey.from_path(os.path.expanduser(path))
                except FileNotFoundError as err:
                    raise ConnectError(
                        f"The SSH key {path} does not exist; point ssh_key (TPUFAB_SSH_KEY) at "
                        "an existing private key, or leave it unset and tpufab makes its own."
                    ) from err
                self._keys[path] = key
            return key

    def uses_libssh2(self, target: Target) -> bool:
        """libssh2 for this worker: installed, not turned off, a key file it can read, and a
        direct TCP connection (a jump host's channel is paramiko's)."""
        return self.libssh2 and target.jump is None and target.key_filename is not None \
            and target.key_filename not in self._paramiko_keys

    def handshake(self, target: Target, timeout: float, *, paramiko_only: bool = False):
        """Socket, key exchange (cheapest first), pinned host key, public-key auth, each
        bounded by ``timeout`` seconds: a libssh2 connection where it can be (a quarter of the
        client CPU of paramiko's at 1,024 workers), else a paramiko Transport."""
        if not paramiko_only and self.uses_libssh2(target):
            path = self._key_paths.get(target.key_filename)
            if path is None:
                path = os.path.expanduser(target.key_filename)
                if not os.path.exists(path):
                    self.pkey(target.key_filename)  # says which setting to fix
                self._key_paths[target.key_filename] = path
            pinned = self.known_hosts.lookup(target.key_alias)
            try:
                return libssh2_connect(
                    open_socket(target, timeout, self.known_hosts), target.user, path, timeout,
                    lambda ktype, blob: self.known_hosts.verify_blob(target.key_alias, ktype,
                                                                     blob, pinned),
                    [ktype for ktype, _blob in pinned])
            except KeyUnusable:
                self._paramiko_keys.add(target.key_filename)  # passphrase, format: paramiko
        import paramiko

        pkey = self.pkey(target.key_filename)
        transport = paramiko.Transport(open_socket(target, timeout, self.known_hosts))
        try:
            transport.banner_timeout = transport.handshake_timeout = timeout
            transport.auth_timeout = timeout
            options = transport.get_security_options()
            options.kex = kex_preference(options.kex)
            transport.start_client(timeout=timeout)
            self.known_hosts.verify(target.key_alias, transport.get_remote_server_key())
            keys = [pkey] if pkey is not None else list(paramiko.Agent().get_keys())
            if not keys:
                raise ConnectError("no SSH key to log in with (set ssh_key, TPUFAB_SSH_KEY)")
            for i, key in enumerate(keys):
                try:
                    transport.auth_publickey(target.user, key)
                    break
                except paramiko.AuthenticationException:
                    if i == len(keys) - 1:
                        raise
            # paramiko's thread wakes every 0.1 s to look for a close: 10 wake-ups a second
            # per idle connection (a quarter of a core for 1,024 warm connections). Closing
            # shuts the socket down instead (Conn.close), which wakes it at once.
            transport.sock.settimeout(IDLE_TICK)
            return transport
        except BaseException:
            transport.close()
            raise

    def connect_once(self, link: Link, timeout: float) -> None:
        started = time.monotonic()
        try:
            transport = self.handshake(link.target, timeout)
        except BaseException as err:
            # paramiko says "No existing session" or "Error reading SSH protocol banner" when
            # the worker took the TCP connection and never spoke: a frozen sshd. Another
            # attempt would only wait as long again.
            if not isinstance(err, OSError | EOFError | KeyboardInterrupt | TpufabError) and \
                    time.monotonic() - started >= 0.9 * timeout:
                raise WorkerSilent(
                    f"no answer within {timeout:g} s (the worker accepts "
                    "connections but its sshd does not respond: frozen or overloaded)") from err
            raise
        link.conn = Conn(transport)

    def connect(self, link: Link, timeout: float,
                cancelled: threading.Event | None = None) -> None:
        """Connect with retries on connection-level failures (tenacity, exponential backoff),
        each attempt bounded by ``timeout`` seconds; none once ``cancelled`` (the run's own
        Ctrl-C: runs sharing these connections, as a keeper's commands do, each have their
        own) is set."""
        if link.ready:
            return
        with link.lock:
            if link.ready:
                return
            link.close()
            try:
                self.connect_once(link, timeout)  # most connect at once: no retry machinery
                return
            except BaseException as err:
                if self.connect_attempts < 2 or not transient(err) or \
                        (cancelled is not None and cancelled.is_set()):
                    raise
                first = err
            self._retry(link, timeout, cancelled, first)

    def _retry(self, link: Link, timeout: float, cancelled: threading.Event | None,
               first: BaseException) -> None:
        """Attempts 2.. of a connection whose first failed with ``first`` (a transient
        failure): tenacity, backing off exponentially (retry_wait) from the first attempt."""
        from tenacity import Retrying, retry_if_exception, stop_after_attempt

        multiplier, longest = self.retry_wait

        def backoff(state) -> float:  # state.attempt_number n here is attempt n + 1 overall
            return min(multiplier * 2 ** state.attempt_number, longest)

        def before_sleep(state):
            if self.on_retry is not None:
                self.on_retry(link.target, state.attempt_number + 1, state.outcome.exception())

        if self.on_retry is not None:
            self.on_retry(link.target, 1, first)
        time.sleep(min(multiplier, longest))  # the backoff after attempt 1
        Retrying(
            stop=stop_after_attempt(self.connect_attempts - 1),
            wait=backoff,
            retry=retry_if_exception(
                lambda e: transient(e) and not (cancelled and cancelled.is_set())),
            before_sleep=before_sleep,
            reraise=True,
        )(self.connect_once, link, timeout)
