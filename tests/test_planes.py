"""Control planes by registry (issue 36): a plane is one module of tpufab/cloud/planes/ and one
entry of its registry. A third plane, made here in the test and registered, takes create,
describe, list and delete without any other edit; and no module outside tpufab/cloud/planes/
(and topology.py, which says which plane offers which accelerator type) branches on a plane's
name, so there is nothing else to edit."""

from __future__ import annotations

import ast
import io
from pathlib import Path

import pytest
from rich.console import Console

from tpufab.cloud import planes
from tpufab.cloud.nodes import Node, QueuedResourceInfo, WorkerEndpoint
from tpufab.cloud.planes.base import ControlPlane
from tpufab.config import load_settings
from tpufab.errors import ConfigError, NotFound

PACKAGE = Path(__file__).resolve().parents[1] / "tpufab"
ALLOWED = ("cloud/planes/", "topology.py", "sim/")   # the planes, the type table, the emulators


class Ledger(ControlPlane):
    """A third control plane, as small as the base allows: v4 nodes kept in a dict."""

    name = "ledger"
    aliases = ("book",)
    title = full_title = "Ledger"
    node_kind = "Ledger node"
    books: dict[str, Node] = {}   # every instance of the plane sees the same nodes

    @classmethod
    def offers(cls, topology):
        return topology.generation == "v4"

    def get_node(self, name):
        if name not in self.books:
            raise NotFound(f"No Ledger node named {name!r}.")
        return self.books[name]

    def list_nodes(self):
        return list(self.books.values())

    def create_pod(self, settings, **how):
        from tpufab.cloud.create import create_nodes

        return create_nodes(self, settings, **how)

    def create_node(self, name, body):
        self.books[name] = self.stamp(Node(
            name, self.project, self.zone, body["accelerator_type"], "READY", id="7",
            workers=[WorkerEndpoint(0, "10.9.0.1", None)], metadata=dict(body["metadata"])))
        return f"ledger/create/{name}"

    def delete_node(self, name):
        self.books.pop(name)
        return f"ledger/delete/{name}"

    def update_metadata(self, name, metadata):
        self.books[name].metadata = dict(metadata)
        return f"ledger/update/{name}"

    def host_keys(self, name, workers=None):
        return {}

    def create_queued_resource(self, name, body):
        raise ConfigError("The Ledger has no queued capacity.")

    def get_queued_resource(self, name) -> QueuedResourceInfo:
        raise NotFound(f"No queued resource named {name!r}: the Ledger has none.")

    def list_queued_resources(self):
        return []

    def delete_queued_resource(self, name, *, force=True):
        raise NotFound(f"No queued resource named {name!r}: the Ledger has none.")

    def operation_done(self, op_name, verb="create", *, kind="node", name=None,
                       accelerator_type=None):
        return True

    def list_operations(self):
        return []

    def zones(self):
        return [self.zone]

    def accelerator_types(self):
        return ["v4-8"]


@pytest.fixture
def ledger(monkeypatch, tmp_path):
    """The Ledger registered, and a user's shell that names no other plane's endpoint (the
    Cloud TPU API and Compute Engine at a closed port: their rivals' checks answer nothing)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path))
    for key, value in {"TPUFAB_PROJECT": "ledger-proj", "TPUFAB_ZONE": "us-central2-b",
                       "TPUFAB_API_ENDPOINT": "http://127.0.0.1:9",
                       "TPUFAB_API_RETRIES": "1"}.items():
        monkeypatch.setenv(key, value)
    planes.PLANES.register(Ledger)
    Ledger.books = {}
    try:
        yield
    finally:
        planes.PLANES.pop(Ledger.name)


def quiet() -> Console:
    return Console(file=io.StringIO(), width=200)


def test_a_third_plane_is_one_module_and_one_registry_line(ledger, monkeypatch):
    """Registered (the one line), the Ledger is chosen by `--on ledger` (or its alias), and
    create, describe, list and delete reach it through the functions the verbs call."""
    from tpufab.pod import pods as api
    from tpufab.views.nodes import nodes_table

    monkeypatch.setenv("TPUFAB_CONTROL_PLANE", "book")
    settings = load_settings({"name": "ledger-pod", "type": "v4-8"})
    assert planes.plane_of(settings) == "ledger"
    made = planes.control_plane(settings)
    assert isinstance(made, Ledger) and {type(r).__name__ for r in made.rivals} == \
        {"TpuApi", "ComputeEngine"}
    [node] = api.create_node(settings, console=quiet())
    assert (node.plane, node.plane_text, node.state) == ("ledger", "Ledger", "READY")
    assert "ssh-ed25519" in Ledger.books["ledger-pod"].metadata["ssh-keys"]   # tpufab's key
    described = api.describe("ledger-pod")
    assert described.to_json()["control_plane"] == "ledger"
    listed = api.list_pods()
    assert [n.name for n in listed.nodes] == ["ledger-pod"]
    shown = quiet()
    shown.print(nodes_table(listed.nodes, shown))
    assert "ON" in shown.file.getvalue() and "Ledger" in shown.file.getvalue()
    assert api.delete("ledger-pod") is True
    assert Ledger.books == {}
    monkeypatch.setenv("TPUFAB_CONTROL_PLANE", "gke")
    with pytest.raises(ConfigError, match="must be tpu, compute or ledger, not 'gke'"):
        planes.plane_of(load_settings({}))


def test_nothing_says_which_plane_then_every_plane_is_asked_the_registered_one_too(ledger):
    settings = load_settings({"name": "x", "type": "v4-8"})
    any_plane = planes.control_plane(settings)
    assert [p.name for p in any_plane.planes] == ["tpu", "compute", "ledger"]
    assert any_plane.maker("v4-8").name == "tpu"      # the first plane that offers the type
    assert any_plane.maker("tpu7x-16").name == "compute"


def test_create_refuses_a_name_another_plane_holds(ledger, monkeypatch):
    """A name is one pod's: the Ledger holds `dup`, so a create of `dup` on the Cloud TPU
    API is refused before any call to it (item 7 of issue 37, on any pair of planes)."""
    from tpufab.cloud import lifecycle

    monkeypatch.setenv("TPUFAB_CONTROL_PLANE", "ledger")
    ledger_settings = load_settings({"name": "dup", "type": "v4-8"})
    lifecycle.create(ledger_settings, console=quiet())
    monkeypatch.setenv("TPUFAB_CONTROL_PLANE", "tpu")
    with pytest.raises(ConfigError) as info:
        lifecycle.create(load_settings({"name": "dup", "type": "v4-8"}), console=quiet())
    assert "'dup' is already a Ledger node in us-central2-b" in str(info.value)
    assert "pick another --name" in str(info.value)


# ---------------------------------------------------------------------------------------------
# nothing outside the planes names one


def plane_words() -> set[str]:
    """Every name, alias and title a registered plane answers to."""
    words = set()
    for plane in planes.PLANES.values():
        words |= {plane.name, *plane.aliases, plane.title, plane.full_title}
    return words - {""}


def _strings(node: ast.AST) -> set[str]:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return {node.value}
    if isinstance(node, ast.Tuple | ast.List | ast.Set):
        return {e.value for e in node.elts if isinstance(e, ast.Constant)
                and isinstance(e.value, str)}
    return set()


def plane_branches(source: str) -> list[str]:
    """Where ``source`` tells planes apart by name: a comparison of something about a plane
    with a plane's name or title, a ``plane=``/``control_plane=`` keyword or ``"plane"``
    key given a plane's name, a ``getattr(x, "plane", NAME)``, an import of one plane's
    module."""
    words = plane_words()
    found = []
    def where(node: ast.AST) -> str:
        return f"line {getattr(node, 'lineno', '?')}: {ast.unparse(node)[:80]}"

    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            named = any(_strings(s) & words for s in sides)
            about = any("plane" in ast.unparse(s) for s in sides if not _strings(s))
            titled = any(_strings(s) & {p.title for p in planes.PLANES.values()} |
                         _strings(s) & {p.full_title for p in planes.PLANES.values()}
                         for s in sides)
            if named and (about or titled):
                found.append(where(node))
        elif isinstance(node, ast.keyword) and node.arg in ("plane", "control_plane"):
            if _strings(node.value) & words:
                found.append(where(node))
        elif isinstance(node, ast.Dict):
            for key, value in zip(node.keys, node.values, strict=False):
                if key is not None and _strings(key) == {"plane"} and _strings(value) & words:
                    found.append(where(node))
        elif isinstance(node, ast.Call) and getattr(node.func, "id", "") == "getattr" and \
                len(node.args) == 3 and _strings(node.args[1]) == {"plane"}:
            found.append(where(node))
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
                "tpufab.cloud.planes."):
            mod = node.module.split(".")[3]
            # one plane's own module (vms: general-purpose VMs, of no TPU plane)
            if mod not in ("base", "calls", "any", "vms"):
                found.append(where(node))
    return found


def test_the_check_finds_the_branches_it_is_for():
    """It would have failed on the tree before the registry (lifecycle, status's view,
    autostop, the watchdog's config, `use`)."""
    for bad in ('if node.plane == "compute":\n    pass\n',
                'x = getattr(control, "plane", "tpu") == "compute"\n',
                'ok = "tpu" not in topo.planes\n',
                'config = {"plane": "compute", "group": None}\n',
                'c = control_plane(settings, control, plane="compute")\n',
                "where = 'Cloud TPU API' if plane == 'TPU API' else plane\n",
                "from tpufab.cloud.planes.compute import ComputeEngine\n"):
        assert plane_branches(bad), bad
    assert not plane_branches('platform = "tpu"\nif platform not in ("tpu", "cpu"):\n    pass\n')


def test_no_module_outside_the_planes_tells_planes_apart_by_name():
    offenders = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel.startswith(ALLOWED):
            continue
        found = plane_branches(path.read_text())
        if found:
            offenders[rel] = found
    assert offenders == {}, "branches on a control plane's name outside tpufab/cloud/planes/ " \
        "(make it a member of ControlPlane):\n" + "\n".join(
            f"  {rel}: {'; '.join(lines)}" for rel, lines in offenders.items())
