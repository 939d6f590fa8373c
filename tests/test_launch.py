"""run_worker.py with real processes: detached runs, recorded exit codes, stop, tail, secrets."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import WORKER_PYTHON, process_alive, shipped, wait_for

from tpufab.ssh.remote_files import read_answer

LAUNCH = shipped("run_worker.py")
SECRET = "hf_s3cr3t-value-that-must-not-leak"


class Runs:
    def __init__(self, root: Path):
        self.root = root
        self.dir = root / "runs"
        self.pgids: list[int] = []

    def launch(self, *args, stdin=None, check=True):
        command, *rest = args
        proc = subprocess.run(
            [WORKER_PYTHON, str(LAUNCH), command, "--run-dir", str(self.dir), *rest],
            input=stdin, capture_output=True, text=True, timeout=60)
        if check:
            assert proc.returncode == 0, (proc.stdout, proc.stderr)
        return proc

    def start(self, run_id, body, *extra, env=None):
        recipe = self.root / f"{run_id}.sh"
        recipe.write_text("#!/bin/bash\n" + body)
        recipe.chmod(0o755)
        args = ["start", "--run", run_id, "--recipe", str(recipe)]
        stdin = None
        if env is not None:
            args.append("--env-stdin")
            stdin = json.dumps(env)
        args.extend(extra)
        started = read_answer(self.launch(*args, stdin=stdin).stdout)
        self.pgids.append(started["pgid"])
        return started

    def status(self, run_id):
        return read_answer(self.launch("status", "--run", run_id).stdout)["runs"][0]

    def go(self, run_id):
        (self.root / f"{run_id}.go").touch()

    def cleanup(self):
        for pgid in self.pgids:
            try:
                os.killpg(pgid, signal.SIGKILL)
            except OSError:
                pass


@pytest.fixture
def runs(tmp_path):
    r = Runs(tmp_path)
    yield r
    r.cleanup()


def wait_go(root, run_id):
    """Recipe text: block until the test creates the go file (no sleeps in the test)."""
    return f'while [ ! -e {root}/{run_id}.go ]; do sleep 0.05; done\n'


def test_run_outlives_its_caller_and_records_the_exit_code(runs):
    recipe = runs.root / "r1.sh"
    recipe.write_text("#!/bin/bash\necho started\n" + wait_go(runs.root, "r1") + "exit 3\n")
    recipe.chmod(0o755)
    # The caller runs inside a session that is then killed whole, as when SSH drops.
    caller = subprocess.Popen(
        ["bash", "-c", '"$0" "$1" start --run-dir "$2" --run r1 --recipe "$3" && exec sleep 60',
         WORKER_PYTHON, str(LAUNCH), str(runs.dir), str(recipe)],
        start_new_session=True, stdout=subprocess.DEVNULL)
    pid_file = runs.dir / "r1" / "supervisor"
    wait_for(pid_file.exists, what="the run to start")
    os.killpg(caller.pid, signal.SIGKILL)
    caller.wait()
    state = runs.status("r1")
    runs.pgids.append(state["pid"])
    assert state["state"] == "running"
    assert process_alive(state["pid"])
    runs.go("r1")
    final = wait_for(lambda: (s := runs.status("r1"))["state"] != "running" and s,
                     what="the run to end")
    assert final["state"] == "exited" and final["exit_code"] == 3
    assert (runs.dir / "r1" / "exit_code").read_text().strip() == "3"
    assert (runs.dir / "r1" / "log").read_text() == "started\n"


def test_run_records(runs):
    # public values come in the env file, secrets on stdin (and are masked in the log)
    env_file = runs.root / "public.json"
    env_file.write_text(json.dumps({"FOO": "bar"}))
    started = runs.start("rec", "echo $TPUFAB_RUN_ID $FOO $HF_TOKEN $PWD \"$@\"\n",
                         "--commit", "abc123", "--env-file", str(env_file),
                         "--cwd", str(runs.root), "--", "x", "y z", env={"HF_TOKEN": SECRET})
    assert started["state"] == "running" and started["pid"] == started["pgid"]
    wait_for(lambda: runs.status("rec")["state"] == "exited", what="the run to end")
    rundir = runs.dir / "rec"
    assert (rundir / "log").read_text() == f"rec bar *** {runs.root} x y z\n"
    assert (rundir / "commit").read_text().strip() == "abc123"
    assert (rundir / "env_keys").read_text().split() == ["FOO", "HF_TOKEN"]
    assert (rundir / "recipe" / "rec.sh").exists()
    digest = hashlib.sha256((runs.root / "rec.sh").read_bytes()).hexdigest()
    assert (rundir / "recipe_sha256").read_text().strip() == digest
    for path in rundir.rglob("*"):
        if path.is_file():
            assert SECRET not in path.read_text(errors="replace"), path
    assert int((rundir / "start_time").read_text()) > 0


def test_the_end_is_recorded_with_all_the_recipe_wrote_in_the_log(runs):
    # A reader that sees the end (logs, babysit, a follower) must see the recipe's last line:
    # the end waits until the copier has drained the pipe, however far behind it is.
    body = ('head -c 8000000 /dev/zero | tr "\\0" "a" | fold -w 100\n'
            + wait_go(runs.root, "big") + 'echo "the last line"\n')
    runs.start("big", body, env={"HF_TOKEN": SECRET})     # a secret: the masker is at work
    runs.go("big")
    wait_for(lambda: runs.status("big")["state"] == "exited", what="the run to end")
    log = (runs.dir / "big" / "log").read_bytes()
    assert log.endswith(b"athe last line\n")
    assert len(log) == 8_000_000 + 79_999 + len(b"the last line\n")   # fold: no final newline


def test_a_process_left_holding_the_output_does_not_hold_up_the_end(runs):
    # The recipe leaves a process behind with its stdout; the end is recorded when the recipe
    # ends (not when that process lets the pipe go), and what it writes later still reaches
    # the log.
    body = ("echo recipe done\n(" + wait_go(runs.root, "left").rstrip("\n")
            + "; echo left behind) &\nexit 4\n")
    runs.start("left", body)
    final = wait_for(lambda: (s := runs.status("left"))["state"] != "running" and s,
                     what="the end, with a process still holding the recipe's output")
    assert final["state"] == "exited" and final["exit_code"] == 4
    log = runs.dir / "left" / "log"
    assert log.read_text() == "recipe done\n"
    runs.go("left")
    wait_for(lambda: log.read_text() == "recipe done\nleft behind\n",
             what="the left-behind process's line in the log")


def test_stop_kills_the_whole_process_group(runs):
    body = ("trap '' TERM\nsleep 300 &\necho child $!\n(trap - TERM; sleep 300) &\n"
            "echo child2 $!\nsetsid sleep 300 </dev/null >/dev/null 2>&1 &\n"
            "echo escaped $!\nwait\n")
    started = runs.start("grp", body)
    log = runs.dir / "grp" / "log"
    wait_for(lambda: log.exists() and log.read_text().count("\n") == 3, what="children")
    children = [int(line.split()[1]) for line in log.read_text().splitlines()]
    assert all(process_alive(pid) for pid in [started["pid"], *children])
    result = read_answer(runs.launch("stop", "--run", "grp", "--grace", "0.5").stdout)
    assert result["before"] == "running"
    assert result["signal"] == "KILL"          # the recipe ignores TERM
    assert result["state"] == "killed" and result["ended_by"] == "SIGKILL"
    assert not any(process_alive(pid) for pid in [started["pid"], *children])
    # Stopping again is a no-op that says so.
    again = read_answer(runs.launch("stop", "--run", "grp").stdout)
    assert again["before"] == "killed" and again["signal"] is None


def test_secrets_never_reach_argv(runs):
    env_file = runs.root / "env.json"
    env_file.write_text(json.dumps({"WANDB_API_KEY": SECRET}))
    env_file.chmod(0o600)
    runs.start("sec", 'echo "key length ${#WANDB_API_KEY}"\n' + wait_go(runs.root, "sec"),
               "--env-file", str(env_file))
    assert not env_file.exists()               # consumed
    log = runs.dir / "sec" / "log"
    wait_for(lambda: log.exists() and "key length" in log.read_text(), what="recipe output")
    assert log.read_text() == f"key length {len(SECRET)}\n"
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                cmdline = Path(f"/proc/{name}/cmdline").read_bytes()
            except OSError:
                continue
            assert SECRET.encode() not in cmdline, name
    runs.go("sec")
    wait_for(lambda: runs.status("sec")["state"] == "exited", what="the run to end")


def test_tail_follows_to_the_end_and_a_killed_follower_changes_nothing(runs):
    body = ('for i in 1 2 3; do echo "line $i"; done\n' + wait_go(runs.root, "tl")
            + 'printf "last line without newline"\nexit 7\n')
    runs.start("tl", body)
    # A follower that is killed halfway must not touch the run.
    first = subprocess.Popen([WORKER_PYTHON, str(LAUNCH), "tail", "--run-dir", str(runs.dir),
                              "--run", "tl", "--follow"], stdout=subprocess.PIPE)
    assert first.stdout.readline() == b"line 1\n"
    first.kill()
    first.wait()
    assert runs.status("tl")["state"] == "running"
    follower = subprocess.Popen([WORKER_PYTHON, str(LAUNCH), "tail", "--run-dir", str(runs.dir),
                                 "--run", "tl", "--follow", "--offset", "7"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, bufsize=0)
    seen = b""
    while seen.count(b"\n") < 2:      # the follower is live before the run ends
        chunk = follower.stdout.read(4096)
        assert chunk, "the follower stopped early"
        seen += chunk
    assert seen == b"line 2\nline 3\n"
    runs.go("tl")
    out, err = follower.communicate(timeout=30)
    assert out == b"last line without newline"
    assert follower.returncode == 7
    final = read_answer(err, "state")
    assert final["state"] == "exited" and final["exit_code"] == 7
    assert final["offset"] == len(b"line 1\nline 2\nline 3\nlast line without newline")


def test_status_lists_runs_and_reports_lost_runs(runs):
    runs.start("a", "exit 0\n")
    wait_for(lambda: runs.status("a")["state"] == "exited", what="run a")
    # A run whose supervisor vanished without a word (e.g. a reboot) is lost.
    lost = runs.dir / "b"
    lost.mkdir()
    (lost / "pid").write_text("999999\n")
    (lost / "start_time").write_text("1\n")
    (lost / "supervisor").write_text("999998\n")
    listed = read_answer(runs.launch("status").stdout)["runs"]
    assert [(r["run"], r["state"]) for r in listed] == [("a", "exited"), ("b", "lost")]


def test_a_stray_directory_among_the_runs_blocks_nothing(runs):
    """issue 37, Low 14: a directory under ~/.tpufab/runs that no run made (a `meta.json` that
    is not JSON, a name no run has) broke `run_worker.py status` on the worker, so every `run`
    was refused there ("could not check w0") and `kill --run NAME` refused the name."""
    from tpufab.errors import ConfigError
    from tpufab.steps.host.killing import check_options

    runs.start("a", "exit 0\n")
    wait_for(lambda: runs.status("a")["state"] == "exited", what="run a")
    (runs.dir / "junk").mkdir()
    (runs.dir / "junk" / "meta.json").write_text("{garbage")
    (runs.dir / "my dir").mkdir()
    (runs.dir / ".tmp").mkdir()
    listed = read_answer(runs.launch("status").stdout)["runs"]
    assert [r["run"] for r in listed] == ["a", "junk"], listed
    junk = next(r for r in listed if r["run"] == "junk")
    assert junk["state"] in ("starting", "lost") and junk.get("recipe") is None
    check_options(run="junk", grace=1)          # a name `tpufab runs` lists is killable
    with pytest.raises(ConfigError, match="is not a run id"):
        check_options(run="../x", grace=1)


def test_start_refuses_bad_input(runs, tmp_path):
    recipe = tmp_path / "x.sh"
    recipe.write_text("#!/bin/sh\n")
    bad = runs.launch("start", "--run", "../escape", "--recipe", str(recipe), check=False)
    assert bad.returncode == 2 and "bad run id" in read_answer(bad.stdout)["error"]
    wrong = runs.launch("start", "--run", "h", "--recipe", str(recipe), "--recipe-sha256",
                        "0" * 64, check=False)
    assert wrong.returncode == 2 and "expected" in read_answer(wrong.stdout)["error"]
    runs.start("dup", "exit 0\n")
    dup = runs.launch("start", "--run", "dup", "--recipe", str(recipe), check=False)
    assert dup.returncode == 2 and "already exists" in read_answer(dup.stdout)["error"]


def _launch_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("launch_under_test", LAUNCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_output_dirs_go_to_the_first_mounted_bucket_else_the_run_dir(tmp_path):
    import shutil

    launch = _launch_module()
    mounts = tmp_path / "mounts"
    mounts.mkdir()
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (mounts / "not_mounted.json").write_text(json.dumps({"at": str(tmp_path / "bucket")}))
    dirs = launch.output_dirs("20261123-000000-abcd", str(run_dir), str(mounts))
    assert dirs == {"TPUFAB_OUTPUT_DIR": str(run_dir / "output"),
                    "TPUFAB_PROFILE_DIR": str(run_dir / "profile")}
    assert (run_dir / "output").is_dir() and (run_dir / "profile").is_dir()
    if not os.path.ismount("/dev/shm") or not os.access("/dev/shm", os.W_OK):
        pytest.skip("no writable mount point to stand in for a bucket")
    run_id = f"20261123-000000-{os.getpid() % 0x10000:04x}"
    (mounts / "a_bucket.json").write_text(json.dumps({"at": "/dev/shm"}))
    try:
        dirs = launch.output_dirs(run_id, str(run_dir), str(mounts))
        assert dirs["TPUFAB_OUTPUT_DIR"] == f"/dev/shm/tpufab/runs/{run_id}/output"
        assert os.path.isdir(dirs["TPUFAB_PROFILE_DIR"])
    finally:
        shutil.rmtree(f"/dev/shm/tpufab/runs/{run_id}", ignore_errors=True)


def test_a_python_recipe_runs_with_the_jobs_python(tmp_path):
    launch = _launch_module()
    script = tmp_path / "train.py"
    script.write_text("#!/usr/bin/env python3\nprint('hi')\n")
    venv_python = tmp_path / "venv" / "bin" / "python"
    venv_python.parent.mkdir(parents=True)
    venv_python.symlink_to(sys.executable)
    assert launch.recipe_argv(str(script), ["a=1"], {"TPUFAB_PYTHON": str(venv_python)}) == \
        [str(venv_python), str(script), "a=1"]
    assert launch.recipe_argv(str(script), [], {"VIRTUAL_ENV": str(tmp_path / "venv")})[0] == \
        str(venv_python)
    shell = tmp_path / "x.sh"
    shell.write_text("#!/bin/sh\necho hi\n")
    # a checkout's file that is not executable (issue 25): its shebang's interpreter runs it
    assert launch.recipe_argv(str(shell), ["--steps", "10"], {}) == \
        ["/bin/sh", str(shell), "--steps", "10"]
    shell.chmod(0o755)
    assert launch.recipe_argv(str(shell), ["--steps", "10"], {}) == [str(shell), "--steps", "10"]
