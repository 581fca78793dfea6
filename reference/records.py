"""Full-precision CSV/JSON records and their tolerance-based comparison.

Floats are written ``%.17g``: 17 significant digits always read back to the same binary64 value
(subnormals, huge values, ``-0`` and ``±inf`` included).  Comparisons across platforms use a tolerance,
never the last bits.
"""
from __future__ import annotations

import csv
import json
import math
import numbers
from pathlib import Path

import numpy as np

__all__ = ["compare_csv", "format_value", "parse_cell", "read_csv", "write_csv", "write_json"]


def format_value(value) -> str:
    """Format one CSV cell: floats ``%.17g``, bools ``true``/``false``, ints and strings as they are."""
    if isinstance(value, (bool, np.bool_)):
        return "true" if value else "false"
    if isinstance(value, numbers.Integral):
        return str(int(value))
    if isinstance(value, numbers.Real):
        return "%.17g" % float(value)
    if value is None:
        return ""
    return str(value)


def write_csv(path, header: list[str], rows) -> Path:
    """Write ``header`` then ``rows`` (sequences of cells) to ``path``; returns the path."""
    path = Path(path)
    with path.open("w", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle, lineterminator="\n")
        writer.writerow(header)
        for row in rows:
            if len(row) != len(header):
                raise ValueError(f"rows: expected {len(header)} cells like the header, got {len(row)}: {row!r}")
            writer.writerow([format_value(cell) for cell in row])
    return path


def read_csv(path) -> tuple[list[str], list[list[str]]]:
    """Return ``(header, rows)`` of a CSV file as strings."""
    with Path(path).open(newline="", encoding="utf-8") as handle:
        rows = list(csv.reader(handle))
    if not rows:
        raise ValueError(f"path: expected a CSV file with a header, got an empty file {path}")
    return rows[0], rows[1:]


def parse_cell(text: str):
    """A cell as a float when it parses as one, else the string itself."""
    try:
        return float(text)
    except ValueError:
        return text


def _cells_match(fresh: str, committed: str, atol: float, rtol: float) -> bool:
    a, b = parse_cell(fresh), parse_cell(committed)
    if isinstance(a, str) or isinstance(b, str):
        return fresh == committed
    if not (math.isfinite(a) and math.isfinite(b)):
        return a == b or (math.isnan(a) and math.isnan(b))
    return abs(a - b) <= atol + rtol * abs(b)


def compare_csv(fresh_path, committed_path, atol: float = 1e-12, rtol: float = 1e-12) -> list[str]:
    """Compare two CSV files cell by cell.

    Numeric cells match when ``|fresh - committed| <= atol + rtol * |committed|`` (infinities must be
    equal); other cells must be equal strings.

    Returns
    -------
    list of str
        One line per difference (empty when the files agree).
    """
    fresh_header, fresh_rows = read_csv(fresh_path)
    ref_header, ref_rows = read_csv(committed_path)
    name = Path(committed_path).name
    if fresh_header != ref_header:
        return [f"{name}: header {fresh_header} differs from committed {ref_header}"]
    if len(fresh_rows) != len(ref_rows):
        return [f"{name}: {len(fresh_rows)} rows, committed copy has {len(ref_rows)}"]
    problems = []
    for r, (row, ref) in enumerate(zip(fresh_rows, ref_rows)):
        if len(row) != len(ref):
            problems.append(f"{name} row {r + 1}: {len(row)} cells, committed copy has {len(ref)}")
            continue
        for column, a, b in zip(fresh_header, row, ref):
            if not _cells_match(a, b, atol, rtol):
                problems.append(f"{name} row {r + 1} column {column}: fresh {a}, committed {b}")
    return problems


def _json_safe(value):
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        value = float(value)
        return value if math.isfinite(value) else repr(value)  # "inf", "-inf", "nan" as strings
    return str(value)


def write_json(path, payload) -> Path:
    """Write ``payload`` as strict JSON (non-finite floats become the strings ``"inf"``, ``"-inf"``, ``"nan"``)."""
    path = Path(path)
    path.write_text(json.dumps(_json_safe(payload), indent=2, allow_nan=False) + "\n", encoding="utf-8")
    return path
