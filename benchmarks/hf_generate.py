"""One `model.generate()` of a random-weight Llama in this process: PagedCache + "pagedkv" (``--impl paged``),
DynamicCache + "sdpa" (``--impl dynamic``) or StaticCache + "sdpa" (``--impl static``, sized for prompt + new);
prints one JSON line.

    python -m benchmarks.hf_generate --impl paged --prompt 512 --batch 1 --new 32 [--layers 16 ...] [--forks 8]
        [--model-dtype float32|bfloat16] [--storage auto|float32|float16|bfloat16]

``--model-dtype bfloat16`` casts the model's weights (transformers then keeps bf16 K/V in Dynamic/StaticCache);
``--storage auto`` leaves PagedCache's page dtype at its default for the model.

Measured inside the process (the model is built, and every kernel warmed, before any timing):
* prefill_s: from the streamer's prompt callback (just before the first forward) to the first new token;
* decode_s: median time between consecutive new tokens (one decode forward + sampling each);
* peak_rss_growth_bytes: VmHWM during generate() minus the RSS just before it (VmHWM is reset first where the
  kernel allows it, /proc/self/clear_refs), beside the raw K/V bytes formula
  2 * layers * batch * tokens * kv_heads * head_dim * bytes_per_element;
* with --forks F: a prompt cache prefilled once then copied for F requests (PagedCache.fork vs
  copy.deepcopy(DynamicCache)): the time and the RSS the copies took, and the pool pages they took.
"""
import argparse
import copy
import json
import os
import sys
import time

import numpy as np

from benchmarks.generate import peak_rss_bytes, rss_bytes


def reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0: write 5 to /proc/self/clear_refs)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


WARM_COLUMNS = 1280      # > TILED_SPLIT keys and >= PARALLEL_QUERIES queries: the prefill kernels' every route


def warm_up_prompt(ids):
    """The warm-up prompt: up to `WARM_COLUMNS` columns of up to two rows, so the measured call loads no kernel
    (a 16-token warm-up left the tiled and split prefill kernels to be loaded from numba's cache, LLVM and all,
    inside the measured generate: its time and its peak RSS)."""
    return ids[:2, :WARM_COLUMNS].contiguous()


def build_model(args):
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
                         num_hidden_layers=args.layers, num_attention_heads=args.heads,
                         num_key_value_heads=args.kv_heads, head_dim=args.head_dim,
                         max_position_embeddings=max(8192, args.prompt + args.new + 64), eos_token_id=None,
                         bos_token_id=None, pad_token_id=0)
    torch.manual_seed(0)
    impl = "pagedkv" if args.impl == "paged" else "sdpa"
    model = AutoModelForCausalLM.from_config(config, attn_implementation=impl).eval()
    return model.to(getattr(torch, args.model_dtype))


def new_cache(args, model, batch, tokens):
    if args.impl == "paged":
        from decode.hf import PagedCache

        kwargs = {} if args.storage == "auto" else {"dtype": args.storage}
        return PagedCache.for_generate(model.config, batch, tokens, page_size=args.page_size, **kwargs)
    if args.impl == "static":
        from transformers import StaticCache

        return StaticCache(config=model.config, max_cache_len=tokens)
    from transformers import DynamicCache

    return DynamicCache(config=model.config)


class Stamps:
    """A generate() streamer that only records when each put happens (the prompt, then each new token)."""

    def __init__(self):
        self.times = []

    def put(self, value):
        self.times.append(time.perf_counter())

    def end(self):
        pass


def run_generate(args, model, ids):
    import torch

    cache = new_cache(args, model, ids.shape[0], ids.shape[1] + args.new)
    stamps = Stamps()
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=cache,
                             max_new_tokens=args.new, do_sample=False, streamer=stamps)
    return out, cache, np.diff(stamps.times)


def storage_name(args, cache) -> str:
    """The K/V element type the cache holds: PagedCache's pool dtype, else the model's."""
    if args.impl == "paged":
        return cache.pool.config.storage
    return args.model_dtype


def kv_itemsize(args, cache) -> int:
    name = storage_name(args, cache)
    return 2 if name in ("bfloat16", "float16") else np.dtype(name).itemsize


def measure_forks(args, model, ids) -> dict:
    """Prefill one prompt, then copy its cache for ``args.forks`` requests; time and RSS of the copies."""
    import torch

    cache = new_cache(args, model, args.forks + 1, ids.shape[1] + 8)
    with torch.no_grad():
        model(input_ids=ids[:1], past_key_values=cache, use_cache=True)
    rss0 = rss_bytes()
    free0 = cache.pool.num_free_pages if args.impl == "paged" else None
    t0 = time.perf_counter()
    copies = [cache.fork() if args.impl == "paged" else copy.deepcopy(cache) for _ in range(args.forks)]
    seconds = time.perf_counter() - t0
    result = {"forks": args.forks, "fork_s": seconds, "fork_rss_growth_bytes": rss_bytes() - rss0}
    if free0 is not None:
        result["fork_pages_taken"] = free0 - cache.pool.num_free_pages
    del copies
    return result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--impl", choices=["paged", "dynamic", "static"], required=True)
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--new", type=int, default=32)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--intermediate", type=int, default=5632)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--page-size", type=int, default=64)
    p.add_argument("--storage", default="float32", help="PagedCache page dtype, or auto (its default)")
    p.add_argument("--model-dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--forks", type=int, default=0)
    args = p.parse_args(argv)

    import numba
    import torch

    torch.set_num_threads(args.threads)
    numba.set_num_threads(min(args.threads, numba.config.NUMBA_NUM_THREADS))
    if args.impl == "paged":
        import decode.hf  # noqa: F401  (registers "pagedkv")
    t0 = time.perf_counter()
    model = build_model(args)
    build_s = time.perf_counter() - t0
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(1, args.vocab, (args.batch, args.prompt), generator=gen)
    t0 = time.perf_counter()
    run_generate(args, model, warm_up_prompt(ids))   # compile / load every kernel the measured call will run
    warm_s = time.perf_counter() - t0

    rss0 = rss_bytes()
    hwm_reset = reset_peak_rss()
    out, cache, gaps = run_generate(args, model, ids)
    peak = peak_rss_bytes()
    tokens = args.prompt + args.new - 1                       # the last token is returned, never cached
    raw_kv = 2 * args.layers * args.batch * tokens * args.kv_heads * args.head_dim * kv_itemsize(args, cache)
    result = {"impl": args.impl, "prompt": args.prompt, "batch": args.batch, "new": args.new,
              "layers": args.layers, "hidden": args.hidden, "heads": args.heads, "kv_heads": args.kv_heads,
              "head_dim": args.head_dim, "threads": args.threads, "storage": storage_name(args, cache),
              "model_dtype": args.model_dtype,
              "build_s": build_s, "warm_s": warm_s, "prefill_s": float(gaps[0]),
              "decode_s": float(np.median(gaps[1:])) if len(gaps) > 1 else None,
              "decode_s_all": [float(g) for g in gaps[1:]],
              "rss_before_bytes": rss0, "peak_rss_bytes": peak, "peak_reset": hwm_reset,
              "peak_rss_growth_bytes": peak - rss0, "raw_kv_bytes": int(raw_kv),
              "new_tokens": out[:, args.prompt:].tolist(),
              "loadavg": os.getloadavg()}
    if args.impl == "paged":
        result["kernel_calls"] = cache.stats["kernel_calls"]
        assert cache.stats["kernel_calls"] == cache.stats["forwards"] * args.layers
    del out, cache
    if args.forks:
        result.update(measure_forks(args, model, ids))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
