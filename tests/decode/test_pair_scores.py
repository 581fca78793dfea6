"""The tiled kernel's scores over bfloat16 pairs (`decode.kernels.pair_scores`, `gemm.gemm_strip_bf`): the register
block against its NumPy twin and its shift-and-FMA emulation (bit for bit) and against the float64 products; a
tile's q packed only when exactly bfloat16; prefill / extend runs of a bfloat16 q over bfloat16 pages within the
float32 budget of the float64 oracle (`naive.budget`) at every page size, group, head_dim, window and thread
split, at |q.k| ~ 10**3 too; the path taken where it applies and not elsewhere, and a sequence's bits
independent of the other queries of the call.

Marked `kernel` (rerun under NUMBA_DISABLE_JIT=1 and NUMBA_BOUNDSCHECK=1 with --reduced-grid)."""
import importlib.util
import itertools
import math
from pathlib import Path

import numpy as np
import pytest

from decode.attention_plan import attend_runs
from decode.kernels import amx_tiles, bf16_dot, gemm
from decode.kernels.pair_scores import pair_scratch, tile_pairs
from decode.kernels.simd import JIT

_spec = importlib.util.spec_from_file_location("decode_kernel_naive_pairs", Path(__file__).with_name("naive.py"))
naive = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(naive)

pytestmark = pytest.mark.kernel

NAN_BITS = np.uint16(0x7FC0)          # a bfloat16 NaN: in every slot no query may read
MODES = ((1, 0), (2, 0), (2, 5))       # serial, parallel, parallel with key-range parts of 5 tokens


def as_bf16(x):
    """x rounded to bfloat16, as float32 (a bfloat16 model's q)."""
    return naive.bf16_values(naive.bf16_bits(x))


@pytest.fixture
def mode(monkeypatch):
    """Set the mode plans pass to the kernels (0 stays 0 where the CPU has no avx512bf16: `plan_mode`); the AMX
    tiles off (`amx_tiles`: they take every bfloat16 tile where the CPU has them)."""
    monkeypatch.setenv(amx_tiles.ENV, "0")

    def set_mode(m):
        monkeypatch.setattr(bf16_dot, "MODE", m)
    return set_mode


# ------------------------------------------------------------------------------------------------------------
# the register block
# ------------------------------------------------------------------------------------------------------------
def _pairs_of(q):
    """B of `gemm_strip_bf` for the columns q [cols, D] (bfloat16 bits): B[p, 2c + e] = q[c, 2p + e]."""
    cols, D = q.shape
    return np.ascontiguousarray(q.reshape(cols, D // 2, 2).transpose(1, 0, 2).reshape(D // 2, 2 * cols)).view(np.int16)


@pytest.mark.parametrize("D,rows,nv", [(2, 4, 1), (30, 8, 2), (64, 12, 3), (128, 28, 4), (130, 24, 4)])
def test_strip_against_products(D, rows, nv):
    """C = scale * K . q per 32-step chunk of float32 sums, within a float32 sum's bound of the float64 products;
    the column maxima of the rows below imax; the JIT's blocks (6- and 4-row) equal to the NumPy twin's bits."""
    rng = np.random.default_rng(D * 100 + rows)
    k = naive.bf16_bits(rng.standard_normal((rows, D)) * 8)
    q = naive.bf16_bits(rng.standard_normal((nv * 16, D)) * 8)
    flags, sc, imax = gemm.FRESH | gemm.SCALE | gemm.COLMAX, 0.125, rows - 3
    exact = naive.bf16_values(k).astype(np.float64) @ naive.bf16_values(q).astype(np.float64).T * sc
    bound = D * 2.0 ** -23 * (np.abs(naive.bf16_values(k)).astype(np.float64)
                              @ np.abs(naive.bf16_values(q)).astype(np.float64).T) * sc
    results = []
    for strip in (gemm.gemm_strip_bf, _jitted_strip()):        # the NumPy twin, then the JIT's blocks
        C, mx = np.full((rows, nv * 16), np.nan, np.float32), np.full(nv * 16, -1e30, np.float32)
        strip(k.view(np.int16), D, 0, rows, _pairs_of(q), 0, C, D // 2, nv, flags, sc, mx, imax)
        assert (np.abs(C - exact) <= bound).all()
        assert np.array_equal(mx, C[:imax].max(axis=0))
        results.append((C, mx))
    assert np.array_equal(results[0][0], results[1][0]) and np.array_equal(results[0][1], results[1][1])


def _jitted_strip():
    """`gemm_strip_bf` called from jitted code (its IR blocks); without the JIT, the twin again."""
    if not JIT:
        return gemm.gemm_strip_bf
    from numba import njit

    @njit
    def strip(A, a_rs, i0, i1, B, c0, C, nk, nv, init, sc, mx, imax):
        gemm.gemm_strip_bf(A, a_rs, i0, i1, B, c0, C, nk, nv, init, sc, mx, imax)
    return strip


@pytest.mark.skipif(not JIT, reason="the IR blocks exist under the JIT only")
def test_emulated_block_equals_instruction():
    """The shift-and-FMA emulation (machines without avx512bf16) gives the instruction's bits, chunks and
    epilogue included; where the CPU lacks the instruction, the kernel's block is the emulation itself."""
    rng = np.random.default_rng(5)
    D = 96
    k = naive.bf16_bits(rng.standard_normal((4, D)) * 100).view(np.int16)
    B = _pairs_of(naive.bf16_bits(rng.standard_normal((16, D)) * 0.01))
    outs = []
    for emulated in (False, True):
        C, mx = np.zeros((4, 16), np.float32), np.full(16, -1e30, np.float32)
        gemm.testing_block_bf(emulated)(k, D, 0, B, 0, C, D // 2, gemm.FRESH | gemm.SCALE | gemm.COLMAX, 0.5, mx, 4)
        outs.append((C, mx))
    assert np.array_equal(outs[0][0], outs[1][0]) and np.array_equal(outs[0][1], outs[1][1])


# ------------------------------------------------------------------------------------------------------------
# the tile's pairs
# ------------------------------------------------------------------------------------------------------------
def test_tile_pairs_packs_only_exact_tiles():
    rng = np.random.default_rng(3)
    D, R, Rp = 6, 5, 16
    QT = np.zeros((D, Rp), np.float32)
    QT[:, :R] = as_bf16(rng.standard_normal((D, R)))
    QP = np.full((D // 2, 2 * Rp), 77, np.int16)
    assert tile_pairs(QT, R, Rp, QP)
    bits = naive.bf16_bits(QT)
    want = bits.reshape(D // 2, 2, Rp).transpose(0, 2, 1).reshape(D // 2, 2 * Rp)
    assert np.array_equal(QP.view(np.uint16), want)
    QT[4, 2] = np.nextafter(QT[4, 2], np.float32(9))           # one low half set: the widened path
    before = QP.copy()
    assert not tile_pairs(QT, R, Rp, QP)
    assert np.array_equal(QP, before)
    QT[4, 2] = as_bf16(QT[4:5, 2])[0]
    QT[1, R + 1] = 0.1                                           # past the tile's R columns: not read
    assert tile_pairs(QT, R, Rp, QP)


@pytest.mark.parametrize("pages,qt,shape", [(np.int16, np.float32, (4, 32)), (np.int16, np.float64, (0, 0)),
                                            (np.uint16, np.float32, (0, 0)), (np.float32, np.float32, (0, 0))])
def test_pair_scratch_only_for_bfloat16_pages_and_float32_scores(pages, qt, shape):
    """QP [D / 2, 2 x columns] for bfloat16 pages (int16 bits) and float32 q.k with an even head_dim, else empty:
    the Python body and (under the JIT) the kernels' overload."""
    scratches = [pair_scratch]
    if JIT:
        from numba import njit
        scratches.append(njit(lambda k, QT, block, dot: pair_scratch(k, QT, block, dot)))
    for scratch in scratches:
        assert scratch(np.zeros((1, 1, 4, 8), pages), np.zeros((8, 16), qt), 32, 1)[0].shape == shape
        assert scratch(np.zeros((1, 1, 4, 7), pages), np.zeros((7, 16), qt), 32, 1)[0].shape == (0, 0)


# ------------------------------------------------------------------------------------------------------------
# the tiled kernel
# ------------------------------------------------------------------------------------------------------------
class Case:
    """Sequences of ``lengths`` tokens in bfloat16 pages in random physical order (unread slots NaN); queries: the
    last ``runs[s]`` tokens of sequence s; q exactly bfloat16 (times ``q_scale``), K times ``k_scale``."""

    def __init__(self, rng, *, D, group, P, lengths, runs, window=0, Hkv=2, q_scale=1.0, k_scale=1.0):
        npp = [-(-L // P) for L in lengths]
        num_pages = sum(npp) + 2
        self.page_indices = rng.permutation(num_pages)[:sum(npp)].astype(np.int32)
        self.page_indptr = np.concatenate([[0], np.cumsum(npp)]).astype(np.int64)
        self.kb = np.full((num_pages, Hkv, P, D), NAN_BITS, np.uint16)
        self.vb = np.full((num_pages, Hkv, P, D), NAN_BITS, np.uint16)
        seq, pos = [], []
        for s, (L, T) in enumerate(zip(lengths, runs)):
            row = self.page_indices[self.page_indptr[s]:self.page_indptr[s + 1]]
            for t in range(L):
                self.kb[row[t // P], :, t % P] = naive.bf16_bits(rng.standard_normal((Hkv, D)) * k_scale)
                self.vb[row[t // P], :, t % P] = naive.bf16_bits(rng.standard_normal((Hkv, D)))
            seq += [s] * T
            pos += list(range(L - T, L))
        self.query_seq, self.query_pos = np.array(seq, np.int32), np.array(pos, np.int64)
        self.q = as_bf16(rng.standard_normal((len(seq), Hkv * group, D)) * q_scale)
        self.scale, self.window = 1.0 / math.sqrt(D), window

    def run(self, q=None, **kw):
        q = self.q if q is None else q
        out = np.full((len(q), q.shape[1], self.vb.shape[3]), np.nan, np.float32)
        rest = attend_runs(q, self.kb, self.vb, self.page_indices, self.page_indptr, self.query_seq, self.query_pos,
                           self.scale, self.window, out, storage="bfloat16", min_run=1, **kw)
        assert len(rest) == 0
        return out

    def check(self, out):
        naive.check_bf16(out, self.q, self.kb, self.vb, self.page_indices, self.page_indptr, self.query_seq,
                         self.query_pos, self.scale, self.window)


def _grid(reduced):
    """(head_dim, group, page_size, window)."""
    if reduced:
        return [(8, 4, 3, 0), (2, 1, 1, 5)]
    grid = itertools.product((2, 8, 64, 128), (1, 4, 8), (1, 3, 16, 64))
    return [(d, g, p, 7 * (n % 2)) for n, (d, g, p) in enumerate(grid) if not (d == 128 and p == 1)]


def pytest_generate_tests(metafunc):
    if "grid_case" in metafunc.fixturenames:
        reduced = metafunc.config.getoption("--reduced-grid")
        metafunc.parametrize("grid_case", _grid(reduced), ids=lambda c: "d%d-g%d-p%d-w%d" % c)


def test_grid(grid_case, reduced_grid, monkeypatch):
    """Prefill and extend runs of a bfloat16 q over bfloat16 pages, serial / parallel / split: within budget; where
    the CPU has AMX tiles, with them (the default) and without (the pairs)."""
    D, group, P, window = grid_case
    rng = np.random.default_rng(D * 1000 + group * 100 + P * 10 + window)
    T = 6 if reduced_grid else 37
    case = Case(rng, D=D, group=group, P=P, lengths=(T, 70 + T), runs=(T, T), window=window)
    for tiles in ("", "0") if amx_tiles.usable() else ("",):
        monkeypatch.setenv(amx_tiles.ENV, tiles)
        for m, split in MODES:
            case.check(case.run(mode=m, split_tokens=split))


@pytest.mark.parametrize("D", [33, 128])
def test_score_magnitudes(D, reduced_grid):
    """q and K times 10 (|q.k| ~ 10**3 at head_dim 128): within budget (odd head_dim: the widened path)."""
    if reduced_grid and D != 33:
        pytest.skip("full grid only")
    for P, group in itertools.product((3, 16) if reduced_grid else (1, 3, 16, 64), (1, 8) if reduced_grid
                                      else (1, 4, 8, 32)):
        rng = np.random.default_rng(D * 100 + P * 10 + group)
        case = Case(rng, D=D, group=group, P=P, lengths=(6, 83), runs=(6, 6), Hkv=1 if group == 32 else 2,
                    q_scale=10.0, k_scale=10.0)
        for m, split in MODES:
            case.check(case.run(mode=m, split_tokens=split))


@pytest.mark.skipif(not bf16_dot.HOST, reason="the pair path runs where the CPU has avx512bf16")
def test_path_taken_only_where_it_applies(mode, reduced_grid):
    """With vdpbf16ps on (the default mode) a bfloat16 q's tiles take the pairs: other bits than the widened path
    (mode 0), both within budget. A tile holding one q element that is not bfloat16 keeps the widened path: its
    bits are mode 0's."""
    case = Case(np.random.default_rng(9), D=64, group=4, P=16, lengths=(90,), runs=(20,))   # one tile per kv head
    mode(0)
    widened = case.run()
    mode(1)
    pairs = case.run()
    case.check(pairs)
    case.check(widened)
    assert not np.array_equal(pairs, widened)
    q = case.q.copy()
    q[3, 5, 7] = np.nextafter(q[3, 5, 7], np.float32(9))     # query 3, kv head 1: its tile
    mixed = case.run(q)
    mode(0)
    mixed0 = case.run(q)
    assert np.array_equal(mixed[:, 4:8], mixed0[:, 4:8])     # kv head 1's tile: widened
    assert np.array_equal(mixed[:, :4], pairs[:, :4])        # kv head 0's: pairs, as before


def test_bits_independent_of_the_other_queries(reduced_grid):
    """A sequence's rows are the same bits alone and beside a sequence whose q is not bfloat16, serial or
    parallel, with any split."""
    D = 8 if reduced_grid else 64
    both = Case(np.random.default_rng(11), D=D, group=4, P=16, lengths=(50, 70), runs=(20, 20))
    both.q[20:] = np.float32(1.0) / 3                      # the second sequence's q: not bfloat16
    alone = Case(np.random.default_rng(11), D=D, group=4, P=16, lengths=(50, 70), runs=(20, 20))
    alone.query_seq, alone.query_pos, alone.q = both.query_seq[:20], both.query_pos[:20], both.q[:20]
    for m, split in MODES:
        got = both.run(mode=m, split_tokens=split)
        both.check(got)
        assert np.array_equal(got[:20], alone.run(mode=m, split_tokens=split))
