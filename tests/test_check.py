"""tpufab check and run --check: the judging as data, then on a simulated v4-32 with JAX.

The verbs run as a user runs them, through the real `tpufab` command; the test breaks one
worker at a time (a zombie, a different package version, a different commit, an
unreachable worker) and expects the check to name that worker and the fix.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import unique_name

from tpufab.check import (
    Promise,
    Report,
    check_clock,
    clock_skew,
    judge_collective,
    parse_collective,
    quick_results,
    report_lines,
)
from tpufab.status import Deployed, Device, Disk, Holder, MountFact, MountProbe, WorkerFacts

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


def healthy(w: int, **changes) -> WorkerFacts:
    facts = WorkerFacts(w, True, host=f"h{w}", devices=tuple(Device(p) for p in ACCEL),
                        deploys=(Deployed("/root/proj", True, "c0ffee" * 6 + "abcd"),),
                        disk=(Disk("/root", 50 << 30, 100 << 30),), memory_total=64 << 30,
                        memory_available=60 << 30, python="3.11.2", time=1000.0,
                        packages=dict(PACKAGES))
    for key, value in changes.items():
        setattr(facts, key, value)
    return facts


def judge(facts, **kw):
    report = Report("pod", "v4-32", sorted(facts))
    report.results = quick_results(facts, expected_devices={w: ACCEL for w in facts},
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
    facts[3] = WorkerFacts(3, False, error="connection refused")
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
    text = 'noise\nTPUFAB_CHECK {"ok": true, "stage": "allreduce"}\n[Gloo] bye\n'
    assert parse_collective(text) == {"ok": True, "stage": "allreduce"}
    assert parse_collective("TPUFAB_CHECK {broken\n") is None


# ---------------------------------------------------------------------------------------------
# on the simulated pod


def _quiet():
    from rich.console import Console

    return Console(file=io.StringIO())


def tpufab(*args: str, env, cwd: Path, timeout: float = 300):
    return subprocess.run([TPUFAB, *args], env=env, cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL)


def git(folder: Path, *argv: str) -> str:
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t",
           "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"}
    return subprocess.run(["git", *argv], cwd=folder, check=True, env=env, text=True,
                          capture_output=True).stdout.strip()


@pytest.fixture(scope="module")
def pod_env(sim, tmp_path_factory):
    """A v4-32 with JAX set up (scripts/setup-sim.sh) and a project deployed to it."""
    from conftest import build_shared_site

    from tpufab import lifecycle
    from tpufab import pod as pods
    from tpufab.config import load_settings
    from tpufab.fanout import run_setup

    base = tmp_path_factory.mktemp("check-sim")
    env = {k: v for k, v in os.environ.items() if not k.startswith("TPUFAB_")}
    env.update(sim.env(), TPUFAB_USER_CONFIG=str(base / "none.yaml"), TPUFAB_SSH_USER="root",
               TPUFAB_SSH_KEY=str(base / "key" / "tpufab_ed25519"),
               TPUFAB_KNOWN_HOSTS=str(base / "known_hosts"), TPUFAB_NAME=unique_name("chk"),
               COLUMNS="250")
    settings = load_settings(env=env, cwd=base)
    build_shared_site([Path(sim.state_dir) / "share"])
    lifecycle.create(load_settings({"type": "v4-32"}, env=env, cwd=base), console=_quiet())
    pod = pods.connect(settings, console=_quiet())
    project = base / "proj"
    project.mkdir()
    (project / "README").write_text("checked\n")
    git(project, "init", "-q", "-b", "main")
    git(project, "add", "-A")
    git(project, "commit", "-q", "-m", "first")
    try:
        run_setup(pod.fanout, REPO / "scripts" / "setup-sim.sh")[0].close()
        deployed = tpufab("deploy", "--direct", env=env, cwd=project)
        assert deployed.returncode == 0, deployed.stdout + deployed.stderr
        yield env, pod, project
    finally:
        pod.close()
        lifecycle.delete(settings, yes=True, console=_quiet())


def on_workers(pod, argv, workers=None) -> dict[int, str]:
    result = pod.fanout.run(argv, workers=workers)
    assert result.ok, result.details()
    return {w: r.stdout.strip() for w, r in result.items()}


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
        assert line.startswith("w1: TPU busy: 4 of 4 device files held by ")
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
