"""The Compute Engine guest of a TPU7x VM (a tpu7x-8: one instance): the preemption and
maintenance notices its metadata server gives (``instance/preempted``,
``instance/maintenance-event``) reach `tpufab status` and `tpufab check` as a TPU API node's
do, announced the Compute Engine way (``instances.simulateMaintenanceEvent`` through the
official client) and with `tpufab sim preempt NAME --notice`. And multislice on Compute
Engine: 2 slices of tpu7x-16 (the smallest: multislice joins multi-host slices) as one job
with the MEGASCALE_* wiring."""

from __future__ import annotations

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


def test_multislice_on_compute_engine_wires_megascale(sim, tmp_path):
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
    made = ok(tpufab("create", "--name", name, "--type", "tpu7x-16", "--num-slices", "2",
                     env=env, cwd=tmp_path, timeout=600))
    assert f"Multislice {name}: 2 slices of tpu7x-16 ({name}-0, {name}-1)" in made
    try:
        recipe = tmp_path / "ms.sh"
        recipe.write_text(
            '#!/bin/bash\nip=$(curl -sf -H Metadata-Flavor:Google http://metadata.google.'
            'internal/computeMetadata/v1/instance/network-interfaces/0/ip)\n'
            'echo "ms $MEGASCALE_NUM_SLICES $MEGASCALE_SLICE_ID $MEGASCALE_COORDINATOR_ADDRESS '
            '$TPU_NAME $TPU_WORKER_ID $TPUFAB_WORKER_ID ip=$ip"\n')
        result = call(env, "run", cwd=tmp_path, recipe=str(recipe), no_deploy=True, raw=True,
                      timeout=300)
        assert result.returncode == 0, result.stdout + result.stderr
        seen = {line.split(" │ ")[0].strip(): line.split(" │ ")[1].split()
                for line in result.stdout.splitlines() if " │ ms " in line}
        assert sorted(seen) == ["w0", "w1", "w2", "w3"], result.stdout
        coordinator = seen["w0"][-1].removeprefix("ip=")  # slice 0's worker 0
        for w in range(4):
            assert seen[f"w{w}"][1:7] == ["2", str(w // 2), coordinator, f"{name}-{w // 2}",
                                          str(w % 2), str(w)], seen
    finally:
        deleted = ok(tpufab("delete", "--name", name, "--yes", env=env, cwd=tmp_path,
                            timeout=600))
    assert f"{name}-0" in deleted and f"{name}-1" in deleted
    listed = ok(tpufab("list", env=env, cwd=tmp_path))
    assert f"{name}-" not in listed
