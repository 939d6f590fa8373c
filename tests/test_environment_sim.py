"""The environment built once, on a simulated v4-16 (2 workers), as a user runs it: `tpufab
setup` with `environment:` in tpufab.yaml, requirements pointing at a package index on
loopback (tests/pyindex.py) that counts every file it serves.

The workers have no uv, so tpufab ships this machine's to worker 0 (docs/environment.md);
interpreters cannot be downloaded here, so the environment uses the workers' own python3.
The tests run in order on one pod: each starts from what the one before it left.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from harness import USER, sim_node
from helpers import in_worker, one_sentence, tpufab, wait_for
from pyindex import PackageIndex

pytestmark = pytest.mark.sim

WORKERS = (0, 1)


@pytest.fixture(scope="module")
def project(sim, tmp_path_factory):
    """A v4-16, a package index and a project folder naming both."""
    root = tmp_path_factory.mktemp("envs-project")
    with PackageIndex(root / "wheels") as index, \
            sim_node(sim, tmp_path_factory, "envs", "v4-16") as node:
        index.add("tfa-alpha", "1.0", requires=["tfa-beta>=1"])
        index.add("tfa-beta", "1.0")
        index.add("tfa-gamma", "1.0")
        folder = root / "proj"
        folder.mkdir()
        (folder / "tpufab.yaml").write_text("environment:\n  requirements: requirements.txt\n")
        yield node, index, folder


def requirements(folder: Path, index: PackageIndex, *lines: str) -> None:
    (folder / "requirements.txt").write_text(f"--index-url {index.url}\n"
                                             + "".join(f"{line}\n" for line in lines))


def wheels_served(index: PackageIndex) -> dict[str, int]:
    return {n.split("-")[0]: c for n, c in index.served().items() if n.endswith(".whl")}


def marker(sim, node, worker: int) -> dict | None:
    text = in_worker(sim, node.node, worker, "cat ~/.venv/.tpufab-env.json 2>/dev/null || :",
                     user=USER)
    return json.loads(text) if text.strip() else None


def imports(sim, node, worker: int, modules: str) -> str:
    return in_worker(sim, node.node, worker, f"~/.venv/bin/python -c 'import sys, {modules}; "
                     "print(sys.prefix)'", user=USER).strip()


def test_a_first_setup_builds_once_and_every_host_gets_that_build(sim, project):
    node, index, folder = project
    requirements(folder, index, "tfa-alpha")
    result = tpufab("setup", env=node.env, cwd=folder)
    assert result.returncode == 0, result.stdout + result.stderr
    assert wheels_served(index) == {"tfa_alpha": 1, "tfa_beta": 1}   # one download per wheel
    markers = [marker(sim, node, w) for w in WORKERS]
    assert markers[0]["hash"] == markers[1]["hash"] and markers[0]["tree"] == markers[1]["tree"]
    short = markers[0]["hash"][:12]
    assert f"Environment {short} at ~/.venv: w0 built; w1 copied from w0." in result.stdout
    for w in WORKERS:
        assert imports(sim, node, w, "tfa_alpha, tfa_beta") == f"/home/{USER}/.venv"


def test_a_second_setup_is_skipped_and_env_status_folds_the_hosts(sim, project):
    node, index, folder = project
    before = index.served()
    result = tpufab("setup", env=node.env, cwd=folder)
    assert result.returncode == 0, result.stderr
    assert "w[0-1] already had it." in result.stdout
    assert index.served() == before
    status = tpufab("env", "status", env=node.env, cwd=folder)
    assert status.returncode == 0, status.stderr
    short = marker(sim, node, 0)["hash"][:12]
    rows = [line for line in status.stdout.splitlines() if line.startswith("w")]
    assert len(rows) == 1 and rows[0].split()[:2] == ["w[0-1]", short], status.stdout
    assert f"Every host has the environment {short} at ~/.venv." in status.stdout

    # a host that lost it: status names it (exit 3), env build gives it the same build again
    in_worker(sim, node.node, 1, "rm -rf ~/.venv", user=USER)
    status = tpufab("env", "status", env=node.env, cwd=folder)
    assert status.returncode == 3 and "w1 lacks the environment" in status.stdout
    built = tpufab("env", "build", env=node.env, cwd=folder)
    assert built.returncode == 0, built.stderr
    assert "w0 already had it; w1 copied from w0." in built.stdout
    assert index.served() == before                       # nothing built, nothing downloaded
    assert marker(sim, node, 1)["tree"] == marker(sim, node, 0)["tree"]


def test_a_changed_requirement_builds_again_downloading_only_what_is_new(sim, project):
    node, index, folder = project
    first = marker(sim, node, 0)["hash"]
    requirements(folder, index, "tfa-alpha", "tfa-gamma")
    result = tpufab("setup", env=node.env, cwd=folder)
    assert result.returncode == 0, result.stderr
    assert "w0 built; w1 copied from w0." in result.stdout
    assert wheels_served(index) == {"tfa_alpha": 1, "tfa_beta": 1, "tfa_gamma": 1}
    hashes = {marker(sim, node, w)["hash"] for w in WORKERS}
    assert len(hashes) == 1 and first not in hashes
    for w in WORKERS:
        imports(sim, node, w, "tfa_gamma")


def test_a_host_that_cannot_take_it_is_retried_then_named_and_the_others_keep_theirs(
        sim, project):
    node, index, folder = project
    requirements(folder, index, "tfa-alpha", "tfa-gamma", "tfa-beta<2")
    in_worker(sim, node.node, 1, "chmod 500 ~/.tpufab/env", user=USER)  # no pull lands
    try:
        result = tpufab("env", "build", env=node.env, cwd=folder)
    finally:
        in_worker(sim, node.node, 1, "chmod 700 ~/.tpufab/env", user=USER)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "did not reach 1 of 2 hosts: w1: " in result.stderr
    assert "(tried 2 times)" in result.stderr and "Traceback" not in result.stderr
    assert marker(sim, node, 0)["hash"] != marker(sim, node, 1)["hash"]
    again = tpufab("env", "build", env=node.env, cwd=folder)
    assert again.returncode == 0, again.stderr
    assert "w0 already had it; w1 copied from w0." in again.stdout
    assert marker(sim, node, 0)["tree"] == marker(sim, node, 1)["tree"]


# Inside w1: a tmpfs too small for the archive is mounted at ~/.tpufab/env, so w1's first pull
# breaks off mid-way (disk full); when that pull removes its part file, this grows the tmpfs
# (inotify: the event is queued, never missed), so the retry has room.
GROW_ON_PART_REMOVED = """
import ctypes, os, select, struct, subprocess, sys
folder = sys.argv[1]
libc = ctypes.CDLL(None, use_errno=True)
fd = libc.inotify_init()
assert libc.inotify_add_watch(fd, folder.encode(), 0x200) >= 0      # IN_DELETE
open("/tmp/grow-ready", "w").close()
while select.select([fd], [], [], 120)[0]:
    data = os.read(fd, 65536)
    while data:
        _wd, _mask, _cookie, size = struct.unpack_from("iIII", data)
        name = data[16:16 + size].rstrip(b"\\0").decode()
        data = data[16 + size:]
        if name.endswith(".part"):
            subprocess.run(["mount", "-o", "remount,size=64m", folder], check=True)
            print("grown after", name)
            sys.exit(0)
sys.exit("no part file was removed")
"""


def test_a_host_that_loses_the_download_mid_way_is_retried_and_gets_it(sim, project):
    import threading

    from helpers import sim_pool

    node, index, folder = project
    index.add("tfa-delta", "1.0", payload=96 << 10)       # an archive of some size
    requirements(folder, index, "tfa-alpha", "tfa-gamma", "tfa-beta<2", "tfa-delta")
    first = tpufab("env", "build", "--worker", "0", env=node.env, cwd=folder)
    assert first.returncode == 0 and "w0 built." in first.stdout, first.stdout + first.stderr
    size = marker(sim, node, 0)["build"]["size"]
    env_dir = f"/home/{USER}/.tpufab/env"
    in_worker(sim, node.node, 1, f"mount -t tmpfs -o size={size // 2},mode=700,"
              f"uid=$(id -u {USER}),gid=$(id -g {USER}) tfa-env {env_dir}")
    grown: dict = {}
    watcher = threading.Thread(target=lambda: grown.update(out=sim_pool(sim).exec_in(
        node.node.id, 1, ["python3", "-c", GROW_ON_PART_REMOVED, env_dir], timeout=150)))
    watcher.start()
    try:
        wait_for(lambda: in_worker(sim, node.node, 1, "test -e /tmp/grow-ready && echo y || :"
                                   ).strip() == "y", 30, what="the watcher on w1")
        result = tpufab("env", "build", "--json", env=node.env, cwd=folder)
        watcher.join(150)
    finally:
        in_worker(sim, node.node, 1, f"umount -l {env_dir}; rm -f /tmp/grow-ready",
                  check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "grown after ." in grown["out"].stdout, grown["out"].stderr   # a pull broke off
    rows = {r["worker"]: r for r in json.loads(result.stdout)["rows"]}
    assert (rows[0]["action"], rows[1]["action"], rows[1]["tries"]) == ("skipped", "copied", 2)
    assert marker(sim, node, 1)["tree"] == marker(sim, node, 0)["tree"]
    imports(sim, node, 1, "tfa_delta")


def test_the_setup_script_and_a_recipe_run_inside_the_environment(sim, project):
    node, _index, folder = project
    (folder / "scripts").mkdir(exist_ok=True)
    (folder / "scripts" / "setup.sh").write_text(
        "#!/bin/sh\necho \"setup python: $(command -v python) VIRTUAL_ENV=$VIRTUAL_ENV\"\n")
    result = tpufab("setup", env=node.env, cwd=folder)
    assert result.returncode == 0, result.stderr
    home = f"/home/{USER}"
    assert f"setup python: {home}/.venv/bin/python VIRTUAL_ENV={home}/.venv" in result.stdout
    assert "already had it." in result.stdout and "Setup setup.sh: w[0-1] ran" in result.stdout
    recipe = folder / "venv.sh"
    recipe.write_text("#!/bin/sh\necho \"recipe VIRTUAL_ENV=$VIRTUAL_ENV python=$(command -v "
                      "python)\"\npython -c 'import tfa_gamma; print(\"gamma\", "
                      "tfa_gamma.VERSION)'\n")
    run = tpufab("run", str(recipe), "--no-deploy", env=node.env, cwd=folder)
    assert run.returncode == 0, run.stdout + run.stderr
    lines = run.stdout.splitlines()
    assert f"recipe VIRTUAL_ENV={home}/.venv python={home}/.venv/bin/python" in lines
    assert "gamma 1.0" in lines                     # folded: every worker printed it


def test_with_a_bucket_every_host_downloads_the_build_from_it(sim, project):
    from helpers import unique_name

    from tpufab.sim.admin import StorageClient

    if not sim.storage_endpoint:
        pytest.skip("the simulated pod runs without Cloud Storage")
    node, index, folder = project
    bucket = unique_name("envs")
    storage = StorageClient(sim.storage_endpoint)
    storage.create_bucket(bucket)
    yaml = folder / "tpufab.yaml"
    original = yaml.read_text()
    short = marker(sim, node, 0)["hash"][:12]
    before = index.served()
    try:
        yaml.write_text(original + f"  bucket: gs://{bucket}/envs\n")   # not in the hash
        in_worker(sim, node.node, 1, "rm -rf ~/.venv", user=USER)
        result = tpufab("env", "build", env=node.env, cwd=folder)
        assert result.returncode == 0, result.stdout + result.stderr
        assert (f"Environment {short} at ~/.venv: w0 already had it; w1 copied from "
                f"gs://{bucket}/envs.") in result.stdout
        [name] = storage.objects(bucket)
        assert name == f"envs/{marker(sim, node, 0)['hash']}.tar.gz"
        assert marker(sim, node, 1)["tree"] == marker(sim, node, 0)["tree"]
        assert index.served() == before

        yaml.write_text(original + "  bucket: gs://no-such-bucket-tpufab/envs\n")
        in_worker(sim, node.node, 1, "rm -rf ~/.venv", user=USER)
        refused = tpufab("env", "build", env=node.env, cwd=folder)
        assert refused.returncode == 1
        one_sentence(refused, "w0 could not put the environment's archive in "
                              "gs://no-such-bucket-tpufab/envs/", "Cloud Storage answered 404",
                     "roles/storage.objectUser", "to copy it host to host.")
    finally:
        yaml.write_text(original)
    again = tpufab("env", "build", env=node.env, cwd=folder)      # host to host again
    assert again.returncode == 0 and "w1 copied from w0." in again.stdout, again.stderr


TASK = """\
type: v4-16
setup: |
  echo "task setup VIRTUAL_ENV=$VIRTUAL_ENV"
run: |
  python -c 'import sys, tfa_gamma; print("task run", sys.prefix, tfa_gamma.VERSION)'
"""


def test_check_names_a_host_without_it_and_a_launch_puts_it_back_first(sim, project):
    node, index, folder = project
    short = marker(sim, node, 0)["hash"][:12]
    in_worker(sim, node.node, 1, "rm -rf ~/.venv", user=USER)
    check = tpufab("check", "--quick", env=node.env, cwd=folder)
    assert check.returncode != 0
    assert (f"w1: no environment at ~/.venv ({short} is on w0); build it there with `tpufab "
            "env build`.") in check.stdout, check.stdout + check.stderr
    (folder / "task.yaml").write_text(TASK)
    before = index.served()
    launched = tpufab("launch", "task.yaml", "--name", node.name, env=node.env, cwd=folder)
    said = launched.stdout + launched.stderr
    assert launched.returncode == 0, said
    assert f"Environment {short} at ~/.venv: w0 already had it; w1 copied from w0." in said
    home = f"/home/{USER}"
    assert f"task setup VIRTUAL_ENV={home}/.venv" in launched.stdout.splitlines()
    assert f"task run {home}/.venv 1.0" in launched.stdout.splitlines()
    assert index.served() == before                     # copied, not downloaded again
    check = tpufab("check", "--quick", env=node.env, cwd=folder)
    assert f"environment  {short} at ~/.venv on w[0-1]" in check.stdout, check.stdout


def test_a_requirement_that_does_not_resolve_is_said_once(sim, project):
    node, index, folder = project
    before = marker(sim, node, 1)
    requirements(folder, index, "tfa-alpha>=3")
    result = tpufab("setup", env=node.env, cwd=folder)
    sentence = one_sentence(result, "requirements.txt does not resolve (w0 asked uv)",
                            "tfa-alpha>=3", "fix requirements.txt")
    assert result.returncode == 1
    assert (result.stdout + result.stderr).count("does not resolve") == 1, sentence
    assert marker(sim, node, 1) == before           # the hosts keep what they had


def test_babysit_recreates_a_preempted_node_with_the_environment_before_the_recipe(
        sim, sim_admin, project):
    """Last here: the node is recreated (new workers, empty homes)."""
    from tpufab.cloud.planes.tpu import TpuApi

    node, index, folder = project
    requirements(folder, index, "tfa-alpha", "tfa-gamma")
    before = wheels_served(index)
    sim_admin.preempt(node.name)
    result = tpufab("babysit", "venv.sh", "--no-deploy", env=node.env, cwd=folder,
                    timeout=300)
    said = result.stdout + result.stderr
    assert result.returncode == 0, said
    assert "recovering it first" in said
    assert "w0 built; w1 copied from w0." in said
    now = wheels_served(index)                 # the new w0 built it: each wheel once more
    assert {k: now[k] - before.get(k, 0) for k in now if now[k] != before.get(k, 0)} == {
        "tfa_alpha": 1, "tfa_beta": 1, "tfa_gamma": 1}
    recreated = TpuApi(node.settings).get_node(node.name)
    assert recreated.id != node.node.id
    assert in_worker(sim, recreated, 1, "~/.venv/bin/python -c 'import tfa_gamma'; echo ok",
                     user=USER).strip() == "ok"
