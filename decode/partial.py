"""Partial attention over a key range, and the split-K merge of partials: the entry points of context sharding.

A sequence whose keys are spread over several holders (workers of `decode.distributed`, each with a contiguous
range of positions) is attended in two steps: every holder computes the unnormalised softmax state of the query
over its own keys (`partial_attention`), and the caller merges the states (`merge_partials`). Both run the
per-query kernel's own code: `query_units` with one workspace slot per query (a unit holds every kv head), and
`merge_items`, the merge of the kernel's split-K.

    m, l, acc = partial_attention(q, k_pages, v_pages, pages, lo, hi, scale)
    out = merge_partials(m_parts, l_parts, acc_parts)

Shapes (named dimensions):
    q:       [num_queries, num_q_heads, head_dim]              float32 (float16/float32 storage) or float64
    k_pages: [num_pages, num_kv_heads, page_size, head_dim]    storage dtype, C-contiguous
    v_pages: [num_pages, num_kv_heads, page_size, head_dim_v]
    pages:   int32 [num_logical_pages]   the holder's page row: its local position t is in page pages[t // page_size]
    lo, hi:  int64 [num_queries]         query i reads the local keys lo[i] .. hi[i]-1 (lo == hi: none)
    m, l:    [num_queries, num_q_heads]  running max of the scaled scores, sum of exp(score - m)
    acc:     [num_queries, num_q_heads, head_dim_v]  sum of exp(score - m) * v
An empty range gives m = -inf, l = 0, acc = 0 (it contributes nothing to the merge).
"""
import numpy as np

from .attention_plan import BLOCK_TOKENS, PREFETCH_BYTES, accumulator, compute_dtype, kernel_view
from .kernels.per_query import merge_items, query_units
from .kernels.register_blocks import in_pairs, unpair

_Q_FLOATS = (np.dtype(np.float32), np.dtype(np.float64))


def partial_attention(q, k_pages, v_pages, pages, lo, hi, scale: float):
    """Unnormalised attention state ``(m, l, acc)`` of each query over its local key range (module docstring)."""
    if not (isinstance(k_pages, np.ndarray) and isinstance(v_pages, np.ndarray) and k_pages.ndim == 4
            and v_pages.ndim == 4 and k_pages.dtype == v_pages.dtype and k_pages.shape[:3] == v_pages.shape[:3]
            and k_pages.flags.c_contiguous and v_pages.flags.c_contiguous):
        raise ValueError("k_pages, v_pages: expected C-contiguous [num_pages, num_kv_heads, page_size, head_dim] "
                         f"arrays of one dtype, got {getattr(k_pages, 'shape', k_pages)!r} and "
                         f"{getattr(v_pages, 'shape', v_pages)!r}")
    num_pages, num_kv_heads, page_size, head_dim = k_pages.shape
    head_dim_v = v_pages.shape[3]
    compute = compute_dtype(k_pages.dtype)
    if not (isinstance(q, np.ndarray) and q.ndim == 3 and q.dtype == compute and q.shape[2] == head_dim
            and q.shape[1] % num_kv_heads == 0 and q.shape[1] > 0):
        raise ValueError(f"q: expected a {compute} array [num_queries, num_q_heads, {head_dim}] with num_q_heads "
                         f"a multiple of {num_kv_heads}, got {getattr(q, 'dtype', None)} {np.shape(q)}")
    num_queries, num_q_heads = q.shape[:2]
    pages = np.ascontiguousarray(pages, dtype=np.int32)
    lo = np.ascontiguousarray(lo, dtype=np.int64).reshape(-1)
    hi = np.ascontiguousarray(hi, dtype=np.int64).reshape(-1)
    if lo.shape != (num_queries,) or hi.shape != (num_queries,):
        raise ValueError(f"lo, hi: expected {num_queries} entries each (num_queries), got {lo.shape}, {hi.shape}")
    capacity = len(pages) * page_size
    if num_queries and (lo.min() < 0 or (hi < lo).any() or hi.max() > capacity):
        raise ValueError(f"lo, hi: expected 0 <= lo <= hi <= {capacity} (the capacity of the page row), "
                         f"got lo={lo.tolist()} hi={hi.tolist()}")
    used = pages[: -(-int(hi.max()) // page_size)] if num_queries else pages[:0]
    if used.size and (used.min() < 0 or used.max() >= num_pages):
        raise ValueError(f"pages: expected physical pages in [0, {num_pages}) for the ranges read, got {used.tolist()}")
    group = num_q_heads // num_kv_heads
    q = np.ascontiguousarray(q)
    wm = np.full((num_queries, num_kv_heads, group), -np.inf, dtype=compute)      # slot = query
    wl = np.zeros((num_queries, num_kv_heads, group), dtype=compute)
    wacc = np.zeros((num_queries, num_kv_heads, group, head_dim_v), dtype=compute)
    units = np.array([(i, lo[i], hi[i], i) for i in range(num_queries) if hi[i] > lo[i]],
                     dtype=np.int64).reshape(-1, 4)                                # [U, 4] = (query, lo, hi, slot)
    if len(units):
        k_pages, v_pages = kernel_view(k_pages), kernel_view(v_pages)
        block = page_size * max(1, BLOCK_TOKENS // page_size)
        indptr = np.array([0, len(pages)], dtype=np.int64)
        unused_out = np.empty((num_queries, num_q_heads, head_dim_v), dtype=compute)
        query_units(q, k_pages, v_pages, None, None, pages, indptr, np.zeros(num_queries, np.int32), hi - 1, 0,
                    float(scale), unused_out, units, 0, len(units), block, PREFETCH_BYTES, wm, wl, wacc,
                    accumulator(compute, "default", head_dim), 0)
        if in_pairs(v_pages, wacc):       # the partials leave by dim (`merge_partials` merges natural ones)
            unpair(wacc.reshape(-1, head_dim_v), head_dim_v - head_dim_v % 32)
    # the kernel keeps the max of the unscaled scores q.k; this module's contract is the max of the scaled ones
    return (wm.reshape(num_queries, num_q_heads) * compute.type(scale), wl.reshape(num_queries, num_q_heads),
            wacc.reshape(num_queries, num_q_heads, head_dim_v))


def merge_partials(m, l, acc, num_kv_heads: int) -> np.ndarray:
    """Merge the states of W holders: ``m, l [W, num_queries, num_q_heads]``,
    ``acc [W, num_queries, num_q_heads, head_dim_v]`` -> ``[num_queries, num_q_heads, head_dim_v]``
    (the kernel's split-K combine; every query must have at least one non-empty part)."""
    m, l, acc = np.asarray(m), np.asarray(l), np.asarray(acc)
    if m.ndim != 3 or l.shape != m.shape or acc.shape[:3] != m.shape or acc.ndim != 4 or m.dtype not in _Q_FLOATS:
        raise ValueError(f"m, l, acc: expected float32/float64 [W, num_queries, num_q_heads] (acc with head_dim_v), "
                         f"got {m.dtype} {m.shape}, {l.shape}, {acc.shape}")
    parts, num_queries, num_q_heads, head_dim_v = acc.shape
    if num_q_heads % num_kv_heads:
        raise ValueError(f"num_kv_heads: expected a divisor of num_q_heads={num_q_heads}, got {num_kv_heads}")
    group = num_q_heads // num_kv_heads
    m4 = m.reshape(parts, num_queries, num_kv_heads, group)
    nonempty = m4[:, :, 0, 0] > -np.inf                           # [W, Q]: an empty range is -inf in every head
    if not nonempty.any(axis=0).all():
        raise ValueError("m: expected every query to have at least one non-empty part, got a query with none")
    # the kernel runs with fastmath (no infinities): only non-empty parts go in; slots ordered (query, part), each
    # with every kv head; m is already scaled, so the merge runs with scale 1
    sel_w, sel_i, items = [], [], []
    for i in range(num_queries):
        ws = np.flatnonzero(nonempty[:, i])
        items.append((i, len(sel_w), len(ws)))
        sel_w.extend(ws)
        sel_i.extend([i] * len(ws))
    wm = np.ascontiguousarray(m4[sel_w, sel_i])                                          # [slots, H, G]
    wl = np.ascontiguousarray(l.reshape(m4.shape)[sel_w, sel_i])
    wacc = np.ascontiguousarray(acc.reshape(m4.shape + (head_dim_v,))[sel_w, sel_i])     # [slots, H, G, Dv]
    items = np.array(items, dtype=np.int64).reshape(-1, 3)
    out = np.empty((num_queries, num_q_heads, head_dim_v), dtype=m.dtype)
    merge_items(out, items, 0, len(items), wm, wl, wacc.astype(m.dtype, copy=False), 1.0, False)
    return out
