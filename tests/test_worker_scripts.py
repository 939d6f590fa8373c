"""Worker-side scripts as they are shipped: each stands alone, the library inlined (pure, and
each script run once under ``python3 -I -S`` with nothing beside it)."""

from __future__ import annotations

import ast
import os
import subprocess
from importlib import resources

import pytest
from helpers import WORKER_PYTHON, process_start_time, shipped

from tpufab.ssh.remote_files import LIBRARY, BundleError, RemoteFile, bundle, read_answer

REMOTE = resources.files("tpufab.remote")
SCRIPTS = sorted(p.name for p in REMOTE.iterdir()
                 if p.name.endswith(".py") and p.name not in ("__init__.py", LIBRARY))
LIB = REMOTE.joinpath(LIBRARY).read_bytes()

# The cheapest thing each shipped script can do: (arguments, stdin, exit status, a line it says).
NO_OP = {
    "agent.py": ([], b"", 0, None),                       # stdin closed: it says hello and ends
    "autostop_worker.py": (["--help"], None, 0, "usage: autostop_worker.py"),
    "deploy_worker.py": (["--help"], None, 0, "usage: deploy_worker.py"),
    "env_worker.py": ([], b"", 2, "env_worker: unknown operation ''"),
    "facts_worker.py": (["--help"], None, 0, "usage: facts_worker.py"),
    "image_worker.py": (["--help"], None, 0, "usage: image_worker.py"),
    "files_worker.py": ([], b"", 2, "files_worker: unknown operation ''"),
    "run_worker.py": (["--help"], None, 0, "usage: run_worker.py"),
    "masktee.py": ([], None, 2, "usage: masktee.py LOG [NAME ...]"),
    "mount_worker.py": (["--help"], None, 0, "usage: mount_worker.py"),
    "ports.py": ([], None, 2, "usage: ports.py wait PORT SECONDS [HOST]"),
    "profile_worker.py": (["--help"], None, 0, "usage: profile_worker.py"),
    "ray_worker.py": ([], None, 2, "ray_worker.py: no command"),
    "kill_worker.py": (["--help"], None, 0, "usage: kill_worker.py"),
    "stacks_worker.py": (["--help"], None, 0, "usage: stacks_worker.py"),
    "verify.py": ([], None, 2, "usage: verify.py N SHA256 PATH"),
    "top_worker.py": (["--help"], None, 0, "usage: top_worker.py"),
    "zombie_worker.py": (["--help"], None, 0, "usage: zombie_worker.py"),
}


def test_every_shipped_script_has_a_no_op_here():
    assert sorted(NO_OP) == SCRIPTS, "a new worker-side script: add its cheapest no-op to NO_OP"


@pytest.mark.parametrize("name", SCRIPTS)
def test_the_shipped_script_runs_alone_in_isolated_mode(tmp_path, name):
    """What a worker gets, alone in a folder, under ``python3 -I -S``: no sibling, no tpufab,
    no site-packages to import from. A forgotten inline fails here, not on a worker."""
    data = RemoteFile.bundled(name).data
    ast.parse(data, filename=name, feature_version=(3, 8))     # what old worker images run
    assert b"tpufab.remote." not in b"".join(
        line for line in data.splitlines() if line.lstrip().startswith((b"from", b"import")))
    (tmp_path / name).write_bytes(data)
    args, stdin, code, says = NO_OP[name]
    done = subprocess.run([WORKER_PYTHON, "-I", "-S", name, *args], cwd=tmp_path, input=stdin,
                          stdin=None if stdin is not None else subprocess.DEVNULL,
                          capture_output=True, timeout=60)
    out = (done.stdout + done.stderr).decode()
    assert done.returncode == code, out
    assert "Traceback" not in out
    if says:
        assert says in out


def test_a_shipped_script_runs_from_stdin_too(tmp_path):
    """The full-disk path (``python3 -I -S -``, source on stdin): the bundled facts_worker.py answers."""
    done = subprocess.run([WORKER_PYTHON, "-I", "-S", "-", "--run-dir", str(tmp_path / "runs")],
                          input=RemoteFile.bundled("facts_worker.py").data, capture_output=True,
                          cwd=tmp_path, timeout=60, check=True)
    answer = read_answer(done.stdout)
    assert answer["runs"] == [] and answer["host"] == os.uname().nodename


# -- bundle (pure) ------------------------------------------------------------------------------


SCRIPT = b'''"""a worker script"""
import sys

from tpufab.remote.workerlib import alive, read_int

print(alive(int(sys.argv[1]), read_int(sys.argv[2])))
'''


def test_the_import_is_replaced_by_what_it_needs_and_no_more(tmp_path):
    data = bundle("probe.py", SCRIPT, LIB)
    text = data.decode()
    for needed in ("def alive(", "def proc_stat(", "class Proc:", "EXITED = ", "def read_int(",
                   "def read_text("):
        assert needed in text
    for unused in ("def scan_holders(", "class Watched:", "def state_of_run(", "import glob"):
        assert unused not in text
    assert "from tpufab" not in text
    # it runs alone, and says what the library says: this process, by its start time
    script = tmp_path / "probe.py"
    script.write_bytes(data)
    start = process_start_time(os.getpid())
    for recorded, answer in ((start, "True"), (start + 1, "False")):
        (tmp_path / "start").write_text(f"{recorded}\n")
        done = subprocess.run([WORKER_PYTHON, "-I", "-S", str(script), str(os.getpid()),
                               str(tmp_path / "start")],
                              capture_output=True, text=True, timeout=60, cwd=tmp_path)
        assert done.stdout.strip() == answer, done.stderr


def test_a_script_is_reshipped_when_what_it_inlines_changes_only():
    before = RemoteFile("kill_worker.py", bundle("kill_worker.py", REMOTE.joinpath("kill_worker.py")
                                             .read_bytes(), LIB))
    assert before.sha256 == RemoteFile.bundled("kill_worker.py").sha256
    used = LIB.replace(b'EXITED = ("Z", "X", "x")', b'EXITED = ("Z", "X")')
    unused = LIB.replace(b"def mount_records(state_dir):", b"def mount_records(state_dir):  #")
    assert used != LIB and unused != LIB
    source = REMOTE.joinpath("kill_worker.py").read_bytes()
    assert bundle("kill_worker.py", source, used) != before.data
    assert bundle("kill_worker.py", source, unused) == before.data


def test_a_script_without_the_library_ships_as_it_is():
    source = REMOTE.joinpath("verify.py").read_bytes()
    assert bundle("verify.py", source, LIB) == source == RemoteFile.bundled("verify.py").data


@pytest.mark.parametrize(("source", "says"), [
    (b"import tpufab.quoting\n", "imports from tpufab only in one top-level statement"),
    (b"from tpufab import quoting\n", "imports from tpufab only in one top-level statement"),
    (b"from . import workerlib\n", "imports from tpufab only in one top-level statement"),
    (b"from tpufab.remote.workerlib import alive as a\n", "(no alias)"),
    (b"def f():\n    from tpufab.remote.workerlib import alive\n", "top-level statement"),
    (b"from tpufab.remote.workerlib import alive\nfrom tpufab.remote.workerlib import read_int\n",
     "line 2"),
    (b"import os; from tpufab.remote.workerlib import alive\n", "of its own"),
    (b"from tpufab.remote.workerlib import alive, nothing_such\n",
     "imports nothing_such from tpufab.remote.workerlib, which does not define them"),
    (b"from tpufab.remote.workerlib import alive\n\ndef read_text(path):\n    return ''\n",
     "defines read_text at top level, as workerlib.py does"),
    (b"from os import stat\nfrom tpufab.remote.workerlib import alive\n",
     "defines stat at top level"),
])
def test_a_script_that_cannot_stand_alone_is_refused_when_bundled(source, says):
    with pytest.raises(BundleError) as err:
        bundle("bad.py", source, LIB)
    assert says in str(err.value)


def test_a_library_statement_bundle_could_not_keep_by_name_is_refused():
    library = LIB + b"\ntry:\n    import fcntl\nexcept ImportError:\n    fcntl = None\n"
    with pytest.raises(BundleError, match=r"workerlib.py line \d+: only imports, assignments"):
        bundle("kill_worker.py", REMOTE.joinpath("kill_worker.py").read_bytes(), library)


def test_the_same_import_in_a_script_and_the_library_is_no_clash():
    source = b"import os\nimport json as json\nfrom tpufab.remote.workerlib import read_json\n"
    assert b"def read_json(" in bundle("ok.py", source, LIB)


def test_each_shipped_script_is_the_one_the_seam_ships():
    """The tests that run scripts by path (helpers.shipped) run these very bytes."""
    for name in ("run_worker.py", "kill_worker.py", "facts_worker.py"):
        assert shipped(name).read_bytes() == RemoteFile.bundled(name).data


# -- the answer codec: workerlib.answer writes, the host reads in one place ----------------------


def _answered(*calls) -> str:
    import io

    from tpufab.remote.workerlib import answer

    out = io.StringIO()
    for kind, payload in calls:
        answer(kind, payload, out)
    return out.getvalue()


def test_an_answer_is_read_back_through_garbage_before_and_after_it():
    from tpufab.ssh.remote_files import read_answer

    text = ("pip: WARNING {not json}\n{\"ok\": false}\n" +
            "half a line without newline" + _answered(("answer", {"ok": True, "n": 3})) +
            "a recipe's print after it\n\n")
    assert read_answer(text) == {"ok": True, "n": 3}
    assert read_answer(text.encode()) == {"ok": True, "n": 3}  # bytes as the fan-out keeps


def test_a_truncated_answer_is_no_answer_and_an_earlier_one_stands():
    from tpufab.ssh.remote_files import read_answer

    whole = _answered(("answer", {"ok": True, "seen": "first"}))
    torn = _answered(("answer", {"ok": False, "seen": "second"}))[:-9]  # cut mid-object
    assert read_answer(torn) is None
    assert read_answer(whole + torn) == {"ok": True, "seen": "first"}
    assert read_answer("") is None and read_answer(None) is None


def test_of_two_answers_the_last_wins_and_streamed_kinds_are_read_apart():
    from tpufab.ssh.remote_files import parse_answer, read_answer, read_answers

    text = _answered(("port", {"port": 4100}), ("progress", {"bytes": 10}),
                     ("answer", {"ok": False}), ("progress", {"bytes": 20}),
                     ("answer", {"ok": True}))
    assert read_answer(text) == {"ok": True}
    assert read_answers(text, "progress") == [("progress", {"bytes": 10}),
                                              ("progress", {"bytes": 20})]
    assert read_answer(text, "port") == {"port": 4100}
    assert parse_answer(text.splitlines()[0].encode()) == ("port", {"port": 4100})
    assert parse_answer('{"port": 1}') is None  # untagged JSON is not an answer
    assert parse_answer("@tpufab-answer answer [1, 2]") is None  # a payload is an object


def test_a_script_of_operations_answers_one_and_refuses_an_unknown_one(monkeypatch, capsys):
    import io

    from tpufab.remote.workerlib import read_answer, serve_ops

    ops = {"echo": lambda request: {"got": request}}
    monkeypatch.setattr("sys.stdin", io.StringIO('{"a": 1}'))
    assert serve_ops("x_worker", ops, ["x_worker.py", "echo"]) == 0
    assert read_answer(capsys.readouterr().out) == {"got": {"a": 1}}
    assert serve_ops("x_worker", ops, ["x_worker.py", "nope"]) == 2
    assert capsys.readouterr().err == "x_worker: unknown operation 'nope'\n"
