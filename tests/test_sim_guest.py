"""The simulated pod's workers behave like real TPU VMs beyond SSH: users with passwordless sudo,
a GCE metadata server per worker (whose tokens the API accepts), startup scripts, maintenance and
preemption notices, their own uptime. Driven through real clients: ssh + curl on the workers,
the official Python client, gcloud, JAX."""

from __future__ import annotations

import concurrent.futures
import json
import os
import shlex
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from helpers import Follower, metadata_keys, ssh_run, tpufab, wait_for, wait_node_state

pytestmark = pytest.mark.sim

MD = "http://metadata.google.internal/computeMetadata/v1"
FLAVOR = "-H 'Metadata-Flavor: Google'"


def keys_for(ssh_key, *users: str) -> str:
    return "\n".join(metadata_keys(u, ssh_key) for u in users)


def on(node, worker: int, ssh_key, command: str, user: str = "alice") -> str:
    """Run a command on a worker over real ssh; fail the test with its stderr if it fails."""
    done = ssh_run(node.network_endpoints[worker].ip_address, ssh_key, user, command, timeout=60)
    assert done.returncode == 0, f"w{worker} {command!r}: {done.returncode} {done.stderr}"
    return done.stdout


def metadata(node, worker: int, ssh_key, path: str) -> str:
    return on(node, worker, ssh_key, f"curl -sf {FLAVOR} {shlex.quote(MD + '/' + path)}")


# --- accounts --------------------------------------------------------------------------------


def test_metadata_users_get_passwordless_sudo_and_root_login_still_works(make_node, ssh_key):
    node = make_node("v4-8", metadata={"ssh-keys": keys_for(ssh_key, "alice", "root")})
    out = on(node, 0, ssh_key, "id -un; id -Gn; sudo -n id -un; sudo -n touch /etc/alice-was-here"
             " && ls /etc/alice-was-here")
    user, groups, sudo_user, touched = out.split("\n")[:4]
    assert user == "alice" and "google-sudoers" in groups.split()
    assert sudo_user == "root" and touched == "/etc/alice-was-here"
    assert on(node, 0, ssh_key, "id -u", user="root").strip() == "0"
    # a user only sudo knows nothing about (not from metadata) gets no sudo
    out = on(node, 0, ssh_key, "sudo -n useradd -m bob && sudo -n -u bob sudo -n true; echo $?")
    assert out.strip().splitlines()[-1] == "1"


def test_workers_report_their_own_uptime(make_node, ssh_key):
    before = time.monotonic()
    node = make_node("v4-8", metadata={"ssh-keys": keys_for(ssh_key, "alice")})
    uptime = float(on(node, 0, ssh_key, "cat /proc/uptime").split()[0])
    host_uptime = float(Path("/proc/uptime").read_text().split()[0])
    assert uptime <= time.monotonic() - before + 1.0 < host_uptime
    assert "up 0 min" in on(node, 0, ssh_key, "uptime") or uptime >= 60


# --- the metadata server ---------------------------------------------------------------------


def test_metadata_server_answers_each_worker_with_its_own_values(make_node, ssh_key):
    keys = keys_for(ssh_key, "alice")
    node = make_node("v4-32", metadata={"ssh-keys": keys, "team": "ml"})
    ips = [e.ip_address for e in node.network_endpoints]
    for w in (0, 3):
        assert metadata(node, w, ssh_key, "instance/attributes/agent-worker-number") == str(w)
        env = metadata(node, w, ssh_key, "instance/attributes/tpu-env")
        assert f"WORKER_ID: '{w}'" in env.splitlines()
        assert "ACCELERATOR_TYPE: 'v4-32'" in env.splitlines()
    endpoints = metadata(node, 1, ssh_key, "instance/attributes/worker-network-endpoints")
    assert [e.split(":")[2] for e in endpoints.split(",")] == ips
    assert metadata(node, 1, ssh_key, "instance/attributes/accelerator-type") == "v4-32"
    assert metadata(node, 1, ssh_key, "instance/attributes/team") == "ml"
    assert metadata(node, 1, ssh_key, "instance/attributes/ssh-keys") == keys
    assert metadata(node, 1, ssh_key, "instance/preempted") == "FALSE"
    assert metadata(node, 1, ssh_key, "instance/maintenance-event") == "NONE"
    listing = metadata(node, 1, ssh_key, "instance/").split()
    assert {"attributes/", "service-accounts/", "preempted", "hostname"} <= set(listing)
    # The header is required, as on GCE; the answer names its flavor.
    out = on(node, 1, ssh_key, f"curl -s -i {MD}/instance/preempted")
    assert out.startswith("HTTP/1.1 403") and "Metadata-Flavor: Google" in out
    # `metadata.google.internal` is the worker's own /etc/hosts entry, as GCE images have it
    assert on(node, 2, ssh_key, "getent hosts metadata.google.internal").split()[0] == ips[2]


def test_service_account_token_is_accepted_by_the_api(make_node, ssh_key, sim, tpu_client):
    from google.api_core import exceptions as gexc
    from google.api_core.client_options import ClientOptions
    from google.auth.exceptions import RefreshError
    from google.cloud import tpu_v2
    from google.oauth2.credentials import Credentials

    node = make_node("v4-8", metadata={"ssh-keys": keys_for(ssh_key, "alice")})
    token = json.loads(metadata(node, 0, ssh_key, "instance/service-accounts/default/token"))
    assert token["token_type"] == "Bearer" and 0 < token["expires_in"] <= 3600
    account = json.loads(metadata(node, 0, ssh_key,
                                  "instance/service-accounts/default/?recursive=true"))
    assert account["email"].endswith("@developer.gserviceaccount.com")

    def client(access_token: str):
        return tpu_v2.TpuClient(credentials=Credentials(access_token), transport="rest",
                                client_options=ClientOptions(api_endpoint=sim.endpoint))

    assert client(token["access_token"]).get_node(name=node.name).state.name == "READY"
    # A token the pod never issued: 401 UNAUTHENTICATED (google-auth then tries to refresh
    # its static token and gives up).
    with pytest.raises((gexc.Unauthenticated, RefreshError)):
        client("ya29.not-issued-here").get_node(name=node.name)
    request = urllib.request.Request(f"{sim.endpoint}/v2/{node.name}",
                                     headers={"Authorization": "Bearer ya29.not-issued-here"})
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=30)
    assert refused.value.code == 401
    assert json.loads(refused.value.read())["error"]["status"] == "UNAUTHENTICATED"


def test_jax_distributed_initialize_without_arguments_forms_one_job(make_node, ssh_key, sim):
    """A program written for a real pod, unchanged: jax.distributed.initialize() finds the pod
    through the metadata server (JAX_PLATFORMS=cpu because there is no TPU; JAX_FORCE_TPU_INIT
    because there is no libtpu)."""
    from helpers import build_shared_site

    build_shared_site([Path(sim.state_dir) / "share"])
    node = make_node("v4-32", metadata={"ssh-keys": keys_for(ssh_key, "alice")})
    program = (
        "import json, jax, numpy as np\n"
        "from jax.experimental import multihost_utils\n"
        "jax.config.update('jax_cpu_collectives_implementation', 'gloo')\n"
        "jax.distributed.initialize(initialization_timeout=120)\n"
        "ids = multihost_utils.process_allgather(np.array([jax.process_index()]))\n"
        "print(json.dumps({'me': jax.process_index(), 'count': jax.process_count(),\n"
        "                  'ids': [int(x) for x in np.asarray(ids).reshape(-1)]}))\n"
        "jax.distributed.shutdown()\n")
    command = ("PYTHONPATH=/opt/tpufab-sim/share/site JAX_PLATFORMS=cpu JAX_FORCE_TPU_INIT=1 "
               f"timeout 300 python3 -c {shlex.quote(program)}")
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        outs = list(pool.map(lambda w: ssh_run(node.network_endpoints[w].ip_address, ssh_key,
                                               "alice", command, timeout=320), range(4)))
    results = []
    for w, out in enumerate(outs):
        assert out.returncode == 0, f"w{w}: {out.stderr[-2000:]}"
        results.append(json.loads(out.stdout.strip().splitlines()[-1]))
    assert [r["me"] for r in results] == [0, 1, 2, 3]
    assert all(r["count"] == 4 and r["ids"] == [0, 1, 2, 3] for r in results)


# --- startup scripts -------------------------------------------------------------------------


STARTUP = "#!/bin/bash\necho started on $(hostname) as $(id -un)\nexit 3\n"


def startup_status(client, name: str) -> list[str]:
    answer = client.get_guest_attributes(request={"name": name,
                                                  "query_path": "startup-script/"})
    return [item.value for attrs in answer.guest_attributes
            for item in attrs.query_value.items]


def test_startup_script_runs_as_root_on_every_worker_at_create_and_after_start(
        make_node, ssh_key, tpu_client):
    node = make_node("v4-16", metadata={"ssh-keys": keys_for(ssh_key, "alice"),
                                        "startup-script": STARTUP})
    wait_for(lambda: startup_status(tpu_client, node.name) == ["exit 3", "exit 3"], 60,
             what="the startup script's exit status in guest attributes")
    log = on(node, 1, ssh_key, "cat /var/log/google-startup-scripts.log")
    hostname = on(node, 1, ssh_key, "hostname").strip()
    assert f"startup-script: started on {hostname} as root" in log
    assert "startup-script exit status 3" in log
    assert log.count("Finished running startup scripts.") == 1

    tpu_client.stop_node(request={"name": node.name}).result(timeout=60)
    tpu_client.start_node(request={"name": node.name}).result(timeout=60)
    wait_for(lambda: on(node, 0, ssh_key, "cat /var/log/google-startup-scripts.log").count(
        "Finished running startup scripts.") == 2, 60, what="the startup script after start")


# --- notices ---------------------------------------------------------------------------------


def test_preemption_notice_reaches_the_metadata_server_before_the_preemption(
        make_node, ssh_key, sim_admin, tpu_client):
    node = make_node("v4-8", metadata={"ssh-keys": keys_for(ssh_key, "alice")})
    ip = node.network_endpoints[0].ip_address
    # A job's watcher blocks on the metadata server, as real checkpointing code does: it
    # reads the value's ETag, then waits for a change from it.
    watch = (f"etag=$(curl -sf -D - -o /dev/null {FLAVOR} {MD}/instance/preempted "
             "| tr -d '\\r' | sed -n 's/^ETag: //Ip'); echo ready $etag; "
             f"curl -sf {FLAVOR} \"{MD}/instance/preempted?wait_for_change=true&last_etag=$etag"
             "&timeout_sec=60\"; echo; date +%s.%N")
    watcher = subprocess.Popen(
        ["ssh", "-i", str(ssh_key.path), "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=no",
         "-o", "UserKnownHostsFile=/dev/null", "-o", "LogLevel=ERROR", f"alice@{ip}", watch],
        stdout=subprocess.PIPE, text=True)
    ready = watcher.stdout.readline().split()
    assert ready[0] == "ready" and len(ready) == 2, ready
    given = time.time()
    sim_admin.preempt(node.name, notice=3)
    out, _ = watcher.communicate(timeout=60)
    value, seen_at = out.split()
    assert value == "TRUE" and float(seen_at) - given < 2.5
    assert metadata(node, 0, ssh_key, "instance/maintenance-event") == "NONE"  # not maintenance
    assert tpu_client.get_node(name=node.name).state.name == "READY"  # not yet
    wait_node_state(tpu_client, node.name, "PREEMPTED", timeout=30)
    assert time.time() - given >= 3


@pytest.mark.gcloud
def test_gcloud_simulate_maintenance_event_and_locations_list(make_node, ssh_key, sim_admin,
                                                              gcloud_env):
    sim_admin.settings(maintenance_notice=15.0)
    node = make_node("v4-16", metadata={"ssh-keys": keys_for(ssh_key, "alice")})
    name = node.name.rsplit("/", 1)[1]
    done = subprocess.run(["gcloud", "alpha", "compute", "tpus", "tpu-vm",
                           "simulate-maintenance-event", name, "--workers=1"],
                          env=gcloud_env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert metadata(node, 1, ssh_key, "instance/maintenance-event") == \
        "TERMINATE_ON_HOST_MAINTENANCE"
    assert metadata(node, 0, ssh_key, "instance/maintenance-event") == "NONE"
    wait_for(lambda: metadata(node, 1, ssh_key, "instance/maintenance-event") == "NONE", 60,
             what="the maintenance event to end")

    listed = subprocess.run(["gcloud", "compute", "tpus", "locations", "list",
                             "--format=value(locationId)"], env=gcloud_env,
                            capture_output=True, text=True, timeout=120)
    assert listed.returncode == 0, listed.stderr
    assert "us-central2-b" in listed.stdout.split()


# --- tpufab relays a notice to the running job --------------------------------------------------

CHECKPOINTING = """#!/bin/bash
trap 'echo "checkpointing: $(cat "$TPUFAB_PREEMPT_NOTICE")"; exit 0' TERM
echo started
while true; do sleep 0.1; done
"""


def test_a_running_job_gets_sigterm_and_the_reason_when_its_node_is_preempted(
        sim, sim_admin, tpu_client, tmp_path):
    """`tpufab run` as a user runs it; `sim preempt --notice` (the verb) gives the notice."""
    from helpers import TPUFAB
    from rich.console import Console

    from tpufab.cloud import lifecycle
    from tpufab.config import load_settings

    name = f"notice-{int(time.time() * 1000) % 10**8}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("TPUFAB_")}
    env.update(sim.env(), TPUFAB_USER_CONFIG=str(tmp_path / "none.yaml"),
               TPUFAB_SSH_KEY=str(tmp_path / "key" / "tpufab_ed25519"),
               TPUFAB_KNOWN_HOSTS=str(tmp_path / "known_hosts"), TPUFAB_NAME=name,
               COLUMNS="200")
    quiet = Console(file=open("/dev/null", "w"))  # noqa: SIM115
    lifecycle.create(load_settings({"type": "v4-16"}, env=env, cwd=tmp_path), console=quiet)
    try:
        recipe = tmp_path / "checkpointing.sh"
        recipe.write_text(CHECKPOINTING)
        recipe.chmod(0o755)
        follower = Follower(env, tmp_path, recipe=str(recipe), no_deploy=True, raw=True)
        follower.wait_lines("started", 2)
        preempt = subprocess.run([TPUFAB, "sim", "preempt", name, "--notice", "2s"],
                                 env=env, cwd=tmp_path, capture_output=True, text=True,
                                 timeout=120)
        assert preempt.returncode == 0, preempt.stdout + preempt.stderr
        assert "Preemption notice given to" in preempt.stdout
        assert f"Preempted TPU node {name}" in preempt.stdout
        assert follower.finish(120) == 0, follower.err
        for w in (0, 1):
            assert f"w{w} │ checkpointing: preempted: the VM is being preempted " \
                   "(instance/preempted=TRUE)" in follower.out, follower.out
            assert any(line.startswith(f"w{w} │ tpufab: notice: preempted") and
                       "sent SIGTERM to the recipe" in line for line in follower.out)
        node = tpu_client.get_node(name=f"projects/{sim.project}/locations/{sim.zone}/nodes/"
                                   f"{name}")
        assert node.state.name == "PREEMPTED"
    finally:
        lifecycle.delete(load_settings(env=env, cwd=tmp_path), yes=True, console=quiet)


# --- legacy TPU Nodes (API v1) ---------------------------------------------------------------


@pytest.mark.gcloud
def test_a_legacy_tpu_node_from_gcloud_is_listed_refused_and_deleted_by_tpufab(sim, gcloud_env,
                                                                              tmp_path):
    """gcloud compute tpus create|describe|list (API v1); tpufab lists it, says it has no
    workers to SSH into, and deletes it (API v2 sees nodes the v1 API made: apiVersion V1)."""
    name = f"legacy-{int(time.time() * 1000) % 10**8}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("TPUFAB_")}
    env.update(sim.env(), HOME=str(tmp_path), TPUFAB_USER_CONFIG=str(tmp_path / "none.yaml"),
               COLUMNS="200")

    def gcloud(*args: str) -> str:
        done = subprocess.run(["gcloud", "compute", "tpus", *args], env=gcloud_env,
                              capture_output=True, text=True, timeout=180)
        assert done.returncode == 0, done.stderr
        return done.stdout

    gcloud("create", name, "--accelerator-type=v2-8", "--version=2.12.0", "--network=default",
           "--range=10.240.8.0/29")
    described = json.loads(gcloud("describe", name, "--format=json"))
    assert described["state"] == "READY" and described["acceleratorType"] == "v2-8"
    assert described["networkEndpoints"] == [{"ipAddress": "10.240.8.1", "port": 8470}]
    assert name in gcloud("list", "--format=value(name)").split()

    listed = tpufab("list", env=env, cwd=tmp_path)
    assert listed.returncode == 0 and name in listed.stdout, listed.stdout + listed.stderr
    refused = tpufab("exec", "--name", name, "hostname", env=env, cwd=tmp_path)
    assert refused.returncode != 0
    assert f"TPU node {name} is a legacy TPU Node (API v1): it has no workers to SSH into" in \
        " ".join(refused.stderr.split()), refused.stderr
    deleted = tpufab("delete", "--name", name, "--yes", env=env, cwd=tmp_path)
    assert deleted.returncode == 0, deleted.stdout + deleted.stderr
    assert name not in gcloud("list", "--format=value(name)").split()
