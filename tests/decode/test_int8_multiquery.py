"""The tiled multi-query kernel over int8 pages (`decode.kernels.tiled` with scale arrays: every K/V block
widened from int8 + float16 group scales into the tile's float32 block) against the float64 oracle computed on
the *dequantized* K/V: |out - oracle| <= 1e-6 + 3 * err_numpy, err_numpy the max error of the same plain NumPy
computation in float32 on the same dequantized values (the float32 budget of the other storage dtypes).

Runs of >= `decode.attention_plan.MIN_RUN` queries go to it (the float path's threshold), the other queries to the
int8 single-query kernel. Marked `kernel`: CI reruns these with NUMBA_DISABLE_JIT=1 and NUMBA_BOUNDSCHECK=1 on
--reduced-grid.
"""
import importlib.util
from pathlib import Path

import numpy as np
import pytest

from decode import Decoder, batch_extend
from decode import attention_plan as MQ
from decode.attention_plan import attend_unchecked
from kvcache import KVCache, quant
from reference.dense import decode_reference


def _load(name, file):
    spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name(file))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_scenes = _load("decode_int8_kernel_scene", "test_int8_kernel.py")
Int8Scene, naive = _scenes.Int8Scene, _scenes.naive

pytestmark = pytest.mark.kernel
ATOL = naive.ATOL
MODES = ((1, 0), (2, 0), (2, 5))          # serial, parallel, parallel with key-range parts of 5 tokens


def runs_scene(rng, *, lengths, runs, singles=(), **kw):
    """An `Int8Scene` whose queries are `runs` [(seq, start, T)] (query t at position start + t) then `singles`."""
    queries = [(s, start + t) for s, start, T in runs for t in range(T)] + list(singles)
    return Int8Scene(rng, lengths=lengths, queries=queries, **kw)


def tiled(scene, mode=0, split_tokens=0):
    """The tiled kernel alone (`decode.attention_plan.attend_runs` with the scales); every query must be in a run."""
    out = np.full((len(scene.q), scene.q.shape[1], scene.v_pages.shape[3]), np.nan, dtype=np.float32)
    rest = MQ.attend_runs(scene.q, scene.k_pages, scene.v_pages, *scene.tables(), scene.scale, scene.window, out,
                          mode=mode, split_tokens=split_tokens, k_scales=scene.k_scales, v_scales=scene.v_scales)
    assert len(rest) == 0
    return out


def single(scene):
    """Every query through the int8 single-query kernel (one query at a time)."""
    out = np.empty((len(scene.q), scene.q.shape[1], scene.v_pages.shape[3]), dtype=np.float32)
    return attend_unchecked(scene.q, scene.k_pages, scene.v_pages, *scene.tables(),
                                                        scene.scale, scene.window, out, mode=1, tiled=False,
                                                        k_scales=scene.k_scales, v_scales=scene.v_scales)


def _grid(reduced):
    """(head_dim, head_dim_v, group, page_size): head_dim tails (3, 33, 127) and whole groups, GQA ratios."""
    if reduced:
        return [(33, 3, 1, 3), (3, 40, 4, 1), (64, 32, 8, 16)]
    dims = ((3, 3), (33, 33), (127, 127), (32, 40), (128, 128))
    return [(d, dv, g, p) for d, dv in dims for g in (1, 4, 8, 32) for p in (1, 3, 16, 64)
            if (d * 7 + g + p) % 2 == 0 or d == 127]


def pytest_generate_tests(metafunc):
    if "case" in metafunc.fixturenames:
        metafunc.parametrize("case", _grid(metafunc.config.getoption("--reduced-grid")),
                             ids=lambda c: f"d{c[0]}-dv{c[1]}-g{c[2]}-P{c[3]}")


def test_grid_prefill_and_extend(case, reduced_grid):
    """A prefill (0 -> T) and an extend (start -> start + T) crossing several tiles and key blocks, every mode."""
    head_dim, head_dim_v, group, P = case
    rng = np.random.default_rng(head_dim * 1000 + head_dim_v * 10 + group + P)
    T = 7 if reduced_grid else (40 if group < 8 else 20)
    start = 5 if reduced_grid else 150
    scene = runs_scene(rng, num_kv_heads=1 if group == 32 else 2, group=group, head_dim=head_dim,
                       head_dim_v=head_dim_v, page_size=P, lengths=(T, start + T),
                       runs=((0, 0, T), (1, start, T)))
    for mode, split in MODES:
        scene.check(tiled(scene, mode, split))
    scene.check(scene.run())                          # routed through the wrapper


@pytest.mark.parametrize("window", [1, 3, 9, 1000])
def test_sliding_windows(window, reduced_grid):
    """Windows inside one tile, across tiles and key blocks, and longer than the context; pages wholly before
    every window are freed (-1)."""
    rng = np.random.default_rng(window)
    P = 4
    L = 30 if reduced_grid else 300
    T = 9 if reduced_grid else 70
    scene = runs_scene(rng, num_kv_heads=2, group=4, head_dim=40, head_dim_v=33, page_size=P, lengths=(L,),
                       runs=((0, L - T, T),), window=window)
    for mode, split in MODES:
        scene.check(tiled(scene, mode, split))


def test_split_k_parts_and_many_runs(reduced_grid):
    """Key ranges cut into parts of various lengths (merged afterwards), several runs of several sequences."""
    rng = np.random.default_rng(3)
    L = 40 if reduced_grid else 600
    scene = runs_scene(rng, num_kv_heads=2, group=2, head_dim=32, page_size=16, lengths=(L, 11, L // 2),
                       runs=((0, L - 8, 8), (1, 0, 11), (2, 3, 5), (0, 0, 3)))
    for split in (1, 7, 16, 64):
        scene.check(tiled(scene, 2, split))


def test_equals_one_query_at_a_time_within_budget(reduced_grid):
    """The tiled kernel and the single-query kernel on the same queries: each within the budget of the oracle,
    and within twice that budget of each other."""
    rng = np.random.default_rng(4)
    L = 24 if reduced_grid else 400
    scene = runs_scene(rng, num_kv_heads=2, group=8, head_dim=64, page_size=16, lengths=(L,),
                       runs=((0, 0, L),))
    a, b = tiled(scene, 1), single(scene)
    scene.check(a)
    scene.check(b)
    args = (scene.q, scene.k_deq, scene.v_deq, *scene.tables(), scene.scale, scene.window)
    ref = naive.decode(*args)
    budget = naive.budget(*args, ref=ref)
    assert np.abs(a - b).max() <= 2 * budget


def test_routing_runs_of_three_or_more(monkeypatch):
    """Runs of >= MIN_RUN (3) queries reach the tiled kernel with the scales; shorter runs and single queries
    the single-query kernel; every output within budget."""
    seen = []
    tiles_run, init = MQ.TilePlan.run, MQ.AttentionPlan.__init__

    def spy_run(self, q, k_pages, v_pages, k_scales, *args):
        seen.append(k_scales is not None)
        return tiles_run(self, q, k_pages, v_pages, k_scales, *args)

    def spy_init(self, *args, **kw):
        init(self, *args, **kw)
        seen.append(len(self.query_pos) if self.rest is None else len(self.rest))

    monkeypatch.setattr(MQ.TilePlan, "run", spy_run)
    monkeypatch.setattr(MQ.AttentionPlan, "__init__", spy_init)
    rng = np.random.default_rng(5)
    scene = runs_scene(rng, num_kv_heads=2, group=4, head_dim=40, page_size=4, lengths=(20, 9),
                       runs=((0, 10, MQ.MIN_RUN), (1, 2, MQ.MIN_RUN - 1)), singles=((0, 4),))
    scene.check(scene.run())
    assert seen == [MQ.MIN_RUN - 1 + 1, True]                  # the short run and the single query: the rest
    seen.clear()
    short = runs_scene(rng, num_kv_heads=2, group=4, head_dim=40, page_size=4, lengths=(9,),
                       runs=((0, 2, MQ.MIN_RUN - 1),))
    short.check(short.run())
    assert seen == [MQ.MIN_RUN - 1]                             # nothing tiled


# -- through the Decoder: prefill, extend after a cache, batch_extend ----------------------------------------------
def _budget_check(q, K, V, start, scale, window, out):
    """out [T, Hq, Dv] of queries q at positions start.. over dense dequantized K, V [n, Hkv, .]."""
    ref = decode_reference(q.astype(np.float64), K, V, start, scale, window or None)
    err = np.abs(out - ref).max()
    budget = naive.budget_dense(q, K, V, start, scale, window or 0, ref)
    assert err <= budget, f"max error {err:.3g} > {budget:.3g}"


@pytest.mark.parametrize("window", [None, 6])
def test_decoder_prefill_then_extend(window, reduced_grid):
    rng = np.random.default_rng(6)
    n0, n1 = (10, 7) if reduced_grid else (200, 70)
    dec = Decoder(8, 2, 40, 33, dtype="int8", page_size=4, max_tokens=n0 + n1 + 4, window=window)
    q = rng.standard_normal((n0 + n1, 8, 40)).astype(np.float32)
    k = rng.standard_normal((n0 + n1, 2, 40)).astype(np.float32)
    v = rng.standard_normal((n0 + n1, 2, 33)).astype(np.float32)
    out0 = dec.extend(q[:n0], k[:n0], v[:n0])                  # prefill 0 -> n0
    out1 = dec.extend(q[n0:], k[n0:], v[n0:])                  # extend after a cache
    # every row is quantized on its own on write: the dequantized K/V of all positions (a window releases pages)
    K, V = (quant.dequantize(*quant.quantize(x.astype(np.float64)), np.float64) for x in (k, v))
    first = dec.cache.pool.first_position(dec.seq)
    for held, full in zip(dec.kv(), (K, V)):
        np.testing.assert_array_equal(held, full[first:])
    assert out0.dtype == out1.dtype == np.float32
    _budget_check(q[:n0], K, V, 0, dec.scale, window or 0, out0)
    _budget_check(q[n0:], K, V, n0, dec.scale, window or 0, out1)


def test_batch_extend_equals_separate_extends(reduced_grid):
    """batch_extend of several int8 sequences == each sequence's own extend (same pool contents, each within
    budget of the oracle, and within twice the budget of each other)."""
    rng = np.random.default_rng(7)
    starts = (0, 5, 3) if reduced_grid else (0, 130, 40)
    counts = (6, 4, 1) if reduced_grid else (64, 20, 1)

    def make():
        cache = KVCache(num_kv_heads=2, head_dim=33, head_dim_v=32, dtype="int8", page_size=4, num_pages=256)
        decs = [Decoder.on_cache(cache, 8) for _ in starts]
        return cache, decs

    data = [(rng.standard_normal((n + c, 8, 33)).astype(np.float32),
             rng.standard_normal((n + c, 2, 33)).astype(np.float32),
             rng.standard_normal((n + c, 2, 32)).astype(np.float32)) for n, c in zip(starts, counts)]
    (_, together), (_, apart) = make(), make()
    for decs in (together, apart):
        for dec, (q, k, v), n in zip(decs, data, starts):
            if n:
                dec.extend(q[:n], k[:n], v[:n])
    outs = batch_extend(together, [q[n:] for (q, _, _), n in zip(data, starts)],
                        [k[n:] for (_, k, _), n in zip(data, starts)], [v[n:] for (_, _, v), n in zip(data, starts)])
    for dec_t, dec_a, (q, k, v), n, out in zip(together, apart, data, starts, outs):
        sep = dec_a.extend(q[n:], k[n:], v[n:])
        K, V = (x.astype(np.float64) for x in dec_t.kv())
        for x, y in zip(dec_t.kv(), dec_a.kv()):
            np.testing.assert_array_equal(x, y)
        _budget_check(q[n:], K, V, n, dec_t.scale, 0, out)
        _budget_check(q[n:], K, V, n, dec_t.scale, 0, sep)
        ref = decode_reference(q[n:].astype(np.float64), K, V, n, dec_t.scale)
        assert np.abs(out - sep).max() <= 2 * max(np.abs(out - ref).max(), np.abs(sep - ref).max()) + ATOL


def test_value_scales_are_applied():
    """The same int8 values with every V scale doubled give an output doubled (to float32 rounding): the tile's
    V block is widened with the scale arrays."""
    rng = np.random.default_rng(8)
    scene = runs_scene(rng, num_kv_heads=2, group=4, head_dim=40, page_size=4, lengths=(12,), runs=((0, 0, 12),))
    base = tiled(scene, 1)
    scene.v_scales = (scene.v_scales.astype(np.float32) * 2).astype(np.float16)
    scene.v_deq = quant.dequantize(scene.v_pages, scene.v_scales)
    doubled = tiled(scene, 1)
    scene.check(doubled)
    np.testing.assert_allclose(doubled, 2 * base, rtol=1e-6, atol=1e-6)
