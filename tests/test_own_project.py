"""tpufab in a user's own project, as a new user meets it: a fresh git repository outside
tpufab's checkout, `tpufab init`, then the headline sequence through the real `invoke` and
`tpufab` commands on the simulated pod, and a user tasks.py that composes tpufab's tasks
with its own and calls `Pod.run`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from helpers import build_shared_site

pytestmark = pytest.mark.sim

BIN = Path(sys.executable).parent


@pytest.fixture
def project(sim, tmp_path):
    """An empty git repository of the user's, and the environment pointing at the pod. The
    login is tpufab's default (here, as root: the ordinary user `tpufab`, with sudo), which
    also names the node: tpufab-v4-32."""
    repo = tmp_path / "climate"
    repo.mkdir()
    for args in (["init", "-q", "-b", "main"], ["config", "user.email", "u@example.com"],
                 ["config", "user.name", "u"]):
        subprocess.run(["git", *args], cwd=repo, check=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("TPUFAB_")}
    home = tmp_path / "home"
    home.mkdir()
    env.update(sim.env(), HOME=str(home), TPUFAB_USER_CONFIG=str(tmp_path / "none.yaml"),
               TPUFAB_STATE_DIR=str(tmp_path / "state"),
               COLUMNS="200", PATH=f"{BIN}:{env.get('PATH', '')}")
    build_shared_site([Path(sim.state_dir) / "share"])
    yield repo, env
    subprocess.run([str(BIN / "tpufab"), "delete", "--name", "tpufab-v4-32", "--yes"], env=env,
                   cwd=tmp_path, capture_output=True, timeout=120)


def sh(argv, repo, env, *, ok=True, timeout=300):
    proc = subprocess.run(argv, cwd=repo, env=env, capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL)
    if ok:
        assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr
    return proc


def test_the_headline_sequence_in_a_fresh_project(project):
    repo, env = project
    made = sh(["tpufab", "init"], repo, env)
    assert "Wrote tasks.py, tpufab.yaml, scripts/setup.sh, recipes/hello.sh" in made.stdout
    for name in ("tasks.py", "tpufab.yaml", "scripts/setup.sh", "recipes/hello.sh"):
        assert (repo / name).is_file(), name
    assert os.access(repo / "recipes" / "hello.sh", os.X_OK)
    (repo / "tpufab.yaml").write_text("# mine\n")
    again = sh(["tpufab", "init"], repo, env)
    assert "Kept tasks.py, tpufab.yaml, scripts/setup.sh, recipes/hello.sh" in again.stdout
    assert (repo / "tpufab.yaml").read_text() == "# mine\n"           # never overwritten

    listed = sh(["invoke", "--list"], repo, env).stdout
    for verb in ("create", "setup", "run", "kill", "status", "delete", "hello", "sim.up"):
        assert verb in listed, verb

    created = sh(["invoke", "create", "--type", "v4-32"], repo, env)
    assert "No node name given: calling it tpufab-v4-32" in created.stderr
    assert "tpufab-v4-32 is this project's current pod" in created.stderr
    current = json.loads((repo / ".tpufab" / "current-pod.json").read_text())
    assert current["name"] == "tpufab-v4-32" and current["set_by"] == "create"

    setup = sh(["invoke", "setup"], repo, env)
    assert "Setup setup.sh: w[0-3] ran" in setup.stdout
    assert '{"status"' not in setup.stdout + setup.stderr          # no worker-side protocol
    assert setup.stdout.count("ready: jax") == 1                    # folded: once, not 4x

    sh(["git", "add", "-A"], repo, env)
    sh(["git", "commit", "-q", "-m", "start"], repo, env)
    ran = sh(["invoke", "run", "recipes/hello.sh"], repo, env)
    assert "no git remote yet: deploying over SSH (--direct)" in ran.stderr
    assert "jax_hello: all-gather of process ids = [0, 1, 2, 3]" in ran.stdout
    assert not any(line.startswith("w0 │") for line in ran.stdout.splitlines())
    assert "finished on w[0-3]: exit 0" in ran.stderr
    logs = sh(["tpufab", "logs"], repo, env).stdout.splitlines()   # the run's logs, folded
    assert logs.count("jax_hello: all-gather of process ids = [0, 1, 2, 3]") == 1
    assert logs.count("jax_hello: OK") == 1

    # identical lines from 4 workers, followed live: each once, under no worker's name
    same = repo / "recipes" / "same.sh"
    same.write_text("#!/bin/sh\nfor i in 1 2 3; do echo \"same line $i\"; done\n")
    same.chmod(0o755)
    sh(["git", "add", "-A"], repo, env)
    sh(["git", "commit", "-q", "-m", "same"], repo, env)
    folded = sh(["invoke", "run", "recipes/same.sh"], repo, env).stdout.splitlines()
    assert [line for line in folded if "same line" in line] == \
        ["same line 1", "same line 2", "same line 3"], folded
    raw = sh(["tpufab", "run", "recipes/same.sh", "--raw"], repo, env).stdout.splitlines()
    assert sorted(line.split(" │ ")[0] for line in raw if "same line 1" in line) == \
        ["w0", "w1", "w2", "w3"]

    killed = sh(["invoke", "kill"], repo, env)
    assert "TPU free on w[0-3]: yes" in killed.stdout
    status = sh(["tpufab", "status"], repo, env)
    assert "Pod tpufab-v4-32 (this project's current pod, set by `tpufab create`" in status.stderr
    assert "w[0-3]" in status.stdout and "4 free" in status.stdout

    deleted = sh(["invoke", "delete", "--yes"], repo, env)
    assert "Deleted TPU node tpufab-v4-32" in deleted.stdout + deleted.stderr
    assert not (repo / ".tpufab" / "current-pod.json").exists()
    assert "tpufab-v4-32" not in sh(["tpufab", "list"], repo, env).stdout
    gone = sh(["tpufab", "status"], repo, env, ok=False)
    assert gone.returncode != 0 and "no current pod" in gone.stderr


USER_TASKS = textwrap.dedent('''
    """A user's tasks.py: tpufab's verbs, and a task of their own built on them."""
    from invoke import task

    from tpufab import Pod, PodError
    from tpufab.tasks import ns, setup


    @task(pre=[setup])
    def hosts(c):
        """Set up, then ask every worker who it is, then try a command that fails on w2."""
        pod = Pod.current()
        result = pod.run("echo host-$(hostname)")
        for worker, r in sorted(result.items()):
            print(f"{worker} {r.stdout.strip()} exited={r.exited} ok={r.ok}")
        print("succeeded", sorted(result.succeeded), "failed", sorted(result.failed))
        pod.run("touch /tmp/broken", workers="2")
        try:
            pod.run("test ! -e /tmp/broken")
        except PodError as err:
            print("PodError:", err.message)
            print("failed", sorted(err.result.failed), "succeeded", sorted(err.result.succeeded))
            print("w2 exited", err.result[2].exited)
        warned = pod.run("test ! -e /tmp/broken", warn=True)
        print("warn ok", warned.ok, "failed", sorted(warned.failed))


    ns.add_task(hosts)
''')


def test_a_user_tasks_py_composes_tpufab_tasks_and_calls_pod_run(project):
    repo, env = project
    sh(["tpufab", "init"], repo, env)
    (repo / "tasks.py").write_text(USER_TASKS)
    sh(["invoke", "create", "--type", "v4-32"], repo, env)
    out = sh(["invoke", "hosts"], repo, env)
    assert "Setup setup.sh: w[0-3] ran" in out.stdout                 # the pre task ran first
    for w in range(4):
        assert f"{w} host-" in out.stdout and "exited=0 ok=True" in out.stdout
    assert "succeeded [0, 1, 2, 3] failed []" in out.stdout
    assert "PodError: `test ! -e /tmp/broken` failed on 1 of 4 workers: w2 exit 1." in out.stdout
    assert "failed [2] succeeded [0, 1, 3]" in out.stdout
    assert "w2 exited 1" in out.stdout
    assert "warn ok False failed [2]" in out.stdout
