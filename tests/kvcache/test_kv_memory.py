"""kvcache.memory: the formula, the accounting identities of a live cache, the report and its table, and one
small real RSS measurement."""
import json
import os

import numpy as np
import pytest

import kvcache
from kvcache import memory
from kvcache.memory import GIB, cache_memory, format_table, kv_bytes_formula, kv_scale_bytes_formula, memory_report


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
    assert [memory.attention_kind(32, kv) for kv in (32, 8, 1)] == ["MHA", "GQA-8", "MQA"]


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
    assert acc["allocated_bytes"] == cache.pool_nbytes == cfg.num_pages * cfg.bytes_per_page
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


# -- memory_report, format_table -------------------------------------------------------------------------------------
def test_report_formula_only_default_shape():
    rows = memory_report(measure=False)
    assert [r["kv_heads"] for r in rows] == [32, 8, 1]
    assert [r["attention"] for r in rows] == ["MHA", "GQA-8", "MQA"]
    assert [r["formula_bytes"] for r in rows] == [5_242_880_000, 1_310_720_000, 163_840_000]
    for row in rows:
        assert row["num_pages"] == 625                           # 10,000 tokens / 16 exactly
        assert row["allocated_bytes"] == row["used_bytes"] == row["formula_bytes"]
        assert row["tail_waste_bytes"] == 0 and 0 < row["metadata_bytes"] < 1_000_000
        assert row["rss_touched_bytes"] is None and row["measured_over_formula"] is None
        assert row["pool_resident_bytes"] is None and row["pool_huge_page_bytes"] is None
        assert row["measured"] is False
    assert json.loads(json.dumps(rows)) == rows
    table = format_table(rows)
    for text in ("kv_heads", "formula bytes", "allocated", "used", "tail waste", "metadata", "RSS untouched",
                 "RSS 1 token", "RSS touched", "pool resident", "in huge pages", "measured/formula", "5,242,880,000", "4.88 GiB", "1.22 GiB", "156.2 MiB",
                 "32 (MHA)", "8 (GQA-8)", "1 (MQA)", "tokens=10000"):
        assert text in table
    assert len(table.splitlines()) == 2 + 3 + 1


def test_report_tail_waste_and_batch():
    rows = memory_report(layers=2, num_q_heads=4, kv_heads=(4, 2), tokens=10, head_dim=8, dtype="float32",
                         batch=3, page_size=4, measure=False)
    for row in rows:
        bpt = 2 * row["kv_heads"] * 16 * 4
        assert row["num_pages"] == 3 * 3
        assert row["formula_bytes"] == 3 * 10 * bpt
        assert row["used_bytes"] == row["allocated_bytes"] == 3 * 12 * bpt
        assert row["tail_waste_bytes"] == 3 * 2 * bpt


def test_report_single_int_kv_heads_and_zero_tokens():
    [row] = memory_report(layers=1, num_q_heads=2, kv_heads=2, tokens=0, head_dim=4, measure=False)
    assert row["formula_bytes"] == 0 and row["measured_over_formula"] is None


@pytest.mark.parametrize("kwargs, error, message", [
    ({"kv_heads": (32, 5)}, ValueError, "kv_heads: expected a divisor of num_q_heads=32, got 5"),
    ({"kv_heads": ()}, ValueError, "kv_heads: expected at least one KV-head count, got none"),
    ({"kv_heads": (0,)}, ValueError, "kv_heads: expected an integer >= 1, got 0"),
    ({"tokens": -5}, ValueError, "tokens: expected an integer >= 0, got -5"),
    ({"layers": 1.5}, TypeError, "layers: expected an integer, got float 1.5"),
    ({"dtype": "int16"}, TypeError, "dtype: expected one of float16, float32, float64, int8, bfloat16"),
])
def test_report_arguments_checked(kwargs, error, message):
    with pytest.raises(error, match=f"^{message}"):
        memory_report(measure=False, **kwargs)


def test_format_table_empty():
    assert format_table([]) == "(no rows)"


# -- measured --------------------------------------------------------------------------------------------------------
def test_report_refuses_shapes_that_do_not_fit():
    pytest.importorskip("psutil")
    with pytest.raises(ValueError, match=r"^kv_heads=32: measuring needs .* GiB .* available .* measure=False"):
        memory_report(tokens=1_000_000)                           # a 488 GiB pool


def test_small_real_measurement_matches_formula():
    """About 200 MiB touched: the resident increase is within 2% of the formula (one retry: shared machine)."""
    pytest.importorskip("psutil")
    for attempt in range(2):
        [row] = memory_report(layers=4, num_q_heads=8, kv_heads=(8,), tokens=12_800, head_dim=128,
                              dtype="float16", page_size=16)
        assert row["formula_bytes"] == 209_715_200 and row["measured"] is True
        if abs(row["measured_over_formula"] - 1) <= 0.02:
            break
    assert abs(row["measured_over_formula"] - 1) <= 0.02, row
    if row["pool_resident_bytes"] is not None:                             # Linux: the pool's own mappings
        assert abs(row["pool_resident_bytes"] / row["formula_bytes"] - 1) <= 0.02, row
        assert 0 <= row["pool_huge_page_bytes"] <= row["pool_resident_bytes"]
    assert row["rss_untouched_bytes"] < 0.01 * row["formula_bytes"]          # zeros are lazily backed
    assert row["rss_one_token_bytes"] < 0.5 * row["formula_bytes"]
    assert "measured/formula" in format_table([row])
    # the naive concat cache of the same tokens: during a step one layer's old and new K (or V) are both alive,
    # so its peak is about formula * (1 + 1 / (2 * layers)) = 1.125 here; the paged pool never copies
    assert row["naive_peak_bytes"] is not None and "naive/formula" in format_table([row])
    assert 1.06 <= row["naive_peak_over_formula"] <= 1.25, row


def test_naive_peak_can_be_skipped_and_is_absent_without_measuring():
    [row] = memory_report(layers=1, num_q_heads=2, kv_heads=2, tokens=4, head_dim=4, measure=False)
    assert row["naive_peak_bytes"] is None and row["naive_peak_over_formula"] is None


def test_report_int8_formula_counts_the_scales():
    rows = memory_report(measure=False, dtype="int8")
    values = [2_621_440_000, 655_360_000, 81_920_000]                    # 1 byte per element
    scales = [v // 16 for v in values]                                    # a float16 per 32 values: +6.25%
    assert [r["value_bytes"] for r in rows] == values
    assert [r["scale_bytes"] for r in rows] == scales
    assert [r["formula_bytes"] for r in rows] == [v + s for v, s in zip(values, scales)]
    for row in rows:
        assert row["dtype"] == "int8" and row["scale_overhead"] == 0.0625
        assert row["allocated_bytes"] == row["used_bytes"] == row["formula_bytes"]
    table = format_table(rows)
    assert "of which scales" in table and "(+6.25%)" in table and "dtype=int8" in table
    assert kv_scale_bytes_formula(1, 1, 1, 1, 40, 33) == (2 + 2) * 2


def test_small_real_int8_measurement_matches_formula():
    """About 220 MiB of int8 values and scales touched: the resident increase is within 2% of the formula."""
    pytest.importorskip("psutil")
    for attempt in range(2):
        [row] = memory_report(layers=4, num_q_heads=8, kv_heads=(8,), tokens=25_600, head_dim=128,
                              dtype="int8", page_size=16)
        assert row["formula_bytes"] == 4 * 25_600 * 8 * (256 + 16) and row["measured"] is True
        if abs(row["measured_over_formula"] - 1) <= 0.02:
            break
    assert abs(row["measured_over_formula"] - 1) <= 0.02, row
    if row["pool_resident_bytes"] is not None:
        assert abs(row["pool_resident_bytes"] / row["formula_bytes"] - 1) <= 0.02, row
    assert row["naive_peak_bytes"] is None                              # the naive cache has no int8 form


def test_pool_residency_is_counted_per_page_of_the_arrays():
    """`_resident_in` asks the kernel about the arrays' own pages (mincore), not about the whole mappings that
    hold them: a small array inside the shared heap counts its own pages only, an untouched array ~nothing."""
    M = memory
    if M._mincore_resident([np.zeros(1)]) is None:
        pytest.skip("mincore(2) unavailable (not Linux)")
    page = os.sysconf("SC_PAGE_SIZE")
    big = np.zeros(64 * 1024 * 1024, dtype=np.uint8)                      # its own lazily backed mapping
    assert M._mincore_resident([big]) <= 4 * 1024 * 1024                   # (a THP neighbour at most)
    big[:] = 1                                                              # every page touched
    lo, hi = big.ctypes.data // page, -(-(big.ctypes.data + big.nbytes) // page)
    assert M._mincore_resident([big]) == (hi - lo) * page
    small = np.ones(3 * page + 5, dtype=np.uint8)                          # malloc's: may sit in the heap
    resident = M._mincore_resident([small])
    assert (3 * page + 5) <= resident <= 5 * page
    assert M._mincore_resident([small, small]) == resident                  # shared pages counted once
    assert M._resident_in([small])[0] == resident


def test_int8_mqa_report_row_within_2_percent():
    """The default report shape's int8 MQA row (32 layers, 10 000 tokens, head_dim 128: an 83 MiB pool with
    its scales): formula == allocated, the pool's own resident pages within a few pages of it, and the
    measuring process's RSS increase within 2% (the fill's one-time costs are in the baseline, `_warm_up`;
    one retry: shared machine)."""
    pytest.importorskip("psutil")
    for attempt in range(2):
        [row] = memory_report(kv_heads=(1,), dtype="int8", naive_peak=False)
        assert row["attention"] == "MQA" and row["formula_bytes"] == 81_920_000 + 5_120_000
        if abs(row["measured_over_formula"] - 1) <= 0.02:
            break
    assert row["allocated_bytes"] == row["used_bytes"] == row["formula_bytes"]
    assert abs(row["measured_over_formula"] - 1) <= 0.02, row
    if row["pool_resident_bytes"] is not None:                              # Linux: the arrays' own pages
        page = os.sysconf("SC_PAGE_SIZE")
        assert row["formula_bytes"] <= row["pool_resident_bytes"] <= row["formula_bytes"] + 8 * page, row
