"""kill_worker.py against real processes, each scenario in a throwaway PID + mount namespace.

Every scenario runs this file as PID 1 of a fresh `unshare --pid --mount` namespace with a
tmpfs on /tmp (fake device files, lockfiles, run records live there), so no host process is
ever in reach of the kill, and everything the scenario started dies with its PID 1. The
worker-side scripts run as they are shipped, under /usr/bin/python3, as on a worker.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import WORKER_PYTHON, process_alive, process_start_time, shipped_bytes

from tpufab.ssh.remote_files import read_answer

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = ("run_worker.py", "kill_worker.py", "zombie_worker.py")
REMOTE = Path("/tmp/tpufab-remote")   # inside a scenario's own /tmp
DEV = "/tmp/dev"
LOCK = "/tmp/libtpu_lockfile"
SO_LOCK = "/tmp/libtpu.so_lockfile"
GLOBS = ["--devices-glob", f"{DEV}/accel*", "--devices-glob", f"{DEV}/vfio/[0-9]*"]


# -- the in-namespace side ------------------------------------------------------------------


def _make_devices(accel=4, vfio=4):
    os.makedirs(f"{DEV}/vfio", exist_ok=True)
    for i in range(accel):
        Path(f"{DEV}/accel{i}").touch()
    for i in range(vfio):
        Path(f"{DEV}/vfio/{i}").touch()
    Path(f"{DEV}/vfio/vfio").touch()   # the vfio container device: not a TPU


def _zombies(*flags):
    out = subprocess.run([WORKER_PYTHON, str(REMOTE / "zombie_worker.py"), *flags],
                         capture_output=True, text=True, timeout=30, check=True).stdout
    return read_answer(out)["zombies"]


def _tpukill(*flags):
    proc = subprocess.run([WORKER_PYTHON, str(REMOTE / "kill_worker.py"), *GLOBS,
                           "--run-dir", "/tmp/runs", *flags],
                          capture_output=True, text=True, timeout=60)
    return {"rc": proc.returncode, "report": read_answer(proc.stdout), "stderr": proc.stderr}


def _wait_for(condition, what: str, timeout=30.0):
    """helpers' wait_for for the scenario side, which runs without pytest."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(0.02)
    return True


def _facts(zombies, kill, **extra):
    return {"zombies": zombies, "kill": kill,
            "alive": {str(z["pid"]): process_alive(z["pid"]) for z in zombies},
            "lockfile_exists": os.path.exists(LOCK), **extra}


def scenario(name):
    # The shipped scripts (and the checkout) may live under /tmp, which the tmpfs below
    # covers: keep them by copying them into the new /tmp.
    scripts = {script: shipped_bytes(script) for script in SCRIPTS}
    subprocess.run(["mount", "-t", "tmpfs", "tpufab-test", "/tmp"], check=True)
    REMOTE.mkdir()
    for script, data in scripts.items():
        (REMOTE / script).write_bytes(data)
    if name == "noop":
        _make_devices()
        return {"kill": _tpukill("--grace", "1")}
    if name in ("mess", "dry_run", "force"):
        _make_devices()
        zombies = _zombies(*GLOBS, "--lockfile", LOCK, "--holders", "2", "--ignore-term", "1",
                           "--lock-holder")
        flags = {"mess": [], "dry_run": ["--dry-run"], "force": ["--force"]}[name]
        return _facts(zombies, _tpukill("--grace", "0.5", *flags))
    if name == "families":
        _make_devices(accel=4, vfio=2)
        accel = _zombies("--devices-glob", f"{DEV}/accel*", "--lockfile", LOCK,
                         "--holders", "1", "--ignore-term", "0", "--no-protected")
        vfio = _zombies("--devices-glob", f"{DEV}/vfio/[0-9]*", "--lockfile", SO_LOCK,
                        "--holders", "1", "--ignore-term", "0", "--no-protected")
        return _facts(accel + vfio, _tpukill("--grace", "2"),
                      so_lockfile_exists=os.path.exists(SO_LOCK))
    if name == "protected_lock":
        _make_devices()
        zombies = _zombies(*GLOBS, "--lockfile", LOCK, "--holders", "1", "--ignore-term", "0",
                           "--lock-holder", "--lock-holder-name", "tpu-runtime",
                           "--no-protected")
        return _facts(zombies, _tpukill("--grace", "2"))
    if name == "null_clone":
        # A placeholder made as a copy of /dev/null: holding /dev/null is not holding a TPU.
        os.makedirs(DEV)
        subprocess.run(["mknod", f"{DEV}/accel0", "c", "1", "3"], check=True)
        bystander = subprocess.Popen(["sleep", "300"], stdin=subprocess.DEVNULL,
                                     start_new_session=True)
        zombies = _zombies("--devices-glob", f"{DEV}/accel*", "--lockfile", LOCK,
                           "--holders", "1", "--ignore-term", "0", "--no-protected")
        return _facts(zombies, _tpukill("--grace", "2"), bystander_alive=process_alive(bystander.pid))
    if name == "runs":
        _make_devices()
        recipe = Path("/tmp/recipe.sh")
        recipe.write_text("#!/bin/sh\nsleep 300 &\necho child $!\nwait\n")
        started = read_answer(subprocess.run(
            [WORKER_PYTHON, str(REMOTE / "run_worker.py"), "start", "--run-dir", "/tmp/runs",
             "--run", "real", "--recipe", str(recipe)],
            capture_output=True, text=True, timeout=30, check=True).stdout)
        log = Path("/tmp/runs/real/log")
        _wait_for(lambda: log.exists() and "child" in log.read_text(), "the recipe's child")
        child = int(log.read_text().split()[1])
        # A run that ended but left a child behind in a session of its own.
        leaky = Path("/tmp/leaky.sh")
        leaky.write_text("#!/bin/sh\nsetsid sleep 300 </dev/null >/dev/null 2>&1 &\n"
                         "echo leak $!\n")
        subprocess.run([WORKER_PYTHON, str(REMOTE / "run_worker.py"), "start", "--run-dir",
                        "/tmp/runs", "--run", "leaky", "--recipe", str(leaky)],
                       capture_output=True, text=True, timeout=30, check=True)
        _wait_for(lambda: Path("/tmp/runs/leaky/exit_code").exists(), "the leaky run to end")
        leaked = int(Path("/tmp/runs/leaky/log").read_text().split()[1])
        assert process_alive(leaked)
        # A recorded run whose pid now belongs to another process (pid reuse).
        bystander = subprocess.Popen(["sleep", "300"], start_new_session=True)
        fake = Path("/tmp/runs/reused")
        fake.mkdir(parents=True)
        (fake / "pid").write_text(f"{bystander.pid}\n")
        (fake / "pgid").write_text(f"{bystander.pid}\n")
        (fake / "start_time").write_text(f"{process_start_time(bystander.pid) - 1}\n")
        kill = _tpukill("--grace", "2")
        recorded = _wait_for(lambda: Path("/tmp/runs/real/killed").exists(),
                             "the kill recorded in the run")
        return {"kill": kill, "recipe_pid": started["pid"], "child_pid": child,
                "recipe_alive": process_alive(started["pid"]), "child_alive": process_alive(child),
                "bystander_pid": bystander.pid, "bystander_alive": process_alive(bystander.pid),
                "leaked_pid": leaked, "leaked_alive": process_alive(leaked),
                "killed_recorded": recorded and Path("/tmp/runs/real/killed").read_text()}
    raise SystemExit(f"unknown scenario {name}")


# -- the pytest side --------------------------------------------------------------------------


def _namespaces_usable():
    if shutil.which("unshare") is None or os.geteuid() != 0:
        return False
    probe = subprocess.run(["unshare", "--pid", "--mount", "--fork", "--mount-proc", "true"],
                           capture_output=True, timeout=30)
    return probe.returncode == 0


pytestmark = [pytest.mark.sim,
              pytest.mark.skipif(not _namespaces_usable(),
                                 reason="needs root and unshare --pid --mount (namespaces)")]


def run_scenario(name):
    proc = subprocess.run(
        ["unshare", "--pid", "--mount", "--fork", "--mount-proc", "--propagation", "private",
         sys.executable, __file__, name],
        capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def by_role(facts):
    return {z["role"]: z for z in facts["zombies"]}


def killed_pids(report):
    return {entry["pid"]: entry for entry in report["killed"]}


def test_clears_the_mess_but_spares_the_protected_process():
    facts = run_scenario("mess")
    report, roles = facts["kill"]["report"], by_role(facts)
    killed = killed_pids(report)
    for role in ("holder-0", "holder-1", "lock-holder"):
        assert facts["alive"][str(roles[role]["pid"])] is False, role
        assert roles[role]["pid"] in killed, role
    assert killed[roles["holder-0"]["pid"]]["signal"] == "KILL"    # it ignores SIGTERM
    assert killed[roles["holder-1"]["pid"]]["signal"] == "TERM"
    protected = roles["protected"]["pid"]
    assert facts["alive"][str(protected)] is True
    assert [p["pid"] for p in report["protected"]] == [protected]
    assert report["protected"][0]["holds"] == [f"{DEV}/accel0"]
    assert report["device_free"] is True and report["failed"] == []
    assert facts["lockfile_exists"] is False
    assert report["lockfiles_removed"] == [LOCK]
    assert {e["path"]: e["action"] for e in report["lockfiles"]} == {
        LOCK: "removed", SO_LOCK: "absent"}
    assert f"{DEV}/vfio/vfio" not in report["devices"]
    assert facts["kill"]["rc"] == 0 and report["noop"] is False


def test_dry_run_only_reports():
    facts = run_scenario("dry_run")
    report, roles = facts["kill"]["report"], by_role(facts)
    assert all(facts["alive"].values())
    assert facts["lockfile_exists"] is True
    assert report["killed"] == []
    would = {entry["pid"] for entry in report["would_kill"]}
    assert would == {roles[r]["pid"] for r in ("holder-0", "holder-1", "lock-holder")}
    assert [p["pid"] for p in report["protected"]] == [roles["protected"]["pid"]]
    assert {e["path"]: e["action"] for e in report["lockfiles"]}[LOCK] == "would remove"


def test_force_stops_the_protected_holder_too():
    facts = run_scenario("force")
    report = facts["kill"]["report"]
    assert not any(facts["alive"].values())
    assert by_role(facts)["protected"]["pid"] in killed_pids(report)
    assert report["protected"] == [] and facts["lockfile_exists"] is False


def test_both_device_families_are_found():
    facts = run_scenario("families")
    report = facts["kill"]["report"]
    holds = {entry["pid"]: entry["reason"] for entry in report["killed"]}
    assert not any(facts["alive"].values())
    assert any("/accel0" in reason for reason in holds.values())
    assert any("/vfio/0" in reason for reason in holds.values())
    assert not facts["lockfile_exists"] and not facts["so_lockfile_exists"]


def test_a_placeholder_copied_from_dev_null_does_not_match_dev_null():
    facts = run_scenario("null_clone")
    assert not any(facts["alive"].values())
    assert facts["bystander_alive"] is True
    assert len(facts["kill"]["report"]["killed"]) == 1


def test_a_lock_held_by_a_protected_process_is_never_removed():
    facts = run_scenario("protected_lock")
    report, roles = facts["kill"]["report"], by_role(facts)
    assert facts["alive"][str(roles["holder-0"]["pid"])] is False
    assert facts["alive"][str(roles["lock-holder"]["pid"])] is True
    assert facts["lockfile_exists"] is True
    locks = {e["path"]: e for e in report["lockfiles"]}
    assert locks[LOCK]["action"] == "kept"
    assert locks[LOCK]["held_by"] == [roles["lock-holder"]["pid"]]
    assert report["device_free"] is True


def test_runs_are_stopped_by_group_and_marker_and_reused_pids_are_left_alone():
    facts = run_scenario("runs")
    report = facts["kill"]["report"]
    assert facts["recipe_alive"] is False and facts["child_alive"] is False
    assert facts["killed_recorded"].strip() == "SIGTERM"
    assert {facts["recipe_pid"], facts["child_pid"]} <= set(killed_pids(report))
    runs = {entry["run"]: entry for entry in report["runs"]}
    assert runs["real"]["state"] == "stopped"
    assert runs["reused"]["state"].startswith("pid reused")
    assert facts["bystander_alive"] is True
    assert facts["bystander_pid"] not in killed_pids(report)
    # A child that outlived its run (own session) is found by the run's TPUFAB_RUN_ID.
    assert facts["leaked_alive"] is False
    assert runs["leaky"]["stragglers"] == [facts["leaked_pid"]]
    assert runs["leaky"]["state"] == "stopped"


def test_nothing_to_kill_is_a_clean_noop():
    facts = run_scenario("noop")
    report = facts["kill"]["report"]
    assert facts["kill"]["rc"] == 0
    assert report["noop"] is True and report["device_free"] is True
    assert report["killed"] == [] and report["protected"] == [] and report["failed"] == []
    assert report["elapsed_s"] >= 0   # measured; how long is the machine's business


def test_protection_rules():
    from tpufab.remote import kill_worker as tpukill
    from tpufab.topology import DEVICE_GLOBS

    assert tpukill.DEVICE_GLOBS == DEVICE_GLOBS == ("/dev/accel*", "/dev/vfio/[0-9]*")
    assert set(tpukill.DEFAULT_LOCKFILES) == {LOCK, SO_LOCK}
    init = tpukill.proc_stat(1)
    assert tpukill.protection(init, set(), tpukill.PROTECTED_NAMES) == "pid 1"
    me = tpukill.proc_stat(os.getpid())
    assert tpukill.protection(me, {os.getpid()}, ()) == "ancestor of this kill"
    assert tpukill.protection(me, set(), ()) == ""
    # the first pattern that matches comm (python, python3.11 or pytest, however pytest runs)
    assert tpukill.protection(me, set(), ("pytho*", "py*")) == f"protected name {me.comm}"
    assert tpukill.protection(me, set(), ("nomatch*",)) == ""


if __name__ == "__main__":
    json.dump(scenario(sys.argv[1]), sys.stdout)
