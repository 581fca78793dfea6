"""Paged attention: the checked public wrapper around the kernels (planned by `decode.attention_plan`, computed
by `decode.kernels`; see docs/kernel.md).

    out = paged_decode_attention(q, k_pages, v_pages, page_indices, page_indptr, query_seq, query_pos,
                                 scale=None, window=0, out=None, k_scales=None, v_scales=None,
                                 storage=None, precision="default")

Shapes (named dimensions):
    q:            [num_queries, num_q_heads, head_dim]              float32 or float64
    k_pages:      [num_pages, num_kv_heads, page_size, head_dim]    float16 / float32 / float64 / int8, or uint16
                                                                    bfloat16 bits (storage="bfloat16"), C-contiguous
    v_pages:      [num_pages, num_kv_heads, page_size, head_dim_v]  same dtype as k_pages, C-contiguous
    k_scales:     [num_pages, num_kv_heads, page_size, ceil(head_dim / 32)]    float16, int8 pages only (None
    v_scales:     [num_pages, num_kv_heads, page_size, ceil(head_dim_v / 32)]  otherwise): kvcache.quant's format
    page_indices: int [total_pages]     sequence s's logical page j is physical page
                                        page_indices[page_indptr[s] + j]; -1 = freed (outside the window)
    page_indptr:  int [num_seqs + 1]    CSR row pointers into page_indices
    query_seq:    int [num_queries]     the sequence (CSR row) of each query
    query_pos:    int [num_queries]     absolute position p of each query: it reads keys at positions lo..p,
                                        lo = 0 (window == 0) or max(0, p - window + 1)
    returns       [num_queries, num_q_heads, head_dim_v]            float32 (float64 for float64 storage)

Query head h uses kv head h // (num_q_heads // num_kv_heads) (GQA / MQA). q.k is accumulated in float32 for
every storage format but float64 (precision="highest": in float64, each score its exact value rounded once;
not for int8); scores, softmax and accumulation are float32 (float64 for float64 storage). int8 pages are read
with their scales, bfloat16 pages as their bits (no dequantized copy); like the K/V values, the scales are not
checked (they come from the cache, which writes only finite ones).

`decode.attention_plan.attend_unchecked` (same arguments, positional scale / window / out) skips validation;
`decode.attention_plan.AttentionPlan` plans once and runs per layer.
"""
import math

import numpy as np

from kvcache.jit_store import writable

from .attention_plan import BFLOAT16, PRECISIONS, attend_unchecked, compute_dtype
from .kernels.input_check import CheckCode, check_inputs

_F32_LIMIT = 3.4028235677973366e38   # float32 max + half an ulp: the smallest float64 that rounds to inf
_FLOATS = (np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64))
_STORAGE = _FLOATS + (np.dtype(np.int8),)
_STORAGE_NAMES = ("float16", "float32", "float64", "int8", BFLOAT16)
_F16 = np.dtype(np.float16)
_SCALE_GROUP = 32
_Q_FLOATS = (np.dtype(np.float32), np.dtype(np.float64))
_I32 = np.dtype(np.int32)
_I64 = np.dtype(np.int64)


def _array(name, x, ndim, kinds, what):
    if not isinstance(x, np.ndarray):
        if x is None or isinstance(x, (str, bytes, dict, set)):
            raise TypeError(f"{name}: expected {what}, got {type(x).__name__}")
        x = np.asarray(x)
    if x.dtype.kind not in kinds:
        raise TypeError(f"{name}: expected {what}, got dtype {x.dtype}")
    if x.ndim != ndim:
        raise ValueError(f"{name}: expected a {ndim}-d array, got shape {x.shape}")
    return x


def _index_array(name, x, dtype):
    x = _array(name, x, 1, "iu", "an integer array")
    if x.dtype != dtype:
        if x.size and not np.can_cast(x.dtype, dtype) and (x.min() < np.iinfo(dtype).min
                                                           or x.max() > np.iinfo(dtype).max):
            raise ValueError(f"{name}: expected values that fit {dtype}, got range [{x.min()}, {x.max()}]")
        x = x.astype(dtype)
    return x


def paged_decode_attention(q, k_pages, v_pages, page_indices, page_indptr, query_seq, query_pos, *,
                           scale=None, window=0, out=None, k_scales=None, v_scales=None, storage=None,
                           precision="default") -> np.ndarray:
    """Attention of each query over its sequence's keys ``lo..p`` read through the page table.

    Every input is checked before anything is computed; errors are ``TypeError`` (wrong kinds: int / bool /
    complex / object data) or ``ValueError`` (shapes, values), with messages ``"name: expected ..., got ..."``.
    See the module docstring for the shapes; storage: None (the format of k_pages' dtype), a format's name
    ("float16", "float32", "float64", "int8": it must be k_pages' dtype) or "bfloat16" (uint16 pages of bfloat16
    bits); precision: "default" or "highest"."""
    storage = _check_storage(k_pages, v_pages, storage)
    compute = compute_dtype(storage)
    _check_scales(k_pages, v_pages, k_scales, v_scales)
    num_pages, num_kv_heads, page_size, head_dim = k_pages.shape
    q = _check_query(q, num_kv_heads, head_dim)
    scale, window = _check_scalars(scale, window, head_dim)
    _check_precision(precision, k_pages)
    page_indices = _index_array("page_indices", page_indices, _I32)
    page_indptr = _index_array("page_indptr", page_indptr, _I64)
    if len(page_indptr) < 2:
        raise ValueError(f"page_indptr: expected num_seqs + 1 >= 2 entries, got {len(page_indptr)}")
    query_seq = _index_array("query_seq", query_seq, _I32)
    query_pos = _index_array("query_pos", query_pos, _I64)
    num_queries = q.shape[0]
    for name, x in (("query_seq", query_seq), ("query_pos", query_pos)):
        if len(x) != num_queries:
            raise ValueError(f"{name}: expected {num_queries} entries (num_queries), got {len(x)}")
    out = _check_out(out, (num_queries, q.shape[1], v_pages.shape[3]), compute)
    if num_queries == 0:
        return out
    q = writable(q)              # a read-only q would compile the input check and the kernels again
    q_limit = _F32_LIMIT if q.itemsize > compute.itemsize else math.inf
    q_flat = q.reshape(-1) if q.flags.c_contiguous else np.ascontiguousarray(q).reshape(-1)
    code, bad = check_inputs(q_flat, q_limit, page_indices, page_indptr, query_seq, query_pos, num_pages,
                             page_size, window)
    if code:
        raise _input_error(CheckCode(code), bad, q, compute, page_indices, page_indptr, query_seq, query_pos,
                           num_pages, page_size, window)
    q = np.ascontiguousarray(q, dtype=compute)
    return attend_unchecked(q, k_pages, v_pages, page_indices, page_indptr, query_seq, query_pos, scale, window,
                            out, k_scales=k_scales, v_scales=v_scales, storage=storage, precision=precision)


def _check_storage(k_pages, v_pages, storage):
    """The storage format of checked K/V pages: their dtype, or "bfloat16" for uint16 pages so named (a given
    name of another format must be the pages' dtype)."""
    if storage is not None and (not isinstance(storage, str) or storage not in _STORAGE_NAMES):
        raise ValueError(f"storage: expected None or one of {_STORAGE_NAMES}, got {storage!r}")
    if storage not in (None, BFLOAT16) and isinstance(k_pages, np.ndarray) and k_pages.dtype != np.dtype(storage):
        raise TypeError(f"k_pages: expected dtype {storage} (storage={storage!r}), got {k_pages.dtype}")
    storage = None if storage != BFLOAT16 else storage
    for name, x in (("k_pages", k_pages), ("v_pages", v_pages)):
        if not isinstance(x, np.ndarray):
            raise TypeError(f"{name}: expected a numpy array, got {type(x).__name__}")
        if storage == BFLOAT16 and x.dtype != np.uint16:
            raise TypeError(f"{name}: expected uint16 (bfloat16 bits, storage='bfloat16'), got dtype {x.dtype}")
        if storage is None and x.dtype not in _STORAGE:
            raise TypeError(f"{name}: expected float16, float32, float64 or int8 (or uint16 bfloat16 bits with "
                            f"storage='bfloat16'), got dtype {x.dtype}")
        if x.ndim != 4:
            raise ValueError(f"{name}: expected a 4-d array [num_pages, num_kv_heads, page_size, head_dim], "
                             f"got shape {x.shape}")
        if not x.flags.c_contiguous:
            raise ValueError(f"{name}: expected a C-contiguous array, got strides {x.strides}")
    if v_pages.dtype != k_pages.dtype:
        raise TypeError(f"v_pages: expected dtype {k_pages.dtype} (as k_pages), got {v_pages.dtype}")
    if v_pages.shape[:3] != k_pages.shape[:3]:
        raise ValueError("v_pages: expected shape ({}, {}, {}, head_dim_v) like k_pages, got {}".format(
            *k_pages.shape[:3], v_pages.shape))
    if min(k_pages.shape[1:]) < 1 or v_pages.shape[3] < 1:
        raise ValueError(f"k_pages: expected num_kv_heads, page_size, head_dim >= 1, got shape {k_pages.shape}"
                         f" (v_pages {v_pages.shape})")
    return BFLOAT16 if storage == BFLOAT16 else k_pages.dtype


def _check_query(q, num_kv_heads: int, head_dim: int):
    q = _array("q", q, 3, "f", "a float32 or float64 array")
    if q.dtype not in _Q_FLOATS:
        raise TypeError(f"q: expected float32 or float64, got dtype {q.dtype}")
    if q.shape[2] != head_dim:
        raise ValueError(f"q: expected head_dim {head_dim} (from k_pages), got shape {q.shape}")
    if q.shape[1] < 1 or q.shape[1] % num_kv_heads:
        raise ValueError(f"q: expected num_q_heads a positive multiple of num_kv_heads={num_kv_heads}, "
                         f"got {q.shape[1]}")
    return q


def _check_scalars(scale, window, head_dim: int) -> tuple[float, int]:
    if scale is None:
        scale = 1.0 / math.sqrt(head_dim)
    else:
        if isinstance(scale, (bool, np.bool_)) or not isinstance(scale, (int, float, np.integer, np.floating)):
            raise TypeError(f"scale: expected a float, got {type(scale).__name__}")
        scale = float(scale)
        if not math.isfinite(scale) or scale <= 0.0:
            raise ValueError(f"scale: expected a finite float > 0, got {scale!r}")
    if isinstance(window, (bool, np.bool_)) or not isinstance(window, (int, np.integer)):
        raise TypeError(f"window: expected an int, got {type(window).__name__}")
    if window < 0:
        raise ValueError(f"window: expected an int >= 0 (0 = no window), got {int(window)}")
    return scale, int(window)


def _check_precision(precision, k_pages) -> None:
    if not isinstance(precision, str) or precision not in PRECISIONS:
        raise ValueError(f"precision: expected one of {PRECISIONS}, got {precision!r}")
    if precision == "highest" and k_pages.dtype == np.int8:
        raise ValueError("precision: expected 'default' for int8 pages (float64 q.k is not implemented for int8), "
                         "got 'highest'")


def _check_out(out, shape: tuple, compute: np.dtype) -> np.ndarray:
    if out is None:
        return np.empty(shape, dtype=compute)
    if not isinstance(out, np.ndarray):
        raise TypeError(f"out: expected a numpy array, got {type(out).__name__}")
    if out.dtype != compute:
        raise TypeError(f"out: expected dtype {compute}, got {out.dtype}")
    if out.shape != shape:
        raise ValueError(f"out: expected shape {shape}, got {out.shape}")
    if not out.flags.c_contiguous or not out.flags.writeable:
        raise ValueError("out: expected a writeable C-contiguous array, got "
                         f"{'a read-only' if not out.flags.writeable else 'a non-contiguous'} array")
    return out


def _check_scales(k_pages, v_pages, k_scales, v_scales) -> None:
    """int8 pages need float16 scales ``[num_pages, num_kv_heads, page_size, ceil(width / 32)]``; float pages none."""
    for name, pages, scales in (("k_scales", k_pages, k_scales), ("v_scales", v_pages, v_scales)):
        if pages.dtype != np.int8:
            if scales is not None:
                raise ValueError(f"{name}: expected None for {pages.dtype} pages (scales belong to int8 pages), "
                                 f"got {type(scales).__name__}")
            continue
        if not isinstance(scales, np.ndarray):
            raise TypeError(f"{name}: expected a float16 numpy array for int8 pages, got {type(scales).__name__}")
        if scales.dtype != _F16:
            raise TypeError(f"{name}: expected dtype float16, got {scales.dtype}")
        shape = pages.shape[:3] + (-(-pages.shape[3] // _SCALE_GROUP),)
        if scales.shape != shape:
            raise ValueError(f"{name}: expected shape [num_pages, num_kv_heads, page_size, ceil(width / 32)] = "
                             f"{shape}, got {scales.shape}")
        if not scales.flags.c_contiguous:
            raise ValueError(f"{name}: expected a C-contiguous array, got strides {scales.strides}")


def _input_error(code, bad, q, compute, page_indices, page_indptr, query_seq, query_pos, num_pages, page_size,
                 window):
    if code >= CheckCode.NOT_FINITE:
        i = tuple(int(x) for x in np.unravel_index(bad, q.shape))
        if code == CheckCode.NOT_FINITE:
            return ValueError(f"q: expected finite values, got {q[i]} at index {i}")
        return ValueError(f"q: expected values finite in {compute} (|x| <= {float(np.finfo(compute).max):.8g}), "
                          f"got {q[i]} at index {i}")
    num_seqs = len(page_indptr) - 1
    if code == CheckCode.BAD_INDPTR:
        return ValueError(f"page_indptr: expected non-decreasing offsets in [0, {len(page_indices)}], "
                          f"got {page_indptr.tolist() if num_seqs < 20 else page_indptr} (entry {bad})")
    if code == CheckCode.BAD_PAGE:
        return ValueError(f"page_indices: expected physical pages in [0, {num_pages}) (or -1 for a freed page), "
                          f"got {page_indices[bad]} at index {bad}")
    if code == CheckCode.BAD_SEQ:
        return ValueError(f"query_seq: expected sequence indices in [0, {num_seqs}), got {query_seq[bad]} "
                          f"at index {bad}")
    s, p = int(query_seq[bad]), int(query_pos[bad])
    if code == CheckCode.BAD_POSITION:
        capacity = int(page_indptr[s + 1] - page_indptr[s]) * page_size
        return ValueError(f"query_pos: expected 0 <= position < {capacity} (the page capacity of sequence {s}), "
                          f"got {p} at index {bad}")
    lo = max(0, p - window + 1) if window else 0
    return ValueError(f"page_indices: expected allocated pages for the visible positions {lo}..{p} of query {bad} "
                      f"(sequence {s}), got a freed page (-1)")
