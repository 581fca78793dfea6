"""The single-query kernel over int8 pages (`kvcache.quant`): int8 values and float16 group scales read straight
from the pool, no dequantized copy of it.

Layout (per layer):
    q:        [num_queries, num_q_heads, head_dim]          float32
    k_pages:  [num_pages, num_kv_heads, page_size, head_dim]     int8
    k_scales: [num_pages, num_kv_heads, page_size, ceil(head_dim / 32)]    uint16 (= float16 bits)
    v_pages:  [num_pages, num_kv_heads, page_size, head_dim_v]   int8
    v_scales: [num_pages, num_kv_heads, page_size, ceil(head_dim_v / 32)]  uint16
    out:      [num_queries, num_q_heads, head_dim_v]        float32

Work: a unit is (query, key range [lo, hi)) with *all* kv heads: it walks the range a block (~64 tokens, whole
pages) at a time and, inside each page, every kv head in turn, so a thread streams whole contiguous pages
(the access pattern that read 52-55 GB/s with 2 threads where one head across all pages read 17-37 GB/s,
shared/notes/measured-facts.md). Long ranges are cut into units of `split` tokens (flash-decoding) and merged.

Scales (G = query heads per kv head; a page tile's float16 scales are converted once, `scales_f32`):
    K  G < 4:   `dot4_i8`   scores straight from the int8 rows, the group scale applied once per row group
       G 4-7:   `dot44_i8`  4 heads x 4 rows, each row converted and scaled once for the 4 heads
       G >= 8:  `widen_rows` + `qk`  a 16-row chunk widened once with its scales, reused by all G heads
    V  G < 4:   `pv1_i8`    the V scale folded into the softmax weight (p * scale per row group)
       G 4-7:   `pv4_i8`    4 heads x 32 lanes in registers, each value vector converted and scaled once
       G >= 8:  `widen_rows` + `pv`
Scores, softmax and accumulation are float32, as for float16/float32 storage.

The micro-kernels are in `int8_simd`, the per-tile row passes in `int8_rows`; the tiled multi-query path over
int8 pages is `decode.kernels.multiquery` with scale arrays (its blocks widened by `int8_rows.widen_block`).
"""
import numpy as np
from numba import njit, prange

from .blocks import combine, load_group, normalise, qk, softmax_block, unit_range
from .int8_rows import pv_folded, pv_int8, qk4_int8, qk_int8, scales_f32, widen_rows
from .int8_simd import GROUP
from .simd import FAST

ONE = np.float32(1.0)  # softmax_block's scale: this kernel scales q up front
CHUNK = 16            # rows per widened tile


@njit(cache=True, fastmath=FAST)
def attend_range_int8(qs, kq, ks, vq, vs, pages, lo, hi, block, S, m, l, acc, kt, vt, kst, vst):
    """Unnormalised attention of every query head over positions [lo, hi) of one sequence (`pages`: its row of
    the page table), all kv heads. qs [Hkv, G, D] (scaled queries), S [Hkv, G, block], m, l [Hkv, G],
    acc [Hkv, G, Dv]; kt [CHUNK, D], vt [CHUNK, Dv], kst [page_size * Gk], vst [page_size * Gv] float32 scratch."""
    P = kq.shape[2]
    Hkv = kq.shape[1]
    G = qs.shape[1]
    D = kq.shape[3]
    RC = kt.shape[0]
    first = True
    b0 = lo
    while b0 < hi:
        b1 = min(hi, (b0 // block + 1) * block)
        c = 0
        t = b0
        while t < b1:                                   # scores: page by page, every kv head of the page
            j = t // P
            s0 = t - j * P
            s1 = min(P, b1 - j * P)
            page = pages[j]
            for h in range(Hkv):
                kp = kq[page, h]
                scales_f32(ks[page, h], kst)
                Sh = S[h]
                qh = qs[h]
                if G < 4:
                    qk_int8(qh, kp, kst, s0, s1, Sh, c)
                    continue
                if G < 8 and D >= GROUP:
                    qk4_int8(qh, kp, kst, s0, s1, Sh, c, kt)
                    continue
                r = s0
                while r < s1:
                    r1 = min(s1, r + RC)
                    widen_rows(kp, kst, r, r1, kt)
                    qk(qh, kt, 0, r1 - r, Sh, c + r - s0)
                    r = r1
            c += s1 - s0
            t += s1 - s0
        for h in range(Hkv):
            softmax_block(S[h], c, m[h], l[h], acc[h], first, ONE)   # scores pre-scaled (load_group)
        first = False
        c = 0
        t = b0
        while t < b1:                                   # values, in the same order
            j = t // P
            s0 = t - j * P
            s1 = min(P, b1 - j * P)
            page = pages[j]
            for h in range(Hkv):
                scales_f32(vs[page, h], vst)
                if G < 4:
                    pv_folded(S[h], c, vq[page, h], vst, s0, s1, acc[h])
                else:
                    pv_int8(S[h], c, vq[page, h], vst, s0, s1, acc[h], vt)
            c += s1 - s0
            t += s1 - s0
        b0 = b1


@njit(cache=True, fastmath=FAST)
def int8_units(q, kq, ks, vq, vs, page_indices, page_indptr, query_seq, query_pos, window, scale, out,
               units, u0, u1, block, wm, wl, wacc):
    """Process units u0..u1-1 with one set of scratch buffers. units.shape[0] == 0 (serial): unit u is query u
    over its whole range, normalised into out. Otherwise units[u] = (query, lo, hi, slot): slot < 0 normalises
    into out, else the partial (max, sum, acc) goes to workspace slot ``slot`` (wm, wl [W, Hkv, G], wacc
    [W, Hkv, G, Dv])."""
    Hkv = kq.shape[1]
    G = q.shape[1] // Hkv
    D = q.shape[2]
    Dv = vq.shape[3]
    RC = min(CHUNK, kq.shape[2])
    qs = np.empty((Hkv, G, D), np.float32)
    S = np.empty((Hkv, G, block), np.float32)
    m = np.empty((Hkv, G), np.float32)
    l = np.empty((Hkv, G), np.float32)
    acc = np.empty((Hkv, G, Dv), np.float32)
    kt = np.empty((RC, D), np.float32)
    vt = np.empty((RC, Dv), np.float32)
    kst = np.empty(ks.shape[2] * ks.shape[3], np.float32)
    vst = np.empty(vs.shape[2] * vs.shape[3], np.float32)
    for u in range(u0, u1):
        i, lo, hi, w = unit_range(units, u, query_pos, window)
        s = query_seq[i]
        pages = page_indices[page_indptr[s]:page_indptr[s + 1]]
        for h in range(Hkv):
            load_group(q, i, h, scale, qs[h])
        if w < 0:
            attend_range_int8(qs, kq, ks, vq, vs, pages, lo, hi, block, S, m, l, acc, kt, vt, kst, vst)
            for h in range(Hkv):
                normalise(acc[h], l[h], out[i, h * G:(h + 1) * G])
        else:
            attend_range_int8(qs, kq, ks, vq, vs, pages, lo, hi, block, S, wm[w], wl[w], wacc[w], kt, vt, kst,
                              vst)


@njit(cache=True, fastmath=FAST)
def combine_int8(out, items, a, b, wm, wl, wacc):
    """Merge the split partials of items a..b-1 into out (all query heads of each item's query)."""
    W = wm.shape[0]
    Hq = wm.shape[1] * wm.shape[2]
    m2 = wm.reshape((W, Hq))
    l2 = wl.reshape((W, Hq))
    acc2 = wacc.reshape((W, Hq, wacc.shape[3]))
    for it in range(a, b):
        combine(m2, l2, acc2, items[it, 1], items[it, 2], out[items[it, 0]])


@njit(parallel=True, cache=True, fastmath=FAST)
def int8_parallel(q, kq, ks, vq, vs, page_indices, page_indptr, query_seq, query_pos, window, scale, out,
                  units, bounds, items, num_slots, block):
    """The units of `decode.plan_units` on all threads (one prange iteration per chunk of units, each owning its units'
    outputs and workspace slots), then the split ranges are merged (prange over items when there are enough)."""
    Hkv = kq.shape[1]
    G = q.shape[1] // Hkv
    Dv = vq.shape[3]
    wm = np.empty((num_slots, Hkv, G), np.float32)
    wl = np.empty((num_slots, Hkv, G), np.float32)
    wacc = np.empty((num_slots, Hkv, G, Dv), np.float32)
    nch = bounds.shape[0] - 1
    for ck in prange(nch):
        int8_units(q, kq, ks, vq, vs, page_indices, page_indptr, query_seq, query_pos, window, scale, out,
                   units, bounds[ck], bounds[ck + 1], block, wm, wl, wacc)
    n = items.shape[0]
    if n >= nch and num_slots * Hkv * G * Dv >= 1 << 16:
        for ck in prange(nch):
            combine_int8(out, items, ck * n // nch, (ck + 1) * n // nch, wm, wl, wacc)
    else:
        combine_int8(out, items, 0, n, wm, wl, wacc)
    return out
