"""Paired timing of the forwards generate() makes: one model, a DynamicCache ("sdpa"), optionally a StaticCache
("sdpa") and a PagedCache ("pagedkv") side by side in one process; the prefills of each and then every decode
step alternate between them (the order rotates each step), so a noisy shared machine slows all alike and the
per-step ratio survives.

    python -m benchmarks.hf_paired [--prompt 4096] [--batch 1] [--steps 32] [--layers 4] [--threads 2] [--json]
        [--impls dynamic,static,paged] [--model-dtype bfloat16] [--storage auto] [--prefill-repeats 3]

Reported: prefill seconds of each (median of the repeats), the median decode step of each, the medians of the
per-step ratios other / paged (> 1 means paged is faster), and the CPU time (process_time) beside the wall time.
"""
import argparse
import json
import statistics
import sys
import time

from benchmarks.hf_generate import WARM_COLUMNS


def timed(fn):
    cpu, wall = time.process_time(), time.perf_counter()
    fn()
    return time.perf_counter() - wall, time.process_time() - cpu


IMPLS = {"dynamic": "sdpa", "static": "sdpa", "paged": "pagedkv"}      # cache -> attention implementation


def make_cache(impl, model, args, max_len):
    from transformers import DynamicCache, StaticCache

    from decode.hf import PagedCache

    if impl == "dynamic":
        return DynamicCache(config=model.config)
    if impl == "static":
        return StaticCache(config=model.config, max_cache_len=max_len)
    kwargs = {} if args.storage == "auto" else {"dtype": args.storage}
    if impl.startswith("paged-t"):                      # "paged-t2": the kernel on 2 numba threads
        kwargs["kernel_threads"] = int(impl[len("paged-t"):])
    return PagedCache(model.config, max_tokens=args.batch * (max_len + 128), page_size=64, **kwargs)


def attn_implementation(impl: str) -> str:
    return IMPLS["paged" if impl.startswith("paged") else impl]


def table(rows: list[dict]) -> str:
    """Markdown of saved ``--json`` results (`python -m benchmarks.hf_paired --table F.jsonl`): the paired ratios
    other / paged (> 1: PagedCache faster) of wall time and of CPU time, beside the medians."""
    lines = ["| model | prompt x batch | layers | pages | prefill dynamic / static / paged (s) | decode step dynamic / "
             "static / paged (ms) | dynamic÷paged prefill, decode | static÷paged prefill, decode | CPU-time "
             "ratios dynamic÷paged, static÷paged decode |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        impls = [i for i in ("dynamic", "static", "paged") if f"{i}_decode_s" in r]

        def ratio(o, what):
            return f"{r.get(f'{o}_over_paged_{what}', float('nan')):.2f}"

        cpu = ", ".join(f"{r[f'{o}_decode_cpu_s'] / r['paged_decode_cpu_s']:.2f}" for o in impls if o != "paged")
        pages = {"uint16": "bfloat16"}.get(r["storage"], r["storage"])        # early runs named bf16's bit dtype
        lines.append(f"| {r['model_dtype']} | {r['prompt']} x {r['batch']} | {r['layers']} | {pages} | "
                     + " / ".join(f"{r[f'{i}_prefill_s']:.2f}" for i in impls) + " | "
                     + " / ".join(f"{1e3 * r[f'{i}_decode_s']:.1f}" for i in impls) + " | "
                     + " | ".join(f"{ratio(o, 'prefill')}, {ratio(o, 'decode')}" for o in impls if o != "paged")
                     + f" | {cpu} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--table", default=None, help="print the markdown table of a file of --json lines and exit")
    p.add_argument("--prompt", type=int, default=4096)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--impls", default="dynamic,paged", help="caches side by side: dynamic,static,paged (paged-tN: "
                                                             "PagedCache(kernel_threads=N))")
    p.add_argument("--model-dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--storage", default="float32", help="PagedCache pages: float32 | float16 | bfloat16 | auto")
    p.add_argument("--prefill-repeats", type=int, default=1,
                   help="prefills of each cache, alternated (the last one's cache is decoded)")
    p.add_argument("--quick", action="store_true", help="a tiny model (CI)")
    p.add_argument("--thin-prefill", action="store_true",
                   help="fill the caches with a narrow model of the same attention layout (hidden 256): the "
                        "history's K/V for the decode timing at a fraction of the prefill cost; prefill times "
                        "are then the narrow model's")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if args.table:
        with open(args.table) as f:
            print(table([json.loads(line) for line in f if line.strip()]))
        return 0

    import numba
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    import decode.hf  # noqa: F401

    torch.set_num_threads(args.threads)
    numba.set_num_threads(min(args.threads, numba.config.NUMBA_NUM_THREADS))
    impls = args.impls.split(",")
    dims = (dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                 vocab_size=256) if args.quick else
            dict(hidden_size=2048, intermediate_size=5632, num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                 vocab_size=32000))
    max_len = args.prompt + args.steps
    config = LlamaConfig(num_hidden_layers=args.layers, max_position_embeddings=max_len + 64,
                         eos_token_id=None, bos_token_id=None, pad_token_id=0, **dims)
    torch.manual_seed(0)
    dtype = getattr(torch, args.model_dtype)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval().to(dtype)
    ids = torch.randint(1, dims["vocab_size"], (args.batch, max_len), generator=torch.Generator().manual_seed(1))
    caches = {}

    thin = model
    if args.thin_prefill:
        thin_config = LlamaConfig(**{**config.to_dict(), "hidden_size": 256, "intermediate_size": 256})
        torch.manual_seed(0)
        thin = AutoModelForCausalLM.from_config(thin_config, attn_implementation="sdpa").eval().to(dtype)

    def forward(impl, tokens, which=None):
        which = model if which is None else which
        which.set_attn_implementation(attn_implementation(impl))
        with torch.no_grad():
            return which(input_ids=tokens, past_key_values=caches[impl], use_cache=True, logits_to_keep=1).logits

    for impl in impls:                                        # compile / warm up outside the timings
        warm = min(args.prompt, WARM_COLUMNS)                 # every prefill kernel route (`hf_generate`)
        caches[impl] = make_cache(impl, model, args, warm + 1)
        forward(impl, ids[:, :warm])
        forward(impl, ids[:, warm:warm + 1])
    prefill, steps, logits = {i: [] for i in impls}, {i: [] for i in impls}, {}
    for rep in range(args.prefill_repeats):
        for impl in (impls if rep % 2 == 0 else impls[::-1]):
            caches[impl] = make_cache(impl, model, args, max_len)
            prefill[impl].append(timed(lambda: logits.__setitem__(impl, forward(impl, ids[:, :args.prompt], thin))))
    base = impls[0]
    max_diff = {i: float((logits[base].float() - logits[i].float()).abs().max()) for i in impls[1:]}
    for i in range(args.steps):
        tok = ids[:, args.prompt + i: args.prompt + i + 1]
        k = i % len(impls)
        for impl in impls[k:] + impls[:k]:
            steps[impl].append(timed(lambda: logits.__setitem__(impl, forward(impl, tok))))
        for o in impls[1:]:
            max_diff[o] = max(max_diff[o], float((logits[base].float() - logits[o].float()).abs().max()))
    ref = "paged" if "paged" in impls else impls[-1]
    result = {"prompt": args.prompt, "batch": args.batch, "thin_prefill": args.thin_prefill, "layers": args.layers,
              "threads": args.threads, "steps": args.steps, "model_dtype": args.model_dtype, "impls": impls,
              "prefill_repeats": args.prefill_repeats,
              "storage": (caches["paged"].pool.config.storage if "paged" in impls else None),
              **{f"{impl}_prefill_s": statistics.median(t[0] for t in prefill[impl]) for impl in impls},
              **{f"{impl}_prefill_cpu_s": statistics.median(t[1] for t in prefill[impl]) for impl in impls},
              **{f"{impl}_decode_s": statistics.median(s[0] for s in steps[impl]) for impl in impls},
              **{f"{impl}_decode_cpu_s": statistics.median(s[1] for s in steps[impl]) for impl in impls},
              f"max_logit_difference_vs_{base}": max_diff}
    for o in impls:
        if o != ref:
            result[f"{o}_over_{ref}_decode"] = statistics.median(a[0] / b[0] for a, b in zip(steps[o], steps[ref]))
            result[f"{o}_over_{ref}_prefill"] = statistics.median(
                a[0] / b[0] for a, b in zip(prefill[o], prefill[ref]))
    if "paged" in impls:
        result["kernel_calls"] = caches["paged"].stats["kernel_calls"]
    if args.json:
        print(json.dumps(result))
    else:
        print(f"prompt {args.prompt} x batch {args.batch}, {args.layers} layers, {args.model_dtype} model, "
              f"{args.threads} threads: " + "; ".join(
                  f"{impl}: prefill {result[impl + '_prefill_s']:.2f} s, decode {1e3 * result[impl + '_decode_s']:.1f}"
                  f" ms" for impl in impls) + "; paired ratios (> 1: " + ref + " faster): " + ", ".join(
                  f"{k} {v:.2f}" for k, v in result.items() if k.endswith(("_decode", "_prefill")) and "_over_" in k)
              + f"; max |logit difference| vs {base} {max_diff}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
