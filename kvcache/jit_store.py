"""Jitted stores of one token per row into the page pool: NumPy's float16 cast runs ~5-10 ns an element here (it
does not use F16C) and its fancy-indexed scatter ~1 ns an element plus its overhead; these were most of a decode step's
time beyond the kernel. float32 -> float16 is bit for bit NumPy's ``astype(np.float16)`` (round to nearest,
ties to even; subnormals; inf above the range): the hardware cast where the CPU has one (`HW_F16`), else integer
arithmetic, float32 -> bfloat16 bit for bit `kvcache.bf16.to_bits` (the
format's one rule), other casts are the compiler's (IEEE round to nearest, as NumPy's), tested against NumPy.

    store_token_bits(k16, v16, layer, page, offset, k_bits, v_bits, fmt)    16-bit pool, float32 input
    scatter_kv(k_dst, v_dst, pages, offsets, k, v, k_old, v_old)             float pools, same dtype or a cast
    scatter_kv_bits(k16, v16, pages, offsets, k_bits, v_bits, k_old, v_old, fmt)   16-bit pool, float32 input

``fmt`` is `FLOAT16` or `BFLOAT16`: the 16-bit format the pool's bits are in (one compiled loop for both; the
branch on it is the same for every element). Shapes for `store_token_bits`: ``k16 [num_layers, num_pages,
num_kv_heads, page_size, head_dim]`` uint16 (the float16 pool viewed as its bits, or a bfloat16 pool), ``v16``
likewise (head_dim_v); the token goes to slot ``offset`` of ``page`` in ``layer``; ``k_bits [num_kv_heads,
head_dim]`` uint32 (float32 values viewed as bits), ``v_bits`` likewise.
"""
import numpy as np
from numba import njit
from numba.core import config as _nb_config

from .bf16 import f32_bits_to_bf16
from .jit_target import target_has

FLOAT16, BFLOAT16 = 0, 1
JIT = not _nb_config.DISABLE_JIT


def _target_casts_f16() -> bool:
    """Whether LLVM lowers float32 -> float16 ``fptrunc`` to an instruction for numba's target (x86 F16C, AArch64
    ``fcvt``), not to a library call the JIT may not link."""
    import platform

    machine = platform.machine().lower()
    if machine in ("aarch64", "arm64"):
        return True
    return machine in ("x86_64", "amd64") and target_has("f16c")


HW_F16 = JIT and _target_casts_f16()


@njit(cache=True, nogil=True, inline="always")
def f16_bits_arith(x):
    """float32 bits (uint32) -> float16 bits (as an int), rounded to nearest even like NumPy; NaN -> 0x7e00, in
    integer arithmetic: `f32_bits_to_f16` where there is no hardware cast (`HW_F16` false, or no JIT), and the check
    of the hardware cast where there is.

    Branch-free (every case computed, one selected), so that loops over it vectorise: the branching form ran
    ~5 ns an element, NumPy's own cast here as slow."""
    sign = (x >> 16) & 0x8000
    a = np.int64(x & 0x7fffffff)
    r = (a >> 13) - 0x1c000                        # normal: exponent rebias 127 -> 15 (112 << 10), 10 mantissa bits
    rest = a & 0x1fff
    up = np.int64((rest > 0x1000) | ((rest == 0x1000) & ((r & 1) == 1)))
    normal = min(r + up, 0x7c00)                   # a carry into the exponent is right (up to inf)
    shift = min(31, max(14, 126 - (a >> 23)))      # subnormal (2**-25 < |x| < 2**-14): in units of 2**-24
    mant = (a & 0x7fffff) | 0x800000               # below 2**-25 the shift leaves 0 (2**-25 itself: tie to even 0)
    s = mant >> shift
    low = mant & ((np.int64(1) << shift) - 1)
    half = np.int64(1) << (shift - 1)
    sub = s + np.int64((low > half) | ((low == half) & ((s & 1) == 1)))
    finite = normal if a >= 0x38800000 else sub
    special = 0x7e00 if a > 0x7f800000 else 0x7c00
    return sign | (special if a >= 0x7f800000 else finite)


if HW_F16:
    from llvmlite import ir as _ir
    from numba import types as _types
    from numba.extending import intrinsic

    @intrinsic
    def _fptrunc_f16(typingctx, x):
        """float32 bits (uint32) -> float16 bits (uint16) by LLVM's ``fptrunc`` (IEEE round to nearest even,
        subnormals kept; one ``vcvtps2ph`` per vector where the loop vectorises)."""
        if x != _types.uint32:
            return None

        def codegen(context, builder, sig, args):
            h = builder.fptrunc(builder.bitcast(args[0], _ir.FloatType()), _ir.HalfType())
            return builder.bitcast(h, _ir.IntType(16))

        return _types.uint16(x), codegen

    @njit(cache=True, nogil=True, inline="always")
    def f32_bits_to_f16(x):
        """`f16_bits_arith` by the hardware cast: the same bits for every float32 pattern (checked over all 2**32
        once; tests/kvcache/test_kv_f16_cast.py keeps a sweep), NaN made 0x7e00 by a select. `f16_round_flat` on
        524288 elements: 0.46 -> 0.14 ms here (~0.9 -> 0.27 ns an element; one measurement, under load)."""
        sign = np.int64((x >> 16) & 0x8000)
        nan = np.int64(x & 0x7fffffff) > 0x7f800000
        return (sign | 0x7e00) if nan else np.int64(_fptrunc_f16(x))
else:
    f32_bits_to_f16 = f16_bits_arith


@njit(cache=True, nogil=True, inline="always")
def round_bits(x, fmt):
    """float32 bits (uint32) -> the 16-bit format ``fmt``'s bits (uint16)."""
    return np.uint16(f32_bits_to_f16(x) if fmt == FLOAT16 else f32_bits_to_bf16(x))


@njit(cache=True, nogil=True)
def f16_round_flat(u, out):
    """``out[i]`` = the float16 bits of float32 bits ``u[i]`` (`f32_bits_to_f16`); returns whether any result is
    inf or NaN (an OR over the lanes, so the loop vectorises; the caller finds the element)."""
    bad = 0
    for i in range(u.shape[0]):
        h = f32_bits_to_f16(u[i])
        out[i] = h
        bad |= np.int64((h & 0x7c00) == 0x7c00)
    return bad != 0


def to_f16(x: np.ndarray) -> tuple[np.ndarray, bool]:
    """float32 array ``x`` (any layout) -> (its float16 cast, bit for bit NumPy's ``astype``; whether any element
    is inf or NaN there): `f16_round_flat` over a C-contiguous copy, ~20x faster than NumPy's cast here."""
    out = np.empty(x.shape, np.float16)
    return out, f16_round_flat(np.ascontiguousarray(x).reshape(-1).view(np.uint32), out.reshape(-1).view(np.uint16))


@njit(cache=True, nogil=True)
def store_token_bits(k16, v16, layer, page, offset, k_bits, v_bits, fmt):
    """See the module docstring."""
    for h in range(k_bits.shape[0]):
        dst, src = k16[layer, page, h, offset], k_bits[h]
        for i in range(src.shape[0]):
            dst[i] = round_bits(src[i], fmt)
        dst, src = v16[layer, page, h, offset], v_bits[h]
        for i in range(src.shape[0]):
            dst[i] = round_bits(src[i], fmt)


@njit(cache=True, nogil=True)
def scatter_kv(k_dst, v_dst, pages, offsets, k, v, k_old, v_old):
    """One layer's ``k_dst [num_pages, H, page_size, D]`` (``v_dst``: Dv): row b of ``k [B, H, D]`` goes to slot
    ``offsets[b]`` of ``pages[b]``, its old contents to ``k_old [B, H, D]`` (same for v). Slots distinct."""
    for b in range(pages.shape[0]):
        page, offset = pages[b], offsets[b]
        for h in range(k.shape[1]):
            for i in range(k.shape[2]):
                k_old[b, h, i] = k_dst[page, h, offset, i]
                k_dst[page, h, offset, i] = k[b, h, i]
            for i in range(v.shape[2]):
                v_old[b, h, i] = v_dst[page, h, offset, i]
                v_dst[page, h, offset, i] = v[b, h, i]


@njit(cache=True, nogil=True)
def scatter_kv_bits(k16, v16, pages, offsets, k_bits, v_bits, k_old, v_old, fmt):
    """`scatter_kv` into a 16-bit layer (uint16 bits of format ``fmt``) from float32 input viewed as uint32 bits."""
    for b in range(pages.shape[0]):
        page, offset = pages[b], offsets[b]
        for h in range(k_bits.shape[1]):
            for i in range(k_bits.shape[2]):
                k_old[b, h, i] = k16[page, h, offset, i]
                k16[page, h, offset, i] = round_bits(k_bits[b, h, i], fmt)
            for i in range(v_bits.shape[2]):
                v_old[b, h, i] = v16[page, h, offset, i]
                v16[page, h, offset, i] = round_bits(v_bits[b, h, i], fmt)


_F32 = np.dtype(np.float32)


def writable(x):
    """``x`` as a jitted function should take it: numba types a read-only array apart from a writeable one, so a
    read-only argument (an array from Ray's object store, `np.broadcast_to`, a memory map, a frozen test input)
    compiles the function again for it: ~40 s for the attention kernels of one storage format, 1-4 s for each of
    the input check and the pool's stores. A read-only array is copied (the per-call inputs: q / k / v of the
    tokens of one call, small beside the pages); anything else is returned as it is, for the checks to judge."""
    return x if not isinstance(x, np.ndarray) or x.flags.writeable else x.copy()


def as_f32_bits(x: np.ndarray) -> np.ndarray | None:
    """``x`` (float32) viewed as uint32 bits, C-contiguous; None for another dtype."""
    if x.dtype != _F32:
        return None
    return (x if x.flags.c_contiguous else np.ascontiguousarray(x)).view(np.uint32)
