"""The shape of the house, measured (docs/architecture.md's table): the bands, the import graph
(imports inside functions counted; TYPE_CHECKING imports on request), circles, sizes.

A plain helper module for tests/test_bands.py and tests/test_spine.py; `python tests/house.py`
prints the measures."""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path
from typing import Any

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

# Split in round 4 (issue 36): the limits below hold for every module; a module that outgrows
# them is split, not listed here. Empty, and it stays so (test_bands).
NOT_SPLIT_YET: set[str] = set()


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


# Where an operation's timeouts are chosen: the layers above the engines (ssh/ and cloud/
# have their own transport bounds).
OPERATION_LAYERS = ("tpufab.verbs", "tpufab.pod", "tpufab.flows", "tpufab.steps")


def timeout_defaults_outside_the_table() -> list[str]:
    """Numbers written as a timeout's default in the operation layers: a parameter named
    ``*timeout*`` whose default is a number, a module constant ``*TIMEOUT*`` = a number."""
    found = []
    for mod, path in modules().items():
        if not mod.startswith(OPERATION_LAYERS):
            continue
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                args = node.args
                pairs = list(zip(args.args[len(args.args) - len(args.defaults):], args.defaults,
                                 strict=True))
                pairs += [(a, d) for a, d in zip(args.kwonlyargs, args.kw_defaults, strict=True)
                          if d is not None]
                found += [f"{mod}:{node.lineno} {node.name}({a.arg}={ast.unparse(d)})"
                          for a, d in pairs if "timeout" in a.arg
                          and isinstance(d, ast.Constant) and isinstance(d.value, int | float)]
        for node in tree.body:
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) and \
                    isinstance(node.value.value, int | float):
                found += [f"{mod}:{node.lineno} {t.id}" for t in node.targets
                          if isinstance(t, ast.Name) and "TIMEOUT" in t.id]
    return found


def timeout_resolvers() -> list[str]:
    """Where a timeout that was not given gets its default: the one resolver
    (tpufab.config.timeout_for) and any ``X if timeout is None else timeout``, ``timeout or
    X`` or ``if timeout is None: timeout = ...`` in the operation layers."""
    found = ["tpufab.config.timeout_for"]
    for mod, path in modules().items():
        if not mod.startswith(OPERATION_LAYERS):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            text = ""
            if isinstance(node, ast.IfExp | ast.If) and isinstance(node.test, ast.Compare):
                test = ast.unparse(node.test)
                if "timeout" in test and test.endswith("is None") and (
                        isinstance(node, ast.IfExp) or any(
                            "timeout" in ast.unparse(t) for b in node.body
                            if isinstance(b, ast.Assign) for t in b.targets)):
                    text = test
            elif isinstance(node, ast.BoolOp) and isinstance(node.op, ast.Or) and \
                    isinstance(node.values[0], ast.Name | ast.Attribute) and \
                    "timeout" in ast.unparse(node.values[0]):
                text = ast.unparse(node)
            if text:
                found.append(f"{mod}:{node.lineno} {text}")
    return found


def shims() -> list[str]:
    """Re-export shims: a module ``__getattr__`` (but the package's own, its public API
    table), and functions that only forward to a function of the same name elsewhere."""
    found = []
    for mod, path in modules().items():
        for node in ast.parse(path.read_text()).body:
            if not isinstance(node, ast.FunctionDef):
                continue
            if node.name == "__getattr__" and mod != "tpufab":
                found.append(f"{mod}.__getattr__")
                continue
            body = node.body[1:] if ast.get_docstring(node) else node.body
            if not body or not isinstance(body[-1], ast.Return) or \
                    not isinstance(body[-1].value, ast.Call):
                continue
            if not all(isinstance(b, ast.Import | ast.ImportFrom) for b in body[:-1]):
                continue
            call = body[-1].value
            called = call.func.attr if isinstance(call.func, ast.Attribute) else \
                getattr(call.func, "id", "")
            params = {a.arg for a in (*node.args.args, *node.args.kwonlyargs)}
            passed = all(isinstance(a, ast.Name) and a.id in params for a in call.args) and \
                all(isinstance(k.value, ast.Name) and k.value.id in params
                    for k in call.keywords)
            if called == node.name and passed:
                found.append(f"{mod}.{node.name}")
    return found


def report_classes() -> dict[str, str]:
    """{class: module} of every subclass of tpufab.reports.Report."""
    out = {}
    for mod, path in modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and any(
                    ast.unparse(b) in ("Report", "reports.Report") for b in node.bases):
                out[node.name] = mod
    return out


def report_naming_schemes() -> set[str]:
    """The naming styles of the report classes: the last word of each name ("Report" for
    ``DeployReport``, "Result" for a ``KillResult``, "Captured" ...)."""
    import re

    return {re.findall(r"[A-Z][a-z]*", name)[-1] for name in report_classes()}


def hand_kept_registries() -> list[str]:
    """Lists a new verb would have to be added to by hand: module-level tuples, lists, sets
    or dicts in the front doors, the verbs, the views and tests/test_spine.py whose items
    name three verbs, families or report views or more."""
    import importlib

    verbs = importlib.import_module("tpufab.verbs")
    names = {v.name for v in verbs.all_verbs()} | {v.pod_method for v in verbs.all_verbs()
                                                   if v.pod_method}
    names |= {p.stem for p in (PACKAGE / "verbs").glob("*.py")}
    found = []
    where = {mod: path for mod, path in modules().items()
             if mod.startswith(("tpufab.verbs", "tpufab.views", "tpufab.cli", "tpufab.tasks"))}
    where["tests.test_spine"] = Path(__file__).with_name("test_spine.py")
    for mod, path in where.items():
        for node in ast.parse(path.read_text()).body:
            value = node.value if isinstance(node, ast.Assign | ast.AnnAssign) else None
            if not isinstance(value, ast.Tuple | ast.List | ast.Set | ast.Dict):
                continue
            items = value.keys if isinstance(value, ast.Dict) else value.elts
            strings = {i.value for i in items if isinstance(i, ast.Constant)
                       and isinstance(i.value, str)}
            if len(strings & names) >= 3:
                target = node.targets[0] if isinstance(node, ast.Assign) else node.target
                found.append(f"{mod}.{ast.unparse(target)}")
    return found


def _type_checking_names(path: Path) -> dict:
    """The names a module imports under TYPE_CHECKING, imported (to read its annotations)."""
    import importlib

    names: dict = {}
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.If) and _is_type_checking(node):
            for item in node.body:
                if isinstance(item, ast.ImportFrom) and item.module:
                    module = importlib.import_module(item.module)
                    for a in item.names:
                        names[a.asname or a.name] = getattr(module, a.name)
    return names


def pod_return_types() -> dict[str, object]:
    """{method: its return type} of every public tpufab.Pod method (inspect.Signature.empty:
    not annotated)."""
    import inspect

    from tpufab.pod import api

    names = {**vars(api), **_type_checking_names(Path(api.__file__))}
    out: dict[str, object] = {}
    for name, member in inspect.getmembers(api.Pod, inspect.isfunction):
        if name.startswith("_"):
            continue
        hint = member.__annotations__.get("return", inspect.Signature.empty)
        out[name] = eval(hint, names) if isinstance(hint, str) else hint
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
    returns = pod_return_types()
    print("-> Any on Pod methods:", sum(1 for h in returns.values() if h is Any))
    print(f"re-export shims: {shims()}")
    print(f"report naming schemes: {sorted(report_naming_schemes())}")
    print(f"timeout defaults outside the table: {timeout_defaults_outside_the_table()}")
    print(f"timeout resolvers: {timeout_resolvers()}")
