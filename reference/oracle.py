"""An independent attention oracle: plain Python loops over ``decimal.Decimal`` at 50 significant digits.

Inputs are converted *exactly* from binary64 (``Decimal(float(x))``), so the oracle computes the exact
attention of the float64 numbers the dense code sees, not of the decimal literals they were typed from.
NumPy is used only to read the input arrays into Python floats; every arithmetic step is ``Decimal``,
with ``Decimal.exp`` for the softmax.  Single head only, causal mask from absolute positions
(query ``i`` reads key ``j`` iff ``j <= query_start + i``).

Results are nested lists of ``Decimal``: ``scores [Lq][Lk]``, ``weights [Lq][Lk]`` (exactly 0 at
masked keys) and ``context [Lq][head_dim_v]``.
"""
from __future__ import annotations

import math
import numbers
from decimal import Decimal, localcontext
from typing import NamedTuple

import numpy as np

__all__ = ["PRECISION", "OracleResult", "oracle_attention", "oracle_context", "oracle_scores",
           "oracle_weights", "to_decimal_matrix", "to_float_matrix"]

PRECISION = 50


class OracleResult(NamedTuple):
    """Decimal scores ``[Lq][Lk]``, causal weights ``[Lq][Lk]`` and context ``[Lq][head_dim_v]``."""

    scores: list
    weights: list
    context: list


def to_decimal_matrix(name: str, x) -> list[list[Decimal]]:
    """Read a 2-D float array into a list of rows of exact ``Decimal`` values.

    Parameters
    ----------
    name : str
        Argument name for error messages.
    x : array_like, float, [rows, cols]

    Raises
    ------
    TypeError
        For a non-float dtype.
    ValueError
        For a non-2-D or empty shape, or a non-finite value.
    """
    arr = np.asarray(x)
    if arr.dtype.kind != "f":
        raise TypeError(f"{name}: expected a float dtype, got {arr.dtype}")
    if arr.ndim != 2 or arr.shape[0] < 1 or arr.shape[1] < 1:
        raise ValueError(f"{name}: expected a non-empty 2-D array, got shape {arr.shape}")
    rows = arr.astype(np.float64).tolist()  # numpy's only job: hand back Python floats
    for i, row in enumerate(rows):
        for j, value in enumerate(row):
            if not math.isfinite(value):
                raise ValueError(f"{name}: expected finite values, got {value!r} at index ({i}, {j})")
    return [[Decimal(value) for value in row] for row in rows]


def to_float_matrix(rows) -> list[list[float]]:
    """Round a nested list of ``Decimal`` to the nearest float64 values."""
    return [[float(value) for value in row] for row in rows]


def _scale(head_dim: int, scale) -> Decimal:
    if scale is None:
        return 1 / Decimal(head_dim).sqrt()
    return Decimal(float(scale))


def _scores(q, k, scale) -> list[list[Decimal]]:
    if len(q[0]) != len(k[0]):
        raise ValueError(f"k: expected head_dim {len(q[0])} (q's last axis), got {len(k[0])}")
    factor = _scale(len(q[0]), scale)
    out = []
    for q_row in q:
        row = []
        for k_row in k:
            dot = Decimal(0)
            for a, b in zip(q_row, k_row):
                dot += a * b
            row.append(dot * factor)
        out.append(row)
    return out


def _check_query_start(query_start, num_queries: int, num_keys: int) -> int:
    if isinstance(query_start, bool) or not isinstance(query_start, numbers.Integral) or query_start < 0:
        raise ValueError(f"query_start: expected a non-negative int, got {query_start!r}")
    if query_start + num_queries > num_keys:
        raise ValueError(f"query_start: expected query_start + Lq <= Lk = {num_keys}, "
                         f"got {query_start + num_queries}")
    return int(query_start)


def _causal_softmax(scores, query_start: int) -> list[list[Decimal]]:
    weights = []
    for i, row in enumerate(scores):
        visible = row[:query_start + i + 1]
        top = max(visible)
        exps = [(s - top).exp() for s in visible]
        total = sum(exps, Decimal(0))
        weights.append([e / total for e in exps] + [Decimal(0)] * (len(row) - len(visible)))
    return weights


def _context(weights, v) -> list[list[Decimal]]:
    out = []
    for w_row in weights:
        row = []
        for c in range(len(v[0])):
            acc = Decimal(0)
            for w, v_row in zip(w_row, v):
                acc += w * v_row[c]
            row.append(acc)
        out.append(row)
    return out


def oracle_scores(q, k, scale=None) -> list[list[Decimal]]:
    """Scaled scores ``q k^T * scale`` (default ``1/sqrt(head_dim)`` at 50 digits), ``[Lq][Lk]``.

    Parameters
    ----------
    q : array_like, float, [Lq, head_dim]
    k : array_like, float, [Lk, head_dim]
    scale : float, optional
    """
    qd, kd = to_decimal_matrix("q", q), to_decimal_matrix("k", k)
    with localcontext() as ctx:
        ctx.prec = PRECISION
        return _scores(qd, kd, scale)


def oracle_weights(q, k, query_start: int = 0, scale=None) -> list[list[Decimal]]:
    """Causal softmax weights ``[Lq][Lk]``; masked keys get ``Decimal(0)``."""
    qd, kd = to_decimal_matrix("q", q), to_decimal_matrix("k", k)
    query_start = _check_query_start(query_start, len(qd), len(kd))
    with localcontext() as ctx:
        ctx.prec = PRECISION
        return _causal_softmax(_scores(qd, kd, scale), query_start)


def oracle_attention(q, k, v, query_start: int = 0, scale=None) -> OracleResult:
    """Scores, causal weights and context of one head.

    Parameters
    ----------
    q : array_like, float, [Lq, head_dim]
    k : array_like, float, [Lk, head_dim]
    v : array_like, float, [Lk, head_dim_v]
    query_start : int
        Absolute position of query 0.
    scale : float, optional
        Defaults to ``1/sqrt(head_dim)``, computed in Decimal.
    """
    qd, kd, vd = to_decimal_matrix("q", q), to_decimal_matrix("k", k), to_decimal_matrix("v", v)
    if len(vd) != len(kd):
        raise ValueError(f"v: expected {len(kd)} keys (k's rows), got {len(vd)}")
    query_start = _check_query_start(query_start, len(qd), len(kd))
    with localcontext() as ctx:
        ctx.prec = PRECISION
        scores = _scores(qd, kd, scale)
        weights = _causal_softmax(scores, query_start)
        return OracleResult(scores, weights, _context(weights, vd))


def oracle_context(q, k, v, query_start: int = 0, scale=None) -> list[list[Decimal]]:
    """Context ``[Lq][head_dim_v]`` of :func:`oracle_attention`."""
    return oracle_attention(q, k, v, query_start, scale).context
