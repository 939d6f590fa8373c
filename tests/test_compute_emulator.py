"""The emulator's Compute Engine v1: the official google-cloud-compute client and the real
gcloud CLI make, see and delete TPU VM instances and a multi-host MIG; the VMs are real sshd
workers. gcloud's list commands show every kind of resource tpufab makes, its commands that
name several resources (one batch request) work, `gcloud compute ssh` goes in at the first
try (project metadata), and the client's filtered list holds what its filter says."""

from __future__ import annotations

import json
import subprocess

import pytest
from google.api_core import exceptions as gexc
from helpers import compute_clients, metadata_keys, port_open, ssh_run, unique_name, wait_for

pytestmark = [pytest.mark.sim, pytest.mark.gcloud]


@pytest.fixture(scope="module")
def compute(sim):
    return compute_clients(sim)


def gcloud(env: dict[str, str], *args: str, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run(["gcloud", "compute", *args], env=env, capture_output=True,
                            text=True, timeout=180, stdin=subprocess.DEVNULL)
    if check and result.returncode != 0:
        pytest.fail(f"gcloud compute {' '.join(args)} exited {result.returncode}:\n"
                    f"{result.stderr}")
    return result


def test_client_instance_is_a_real_worker_gcloud_sees(compute, gcloud_env, ssh_key):
    v1 = compute.v1
    name = unique_name("ci")
    instance = v1.Instance(
        name=name, machine_type=f"zones/{compute.zone}/machineTypes/tpu7x-standard-4t",
        network_interfaces=[v1.NetworkInterface(access_configs=[v1.AccessConfig(
            name="External NAT")])],
        scheduling=v1.Scheduling(provisioning_model="SPOT"), labels={"team": "infra"},
        metadata=v1.Metadata(items=[v1.Items(key="ssh-keys",
                                             value=metadata_keys("alice", ssh_key))]))
    op = compute.wait(compute.instances.insert_unary(project=compute.project, zone=compute.zone,
                                                     instance_resource=instance))
    assert not op.error.errors
    got = compute.instances.get(project=compute.project, zone=compute.zone, instance=name)
    assert got.status == "RUNNING" and got.scheduling.provisioning_model == "SPOT"
    assert got.machine_type.endswith("/machineTypes/tpu7x-standard-4t")
    ip = got.network_interfaces[0].network_i_p
    assert ip.startswith("127.") and got.network_interfaces[0].access_configs[0].nat_i_p == ip
    assert port_open(ip)
    result = ssh_run(ip, ssh_key, "alice", "hostname; ls /dev/vfio | wc -l")
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == [name, "4"]  # the VM's name; 4 chips
    agg = dict(compute.instances.aggregated_list(project=compute.project))
    assert name in [i.name for i in agg[f"zones/{compute.zone}"].instances]

    listed = json.loads(gcloud(gcloud_env, "instances", "list", "--format=json").stdout)
    mine = [i for i in listed if i["name"] == name]
    assert mine and mine[0]["status"] == "RUNNING" and mine[0]["labels"] == {"team": "infra"}

    # two more VMs in one gcloud command (a batch of inserts), then filtered lists
    others = [unique_name("cb"), unique_name("cb")]
    gcloud(gcloud_env, "instances", "create", *others, "--machine-type=tpu7x-standard-4t",
           "--labels=team=ml")
    filtered = [i.name for i in compute.instances.list(request={
        "project": compute.project, "zone": compute.zone, "filter": "labels.team = infra"})]
    assert name in filtered and not set(others) & set(filtered)
    shown = gcloud(gcloud_env, "instances", "list", "--filter=labels.team=ml",
                   "--format=value(name)").stdout.split()
    assert set(others) <= set(shown) and name not in shown
    pages = list(compute.instances.list(request={
        "project": compute.project, "zone": compute.zone, "max_results": 1}).pages)
    assert len(pages) >= 3 and all(len(p.items) == 1 for p in pages)  # one VM a page

    # gcloud compute ssh: its key goes into the project's metadata, at the first try
    first = gcloud(gcloud_env, "ssh", name, "--command=hostname", check=False)
    assert first.returncode == 0 and first.stdout.strip().endswith(name), first.stderr
    assert "failed." not in first.stderr, first.stderr
    console = gcloud(gcloud_env, "instances", "get-serial-port-output", name).stdout
    assert name in console
    started = compute.wait(compute.instances.start_unary(  # running already: DONE, no error
        project=compute.project, zone=compute.zone, instance=name))
    assert not started.error.errors
    gcloud(gcloud_env, "instances", "reset", name)
    wait_for(lambda: port_open(ip), timeout=60, interval=0.2, what=f"{name} back after reset")
    again = ssh_run(ip, ssh_key, "alice", "hostname")
    assert again.returncode == 0 and again.stdout.strip() == name, again.stderr

    gcloud(gcloud_env, "instances", "delete", name, *others, "--quiet")  # one batch
    with pytest.raises(gexc.NotFound):
        compute.instances.get(project=compute.project, zone=compute.zone, instance=name)
    assert not port_open(ip)


def names_listed(env: dict[str, str], *what: str) -> list[str]:
    return gcloud(env, *what, "list", "--format=value(name)").stdout.split()


def test_gcloud_slice_mig_is_seen_by_the_client_in_worker_order(compute, gcloud_env):
    policy, template, group = unique_name("wp"), unique_name("tt"), unique_name("mig")
    gcloud(gcloud_env, "resource-policies", "create", "workload-policy", policy,
           "--type=HIGH_THROUGHPUT", "--accelerator-topology=2x2x2",
           f"--region={compute.region}")
    gcloud(gcloud_env, "instance-templates", "create", template,
           "--machine-type=tpu7x-standard-4t")
    gcloud(gcloud_env, "instance-groups", "managed", "create", group, "--size=2",
           f"--template={template}", f"--workload-policy=projects/{compute.project}/regions/"
           f"{compute.region}/resourcePolicies/{policy}")
    mig = compute.groups.get(project=compute.project, zone=compute.zone,
                             instance_group_manager=group)
    assert mig.target_size == 2 and mig.resource_policies.workload_policy.endswith(
        f"/resourcePolicies/{policy}")
    members = list(compute.groups.list_managed_instances(
        project=compute.project, zone=compute.zone, instance_group_manager=group))
    assert len(members) == 2 and {m.instance_status for m in members} == {"RUNNING"}
    assert all(m.name.startswith(f"{group}-") for m in members)
    vms = [compute.instances.get(project=compute.project, zone=compute.zone, instance=m.name)
           for m in members]
    assert all(port_open(v.network_interfaces[0].network_i_p) for v in vms)
    # gcloud's list commands show every kind of resource a slice is made of
    assert group in names_listed(gcloud_env, "instance-groups", "managed")
    assert group in names_listed(gcloud_env, "instance-groups")
    assert template in names_listed(gcloud_env, "instance-templates")
    assert policy in names_listed(gcloud_env, "resource-policies")
    assert {v.name for v in vms} <= set(names_listed(gcloud_env, "instances"))

    # gcloud's recreate-instances: the VM comes back under its name, a new VM (another id,
    # another internal IP), and list-instances shows it RECREATING, then RUNNING again
    old = vms[0]
    gcloud(gcloud_env, "instance-groups", "managed", "recreate-instances", group,
           f"--instances={old.name}")

    def back():
        listed = json.loads(gcloud(gcloud_env, "instance-groups", "managed", "list-instances",
                                   group, "--format=json").stdout)
        mine = [i for i in listed if i["instance"].endswith(f"/{old.name}")]
        return mine and mine[0].get("currentAction") == "NONE" and \
            mine[0].get("instanceStatus") == "RUNNING"

    wait_for(back, timeout=120, interval=0.5, what=f"{old.name} recreated")
    new = compute.instances.get(project=compute.project, zone=compute.zone, instance=old.name)
    assert new.id != old.id and new.network_interfaces[0].network_i_p != \
        old.network_interfaces[0].network_i_p
    assert port_open(new.network_interfaces[0].network_i_p)

    # a policy or template the group uses cannot go; the group's deletion takes its VMs
    in_use = gcloud(gcloud_env, "instance-templates", "delete", template, "--quiet",
                    check=False)
    assert in_use.returncode != 0 and "already being used" in in_use.stderr
    compute.wait(compute.groups.delete_unary(project=compute.project, zone=compute.zone,
                                             instance_group_manager=group))
    listed = json.loads(gcloud(gcloud_env, "instances", "list", "--format=json").stdout)
    assert not [i for i in listed if i["name"].startswith(f"{group}-")]
    gcloud(gcloud_env, "instance-templates", "delete", template, "--quiet")
    compute.wait(compute.policies.delete_unary(project=compute.project, region=compute.region,
                                               resource_policy=policy))


def test_client_mig_and_its_errors(compute, gcloud_env, sim_admin):
    v1 = compute.v1
    policy, template, group = unique_name("wp"), unique_name("tt"), unique_name("mig")
    compute.wait(compute.policies.insert_unary(
        project=compute.project, region=compute.region,
        resource_policy_resource=v1.ResourcePolicy(
            name=policy, workload_policy=v1.ResourcePolicyWorkloadPolicy(
                type_="HIGH_THROUGHPUT", accelerator_topology="2x2x2"))))
    compute.wait(compute.templates.insert_unary(
        project=compute.project, instance_template_resource=v1.InstanceTemplate(
            name=template, properties=v1.InstanceProperties(machine_type="tpu7x-standard-4t"))))
    with pytest.raises(gexc.BadRequest, match="target size of 2 VMs"):
        compute.groups.insert_unary(
            project=compute.project, zone=compute.zone,
            instance_group_manager_resource=v1.InstanceGroupManager(
                name=group, instance_template=f"global/instanceTemplates/{template}",
                target_size=3, resource_policies=v1.InstanceGroupManagerResourcePolicies(
                    workload_policy=f"regions/{compute.region}/resourcePolicies/{policy}")))
    compute.wait(compute.groups.insert_unary(
        project=compute.project, zone=compute.zone,
        instance_group_manager_resource=v1.InstanceGroupManager(
            name=group, instance_template=f"global/instanceTemplates/{template}",
            base_instance_name=group, target_size=2,
            resource_policies=v1.InstanceGroupManagerResourcePolicies(
                workload_policy=f"regions/{compute.region}/resourcePolicies/{policy}"))))
    table = gcloud(gcloud_env, "instance-groups", "managed", "list-instances", group).stdout
    assert table.count(f"{group}-") == 2 and table.count("RUNNING") == 2
    # resize to 0 and back: the slice's VMs go and come again
    compute.wait(compute.groups.resize_unary(project=compute.project, zone=compute.zone,
                                             instance_group_manager=group, size=0))
    assert not list(compute.groups.list_managed_instances(
        project=compute.project, zone=compute.zone, instance_group_manager=group))
    compute.wait(compute.groups.resize_unary(project=compute.project, zone=compute.zone,
                                             instance_group_manager=group, size=2))
    members = list(compute.groups.list_managed_instances(
        project=compute.project, zone=compute.zone, instance_group_manager=group))
    assert [m.instance_status for m in members] == ["RUNNING", "RUNNING"]
    ips = [compute.instances.get(project=compute.project, zone=compute.zone, instance=m.name)
           .network_interfaces[0].network_i_p for m in members]
    # resized to 0, up again and deleted without waiting: nothing is left listening, and the
    # next slice placed (the same shape, name and addresses) comes up
    kw = {"project": compute.project, "zone": compute.zone, "instance_group_manager": group}
    compute.groups.resize_unary(**kw, size=0)
    compute.groups.resize_unary(**kw, size=2)
    compute.wait(compute.groups.delete_unary(**kw))
    wait_for(lambda: not any(port_open(ip) for ip in ips), timeout=60, interval=0.2,
             what="the deleted slice's VMs to stop listening")
    compute.wait(compute.groups.insert_unary(
        project=compute.project, zone=compute.zone,
        instance_group_manager_resource=v1.InstanceGroupManager(
            name=group, instance_template=f"global/instanceTemplates/{template}",
            base_instance_name=group, target_size=2,
            resource_policies=v1.InstanceGroupManagerResourcePolicies(
                workload_policy=f"regions/{compute.region}/resourcePolicies/{policy}"))))
    again = list(compute.groups.list_managed_instances(**kw))
    assert [m.instance_status for m in again] == ["RUNNING", "RUNNING"]
    compute.wait(compute.groups.resize_unary(**kw, size=0))
    # the flex-start path: a resize request for the whole slice, its VMs made at once
    requests = compute.v1.InstanceGroupManagerResizeRequestsClient(
        credentials=compute.instances._transport._credentials, transport="rest",
        client_options={"api_endpoint": gcloud_env["CLOUDSDK_API_ENDPOINT_OVERRIDES_COMPUTE"]
                        .removesuffix("/compute/v1/")})
    compute.wait(requests.insert_unary(**kw, instance_group_manager_resize_request_resource=(
        v1.InstanceGroupManagerResizeRequest(name="flex", resize_by=2,
                                             requested_run_duration=v1.Duration(seconds=3600)))))
    wait_for(lambda: requests.get(**kw, resize_request="flex").state == "SUCCEEDED",
             timeout=120, interval=0.3, what="the resize request")
    assert [m.instance_status for m in compute.groups.list_managed_instances(**kw)] == \
        ["RUNNING", "RUNNING"]
    compute.wait(compute.groups.delete_unary(**kw))
    # a VM the zone has no capacity for: the MIG keeps trying, and listErrors says why
    sim_admin.fail_next_create("stockout", vms=1)
    compute.wait(compute.groups.insert_unary(
        project=compute.project, zone=compute.zone,
        instance_group_manager_resource=v1.InstanceGroupManager(
            name=group, instance_template=f"global/instanceTemplates/{template}",
            base_instance_name=group, target_size=2,
            resource_policies=v1.InstanceGroupManagerResourcePolicies(
                workload_policy=f"regions/{compute.region}/resourcePolicies/{policy}"))))
    errors = list(compute.groups.list_errors(**kw))
    assert [e.error.code for e in errors] == ["ZONE_RESOURCE_POOL_EXHAUSTED"]
    assert "does not have enough resources" in errors[0].error.message
    compute.wait(compute.groups.delete_unary(**kw))
    # an injected stockout ends the insert operation with the capacity error
    sim_admin.fail_next_create("stockout")
    op = compute.wait(compute.instances.insert_unary(
        project=compute.project, zone=compute.zone, instance_resource=v1.Instance(
            name=unique_name("ci"),
            machine_type=f"zones/{compute.zone}/machineTypes/tpu7x-standard-4t")))
    assert op.error.errors[0].code == "ZONE_RESOURCE_POOL_EXHAUSTED"
    # an injected quota failure: a DONE operation with QUOTA_EXCEEDED, and no VM left behind
    sim_admin.fail_next_create("quota")
    vm = unique_name("cq")
    op = compute.wait(compute.instances.insert_unary(
        project=compute.project, zone=compute.zone, instance_resource=v1.Instance(
            name=vm, machine_type=f"zones/{compute.zone}/machineTypes/tpu7x-standard-4t")))
    assert op.error.errors[0].code == "QUOTA_EXCEEDED" and "Quota" in op.error.errors[0].message
    with pytest.raises(gexc.NotFound):
        compute.instances.get(project=compute.project, zone=compute.zone, instance=vm)
    with pytest.raises(gexc.BadRequest, match="does not exist in zone"):
        compute.instances.insert_unary(
            project=compute.project, zone=compute.zone, instance_resource=v1.Instance(
                name=unique_name("ci"), machine_type=f"zones/{compute.zone}/machineTypes/"
                "tpu7x-standard-3t"))
    types = [m.name for m in compute.v1.MachineTypesClient(
        credentials=compute.instances._transport._credentials, transport="rest",
        client_options={"api_endpoint": gcloud_env["CLOUDSDK_API_ENDPOINT_OVERRIDES_COMPUTE"]
                        .removesuffix("/compute/v1/")}).list(project=compute.project,
                                                              zone=compute.zone)]
    assert {"tpu7x-standard-4t", "ct6e-standard-4t", "ct5p-hightpu-4t"} <= set(types)

