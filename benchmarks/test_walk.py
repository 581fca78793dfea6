"""The decode paths against the page-walk read ceiling of the very pages they read (issue 9), measured in
alternation with the timed rounds: before every timed call the untimed setup walks the pages of a layer half a
rotation away (`benchmarks.walk.page_walk`), so the ceiling and the step see the same memory state.

    step      `Decoder.step`, MHA and GQA-8 (32 q heads, head_dim 128), 4096 / 32768 tokens, float32 / float16,
              pages of 16 and 64; cold (one Decoder per layer, >= 1 GiB of K/V rotated)
    batch     `batch_step` of B sequences x N tokens (GQA-8 float32, page 16) vs a loop of `Decoder.step`, both
              against the walk of all B page rows
    layers    a 32-layer token (`transaction(1)` + 32 `tx.step`) vs the 32 bare kernel calls over the same pages
              (`AttentionPlan.run`): the per-layer time beyond the kernel; GQA-8 float16, 4096 tokens (cold) and
              16 tokens (hot, where the overhead is not hidden by the kernel's own variation)
"""
from __future__ import annotations

import gc
import math

import numpy as np
import pytest

from . import common
from .common import Data, Shape
from .impls import EngineStep
from .walk import WalkCeiling


def _step_cases(quick):
    if quick:
        return [(Shape(8, kv, 32, 300, dt), p) for kv in (8, 2) for dt, p in (("float32", 16), ("float16", 64))]
    return [(Shape(32, kv, 128, n, dt), p) for kv in (32, 8) for n in (4096, 32768) for dt in ("float32", "float16")
            for p in (16, 64)]


def _batch_cases(quick):
    if quick:
        return [(4, 64, how) for how in ("batch_step", "loop")]
    return [(b, n, how) for b in (32, 64) for n in (128, 256, 1024) for how in ("batch_step", "loop")]


def pytest_generate_tests(metafunc):
    quick = metafunc.config.getoption("--quick")
    if "walk_case" in metafunc.fixturenames:
        cases = _step_cases(quick)
        metafunc.parametrize("walk_case", cases, ids=[f"{s.label}-P{p}" for s, p in cases])
    if "batch_case" in metafunc.fixturenames:
        cases = _batch_cases(quick)
        metafunc.parametrize("batch_case", cases, ids=[f"B{b}-n{n}-{how}" for b, n, how in cases])
    if "layers_case" in metafunc.fixturenames:
        metafunc.parametrize("layers_case", ["cold", "hot"])


def _rounds(per_call, quick, budget=1.5, maximum=400):
    return 1 if quick else common.choose_rounds(per_call, budget=budget, minimum=7, maximum=maximum)


@pytest.mark.kernel
def test_step_vs_walk(benchmark, ceilings, quick, warm_engine, walk_case):
    shape, page = walk_case
    layers = common.layers_for(shape, quick)
    data = Data(shape, layers)
    engine = EngineStep(data, page_size=page)
    engine.build()
    common.check_close(f"step {shape.label}", engine.call(0), data.reference(0), shape.dtype)
    ceiling = WalkCeiling()
    rotation = common.Rotation(layers)
    pages = [dec.cache.pool.page_table(dec.seq) for dec in engine.decs]

    def setup():
        layer = next(rotation)
        other = engine.decs[(layer + layers // 2) % layers]
        ceiling.measure(other.cache.pool.k_pages(0), other.cache.pool.v_pages(0), pages[(layer + layers // 2) % layers],
                        shape.kv_bytes)
        engine.setup(layer)
        return (layer,), {}

    trial = []
    for _ in range(3):
        (layer,), _ = setup()
        trial.append(common.time_calls(engine.call, [(layer,)]))
    ceiling.seconds.clear()
    benchmark.group = f"walk step {shape.label}"
    common.pedantic(benchmark, engine.call, setup=setup, rounds=_rounds(float(np.median(trial)), quick),
                    iterations=1, warmup_rounds=0)
    common.record(benchmark, ceilings.near(f"walk {shape.label} P{page}"), shape.kv_bytes, shape.flops,
                  impl="engine_step", layers=layers, page_size=page, **shape.info())
    ceiling.record(benchmark)
    engine.free()
    gc.collect()


@pytest.mark.kernel
def test_batch_vs_walk(benchmark, ceilings, quick, warm_engine, batch_case):
    """B sequences of N tokens in one pool per layer ("layers" pools rotated so the K/V is cold)."""
    from decode import Decoder, batch_step
    from kvcache import KVCache

    batch, n, how = batch_case
    shape = Shape(8, 2, 32, n, "float32") if quick else Shape(32, 8, 128, n, "float32")
    page = 16
    per_pool = batch * shape.kv_bytes
    pools = 2 if quick else int(min(64, max(2, math.ceil(512 * common.MiB / per_pool))))
    data = Data(shape, 1)
    decs = []
    for _ in range(pools):
        cache = KVCache(num_kv_heads=shape.num_kv_heads, head_dim=shape.head_dim, dtype=shape.dtype, page_size=page,
                        max_tokens=batch * (n + page))
        row = [Decoder.on_cache(cache, shape.num_q_heads) for _ in range(batch)]
        for dec in row:
            for _, k, v in data.chunks(0):
                dec.append(k, v)
        decs.append(row)
    rng = np.random.default_rng(5)
    q = rng.standard_normal((batch, shape.num_q_heads, shape.head_dim), dtype=np.float32)
    k = rng.standard_normal((batch, shape.num_kv_heads, shape.head_dim), dtype=np.float32)
    ceiling = WalkCeiling()
    rotation = common.Rotation(pools)

    def call(p):
        if how == "batch_step":
            return batch_step(decs[p], q, k, k)
        return [dec.step(q[b], k[b], k[b]) for b, dec in enumerate(decs[p])]

    def setup():
        p = next(rotation)
        other = decs[(p + pools // 2) % pools]
        cache = other[0].cache
        ceiling.measure(cache.pool.k_pages(0), cache.pool.v_pages(0),
                        np.concatenate([cache.pool.page_table(d.seq) for d in other]), per_pool)
        for dec in decs[p]:
            if dec.length == n:
                dec.truncate(n - 1)
        return (p,), {}

    trial = []
    for _ in range(3):
        (p,), _ = setup()
        trial.append(common.time_calls(call, [(p,)]))
    ceiling.seconds.clear()
    benchmark.group = f"walk batch B={batch} n={n}"
    common.pedantic(benchmark, call, setup=setup, rounds=_rounds(float(np.median(trial)), quick), iterations=1,
                    warmup_rounds=0)
    common.record(benchmark, ceilings.near(f"walk batch B={batch} n={n}"), per_pool, batch * shape.flops,
                  impl=how, batch=batch, pools=pools, page_size=page, **shape.info())
    ceiling.record(benchmark)
    del decs
    gc.collect()


@pytest.mark.kernel
def test_layer_overhead(benchmark, ceilings, quick, warm_engine, layers_case):
    """Per-layer time of a multi-layer token beyond its kernel calls: the transaction (validation, slot, 32
    writes, 32 kernel calls over one plan) against the 32 `AttentionPlan.run` calls alone, alternated round by
    round (extra_info ``kernel_seconds``, ``overhead_per_layer_s``)."""
    from decode import Decoder
    from decode.attention_plan import AttentionPlan

    num_layers = 4 if quick else 32
    n = 16 if layers_case == "hot" else (300 if quick else 4096)
    hq, hkv, d = (8, 2, 32) if quick else (32, 8, 128)
    shape = Shape(hq, hkv, d, n, "float16")
    dec = Decoder(num_q_heads=hq, num_kv_heads=hkv, head_dim=d, dtype="float16", page_size=16, max_tokens=n + 16,
                  num_layers=num_layers)
    rng = np.random.default_rng(7)
    kv = rng.standard_normal((num_layers, n - 1, hkv, d), dtype=np.float32)
    dec.cache.append(dec.seq, kv, kv)
    q = list(rng.standard_normal((num_layers, hq, d), dtype=np.float32))
    k = list(rng.standard_normal((num_layers, hkv, d), dtype=np.float32))

    def token():
        with dec.transaction(1) as tx:
            for layer in range(num_layers):
                tx.step(layer, q[layer], k[layer], k[layer])

    token()                                                        # n tokens: the kernel-only baseline's pages
    table = dec.cache.pool.page_table(dec.seq)
    indptr = np.array([0, len(table)], dtype=np.int64)
    qseq, qpos = np.zeros(1, dtype=np.int32), np.array([n - 1], dtype=np.int64)
    plan = AttentionPlan(qseq, qpos, 0, (1, hq, d), dec.cache.pool.v_pages(0).shape, np.dtype(np.float16))
    out = np.empty((1, hq, d), dtype=np.float32)
    # the kernels' own view of float16 pages (uint16 bits), made here once: the baseline is the bare kernel call
    pools = [(dec.cache.pool.k_pages(layer).view(np.uint16), dec.cache.pool.v_pages(layer).view(np.uint16))
             for layer in range(num_layers)]
    qs = [x[None] for x in q]
    kernel_s = []

    def kernels():
        for layer in range(num_layers):
            plan.run(qs[layer], *pools[layer], table, indptr, dec.scale, 0, out)

    def setup():
        kernel_s.append(common.time_calls(kernels, [()]))
        dec.truncate(n - 1)
        return (), {}

    for _ in range(3):
        setup()
        token()
    kernel_s.clear()
    benchmark.group = f"layers {num_layers}x {shape.label}"
    per_call = common.time_calls(token, [()])
    dec.truncate(n - 1)
    common.pedantic(benchmark, token, setup=setup, rounds=_rounds(per_call, quick, budget=2.0, maximum=2000),
                    iterations=1, warmup_rounds=0)
    common.record(benchmark, ceilings, num_layers * shape.kv_bytes, num_layers * shape.flops, impl="transaction",
                  num_layers=num_layers, **shape.info())
    stats = getattr(getattr(benchmark, "stats", None), "stats", None)
    kernel = float(np.median(kernel_s)) if kernel_s else None
    benchmark.extra_info.update({"kernel_seconds": kernel, "case": layers_case})
    if stats is not None and stats.median > 0 and kernel is not None:
        benchmark.extra_info["overhead_per_layer_s"] = (stats.median - kernel) / num_layers
