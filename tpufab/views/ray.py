"""How `tpufab ray status` shows (the view ``ray`` of tpufab.views.report.show): a line
on Ray's head and how many hosts joined, a line per node the head sees (its TPU and CPU, the
head resource, the slice labels), the hosts not joined, then the jobs; or one sentence when
Ray is not up. ``--json``: up, address, head, missing, nodes, jobs, error (docs/ray.md).
And the sentences that say what `ray up` and `ray down` did."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tpufab import nodeset
from tpufab.term.terminal import neutralise_text

if TYPE_CHECKING:
    from rich.console import Console

    from tpufab.steps.start.raycluster import RayDown, RayStatus, RayUp


def to_json(report: RayStatus) -> dict[str, Any]:
    return {"up": report.up, "address": report.address if report.up else None,
            "head": report.head, "missing": report.missing, "nodes": report.nodes,
            "jobs": report.jobs, "error": report.error}


def lines(report: RayStatus) -> list[str]:
    if not report.up:
        running = [w for w, s in report.states.items() if s.get("processes")]
        extra = (f" (Ray processes are left on {nodeset.fold(running)}: `tpufab ray down` "
                 "stops them)") if running else ""
        why = f": {report.error}" if report.error else ""
        return [f"Ray is not running on {report.name}{why}{extra}; `tpufab ray up` starts it."]
    by_ip = {h.ip: h for h in report.hosts}
    out = [f"Ray on {report.name}: head on {nodeset.label(report.head)} at {report.address}; "
           f"{len(report.hosts) - len(report.missing)}/{len(report.hosts)} hosts joined."]
    for n in sorted(report.nodes, key=lambda n: by_ip[n["ip"]].worker if n.get("ip") in by_ip
                    else 1 << 30):
        host = by_ip.get(n.get("ip"))
        res = n.get("resources") or {}
        labels = n.get("labels") or {}
        extras = sorted(k for k in res if k.startswith("TPU-") and k.endswith("-head"))
        out.append(
            f"  {nodeset.label(host.worker) if host else '?'} {n.get('ip')}: "
            f"TPU {res.get('TPU', 0):g}, CPU {res.get('CPU', 0):g}"
            + "".join(f", {k}" for k in extras)
            + f"; slice {labels.get('ray.io/tpu-slice-name', '-')}, worker-id "
            f"{labels.get('ray.io/tpu-worker-id', '-')}, pod-type "
            f"{labels.get('ray.io/tpu-pod-type', '-')}, topology "
            f"{labels.get('ray.io/tpu-topology', '-')}" + (" (head)" if n.get("head") else ""))
    if report.missing:
        out.append(f"  not joined: {nodeset.fold(report.missing)} (`tpufab ray up` rejoins "
                   "them)")
    if report.jobs:
        out.append(f"Jobs ({len(report.jobs)}):")
        for job in sorted(report.jobs, key=lambda j: j.get("start_time") or 0):
            out.append(f"  {job.get('id')}: {job.get('status')}  {job.get('entrypoint')}")
    else:
        out.append("No jobs.")
    return out


def show(report: RayStatus, *, as_json: bool, console: Console, errors: Console) -> None:
    """The lines on ``console``; or the JSON."""
    from tpufab.term.console import print_json

    if as_json:
        print_json(to_json(report), console)
        return
    for line in lines(report):
        console.print(neutralise_text(line), markup=False)


def up_sentence(done: RayUp, name: str) -> str:
    """What `tpufab ray up` did on pod ``name``, and what to do next (and, where the Ray
    installed has no token authentication, that its job API is open to whoever reaches the
    host)."""
    warning = (f" Warning: Ray on {nodeset.fold(done.open_hosts)} has no token authentication "
               "(Ray 2.52 and later have it): anyone who can reach those hosts can run "
               "commands through Ray; install a newer Ray (`TPUFAB_RAY_SPEC`).") \
        if done.open_hosts else ""
    if done.already:
        return (f"Ray is already up on {name}: head on {nodeset.label(done.head)} at "
                f"{done.address}, all {done.hosts} hosts joined; nothing to do "
                f"({done.seconds:.1f} s).{warning}")
    how = "started" if len(done.started) == done.hosts else \
        f"started on {nodeset.fold(done.started)} (the others were up)"
    return (f"Ray is up on {name}: head on {nodeset.label(done.head)} at {done.address}, "
            f"{done.hosts} hosts joined ({how}, {done.seconds:.1f} s). Jobs: `tpufab ray "
            f"submit RECIPE`; dashboard: `tpufab forward {done.dashboard_port}` (its token: "
            f"`~/.ray/auth_token` on the head).{warning}")


def down_sentence(done: RayDown, name: str) -> str:
    """What `tpufab ray down` did on pod ``name``."""
    had = [w for w, a in done.answers.items() if a.get("stopped")]
    if not had:
        return f"Ray was not running on {name}; nothing to stop."
    forced = [w for w, a in done.answers.items() if a.get("forced")]
    how = f" (forced on {nodeset.fold(forced)})" if forced else ""
    return (f"Ray stopped on {nodeset.fold(had)} of {name}{how}; no Ray process is left "
            "on any host.")
