"""docs/architecture.md's "Done means" table says what tests/house.py measures: each figure of
its "this tree" column is computed here."""

from __future__ import annotations

import typing
from pathlib import Path

import house

REPO = Path(__file__).resolve().parents[1]


def _circles() -> str:
    return str(len(house.cycles(house.import_graph(type_checking=True))))


def _upward() -> str:
    return str(len(house.band_violations(house.import_graph())))


def _big_modules() -> str:
    big = house.modules_over(900)
    inside = sum(1 for m in big if m.startswith("tpufab.sim"))
    return f"{len(big) - inside} ({inside})"


def _timeouts() -> str:
    # the resolver itself is one of the resolvers
    return (f"{len(house.timeout_defaults_outside_the_table())}; "
            f"{len(house.timeout_resolvers())}")


def _any_and_shims() -> str:
    returns = house.pod_return_types()
    return f"{sum(1 for h in returns.values() if h is typing.Any)}; {len(house.shims())}"


def _new_verb() -> str:
    from test_new_verb import FILES

    return f"{len(FILES)}; {len(house.hand_kept_registries())}"


def _deploy_and_start() -> str:
    from test_one_path import callers

    return (f"{len(callers('deploy', (None, 'deploy', 'deploying')))}; "
            f"{len(callers('start_on_workers'))}")


def _result_containers() -> str:
    """Classes holding one command's result per worker: those named *Result made directly on
    a dict or a Mapping (a subclass of one of them, as run --local's, adds fields only)."""
    import ast

    found = set()
    for mod, path in house.modules().items():
        if mod.startswith(("tpufab.sim", "tpufab.remote")):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and node.name.endswith("Result") and any(
                    isinstance(b, ast.Name) and b.id == "dict" or
                    isinstance(b, ast.Subscript) and getattr(b.value, "id", "") in ("dict", "Mapping")
                    for b in node.bases):
                found.add(f"{mod}.{node.name}")
    return str(len(found))


def _plane_files() -> str:
    from test_planes import ALLOWED, PACKAGE, plane_branches

    return str(sum(1 for path in PACKAGE.rglob("*.py")
                   if not path.relative_to(PACKAGE).as_posix().startswith(ALLOWED)
                   and plane_branches(path.read_text())))


MEASURES = {
    "import circles, counting function-level and `TYPE_CHECKING` imports": _circles,
    "imports from a lower band to a higher one": _upward,
    "modules over 900 lines outside `sim/` (inside `sim/`)": _big_modules,
    "classes over 600 lines": lambda: str(len(house.classes_over(600))),
    "report naming schemes": lambda: str(len(house.report_naming_schemes())),
    "timeout defaults written outside the table; resolvers": _timeouts,
    "`-> Any` on `Pod` methods; re-export shims": _any_and_shims,
    "files a new worker verb touches; hand-kept registries": _new_verb,
    "deploy call sites; start paths": _deploy_and_start,
    "command-result containers": _result_containers,
    "files naming a control plane outside `cloud/planes/` and `topology.py`": _plane_files,
}


def done_means() -> dict[str, str]:
    text = (REPO / "docs" / "architecture.md").read_text()
    table = text[text.index("## Done means"):].split("\n\n")[2]
    rows = {}
    for line in table.splitlines()[2:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        rows[cells[0]] = cells[2]
    return rows


def test_every_row_of_the_table_is_measured_here():
    assert set(done_means()) == set(MEASURES), set(done_means()) ^ set(MEASURES)


def test_the_table_says_what_is_measured():
    rows = done_means()
    wrong = {k: (rows[k], measure()) for k, measure in MEASURES.items() if rows[k] != measure()}
    assert not wrong, f"docs/architecture.md's Done means says (table, measured): {wrong}"
