"""Worker addresses and node slots of the simulated pod (pure, plus the slot registry file)."""

import ipaddress
import json

import pytest

from tpufab.sim._model import worker_address
from tpufab.sim._slots import FRESH, MAX_SLOT, SlotRegistry, node_slots, slots_for
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
    biggest = max(parse_accelerator_type(t).hosts for t in all_accelerator_types("tpu"))
    assert biggest == 1536  # v5p-12288
    largest = max(parse_accelerator_type(t).hosts for t in all_accelerator_types())
    assert largest == 2304  # tpu7x-18432, on Compute Engine
    assert slots_for(largest) * 254 >= largest


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
    assert mine.claim({1, 5}, 1) == 2    # free again for pod a at once
    mine.release(2, 1)
    assert other.claim({6, 7}, 3) == 8   # for pod b only once a's claims are no longer fresh
    table = json.loads(path.read_text())
    for slot in ("2", "3", "4"):
        table[slot]["at"] -= FRESH
    path.write_text(json.dumps(table))
    assert other.claim({6, 7, 8, 9, 10}, 4) == 11  # 2-4 are free, but only three of them
    assert other.claim({6, 7, 8, 9, 10, 11, 12, 13, 14}, 3) == 2


def test_a_node_made_again_under_its_name_gets_its_old_slots_back(tmp_path):
    """The simulated pod prefers a deleted node's slots for the next node of its name (its
    addresses and its bastion's stay), and another pod cannot take them meanwhile."""
    path = tmp_path / "slots.json"
    mine = SlotRegistry(_state(tmp_path, "a", {}), path)
    other = SlotRegistry(_state(tmp_path, "b", {}), path)
    assert [mine.claim(set(range(1, s)), 1) for s in (1, 2, 3)] == [1, 2, 3]
    mine.release(1, 1)
    mine.release(3, 1)                        # the node on 3 is recreated...
    assert other.claim(set(), 1) == 4         # ...while another pod makes one: not 1 or 3
    assert mine.claim({2}, 1, prefer=3) == 3  # ...and gets 3 back, not the lower free 1
    assert mine.claim({2, 3}, 1, prefer=4) == 1   # a preferred slot taken: the lowest free


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
