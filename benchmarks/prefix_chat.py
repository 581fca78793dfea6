"""A chat-like run for `test_prefix.py::test_chat_time_to_first_token` (its own process: run with
``OPENBLAS_NUM_THREADS=1``):

    python -m benchmarks.prefix_chat [--system 2048] [--user 32] [--requests 8]

``requests`` prompts = one shared system prompt + a user turn each, through the demo's numpy transformer
(`decode.app.tiny_model.TinyTransformer`: 4 layers, d_model 256, 8 q / 2 kv heads, head_dim 32, float32 K/V, page 16) on
one shared cache, twice: with prefix reuse (`Decoder.from_prefix`, token ids on the prefill) and without
(every prompt computed whole). Time to first token = match + prefill of the uncached tokens -> the first
token's logits and argmax. Prints one JSON line: medians, the ratio (requests 2.. with reuse: the first has
nothing cached), tokens computed, and the K/V bytes the pool holds beside the raw formula
2 * layers * requests * tokens * kv_heads * head_dim * 4 bytes.
"""
import argparse
import json
import time

import numpy as np

from decode.decoder import Decoder
from decode.app.demo import DemoConfig
from decode.app.tiny_model import TinyTransformer
from kvcache import KVCache


def first_token(model, cfg, cache, prompt, reuse):
    """(seconds to the first token, tokens computed)."""
    t0 = time.perf_counter()
    if reuse:
        dec, hit = Decoder.from_prefix(cache, cfg.num_q_heads, prompt)
    else:
        dec, hit = Decoder.on_cache(cache, cfg.num_q_heads), 0
    rest = prompt[hit:]
    with dec.transaction(len(rest), token_ids=rest if reuse else None) as tx:
        logits = model.forward(rest, hit, lambda layer, q, k, v: tx.extend(layer, q, k, v))
    int(np.argmax(logits[-1]))
    return time.perf_counter() - t0, len(rest)


def run(system: int, user: int, requests: int) -> dict:
    cfg = DemoConfig(progress=False)
    model = TinyTransformer(cfg)
    rng = np.random.default_rng(0)
    system_ids = rng.integers(0, cfg.vocab, system)
    prompts = [np.concatenate([system_ids, rng.integers(0, cfg.vocab, user)]) for _ in range(requests)]
    capacity = requests * (system + user) + 64 * cfg.page_size

    def new_cache(reuse):
        return KVCache(num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, num_layers=cfg.layers,
                       page_size=cfg.page_size, max_tokens=capacity, prefix_caching=reuse)

    warm = new_cache(True)                                   # compile every kernel shape outside the timings
    for prompt in prompts[:2]:
        first_token(model, cfg, warm, prompt, True)
    runs = {}
    for reuse in (False, True):
        cache = new_cache(reuse)
        timed = [first_token(model, cfg, cache, prompt, reuse) for prompt in prompts]
        used = cache.config.num_pages - cache.num_free_pages
        runs[reuse] = dict(ttft=[t for t, _ in timed], computed=[n for _, n in timed],
                           held=used * cache.config.bytes_per_page)
    cold = float(np.median(runs[False]["ttft"]))
    hot = float(np.median(runs[True]["ttft"][1:]))
    formula = 2 * cfg.layers * requests * (system + user) * cfg.num_kv_heads * cfg.head_dim * 4
    return dict(system_tokens=system, user_tokens=user, requests=requests, ttft_no_reuse_ms=cold * 1e3,
                ttft_reuse_ms=hot * 1e3, ttft_first_request_ms=runs[True]["ttft"][0] * 1e3, ratio=cold / hot,
                target=10.0, tokens_computed_reuse=runs[True]["computed"],
                tokens_computed_no_reuse=runs[False]["computed"], kv_formula_bytes_no_reuse=formula,
                kv_bytes_held_no_reuse=runs[False]["held"], kv_bytes_held_reuse=runs[True]["held"],
                memory_saved_bytes=runs[False]["held"] - runs[True]["held"],
                memory_saved_fraction=1 - runs[True]["held"] / runs[False]["held"])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--system", type=int, default=2048)
    parser.add_argument("--user", type=int, default=32)
    parser.add_argument("--requests", type=int, default=8)
    args = parser.parse_args()
    print(json.dumps(run(args.system, args.user, args.requests)))


if __name__ == "__main__":
    main()
