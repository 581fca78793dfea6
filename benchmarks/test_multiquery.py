"""Prefill and extend (the tiled multi-query kernel) against torch SDPA, as GFLOP/s and a fraction of the
session's matmul rate (`ceilings.near`, re-measured before each shape's group).

Shapes (issue 9): GQA 32 q heads / 8 kv heads, head_dim 128, float32 and float16 storage, page 16 (the
Decoder's default), prefill 0 -> 512 and 0 -> 2048, extend 4096 + 16 / 128 / 512. Engine: `Decoder.extend`
(validation, the write into the pool, the kernel; the setup truncates back to the start, untimed). torch:
`scaled_dot_product_attention(..., enable_gqa=True)` on 2 threads over contiguous K/V [1, kv_heads, L, head_dim]
(`is_causal=True` for a prefill, a boolean mask [T, L] otherwise), float16 storage in float16 (the same bytes).
Both are checked against the float64 reference (first and last 8 queries) before timing.

The machine is shared (2 cores, other sessions' jobs): besides the pytest-benchmark timing, the engine's record
holds an *alternated* measurement, rounds of [engine, torch, numpy matmul 1024^3] run back to back, so that the
ratios engine/torch and engine/matmul compare timings taken under the same load (`alt_*` in extra_info).
"""
import time
import math

import numpy as np
import pytest

from . import common

ENGINE, TORCH = "engine_extend", "torch_sdpa"


def cases(quick):
    """(num_q_heads, num_kv_heads, head_dim, start, tokens, dtype)."""
    if quick:
        return [(8, 2, 32, start, T, dt) for start, T in ((0, 64), (100, 16)) for dt in ("float32", "float16")]
    return [(32, 8, 128, start, T, dt) for start, T in ((0, 512), (0, 2048), (4096, 16), (4096, 128), (4096, 512))
            for dt in ("float32", "float16")]


def pytest_generate_tests(metafunc):
    if "mq_case" in metafunc.fixturenames:
        quick = metafunc.config.getoption("--quick")
        params = [(c, impl) for c in cases(quick) for impl in (ENGINE, TORCH)]
        metafunc.parametrize("mq_case", params, ids=[f"{label(c)}-{impl}" for c, impl in params])
    if "int8_case" in metafunc.fixturenames:
        quick = metafunc.config.getoption("--quick")
        params = [(c, impl) for c in int8_cases(quick) for impl in INT8_IMPLS]
        metafunc.parametrize("int8_case", params, ids=[f"{int8_label(c)}-{impl}" for c, impl in params])


def label(c) -> str:
    hq, hkv, d, start, T, dt = c
    what = f"prefill0-{T}" if start == 0 else f"extend{start}+{T}"
    return f"GQA-q{hq}kv{hkv}d{d}-{what}-{'fp16' if dt == 'float16' else 'fp32'}"


class Problem:
    """Deterministic q/k/v of one case: K/V [start + T, kv_heads, head_dim] (the cache, new tokens last)."""

    _cache: dict = {}

    def __init__(self, c):
        self.hq, self.hkv, self.d, self.start, self.T, self.dtype = c
        rng = np.random.default_rng(5)
        L = self.start + self.T
        self.q = rng.standard_normal((self.T, self.hq, self.d), dtype=np.float32)
        self.K = rng.standard_normal((L, self.hkv, self.d), dtype=np.float32).astype(self.dtype)
        self.V = rng.standard_normal((L, self.hkv, self.d), dtype=np.float32).astype(self.dtype)
        self.scale = 1.0 / math.sqrt(self.d)

    @classmethod
    def get(cls, c):
        if c not in cls._cache:
            cls._cache.clear()
            cls._cache[c] = cls(c)
        return cls._cache[c]

    @property
    def keys(self) -> int:
        """Visible keys summed over the T queries."""
        return self.T * self.start + self.T * (self.T + 1) // 2

    @property
    def flops(self) -> int:
        return 4 * self.hq * self.d * self.keys

    @property
    def kv_bytes(self) -> int:
        return 2 * (self.start + self.T) * self.hkv * self.d * np.dtype(self.dtype).itemsize

    def reference_rows(self, rows):
        """float64 outputs of the queries ``rows`` [n] -> [n, hq, d]."""
        g = self.hq // self.hkv
        out = np.empty((len(rows), self.hq, self.d))
        K, V = self.K.astype(np.float64), self.V.astype(np.float64)
        for i, t in enumerate(rows):
            p = self.start + t
            for h in range(self.hq):
                s = (K[:p + 1, h // g] @ self.q[t, h].astype(np.float64)) * self.scale
                w = np.exp(s - s.max())
                out[i, h] = (w / w.sum()) @ V[:p + 1, h // g]
        return out


def engine(prob: Problem):
    from decode import Decoder

    dec = Decoder(num_q_heads=prob.hq, num_kv_heads=prob.hkv, head_dim=prob.d, dtype=prob.dtype, page_size=16,
                  max_tokens=prob.start + prob.T)
    if prob.start:
        dec.append(prob.K[:prob.start], prob.V[:prob.start])
    k_new, v_new = prob.K[prob.start:].astype(np.float32), prob.V[prob.start:].astype(np.float32)

    def setup():
        if dec.length != prob.start:
            dec.truncate(prob.start)
        return (prob.q, k_new, v_new), {}
    return dec.extend, setup, {"page_size": 16}


def torch_sdpa(prob: Problem):
    torch = pytest.importorskip("torch")
    import torch.nn.functional as F

    torch.set_num_threads(2)
    dt = torch.float16 if prob.dtype == "float16" else torch.float32
    Q = torch.from_numpy(prob.q.transpose(1, 0, 2).copy()).to(dt)[None]          # [1, hq, T, d]
    K = torch.from_numpy(prob.K.transpose(1, 0, 2).copy())[None]                  # [1, hkv, L, d]
    V = torch.from_numpy(prob.V.transpose(1, 0, 2).copy())[None]
    if prob.start == 0:
        def call():
            return F.scaled_dot_product_attention(Q, K, V, is_causal=True, enable_gqa=True)[0].transpose(0, 1)
    else:
        L = prob.start + prob.T
        mask = torch.from_numpy(np.arange(L)[None, :] <= (prob.start + np.arange(prob.T))[:, None])

        def call():
            return F.scaled_dot_product_attention(Q, K, V, attn_mask=mask, enable_gqa=True)[0].transpose(0, 1)
    return call, lambda: ((), {}), {"torch": torch.__version__, "torch_threads": torch.get_num_threads(),
                                    "mask": "is_causal" if prob.start == 0 else "boolean"}


def alternated(fns: dict, rounds: int) -> dict:
    """Median wall seconds of each callable, the callables run in turn ``rounds`` times."""
    times = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {name: float(np.median(t)) for name, t in times.items()}


def alternated_record(prob: Problem, engine_call, quick) -> dict:
    torch_call = torch_sdpa(prob)[0]
    a = np.random.default_rng(0).standard_normal((1024, 1024), dtype=np.float32)
    c = a @ a
    med = alternated({"engine": engine_call, "torch": torch_call, "matmul": lambda: np.matmul(a, a, out=c)},
                     1 if quick else 5)
    matmul_rate = 2 * 1024 ** 3 / med["matmul"]
    return {"alt_engine_s": med["engine"], "alt_torch_s": med["torch"], "alt_matmul_rate": matmul_rate,
            "alt_speedup_vs_torch": med["torch"] / med["engine"],
            "alt_frac_matmul": prob.flops / med["engine"] / matmul_rate}


@pytest.mark.kernel
def test_multiquery(benchmark, ceilings, quick, warm_engine, mq_case):
    c, impl = mq_case
    prob = Problem.get(c)
    fn, setup, extra = (engine if impl == ENGINE else torch_sdpa)(prob)
    ceil = ceilings.near(label(c))
    rows = sorted({*range(min(8, prob.T)), *range(max(0, prob.T - 8), prob.T)})
    args, kwargs = setup()
    out = fn(*args, **kwargs)
    out = out.float().numpy() if hasattr(out, "numpy") else out
    common.check_close(f"{impl} {label(c)}", out[rows], prob.reference_rows(rows), prob.dtype)
    per_call = common.time_calls(lambda: fn(*setup()[0]), [()])
    rounds = 1 if quick else common.choose_rounds(per_call, budget=1.5, minimum=3, maximum=200)
    benchmark.group = f"multiquery {label(c)}"
    common.pedantic(benchmark, fn, setup=setup, rounds=rounds, iterations=1, warmup_rounds=0)
    if impl == ENGINE:
        benchmark.extra_info.update(alternated_record(prob, lambda: fn(*setup()[0]), quick))
    common.record(benchmark, ceil, prob.kv_bytes, prob.flops, impl=impl, op="prefill" if prob.start == 0 else "extend",
                  start=prob.start, tokens=prob.T, keys_attended=prob.keys, num_q_heads=prob.hq,
                  num_kv_heads=prob.hkv, head_dim=prob.d, dtype=prob.dtype, shape=label(c), rounds=rounds, **extra)


@pytest.mark.kernel
@pytest.mark.parametrize("impl", ["batch_extend", "extend_loop"])
def test_batch_extend(benchmark, ceilings, quick, warm_engine, impl):
    """Batched prefill: 4 sequences of one pool with 64 / 128 / 256 / 512 new tokens (quick: 4 / 8 / 16 / 32)
    after 256 cached tokens each, GQA 32/8 d128 (quick 8/2 d32) float16: one `batch_extend` call vs a loop of
    `Decoder.extend` over the same decoders (the setup truncates back, untimed)."""
    from decode import Decoder, batch_extend
    from kvcache import KVCache

    hq, hkv, d = (8, 2, 32) if quick else (32, 8, 128)
    counts = [4, 8, 16, 32] if quick else [64, 128, 256, 512]
    start = 32 if quick else 256
    rng = np.random.default_rng(9)
    cache = KVCache(num_kv_heads=hkv, head_dim=d, dtype="float16", page_size=16,
                    max_tokens=sum(start + n for n in counts) + 16 * len(counts))
    decs = [Decoder.on_cache(cache, hq) for _ in counts]
    for dec in decs:
        kv = rng.standard_normal((start, hkv, d), dtype=np.float32)
        dec.append(kv, kv)
    qs = [rng.standard_normal((n, hq, d), dtype=np.float32) for n in counts]
    ks = [rng.standard_normal((n, hkv, d), dtype=np.float32) for n in counts]

    def setup():
        for dec in decs:
            if dec.length != start:
                dec.truncate(start)
        return (), {}

    def batched():
        return batch_extend(decs, qs, ks, ks)

    def loop():
        return [dec.extend(q, k, k) for dec, q, k in zip(decs, qs, ks)]

    fn = batched if impl == "batch_extend" else loop
    setup()
    first = fn()
    setup()
    other = (loop if fn is batched else batched)()
    for a, b in zip(first, other):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    per_call = common.time_calls(lambda: (setup(), fn()), [()])
    rounds = 1 if quick else common.choose_rounds(per_call, budget=1.5, minimum=5, maximum=200)
    benchmark.group = "multiquery batch_extend"
    common.pedantic(benchmark, fn, setup=setup, rounds=rounds, iterations=1, warmup_rounds=0)
    keys = sum(n * start + n * (n + 1) // 2 for n in counts)
    common.record(benchmark, ceilings, 2 * sum(start + n for n in counts) * hkv * d * 2, 4 * hq * d * keys,
                  impl=impl, op="batch_extend", counts=counts, start=start, num_q_heads=hq, num_kv_heads=hkv,
                  head_dim=d, dtype="float16", rounds=rounds)


# ---------------------------------------------------------------------------------------------------------------
# int8 storage (issue 11): the tiled kernel over int8 pages vs float16 and vs the int8 single-query kernel
# ---------------------------------------------------------------------------------------------------------------
INT8_IMPLS = ("int8_extend", "fp16_extend", "int8_kernel_tiled", "fp16_kernel_tiled", "int8_kernel_per_query")


def int8_cases(quick):
    """(num_q_heads, num_kv_heads, head_dim, start, tokens): GQA 32/8 d128, page 16."""
    if quick:
        return [(8, 2, 32, 0, 64), (8, 2, 32, 100, 16)]
    return [(32, 8, 128, 0, 512), (32, 8, 128, 0, 2048), (32, 8, 128, 4096, 128)]


def int8_label(c) -> str:
    hq, hkv, d, start, T = c
    return f"GQA-q{hq}kv{hkv}d{d}-{f'prefill0-{T}' if start == 0 else f'extend{start}+{T}'}"


def int8_engine(c, impl):
    """(call, setup, rows to check, reference K/V as float64): ``*_extend``: `Decoder.extend` of the T new tokens
    (validation, quantizing write, kernel; the setup truncates back to the start, untimed); ``*_kernel_*``:
    the kernel call alone on a pool holding all start + T tokens (queries at positions start..), tiled (runs
    to the tiled multi-query kernel) or (int8) every query through the int8 single-query kernel."""
    from decode import Decoder
    from decode.attention_plan import attend_unchecked

    hq, hkv, d, start, T = c
    rng = np.random.default_rng(5)
    L = start + T
    q = rng.standard_normal((T, hq, d), dtype=np.float32)
    K = rng.standard_normal((L, hkv, d), dtype=np.float32)
    V = rng.standard_normal((L, hkv, d), dtype=np.float32)
    dec = Decoder(num_q_heads=hq, num_kv_heads=hkv, head_dim=d, dtype="float16" if impl.startswith("fp16") else "int8",
                  page_size=16, max_tokens=L)
    if impl.endswith("_extend"):
        if start:
            dec.append(K[:start], V[:start])

        def setup():
            if dec.length != start:
                dec.truncate(start)
            return (q, K[start:], V[start:]), {}
        setup()
        dec.extend(q, K[start:], V[start:])
        Kd, Vd = (x.astype(np.float64) for x in dec.kv())
        return dec.extend, setup, Kd, Vd, q, start
    dec.append(K, V)
    cache = dec.cache
    indices = np.asarray(cache.pool.page_table(dec.seq), dtype=np.int32)
    indptr = np.array([0, len(indices)], dtype=np.int64)
    qseq = np.zeros(T, dtype=np.int32)
    qpos = np.arange(start, L, dtype=np.int64)
    out = np.empty((T, hq, d), dtype=np.float32)
    args = (q, cache.pool.k_pages(), cache.pool.v_pages(), indices, indptr, qseq, qpos, dec.scale, 0, out)
    kw = dict(k_scales=cache.pool.k_scales(), v_scales=cache.pool.v_scales(), tiled=impl.endswith("_tiled"))

    def call():
        return attend_unchecked(*args, **kw)
    Kd, Vd = (x.astype(np.float64) for x in dec.kv())
    return call, lambda: ((), {}), Kd, Vd, q, start


def int8_reference_rows(q, K, V, start, rows):
    hq, hkv = q.shape[1], K.shape[1]
    g = hq // hkv
    out = np.empty((len(rows), hq, V.shape[2]))
    for i, t in enumerate(rows):
        p = start + t
        for h in range(hq):
            s = (K[:p + 1, h // g] @ q[t, h].astype(np.float64)) / math.sqrt(q.shape[2])
            w = np.exp(s - s.max())
            out[i, h] = (w / w.sum()) @ V[:p + 1, h // g]
    return out


@pytest.mark.kernel
def test_int8_prefill(benchmark, ceilings, quick, warm_engine, int8_case):
    """int8 prefill / extend: `Decoder.extend` with int8 vs float16 storage, and the kernel alone over the int8
    pool, tiled vs every query through the single-query kernel. Each checked against the float64 reference on
    the K/V the pool holds (dequantized for int8) before timing."""
    c, impl = int8_case
    hq, hkv, d, start, T = c
    fn, setup, Kd, Vd, q, start = int8_engine(c, impl)
    ceil = ceilings.near("int8 " + int8_label(c))
    rows = sorted({*range(min(8, T)), *range(max(0, T - 8), T)})
    out = fn(*setup()[0])
    common.check_close(f"{impl} {int8_label(c)}", out[rows], int8_reference_rows(q, Kd, Vd, start, rows),
                       "float32")
    per_call = common.time_calls(lambda: fn(*setup()[0]), [()])
    rounds = 1 if quick else common.choose_rounds(per_call, budget=1.5, minimum=3, maximum=200)
    benchmark.group = f"multiquery int8 {int8_label(c)}"
    common.pedantic(benchmark, fn, setup=setup, rounds=rounds, iterations=1, warmup_rounds=0)
    if impl == "int8_kernel_tiled":        # the kernel ratios under the same load: calls alternated in rounds
        calls = {name: int8_engine(c, name)[0] for name in ("fp16_kernel_tiled", "int8_kernel_per_query")}
        med = alternated({"int8_tiled": fn, **calls}, 1 if quick else 5)
        benchmark.extra_info.update({"alt_int8_tiled_s": med["int8_tiled"],
                                     "alt_fp16_tiled_s": med["fp16_kernel_tiled"],
                                     "alt_int8_per_query_s": med["int8_kernel_per_query"],
                                     "alt_speedup_vs_fp16_tiled": med["fp16_kernel_tiled"] / med["int8_tiled"],
                                     "alt_speedup_vs_per_query": med["int8_kernel_per_query"] / med["int8_tiled"]})
    keys = T * start + T * (T + 1) // 2
    itemsize = 2 if impl.startswith("fp16") else 1
    common.record(benchmark, ceil, 2 * (start + T) * hkv * d * itemsize, 4 * hq * d * keys, impl=impl,
                  op="prefill" if start == 0 else "extend", start=start, tokens=T, keys_attended=keys,
                  num_q_heads=hq, num_kv_heads=hkv, head_dim=d, dtype="float16" if impl.startswith("fp16") else "int8",
                  shape=int8_label(c), rounds=rounds, page_size=16)
