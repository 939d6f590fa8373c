"""`status`: facts_worker.py's output parsed as data, the folded table as data, and the whole verb on
a simulated v4-32 (a busy TPU on one worker, an unreachable one, a preempted node)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from harness import sim_node
from helpers import (
    TPUFAB,
    WORKER_PYTHON,
    answered,
    cli_env,
    facts_of,
    in_worker,
    outcome,
    quiet_console,
    shipped,
    sim_settings,
    unique_name,
    use_env,
    wait_for,
)

from tpufab.remote import facts_worker as facts
from tpufab.ssh.remote_files import read_answer
from tpufab.steps.health import status as st
from tpufab.views import status as status_view

GiB = 1 << 30




# ---------------------------------------------------------------------------------------------
# facts_worker.py's answer as data


def test_parse_facts_reads_every_field():
    f = facts_of(3)
    assert f.worker == 3 and f.reachable and f.error is None
    assert f.host == "t1v-n-1a2b3c4d-w-0" and f.uptime_s == 7260.5
    assert [d.path for d in f.busy_devices] == ["/dev/accel0"]
    assert f.devices[0].holders == (st.Holder(812, "python3 train.py"),)
    assert [r.run for r in f.running] == ["20261122-114455-cd34"]
    assert f.runs[0].outcome == "exit 0" and f.runs_total == 7
    assert f.commit == "a" * 40 and f.deploy_dir == "/home/u/proj"
    assert f.mounts[0].driver == "gcsfuse" and f.mounts[0].what == "gs://bucket/prefix"
    assert f.setup[0].done and f.disk[0].free_bytes == 80 * GiB
    assert f.memory_total == 400 * GiB and not f.memory_low
    assert status_view.facts_json(f)["devices"][0]["busy"] is True


@pytest.mark.parametrize("result,reason", [
    (outcome(error="connection refused", exit_code=None), "connection refused"),
    (outcome("not json\n", exit_code=1, stderr="Traceback...\nOSError: boom\n"),
     "no facts: OSError: boom"),
    (outcome("", exit_code=127, stderr="sh: 1: python3: not found\n"),
     "no facts: python3 is not installed on this worker"),
    (outcome('["a list"]\n', exit_code=0), "no facts: exit status 0"),
])
def test_parse_facts_failures_make_the_worker_unreachable_with_a_reason(result, reason):
    f = st.parse_facts(5, result)
    assert not f.reachable and f.error == reason


def test_parse_facts_drops_malformed_fields_one_by_one():
    data = {"host": "h", "uptime_s": "soon", "devices": [{"path": "/dev/accel0",
            "holders": [{"pid": "x"}, "junk"]}, "junk", {"holders": []}],
            "runs": [{"state": "running"}, {"run": "r1", "exit_code": "?"}],
            "disk": "full", "memory": [1], "mounts": [{"at": "/m"}]}
    f = st.parse_facts(0, outcome(answered(data)))
    assert f.reachable and f.uptime_s is None
    assert f.devices == (st.Device("/dev/accel0", (st.Holder(0, "?"),)),)
    assert [(r.run, r.state, r.exit_code) for r in f.runs] == [("r1", "lost", None)]
    assert f.disk == () and f.memory_total is None
    assert f.mounts == (st.MountFact("/m", "fuse", "", None),)


def test_cells_say_what_a_worker_is_doing():
    f = facts_of(0)
    assert st.tpu_cell(f) == "1/2 busy: python3 train.py"
    assert st.runs_cell(f) == ("running 20261122-114455-cd34 (jax_train.sh); "
                               "last 20261122-104455-ab12 exit 0; 6 finished")
    assert st.commit_cell(f) == "a" * 12
    assert st.mounts_cell(f) == "/mnt/data gs://bucket/prefix"
    idle = facts_of(1, devices=[{"path": f"/dev/vfio/{i}", "holders": []} for i in range(8)],
                    runs=[], runs_total=0, deploys=[], mounts=[], unreadable_processes=3)
    assert st.tpu_cell(idle) == "8 free (3 processes unreadable)"
    assert (st.runs_cell(idle), st.commit_cell(idle), st.mounts_cell(idle)) == ("-", "-", "-")
    assert st.tpu_cell(facts_of(2, devices=[])) == "no TPU devices"
    no_checkout = facts_of(2, deploys=[{"dir": "/p", "exists": True, "commit": None}])
    assert st.commit_cell(no_checkout) == "not a checkout"


def test_sixty_four_workers_fold_into_three_rows():
    idle = [{"path": f"/dev/vfio/{i}", "holders": []} for i in range(4)]
    workers = {w: facts_of(w, devices=idle, uptime_s=7200.0 + w) for w in range(64)}
    workers[17] = facts_of(17, uptime_s=7217.0)   # the odd one out: a process holds the TPU
    workers[63] = st.StatusRow(63, False, error="connection refused")
    rows = st.fold_rows(workers)
    assert [r.label for r in rows] == ["w[0-16,18-62]", "w17", "w63"]
    assert rows[0].tpu == "4 free" and rows[0].state == "up 2h00m..2h01m"
    assert rows[1].tpu.startswith("1/2 busy: python3 train.py")
    assert rows[2].state == "unreachable: connection refused" and not rows[2].ok
    assert status_view.row_json(rows[0])["worker_ids"] == [w for w in range(63) if w != 17]


def test_a_rebooted_worker_and_low_disk_get_their_own_rows():
    workers = {w: facts_of(w, uptime_s=86400.0 + 3 * w) for w in range(8)}
    workers[2] = facts_of(2, uptime_s=95.0)                       # rebooted
    workers[5] = facts_of(5, uptime_s=86415.0,
                          disk=[{"path": "/h", "free_bytes": GiB, "total_bytes": 100 * GiB}])
    workers[6] = facts_of(6, uptime_s=86418.0,                    # drift: same row
                          disk=[{"path": "/h", "free_bytes": 70 * GiB, "total_bytes": 100 * GiB}])
    rows = st.fold_rows(workers)
    assert [r.label for r in rows] == ["w[0-1,3-4,6-7]", "w2", "w5"]
    assert rows[0].disk == "70G..80G" and rows[0].ok
    assert rows[1].state == "up 1m"
    assert rows[2].disk == "1.0G LOW" and not rows[2].ok
    assert rows[0].memory == "390G of 400G"


def test_a_full_disk_is_named_in_one_sentence():
    full = [{"path": "/home/u", "free_bytes": 0, "total_bytes": GiB},
            {"path": "/tmp", "free_bytes": 10 << 20, "total_bytes": GiB}]
    workers = {w: facts_of(w) for w in range(4)}
    assert status_view.full_disk_line(workers) is None
    workers[1] = facts_of(1, disk=full)
    workers[3] = facts_of(3, disk=full[:1])
    assert status_view.full_disk_line(workers) == (
        "Disk full on w[1,3] (/home/u, /tmp): setup, deploy and run fail there until you "
        "free space (kill and status still work).")


def test_holder_lines_fold_by_command():
    workers = {w: facts_of(w, devices=[{"path": "/dev/accel0", "holders": [
        {"pid": 100 + w, "command": "python3 train.py"}]}]) for w in range(3)}
    workers[3] = facts_of(3, devices=[{"path": "/dev/accel0", "holders": []}])
    assert status_view.holder_lines(workers, shown=2) == [
        "python3 train.py: w[0-2] (w0 pid 100, w1 pid 101, +1 more (see --json))"]


def test_facts_args_are_data():
    assert st.facts_args(deploy_dirs=["~/a", "~/b c"], max_runs=2) == [
        "--deploy-dir", "~/a", "--deploy-dir", "~/b c", "--max-runs", "2"]
    assert st.facts_args() == []


# ---------------------------------------------------------------------------------------------
# facts_worker.py's pieces on local files


def git(cwd: Path, *args: str) -> str:
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t",
           "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"}
    return subprocess.run(["git", *args], cwd=cwd, env=env, check=True, capture_output=True,
                          text=True).stdout.strip()


def test_deployed_commit_is_read_without_git(tmp_path):
    repo = tmp_path / "proj"
    repo.mkdir()
    git(repo, "init", "-q", "-b", "main")
    git(repo, "commit", "-q", "--allow-empty", "-m", "one")
    head = git(repo, "rev-parse", "HEAD")
    assert facts.deployed(str(repo)) == {"dir": str(repo), "exists": True, "commit": head,
                                         "branch": "main"}
    git(repo, "pack-refs", "--all")                     # refs only in packed-refs now
    assert facts.deployed(str(repo))["commit"] == head
    git(repo, "checkout", "-q", "--detach")
    assert facts.deployed(str(repo))["commit"] == head
    assert facts.deployed(str(repo))["branch"] is None
    assert facts.deployed(str(tmp_path / "none"))["exists"] is False
    (tmp_path / "plain").mkdir()
    assert facts.deployed(str(tmp_path / "plain"))["commit"] is None


def test_mounts_lists_fuse_ones_with_their_recorded_url(tmp_path):
    proc = tmp_path / "mounts"
    proc.write_text(
        "/dev/sda1 / ext4 rw 0 0\n"
        "bucket /mnt/my\\040data fuse.gcsfuse rw,nosuid 0 0\n"
        "tpufab{AbC}:b2/p /tmp/m2 fuse.rclone rw 0 0\n"
        "lxcfs /proc/cpuinfo fuse.lxcfs rw 0 0\n")
    state = tmp_path / "state"
    state.mkdir()
    (state / "mnt_my_data.json").write_text(json.dumps(
        {"url": "gs://bucket/pre", "at": "/mnt/my data", "source": "bucket"}))
    (state / "broken.json").write_text("{")
    assert facts.mounts(str(state), str(proc)) == [
        {"at": "/mnt/my data", "fstype": "fuse.gcsfuse", "source": "bucket",
         "url": "gs://bucket/pre"},
        {"at": "/tmp/m2", "fstype": "fuse.rclone", "source": "tpufab{AbC}:b2/p", "url": None}]


def test_run_states_from_launch_records(tmp_path):
    def run(name, **files):
        d = tmp_path / name
        d.mkdir()
        (d / "meta.json").write_text(json.dumps({"recipe": "r.sh", "started_at": 1.5}))
        for key, value in files.items():
            (d / key).write_text(f"{value}\n")
        return d

    me = facts.proc_stat(os.getpid()).start_time
    states = {
        "a-exited": run("a-exited", pid=1, start_time=1, exit_code=3, ended_at=9.5),
        "b-killed": run("b-killed", pid=1, start_time=1, killed="SIGTERM"),
        "c-running": run("c-running", pid=os.getpid(), start_time=me),
        "d-lost": run("d-lost", pid=os.getpid(), start_time=me + 1, supervisor=1),
    }
    got = {name: facts.run_state(str(path)) for name, path in states.items()}
    assert got["a-exited"] == {"run": "a-exited", "recipe": "r.sh", "started_at": 1.5,
                               "state": "exited", "exit_code": 3, "ended_at": 9.5}
    assert got["b-killed"]["state"] == "killed" and got["b-killed"]["signal"] == "SIGTERM"
    assert got["c-running"]["state"] == "running"
    assert got["d-lost"]["state"] == "lost"
    listed, total = facts.runs(str(tmp_path), 1)
    assert total == 4 and [r["run"] for r in listed] == ["c-running", "d-lost"]


def test_device_holders_scan_proc_fd(tmp_path):
    device = tmp_path / "accel0"
    device.write_text("")
    other = tmp_path / "accel1"
    other.write_text("")
    holder = subprocess.Popen([sys.executable, "-c", "import sys; f = open(sys.argv[1]); "
                               "print('ok', flush=True); sys.stdin.read()", str(device)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "ok"
        held, unreadable = facts.device_holders([str(device), str(other)])
        assert [h["pid"] for h in held[str(device)]] == [holder.pid]
        assert str(device) in held[str(device)][0]["command"]
        assert held[str(other)] == [] and unreadable == 0
    finally:
        holder.stdin.close()
        holder.wait(timeout=10)


def test_facts_script_prints_one_json_line(tmp_path):
    proc = subprocess.run([WORKER_PYTHON, "-I", "-S", str(shipped("facts_worker.py")), "--run-dir",
                           str(tmp_path / "runs"), "--deploy-dir", str(tmp_path)],
                          capture_output=True, text=True, check=True)
    lines = proc.stdout.splitlines()
    assert len(lines) == 1
    data = read_answer(lines[0])
    assert data["runs"] == [] and data["deploys"][0]["exists"] is True
    assert data["memory"]["total_bytes"] > 0 and data["uptime_s"] > 0
    assert st.parse_facts(0, outcome(proc.stdout)).reachable


# ---------------------------------------------------------------------------------------------
# on the simulated pod


@pytest.fixture(scope="module")
def node(sim, tmp_path_factory):
    """A READY v4-32 (4 workers) and Settings naming it."""
    with sim_node(sim, tmp_path_factory, "st", "v4-32") as node:
        yield node


@pytest.mark.sim
def test_status_folds_agreeing_workers_and_singles_out_the_odd_one(sim, node, sim_admin, capsys,
                                                                  monkeypatch):
    from tpufab.hosts import connect as pods
    from tpufab.term.console import run
    from tpufab.verbs.status import status as status_verb

    settings = node.settings
    use_env(monkeypatch, sim, node.home)
    pod = pods.shared(settings)
    pod.fanout.run("mkdir -p ~/proj/.git/refs/heads && echo 'ref: refs/heads/main' > "
                   "~/proj/.git/HEAD && echo " + "c" * 40 + " > ~/proj/.git/refs/heads/main",
                   check=True)
    found = st.collect(settings, deploy_dirs=["~/proj"])
    assert found.healthy and [r.label for r in found.folded] == ["w[0-3]"]
    row = found.folded[0]
    assert row.tpu == "4 free" and row.commit == "c" * 12 and row.runs == "-"
    assert found.nodes[0].state == "READY" and found.nodes[0].health == "HEALTHY"

    # w1: a process holds one TPU device file; it gets its own row, with pid and command
    pid = int(in_worker(sim, node.node, 1, "setsid python3 -c 'import signal; "
                        "f = open(\"/dev/accel0\"); signal.pause()' </dev/null >/dev/null 2>&1 & "
                        "echo $!").strip())
    try:
        def busy():
            got = st.collect(settings, deploy_dirs=["~/proj"])
            return got if got.workers[1].busy_devices else None

        found = wait_for(busy, 20, what="w1's holder to show")
        assert [r.label for r in found.folded] == ["w[0,2-3]", "w1"]
        assert found.folded[1].tpu.startswith("1/4 busy: python3 -c ...")   # what names it
        holder = found.workers[1].busy_devices[0].holders[0]
        assert holder.pid == pid and found.workers[1].busy_devices[0].path == "/dev/accel0"
        assert run(status_verb, name=settings.name, as_json=True) == 0
        data = json.loads(capsys.readouterr().out)
        assert [r["workers"] for r in data["rows"]] == ["w[0,2-3]", "w1"]
        assert data["workers"][1]["devices"][0]["holders"][0]["pid"] == pid
        assert data["nodes"][0]["state"] == "READY"
    finally:
        in_worker(sim, node.node, 1, f"kill {pid}", check=False)

    # w3 unreachable: shown, not hidden; exit code 1
    pods.forget(settings)      # a new connection is needed to notice
    sim_admin.set_reachable(settings.name, 3, False)
    try:
        found = st.collect(settings, deploy_dirs=["~/proj"])
        assert [r.label for r in found.folded] == ["w[0-2]", "w3"]
        assert found.folded[1].state == "unreachable: connection refused"
        assert found.unreachable == [3] and not found.healthy
        assert run(status_verb, name=settings.name) == 1
        out = capsys.readouterr().out
        assert "w3" in out and "unreachable: connection refused" in out
        assert "1 of 4 workers unreachable" in out
    finally:
        sim_admin.set_reachable(settings.name, 3, True)
        pods.forget(settings)


@pytest.mark.sim
def test_status_shows_a_running_run_and_finished_ones(sim, node):
    from tpufab.hosts import connect as pods
    from tpufab.steps.code.deploy import run_script

    settings = node.settings
    pod = pods.shared(settings)
    pod.fanout.put(b"#!/bin/sh\nwhile [ ! -e \"$HOME/go-$1\" ]; do sleep 0.05; done\n",
                   "~/wait.sh", mode=0o755)
    run_id = f"{time.strftime('%Y%m%d-%H%M%S')}-0a0a"
    started = run_script(pod.fanout, "run_worker.py",
                         ["start", "--run", run_id, "--recipe", "~/wait.sh", "--", "x"],
                         pod.workers)
    assert all(r.exit_code == 0 for r in started.values()), started
    found = st.collect(settings, deploy_dirs=[])
    assert [r.label for r in found.folded] == ["w[0-3]"]
    assert found.folded[0].runs == f"running {run_id} (wait.sh)"
    pod.fanout.run("touch ~/go-x", workers=[0, 1, 2], check=True)

    def ended():
        got = st.collect(settings, deploy_dirs=[])
        return got if len(got.folded) == 2 else None

    found = wait_for(ended, 20, what="w[0-2]'s run to end")
    assert [r.label for r in found.folded] == ["w[0-2]", "w3"]
    assert found.folded[0].runs == f"last {run_id} exit 0"
    assert found.folded[1].runs == f"running {run_id} (wait.sh)"
    pod.fanout.run("touch ~/go-x", workers=[3], check=True)
    wait_for(lambda: len(st.collect(settings, deploy_dirs=[]).folded) == 1, 20,
             what="w3's run to end")


@pytest.mark.sim
def test_status_of_a_preempted_node_shows_the_api_state(sim, sim_admin, tmp_path, capsys,
                                                        monkeypatch):
    from tpufab.cloud import lifecycle
    from tpufab.term.console import run
    from tpufab.verbs.status import status as status_verb

    settings = sim_settings(sim, tmp_path, name=unique_name("stp"), type="v4-16")
    use_env(monkeypatch, sim, tmp_path)
    lifecycle.create(settings, console=quiet_console())
    try:
        sim_admin.preempt(settings.name)
        found = st.collect(settings)
        assert found.nodes[0].state == "PREEMPTED" and not found.healthy
        assert "is PREEMPTED: its workers were not asked" in found.note
        assert [r.label for r in found.folded] == ["w[0-1]"]
        assert found.folded[0].state == "unreachable: node PREEMPTED"
        assert run(status_verb, name=settings.name) == 1
        out = capsys.readouterr().out
        assert f"{settings.name} is PREEMPTED" in out and "tpufab babysit" in out
    finally:
        lifecycle.delete(settings, yes=True, console=quiet_console())


@pytest.mark.sim
def test_status_from_the_command_line(sim, node, tmp_path):
    env = cli_env(sim, node.home)
    shown = subprocess.run([TPUFAB, "status", "--name", node.settings.name, "--json"], env=env,
                           capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert shown.returncode == 0, shown.stderr
    data = json.loads(shown.stdout)
    assert data["healthy"] and [r["workers"] for r in data["rows"]] == ["w[0-3]"]
    table = subprocess.run([TPUFAB, "status", "--name", node.settings.name], env=env,
                           capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert table.returncode == 0 and "WORKERS" in table.stdout and "w[0-3]" in table.stdout
    # a terminal narrower than the table (66 cells here): every row on one line, shortened;
    # --wide: every value in full
    narrow = subprocess.run([TPUFAB, "status", "--name", node.settings.name],
                            env={**env, "COLUMNS": "60"}, capture_output=True, text=True,
                            timeout=120, cwd=tmp_path)
    assert "WORKERS " in narrow.stdout, narrow.stdout + narrow.stderr   # never shortened
    rows = narrow.stdout[narrow.stdout.index("WORKERS"):].splitlines()
    assert narrow.returncode == 0 and len(rows) == 2, rows      # the header and one row
    assert rows[1].startswith("w[0-3] ") and "…" in rows[1], rows
    # within the terminal, or (when even the shortest cells do not fit) the floors' width
    assert all(len(line) <= 70 for line in rows), rows
    wide = subprocess.run([TPUFAB, "status", "--name", node.settings.name, "--wide"],
                          env={**env, "COLUMNS": "60"}, capture_output=True, text=True,
                          timeout=120, cwd=tmp_path)
    full = wide.stdout[wide.stdout.index("WORKERS"):].splitlines()[1]
    assert wide.returncode == 0 and "…" not in full and len(full) > 60, full
    missing = subprocess.run([TPUFAB, "status", "--name", "no-such-node"], env=env,
                             capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert missing.returncode == 1 and "Traceback" not in missing.stderr
    assert "No TPU node or queued resource named 'no-such-node'" in missing.stderr


SUPERVISOR = ("import sys; open('/proc/self/comm', 'w').write('tpufab-run'); "
              "print('ok', flush=True); sys.stdin.read()")


def ending_run(tmp_path: Path, *, start_time: bool = True):
    """A run whose recipe has just exited while its supervisor has not yet written the exit
    code: a dead recipe pid, a live supervisor. Returns (run dir, supervisor process)."""
    gone = subprocess.Popen(["true"])
    gone.wait()
    supervisor = subprocess.Popen([sys.executable, "-c", SUPERVISOR], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True)
    assert supervisor.stdout.readline().strip() == "ok"
    rundir = tmp_path / "20261122-104455-ab12"
    rundir.mkdir()
    (rundir / "meta.json").write_text(json.dumps({"recipe": "r.sh", "started_at": 1.0}))
    for key, value in (("pid", gone.pid), ("start_time", 1), ("supervisor", supervisor.pid)):
        (rundir / key).write_text(f"{value}\n")
    if start_time:
        (rundir / "supervisor_start_time").write_text(f"{facts.proc_stat(supervisor.pid).start_time}\n")
    return rundir, supervisor


@pytest.mark.parametrize("start_time", [True, False])
def test_a_run_whose_supervisor_is_writing_its_end_is_not_lost(tmp_path, start_time):
    from tpufab.remote import run_worker as launch

    rundir, supervisor = ending_run(tmp_path, start_time=start_time)
    try:
        assert facts.run_state(str(rundir))["state"] == "running"
        if start_time:     # run_worker.py agrees
            assert launch.run_status(str(rundir))["state"] == "running"
    finally:
        supervisor.stdin.close()
        supervisor.wait(10)
    assert facts.run_state(str(rundir))["state"] == "lost"   # no supervisor: nobody will say
