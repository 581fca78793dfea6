"""Regression tests for bugs found (and fixed) in kvcache while writing this suite; one section per fix."""
import numpy as np
import pytest

import kvcache
from kvcache.checks import check_storage_dtype


# -- 1. check_storage_dtype accepted unknown dtype names ---------------------------------------------------
# `np.dtype("float64") == None` is True, so a name numpy does not know (resolved to None) passed the
# `resolved not in STORAGE_DTYPES` test and the pool silently became float64 (np.zeros(dtype=None)).
@pytest.mark.parametrize("dtype", ["bf16", "foo", None, "float8"])
def test_unknown_dtype_names_are_rejected(dtype):
    with pytest.raises(TypeError, match=r"dtype: expected one of float16, float32, float64, int8, bfloat16, got"):
        check_storage_dtype("dtype", dtype)
    with pytest.raises(TypeError, match="dtype: expected one of"):
        kvcache.KVCache(num_kv_heads=1, head_dim=2, num_pages=1, dtype=dtype)


# -- 2. copy-on-write dropped the old page's reference at begin, not at commit -----------------------------
# A transaction that copied a shared tail page away decref'd the original at once. While it was open, a
# sibling could then write into that page in place (ref count 1) or free it; rolling back pointed the
# sequence at the original again: it read the sibling's tokens, or a page that was on the free list.
def _forked_pair():
    cache = kvcache.KVCache(num_kv_heads=1, head_dim=2, page_size=4, num_pages=4)
    a = cache.create_sequence()
    rows = np.arange(6.0).reshape(3, 1, 2)
    cache.append(a, rows, rows)                       # 3 tokens: page 0 partially filled
    b = cache.fork(a)                                 # page 0 shared, ref count 2
    return cache, a, b, rows


def test_rollback_after_sibling_writes_into_the_shared_page():
    cache, a, b, rows = _forked_pair()
    cache.truncate(b, 1)
    tx = cache.transaction({a: 1})                    # a copies page 0 away
    cache.append(b, np.full((2, 1, 2), 99.0), np.full((2, 1, 2), 99.0))   # must copy too, not write in place
    tx.rollback()
    k, v = cache.gather(a)
    np.testing.assert_array_equal(k, rows.astype(np.float32))
    np.testing.assert_array_equal(v, rows.astype(np.float32))
    np.testing.assert_array_equal(cache.gather(b)[0][1:], np.full((2, 1, 2), 99.0, np.float32))
    cache.check_invariants()


def test_rollback_after_sibling_is_freed():
    cache, a, b, rows = _forked_pair()
    tx = cache.transaction({a: 1})
    cache.check_invariants()                          # the copied-away page is still held by the transaction
    cache.free(b)
    tx.rollback()
    cache.check_invariants()                          # was: "pages both free and mapped: [0]"
    np.testing.assert_array_equal(cache.gather(a)[0], rows.astype(np.float32))
    cache.free(a)
    assert cache.num_free_pages == 4
    cache.check_invariants()


def test_commit_releases_the_copied_away_page():
    cache, a, b, rows = _forked_pair()
    with cache.transaction({a: 1}) as tx:
        tx.write(0, a, np.ones((1, 1, 2)), np.ones((1, 1, 2)))
        assert cache.pool.allocator.ref_count(0) == 2      # b's table + the open transaction
    assert cache.pool.allocator.ref_count(0) == 1          # b only
    assert cache.num_free_pages == 2
    cache.check_invariants()


# -- 3. Transaction.write did not check ``layer`` ------------------------------------------------------------
# layer=True wrote layer 1 but `written[True] = True` marked *every* layer written, so a commit published
# layer 0's unwritten slots; layer=-1 wrote the last layer; floats and out-of-range layers raised IndexError.
def _two_layer_tx():
    cache = kvcache.KVCache(num_kv_heads=1, head_dim=2, page_size=4, num_pages=2, num_layers=2)
    seq = cache.create_sequence()
    return cache, seq, cache.transaction({seq: 1})


@pytest.mark.parametrize("layer, error, message", [
    (True, TypeError, "layer: expected an integer, got bool True"),
    (1.0, TypeError, "layer: expected an integer, got float 1.0"),
    (-1, ValueError, r"layer: expected an integer in \[0, 1\], got -1"),
    (2, ValueError, r"layer: expected an integer in \[0, 1\], got 2"),
])
def test_transaction_write_checks_layer(layer, error, message):
    cache, seq, tx = _two_layer_tx()
    with pytest.raises(error, match=message):
        tx.write(layer, seq, np.ones((1, 1, 2)), np.ones((1, 1, 2)))
    assert tx.state == "rolled back"
    cache.check_invariants()
    assert cache.length(seq) == 0 and cache.num_free_pages == 2


def test_bool_layer_cannot_fake_a_complete_transaction():
    cache, seq, tx = _two_layer_tx()
    with pytest.raises(TypeError):
        tx.write(True, seq, np.ones((1, 1, 2)), np.ones((1, 1, 2)))
    with pytest.raises(RuntimeError, match="rolled back"):
        tx.commit()
    assert cache.length(seq) == 0


# -- 4. an explicit commit() inside a ``with`` block made the exit raise ------------------------------------
# __exit__ called commit() again: RuntimeError "expected an open transaction, got one that is committed".
def test_explicit_commit_inside_with_block():
    cache = kvcache.KVCache(num_kv_heads=1, head_dim=2, page_size=4, num_pages=2)
    seq = cache.create_sequence()
    with cache.transaction({seq: 1}) as tx:
        tx.write(0, seq, np.ones((1, 1, 2)), np.ones((1, 1, 2)))
        tx.commit()
    assert tx.state == "committed" and cache.length(seq) == 1
    cache.check_invariants()


def test_normal_exit_after_a_swallowed_write_error_still_raises():
    # the block caught the write's error and carried on: the exit must not pretend the tokens were stored
    cache = kvcache.KVCache(num_kv_heads=1, head_dim=2, page_size=4, num_pages=2)
    seq = cache.create_sequence()
    with pytest.raises(RuntimeError, match="got one that is rolled back"):
        with cache.transaction({seq: 1}) as tx:
            try:
                tx.write(0, seq, np.full((1, 1, 2), np.nan), np.ones((1, 1, 2)))
            except ValueError:
                pass
    assert cache.length(seq) == 0 and cache.num_free_pages == 2
