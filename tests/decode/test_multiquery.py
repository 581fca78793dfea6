"""The tiled multi-query kernel (`decode.kernels.tiled`, reached through `decode.attention`) against the
float64 reference (`reference.dense.decode_reference`).

Accuracy contract: float32 / float16 storage within `naive.budget` of the float64 oracle on the stored values;
float64: 1e-13 absolute + relative. Every test is marked `kernel` (CI reruns `-m kernel --reduced-grid` with
NUMBA_DISABLE_JIT=1 and NUMBA_BOUNDSCHECK=1, so the reduced grid stays small).
"""
import importlib.util
import itertools
import math
from pathlib import Path

import numpy as np
import pytest

from decode import attention_plan as MQ
from decode.attention import paged_decode_attention
from decode.attention_plan import attend_unchecked
from reference.dense import decode_reference

pytestmark = pytest.mark.kernel

_spec = importlib.util.spec_from_file_location("decode_kernel_naive_mq", Path(__file__).with_name("naive.py"))
naive = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(naive)

F16, F32, F64 = np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64)
TOL = {F16: (1e-6, 0.0, 3.0), F32: (1e-6, 0.0, 3.0), F64: (1e-13, 1e-13, 0.0)}


class Pool:
    """Sequences of `lengths` tokens in a pool of pages in random physical order; every slot no query may read
    (unused slots, spare pages, pages freed by the window) holds NaN. Queries: `runs` = [(seq, start, T)]
    (query t of a run at position start + t) plus `singles` = [(seq, position)], in shuffled run order."""

    def __init__(self, rng, *, dtype=F32, num_kv_heads=2, group=4, head_dim=8, head_dim_v=None, page_size=4,
                 lengths=(20,), runs=((0, 10, 10),), singles=(), window=0, spare_pages=2, scale_k=1.0,
                 order=None):
        dtype = np.dtype(dtype)
        self.dtype, self.window, P = dtype, window, page_size
        head_dim_v = head_dim if head_dim_v is None else head_dim_v
        npp = [-(-L // P) for L in lengths]
        num_pages = sum(npp) + spare_pages
        phys = rng.permutation(num_pages)          # drawn either way: the data that follows stays the same
        phys = phys if order is None else order
        self.page_indptr = np.zeros(len(lengths) + 1, dtype=np.int64)
        self.page_indptr[1:] = np.cumsum(npp)
        self.page_indices = np.asarray(phys[:sum(npp)], dtype=np.int32).copy()
        self.dense_k = [rng.standard_normal((L, num_kv_heads, head_dim)) * scale_k for L in lengths]
        self.dense_v = [rng.standard_normal((L, num_kv_heads, head_dim_v)) for L in lengths]
        self.k_pages = np.full((num_pages, num_kv_heads, P, head_dim), np.nan, dtype)
        self.v_pages = np.full((num_pages, num_kv_heads, P, head_dim_v), np.nan, dtype)
        queries = [(s, start + t) for s, start, T in runs for t in range(T)] + list(singles)
        self.queries = queries
        for s, L in enumerate(lengths):
            row = self.page_indices[self.page_indptr[s]:self.page_indptr[s + 1]]
            ps = [p for (qs, p) in queries if qs == s]
            first = min((max(0, p - window + 1) if window else 0) for p in ps) if ps else 0
            for t in range(L):
                self.k_pages[row[t // P], :, t % P] = self.dense_k[s][t]
                self.v_pages[row[t // P], :, t % P] = self.dense_v[s][t]
            for j in range(first // P):          # pages wholly before every window: freed
                self.k_pages[row[j]] = np.nan
                self.v_pages[row[j]] = np.nan
                row[j] = -1
        for s in range(len(lengths)):            # the reference reads the stored (rounded) values
            self.dense_k[s] = self.dense_k[s].astype(dtype).astype(np.float64)
            self.dense_v[s] = self.dense_v[s].astype(dtype).astype(np.float64)
        self.compute = F64 if dtype == F64 else F32
        self.q = rng.standard_normal((len(queries), num_kv_heads * group, head_dim)).astype(self.compute)
        self.query_seq = np.array([s for s, _ in queries], dtype=np.int32)
        self.query_pos = np.array([p for _, p in queries], dtype=np.int64)
        self.scale = 1.0 / math.sqrt(head_dim)

    def args(self):
        return (self.q, self.k_pages, self.v_pages, self.page_indices, self.page_indptr, self.query_seq,
                self.query_pos)

    def run(self, **kw):
        out = np.empty((len(self.q), self.q.shape[1], self.v_pages.shape[3]), dtype=self.compute)
        return attend_unchecked(*self.args(), self.scale, self.window, out, **kw)

    def reference(self, plain32=False):
        out = np.empty((len(self.q), self.q.shape[1], self.v_pages.shape[3]))
        for i, (s, p) in enumerate(self.queries):
            K, V = self.dense_k[s][:p + 1], self.dense_v[s][:p + 1]
            if plain32:
                out[i] = _plain32(self.q[i], K, V, self.scale, self.window, p)
            else:
                out[i] = decode_reference(self.q[i:i + 1], K, V, p, self.scale, self.window or None)[0]
        return out

    def check(self, out):
        """Within the float32 budget of the float64 oracle (`naive.budget`; float64 storage: 1e-13)."""
        ref = self.reference()
        atol, rtol, factor = TOL[self.dtype]
        allowed = atol + rtol * np.abs(ref)
        if factor:
            allowed = naive.budget(*self.args(), self.scale, self.window, ref=ref)
        assert out.dtype == self.compute and out.shape == ref.shape
        assert np.isfinite(out).all()
        err = np.abs(out - ref)
        assert (err <= allowed).all(), f"max error {err.max():.3g} (allowed {np.max(allowed):.3g})"


def _plain32(q, K, V, scale, window, p):
    """The same attention in plain float32 NumPy (q [Hq, D] at position p; K, V dense [p + 1, Hkv, .])."""
    lo = max(0, p - window + 1) if window else 0
    K, V = K[lo:].astype(np.float32), V[lo:].astype(np.float32)
    G = q.shape[0] // K.shape[1]
    out = np.empty((q.shape[0], V.shape[2]), np.float32)
    for h in range(q.shape[0]):
        s = (K[:, h // G] @ q[h].astype(np.float32)) * np.float32(scale)
        e = np.exp(s - s.max())
        out[h] = (e @ V[:, h // G]) / e.sum()
    return out


MODES = ((1, 0), (2, 0), (2, 5))          # serial, parallel, parallel with key-range parts of 5 tokens


def _grid(reduced):
    """(head_dim, group, page_size, dtype)."""
    if reduced:
        return [(3, 1, 3, F32), (1, 4, 1, F16), (4, 2, 16, F64), (33, 8, 3, F32)]
    dims, groups, pages = (1, 3, 64, 128), (1, 4, 8), (1, 3, 16, 64)
    grid = [(d, g, p, F32) for d, g, p in itertools.product(dims, groups, pages)]
    for n, (d, g, p) in enumerate(itertools.product(dims, groups, pages)):
        if n % 3 == 0:
            grid.append((d, g, p, F16))
        if n % 4 == 0:
            grid.append((d, g, p, F64))
    return grid


def pytest_generate_tests(metafunc):
    if "grid_case" in metafunc.fixturenames:
        metafunc.parametrize("grid_case", _grid(metafunc.config.getoption("--reduced-grid")),
                             ids=lambda c: f"d{c[0]}-g{c[1]}-P{c[2]}-{c[3].name}")


def test_grid(grid_case, reduced_grid):
    """Prefill (0 -> T) and extend (start -> start + T) runs crossing several tiles and key blocks."""
    head_dim, group, P, dtype = grid_case
    rng = np.random.default_rng(head_dim * 1000 + group * 100 + P + dtype.itemsize)
    T = 9 if reduced_grid else 70
    start = 5 if reduced_grid else 77
    pool = Pool(rng, dtype=dtype, num_kv_heads=2, group=group, head_dim=head_dim, head_dim_v=head_dim + 1,
                page_size=P, lengths=(T, start + T), runs=((0, 0, T), (1, start, T)))
    for mode, split in MODES:
        pool.check(pool.run(mode=mode, split_tokens=split))
    pool.check(paged_decode_attention(*pool.args(), scale=pool.scale))


@pytest.mark.parametrize("dtype", [F32, F16, F64])
def test_sliding_window(dtype, reduced_grid):
    """Windows inside one tile, across tiles and longer than the context; freed pages are -1 and NaN."""
    P = 4 if reduced_grid else 16
    for window in ([1, 3, 2 * P + 1] if reduced_grid else [1, 5, P, 3 * P + 5, 1000]):
        rng = np.random.default_rng(window)
        L, T = (6 * P + 1, 2 * P + 3)
        pool = Pool(rng, dtype=dtype, num_kv_heads=2, group=4, head_dim=3 if reduced_grid else 64, page_size=P,
                    lengths=(L,), runs=((0, L - T, T),), window=window)
        assert window + P > L - T or (pool.page_indices < 0).any()
        for mode, split in MODES:
            pool.check(pool.run(mode=mode, split_tokens=split))


@pytest.mark.parametrize("dtype", [F32, F16, F64])
def test_runs_and_singles(dtype, reduced_grid):
    """Several runs (each sequence its own count) and single queries in one call, in shuffled order: the runs go
    to the tiled kernel, the singles to the single-query kernel, every output lands at its own index."""
    rng = np.random.default_rng(3)
    P = 3 if reduced_grid else 16
    lengths = (2 * P + 1, 5 * P, P, 40)
    runs = [(0, 2, 2 * P - 1), (1, 0, 5 * P), (3, 30, 10)]
    singles = [(2, P - 1), (3, 12), (1, 7)]
    pool = Pool(rng, dtype=dtype, num_kv_heads=2, group=2, head_dim=4 if reduced_grid else 32, head_dim_v=6,
                page_size=P, lengths=lengths, runs=runs, singles=singles)
    for mode, split in MODES:
        pool.check(pool.run(mode=mode, split_tokens=split))
    storage = np.uint16 if dtype == F16 else dtype                  # the wrapper's view of float16 pages
    q, k, v, *table = pool.args()
    rest = MQ.attend_runs(q, k.view(storage), v.view(storage), *table, pool.scale, 0,
                          np.zeros((len(q), 4, 6), pool.compute))
    assert sorted(rest.tolist()) == list(range(len(pool.q) - 3, len(pool.q)))


@pytest.mark.parametrize("dtype", [F32, F16])
def test_nan_slots_and_page_order(dtype, reduced_grid):
    """NaN in every slot no query may read leaves the result bitwise unchanged (the Pool fills them; a copy with
    zeros there must agree), and a different physical page order gives the same bits."""
    P = 4 if reduced_grid else 16
    kw = dict(dtype=dtype, num_kv_heads=2, group=4, head_dim=5 if reduced_grid else 64, page_size=P,
              lengths=(3 * P + 1,), runs=((0, P - 1, 2 * P + 2),), spare_pages=3)
    pool = Pool(np.random.default_rng(5), **kw)
    order = np.random.default_rng(99).permutation(len(pool.k_pages))
    other = Pool(np.random.default_rng(5), order=order, **kw)
    assert not np.array_equal(pool.page_indices, other.page_indices)
    clean = Pool(np.random.default_rng(5), **kw)
    clean.k_pages = np.nan_to_num(clean.k_pages, nan=0.0)
    clean.v_pages = np.nan_to_num(clean.v_pages, nan=0.0)
    for mode, split in MODES:
        a = pool.run(mode=mode, split_tokens=split)
        assert np.array_equal(a, other.run(mode=mode, split_tokens=split))
        assert np.array_equal(a, clean.run(mode=mode, split_tokens=split))
        pool.check(a)


@pytest.mark.parametrize("dtype", [F32, F64])
def test_split_serial_parallel_untiled(dtype, reduced_grid):
    """Serial == parallel at the same pieces (bitwise); key-range parts of several sizes and the single-query kernel
    (tiled=False) agree with them to rounding."""
    P = 4 if reduced_grid else 16
    L, T = (12 * P + 3, 9) if reduced_grid else (1500, 40)
    pool = Pool(np.random.default_rng(8), dtype=dtype, num_kv_heads=1, group=8, head_dim=3 if reduced_grid else 64,
                page_size=P, lengths=(L,), runs=((0, L - T, T),))
    ref = pool.run(mode=1)
    assert np.array_equal(ref, pool.run(mode=2))           # the default pieces (fixed absolute cuts)
    whole = pool.run(mode=1, split_tokens=10 ** 9)
    assert np.array_equal(whole, pool.run(mode=2, split_tokens=10 ** 9))   # one piece per run
    tol = 1e-14 if dtype == F64 else 2e-6
    for split in (1, 7, 64, 130, 1000):
        np.testing.assert_allclose(pool.run(mode=2, split_tokens=split), ref, rtol=tol, atol=tol)
    np.testing.assert_allclose(pool.run(tiled=False), ref, rtol=tol, atol=tol)
    pool.check(ref)


def test_large_scores(reduced_grid):
    """Keys scaled so that scores span hundreds: the softmax is dominated by few keys per row."""
    pool = Pool(np.random.default_rng(12), dtype=F32, num_kv_heads=1, group=4, head_dim=3, page_size=3,
                lengths=(40,), runs=((0, 20, 20),), scale_k=300.0)
    for mode, split in MODES:
        pool.check(pool.run(mode=mode, split_tokens=split))


@pytest.mark.parametrize("head_dim,dtype", [(d, F32) for d in (3, 33, 64, 127, 128, 129)] + [(128, F16), (33, F16)],
                         ids=lambda v: v.name if isinstance(v, np.dtype) else None)
def test_score_magnitudes(head_dim, dtype, reduced_grid):
    """q and K scaled by 10 (|q.k| ~ 10**3 at head_dim 128): prefill and extend runs inside 3x max(NumPy's error,
    the float32-score floor) at page sizes 1-64, groups 1/4/8/32, serial / parallel / split, two seeds. The
    score GEMM accumulates in float32 in chunks of 32 steps of head_dim (`gemm.KCHUNK`); as one FMA chain over
    head_dim per score it passed here but came out 1.3x over on the int8 grid's data
    (tests/decode/test_int8_kernel.py::test_score_magnitudes)."""
    if reduced_grid and (head_dim, dtype) != (33, F32):
        pytest.skip("full grid only")
    T, start = (6, 5) if reduced_grid else (40, 77)
    for P, group, seed in itertools.product((1, 3, 16) if reduced_grid else (1, 3, 16, 64),
                                            (1, 8) if reduced_grid else (1, 4, 8, 32),
                                            (0,) if reduced_grid else (0, 1)):
        rng = np.random.default_rng(head_dim * 1000 + P * 10 + group + 7919 * seed)
        pool = Pool(rng, dtype=dtype, num_kv_heads=1 if group == 32 else 2, group=group, head_dim=head_dim,
                    page_size=P, lengths=(T, start + T), runs=((0, 0, T), (1, start, T)), scale_k=10.0)
        pool.q *= 10
        for mode, split in MODES:
            pool.check(pool.run(mode=mode, split_tokens=split))


def _as_bfloat16(pool):
    """Round the pool's K/V once to bfloat16: returns the (k, v) bit pages (uint16) the kernel reads and leaves the
    pool's pages and dense copies holding their values (the oracle's and the budget's K/V)."""
    kb, vb = naive.bf16_bits(pool.k_pages), naive.bf16_bits(pool.v_pages)
    pool.k_pages, pool.v_pages = naive.bf16_values(kb), naive.bf16_values(vb)
    pool.dense_k = [naive.bf16_values(naive.bf16_bits(k)).astype(np.float64) for k in pool.dense_k]
    pool.dense_v = [naive.bf16_values(naive.bf16_bits(v)).astype(np.float64) for v in pool.dense_v]
    return kb, vb


@pytest.mark.parametrize("head_dim", [33, 128])
def test_score_magnitudes_bfloat16(head_dim, reduced_grid):
    """bfloat16 pages (storage="bfloat16") under the grid of `test_score_magnitudes`: q and K scaled by 10, the
    tiled kernel within `naive.budget` of the float64 oracle on the bfloat16 values."""
    if reduced_grid and head_dim != 33:
        pytest.skip("full grid only")
    T, start = (6, 5) if reduced_grid else (40, 77)
    for P, group, seed in itertools.product((1, 3, 16) if reduced_grid else (1, 3, 16, 64),
                                            (1, 8) if reduced_grid else (1, 4, 8, 32),
                                            (0,) if reduced_grid else (0, 1)):
        rng = np.random.default_rng(head_dim * 1000 + P * 10 + group + 7919 * seed + 23)
        pool = Pool(rng, dtype=F32, num_kv_heads=1 if group == 32 else 2, group=group, head_dim=head_dim,
                    page_size=P, lengths=(T, start + T), runs=((0, 0, T), (1, start, T)), scale_k=10.0)
        pool.q *= 10
        kb, vb = _as_bfloat16(pool)
        for mode, split in MODES:
            out = np.empty((len(pool.q), pool.q.shape[1], vb.shape[3]), np.float32)
            pool.check(attend_unchecked(pool.q, kb, vb, *pool.args()[3:], pool.scale, pool.window, out, mode=mode,
                                        split_tokens=split, storage="bfloat16"))


def test_deterministic(reduced_grid):
    pool = Pool(np.random.default_rng(14), dtype=F32, num_kv_heads=2, group=4, head_dim=3 if reduced_grid else 64,
                page_size=4, lengths=(90,), runs=((0, 30, 60),))
    for mode, split in MODES:
        first = pool.run(mode=mode, split_tokens=split)
        for _ in range(3):
            assert np.array_equal(pool.run(mode=mode, split_tokens=split), first)
