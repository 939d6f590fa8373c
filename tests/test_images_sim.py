"""Images on a simulated 2-worker pod (v4-16): pre-heat with a host failing auth, `run
--image` (the image's OS, the job env, the TPU device files, the deployed code), a digest
that differs refused, a host without room refused before it pulls, another registry with
the credentials the user names (on stdin), stacks, top and status seeing into the container,
kill of a TPU holder inside a container leaving the VM's own runtime container alone, secrets
not in `docker inspect`, argv or files. Two workers: each point is about hosts that differ.

The base image is built once per machine beside the shared site (tests/helpers.py's cache;
tpufab.sim.image) and pushed to this session's simulated registry.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
from harness import connected_pod
from helpers import call, in_worker, on_workers, tpufab, wait_for, write_recipe

pytestmark = pytest.mark.sim

SECRET = "hf_imagesecret_4c1d2e"
RUNTIME = "tpu-runtime"

FACTS = """#!/bin/bash
. /etc/os-release
echo "os=$ID"
echo "rank=$TPU_WORKER_ID run=${TPUFAB_RUN_ID:+set} python=$TPUFAB_PYTHON"
echo "devices=$(ls /dev/accel* | tr '\\n' ' ')"
echo "code=$(cat "$(dirname "$0")/marker.txt")"
echo "secret=${#HF_TOKEN}"
"""

HOLDER = """#!/bin/bash
echo "secret=${#HF_TOKEN}"
exec python3 -c '
import os, time
fd = os.open("/dev/accel0", os.O_RDONLY)
print("holding", flush=True)
time.sleep(120)
'
"""


@pytest.fixture(scope="module")
def img(sim, tmp_path_factory):
    """The pod, the base image pushed (its reference and digest), the sim's admin client."""
    from tpufab.sim.admin import SimAdmin
    from tpufab.sim.image import publish

    for tool in ("podman", "docker-registry", "skopeo", "runc", "catatonit"):
        assert shutil.which(tool), f"{tool} is missing: scripts/bootstrap.sh installs it"
    share = Path(os.environ.get("TPUFAB_TEST_SIM_CACHE",
                                Path.home() / ".cache" / "tpufab" / "test-sim")) / "share"
    admin = SimAdmin.from_info(sim)
    # the slim base (the OS and Python, ~50 MB): the full one carries JAX (~650 MB), whose
    # push and pulls would cost CI a minute; docs/images.md has its figures
    reference, digest = publish(admin.registry(), share, project=sim.project, name="slim",
                                jax=False)
    # site="jax": py-spy for `stacks` (the pod's shared site; a hard link if built already)
    with connected_pod(sim, tmp_path_factory, "img", type="v4-16", site="jax") as pod:
        pod.reference, pod.digest, pod.admin, pod.share = reference, digest, admin, share
        pod.sim = sim
        try:
            yield pod
        finally:
            admin.registry(failAuth=0, slowSeconds=0)


def git_project(folder: Path, files: dict[str, str]) -> Path:
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t",
           "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"}
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        write_recipe(folder, name, text)
    for argv in (["git", "init", "-q", "-b", "main"], ["git", "add", "-A"],
                 ["git", "commit", "-q", "-m", "recipes"]):
        subprocess.run(argv, cwd=folder, check=True, env=env, capture_output=True)
    return folder


def as_root(img, command: str, workers=None) -> dict[int, str]:
    return on_workers(img.pod, f"sudo -n sh -c {shlex.quote(command)}", workers=workers)


def test_pull_with_a_host_failing_auth_twice_comes_up_with_the_retries_shown(img):
    img.admin.registry(failAuth=0.5, failTimes=2)     # of 2 hosts: w1
    try:
        pulled = call(img.env, "image_pull", cwd=img.base, recipe=img.reference, timeout=240)
    finally:
        refused = img.admin.registry()["refused"]
        img.admin.registry(failAuth=0)
    assert pulled.returncode == 0, pulled.stdout + pulled.stderr
    assert list(refused.values()) == [2] and next(iter(refused)).endswith("/1")
    assert "w1: auth and pull retried 2 times before it came up" in pulled.stderr
    assert "login to us-docker.pkg.dev" in pulled.stderr
    assert f"is {img.digest} on w[0-1]" in pulled.stdout
    # a second pull of the present digest is a re-check: nothing pulled
    again = call(img.env, "image_pull", cwd=img.base, recipe=img.reference, timeout=120)
    assert again.returncode == 0, again.stdout + again.stderr
    assert "present (re-checked)" in again.stdout and "already on w[0-1]" in again.stdout
    # setup --image: the script, then the same pull
    script = write_recipe(img.base, "setup.sh", "#!/bin/sh\necho set up\n")
    setup = call(img.env, "setup", cwd=img.base, script=str(script), image=img.reference,
                 timeout=120)
    assert setup.returncode == 0, setup.stdout + setup.stderr
    assert f"Image: {img.reference} is {img.digest} on w[0-1] (already on w[0-1]" in \
        setup.stdout


def test_an_anonymous_pull_is_refused_with_artifact_registrys_sentence(img):
    anonymous = img.pod.fanout.run(
        "sudo -n docker logout us-docker.pkg.dev >/dev/null 2>&1; sudo -n docker pull -q "
        f"{shlex.quote(img.reference)}", workers=[0])
    assert not anonymous[0].ok
    assert "Unauthenticated request" in anonymous[0].stderr


def test_run_with_an_image_sees_its_os_the_job_env_the_tpu_and_the_deployed_code(img,
                                                                                tmp_path):
    project = git_project(tmp_path / "proj", {"facts.sh": FACTS, "marker.txt": "deployed-7\n"})
    result = call(img.env, "run", cwd=project, recipe="facts.sh", direct=True, raw=True,
                  image=img.reference, extra_env={"HF_TOKEN": SECRET}, timeout=240)
    assert result.returncode == 0, result.stdout + result.stderr
    for w in (0, 1):
        assert f"w{w} │ os=tpufab-sim" in result.stdout          # the image's, not Debian's
        assert f"w{w} │ rank={w} run=set python=python3" in result.stdout
        assert f"w{w} │ devices=/dev/accel0 /dev/accel1 /dev/accel2 /dev/accel3" in \
            result.stdout
        assert f"w{w} │ code=deployed-7" in result.stdout
        assert f"w{w} │ secret={len(SECRET)}" in result.stdout
    assert f"@{img.digest} on w[0-1]" in result.stderr          # pinned by digest
    assert SECRET not in result.stdout + result.stderr
    # --rm: nothing of the run is left as a container
    left = as_root(img, "docker ps -a --filter label=tpufab-run --format '{{.Names}}'")
    assert left == {0: "", 1: ""}


def test_a_digest_that_differs_between_hosts_is_refused_naming_the_host(img, tmp_path):
    from tpufab.sim.image import publish

    state = img.admin.registry()
    first, one = publish(state, img.share, project="sim-project", name="moving", tag="v1",
                         files={"/etc/moving": b"1\n"}, jax=False)
    pulled = call(img.env, "image_pull", cwd=img.base, recipe=first, timeout=120)
    assert pulled.returncode == 0, pulled.stderr
    _, two = publish(state, img.share, project="sim-project", name="moving", tag="v1",
                     files={"/etc/moving": b"2\n"}, jax=False)
    assert two != one
    again = call(img.env, "image_pull", cwd=img.base, recipe=first, worker="1", timeout=120)
    assert again.returncode == 0, again.stderr
    project = git_project(tmp_path / "proj", {"facts.sh": FACTS, "marker.txt": "x\n"})
    refused = call(img.env, "run", cwd=project, recipe="facts.sh", no_deploy=True,
                   image=first, timeout=120)
    assert refused.returncode != 0
    assert "Traceback" not in refused.stderr
    assert f"w1: {two} (differs)" in refused.stderr and f"w0 {one}" in refused.stderr
    assert "Not starting" in refused.stderr


STORAGE = "/var/lib/containers/storage"     # the simulated worker's podman graphroot


def test_a_host_without_room_is_refused_before_it_pulls_and_status_shows_it(img):
    """w1's storage is an 8 MB tmpfs: the slim image (~50 MB compressed) needs 3 times that."""
    node = img.pod.node
    in_worker(img.sim, node, 1, f"mkdir -p {STORAGE} && mount -t tmpfs -o size=8m tmpfs "
                                f"{STORAGE}")
    try:
        pulled = call(img.env, "image_pull", cwd=img.base, recipe=img.reference, timeout=180)
        assert pulled.returncode == 1, pulled.stdout + pulled.stderr
        assert "Traceback" not in pulled.stderr
        assert f"w1 has no room for {img.reference}, refused before the pull: it needs " in \
            pulled.stderr
        assert f" free in {STORAGE} (3 x its " in pulled.stderr and " and it has 8." in \
            pulled.stderr
        used = in_worker(img.sim, node, 1, f"du -sk {STORAGE} | cut -f1").strip()
        assert int(used) < 1024, used                      # no layer reached w1
        status = call(img.env, "status", cwd=img.base, extra_env={"TPUFAB_IMAGE": img.reference},
                      timeout=120)
        assert status.returncode == 0, status.stdout + status.stderr
        assert f"Image {img.reference}: {img.digest[:19]}... on w0; not on w1 (" in \
            status.stdout
    finally:
        in_worker(img.sim, node, 1, f"umount -l {STORAGE}")


def test_another_registry_takes_the_credentials_the_user_names_on_stdin(img):
    from tpufab.sim.registry import OTHER_HOST

    user, password = Path(img.admin.registry()["accountFile"]).read_text().strip().split(":", 1)
    ref = f"{OTHER_HOST}/{img.reference.split('/', 1)[1]}"
    anonymous = call(img.env, "image_pull", cwd=img.base, recipe=ref, worker="0", timeout=120)
    assert anonymous.returncode == 1, anonymous.stdout + anonymous.stderr
    assert f"{ref.split(':')[0]}: unauthorized (an anonymous pull was refused" in \
        anonymous.stderr, anonymous.stderr
    assert "name the registry's credentials with the registry_login setting" in anonymous.stderr
    login = {"TPUFAB_REGISTRY_LOGIN": "SIM_REG_USER:SIM_REG_PASSWORD", "SIM_REG_USER": user,
             "SIM_REG_PASSWORD": password}
    pulled = call(img.env, "image_pull", cwd=img.base, recipe=ref, worker="0", extra_env=login,
                  timeout=180)
    assert pulled.returncode == 0, pulled.stdout + pulled.stderr
    assert f"{ref} is {img.digest} on w0" in pulled.stdout
    assert password not in pulled.stdout + pulled.stderr
    # root's alone on the worker (docker login's store), in no file another user can read
    found = as_root(img, f"grep -rl {shlex.quote(password)} /home /tmp /etc /root /run "
                         "2>/dev/null | head -3; stat -c %a /run/containers/0/auth.json",
                    workers=[0])
    assert found == {0: "600"}


def test_kill_stops_the_tpu_holder_in_its_container_and_leaves_the_runtime_alone(img,
                                                                               tmp_path):
    """Before the kill, while the holder runs: stacks, top and status see into its container."""
    as_root(img, f"docker rm -f {RUNTIME} >/dev/null 2>&1; docker run -d --name {RUNTIME} "
                 f"--network host {shlex.quote(img.reference)} sleep 600 >/dev/null")
    project = git_project(tmp_path / "proj", {"hold.sh": HOLDER})
    started = call(img.env, "run", cwd=project, recipe="hold.sh", direct=True, detach=True,
                   image=img.reference, extra_env={"HF_TOKEN": SECRET}, timeout=240)
    assert started.returncode == 0, started.stdout + started.stderr
    run_id = started.stderr.split("Run ", 1)[1].split(":", 1)[0]

    def holding() -> bool:
        logs = call(img.env, "logs", cwd=project, run=run_id, raw=True)
        return logs.stdout.count("holding") == 2

    wait_for(holding, 60, what="the container's TPU holder on both workers")
    # the secret reached the recipe on stdin: not in docker inspect, argv or files
    name = f"tpufab-{run_id}"
    inspect = as_root(img, f"docker inspect {name}")
    for text in inspect.values():
        assert json.loads(text)[0]["Config"]["Labels"]["tpufab-run"] == run_id
        assert SECRET not in text
    argv = as_root(img, "cat /proc/[0-9]*/cmdline 2>/dev/null | tr '\\0' ' '")
    files = as_root(img, f"grep -rl {SECRET} /home /tmp /root /run "
                         "/var/lib/containers/storage/overlay-containers 2>/dev/null | head -3; "
                         "true")
    for w in (0, 1):
        assert SECRET not in argv[w] and files[w] == ""

    # stacks, top and status see into the container (py-spy from the host's PID namespace)
    stacks = call(img.env, "stacks", cwd=project, run=run_id, as_json=True, timeout=120)
    assert stacks.returncode == 0, stacks.stdout + stacks.stderr
    data = json.loads(stacks.stdout)
    assert data["run"] == run_id and data["source"] == "run"
    for w in ("0", "1"):
        [holder] = [p for p in data["workers"][w]["processes"] if "threads" in p]
        assert holder["command"].startswith("python3 -c"), holder
        assert holder["threads"][0]["frames"][0]["function"] == "<module>", holder
    top = tpufab("top", "--once", "--json", env=img.env, cwd=project, timeout=120)
    assert top.returncode == 0, top.stdout + top.stderr
    for load in json.loads(top.stdout)["workers"]:
        [run] = [r for r in load["runs"] if r["run"] == run_id]
        # the docker CLI, and inside: the container's init and the recipe's python3
        assert run["processes"] >= 3, load["runs"]
    status = call(img.env, "status", cwd=project, extra_env={"TPUFAB_IMAGE": img.reference},
                  timeout=120)
    assert f"Image {img.reference}: {img.digest[:19]}... on w[0-1]." in status.stdout

    killed = call(img.env, "kill", cwd=project, timeout=120)
    assert killed.returncode == 0, killed.stdout + killed.stderr
    assert f"container  {name} (run {run_id}): stopped" in killed.stdout
    running = as_root(img, "docker ps --format '{{.Names}}'")
    assert running == {0: RUNTIME, 1: RUNTIME}          # tpufab's gone; the runtime's kept
    holders = as_root(img, "for p in /proc/[0-9]*; do ls -l $p/fd 2>/dev/null; done | "
                           "grep -c /dev/accel; true")
    assert holders == {0: "0", 1: "0"}
    as_root(img, f"docker rm -f {RUNTIME} >/dev/null")

