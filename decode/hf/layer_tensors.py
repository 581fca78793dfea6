"""One layer's torch tensors as the pool and the kernels take them, with no copy where the dtypes allow.

    check_query(q, batch, width, num_q_heads, head_dim)     ValueError / TypeError naming q's shape or dtype
    check_kv_dtype(name, x)                                 TypeError unless a float tensor
    check_finite(name, x, limit=None, rows=None)            ValueError at a value not finite (or >= limit)
    arrays_finite(a, b, c) -> bool                          numpy arrays' values finite (one jitted call)
    kv_rows(x, b, columns, bits) -> numpy [n, H, D]        row b's new K or V (real columns only)
    token_rows(x, bits) -> numpy [B, H, D]                  every row's one new K or V (a decode step)
    chunk_view(x, chunk) -> torch [rows, columns, H, D]     a chunk's queries (or output rows), a view

Shapes: q ``[B, num_q_heads, T, head_dim]``, k / v ``[B, num_kv_heads, T, head_dim(_v)]`` as transformers
hands them over; ``columns`` of row b: a ``slice`` of its real columns, or an int64 index tensor when they are
not consecutive (inner padding). bfloat16 K/V going to bfloat16 pages are handed over as their bits (``uint16``,
exactly what the pool stores: a bfloat16 tensor's bits are its storage), other float16 / float32 / float64
tensors as numpy views and bfloat16 ones converted to float32 (exact) for the pool to cast.
"""
import math

import numpy as np
import torch
from numba import njit

_CHECK_ELEMENTS = 1 << 21       # elements tested per step: the boolean temporary of a check stays <= 2 MiB
_NUMPY = (torch.float16, torch.float32, torch.float64)
_FLOATS = _NUMPY + (torch.bfloat16,)
_F32_MAX = float(np.finfo(np.float32).max)
# a float dtype's exponent field as a mask of its bits (all ones: inf or NaN), and the integer view of its bits
_EXPONENT = {torch.bfloat16: (torch.int16, 0x7F80), torch.float16: (torch.int16, 0x7C00),
             torch.float32: (torch.int32, 0x7F800000), torch.float64: (torch.int64, 0x7FF0000000000000)}
# the same of numpy arrays as the pool and the kernels take them (bfloat16 as its uint16 bits)
_ARRAY_BITS = {np.dtype(np.uint16): (np.uint16, np.uint16(0x7F80)),
               np.dtype(np.float16): (np.uint16, np.uint16(0x7C00)),
               np.dtype(np.float32): (np.uint32, np.uint32(0x7F800000)),
               np.dtype(np.float64): (np.uint64, np.uint64(0x7FF0000000000000))}


@njit(cache=True, nogil=True)
def _any_exponent_full(bits, mask):
    """Whether any element of the 1-D integer array ``bits`` has every bit of ``mask`` set (an OR over the
    lanes, so the loop vectorises)."""
    bad = 0
    for i in range(bits.shape[0]):
        bad |= np.int64((bits[i] & mask) == mask)
    return bad != 0


@njit(cache=True, nogil=True)
def _any_exponent_full3(a, mask_a, b, mask_b, c, mask_c):
    """`_any_exponent_full` of three arrays in one call (`arrays_finite`)."""
    return _any_exponent_full(a, mask_a) or _any_exponent_full(b, mask_b) or _any_exponent_full(c, mask_c)


def _flat_bits(x: torch.Tensor):
    """``(bits, mask)``: the elements of ``x`` as a 1-D integer view of their bits (no copy) and the mask of
    their exponent field, or None when the strides of ``x`` are not a permutation of a contiguous layout. q / k /
    v as transformers hands them over (``[B, T, H, D]`` transposed to ``[B, H, T, D]``, or a range of columns of
    it) are such permutations."""
    view, mask = _EXPONENT[x.dtype]
    bits = x.detach().view(view).numpy()
    if not x.is_contiguous():
        order = sorted(range(bits.ndim), key=lambda a: (bits.strides[a], bits.shape[a]), reverse=True)
        bits = bits.transpose(order)
        if not bits.flags.c_contiguous:
            return None
    return bits.reshape(-1), bits.dtype.type(mask)


def _surely_finite(x: torch.Tensor) -> bool:
    """True when every element of ``x`` is finite, by one vectorised pass over its bits (`_flat_bits`); False
    when one is not, or when its layout is not one `_flat_bits` takes (then the caller tests it in torch). No
    copy, no temporary (torch's isfinite made a boolean tensor of each, 2-3 ms a layer of a 512-token bfloat16
    prefill)."""
    if x.numel() == 0:
        return True
    flat = _flat_bits(x)
    return flat is not None and not _any_exponent_full(*flat)


def check_query(q, batch: int, width: int, num_q_heads: int, head_dim: int) -> None:
    """q must be ``[batch, num_q_heads, width, head_dim]`` of a float dtype (the forward's planned shape)."""
    if not isinstance(q, torch.Tensor) or q.dtype not in _FLOATS:
        got = q.dtype if isinstance(q, torch.Tensor) else type(q).__name__
        raise TypeError(f"query: expected a float16 / bfloat16 / float32 / float64 tensor, got {got}")
    expected = (batch, num_q_heads, width, head_dim)
    if tuple(q.shape) != expected:
        raise ValueError(f"query: expected shape [batch, num_q_heads, new, head_dim] = {expected} (the forward's "
                         f"plan), got {tuple(q.shape)}")


def check_kv_dtype(name: str, x) -> None:
    if not isinstance(x, torch.Tensor) or x.dtype not in _FLOATS:
        got = x.dtype if isinstance(x, torch.Tensor) else type(x).__name__
        raise TypeError(f"{name}: expected a float16 / bfloat16 / float32 / float64 tensor, got {got}")


def check_finite(name: str, x: torch.Tensor, limit: float | None = None, rows=None) -> None:
    """ValueError naming the value and its index ``(b, h, t, d)`` at a value of ``x [B, H, T, D]`` that is not
    finite, or whose magnitude is >= ``limit`` (it would overflow the float32 it goes to); only the ``rows``
    (``[(b, columns)]``, as `kv_rows` takes them) when given. Tested a few columns at a time, so the boolean
    temporary stays small. Without a limit the bits are tested first in one jitted pass (`_surely_finite`); the
    torch path runs only to find and name a bad value (or for a layout that pass does not take)."""
    if rows is None:
        if limit is None and _surely_finite(x):
            return
        _check_part(name, x, 0, slice(None), limit)
        return
    for b, columns in rows:
        if limit is None and isinstance(columns, slice) and _surely_finite(x[b:b + 1, :, columns]):
            continue
        _check_part(name, x[b:b + 1], b, columns, limit)


def arrays_finite(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> bool:
    """True when every value of three numpy arrays (float16 / float32 / float64, or bfloat16 bits as uint16) is
    finite, in one jitted call; False when one is not, or when an array is not C-contiguous (then the caller
    tests the tensors with `check_finite`, which names the value). A decode step's q, k and v."""
    if not (a.flags.c_contiguous and b.flags.c_contiguous and c.flags.c_contiguous):
        return False
    return not _any_exponent_full3(*_array_bits(a), *_array_bits(b), *_array_bits(c))


def _array_bits(a: np.ndarray):
    view, mask = _ARRAY_BITS[a.dtype]
    return a.reshape(-1).view(view), mask


def _check_part(name, x, b, columns, limit) -> None:
    """The ``columns`` of ``x [rows, H, T, D]``, whose first row is row ``b``."""
    if isinstance(columns, torch.Tensor):
        pieces = [(x.index_select(2, columns), columns)]
    else:
        start, stop, _ = columns.indices(x.shape[2])
        step = max(1, _CHECK_ELEMENTS // max(1, x[:, :, :1].numel()))
        pieces = [(x[:, :, t:min(t + step, stop)], t) for t in range(start, stop, step)]
    for part, where in pieces:
        ok = torch.isfinite(part) if limit is None else part.abs() < limit
        if bool(ok.all()):
            continue
        i = [int(j) for j in (~ok).nonzero()[0]]
        value = part[tuple(i)].item()
        i[0] += b
        i[2] = int(where[i[2]]) if isinstance(where, torch.Tensor) else where + i[2]
        if math.isfinite(value):
            raise ValueError(f"{name}: expected values finite in float32 (|x| <= {_F32_MAX:.8g}), got {value} at "
                             f"index {tuple(i)}")
        raise ValueError(f"{name}: expected finite values, got {value} at index {tuple(i)}")


def kv_rows(x: torch.Tensor, b: int, columns, bits: bool) -> np.ndarray:
    """Row b's new K (or V) ``[n, H, D]`` for the pool: ``bits`` (bfloat16 into bfloat16 pages) its uint16 bits
    (a view), float16 / float32 / float64 a numpy view, bfloat16 otherwise a float32 copy (exact)."""
    rows = (x[b, :, columns] if isinstance(columns, slice) else x[b].index_select(1, columns)).transpose(0, 1)
    return _as_pool_rows(rows, bits)


def token_rows(x: torch.Tensor, bits: bool) -> np.ndarray:
    """The one new column of every row, ``x [B, H, 1, D]`` -> ``[B, H, D]``, as `kv_rows` converts it (the
    column taken in numpy: a torch index costs several times more)."""
    return _as_pool_rows(x, bits)[:, :, 0]


def _as_pool_rows(rows: torch.Tensor, bits: bool) -> np.ndarray:
    if bits:
        return rows.view(torch.uint16).numpy()
    if rows.dtype in _NUMPY:
        return rows.numpy()
    return rows.to(torch.float32).numpy()


def chunk_view(x: torch.Tensor, chunk, transposed: bool) -> torch.Tensor:
    """The ``[rows, columns, H, D]`` view of a chunk ``(b0, b1, t0, t1, q0)`` (`decode.hf.query_chunks`): of q
    ``[B, H, T, D]`` (``transposed``) or of the output ``[B, T, H, Dv]``."""
    b0, b1, t0, t1, _ = chunk
    if transposed:
        return x[b0:b1, :, t0:t1].transpose(1, 2)
    return x[b0:b1, t0:t1]
