"""profile: capture a trace from a running JAX job's profiler server, bring it back.

Every run's environment names its profiler port (``TPUFAB_PROFILER_PORT``, see
``runs.profiler_port``); recipes call ``jax.profiler.start_server`` on it. A capture runs
``remote/profile_worker.py`` with the job's Python on each selected worker (what
``python -m jax.collect_profile`` does, without the Perfetto upload), then ``transfer.get``
copies the trace directory to ``.tpufab/runs/<run>/profiles/<stamp>/`` here.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from tpufab import nodeset
from tpufab.errors import ConfigError, TpufabError
from tpufab.quoting import Raw, command
from tpufab.reports import Column, Report
from tpufab.ssh.remote_files import RemoteFile, read_answer, run_with_files, verified_args

MAX_AT_ONCE = 256   # captures at once (one thread each, waiting on its worker)
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m)?\s*$")


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B?|B)?\s*$", re.IGNORECASE)
DEFAULT_MAX_SIZE = "2GiB"   # a host's trace brought back at most (a 5 s TPU trace: MiBs to 100s)


def parse_size(text: str | int) -> int:
    """``2GiB`` / ``500MiB`` / ``500MB`` / ``1048576`` (bytes) -> bytes, or one sentence."""
    match = _SIZE.match(str(text))
    if not match or float(match[1]) <= 0:
        raise ConfigError(f"--max-size takes a size such as 2GiB or 500MiB, not {text!r}.")
    unit = (match[2] or "B").upper().rstrip("B").rstrip("I")
    return int(float(match[1]) * 1024 ** " KMGT".index(unit or " "))


def _size(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n / 1024:.0f} KiB"


_BUCKET = re.compile(r"^[a-z0-9][a-z0-9._-]{1,220}[a-z0-9]$")


def check_destination(to: str) -> tuple[str, str]:
    """``gs://BUCKET[/PREFIX]`` as (bucket, prefix without slashes at its ends), or one
    sentence."""
    text = str(to).strip()
    bucket, _, prefix = text[len("gs://"):].partition("/") if text.startswith("gs://") \
        else ("", "", "")
    if not _BUCKET.match(bucket):
        raise ConfigError(f"--to takes a Cloud Storage folder such as gs://my-bucket/profiles, "
                          f"not {to!r}.")
    return bucket, prefix.strip("/")


def upload(store, bucket: str, prefix: str, where: Path) -> tuple[str, int, int]:
    """Every file of the logdir ``where`` to ``gs://bucket/prefix/<its name>/...``, the same
    layout (XProf and TensorBoard read a gs:// logdir as they read a local one): (the gs://
    logdir, files, bytes)."""
    base = "/".join(p for p in (prefix, where.name) if p)
    count = size = 0
    for path in sorted(p for p in where.rglob("*") if p.is_file() and not p.is_symlink()):
        data = path.read_bytes()
        store.put(bucket, f"{base}/{path.relative_to(where).as_posix()}", data)
        count, size = count + 1, size + len(data)
    return f"gs://{bucket}/{base}", count, size


def parse_duration(text: str | float) -> float:
    """``5s`` / ``500ms`` / ``1m`` / ``2.5`` (seconds) -> seconds."""
    match = _DURATION.match(str(text))
    if not match:
        raise ConfigError(f"--duration takes a time such as 5s, 500ms or 1m, not {text!r}.")
    value = float(match[1]) * {"ms": 1e-3, "s": 1.0, "m": 60.0, None: 1.0}[match[2]]
    if not 0.01 <= value <= 3600:
        raise ConfigError(f"--duration {text} is out of range (10ms to 60m).")
    return value


@dataclass
class ProfileRow:
    """What one worker's capture brought back: its trace files (name, size), or why not."""

    worker: int
    files: list[tuple[str, int]] = field(default_factory=list)
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


def _traces(row: ProfileRow) -> str:
    traces = [f for f in row.files if f[0].endswith(".xplane.pb")]
    size = sum(s for _n, s in traces)
    return (f"{len(traces)} trace file{'s' if len(traces) != 1 else ''} "
            f"({size / 1024:.0f} KiB)")


@dataclass(kw_only=True)
class ProfileReport(Report):
    """Every worker's capture (``tpufab.reports.Report``): ``profile: w[0-3]  1 trace file
    (12 KiB)``, then where the traces are and how to view them."""

    step: str = "profile"
    columns: tuple[Column, ...] = (Column("TRACES", _traces),)
    lines: bool = True
    prefix: str = "profile: "
    run: str
    local_dir: Path
    uploaded: str | None = None   # the gs:// logdir it was copied to (profile --to)

    @property
    def files(self) -> dict[int, list[tuple[str, int]]]:
        return {r.worker: r.files for r in self.rows if r.ok}

    @property
    def errors(self) -> dict[int, str]:
        return {r.worker: r.error for r in self.failed}


Captured = ProfileReport   # the 0.1 name (docs/api.md), until 0.2


def _running_run(fanout, workers: Sequence[int], run: str | None) -> str:
    from tpufab.steps.runs import running as jobs

    statuses = jobs.statuses(fanout, workers)
    if run is not None:
        return run
    running = [(e.get("started_at") or 0, e["run"]) for s in statuses.values() for e in s.runs
               if e.get("state") == "running"]
    if not running:
        raise TpufabError(f"No run is running on {nodeset.fold(workers)}, so there is no "
                          "profiler to ask; start one (e.g. `tpufab run recipes/serve_jax.sh "
                          "--wait-port 9000`) or name it with --run.")
    return max(running)[1]


def one_logdir(local_dir: Path, stamp: str, workers: Sequence[int]) -> dict[int, list[Path]]:
    """Every worker's copy (``local_dir/wN/stamp/...``, as ``transfer.get`` lays out several
    workers) moved into one logdir as TensorBoard and XProf read a multi-host profile:
    ``local_dir/stamp/plugins/profile/stamp/<host>.xplane.pb``, one file per host (a name
    two hosts share gets the worker's label in front); what is outside ``plugins/profile``
    goes under ``wN/``. Returns each worker's files, where they are now."""
    import shutil

    target = local_dir / stamp
    session = target / "plugins" / "profile" / stamp
    moved: dict[int, list[Path]] = {}
    for w in workers:
        source = local_dir / nodeset.label(w) / stamp
        moved[w] = []
        for path in sorted(p for p in source.rglob("*") if p.is_file() and not p.is_symlink()):
            rel = path.relative_to(source)
            if rel.parts[:2] == ("plugins", "profile") and len(rel.parts) == 4:
                to = session / rel.name
                if to.exists():
                    to = session / f"{nodeset.label(w)}.{rel.name}"
            else:
                to = target / nodeset.label(w) / rel
            to.parent.mkdir(parents=True, exist_ok=True)
            path.replace(to)
            moved[w].append(to)
        shutil.rmtree(local_dir / nodeset.label(w), ignore_errors=True)
    return moved


def capture_command(script: RemoteFile, port: int, seconds: float, logdir: str):
    """Run the capture with the job's Python ($TPUFAB_PYTHON, ~/.venv, else python3)."""
    return command(Raw('PY="${TPUFAB_PYTHON:-$HOME/.venv/bin/python}"; [ -x "$PY" ] || '
                       'PY=python3; exec "$PY"'),
                   *verified_args([script], ["--port", port, "--duration-ms",
                                             int(seconds * 1000), "--logdir", logdir]))


def capture(fanout, *, workers: Sequence[int], run: str | None = None, port: int | None = None,
            seconds: float = 5.0, local_base: Path | None = None,
            progress: Callable[[str], None] | None = None,
            max_bytes: int | None = None) -> ProfileReport:
    """Capture ``seconds`` of trace on each of ``workers`` and copy it under the run's logs;
    a host whose trace is larger than ``max_bytes`` (None: DEFAULT_MAX_SIZE) keeps it, and its
    row says where and how to bring it."""
    from tpufab.ssh import transfer
    from tpufab.steps.runs import running as jobs
    from tpufab.steps.runs.env import profiler_port

    say = progress or (lambda text: None)
    began = time.monotonic()
    run_id = _running_run(fanout, workers, run)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    remote_dir = f".cache/tpufab/profiles/{run_id}/{stamp}"
    script = RemoteFile.bundled("profile_worker.py")
    say(f"Capturing {seconds:g} s of trace from run {run_id} on {nodeset.fold(workers)}...")

    def one(worker: int):
        line = capture_command(script, port or profiler_port(worker), seconds, remote_dir)
        return worker, run_with_files(fanout, [script], line, [worker],
                                      timeout=seconds + 120)[worker]

    # every host at once (each has its own profiler port): the wall time is the duration's
    with ThreadPoolExecutor(max_workers=min(MAX_AT_ONCE, len(workers))) as pool:
        results = dict(pool.map(one, workers))
    local_dir = jobs.local_log_dir(run_id, local_base) / "profiles"
    local_dir.mkdir(exist_ok=True)
    where = local_dir / stamp
    rows: dict[int, ProfileRow] = {}
    good = []
    limit = parse_size(DEFAULT_MAX_SIZE) if max_bytes is None else max_bytes
    for w, r in results.items():
        answer = read_answer(r.stdout) if r.ok else None
        size = sum(int(f[1]) for f in (answer or {}).get("files") or () if len(f) == 2)
        if not answer or answer.get("error"):
            rows[w] = ProfileRow(w, error=(answer or {}).get("error") or jobs.failure_reason(r))
        elif size > limit:
            rows[w] = ProfileRow(w, error=(
                f"its trace is {_size(size)}, above --max-size {_size(limit)}: it stays on the "
                f"worker in ~/{remote_dir}; profile again with a larger --max-size or a "
                "shorter --duration, or copy it with `tpufab get`"))
        else:
            good.append(w)
    if good:
        report = transfer.get(fanout, remote_dir, local_dir, workers=good)
        copied = [row.worker for row in report.rows if not row.error]
        # transfer.get lays several workers out as wN/..., one as it is
        moved = one_logdir(local_dir, stamp, copied) if len(good) > 1 else \
            {row.worker: [Path(p) for p in row.paths] for row in report.rows if not row.error}
        for row in report.rows:
            if row.error:
                rows[row.worker] = ProfileRow(row.worker, error=row.error)
            else:
                rows[row.worker] = ProfileRow(row.worker, [
                    (str(p.relative_to(where)), p.stat().st_size) for p in moved[row.worker]])
    captured = ProfileReport(run=run_id, local_dir=where, rows=sorted(rows.values(),
                                                                 key=lambda r: r.worker))
    if not captured.files:
        by_reason: dict[str, list[int]] = {}
        for w, e in captured.errors.items():   # each host's own port: one reason for all
            by_reason.setdefault(re.sub(r"\bport \d+", "its port (TPUFAB_PROFILER_PORT)", e),
                                 []).append(w)
        raise TpufabError(f"No trace captured from run {run_id}: " + "; ".join(
            f"{nodeset.fold(ws)}: {e}" for e, ws in by_reason.items()) + ".")
    captured.notes.append(f"Traces under {where} ({time.monotonic() - began:.1f} s). View them "
                          f"with `xprof --logdir {where}` or TensorBoard's profile plugin.")
    return captured

