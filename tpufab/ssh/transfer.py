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
from tpufab.errors import CodeBusy, ConfigError, TpufabError
from tpufab.reports import Column, Report, last_line, text
from tpufab.ssh.connections import lost_mid_transfer
from tpufab.ssh.remote_files import (
    RemoteFile,
    parse_answer,
    python_command,
    read_answer,
    run_with_files,
)
from tpufab.ssh.results import FanoutInterrupted

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
class TransferRow:
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


def _moved(row: TransferRow) -> str:
    """``3 files, 1 already there, 1.2 GiB``."""
    parts = [_count(row.files, "file")]
    if row.skipped:
        parts.append(f"{row.skipped} already there")
    return ", ".join([*parts, human_bytes(row.bytes)])


# the slowest worker's time
TRANSFER_COLUMNS = (Column("MOVED", _moved),
                    Column("TIME", over=lambda rows: f"{max(r.seconds for r in rows):.1f} s"))


@dataclass(kw_only=True)
class TransferReport(Report):
    """One :class:`TransferRow` per worker (``tpufab.reports.Report``), shown as lines
    ``put: w[0-63]  3 files, 1.2 GiB, 4.1 s`` (the slowest worker's time), one per outcome."""

    columns: tuple[Column, ...] = TRANSFER_COLUMNS
    lines: bool = True

    def __post_init__(self) -> None:
        self.rows = sorted(self.rows, key=lambda r: r.worker)
        self.prefix = self.prefix or f"{self.step}: "

    def check(self) -> TransferReport:
        failed = self.failed
        if failed:
            groups: dict[str, list[int]] = {}
            for row in failed:
                groups.setdefault(row.error or "", []).append(row.worker)
            what = "; ".join(f"{nodeset.fold(ws)}: {err}" for err, ws in groups.items())
            raise TransferError(f"{self.step} failed on {len(failed)} of {len(self.rows)} "
                                f"workers: {what}.", self, details="\n".join(text(self)))
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


def special_kind(mode: int) -> str:
    """``a FIFO``, ``a character device``...: what a file that is not a regular one is."""
    for test, kind in ((stat.S_ISLNK, "a symlink"), (stat.S_ISFIFO, "a FIFO"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a directory")):
        if test(mode):
            return kind
    return "a special file"


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
    if not stat.S_ISDIR(st.st_mode) and not stat.S_ISREG(st.st_mode):
        # Refused before a byte is read: hashing a FIFO or /dev/zero would never end.
        raise ConfigError(f"{local} is {special_kind(st.st_mode)} here, not a file or a "
                          "directory; put copies regular files and directories only.")
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


class _Timed:
    """The fan-out with one put's or get's ``timeout`` as the default of each step: passed
    explicitly on every run (and to SFTP), never by changing the shared Fanout."""

    def __init__(self, fanout, timeout: float):
        self._fanout = fanout
        self._timeout = timeout
        self.command_timeout = None if timeout == float("inf") else timeout

    def run(self, *args, timeout: float | None = None, **kwargs):
        return self._fanout.run(*args, timeout=self._timeout if timeout is None else timeout,
                                **kwargs)

    def __getattr__(self, name: str):
        return getattr(self._fanout, name)


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
            from tpufab.ssh.results import LineCallback

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
    answer = read_answer(r.stdout)
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
        concurrency: int = DEFAULT_CONCURRENCY, timeout: float | None = None) -> TransferReport:
    """Copy a local file or directory to ``remote`` on every selected worker.

    ``remote`` defaults to the home directory; as with scp, a source lands *inside* an
    existing remote directory (or one given with a trailing ``/``), else *as* ``remote``.
    Files already identical (sha256) are skipped. ``peers`` maps workers to addresses the
    other workers can reach (internal IPs): with it, several workers are served by one
    upload (the relay). ``timeout``: seconds a worker may go without answering, during a
    step or the copy (None: the fan-out's command_timeout). Returns the per-worker report
    (``.check()`` raises on failures).
    """
    if timeout is not None:
        fanout = _Timed(fanout, timeout)
    files, dirs, is_dir = scan_local(local)
    name = Path(local).expanduser().resolve().name
    chosen = fanout.select(workers)
    progress = progress or Progress()
    started = time.perf_counter()
    rows = {w: TransferRow(w) for w in chosen}
    request = {"dest": remote or ".", "name": name, "is_dir": is_dir, "dirs": dirs,
               "files": [{"rel": f.rel, "size": f.size, "mode": f.mode, "sha256": f.sha256}
                         for f in files], "home_here": str(Path.home())}
    plans: dict[int, _PutPlan] = {}
    answers = _call(fanout, "plan", {w: request for w in chosen})
    _refuse_a_live_checkout(answers)
    for worker, answer in answers.items():
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
                rows[w] = TransferRow(w, skipped=rows[w].skipped)
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
    return TransferReport(step="put", rows=list(rows.values()))


def _refuse_a_live_checkout(answers: Mapping[int, dict]) -> None:
    """As ``deploy`` does: nothing goes into the checkout a live run reads (the files worker's
    plan names such runs; the check costs no round trip of its own)."""
    runs: dict[tuple, list[int]] = {}
    for worker, answer in answers.items():
        for run in answer.get("live_runs") or []:
            if isinstance(run, dict):
                key = (_text(run.get("run")), _text(run.get("recipe") or "a recipe"),
                       _text(run.get("cwd")), _text(answer.get("root")))
                runs.setdefault(key, []).append(worker)
    if runs:
        (run, recipe, cwd, root), workers = next(iter(runs.items()))
        raise CodeBusy(f"Run {run} ({recipe}) is running in {cwd} on {nodeset.fold(workers)}, "
                       f"and putting {root} there would change its code under it: wait for it "
                       f"to end (`tpufab logs --run {run} --follow`), stop it (`tpufab kill "
                       f"--run {run}`), or put the files elsewhere.")


def _put_error(worker: int, answer: dict) -> str:
    error = answer["error"]
    if error.startswith("is a directory"):
        return f"{error} (a file was expected there: give a file name, or end the path with / " \
               "to copy into it)"
    if error.startswith("no space left"):
        return f"{error} on {nodeset.label(worker)}; nothing was written"
    return error


def _upload_all(fanout, plans: Mapping[int, _PutPlan], token: str,
                rows: dict[int, TransferRow], progress: Progress, concurrency: int) -> None:
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


def _upload(fanout, plan: _PutPlan, token: str, row: TransferRow, progress: Progress,
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
    return lost_mid_transfer(err) or text


def _relay(fanout, seed_plan: _PutPlan, files: Sequence[LocalFile],
           relayed: Mapping[int, _PutPlan], seed_address: str, token: str,
           rows: dict[int, TransferRow], progress: Progress) -> dict[int, _PutPlan]:
    """The seed serves every file to the relayed workers; returns those that must fall back."""
    index = {f.rel: i for i, f in enumerate(files)}
    secret = secrets.token_hex(16)
    port: list[int] = []
    got_port = threading.Event()

    def on_serve_line(worker, stream, line):
        found = parse_answer(line) if stream == "stdout" else None
        if found is not None and found[0] == "port":
            port.append(found[1]["port"])
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
        found = parse_answer(line) if stream == "stdout" else None
        if found is not None and found[0] == "progress":
            now = found[1]["progress"]
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
        concurrency: int = DEFAULT_CONCURRENCY, timeout: float | None = None) -> TransferReport:
    """Copy ``remote`` (file or directory) from every selected worker to ``local``.

    Several workers: ``local/w0/NAME``, ``local/w1/NAME``...; one worker: into ``local`` if
    it is a directory, else as ``local``. Files already identical locally are skipped; each
    file is checked against the worker's sha256 and renamed into place. ``timeout`` as for
    ``put``.

    A worker's listing is data to check, not paths and modes to obey: every file must land
    under ``local`` (no ``..``, no absolute path, no symlink on the way), an existing
    symlink, FIFO, device or socket is never replaced, and modes lose setuid, setgid and
    sticky and respect the umask (as OpenSSH's sftp and scp do). A worker whose listing
    fails that is refused in one sentence before anything of it is written.
    """
    if timeout is not None:
        fanout = _Timed(fanout, timeout)
    chosen = fanout.select(workers)
    progress = progress or Progress()
    rows = {w: TransferRow(w) for w in chosen}
    listings = _call(fanout, "list", {w: {"path": remote} for w in chosen})
    base = Path(local).expanduser()
    umask = _umask()
    jobs: dict[int, _GetPlan] = {}
    for w, answer in listings.items():
        if answer.get("error"):
            rows[w].error = _text(answer["error"])
            continue
        try:
            jobs[w] = _plan_get(w, answer, base, several=len(chosen) > 1, umask=umask)
        except _Refused as refused:
            rows[w].error = str(refused)
    total = sum(f.size for plan in jobs.values() for f in plan.files)
    progress.start(total, len(chosen))
    token = secrets.token_hex(8)
    stop = threading.Event()

    def one(worker: int) -> None:
        row = rows[worker]
        began = time.perf_counter()
        try:
            _download(fanout, jobs[worker], token, row, progress, stop)
        except OSError as err:
            row.error = lost_mid_transfer(err) or _local_error(err)
        except Exception as err:  # noqa: BLE001 - becomes this worker's row
            row.error = lost_mid_transfer(err) or str(err) or type(err).__name__
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
    return TransferReport(step="get", rows=list(rows.values()))


class _Refused(Exception):
    """A worker's listing that ``get`` will not follow; the message is its row's sentence."""


@dataclass(frozen=True)
class _GetFile:
    remote: str          # the worker's path
    final: Path          # where it lands here (checked: under LOCAL, nothing special on the way)
    size: int
    mode: int            # the worker's mode, without setuid/setgid/sticky, under the umask
    sha256: str


@dataclass(frozen=True)
class _GetPlan:
    worker: int
    root: Path
    dirs: tuple[Path, ...]
    files: tuple[_GetFile, ...]


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _text(value) -> str:
    """A worker's free text, made printable (it reaches the terminal in the error sentence)."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in str(value))[:500]


_SHA256 = frozenset("0123456789abcdef")


def _parts(worker: int, rel, what: str) -> list[str]:
    """The components of a relative path a worker named, or _Refused: no ``..``, no ``.``, no
    absolute path, no empty component, no NUL, nothing but a string."""
    if not isinstance(rel, str) or "\0" in rel or rel.startswith("/") or any(
            part in ("", ".", "..") for part in rel.split("/")):
        raise _Refused(f"refused: {nodeset.label(worker)}'s listing names {_text(repr(rel))} "
                       f"as {what}, which would not stay under LOCAL; nothing from "
                       f"{nodeset.label(worker)} was written")
    return rel.split("/")


def _walk_here(worker: int, anchor: str, parts: Sequence[str], *, last_is_file: bool,
               seen: dict[str, bool]) -> list[str]:
    """``parts`` below ``anchor``, checked along the way: no existing component is a symlink
    (or a non-directory where a directory goes), and an existing final file is a regular file.
    ``seen``: directories already found real (True) or absent (False), for a whole tree.
    (Strings, not Paths: a listing can hold a million files.)"""
    path = anchor
    for n, part in enumerate(parts):
        path = f"{path}/{part}" if path != "/" else f"/{part}"
        final = n == len(parts) - 1
        if not final and path in seen:
            if seen[path]:
                continue
            return list(parts)
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            if not final:
                seen[path] = False
            return list(parts)                  # the rest is created by get
        if stat.S_ISLNK(st.st_mode) or (final and last_is_file and not (
                stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode))):
            raise _Refused(f"refused: {path} exists here and is {special_kind(st.st_mode)}, "
                           "which get never writes through or replaces (remove it or choose "
                           f"another LOCAL); nothing from {nodeset.label(worker)} was written")
        if final and last_is_file:
            if stat.S_ISDIR(st.st_mode):
                raise _Refused(f"{path} is a directory here")
        elif not stat.S_ISDIR(st.st_mode):
            raise _Refused(f"{path} exists here and is not a directory")
        elif not final:
            seen[path] = True
    return list(parts)


def _plan_get(worker: int, answer: dict, base: Path, *, several: bool, umask: int) -> _GetPlan:
    """Where each file of ``answer`` (a worker's listing) lands here; _Refused says why not."""
    label = nodeset.label(worker)
    not_understood = _Refused(f"refused: {label}'s listing is not one get understands; "
                              f"nothing from {label} was written")
    try:
        remote_root = answer["root"]
        is_dir = answer["is_dir"]
        entries = answer["files"]
        dirs = answer.get("dirs") or []
    except (KeyError, TypeError):
        raise not_understood from None
    if not (isinstance(remote_root, str) and isinstance(is_dir, bool)
            and isinstance(entries, list) and isinstance(dirs, list)):
        raise not_understood
    name = os.path.basename(remote_root.rstrip("/")) or "root"
    _parts(worker, name, "the name of what it sends")
    # LOCAL as the user named it (a symlink to a directory is theirs to choose): checked
    # below its resolved path, written (and reported) as the user spelled it.
    if base.is_dir() or base.name in ("", ".", ".."):
        named, top = base, []
    else:
        named, top = base.parent, [base.name]
    anchor = os.path.realpath(named)
    if several:
        root_parts = [*top, label, name]
    elif top:
        root_parts = top
    else:
        root_parts = [name]
    checked: dict[str, bool] = {}
    _walk_here(worker, anchor, root_parts, last_is_file=not is_dir, seen=checked)
    root = named.joinpath(*root_parts)
    files, seen = [], set()
    for entry in entries:
        try:
            rel, size, mode, digest = entry["rel"], entry["size"], entry["mode"], entry["sha256"]
        except (KeyError, TypeError):
            raise not_understood from None
        if not (isinstance(size, int) and size >= 0 and isinstance(mode, int)
                and 0 <= mode <= 0o7777 and isinstance(digest, str) and len(digest) == 64
                and set(digest) <= _SHA256):
            raise _Refused(f"refused: {label}'s listing gives {_text(repr(rel))} a size, mode "
                           f"or checksum that is not one; nothing from {label} was written")
        if is_dir:
            parts = _parts(worker, rel, "a file")
            _walk_here(worker, anchor, [*root_parts, *parts], last_is_file=True, seen=checked)
            final = f"{root}/{rel}"
            remote_path = f"{remote_root.rstrip('/')}/{rel}"
        elif rel == "" and not files:
            final, remote_path = str(root), remote_root
        else:
            raise _Refused(f"refused: {label}'s listing names {_text(repr(rel))} inside a "
                           f"single file; nothing from {label} was written")
        if final in seen:
            raise _Refused(f"refused: {label}'s listing names {_text(repr(rel))} twice; "
                           f"nothing from {label} was written")
        seen.add(final)
        # As OpenSSH's sftp and scp: no setuid, setgid or sticky bit, and the umask applies.
        files.append(_GetFile(remote_path, Path(final), size, mode & 0o777 & ~umask, digest))
    here = []
    if is_dir:
        here.append(root)
        for rel in dirs:
            if rel == "":
                continue
            _walk_here(worker, anchor, [*root_parts, *_parts(worker, rel, "a directory")],
                       last_is_file=False, seen=checked)
            here.append(root / rel)
    return _GetPlan(worker, root, tuple(here), tuple(files))


def _local_error(err: OSError) -> str:
    import errno

    if err.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        return "no space left on this machine; the partial file was removed"
    if err.errno in (errno.EACCES, errno.EPERM):
        return f"permission denied writing {err.filename} on this machine"
    return f"{err.strerror or err}: {err.filename}" if err.filename else str(err)


def _download(fanout, plan: _GetPlan, token: str, row: TransferRow, progress: Progress,
              stop: threading.Event) -> None:
    for folder in plan.dirs:
        folder.mkdir(parents=True, exist_ok=True)
    plan.root.parent.mkdir(parents=True, exist_ok=True)
    sftp = None
    try:
        for entry in plan.files:
            final = entry.final
            if final.is_file() and not final.is_symlink() and \
                    final.stat().st_size == entry.size and sha256_file(final) == entry.sha256:
                os.chmod(final, entry.mode)
                row.skipped += 1
                progress.advance(entry.size)
                continue
            if sftp is None:
                sftp = _sftp(fanout, plan.worker)
            final.parent.mkdir(parents=True, exist_ok=True)
            tmp = Path(_tmp_name(str(final), token))
            try:
                _fetch(sftp, entry, tmp, progress, stop)
                os.replace(tmp, final)
            except BaseException:
                tmp.unlink(missing_ok=True)
                raise
            row.files += 1
            row.bytes += entry.size
            row.paths.append(str(final))
    finally:
        if sftp is not None:
            sftp.close()


def _fetch(sftp, entry: _GetFile, tmp: Path, progress: Progress,
           stop: threading.Event) -> None:
    """The worker's file into ``tmp`` (created here, never an existing file): exactly the size
    the listing gave, checked against its sha256, then given its (cleaned) mode."""
    digest = hashlib.sha256()
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0),
                 0o600)
    with os.fdopen(fd, "wb") as dst:
        src = sftp.open(entry.remote, "rb")
        senders = _prefetch(src, entry.size)
        try:
            left = entry.size
            while left:
                if stop.is_set():
                    raise KeyboardInterrupt
                block = src.read(min(CHUNK, left))
                if not block:
                    break
                dst.write(block)
                digest.update(block)
                left -= len(block)
                progress.advance(len(block))
        finally:
            src.close()     # reads the answers still on their way
            for thread in senders:
                thread.join(10)
        if left or digest.hexdigest() != entry.sha256:
            raise TpufabError(f"checksum mismatch for {entry.remote} (it changed while "
                              "being copied?)")
        os.fchmod(dst.fileno(), entry.mode)


def _prefetch(src, size: int) -> list[threading.Thread]:
    """``src.prefetch(size)``; returns the thread paramiko starts to send the read requests.
    It must be done before the SFTP channel closes, or it dies printing a traceback (seen
    1 time in 4 when the local disk filled mid-copy): the caller joins it."""
    before = set(threading.enumerate())
    src.prefetch(size)
    # this file's thread only (its target is a method of ``src``): another worker's copy may
    # be starting its own at this moment, and joining a thread not yet started raises
    # "cannot join thread before it is started" (seen once in CI, on a get from four workers)
    return [t for t in threading.enumerate()
            if t not in before and getattr(getattr(t, "_target", None), "__self__", None) is src]
