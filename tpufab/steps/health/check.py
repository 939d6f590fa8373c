"""`tpufab check`: trust a pod before you spend it.

One fan-out (``remote/facts_worker.py``, the seam `status` uses) asks every worker at once for its
TPU device files and their holders, the Python and package versions a job would run with,
the deployed commit, disk and memory headroom, its clock and whether its mounts answer (and,
where an environment is configured, a second one its hash: docs/environment.md). The
answers are compared across workers (``quick_results``, pure): workers that agree fold into
one line, the odd ones are named, each problem gets its fix. Unless ``quick``, a real
collective follows (``remote/check_collective.sh``, started on every worker through the run
machinery): it checks ``jax.process_count()`` and ``jax.device_count()`` against what the
accelerator type promises and times an all-reduce over every device.
"""

from __future__ import annotations

import statistics
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from tpufab import nodeset
from tpufab.config import timeout_for
from tpufab.errors import TpufabError
from tpufab.reports import Report
from tpufab.steps.health.status import StatusRow, human_bytes
from tpufab.term.commands import short_command

PYTHONS = ("~/.venv/bin/python", "python3")          # what the recipes run with, in order
PACKAGES = ("python", "jax", "jaxlib", "libtpu", "libtpu-nightly", "torch", "torch_xla")
CLOCK_SKEW_SECONDS = 1.0
MOUNT_PROBE_SECONDS = 5.0
COLLECTIVE = "check_collective.sh"
COLLECTIVE_BYTES = 1 << 20        # the buffer each device contributes and gets back
COLLECTIVE_ITERATIONS = 10

FIX_KILL = "free it with `tpufab kill`"
FIX_SETUP = "make the workers agree with `tpufab setup --force`"
FIX_DEPLOY = "put one commit everywhere with `tpufab deploy`"


class CheckError(TpufabError):
    """The pod is not fit to run on (one line per problem in the details)."""


@dataclass(frozen=True)
class Problem:
    check: str
    workers: tuple[int, ...]
    text: str
    fix: str

    def line(self) -> str:
        where = f"{nodeset.fold(self.workers)}: " if self.workers else ""
        return f"{where}{self.text}; {self.fix}."


@dataclass
class Result:
    """One check across the pod: what was found, and the problems (none when it passed)."""

    check: str
    detail: str
    problems: list[Problem] = field(default_factory=list)
    skipped: bool = False
    data: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def status(self) -> str:
        return "skip" if self.skipped else ("ok" if self.ok else "FAIL")


@dataclass
class CheckReport(Report):
    """`tpufab check` (and `run --check`'s quick checks): a ``tpufab.reports.Report`` of the
    pod's own rows, one ``Result`` per check (``ok``: no problems), and the ``summary``
    sentence; printed by tpufab.views.check (the view ``check``)."""

    name: str
    accelerator: str
    workers: list[int]
    seconds: float = 0.0
    step: str = field(default="check", kw_only=True)
    per_worker: bool = field(default=False, kw_only=True)

    view: ClassVar[str] = "check"

    @property
    def problems(self) -> list[Problem]:
        return [p for r in self.rows for p in r.problems]


# ---------------------------------------------------------------------------------------------
# Comparing the workers' facts (pure)


def _majority(groups: Mapping[Any, list[int]]) -> Any:
    """The value most workers share (the first worker's on a tie)."""
    return max(groups, key=lambda v: (len(groups[v]), -min(groups[v])))


def _odd_ones(groups: Mapping[Any, list[int]]) -> tuple[Any, list[tuple[Any, list[int]]]]:
    common = _majority(groups)
    return common, sorted(((v, ws) for v, ws in groups.items() if v != common),
                          key=lambda item: min(item[1]))


def _group(pairs: Sequence[tuple[int, Any]]) -> dict[Any, list[int]]:
    out: dict[Any, list[int]] = {}
    for w, value in pairs:
        out.setdefault(value, []).append(w)
    return out


def check_reachable(facts: Mapping[int, StatusRow]) -> Result:
    down = [(w, f.error or "no answer") for w, f in sorted(facts.items()) if not f.reachable]
    up = [w for w, f in facts.items() if f.reachable]
    problems = [Problem("reachable", tuple(ws), f"unreachable ({why})",
                        "see `tpufab status` and `tpufab describe`; a worker that stays "
                        "unreachable needs the node recreated (`tpufab delete`, then "
                        "`tpufab create`)")
                for why, ws in _group(down).items()]
    return Result("reachable", f"{nodeset.fold(up) or 'none'} answered", problems)


def check_tpu(facts: Mapping[int, StatusRow],
              expected: Mapping[int, Sequence[str]]) -> Result:
    problems: list[Problem] = []
    missing: list[tuple[int, str]] = []
    busy: list[tuple[int, str]] = []
    holders: dict[int, list[dict]] = {}
    for w, f in sorted(facts.items()):
        if not f.reachable:
            continue
        present = {d.path for d in f.devices}
        lost = [p for p in expected.get(w, ()) if p not in present]
        if lost:
            missing.append((w, f"{len(lost)} of {len(expected[w])} TPU device files missing "
                               f"({', '.join(lost)})"))
        if f.busy_devices:
            commands = sorted({_short(h.command) for d in f.busy_devices for h in d.holders})
            shown = "; ".join(commands[:3]) + (f"; +{len(commands) - 3} more"
                                                if len(commands) > 3 else "")
            busy.append((w, f"TPU busy: {len(f.busy_devices)} of {len(f.devices)} device "
                            f"files held by {shown}"))
            holders[w] = [{"pid": h.pid, "command": h.command, "device": d.path}
                          for d in f.busy_devices for h in d.holders]
    for text, ws in _group(missing).items():
        problems.append(Problem("tpu", tuple(ws), text, "the VM lost its TPU: recreate the "
                                "node (`tpufab delete`, then `tpufab create`)"))
    for text, ws in _group(busy).items():
        pids = "; ".join(f"{nodeset.label(w)} pid "
                         f"{', '.join(str(p) for p in sorted({h['pid'] for h in holders[w]}))}"
                         for w in ws[:4]) + ("; ..." if len(ws) > 4 else "")
        problems.append(Problem("tpu", tuple(ws), f"{text} ({pids})", FIX_KILL))
    free = [w for w, f in facts.items() if f.reachable and not f.busy_devices
            and w not in dict(missing)]
    counts = sorted({len(facts[w].devices) for w in free})
    what = "/".join(str(c) for c in counts) if counts else "no"
    return Result("tpu", f"{what} device files, free, on {nodeset.fold(free) or 'no worker'}",
                  problems, data={"holders": {str(w): h for w, h in holders.items()}})


def _short(command: str, width: int = 60) -> str:
    """A holder's command as what names it (tpufab.term.commands; --json has it whole)."""
    return short_command(command, width)


def check_versions(facts: Mapping[int, StatusRow]) -> Result:
    reachable = {w: f for w, f in sorted(facts.items()) if f.reachable}
    problems: list[Problem] = []
    unread = [(w, str(f.packages.get("error"))) for w, f in reachable.items()
              if not f.packages or f.packages.get("error")]
    for why, ws in _group(unread).items():
        problems.append(Problem("versions", tuple(ws), f"cannot read the job's Python "
                                f"packages ({why})", "set it up with `tpufab setup`"))
    read = {w: f for w, f in reachable.items() if w not in dict(unread)}
    agreed = []
    for key in PACKAGES:
        groups = _group([(w, f.packages.get(key)) for w, f in read.items()])
        if not groups:
            continue
        if len(groups) == 1:
            value = next(iter(groups))
            if value is not None:
                agreed.append(f"{key} {value}")
            continue
        common, odd = _odd_ones(groups)
        for value, ws in odd:
            problems.append(Problem("versions", tuple(ws),
                                    f"{key} {value or 'not installed'}, but "
                                    f"{common or 'not installed'} on "
                                    f"{nodeset.fold(groups[common])}", FIX_SETUP))
    pythons = sorted({str(f.packages.get("executable")) for f in read.values()
                      if f.packages.get("executable")})
    where = f" ({', '.join(pythons)})" if len(pythons) == 1 else ""
    detail = (", ".join(agreed) + where) if agreed else "no Python packages to compare"
    return Result("versions", detail, problems,
                  data={"packages": {str(w): f.packages for w, f in read.items()}})


def check_environment(status: Any) -> Result:
    """Every host's environment against the configured one (``status``: an
    ``EnvStatusReport`` of tpufab.steps.host.environment: each host's hash, the expected
    one); a host lacking it or holding another is a line with its fix (pure)."""
    rows = [r for r in status.rows if r.ok]
    groups = _group([(r.worker, r.hash or None) for r in rows])
    expected = status.expected or (_majority(groups) if groups else None)
    short = (expected or "")[:12]
    have = groups.get(expected, []) if expected else []
    where = f"on {nodeset.fold(have)}" if have else "on no host"
    problems = []
    for value, ws in sorted(((v, ws) for v, ws in groups.items() if v != expected),
                            key=lambda item: min(item[1])):
        text = (f"no environment at {status.path}" if value is None else
                f"environment {value[:12]} at {status.path}, not the configured one")
        problems.append(Problem("environment", tuple(ws), f"{text} ({short} is {where})",
                                "build it there with `tpufab env build`"))
    detail = (f"{short} at {status.path} {where}" if not problems else
              f"{len(groups)} different environments at {status.path}")
    return Result("environment", detail, problems,
                  data={"expected": expected, "hashes": {str(r.worker): r.hash for r in rows}})


def check_commit(facts: Mapping[int, StatusRow], *, enabled: bool = True) -> Result:
    if not enabled:
        return Result("commit", "skipped: run deploys one commit to every worker first",
                      skipped=True)
    reachable = {w: f for w, f in sorted(facts.items()) if f.reachable}
    dirs = sorted({d.dir for f in reachable.values() for d in f.deploys})
    if not dirs:
        return Result("commit", "skipped: not run from a git checkout (nothing deployed "
                      "from here to compare)", skipped=True)
    groups = _group([(w, f.commit) for w, f in reachable.items()])
    if set(groups) == {None}:
        return Result("commit", f"no checkout in {', '.join(dirs)} yet (`tpufab deploy` "
                      "puts one there)")
    if len(groups) == 1:
        commit = next(iter(groups))
        return Result("commit", f"{commit[:12]} on {nodeset.fold(groups[commit])} in "
                      f"{', '.join(dirs)}")
    common, odd = _odd_ones(groups)
    problems = [Problem("commit", tuple(ws),
                        f"{'checkout at ' + value[:12] if value else 'no checkout'} in "
                        f"{', '.join(dirs)}, but {common[:12] if common else 'none'} on "
                        f"{nodeset.fold(groups[common])}", FIX_DEPLOY)
                for value, ws in odd]
    return Result("commit", f"{len(groups)} different commits", problems)


def check_headroom(facts: Mapping[int, StatusRow]) -> list[Result]:
    reachable = {w: f for w, f in sorted(facts.items()) if f.reachable}
    disk_low = [(w, "; ".join(f"{d.path} has {human_bytes(d.free_bytes)} free of "
                              f"{human_bytes(d.total_bytes)}" for d in f.disk if d.low))
                for w, f in reachable.items() if any(d.low for d in f.disk)]
    disk = Result("disk", _range("free", [min((d.free_bytes for d in f.disk), default=None)
                                          for f in reachable.values()]),
                  [Problem("disk", (w,), f"low on disk: {text}", "free space there (old "
                           "checkpoints, ~/.cache) before a job fills it")
                   for w, text in disk_low])
    mem_low = [w for w, f in reachable.items() if f.memory_low]
    memory = Result("memory", _range("available", [f.memory_available
                                                   for f in reachable.values()]),
                    [Problem("memory", tuple(mem_low), "under 5% of memory available",
                             "find what holds it with `tpufab status`; stale jobs go with "
                             "`tpufab kill`")] if mem_low else [])
    return [disk, memory]


def _range(what: str, values: Sequence[int | None]) -> str:
    known = sorted(v for v in values if v is not None)
    if not known:
        return "unknown"
    low, high = human_bytes(known[0]), human_bytes(known[-1])
    return f"{low if low == high else low + '-' + high} {what}"


def clock_skew(worker_time: float | None, before: float, after: float) -> float | None:
    """How far a worker's clock is off, as far as the round trip can tell: 0 when it read a
    time within [before, after] of ours, else the distance to that window."""
    if worker_time is None:
        return None
    if worker_time < before:
        return worker_time - before
    if worker_time > after:
        return worker_time - after
    return 0.0


def check_clock(facts: Mapping[int, StatusRow], before: float, after: float,
                limit: float = CLOCK_SKEW_SECONDS) -> Result:
    skews = {w: clock_skew(f.time, before, after) for w, f in sorted(facts.items())
             if f.reachable}
    off = {w: s for w, s in skews.items() if s is not None and abs(s) > limit}
    problems = []
    for w, s in off.items():
        problems.append(Problem("clock", (w,), f"clock {abs(s):.1f} s "
                                f"{'ahead of' if s > 0 else 'behind'} this machine",
                                "sync it (chrony or systemd-timesyncd); skewed clocks break "
                                "token expiry, logs and coordinator timeouts"))
    worst = max((abs(s) for s in skews.values() if s is not None), default=None)
    detail = (f"within {limit:g} s of this machine (round trip {after - before:.1f} s)"
              if worst is not None and not off else "unknown" if worst is None else
              f"up to {worst:.1f} s off")
    return Result("clock", detail, problems,
                  data={"skew_seconds": {str(w): s for w, s in skews.items()}})


def check_mounts(facts: Mapping[int, StatusRow]) -> Result:
    reachable = {w: f for w, f in sorted(facts.items()) if f.reachable}
    problems: list[Problem] = []
    failing = [(w, (p.at, p.error or "no answer")) for w, f in reachable.items()
               for p in f.mount_probes if not p.ok]
    for (at, why), ws in _group(failing).items():
        problems.append(Problem("mounts", tuple(ws), f"{at} does not answer ({why})",
                                f"remount it: `tpufab umount --at {at} --lazy`, then "
                                "`tpufab mount` again"))
    where: dict[str, list[int]] = {}
    for w, f in reachable.items():
        for m in f.mounts:
            where.setdefault(m.at, []).append(w)
    for at, ws in sorted(where.items()):
        lacking = [w for w in reachable if w not in ws]
        if lacking:
            problems.append(Problem("mounts", tuple(lacking), f"{at} is not mounted (it is "
                                    f"on {nodeset.fold(ws)})", "mount it there with "
                                    "`tpufab mount`"))
    if not where:
        return Result("mounts", "none", problems)
    answering = [f"{at}" for at in sorted(where)]
    return Result("mounts", f"{', '.join(answering)} answer{'s' if len(answering) == 1 else ''}"
                  if not problems else f"{len(where)} mount(s)", problems)


def check_ray(facts: Mapping[int, StatusRow]) -> Result | None:
    """Ray up with every worker joined to its head (from the raylets the facts found); None
    where no worker runs Ray at all."""
    from tpufab.steps.health.status import ray_view

    view = ray_view(facts)
    if view is None:
        return None
    if view.up:
        return Result("ray", f"up, head {nodeset.label(view.head)}, {len(view.joined)}/"
                      f"{len(view.joined)} hosts joined")
    if view.head is None:
        text = "a raylet runs without Ray's head (GCS) on any worker"
        where = view.stray
    else:
        text = f"not joined to Ray's head on {nodeset.label(view.head)}"
        where = view.missing
    return Result("ray", view.line().removeprefix("Ray: ").split(";")[0],
                  [Problem("ray", tuple(where), text, "start Ray again with `tpufab ray up`")])


def quick_results(facts: Mapping[int, StatusRow], *, expected_devices: Mapping[int,
                  Sequence[str]], before: float, after: float,
                  compare_commits: bool = True) -> list[Result]:
    """Every quick check, from the facts the workers sent (pure)."""
    return [check_reachable(facts), check_tpu(facts, expected_devices), check_versions(facts),
            check_commit(facts, enabled=compare_commits), *check_headroom(facts),
            check_clock(facts, before, after), check_mounts(facts),
            *filter(None, [check_ray(facts)])]


# ---------------------------------------------------------------------------------------------
# The collective (its answers are parsed and judged purely)


@dataclass(frozen=True)
class Promise:
    """What the accelerator type promises JAX will see."""

    processes: int
    devices: int

    @property
    def local_devices(self) -> int:
        return max(1, self.devices // max(1, self.processes))


def promise_of(nodes: Sequence[Any]) -> Promise:
    from tpufab.topology import slice_shape

    processes = devices = 0
    for node in nodes:
        shape = slice_shape(node.accelerator_type, node.chip_topology or None)
        processes += len(node.workers) or shape.topology.hosts
        devices += shape.jax_device_count
    return Promise(processes, devices)


def collective_args(promise: Promise, *, timeout: float, size: int = COLLECTIVE_BYTES,
                    iterations: int = COLLECTIVE_ITERATIONS) -> list[str]:
    return ["--expect-processes", str(promise.processes), "--expect-devices",
            str(promise.devices), "--local-devices", str(promise.local_devices),
            "--bytes", str(size), "--iterations", str(iterations),
            "--timeout", f"{timeout:g}"]


def parse_collective(text: str) -> dict | None:
    """The collective's answer (check_collective.sh), read as every worker answer is."""
    from tpufab.ssh.remote_files import read_answer

    return read_answer(text)


def _collective_fix(stage: str, error: str) -> str:
    if stage in ("import", "python"):
        return "install JAX there with `tpufab setup --force`"
    if stage == "count":
        return "a host is missing or the wrong JAX/libtpu runs there: `tpufab kill`, then " \
               "`tpufab setup --force`"
    if stage == "initialize" or "gave up" in error:
        return "a peer never joined: see `tpufab status`, free the TPU with `tpufab kill`"
    return "see `tpufab logs --run RUN` for the whole log"


def judge_collective(answers: Mapping[int, dict | None], ended: Mapping[int, str],
                     promise: Promise, run_id: str) -> Result:
    """One Result from every worker's answer (None: it printed none; ``ended`` says how its
    job ended)."""
    problems: list[Problem] = []
    failed: list[tuple[int, tuple[str, str]]] = []
    for w in sorted(answers):
        data = answers[w]
        if data is None:
            failed.append((w, ("start", f"no answer ({ended.get(w, 'no record')})")))
        elif data.get("error") or not data.get("ok"):
            failed.append((w, (str(data.get("stage") or "?"),
                               str(data.get("error") or f"the all-reduce summed to "
                                   f"{data.get('sum')}, not {data.get('expected_sum')}"))))
    for (stage, error), ws in _group(failed).items():
        problems.append(Problem("collective", tuple(ws), f"collective failed ({stage}): {error}",
                                _collective_fix(stage, error).replace("RUN", run_id)))
    good = {w: d for w, d in answers.items() if d and d.get("ok")}
    if problems or not good:
        return Result("collective", f"failed on {nodeset.fold(w for w, _ in failed)} "
                      f"(run {run_id})", problems, data={"run": run_id})
    first = good[min(good)]
    times = {w: d.get("times_ms") or [] for w, d in good.items()}
    rounds = min(len(t) for t in times.values())
    per_round = [statistics.median(t[i] for t in times.values()) for i in range(rounds)]
    median = statistics.median(per_round) if per_round else 0.0
    # In each round, the host that arrived last waited least: it held the others up by the
    # difference. The slowest host is the one that did that most often.
    stragglers: Counter[int] = Counter()
    leads: dict[int, list[float]] = {}
    for i in range(rounds):
        round_times = {w: t[i] for w, t in times.items()}
        last = min(round_times, key=lambda w: (round_times[w], w))
        stragglers[last] += 1
        leads.setdefault(last, []).append(max(round_times.values()) - round_times[last])
    slowest = stragglers.most_common(1)[0][0] if stragglers else min(good)
    waited = statistics.median(leads.get(slowest, [0.0]))
    size = int(first.get("bytes") or 0)
    detail = (f"{first.get('process_count')} processes, {first.get('device_count')} "
              f"{first.get('backend')} devices (as promised); all-reduce of "
              f"{human_bytes(size)} per device: {median:.1f} ms median over {rounds} rounds; slowest "
              f"host {nodeset.label(slowest)} (the others waited {waited:.1f} ms for it)")
    return Result("collective", detail, data={
        "run": run_id, "processes": first.get("process_count"),
        "devices": first.get("device_count"), "backend": first.get("backend"),
        "promised": {"processes": promise.processes, "devices": promise.devices},
        "allreduce_bytes_per_device": size, "median_ms": median, "rounds_ms": per_round,
        "slowest_host": slowest, "slowest_host_lead_ms": waited})


# ---------------------------------------------------------------------------------------------
# The whole check


def expected_device_files(nodes: Sequence[Any]) -> dict[int, tuple[str, ...]]:
    out: dict[int, tuple[str, ...]] = {}
    worker = 0
    for node in nodes:
        files = node.topology.device_files if node.topology else ()
        for _ in node.workers:
            out[worker] = files
            worker += 1
    return out


def live_runs(facts: Mapping[int, StatusRow]) -> list[tuple[str, str | None, str]]:
    """(run, recipe, its workers folded) for each run running or starting (pure)."""
    found: dict[str, tuple[str | None, list[int]]] = {}
    for w, f in sorted(facts.items()):
        for r in f.running:
            found.setdefault(r.run, (r.recipe, []))[1].append(w)
    return [(run, recipe, nodeset.fold(where)) for run, (recipe, where) in sorted(found.items())]


def run_check(settings: Any, pod: Any, *, quick: bool = False, timeout: float | None = None,
              compare_commits: bool = True, deploy_dirs: Sequence[str] | None = None,
              progress: Any = None, collective: Any = None) -> CheckReport:
    """The quick checks in one fan-out, then (unless ``quick`` or they failed) the
    collective: ``collective(pod, promise, timeout=)``, a job started the one way every job
    starts (``tpufab.steps.start.collective.run_collective``, given by the caller: starting
    a job is a band above this one). Beside a live run the collective is refused (CodeBusy,
    one sentence), or with ``quick`` named as skipped because of it."""
    from tpufab.steps.health import status

    timeout = timeout_for("check", timeout)
    started = time.monotonic()
    from tpufab.steps.host.environment import env_spec, environment_status

    dirs = status.default_deploy_dirs(settings) if deploy_dirs is None else list(deploy_dirs)
    spec = env_spec(settings)
    pythons = PYTHONS if spec is None else (f"{spec.path}/bin/python", "python3")
    before = time.time()
    facts = status.gather_facts(pod.fanout, deploy_dirs=dirs, pythons=pythons,
                                probe_mounts=MOUNT_PROBE_SECONDS,
                                timeout=settings.command_timeout)
    after = time.time()
    types = sorted({n.accelerator_type for n in pod.nodes})
    report = CheckReport(pod.name, ", ".join(types), list(pod.workers))
    report.rows = quick_results(facts, expected_devices=expected_device_files(pod.nodes),
                                before=before, after=after, compare_commits=compare_commits)
    up = [w for w in pod.workers if facts[w].reachable]
    if spec is not None and up:     # the environment built once: the same hash everywhere
        found = environment_status(pod.fanout, spec, spec.path, workers=up,
                                   timeout=timeout_for("env status", None,
                                                       settings.command_timeout))
        at = next(i for i, r in enumerate(report.rows) if r.check == "versions") + 1
        report.rows.insert(at, check_environment(found))
    report.rows.append(maintenance_result(settings, pod.nodes, facts))
    live = live_runs(facts)
    if live:
        run, recipe, where = live[0]
        if not quick:
            from tpufab.errors import CodeBusy

            raise CodeBusy(f"Run {run} ({recipe or 'a recipe'}) is running on {where}, and "
                           "the collective would start beside it on the same TPUs: wait for "
                           f"it (`tpufab logs --run {run} --follow`), stop it (`tpufab kill "
                           f"--run {run}`), or check without the collective (`tpufab check "
                           "--quick`).")
        report.rows.append(Result("collective", f"skipped (--quick): run {run} is "
                                     f"running on {where}", skipped=True))
    elif not quick:
        if report.problems:
            report.rows.append(Result("collective", "skipped: fix the problems above "
                                         "first", skipped=True))
        else:
            if progress is not None:
                progress("Running a collective on every worker ...")
            report.rows.append(collective(pod, promise_of(pod.nodes), timeout=timeout))
    report.seconds = time.monotonic() - started
    report.summary = summary(report)
    return report


def maintenance_result(settings: Any, nodes: Sequence[Any], facts: Mapping[int, Any]) -> Result:
    """The maintenance windows the API announces for the nodes and the notices the workers'
    metadata servers hold: shown, never a failure (the collective says whether it works)."""
    from tpufab.cloud import planes
    from tpufab.steps.health import status

    try:
        status.fill_upcoming_maintenance(planes.control_plane(settings), nodes)
    except TpufabError:  # no control plane to ask (no project): the notices alone
        pass
    lines = status.maintenance_lines(nodes, facts)
    detail = "; ".join(lines) if lines else "none announced"
    return Result("notices", detail, data={"maintenance": lines})


def refuse_timeout(timeout: float) -> None:
    """`tpufab check --timeout` (the collective's seconds) above 0, or one sentence."""
    from tpufab.errors import ConfigError

    if timeout <= 0:
        raise ConfigError(f"--timeout must be more than 0 seconds, not {timeout:g}.")


def summary(report: CheckReport) -> str:
    """One sentence: passed every check, or how many problems (pure)."""
    where = nodeset.fold(report.workers)
    if report.ok:
        return (f"Pod {report.name} ({report.accelerator}, {where}) passed every check in "
                f"{report.seconds:.1f} s.")
    n = len(report.problems)
    return (f"Pod {report.name} ({report.accelerator}, {where}): {n} "
            f"problem{'s' if n != 1 else ''} ({report.seconds:.1f} s).")
