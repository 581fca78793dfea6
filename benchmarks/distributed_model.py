"""The break-even model of docs/distributed.md, from figures measured on this machine.

    python -m benchmarks.distributed_model [--quick] [--json out.json]

Measured here: the Ray round trip of a call to 2 workers in parallel carrying one step's q/k/v (ShardedDecoder.ping
with that payload), and the single-process `Decoder.step` time T1(L) at several context lengths L (and a batch of
8 via decode.batch_step), all threads of this machine. Modelled (NOT a multi-machine measurement): N machines
like this one, each holding 1/N of the K/V (head or context sharding), a step costs

    T_N(L) = T1(L / N) + RT     (every machine reads 1/N of the K/V; RT = the measured per-step overhead of a
                                 sharded step over the single-process step: one prepare round trip, the
                                 driver's checks and the commit message)

with T1 interpolated between the measured lengths (extended linearly beyond the longest), so sharding pays
when T1(L) > T1(L / N) + RT. T1 is measured with numba on one thread (the serial kernel): on a
machine shared with other sessions the parallel kernel's timings are dominated by waits for a free core; a
machine's own T1 with all its cores is smaller, which moves the break-even up by the same factor. The merge of context sharding
(a few us) and the driver's checks (tens of us) are inside the measured sharded step, not in this model.
"""
import argparse
import json
import os
import statistics
import time

import numpy as np

SHAPE = dict(num_q_heads=32, num_kv_heads=8, head_dim=128, dtype="float16", page_size=16)


def median_time(call, repeats: int, setup=None) -> float:
    times = []
    for _ in range(repeats):
        if setup:
            setup()
        t = time.perf_counter()
        call()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def single_step_times(lengths, batch: int, repeats: int) -> dict:
    import numba
    from decode import Decoder, batch_step
    numba.set_num_threads(1)
    from kvcache import KVCache
    rng = np.random.default_rng(0)
    h, hk, d = SHAPE["num_q_heads"], SHAPE["num_kv_heads"], SHAPE["head_dim"]
    out = {}
    for length in lengths:
        cache = KVCache(num_kv_heads=hk, head_dim=d, dtype=SHAPE["dtype"], page_size=SHAPE["page_size"],
                        max_tokens=batch * (length + 32))
        decs = [Decoder.on_cache(cache, h) for _ in range(batch)]
        for dec in decs:
            for start in range(0, length, 8192):
                n = min(8192, length - start)
                dec.append(rng.standard_normal((n, hk, d), dtype=np.float32),
                           rng.standard_normal((n, hk, d), dtype=np.float32))
        q = rng.standard_normal((batch, h, d), dtype=np.float32)
        k = rng.standard_normal((batch, hk, d), dtype=np.float32)
        v = rng.standard_normal((batch, hk, d), dtype=np.float32)

        def reset():
            for dec in decs:
                dec.truncate(length)
        if batch == 1:
            call = lambda: decs[0].step(q[0], k[0], v[0])             # noqa: E731
        else:
            call = lambda: batch_step(decs, q, k, v)                  # noqa: E731
        call()
        out[length] = median_time(call, repeats, reset)
        del cache, decs
    return out


def round_trip(payload_bytes: int, repeats: int) -> tuple[float, float]:
    """``(ping, step overhead)``: the median ping of 2 workers with the payload, and the median sharded step
    (heads, 2 workers, 16 tokens cached) minus the median single-process step of the same."""
    from decode import Decoder
    from decode.distributed import ShardedDecoder, start_local_ray, stop_local_ray
    rng = np.random.default_rng(1)
    h, hk, d = SHAPE["num_q_heads"], SHAPE["num_kv_heads"], SHAPE["head_dim"]
    q, k, v = (rng.standard_normal(s, dtype=np.float32) for s in ((h, d), (hk, d), (hk, d)))
    start_local_ray()
    try:
        with ShardedDecoder(workers=2, shard="heads", max_tokens=64, **SHAPE) as dec:
            payload = np.zeros(payload_bytes // 4, dtype=np.float32)
            for _ in range(10):
                dec.ping(payload)
            ping = median_time(lambda: dec.ping(payload), repeats)
            single = Decoder(**SHAPE, max_tokens=64)
            times = {}
            for name, target in (("sharded", dec), ("single", single)):
                target.append(*(rng.standard_normal((16, hk, d), dtype=np.float32) for _ in range(2)))
                times[name] = median_time(lambda: target.step(q, k, v), repeats, lambda: target.truncate(16))
            return ping, times["sharded"] - times["single"]
    finally:
        stop_local_ray()


def t1(times: dict, length: float) -> float:
    """T1 at ``length``: linear between the measured points (made non-decreasing), proportional to L below the
    shortest, extended with the last segment's slope beyond the longest (the step reads the K/V: linear in L)."""
    xs = sorted(times)
    ys = np.maximum.accumulate([times[x] for x in xs])
    if length <= xs[0]:
        return ys[0] * length / xs[0]
    if length >= xs[-1]:
        return ys[-1] + (ys[-1] - ys[-2]) / (xs[-1] - xs[-2]) * (length - xs[-1])
    return float(np.interp(length, xs, ys))


def table(times: dict, rt: float, machines=(2, 4, 8), lengths=(1024, 4096, 16384, 65536, 262144, 1048576)):
    """Rows ``(L, T1(L), [T1(L) / (T1(L / N) + RT) for N in machines])``."""
    return [(length, t1(times, length), [t1(times, length) / (t1(times, length / n) + rt) for n in machines])
            for length in lengths]


def break_even(times: dict, rt: float, n: int) -> float:
    """Smallest L (bisection over [1, 2**26]) with T1(L) > T1(L / n) + RT."""
    lo, hi = 1.0, float(1 << 26)
    if t1(times, hi) <= t1(times, hi / n) + rt:
        return float("inf")
    for _ in range(80):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if t1(times, mid) <= t1(times, mid / n) + rt else (lo, mid)
    return hi


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="short lengths, few repeats")
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args(argv)
    lengths = {1: [256, 1024] if args.quick else [1024, 4096, 16384, 65536],
               8: [256, 1024] if args.quick else [1024, 4096, 16384]}          # batch 8 x 65536 would be 2 GiB
    repeats = 5 if args.quick else 40
    h, hk, d = SHAPE["num_q_heads"], SHAPE["num_kv_heads"], SHAPE["head_dim"]
    payload = 4 * (h * d + 2 * hk * d)                               # one step's q, k, v in float32
    load = os.getloadavg()[0]
    ping, rt = round_trip(payload, 20 if args.quick else 300)
    single = {b: single_step_times(lengths[b], b, repeats) for b in (1, 8)}
    machines = (2, 4, 8)
    print(f"T1 on one thread; shape {SHAPE}; ping of 2 workers with {payload} B: {ping * 1e3:.3f} ms; "
          f"sharded step overhead (the model's RT): {rt * 1e3:.3f} ms; load average {load:.1f}")
    for b, times in single.items():
        print(f"\nbatch {b}: measured T1 " + ", ".join(f"L={L}: {t * 1e3:.3f} ms" for L, t in times.items()))
        print("| context L | T1(L) ms (model) | " + " | ".join(f"speed-up on {n} machines" for n in machines) + " |")
        print("| ---: | ---: | " + " | ".join("---:" for _ in machines) + " |")
        for length, base, ups in table(times, rt, machines):
            print(f"| {length:,} | {base * 1e3:.2f} | " + " | ".join(f"{u:.2f}x" for u in ups) + " |")
        print("break-even L: " + ", ".join(f"{n} machines {break_even(times, rt, n):,.0f}" for n in machines))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"shape": SHAPE, "payload_bytes": payload, "ping_s": ping, "step_overhead_s": rt,
                       "load_average": load,
                       "single_step_s": {str(b): {str(k): v for k, v in t.items()} for b, t in single.items()}},
                      f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
