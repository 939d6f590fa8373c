"""kill and sim zombie on a simulated v4-32, and the report folding as data."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest
from harness import connected_pod
from helpers import call, on_workers, write_recipe

from tpufab.reports import text as report_lines
from tpufab.ssh.remote_files import RemoteFile, verify_loader
from tpufab.steps.host.killing import (
    KillReport,
    WorkerReport,
    fold_paths,
    kill_command,
    summary,
    zombie_command,
)

REPO = Path(__file__).resolve().parents[1]

# Takes the TPU the way libtpu does: every device file open and an exclusive flock on the
# lockfile; fails like libtpu when another process holds the lock.
LIBTPU_LIKE = r"""#!/usr/bin/env python3
import fcntl, glob, os, sys
devices = sorted(glob.glob("/dev/accel*") + glob.glob("/dev/vfio/[0-9]*"))
held = [os.open(d, os.O_RDONLY | os.O_NONBLOCK) for d in devices]
try:
    fd = os.open("/tmp/libtpu_lockfile", os.O_RDWR | os.O_CREAT, 0o644)
except PermissionError:  # another user's lockfile: flock works on a read-only descriptor too
    fd = os.open("/tmp/libtpu_lockfile", os.O_RDONLY)
try:
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
except BlockingIOError:
    inode = os.fstat(fd).st_ino
    pids = [line.split()[4] for line in open("/proc/locks")
            if line.split()[5].endswith(f":{inode}")]
    print(f"TPU is already in use by process with pid {','.join(pids)}", file=sys.stderr)
    sys.exit(1)
print(f"TPU acquired: {len(devices)} devices")
os.unlink("/tmp/libtpu_lockfile")
"""

# On a worker: who holds a device file, as {pid: comm}.
HOLDERS = r"""
import os, json
found = {}
for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
        links = [os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")]
        comm = open(f"/proc/{pid}/comm").read().strip()
    except OSError:
        continue
    if any(link.startswith("/dev/accel") for link in links):
        found[pid] = comm
print(json.dumps(found))
"""

# A TPU job that hands the device to a successor when told to stop (as a restart loop or a
# supervisor would bring it back): on SIGTERM it starts a new holder, waits until that one
# holds /dev/accel1, then exits. Only the first generation does this; all end after a minute.
HANDOFF = r"""
import os, signal, sys, time

def hold(generation, ready):
    os.open("/dev/accel1", os.O_RDONLY | os.O_NONBLOCK)

    def stop(signum, frame):
        if generation == 0:
            r, w = os.pipe()
            if os.fork() == 0:
                os.close(r)
                hold(1, w)
            os.close(w)
            os.read(r, 1)
        os._exit(0)

    signal.signal(signal.SIGTERM, stop)
    os.write(ready, b"x")
    os.close(ready)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        time.sleep(0.5)
    os._exit(0)

r, w = os.pipe()
if os.fork() == 0:
    os.close(r)
    os.setsid()
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    hold(0, w)
os.close(w)
print("holding" if os.read(r, 1) else "failed")
"""


# ---------------------------------------------------------------------------------------------
# pure parts


def test_kill_command_runs_tpukill_as_root_with_both_device_families():
    line = kill_command(run="20261122-104455-ab12", grace=3, dry_run=True, force=True)
    tpukill = RemoteFile.bundled("kill_worker.py")
    checked = f"python3 -I -S -c {shlex.quote(verify_loader())} 1 {tpukill.sha256} {tpukill.path}"
    assert line.startswith('if [ "$(id -u)" != 0 ] && sudo -n true 2>/dev/null; then exec sudo '
                           f"-n {checked} ")
    assert f"; else exec {checked} " in line
    assert "--devices-glob '/dev/accel*' --devices-glob '/dev/vfio/[0-9]*'" in line
    assert '--run-dir="$HOME/.tpufab/runs"' in line and "--grace 3 --settle 2" in line
    assert "--run 20261122-104455-ab12 --dry-run --force" in line
    assert "--holders 2 --ignore-term 1" in zombie_command()


def test_fold_paths():
    assert fold_paths([f"/dev/accel{i}" for i in range(4)] + ["/tmp/libtpu_lockfile"]) == \
        "/dev/accel[0-3], /tmp/libtpu_lockfile"
    assert fold_paths(["/dev/vfio/0", "/dev/vfio/2", "/dev/vfio/3"]) == "/dev/vfio/[0,2-3]"
    assert fold_paths(["/dev/accel0"]) == "/dev/accel0"


def report(pid_base: int, *, killed=True) -> dict:
    devices = [f"/dev/accel{i}" for i in range(4)]
    return {
        "dry_run": False, "devices": devices, "runs": [], "failed": [], "holders_left": [],
        "killed": [{"pid": pid_base, "name": "python3", "command": "python3 train.py",
                    "reason": "holds " + ", ".join(devices) + ", /tmp/libtpu_lockfile",
                    "signal": "KILL"}] if killed else [],
        "protected": [{"pid": 7, "name": "tpu-runtime", "command": "tpu-runtime",
                       "holds": devices[:1], "why": "protected name tpu-runtime"}],
        "device_free": True,
        "lockfiles": [{"path": "/tmp/libtpu_lockfile", "action": "removed" if killed
                       else "absent"}],
        "lockfiles_removed": ["/tmp/libtpu_lockfile"] if killed else [],
        "noop": not killed,
    }


def test_reports_of_many_workers_fold_into_a_few_lines():
    workers = {w: WorkerReport(w, report(100 + w)) for w in range(3)}
    workers[3] = WorkerReport(3, report(0, killed=False))
    workers[4] = WorkerReport(4, error="connection refused")
    result = KillReport(workers, grace=5)
    lines = report_lines(result)
    assert lines == [
        "w[0-2]  killed     pids 100,101,102 python3 `python3 train.py` (holds "
        "/dev/accel[0-3], /tmp/libtpu_lockfile); needed SIGKILL (still alive 5 s after SIGTERM)",
        "w[0-3]  protected  pid 7 tpu-runtime holds /dev/accel0 (protected name tpu-runtime; "
        "left running)",
        "w[0-2]  lockfile   /tmp/libtpu_lockfile removed",
        "w4      failed: connection refused",
    ]
    text = summary(result)
    assert text.startswith("Killed 3 processes on w[0-2] (3 needed SIGKILL after the 5 s grace).")
    assert "Left running (protected): tpu-runtime on w[0-3]; --force stops them too." in text
    # the protected tpu-runtime still holds /dev/accel0: not free, and the same words as status
    assert "TPU free on w[0-3]: NO - protected (tpu-runtime): `tpufab kill` leaves it running; " \
           "if it should not hold the TPU, stop it with `tpufab kill --force`" in text
    assert "TPU free on w[0-3]: yes" not in text
    assert "Removed /tmp/libtpu_lockfile on w[0-2]." in text
    assert "Could not check w4 (w4: connection refused)" in text
    assert not result.ok


def test_a_device_still_held_makes_the_result_fail():
    busy = report(100)
    busy["device_free"] = False
    busy["holders_left"] = [{"pid": 9, "name": "python3", "command": "x",
                             "holds": ["/dev/accel1"], "ppid": 5, "parent": "healthagent"}]
    result = KillReport({0: WorkerReport(0, busy), 1: WorkerReport(1, report(0, killed=False))})
    assert result.busy == [0] and not result.ok
    assert "w0 BUSY pid 9 python3 still holds /dev/accel1 (its parent: healthagent pid 5)" in [
        " ".join(line.split()) for line in report_lines(result)]
    assert "TPU free on w0: NO" in summary(result)


# ---------------------------------------------------------------------------------------------
# on the simulated pod


@pytest.fixture(scope="module")
def pod_env(sim, tmp_path_factory):
    """A v4-32 and the environment naming it (ssh as the default user, `tpufab`: an ordinary
    user with passwordless sudo, as on a real TPU VM)."""
    with connected_pod(sim, tmp_path_factory, "kill", columns=250) as pod:
        yield pod.env, pod.pod, pod.base


def flat(text: str) -> list[str]:
    """Lines with runs of spaces as one (column widths depend on the widest worker set)."""
    return [" ".join(line.split()) for line in text.splitlines()]


def holders(pod) -> dict[int, dict[str, str]]:
    return {w: json.loads(out)  # every user's processes: as root
            for w, out in on_workers(pod, ["sudo", "-n", "python3", "-c", HOLDERS]).items()}


def lockfiles(pod) -> dict[int, bool]:
    found = on_workers(pod, "test -e /tmp/libtpu_lockfile && echo yes || echo no")
    return {w: out == "yes" for w, out in found.items()}


@pytest.mark.sim
def test_zombies_are_cleared_the_protected_process_survives_and_a_new_run_works(pod_env,
                                                                                tmp_path):
    env, pod, _ = pod_env
    made = call(env, "sim_zombie", cwd=tmp_path, worker="0-2")
    assert made.returncode == 0, made.stdout + made.stderr
    assert "w[0-2]  holder-0" in made.stdout and "ignores SIGTERM" in made.stdout
    before = holders(pod)
    assert all(len(before[w]) == 3 for w in range(3)) and before[3] == {}
    assert lockfiles(pod) == {0: True, 1: True, 2: True, 3: False}

    # the mess is real: a job that takes the TPU as libtpu does cannot start there
    recipe = write_recipe(tmp_path, "take_tpu.py", LIBTPU_LIKE)
    blocked = call(env, "run", cwd=tmp_path, recipe=str(recipe), no_deploy=True, raw=True)
    assert blocked.returncode == 1, blocked.stdout + blocked.stderr
    assert "TPU is already in use by process with pid" in blocked.stdout
    assert "failed on w[0-2]: w[0-2] exited 1; w3 exited 0." in blocked.stderr

    # the holders look as a crashed job's do, in status's TPU column and lines as in kill's
    status = call(env, "status", cwd=tmp_path)
    assert "python3 train.py: w[0-2]" in status.stdout, status.stdout
    assert "-I -S -c" not in status.stdout and "import os" not in status.stdout

    killed = call(env, "kill", cwd=tmp_path, grace=1)
    # the protected tpu-runtime still holds /dev/accel0 on w[0-2]: kill says so and fails
    assert killed.returncode == 1, killed.stdout + killed.stderr
    lines = flat(killed.stdout)
    assert any("`python3 train.py`" in line for line in lines), lines
    assert "-I -S -c" not in killed.stdout
    assert any(line.startswith("w[0-2] killed") and "needed SIGKILL" in line
               for line in lines), lines
    assert any(line.startswith("w[0-2] killed") and "stopped by SIGTERM" in line
               for line in lines), lines
    assert any(line.startswith("w[0-2] protected") and "tpu-runtime" in line
               for line in lines), lines
    assert "w[0-2] lockfile /tmp/libtpu_lockfile removed" in lines
    assert "w3 nothing to kill" in lines
    summary_line = flat(killed.stderr)[-1]
    assert "Killed 6 processes on w[0-2] (3 needed SIGKILL after the 1 s grace)." in summary_line
    assert "TPU free on w3: yes. TPU free on w[0-2]: NO - protected (tpu-runtime)" in summary_line
    after = holders(pod)
    runtime = {w: {p: c for p, c in before[w].items() if c == "tpu-runtime"} for w in range(3)}
    assert after == {**runtime, 3: {}} and all(len(r) == 1 for r in runtime.values())
    assert lockfiles(pod) == {w: False for w in range(4)}

    fresh = call(env, "run", cwd=tmp_path, recipe=str(recipe), no_deploy=True, raw=True)
    assert fresh.returncode == 0, fresh.stdout + fresh.stderr
    assert sorted(line for line in fresh.stdout.splitlines() if "TPU acquired" in line) == \
        [f"w{w} │ TPU acquired: 4 devices" for w in range(4)]

    again = call(env, "kill", cwd=tmp_path)
    assert again.returncode == 1 and "Nothing to kill on w[0-3]." in again.stderr
    assert "`tpufab kill --force`" in again.stderr
    assert call(env, "kill", cwd=tmp_path, force=True).returncode == 0
    assert holders(pod) == {w: {} for w in range(4)}


@pytest.mark.sim
def test_dry_run_only_reports(pod_env, tmp_path):
    env, pod, _ = pod_env
    assert call(env, "sim_zombie", cwd=tmp_path, worker="3").returncode == 0
    dry = call(env, "kill", cwd=tmp_path, dry_run=True)
    assert dry.returncode == 0, dry.stdout + dry.stderr
    lines = flat(dry.stdout)
    assert any(line.startswith("w3 would kill") for line in lines), lines
    assert "w3 lockfile /tmp/libtpu_lockfile would remove" in lines
    assert "Dry run: would kill 2 processes on w3 and remove the lockfile on w3; nothing was " \
           "signalled." in dry.stdout
    assert len(holders(pod)[3]) == 3 and lockfiles(pod)[3]
    assert call(env, "kill", cwd=tmp_path, grace=0.5, force=True).returncode == 0
    assert holders(pod)[3] == {} and not lockfiles(pod)[3]


@pytest.mark.sim
def test_a_holder_that_comes_back_keeps_the_tpu_busy_and_kill_fails(pod_env, tmp_path):
    env, pod, _ = pod_env
    assert on_workers(pod, ["python3", "-c", HANDOFF], workers=[1]) == {1: "holding"}
    busy = call(env, "kill", cwd=tmp_path, grace=0.5)
    assert busy.returncode == 1, busy.stdout + busy.stderr
    assert any(line.startswith("w1 BUSY") and "/dev/accel1" in line
               for line in flat(busy.stdout)), busy.stdout
    assert "TPU free on w[0,2-3]: yes. TPU free on w1: NO" in busy.stderr
    again = call(env, "kill", cwd=tmp_path, grace=0.5)           # the successor goes quietly
    assert again.returncode == 0, again.stdout + again.stderr
    assert holders(pod)[1] == {}

def test_without_root_free_is_unknown_and_kill_fails():
    seen = report(0, killed=False)
    seen["protected"] = []
    seen["unreadable_processes"] = 5
    result = KillReport({0: WorkerReport(0, seen)})
    assert result.unverified == [0] and not result.ok
    assert "w0 note 5 processes of other users could not be inspected (not root)" in [
        " ".join(line.split()) for line in report_lines(result)]
    assert "TPU free on w0: unknown" in summary(result)
    seen["dry_run"] = True
    assert KillReport({0: WorkerReport(0, seen)}, dry_run=True).ok


@pytest.mark.sim
def test_kill_as_root_still_works(pod_env, tmp_path):
    """The root path (ssh_user: root, no sudo involved) on the same pod."""
    env, pod, _ = pod_env
    as_root = {"TPUFAB_SSH_USER": "root"}
    made = call(env, "sim_zombie", cwd=tmp_path, worker="3", extra_env=as_root)
    assert made.returncode == 0, made.stdout + made.stderr
    assert len(holders(pod)[3]) == 3
    killed = call(env, "kill", cwd=tmp_path, grace=0.5, force=True, extra_env=as_root)
    assert killed.returncode == 0, killed.stdout + killed.stderr
    assert "TPU free on w[0-3]: yes." in killed.stdout
    assert holders(pod)[3] == {} and not lockfiles(pod)[3]


@pytest.mark.sim
def test_kill_and_status_say_the_same_about_a_protected_holder(pod_env, tmp_path):
    """Issue 11, finding 7: after `sim zombie`, kill said "TPU free: yes" (exit 0) while status
    said busy and advised `tpufab kill`: the user looped. Now both name the protected holder
    with the same advice, kill fails until it is gone, and --force ends the loop."""
    import subprocess
    import sys

    env, pod, _ = pod_env
    tpufab = str(Path(sys.executable).parent / "tpufab")

    def status() -> subprocess.CompletedProcess:
        return subprocess.run([tpufab, "status"], env=env, cwd=tmp_path, capture_output=True,
                              text=True, timeout=180, stdin=subprocess.DEVNULL)

    assert call(env, "sim_zombie", cwd=tmp_path, worker="1").returncode == 0
    advice = "protected (tpu-runtime): `tpufab kill` leaves it running; if it should not " \
             "hold the TPU, stop it with `tpufab kill --force` (or its service)"
    for _ in range(2):  # the second kill says the same: no "yes" after a "NO"
        killed = call(env, "kill", cwd=tmp_path, grace=0.5)
        assert killed.returncode == 1, killed.stdout + killed.stderr
        assert f"TPU free on w1: NO - {advice}" in killed.stderr, killed.stderr
        assert "TPU free on w[0,2-3]: yes" in killed.stderr
        seen = status()
        rows = {line.split()[0]: line for line in seen.stdout.splitlines()
                if line.startswith("w") and ":" not in line.split()[0]}
        assert "held by protected tpu-runtime" in rows["w1"], seen.stdout
        others = [row for label, row in rows.items() if label != "w1"]
        assert others and all("busy" not in row and "held" not in row for row in others)
        holder = next(line for line in seen.stdout.splitlines() if ": w1 (w1 pid" in line)
        assert holder.strip().endswith(advice), holder
    forced = call(env, "kill", cwd=tmp_path, grace=0.5, force=True)
    assert forced.returncode == 0, forced.stdout + forced.stderr
    assert "TPU free on w[0-3]: yes." in forced.stdout
    assert "held" not in status().stdout


# The Python API: a kill that cannot finish (a holder ignoring SIGTERM, a long grace)
KILL_API = """\
import json, sys, time
from tpufab import Pod
began = time.monotonic()
result = Pod().kill(workers="3", grace=60, timeout=3)
print(json.dumps({"seconds": time.monotonic() - began, "unreachable": result.unreachable,
                  "ok": result.ok}))
"""


@pytest.mark.sim
def test_pod_kill_gives_up_at_its_timeout(pod_env, tmp_path):
    """Pod.kill(timeout=...) is honoured, as `tpufab kill --timeout` is (before: Pod.kill
    took no timeout)."""
    import subprocess
    import sys

    env, pod, _ = pod_env
    assert call(env, "sim_zombie", cwd=tmp_path, worker="3").returncode == 0
    try:
        done = subprocess.run([sys.executable, "-c", KILL_API], env=env, cwd=tmp_path,
                              capture_output=True, text=True, timeout=120,
                              stdin=subprocess.DEVNULL)
        assert done.returncode == 0, done.stdout + done.stderr
        answer = json.loads(done.stdout.splitlines()[-1])
        assert answer["seconds"] < 30, answer           # not the 60 s grace
        assert not answer["ok"] and "timed out after 3 s" in answer["unreachable"]["3"], answer
    finally:
        assert call(env, "kill", cwd=tmp_path, grace=0.5, force=True).returncode == 0
    assert holders(pod)[3] == {}
