"""What every SSH connection tpufab opens shares (the fan-out's and the jump host's): the
errors a connection can end in, paramiko's logging kept quiet; and the libssh2 transport.

**libssh2** (ssh2-python): the fan-out's cheaper handshake. paramiko's costs the client
several ms of CPU in Python; libssh2 does it in C, a quarter of that (docs/fanout.md).
:func:`libssh2_connect` makes one connection with tpufab's guarantees (cheapest key exchange
first, the worker's host key checked against the pinned one before authenticating, the key
file) and returns a :class:`Libssh2Connection`, shaped like the part of paramiko's
``Transport`` the fan-out uses (``open_session``, ``is_active``, ``close``), whose channels
are shaped like paramiko's ``Channel`` for the agent and one-shot paths: the fan-out runs
both unchanged. SFTP and port forwards stay on paramiko (``Fanout.transport``).

libssh2 is not thread-safe within a session, so every call on a connection holds its lock.
While only the connecting thread uses it, the session stays in blocking mode and libssh2
waits for answers in C (the one-shot path: channel open, exec, the command line, and the
command's end within SETTLE). From the first wait on the socket in Python it is non-blocking:
one thread at a time waits on the socket (poll, no periodic wake-up) and reads every open
channel into its buffers, the thread that waits for an answer while nobody else reads, else
a *pump* thread started for channels that other threads read (an agent's). A caller whose
call may have read the socket itself kicks whoever waits through an eventfd.
"""

from __future__ import annotations

import base64
import functools
import os
import select
import socket
import threading
import time

from tpufab.errors import TpufabError


class ConnectError(TpufabError):
    """A worker could not be reached or logged into."""


class WorkerSilent(ConnectError):
    """The worker accepted the connection but did not answer within the connect timeout."""


def quiet_paramiko() -> None:
    """paramiko logs its transport thread's failures with tracebacks through the logging
    module's last-resort handler (stderr); each worker's failure is reported as one sentence
    instead. --debug (a configured root logger) still sees them."""
    import logging

    logger = logging.getLogger("paramiko")
    if not any(isinstance(h, logging.NullHandler) for h in logger.handlers):
        logger.addHandler(logging.NullHandler())


# ---------------------------------------------------------------------------------------------
# libssh2
# ---------------------------------------------------------------------------------------------


EAGAIN = -37  # LIBSSH2_ERROR_EAGAIN
BLOCK_OUTBOUND = 2  # LIBSSH2_SESSION_BLOCK_OUTBOUND: a packet waits for room in the socket
STALL_LIMIT = 3     # writable wake-ups that sent nothing (a caller's packet waits): then
STALL_PAUSE = 0.02  # s: the socket's room is looked at this often, not at once
READ_SIZE = 1 << 16
SETTLE = 0.1  # s: how long a fresh one-shot command is waited for in C before the pump loop
ANSWER_TICK = 0.05  # s: the longest a caller waits for an answer the pump may have read first
KEX = ("curve25519-sha256,curve25519-sha256@libssh.org,ecdh-sha2-nistp256,"
       "ecdh-sha2-nistp384,ecdh-sha2-nistp521,diffie-hellman-group14-sha256,"
       "diffie-hellman-group16-sha512,diffie-hellman-group-exchange-sha256")
# Host key algorithms by the key type known_hosts pins; the pinned types are asked for first
# (a worker with several host keys then shows the pinned one), then as paramiko orders them.
HOSTKEY_ALGORITHMS = {"ssh-ed25519": ("ssh-ed25519",),
                      "ecdsa-sha2-nistp256": ("ecdsa-sha2-nistp256",),
                      "ecdsa-sha2-nistp384": ("ecdsa-sha2-nistp384",),
                      "ecdsa-sha2-nistp521": ("ecdsa-sha2-nistp521",),
                      "ssh-rsa": ("rsa-sha2-512", "rsa-sha2-256", "ssh-rsa")}
HOSTKEY_TYPES = {1: "ssh-rsa", 2: "ssh-dss", 3: "ecdsa-sha2-nistp256",
                 4: "ecdsa-sha2-nistp384", 5: "ecdsa-sha2-nistp521", 6: "ssh-ed25519"}


def libssh2_available() -> bool:
    """ssh2-python imports (a wheel for this platform was installed), on Linux (the pump's
    eventfd and POLLRDHUP); elsewhere the fan-out uses paramiko."""
    if not hasattr(os, "eventfd") or not hasattr(select, "POLLRDHUP"):
        return False
    try:
        import ssh2.session  # noqa: F401
    except ImportError:
        return False
    return True


class KeyUnusable(Exception):
    """libssh2 cannot read this private key (passphrase, format): the fan-out uses paramiko."""


@functools.cache
def _ssh2():
    """ssh2-python's ``exceptions`` and ``session`` modules, imported at the first use (startup
    stays instant) and then taken from here: an import statement per call costs each connection
    a trip through the import machinery."""
    from ssh2 import exceptions, session

    return exceptions, session


def libssh2_auth_error(err: BaseException) -> bool:
    e = _ssh2()[0]
    return isinstance(err, e.AuthenticationError | e.PublickeyUnverifiedError)


def libssh2_timeout(err: BaseException) -> bool:
    e = _ssh2()[0]
    return isinstance(err, e.Timeout | e.SocketTimeout)


def libssh2_transient(err: BaseException) -> bool:
    """A connection-level failure another attempt may not meet (reset, a banner cut short by
    sshd's MaxStartups): not authentication, not a timeout, not a host key."""
    e = _ssh2()[0]
    return isinstance(err, e.SSH2Error) and not libssh2_auth_error(err) and not libssh2_timeout(err) \
        and not isinstance(err, KeyUnusable)


@functools.lru_cache(maxsize=64)
def hostkey_preference(pinned: tuple[str, ...]) -> str:
    """libssh2's host key algorithms, those of the ``pinned`` key types first (pure)."""
    order = [a for t in pinned for a in HOSTKEY_ALGORITHMS.get(t, ())]
    order += [a for algs in HOSTKEY_ALGORITHMS.values() for a in algs if a not in order]
    return ",".join(order)


def libssh2_connect(sock: socket.socket, user: str, key_filename: str, timeout: float,
            verify, pinned: list[str] = ()) -> Libssh2Connection:
    """Handshake on ``sock`` (curve25519 first, the ``pinned`` host key types first),
    ``verify(key_type, base64_blob)`` the host key (raises to refuse it), then public-key
    auth with ``key_filename``; each step bounded by ``timeout`` seconds."""
    e, lib = _ssh2()
    timeout_ms = max(1, int(timeout * 1000))
    session = lib.Session()
    try:
        session.set_timeout(timeout_ms)
        session.method_pref(lib.LIBSSH2_METHOD_KEX, KEX)
        session.method_pref(lib.LIBSSH2_METHOD_HOSTKEY, hostkey_preference(tuple(pinned)))
        session.handshake(sock)
        blob, kind = session.hostkey()
        verify(HOSTKEY_TYPES.get(kind, "unknown"), base64.b64encode(blob).decode())
        try:
            session.userauth_publickey_fromfile(user, key_filename)
        except (e.FileError, e.PublicKeyInitError, e.PublicKeyError) as err:
            raise KeyUnusable(str(err) or type(err).__name__) from err
        except e.AuthenticationError as err:  # "Unable to ..." read the key, not "invalid"
            if session.last_error().startswith("Unable to extract"):
                raise KeyUnusable(session.last_error()) from err
            raise
    except BaseException:
        _shut(sock)
        raise
    return Libssh2Connection(sock, session, timeout_ms)


def _shut(sock: socket.socket) -> None:
    """End a connection's socket but leave its descriptor open: libssh2 writes to it when its
    session or a channel is freed (a channel's close), which may be later, from the garbage
    collector; a closed descriptor's number may by then be another connection's. The socket
    object closes it when the session that holds it is freed, after libssh2 is done."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


class _Stream:
    """One of a channel's two streams, as paramiko's buffer looks to the fan-out."""

    __slots__ = ("data", "event")

    def __init__(self):
        self.data = bytearray()
        self.event = None

    def set_event(self, event) -> None:
        self.event = event


class Libssh2Channel:
    """A session channel on a :class:`Libssh2Connection`, with the paramiko ``Channel`` methods the
    fan-out's agent and one-shot paths use."""

    def __init__(self, conn: Libssh2Connection, chan, timeout: float | None):
        self.conn = conn
        self.chan = chan
        self.in_buffer = _Stream()
        self.in_stderr_buffer = _Stream()
        self.cond = threading.Condition()
        self.eof_received = False
        self.closed = False
        self.closing = False
        self.close_sent = False
        self.exit_status = -1
        self.status_event = threading.Event()
        self.timeout = timeout  # for a request's answer (the channel's open timeout)

    # -- from the pump (holding the connection's lock) ---------------------------------------
    def _feed(self, stream: _Stream, data: bytes) -> None:
        with self.cond:
            stream.data += data
            self.cond.notify_all()
        if stream.event is not None:
            stream.event.set()

    def _ended(self, status: int) -> None:
        # libssh2's channel is freed here, under the connection's lock: freed later by the
        # garbage collector, in any thread, it would change the session's packet list while
        # another thread reads it in a libssh2 call (the session is not thread-safe)
        self.chan = None
        with self.cond:
            self.eof_received = True
            self.closed = True
            self.exit_status = status
            self.cond.notify_all()
        self.status_event.set()
        for stream in (self.in_buffer, self.in_stderr_buffer):
            if stream.event is not None:
                stream.event.set()

    def _eof(self) -> None:
        with self.cond:
            self.eof_received = True
            self.cond.notify_all()
        for stream in (self.in_buffer, self.in_stderr_buffer):
            if stream.event is not None:
                stream.event.set()

    def live(self):
        """libssh2's channel (the connection's lock held), or EOFError once it ended; calls
        look it up under the lock, so no reference to it outlives them."""
        chan = self.chan
        if chan is None:
            raise EOFError("the channel is closed")
        return chan

    # -- paramiko's Channel ------------------------------------------------------------------
    def exec_command(self, command: str) -> None:
        self.conn.call(lambda: self.live().execute(command), timeout=self.timeout)

    def sendall(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            written = self.conn.write(self, view)
            view = view[written:]

    def shutdown_write(self) -> None:
        self.conn.call(lambda: self.live().send_eof())

    def _take(self, stream: _Stream, size: int) -> bytes:
        out = bytes(stream.data[:size])
        del stream.data[:size]
        return out

    def recv(self, size: int) -> bytes:
        """Up to ``size`` bytes of stdout, waiting for some; b"" at the end (another thread
        reads the socket meanwhile: the connection's pump)."""
        self.conn.start_pump()
        with self.cond:
            while not self.in_buffer.data and not self.eof_received:
                self.cond.wait()
            return self._take(self.in_buffer, size)

    def recv_ready(self) -> bool:
        return bool(self.in_buffer.data)

    def recv_stderr_ready(self) -> bool:
        return bool(self.in_stderr_buffer.data)

    def recv_stderr(self, size: int) -> bytes:
        with self.cond:
            return self._take(self.in_stderr_buffer, size)

    def drive(self, event: threading.Event, timeout: float | None) -> bool:
        """Wait up to ``timeout`` s for ``event``, reading the socket meanwhile if nobody else
        does (:meth:`Libssh2Connection.drive`)."""
        return self.conn.drive(event, timeout)

    def settle(self, seconds: float) -> bool:
        """Wait up to ``seconds`` for the command to end, in C, if nobody else reads the
        connection: most one-shot commands end that soon, and then cost no Python loop. True
        when it ended (its output buffered, its exit status in)."""
        return self.conn.settle(self, seconds)

    def close(self) -> None:
        if not self.closed and not self.closing:
            self.closing = True
            self.conn.kick()
            self.conn.start_pump()  # someone must send the close and see the worker's


_BUSY = object()  # another thread reads the connection: no call of libssh2's may wait in C


class Libssh2Connection:
    """An authenticated libssh2 session, shaped like the part of paramiko's Transport the
    fan-out uses."""

    def __init__(self, sock: socket.socket, session, timeout_ms: int):
        self.sock = sock
        self.blocking = True         # as the handshake left it, waiting at most timeout_ms
        self.timeout_ms = timeout_ms
        self.fd = sock.fileno()
        self.session = session
        self.lock = threading.Lock()                    # every libssh2 call
        self.answered = threading.Condition(self.lock)  # the socket had something to read
        self.stepper = threading.Lock()  # one thread at a time waits on the socket and reads
        self.pump_thread: threading.Thread | None = None
        self.channels: list[Libssh2Channel] = []
        self.dead = False
        self.waiting = 0    # callers waiting for the stepping thread to read an answer
        self.calls = 0      # libssh2 calls made by callers (each may read the socket)
        self.seen = -1      # ``calls`` when the stepping thread last woke them
        self.dirty = False  # a caller's call may have read data a channel is waiting for
        # The eventfd that wakes the stepping thread, and its poll set: made by the first wait
        # on the socket in Python (a one-shot command that ends within SETTLE never waits so).
        self.kick_fd = -1
        self.kick_lock = threading.Lock()  # the eventfd is closed once, never written after
        self.poller: select.poll | None = None
        self.ended = False
        self.watching = 0
        self.stalled = 0    # wake-ups for room in the socket after which a packet still waited

    # -- calls (from any thread) ------------------------------------------------------------
    def _check(self, deadline: float | None) -> None:
        if self.dead:
            raise EOFError("the connection to the worker is closed")
        if deadline is not None and time.monotonic() >= deadline:
            raise TimeoutError("timed out waiting for the worker")

    def _attempt(self, fn, deadline: float | None):
        """Call ``fn`` until libssh2 stops saying EAGAIN, waiting for the socket in between
        (this thread, or the one already waiting on it); ``fn``'s result."""
        while True:
            with self.lock:
                self._check(deadline)
                self._nonblocking()
                self.calls += 1
                result = fn()
                if (result[0] if isinstance(result, tuple) else result) != EAGAIN or \
                        (isinstance(result, tuple) and result[1] > 0):
                    self.dirty = True
                    break
                outbound = self.session.block_directions() & BLOCK_OUTBOUND
                left = 1.0 if deadline is None else min(1.0, deadline - time.monotonic())
                inline = not outbound and self.stepper.acquire(blocking=False)
                if not outbound and not inline:
                    # Another thread waits on the socket: it wakes us when something came in.
                    # ANSWER_TICK bounds the race of it reading our answer during a pass.
                    self.waiting += 1
                    self.dirty = True
                    self.kick()
                    try:
                        self.answered.wait(max(0.0, min(left, ANSWER_TICK)))
                    finally:
                        self.waiting -= 1
                    continue
            if outbound:
                select.select([], [self.sock], [], max(0.0, left))
                continue
            try:
                self._step(max(0.0, left), answer=True)
            finally:
                self.stepper.release()
        if self.stepper.locked():  # whoever waits on the socket passes over the channels again
            self.kick()            # (one that starts later sees ``dirty``)
        return result

    def call(self, fn, *args, timeout: float | None = None):
        """``fn(*args)`` until it stops saying EAGAIN, within ``timeout`` seconds."""
        if timeout is not None:
            result = self._inline(fn, args, timeout)
            if result is not _BUSY:
                return result
        deadline = None if timeout is None else time.monotonic() + timeout
        return self._attempt(lambda: fn(*args), deadline)

    def _inline(self, fn, args, timeout: float):
        """``fn(*args)`` with libssh2 waiting for the answer itself, in C, without the GIL,
        within ``timeout`` s, if nobody else reads this connection (a fresh one, the one-shot
        path); else _BUSY."""
        if self.pump_thread is not None or not self.stepper.acquire(blocking=False):
            return _BUSY
        try:
            with self.lock:
                self._check(None)
                self._blocking(timeout)
                try:
                    return fn(*args)
                finally:
                    self.dirty = True
        finally:
            self.stepper.release()

    def settle(self, channel: Libssh2Channel, seconds: float) -> bool:
        """:meth:`Libssh2Channel.settle`: EOF, the output, the worker's close and the exit
        status waited for in blocking mode; False (nothing lost: the rest is read as usual)
        when the command runs on, or another thread reads this connection."""
        errors = _ssh2()[0]
        if seconds <= 0 or self.pump_thread is not None or \
                not self.stepper.acquire(blocking=False):
            return False
        try:
            with self.lock:
                if self.dead or channel not in self.channels:
                    return False
                self._blocking(seconds)
                self.dirty = True  # whatever ends this, the next pass looks at every channel
                try:
                    channel.chan.wait_eof()
                    self._read(channel)    # up to the EOF: no read waits
                    self._finish(channel)  # the close follows the EOF at once, as a rule
                except (errors.Timeout, errors.ChannelWindowFullError):
                    # it runs on, or wrote a window's worth before its EOF: read as usual
                    return False
                return channel.closed
        finally:
            self.stepper.release()

    def _blocking(self, timeout: float) -> None:
        """libssh2 in blocking mode, waiting at most ``timeout`` s (the lock and the stepper
        held). The session stays so until the socket is waited on in Python again: a fresh
        connection's requests switch nothing."""
        ms = max(1, int(timeout * 1000))
        if not self.blocking:
            self.session.set_blocking(True)
            self.blocking = True
        if ms != self.timeout_ms:
            self.session.set_timeout(ms)
            self.timeout_ms = ms

    def _nonblocking(self) -> None:
        """libssh2 back in non-blocking mode (the lock held) before any call that must not wait."""
        if self.blocking:
            self.session.set_blocking(False)
            self.blocking = False

    def write(self, chan: Libssh2Channel, data: memoryview) -> int:
        """Write some of ``data`` to ``chan``'s stdin; how much."""
        piece = bytes(data[:1 << 18])
        if chan.timeout is not None:  # before any pump: a fresh channel's request or script
            result = self._inline(lambda: chan.live().write(piece), (), chan.timeout)
            if result is not _BUSY:
                return result[1]
        return self._attempt(lambda: chan.live().write(piece), None)[1]

    def open_session(self, timeout: float | None = None) -> Libssh2Channel:
        chan = self.call(self.session.open_session, timeout=timeout)
        channel = Libssh2Channel(self, chan, timeout)
        with self.lock:
            if self.ended:  # it ended its channels meanwhile: this one would wait forever
                channel.chan = None
                raise EOFError("the connection to the worker is closed")
            self.channels.append(channel)
        return channel

    def is_active(self) -> bool:
        if self.dead:
            return False
        poller = select.poll()
        poller.register(self.sock, select.POLLRDHUP)
        return not poller.poll(0)

    def kick(self) -> None:
        with self.kick_lock:
            if self.kick_fd >= 0:
                os.eventfd_write(self.kick_fd, 1)

    def close(self) -> None:
        self.dead = True
        _shut(self.sock)
        self.kick()
        if self.stepper.acquire(blocking=False):  # nobody waits on the socket: end it here
            try:
                self._end()
            finally:
                self.stepper.release()

    # -- waiting on the socket (one thread at a time: the pump, or a caller inline) ---------
    def start_pump(self) -> None:
        """A thread that waits on the socket for good (channels read by other threads: an
        agent's); until then whoever waits for an answer reads the socket itself."""
        with self.lock:
            if self.pump_thread is None and not self.dead:
                self.pump_thread = threading.Thread(target=self._pump, daemon=True,
                                                    name="tpufab-libssh2")
                self.pump_thread.start()

    def drive(self, event: threading.Event, timeout: float | None) -> bool:
        """Wait up to ``timeout`` s for ``event`` (a channel's), reading the socket in this
        thread while nobody else does: the one-shot path needs no second thread."""
        if event.is_set():
            return True
        if not self.stepper.acquire(blocking=False):
            return event.wait(timeout)
        try:
            self._step(timeout)
        finally:
            self.stepper.release()
        return event.is_set()

    def _pump(self) -> None:
        with self.stepper:
            while not self.dead:
                self._step(None)
            self._end()

    def _step(self, timeout: float | None, *, answer: bool = False) -> None:
        """Wait (the stepper held) up to ``timeout`` s for the socket or a kick, then read
        every channel and wake the callers waiting for an answer."""
        with self.lock:
            dead = self.dead
            if self.poller is None and not dead:
                self._wakeable()
            # Without a channel nothing drains the socket but a caller's own call: watched
            # for data only while one waits and has called since it was last woken.
            inbound = answer or bool(self.channels) or \
                (self.waiting and self.calls != self.seen)
            busy = self.dirty or any(c.closing and not c.close_sent for c in self.channels)
            # A packet libssh2 could not send whole (a window adjust while reading) goes out
            # only when something calls it again: the socket's room is watched too.
            outbound = bool(self.session.block_directions() & BLOCK_OUTBOUND)
        if dead:
            self._end()
            return
        wait = 0 if busy else timeout
        if outbound and self.stalled >= STALL_LIMIT:  # a caller's packet, not ours: pause
            outbound = False
            self.stalled = STALL_LIMIT - 1
            wait = STALL_PAUSE if wait is None else min(wait, STALL_PAUSE)
        want = select.POLLRDHUP | (select.POLLIN if inbound else 0) | \
            (select.POLLOUT if outbound else 0)
        if want != self.watching:
            self.poller.register(self.fd, want)
            self.watching = want
        try:
            events = dict(self.poller.poll(None if wait is None else int(wait * 1000)))
        except OSError:
            events = {}
        if self.kick_fd in events:
            try:
                os.eventfd_read(self.kick_fd)
            except OSError:
                pass
        ready = events.get(self.fd, 0)
        try:
            with self.lock:
                if self.dead:
                    return
                if ready or self.dirty or busy or outbound:
                    self.dirty = False
                    self._nonblocking()
                    self._pass()
                if not self.session.block_directions() & BLOCK_OUTBOUND:
                    self.stalled = 0
                elif ready & select.POLLOUT:
                    self.stalled += 1
                if ready & ~select.POLLOUT:
                    self.seen = self.calls
                    self.answered.notify_all()
        except Exception:  # noqa: BLE001 - the connection failed: every channel ends
            ready = select.POLLHUP
        if ready & select.POLLIN:
            try:
                self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_QUICKACK, 1)
            except OSError:
                pass
        if ready & (select.POLLRDHUP | select.POLLHUP | select.POLLERR):
            self.dead = True
            self._end()

    def _wakeable(self) -> None:
        """The eventfd and poll set (the lock held; before the first wait: a kick earlier came
        with a flag the wait looks at first, ``dirty``, ``dead`` or a channel's ``closing``)."""
        with self.kick_lock:
            self.kick_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self.poller = select.poll()
        self.poller.register(self.kick_fd, select.POLLIN)

    def _end(self) -> None:
        """The connection is gone (the stepper held): end its channels, free the socket."""
        with self.lock, self.kick_lock:
            if self.ended:
                return
            self.ended = self.dead = True
            channels, self.channels = self.channels, []
            self.answered.notify_all()
            _shut(self.sock)
            if self.kick_fd >= 0:
                os.close(self.kick_fd)
                self.kick_fd = -1
            for channel in channels:  # under the lock: their libssh2 channels are freed
                channel._ended(-1)

    def _pass(self) -> None:
        """Read every channel into its buffers; close those that ended (the lock held)."""
        SSH2Error = _ssh2()[0].SSH2Error  # noqa: N806
        # Any read takes in every packet that arrived, for every channel and stream: reading
        # one stream may queue another's data after that one was read. So read rounds until
        # nothing comes, and once more while libssh2 still holds data (a round that reads
        # nothing then is a window adjust waiting for room: the pump watches for it).
        empty = 0
        while empty < 2:
            got = False
            for channel in list(self.channels):
                try:
                    got = self._read(channel) or got
                except SSH2Error:
                    if not channel.closing:
                        raise
                    self.channels.remove(channel)  # closed at the connection's end already
                    channel._ended(-1)
            if got:
                empty = 0
                continue
            empty += 1
            if not any(c.chan.poll_channel_read(0) > 0 or c.chan.poll_channel_read(1) > 0
                       for c in self.channels):
                break
        for channel in list(self.channels):
            try:
                self._finish(channel)
            except SSH2Error:
                if not channel.closing:
                    raise
                self.channels.remove(channel)
                channel._ended(-1)

    @staticmethod
    def _read(channel: Libssh2Channel) -> bool:
        """What libssh2 holds for ``channel`` into its buffers; whether there was any."""
        got = False
        for stream, read in ((channel.in_buffer, channel.chan.read),
                             (channel.in_stderr_buffer, channel.chan.read_stderr)):
            while True:
                rc, data = read(READ_SIZE)
                if rc <= 0:
                    break
                channel._feed(stream, data)
                got = True
        return got

    def _finish(self, channel: Libssh2Channel) -> None:
        """EOF, our close, the worker's close and the exit status of ``channel``."""
        chan = channel.chan
        if not channel.eof_received and chan.eof():
            channel._eof()
        if channel.closing and not channel.close_sent:
            if chan.close() == EAGAIN:  # ours first: the worker's session ends
                return
            channel.close_sent = True
        if not channel.eof_received:
            return
        # After EOF the exit status still comes, then the worker's close: wait for that
        # before closing ours (a command may close its output and go on).
        if chan.wait_closed() == EAGAIN:
            return
        if not channel.close_sent:
            if chan.close() == EAGAIN:
                return
            channel.close_sent = True
        signal = chan.get_exit_signal()
        status = -1 if signal[1] else chan.get_exit_status()
        self.channels.remove(channel)
        channel._ended(status)
