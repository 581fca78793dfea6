"""The paged decode-attention kernels (`decode.kernels` through `decode.attention`) against a naive oracle.

Accuracy contract, per storage dtype (`TOL`): |out - oracle| <= atol + rtol * |oracle| + factor * err_numpy, where
the oracle is float64 NumPy on the stored values (float16 K/V widened exactly) and err_numpy is the max error of
the same plain NumPy computation in float32 (the working precision). float64: 1e-13 absolute on O(1) data.

Every test is marked `kernel`; CI reruns `-m kernel --reduced-grid` with NUMBA_DISABLE_JIT=1 and with
NUMBA_BOUNDSCHECK=1, so the reduced grid stays small enough for pure Python.
"""
import hashlib
import importlib.util
import itertools
import math
from pathlib import Path

import numpy as np
import pytest

from decode import attention_plan as AP
from decode.attention import paged_decode_attention
from decode.attention_plan import attend_unchecked

_spec = importlib.util.spec_from_file_location("decode_kernel_naive", Path(__file__).with_name("naive.py"))
naive = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(naive)

pytestmark = pytest.mark.kernel

F16, F32, F64 = np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64)
#        atol    rtol   factor on the float32 NumPy error
TOL = {F16: (1e-6, 0.0, 3.0), F32: (1e-6, 0.0, 3.0), F64: (1e-13, 1e-13, 0.0)}


# ------------------------------------------------------------------------------------------------------------
# scenes: a pool of pages, CSR page table in random physical order, queries
# ------------------------------------------------------------------------------------------------------------
class Scene:
    def __init__(self, rng, *, dtype=F32, num_kv_heads=2, group=2, head_dim=8, head_dim_v=None, page_size=4,
                 lengths=(5,), queries=None, window=0, spare_pages=3, reserve=0, q_dtype=None, nan_fill=False,
                 values=None):
        dtype = np.dtype(dtype)
        head_dim_v = head_dim if head_dim_v is None else head_dim_v
        P = page_size
        if queries is None:                      # one query per sequence at its last position
            queries = [(s, L - 1) for s, L in enumerate(lengths)]
        self.queries = queries
        npp = [-(-L // P) + reserve for L in lengths]
        num_pages = sum(npp) + spare_pages
        phys = rng.permutation(num_pages)
        self.page_indptr = np.zeros(len(lengths) + 1, dtype=np.int64)
        self.page_indptr[1:] = np.cumsum(npp)
        self.page_indices = phys[:sum(npp)].astype(np.int32)
        shape_k = (num_pages, num_kv_heads, P, head_dim)
        shape_v = (num_pages, num_kv_heads, P, head_dim_v)
        if values is None:
            self.k_pages = rng.standard_normal(shape_k).astype(dtype)
            self.v_pages = rng.standard_normal(shape_v).astype(dtype)
        else:
            self.k_pages, self.v_pages = values(shape_k, shape_v)
        self.query_seq = np.array([s for s, _ in queries], dtype=np.int32)
        self.query_pos = np.array([p for _, p in queries], dtype=np.int64)
        self.window = window
        # sliding window: pages wholly before every query's window of a sequence are freed (-1)
        if window:
            for s in range(len(lengths)):
                ps = [p for (qs, p) in queries if qs == s]
                if not ps:
                    continue
                first_visible = min(naive.visible(p, window) for p in ps)
                row = self.page_indices[self.page_indptr[s]:self.page_indptr[s + 1]]
                for j in range(first_visible // P):
                    if nan_fill:
                        self.k_pages[row[j]] = np.nan
                        self.v_pages[row[j]] = np.nan
                    row[j] = -1
        if nan_fill:   # every slot no query may read: unused slots, reserved pages, unreferenced pages
            used = np.zeros((num_pages, P), dtype=bool)
            for s, L in enumerate(lengths):
                row = self.page_indices[self.page_indptr[s]:self.page_indptr[s + 1]]
                for t in range(L):
                    if row[t // P] >= 0:
                        used[row[t // P], t % P] = True
            mask = ~used[:, None, :, None]
            self.k_pages = np.where(mask, np.nan, self.k_pages).astype(dtype)
            self.v_pages = np.where(mask, np.nan, self.v_pages).astype(dtype)
        qd = q_dtype or (F64 if dtype == F64 else F32)
        self.q = rng.standard_normal((len(queries), num_kv_heads * group, head_dim)).astype(qd)
        self.scale = 1.0 / math.sqrt(head_dim)
        self.dtype = dtype

    def args(self):
        return (self.q, self.k_pages, self.v_pages, self.page_indices, self.page_indptr, self.query_seq,
                self.query_pos)

    def run(self, mode=0, split_tokens=0, scale=None):
        """The single-query kernel on every query (tiled=False: runs of queries are not routed to the
        multi-query kernel, which tests/decode/test_multiquery.py covers)."""
        scale = self.scale if scale is None else scale
        out = np.empty((len(self.q), self.q.shape[1], self.v_pages.shape[3]),
                       dtype=F64 if self.dtype == F64 else F32)
        q = self.q.astype(out.dtype)
        return attend_unchecked(q, *self.args()[1:], scale, self.window, out, mode=mode,
                                                 split_tokens=split_tokens, tiled=False)

    def reference(self, dtype=np.float64, scale=None):
        scale = self.scale if scale is None else scale
        return naive.decode(*self.args(), scale, self.window, dtype=dtype)

    def expected(self, scale=None):
        """(float64 oracle, allowed error), computed once per content of the scene: a scene is checked against
        several kernel runs (modes, splits), and the oracle plus its budget (four NumPy / torch oracles) cost far
        more than a kernel run. The key is a digest of every input, so a scene changed in place is recomputed."""
        digest = hashlib.blake2b(repr((scale, self.window, self.scale)).encode())
        for a in self.args():
            digest.update(repr((a.dtype.str, a.shape)).encode())
            digest.update(np.ascontiguousarray(a).view(np.uint8).data)
        key = digest.hexdigest()
        if getattr(self, "_expected", (None,))[0] != key:
            ref = self.reference(scale=scale)
            atol, rtol, factor = TOL[self.dtype]
            allowed = atol + rtol * np.abs(ref)
            if factor:
                allowed = naive.budget(*self.args(), self.scale if scale is None else scale, self.window, ref=ref)
            self._expected = (key, ref, allowed)
        return self._expected[1:]

    def check(self, out, scale=None):
        """Within the float32 budget of the float64 oracle (`naive.budget`; float64 storage: 1e-13)."""
        ref, allowed = self.expected(scale)
        assert out.shape == ref.shape
        assert out.dtype == (F64 if self.dtype == F64 else F32)
        err = np.abs(out - ref)
        assert np.isfinite(out).all()
        assert (err <= allowed).all(), f"max error {err.max():.3g}, allowed {np.min(allowed):.3g}..{np.max(allowed):.3g}"


def boundary_lengths(P):
    return sorted({L for L in (P - 1, P, P + 1, 2 * P + 1) if L >= 1})


def _grid(reduced):
    """(head_dim, group, page_size, dtype): the product for float32, a diagonal for float16 / float64."""
    tails = [(33, 4, 3, F32), (32, 1, 16, F16), (40, 4, 5, F64)]   # vector part + scalar tail of head_dim
    if reduced:
        return [(3, 1, 3, F32), (1, 4, 1, F16), (4, 2, 16, F64), (3, 8, 3, F32)] + tails
    dims, groups, pages = (1, 3, 64, 128), (1, 4, 8, 32), (1, 3, 16, 64)
    grid = [(d, g, p, F32) for d, g, p in itertools.product(dims, groups, pages)]
    for n, (d, g, p) in enumerate(itertools.product(dims, groups, pages)):
        if n % 3 == 0:
            grid.append((d, g, p, F16))
        if n % 5 == 0:
            grid.append((d, g, p, F64))
    return grid + tails + [(48, 8, 16, F16), (96, 32, 64, F32)]


def pytest_generate_tests(metafunc):
    reduced = metafunc.config.getoption("--reduced-grid")
    if "grid_case" in metafunc.fixturenames:
        metafunc.parametrize("grid_case", _grid(reduced),
                             ids=lambda c: f"d{c[0]}-g{c[1]}-P{c[2]}-{c[3].name}")


# ------------------------------------------------------------------------------------------------------------
# accuracy
# ------------------------------------------------------------------------------------------------------------
def test_grid(grid_case):
    """Head dims x GQA ratios x page sizes; lengths P-1, P, P+1, 2P+1 as sequences of one call."""
    head_dim, group, P, dtype = grid_case
    rng = np.random.default_rng(head_dim * 10000 + group * 100 + P + 7 * dtype.itemsize)
    num_kv_heads = 2 if group < 32 else 1
    scene = Scene(rng, dtype=dtype, num_kv_heads=num_kv_heads, group=group, head_dim=head_dim, page_size=P,
                  lengths=boundary_lengths(P))
    for mode in (1, 2):
        scene.check(scene.run(mode=mode))
    scene.check(paged_decode_attention(*scene.args(), scale=scene.scale))


@pytest.mark.parametrize("dtype", [F32, F16, F64])
@pytest.mark.parametrize("P,group,head_dim", [(16, 1, 64), (64, 8, 128), (3, 4, 3)])
def test_long(dtype, P, group, head_dim, reduced_grid):
    """Contexts beyond 4096 tokens, serial, parallel (auto split) and forced split-K."""
    if reduced_grid:
        if (P, group) != (3, 4) or dtype == F64:
            pytest.skip("full grid only")
        head_dim = 2
    rng = np.random.default_rng(7)
    scene = Scene(rng, dtype=dtype, num_kv_heads=1 if group == 8 else 2, group=group, head_dim=head_dim,
                  head_dim_v=head_dim + 1, page_size=P, lengths=[4097, 4200 + P])
    for mode, split in ((1, 0), (2, 0), (2, 1), (2, 300)):
        scene.check(scene.run(mode=mode, split_tokens=split))


MAGNITUDE_DIMS = (1, 2, 3, 5, 33, 64, 127, 128, 129)


@pytest.mark.parametrize("head_dim,magnitude,dtype",
                         [(d, m, F32) for d in MAGNITUDE_DIMS for m in (1.0, 3.0, 10.0)]
                         + [(d, 10.0, F16) for d in (3, 33, 128, 129)],
                         ids=lambda v: v.name if isinstance(v, np.dtype) else None)
def test_score_magnitudes(head_dim, magnitude, dtype, reduced_grid):
    """float32 (and float16 storage) inside the budget at every page size with q and K scaled up (|q.k| up to
    ~500 at head_dim 3, ~1000 * 3 sigma at 128, where rounding a score to float32 moves a weight by up to
    ~|q.k| * 2**-24 * scale): head_dim 1-3 and 5 (all of the dot product in the float64 tail), 64 and 128
    (vector part only), 33, 127, 129 (vector part plus tail), page sizes 1-64, groups 1/4/8/32, serial,
    parallel, split; two seeds at magnitude 10.

    At magnitude 10 NumPy's own float32 error is luck: when two top scores nearly tie, its rounding of both can
    cancel, leaving it below the floor of ANY computation that holds float32 scores (the oracle with its q.k
    rounded once to float32). The budget (`naive.budget`) is therefore 1e-6 + 3x max(NumPy, torch SDPA,
    sqrt(head_dim) x that floor): a float32 dot product of head_dim terms carries ~sqrt(head_dim) roundings."""
    if reduced_grid and ((head_dim, magnitude) not in ((3, 1.0), (3, 10.0), (33, 1.0), (33, 10.0), (129, 10.0))
                         or dtype == F16 and head_dim != 33):
        pytest.skip("full grid only")
    pages = (1, 3, 16) if reduced_grid else (1, 2, 3, 4, 16, 64)
    seeds = (0, 1) if magnitude > 3.0 and not reduced_grid else (0,)
    for P, group, seed in itertools.product(pages, (1, 8) if reduced_grid else (1, 4, 8, 32), seeds):
        rng = np.random.default_rng(int(head_dim * 1000 + P * 10 + group + magnitude * 7) + 7919 * seed)
        scene = Scene(rng, dtype=dtype, num_kv_heads=1 if group == 32 else 2, group=group, head_dim=head_dim,
                      page_size=P, lengths=[1, P, 2 * P + 1, 70] if reduced_grid else [1, P, 2 * P + 1, 70, 300],
                      values=None if dtype == F32 else _scaled_values(rng, dtype, magnitude))
        scene.q *= magnitude
        if dtype == F32:
            scene.k_pages *= magnitude
        for mode, split in ((1, 0), (2, 0), (2, 64)):
            scene.check(scene.run(mode=mode, split_tokens=split))


@pytest.mark.parametrize("head_dim", [3, 33, 128, 129])
def test_score_magnitudes_bfloat16(head_dim, reduced_grid):
    """bfloat16 pages (storage="bfloat16", uint16 bits) under the magnitude grid of float16: K ~ 10 N(0, 1) and
    V ~ N(0, 1) rounded once to bfloat16, q scaled by 10 (|q.k| ~ 10**3 at head_dim 128); the per-query kernel
    serial, parallel and split within `naive.budget` of the float64 oracle on the bfloat16 values."""
    if reduced_grid and head_dim != 33:
        pytest.skip("full grid only")
    pages = (1, 3, 16) if reduced_grid else (1, 2, 3, 4, 16, 64)
    for P, group, seed in itertools.product(pages, (1, 8) if reduced_grid else (1, 4, 8, 32),
                                            (0,) if reduced_grid else (0, 1)):
        rng = np.random.default_rng(int(head_dim * 1000 + P * 10 + group) + 7919 * seed + 17)
        scene = Scene(rng, dtype=F32, num_kv_heads=1 if group == 32 else 2, group=group, head_dim=head_dim,
                      page_size=P, lengths=[1, P, 2 * P + 1, 70] if reduced_grid else [1, P, 2 * P + 1, 70, 300],
                      values=_scaled_values(rng, F32, 10.0))
        scene.q *= 10.0
        kb, vb = _to_bf16_bits(scene.k_pages), _to_bf16_bits(scene.v_pages)
        scene.k_pages, scene.v_pages = _bf16_values(kb), _bf16_values(vb)     # the oracle's K/V
        args = scene.args()
        for mode, split in ((1, 0), (2, 0), (2, 64)):
            out = np.empty((len(scene.q), scene.q.shape[1], vb.shape[3]), F32)
            scene.check(attend_unchecked(scene.q, kb, vb, *args[3:], scene.scale, 0, out, mode=mode,
                                         split_tokens=split, tiled=False, storage="bfloat16"))


def _scaled_values(rng, dtype, magnitude):
    """K ~ magnitude * N(0, 1) and V ~ N(0, 1), rounded once to the storage dtype."""
    def values(shape_k, shape_v):
        return ((magnitude * rng.standard_normal(shape_k)).astype(dtype), rng.standard_normal(shape_v).astype(dtype))
    return values


@pytest.mark.parametrize("dtype", [F32, F16, F64])
def test_extend_queries(dtype, reduced_grid):
    """Several queries of one sequence (extend of T tokens: positions start..start+T-1), T = 1..3P."""
    rng = np.random.default_rng(11)
    P = 4 if reduced_grid else 16
    for T in ([1, P, 3 * P] if reduced_grid else [1, 2, P - 1, P, P + 1, 2 * P, 3 * P]):
        start = int(rng.integers(0, 3 * P))
        L = start + T
        queries = [(0, start + i) for i in range(T)]
        scene = Scene(rng, dtype=dtype, num_kv_heads=2, group=4, head_dim=5 if reduced_grid else 64,
                      page_size=P, lengths=[L], queries=queries, reserve=1)
        for mode in (1, 2):
            scene.check(scene.run(mode=mode))
        scene.check(paged_decode_attention(*scene.args()))


@pytest.mark.parametrize("dtype", [F32, F16, F64])
def test_mixed_sequences(dtype, reduced_grid):
    """Sequences of mixed lengths, batched single queries and extend queries in one call, reserved pages."""
    rng = np.random.default_rng(13)
    P = 3 if reduced_grid else 16
    lengths = [1, P, 2 * P + 1, 5 * P + 2, 7] if reduced_grid else [1, 15, 16, 17, 100, 333, 1000, 40]
    queries = [(s, L - 1) for s, L in enumerate(lengths)] + [(3, lengths[3] - 2), (3, lengths[3] - 7)]
    rng.shuffle(queries)
    scene = Scene(rng, dtype=dtype, num_kv_heads=4, group=2, head_dim=4 if reduced_grid else 32,
                  head_dim_v=6 if reduced_grid else 48, page_size=P, lengths=lengths, queries=queries, reserve=2)
    for mode, split in ((1, 0), (2, 0), (2, 1)):
        scene.check(scene.run(mode=mode, split_tokens=split))


@pytest.mark.parametrize("dtype", [F32, F16, F64])
def test_sliding_window(dtype, reduced_grid):
    """window > 0: keys lo..p only; fully-out-of-window pages are -1 (and NaN in the pool)."""
    rng = np.random.default_rng(17)
    P = 4 if reduced_grid else 16
    for window in ([1, P, 2 * P + 1] if reduced_grid else [1, 2, P - 1, P, P + 1, 3 * P + 5, 100]):
        lengths = [3 * P + 2, 2 * P, 1, 6 * P + 1]
        queries = [(s, L - 1) for s, L in enumerate(lengths)] + [(3, 6 * P - 1)]
        scene = Scene(rng, dtype=dtype, num_kv_heads=2, group=4, head_dim=3 if reduced_grid else 64,
                      page_size=P, lengths=lengths, queries=queries, window=window, nan_fill=True)
        assert (scene.page_indices < 0).any() or window > 5 * P
        for mode, split in ((1, 0), (2, 0), (2, 1)):
            scene.check(scene.run(mode=mode, split_tokens=split))
        scene.check(paged_decode_attention(*scene.args(), window=window))


@pytest.mark.parametrize("dtype", [F32, F16, F64])
def test_unused_slots_nan(dtype, reduced_grid):
    """Unused slots, reserved pages and unreferenced pages hold NaN: the result is bitwise unchanged."""
    P = 4 if reduced_grid else 16
    kw = dict(dtype=dtype, num_kv_heads=2, group=4, head_dim=3 if reduced_grid else 64, page_size=P,
              lengths=[P + 1, 3 * P - 1, 1], reserve=1, spare_pages=4)
    clean = Scene(np.random.default_rng(19), **kw)
    dirty = Scene(np.random.default_rng(19), nan_fill=True, **kw)
    assert np.isnan(dirty.k_pages).any() and np.isnan(dirty.v_pages).any()
    for mode, split in ((1, 0), (2, 0), (2, 1)):
        a, b = clean.run(mode=mode, split_tokens=split), dirty.run(mode=mode, split_tokens=split)
        assert np.array_equal(a, b)
        clean.check(a)


@pytest.mark.parametrize("mode,split", [(1, 0), (2, 0), (2, 1)])
def test_deterministic(mode, split, reduced_grid):
    """Bitwise identical on 100 reruns (serial, parallel, parallel with split-K)."""
    rng = np.random.default_rng(23)
    scene = Scene(rng, dtype=F32, num_kv_heads=2, group=4, head_dim=3 if reduced_grid else 64,
                  page_size=4 if reduced_grid else 16, lengths=[70, 9, 130] if reduced_grid else [700, 9, 1300])
    first = scene.run(mode=mode, split_tokens=split)
    for _ in range(5 if reduced_grid else 100):
        assert np.array_equal(scene.run(mode=mode, split_tokens=split), first)


@pytest.mark.parametrize("dtype", [F32, F16, F64])
def test_split_matches_unsplit(dtype, reduced_grid):
    """Flash-decoding splits (forced, several sizes) agree with the single-pass serial result."""
    rng = np.random.default_rng(29)
    P = 4 if reduced_grid else 16
    scene = Scene(rng, dtype=dtype, num_kv_heads=1, group=8, head_dim=3 if reduced_grid else 64, page_size=P,
                  lengths=[10 * P + 3, 3] if reduced_grid else [3000, 3])
    ref = scene.run(mode=1)
    tol = 1e-14 if dtype == F64 else 2e-6
    for split in (1, 64, 130, 256, 1000):
        out = scene.run(mode=2, split_tokens=split)
        np.testing.assert_allclose(out, ref, rtol=tol, atol=tol)


def _integer_values(lo, hi, dtype):
    rng = np.random.default_rng(31)

    def values(shape_k, shape_v):
        return (rng.integers(lo, hi, size=shape_k).astype(dtype), rng.integers(-8, 9, size=shape_v).astype(dtype))
    return values


@pytest.mark.parametrize("dtype", [F32, F16, F64])
def test_huge_scores(dtype, reduced_grid):
    """q.k up to ~4e5 (exact integers, scale 1): no overflow, softmax of the exact scores."""
    rng = np.random.default_rng(37)
    P = 4 if reduced_grid else 16
    scene = Scene(rng, dtype=dtype, num_kv_heads=1, group=4, head_dim=16, page_size=P,
                  lengths=[5 * P + 1, 2], values=_integer_values(-2000, 2001, dtype))
    scene.q = rng.integers(-20, 21, size=scene.q.shape).astype(scene.q.dtype)
    scores = np.einsum("hd,nhkd->nk", scene.q[0, :1], scene.k_pages[:, :1].astype(np.float64))
    assert np.abs(scores).max() > 1e5
    for mode, split in ((1, 0), (2, 1)):
        out = scene.run(mode=mode, split_tokens=split, scale=1.0)
        scene.check(out, scale=1.0)


@pytest.mark.parametrize("dtype", [F32, F16, F64])
def test_very_negative_scores(dtype, reduced_grid):
    """All scores near -5e5 (exact): -5e5 next to -5e5 weighs equally, -5e5 + r weighs exp(r)."""
    rng = np.random.default_rng(41)
    P = 4 if reduced_grid else 16

    def values(shape_k, shape_v):
        k = np.zeros(shape_k)
        k[..., 0] = -1000.0
        k[..., 1] = rng.integers(-3, 4, size=shape_k[:-1])
        return k.astype(dtype), rng.standard_normal(shape_v).astype(dtype)
    scene = Scene(rng, dtype=dtype, num_kv_heads=1, group=2, head_dim=4, page_size=P, lengths=[3 * P + 1, 5],
                  values=values)
    scene.q[:] = 0
    scene.q[:, :, 0] = 500.0
    scene.q[:, 1, 1] = 1.0      # head 1: scores -5e5 + r; head 0: all exactly -5e5
    for mode, split in ((1, 0), (2, 1)):
        out = scene.run(mode=mode, split_tokens=split, scale=1.0)
        scene.check(out, scale=1.0)
        # head 0 is the plain mean of V over the visible positions
        V = naive.gather(scene.v_pages, scene.page_indices, scene.page_indptr, 0, 3 * P + 1).astype(np.float64)
        np.testing.assert_allclose(out[0, 0], V[:, 0].mean(axis=0), rtol=0,
                                   atol=1e-13 if dtype == F64 else 1e-6)


def test_float16_conversion_exact():
    """Every finite float16 bit pattern (subnormals included) widens exactly: V rows of a one-key attention
    come back unchanged."""
    bits = np.arange(1 << 16, dtype=np.uint16)
    halves = bits.view(np.float16)
    vals = halves[np.isfinite(halves)]
    n = len(vals)
    dim = 1024
    rows = -(-n // dim)
    v = np.zeros(rows * dim, dtype=np.float16)
    v[:n] = vals
    v_pages = v.reshape(rows, 1, 1, dim)
    k_pages = np.zeros((rows, 1, 1, 1), dtype=np.float16)
    q = np.zeros((rows, 1, 1), dtype=np.float32)
    out = paged_decode_attention(q, k_pages, v_pages, np.arange(rows, dtype=np.int32),
                                 np.arange(rows + 1, dtype=np.int64), np.arange(rows, dtype=np.int32),
                                 np.zeros(rows, dtype=np.int64))
    assert np.array_equal(out.reshape(-1)[:n], vals.astype(np.float32))


def test_float64_query_on_float32_storage():
    """q float64 on float32 storage is cast to float32; float32 q on float64 storage is widened."""
    rng = np.random.default_rng(43)
    scene = Scene(rng, dtype=F32, lengths=[9, 4])
    out = paged_decode_attention(scene.q.astype(np.float64), *scene.args()[1:])
    assert out.dtype == F32
    scene.check(out)
    scene = Scene(rng, dtype=F64, lengths=[9, 4], q_dtype=F32)
    out = paged_decode_attention(*scene.args())
    assert out.dtype == F64
    scene.check(out)


def test_read_only_query_compiles_nothing_new():
    """A read-only q (Ray's object store hands those to a worker) gives the writeable q's bits, through the
    public call and through the per-query and the tiled kernel, serial and parallel, and compiles no new
    signature of the input check or the kernels (numba types read-only arrays apart)."""
    from decode.kernels.input_check import check_inputs
    from decode.kernels.per_query import query_parallel, query_serial
    from decode.kernels.tiled import tiled_parallel, tiled_serial

    rng = np.random.default_rng(53)
    scene = Scene(rng, lengths=[40, 9], queries=[(0, 30), (0, 31), (0, 32), (0, 33), (1, 8)], group=4)
    assert AP.AttentionPlan(scene.query_seq, scene.query_pos, 0, scene.q.shape, scene.v_pages.shape,
                            F32).tiles is not None                  # the run of four goes to the tiled kernel
    frozen = scene.q.copy()
    frozen.flags.writeable = False
    jitted = (check_inputs, query_serial, query_parallel, tiled_serial, tiled_parallel)

    def compiled():                          # signatures so far (plain functions under NUMBA_DISABLE_JIT: none)
        return [len(getattr(f, "signatures", ())) for f in jitted]

    def kernels(q, mode):                    # the unchecked path, serial (1) or parallel (2)
        out = np.empty((len(q), q.shape[1], scene.v_pages.shape[3]), np.float32)
        return attend_unchecked(q, *scene.args()[1:], scene.scale, 0, out, mode=mode)

    calls = [lambda q: paged_decode_attention(q, *scene.args()[1:]), lambda q: kernels(q, 1), lambda q: kernels(q, 2)]
    for call in calls:
        expected = call(scene.q)
        before = compiled()
        assert np.array_equal(call(frozen), expected)
        assert compiled() == before
    scene.check(calls[0](frozen))


def test_out_argument_and_empty():
    rng = np.random.default_rng(47)
    scene = Scene(rng, lengths=[9, 4])
    out = np.full((2, 4, 8), np.nan, dtype=np.float32)
    res = paged_decode_attention(*scene.args(), out=out)
    assert res is out
    scene.check(out)
    empty = paged_decode_attention(scene.q[:0], *scene.args()[1:5], scene.query_seq[:0], scene.query_pos[:0])
    assert empty.shape == (0, 4, 8)


# ------------------------------------------------------------------------------------------------------------
# validation: (mutation, exception type, message fragment)
# ------------------------------------------------------------------------------------------------------------
def _base():
    scene = Scene(np.random.default_rng(53), num_kv_heads=2, group=2, head_dim=8, page_size=4, lengths=[9, 4])
    return dict(q=scene.q, k_pages=scene.k_pages, v_pages=scene.v_pages, page_indices=scene.page_indices,
                page_indptr=scene.page_indptr, query_seq=scene.query_seq, query_pos=scene.query_pos)


def _with(**changes):
    def make():
        kw = _base()
        for key, f in changes.items():
            kw[key] = f(kw[key]) if callable(f) else f
        return kw
    return make


def _nan_at(x, idx):
    x = x.copy()
    x[idx] = np.nan
    return x


def _set(x, idx, val):
    x = x.copy()
    x[idx] = val
    return x


BAD = [
    ("q int", _with(q=lambda q: q.astype(np.int32)), TypeError, "q: expected a float32 or float64 array"),
    ("q bool", _with(q=lambda q: q > 0), TypeError, "q: expected"),
    ("q complex", _with(q=lambda q: q.astype(np.complex64)), TypeError, "q: expected"),
    ("q object", _with(q=lambda q: q.astype(object)), TypeError, "q: expected"),
    ("q float16", _with(q=lambda q: q.astype(np.float16)), TypeError, "q: expected float32 or float64, got dtype float16"),
    ("q 2-d", _with(q=lambda q: q[0]), ValueError, "q: expected a 3-d array"),
    ("q head_dim", _with(q=lambda q: q[..., :7]), ValueError, "q: expected head_dim 8"),
    ("q heads", _with(q=lambda q: q[:, :3]), ValueError, "q: expected num_q_heads a positive multiple of num_kv_heads=2"),
    ("q nan", _with(q=lambda q: _nan_at(q, (1, 2, 3))), ValueError, "q: expected finite values, got nan at index (1, 2, 3)"),
    ("q inf", _with(q=lambda q: _set(q, (0, 0, 0), np.inf)), ValueError, "at index (0, 0, 0)"),
    ("k list", _with(k_pages=lambda k: k.tolist()), TypeError, "k_pages: expected a numpy array, got list"),
    ("k int", _with(k_pages=lambda k: k.astype(np.int16)), TypeError, "k_pages: expected float16, float32, float64 or int8"),
    ("k bool", _with(k_pages=lambda k: k > 0), TypeError, "k_pages: expected float16"),
    ("k 3-d", _with(k_pages=lambda k: k[0]), ValueError, "k_pages: expected a 4-d array"),
    ("k strided", _with(k_pages=lambda k: k[:, :, :, ::2]), ValueError, "k_pages: expected a C-contiguous array"),
    ("v dtype", _with(v_pages=lambda v: v.astype(np.float64)), TypeError, "v_pages: expected dtype float32 (as k_pages)"),
    ("v shape", _with(v_pages=lambda v: np.ascontiguousarray(v[:, :1])), ValueError, "v_pages: expected shape"),
    ("indices float", _with(page_indices=lambda x: x.astype(np.float32)), TypeError, "page_indices: expected an integer array"),
    ("indices 2-d", _with(page_indices=lambda x: x[None]), ValueError, "page_indices: expected a 1-d array"),
    ("indices high", _with(page_indices=lambda x: _set(x, 1, 999)), ValueError, "page_indices: expected physical pages in [0, 7)"),
    ("indices -2", _with(page_indices=lambda x: _set(x, 0, -2)), ValueError, "got -2 at index 0"),
    ("indices freed", _with(page_indices=lambda x: _set(x, 1, -1)), ValueError, "got a freed page (-1)"),
    ("indptr short", _with(page_indptr=lambda x: x[:1]), ValueError, "page_indptr: expected num_seqs + 1 >= 2 entries"),
    ("indptr order", _with(page_indptr=lambda x: x[::-1].copy()), ValueError, "page_indptr: expected non-decreasing"),
    ("indptr beyond", _with(page_indptr=lambda x: x + 1), ValueError, "page_indptr: expected non-decreasing offsets in [0, 4]"),
    ("indptr bool", _with(page_indptr=lambda x: x > 0), TypeError, "page_indptr: expected an integer array"),
    ("seq length", _with(query_seq=lambda x: x[:1]), ValueError, "query_seq: expected 2 entries"),
    ("seq range", _with(query_seq=lambda x: _set(x, 1, 2)), ValueError, "query_seq: expected sequence indices in [0, 2), got 2 at index 1"),
    ("seq float", _with(query_seq=lambda x: x.astype(float)), TypeError, "query_seq: expected an integer array"),
    ("pos length", _with(query_pos=lambda x: x[:1]), ValueError, "query_pos: expected 2 entries"),
    ("pos negative", _with(query_pos=lambda x: _set(x, 0, -1)), ValueError, "query_pos: expected 0 <= position < 12"),
    ("pos capacity", _with(query_pos=lambda x: _set(x, 1, 4)), ValueError, "query_pos: expected 0 <= position < 4 (the page capacity of sequence 1), got 4 at index 1"),
    ("pos float", _with(query_pos=lambda x: x.astype(np.float64)), TypeError, "query_pos: expected an integer array"),
]


@pytest.mark.parametrize("name,make,exc,msg", BAD, ids=[b[0] for b in BAD])
def test_rejects(name, make, exc, msg):
    kw = make()
    with pytest.raises(exc) as info:
        paged_decode_attention(**kw)
    assert msg in str(info.value)


@pytest.mark.parametrize("kwargs,exc,msg", [
    (dict(scale=0.0), ValueError, "scale: expected a finite float > 0, got 0.0"),
    (dict(scale=float("nan")), ValueError, "scale: expected a finite float > 0"),
    (dict(scale="1"), TypeError, "scale: expected a float, got str"),
    (dict(scale=True), TypeError, "scale: expected a float, got bool"),
    (dict(window=-1), ValueError, "window: expected an int >= 0"),
    (dict(window=1.5), TypeError, "window: expected an int, got float"),
    (dict(out=np.empty((2, 4, 8), np.float64)), TypeError, "out: expected dtype float32, got float64"),
    (dict(out=np.empty((2, 4, 9), np.float32)), ValueError, "out: expected shape (2, 4, 8), got (2, 4, 9)"),
    (dict(out=np.empty((2, 4, 16), np.float32)[..., ::2]), ValueError, "out: expected a writeable C-contiguous"),
    (dict(out=[0.0]), TypeError, "out: expected a numpy array, got list"),
], ids=["scale0", "scale-nan", "scale-str", "scale-bool", "window-neg", "window-float", "out-dtype",
        "out-shape", "out-strided", "out-list"])
def test_rejects_options(kwargs, exc, msg):
    with pytest.raises(exc) as info:
        paged_decode_attention(**_base(), **kwargs)
    assert msg in str(info.value)


def test_window_freed_page_rejected_only_when_visible():
    """A -1 entry is fine while it lies wholly before the window, an error once the window reaches it."""
    kw = _base()
    kw["page_indices"] = _set(kw["page_indices"], 0, -1)   # sequence 0, logical page 0 (positions 0..3)
    kw["query_pos"] = np.array([8, 3], dtype=np.int64)
    out = paged_decode_attention(**kw, window=5)              # lo = 4
    assert np.isfinite(out).all()
    with pytest.raises(ValueError, match="got a freed page"):
        paged_decode_attention(**kw, window=6)                # lo = 3


def test_checks_before_computing():
    """A rejected call leaves `out` untouched."""
    kw = _base()
    out = np.full((2, 4, 8), 7.0, dtype=np.float32)
    kw["query_pos"] = _set(kw["query_pos"], 1, 99)
    with pytest.raises(ValueError):
        paged_decode_attention(**kw, out=out)
    assert (out == 7.0).all()


def test_cache_dir_fallback(monkeypatch, tmp_path):
    """A read-only package directory and no NUMBA_CACHE_DIR: the numba cache goes to a per-user directory
    (XDG_CACHE_HOME), or to the temp directory when that is not writable either."""
    from numba.core import config
    from decode.kernels import cachedir as K
    monkeypatch.setattr(config, "CACHE_DIR", config.CACHE_DIR)
    monkeypatch.delenv("NUMBA_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    real = K.writable_dir
    monkeypatch.setattr(K, "writable_dir", lambda path: "__pycache__" not in path and real(path))
    chosen = K.configure_cache_dir()
    assert chosen == str(tmp_path / "xdg" / "pagedkv" / "numba")
    assert config.CACHE_DIR == chosen and K.os.environ["NUMBA_CACHE_DIR"] == chosen
    monkeypatch.delenv("NUMBA_CACHE_DIR")
    monkeypatch.setattr(K, "writable_dir", lambda path: "__pycache__" not in path and "xdg" not in path
                        and real(path))
    chosen = K.configure_cache_dir()
    assert chosen is not None and "pagedkv-numba" in chosen and config.CACHE_DIR == chosen
    monkeypatch.setenv("NUMBA_CACHE_DIR", "/somewhere")          # an explicit setting always wins
    assert K.configure_cache_dir() is None


def test_thresholds_are_sane():
    assert AP.SERIAL_WORK > 0 and AP.SPLIT_TOKENS >= AP.BLOCK_TOKENS
    assert AP.TILED_SPLIT % AP.TILE_BLOCK == 0


# ------------------------------------------------------------------------------------------------------------
# bfloat16 pages (uint16 bits, widened by a 16-bit shift)
# ------------------------------------------------------------------------------------------------------------
_to_bf16_bits, _bf16_values = naive.bf16_bits, naive.bf16_values


@pytest.mark.parametrize("head_dim,group,P", [(1, 1, 1), (33, 4, 3), (64, 8, 16), (40, 2, 5), (128, 32, 16)])
def test_bfloat16_pages(head_dim, group, P, reduced_grid):
    """storage="bfloat16": uint16 pages of bfloat16 bits read directly by the per-query kernel (serial, parallel,
    split) and the tiled kernel (runs), within the float32 budget of the float64 oracle on the dequantized K/V."""
    if reduced_grid and head_dim == 128:
        pytest.skip("full grid only")
    rng = np.random.default_rng(head_dim * 100 + group + P)
    kv = 1 if group == 32 else 2
    scene = Scene(rng, dtype=F32, num_kv_heads=kv, group=group, head_dim=head_dim, page_size=P,
                  lengths=[1, P + 1, 70, 300], queries=[(0, 0), (1, P), (2, 69)] + [(3, t) for t in range(290, 300)])
    kb, vb = _to_bf16_bits(scene.k_pages), _to_bf16_bits(scene.v_pages)
    scene.k_pages, scene.v_pages = _bf16_values(kb), _bf16_values(vb)     # the oracle's (dequantized) K/V
    args = scene.args()
    ref = naive.decode(*args, scene.scale, 0)
    allowed = naive.budget(*args, scene.scale, 0, ref=ref)
    out = paged_decode_attention(scene.q, kb, vb, *args[3:], storage="bfloat16")
    assert np.abs(out - ref).max() <= allowed
    for mode, split in ((1, 0), (2, 0), (2, 64)):
        got = attend_unchecked(scene.q, kb, vb, *args[3:], scene.scale, 0, np.empty_like(out), mode=mode,
                               split_tokens=split, storage="bfloat16")
        assert np.abs(got - ref).max() <= allowed
    with pytest.raises(TypeError, match="storage='bfloat16'"):
        paged_decode_attention(scene.q, kb, vb, *args[3:])
    with pytest.raises(TypeError, match="uint16"):
        paged_decode_attention(*args, storage="bfloat16")


def test_bfloat16_widening_exact(reduced_grid):
    """The kernel's bfloat16 load widens finite bit patterns exactly (subnormals, signed zeros, extremes): one
    key per sequence, so each output is its value row times weight 1."""
    bits = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    bits = np.ascontiguousarray(bits[np.isfinite(_bf16_values(bits))][:: 97 if reduced_grid else 7])
    n = len(bits)
    v = bits.reshape(n, 1, 1, 1)
    k = np.zeros_like(v)
    out = paged_decode_attention(np.ones((n, 1, 1), np.float32), k, v, np.arange(n, dtype=np.int32),
                                 np.arange(n + 1), np.arange(n, dtype=np.int32), np.zeros(n, np.int64),
                                 storage="bfloat16")
    assert np.array_equal(out.reshape(-1), _bf16_values(bits))             # (-0.0 comes out as 0.0)
