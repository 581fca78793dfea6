"""The tiled multi-query kernel (extend, prefill, speculative verification): runs of consecutive queries of one
sequence attend over its pages with every K/V block loaded once per tile of rows.

A *run* is T >= 1 queries i0..i0+T-1 of one sequence at consecutive positions p0..p0+T-1 (query i0+t reads keys
lo(t)..p0+t, lo = 0 or max(0, p0+t-window+1)). A *tile* is up to `tokens` consecutive queries of a run with the G
query heads of one kv head h: rows r = t*G + g (token-major). Per tile, keys are taken `block` at a time:

    Kb [nb, D] <- the block's K rows (widened exactly to float64), ST [nb, R] = Kb @ QT  (QT [D, R]: the tile's
    queries in float64, transposed once per tile; accumulated in float64, every product exact, and rounded once
    into ST in the compute dtype: the float32-score floor; the scale is applied to the dot products), the online softmax runs down ST's columns (one per row: the max,
    exp and sum vectorise over rows), O [R, Dv] += P @ Vb with P read as ST transposed.

Both products go through `gemm.gemm4` (4 x up to 64 register blocks). Only blocks that cross the causal diagonal
(or the window's lower edge) are masked; masked entries get weight exactly 0. A unit of work is (run, kv head,
tile, key range [ka, kb)); a unit whose range is a part of the tile's keys (split: fewer units than threads)
stores its partial (max, sum, unnormalised O) in a workspace slot and the parts are merged afterwards.

Layout as in `decode.kernels` (q / out [num_queries, num_q_heads, head_dim(_v)], pages head-major, CSR page
table). runs: int64 [num_runs, 4] = (sequence, first query, count, first position).
units: int64 [num_units, 7] = (run, kv head, first token of the tile in the run, tokens, ka, kb, slot or -1).
items: int64 [num_split, 5] = (run, kv head, first token, tokens, first slot) of split tiles; each tile's parts
occupy consecutive slots in key order, their number in `item_parts`.
"""
import math

import numpy as np
from numba import njit, prange

from .gemm import MR, gemm4
from .int8_rows import widen_block
from .simd import EXP_FLAGS, FAST, JIT, exp_inline, ld

NEG = -3.0e38         # "no key yet" running max: finite (fastmath), below every admissible score


@njit(cache=True, fastmath=FAST)
def _load_tile(q, i0, nt, h, G, QT, Rp):
    """QT[d, t*G + g] = q[i0 + t, h*G + g, d]; rows R..Rp-1 zero."""
    D = q.shape[2]
    R = nt * G
    for t in range(nt):
        for g in range(G):
            src = q[i0 + t, h * G + g]
            r = t * G + g
            for d in range(D):
                QT[d, r] = src[d]
    for d in range(D):
        row = QT[d]
        for r in range(R, Rp):
            row[r] = 0.0


@njit(cache=True, fastmath=FAST)
def _copy_block(pool, pages, h, b0, nb, dst):
    """dst[j, :width] = pool rows of kv head h at absolute positions b0 + j (j < nb), widened to the compute
    dtype; rows nb..(nb rounded up to MR)-1 set to zero."""
    P = pool.shape[2]
    W = pool.shape[3]
    t = b0
    j = 0
    while j < nb:
        pg = t // P
        s0 = t - pg * P
        s1 = min(P, s0 + nb - j)
        tile = pool[pages[pg], h]
        for s in range(s0, s1):
            src = tile[s]
            row = dst[j + s - s0]
            for d in range(W):
                row[d] = ld(src[d])
        j += s1 - s0
        t += s1 - s0
    for jj in range(nb, -(-nb // MR) * MR):
        row = dst[jj]
        for d in range(W):
            row[d] = 0.0


def _copy_kv(pool, pages, h, b0, nb, dst, scales):
    """`_copy_block` for float pools (scales None), `int8_rows.widen_block` for int8 pools (scales: their float16
    group scales as uint16 [num_pages, num_kv_heads, page_size, ceil(width / 32)]: each value times its group's
    scale in float32). Chosen by type at compile time (an overload; numba cannot prune `scales is None` when
    scales is an array); this body is the NUMBA_DISABLE_JIT twin."""
    if scales is None:
        _copy_block(pool, pages, h, b0, nb, dst)
    else:
        widen_block(pool, scales, pages, h, b0, nb, -(-nb // MR) * MR, dst)


if JIT:
    from numba import types as _types
    from numba.extending import overload as _overload

    @_overload(_copy_kv)
    def _copy_kv_typed(pool, pages, h, b0, nb, dst, scales):
        if scales is None or isinstance(scales, (_types.NoneType, _types.Omitted)):
            return lambda pool, pages, h, b0, nb, dst, scales: _copy_block(pool, pages, h, b0, nb, dst)
        return lambda pool, pages, h, b0, nb, dst, scales: widen_block(pool, scales, pages, h, b0, nb,
                                                                      -(-nb // MR) * MR, dst)


def score_scratch(D, R, nk, scales):
    """QT [D, R] and Kb [nk, D], the score GEMM's operands: float64 for float pools (scales None: ST = Kb @ QT
    accumulates in float64, every product exact, and is rounded once into the score tile), float32 for int8 pools
    (their dequantized float32 rows, as `kernels.int8`). Chosen by type at compile time (an overload, as
    `_copy_kv`); this body is the NUMBA_DISABLE_JIT twin."""
    dt = np.float64 if scales is None else np.float32
    return np.empty((D, R), dt), np.empty((nk, D), dt)


if JIT:
    @_overload(score_scratch)
    def _score_scratch_typed(D, R, nk, scales):
        if scales is None or isinstance(scales, (_types.NoneType, _types.Omitted)):
            return lambda D, R, nk, scales: (np.empty((D, R), np.float64), np.empty((nk, D), np.float64))
        return lambda D, R, nk, scales: (np.empty((D, R), np.float32), np.empty((nk, D), np.float32))


@njit(cache=True, fastmath=EXP_FLAGS)
def _softmax_block(ST, nb, Rp, b0, masked, rpos, rlo, sc, m, l, alpha, jlo, jhi, neg):
    """Online softmax over the block's dot products ST[:nb, :Rp] (column r = row r of the tile, key b0 + j):
    scores = dots * sc (the scale applied after the dot, as a plain computation does), new running max m,
    alpha = exp(old max - new max), l = alpha * l + sum of weights, ST <- weights (exactly 0 where masked).
    Every loop runs down the rows r (contiguous, no reduction across lanes) so that it vectorises: selects, not
    max() or branches, and the exp inlined. jlo / jhi: int32 scratch [>= Rp] (row r sees block keys
    jlo[r]..jhi[r]); neg: NEG in the compute dtype."""
    z = neg - neg
    for r in range(Rp):
        alpha[r] = m[r]
    if masked:
        for r in range(Rp):
            jlo[r] = max(-1, min(nb, rlo[r] - b0))
            jhi[r] = max(-1, min(nb, rpos[r] - b0))
        for j in range(nb):
            row = ST[j]
            for r in range(Rp):
                x = row[r] * sc
                row[r] = x
                x = x if (j >= jlo[r]) & (j <= jhi[r]) else neg
                a = alpha[r]
                alpha[r] = x if x > a else a
    else:
        for j in range(nb):
            row = ST[j]
            for r in range(Rp):
                x = row[r] * sc
                row[r] = x
                a = alpha[r]
                alpha[r] = x if x > a else a
    for r in range(Rp):          # alpha holds the new max here
        mn = alpha[r]
        a = exp_inline(m[r] - mn)
        m[r] = mn
        l[r] *= a
        alpha[r] = a
    if masked:
        for j in range(nb):
            row = ST[j]
            for r in range(Rp):
                d = row[r] - m[r]
                p = exp_inline(d if d < z else z)      # masked entries may lie above a row's max
                p = p if (j >= jlo[r]) & (j <= jhi[r]) else z
                row[r] = p
                l[r] += p
    else:
        for j in range(nb):
            row = ST[j]
            for r in range(Rp):
                p = exp_inline(row[r] - m[r])
                row[r] = p
                l[r] += p


@njit(cache=True, fastmath=FAST)
def attend_tile(q, k_pages, v_pages, pages, h, G, i0, pos0, nt, ka, kb, window, sc, block,
                QT, Kb, Vb, ST, O, m, l, alpha, rpos, rlo, jlo, jhi, neg, k_scales=None, v_scales=None):
    """Unnormalised attention of one tile (queries i0..i0+nt-1 at positions pos0.., kv head h) over the keys in
    [ka, kb) of the sequence with page row `pages` (sc: the score scale in the compute dtype). Leaves m[R], l[R],
    O[R, :Dv] (R = nt * G; rows padded to the vector width are zero queries). Scratch: QT [D, >=Rp] and Kb [>=block+3, D]
    (float64 for float pools: the score GEMM's accumulation dtype, `score_scratch`), Vb [>=block+3, Dvp] (columns
    Dv..Dvp-1 zero), ST [>=block+3, >=Rp], O [>=Rp, Dvp], m / l / alpha / rpos / rlo / jlo / jhi [>=Rp]; neg: NEG in the compute dtype.
    k_scales / v_scales: the int8 pools' scales (`_copy_kv`), None for float pools."""
    D = q.shape[2]
    Dvp = Vb.shape[1]
    L = 8 if O.itemsize == 8 else 16
    LK = 8 if QT.itemsize == 8 else 16    # lanes of the score GEMM (its accumulation dtype: QT's)
    R = nt * G
    Rp = -(-R // L) * L
    _load_tile(q, i0, nt, h, G, QT, Rp)
    for r in range(Rp):
        p = pos0 + min(r, R - 1) // G
        rpos[r] = p
        rlo[r] = max(0, p - window + 1) if window > 0 else 0
        m[r] = neg
        l[r] = 0.0
        row = O[r]
        for d in range(Dvp):
            row[d] = 0.0
    lo = max(ka, rlo[0])
    hi = min(kb, pos0 + nt)
    b0 = lo
    while b0 < hi:
        b1 = min(hi, b0 + block)
        nb = b1 - b0
        nbp = -(-nb // MR) * MR
        _copy_kv(k_pages, pages, h, b0, nb, Kb, k_scales)
        for j in range(0, nbp, MR):
            c = 0
            while c < Rp:
                nv = min(4, (Rp - c) // LK)
                gemm4(Kb, D, 1, j, QT, c, ST, D, nv, 1)
                c += nv * LK
        masked = (b1 - 1 > rpos[0]) | (b0 < rlo[R - 1])
        _softmax_block(ST, nb, Rp, b0, masked, rpos, rlo, sc, m, l, alpha, jlo, jhi, neg)
        for r in range(Rp):
            a = alpha[r]
            if a != 1.0:
                row = O[r]
                for d in range(Dvp):
                    row[d] *= a
        _copy_kv(v_pages, pages, h, b0, nb, Vb, v_scales)
        st_cols = ST.shape[1]
        for r in range(0, Rp, MR):
            c = 0
            while c < Dvp:
                nv = min(4, (Dvp - c) // L)
                gemm4(ST, 1, st_cols, r, Vb, c, O, nb, nv, 0)
                c += nv * L
        b0 = b1


@njit(cache=True, fastmath=FAST)
def _store_tile(O, l, out, i0, nt, h, G):
    """out[i0 + t, h*G + g, :] = O[t*G + g, :Dv] / l[t*G + g]."""
    Dv = out.shape[2]
    for t in range(nt):
        for g in range(G):
            r = t * G + g
            inv = 1.0 / l[r]
            src = O[r]
            dst = out[i0 + t, h * G + g]
            for d in range(Dv):
                dst[d] = src[d] * inv


@njit(cache=True, fastmath=FAST)
def mq_units(q, k_pages, v_pages, page_indices, page_indptr, runs, units, u0, u1, window, scale, block, tokens,
             out, wm, wl, wacc, k_scales=None, v_scales=None):
    """Process units u0..u1-1 with one set of scratch buffers (the serial kernel, and each parallel chunk's
    body). tokens: the most queries per tile (bounds the scratch); block: keys per score tile. int8 pools
    (float32 q): k_scales / v_scales uint16 [num_pages, num_kv_heads, page_size, ceil(width / 32)]."""
    Hkv = k_pages.shape[1]
    G = q.shape[1] // Hkv
    D = q.shape[2]
    Dv = v_pages.shape[3]
    dt = q.dtype
    L = 8 if q.itemsize == 8 else 16
    Rmax = -(-(tokens * G) // L) * L
    Dvp = -(-Dv // L) * L
    QT, Kb = score_scratch(D, Rmax, block + MR, k_scales)
    Vb = np.zeros((block + MR, Dvp), dt)
    ST = np.empty((block + MR, Rmax), dt)
    O = np.empty((Rmax, Dvp), dt)
    m = np.empty(Rmax, dt)
    l = np.empty(Rmax, dt)
    alpha = np.empty(Rmax, dt)
    rpos = np.empty(Rmax, np.int64)
    rlo = np.empty(Rmax, np.int64)
    jlo = np.empty(Rmax, np.int32)
    jhi = np.empty(Rmax, np.int32)
    neg = np.full(1, NEG, dt)[0]
    sc = np.full(1, scale, dt)[0]        # the scale in the compute dtype
    for u in range(u0, u1):
        run = units[u, 0]
        h = units[u, 1]
        t0 = units[u, 2]
        nt = units[u, 3]
        slot = units[u, 6]
        s = runs[run, 0]
        i0 = runs[run, 1] + t0
        pages = page_indices[page_indptr[s]:page_indptr[s + 1]]
        attend_tile(q, k_pages, v_pages, pages, h, G, i0, runs[run, 3] + t0, nt, units[u, 4], units[u, 5], window,
                    sc, block, QT, Kb, Vb, ST, O, m, l, alpha, rpos, rlo, jlo, jhi, neg, k_scales, v_scales)
        if slot < 0:
            _store_tile(O, l, out, i0, nt, h, G)
        else:
            R = nt * G
            for r in range(R):
                wm[slot, r] = m[r]
                wl[slot, r] = l[r]
                src = O[r]
                dst = wacc[slot, r]
                for d in range(Dv):
                    dst[d] = src[d]


@njit(cache=True, fastmath=FAST)
def _merge_items(runs, items, item_parts, a, b, G, wm, wl, wacc, out):
    """Merge the parts of split tiles a..b-1 into out (float64 weights: the merge is cheap)."""
    Dv = out.shape[2]
    for it in range(a, b):
        run = items[it, 0]
        h = items[it, 1]
        nt = items[it, 3]
        w0 = items[it, 4]
        n = item_parts[it]
        i0 = runs[run, 1] + items[it, 2]
        for t in range(nt):
            for g in range(G):
                r = t * G + g
                mx = wm[w0, r]
                for s in range(1, n):
                    mx = max(mx, wm[w0 + s, r])
                dst = out[i0 + t, h * G + g]
                for d in range(Dv):
                    dst[d] = 0.0
                tot = 0.0
                for s in range(n):
                    f = math.exp(wm[w0 + s, r] - mx)
                    tot += f * wl[w0 + s, r]
                    src = wacc[w0 + s, r]
                    for d in range(Dv):
                        dst[d] += f * src[d]
                inv = 1.0 / tot
                for d in range(Dv):
                    dst[d] *= inv


@njit(cache=True)
def plan_tiles(runs, num_kv_heads, G, window, tokens, split, nchunks):
    """Units of work for `runs`: every (run, kv head, tile of <= `tokens` queries), its key range cut at absolute
    multiples of `split` tokens when split > 0 (a unit per part), balanced over `nchunks` contiguous chunks by
    cost (rows x keys + a fixed 64 x rows per unit).

    Returns units [U, 7], bounds [nchunks + 1], items [n_split, 5], item_parts [n_split], num_slots, max_rows."""
    U = 0
    n_items = 0
    W = 0
    for run in range(runs.shape[0]):
        T = runs[run, 2]
        p0 = runs[run, 3]
        for t0 in range(0, T, tokens):
            nt = min(tokens, T - t0)
            lo = max(0, p0 + t0 - window + 1) if window > 0 else 0
            hi = p0 + t0 + nt
            n = (hi - 1) // split - lo // split + 1 if split > 0 else 1
            U += n * num_kv_heads
            if n > 1:
                n_items += num_kv_heads
                W += n * num_kv_heads
    units = np.empty((U, 7), np.int64)
    costs = np.empty(U, np.int64)
    items = np.empty((n_items, 5), np.int64)
    item_parts = np.empty(n_items, np.int64)
    u = 0
    w = 0
    it = 0
    total = 0
    for run in range(runs.shape[0]):
        T = runs[run, 2]
        p0 = runs[run, 3]
        for t0 in range(0, T, tokens):
            nt = min(tokens, T - t0)
            lo = max(0, p0 + t0 - window + 1) if window > 0 else 0
            hi = p0 + t0 + nt
            n = (hi - 1) // split - lo // split + 1 if split > 0 else 1
            for h in range(num_kv_heads):
                if n > 1:
                    items[it, 0] = run
                    items[it, 1] = h
                    items[it, 2] = t0
                    items[it, 3] = nt
                    items[it, 4] = w
                    item_parts[it] = n
                    it += 1
                for j in range(n):
                    a = lo if n == 1 else max(lo, (lo // split + j) * split)
                    b = hi if n == 1 else min(hi, (lo // split + j + 1) * split)
                    units[u, 0] = run
                    units[u, 1] = h
                    units[u, 2] = t0
                    units[u, 3] = nt
                    units[u, 4] = a
                    units[u, 5] = b
                    if n > 1:
                        units[u, 6] = w
                        w += 1
                    else:
                        units[u, 6] = -1
                    costs[u] = nt * G * (b - a + 64)
                    total += costs[u]
                    u += 1
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
    return units, bounds, items, item_parts, W


@njit(parallel=True, cache=True, fastmath=FAST)
def mq_parallel(q, k_pages, v_pages, page_indices, page_indptr, runs, units, bounds, items, item_parts, num_slots,
                window, scale, block, tokens, out, k_scales=None, v_scales=None):
    """The units of `plan_tiles` on all threads (one prange iteration per chunk: it owns its units' outputs and
    workspace slots), then the split tiles' parts are merged. k_scales / v_scales: as `mq_units`."""
    Hkv = k_pages.shape[1]
    G = q.shape[1] // Hkv
    Dv = v_pages.shape[3]
    R = tokens * G
    wm = np.empty((num_slots, R), q.dtype)
    wl = np.empty((num_slots, R), q.dtype)
    wacc = np.empty((num_slots, R, Dv), q.dtype)
    nch = bounds.shape[0] - 1
    for ck in prange(nch):
        mq_units(q, k_pages, v_pages, page_indices, page_indptr, runs, units, bounds[ck], bounds[ck + 1], window,
                 scale, block, tokens, out, wm, wl, wacc, k_scales, v_scales)
    n = items.shape[0]
    if n >= nch:
        for ck in prange(nch):
            _merge_items(runs, items, item_parts, ck * n // nch, (ck + 1) * n // nch, G, wm, wl, wacc, out)
    else:
        _merge_items(runs, items, item_parts, 0, n, G, wm, wl, wacc, out)
    return out


@njit(cache=True)
def find_runs(query_seq, query_pos, min_run, window):
    """Split the queries into runs (one sequence, consecutive positions, >= min_run queries) and the rest.
    Returns runs [n, 4] = (sequence, first query, count, first position), rest (int64 query indices), and the
    visible keys summed over the queries in runs."""
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
        if starts[k + 1] - starts[k] >= min_run:
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
        if T >= min_run:
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
