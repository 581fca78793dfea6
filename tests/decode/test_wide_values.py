"""Rows of a large query-head group widened once per chunk: 16-bit value rows (`loaders.value_rows`,
`register_blocks.pair_rows`): the widened rows against NumPy (bfloat16 in the pair order), and PV over them
bit for bit PV over the stored rows, for float16 and bfloat16 pages at groups on both sides of the threshold;
float16 / bfloat16 key rows under float32 q.k (`loaders.score_rows`, q itself: `bf16_dot` mode 0): the scores
bit for bit those over the stored rows."""
import numpy as np
import pytest
from numba import njit

from decode.kernels.blocks import pv, qk
from decode.kernels.loaders import score_rows, value_rows, wide_group, wide_values
from decode.kernels.register_blocks import pair_dim, pair_rows
from kvcache import bf16

pytestmark = pytest.mark.kernel


def _bf16_rows(rng, rows, width):
    return bf16.to_bits(rng.standard_normal((rows, width)).astype(np.float32)).view(np.int16)


def _f16_rows(rng, rows, width):
    return rng.standard_normal((rows, width)).astype(np.float16).view(np.uint16)


@njit
def _jit_pair_rows(vp, t0, t1, dst):
    pair_rows(vp, t0, t1, dst)


@njit
def _jit_value_rows(Sh, c, vp, r0, r1, ah, vt):
    value_rows(Sh, c, vp, None, None, r0, r1, ah, vt)


@njit
def _jit_pv(Sh, c, vp, r0, r1, ah):
    pv(Sh, c, vp, r0, r1, ah)


@pytest.mark.parametrize("width", [32, 64, 96 + 7, 128, 31])
def test_pair_rows_widens_bfloat16_rows_into_the_pair_order(width):
    rng = np.random.default_rng(width)
    vp = _bf16_rows(rng, 20, width)
    n = width - width % 32
    wide = bf16.to_float32(vp.view(np.uint16))[3:19]
    expected = wide.copy()
    expected[:, :n] = wide[:, pair_dim(np.arange(n))]
    for widen in (_jit_pair_rows, pair_rows):
        dst = np.full((16, width), np.nan, np.float32)
        widen(vp, 3, 19, dst)
        assert np.array_equal(dst, expected)


@pytest.mark.parametrize("make, bits", [(_f16_rows, np.uint16), (_bf16_rows, np.int16)])
@pytest.mark.parametrize("heads", [4, 8, 16, 32, 33])
@pytest.mark.parametrize("width", [128, 64 + 5])
def test_value_rows_widened_once_gives_the_bits_of_pv_over_the_rows(make, bits, heads, width):
    rng = np.random.default_rng(heads * width)
    vp = make(rng, 40, width)
    assert vp.dtype == bits
    S = rng.random((heads, 64)).astype(np.float32)
    start = rng.standard_normal((heads, width)).astype(np.float32)
    direct, widened = start.copy(), start.copy()
    vt = np.full((16, width), np.nan, np.float32)
    for r0, r1, c in ((0, 16, 0), (16, 29, 20), (29, 40, 40)):        # whole and short chunks
        _jit_pv(S, c, vp, r0, r1, direct)
        _jit_value_rows(S, c, vp, r0, r1, widened, vt)
    assert np.array_equal(direct, widened)
    assert np.isnan(vt).all() == (heads < wide_values(bits == np.int16))  # the scratch used iff widened


def test_the_thresholds_are_the_measured_groups():
    assert (wide_values(False), wide_values(True)) == (16, 32)
    assert (wide_group(4, 2), wide_group(8, 4), wide_group(8, 2)) == (32, 16, 8)


@njit
def _jit_score_rows(qh, kp, r0, r1, Sh, c, kt):
    G = qh.shape[0]     # parts 0: q itself (the split buffers only typed, as the kernel's are when unused)
    score_rows(qh, np.zeros((G, 0), np.int16), np.zeros((G, 0), np.float32), 0, kp, None, None, r0, r1, Sh, c, kt)


@njit
def _jit_qk(qh, kp, r0, r1, Sh, c):
    qk(qh, kp, r0, r1, Sh, c)


@pytest.mark.parametrize("make", [_f16_rows, _bf16_rows])
@pytest.mark.parametrize("heads, acc", [(8, np.float32), (32, np.float32), (36, np.float32), (8, np.float64)])
@pytest.mark.parametrize("width", [128, 64 + 5])
def test_16bit_keys_widened_once_give_the_bits_of_the_scores_over_the_rows(make, heads, acc, width):
    rng = np.random.default_rng(heads + width)
    kp = make(rng, 40, width)
    qh = rng.standard_normal((heads, width)).astype(acc)
    direct = np.zeros((heads, 48), acc)
    widened = np.zeros((heads, 48), acc)
    kt = np.full((16, width), np.nan, acc)
    for r0, r1, c in ((0, 16, 0), (16, 29, 20), (29, 40, 33)):
        _jit_qk(qh, kp, r0, r1, direct, c)
        _jit_score_rows(qh, kp, r0, r1, widened, c, kt)
    assert np.array_equal(direct, widened)
    widened_rows = heads >= wide_group(qh.itemsize, 2) and not (acc == np.float64 and kp.dtype == np.int16)
    assert np.isnan(kt).all() != widened_rows
