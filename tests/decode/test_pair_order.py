"""The PV blocks' pair order (`register_blocks.in_pairs`): bfloat16 values into float32 accumulators keep each
32-lane strip as (even dims, odd dims) for a whole kernel call, and `unpair` / `blocks.normalise` put them back
by dim. Checked: which formats take the order (jitted and plain answers agree), `unpair` against NumPy's
transposition (a tail beyond the strips untouched), the PV block's accumulators against NumPy's p @ V in that
order, and normalise writing them by dim."""
import numpy as np
import pytest
from numba import njit

from decode.kernels.blocks import normalise, pv
from decode.kernels.register_blocks import in_pairs, unpair
from kvcache import bf16

pytestmark = pytest.mark.kernel


def pair_order(x: np.ndarray, n: int) -> np.ndarray:
    """NumPy: the first n lanes (whole strips of 32) of every row of x [rows, width] in the pair order."""
    out = x.copy()
    out[:, :n] = x[:, :n].reshape(len(x), -1, 16, 2).transpose(0, 1, 3, 2).reshape(len(x), n)
    return out


@njit
def _jit_in_pairs(vp, acc):
    return in_pairs(vp, acc)


@njit
def _jit_pv(S, c0, vp, s0, s1, acc):
    pv(S, c0, vp, s0, s1, acc)


@pytest.mark.parametrize("values, acc, expected", [(np.int16, np.float32, True), (np.int16, np.float64, False),
                                                   (np.uint16, np.float32, False), (np.float32, np.float32, False),
                                                   (np.int8, np.float32, False), (np.float64, np.float64, False)])
def test_only_bfloat16_values_into_float32_take_the_pair_order(values, acc, expected):
    vp, a = np.zeros((2, 32), values), np.zeros((1, 32), acc)
    assert in_pairs(vp, a) == expected
    assert _jit_in_pairs(vp, a) == expected


@pytest.mark.parametrize("width, n", [(32, 32), (96, 96), (103, 96), (64, 32), (31, 0)])
def test_unpair_inverts_the_pair_order_and_leaves_the_tail(width, n):
    rng = np.random.default_rng(width)
    natural = rng.standard_normal((5, width)).astype(np.float32)
    stored = pair_order(natural, n)
    if n:
        assert not np.array_equal(stored, natural)
    x = stored.copy()
    unpair(x, n)
    assert np.array_equal(x, natural)


@pytest.mark.parametrize("heads, width", [(4, 64), (1, 32), (5, 96 + 7), (8, 128)])
def test_bfloat16_pv_accumulates_in_pair_order_and_normalise_writes_by_dim(heads, width):
    rng = np.random.default_rng(heads * width)
    rows = 37
    bits = bf16.to_bits(rng.standard_normal((rows, width)).astype(np.float32))      # uint16
    values = bits.view(np.int16)                                                     # the kernels' view
    S = rng.random((heads, rows + 3)).astype(np.float32)
    acc = np.zeros((heads, width), np.float32)
    _jit_pv(S, 3, values, 0, rows, acc)                 # weights S[:, 3:3 + rows]
    exact = S[:, 3:3 + rows].astype(np.float64) @ bf16.to_float32(bits).astype(np.float64)
    n = width - width % 32
    np.testing.assert_allclose(acc, pair_order(exact, n), rtol=1e-5, atol=1e-5)
    out = np.empty_like(acc)
    l = np.full(heads, 2.0, np.float32)
    normalise(acc, l, out, True)
    np.testing.assert_allclose(out, exact / 2.0, rtol=1e-5, atol=1e-5)
