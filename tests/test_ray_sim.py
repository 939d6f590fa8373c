"""Ray on the pod (`tpufab ray up | status | submit | down`, and `kill` knowing Ray), with real
Ray on a simulated v4-16 (2 real sshd workers, 4 placeholder chips each).

The workers import Ray from the pod's share (scripts/sim-wheels.sh --ray, built once per
machine and cached; scripts/setup-sim.sh on every worker). Ray is heavy on a 2-core machine:
one cluster per module, started by the first test and reused (each test says what it needs).
Ray on the simulated workers shares the host's network namespace, so every Ray address is the
worker's own 127.x address (what tpufab passes as --node-ip-address).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from harness import connected_pod
from helpers import (
    LOGIN,
    TPUFAB,
    InThread,
    Running,
    in_worker,
    ok,
    one_sentence,
    tpufab,
    wait_for,
)

from tpufab.remote.ray_worker import agent_port

pytestmark = [pytest.mark.sim, pytest.mark.timeout(900)]

# Small Ray nodes: one CPU and an 80 MB object store per host.
SMALL = ["--", "--num-cpus=1", "--object-store-memory=80000000"]
SECRET = "hf_Ray-secret-never-in-logs-4417"

# One task per host: a placement group of one {"TPU": 4} bundle per host, spread.
PER_HOST_PY = """import json, os, socket
import ray
from ray.util.placement_group import placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

ray.init()
hosts = int(os.environ.get("HOSTS", "2"))
pg = placement_group([{"TPU": 4, "CPU": 1}] * hosts, strategy="STRICT_SPREAD")
ray.get(pg.ready(), timeout=120)

@ray.remote(num_cpus=1, resources={"TPU": 4})
def where():
    ctx = ray.get_runtime_context()
    return {"worker_id": os.environ.get("TPU_WORKER_ID"), "name": os.environ.get("TPU_NAME"),
            "node": ctx.get_node_id(), "accelerator_ids": ctx.get_accelerator_ids().get("TPU")}

found = ray.get([where.options(scheduling_strategy=PlacementGroupSchedulingStrategy(
    placement_group=pg, placement_group_bundle_index=i)).remote() for i in range(hosts)])
print("PER_HOST " + json.dumps(found), flush=True)
"""

EXIT_PY = """import os, sys
print("job says hello", flush=True)
print("token is " + os.environ.get("HF_TOKEN", "unset"), flush=True)
print("plain is " + os.environ.get("PLAIN", "unset"), flush=True)
sys.exit(int(sys.argv[1]))
"""

# Holds worker 1's TPU (its device files, as libtpu does) in a Ray task placed there by label.
HOLD_PY = """import os, time
import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

ray.init()
w1 = next(n["NodeID"] for n in ray.nodes()
          if n["Alive"] and n["Labels"].get("ray.io/tpu-worker-id") == "1")

@ray.remote(num_cpus=1, resources={"TPU": 4})
def hold():
    files = [open(f"/dev/accel{i}", "rb") for i in range(4)]
    print("holding the TPU on worker", os.environ.get("TPU_WORKER_ID"), flush=True)
    time.sleep(600)

ray.get(hold.options(scheduling_strategy=NodeAffinitySchedulingStrategy(w1, soft=False)).remote())
"""

RAY_PS = ("ps -eo pid=,comm=,args= | grep -E 'raylet|gcs_server|ray::|ray-dashboard|/ray/' "
          "| grep -v grep || true")


@pytest.fixture(scope="module")
def ray_pod(sim, tmp_path_factory):
    """A v4-16 whose workers import Ray; Ray itself is started by the tests (ray up)."""
    with connected_pod(sim, tmp_path_factory, "ray", type="v4-16", site="ray", setup=True,
                       drop=("HF_TOKEN", "PLAIN")) as pod:
        recipes = pod.base / "recipes"
        recipes.mkdir()
        for name, text in (("per_host.py", PER_HOST_PY), ("exit.py", EXIT_PY),
                           ("hold.py", HOLD_PY)):
            (recipes / name).write_text(text)
        yield pod
        tpufab("ray", "down", env=pod.env, timeout=300)


def ray_processes(sim, pod, worker: int) -> list[str]:
    return [line for line in in_worker(sim, pod.pod.node, worker, RAY_PS).splitlines()
            if line.strip()]


def accel_holders(sim, pod, worker: int) -> int:
    """How many open files of the worker's processes are its TPU device files."""
    out = in_worker(sim, pod.pod.node, worker,
                    "ls -l /proc/[0-9]*/fd 2>/dev/null | grep -c /dev/accel || true")
    return int(out.strip() or 0)


def ray_up(pod) -> str:
    result = tpufab("ray", "up", *SMALL, env=pod.env, timeout=600)
    print(result.stderr + result.stdout)     # its times, for docs/benchmarks.md (pytest -s)
    return ok(result)


def status_json(pod) -> dict:
    result = tpufab("ray", "status", "--json", env=pod.env, timeout=300)
    assert result.returncode in (0, 3), result.stdout + result.stderr
    return json.loads(result.stdout)


def test_ray_up_joins_hosts_in_batches_after_the_head():
    from tpufab.steps.start.raycluster import join_batches

    assert join_batches(0, range(16), head_up=False) == [[0], list(range(1, 16))]
    assert join_batches(0, range(16), head_up=False, size=4) == \
        [[0], [1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12], [13, 14, 15]]
    assert join_batches(0, [3, 7], head_up=True, size=4) == [[3, 7]]   # rejoin only those
    assert join_batches(0, [0], head_up=False, size=4) == [[0]]


def pod_status(pod) -> str:
    """`tpufab status`'s text (exit 0: every worker answered)."""
    return ok(tpufab("status", env=pod.env, timeout=300))


def test_ray_up_starts_one_cluster_whose_nodes_carry_the_tpu_and_slice_labels(ray_pod):
    name = ray_pod.env["TPUFAB_NAME"]
    ips = ray_pod.pod.internal_ips()
    assert "Ray" not in pod_status(ray_pod)        # Ray never used here: status says nothing
    out = ray_up(ray_pod)
    assert f"Ray is up on {name}: head on w0 at {ips[0]}:6379, 2 hosts joined" in out, out

    report = status_json(ray_pod)
    assert report["up"] and report["missing"] == [], report
    nodes = {n["ip"]: n for n in report["nodes"]}
    assert set(nodes) == set(ips), report
    for w, ip in enumerate(ips):
        node = nodes[ip]
        assert node["resources"]["TPU"] == 4, node
        # tpufab's environment, not the metadata server's numeric instance id, names the slice
        assert node["labels"]["ray.io/tpu-slice-name"] == name, node
        assert node["labels"]["ray.io/tpu-worker-id"] == str(w), node
        assert node["labels"]["ray.io/tpu-pod-type"] == "v4-16", node
        assert node["labels"]["ray.io/tpu-topology"] == "2x2x2", node
        assert ("TPU-v4-16-head" in node["resources"]) == (w == 0), node

    text = ok(tpufab("ray", "status", env=ray_pod.env, timeout=300))
    assert f"Ray on {name}: head on w0 at {ips[0]}:6379; 2/2 hosts joined." in text, text
    assert re.search(rf"w0 {re.escape(ips[0])}: TPU 4, CPU 1, TPU-v4-16-head; slice {name}, "
                     r"worker-id 0, pod-type v4-16, topology 2x2x2 \(head\)", text), text
    assert re.search(rf"w1 {re.escape(ips[1])}: TPU 4, CPU 1; slice {name}, worker-id 1", text)
    # `tpufab status` reads Ray's daemons in its own fan-out
    assert "Ray: up, head w0, 2/2 hosts joined." in pod_status(ray_pod)


CANARY = "/tmp/tpufab-ray-canary"


def _of_pod(pid: int, name: str) -> bool:
    """``pid`` or one of its parents carries the slice's TPU_NAME in its environment. (Ray's
    Python processes retitle themselves, `ray::DashboardAgent`, and the longer title can
    overwrite their own /proc/PID/environ: their raylet's is intact.)"""
    for _ in range(6):
        try:
            if f"\0TPU_NAME={name}\0".encode() in b"\0" + Path(f"/proc/{pid}/environ").read_bytes():
                return True
            pid = int(Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[1])
        except (OSError, ValueError, IndexError):
            return False
        if pid <= 1:
            return False
    return False


def ray_listeners(sim, pod) -> list[tuple[str, int, str]]:
    """(address, port, process) of every TCP socket the pod's Ray processes listen on (the
    simulated workers share this machine's network namespace, so `ss` here sees them all;
    a Ray process or its raylet carries the slice's TPU_NAME in its environment)."""
    name = pod.env["TPUFAB_NAME"]
    out = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, check=True).stdout
    found = []
    for line in out.splitlines():
        fields = line.split()
        local, procs = fields[3], " ".join(fields[5:])
        pids = [int(p) for p in re.findall(r"pid=(\d+)", procs)]
        if any(_of_pod(pid, name) for pid in pids):
            address, _, port = local.rpartition(":")
            found.append((address.strip("[]").removeprefix("::ffff:"), int(port),
                          (re.findall(r'\("([^"]+)"', procs) or ["?"])[0]))
    return found


def post_without_token(host: str, port: int, path: str) -> int | str:
    """An unauthenticated POST asking the listener to run a job that touches the canary (the
    ShadowRay request): its HTTP status, or why there was none."""
    import urllib.error
    import urllib.request

    body = json.dumps({"entrypoint": f"touch {CANARY}", "submission_id": f"x{port}"}).encode()
    request = urllib.request.Request(f"http://{host}:{port}{path}", data=body, method="POST",
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=10) as resp:
            return resp.status
    except urllib.error.HTTPError as err:
        return err.code
    except Exception as err:        # not HTTP (gRPC), reset, timed out: no job either way
        return type(err).__name__


def test_no_ray_listener_runs_anything_without_the_clusters_token(sim, ray_pod):
    """ShadowRay (CVE-2023-48022): every host's dashboard agent listens on the host's
    internal IP, and its job API ran a shell command for any POST. Now every Ray listener of
    the cluster, on any address, wants the cluster's token (Ray's token authentication): a
    POST of a job to each is refused and nothing runs; joining the GCS without the token is
    refused; and Ray's session directory (every job's log) is private on every host."""
    ips = ray_pod.pod.internal_ips()
    # `ray up` returns once every host's raylet is alive in the head's view; each host's
    # dashboard agent binds its port a little later (seconds later on a loaded machine)
    # (each simulated host's agent on a port of its own: they share 127.0.0.1, ray_worker.py)
    agents = {(ip, agent_port(ip, [])) for ip in ips}
    wait_for(lambda: agents <= {(a, port) for a, port, _ in ray_listeners(sim, ray_pod)},
             120, interval=1.0,
             what=lambda: f"every host's dashboard agent listening ({sorted(agents)}; the pod's "
             f"Ray listeners now: {sorted(ray_listeners(sim, ray_pod))})")
    listeners = ray_listeners(sim, ray_pod)
    assert len(listeners) >= 8, listeners
    answers = {}
    for address, port, proc in listeners:
        hosts = ips if address in ("*", "0.0.0.0", "") else [address]
        for host in hosts:
            for path in ("/api/job_agent/jobs/", "/api/jobs/"):
                answers[(host, port, proc, path)] = post_without_token(host, port, path)
    accepted = {k: v for k, v in answers.items() if isinstance(v, int) and 200 <= v < 300}
    assert not accepted, accepted
    # the job APIs of the dashboard (127.0.0.1:8265) and each agent answer 401, not a job
    assert answers[("127.0.0.1", 8265, next(p for a, port, p in listeners if port == 8265),
                    "/api/jobs/")] == 401, answers
    assert {v for (h, port, _, path), v in answers.items()
            if (h, port) in agents and path == "/api/job_agent/jobs/"} == {401}, answers
    assert len({(h, port) for (h, port, _, _) in answers} & agents) == len(ips), answers
    # a driver without the token cannot join (the login user's own finds ~/.ray/auth_token)
    join = (f"HOME=/root RAY_AUTH_MODE= timeout 120 /home/tpufab/.venv/bin/python -c "
            f"\"import ray; ray.init(address='{ips[0]}:6379'); "
            f"ray.get(ray.remote(lambda: open('{CANARY}', 'w').close()).remote())\" 2>&1 "
            "| tail -3; echo rc=$?")
    print(in_worker(sim, ray_pod.pod.node, 1, join, check=False))
    for w in (0, 1):
        assert in_worker(sim, ray_pod.pod.node, w, f"test -e {CANARY} && echo y || true"
                         ).strip() == "", f"a request without the token ran on w{w}"
        mode = in_worker(sim, ray_pod.pod.node, w,
                         "stat -c %a \"$(readlink -f /tmp/ray/session_latest)\"").strip()
        assert mode == "700", (w, mode)
        token = in_worker(sim, ray_pod.pod.node, w,
                          "stat -c '%a %U' /home/tpufab/.ray/auth_token").strip()
        assert token == "600 tpufab", (w, token)


def test_ray_up_again_is_a_no_op_and_rejoins_a_host_where_ray_died(sim, ray_pod):
    name = ray_pod.env["TPUFAB_NAME"]
    raylet = in_worker(sim, ray_pod.pod.node, 1, "pgrep -x raylet").split()
    assert len(raylet) == 1, raylet
    out = ray_up(ray_pod)
    assert f"Ray is already up on {name}:" in out and "nothing to do" in out, out
    # options for `ray start` on a running cluster are not dropped silently
    other = tpufab("ray", "up", "--", "--num-cpus=2", env=ray_pod.env, timeout=300)
    one_sentence(other, "with the `ray start` options --num-cpus=1 "
                 "--object-store-memory=80000000", "--num-cpus=2", "`tpufab ray down`")

    in_worker(sim, ray_pod.pod.node, 1, f"kill -9 {raylet[0]}")  # the host's raylet dies
    wait_for(lambda: not in_worker(sim, ray_pod.pod.node, 1, "pgrep -x raylet", check=False),
             30, what="w1's raylet to be gone")
    # status and check see that w1 left Ray, from the workers' processes
    assert "Ray: head w0, 1/2 hosts joined (w1 missing); `tpufab ray up` rejoins them." in \
        pod_status(ray_pod)
    checked = tpufab("check", "--quick", env=ray_pod.env, timeout=300)
    assert checked.returncode == 1, checked.stdout + checked.stderr
    assert "w1: not joined to Ray's head on w0; start Ray again with `tpufab ray up`." in \
        checked.stdout, checked.stdout
    out = ray_up(ray_pod)
    assert "started on w1 (the others were up)" in out, out
    assert "Ray: up, head w0, 2/2 hosts joined." in pod_status(ray_pod)
    report = status_json(ray_pod)
    assert report["up"] and report["missing"] == [], report
    assert {n["ip"] for n in report["nodes"]} == set(ray_pod.pod.internal_ips()), report


def test_a_ray_program_runs_one_task_per_host_with_its_worker_id(ray_pod):
    recipe = ray_pod.base / "recipes" / "per_host.py"
    result = tpufab("ray", "submit", str(recipe), "--no-deploy", env=ray_pod.env,
                    cwd=ray_pod.base, timeout=600)
    out = ok(result)
    line = next(x for x in out.splitlines() if x.startswith("PER_HOST "))
    found = json.loads(line.removeprefix("PER_HOST "))
    assert sorted(f["worker_id"] for f in found) == ["0", "1"], found
    assert len({f["node"] for f in found}) == 2, found          # one task on each host
    assert {f["name"] for f in found} == {ray_pod.env["TPUFAB_NAME"]}, found
    assert all(len(f["accelerator_ids"]) == 4 for f in found), found
    assert re.search(r"Ray job tpufab-\S+ succeeded: exit 0", result.stderr), result.stderr


def test_ray_submit_follows_the_logs_masks_secrets_and_exits_with_the_jobs_status(sim, ray_pod):
    recipe = ray_pod.base / "recipes" / "exit.py"
    extra = {"HF_TOKEN": SECRET, "PLAIN": "visible-value"}
    good = tpufab("ray", "submit", str(recipe), "--no-deploy", "--env", "HF_TOKEN",
                  "--env", "PLAIN", "0", env=ray_pod.env, extra_env=extra, timeout=600)
    out = ok(good)
    assert "job says hello" in out and "token is ***" in out, out
    assert "plain is visible-value" in out, out
    assert SECRET not in good.stdout + good.stderr

    bad = tpufab("ray", "submit", str(recipe), "--no-deploy", "3", env=ray_pod.env,
                 timeout=600)
    assert bad.returncode == 3, bad.stdout + bad.stderr
    assert "job says hello" in bad.stdout, bad.stdout
    assert re.search(r"Ray job tpufab-\S+ failed: exit 3", bad.stderr), bad.stderr
    # the job's record in Ray never held the secret, nor Ray's logs on the head (the job's
    # output is masked before Ray writes it), which only the login user may read
    jobs = json.dumps(status_json(ray_pod)["jobs"])
    assert SECRET not in jobs and len(status_json(ray_pod)["jobs"]) >= 3, jobs
    logs = in_worker(sim, ray_pod.pod.node, 0, "grep -rl 'token is' /tmp/ray/session_latest/"
                     "logs/ || true")
    assert "job-driver" in logs, logs
    assert in_worker(sim, ray_pod.pod.node, 0, f"grep -rl {SECRET} /tmp/ray/ || true") == ""


def test_ray_submit_deploys_the_commit_and_runs_the_job_in_it(ray_pod, tmp_path):
    project = tmp_path / "rayproj"
    (project / "recipes").mkdir(parents=True)
    (project / "data.txt").write_text("hello from the commit\n")
    (project / "recipes" / "where.py").write_text(
        "import os\nprint('cwd=' + os.getcwd())\nprint('data=' + open('data.txt').read())\n")
    git = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t",
           "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"}
    for argv in (["git", "init", "-q", "-b", "main"], ["git", "add", "-A"],
                 ["git", "commit", "-q", "-m", "ray recipe"]):
        subprocess.run(argv, cwd=project, check=True, env=git, capture_output=True)
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=project, check=True, text=True,
                            capture_output=True).stdout.strip()
    result = tpufab("ray", "submit", "recipes/where.py", "--direct", env=ray_pod.env,
                    cwd=project, timeout=600)
    out = ok(result)
    assert f"Deployed {commit[:12]} to ~/rayproj on w[0-1]" in result.stderr, result.stderr
    assert "cwd=/home/tpufab/rayproj" in out and "data=hello from the commit" in out, out


def test_ray_submit_deploys_from_a_token_only_remote(sim, ray_pod, tmp_path):
    """`ray submit` deploys through the one deploy path, which sends TPUFAB_GIT_TOKEN to the
    workers as `deploy` does (issue 37, finding 11: before, only `Pod.deploy` read it, and the
    workers' fetch from a remote that answers only with the token was refused)."""
    from gitremote import LAPTOP_HELPER, make_tls, token_remote, trust

    tls = make_tls(tmp_path)
    srv = tmp_path / "srv"
    srv.mkdir()
    subprocess.run(["git", "init", "-q", "--bare", "-b", "main", str(srv / "tokproj.git")],
                   check=True)
    with token_remote(srv, tls) as remote:
        trust(lambda w, script: in_worker(sim, ray_pod.pod.node, w, script, user=LOGIN),
              (0, 1), tls)
        project = tmp_path / "tokproj"
        (project / "recipes").mkdir(parents=True)
        (project / "data.txt").write_text("hello through the token\n")
        (project / "recipes" / "where.py").write_text(
            "import os\nprint('cwd=' + os.getcwd())\nprint('data=' + open('data.txt').read())\n")
        env = {**ray_pod.env, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t",
               "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t",
               "GIT_SSL_CAINFO": str(tls.cert), "LAPTOP_GIT_TOKEN": remote.token,
               "TPUFAB_GIT_TOKEN": remote.token}
        for argv in (["init", "-q", "-b", "main"],
                     ["config", "credential.helper", LAPTOP_HELPER],
                     ["remote", "add", "origin", f"{remote.url}/tokproj.git"], ["add", "-A"],
                     ["commit", "-q", "-m", "ray recipe"]):
            subprocess.run(["git", *argv], cwd=project, check=True, env=env, capture_output=True)
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=project, check=True,
                                text=True, capture_output=True).stdout.strip()
        result = tpufab("ray", "submit", "recipes/where.py", env=env, cwd=project, timeout=600)
    out = ok(result)
    assert f"Deployed {commit[:12]} to ~/tokproj on w[0-1]" in result.stderr, result.stderr
    assert "data=hello through the token" in out, out
    assert remote.token not in out + result.stderr


def test_kill_during_a_ray_job_stops_ray_there_cleanly_and_frees_the_tpu(sim, ray_pod):
    job = Running([TPUFAB, "ray", "submit", str(ray_pod.base / "recipes" / "hold.py"),
                   "--no-deploy"], env=ray_pod.env)
    try:
        wait_for(lambda: accel_holders(sim, ray_pod, 1), 300, interval=1.0,
                 what="the Ray job's task to hold w1's TPU")
        out = ok(tpufab("kill", env=ray_pod.env, timeout=300))
        assert re.search(r"w1 .*Ray worker.*stopped by `ray stop`", out), out
        assert "SIGKILL" not in out, out
        ended = job.wait(300)
        # the job's driver saw its task's node go (Ray's traceback is the recipe's output)
        assert ended.returncode == 1, ended.stdout + ended.stderr
        assert re.search(r"Ray job tpufab-\S+ failed: exit 1", ended.stderr), ended.stderr
    finally:
        job.kill()
    assert ray_processes(sim, ray_pod, 1) == []
    assert accel_holders(sim, ray_pod, 1) == 0
    assert ray_processes(sim, ray_pod, 0), "kill stopped Ray where it held no TPU"


def test_the_dashboard_s_forkserver_is_a_ray_process():
    """Ray 2.60's dashboard starts its modules through a multiprocessing forkserver, a
    ``python -c`` whose command line names Ray only in its module list: `ray down` must wait
    for it (and kill it if it stays), as for any other Ray process (CI once found one left)."""
    from tpufab.remote import ray_worker as ray_node

    line = ("import time; time.sleep(60)  # from multiprocessing.forkserver import main; "
            "main(25, 27, ['ray', 'ray.dashboard.subprocesses.module'], **{'sys_path': []})")
    proc = subprocess.Popen([sys.executable, "-c", line])
    plain = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)  # ray"])
    try:
        wait_for(lambda: b"forkserver" in Path(f"/proc/{proc.pid}/cmdline").read_bytes(),
                 what="the process to start")
        assert ray_node.ray_kind(proc.pid) == "daemon"
        assert ray_node.ray_kind(plain.pid) is None
        assert proc.pid in ray_node.ray_processes()
    finally:
        for p in (proc, plain):
            p.kill()
            p.wait()


def test_ray_down_leaves_no_ray_process_on_any_worker(sim, ray_pod):
    name = ray_pod.env["TPUFAB_NAME"]
    assert ray_processes(sim, ray_pod, 0)         # the head (kill stopped w1's Ray)
    out = ok(tpufab("ray", "down", env=ray_pod.env, timeout=300))
    assert f"Ray stopped on w0 of {name}" in out and "no Ray process is left" in out, out
    for w in (0, 1):
        assert ray_processes(sim, ray_pod, w) == [], w
    assert "Ray" not in pod_status(ray_pod)        # no Ray daemon left: nothing to say
    again = ok(tpufab("ray", "down", env=ray_pod.env, timeout=300))
    assert f"Ray was not running on {name}; nothing to stop." in again, again
    gone = tpufab("ray", "status", env=ray_pod.env, timeout=300)
    assert gone.returncode == 3 and f"Ray is not running on {name}" in gone.stdout, gone.stdout
    refused = tpufab("ray", "submit", str(ray_pod.base / "recipes" / "exit.py"), "--no-deploy",
                     "0", env=ray_pod.env, timeout=300)
    one_sentence(refused, f"Ray is not running on {name}", "tpufab ray up")



def test_launch_ray_brings_ray_up_and_runs_the_tasks_run_as_a_ray_job(ray_pod):
    """launch --ray runs `ray up` (here a no-op: the small cluster is started first, since
    Ray's defaults would take every CPU and 30% of memory on each simulated host)."""
    name = ray_pod.env["TPUFAB_NAME"]
    ray_up(ray_pod)
    driver = "\n".join("  " + line for line in PER_HOST_PY.splitlines())
    (ray_pod.base / "raytask.yaml").write_text(
        "type: v4-16\nrun: |\n  echo \"task says $GREETING\"\n"
        '  PY="${TPUFAB_PYTHON:-$HOME/.venv/bin/python}"; [ -x "$PY" ] || PY=python3\n'
        "  \"$PY\" - <<'EOF'\n" + driver + "\n  EOF\n  exit 3\n")
    result = tpufab("launch", "raytask.yaml", "--name", name, "--ray", "--env",
                    "GREETING=hello-from-launch", env=ray_pod.env, cwd=ray_pod.base,
                    timeout=900)
    assert result.returncode == 3, result.stdout + result.stderr
    assert f"Ray is already up on {name}: head on w0" in result.stderr, result.stderr
    assert "task says hello-from-launch" in result.stdout, result.stdout
    line = next(x for x in result.stdout.splitlines() if x.startswith("PER_HOST "))
    found = json.loads(line.removeprefix("PER_HOST "))
    assert sorted(f["worker_id"] for f in found) == ["0", "1"], found
    assert re.search(r"Ray job tpufab-\S+ failed: exit 3", result.stderr), result.stderr

# babysit --ray: attempt 0 runs until the node is preempted under it; attempt 1 (on the
# recreated node, in a Ray cluster started again) counts the hosts its Ray sees and ends.
BABYSAT_PY = """import os, time
import ray
n = os.environ["TPUFAB_RESTART_COUNT"]
print("ray attempt " + n + " of " + os.environ["TPUFAB_BABYSIT_RUN"], flush=True)
if n == "0":
    time.sleep(600)
ray.init()
alive = sorted(x["Labels"].get("ray.io/tpu-worker-id") for x in ray.nodes() if x["Alive"])
print("attempt " + n + " sees Ray hosts " + ",".join(alive), flush=True)
"""


def test_babysit_ray_restarts_the_cluster_after_a_preemption_then_resubmits(ray_pod, sim_admin,
                                                                           tmp_path):
    import io

    from rich.console import Console

    from tpufab.cloud.planes.tpu import TpuApi
    from tpufab.flows.babysit import loop

    name = ray_pod.env["TPUFAB_NAME"]
    recipe = tmp_path / "babysat.py"
    recipe.write_text(BABYSAT_PY)
    notes, out = io.StringIO(), io.StringIO()
    sitter = loop.Babysitter(ray_pod.settings, recipe, no_deploy=True, ray=True,
                             ray_options=SMALL[1:], poll=0.5, backoff=(0.0, 0.0),
                             console=Console(file=notes, width=300),
                             out=lambda line: out.write(line + "\n"), base_dir=tmp_path)
    before = TpuApi(ray_pod.settings).get_node(name).id
    thread = InThread(sitter.run)
    outcome = thread.outcome
    try:
        wait_for(lambda: "error" in outcome or "ray attempt 0 of" in out.getvalue(), 420,
                 interval=1.0, what="attempt 0's Ray job to be running")
        assert "error" not in outcome, f"{outcome['error']}\n{notes.getvalue()}"
        sim_admin.preempt(name)
        thread.join(900)
        assert not thread.is_alive(), "babysit did not end\n" + notes.getvalue()
        said = notes.getvalue()
        assert "value" in outcome, f"{outcome.get('error')}\n{said}"
        result = outcome["value"]
        assert result.exit_code == 0
        assert [a.outcome for a in result.attempts] == ["preempted", "finished"], said
        assert TpuApi(ray_pod.settings).get_node(name).id != before     # recreated
        assert "babysit: preempted: attempt 0 preempted" in said, said
        # the cluster was started on the recreated node (not found up) before the job went again
        again = said.split("before attempt 1")[1]
        assert re.search(rf"babysit: Ray is up on {name}: head on w0 at \S+, 2 hosts joined "
                         r"\(started, ", again), said
        assert again.index("2 hosts joined (started") < again.index("attempt 1 is Ray job"), said
        text = out.getvalue()
        assert f"ray attempt 1 of {result.run_id}" in text, text
        assert "attempt 1 sees Ray hosts 0,1" in text, text
        copied = (result.log_dir / "attempt-1" / "job.log").read_text()
        assert "attempt 1 sees Ray hosts 0,1" in copied, copied
    finally:   # Ray's GCS listens on every address: one cluster on the machine at a time
        tpufab("ray", "down", env=ray_pod.env, timeout=300)


@pytest.fixture(scope="module")
def ray_slices(sim, tmp_path_factory):
    """Two slices of v4-8 (one host each) in one queued resource, whose workers import Ray."""
    with connected_pod(sim, tmp_path_factory, "rayms", type="v4-8", site="ray", setup=True,
                       num_slices=2) as pod:
        (pod.base / "per_host.py").write_text(PER_HOST_PY)
        yield pod
        tpufab("ray", "down", env=pod.env, timeout=300)


def test_ray_up_on_two_slices_is_one_cluster_each_slice_with_its_own_labels(ray_slices):
    name = ray_slices.env["TPUFAB_NAME"]
    ips = ray_slices.pod.internal_ips()
    assert len(ips) == 2, ips
    out = ray_up(ray_slices)
    assert f"Ray is up on {name}: head on w0 at {ips[0]}:6379, 2 hosts joined" in out, out
    report = status_json(ray_slices)
    assert report["up"] and report["missing"] == [], report
    nodes = {n["ip"]: n for n in report["nodes"]}
    assert set(nodes) == set(ips), report
    for index, ip in enumerate(ips):
        node = nodes[ip]
        assert node["labels"]["ray.io/tpu-slice-name"] == f"{name}-{index}", node
        assert node["labels"]["ray.io/tpu-worker-id"] == "0", node   # each slice's worker 0
        assert node["labels"]["ray.io/tpu-pod-type"] == "v4-8", node
        assert node["resources"]["TPU"] == 4, node
        assert "TPU-v4-8-head" in node["resources"], node   # every slice's worker 0 (Ray's way)
        assert node["head"] == (index == 0), node            # Ray's head: slice 0's worker 0
    # one task per host lands on each slice
    result = tpufab("ray", "submit", str(ray_slices.base / "per_host.py"), "--no-deploy",
                    env=ray_slices.env, cwd=ray_slices.base, timeout=600)
    line = next(x for x in ok(result).splitlines() if x.startswith("PER_HOST "))
    found = json.loads(line.removeprefix("PER_HOST "))
    assert sorted(f["name"] for f in found) == [f"{name}-0", f"{name}-1"], found
    assert [f["worker_id"] for f in found] == ["0", "0"], found
    assert "Ray: up, head w0, 2/2 hosts joined." in pod_status(ray_slices)
