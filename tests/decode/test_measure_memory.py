"""decode.app.measure_memory (`kvengine memory`): the report and its table, and small real RSS measurements
beside the formula."""
import json
import mmap
import os

import numpy as np
import pytest

from decode.app import measure_memory as memory
from decode.app.measure_memory import format_table, memory_report
from kvcache.accounting import kv_scale_bytes_formula


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
    """`resident_in` asks the kernel about the arrays' own pages (mincore), not about the whole mappings that
    hold them: a small array inside the shared heap counts its own pages only, an untouched array ~nothing."""
    M = memory
    if M.mincore_resident([np.zeros(1)]) is None:
        pytest.skip("mincore(2) unavailable (not Linux)")
    page = os.sysconf("SC_PAGE_SIZE")
    # its own lazily backed mapping: an anonymous mmap (np.zeros may take memory glibc kept resident from an
    # earlier test once its dynamic mmap threshold has grown, which made this check order-dependent)
    big = np.frombuffer(mmap.mmap(-1, 64 * 1024 * 1024), dtype=np.uint8)
    assert M.mincore_resident([big]) <= 4 * 1024 * 1024                   # (a THP neighbour at most)
    big[:] = 1                                                              # every page touched
    lo, hi = big.ctypes.data // page, -(-(big.ctypes.data + big.nbytes) // page)
    assert M.mincore_resident([big]) == (hi - lo) * page
    small = np.ones(3 * page + 5, dtype=np.uint8)                          # malloc's: may sit in the heap
    resident = M.mincore_resident([small])
    assert (3 * page + 5) <= resident <= 5 * page
    assert M.mincore_resident([small, small]) == resident                  # shared pages counted once
    assert M.resident_in([small])[0] == resident


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
