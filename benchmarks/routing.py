"""Routing of runs between the per-query and the tiled kernel (issue 20, "routing"): one sequence extends by T
new tokens over ``context`` cached ones; the kernel call alone (the plan made once, as a forward makes it once
for every layer), forced through each kernel and as routed by `decode.attention_plan.route_rule`.

The machine is shared, so the kernels are timed **interleaved in one process**: every round times per-query,
tiled and routed back to back (the order alternating between rounds), each over enough calls for ~2 ms; a
shape's figure is the median over rounds of the per-round ratio (tiled / per-query time: > 1 means the tiled
kernel is slower). On one numba thread the kernel runs on the calling thread, whose CPU time
(`time.thread_time`) other processes do not inflate: those ratios are the robust ones (``cpu_*``); the 2-thread
figures are wall clock and carry the other jobs' load (a parallel region may wait a scheduler tick for its
worker). The table of docs/kernel.md ("Routing") and the comment of `attention_plan.ROUTE_MIN_RUN` come from

    python -m benchmarks.routing --out routing.jsonl                    (the default grid; ~10-30 min under load)
    python -m benchmarks.routing --contexts 4096 --head-dims 64 --storages float32 --out r64.jsonl

Each shape prints one line and appends one JSON record to ``--out`` as it is measured.
"""
import argparse
import json
import math
import os
import sys
import time

import numba
import numpy as np

from decode.attention_plan import BFLOAT16, AttentionPlan, kernel_view

ROUTES = ("per_query", "tiled", "routed")


class Scene:
    """One sequence of ``context + T`` tokens in pages of ``page_size`` (random physical order) and T queries at
    positions context..context+T-1; storage "float32", "float16", "bfloat16" (uint16 bits) or "int8" (with
    float16 group scales); q_dtype "bfloat16": q rounded to bfloat16."""

    def __init__(self, context, T, num_q_heads, num_kv_heads, head_dim, storage, page_size, seed=0,
                 q_dtype="float32"):
        rng = np.random.default_rng(seed)
        L = context + T
        npages = -(-L // page_size)
        shape = (npages, num_kv_heads, page_size, head_dim)
        k = rng.standard_normal(shape, dtype=np.float32)
        v = rng.standard_normal(shape, dtype=np.float32)
        self.k_scales = self.v_scales = None
        if storage == BFLOAT16:
            from kvcache import bf16
            self.k_pages, self.v_pages = bf16.to_bits(k), bf16.to_bits(v)
        elif storage == "int8":                 # int8 pages with their float16 group scales (`kvcache.quant`)
            from kvcache import quant
            (self.k_pages, self.k_scales), (self.v_pages, self.v_scales) = quant.quantize(k), quant.quantize(v)
        else:
            self.k_pages, self.v_pages = k.astype(storage), v.astype(storage)
        self.storage = BFLOAT16 if storage == BFLOAT16 else np.dtype(storage)
        self.indices = rng.permutation(npages).astype(np.int32)
        self.indptr = np.array([0, npages], dtype=np.int64)
        self.q = rng.standard_normal((T, num_q_heads, head_dim), dtype=np.float32)
        if q_dtype == BFLOAT16:          # a bfloat16 model's q (the tiled kernel's pair scores over bfloat16 pages)
            from kvcache import bf16
            self.q = bf16.to_float32(bf16.to_bits(self.q))
        self.query_seq = np.zeros(T, dtype=np.int32)
        self.query_pos = np.arange(context, L, dtype=np.int64)
        self.scale = 1.0 / math.sqrt(head_dim)
        self.out = np.empty((T, num_q_heads, head_dim), dtype=np.float32)

    def plan(self, route: str) -> AttentionPlan:
        """The plan of the T queries: forced through the per-query kernel (tiled=False), through the tiled one
        (min_run=1: every run tiled) or routed (the rule)."""
        kw = {"per_query": {"tiled": False}, "tiled": {"min_run": 1}, "routed": {}}[route]
        return AttentionPlan(self.query_seq, self.query_pos, 0, self.q.shape, self.v_pages.shape, self.storage,
                             **kw)

    def call(self, route: str):
        """A zero-argument callable running the plan once (the pages in their kernel view)."""
        plan = self.plan(route)
        k, v = kernel_view(self.k_pages, self.storage), kernel_view(self.v_pages, self.storage)
        args = (self.q, k, v, self.indices, self.indptr, self.scale, 0, self.out, kernel_view(self.k_scales),
                kernel_view(self.v_scales))
        return lambda: plan.run(*args)

    def tiled_routed(self) -> bool:
        return self.plan("routed").tiles is not None


def interleaved(calls: dict, rounds: int, target_s: float = 2e-3) -> dict:
    """Seconds per call of each callable, timed in turn ``rounds`` times (the order reversed every other round),
    each time over ``reps`` calls (~target_s). Returns {name: [per-round wall seconds per call]} and, under
    ``"cpu:" + name``, the calling thread's CPU seconds per call (`time.thread_time`: with one numba thread the
    whole kernel runs there, and other processes' load does not enter)."""
    reps = {}
    for name, fn in calls.items():
        fn()
        t0 = time.perf_counter()
        fn()
        reps[name] = max(1, int(target_s / max(time.perf_counter() - t0, 1e-7)))
    n = min(reps.values())
    times = {key: [] for name in calls for key in (name, "cpu:" + name)}
    names = list(calls)
    for r in range(rounds):
        for name in (names if r % 2 == 0 else names[::-1]):
            fn = calls[name]
            c0, t0 = time.thread_time(), time.perf_counter()
            for _ in range(n):
                fn()
            times[name].append((time.perf_counter() - t0) / n)
            times["cpu:" + name].append((time.thread_time() - c0) / n)
    return times


def ratios(times: dict, prefix: str = "") -> dict:
    """Medians (seconds) and median per-round ratios of one clock (prefix "" wall, "cpu:" CPU time)."""
    pq, ti, ro = (np.array(times[prefix + r]) for r in ROUTES)
    return {"per_query_s": float(np.median(pq)), "tiled_s": float(np.median(ti)), "routed_s": float(np.median(ro)),
            "tiled_over_per_query": float(np.median(ti / pq)),
            "routed_over_best": float(np.median(ro / np.minimum(pq, ti)))}


def measure(context, T, hq, hkv, d, storage, page, threads, rounds, q_dtype="float32") -> dict:
    """One shape: the wall-clock figures, and (``cpu_*``) the CPU-time ones (meaningful at threads=1 only)."""
    numba.set_num_threads(threads)
    scene = Scene(context, T, hq, hkv, d, storage, page, q_dtype=q_dtype)
    times = interleaved({route: scene.call(route) for route in ROUTES}, rounds)
    rec = {"context": context, "T": T, "num_q_heads": hq, "num_kv_heads": hkv, "group": hq // hkv,
           "head_dim": d, "storage": storage, "page_size": page, "threads": threads, "rounds": rounds,
           "q_dtype": q_dtype}
    rec.update(ratios(times))
    rec.update({"cpu_" + k: v for k, v in ratios(times, "cpu:").items()})
    rec.update({"routed_tiled": scene.tiled_routed(), "loadavg": os.getloadavg()[0]})
    return rec


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ints = lambda s: [int(x) for x in s.split(",")]                          # noqa: E731
    ap.add_argument("--contexts", type=ints, default=[512, 4096])
    ap.add_argument("--tokens", type=ints, default=[1, 2, 3, 4, 5, 6, 8, 12, 16])
    ap.add_argument("--groups", type=ints, default=[1, 2, 4, 8, 16, 32])
    ap.add_argument("--num-q-heads", type=int, default=32)
    ap.add_argument("--head-dims", type=ints, default=[128])
    ap.add_argument("--storages", type=lambda s: s.split(","), default=["float32", "float16", "bfloat16"])
    ap.add_argument("--pages", type=ints, default=[16])
    ap.add_argument("--threads", type=ints, default=[1, 2])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--q-dtype", choices=("float32", BFLOAT16), default="float32",
                    help="bfloat16: q rounded to bfloat16 (a bfloat16 model's q)")
    ap.add_argument("--out", default=None, help="append one JSON record per shape to this file")
    a = ap.parse_args(argv)
    for d in a.head_dims:
        for storage in a.storages:
            for page in a.pages:
                for context in a.contexts:
                    for g in a.groups:
                        for T in a.tokens:
                            for threads in a.threads:
                                rec = measure(context, T, a.num_q_heads, a.num_q_heads // g, d, storage, page,
                                              threads, a.rounds, a.q_dtype)
                                c = "cpu_" if threads == 1 else ""
                                print(f"d{d} {storage} p{page} ctx{context} G{g} T{T} th{threads}: "
                                      f"tiled/pq {rec[c + 'tiled_over_per_query']:.2f} routed/best "
                                      f"{rec[c + 'routed_over_best']:.2f} ({'tiled' if rec['routed_tiled'] else 'pq'}) "
                                      f"pq {rec[c + 'per_query_s'] * 1e6:.0f} us ({c or 'wall'}) "
                                      f"load {rec['loadavg']:.1f}", flush=True)
                                if a.out:
                                    with open(a.out, "a") as f:
                                        f.write(json.dumps(rec) + "\n")


if __name__ == "__main__":
    sys.exit(main())
