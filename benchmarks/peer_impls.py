"""The implementations `benchmarks.vllm_peer` times, one class each: the engine (`Decoder` / `batch_step` over
`KVCache` pages), vLLM's CPU attention ops, torch SDPA. Each is built untimed over every copy of a case's data
(`vllm_peer.Data`), then ``setup(copy)`` (untimed) and ``call(copy)`` (timed) -> output ``[B * T, hq, d]``.

    impl = IMPLS[name](data, page_size, threads=2, beside=True)

``threads``: the implementation's thread count (numba's or torch's); ``beside`` (engine only): measure the page walk
or the loop of steps beside the timed calls (`alongside`). Like `vllm_peer`, this module imports only numpy at the
top: torch / vllm inside the torch implementations, `decode` / `kvcache` inside the engine's (``--impl vllm`` runs
under the vLLM venv's python, which has no numba).
"""
from __future__ import annotations

import os
import time

import numpy as np


class Engine:
    name = "engine"

    def __init__(self, data, page_size: int, threads: int = 2, beside: bool = True):
        import numba

        from decode import Decoder, batch_step
        from kvcache import KVCache

        numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
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
        self.beside = None if not beside else ("loop" if c.batch > 1 else ("walk" if c.tokens == 1 else None))
        # the walk (the kernel's threads) alternates with the timed calls; the loop of steps (one thread at <= 256
        # tokens: the other core idles) runs after them (`vllm_peer.time_mode`)
        self.beside_alternates = self.beside == "walk"
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

    def __init__(self, data, page_size: int, threads: int = 2, beside: bool = True):
        import torch
        import vllm
        from vllm import _custom_ops as ops

        torch.set_num_threads(threads)
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

    def __init__(self, data, page_size: int, threads: int = 2, beside: bool = True):
        import torch
        import torch.nn.functional as F

        torch.set_num_threads(threads)
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
