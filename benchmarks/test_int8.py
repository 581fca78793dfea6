"""int8 against float16 and float32 storage: one cold `Decoder.step` per round, the three dtypes interleaved
within every round (so a noisy shared machine slows all three alike), page 64 and page 16.

Shapes (issue 11): 32 query heads, head_dim 128; MHA (32 kv heads) 4096 and 32768 tokens, GQA-8 4096 and
32768, MQA 32768. Each dtype has enough layers (one Decoder each, stepped in rotation) that they hold
>= 256 MiB of K/V (8x the 32 MiB last-level cache), so every step reads its K/V from DRAM. The pytest-benchmark
figure is the whole round (three steps); ``extra_info`` has each dtype's median step and the ratios
``float16 / int8`` and ``float32 / int8`` (speed-ups of int8). The first step of each layer is checked against
the float64 reference on the K/V that layer holds (int8: dequantized, `Decoder.kv`) within the float32 budget.

    pytest benchmarks/test_int8.py --benchmark-only             the issue-11 grid (a few minutes)
    pytest benchmarks/test_int8.py --benchmark-disable --quick  CI: small shapes, once
"""
import math
import time

import numpy as np
import pytest

from . import common

DTYPES = ("int8", "float16", "float32")
COLD_BYTES = 256 * common.MiB
TARGETS = {"MHA": 1.7, "GQA": 1.35, "MQA": 1 / 1.1}       # int8 speed-up over float16 (issue 11)


def shapes(quick: bool):
    if quick:
        return [(8, kv, 64, n) for kv, n in ((8, 300), (2, 300), (1, 130))]
    return [(32, 32, 128, 4096), (32, 32, 128, 32768), (32, 8, 128, 4096), (32, 8, 128, 32768), (32, 1, 128, 32768)]


def pytest_generate_tests(metafunc):
    if "int8_case" in metafunc.fixturenames:
        quick = metafunc.config.getoption("--quick")
        cases = [(s, p) for s in shapes(quick) for p in ((16,) if quick else (64, 16))]
        metafunc.parametrize("int8_case", cases, ids=[f"q{s[0]}kv{s[1]}d{s[2]}-n{s[3]}-P{p}" for s, p in cases])


def _kind(num_q_heads, num_kv_heads):
    return "MHA" if num_kv_heads == num_q_heads else ("MQA" if num_kv_heads == 1 else "GQA")


class Layers:
    """``layers`` Decoders of one dtype holding the same N - 1 tokens; ``step(i)`` appends token N - 1 to layer
    i % layers and attends over N keys; the truncate back to N - 1 is untimed."""

    def __init__(self, dtype, shape, page_size, block_k, block_v, quick):
        from decode import Decoder

        hq, hkv, d, n = shape
        self.n_keys = n
        per_layer = n * hkv * 2 * d * (1 if dtype == "int8" else np.dtype(dtype).itemsize)
        target = 4 * common.MiB if quick else COLD_BYTES
        self.count = max(1, math.ceil(target / per_layer))
        self.decs = []
        for _ in range(self.count):
            dec = Decoder(hq, hkv, d, dtype=dtype, page_size=page_size, max_tokens=n + page_size)
            done = 0
            while done < n - 1:
                take = min(len(block_k), n - 1 - done)
                dec.append(block_k[:take], block_v[:take])
                done += take
            self.decs.append(dec)
        self.next = 0

    def step(self, q, k, v):
        dec = self.decs[self.next]
        self.next = (self.next + 1) % self.count
        if dec.length == self.n_keys:
            dec.truncate(self.n_keys - 1)
        t0 = time.perf_counter()
        out = dec.step(q, k, v)
        return time.perf_counter() - t0, out, dec


def _check(out, dec, q):
    K, V = (x.astype(np.float64) for x in dec.kv())
    ref = common.reference_attention(q.astype(np.float64), K, V, 1 / math.sqrt(q.shape[1]))
    ref32 = common.reference_attention(q, K.astype(np.float32), V.astype(np.float32), 1 / math.sqrt(q.shape[1]))
    assert np.abs(out - ref).max() <= 1e-6 + 3 * np.abs(ref32 - ref).max() + 2e-5 * np.abs(ref).max()


@pytest.mark.kernel
def test_int8_step(benchmark, quick, int8_case):
    shape, page_size = int8_case
    hq, hkv, d, n = shape
    rng = np.random.default_rng(11)
    block = min(n, 4096)
    block_k = rng.standard_normal((block, hkv, d), dtype=np.float32)
    block_v = rng.standard_normal((block, hkv, d), dtype=np.float32)
    q = rng.standard_normal((hq, d), dtype=np.float32)
    k, v = block_k[0], block_v[0]
    stacks = {}
    for dtype in DTYPES:
        stacks[dtype] = layers = Layers(dtype, shape, page_size, block_k, block_v, quick)
        for _ in range(min(3, layers.count)):                 # warm-up (compiles or loads the kernels)
            _, out, dec = layers.step(q, k, v)
        if n <= 4096 or quick:
            _check(out, dec, q)
    times = {dtype: [] for dtype in DTYPES}

    def one_round():
        for dtype in DTYPES:
            times[dtype].append(stacks[dtype].step(q, k, v)[0])

    rounds = 1 if quick else (11 if n > 4096 else 25)
    benchmark.group = f"int8 {_kind(hq, hkv)} n{n} P{page_size}"
    benchmark.pedantic(one_round, rounds=rounds, iterations=1, warmup_rounds=0)
    med = {dtype: float(np.median(times[dtype])) for dtype in DTYPES}
    benchmark.extra_info.update({
        "attention": _kind(hq, hkv), "num_q_heads": hq, "num_kv_heads": hkv, "head_dim": d, "context": n,
        "page_size": page_size, "rounds": rounds, "layers": {dt: stacks[dt].count for dt in DTYPES},
        **{f"median_s_{dt}": med[dt] for dt in DTYPES},
        **{f"min_s_{dt}": float(min(times[dt])) for dt in DTYPES},
        "min_speedup_vs_float16": min(times["float16"]) / min(times["int8"]),
        "min_speedup_vs_float32": min(times["float32"]) / min(times["int8"]),
        "speedup_vs_float16": med["float16"] / med["int8"], "speedup_vs_float32": med["float32"] / med["int8"],
        "target_vs_float16": TARGETS[_kind(hq, hkv)],
        "loadavg": list(__import__("os").getloadavg()),
    })
    print(f"\n{benchmark.group}: " + ", ".join(f"{dt} {med[dt] * 1e3:.2f} ms" for dt in DTYPES)
          + f"; int8 speed-up x{med['float16'] / med['int8']:.2f} vs fp16, x{med['float32'] / med['int8']:.2f} vs fp32"
          + " (fastest rounds: " + ", ".join(f"{dt} {min(times[dt]) * 1e3:.2f}" for dt in DTYPES) + " ms)")


def compute_cases(quick: bool):
    return [(8, kv, 64, 128) for kv in (8, 2, 1)] if quick else [(32, kv, 128, 512) for kv in (32, 8, 1)]


@pytest.mark.kernel
@pytest.mark.parametrize("which", [0, 1, 2], ids=["MHA", "GQA", "MQA"])
def test_int8_kernel_compute(benchmark, quick, which):
    """The kernel's compute per step, apart from memory and from other processes: the serial kernel over a warm
    pool (512 tokens: 4-16 MiB, cache resident), thread CPU time (``time.thread_time``: time-slicing by other
    jobs does not count), best of many calls, int8 against float16 and float32 storage."""
    from decode.attention_plan import attend_unchecked as attend
    from kvcache import KVCache

    hq, hkv, d, n = compute_cases(quick)[which]
    rng = np.random.default_rng(12)
    k = rng.standard_normal((n, hkv, d), dtype=np.float32)
    q = rng.standard_normal((1, hq, d), dtype=np.float32)
    calls = {}
    for dtype in DTYPES:
        cache = KVCache(num_kv_heads=hkv, head_dim=d, dtype=dtype, page_size=64, max_tokens=n)
        seq = cache.create_sequence()
        cache.append(seq, k, k)
        table = cache.pool.page_table(seq)
        args = (q, cache.pool.k_pages(), cache.pool.v_pages(), table, np.array([0, len(table)], np.int64),
                np.zeros(1, np.int32), np.array([n - 1], np.int64), 1 / math.sqrt(d), 0,
                np.empty((1, hq, d), np.float32))
        calls[dtype] = (lambda args=args, cache=cache: attend(*args, mode=1, k_scales=cache.pool.k_scales(),
                                                             v_scales=cache.pool.v_scales()))
        calls[dtype]()
    best = {dtype: math.inf for dtype in DTYPES}
    repeat = 1 if quick else 20

    def one_round():
        for dtype in DTYPES:
            t0 = time.thread_time()
            for _ in range(repeat):
                calls[dtype]()
            best[dtype] = min(best[dtype], (time.thread_time() - t0) / repeat)

    benchmark.group = "int8 kernel compute (serial, warm, thread CPU time)"
    benchmark.pedantic(one_round, rounds=1 if quick else 30, iterations=1, warmup_rounds=0)
    benchmark.extra_info.update({"attention": _kind(hq, hkv), "num_q_heads": hq, "num_kv_heads": hkv, "context": n,
                                 **{f"cpu_s_{dt}": best[dt] for dt in DTYPES},
                                 "int8_cost_vs_float16": best["int8"] / best["float16"],
                                 "int8_cost_vs_float32": best["int8"] / best["float32"]})
    print(f"\ncompute {_kind(hq, hkv)} n{n}: " + ", ".join(f"{dt} {best[dt] * 1e6:.0f} us" for dt in DTYPES))
