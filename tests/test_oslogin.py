"""OS Login without workers: the official google-cloud-os-login client and tpufab.cloud.oslogin
against the emulator's OS Login API (in this process, paper workers), and the pure parts."""

from __future__ import annotations

import base64
import hashlib
import threading
import time
from types import SimpleNamespace

import pytest
from google.api_core import exceptions as gexc
from google.api_core.client_options import ClientOptions
from google.auth.credentials import AnonymousCredentials
from google.cloud import oslogin_v1
from google.cloud.oslogin_v1 import common

from tpufab.cloud import oslogin
from tpufab.config import load_settings
from tpufab.errors import ApiError, ConfigError

PROJECT = "p-oslogin"
ACCOUNT = "alice@example.com"
KEY = ("ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIOMqqnkVzrm0SdG6UOoqKLsabgH5C9okWi0dh2l9GKJl "
       "tpufab")


@pytest.fixture(scope="module")
def emulator(tmp_path_factory):
    from tpufab.sim._fakepool import PaperWorkers
    from tpufab.sim.emulator import Emulator, make_server

    emu = Emulator(tmp_path_factory.mktemp("oslogin-api"), PaperWorkers())
    server = make_server(emu, 0)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    emu.endpoint = f"http://127.0.0.1:{server.server_address[1]}"
    yield emu
    server.shutdown()
    thread.join(10)


@pytest.fixture
def client(emulator):
    return oslogin_v1.OsLoginServiceClient(
        transport="rest", credentials=AnonymousCredentials(),
        client_options=ClientOptions(api_endpoint=emulator.endpoint))


def settings_for(emulator, tmp_path, **extra):
    env = {"TPUFAB_API_ENDPOINT": emulator.endpoint, "TPUFAB_PROJECT": PROJECT,
           "TPUFAB_USER_CONFIG": str(tmp_path / "none.yaml"), **extra}
    return load_settings(env=env, cwd=tmp_path)


def test_the_official_client_drives_the_api(client, emulator):
    account = "client-test@example.com"
    empty = client.get_login_profile(name=f"users/{account}")
    assert empty.name == account and not empty.posix_accounts and not empty.ssh_public_keys
    expiry = int((time.time() + 3600) * 1e6)
    imported = client.import_ssh_public_key(request={
        "parent": f"users/{account}", "project_id": PROJECT,
        "ssh_public_key": common.SshPublicKey(key=KEY, expiration_time_usec=expiry)})
    [posix] = imported.login_profile.posix_accounts
    assert posix.username == "client_test_example_com" and posix.primary
    assert posix.home_directory == "/home/client_test_example_com"
    assert posix.shell == "/bin/bash" and posix.uid > 1_000_000_000 and posix.gid == posix.uid
    fingerprint = hashlib.sha256(base64.b64decode(KEY.split()[1])).hexdigest()
    assert list(imported.login_profile.ssh_public_keys) == [fingerprint]
    key = client.get_ssh_public_key(name=f"users/{account}/sshPublicKeys/{fingerprint}")
    assert key.key == KEY and key.expiration_time_usec == expiry and key.fingerprint == fingerprint
    again = client.import_ssh_public_key(request={  # the same key twice: one entry, same uid
        "parent": f"users/{account}", "project_id": PROJECT,
        "ssh_public_key": common.SshPublicKey(key=KEY)})
    assert again.login_profile.posix_accounts[0].uid == posix.uid
    client.delete_ssh_public_key(name=f"users/{account}/sshPublicKeys/{fingerprint}")
    with pytest.raises(gexc.NotFound):
        client.get_ssh_public_key(name=f"users/{account}/sshPublicKeys/{fingerprint}")
    # an expired key is gone from the profile, as Google drops it
    client.import_ssh_public_key(request={
        "parent": f"users/{account}", "ssh_public_key": common.SshPublicKey(
            key=KEY, expiration_time_usec=int((time.time() - 1) * 1e6))})
    assert not client.get_login_profile(name=f"users/{account}").ssh_public_keys
    client.delete_posix_account(name=f"users/{account}/projects/{PROJECT}")
    profile = client.get_login_profile(request={"name": f"users/{account}",
                                                "project_id": PROJECT})
    assert not profile.posix_accounts


def test_missing_role_is_a_403(client, emulator):
    account = "norole@example.com"
    emulator.oslogin.admin("PATCH", {"project": PROJECT, "role": "none", "account": account})
    with pytest.raises(gexc.Forbidden, match="roles/compute.osLogin"):
        client.import_ssh_public_key(request={
            "parent": f"users/{account}", "project_id": PROJECT,
            "ssh_public_key": common.SshPublicKey(key=KEY)})


def test_project_metadata_is_served_and_nodes_override_it(emulator, tmp_path):
    settings = settings_for(emulator, tmp_path)
    assert oslogin.project_metadata(settings) == {}
    emulator.oslogin.admin("PATCH", {"project": PROJECT, "enabled": True})
    try:
        assert oslogin.project_metadata(settings) == {"enable-oslogin": "TRUE"}
        node = {"node": {"name": f"projects/{PROJECT}/locations/z/nodes/n", "metadata": {}}}
        assert emulator.oslogin.enabled_for(node)
        node["node"]["metadata"]["enable-oslogin"] = "false"
        assert not emulator.oslogin.enabled_for(node)
    finally:
        emulator.oslogin.admin("PATCH", {"project": PROJECT, "enabled": None})


def test_register_imports_once_then_renews_near_expiry(emulator, tmp_path):
    settings = settings_for(emulator, tmp_path)
    api = oslogin.OsLoginApi(settings)
    now = time.time()
    first = api.register("renew@example.com", PROJECT, KEY, 86400, now=now)
    assert first.user == "renew_example_com" and first.imported
    assert abs(first.expires - (now + 86400)) < 1
    second = api.register("renew@example.com", PROJECT, KEY, 86400, now=now + 3600)
    assert not second.imported and second.expires == first.expires
    late = api.register("renew@example.com", PROJECT, KEY, 86400, now=now + 19 * 3600)
    assert late.imported and late.expires > first.expires  # under a quarter left: renewed


def test_a_refused_key_names_the_role(emulator, tmp_path):
    emulator.oslogin.admin("PATCH", {"project": PROJECT, "role": "none",
                                     "account": "refused@example.com"})
    api = oslogin.OsLoginApi(settings_for(emulator, tmp_path))
    with pytest.raises(ApiError, match=r"roles/compute\.osAdminLogin .*roles/compute\.osLogin"):
        api.register("refused@example.com", PROJECT, KEY, 3600)


def test_logins_decide_per_node_and_say_so_once(emulator, tmp_path):
    from rich.console import Console

    console = Console(record=True, width=300)
    node_on = SimpleNamespace(name="on", metadata={"enable-oslogin": "TRUE"})
    node_off = SimpleNamespace(name="off", metadata={})
    settings = settings_for(emulator, tmp_path, TPUFAB_OS_LOGIN_ACCOUNT="bob@example.com",
                            TPUFAB_SSH_KEY=str(tmp_path / "key"))
    users = oslogin.logins(settings, [node_on, node_off], console,
                           project_md=lambda s: {"enable-oslogin": "FALSE"})
    assert {n: login.user for n, login in users.items()} == {"on": "bob_example_com"}
    assert "bob@example.com hold roles/compute.osAdminLogin" in users["on"].hint
    assert ("OS Login is on for node on: logging in as bob_example_com with tpufab's key "
            "registered for 24 h.") in console.export_text()
    quiet = Console(record=True, width=300)
    assert oslogin.logins(settings, [node_on], quiet, project_md=lambda s: None) == users
    assert quiet.export_text() == ""  # already registered
    # ssh_user set by hand wins over the profile's name; os_login false registers nothing
    mine = settings_for(emulator, tmp_path, TPUFAB_OS_LOGIN_ACCOUNT="bob@example.com",
                        TPUFAB_SSH_KEY=str(tmp_path / "key"), TPUFAB_SSH_USER="ops")
    assert oslogin.logins(mine, [node_on], quiet, project_md=lambda s: None)["on"].user == "ops"
    off = settings_for(emulator, tmp_path, TPUFAB_OS_LOGIN="no")
    warned = Console(record=True, width=300)
    forced = oslogin.logins(off, [node_on, node_off], warned, project_md=lambda s: None)
    assert list(forced) == ["on"] and forced["on"].user is None
    assert "drop --no-os-login" in forced["on"].hint
    assert "OS Login is on for on (enable-oslogin=TRUE), but os_login is false" in \
        warned.export_text()


@pytest.mark.parametrize(("value", "expected"), [
    ("TRUE", True), ("true", True), ("1", True), ("FALSE", False), ("f", False),
    (None, None), ("yes", None), ("", None)])
def test_metadata_flag_reads_like_the_guest_agent(value, expected):
    assert oslogin.metadata_flag(value) is expected


def test_the_node_decides_before_the_project():
    assert oslogin.enabled({"enable-oslogin": "FALSE"}, {"enable-oslogin": "TRUE"}) is False
    assert oslogin.enabled({}, {"enable-oslogin": "TRUE"}) is True
    assert oslogin.enabled({}, None) is False


def test_settings_are_checked(tmp_path):
    env = {"TPUFAB_USER_CONFIG": str(tmp_path / "none.yaml")}
    assert load_settings(env=env, cwd=tmp_path).os_login == "auto"
    assert load_settings({"os_login": "off"}, env=env, cwd=tmp_path).os_login == "false"
    with pytest.raises(ConfigError, match="os_login must be one of auto, true, false"):
        load_settings(env={**env, "TPUFAB_OS_LOGIN": "maybe"}, cwd=tmp_path)
    with pytest.raises(ConfigError, match="os_login_ttl"):
        load_settings(env={**env, "TPUFAB_OS_LOGIN_TTL": "0"}, cwd=tmp_path)
    assert oslogin.ttl_text(86400) == "24 h" and oslogin.ttl_text(1800) == "30 min"
    assert oslogin.ttl_text(45) == "45 s"


def test_the_account_comes_from_the_credentials():
    service = SimpleNamespace(service_account_email="ci@p.iam.gserviceaccount.com")
    assert oslogin.account_from_credentials(service) == "ci@p.iam.gserviceaccount.com"
    asked = []
    user = SimpleNamespace(valid=True, token="ya29.x")

    def tokeninfo(url, params):
        asked.append((url, params))
        return {"email": "me@example.com"}

    assert oslogin.account_from_credentials(user, get=tokeninfo) == "me@example.com"
    assert asked == [(oslogin.TOKENINFO, {"access_token": "ya29.x"})]


def test_workers_learn_of_os_login_and_its_users(emulator, client):
    """Paper workers record what the emulator tells them: OS Login on for a node of an
    enabled project, with each POSIX account as it is created; off where the node says so."""
    from google.cloud import tpu_v2

    tpu = tpu_v2.TpuClient(transport="rest", credentials=AnonymousCredentials(),
                           client_options=ClientOptions(api_endpoint=emulator.endpoint))
    parent = f"projects/workers-{PROJECT}/locations/us-central2-b"
    emulator.oslogin.admin("PATCH", {"project": f"workers-{PROJECT}", "enabled": True})
    on = tpu.create_node(parent=parent, node_id="on", node=tpu_v2.Node(
        accelerator_type="v4-8", runtime_version="tpu-ubuntu2204-base",
        metadata={"ssh-keys": f"bob:{KEY}"})).result(timeout=60)
    off = tpu.create_node(parent=parent, node_id="off", node=tpu_v2.Node(
        accelerator_type="v4-8", runtime_version="tpu-ubuntu2204-base",
        metadata={"ssh-keys": f"bob:{KEY}", "enable-oslogin": "FALSE"})).result(timeout=60)
    workers, on_id, off_id = emulator.workers, str(on.id), str(off.id)
    assert workers.os_login[on_id] == [] and workers.os_login[off_id] is None
    assert workers.keys[on_id] == "" and workers.keys[off_id] == f"bob:{KEY}"
    client.import_ssh_public_key(request={
        "parent": "users/carol@example.com", "project_id": f"workers-{PROJECT}",
        "ssh_public_key": common.SshPublicKey(key=KEY)})
    [account] = workers.os_login[on_id]
    assert account["username"] == "carol_example_com" and workers.os_login[off_id] is None
