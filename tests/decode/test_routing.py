"""Routing of runs between the per-query and the tiled kernel (`decode.attention_plan.route_min_run`, issue 20):
the plan follows the rule for every run of a call, a sequence is routed the same alone and in a ragged batch,
and the routed output is within the accuracy budget (`naive.budget`) of the float64 oracle at the boundary run
lengths, where the rule switches kernels. Speed is the benchmarks' business (`benchmarks/test_routing.py`).
"""
import importlib.util
import math
from pathlib import Path

import numpy as np
import pytest

from decode import attention_plan as AP
from decode.attention import paged_decode_attention
from kvcache import bf16

pytestmark = pytest.mark.kernel

_spec = importlib.util.spec_from_file_location("decode_kernel_naive_routing", Path(__file__).with_name("naive.py"))
naive = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(naive)

GROUPS = (1, 2, 4, 8, 16, 32)
STORAGES = ("float32", "float16", "bfloat16", "int8")


def storage_of(name):
    return AP.BFLOAT16 if name == AP.BFLOAT16 else np.dtype(name)


def plan_of(counts, group, head_dim, storage, *, num_kv_heads=1, start=40, page_size=16):
    """The plan of a ragged call: sequence b extends by counts[b] queries from position start + 7 b."""
    seqs = np.concatenate([np.full(n, b, np.int32) for b, n in enumerate(counts)])
    pos = np.concatenate([start + 7 * b + np.arange(n, dtype=np.int64) for b, n in enumerate(counts)])
    q_shape = (len(seqs), num_kv_heads * group, head_dim)
    v_shape = (8, num_kv_heads, page_size, head_dim)
    return AP.AttentionPlan(seqs, pos, 0, q_shape, v_shape, storage_of(storage))


def tiled_sequences(plan):
    return set() if plan.tiles is None else {int(s) for s in plan.tiles.runs[:, 0]}


@pytest.mark.parametrize("storage", STORAGES)
@pytest.mark.parametrize("head_dim", (64, 128))
def test_plan_follows_the_rule(storage, head_dim):
    """For every group and run length 1..20: a lone extend is tiled iff T >= the rule's length and T is not one
    it skips (`route_rule`), and in a ragged batch of all those lengths exactly the same sequences are tiled; the
    rest go to the per-query kernel."""
    counts = list(range(1, 21))
    for group in GROUPS:
        threshold, skip = AP.route_rule(group, head_dim, storage_of(storage))
        assert threshold >= 2                               # a single query (a decode step) is never tiled
        assert all(threshold < x < AP.LONGEST_MIN_RUN for x in skip)
        tiled = {T for T in counts if T >= threshold and T not in skip}
        for T in counts:
            alone = plan_of([T], group, head_dim, storage)
            assert (alone.tiles is not None) == (T in tiled), (group, T, threshold, skip)
            assert (alone.single is not None) == (T not in tiled)
            assert AP.routes_tiled(T, group, head_dim, storage_of(storage)) == (T in tiled)
        batch = plan_of(counts, group, head_dim, storage)
        assert tiled_sequences(batch) == {b for b, T in enumerate(counts) if T in tiled}
        if batch.tiles is not None:
            assert len(batch.rest) == sum(T for T in counts if T not in tiled)


def test_rule_depends_on_shapes_only():
    """The same answer on 1 and 2 threads and for any number of kv heads at a given group."""
    import numba

    before = numba.get_num_threads()
    try:
        seen = set()
        for threads in (1, min(2, numba.config.NUMBA_NUM_THREADS)):
            numba.set_num_threads(threads)
            for kv in (1, 2, 8):
                seen.add(tuple(AP.route_min_run(g, 128, np.dtype(np.float32)) for g in GROUPS))
                assert tiled_sequences(plan_of([3, 5, 9], 4, 128, "float32", num_kv_heads=kv)) == \
                    tiled_sequences(plan_of([3, 5, 9], 4, 128, "float32"))
        assert len(seen) == 1
    finally:
        numba.set_num_threads(before)


def _pages(rng, storage, n_tokens, num_kv_heads, head_dim, page_size):
    """(k_pages, v_pages as stored, k_scales, v_scales, page_indices, dequantized K/V pages as float64)."""
    npages = -(-n_tokens // page_size)
    shape = (npages, num_kv_heads, page_size, head_dim)
    k, v = (rng.standard_normal(shape).astype(np.float32) for _ in range(2))
    indices = rng.permutation(npages).astype(np.int32)
    if storage == "bfloat16":
        kb, vb = bf16.to_bits(k), bf16.to_bits(v)
        return kb, vb, None, None, indices, bf16.to_float32(kb), bf16.to_float32(vb)
    kd, vd = k.astype(storage), v.astype(storage)
    return kd, vd, None, None, indices, kd, vd


@pytest.mark.parametrize("storage", ("float32", "float16", "bfloat16"))
def test_routed_output_within_budget_at_the_boundary(storage, reduced_grid):
    """Per group: extends of threshold - 1, threshold and threshold + 1 tokens (one kernel on each side of the
    rule) over 45 cached tokens, alone and as one ragged batch, within `naive.budget` of the float64 oracle; each
    sequence of the batch bitwise equal to its lone call."""
    head_dim = 8 if reduced_grid else 128
    groups = (1, 8) if reduced_grid else GROUPS
    rng = np.random.default_rng(20)
    for group in groups:
        num_kv_heads = 1 if group >= 8 else 2
        threshold = AP.route_min_run(group, head_dim, storage_of(storage))
        counts = [max(1, threshold - 1), threshold, threshold + 1]
        start, P = 45, 16
        lengths = [start + n for n in counts]
        parts = [_pages(rng, storage, L, num_kv_heads, head_dim, P) for L in lengths]
        offs = np.cumsum([0] + [len(p[0]) for p in parts])
        k = np.concatenate([p[0] for p in parts])
        v = np.concatenate([p[1] for p in parts])
        kd = np.concatenate([p[5] for p in parts]).astype(np.float64)
        vd = np.concatenate([p[6] for p in parts]).astype(np.float64)
        tables = [p[4] + o for p, o in zip(parts, offs)]
        indices = np.concatenate(tables).astype(np.int32)
        indptr = np.array([0] + list(np.cumsum([len(t) for t in tables])), np.int64)
        q = rng.standard_normal((sum(counts), num_kv_heads * group, head_dim)).astype(np.float32)
        seqs = np.concatenate([np.full(n, b, np.int32) for b, n in enumerate(counts)])
        pos = np.concatenate([start + np.arange(n, dtype=np.int64) for n in counts])
        scale = 1.0 / math.sqrt(head_dim)
        kw = {"storage": storage} if storage == "bfloat16" else {}
        batch = paged_decode_attention(q, k, v, indices, indptr, seqs, pos, scale=scale, **kw)
        ref = naive.decode(q, kd, vd, indices, indptr, seqs, pos, scale, 0)
        allowed = naive.budget(q, kd, vd, indices, indptr, seqs, pos, scale, 0, ref=ref)
        err = np.abs(batch - ref).max()
        assert err <= allowed, (group, counts, err, allowed)
        first = 0
        for b, n in enumerate(counts):
            one = slice(first, first + n)
            alone = paged_decode_attention(q[one], k, v, indices, indptr, seqs[one] * 0 + b, pos[one], scale=scale,
                                           **kw)
            assert np.array_equal(alone, batch[one]), (group, n)
            first += n


@pytest.mark.parametrize("count", [1, 64])
def test_a_plan_for_one_thread_is_serial_whatever_numbas_count(count):
    """``threads=1`` plans serial calls (run on the calling thread) and ``threads=2`` parallel ones for the same
    long call, whatever numba's count is while planning: a forward on one kernel thread never sets numba's count
    (`decode.hf.plan.ForwardPlan`)."""
    import numba

    seqs = np.zeros(count, np.int32)
    pos = 8192 + np.arange(count, dtype=np.int64)
    before = numba.get_num_threads()
    try:
        for numba_count in sorted({1, numba.config.NUMBA_NUM_THREADS}):
            numba.set_num_threads(numba_count)
            for threads in (1, 2):
                plan = AP.AttentionPlan(seqs, pos, 0, (count, 32, 128), (8, 8, 16, 128), np.dtype(np.float32),
                                        threads=threads)
                parts = [p for p in (plan.tiles, plan.single) if p is not None]
                assert len(parts) == 1 and (plan.tiles is not None) == (count > 1)
                assert parts[0].serial == (threads == 1)
    finally:
        numba.set_num_threads(before)


def test_bfloat16_rule_follows_the_tiles(monkeypatch):
    """bfloat16 pages take `ROUTE_MIN_RUN_AMX` where the tiled kernel runs on AMX tiles, the CPU's other table
    with the tiles off ($KVENGINE_AMX=0) or on a CPU without them (`ROUTE_MIN_RUN`, or `ROUTE_MIN_RUN_AVX2` without
    AVX-512); other formats never change."""
    from decode.kernels import amx_tiles
    tiles = amx_tiles.usable()
    tiles_off = AP.ROUTE_MIN_RUN if AP.AVX512 else AP.ROUTE_MIN_RUN_AVX2
    for head_dim, table in AP.ROUTE_MIN_RUN_AMX.items():
        for entry in table:
            want = entry[1] if tiles else expected_rule(tiles_off, AP.BFLOAT16, entry[0], head_dim)[0]
            assert AP.route_min_run(entry[0], head_dim, AP.BFLOAT16) == want
    f32 = AP.route_rule(4, 128, np.float32)
    monkeypatch.setenv(amx_tiles.ENV, "0")
    assert AP.route_rule(4, 128, np.float32) == f32
    assert AP.route_rule(4, 128, AP.BFLOAT16) == expected_rule(tiles_off, AP.BFLOAT16, 4, 128)


def expected_rule(table, name, group, head_dim):
    """(min_run, skip) of a routing table read by hand: the largest listed head_dim <= head_dim, then the entry of
    the largest listed group <= group."""
    dims = [d for (fmt, d) in table if fmt == name and d <= head_dim]
    if not dims:
        return AP.MIN_RUN, ()
    entry = max((e for e in table[name, max(dims)] if e[0] <= group), key=lambda e: e[0])
    return entry[1], tuple(entry[2]) if len(entry) > 2 else ()


CPU_TABLES = {"avx2": "ROUTE_MIN_RUN_AVX2", "avx512": "ROUTE_MIN_RUN", "amx": "ROUTE_MIN_RUN_AMX_CPU"}


@pytest.mark.parametrize("cpu", sorted(CPU_TABLES))
def test_float_and_int8_rules_follow_the_cpu(monkeypatch, cpu):
    """float32 / float16 pages take `ROUTE_MIN_RUN_AMX_CPU` on a CPU with AMX (measured there: the other table lost
    up to 1.85x), `ROUTE_MIN_RUN_AVX2` on one without AVX-512 (measured on a Zen 3 once its register blocks fit
    AVX2) and `ROUTE_MIN_RUN` on the others, whatever $KVENGINE_AMX says; int8 takes the AVX2 table without
    AVX-512, else `ROUTE_MIN_RUN`'s lengths; float64 MIN_RUN everywhere. The tables differ where their CPUs
    measured otherwise, so a wrong choice shows."""
    from decode.kernels import amx_tiles
    monkeypatch.setattr(AP, "AMX_CPU", cpu == "amx")
    monkeypatch.setattr(AP, "AVX512", cpu != "avx2")
    table = getattr(AP, CPU_TABLES[cpu])
    int8_table = AP.ROUTE_MIN_RUN_AVX2 if cpu == "avx2" else AP.ROUTE_MIN_RUN
    for env in ("1", "0"):
        monkeypatch.setenv(amx_tiles.ENV, env)
        for name in ("float32", "float16"):
            for head_dim in (32, 64, 96, 128, 256):
                for group in GROUPS:
                    assert AP.route_rule(group, head_dim, np.dtype(name)) == \
                        expected_rule(table, name, group, head_dim), (name, head_dim, group, env)
        for head_dim in (32, 64, 128):
            for group in GROUPS:
                assert AP.route_rule(group, head_dim, np.dtype("int8")) == \
                    expected_rule(int8_table, "int8", group, head_dim)
                assert AP.route_rule(group, head_dim, np.dtype("float64")) == (AP.MIN_RUN, ())
    for other in set(CPU_TABLES) - {cpu}:
        tab = getattr(AP, CPU_TABLES[other])
        assert any(expected_rule(tab, name, g, d) != expected_rule(table, name, g, d)
                   for name in ("float32", "float16") for d in (64, 128) for g in GROUPS), (cpu, other)
