"""Ray on the pod (`tpufab ray up | status | submit | down`): one Ray cluster over every host.

tpufab starts Ray and keeps it; Ray schedules. The head runs on worker 0 of slice 0, every
other host joins it through one fan-out, each host with the TPU environment Ray's TPU
accelerator manager reads (``TPU_NAME``: the slice's node name, ``TPU_WORKER_ID``: the
host's index in its slice, ``TPU_ACCELERATOR_TYPE``, ``TPU_TOPOLOGY``), so every node carries
its slice's labels and worker 0 of each slice the ``TPU-<type>-head`` resource; the chips Ray
counts from the host's own device files. Every Ray address is the host's internal IP;
the dashboard (and with it the Job API) listens on 127.0.0.1 of the head only, reached
through an SSH forward. Every listener Ray opens wants the cluster's token (Ray's own token
authentication, Ray 2.52+): ``up`` makes one per cluster and gives it to each host in its
0600 start file. The worker side is remote/ray_worker.py. See docs/ray.md ("Who can reach
Ray").
"""

from __future__ import annotations

import json
import secrets
import shlex
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

from tpufab import nodeset
from tpufab.config import timeout_for
from tpufab.errors import ConfigError, TpufabError
from tpufab.reports import Report

GCS_PORT = 6379          # the head's GCS (Ray's default)
DASHBOARD_PORT = 8265    # the dashboard and Job API, on the head's 127.0.0.1 only
CONFIG_PATH = ".cache/tpufab/ray/start.json"   # each host's part, 0600, read and removed
SCRIPT = "ray_worker.py"
TERMINAL = ("SUCCEEDED", "FAILED", "STOPPED")

Progress = Callable[..., None]


class RayError(TpufabError):
    """Ray could not be started, reached or stopped (the sentence says where and why)."""


def silent(text: str, style: str | None = None) -> None:
    pass


@dataclass(frozen=True)
class Host:
    """One host of the pod as Ray sees it."""

    worker: int             # tpufab's global worker index
    ip: str                 # its internal IP: Ray's node address
    slice_name: str         # the slice's node name: TPU_NAME, Ray's ray.io/tpu-slice-name
    slice_worker: int       # its index in the slice: TPU_WORKER_ID
    accelerator_type: str   # e.g. v4-16: TPU_ACCELERATOR_TYPE
    topology: str           # e.g. 2x2x2: TPU_TOPOLOGY
    chips: int              # chips per host, what Ray should count

    def env(self) -> dict[str, str]:
        return {"TPU_NAME": self.slice_name, "TPU_WORKER_ID": str(self.slice_worker),
                "TPU_ACCELERATOR_TYPE": self.accelerator_type, "TPU_TOPOLOGY": self.topology}


def hosts(pod) -> list[Host]:
    """Every host of ``pod`` (a tpufab.Pod), slice by slice."""
    from tpufab.topology import default_dims, format_dims

    ips = pod.internal_ips()
    out = []
    for index, workers in enumerate(pod.slices):
        node = pod.nodes[index] if index < len(pod.nodes) else pod.nodes[0]
        topo = node.topology
        text = node.chip_topology or (format_dims(default_dims(topo)) if topo else "")
        for position, w in enumerate(workers):
            out.append(Host(worker=w, ip=ips[w], slice_name=node.name, slice_worker=position,
                            accelerator_type=node.accelerator_type, topology=text,
                            chips=topo.chips_per_host if topo else 0))
    return out


def _run(pod, args: Sequence, workers: Sequence[int], timeout: float) -> dict[int, dict]:
    """remote/ray_worker.py ``args`` on ``workers``: {worker: its JSON answer}; a worker that did
    not answer gets {"error": why}."""
    from tpufab.ssh.remote_files import read_answer, run_script
    from tpufab.steps.runs.running import failure_reason

    results = run_script(pod.fanout, SCRIPT, list(args), list(workers), timeout=timeout)
    out = {}
    for w, r in results.items():
        answer = read_answer(r.stdout) if getattr(r, "stdout", None) is not None else None
        out[w] = answer if answer is not None else {"error": failure_reason(r)}
    return out


def _fail(what: str, errors: dict[int, str], fix: str) -> RayError:
    by_reason: dict[str, list[int]] = {}
    for w, why in errors.items():
        by_reason.setdefault(str(why).rstrip("."), []).append(w)
    parts = "; ".join(f"{nodeset.fold(ws)}: {why}" for why, ws in by_reason.items())
    return RayError(f"{what} on {nodeset.fold(errors)} ({parts}); {fix}")


# -- up -------------------------------------------------------------------------------------


@dataclass
class RayUp:
    address: str                       # the head's GCS, IP:PORT
    head: int                          # the head's worker
    hosts: int
    started: list[int] = field(default_factory=list)    # hosts Ray was started on now
    already: bool = False              # Ray was up everywhere: nothing done
    seconds: float = 0.0
    nodes: list[dict] = field(default_factory=list)     # the head's view afterwards
    open_hosts: list[int] = field(default_factory=list)  # Ray without token auth (too old)

    @property
    def dashboard_port(self) -> int:
        """Where the head's dashboard (and Job API) listens, on its loopback."""
        return DASHBOARD_PORT


def join_batches(head: int, to_start: Sequence[int], *, head_up: bool,
                 size: int = 0) -> list[list[int]]:
    """The order ``up`` starts Ray in (pure): the head alone first (unless it is up), then the
    other hosts ``size`` at a time (0: all at once)."""
    others = [w for w in to_start if w != head]
    size = size or len(others) or 1
    return ([[head]] if not head_up else []) + \
        [others[i:i + size] for i in range(0, len(others), size)]


def up(pod, *, extra: Sequence[str] = (), timeout: float | None = None,
       progress: Progress = silent, join_batch: int = 0) -> RayUp:
    """Start Ray where it is not running: the head on worker 0 of slice 0 (unless it is up),
    then every host not joined to it, in one fan-out (``join_batch`` > 0: that many hosts at
    a time, each batch seen by the head before the next starts). ``extra``: more ``ray
    start`` options for every host (e.g. ``--num-cpus=1``)."""
    if join_batch < 0:
        raise ConfigError(f"--join-batch takes a number of hosts, 1 or more (0: all at once), "
                          f"not {join_batch}.")
    from tpufab.ssh.remote_files import put_each

    timeout = timeout_for("ray up", timeout)
    began = time.monotonic()
    every = hosts(pod)
    by_worker = {h.worker: h for h in every}
    head = every[0]
    address = f"{head.ip}:{GCS_PORT}"
    states = _run(pod, ["state"], list(by_worker), timeout)
    errors = {w: s["error"] for w, s in states.items() if s.get("error")}
    if errors:
        raise _fail("Could not look for Ray", errors, "check the workers with `tpufab status`.")
    head_state = states[head.worker]
    head_up = head_state.get("head") and head_state.get("raylet")
    if head_up and not head_state.get("auth") and head_state.get("auth_supported"):
        progress(f"Ray on {nodeset.label(head.worker)} runs without token authentication "
                 "(anyone who reaches a host could run commands through it); starting it "
                 "again with a token...", "yellow")
        head_up = False
    extra = list(extra)
    if head_up and extra and head_state.get("options") not in (None, extra):
        raise RayError(
            f"Ray is up on {pod.name} with the `ray start` options "
            f"{' '.join(head_state['options']) or '(none)'}, and {' '.join(extra)} would "
            "apply only to the hosts started now: `tpufab ray down`, then `tpufab ray up -- "
            f"{' '.join(extra)}` starts every host with them.")

    def joined(w: int) -> bool:
        return bool(states[w].get("raylet")) and states[w].get("gcs_address") == address

    if head_up and all(joined(w) for w in by_worker):
        return RayUp(address, head.worker, len(every), already=True,
                     seconds=time.monotonic() - began, nodes=_alive(pod, head.worker, timeout),
                     open_hosts=sorted(w for w, st in states.items() if not st.get("auth")))
    to_start = [w for w in by_worker if not head_up or not joined(w)]
    token = _token(pod, head.worker, timeout) if head_up else secrets.token_hex(32)
    # Ray left over from an older cluster (a dead head, another address) goes first.
    stale = [w for w in to_start if states[w].get("processes")]
    if stale:
        progress(f"Stopping Ray left from an older cluster on {nodeset.fold(stale)}...", "dim")
        stopped = _run(pod, ["stop", "--grace", 5], stale, timeout)
        left = {w: f"{len(s['left'])} Ray processes would not stop" for w, s in stopped.items()
                if s.get("left")}
        left.update({w: s["error"] for w, s in stopped.items() if s.get("error")})
        if left:
            raise _fail("Could not stop the old Ray", left, "try `tpufab ray down`.")

    def config(h: Host) -> bytes:
        return json.dumps({"head": h.worker == head.worker, "address": address,
                           "node_ip": h.ip, "port": GCS_PORT, "token": token,
                           "options": extra, "dashboard_port": DASHBOARD_PORT,
                           "env": h.env()}).encode()

    open_hosts: list[int] = [w for w in by_worker if w not in to_start
                             and not states[w].get("auth")]
    batches = join_batches(head.worker, to_start, head_up=bool(head_up), size=join_batch)
    ips = {h.ip: h.worker for h in every}
    for number, batch in enumerate(batches):
        if not batch:
            continue
        what = "the head" if batch == [head.worker] else f"{nodeset.fold(batch)}"
        progress(f"Starting Ray on {what}...", "dim")
        puts = put_each(pod.fanout, {w: config(by_worker[w]) for w in batch}, CONFIG_PATH,
                        mode=0o600)
        bad = {w: r.outcome for w, r in puts.items() if not r.ok}
        if bad:
            raise _fail("Could not write Ray's settings", bad, "check the workers' disks.")
        started = _run(pod, ["start", "--config", CONFIG_PATH, "--", *extra], batch, timeout)
        bad = {w: s.get("error") for w, s in started.items() if s.get("error")}
        # `ray start` gives up after 30 s without the raylet registered (hard-coded in Ray),
        # leaving what it started running; on a loaded host the raylet may still register
        # (the head's too: its GCS and dashboard are up by then): the waits below decide.
        late = [w for w, why in bad.items() if "timed out during startup" in str(why)]
        if late:
            progress(f"`ray start` stopped waiting for its raylet on {nodeset.fold(late)}; "
                     "waiting for the head to see those hosts...", "dim")
        bad = {w: why for w, why in bad.items() if w not in late}
        if bad:
            raise _fail("Ray did not start", bad, "see the reason; `tpufab ray down` clears a "
                        "half-started cluster.")
        open_hosts.extend(w for w, st in started.items() if not st.get("error")
                          and not st.get("auth"))
        done = [float(s.get("seconds") or 0) for s in started.values() if not s.get("error")]
        if done:
            progress(f"Ray started on {what} (`ray start`: {max(done):.1f} s; "
                     f"{time.monotonic() - began:.1f} s so far).", "dim")
        if batch == [head.worker] and late:   # the others join once the head sees itself
            _wait_joined(pod, head.worker, {head.ip: head.worker}, timeout)
        elif join_batch and number < len(batches) - 1 and batch != [head.worker]:
            # the next batch starts once the head sees this one (its raylets registered)
            _wait_joined(pod, head.worker, {ip: w for ip, w in ips.items() if w in batch},
                         timeout)
    nodes = _wait_joined(pod, head.worker, ips, timeout)
    return RayUp(address, head.worker, len(every), started=sorted(to_start),
                 seconds=time.monotonic() - began, nodes=nodes,
                 open_hosts=sorted(set(open_hosts)))


def _token(pod, head: int, timeout: float) -> str | None:
    """The running cluster's token, from the head (None: it runs without one)."""
    return _run(pod, ["token"], [head], timeout)[head].get("token") or None


def _alive(pod, head: int, timeout: float) -> list[dict]:
    answer = _run(pod, ["cluster", "--dashboard-port", DASHBOARD_PORT], [head], timeout)[head]
    if answer.get("error"):
        raise RayError(f"Ray's head on {nodeset.label(head)} did not answer: {answer['error']}; "
                       "`tpufab ray down` then `tpufab ray up` restarts it.")
    return [n for n in answer.get("nodes", []) if n.get("state") == "ALIVE"]


def _wait_joined(pod, head: int, ips: dict[str, int], timeout: float) -> list[dict]:
    """Until every host's IP (``{ip: worker}``) is an alive node in the head's view
    (bounded)."""
    bound = min(timeout, timeout_for("ray up: joined"))
    deadline = time.monotonic() + bound
    while True:
        try:
            nodes = _alive(pod, head, timeout)
        except RayError:
            nodes = []
            if time.monotonic() >= deadline:
                raise
        missing = sorted(set(ips) - {n.get("ip") for n in nodes})
        if not missing:
            return nodes
        if time.monotonic() >= deadline:
            raise RayError(f"Ray started, but the head does not see "
                           f"{nodeset.fold(ips[ip] for ip in missing)} after "
                           f"{bound:g} s; `tpufab ray status` shows what it "
                           "sees, `tpufab ray up` again rejoins the missing hosts.")
        time.sleep(1.0)


# -- status ---------------------------------------------------------------------------------


@dataclass(kw_only=True)
class RayStatusReport(Report):
    """`tpufab ray status`: a row per host (its ``Host``), what each said of its Ray
    processes (``states``), the nodes the head sees and the jobs; printed by
    tpufab/views/ray.py (the view ``ray``)."""

    step: str = "ray status"
    name: str
    address: str
    head: int
    states: dict[int, dict]
    nodes: list[dict] = field(default_factory=list)
    jobs: list[dict] = field(default_factory=list)
    error: str | None = None

    view: ClassVar[str] = "ray"

    @property
    def hosts(self) -> list[Host]:
        return self.rows

    @property
    def up(self) -> bool:
        return bool(self.states.get(self.head, {}).get("head")) and self.error is None

    @property
    def missing(self) -> list[int]:
        """Hosts the head does not see alive."""
        seen = {n.get("ip") for n in self.nodes}
        return [h.worker for h in self.hosts if h.ip not in seen]

    @property
    def healthy(self) -> bool:
        return self.up and not self.missing

    @property
    def ok(self) -> bool:
        return self.healthy


def status(pod, *, timeout: float | None = None) -> RayStatusReport:
    timeout = timeout_for("ray status", timeout)
    every = hosts(pod)
    head = every[0]
    states = _run(pod, ["state"], [h.worker for h in every], timeout)
    report = RayStatusReport(name=pod.name, address=f"{head.ip}:{GCS_PORT}", head=head.worker,
                       rows=every, states=states)
    if states[head.worker].get("head"):
        answer = _run(pod, ["cluster", "--dashboard-port", DASHBOARD_PORT], [head.worker],
                      timeout)[head.worker]
        if answer.get("error"):
            report.error = answer["error"]
        else:
            report.nodes = [n for n in answer.get("nodes", []) if n.get("state") == "ALIVE"]
            report.jobs = answer.get("jobs", [])
    return report


# -- down -----------------------------------------------------------------------------------


@dataclass
class RayDown:
    answers: dict[int, dict]    # each worker's answer: stopped, forced, left


def down(pod, *, grace: float = 10.0, timeout: float | None = None) -> RayDown:
    """`ray stop` on every host (then --force, then SIGKILL what is left). Raises RayError
    naming the hosts where Ray processes are left."""
    timeout = timeout_for("ray down", timeout)
    answers = _run(pod, ["stop", "--grace", grace], pod.workers, timeout)
    bad = {w: a["error"] for w, a in answers.items() if a.get("error")}
    bad.update({w: "left " + ", ".join(a["left"]) for w, a in answers.items() if a.get("left")})
    if bad:
        raise _fail("Ray is not fully stopped", bad, "run `tpufab ray down` again, or "
                    "`tpufab kill`.")
    return RayDown(answers)


# -- submit ---------------------------------------------------------------------------------


def _shell_dir(path: str) -> str:
    """A worker directory for the job's shell: ``~/x`` and relative ones under $HOME."""
    if path.startswith("/"):
        return shlex.quote(path)
    return '"$HOME"/' + shlex.quote(path.removeprefix("~/"))


def entrypoint(recipe_path: str, *, is_python: bool, args: Sequence[str], cwd: str | None,
               secrets_file: str | None, secret_names: Sequence[str] = (),
               masktee: str | None = None, masktee_sha256: str | None = None) -> str:
    """The job's shell command: into the deployed commit, the secrets from their 0600 file
    (then removed), the recipe with the job's Python (or as its own executable). With
    secrets, the recipe's output goes through ``masktee`` (remote/masktee.py, checked
    against its sha256 first) before Ray's job log sees a byte of it, as `run` masks at
    capture, and the job exits with the recipe's status."""
    parts = []
    if cwd:   # as `run`: a directory missing there (not deployed) means the home directory
        parts.append(f"cd {_shell_dir(cwd)} 2>/dev/null || {{ echo {shlex.quote(cwd)}' does "
                     "not exist on the head; running in the home directory (deploy first, or "
                     "drop --no-deploy)' >&2; cd; }")
    if secrets_file:
        parts.append(f"set -a; . {_shell_dir(secrets_file)}; set +a; rm -f "
                     f"{_shell_dir(secrets_file)}")
    run = [_shell_dir(recipe_path), *map(shlex.quote, args)]
    if is_python:
        parts.append('PY="${TPUFAB_PYTHON:-$HOME/.venv/bin/python}"; [ -x "$PY" ] || PY=python3')
        command = '"$PY" ' + " ".join(run)
    else:
        command = " ".join(run)
    if not (secrets_file and secret_names and masktee):
        parts.append("exec " + command)
        return "; ".join(parts)
    tee, rc = _shell_dir(masktee), '"$HOME"/.cache/tpufab/ray/rc.$$'
    names = " ".join(shlex.quote(n) for n in secret_names)
    if masktee_sha256:     # the bytes that mask are the bytes tpufab shipped
        parts.append(f"echo {masktee_sha256}'  '{tee} | sha256sum -c --status || {{ echo "
                     "'tpufab: the masking script on the head was changed; run `tpufab ray "
                     "submit` again' >&2; exit 97; }")
    parts.append(f"{{ {command} 2>&1; echo $? > {rc}; }} | python3 -I -S {tee} - {names}")
    parts.append(f"code=$(cat {rc} 2>/dev/null || echo 1); rm -f {rc}; exit $code")
    return "; ".join(parts)


class JobApi:
    """Ray's Job API (the dashboard's REST routes) over a local port forwarded to the head."""

    def __init__(self, url: str, token: str | None = None):
        self.url = url.rstrip("/")
        self.token = token       # Ray's token authentication: the cluster's token

    def _call(self, method: str, path: str, body: dict | None = None) -> dict | list:
        data = json.dumps(body).encode() if body is not None else None
        headers = {"Content-Type": "application/json"}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        request = urllib.request.Request(self.url + path, data=data, method=method,
                                         headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=60) as resp:
                return json.loads(resp.read().decode() or "{}")
        except urllib.error.HTTPError as err:
            text = err.read().decode("utf-8", "replace").strip().splitlines()
            raise RayError(f"Ray's Job API answered {err.code} to {method} {path}"
                           f"{': ' + text[-1][:200] if text else ''}.") from None
        except (OSError, ValueError) as err:
            raise RayError(f"Ray's Job API did not answer ({err}); is Ray up (`tpufab ray "
                           "status`)?") from None

    def submit(self, entrypoint: str, submission_id: str, env_vars: dict[str, str]) -> str:
        body = {"entrypoint": entrypoint, "submission_id": submission_id,
                "runtime_env": {"env_vars": env_vars} if env_vars else {}}
        answer = self._call("POST", "/api/jobs/", body)
        return str(answer.get("submission_id") or submission_id)  # type: ignore[union-attr]

    def info(self, job: str) -> dict:
        return self._call("GET", f"/api/jobs/{job}")  # type: ignore[return-value]

    def logs(self, job: str) -> str:
        return str(self._call("GET", f"/api/jobs/{job}/logs").get("logs") or "")  # type: ignore[union-attr]

    def stop(self, job: str) -> None:
        self._call("POST", f"/api/jobs/{job}/stop")


@dataclass
class Submitted:
    job: str
    status: str
    exit_code: int
    message: str
    seconds: float


def exit_code_of(info: dict) -> int:
    status = info.get("status")
    if status == "SUCCEEDED":
        return 0
    code = info.get("driver_exit_code")
    if isinstance(code, int) and 0 < code < 256:
        return code
    return 130 if status == "STOPPED" else 1


def submit(pod, settings, recipe, args: Sequence[str] = (), *,
           env: Sequence[str] | None = None, secret: Sequence[str] | None = None,
           no_deploy: bool = False, direct: bool = False, timeout: float | None = None,
           out: Callable[[str], None] | None = None, progress: Progress = silent,
           poll: float = 0.5, cwd: str | None = None, extra_env: dict[str, str] | None = None,
           job_id: str | None = None, cancel: threading.Event | None = None,
           forwarded=None) -> Submitted:
    """Deploy, submit ``recipe`` through Ray's Job API (forwarded to the head's 127.0.0.1),
    print its logs as they come (``out(line)``, secrets masked) and return how it ended. The
    deploy and the submission are the one start path's (``starting.start_job``: under the
    pod's code lease, refused beside a running run); following the job comes after.

    For babysit: ``cwd`` (the commit is deployed there already: no deploy), ``extra_env``
    (more public variables), ``job_id`` (the submission id), ``cancel`` (set: ask Ray to stop
    the job, as far as it answers, and return status CANCELLED). For launch: ``recipe`` may be
    a RemoteFile (a script, run as its own executable), ``forwarded`` the environment as
    decided already (a tpufab.steps.runs.env.Forwarded)."""
    import secrets as tokens

    from tpufab.ssh import forward as forwarding
    from tpufab.ssh.remote_files import RemoteFile, put_each, ship
    from tpufab.steps.code.deploy import default_cwd
    from tpufab.steps.runs.env import forwarded_for
    from tpufab.steps.start.starting import check_recipe, deploy_ask, start_job

    timeout = timeout_for("ray submit", timeout)
    if no_deploy and direct:
        raise ConfigError("--no-deploy skips deploy, while --direct says how to deploy: give "
                          "one or the other.")
    if isinstance(recipe, RemoteFile):
        path, script = Path(recipe.path), recipe
    else:
        path = check_recipe(recipe)
        script = RemoteFile.from_path(path)
    if forwarded is None:
        forwarded = forwarded_for(settings, list(env or ()), secret)
    every = hosts(pod)
    head = every[0].worker
    state = _run(pod, ["state"], [head], timeout)[head]
    if not state.get("head"):
        raise RayError(f"Ray is not running on {pod.name}: start it with `tpufab ray up`.")
    ask = None
    if cwd is None and not no_deploy:
        ask = deploy_ask(settings, direct=direct, what=path.name, progress=progress)
    token = _token(pod, head, timeout)
    job = job_id or f"tpufab-{time.strftime('%Y%m%d-%H%M%S')}-{tokens.token_hex(3)}"
    secret_values = {k: str(v) for k, v in forwarded.secrets.items()}
    masks = sorted((v for v in secret_values.values() if v), key=len, reverse=True)

    def masked(text: str) -> str:
        for value in masks:
            text = text.replace(value, "***")
        return text

    def begin(report) -> tuple[object, JobApi, str, float]:
        """Under the lease: the recipe and the secrets on the head, the job submitted."""
        where = cwd if cwd is not None else report.dir if report is not None else \
            default_cwd(settings.remote_dir)
        masktee = RemoteFile.bundled("masktee.py")
        failed = ship(pod.fanout, [script, masktee], [head])
        if failed:
            raise RayError(f"Could not put {path.name} on {nodeset.label(head)}.")
        secrets_file = None
        if secret_values:
            secrets_file = f".cache/tpufab/ray/{job}.env"
            body = "".join(f"{k}={shlex.quote(v)}\n" for k, v in secret_values.items()).encode()
            puts = put_each(pod.fanout, {head: body}, secrets_file, mode=0o600)
            if not puts[head].ok:
                raise RayError(f"Could not put the job's secrets on {nodeset.label(head)}.")
        command = entrypoint(script.path, is_python=path.suffix == ".py", args=list(args),
                             cwd=where, secrets_file=secrets_file,
                             secret_names=sorted(secret_values), masktee=masktee.path,
                             masktee_sha256=masktee.sha256)
        tunnel = forwarding.forward(pod.fanout, [forwarding.PortForward(0, DASHBOARD_PORT)],
                                    worker=head)
        try:
            port = tunnel.listeners[0][1].getsockname()[1]
            api = JobApi(f"http://127.0.0.1:{port}", token)
            public = {**{k: str(v) for k, v in forwarded.public.items()}, **(extra_env or {})}
            began = time.monotonic()
            submitted = api.submit(command, job, public)
        except BaseException:
            tunnel.close()
            raise
        progress(f"Ray job {submitted} submitted on {pod.name} ({path.name}"
                 f"{', in ' + where if where else ''}); following its logs.")
        return tunnel, api, submitted, began

    emit = out or print
    tunnel, api, job, began = start_job(pod, begin, verb="ray submit", what=path.name,
                                        deploy=ask, timeout=timeout, progress=progress)
    try:
        shown, partial = 0, ""
        try:
            while True:
                info = api.info(job)
                text = api.logs(job)
                if len(text) > shown:
                    partial += text[shown:]
                    shown = len(text)
                    *complete, partial = partial.split("\n")
                    for line in complete:
                        emit(masked(line))
                if info.get("status") in TERMINAL:
                    if partial:
                        emit(masked(partial))
                    break
                if cancel is not None and cancel.wait(poll):
                    try:
                        api.stop(job)
                    except RayError:     # the head is gone (preempted): nothing to stop
                        pass
                    return Submitted(job, "CANCELLED", 130, "cancelled",
                                     time.monotonic() - began)
                if cancel is None:
                    time.sleep(poll)
        except KeyboardInterrupt:
            api.stop(job)
            raise RayError(f"Interrupted: Ray job {job} was asked to stop.",
                           exit_code=130) from None
        message = str(info.get("message") or "").split(", last available logs")[0]
        return Submitted(job, str(info.get("status")), exit_code_of(info),
                         masked(message.strip().splitlines()[0] if message.strip() else ""),
                         time.monotonic() - began)
    finally:
        tunnel.close()
