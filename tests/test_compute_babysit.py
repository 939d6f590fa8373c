"""babysit, autostop, gc and capacity on Compute Engine (issue 24), on tpu7x-16 (a MIG of 2
VMs, the smallest multi-host TPU7x): a spot slice preempted under a babysat recipe is recreated
and the recipe re-run ("preempted"); autostop deletes the MIG and gc what tpufab made for it;
a flex-start slice whose run ended is said in one sentence, babysit stops or renews it; a MIG
stuck below its size is said by status and check, and create gives up on it; --zones falls
through a stockout."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
from harness import sim_node
from helpers import InThread, attempt_running, free_port, ok, text_of, tpufab, wait_for
from rich.console import Console

from tpufab.flows.babysit import loop, policy

pytestmark = [pytest.mark.sim, pytest.mark.timeout(900)]  # a loaded 2-core machine

LOOPS_FIRST = """#!/bin/sh
# attempt 0 runs until the slice is preempted under it; attempt 1 finishes
echo "attempt $TPUFAB_RESTART_COUNT w$TPUFAB_WORKER_ID of $TPUFAB_NUM_WORKERS"
if [ "$TPUFAB_RESTART_COUNT" = 0 ]; then
    while true; do sleep 0.05; done
fi
echo "done $TPUFAB_RESTART_COUNT"
"""


@pytest.fixture(scope="module")
def spot16(sim, tmp_path_factory):
    """A READY spot tpu7x-16 (a MIG of 2 VMs) on the simulated Compute Engine."""
    with sim_node(sim, tmp_path_factory, "cbs", "tpu7x-16", spot=True) as pod:
        assert pod.node.plane == "compute" and len(pod.node.workers) == 2
        yield pod


def _compute(pod):
    from tpufab.cloud.planes.compute import ComputeEngine

    return ComputeEngine(pod.settings)


def test_a_preempted_spot_mig_is_recreated_and_the_recipe_rerun(spot16, tmp_path):
    recipe = tmp_path / "loops_first.sh"
    recipe.write_text(LOOPS_FIRST)
    recipe.chmod(0o755)
    notes = io.StringIO()
    sitter = loop.Babysitter(spot16.settings, recipe, no_deploy=True, poll=0.3,
                             backoff=(0.0, 0.0), failure_grace=1.0,
                             console=Console(file=notes, width=300), base_dir=tmp_path)
    before = _compute(spot16).get_node(spot16.name)
    thread = InThread(sitter.run)
    outcome = thread.outcome
    attempt_running(sitter, thread, 0, (0, 1), 120, "attempt 0 to be running on both VMs")
    said = ok(tpufab("sim", "preempt", spot16.name, env=spot16.env, cwd=spot16.home))
    assert f"Preempted TPU node {spot16.name}" in said   # `sim preempt` finds the MIG
    thread.join(400)
    assert not thread.is_alive(), "babysit did not end"
    assert "error" not in outcome, (outcome["error"], notes.getvalue())
    said = notes.getvalue()
    assert [a.outcome for a in sitter.attempts] == ["preempted", "finished"], said
    assert f"babysit: preempted: attempt 0 preempted (TPU node {spot16.name} was PREEMPTED)" \
        in said
    after = _compute(spot16).get_node(spot16.name)
    assert after.id != before.id and after.state == "READY"       # a new MIG
    assert after.plane == "compute" and after.spot and len(after.workers) == 2
    assert after.accelerator_type == "tpu7x-16"
    for w in (0, 1):
        assert "done 1" in text_of(sitter.log_dir / "attempt-1" / f"w{w}.log")


def test_autostop_deletes_an_idle_mig_with_the_template_and_policy_tpufab_made(spot16, sim):
    """The last test that uses spot16: it deletes the slice."""
    from google.api_core import exceptions as gexc

    from tpufab.hosts import connect as pods

    pods.forget(spot16.settings)   # babysit's kept connection would count as busy
    env = {**spot16.env, "TPUFAB_AUTOSTOP_CHECK": "0.3",
           "TPUFAB_AUTOSTOP_PORT": str(free_port())}
    armed = ok(tpufab("autostop", "--idle", "2s", env=env, cwd=spot16.home))
    assert f"Autostop of {spot16.name}: deletes the pod after 2s idle." in armed
    ce = _compute(spot16)
    c = ce.c

    def missing(get) -> bool:
        try:
            get()
        except gexc.NotFound:
            return True
        return False

    region = sim.zone.rsplit("-", 1)[0]
    wait_for(lambda: missing(lambda: c.groups.get(project=sim.project, zone=sim.zone,
                                                  instance_group_manager=spot16.name)),
             300, what="the idle MIG to be deleted by its watchdog")
    assert not [i for i in c.instances.list(project=sim.project, zone=sim.zone)
                if i.name.startswith(f"{spot16.name}-")]
    # the template and policy tpufab made stay (the watchdog went with its VM): gc takes them
    collected = ok(tpufab("gc", "--yes", env=spot16.env, cwd=spot16.home))
    assert f"instance template {spot16.name}-tpufab-tt (made by tpufab for slice " \
        f"{spot16.name})" in collected
    assert f"workload policy {spot16.name}-tpufab-wp (made by tpufab for slice " \
        f"{spot16.name})" in collected
    assert "Deleted 2 of 2 leftovers." in collected
    assert missing(lambda: c.templates.get(project=sim.project,
                                           instance_template=f"{spot16.name}-tpufab-tt"))
    assert missing(lambda: c.policies.get(project=sim.project, region=region,
                                          resource_policy=f"{spot16.name}-tpufab-wp"))
    again = ok(tpufab("gc", "--yes", env=spot16.env, cwd=spot16.home))
    assert "leftover" not in again


FINISHES = """#!/bin/sh
echo "attempt $TPUFAB_RESTART_COUNT w$TPUFAB_WORKER_ID finished"
"""


def _sitter(settings, recipe: Path, tmp_path: Path):
    notes = io.StringIO()
    return loop.Babysitter(settings, recipe, no_deploy=True, poll=0.3, backoff=(0.0, 0.0),
                           failure_grace=1.0, console=Console(file=notes, width=300),
                           base_dir=tmp_path), notes


def test_a_flex_start_end_is_said_and_babysit_stops_or_renews(sim, tmp_path_factory, tmp_path):
    from dataclasses import replace

    with sim_node(sim, tmp_path_factory, "cfx", "tpu7x-16", flex_start=True,
                  max_run_duration="10m") as pod:
        assert pod.node.provisioning_model == "FLEX_START" and pod.node.max_run_duration == 600
        loops = tmp_path / "loops_first.sh"
        loops.write_text(LOOPS_FIRST)
        loops.chmod(0o755)
        sitter, notes = _sitter(pod.settings, loops, tmp_path / "first")
        thread = InThread(sitter.run)
        outcome = thread.outcome
        attempt_running(sitter, thread, 0, (0, 1), 120, "attempt 0 to be running on both VMs")
        ended = ok(tpufab("sim", "end-run", pod.name, env=pod.env, cwd=pod.home))
        assert f"The run of {pod.name} ended: Compute Engine deleted its VMs." in ended
        thread.join(300)
        assert not thread.is_alive(), "babysit did not end"
        err = outcome.get("error")
        assert isinstance(err, policy.BabysitError), (outcome, notes.getvalue())
        assert str(err).startswith(f"babysit stops: flex-start slice {pod.name} ended (its "
                                   "maximum run duration ran out")
        assert "set flex_start_renew: true" in str(err)
        assert "flex-start end: attempt 0 preempted" in notes.getvalue()
        sentence = (f"Flex-start slice {pod.name} ended: its maximum run duration (10m) ran "
                    "out and Compute Engine deleted its VMs; for another run, `tpufab delete "
                    f"--name {pod.name} --yes`, then `tpufab create --name {pod.name} --type "
                    "tpu7x-16 --flex-start --max-run-duration 10m`.")
        for verb in ("describe", "status"):
            said = tpufab(verb, env=pod.env, cwd=pod.home)
            assert sentence in " ".join(said.stdout.split()), (verb, said.stdout, said.stderr)
        # asked to renew, babysit makes a new flex-start request and runs the recipe
        done = tmp_path / "finishes.sh"
        done.write_text(FINISHES)
        done.chmod(0o755)
        renewing, notes = _sitter(replace(pod.settings, flex_start_renew=True), done,
                                  tmp_path / "renew")
        result = renewing.run()
        assert [a.outcome for a in result.attempts] == ["finished"], notes.getvalue()
        assert "making a new flex-start request" in notes.getvalue()
        from tpufab.cloud.planes.compute import ComputeEngine

        again = ComputeEngine(pod.settings).get_node(pod.name)
        assert again.state == "READY" and again.provisioning_model == "FLEX_START"
        assert again.max_run_duration == 600 and len(again.workers) == 2


def test_a_mig_short_of_vms_is_said_by_status_and_create_gives_up(sim, sim_admin, tmp_path):
    from helpers import cli_env, one_sentence, unique_name

    env = cli_env(sim, tmp_path)
    short, given_up = unique_name("csh"), unique_name("csg")
    sim_admin.fail_next_create(vms=1)           # the next MIG gets 1 of its 2 VMs
    ok(tpufab("create", "--name", short, "--type", "tpu7x-16", "--async", env=env,
              cwd=tmp_path))
    try:
        def said():
            out = tpufab("status", "--name", short, env=env, cwd=tmp_path).stdout
            return " ".join(out.split()) if "1/2 VMs" in out else ""

        line = wait_for(said, 120, what="status to say the MIG is short of a VM")
        assert f"{short} has 1/2 VMs: Compute Engine could not create {short}-" in line
        assert "(The zone " in line and "does not have enough resources available" in line
        assert "; wait for capacity (the MIG keeps trying), or `tpufab delete --name " \
            f"{short} --yes` and create it in another --zone or with --spot." in line
        checked = tpufab("check", "--name", short, env=env, cwd=tmp_path)
        one_sentence(checked, f"{short} has 1/2 VMs: Compute Engine could not create",
                     "wait for capacity (the MIG keeps trying)")
        # create waits for the missing VM only so long, then says why and cleans up
        sim_admin.fail_next_create(vms=1)
        failed = tpufab("create", "--name", given_up, "--type", "tpu7x-16",
                        env={**env, "TPUFAB_MIG_SHORT_WAIT": "1"}, cwd=tmp_path)
        sentence = one_sentence(failed, f"{given_up} has 1/2 VMs: Compute Engine could not "
                                f"create {given_up}-", "(gave up after ",
                                "TPUFAB_MIG_SHORT_WAIT is 1 s)",
                                "deleted what this create made")
        assert sentence
        listed = ok(tpufab("list", env=env, cwd=tmp_path))
        assert given_up not in listed and short in listed
    finally:
        tpufab("delete", "--name", short, "--yes", env=env, cwd=tmp_path)


def test_zones_fall_through_a_stockout_on_compute_engine(sim, sim_admin, tmp_path):
    from helpers import cli_env, unique_name

    env = cli_env(sim, tmp_path)
    name, other = unique_name("czn"), "us-east5-a"
    sim_admin.fail_next_create("stockout", zone=sim.zone)
    got = tpufab("create", "--name", name, "--type", "tpu7x-8", "--zones",
                 f"{sim.zone},{other}", env=env, cwd=tmp_path)
    try:
        assert got.returncode == 0, got.stdout + got.stderr
        assert f"No tpu7x-8 capacity in {sim.zone} right now; trying {other}." in got.stdout
        listed = ok(tpufab("list", "--zone", other, env=env, cwd=tmp_path))
        assert name in listed and name not in ok(tpufab("list", env=env, cwd=tmp_path))
    finally:
        tpufab("delete", "--name", name, "--zone", other, "--yes", env=env, cwd=tmp_path)


def test_create_replaces_what_an_autostopped_slice_of_the_name_left(sim, tmp_path):
    """The template and policy tpufab made outlive a MIG autostop deleted; a create of the
    name removes them first instead of failing on "already exists"."""
    from helpers import cli_env, unique_name

    from tpufab.cloud.planes.compute import ComputeEngine
    from tpufab.cloud.planes.compute_parts import MADE_BY
    from tpufab.config import load_settings

    env = cli_env(sim, tmp_path)
    name = unique_name("clo")
    ce = ComputeEngine(load_settings(env=env, cwd=tmp_path))
    v1, c = ce.c.v1, ce.c
    c.policies.insert_unary(project=sim.project, region=ce.region,
                            resource_policy_resource=v1.ResourcePolicy(
                                name=f"{name}-tpufab-wp", description=MADE_BY + name,
                                workload_policy=v1.ResourcePolicyWorkloadPolicy(
                                    type_="HIGH_THROUGHPUT", accelerator_topology="2x2x2")))
    c.templates.insert_unary(project=sim.project, instance_template_resource=v1.InstanceTemplate(
        name=f"{name}-tpufab-tt", description=MADE_BY + name,
        properties=v1.InstanceProperties(machine_type="tpu7x-standard-4t")))
    assert {x for x in ce.leftovers() if x[2] == name} == {
        ("instance template", f"{name}-tpufab-tt", name),
        ("workload policy", f"{name}-tpufab-wp", name)}
    try:
        ok(tpufab("create", "--name", name, "--type", "tpu7x-16", env=env, cwd=tmp_path))
        node = ce.get_node(name)
        assert node.state == "READY" and len(node.workers) == 2
        assert not [x for x in ce.leftovers() if x[2] == name]
    finally:
        tpufab("delete", "--name", name, "--yes", env=env, cwd=tmp_path)
