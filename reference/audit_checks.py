"""The audit's records: one checked figure (`Check`), the three ways a figure is checked (`close`, `at_most`,
`equal`), one part's tables and checks (`Section`) and the small helpers the parts share.

    close(section, name, measured, document, tolerance) -> Check     |measured - document| <= tolerance
    at_most(section, name, measured, bound) -> Check                  measured <= bound
    equal(section, name, measured, document) -> Check                 measured == document
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from decimal import Decimal, localcontext

import numpy as np

from . import oracle

# Tolerances for figures the document prints rounded: half a unit of the last printed digit.
TOL_6 = 5e-7   # 6 decimals
TOL_3 = 5e-4   # 3 decimals (the score tables)
TOL_2 = 5e-3   # 2 decimals (GiB)
TOL_HAND = 1e-12  # figures the document derives by exact hand arithmetic (0.53, -0.95)
TOL_ROUNDOFF = 1e-15  # float64 agreement between two computations of the same quantity


@dataclass
class Check:
    """One audited figure.

    ``kind`` is ``close`` (``|measured - document| <= tolerance``; infinities must be equal),
    ``at_most`` (``measured <= tolerance``; ``document`` is the document's own figure, if any) or
    ``equal`` (``measured == document``).
    """

    section: str
    name: str
    kind: str
    measured: object
    document: object
    tolerance: float | None
    passed: bool
    note: str = ""

    def row(self) -> list:
        return [self.section, self.name, self.kind, self.measured, self.document, self.tolerance,
                self.passed, self.note]


CHECK_HEADER = ["section", "name", "kind", "measured", "document", "tolerance", "passed", "note"]


def close(section, name, measured, document, tolerance, note="") -> Check:
    measured, document = float(measured), float(document)
    if math.isfinite(measured) and math.isfinite(document):
        passed = abs(measured - document) <= tolerance
    else:
        passed = measured == document
    return Check(section, name, "close", measured, document, tolerance, passed, note)


def at_most(section, name, measured, bound, document=None, note="") -> Check:
    measured = float(measured)
    return Check(section, name, "at_most", measured, document, bound, bool(measured <= bound), note)


def equal(section, name, measured, document, note="") -> Check:
    return Check(section, name, "equal", measured, document, None, bool(measured == document), note)


@dataclass
class Section:
    """Tables (file name -> (header, rows)) and checks produced by one part of the audit."""

    tables: dict = field(default_factory=dict)
    checks: list = field(default_factory=list)
    details: dict = field(default_factory=dict)


def matrix_table(matrix, prefix: str) -> tuple[list, list]:
    """A ``[rows, cols]`` matrix as a table: a ``query`` index column, then ``<prefix>_<j>`` columns."""
    matrix = np.asarray(matrix)
    header = ["query"] + [f"{prefix}_{j}" for j in range(matrix.shape[1])]
    return header, [[i] + [float(x) for x in row] for i, row in enumerate(matrix)]


def decimal_error(exact, approx: float) -> float:
    """``|exact - approx|`` evaluated in Decimal (``approx`` converted exactly), rounded to float."""
    with localcontext() as ctx:
        ctx.prec = oracle.PRECISION
        return float(abs(exact - Decimal(float(approx))))


def softmax_rows(masked: np.ndarray, axis: int = -1) -> np.ndarray:
    """Softmax of ``masked`` along ``axis`` (the largest value subtracted first)."""
    shifted = masked - masked.max(axis=axis, keepdims=True)
    exps = np.exp(shifted)
    return exps / exps.sum(axis=axis, keepdims=True)
