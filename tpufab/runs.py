"""Runs: ids, the job environment every worker gets, and the folded log view (pure).

Nothing here touches a worker. `job_environment` decides what a recipe sees on one worker;
`fold_logs` turns N workers' output into one readable stream (worker 0's lines once, and
only where other workers differ, their lines under a folded worker set like ``w[1-3,7]``).
"""

from __future__ import annotations

import difflib
import fnmatch
import re
import secrets as _random
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from functools import cached_property

from tpufab.errors import ConfigError
from tpufab.nodeset import fold

RUN_DIR = "~/.tpufab/runs"
DEFAULT_COORDINATOR_PORT = 8476
DEFAULT_MEGASCALE_PORT = 8081
# jax.profiler.start_server port of rank 0; rank N uses this + N, so processes that share one
# network (the simulated pod, `run --local`) never collide. `tpufab profile` connects there.
DEFAULT_PROFILER_PORT = 9431
# torch.distributed's default port (torchrun's too), plus 0-999 from the run id: a process
# left over from an earlier run that still holds its port cannot block the next run.
DEFAULT_MASTER_PORT = 29500
_RUN_ID = re.compile(r"^\d{8}-\d{6}-[0-9a-f]{4}$")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")

# Names a forwarded variable may not take: tpufab sets them per worker.
RESERVED = ("TPUFAB_RUN_ID", "TPUFAB_RUN_DIR", "TPUFAB_WORKER_ID", "TPU_WORKER_ID",
            "TPUFAB_NUM_WORKERS", "TPUFAB_WORKER_IPS", "TPUFAB_COORDINATOR",
            "TPUFAB_SLICE_ID", "TPUFAB_NUM_SLICES", "TPUFAB_TASK", "TPUFAB_PROFILER_PORT",
            "MASTER_ADDR", "WORLD_SIZE", "RANK", "NODE_RANK", "LOCAL_RANK")
# Forwarded on every run when set locally, as torchprime's `tp run` does (HF_TOKEN is a
# secret by its name, so it travels on stdin only).
ALWAYS_FORWARDED = ("HF_TOKEN", "XLA_IR_DEBUG", "XLA_HLO_DEBUG", "LIBTPU_INIT_ARGS")
# Forwarded values whose names look like these are secrets too (besides config `secrets`).
SECRET_PATTERNS = ("*TOKEN*", "*SECRET*", "*PASSWORD*", "*PASSWD*", "*API_KEY*",
                   "*ACCESS_KEY*", "*PRIVATE_KEY*", "*CREDENTIAL*")


# -- run ids ---------------------------------------------------------------------------------


def new_run_id(now: datetime | None = None, suffix: str | None = None) -> str:
    """A sortable run id in UTC: ``20261122-104455-ab12``."""
    now = (now or datetime.now(timezone.utc)).astimezone(timezone.utc)
    suffix = suffix if suffix is not None else _random.token_hex(2)
    run_id = f"{now:%Y%m%d-%H%M%S}-{suffix}"
    if not _RUN_ID.match(run_id):
        raise ValueError(f"bad run id suffix {suffix!r}: four lower-case hex digits")
    return run_id


def is_run_id(text: str) -> bool:
    return bool(_RUN_ID.match(text))


# -- the job environment ---------------------------------------------------------------------


@dataclass(frozen=True)
class JobLayout:
    """Where the processes of a job run: internal IPs per slice, in worker order.

    A plain pod is one slice; a multislice queued resource has several. The global rank of
    a worker is its position in the flattened list (slice 0's workers first).
    """

    slices: tuple[tuple[str, ...], ...]

    @classmethod
    def single(cls, worker_ips: Sequence[str]) -> JobLayout:
        return cls((tuple(worker_ips),))

    @classmethod
    def multislice(cls, slices: Sequence[Sequence[str]]) -> JobLayout:
        return cls(tuple(tuple(ips) for ips in slices))

    def __post_init__(self) -> None:
        if not self.slices or not all(self.slices):
            raise ConfigError("A job needs at least one worker in every slice.")

    @cached_property
    def ips(self) -> tuple[str, ...]:
        return tuple(ip for ips in self.slices for ip in ips)

    @cached_property
    def ips_text(self) -> str:
        """Every IP in rank order, comma-separated: built once, not once per worker (1,024
        workers x 1,024 addresses)."""
        return ",".join(self.ips)

    @property
    def num_workers(self) -> int:
        return sum(len(ips) for ips in self.slices)

    def place(self, rank: int) -> tuple[int, int]:
        """(slice id, worker id within the slice) of global `rank`."""
        if not 0 <= rank < self.num_workers:
            raise ValueError(f"rank {rank} outside 0..{self.num_workers - 1}")
        for slice_id, ips in enumerate(self.slices):
            if rank < len(ips):
                return slice_id, rank
            rank -= len(ips)
        raise AssertionError("unreachable")


@dataclass(frozen=True)
class Forwarded:
    """Variables forwarded to every worker, split into public values and secrets."""

    public: Mapping[str, str] = field(default_factory=dict)
    secrets: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class JobEnvironment:
    """One worker's environment. Secrets go only through a 0600 file or stdin."""

    public: Mapping[str, str]
    secrets: Mapping[str, str]

    def merged(self) -> dict[str, str]:
        """Everything the recipe sees (the content of the worker's env file)."""
        return {**self.public, **self.secrets}

    def masked(self) -> dict[str, str]:
        """For display and logs: secret values as ``***``."""
        return {**self.public, **{key: "***" for key in self.secrets}}


def is_secret_name(name: str, secret_names: Iterable[str] = ()) -> bool:
    """A configured secret name (fnmatch patterns allowed) or a name that looks like one."""
    upper = name.upper()
    return any(fnmatch.fnmatchcase(upper, pattern.upper())
               for pattern in (*secret_names, *SECRET_PATTERNS))


def forwarded_environment(specs: Iterable[str], local_env: Mapping[str, str],
                          secret_names: Iterable[str] = ()) -> Forwarded:
    """`--env K=V` sets K; `--env K` forwards the local value of K. Later specs win."""
    secret_names = tuple(secret_names)
    public: dict[str, str] = {}
    hidden: dict[str, str] = {}
    for spec in specs:
        name, sep, value = spec.partition("=")
        if not _ENV_NAME.match(name):
            raise ConfigError(f"--env {spec.split('=')[0]!r} is not a variable name; use "
                              "--env NAME=value or --env NAME.")
        if name in RESERVED:
            raise ConfigError(f"--env {name} cannot be set: tpufab sets it for every worker.")
        if not sep:
            if name not in local_env:
                raise ConfigError(f"--env {name} forwards your local {name}, but it is not "
                                  f"set; export it or pass --env {name}=value.")
            value = local_env[name]
        public.pop(name, None)
        hidden.pop(name, None)
        (hidden if is_secret_name(name, secret_names) else public)[name] = value
    return Forwarded(public, hidden)


def job_environment(run_id: str, layout: JobLayout, rank: int, *, platform: str = "tpu",
                    spmd: bool = False, coordinator_port: int = DEFAULT_COORDINATOR_PORT,
                    megascale_port: int = DEFAULT_MEGASCALE_PORT,
                    master_port: int | None = None,
                    forwarded: Forwarded | None = None) -> JobEnvironment:
    """The environment of global `rank` in `layout`.

    TPUFAB_* describe the whole job (rank, count, IPs in rank order, rank 0's ip:port as
    coordinator); TPU_WORKER_ID is the worker within its slice, as the TPU runtime counts.
    torch.distributed and Lightning get the same job in their words: one process per worker
    (WORLD_SIZE workers, RANK = NODE_RANK = the worker's rank, LOCAL_RANK 0), rendezvous at
    rank 0's IP (MASTER_ADDR) on `master_port` (default: ``master_port_for(run_id)``).
    `platform="cpu"` is for runs without a TPU (JAX_PLATFORMS=cpu, PJRT_DEVICE=CPU).
    Forwarded variables override the framework defaults (MASTER_PORT included), never the
    TPUFAB_* contract.
    """
    if platform not in ("tpu", "cpu"):
        raise ValueError(f"platform must be 'tpu' or 'cpu', not {platform!r}")
    slice_id, worker_id = layout.place(rank)
    ips = layout.ips
    env: dict[str, str] = {}
    if platform == "tpu":
        env["PJRT_DEVICE"] = "TPU"
    else:
        env.update(JAX_PLATFORMS="cpu", PJRT_DEVICE="CPU")
    if spmd:
        env["XLA_USE_SPMD"] = "1"
    env["MASTER_PORT"] = str(master_port or master_port_for(run_id))
    if len(layout.slices) > 1:
        env.update(MEGASCALE_COORDINATOR_ADDRESS=layout.slices[0][0],
                   MEGASCALE_NUM_SLICES=str(len(layout.slices)),
                   MEGASCALE_SLICE_ID=str(slice_id),
                   MEGASCALE_PORT=str(megascale_port))
    forwarded = forwarded or Forwarded()
    env.update(forwarded.public)
    env.update(
        TPUFAB_RUN_ID=run_id,
        TPUFAB_WORKER_ID=str(rank),
        TPU_WORKER_ID=str(worker_id),
        TPUFAB_NUM_WORKERS=str(layout.num_workers),
        TPUFAB_WORKER_IPS=layout.ips_text,
        TPUFAB_COORDINATOR=f"{ips[0]}:{coordinator_port}",
        TPUFAB_SLICE_ID=str(slice_id),
        TPUFAB_NUM_SLICES=str(len(layout.slices)),
        TPUFAB_PROFILER_PORT=str(profiler_port(rank)),
        MASTER_ADDR=ips[0],
        WORLD_SIZE=str(layout.num_workers),
        RANK=str(rank),
        NODE_RANK=str(rank),
        LOCAL_RANK="0",
    )
    return JobEnvironment(public=env, secrets=dict(forwarded.secrets))


def skypilot_variables(public: Mapping[str, str], *, task_id: str,
                       node_name: str) -> dict[str, str]:
    """The variables SkyPilot documents for a task's ``run``, from tpufab's job environment
    (one worker's ``JobEnvironment.public``): every host of the pod is a node to the run."""
    return {
        "SKYPILOT_NODE_RANK": public["TPUFAB_WORKER_ID"],
        "SKYPILOT_NUM_NODES": public["TPUFAB_NUM_WORKERS"],
        "SKYPILOT_NODE_IPS": "\n".join(public["TPUFAB_WORKER_IPS"].split(",")),
        "SKYPILOT_TASK_ID": task_id,
        "SKYPILOT_NUM_GPUS_PER_NODE": "0",
        "TPU_NAME": node_name,
    }


def profiler_port(rank: int) -> int:
    """Where rank ``rank``'s profiler server listens (TPUFAB_PROFILER_PORT)."""
    return DEFAULT_PROFILER_PORT + rank


def master_port_for(run_id: str) -> int:
    """MASTER_PORT of a run: 29500 plus 0-999 taken from the run id's random suffix."""
    suffix = run_id.rsplit("-", 1)[-1]
    try:
        return DEFAULT_MASTER_PORT + int(suffix, 16) % 1000
    except ValueError:
        return DEFAULT_MASTER_PORT


def job_environments(run_id: str, layout: JobLayout, **options) -> list[JobEnvironment]:
    """Every worker's environment, indexed by global rank."""
    return [job_environment(run_id, layout, rank, **options)
            for rank in range(layout.num_workers)]


def local_environments(run_id: str, workers: int, coordinator_port: int,
                       master_port: int | None = None, **options) -> list[JobEnvironment]:
    """The same contract for N processes on this machine (coordinator 127.0.0.1, CPU)."""
    options.setdefault("platform", "cpu")
    layout = JobLayout.single(["127.0.0.1"] * workers)
    return job_environments(run_id, layout, coordinator_port=coordinator_port,
                            master_port=master_port or coordinator_port + 1, **options)


# -- the folded log view ---------------------------------------------------------------------


@dataclass(frozen=True)
class FoldedLine:
    text: str
    workers: tuple[int, ...]     # the workers that printed this line here

    @property
    def label(self) -> str:
        return fold(self.workers)


def _positional(reference: Sequence[str], lines: Sequence[str]) -> list[bool] | None:
    """Where the two agree line by line, when that is their alignment: as long, at least half
    their lines equal where they stand, and no differing line equal to its neighbour in the
    other (the mark of a line inserted or dropped, which shifts what follows); else None."""
    n = len(reference)
    if n != len(lines) or not n:
        return None
    same = [a == b for a, b in zip(reference, lines, strict=True)]
    if 2 * sum(same) < n:
        return None
    for i, equal in enumerate(same):
        if not equal and ((i and (lines[i] == reference[i - 1] or reference[i] == lines[i - 1]))
                          or (i + 1 < n and (lines[i] == reference[i + 1]
                                             or reference[i] == lines[i + 1]))):
            return None
    return same


def _opcodes(reference: Sequence[str], lines: Sequence[str]) -> list[tuple]:
    """difflib's opcodes, or the same found by position when that is the alignment (the
    common case: one line per step, some differing per worker). difflib costs a search per
    matching block, which is slow when workers differ every few lines."""
    same = _positional(reference, lines)
    if same is None:
        return difflib.SequenceMatcher(None, reference, lines, autojunk=False).get_opcodes()
    codes, start, n = [], 0, len(same)
    for i in range(1, n + 1):
        if i == n or same[i] != same[start]:
            codes.append(("equal" if same[start] else "replace", start, i, start, i))
            start = i
    return codes


def fold_logs(per_worker_lines: Mapping[int, Sequence[str]]) -> list[FoldedLine]:
    """Worker 0's lines once, each with the set of workers that printed it there, plus the
    lines where other workers differ, placed where they occur, with their worker set.

    The lowest worker present is the reference. Each other worker is aligned to it with a
    line diff; identical extra lines at the same place are merged across workers.
    """
    if not per_worker_lines:
        return []
    workers = sorted(per_worker_lines)
    reference = list(per_worker_lines[workers[0]])
    have: list[set[int]] = [{workers[0]} for _ in reference]
    # (anchor, text, occurrence) -> [workers, (offset in block, first seen)]
    extra: dict[tuple[int, str, int], list] = {}
    seen = 0
    for worker in workers[1:]:
        lines = list(per_worker_lines[worker])
        if lines == reference:
            for holders in have:
                holders.add(worker)
            continue
        for tag, i1, i2, j1, j2 in _opcodes(reference, lines):
            if tag == "equal":
                for i in range(i1, i2):
                    have[i].add(worker)
                continue
            counts: dict[str, int] = {}
            # A worker's variant sits right after the reference lines it replaces.
            for offset, text in enumerate(lines[j1:j2]):
                occurrence = counts.get(text, 0)
                counts[text] = occurrence + 1
                key = (i2, text, occurrence)
                if key not in extra:
                    extra[key] = [set(), (offset, seen)]
                    seen += 1
                extra[key][0].add(worker)
    by_anchor: dict[int, list[tuple[tuple[int, int], FoldedLine]]] = {}
    for (anchor, text, _), (holders, order) in extra.items():
        by_anchor.setdefault(anchor, []).append((order, FoldedLine(text, tuple(sorted(holders)))))
    folded: list[FoldedLine] = []
    for i in range(len(reference) + 1):
        folded.extend(line for _, line in sorted(by_anchor.get(i, ()), key=lambda e: e[0]))
        if i < len(reference):
            folded.append(FoldedLine(reference[i], tuple(sorted(have[i]))))
    return folded


FOLD_WINDOW = 1000            # lines of the reference worker folded at a time
FOLD_WINDOW_BYTES = 256 << 10  # ... and at most this many bytes of any worker's lines


def fold_stream(streams: Mapping[int, Iterable[str]], *, window: int = FOLD_WINDOW,
                window_bytes: int = FOLD_WINDOW_BYTES) -> Iterator[FoldedLine]:
    """:func:`fold_logs` over line streams of any length, in bounded memory and linear time.

    The lowest worker with lines left is the reference; a window of its lines is folded with
    the lines of each other worker that align with it (difflib finds the last matching line;
    unmatched lines at the end pair up one for one), and what a worker printed beyond that
    waits for the next window. A worker whose stream ends drops out; one with lines after
    the reference ended becomes the reference for the rest.
    """
    iters = {w: iter(lines) for w, lines in streams.items()}
    buffers: dict[int, list[str]] = {w: [] for w in iters}
    sizes = dict.fromkeys(iters, 0)
    ended: set[int] = set()

    def fill(worker: int, lines: int, size: int) -> None:
        buf, it = buffers[worker], iters[worker]
        while worker not in ended and len(buf) < lines and sizes[worker] < size:
            try:
                line = next(it)
            except StopIteration:
                ended.add(worker)
                break
            buf.append(line)
            sizes[worker] += len(line)

    def take(worker: int, count: int) -> list[str]:
        buf = buffers[worker]
        taken, buffers[worker] = buf[:count], buf[count:]
        sizes[worker] -= sum(len(line) for line in taken)
        return taken

    while True:
        for w in iters:
            fill(w, 1, 1)
        active = sorted(w for w in iters if buffers[w])
        if not active:
            return
        ref = active[0]
        fill(ref, window, window_bytes)
        reference = take(ref, len(buffers[ref]))
        chunks = {ref: reference}
        slack = len(reference) // 2 + 8
        for w in active[1:]:
            fill(w, len(reference) + slack, window_bytes + window_bytes // 2)
            chunks[w] = take(w, _aligned(reference, buffers[w]))
        yield from fold_logs(chunks)


def _aligned(reference: Sequence[str], lines: Sequence[str]) -> int:
    """How many of ``lines`` go with ``reference`` (a window of the reference worker)."""
    count = len(reference)
    if _positional(reference, lines[:count]) is not None:
        return count          # aligned where they stand (see _opcodes)
    matcher = difflib.SequenceMatcher(None, reference, lines, autojunk=False)
    blocks = [b for b in matcher.get_matching_blocks() if b.size]
    if not blocks:
        return min(len(lines), count)
    last = blocks[-1]
    i, j = last.a + last.size, last.b + last.size
    return min(len(lines), j + (count - i))


def render_folded(folded: Sequence[FoldedLine], workers: Iterable[int]) -> list[str]:
    """Display lines: plain text when every worker printed it, else ``w[1-3]: text``."""
    everyone = tuple(sorted(set(workers)))
    return [line.text if line.workers == everyone else f"{line.label}: {line.text}"
            for line in folded]


def forwarded_for(settings, env: Iterable[str] | None) -> Forwarded:
    """``--env`` specs on top of the config's ``env``, on top of ``ALWAYS_FORWARDED``; a
    configured or always-forwarded name that is not set here is skipped (it means "forward it
    when I have it"), an ``--env NAME`` that is not set is an error."""
    import os

    configured = [spec for spec in (*ALWAYS_FORWARDED, *settings.env)
                  if "=" in spec or spec in os.environ]
    return forwarded_environment([*configured, *(env or ())], os.environ, settings.secrets)
