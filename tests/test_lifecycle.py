"""create / delete / list / describe: pure parts as data, then the operations on the simulated pod."""

from __future__ import annotations

import io
import time

import pytest
from helpers import SshKey, ssh_run, unique_name, wait_for
from rich.console import Console

from tpufab.cloud import gc as collecting
from tpufab.cloud import lifecycle, names, waiting
from tpufab.cloud.nodes import Node, QueuedResourceInfo, WorkerEndpoint
from tpufab.cloud.planes.tpu import TpuApi
from tpufab.config import load_settings
from tpufab.errors import ApiError, ConfigError, NotFound
from tpufab.ssh import keys as sshkeys
from tpufab.views import nodes as node_views


def recording_console() -> Console:
    return Console(file=io.StringIO(), width=200, soft_wrap=True, highlight=False)


def output(console: Console) -> str:
    return console.file.getvalue()


# ---------------------------------------------------------------------------------------------
# names


@pytest.mark.parametrize("name", ["a", "my-tpu", "v4-32-run7", "x" * 63])
def test_valid_names(name):
    assert names.validate_name(name) == name


@pytest.mark.parametrize("name, why", [
    ("my node", "lowercase letters, digits and hyphens"),
    ("tpu;rm -rf /", "no spaces or shell characters"),
    ("$(reboot)", "no spaces or shell characters"),
    ("MyTpu", "lowercase"),
    ("-tpu", "start with a letter"),
    ("tpu-", "not end with a hyphen"),
    ("9tpu", "start with a letter"),
    ("x" * 64, "longer than 63 characters"),
])
def test_invalid_names_are_one_sentence(name, why):
    with pytest.raises(ConfigError) as info:
        names.validate_name(name)
    text = str(info.value)
    assert repr(name) in text and why in text and "--name my-tpu" in text and "\n" not in text


def test_missing_name_says_how_to_give_one():
    with pytest.raises(ConfigError, match="No node name given and this project has no current pod: pass --name, choose one with `tpufab use NAME`"):
        names.validate_name(None)


def test_multislice_names_must_fit_with_their_suffix():
    names.validate_name("x" * 61, num_slices=10)           # the last slice, x...x-9, is 63
    with pytest.raises(ConfigError, match="longer than 63"):
        names.validate_name("x" * 61, num_slices=11)       # x...x-10 is 64


# ---------------------------------------------------------------------------------------------
# waiting


class FakeClock:
    def __init__(self):
        self.now = 0.0
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


def test_wait_for_reports_each_transition_with_elapsed_time():
    clock, console = FakeClock(), recording_console()
    states = iter([("CREATING", False)] * 5 + [("STARTING", False)] * 3 + [("READY", True)])
    final = waiting.wait_for(lambda: next(states), what="TPU node demo", timeout=60,
                               console=console, clock=clock, sleep=clock.sleep)
    assert final == "READY"
    lines = output(console).splitlines()
    assert lines[0] == "TPU node demo: CREATING"
    assert lines[1].startswith("TPU node demo: CREATING -> STARTING after ")
    assert lines[2].startswith("TPU node demo: STARTING -> READY after ")
    assert clock.sleeps[0] == 0.25 and max(clock.sleeps) <= 5.0     # growing, bounded poll


def test_wait_for_gives_up_at_the_timeout():
    clock, console = FakeClock(), recording_console()
    with pytest.raises(ApiError) as info:
        waiting.wait_for(lambda: ("CREATING", False), what="TPU node demo", timeout=30,
                           console=console, clock=clock, sleep=clock.sleep,
                           check_hint="check it with `tpufab describe --name demo`, ")
    text = str(info.value)
    assert text.startswith("Gave up waiting after 30s: TPU node demo is still CREATING")
    assert "tpufab describe --name demo" in text and "TPUFAB_WAIT_TIMEOUT" in text
    assert 30 <= clock.now <= 31


# ---------------------------------------------------------------------------------------------
# tables


def a_node(name="demo", state="READY", accelerator_type="v4-32", **kw) -> Node:
    workers = [WorkerEndpoint(i, f"10.0.0.{i + 2}", f"34.0.0.{i + 2}", 22) for i in range(4)]
    return Node(name=name, project="p", zone="z", accelerator_type=accelerator_type, state=state,
                health="HEALTHY" if state == "READY" else None, workers=workers, **kw)


def render(renderable) -> str:
    console = recording_console()
    console.print(renderable)
    return output(console)


def test_list_table_shows_what_a_user_needs():
    text = render(node_views.nodes_table([a_node(), a_node("spot-one", "PREEMPTED", spot=True)],
                                        recording_console()))
    header = text.splitlines()[0].split()
    assert header == ["NAME", "TYPE", "STATE", "HEALTH", "HOSTS", "WORKER", "IPS", "SPOT",
                      "CREATED"]
    demo = next(line for line in text.splitlines() if line.startswith("demo"))
    assert "READY" in demo and "HEALTHY" in demo and " 4 " in demo
    assert "34.0.0.2 34.0.0.3 34.0.0.4 34.0.0.5" in demo
    spot = next(line for line in text.splitlines() if line.startswith("spot-one"))
    assert "PREEMPTED" in spot and " yes " in spot
    notes = node_views.preempted_notes([a_node(), a_node("spot-one", "PREEMPTED")])
    assert len(notes) == 1 and "spot-one was PREEMPTED" in notes[0]
    assert "tpufab delete --name spot-one --yes" in notes[0]


def test_describe_view_lists_every_worker():
    text = render(node_views.details_table(a_node(labels={"team": "ml"})))
    for expected in ("v4-32", "READY", "16 (4 per host)", "team=ml"):
        assert expected in text
    for i in range(4):
        assert f"10.0.0.{i + 2}" in text and f"34.0.0.{i + 2}" in text
    qr = QueuedResourceInfo(name="q", project="p", zone="z", state="FAILED", tier="spot",
                            accelerator_type="v4-8", node_ids=["q"], failure="no [capacity]")
    text = render(node_views.details_table(qr))
    assert "FAILED" in text and "no [capacity]" in text     # API text is not rich markup


# ---------------------------------------------------------------------------------------------
# a create that loses a race


class RacingControl(TpuApi):
    """Nothing there at first; the create then answers ALREADY_EXISTS (another tpufab, or our
    own request retried after a 503, got there first) and the node is READY."""

    def __init__(self, settings):
        super().__init__(settings, client=object())
        self.created = False
        self.node = a_node("demo", accelerator_type="v4-32")

    def find_queued_resource(self, name):
        return None

    def find_node(self, name):
        return self.node if self.created else None

    def create_node(self, name, body):
        from tpufab.cloud.planes.calls import AlreadyExists

        self.created = True
        raise AlreadyExists("A node named 'demo' already exists.")

    def add_ssh_key(self, node, entry):
        return None


def test_create_that_finds_the_node_already_made_is_a_no_op(tmp_path):
    settings = load_settings({"project": "p", "name": "demo", "type": "v4-32",
                              "ssh_key": str(tmp_path / "k")}, cwd=tmp_path, env={})
    console = recording_console()
    [node] = lifecycle.create(settings, console=console, control=RacingControl(settings))
    assert node.name == "demo" and "already exists and is READY" in output(console)


# ---------------------------------------------------------------------------------------------
# on the simulated pod


@pytest.fixture
def settings_for(sim, tmp_path):
    """Settings pointing at the simulated pod, with a fresh tpufab key and fast retries."""

    def make(**flags):
        base = {"api_endpoint": sim.endpoint, "project": sim.project, "zone": sim.zone,
                "ssh_key": str(tmp_path / "keys" / "tpufab_ed25519"), "ssh_user": "alice",
                "api_retries": 5, "api_retry_seconds": 30, "wait_timeout": 120}
        return load_settings({**base, **flags}, cwd=tmp_path, env={})

    return make


@pytest.fixture
def created(settings_for):
    """Names to delete (node or queued resource) after the test."""
    names: list[str] = []
    yield names
    for name in names:
        lifecycle.delete(settings_for(name=name), yes=True, console=recording_console())


def tpufab_key(settings) -> SshKey:
    return SshKey(settings.ssh_key_path, sshkeys.ensure_key(settings.ssh_key_path))


@pytest.mark.sim
def test_create_describe_list_delete_single_host(settings_for, created, tpu_client):
    name = unique_name("life")
    created.append(name)
    settings = settings_for(name=name, type="tpu-v5litepod-4")
    console = recording_console()
    [node] = lifecycle.create(settings, console=console)
    text = output(console)
    assert f"Creating TPU node {name} (v5litepod-4, 1 host, on-demand)" in text
    assert f"TPU node {name}: " in text and "-> READY after" in text
    assert node.ready and node.hosts == 1 and node.accelerator_type == "v5litepod-4"

    # the API agrees, and our key is in the metadata as `alice:ssh-ed25519 AAAA... alice`
    proto = tpu_client.get_node(
        name=f"projects/{settings.project}/locations/{settings.zone}/nodes/{name}")
    assert proto.state.name == "READY"
    assert proto.runtime_version == "v2-alpha-tpuv5-lite"          # default of the generation
    entry = sshkeys.metadata_entry("alice", sshkeys.ensure_key(settings.ssh_key_path))
    assert entry in proto.metadata["ssh-keys"].splitlines()

    assert [n.name for n in lifecycle.list_nodes(settings) if n.name == name] == [name]
    described = lifecycle.describe(settings, name)
    assert isinstance(described, Node)
    assert [w.internal_ip for w in described.workers] == [
        e.ip_address for e in proto.network_endpoints]

    console = recording_console()
    assert lifecycle.delete(settings, yes=True, console=console) is True
    assert f"Deleted TPU node {name}" in output(console)
    with pytest.raises(NotFound, match=f"No node named '{name}'"):
        lifecycle.describe(settings, name)

    console = recording_console()
    assert lifecycle.delete(settings, yes=True, console=console) is False
    assert f"No TPU node named {name}" in output(console) and "nothing to delete" in output(console)


@pytest.mark.sim
def test_create_v4_32_gives_four_reachable_workers(settings_for, created):
    name = unique_name("pod")
    created.append(name)
    settings = settings_for(name=name, type="v4-32")
    [node] = lifecycle.create(settings, console=recording_console())
    assert node.hosts == 4 and len(set(node.addresses())) == 4

    # the tpufab key reaches every worker as the user named in the metadata entry
    key = tpufab_key(settings)

    def hostnames():
        runs = [ssh_run(ip, key, "alice", "hostname") for ip in node.addresses()]
        return [r.stdout.strip() for r in runs] if all(r.returncode == 0 for r in runs) else None

    names = wait_for(hostnames, timeout=60, interval=0.2, what="ssh to every worker")
    assert len(set(names)) == 4 and all(n.startswith("t1v-n-") for n in names)

    # creating it again is a no-op that says so
    console = recording_console()
    [again] = lifecycle.create(settings, console=console)
    assert again.id == node.id
    assert f"TPU node {name} already exists and is READY" in output(console)
    assert "nothing to do" in output(console)

    # another type under the same name is a clear error
    with pytest.raises(ConfigError, match=f"'{name}' already exists as a v4-32, not a v4-8"):
        lifecycle.create(settings_for(name=name, type="v4-8"), console=recording_console())


@pytest.mark.sim
def test_create_adds_the_key_to_an_existing_node_and_keeps_others(settings_for, make_node,
                                                                    ssh_key, tpu_client):
    other = f"bob:{ssh_key.public}"
    proto = make_node("v4-8", metadata={"ssh-keys": other, "startup-script": "true"})
    name = proto.name.rsplit("/", 1)[-1]
    settings = settings_for(name=name, type="v4-8")
    console = recording_console()
    [node] = lifecycle.create(settings, console=console)
    assert "already exists and is READY" in output(console)
    assert "added your SSH key to its metadata" in output(console)

    metadata = tpu_client.get_node(name=proto.name).metadata
    entry = sshkeys.metadata_entry("alice", sshkeys.ensure_key(settings.ssh_key_path))
    assert metadata["ssh-keys"].splitlines() == [other, entry]     # bob's key kept, ours added
    assert metadata["startup-script"] == "true"

    key = tpufab_key(settings)
    wait_for(lambda: ssh_run(node.addresses()[0], key, "alice", "true").returncode == 0,
             timeout=60, interval=0.2, what="the new key to reach the worker")

    console = recording_console()
    lifecycle.create(settings, console=console)
    assert "nothing to do" in output(console)
    assert tpu_client.get_node(name=proto.name).metadata["ssh-keys"].count(entry) == 1


@pytest.mark.sim
def test_queued_multislice_create_describe_delete(settings_for, created, tpu_client):
    name = unique_name("ms")
    created.append(name)
    settings = settings_for(name=name, type="v4-16", spot=True)
    console = recording_console()
    nodes = lifecycle.create(settings, queued=True, num_slices=2, console=console)
    assert f"Creating queued resource {name} (v4-16 x 2 slices" in output(console)
    assert f"Queued resource {name} is ACTIVE" in output(console)
    assert [n.name for n in nodes] == [f"{name}-0", f"{name}-1"]
    assert all(n.ready and n.queued_resource == name and n.multislice for n in nodes)
    assert [n.slice_index for n in nodes] == [0, 1]

    qr = lifecycle.describe(settings, name)
    assert isinstance(qr, QueuedResourceInfo)
    assert qr.state == "ACTIVE" and qr.tier == "spot" and qr.node_ids == [n.name for n in nodes]

    # deleting one slice by name deletes the whole queued resource (force)
    console = recording_console()
    assert lifecycle.delete(settings_for(name=f"{name}-1"), yes=True, console=console)
    assert f"Deleted queued resource {name}" in output(console)
    names = {n.name for n in lifecycle.list_nodes(settings)}
    assert not names & {f"{name}-0", f"{name}-1"}


@pytest.mark.sim
def test_queued_single_node(settings_for, created):
    name = unique_name("q")
    created.append(name)
    [node] = lifecycle.create(settings_for(name=name, type="v4-8"), queued=True,
                              console=recording_console())
    assert node.name == name and node.queued_resource == name and node.ready


@pytest.mark.sim
@pytest.mark.parametrize("reason, immediate, expected", [
    ("stockout", False, "No v4-8 capacity is available"),
    ("stockout", True, "No v4-8 capacity is available"),
    ("quota", False, "Not enough quota to create TPU node"),
])
def test_resource_exhausted_is_one_sentence(settings_for, created, sim_admin, reason, immediate,
                                            expected):
    name = unique_name("full")
    created.append(name)
    sim_admin.fail_next_create(reason, immediate=immediate)
    with pytest.raises(ApiError) as info:
        lifecycle.create(settings_for(name=name, type="v4-8"), console=recording_console())
    text = str(info.value)
    assert text.startswith(expected) and "--spot" in text and "another --zone" in text


@pytest.mark.sim
def test_a_503_burst_is_retried(settings_for, sim_admin, capsys):
    sim_admin.error_burst(3, code=503)
    lifecycle.list_nodes(settings_for())                       # succeeds after the burst
    assert capsys.readouterr().err.count("TPU API busy (503 Service Unavailable)") == 3


@pytest.mark.sim
def test_a_429_burst_is_retried(settings_for, sim_admin, capsys):
    sim_admin.error_burst(2, code=429)
    nodes = lifecycle.list_nodes(settings_for())                # succeeds after the burst
    assert isinstance(nodes, list)
    assert capsys.readouterr().err.count("TPU API busy (429 Too Many Requests)") == 2


@pytest.mark.sim
def test_a_long_503_burst_ends_in_one_sentence(settings_for, sim_admin):
    sim_admin.error_burst(50, code=503)
    with pytest.raises(ApiError) as info:
        lifecycle.list_nodes(settings_for(api_retries=3, api_retry_seconds=10))
    assert "kept failing with 503 Service Unavailable (3 attempts" in str(info.value)


@pytest.mark.sim
def test_preempted_node_is_reported_and_recreate_says_how(settings_for, make_node, sim_admin):
    proto = make_node("v4-8")
    name = proto.name.rsplit("/", 1)[-1]
    sim_admin.preempt(name)
    settings = settings_for(name=name, type="v4-8")
    node = lifecycle.describe(settings, name)
    assert node.preempted
    assert [n.state for n in lifecycle.list_nodes(settings) if n.name == name] == ["PREEMPTED"]
    with pytest.raises(ApiError) as info:
        lifecycle.create(settings, console=recording_console())
    assert "was PREEMPTED" in str(info.value)
    assert f"tpufab delete --name {name} --yes" in str(info.value)


@pytest.mark.sim
def test_async_returns_before_ready(settings_for, created, sim_admin):
    name = unique_name("async")
    created.append(name)
    sim_admin.settings(create_delay=2.0)
    try:
        console = recording_console()
        nodes = lifecycle.create(settings_for(name=name, type="v4-8"), async_=True,
                                 console=console)
    finally:
        sim_admin.settings(create_delay=0.2)
    assert "Not waiting (--async)" in output(console)
    assert [n.state for n in nodes] in ([], ["CREATING"])


@pytest.mark.sim
def test_delete_asks_first(settings_for, make_node, tpu_client):
    proto = make_node("v4-8")
    name = proto.name.rsplit("/", 1)[-1]
    settings = settings_for(name=name)
    asked = []

    def say_no(question, console):
        asked.append(question)
        return False

    assert lifecycle.delete(settings, console=recording_console(), confirm=say_no) is False
    assert name in asked[0] and "v4-8" in asked[0]
    assert tpu_client.get_node(name=proto.name).state.name == "READY"

    # without a terminal and without --yes: a clear error, not a hang
    with pytest.raises(ConfigError, match="pass --yes"):
        lifecycle.delete(settings, console=recording_console())


# ---------------------------------------------------------------------------------------------
# deleting re-reads what it deletes (issue 23, finding 4)


@pytest.mark.sim
def test_gc_leaves_a_node_recreated_between_its_listing_and_its_delete(settings_for, make_node,
                                                                      sim_admin, tpu_client):
    """babysit recreates a preempted node under its name: gc, which listed the preempted one,
    must not delete the live one that now has the name."""
    proto = make_node("v4-8")
    name = proto.name.rsplit("/", 1)[-1]
    sim_admin.preempt(name)
    settings = settings_for(name=name, type="v4-8")
    old_id = lifecycle.describe(settings, name).id
    recreated = {}

    def recreate_while_asking(question, console):     # the prompt is where a user waits
        lifecycle.delete(settings, yes=True, console=recording_console())
        [node] = lifecycle.create(settings, console=recording_console())
        recreated["id"] = node.id
        return True

    console = recording_console()
    collecting.gc(settings, console=console, confirm=recreate_while_asking)
    text = output(console)
    assert f"TPU node {name} (v4-8, PREEMPTED) in {settings.zone}, id {old_id}" in text
    assert recreated["id"] != old_id
    assert (f"Not deleting TPU node {name}: {name} is not the node that was listed (it was id "
            f"{old_id}, it is now id {recreated['id']}, READY)") in text
    assert f"Deleted TPU node {name}" not in text
    live = tpu_client.get_node(name=proto.name)
    assert live.state.name == "READY" and str(live.id) == recreated["id"]


@pytest.mark.sim
def test_gc_names_every_slice_a_queued_resource_delete_takes(settings_for, created, sim_admin):
    name = unique_name("gcms")
    created.append(name)
    settings = settings_for(name=name, type="v4-8")
    nodes = lifecycle.create(settings, num_slices=2, console=recording_console())
    ids = {n.name: n.id for n in nodes}
    sim_admin.preempt(f"{name}-1")
    asked = []

    def say_no(question, console):
        asked.append(question)
        return False

    console = recording_console()
    assert collecting.gc(settings, console=console, confirm=say_no) == []
    text = output(console)
    assert (f"queued resource {name} (v4-8, SUSPENDED) in {settings.zone}; "
            f"deleting it deletes all its slices {name}-0 (id {ids[f'{name}-0']}, READY), "
            f"{name}-1 (id {ids[f'{name}-1']}, PREEMPTED)") in text
    assert f"{name}-0 is not dead and will be deleted too" in text.replace("\n", " ")
    assert asked and "Nothing deleted." in text

    console = recording_console()
    collecting.gc(settings, yes=True, console=console)
    assert (f"Deleted queued resource {name} (v4-8, SUSPENDED) with all its slices "
            f"{name}-0 (id {ids[f'{name}-0']}, READY), {name}-1") in output(console)


@pytest.mark.sim
def test_delete_says_the_id_and_state_it_deleted(settings_for, make_node):
    proto = make_node("v4-8")
    name = proto.name.rsplit("/", 1)[-1]
    settings = settings_for(name=name)
    node_id = lifecycle.describe(settings, name).id
    console = recording_console()
    assert lifecycle.delete(settings, yes=True, console=console)
    assert f"Deleted TPU node {name} (v4-8, id {node_id}, READY)" in output(console)


@pytest.mark.sim
def test_the_autostop_watchdog_re_reads_the_node_before_it_deletes_it(sim, make_node, settings_for,
                                                                     tpu_client):
    """The watchdog's delete (worker side) goes for the node it guards only: another id under
    the name is left alone; its own node is labelled with the decision, then deleted, and
    `describe` says so afterwards."""
    import importlib.util
    from pathlib import Path

    import tpufab.remote

    spec = importlib.util.spec_from_file_location(
        "autostop_worker", Path(tpufab.remote.__file__).parent / "autostop_worker.py")
    watchdog = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(watchdog)
    proto = make_node("v4-8")
    name = proto.name.rsplit("/", 1)[-1]
    config = {"endpoint": sim.endpoint, "project": sim.project, "zone": sim.zone, "node": name,
              "auth": "anonymous", "node_id": "12345"}
    result = watchdog.delete_pod(config, 1_700_000_000, "idle")
    assert result == {"ok": False, "skipped": f"node {name} is now id {proto.id}, not the one "
                                              "this watchdog guards (id 12345)"}
    assert tpu_client.get_node(name=proto.name).state.name == "READY"

    result = watchdog.delete_pod({**config, "node_id": str(proto.id)}, time.time(), "ttl")
    assert result["ok"] and result["node_id"] == str(proto.id) and result["state"] == "READY"
    settings = settings_for(name=name)
    wait_for(lambda: name not in {n.name for n in lifecycle.list_nodes(settings)}, 60,
             what="the node to go")
    with pytest.raises(NotFound, match=r"it was deleted by autostop at \S+ \S+ \(ttl\)"):
        lifecycle.describe(settings, name)


@pytest.mark.sim
def test_babysit_does_not_delete_a_node_someone_recreated_before_its_recovery(settings_for,
                                                                            tmp_path):
    """babysit decided on the node it watched (preempted); by the time it deletes, another
    babysit (or a person) recreated the name: the new node is used, not deleted."""
    from tpufab.flows.babysit.loop import Babysitter
    from tpufab.flows.babysit.recover import NodeSpec

    name = unique_name("sit")
    settings = settings_for(name=name, type="v4-8")
    [watched] = lifecycle.create(settings, console=recording_console())
    recipe = tmp_path / "r.sh"
    recipe.write_text("#!/bin/sh\ntrue\n")
    console = recording_console()
    sitter = Babysitter(settings_for(name=name), recipe, console=console)
    sitter.spec = NodeSpec.from_api(name, [watched], None)
    sitter._watched_ids = {watched.id}
    lifecycle.delete(settings, yes=True, console=recording_console())   # someone else
    [fresh] = lifecycle.create(settings, console=recording_console())
    try:
        sitter._recreate(f"TPU node {name} was PREEMPTED")
        text = output(console)
        assert f"{name} (id {fresh.id}, READY) is not the node babysit watched" in text
        assert f"Deleted TPU node {name}" not in text
        assert lifecycle.describe(settings, name).id == fresh.id
    finally:
        lifecycle.delete(settings, yes=True, console=recording_console())
