"""The audit's parts that reproduce the source document's own figures: the worked 3-token example (section 3),
the cached query with the right and the wrong offset (section 4), the Decimal oracle and the two deliberate bugs
(section 5), the KV byte formula and its table (section 6). Each part returns a `audit_checks.Section`.
"""
from __future__ import annotations

import math

import numpy as np

from . import dense, oracle
from .audit_checks import (TOL_2, TOL_3, TOL_6, TOL_HAND, TOL_ROUNDOFF, Section, at_most, close, decimal_error,
                           equal, matrix_table, softmax_rows)
from .example import example_qkv
from .memory import gib, kv_bytes, parameter_bytes
from .naive_cache import NaiveKVCache

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


def section_example() -> Section:
    """Section 3: scores, masked scores, weights and context of the 3-token example."""
    s = Section()
    q, k, v = example_qkv()
    res = dense.attention(q, k, v, query_start=0)
    s.tables["scores.csv"] = matrix_table(res.scores, "key")
    s.tables["masked_scores.csv"] = matrix_table(res.masked_scores, "key")
    s.tables["weights.csv"] = matrix_table(res.weights, "key")
    s.tables["context.csv"] = matrix_table(res.context, "out")

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
                error = decimal_error(exact_value, got[i, j])
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


def reversed_mask_weights(scores: np.ndarray) -> np.ndarray:
    """Deliberate bug: the causal mask reversed (key ``j >= i`` allowed instead of ``j <= i``)."""
    n = scores.shape[-1]
    allow = np.arange(n)[None, :] >= np.arange(n)[:, None]
    return softmax_rows(np.where(allow, scores, -np.inf))


def column_normalised_weights(masked: np.ndarray) -> np.ndarray:
    """Deliberate bug: softmax over the query axis (columns) instead of the key axis."""
    return softmax_rows(masked, axis=-2)


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
