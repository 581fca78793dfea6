"""Copy-on-write: forked sequences share pages until one of them writes into a shared page."""
import numpy as np
import pytest

from kvcache import CacheFullError, testing
from .kv_helpers import DenseModel, assert_fails_unchanged, assert_matches_model, make_cache, random_kv


def setup(rng, tokens, **kwargs):
    cache = make_cache(**kwargs)
    model = DenseModel(cache)
    a = cache.create_sequence()
    model.create(a)
    k, v = random_kv(cache, tokens, rng)
    cache.append(a, k, v)
    model.append(a, k, v)
    return cache, model, a


def append(cache, model, seq, count, rng):
    k, v = random_kv(cache, count, rng)
    cache.append(seq, k, v)
    model.append(seq, k, v)


def refs(cache, seq):
    return [cache.pool.allocator.ref_count(int(p)) for p in cache.pool.page_table(seq) if p >= 0]


@pytest.mark.parametrize("num_layers", [1, 3])
def test_append_into_shared_partial_page_copies_it(num_layers):
    rng = np.random.default_rng(0)
    cache, model, a = setup(rng, 6, num_layers=num_layers, page_size=4)        # pages [p0 full, p1 half]
    b = cache.fork(a)
    model.fork(a, b)
    shared = cache.pool.page_table(a).tolist()
    assert refs(cache, a) == [2, 2] and cache.num_free_pages == 6
    append(cache, model, b, 1, rng)                                            # into the shared tail page
    tb = cache.pool.page_table(b).tolist()
    assert tb[0] == shared[0] and tb[1] != shared[1]                          # only the tail was copied
    assert cache.pool.page_table(a).tolist() == shared
    assert refs(cache, a) == [2, 1] and refs(cache, b) == [2, 1]
    assert cache.num_free_pages == 5
    assert_matches_model(cache, model)                                        # a does not see b's token
    append(cache, model, a, 3, rng)                                           # a's tail is private now: no copy
    assert cache.pool.page_table(a).tolist()[:2] == shared and cache.num_free_pages == 4
    assert_matches_model(cache, model)
    cache.check_invariants()


def test_copy_carries_every_layer_and_both_pools():
    rng = np.random.default_rng(1)
    cache, model, a = setup(rng, 3, num_layers=2, head_dim_v=5, page_size=4)
    b = cache.fork(a)
    model.fork(a, b)
    append(cache, model, b, 1, rng)
    pa, pb = cache.pool.page_table(a)[0], cache.pool.page_table(b)[0]
    for pool in testing.pool_arrays(cache):
        np.testing.assert_array_equal(pool[:, pb, :, :3], pool[:, pa, :, :3])   # the shared prefix, all layers
    assert_matches_model(cache, model)


def test_full_shared_last_page_is_not_copied():
    rng = np.random.default_rng(2)
    cache, model, a = setup(rng, 8, page_size=4)
    b = cache.fork(a)
    model.fork(a, b)
    append(cache, model, b, 2, rng)
    assert cache.pool.page_table(b).tolist()[:2] == cache.pool.page_table(a).tolist()
    assert cache.num_free_pages == 5 and refs(cache, a) == [2, 2]
    assert_matches_model(cache, model)


@pytest.mark.parametrize("who", ["child", "parent"])
def test_truncate_into_shared_page_then_append(who):
    rng = np.random.default_rng(3)
    cache, model, a = setup(rng, 11, num_layers=2, page_size=4)            # 3 pages
    b = cache.fork(a)
    model.fork(a, b)
    seq, other = (b, a) if who == "child" else (a, b)
    cache.truncate(seq, 5)                                                 # into shared page 1
    model.truncate(seq, 5)
    assert cache.num_free_pages == 5                                      # page 2 still held by `other`
    assert refs(cache, seq) == [2, 2] and refs(cache, other) == [2, 2, 1]
    append(cache, model, seq, 4, rng)                                     # overwrites slots 5..7 of page 1: copy
    assert cache.pool.page_table(seq).tolist()[1] != cache.pool.page_table(other).tolist()[1]
    assert refs(cache, other) == [2, 1, 1]
    assert_matches_model(cache, model)
    cache.check_invariants()


def test_truncate_to_page_boundary_of_shared_pages_then_append():
    rng = np.random.default_rng(4)
    cache, model, a = setup(rng, 10, page_size=4)
    b = cache.fork(a)
    model.fork(a, b)
    cache.truncate(b, 8)
    model.truncate(b, 8)
    append(cache, model, b, 1, rng)                                       # new page, nothing shared written
    assert cache.pool.page_table(b).tolist()[:2] == cache.pool.page_table(a).tolist()[:2]
    assert_matches_model(cache, model)


def test_copy_needs_a_free_page():
    rng = np.random.default_rng(5)
    cache, model, a = setup(rng, 6, page_size=4, num_pages=2)
    b = cache.fork(a)
    model.fork(a, b)
    info = assert_fails_unchanged(cache, lambda: cache.append(b, *random_kv(cache, 1, rng)), CacheFullError,
                                  r"^append: needs 1 free pages, 0 of 2 are free")
    assert info.value.could_ever_fit is True
    cache.free(a)
    model.free(a)
    append(cache, model, b, 1, rng)                                        # b owns the tail alone now: no copy
    assert cache.num_free_pages == 0
    assert_matches_model(cache, model)


def test_siblings_in_one_transaction_each_get_a_copy():
    rng = np.random.default_rng(6)
    cache, model, a = setup(rng, 3, num_layers=2, page_size=4)
    b = cache.fork(a)
    model.fork(a, b)
    shared = int(cache.pool.page_table(a)[0])
    ka, va = random_kv(cache, 2, rng)
    kb, vb = random_kv(cache, 1, rng)
    with cache.transaction({a: 2, b: 1}) as tx:
        for layer in range(2):
            tx.write(layer, a, ka[layer], va[layer])
            tx.write(layer, b, kb[layer], vb[layer])
        assert cache.pool.allocator.ref_count(shared) == 2             # held by the open transaction
        cache.check_invariants()
    model.append(a, ka, va)
    model.append(b, kb, vb)
    assert cache.pool.allocator.ref_count(shared) == 0 and cache.num_free_pages == 8 - 3   # a: 2 pages, b: 1
    assert_matches_model(cache, model)
    cache.check_invariants()


def test_many_siblings_never_see_each_others_writes():
    rng = np.random.default_rng(7)
    cache, model, root = setup(rng, 5, num_layers=2, page_size=3, num_pages=40)
    seqs = [root]
    for step in range(120):
        seq = seqs[rng.integers(len(seqs))]
        op = rng.integers(5)
        if op == 0 and len(seqs) < 6:
            child = cache.fork(seq)
            model.fork(seq, child)
            seqs.append(child)
        elif op == 1:
            n = int(rng.integers(0, cache.length(seq) + 1))
            cache.truncate(seq, n)
            model.truncate(seq, n)
        elif op == 2 and len(seqs) > 1:
            cache.free(seq)
            model.free(seq)
            seqs.remove(seq)
        else:
            try:
                append(cache, model, seq, int(rng.integers(1, 5)), rng)
            except CacheFullError:
                pass
        cache.check_invariants()
        assert_matches_model(cache, model)
    for seq in seqs:
        cache.free(seq)
    assert cache.num_free_pages == 40
    cache.check_invariants()


def test_fork_chain_ref_counts_and_whole_pool_after_free():
    rng = np.random.default_rng(8)
    cache, model, a = setup(rng, 9, page_size=4)
    b = cache.fork(a)
    c = cache.fork(b)
    assert refs(cache, a) == [3, 3, 3]
    cache.truncate(c, 2)
    assert refs(cache, a) == [3, 2, 2]
    cache.free(a)
    assert refs(cache, b) == [2, 1, 1]
    cache.free(b)
    assert refs(cache, c) == [1]
    cache.free(c)
    assert cache.num_free_pages == cache.config.num_pages
    cache.check_invariants()
