"""simd.lane_max / lane_sum (the softmax block's reductions) and simd.borrow: the jitted IR against the NumPy
twins that NUMBA_DISABLE_JIT runs use, bit for bit, and against plain NumPy."""
import numpy as np
import pytest
from numba import njit

from decode.kernels import simd

pytestmark = pytest.mark.kernel


@njit
def _jit_reduce(x, n):
    return simd.lane_max(x, n), simd.lane_sum(x, n)


@njit
def _jit_borrowed_rows(a, r):
    b = simd.borrow(a)
    row = b[r]                  # a view of a borrowed array: no owner either
    s = row[0] - row[0]
    for i in range(row.shape[0]):
        s += row[i]
    return s, b.shape[0], b.shape[1]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_lane_reductions_match_their_twins_bit_for_bit(dtype):
    rng = np.random.default_rng(7)
    for n in list(range(1, 40)) + [63, 64, 65, 127, 128, 129]:
        x = (rng.standard_normal(n + 5) * 10).astype(dtype)
        x[n:] = 1e6                                     # beyond n: never read
        mx, sm = _jit_reduce(x, n)
        assert mx == simd.lane_max(x, n) == x[:n].max()
        twin = simd.lane_sum(x, n)
        assert np.asarray(sm, dtype).tobytes() == np.asarray(twin, dtype).tobytes(), n
        exact = float(np.sum(x[:n].astype(np.float64)))
        assert abs(float(sm) - exact) <= n * np.finfo(dtype).eps * float(np.abs(x[:n]).sum())


def test_lane_max_of_equal_and_negative_values():
    x = np.array([-3.0, -1.5, -1.5, -7.0] * 9, np.float32)
    assert _jit_reduce(x, x.shape[0])[0] == np.float32(-1.5)


def test_borrowed_array_reads_the_same_data():
    a = np.arange(24, dtype=np.float32).reshape(4, 6)
    s, rows, cols = _jit_borrowed_rows(a, 2)
    assert (rows, cols) == (4, 6)
    assert s == a[2].sum()
    assert simd.borrow(None) is None
