"""Dense float64 attention against the source document's printed figures and against itself.

The expected numbers below are typed from the document (section 3-5), not produced by our code.
"""
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from reference import dense
from reference.example import example_qkv

NEG_INF = -math.inf

# --- the document's figures -----------------------------------------------------------------
DOC_SCORES = np.array([[0.530, 0.095, -0.075], [-0.080, 0.870, 0.155], [-0.165, 0.260, 1.160]])
DOC_MASKED = np.array([[0.530, NEG_INF, NEG_INF], [-0.080, 0.870, NEG_INF], [-0.165, 0.260, 1.160]])
DOC_WEIGHTS = np.array([[1.000000, 0.000000, 0.000000],
                        [0.278885, 0.721115, 0.000000],
                        [0.158938, 0.243109, 0.597953]])
DOC_CONTEXT = np.array([[1.000000, 0.000000], [0.278885, 0.721115], [-0.439015, -0.354843]])
PRINTED_3 = 5e-4  # half a unit of the 3rd decimal
PRINTED_6 = 5e-7  # half a unit of the 6th decimal


@pytest.fixture
def qkv():
    return example_qkv()


def test_example_inputs_are_the_documents():
    q, k, v = example_qkv()
    assert q.tolist() == [[1.0, 0.5, -0.2, 0.1], [-0.5, 1.2, 0.8, -0.4], [0.2, -0.1, 1.5, 0.9]]
    assert k.tolist() == [[0.8, 0.4, -0.3, 0.0], [-0.2, 1.0, 0.5, -0.1], [0.1, -0.2, 1.1, 0.7]]
    assert v.tolist() == [[1.0, 0.0], [0.0, 1.0], [-1.0, -1.0]]


def test_first_score_by_hand(qkv):
    q, k, _ = qkv
    # (1*0.8 + 0.5*0.4 + (-0.2)*(-0.3) + 0.1*0) / 2 = 0.53
    assert dense.scaled_scores(q, k)[0, 0] == pytest.approx(0.53, abs=1e-15)


def test_scores_and_masked_scores_match_printed_tables(qkv):
    q, k, _ = qkv
    scores = dense.scaled_scores(q, k)
    np.testing.assert_allclose(scores, DOC_SCORES, rtol=0, atol=PRINTED_3)
    masked = dense.masked_scores(q, k, query_start=0)
    assert np.array_equal(np.isneginf(masked), np.isneginf(DOC_MASKED))
    finite = np.isfinite(DOC_MASKED)
    np.testing.assert_allclose(masked[finite], DOC_MASKED[finite], rtol=0, atol=PRINTED_3)
    assert np.array_equal(masked[finite], scores[finite])  # masking does not touch visible scores


def test_weights_and_context_match_printed_tables(qkv):
    res = dense.attention(*qkv)
    np.testing.assert_allclose(res.weights, DOC_WEIGHTS, rtol=0, atol=PRINTED_6)
    np.testing.assert_allclose(res.context, DOC_CONTEXT, rtol=0, atol=PRINTED_6)
    assert res.weights[1, 0] == pytest.approx(0.278885, abs=PRINTED_6)
    assert res.weights[1, 1] == pytest.approx(0.721115, abs=PRINTED_6)
    assert res.context[2, 0] == pytest.approx(-0.439015, abs=PRINTED_6)
    assert res.context[2, 1] == pytest.approx(-0.354843, abs=PRINTED_6)
    assert np.all(res.weights[np.triu_indices(3, 1)] == 0.0)


def test_query_one_worked_through(qkv):
    res = dense.attention(*qkv)
    shifted = res.masked_scores[1] - res.masked_scores[1].max()
    assert shifted[0] == pytest.approx(-0.95, abs=1e-15)
    assert shifted[1] == 0.0 and shifted[2] == NEG_INF
    denominator = math.exp(-0.95) + 1.0
    assert res.weights[1, 0] == pytest.approx(math.exp(-0.95) / denominator, abs=1e-16)
    assert res.weights[1, 1] == pytest.approx(1.0 / denominator, abs=1e-16)


def test_query_two_output_is_weight_differences(qkv):
    res = dense.attention(*qkv)
    w = res.weights[2]
    np.testing.assert_allclose(res.context[2], [w[0] - w[2], w[1] - w[2]], rtol=0, atol=1e-15)
    assert np.all(res.context[2] < 0)


def test_batch_matches_per_head_loops():
    rng = np.random.default_rng(42)
    q = rng.standard_normal((2, 3, 7, 4))
    k = rng.standard_normal((2, 3, 7, 4))
    v = rng.standard_normal((2, 3, 7, 5))
    res = dense.attention(q, k, v)
    assert res.scores.shape == (2, 3, 7, 7) and res.context.shape == (2, 3, 7, 5)
    for b in range(2):
        for h in range(3):
            single = dense.attention(q[b, h], k[b, h], v[b, h])
            np.testing.assert_allclose(res.scores[b, h], single.scores, rtol=0, atol=1e-15)
            np.testing.assert_allclose(res.weights[b, h], single.weights, rtol=0, atol=1e-15)
            np.testing.assert_allclose(res.context[b, h], single.context, rtol=0, atol=1e-15)
            # the loop itself against the textbook formula with an explicit transpose of a 2-D K
            expected = q[b, h] @ k[b, h].T / 2.0
            np.testing.assert_allclose(single.scores, expected, rtol=0, atol=1e-15)


def test_batched_transpose_is_last_two_axes_only():
    """K.T on a 4-D tensor reverses every axis; the batched scores must pair (b, h) with (b, h)."""
    rng = np.random.default_rng(0)
    q = rng.standard_normal((2, 3, 4, 4))
    k = rng.standard_normal((2, 3, 4, 4))
    scores = dense.scaled_scores(q, k)
    expected = np.einsum("bhqd,bhkd->bhqk", q, k) / 2.0
    np.testing.assert_allclose(scores, expected, rtol=0, atol=1e-15)


def test_cached_last_query_with_right_and_wrong_offset(qkv):
    q, k, v = qkv
    full = dense.attention(q, k, v)
    right = dense.attention(q[2:3], k, v, query_start=2)
    np.testing.assert_allclose(right.context[0], full.context[2], rtol=0, atol=1e-15)
    wrong = dense.attention(q[2:3], k, v, query_start=0)
    np.testing.assert_allclose(wrong.context[0], [1.0, 0.0], rtol=0, atol=PRINTED_6)
    assert np.abs(wrong.context[0] - full.context[2]).max() == pytest.approx(1.439015, abs=PRINTED_6)
    assert wrong.weights[0].sum() == pytest.approx(1.0, abs=1e-15)  # row sums cannot catch it
    assert wrong.context.shape == right.context.shape == (1, 2)


def test_future_kv_and_last_v_changes_leave_earlier_outputs_bit_identical(qkv):
    q, k, v = qkv
    base = dense.attention(q, k, v).context
    k2, v2 = k.copy(), v.copy()
    k2[2] = [9.0, -3.0, 2.5, 7.0]
    v2[2] = [4.0, 8.0]
    future = dense.attention(q, k2, v2).context
    assert future[:2].tobytes() == base[:2].tobytes()
    v3 = v.copy()
    v3[2] = [2.0, 3.0]
    last = dense.attention(q, k, v3).context
    assert last[:2].tobytes() == base[:2].tobytes()
    assert not np.allclose(last[2], base[2])  # the edit shows where it should


def test_deliberate_bugs_give_the_documents_figures(qkv):
    q, k, _ = qkv
    scores = dense.scaled_scores(q, k)
    i, j = np.arange(3)[:, None], np.arange(3)[None, :]
    # bug 1: reversed causal mask (j >= i allowed instead of j <= i), softmax over keys
    rev = np.where(j >= i, scores, -np.inf)
    rev_w = np.exp(rev - rev.max(axis=1, keepdims=True))
    rev_w /= rev_w.sum(axis=1, keepdims=True)
    forbidden = rev_w[j > i].sum()  # total, over all rows, of the weight on future keys
    assert forbidden == pytest.approx(0.872569, abs=PRINTED_6)
    # bug 2: the right mask, but normalised over the query axis
    masked = dense.masked_scores(q, k)
    col_w = np.exp(masked - masked.max(axis=0, keepdims=True))
    col_w /= col_w.sum(axis=0, keepdims=True)
    assert np.abs(col_w.sum(axis=1) - 1.0).max() == pytest.approx(0.596413, abs=PRINTED_6)
    # the correct weights pass both detectors
    w = dense.attention_weights(q, k)
    assert w[j > i].sum() == 0.0
    assert np.abs(w.sum(axis=1) - 1.0).max() <= 1e-15


def test_padding_mask_combines_with_causal_by_and(qkv):
    q, k, v = qkv
    pad = np.array([True, False, True])
    res = dense.attention(q, k, v, key_padding_mask=pad)
    assert np.array_equal(np.isfinite(res.masked_scores),
                          [[True, False, False], [True, False, False], [True, False, True]])
    assert res.weights[1].tolist() == [1.0, 0.0, 0.0]
    # row 2 equals attention over keys 0 and 2 only
    sub = dense.attention(q[2:3], k[[0, 2]], v[[0, 2]], query_start=1)
    np.testing.assert_allclose(res.context[2], sub.context[0], rtol=0, atol=1e-15)


def test_batched_padding_mask_per_sequence():
    rng = np.random.default_rng(3)
    q, k, v = rng.standard_normal((2, 2, 3, 4)), rng.standard_normal((2, 2, 5, 4)), rng.standard_normal((2, 2, 5, 3))
    pad = np.array([[True, True, False, True, True], [True, True, True, True, False]])
    res = dense.attention(q, k, v, query_start=2, key_padding_mask=pad)
    for b in range(2):
        for h in range(2):
            single = dense.attention(q[b, h], k[b, h], v[b, h], query_start=2, key_padding_mask=pad[b])
            np.testing.assert_allclose(res.context[b, h], single.context, rtol=0, atol=1e-15)
    assert np.all(res.weights[0, :, :, 2] == 0.0) and np.all(res.weights[1, :, :, 4] == 0.0)
    shared = dense.attention(q, k, v, query_start=2, key_padding_mask=pad[0])  # (Lk,) broadcasts over B
    assert np.all(shared.weights[..., 2] == 0.0)


def test_lower_precision_inputs_are_computed_in_float64(qkv):
    q, k, v = (x.astype(np.float16) for x in qkv)
    res = dense.attention(q, k, v)
    assert res.context.dtype == np.float64
    expected = dense.attention(*(x.astype(np.float64) for x in (q, k, v)))
    assert res.context.tobytes() == expected.context.tobytes()


def test_inputs_are_not_modified(qkv):
    copies = [x.copy() for x in qkv]
    dense.attention(*qkv, key_padding_mask=np.array([True, True, False]))
    for x, c in zip(qkv, copies):
        assert x.tobytes() == c.tobytes()


def test_explicit_scale(qkv):
    q, k, _ = qkv
    np.testing.assert_allclose(dense.scaled_scores(q, k, scale=1.0), q @ k.T, rtol=0, atol=1e-15)


def test_causal_mask_from_absolute_positions():
    assert dense.causal_mask(2, 5, 2).tolist() == [[True, True, True, False, False],
                                                  [True, True, True, True, False]]
    assert dense.causal_mask(1, 3, 0).tolist() == [[True, False, False]]


# --- properties -------------------------------------------------------------------------------

@st.composite
def attention_case(draw):
    num_keys = draw(st.integers(1, 6))
    num_queries = draw(st.integers(1, num_keys))
    query_start = draw(st.integers(0, num_keys - num_queries))
    head_dim, head_dim_v = draw(st.integers(1, 4)), draw(st.integers(1, 3))
    seed = draw(st.integers(0, 2**32 - 1))
    scale = draw(st.sampled_from([1.0, 10.0, 100.0]))
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((num_queries, head_dim)) * scale
    k = rng.standard_normal((num_keys, head_dim)) * scale
    v = rng.standard_normal((num_keys, head_dim_v))
    pad = draw(st.none() | st.lists(st.booleans(), min_size=num_keys, max_size=num_keys).map(np.array))
    return q, k, v, query_start, pad


@settings(max_examples=150, deadline=None)
@given(attention_case())
def test_property_rows_sum_to_one_and_masked_keys_get_exactly_zero(case):
    q, k, v, query_start, pad = case
    allow = np.arange(k.shape[0])[None, :] <= query_start + np.arange(q.shape[0])[:, None]
    if pad is not None:
        allow = allow & pad[None, :]
    if not allow.any(axis=1).all():
        with pytest.raises(ValueError, match="key_padding_mask: expected at least one visible key"):
            dense.attention(q, k, v, query_start, key_padding_mask=pad)
        return
    res = dense.attention(q, k, v, query_start, key_padding_mask=pad)
    assert np.all(res.weights[~allow] == 0.0)
    assert np.all(np.isneginf(res.masked_scores[~allow]))
    assert np.all(res.weights >= 0.0) and np.all(res.weights <= 1.0)
    np.testing.assert_allclose(res.weights.sum(axis=1), 1.0, rtol=0, atol=4e-16 * k.shape[0])
    assert np.all(np.isfinite(res.context))
    # every context row is a convex combination of the visible values
    lo = np.where(allow[:, :, None], v[None], np.inf).min(axis=1)
    hi = np.where(allow[:, :, None], v[None], -np.inf).max(axis=1)
    assert np.all(res.context >= lo - 1e-12) and np.all(res.context <= hi + 1e-12)


@settings(max_examples=60, deadline=None)
@given(attention_case())
def test_property_block_of_queries_equals_rows_of_the_full_prefix(case):
    q, k, v, query_start, _ = case
    block = dense.attention_context(q, k, v, query_start)
    for i in range(q.shape[0]):  # each query alone, at its absolute position
        one = dense.attention_context(q[i:i + 1], k, v, query_start + i)
        np.testing.assert_allclose(block[i], one[0], rtol=0, atol=1e-12)
