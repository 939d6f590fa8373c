"""The control plane: error sentences, the retry policy, request bodies, records from protos;
then the official client against the emulator (the `sim` fixture)."""

from __future__ import annotations

import os
import stat

import pytest
import requests
from google.api_core import exceptions as gexc
from google.cloud import tpu_v2
from helpers import unique_name, wait_for

from tpufab.cloud import planes
from tpufab.cloud.bodies import node_body, queued_resource_body
from tpufab.cloud.nodes import Node, QueuedResourceInfo
from tpufab.cloud.planes.base import ControlPlane
from tpufab.cloud.planes.calls import (
    Action,
    RetriesExhausted,
    RetryPolicy,
    call_with_retries,
    exhausted_kind,
    is_transient,
    translate,
)
from tpufab.cloud.planes.tpu import TpuApi
from tpufab.config import load_settings
from tpufab.errors import ApiError, ConfigError, NotFound
from tpufab.ssh import keys as sshkeys
from tpufab.topology import parse_accelerator_type

SIM = "http://127.0.0.1:9"
REAL = "https://tpu.googleapis.com"
CREATE = Action(verb="create", target="TPU node 'demo'", permission="tpu.nodes.create",
                name="demo", accelerator_type="v4-32", zone="us-central2-b", project="proj")
STOCKOUT = ('There is no more capacity in the zone "us-central2-b"; you can try in another zone '
            "where Cloud TPU Nodes are offered [EID: 0x1234]")
QUOTA = ("Quota limit 'TPUV4sPodPerProjectPerZoneForTPUAPI' has been exceeded. Limit: 32 in "
         "zone us-central2-b.")
RATE = ("Quota exceeded for quota metric 'Read requests' and limit 'Read requests per minute' of "
        "service 'tpu.googleapis.com'")


def rest(code: int, message: str) -> gexc.GoogleAPICallError:
    """What the REST transport raises: the HTTP status's class, message prefixed by method+URL."""
    return gexc.from_http_status(code, f"POST http://127.0.0.1:9/v2/projects/proj/x: {message}")


def refused() -> requests.ConnectionError:
    return requests.ConnectionError(
        "HTTPConnectionPool(host='127.0.0.1', port=9): Max retries exceeded (Caused by "
        "NewConnectionError('Failed to establish a new connection: [Errno 111] Connection refused'))")


def reset() -> requests.ConnectionError:
    return requests.ConnectionError("('Connection aborted.', ConnectionResetError(104, "
                                    "'Connection reset by peer'))")


# ---------------------------------------------------------------------------------------------
# error sentences

SENTENCES = [
    # (exception, endpoint, error class, every fragment the sentence must hold)
    (rest(429, STOCKOUT), SIM, ApiError,
     ["No v4-32 capacity", "us-central2-b", "stockout", "--spot", "--queued", "--zone"]),
    (gexc.from_grpc_status(8, STOCKOUT), SIM, ApiError, ["stockout", "--spot", "--queued"]),
    (rest(429, QUOTA), SIM, ApiError,
     ["Not enough quota", "TPUV4sPodPerProjectPerZoneForTPUAPI", "request more TPU quota",
      "--spot"]),
    (gexc.from_grpc_status(8, QUOTA), SIM, ApiError, ["Not enough quota"]),
    (rest(403, "Permission 'tpu.nodes.create' denied on 'projects/proj'"), REAL, ApiError,
     ["Permission denied", "tpu.nodes.create", "roles/tpu.admin",
      "gcloud auth application-default login"]),
    (rest(403, "Cloud TPU API has not been used in project 42 before or it is disabled."), REAL,
     ApiError, ["not enabled", "gcloud services enable tpu.googleapis.com --project proj"]),
    (rest(401, "Request had invalid authentication credentials."), REAL, ApiError,
     ["credentials", "gcloud auth application-default login"]),
    (rest(404, "Resource 'projects/proj/locations/us-central2-b/nodes/demo' was not found"), SIM,
     NotFound, ["No node named 'demo'", "us-central2-b", "tpufab list"]),
    (rest(409, "Resource already exists"), SIM, ApiError,
     ["already exists", "--name", "tpufab delete --name demo"]),
    (gexc.from_grpc_status(10, "Node demo was preempted."), SIM, ApiError,
     ["ABORTED", "Node demo was preempted"]),
    (rest(400, "Invalid runtime version 'nope' for v4-32"), SIM, ApiError,
     ["rejected", "Invalid runtime version 'nope' for v4-32"]),
    (refused(), SIM, ApiError,
     ["Cannot reach the TPU API at http://127.0.0.1:9 (connection refused); is the simulated pod "
      "up? run `tpufab sim up`"]),
    (refused(), REAL, ApiError, ["Cannot reach the TPU API", "check your network"]),
    (rest(503, "The service is currently unavailable."), SIM, ApiError,
     ["unavailable", "503", "try again"]),
]


@pytest.mark.parametrize("exc, endpoint, kind, fragments", SENTENCES,
                         ids=[f"{type(s[0]).__name__}-{i}" for i, s in enumerate(SENTENCES)])
def test_each_error_becomes_one_sentence_with_the_fix(exc, endpoint, kind, fragments):
    err = translate(exc, CREATE, endpoint)
    assert isinstance(err, kind)
    text = str(err)
    for fragment in fragments:
        assert fragment in text
    assert "\n" not in text and "Traceback" not in text
    assert "POST http" not in text  # the transport's method+URL prefix is stripped


def test_resource_exhausted_kinds():
    assert exhausted_kind(rest(429, STOCKOUT)) == "stockout"
    assert exhausted_kind(rest(429, QUOTA)) == "quota"
    assert exhausted_kind(rest(429, RATE)) == "rate"
    # A bare 429 is rate limiting; a failed operation with RESOURCE_EXHAUSTED is a stockout.
    assert exhausted_kind(rest(429, "Too many requests")) == "rate"
    assert exhausted_kind(rest(429, "slow down")) == "rate"
    assert exhausted_kind(gexc.from_grpc_status(8, "Resource exhausted")) == "stockout"


@pytest.mark.parametrize("exc, transient", [
    (rest(503, "unavailable"), True),
    (rest(504, "gateway timeout"), True),
    (gexc.from_grpc_status(14, "UNAVAILABLE"), True),
    (gexc.from_grpc_status(4, "DEADLINE_EXCEEDED"), True),
    (rest(429, "Too many requests"), True),
    (rest(429, RATE), True),
    (rest(429, STOCKOUT), False),
    (rest(429, QUOTA), False),
    (reset(), True),
    (requests.ReadTimeout("read timed out"), True),
    (refused(), False),
    (rest(404, "not found"), False),
    (rest(400, "bad"), False),
    (rest(403, "denied"), False),
    (ValueError("bug"), False),
])
def test_which_failures_are_retried(exc, transient):
    assert is_transient(exc) is transient


# ---------------------------------------------------------------------------------------------
# retries


class Flaky:
    """Fails ``failures`` times with ``exc`` then returns "ok"; counts calls."""

    def __init__(self, failures: int, exc: Exception):
        self.failures, self.exc, self.calls = failures, exc, 0

    def __call__(self):
        self.calls += 1
        if self.calls <= self.failures:
            raise self.exc
        return "ok"


FAST = RetryPolicy(attempts=6, total_seconds=60, initial=0.5, maximum=4, jitter=0.5)


def test_transient_failures_are_retried_with_growing_jittered_backoff():
    flaky, sleeps, seen = Flaky(4, rest(503, "busy")), [], []
    result = call_with_retries(flaky, FAST, sleep=sleeps.append,
                               on_retry=lambda exc, n, delay: seen.append((n, delay)))
    assert result == "ok" and flaky.calls == 5
    assert len(sleeps) == 4 and [n for n, _ in seen] == [1, 2, 3, 4]
    # exponential: each base doubles (0.5, 1, 2, 4 capped at 4) plus up to 0.5 s of jitter
    for sleep, base in zip(sleeps, [0.5, 1, 2, 4], strict=True):
        assert base <= sleep <= min(base + 0.5, 4)


def test_a_long_burst_ends_in_one_sentence():
    flaky = Flaky(100, rest(503, "The service is currently unavailable."))
    with pytest.raises(RetriesExhausted) as info:
        call_with_retries(flaky, FAST, sleep=lambda s: None)
    assert flaky.calls == FAST.attempts and info.value.attempts == FAST.attempts

    settings = load_settings({"project": "proj", "api_endpoint": SIM}, env={})
    control = TpuApi(settings, retry=FAST, sleep=lambda s: None, client=object())
    with pytest.raises(ApiError) as info:
        control._call(CREATE, lambda **kw: flaky())
    text = str(info.value)
    assert "kept failing with 503 Service Unavailable" in text and "6 attempts" in text
    assert "wait a few minutes" in text and "\n" not in text


def test_retries_stop_at_the_time_bound():
    import time

    flaky = Flaky(10_000, rest(503, "busy"))
    policy = RetryPolicy(attempts=10_000, total_seconds=0.3, initial=0.02, maximum=0.05, jitter=0)
    slept: list[float] = []

    def sleep(seconds: float) -> None:
        slept.append(seconds)
        time.sleep(seconds)

    with pytest.raises(RetriesExhausted) as info:
        call_with_retries(flaky, policy, sleep=sleep)
    # the time bound stopped it, not the 10,000 attempts: it never planned to sleep past
    # total_seconds (a busy machine only makes it stop sooner)
    assert 1 <= flaky.calls < 100 and info.value.attempts == flaky.calls
    assert len(slept) == flaky.calls - 1 and sum(slept) <= 0.3


def test_permanent_failures_are_not_retried():
    flaky = Flaky(1, rest(429, STOCKOUT))
    with pytest.raises(gexc.TooManyRequests):
        call_with_retries(flaky, FAST, sleep=lambda s: pytest.fail("slept"))
    assert flaky.calls == 1


def test_client_calls_go_through_one_retry_policy_with_client_retry_off():
    settings = load_settings({"project": "proj", "api_endpoint": SIM}, env={})
    seen = []

    class Client:
        def get_node(self, *, name, retry, timeout):
            seen.append((name, retry, timeout))
            if len(seen) < 3:
                raise rest(503, "busy")
            return tpu_v2.Node(name=name, accelerator_type="v4-8", state="READY")

    control = TpuApi(settings, client=Client(), retry=FAST, sleep=lambda s: None)
    node = control.get_node("demo")
    assert node.name == "demo" and node.ready
    assert len(seen) == 3
    assert all(retry is None for _, retry, _ in seen)      # the client's own retry is off
    assert seen[0][0] == "projects/proj/locations/us-central2-b/nodes/demo"


def test_no_project_is_a_config_sentence(tmp_path):
    # in a folder of its own: a current pod where the tests run would name a project
    settings = load_settings({"api_endpoint": SIM}, env={}, cwd=tmp_path)
    with pytest.raises(ConfigError, match="No project given: pass --project"):
        TpuApi(settings)


# ---------------------------------------------------------------------------------------------
# request bodies (data)


def settings_for(**flags):
    base = {"project": "proj", "zone": "us-central2-b", "name": "demo", "type": "v4-32"}
    return load_settings({**base, **flags}, env={})


ENTRY = "alice:ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIExample alice"


def test_node_body_defaults():
    body = node_body(settings_for(), ssh_entry=ENTRY)
    assert body == {
        "accelerator_type": "v4-32",
        "runtime_version": "tpu-ubuntu2204-base",       # default of the generation
        "network_config": {"enable_external_ips": True},
        "labels": {},
        "metadata": {"ssh-keys": ENTRY},
    }
    tpu_v2.Node(body)  # the client accepts it as is


@pytest.mark.parametrize("flags, expected", [
    ({"spot": True}, {"spot": True}),
    ({"preemptible": True}, {"preemptible": True}),
    ({"reserved": True}, {"reserved": True}),
])
def test_node_body_scheduling(flags, expected):
    assert node_body(settings_for(**flags))["scheduling_config"] == expected


def test_node_body_everything():
    settings = settings_for(type="tpu-v6e-8", runtime_version="v2-alpha-tpuv6e-custom",
                            labels={"team": "ml"}, metadata={"ssh-keys": "bob:ssh-rsa AAAB bob",
                                                             "startup-script": "true"},
                            network="net", subnetwork="sub", service_account="sa@x.iam",
                            internal_ip=True)
    body = node_body(settings, ssh_entry=ENTRY)
    assert body["accelerator_type"] == "v6e-8"
    assert body["runtime_version"] == "v2-alpha-tpuv6e-custom"
    assert body["network_config"] == {"enable_external_ips": False, "network": "net",
                                      "subnetwork": "sub"}
    assert body["service_account"]["email"] == "sa@x.iam"
    assert body["labels"] == {"team": "ml"}
    assert body["metadata"]["ssh-keys"] == "bob:ssh-rsa AAAB bob\n" + ENTRY   # others' keys kept
    assert body["metadata"]["startup-script"] == "true"
    tpu_v2.Node(body)


@pytest.mark.parametrize("type_, runtime", [("v5litepod-16", "v2-alpha-tpuv5-lite"),
                                            ("v5p-8", "v2-alpha-tpuv5"),
                                            ("v6e-256", "v2-alpha-tpuv6e"),
                                            ("v2-8", "tpu-ubuntu2204-base")])
def test_runtime_defaults_by_generation(type_, runtime):
    assert node_body(settings_for(type=type_))["runtime_version"] == runtime


def test_conflicting_tiers_are_one_sentence():
    with pytest.raises(ConfigError, match="--spot and --reserved cannot be combined"):
        node_body(settings_for(spot=True, reserved=True))


def test_queued_resource_body_single_guaranteed():
    body = queued_resource_body(settings_for(), ssh_entry=ENTRY)
    spec = body["tpu"]["node_spec"][0]
    assert body["guaranteed"] == {} and "spot" not in body
    assert spec["parent"] == "projects/proj/locations/us-central2-b"
    assert spec["node_id"] == "demo" and "multislice_params" not in spec
    assert spec["node"]["accelerator_type"] == "v4-32"
    assert spec["node"]["metadata"]["ssh-keys"] == ENTRY
    tpu_v2.QueuedResource(body)


def test_queued_resource_body_spot_multislice():
    body = queued_resource_body(settings_for(spot=True), num_slices=4)
    spec = body["tpu"]["node_spec"][0]
    assert body["spot"] == {} and "guaranteed" not in body
    assert spec["multislice_params"] == {"node_count": 4, "node_id_prefix": "demo"}
    assert "node_id" not in spec and "scheduling_config" not in spec["node"]
    info = QueuedResourceInfo.from_proto(tpu_v2.QueuedResource(
        {**body, "name": "projects/proj/locations/us-central2-b/queuedResources/demo"}))
    assert info.node_ids == ["demo-0", "demo-1", "demo-2", "demo-3"]
    assert info.tier == "spot" and info.accelerator_type == "v4-32"


def test_queued_resource_body_reserved():
    body = queued_resource_body(settings_for(reserved=True))
    assert body["guaranteed"] == {}
    assert body["tpu"]["node_spec"][0]["node"]["scheduling_config"] == {"reserved": True}
    with pytest.raises(ConfigError, match="cannot be preemptible"):
        queued_resource_body(settings_for(preemptible=True))


# ---------------------------------------------------------------------------------------------
# records


def test_node_from_proto():
    proto = tpu_v2.Node(
        name="projects/proj/locations/us-central2-b/nodes/demo", id=123,
        accelerator_type="v4-32", runtime_version="tpu-ubuntu2204-base", state="PREEMPTED",
        health="HEALTHY", scheduling_config={"spot": True}, labels={"team": "ml"},
        accelerator_config={"type_": "V4", "topology": "2x2x4"},
        create_time={"seconds": 1_700_000_000},
        queued_resource="projects/proj/locations/us-central2-b/queuedResources/qr",
        network_endpoints=[{"ip_address": f"10.0.0.{i}", "port": 8470,
                            "access_config": {"external_ip": f"34.1.1.{i}"}} for i in range(4)])
    node = Node.from_proto(proto)
    assert (node.name, node.project, node.zone, node.id) == ("demo", "proj", "us-central2-b", "123")
    assert node.state == "PREEMPTED" and node.preempted and not node.ready
    assert node.health == "HEALTHY" and node.spot and node.tier == "spot"
    assert node.hosts == 4 and node.topology.chips == 16 and node.chip_topology == "2x2x4"
    assert node.addresses() == [f"34.1.1.{i}" for i in range(4)]
    assert node.addresses(internal_ip=True) == [f"10.0.0.{i}" for i in range(4)]
    assert node.queued_resource == "qr"
    data = node.to_json()
    assert data["workers"][3] == {"index": 3, "internal_ip": "10.0.0.3",
                                  "external_ip": "34.1.1.3", "port": 8470}
    assert data["created"].startswith("2023-11-14")


def test_node_without_external_ips_uses_internal():
    proto = tpu_v2.Node(name="projects/p/locations/z/nodes/n", accelerator_type="v9-8",
                        network_endpoints=[{"ip_address": "10.0.0.2"}])
    node = Node.from_proto(proto)
    assert node.addresses() == ["10.0.0.2"] and node.topology is None  # unknown type kept
    assert node.created is None and node.health is None


# ---------------------------------------------------------------------------------------------
# ssh keys


def test_key_is_generated_once_0600_with_pub_beside(tmp_path):
    key = tmp_path / "ssh" / "tpufab_ed25519"
    pub = sshkeys.ensure_key(key)
    assert pub.startswith("ssh-ed25519 AAAA")
    assert stat.S_IMODE(key.stat().st_mode) == 0o600
    assert (tmp_path / "ssh" / "tpufab_ed25519.pub").read_text().strip() == pub
    assert sshkeys.ensure_key(key) == pub            # not regenerated
    os.unlink(tmp_path / "ssh" / "tpufab_ed25519.pub")
    assert sshkeys.ensure_key(key).split()[:2] == pub.split()[:2]   # .pub rebuilt from the key
    assert [p.name for p in (tmp_path / "ssh").iterdir() if p.name.startswith(".")] == []


def test_metadata_entry_and_merge():
    entry = sshkeys.metadata_entry("alice", "ssh-ed25519 AAAAkey laptop")
    assert entry == "alice:ssh-ed25519 AAAAkey alice"
    others = "bob:ssh-rsa AAAAbob bob\ncarol:ssh-ed25519 AAAAcarol carol"
    merged = sshkeys.merge_entry(others, entry)
    assert merged.splitlines() == [*others.splitlines(), entry]
    assert sshkeys.merge_entry(merged, entry) == merged                      # no duplicate
    assert sshkeys.merge_entry(merged, "alice:ssh-ed25519 AAAAkey other-comment") == merged
    assert sshkeys.merge_entry(None, entry) == entry
    assert sshkeys.has_entry(merged, entry) and not sshkeys.has_entry(others, entry)


# ---------------------------------------------------------------------------------------------
# against the emulator, through the official client


@pytest.fixture
def control(sim, tmp_path):
    settings = load_settings({"api_endpoint": sim.endpoint, "project": sim.project,
                              "zone": sim.zone, "api_retries": 5, "api_retry_seconds": 30},
                             cwd=tmp_path, env={})
    return TpuApi(settings, retry=RetryPolicy(attempts=5, total_seconds=30, initial=0.05,
                                                    maximum=0.2, jitter=0.05))


@pytest.fixture
def doomed(control):
    """Node / queued resource names to delete after the test (and wait for)."""
    names: list[str] = []
    yield names
    for name in names:
        if control.find_queued_resource(name):
            control.delete_queued_resource(name)
            wait_for(lambda n=name: control.find_queued_resource(n) is None, 60, 0.1, name)
        if control.find_node(name):
            control.delete_node(name)
            wait_for(lambda n=name: control.find_node(n) is None, 60, 0.1, name)


def wait_op(control, op, **kw):
    return wait_for(lambda: control.operation_done(op, **kw), 60, 0.05, f"operation {op}")


@pytest.mark.sim
@pytest.mark.parametrize("type_, hosts", [("v5litepod-8", 1), ("v4-32", 4)])
def test_create_get_list_delete_node(control, doomed, type_, hosts):
    name = unique_name("cp")
    doomed.append(name)
    settings = load_settings({"project": control.project, "zone": control.zone, "name": name,
                              "type": type_, "labels": {"team": "ml"}}, env={})
    op = control.create_node(name, node_body(settings, ssh_entry=ENTRY))
    wait_op(control, op, name=name)
    node = wait_for(lambda: (n := control.get_node(name)).ready and n, 60, 0.05, "READY")
    assert node.accelerator_type == type_ and node.hosts == hosts
    assert node.labels == {"team": "ml"} and node.metadata["ssh-keys"] == ENTRY
    assert node.runtime_version == parse_accelerator_type(type_).default_runtime
    assert len(set(node.addresses())) == hosts
    assert name in [n.name for n in control.list_nodes()]

    host_keys = control.host_keys(name)
    assert sorted(host_keys) == list(range(hosts))
    assert all(k["ssh-ed25519"].startswith("ssh-ed25519 AAAA") for k in host_keys.values())

    with pytest.raises(ApiError, match=f"'{name}' already exists"):
        control.create_node(name, node_body(settings))

    wait_op(control, control.delete_node(name), verb="delete", name=name)
    wait_for(lambda: control.find_node(name) is None, 60, 0.05, "the node to go")
    with pytest.raises(NotFound, match=f"No node named '{name}' in {control.zone}"):
        control.get_node(name)


@pytest.mark.sim
def test_ssh_key_is_added_to_an_existing_node(control, make_node):
    other = "bob:ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIBob bob"
    node = Node.from_proto(make_node("v4-8", metadata={"ssh-keys": other}))
    op = control.add_ssh_key(node, ENTRY)
    assert op is not None
    wait_op(control, op, verb="update", name=node.name)
    after = control.get_node(node.name)
    assert after.metadata["ssh-keys"].splitlines() == [other, ENTRY]
    assert control.add_ssh_key(after, ENTRY) is None          # already there: no call


@pytest.mark.sim
def test_queued_resource_multislice(control, doomed):
    name = unique_name("qr")
    doomed.append(name)
    settings = load_settings({"project": control.project, "zone": control.zone, "name": name,
                              "type": "v5litepod-16", "spot": True}, env={})
    control.create_queued_resource(name, queued_resource_body(settings, num_slices=3))
    qr = wait_for(lambda: (q := control.get_queued_resource(name)).active and q, 60, 0.05,
                  "ACTIVE")
    assert qr.tier == "spot" and qr.node_count == 3
    assert qr.node_ids == [f"{name}-{i}" for i in range(3)]
    nodes = [control.get_node(n) for n in qr.node_ids]
    assert all(n.queued_resource == name and n.hosts == 4 and n.spot for n in nodes)
    assert name in [q.name for q in control.list_queued_resources()]
    control.delete_queued_resource(name)
    wait_for(lambda: control.find_queued_resource(name) is None, 60, 0.05, "the QR to go")
    assert not {n.name for n in control.list_nodes()} & set(qr.node_ids)


@pytest.mark.sim
@pytest.mark.parametrize("reason, fragment", [("stockout", "No v4-8 capacity"),
                                              ("quota", "Not enough quota")])
def test_failed_create_operation_is_a_sentence(control, doomed, sim_admin, reason, fragment):
    name = unique_name("full")
    doomed.append(name)
    sim_admin.fail_next_create(reason)
    settings = load_settings({"project": control.project, "zone": control.zone, "name": name,
                              "type": "v4-8"}, env={})
    op = control.create_node(name, node_body(settings))
    with pytest.raises(ApiError, match=fragment):
        wait_op(control, op, name=name, accelerator_type="v4-8")


@pytest.mark.sim
def test_503_burst_is_retried_by_the_client(control, sim_admin):
    retried = []
    control.on_retry = lambda exc, n, delay: retried.append(type(exc).__name__)
    sim_admin.error_burst(3, code=503)
    assert isinstance(control.list_nodes(), list)
    assert retried == ["ServiceUnavailable"] * 3


@pytest.mark.sim
def test_preempted_node_reads_as_preempted(control, make_node, sim_admin):
    node = Node.from_proto(make_node("v4-8"))
    sim_admin.preempt(node.name)
    after = control.get_node(node.name)
    assert after.preempted and after.state == "PREEMPTED" and after.to_json()["state"] == "PREEMPTED"


@pytest.mark.sim
def test_accelerator_types_from_the_api(control):
    types = control.accelerator_types()
    assert "v4-32" in types and "v6e-8" in types


def test_an_endpoint_that_accepts_and_never_answers_costs_api_timeout_then_one_sentence():
    """(issue 23) list/describe have no --timeout: the whole call, retries included, waits at
    most api_timeout for answers that never come (it took 121 s: two 60 s attempts)."""
    import socket
    import time

    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(16)                       # accepts (the kernel does), never answers
    endpoint = f"http://127.0.0.1:{silent.getsockname()[1]}"
    try:
        settings = load_settings({"project": "proj", "zone": "us-central2-b",
                                  "api_endpoint": endpoint, "api_timeout": 1.5,
                                  "api_retries": 8, "api_retry_seconds": 120}, env={})
        started = time.monotonic()
        with pytest.raises(ApiError) as info:
            TpuApi(settings).list_nodes()
        took = time.monotonic() - started
    finally:
        silent.close()
    assert took < 4, took
    text = str(info.value)
    assert text.startswith(f"The TPU API at {endpoint} did not answer within 1.5s")
    assert "TPUFAB_API_TIMEOUT" in text and "\n" not in text

# ---------------------------------------------------------------------------------------------
# the seam (issue 22, item 6): lifecycle and everything above it talk to ControlPlane


class InMemory(ControlPlane):
    """A second control plane, as small as the interface allows: nodes in a dict."""

    def __init__(self, settings, nodes=()):
        super().__init__(settings)
        self.nodes = {n.name: n for n in nodes}

    def get_node(self, name):
        if name not in self.nodes:
            raise NotFound(f"No TPU node named {name!r}.")
        return self.nodes[name]

    def list_nodes(self):
        return list(self.nodes.values())

    def create_node(self, name, body):
        raise ApiError("This control plane creates nothing.")

    def create_pod(self, settings, **how):
        raise ApiError("This control plane creates nothing.")

    def delete_node(self, name):
        self.nodes.pop(name)
        return "op-delete"

    def update_metadata(self, name, metadata):
        self.nodes[name].metadata = dict(metadata)
        return "op-update"

    def host_keys(self, name, workers=None):
        return {}

    def create_queued_resource(self, name, body):
        raise ApiError("This control plane has no queued capacity.")

    def get_queued_resource(self, name):
        raise NotFound(f"No queued resource named {name!r}.")

    def list_queued_resources(self):
        return []

    def delete_queued_resource(self, name, *, force=True):
        raise NotFound(f"No queued resource named {name!r}.")

    def operation_done(self, op_name, verb="create", *, kind="node", name=None,
                       accelerator_type=None):
        return True

    def list_operations(self):
        return []

    def zones(self):
        return [self.zone]

    def accelerator_types(self):
        return ["v4-8"]


def test_the_control_plane_is_an_interface_with_the_tpu_api_as_its_first_implementation(
        tmp_path):
    settings = load_settings({"project": "proj", "api_endpoint": SIM}, env={}, cwd=tmp_path)
    with pytest.raises(TypeError, match="abstract"):
        ControlPlane(settings)
    made = planes.control_plane(settings)  # nothing says which plane: every one, by name
    from tpufab.cloud.planes.any import AnyPlane
    from tpufab.cloud.planes.compute import ComputeEngine

    assert isinstance(made, AnyPlane) and isinstance(made, ControlPlane)
    assert [type(p) for p in made.planes] == [TpuApi, ComputeEngine]
    settings.control_plane = "tpu"
    assert isinstance(planes.control_plane(settings), TpuApi)
    settings.control_plane, settings.type = None, "tpu7x-16"  # TPU7x: Compute Engine only
    assert isinstance(planes.control_plane(settings), ComputeEngine)
    settings.type = "v6e-8"
    settings.control_plane = "compute"  # --on compute
    assert isinstance(planes.control_plane(settings), ComputeEngine)
    settings.control_plane = "gke"
    with pytest.raises(ConfigError, match="must be tpu or compute"):
        planes.control_plane(settings)

    class Half(ControlPlane):
        def get_node(self, name):
            raise NotFound(name)

    with pytest.raises(TypeError) as info:   # a new implementation is told what it lacks
        Half(settings)
    assert "list_nodes" in str(info.value) and "operation_done" in str(info.value)


def test_lifecycle_works_on_any_control_plane(tmp_path):
    from rich.console import Console

    from tpufab.cloud import lifecycle

    settings = load_settings({"project": "proj", "name": "demo"}, env={}, cwd=tmp_path)
    node = Node(name="demo", project="proj", zone=settings.zone, accelerator_type="v4-8",
                state="READY")
    control = InMemory(settings, [node])
    assert control.find_node("gone") is None and control.find_queued_resource("q") is None
    assert [n.name for n in lifecycle.list_nodes(settings, control=control)] == ["demo"]
    assert lifecycle.describe(settings, control=control) is node
    console = Console(record=True, width=200)
    assert lifecycle.delete(settings, yes=True, console=console, control=control)
    assert control.nodes == {}


def test_only_the_factory_names_the_tpu_api():
    """Verbs, workflows and the Pod reach the cloud through planes.control_plane: a plane
    slots in there (its registry), and only its own module imports its client."""
    import ast
    from pathlib import Path

    package = Path(__file__).resolve().parents[1] / "tpufab"
    naming, client, compute = [], [], []
    for path in package.rglob("*.py"):
        rel = str(path.relative_to(package))
        if rel.startswith("sim/"):
            continue  # the simulated pod serves the API, it is not a client of it
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            if any(n.startswith("tpufab.cloud.planes.tpu") for n in names):
                naming.append(rel)
            if any(n.startswith("google.cloud.tpu_v2") for n in names):
                client.append(rel)
            if any(n.startswith("google.cloud.compute_v1") for n in names) or (
                    isinstance(node, ast.ImportFrom) and node.module == "google.cloud"
                    and any(a.name == "compute_v1" for a in node.names)):
                compute.append(rel)
    assert sorted(set(naming)) == ["cloud/planes/__init__.py"]   # the registry
    assert sorted(set(client)) == ["cloud/planes/tpu.py"]
    assert sorted(set(compute)) == ["cloud/planes/compute_parts.py"]  # google-cloud-compute


def _vm(name, ip, vm_id):
    from google.cloud import compute_v1

    return compute_v1.Instance(name=name, id=vm_id, network_interfaces=[
        compute_v1.NetworkInterface(network_i_p=ip)])


def test_a_migs_vms_are_ordered_by_the_numbers_kept_for_them_then_by_ip():
    """compute_parts.worker_order: the worker number kept in a VM's per-instance config wins
    over its IP (a recreated VM keeps its place); VMs without one follow, by IP."""
    from tpufab.cloud.planes.compute_parts import worker_order

    vms = [_vm("a", "10.0.0.9", 1), _vm("b", "10.0.0.10", 2), _vm("c", "10.0.0.2", 3),
           _vm("d", "10.0.0.1", 4)]
    assert [v.name for v in worker_order(vms, {})] == ["d", "c", "a", "b"]  # by IP (9 < 10)
    assert [v.name for v in worker_order(vms, {"b": 0, "a": 1})] == ["b", "a", "d", "c"]


def test_a_multislice_numbers_its_workers_slice_by_slice():
    from tpufab.cloud.nodes import MultisliceInfo, WorkerEndpoint

    def one(index, state="READY"):
        return Node(name=f"ms-{index}", project="p", zone="z", accelerator_type="tpu7x-16",
                    state=state, plane="compute", plane_text="Compute Engine",
                    multislice=True, slice_index=index,
                    workers=[WorkerEndpoint(w, f"10.0.{index}.{w + 1}", None)
                             for w in range(2)])

    ms = MultisliceInfo("ms", "p", "z", [one(0), one(1, "CREATING")])
    assert (ms.state, ms.hosts, ms.accelerator_type, ms.plane_text) == \
        ("CREATING", 4, "tpu7x-16", "Compute Engine")
    data = ms.to_json()
    assert data["multislice"] and data["slice_count"] == 2
    assert [(w["index"], w["slice"], w["slice_worker"], w["internal_ip"])
            for w in data["workers"]] == [(0, 0, 0, "10.0.0.1"), (1, 0, 1, "10.0.0.2"),
                                          (2, 1, 0, "10.0.1.1"), (3, 1, 1, "10.0.1.2")]
