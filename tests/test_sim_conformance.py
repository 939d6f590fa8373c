"""The simulated pod answers as Google's APIs do, checked against Google's own schemas.

One sweep (in process, paper workers: no root, a few seconds) calls every method the emulator
serves (each route of tpufab/sim/compute_engine.py's ROUTES, every Cloud TPU API v2, v2alpha1
and v1 method, the OS Login calls), on resources it makes as a user would, plus requests that
must fail. Every answer is then checked:

- parsed with the official clients' protos (google-cloud-compute, google-cloud-tpu,
  google-cloud-os-login; ``json_format.Parse`` without ignoring unknown fields): a field the
  API does not have, a wrong JSON type, an enum value not in the enum all fail;
- 64-bit integers are JSON strings (Google's JSON mapping writes them so);
- the output fields real resources always carry are there (``ALWAYS``);
- errors have their API's shape: Cloud TPU ``{error: {code, message, status}}``, Compute
  Engine ``{error: {code, message, errors: [{domain, reason, message}]}}``, ``code`` the
  HTTP status;
- operations carry their API's fields (Compute Engine: ``kind, status, targetLink, progress,
  insertTime, user``...).

With gcloud installed, the same answers are also decoded with gcloud's generated messages
(apitools; unknown fields counted) and ROUTES is checked against gcloud's generated Compute
client (method, path and response type of each method id). docs/simulated-pod.md
("Conformance") has the counts.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from conformance import Answer, api_and_message, violations

from tpufab.sim._fakepool import PaperWorkers
from tpufab.sim.compute_engine import ROUTES
from tpufab.sim.emulator import Emulator, SimSettings

P, Z, REGION = "conf-project", "us-central2-b", "us-central2"
TPU = f"/v2/projects/{P}/locations/{Z}"
CE = f"/compute/v1/projects/{P}"
KEY = ("ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIGM2rUNRnz6RdpZXq5aXcVmHPH6gxEoIyQmeyE3Ky+Ww "
       "alice@example.com")
GCLOUD_LIB = Path("/usr/lib/google-cloud-sdk/lib")

@dataclass
class Sweep:
    emu: Emulator
    answers: list[Answer] = field(default_factory=list)

    def __call__(self, method: str, path: str, body: Any = None, query: dict | None = None,
                 ok: bool = True) -> Any:
        code, answer = self.emu.handle(method, path, dict(query or {}), body)
        api, message = api_and_message(method, path)
        self.answers.append(Answer(api, method, path, code, answer, message))
        if ok:
            assert code == 200, f"{method} {path}: {code} {answer}"
        return answer

    def batch(self, requests: list[tuple[str, str]]) -> list[tuple[int, Any]]:
        """POST /batch/compute/v1 with ``requests``; each part's (code, body), recorded."""
        import email.parser

        kind, body = batch_body(requests)
        code, reply_kind, reply = self.emu.handle_batch(body, kind)
        assert code == 200 and reply_kind.startswith("multipart/mixed"), (code, reply)
        parsed = email.parser.Parser().parsestr(f"content-type: {reply_kind}\r\n\r\n"
                                                + reply.decode())
        out = []
        for (method, path), part in zip(requests, parsed.get_payload(), strict=True):
            assert part["Content-ID"].startswith("<response-a1b2c3+"), part["Content-ID"]
            status_line, payload = part.get_payload().split("\n", 1)
            answer = json.loads(email.parser.Parser().parsestr(payload).get_payload())
            code = int(status_line.split()[1])
            api, message = api_and_message(method, path)
            self.answers.append(Answer(api, method, path, code, answer, message))
            out.append((code, answer))
        return out

    def wait(self, predicate, what: str, timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            time.sleep(0.02)


def run_sweep(emu: Emulator) -> Sweep:  # noqa: PLR0915 - one user's session, in order
    call = Sweep(emu)
    emu.base_url = "http://127.0.0.1:1"
    # --- Cloud TPU API v2 and v2alpha1
    call("GET", f"/v2/projects/{P}/locations")
    call("GET", f"{TPU}")
    call("POST", f"{TPU}:generateServiceIdentity", {})
    call("GET", f"{TPU}/acceleratorTypes")
    call("GET", f"{TPU}/acceleratorTypes/v4-8")
    call("GET", f"{TPU}/runtimeVersions")
    call("GET", f"{TPU}/runtimeVersions/tpu-ubuntu2204-base")
    for version, node in (("v2", "n2"), ("v2alpha1", "n2a")):
        base = f"/{version}/projects/{P}/locations/{Z}"
        call("POST", f"{base}/nodes", {"acceleratorType": "v4-8",
                                       "runtimeVersion": "tpu-ubuntu2204-base",
                                       "metadata": {"k": "v"}}, {"nodeId": node})
    for version, node in (("v2", "n2"), ("v2alpha1", "n2a"), ("v2", "n2a"), ("v2alpha1", "n2")):
        name = f"projects/{P}/locations/{Z}/nodes/{node}"
        call.wait(lambda n=name: emu.store.node(n)["node"]["state"] == "READY", name)
        call("GET", f"/{version}/{name}")
    call("GET", f"{TPU}/nodes")
    call("GET", f"/v2alpha1/projects/{P}/locations/{Z}/nodes")
    node = f"projects/{P}/locations/{Z}/nodes/n2"
    call("POST", f"/v2/{node}:getGuestAttributes", {"workerIds": [""]})
    call("PATCH", f"/v2/{node}", {"labels": {"a": "b"}}, {"updateMask": "labels"})
    call("POST", f"/v2/{node}:simulateMaintenanceEvent", {})
    call("POST", f"/v2alpha1/{node}:performMaintenance", {})
    call("POST", f"/v2/{node}:stop", {})
    call.wait(lambda: emu.store.node(node)["node"]["state"] == "STOPPED", "stopped")
    call("POST", f"/v2/{node}:start", {})
    call.wait(lambda: emu.store.node(node)["node"]["state"] == "READY", "started")
    # queued resources: one node (v2), a multislice as MaxText's recipe makes it (v2alpha1,
    # multiNodeParams), each read through the other version too
    call("POST", f"{TPU}/queuedResources", {"tpu": {"nodeSpec": [{
        "parent": f"projects/{P}/locations/{Z}", "nodeId": "qn",
        "node": {"acceleratorType": "v4-8", "runtimeVersion": "tpu-ubuntu2204-base"}}]},
        "spot": {}}, {"queuedResourceId": "q1"})
    call("POST", f"/v2alpha1/projects/{P}/locations/{Z}/queuedResources", {"tpu": {"nodeSpec": [{
        "parent": f"projects/{P}/locations/{Z}",
        "multiNodeParams": {"nodeCount": 2, "nodeIdPrefix": "ms"},
        "node": {"acceleratorType": "v4-8", "runtimeVersion": "tpu-ubuntu2204-base"}}]}},
        {"queuedResourceId": "q2"})
    for qr in ("q1", "q2"):
        name = f"projects/{P}/locations/{Z}/queuedResources/{qr}"
        call.wait(lambda n=name: emu.queued.get(n)["qr"]["state"]["state"] == "ACTIVE", name)
        for version in ("v2", "v2alpha1"):
            call("GET", f"/{version}/{name}")
    call("GET", f"{TPU}/queuedResources")
    call("GET", f"/v2alpha1/projects/{P}/locations/{Z}/queuedResources")
    q2 = f"projects/{P}/locations/{Z}/queuedResources/q2"
    call("POST", f"/v2alpha1/{q2}:performMaintenanceQueuedResource", {})
    call("POST", f"/v2/{q2}:reset", {})
    call.wait(lambda: emu.queued.get(q2)["qr"]["state"]["state"] == "ACTIVE", "reset")
    call("DELETE", f"/v2/{q2}", query={"force": "true"})
    # legacy TPU Nodes (v1), listed through v2 as well
    call("POST", f"/v1/projects/{P}/locations/{Z}/nodes", {"acceleratorType": "v3-8",
                                                           "tensorflowVersion": "2.12.0"},
         {"nodeId": "legacy"})
    legacy = f"projects/{P}/locations/{Z}/nodes/legacy"
    call.wait(lambda: emu.legacy.get(legacy)["state"] == "READY", "legacy")
    call("GET", f"/v1/{legacy}")
    call("GET", f"/v1/projects/{P}/locations/{Z}/nodes")
    call("GET", f"/v1/projects/{P}/locations")
    ops = call("GET", f"{TPU}/operations")["operations"]
    call("GET", f"/v2alpha1/projects/{P}/locations/{Z}/operations")
    call("GET", f"/v2/{ops[0]['name']}")
    call("GET", f"/v1/{ops[-1]['name']}")
    call("POST", f"/v2/{ops[0]['name']}:cancel", {})
    call("DELETE", f"/v2/{ops[0]['name']}")
    call("DELETE", f"/v1/{legacy}")
    call("DELETE", f"/v2/{node}")
    # TPU API errors
    call("GET", f"{TPU}/nodes/missing", ok=False)
    call("POST", f"{TPU}/nodes", {"acceleratorType": "v4-31", "runtimeVersion": "x"},
         {"nodeId": "bad"}, ok=False)
    call("POST", f"{TPU}/nodes", {"acceleratorType": "v4-8"}, {"nodeId": "n2a"}, ok=False)
    call("POST", f"{TPU}/nodes/n2a:stop", {}, ok=False)  # v2alpha1 node: fine; then again
    call("GET", f"/v2/{q2}/nope", ok=False)
    # --- OS Login
    user = "/v1/users/alice@example.com"
    call("POST", f"{user}:importSshPublicKey", {"key": KEY}, {"projectId": P})
    profile = call("GET", f"{user}/loginProfile", query={"projectId": P})
    fp = next(iter(profile["sshPublicKeys"]))
    call("GET", f"{user}/sshPublicKeys/{fp}")
    call("PATCH", f"{user}/sshPublicKeys/{fp}", {"expirationTimeUsec": str(10**18)},
         {"updateMask": "expirationTimeUsec"})
    call("DELETE", f"{user}/sshPublicKeys/{fp}")
    call("DELETE", f"{user}/projects/{P}")
    # --- Compute Engine
    sweep_compute(call)
    return call


def sweep_compute(call: Sweep) -> None:  # noqa: PLR0915 - one user's session, in order
    emu = call.emu
    zone, region = f"{CE}/zones/{Z}", f"{CE}/regions/{REGION}"
    done = lambda op: op.get("status") == "DONE"  # noqa: E731

    def wait_op(op: dict) -> dict:
        scope = f"{zone}/operations" if "zone" in op else f"{region}/operations" if \
            "region" in op else f"{CE}/global/operations"
        call.wait(lambda: done(call("GET", f"{scope}/{op['name']}")), op["name"])
        return call("POST", f"{scope}/{op['name']}/wait", {})

    project = call("GET", CE)
    call("POST", f"{CE}/setCommonInstanceMetadata", {
        "fingerprint": project["commonInstanceMetadata"]["fingerprint"],
        "items": [{"key": "ssh-keys", "value": f"alice:{KEY}"}]})
    call("POST", f"{CE}/setCommonInstanceMetadata", {"fingerprint": "stale", "items": []},
         ok=False)
    for path in ("zones", f"zones/{Z}", "regions", f"regions/{REGION}", f"zones/{Z}/machineTypes",
                 f"zones/{Z}/machineTypes/tpu7x-standard-4t", "aggregated/machineTypes",
                 f"zones/{Z}/acceleratorTypes", f"zones/{Z}/acceleratorTypes/tpu7x",
                 "aggregated/acceleratorTypes", "global/images/tpu-vm",
                 "global/images/family/tpu-ubuntu2204", "global/networks/default",
                 f"zones/{Z}/autoscalers", "aggregated/autoscalers"):
        call("GET", f"{CE}/{path}")
    call("GET", f"{CE}/zones", query={"filter": 'region eq ".*\\bus\\-central2\\b.*"',
                                      "maxResults": "1"})
    # instances: a standalone TPU VM, its actions, a filtered list
    vm = {"name": "vm1", "machineType": f"zones/{Z}/machineTypes/tpu7x-standard-4t",
          "labels": {"team": "infra"}, "networkInterfaces": [{"accessConfigs": [{}]}],
          "serviceAccounts": [{"email": "default",
                               "scopes": ["https://www.googleapis.com/auth/cloud-platform"]}],
          "scheduling": {"provisioningModel": "SPOT"},
          "metadata": {"items": [{"key": "startup-script", "value": "echo hi"}]}}
    wait_op(call("POST", f"{zone}/instances", vm))
    call("POST", f"{zone}/instances", {**vm, "name": "vm2", "labels": {}})
    call("POST", f"{zone}/instances", vm, ok=False)  # already exists
    call("POST", f"{zone}/instances", {**vm, "name": "vm3",
                                       "machineType": "zones/z/machineTypes/nope-1t"}, ok=False)
    # a general-purpose VM (the supervisor's kind: sshd, metadata, no TPU), reset
    wait_op(call("POST", f"{zone}/instances", {
        "name": "gp1", "machineType": f"zones/{Z}/machineTypes/e2-small",
        "networkInterfaces": [{"accessConfigs": [{}]}], "serviceAccounts": vm["serviceAccounts"],
        "disks": [{"boot": True, "autoDelete": True, "initializeParams": {
            "sourceImage": "projects/debian-cloud/global/images/family/debian-12",
            "diskSizeGb": "10"}}]}))
    call("GET", f"{zone}/instances/gp1")
    call("GET", f"{zone}/machineTypes/e2-small")
    wait_op(call("POST", f"{zone}/instances/gp1/reset", {}))
    one = f"{zone}/instances/vm1"
    inst = call("GET", one)
    call("GET", f"{zone}/instances", query={"filter": "labels.team = infra"})
    call("GET", f"{zone}/instances", query={"maxResults": "1"})
    call("GET", f"{CE}/aggregated/instances", query={"filter": "name eq vm.*"})
    wait_op(call("POST", f"{one}/setMetadata", {"fingerprint": inst["metadata"]["fingerprint"],
                                                "items": [{"key": "a", "value": "b"}]}))
    wait_op(call("POST", f"{one}/setLabels", {"labels": {"x": "y"}}))
    wait_op(call("POST", f"{one}/start", {}))  # running already: a DONE operation
    wait_op(call("POST", f"{one}/reset", {}))
    wait_op(call("POST", f"{one}/simulateMaintenanceEvent", {}))
    call.wait(lambda: emu.store.node(f"projects/{P}/locations/{Z}/ceInstances/vm1")["sim"]
              .get("hostKeys"), "host keys")
    call("GET", f"{one}/getGuestAttributes", query={"queryPath": "hostkeys/"})
    call("GET", f"{one}/serialPort", query={"port": "1"})
    wait_op(call("POST", f"{one}/stop", {}))
    wait_op(call("POST", f"{one}/stop", {}))  # stopped already
    wait_op(call("POST", f"{one}/start", {}))
    call("GET", f"{zone}/instances/none", ok=False)
    call("POST", f"{zone}/instances/vm1/nope", {}, ok=False)
    call("PATCH", one, {}, ok=False)
    # a failed insert (an injected quota failure): a DONE operation with QUOTA_EXCEEDED, no VM
    emu.store.arm_create_failure({"reason": "quota"})
    failed = wait_op(call("POST", f"{zone}/instances", {**vm, "name": "vmq"}))
    assert failed["error"]["errors"][0]["code"] == "QUOTA_EXCEEDED", failed
    call("GET", f"{zone}/instances/vmq", ok=False)
    # policies, templates, reservations, MIGs
    wait_op(call("POST", f"{region}/resourcePolicies", {
        "name": "wp", "workloadPolicy": {"type": "HIGH_THROUGHPUT",
                                         "acceleratorTopology": "2x2x2"}}))
    wait_op(call("POST", f"{CE}/global/instanceTemplates", {
        "name": "tt", "properties": {"machineType": "tpu7x-standard-4t"}}))
    wait_op(call("POST", f"{CE}/global/instanceTemplates", {
        "name": "flex", "properties": {"machineType": "tpu7x-standard-4t", "scheduling": {
            "provisioningModel": "FLEX_START", "instanceTerminationAction": "DELETE",
            "maxRunDuration": {"seconds": "3600"}}}}))
    wait_op(call("POST", f"{zone}/reservations", {"name": "res", "specificReservation": {
        "count": "1", "instanceProperties": {"machineType": "tpu7x-standard-4t"}}}))
    mig = {"name": "mig", "instanceTemplate": "global/instanceTemplates/tt", "targetSize": 2,
           "resourcePolicies": {"workloadPolicy": f"regions/{REGION}/resourcePolicies/wp"}}
    wait_op(call("POST", f"{zone}/instanceGroupManagers", mig))
    wait_op(call("POST", f"{zone}/instanceGroupManagers", {
        "name": "free", "instanceTemplate": "global/instanceTemplates/tt", "targetSize": 1}))
    igm = f"{zone}/instanceGroupManagers/mig"
    members = call("POST", f"{igm}/listManagedInstances", {})["managedInstances"]
    for path in (f"regions/{REGION}/resourcePolicies", f"regions/{REGION}/resourcePolicies/wp",
                 "global/instanceTemplates", "global/instanceTemplates/tt",
                 f"zones/{Z}/reservations", f"zones/{Z}/reservations/res",
                 f"zones/{Z}/instanceGroupManagers", f"zones/{Z}/instanceGroupManagers/mig",
                 f"zones/{Z}/instanceGroups", f"zones/{Z}/instanceGroups/mig",
                 "aggregated/instanceGroupManagers", "aggregated/instanceGroups",
                 "aggregated/instanceTemplates", "aggregated/resourcePolicies",
                 "aggregated/reservations", "aggregated/operations", "aggregated/instances",
                 f"zones/{Z}/operations", f"regions/{REGION}/operations", "global/operations",
                 f"zones/{Z}/instanceGroupManagers/mig/listErrors"):
        call("GET", f"{CE}/{path}")
    call("GET", f"{zone}/instances/{members[0]['name']}")
    call("POST", f"{zone}/instanceGroups/mig/listInstances", {})
    wait_op(call("POST", f"{igm}/updatePerInstanceConfigs", {"perInstanceConfigs": [
        {"name": members[0]["name"], "preservedState": {"metadata": {"tpufab-worker": "0"}}}]}))
    call("POST", f"{igm}/listPerInstanceConfigs", {})
    wait_op(call("POST", f"{igm}/recreateInstances", {"instances": [members[0]["instance"]]}))
    wait_op(call("POST", f"{igm}/resize", {}, {"size": "0"}))
    wait_op(call("POST", f"{igm}/createInstances", {"instances": [{"name": "mig-a"},
                                                                  {"name": "mig-b"}]}))
    call("POST", f"{igm}/resize", {}, {"size": "3"}, ok=False)  # a slice: 0 or its size
    wait_op(call("POST", f"{igm}/resize", {}, {"size": "0"}))
    # the flex-start path: a resize request for the whole slice
    wait_op(call("POST", f"{igm}/resizeRequests", {"name": "rr", "resizeBy": 2,
                                                    "requestedRunDuration": {"seconds": "600"}}))
    call.wait(lambda: call("GET", f"{igm}/resizeRequests/rr")["state"] == "SUCCEEDED", "rr")
    call("GET", f"{igm}/resizeRequests")
    call("POST", f"{igm}/resizeRequests/rr/cancel", {}, ok=False)  # succeeded: not cancelled
    wait_op(call("DELETE", f"{igm}/resizeRequests/rr"))
    wait_op(call("POST", f"{igm}/resize", {}, {"size": "0"}))
    emu.settings.create_delay = 30  # the VMs take their time: the request can be cancelled
    call("POST", f"{igm}/resizeRequests", {"name": "rr2", "resizeBy": 2})
    assert call("GET", f"{igm}/resizeRequests/rr2")["state"] in ("ACCEPTED", "CREATING")
    wait_op(call("POST", f"{igm}/resizeRequests/rr2/cancel", {}))
    assert call("GET", f"{igm}/resizeRequests/rr2")["state"] == "CANCELLED"
    emu.settings.create_delay = 0
    # a MIG the zone has no capacity for: listErrors says why
    emu.store.arm_create_failure({"reason": "stockout", "vms": 1})
    wait_op(call("POST", f"{zone}/instanceGroupManagers", {**mig, "name": "short"}))
    errors = call("GET", f"{zone}/instanceGroupManagers/short/listErrors")["items"]
    assert errors and errors[0]["error"]["code"] == "ZONE_RESOURCE_POOL_EXHAUSTED", errors
    call("DELETE", f"{CE}/global/instanceTemplates/tt", ok=False)  # in use
    call("GET", f"{zone}/instanceGroupManagers/none", ok=False)
    for name in ("mig", "free", "short"):
        wait_op(call("DELETE", f"{zone}/instanceGroupManagers/{name}"))
    for path in ("global/instanceTemplates/tt", "global/instanceTemplates/flex",
                 f"regions/{REGION}/resourcePolicies/wp", f"zones/{Z}/reservations/res",
                 f"zones/{Z}/instances/vm1", f"zones/{Z}/instances/vm2"):
        wait_op(call("DELETE", f"{CE}/{path}"))
    for scope in (f"zones/{Z}", f"regions/{REGION}", "global"):
        name = call("GET", f"{CE}/{scope}/operations")["items"][0]["name"]
        call("DELETE", f"{CE}/{scope}/operations/{name}")
    call("GET", f"{CE}/zones/{Z}/instances", query={"filter": "name = ("}, ok=False)
    # a batch as gcloud sends one (two gets, one of a VM that is gone), parsed as apitools does
    parts = call.batch([("GET", f"{zone}/machineTypes/tpu7x-standard-4t"),
                        ("GET", f"{zone}/instances/vm1")])
    assert [code for code, _ in parts] == [200, 404], parts


def batch_body(requests: list[tuple[str, str]]) -> tuple[str, bytes]:
    """A multipart/mixed batch as apitools' BatchHttpRequest writes it."""
    boundary = "===============7330845974216740156=="
    out = []
    for i, (method, path) in enumerate(requests, 1):
        out.append(f"--{boundary}\nContent-Type: application/http\nMIME-Version: 1.0\n"
                   f"Content-Transfer-Encoding: binary\nContent-ID: <a1b2c3+{i}>\n\n"
                   f"{method} {path}?alt=json HTTP/1.1\nContent-Type: application/json\n"
                   "MIME-Version: 1.0\ncontent-length: 0\nHost: 127.0.0.1\n\n\n")
    return f'multipart/mixed; boundary="{boundary}"', \
        ("".join(out) + f"--{boundary}--\n").encode()


@pytest.fixture(scope="module")
def sweep(tmp_path_factory) -> Sweep:
    emu = Emulator(tmp_path_factory.mktemp("conformance"), PaperWorkers(),
                   settings=SimSettings(create_delay=0, worker_start_delay=0, operation_delay=0,
                                        maintenance_notice=0))
    try:
        yield run_sweep(emu)
    finally:
        emu.shutdown()


# ---------------------------------------------------------------------- the checks


def test_every_served_method_is_swept(sweep):
    swept = set(sweep.emu.compute.methods_served())
    assert swept == {r.name for r in ROUTES}, \
        f"Compute Engine methods the sweep never called: {sorted({r.name for r in ROUTES} - swept)}"
    tpu = {k.split(" ", 1)[1] for k in sweep.emu.served}
    assert len(tpu) >= 22, sorted(tpu)  # every TPU API method of the router (v1 aside)


def test_answers_parse_in_googles_protos_with_their_fields(sweep):
    found, answers, fields = violations(sweep.answers)
    print(f"\nconformance: {answers} answers, {fields} fields, {len(found)} violations")
    assert not found, "\n".join(found[:40])


def test_the_sweep_sees_what_a_user_sees(sweep):
    """A few answers a user reads, as data: a v2alpha1 multislice read through v2 is v2's
    multisliceParams; a v2 node through v2alpha1 has an apiVersion of v2alpha1's enum;
    the Python client's filtered list holds what the filter says."""
    by = {(a.method, a.path.split("?")[0]): a.body for a in sweep.answers if a.code == 200}
    q2 = by[("GET", f"/v2/projects/{P}/locations/{Z}/queuedResources/q2")]
    spec = q2["tpu"]["nodeSpec"][0]
    assert spec["multisliceParams"] == {"nodeCount": 2, "nodeIdPrefix": "ms"} and \
        "multiNodeParams" not in spec
    alpha = by[("GET", f"/v2alpha1/projects/{P}/locations/{Z}/queuedResources/q1")]
    assert "multisliceParams" not in json.dumps(alpha)
    node = by[("GET", f"/v2alpha1/projects/{P}/locations/{Z}/nodes/n2")]
    assert node["apiVersion"] == "V2_ALPHA1"
    member = next(a.body for a in sweep.answers if a.code == 200 and a.method == "GET" and
                  a.path.startswith(f"{CE}/zones/{Z}/instances/mig-"))
    assert set(member["resourceStatus"]["physicalHostTopology"]) == {
        "cluster", "block", "subblock", "host"}  # a VM of a HIGH_THROUGHPUT MIG
    vm1 = by[("GET", f"{CE}/zones/{Z}/instances/vm1")]
    assert vm1["serviceAccounts"][0]["email"].endswith("-compute@developer.gserviceaccount.com")
    filtered = [a.body for a in sweep.answers if a.path == f"{CE}/zones/{Z}/instances" and
                a.method == "GET" and a.code == 200]
    assert [i["name"] for i in filtered[0]["items"]] == ["vm1"]  # labels.team = infra
    assert len(filtered[1]["items"]) == 1 and filtered[1]["nextPageToken"]  # maxResults 1


# ---------------------------------------------------------------------- gcloud's messages


# Known: gcloud 528's generated compute v1 messages predate a value the Python client 1.57
# already has (Scheduling.provisioningModel FLEX_START, which a flex-start template sends and
# the emulator echoes): gcloud counts it an unknown field.
GCLOUD_OLDER = ("scheduling.provisioningModel",)

GCLOUD_CHECK = r"""
import json, sys
from apitools.base.py import encoding
from googlecloudsdk.generated_clients.apis.compute.v1 import compute_v1_messages as compute
from googlecloudsdk.generated_clients.apis.tpu.v2 import tpu_v2_messages as v2
from googlecloudsdk.generated_clients.apis.tpu.v2alpha1 import tpu_v2alpha1_messages as v2a
from googlecloudsdk.generated_clients.apis.tpu.v1 import tpu_v1_messages as v1
MODULES = {"compute": compute, "tpu-v2": v2, "tpu-v2alpha1": v2a, "tpu-v1": v1}
NAMES = {"location.Location": "Location", "location.ListLocationsResponse":
         "ListLocationsResponse"}

def unknown(message, path=""):
    out = [path + name for name in message.all_unrecognized_fields()]
    for f in message.all_fields():
        value = message.get_assigned_value(f.name)
        for item in (value if f.repeated and value is not None else [value]):
            if hasattr(item, "all_unrecognized_fields"):
                out += unknown(item, f"{path}{f.name}.")
    return out

found, checked = [], 0
for api, name, body in json.load(sys.stdin):
    module = MODULES.get(api)
    cls = getattr(module, NAMES.get(name, name), None) if module else None
    if cls is None:
        continue
    checked += 1
    try:
        message = encoding.JsonToMessage(cls, json.dumps(body))
    except Exception as err:
        found.append(f"{api} {name}: {type(err).__name__}: {err}")
        continue
    found += [f"{api} {name}: unknown field {p}" for p in unknown(message)]
print(json.dumps({"found": found, "checked": checked}))
"""


def gcloud_python() -> list[str]:
    bundled = GCLOUD_LIB.parent / "platform" / "bundledpythonunix" / "bin" / "python3"
    return [str(bundled) if bundled.exists() else shutil.which("python3") or sys.executable]


@pytest.mark.gcloud
def test_answers_decode_in_gclouds_generated_messages(sweep):
    if not (GCLOUD_LIB / "googlecloudsdk").is_dir():
        pytest.skip(f"gcloud's library is not at {GCLOUD_LIB}")
    payload = [(a.api, a.message, a.body) for a in sweep.answers
               if a.code == 200 and a.api != "oslogin" and a.message not in ("Empty", "?")]
    env = {"PATH": os.environ.get("PATH", ""), "PYTHONPATH":
           f"{GCLOUD_LIB}:{GCLOUD_LIB / 'third_party'}", "CLOUDSDK_CORE_DISABLE_PROMPTS": "1"}
    done = subprocess.run([*gcloud_python(), "-c", GCLOUD_CHECK], input=json.dumps(payload),
                          capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    new = [f for f in result["found"] if not any(k in f for k in GCLOUD_OLDER)]
    print(f"\ngcloud messages: {result['checked']} answers, {len(result['found'])} violations "
          f"({len(result['found']) - len(new)} known)")
    assert result["checked"] > 150 and not new, "\n".join(new[:40])


@pytest.mark.gcloud
def test_routes_are_gclouds_compute_methods():
    """Each route's method, path and response type are those of gcloud's generated Compute
    Engine v1 client for its method id (the API's discovery document)."""
    client = GCLOUD_LIB / "googlecloudsdk/generated_clients/apis/compute/v1/compute_v1_client.py"
    if not client.exists():
        pytest.skip(f"gcloud's generated client is not at {client}")
    configs = {m[2]: (m[1], m[3], m[4]) for m in re.finditer(
        r"http_method='(\w+)',\s*method_id='([\w.]+)',.*?relative_path='([^']*)',"
        r".*?response_type_name='(\w+)'", client.read_text(), re.S)}
    shape = lambda path: re.sub(r"\{[^}]+\}", "{}", path)  # noqa: E731
    wrong = [(r.name, r.method, r.pattern, r.returns, configs.get(r.name)) for r in ROUTES
             if r.name not in configs or configs[r.name][0] != r.method or
             shape(configs[r.name][1].removeprefix("projects/{project}").lstrip("/")) !=
             shape(r.pattern) or configs[r.name][2] != r.returns]
    assert not wrong, wrong
