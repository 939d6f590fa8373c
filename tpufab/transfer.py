"""put / get: files and directory trees to and from every worker, verified and atomic.

Bytes travel over SFTP on the SSH transport each worker's fan-out connection already holds
(no new handshake); what SFTP cannot do in one round trip (resolve where a transfer lands,
say which files are already identical, check free space, verify a checksum, rename into
place, list a tree with checksums) is done by ``remote/files_worker.py``, shipped by hash.

Every file is written under a temporary name next to its final one, its sha256 checked,
then renamed: an interrupted or failed transfer never leaves a partial file under the final
name. ``put`` to many workers can relay: the client uploads once to one worker, which
serves the files to the others over the pod's internal network (a one-shot listener with a
random token); a worker that cannot reach it gets its files over SFTP instead. See
docs/files.md.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import stat
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from tpufab import nodeset
from tpufab.errors import ConfigError, TpufabError
from tpufab.fanout import FanoutInterrupted
from tpufab.remote_files import (
    RemoteFile,
    last_json,
    last_line,
    python_command,
    run_with_files,
)

CHUNK = 1 << 18
DEFAULT_CONCURRENCY = 16


class TransferError(TpufabError):
    """A put or get failed on one or more workers; ``report`` has every worker's row."""

    def __init__(self, message: str, report: TransferReport, **kwargs):
        super().__init__(message, **kwargs)
        self.report = report


# ---------------------------------------------------------------------------------------------
# records


@dataclass(frozen=True)
class LocalFile:
    rel: str            # "" for a single file, else the path under the copied directory
    path: Path
    size: int
    mode: int
    sha256: str


@dataclass
class WorkerTransfer:
    """What one worker got (put) or gave (get)."""

    worker: int
    files: int = 0         # transferred
    skipped: int = 0       # already identical
    bytes: int = 0
    seconds: float = 0.0
    error: str | None = None
    paths: list[str] = field(default_factory=list)   # final paths written (remote or local)

    @property
    def ok(self) -> bool:
        return self.error is None


class TransferReport:
    """One :class:`WorkerTransfer` per worker; ``lines()`` folds workers that agree."""

    def __init__(self, verb: str, rows: Mapping[int, WorkerTransfer]):
        self.verb = verb
        self.rows = dict(sorted(rows.items()))

    @property
    def failed(self) -> list[WorkerTransfer]:
        return [r for r in self.rows.values() if not r.ok]

    @property
    def ok(self) -> bool:
        return not self.failed

    def lines(self) -> list[str]:
        """``w[0-63] 3 files, 1.2 GiB, 4.1 s`` (slowest worker's time), one per outcome."""
        groups: dict[tuple, list[WorkerTransfer]] = {}
        for row in self.rows.values():
            key = (row.error,) if row.error else (row.files, row.skipped, row.bytes)
            groups.setdefault(key, []).append(row)
        out = []
        for key, rows in groups.items():
            who = nodeset.fold(r.worker for r in rows)
            if key[0] is not None and len(key) == 1:
                out.append(f"{who} failed: {key[0]}")
                continue
            row = rows[0]
            parts = [_count(row.files, "file")]
            if row.skipped:
                parts.append(f"{row.skipped} already there")
            parts += [human_bytes(row.bytes), f"{max(r.seconds for r in rows):.1f} s"]
            out.append(f"{who} {', '.join(parts)}")
        return out

    def check(self) -> TransferReport:
        failed = self.failed
        if failed:
            groups: dict[str, list[int]] = {}
            for row in failed:
                groups.setdefault(row.error or "", []).append(row.worker)
            what = "; ".join(f"{nodeset.fold(ws)}: {err}" for err, ws in groups.items())
            raise TransferError(f"{self.verb} failed on {len(failed)} of {len(self.rows)} "
                                f"workers: {what}.", self, details="\n".join(self.lines()))
        return self


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


class Progress:
    """Progress seam: bytes moved and workers finished. The default shows nothing."""

    def start(self, total_bytes: int, workers: int) -> None:
        pass

    def advance(self, nbytes: int) -> None:
        pass

    def worker_done(self, worker: int) -> None:
        pass

    def stop(self) -> None:
        pass


# ---------------------------------------------------------------------------------------------
# local side (pure-ish: reads the local tree)


def sha256_file(path: Path, progress: Callable[[int], None] | None = None) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


def scan_local(local: str | os.PathLike[str]) -> tuple[list[LocalFile], list[str], bool]:
    """The files (with sha256 and mode) and directories under ``local``; raises one sentence."""
    path = Path(local).expanduser()
    try:
        st = path.stat()
    except FileNotFoundError:
        raise ConfigError(f"{local} does not exist here; check the local path (put copies "
                          "a file or directory from this machine).") from None
    except PermissionError:
        raise ConfigError(f"Permission denied reading {local} on this machine.") from None
    try:
        if not stat.S_ISDIR(st.st_mode):
            return [LocalFile("", path, st.st_size, stat.S_IMODE(st.st_mode),
                              sha256_file(path))], [], False
        files, dirs = [], []
        for folder, subdirs, names in os.walk(path):
            subdirs.sort()
            rel_folder = os.path.relpath(folder, path)
            dirs.append("" if rel_folder == "." else rel_folder)
            for name in sorted(names):
                full = Path(folder) / name
                fst = full.stat()
                if not stat.S_ISREG(fst.st_mode):
                    continue
                rel = os.path.normpath(os.path.join(rel_folder, name))
                files.append(LocalFile(rel, full, fst.st_size, stat.S_IMODE(fst.st_mode),
                                       sha256_file(full)))
        return files, dirs, True
    except PermissionError as err:
        raise ConfigError(f"Permission denied reading {err.filename} on this machine.") from None


# ---------------------------------------------------------------------------------------------
# worker side calls


def _worker_script() -> RemoteFile:
    return RemoteFile.bundled("files_worker.py")


def _call(fanout, op: str, requests: Mapping[int, dict], *, on_line=None,
          timeout: float | None = None) -> dict[int, dict]:
    """Run ``files_worker.py OP`` with a per-worker JSON request; {worker: answer or error}."""
    script = _worker_script()
    line = python_command(script, [op])
    answers: dict[int, dict] = {}
    by_request: dict[str, list[int]] = {}
    for worker, request in requests.items():
        by_request.setdefault(json.dumps(request, sort_keys=True), []).append(worker)

    def one(item):
        body, workers = item
        kwargs = {"stdin": body.encode(), "timeout": timeout}
        if on_line is not None:
            from tpufab.fanout import LineCallback

            kwargs["sink"] = LineCallback(on_line)
        return run_with_files(fanout, [script], line, workers, **kwargs)

    items = list(by_request.items())
    if len(items) == 1:
        results = [one(items[0])]
    else:
        with ThreadPoolExecutor(max_workers=min(16, len(items)),
                                thread_name_prefix="tpufab-files") as pool:
            results = list(pool.map(one, items))
    for result in results:
        for worker, r in result.items():
            answers[worker] = _answer(r)
    return answers


def _answer(r) -> dict:
    """A worker's JSON answer, or ``{"error": ..., "_failed": True}`` saying why there is none."""
    if getattr(r, "error", None):  # the transport's: the worker did not answer (or not at all)
        return {"error": r.error, "_failed": True, "_silent": True}
    answer = last_json(r.stdout)
    if r.exit_code != 0 or answer is None:
        why = last_line(r.stderr)
        return {"error": f"files worker exit {r.exit_code}" + (f": {why}" if why else ""),
                "_failed": True}
    return answer


def _tmp_name(final: str, token: str) -> str:
    head, tail = os.path.split(final)
    return os.path.join(head, f".{tail}.tpufab-{token}.part")


def _no_space_sentence(worker: int, free: int | None, where: str) -> str:
    room = f"{human_bytes(free)} free" if free is not None else "disk full"
    return (f"no space left on {nodeset.label(worker)} under {os.path.dirname(where) or where} "
            f"({room}); the partial files were removed")


# ---------------------------------------------------------------------------------------------
# put


@dataclass
class _PutPlan:
    worker: int
    root: str
    needed: list[LocalFile]
    skipped: int

    def final(self, f: LocalFile) -> str:
        return os.path.join(self.root, f.rel) if f.rel else self.root


def put(fanout, local: str | os.PathLike[str], remote: str | None = None, *, workers=None,
        peers: Mapping[int, str] | None = None, progress: Progress | None = None,
        concurrency: int = DEFAULT_CONCURRENCY) -> TransferReport:
    """Copy a local file or directory to ``remote`` on every selected worker.

    ``remote`` defaults to the home directory; as with scp, a source lands *inside* an
    existing remote directory (or one given with a trailing ``/``), else *as* ``remote``.
    Files already identical (sha256) are skipped. ``peers`` maps workers to addresses the
    other workers can reach (internal IPs): with it, several workers are served by one
    upload (the relay). Returns the per-worker report (``.check()`` raises on failures).
    """
    files, dirs, is_dir = scan_local(local)
    name = Path(local).expanduser().resolve().name
    chosen = fanout.select(workers)
    progress = progress or Progress()
    started = time.perf_counter()
    rows = {w: WorkerTransfer(w) for w in chosen}
    request = {"dest": remote or ".", "name": name, "is_dir": is_dir, "dirs": dirs,
               "files": [{"rel": f.rel, "size": f.size, "mode": f.mode, "sha256": f.sha256}
                         for f in files]}
    plans: dict[int, _PutPlan] = {}
    for worker, answer in _call(fanout, "plan", {w: request for w in chosen}).items():
        if answer.get("error"):
            rows[worker].error = _put_error(worker, answer)
            continue
        status = answer["files"]
        needed = [f for f in files if status.get(f.rel) != "same"]
        plans[worker] = _PutPlan(worker, answer["root"], needed, len(files) - len(needed))
    token = secrets.token_hex(8)
    todo = {w: p for w, p in plans.items() if p.needed}
    progress.start(sum(f.size for p in todo.values() for f in p.needed), len(chosen))
    for w, p in plans.items():
        rows[w].skipped = p.skipped
        if not p.needed:
            progress.worker_done(w)
    try:
        direct = dict(todo)
        relayed: dict[int, _PutPlan] = {}
        if peers and len(todo) > 1:
            seed = min(todo, key=lambda w: (-len(todo[w].needed), w))
            direct = {seed: todo[seed]}
            relayed = {w: p for w, p in todo.items() if w != seed}
        _upload_all(fanout, direct, token, rows, progress, concurrency)
        if relayed:
            seed = next(iter(direct))
            if rows[seed].ok:
                fallback = _relay(fanout, plans[seed], files, relayed, peers[seed], token, rows,
                                  progress)
            else:
                fallback = relayed
            for w in fallback:
                rows[w] = WorkerTransfer(w, skipped=rows[w].skipped)
            _upload_all(fanout, fallback, token, rows, progress, concurrency)
    except (KeyboardInterrupt, FanoutInterrupted):
        _cleanup(fanout, todo, token)
        raise TpufabError(f"Interrupted: put stopped on {nodeset.fold(chosen)}; no partial "
                          "file was left under a final name.", exit_code=130) from None
    finally:
        progress.stop()
    elapsed = time.perf_counter() - started
    for row in rows.values():
        if not row.seconds:
            row.seconds = elapsed
    return TransferReport("put", rows)


def _put_error(worker: int, answer: dict) -> str:
    error = answer["error"]
    if error.startswith("is a directory"):
        return f"{error} (a file was expected there: give a file name, or end the path with / " \
               "to copy into it)"
    if error.startswith("no space left"):
        return f"{error} on {nodeset.label(worker)}; nothing was written"
    return error


def _upload_all(fanout, plans: Mapping[int, _PutPlan], token: str,
                rows: dict[int, WorkerTransfer], progress: Progress, concurrency: int) -> None:
    if not plans:
        return
    stop = threading.Event()

    def one(plan: _PutPlan) -> None:
        began = time.perf_counter()
        row = rows[plan.worker]
        try:
            _upload(fanout, plan, token, row, progress, stop)
        except Exception as err:  # noqa: BLE001 - becomes this worker's row
            row.error = _upload_error(fanout, plan, token, err)
        row.seconds = time.perf_counter() - began
        progress.worker_done(plan.worker)

    pool = ThreadPoolExecutor(max_workers=min(concurrency, len(plans)),
                              thread_name_prefix="tpufab-put")
    try:
        _wait_all([pool.submit(one, p) for p in plans.values()])
    except KeyboardInterrupt:
        stop.set()
        pool.shutdown(wait=True, cancel_futures=True)
        raise
    pool.shutdown()


def _wait_all(futures) -> None:
    """Wait for every future; the bounded waits let Ctrl-C through to the main thread."""
    from concurrent.futures import wait

    pending = set(futures)
    while pending:
        _done, pending = wait(pending, timeout=0.5)
    for future in futures:
        future.result()


def _sftp(fanout, worker: int):
    import paramiko

    sftp = paramiko.SFTPClient.from_transport(fanout.transport(worker))
    # a worker whose sftp-server stops answering is given up on after the command timeout
    # (no progress for that long), as every other step is
    sftp.get_channel().settimeout(fanout.command_timeout)
    return sftp


def _upload(fanout, plan: _PutPlan, token: str, row: WorkerTransfer, progress: Progress,
            stop: threading.Event) -> None:
    sftp = _sftp(fanout, plan.worker)
    entries = []
    try:
        for f in plan.needed:
            final = plan.final(f)
            tmp = _tmp_name(final, token)
            entries.append({"tmp": tmp, "final": final, "sha256": f.sha256, "mode": f.mode})
            with open(f.path, "rb") as src, sftp.open(tmp, "wb") as dst:
                dst.set_pipelined(True)
                while block := src.read(CHUNK):
                    if stop.is_set():
                        raise KeyboardInterrupt
                    dst.write(block)
                    progress.advance(len(block))
            row.bytes += f.size
    finally:
        sftp.close()
    answer = _call(fanout, "commit", {plan.worker: {"files": entries}})[plan.worker]
    if answer.get("error") or answer.get("mismatch"):
        bad = answer.get("mismatch") or []
        raise TpufabError(answer.get("error") or
                          f"checksum mismatch after upload for {', '.join(bad)}")
    row.files = len(answer["committed"])
    row.paths = answer["committed"]


def _upload_error(fanout, plan: _PutPlan, token: str, err: Exception) -> str:
    """Remove this worker's partial files; say why it failed in one phrase."""
    tmps = [_tmp_name(plan.final(f), token) for f in plan.needed]
    answer = _call(fanout, "cleanup", {plan.worker: {"paths": tmps, "near": plan.root}}
                   ).get(plan.worker, {})
    text = str(err) or type(err).__name__
    remaining = sum(f.size for f in plan.needed)
    free = answer.get("free")
    inodes = answer.get("inodes")
    # SFTP reports ENOSPC as a bare "Failure": look at the worker's free bytes and inodes.
    if "No space" in text or "no space" in text or (isinstance(err, OSError) and (
            (free is not None and free < min(remaining, 1 << 20))
            or (inodes is not None and inodes < len(plan.needed)))):
        return _no_space_sentence(plan.worker, free, plan.root)
    if isinstance(err, PermissionError) or "ermission denied" in text:
        return f"permission denied writing under {os.path.dirname(plan.root)}"
    return text


def _relay(fanout, seed_plan: _PutPlan, files: Sequence[LocalFile],
           relayed: Mapping[int, _PutPlan], seed_address: str, token: str,
           rows: dict[int, WorkerTransfer], progress: Progress) -> dict[int, _PutPlan]:
    """The seed serves every file to the relayed workers; returns those that must fall back."""
    index = {f.rel: i for i, f in enumerate(files)}
    secret = secrets.token_hex(16)
    port: list[int] = []
    got_port = threading.Event()

    def on_serve_line(worker, stream, line):
        if stream == "stdout" and line.startswith('{"port"'):
            port.append(json.loads(line)["port"])
            got_port.set()

    serve_request = {"bind": seed_address, "token": secret, "clients": len(relayed),
                     "idle": 60, "files": [seed_plan.final(f) for f in files]}
    server_answer: dict = {}

    def serve():
        server_answer.update(_call(fanout, "serve", {seed_plan.worker: serve_request},
                                   on_line=on_serve_line)[seed_plan.worker])
        got_port.set()

    server = threading.Thread(target=serve, name="tpufab-relay", daemon=True)
    server.start()
    while not got_port.wait(0.5):
        pass
    if not port:
        return dict(relayed)
    moved: dict[int, int] = {}

    def on_pull_line(worker, stream, line):
        if stream == "stdout" and line.startswith('{"progress"'):
            now = json.loads(line)["progress"]
            progress.advance(now - moved.get(worker, 0))
            moved[worker] = now

    began = time.perf_counter()
    requests = {}
    for w, plan in relayed.items():
        requests[w] = {"source": [seed_address, port[0]], "token": secret, "files": [
            {"index": index[f.rel], "final": plan.final(f), "mode": f.mode, "sha256": f.sha256,
             "tmp": _tmp_name(plan.final(f), token), "size": f.size} for f in plan.needed]}
    answers = _call(fanout, "pull", requests, on_line=on_pull_line)
    fallback = {}
    for w, answer in answers.items():
        row = rows[w]
        plan = relayed[w]
        progress.advance(sum(f.size for f in plan.needed) - moved.get(w, 0))
        row.seconds = time.perf_counter() - began + rows[seed_plan.worker].seconds
        if answer.get("_silent"):
            # the worker itself did not answer: a direct copy (and a cleanup) would only wait
            # on it again
            row.error = answer["error"]
            continue
        if answer.get("unreachable") or (answer.get("_failed") and not answer.get("no_space")):
            fallback[w] = plan
            continue
        if answer.get("error") or answer.get("mismatch"):
            if answer.get("no_space"):
                row.error = _no_space_sentence(w, None, plan.root)
            else:
                row.error = answer.get("error") or "checksum mismatch: " + \
                    ", ".join(answer["mismatch"])
            _call(fanout, "cleanup", {w: {"paths": [r["tmp"] for r in requests[w]["files"]]}})
            continue
        row.files = len(answer["committed"])
        row.paths = answer["committed"]
        row.bytes = sum(f.size for f in plan.needed)
        progress.worker_done(w)
    if fallback:
        # Pullers that never connected do not say goodbye; the server exits on its idle bound.
        pass
    server.join(timeout=5 if not fallback else 0.1)
    return fallback


def _cleanup(fanout, plans: Mapping[int, _PutPlan], token: str) -> None:
    requests = {w: {"paths": [_tmp_name(p.final(f), token) for f in p.needed]}
                for w, p in plans.items()}
    if requests:
        try:
            _call(fanout, "cleanup", requests, timeout=30)
        except Exception:  # noqa: BLE001 - best effort after Ctrl-C
            pass


# ---------------------------------------------------------------------------------------------
# get


def get(fanout, remote: str, local: str | os.PathLike[str], *, workers=None,
        progress: Progress | None = None,
        concurrency: int = DEFAULT_CONCURRENCY) -> TransferReport:
    """Copy ``remote`` (file or directory) from every selected worker to ``local``.

    Several workers: ``local/w0/NAME``, ``local/w1/NAME``...; one worker: into ``local`` if
    it is a directory, else as ``local``. Files already identical locally are skipped; each
    file is checked against the worker's sha256 and renamed into place.
    """
    chosen = fanout.select(workers)
    progress = progress or Progress()
    rows = {w: WorkerTransfer(w) for w in chosen}
    listings = _call(fanout, "list", {w: {"path": remote} for w in chosen})
    base = Path(local).expanduser()
    jobs: dict[int, tuple[Path, list[dict]]] = {}
    for w, answer in listings.items():
        if answer.get("error"):
            rows[w].error = answer["error"]
            continue
        name = os.path.basename(answer["root"].rstrip("/")) or "root"
        if len(chosen) > 1:
            root = base / nodeset.label(w) / name
        else:
            root = base / name if base.is_dir() else base
        if answer["is_dir"] and root.exists() and not root.is_dir():
            rows[w].error = f"{root} exists here and is not a directory"
            continue
        if not answer["is_dir"] and root.is_dir():
            rows[w].error = f"{root} is a directory here"
            continue
        jobs[w] = (root, answer)
    total = sum(f["size"] for _root, answer in jobs.values() for f in answer["files"])
    progress.start(total, len(chosen))
    token = secrets.token_hex(8)
    stop = threading.Event()

    def one(worker: int) -> None:
        root, answer = jobs[worker]
        row = rows[worker]
        began = time.perf_counter()
        try:
            _download(fanout, worker, answer, root, token, row, progress, stop)
        except OSError as err:
            row.error = _local_error(err)
        except Exception as err:  # noqa: BLE001 - becomes this worker's row
            row.error = str(err) or type(err).__name__
        row.seconds = time.perf_counter() - began
        progress.worker_done(worker)

    pool = ThreadPoolExecutor(max_workers=min(concurrency, max(1, len(jobs))),
                              thread_name_prefix="tpufab-get")
    try:
        _wait_all([pool.submit(one, w) for w in jobs])
        pool.shutdown()
    except KeyboardInterrupt:
        stop.set()   # each download removes its temporary file as it stops
        pool.shutdown(wait=True, cancel_futures=True)
        raise TpufabError(f"Interrupted: get stopped on {nodeset.fold(chosen)}; no partial "
                          "file was left under a final name.", exit_code=130) from None
    finally:
        progress.stop()
    return TransferReport("get", rows)


def _local_error(err: OSError) -> str:
    import errno

    if err.errno == errno.ENOSPC:
        return "no space left on this machine; the partial file was removed"
    if err.errno in (errno.EACCES, errno.EPERM):
        return f"permission denied writing {err.filename} on this machine"
    return f"{err.strerror or err}: {err.filename}" if err.filename else str(err)


def _download(fanout, worker: int, answer: dict, root: Path, token: str,
              row: WorkerTransfer, progress: Progress, stop: threading.Event) -> None:
    for rel in answer.get("dirs", []):
        (root / rel if rel else root).mkdir(parents=True, exist_ok=True)
    root.parent.mkdir(parents=True, exist_ok=True)
    sftp = None
    try:
        for entry in answer["files"]:
            final = root / entry["rel"] if entry["rel"] else root
            if final.is_file() and final.stat().st_size == entry["size"] \
                    and sha256_file(final) == entry["sha256"]:
                os.chmod(final, entry["mode"])
                row.skipped += 1
                progress.advance(entry["size"])
                continue
            if sftp is None:
                sftp = _sftp(fanout, worker)
            remote_path = os.path.join(answer["root"], entry["rel"]) if entry["rel"] \
                else answer["root"]
            tmp = Path(_tmp_name(str(final), token))
            digest = hashlib.sha256()
            try:
                with sftp.open(remote_path, "rb") as src, open(tmp, "wb") as dst:
                    src.prefetch(entry["size"])
                    while block := src.read(CHUNK):
                        if stop.is_set():
                            raise KeyboardInterrupt
                        dst.write(block)
                        digest.update(block)
                        progress.advance(len(block))
                if digest.hexdigest() != entry["sha256"]:
                    raise TpufabError(f"checksum mismatch for {remote_path} (it changed while "
                                      "being copied?)")
                os.chmod(tmp, entry["mode"])
                os.replace(tmp, final)
            except BaseException:
                tmp.unlink(missing_ok=True)
                raise
            row.files += 1
            row.bytes += entry["size"]
            row.paths.append(str(final))
    finally:
        if sftp is not None:
            sftp.close()
