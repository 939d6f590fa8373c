"""Private unix sockets: where the kept-connection keepers and the resident command server
listen, and who may use them. Stdlib only and no pathlib: the ``tpufab`` entry reads it before
anything else loads (tpufab.entry).

The resident server (tpufab.resident) is found by a fingerprint of the tpufab it runs: uid,
Python, sys.path (and its folders' times: a package installed or removed) and tpufab's own
files (a changed checkout gets a new server).

The directory is ``$XDG_RUNTIME_DIR/tpufab``, else ``~/.cache/tpufab/keepers``: 0700, ours.
A socket in it is 0600 and ours; each end checks the other's uid (SO_PEERCRED).
"""

from __future__ import annotations

import fcntl
import os
import socket
import stat
import struct

PEERCRED = struct.Struct("3i")  # pid, uid, gid
# A keeper answers only its own user, which it learns with SO_PEERCRED (Linux): where there
# is none (macOS), connections are not kept and every command connects itself.
SUPPORTED = hasattr(socket, "SO_PEERCRED")


# What a background server (a keeper, the resident command server) keeps of the environment
# of the command that starts it: what running tpufab, loading its modules and reaching the
# workers need, and the cloud API's own settings (API_ENV), never a secret: it outlives that
# command by minutes, and would hold its secrets that long (/proc/PID/environ).
SERVER_ENV = ("PATH", "HOME", "USER", "LOGNAME", "SHELL", "LANG", "LANGUAGE", "TZ", "TMPDIR",
              "PYTHONPATH", "PYTHONHOME", "PYTHONSAFEPATH", "VIRTUAL_ENV", "SSH_AUTH_SOCK",
              "XDG_RUNTIME_DIR", "XDG_CACHE_HOME", "XDG_CONFIG_HOME")
# The environment a cloud API client reads (credentials' paths, gcloud's config, proxies,
# CA bundles): a keeper asks the API for a command only if the command's is the same.
API_ENV = ("GOOGLE_", "CLOUDSDK_", "GCE_", "SSL_CERT_", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE",
           "HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY", "ALL_PROXY", "http_proxy", "https_proxy",
           "no_proxy", "all_proxy")
SECRET_WORDS = ("TOKEN", "SECRET", "PASSWORD", "PASSWD", "API_KEY", "APIKEY", "PRIVATE_KEY",
                "CREDENTIAL_JSON", "ACCESS_KEY", "AUTH")


def _secret(name: str, value: str) -> bool:
    """A secret by its name (tpufab.quoting's words) or a URL with a password in it."""
    upper = name.upper()
    return any(word in upper for word in SECRET_WORDS) or ("://" in value and "@" in value)


def api_env(environ) -> dict[str, str]:
    """The part of ``environ`` the cloud API's client reads (API_ENV), secrets left out."""
    return {k: v for k, v in environ.items()
            if k.startswith(API_ENV) and not _secret(k, v)}


def server_env(environ) -> dict[str, str]:
    """The environment a background server starts with (see SERVER_ENV)."""
    env = {k: v for k, v in environ.items() if k in SERVER_ENV or k.startswith("LC_")}
    env.update(api_env(environ))
    env["PYTHONWARNINGS"] = "ignore"
    return env


def socket_dir() -> str:
    """The private directory's path (it may not exist yet)."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and os.path.isdir(runtime):
        return os.path.join(runtime, "tpufab")
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "tpufab", "keepers")


def unsafe(path: str | os.PathLike, kind: str) -> str | None:
    """Why ``path`` (a ``"directory"`` or ``"socket"``) must not be used, or None: ours, no
    symlink, and no access for group or others."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    want = stat.S_ISDIR if kind == "directory" else stat.S_ISSOCK
    if not want(st.st_mode):
        return f"it is not a {kind}"
    if st.st_uid != os.getuid():
        return f"it is owned by uid {st.st_uid}, not you (uid {os.getuid()})"
    if st.st_mode & 0o077:
        return f"its mode is {stat.S_IMODE(st.st_mode):04o}, not {0o700 if kind == 'directory' else 0o600:04o}"
    return None


def peer(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end of a unix socket."""
    return PEERCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, PEERCRED.size))


def fingerprint() -> str:
    """What a resident server must share with a command (see the module's docstring)."""
    import hashlib
    import sys

    parts = [str(os.getuid()), sys.executable, sys.version, repr(sys.path)]
    for folder in sys.path:
        try:
            parts.append(str(os.stat(folder or ".").st_mtime_ns))
        except OSError:
            parts.append("-")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))   # tpufab/
    stack = [root]
    while stack:
        folder = stack.pop()
        try:
            entries = sorted(os.scandir(folder), key=lambda e: e.name)
        except OSError:
            continue
        for entry in entries:
            if entry.name.endswith(".py"):
                st = entry.stat()
                parts.append(f"{entry.path[len(root):]} {st.st_mtime_ns} {st.st_size}")
            elif entry.is_dir() and not entry.name.startswith((".", "__pycache__")):
                stack.append(entry.path)
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:20]


def resident_path(print_: str | None = None) -> str:
    """The resident server's socket for this tpufab (``print_``: its fingerprint, if known)."""
    return os.path.join(socket_dir(), f"resident-{print_ or fingerprint()}.sock")


def serving(path: str) -> bool:
    """A server holds the lock beside socket ``path`` (it does for its whole life)."""
    try:
        fd = os.open(path[:-len(".sock")] + ".lock", os.O_RDWR | os.O_CREAT, 0o600)
    except OSError:
        return True   # cannot tell: start none
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except OSError:
        return True
    finally:
        os.close(fd)


def resident_pid() -> int | None:
    """The pid of this tpufab's resident server, if one serves (it writes it in its lock)."""
    path = resident_path()
    if not os.path.isdir(os.path.dirname(path)) or not serving(path):
        return None
    try:
        with open(path[:-len(".sock")] + ".lock") as fh:
            return int(fh.read().strip())
    except (OSError, ValueError):
        return None
