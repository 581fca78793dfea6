"""Plan once, run per layer: what every layer of a token (or a batch) shares, computed by the first layer that
attends, and the per-layer kernel call over it.

A plan holds the page tables (CSR ``indices int32 [total_pages]``, ``indptr int64 [num_seqs + 1]``), checked
once (no page released by a sliding window is visible to a query), the queries' sequences and positions, and
the kernel's work partition (a `decode.attention.DecodePlan` for one query per sequence, a
`decode.multiquery.RunsPlan` for runs of queries, None where the wrapper decides per call: int8 pages, a mix of
runs and single queries). `LayerPools` are the per-layer page arrays of a cache (views; the pool never moves).
"""
import numpy as np

from .attention import _paged_decode_attention_unchecked, plan_decode
from .multiquery import RunsPlan


class LayerPools:
    """Per-layer views of a cache's pages: ``k[layer] [num_pages, num_kv_heads, page_size, head_dim]``,
    ``v[layer]`` (``head_dim_v``), int8 scales ``k_scales[layer]`` / ``v_scales[layer]`` (None for floats)."""

    __slots__ = ("k", "v", "k_run", "v_run", "k_scales", "v_scales", "int8")

    def __init__(self, cache):
        layers = range(cache.config.num_layers)
        self.k = [cache.k_pages(layer) for layer in layers]
        self.v = [cache.v_pages(layer) for layer in layers]
        # what the kernels are handed: float16 pages as their uint16 bits (the view every kernel entry makes)
        self.k_run = [k.view(np.uint16) if k.dtype == np.float16 else k for k in self.k]
        self.v_run = [v.view(np.uint16) if v.dtype == np.float16 else v for v in self.v]
        self.k_scales = [cache.k_scales(layer) for layer in layers]
        self.v_scales = [cache.v_scales(layer) for layer in layers]
        self.int8 = self.k_scales[0] is not None


class LayerPlan:
    """One kernel call's shared arguments: ``indices``, ``indptr``, ``query_seq int32 [N]``, ``query_pos int64
    [N]`` and ``partition`` (DecodePlan / RunsPlan / None, see the module docstring)."""

    __slots__ = ("indices", "indptr", "query_seq", "query_pos", "partition", "out_shape")

    def __init__(self, indices, indptr, query_seq, query_pos, partition, out_shape=None):
        self.indices, self.indptr, self.partition = indices, indptr, partition
        self.query_seq, self.query_pos = query_seq, query_pos
        self.out_shape = out_shape              # (N, num_q_heads, head_dim_v), for the one-token path

    def run(self, pools: LayerPools, layer: int, q: np.ndarray, scale: float, window: int,
            out: np.ndarray) -> np.ndarray:
        """Attend ``q [N, num_q_heads, head_dim]`` (checked, working precision) in ``layer`` into ``out [N,
        num_q_heads, head_dim_v]``; returns out."""
        if self.partition is None:
            return _paged_decode_attention_unchecked(q, pools.k_run[layer], pools.v_run[layer], self.indices,
                                                     self.indptr, self.query_seq, self.query_pos, scale, window, out,
                                                     k_scales=pools.k_scales[layer], v_scales=pools.v_scales[layer])
        return self.partition.run(q, pools.k_run[layer], pools.v_run[layer], self.indices, self.indptr,
                                  self.query_seq, self.query_pos, scale, window, out)


_QUERY_SEQ1 = np.zeros(1, dtype=np.int32)          # one query of CSR row 0 (read only)


def plan_token(cache, pools: LayerPools, seq: int, pages: np.ndarray, position: int, num_q_heads: int,
               window: int) -> LayerPlan:
    """The plan of one query at ``position`` of ``seq`` over its page table ``pages int32`` (reserved slot
    included); ValueError if the query would read a released page."""
    first = max(0, position - window + 1) if window else 0
    if pages[first // cache.config.page_size] < 0:
        raise_released(cache, seq, first, position)
    indptr = np.array([0, len(pages)], dtype=np.int64)
    qpos = np.array([position], dtype=np.int64)
    partition = None if pools.int8 else plan_decode(qpos, window, (1, num_q_heads, cache.config.head_dim), pools.v[0])
    return LayerPlan(pages, indptr, _QUERY_SEQ1, qpos, partition, (1, num_q_heads, cache.config.head_dim_v))


def plan_batch(cache, pools: LayerPools, seqs: list, indices: np.ndarray, indptr: np.ndarray, start: list,
               counts: list, q_shape: tuple, window: int, query_seq: np.ndarray, query_pos: np.ndarray) -> LayerPlan:
    """The plan of ``q_shape = (N, num_q_heads, head_dim)`` ragged queries (``counts[b]`` of sequence ``seqs[b]``
    from position ``start[b]`` on) over the page tables ``indices`` / ``indptr`` (CSR, row b: ``seqs[b]``): a
    DecodePlan (one query per sequence), a RunsPlan when every query is in a run of several queries of one
    sequence, else None. ValueError if a sequence's first query would read a released page."""
    num_queries = q_shape[0]
    if num_queries:
        check_held(cache, seqs, indices, indptr, np.asarray(start, dtype=np.int64), np.asarray(counts) > 0, window)
    one_per_sequence = num_queries <= len(seqs) and max(counts) <= 1
    if pools.int8 or not num_queries:
        partition = None
    elif one_per_sequence:
        partition = plan_decode(query_pos, window, q_shape, pools.v[0])
    else:
        runs = RunsPlan(query_seq, query_pos, window, q_shape, pools.v[0])
        partition = runs if len(runs.rest) == 0 else None
    return LayerPlan(indices, indptr, query_seq, query_pos, partition)


def csr(tables: list) -> tuple[np.ndarray, np.ndarray]:
    """Page tables ``[int32 [n_b]]`` -> ``(indices int32 [sum n_b], indptr int64 [B + 1])``."""
    if len(tables) == 1:
        return tables[0], np.array([0, len(tables[0])], dtype=np.int64)
    indptr = np.zeros(len(tables) + 1, dtype=np.int64)
    np.cumsum([len(t) for t in tables], out=indptr[1:])
    return np.concatenate(tables), indptr


def check_held(cache, seqs: list, indices: np.ndarray, indptr: np.ndarray, start: np.ndarray, reads: np.ndarray,
               window: int) -> None:
    """ValueError (`raise_released`) for the first row b with ``reads[b]`` whose first query (at ``start[b]``)
    would read a page released by `KVCache.release_before` (-1); one vectorised pass over the rows."""
    rows = np.flatnonzero(reads)
    first = np.maximum(start[rows] - window + 1, 0) if window else np.zeros(len(rows), dtype=np.int64)
    bad = np.flatnonzero(indices[indptr[rows] + first // cache.config.page_size] < 0)
    if len(bad):
        b = int(rows[bad[0]])
        raise_released(cache, seqs[b], int(first[bad[0]]), int(start[b]))


def attend_token(decoder, token, layer: int, q, k, v, plan: LayerPlan | None = None) -> tuple[np.ndarray, LayerPlan]:
    """Write one token's checked ``k``/``v`` into ``token``'s slot (`kvcache.TokenWrite`) in ``layer`` and
    attend with ``q [num_q_heads, head_dim]`` (working precision) over positions ``.. token.positions[0]``.
    Returns ``(out [num_q_heads, head_dim_v], plan)``; ``plan`` is made on the first layer of a token
    (`plan_token`) and passed back in for the others."""
    token.write(layer, k, v)
    if plan is None:
        plan = plan_token(decoder.cache, decoder.pools, decoder.seq, token.pages(), int(token.positions[0]),
                          decoder.num_q_heads, decoder.window)
    out = np.empty(plan.out_shape, dtype=decoder.q_dtype)
    return plan.run(decoder.pools, layer, q[None], decoder.scale, decoder.window, out)[0], plan


def raise_released(cache, seq: int, first: int, position: int):
    """Raise: the query at ``position`` would read positions ``first ..`` of which some were given back by
    `KVCache.release_before` (a -1 in the page table; the unchecked kernel would index the pool with it)."""
    raise ValueError(f"seq: expected K/V held for positions {first}..{position} (read by the query at position "
                     f"{position}), got positions < {cache.first_position(seq)} released (KVCache.release_before)")
