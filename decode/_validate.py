"""A jitted finiteness check for the decode-step path: one call instead of three NumPy reductions.

The limit makes "finite after the cast to the storage dtype" checkable before casting: a float32 input bound
for float16 storage must satisfy |x| < 65520 (values from 65520 up round to inf in float16).
"""
import numpy as np
from numba import njit

FLOAT16_OVERFLOW = 65520.0                      # smallest magnitude that rounds to inf in float16
FLOAT32_OVERFLOW = 3.4028235677973366e38     # float32 max + half an ulp: the smallest float64 that rounds to inf


@njit(cache=True, nogil=True)
def _finite_below(x, limit):
    for value in x.ravel():
        if not abs(value) < limit:             # False for NaN too
            return False
    return True


@njit(cache=True, nogil=True)
def first_bad_input(q, k, v, q_limit, kv_limit):
    """0 / 1 / 2 for the first of q / k / v that is not finite or reaches its limit in magnitude, else -1."""
    if not _finite_below(q, q_limit):
        return 0
    if not _finite_below(k, kv_limit):
        return 1
    if not _finite_below(v, kv_limit):
        return 2
    return -1


def overflow_limit(input_dtype: np.dtype, storage_dtype: np.dtype) -> float:
    """Magnitude from which a value of ``input_dtype`` becomes inf in ``storage_dtype``."""
    if storage_dtype.itemsize >= input_dtype.itemsize:
        return np.inf
    return FLOAT16_OVERFLOW if storage_dtype == np.float16 else FLOAT32_OVERFLOW
