"""kvcache.accounting: the formula and the accounting identities of a live cache (the measured report is
tests/decode/test_measure_memory.py)."""
import json

import numpy as np
import pytest

import kvcache
from kvcache import accounting
from kvcache.accounting import GIB, cache_memory, kv_bytes_formula


# -- the formula ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kv_heads, expected, gib", [(32, 5_242_880_000, "4.88"), (8, 1_310_720_000, "1.22"),
                                                     (1, 163_840_000, "0.15")])
def test_formula_document_values(kv_heads, expected, gib):
    value = kv_bytes_formula(layers=32, batch=1, tokens=10_000, kv_heads=kv_heads, head_dim=128, bytes_per_element=2)
    assert value == expected and f"{value / GIB:.2f}" == gib
    assert value == 2 * 32 * 1 * 10_000 * kv_heads * 128 * 2


def test_formula_head_dim_v_batch_and_zero_tokens():
    assert kv_bytes_formula(2, 3, 5, 4, 8, 4, head_dim_v=6) == 2 * 3 * 5 * 4 * (8 + 6) * 4
    assert kv_bytes_formula(2, 3, 0, 4, 8, 4) == 0


@pytest.mark.parametrize("name, value, error, message", [
    ("layers", 0, ValueError, "layers: expected an integer >= 1, got 0"),
    ("tokens", -1, ValueError, "tokens: expected an integer >= 0, got -1"),
    ("kv_heads", True, TypeError, "kv_heads: expected an integer, got bool True"),
    ("head_dim", 2.0, TypeError, "head_dim: expected an integer, got float 2.0"),
    ("bytes_per_element", 0, ValueError, "bytes_per_element: expected an integer >= 1, got 0"),
    ("head_dim_v", 0, ValueError, "head_dim_v: expected an integer >= 1, got 0"),
])
def test_formula_arguments_checked(name, value, error, message):
    kwargs = dict(layers=1, batch=1, tokens=1, kv_heads=1, head_dim=1, bytes_per_element=2)
    kwargs[name] = value
    with pytest.raises(error, match=f"^{message}$"):
        kv_bytes_formula(**kwargs)


def test_attention_kind():
    assert [accounting.attention_kind(32, kv) for kv in (32, 8, 1)] == ["MHA", "GQA-8", "MQA"]


# -- cache_memory ----------------------------------------------------------------------------------------------------
def small_cache(**kwargs):
    args = dict(num_layers=2, num_kv_heads=2, head_dim=3, head_dim_v=5, page_size=4, num_pages=6, dtype="float16")
    args.update(kwargs)
    return kvcache.KVCache(**args)


def append(cache, seq, tokens):
    cfg = cache.config
    cache.append(seq, np.ones((cfg.num_layers, tokens, cfg.num_kv_heads, cfg.head_dim)),
                 np.ones((cfg.num_layers, tokens, cfg.num_kv_heads, cfg.head_dim_v)))


def check_identities(acc, cache):
    cfg = cache.config
    assert acc["allocated_bytes"] == cache.pool.nbytes == cfg.num_pages * cfg.bytes_per_page
    assert acc["used_bytes"] == acc["pages_used"] * cfg.bytes_per_page
    assert acc["used_bytes"] == acc["formula_bytes"] + acc["tail_waste_bytes"]
    assert acc["allocated_bytes"] == acc["used_bytes"] + acc["free_bytes"]
    assert acc["pages_used"] + acc["pages_free"] == cfg.num_pages and acc["pages_free"] == cache.num_free_pages
    assert acc["formula_bytes"] == acc["distinct_tokens"] * cfg.bytes_per_token
    assert acc["formula_bytes_logical"] == acc["logical_tokens"] * cfg.bytes_per_token
    assert acc["tail_waste_bytes"] >= 0 and acc["metadata_bytes"] == sum(acc["metadata_detail"].values()) > 0
    json.dumps(acc)


def test_cache_memory_empty_and_filled():
    cache = small_cache()
    bpt = 2 * 2 * (3 + 5) * 2
    acc = cache_memory(cache)
    check_identities(acc, cache)
    assert (acc["formula_bytes"], acc["used_bytes"], acc["tail_waste_bytes"]) == (0, 0, 0)
    a = cache.create_sequence()
    append(cache, a, 5)                                          # 2 pages, 3 empty slots
    acc = cache_memory(cache)
    check_identities(acc, cache)
    assert acc["formula_bytes"] == 5 * bpt == kv_bytes_formula(2, 1, 5, 2, 3, 2, head_dim_v=5)
    assert acc["used_bytes"] == 8 * bpt and acc["tail_waste_bytes"] == 3 * bpt
    assert acc["num_sequences"] == 1 and acc["logical_tokens"] == acc["distinct_tokens"] == 5


def test_cache_memory_counts_shared_pages_once():
    cache = small_cache()
    bpt = cache.config.bytes_per_token
    a = cache.create_sequence()
    append(cache, a, 5)
    b = cache.fork(a)
    acc = cache_memory(cache)
    check_identities(acc, cache)
    assert acc["logical_tokens"] == 10 and acc["distinct_tokens"] == 5 and acc["pages_used"] == 2
    append(cache, b, 1)                       # copy-on-write of the tail page: b's copy holds positions 4, 5
    acc = cache_memory(cache)
    check_identities(acc, cache)
    assert acc["distinct_tokens"] == 4 + 1 + 2 and acc["pages_used"] == 3
    assert acc["tail_waste_bytes"] == (12 - 7) * bpt
    cache.truncate(b, 2)                      # b keeps only shared page 0, partially: the page still holds 4
    acc = cache_memory(cache)
    check_identities(acc, cache)
    assert acc["distinct_tokens"] == 5 and acc["logical_tokens"] == 7


def test_cache_memory_release_and_open_transaction():
    cache = small_cache()
    a = cache.create_sequence()
    append(cache, a, 10)
    cache.release_before(a, 8)
    acc = cache_memory(cache)
    check_identities(acc, cache)
    assert acc["logical_tokens"] == acc["distinct_tokens"] == 2 and acc["pages_used"] == 1
    tx = cache.transaction({a: 7})            # reserved pages are used; their slots hold no token yet
    acc = cache_memory(cache)
    check_identities(acc, cache)
    assert acc["pages_used"] == 3 and acc["distinct_tokens"] == 2
    tx.rollback()
    cache.free(a)
    acc = cache_memory(cache)
    check_identities(acc, cache)
    assert acc["pages_used"] == 0 and acc["num_sequences"] == 0


def test_cache_memory_type_check():
    with pytest.raises(TypeError, match="^cache: expected a KVCache, got dict$"):
        cache_memory({})
