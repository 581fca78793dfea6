"""The single-query ("decode") kernel. Work unit = (query, key range) with EVERY kv head: each page of the range is
read whole (its K for all heads is one contiguous run of the head-major pool, then its V), so a thread streams
long runs instead of one head's small tile per page. Units are planned once, balanced over the threads, and
split ranges are merged flash-decoding style."""
import numpy as np
from numba import njit, prange

from .blocks import combine_heads, load_heads, normalise, pv, qk, softmax_block, unit_range
from .simd import FAST, prefetch_lines


@njit(cache=True, fastmath=FAST)
def prefetch_ahead(run, nxt, R0, R1, A):
    """Prefetch rows [R0 + A, R1 + A) of the walk whose current run is `run` and next run `nxt` (each a page
    [num_kv_heads, page_size, dim] read as num_kv_heads * page_size rows); A <= rows of a run."""
    HP = run.shape[0] * run.shape[1]
    a = R0 + A
    b = R1 + A
    if a < HP:
        prefetch_lines(run, a, min(b, HP))
    if b > HP:
        prefetch_lines(nxt, max(a - HP, 0), b - HP)


@njit(cache=True, fastmath=FAST)
def attend_pages(qs, k_pages, v_pages, pages, lo, hi, scale, block, ahead, S, m, l, acc):
    """Unnormalised attention of every query-head group over the keys at absolute positions [lo, hi) of one
    sequence (`pages`: its row of the page table).

    qs [num_kv_heads, G, head_dim] (the query), scale: score scale, S [num_kv_heads, G, block] scratch; leaves the running (unscaled) max
    m [num_kv_heads, G], running sum l [num_kv_heads, G] and unnormalised output acc [num_kv_heads, G, head_dim_v].

    Keys are taken `block` at a time (a multiple of page_size, aligned to absolute positions). Within a block the
    walk is page-major, head-minor: the scores of page j for heads 0..H-1 (one contiguous run of K), the
    softmax update per head, then the values of page j for heads 0..H-1 (one contiguous run of V). Each tile is
    taken in chunks of rows; while a chunk is used, the rows `ahead` bytes further along the walk are
    prefetched (the next run after a page's K is the next page's K, after the block's last K the block's first
    V, after its last V the next block's first K)."""
    P = k_pages.shape[2]
    H = k_pages.shape[1]
    RC = 16 if qs.shape[1] >= 8 else min(16, max(4, 4096 // (k_pages.shape[3] * k_pages.itemsize)))
    AK = min(H * P, max(1, ahead // (k_pages.shape[3] * k_pages.itemsize)))
    AV = min(H * P, max(1, ahead // (v_pages.shape[3] * v_pages.itemsize)))
    first = True
    b0 = lo
    while b0 < hi:
        b1 = min(hi, (b0 // block + 1) * block)
        jb = b0 // P
        jn = b1 // P if b1 < hi else jb
        c = 0
        t = b0
        while t < b1:
            j = t // P
            s0 = t - j * P
            s1 = min(P, b1 - j * P)
            kpage = k_pages[pages[j]]
            nxt = k_pages[pages[j + 1]] if t + s1 - s0 < b1 else v_pages[pages[jb]]
            for h in range(H):
                kp = kpage[h]
                r = s0
                while r < s1:
                    r1 = min(s1, r + RC)
                    prefetch_ahead(kpage, nxt, h * P + r, h * P + r1, AK)
                    qk(qs[h], kp, r, r1, S[h], c + r - s0)
                    r = r1
            c += s1 - s0
            t += s1 - s0
        for h in range(H):
            softmax_block(S[h], c, m[h], l[h], acc[h], first, scale)
        first = False
        c = 0
        t = b0
        while t < b1:
            j = t // P
            s0 = t - j * P
            s1 = min(P, b1 - j * P)
            vpage = v_pages[pages[j]]
            nxt = v_pages[pages[j + 1]] if t + s1 - s0 < b1 else k_pages[pages[jn]]
            for h in range(H):
                vp = vpage[h]
                r = s0
                while r < s1:
                    r1 = min(s1, r + RC)
                    prefetch_ahead(vpage, nxt, h * P + r, h * P + r1, AV)
                    pv(S[h], c + r - s0, vp, r, r1, acc[h])
                    r = r1
            c += s1 - s0
            t += s1 - s0
        b0 = b1


@njit(cache=True, fastmath=FAST)
def decode_units(q, k_pages, v_pages, page_indices, page_indptr, query_seq, query_pos, window, scale, out,
                 units, u0, u1, block, ahead, wm, wl, wacc):
    """Process work units u0..u1-1 with one set of scratch buffers (the serial kernel, and the body of each
    parallel chunk). block: keys per online-softmax block (whole pages); ahead: prefetch distance in bytes.

    units.shape[0] == 0 (serial): unit u is query u over its whole visible range.
    Otherwise unit u is the row units[u] = (query, lo, hi, slot): keys [lo, hi); slot < 0: the unit covers the
    whole range, normalise into out; else store the partial (max, sum, acc) at workspace slot
    (wm, wl [slots, num_kv_heads, G], wacc [slots, num_kv_heads, G, head_dim_v])."""
    H = k_pages.shape[1]
    G = q.shape[1] // H
    D = q.shape[2]
    Dv = v_pages.shape[3]
    qs = np.empty((H, G, D), np.float64)    # scores accumulated in float64 (exact products, one rounding into S)
    S = np.empty((H, G, block), q.dtype)
    m = np.empty((H, G), q.dtype)
    l = np.empty((H, G), q.dtype)
    acc = np.empty((H, G, Dv), q.dtype)
    sc = np.empty(1, q.dtype)
    sc[0] = scale                    # the scale in the compute dtype: score arithmetic never widens to float64
    scale_c = sc[0]
    for u in range(u0, u1):
        i, lo, hi, w = unit_range(units, u, query_pos, window)
        s = query_seq[i]
        pages = page_indices[page_indptr[s]:page_indptr[s + 1]]
        load_heads(q[i], qs)
        if w < 0:
            attend_pages(qs, k_pages, v_pages, pages, lo, hi, scale_c, block, ahead, S, m, l, acc)
            for h in range(H):
                normalise(acc[h], l[h], out[i, h * G:(h + 1) * G])
        else:
            attend_pages(qs, k_pages, v_pages, pages, lo, hi, scale_c, block, ahead, S, wm[w], wl[w], wacc[w])


@njit(cache=True, fastmath=FAST)
def combine_items(out, items, a, b, wm, wl, wacc, scale):
    """Merge the partials of split queries items[a:b] = (query, first slot, number of slots) into out."""
    for it in range(a, b):
        combine_heads(wm, wl, wacc, items[it, 1], items[it, 2], out[items[it, 0]], scale)


@njit(cache=True)
def plan_units(query_pos, window, split, nchunks):
    """Cut every query's visible key range at absolute multiples of `split` tokens into units and balance the
    units over `nchunks` contiguous chunks by cost (tokens + 16 per unit); consecutive units of a query are
    consecutive key ranges, so a chunk walks contiguous pages.

    Returns units [U, 4] = (query, lo, hi, workspace slot or -1 when the range is not split),
    bounds [nchunks + 1] (chunk c = units bounds[c]..bounds[c+1]-1), items [n_split, 3] = (query, first slot,
    number of slots) of the split queries, and the number of workspace slots."""
    nq = query_pos.shape[0]
    C = split
    U = 0
    n_items = 0
    for i in range(nq):
        hi = query_pos[i] + 1
        lo = max(0, hi - window) if window > 0 else 0
        n = (hi - 1) // C - lo // C + 1
        U += n
        if n > 1:
            n_items += 1
    units = np.empty((U, 4), np.int64)
    items = np.empty((n_items, 3), np.int64)
    u = 0
    w = 0
    it = 0
    total = 0
    for i in range(nq):
        hi = query_pos[i] + 1
        lo = max(0, hi - window) if window > 0 else 0
        n = (hi - 1) // C - lo // C + 1
        if n > 1:
            items[it, 0] = i
            items[it, 1] = w
            items[it, 2] = n
            it += 1
        for j in range(n):
            a = max(lo, (lo // C + j) * C)
            b = min(hi, (lo // C + j + 1) * C)
            units[u, 0] = i
            units[u, 1] = a
            units[u, 2] = b
            if n > 1:
                units[u, 3] = w
                w += 1
            else:
                units[u, 3] = -1
            total += b - a + 16
            u += 1
    nch = max(1, nchunks)
    bounds = np.empty(nch + 1, np.int64)
    bounds[0] = 0
    cum = 0
    c = 1
    for u in range(U):
        cost = units[u, 2] - units[u, 1] + 16
        mid2 = 2 * cum + cost  # twice the unit's cost midpoint: unit u goes to chunk floor(mid * nch / total)
        while c < nch and mid2 * nch > 2 * c * total:
            bounds[c] = u
            c += 1
        cum += cost
    while c <= nch:
        bounds[c] = U
        c += 1
    return units, bounds, items, w


@njit(parallel=True, cache=True, fastmath=FAST)
def decode_parallel(q, k_pages, v_pages, page_indices, page_indptr, query_seq, query_pos, scale, window, out,
                    units, bounds, items, num_slots, block, ahead):
    """The units of `plan_units` on all threads: one prange iteration per chunk of units (each owns its units'
    outputs and workspace slots), then the split queries are merged (prange over items when there are enough)."""
    H = k_pages.shape[1]
    G = q.shape[1] // H
    Dv = v_pages.shape[3]
    wm = np.empty((num_slots, H, G), q.dtype)
    wl = np.empty((num_slots, H, G), q.dtype)
    wacc = np.empty((num_slots, H, G, Dv), q.dtype)
    nch = bounds.shape[0] - 1
    for ck in prange(nch):
        decode_units(q, k_pages, v_pages, page_indices, page_indptr, query_seq, query_pos, window, scale, out,
                     units, bounds[ck], bounds[ck + 1], block, ahead, wm, wl, wacc)
    n = items.shape[0]
    if n >= nch and num_slots * H * G * Dv >= 1 << 16:
        for ck in prange(nch):
            combine_items(out, items, ck * n // nch, (ck + 1) * n // nch, wm, wl, wacc, scale)
    else:
        combine_items(out, items, 0, n, wm, wl, wacc, scale)
    return out
