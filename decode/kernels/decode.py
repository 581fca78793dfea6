"""The single-query ("decode") kernel: work units of (query, kv head, key range), their planning, the serial
loop and the parallel driver with the flash-decoding combine of split ranges."""
import numpy as np
from numba import njit, prange

from .blocks import combine, load_group, normalise, prefetch_rows, prefetch_span, pv, qk, softmax_block
from .simd import FAST


@njit(cache=True, fastmath=FAST)
def attend_range(qs, k_pages, v_pages, pages, h, lo, hi, block, S, m, l, acc):
    """Unnormalised attention of the query-head group qs ([G, D], already scaled) over the keys at absolute
    positions [lo, hi) of one sequence (`pages`: its row of the page table), kv head h.
    Leaves the running max m[G], running sum l[G] and the unnormalised output acc[G, Dv].

    Keys are taken `block` at a time (block is a multiple of page_size, blocks aligned to absolute positions),
    each page tile in chunks of 4-16 rows. Software prefetch runs one phase ahead: while the scores of a
    chunk are computed its V rows are requested, while a V chunk is applied the K rows at the same offset of the
    next block are requested (the hardware prefetchers do not follow several rows read in lockstep)."""
    P = k_pages.shape[2]
    # rows per chunk: ~4 KiB of K for small groups (memory bound), 16 rows for groups >= 8 (compute bound)
    RC = 16 if qs.shape[0] >= 8 else min(16, max(4, 4096 // (k_pages.shape[3] * k_pages.itemsize)))
    first = True
    b0 = lo
    while b0 < hi:
        b1 = min(hi, (b0 // block + 1) * block)
        n1 = min(hi, (b1 // block + 1) * block)
        c = 0
        t = b0
        while t < b1:
            j = t // P
            s0 = t - j * P
            s1 = min(P, b1 - j * P)
            kp = k_pages[pages[j], h]
            vp = v_pages[pages[j], h]
            r = s0
            while r < s1:
                r1 = min(s1, r + RC)
                prefetch_rows(vp, r, r1)
                qk(qs, kp, r, r1, S, c + r - s0)
                r = r1
            c += s1 - s0
            t += s1 - s0
        softmax_block(S, c, m, l, acc, first)
        first = False
        c = 0
        t = b0
        while t < b1:
            j = t // P
            s0 = t - j * P
            s1 = min(P, b1 - j * P)
            vp = v_pages[pages[j], h]
            r = s0
            while r < s1:
                r1 = min(s1, r + RC)
                q0 = b1 + c + r - s0
                prefetch_span(k_pages, pages, h, q0, min(n1, q0 + r1 - r))
                pv(S, c + r - s0, vp, r, r1, acc)
                r = r1
            c += s1 - s0
            t += s1 - s0
        b0 = b1



@njit(cache=True, fastmath=FAST)
def decode_units(q, k_pages, v_pages, page_indices, page_indptr, query_seq, query_pos, window, scale, out,
               units, u0, u1, block, wm, wl, wacc):
    """Process work units u0..u1-1 with one set of scratch buffers (the serial kernel, and the body of each
    parallel chunk). block: keys per online-softmax block (whole pages, ~64 tokens).

    units.shape[0] == 0 (serial): unit u is query u // num_kv_heads, kv head u % num_kv_heads, its whole range.
    Otherwise unit u is the row units[u] = (query, kv head, lo, hi, slot): keys [lo, hi); slot < 0: the unit
    covers the whole range, normalise into out; else store the partial (max, sum, acc) at workspace slot."""
    Hkv = k_pages.shape[1]
    G = q.shape[1] // Hkv
    D = q.shape[2]
    Dv = v_pages.shape[3]
    qs = np.empty((G, D), q.dtype)
    S = np.empty((G, block), q.dtype)
    m = np.empty(G, q.dtype)
    l = np.empty(G, q.dtype)
    acc = np.empty((G, Dv), q.dtype)
    serial = units.shape[0] == 0
    for u in range(u0, u1):
        if serial:
            i = u // Hkv
            h = u - i * Hkv
            hi = query_pos[i] + 1
            lo = max(0, hi - window) if window > 0 else 0
            w = -1
        else:
            i = units[u, 0]
            h = units[u, 1]
            lo = units[u, 2]
            hi = units[u, 3]
            w = units[u, 4]
        s = query_seq[i]
        pages = page_indices[page_indptr[s]:page_indptr[s + 1]]
        load_group(q, i, h, scale, qs)
        if w < 0:
            attend_range(qs, k_pages, v_pages, pages, h, lo, hi, block, S, m, l, acc)
            normalise(acc, l, out[i, h * G:(h + 1) * G])
        else:
            attend_range(qs, k_pages, v_pages, pages, h, lo, hi, block, S, wm[w], wl[w], wacc[w])


@njit(cache=True, fastmath=FAST)
def combine_items(out, G, items, a, b, wm, wl, wacc):
    for it in range(a, b):
        h = items[it, 1]
        combine(wm, wl, wacc, items[it, 2], items[it, 3], out[items[it, 0], h * G:(h + 1) * G])



@njit(cache=True)
def plan_units(query_pos, window, num_kv_heads, split, nchunks):
    """Cut every (query, kv head) key range at absolute multiples of `split` tokens into units and balance the
    units over `nchunks` contiguous chunks by cost (tokens + 16 per unit).

    Returns units [U, 5] = (query, kv head, lo, hi, workspace slot or -1 when the range is not split),
    bounds [nchunks + 1] (chunk c = units bounds[c]..bounds[c+1]-1), items [n_split, 4] = (query, kv head,
    first slot, number of slots) of the split ranges, and the number of workspace slots."""
    nq = query_pos.shape[0]
    C = split
    U = 0
    n_items = 0
    W = 0
    for i in range(nq):
        hi = query_pos[i] + 1
        lo = max(0, hi - window) if window > 0 else 0
        n = (hi - 1) // C - lo // C + 1
        U += n * num_kv_heads
        if n > 1:
            n_items += num_kv_heads
            W += n * num_kv_heads
    units = np.empty((U, 5), np.int64)
    items = np.empty((n_items, 4), np.int64)
    u = 0
    w = 0
    it = 0
    total = 0
    for i in range(nq):
        hi = query_pos[i] + 1
        lo = max(0, hi - window) if window > 0 else 0
        n = (hi - 1) // C - lo // C + 1
        for h in range(num_kv_heads):
            if n > 1:
                items[it, 0] = i
                items[it, 1] = h
                items[it, 2] = w
                items[it, 3] = n
                it += 1
            for j in range(n):
                a = max(lo, (lo // C + j) * C)
                b = min(hi, (lo // C + j + 1) * C)
                units[u, 0] = i
                units[u, 1] = h
                units[u, 2] = a
                units[u, 3] = b
                if n > 1:
                    units[u, 4] = w
                    w += 1
                else:
                    units[u, 4] = -1
                total += b - a + 16
                u += 1
    nch = max(1, nchunks)
    bounds = np.empty(nch + 1, np.int64)
    bounds[0] = 0
    cum = 0
    c = 1
    for u in range(U):
        cost = units[u, 3] - units[u, 2] + 16
        mid2 = 2 * cum + cost  # twice the unit's cost midpoint: unit u goes to chunk floor(mid * nch / total)
        while c < nch and mid2 * nch > 2 * c * total:
            bounds[c] = u
            c += 1
        cum += cost
    while c <= nch:
        bounds[c] = U
        c += 1
    return units, bounds, items, W


@njit(parallel=True, cache=True, fastmath=FAST)
def decode_parallel(q, k_pages, v_pages, page_indices, page_indptr, query_seq, query_pos, scale, window, out,
                    units, bounds, items, num_slots, block):
    """The units of `plan_units` on all threads: one prange iteration per chunk of units (each owns its units'
    outputs and workspace slots), then the split ranges are merged (prange over items when there are enough)."""
    Hkv = k_pages.shape[1]
    G = q.shape[1] // Hkv
    Dv = v_pages.shape[3]
    wm = np.empty((num_slots, G), q.dtype)
    wl = np.empty((num_slots, G), q.dtype)
    wacc = np.empty((num_slots, G, Dv), q.dtype)
    nch = bounds.shape[0] - 1
    for ck in prange(nch):
        decode_units(q, k_pages, v_pages, page_indices, page_indptr, query_seq, query_pos, window, scale, out,
                     units, bounds[ck], bounds[ck + 1], block, wm, wl, wacc)
    n = items.shape[0]
    if n >= nch and num_slots * G * Dv >= 1 << 16:
        for ck in prange(nch):
            combine_items(out, G, items, ck * n // nch, (ck + 1) * n // nch, wm, wl, wacc)
    else:
        combine_items(out, G, items, 0, n, wm, wl, wacc)
    return out
