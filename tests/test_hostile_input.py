"""Fault 7: hostile input, generated with hypothesis. Node names, worker selectors, recipe args,
env values and bucket names full of quotes, `$()`, backticks, `;`, newlines and unicode are
either rejected with a clear error or passed through literally; nothing unintended runs: every
generated string tries to create a canary file, which must never appear on any worker or here.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess

import pytest
from harness import sim_node
from helpers import (
    TPUFAB,
    cli_env,
    in_worker,
    keepers,
    kept_connections,
    no_traceback,
    ok,
    one_sentence,
    quiet_console,
    residents,
    tpufab,
    unique_name,
    wait_for,
)
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from tpufab.errors import ConfigError, TpufabError

CANARY = "/tmp/tpufab-canary"
TOUCH = f"touch {CANARY}"
NASTY = ["'", '"', f"$({TOUCH})", f"`{TOUCH}`", f"; {TOUCH}", f" && {TOUCH}", f" | {TOUCH}",
         f"\n{TOUCH}\n", "\n", "\r", "\t", " ", "$HOME", "${IFS}", "\\", "\\'", "-", "--", "*",
         "~", "a", "0", "7", "w[0-1]", ",", "%s", "{}", "é", "☃", "日本", "\u202e", "\x1b[31m",
         "-o ProxyCommand=" + TOUCH, "../", "=", "gs://"]
TEXT = st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00")
HOSTILE = st.lists(st.one_of(st.sampled_from(NASTY), st.text(TEXT, max_size=4)),
                   min_size=1, max_size=8).map("".join)
FEW = settings(max_examples=25, deadline=None, derandomize=True,
               suppress_health_check=[HealthCheck.too_slow])

pytestmark = pytest.mark.sim


def no_canary_here() -> None:
    assert not os.path.exists(CANARY), "a hostile string ran a command on this machine"


@pytest.fixture(scope="module")
def pod2(sim, tmp_path_factory):
    """A READY v4-16 (2 workers), connected once for the whole module."""
    from tpufab.hosts import connect as pods

    if os.path.exists(CANARY):
        os.unlink(CANARY)
    with sim_node(sim, tmp_path_factory, "hos", "v4-16") as found:
        found.pod = pods.connect(found.settings, console=quiet_console())
        yield found
        found.pod.close()
        for w in (0, 1):
            assert in_worker(sim, found.node, w, f"test -e {CANARY} && echo FOUND || true"
                             ).strip() == "", f"a hostile string ran a command on worker {w}"
        no_canary_here()


def canary_on_workers(pod2) -> list[int]:
    return [w for w in (0, 1) if in_worker(pod2.sim, pod2.node, w,
                                            f"test -e {CANARY} && echo y || true").strip()]


# ---------------------------------------------------------------------------------------------
# node names


@FEW
@given(name=HOSTILE)
def test_node_names_are_valid_or_rejected_in_one_sentence(name):
    from tpufab.cloud.names import NAME_RE, validate_name

    try:
        accepted = validate_name(name)
    except ConfigError as err:
        assert "node name" in str(err) and "\n" not in str(err).strip()
        return
    assert accepted == name and NAME_RE.match(name) and len(name) <= 63


@pytest.mark.parametrize("name", [f"$({TOUCH})", f"x; {TOUCH}", "a\nb", "é", "../x", "-rf"])
def test_hostile_node_name_on_the_command_line(pod2, name):
    result = subprocess.run([TPUFAB, "exec", "--name", name, "true"], env=pod2.env,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2, result.stderr
    assert "Invalid node name" in result.stderr and "Traceback" not in result.stderr
    no_canary_here()


# ---------------------------------------------------------------------------------------------
# worker selectors


@FEW
@given(selection=HOSTILE)
def test_worker_selectors_select_real_workers_or_are_rejected(pod2, selection):
    try:
        chosen = pod2.pod.fanout.select(selection)
    except TpufabError as err:
        assert "worker" in str(err).lower()
        return
    assert chosen and set(chosen) <= {0, 1}


@pytest.mark.parametrize("selection", ["9" * 5000, "٣"])
def test_worker_selector_edge_cases_are_rejected(selection):
    from tpufab.nodeset import parse_selection

    with pytest.raises(ConfigError):
        parse_selection(selection, 4)


# ---------------------------------------------------------------------------------------------
# env values (and names)


@FEW
@given(value=st.one_of(HOSTILE, st.text(TEXT, max_size=30)))
def test_env_values_arrive_literally(pod2, value):
    result = pod2.pod.fanout.run(["printenv", "HOSTILE"], env={"HOSTILE": value})
    try:
        assert result.ok, result.summary()
        assert {w: r.stdout for w, r in result.items()} == {0: value + "\n", 1: value + "\n"}
    finally:
        result.close()
    # and through a shell that expands "$HOSTILE": still the value, never run
    shell = pod2.pod.fanout.run('printf "%s" "$HOSTILE"', env={"HOSTILE": value})
    try:
        assert [r.stdout for r in shell.values()] == [value, value]
    finally:
        shell.close()
    assert not canary_on_workers(pod2)


@FEW
@given(spec=HOSTILE)
def test_env_specs_with_bad_names_are_rejected(spec):
    from tpufab.steps.runs.env import forwarded_environment

    try:
        forwarded = forwarded_environment([spec], {})
    except ConfigError as err:
        assert "--env" in str(err)
        return
    name, _, value = spec.partition("=")
    assert forwarded.public.get(name, forwarded.secrets.get(name)) == value
    assert name.isidentifier() and name.isascii()


def test_env_value_with_a_nul_byte_is_one_clear_error(pod2):
    """Refused once, before any worker runs anything (not truncated at the NUL)."""
    probe = "/tmp/tpufab-nul-probe"
    with pytest.raises(TpufabError, match="NUL"):
        pod2.pod.fanout.run(f"touch {probe}; printenv HOSTILE", env={"HOSTILE": "a\x00b"})
    assert [in_worker(pod2.sim, pod2.node, w, f"test -e {probe} && echo ran || true").strip()
            for w in (0, 1)] == ["", ""]


# ---------------------------------------------------------------------------------------------
# bucket names and mount points


@FEW
@given(bucket=HOSTILE, at=HOSTILE)
def test_bucket_names_are_valid_or_rejected(bucket, at):
    from tpufab.steps.host import mount

    try:
        spec = mount.mount_spec(f"gs://{bucket}", at=f"/tmp/{at}")
    except ConfigError as err:
        assert "\n" not in str(err).strip()
        return
    assert mount.BUCKET_NAME.match(spec.bucket)
    args = mount.worker_args(spec)
    # the worker command line splits back into exactly these arguments: nothing interpreted
    from tpufab.ssh.remote_files import python_command

    line = python_command(mount.SCRIPT, args)
    assert shlex.split(line)[-len(args):] == args


@FEW
@given(at=HOSTILE)
def test_hostile_mount_points_reach_the_worker_literally(pod2, at):
    from tpufab.steps.host import mount

    path = "/tmp/hostile/" + at
    try:
        mount.mount_spec("gs://bucket-x", at=path)
    except ConfigError:
        return
    with pytest.raises(mount.MountError) as failed:
        mount.mount(pod2.pod.fanout, "gs://bucket-x", at=path, driver="gcsfuse")
    # gcsfuse is not installed on the simulated workers: the worker script said so, and did
    # nothing else
    assert "gcsfuse is not installed" in str(failed.value)
    assert not canary_on_workers(pod2)


# ---------------------------------------------------------------------------------------------
# the canary itself: the test would notice a command that ran


def test_the_canary_would_be_seen(pod2):
    probe = "/tmp/tpufab-canary-probe"
    pod2.pod.fanout.run(f"touch {probe}", workers=[1], check=True)
    seen = in_worker(pod2.sim, pod2.node, 1, f"test -e {probe} && echo y; rm -f {probe}")
    assert seen.strip() == "y"


# ---------------------------------------------------------------------------------------------
# recipe arguments


ARGS = st.lists(HOSTILE, max_size=5)
PRINT_ARGS = b"#!/usr/bin/env python3\nimport json, sys\nprint(json.dumps(sys.argv[1:]))\n"


def plan_for(args, run_id=None):
    from tpufab.ssh.remote_files import RemoteFile
    from tpufab.steps.start import plan as plans

    return plans.plan_run(RemoteFile("print_args.py", PRINT_ARGS, 0o755), slices=[[0, 1]],
                          ips=["10.0.0.1", "10.0.0.2"], args=args, run_id=run_id)


@FEW
@given(args=ARGS)
def test_recipe_args_are_single_quoted_words_on_the_worker_command_line(args):
    from tpufab.steps.start.plan import start_command

    line = start_command(plan_for(args))
    words = shlex.split(line)
    assert words[words.index("--") + 1:] == args


@FEW
@given(text=HOSTILE)
def test_an_args_string_is_split_as_shell_words_or_refused_in_one_sentence(text,
                                                                           tmp_path_factory):
    from tpufab.verbs import status as statusverbs

    recipe = str(tmp_path_factory.getbasetemp() / "none.sh")
    try:
        shlex.split(text)
        valid = True
    except ValueError:
        valid = False
    # babysit (like run) checks the args first, then the recipe, before it looks for the node
    with pytest.raises(ConfigError) as refused:
        statusverbs.babysit(recipe, name="x", args=text)
    sentence = str(refused.value)
    if valid:
        assert sentence.startswith(f"No recipe at {recipe}"), sentence
    else:
        assert "is not a valid argument list" in sentence, sentence
    assert "\n" not in sentence.strip()


@settings(max_examples=8, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(args=ARGS)
def test_recipe_args_reach_the_recipe_literally(pod2, args):
    import json

    from tpufab.steps.runs import running as jobs
    from tpufab.steps.start import plan as plans
    from tpufab.steps.start.starting import start_on_workers

    plan = plan_for(args)
    plan = plans.plan_run(plan.recipe, slices=pod2.pod.slices, ips=pod2.pod.internal_ips(),
                          args=args)
    start_on_workers(pod2.pod.fanout, plan)
    states = jobs.follow(pod2.pod.fanout, plan.run_id, plan.workers, None)
    assert all(s.ended for s in states.values()), states
    logs, _ = jobs.fetch_logs(pod2.pod.fanout, plan.run_id, plan.workers)
    for w in plan.workers:
        assert json.loads(logs[w].read().decode().strip().splitlines()[-1]) == args
    assert not canary_on_workers(pod2)


# ---------------------------------------------------------------------------------------------
# through the command line: every rejection is one sentence and a non-zero exit, never a
# traceback; what is accepted arrives literally; nothing runs (the canary)

CLI = settings(max_examples=8, deadline=None, derandomize=True,
               suppress_health_check=[HealthCheck.too_slow,
                                      HealthCheck.function_scoped_fixture])


def refused_or(result, accepted: bool) -> None:
    """`accepted`: what the library says about the input; the command must agree."""
    no_canary_here()
    no_traceback(result)
    if accepted:
        assert result.returncode == 0, result.stdout + result.stderr
    else:
        one_sentence(result)


@CLI
@given(name=HOSTILE)
def test_node_names_on_the_command_line(pod2, name):
    from tpufab.cloud import names

    try:
        names.validate_name(name)
        valid = True
    except ConfigError:
        valid = False
    result = tpufab("describe", f"--name={name}", env=pod2.env, timeout=120)
    # a valid name that does not exist is refused too, in one sentence that names it
    sentence = one_sentence(result)
    assert ("No node named" in sentence) == valid, sentence
    no_canary_here()


@CLI
@given(selection=HOSTILE)
def test_worker_selections_on_the_command_line(pod2, selection):
    from tpufab import nodeset

    try:
        workers = nodeset.parse_selection(selection, 2)
    except ConfigError:
        workers = None
    result = tpufab("exec", f"--worker={selection}", "echo picked", env=pod2.env, timeout=120)
    refused_or(result, workers is not None)
    if workers is not None:
        assert result.stdout.count("picked") == len(workers), result.stdout
    assert not canary_on_workers(pod2)


@CLI
@given(name=st.one_of(st.sampled_from(["HOSTILE", "HF_TOKEN"]), HOSTILE), value=HOSTILE)
def test_env_on_the_command_line(name, value, tmp_path_factory):
    """`run --local -e NAME=VALUE`: a bad name is one sentence; a value arrives byte for byte."""
    spec = f"{name}={value}"
    name, _, value = spec.partition("=")          # what the command line will see
    assume(name not in ("SHOW", "OUT", "PATH", "HOME"))
    work = tmp_path_factory.mktemp("env")
    recipe = work / "show.sh"
    recipe.write_text('#!/bin/sh\nprintenv "$SHOW" > "$OUT"\n')
    recipe.chmod(0o755)
    out = work / "value.txt"
    env = {k: v for k, v in os.environ.items() if not k.startswith("TPUFAB_")}
    env.update(HOME=str(work), TPUFAB_USER_CONFIG=str(work / "none.yaml"))
    valid = name.isidentifier() and name.isascii()
    result = subprocess.run(
        [TPUFAB, "run", "--local", "--workers=1", "--no-deploy", f"--env={spec}",
         f"--env=SHOW={name if valid else 'x'}", f"--env=OUT={out}", "--", str(recipe)],
        env=env, cwd=work, capture_output=True, text=True, timeout=120,
        stdin=subprocess.DEVNULL)
    refused_or(result, valid)
    if valid:
        assert out.read_text() == value + "\n"
        if name == "HF_TOKEN" and len(value.strip()) > 3:
            assert value not in result.stdout + result.stderr   # a secret is never shown


@CLI
@given(stem=HOSTILE)
def test_recipe_paths_on_the_command_line(stem, tmp_path_factory):
    """A recipe whose file name is hostile runs as that file, and only that file."""
    work = tmp_path_factory.mktemp("recipe")
    name = stem.replace("/", "_").lstrip("-")[:200] or "r"
    env = {k: v for k, v in os.environ.items() if not k.startswith("TPUFAB_")}
    env.update(HOME=str(work), TPUFAB_USER_CONFIG=str(work / "none.yaml"))
    recipe = work / name
    try:
        recipe.write_text(f"#!/bin/sh\necho ran > {shlex.quote(str(work / 'ran'))}\n")
    except (OSError, ValueError):
        return  # not a file name this filesystem takes
    recipe.chmod(0o755)
    result = subprocess.run([TPUFAB, "run", "--local", "--workers=1", "--no-deploy", "--",
                             str(recipe)], env=env, cwd=work, capture_output=True, text=True,
                            timeout=120, stdin=subprocess.DEVNULL)
    refused_or(result, True)
    assert (work / "ran").read_text() == "ran\n"
    missing = subprocess.run([TPUFAB, "run", "--local", "--workers=1", "--no-deploy", "--",
                              str(work / ("missing-" + name))], env=env, cwd=work,
                             capture_output=True, text=True, timeout=120,
                             stdin=subprocess.DEVNULL)
    assert "No recipe at" in one_sentence(missing)
    no_canary_here()


CONFIG_KEYS = ["name", "zone", "project", "type", "concurrency", "connect_timeout",
               "ssh_user", "remote_dir", "env", "nmae", "secrets"]
CONFIG = st.one_of(
    st.lists(st.tuples(st.sampled_from(CONFIG_KEYS), HOSTILE), max_size=4).map(
        lambda pairs: "".join(f"{k}: {v}\n" for k, v in pairs)),
    HOSTILE)


@CLI
@given(content=CONFIG)
def test_tpufab_yaml_content(pod2, content, tmp_path_factory):
    """Any tpufab.yaml: tpufab either reads it or says in one sentence what is wrong with it
    (naming the file); never a traceback, never a command from it."""
    from tpufab.config import load_settings

    work = tmp_path_factory.mktemp("yaml")
    (work / "tpufab.yaml").write_text(content)
    env = {k: v for k, v in pod2.env.items() if k != "TPUFAB_NAME"}
    try:
        load_settings(env=env, cwd=work)
        loads = True
    except ConfigError:
        loads = False
    result = subprocess.run([TPUFAB, "describe", "--name=no-such-node",
                             f"--project={pod2.sim.project}", f"--zone={pod2.sim.zone}"],
                            env=env, cwd=work, capture_output=True, text=True, timeout=120,
                            stdin=subprocess.DEVNULL)
    sentence = one_sentence(result)
    if loads:
        assert "No node named 'no-such-node'" in sentence, sentence
    else:
        assert "tpufab.yaml" in sentence, sentence
    no_canary_here()


# ---------------------------------------------------------------------------------------------
# special files through put and get (issue 23 finding 12)


def test_special_files_through_the_cli_are_one_sentence(pod2, tmp_path):
    """A FIFO or /dev/zero to put, a device node as get's LOCAL: one sentence each, at once
    (these hung before: the source was hashed before anything, outside --timeout), and the
    device node is still one afterwards."""
    import stat

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for source in (str(fifo), "/dev/zero"):
        result = tpufab("put", source, "/tmp/", "--worker=0", env=pod2.env, timeout=60)
        one_sentence(result, f"{source} is a", "put copies regular files and directories only")
    device = tmp_path / "full"
    os.mknod(device, 0o600 | stat.S_IFCHR, os.makedev(1, 7))
    result = tpufab("get", "/etc/hostname", str(device), "--worker=0", env=pod2.env, timeout=60)
    no_traceback(result)      # the sentence, then the per-worker summary it folds
    assert result.returncode != 0 and result.stderr.startswith(
        f"get failed on 1 of 1 workers: w0: refused: {device} exists here and is a character "
        "device, which get never writes through or replaces"), result.stderr
    assert stat.S_ISCHR(device.lstat().st_mode)


# ---------------------------------------------------------------------------------------------
# the fourth hostile try's bad inputs (issue 37, 15): each one sentence, nothing done

ROUND_FOUR = [
    # (argv, tpufab.yaml or None, a task file or None, what the sentence says)
    (["autostop", "--ttl", "99999999999d"], None, None, "--ttl must be at most"),
    (["create", "--name", "r4-flex", "--type", "tpu7x-8", "--flex-start",
      "--max-run-duration", "99999d"], None, None, "--max-run-duration must be at most"),
    (["top", "--every", "1e308"], None, None, "--every must be at least 1 second and at most"),
    (["stacks", "--timeout", "inf"], None, None, "--timeout takes a number of seconds above 0"),
    (["gc", "--zone", f"$({TOUCH})"], None, None, "is not a zone name"),
    (["gc", "--zone", "us-central2-b; rm -rf ~"], None, None, "is not a zone name"),
    (["disconnect", "--name", "r4-no-such-node"], None, None,
     "No node named 'r4-no-such-node'"),
    (["describe", "--name", "x"], "zone: {a: 1}\n", None, "zone must be text, not a mapping"),
    (["describe", "--name", "x"], "secrets: 7\n", None, "secrets must be a,b,c (or a list)"),
    (["describe", "--name", "x"], "keep_runs: -1\n", None,
     "keep_runs (local run log copies kept) must be at least 0"),
    (["describe", "--name", "x"], "concurrency: 2.5\n", None,
     "concurrency must be a whole number"),
    (["describe", "--name", "x"], "connect_timeout: .inf\n", None,
     "connect_timeout must be a finite number"),
    (["babysit", "r4.sh", "--ray-options", "--num-cpus=8"], None, None,
     "--ray-options are `ray start` options for babysit --ray"),
    (["create", "--name", "r4-label", "--type", "v4-8", "--label", "team=a=b"], None, None,
     "the value of label team, 'a=b'"),
    (["create", "--name", "r4-zones", "--type", "v4-8", "--zones", ","], None, None,
     "--zones names no zone"),
    (["launch", "task.yaml", "--dry-run", "--name", "r4"], None,
     'type: v4-8\nrun: x\nenvs: {A: "a\\0b"}\n', "envs.A holds a NUL byte"),
    (["launch", "task.yaml", "--dry-run", "--name", "r4"], None,
     "resources: {accelerators: tpu-v4-8}\nrun: x\nfile_mounts: {~/z: /dev/zero}\n",
     "/dev/zero (for ~/z) is a character device here, not a regular file"),
]


@pytest.mark.parametrize(("argv", "config", "task", "sentence"), ROUND_FOUR,
                         ids=[" ".join(c[0])[:40] + (" +yaml" if c[1] else "")
                              for c in ROUND_FOUR])
def test_the_fourth_tries_bad_inputs_are_one_sentence_each(pod2, tmp_path, argv, config, task,
                                                           sentence):
    if config is not None:
        (tmp_path / "tpufab.yaml").write_text(config)
    if task is not None:
        (tmp_path / "task.yaml").write_text(task)
    (tmp_path / "r4.sh").write_text("echo hi\n")
    env = {k: v for k, v in pod2.env.items() if k != "TPUFAB_NAME" or argv[0] in (
        "autostop", "top", "stacks", "babysit")}
    result = tpufab(*argv, env=env, cwd=tmp_path, timeout=120)
    one_sentence(result, sentence)
    assert "r4-flex" not in result.stdout and "created" not in result.stdout.lower()
    no_canary_here()


def test_create_says_when_the_project_file_s_name_wins_over_the_new_current_pod(pod2, tmp_path):
    """`name: A` in tpufab.yaml, `create --name B`: create said B was the current pod while
    every later command went to A. It now says which pod later commands go to, and why."""
    from helpers import unique_name

    other = unique_name("r4b")
    (tmp_path / "tpufab.yaml").write_text(f"name: {pod2.name}\n")
    env = {k: v for k, v in pod2.env.items() if k != "TPUFAB_NAME"}
    try:
        made = tpufab("create", "--name", other, "--type", "v4-8", env=env, cwd=tmp_path,
                      timeout=300)
        assert made.returncode == 0, made.stderr
        assert (f"Created {other} and remembered it as this project's current pod, but "
                f"{tmp_path / 'tpufab.yaml'} names {pod2.name}, which wins over the current "
                f"pod: later commands without --name go to {pod2.name}") in made.stderr, \
            made.stderr
        assert f"{other} is this project's current pod" not in made.stderr
    finally:
        tpufab("delete", "--name", other, "--yes", env=env, cwd=tmp_path, timeout=300)
# a command as the caller started it, through the resident command server (issue 37 item 13):
# its descriptors, niceness, limits and ignored signals are the caller's, and the long-lived
# servers keep none of the first command's secrets


@pytest.fixture
def resident(pod2):
    """pod2's environment with kept connections and the resident command server listening
    (the first command that kept the connections starts it)."""
    with kept_connections(pod2.env) as env:
        assert tpufab("exec", "true", env=env, timeout=120).returncode == 0
        folder = os.path.join(env["XDG_RUNTIME_DIR"], "tpufab")
        wait_for(lambda: residents(env) and any(
            name.startswith("resident-") and name.endswith(".sock")
            for name in os.listdir(folder)), 60, 0.05, "the resident command server")
        yield env


def served(result) -> bool:
    """The command ran in the resident server: this process loaded no CLI
    (PYTHONPROFILEIMPORTTIME's lines)."""
    return "typer" not in result.stderr and "import time:" in result.stderr


PROBE = """#!/bin/sh
echo "nice=$(nice) nofile=$(ulimit -n) core=$(ulimit -c)"
grep '^SigIgn:' /proc/self/status
"""


def test_descriptors_the_caller_passes_reach_the_command(pod2, resident, tmp_path):
    """`put /dev/fd/7`, `launch /dev/fd/7`: the caller's descriptor is the command's.
    Before: "No such file" through the resident server (it worked without it)."""
    (tmp_path / "note.txt").write_text("from-fd-7\n")
    (tmp_path / "task.yaml").write_text("run: echo hi\n")
    env = {**resident, "PYTHONPROFILEIMPORTTIME": "1"}
    put = subprocess.run(["bash", "-c", f"exec 7<note.txt; {TPUFAB} put /dev/fd/7 "
                                        "/tmp/hos-fd.txt"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=120)
    assert put.returncode == 0 and served(put), put.stdout + put.stderr[-3000:]
    assert in_worker(pod2.sim, pod2.node, 1, "cat /tmp/hos-fd.txt") == "from-fd-7\n"
    launch = subprocess.run(["bash", "-c", f"exec 7<task.yaml; {TPUFAB} launch --dry-run "
                                           "/dev/fd/7"], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=120)
    assert launch.returncode == 0 and served(launch), launch.stdout + launch.stderr[-3000:]
    assert "Dry run: nothing was created" in launch.stdout, launch.stdout


def test_niceness_limits_and_ignored_signals_are_the_callers(resident, tmp_path):
    """`nice`, `ulimit` and an ignored SIGHUP (`nohup`) hold for what the command starts
    (`run --local`'s processes). Before: the resident server's own (niceness 0, its limits,
    SIGHUP not ignored)."""
    probe = tmp_path / "probe.sh"
    probe.write_text(PROBE)
    probe.chmod(0o755)
    env = {**resident, "PYTHONPROFILEIMPORTTIME": "1"}
    started = subprocess.run(["bash", "-c", f"ulimit -n 321; ulimit -c 0; trap '' HUP; "
                                            f"exec nice -n 7 {TPUFAB} run --local probe.sh"],
                             cwd=tmp_path, env=env, capture_output=True, text=True,
                             timeout=120)
    assert started.returncode == 0 and served(started), started.stdout + started.stderr[-3000:]
    assert "nice=7 nofile=321 core=0" in started.stdout, started.stdout
    ignored = int(next(line for line in started.stdout.splitlines()
                       if line.startswith("SigIgn:")).split()[1], 16)
    assert ignored & 1, started.stdout          # bit 0: SIGHUP


def test_the_servers_kept_between_commands_hold_none_of_its_secrets(pod2, tmp_path):
    """The keeper and the resident command server outlive the command that starts them (5
    minutes by default): their environment keeps none of its secrets. Before: its whole
    environment, HF_TOKEN and WANDB_API_KEY included, readable in /proc/PID/environ that long."""
    secrets = {"HF_TOKEN": "hf_hostilesecret0123456789", "WANDB_API_KEY": "wb_hostile9876543210",
               "MY_SERVICE_TOKEN": "tok_hostile_555555555"}
    with kept_connections(pod2.env) as env:
        first = tpufab("exec", "true", env={**env, **secrets}, timeout=120)
        assert first.returncode == 0, first.stdout + first.stderr
        wait_for(lambda: keepers(env) and residents(env), 60, 0.05,
                 "the keeper and the resident server")
        for pid in keepers(env) + residents(env):
            with open(f"/proc/{pid}/environ", "rb") as fh:
                held = fh.read()
            for name, value in secrets.items():
                assert value.encode() not in held and name.encode() + b"=" not in held, (pid, name)

# a name on two control planes (issue 37 item 7)


def test_a_name_is_one_planes_and_a_name_on_two_is_refused_by_every_verb(sim, make_node,
                                                                         tmp_path_factory):
    """`create` refuses a name the other control plane holds (a TPU7x slice beside a v4 node
    of that name used to be made, and then status, exec, run and kill silently took the v4
    node while describe and delete refused); a name two planes hold anyway (made past
    tpufab, with gcloud or a client) is the one sentence describe says, from every verb."""
    home = tmp_path_factory.mktemp("two-planes")
    env = cli_env(sim, home)
    tpu = make_node("v4-8").name.rsplit("/", 1)[-1]
    refused = tpufab("create", "--name", tpu, "--type", "tpu7x-8", env=env, cwd=home)
    one_sentence(refused, f"'{tpu}' is already a Cloud TPU API node", "pick another --name")
    assert refused.returncode == 2
    listed = json.loads(ok(tpufab("list", "--json", env=env, cwd=home)))
    assert [n["control_plane"] for n in listed if n["name"] == tpu] == ["tpu"]  # no VM made

    vm = unique_name("two")
    ok(tpufab("create", "--name", vm, "--type", "tpu7x-8", env=env, cwd=home, timeout=600))
    try:
        refused = tpufab("create", "--name", vm, "--type", "v4-8", env=env, cwd=home)
        one_sentence(refused, f"'{vm}' is already a Compute Engine TPU slice")
        make_node("v4-8", node_id=vm)   # the TPU API takes it when asked directly
        recipe = home / "hello.sh"
        recipe.write_text("#!/bin/sh\necho hello\n")
        recipe.chmod(0o755)
        for verb in (("describe",), ("status",), ("exec", "--", "true"),
                     ("run", str(recipe), "--no-deploy"), ("kill",)):
            result = tpufab(verb[0], "--name", vm, *verb[1:], env=env, cwd=home)
            one_sentence(result, f"'{vm}' names both a Cloud TPU API node and a Compute "
                         "Engine TPU slice", "TPUFAB_CONTROL_PLANE=tpu or =compute",
                         progress=int(verb[0] == "status"))   # status says the pod it asks of
            assert result.returncode == 2, (verb, result.stdout + result.stderr)
        picked = json.loads(ok(tpufab("describe", "--name", vm, "--json", env=env, cwd=home,
                                      extra_env={"TPUFAB_CONTROL_PLANE": "tpu"})))
        assert picked["control_plane"] == "tpu"   # the way out the sentence gives
    finally:
        ok(tpufab("delete", "--name", vm, "--yes", env=env, cwd=home, timeout=600,
                  extra_env={"TPUFAB_CONTROL_PLANE": "compute"}))
