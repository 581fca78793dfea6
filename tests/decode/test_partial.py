"""`decode.partial`: partial attention over key ranges of a page row, merged by the split-K combine, against the
float64 reference (reference.dense.decode_reference) on the K/V as stored.

Tolerances (atol + rtol * |ref|): float64 storage 1e-13 + 1e-13; float32 / float16 storage 2e-6 + 2e-5."""
import numpy as np
import pytest

from decode.partial import merge_partials, partial_attention
from kvcache import KVCache
from reference.dense import decode_reference

TOL = {"float64": (1e-13, 1e-13), "float32": (2e-6, 2e-5), "float16": (2e-6, 2e-5)}
pytestmark = pytest.mark.kernel


def filled(rng, dtype, length, kv_heads, dim, page_size=4):
    cache = KVCache(num_kv_heads=kv_heads, head_dim=dim, dtype=dtype, page_size=page_size, max_tokens=4 * length)
    seq = cache.create_sequence()
    cache.append(seq, rng.standard_normal((length, kv_heads, dim)), rng.standard_normal((length, kv_heads, dim)))
    return cache, seq


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (6, 2), (4, 1)])
def test_split_ranges_merge_to_the_reference(dtype, heads, kv_heads):
    rng = np.random.default_rng(hash((dtype, heads, kv_heads)) % 2**32)
    length, dim = 37, 8
    cache, seq = filled(rng, dtype, length, kv_heads, dim)
    compute = np.float64 if dtype == "float64" else np.float32
    positions = np.array([0, 5, 20, 36])                               # each query reads keys 0..p
    q = rng.standard_normal((len(positions), heads, dim)).astype(compute)
    cuts = [0, 8, 9, 24, length]                                       # holders of [0,8), [8,9), [9,24), [24,37)
    parts = [partial_attention(q, cache.pool.k_pages(), cache.pool.v_pages(), cache.pool.page_table(seq),
                               np.minimum(positions + 1, a), np.minimum(positions + 1, b), 1 / np.sqrt(dim))
             for a, b in zip(cuts, cuts[1:])]
    out = merge_partials(*(np.stack([p[i] for p in parts]) for i in range(3)), kv_heads)
    k, v = cache.gather(seq)
    for row, p in enumerate(positions):
        ref = decode_reference(q[row:row + 1].astype(np.float64), k[:p + 1].astype(np.float64),
                               v[:p + 1].astype(np.float64), query_start=p)[0]
        atol, rtol = TOL[dtype]
        assert out.dtype == compute
        assert (np.abs(out[row] - ref) <= atol + rtol * np.abs(ref)).all(), (row, np.abs(out[row] - ref).max())


def test_empty_range_is_neutral_and_an_all_empty_query_is_refused():
    rng = np.random.default_rng(1)
    cache, seq = filled(rng, "float32", 8, 2, 4)
    q = rng.standard_normal((1, 2, 4)).astype(np.float32)
    args = (q, cache.pool.k_pages(), cache.pool.v_pages(), cache.pool.page_table(seq))
    m, l, acc = partial_attention(*args, [3], [3], 0.5)
    assert np.isneginf(m).all() and (l == 0).all() and (acc == 0).all()
    full = partial_attention(*args, [0], [8], 0.5)
    alone = merge_partials(*(np.stack([x]) for x in full), 2)
    with_empty = merge_partials(*(np.stack([x, y]) for x, y in zip(full, (m, l, acc))), 2)
    assert np.array_equal(alone, with_empty)
    with pytest.raises(ValueError, match="at least one non-empty part"):
        merge_partials(m[None], l[None], acc[None], 2)
    with pytest.raises(ValueError, match="lo, hi: expected 0 <= lo <= hi <= 8"):
        partial_attention(*args, [0], [9], 0.5)
    with pytest.raises(ValueError, match="q: expected a float32 array"):
        partial_attention(q.astype(np.float64), *args[1:], [0], [8], 0.5)
