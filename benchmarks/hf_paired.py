"""Paired timing of the forwards generate() makes: one model, a DynamicCache ("sdpa") and a PagedCache
("pagedkv") side by side in one process; the prefill of each and then every decode step alternate between the
two (the order flips each step), so a noisy shared machine slows both alike and the per-step ratio survives.

    python -m benchmarks.hf_paired [--prompt 4096] [--batch 1] [--steps 32] [--layers 4] [--threads 2] [--json]

Reported: prefill seconds of each, the median decode step of each, the median of the per-step ratios
(sdpa / paged: > 1 means paged is faster), and the CPU time (process_time) beside the wall time.
"""
import argparse
import json
import statistics
import sys
import time


def timed(fn):
    cpu, wall = time.process_time(), time.perf_counter()
    fn()
    return time.perf_counter() - wall, time.process_time() - cpu


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompt", type=int, default=4096)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--quick", action="store_true", help="a tiny model (CI)")
    p.add_argument("--thin-prefill", action="store_true",
                   help="fill both caches with a narrow model of the same attention layout (hidden 256): the "
                        "history's K/V for the decode timing at a fraction of the prefill cost; prefill times "
                        "are then the narrow model's")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)

    import numba
    import torch
    from transformers import AutoModelForCausalLM, DynamicCache, LlamaConfig

    import decode.hf  # noqa: F401
    from decode.hf import PagedCache

    torch.set_num_threads(args.threads)
    numba.set_num_threads(min(args.threads, numba.config.NUMBA_NUM_THREADS))
    dims = (dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                 vocab_size=256) if args.quick else
            dict(hidden_size=2048, intermediate_size=5632, num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                 vocab_size=32000))
    config = LlamaConfig(num_hidden_layers=args.layers, max_position_embeddings=args.prompt + args.steps + 64,
                         eos_token_id=None, bos_token_id=None, pad_token_id=0, **dims)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    ids = torch.randint(1, dims["vocab_size"], (args.batch, args.prompt + args.steps),
                        generator=torch.Generator().manual_seed(1))
    caches = {"sdpa": DynamicCache(config=model.config),
              "pagedkv": PagedCache(model.config, max_tokens=args.batch * (args.prompt + args.steps + 128),
                                    page_size=64)}

    thin = model
    if args.thin_prefill:
        thin_config = LlamaConfig(**{**config.to_dict(), "hidden_size": 256, "intermediate_size": 256})
        torch.manual_seed(0)
        thin = AutoModelForCausalLM.from_config(thin_config, attn_implementation="sdpa").eval()

    def forward(impl, tokens, which=None):
        which = model if which is None else which
        which.set_attn_implementation(impl)
        with torch.no_grad():
            return which(input_ids=tokens, past_key_values=caches[impl], use_cache=True, logits_to_keep=1).logits

    warm = {"sdpa": DynamicCache(config=model.config), "pagedkv": PagedCache(model.config, max_tokens=4096)}
    for impl in warm:                                         # compile / warm up outside the timings
        model.set_attn_implementation(impl)
        with torch.no_grad():
            model(input_ids=ids[:, :8], past_key_values=warm[impl], use_cache=True)
            model(input_ids=ids[:, 8:9], past_key_values=warm[impl], use_cache=True)
    prefill, steps, logits = {}, {"sdpa": [], "pagedkv": []}, {}
    for impl in ("sdpa", "pagedkv"):
        prefill[impl] = timed(lambda: logits.__setitem__(impl, forward(impl, ids[:, :args.prompt], thin)))
    max_diff = float((logits["sdpa"] - logits["pagedkv"]).abs().max())
    for i in range(args.steps):
        tok = ids[:, args.prompt + i: args.prompt + i + 1]
        for impl in (("sdpa", "pagedkv") if i % 2 == 0 else ("pagedkv", "sdpa")):
            steps[impl].append(timed(lambda: logits.__setitem__(impl, forward(impl, tok))))
        max_diff = max(max_diff, float((logits["sdpa"] - logits["pagedkv"]).abs().max()))
    ratios = [a[0] / b[0] for a, b in zip(steps["sdpa"], steps["pagedkv"])]
    result = {"prompt": args.prompt, "batch": args.batch, "thin_prefill": args.thin_prefill, "layers": args.layers, "threads": args.threads,
              "steps": args.steps,
              **{f"{impl}_prefill_s": prefill[impl][0] for impl in prefill},
              **{f"{impl}_prefill_cpu_s": prefill[impl][1] for impl in prefill},
              **{f"{impl}_decode_s": statistics.median(s[0] for s in steps[impl]) for impl in steps},
              **{f"{impl}_decode_cpu_s": statistics.median(s[1] for s in steps[impl]) for impl in steps},
              "decode_ratio_median": statistics.median(ratios), "prefill_ratio": prefill["sdpa"][0] / prefill[
                  "pagedkv"][0], "max_logit_difference": max_diff,
              "kernel_calls": caches["pagedkv"].stats["kernel_calls"]}
    if args.json:
        print(json.dumps(result))
    else:
        print(f"prompt {args.prompt} x batch {args.batch}, {args.layers} layers, {args.threads} threads: prefill "
              f"sdpa {result['sdpa_prefill_s']:.2f} s / paged {result['pagedkv_prefill_s']:.2f} s "
              f"({result['prefill_ratio']:.2f}x); decode step sdpa {1e3 * result['sdpa_decode_s']:.1f} ms / paged "
              f"{1e3 * result['pagedkv_decode_s']:.1f} ms (median paired ratio {result['decode_ratio_median']:.2f}x);"
              f" max |logit difference| {max_diff:.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
