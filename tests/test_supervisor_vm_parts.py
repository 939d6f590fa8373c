"""The supervisor VM's parts that need no pod (docs/supervisor.md, "The VM"): the laptop's own
wheel (built from an editable install's source, repacked from an installed one's RECORD), the
idle clock, the price table (the code's and the docs' agree), the refusal sentences, and how
the simulated VM's init reads a unit file (docs/simulated-pod.md)."""

from __future__ import annotations

import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_the_wheel_of_an_editable_install_is_built_from_its_source(tmp_path):
    from tpufab import __version__
    from tpufab.flows.supervisor import wheel

    assert wheel.editable_source() == ROOT
    built = wheel.build(tmp_path)
    assert built.version == __version__ and built.how == f"built from {ROOT}"
    names = zipfile.ZipFile(built.path).namelist()
    assert "tpufab/flows/supervisor/vm_startup.py" in names
    here = (ROOT / "tpufab" / "flows" / "supervisor" / "vm.py").read_bytes()
    assert zipfile.ZipFile(built.path).read("tpufab/flows/supervisor/vm.py") == here
    assert built.code_id == wheel.code_id()


def test_the_code_id_changes_with_the_code(tmp_path, monkeypatch):
    from tpufab.flows.supervisor import wheel

    source = tmp_path / "src"
    (source / "tpufab").mkdir(parents=True)
    (source / "pyproject.toml").write_text("[project]\nname = 'tpufab'\n")
    (source / "tpufab" / "a.py").write_text("x = 1\n")
    monkeypatch.setattr(wheel, "editable_source", lambda dist=None: source)
    first = wheel.code_id(dist=object())
    (source / "tpufab" / "__pycache__").mkdir()
    (source / "tpufab" / "__pycache__" / "a.cpython-311.pyc").write_bytes(b"\0")
    assert wheel.code_id(dist=object()) == first   # caches are not code
    (source / "tpufab" / "a.py").write_text("x = 2\n")
    assert wheel.code_id(dist=object()) != first


def test_an_installed_tpufab_is_repacked_from_its_record(tmp_path):
    from tpufab.flows.supervisor import wheel

    (tmp_path / "built").mkdir()
    original = wheel.build(tmp_path / "built").path
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps",
                    "--no-compile", "--disable-pip-version-check", "--target", str(site),
                    str(original)], check=True, timeout=300)
    out = tmp_path / "repacked"
    out.mkdir()
    script = ("import sys; sys.path[:0] = [sys.argv[1]]; from pathlib import Path; "
              "from tpufab.flows.supervisor import wheel; "
              "w = wheel.build(Path(sys.argv[2])); print(w.path); print(w.how)")
    proc = subprocess.run([sys.executable, "-I", "-c", script, str(site), str(out)],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    path, how = proc.stdout.split("\n")[:2]
    assert how == "repacked from the installed files"
    ours = set(zipfile.ZipFile(path).namelist())
    theirs = {n for n in zipfile.ZipFile(original).namelist() if not n.endswith(".pyc")}
    assert ours == theirs
    metadata = next(n for n in theirs if n.endswith(".dist-info/METADATA"))
    for name in ("tpufab/flows/supervisor/vm.py", metadata):
        assert zipfile.ZipFile(path).read(name) == zipfile.ZipFile(original).read(name)


def test_idle_watch_counts_from_the_last_live_job():
    from tpufab.flows.supervisor.vm import IdleWatch

    now = [100.0]
    watch = IdleWatch(60, clock=lambda: now[0])
    now[0] = 150
    assert not watch.update(0)
    now[0] = 161
    assert watch.update(0)           # idle since it started
    assert not watch.update(2)       # a job: the clock stops
    now[0] = 200
    assert not watch.update(0)       # idle again from here
    now[0] = 259
    assert not watch.update(0)
    now[0] = 260
    assert watch.update(0)


def test_the_price_table_in_the_docs_is_the_one_status_uses():
    from tpufab.flows.supervisor.vm import DISK_GB, HOURLY_USD, PRICES_DATED, hourly_cost

    text = (ROOT / "docs" / "supervisor.md").read_text()
    rows = dict(re.findall(r"^\| `([a-z0-9-]+)` \| \d+[^|]*\|[^|]*\| \$([0-9.]+) \|", text,
                           re.M))
    assert {k: float(v) for k, v in rows.items()} == HOURLY_USD
    assert PRICES_DATED in text and f"{DISK_GB} GB" in text
    assert hourly_cost("e2-small") == round(0.0168 + 10 * 0.10 / 730, 4)
    assert hourly_cost("a2-megagpu-16g") is None


def test_a_missing_permission_is_one_sentence_with_its_role():
    from tpufab.flows.supervisor.vm import _refusal

    sentence = _refusal({"ok": False, "missing": {"tpu.nodes.create": "roles/tpu.admin",
                                                  "storage.objects.create":
                                                      "roles/storage.objectUser"}}, "sup")
    assert "storage.objects.create, tpu.nodes.create" in sentence
    assert "roles/storage.objectUser and roles/tpu.admin" in sentence
    assert sentence.endswith(".") and "\n" not in sentence
    assert _refusal({"ok": True, "missing": {}}, "sup") is None
    assert "pip install" in _refusal({"ok": False, "error": "pip install exited 1"}, "sup")


def test_the_simulated_vms_init_reads_a_unit_as_systemd_does(tmp_path):
    from tpufab.sim.vm_units import parse_seconds, parse_unit

    env_file = tmp_path / "env"
    env_file.write_text("# comment\nA=1\nB=\"two words\"\n")
    unit = parse_unit("\n".join([
        "[Unit]", "Description=x", "ExecStart=/not/this", "[Service]", "User=svc",
        f"EnvironmentFile={env_file}", "EnvironmentFile=-/does/not/exist",
        "Environment=C=3 \"D=four five\"", "ExecStart=-/opt/v/bin/python -m m serve --x 'a b'",
        "Restart=always", "RestartSec=2", "WorkingDirectory=/var/lib/svc", "", "[Install]",
        "WantedBy=multi-user.target"]))
    assert unit["argv"] == ["/opt/v/bin/python", "-m", "m", "serve", "--x", "a b"]
    assert unit["user"] == "svc" and unit["restart"] == "always" and unit["restart_sec"] == 2
    assert unit["env"] == {"A": "1", "B": "two words", "C": "3", "D": "four five"}
    assert unit["cwd"] == "/var/lib/svc"
    assert parse_unit("[Service]\nExecStart=/bin/true\n")["restart"] == "no"
    assert [parse_seconds(t, 0.1) for t in ("5", "5s", "100ms", "2min", "", "x")] == \
        [5, 5, 0.1, 120, 0.1, 0.1]
    with pytest.raises(OSError):
        parse_unit("[Service]\nEnvironmentFile=/does/not/exist\nExecStart=/bin/true\n")
