"""How a forward's queries are cut into attention calls: chunks of whole rows or of one row's columns, small enough
that a call's temporaries (its queries and outputs in the compute dtype, the kernels' split-K workspace) stay
within `CHUNK_BYTES`, whatever the prompt length.

    chunks(first, width, limit) -> [(b0, b1, t0, t1, q0)]     rows b0..b1-1, columns t0..t1-1 of each, whose
                                                              queries are q0 .. q0 + (b1 - b0) * (t1 - t0) - 1
    chunk_limit(max_position, num_q_heads, head_dim, head_dim_v, group, itemsize) -> queries per chunk
    scratch(shape, dtype) -> an uninitialized array for one layer's chunk copies, its memory given back to the
                             OS when it dies

Row b's queries are its columns ``first[b] .. width - 1`` (the columns at or after its first real token), in
row order: the flat layout of `decode.hf.plan.ForwardPlan`. A chunk holds several rows only when each of them
is whole (``first == 0``); a longer row is cut every `limit` columns from its first query, `limit` a multiple
of the tiled kernel's tile (`decode.attention_plan.TILE_ROWS` // group), and a tail shorter than
`LONGEST_MIN_RUN` (from that length on every shape's run is tiled) stays with the piece before it, so the
tiles of a run of queries, and its kernel, are the ones one call would make.
"""
import numpy as np

from kvcache import mapped

from decode.attention_plan import LONGEST_MIN_RUN, SPLIT_TOKENS, TILE_ROWS, TILED_SPLIT

CHUNK_BYTES = 8 << 20       # a call's queries, outputs and split-K workspace together (compute dtype)
SCRATCH_MMAP_BYTES = 256 << 10   # scratch arrays from this size on are mappings of their own (`kvcache.mapped`)


def chunk_limit(max_position: int, num_q_heads: int, head_dim: int, head_dim_v: int, group: int,
                itemsize: int, *, single: bool = False) -> int:
    """Queries per chunk: `CHUNK_BYTES` over one query's bytes (q and out rows, plus the workspace of its pieces
    when its keys are cut: ``ceil(keys / split)`` partial outputs with their max and sum), a multiple of the
    tile's queries (at least one tile). ``single``: the queries go to the per-query kernel (cut every
    `SPLIT_TOKENS` keys) rather than the tiled one (`TILED_SPLIT`)."""
    pieces = -(-(max_position + 1) // (SPLIT_TOKENS if single else TILED_SPLIT))
    per_query = itemsize * num_q_heads * (head_dim + head_dim_v + (pieces * (head_dim_v + 2) if pieces > 1 else 0))
    tile = max(1, TILE_ROWS // group)
    return max(tile, CHUNK_BYTES // per_query // tile * tile)


def chunks(first: np.ndarray, width: int, limit: int) -> list[tuple[int, int, int, int, int]]:
    """See the module docstring. ``first int [B]``: each row's first query column (< width)."""
    out, q0, b, batch = [], 0, 0, len(first)
    while b < batch:
        if first[b] == 0 and width <= limit:                       # whole rows, as many as fit
            b1 = b + 1
            while b1 < batch and first[b1] == 0 and (b1 + 1 - b) * width <= limit:
                b1 += 1
            out.append((b, b1, 0, width, q0))
            q0 += (b1 - b) * width
            b = b1
            continue
        t = int(first[b])
        while t < width:
            t1 = min(width, t + limit)
            if width - t1 < LONGEST_MIN_RUN:
                t1 = width
            out.append((b, b + 1, t, t1, q0))
            q0 += t1 - t
            t = t1
        b += 1
    return out


def scratch(shape: tuple, dtype) -> np.ndarray:
    """An array of ``shape`` for one layer's chunk copies (uninitialized below `SCRATCH_MMAP_BYTES`); from that size
    on a `kvcache.mapped` array, unmapped when it dies: from malloc's heap (once its dynamic mmap threshold has
    grown past the size) a buffer made per layer would stay resident after it."""
    dtype = np.dtype(dtype)
    if int(np.prod(shape, dtype=np.int64)) * dtype.itemsize < SCRATCH_MMAP_BYTES:
        return np.empty(shape, dtype)
    return mapped.zeros(shape, dtype)
