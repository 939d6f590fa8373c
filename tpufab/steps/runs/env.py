"""Runs: ids, the job environment every worker gets, and the folded log view (pure).

Nothing here touches a worker. `job_environment` decides what a recipe sees on one worker;
`fold_logs` turns N workers' output into one readable stream (worker 0's lines once, and
only where other workers differ, their lines under a folded worker set like ``w[1-3,7]``).
"""

from __future__ import annotations

import difflib
import re
import secrets as _random
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from functools import cached_property

from tpufab.config import RESERVED
from tpufab.errors import ConfigError
from tpufab.nodeset import fold
from tpufab.quoting import is_secret_name
from tpufab.term.fields import merge as merge_fields
from tpufab.term.fields import shape

RUN_DIR = "~/.tpufab/runs"
# JAX's coordinator port (TPUFAB_COORDINATOR), plus 0-499 from the run id, as MASTER_PORT
# below: a coordinator left over from an earlier run cannot take the next run's connections,
# and on the simulated pod, whose nodes share this machine's network (XLA's coordination
# service listens on every address, with SO_REUSEPORT), two pods' jobs never meet.
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

# Forwarded on every run when set locally, as torchprime's `tp run` does (HF_TOKEN is a
# secret by its name, so it travels on stdin only).
ALWAYS_FORWARDED = ("HF_TOKEN", "XLA_IR_DEBUG", "XLA_HLO_DEBUG", "LIBTPU_INIT_ARGS")


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
class SliceFacts:
    """What the TPU runtime knows of one slice, set explicitly in every job's environment
    (TPU_NAME, TPU_ACCELERATOR_TYPE, TPU_TOPOLOGY): a Compute Engine TPU VM's guest may not
    carry the TPU API's metadata, so tpufab does not leave them to discovery."""

    name: str                 # the slice's node (TPU API) or MIG/instance (Compute Engine)
    accelerator_type: str     # e.g. tpu7x-16
    topology: str = ""        # the chip shape, e.g. 2x2x2


@dataclass(frozen=True)
class JobLayout:
    """Where the processes of a job run: internal IPs per slice, in worker order.

    A plain pod is one slice; a multislice queued resource has several. The global rank of
    a worker is its position in the flattened list (slice 0's workers first). ``tpu`` holds
    each slice's facts (empty: not known, e.g. ``run --local``).
    """

    slices: tuple[tuple[str, ...], ...]
    tpu: tuple[SliceFacts, ...] = field(default=(), compare=False)

    @classmethod
    def single(cls, worker_ips: Sequence[str]) -> JobLayout:
        return cls((tuple(worker_ips),))

    @classmethod
    def multislice(cls, slices: Sequence[Sequence[str]],
                   tpu: Sequence[SliceFacts] = ()) -> JobLayout:
        return cls(tuple(tuple(ips) for ips in slices), tuple(tpu))

    def __post_init__(self) -> None:
        if not self.slices or not all(self.slices):
            raise ConfigError("A job needs at least one worker in every slice.")
        if self.tpu and len(self.tpu) != len(self.slices):
            raise ValueError(f"{len(self.tpu)} slice facts for {len(self.slices)} slices")

    @cached_property
    def slice_hosts_text(self) -> tuple[str, ...]:
        """Each slice's IPs in worker order, comma-separated (TPU_WORKER_HOSTNAMES): built
        once per slice, not once per worker."""
        return tuple(",".join(ips) for ips in self.slices)

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


def secret_specs(secret: Iterable[str] | None) -> tuple[list[str], list[str]]:
    """``--secret K=V|K`` (a task's ``secrets:``): the ``--env`` specs they add and the names
    they make secrets, whatever the names look like."""
    specs = list(secret or ())
    return specs, [spec.partition("=")[0] for spec in specs]


def job_environment(run_id: str, layout: JobLayout, rank: int, *, platform: str = "tpu",
                    spmd: bool = False, coordinator_port: int | None = None,
                    megascale_port: int = DEFAULT_MEGASCALE_PORT,
                    master_port: int | None = None,
                    forwarded: Forwarded | None = None,
                    virtual_env: str | None = None) -> JobEnvironment:
    """The environment of global `rank` in `layout`.

    TPUFAB_* describe the whole job (rank, count, IPs in rank order, rank 0's ip:port as
    coordinator); TPU_WORKER_ID is the worker within its slice, as the TPU runtime counts, and
    TPU_WORKER_HOSTNAMES its slice's IPs in that order: with both set, JAX's cluster
    detection (GkeTpuCluster, tried before the metadata server's GceTpuCluster) and Ray take
    tpufab's numbering on either control plane. TPU_NAME, TPU_ACCELERATOR_TYPE and
    TPU_TOPOLOGY come from ``layout.tpu`` when known.
    torch.distributed and Lightning get the same job in their words: one process per worker
    (WORLD_SIZE workers, RANK = NODE_RANK = the worker's rank, LOCAL_RANK 0), rendezvous at
    rank 0's IP (MASTER_ADDR) on `master_port` (default: ``master_port_for(run_id)``).
    `platform="cpu"` is for runs without a TPU (JAX_PLATFORMS=cpu, PJRT_DEVICE=CPU).
    Forwarded variables override the framework defaults (MASTER_PORT included), never the
    TPUFAB_* contract. ``virtual_env``: the environment tpufab built (the ``environment``
    setting's path): VIRTUAL_ENV, whose bin the worker puts first on PATH (a forwarded
    VIRTUAL_ENV wins).
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
    if virtual_env:
        env["VIRTUAL_ENV"] = virtual_env
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
        TPU_WORKER_HOSTNAMES=layout.slice_hosts_text[slice_id],
        TPUFAB_NUM_WORKERS=str(layout.num_workers),
        TPUFAB_WORKER_IPS=layout.ips_text,
        TPUFAB_COORDINATOR=f"{ips[0]}:{coordinator_port or coordinator_port_for(run_id)}",
        TPUFAB_SLICE_ID=str(slice_id),
        TPUFAB_NUM_SLICES=str(len(layout.slices)),
        TPUFAB_PROFILER_PORT=str(profiler_port(rank)),
        MASTER_ADDR=ips[0],
        WORLD_SIZE=str(layout.num_workers),
        RANK=str(rank),
        NODE_RANK=str(rank),
        LOCAL_RANK="0",
    )
    if layout.tpu:
        facts = layout.tpu[slice_id]
        env.update({key: value for key, value in (
            ("TPU_NAME", facts.name), ("TPU_ACCELERATOR_TYPE", facts.accelerator_type),
            ("TPU_TOPOLOGY", facts.topology)) if value})
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


def _port_for(run_id: str, base: int, spread: int) -> int:
    """``base`` plus 0 to ``spread - 1`` taken from the run id's random suffix."""
    try:
        return base + int(run_id.rsplit("-", 1)[-1], 16) % spread
    except ValueError:
        return base


def master_port_for(run_id: str) -> int:
    """MASTER_PORT of a run: 29500 plus 0-999 taken from the run id's random suffix."""
    return _port_for(run_id, DEFAULT_MASTER_PORT, 1000)


def coordinator_port_for(run_id: str) -> int:
    """The port of TPUFAB_COORDINATOR: 8476 plus 0-499 from the run id's random suffix."""
    return _port_for(run_id, DEFAULT_COORDINATOR_PORT, 500)


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
    text: str                    # as shown: fields that vary between workers in braces
    workers: tuple[int, ...]     # the workers that printed this line here
    # each worker's own text where they differ (tpufab.term.fields), else None
    texts: Mapping[int, str] | None = field(default=None, compare=False, repr=False)

    @property
    def label(self) -> str:
        return fold(self.workers)

    def text_of(self, worker: int) -> str:
        """What ``worker`` printed here, as it printed it."""
        return self.texts[worker] if self.texts else self.text


def _folded(texts: dict[int, str]) -> FoldedLine:
    """A line that these workers printed here, each its own text, of one shape."""
    workers = tuple(sorted(texts))
    if len(set(texts.values())) == 1:
        return FoldedLine(texts[workers[0]], workers)
    return FoldedLine(merge_fields(texts), workers, dict(texts))


def unfold(folded: Sequence[FoldedLine], worker: int) -> list[str]:
    """The lines ``worker`` printed, in order, from a folded view (nothing is lost)."""
    return [line.text_of(worker) for line in folded if worker in line.workers]


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

    The lowest worker with lines is the reference. Each other worker is aligned to it with a
    line diff; where they differ, its lines of the same shape as the reference's
    (tpufab.term.fields: lines that differ only in their fields, a rank, an address, a
    loss) pair up with them and fold into one line. The lines only some workers printed at one
    place are folded among themselves the same way, so each worker's lines keep their order
    (``unfold`` gives them back).
    """
    lists = {w: list(lines) for w, lines in per_worker_lines.items() if lines}
    if not lists:
        return []
    workers = sorted(lists)
    reference = lists[workers[0]]
    have: list[dict[int, str]] = [{workers[0]: text} for text in reference]
    reference_shapes: list[str] | None = None
    extras: dict[int, dict[int, list[str]]] = {}    # anchor -> worker -> its own lines there
    for worker in workers[1:]:
        lines = lists[worker]
        if lines == reference:
            for i, holders in enumerate(have):
                holders[worker] = reference[i]
            continue
        for tag, i1, i2, j1, j2 in _opcodes(reference, lines):
            if tag == "equal":
                for k in range(i2 - i1):
                    have[i1 + k][worker] = lines[j1 + k]
                continue
            if reference_shapes is None:
                reference_shapes = [shape(text) for text in reference]
            # within the block, its lines of a reference line's shape are that line
            paired = paired_by_shape(reference_shapes[i1:i2],
                                     [shape(text) for text in lines[j1:j2]])
            for a, b in paired.items():
                have[i1 + a][worker] = lines[j1 + b]
            after = sorted((b, a) for a, b in paired.items())
            for b, text in enumerate(lines[j1:j2]):
                if b in paired.values():
                    continue
                # its own line sits right before the next reference line it printed
                anchor = next((i1 + a for bb, a in after if bb > b), i2)
                extras.setdefault(anchor, {}).setdefault(worker, []).append(text)
    folded: list[FoldedLine] = []
    for i in range(len(reference) + 1):
        if i in extras:
            folded.extend(fold_logs(extras[i]))
        if i < len(reference):
            folded.append(_folded(have[i]))
    return folded


def paired_by_shape(reference: Sequence[str], lines: Sequence[str]) -> dict[int, int]:
    """Within a block where a worker's lines differ from the reference's, which of its lines
    (by index) have the shape of which reference line: {reference index: line index}."""
    if len(reference) == len(lines) and reference == list(lines):
        return {i: i for i in range(len(lines))}
    matcher = difflib.SequenceMatcher(None, list(reference), list(lines), autojunk=False)
    return {block.a + k: block.b + k for block in matcher.get_matching_blocks()
            for k in range(block.size)}


FOLD_WINDOW = 1000            # lines of the reference worker folded at a time
FOLD_WINDOW_BYTES = 256 << 10  # ... and at most this many bytes of any worker's lines


def fold_stream(streams: Mapping[int, Iterable[str]], *, window: int = FOLD_WINDOW,
                window_bytes: int = FOLD_WINDOW_BYTES) -> Iterator[FoldedLine]:
    """:func:`fold_logs` over line streams of any length, in bounded memory and linear time.

    The lowest worker with lines left is the reference; a window of its lines is folded with
    the lines of each other worker that align with it (difflib finds the last matching line;
    unmatched lines at the end pair up one for one; where its stream and the reference's both
    end in the window, all of its lines go with it), and what a worker printed beyond that
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
        last = ref in ended and not buffers[ref]     # the reference's last window
        for w in active[1:]:
            fill(w, len(reference) + slack, window_bytes + window_bytes // 2)
            # where both streams end here, all of this worker's lines go with the reference's
            # last ones (a worker with one more line than the reference before its last
            # would else have its last line shown apart from everyone's)
            everything = last and w in ended
            chunks[w] = take(w, len(buffers[w]) if everything else _aligned(reference, buffers[w]))
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


def virtual_env(settings) -> str | None:
    """The path of the environment tpufab builds (the ``environment`` setting's, ~/.venv by
    default): what VIRTUAL_ENV says in a job; None where none is configured."""
    from tpufab.config import DEFAULT_ENVIRONMENT_PATH

    environment = getattr(settings, "environment", None) or {}
    if not (environment.get("requirements") or environment.get("lock")):
        return None
    return environment.get("path") or DEFAULT_ENVIRONMENT_PATH


def forwarded_for(settings, env: Iterable[str] | None,
                  secret: Iterable[str] | None = None) -> Forwarded:
    """``--env`` specs on top of the config's ``env``, on top of ``ALWAYS_FORWARDED``; a
    configured or always-forwarded name that is not set here is skipped (it means "forward it
    when I have it"), an ``--env NAME`` that is not set is an error. ``--secret`` specs are
    ``--env`` specs whose names are secrets whatever they look like (as are the ``secrets``
    setting's); every other name is judged by :func:`tpufab.quoting.is_secret_name`."""
    import os

    configured = [spec for spec in (*ALWAYS_FORWARDED, *settings.env)
                  if "=" in spec or spec in os.environ]
    specs, names = secret_specs(secret)
    return forwarded_environment([*configured, *(env or ()), *specs], os.environ,
                                 [*settings.secrets, *names])
