"""Reproduce every figure of the source document and check each one.

    python -m reference.audit --out DIR [--reference DIR | --no-reference]

Writes into ``DIR`` one CSV per table (values ``%.17g``), ``checks.csv`` and ``audit.json`` (sha256 of
every ``reference/*.py`` source, Python/NumPy versions, every check with its measured figure, the
document's figure, the tolerance and the verdict).  The fresh CSVs are then compared with the committed
reference copy (``reference/results/`` unless ``--reference`` says otherwise) under a tolerance
(``|fresh - committed| <= 1e-12 + 1e-12 * |committed|``), never bit for bit.

Prints a short summary; the last line is ``ATTENTION_AUDIT_OK`` (exit 0) when every check and the
comparison pass, otherwise the failing checks are named and the exit status is 1.  Writing into the
committed reference copy is refused (exit 2).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import platform
import sys
from dataclasses import dataclass, field
from decimal import Decimal, localcontext
from pathlib import Path

import numpy as np

from . import dense, oracle
from .example import example_qkv
from .memory import gib, kv_bytes, parameter_bytes
from .naive_cache import NaiveKVCache
from .records import compare_csv, write_csv, write_json

__all__ = ["Check", "REFERENCE_DIR", "AuditResult", "run_checks", "main"]

PACKAGE_DIR = Path(__file__).resolve().parent
REFERENCE_DIR = PACKAGE_DIR / "results"
OK_LINE = "ATTENTION_AUDIT_OK"
COMPARE_ATOL = 1e-12
COMPARE_RTOL = 1e-12

# Tolerances for figures the document prints rounded: half a unit of the last printed digit.
TOL_6 = 5e-7   # 6 decimals
TOL_3 = 5e-4   # 3 decimals (the score tables)
TOL_2 = 5e-3   # 2 decimals (GiB)
TOL_HAND = 1e-12  # figures the document derives by exact hand arithmetic (0.53, -0.95)
TOL_ROUNDOFF = 1e-15  # float64 agreement between two computations of the same quantity

NEG_INF = -math.inf

# The document's printed figures (section 3).
DOC_SCORES = [[0.530, 0.095, -0.075], [-0.080, 0.870, 0.155], [-0.165, 0.260, 1.160]]
DOC_MASKED = [[0.530, NEG_INF, NEG_INF], [-0.080, 0.870, NEG_INF], [-0.165, 0.260, 1.160]]
DOC_WEIGHTS = [[1.000000, 0.000000, 0.000000], [0.278885, 0.721115, 0.000000],
               [0.158938, 0.243109, 0.597953]]
DOC_CONTEXT = [[1.000000, 0.000000], [0.278885, 0.721115], [-0.439015, -0.354843]]
DOC_HAND_SCORE = 0.53
DOC_QUERY1_SHIFTED = [-0.95, 0.0, NEG_INF]
# Section 4: the cached query with the wrong offset.
DOC_WRONG_OFFSET_OUTPUT = [1.0, 0.0]
DOC_WRONG_OFFSET_ERROR = 1.439015
# Section 5.
DOC_ORACLE_SCORE_ERROR = 1.1e-16
DOC_REVERSED_MASK_FORBIDDEN = 0.872569
DOC_COLUMN_NORM_ROW_SUM_ERROR = 0.596413
# Section 6: 32 layers, batch 1, 10,000 tokens, head_dim 128, 2-byte elements.
DOC_MHA_BYTES = 5_242_880_000
DOC_GIB = {"MHA": 4.88, "GQA": 1.22, "MQA": 0.15}
DOC_KV_HEADS = {"MHA": 32, "GQA": 8, "MQA": 1}
DOC_SMALL_ARRAY_BYTES = 480
DOC_WEIGHTS_GIB = 13.04


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


def _matrix_table(matrix, prefix: str) -> tuple[list, list]:
    """A ``[rows, cols]`` matrix as a table: a ``query`` index column, then ``<prefix>_<j>`` columns."""
    matrix = np.asarray(matrix)
    header = ["query"] + [f"{prefix}_{j}" for j in range(matrix.shape[1])]
    return header, [[i] + [float(x) for x in row] for i, row in enumerate(matrix)]


def _decimal_error(exact, approx: float) -> float:
    """``|exact - approx|`` evaluated in Decimal (``approx`` converted exactly), rounded to float."""
    with localcontext() as ctx:
        ctx.prec = oracle.PRECISION
        return float(abs(exact - Decimal(float(approx))))


def _softmax_rows(masked: np.ndarray, axis: int = -1) -> np.ndarray:
    shifted = masked - masked.max(axis=axis, keepdims=True)
    exps = np.exp(shifted)
    return exps / exps.sum(axis=axis, keepdims=True)


# ----------------------------------------------------------------------------------------------
# sections
# ----------------------------------------------------------------------------------------------

def section_example() -> Section:
    """Section 3: scores, masked scores, weights and context of the 3-token example."""
    s = Section()
    q, k, v = example_qkv()
    res = dense.attention(q, k, v, query_start=0)
    s.tables["scores.csv"] = _matrix_table(res.scores, "key")
    s.tables["masked_scores.csv"] = _matrix_table(res.masked_scores, "key")
    s.tables["weights.csv"] = _matrix_table(res.weights, "key")
    s.tables["context.csv"] = _matrix_table(res.context, "out")

    sec = "example"
    s.checks.append(close(sec, "hand score q0.k0/2", res.scores[0, 0], DOC_HAND_SCORE, TOL_HAND,
                          "(1*0.8 + 0.5*0.4 + (-0.2)*(-0.3) + 0.1*0) / 2"))
    for name, got, doc, tol in (("scores", res.scores, DOC_SCORES, TOL_3),
                                ("masked_scores", res.masked_scores, DOC_MASKED, TOL_3),
                                ("weights", res.weights, DOC_WEIGHTS, TOL_6),
                                ("context", res.context, DOC_CONTEXT, TOL_6)):
        for i, row in enumerate(doc):
            for j, value in enumerate(row):
                s.checks.append(close(sec, f"{name}[{i},{j}]", got[i, j], value, tol, "as printed"))

    shifted = res.masked_scores[1] - res.masked_scores[1].max()
    for j, value in enumerate(DOC_QUERY1_SHIFTED):
        s.checks.append(close(sec, f"query 1 shifted[{j}]", shifted[j], value, TOL_HAND,
                              "row 1 minus its largest visible score"))
    denominator = math.exp(-0.95) + 1.0
    s.checks.append(close(sec, "query 1 weight 0 = exp(-0.95)/(exp(-0.95)+1)", res.weights[1, 0],
                          math.exp(-0.95) / denominator, TOL_ROUNDOFF))
    w = res.weights[2]
    identity = np.array([w[0] - w[2], w[1] - w[2]])
    s.checks.append(at_most(sec, "query 2 output = [w20 - w22, w21 - w22] (max abs diff)",
                            np.abs(res.context[2] - identity).max(), TOL_ROUNDOFF))
    s.checks.append(at_most(sec, "weight rows sum to 1 (max abs error)",
                            np.abs(res.weights.sum(axis=-1) - 1.0).max(), TOL_ROUNDOFF))
    s.checks.append(equal(sec, "masked weights are exactly 0",
                          bool(np.all(res.weights[~dense.causal_mask(3, 3, 0)] == 0.0)), True))
    return s


def section_oracle() -> Section:
    """Section 5: the 50-digit Decimal oracle over all 9 scores, 9 weights and 6 outputs."""
    s = Section()
    q, k, v = example_qkv()
    res = dense.attention(q, k, v)
    ref = oracle.oracle_attention(q, k, v)
    rows = []
    errors = {}
    for quantity, got, exact in (("score", res.scores, ref.scores), ("weight", res.weights, ref.weights),
                                 ("output", res.context, ref.context)):
        worst = 0.0
        for i, exact_row in enumerate(exact):
            for j, exact_value in enumerate(exact_row):
                error = _decimal_error(exact_value, got[i, j])
                worst = max(worst, error)
                rows.append([quantity, i, j, float(got[i, j]), float(exact_value), str(exact_value), error])
        errors[quantity] = (worst, sum(len(r) for r in exact))
    s.tables["oracle.csv"] = (["quantity", "row", "col", "dense", "oracle", "oracle_decimal", "abs_error"], rows)
    sec = "oracle"
    s.checks.append(equal(sec, "values compared (scores, weights, outputs)",
                          f"{errors['score'][1]}, {errors['weight'][1]}, {errors['output'][1]}", "9, 9, 6"))
    s.checks.append(at_most(sec, "max score error vs Decimal", errors["score"][0], TOL_ROUNDOFF,
                            DOC_ORACLE_SCORE_ERROR, "document: max score error 1.1e-16"))
    s.checks.append(at_most(sec, "max weight error vs Decimal", errors["weight"][0], TOL_ROUNDOFF))
    s.checks.append(at_most(sec, "max output error vs Decimal", errors["output"][0], TOL_ROUNDOFF))
    s.details["errors"] = {key: value[0] for key, value in errors.items()}
    return s


def batch_inputs(seed: int = 42, batch: int = 2, heads: int = 3, length: int = 7, head_dim: int = 4,
                 head_dim_v: int = 5) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The batch case: ``q, k [B, H, L, head_dim]`` and ``v [B, H, L, head_dim_v]``, standard normal,
    drawn in the order q, k, v from ``np.random.default_rng(seed)``."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((batch, heads, length, head_dim))
    k = rng.standard_normal((batch, heads, length, head_dim))
    v = rng.standard_normal((batch, heads, length, head_dim_v))
    return q, k, v


def section_batch() -> Section:
    """Section 5: B=2, H=3, L=7, dk=4, dv=5, seed 42, batched vs per-head loops (and the oracle)."""
    s = Section()
    q, k, v = batch_inputs()
    batched = dense.attention(q, k, v)
    loop_err = np.zeros(q.shape[:3])
    oracle_err = np.zeros(q.shape[:3])
    rows = []
    weight_err = 0.0
    for b in range(q.shape[0]):
        for h in range(q.shape[1]):
            single = dense.attention(q[b, h], k[b, h], v[b, h])
            weight_err = max(weight_err, float(np.abs(batched.weights[b, h] - single.weights).max()))
            loop_err[b, h] = np.abs(batched.context[b, h] - single.context).max(axis=-1)
            exact = np.array(oracle.to_float_matrix(oracle.oracle_context(q[b, h], k[b, h], v[b, h])))
            oracle_err[b, h] = np.abs(batched.context[b, h] - exact).max(axis=-1)
            for t in range(q.shape[2]):
                rows.append([b, h, t] + [float(x) for x in batched.context[b, h, t]]
                            + [loop_err[b, h, t], oracle_err[b, h, t]])
    header = ["batch", "head", "position"] + [f"out_{c}" for c in range(v.shape[-1])] + \
             ["abs_err_vs_loop", "abs_err_vs_oracle"]
    s.tables["batch.csv"] = (header, rows)

    sec = "batch"
    s.checks.append(equal(sec, "context shape [B, H, L, dv]", str(batched.context.shape), "(2, 3, 7, 5)"))
    s.checks.append(at_most(sec, "batched vs per-head loop, context (max abs)", loop_err.max(), TOL_ROUNDOFF))
    s.checks.append(at_most(sec, "batched vs per-head loop, weights (max abs)", weight_err, TOL_ROUNDOFF))
    s.checks.append(at_most(sec, "batched vs Decimal oracle, context (max abs)", oracle_err.max(), 1e-14))

    # padding: batch 0 hides key 3, batch 1 hides keys 5 and 6
    pad = np.ones((2, 7), dtype=bool)
    pad[0, 3] = False
    pad[1, 5:] = False
    padded = dense.attention(q, k, v, key_padding_mask=pad)
    pad_err = max(float(np.abs(padded.context[b, h] - dense.attention(q[b, h], k[b, h], v[b, h],
                                                                      key_padding_mask=pad[b]).context).max())
                  for b in range(2) for h in range(3))
    s.checks.append(at_most(sec, "batched [B, Lk] padding mask vs per-head loop (max abs)", pad_err, TOL_ROUNDOFF))
    s.checks.append(equal(sec, "padded keys get exactly 0 weight",
                          bool(np.all(padded.weights[0, :, :, 3] == 0) and np.all(padded.weights[1, :, :, 5:] == 0)),
                          True))

    # future K/V at positions >= 4 do not move outputs 0..3
    k2, v2 = k.copy(), v.copy()
    k2[:, :, 4:] += 3.0
    v2[:, :, 4:] -= 5.0
    moved = dense.attention(q, k2, v2)
    s.checks.append(equal(sec, "future K/V (positions >= 4) change: outputs 0..3 bit-identical",
                          moved.context[:, :, :4].tobytes() == batched.context[:, :, :4].tobytes(), True))
    return s


def section_cache() -> Section:
    """Section 4: the cached last query, with the right (2) and the wrong (0) offset."""
    s = Section()
    q, k, v = example_qkv()
    full = dense.attention(q, k, v)

    cache = NaiveKVCache(num_kv_heads=1, head_dim=4, head_dim_v=2)
    cache.append(k[:2, None, :], v[:2, None, :])                # prefill positions 0, 1
    query_start = cache.append(k[2:, None, :], v[2:, None, :])  # decode step: append K/V, then read
    cached_k, cached_v = cache.k[:, 0, :], cache.v[:, 0, :]
    right = dense.attention(q[2:3], cached_k, cached_v, query_start=query_start)
    wrong = dense.attention(q[2:3], cached_k, cached_v, query_start=0)
    gqa = dense.decode_reference(q[2:3, None, :], cache.k, cache.v, query_start=query_start)

    right_err = float(np.abs(right.context[0] - full.context[2]).max())
    wrong_err = float(np.abs(wrong.context[0] - full.context[2]).max())
    rows = []
    for case, start, res, err in (("correct offset", query_start, right, right_err),
                                  ("wrong offset", 0, wrong, wrong_err)):
        rows.append([case, start] + [float(x) for x in res.weights[0]] + [float(res.weights[0].sum())]
                    + [float(x) for x in res.context[0]] + [err])
    header = ["case", "query_start", "w_0", "w_1", "w_2", "weight_sum", "out_0", "out_1", "max_abs_err_vs_full_row_2"]
    s.tables["cached_query.csv"] = (header, rows)

    sec = "cache"
    s.checks.append(equal(sec, "query_start = tokens cached before the step", query_start, 2))
    s.checks.append(equal(sec, "cached K/V byte-equal to the full K/V",
                          cached_k.tobytes() == k.tobytes() and cached_v.tobytes() == v.tobytes(), True))
    s.checks.append(at_most(sec, "query_start=2: max abs error vs full row 2", right_err, TOL_ROUNDOFF))
    s.checks.append(at_most(sec, "decode_reference (query_start=2) vs full row 2",
                            float(np.abs(gqa[0, 0] - full.context[2]).max()), TOL_ROUNDOFF))
    for c, value in enumerate(DOC_WRONG_OFFSET_OUTPUT):
        s.checks.append(close(sec, f"query_start=0: output[{c}]", wrong.context[0, c], value, TOL_6))
    s.checks.append(close(sec, "query_start=0: max abs error vs full row 2", wrong_err, DOC_WRONG_OFFSET_ERROR, TOL_6))
    s.checks.append(close(sec, "query_start=0: weight row still sums to 1", wrong.weights[0].sum(), 1.0, TOL_ROUNDOFF))
    s.checks.append(equal(sec, "query_start=0: output shape still (1, 2)", str(wrong.context.shape), "(1, 2)"))
    s.details["wrong_offset_output"] = [float(x) for x in wrong.context[0]]
    return s


def section_visibility() -> Section:
    """Section 5/7: changing future K/V, or only the last V, leaves earlier outputs bit-identical."""
    s = Section()
    q, k, v = example_qkv()
    base = dense.attention(q, k, v).context
    k_future, v_future = k.copy(), v.copy()
    k_future[2] = [5.0, -4.0, 3.0, 2.0]
    v_future[2] = [7.0, 9.0]
    future = dense.attention(q, k_future, v_future).context
    v_last = v.copy()
    v_last[2] = [2.0, 3.0]
    last = dense.attention(q, k, v_last).context

    rows = []
    for case, ctx in (("baseline", base), ("future K/V changed", future), ("last V changed", last)):
        for i in range(3):
            rows.append([case, i] + [float(x) for x in ctx[i]] + [ctx[i].tobytes() != base[i].tobytes()])
    s.tables["visibility.csv"] = (["case", "query", "out_0", "out_1", "differs_from_baseline"], rows)

    sec = "visibility"
    s.checks.append(equal(sec, "future K/V changed: outputs 0, 1 bit-identical",
                          future[:2].tobytes() == base[:2].tobytes(), True))
    s.checks.append(equal(sec, "last V changed: outputs 0, 1 bit-identical",
                          last[:2].tobytes() == base[:2].tobytes(), True))
    s.checks.append(equal(sec, "last V changed: output 2 does change", bool(np.any(last[2] != base[2])), True,
                          "the edit is visible where it should be"))
    return s


def reversed_mask_weights(scores: np.ndarray) -> np.ndarray:
    """Deliberate bug: the causal mask reversed (key ``j >= i`` allowed instead of ``j <= i``)."""
    n = scores.shape[-1]
    allow = np.arange(n)[None, :] >= np.arange(n)[:, None]
    return _softmax_rows(np.where(allow, scores, -np.inf))


def column_normalised_weights(masked: np.ndarray) -> np.ndarray:
    """Deliberate bug: softmax over the query axis (columns) instead of the key axis."""
    return _softmax_rows(masked, axis=-2)


def section_bugs() -> Section:
    """Section 5: the two deliberate bugs and the figures that expose them."""
    s = Section()
    q, k, v = example_qkv()
    res = dense.attention(q, k, v)
    allow = dense.causal_mask(3, 3, 0)
    reversed_w = reversed_mask_weights(res.scores)
    forbidden = np.where(allow, 0.0, reversed_w)          # weight on future keys j > i
    column_w = column_normalised_weights(res.masked_scores)
    row_sum_error = np.abs(column_w.sum(axis=-1) - 1.0)
    rows = []
    for bug, w in (("reversed causal mask", reversed_w), ("softmax over queries", column_w)):
        for i in range(3):
            rows.append([bug, i] + [float(x) for x in w[i]]
                        + [float(w[i].sum()), float(np.where(allow[i], 0.0, w[i]).sum())])
    s.tables["deliberate_bugs.csv"] = (["bug", "query", "w_0", "w_1", "w_2", "row_sum", "weight_on_future_keys"], rows)

    sec = "bugs"
    s.checks.append(close(sec, "reversed mask: total weight on future keys (sum over rows of j > i)",
                          forbidden.sum(), DOC_REVERSED_MASK_FORBIDDEN, TOL_6))
    s.checks.append(equal(sec, "reversed mask detected (weight on a future key > 0)",
                          bool(forbidden.max() > 0.0), True))
    s.checks.append(close(sec, "softmax over queries: max row-sum error", row_sum_error.max(),
                          DOC_COLUMN_NORM_ROW_SUM_ERROR, TOL_6))
    s.checks.append(equal(sec, "softmax over queries detected (row sums != 1)",
                          bool(row_sum_error.max() > TOL_ROUNDOFF), True))
    return s


def section_append_failure() -> Section:
    """Section 5: a failed append leaves the cached K/V byte-identical."""
    s = Section()
    _, k, v = example_qkv()
    cache = NaiveKVCache(num_kv_heads=1, head_dim=4, head_dim_v=2)
    cache.append(k[:2, None, :], v[:2, None, :])
    before = (cache.k.tobytes(), cache.v.tobytes(), cache.length)
    nan_v = v[2:, None, :].copy()
    nan_v[0, 0, 1] = np.nan
    cases = [("wrong K shape", k[2:, None, :3], v[2:, None, :]),
             ("NaN in new V", k[2:, None, :], nan_v),
             ("inf in new K", np.full((1, 1, 4), np.inf), v[2:, None, :]),
             ("K/V token counts differ", k[1:, None, :], v[2:, None, :])]
    rows = []
    sec = "append"
    for case, new_k, new_v in cases:
        try:
            cache.append(new_k, new_v)
            raised = "none"
        except (TypeError, ValueError) as exc:
            raised = type(exc).__name__
        unchanged = (cache.k.tobytes(), cache.v.tobytes(), cache.length) == before
        rows.append([case, raised, unchanged, cache.length])
        s.checks.append(equal(sec, f"{case}: append rejected", raised, "ValueError"))
        s.checks.append(equal(sec, f"{case}: K/V byte-identical afterwards", unchanged, True))
    s.tables["cache_append.csv"] = (["case", "raised", "kv_unchanged", "length_after"], rows)
    return s


def _rejection_cases() -> list:
    """(case, expected exception type, argument named by the message, callable)."""
    q, k, v = example_qkv()

    def with_value(arr, index, value):
        arr = arr.copy()
        arr[index] = value
        return arr

    q4 = np.zeros((2, 3, 3, 4))
    return [
        ("NaN in q", ValueError, "q", lambda: dense.attention(with_value(q, (1, 2), np.nan), k, v)),
        ("inf in k", ValueError, "k", lambda: dense.attention(q, with_value(k, (0, 1), np.inf), v)),
        ("-inf in v", ValueError, "v", lambda: dense.attention(q, k, with_value(v, (2, 0), -np.inf))),
        ("fully masked query row", ValueError, "key_padding_mask",
         lambda: dense.attention(q, k, v, key_padding_mask=np.array([False, True, True]))),
        ("all -inf row of masked scores", ValueError, "masked_scores",
         lambda: dense.softmax_over_keys(np.array([[0.0, -np.inf], [-np.inf, -np.inf]]))),
        ("q with 1 dimension", ValueError, "q", lambda: dense.attention(q[0], k, v)),
        ("q/k head_dim mismatch", ValueError, "k", lambda: dense.attention(q, k[:, :3], v)),
        ("k/v length mismatch", ValueError, "v", lambda: dense.attention(q, k, v[:2])),
        ("batched head count mismatch", ValueError, "k",
         lambda: dense.attention(q4, np.zeros((2, 2, 3, 4)), np.zeros((2, 2, 3, 2)))),
        ("negative query_start", ValueError, "query_start", lambda: dense.attention(q, k, v, query_start=-1)),
        ("non-integer query_start", ValueError, "query_start", lambda: dense.attention(q[2:], k, v, query_start=2.0)),
        ("bool query_start", ValueError, "query_start", lambda: dense.attention(q[2:], k, v, query_start=True)),
        ("query_start + Lq > Lk", ValueError, "query_start", lambda: dense.attention(q[1:], k, v, query_start=2)),
        ("int dtype", TypeError, "q", lambda: dense.attention(q.astype(np.int64), k, v)),
        ("bool dtype", TypeError, "k", lambda: dense.attention(q, k > 0, v)),
        ("complex dtype", TypeError, "v", lambda: dense.attention(q, k, v.astype(np.complex128))),
        ("object dtype", TypeError, "q", lambda: dense.attention(q.astype(object), k, v)),
        ("non-bool padding mask", TypeError, "key_padding_mask",
         lambda: dense.attention(q, k, v, key_padding_mask=np.array([1, 1, 1]))),
        ("padding mask shape", ValueError, "key_padding_mask",
         lambda: dense.attention(q, k, v, key_padding_mask=np.array([True, True]))),
        ("non-positive scale", ValueError, "scale", lambda: dense.attention(q, k, v, scale=0.0)),
        ("decode: num_q_heads not a multiple of num_kv_heads", ValueError, "q",
         lambda: dense.decode_reference(np.zeros((1, 3, 4)), np.zeros((3, 2, 4)), np.zeros((3, 2, 2)), 2)),
        ("decode: window 0", ValueError, "window",
         lambda: dense.decode_reference(np.zeros((1, 2, 4)), np.zeros((3, 1, 4)), np.zeros((3, 1, 2)), 2, window=0)),
    ]


def section_rejections() -> Section:
    """Section 4/5: every illegal input raises, and the message names the argument, expected and got."""
    s = Section()
    rows = []
    messages = {}
    for case, expected_type, argument, call in _rejection_cases():
        try:
            call()
            raised, message = "none", ""
        except Exception as exc:  # noqa: BLE001 - the audit records whatever happened
            raised, message = type(exc).__name__, str(exc)
        well_formed = message.startswith(f"{argument}: expected") and ", got " in message
        ok = raised == expected_type.__name__ and well_formed
        rows.append([case, expected_type.__name__, raised, argument, well_formed])
        messages[case] = message
        s.checks.append(equal("rejections", f"{case}: {expected_type.__name__} naming '{argument}'", ok, True,
                              "message in audit.json details"))
    s.tables["rejections.csv"] = (["case", "expected_error", "raised", "argument", "message_names_argument"], rows)
    s.details["messages"] = messages
    return s


def small_kv_arrays(layers: int = 2, batch: int = 1, tokens: int = 5, kv_heads: int = 3, head_dim: int = 4,
                    head_dim_v: int | None = None) -> list[tuple[np.ndarray, np.ndarray]]:
    """Real float16 K/V arrays, one ``(k, v)`` pair per layer, ``[batch, kv_heads, tokens, head_dim]``."""
    head_dim_v = head_dim if head_dim_v is None else head_dim_v
    return [(np.zeros((batch, kv_heads, tokens, head_dim), dtype=np.float16),
             np.zeros((batch, kv_heads, tokens, head_dim_v), dtype=np.float16)) for _ in range(layers)]


def section_memory() -> Section:
    """Section 6: the KV byte formula, the MHA/GQA/MQA table, the 480-byte arrays, 7e9 parameters."""
    s = Section()
    sec = "memory"
    rows = []
    results = {}
    for config, heads in DOC_KV_HEADS.items():
        nbytes = kv_bytes(layers=32, batch=1, tokens=10_000, kv_heads=heads, head_dim=128, bytes_per_element=2)
        results[config] = nbytes
        rows.append([config, 32, 1, 10_000, heads, 128, 2, nbytes, gib(nbytes)])
        s.checks.append(close(sec, f"{config} ({heads} KV heads) GiB", gib(nbytes), DOC_GIB[config], TOL_2))
    s.checks.insert(0, equal(sec, "MHA bytes", results["MHA"], DOC_MHA_BYTES))
    weights = parameter_bytes(7_000_000_000, 2)
    rows.append(["7e9 two-byte parameters", "", "", "", "", "", 2, weights, gib(weights)])
    s.tables["memory.csv"] = (["config", "layers", "batch", "tokens", "kv_heads", "head_dim", "bytes_per_element",
                               "bytes", "gib"], rows)
    s.checks.append(close(sec, "7e9 two-byte parameters GiB", gib(weights), DOC_WEIGHTS_GIB, TOL_2))
    s.checks.append(equal(sec, "10K-token MHA cache smaller than the 7e9-parameter weights",
                          results["MHA"] < weights, True))

    arrays = small_kv_arrays()
    measured = sum(k.nbytes + v.nbytes for k, v in arrays)
    formula = kv_bytes(layers=2, batch=1, tokens=5, kv_heads=3, head_dim=4, bytes_per_element=2)
    s.checks.append(equal(sec, "small float16 arrays: measured nbytes", measured, DOC_SMALL_ARRAY_BYTES,
                          "2 layers x (K, V) x [1, 3, 5, 4] float16"))
    s.checks.append(equal(sec, "small float16 arrays: formula = measured", formula, measured))
    return s


SECTIONS = (section_example, section_oracle, section_batch, section_cache, section_visibility, section_bugs,
            section_append_failure, section_rejections, section_memory)


# ----------------------------------------------------------------------------------------------
# running, writing, comparing
# ----------------------------------------------------------------------------------------------

@dataclass
class AuditResult:
    """All tables (file name -> (header, rows)), checks and per-section details."""

    tables: dict
    checks: list
    details: dict

    @property
    def failed(self) -> list:
        return [c for c in self.checks if not c.passed]


def run_checks() -> AuditResult:
    """Compute every section (no files written)."""
    tables, checks, details = {}, [], {}
    for make in SECTIONS:
        section = make()
        tables.update(section.tables)
        checks.extend(section.checks)
        details[make.__name__.removeprefix("section_")] = section.details
    return AuditResult(tables, checks, details)


def source_hashes() -> dict:
    """sha256 of every ``reference/*.py`` file, keyed ``reference/<name>``."""
    return {f"reference/{p.name}": hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(PACKAGE_DIR.glob("*.py"))}


def _inside(path: Path, directory: Path) -> bool:
    return path == directory or directory in path.parents


def compare_with_reference(out: Path, reference: Path) -> dict:
    """Compare every CSV in ``out`` with the same file in ``reference`` under the tolerance."""
    problems = []
    fresh = sorted(p.name for p in out.glob("*.csv"))
    committed = sorted(p.name for p in reference.glob("*.csv")) if reference.is_dir() else []
    if not committed:
        problems.append(f"no committed reference CSV files in {reference}")
    for name in sorted(set(committed) - set(fresh)):
        problems.append(f"{name}: in the reference copy but not produced")
    for name in sorted(set(fresh) - set(committed)):
        if committed:
            problems.append(f"{name}: produced but missing from the reference copy")
    compared = sorted(set(fresh) & set(committed))
    for name in compared:
        problems.extend(compare_csv(out / name, reference / name, COMPARE_ATOL, COMPARE_RTOL))
    return {"reference_dir": str(reference), "atol": COMPARE_ATOL, "rtol": COMPARE_RTOL,
            "files_compared": compared, "problems": problems, "passed": not problems, "skipped": False}


def _committed_hash_changes(reference: Path, hashes: dict) -> list:
    path = reference / "audit.json"
    try:
        committed = json.loads(path.read_text(encoding="utf-8")).get("sources", {})
    except (OSError, ValueError):
        return ["(no readable audit.json in the reference copy)"]
    return sorted(name for name in set(hashes) | set(committed) if hashes.get(name) != committed.get(name))


def write_outputs(result: AuditResult, out: Path) -> None:
    """Write every table, ``checks.csv`` (``audit.json`` is written by :func:`main`)."""
    out.mkdir(parents=True, exist_ok=True)
    for name, (header, rows) in result.tables.items():
        write_csv(out / name, header, rows)
    write_csv(out / "checks.csv", CHECK_HEADER, [c.row() for c in result.checks])


def _fmt(value, digits: int = 9) -> str:
    if isinstance(value, float):
        if value == 0 or not math.isfinite(value) or abs(value) >= 1e-4:
            return f"{value:.{digits}g}"
        return f"{value:.3g}"
    return str(value)


HEADLINES = [
    ("example", "hand score q0.k0/2"),
    ("example", "weights[1,0]"), ("example", "weights[1,1]"),
    ("example", "context[2,0]"), ("example", "context[2,1]"),
    ("oracle", "max score error vs Decimal"), ("oracle", "max weight error vs Decimal"),
    ("oracle", "max output error vs Decimal"),
    ("batch", "batched vs per-head loop, context (max abs)"),
    ("cache", "query_start=2: max abs error vs full row 2"),
    ("cache", "query_start=0: output[0]"), ("cache", "query_start=0: output[1]"),
    ("cache", "query_start=0: max abs error vs full row 2"),
    ("bugs", "reversed mask: total weight on future keys (sum over rows of j > i)"),
    ("bugs", "softmax over queries: max row-sum error"),
    ("memory", "MHA bytes"), ("memory", "MHA (32 KV heads) GiB"), ("memory", "GQA (8 KV heads) GiB"),
    ("memory", "MQA (1 KV heads) GiB"), ("memory", "small float16 arrays: measured nbytes"),
    ("memory", "7e9 two-byte parameters GiB"),
]


def summary_lines(result: AuditResult, comparison: dict | None) -> list[str]:
    lines = ["attention audit: measured vs document"]
    by_key = {(c.section, c.name): c for c in result.checks}
    for key in HEADLINES:
        c = by_key.get(key)
        if c is None:
            continue
        doc = "" if c.document is None else f" (document {c.document!r})"
        lines.append(f"  {'ok  ' if c.passed else 'FAIL'} {c.name}: {_fmt(c.measured)}{doc}")
    sections = {}
    for c in result.checks:
        total, ok = sections.get(c.section, (0, 0))
        sections[c.section] = (total + 1, ok + c.passed)
    lines.append("  checks by section: " + ", ".join(f"{s} {ok}/{total}" for s, (total, ok) in sections.items()))
    for c in result.failed:
        lines.append(f"  FAILED [{c.section}] {c.name}: measured {_fmt(c.measured)}, document {_fmt(c.document)}, "
                     f"tolerance {_fmt(c.tolerance)}")
    if comparison is None:
        lines.append("  reference comparison: skipped (--no-reference)")
    else:
        lines.append(f"  reference comparison with {comparison['reference_dir']}: "
                     f"{len(comparison['files_compared'])} files, "
                     + ("all within tolerance" if comparison["passed"] else f"{len(comparison['problems'])} problems"))
        for problem in comparison["problems"][:20]:
            lines.append(f"  FAILED reference: {problem}")
        if comparison.get("source_hashes_changed"):
            lines.append("  note: sources differ from the ones that produced the reference copy: "
                         + ", ".join(comparison["source_hashes_changed"]))
    return lines


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m reference.audit", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="audit-out", help="directory for the CSV/JSON files (default: audit-out)")
    parser.add_argument("--reference", default=str(REFERENCE_DIR),
                        help="committed reference copy to compare with (default: reference/results)")
    parser.add_argument("--no-reference", action="store_true",
                        help="skip the comparison (used once to create a reference copy); never prints the OK line")
    return parser


def main(argv=None) -> int:
    """Run the audit; returns the exit status (0 all passed, 1 a check failed, 2 usage error)."""
    try:
        args = _parser().parse_args(argv)
    except SystemExit as exc:
        return int(exc.code or 0)
    out = Path(args.out).resolve()
    reference = Path(args.reference).resolve()
    for protected in {REFERENCE_DIR, reference}:
        if _inside(out, protected):
            print(f"audit: refusing to write into {protected}, which holds the committed reference copy; "
                  "choose another --out", file=sys.stderr)
            return 2

    result = run_checks()
    write_outputs(result, out)
    hashes = source_hashes()
    comparison = None
    if not args.no_reference:
        comparison = compare_with_reference(out, reference)
        comparison["source_hashes_changed"] = _committed_hash_changes(reference, hashes)
    failed = [f"[{c.section}] {c.name}" for c in result.failed]
    all_passed = not failed and comparison is not None and comparison["passed"]
    payload = {
        "tool": "python -m reference.audit",
        "python": platform.python_version(),
        "numpy": np.__version__,
        "sources": hashes,
        "tolerances": {"printed_6_decimals": TOL_6, "printed_3_decimals": TOL_3, "printed_2_decimals": TOL_2,
                       "hand_arithmetic": TOL_HAND, "float64_roundoff": TOL_ROUNDOFF,
                       "reference_copy_atol": COMPARE_ATOL, "reference_copy_rtol": COMPARE_RTOL},
        "tables": sorted(list(result.tables) + ["checks.csv"]),
        "checks": [dict(zip(CHECK_HEADER, c.row())) for c in result.checks],
        "details": result.details,
        "summary": {"checks": len(result.checks), "passed": len(result.checks) - len(failed), "failed": failed,
                    "all_passed": all_passed},
        "reference_comparison": comparison if comparison is not None else {"skipped": True},
    }
    write_json(out / "audit.json", payload)

    for line in summary_lines(result, comparison):
        print(line)
    print(f"  wrote {len(result.tables) + 2} files to {out}")
    if all_passed:
        print(OK_LINE)
        return 0
    if not failed and comparison is None:
        print("all checks passed; ATTENTION_AUDIT_OK withheld because the reference comparison was skipped")
        return 0
    print(f"ATTENTION_AUDIT_FAILED: {len(failed)} checks failed"
          + ("" if comparison is None or comparison["passed"] else ", reference copy differs"))
    return 1


if __name__ == "__main__":
    sys.exit(main())
