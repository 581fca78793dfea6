"""Serving benchmark (issue 18 §4): `decode.serve.Engine` against transformers' continuous batching, padded
static `generate()` + DynamicCache, and vLLM's V1 CPU engine, on one saved random-weight Llama checkpoint and one
KV budget; each (system, workload, dtype) in a fresh process (`benchmarks.serve_run`), the systems' order rotated
each round, medians over rounds.

    python -m benchmarks.serve [--systems engine,hf_cb,static,vllm] [--dtypes float32,bfloat16]
        [--workloads burst,poisson,poisson_mixed,shared_prefix] [--requests 64] [--layers 8] [--new 128]
        [--kv-budget-mib 512] [--rate 1.0] [--rounds 1] [--quick] [--out F.json] [--markdown F.md] [--plot F.png]

The issue's workload: 64 requests, prompts log-normal around 512 (128-2048), 128 new tokens, a Llama-style model
of 8 layers, hidden 1024, 16 q / 4 kv heads (head_dim 64, intermediate 2816, vocab 32000). ``--requests`` /
``--layers`` / ``--new`` scale it down for a shared 2-core machine (say so beside the figures). vLLM runs under
``--vllm-python`` (its own venv, /work/vllm-venv) and is skipped, with the reason, when that venv is absent.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks import common
from benchmarks.serve_workload import make_workload

ROOT = Path(__file__).resolve().parent.parent
SYSTEMS = ("engine", "hf_cb", "static", "vllm")
LABELS = {"engine": "decode.serve.Engine", "hf_cb": "transformers generate_batch (sdpa)",
          "static": "padded generate() + DynamicCache", "vllm": "vLLM CPU (V1 engine)"}
MODEL = dict(hidden_size=1024, intermediate_size=2816, num_attention_heads=16, num_key_value_heads=4, head_dim=64,
             vocab_size=32000)
QUICK_MODEL = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                   vocab_size=512)
METRICS = ("output_tokens_per_s", "output_tokens_per_cpu_s", "run_cpu_s", "ttft_p50_s", "ttft_p99_s", "itl_p50_s", "itl_p99_s", "peak_rss_bytes",
           "makespan_s")


def make_checkpoint(directory: Path, dtype: str, layers: int, dims: dict) -> Path:
    """A random-weight Llama saved with save_pretrained (config.json + model.safetensors); reused if present."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    path = directory / f"llama-l{layers}-h{dims['hidden_size']}-{dtype}"
    if (path / "config.json").exists() and any(path.glob("*.safetensors")):
        return path
    config = LlamaConfig(num_hidden_layers=layers, max_position_embeddings=4096, bos_token_id=1, eos_token_id=2,
                         pad_token_id=0, tie_word_embeddings=False, **dims)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval().to(getattr(torch, dtype))
    model.save_pretrained(path)
    return path


def run_one(python: str, system: str, checkpoint: Path, workload_file: Path, args) -> dict:
    cmd = [python, "-m", "benchmarks.serve_run", "--system", system, "--checkpoint", str(checkpoint),
           "--workload", str(workload_file), "--kv-budget", str(args.kv_budget_mib << 20), "--threads",
           str(args.threads), "--max-batched-tokens", str(args.max_batched_tokens), "--max-seqs", str(args.max_seqs)]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=args.timeout,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    if proc.returncode != 0:
        return {"system": system, "error": proc.stderr.strip()[-1500:], "process_wall_s": time.perf_counter() - t0}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def vllm_missing(python: str) -> str | None:
    if not Path(python).exists():
        return f"{python} does not exist"
    proc = subprocess.run([python, "-c", "import vllm"], capture_output=True, text=True, timeout=300)
    return None if proc.returncode == 0 else proc.stderr.strip().splitlines()[-1]


def summarize(runs: list[dict]) -> list[dict]:
    """Medians over rounds per (dtype, workload, system) and each system's ratios to the engine's."""
    groups: dict = {}
    for r in runs:
        groups.setdefault((r["dtype"], r["workload"], r["system"]), []).append(r)
    rows = []
    for (dtype, workload, system), rs in groups.items():
        ok = [r for r in rs if "error" not in r]
        row = {"dtype": dtype, "workload": workload, "system": system, "rounds": len(ok)}
        if not ok:
            row["error"] = rs[-1]["error"]
        for m in METRICS:
            vals = [r[m] for r in ok if r.get(m) is not None]
            if vals:
                row[m] = statistics.median(vals)
        for key in ("prompt_tokens", "output_tokens", "requests", "kv_cache_dtype", "batches", "incomplete"):
            if ok and key in ok[-1]:
                row[key] = ok[-1][key]
        rows.append(row)
    for row in rows:
        eng = next((x for x in rows if x["system"] == "engine" and x["dtype"] == row["dtype"]
                    and x["workload"] == row["workload"] and "output_tokens_per_s" in x), None)
        if eng and "output_tokens_per_s" in row:
            row["engine_throughput_ratio"] = eng["output_tokens_per_s"] / row["output_tokens_per_s"]
    return rows


def fmt_s(x) -> str:
    return "—" if x is None else (f"{1e3 * x:.0f} ms" if x < 1 else f"{x:.1f} s")


def markdown(rows: list[dict], info: dict) -> str:
    out = [f"Workload: {info['workload_text']}", "", f"Run: {info['run_text']}", ""]
    out += ["| dtype | workload | system | output tok/s | engine ÷ system | output tok per CPU-s | TTFT p50 / p99 | "
            "ITL p50 / p99 | peak RSS (MiB) |", "|---|---|---|---|---|---|---|---|---|"]
    order = {s: i for i, s in enumerate(SYSTEMS)}
    for row in sorted(rows, key=lambda r: (r["dtype"], r["workload"], order.get(r["system"], 9))):
        if "error" in row:
            out.append(f"| {row['dtype']} | {row['workload']} | {LABELS[row['system']]} | failed: "
                       f"{row['error'].splitlines()[-1][:150]} | | | | | |")
            continue
        ratio = row.get("engine_throughput_ratio")
        per_cpu = row.get("output_tokens_per_cpu_s")
        out.append(f"| {row['dtype']} | {row['workload']} | {LABELS[row['system']]} | "
                   f"{row['output_tokens_per_s']:.1f} | {'—' if ratio is None else f'{ratio:.2f}x'} | "
                   f"{'—' if per_cpu is None else f'{per_cpu:.1f}'} | "
                   f"{fmt_s(row.get('ttft_p50_s'))} / {fmt_s(row.get('ttft_p99_s'))} | "
                   f"{fmt_s(row.get('itl_p50_s'))} / {fmt_s(row.get('itl_p99_s'))} | "
                   f"{row['peak_rss_bytes'] / 2 ** 20:.0f} |")
    return "\n".join(out)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dtypes = sorted({r["dtype"] for r in rows})
    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    systems = [s for s in SYSTEMS if any(r["system"] == s for r in rows)]
    fig, axes = plt.subplots(2, len(dtypes), figsize=(5.5 * len(dtypes), 7), squeeze=False)
    width = 0.8 / max(1, len(systems))
    for col, dtype in enumerate(dtypes):
        for k, (metric, title) in enumerate((("output_tokens_per_s", "output tokens/s"),
                                             ("ttft_p50_s", "TTFT p50 (s)"))):
            ax = axes[k][col]
            for j, system in enumerate(systems):
                vals = [next((r.get(metric) or 0 for r in rows if r["dtype"] == dtype and r["workload"] == w
                              and r["system"] == system), 0) for w in workloads]
                ax.bar([i + j * width for i in range(len(workloads))], vals, width, label=LABELS[system])
            ax.set_xticks([i + width * (len(systems) - 1) / 2 for i in range(len(workloads))])
            ax.set_xticklabels(workloads, fontsize=8)
            ax.set_title(f"{title}, {dtype} model", fontsize=9)
            if k == 0 and col == 0:
                ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--systems", default=",".join(SYSTEMS))
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--workloads", default="burst,poisson,poisson_mixed,shared_prefix")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--new", type=int, default=128)
    p.add_argument("--prompt-median", type=int, default=512)
    p.add_argument("--rate", type=float, default=1.0, help="Poisson arrivals per second")
    p.add_argument("--kv-budget-mib", type=int, default=512)
    p.add_argument("--max-batched-tokens", type=int, default=2048)
    p.add_argument("--max-seqs", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--timeout", type=float, default=3600)
    p.add_argument("--checkpoint-dir", default="/tmp/kvengine-serve-bench")
    p.add_argument("--vllm-python", default=os.environ.get("VLLM_PYTHON", "/work/vllm-venv/bin/python"))
    p.add_argument("--quick", action="store_true", help="a tiny model and 4 short requests")
    p.add_argument("--out", default=None)
    p.add_argument("--markdown", default=None)
    p.add_argument("--plot", default=None)
    p.add_argument("--from-json", default=None,
                   help="comma-separated --out files of earlier runs: re-render their table (and --plot) together")
    args = p.parse_args(argv)
    if args.from_json:
        saved = [json.loads(Path(f).read_text()) for f in args.from_json.split(",")]
        rows = summarize([r for s in saved for r in s["runs"]])
        text = "\n\n".join(markdown([], s["info"]).split("\n\n| dtype")[0] for s in saved)
        common.write_results(text + "\n\n" + markdown(rows, saved[0]["info"]).split("\n\n", 2)[2],
                             {"summary": rows}, args.out, args.markdown)
        if args.plot:
            plot(rows, Path(args.plot))
        return 0
    dims = QUICK_MODEL if args.quick else MODEL
    if args.quick:
        args.requests, args.layers, args.new, args.prompt_median = 4, 2, 8, 32
    systems = args.systems.split(",")
    why = vllm_missing(args.vllm_python) if "vllm" in systems else None
    if why:
        print(f"vLLM skipped: {why}", file=sys.stderr)
        systems.remove("vllm")
    cdir = Path(args.checkpoint_dir)
    cdir.mkdir(parents=True, exist_ok=True)
    runs, started = [], time.strftime("%Y-%m-%d %H:%M %Z")
    for dtype in args.dtypes.split(","):
        ckpt = make_checkpoint(cdir, dtype, args.layers, dims)
        for name in args.workloads.split(","):
            lo, hi = (8, 64) if args.quick else (128, 2048)
            work = make_workload(name, requests=args.requests, vocab=dims["vocab_size"], new=args.new,
                                 prompt_median=args.prompt_median, prompt_min=lo, prompt_max=hi, rate=args.rate,
                                 shared_prefix=16 if args.quick else 1024)
            if args.quick:
                for r in work:
                    r["max_tokens"] = min(r["max_tokens"], 12)
            wfile = cdir / f"workload-{name}-{args.requests}.json"
            wfile.write_text(json.dumps(work))
            for rnd in range(args.rounds):
                k = rnd % len(systems)
                for system in systems[k:] + systems[:k]:
                    python = args.vllm_python if system == "vllm" else sys.executable
                    r = run_one(python, system, ckpt, wfile, args)
                    r.update({"dtype": dtype, "workload": name, "round": rnd})
                    runs.append(r)
                    print(f"{dtype} {name} {system}: " + (f"failed: {r['error'].splitlines()[-1][:200]}"
                          if "error" in r else f"{r['output_tokens_per_s']:.1f} tok/s, TTFT p50 "
                          f"{r['ttft_p50_s']:.2f} s, ITL p50 {r['itl_p50_s']:.3f} s, {r['process_wall_s']:.0f} s"),
                          file=sys.stderr, flush=True)
                    if args.out:
                        Path(args.out).write_text(json.dumps({"runs": runs}, indent=1))
    rows = summarize(runs)
    load = [r["loadavg"][0] for r in runs if "loadavg" in r]
    info = {"started": started, "ended": time.strftime("%H:%M %Z"), "vllm_skipped": why,
            "vllm": next((r.get("vllm") for r in runs if r.get("vllm")), None),
            "workload_text": (f"{args.requests} requests, prompts log-normal around {args.prompt_median} tokens "
                              f"(clipped {128 if not args.quick else 8}-{2048 if not args.quick else 64}), "
                              f"{args.new} new tokens (mixed: uniform 16-256), Poisson rate {args.rate}/s, "
                              f"shared_prefix: a 1024-token system prompt before each prompt; random-weight Llama "
                              f"{args.layers} layers, hidden {dims['hidden_size']}, {dims['num_attention_heads']} q / "
                              f"{dims['num_key_value_heads']} kv heads, vocab {dims['vocab_size']}; KV budget "
                              f"{args.kv_budget_mib} MiB for every system; greedy, ignore_eos."),
            "run_text": (f"{started} to {time.strftime('%H:%M %Z')}, {args.rounds} round(s), {args.threads} threads "
                         f"per process, fresh process per cell; load average (1 min) at the end of each process "
                         f"{min(load, default=0):.1f}-{max(load, default=0):.1f} on this 2-vCPU machine shared with "
                         f"other sessions; vLLM {next((r.get('vllm') for r in runs if r.get('vllm')), why)}.")}
    common.write_results(markdown(rows, info), {"info": info, "summary": rows, "runs": runs}, args.out,
                         args.markdown)
    if args.plot:
        plot(rows, Path(args.plot))
    return 0


if __name__ == "__main__":
    sys.exit(main())
