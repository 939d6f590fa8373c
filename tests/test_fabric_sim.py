"""Fabric's own API on the simulated pod (one v4-16: 2 workers): `Pod.connections()` are
fabric.Connection objects made as tpufab connects, so the mesh-transformer-jax `ray_tpu.py`
pattern runs after one line changes; `Pod.group()` is Fabric's Group on tpufab's fan-out;
`fab -H POD-w0,POD-w1` runs a fabfile's task through the entries `tpufab config-ssh` wrote."""

from __future__ import annotations

import difflib
import io
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from harness import sim_node
from helpers import POD_USER, ok, tpufab

pytestmark = pytest.mark.sim

fabric = pytest.importorskip("fabric")

# mesh-transformer-jax's ray_tpu.py / TPU_cluster.py, in its shape: a Connection per endpoint
# of the TPU API, then on each (a thread apiece) put the code, sudo an install, run a command.
DRIVER = '''\
import functools
import glob
import os
import sys
from multiprocessing import pool

from fabric import Connection


def get_connection(name, zone):
    info = check_tpu(name, zone)
    return [Connection(i["ipAddress"], connect_kwargs={
        "key_filename": os.path.expanduser("~/.ssh/google_compute_engine")})
        for i in info["networkEndpoints"]]


def start_ray(conn, address):
    conn.sudo("rm -rf *.py", hide=True)
    for i in glob.glob("*.py"):
        conn.put(i, "")
    conn.put("scripts/init_ray.sh", "/tmp/ray-tpu.sh")
    conn.sudo("chmod +x /tmp/ray-tpu.sh", hide=True)
    conn.sudo("/tmp/ray-tpu.sh", hide=True)
    return conn.run(f"python3 node.py {address}", hide=True).stdout.strip()


tpu_name, region = sys.argv[1], sys.argv[2]
conns = get_connection(tpu_name, region)
with pool.ThreadPool(processes=len(conns)) as p:
    for line in p.map(functools.partial(start_ray, address="10.0.0.2:6379"), conns):
        print(line)
'''
ORIGINAL = "conns = get_connection(tpu_name, region)\n"
CHANGED = "from tpufab import Pod; conns = Pod(tpu_name, zone=region).connections()\n"
INIT_RAY = "#!/bin/sh\nset -e\nmkdir -p /root/installed\nid -un > /root/installed/by\n"
NODE = "import socket, sys\nprint(socket.gethostname(), 'joins', sys.argv[1])\n"


@pytest.fixture(scope="module")
def node(sim, tmp_path_factory):
    with sim_node(sim, tmp_path_factory, "fab") as made:
        yield made


@pytest.fixture(scope="module")
def pod(node):
    from tpufab import Pod

    with Pod.from_settings(node.settings) as pod:
        yield pod


def hostnames(pod) -> dict[int, str]:
    return {w: r.stdout.strip() for w, r in pod.run("hostname").items()}


def test_the_mesh_transformer_jax_pattern_runs_after_one_changed_line(node, tmp_path):
    driver = DRIVER.replace(ORIGINAL, CHANGED)
    changed = [d for d in difflib.ndiff(DRIVER.splitlines(), driver.splitlines())
               if d.startswith(("+ ", "- "))]
    assert changed == ["- " + ORIGINAL.strip(), "+ " + CHANGED.strip()]
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts" / "init_ray.sh").write_text(INIT_RAY)
    (tmp_path / "node.py").write_text(NODE)
    (tmp_path / "run_cluster.py").write_text(driver)
    done = subprocess.run([sys.executable, "run_cluster.py", node.name, node.settings.zone],
                          cwd=tmp_path, env=node.env, capture_output=True, text=True,
                          timeout=240, stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stderr
    from tpufab import Pod

    with Pod.from_settings(node.settings) as pod:
        names = hostnames(pod)
        assert done.stdout.splitlines() == [f"{names[w]} joins 10.0.0.2:6379" for w in (0, 1)]
        by = pod.run("sudo -n cat /root/installed/by; ls ~")
        assert {r.stdout.split()[0] for r in by.values()} == {"root"}  # the sudo'd install
        assert all({"node.py", "run_cluster.py"} <= set(r.stdout.split()[1:])
                   for r in by.values())


def test_connections_are_made_as_tpufab_connects(pod):
    conns = pod.connections()
    assert [c.worker for c in conns] == [0, 1]
    for conn, (_worker, target) in zip(conns, sorted(pod.fanout.targets.items()), strict=True):
        assert (conn.host, conn.user, conn.port) == (target.host, target.user, target.port)
        assert conn.connect_kwargs["key_filename"] == [str(pod.settings.ssh_key_path)]
        assert conn.connect_kwargs["look_for_keys"] is False
        assert conn.gateway is False
        assert conn.client._policy.host_alias == target.host_key_alias  # the worker's pin
    assert conns[1].run("id -un", hide=True, in_stream=False).stdout.strip() == POD_USER
    pins = pod.settings.known_hosts_path
    saved = pins.read_text()
    alias = pod.fanout.targets[0].host_key_alias
    other = next(line.split()[2] for line in saved.splitlines() if not line.startswith(alias))
    try:  # another key pinned for w0: Fabric's connection is refused, as tpufab's would be
        pins.write_text("".join(f"{a} {t} {other if a == alias else k}\n" for a, t, k in
                                (line.split()[:3] for line in saved.splitlines())))
        from tpufab.ssh.hostkeys import HostKeyChanged

        with pytest.raises(HostKeyChanged, match="differs from the one pinned"):
            pod.connections(workers="0")[0].run("true", hide=True, in_stream=False)
    finally:
        pins.write_text(saved)
    for conn in conns:
        conn.close()


def test_group_run_sudo_put_and_get(pod, tmp_path, monkeypatch):
    from fabric.group import GroupResult
    from fabric.runners import Result

    group = pod.group()
    assert isinstance(group, fabric.Group) and len(group) == 2
    names = hostnames(pod)
    result = group.run("hostname", hide=True)
    assert isinstance(result, GroupResult) and sorted(result) == [0, 1]
    assert not result.failed and len(result.succeeded) == 2
    for worker, res in result.items():   # Fabric's own loop: connection.host, result.stdout
        assert isinstance(res, Result) and res.ok and res.exited == 0
        assert (worker.host, res.stdout.strip()) == (pod.fanout.targets[worker].host,
                                                     names[worker])
    out, err = io.StringIO(), io.StringIO()
    group.run("echo said; echo warned >&2", out_stream=out, err_stream=err)  # printed as Fabric
    assert out.getvalue() == "said\nsaid\n" and err.getvalue() == "warned\nwarned\n"
    assert {r.stdout.strip() for r in group.sudo("id -un", hide=True).values()} == {"root"}
    assert {r.stdout.strip() for r in group.sudo("id -un", user=POD_USER, hide=True).values()
            } == {POD_USER}
    data = tmp_path / "data.bin"
    data.write_bytes(bytes(range(256)) * 64)
    put = group.put(str(data), "/tmp/")
    assert {r.remote for r in put.values()} == {"/tmp/data.bin"}
    sums = group.run("sha256sum /tmp/data.bin", hide=True)
    assert len({r.stdout.split()[0] for r in sums.values()}) == 1
    group.run("hostname > /tmp/out.txt", hide=True)
    monkeypatch.chdir(tmp_path)
    got = group.get("/tmp/out.txt")   # default: {worker}/
    for worker, res in got.items():
        assert Path(res.local) == tmp_path / f"w{worker}" / "out.txt"
        assert Path(res.local).read_text().strip() == names[worker]
    by_host = group.get("/tmp/out.txt", local=str(tmp_path / "by-host" / "{host}-{basename}"))
    assert sorted(Path(r.local).name for r in by_host.values()) == sorted(
        f"{pod.fanout.targets[w].host}-out.txt" for w in (0, 1))
    assert group.local("echo here", hide=True, in_stream=False).stdout == "here\n"


def test_a_failing_worker_raises_group_exception_naming_it(pod):
    from fabric.exceptions import GroupException
    from invoke.exceptions import CommandTimedOut, UnexpectedExit

    group = pod.group()
    second = hostnames(pod)[1]
    command = f'test "$(hostname)" != {second}'
    with pytest.raises(GroupException) as caught:
        group.run(command, hide=True)
    assert str(caught.value) == f"`{command}` failed on 1 of 2 workers: w1 exit 1."
    results = caught.value.result
    assert results[0].ok and isinstance(results[1], UnexpectedExit)
    assert list(results.failed) == [1]
    warned = group.run(command, hide=True, warn=True)   # warn: a Result, no exception
    assert warned[1].failed and warned[1].exited == 1 and not warned.failed
    with pytest.raises(GroupException, match=r"w\[0-1\] timed out after 1 s") as slow:
        group.run("sleep 30", hide=True, timeout=1)
    assert all(isinstance(v, CommandTimedOut) for v in slow.value.result.values())
    with pytest.raises(Exception, match="does not take pty"):
        group.run("true", pty=True)


def test_fab_dash_h_runs_a_fabfile_task_on_two_workers(node, pod, tmp_path):
    ok(tpufab("config-ssh", "--yes", "--name", node.name, env=node.env, cwd=node.home))
    (tmp_path / "fabfile.py").write_text(textwrap.dedent('''\
        from fabric import task

        @task
        def train(c):
            c.run("echo training on $(hostname) as $(id -un)")
        '''))
    fab = Path(sys.executable).parent / "fab"
    hosts = f"{node.name}-w0,{node.name}-w1"
    done = subprocess.run([str(fab), "-H", hosts, "train"], cwd=tmp_path, env=node.env,
                          capture_output=True, text=True, timeout=120,
                          stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stderr
    names = hostnames(pod)
    assert done.stdout.splitlines() == [f"training on {names[w]} as {POD_USER}"
                                        for w in (0, 1)]
    ok(tpufab("config-ssh", "--remove", env=node.env, cwd=node.home))
