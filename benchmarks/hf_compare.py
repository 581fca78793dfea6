"""generate() with PagedCache + "pagedkv" against DynamicCache + "sdpa" (and StaticCache + "sdpa" with
``--impls dynamic,static,paged``), side by side: each case runs the implementations in fresh processes
(`benchmarks.hf_generate`), their order rotated each repeat, and reports the ratios.

    python -m benchmarks.hf_compare [--quick] [--repeats R] [--cases 512x1,4096x1] [--impls dynamic,static,paged]
        [--model-dtype bfloat16] [--storage auto] [--layers 8] [--out results.json]

Figures: prefill time, median per-token decode time, peak RSS growth of generate() (beside the raw K/V
formula), and for cases with forks the cost of copying a prompt cache for 8 requests.
"""
import argparse
import json
import statistics
import sys
from pathlib import Path

from .test_generation import run_module

MODEL = ["--layers", "16", "--hidden", "2048", "--intermediate", "5632", "--heads", "32", "--kv-heads", "8",
         "--head-dim", "64", "--vocab", "32000"]
QUICK_MODEL = ["--layers", "2", "--hidden", "128", "--intermediate", "256", "--heads", "4", "--kv-heads", "2",
               "--head-dim", "32", "--vocab", "256"]

# (name, prompt, batch, new tokens, forks)
CASES = [("512x1", 512, 1, 32, 0), ("512x8", 512, 8, 32, 0), ("4096x1", 4096, 1, 32, 8)]
# issue 20's transformers row: prompt 512 and 4096 x batch 1 and 8 (`--cases` picks; not in the pytest suite)
ISSUE20_CASES = [("512x1", 512, 1, 32, 0), ("512x8", 512, 8, 32, 0), ("4096x1", 4096, 1, 32, 0),
                 ("4096x8", 4096, 8, 16, 0)]
QUICK_CASES = [("64x1", 64, 1, 6, 8), ("64x2", 64, 2, 6, 0)]
IMPLS = ("dynamic", "paged")
ALL_IMPLS = ("dynamic", "static", "paged")


def case_args(case, quick: bool, layers: int | None = None, model_dtype: str = "float32",
              storage: str = "float32", threads: int = 2, new: int | None = None) -> list[str]:
    _, prompt, batch, case_new, forks = case
    new = case_new if new is None else new
    model = list(QUICK_MODEL if quick else MODEL)
    if layers is not None:
        model[1] = str(layers)
    return [*model, "--prompt", str(prompt), "--batch", str(batch), "--new", str(new),
            "--forks", str(forks), "--model-dtype", model_dtype, "--storage", storage, "--threads", str(threads)]


def run_case(case, impl: str, quick: bool, layers: int | None = None, model_dtype: str = "float32",
             storage: str = "float32", threads: int = 2, new: int | None = None) -> dict:
    return run_module("benchmarks.hf_generate", "--impl", impl,
                      *case_args(case, quick, layers, model_dtype, storage, threads, new), timeout=3600)


def summarize(name: str, runs: dict) -> dict:
    """Medians over repeats and the ratios other / paged (> 1: paged is faster / smaller) for every other
    implementation that ran (``decode_ratio`` etc. keep meaning dynamic / paged)."""
    impls = [impl for impl in ALL_IMPLS if runs.get(impl)]
    med = {impl: {key: statistics.median(r[key] for r in runs[impl])
                  for key in ("prefill_s", "decode_s", "peak_rss_growth_bytes")} for impl in impls}
    out = {"case": name, **{f"{impl}_{k}": v for impl in impls for k, v in med[impl].items()},
           "raw_kv_bytes": runs["paged"][0]["raw_kv_bytes"], "storage": runs["paged"][0].get("storage"),
           "model_dtype": runs["paged"][0].get("model_dtype", "float32")}
    for other in impls:
        if other == "paged":
            continue
        pre = "" if other == "dynamic" else f"{other}_"
        out[f"{pre}prefill_ratio"] = med[other]["prefill_s"] / med["paged"]["prefill_s"]
        out[f"{pre}decode_ratio"] = med[other]["decode_s"] / med["paged"]["decode_s"]
        out[f"{pre}rss_ratio"] = med[other]["peak_rss_growth_bytes"] / max(1, med["paged"]["peak_rss_growth_bytes"])
        out[f"{pre}same_tokens"] = all(a["new_tokens"] == b["new_tokens"] for a, b in zip(runs[other], runs["paged"]))
    if runs["paged"][0].get("forks"):
        for impl in impls:
            out[f"{impl}_fork_s"] = statistics.median(r["fork_s"] for r in runs[impl])
            out[f"{impl}_fork_rss_growth_bytes"] = statistics.median(r["fork_rss_growth_bytes"] for r in runs[impl])
        out["paged_fork_pages_taken"] = max(r["fork_pages_taken"] for r in runs["paged"])
    return out


def table(rows: list[dict]) -> str:
    mib = 1 << 20
    lines = ["| case (prompt x batch) | prefill dynamic / paged (s) | ratio | decode per token dynamic / paged (ms) "
             "| ratio | peak RSS growth dynamic / paged (MiB) | raw K/V (MiB) | same tokens |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['case']} | {r['dynamic_prefill_s']:.2f} / {r['paged_prefill_s']:.2f} | "
                     f"{r['prefill_ratio']:.2f}x | {1e3 * r['dynamic_decode_s']:.1f} / {1e3 * r['paged_decode_s']:.1f}"
                     f" | {r['decode_ratio']:.2f}x | {r['dynamic_peak_rss_growth_bytes'] / mib:.0f} / "
                     f"{r['paged_peak_rss_growth_bytes'] / mib:.0f} | {r['raw_kv_bytes'] / mib:.0f} | "
                     f"{r['same_tokens']} |")
    forks = [r for r in rows if "paged_fork_s" in r]
    if forks:
        lines += ["", "| case | copies | deepcopy(DynamicCache): time, RSS | PagedCache.fork: time, RSS, pool pages "
                  "taken |", "|---|---|---|---|"]
        for r in forks:
            lines.append(f"| {r['case']} | 8 | {1e3 * r['dynamic_fork_s']:.1f} ms, "
                         f"{r['dynamic_fork_rss_growth_bytes'] / mib:.0f} MiB | {1e3 * r['paged_fork_s']:.2f} ms, "
                         f"{r['paged_fork_rss_growth_bytes'] / mib:.1f} MiB, {r['paged_fork_pages_taken']} |")
    return "\n".join(lines)


def table_vs(rows: list[dict]) -> str:
    """Every implementation that ran beside PagedCache: times, peak RSS growth and the ratios other / paged."""
    mib = 1 << 20
    others = [impl for impl in ALL_IMPLS if impl != "paged" and any(f"{impl}_decode_s" in r for r in rows)]
    names = " / ".join(others + ["paged"])
    lines = [f"| case | model / pages | prefill {names} (s) | decode per token {names} (ms) | peak RSS growth {names}"
             " (MiB) | raw K/V (MiB) | " + " | ".join(f"{o}÷paged prefill, decode, RSS" for o in others)
             + " | same tokens |", "|---|---|---|---|---|---|" + "---|" * len(others) + "---|"]
    for r in rows:
        impls = others + ["paged"]
        ratios = []
        for o in others:
            pre = "" if o == "dynamic" else f"{o}_"
            ratios.append(", ".join(f"{r[pre + k]:.2f}" for k in ("prefill_ratio", "decode_ratio", "rss_ratio")))
        same = all(r.get(("" if o == "dynamic" else f"{o}_") + "same_tokens") for o in others)
        lines.append(f"| {r['case']} | {r.get('model_dtype')} / {r.get('storage')} | "
                     + " / ".join(f"{r[i + '_prefill_s']:.2f}" for i in impls) + " | "
                     + " / ".join(f"{1e3 * r[i + '_decode_s']:.1f}" for i in impls) + " | "
                     + " / ".join(f"{r[i + '_peak_rss_growth_bytes'] / mib:.0f}" for i in impls)
                     + f" | {r['raw_kv_bytes'] / mib:.0f} | " + " | ".join(ratios) + f" | {same} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--cases", default=None, help="comma-separated case names (default: all)")
    p.add_argument("--layers", type=int, default=None, help="override the model's layer count (per-layer work "
                   "is unchanged, so per-token ratios hold; times scale with it)")
    p.add_argument("--impls", default=",".join(IMPLS), help="dynamic,static,paged (paged always runs)")
    p.add_argument("--model-dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--storage", default="float32", help="PagedCache pages: float32 | float16 | bfloat16 | auto")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--new", type=int, default=None, help="new tokens per generate() (default: the case's)")
    p.add_argument("--issue20", action="store_true", help="issue 20's cases (512 and 4096 x batch 1 and 8)")
    p.add_argument("--out", default=None, help="write the runs and the summary as JSON here")
    args = p.parse_args(argv)
    cases = QUICK_CASES if args.quick else (ISSUE20_CASES if args.issue20 else CASES)
    if args.cases:
        cases = [c for c in cases if c[0] in args.cases.split(",")]
    impls = tuple(dict.fromkeys([*args.impls.split(","), "paged"]))
    results, rows = {}, []
    for case in cases:
        runs = {impl: [] for impl in impls}
        for repeat in range(args.repeats):
            k = repeat % len(impls)
            for impl in impls[k:] + impls[:k]:
                runs[impl].append(run_case(case, impl, args.quick, args.layers, args.model_dtype, args.storage,
                                              args.threads, args.new))
                print(f"{case[0]} {impl}: prefill {runs[impl][-1]['prefill_s']:.3f} s, decode "
                      f"{runs[impl][-1]['decode_s']:.4f} s/token", file=sys.stderr, flush=True)
        rows.append(summarize(case[0], runs))
        results[case[0]] = runs
        if args.out:
            Path(args.out).write_text(json.dumps({"summary": rows, "runs": results}, indent=1))
    print(table(rows) if impls == IMPLS else table_vs(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
