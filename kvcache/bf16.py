"""The bfloat16 storage format: the one rounding rule of the cache, in NumPy and jitted forms.

NumPy has no bfloat16, so a bfloat16 pool holds the **bits**: ``uint16`` arrays with the same page shapes as the
other float dtypes (``k [num_layers, num_pages, num_kv_heads, page_size, head_dim]``, V likewise). A bfloat16
value is the upper half of a float32 (sign, 8 exponent bits, 7 mantissa bits), so

    widen:   float32 bits = bf16 bits << 16                  (exact: every bfloat16 is a float32)
    narrow:  bf16 bits    = (f32 bits + 0x7fff + ((f32 bits >> 16) & 1)) >> 16      (round to nearest, ties
                                                               to even; carries into the exponent up to inf)

The rule is bit for bit ``torch.Tensor.to(torch.bfloat16)`` (c10's ``round_to_nearest_even``) for every float32
that is not a NaN: ties to even, subnormals kept (no flush to zero), -0.0 kept, values from ``OVERFLOW`` up
(float32 max included) to inf. Inputs of other widths go through float32 first, as torch does: float16 widens
exactly; **float64 is rounded to float32 (nearest even), then to bfloat16** -- two roundings, which differ
from one rounding when the float64 lies just off a bfloat16 tie (``1 + 2**-8 + 2**-30`` gives 1.0 here and in
torch, 1.0078125 rounded once). NaN becomes the quiet NaN ``0x7fc0`` (c10's scalar rule; torch's vectorised
contiguous cast writes ``0xffff`` instead, so torch itself has no single NaN pattern). The cache never stores
either: a non-finite input, or a finite one that rounds to inf, is refused before anything changes.

Public helpers (the cache's writes and the kernels' loaders use these; nothing else knows the format):

    to_bits(x)              float16/32/64 array -> uint16 bits array (same shape)
    to_float32(bits)        uint16 bits array -> float32 array (exact)
    round_bits(x)           `to_bits` and the flat index of the first element that is not a finite bfloat16 (the
                            check of `kvcache.checks.check_bf16_storable`)
    f32_bits_to_bf16(u)     jitted scalar: float32 bits (uint32) -> bfloat16 bits (an int), the rule above
    bf16_to_f32_bits(b)     jitted scalar: bfloat16 bits -> float32 bits (uint32)
"""
import numpy as np
from numba import njit

NAME = "bfloat16"
BITS_DTYPE = np.dtype(np.uint16)            # the element type of a bfloat16 pool
QUIET_NAN = 0x7fc0
MAX = float(np.uint32(0x7f7f0000).view(np.float32))     # 3.3895314e38, the largest finite bfloat16
OVERFLOW = float(np.uint32(0x7f7f8000).view(np.float32))  # 3.3961775e38: from here up a float32 rounds to inf


def to_bits(x: np.ndarray) -> np.ndarray:
    """``x`` (float16 / float32 / float64, any shape) rounded to bfloat16: ``uint16`` bits, same shape."""
    return round_bits(x)[0]


def round_bits(x: np.ndarray) -> tuple[np.ndarray, int]:
    """(`to_bits` of ``x``, flat index of the first element that is not a finite bfloat16 or -1): one jitted pass,
    no temporaries beyond the bits (and float64 input's float32 copy)."""
    x = np.asarray(x)
    if x.dtype.kind != "f":
        raise TypeError(f"x: expected a floating-point array, got dtype {x.dtype}")
    with np.errstate(over="ignore", invalid="ignore"):
        f32 = np.asarray(x, dtype=np.float32, order="C")        # float64: nearest-even to float32 (torch's path)
    bits = np.empty(f32.shape, dtype=BITS_DTYPE)
    bad = _round_flat(f32.reshape(-1).view(np.uint32), bits.reshape(-1))
    return bits, bad


def to_float32(bits: np.ndarray) -> np.ndarray:
    """``uint16`` bfloat16 bits -> float32 values (exact), same shape."""
    bits = np.asarray(bits)
    if bits.dtype != BITS_DTYPE:
        raise TypeError(f"bits: expected uint16 bfloat16 bits, got dtype {bits.dtype}")
    return (bits.astype(np.uint32) << 16).view(np.float32)


@njit(cache=True, nogil=True, inline="always")
def f32_bits_to_bf16(u):
    """float32 bits (uint32) -> bfloat16 bits (an int), rounded to nearest even; NaN -> 0x7fc0."""
    r = (u + 0x7fff + ((u >> 16) & 1)) >> 16     # both computed, one selected: loops over it vectorise
    return QUIET_NAN if (u & 0x7fffffff) > 0x7f800000 else r


@njit(cache=True, nogil=True, inline="always")
def bf16_to_f32_bits(b):
    """bfloat16 bits -> float32 bits (uint32): the bits shifted up (exact)."""
    return np.uint32(b) << np.uint32(16)


@njit(cache=True, nogil=True)
def _round_flat(u, out):
    """``out[i]`` = the bfloat16 bits of float32 bits ``u[i]``; returns the first i whose result is inf or NaN,
    or -1. The rounding pass ORs a flag over the lanes (so it vectorises); only a flagged call looks for i."""
    any_bad = 0
    for i in range(u.shape[0]):
        b = f32_bits_to_bf16(u[i])
        out[i] = b
        any_bad |= np.int64((b & 0x7f80) == 0x7f80)
    if any_bad == 0:
        return -1
    for i in range(u.shape[0]):
        if (out[i] & 0x7f80) == 0x7f80:
            return i
    return -1
