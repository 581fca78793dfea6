"""The 50-digit Decimal oracle: exact binary64 inputs, and agreement with the dense float64 code."""
import ast
from decimal import Decimal
from pathlib import Path

import numpy as np
import pytest

from reference import dense, oracle
from reference.example import example_qkv

# dense float64 vs the oracle: |dense - oracle| <= ATOL + RTOL * |oracle|
ATOL = 1e-15
RTOL = 1e-13


def decimal_error(exact, approx) -> float:
    return float(abs(exact - Decimal(float(approx))))


def test_inputs_are_converted_exactly_from_binary64():
    rows = oracle.to_decimal_matrix("q", np.array([[0.1, -2.5e-300]]))
    assert rows[0][0] == Decimal(0.1) != Decimal("0.1")  # all 55 digits of the binary64 value
    assert rows[0][1] == Decimal(-2.5e-300)
    # products are then rounded to 50 significant digits, not to the decimal literal 0.1
    scores = oracle.oracle_scores(np.array([[0.1]]), np.array([[1.0]]), scale=1.0)
    assert str(scores[0][0]) == "0.10000000000000000555111512312578270211815834045410"


def test_default_scale_is_one_over_sqrt_head_dim_at_50_digits():
    scores = oracle.oracle_scores(np.ones((1, 3)), np.ones((1, 3)))
    expected = Decimal(3) / Decimal(3).sqrt()  # sqrt(3), default context is enough to compare 25 digits
    assert abs(scores[0][0] - expected) < Decimal("1e-25")
    assert len(str(scores[0][0]).replace(".", "").lstrip("0")) >= 45


def test_example_all_values_agree_with_dense():
    q, k, v = example_qkv()
    res = dense.attention(q, k, v)
    ref = oracle.oracle_attention(q, k, v)
    score_err = max(decimal_error(ref.scores[i][j], res.scores[i, j]) for i in range(3) for j in range(3))
    weight_err = max(decimal_error(ref.weights[i][j], res.weights[i, j]) for i in range(3) for j in range(3))
    out_err = max(decimal_error(ref.context[i][c], res.context[i, c]) for i in range(3) for c in range(2))
    # the document reports a max score error of 1.1e-16
    assert 0 < score_err <= 1e-15
    assert score_err == pytest.approx(1.1e-16, rel=0.1)
    assert weight_err <= 1e-15 and out_err <= 1e-15
    assert sum(len(r) for r in ref.scores) == 9 and sum(len(r) for r in ref.weights) == 9
    assert sum(len(r) for r in ref.context) == 6


def test_masked_weights_are_exact_zeros_and_rows_sum_to_one():
    q, k, v = example_qkv()
    weights = oracle.oracle_weights(q, k)
    assert weights[0][1] == weights[0][2] == weights[1][2] == Decimal(0)
    for row in weights:
        assert abs(sum(row) - 1) < Decimal("1e-45")


def test_query_start_shifts_the_mask():
    q, k, v = example_qkv()
    cached = oracle.oracle_context(q[2:], k, v, query_start=2)
    full = oracle.oracle_context(q, k, v)
    assert all(abs(a - b) < Decimal("1e-45") for a, b in zip(cached[0], full[2]))
    wrong = oracle.oracle_context(q[2:], k, v, query_start=0)
    assert [float(x) for x in wrong[0]] == [1.0, 0.0]


@pytest.mark.parametrize("seed", range(12))
def test_random_small_cases_agree_with_dense(seed):
    rng = np.random.default_rng(seed)
    num_keys = int(rng.integers(1, 7))
    num_queries = int(rng.integers(1, num_keys + 1))
    query_start = int(rng.integers(0, num_keys - num_queries + 1))
    head_dim, head_dim_v = int(rng.integers(1, 6)), int(rng.integers(1, 4))
    q = rng.standard_normal((num_queries, head_dim)) * 3
    k = rng.standard_normal((num_keys, head_dim)) * 3
    v = rng.standard_normal((num_keys, head_dim_v))
    res = dense.attention(q, k, v, query_start)
    ref = oracle.oracle_attention(q, k, v, query_start)
    for got, exact in ((res.scores, ref.scores), (res.weights, ref.weights), (res.context, ref.context)):
        exact_f = np.array(oracle.to_float_matrix(exact))
        np.testing.assert_allclose(got, exact_f, rtol=RTOL, atol=ATOL)


def test_oracle_rejects_non_finite_and_bad_inputs():
    q, k, v = example_qkv()
    bad = q.copy()
    bad[1, 2] = np.nan
    with pytest.raises(ValueError, match=r"q: expected finite values, got nan at index \(1, 2\)"):
        oracle.oracle_scores(bad, k)
    with pytest.raises(TypeError, match="k: expected a float dtype, got int64"):
        oracle.oracle_scores(q, k.astype(np.int64))
    with pytest.raises(ValueError, match="k: expected head_dim 4"):
        oracle.oracle_scores(q, k[:, :2])
    with pytest.raises(ValueError, match="query_start: expected query_start \\+ Lq <= Lk = 3"):
        oracle.oracle_context(q, k, v, query_start=1)
    with pytest.raises(ValueError, match="query_start: expected a non-negative int, got True"):
        oracle.oracle_context(q[2:], k, v, query_start=True)


def test_oracle_uses_numpy_only_to_read_inputs():
    """Static guard: the only numpy names oracle.py touches are the ones that read arrays into floats."""
    source = Path(oracle.__file__).read_text(encoding="utf-8")
    used = {node.attr for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "np"}
    assert used <= {"asarray", "float64"}
    assert ".tolist()" in source
