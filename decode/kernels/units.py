"""Work units of both kernel families, their balancing over threads and the split-K merge.

A query's (or a tile's) key range is cut at absolute multiples of `split` tokens: the cut depends on the
positions and the split length only, never on the thread count or on the other queries of the call, so a
sequence's partial states, and the order they are merged in, are the same whatever else is computed alongside
(docs/kernel.md, "Determinism"). Threads only decide who computes a unit.

    plan_units(query_pos, window, split, nchunks)                      per-query units [U, 4]
    plan_tiles(runs, num_kv_heads, G, window, tokens, split, nchunks)  tiled units [U, 7]
    balance(costs, nchunks)                                            contiguous chunks of units by cost
    merge_rows(wm, wl, wacc, w0, n, r0, dst, scale)                    the split-K merge of n partials
    find_runs(query_seq, query_pos, min_run, skip, window)             runs of consecutive queries
"""
import math

import numpy as np
from numba import njit

from . import cachedir  # noqa: F401
from .simd import FAST


@njit(cache=True)
def parts(lo, hi, split):
    """Number of pieces of the key range [lo, hi) cut at absolute multiples of `split` (split <= 0: one)."""
    if split <= 0:
        return 1
    return (hi - 1) // split - lo // split + 1


@njit(cache=True)
def piece(lo, hi, split, j, n):
    """Piece j of n of [lo, hi) cut at absolute multiples of `split` -> (a, b)."""
    if n == 1:
        return lo, hi
    return max(lo, (lo // split + j) * split), min(hi, (lo // split + j + 1) * split)


@njit(cache=True)
def balance(costs, nchunks):
    """bounds [nchunks + 1]: chunk c takes units bounds[c]..bounds[c+1]-1, contiguous, cut where the running cost
    crosses c / nchunks of the total (each unit goes to the chunk of its cost midpoint)."""
    U = costs.shape[0]
    total = 0
    for u in range(U):
        total += costs[u]
    nch = max(1, nchunks)
    bounds = np.empty(nch + 1, np.int64)
    bounds[0] = 0
    cum = 0
    c = 1
    for u in range(U):
        mid2 = 2 * cum + costs[u]
        while c < nch and mid2 * nch > 2 * c * total:
            bounds[c] = u
            c += 1
        cum += costs[u]
    while c <= nch:
        bounds[c] = U
        c += 1
    return bounds


@njit(cache=True)
def cut_ranges(lo, hi, split):
    """Cut each owner's key range [lo[o], hi[o]) at absolute multiples of `split[o]` (<= 0: never).
    Returns pieces [U, 4] = (owner, a, b, workspace slot or -1 when the range is one piece), in owner order and
    key order within an owner, items [n_split, 3] = (owner, first slot, number of pieces) and the number of
    slots (a cut range's pieces occupy consecutive slots in key order)."""
    U = 0
    n_items = 0
    for o in range(lo.shape[0]):
        n = parts(lo[o], hi[o], split[o])
        U += n
        n_items += n > 1
    pieces = np.empty((U, 4), np.int64)
    items = np.empty((n_items, 3), np.int64)
    u = 0
    w = 0
    it = 0
    for o in range(lo.shape[0]):
        n = parts(lo[o], hi[o], split[o])
        if n > 1:
            items[it, 0] = o
            items[it, 1] = w
            items[it, 2] = n
            it += 1
        for j in range(n):
            a, b = piece(lo[o], hi[o], split[o], j, n)
            pieces[u, 0] = o
            pieces[u, 1] = a
            pieces[u, 2] = b
            pieces[u, 3] = w if n > 1 else -1
            w += n > 1
            u += 1
    return pieces, items, w


@njit(cache=True)
def plan_units(query_pos, window, split, nchunks):
    """Per-query units: every query's visible keys cut at absolute multiples of `split` tokens (`cut_ranges`),
    balanced over `nchunks` chunks by cost (tokens + 16 per unit).

    Returns units [U, 4] = (query, lo, hi, workspace slot or -1 when the range is one piece), bounds
    [nchunks + 1], items [n_split, 3] = (query, first slot, number of slots) and the number of slots."""
    hi = query_pos + 1
    lo = np.zeros_like(hi)
    if window > 0:
        lo = np.maximum(hi - window, 0)
    units, items, w = cut_ranges(lo, hi, np.full(lo.shape[0], split, np.int64))
    return units, balance(units[:, 2] - units[:, 1] + 16, nchunks), items, w


@njit(cache=True)
def plan_tiles(runs, num_kv_heads, G, window, tokens, split, nchunks, min_tiles):
    """Tiled units: every (run, kv head, tile of <= `tokens` queries), its key range cut at absolute multiples of
    `split` tokens (`cut_ranges`, a unit per piece) unless the run has `min_tiles` (> 0) or more tiles per kv
    head (then every thread has whole tiles to take: a cut would only add a merge), balanced over `nchunks` chunks by cost (rows x keys +
    64 x rows). Head-major within a run: a kv head's tiles are consecutive (they read the same K/V prefix, which
    stays in L2 from one tile to the next), and with as many heads as chunks, or a multiple, every chunk holds
    the same mix of short and long tiles whatever the cost model's error (the token-major order put the short
    tiles in the first chunks: 12% more CPU time in one thread's half at 0 -> 2048).

    Returns units [U, 7] = (run, kv head, first token, tokens, ka, kb, slot or -1), bounds [nchunks + 1],
    items [n_split, 5] = (run, kv head, first token, tokens, first slot), item_parts [n_split], num_slots."""
    n = 0
    for run in range(runs.shape[0]):
        n += -(-runs[run, 2] // tokens) * num_kv_heads
    tiles = np.empty((n, 4), np.int64)            # (run, kv head, first token, tokens) of every tile
    lo = np.empty(n, np.int64)
    hi = np.empty(n, np.int64)
    cut_at = np.empty(n, np.int64)
    o = 0
    for run in range(runs.shape[0]):
        p0 = runs[run, 3]
        whole = min_tiles > 0 and -(-runs[run, 2] // tokens) >= min_tiles
        for h in range(num_kv_heads):
            for t0 in range(0, runs[run, 2], tokens):
                nt = min(tokens, runs[run, 2] - t0)
                tiles[o, 0] = run
                tiles[o, 1] = h
                tiles[o, 2] = t0
                tiles[o, 3] = nt
                lo[o] = max(0, p0 + t0 - window + 1) if window > 0 else 0
                hi[o] = p0 + t0 + nt
                cut_at[o] = 0 if whole else split
                o += 1
    pieces, cut, w = cut_ranges(lo, hi, cut_at)
    units = np.empty((pieces.shape[0], 7), np.int64)
    units[:, :4] = tiles[pieces[:, 0]]
    units[:, 4:] = pieces[:, 1:]
    items = np.empty((cut.shape[0], 5), np.int64)
    items[:, :4] = tiles[cut[:, 0]]
    items[:, 4] = cut[:, 1]
    costs = units[:, 3] * G * (units[:, 5] - units[:, 4] + 64)
    return units, balance(costs, nchunks), items, cut[:, 2].copy(), w


@njit(cache=True, fastmath=FAST)
def merge_rows(wm, wl, wacc, w0, n, r0, dst, scale):
    """dst[r, :] = the merge of the n partial states at slots w0..w0+n-1 (key order) of rows r0 + r: wm, wl
    [slots, rows] (running max of the scores, times `scale` to get the scaled one; sum of weights), wacc
    [slots, rows, Dv] (unnormalised output), dst [nrows, Dv]. Weights in float64 (the merge is cheap), the
    parts always taken in slot order."""
    Dv = dst.shape[1]
    for r in range(dst.shape[0]):
        rr = r0 + r
        mx = wm[w0, rr]
        for s in range(1, n):
            mx = max(mx, wm[w0 + s, rr])
        og = dst[r]
        for d in range(Dv):
            og[d] = 0.0
        tot = 0.0
        for s in range(n):
            f = math.exp((np.float64(wm[w0 + s, rr]) - mx) * scale)
            tot += f * wl[w0 + s, rr]
            src = wacc[w0 + s, rr]
            for d in range(Dv):
                og[d] += f * src[d]
        inv = 1.0 / tot
        for d in range(Dv):
            og[d] *= inv


@njit(cache=True)
def find_runs(query_seq, query_pos, min_run, skip, window):
    """Split the queries into runs (one sequence, consecutive positions, >= min_run queries, a count not in
    ``skip``: int64 run lengths left to the per-query kernel) and the rest. Returns runs [n, 4] = (sequence,
    first query, count, first position), rest (int64 query indices), and the visible keys summed over the
    queries in runs."""
    nq = query_seq.shape[0]
    starts = np.empty(nq + 1, np.int64)
    n = 0
    for i in range(nq):
        if i == 0 or query_seq[i] != query_seq[i - 1] or query_pos[i] != query_pos[i - 1] + 1:
            starts[n] = i
            n += 1
    starts[n] = nq
    nr = 0
    nrest = 0
    for k in range(n):
        if _taken(starts[k + 1] - starts[k], min_run, skip):
            nr += 1
        else:
            nrest += starts[k + 1] - starts[k]
    runs = np.empty((nr, 4), np.int64)
    rest = np.empty(nrest, np.int64)
    a = 0
    b = 0
    keys = 0
    for k in range(n):
        i0 = starts[k]
        T = starts[k + 1] - i0
        if _taken(T, min_run, skip):
            runs[a, 0] = query_seq[i0]
            runs[a, 1] = i0
            runs[a, 2] = T
            runs[a, 3] = query_pos[i0]
            a += 1
            for i in range(i0, i0 + T):
                keys += min(query_pos[i] + 1, window) if window > 0 else query_pos[i] + 1
        else:
            for i in range(i0, i0 + T):
                rest[b] = i
                b += 1
    return runs, rest, keys


@njit(cache=True)
def _taken(T, min_run, skip):
    """Whether a run of T queries is tiled: T >= min_run and T not in skip."""
    if T < min_run:
        return False
    for x in skip:
        if x == T:
            return False
    return True
