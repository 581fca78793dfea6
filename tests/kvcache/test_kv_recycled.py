"""Freed pages are zeroed once the free is final, so a write into a recycled page journals no copy of old K/V
(`Journal.save_bytes` finds zeros), while every failure still leaves every pool byte as it was: a free inside an
open group keeps its bytes (the group may take it back), a cached prefix page keeps them (it may be adopted), a
page a failed call took and gave back holds what it held."""
import numpy as np
import pytest

import kvcache
from kvcache import journal, testing
from .kv_helpers import assert_fails_unchanged, make_cache, random_kv


@pytest.fixture
def rng():
    return np.random.default_rng(77)


def page_bytes(cache, pages) -> list[bytes]:
    return [b"".join(a[:, p].tobytes() for a in testing.pool_arrays(cache)) for p in pages]


def filled_seq(cache, rng, tokens):
    seq = cache.create_sequence()
    cache.append(seq, *random_kv(cache, tokens, rng))
    return seq


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8"])
def test_free_zeroes_the_pages_it_frees(rng, dtype):
    cache = make_cache(num_layers=2, dtype=dtype)
    keep, gone = filled_seq(cache, rng, 6), filled_seq(cache, rng, 7)
    kept_pages, gone_pages = cache.pool.page_table(keep).tolist(), cache.pool.page_table(gone).tolist()
    kept = page_bytes(cache, kept_pages)
    assert any(any(b) for b in page_bytes(cache, gone_pages))
    cache.free(gone)
    assert not any(a[:, p].any() for a in testing.pool_arrays(cache) for p in gone_pages)
    assert page_bytes(cache, kept_pages) == kept


def test_truncate_zeroes_dropped_pages_only(rng):
    cache = make_cache()
    seq = filled_seq(cache, rng, 11)                               # pages of 4: 3 pages
    pages = cache.pool.page_table(seq).tolist()
    before = page_bytes(cache, pages[:2])
    cache.truncate(seq, 5)
    assert page_bytes(cache, pages[:2]) == before                  # the kept partial page is untouched
    assert page_bytes(cache, pages[2:]) == [bytes(len(before[0]))]


def test_free_inside_a_group_keeps_bytes_until_the_group_closes(rng):
    cache = make_cache()
    seq = filled_seq(cache, rng, 6)
    pages = cache.pool.page_table(seq).tolist()
    before, k, v = page_bytes(cache, pages), *cache.gather(seq)
    fingerprint = cache.fingerprint()
    with pytest.raises(RuntimeError):
        with cache.group():
            cache.free(seq)
            assert page_bytes(cache, pages) == before             # freed, but the group can take it back
            raise RuntimeError("undo the group")
    assert cache.fingerprint() == fingerprint
    got_k, got_v = cache.gather(seq)
    np.testing.assert_array_equal(got_k, k)
    np.testing.assert_array_equal(got_v, v)
    group = cache.group(span_calls=True)
    with group:
        cache.free(seq)
    assert page_bytes(cache, pages) == before                      # still open: nothing zeroed
    group.close()
    assert not any(any(b) for b in page_bytes(cache, pages))


def test_cached_prefix_pages_keep_their_bytes(rng):
    cache = kvcache.KVCache(num_layers=1, num_kv_heads=2, head_dim=3, page_size=4, num_pages=8,
                            prefix_caching=True)
    seq = cache.create_sequence()
    ids = np.arange(9, dtype=np.int32)
    cache.append(seq, *random_kv(cache, 9, rng), token_ids=ids)
    pages = cache.pool.page_table(seq).tolist()
    before = page_bytes(cache, pages)
    cache.free(seq)
    assert page_bytes(cache, pages[:2]) == before[:2]             # registered, parked: kept for match_prefix
    assert not any(page_bytes(cache, pages[2:])[0])                 # the partial page: free, zeroed
    match = cache.match_prefix(ids)
    assert match.num_tokens == 8
    assert page_bytes(cache, cache.pool.page_table(match.seq).tolist()) == before[:2]


def test_recycled_prefill_saves_no_copy_and_fails_unchanged(rng, monkeypatch):
    cache = make_cache(num_layers=3, num_pages=8)
    cache.free(filled_seq(cache, rng, 30))                         # every page used once, then freed
    copies = []
    original = journal.Journal.save_bytes

    def counting(self, view):
        if view.any():
            copies.append(view.nbytes)
        original(self, view)
    monkeypatch.setattr(journal.Journal, "save_bytes", counting)
    seq = cache.create_sequence()
    k, v = random_kv(cache, 30, rng)
    fault_points = testing.FaultInjector()
    testing.set_fault_hook(cache, fault_points)
    cache.append(seq, k, v)
    assert copies == []                                              # nothing old to save
    cache.truncate(seq, 0)                                           # its pages are free and zero again
    writes = [i for i, point in enumerate(fault_points.points) if point == "write_v"]
    for fail_at in (writes[0], writes[len(writes) // 2], writes[-1]):
        testing.set_fault_hook(cache, testing.FaultInjector(fail_at=fail_at))
        assert_fails_unchanged(cache, lambda: cache.append(seq, k, v), kvcache.testing.InjectedFault)
    assert copies == []
