"""The tiled kernel on AMX tiles (`decode.kernels.amx_tiles`, `amx_blocks`): the exact split of a float32 q into
bfloat16 parts (everywhere: the NumPy body and the JIT's), the tile GEMM against the float64 products of the same parts,
and prefill / extend runs over bfloat16 pages with a float32 q (three parts) and a bfloat16 q (one) within the
float32 budget of the float64 oracle (`naive.budget`), at |q.k| ~ 10**3 too, serial / parallel / split, with the
same bits on every call. The tile tests run where the CPU has AMX and the OS grants the tile state.

Marked `kernel` (rerun under NUMBA_DISABLE_JIT=1 and NUMBA_BOUNDSCHECK=1 with --reduced-grid)."""
import importlib.util
import itertools
from pathlib import Path

import numpy as np
import pytest

from decode.kernels import amx_blocks, amx_tiles
from decode.kernels.simd import JIT, zeros64

_spec = importlib.util.spec_from_file_location("decode_kernel_naive_amx", Path(__file__).with_name("naive.py"))
naive = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(naive)
_spec2 = importlib.util.spec_from_file_location("decode_pair_cases_amx",
                                                Path(__file__).with_name("test_pair_scores.py"))
pair_cases = importlib.util.module_from_spec(_spec2)
_spec2.loader.exec_module(pair_cases)

pytestmark = pytest.mark.kernel
TILES = pytest.mark.skipif(not amx_tiles.usable(), reason="AMX tiles: the CPU lacks them or the OS refused")


def _parts_values(QA, parts, D, cols):
    """The float64 values of the packed parts: [parts, D, cols]."""
    half = D // 2
    out = []
    for p in range(parts):
        bits = QA[p * half:(p + 1) * half, :2 * cols].view(np.uint16).astype(np.uint32) << np.uint32(16)
        out.append(bits.view(np.float32).reshape(half, cols, 2).transpose(0, 2, 1).reshape(D, cols))
    return np.array(out, np.float64)


@pytest.mark.parametrize("P,b0,nb", [(16, 0, 128), (16, 5, 77), (32, 3, 31), (1, 0, 9), (64, 64, 128), (8, 7, 2)])
def test_value_pairs(P, b0, nb):
    """`value_pairs` (the IR interleave, rows followed page by page): VB[k] = rows 2k (low halves) and 2k + 1 (high
    halves) of the kv head's value rows at b0.., rows past nb zero, up to nb rounded to 32, nothing written after."""
    rng = np.random.default_rng(P + b0 + nb)
    n_pages = -(-(b0 + nb) // P) + 1
    pool = zeros64(n_pages, 2 * P * 64, np.zeros(0, np.int16)).reshape(n_pages, 2, P, 64)
    pool[:] = rng.integers(-2 ** 15, 2 ** 15, pool.shape, dtype=np.int64).astype(np.int16)
    pages = rng.permutation(n_pages).astype(np.int32)
    VB = np.full((80, 64), 9, np.uint32)
    amx_blocks.value_pairs(pool, pages, 1, b0, nb, VB)
    n = -(-nb // 32) * 32
    rows = np.zeros((n, 64), np.uint32)
    for j in range(nb):
        t = b0 + j
        rows[j] = pool[pages[t // P], 1, t % P].view(np.uint16)
    assert np.array_equal(VB[:n // 2], rows[0::2] | (rows[1::2] << np.uint32(16)))
    assert np.all(VB[n // 2:] == 9)


@pytest.mark.parametrize("scale,kind", [(1.0, "float32"), (1e3, "float32"), (1.0, "bfloat16"), (1e-20, "float32")])
def test_split_is_exact(scale, kind):
    """hi + mid + lo == q for every element (float32 q: up to three parts; a bfloat16 q: one); the columns past Rp
    zero; the NumPy body and the JIT's the same bits (a part below 2**-126 is subnormal and not exact: not tested)."""
    rng = np.random.default_rng(int(np.log10(scale) + 40))
    D, R, Rp = 64, 40, 48
    QT = np.zeros((D, 64), np.float32)
    QT[:, :R] = (rng.standard_normal((D, R)) * scale).astype(np.float32)
    if kind == "bfloat16":
        QT[:, :R] = naive.bf16_values(naive.bf16_bits(QT[:, :R]))
    packs = [amx_blocks.pack_parts]
    if JIT:
        from numba import njit
        packs.append(njit(lambda QT, R, Rp, QA: amx_blocks.pack_parts(QT, R, Rp, QA)))
    got = []
    for pack in packs:
        QA = np.full((3 * D // 2, 2 * 64), 7, np.int16)
        parts = pack(QT, R, Rp, QA)
        assert parts == (1 if kind == "bfloat16" else 3)
        vals = _parts_values(QA, 3, D, 64)
        assert np.array_equal(vals.sum(axis=0)[:, :Rp], QT[:, :Rp].astype(np.float64))
        assert not QA[:, 2 * Rp:].any()
        got.append(QA)
    assert all(np.array_equal(g, got[0]) for g in got)


@TILES
@pytest.mark.parametrize("D,nb,Rp,parts,P", [(32, 32, 32, 1, 32), (64, 59, 96, 3, 16), (128, 128, 128, 3, 64),
                                            (128, 90, 64, 2, 8), (64, 40, 32, 3, 24)])
def test_tile_gemm_against_products(D, nb, Rp, parts, P):
    """ST = K . the parts' columns within a float32 sum's bound of the float64 products (every product exact), the
    keys read in place (whole 16-key groups inside a page) or staged (pages of 8 / 24, a last partial group), from
    pages in shuffled order starting at key 5 (staged: not at a 16-key offset) or 0."""
    from numba import njit
    from decode.kernels.simd import zeros64
    rng = np.random.default_rng(D + nb + Rp + P)
    b0 = 5 if P % 16 else 0
    n_pages = -(-(b0 + nb + 32) // P)
    pool = naive.bf16_bits(rng.standard_normal((n_pages, 2, P, D)) * 4).view(np.int16)
    pages = rng.permutation(n_pages).astype(np.int32)
    keys = np.concatenate([pool[pg, 1] for pg in pages])[b0:b0 + nb]
    QT = (rng.standard_normal((D, Rp)) * 4).astype(np.float32)
    QA = zeros64(3 * D // 2, 2 * Rp, np.zeros(0, np.int16))
    amx_blocks.pack_parts(QT, Rp, Rp, QA)
    Kt = zeros64(nb + 32, D, np.zeros(0, np.int16))
    ST = zeros64(nb + 32, Rp, np.zeros(0, np.float32))
    run = njit(lambda pool, pages, b0, nb, Kt, QA, parts, ST, Rp, cfg: (
        amx_blocks.stage_keys(pool, pages, 1, b0, nb, Kt),
        amx_tiles.amx_scores(pool, pages, 1, b0, nb, Kt, QA, parts, ST, Rp, cfg)))
    run(pool, pages, b0, nb, Kt, QA, parts, ST, Rp, amx_tiles.tile_config())
    ref = amx_blocks.scores_reference(keys, QA, parts, nb, Rp)
    kabs = np.abs(naive.bf16_values(keys.view(np.uint16))).astype(np.float64)
    bound = 3 * parts * D * 2.0 ** -24 * (kabs @ np.abs(_parts_values(QA, parts, D, Rp)).sum(axis=0))
    assert np.all(np.abs(ST[:nb] - ref) <= bound + 1e-30)


class Case(pair_cases.Case):
    """`test_pair_scores.Case` with the q left float32 (not rounded to bfloat16) unless ``bf16_q``."""

    def __init__(self, rng, *, bf16_q, **kw):
        super().__init__(rng, **kw)
        if not bf16_q:
            self.q = (self.q + rng.standard_normal(self.q.shape) * 1e-3).astype(np.float32)


def _grid(reduced):
    if reduced:
        return [(32, 4, 16, 0, False), (32, 1, 3, 5, True)]
    grid = itertools.product((32, 64, 128), (1, 4, 8), (1, 16, 32, 64), (False, True))
    return [(d, g, p, 7 * (n % 2), b) for n, (d, g, p, b) in enumerate(grid) if not (d == 128 and p == 1)]


def pytest_generate_tests(metafunc):
    if "amx_case" in metafunc.fixturenames:
        reduced = metafunc.config.getoption("--reduced-grid")
        metafunc.parametrize("amx_case", _grid(reduced), ids=lambda c: "d%d-g%d-p%d-w%d-bf16q%d" % c)


@TILES
def test_grid(amx_case):
    """Prefill and extend over bfloat16 pages on the tiles, serial / parallel / split: within budget, the same bits
    on a second call."""
    D, group, P, window, bf16_q = amx_case
    rng = np.random.default_rng(D * 1000 + group * 100 + P * 10 + window + bf16_q)
    case = Case(rng, D=D, group=group, P=P, lengths=(37, 107), runs=(37, 37), window=window, bf16_q=bf16_q)
    for m, split in pair_cases.MODES:
        out = case.run(mode=m, split_tokens=split)
        case.check(out)
        assert np.array_equal(out, case.run(mode=m, split_tokens=split))


@TILES
@pytest.mark.parametrize("D,group", [(128, 4), (128, 32), (64, 8)])
def test_score_magnitudes(D, group):
    """q and K times 10 (|q.k| ~ 10**3 at head_dim 128), a float32 q: within budget."""
    rng = np.random.default_rng(D + group)
    case = Case(rng, D=D, group=group, P=16, lengths=(6, 83), runs=(6, 6), Hkv=1 if group == 32 else 2,
                q_scale=10.0, k_scale=10.0, bf16_q=False)
    for m, split in pair_cases.MODES:
        case.check(case.run(mode=m, split_tokens=split))


@TILES
def test_tiles_off_by_environment(monkeypatch):
    """$KVENGINE_AMX=0 turns the tiles off (other bits: the widened / pair path), both within budget."""
    case = Case(np.random.default_rng(5), D=64, group=4, P=16, lengths=(90,), runs=(20,), bf16_q=False)
    tiles = case.run()
    monkeypatch.setenv(amx_tiles.ENV, "0")
    assert not amx_tiles.usable()
    other = case.run()
    case.check(tiles)
    case.check(other)
    assert not np.array_equal(tiles, other)
