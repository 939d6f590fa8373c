"""tpufab.steps.runs.env: run ids, the job environment contract, the folded log view (data in, data out)."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest

from tpufab.errors import ConfigError
from tpufab.steps.runs.env import (
    FoldedLine,
    Forwarded,
    JobLayout,
    SliceFacts,
    fold_logs,
    forwarded_environment,
    is_run_id,
    job_environment,
    job_environments,
    local_environments,
    new_run_id,
    render_folded,
)

# -- run ids -------------------------------------------------------------------------------


def test_run_id_format_and_order():
    t = datetime(2026, 11, 22, 10, 44, 55, tzinfo=timezone.utc)
    assert new_run_id(t, "ab12") == "20261122-104455-ab12"
    later = new_run_id(t + timedelta(seconds=1), "0000")
    assert sorted([later, new_run_id(t, "ffff")]) == [new_run_id(t, "ffff"), later]
    # Local times are stored in timezone.utc.
    cet = timezone(timedelta(hours=1))
    assert new_run_id(datetime(2026, 11, 22, 11, 44, 55, tzinfo=cet), "ab12") == \
        "20261122-104455-ab12"
    assert is_run_id(new_run_id())


@pytest.mark.parametrize("text,ok", [
    ("20261122-104455-ab12", True),
    ("20261122-104455-AB12", False),
    ("20261122-104455", False),
    ("../20261122-104455-ab12", False),
    ("", False),
])
def test_is_run_id(text, ok):
    assert is_run_id(text) is ok


def test_bad_suffix():
    with pytest.raises(ValueError):
        new_run_id(suffix="xyz!")


# -- the environment contract ---------------------------------------------------------------

IPS = ["10.0.0.2", "10.0.0.3", "10.0.0.4", "10.0.0.5"]


@pytest.mark.parametrize("rank,expected", [
    (0, {"TPUFAB_WORKER_ID": "0", "TPU_WORKER_ID": "0", "RANK": "0", "NODE_RANK": "0"}),
    (3, {"TPUFAB_WORKER_ID": "3", "TPU_WORKER_ID": "3", "RANK": "3", "NODE_RANK": "3"}),
])
def test_single_slice_contract(rank, expected):
    env = job_environment("r1", JobLayout.single(IPS), rank)
    assert env.public == {
        "TPUFAB_RUN_ID": "r1",
        "TPUFAB_NUM_WORKERS": "4",
        "TPUFAB_WORKER_IPS": ",".join(IPS),
        "TPU_WORKER_HOSTNAMES": ",".join(IPS),
        "TPUFAB_COORDINATOR": "10.0.0.2:8476",
        "TPUFAB_SLICE_ID": "0",
        "TPUFAB_NUM_SLICES": "1",
        "TPUFAB_PROFILER_PORT": str(9431 + rank),
        "PJRT_DEVICE": "TPU",
        "MASTER_ADDR": "10.0.0.2",
        "MASTER_PORT": "29500",                          # r1 is no run id: the base port
        "WORLD_SIZE": "4",
        "LOCAL_RANK": "0",
        **expected,
    }
    assert env.secrets == {}


def test_torch_distributed_names_follow_the_tpufab_contract_on_every_layout():
    layout = JobLayout.multislice([["10.0.0.2", "10.0.0.3"], ["10.1.0.2", "10.1.0.3"]])
    for env in (e.public for e in job_environments("r1", layout, coordinator_port=7000)):
        assert env["RANK"] == env["NODE_RANK"] == env["TPUFAB_WORKER_ID"]
        assert env["WORLD_SIZE"] == env["TPUFAB_NUM_WORKERS"] == "4"
        assert env["MASTER_ADDR"] == env["TPUFAB_COORDINATOR"].split(":")[0] == "10.0.0.2"
        assert env["LOCAL_RANK"] == "0"
    local = [e.public for e in local_environments("r2", 3, 5555, master_port=6000)]
    assert [e["RANK"] for e in local] == ["0", "1", "2"]
    assert {(e["MASTER_ADDR"], e["MASTER_PORT"], e["WORLD_SIZE"]) for e in local} == \
        {("127.0.0.1", "6000", "3")}


def test_master_port_comes_from_the_run_id_so_a_stale_process_cannot_block_the_next_run():
    ports = {job_environment(run_id, JobLayout.single(IPS), 0).public["MASTER_PORT"]
             for run_id in ("20261122-104455-0000", "20261122-104455-03e7",
                            "20261122-104455-03e8")}
    assert ports == {"29500", "30499"}                 # 0x3e7 = 999, 0x3e8 = 1000 -> 0


def test_a_forwarded_master_port_wins_but_ranks_cannot_be_forwarded():
    env = job_environment("r1", JobLayout.single(IPS), 1,
                          forwarded=Forwarded({"MASTER_PORT": "12355"})).public
    assert env["MASTER_PORT"] == "12355"
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "NODE_RANK", "LOCAL_RANK"):
        with pytest.raises(ConfigError, match="tpufab sets it"):
            forwarded_environment([f"{name}=5"], {})


@pytest.mark.parametrize("options,present,absent", [
    ({"spmd": True}, {"XLA_USE_SPMD": "1", "PJRT_DEVICE": "TPU"}, ["JAX_PLATFORMS"]),
    ({"platform": "cpu"}, {"JAX_PLATFORMS": "cpu", "PJRT_DEVICE": "CPU"}, ["XLA_USE_SPMD"]),
    ({"coordinator_port": 1234}, {"TPUFAB_COORDINATOR": "10.0.0.2:1234"}, []),
    ({}, {}, ["XLA_USE_SPMD", "MEGASCALE_NUM_SLICES", "JAX_PLATFORMS"]),
])
def test_framework_options(options, present, absent):
    env = job_environment("r1", JobLayout.single(IPS), 1, **options).public
    for key, value in present.items():
        assert env[key] == value
    for key in absent:
        assert key not in env


@pytest.mark.parametrize("rank,slice_id,worker_id", [(0, 0, 0), (1, 0, 1), (2, 1, 0),
                                                      (5, 2, 1)])
def test_multislice(rank, slice_id, worker_id):
    layout = JobLayout.multislice([["10.0.0.2", "10.0.0.3"], ["10.1.0.2", "10.1.0.3"],
                                   ["10.2.0.2", "10.2.0.3"]])
    env = job_environment("r1", layout, rank, megascale_port=9000).public
    assert env["MEGASCALE_COORDINATOR_ADDRESS"] == "10.0.0.2"
    assert env["MEGASCALE_NUM_SLICES"] == "3"
    assert env["MEGASCALE_SLICE_ID"] == str(slice_id)
    assert env["MEGASCALE_PORT"] == "9000"
    assert env["TPU_WORKER_ID"] == str(worker_id)
    assert env["TPUFAB_WORKER_ID"] == str(rank)
    assert env["TPUFAB_NUM_WORKERS"] == "6"
    assert env["TPUFAB_SLICE_ID"] == str(slice_id)
    assert env["TPUFAB_COORDINATOR"] == "10.0.0.2:8476"


def test_tpu_variables_are_explicit_per_slice():
    """TPU_WORKER_HOSTNAMES is the worker's own slice in worker order (what JAX's
    GkeTpuCluster and libtpu read), TPU_NAME/TYPE/TOPOLOGY the slice's facts."""
    layout = JobLayout.multislice(
        [["10.0.0.2", "10.0.0.3"], ["10.1.0.2", "10.1.0.3"]],
        [SliceFacts("s-0", "tpu7x-16", "2x2x2"), SliceFacts("s-1", "tpu7x-16", "2x2x2")])
    env = job_environment("r1", layout, 3).public
    assert env["TPU_WORKER_HOSTNAMES"] == "10.1.0.2,10.1.0.3"
    assert (env["TPU_NAME"], env["TPU_WORKER_ID"]) == ("s-1", "1")
    assert (env["TPU_ACCELERATOR_TYPE"], env["TPU_TOPOLOGY"]) == ("tpu7x-16", "2x2x2")
    local = job_environment("r1", JobLayout.single(IPS), 0).public  # facts unknown
    assert local["TPU_WORKER_HOSTNAMES"] == ",".join(IPS) and "TPU_NAME" not in local
    with pytest.raises(ConfigError, match="TPU_NAME cannot be set"):
        forwarded_environment(["TPU_NAME=x"], {})
    with pytest.raises(ValueError):
        JobLayout.multislice([["10.0.0.2"]], [SliceFacts("a", "v4-8"), SliceFacts("b", "v4-8")])


def test_all_workers_and_local():
    envs = job_environments("r1", JobLayout.single(IPS))
    assert [e.public["TPUFAB_WORKER_ID"] for e in envs] == ["0", "1", "2", "3"]
    local = local_environments("r2", 3, 5555)
    assert [e.public["TPUFAB_COORDINATOR"] for e in local] == ["127.0.0.1:5555"] * 3
    assert local[2].public["TPUFAB_WORKER_IPS"] == "127.0.0.1,127.0.0.1,127.0.0.1"
    assert local[0].public["JAX_PLATFORMS"] == "cpu"


def test_bad_layouts():
    with pytest.raises(ConfigError):
        JobLayout.single([])
    with pytest.raises(ValueError):
        job_environment("r1", JobLayout.single(IPS), 4)


LOCAL = {"HF_TOKEN": "hf_abc", "XLA_FLAGS": "--xla_dump_to=/tmp/d", "MY_DB_PASSWORD": "pw",
         "PLAIN": "x"}


@pytest.mark.parametrize("specs,public,secret", [
    (["FOO=bar"], {"FOO": "bar"}, {}),
    (["XLA_FLAGS"], {"XLA_FLAGS": "--xla_dump_to=/tmp/d"}, {}),
    (["HF_TOKEN"], {}, {"HF_TOKEN": "hf_abc"}),
    (["HF_TOKEN=other"], {}, {"HF_TOKEN": "other"}),
    (["MY_DB_PASSWORD"], {}, {"MY_DB_PASSWORD": "pw"}),               # looks like a secret
    (["A=1", "A=2"], {"A": "2"}, {}),                                  # later wins
    (["EMPTY="], {"EMPTY": ""}, {}),
    (["EQ=a=b"], {"EQ": "a=b"}, {}),
])
def test_forwarded_environment(specs, public, secret):
    fwd = forwarded_environment(specs, LOCAL)
    assert dict(fwd.public) == public and dict(fwd.secrets) == secret


def test_configured_secret_names():
    fwd = forwarded_environment(["PLAIN", "OTHER=1"], LOCAL, secret_names=["PLAIN"])
    assert dict(fwd.secrets) == {"PLAIN": "x"} and dict(fwd.public) == {"OTHER": "1"}


@pytest.mark.parametrize("spec,message", [
    ("MISSING", "not set"),
    ("1BAD=x", "not a variable name"),
    ("TPUFAB_WORKER_ID=3", "tpufab sets it"),
    ("TPU_WORKER_ID", "tpufab sets it"),
])
def test_forwarded_environment_errors(spec, message):
    with pytest.raises(ConfigError, match=message):
        forwarded_environment([spec], {"TPU_WORKER_ID": "1"})


def test_forwarded_values_reach_the_worker_and_secrets_stay_apart():
    fwd = Forwarded({"PJRT_DEVICE": "CPU", "LIBTPU_INIT_ARGS": "--x"}, {"HF_TOKEN": "hf_abc"})
    env = job_environment("r1", JobLayout.single(IPS), 0, forwarded=fwd)
    assert env.public["PJRT_DEVICE"] == "CPU"            # overrides the framework default
    assert env.public["LIBTPU_INIT_ARGS"] == "--x"
    assert "HF_TOKEN" not in env.public
    assert env.merged()["HF_TOKEN"] == "hf_abc"
    assert env.masked()["HF_TOKEN"] == "***"


# -- the folded log view --------------------------------------------------------------------


def test_folded_labels():
    assert FoldedLine("x", (0, 1, 2, 3, 7)).label == "w[0-3,7]"
    assert FoldedLine("x", (5,)).label == "w5"


ALL4 = (0, 1, 2, 3)
SAME = ["start", "processes=4", "result=[0 1 2 3]", "done"]


@pytest.mark.parametrize("logs,expected", [
    # identical output folds to one copy
    ({w: SAME for w in range(4)}, [(t, ALL4) for t in SAME]),
    # one worker prints a different value in place: it differs in a field only, so it folds
    ({0: ["a", "loss 1.0", "b"], 1: ["a", "loss 1.0", "b"], 2: ["a", "loss 9.9", "b"]},
     [("a", (0, 1, 2)), ("loss {1.0,9.9}", (0, 1, 2)), ("b", (0, 1, 2))]),
    # one that differs in its words does not
    ({0: ["a", "loss 1.0", "b"], 1: ["a", "loss 1.0", "b"], 2: ["a", "NaN loss", "b"]},
     [("a", (0, 1, 2)), ("loss 1.0", (0, 1)), ("NaN loss", (2,)), ("b", (0, 1, 2))]),
    # extra lines on two workers merge under one set
    ({0: ["a", "b"], 1: ["a", "warn x", "b"], 2: ["a", "warn x", "b"]},
     [("a", (0, 1, 2)), ("warn x", (1, 2)), ("b", (0, 1, 2))]),
    # a worker that stopped early lacks the tail
    ({0: ["a", "b", "c"], 1: ["a"]},
     [("a", (0, 1)), ("b", (0,)), ("c", (0,))]),
    # repeated lines keep their count
    ({0: ["a"], 1: ["a", "retry", "retry"]},
     [("a", (0, 1)), ("retry", (1,)), ("retry", (1,))]),
    # worker 0 silent: others still show, folded
    ({0: [], 1: ["x"], 2: ["x"]}, [("x", (1, 2))]),
    # worker 0 absent: the lowest worker is the reference
    ({2: ["a"], 3: ["a", "b"]}, [("a", (2, 3)), ("b", (3,))]),
    ({}, []),
])
def test_fold_logs(logs, expected):
    assert fold_logs(logs) == [FoldedLine(text, workers) for text, workers in expected]


def test_render_folded():
    logs = {0: ["a", "loss 1.0"], 1: ["a", "loss 1.0"], 2: ["a", "loss 2.0"], 3: ["b"]}
    assert render_folded(fold_logs(logs), logs) == [
        "w[0-2]: a", "w[0-2]: loss {1.0,2.0}", "w3: b"]


def test_64_hosts_read_like_one():
    lines = [f"step {i} loss {1 / (i + 1):.4f}" for i in range(2000)]
    logs = {w: list(lines) for w in range(64)}
    logs[17] = lines[:1000] + ["NaN detected on w17"] + lines[1000:]
    logs[40] = lines[:1500]
    rendered = render_folded(fold_logs(logs), range(64))
    assert len(rendered) == 2001
    assert rendered[0] == "step 0 loss 1.0000"
    assert rendered[1000] == "w17: NaN detected on w17"
    assert rendered[1001] == "step 1000 loss 0.0010"
    assert rendered[-1] == "w[0-39,41-63]: step 1999 loss 0.0005"


def test_torchprime_variables_are_forwarded_when_set_and_hf_token_stays_secret(monkeypatch):
    from types import SimpleNamespace

    from tpufab.steps.runs.env import forwarded_for

    for name in ("HF_TOKEN", "XLA_IR_DEBUG", "XLA_HLO_DEBUG", "LIBTPU_INIT_ARGS", "OTHER"):
        monkeypatch.delenv(name, raising=False)
    settings = SimpleNamespace(env=[], secrets=[])
    assert forwarded_for(settings, None) == Forwarded()          # nothing set: nothing sent
    monkeypatch.setenv("HF_TOKEN", "hf_abc")
    monkeypatch.setenv("XLA_IR_DEBUG", "1")
    monkeypatch.setenv("LIBTPU_INIT_ARGS", "--xla_tpu_enable_latency_hiding_scheduler=true")
    monkeypatch.setenv("OTHER", "x")
    fwd = forwarded_for(settings, ["XLA_IR_DEBUG=0"])
    assert dict(fwd.secrets) == {"HF_TOKEN": "hf_abc"}
    assert dict(fwd.public) == {"XLA_IR_DEBUG": "0",              # --env wins
                                "LIBTPU_INIT_ARGS": "--xla_tpu_enable_latency_hiding_scheduler=true"}


def test_secret_flag_makes_any_name_a_secret_and_names_are_judged_as_words(monkeypatch):
    """`--secret K=V|K` (issue 23, finding 11): forwarded like --env, always a secret; -e names
    by the one rule (DB_PASS is one, MAX_NEW_TOKENS and USE_AUTH_TOKEN are not)."""
    from types import SimpleNamespace

    from tpufab.steps.runs.env import forwarded_for

    for name in ("HF_TOKEN", "XLA_IR_DEBUG", "XLA_HLO_DEBUG", "LIBTPU_INIT_ARGS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("RUN_NOTE", "a note")
    monkeypatch.setenv("DB_PASS", "pw-long-enough")
    settings = SimpleNamespace(env=[], secrets=[])
    fwd = forwarded_for(settings, ["DB_PASS", "MAX_NEW_TOKENS=128", "USE_AUTH_TOKEN=1"],
                        ["RUN_NOTE", "PIN=1234"])
    assert dict(fwd.public) == {"MAX_NEW_TOKENS": "128", "USE_AUTH_TOKEN": "1"}
    assert dict(fwd.secrets) == {"DB_PASS": "pw-long-enough", "RUN_NOTE": "a note",
                                 "PIN": "1234"}
