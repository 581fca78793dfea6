"""int8 storage (`kvcache.quant`): the stored bytes against their inputs, batched == incremental, written rows
never change, rollback restores values and scales at every fault point, CoW / fork / truncate / window carry
the scales, bad input (non-finite, a scale overflow) changes nothing."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from hypothesis.extra import numpy as hnp

from kvcache import ScaleOverflowError, quant
from .kv_helpers import assert_bitwise_equal, assert_fails_unchanged, make_cache
from .kv_helpers import enumerate_faults

F16_MAX = float(np.finfo(np.float16).max)


def int8_cache(**kwargs):
    kwargs.setdefault("dtype", "int8")
    return make_cache(**kwargs)


def stored_rows(cache, seq, layer=0):
    """Raw int8 values and float16 scales of every held position: ``[T, H, D]``, ``[T, H, G]`` (K and V)."""
    size, table, length = cache.config.page_size, cache.pool.page_table(seq), cache.length(seq)
    out = []
    for values, scales in ((cache.pool.k_pages(layer), cache.pool.k_scales(layer)), (cache.pool.v_pages(layer), cache.pool.v_scales(layer))):
        rows = [values[table[p // size], :, p % size] for p in range(length)]
        srows = [scales[table[p // size], :, p % size] for p in range(length)]
        out.append((np.array(rows), np.array(srows)))
    return out


def check_row_rule(x, q, s):
    """The format's promise for one row set ``x [..., D]`` stored as ``q [..., D]`` int8, ``s [..., G]`` float16:
    s is the smallest float16 >= max|x| / 127 of its group, |q| <= 127, and |x - q * s| <= s / 2."""
    x = np.asarray(x, dtype=np.float64)
    D = x.shape[-1]
    G = quant.num_groups(D)
    assert q.dtype == np.int8 and s.dtype == np.float16 and s.shape == x.shape[:-1] + (G,)
    assert np.abs(q.astype(int)).max(initial=0) <= 127
    step = np.repeat(s.astype(np.float64), 32, axis=-1)[..., :D]
    assert (np.abs(x - q * step) <= step / 2 * (1 + 1e-12)).all(), "an element further than scale/2 from its input"
    pad = np.zeros(x.shape[:-1] + (G * 32,))
    pad[..., :D] = np.abs(x)
    peak = pad.reshape(x.shape[:-1] + (G, 32)).max(axis=-1)          # compared as 127 * s, never peak / 127
    assert (s.astype(np.float64) * 127 >= peak).all(), "a scale rounded down (the group could clip)"
    below = np.nextafter(s, np.float16(0)).astype(np.float64)
    assert ((below * 127 < peak) | ((s == 0) & (peak == 0))).all(), (
        "a scale larger than the smallest float16 that holds the group (or zero for a nonzero group)")


# -- the rule through the cache ----------------------------------------------------------------------------------
@settings(max_examples=60, deadline=None)
@given(head_dim=st.sampled_from([1, 3, 31, 32, 33, 64, 80, 128]), tokens=st.integers(1, 9),
       data=st.data())
def test_every_stored_element_within_half_a_scale(head_dim, tokens, data):
    cache = int8_cache(num_kv_heads=2, head_dim=head_dim, head_dim_v=max(1, head_dim // 2), page_size=4,
                       num_pages=3)
    elements = st.floats(-quant.MAX_ABS, quant.MAX_ABS, allow_nan=False, width=64)
    k = data.draw(hnp.arrays(np.float64, (tokens, 2, head_dim), elements=elements))
    v = data.draw(hnp.arrays(np.float32, (tokens, 2, max(1, head_dim // 2)),
                             elements=st.floats(-1e3, 1e3, allow_nan=False, width=32)))
    k *= data.draw(st.sampled_from([1.0, 1e-6, 1e-30]))                       # tiny groups: subnormal scales
    seq = cache.create_sequence()
    cache.append(seq, k, v)
    (kq, ks), (vq, vs) = stored_rows(cache, seq)
    check_row_rule(k, kq, ks)
    check_row_rule(v, vq, vs)
    gk, gv = cache.gather(seq)
    assert gk.dtype == gv.dtype == np.float32
    assert_bitwise_equal(gk, quant.dequantize(kq, ks), "gather K")
    assert_bitwise_equal(gv, quant.dequantize(vq, vs), "gather V")


def test_a_group_whose_peak_over_127_underflows_still_gets_a_scale():
    """5e-324 / 127 is 0 in float64: the scale must still be the smallest float16, not 0 (found by Hypothesis)."""
    cache = int8_cache(num_kv_heads=1, head_dim=4, page_size=2, num_pages=1)
    seq = cache.create_sequence()
    k = np.array([[[[5e-324, 0.0, -5e-324, 0.0]]]])
    cache.append(seq, k, np.zeros_like(k))
    (kq, ks), _ = stored_rows(cache, seq)
    assert ks.tolist() == [[[np.nextafter(np.float16(0), np.float16(1))]]] and not kq.any()
    check_row_rule(k[0], kq, ks)


def test_zero_rows_and_the_largest_accepted_value():
    cache = int8_cache(num_kv_heads=1, head_dim=40, page_size=2, num_pages=2)
    seq = cache.create_sequence()
    k = np.zeros((1, 3, 1, 40))
    k[0, 1, 0, 35] = quant.MAX_ABS                       # second group of row 1: scale exactly 65504
    k[0, 2, 0, :32] = -1.0
    cache.append(seq, k, k)
    (kq, ks), _ = stored_rows(cache, seq)
    assert ks[0, 0].tolist() == [0.0, 0.0] and not kq[0].any()
    assert ks[1, 0].tolist() == [0.0, F16_MAX] and kq[1, 0, 35] == 127
    assert kq[2, 0, :32].tolist() == [-127] * 32 and kq[2, 0, 32:].tolist() == [0] * 8
    check_row_rule(k[0], kq, ks)


def test_batched_token_by_token_and_token_path_give_identical_bytes(rng):
    shape = dict(num_layers=2, num_kv_heads=3, head_dim=72, head_dim_v=40, page_size=5, num_pages=6)
    k = rng.standard_normal((2, 23, 3, 72)) * rng.choice([1e-3, 1.0, 1e3], size=(1, 23, 3, 1))
    v = rng.standard_normal((2, 23, 3, 40))
    batched, one_by_one, tokens = (int8_cache(**shape) for _ in range(3))
    for cache in (batched, one_by_one, tokens):
        cache.create_sequence()
    batched.append(0, k, v)
    for t in range(23):
        one_by_one.append(0, k[:, t:t + 1], v[:, t:t + 1])
        tok = tokens.transaction(0)
        for layer in range(2):
            tok.write(layer, k[layer, t], v[layer, t])
        tok.commit()
    assert batched.fingerprint() == one_by_one.fingerprint() == tokens.fingerprint()
    for a, b in zip(batched.pool.arrays, tokens.pool.arrays):
        assert_bitwise_equal(a, b)


def test_written_rows_never_change_when_later_rows_arrive(rng):
    cache = int8_cache(num_kv_heads=2, head_dim=64, page_size=8, num_pages=4)
    seq = cache.create_sequence()
    cache.append(seq, *(rng.standard_normal((1, 3, 2, 64)) * 0.01 for _ in range(2)))
    before = [np.array(a[0, 0, :, :3]) for a in cache.pool.arrays]            # page 0, slots 0..2
    cache.append(seq, *(rng.standard_normal((1, 20, 2, 64)) * 1e4 for _ in range(2)))   # much larger rows
    for a, b in zip(before, cache.pool.arrays):
        assert_bitwise_equal(b[0, 0, :, :3], a)


def test_layout_and_bytes(rng):
    cache = int8_cache(num_layers=3, num_kv_heads=4, head_dim=128, head_dim_v=96, page_size=16, num_pages=5)
    cfg = cache.config
    assert cache.pool.k_pages(2).shape == (5, 4, 16, 128) and cache.pool.k_pages().dtype == np.int8
    assert cache.pool.k_scales(2).shape == (5, 4, 16, 4) and cache.pool.v_scales(1).shape == (5, 4, 16, 3)
    assert cache.pool.k_scales().dtype == np.float16
    assert cfg.scale_bytes_per_token == 3 * 4 * (4 + 3) * 2
    assert cfg.bytes_per_token == 3 * 4 * (128 + 96) + cfg.scale_bytes_per_token
    assert cache.pool.nbytes == 5 * 16 * cfg.bytes_per_token == sum(a.nbytes for a in cache.pool.arrays)
    assert make_cache(dtype="float16").pool.k_scales() is None


# -- bad input -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("bad, error, match", [
    (1e7, ScaleOverflowError, r"^k: expected \|x\| <= 8319008 in int8 storage .*got 10000000.0 at index \(0, 1, 0, 2\)$"),
    (-8319009.0, ScaleOverflowError, r"^k: expected \|x\| <= 8319008 .*got -8319009.0"),
    (np.nan, ValueError, r"^k: expected finite values, got nan at index \(0, 1, 0, 2\)$"),
    (np.inf, ValueError, r"^k: expected finite values, got inf"),
])
def test_bad_rows_refused_with_nothing_changed(rng, bad, error, match):
    cache = int8_cache(num_kv_heads=1, head_dim=4, page_size=2, num_pages=4)
    seq = cache.create_sequence()
    cache.append(seq, *(rng.standard_normal((1, 3, 1, 4)) for _ in range(2)))
    k, v = (rng.standard_normal((1, 2, 1, 4)) for _ in range(2))
    k[0, 1, 0, 2] = bad
    assert_fails_unchanged(cache, lambda: cache.append(seq, k, v), error, match)
    assert issubclass(ScaleOverflowError, ValueError)


def test_fingerprint_covers_the_scales(rng):
    cache = int8_cache()
    cache.create_sequence()
    cache.append(0, *(rng.standard_normal((1, 2, 2, 3)) for _ in range(2)))
    before = cache.fingerprint()
    scales = cache.pool.v_scales()
    scales.flags.writeable = True                       # a view of the pool (tests only)
    scales[0, 1, 1, 0] = np.nextafter(scales[0, 1, 1, 0], np.float16(1))
    assert cache.fingerprint() != before


# -- rollback at every fault point ---------------------------------------------------------------------------------
def _filled(tokens, rng, **shape):
    cache = int8_cache(**shape)
    for count in tokens:
        seq = cache.create_sequence()
        if count:
            cache.append(seq, *(rng.standard_normal((cache.config.num_layers, count, cache.config.num_kv_heads, d))
                                for d in (cache.config.head_dim, cache.config.head_dim_v)))
    return cache


def _kv(cache, count, rng, scale=1.0):
    cfg = cache.config
    return tuple(rng.standard_normal((cfg.num_layers, count, cfg.num_kv_heads, d)) * scale
                 for d in (cfg.head_dim, cfg.head_dim_v))


def test_faults_in_an_overwriting_append_restore_values_and_scales():
    """Truncate, then append over the released slots with much larger rows: every fault point's rollback must
    put back the old int8 values *and* scales of the overwritten slots (the fingerprint covers both)."""
    def build():
        rng = np.random.default_rng(7)
        cache = _filled([7], rng, num_layers=2, num_kv_heads=2, head_dim=40, head_dim_v=33, page_size=4,
                        num_pages=6)
        cache.truncate(0, 2)
        return cache, (0,) + _kv(cache, 9, rng, scale=300.0)
    points = enumerate_faults(build, lambda cache, ctx: cache.append(*ctx))
    assert points.count("write_k") == points.count("write_v") == 2 * 3


def test_faults_in_a_copy_on_write_append_restore_values_and_scales():
    def build():
        rng = np.random.default_rng(8)
        cache = _filled([6], rng, num_kv_heads=2, head_dim=32, page_size=4, num_pages=6)
        child = cache.fork(0)
        return cache, (child,) + _kv(cache, 3, rng, scale=50.0)
    points = enumerate_faults(build, lambda cache, ctx: cache.append(*ctx))
    assert "cow_copy" in points


def test_faults_in_the_token_path_restore_values_and_scales():
    def build():
        rng = np.random.default_rng(9)
        cache = _filled([5], rng, num_layers=3, num_kv_heads=2, head_dim=35, page_size=4, num_pages=4)
        cache.truncate(0, 3)
        return cache, _kv(cache, 1, rng, scale=1e4)

    def op(cache, ctx):
        k, v = ctx
        tok = cache.transaction(0)
        try:
            for layer in range(3):
                tok.write(layer, k[layer, 0], v[layer, 0])
            tok.commit()
        except BaseException:
            tok.rollback()
            raise
    enumerate_faults(build, op)


def test_transaction_rollback_restores_scales(rng):
    cache = _filled([5, 3], rng, num_kv_heads=2, head_dim=32, page_size=4, num_pages=8)
    cache.truncate(0, 1)
    before = [a.copy() for a in cache.pool.arrays]
    with pytest.raises(RuntimeError, match="boom"):
        with cache.transaction({0: 6, 1: 2}) as tx:
            k, v = _kv(cache, 6, rng, scale=1e3)
            tx.write(0, 0, k[0], v[0])
            raise RuntimeError("boom")
    for a, b in zip(before, cache.pool.arrays):
        assert_bitwise_equal(b, a)


# -- fork, copy-on-write, truncate, window -------------------------------------------------------------------------
def test_copy_on_write_copies_the_scales(rng):
    cache = int8_cache(num_kv_heads=2, head_dim=48, page_size=4, num_pages=6)
    parent = cache.create_sequence()
    cache.append(parent, *_kv(cache, 6, rng))
    parent_k, parent_v = cache.gather(parent)
    child = cache.fork(parent)
    cache.append(child, *_kv(cache, 1, rng, scale=1e3))                  # writes into the shared tail page
    assert cache.pool.page_table(child)[1] != cache.pool.page_table(parent)[1]
    ck, cv = cache.gather(child)
    assert_bitwise_equal(ck[:6], parent_k)                              # copied values *and* scales
    assert_bitwise_equal(cv[:6], parent_v)
    pk, pv = cache.gather(parent)
    assert_bitwise_equal(pk, parent_k)
    assert_bitwise_equal(pv, parent_v)


def test_truncate_then_rewrite_equals_a_fresh_cache(rng):
    a, b = int8_cache(page_size=4, num_pages=6), int8_cache(page_size=4, num_pages=6)
    a.create_sequence()
    b.create_sequence()
    first, second = _kv(a, 9, rng, 1e3), _kv(a, 5, rng, 1e-3)
    a.append(0, *first)
    a.truncate(0, 3)
    a.append(0, *second)
    b.append(0, first[0][:, :3], first[1][:, :3])
    b.append(0, *second)
    for x, y in zip(a.gather(0), b.gather(0)):
        assert_bitwise_equal(x, y)


def test_sliding_window_release_keeps_the_rest_dequantized(rng):
    cache = int8_cache(page_size=4, num_pages=6)
    seq = cache.create_sequence()
    k, v = _kv(cache, 14, rng)
    cache.append(seq, k, v)
    full = cache.gather(seq)
    assert cache.release_before(seq, 9) == 2
    for part, whole in zip(cache.gather(seq), full):
        assert_bitwise_equal(part, whole[8:])


def test_int8_cache_rejects_no_float_input_dtype(rng):
    cache = int8_cache(num_kv_heads=1, head_dim=2)
    seq = cache.create_sequence()
    with pytest.raises(TypeError, match="^k: expected a real floating-point array, got dtype int8$"):
        cache.append(seq, np.ones((1, 1, 1, 2), np.int8), np.ones((1, 1, 1, 2)))
    cache.append(seq, np.ones((1, 1, 1, 2), np.float16), np.ones((1, 1, 1, 2), np.float32))
    scale = float(cache.pool.k_scales()[0, 0, 0, 0])            # 1/127 rounded up to a float16: 127 * scale > 1
    assert scale > 1 / 127 and cache.gather(seq)[0].tolist() == [[[127 * scale, 127 * scale]]]


@pytest.fixture
def rng():
    return np.random.default_rng(0)
