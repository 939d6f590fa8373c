"""A general-purpose VM on the simulated Compute Engine (docs/simulated-pod.md, "General-purpose
VMs"): an e2-micro made with the official client is a VM with sshd, a metadata server with a
service-account token and no TPU; only an OS image's folders; `useradd` works; its init runs
the unit its startup script writes (as that unit's user, Restart=always: back after a
SIGKILL) and, after instances.reset, starts the enabled unit again and runs the startup
script again."""

from __future__ import annotations

import json

import pytest
from helpers import compute_clients, metadata_keys, ssh_run, unique_name, wait_for

pytestmark = pytest.mark.sim

# The startup script a user would write: a user of its own, a unit, enable --now.
STARTUP = r"""#!/bin/bash
set -e
echo "boot $(date +%s.%N)" >> /var/log/boots
id -u ticker >/dev/null 2>&1 || useradd --system --user-group --shell /usr/sbin/nologin ticker
mkdir -p /var/lib/ticker && chown ticker:ticker /var/lib/ticker
cat > /etc/systemd/system/ticker.service <<'EOF'
[Unit]
Description=ticks
[Service]
User=ticker
Environment="GREETING=hello there"
ExecStart=/bin/sh -c 'echo "$$ $(id -un) $GREETING" > /var/lib/ticker/pid; exec sleep 3600'
Restart=always
RestartSec=0.5
[Install]
WantedBy=multi-user.target
EOF
systemctl daemon-reload
systemctl enable --now ticker
"""


@pytest.fixture(scope="module")
def vm(sim, ssh_key):
    clients = compute_clients(sim)
    name = unique_name("gp")
    v1 = clients.v1
    clients.wait(clients.instances.insert_unary(
        project=sim.project, zone=sim.zone, instance_resource=v1.Instance(
            name=name, machine_type=f"zones/{sim.zone}/machineTypes/e2-micro",
            network_interfaces=[v1.NetworkInterface(access_configs=[v1.AccessConfig()])],
            service_accounts=[v1.ServiceAccount(email="default", scopes=[
                "https://www.googleapis.com/auth/cloud-platform"])],
            metadata=v1.Metadata(items=[
                v1.Items(key="startup-script", value=STARTUP),
                v1.Items(key="ssh-keys", value=metadata_keys("alice", ssh_key))]))))
    inst = clients.instances.get(project=sim.project, zone=sim.zone, instance=name)
    ip = inst.network_interfaces[0].network_i_p
    wait_for(lambda: ssh_run(ip, ssh_key, "alice", "true").returncode == 0, 30, 0.2,
             "sshd on the VM")
    try:
        yield {"name": name, "ip": ip, "clients": clients, "key": ssh_key}
    finally:
        clients.wait(clients.instances.delete_unary(project=sim.project, zone=sim.zone,
                                                    instance=name))


def sh(vm, command: str) -> str:
    done = ssh_run(vm["ip"], vm["key"], "alice", command)
    assert done.returncode == 0, done.stderr
    return done.stdout


def ticker(vm) -> list[str] | None:
    done = ssh_run(vm["ip"], vm["key"], "alice", "cat /var/lib/ticker/pid 2>/dev/null")
    return done.stdout.split() or None if done.returncode == 0 else None


def test_a_general_purpose_vm_is_a_vm_without_tpu_and_without_the_hosts_files(vm):
    meta = "curl -sf -H 'Metadata-Flavor: Google' http://metadata.google.internal/computeMetadata/v1/"
    assert sh(vm, meta + "instance/machine-type").endswith("/machineTypes/e2-micro")
    token = json.loads(sh(vm, meta + "instance/service-accounts/default/token"))
    assert token["access_token"].startswith("ya29.")
    attributes = sh(vm, meta + "instance/attributes/").split()
    assert "accelerator-type" not in attributes and "tpu-env" not in attributes
    assert sh(vm, "ls /dev | grep -c -E '^(accel|vfio)' || true").strip() == "0"
    top = set(sh(vm, "ls /").split())
    assert {"usr", "etc", "home", "tmp"} <= top and not top & {"work", "farm"}, top
    assert not sh(vm, "ls /opt").count("tpufab-sim")   # not the TPU workers' shared site


def test_its_init_runs_the_unit_its_startup_script_wrote_and_restarts_it(vm):
    first = wait_for(lambda: ticker(vm), 60, 0.3, "the unit's first start")
    assert first[1:] == ["ticker", "hello", "there"]   # as its User=, with its Environment=
    assert sh(vm, "systemctl is-active ticker").strip() == "active"
    assert sh(vm, "systemctl is-enabled ticker").strip() == "enabled"
    sh(vm, f"sudo kill -KILL {first[0]}")
    again = wait_for(lambda: (t := ticker(vm)) and t[0] != first[0] and t, 15, 0.2,
                     "Restart=always to start it again")
    assert again[1] == "ticker"
    assert "NRestarts=1" in sh(vm, "systemctl show ticker")
    sh(vm, "sudo systemctl stop ticker")
    assert sh(vm, "systemctl is-active ticker || true").strip() == "inactive"
    stopped = sh(vm, "systemctl show ticker")
    assert "SubState=dead" in stopped and "MainPID=0" in stopped   # no restart pending
    sh(vm, "sudo systemctl start ticker")
    wait_for(lambda: (t := ticker(vm)) and t[0] != again[0], 15, 0.2, "systemctl start")


def test_after_reset_the_enabled_unit_and_the_startup_script_run_again(sim, vm):
    before = ticker(vm) or wait_for(lambda: ticker(vm), 30, 0.3, "the unit")
    boots = sh(vm, "cat /var/log/boots").count("boot")
    clients = vm["clients"]
    clients.wait(clients.instances.reset_unary(project=sim.project, zone=sim.zone,
                                               instance=vm["name"]))
    wait_for(lambda: ssh_run(vm["ip"], vm["key"], "alice", "true").returncode == 0, 30, 0.2,
             "sshd after the reset")
    after = wait_for(lambda: (t := ticker(vm)) and t[0] != before[0] and t, 30, 0.3,
                     "the unit after the reset")
    assert after[1] == "ticker"
    wait_for(lambda: sh(vm, "cat /var/log/boots").count("boot") == boots + 1, 30, 0.3,
             "the startup script at the new boot")
    assert sh(vm, "id -un ticker").strip() == "ticker"   # its disk kept: the user is there
