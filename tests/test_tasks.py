"""issue 25 without a pod: the advice launch's errors give names flags launch really has,
the plan of a SkyPilot task from the TPU docs (tests/data/) and the setup script launch writes."""

from __future__ import annotations

import ast
import inspect
import re
import subprocess
from pathlib import Path

import pytest

DATA = Path(__file__).parent / "data"
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")
COMMAND = re.compile(r"`([^`]*)`")


def groups() -> set[str]:
    """Verb groups (`tpufab ray up`: the verb is `ray up`)."""
    from tpufab.verbs import all_verbs

    return {v.path.split()[0] for v in all_verbs() if " " in v.path}


def verb_flags(path: str) -> set[str]:
    from tpufab.verbs import all_verbs

    verb = next(v for v in all_verbs() if v.path == path)
    return {f for p in verb.params() for f in p.flags}


def wrong_flags(sentence: str, verb: str = "launch") -> list[str]:
    """The flags ``sentence`` names that their command lacks: a flag inside a backticked
    `tpufab VERB ...` belongs to VERB, one inside another backticked command (git, gcloud) to
    that tool, any other to ``verb``."""
    wrong = []
    for command in COMMAND.findall(sentence):
        words = command.split()
        if words[:1] == ["tpufab"] and len(words) > 1:
            path = " ".join(words[1:3]) if words[1] in groups() else words[1]
            have = verb_flags(path)
            wrong += [f"{f} (of tpufab {path})" for f in FLAG.findall(command)
                      if f not in have]
    bare = COMMAND.sub("", sentence)
    have = verb_flags(verb)
    return wrong + [f for f in FLAG.findall(bare) if f not in have]


def test_wrong_flags_finds_what_the_issue_found():
    """The advice issue 25 found under launch (--install, --driver, --wip) is caught."""
    from tpufab.steps.code import gitops
    from tpufab.steps.host import mount

    assert wrong_flags("gcsfuse is not installed on worker 0: "
                       + mount.INSTALL_HINT["gcsfuse"] + ".") == ["--install", "--driver"]
    assert "--wip" in wrong_flags(inspect.getsource(gitops.refuse_dirty))
    assert wrong_flags("install it with `tpufab mount gs://b --install`") == []
    assert wrong_flags("see `tpufab mount --wip`") == ["--wip (of tpufab mount)"]


def _raised_texts(source: str) -> list[str]:
    """The literal text of every `raise X(...)` in ``source`` (f-string holes as {})."""
    texts = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call) and node.exc.args:
            parts = []
            for sub in ast.walk(node.exc.args[0]):
                if isinstance(sub, ast.Constant) and isinstance(sub.value, str):
                    parts.append(sub.value)
            texts.append("".join(parts))
    return texts


def test_every_error_launch_can_raise_names_flags_launch_has():
    """Every sentence the launch steps can end in, in the words launch says it (its own
    errors, the task file's, create's, deploy's, a task's mount, the setup's)."""
    from tpufab.cloud import create, lifecycle, names
    from tpufab.flows import launch, taskfile
    from tpufab.steps.code import deploy
    from tpufab.steps.host import mount
    from tpufab.steps.host import setup as setting

    sentences = [*_raised_texts(inspect.getsource(launch)),
                 *_raised_texts(inspect.getsource(taskfile)),
                 *(text for fn in (names.validate_name, lifecycle.create,
                                   lifecycle.refuse_rivals, create.create_nodes,
                                   create.create_and_wait, create.wait_node,
                                   create.existing_node)
                   for text in _raised_texts(inspect.getsource(fn))),
                 *deploy.ERROR_SENTENCES.values(), *mount.TASK_MOUNT_SENTENCES.values(),
                 *_raised_texts(inspect.getsource(setting))]
    # create's refusal of --queued with --zones: launch never creates a queued resource
    sentences = [s for s in sentences if "a queued resource already waits" not in s]
    assert len(sentences) > 30
    bad = {s: wrong_flags(launch.in_launch_words(s)) for s in sentences}
    assert {s: w for s, w in bad.items() if w} == {}


def test_a_dirty_workdir_is_refused_with_advice_launch_can_follow(tmp_path):
    from tpufab.config import Settings
    from tpufab.errors import ConfigError
    from tpufab.flows import launch
    from tpufab.flows.taskfile import Task

    for argv in (["init", "-q"], ["-c", "user.name=t", "-c", "user.email=t@t.invalid",
                                  "commit", "-qm", "x", "--allow-empty"]):
        subprocess.run(["git", *argv], cwd=tmp_path, check=True)
    (tmp_path / "new.py").write_text("x = 1\n")
    task = Task(source="tpufab", type="v4-8", workdir=".", run="echo hi")
    with pytest.raises(ConfigError) as err:
        launch.plan(task, settings=Settings(name="p", zone="us-central2-b"), cwd=tmp_path)
    assert "uncommitted changes (new.py): commit them first" in str(err.value)
    assert wrong_flags(str(err.value)) == []


@pytest.mark.parametrize("source", ["skypilot", "tpufab"])
def test_the_setup_script_records_the_failed_line_and_command(tmp_path, source):
    """The script launch writes for a task's setup: a SkyPilot setup goes on past a failure
    (as SkyPilot runs it), a tpufab setup stops (errexit); both record line 2 and the
    command; a handled failure (`|| true`) is none."""
    from tpufab.config import Settings
    from tpufab.flows import launch
    from tpufab.flows.taskfile import Task

    task = Task(source=source, setup="echo one\nls /no/such/dir\nfalse || true\necho last\n",
                run="x")
    plan = launch.LaunchPlan(task, Settings(), (), None, run_cwd=str(tmp_path))
    script = tmp_path / "setup.sh"
    script.write_bytes(plan.setup_script)
    failed = tmp_path / "failed"
    got = subprocess.run(["bash", str(script)], capture_output=True, text=True,
                         env={"PATH": "/usr/bin:/bin", "TPUFAB_SETUP_FAILED": str(failed),
                              "HOME": str(tmp_path)})
    assert failed.read_text() == "2\t2\tls /no/such/dir\n"
    assert "tpufab: setup line 2: `ls /no/such/dir` exited 2" in got.stderr
    if source == "skypilot":
        assert (got.returncode, got.stdout) == (0, "one\nlast\n")
    else:
        assert (got.returncode, got.stdout) == (2, "one\n")


# --- finding 2: zones are honoured or refused, never dropped ----------------------------------


def _sky(resources: str):
    from tpufab.flows.taskfile import parse_task, parse_yaml

    return parse_task(parse_yaml(f"resources:\n  accelerators: tpu-v4-8\n{resources}run: x\n"),
                      "z.yaml")


@pytest.mark.parametrize(("resources", "zone"), [
    ("  infra: gcp/us-east5/us-east5-b\n", "us-east5-b"),
    ("  infra: gcp/*/us-east5-a\n", "us-east5-a"),
    ("  infra: gcp/us-east5\n  zone: us-east5-a\n", "us-east5-a"),
    ("  region: us-east5\n  zone: us-east5-b\n", "us-east5-b"),
    ("  infra: gcp\n", "us-central2-b"),
])
def test_the_task_s_zone_is_the_plan_s(resources, zone):
    from tpufab.config import Settings
    from tpufab.flows import launch

    p = launch.plan(_sky(resources), settings=Settings(name="n", zone="us-central2-b",
                                                       project="p"))
    assert p.settings.zone == zone
    assert f" in {zone} (project p)" in p.steps[0]


@pytest.mark.parametrize(("resources", "sentence"), [
    ("  infra: gcp/us-east5/us-east5-b\n  zone: us-east5-a\n",
     "z.yaml: resources.infra names zone us-east5-b and resources.zone us-east5-a; give one of "
     "them."),
    ("  region: us-east5\n  zone: us-central2-b\n",
     "z.yaml: zone us-central2-b is not in region us-east5; name a zone of us-east5 (such as "
     "us-east5-b), or drop the region."),
    ("  infra: aws/us-east-1\n",
     "z.yaml: resources.infra is 'aws/us-east-1'"),
    ("  region: us-east5\n",
     "z.yaml names region us-east5 but no zone, and tpufab creates TPUs in a zone: name one "
     "(infra: gcp/us-east5/us-east5-b, or resources.zone) or pass --zone (the zone setting, "
     "us-central2-b, is not in us-east5)."),
])
def test_a_zone_that_cannot_be_honoured_is_refused_in_one_sentence(resources, sentence):
    from tpufab.config import Settings
    from tpufab.errors import ConfigError
    from tpufab.flows import launch

    with pytest.raises(ConfigError) as err:
        launch.plan(_sky(resources), settings=Settings(name="n", zone="us-central2-b",
                                                       project="p"))
    assert str(err.value).startswith(sentence)
    assert wrong_flags(str(err.value)) == []


def test_a_region_alone_takes_the_zone_setting_when_it_lies_in_it():
    from tpufab.config import Settings
    from tpufab.flows import launch

    p = launch.plan(_sky("  infra: gcp/us-east5\n"),
                    settings=Settings(name="n", zone="us-east5-a", project="p"))
    assert p.settings.zone == "us-east5-a"


# --- finding 1: SkyPilot's paths --------------------------------------------------------------


def test_a_skypilot_task_s_scripts_link_and_enter_sky_workdir_and_map_gcpuser(tmp_path):
    from tpufab.config import Settings
    from tpufab.flows import launch
    from tpufab.flows.taskfile import Task
    from tpufab.steps.runs.env import Forwarded

    task = Task(source="skypilot", workdir=".", setup="pwd", run="pwd")
    forwarded = Forwarded({"CKPT": "/home/gcpuser/sky_workdir/ckpt", "MODEL": "m"}, {})
    p = launch.LaunchPlan(task, Settings(), (), forwarded, run_cwd="~/proj")
    run = p.run_script.data.decode()
    assert 'ln -sfn "$HOME"/proj "$HOME"/sky_workdir && cd "$HOME"/sky_workdir || exit 1' in run
    assert 'export CKPT="${CKPT//\\/home\\/gcpuser/$HOME}"' in run and "MODEL" not in run
    home = tmp_path / "home"
    (home / "proj").mkdir(parents=True)
    env = {"PATH": "/usr/bin:/bin", "HOME": str(home), "CKPT": "/home/gcpuser/sky_workdir/ckpt"}
    for script in (p.setup_script, p.run_script.data):
        path = tmp_path / "s.sh"
        path.write_bytes(script + b'echo "ckpt=$CKPT"\n')
        got = subprocess.run(["bash", str(path)], capture_output=True, text=True, env=env)
        assert got.stdout == f"{home}/sky_workdir\nckpt={home}/sky_workdir/ckpt\n", got.stderr
    assert (home / "sky_workdir").resolve() == (home / "proj").resolve()
    # a directory of its own there is not replaced
    (home / "sky_workdir").unlink()
    (home / "sky_workdir").mkdir()
    got = subprocess.run(["bash", "-c", p.run_script.data.decode()], capture_output=True,
                         text=True, env=env)
    assert got.returncode == 1 and "~/sky_workdir is a directory of its own" in got.stderr


def test_a_skypilot_task_name_becomes_a_node_name():
    from tpufab.flows.launch import node_name_of
    from tpufab.flows.taskfile import Task

    assert node_name_of(Task(source="skypilot", name="tpuvm_mnist")) == "tpuvm-mnist"
    assert node_name_of(Task(source="skypilot", name="Llama3 Train")) == "llama3-train"
    assert node_name_of(Task(source="tpufab", name="as_is")) == "as_is"   # then refused
