"""Guard pages and sentinel slots (`driver.Guards`): the pool's first and last pages belong to guard sequences and
hold a NaN bit pattern, and so does every slot no sequence holds; the random driver repaints them before every
operation and checks them after it, and compares every output with the dense reference, so a read of any of
them (outputs NaN or wrong) or a write into one (pattern changed) is a divergence.

Here: the guard layout for each storage dtype, the check catching a stray write, and Hypothesis drawing driver
configurations (dtype, layers, page size, window, pool size) for short guarded runs.
"""
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from kvcache import KVCache, testing

from .driver import SENTINEL_BITS, Divergence, Guards, Settings, run


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
def test_guard_layout(dtype):
    cache = KVCache(num_layers=2, num_kv_heads=2, head_dim=3, head_dim_v=5, page_size=4, num_pages=6, dtype=dtype)
    guards = Guards(cache)
    assert cache.pool.page_table(guards.low).tolist() == [0] and cache.pool.page_table(guards.high).tolist() == [5]
    assert cache.num_free_pages == 4
    for pool in testing.pool_arrays(cache):
        assert np.isnan(pool[:, [0, -1]]).all()
        assert (pool[:, [0, -1]].view(guards.bits.dtype) == SENTINEL_BITS[cache.config.dtype.itemsize]).all()
    seq = cache.create_sequence()
    cache.append(seq, np.ones((2, 5, 2, 3)), np.ones((2, 5, 2, 5)))    # pages 1, 2: slots 1..3 of page 2 unused
    guards.paint()
    unused = guards.unused()
    assert unused[0].all() and unused[5].all() and unused[3].all() and unused[4].all()
    assert not unused[1].any() and unused[2].tolist() == [False, True, True, True]
    k = testing.pool_arrays(cache)[0]
    assert np.isnan(k[:, 2, :, 1:]).all() and (k[:, 2, :, 0] == 1).all()
    guards.check("painted")                                             # nothing changed: passes


@pytest.mark.parametrize("where", ["unused slot", "free page", "low guard", "high guard"])
def test_a_stray_write_is_caught(where):
    cache = KVCache(num_kv_heads=1, head_dim=2, page_size=4, num_pages=6)
    guards = Guards(cache)
    seq = cache.create_sequence()
    cache.append(seq, np.ones((3, 1, 2)), np.ones((3, 1, 2)))
    guards.paint()
    page, slot = {"unused slot": (1, 3), "free page": (4, 0), "low guard": (0, 2), "high guard": (5, 1)}[where]
    testing.pool_arrays(cache)[1][0, page, 0, slot, 1] = 0.0
    with pytest.raises(Divergence, match="overwritten"):
        guards.check("a stray write")


def test_guards_need_an_empty_pool_of_three_pages():
    with pytest.raises(ValueError, match="guards: expected an empty pool of at least 3 pages"):
        Guards(KVCache(num_kv_heads=1, head_dim=2, page_size=4, num_pages=2))


@pytest.mark.kernel
@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2 ** 32 - 1), dtype=st.sampled_from(["float16", "float32", "float64", "bfloat16"]),
       layers=st.integers(1, 3), page_size=st.sampled_from([1, 2, 3, 4, 8]), num_pages=st.integers(3, 40),
       window=st.sampled_from([None, None, 1, 2, 5, 9]), kv_heads=st.sampled_from([1, 2]),
       group=st.sampled_from([1, 2, 3]))
def test_guarded_random_runs(seed, dtype, layers, page_size, num_pages, window, kv_heads, group):
    summary = run(Settings(ops=150, seed=seed, dtype=dtype, layers=layers, page_size=page_size, num_pages=num_pages,
                           window=window, num_kv_heads=kv_heads, num_q_heads=kv_heads * group, max_decoders=6))
    assert summary.divergences == 0 and summary.leaked_pages == 0
