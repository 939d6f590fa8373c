import pytest
from hypothesis import given
from hypothesis import strategies as st

from tpufab.errors import ConfigError
from tpufab.nodeset import fold, label, parse_selection


@pytest.mark.parametrize(
    ("selection", "count", "expected"),
    [
        (None, 4, [0, 1, 2, 3]),
        ("all", 4, [0, 1, 2, 3]),
        ("ALL", 2, [0, 1]),
        ("0", 4, [0]),
        (3, 4, [3]),
        ("0,3-5", 8, [0, 3, 4, 5]),
        (" 5 , 1 ", 8, [1, 5]),
        ("w[0-3,7]", 8, [0, 1, 2, 3, 7]),
        ("w[0-1],w5,6", 8, [0, 1, 5, 6]),
        ("w7", 8, [7]),
        ("2-2", 4, [2]),
        ("1,1,1", 4, [1]),
        ([3, 1, 1], 4, [1, 3]),
        ("w[0-63]", 64, list(range(64))),
    ],
)
def test_parse_selection(selection, count, expected):
    assert parse_selection(selection, count) == expected


@pytest.mark.parametrize(
    ("selection", "count", "fragment"),
    [
        ("4", 4, "valid workers are 0-3"),
        ("0-9", 8, "node has 8 workers"),
        ("1", 1, "the only worker is 0"),
        ("x", 4, "'x' is not a worker number"),
        ("5-3", 8, "runs backwards"),
        ("", 4, "Empty worker selection"),
        ("w[0-3", 8, "is not a worker number"),
        ("-1", 4, "is not a worker number"),
        ([9], 4, "Worker 9 does not exist"),
    ],
)
def test_parse_selection_errors(selection, count, fragment):
    with pytest.raises(ConfigError) as err:
        parse_selection(selection, count)
    assert fragment in str(err.value)


@pytest.mark.parametrize(
    ("workers", "folded"),
    [
        ([], ""),
        ([5], "w5"),
        ([0, 1, 2, 3, 7], "w[0-3,7]"),
        ([7, 3, 2, 1, 0, 0], "w[0-3,7]"),
        ([0, 2, 4], "w[0,2,4]"),
        (range(64), "w[0-63]"),
        ([1, 2], "w[1-2]"),
    ],
)
def test_fold(workers, folded):
    assert fold(workers) == folded


def test_label():
    assert label(3) == "w3"


@given(st.sets(st.integers(min_value=0, max_value=511), min_size=1))
def test_fold_round_trips(workers):
    assert parse_selection(fold(workers), 512) == sorted(workers)
