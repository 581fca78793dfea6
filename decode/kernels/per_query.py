"""The per-query ("decode") kernel, one skeleton for every storage format (`loaders`). Work unit = (query, key
range) with EVERY kv head: each page of the range is read whole (its K for all heads is one contiguous run of
the head-major pool, then its V), so a thread streams long runs instead of one head's small tile per page.
Units come from `units.plan_units` (ranges cut at absolute positions), are balanced over the threads, and split
ranges are merged (`units.merge_rows`) in slot order. bfloat16 pages with >= `amx_decode.MIN_GROUP` q heads per kv
head take the AMX tiles where the plan says so (`amx_decode.attend_query` instead of `attend_pages`).

Arguments shared by the entry points (docs/kernel.md, "API of the kernels"): q [num_queries, num_q_heads,
head_dim] compute dtype; k_pages / v_pages as `loaders` reads them; k_scales / v_scales None (float formats) or
uint16 [num_pages, num_kv_heads, page_size, ceil(width / 32)] (int8); acc0: a zero of the q.k accumulation dtype
(float32 by default, float64 for precision="highest"; float32 for int8).
"""
import numpy as np
from numba import njit, prange

from .amx_decode import attend_query, decode_scratch, prepare_query, takes_tiles
from .amx_tiles import HOST as AMX_CODE
from .bf16_dot import q_buffers, split_query
from .blocks import load_heads, normalise, softmax_block, unit_range
from .loaders import key_scratch, score_rows, tile_scales, value_rows
from .register_blocks import in_pairs, unpair
from .simd import FAST, borrow, prefetch_lines, touch_pages
from .units import merge_rows
from .vector_ir import WIDE

GROUP = 32          # values per int8 scale group (the width of a scale row: ceil(width / GROUP))
# pages are touched (`simd.touch_pages`) this many times the prefetch distance ahead, so that a page's address
# translation is in the TLB before its lines are hinted (a hint that misses the TLB is dropped). Measured on the
# 2-vCPU Zen 4 guest (4 KiB pages under nested paging, no transparent huge pages): a cold one-thread call over
# 1 MiB of bfloat16 K/V 197 -> 184 µs at 3x; touching within the hinted rows (1x) did not help; on the 2-thread
# decode cells 2x, 3x, 5x and 8x measured alike (docs/kernel.md, "Memory access"). Not on a CPU without AVX-512
# (`vector_ir.WIDE` False): on the Zen 3 guest (AVX2) every cold decode / batch cell took 0.67-0.86x the time
# without them (float32 MHA-32768 cold 73-78 -> 39-41 ms), the hot ones alike or faster
TOUCH_FACTOR = 3 if WIDE else 0


@njit(cache=True, fastmath=FAST)
def prefetch_ahead(run, nxt, R0, R1, A, T):
    """Prefetch rows [R0 + A, R1 + A) of the walk whose current run is `run` and next run `nxt` (each a page
    [num_kv_heads, page_size, dim] read as num_kv_heads * page_size rows), and touch the pages of rows [R0 + T,
    R1 + T) (`touch_pages`; none where T is 0); A, T <= rows of a run."""
    HP = run.shape[0] * run.shape[1]
    a = R0 + A
    b = R1 + A
    if a < HP:
        prefetch_lines(run, a, min(b, HP))
    if b > HP:
        prefetch_lines(nxt, max(a - HP, 0), b - HP)
    if T > 0:                        # T = 0: no touches (`TOUCH_FACTOR`)
        a = R0 + T
        b = R1 + T
        if a < HP:
            touch_pages(run, a, min(b, HP))
        if b > HP:
            touch_pages(nxt, max(a - HP, 0), min(b - HP, HP))


@njit(cache=True, fastmath=FAST, inline="always")
def walk_block(values, qs, qb, qf, parts, pool, nxt_pool, scales, pages, b0, b1, jn, S, acc, RC, A, T, st, rows):
    """One pass over the keys [b0, b1) of a block (whole pages), page-major and head-minor: scores into S
    (values False: ``S[h, :, c] = qs[h] . K[t]``) or the weighted values into acc (values True). Each tile is taken
    in chunks of RC rows; while a chunk is used, the rows A further along the walk are prefetched and those T
    further are touched (the next run
    after the block's last page is page ``pages[jn]`` of ``nxt_pool``: K's pass is followed by the block's first V,
    V's by the next block's first K). qb / qf / parts: q prepared for bfloat16 pages (`bf16_dot.split_query`).
    st / rows: the loader's scratch (`loaders`). Inlined into its two call sites
    (numba IR), where ``values`` is a constant: each is a loop of one kind."""
    P = pool.shape[2]
    H = pool.shape[1]
    c = 0
    t = b0
    while t < b1:
        j = t // P
        s0 = t - j * P
        s1 = min(P, b1 - j * P)
        page = pool[pages[j]]
        nxt = pool[pages[j + 1]] if t + s1 - s0 < b1 else nxt_pool[pages[jn]]
        for h in range(H):
            tile_scales(scales, pages[j], h, st)
            tile = page[h]
            r = s0
            while r < s1:
                r1 = min(s1, r + RC)
                prefetch_ahead(page, nxt, h * P + r, h * P + r1, A, T)
                if values:
                    value_rows(S[h], c + r - s0, tile, st, scales, r, r1, acc[h], rows)
                else:
                    score_rows(qs[h], qb[h], qf[h], parts, tile, st, scales, r, r1, S[h], c + r - s0, rows)
                r = r1
        c += s1 - s0
        t += s1 - s0
    return c


@njit(cache=True, fastmath=FAST)
def attend_pages(qs, qb, qf, parts, k_pages, v_pages, k_scales, v_scales, pages, lo, hi, scale, block, ahead, S, m, l,
                 acc, st, kt, vt):
    """Unnormalised attention of every query-head group over the keys at absolute positions [lo, hi) of one
    sequence (`pages`: its row of the page table).

    qs [num_kv_heads, G, head_dim] (the query, accumulation dtype), qb / qf / parts: q prepared for bfloat16 pages,
    scale: score scale, S [num_kv_heads, G, block] scratch; leaves the running (unscaled) max m [num_kv_heads, G],
    running sum l [num_kv_heads, G] and unnormalised output acc [num_kv_heads, G, head_dim_v]. Keys are taken
    `block` at a time (a multiple of page_size, aligned to absolute positions): the scores of the block
    (`walk_block` over K), the softmax update per head, then the values (`walk_block` over V)."""
    qs, qb, qf, k_pages, v_pages, k_scales, v_scales = (borrow(qs), borrow(qb), borrow(qf), borrow(k_pages),
                                                         borrow(v_pages), borrow(k_scales), borrow(v_scales))
    pages, S, m, l, acc, st, kt, vt = (borrow(pages), borrow(S), borrow(m), borrow(l), borrow(acc), borrow(st),
                                       borrow(kt), borrow(vt))
    P = k_pages.shape[2]
    H = k_pages.shape[1]
    RC = 16 if qs.shape[1] >= 8 else min(16, max(4, 4096 // (k_pages.shape[3] * k_pages.itemsize)))
    AK = min(H * P, max(1, ahead // (k_pages.shape[3] * k_pages.itemsize)))
    AV = min(H * P, max(1, ahead // (v_pages.shape[3] * v_pages.itemsize)))
    TK = min(H * P, TOUCH_FACTOR * AK)
    TV = min(H * P, TOUCH_FACTOR * AV)
    first = True
    b0 = lo
    while b0 < hi:
        b1 = min(hi, (b0 // block + 1) * block)
        jb = b0 // P
        jn = b1 // P if b1 < hi else jb
        c = walk_block(False, qs, qb, qf, parts, k_pages, v_pages, k_scales, pages, b0, b1, jb, S, acc, RC, AK, TK, st,
                       kt)
        for h in range(H):
            softmax_block(S[h], c, m[h], l[h], acc[h], first, scale)
        first = False
        walk_block(True, qs, qb, qf, parts, v_pages, k_pages, v_scales, pages, b0, b1, jn, S, acc, RC, AV, TV, st, vt)
        b0 = b1


@njit(cache=True, fastmath=FAST)
def query_units(q, k_pages, v_pages, k_scales, v_scales, page_indices, page_indptr, query_seq, query_pos, window,
                scale, out, units, u0, u1, block, ahead, wm, wl, wacc, acc0, dot):
    """Process work units u0..u1-1 with one set of scratch buffers (the serial kernel, and the body of each
    parallel chunk). block: keys per online-softmax block (whole pages); ahead: prefetch distance in bytes;
    dot: which queries take vdpbf16ps scores over bfloat16 pages (`bf16_dot` modes 0-2, the low bits) and whether
    the AMX tiles take them (`amx_decode.FLAG`: every query, where `decode_scratch` applies).

    units.shape[0] == 0: unit u is query u over its whole visible range. Otherwise unit u is the row units[u] =
    (query, lo, hi, slot): keys [lo, hi); slot < 0: the unit covers the whole range, normalise into out; else
    store the partial (max, sum, acc) at workspace slot (wm, wl [slots, num_kv_heads, G], wacc [slots,
    num_kv_heads, G, head_dim_v])."""
    H = k_pages.shape[1]
    G = q.shape[1] // H
    D = q.shape[2]
    Dv = v_pages.shape[3]
    P = k_pages.shape[2]
    RC = 16
    qs = np.full((H, G, D), acc0)      # q.k accumulated in acc0's dtype
    ax = decode_scratch(k_pages, v_pages, q, acc0, H, dot)    # the AMX tiles' buffers (empty: they do not apply)
    amx = AMX_CODE and ax[0].shape[0] > 0    # a compile-time False without AMX: numba prunes the tiles' branches
    mode = dot % 8
    qb, qf = q_buffers(k_pages, qs)    # q as bfloat16 parts / float32 halves (empty unless bfloat16 pages and
                                       # float32 q.k)
    S = np.empty((H, G, block), q.dtype)
    m = np.empty((H, G), q.dtype)
    l = np.empty((H, G), q.dtype)
    acc = np.empty((H, G, Dv), q.dtype)
    st = np.empty(P * (-(-max(D, Dv) // GROUP)), np.float32)
    kt = key_scratch(k_scales, RC, D, qs)     # float64 with float64 q.k: key rows widened once (loaders)
    vt = np.empty((RC, Dv), np.float32)
    sc = np.empty(1, q.dtype)
    sc[0] = scale                    # the scale in the compute dtype: score arithmetic never widens to float64
    scale_c = sc[0]
    prev = -1
    parts = 0
    for u in range(u0, u1):
        i, lo, hi, w = unit_range(units, u, query_pos, window)
        s = query_seq[i]
        pages = page_indices[page_indptr[s]:page_indptr[s + 1]]
        if i != prev:                  # the pieces of one query are consecutive units: prepared once
            if amx:
                parts = prepare_query(q[i], ax)
            else:
                load_heads(q[i], qs)
                parts = split_query(q[i], qb, qf, mode)
            prev = i
        if amx:
            attend_query(k_pages, v_pages, pages, lo, hi, scale_c, parts, ax, out[i], w, wm, wl, wacc)
        elif w < 0:
            attend_pages(qs, qb, qf, parts, k_pages, v_pages, k_scales, v_scales, pages, lo, hi, scale_c, block, ahead,
                         S, m, l, acc, st, kt, vt)
            for h in range(H):
                normalise(acc[h], l[h], out[i, h * G:(h + 1) * G], in_pairs(v_pages, acc))
        else:
            attend_pages(qs, qb, qf, parts, k_pages, v_pages, k_scales, v_scales, pages, lo, hi, scale_c, block, ahead,
                         S, wm[w], wl[w], wacc[w], st, kt, vt)


@njit(cache=True, fastmath=FAST)
def merge_items(out, items, a, b, wm, wl, wacc, scale, pairs):
    """Merge the partials of split queries items[a:b] = (query, first slot, number of slots) into out (wm, wl
    [slots, num_kv_heads, G], wacc [slots, num_kv_heads, G, head_dim_v]; query head h*G + g); pairs: the partials'
    first lanes are in the pair order (`register_blocks.in_pairs`), put back by dim in out."""
    W = wm.shape[0]
    Hq = wm.shape[1] * wm.shape[2]
    Dv = wacc.shape[3]
    m2 = wm.reshape((W, Hq))
    l2 = wl.reshape((W, Hq))
    acc2 = wacc.reshape((W, Hq, Dv))
    for it in range(a, b):
        merge_rows(m2, l2, acc2, items[it, 1], items[it, 2], 0, out[items[it, 0]], scale)
        if pairs:
            unpair(out[items[it, 0]], Dv - Dv % 32)


@njit(inline="always")
def paired_partials(k_pages, v_pages, q, acc0, dot):
    """Whether the partials of split queries hold their lanes in the pair order (`register_blocks.in_pairs`:
    bfloat16 values into float32 accumulators) for the merge to unpair: not where the AMX tiles take the queries
    (`amx_decode.takes_tiles`), whose partials are by dim."""
    return in_pairs(v_pages, q) and not takes_tiles(k_pages, v_pages, q, acc0, k_pages.shape[1], dot)


@njit(cache=True, fastmath=FAST)
def _workspace(q, H, Dv, num_slots):
    G = q.shape[1] // H
    return (np.empty((num_slots, H, G), q.dtype), np.empty((num_slots, H, G), q.dtype),
            np.empty((num_slots, H, G, Dv), q.dtype))


@njit(cache=True, fastmath=FAST)
def query_serial(q, k_pages, v_pages, k_scales, v_scales, page_indices, page_indptr, query_seq, query_pos, scale,
                 window, out, units, items, num_slots, block, ahead, acc0, dot):
    """Every unit on the calling thread, then the merge of the split queries (units empty: one per query)."""
    wm, wl, wacc = _workspace(q, k_pages.shape[1], v_pages.shape[3], num_slots)
    n = units.shape[0] if units.shape[0] else query_pos.shape[0]
    zero = np.int64(0)               # not the literal 0: the serial and parallel kernels share one compiled body
    query_units(q, k_pages, v_pages, k_scales, v_scales, page_indices, page_indptr, query_seq, query_pos, window,
                scale, out, units, zero, n, block, ahead, wm, wl, wacc, acc0, dot)
    merge_items(out, items, zero, items.shape[0], wm, wl, wacc, scale, paired_partials(k_pages, v_pages, q, acc0, dot))
    return out


@njit(parallel=True, cache=True, fastmath=FAST)
def query_parallel(q, k_pages, v_pages, k_scales, v_scales, page_indices, page_indptr, query_seq, query_pos, scale,
                   window, out, units, bounds, items, num_slots, block, ahead, acc0, dot):
    """The units of `plan_units` on all threads: one prange iteration per chunk of units (each owns its units'
    outputs and workspace slots), then the split queries are merged (prange over items when there are enough;
    each query's parts always in slot order)."""
    H = k_pages.shape[1]
    wm, wl, wacc = _workspace(q, H, v_pages.shape[3], num_slots)
    nch = bounds.shape[0] - 1
    for ck in prange(nch):
        query_units(q, k_pages, v_pages, k_scales, v_scales, page_indices, page_indptr, query_seq, query_pos,
                    window, scale, out, units, bounds[ck], bounds[ck + 1], block, ahead, wm, wl, wacc, acc0, dot)
    n = items.shape[0]
    pairs = paired_partials(k_pages, v_pages, q, acc0, dot)
    if n >= nch and wacc.size >= 1 << 16:
        for ck in prange(nch):
            merge_items(out, items, ck * n // nch, (ck + 1) * n // nch, wm, wl, wacc, scale, pairs)
    else:
        merge_items(out, items, np.int64(0), n, wm, wl, wacc, scale, pairs)
    return out
