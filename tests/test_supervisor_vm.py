"""The supervisor's VM on the simulated pod (docs/supervisor.md, "The VM"): one general-purpose
VM (e2-micro) made with the laptop's own tpufab, its service under the VM's init
(Restart=always), back after a SIGKILL and after instances.reset; `supervisor status`, `down`
refused with a live job, `gc` listing it once idle, its idle self-deletion; and a supervisor
whose service account lacks a permission, named before anything is installed.

The service here is a stand-in (tests/supervisor_standin: a heartbeat a second, and the idle
end through tpufab's own vm.IdleWatch / vm.delete_self), installed beside tpufab from a wheel
of its own; the product's unit runs `python -m tpufab.flows.supervisor serve`.
"""

from __future__ import annotations

import hashlib
import json
import shlex
import subprocess
import time
from pathlib import Path

import pytest
from helpers import cli_env, compute_clients, ok, one_sentence, sim_settings, tpufab, unique_name
from helpers import wait_for as wait_until

# the first test includes the VM's install from the package index (tens of seconds; more on
# a loaded machine): bounded, but not by the default 300 s
pytestmark = [pytest.mark.sim, pytest.mark.timeout(600)]

HERE = Path(__file__).resolve().parent
STANDIN = HERE / "supervisor_standin"
IDLE = 25   # seconds: long enough for `gc` to see it idle, short enough to watch it go
ZONE = "us-central1-a"   # a zone of its own: `gc` there meets no other test's nodes


@pytest.fixture(scope="module")
def home(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("supervisor-home")


@pytest.fixture(scope="module")
def standin_wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("standin-wheel")
    uv = Path(__import__("sys").executable).with_name("uv")
    subprocess.run([str(uv), "build", "--wheel", "--quiet", "--out-dir", str(out),
                    str(STANDIN)], check=True, timeout=300)
    return next(out.glob("tpufab_standin-*.whl"))


def _settings(sim, home: Path, name: str, bucket: str):
    return sim_settings(sim, home, zone=ZONE, supervisor_name=name, supervisor_bucket=bucket,
                        supervisor_machine_type="e2-micro", supervisor_idle=f"{IDLE}s")


def _env(sim, home: Path, name: str, bucket: str) -> dict[str, str]:
    return {**cli_env(sim, home), "TPUFAB_ZONE": ZONE, "TPUFAB_SUPERVISOR_NAME": name,
            "TPUFAB_SUPERVISOR_BUCKET": bucket, "TPUFAB_SUPERVISOR_MACHINE_TYPE": "e2-micro",
            "TPUFAB_SUPERVISOR_IDLE": f"{IDLE}s"}


@pytest.fixture(scope="module")
def supervisor(sim, home, standin_wheel):
    """A supervisor VM (the stand-in service) and one live job in its bucket."""
    from tpufab.cloud.storage import Storage
    from tpufab.flows.supervisor import vm
    from tpufab.flows.supervisor.state import Code, Records, job_spec, new_job_id

    name, bucket = unique_name("sup"), unique_name("sup-bucket")
    settings = _settings(sim, home, name, bucket)
    store = Storage.from_settings(settings)
    store.ensure_bucket(bucket, project=sim.project)
    records = Records(store, bucket)
    job = new_job_id()
    spec_settings = sim_settings(sim, home, name="pod-a", type="v4-8")
    records.create(job_spec(spec_settings, job, "recipes/train.sh",
                            code=Code.of("0123456789abcdef0123456789abcdef01234567")))
    made = vm.ensure(settings, module="tpufab_standin", extra_wheels=[standin_wheel])
    try:
        yield {"settings": settings, "vm": made, "records": records, "job": job,
               "wheels": [standin_wheel],
               "store": store, "bucket": bucket, "name": name,
               "env": _env(sim, home, name, bucket)}
    finally:
        vm.down(settings, force=True)


def _clients(sim):
    clients = compute_clients(sim)
    clients.zone = ZONE
    return clients


def _install(s) -> dict:
    from tpufab.flows.supervisor.vm import install_record_name

    return s["store"].read_json(s["bucket"], install_record_name(s["name"]))[0]


def _heartbeat(s) -> dict | None:
    from tpufab.flows.supervisor.state import heartbeat_name

    found = s["store"].read_json(s["bucket"], heartbeat_name(s["name"]))
    return found[0] if found else None


def _ssh(s, *command: str) -> str:
    return ok(tpufab("supervisor", "ssh", "--", *command, env=s["env"], timeout=60))


def test_up_installs_the_laptops_own_tpufab_in_a_venv_of_its_own(supervisor):
    from tpufab import __version__
    from tpufab.flows.supervisor import wheel

    made = supervisor["vm"]
    assert made.created and made.machine_type == "e2-micro"
    print("install steps (s):", _install(supervisor).get("seconds"))
    assert made.version == __version__ and made.code_id == wheel.code_id()
    laptop = ok(tpufab("--version", env=supervisor["env"])).strip()
    beat = wait_until(lambda: _heartbeat(supervisor), 60, 0.5, "the service's first heartbeat")
    assert beat["tpufab_file"].startswith("/opt/tpufab-supervisor/venv/lib/")
    assert beat["user"] == "tpufab-supervisor" and beat["uid"] != 0   # a user of its own
    # its files are its own: the same bytes as this laptop's code, in its venv, and nothing of
    # this machine's checkout or site-packages is there to import by accident (one ssh)
    here = Path(__import__("tpufab").__file__).parent / "flows" / "supervisor" / "vm.py"
    there = beat["tpufab_file"].replace("__init__.py", "flows/supervisor/vm.py")
    mine = [str(HERE), str(here.parent)]   # this checkout, this machine's installed tpufab
    version, digest, system, *seen = _ssh(supervisor, "; ".join([
        "/opt/tpufab-supervisor/venv/bin/tpufab --version", f"sha256sum {there}",
        "python3 -c 'import importlib.util as u; print(u.find_spec(\"tpufab\"))'",
        "for p in " + " ".join(shlex.quote(m) for m in mine) + "; do test -e \"$p\" && "
        "echo \"$p\"; done; true"])).split("\n")
    assert version.strip() == laptop
    assert digest.split()[0] == hashlib.sha256(here.read_bytes()).hexdigest()
    assert system.strip() == "None"   # the image's python3 has no tpufab
    assert not [s for s in seen if s.strip()], seen   # neither path exists on the VM
    # `supervisor up` again, warm: the same code is running, nothing is made or reinstalled
    again = ok(tpufab("supervisor", "up", env=supervisor["env"], timeout=120))
    assert "running" in again and "made" not in again


def _restarted(s, before: dict) -> dict | None:
    beat = _heartbeat(s)
    return beat if beat and beat["pid"] != before["pid"] and \
        beat["started_at"] > before["started_at"] else None


def test_the_service_comes_back_after_sigkill(supervisor):
    before = wait_until(lambda: _heartbeat(supervisor), 60, 0.5, "a heartbeat")
    _ssh(supervisor, f"sudo kill -KILL {before['pid']}")
    after = wait_until(lambda: _restarted(supervisor, before), 30, 0.5,
                       "the service started again by the VM's init")
    assert after["user"] == "tpufab-supervisor"
    shown = _ssh(supervisor, "systemctl show tpufab-supervisor.service")
    assert "NRestarts=1" in shown and "ActiveState=active" in shown, shown


def test_the_service_comes_back_after_instances_reset(sim, supervisor):
    from tpufab.flows.supervisor.vm import install_record_name

    clients = _clients(sim)
    before = wait_until(lambda: _heartbeat(supervisor), 60, 0.5, "a heartbeat")
    installed = supervisor["store"].read_json(supervisor["bucket"],
                                              install_record_name(supervisor["name"]))[0]
    reset_at = time.time()
    clients.wait(clients.instances.reset_unary(project=sim.project, zone=ZONE,
                                               instance=supervisor["name"]))
    wait_until(lambda: _restarted(supervisor, before), 60, 0.5, "the service after the reset")

    def booted_again():
        found = supervisor["store"].read_json(supervisor["bucket"],
                                              install_record_name(supervisor["name"]))[0]
        return found if found["at"] > reset_at and found["booted_at"] > installed["booted_at"] \
            else None

    again = wait_until(booted_again, 60, 0.5, lambda: "the startup script's record of the new "
                       "boot; its log:\n" + _ssh(supervisor, "tail -30 "
                                                  "/var/log/google-startup-scripts.log"))
    assert again["ok"] and again["install_id"] == installed["install_id"]
    log = _ssh(supervisor, "cat /var/log/google-startup-scripts.log")
    assert "this tpufab is installed already" in log   # kept on its disk, not reinstalled


def test_status_names_machine_type_uptime_jobs_and_cost(supervisor):
    from tpufab.flows.supervisor.vm import hourly_cost

    text = ok(tpufab("supervisor", "status", env=supervisor["env"]))
    assert "e2-micro" in text and f"${hourly_cost('e2-micro'):.4f}/h" in text
    assert "1 live of 1" in text and supervisor["job"] in text
    found = json.loads(ok(tpufab("supervisor", "status", "--json", env=supervisor["env"])))
    assert found["vm"]["machine_type"] == "e2-micro" and found["live_jobs"] == [supervisor["job"]]
    assert 0 < found["uptime_seconds"] < 3600 and found["hourly_usd"] == hourly_cost("e2-micro")


def test_down_is_refused_while_a_job_is_live(sim, supervisor):
    result = tpufab("supervisor", "down", env=supervisor["env"])
    one_sentence(result, "live job", supervisor["job"], "--force")
    clients = _clients(sim)
    assert clients.instances.get(project=sim.project, zone=ZONE,
                                 instance=supervisor["name"]).status == "RUNNING"


OTHER_CODE = "feedfacefeedface"   # the code id of "another tpufab" on the laptop


def test_another_tpufab_is_refused_while_a_job_is_live(supervisor, monkeypatch):
    from tpufab.errors import ConfigError
    from tpufab.flows.supervisor import vm, wheel

    monkeypatch.setattr(wheel, "code_id", lambda dist=None: OTHER_CODE)
    with pytest.raises(ConfigError, match="it is upgraded only between jobs") as refused:
        vm.ensure(supervisor["settings"], module="tpufab_standin",
                  extra_wheels=supervisor["wheels"])
    assert supervisor["job"] in str(refused.value) and "\n" not in str(refused.value)
    assert _ssh(supervisor, "systemctl is-active tpufab-supervisor").strip() == "active"


def test_between_jobs_another_tpufab_upgrades_it_in_place_then_idle_it_goes(
        sim, supervisor, monkeypatch):
    from google.api_core import exceptions as gexc

    from tpufab.flows.supervisor import vm, wheel
    from tpufab.flows.supervisor.state import finish

    records, job = supervisor["records"], supervisor["job"]
    records.update(job, lambda s: finish(s, "cancelled", records.now(), "test over"))
    wait_until(lambda: (_heartbeat(supervisor) or {}).get("live") == 0, 20, 0.5,
               "the service to see no live job")
    before = _heartbeat(supervisor)
    monkeypatch.setattr(wheel, "code_id", lambda dist=None: OTHER_CODE)
    upgraded = vm.ensure(supervisor["settings"], module="tpufab_standin",
                         extra_wheels=supervisor["wheels"])
    assert upgraded.upgraded and not upgraded.created and upgraded.code_id == OTHER_CODE
    wait_until(lambda: _restarted(supervisor, before), 30, 0.5, "the upgraded service")
    monkeypatch.undo()
    # `tpufab gc` would list it now (tpufab.pod.pods.gc, vm.idle_supervisor); on this tree
    # `gc` itself fails before that (pods.gc calls a lifecycle.gc that moved to cloud.gc)
    assert vm.idle_supervisor(supervisor["settings"]).name == supervisor["name"]
    clients = _clients(sim)

    def gone():
        try:
            clients.instances.get(project=sim.project, zone=ZONE,
                                  instance=supervisor["name"])
        except gexc.NotFound:
            return True
        return False

    wait_until(gone, IDLE + 40, 0.5, "the idle VM to delete itself")   # from the upgrade on
    beat = _heartbeat(supervisor)
    assert beat["deleting"] is not None   # it was the service that asked, with its own token
    assert records.state(job)[0].state == "cancelled"   # the bucket keeps the records
    text = ok(tpufab("supervisor", "status", env=supervisor["env"]))
    assert "No supervisor VM is running" in text and "keeps 1 job" in text


def test_a_missing_permission_is_named_with_its_role_and_nothing_is_left(sim, sim_admin, home):
    name, bucket = unique_name("sup"), unique_name("sup-bucket")
    sim_admin.deny_permission("tpu.nodes.create")
    result = tpufab("supervisor", "up", env=_env(sim, home, name, bucket), timeout=300)
    one_sentence(result, "tpu.nodes.create", "roles/tpu.admin", progress=2)
    clients = _clients(sim)
    names = [i.name for i in clients.instances.list(project=sim.project, zone=ZONE)]
    assert name not in names   # the VM made for it is deleted again
