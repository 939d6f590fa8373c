"""libtpu's runtime metrics service, simulated: what ``localhost:8431`` answers on each worker.

On a TPU VM, libtpu (inside the process that holds the chips) serves the gRPC service
``tpu.monitoring.runtime.RuntimeMetricService`` on ``localhost:8431``; Google's ``tpu-info``
reads it (``GetRuntimeMetric`` with a metric name; local channel credentials, which are plain
HTTP/2 on a loopback connection). While no process holds the chips nothing serves it and a
client gets UNAVAILABLE. This module serves the same service for every worker of a
:class:`~tpufab.sim.workers.WorkerPool`, from what the worker's simulated TPU is doing:

- a process holding a chip (an open fd on its /dev/accel* or /dev/vfio/* placeholder) makes
  the chip report HBM in use (the process's resident memory, shared among its chips; the
  total is the generation's HBM) and a duty cycle;
- the chip is *busy* while that process's main thread is on a CPU or waiting for one
  (``/proc/PID/schedstat``: exact, cumulative); it waits otherwise (a collective over the
  network, a sleep, input). So a program of D chip-seconds (a main thread that computes
  until its own run + runqueue time grew by D: tests/data/collective_steps.py) takes D
  however busy this machine's CPUs are, as on a chip, which a host's load does not slow. A
  process stopped by ``tpufab sim slow`` keeps the phase it was stopped in, as a slower chip
  would: the time a program was stopped (sim/slow.py counts each worker's stops exactly)
  is added to it, and the context switch each stop costs is not taken for a wait;
- a busy stretch is one program execution (``hlo.execution.timing.distribution.microseconds``:
  a distribution per chip; a wait between two samples, seen as a new voluntary context
  switch, ends one) once it was MIN_PROGRAM_RUN on a CPU (less is the host's own
  bookkeeping: no program, no busy time), the duty cycle is the busy share of the last 2 s, and
  ``tpu.runtime.tensorcore.idle_duration.seconds`` how long the chip has been idle;
- a chip no process holds reports 0 % and no HBM; a worker none of whose chips is held
  answers UNAVAILABLE, as a TPU VM with no job does.

One gRPC server (grpcio, with local server credentials, as libtpu) runs per pool on an
ephemeral 127.0.0.1 port; a small byte relay listens on every running worker's own address
(``<worker ip>:8431``, in the worker's network namespace if it has one) and forwards each
connection to it, noting which worker the relay's outgoing port belongs to, so the server
knows whose metrics to answer with. Workers' ``/etc/hosts`` map ``localhost`` to their own
address (sim/workers.py), so an unmodified ``tpu-info`` on a worker reaches its own service.
The messages are written here by hand (the protobuf wire format; field numbers of
``tpu_metric_service.proto``), no generated code. A worker's processes are looked at only
while somebody asks for its metrics (for 5 minutes after the last request), so an idle pool
of 1,024 workers costs nothing but its listening sockets.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import os
import socket
import struct
import threading
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tpufab.sim import slow

log = logging.getLogger("tpufab.sim.tpumetrics")

PORT = 8431
SERVICE = "tpu.monitoring.runtime.RuntimeMetricService"
TOTAL_MEMORY = "tpu.runtime.hbm.memory.total.bytes"
MEMORY_USAGE = "tpu.runtime.hbm.memory.usage.bytes"
DUTY_CYCLE = "tpu.runtime.tensorcore.dutycycle.percent"
IDLE_DURATION = "tpu.runtime.tensorcore.idle_duration.seconds"
HLO_EXEC_TIMING = "hlo.execution.timing.distribution.microseconds"
HLO_QUEUE_SIZE = "hlo.queue.size.gauge"
SERVED = (TOTAL_MEMORY, MEMORY_USAGE, DUTY_CYCLE, IDLE_DURATION, HLO_EXEC_TIMING, HLO_QUEUE_SIZE)
SAMPLE_EVERY = 0.01       # s between two looks at a holder's main thread
MIN_PROGRAM_RUN = 0.002   # s on a CPU a stretch between two waits needs to be a program
DUTY_WINDOW = 2.0         # s: the duty cycle is the busy share of this much time
WATCH_FOR = 300.0         # s a worker is watched after its last request
SCAN_EVERY = 1.0          # s between two looks for the processes holding a worker's chips
RECONCILE_EVERY = 2.0     # s between two looks at which workers run
BUCKETS = 32              # exponential buckets of the timing distribution (1 us x 2^i)
GIB = 1 << 30
# PCI device id -> (generation, HBM GiB per chip, devices per chip), as tpu-info counts them
CHIPS = {"0x0027": ("v3", 16, 2), "0x005e": ("v4", 32, 1), "0x0063": ("v5e", 16, 1),
         "0x0062": ("v5p", 95, 1), "0x006f": ("v6e", 32, 1), "0x0076": ("7x", 192, 2)}
CLONE_NEWNET = 0x40000000


# --- the protobuf wire format (what tpu_metric_service.proto's messages look like) --------


def varint(n: int) -> bytes:
    n &= (1 << 64) - 1  # negative int64 values are ten bytes, two's complement
    out = bytearray()
    while True:
        low, n = n & 0x7F, n >> 7
        if n:
            out.append(low | 0x80)
        else:
            out.append(low)
            return bytes(out)


def f_int(number: int, value: int) -> bytes:
    return varint(number << 3) + varint(int(value))


def f_double(number: int, value: float) -> bytes:
    return varint(number << 3 | 1) + struct.pack("<d", float(value))


def f_bytes(number: int, payload: bytes) -> bytes:
    return varint(number << 3 | 2) + varint(len(payload)) + payload


def f_str(number: int, text: str) -> bytes:
    return f_bytes(number, text.encode())


def attribute(key: str, *, int_value: int | None = None, text: str | None = None) -> bytes:
    """Attribute {key, value: AttrValue{string_attr=1 | int_attr=3}}."""
    value = f_int(3, int_value) if int_value is not None else f_str(1, text or "")
    return f_str(1, key) + f_bytes(2, value)


def device_attribute(device: int) -> bytes:
    """How libtpu labels per-device gauges (tpu-info reads ``attribute.value.int_attr``)."""
    return attribute("device-id", int_value=device)


def ordinal_attribute(device: int) -> bytes:
    """How libtpu labels HLO metrics: a key-value list with ``device_ordinal`` (a string in
    newer libtpu) and ``core_type``."""
    items = (f_bytes(1, attribute("device_ordinal", text=str(device)))
             + f_bytes(1, attribute("core_type", text="tensorcore")))
    return f_str(1, "device") + f_bytes(2, f_bytes(6, items))


def timestamp(now: float) -> bytes:
    seconds = int(now)
    return f_int(1, seconds) + f_int(2, int((now - seconds) * 1e9))


def gauge_metric(attr: bytes, now: float, *, double: float | None = None,
                 integer: int | None = None) -> bytes:
    """Metric {attribute=1, timestamp=2, gauge=3 {as_double=1 | as_int=2}}."""
    gauge = f_double(1, double) if double is not None else f_int(2, integer or 0)
    return f_bytes(1, attr) + f_bytes(2, timestamp(now)) + f_bytes(3, gauge)


def distribution_metric(attr: bytes, now: float, dist: Timing) -> bytes:
    """Metric {..., distribution=5 {count, mean, min, max, sum_of_squared_deviation,
    bucket_options {exponential_buckets=2 {num_finite_buckets, growth_factor, scale}},
    bucket_counts (packed)}}."""
    options = f_bytes(2, f_int(1, BUCKETS - 2) + f_double(2, 2.0) + f_double(3, 1.0))
    packed = b"".join(varint(c) for c in dist.buckets)
    body = (f_int(1, dist.count) + f_double(2, dist.mean) + f_double(3, dist.low)
            + f_double(4, dist.high) + f_double(5, dist.m2) + f_bytes(6, options)
            + f_bytes(7, packed))
    return f_bytes(1, attr) + f_bytes(2, timestamp(now)) + f_bytes(5, body)


def metric_response(name: str, metrics: Iterable[bytes], description: str = "") -> bytes:
    """MetricResponse {metric=1: TPUMetric {name=1, description=2, metrics=3 (repeated)}}."""
    body = f_str(1, name) + (f_str(2, description) if description else b"")
    body += b"".join(f_bytes(3, m) for m in metrics)
    return f_bytes(1, body)


def supported_response(names: Iterable[str]) -> bytes:
    """ListSupportedMetricsResponse {supported_metric=1 (repeated): {metric_name=1}}."""
    return b"".join(f_bytes(1, f_str(1, n)) for n in names)


def request_metric_name(data: bytes) -> str:
    """MetricRequest {metric_name=1, skip_node_aggregation=2}: the name asked for."""
    i = 0
    while i < len(data):
        key, i = _read_varint(data, i)
        number, kind = key >> 3, key & 7
        if kind == 0:
            _, i = _read_varint(data, i)
        elif kind == 2:
            size, i = _read_varint(data, i)
            if number == 1:
                return data[i:i + size].decode("utf-8", "replace")
            i += size
        elif kind == 1:
            i += 8
        elif kind == 5:
            i += 4
        else:
            raise ValueError(f"wire type {kind} in a MetricRequest")
    return ""


def _read_varint(data: bytes, i: int) -> tuple[int, int]:
    shift = value = 0
    while True:
        if i >= len(data):
            raise ValueError("truncated varint")
        byte = data[i]
        i += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, i
        shift += 7


# --- the simulated TPU -----------------------------------------------------------------------


@dataclass
class Timing:
    """A distribution of program times in microseconds (Welford's running mean and m2)."""

    count: int = 0
    mean: float = 0.0
    m2: float = 0.0
    low: float = 0.0
    high: float = 0.0
    buckets: list[int] = field(default_factory=lambda: [0] * BUCKETS)

    def add(self, micros: float) -> None:
        self.count += 1
        delta = micros - self.mean
        self.mean += delta / self.count
        self.m2 += delta * (micros - self.mean)
        self.low = micros if self.count == 1 else min(self.low, micros)
        self.high = max(self.high, micros)
        index = 0 if micros < 1.0 else min(BUCKETS - 1, int(micros).bit_length())
        self.buckets[index] += 1


@dataclass
class Holder:
    """A process holding some of a worker's chips, and what its main thread did."""

    pid: int
    chips: set[int]
    rss: int = 0
    busy: float = 0.0           # seconds busy so far (stopped in a program counts)
    raw: float | None = None    # schedstat's run + runqueue seconds at the last look
    switches: int | None = None
    state: str = "S"
    at: float = 0.0
    run: float = 0.0            # schedstat's run seconds alone at the last look
    stretch: bool = False       # between a look that saw it running and its next wait
    stretch_busy: float = 0.0   # that stretch's busy seconds so far
    stretch_run: float = 0.0    # and its seconds on a CPU
    in_program: bool = False    # the stretch is a program (MIN_PROGRAM_RUN on a CPU so far)
    last_busy_at: float = 0.0
    stops: tuple[int, float] = (0, 0.0)   # sim slow's stops of its worker at the last look
    waits: int = 0                        # the most voluntary switches seen, less the stops'
    history: deque = field(default_factory=lambda: deque(maxlen=int(DUTY_WINDOW / SAMPLE_EVERY)
                                                        + 50))


def read_holder(pid: int) -> tuple[float, str, int, int, float] | None:
    """(run + runqueue seconds of the main thread, state letter, voluntary context switches,
    resident bytes, run seconds alone), or None when the process is gone."""
    try:
        with open(f"/proc/{pid}/schedstat", "rb") as f:
            run, wait = f.read().split()[:2]
        with open(f"/proc/{pid}/status", "rb") as f:
            status = f.read()
    except (OSError, ValueError):
        return None
    state, switches, rss = "S", 0, 0
    for line in status.splitlines():
        if line.startswith(b"State:"):
            state = line.split()[1].decode()
        elif line.startswith(b"voluntary_ctxt_switches:"):
            switches = int(line.split()[1])
        elif line.startswith(b"VmRSS:"):
            rss = int(line.split()[1]) * 1024
    return (int(run) + int(wait)) / 1e9, state, switches, rss, int(run) / 1e9


def step_holder(h: Holder, now: float, raw: float, state: str, switches: int,
                programs: list[float], stops: tuple[int, float] = (0, 0.0),
                run: float | None = None) -> None:
    """One look at a holder: advance its busy time and its program; a finished program's
    seconds go to ``programs``. ``stops``: its worker's stops by sim slow so far (how many,
    seconds in all; sim/slow.py); ``run``: its seconds on a CPU alone (None: ``raw``). A
    stretch between two waits is a program once it was MIN_PROGRAM_RUN on a CPU: less is the
    host's own bookkeeping (a line printed, a loop's turn), which no chip runs, however long
    a busy machine keeps it waiting for a CPU. Pure (tested as data)."""
    run = raw if run is None else run
    if h.raw is None:  # the first look: nothing measured yet
        h.raw, h.run, h.switches, h.state, h.at = raw, run, switches, state, now
        h.stops, h.waits = stops, switches - stops[0]
        h.last_busy_at = now
        h.history.append((now, h.busy))
        return
    stopped = state in ("T", "t")
    running = state == "R"
    advanced, ran = max(0.0, raw - h.raw), max(0.0, run - h.run)
    slowed = max(0.0, stops[1] - h.stops[1])   # seconds sim slow stopped it since the last look
    if slowed and (h.stretch or running):
        advanced += slowed                     # a slower chip: the program goes on
    elif stopped and h.stretch and not slowed:
        advanced += max(0.0, now - h.at)       # stopped by another hand: counted as seen
    # each stop costs a voluntary switch (counted before its signal: a look in between sees
    # one switch fewer for a moment, hence the most seen): only more than that is a wait
    own = switches - stops[0]
    waited = own > h.waits
    h.waits, h.stops = max(h.waits, own), stops
    before = h.busy
    if h.stretch:
        _grow(h, advanced, ran)
        if not running and not stopped:
            _end(h, programs)
        elif running and waited:
            _end(h, programs)
            h.stretch = True
    elif running:
        h.stretch = True
        _grow(h, advanced, ran)
    elif waited and ran >= MIN_PROGRAM_RUN:    # ran and waited again between two looks
        h.busy += advanced
        programs.append(advanced)
    if h.busy > before or h.in_program:
        h.last_busy_at = now
    h.raw, h.run, h.switches, h.state, h.at = raw, run, switches, state, now
    h.history.append((now, h.busy))


def _grow(h: Holder, advanced: float, ran: float) -> None:
    """The stretch goes on: once it is a program, its busy time is the chip's."""
    h.stretch_busy += advanced
    h.stretch_run += ran
    if h.in_program:
        h.busy += advanced
    elif h.stretch_run >= MIN_PROGRAM_RUN:
        h.in_program = True
        h.busy += h.stretch_busy


def _end(h: Holder, programs: list[float]) -> None:
    if h.in_program:
        programs.append(h.stretch_busy)
    h.stretch = h.in_program = False
    h.stretch_busy = h.stretch_run = 0.0


def duty_percent(h: Holder, now: float) -> float:
    """Busy share of the last DUTY_WINDOW seconds (0-100)."""
    if not h.history:
        return 0.0
    start_t, start_busy = h.history[0]
    for t, busy in h.history:
        if now - t <= DUTY_WINDOW:
            start_t, start_busy = t, busy
            break
    span = now - start_t
    if span <= 0:
        return 100.0 if h.in_program else 0.0
    return max(0.0, min(100.0, 100.0 * (h.busy - start_busy) / span))


@dataclass
class WorkerTpu:
    """One worker's simulated chips, and who holds them."""

    key: tuple[str, int]
    init_pid: int
    device_files: tuple[str, ...]
    pci_device: str
    hostname: str = ""
    watched_until: float = 0.0
    scanned_at: float = 0.0
    holders: dict[int, Holder] = field(default_factory=dict)
    timings: dict[int, Timing] = field(default_factory=dict)
    since: float = field(default_factory=time.monotonic)

    @property
    def generation(self) -> tuple[str, int, int]:
        return CHIPS.get(self.pci_device, ("v4", 32, 1))

    @property
    def devices(self) -> int:
        return len(self.device_files) * self.generation[2]

    def chip_of_device(self, device: int) -> int:
        return device // self.generation[2]

    def holder_of(self, chip: int) -> Holder | None:
        for h in self.holders.values():
            if chip in h.chips:
                return h
        return None

    def answer(self, name: str, now_wall: float, now: float) -> bytes | None:
        """The MetricResponse for ``name`` (None: not a metric this service serves)."""
        _, hbm_gib, per_chip = self.generation
        chips = len(self.device_files)
        if name == TOTAL_MEMORY:
            return metric_response(name, (gauge_metric(device_attribute(d), now_wall,
                                                       integer=hbm_gib * GIB // per_chip)
                                          for d in range(self.devices)))
        if name == MEMORY_USAGE:
            def used(device: int) -> int:
                h = self.holder_of(self.chip_of_device(device))
                if h is None:
                    return 0
                share = h.rss // max(1, len(h.chips) * per_chip)
                return min(share, hbm_gib * GIB // per_chip)
            return metric_response(name, (gauge_metric(device_attribute(d), now_wall,
                                                       integer=used(d))
                                          for d in range(self.devices)))
        if name == DUTY_CYCLE:  # per chip
            def duty(chip: int) -> float:
                h = self.holder_of(chip)
                return 0.0 if h is None else round(duty_percent(h, now), 2)
            return metric_response(name, (gauge_metric(device_attribute(c), now_wall,
                                                       double=duty(c)) for c in range(chips)))
        if name == IDLE_DURATION:
            def idle(device: int) -> float:
                h = self.holder_of(self.chip_of_device(device))
                last = self.since if h is None else h.last_busy_at
                return 0.0 if h is not None and h.in_program else round(now - last, 3)
            return metric_response(name, (gauge_metric(device_attribute(d), now_wall,
                                                       double=idle(d))
                                          for d in range(self.devices)))
        if name == HLO_EXEC_TIMING:
            return metric_response(name, (
                distribution_metric(ordinal_attribute(d), now_wall,
                                    self.timings.setdefault(self.chip_of_device(d), Timing()))
                for d in range(self.devices)))
        if name == HLO_QUEUE_SIZE:
            return metric_response(name, (
                gauge_metric(ordinal_attribute(d), now_wall,
                             integer=int(bool((h := self.holder_of(self.chip_of_device(d)))
                                              and h.in_program)))
                for d in range(self.devices)))
        return None


# --- finding the holders ---------------------------------------------------------------------


def namespace_of(pid: int) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/pid")
    except OSError:
        return None


def holders_by_worker(workers: Iterable[WorkerTpu]) -> dict[tuple[str, int], dict[int, set[int]]]:
    """One pass over /proc: for each worker, host pid -> the chip indexes it holds open."""
    by_ns: dict[str, WorkerTpu] = {}
    for w in workers:
        ns = namespace_of(w.init_pid)
        if ns:
            by_ns[ns] = w
    found: dict[tuple[str, int], dict[int, set[int]]] = {w.key: {} for w in by_ns.values()}
    if not by_ns:
        return found
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) in (w.init_pid for w in by_ns.values()):
            continue
        worker = by_ns.get(namespace_of(int(name)) or "")
        if worker is None:
            continue
        chips: set[int] = set()
        try:
            fds = os.listdir(f"/proc/{name}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{name}/fd/{fd}")
            except OSError:
                continue
            if target in worker.device_files:
                chips.add(worker.device_files.index(target))
        if chips:
            found[worker.key][int(name)] = chips
    return found


# --- the service -----------------------------------------------------------------------------


_libc = ctypes.CDLL(None, use_errno=True)


def _listen(ip: str, netns: str) -> socket.socket:
    """A listening socket on ip:8431, made in ``netns`` (a network namespace path) if given:
    setns applies to the calling thread only, so a short-lived thread makes it."""
    made: list[Any] = []

    def make() -> None:
        try:
            if netns:
                with open(netns, "rb") as ns:
                    if _libc.setns(ns.fileno(), CLONE_NEWNET) != 0:
                        raise OSError(ctypes.get_errno(), f"setns {netns}")
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((ip, PORT))
            s.listen(64)
            made.append(s)
        except OSError as err:
            made.append(err)

    thread = threading.Thread(target=make, name="tpufab-tpu-listen", daemon=True)
    thread.start()
    thread.join()
    if isinstance(made[0], OSError):
        raise made[0]
    return made[0]


class MetricsService:
    """The simulated metrics service of one pool (see the module docstring)."""

    def __init__(self, pool: Any):
        from concurrent.futures import ThreadPoolExecutor

        import grpc

        self.pool = pool
        self.lock = threading.Lock()
        self.workers: dict[tuple[str, int], WorkerTpu] = {}
        self.listeners: dict[tuple[str, int], socket.socket] = {}
        self.relayed: dict[int, tuple[str, int]] = {}  # relay's outgoing port -> worker
        self.stopped = threading.Event()
        self.grpc = grpc
        self.server = grpc.server(ThreadPoolExecutor(max_workers=4, thread_name_prefix="tpu-rpc"))
        unary = grpc.unary_unary_rpc_method_handler
        self.server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, {
            "GetRuntimeMetric": unary(self.get_runtime_metric),
            "ListSupportedMetrics": unary(self.list_supported),
            "GetTpuRuntimeStatus": unary(self.runtime_status),
        }),))
        creds = grpc.local_server_credentials(grpc.LocalConnectionType.LOCAL_TCP)
        self.port = self.server.add_secure_port("127.0.0.1:0", creds)
        self.server.start()
        import selectors
        self.selector = selectors.DefaultSelector()
        self.wake_r, self.wake_w = socket.socketpair()
        self.selector.register(self.wake_r, selectors.EVENT_READ, None)
        for target, name in ((self._accept_loop, "tpufab-tpu-accept"),
                             (self._sample_loop, "tpufab-tpu-sample"),
                             (self._reconcile_loop, "tpufab-tpu-workers")):
            threading.Thread(target=target, name=name, daemon=True).start()

    # which workers run

    def running_workers(self) -> dict[tuple[str, int], tuple[Any, int]]:
        """(node id, index) -> (WorkerSpec, PID 1's host pid) of every worker that runs."""
        found = {}
        nodes = Path(self.pool.state_dir) / "nodes"
        for node_dir in sorted(nodes.iterdir()) if nodes.is_dir() else []:
            try:
                specs = self.pool.node_specs(node_dir.name)
            except Exception:  # noqa: BLE001 - a node being written or removed: next round
                continue
            for spec in specs:
                if not spec.device_files:
                    continue
                pid = self.pool.init_pid(node_dir.name, spec.index)
                if pid is not None:
                    found[(node_dir.name, spec.index)] = (spec, pid)
        return found

    def reconcile(self) -> None:
        import selectors

        running = self.running_workers()
        with self.lock:
            for key in [k for k in self.workers if k not in running
                        or self.workers[k].init_pid != running[k][1]]:
                del self.workers[key]
                sock = self.listeners.pop(key, None)
                if sock is not None:
                    with contextlib.suppress(KeyError, ValueError):
                        self.selector.unregister(sock)
                    sock.close()
            for key, (spec, pid) in running.items():
                if key in self.workers:
                    continue
                self.workers[key] = WorkerTpu(key, pid, tuple(spec.device_files),
                                              spec.pci_device, spec.hostname)
                try:
                    sock = _listen(spec.ip, spec.netns)
                except OSError as err:
                    log.warning("worker %s of node %s: cannot serve TPU metrics on %s:%d: %s",
                                key[1], key[0], spec.ip, PORT, err)
                    continue
                sock.setblocking(False)
                self.listeners[key] = sock
                self.selector.register(sock, selectors.EVENT_READ, key)
        self.wake_w.send(b"x")

    def _reconcile_loop(self) -> None:
        while not self.stopped.is_set():
            try:
                self.reconcile()
            except Exception:  # noqa: BLE001 - the next round tries again
                log.exception("tpu metrics: reconcile failed")
            self.stopped.wait(RECONCILE_EVERY)

    # the relay

    def _accept_loop(self) -> None:
        while not self.stopped.is_set():
            for sel_key, _ in self.selector.select(1.0):
                if sel_key.data is None:
                    with contextlib.suppress(OSError):
                        self.wake_r.recv(4096)
                    continue
                try:
                    client, _ = sel_key.fileobj.accept()
                except OSError:
                    continue
                threading.Thread(target=self._relay, args=(client, sel_key.data),
                                 name="tpufab-tpu-relay", daemon=True).start()

    def _relay(self, client: socket.socket, key: tuple[str, int]) -> None:
        client.setblocking(True)
        try:
            upstream = socket.create_connection(("127.0.0.1", self.port), timeout=5)
        except OSError:
            client.close()
            return
        upstream.settimeout(None)
        port = upstream.getsockname()[1]
        with self.lock:
            self.relayed[port] = key

        def pump(src: socket.socket, dst: socket.socket) -> None:
            try:
                while True:
                    data = src.recv(65536)
                    if not data:
                        break
                    dst.sendall(data)
            except OSError:
                pass
            finally:
                with contextlib.suppress(OSError):
                    dst.shutdown(socket.SHUT_WR)

        back = threading.Thread(target=pump, args=(upstream, client), daemon=True)
        back.start()
        pump(client, upstream)
        back.join()
        client.close()
        upstream.close()
        with self.lock:
            self.relayed.pop(port, None)

    # sampling

    def _sample_loop(self) -> None:
        while not self.stopped.is_set():
            now = time.monotonic()
            with self.lock:
                watched = [w for w in self.workers.values() if w.watched_until > now]
            if not watched:
                self.stopped.wait(0.2)
                continue
            due = [w for w in watched if now - w.scanned_at >= SCAN_EVERY]
            if due:
                self.scan(due)
            for w in watched:
                self.sample(w)
            self.stopped.wait(max(0.0, SAMPLE_EVERY - (time.monotonic() - now)))

    def scan(self, workers: list[WorkerTpu]) -> None:
        found = holders_by_worker(workers)
        now = time.monotonic()
        with self.lock:
            for w in workers:
                w.scanned_at = now
                held = found.get(w.key, {})
                for pid in [p for p in w.holders if p not in held]:
                    del w.holders[pid]
                for pid, chips in held.items():
                    if pid in w.holders:
                        w.holders[pid].chips = chips
                    else:
                        w.holders[pid] = Holder(pid, chips)

    def sample(self, w: WorkerTpu) -> None:
        for h in list(w.holders.values()):
            looked = read_holder(h.pid)
            if looked is None:
                continue
            raw, state, switches, rss, run = looked
            programs: list[float] = []
            stopped = slow.stops(self.pool, *w.key)
            with self.lock:
                h.rss = rss
                step_holder(h, time.monotonic(), raw, state, switches, programs, stopped, run)
                for seconds in programs:
                    for chip in h.chips:
                        w.timings.setdefault(chip, Timing()).add(seconds * 1e6)

    # the RPCs

    def _worker(self, context: Any) -> WorkerTpu | None:
        peer = context.peer() or ""
        try:
            port = int(peer.rsplit(":", 1)[1])
        except (IndexError, ValueError):
            return None
        with self.lock:
            key = self.relayed.get(port)
            return self.workers.get(key) if key else None

    def _held(self, context: Any) -> WorkerTpu | None:
        w = self._worker(context)
        if w is None:
            context.abort(self.grpc.StatusCode.UNAVAILABLE, "no simulated worker behind this "
                          "connection")
        now = time.monotonic()
        first = w.watched_until <= now
        w.watched_until = now + WATCH_FOR
        if first or now - w.scanned_at >= SCAN_EVERY:
            self.scan([w])
            if first:  # a duty cycle needs a little history
                deadline = now + 0.25
                while time.monotonic() < deadline:
                    self.sample(w)
                    time.sleep(SAMPLE_EVERY)
        if not w.holders:
            context.abort(self.grpc.StatusCode.UNAVAILABLE,
                          "no process holds this worker's TPU chips; libtpu serves its runtime "
                          "metrics from the process that does")
        return w

    def get_runtime_metric(self, request: bytes, context: Any) -> bytes:
        w = self._held(context)
        try:
            name = request_metric_name(request)
        except ValueError as err:
            context.abort(self.grpc.StatusCode.INVALID_ARGUMENT, f"bad MetricRequest: {err}")
        with self.lock:
            answer = w.answer(name, time.time(), time.monotonic())
        if answer is None:
            context.abort(self.grpc.StatusCode.NOT_FOUND,
                          f"metric {name!r} is not served on this (single-slice) TPU")
        return answer

    def list_supported(self, request: bytes, context: Any) -> bytes:
        self._held(context)
        return supported_response(SERVED)

    def runtime_status(self, request: bytes, context: Any) -> bytes:
        self._held(context)
        context.abort(self.grpc.StatusCode.UNIMPLEMENTED,
                      "the simulated TPU has no sequencers to report")

    def status(self) -> dict[str, Any]:
        """What is served where, for tests and `sim status`."""
        with self.lock:
            return {f"{k[0]}/w{k[1]}": {"holders": {str(p): sorted(h.chips)
                                                    for p, h in w.holders.items()},
                                        "listening": k in self.listeners}
                    for k, w in self.workers.items()}

    def close(self) -> None:
        self.stopped.set()
        self.wake_w.send(b"x")
        self.server.stop(0)
        with self.lock:
            for sock in self.listeners.values():
                sock.close()
            self.listeners.clear()


_services: dict[int, MetricsService] = {}
_services_lock = threading.Lock()


def serve(pool: Any) -> MetricsService | None:
    """The pool's metrics service, started on first use (None, said once in the log, where
    grpcio is missing: workers then have no metrics service, as a TPU VM with no job)."""
    with _services_lock:
        service = _services.get(id(pool), False)
        if service is False:
            try:
                service = MetricsService(pool)
            except ImportError as err:
                log.warning("no simulated TPU metrics service: %s (pip install grpcio)", err)
                service = None
            _services[id(pool)] = service
    if service is not None:
        service.reconcile()
    return service


def describe(pool: Any) -> str:
    service = _services.get(id(pool))
    return json.dumps(service.status() if service else {})
