"""The public surface of `KVCache`: its members, the one `transaction` entry whose argument picks the shape, the
`cache.pool` view and the test tooling in `kvcache.testing`."""
import numpy as np
import pytest

import kvcache
from kvcache import TokenBatch, TokenWrite, Transaction, testing
from kvcache.pool_view import PoolView

from .kv_helpers import make_cache, random_kv

@pytest.fixture
def rng():
    return np.random.default_rng(17)


USER_MEMBERS = {"append", "check_invariants", "config", "create_sequence", "fingerprint", "fork", "free", "gather",
                "group", "length", "load", "match_prefix", "namespace", "num_cached_pages", "num_free_pages", "pool",
                "prefix_caching", "release_before", "save", "sequences", "token_ids", "transaction", "truncate"}


def test_kvcache_members_are_the_user_surface():
    cache = make_cache()
    assert {name for name in dir(cache) if not name.startswith("_")} == USER_MEMBERS
    assert isinstance(cache.pool, PoolView)
    assert set(kvcache.__all__) == {"KVCache", "CacheConfig", "PrefixMatch", "CacheFullError", "ScaleOverflowError",
                                    "SnapshotError", "AppendTransaction", "Transaction", "TokenBatch", "TokenWrite"}


def _twins(rng, counts=(3, 5)):
    """Two identical caches (3 layers) holding sequences of ``counts`` tokens."""
    caches = [make_cache(num_layers=3, num_pages=12), make_cache(num_layers=3, num_pages=12)]
    seqs = []
    for n in counts:
        k, v = random_kv(caches[0], n, rng)
        for cache in caches:
            seq = cache.create_sequence()
            cache.append(seq, k, v)
        seqs.append(seq)
    return caches, seqs


@pytest.mark.parametrize("shape", ["one id", "list of one", "list", "dict"])
def test_transaction_argument_picks_the_shape_and_every_shape_writes_per_sequence(rng, shape):
    (cache, twin), [a, b] = _twins(rng)
    seqs = [a] if shape in ("one id", "list of one") else [a, b]
    tokens = {"one id": a, "list of one": [a], "list": [a, b], "dict": {a: 1, b: 1}}[shape]
    kind = {"one id": TokenWrite, "list of one": TokenWrite, "list": TokenBatch, "dict": Transaction}[shape]
    rows = {seq: random_kv(cache, 1, rng) for seq in seqs}
    with cache.transaction(tokens) as tx:
        assert type(tx) is kind and tx.num_tokens == dict.fromkeys(seqs, 1)
        for layer in (2, 0, 1):
            for seq in reversed(seqs):                          # validated per-sequence writes, any order
                k, v = rows[seq]
                tx.write(layer, seq, k[layer], v[layer])
    for seq in seqs:
        twin.append(seq, *rows[seq])
    assert cache.fingerprint() == twin.fingerprint()
    cache.check_invariants()


@pytest.mark.parametrize("shape", ["one id", "list", "dict"])
def test_a_bad_per_sequence_write_rolls_back_every_shape(rng, shape):
    (cache, _), [a, b] = _twins(rng, counts=(4, 5))              # a: a full last page (the write takes one)
    tokens = {"one id": a, "list": [a, b], "dict": {a: 1, b: 1}}[shape]
    before = cache.fingerprint()
    tx = cache.transaction(tokens)
    k, v = random_kv(cache, 1, rng)
    tx.write(0, a, k[0], v[0])
    bad = k[1].copy()
    bad[0, 1, 2] = np.nan
    with pytest.raises(ValueError, match=r"^k: expected finite values, got nan at index \(0, 1, 2\)$"):
        tx.write(1, a, bad, v[1])
    assert tx.state == "rolled back" and cache.fingerprint() == before
    with pytest.raises(RuntimeError, match="^transaction: expected an open transaction, got one that is rolled back$"):
        tx.write(2, a, k[2], v[2])


def test_commit_names_the_sequences_and_layers_not_written(rng):
    (cache, _), [a, b] = _twins(rng)
    before = cache.fingerprint()
    tx = cache.transaction([a, b])
    k, v = random_kv(cache, 1, rng)
    for layer in range(3):
        tx.write(layer, a, k[layer], v[layer])
    tx.write(0, b, k[0], v[0])
    with pytest.raises(ValueError, match=r"^commit: expected every layer written, got layers \{%d: \[1, 2\]\} " % b):
        tx.commit()
    assert cache.fingerprint() == before


def test_transaction_argument_errors_name_the_argument(rng):
    (cache, _), [a, b] = _twins(rng)
    before = cache.fingerprint()
    for call, error, match in (
            (lambda: cache.transaction([a, a]), ValueError, r"^tokens: expected distinct sequence ids, got \[0, 0\]$"),
            (lambda: cache.transaction(()), TypeError, r"^tokens: expected a non-empty list of sequence ids, got \(\)$"),
            (lambda: cache.transaction(a, token_ids=[1, 2]), ValueError, r"^token_ids: expected 1 token ids"),
            (lambda: cache.transaction([a, b], token_ids=[1, 2]), TypeError, r"^token_ids: expected a dict"),
            (lambda: cache.transaction({a: -1}), ValueError, r"^num_tokens\[0\]: expected an integer >= 0, got -1$"),
            (lambda: cache.transaction("a"), TypeError, r"^seq: expected an integer sequence id, got str 'a'$"),
            (lambda: cache.transaction(a).write(0, b, *random_kv(cache, 1, rng)), ValueError,
             r"^seq: expected one of the transaction's sequences \[0\], got 1$")):
        with pytest.raises(error, match=match):
            call()
        assert cache.fingerprint() == before


def test_pool_view_reads_what_the_cache_holds(rng):
    cache = make_cache(num_layers=2, page_size=4, num_pages=6)
    a = cache.create_sequence()
    k, v = random_kv(cache, 6, rng)
    cache.append(a, k, v)
    pool, (k_all, v_all) = cache.pool, testing.pool_arrays(cache)
    assert np.shares_memory(pool.k_pages(1), k_all) and pool.k_pages(1).shape == cache.config.k_page_shape
    assert pool.v_pages(0).base is v_all or np.shares_memory(pool.v_pages(0), v_all)
    assert pool.k_scales(0) is None and pool.arrays == (k_all, v_all)
    assert pool.nbytes == k_all.nbytes + v_all.nbytes
    table = pool.page_table(a)
    assert len(table) == 2 and pool.first_position(a) == 0
    np.testing.assert_array_equal(pool.k_pages(1)[table[1], :, 1], k[1, 5].astype(np.float32))
    b = cache.fork(a)
    assert pool.needs_copy(int(table[1])) and pool.allocator.ref_count(int(table[1])) == 2
    cache.free(b)
    assert not pool.needs_copy(int(table[1]))
    with pytest.raises(ValueError, match=r"^page: expected an integer in \[0, 5\], got 6$"):
        pool.needs_copy(6)
    with pytest.raises(ValueError, match=r"^layer: expected an integer in \[0, 1\], got 2$"):
        pool.k_pages(2)


def test_set_fault_hook_reaches_the_cache_and_its_allocator(rng):
    cache = make_cache(num_pages=4)
    a = cache.create_sequence()
    counter = testing.FaultInjector()
    testing.set_fault_hook(cache, counter)
    cache.append(a, *random_kv(cache, 5, rng))
    assert counter.points.count("allocate") == 2 and "publish" in counter.points
    before = cache.fingerprint()
    testing.set_fault_hook(cache, testing.FaultInjector(fail_at=0))
    with pytest.raises(testing.InjectedFault):
        cache.append(a, *random_kv(cache, 4, rng))
    assert cache.fingerprint() == before
    testing.set_fault_hook(cache, testing.no_fault)
    cache.append(a, *random_kv(cache, 3, rng))
    assert cache.length(a) == 8
