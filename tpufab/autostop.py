"""Autostop: a watchdog on the pod deletes it once idle, or at a TTL, without your laptop.

``arm`` writes each worker's config (a 0600 file, no secrets) and starts
``tpufab/remote/autostop.py`` on every worker (shipped by hash, with ``facts.py``, which it
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
from typing import Any

from tpufab.errors import TpufabError
from tpufab.remote_files import (
    RemoteFile,
    last_json,
    put_each,
    python_command,
    run_script,
    run_with_files,
)

METADATA_KEY = "tpufab-autostop"
SCRIPT = "autostop.py"
FACTS = "facts.py"
CONFIG_FILE = "~/.tpufab/autostop-arm-{token}.json"   # one per arm: two at once never share it


class AutostopError(TpufabError):
    """The watchdog could not be armed, cancelled or read on some workers."""


def script() -> RemoteFile:
    return RemoteFile.bundled(SCRIPT)


def facts_file() -> RemoteFile:
    return RemoteFile.bundled(FACTS)


# -- deciding (pure) --------------------------------------------------------------------------


def policy(*, idle: float | None, ttl: float | None, now: float) -> dict[str, Any]:
    """What the user asked for, as stored in node metadata."""
    out: dict[str, Any] = {"armed_at": round(now, 3)}
    if idle:
        out["idle"] = float(idle)
    if ttl:
        out["ttl_at"] = round(now + float(ttl), 3)
    return out


def worker_configs(pol: Mapping[str, Any], *, ips: Sequence[str], endpoint: str, project: str,
                   zone: str, node: str, queued_resource: str | None, port: int,
                   check_every: float, metadata_host: str | None = None) -> dict[int, dict]:
    """Each worker's watchdog config; worker 0 leads and knows every peer's address."""
    auth = "anonymous" if endpoint.startswith("http://") else "metadata"
    base = {**pol, "endpoint": endpoint, "project": project, "zone": zone, "node": node,
            "queued_resource": queued_resource, "port": port, "check_every": check_every,
            "auth": auth}
    if metadata_host:
        base["metadata_host"] = metadata_host
    out = {}
    for w, ip in enumerate(ips):
        config = {**base, "worker": w, "listen": ip}
        if w == 0:
            config["peers"] = list(ips)
        out[w] = config
    return out


def describe(pol: Mapping[str, Any] | None, *, fires_at: float | None = None) -> str:
    """``deletes it after 30m idle, or at 14:05 at the latest (TTL)``."""
    from tpufab.lifecycle import human_duration

    if not pol:
        return "off"
    parts = []
    if pol.get("idle"):
        parts.append(f"deletes the pod after {human_duration(pol['idle'])} idle")
    if pol.get("ttl_at"):
        at = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(pol["ttl_at"]))
        parts.append(f"{'or ' if parts else 'deletes the pod '}at {at} at the latest (TTL)")
    text = ", ".join(parts)
    if fires_at:
        text += f"; fires at {time.strftime('%H:%M:%S', time.localtime(fires_at))} if nothing " \
                "starts"
    return text


def list_cell(metadata: Mapping[str, str]) -> str:
    """The AUTOSTOP column of `tpufab list`, from node metadata."""
    from tpufab.lifecycle import human_duration

    raw = metadata.get(METADATA_KEY)
    if not raw:
        return "-"
    try:
        pol = json.loads(raw)
    except ValueError:
        return "?"
    parts = []
    if pol.get("idle"):
        parts.append(f"idle {human_duration(pol['idle'])}")
    if pol.get("ttl_at"):
        parts.append("at " + time.strftime("%m-%d %H:%M", time.localtime(pol["ttl_at"])))
    return ", ".join(parts) or "-"


# -- applying ----------------------------------------------------------------------------------


def _check(results: Mapping[int, Any], what: str) -> dict[int, dict]:
    from tpufab import nodeset
    from tpufab.jobs import failure_reason

    answers, failed = {}, {}
    for w, r in sorted(results.items()):
        data = (last_json(r.stdout) or {}) if r.error is None else {}
        if r.ok and "error" not in data:
            answers[w] = data
        else:
            failed[w] = data.get("error") or failure_reason(r)
    if failed:
        detail = "; ".join(f"{nodeset.label(w)}: {why}" for w, why in failed.items())
        raise AutostopError(f"Could not {what} on {nodeset.fold(failed)} ({detail}).")
    return answers


def _set_metadata(pod, settings, value: str | None, control=None) -> None:
    from tpufab import lifecycle

    control = lifecycle.control_plane(settings, control)
    for node in pod.nodes:
        current = control.get_node(node.name)
        metadata = dict(current.metadata)
        if value is None and METADATA_KEY not in metadata:
            continue
        if value is None:
            metadata.pop(METADATA_KEY)
        else:
            metadata[METADATA_KEY] = value
        op = control.update_metadata(node.name, metadata)
        deadline = time.monotonic() + settings.wait_timeout
        while not control.operation_done(op, "update", name=node.name):
            if time.monotonic() > deadline:
                raise AutostopError(f"Updating the metadata of {node.name} did not finish.")
            time.sleep(0.2)


def arm(pod, settings, *, idle: float | None = None, ttl: float | None = None,
        control=None) -> dict[str, Any]:
    """Start (or replace) the watchdog on every worker; returns the policy."""
    from tpufab.controlplane import DEFAULT_ENDPOINT

    pol = policy(idle=idle, ttl=ttl, now=time.time())
    node = pod.nodes[0]
    configs = worker_configs(pol, ips=pod.internal_ips(),
                             endpoint=settings.api_endpoint or DEFAULT_ENDPOINT,
                             project=settings.project, zone=settings.zone, node=node.name,
                             queued_resource=node.queued_resource,
                             port=settings.autostop_port, check_every=settings.autostop_check)
    workers = pod.workers
    contents = {w: json.dumps(configs[w]).encode() for w in workers}
    from tpufab.jobs import open_workers

    open_workers(pod.fanout, workers, "arm autostop")
    config_file = CONFIG_FILE.format(token=secrets.token_hex(6))
    puts = put_each(pod.fanout, contents, config_file, mode=0o600)
    _check(puts, "write the autostop config")
    line = python_command(script(), ["arm", "--config", config_file, "--facts",
                                     facts_file().path], needs=[facts_file()])
    _check(run_with_files(pod.fanout, [script(), facts_file()], line, workers),
           "start the autostop watchdog")
    _set_metadata(pod, settings, json.dumps(pol, sort_keys=True), control)
    return pol


def cancel(pod, settings, *, control=None) -> str | None:
    """Stop every watchdog; the description of what was armed, or None."""
    answers = _check(run_script(pod.fanout, SCRIPT, ["cancel"], pod.workers),
                     "cancel the autostop")
    _set_metadata(pod, settings, None, control)
    was = answers.get(pod.workers[0], {}).get("was")
    return describe(was) if was else None


def worker_state(pod) -> dict[str, Any]:
    """Worker 0's view: config, state (idle since, fires at, busy), recent events."""
    first = pod.workers[0]
    results = run_script(pod.fanout, SCRIPT, ["state"], [first])
    return _check(results, "read the autostop state")[first]


def status_lines(state: Mapping[str, Any]) -> list[str]:
    """What `tpufab status` prints about autostop."""
    config = state.get("config")
    events = state.get("events") or []
    lines = []
    if config:
        current = state.get("state") or {}
        fires = current.get("fires_at")
        text = f"Autostop: {describe(config, fires_at=fires if not current.get('busy') else None)}"
        if current.get("busy"):
            text += f"; busy now ({', '.join(current['busy'][:3])})"
        if not state.get("running"):
            text += "; the watchdog is NOT running (arm it again: `tpufab autostop`)"
        lines.append(text + ".")
    elif events:
        lines.append("Autostop: off.")
    for e in events[-5:]:
        when = time.strftime("%H:%M:%S", time.localtime(e.get("time", 0)))
        extra = {k: _shown(k, v) for k, v in e.items() if k not in ("event", "time", "host")
                 and v not in (None, [], "", False)}
        detail = ", ".join(f"{k}={v}" for k, v in sorted(extra.items()))
        lines.append(f"  {when} {e.get('event')}" + (f" ({detail})" if detail else ""))
    return lines


def _shown(key: str, value: Any) -> Any:
    """Event fields for people: times as clock times, the idle period as a duration."""
    from tpufab.lifecycle import human_duration

    if isinstance(value, int | float) and (key.endswith("_at") or key.endswith("since")):
        return time.strftime("%H:%M:%S", time.localtime(value))
    if key == "idle" and isinstance(value, int | float):
        return human_duration(value)
    if isinstance(value, list):
        return "; ".join(str(v) for v in value[:3])
    return value
