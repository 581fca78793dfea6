"""Sections of the cache operations, the batched step, page sizes and the multi-query comparison."""
from __future__ import annotations

from collections import defaultdict

from .results import Results, fmt_bytes, fmt_time, pct, ratio, shape_key, table


def ops_section(res: Results) -> str:
    rows = []
    for op in ("append", "extend", "truncate", "fork", "step_after_fork"):
        for r in res.op_rows(op):
            e = r["extra"]
            what = {"append": f"{e.get('tokens')} tokens", "extend": f"{e.get('tokens')} queries at length {e.get('context')}",
                    "truncate": f"drop {e.get('tokens')} tokens ({e.get('pages_freed')} pages)",
                    "fork": f"{e.get('tokens')} tokens ({e.get('pages_shared')} pages shared)",
                    "step_after_fork": f"copy-on-write of {fmt_bytes(e.get('cow_bytes'))} + step at {e.get('context')}"}[op]
            extra = ""
            if op == "append" and r["median"]:
                extra = f"{e['bytes_written'] / r['median'] / 1e9:.2f} GB/s written"
            if op == "extend" and r["median"]:
                extra = f"{pct(res.metrics(r)['roof'])} of roofline"
            rows.append([op, what, fmt_time(r["median"]), fmt_time(r["min"]), r["rounds"], extra])
    return table(["operation", "what", "median", "min", "rounds", ""], rows)


def batch_section(res: Results) -> str:
    rows = defaultdict(dict)
    for r in res.op_rows("batched_step"):
        rows[r["extra"]["batch"]][r["extra"]["impl"]] = r
    out = []
    for b in sorted(rows):
        bs, loop = rows[b].get("engine_batch_step"), rows[b].get("engine_step_loop")
        ref = bs or loop
        e = ref["extra"]
        out.append([b, f"{e['lengths_min']}-{e['lengths_max']}", fmt_bytes(e["kv_bytes"]),
                    fmt_time(bs and bs["median"]), fmt_time(loop and loop["median"]),
                    ratio(loop and loop["median"], bs and bs["median"]),
                    pct(res.metrics(bs)["roof"]) if bs else "—"])
    return table(["sequences", "lengths", "K/V read", "batch_step", "loop of Decoder.step", "batch speed-up",
                  "batch_step % roofline"], out)


def multiquery_section(res: Results) -> str:
    """Prefill / extend (benchmarks/test_multiquery.py): engine vs torch SDPA, and the alternated ratios."""
    rows = defaultdict(dict)
    for r in res.rows:
        if r["group"].startswith("multiquery") and "shape" in r["extra"]:
            rows[r["extra"]["shape"]][r["extra"]["impl"]] = r
    out = []
    for shape, impls in rows.items():
        eng, tor = impls.get("engine_extend"), impls.get("torch_sdpa")
        if not eng and not tor:                  # the int8 rows (issue 11's section)
            continue
        m = res.metrics(eng) if eng else {}
        alt = eng["extra"] if eng else {}
        out.append([shape, fmt_time(eng and eng["median"]), fmt_time(tor and tor["median"]),
                    ratio(tor and tor["median"], eng and eng["median"]),
                    f"{m['gflops']:.0f}" if m else "—", pct(m["frac_mm"]) if m else "—",
                    f"{alt['alt_speedup_vs_torch']:.2f}x" if "alt_speedup_vs_torch" in alt else "—",
                    pct(alt["alt_frac_matmul"]) if "alt_frac_matmul" in alt else "—", (tor or eng)["extra"].get("mask", "")])
    return table(["shape", "engine (Decoder.extend)", "torch SDPA", "speed-up", "engine GFLOP/s", "of matmul",
                  "alternated speed-up", "alternated of matmul", "torch mask"], out)


def page_section(res: Results) -> str:
    rows = []
    for r in res.rows:
        if r["group"].startswith("page size"):
            e = r["extra"]
            rows.append([e["shape"], e.get("page_size"), fmt_time(r["median"]), pct(res.metrics(r)["roof"])])
    rows.sort(key=lambda x: (shape_key(x[0]), x[1]))
    return table(["shape", "page size", "Decoder.step (cold)", "% roofline"], rows)



COVERED_GROUPS = ("step ", "tiny ", "walk ", "layers ", "multiquery", "int8 ", "page size")
COVERED_OPS = ("append", "extend", "truncate", "fork", "step_after_fork", "batched_step")
SHOWN_EXTRA = ("ratio", "target", "target_met", "ns_per_token", "ms", "target_ms", "save_gb_s", "load_gb_s",
               "speedup", "tokens_per_s", "ttft_s")


def other_rows_section(res: Results) -> str:
    """Every benchmark of the run that no section above shows (prefix caching, snapshots, the transformers and
    Ray integrations): group, name, median, and the figures they record for their own targets."""
    out = []
    for r in res.rows:
        e = r["extra"]
        if r["group"].startswith(COVERED_GROUPS) or e.get("op") in COVERED_OPS or "generation" in str(e.get("impl")) \
                or e.get("impl") == "engine_first_step":
            continue
        shown = ", ".join(f"{k}={_short(e[k])}" for k in SHOWN_EXTRA if k in e)
        out.append([r["group"], r["name"].replace("test_", "", 1), fmt_time(r["median"]), fmt_time(r["min"]),
                    r["rounds"], shown])
    if not out:
        return "(none)"
    return table(["group", "benchmark", "median", "min", "rounds", "recorded"], out)


def _short(x) -> str:
    return f"{x:.3g}" if isinstance(x, float) else str(x)
