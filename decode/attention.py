"""Paged single-query ("decode") attention: the validating wrapper around the kernels in `decode.kernels`
(`decode_units` on the calling thread, `plan_units` + `decode_parallel` on all threads; see docs/kernel.md).

    out = paged_decode_attention(q, k_pages, v_pages, page_indices, page_indptr, query_seq, query_pos,
                                 scale=None, window=0, out=None, k_scales=None, v_scales=None)

Shapes (named dimensions):
    q:            [num_queries, num_q_heads, head_dim]              float32 or float64
    k_pages:      [num_pages, num_kv_heads, page_size, head_dim]    float16 / float32 / float64 / int8, C-contiguous
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

Query head h uses kv head h // (num_q_heads // num_kv_heads) (GQA / MQA). Scores and accumulation are float32
for float16/float32/int8 storage (q is cast to float32) and float64 for float64 storage. int8 pages are read
with their scales by `decode.kernels.int8` (no dequantized copy); like the K/V values, the scales are not
checked (they come from the cache, which writes only finite ones).

`_paged_decode_attention_unchecked` (same arguments, positional scale / window / out) skips validation: for
callers that validated their inputs already (the Decoder). `plan_decode` computes the work partition once
(`DecodePlan`); `plan.run(...)` is the per-layer kernel call of a multi-layer token or batch step.
"""
import math

import numpy as np
import numba

from . import kernels as _kernels
from . import multiquery as _multiquery

# Dispatch thresholds (measured, see docs/kernel.md)
SERIAL_WORK = 1 << 19        # visible tokens * num_q_heads * (head_dim + head_dim_v) below this: no threads
MIN_SPLIT_WORK = 1 << 20     # a flash-decoding split holds at least this much work (tokens * num_q_heads *
                             # (head_dim + head_dim_v)), then rounded up to whole blocks
UNITS_PER_THREAD = 2         # a query's key range is cut into about this many units per thread (load balance)
BLOCK_TOKENS = 64            # keys per online-softmax block (rounded down to whole pages, at least one page)
PREFETCH_BYTES = 4096        # software prefetch distance along the walk of K and V runs (docs/kernel.md)
INT8_MIN_SPLIT_TOKENS = 256  # the int8 kernel's shortest key-range split

_F32_LIMIT = 3.4028235677973366e38   # float32 max + half an ulp: the smallest float64 that rounds to inf
_FLOATS = (np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64))
_STORAGE = _FLOATS + (np.dtype(np.int8),)
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
                           scale=None, window=0, out=None, k_scales=None, v_scales=None) -> np.ndarray:
    """Attention of each query over its sequence's keys ``lo..p`` read through the page table.

    Every input is checked before anything is computed; errors are ``TypeError`` (wrong kinds: int / bool /
    complex / object data) or ``ValueError`` (shapes, values), with messages ``"name: expected ..., got ..."``.
    See the module docstring for the shapes."""
    # ---- storage
    for name, x in (("k_pages", k_pages), ("v_pages", v_pages)):
        if not isinstance(x, np.ndarray):
            raise TypeError(f"{name}: expected a numpy array, got {type(x).__name__}")
        if x.dtype not in _STORAGE:
            raise TypeError(f"{name}: expected float16, float32, float64 or int8, got dtype {x.dtype}")
        if x.ndim != 4:
            raise ValueError(f"{name}: expected a 4-d array [num_pages, num_kv_heads, page_size, head_dim], "
                             f"got shape {x.shape}")
        if not x.flags.c_contiguous:
            raise ValueError(f"{name}: expected a C-contiguous array, got strides {x.strides}")
    if v_pages.dtype != k_pages.dtype:
        raise TypeError(f"v_pages: expected dtype {k_pages.dtype} (as k_pages), got {v_pages.dtype}")
    num_pages, num_kv_heads, page_size, head_dim = k_pages.shape
    if v_pages.shape[:3] != k_pages.shape[:3]:
        raise ValueError(f"v_pages: expected shape ({num_pages}, {num_kv_heads}, {page_size}, head_dim_v) "
                         f"like k_pages, got {v_pages.shape}")
    head_dim_v = v_pages.shape[3]
    if num_kv_heads < 1 or page_size < 1 or head_dim < 1 or head_dim_v < 1:
        raise ValueError(f"k_pages: expected num_kv_heads, page_size, head_dim >= 1, got shape {k_pages.shape}"
                         f" (v_pages {v_pages.shape})")
    compute = np.dtype(np.float64) if k_pages.dtype == np.float64 else np.dtype(np.float32)
    _check_scales(k_pages, v_pages, k_scales, v_scales)

    # ---- queries
    q = _array("q", q, 3, "f", "a float32 or float64 array")
    if q.dtype not in _Q_FLOATS:
        raise TypeError(f"q: expected float32 or float64, got dtype {q.dtype}")
    num_queries, num_q_heads, qd = q.shape
    if qd != head_dim:
        raise ValueError(f"q: expected head_dim {head_dim} (from k_pages), got shape {q.shape}")
    if num_q_heads < 1 or num_q_heads % num_kv_heads:
        raise ValueError(f"q: expected num_q_heads a positive multiple of num_kv_heads={num_kv_heads}, "
                         f"got {num_q_heads}")
    q_limit = _F32_LIMIT if q.itemsize > compute.itemsize else math.inf

    # ---- scalars
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
    window = int(window)
    if window < 0:
        raise ValueError(f"window: expected an int >= 0 (0 = no window), got {window}")

    # ---- page table
    page_indices = _index_array("page_indices", page_indices, _I32)
    page_indptr = _index_array("page_indptr", page_indptr, _I64)
    if len(page_indptr) < 2:
        raise ValueError(f"page_indptr: expected num_seqs + 1 >= 2 entries, got {len(page_indptr)}")
    num_seqs = len(page_indptr) - 1

    # ---- queries -> sequences, positions
    query_seq = _index_array("query_seq", query_seq, _I32)
    query_pos = _index_array("query_pos", query_pos, _I64)
    if len(query_seq) != num_queries:
        raise ValueError(f"query_seq: expected {num_queries} entries (num_queries), got {len(query_seq)}")
    if len(query_pos) != num_queries:
        raise ValueError(f"query_pos: expected {num_queries} entries (num_queries), got {len(query_pos)}")

    # ---- out
    shape = (num_queries, num_q_heads, head_dim_v)
    if out is not None:
        if not isinstance(out, np.ndarray):
            raise TypeError(f"out: expected a numpy array, got {type(out).__name__}")
        if out.dtype != compute:
            raise TypeError(f"out: expected dtype {compute}, got {out.dtype}")
        if out.shape != shape:
            raise ValueError(f"out: expected shape {shape}, got {out.shape}")
        if not out.flags.c_contiguous or not out.flags.writeable:
            raise ValueError("out: expected a writeable C-contiguous array, got "
                             f"{'a read-only' if not out.flags.writeable else 'a non-contiguous'} array")
    else:
        out = np.empty(shape, dtype=compute)
    if num_queries == 0:
        return out

    q_flat = q.reshape(-1) if q.flags.c_contiguous else np.ascontiguousarray(q).reshape(-1)
    code, bad = _kernels.check_inputs(q_flat, q_limit, page_indices, page_indptr, query_seq, query_pos, num_pages,
                                      page_size, window)
    if code:
        raise _input_error(code, bad, q, compute, page_indices, page_indptr, query_seq, query_pos, num_pages,
                           page_size, window)
    if q.dtype != compute:
        q = q.astype(compute, order="C")
    elif not q.flags.c_contiguous:
        q = np.ascontiguousarray(q)
    return _paged_decode_attention_unchecked(q, k_pages, v_pages, page_indices, page_indptr, query_seq, query_pos,
                                             scale, window, out, k_scales=k_scales, v_scales=v_scales)


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
    if code >= 6:
        i = tuple(int(x) for x in np.unravel_index(bad, q.shape))
        if code == 6:
            return ValueError(f"q: expected finite values, got {q[i]} at index {i}")
        return ValueError(f"q: expected values finite in {compute} (|x| <= {float(np.finfo(compute).max):.8g}), "
                          f"got {q[i]} at index {i}")
    num_seqs = len(page_indptr) - 1
    if code == 1:
        return ValueError(f"page_indptr: expected non-decreasing offsets in [0, {len(page_indices)}], "
                          f"got {page_indptr.tolist() if num_seqs < 20 else page_indptr} (entry {bad})")
    if code == 2:
        return ValueError(f"page_indices: expected physical pages in [0, {num_pages}) (or -1 for a freed page), "
                          f"got {page_indices[bad]} at index {bad}")
    if code == 3:
        return ValueError(f"query_seq: expected sequence indices in [0, {num_seqs}), got {query_seq[bad]} "
                          f"at index {bad}")
    s, p = int(query_seq[bad]), int(query_pos[bad])
    if code == 4:
        capacity = int(page_indptr[s + 1] - page_indptr[s]) * page_size
        return ValueError(f"query_pos: expected 0 <= position < {capacity} (the page capacity of sequence {s}), "
                          f"got {p} at index {bad}")
    lo = max(0, p - window + 1) if window else 0
    return ValueError(f"page_indices: expected allocated pages for the visible positions {lo}..{p} of query {bad} "
                      f"(sequence {s}), got a freed page (-1)")


class DecodePlan:
    """The work partition of one kernel call, computed once from the queries' positions and the shapes and reused
    by every layer that attends with the same page table and positions (a multi-layer token or batch step).

    serial: run `decode_units` on the calling thread (one unit per query); otherwise `decode_parallel` with
    units [U, 4] = (query, lo, hi, slot), bounds [threads + 1], items [n_split, 3] (from `plan_units`).
    block: keys per online-softmax block; ahead: prefetch distance (bytes)."""

    __slots__ = ("serial", "block", "ahead", "units", "bounds", "items", "num_slots", "num_queries", "workspace")

    def __init__(self, query_pos, window, num_q_heads, num_kv_heads, head_dim, head_dim_v, page_size, dtype, *,
                 mode=0, split_tokens=0):
        nq = len(query_pos)
        if nq == 1:
            p1 = int(query_pos[0]) + 1
            work = min(p1, window) if window else p1
        elif window:
            work = int(np.minimum(query_pos + 1, window).sum())
        else:
            work = int(query_pos.sum()) + nq
        self.num_queries = nq
        self.block = block = page_size * max(1, BLOCK_TOKENS // page_size)
        self.ahead = PREFETCH_BYTES
        serial = mode == 1 or (mode == 0 and work * num_q_heads * (head_dim + head_dim_v) < SERIAL_WORK)
        if not serial:
            nthreads = numba.get_num_threads()
            min_split = -(-MIN_SPLIT_WORK // (num_q_heads * (head_dim + head_dim_v)))
            split = split_tokens if split_tokens > 0 else max(min_split, -(-work // (UNITS_PER_THREAD * nthreads)))
            split = -(-split // block) * block
            serial = mode == 0 and (nthreads < 2 or (nq == 1 and work <= split))   # a single unit
        self.serial = serial
        if serial:
            self.units, self.bounds, self.items, self.num_slots = _NO_UNITS, None, None, 0
            self.workspace = _empty_workspace(dtype, num_kv_heads, num_q_heads // num_kv_heads, head_dim_v)
        else:
            self.units, self.bounds, self.items, self.num_slots = _kernels.plan_units(query_pos, window, split,
                                                                                      nthreads)
            self.workspace = None

    def run(self, q, k_pages, v_pages, page_indices, page_indptr, query_seq, query_pos, scale, window, out):
        """One layer: the kernel over this plan (arguments as `_paged_decode_attention_unchecked`; the positions
        must be the ones the plan was made from). Returns out."""
        if k_pages.dtype == np.float16:
            k_pages = k_pages.view(np.uint16)
            v_pages = v_pages.view(np.uint16)
        if self.serial:
            ws, wacc = self.workspace
            _kernels.decode_units(q, k_pages, v_pages, page_indices, page_indptr, query_seq, query_pos, window,
                                  scale, out, _NO_UNITS, 0, self.num_queries, self.block, self.ahead, ws, ws, wacc)
            return out
        return _kernels.decode_parallel(q, k_pages, v_pages, page_indices, page_indptr, query_seq, query_pos, scale,
                                        window, out, self.units, self.bounds, self.items, self.num_slots,
                                        self.block, self.ahead)


def plan_decode(query_pos, window, q_shape, v_pages) -> DecodePlan:
    """`DecodePlan` for queries ``q_shape = (num_queries, num_q_heads, head_dim)`` at ``query_pos`` (int64) over
    pages shaped like ``v_pages [num_pages, num_kv_heads, page_size, head_dim_v]``."""
    _, num_kv_heads, page_size, head_dim_v = v_pages.shape
    dtype = np.dtype(np.float64) if v_pages.dtype == np.float64 else np.dtype(np.float32)
    return DecodePlan(query_pos, window, q_shape[1], num_kv_heads, q_shape[2], head_dim_v, page_size, dtype)


def _paged_decode_attention_unchecked(q, k_pages, v_pages, page_indices, page_indptr, query_seq, query_pos,
                                      scale, window, out, *, mode=0, split_tokens=0, tiled=True, k_scales=None,
                                      v_scales=None):
    """The kernel call with no checks, for callers that validated already (the Decoder).

    Requires: q C-contiguous in the compute dtype (float32 for float16/float32 storage, float64 for float64),
    page_indices int32, page_indptr int64, query_seq int32, query_pos int64, scale a float > 0, window an int
    >= 0, out a C-contiguous [num_queries, num_q_heads, head_dim_v] array of the compute dtype; every visible
    position backed by a valid page. Returns out.

    mode (testing / tuning): 0 = choose, 1 = serial, 2 = parallel. split_tokens > 0 (parallel) forces key-range
    splits of that many tokens (rounded up to whole blocks); 0 = choose. tiled: runs of queries of
    one sequence at consecutive positions go to the tiled multi-query kernel (`decode.multiquery`); False: every
    query through the single-query kernel. int8 pages: k_scales / v_scales float16 of the checked shapes; runs
    go to the tiled kernel with the scales (their K/V blocks widened from int8), the other queries to the int8
    single-query kernel (`_int8_unchecked`)."""
    if k_scales is not None:
        return _int8_unchecked(q, k_pages, v_pages, k_scales, v_scales, page_indices, page_indptr, query_seq,
                               query_pos, scale, window, out, mode, split_tokens, tiled)
    if k_pages.dtype == np.float16:
        k_pages = k_pages.view(np.uint16)
        v_pages = v_pages.view(np.uint16)
    nq = len(query_pos)
    if nq > 1 and tiled:
        rest = _multiquery.attend_runs(q, k_pages, v_pages, page_indices, page_indptr, query_seq, query_pos, scale,
                                       window, out, mode=mode, split_tokens=split_tokens)
        if len(rest) < nq:
            if len(rest):
                sub = _paged_decode_attention_unchecked(q[rest], k_pages, v_pages, page_indices, page_indptr,
                                                        query_seq[rest], query_pos[rest], scale, window,
                                                        np.empty((len(rest),) + out.shape[1:], out.dtype),
                                                        mode=mode, split_tokens=split_tokens, tiled=False)
                out[rest] = sub
            return out
    _, num_q_heads, head_dim = q.shape
    _, num_kv_heads, page_size, head_dim_v = v_pages.shape
    plan = DecodePlan(query_pos, window, num_q_heads, num_kv_heads, head_dim, head_dim_v, page_size, q.dtype,
                      mode=mode, split_tokens=split_tokens)
    return plan.run(q, k_pages, v_pages, page_indices, page_indptr, query_seq, query_pos, scale, window, out)


_NO_UNITS = np.empty((0, 4), dtype=np.int64)
_WORKSPACES = {}


def _empty_workspace(dtype, num_kv_heads, group, head_dim_v):
    key = (dtype, num_kv_heads, group, head_dim_v)
    ws = _WORKSPACES.get(key)
    if ws is None:
        ws = _WORKSPACES[key] = (np.empty((0, num_kv_heads, group), dtype),
                                 np.empty((0, num_kv_heads, group, head_dim_v), dtype))
    return ws


def _visible_work(query_pos, window) -> int:
    """Keys read over all queries (each query reads min(p + 1, window) keys)."""
    nq = len(query_pos)
    if nq == 1:
        p1 = int(query_pos[0]) + 1
        return min(p1, window) if window else p1
    if window:
        return int(np.minimum(query_pos + 1, window).sum())
    return int(query_pos.sum()) + nq


def _int8_unchecked(q, k_pages, v_pages, k_scales, v_scales, page_indices, page_indptr, query_seq, query_pos,
                    scale, window, out, mode, split_tokens, tiled=True):
    """int8 pages: runs of >= `decode.multiquery.MIN_RUN` consecutive queries of one sequence (tiled) through the
    tiled multi-query kernel with the scales; the rest through `decode.kernels.int8`: serial below SERIAL_WORK,
    else units of (query, key range, all kv heads) cut at ``split`` tokens (about two per thread) on all
    threads."""
    nq = len(query_pos)
    if nq > 1 and tiled:
        rest = _multiquery.attend_runs(q, k_pages, v_pages, page_indices, page_indptr, query_seq, query_pos, scale,
                                       window, out, mode=mode, split_tokens=split_tokens, k_scales=k_scales,
                                       v_scales=v_scales)
        if len(rest) < nq:
            if len(rest):
                out[rest] = _int8_unchecked(q[rest], k_pages, v_pages, k_scales, v_scales, page_indices,
                                            page_indptr, query_seq[rest], query_pos[rest], scale, window,
                                            np.empty((len(rest),) + out.shape[1:], out.dtype), mode, split_tokens,
                                            False)
            return out
    ks, vs = k_scales.view(np.uint16), v_scales.view(np.uint16)
    nq, num_q_heads, head_dim = q.shape
    page_size, head_dim_v = v_pages.shape[2], v_pages.shape[3]
    work = _visible_work(query_pos, window)
    block = page_size * max(1, 64 // page_size)
    serial = mode == 1 or (mode == 0 and work * num_q_heads * (head_dim + head_dim_v) < SERIAL_WORK)
    if not serial:
        nthreads = numba.get_num_threads()
        split = split_tokens if split_tokens > 0 else max(INT8_MIN_SPLIT_TOKENS, -(-work // (2 * nthreads)))
        split = -(-split // block) * block
        serial = mode == 0 and (nthreads < 2 or (nq == 1 and work <= split))       # a single unit
    if serial:
        _kernels.int8_units(q, k_pages, ks, v_pages, vs, page_indices, page_indptr, query_seq, query_pos, window,
                            scale, out, _NO_UNITS4, 0, nq, block, _NO_WM, _NO_WM, _NO_WACC)
        return out
    units, bounds, items, num_slots = _kernels.plan_units(query_pos, window, split, nthreads)
    return _kernels.int8_parallel(q, k_pages, ks, v_pages, vs, page_indices, page_indptr, query_seq, query_pos,
                                  window, scale, out, units, bounds, items, num_slots, block)


_NO_UNITS4 = np.empty((0, 4), dtype=np.int64)
_NO_WM = np.empty((0, 1, 1), dtype=np.float32)
_NO_WACC = np.empty((0, 1, 1, 1), dtype=np.float32)
