"""tpufab ray: Ray on one host of the pod (stdlib only; Ray itself runs in the job's Python).

    python3 ray_worker.py state
    python3 ray_worker.py start --config FILE [-- RAY START OPTIONS]
    python3 ray_worker.py stop [--grace S]
    python3 ray_worker.py cluster [--dashboard-port P]       (on the head: nodes and jobs)
    python3 ray_worker.py token                              (on the head: the cluster's token)

The job's Python is $TPUFAB_PYTHON, else ~/.venv/bin/python, else python3; Ray is installed
into it with pip when missing ($TPUFAB_RAY_SPEC, default ``ray[default]``: the Job API lives
in the dashboard). ``start`` reads its host's part of the cluster from FILE (written 0600 by
tpufab, one per host): {"head": bool, "address": "IP:PORT", "node_ip": IP, "port": P,
"dashboard_port": P, "token": T, "options": [...], "env": {TPU_NAME, TPU_WORKER_ID,
TPU_ACCELERATOR_TYPE, TPU_TOPOLOGY}} and runs ``ray start`` with that environment, so Ray's
TPU accelerator manager labels the node from tpufab's values.

Ray's own token authentication (Ray 2.52 and later) guards every listener Ray opens: the
token goes to ``~/.ray/auth_token`` (0600 in a 0700 directory: where Ray, and any ``ray``
command or ``ray.init()`` of the login user, finds it) and Ray starts with
``RAY_AUTH_MODE=token``; an older Ray starts without it and says so (``"auth": false``). The
node's session directory (Ray's logs, the jobs' output among them) is made 0700 once Ray is
up. Each command prints one JSON line last.
"""

import json
import os
import signal
import subprocess
import sys
import time

from tpufab.remote.workerlib import answer

RAY_MAIN = "import sys; from ray.scripts.scripts import main; sys.argv[0] = 'ray'; sys.exit(main())"
# What a Ray process looks like in /proc: its own binaries, its Python daemons, its workers.
RAY_BINARIES = ("raylet", "gcs_server", "plasma_store")
# (``ray.dashboard.``: the dashboard's multiprocessing forkserver, ``python -c from
# multiprocessing.forkserver import main; main(..., ['ray', 'ray.dashboard.subprocesses...'])``,
# which can outlive the dashboard a moment)
RAY_SCRIPTS = ("/ray/dashboard/", "/ray/_private/", "/ray/autoscaler/", "ray.util.client.server",
               "/ray/core/src/", "ray.dashboard.")
TOKEN_PATH = "~/.ray/auth_token"               # Ray's default place for its token
STARTED_PATH = "~/.cache/tpufab/ray/started.json"   # the options this host's Ray started with
RAY_TEMP = "/tmp/ray"                          # Ray's default temp directory (its sessions)
# Where Ray's token authentication lives (Ray 2.52 and later): its presence, not a version
AUTH_MODULE = os.path.join("_private", "authentication", "authentication_token_setup.py")


def python():
    for candidate in (os.environ.get("TPUFAB_PYTHON"), os.path.expanduser("~/.venv/bin/python")):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    return "python3"


def read(path, binary=False):
    try:
        with open(path, "rb") as fh:
            data = fh.read()
    except OSError:
        return b"" if binary else ""
    return data if binary else data.decode("utf-8", "replace")


def ray_kind(pid):
    """What kind of Ray process ``pid`` is ('raylet', 'gcs_server', 'worker', 'daemon',
    'driver'), or None."""
    comm = read(f"/proc/{pid}/comm").strip()
    argv = read(f"/proc/{pid}/cmdline", binary=True).split(b"\0")
    first = argv[0].decode("utf-8", "replace") if argv else ""
    if comm in RAY_BINARIES or os.path.basename(first) in RAY_BINARIES:
        return comm if comm in RAY_BINARIES else os.path.basename(first)
    if comm.startswith("ray::") or first.startswith("ray::"):
        return "worker"
    if comm.startswith("ray-dashboard") or first.startswith("ray-dashboard"):
        return "daemon"
    line = b" ".join(argv).decode("utf-8", "replace")
    if any(mark in line for mark in RAY_SCRIPTS):
        return "daemon"
    # a Ray job's entrypoint (the job supervisor sets this in its environment)
    if b"\0RAY_JOB_CONFIG_JSON_ENV_VAR=" in b"\0" + read(f"/proc/{pid}/environ", binary=True):
        return "driver"
    return None


def ray_processes():
    """{pid: (kind, cmdline)} of this user's Ray processes on this host."""
    me, found = os.getpid(), {}
    uid = os.getuid()
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == me:
            continue
        pid = int(name)
        try:
            if uid != 0 and os.stat(f"/proc/{pid}").st_uid != uid:
                continue
        except OSError:
            continue
        stat = read(f"/proc/{pid}/stat")
        if not stat or stat[stat.rfind(")") + 2:][:1] in ("Z", "X"):
            continue
        kind = ray_kind(pid)
        if kind:
            line = read(f"/proc/{pid}/cmdline", binary=True).replace(b"\0", b" ")
            found[pid] = (kind, line.decode("utf-8", "replace")[:200])
    return found


def option(line, name):
    """The value of ``--name=value`` (or ``--name value``) in a command line, else None."""
    words = line.split()
    for i, word in enumerate(words):
        if word.startswith(name + "="):
            return word.split("=", 1)[1]
        if word == name and i + 1 < len(words):
            return words[i + 1]
    return None


def environ_of(pid):
    """{NAME: value} of ``pid``'s environment (empty when unreadable)."""
    out = {}
    for item in read(f"/proc/{pid}/environ", binary=True).split(b"\0"):
        name, sep, value = item.partition(b"=")
        if sep:
            out[name.decode("utf-8", "replace")] = value.decode("utf-8", "replace")
    return out


def started_options():
    try:
        with open(os.path.expanduser(STARTED_PATH)) as fh:
            options = json.load(fh).get("options")
    except (OSError, ValueError, AttributeError):
        return None
    return [str(o) for o in options] if isinstance(options, list) else None


def state():
    procs = ray_processes()
    raylets = [(pid, line) for pid, (kind, line) in procs.items() if kind == "raylet"]
    heads = [pid for pid, (kind, _) in procs.items() if kind == "gcs_server"]
    gcs = None
    for pid in heads + [pid for pid, _ in raylets]:
        gcs = option(read(f"/proc/{pid}/cmdline", binary=True).replace(b"\0", b" ").decode(
            "utf-8", "replace"), "--gcs-address") or gcs
    daemons = heads + [pid for pid, _ in raylets]
    auth = bool(daemons) and all(environ_of(pid).get("RAY_AUTH_MODE") == "token"
                                 for pid in daemons)
    return {"raylet": raylets[0][0] if raylets else None, "head": bool(heads),
            "gcs_address": gcs, "node_ip": (option(raylets[0][1], "--node_ip_address")
                                          or option(raylets[0][1], "--node-ip-address"))
            if raylets else None, "processes": len(procs),
            "kinds": sorted({kind for kind, _ in procs.values()}), "auth": auth,
            "auth_supported": has_token_auth(python()) if daemons and not auth else auth,
            "options": started_options() if daemons else None}


def ensure_ray(py):
    """Ray importable by ``py``: (version, None), installing it with pip when missing;
    (None, why) when it cannot be."""
    probe = subprocess.run([py, "-c", "import ray; print(ray.__version__)"],
                           capture_output=True, text=True)
    if probe.returncode == 0:
        return probe.stdout.strip(), None
    spec = os.environ.get("TPUFAB_RAY_SPEC") or "ray[default]"
    pip = subprocess.run([py, "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
                          spec], capture_output=True, text=True)
    if pip.returncode != 0:
        tail = (pip.stderr or pip.stdout).strip().splitlines()
        return None, (f"Ray is not installed for {py} and `pip install {spec}` failed there "
                      f"({tail[-1] if tail else f'exit {pip.returncode}'})")
    probe = subprocess.run([py, "-c", "import ray; print(ray.__version__)"],
                           capture_output=True, text=True)
    if probe.returncode != 0:
        return None, f"{py} still cannot import ray after `pip install {spec}`"
    return probe.stdout.strip(), None


def ray_cli(py, args, env=None, timeout=300):
    return subprocess.run([py, "-c", RAY_MAIN, *args], capture_output=True, text=True,
                          env=env, timeout=timeout, stdin=subprocess.DEVNULL)


START_TIMEOUT = 240   # seconds for one `ray start`


def why_failed(text, code):
    """The lines of Ray's output that say why (not its INFO chatter), shortened."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    marks = ("rror", "xception", "imed out", "ailed", "annot", "not ")
    said = [ln for ln in lines if any(m in ln for m in marks) and " INFO " not in ln]
    picked = said[-2:] or lines[-2:]
    return " / ".join(ln[:240] for ln in picked) or f"exit {code}"


def has_token_auth(py):
    """This Python's Ray has token authentication (its module is there; Ray is not
    imported)."""
    probe = subprocess.run([py, "-c", "import importlib.util as u, sys; s = "
                            "u.find_spec('ray'); sys.stdout.write(list("
                            "s.submodule_search_locations)[0] if s else '')"],
                           capture_output=True, text=True)
    where = probe.stdout.strip()
    return bool(where) and os.path.isfile(os.path.join(where, AUTH_MODULE))


def private_file(path, data):
    """``data`` at ``path`` (~ expanded), 0600 in a 0700 directory, replaced atomically."""
    path = os.path.expanduser(path)
    folder = os.path.dirname(path)
    os.makedirs(folder, mode=0o700, exist_ok=True)
    os.chmod(folder, 0o700)
    temp = f"{path}.{os.getpid()}.tmp"
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(data)
    os.replace(temp, path)


def private_session():
    """Ray's session directory on this host made 0700 (Ray creates it 0777: its logs hold
    every job's output); None, or why it could not be."""
    latest = os.path.join(RAY_TEMP, "session_latest")
    try:
        session = os.path.realpath(latest)
        info = os.lstat(session)
        if info.st_uid != os.getuid():
            return f"{session} belongs to uid {info.st_uid}, not this user"
        os.chmod(session, 0o700)
    except OSError as err:
        return f"{latest}: {err.strerror}"
    return None


AGENT_PORT_FLAG = "--dashboard-agent-listen-port"


def agent_port(node_ip, extra):
    """The dashboard agent's HTTP port for this host, or None for Ray's own (52365).

    Ray's agent binds its port on the node's address and on 127.0.0.1. Hosts whose
    addresses are loopback ones (127.A.B.C: the simulated pod, where every worker shares one
    network namespace) share that 127.0.0.1, so with one port for all of them only the first
    agent gets an HTTP server and a job sent to another fails; each gets a port of its own,
    from its address (Ray publishes every node's agent port to the head). A TPU VM's
    address is never loopback, and a port the user passes is theirs."""
    if any(a == AGENT_PORT_FLAG or a.startswith(AGENT_PORT_FLAG + "=") for a in extra):
        return None
    parts = node_ip.split(".")
    if len(parts) != 4 or parts[0] != "127" or not all(x.isdigit() for x in parts):
        return None
    return 40000 + (int(parts[2]) % 64) * 256 + int(parts[3])


def start(config_path, extra):
    with open(os.path.expanduser(config_path)) as fh:
        config = json.load(fh)
    os.unlink(os.path.expanduser(config_path))
    py = python()
    env = dict(os.environ)
    env.update({k: str(v) for k, v in config["env"].items()})
    env["RAY_USAGE_STATS_ENABLED"] = "0"
    auth = bool(config.get("token")) and has_token_auth(py)
    if auth:   # every listener of this node wants the token; the login user's Ray finds it
        private_file(TOKEN_PATH, config["token"])
        env["RAY_AUTH_MODE"] = "token"
        env.pop("RAY_AUTH_TOKEN", None)
        env.pop("RAY_AUTH_TOKEN_PATH", None)
    else:
        env["RAY_AUTH_MODE"] = "disabled"
    args = ["start", f"--node-ip-address={config['node_ip']}", "--disable-usage-stats"]
    if config["head"]:
        args += ["--head", f"--port={config['port']}", "--include-dashboard=true",
                 "--dashboard-host=127.0.0.1", f"--dashboard-port={config['dashboard_port']}"]
    else:
        args += [f"--address={config['address']}"]
    port = agent_port(config["node_ip"], extra)
    if port is not None:
        args.append(f"{AGENT_PORT_FLAG}={port}")
    started = time.monotonic()
    try:
        done = ray_cli(py, args + list(extra), env=env, timeout=START_TIMEOUT)
        if done.returncode != 0 and "No module named 'ray'" in done.stderr:
            _version, why = ensure_ray(py)     # Ray is missing: install it, once, then again
            if why:
                return {"error": why}
            done = ray_cli(py, args + list(extra), env=env, timeout=START_TIMEOUT)
    except subprocess.TimeoutExpired:
        return {"error": f"ray start did not finish in {START_TIMEOUT} s"}
    if done.returncode != 0:
        return {"error": "ray start failed: " + why_failed(done.stderr + "\n" + done.stdout,
                                                          done.returncode)}
    private_file(STARTED_PATH, json.dumps({"options": list(extra)}))
    session = private_session()
    return {"started": True, "seconds": round(time.monotonic() - started, 2),
            **state(), "auth": auth, "session_private": session is None,
            "session_error": session}


def stop(grace):
    """``ray stop`` (SIGTERM, Ray's own), then ``ray stop --force``, then SIGKILL what is left;
    until no Ray process is left on this host (bounded)."""
    before = ray_processes()
    if not before:
        return {"stopped": 0, "left": [], "forced": False}
    py = python()
    forced = False
    try:
        ray_cli(py, ["stop", f"--grace-period={int(grace)}"], timeout=grace + 60)
    except (OSError, subprocess.TimeoutExpired):
        pass
    left = wait_gone(grace)
    if left:
        forced = True
        try:
            ray_cli(py, ["stop", "--force"], timeout=60)
        except (OSError, subprocess.TimeoutExpired):
            pass
        left = wait_gone(5.0)
    for pid in left:
        forced = True
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    left = wait_gone(5.0)
    return {"stopped": len(before) - len(left), "forced": forced,
            "left": [f"{pid} {kind}" for pid, (kind, _) in left.items()]}


def wait_gone(seconds):
    deadline = time.monotonic() + seconds
    while True:
        left = ray_processes()
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(0.2)


def cluster(port):
    """On the head: the nodes (alive, address, resources, labels) and the jobs, from the
    dashboard's HTTP API on 127.0.0.1."""
    import urllib.request

    token = read(os.path.expanduser(TOKEN_PATH)).strip()

    def get(path):
        request = urllib.request.Request(f"http://127.0.0.1:{port}{path}")
        if token:
            request.add_header("Authorization", f"Bearer {token}")
        with urllib.request.urlopen(request, timeout=20) as resp:
            return json.loads(resp.read().decode())

    try:
        nodes = get("/api/v0/nodes?limit=10000&detail=1")
        jobs = get("/api/jobs/")
    except (OSError, ValueError) as err:
        return {"error": f"the Ray dashboard on 127.0.0.1:{port} did not answer ({err})"}
    rows = []
    for node in (nodes.get("data") or {}).get("result", {}).get("result", []):
        rows.append({"ip": node.get("node_ip"), "state": node.get("state"),
                     "head": bool(node.get("is_head_node")),
                     "resources": node.get("resources_total") or {},
                     "labels": node.get("labels") or {}})
    return {"nodes": rows, "jobs": [
        {"id": j.get("submission_id") or j.get("job_id"), "status": j.get("status"),
         "entrypoint": (j.get("entrypoint") or "")[:200], "start_time": j.get("start_time")}
        for j in jobs if isinstance(j, dict)]}


def main(argv):
    extra = []
    if "--" in argv:
        at = argv.index("--")
        argv, extra = argv[:at], argv[at + 1:]
    if not argv:
        answer("answer", {"error": "ray_worker.py: no command"})
        return 2
    command, rest = argv[0], argv[1:]
    if command == "state":
        reply = state()
    elif command == "start":
        reply = start(rest[rest.index("--config") + 1], extra)
    elif command == "stop":
        grace = float(rest[rest.index("--grace") + 1]) if "--grace" in rest else 10.0
        reply = stop(grace)
    elif command == "token":
        token = read(os.path.expanduser(TOKEN_PATH)).strip()
        reply = {"token": token} if token else {"token": None}
    elif command == "cluster":
        port = int(rest[rest.index("--dashboard-port") + 1]) if "--dashboard-port" in rest \
            else 8265
        reply = cluster(port)
    else:
        reply = {"error": f"ray_worker.py: unknown command {command}"}
    answer("answer", reply)
    return 1 if reply.get("error") else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
