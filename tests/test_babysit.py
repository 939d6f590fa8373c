"""babysit: its decisions as data (spec, restore, API verdicts, attempt decisions, backoff,
the lock), then on a simulated v4-16: a failure that is not a preemption, restarts on failure,
giving up, workers that stay unreachable, one babysitter per node, Ctrl-C.

The preemption scenario itself is fault 5 in test_faults.py."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from harness import sim_node
from helpers import (
    TPUFAB,
    InThread,
    attempt_running,
    cli_env,
    facts_of,
    in_worker,
    text_of,
    unique_name,
    wait_for,
)
from rich.console import Console

from tpufab.cloud.nodes import Node, QueuedResourceInfo
from tpufab.config import Settings
from tpufab.errors import ConfigError
from tpufab.flows.babysit import loop, policy, records, recover
from tpufab.steps.runs.running import WorkerState

# ---------------------------------------------------------------------------------------------
# decisions as data


def node(name="pod", state="READY", *, spot=False, qr=None, runtime="tpu-ubuntu2204-base",
         labels=None, **fields) -> Node:
    return Node(name=name, project="p", zone="z", accelerator_type="v4-32", state=state,
                runtime_version=runtime, spot=spot, queued_resource=qr, labels=labels or {},
                **fields)


def queued(name="pod", state="ACTIVE", *, tier="spot", count=1, failure="") -> QueuedResourceInfo:
    return QueuedResourceInfo(name=name, project="p", zone="z", state=state, tier=tier,
                              accelerator_type="v4-32", runtime_version="rt", node_count=count,
                              failure=failure)


def test_node_spec_keeps_type_runtime_tier_and_queuing():
    plain = recover.NodeSpec.from_api("pod", [node(labels={"team": "ml"})], None)
    assert plain == recover.NodeSpec("pod", "v4-32", "tpu-ubuntu2204-base", "on-demand", False, 1,
                                {"team": "ml"}, external_ips=True, metadata={})
    spot = recover.NodeSpec.from_api("pod", [node(spot=True, qr="pod")], queued())
    assert (spot.tier, spot.queued, spot.num_slices) == ("spot", True, 1)
    multi = recover.NodeSpec.from_api("ms", [node("ms-0", qr="ms"), node("ms-1", qr="ms")],
                                 queued("ms", count=2))
    assert (multi.queued, multi.num_slices) == (True, 2)
    waiting = recover.NodeSpec.from_api("q", [], queued("q", "WAITING_FOR_RESOURCES", tier="guaranteed"))
    assert (waiting.accelerator_type, waiting.tier, waiting.queued) == ("v4-32", "on-demand", True)
    with pytest.raises(ConfigError, match="Nothing to babysit"):
        recover.NodeSpec.from_api("none", [], None)


def test_node_spec_settings_are_a_copy_with_the_spec():
    base = Settings(name="pod", project="p", preemptible=True, labels={"extra": "1"})
    wanted = recover.NodeSpec("pod", "v6e-8", "v2-alpha-tpuv6e", "spot", labels={"team": "ml"}
                         ).settings(base)
    assert (wanted.type, wanted.runtime_version) == ("v6e-8", "v2-alpha-tpuv6e")
    assert (wanted.spot, wanted.preemptible, wanted.reserved) == (True, False, False)
    assert wanted.labels == {"team": "ml", "extra": "1"}
    assert base.preemptible and base.type is None   # untouched


def test_node_spec_keeps_no_external_ips_metadata_and_network():
    """A node made with --internal-ips (the flag, not a setting) comes back without external
    IPs; an OS Login node keeps enable-oslogin (and its other metadata, not autostop's)."""
    from tpufab.cloud.bodies import node_body

    made = node(external_ips=False, network="projects/p/global/networks/vpc",
                subnetwork="projects/p/regions/r/subnetworks/s",
                metadata={"enable-oslogin": "TRUE", "startup-script": "echo hi",
                          "tpufab-autostop": '{"idle": 60}', "ssh-keys": "bob:ssh-ed25519 AAAA"})
    spec = recover.NodeSpec.from_api("pod", [made], None)
    assert spec.external_ips is False
    assert "no external IPs" in spec.describe()
    base = Settings(name="pod", project="p", metadata={"startup-script": "echo mine"})
    wanted = spec.settings(base)
    body = node_body(wanted, ssh_entry="tpufab:ssh-ed25519 BBBB tpufab")
    assert body["network_config"] == {"enable_external_ips": False,
                                      "network": "projects/p/global/networks/vpc",
                                      "subnetwork": "projects/p/regions/r/subnetworks/s"}
    assert body["metadata"]["enable-oslogin"] == "TRUE"
    assert body["metadata"]["startup-script"] == "echo mine"     # the settings' own wins
    assert "tpufab-autostop" not in body["metadata"]              # no watchdog on the new node
    assert body["metadata"]["ssh-keys"].splitlines() == ["bob:ssh-ed25519 AAAA",
                                                         "tpufab:ssh-ed25519 BBBB tpufab"]
    assert not base.internal_ip and base.network is None          # untouched
    # and the other way round: internal_ip (tpufab runs in the VPC) does not strip a node's
    # external IPs when it is recreated
    inside = Settings(name="pod", project="p", internal_ip=True)
    external = recover.NodeSpec.from_api("pod", [node(external_ips=True)], None).settings(inside)
    assert node_body(external)["network_config"]["enable_external_ips"] is True


def test_restore_reads_setup_commit_and_mounts_from_the_first_worker_that_answered():
    from tpufab.steps.health.status import StatusRow

    first = facts_of(1, setup=[{"hash": "a" * 16, "done": True, "mtime": 1.0},
                               {"hash": "b" * 16, "done": True, "mtime": 2.0},
                               {"hash": "c" * 16, "done": False, "mtime": 3.0}],
                     mounts=[{"at": "/mnt/d", "fstype": "fuse.rclone", "source": "tpufab:d",
                              "url": "gs://d/p"},
                             {"at": "/mnt/x", "fstype": "fuse.sshfs", "source": "h:/x"},
                             {"at": "/mnt/e", "fstype": "fuse.gcsfuse", "source": "e"}])
    found = recover.Restore.from_facts({0: StatusRow(0, False, error="refused"), 1: first})
    assert found.setup_hash == "b" * 16
    assert found.commit == "a" * 40 and found.deploy_dir == "/home/u/proj"
    assert found.mounts == [recover.MountPoint("gs://d/p", "/mnt/d", "rclone")]
    assert recover.Restore.from_facts({0: StatusRow(0, False)}) == recover.Restore()
    assert recover.Restore().describe() == "nothing"


@pytest.mark.parametrize("nodes,qr,expected,reason", [
    ([node()], None, ["pod"], None),
    ([node(state="PREEMPTED")], None, ["pod"], "TPU node pod was PREEMPTED"),
    ([node(state="TERMINATED")], None, ["pod"], "TPU node pod was TERMINATED"),
    ([], None, ["pod"], "TPU node pod is gone"),
    ([node(qr="pod")], queued(state="SUSPENDED"), ["pod"], "queued resource pod is SUSPENDED"),
    ([node(qr="pod")], queued(state="FAILED", failure="no capacity"), ["pod"],
     "queued resource pod is FAILED (no capacity)"),
    ([node("ms-0", qr="ms")], queued("ms", count=2), ["ms-0", "ms-1"], "TPU node ms-1 is gone"),
    ([node(state="CREATING")], None, ["pod"], None),
])
def test_api_reason(nodes, qr, expected, reason):
    assert policy.api_reason("pod", nodes, qr, expected) == reason


def ws(worker, state, code=None, detail=None):
    return WorkerState(worker, state, code, detail=detail)


@pytest.mark.parametrize("states,kw,expected", [
    ({0: ws(0, "exited", 0), 1: ws(1, "exited", 0)}, {}, ("finished", "w[0-1] exited 0")),
    ({0: ws(0, "exited", 0), 1: ws(1, "exited", 3)}, {}, ("failed", "w0 exited 0; w1 exited 3")),
    ({0: ws(0, "running"), 1: ws(1, "exited", 3)}, {"first_failure_at": 95.0},
     ("wait", "")),
    ({0: ws(0, "running"), 1: ws(1, "exited", 3)}, {"first_failure_at": 80.0},
     ("stop-others", "w0 running; w1 exited 3")),
    ({0: ws(0, "running"), 1: ws(1, "unreachable", detail="refused")},
     {"unreachable_since": {1: 99.0}}, ("wait", "")),
    ({0: ws(0, "running"), 1: ws(1, "unreachable", detail="refused")},
     {"unreachable_since": {1: 30.0}},
     ("lost", "w1 unreachable for 70 s while the API says the node is READY")),
    ({0: ws(0, "running")}, {"api": "TPU node pod was PREEMPTED"},
     ("preempted", "TPU node pod was PREEMPTED")),
    ({0: ws(0, "exited", 0), 1: ws(1, "no record")}, {}, ("failed", "w0 exited 0; w1 no record")),
    ({0: ws(0, "exited", 0)}, {}, ("wait", "")),          # w1 has not said anything yet
])
def test_decide(states, kw, expected):
    options = {"api": None, "unreachable_since": {}, "now": 100.0, "unreachable_grace": 60.0,
               "first_failure_at": None, "failure_grace": 10.0, **kw}
    decision = policy.decide([0, 1] if len(states) > 1 or expected[0] == "wait" else [0], states,
                         **options)
    assert (decision.action, decision.reason) == expected


@pytest.mark.parametrize("restart,expected", [(0, 0), (1, 10), (2, 20), (3, 40), (6, 300),
                                               (60, 300)])
def test_backoff_doubles_up_to_the_cap(restart, expected):
    assert policy.backoff_delay(restart, 10, 300) == expected
    assert policy.backoff_delay(restart, 0, 300) == 0


def test_lock_one_babysitter_per_node_and_stale_locks(tmp_path):
    settings = Settings(name="pod", project="p", zone="z", state_dir=str(tmp_path))
    path = loop.Lock.for_node(settings).path
    assert path == tmp_path / "babysit" / "p.z.pod.lock"
    # a stale file from a babysitter that died (no flock held): taken over
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"pid": 999999999, "host": "gone", "what": "old"}))
    with loop.Lock.for_node(settings) as first:
        first.acquire("babysit a.sh on pod")
        assert json.loads(path.read_text())["pid"] == os.getpid()
        with pytest.raises(policy.BabysitError, match=rf"Another babysit \(pid {os.getpid()} on "):
            loop.Lock.for_node(settings).acquire("again")
        # another process is refused too, and told who holds it
        probe = subprocess.run([sys.executable, "-c", textwrap.dedent(f"""
            from tpufab.flows.babysit.loop import Lock
            from tpufab.flows.babysit.policy import BabysitError
            from pathlib import Path
            try:
                Lock(Path({str(path)!r})).acquire("x")
            except BabysitError as err:
                print(err)
            """)], capture_output=True, text=True, timeout=30)
        assert f"pid {os.getpid()}" in probe.stdout and "babysit a.sh on pod" in probe.stdout
    with loop.Lock.for_node(settings) as again:   # released: free again
        again.acquire("next")


def test_a_killed_babysitter_leaves_no_lock_behind(tmp_path):
    path = tmp_path / "x.lock"
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys
        from pathlib import Path
        from tpufab.flows.babysit.loop import Lock
        Lock(Path({str(path)!r})).acquire("held")
        print("held", flush=True)
        sys.stdin.read()
        """)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(policy.BabysitError, match=f"pid {holder.pid}"):
            loop.Lock(path).acquire("me")
    finally:
        holder.kill()
        holder.wait(10)
    lock = loop.Lock(path)
    lock.acquire("me")      # SIGKILL released the flock
    lock.release()


# ---------------------------------------------------------------------------------------------
# on the simulated pod


RECIPE = """#!/bin/sh
# attempt 0 of worker $FAIL_WORKER exits $FAIL_CODE at once; the others wait for /tmp/$GO
echo "attempt $TPUFAB_RESTART_COUNT w$TPUFAB_WORKER_ID babysit=$TPUFAB_BABYSIT_RUN"
if [ "$TPUFAB_RESTART_COUNT" -lt "${FAIL_UNTIL:-1}" ] && [ "$TPUFAB_WORKER_ID" = "$FAIL_WORKER" ]; then
    echo "failing on purpose" >&2
    exit "$FAIL_CODE"
fi
if [ "$TPUFAB_RESTART_COUNT" -lt "${WAIT_UNTIL:-1}" ]; then
    while [ ! -e "/tmp/$GO" ]; do sleep 0.05; done
fi
echo "done $TPUFAB_RESTART_COUNT"
"""


@pytest.fixture(scope="module")
def pod2(sim, tmp_path_factory):
    """A READY v4-16 (2 workers), shared by the scenarios below."""
    with sim_node(sim, tmp_path_factory, "bs", "v4-16") as pod:
        pod.recipe = pod.home / "recipe.sh"
        pod.recipe.write_text(RECIPE)
        pod.recipe.chmod(0o755)
        yield pod


def current_node(pod2):
    from tpufab.cloud.planes.tpu import TpuApi

    return TpuApi(pod2.settings).get_node(pod2.name)


def babysitter(pod2, tmp_path, monkeypatch, *, env=(), **options):
    for spec in env:
        key, _, value = spec.partition("=")
        monkeypatch.setenv(key, value)
    notes = io.StringIO()
    options.setdefault("poll", 0.3)
    options.setdefault("backoff", (0.0, 0.0))
    options.setdefault("failure_grace", 1.0)
    return loop.Babysitter(pod2.settings, pod2.recipe, no_deploy=True,
                           env=[e.partition("=")[0] for e in env],
                           console=Console(file=notes, width=300), base_dir=tmp_path,
                           **options), notes


RUNNING = "recipe/recipe.sh"    # how the recipe shows in ps: run_worker.py runs its own copy


def no_recipe_left(pod2, node) -> None:
    for w in (0, 1):
        wait_for(lambda w=w: RUNNING not in in_worker(pod2.sim, node, w, "ps -eo args"),
                 15, what=f"no recipe left on w{w}")


@pytest.mark.sim
def test_a_recipe_failing_on_its_own_is_not_a_preemption(pod2, tmp_path, monkeypatch):
    go = unique_name("go")
    sitter, notes = babysitter(pod2, tmp_path, monkeypatch,
                               env=[f"GO={go}", "FAIL_WORKER=1", "FAIL_CODE=3"])
    before = current_node(pod2).id
    with pytest.raises(policy.BabysitError) as failed:
        sitter.run()
    err = failed.value
    assert err.exit_code == 3
    assert "failed on its own (w0 killed (SIGTERM); w1 exited 3)" in str(err)
    assert "not a preemption" in str(err) and "--restart-on-failure" in str(err)
    assert len(sitter.attempts) == 1 and sitter.attempts[0].outcome == "failed"
    assert current_node(pod2).id == before              # the node was left alone
    assert "stopping the run on w0" in notes.getvalue()  # w0 would have waited forever
    no_recipe_left(pod2, pod2.node)
    logs = sitter.log_dir / "attempt-0"
    assert "failing on purpose" in (logs / "w1.log").read_text()
    assert "attempt 0 w0" in (logs / "w0.log").read_text()


@pytest.mark.sim
def test_restart_on_failure_restarts_on_the_same_node(pod2, tmp_path, monkeypatch):
    go = unique_name("go")
    sitter, notes = babysitter(pod2, tmp_path, monkeypatch, restart_on_failure=True,
                               env=[f"GO={go}", "FAIL_WORKER=0", "FAIL_CODE=1", "WAIT_UNTIL=0"])
    before = current_node(pod2).id
    result = sitter.run()
    assert result.exit_code == 0 and result.restarts == 1
    assert [a.outcome for a in result.attempts] == ["failed", "finished"]
    assert current_node(pod2).id == before
    second = (result.log_dir / "attempt-1" / "w0.log").read_text()
    assert f"attempt 1 w0 babysit={result.run_id}" in second and "done 1" in second
    summary = json.loads((result.log_dir / "babysit.json").read_text())
    assert [a["outcome"] for a in summary["attempts"]] == ["failed", "finished"]


@pytest.mark.sim
def test_babysit_gives_up_after_max_restarts(pod2, tmp_path, monkeypatch):
    go = unique_name("go")
    sitter, notes = babysitter(pod2, tmp_path, monkeypatch, restart_on_failure=True,
                               max_restarts=1, backoff=(0.2, 1.0),
                               env=[f"GO={go}", "FAIL_WORKER=0", "FAIL_CODE=4",
                                    "FAIL_UNTIL=9", "WAIT_UNTIL=0"])
    with pytest.raises(policy.BabysitError, match=r"Gave up after 1 restart \(--max-restarts 1; "
                                              r"by reason: 1 error\)"):
        sitter.run()
    assert [a.outcome for a in sitter.attempts] == ["failed", "failed"]
    assert "restarting in 0.2 s (restart 1 of 1)" in notes.getvalue()


@pytest.mark.sim
def test_workers_unreachable_while_the_api_says_ready_are_recovered(pod2, tmp_path, monkeypatch,
                                                                    sim_admin):
    go = unique_name("go")
    sitter, notes = babysitter(pod2, tmp_path, monkeypatch, unreachable_grace=1.0,
                               env=[f"GO={go}", "FAIL_WORKER=9", "FAIL_CODE=0"])
    before = current_node(pod2)
    thread = InThread(sitter.run)
    result = thread.outcome
    try:
        wait_for(lambda: sitter.log_dir is not None and
                 "attempt 0 w1" in text_of(sitter.log_dir / "attempt-0" / "w1.log"), 30,
                 what="attempt 0 to start")
        sim_admin.set_reachable(pod2.name, 1, False)
        sim_admin.kill_sshd(pod2.name, 1)       # cut the follower's connection too
        thread.join(90)
    finally:
        sim_admin.set_reachable(pod2.name, 1, True)
    assert not thread.is_alive()
    assert "error" not in result, result.get("error")
    done = result["value"]
    assert [a.outcome for a in done.attempts] == ["lost", "finished"]
    assert "w1 unreachable for" in done.attempts[0].reason
    after = current_node(pod2)
    assert after.id != before.id and after.state == "READY"      # deleted and recreated
    pod2.node = after
    assert "done 1" in (done.log_dir / "attempt-1" / "w1.log").read_text()


@pytest.mark.sim
def test_a_second_babysit_refuses_and_ctrl_c_stops_the_run(pod2, tmp_path):
    go = unique_name("go")
    env = {**cli_env(pod2.sim, pod2.home, pod2.name), "GO": go, "FAIL_WORKER": "9",
           "FAIL_CODE": "0"}
    babysit = [TPUFAB, "babysit", str(pod2.recipe), "--no-deploy", "--env", "GO"]
    first = subprocess.Popen(babysit, env=env, cwd=tmp_path, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    try:
        node = current_node(pod2)
        wait_for(lambda: all(RUNNING in in_worker(pod2.sim, node, w, "ps -eo args")
                             for w in (0, 1)), 60, what="the babysat run to start")
        second = subprocess.run(babysit, env=env, cwd=tmp_path, capture_output=True, text=True,
                                timeout=60)
        assert second.returncode == 1
        assert f"Another babysit (pid {first.pid} on" in second.stderr
        assert "Traceback" not in second.stderr
        first.send_signal(signal.SIGINT)
        out, err = first.communicate(timeout=60)
    finally:
        if first.poll() is None:
            first.kill()
            first.communicate(timeout=10)
    assert first.returncode == 130, err
    assert "Interrupted: stopped run" in err and "Traceback" not in err
    no_recipe_left(pod2, node)
    runs = list((tmp_path / ".tpufab" / "runs").glob("*/babysit.json"))
    assert len(runs) == 1
    assert json.loads(runs[0].read_text())["attempts"][0]["outcome"] == "interrupted"
    # the lock went with it: babysit starts again (and this time the recipe finishes)
    for w in (0, 1):
        in_worker(pod2.sim, node, w, f"touch /tmp/{go}")
    third = subprocess.run(babysit, env=env, cwd=tmp_path, capture_output=True, text=True,
                           timeout=120)
    assert third.returncode == 0, third.stderr
    assert "finished after 0 restarts" in third.stderr


# ---------------------------------------------------------------------------------------------
# restart budgets (issue 27): errors have a budget, the platform's losses do not use it

def test_budget_and_exit_code_input_is_checked_in_one_sentence():
    assert policy.restart_budget(2) == 2 and policy.restart_budget("0") == 0
    assert policy.exit_codes("42, 143") == {42, 143} and policy.exit_codes([42, "143"]) == {42, 143}
    assert policy.exit_codes("") == frozenset()
    for bad in (-1, "two", True):
        with pytest.raises(ConfigError, match=r"^--max-restarts-on-errors takes a whole "
                                                 r"number of restarts, 0 or more, not .*\.$"):
            policy.restart_budget(bad)
    for bad in ("42,x", "0", "256", "42,,143", "-1"):
        with pytest.raises(ConfigError, match=r"^--restart-on-exit takes exit codes from 1 "
                                                 r"to 255 separated by commas, such as 42,143, "
                                                 r"not .*\.$"):
            policy.exit_codes(bad)


def test_signals_count_as_128_plus_n_and_restarts_are_counted_by_reason(tmp_path):
    assert policy.state_exit_code(WorkerState(0, "killed", signal="SIGTERM")) == 143
    assert policy.state_exit_code(WorkerState(0, "exited", exit_code=42)) == 42
    assert policy.recovery_reason("preempted", "TPU node p was PREEMPTED", {}) == "preempted"
    assert policy.recovery_reason("preempted", "TPU node p was TERMINATED",
                              {0: "maintenance: TERMINATE_ON_HOST_MAINTENANCE (x)"}) == \
        "maintenance"
    assert policy.recovery_reason("lost", "w1 unreachable for 300 s", {}) == "host failure"
    attempts = [records.Attempt(i, f"r{i}", o, "", tmp_path, restart=k and "x", restart_kind=k)
                for i, (o, k) in enumerate([("failed", "error"), ("preempted", "preempted"),
                                            ("failed", "error"), ("failed", "")])]
    assert records.restart_counts(attempts) == {"error": 2, "preempted": 1}
    assert records.counts_text(attempts) == "3 restarts: 2 error, 1 preempted"


BUDGETED = """#!/bin/sh
# attempts 0 and 2 exit 1 on every worker; attempt 1 runs until the node is preempted under it
echo "attempt $TPUFAB_RESTART_COUNT w$TPUFAB_WORKER_ID"
if [ "$TPUFAB_RESTART_COUNT" = 1 ]; then
    while true; do sleep 0.05; done
fi
echo "failing on purpose" >&2
exit 1
"""


@pytest.mark.sim
def test_error_budget_restarts_once_and_a_preemption_does_not_use_it(pod2, tmp_path,
                                                                      monkeypatch, sim_admin):
    recipe = tmp_path / "budgeted.sh"
    recipe.write_text(BUDGETED)
    recipe.chmod(0o755)
    sitter, notes = babysitter(pod2, tmp_path, monkeypatch, max_restarts_on_errors=1)
    sitter.recipe = recipe
    before = current_node(pod2)
    thread = InThread(sitter.run)
    outcome = thread.outcome
    attempt_running(sitter, thread, 1, (0, 1), 90,
                    "attempt 1 to be running (after one restart on the error budget)")
    sim_admin.preempt(pod2.name)
    thread.join(180)
    assert not thread.is_alive(), "babysit did not end"
    pod2.node = current_node(pod2)
    assert pod2.node.id != before.id          # the preemption was recovered (recreated)
    err = outcome.get("error")
    assert isinstance(err, policy.BabysitError), outcome
    assert err.exit_code == 1
    assert [a.outcome for a in sitter.attempts] == ["failed", "preempted", "failed"]
    said = notes.getvalue()
    assert "babysit: exit 1 (error budget 1 of 1 used): attempt 0 failed" in said
    assert "babysit: preempted: attempt 1 preempted" in said
    assert "its error budget is spent (1 of 1 used)" in str(err)
    assert "after 2 restarts: 1 error, 1 preempted" in str(err)
    summary = json.loads((sitter.log_dir / "babysit.json").read_text())
    assert summary["restarts"] == {"error": 1, "preempted": 1}
    assert summary["errors_used"] == 1
    assert [a.get("restart") for a in summary["attempts"]] == \
        ["exit 1 (error budget 1 of 1 used)", "preempted", None]


EXITS = """#!/bin/sh
# attempt 0 exits 42, attempt 1 is killed by SIGTERM (143), attempt 2 finishes
echo "attempt $TPUFAB_RESTART_COUNT w$TPUFAB_WORKER_ID"
case "$TPUFAB_RESTART_COUNT" in
    0) exit 42 ;;
    1) kill -TERM $$; sleep 5; exit 7 ;;
esac
echo "done $TPUFAB_RESTART_COUNT"
"""


@pytest.mark.sim
def test_restart_on_exit_restarts_those_codes_without_an_error_budget(pod2, tmp_path,
                                                                       monkeypatch):
    recipe = tmp_path / "exits.sh"
    recipe.write_text(EXITS)
    recipe.chmod(0o755)
    sitter, notes = babysitter(pod2, tmp_path, monkeypatch, restart_on_exit="42,143")
    sitter.recipe = recipe
    result = sitter.run()
    assert result.exit_code == 0
    assert [a.outcome for a in result.attempts] == ["failed", "failed", "finished"]
    said = notes.getvalue()
    assert "babysit: exit 42 (--restart-on-exit): attempt 0 failed" in said
    assert "babysit: exit 143 (--restart-on-exit): attempt 1 failed" in said
    assert "finished after 2 restarts: 1 exit 42, 1 exit 143" in said
    assert result.restart_counts == {"exit 42": 1, "exit 143": 1}
    assert sitter.errors_used == 0


@pytest.mark.sim
def test_bad_budget_flags_are_one_sentence(pod2, tmp_path):
    from helpers import one_sentence, tpufab

    env = cli_env(pod2.sim, pod2.home, pod2.name)
    bad_budget = tpufab("babysit", str(pod2.recipe), "--no-deploy",
                        "--max-restarts-on-errors", "-1", env=env, cwd=tmp_path)
    one_sentence(bad_budget, "--max-restarts-on-errors takes a whole number", "not -1.")
    bad_codes = tpufab("babysit", str(pod2.recipe), "--no-deploy", "--restart-on-exit",
                       "42,oops", env=env, cwd=tmp_path)
    one_sentence(bad_codes, "--restart-on-exit takes exit codes", "not oops.")


CHECKPOINTS = """#!/bin/bash
# attempt 0 waits for the checkpoint signal, says why, and exits 0; attempt 1 finishes
echo "attempt $TPUFAB_RESTART_COUNT w$TPUFAB_WORKER_ID"
if [ "$TPUFAB_RESTART_COUNT" = 0 ]; then
    trap 'echo "checkpointing: $(cat "$TPUFAB_PREEMPT_NOTICE")"; exit 0' USR1
    while true; do sleep 0.1; done
fi
echo "done $TPUFAB_RESTART_COUNT"
"""


@pytest.mark.sim
def test_before_maintenance_signals_the_recipe_then_restarts_it(pod2, tmp_path, monkeypatch,
                                                                sim_admin):
    recipe = tmp_path / "checkpoints.sh"
    recipe.write_text(CHECKPOINTS)
    recipe.chmod(0o755)
    # the window starts in an hour; with a 2 h margin it is due at once
    sim_admin.schedule_maintenance(pod2.name, 3600)
    try:
        sitter, notes = babysitter(pod2, tmp_path, monkeypatch, before_maintenance="usr1",
                                   maintenance_margin="2h", maintenance_poll=0.5)
        sitter.recipe = recipe
        before = current_node(pod2).id
        result = sitter.run()
    finally:
        sim_admin.schedule_maintenance(pod2.name, 0, clear=True)
    assert result.exit_code == 0
    assert [a.outcome for a in result.attempts] == ["maintenance", "finished"]
    assert result.restart_counts == {"maintenance": 1}
    assert current_node(pod2).id == before                   # the same node, restarted
    said = notes.getvalue()
    assert f"babysit: maintenance window on {pod2.name} at " in said
    assert "sent SIGUSR1 to run" in said and "on w[0-1] to checkpoint" in said
    assert "babysit: maintenance: attempt 0 maintenance" in said
    assert said.count("sent SIGUSR1") == 1                   # once per window
    for w in (0, 1):
        first = (result.log_dir / "attempt-0" / f"w{w}.log").read_text()
        assert "checkpointing: maintenance: SCHEDULED window on" in first
        assert "tpufab: notice: maintenance: SCHEDULED window" in first
        assert "done 1" in (result.log_dir / "attempt-1" / f"w{w}.log").read_text()


def test_before_maintenance_input_is_checked_in_one_sentence():
    assert policy.signal_name("USR1") == "USR1" and policy.signal_name("sigterm") == "TERM"
    for bad in ("NOPE", "KILL", ""):
        with pytest.raises(ConfigError, match=r"^--before-maintenance takes the signal the "
                                                 r"recipe checkpoints on, such as TERM, USR1 "
                                                 r"or INT, not .*\.$"):
            policy.signal_name(bad)


# ---------------------------------------------------------------------------------------------
# the stall watchdog in babysit (issue 27): stacks into the attempt's logs, then restart

STALLS = '''\
import os
import time

ATTEMPT = os.environ["TPUFAB_RESTART_COUNT"]


def wait_for_a_batch():
    time.sleep(600)


print(f"attempt {ATTEMPT} w{os.environ['TPUFAB_WORKER_ID']}", flush=True)
if ATTEMPT == "0":
    wait_for_a_batch()
print(f"done {ATTEMPT}", flush=True)
'''

# prints nothing at all; worker 1 touches the progress file for a while, then both hang
TOUCHES = '''\
import os
import pathlib
import time

PROGRESS = pathlib.Path(os.environ["TPUFAB_RUN_DIR"]) / "progress"


def train():
    end = time.monotonic() + 15
    while time.monotonic() < end:
        PROGRESS.touch()
        time.sleep(0.5)


def hang():
    time.sleep(600)


if os.environ["TPUFAB_WORKER_ID"] == "1":
    train()
hang()
'''


def py_spy_on(pod2) -> None:
    """py-spy for the workers: the simulated pod's shared site carries it."""
    from helpers import build_shared_site

    build_shared_site([Path(pod2.sim.state_dir) / "share"])


@pytest.mark.sim
def test_a_stall_restarts_the_attempt_with_its_stacks_in_the_attempt_logs(pod2, tmp_path,
                                                                           monkeypatch):
    """Attempt 0 goes silent (inside wait_for_a_batch); --stall 10s --stall-action restart
    takes both workers' stacks into attempt-0's logs, stops it and starts attempt 1, which
    finishes. The stall is its own reason and leaves the error budget (0) alone."""
    py_spy_on(pod2)
    recipe = tmp_path / "stalls.py"
    recipe.write_text(STALLS)
    sitter, notes = babysitter(pod2, tmp_path, monkeypatch, stall="10s",
                               stall_action="restart")
    sitter.recipe = recipe
    result = sitter.run()
    said = " ".join(notes.getvalue().split())    # rich wraps the long lines
    assert result.exit_code == 0, said
    assert [a.outcome for a in result.attempts] == ["stalled", "finished"]
    assert result.restart_counts == {"stalled": 1} and sitter.errors_used == 0
    assert "babysit: no new output from any worker for 10s (--stall 10s): taking every " \
           "worker's stacks" in said
    assert "w[0-1] · `" in said and "wait_for_a_batch (stalls.py:" in said   # folded
    assert "(--stall-action restart) ..." in said
    assert "babysit: stalled (--stall-action restart): attempt 0 stalled (no new output " \
           "for 10s; stacks: " in said
    assert "finished after 1 restart: 1 stalled" in said
    saved = list((result.log_dir / "attempt-0").glob("stacks-*.txt"))
    assert len(saved) == 1 and "wait_for_a_batch (stalls.py:" in saved[0].read_text()
    assert "done 1" in (result.log_dir / "attempt-1" / "w1.log").read_text()
    summary = json.loads((result.log_dir / "babysit.json").read_text())
    assert summary["restarts"] == {"stalled": 1} and summary["errors_used"] == 0
    assert summary["stall"] == {"seconds": 10.0, "action": "restart", "progress_file": None}
    assert summary["attempts"][0]["restart"] == "stalled (--stall-action restart)"


@pytest.mark.sim
def test_a_progress_file_is_progress_until_it_stops_advancing(pod2, tmp_path, monkeypatch):
    """No output at all, but worker 1 touches $TPUFAB_RUN_DIR/progress for 15 s: with
    --stall-progress-file progress the 10 s watchdog stays quiet while any worker touches it,
    and fires once it stops (the stacks show both workers in hang(), none in train())."""
    py_spy_on(pod2)
    recipe = tmp_path / "touches.py"
    recipe.write_text(TOUCHES)
    sitter, notes = babysitter(pod2, tmp_path, monkeypatch, stall="10s", stall_action="kill",
                               stall_progress_file="progress")
    sitter.recipe = recipe
    with pytest.raises(policy.BabysitError) as stalled:
        sitter.run()
    said = " ".join(notes.getvalue().split())
    err = stalled.value
    assert err.exit_code == 124, said
    assert "babysit: the progress file progress did not advance on any worker for 10s " \
           "(--stall 10s --stall-progress-file progress): taking every worker's stacks" in said
    assert said.count("taking every worker's stacks") == 1
    assert "stalled: the progress file progress did not advance on any worker for 10s" \
        in str(err)
    assert "(--stall-action kill), so babysit stops here after 0 restarts" in str(err)
    [saved] = (sitter.log_dir / "attempt-0").glob("stacks-*.txt")
    stacks = saved.read_text()
    assert "hang (touches.py:" in stacks and "train (" not in stacks
    assert [a.outcome for a in sitter.attempts] == ["stalled"]
    no_recipe_left(pod2, pod2.node)


@pytest.mark.sim
def test_bad_stall_flags_are_one_sentence(pod2, tmp_path):
    from helpers import one_sentence, tpufab

    env = cli_env(pod2.sim, pod2.home, pod2.name)
    recipe = str(pod2.recipe)
    cases = [
        (("babysit", "--stall", "5s"),
         ("--stall 5s is below the floor of 10 s", "use --stall 10s or more.")),
        (("babysit", "--stall", "1m", "--stall-action", "later"),
         ("--stall-action takes wait, kill or restart, not 'later'.",)),
        (("babysit", "--stall", "1m", "--stall-progress-file", "../progress"),
         ("--stall-progress-file ", "has a '..' part",)),
        (("babysit", "--stall", "1m", "--stall-progress-file", ""),
         ("--stall-progress-file needs a file the recipe touches", "it was empty.")),
        (("babysit", "--stall-progress-file", "progress"),
         ("--stall-progress-file says what progress means", "add --stall")),
        (("babysit", "--stall", "1m", "--ray"),
         ("--stall watches the output of a recipe tpufab runs, and --ray hands the recipe to "
          "Ray: give one or the other.",)),
        (("run", "--stall", "1m", "--stall-action", "restart"),
         ("--stall-action restart needs something to start the next attempt, which only "
          "babysit does", "`tpufab babysit RECIPE --stall DURATION --stall-action restart`")),
    ]
    for argv, fragments in cases:
        one_sentence(tpufab(*argv, "--no-deploy", recipe, env=env, cwd=tmp_path), *fragments)
