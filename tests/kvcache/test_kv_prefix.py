"""Prefix caching: hits, keys, namespaces, immutability of registered pages, eviction, validation, fault
injection at every point of match / adopt / register / evict, and `Decoder.from_prefix` outputs."""
import numpy as np
import pytest

import kvcache
from kvcache import CacheFullError
from kvcache.prefix import page_key
from .kv_helpers import assert_fails_unchanged, random_kv
from .kv_helpers import enumerate_faults


@pytest.fixture
def rng():
    return np.random.default_rng(0)


def make(num_pages=16, page_size=4, **kwargs):
    kwargs.setdefault("prefix_salt", b"test-salt")                   # reproducible keys across fresh caches
    return kvcache.KVCache(num_kv_heads=2, head_dim=3, page_size=page_size, num_pages=num_pages,
                           prefix_caching=True, **kwargs)


def filled(cache, tokens, rng, namespace=None):
    seq = cache.create_sequence(namespace=namespace)
    k, v = random_kv(cache, len(tokens), rng)
    cache.append(seq, k, v, token_ids=tokens)
    return seq


def same_kv(cache, a, b, count):
    for x, y in zip(cache.gather(a), cache.gather(b)):
        assert x[:count].tobytes() == y[:count].tobytes()


def test_hit_is_whole_pages_at_most_len_minus_one_and_adopts_pages(rng):
    cache = make()
    a = filled(cache, np.arange(12), rng)
    for prompt, hit in (([0], 0), (range(4), 0), (range(5), 4), (range(12), 8), (range(13), 12), (range(30), 12),
                        ([0, 1, 2, 3, 9, 9, 9, 9, 9], 4)):
        match = cache.match_prefix(list(prompt))
        assert match.num_tokens == hit and cache.length(match.seq) == hit
        assert np.array_equal(cache.pool.page_table(match.seq), cache.pool.page_table(a)[:hit // 4])
        assert np.array_equal(cache.token_ids(match.seq), np.arange(hit))
        same_kv(cache, a, match.seq, hit)
        cache.free(match.seq)
    assert [cache.pool.allocator.ref_count(p) for p in cache.pool.page_table(a)] == [1, 1, 1]
    cache.check_invariants()


def test_namespaces_and_caches_do_not_share(rng):
    cache = make(namespace="model-a", prefix_salt=None)
    filled(cache, np.arange(8), rng)
    assert cache.match_prefix(np.arange(9)).num_tokens == 8
    assert cache.match_prefix(np.arange(9), namespace="model-b").num_tokens == 0
    filled(cache, np.arange(8), rng, namespace="model-b")
    assert cache.match_prefix(np.arange(9), namespace="model-b").num_tokens == 8
    other = make(namespace="model-a", prefix_salt=None)      # a random salt: other keys for the same tokens
    filled(other, np.arange(8), rng)
    assert cache.pool.index.root("model-a").key != other.pool.index.root("model-a").key
    assert cache.pool.index.entries()[0].key != other.pool.index.entries()[0].key


def test_key_chain_is_sha256_of_parent_and_int32_tokens(rng):
    cache = make()
    filled(cache, np.arange(8) + 7, rng)
    first, second = sorted(cache.pool.index.entries(), key=lambda e: e.parent is not cache.pool.index.root(""))
    assert first.key == page_key(cache.pool.index.root("").key, np.arange(7, 11, dtype="<i4").tobytes())
    assert second.key == page_key(first.key, np.arange(11, 15, dtype="<i4").tobytes()) and second.parent is first


def test_forced_constant_hash_costs_hits_never_wrong_kv(rng):
    cache = make(num_pages=32)
    cache.pool.index.hash_page = lambda parent, tokens: b"\0" * 32          # every key collides
    a = filled(cache, [1, 2, 3, 4, 5, 6, 7, 8], rng)
    b = filled(cache, [9, 9, 9, 9, 5, 6, 7, 8], rng)
    assert len(cache.pool.index.entries()) == 1                   # only the first page got the one key
    for prompt, owner, hit in (([1, 2, 3, 4, 5, 6, 7, 8, 0], a, 4), ([9, 9, 9, 9, 5, 6, 7, 8, 0], b, 0)):
        match = cache.match_prefix(prompt)
        assert match.num_tokens == hit
        same_kv(cache, owner, match.seq, hit)
    cache.check_invariants()


def test_registered_page_is_copied_before_a_write_even_at_ref_count_one(rng):
    cache = make()
    a = filled(cache, np.arange(8), rng)
    page = int(cache.pool.page_table(a)[1])
    before = cache.pool.k_pages()[page].copy()
    cache.truncate(a, 6)                                     # into the registered page 1; a holds it alone
    assert cache.pool.allocator.ref_count(page) == 1 and cache.pool.index.holds(page)
    cache.append(a, *random_kv(cache, 2, rng), token_ids=[50, 51])
    assert int(cache.pool.page_table(a)[1]) != page               # copied first
    assert cache.pool.k_pages()[page].tobytes() == before.tobytes() and cache.num_cached_pages == 1
    old = cache.match_prefix(np.arange(9))                   # the old content is still served, exactly
    new = cache.match_prefix([0, 1, 2, 3, 4, 5, 50, 51, 0])
    assert old.num_tokens == new.num_tokens == 8
    assert cache.pool.page_table(old.seq)[1] == page and cache.pool.page_table(new.seq)[1] == cache.pool.page_table(a)[1]
    same_kv(cache, a, new.seq, 8)
    cache.check_invariants()


def test_step_with_token_id_registers_the_page_it_fills(rng):
    cache = make()
    seq = cache.create_sequence()
    for position in range(4):
        k, v = random_kv(cache, 1, rng)
        token = cache.transaction(seq, token_ids=position + 10)
        token.write(0, k[0, 0], v[0, 0])
        token.commit()
        assert len(cache.pool.index.entries()) == (position == 3)
    assert cache.match_prefix([10, 11, 12, 13, 14]).num_tokens == 4


def test_append_without_ids_stops_registration_until_truncated_back(rng):
    cache = make()
    seq = filled(cache, np.arange(6), rng)
    cache.append(seq, *random_kv(cache, 6, rng))             # positions 6..11 unknown
    assert len(cache.pool.index.entries()) == 1 and len(cache.token_ids(seq)) == 6
    cache.append(seq, *random_kv(cache, 4, rng), token_ids=[1, 2, 3, 4])   # after a gap: still unknown
    assert len(cache.pool.index.entries()) == 1
    cache.truncate(seq, 6)
    cache.append(seq, *random_kv(cache, 2, rng), token_ids=[6, 7])
    assert len(cache.pool.index.entries()) == 2


def test_evicts_least_recently_released_only_when_no_clean_page_is_left(rng):
    cache = make(num_pages=6)
    a = filled(cache, np.arange(8), rng)                     # pages 0, 1
    b = filled(cache, np.arange(8) + 100, rng)               # pages 2, 3
    cache.free(a)
    cache.free(b)                                            # released tail first: 1, 0, 3, 2
    assert cache.pool.index.eviction_order() == [1, 0, 3, 2] and cache.num_free_pages == 6
    c = filled(cache, np.arange(8) + 200, rng)               # the two clean pages first
    assert cache.pool.index.eviction_order() == [1, 0, 3, 2] and cache.pool.allocator.num_free_pages == 0
    cache.append(c, *random_kv(cache, 1, rng), token_ids=[0])              # evicts page 1
    assert cache.pool.index.eviction_order() == [0, 3, 2]
    assert cache.match_prefix(np.arange(9)).num_tokens == 4                # page 0 still hits; page 1 gone
    assert cache.pool.index.eviction_order() == [3, 2]
    with pytest.raises(CacheFullError) as info:
        cache.append(c, *random_kv(cache, 12, rng))
    assert info.value.pages_free == 2
    cache.check_invariants()


def test_bad_input_is_named_and_changes_nothing(rng):
    cache = make()
    seq = filled(cache, np.arange(8), rng)
    k, v = random_kv(cache, 2, rng)
    for call, error, match in (
            (lambda: cache.append(seq, k, v, token_ids=[1]), ValueError, r"token_ids\[0\]: expected 2 token ids"),
            (lambda: cache.append(seq, k, v, token_ids=[1.0, 2.0]), TypeError, "expected integer token ids"),
            (lambda: cache.append(seq, k, v, token_ids=[1, -2]), ValueError, "got -2"),
            (lambda: cache.append(seq, k, v, token_ids=[1, 2**31]), ValueError, "expected token ids in"),
            (lambda: cache.transaction({seq: 1}, token_ids={seq + 5: [1]}), ValueError, "token_ids: expected keys"),
            (lambda: cache.transaction(seq, token_ids=[1, 2]), ValueError, "token_ids: expected 1 token ids"),
            (lambda: cache.match_prefix([]), ValueError, "at least one token id"),
            (lambda: cache.match_prefix([[1, 2]]), ValueError, "1-D"),
            (lambda: cache.match_prefix([1], namespace=1), TypeError, "namespace: expected a str"),
            (lambda: make(namespace=None), TypeError, "namespace: expected a str"),
            (lambda: kvcache.KVCache(num_kv_heads=1, head_dim=1, num_pages=1).match_prefix([1]), ValueError,
             "prefix_caching=True")):
        assert_fails_unchanged(cache, call, error, match)


# -- fault injection ------------------------------------------------------------------------------------------------
def prefix_state(seed=0, num_pages=10):
    """Page 0-1 referenced by a, pages of a freed sequence cached, clean pages left: ``(cache, a)``."""
    rng = np.random.default_rng(seed)
    cache = make(num_pages=num_pages, num_layers=2)
    a = filled(cache, np.arange(10), rng)                    # pages 0, 1 registered, page 2 partial
    b = filled(cache, np.arange(8) + 50, rng)                # 2 more registered pages
    cache.free(b)                                            # cached
    return cache, a, rng


def test_faults_in_match_and_adopt_of_referenced_and_cached_pages():
    def build():
        cache, a, rng = prefix_state()
        cache.match_prefix(np.arange(8) + 50)                # so the cached pages are adopted again below
        cache.free(cache.sequences[-1])
        return cache, None

    points = enumerate_faults(build, lambda cache, _: cache.match_prefix(np.concatenate([np.arange(8) + 50, [1]])))
    assert points == ["match", "adopt", "publish"]


def test_faults_in_register_while_appending_through_a_page_boundary():
    def build():
        cache, a, rng = prefix_state()
        return cache, (a,) + random_kv(cache, 7, rng)        # 10 + 7: fills pages 2 and 3

    points = enumerate_faults(build, lambda cache, ctx: cache.append(*ctx, token_ids=np.arange(10, 17)))
    assert points.count("register") == 2 and points[-1] == "publish"


def test_faults_in_eviction_under_memory_pressure():
    def build():
        cache, a, rng = prefix_state(num_pages=6)            # a: 3 pages, 2 cached, 1 clean
        return cache, (a,) + random_kv(cache, 14, rng)       # 10 + 14: 3 new pages, the clean one and 2 evicted

    points = enumerate_faults(build, lambda cache, ctx: cache.append(*ctx, token_ids=np.arange(10, 24)))
    assert points.count("evict") == 2 and points.count("register") == 4


def test_faults_in_free_and_truncate_that_park_pages():
    def build():
        cache, a, rng = prefix_state()
        return cache, a

    points = enumerate_faults(build, lambda cache, a: cache.free(a))
    assert points.count("decref") == 3
    points = enumerate_faults(build, lambda cache, a: cache.truncate(a, 2))
    assert points.count("decref") == 2


def test_faults_in_copy_on_write_of_a_registered_page():
    def build():
        cache, a, rng = prefix_state()
        cache.truncate(a, 6)
        return cache, (a,) + random_kv(cache, 4, rng)

    points = enumerate_faults(build, lambda cache, ctx: cache.append(*ctx, token_ids=[7, 7, 7, 7]))
    assert "cow_copy" in points and "register" in points


# -- the decoder --------------------------------------------------------------------------------------------------
def test_decoder_from_prefix_outputs_equal_a_fresh_computation_bitwise(rng):
    from decode.decoder import Decoder
    cache = make(num_pages=32, page_size=4)
    prompt = np.arange(13) + 3
    q, k, v = (rng.standard_normal((13, 4, 3)), rng.standard_normal((13, 2, 3)), rng.standard_normal((13, 2, 3)))
    first = Decoder.on_cache(cache, 4)
    first.extend(q[:8], k[:8], v[:8], token_ids=prompt[:8])
    first.extend(q[8:12], k[8:12], v[8:12], token_ids=prompt[8:12])
    fresh = first.extend(q[12:], k[12:], v[12:], token_ids=prompt[12:])      # the call the reuse makes
    reused, hit = Decoder.from_prefix(cache, 4, prompt)
    assert hit == 12 and reused.length == 12
    again = reused.extend(q[12:], k[12:], v[12:], token_ids=prompt[12:])
    assert again.tobytes() == fresh.tobytes()
    q1 = rng.standard_normal((4, 3))
    k1, v1 = rng.standard_normal((2, 3)), rng.standard_normal((2, 3))
    assert first.step(q1, k1, v1, token_ids=9).tobytes() == reused.step(q1, k1, v1, token_ids=9).tobytes()
    with pytest.raises(ValueError, match="num_q_heads"):
        Decoder.from_prefix(cache, 3, prompt)
    cache.check_invariants()


def test_docs_example_runs():
    import re
    from pathlib import Path
    doc = Path(__file__).resolve().parents[2] / "docs" / "prefix-caching.md"
    blocks = [b for b in re.findall(r"```python\n(.*?)```", doc.read_text(), flags=re.S) if "from_prefix" in b]
    assert blocks, "docs/prefix-caching.md lost its example"
    exec(compile(blocks[0], str(doc), "exec"), {})


def test_memory_accounting_counts_cached_pages_apart(rng):
    from kvcache.accounting import cache_memory
    cache = make(num_pages=8)
    a = filled(cache, np.arange(10), rng)
    filled(cache, np.arange(4) + 50, rng)
    cache.free(a)                                             # 2 cached, the partial page freed
    acc = cache_memory(cache)
    page = cache.config.bytes_per_page
    assert (acc["pages_used"], acc["pages_cached"], acc["pages_free"]) == (1, 2, 5)
    assert acc["cached_bytes"] == 2 * page and acc["used_bytes"] == page
    assert acc["allocated_bytes"] == acc["used_bytes"] + acc["cached_bytes"] + acc["free_bytes"]
