"""The simulated pod says, before starting anything, when a node is bigger than the machine."""

import json

import pytest

from tpufab.sim import capacity
from tpufab.sim._fakepool import PaperWorkers
from tpufab.sim.emulator import Emulator

GIB = 1024 * 1024  # KiB


def test_too_little_memory_is_one_sentence_with_the_figures():
    problem = capacity.capacity_problem("v5p-12288", 1536, available_kib=int(11.2 * GIB),
                                        free_processes=30000, fd_limit=1 << 20)
    assert problem == (
        "v5p-12288 needs 1,536 simulated workers x 9.6 MiB = 14.4 GiB (each idle 2.6 MiB, "
        "plus 7 MiB while a verb runs on it); this machine has 11.2 GiB available: use a "
        "smaller type or free memory.")


def test_enough_of_everything_is_no_problem():
    assert capacity.capacity_problem("v5p-12288", 1536, available_kib=20 * GIB,
                                     free_processes=30000, fd_limit=20000) is None
    # unknown figures are not held against the request
    assert capacity.capacity_problem("v4-8", 1, available_kib=None, free_processes=None,
                                     fd_limit=None) is None


def test_too_few_process_ids_says_how_to_raise_pid_max():
    problem = capacity.capacity_problem("v4-4096", 512, available_kib=20 * GIB,
                                        free_processes=2000, fd_limit=1 << 20)
    assert "3,072 processes" in problem and "room for 2,000 more" in problem
    assert "sysctl -w kernel.pid_max=" in problem and problem.endswith(".")


def test_too_few_file_descriptors_says_how_to_raise_them():
    problem = capacity.capacity_problem("v5p-8192", 1024, available_kib=20 * GIB,
                                        free_processes=30000, fd_limit=1024)
    assert "1,280 open files" in problem and "limit is 1,024" in problem
    assert "ulimit -Hn" in problem


def test_live_figures_are_read_from_this_machine():
    assert capacity.mem_available_kib() > 0
    assert capacity.processes_free() > 0
    assert capacity.raise_fd_limit() == capacity.fd_limit()


class SmallMachine(PaperWorkers):
    """Paper workers on a machine with 1 GiB available."""

    def capacity_problem(self, what, workers):
        return capacity.capacity_problem(what, workers, available_kib=GIB,
                                         free_processes=None, fd_limit=None)


@pytest.fixture
def small(tmp_path, monkeypatch):
    monkeypatch.setenv("TPUFAB_SIM_SLOTS", str(tmp_path / "slots.json"))
    return Emulator(tmp_path / "state", SmallMachine())


def test_a_node_too_big_is_refused_before_anything_starts(small, tmp_path):
    parent = "/v2/projects/p/locations/us-central2-b"
    code, body = small.handle("POST", f"{parent}/nodes", {"nodeId": "big"},
                              {"acceleratorType": "v4-2048", "runtimeVersion": "r"})
    assert code == 400
    assert body["error"]["status"] == "FAILED_PRECONDITION"
    assert body["error"]["message"].startswith(
        "v4-2048 needs 256 simulated workers x 9.6 MiB = 2.4 GiB")
    assert "this machine has 1.0 GiB available" in body["error"]["message"]
    assert small.workers.calls == []  # nothing started
    assert small.handle("GET", f"{parent}/nodes", {}, None)[1].get("nodes", []) == []
    slots = tmp_path / "slots.json"
    assert not slots.exists() or json.loads(slots.read_text()) == {}  # no address claimed
    # a small one still fits
    code, _ = small.handle("POST", f"{parent}/nodes", {"nodeId": "ok"},
                           {"acceleratorType": "v4-32", "runtimeVersion": "r"})
    assert code == 200


def test_multislice_counts_every_slice(small):
    parent = "/v2/projects/p/locations/us-central2-b"
    code, body = small.handle(
        "POST", f"{parent}/queuedResources", {"queuedResourceId": "qr"},
        {"tpu": {"nodeSpec": [{"parent": parent[4:], "node": {
            "acceleratorType": "v4-512", "runtimeVersion": "r"},
            "multisliceParams": {"nodeCount": 2, "nodeIdPrefix": "s"}}]}})
    assert code == 400
    assert body["error"]["message"].startswith(
        "2 slices of v4-512 needs 128 simulated workers x 9.6 MiB = 1.2 GiB")


def test_tpufab_create_says_it_in_one_sentence(small, tmp_path):
    """Through the real command, as a user sees it (an emulator whose machine has 1 GiB)."""
    import threading

    from helpers import one_sentence, tpufab

    from tpufab.sim.emulator import make_server

    server = make_server(small, 0)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05},
                              daemon=True)
    thread.start()
    try:
        env = {k: v for k, v in __import__("os").environ.items() if not k.startswith("TPUFAB_")}
        env.update(HOME=str(tmp_path), TPUFAB_USER_CONFIG=str(tmp_path / "none.yaml"),
                   TPUFAB_API_ENDPOINT=f"http://127.0.0.1:{server.server_address[1]}",
                   TPUFAB_PROJECT="p", TPUFAB_ZONE="us-central2-b",
                   TPUFAB_SSH_KEY=str(tmp_path / "key"), TPUFAB_API_RETRIES="1")
        result = tpufab("create", "--name", "big", "--type", "v5p-12288", env=env,
                        cwd=tmp_path, timeout=120)
        line = one_sentence(result, "v5p-12288 needs 1,536 simulated workers x 9.6 MiB = "
                            "14.4 GiB", "this machine has 1.0 GiB available: use a smaller "
                            "type or free memory")
        assert "big" in line
    finally:
        server.shutdown()
        server.server_close()


def test_the_largest_tpu7x_slice_is_refused_with_the_figure_and_nothing_left(small, tmp_path):
    """tpu7x-18432 (144 cubes, 2,304 VMs) through `tpufab create` on Compute Engine: the
    emulator refuses the MIG before any VM starts; tpufab removes the workload policy and
    instance template it made and says so in one sentence."""
    import os
    import threading

    from helpers import one_sentence, tpufab

    from tpufab.sim.emulator import make_server

    server = make_server(small, 0)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05},
                              daemon=True)
    thread.start()
    try:
        env = {k: v for k, v in os.environ.items() if not k.startswith("TPUFAB_")}
        env.update(HOME=str(tmp_path), TPUFAB_USER_CONFIG=str(tmp_path / "none.yaml"),
                   TPUFAB_API_ENDPOINT=f"http://127.0.0.1:{server.server_address[1]}",
                   TPUFAB_PROJECT="p", TPUFAB_ZONE="us-central1-c",
                   TPUFAB_SSH_KEY=str(tmp_path / "key"), TPUFAB_API_RETRIES="1")
        result = tpufab("create", "--name", "huge", "--type", "tpu7x-18432", env=env,
                        cwd=tmp_path, timeout=300)
        line = one_sentence(result, "tpu7x-18432 needs 2,304 simulated workers x 9.6 MiB = "
                            "21.6 GiB", "this machine has 1.0 GiB available")
        assert "huge" in line
    finally:
        server.shutdown()
        server.server_close()
    assert small.workers.calls == []  # no worker started
    state = small.store.data.get("compute") or {}
    for kind in ("instances", "groups", "templates", "policies"):
        assert not state.get(kind), (kind, state.get(kind))
    assert small.store.nodes == {}
