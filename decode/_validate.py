"""A jitted finiteness check for the decode-step path: one call instead of three NumPy reductions.

The limit makes "finite after the cast to the storage dtype" checkable before casting: a float32 input bound
for float16 storage must satisfy |x| < 65520 (values from 65520 up round to inf in float16).

`magnitude_limits` bounds the inputs so that the kernel's arithmetic cannot overflow: finite q and k whose scores
exceed the compute dtype made the fastmath kernel return NaN, raise ZeroDivisionError, or return finite garbage.
"""
import math

import numpy as np
from numba import njit

from kvcache import quant

FLOAT16_OVERFLOW = 65520.0                      # smallest magnitude that rounds to inf in float16
FLOAT32_OVERFLOW = 3.4028235677973366e38     # float32 max + half an ulp: the smallest float64 that rounds to inf


@njit(cache=True, nogil=True)
def _finite_below(x, limit):
    """Whether every ``|x| < limit`` (False for NaN too); no early exit, so the loop vectorises (4x faster on a
    decode step's q/k/v than stopping at the first bad element, which the caller then looks up by NumPy)."""
    flat = x.ravel()
    ok = True
    for i in range(flat.size):
        ok &= abs(flat[i]) < limit
    return ok


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
    """Magnitude from which a value of ``input_dtype`` becomes inf in ``storage_dtype`` (int8: from which its
    group's float16 scale would overflow, just above `kvcache.quant.MAX_ABS`)."""
    if storage_dtype == quant.VALUE_DTYPE:
        return float(np.nextafter(quant.MAX_ABS, np.inf))
    if storage_dtype.itemsize >= input_dtype.itemsize:
        return np.inf
    return FLOAT16_OVERFLOW if storage_dtype == np.float16 else FLOAT32_OVERFLOW


def magnitude_limits(compute_dtype: np.dtype, head_dim: int, scale: float) -> tuple[float, float]:
    """``(q_limit, kv_limit)``: with every ``|q| < q_limit`` and every ``|k|, |v| < kv_limit`` each score
    ``q.k * scale`` (every partial sum, in any order) stays below a quarter of the compute dtype's largest value,
    so score differences are finite too, and each weighted sum of V stays below ``tokens * kv_limit``.

    With E = 128 (float32 compute) or 1024 (float64): kv_limit = 2**(E/2 - 16) (2.8e14 for float32; float16
    storage never gets there) and q_limit = 2**(E/2 + 14) / (head_dim * scale), so that
    head_dim * (q_limit * scale) * kv_limit = 2**(E - 2)."""
    e = 128 if compute_dtype == np.float32 else 1024
    with np.errstate(over="ignore"):
        q_limit = math.ldexp(1.0, e // 2 + 14) / (head_dim * scale) if head_dim * scale > 0 else math.inf
    return q_limit, math.ldexp(1.0, e // 2 - 16)


def check_magnitude(name: str, x: np.ndarray, limit: float, compute_dtype: np.dtype) -> None:
    """ValueError naming the first element of ``x`` (finite already) with ``|x| >= limit``."""
    if x.size and limit < math.inf and not float(np.abs(x).max()) < limit:      # compared in float64
        index = tuple(int(i) for i in np.argwhere(np.abs(x).astype(np.float64) >= limit)[0])
        raise ValueError(f"{name}: expected |x| < {limit:.6g} (scores q.k * scale and the weighted sums of v must "
                         f"stay finite in {compute_dtype}), got {x[index]} at index {index}")
