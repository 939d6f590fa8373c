"""Worker verbs on a Compute Engine TPU7x slice (a MIG of 2 VMs): a JAX recipe whose
jax.process_count() is the VM count, status naming the plane, kill; and a slice made by hand
with gcloud (workload policy + template + MIG) adopted with `tpufab use` and reached."""

from __future__ import annotations

import json
import subprocess

import pytest
from harness import connected_pod
from helpers import REPO, call, cli_env, ok, tpufab, unique_name

from tpufab.cloud import planes

pytestmark = [pytest.mark.sim, pytest.mark.timeout(900)]  # a loaded 2-core machine


@pytest.fixture(scope="module")
def ce_pod(sim, tmp_path_factory):
    """A tpu7x-16 (2 VMs) on the simulated Compute Engine, with JAX set up."""
    with connected_pod(sim, tmp_path_factory, "cew", type="tpu7x-16", site="jax",
                       setup=True) as pod:
        assert pod.pod.node.plane == "compute" and len(pod.pod.node.workers) == 2
        yield pod


def test_jax_recipe_sees_one_process_per_vm(ce_pod, tmp_path):
    result = call(ce_pod.env, "run", cwd=tmp_path, recipe=str(REPO / "recipes" / "jax_hello.sh"),
                  no_deploy=True, raw=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    for w in range(2):  # jax.process_count() == 2 == the MIG's VMs
        assert f"w{w} │ jax_hello: all-gather of process ids = [0, 1]" in result.stdout
        assert f"w{w} │ jax_hello: OK" in result.stdout


def _ip_key(ip):
    return [int(part) for part in ip.split(".")]


def test_every_vm_gets_the_slices_tpu_environment_in_a_stable_order(ce_pod, tmp_path):
    """The run path sets TPU_NAME, TPU_WORKER_ID, TPU_WORKER_HOSTNAMES, TPU_ACCELERATOR_TYPE and
    TPU_TOPOLOGY itself (a Compute Engine guest's metadata need not carry them); the workers
    are the MIG's VMs in order of internal IP, the same on every list."""

    control = planes.control_plane(ce_pod.settings)
    name = ce_pod.pod.node.name
    orders = [[w.internal_ip for w in control.get_node(name).workers] for _ in range(2)]
    orders += [[w.internal_ip for w in n.workers] for n in control.list_nodes()
               if n.name == name]
    assert len(orders) == 3 and orders[0] == orders[1] == orders[2], orders
    ips = orders[0]
    assert ips == sorted(ips, key=_ip_key) and len(set(ips)) == 2
    recipe = tmp_path / "tpu_env.sh"
    recipe.write_text('#!/bin/bash\necho "tpuenv $TPU_NAME $TPU_WORKER_ID $TPU_WORKER_HOSTNAMES '
                      '$TPU_ACCELERATOR_TYPE $TPU_TOPOLOGY ip=$(curl -sf -H Metadata-Flavor:Google '
                      'http://metadata.google.internal/computeMetadata/v1/instance/'
                      'network-interfaces/0/ip)"\n')  # the VM's own IP, as its guest says
    result = call(ce_pod.env, "run", cwd=tmp_path, recipe=str(recipe), no_deploy=True, raw=True,
                  timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    for w in range(2):  # each VM: its own index, and it is the VM with that IP
        assert f"w{w} │ tpuenv {name} {w} {','.join(ips)} tpu7x-16 2x2x2 ip={ips[w]}" \
            in result.stdout, result.stdout


def test_status_names_the_plane_and_kill_frees_the_tpu(ce_pod, tmp_path):
    status = call(ce_pod.env, "status", cwd=tmp_path)
    assert status.returncode == 0, status.stdout + status.stderr
    assert "tpu7x-16" in status.stdout and "on Compute Engine (STANDARD)" in status.stdout
    made = call(ce_pod.env, "sim_zombie", cwd=tmp_path, worker="1")
    assert made.returncode == 0, made.stdout + made.stderr
    killed = call(ce_pod.env, "kill", cwd=tmp_path, grace=1)
    lines = [" ".join(line.split()) for line in killed.stdout.splitlines()]
    assert any(line.startswith("w1 killed") for line in lines), killed.stdout
    assert "w0 nothing to kill" in lines, killed.stdout


def test_a_slice_made_with_gcloud_is_adopted_and_reached(sim, gcloud_env, tmp_path):
    def gcloud(*args):
        result = subprocess.run(["gcloud", "compute", *args], env=gcloud_env, text=True,
                                capture_output=True, timeout=180, stdin=subprocess.DEVNULL)
        assert result.returncode == 0, result.stderr
        return result.stdout

    region = sim.zone.rsplit("-", 1)[0]
    name, policy, template = unique_name("hand"), unique_name("wp"), unique_name("tt")
    gcloud("resource-policies", "create", "workload-policy", policy, "--type=HIGH_THROUGHPUT",
           "--accelerator-topology=2x2x2", f"--region={region}")
    gcloud("instance-templates", "create", template, "--machine-type=tpu7x-standard-4t")
    gcloud("instance-groups", "managed", "create", name, "--size=2", f"--template={template}",
           f"--workload-policy=projects/{sim.project}/regions/{region}/resourcePolicies/"
           f"{policy}")
    vms = json.loads(gcloud("instances", "list", "--format=json"))
    mine = sorted((v for v in vms if v["name"].startswith(f"{name}-")),
                  key=lambda v: [int(p) for p in v["networkInterfaces"][0]["networkIP"]
                                 .split(".")])
    env = cli_env(sim, tmp_path)
    used = ok(tpufab("use", name, env=env, cwd=tmp_path))
    assert f"{name} (Compute Engine) is now this project's current pod" in used
    out = ok(tpufab("exec", "--", "hostname", env=env, cwd=tmp_path))  # its key added first
    seen = {line.split(" │ ")[0].strip(): line.split(" │ ")[1].strip()
            for line in out.splitlines() if " │ " in line}
    assert seen == {"w0": mine[0]["name"], "w1": mine[1]["name"]}
    deleted = ok(tpufab("delete", "--yes", env=env, cwd=tmp_path))
    assert "Left alone: " in deleted and "not made by tpufab" in deleted  # the user's own
    gcloud("instance-templates", "delete", template, "--quiet")
    gcloud("resource-policies", "delete", policy, f"--region={region}", "--quiet")
