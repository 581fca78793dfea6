"""`decode.kernels.tile_softmax`: the AMX paths' online-softmax steps over a block of scores laid out keys x heads
(decode) or keys x rows (the tiled kernel), 512-bit IR under the JIT, against float64 NumPy computations of the same
steps; the weights' bfloat16 parts checked exact."""
import numpy as np
import pytest

from decode.kernels import tile_softmax

pytestmark = pytest.mark.kernel


def _step(rng, G, npq, nb, first, grow):
    """Run one block through `block_softmax` with random state; returns what it wrote and the float64 expectation."""
    GP = -(-G // 16) * 16
    nbp = -(-nb // 32) * 32
    R = -(-3 * G // 32) * 32
    Dv = 32
    ST = (rng.standard_normal((nbp, R + 16)) * 4).astype(np.float32)
    W = np.full((nbp, GP), np.nan, np.float32)
    PA = np.full((R + 16, nbp + 16), 0x5555, np.int16)
    red = np.zeros((3, GP), np.float32)
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
    tile_softmax.block_softmax(npq, G, nb, nbp, ST, W, PA, red, m, l, O, first, scale)
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
    return (PA, m, l, O), (e, m_new, l_new, O_new, nb, nbp, G)


@pytest.mark.parametrize("G,npq", [(4, 3), (16, 3), (16, 1), (32, 1), (32, 3), (40, 3)])
@pytest.mark.parametrize("nb,first,grow", [(128, True, False), (100, False, True), (37, False, False)])
def test_block_softmax_matches_float64(G, npq, nb, first, grow):
    rng = np.random.default_rng(G * 100 + npq * 10 + nb)
    (PA, m, l, O), (e, m_new, l_new, O_new, nb, nbp, G) = _step(rng, G, npq, nb, first, grow)
    np.testing.assert_allclose(m, m_new, rtol=1e-6)
    weights = _parts_value(PA[:3 * G].reshape(3, G, -1))        # [G, nbp + 16]: the three parts' exact sum
    np.testing.assert_allclose(weights[:, :nb].T, e, rtol=2e-6, atol=1e-30)
    assert np.all(PA[:3 * G, nb:nbp] == 0)
    assert np.all(PA[3 * G:] == 0x5555) and np.all(PA[:, nbp:] == 0x5555)     # nothing written past them
    whole = weights[:, :nb].astype(np.float32)                 # each weight as float32: its parts sum to it
    assert np.array_equal(whole.astype(np.float64), weights[:, :nb])
    hi = PA[:G, :nb].view(np.uint16).astype(np.uint32) << np.uint32(16)
    assert np.array_equal(hi, whole.view(np.uint32) & np.uint32(0xFFFF0000))
    np.testing.assert_allclose(l, l_new, rtol=2e-6)
    np.testing.assert_allclose(O, O_new, rtol=2e-6, atol=1e-30)


def _parts_value(PA):
    """The float64 sum of the three bfloat16 parts PA [3, ...] (exact: each part is a bfloat16)."""
    bits = PA.view(np.uint16).astype(np.uint32) << np.uint32(16)
    return bits.view(np.float32).astype(np.float64).sum(axis=0)


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("nb,Rp,Rs", [(128, 128, 128), (100, 48, 64), (17, 16, 32), (128, 80, 96)])
def test_weight_parts_match_float64(nb, Rp, Rs, masked):
    """The tiled kernel's fused step: PA's parts sum to exp(ST sc - m) (float64 within the float32 exp's ~1e-7; 0
    where masked, past nb and in the rows Rp..Rs), each part the exact truncation split of the weight, l += the
    weights."""
    rng = np.random.default_rng(nb * 1000 + Rp + masked)
    nbp = -(-nb // 32) * 32
    ST = (rng.standard_normal((nbp + 32, Rs)) * 6).astype(np.float32)
    ST[nb:] = np.nan                                     # never read as weights
    l0 = (rng.random(Rp) + 1).astype(np.float32)
    l = np.concatenate([l0, np.full(8, -5.0, np.float32)])  # entries past Rp untouched
    PA = np.full((3, Rs + 16, nbp + 32), 0x5555, np.int16)
    jlo = rng.integers(-1, nb, Rp + 8).astype(np.int32)
    jhi = np.minimum(nb, jlo + rng.integers(0, nb + 2, Rp + 8)).astype(np.int32)
    if masked:                                           # keys outside a row's range may score above its max
        j = np.arange(nb)[:, None]
        ST[:nb, :Rp] = np.where((j >= jlo[:Rp]) & (j <= jhi[:Rp]), ST[:nb, :Rp], np.float32(200.0))
    inside = ST[:nb, :Rp] < 100
    sc = np.float32(1 / np.sqrt(128))
    m = (np.where(inside, ST[:nb, :Rp] * sc, -np.inf).max(axis=0) + rng.random(Rp)).astype(np.float32)
    m[~inside.any(axis=0)] = np.float32(-3.0e38)         # a row with no key in this block
    tile_softmax.run_weight_parts(ST, sc, nb, nbp, Rp, Rs, m, l, PA, masked, jlo, jhi)
    exact = ST[:nb, :Rp].astype(np.float64) * float(sc) - m.astype(np.float64)
    d = exact.astype(np.float32).astype(np.float64)      # fma(ST, sc, -m): one rounding (at most one ulp apart)
    w = np.exp(d).T                                      # [Rp, nb]
    if masked:
        j = np.arange(nb)[None, :]
        w = np.where((j >= jlo[:Rp, None]) & (j <= jhi[:Rp, None]), w, 0.0)
    got = _parts_value(PA[:, :Rp, :nb])
    np.testing.assert_allclose(got, w, rtol=3e-7 + 1.2e-7 * np.abs(d.T).max(), atol=0)
    assert np.all(got[w == 0] == 0)
    assert np.all(PA[:, :Rp, nb:nbp] == 0) and np.all(PA[:, Rp:Rs, :nbp] == 0)
    assert np.all(PA[:, Rs:] == 0x5555) and np.all(PA[:, :, nbp:] == 0x5555)
    hi = PA[0, :Rp, :nb].view(np.uint16).astype(np.uint32) << np.uint32(16)
    whole = got.astype(np.float32)                       # the weight as float32 (exact: the parts sum to it)
    assert np.array_equal(whole.astype(np.float64), got)
    assert np.array_equal(hi, whole.view(np.uint32) & np.uint32(0xFFFF0000))
    rest = (whole - hi.view(np.float32)).view(np.uint32) & np.uint32(0xFFFF0000)   # exact difference
    assert np.array_equal(PA[1, :Rp, :nb].view(np.uint16).astype(np.uint32) << np.uint32(16), rest)
    np.testing.assert_allclose(l[:Rp], l0 + w.sum(axis=1), rtol=2e-6)
    assert np.all(l[Rp:] == -5.0)


@pytest.mark.parametrize("nb", [1, 37, 128])
@pytest.mark.parametrize("Rp", [16, 48, 128, 144, 272])
def test_block_max_is_the_scaled_column_max(nb, Rp):
    """block_max: mx[r] = max(mx[r], the largest of the block's scores in column r, times sc), bit for bit the
    maximum of the rounded scaled scores; columns from Rp and the mx entries past them untouched."""
    rng = np.random.default_rng(nb * 7 + Rp)
    ST = (rng.standard_normal((nb + 3, Rp + 16)) * 50).astype(np.float32)
    ST[nb:] = 1e30                                       # rows past nb: never read
    ST[:, Rp:] = 1e30                                    # columns past Rp: never read
    sc = np.float32(1 / np.sqrt(128))
    mx0 = (rng.standard_normal(Rp + 8) * 20).astype(np.float32)
    mx = mx0.copy()
    tile_softmax.run_block_max(ST, sc, nb, Rp, mx)
    want = np.maximum(mx0[:Rp], (ST[:nb, :Rp] * sc).max(axis=0))
    assert np.array_equal(mx[:Rp], want)
    assert np.array_equal(mx[Rp:], mx0[Rp:])
