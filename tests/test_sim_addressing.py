"""Worker addresses and node slots of the simulated pod (pure, plus the slot registry file)."""

import ipaddress
import json

import pytest

from tpufab.sim._model import worker_address
from tpufab.sim._slots import MAX_SLOT, SlotRegistry, node_slots, slots_for
from tpufab.topology import all_accelerator_types, parse_accelerator_type


@pytest.mark.parametrize(("hosts", "slots"), [(1, 1), (64, 1), (254, 1), (255, 2), (256, 2),
                                               (512, 3), (1024, 5), (1536, 7)])
def test_slots_for(hosts, slots):
    assert slots_for(hosts) == slots


def test_small_nodes_keep_their_addresses():
    assert worker_address(1, 0) == "127.16.1.1"
    assert worker_address(1, 253) == "127.16.1.254"
    assert worker_address(300, 3) == "127.17.44.4"


def test_a_big_node_spills_into_its_next_slots():
    assert worker_address(1, 254) == "127.16.2.1"
    assert worker_address(255, 254) == "127.17.0.1"  # across the second octet
    assert worker_address(1, 1535) == "127.16.7.12"


@pytest.mark.parametrize("type_name", ["v4-4096", "v5p-12288"])
def test_every_worker_of_the_biggest_types_has_its_own_loopback_address(type_name):
    hosts = parse_accelerator_type(type_name).hosts
    first = MAX_SLOT - slots_for(hosts) + 1  # the last slots a node can get
    for slot in (1, first):
        addresses = [worker_address(slot, w) for w in range(hosts)]
        assert len(set(addresses)) == hosts
        for address in addresses:
            assert ipaddress.ip_address(address).is_loopback
            octets = [int(o) for o in address.split(".")]
            assert 16 <= octets[1] <= 255 and 1 <= octets[3] <= 254
        # the node's range ends in its own last slot: no address of the next node's first slot
        assert worker_address(slot, hosts - 1).rsplit(".", 1)[0] == \
            worker_address(slot + slots_for(hosts) - 1, 0).rsplit(".", 1)[0]


def test_every_type_fits_the_address_space():
    biggest = max(parse_accelerator_type(t).hosts for t in all_accelerator_types())
    assert biggest == 1536
    assert slots_for(biggest) * 254 >= biggest


def _state(tmp_path, name, nodes):
    """A pod's state dir whose api-state.json lists nodes {slot: hosts}."""
    state_dir = tmp_path / name
    state_dir.mkdir()
    records = {f"n{slot}": {"node": {"networkEndpoints": [{}] * hosts}, "sim": {"slot": slot}}
               for slot, hosts in nodes.items()}
    (state_dir / "api-state.json").write_text(json.dumps({"nodes": records}))
    return state_dir


def test_claims_are_runs_of_consecutive_free_slots(tmp_path):
    path = tmp_path / "slots.json"
    mine = SlotRegistry(_state(tmp_path, "a", {}), path)
    assert mine.claim(set(), 1) == 1
    assert mine.claim({1}, 3) == 2  # 2, 3, 4
    assert mine.claim({1, 2, 3, 4}, 1) == 5
    other = SlotRegistry(_state(tmp_path, "b", {}), path)
    assert other.claim(set(), 2) == 6  # 1-5 are fresh claims of pod a
    mine.release(2, 3)
    assert other.claim({6, 7}, 4) == 8  # 2-4 are free again, but only three of them
    assert other.claim({6, 7, 8, 9, 10, 11}, 3) == 2


def test_another_pods_big_node_holds_every_slot_it_covers(tmp_path):
    path = tmp_path / "slots.json"
    # pod b's claim is old (not fresh), but its state still lists a 600-worker node on 1-3
    holder = _state(tmp_path, "b", {1: 600})
    path.write_text(json.dumps({str(s): {"owner": str(holder.resolve()), "at": 0}
                                for s in (1, 2, 3)}))
    mine = SlotRegistry(_state(tmp_path, "a", {}), path)
    assert mine.claim(set(), 1) == 4
    assert not mine.reclaim(3, 1)
    (holder / "api-state.json").write_text(json.dumps({"nodes": {}}))  # b deleted it
    assert mine.reclaim(1, 3)


def test_node_slots_of_a_record():
    record = {"node": {"networkEndpoints": [{}] * 1024}, "sim": {"slot": 10}}
    assert node_slots(record) == range(10, 15)
