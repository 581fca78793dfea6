"""The targets of issue 9 (streaming decode, tiled multi-query path, batch_step, per-layer overhead): one table
per row of the issue's target table, each with its verdict, from benchmarks/test_walk.py, test_multiquery.py,
test_decode_step.py (MQA), test_tiny.py and test_generation.py of the same run.

Each section returns (markdown, unmet) where unmet lists one line per missed target."""
from __future__ import annotations

from collections import defaultdict

from .results import Results, fmt_time, pct, ratio, shape_key, split_label, table, verdict

WALK_TARGET = 0.90        # of the page-walk ceiling (bandwidth-bound decode and batch_step)
PAGE_SPREAD = 1.10        # page 16 within 10% of page 64
MQA_TARGET = 0.65         # of the matmul rate
MQ_TARGET = 0.60          # multi-query: of the matmul rate where rows >= 64
BATCH_SPEEDUP = 2.0       # batch_step vs a loop of steps at <= 256 tokens
LAYER_OVERHEAD_S = 3e-6   # per layer beyond the kernel
GENERATION_SPEEDUP = 10.0
# ggml's CPU flash attention (GGML_OP_FLASH_ATTN_EXT, -O3 -march=native, 2 threads, cold), as measured on this
# machine kind by the issue's author: quoted, not re-run here.
GGML_MS = {"MHA-q32kv32d128-n4096-fp32": 4.35, "MHA-q32kv32d128-n32768-fp32": 32.0,
           "MHA-q32kv32d128-n32768-fp16": 19.9}


def _walk_rows(res: Results) -> dict:
    """{(shape, page): row} of `test_step_vs_walk`."""
    return {(r["extra"]["shape"], r["extra"]["page_size"]): r for r in res.rows if r["group"].startswith("walk step ")}


def walk_section(res: Results) -> tuple[str, list]:
    rows = _walk_rows(res)
    shapes = sorted({s for s, _ in rows}, key=shape_key)
    out, unmet = [], []
    for s in shapes:
        a, b = rows.get((s, 16)), rows.get((s, 64))
        cells = []
        for r in (a, b):
            e = r["extra"] if r else {}
            cells += [fmt_time(r and r["median"]), f"{e['walk_gb_per_s']:.1f}" if "walk_gb_per_s" in e else "—",
                      pct(e.get("frac_walk"))]
            if r and e.get("frac_walk") is not None and e["frac_walk"] < WALK_TARGET:
                unmet.append(f"step {s} P{e['page_size']}: {pct(e['frac_walk'])} of the page walk")
        spread = a["median"] / b["median"] if a and b and a["median"] and b["median"] else None
        if spread is not None and spread > PAGE_SPREAD:
            unmet.append(f"page 16 vs 64 at {s}: {spread:.2f}x")
        ggml = GGML_MS.get(s)
        vs_ggml = ""
        if ggml and a and b:
            vs_ggml = f"{ggml:.2f} ms: {ggml * 1e-3 / a['median']:.2f}x / {ggml * 1e-3 / b['median']:.2f}x"
            if max(a["median"], b["median"]) > ggml * 1e-3:
                unmet.append(f"vs ggml at {s}: P16 {fmt_time(a['median'])}, P64 {fmt_time(b['median'])} "
                             f"vs {ggml:.2f} ms")
        fracs = [r["extra"].get("frac_walk") for r in (a, b) if r and r["extra"].get("frac_walk") is not None]
        out.append([s, *cells, f"{spread:.2f}" if spread else "—", verdict(spread <= PAGE_SPREAD) if spread else "—",
                    vs_ggml, verdict(min(fracs) >= WALK_TARGET) if fracs else "—"])
    header = ["shape", "P16 step", "P16 walk GB/s", "P16 of walk", "P64 step", "P64 walk GB/s", "P64 of walk",
              "P16 / P64", "within 10%", "ggml flash attn (issue 9): speed-up P16 / P64", "≥ 90% of walk"]
    return table(header, out), unmet


def _compute_rows(res: Results) -> dict:
    """{(shape prefix, dtype, page): compute seconds per token} of benchmarks/test_compute.py."""
    return {(r["extra"]["walk_shape_prefix"], r["extra"]["dtype"], r["extra"]["page_size"]):
            r["extra"]["compute_s_per_token"] for r in res.rows if "compute_s_per_token" in r["extra"]}


def limits_section(res: Results) -> str:
    """Each cold step beside the page walk of its pages and its compute time (the hot step's slope x N): a step
    near walk + compute serialises the two; one near max(walk, compute) overlaps them."""
    compute = _compute_rows(res)
    out = []
    for (s, page), r in sorted(_walk_rows(res).items(), key=lambda kv: (shape_key(kv[0][0]), kv[0][1])):
        e = r["extra"]
        c = compute.get((s.rsplit("-n", 1)[0], e.get("dtype"), page))
        walk = e.get("walk_seconds")
        if c is None or walk is None:
            continue
        comp = c * e["context"]
        out.append([s, page, fmt_time(r["median"]), fmt_time(walk), fmt_time(comp), fmt_time(max(walk, comp)),
                    fmt_time(walk + comp), f"{r['median'] / (walk + comp):.2f}"])
    if not out:
        return "(no compute benchmark in this run: `benchmarks/test_compute.py`)"
    return table(["shape", "page", "cold step", "page walk", "compute (hot slope x N)", "max(walk, compute)",
                  "walk + compute", "step / (walk + compute)"], out)


def mqa_section(res: Results) -> tuple[str, list]:
    """`Decoder.step` at MQA (compute-bound): fraction of the matmul rate, 4096 and 32768 tokens."""
    out, unmet = [], []
    for r in res.rows:
        e = r["extra"]
        if not (r["group"].startswith("step MQA") and e.get("impl") == "engine_step" and e.get("context", 0) >= 4096):
            continue
        m = res.metrics(r)
        out.append([e["shape"], fmt_time(r["median"]), f"{m['gflops']:.0f}", f"{m['matmul_rate'] / 1e9:.0f}",
                    pct(m["frac_mm"]), verdict(m["frac_mm"] >= MQA_TARGET)])
        if m["frac_mm"] < MQA_TARGET:
            unmet.append(f"MQA {e['shape']}: {pct(m['frac_mm'])} of the matmul rate")
    out.sort(key=lambda x: shape_key(x[0]))
    return table(["shape", "Decoder.step", "GFLOP/s", "matmul probe GFLOP/s", "of matmul", "≥ 65%"], out), unmet


def multiquery_targets_section(res: Results) -> tuple[str, list]:
    """extend / prefill: of the matmul rate (rows = tokens x group >= 64) and vs torch SDPA, both as timed in
    this run and as alternated round by round (`alt_*`: the two timings under the same load)."""
    rows = defaultdict(dict)
    for r in res.rows:
        if r["group"].startswith("multiquery ") and "shape" in r["extra"]:
            rows[r["extra"]["shape"]][r["extra"]["impl"]] = r
    out, unmet = [], []
    for shape in sorted(rows):
        eng, tor = rows[shape].get("engine_extend"), rows[shape].get("torch_sdpa")
        if not eng:
            continue
        e = eng["extra"]
        group = e["num_q_heads"] // e["num_kv_heads"]
        m = res.metrics(eng)
        in_scope = e.get("tokens", 0) * group >= 64
        frac_ok = m["frac_mm"] >= MQ_TARGET
        faster = tor is not None and tor["median"] > eng["median"]
        out.append([shape, fmt_time(eng["median"]), pct(m["frac_mm"]), pct(e.get("alt_frac_matmul")),
                    verdict(frac_ok) if in_scope else "(rows < 64)", fmt_time(tor and tor["median"]),
                    (tor or {}).get("extra", {}).get("mask", ""), ratio(tor and tor["median"], eng["median"]),
                    f"{e['alt_speedup_vs_torch']:.2f}x" if "alt_speedup_vs_torch" in e else "—",
                    verdict(faster) if tor else "—"])
        if in_scope and not frac_ok:
            unmet.append(f"{shape}: {pct(m['frac_mm'])} of the matmul rate")
        if tor and not faster:
            unmet.append(f"{shape}: {ratio(tor['median'], eng['median'])} torch SDPA")
    header = ["shape", "engine", "of matmul", "of matmul (alternated)", "≥ 60%", "torch SDPA (same process)",
              "torch mask", "speed-up", "speed-up (alternated)", "faster than torch"]
    return table(header, out) + "\n\n" + _batch_extend_line(res), unmet


def _batch_extend_line(res: Results) -> str:
    got = {r["extra"]["impl"]: r for r in res.rows if r["group"] == "multiquery batch_extend"}
    one, loop = got.get("batch_extend"), got.get("extend_loop")
    if not one or not loop:
        return ""
    m = res.metrics(one)
    return (f"`batch_extend` of several sequences in one kernel call: {fmt_time(one['median'])} vs a loop of "
            f"`extend` {fmt_time(loop['median'])} ({ratio(loop['median'], one['median'])}; {pct(m['frac_mm'])} of "
            f"the matmul rate).")


def batch_walk_section(res: Results) -> tuple[str, list]:
    rows = defaultdict(dict)
    for r in res.rows:
        if r["group"].startswith("walk batch "):
            rows[(r["extra"]["batch"], r["extra"]["context"])][r["extra"]["impl"]] = r
    out, unmet = [], []
    for (b, n) in sorted(rows):
        bs, loop = rows[(b, n)].get("batch_step"), rows[(b, n)].get("loop")
        speed = loop["median"] / bs["median"] if bs and loop else None
        frac = bs["extra"].get("frac_walk") if bs else None
        bound = bs and bs["extra"].get("bound")
        speed_ok = None if n > 256 or speed is None else speed >= BATCH_SPEEDUP
        walk_ok = None if frac is None else frac >= WALK_TARGET
        out.append([b, n, (bs or loop)["extra"].get("shape", ""), fmt_time(bs and bs["median"]),
                    fmt_time(loop and loop["median"]), f"{speed:.2f}x" if speed else "—",
                    verdict(speed_ok) if speed_ok is not None else "(> 256 tokens)", pct(frac), bound or "—",
                    verdict(walk_ok)])
        if speed_ok is False:
            unmet.append(f"batch_step B={b} n={n}: {speed:.2f}x a loop of steps")
        if walk_ok is False:
            unmet.append(f"batch_step B={b} n={n}: {pct(frac)} of the page walk")
    header = ["sequences", "tokens each", "shape", "batch_step", "loop of steps", "speed-up", "≥ 2x (≤ 256 tokens)",
              "batch_step of walk", "bound", "≥ 90% of walk"]
    return table(header, out), unmet


def layers_section(res: Results) -> tuple[str, list]:
    out, unmet = [], []
    for r in res.rows:
        if not r["group"].startswith("layers "):
            continue
        e = r["extra"]
        over = e.get("overhead_per_layer_s")
        ok = over is not None and over <= LAYER_OVERHEAD_S
        out.append([e.get("case"), e.get("shape"), e.get("num_layers"), fmt_time(r["median"]),
                    fmt_time(e.get("kernel_seconds")), fmt_time(over), verdict(ok if over is not None else None)])
        if over is not None and not ok:
            unmet.append(f"per-layer overhead ({e.get('case')}): {fmt_time(over)}")
    header = ["case", "shape", "layers", "token (transaction + all layers)", "the bare kernel calls",
              "per layer beyond the kernel", "≤ 3 µs"]
    return table(header, out), unmet


def tiny_vs_bare_section(res: Results) -> tuple[str, list]:
    steps = res.steps("tiny ")
    out, unmet = [], []
    for s in sorted({s for s, _ in steps}, key=lambda s: split_label(s)["context"]):
        n = split_label(s)["context"]
        eng, bare = steps.get((s, "engine_step")), steps.get((s, "torch_sdpa_bare"))
        if n > 16 or not eng or not bare:
            continue
        ok = eng["median"] < bare["median"]
        out.append([n, fmt_time(eng["median"]), fmt_time(bare["median"]), ratio(bare["median"], eng["median"]),
                    verdict(ok)])
        if not ok:
            unmet.append(f"tiny step at {n} tokens: {fmt_time(eng['median'])} vs bare torch {fmt_time(bare['median'])}")
    return table(["tokens", "Decoder.step", "bare torch SDPA", "speed-up", "below bare torch"], out), unmet


def generation_target(gens: dict) -> tuple[str, list]:
    if "naive" not in gens or "engine" not in gens:
        return "(no generation benchmark in this run)", []
    a, b = gens["naive"]["extra"], gens["engine"]["extra"]
    speed = a["total_s"] / b["total_s"]
    line = (f"{a['tokens']} tokens, {a['heads']} heads x {a['head_dim']} {a['dtype']}: naive {fmt_time(a['total_s'])}, "
            f"engine {fmt_time(b['total_s'])}: **{speed:.1f}x** (target ≥ {GENERATION_SPEEDUP:.0f}x: "
            f"{verdict(speed >= GENERATION_SPEEDUP)}).")
    return line, ([] if speed >= GENERATION_SPEEDUP else [f"generation {speed:.1f}x the naive cache"])


def issue9_section(res: Results, gens: dict) -> tuple[str, list]:
    """Every target row of issue 9, in the issue's order."""
    parts, unmet = [], []
    for title, (text, miss) in (
            ("`Decoder.step` against the page-walk ceiling (cold, 32 q heads, d 128)", walk_section(res)),
            ("What limits the step: its page walk and its compute time", (limits_section(res), [])),
            ("`Decoder.step`, MQA: of the matmul rate", mqa_section(res)),
            ("`extend` / prefill (GQA 32/8, d 128): of the matmul rate and vs torch SDPA",
             multiquery_targets_section(res)),
            ("`batch_step` vs a loop of steps and the page walk", batch_walk_section(res)),
            ("Multi-layer token: per-layer time beyond the kernel", layers_section(res)),
            ("Tiny step (≤ 16 tokens) vs a bare torch SDPA call", tiny_vs_bare_section(res)),
            ("Whole generation vs the naive concat cache", generation_target(gens))):
        parts += [f"### {title}", "", text, ""]
        unmet += miss
    return "\n".join(parts), unmet
