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


class RunsPlan:
    """The runs of a call and their work partition, computed once (`find_runs`, `plan_tiles`) and reused by every
    layer that attends with the same positions (a multi-layer extend or batched prefill).

    ``rest`` (int64): the queries outside runs, for the single-query kernel; ``empty``: no run at all."""

    __slots__ = ("runs", "rest", "serial", "tokens", "units", "bounds", "items", "parts", "slots", "dtype")

    def __init__(self, query_seq, query_pos, window, q_shape, v_pages, *, mode=0, split_tokens=0, min_run=MIN_RUN):
        runs, self.rest, keys = _mq.find_runs(query_seq, query_pos, min_run, window)
        self.runs = runs
        _, num_q_heads, head_dim = q_shape
        num_kv_heads, head_dim_v = v_pages.shape[1], v_pages.shape[3]
        self.dtype = np.dtype(np.float64) if v_pages.dtype == np.float64 else np.dtype(np.float32)
        group = num_q_heads // num_kv_heads
        self.tokens = tokens = max(1, TILE_ROWS // group)
        nthreads = numba.get_num_threads()
        work = keys * num_q_heads * (head_dim + head_dim_v)
        self.serial = mode == 1 or (mode == 0 and (work < SERIAL_WORK or nthreads < 2))
        if runs.shape[0] == 0:
            self.units = self.bounds = self.items = self.parts = self.slots = None
            return
        split, chunks = 0, 1
        if not self.serial:
            split, chunks = split_tokens, 4 * nthreads
            if split <= 0:
                tiles = int(sum(-(-int(T) // tokens) for T in runs[:, 2])) * num_kv_heads
                if tiles < 2 * nthreads:                   # too few units to keep every thread busy: cut the keys
                    longest = int(keys // max(1, int(runs[:, 2].sum())))
                    split = -(-max(MIN_SPLIT, -(-longest * tiles // (2 * nthreads))) // BLOCK) * BLOCK
        self.units, self.bounds, self.items, self.parts, self.slots = _mq.plan_tiles(
            runs, num_kv_heads, group, window, tokens, split, chunks)

    @property
    def empty(self) -> bool:
        return self.runs.shape[0] == 0

    def run(self, q, k_pages, v_pages, page_indices, page_indptr, query_seq, query_pos, scale, window, out,
            k_scales=None, v_scales=None):
        """One layer: out[i] of every query i in a run (arguments as `DecodePlan.run`; the positions must be the
        ones the plan was made from; k_pages / v_pages as stored: float16 is viewed here; int8 pages with their
        float16 k_scales / v_scales, q float32). Returns out."""
        if self.empty:
            return out
        if k_pages.dtype == np.float16:
            k_pages, v_pages = k_pages.view(np.uint16), v_pages.view(np.uint16)
        if k_scales is not None:
            k_scales, v_scales = k_scales.view(np.uint16), v_scales.view(np.uint16)
        if self.serial:
            _mq.mq_units(q, k_pages, v_pages, page_indices, page_indptr, self.runs, self.units, 0,
                         self.units.shape[0], window, scale, BLOCK, self.tokens, out, _EMPTY2[self.dtype],
                         _EMPTY2[self.dtype], _EMPTY3[self.dtype], k_scales, v_scales)
        else:
            _mq.mq_parallel(q, k_pages, v_pages, page_indices, page_indptr, self.runs, self.units, self.bounds,
                            self.items, self.parts, self.slots, window, scale, BLOCK, self.tokens, out, k_scales,
                            v_scales)
        return out


def attend_runs(q, k_pages, v_pages, page_indices, page_indptr, query_seq, query_pos, scale, window, out, *,
                mode=0, split_tokens=0, min_run=MIN_RUN, k_scales=None, v_scales=None):
    """Compute out[i] of every query i in a run with the tiled kernel; return the indices (int64) of the other
    queries, which the caller computes. Arguments as `decode.attention._paged_decode_attention_unchecked`.
    mode: 0 choose, 1 serial, 2 parallel; split_tokens > 0 forces key-range parts of that many tokens
    (parallel). int8 pages: k_scales / v_scales (float16, `kvcache.quant`'s format)."""
    plan = RunsPlan(query_seq, query_pos, window, q.shape, v_pages, mode=mode, split_tokens=split_tokens,
                    min_run=min_run)
    plan.run(q, k_pages, v_pages, page_indices, page_indptr, query_seq, query_pos, scale, window, out, k_scales,
             v_scales)
    return plan.rest


_EMPTY2 = {np.dtype(t): np.empty((0, 0), t) for t in (np.float32, np.float64)}
_EMPTY3 = {np.dtype(t): np.empty((0, 0, 0), t) for t in (np.float32, np.float64)}
