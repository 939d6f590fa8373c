"""tpufab check and run --check: the judging as data, then on a simulated v4-32 with JAX.

The verbs run as a user runs them, through the real `tpufab` command; the test breaks one
worker at a time (a zombie, a different package version, a different commit, an
unreachable worker) and expects the check to name that worker and the fix.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from harness import connected_pod
from helpers import on_workers, tpufab, unique_name

from tpufab.steps.health.check import (
    CheckReport,
    Promise,
    check_clock,
    clock_skew,
    judge_collective,
    parse_collective,
    quick_results,
)
from tpufab.steps.health.status import (
    Deployed,
    Device,
    Disk,
    Holder,
    MountFact,
    MountProbe,
    StatusRow,
)
from tpufab.views.check import report_lines

REPO = Path(__file__).resolve().parents[1]
TPUFAB = str(Path(sys.executable).parent / "tpufab")
ACCEL = tuple(f"/dev/accel{i}" for i in range(4))
# The pid of the rclone process serving a mount point (on a worker).
MOUNT_DAEMON = r"""
import json, os, sys
found = []
for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            argv = fh.read().split(b"\0")
    except OSError:
        continue
    if argv and b"rclone" in argv[0] and sys.argv[1].encode() in argv:
        found.append(int(pid))
print(json.dumps(found))
"""
PACKAGES = {"python": "3.11.2", "executable": "/root/.venv/bin/python", "jax": "0.10.2",
            "jaxlib": "0.10.2", "libtpu": None, "torch": None}


# ---------------------------------------------------------------------------------------------
# judging (pure)


def healthy(w: int, **changes) -> StatusRow:
    facts = StatusRow(w, True, host=f"h{w}", devices=tuple(Device(p) for p in ACCEL),
                        deploys=(Deployed("/root/proj", True, "c0ffee" * 6 + "abcd"),),
                        disk=(Disk("/root", 50 << 30, 100 << 30),), memory_total=64 << 30,
                        memory_available=60 << 30, python="3.11.2", time=1000.0,
                        packages=dict(PACKAGES))
    for key, value in changes.items():
        setattr(facts, key, value)
    return facts


def judge(facts, **kw):
    report = CheckReport("pod", "v4-32", sorted(facts))
    report.rows = quick_results(facts, expected_devices={w: ACCEL for w in facts},
                                before=999.9, after=1000.2, **kw)
    return report


def test_a_healthy_pod_passes_every_quick_check():
    report = judge({w: healthy(w) for w in range(4)})
    assert report.ok, report_lines(report)
    lines = report_lines(report)
    assert "ok    tpu        4 device files, free, on w[0-3]" in lines
    assert any(line.startswith("ok    versions") and "jax 0.10.2, jaxlib 0.10.2" in line
               for line in lines)
    assert any(line.startswith("ok    commit") and "c0ffeec0ffee on w[0-3]" in line
               for line in lines)


def test_each_odd_worker_is_named_with_its_fix():
    facts = {w: healthy(w) for w in range(4)}
    facts[1] = healthy(1, devices=(Device(ACCEL[0], (Holder(812, "python3 train.py"),)),
                                   *(Device(p) for p in ACCEL[1:])))
    facts[2] = healthy(2, packages={**PACKAGES, "jax": "0.4.30"})
    facts[3] = healthy(3, deploys=(Deployed("/root/proj", True, "beef" * 10),), time=1003.5)
    facts[0] = healthy(0, mounts=(MountFact("/mnt/data", "fuse.rclone", "data:"),),
                       mount_probes=(MountProbe("/mnt/data", False, "no answer in 5 s"),))
    lines = [p.line() for p in judge(facts).problems]
    assert "w1: TPU busy: 1 of 4 device files held by python3 train.py (w1 pid 812); free " \
           "it with `tpufab kill`." in lines
    assert "w2: jax 0.4.30, but 0.10.2 on w[0-1,3]; make the workers agree with " \
           "`tpufab setup --force`." in lines
    assert any(line.startswith("w3: checkout at beefbeefbeef in /root/proj, but "
                               "c0ffeec0ffee on w[0-2]; put one commit everywhere with "
                               "`tpufab deploy`") for line in lines), lines
    assert any(line.startswith("w3: clock 3.3 s ahead of this machine") for line in lines)
    assert "w0: /mnt/data does not answer (no answer in 5 s); remount it: `tpufab umount " \
           "--at /mnt/data --lazy`, then `tpufab mount` again." in lines
    assert "w[1-3]: /mnt/data is not mounted (it is on w0); mount it there with " \
           "`tpufab mount`." in lines


def test_unreachable_missing_devices_and_low_disk():
    facts = {w: healthy(w) for w in range(4)}
    facts[3] = StatusRow(3, False, error="connection refused")
    facts[2] = healthy(2, devices=tuple(Device(p) for p in ACCEL[:3]),
                       disk=(Disk("/root", 1 << 30, 100 << 30),))
    lines = [p.line() for p in judge(facts).problems]
    assert any(line.startswith("w3: unreachable (connection refused)") for line in lines)
    assert any(line.startswith("w2: 1 of 4 TPU device files missing (/dev/accel3)")
               for line in lines)
    assert any(line.startswith("w2: low on disk: /root has 1.0G free of 100G")
               for line in lines), lines


def test_commit_comparison_can_be_left_to_deploy():
    facts = {w: healthy(w) for w in range(2)}
    facts[1] = healthy(1, deploys=(Deployed("/root/proj", True, "beef" * 10),))
    assert judge(facts, compare_commits=False).ok


def test_clock_skew_is_judged_against_the_round_trip():
    assert clock_skew(100.5, 100.0, 101.0) == 0.0
    assert clock_skew(98.0, 100.0, 101.0) == -2.0
    facts = {0: healthy(0, time=95.0), 1: healthy(1, time=100.5)}
    result = check_clock(facts, 100.0, 101.0)
    assert [p.line() for p in result.problems][0].startswith(
        "w0: clock 5.0 s behind this machine")


def test_the_collective_names_its_slowest_host_and_failures():
    def answer(w, times):
        return {"ok": True, "process_count": 4, "device_count": 16, "backend": "cpu",
                "bytes": 262144, "times_ms": times, "sum": 40.0, "expected_sum": 40.0}

    # w2 arrives last in every round: the others wait for it
    answers = {w: answer(w, [5.0, 6.0, 5.5]) for w in range(4)}
    answers[2] = answer(2, [1.0, 2.0, 1.5])
    result = judge_collective(answers, {}, Promise(4, 16), "r1")
    assert result.ok
    assert result.detail.startswith("4 processes, 16 cpu devices (as promised); all-reduce of "
                                    "256K per device: 5.5 ms median over 3 rounds; slowest "
                                    "host w2")
    assert result.data["slowest_host"] == 2

    answers[1] = {"error": "JAX sees 3 processes and 12 devices, the accelerator type "
                           "promises 4 and 16", "stage": "count"}
    answers[3] = None
    failed = judge_collective(answers, {3: "exited 2"}, Promise(4, 16), "r1")
    lines = [p.line() for p in failed.problems]
    assert any(line.startswith("w1: collective failed (count): JAX sees 3 processes")
               for line in lines)
    assert "w3: collective failed (start): no answer (exited 2); see `tpufab logs --run r1` " \
           "for the whole log." in lines


def test_parse_collective_takes_the_marked_line():
    text = 'noise\n@tpufab-answer answer {"ok": true, "stage": "allreduce"}\n[Gloo] bye\n'
    assert parse_collective(text) == {"ok": True, "stage": "allreduce"}
    assert parse_collective("@tpufab-answer answer {broken\n") is None


# ---------------------------------------------------------------------------------------------
# on the simulated pod


def git(folder: Path, *argv: str) -> str:
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t",
           "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"}
    return subprocess.run(["git", *argv], cwd=folder, check=True, env=env, text=True,
                          capture_output=True).stdout.strip()


@pytest.fixture(scope="module")
def pod_env(sim, tmp_path_factory):
    """A v4-32 with JAX set up (scripts/setup-sim.sh) and a project deployed to it."""
    with connected_pod(sim, tmp_path_factory, "chk", ssh_user="root", columns=250, site="jax",
                       setup=True) as pod:
        project = pod.base / "proj"
        project.mkdir()
        (project / "README").write_text("checked\n")
        git(project, "init", "-q", "-b", "main")
        git(project, "add", "-A")
        git(project, "commit", "-q", "-m", "first")
        deployed = tpufab("deploy", "--direct", env=pod.env, cwd=project)
        assert deployed.returncode == 0, deployed.stdout + deployed.stderr
        yield pod.env, pod.pod, project


def problem_lines(result) -> list[str]:
    return [line.strip() for line in result.stdout.splitlines() if line.startswith("  w")]


def assert_refused(env, project, tmp_path, text: str) -> None:
    """run --check stops before anything starts, naming the problem."""
    recipe = tmp_path / "never.sh"
    recipe.write_text("#!/bin/sh\necho should-not-run\n")
    recipe.chmod(0o755)
    before = tpufab("runs", "--json", env=env, cwd=project).stdout
    refused = tpufab("run", str(recipe), "--no-deploy", "--check", env=env, cwd=project)
    assert refused.returncode == 1, refused.stdout + refused.stderr
    assert "Not starting: `tpufab check --quick` found" in refused.stderr, refused.stderr
    assert text in refused.stderr, refused.stderr
    assert "should-not-run" not in refused.stdout
    assert tpufab("runs", "--json", env=env, cwd=project).stdout == before


@pytest.mark.sim
def test_a_healthy_v4_32_passes_with_a_real_collective(pod_env, tmp_path):
    env, _, project = pod_env
    result = tpufab("check", env=env, cwd=project)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert "ok    tpu         4 device files, free, on w[0-3]" in lines, lines
    collective = next(line for line in lines if line.startswith("ok    collective"))
    assert "4 processes, 16 cpu devices (as promised)" in collective
    assert "slowest host w" in collective and " ms median over 10 rounds" in collective
    assert "passed every check" in result.stderr

    as_json = tpufab("check", "--quick", "--json", env=env, cwd=project)
    assert as_json.returncode == 0, as_json.stderr
    data = json.loads(as_json.stdout)
    assert data["ok"] and data["workers"] == "w[0-3]"
    versions = next(c for c in data["checks"] if c["check"] == "versions")
    assert {p["jax"] for p in versions["packages"].values()} == {
        on_workers(pod_env[1], ["/root/.venv/bin/python", "-c",
                                "import jax; print(jax.__version__)"])[0]}

    started = tpufab("run", str(REPO / "recipes" / "jax_hello.sh"), "--no-deploy", "--check",
                     env=env, cwd=project)
    assert started.returncode == 0, started.stdout + started.stderr
    assert "every quick check passed" in started.stderr
    assert "jax_hello: OK" in started.stdout and "jax_hello: MISMATCH" not in started.stdout
    assert "finished on w[0-3]: exit 0" in started.stderr


@pytest.mark.sim
def test_a_zombie_on_one_worker_is_named_with_tpufab_kill(pod_env, tmp_path):
    env, _, project = pod_env
    made = tpufab("sim", "zombie", "--worker", "1", env=env, cwd=project)
    assert made.returncode == 0, made.stdout + made.stderr
    try:
        result = tpufab("check", "--quick", env=env, cwd=project)
        assert result.returncode == 1, result.stdout + result.stderr
        [line] = [p for p in problem_lines(result) if "TPU busy" in p]
        assert line.startswith("w1: TPU busy: 4 of 4 device files held by python3 train.py; "
                               "tpu-runtime"), line  # what names them, not the loader
        assert line.endswith("free it with `tpufab kill`.")
        assert_refused(env, project, tmp_path, "w1: TPU busy")
    finally:
        assert tpufab("kill", "--grace", "0.5", "--force", env=env, cwd=project).returncode == 0
    assert tpufab("check", "--quick", env=env, cwd=project).returncode == 0


@pytest.mark.sim
def test_a_different_package_version_on_one_worker(pod_env, tmp_path):
    env, pod, project = pod_env
    purelib = on_workers(pod, ["/root/.venv/bin/python", "-c", "import sysconfig; "
                               "print(sysconfig.get_paths()['purelib'])"], [1])[1]
    fake = f"{purelib}/jax-0.0.1.dist-info"
    on_workers(pod, f"mkdir -p {fake} && printf 'Metadata-Version: 2.1\\nName: jax\\n"
                    f"Version: 0.0.1\\n' > {fake}/METADATA", [1])
    try:
        result = tpufab("check", "--quick", env=env, cwd=project)
        assert result.returncode == 1, result.stdout + result.stderr
        [line] = problem_lines(result)
        assert line.startswith("w1: jax 0.0.1, but ") and " on w[0,2-3]; make the workers " \
            "agree with `tpufab setup --force`." in line
        assert_refused(env, project, tmp_path, "w1: jax 0.0.1")
    finally:
        on_workers(pod, ["rm", "-rf", fake], [1])


@pytest.mark.sim
def test_a_different_commit_on_one_worker_until_deploy(pod_env, tmp_path):
    env, pod, project = pod_env
    on_workers(pod, "cd ~/proj && git -c user.name=t -c user.email=t@t commit -q "
                    "--allow-empty -m drift", [2])
    result = tpufab("check", "--quick", env=env, cwd=project)
    assert result.returncode == 1, result.stdout + result.stderr
    [line] = problem_lines(result)
    head = git(project, "rev-parse", "HEAD")
    assert line.startswith("w2: checkout at ") and f"but {head[:12]} on w[0-1,3]" in line
    assert line.endswith("put one commit everywhere with `tpufab deploy`.")
    assert_refused(env, project, tmp_path, "w2: checkout at")

    fixed = tpufab("deploy", "--direct", env=env, cwd=project)
    assert fixed.returncode == 0, fixed.stdout + fixed.stderr
    again = tpufab("check", "--quick", env=env, cwd=project)
    assert again.returncode == 0, again.stdout + again.stderr
    assert f"{head[:12]} on w[0-3]" in again.stdout


@pytest.mark.sim
def test_an_unreachable_worker(pod_env, sim_admin, tmp_path):
    env, _, project = pod_env
    sim_admin.set_reachable(env["TPUFAB_NAME"], 3, False)
    try:
        result = tpufab("check", "--quick", env=env, cwd=project)
        assert result.returncode == 1, result.stdout + result.stderr
        [line] = problem_lines(result)
        assert line.startswith("w3: unreachable (") and "`tpufab status`" in line
        full = tpufab("check", env=env, cwd=project)
        assert full.returncode == 1
        assert "skip  collective  skipped: fix the problems above first" in full.stdout
        assert_refused(env, project, tmp_path, "w3: unreachable")
    finally:
        sim_admin.set_reachable(env["TPUFAB_NAME"], 3, True)


@pytest.mark.sim
def test_a_mount_that_hangs_on_one_worker(pod_env, tmp_path):
    env, pod, project = pod_env
    bucket = unique_name("chk")
    assert tpufab("sim", "bucket", bucket, env=env, cwd=project).returncode == 0
    mounted = tpufab("mount", bucket, "--driver", "rclone", "--at", "/mnt/chk", env=env,
                     cwd=project)
    assert mounted.returncode == 0, mounted.stdout + mounted.stderr
    try:
        fine = tpufab("check", "--quick", env=env, cwd=project)
        assert fine.returncode == 0, fine.stdout + fine.stderr
        assert "ok    mounts     /mnt/chk answers" in fine.stdout.splitlines()
        # freeze worker 3's rclone: its mount stops answering, as a wedged gcsfuse does
        [pid] = json.loads(on_workers(pod, ["python3", "-c", MOUNT_DAEMON, "/mnt/chk"], [3])[3])
        on_workers(pod, ["kill", "-STOP", str(pid)], [3])
        try:
            hung = tpufab("check", "--quick", env=env, cwd=project)
        finally:
            on_workers(pod, ["kill", "-CONT", str(pid)], [3])
        assert hung.returncode == 1, hung.stdout + hung.stderr
        assert problem_lines(hung) == [
            "w3: /mnt/chk does not answer (no answer in 5 s); remount it: `tpufab umount "
            "--at /mnt/chk --lazy`, then `tpufab mount` again."]
    finally:
        tpufab("umount", "--at", "/mnt/chk", "--lazy", env=env, cwd=project)


@pytest.fixture(scope="module")
def small_pod(sim, tmp_path_factory):
    """A READY v4-8 (one worker), no JAX: enough to hold a live run."""
    from harness import sim_node

    with sim_node(sim, tmp_path_factory, "chklive", "v4-8") as node:
        yield node


@pytest.mark.sim
def test_check_respects_a_live_run(small_pod):
    """Beside a live run `check` refuses in one sentence (its collective would start on the
    same TPUs, as deploy and run refuse); `check --quick` checks and says why the collective
    is skipped. Before: the collective started beside the run without a word."""
    env, home = small_pod.env, small_pod.home
    (home / "long.sh").write_text("#!/bin/sh\necho started\nexec sleep 600\n")
    (home / "long.sh").chmod(0o755)
    started = tpufab("run", "long.sh", "--no-deploy", "--detach", env=env, cwd=home)
    assert started.returncode == 0, started.stdout + started.stderr
    import re

    found = re.search(r"Run (\d{8}-\d{6}-[0-9a-f]{4})", started.stdout + started.stderr)
    assert found, started.stdout + started.stderr
    run = found.group(1)
    runs = json.loads(tpufab("runs", "--json", env=env, cwd=home).stdout)
    try:
        refused = tpufab("check", env=env, cwd=home)
        assert refused.returncode != 0, refused.stdout + refused.stderr
        text = refused.stdout + refused.stderr
        assert "Traceback" not in text
        lines = [line for line in refused.stderr.splitlines() if line.strip()]
        assert len(lines) == 1, refused.stderr
        assert lines[0].startswith(f"Run {run} (long.sh) is running on w0, and the collective")
        assert "`tpufab check --quick`" in lines[0]
        after = json.loads(tpufab("runs", "--json", env=env, cwd=home).stdout)
        assert [r["run"] for r in after["rows"]] == [r["run"] for r in runs["rows"]]  # none ran
        quick = tpufab("check", "--quick", env=env, cwd=home)
        assert re.search(rf"skip +collective +skipped \(--quick\): run {run} is running on "
                         r"w0", quick.stdout), quick.stdout + quick.stderr
    finally:
        tpufab("kill", "--run", run, env=env, cwd=home)


def test_ray_is_judged_from_the_workers_raylets_and_unsaid_where_ray_is_not_used():
    def ray(head: bool, gcs: str = "10.0.0.1:6379", raylet: int | None = 7) -> dict:
        return {"raylet": raylet, "head": head, "gcs_address": gcs, "node_ip": None}

    assert not any(r.check == "ray" for r in judge({w: healthy(w) for w in range(4)}).rows)
    up = {w: healthy(w, ray=ray(w == 0)) for w in range(4)}
    assert "ok    ray        up, head w0, 4/4 hosts joined" in report_lines(judge(up))
    # w2's raylet is gone, w3's talks to another GCS
    part = {**up, 2: healthy(2), 3: healthy(3, ray=ray(False, gcs="10.0.0.9:6379"))}
    report = judge(part)
    assert [p.line() for p in report.problems] == [
        "w[2-3]: not joined to Ray's head on w0; start Ray again with `tpufab ray up`."]
    assert "FAIL  ray        head w0, 2/4 hosts joined (w[2-3] missing)" in report_lines(report)
    # raylets left without a head anywhere
    headless = {w: healthy(w, ray=ray(False) if w == 1 else None) for w in range(4)}
    assert [p.line() for p in judge(headless).problems] == [
        "w1: a raylet runs without Ray's head (GCS) on any worker; start Ray again with "
        "`tpufab ray up`."]
