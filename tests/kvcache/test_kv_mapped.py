"""`kvcache.mapped.zeros`: the page pool's arrays and decode.hf's large scratch buffers live on mappings of their
own: zero, writable, of the asked shape and dtype, not resident until written, and gone with the array."""
import gc

import numpy as np
import psutil
import pytest

from kvcache import KVCache, mapped


@pytest.mark.parametrize("shape, dtype", [((3, 5, 7), np.float32), (11, np.uint16), ((2, 0, 4), np.float64),
                                          ((4, 4096), np.int8)])
def test_zeros_are_zero_writable_and_shaped(shape, dtype):
    a = mapped.zeros(shape, dtype)
    assert a.shape == (shape if isinstance(shape, tuple) else (shape,)) and a.dtype == np.dtype(dtype)
    assert a.flags.writeable and a.flags.c_contiguous and not a.any()
    a[...] = 1
    assert (a == 1).all()


def test_an_untouched_mapping_is_not_resident_and_leaves_with_its_array():
    proc = psutil.Process()
    before = proc.memory_info().rss
    a = mapped.zeros((64 << 20,), np.uint8)                     # 64 MiB, never written
    assert proc.memory_info().rss - before < (8 << 20)
    a[: 16 << 20] = 1                                           # 16 MiB written: now resident
    written = proc.memory_info().rss
    assert written - before > (12 << 20)
    del a
    gc.collect()
    assert proc.memory_info().rss < written - (12 << 20)         # unmapped: its pages left the process


def test_the_pool_arrays_are_mappings():
    cache = KVCache(num_layers=2, num_kv_heads=2, head_dim=8, page_size=4, num_pages=8)
    for array in cache.pool.arrays:
        assert not array.any() and not array.flags.owndata
