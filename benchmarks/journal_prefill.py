"""A prefill's extra memory and time with the journal's zero-byte rule (`kvcache.journal`) against the journal
copying every overwritten byte (the rule before it, reproduced here by a patched `Journal.save_bytes`):

    python -m benchmarks.journal_prefill [--tokens 4096] [--dtype float32] [--rounds 7]

One `KVCache.append` of ``tokens`` tokens (8 layers, 8 kv heads, head_dim 64: the hf target's Llama shape) into
a fresh pool, three ways interleaved per round: "new" (fresh zero pages: nothing saved), "old" (the copying
journal) and "reused" (the new journal over pages that held K/V before and were freed: zeroed at the free,
`CacheCore.clear_freed`, so nothing is saved either; before that change the copies were made). Peak extra
memory is tracemalloc's peak during the append (numpy's buffers and the saved bytes; the input arrays and the
pool are allocated before); prints medians and the new / old time ratio.
"""
import argparse
import gc
import statistics
import time
import tracemalloc

import numpy as np

from kvcache import KVCache
from kvcache import journal

NEW = journal.Journal.save_bytes


def copying_save_bytes(self, view):
    saved = view.copy()
    self.record(lambda: view.__setitem__(Ellipsis, saved))


def one(kind: str, k, v, dtype: str) -> tuple[int, float]:
    layers, tokens, heads, dim = k.shape
    cache = KVCache(num_layers=layers, num_kv_heads=heads, head_dim=dim, page_size=16, max_tokens=tokens,
                    dtype=dtype)
    if kind == "reused":
        seq = cache.create_sequence()
        cache.append(seq, k, v)
        cache.free(seq)
    journal.Journal.save_bytes = copying_save_bytes if kind == "old" else NEW
    seq = cache.create_sequence()
    gc.collect()
    tracemalloc.start()
    try:
        start = time.perf_counter()
        cache.append(seq, k, v)
        elapsed = time.perf_counter() - start
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
        journal.Journal.save_bytes = NEW
    return peak, elapsed


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--rounds", type=int, default=7)
    args = p.parse_args(argv)
    rng = np.random.default_rng(0)
    k = rng.standard_normal((8, args.tokens, 8, 64)).astype(np.float32)
    v = rng.standard_normal((8, args.tokens, 8, 64)).astype(np.float32)
    kinds = ("new", "old", "reused")
    for kind in kinds:                                             # compile and warm up
        one(kind, k, v, args.dtype)
    results = {kind: [one(kind, k, v, args.dtype) for _ in range(1)] for kind in kinds}
    for _ in range(args.rounds - 1):
        for kind in kinds:
            results[kind].append(one(kind, k, v, args.dtype))
    cfg = KVCache(num_layers=8, num_kv_heads=8, head_dim=64, num_pages=1, dtype=args.dtype).config
    print(f"prefill of {args.tokens} tokens, 8 layers x 8 kv heads x head_dim 64, {args.dtype} pool, float32 "
          f"input: K/V {args.tokens * cfg.bytes_per_token / 2 ** 20:.1f} MiB; medians of {args.rounds} rounds")
    for kind, rows in results.items():
        print(f"  {kind:6s}  peak extra {statistics.median(p for p, _ in rows) / 2 ** 20:7.1f} MiB   "
              f"time {statistics.median(t for _, t in rows) * 1e3:7.1f} ms")
    ratio = statistics.median(t for _, t in results["new"]) / statistics.median(t for _, t in results["old"])
    print(f"  time new / old: {ratio:.3f}")


if __name__ == "__main__":
    main()
