"""`python -m benchmarks.report`: the verdicts follow the recorded figures (synthetic runs on both sides of each
target), and the committed run renders with every one of its issue-9 / issue-11 rows in the document."""
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.report.document import render            # noqa: E402
from benchmarks.report.results import Results            # noqa: E402

pytest.importorskip("matplotlib")


def _bench(group, name, median, **extra):
    return {"group": group, "name": name, "fullname": name, "stats": {"median": median, "min": median, "rounds": 5},
            "extra_info": extra}


def _walk(shape, page, median, frac):
    return _bench(f"walk step {shape}", f"test_step_vs_walk[{shape}-P{page}]", median, shape=shape, page_size=page,
                  frac_walk=frac, walk_gb_per_s=40.0)


def test_limits_table_sets_walk_and_compute_beside_the_step(tmp_path):
    shape = "GQA-q32kv8d128-n4096-fp16"
    walk = _walk(shape, 16, 1.5e-3, 0.6)
    walk["extra_info"].update(dtype="float16", context=4096, walk_seconds=1.0e-3)
    compute = _bench("compute GQA-q32kv8d128-fp16", "test_step_compute[x]", 1e-4, walk_shape_prefix="GQA-q32kv8d128",
                     dtype="float16", page_size=16, compute_s_per_token=1e-3 / 4096 / 2)
    text = _render(tmp_path, [walk, compute])
    assert f"| {shape} | 16 | 1.50 ms | 1.00 ms | 500.0 µs | 1.00 ms | 1.50 ms | 1.00 |" in text


def _int8(att, n, page, s16, s32):
    return _bench(f"int8 {att} n{n} P{page}", f"test_int8_step[{att}{n}P{page}]", 1e-3, attention=att, context=n,
                  page_size=page, median_s_int8=1e-3, median_s_float16=s16 * 1e-3, median_s_float32=s32 * 1e-3,
                  speedup_vs_float16=s16, speedup_vs_float32=s32)


def _layers(case, overhead):
    return _bench(f"layers 32x X-{case}", f"test_layer_overhead[{case}]", 1e-3, case=case, shape="X", num_layers=32,
                  kernel_seconds=1e-3 - 32 * overhead, overhead_per_layer_s=overhead)


def _render(tmp_path, benchmarks, memory=None):
    doc = tmp_path / "benchmarks.md"
    return render(Results({"benchmarks": benchmarks, "pagedkv": {}}), memory, None, doc)


def _row(text, first_cell):
    return next(line for line in text.splitlines() if line.startswith(f"| {first_cell} |"))


def test_walk_verdicts_follow_the_fractions_and_the_page_spread(tmp_path):
    good, bad = "GQA-q32kv8d128-n4096-fp16", "GQA-q32kv8d128-n32768-fp16"
    text = _render(tmp_path, [_walk(good, 16, 1.05e-3, 0.95), _walk(good, 64, 1.0e-3, 0.93),
                              _walk(bad, 16, 2.0e-3, 0.95), _walk(bad, 64, 1.0e-3, 0.50)])
    assert _row(text, good).endswith("| **met** |  | **met** |")
    row = _row(text, bad)
    assert "| 2.00 | **not met** |" in row and row.endswith("**not met** |")
    assert f"* step {bad} P64: 50% of the page walk" in text
    assert f"* page 16 vs 64 at {bad}: 2.00x" in text
    assert f"step {good}" not in text.split("## Targets (issues 9")[1].split("<!-- notes")[0]


def test_int8_and_layer_verdicts(tmp_path):
    memory = [{"attention": "MQA", "kv_heads": 1, "tokens": 10, "dtype": "int8", "formula_bytes": 1000,
               "allocated_bytes": 1000, "rss_touched_bytes": 1030, "value_bytes": 940, "scale_bytes": 60,
               "scale_overhead": 0.0625},
              {"attention": "MHA", "kv_heads": 32, "tokens": 10, "dtype": "int8", "formula_bytes": 1000,
               "allocated_bytes": 1000, "rss_touched_bytes": 1010, "value_bytes": 940, "scale_bytes": 60,
               "scale_overhead": 0.0625}]
    text = _render(tmp_path, [_int8("MHA", 32768, 64, 1.8, 3.6), _int8("GQA", 4096, 16, 1.2, 1.5),
                              _layers("hot", 2e-6), _layers("cold", 5e-6)], memory)
    assert "≥ 1.70x: **met**" in text and "≥ 3.5x: **met**" in text
    assert "* int8 GQA 4096 P16: 1.20x float16 (target 1.35x)" in text
    assert "* int8 memory MQA: measured +3.00% of the formula" in text and "int8 memory MHA" not in text
    assert "| +1.00% | **met** |" in text
    assert "* per-layer overhead (cold): 5.0 µs" in text and "per-layer overhead (hot)" not in text


@pytest.mark.parametrize("name", ["full-run.json"])
def test_committed_run_renders_every_issue_row(tmp_path, name):
    path = ROOT / "benchmarks" / "results" / name
    raw = json.loads(path.read_text())
    text = render(Results(raw), None, path, tmp_path / "benchmarks.md")
    for b in raw["benchmarks"]:
        e = b.get("extra_info") or {}
        if b["group"].startswith("walk step "):
            assert f"| {e['shape']} |" in text
        if b["group"].startswith("int8 ") and "median_s_int8" in e:
            assert f"| {e['attention']} | {e['context']} | {e['page_size']} |" in text
    assert "## Issue 9 targets" in text and "## Issue 11 targets: int8 storage" in text
