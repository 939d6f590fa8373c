#!/usr/bin/env python3
"""tpufab autostop, worker side (stdlib only, Python 3.6+): delete the pod when it idles.

    autostop_worker.py arm --config FILE --facts PATH   start (or replace) this worker's watchdog
                 [--check-only]                  only check the config and the port
    autostop_worker.py cancel                           stop it and forget the config
    autostop_worker.py state                            the config, the leader's view, recent events
    autostop_worker.py daemon                           the watchdog itself (started by arm)

Every worker runs a watchdog. It answers, on its own internal address and the config's
port, one JSON line saying whether this worker is busy (a tpufab run running or starting,
or a process holding a TPU device file; both read by tpufab's ``facts_worker.py``). The leader
(worker 0) also asks every peer, every ``check_every`` seconds; a peer that does not answer
counts as busy. Once nothing was busy for ``idle`` seconds, or at ``ttl_at``, the leader
deletes the node (or its queued resource) through the TPU API: anonymously for a plain
``http://`` endpoint (as tpufab's own client does: the simulated pod), else as the VM's
service account, with a token from the metadata server. Each decision is appended to
``~/.tpufab/autostop/events.jsonl``; ``state.json`` holds when it will fire.

The config holds no secrets. Everything prints one JSON line and exits 0 unless the usage is
wrong.
"""

import argparse
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

from tpufab.remote.workerlib import (
    DEVICE_GLOBS,
    alive,
    answer,
    expand_globs,
    proc_stat,
    read_json,
    tpufab_sessions,
    write_atomic,
)

BASE = "~/.tpufab/autostop"
DROPPED_ENV = ("TPUFAB_TASK",)   # the fan-out agent's marker: the watchdog outlives the command
METADATA_HOST = "metadata.google.internal"
TOKEN_PATH = "/computeMetadata/v1/instance/service-accounts/default/token"


def path(name):
    return os.path.join(os.path.expanduser(BASE), name)


def log_event(event, **fields):
    fields.update(event=event, time=time.time(), host=socket.gethostname())
    os.makedirs(os.path.dirname(path("events.jsonl")), exist_ok=True)
    with open(path("events.jsonl"), "a") as fh:
        fh.write(json.dumps(fields, sort_keys=True) + "\n")


def recent_events(limit=10):
    try:
        with open(path("events.jsonl")) as fh:
            lines = fh.readlines()[-limit:]
    except OSError:
        return []
    out = []
    for line in lines:
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


# -- the watchdog's process ------------------------------------------------------------------


def recorded_daemon():
    """(pid, start time) of the watchdog pid.json names, or (None, None)."""
    info = read_json(path("pid.json")) or {}
    return info.get("pid"), info.get("start_time")


def running_daemon():
    """(pid) of this worker's live watchdog, verified by its start time; else None."""
    pid, start = recorded_daemon()
    if isinstance(pid, int) and start is not None and alive(pid, start):
        return pid
    return None


def stop_daemon(timeout=5.0):
    pid = running_daemon()
    if pid is None:
        return False
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return True
    deadline = time.monotonic() + timeout
    start = recorded_daemon()[1]
    while time.monotonic() < deadline and alive(pid, start):
        time.sleep(0.05)
    if alive(pid, start):
        os.kill(pid, signal.SIGKILL)
    return True


def one_at_a_time(step, args):
    """Two tpufabs arming (or cancelling) at once take turns: each stop-then-start of the
    watchdog is whole, so one watchdog runs and the last arm is what it enforces."""
    import fcntl

    os.makedirs(os.path.expanduser(BASE), mode=0o700, exist_ok=True)
    with open(path("arm.lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return step(args)


def config_problem(config):
    """Why this config cannot run a watchdog (one sentence), or None: checked before the
    running watchdog is touched."""
    try:
        port = int(config.get("port"))
    except (TypeError, ValueError):
        return "the autostop port {!r} is not a number".format(config.get("port"))
    if not 1 <= port <= 65535:
        return f"the autostop port must be between 1 and 65535, not {port}"
    for key in ("check_every", "idle", "ttl"):
        value = config.get(key)
        if value is None and key != "check_every":
            continue
        try:
            ok = float(value) > 0
        except (TypeError, ValueError):
            ok = False
        if not ok:
            return f"autostop's {key} must be a number of seconds above 0, not {value!r}"
    if not config.get("idle") and not config.get("ttl"):
        return "autostop needs an idle period or a TTL"
    return None


def port_problem(config, old):
    """Why the watchdog could not listen on the config's address and port (a test bind),
    unless the running watchdog ``old`` holds that very address already."""
    address = (config.get("listen") or "0.0.0.0", int(config["port"]))
    if old and (old.get("listen") or "0.0.0.0", int(old.get("port") or 0)) == address:
        return None
    probe = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        probe.bind(address)
        probe.listen(1)
    except OSError as err:
        return f"the watchdog cannot listen on {address[0]}:{address[1]} ({err.strerror or err})"
    finally:
        probe.close()
    return None


def start_daemon():
    """Start the watchdog on config.json; (pid, None) once it runs, or (None, why)."""
    env = {k: v for k, v in os.environ.items() if k not in DROPPED_ENV}
    with open(os.devnull, "rb") as devnull, open(path("daemon.log"), "ab") as log:
        # as checked as this run was (the verifying loader's argv), else this file
        again = globals().get("__tpufab_rerun__") or [sys.executable, "-I", "-S",
                                                      os.path.abspath(__file__)]
        child = subprocess.Popen([*again, "daemon"], stdin=devnull, stdout=log, stderr=log, env=env,
                                 cwd=os.path.expanduser("~"), start_new_session=True,
                                 close_fds=True)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if running_daemon() == child.pid:
            return child.pid, None
        if child.poll() is not None:
            return None, "the watchdog exited at once (see {})".format(path("daemon.log"))
        time.sleep(0.02)
    child.kill()
    return None, "the watchdog did not start within 10 s"


def arm(args):
    with open(os.path.expanduser(args.config)) as fh:
        config = json.load(fh)
    if not args.check_only:
        os.remove(os.path.expanduser(args.config))
    config["facts"] = os.path.expanduser(args.facts)
    os.makedirs(os.path.expanduser(BASE), mode=0o700, exist_ok=True)
    old = read_json(path("config.json")) if running_daemon() is not None else None
    problem = config_problem(config) or port_problem(config, old)
    if problem:   # the running watchdog, if any, is left as it was
        kept = "; the watchdog already running is kept" if old else ""
        return {"error": problem + kept}
    if args.check_only:   # the first of two rounds: every worker says yes before any changes
        return {"ok": True}
    # Deadlines on this worker's clock: the client sends durations, never its own time.
    now = time.time()
    config["armed_at"] = round(now, 3)
    if config.get("ttl"):
        config["ttl_at"] = round(now + float(config["ttl"]), 3)
    replaced = stop_daemon()
    write_atomic(path("config.json"), json.dumps(config, sort_keys=True), mode=0o600)
    try:
        os.remove(path("state.json"))
    except OSError:
        pass
    pid, why = start_daemon()
    if pid is None:
        if old is not None:   # put the one that ran back
            write_atomic(path("config.json"), json.dumps(old, sort_keys=True), mode=0o600)
            back, _ = start_daemon()
            why += "; the previous watchdog runs again" if back else \
                "; the previous watchdog could not be started again either"
        return {"error": why}
    if config.get("worker") == 0:
        log_event("armed", idle=config.get("idle"), ttl_at=config.get("ttl_at"),
                  replaced=replaced)
    return {"armed": True, "pid": pid, "replaced": replaced, "armed_at": config["armed_at"],
            "ttl_at": config.get("ttl_at"), "now": time.time()}


def cancel(_args):
    was = read_json(path("config.json"))
    stopped = stop_daemon()
    for name in ("config.json", "state.json"):
        try:
            os.remove(path(name))
        except OSError:
            pass
    if was is not None and was.get("worker") == 0:
        log_event("cancelled")
    return {"cancelled": was is not None or stopped, "was": was}


def state(_args):
    return {"config": read_json(path("config.json")), "state": read_json(path("state.json")),
            "running": running_daemon() is not None, "events": recent_events()}


# -- what is busy ------------------------------------------------------------------------------


def load_facts(facts_path):
    spec = importlib.util.spec_from_file_location("tpufab_facts", facts_path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def local_activity(facts):
    """Reasons this worker is busy (empty: idle)."""
    reasons = []
    live, _ = facts.runs("~/.tpufab/runs", 0)
    for run in live:
        reasons.append("run {} {}".format(run["run"], run["state"]))
    holders, _ = facts.device_holders(expand_globs(DEVICE_GLOBS))
    pids = sorted({h["pid"] for found in holders.values() for h in found})
    if pids:
        reasons.append("TPU held by pid {}".format(",".join(str(p) for p in pids[:5])))
    sessions = {}
    for pid, what in tpufab_sessions():
        sessions.setdefault(what, []).append(pid)
    for what, found in sorted(sessions.items()):
        reasons.append("{} (pid {})".format(what, ",".join(str(p) for p in found[:5])))
    return reasons


def answer_peer(conn, config, busy):
    """One peer's question on ``conn``: the pod's peer token first (a line), else no answer
    (a co-tenant reaching the port learns nothing of the pod's jobs)."""
    import hmac

    conn.settimeout(1.0)
    line = b""
    try:
        while not line.endswith(b"\n") and len(line) < 256:
            chunk = conn.recv(256)
            if not chunk:
                break
            line += chunk
    except OSError:
        return False
    expected = str(config.get("peer_token") or "").encode()
    if not expected or not hmac.compare_digest(line.strip(), expected):
        return False
    try:
        conn.sendall((json.dumps({"busy": busy()}) + "\n").encode())
    except OSError:
        return False
    return True


def ask_peer(ip, port, timeout, peer_token=""):
    with socket.create_connection((ip, port), timeout=timeout) as conn:
        conn.settimeout(timeout)
        conn.sendall(f"{peer_token}\n".encode())
        data = b""
        while not data.endswith(b"\n"):
            chunk = conn.recv(4096)
            if not chunk:
                break
            data += chunk
    return json.loads(data.decode() or "{}")


# -- deleting through the TPU API ----------------------------------------------------------------


def token(config):
    host = config.get("metadata_host") or os.environ.get("GCE_METADATA_HOST") or METADATA_HOST
    request = urllib.request.Request(f"http://{host}{TOKEN_PATH}",
                                     headers={"Metadata-Flavor": "Google"})
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(request, timeout=10) as response:
        return json.loads(response.read().decode())["access_token"]


FIRED_LABEL = "tpufab-autostop-fired"   # <unix time>-<idle|ttl> (tpufab.steps.host.autostop reads it)
DELETABLE = ("READY", "STOPPED", "PREEMPTED", "TERMINATED", "REPAIRING", "RESTARTING")


def api_parent(config):
    return "{}/v2/projects/{}/locations/{}".format(config["endpoint"].rstrip("/"),
                                                   config["project"], config["zone"])


def delete_request(config):
    """(method, url) that deletes the pod: its queued resource if it has one."""
    parent = api_parent(config)
    if config.get("queued_resource"):
        return "DELETE", "{}/queuedResources/{}?force=true".format(parent, config["queued_resource"])
    return "DELETE", "{}/nodes/{}".format(parent, config["node"])


def api_call(config, method, url, body=None):
    """One TPU API request: (HTTP status, JSON body); HTTP errors are answers, not raised."""
    headers = {"Content-Type": "application/json"}
    if config.get("auth") == "metadata":
        headers["Authorization"] = "Bearer " + token(config)
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, method=method, headers=headers)
    handlers = [urllib.request.ProxyHandler({})] if url.startswith("http://") else []
    opener = urllib.request.build_opener(*handlers)
    try:
        with opener.open(request, timeout=30) as response:
            return response.status, json.loads(response.read().decode() or "{}")
    except urllib.error.HTTPError as err:
        detail = err.read().decode(errors="replace")[:300]
        try:
            return err.code, json.loads(detail)
        except ValueError:
            return err.code, {"error": {"message": detail}}


def recheck(config):
    """Re-read the node just before deleting it: (node, None) when it is still the one this
    watchdog guards in a deletable state, else (None, why it is left alone)."""
    status, node = api_call(config, "GET", "{}/nodes/{}".format(api_parent(config),
                                                                   config["node"]))
    if status == 404:
        return None, "node {} is already gone".format(config["node"])
    if status != 200:
        raise OSError("could not read node {} (HTTP {})".format(config["node"], status))
    if config.get("node_id") and str(node.get("id")) != str(config["node_id"]):
        return None, "node {} is now id {}, not the one this watchdog guards (id {})".format(
            config["node"], node.get("id"), config["node_id"])
    if node.get("state") not in DELETABLE:
        return None, "node {} is {}".format(config["node"], node.get("state"))
    return node, None


def mark_fired(config, node, now, why):
    """Label the node with this decision just before deleting it (``FIRED_LABEL``): the update
    operation the API keeps holds the node with that label, which is how a client later tells
    that autostop deleted it, and when. Best effort: the delete goes ahead without it."""
    labels = dict(node.get("labels") or {})
    labels[FIRED_LABEL] = f"{int(now)}-{why}"
    url = "{}/nodes/{}?updateMask=labels".format(api_parent(config), config["node"])
    status, answer = api_call(config, "PATCH", url, {"labels": labels})
    return status == 200, answer.get("name") if isinstance(answer, dict) else None


# -- a pod deleted by one URL (config "target_url", its control plane's: a MIG, a VM) ---------

def url_recheck(config):
    status, found = api_call(config, "GET", config["target_url"])
    if status == 404:
        return None, "{} is already gone".format(config["node"])
    if status != 200:
        raise OSError("could not read {} (HTTP {})".format(config["node"], status))
    if config.get("node_id") and str(found.get("id")) != str(config["node_id"]):
        return None, "{} is now id {}, not the one this watchdog guards (id {})".format(
            config["node"], found.get("id"), config["node_id"])
    if found.get("status") in ("PROVISIONING", "STAGING"):
        return None, "{} is {}".format(config["node"], found.get("status"))
    return found, None


def url_delete(config, now, why):
    found, skipped = url_recheck(config)
    if found is None:
        return {"ok": False, "skipped": skipped}
    status, op = api_call(config, "DELETE", config["target_url"])
    if status != 200:
        message = (op.get("error") or {}).get("message") if isinstance(op, dict) else ""
        return {"ok": False, "error": f"HTTP {status}: {message}"}
    # what tpufab made beside it stays (a MIG's template and workload policy: in use until
    # the MIG is gone, and this VM goes with it): `tpufab gc` and the next create remove them
    return {"ok": True, "operation": op.get("name"), "node_id": found.get("id"),
            "state": found.get("status") or "RUNNING", "labelled": False}


def delete_pod(config, now=None, why="idle"):
    now = time.time() if now is None else now
    if config.get("target_url"):
        try:
            return url_delete(config, now, why)
        except (OSError, ValueError, KeyError) as err:
            return {"ok": False, "error": f"{type(err).__name__}: {err}"}
    try:
        node, skipped = recheck(config)
        if node is None:
            return {"ok": False, "skipped": skipped}
        labelled, _ = mark_fired(config, node, now, why)
        method, url = delete_request(config)
        status, body = api_call(config, method, url)
        if status != 200:
            message = (body.get("error") or {}).get("message") if isinstance(body, dict) else ""
            return {"ok": False, "error": f"HTTP {status}: {message}"}
        return {"ok": True, "operation": body.get("name"), "node_id": node.get("id"),
                "state": node.get("state"), "labelled": labelled}
    except (OSError, ValueError, KeyError) as err:
        return {"ok": False, "error": f"{type(err).__name__}: {err}"}


# -- the loop ----------------------------------------------------------------------------------


def decide(config, now, idle_since):
    """(reason to fire or None, when it will fire or None) (pure)."""
    ttl_at = config.get("ttl_at")
    idle = config.get("idle")
    fires = []
    if ttl_at:
        fires.append((ttl_at, "ttl"))
    if idle and idle_since is not None:
        fires.append((idle_since + idle, "idle"))
    if not fires:
        return None, None
    at, why = min(fires)
    return (why if now >= at else None), at


def daemon(_args):
    config = read_json(path("config.json"))
    if config is None:
        return {"error": "no config"}
    write_atomic(path("pid.json"), json.dumps({"pid": os.getpid(),
                                               "start_time": proc_stat(os.getpid()).start_time}),
                 mode=0o600)
    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(1))
    facts = load_facts(config["facts"])
    every = float(config.get("check_every", 30))
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind((config.get("listen") or "0.0.0.0", int(config["port"])))
    listener.listen(64)
    listener.settimeout(0.2)
    leader = config.get("worker") == 0
    idle_since = time.time()
    was_busy = None
    last_check = time.monotonic()   # the first check one period in: peers are listening by then
    fired_at = None
    while not stopping:
        try:
            conn, _ = listener.accept()
        except OSError:   # the 0.2 s accept timeout (socket.timeout is an OSError everywhere)
            conn = None
        if conn is not None:
            with conn:
                answer_peer(conn, config, lambda: local_activity(facts))
        if not leader or time.monotonic() - last_check < every:
            continue
        last_check = time.monotonic()
        now = time.time()
        busy = ["w0: " + r for r in local_activity(facts)]
        for index, ip in enumerate(config.get("peers") or []):
            if index == 0:
                continue
            try:
                answer = ask_peer(ip, int(config["port"]), min(5.0, every),
                                  config.get("peer_token") or "")
                busy += [f"w{index}: {r}" for r in answer.get("busy") or []]
            except (OSError, ValueError) as err:
                busy.append(f"w{index}: no answer ({type(err).__name__})")
        if busy:
            idle_since = None
        elif idle_since is None:
            idle_since = now
        if bool(busy) != was_busy:
            log_event("busy" if busy else "idle", reasons=busy[:10])
            was_busy = bool(busy)
        why, fires_at = decide(config, now, idle_since)
        write_atomic(path("state.json"), json.dumps({
            "checked_at": now, "busy": busy[:10], "idle_since": idle_since,
            "fires_at": fires_at, "fired_at": fired_at}), mode=0o600)
        if why is None or (fired_at is not None and now - fired_at < 60):
            continue
        fired_at = now
        log_event("firing", reason=why, idle_since=idle_since, ttl_at=config.get("ttl_at"))
        result = delete_pod(config, now, why)
        if result.get("skipped"):   # a node recreated under the name is not ours to delete
            log_event("not deleted", **result)
            break
        log_event("deleted" if result["ok"] else "delete failed", **result)
    listener.close()
    return {"stopped": True}


def main(argv=None):
    parser = argparse.ArgumentParser(prog="autostop_worker.py")
    sub = parser.add_subparsers(dest="verb")
    sub.required = True   # (the keyword needs Python 3.7)
    p = sub.add_parser("arm")
    p.add_argument("--config", required=True)
    p.add_argument("--facts", required=True)
    p.add_argument("--check-only", action="store_true")
    sub.add_parser("cancel")
    sub.add_parser("state")
    sub.add_parser("daemon")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    verbs = {"arm": arm, "cancel": cancel, "state": state, "daemon": daemon}
    try:
        if args.verb in ("arm", "cancel"):
            out = one_at_a_time(verbs[args.verb], args)
        else:
            out = verbs[args.verb](args)
    except (OSError, ValueError, KeyError) as err:
        out = {"error": f"{type(err).__name__}: {err}"}
    answer("answer", out)
    return 1 if "error" in out else 0


if __name__ == "__main__":
    sys.exit(main())
