"""The Compute Engine guest of a TPU7x VM (a tpu7x-8: one instance): the preemption and
maintenance notices its metadata server gives (``instance/preempted``,
``instance/maintenance-event``) reach `tpufab status` and `tpufab check` as a TPU API node's
do, announced the Compute Engine way (``instances.simulateMaintenanceEvent`` through the
official client) and with `tpufab sim preempt NAME --notice`. And multislice on Compute
Engine: 2 slices of tpu7x-16 (the smallest: multislice joins multi-host slices) as one job
with the MEGASCALE_* wiring."""

from __future__ import annotations

import json

import pytest
from harness import connected_pod
from helpers import call, cli_env, ok, one_sentence, tpufab, unique_name

pytestmark = [pytest.mark.sim, pytest.mark.timeout(900)]  # a loaded 2-core machine

MAINTENANCE = "maintenance: TERMINATE_ON_HOST_MAINTENANCE (instance/maintenance-event)"
PREEMPTED = "preempted (instance/preempted=TRUE)"


@pytest.fixture(scope="module")
def vm(sim, tmp_path_factory):
    with connected_pod(sim, tmp_path_factory, "ceg", type="tpu7x-8") as pod:
        assert pod.pod.node.plane == "compute" and len(pod.pod.node.workers) == 1
        yield pod


def test_maintenance_then_preemption_notices_show_in_status_and_check(vm, sim, sim_admin,
                                                                    tmp_path, tpu_client):
    from google.api_core.client_options import ClientOptions
    from google.auth.credentials import AnonymousCredentials
    from google.cloud import compute_v1

    name = vm.pod.node.name
    sim_admin.settings(maintenance_notice=600)  # announced long enough for a loaded machine
    client = compute_v1.InstancesClient(credentials=AnonymousCredentials(), transport="rest",
                                        client_options=ClientOptions(api_endpoint=sim.endpoint))
    op = client.simulate_maintenance_event_unary(project=sim.project, zone=sim.zone,
                                                 instance=name)
    assert op.status == compute_v1.Operation.Status.DONE and not op.error.errors
    status = call(vm.env, "status", cwd=tmp_path)
    assert status.returncode == 0, status.stdout + status.stderr
    assert f"Notice on w0: {MAINTENANCE}" in status.stdout, status.stdout
    assert PREEMPTED not in status.stdout

    sim_admin.preempt(name, notice=600)  # the name of an instance, as for a TPU API node
    status = call(vm.env, "status", cwd=tmp_path)
    assert f"Notice on w0: {PREEMPTED}" in status.stdout, status.stdout
    checked = tpufab("check", "--quick", env=vm.env, cwd=tmp_path, timeout=300)
    assert PREEMPTED in checked.stdout and MAINTENANCE in checked.stdout, \
        checked.stdout + checked.stderr
    # what happened to the VM is no operation of the Cloud TPU API: its official client still
    # reads the zone's operations (a TPU7x record's acceleratorConfig is no enum it knows)
    parent = f"projects/{sim.project}/locations/{sim.zone}"
    ops = tpu_client.list_operations(request={"name": parent}).operations
    assert not any(name in op.metadata.value.decode(errors="ignore") for op in ops)


def test_multislice_takes_multi_host_slices_and_a_failed_create_deletes_its_slices(
        sim, tmp_path):
    env = cli_env(sim, tmp_path)
    refused = tpufab("create", "--name", unique_name("ms"), "--type", "tpu7x-8",
                     "--num-slices", "2", env=env, cwd=tmp_path)
    one_sentence(refused, "Multislice joins multi-host slices only", "tpu7x-16")
    name = unique_name("ms")
    # slice 1's name is taken by another type: slice 0, made first, is deleted again
    ok(tpufab("create", "--name", f"{name}-1", "--type", "tpu7x-8", env=env, cwd=tmp_path,
              timeout=600))
    failed = tpufab("create", "--name", name, "--type", "tpu7x-16", "--num-slices", "2",
                    env=env, cwd=tmp_path, timeout=600)
    one_sentence(failed, f"{name}-1", "already exists as a tpu7x-8",
                 f"deleted slice {name}-0 made by this create", progress=4)
    ok(tpufab("delete", "--name", f"{name}-1", "--yes", env=env, cwd=tmp_path, timeout=600))
    assert f"{name}-0" not in ok(tpufab("list", env=env, cwd=tmp_path))


@pytest.fixture(scope="module")
def multislice(sim, tmp_path_factory):
    """2 slices of tpu7x-16 (4 VMs) as one multislice, made by `tpufab create --num-slices`;
    (env, project folder, name). The last test deletes it."""
    home = tmp_path_factory.mktemp("multislice")
    (home / ".git").mkdir()  # a project of its own: `tpufab use` remembers the pod here
    env = cli_env(sim, home)
    name = unique_name("ms")
    made = ok(tpufab("create", "--name", name, "--type", "tpu7x-16", "--num-slices", "2",
                     env=env, cwd=home, timeout=600))
    assert f"Multislice {name}: 2 slices of tpu7x-16 ({name}-0, {name}-1)" in made
    yield env, home, name
    tpufab("delete", "--name", name, "--yes", env=env, cwd=home, timeout=600)


def test_multislice_on_compute_engine_wires_megascale(multislice, tmp_path):
    env, home, name = multislice
    recipe = tmp_path / "ms.sh"
    recipe.write_text(
        '#!/bin/bash\nip=$(curl -sf -H Metadata-Flavor:Google http://metadata.google.'
        'internal/computeMetadata/v1/instance/network-interfaces/0/ip)\n'
        'echo "ms $MEGASCALE_NUM_SLICES $MEGASCALE_SLICE_ID $MEGASCALE_COORDINATOR_ADDRESS '
        '$TPU_NAME $TPU_WORKER_ID $TPUFAB_WORKER_ID ip=$ip"\n')
    result = call({**env, "TPUFAB_NAME": name}, "run", cwd=tmp_path, recipe=str(recipe),
                  no_deploy=True, raw=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    seen = {line.split(" │ ")[0].strip(): line.split(" │ ")[1].split()
            for line in result.stdout.splitlines() if " │ ms " in line}
    assert sorted(seen) == ["w0", "w1", "w2", "w3"], result.stdout
    coordinator = seen["w0"][-1].removeprefix("ip=")  # slice 0's worker 0
    for w in range(4):
        assert seen[f"w{w}"][1:7] == ["2", str(w // 2), coordinator, f"{name}-{w // 2}",
                                      str(w % 2), str(w)], seen


def test_describe_and_use_take_the_multislices_name(multislice):
    """`describe NAME` and `use NAME` take the multislice's name as they take a multislice
    queued resource's on the Cloud TPU API: its slices, its workers numbered as the verbs
    number them, and verbs without --name (exec, status) then reach every VM of it."""
    env, home, name = multislice
    shown = " ".join(ok(tpufab("describe", "--name", name, env=env, cwd=home)).split())
    for text in (f"multislice {name}", "control plane Compute Engine", "type 2 x tpu7x-16",
                 "state READY", "hosts 4", f"slices {name}-0 (READY), {name}-1 (READY)"):
        assert text in shown, shown
    found = json.loads(ok(tpufab("describe", "--name", name, "--json", env=env, cwd=home)))
    assert found["multislice"] and found["control_plane"] == "compute"
    assert (found["slice_count"], found["hosts"], found["state"]) == (2, 4, "READY")
    assert [(w["index"], w["slice"], w["slice_worker"]) for w in found["workers"]] == \
        [(0, 0, 0), (1, 0, 1), (2, 1, 0), (3, 1, 1)]
    one = json.loads(ok(tpufab("describe", "--name", f"{name}-1", "--json", env=env,
                               cwd=home)))
    assert one["multislice"] and one["slice_index"] == 1
    assert [w["internal_ip"] for w in one["workers"]] == \
        [w["internal_ip"] for w in found["workers"][2:]]

    used = ok(tpufab("use", name, env=env, cwd=home))
    assert f"{name} (Compute Engine multislice of 2 slices: {name}-0, {name}-1) is now this " \
        "project's current pod" in used, used
    assert ok(tpufab("use", env=env, cwd=home)).startswith(f"{name}: this project's current pod")
    out = ok(tpufab("exec", "--", "hostname", env=env, cwd=home))  # no --name: the current pod
    said = dict(line.split(" │ ") for line in out.splitlines() if " │ " in line)
    assert sorted(k.strip() for k in said) == ["w0", "w1", "w2", "w3"], out
    assert {v.strip().rsplit("-", 1)[0] for v in said.values()} == {f"{name}-0", f"{name}-1"}
    status = tpufab("status", env=env, cwd=home)  # the current pod, said as such
    shown = ok(status)
    assert f"Pod {name} (this project's current pod, set by `tpufab use`" in status.stderr
    for index in range(2):
        assert f"TPU node {name}-{index}: tpu7x-16 READY, 2 workers" in shown, shown
    assert "w[0-3]" in shown, shown


def test_a_name_that_is_a_slice_and_a_multislice_is_one_sentence(multislice):
    env, home, name = multislice
    ok(tpufab("create", "--name", name, "--type", "tpu7x-8", env=env, cwd=home, timeout=600))
    try:
        for verb in (("describe", "--name", name), ("use", name)):
            result = tpufab(*verb, env=env, cwd=home)
            assert result.returncode == 2, result.stdout + result.stderr
            one_sentence(result, f"'{name}' names both the Compute Engine TPU slice {name} "
                         f"and the Compute Engine multislice {name} ({name}-0, {name}-1)",
                         f"`tpufab delete --name {name}` deletes the Compute Engine TPU slice",
                         f"`--name {name}-0`")
    finally:
        ok(tpufab("delete", "--name", name, "--yes", env=env, cwd=home, timeout=600))
    assert json.loads(ok(tpufab("describe", "--name", name, "--json", env=env,
                                cwd=home)))["slice_count"] == 2  # only the lone VM went


def test_a_multislice_is_deleted_by_its_name(multislice):
    env, home, name = multislice
    deleted = ok(tpufab("delete", "--name", name, "--yes", env=env, cwd=home, timeout=600))
    assert f"{name}-0" in deleted and f"{name}-1" in deleted
    listed = ok(tpufab("list", env=env, cwd=home))
    assert f"{name}-" not in listed
