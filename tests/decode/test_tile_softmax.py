"""`decode.kernels.tile_softmax`: the AMX decode's online softmax over a block of scores laid out keys x heads
(512-bit IR under the JIT), against a float64 NumPy computation of the same step."""
import numpy as np
import pytest

from decode.kernels import tile_softmax
from decode.kernels.gemm import transpose_rows  # noqa: F401  (the step's transposition, jitted with it)

pytestmark = pytest.mark.kernel


def _step(rng, G, npq, nb, first, grow):
    """Run one block through `block_softmax` with random state; returns what it wrote and the float64 expectation."""
    GP = -(-G // 16) * 16
    nbp = -(-nb // 32) * 32
    R = -(-3 * G // 32) * 32
    Dv = 32
    ST = (rng.standard_normal((nbp, R + 16)) * 4).astype(np.float32)
    W = np.full((nbp, GP), np.nan, np.float32)
    S = np.full((GP, nbp), np.nan, np.float32)
    red = np.zeros((3, GP), np.float32)
    off = np.zeros(16, np.int64)
    scores = ST[:nb, :G].astype(np.float64)
    if npq == 3:
        scores = scores + ST[:nb, G:2 * G] + ST[:nb, 2 * G:3 * G]
    m0 = (scores.max(axis=0) + (-1.0 if grow else 2.0)).astype(np.float32)
    m = m0.copy()
    l0 = (rng.random(G) + 1).astype(np.float32)
    l = l0.copy()
    O0 = rng.standard_normal((R, Dv)).astype(np.float32)
    O = O0.copy()
    scale = np.float32(0.125)
    tile_softmax.block_softmax(npq, G, nb, nbp, ST, W, S, off, red, m, l, O, first, scale)
    if first:
        m_new, alpha = scores.max(axis=0), np.zeros(G)
    else:
        m_new = np.maximum(m0.astype(np.float64), scores.max(axis=0))
        alpha = np.exp((m0 - m_new) * float(scale))
    e = np.exp((scores - m_new) * float(scale))
    l_new = l0 * alpha + e.sum(axis=0)
    O_new = O0.astype(np.float64).copy()
    if not first:
        for p in range(3):
            O_new[p * G:(p + 1) * G] *= alpha[:, None]
    return (S, m, l, O), (e, m_new, l_new, O_new, nb, nbp, G)


@pytest.mark.parametrize("G,npq", [(4, 3), (16, 3), (16, 1), (32, 1), (32, 3), (40, 3)])
@pytest.mark.parametrize("nb,first,grow", [(128, True, False), (100, False, True), (37, False, False)])
def test_block_softmax_matches_float64(G, npq, nb, first, grow):
    rng = np.random.default_rng(G * 100 + npq * 10 + nb)
    (S, m, l, O), (e, m_new, l_new, O_new, nb, nbp, G) = _step(rng, G, npq, nb, first, grow)
    np.testing.assert_allclose(m, m_new, rtol=1e-6)
    np.testing.assert_allclose(S[:G, :nb].T, e, rtol=2e-6, atol=1e-30)
    assert np.all(S[:G, nb:nbp] == 0.0)
    np.testing.assert_allclose(l, l_new, rtol=2e-6)
    np.testing.assert_allclose(O, O_new, rtol=2e-6, atol=1e-30)
