"""Generate T tokens one by one in a fresh process and print one JSON object (used by test_generation.py).

    python -m benchmarks.generate --impl naive|engine --tokens 4096 --heads 32 --head-dim 128 [--window 512]

naive:  K, V [t, heads, head_dim] grown by np.concatenate at every token (the whole history copied), attention
        in NumPy (einsum).
engine: one `Decoder`, `Decoder.step` per token (pages of 64 tokens, pool preallocated for T tokens).

Reported: total time of the T steps, the time and (naive) the bytes copied per window of ``--window`` tokens,
peak RSS (VmHWM) and the RSS before the first token, so peak - baseline is what the cache itself took.
The inputs are drawn from a bank of 64 random tokens (generating T fresh tokens would itself take memory).
"""
import argparse
import json
import os
import resource
import sys
import time

import numpy as np


def rss_bytes() -> int:
    try:
        import psutil

        return psutil.Process().memory_info().rss
    except ImportError:                                       # pragma: no cover
        with open(f"/proc/{os.getpid()}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss_bytes() -> int:
    """Peak RSS of this process: VmHWM (Linux; ru_maxrss would include the parent's RSS at fork time, which
    exec carries over), else ru_maxrss."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:                                           # pragma: no cover
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--impl", choices=["naive", "engine"], required=True)
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", default="float32", choices=["float32", "float16"])
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--page-size", type=int, default=64)
    args = p.parse_args(argv)

    T, H, D = args.tokens, args.heads, args.head_dim
    rng = np.random.default_rng(0)
    bank = 64
    q_bank = rng.standard_normal((bank, H, D), dtype=np.float32)
    k_bank = rng.standard_normal((bank, H, D), dtype=np.float32).astype(args.dtype)
    v_bank = rng.standard_normal((bank, H, D), dtype=np.float32).astype(args.dtype)
    scale = 1.0 / np.sqrt(D)
    token_bytes = H * 2 * D * np.dtype(args.dtype).itemsize
    result = {"impl": args.impl, "tokens": T, "heads": H, "head_dim": D, "dtype": args.dtype,
              "window": args.window, "token_bytes": token_bytes, "final_cache_bytes": T * token_bytes}

    if args.impl == "engine":
        from decode import Decoder

        t0 = time.perf_counter()
        warm = Decoder(num_q_heads=H, num_kv_heads=H, head_dim=D, dtype=args.dtype, page_size=args.page_size,
                       max_tokens=2)
        warm.step(q_bank[0], k_bank[0].astype(np.float32), v_bank[0].astype(np.float32))   # load the kernel
        result["kernel_load_s"] = time.perf_counter() - t0
        del warm
        dec = Decoder(num_q_heads=H, num_kv_heads=H, head_dim=D, dtype=args.dtype, page_size=args.page_size,
                      max_tokens=T)
        k_in, v_in = k_bank.astype(np.float32), v_bank.astype(np.float32)

        def step(t):
            i = t % bank
            return dec.step(q_bank[i], k_in[i], v_in[i])
        copied = None
    else:
        sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        from benchmarks.common import naive_attention

        state = {"K": np.empty((0, H, D), dtype=args.dtype), "V": np.empty((0, H, D), dtype=args.dtype)}

        def step(t):
            i = t % bank
            state["K"] = np.concatenate([state["K"], k_bank[i][None]])
            state["V"] = np.concatenate([state["V"], v_bank[i][None]])
            return naive_attention(q_bank[i], state["K"], state["V"], scale)
        copied = 0

    base_rss = rss_bytes()
    result["rss_before_bytes"] = base_rss
    result["peak_rss_before_bytes"] = peak_rss_bytes()
    windows = []
    t_start = time.perf_counter()
    t_win = t_start
    win_copied = 0
    for t in range(T):
        step(t)
        if copied is not None:
            win_copied += (t + 1) * token_bytes          # concatenate writes the whole new K and V
        if (t + 1) % args.window == 0 or t + 1 == T:
            now = time.perf_counter()
            windows.append({"end_token": t + 1, "seconds": now - t_win,
                            "bytes_copied": win_copied if copied is not None else 0,
                            "rss_bytes": rss_bytes()})
            if copied is not None:
                copied += win_copied
            win_copied = 0
            t_win = now
    total = time.perf_counter() - t_start
    result.update({"total_s": total, "per_token_s": total / T, "windows": windows,
                   "bytes_copied": copied or 0, "peak_rss_bytes": peak_rss_bytes(),
                   "rss_after_bytes": rss_bytes()})
    result["peak_rss_growth_bytes"] = result["peak_rss_bytes"] - base_rss
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
