"""Autostop: a watchdog on the pod deletes it once idle, or at a TTL, without your laptop.

``arm`` writes each worker's config (a 0600 file, no secrets) and starts
``tpufab/remote/autostop_worker.py`` on every worker (shipped by hash, with ``facts_worker.py``, which it
uses to see runs and TPU holders). Worker 0 leads: it asks the others over TCP on their
internal addresses and deletes the node (or its queued resource) through the TPU API. The
policy is also put in the node's metadata (``tpufab-autostop``) so ``tpufab list`` shows it
without reaching the workers; ``tpufab status`` asks worker 0 for when it will fire and what
it did. ``cancel`` stops every watchdog and clears the metadata.
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tpufab.cloud.nodes import AUTOSTOP_KEY, describe_autostop
from tpufab.errors import ApiError, ConfigError, NotFound, TpufabError
from tpufab.reports import Report
from tpufab.ssh.remote_files import (
    RemoteFile,
    put_each,
    python_command,
    read_answer,
    run_script,
    run_with_files,
)

SCRIPT = "autostop_worker.py"
FACTS = "facts_worker.py"
CONFIG_FILE = "~/.tpufab/autostop-arm-{token}.json"   # one per arm: two at once never share it


class AutostopError(TpufabError):
    """The watchdog could not be armed, cancelled or read on some workers."""


def script() -> RemoteFile:
    return RemoteFile.bundled(SCRIPT)


def facts_file() -> RemoteFile:
    return RemoteFile.bundled(FACTS)


# -- deciding (pure) --------------------------------------------------------------------------


def policy(*, idle: float | None, ttl: float | None) -> dict[str, Any]:
    """What the user asked for, as durations: the workers turn a TTL into a deadline on their
    own clock (a laptop's clock may be hours off)."""
    out: dict[str, Any] = {}
    if idle:
        out["idle"] = float(idle)
    if ttl:
        out["ttl"] = float(ttl)
    return out


def check_settings(settings) -> None:
    """The watchdog's settings, refused in one sentence before any worker is touched."""
    from tpufab.errors import ConfigError

    port, every = settings.autostop_port, settings.autostop_check
    if not isinstance(port, int) or isinstance(port, bool) or not 1 <= port <= 65535:
        raise ConfigError(f"autostop_port (TPUFAB_AUTOSTOP_PORT) must be a TCP port between 1 "
                          f"and 65535, not {port!r}.")
    if not isinstance(every, int | float) or isinstance(every, bool) or not every > 0:
        raise ConfigError(f"autostop_check (TPUFAB_AUTOSTOP_CHECK) must be a number of "
                          f"seconds above 0, not {every!r}.")


def worker_configs(pol: Mapping[str, Any], *, ips: Sequence[str], endpoint: str, project: str,
                   zone: str, node: str, queued_resource: str | None, port: int,
                   check_every: float, metadata_host: str | None = None) -> dict[int, dict]:
    """Each worker's watchdog config; worker 0 leads and knows every peer's address. A peer
    answers only a question that carries ``peer_token`` (one per arm, in each worker's 0600
    config): its port is on the internal IP, reachable by others in the VPC."""
    import secrets

    auth = "anonymous" if endpoint.startswith("http://") else "metadata"
    base = {**pol, "endpoint": endpoint, "project": project, "zone": zone, "node": node,
            "queued_resource": queued_resource, "port": port, "check_every": check_every,
            "auth": auth, "peer_token": secrets.token_hex(16)}
    if metadata_host:
        base["metadata_host"] = metadata_host
    out = {}
    for w, ip in enumerate(ips):
        config = {**base, "worker": w, "listen": ip}
        if w == 0:
            config["peers"] = list(ips)
        out[w] = config
    return out


# -- applying ----------------------------------------------------------------------------------


def _check(results: Mapping[int, Any], what: str) -> dict[int, dict]:
    from tpufab import nodeset
    from tpufab.steps.runs.running import failure_reason

    answers, failed = {}, {}
    for w, r in sorted(results.items()):
        data = (read_answer(r.stdout) or {}) if r.error is None else {}
        if r.ok and "error" not in data:
            answers[w] = data
        else:
            failed[w] = data.get("error") or failure_reason(r)
    if failed:
        detail = "; ".join(f"{nodeset.label(w)}: {why}" for w, why in failed.items())
        raise AutostopError(f"Could not {what} on {nodeset.fold(failed)} ({detail}).")
    return answers


def _node_going(settings, name: str, control=None) -> bool:
    """True when the node is deleted or being deleted (the API refuses to update it then)."""
    from tpufab.cloud import planes

    try:
        return planes.control_plane(settings, control).get_node(name).state == "DELETING"
    except NotFound:
        return True


def _set_metadata(pod, settings, value: str | None, control=None) -> None:
    from tpufab.cloud import planes

    control = planes.control_plane(settings, control)
    for node in pod.nodes:
        current = control.get_node(node.name)
        metadata = dict(current.metadata)
        if value is None and AUTOSTOP_KEY not in metadata:
            continue
        if value is None:
            metadata.pop(AUTOSTOP_KEY)
        else:
            metadata[AUTOSTOP_KEY] = value
        op = control.update_metadata(node.name, metadata)
        deadline = time.monotonic() + settings.wait_timeout
        while not control.operation_done(op, "update", name=node.name):
            if time.monotonic() > deadline:
                raise AutostopError(f"Updating the metadata of {node.name} did not finish.")
            time.sleep(0.2)


@dataclass(kw_only=True)
class AutostopReport(Report):
    """What `tpufab autostop` did (a ``tpufab.reports.Report`` of the pod as a whole: the
    watchdog runs on every worker, worker 0 answers for them): ``armed`` is the policy as
    worker 0 armed it, or (``cancelled``) what was armed, None if nothing was."""

    step: str = "autostop"
    armed: dict[str, Any] | str | None = None
    cancelled: bool = False


def configure(pod, settings, *, idle: str | float | None = None,
              ttl: str | float | None = None, cancel: bool = False,
              timeout: float | None = None) -> AutostopReport:
    """`tpufab autostop` (and ``Pod.autostop``): ``idle``/``ttl`` as durations (``30m``, or
    seconds) checked before any worker is touched; arm them, or ``cancel``. Returns the
    report: the policy armed, or (cancel) what was armed (None if nothing was)."""
    from tpufab import durations

    idle_s = durations.parse_duration(idle, "--idle")
    ttl_s = durations.parse_duration(ttl, "--ttl")
    if cancel and (idle_s or ttl_s):
        raise ConfigError("--cancel removes the autostop; it takes no --idle or --ttl.")
    if not cancel and not idle_s and not ttl_s:
        raise ConfigError("Say when to stop: --idle 30m (after 30 idle minutes), --ttl 8h (8 "
                          "hours from now), both, or --cancel.")
    if cancel:
        done = _cancel_all(pod, settings, timeout=timeout)
        return AutostopReport(armed=done, cancelled=True, summary=(
            f"Autostop of {pod.name} cancelled"
            + (f" (it was: {done})." if done else "; none was armed.")))
    armed = arm(pod, settings, idle=idle_s, ttl=ttl_s, timeout=timeout)
    skew = skew_note(armed)
    return AutostopReport(armed=armed, notes=[skew] if skew else [], summary=(
        f"Autostop of {pod.name}: {describe_autostop(armed)}. `tpufab status` shows it; "
        "`tpufab autostop --cancel` removes it."))


SKEW_NOTE = 60.0   # seconds between this machine's clock and worker 0's worth a note


def arm(pod, settings, *, idle: float | None = None, ttl: float | None = None,
        control=None, clock=time.time, timeout: float | None = None) -> dict[str, Any]:
    """Start (or replace) the watchdog on every worker; returns the policy as worker 0 armed
    it (``armed_at``, ``ttl_at`` on its clock; ``skew``: its clock minus ``clock()`` when they
    differ by more than a minute).

    The settings are checked first, and each worker checks its config (and that it can
    listen) before it stops a watchdog already running, which it starts again if the new one
    does not start: a bad arm leaves the old watchdog in charge."""
    from tpufab.cloud import planes
    from tpufab.cloud.planes.calls import DEFAULT_ENDPOINT

    check_settings(settings)
    pol = policy(idle=idle, ttl=ttl)
    if not pol:
        raise AutostopError("Say when to stop: an idle period, a TTL, or both.")
    node = pod.nodes[0]
    configs = worker_configs(pol, ips=pod.internal_ips(),
                             endpoint=settings.api_endpoint or DEFAULT_ENDPOINT,
                             project=settings.project, zone=settings.zone, node=node.name,
                             queued_resource=node.queued_resource,
                             port=settings.autostop_port, check_every=settings.autostop_check)
    for config in configs.values():
        config["node_id"] = node.id
        config.update(planes.plane_for(node, settings).watchdog(node))  # its plane's way
    workers = pod.workers
    contents = {w: json.dumps(configs[w]).encode() for w in workers}
    from tpufab.steps.runs.running import open_workers

    open_workers(pod.fanout, workers, "arm autostop")
    config_file = CONFIG_FILE.format(token=secrets.token_hex(6))
    puts = put_each(pod.fanout, contents, config_file, mode=0o600)
    _check(puts, "write the autostop config")
    arm_args = ["arm", "--config", config_file, "--facts", facts_file().path]
    check = python_command(script(), [*arm_args, "--check-only"], needs=[facts_file()])
    try:   # every worker checks first: one that cannot run it changes nothing anywhere
        _check(run_with_files(pod.fanout, [script(), facts_file()], check, workers,
                              timeout=timeout),
               "arm the autostop (nothing was changed: any watchdog running is kept)")
    except AutostopError:
        pod.fanout.run(f"rm -f {config_file}", workers=workers).close()
        raise
    line = python_command(script(), arm_args, needs=[facts_file()])
    answers = _check(run_with_files(pod.fanout, [script(), facts_file()], line, workers,
                                    timeout=timeout),
                     "start the autostop watchdog")
    lead = answers.get(workers[0], {})
    armed = dict(pol)
    armed["armed_at"] = lead.get("armed_at")
    if lead.get("ttl_at"):
        armed["ttl_at"] = lead["ttl_at"]
    try:
        _set_metadata(pod, settings, json.dumps(armed, sort_keys=True), control)
    except ApiError:
        # every worker answered a moment ago: if the node is gone or going since, this very
        # watchdog did it (a TTL shorter than this command on a loaded machine). Armed, and
        # done already; any other refusal is the user's to see.
        if not _node_going(settings, node.name, control):
            raise
    if isinstance(lead.get("now"), int | float) and abs(lead["now"] - clock()) > SKEW_NOTE:
        armed["skew"] = lead["now"] - clock()
    return armed


def skew_note(armed: Mapping[str, Any]) -> str | None:
    """One line when worker 0's clock and this machine's disagree (the TTL counts there)."""
    from tpufab.durations import human_duration

    skew = armed.get("skew")
    if not skew:
        return None
    size = abs(skew)
    if size >= 120:   # to the minute: the measurement itself is a round trip off
        size = round(size / 60) * 60
    return (f"Worker 0's clock is {human_duration(size)} "
            f"{'ahead of' if skew > 0 else 'behind'} this machine's; the TTL counts on the "
            "worker's clock.")


def cancel(pod, settings, *, control=None, timeout: float | None = None) -> str | None:
    """Stop every watchdog; the description of what was armed, or None."""
    answers = _check(run_script(pod.fanout, SCRIPT, ["cancel"], pod.workers, timeout=timeout),
                     "cancel the autostop")
    _set_metadata(pod, settings, None, control)
    was = answers.get(pod.workers[0], {}).get("was")
    return describe_autostop(was) if was else None


_cancel_all = cancel  # configure's keyword `cancel` hides the function there


def worker_state(pod, *, timeout: float | None = None) -> dict[str, Any]:
    """Worker 0's view: config, state (idle since, fires at, busy), recent events."""
    first = pod.workers[0]
    results = run_script(pod.fanout, SCRIPT, ["state"], [first], timeout=timeout)
    return _check(results, "read the autostop state")[first]
