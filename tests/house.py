"""The shape of the house, measured (docs/architecture.md's table): the bands, the import graph
(imports inside functions counted; TYPE_CHECKING imports on request), circles, sizes.

A plain helper module for tests/test_bands.py and tests/test_spine.py; `python tests/house.py`
prints the measures."""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "tpufab"

# Top to bottom: a module may import its own band and the bands below it, never one above.
# Within a band, modules import each other freely, but never in a circle.
BANDS: list[tuple[str, tuple[str, ...]]] = [
    ("front doors", ("tpufab", "tpufab.cli", "tpufab.tasks", "tpufab.entry", "tpufab.resident",
                     "tpufab.templates")),
    ("verbs", ("tpufab.verbs",)),
    ("views", ("tpufab.views",)),
    ("pod", ("tpufab.pod",)),
    ("flows", ("tpufab.flows",)),
    ("steps: start", ("tpufab.steps", "tpufab.steps.start")),
    ("steps: health", ("tpufab.steps.health",)),
    ("steps: host", ("tpufab.steps.host",)),
    ("steps: code", ("tpufab.steps.code",)),
    ("steps: runs", ("tpufab.steps.runs",)),
    ("simulated pod", ("tpufab.sim",)),
    ("hosts", ("tpufab.hosts",)),
    ("engines", ("tpufab.ssh", "tpufab.cloud")),
    ("base", ("tpufab.term", "tpufab.reports", "tpufab.errors", "tpufab.config",
              "tpufab.current", "tpufab.quoting", "tpufab.nodeset", "tpufab.topology",
              "tpufab.durations")),
    ("worker side", ("tpufab.remote",)),
]

# Being split this round (issue 36): the limits below hold for every other module. Only
# shrinks; empty when the round is done.
NOT_SPLIT_YET = {"tpufab.cloud.lifecycle", "tpufab.cloud.compute_api",
                 "tpufab.pod.api", "tpufab.ssh.fanout",
                 "tpufab.sim.compute_api", "tpufab.sim.emulator", "tpufab.sim.workers",
                 "tpufab.sim.guest", "tpufab.sim.legacy", "tpufab.sim.oslogin",
                 "tpufab.sim.queued"}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@cache
def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def band_of(module: str) -> str | None:
    """The band of ``module``: the one whose longest prefix matches."""
    best, length = None, -1
    for name, prefixes in BANDS:
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > length:
                best, length = name, len(prefix)
    return best


def band_index(module: str) -> int:
    name = band_of(module)
    return next(i for i, (band, _) in enumerate(BANDS) if band == name)


def _is_type_checking(node: ast.If) -> bool:
    return getattr(node.test, "id", getattr(node.test, "attr", "")) == "TYPE_CHECKING"


@cache
def import_graph(type_checking: bool = True) -> dict[str, frozenset[str]]:
    """{module: the tpufab modules it imports}, imports inside functions counted (and those
    under TYPE_CHECKING unless ``type_checking`` is False)."""
    mods = modules()

    def resolve(name: str) -> str | None:
        parts = name.split(".")
        while parts and ".".join(parts) not in mods:
            parts.pop()
        return ".".join(parts) or None

    graph = {}
    for mod, path in mods.items():
        tree = ast.parse(path.read_text())
        skip = set() if type_checking else {
            id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and _is_type_checking(node)
            for n in ast.walk(node)}
        deps = set()
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            names = []
            if isinstance(node, ast.ImportFrom) and node.module and not node.level:
                # `from tpufab import __version__`: the package's version constant, not its API
                names = [f"{node.module}.{a.name}" for a in node.names
                         if (node.module, a.name) != ("tpufab", "__version__")]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            for name in names:
                target = resolve(name) if name.startswith("tpufab") else None
                if target and target != mod:
                    deps.add(target)
        graph[mod] = frozenset(deps)
    return graph


def band_violations(graph: dict[str, frozenset[str]]) -> list[tuple[str, str]]:
    """(importer, imported) pairs where the imported module sits in a higher band."""
    return sorted((a, b) for a, deps in graph.items() for b in deps
                  if band_of(a) and band_of(b) and band_index(b) < band_index(a))


def cycles(graph: dict[str, frozenset[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def modules_over(lines: int) -> dict[str, int]:
    out = {}
    for mod, path in modules().items():
        n = len(path.read_text().splitlines())
        if n > lines:
            out[mod] = n
    return out


def classes_over(lines: int) -> dict[str, int]:
    out = {}
    for mod, path in modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                n = node.end_lineno - node.lineno + 1
                if n > lines:
                    out[f"{mod}.{node.name}"] = n
    return out


if __name__ == "__main__":
    graph = import_graph()
    wrong = band_violations(graph)
    pairs = sorted({(band_of(a), band_of(b)) for a, b in wrong})
    print(f"modules: {len(modules())}")
    print(f"upward imports: {len(wrong)} ({len(pairs)} band pairs)")
    for a, b in wrong:
        print(f"  {a} -> {b}")
    print(f"circles (type-only counted): {cycles(graph)}")
    print(f"modules over 900 lines: {modules_over(900)}")
    print(f"classes over 600 lines: {classes_over(600)}")
