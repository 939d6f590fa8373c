"""The simulated pod's own house (tpufab/sim/, docs/simulated-pod.md "The code"): modules and
classes a newcomer can read, handlers that share the store (tpufab/sim/store.py) through its
public methods instead of reaching into each other, and no import circle among them, counting
imports inside functions and under TYPE_CHECKING."""

from __future__ import annotations

import ast
from pathlib import Path

SIM = Path(__file__).resolve().parents[1] / "tpufab" / "sim"
MAX_MODULE_LINES = 900
MAX_CLASS_LINES = 600
# What may call a module's private name: the stdlib's os._exit (a worker's PID 1 exits so).
STDLIB_PRIVATE = {("os", "_exit")}
# The only modules that build the emulator: its own, and the daemon that serves it.
EMULATOR_USERS = {"emulator.py", "daemon.py"}


def modules() -> list[Path]:
    return sorted(SIM.glob("*.py"))


def test_no_sim_module_passes_900_lines():
    long = {p.name: n for p in modules() if (n := len(p.read_text().splitlines()))
            > MAX_MODULE_LINES}
    assert not long, f"tpufab/sim modules over {MAX_MODULE_LINES} lines: {long}"


def test_no_sim_class_passes_600_lines():
    long = {}
    for path in modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                size = node.end_lineno - node.lineno + 1
                if size > MAX_CLASS_LINES:
                    long[f"{path.name}:{node.name}"] = size
    assert not long, f"tpufab/sim classes over {MAX_CLASS_LINES} lines: {long}"


def private_reaches(source: str) -> list[str]:
    """Every ``x._name`` in ``source`` whose ``x`` is not the object itself (``self``,
    ``cls``): one object reaching into another's internals (``self.emu._lock``,
    ``store._state``, ``emulator._save()``)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Attribute) or not node.attr.startswith("_") or \
                node.attr.startswith("__"):
            continue
        owner = node.value
        if isinstance(owner, ast.Name) and (owner.id in ("self", "cls") or
                                            (owner.id, node.attr) in STDLIB_PRIVATE):
            continue
        found.append(f"{ast.unparse(node)} (line {node.lineno})")
    return found


def test_the_rule_sees_a_handler_reaching_into_the_emulator():
    # what every handler did before the store: the rule must catch each shape of it
    assert private_reaches("with self.emu._lock:\n    self.emu._save()\n") == [
        "self.emu._lock (line 1)", "self.emu._save (line 2)"]
    assert private_reaches("emu._state['nodes']\n") == ["emu._state (line 1)"]
    assert private_reaches("self._lock\nos._exit(1)\nself.store.lock\n") == []


def test_no_sim_module_reaches_into_another_objects_private_members():
    wrong = {p.name: found for p in modules() if (found := private_reaches(p.read_text()))}
    assert not wrong, f"private members used across objects (use the store's public " \
        f"methods): {wrong}"


def _imports(path: Path) -> set[str]:
    """Every tpufab.sim module ``path`` imports: at the top, inside functions and under
    TYPE_CHECKING alike."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            if node.module == "tpufab.sim":
                out |= {f"tpufab.sim.{a.name}" for a in node.names}
            elif node.module.startswith("tpufab.sim."):
                out.add(node.module)
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("tpufab.sim.")}
    return {m for m in out if (SIM / f"{m.rsplit('.', 1)[1]}.py").exists()}


def test_only_the_daemon_builds_the_emulator():
    wrong = sorted(p.name for p in modules()
                   if "tpufab.sim.emulator" in _imports(p) and p.name not in EMULATOR_USERS)
    assert not wrong, f"sim modules importing the emulator (take the store instead): {wrong}"


def test_no_import_circle_in_sim_counting_type_checking_imports():
    graph = {f"tpufab.sim.{p.stem}": _imports(p) for p in modules()}
    circles = []
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(mod: str, path: list[str]) -> None:
        state[mod] = 1
        for dep in sorted(graph.get(mod, ())):
            if state.get(dep) == 1:
                circles.append(path[path.index(dep):] + [dep])
            elif dep not in state:
                visit(dep, path + [dep])
        state[mod] = 2

    for mod in sorted(graph):
        if mod not in state:
            visit(mod, [mod])
    assert not circles, f"import circles in tpufab/sim: {circles}"
