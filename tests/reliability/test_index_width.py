"""Index width: every element offset of the pool is computed in 64-bit arithmetic.

`CacheConfig.element_offset` is the layout contract (flat C-order index of ``[layer, page, head, slot, dim]``).
It is checked against numpy's own `ravel_multi_index` and against the real addresses of pool elements, then the
kernels (serial and parallel) are run on a real pool whose byte offsets pass 2**32 and element offsets pass
2**31: the pool is lazily backed (np.zeros), so only the few pages written become resident. A sequence is pushed
to the top pages by an open transaction that reserves every lower page without writing any of them.
"""
import numpy as np
import pytest

from decode import Decoder
from kvcache import CacheConfig, KVCache, testing
from reference.dense import decode_reference


def _config(**kw):
    args = dict(num_layers=1, num_kv_heads=2, head_dim=3, head_dim_v=5, page_size=4, num_pages=6, dtype="float32")
    args.update(kw)
    return CacheConfig.build(**args)


def test_element_offset_is_the_c_order_index_of_the_pool():
    cfg = _config(num_layers=3)
    for v, width, shape in ((False, 3, cfg.k_page_shape), (True, 5, cfg.v_page_shape)):
        dims = (cfg.num_layers,) + shape
        flat = [cfg.element_offset(*index, v=v) for index in np.ndindex(*dims)]
        assert flat == list(range(int(np.prod(dims))))
        assert flat[-1] == np.ravel_multi_index(tuple(d - 1 for d in dims), dims)


@pytest.mark.parametrize("num_layers, num_pages, heads, page_size, head_dim, past", [
    (32, 70_000, 8, 16, 128, 2 ** 32),          # a 32-layer model, 1.1M tokens: element offsets past 2**35
    (1, 2 ** 17 + 2, 1, 64, 256, 2 ** 31),      # one layer: the last page starts past 2**31 elements
    (2, 2 ** 16, 1, 64, 512, 2 ** 32 - 1),      # layer 1 alone starts at 2**31 elements, ends at 2**32 - 1
])
def test_element_offset_past_2_to_the_31_and_32(num_layers, num_pages, heads, page_size, head_dim, past):
    cfg = CacheConfig.build(num_layers=num_layers, num_kv_heads=heads, head_dim=head_dim, page_size=page_size,
                            num_pages=num_pages, dtype="float16")
    dims = (num_layers, num_pages, heads, page_size, head_dim)
    last = tuple(d - 1 for d in dims)
    top = cfg.element_offset(*last)
    assert type(top) is int and top == int(np.prod(dims, dtype=np.int64)) - 1 >= past
    assert top == int(np.ravel_multi_index(last, dims))                   # numpy's intp arithmetic agrees
    for index in [(num_layers - 1, num_pages // 2, 0, page_size // 2, 3), (0, num_pages - 1, heads - 1, 0, 0)]:
        assert cfg.element_offset(*index) == int(np.ravel_multi_index(index, dims))
    # what an int32 offset would have read instead: another page's element (the bug this contract rules out)
    wrapped = int(np.array(top, dtype=np.int64).astype(np.int32))
    assert wrapped != top


@pytest.mark.parametrize("bad, error, message", [
    (dict(layer=1), ValueError, "layer: expected an integer in [0, 0], got 1"),
    (dict(page=6), ValueError, "page: expected an integer in [0, 5], got 6"),
    (dict(head=-1), ValueError, "head: expected an integer in [0, 1], got -1"),
    (dict(slot=4), ValueError, "slot: expected an integer in [0, 3], got 4"),
    (dict(dim=3), ValueError, "dim: expected an integer in [0, 2], got 3"),
    (dict(dim=1.0), TypeError, "dim: expected an integer, got float 1.0"),
    (dict(page=True), TypeError, "page: expected an integer, got bool True"),
])
def test_element_offset_checks_its_arguments(bad, error, message):
    index = dict(layer=0, page=0, head=0, slot=0, dim=0)
    index.update(bad)
    with pytest.raises(error) as info:
        _config().element_offset(**index)
    assert str(info.value) == message
    assert _config().element_offset(0, 0, 0, 0, 4, v=True) == 4          # V rows are head_dim_v wide


def _big_pool():
    """float16, 2 kv heads x 2048 dims x 4-token pages (16384 K elements a page): the top page starts past 2**31
    elements (2**32 bytes). 4 GiB of K and 16 MiB of V, virtual; resident: the pages written."""
    num_pages = 2 ** 31 // 16384 + 2
    try:
        return KVCache(num_kv_heads=2, head_dim=2048, head_dim_v=8, page_size=4, num_pages=num_pages,
                       dtype="float16")
    except MemoryError:
        pytest.skip("cannot map a 4 GiB lazily backed pool here")


def test_real_pool_addresses_match_element_offset_past_2_to_the_32_bytes():
    cache = _big_pool()
    cfg = cache.config
    k, v = testing.pool_arrays(cache)
    base_k, base_v = k.ctypes.data, v.ctypes.data
    for index in [(0, cfg.num_pages - 1, 1, 3, 2047), (0, cfg.num_pages - 1, 0, 0, 0), (0, 17, 1, 2, 5)]:
        assert k[index[:-1]][index[-1]:].ctypes.data - base_k == cfg.element_offset(*index) * 2
    assert cfg.element_offset(0, cfg.num_pages - 1, 0, 0, 0) * 2 > 2 ** 32
    last_v = (0, cfg.num_pages - 1, 1, 3, 7)
    assert v[last_v[:-1]][7:].ctypes.data - base_v == cfg.element_offset(*last_v, v=True) * 2


@pytest.mark.kernel
@pytest.mark.parametrize("mode", ["serial", "parallel"])
def test_kernels_read_the_top_pages_of_a_pool_past_2_to_the_31_elements(mode, monkeypatch):
    """A decoder whose pages are the pool's last two (element offsets > 2**31, byte offsets > 2**32) decodes
    exactly what the float64 reference computes on its K/V; an int32 offset anywhere would read the zeros of a
    low page (or fault). Parallel: the dispatch threshold is set to 0 so every call takes the parallel kernel."""
    import decode.attention_plan as attention_plan
    if mode == "parallel":
        monkeypatch.setattr(attention_plan, "SERIAL_WORK", 0)
    cache = _big_pool()
    cfg = cache.config
    hog = cache.create_sequence()
    tx = cache.transaction({hog: (cfg.num_pages - 2) * cfg.page_size})    # pages 0 .. N-3, none written
    try:
        dec = Decoder.on_cache(cache, 4)
        rng = np.random.default_rng(3)
        q = rng.standard_normal((8, 4, 2048))
        k = rng.standard_normal((8, 2, 2048))
        v = rng.standard_normal((8, 2, 8))
        outs = [dec.step(q[i], k[i], v[i]) for i in range(6)] + list(dec.extend(q[6:], k[6:], v[6:]))
        assert cache.pool.page_table(dec.seq).tolist() == [cfg.num_pages - 2, cfg.num_pages - 1]
        assert cfg.element_offset(0, cfg.num_pages - 1, 0, 0, 0) > 2 ** 31
        ref = decode_reference(q, k.astype(np.float16), v.astype(np.float16), 0)
        np.testing.assert_allclose(np.array(outs), ref, rtol=2e-5, atol=2e-6)
        K, V = dec.kv()
        np.testing.assert_array_equal(K, k.astype(np.float16))
        np.testing.assert_array_equal(V, v.astype(np.float16))
    finally:
        tx.rollback()
