"""tpufab on Compute Engine (the ComputeEngine control plane): TPU7x created as one VM or as
a workload policy + instance template + MIG, seen by the official google-cloud-compute
client, listed beside TPU API nodes, reached by worker verbs, deleted with what tpufab made
(and only that); bad input is one sentence."""

from __future__ import annotations

import json
import shlex

import pytest
from helpers import (
    call,
    cli_env,
    compute_clients,
    ok,
    one_sentence,
    tpufab,
    unique_name,
    wait_for,
)

pytestmark = [pytest.mark.sim, pytest.mark.timeout(900)]  # a loaded 2-core machine


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    return tmp_path_factory.mktemp("compute-home")


@pytest.fixture(scope="module")
def env(sim, home):
    return cli_env(sim, home)


@pytest.fixture(scope="module")
def compute(sim):
    return compute_clients(sim)


def _created(env, home, name, *flags):
    ok(tpufab("create", "--name", name, *flags, env=env, cwd=home))
    return name


@pytest.fixture(scope="module")
def single(env, home):
    name = _created(env, home, unique_name("c1"), "--type", "tpu7x-8", "--spot")
    yield name
    tpufab("delete", "--name", name, "--yes", env=env, cwd=home)


@pytest.fixture(scope="module")
def sliced(env, home):
    name = _created(env, home, unique_name("c2"), "--type", "tpu7x-16")
    yield name
    tpufab("delete", "--name", name, "--yes", env=env, cwd=home)


def test_one_vm_spot_is_an_instance_listed_described_and_reached(single, env, home, compute):
    inst = compute.instances.get(project=compute.project, zone=compute.zone, instance=single)
    assert inst.status == "RUNNING" and inst.scheduling.provisioning_model == "SPOT"
    assert inst.machine_type.endswith("/tpu7x-standard-4t") and inst.labels["tpufab"] == "yes"
    keys = {i.key: i.value for i in inst.metadata.items}
    assert "ssh-ed25519" in keys["ssh-keys"]  # tpufab's key, for its SSH
    listed = ok(tpufab("list", env=env, cwd=home))
    row = next(line for line in listed.splitlines() if line.startswith(single + " "))
    assert "tpu7x-8" in row and "Compute Engine" in row and "yes" in row
    described = json.loads(ok(tpufab("describe", "--name", single, "--json", env=env,
                                     cwd=home)))
    assert described["control_plane"] == "compute" and described["hosts"] == 1
    assert described["provisioning_model"] == "SPOT"
    out = ok(tpufab("exec", "--name", single, "--", "hostname", env=env, cwd=home))
    assert out.strip().endswith(single)  # the VM answers as its instance name


def test_multi_host_slice_is_a_mig_with_workload_policy_in_worker_order(sliced, env, home,
                                                                         compute):
    mig = compute.groups.get(project=compute.project, zone=compute.zone,
                             instance_group_manager=sliced)
    assert mig.target_size == 2
    policy = compute.policies.get(project=compute.project, region=compute.region,
                                  resource_policy=f"{sliced}-tpufab-wp")
    assert policy.workload_policy.type_ == "HIGH_THROUGHPUT"
    assert policy.workload_policy.accelerator_topology == "2x2x2"
    assert mig.resource_policies.workload_policy.endswith(f"/{sliced}-tpufab-wp")
    template = compute.templates.get(project=compute.project,
                                     instance_template=f"{sliced}-tpufab-tt")
    assert template.properties.machine_type == "tpu7x-standard-4t"
    members = list(compute.groups.list_managed_instances(
        project=compute.project, zone=compute.zone, instance_group_manager=sliced))
    vms = [compute.instances.get(project=compute.project, zone=compute.zone,
                                 instance=m.name) for m in members]
    assert {v.status for v in vms} == {"RUNNING"}
    # workers are numbered as the slice numbers them (the sim: address order)
    order = [v.name for v in sorted(vms, key=lambda v: [
        int(p) for p in v.network_interfaces[0].network_i_p.split(".")])]
    out = ok(tpufab("exec", "--name", sliced, "--", "hostname", env=env, cwd=home))
    seen = dict(line.split(" │ ") for line in out.splitlines() if " │ " in line)
    assert {seen["w0"].strip(), seen["w1"].strip()} == set(order)
    assert seen["w0"].strip() == order[0] and seen["w1"].strip() == order[1]
    described = json.loads(ok(tpufab("describe", "--name", sliced, "--json", env=env,
                                     cwd=home)))
    assert described["instance_group"] == sliced and described["chip_topology"] == "2x2x2"
    assert described["workload_policy"] == f"{sliced}-tpufab-wp"


def _workers_say(env, home, name):
    """{worker: (hostname, the worker number its own metadata server says)} via `exec`."""
    out = ok(tpufab("exec", "--name", name, "--", "echo $(hostname) $(curl -sf -H "
                    "Metadata-Flavor:Google http://metadata.google.internal/computeMetadata/"
                    "v1/instance/attributes/agent-worker-number)", env=env, cwd=home))
    return {w.strip(): tuple(said.split()) for w, said in
            (line.split(" │ ") for line in out.splitlines() if " │ " in line)}


def _pinned(home, host_alias):
    lines = (home / "known_hosts").read_text().splitlines()
    return [line.split()[2] for line in lines if line.split()[0] == host_alias]


def test_a_vm_the_mig_recreates_keeps_its_worker_number_and_its_new_key_is_pinned(
        sliced, env, home, compute):
    """The MIG recreates the slice's worker 0 (instanceGroupManagers.recreateInstances,
    through the official client): it comes back under its name with a new instance id, boot
    disk and host key, at an internal IP that now sorts after worker 1's. tpufab still
    numbers the workers as the slice does (each VM's own agent-worker-number), describe
    agrees, and verbs reach the new VM with its new key, pinned from its guest attributes
    under the new VM's id, never the old VM's key."""
    before = _workers_say(env, home, sliced)
    assert [before["w0"][1], before["w1"][1]] == ["0", "1"], before
    vm, other = before["w0"][0], before["w1"][0]

    def get(instance):
        return compute.instances.get(project=compute.project, zone=compute.zone,
                                     instance=instance)

    old, peer = get(vm), get(other)
    group_id = str(compute.groups.get(project=compute.project, zone=compute.zone,
                                      instance_group_manager=sliced).id)
    pinned_before = {line.split()[2] for line in
                     (home / "known_hosts").read_text().splitlines()}
    compute.wait(compute.groups.recreate_instances_unary(
        project=compute.project, zone=compute.zone, instance_group_manager=sliced,
        instance_group_managers_recreate_instances_request_resource=(
            compute.v1.InstanceGroupManagersRecreateInstancesRequest(
                instances=[f"zones/{compute.zone}/instances/{vm}"]))))

    def settled():
        managed = list(compute.groups.list_managed_instances(
            project=compute.project, zone=compute.zone, instance_group_manager=sliced))
        return all(m.instance_status == "RUNNING" and m.current_action == "NONE"
                   for m in managed) and len(managed) == 2

    wait_for(settled, timeout=120, interval=0.5, what=f"{vm} recreated and RUNNING")
    new = get(vm)
    ip = new.network_interfaces[0].network_i_p
    assert new.id != old.id and ip != old.network_interfaces[0].network_i_p
    assert [int(p) for p in ip.split(".")] > \
        [int(p) for p in peer.network_interfaces[0].network_i_p.split(".")]  # IP order: last

    after = _workers_say(env, home, sliced)  # no stale key in the way: it just works
    assert after == {"w0": (vm, "0"), "w1": (other, "1")}, after
    described = json.loads(ok(tpufab("describe", "--name", sliced, "--json", env=env,
                                     cwd=home)))
    assert [w["internal_ip"] for w in described["workers"]] == \
        [ip, peer.network_interfaces[0].network_i_p]
    offered = compute.instances.get_guest_attributes(request={
        "project": compute.project, "zone": compute.zone, "instance": vm,
        "query_path": "hostkeys/"})
    new_key = next(i.value.split()[-1] for i in offered.query_value.items
                   if i.key == "ssh-ed25519")
    assert _pinned(home, f"tpufab-{group_id}-vm{new.id}") == [new_key]
    assert new_key not in pinned_before  # a new disk, a new key: no old key is the new VM's


JAX_PROGRAM = (
    "import json, os, jax, numpy as np\n"
    "from jax.experimental import multihost_utils\n"
    "jax.config.update('jax_cpu_collectives_implementation', 'gloo')\n"
    "jax.distributed.initialize(initialization_timeout=120)\n"
    "ids = multihost_utils.process_allgather(np.array([jax.process_index()]))\n"
    "print('jax', json.dumps({'me': jax.process_index(), 'count': jax.process_count(),\n"
    "      'ids': [int(x) for x in np.asarray(ids).reshape(-1)],\n"
    "      'tpufab': os.environ.get('TPUFAB_WORKER_ID'),\n"
    "      'gke': 'TPU_WORKER_HOSTNAMES' in os.environ}))\n"
    "jax.distributed.shutdown()\n")


def _jax_said(out: str) -> dict[str, dict]:
    return {line.split(" │ ")[0].strip(): json.loads(line.split(" │ jax ", 1)[1])
            for line in out.splitlines() if " │ jax " in line}


def test_the_slices_guest_is_compute_engines_and_jax_numbers_its_workers_as_tpufab(
        sliced, env, home, sim, tmp_path):
    """A MIG slice's VMs serve what Compute Engine TPU VMs serve (worker-network-endpoints a
    bare list of the VMs' names in worker order; tpu-env's TOPOLOGY, TPU_WORKER_ID,
    CHIPS_PER_HOST_BOUNDS), and JAX's own discovery agrees with tpufab's numbering, after the
    MIG recreated worker 0 elsewhere: through the metadata server (`exec`, no TPU_* set:
    GceTpuCluster, the coordinator found by name) and through tpufab's job environment
    (`run`: TPU_WORKER_ID and TPU_WORKER_HOSTNAMES, GkeTpuCluster)."""
    from pathlib import Path

    from helpers import build_shared_site

    build_shared_site([Path(sim.state_dir) / "share"])
    md = "curl -sf -H Metadata-Flavor:Google http://metadata.google.internal/computeMetadata/" \
        "v1/instance/attributes/"
    out = ok(tpufab("exec", "--name", sliced, "--", f"echo $(hostname) $({md}worker-network-"
                    f"endpoints) $({md}tpu-env | tr '\\n' ' ')", env=env, cwd=home))
    said = {w.strip(): text.split() for w, text in
            (line.split(" │ ") for line in out.splitlines() if " │ " in line)}
    names = [said["w0"][0], said["w1"][0]]
    for w in (0, 1):
        assert said[f"w{w}"][1] == ",".join(names), said  # bare names, in worker order
        assert " ".join(said[f"w{w}"][2:]) == (
            f"ACCELERATOR_TYPE: 'tpu7x-16' CHIPS_PER_HOST_BOUNDS: '2,2,1' TOPOLOGY: '2x2x2' "
            f"TPU_WORKER_ID: '{w}'"), said
    command = ("PYTHONPATH=/opt/tpufab-sim/share/site JAX_PLATFORMS=cpu JAX_FORCE_TPU_INIT=1 "
               f"timeout 300 python3 -c {shlex.quote(JAX_PROGRAM)}")
    found = _jax_said(ok(tpufab("exec", "--name", sliced, "--timeout", "320", "--", command,
                                env=env, cwd=home, timeout=360)))
    assert {w: (r["me"], r["count"], r["ids"], r["gke"]) for w, r in found.items()} == {
        "w0": (0, 2, [0, 1], False), "w1": (1, 2, [0, 1], False)}, found
    recipe = tmp_path / "jax_job.sh"
    recipe.write_text("#!/bin/bash\nexport PYTHONPATH=/opt/tpufab-sim/share/site "
                      "JAX_PLATFORMS=cpu JAX_FORCE_TPU_INIT=1\n"
                      f"exec timeout 300 python3 -c {shlex.quote(JAX_PROGRAM)}\n")
    ran = call({**env, "TPUFAB_NAME": sliced}, "run", cwd=home, recipe=str(recipe),
               no_deploy=True, raw=True, timeout=400)
    assert ran.returncode == 0, ran.stdout + ran.stderr
    found = _jax_said(ran.stdout)
    assert {w: (r["me"], r["tpufab"], r["gke"]) for w, r in found.items()} == {
        "w0": (0, "0", True), "w1": (1, "1", True)}, found


def test_delete_takes_the_mig_and_what_tpufab_made_never_what_others_use(sliced, env, home,
                                                                         compute):
    v1 = compute.v1
    other = unique_name("other")  # a size-0 group of someone else's using tpufab's template
    compute.wait(compute.groups.insert_unary(
        project=compute.project, zone=compute.zone,
        instance_group_manager_resource=v1.InstanceGroupManager(
            name=other, target_size=0,
            instance_template=f"global/instanceTemplates/{sliced}-tpufab-tt")))
    out = ok(tpufab("delete", "--name", sliced, "--yes", env=env, cwd=home))
    assert f"workload policy {sliced}-tpufab-wp" in out
    assert f"Left alone: instance template {sliced}-tpufab-tt" in out
    from google.api_core import exceptions as gexc

    with pytest.raises(gexc.NotFound):
        compute.groups.get(project=compute.project, zone=compute.zone,
                           instance_group_manager=sliced)
    with pytest.raises(gexc.NotFound):
        compute.policies.get(project=compute.project, region=compute.region,
                             resource_policy=f"{sliced}-tpufab-wp")
    assert compute.templates.get(project=compute.project,
                                 instance_template=f"{sliced}-tpufab-tt").name
    compute.wait(compute.groups.delete_unary(project=compute.project, zone=compute.zone,
                                             instance_group_manager=other))
    compute.templates.delete_unary(project=compute.project,
                                   instance_template=f"{sliced}-tpufab-tt")


def test_flex_start_and_reservation_reach_the_instance(env, home, compute):
    name = _created(env, home, unique_name("cf"), "--type", "tpu7x-8", "--flex-start",
                    "--max-run-duration", "8h", "--async")
    inst = compute.instances.get(project=compute.project, zone=compute.zone, instance=name)
    assert inst.scheduling.provisioning_model == "FLEX_START"
    assert inst.scheduling.max_run_duration.seconds == 8 * 3600
    ok(tpufab("delete", "--name", name, "--yes", env=env, cwd=home))
    v1 = compute.v1
    reservation = unique_name("res")
    compute.wait(compute.reservations.insert_unary(
        project=compute.project, zone=compute.zone, reservation_resource=v1.Reservation(
            name=reservation, specific_reservation_required=True,
            specific_reservation=v1.AllocationSpecificSKUReservation(
                count=1, instance_properties=v1.AllocationSpecificSKUAllocationReservedInstanceProperties(
                    machine_type="tpu7x-standard-4t")))))
    name = _created(env, home, unique_name("cr"), "--type", "tpu7x-8", "--reservation",
                    reservation, "--async")
    inst = compute.instances.get(project=compute.project, zone=compute.zone, instance=name)
    assert inst.reservation_affinity.consume_reservation_type == "SPECIFIC_RESERVATION"
    assert list(inst.reservation_affinity.values) == [reservation]
    ok(tpufab("delete", "--name", name, "--yes", env=env, cwd=home))


def test_bad_input_is_one_sentence(env, home):
    def create(*flags):
        return tpufab("create", "--name", unique_name("bad"), *flags, env=env, cwd=home)

    one_sentence(create("--type", "tpu7x-8", "--flex-start"), "--max-run-duration")
    one_sentence(create("--type", "tpu7x-12"), "Unknown TPU accelerator type", "tpu7x-16")
    one_sentence(create("--type", "tpu7x-32", "--topology", "2x2x3"), "2x2x4")
    one_sentence(create("--type", "tpu7x-8", "--reservation", "no-such-res"),
                 "No reservation named 'no-such-res'", progress=1)
    one_sentence(create("--type", "v4-8", "--on", "compute"), "not offered on Compute Engine")
    one_sentence(create("--type", "tpu7x-8", "--spot", "--flex-start",
                        "--max-run-duration", "1h"), "cannot be combined")


def test_a_name_on_both_planes_is_one_sentence(single, env, home, make_node):
    make_node("v4-8", node_id=single)  # the same name in the Cloud TPU API
    result = tpufab("describe", "--name", single, env=env, cwd=home)
    one_sentence(result, "both a Cloud TPU API node and a Compute Engine TPU slice",
                 "TPUFAB_CONTROL_PLANE")
    picked = json.loads(ok(tpufab("describe", "--name", single, "--json", env=env, cwd=home,
                                  extra_env={"TPUFAB_CONTROL_PLANE": "compute"})))
    assert picked["control_plane"] == "compute"
    listed = ok(tpufab("list", env=env, cwd=home))
    rows = [line for line in listed.splitlines() if line.startswith(single + " ")]
    assert sorted(r.split()[-1] for r in rows) == ["API", "Engine"]  # TPU API, Compute Engine


def test_v6e_on_compute_by_choice(env, home, compute):
    name = _created(env, home, unique_name("c6"), "--type", "v6e-4", "--on", "compute",
                    "--async")
    inst = compute.instances.get(project=compute.project, zone=compute.zone, instance=name)
    assert inst.machine_type.endswith("/ct6e-standard-4t")
    wait_for(lambda: '"state": "READY"' in tpufab("describe", "--name", name, "--json",
                                                  env=env, cwd=home).stdout, 120,
             what="the v6e VM READY")
    ok(tpufab("delete", "--name", name, "--yes", env=env, cwd=home))


def test_a_failed_create_deletes_what_it_made_and_says_so(env, home, compute, sim_admin):
    from google.api_core import exceptions as gexc

    name = unique_name("cs")
    sim_admin.fail_next_create("stockout")  # the MIG's VMs find no capacity
    result = tpufab("create", "--name", name, "--type", "tpu7x-16", env=env, cwd=home)
    one_sentence(result, "No tpu7x-16 capacity", f"deleted what this create made of {name}")
    for get in (lambda: compute.groups.get(project=compute.project, zone=compute.zone,
                                           instance_group_manager=name),
                lambda: compute.templates.get(project=compute.project,
                                              instance_template=f"{name}-tpufab-tt"),
                lambda: compute.policies.get(project=compute.project, region=compute.region,
                                             resource_policy=f"{name}-tpufab-wp")):
        with pytest.raises(gexc.NotFound):
            get()


def test_a_preempted_spot_vm_is_reported_and_collected(single, env, home, compute, sim,
                                                       sim_admin):
    from google.api_core import exceptions as gexc

    sim_admin.preempt(f"projects/{sim.project}/locations/{sim.zone}/ceInstances/{single}")
    inst = compute.instances.get(project=compute.project, zone=compute.zone, instance=single)
    assert inst.status == "TERMINATED"
    described = tpufab("describe", "--name", single, env=env, cwd=home)
    assert f"{single} was PREEMPTED" in described.stdout
    collected = ok(tpufab("gc", "--yes", env=env, cwd=home))
    assert f"TPU node {single} (tpu7x-8, PREEMPTED)" in collected
    with pytest.raises(gexc.NotFound):
        compute.instances.get(project=compute.project, zone=compute.zone, instance=single)


def test_ctrl_c_in_create_deletes_what_it_made(env, home, compute, sim_admin):
    from google.api_core import exceptions as gexc
    from helpers import TPUFAB, interrupted_when

    name = unique_name("cc")
    sim_admin.settings(create_delay=60.0)  # the VMs take their time: Ctrl-C comes first
    result = interrupted_when([TPUFAB, "create", "--name", name, "--type", "tpu7x-16"], env,
                              lambda r: r.saw(f"{name}: CREATING"), "the MIG to be under way",
                              timeout=240, cwd=home)
    assert result.returncode == 130, (result.stdout, result.stderr)
    assert "Traceback" not in result.stderr
    assert f"Interrupted: Deleted what this create made of {name}" in result.stderr
    for get in (lambda: compute.groups.get(project=compute.project, zone=compute.zone,
                                           instance_group_manager=name),
                lambda: compute.templates.get(project=compute.project,
                                              instance_template=f"{name}-tpufab-tt"),
                lambda: compute.policies.get(project=compute.project, region=compute.region,
                                             resource_policy=f"{name}-tpufab-wp")):
        with pytest.raises(gexc.NotFound):
            get()


def test_a_mig_without_a_slices_workload_policy_is_single_host_pods(env, home, compute):
    """A MIG of TPU VMs with no HIGH_THROUGHPUT workload policy is independent single-host
    slices, not connected by ICI (Google's "TPU instances in MIGs"): each VM is a pod of one
    host (listed, described and reached by its own name), and the group's name is one
    sentence from every verb, never one multi-host slice a job would wire into one JAX
    cluster (issue 39)."""
    v1 = compute.v1
    name = unique_name("mi")
    template = f"{name}-by-hand"
    compute.wait(compute.templates.insert_unary(
        project=compute.project, instance_template_resource=v1.InstanceTemplate(
            name=template, properties=v1.InstanceProperties(
                machine_type="tpu7x-standard-4t",
                network_interfaces=[v1.NetworkInterface(access_configs=[
                    v1.AccessConfig(name="External NAT", type_="ONE_TO_ONE_NAT")])]))))
    compute.wait(compute.groups.insert_unary(
        project=compute.project, zone=compute.zone,
        instance_group_manager_resource=v1.InstanceGroupManager(
            name=name, base_instance_name=name, target_size=2,
            instance_template=f"global/instanceTemplates/{template}")))
    try:
        vms = sorted(m.name for m in compute.groups.list_managed_instances(
            project=compute.project, zone=compute.zone, instance_group_manager=name))
        assert len(vms) == 2
        wait_for(lambda: all(json.loads(ok(tpufab("describe", "--name", vm, "--json",
                                                  env=env, cwd=home)))["state"] == "READY"
                             for vm in vms), 180, what="both VMs READY")
        listed = json.loads(ok(tpufab("list", "--json", env=env, cwd=home)))
        mine = {n["name"]: n for n in listed if n.get("instance_group") == name}
        assert sorted(mine) == vms and {n["hosts"] for n in mine.values()} == {1}
        assert name not in {n["name"] for n in listed}
        for verb in (("describe",), ("exec", "--", "true"), ("status",)):
            refused = tpufab(verb[0], "--name", name, *verb[1:], env=env, cwd=home)
            one_sentence(refused, f"'{name}' is a managed instance group without a "
                         "HIGH_THROUGHPUT workload policy", "independent single-host slices",
                         f"`--name {vms[0]}`", progress=int(verb[0] == "status"))
            assert refused.returncode == 2
        out = ok(tpufab("exec", "--name", vms[0], "--", "hostname", env=env, cwd=home))
        assert out.strip().endswith(vms[0]) and "w1" not in out   # one host, that VM
        one = json.loads(ok(tpufab("describe", "--name", vms[1], "--json", env=env,
                                   cwd=home)))
        assert (one["hosts"], one["instance_group"], one["workload_policy"]) == (1, name, None)
    finally:
        compute.wait(compute.groups.delete_unary(project=compute.project, zone=compute.zone,
                                                 instance_group_manager=name))
        compute.wait(compute.templates.delete_unary(project=compute.project,
                                                    instance_template=template))
