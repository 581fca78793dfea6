"""The naive concat cache (transactional append) and the KV byte formula (document section 6)."""
import re

import numpy as np
import pytest

from reference import dense
from reference.example import example_qkv
from reference.memory import GIB, gib, kv_bytes, parameter_bytes
from reference.naive_cache import NaiveKVCache


@pytest.fixture
def cache():
    _, k, v = example_qkv()
    c = NaiveKVCache(num_kv_heads=1, head_dim=4, head_dim_v=2)
    assert c.append(k[:2, None, :], v[:2, None, :]) == 0
    return c


def test_decode_step_appends_then_reads_with_the_cached_length(cache):
    q, k, v = example_qkv()
    query_start = cache.append(k[2:, None, :], v[2:, None, :])
    assert query_start == 2 and cache.length == 3
    assert cache.k[:, 0].tobytes() == k.tobytes() and cache.v[:, 0].tobytes() == v.tobytes()
    out = dense.attention_context(q[2:], cache.k[:, 0], cache.v[:, 0], query_start=query_start)
    np.testing.assert_allclose(out[0], [-0.439015, -0.354843], rtol=0, atol=5e-7)


def nan_at(arr, index):
    arr = arr.copy()
    arr[index] = np.nan
    return arr


_, K, V = example_qkv()
FAILURES = [
    ("wrong K head_dim", K[2:, None, :3], V[2:, None, :], ValueError, "k: expected shape [T, 1, 4], got (1, 1, 3)"),
    ("wrong V rank", K[2:, None, :], V[2:], ValueError, "v: expected shape [T, 1, 2], got (1, 2)"),
    ("NaN in new K", nan_at(K[2:, None, :], (0, 0, 3)), V[2:, None, :], ValueError,
     "k: expected finite values, got nan at index (0, 0, 3)"),
    ("NaN in new V", K[2:, None, :], nan_at(V[2:, None, :], (0, 0, 1)), ValueError,
     "v: expected finite values, got nan at index (0, 0, 1)"),
    ("token counts differ", K[1:, None, :], V[2:, None, :], ValueError, "v: expected 2 tokens like k, got 1"),
    ("int K", K[2:, None, :].astype(np.int64), V[2:, None, :], TypeError, "k: expected a float dtype"),
]


@pytest.mark.parametrize("case, new_k, new_v, error, pattern", FAILURES, ids=[f[0] for f in FAILURES])
def test_failed_append_leaves_kv_byte_identical(cache, case, new_k, new_v, error, pattern):
    before_k, before_v, before_len = cache.k.tobytes(), cache.v.tobytes(), cache.length
    with pytest.raises(error, match=re.escape(pattern)):
        cache.append(new_k, new_v)
    assert cache.k.tobytes() == before_k and cache.v.tobytes() == before_v and cache.length == before_len
    # and the cache still works afterwards
    assert cache.append(K[2:, None, :], V[2:, None, :]) == 2


def test_appended_arrays_are_copies(cache):
    new_k, new_v = K[2:, None, :].copy(), V[2:, None, :].copy()
    cache.append(new_k, new_v)
    new_k[:] = 99.0
    assert cache.k[2, 0].tolist() == K[2].tolist()


def test_cache_constructor_rejects_bad_sizes():
    with pytest.raises(ValueError, match="head_dim: expected an int >= 1, got 0"):
        NaiveKVCache(num_kv_heads=1, head_dim=0)
    with pytest.raises(ValueError, match="num_kv_heads: expected an int >= 1, got True"):
        NaiveKVCache(num_kv_heads=True, head_dim=4)


# --- the KV byte formula ---------------------------------------------------------------------

DOC_TABLE = [("MHA", 32, 4.88), ("GQA", 8, 1.22), ("MQA", 1, 0.15)]  # 32 layers, 10,000 tokens, d=128, 2 B


def test_mha_bytes_exactly():
    assert kv_bytes(layers=32, batch=1, tokens=10_000, kv_heads=32, head_dim=128, bytes_per_element=2) \
        == 5_242_880_000


@pytest.mark.parametrize("name, kv_heads, doc_gib", DOC_TABLE)
def test_documents_gib_table(name, kv_heads, doc_gib):
    nbytes = kv_bytes(32, 1, 10_000, kv_heads, 128, 2)
    assert nbytes == 2 * 32 * 1 * 10_000 * kv_heads * 128 * 2
    assert round(nbytes / 2**30, 2) == doc_gib
    assert gib(nbytes) == pytest.approx(doc_gib, abs=5e-3)


def test_seven_billion_two_byte_parameters():
    weights = parameter_bytes(7_000_000_000, 2)
    assert round(weights / GIB, 2) == 13.04
    assert kv_bytes(32, 1, 10_000, 32, 128, 2) < weights  # the 10K-token MHA cache does not exceed the weights


def test_formula_on_real_float16_arrays_of_480_bytes():
    layers, batch, tokens, kv_heads, head_dim = 2, 1, 5, 3, 4
    arrays = [(np.zeros((batch, kv_heads, tokens, head_dim), np.float16),
               np.zeros((batch, kv_heads, tokens, head_dim), np.float16)) for _ in range(layers)]
    measured = sum(k.nbytes + v.nbytes for k, v in arrays)
    assert measured == 480
    assert kv_bytes(layers, batch, tokens, kv_heads, head_dim, np.dtype(np.float16).itemsize) == measured


def test_head_dim_v_on_real_arrays():
    k = np.zeros((3, 2, 7, 8), np.float32)   # [layers, kv_heads, tokens, head_dim]
    v = np.zeros((3, 2, 7, 5), np.float32)   # head_dim_v = 5
    assert kv_bytes(layers=3, batch=1, tokens=7, kv_heads=2, head_dim=8, bytes_per_element=4, head_dim_v=5) \
        == k.nbytes + v.nbytes
    assert kv_bytes(1, 1, 0, 1, 8, 2) == 0  # an empty cache


@pytest.mark.parametrize("kwargs, error, pattern", [
    (dict(layers=0), ValueError, "layers: expected an int >= 1, got 0"),
    (dict(tokens=-1), ValueError, "tokens: expected an int >= 0, got -1"),
    (dict(head_dim=True), TypeError, "head_dim: expected an int, got True of type bool"),
    (dict(bytes_per_element=2.0), TypeError, "bytes_per_element: expected an int, got 2.0 of type float"),
    (dict(head_dim_v=0), ValueError, "head_dim_v: expected an int >= 1, got 0"),
])
def test_kv_bytes_rejects(kwargs, error, pattern):
    args = dict(layers=1, batch=1, tokens=1, kv_heads=1, head_dim=1, bytes_per_element=2) | kwargs
    with pytest.raises(error, match=re.escape(pattern)):
        kv_bytes(**args)
