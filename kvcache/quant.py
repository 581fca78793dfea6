"""The int8 storage format: the one quantize / dequantize rule of the cache.

Format (per layer; K shown, V likewise with ``head_dim_v``):

    k_pages:  int8    [num_pages, num_kv_heads, page_size, head_dim]
    k_scales: float16 [num_pages, num_kv_heads, page_size, num_groups],  num_groups = ceil(head_dim / 32)

Every (page, kv head, slot) row of ``head_dim`` values is cut into groups of `GROUP_SIZE` = 32 consecutive
values (the last group is shorter when head_dim is not a multiple of 32); each group has its own symmetric
scale, stored as float16 beside the pages (llama.cpp's q8_0 block: 32 int8 + one float16 = 8.5 bits per value).

The rule, for one group ``x`` (any float dtype, computed in float64):

    scale  = max|x| / 127 rounded UP to a float16        (so |x / scale| <= 127: nothing clips)
    q      = rint(x / scale) as int8, in [-127, 127]      (quantized with the *stored* scale)
    x'     = q * scale                                    (dequantized; exact in float32: 8 x 11 bits)

so every stored element is within ``scale / 2`` of its input (llama.cpp quantizes with the unrounded scale,
which can put an element up to 127.5 * ulp(scale) further away). A group of zeros has scale 0 and q 0.
The scale of a row depends on that row alone: appends stay O(1), a batched append stores the same bytes as
token-by-token appends, and a written row never changes when later rows arrive.

Range: the largest float16 is 65504, so a group with ``max|x| > 127 * 65504`` (`MAX_ABS`, 8.3e6) has no
scale; `kvcache.checks.check_quantizable` raises `ScaleOverflowError` (a ValueError naming the element)
before anything changes. float16 rather than float32 scales: half the overhead (6.25% of the int8 bytes
instead of 12.5%) and the rounding up costs at most one float16 ulp (2**-10 relative) of quantization step.
"""
import numpy as np


GROUP_SIZE = 32
SCALE_DTYPE = np.dtype(np.float16)
VALUE_DTYPE = np.dtype(np.int8)
QMAX = 127
MAX_ABS = QMAX * float(np.finfo(np.float16).max)     # 8319008.0: the largest max|x| with a float16 scale


def num_groups(width: int) -> int:
    """Scale groups of one row of ``width`` values: ``ceil(width / 32)``."""
    return -(-width // GROUP_SIZE)


def _grouped(x: np.ndarray) -> np.ndarray:
    """``x [..., width]`` as float64 ``[..., num_groups, 32]`` (the last group zero-padded)."""
    width = x.shape[-1]
    groups = num_groups(width)
    x = np.asarray(x, dtype=np.float64)
    if width != groups * GROUP_SIZE:
        pad = np.zeros(x.shape[:-1] + (groups * GROUP_SIZE,), dtype=np.float64)
        pad[..., :width] = x
        x = pad
    return x.reshape(x.shape[:-1] + (groups, GROUP_SIZE))             # [..., num_groups, 32]


def scales_for(x: np.ndarray) -> np.ndarray:
    """float16 ``[..., num_groups]``: each group's ``max|x| / 127`` rounded up to a float16 (finite input with
    ``max|x| <= MAX_ABS`` assumed: see `kvcache.checks.check_quantizable`)."""
    peak = np.abs(_grouped(x)).max(axis=-1)                             # [..., num_groups] float64
    exact = peak / QMAX
    with np.errstate(over="ignore"):
        scale = exact.astype(SCALE_DTYPE)
    # rounded up; a tiny nonzero group whose max / 127 underflows float64 (5e-324 / 127 == 0) still gets the
    # smallest float16 scale, so that no element is further than scale / 2 from its input
    low = (scale.astype(np.float64) < exact) | ((scale == 0) & (peak > 0))
    if low.any():
        scale[low] = np.nextafter(scale[low], SCALE_DTYPE.type(np.inf))
    return scale


def quantize(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``x [..., width]`` (float, finite, validated by `kvcache.checks.check_quantizable`) -> ``(q int8 [..., width],
    scales float16 [..., num_groups])`` by the rule of the module docstring."""
    width = x.shape[-1]
    scale = scales_for(x)                                               # [..., G] float16
    step = scale.astype(np.float64)[..., None]                          # [..., G, 1]
    grouped = _grouped(x)                                               # [..., G, 32]
    q = np.zeros(grouped.shape, dtype=np.float64)
    np.divide(grouped, step, out=q, where=step > 0)
    np.rint(q, out=q)
    np.clip(q, -QMAX, QMAX, out=q)                                      # a no-op by construction; a guard
    q = q.reshape(q.shape[:-2] + (-1,))[..., :width]                    # [..., G * 32] -> [..., width]
    return q.astype(VALUE_DTYPE), scale


def dequantize(q: np.ndarray, scales: np.ndarray, dtype=np.float32) -> np.ndarray:
    """``q int8 [..., width]``, ``scales [..., num_groups]`` -> ``[..., width]`` in ``dtype`` (float32: exact)."""
    width = q.shape[-1]
    step = np.repeat(scales.astype(np.float64), GROUP_SIZE, axis=-1)[..., :width]   # [..., width]
    return (q.astype(np.float64) * step).astype(dtype)
