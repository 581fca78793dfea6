"""decode_reference (GQA, sliding window) against the dense single-head attention."""
import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from reference import dense
from reference.dense import decode_reference
from reference.example import example_qkv


def make(rng, tokens, length, num_q_heads, num_kv_heads, head_dim=4, head_dim_v=3):
    q = rng.standard_normal((tokens, num_q_heads, head_dim))
    k = rng.standard_normal((length, num_kv_heads, head_dim))
    v = rng.standard_normal((length, num_kv_heads, head_dim_v))
    return q, k, v


def test_document_example_as_one_head():
    q, k, v = example_qkv()
    full = decode_reference(q[:, None, :], k[:, None, :], v[:, None, :], query_start=0)
    np.testing.assert_allclose(full[:, 0, :], [[1.0, 0.0], [0.278885, 0.721115], [-0.439015, -0.354843]],
                               rtol=0, atol=5e-7)
    last = decode_reference(q[2:, None, :], k[:, None, :], v[:, None, :], query_start=2)
    np.testing.assert_allclose(last[0, 0], full[2, 0], rtol=0, atol=1e-15)


@pytest.mark.parametrize("num_q_heads, num_kv_heads", [(4, 4), (4, 2), (6, 2), (4, 1)])
def test_gqa_head_mapping_matches_dense_per_head(num_q_heads, num_kv_heads):
    rng = np.random.default_rng(num_q_heads * 10 + num_kv_heads)
    q, k, v = make(rng, tokens=3, length=8, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads)
    out = decode_reference(q, k, v, query_start=5)
    assert out.shape == (3, num_q_heads, 3) and out.dtype == np.float64
    group = num_q_heads // num_kv_heads
    for h in range(num_q_heads):
        expected = dense.attention_context(q[:, h, :], k[:, h // group, :], v[:, h // group, :], query_start=5)
        np.testing.assert_allclose(out[:, h, :], expected, rtol=0, atol=1e-14)


def test_head_h_reads_kv_head_h_over_group():
    """Give each KV head a constant V equal to its index: the output reveals which KV head was read."""
    rng = np.random.default_rng(1)
    q, k, _ = make(rng, tokens=2, length=4, num_q_heads=6, num_kv_heads=3)
    v = np.broadcast_to(np.arange(3.0)[None, :, None], (4, 3, 2)).copy()
    out = decode_reference(q, k, v, query_start=2)
    np.testing.assert_allclose(out[0, :, 0], [0, 0, 1, 1, 2, 2], rtol=0, atol=1e-15)


@pytest.mark.parametrize("window", [1, 2, 3, 10])
def test_sliding_window_reads_positions_p_minus_window_exclusive_to_p(window):
    rng = np.random.default_rng(window)
    q, k, v = make(rng, tokens=3, length=6, num_q_heads=2, num_kv_heads=1)
    out = decode_reference(q, k, v, query_start=3, window=window)
    for t in range(3):
        p = 3 + t
        pad = (np.arange(6) > p - window)  # keys in (p - window, p]; the causal part is dense's job
        for h in range(2):
            expected = dense.attention_context(q[t:t + 1, h, :], k[:, 0, :], v[:, 0, :], query_start=p,
                                               key_padding_mask=pad)
            np.testing.assert_allclose(out[t, h], expected[0], rtol=0, atol=1e-14)


def test_window_one_returns_the_own_value_and_a_large_window_equals_none():
    rng = np.random.default_rng(7)
    q, k, v = make(rng, tokens=4, length=4, num_q_heads=2, num_kv_heads=2)
    own = decode_reference(q, k, v, query_start=0, window=1)
    np.testing.assert_allclose(own, v, rtol=0, atol=0)
    big = decode_reference(q, k, v, query_start=0, window=4)
    assert big.tobytes() == decode_reference(q, k, v, query_start=0).tobytes()


def test_future_keys_beyond_the_block_are_ignored():
    rng = np.random.default_rng(11)
    q, k, v = make(rng, tokens=2, length=7, num_q_heads=2, num_kv_heads=1)
    base = decode_reference(q, k, v, query_start=2)
    k[4:] = 50.0
    v[4:] = -9.0
    assert decode_reference(q, k, v, query_start=2).tobytes() == base.tobytes()


def test_float16_inputs_and_explicit_scale():
    rng = np.random.default_rng(5)
    q, k, v = make(rng, tokens=1, length=3, num_q_heads=2, num_kv_heads=1)
    half = decode_reference(q.astype(np.float16), k.astype(np.float16), v.astype(np.float16), 2, scale=0.25)
    expected = decode_reference(*(x.astype(np.float16).astype(np.float64) for x in (q, k, v)), 2, scale=0.25)
    assert half.dtype == np.float64 and half.tobytes() == expected.tobytes()


@pytest.mark.parametrize("kwargs, error, pattern", [
    (dict(q=np.zeros((1, 3, 4)), k=np.zeros((3, 2, 4)), v=np.zeros((3, 2, 2)), query_start=2), ValueError,
     "q: expected num_q_heads divisible by num_kv_heads = 2, got 3"),
    (dict(q=np.zeros((1, 2, 4)), k=np.zeros((3, 1, 4)), v=np.zeros((3, 1, 2)), query_start=2, window=0), ValueError,
     "window: expected None or an int >= 1, got 0"),
    (dict(q=np.zeros((1, 2, 4)), k=np.zeros((3, 1, 4)), v=np.zeros((3, 1, 2)), query_start=2, window=True),
     ValueError, "window: expected None or an int >= 1, got True"),
    (dict(q=np.zeros((1, 2, 4)), k=np.zeros((3, 1, 5)), v=np.zeros((3, 1, 2)), query_start=2), ValueError,
     "k: expected head_dim 4 (q's last axis), got 5"),
    (dict(q=np.zeros((1, 2, 4)), k=np.zeros((3, 1, 4)), v=np.zeros((2, 1, 2)), query_start=2), ValueError,
     "v: expected [L, num_kv_heads] = (3, 1) like k, got (2, 1)"),
    (dict(q=np.zeros((2, 4)), k=np.zeros((3, 1, 4)), v=np.zeros((3, 1, 2)), query_start=2), ValueError,
     "q: expected 3 dimensions [T, num_q_heads, head_dim], got shape (2, 4)"),
    (dict(q=np.zeros((2, 2, 4)), k=np.zeros((3, 1, 4)), v=np.zeros((3, 1, 2)), query_start=2), ValueError,
     "query_start: expected query_start + Lq <= Lk = 3, got 2 + 2 = 4"),
    (dict(q=np.zeros((1, 2, 4), dtype=np.int32), k=np.zeros((3, 1, 4)), v=np.zeros((3, 1, 2)), query_start=2),
     TypeError, "q: expected a float dtype (float16, float32 or float64), got int32"),
    (dict(q=np.zeros((1, 2, 4)), k=np.full((3, 1, 4), np.nan), v=np.zeros((3, 1, 2)), query_start=2),
     ValueError, "k: expected finite values, got nan at index (0, 0, 0)"),
])
def test_decode_reference_rejects(kwargs, error, pattern):
    with pytest.raises(error, match=re.escape(pattern)):
        decode_reference(**kwargs)


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 3), st.integers(0, 4), st.sampled_from([(1, 1), (2, 1), (4, 2), (3, 3)]),
       st.none() | st.integers(1, 5), st.integers(0, 2**32 - 1))
def test_property_outputs_are_convex_combinations_of_the_window(tokens, extra, heads, window, seed):
    num_q_heads, num_kv_heads = heads
    rng = np.random.default_rng(seed)
    length = tokens + extra
    q, k, v = make(rng, tokens, length, num_q_heads, num_kv_heads)
    query_start = extra
    out = decode_reference(q, k, v, query_start, window=window)
    group = num_q_heads // num_kv_heads
    for t in range(tokens):
        p = query_start + t
        first = 0 if window is None else max(0, p - window + 1)
        for h in range(num_q_heads):
            seen = v[first:p + 1, h // group]
            assert np.all(out[t, h] >= seen.min(axis=0) - 1e-12) and np.all(out[t, h] <= seen.max(axis=0) + 1e-12)
