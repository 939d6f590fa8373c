"""The settings stack: defaults < user file < project file < env < flags."""

import pytest

from tpufab.config import load_settings
from tpufab.errors import ConfigError


@pytest.fixture
def dirs(tmp_path):
    user = tmp_path / "user.yaml"
    project = tmp_path / "proj"
    (project / "sub").mkdir(parents=True)
    return user, project


def test_defaults(tmp_path):
    s = load_settings(cwd=tmp_path, env={})
    assert s.zone == "us-central2-b"
    assert s.project is None and s.name is None
    assert s.concurrency == 64
    assert "HF_TOKEN" in s.secrets


def test_each_layer_overrides_the_one_before(dirs):
    user, project = dirs
    user.write_text("project: from-user\nzone: user-zone\nname: user-node\ntype: v4-8\n")
    (project / "tpufab.yaml").write_text("zone: project-zone\nname: project-node\ntype: v4-16\n")
    env = {"TPUFAB_USER_CONFIG": str(user), "TPUFAB_NAME": "env-node", "TPUFAB_TYPE": "tpu-v6e-8"}
    s = load_settings({"type": "v4-32", "zone": None}, cwd=project / "sub", env=env)
    assert s.project == "from-user"          # only the user file sets it
    assert s.zone == "project-zone"          # project beats user; a None flag is "not given"
    assert s.name == "env-node"              # env beats project
    assert s.type == "v4-32"                 # flag beats env


def test_invoke_yaml_section(dirs):
    _, project = dirs
    (project / "invoke.yaml").write_text("run:\n  echo: true\ntpufab:\n  zone: europe-west4-a\n  spot: yes\n")
    s = load_settings(cwd=project, env={})
    assert s.zone == "europe-west4-a" and s.spot is True


def test_env_types_are_coerced(tmp_path):
    env = {"TPUFAB_SPOT": "1", "TPUFAB_CONCURRENCY": "8", "TPUFAB_LABELS": "team=ml,env=dev",
           "TPUFAB_ENV": "HF_TOKEN,XLA_FLAGS", "TPUFAB_API_ENDPOINT": "http://127.0.0.1:9",
           "TPUFAB_ACCELERATOR_TYPE": "v5p-8"}
    s = load_settings(cwd=tmp_path, env=env)
    assert s.spot is True and s.concurrency == 8
    assert s.labels == {"team": "ml", "env": "dev"}
    assert s.env == ["HF_TOKEN", "XLA_FLAGS"]
    assert s.api_endpoint == "http://127.0.0.1:9"
    assert s.type == "v5p-8"


@pytest.mark.parametrize("content,needle", [
    ("zome: a\n", "Did you mean 'zone'"),
    ("spot: maybe\n", "spot must be true or false"),
    ("- a\n- b\n", "must hold a mapping"),
    ("type: v4-7\n", "did you mean v4-8"),
    ("project: [unclosed\n", "not valid YAML"),
    # issue 37, 15: a value of the wrong type is refused, never str()-ed
    ("zone: {a: 1}\n", "zone must be text, not a mapping"),
    ("name: [a, b]\n", "name must be text, not a list"),
    ("secrets: 7\n", "secrets must be a,b,c (or a list), not 7"),
    ("secrets: [{a: 1}]\n", "secrets must be a,b,c (or a list), not a list"),
    ("keep_runs: -1\n", "keep_runs (local run log copies kept) must be at least 0, not -1"),
    ("concurrency: 2.5\n", "concurrency must be a whole number, not 2.5"),
    ("concurrency: true\n", "concurrency must be a whole number, not True"),
    ("connect_timeout: .nan\n", "connect_timeout must be a finite number"),
    ("labels: {team: {a: 1}}\n", "labels must be key=value,key2=value2 (or a mapping)"),
    ("labels: {team: a=b}\n", "the value of label team, 'a=b', is not one Google Cloud takes"),
    ("zone: us-central2-b; rm -rf ~\n", "is not a zone name"),
    ("wait_timeout: 1e12\n", "wait_timeout must be at most"),
])
def test_bad_files_get_one_sentence(tmp_path, content, needle):
    (tmp_path / "tpufab.yaml").write_text(content)
    with pytest.raises(ConfigError) as info:
        load_settings(cwd=tmp_path, env={})
    assert needle in str(info.value)


def test_yaml_s_own_booleans_still_mean_the_words_where_a_setting_takes_them(tmp_path):
    (tmp_path / "tpufab.yaml").write_text("os_login: true\nkeep_alive: off\nproject: 12345\n")
    s = load_settings(cwd=tmp_path, env={})
    assert (s.os_login, s.keep_alive, s.project) == ("true", "false", "12345")
    assert s.keep_alive_seconds == 0


def test_require_names_every_way_to_set_it(tmp_path):
    s = load_settings(cwd=tmp_path, env={})
    with pytest.raises(ConfigError) as info:
        s.require("name")
    assert "--name" in str(info.value) and "TPUFAB_NAME" in str(info.value)


@pytest.mark.parametrize(("local", "expected"), [("alice", "alice"), ("root", "tpufab")])
def test_the_default_login_is_the_local_user_but_never_root(monkeypatch, local, expected):
    """TPU VMs are entered as an ordinary user with sudo; CI runs as root."""
    import getpass

    monkeypatch.setattr(getpass, "getuser", lambda: local)
    assert load_settings(env={}).ssh_user == expected
    assert load_settings({"ssh_user": "root"}, env={}).ssh_user == "root"
    assert load_settings(env={"TPUFAB_SSH_USER": "root"}).ssh_user == "root"


def test_ssh_transport_is_one_of_three_words(tmp_path):
    assert load_settings(cwd=tmp_path, env={}).ssh_transport == "auto"
    assert load_settings(cwd=tmp_path, env={"TPUFAB_SSH_TRANSPORT": "Paramiko"}).ssh_transport \
        == "paramiko"
    with pytest.raises(ConfigError, match="TPUFAB_SSH_TRANSPORT: ssh_transport must be one of "
                                          "auto, libssh2, paramiko, not 'openssh'"):
        load_settings(cwd=tmp_path, env={"TPUFAB_SSH_TRANSPORT": "openssh"})


# --- the timeout table (docs/reliability.md, "Timeouts") -----------------------------------

def test_one_resolver_reads_the_timeout_table():
    """given > the command_timeout setting (where the row bounds commands) > the row."""
    import math

    from tpufab.config import TIMEOUTS, timeout_for

    assert timeout_for("status") == TIMEOUTS["status"].seconds == 60.0
    assert timeout_for("status", 5) == 5.0 and timeout_for("status", None, 7) == 7.0
    assert timeout_for("status", 5, 7) == 5.0
    assert timeout_for("exec") == math.inf and timeout_for("exec", None, 3) == 3.0
    assert timeout_for("check", None, 3) == 120.0      # the collective's: not a command's
    assert timeout_for("kill", plus=5.0) == 39.0       # the grace period plus 34 s
    assert timeout_for("logs --follow") == math.inf


def test_every_verb_on_a_pod_with_a_timeout_has_its_row_and_says_it_in_its_help():
    from tpufab.config import TIMEOUTS
    from tpufab.verbs import all_verbs

    for v in all_verbs():
        timeout = next((p for p in v.params() if p.name == "timeout"), None)
        if v.pod_method and timeout is not None:
            assert v.path in TIMEOUTS, v.path
            assert TIMEOUTS[v.path].text in timeout.help and TIMEOUTS[v.path].bounds \
                in timeout.help, (v.path, timeout.help)
            assert timeout.default is None, v.path   # None: not given, the table decides


def test_no_timeout_default_is_written_outside_the_table():
    """No number as a timeout's default in the verbs, the Pod, the flows or the steps: a
    parameter ``*timeout*`` or a module constant ``*TIMEOUT*`` reads TIMEOUTS instead."""
    from house import timeout_defaults_outside_the_table

    assert timeout_defaults_outside_the_table() == []


def test_docs_list_the_timeout_table_as_it_is():
    from pathlib import Path

    from tpufab.config import timeouts_table

    docs = (Path(__file__).resolve().parents[1] / "docs" / "reliability.md").read_text()
    assert "\n".join(timeouts_table()) in docs, "regenerate docs/reliability.md's table: " \
        "python -c 'from tpufab.config import timeouts_table; print(*timeouts_table(), sep=chr(10))'"
