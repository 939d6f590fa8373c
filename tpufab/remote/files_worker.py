"""tpufab files worker: the worker side of put/get. Stdlib only, Python 3.6+.

    python3 -I -S files_worker.py plan|commit|cleanup|list  < request.json

The bytes themselves travel over SFTP on the same SSH connection; this script does what
SFTP cannot do in one round trip: resolve where a transfer lands, say which files are
already identical (by sha256), create directories, check free space, verify every uploaded
file's checksum before renaming it into place, remove partial files, and list a tree with
checksums for `get`. It reads one JSON request on stdin and prints one JSON line.
"""

import errno
import hashlib
import os
import stat
import sys
import time

from tpufab.remote.workerlib import CarriedRunIds, answer, read_json, serve_ops, state_of_run

CHUNK = 1 << 20
RUN_DIR = "~/.tpufab/runs"   # run_worker.py's


def sha256_of(path):
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while True:
            block = fh.read(CHUNK)
            if not block:
                break
            digest.update(block)
    return digest.hexdigest()


def free_bytes(path):
    while path and not os.path.isdir(path):
        path = os.path.dirname(path)
    try:
        st = os.statvfs(path or "/")
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def why(err):
    """A short reason: 'permission denied', 'no space left on device', ..."""
    text = os.strerror(err.errno) if err.errno else str(err)
    return text[:1].lower() + text[1:]


def resolve_root(dest, name, is_dir):
    """Where the source lands, as scp does: into DEST if it is a directory, else as DEST."""
    dest = os.path.expanduser(dest or ".")
    into = dest.endswith("/") or os.path.isdir(dest)
    root = os.path.join(dest, name) if into else dest
    return os.path.abspath(root)


def inside(path, folder):
    return path == folder or path.startswith(folder.rstrip("/") + "/")


def live_runs_over(root):
    """Runs still running (or starting) whose working directory (the deployed checkout) holds
    ``root`` or lies under it: a put there would change their code under them."""
    base = os.path.expanduser(RUN_DIR)
    home = os.path.realpath(os.path.expanduser("~"))
    root = os.path.realpath(root)
    try:
        names = sorted(os.listdir(base))
    except OSError:
        return []
    found, carried = [], CarriedRunIds()
    for name in names:
        rundir = os.path.join(base, name)
        meta = read_json(os.path.join(rundir, "meta.json"))
        if not isinstance(meta, dict) or not isinstance(meta.get("cwd"), str):
            continue
        cwd = os.path.realpath(meta["cwd"])
        # a run started in the home directory reads no checkout there
        if not (inside(cwd, root) or (cwd != home and inside(root, cwd))):
            continue
        if state_of_run(rundir, carried).get("state") in ("running", "starting"):
            found.append({"run": name, "recipe": meta.get("recipe"), "cwd": cwd})
    return found


def not_this_home(dest, home_here):
    """``dest`` is the client's home directory (a shell expanded ``~`` there) and no such
    directory exists on this worker: the sentence that says so, else None."""
    if not home_here or not dest.startswith("/") or \
            not inside(dest, home_here) or os.path.isdir(home_here):
        return None
    return (f"no such directory: {home_here} (the home directory on your machine: quote "
            f"'~/' so that ~ means this worker's home, {os.path.expanduser('~')})")


def plan(request):
    root = resolve_root(request.get("dest"), request["name"], request["is_dir"])
    out = {"root": root, "files": {}, "error": None}
    elsewhere = not_this_home(request.get("dest") or "", request.get("home_here"))
    if elsewhere:
        out["error"] = elsewhere
        return out
    out["live_runs"] = live_runs_over(root)
    if out["live_runs"]:
        return out
    if request["is_dir"]:
        if os.path.exists(root) and not os.path.isdir(root):
            out["error"] = f"not a directory: {root} exists and is a file"
            return out
    elif os.path.isdir(root):
        out["error"] = f"is a directory: {root}"
        return out
    need = 0
    for entry in request["files"]:
        rel = entry["rel"]
        final = os.path.join(root, rel) if rel else root
        try:
            st = os.stat(final)
        except OSError:
            out["files"][rel] = "missing"
            need += entry["size"]
            continue
        if stat.S_ISDIR(st.st_mode):
            out["error"] = f"is a directory: {final}"
            return out
        same = st.st_size == entry["size"] and sha256_of(final) == entry["sha256"]
        if same and stat.S_IMODE(st.st_mode) != entry["mode"]:
            os.chmod(final, entry["mode"])
        out["files"][rel] = "same" if same else "differs"
        if not same:
            need += entry["size"]
    dirs = sorted(set(request.get("dirs", [])) | {os.path.dirname(e["rel"])
                                                  for e in request["files"]})
    try:
        for rel in dirs:
            path = os.path.join(root, rel) if rel else (root if request["is_dir"]
                                                        else os.path.dirname(root))
            if not os.path.isdir(path):
                os.makedirs(path, exist_ok=True)
    except OSError as err:
        out["error"] = f"{why(err)}: {err.filename or root}"
        return out
    free = free_bytes(root)
    out["free"] = free
    if free is not None and need > free:
        out["error"] = f"no space left: {need} bytes needed, {free} free under {os.path.dirname(root)}"
    return out


def remove(paths):
    for path in paths:
        try:
            os.unlink(path)
        except OSError:
            pass


def commit(request):
    """Verify each temp file's sha256, then chmod and rename it over its final name."""
    done, bad = [], []
    for entry in request["files"]:
        tmp, final = entry["tmp"], entry["final"]
        try:
            if sha256_of(tmp) != entry["sha256"]:
                bad.append(final)
                remove([tmp])
                continue
            os.chmod(tmp, entry["mode"])
            os.rename(tmp, final)
            done.append(final)
        except OSError as err:
            remove([tmp])
            return {"committed": done, "mismatch": bad, "error": f"{why(err)}: {final}"}
    return {"committed": done, "mismatch": bad, "error": None}


def free_inodes(path):
    while path and not os.path.isdir(path):
        path = os.path.dirname(path)
    try:
        return os.statvfs(path or "/").f_favail
    except OSError:
        return None


def cleanup(request):
    remove(request["paths"])
    left = [p for p in request["paths"] if os.path.exists(p)]
    near = request.get("near") or "/"
    return {"left": left, "free": free_bytes(near), "inodes": free_inodes(near)}


def special_kind(mode):
    for test, kind in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return kind
    return "a special file"


def listing(request):
    root = os.path.abspath(os.path.expanduser(request["path"]))
    try:
        st = os.stat(root)
    except OSError as err:
        return {"root": root, "error": f"{why(err)}: {root}"}
    files, dirs = [], []
    is_dir = stat.S_ISDIR(st.st_mode)
    if not is_dir:
        if request.get("want") == "dir":
            return {"root": root, "error": f"not a directory: {root}"}
        if not stat.S_ISREG(st.st_mode):
            # Refused before a byte is read: a FIFO or /dev/zero would never end.
            return {"root": root, "error": f"not a regular file or directory: {root} is "
                                           f"{special_kind(st.st_mode)}"}
        paths = [("", root)]
    else:
        paths = []
        for folder, subdirs, names in os.walk(root):
            subdirs.sort()
            rel_folder = os.path.relpath(folder, root)
            rel_folder = "" if rel_folder == "." else rel_folder
            dirs.append(rel_folder)
            for name in sorted(names):
                paths.append((os.path.join(rel_folder, name), os.path.join(folder, name)))
    for rel, path in paths:
        try:
            st = os.stat(path)
            if not stat.S_ISREG(st.st_mode):
                continue
            files.append({"rel": rel, "size": st.st_size, "mode": stat.S_IMODE(st.st_mode),
                          "sha256": sha256_of(path)})
        except OSError as err:
            if err.errno in (errno.EACCES, errno.EPERM):
                return {"root": root, "error": f"{why(err)}: {path}"}
    return {"root": root, "is_dir": is_dir, "files": files, "dirs": dirs, "error": None}


def serve(request):
    """Serve files to the other workers (the relay): ``TOKEN INDEX\n`` -> 8-byte size + bytes.

    Exits once every expected client has said ``TOKEN BYE`` or nothing happened for
    ``idle`` seconds. Bound to this worker's internal address; the token came on stdin.
    """
    import hmac
    import socket
    import threading

    paths = request["files"]
    token = request["token"].encode()
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind((request["bind"], 0))
    listener.listen(128)
    idle = float(request.get("idle", 60))
    listener.settimeout(0.2)
    answer("port", {"port": listener.getsockname()[1]})
    left = [int(request["clients"])]
    lock = threading.Lock()
    last = [time.time()]

    def wake():
        last[0] = time.time()

    def handle(conn):
        # One connection per client; it counts as done when it closes, whatever happened.
        try:
            with conn:
                reader = conn.makefile("rb")
                for line in reader:
                    tok, _, what = line.strip().partition(b" ")
                    if not hmac.compare_digest(tok, token) or what == b"BYE":
                        return
                    with open(paths[int(what)], "rb") as fh:
                        size = os.fstat(fh.fileno()).st_size
                        conn.sendall(size.to_bytes(8, "big"))
                        conn.sendfile(fh)
        except (OSError, ValueError, IndexError):
            pass
        finally:
            with lock:
                left[0] -= 1
            wake()

    while True:
        with lock:
            if left[0] <= 0:
                break
        try:
            conn, _ = listener.accept()
        except TimeoutError:
            if time.time() - last[0] > idle:
                break
            continue
        wake()
        threading.Thread(target=handle, args=(conn,), daemon=True).start()
    listener.close()
    return {"served": True, "clients_left": left[0]}


def pull(request):
    """Fetch files from a serving worker into temp names, verify sha256, rename into place."""
    import socket

    host, port = request["source"]
    token = request["token"].encode()
    try:
        sock = socket.create_connection((host, int(port)),
                                        timeout=float(request.get("timeout", 60)))
    except OSError as err:
        return {"committed": [], "mismatch": [], "bytes": 0, "unreachable": True,
                "error": f"cannot reach {host}:{port}: {why(err)}"}
    reader = sock.makefile("rb")
    moved, last = 0, 0
    written = []   # temp files, renamed into place only once every file arrived intact
    try:
        for entry in request["files"]:
            tmp, final = entry["tmp"], entry["final"]
            sock.sendall(token + b" " + str(entry["index"]).encode() + b"\n")
            size = int.from_bytes(reader.read(8), "big")
            digest = hashlib.sha256()
            written.append(tmp)
            with open(tmp, "wb") as out:
                left = size
                while left:
                    block = reader.read(min(CHUNK, left))
                    if not block:
                        raise OSError(errno.ECONNRESET, "the serving worker went away")
                    out.write(block)
                    digest.update(block)
                    left -= len(block)
                    moved += len(block)
                    if moved - last >= 8 * CHUNK:
                        last = moved
                        answer("progress", {"progress": moved})
            if digest.hexdigest() != entry["sha256"]:
                remove(written)
                return {"committed": [], "mismatch": [final], "error": None, "bytes": moved}
        sock.sendall(token + b" BYE\n")
        done = []
        for entry in request["files"]:
            os.chmod(entry["tmp"], entry["mode"])
            os.rename(entry["tmp"], entry["final"])
            done.append(entry["final"])
    except OSError as err:
        remove(written)
        return {"committed": [], "mismatch": [], "bytes": moved,
                "error": "{}: {}".format(why(err), err.filename or request["files"][0]["final"]),
                "no_space": err.errno in (errno.ENOSPC, errno.EDQUOT)}
    finally:
        sock.close()
    return {"committed": done, "mismatch": [], "error": None, "bytes": moved}


OPS = {"plan": plan, "commit": commit, "cleanup": cleanup, "list": listing, "serve": serve,
       "pull": pull}


if __name__ == "__main__":
    sys.exit(serve_ops("files_worker", OPS))
