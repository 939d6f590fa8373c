"""Pure pieces of the simulated pod and of what tpufab shows of processes, as data: Compute
Engine's list filter and paging (tpufab/sim/compute_filter.py), the batch format gcloud
sends (compute_engine.py), a process's command line as a person names it
(tpufab/term/commands.py)."""

from __future__ import annotations

import pytest

from tpufab.sim.compute_filter import FilterError, page, parse
from tpufab.term.commands import short_command

VMS = [
    {"name": "vm-a", "status": "RUNNING", "labels": {"team": "infra"},
     "zone": "https://compute.googleapis.com/compute/v1/projects/p/zones/us-central2-b",
     "scheduling": {"automaticRestart": False, "provisioningModel": "SPOT"},
     "networkInterfaces": [{"networkIP": "10.0.0.2"}], "id": "17"},
    {"name": "vm-b", "status": "TERMINATED", "labels": {"team": "ml"},
     "zone": "https://compute.googleapis.com/compute/v1/projects/p/zones/europe-west4-a",
     "scheduling": {"automaticRestart": True}, "networkInterfaces": [{"networkIP": "10.0.0.3"}],
     "id": "200"},
    {"name": "node-c", "status": "RUNNING", "zone": ".../zones/us-central2-b", "id": "5"},
]


@pytest.mark.parametrize(("text", "names"), [
    ("", ["vm-a", "vm-b", "node-c"]),
    ("name = vm-a", ["vm-a"]),
    ("name != vm-a", ["vm-b", "node-c"]),
    ('name = "vm-*"', ["vm-a", "vm-b"]),
    ("name : vm", ["vm-a", "vm-b"]),
    ("labels.team = infra", ["vm-a"]),
    ("labels.team:*", ["vm-a", "vm-b"]),
    ("-labels.team:*", ["node-c"]),
    ("NOT labels.team:*", ["node-c"]),
    ("scheduling.automaticRestart = false", ["vm-a"]),
    ("zone = us-central2-b", ["vm-a", "node-c"]),  # a URL matches by its last segment
    ("networkInterfaces.networkIP = 10.0.0.3", ["vm-b"]),  # repeated fields fan out
    ("id > 10", ["vm-a", "vm-b"]),
    ("(status = RUNNING) (name : vm)", ["vm-a"]),  # juxtaposition is AND
    ("status = RUNNING AND name : node", ["node-c"]),
    # OR binds tighter than AND (AIP-160): a AND (b OR c)
    ("status = RUNNING AND name = vm-b OR name = node-c", ["node-c"]),
    ("status eq RUNNING", ["vm-a", "node-c"]),  # gcloud's regular-expression form
    ('region eq ".*\\bus\\-central2\\b.*"', []),  # no region field: empty, no match
    ('zone eq ".*\\bus\\-central2\\-b\\b.*"', ["vm-a", "node-c"]),
    ("name ne vm-.*", ["node-c"]),  # the whole value must match
    ("(name eq vm-.*) (status ne TERMINATED)", ["vm-a"]),
])
def test_compute_filters_keep_what_they_say(text, names):
    keep = parse(text)
    assert [vm["name"] for vm in VMS if keep(vm)] == names


@pytest.mark.parametrize("text", ["name =", "(name = a", "name ~ a", "name eq (", "= a"])
def test_a_malformed_filter_is_refused(text):
    with pytest.raises(FilterError, match="filter|regular expression"):
        parse(text)(VMS[0])


def test_pages_follow_max_results_and_page_tokens():
    items = list(range(7))
    first, token = page(items, {"maxResults": "3"})
    second, token2 = page(items, {"maxResults": "3", "pageToken": token})
    last, end = page(items, {"maxResults": "3", "pageToken": token2})
    assert (first, second, last, end) == ([0, 1, 2], [3, 4, 5], [6], "")
    assert page(list(range(600)), {})[1] == "500"  # the API's cap of 500 a page


@pytest.mark.parametrize(("command", "shown"), [
    ("python3 train.py", "python3 train.py"),  # short: as it is
    ("/usr/bin/python3 -u /home/alice/climate/recipes/train_the_model_now.py --lr 3e-4 "
     "--batch 1024 --steps 10000", "python3 train_the_model_now.py"),
    ("python3 -I -S -c L='import os\nimport sys\nimport types\ntry: ...' 1 " + "a" * 64 +
     " /home/tpufab/.cache/tpufab/remote/abc/tpukill.py --grace 5", "python3 tpukill.py"),
    ("python3 -c 'import jax\nprint(jax.devices())'", "python3 -c ..."),  # several lines
    ("/opt/conda/bin/python3.11 -X importtime -m torch.distributed.run --nproc 8 " + "x" * 60,
     "python3.11 -m torch.distributed.run"),
    ("bash /home/alice/.cache/tpufab/remote/0123456789abcdef/setup_runner.sh --log /tmp/a/b",
     "bash setup_runner.sh"),
    ("/usr/local/bin/ray-dashboard-agent --config /etc/ray/a/very/long/path.yaml --verbose",
     "ray-dashboard-agent"),
])
def test_a_long_command_line_shows_as_what_names_it(command, shown):
    assert short_command(command) == shown


def test_a_command_is_cut_to_the_width_asked():
    assert short_command("x" * 100, width=20) == "x" * 17 + "..."
