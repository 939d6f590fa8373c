"""Folders are the bands (docs/architecture.md): every module of tpufab belongs to one band, and
imports point down the bands only, counting imports inside functions and under TYPE_CHECKING.

The band order is the one table below; `house_measures` (tests/house.py) computes the counts
docs/architecture.md reports, and this module asserts the goals."""

from __future__ import annotations

import pytest
from house import (
    BANDS,
    NOT_SPLIT_YET,
    band_of,
    band_violations,
    classes_over,
    cycles,
    import_graph,
    modules,
    modules_over,
)


def test_every_module_belongs_to_a_band():
    homeless = [m for m in modules() if band_of(m) is None]
    assert not homeless, f"modules in no band (add their folder to tests/house.py BANDS): {homeless}"


def test_imports_point_down_the_bands_only():
    wrong = band_violations(import_graph())
    assert not wrong, "imports from a lower band to a higher one:\n" + "\n".join(
        f"  {a} ({band_of(a)}) -> {b} ({band_of(b)})" for a, b in wrong)


def test_no_import_circles_counting_type_only_imports():
    found = [c for c in cycles(import_graph(type_checking=True))
             if not set(c) <= NOT_SPLIT_YET]
    assert not found, f"import circles (TYPE_CHECKING and function-level imports counted): {found}"


def test_the_simulated_pod_is_driven_only_by_its_own_verbs():
    """No product module imports tpufab.sim (no `if sim:` in product code): only the `tpufab
    sim ...` verbs drive it."""
    graph = import_graph(type_checking=True)
    users = sorted(a for a, deps in graph.items() for b in deps
                   if b.startswith("tpufab.sim") and not a.startswith("tpufab.sim")
                   and a != "tpufab.verbs.sim")
    assert not users, users


@pytest.mark.parametrize("inside_sim", [False, True], ids=["product", "sim"])
def test_no_module_over_900_lines(inside_sim):
    big = {m: n for m, n in modules_over(900).items()
           if m.startswith("tpufab.sim") == inside_sim and m not in NOT_SPLIT_YET}
    assert not big, f"modules over 900 lines (split by concern): {big}"


def test_no_class_over_600_lines():
    big = {c: n for c, n in classes_over(600).items()
           if c.rsplit(".", 1)[0] not in NOT_SPLIT_YET}
    assert not big, f"classes over 600 lines: {big}"


def test_the_band_table_lists_each_band_once():
    names = [name for name, _ in BANDS]
    assert len(names) == len(set(names))


def test_the_modules_not_split_yet_only_shrink():
    """The modules this round splits, while they are being split: the set may only lose names
    (each must still be over a limit or in a circle), and is empty when the round is done."""
    over = set(modules_over(900)) | {c.rsplit(".", 1)[0] for c in classes_over(600)}
    circled = {m for c in cycles(import_graph(type_checking=True)) for m in c}
    assert NOT_SPLIT_YET <= over | circled, NOT_SPLIT_YET - over - circled
