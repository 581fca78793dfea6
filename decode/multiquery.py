"""Routing of query runs to the tiled multi-query kernel (`decode.kernels.multiquery`), for the attention wrapper.

A run is T >= MIN_RUN queries of one sequence at consecutive positions (an `extend`, a prefill chunk, a
speculative verification); every run is computed by the tiled kernel, the other queries by the single-query
kernel. Thresholds are measured (docs/kernel.md, "The multi-query kernel").
"""
import numba
import numpy as np

from .kernels import multiquery as _mq

MIN_RUN = 3              # queries per run from which the tiled kernel is used (at 2 both kernels tie)
TILE_ROWS = 128          # (query, q head) rows per tile: tokens per tile = max(1, TILE_ROWS // group)
BLOCK = 128              # keys per score tile
SERIAL_WORK = 1 << 20    # rows x visible keys x (head_dim + head_dim_v) below this: no threads
MIN_SPLIT = 256          # key-range parts are never shorter than this


def attend_runs(q, k_pages, v_pages, page_indices, page_indptr, query_seq, query_pos, scale, window, out, *,
                mode=0, split_tokens=0, min_run=MIN_RUN):
    """Compute out[i] of every query i in a run with the tiled kernel; return the indices (int64) of the other
    queries, which the caller computes. Arguments as `decode.attention._paged_decode_attention_unchecked`
    (k_pages / v_pages already viewed as uint16 for float16 storage). mode: 0 choose, 1 serial, 2 parallel;
    split_tokens > 0 forces key-range parts of that many tokens (parallel)."""
    runs, rest, keys = _mq.find_runs(query_seq, query_pos, min_run, window)
    if runs.shape[0] == 0:
        return rest
    num_q_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads, head_dim_v = k_pages.shape[1], v_pages.shape[3]
    group = num_q_heads // num_kv_heads
    tokens = max(1, TILE_ROWS // group)
    work = keys * num_q_heads * (head_dim + head_dim_v)
    nthreads = numba.get_num_threads()
    serial = mode == 1 or (mode == 0 and (work < SERIAL_WORK or nthreads < 2))
    if serial:
        units, bounds, items, parts, slots = _mq.plan_tiles(runs, num_kv_heads, group, window, tokens, 0, 1)
        _mq.mq_units(q, k_pages, v_pages, page_indices, page_indptr, runs, units, 0, units.shape[0], window, scale,
                     BLOCK, tokens, out, _EMPTY2[q.dtype], _EMPTY2[q.dtype], _EMPTY3[q.dtype])
        return rest
    split = split_tokens
    if split <= 0:
        tiles = int(sum(-(-int(T) // tokens) for T in runs[:, 2])) * num_kv_heads
        if tiles < 2 * nthreads:                       # too few units to keep every thread busy: cut the keys
            longest = int(keys // max(1, int(runs[:, 2].sum())))
            split = -(-max(MIN_SPLIT, -(-longest * tiles // (2 * nthreads))) // BLOCK) * BLOCK
    units, bounds, items, parts, slots = _mq.plan_tiles(runs, num_kv_heads, group, window, tokens, split,
                                                        4 * nthreads)
    _mq.mq_parallel(q, k_pages, v_pages, page_indices, page_indptr, runs, units, bounds, items, parts, slots,
                    window, scale, BLOCK, tokens, out)
    return rest


_EMPTY2 = {np.dtype(t): np.empty((0, 0), t) for t in (np.float32, np.float64)}
_EMPTY3 = {np.dtype(t): np.empty((0, 0, 0), t) for t in (np.float32, np.float64)}
