"""The CSV/JSON writer: 17 significant digits read back to the same float64, and tolerance comparison."""
import json
import math
import struct

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from reference.records import compare_csv, format_value, read_csv, write_csv, write_json

EDGE_VALUES = [0.0, -0.0, 5e-324, -5e-324, 2.2250738585072009e-308, 2.2250738585072014e-308,
               1.7976931348623157e308, -1.7976931348623157e308, 0.1, 1 / 3, -2.5e-300, 123456789012345680.0,
               math.inf, -math.inf]


def same_bits(a: float, b: float) -> bool:
    return struct.pack("<d", a) == struct.pack("<d", b)


@pytest.mark.parametrize("value", EDGE_VALUES)
def test_edge_values_round_trip_bit_for_bit(value):
    assert same_bits(float(format_value(value)), value)


def test_negative_zero_keeps_its_sign():
    assert format_value(-0.0) == "-0"
    assert math.copysign(1.0, float(format_value(-0.0))) == -1.0


@settings(max_examples=500, deadline=None)
@given(st.floats(allow_nan=False, allow_infinity=True, allow_subnormal=True))
def test_property_17_digits_round_trip(value):
    assert same_bits(float(format_value(value)), value)
    assert same_bits(float(format_value(np.float64(value))), value)


def test_cells_other_than_floats():
    assert [format_value(x) for x in (True, np.bool_(False), 7, np.int64(-3), "a,b", None)] == \
        ["true", "false", "7", "-3", "a,b", ""]


def test_csv_round_trip_of_random_and_edge_values(tmp_path):
    rng = np.random.default_rng(2024)
    values = np.concatenate([rng.standard_normal(200) * 10.0 ** rng.integers(-300, 300, 200), EDGE_VALUES])
    path = write_csv(tmp_path / "values.csv", ["index", "value", "label"],
                     [[i, float(x), f"row {i}, quoted"] for i, x in enumerate(values)])
    header, rows = read_csv(path)
    assert header == ["index", "value", "label"]
    assert len(rows) == len(values)
    for i, (row, x) in enumerate(zip(rows, values)):
        assert int(row[0]) == i and row[2] == f"row {i}, quoted"
        assert same_bits(float(row[1]), float(x))


def test_write_csv_rejects_ragged_rows(tmp_path):
    with pytest.raises(ValueError, match="rows: expected 2 cells like the header, got 1"):
        write_csv(tmp_path / "x.csv", ["a", "b"], [[1]])


def write_pair(tmp_path, fresh_value, committed_value, label="x"):
    fresh = write_csv(tmp_path / "fresh.csv", ["name", "value"], [[label, fresh_value]])
    (tmp_path / "ref").mkdir(exist_ok=True)
    committed = write_csv(tmp_path / "ref" / "fresh.csv", ["name", "value"], [["x", committed_value]])
    return fresh, committed


@pytest.mark.parametrize("fresh_value, committed_value, agree", [
    (0.1, 0.1, True),
    (0.1 + 5e-13, 0.1, True),          # within atol 1e-12: not bit for bit
    (0.1 + 5e-12, 0.1, False),
    (5e9 + 1e-3, 5e9, True),           # the rtol part: 1e-12 * 5e9 = 5e-3
    (5e9 + 1e-2, 5e9, False),
    (-math.inf, -math.inf, True),
    (-math.inf, 0.0, False),
    (math.inf, -math.inf, False),
])
def test_compare_csv_tolerance(tmp_path, fresh_value, committed_value, agree):
    fresh, committed = write_pair(tmp_path, fresh_value, committed_value)
    problems = compare_csv(fresh, committed, atol=1e-12, rtol=1e-12)
    assert (problems == []) == agree
    if not agree:
        assert "fresh.csv row 1 column value" in problems[0]


def test_compare_csv_strings_headers_and_row_counts(tmp_path):
    fresh, committed = write_pair(tmp_path, 1.0, 1.0, label="y")
    assert compare_csv(fresh, committed) == ["fresh.csv row 1 column name: fresh y, committed x"]
    write_csv(committed, ["name", "other"], [["x", 1.0]])
    assert "header" in compare_csv(fresh, committed)[0]
    write_csv(committed, ["name", "value"], [["x", 1.0], ["x", 2.0]])
    assert compare_csv(fresh, committed) == ["fresh.csv: 1 rows, committed copy has 2"]


def test_json_is_strict_and_round_trips_floats(tmp_path):
    values = [0.1, 1 / 3, 5e-324, -0.0, 1.7976931348623157e308]
    path = write_json(tmp_path / "a.json", {"values": values, "neg": -math.inf, "flag": np.bool_(True),
                                            "n": np.int64(3), "x": np.float64(0.25), "t": (1, 2)})
    loaded = json.loads(path.read_text(), parse_constant=lambda name: pytest.fail(f"non-strict JSON {name}"))
    assert all(same_bits(a, b) for a, b in zip(loaded["values"], values))
    assert loaded["neg"] == "-inf" and loaded["flag"] is True and loaded["n"] == 3 and loaded["x"] == 0.25
    assert loaded["t"] == [1, 2]
