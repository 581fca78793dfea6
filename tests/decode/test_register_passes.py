"""The register blocks' two shapes (`register_blocks.head_groups`, `gemm.testing_strip`): AVX-512 targets take a
block's 4 heads in one pass and the GEMM strips in blocks of up to 4 vectors; AVX2 targets (16 registers) one
head per pass and one vector per block. Both compile on any x86-64 CPU with FMA, so each is checked against the
other bit for bit here, whatever the CPU, and against float64 products."""
import numpy as np
import pytest

from decode.kernels import gemm, register_blocks
from kvcache import bf16

pytestmark = pytest.mark.kernel


def storage(x, kind):
    """float32 rows as the pool keeps them: float32, float16 bits (uint16) or bfloat16 bits (int16)."""
    if kind == "float16":
        return x.astype(np.float16).view(np.uint16)
    if kind == "bfloat16":
        return bf16.to_bits(x).view(np.int16)
    return x.astype(np.float32)


@pytest.mark.parametrize("kind", ["float32", "float16", "bfloat16", "float64"])
def test_dot_block_the_same_in_one_pass_or_a_head_per_pass(kind):
    rng = np.random.default_rng(3)
    wide, narrow = register_blocks.testing_blocks(False), register_blocks.testing_blocks(True)
    for D in (16, 40, 64, 128):
        qdt = np.float64 if kind == "float64" else np.float32
        qs = (rng.standard_normal((6, D)) * 3).astype(qdt)
        kp = storage(rng.standard_normal((9, D)), "float32" if kind == "float64" else kind)
        for g, t, n, last in ((0, 0, D, 8), (2, 5, D, 8), (1, 6, D - 3, 7)):
            a, b = wide[0](qs, g, kp, t, n, last), narrow[0](qs, g, kp, t, n, last)
            assert a.tobytes() == b.tobytes(), (D, g, t, n)
            K = register_blocks.row_f(kp).astype(np.float64)
            exact = np.array([qs[g + i, :n].astype(np.float64) @ K[min(t + j, last), :n]
                              for i in range(4) for j in range(4)])
            mag = np.array([np.abs(qs[g + i, :n]).astype(np.float64) @ np.abs(K[min(t + j, last), :n])
                            for i in range(4) for j in range(4)])
            assert (np.abs(a - exact) <= n * np.finfo(qdt).eps * mag).all(), (D, g, t, n)


@pytest.mark.parametrize("kind", ["float32", "float16", "bfloat16"])
def test_value_block_the_same_in_one_pass_or_a_head_per_pass(kind):
    rng = np.random.default_rng(4)
    wide, narrow = register_blocks.testing_blocks(False), register_blocks.testing_blocks(True)
    for Dv in (32, 64, 96):
        S = rng.random((6, 40)).astype(np.float32)
        vp = storage(rng.standard_normal((16, Dv)), kind)
        acc0 = rng.standard_normal((6, Dv)).astype(np.float32)
        outs = []
        for pv in (wide[1], narrow[1]):
            acc = acc0.copy()
            pv(S, 1, 3, vp, 2, 13, acc, Dv)
            outs.append(acc)
        assert outs[0].tobytes() == outs[1].tobytes(), Dv
        twin = acc0.copy()
        register_blocks.pv4(S, 1, 3, vp, 2, 13, twin, Dv)
        np.testing.assert_allclose(outs[0], twin, rtol=1e-5, atol=1e-5)
        assert (outs[0][0] == acc0[0]).all() and (outs[0][5] == acc0[5]).all()    # rows outside the block kept


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_gemm_strip_the_same_with_either_blocking(dtype):
    rng = np.random.default_rng(5)
    wide, narrow = gemm.testing_strip(True, dtype), gemm.testing_strip(False, dtype)
    L = gemm.lanes(dtype)
    for rows, nv, nk in ((4, 1, 7), (12, 2, 64), (16, 4, 33), (28, 3, 128), (24, 4, 1)):
        cols = nv * L + L
        A = rng.standard_normal((rows, nk)).astype(dtype)
        B = rng.standard_normal((nk, cols)).astype(dtype)
        rsc = rng.random(rows).astype(np.float32)
        for init in (gemm.FRESH | gemm.SCALE | gemm.COLMAX, gemm.RESCALE, 0):
            outs = []
            for strip in (wide, narrow):
                C = rng.standard_normal((rows, cols)).astype(np.float32) if not outs else outs[0][2].copy()
                C0 = C.copy()
                mx = np.full(cols, -1e30, np.float32)
                strip(A, nk, 1, 0, rows, B, L, C, nk, nv, init, rsc, np.float32(0.5), mx, rows - 1)
                outs.append((C, mx, C0))
            (c1, m1, start), (c2, m2, _) = outs
            assert c1.tobytes() == c2.tobytes() and m1.tobytes() == m2.tobytes(), (rows, nv, nk, init)
            assert (c1[:, :L] == start[:, :L]).all() and (c1[:, L + nv * L:] == start[:, L + nv * L:]).all()
            want = start.astype(np.float64)
            blk = want[:, L:L + nv * L]
            if init & gemm.RESCALE:
                blk *= rsc[:, None]
            prod = A.astype(np.float64) @ B[:, L:L + nv * L].astype(np.float64)
            blk[:] = prod if init & gemm.FRESH else blk + prod
            if init & gemm.SCALE:
                blk *= 0.5
            np.testing.assert_allclose(c1, want, rtol=1e-4, atol=1e-4 * np.sqrt(nk))
            if init & gemm.COLMAX:
                np.testing.assert_allclose(m1[L:L + nv * L], c1[:rows - 1, L:L + nv * L].max(axis=0), rtol=0)
