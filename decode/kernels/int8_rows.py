"""Row-level pieces of the int8 kernels over one page tile of one kv head: the tile's scales converted once,
int8 rows widened with their group scales into float32 rows (the single-query kernel's widened chunks and the
tiled multi-query kernel's K/V blocks), and the single-query kernel's score and value passes per query-head
group (`qk_int8` G < 4, `qk4_int8` G 4-7, `pv_folded` G < 4, `pv_int8` G >= 4). Shapes in each docstring;
`decode.kernels.int8` walks the pages with them.
"""
import numpy as np
from numba import njit

from .blocks import pv
from .int8_simd import GROUP, dot4_i8, dot44_i8, h2f_all, pv1_i8, pv4_i8, widen32
from .simd import FAST


@njit(cache=True, fastmath=FAST)
def scales_f32(scales, st):
    """st[t * G + g] = float32(scales[t, g]) for a whole page tile (scales [page_size, G] uint16 float16 bits),
    one vectorised pass: converting one scale at a time where it is used chains every conversion to the previous
    one through a register merge (vpinsrw; 48 cycles per 128-value row, measured)."""
    h2f_all(scales, st)


@njit(cache=True, fastmath=FAST)
def widen_rows(src, st, r0, r1, dst):
    """dst[t - r0, d] = src[t, d] * st[t * G + d // 32] for t in [r0, r1): int8 rows and their group scales
    (`scales_f32` of the page tile) -> float32 (exact: 8 x 11 significant bits). src [page_size, D] int8,
    dst [>= r1 - r0, D] float32. Whole groups by `widen32`, a short last group element by element."""
    D = src.shape[1]
    full = D // GROUP
    G = -(-D // GROUP)
    for t in range(r0, r1):
        row = src[t]
        out = dst[t - r0]
        for g in range(full):
            widen32(row, g * GROUP, out, g * GROUP, st[t * G + g])
        if full * GROUP < D:
            s = st[t * G + full]
            for d in range(full * GROUP, D):
                out[d] = np.float32(row[d]) * s


@njit(cache=True, fastmath=FAST)
def pv_folded(S, c0, vp, st, s0, s1, acc):
    """acc[g, d] += sum_t (S[g, c0 + t - s0] * scale[t, d // 32]) * vp[t, d] for t in [s0, s1): the V scale folded
    into the softmax weight (one multiply per row group), the int8 values converted inside the FMA pass
    (`pv1_i8`: each 32-lane group's accumulator in registers over all the rows). S [G, block] float32,
    vp [page_size, Dv] int8, st the page tile's
    scales (`scales_f32`), acc [G, Dv] float32."""
    G = acc.shape[0]
    Dv = acc.shape[1]
    full = Dv // GROUP
    NG = -(-Dv // GROUP)
    for g in range(G):
        ag = acc[g]
        w = S[g]
        if full > 0:
            pv1_i8(S, g, c0, vp, st, NG, s0, s1, acc, full)
        if full * GROUP < Dv:                            # a short last group
            for t in range(s0, s1):
                w0 = w[c0 + t - s0] * st[t * NG + full]
                row = vp[t]
                for d in range(full * GROUP, Dv):
                    ag[d] += w0 * np.float32(row[d])


@njit(cache=True, fastmath=FAST)
def pv_int8(S, c0, vp, st, s0, s1, acc, vt):
    """acc[g, :] += sum_t S[g, c0 + t - s0] * (vp[t] * its group scales) for t in [s0, s1), G >= 4 query heads per
    kv head. G < 8: `pv4_i8` keeps 4 heads x 32 lanes in registers over the rows and converts each int8 value
    vector once per 4 heads (scale applied to the vector, shared by the 4 heads); G >= 8 (every head), leftover
    heads and a short last group: a widened tile per chunk (`widen_rows`, converted once for all heads). S [G, block], vp [page_size, Dv] int8, st the page tile's
    scales, acc [G, Dv], vt [CHUNK, Dv] float32 scratch."""
    G = acc.shape[0]
    Dv = acc.shape[1]
    full = Dv // GROUP
    NG = -(-Dv // GROUP)
    RC = vt.shape[0]
    if G >= 8 or full == 0:             # from 8 heads on, one widened tile per chunk converts less (measured)
        r = s0
        while r < s1:
            r1 = min(s1, r + RC)
            widen_rows(vp, st, r, r1, vt)
            pv(S, c0 + r - s0, vt, 0, r1 - r, acc)
            r = r1
        return
    g4 = G - G % 4
    if full > 0:
        for g in range(0, g4, 4):
            pv4_i8(S, g, c0, vp, st, NG, s0, s1, acc, full)
    if g4 < G or full < NG:
        r = s0
        while r < s1:
            r1 = min(s1, r + RC)
            widen_rows(vp, st, r, r1, vt)
            for g in range(G):
                w = S[g]
                ag = acc[g]
                d0 = 0 if g >= g4 else full * GROUP
                for t in range(r, r1):
                    w0 = w[c0 + t - s0]
                    row = vt[t - r]
                    for d in range(d0, Dv):
                        ag[d] += w0 * row[d]
            r = r1


@njit(cache=True, fastmath=FAST)
def qk4_int8(qs, kp, st, s0, s1, S, c0, kt):
    """S[g, c0 + t - s0] = qs[g] . (kp[t] * its group scales) for t in [s0, s1), for 4 to 7 query heads per kv
    head: blocks of 4 heads x 4 rows straight from the int8 rows (`dot44_i8`: each row converted and scaled once
    per 4 heads, 16 dot products reduced by one butterfly); leftover rows and heads through a widened tile
    (`widen_rows` + `qk`), a short last group element by element. kt [CHUNK, D] float32 scratch."""
    G = qs.shape[0]
    D = qs.shape[1]
    full = D // GROUP
    NG = -(-D // GROUP)
    g4 = G - G % 4
    t4 = s0 + (s1 - s0) // 4 * 4
    for g in range(0, g4, 4):
        S0 = S[g]
        S1 = S[g + 1]
        S2 = S[g + 2]
        S3 = S[g + 3]
        c = c0
        for t in range(s0, t4, 4):
            r = dot44_i8(qs, g, kp, t, st, NG, full)
            S0[c] = r[0]
            S0[c + 1] = r[1]
            S0[c + 2] = r[2]
            S0[c + 3] = r[3]
            S1[c] = r[4]
            S1[c + 1] = r[5]
            S1[c + 2] = r[6]
            S1[c + 3] = r[7]
            S2[c] = r[8]
            S2[c + 1] = r[9]
            S2[c + 2] = r[10]
            S2[c + 3] = r[11]
            S3[c] = r[12]
            S3[c + 1] = r[13]
            S3[c + 2] = r[14]
            S3[c + 3] = r[15]
            c += 4
    if full < NG:                                        # the short last group of the block rows
        for g in range(g4):
            qg = qs[g]
            for t in range(s0, t4):
                row = kp[t]
                part = qg[0] - qg[0]
                for d in range(full * GROUP, D):
                    part += qg[d] * np.float32(row[d])
                S[g, c0 + t - s0] += part * st[t * NG + full]
    rest_rows = t4 < s1
    if g4 < G or rest_rows:                              # leftover heads (all rows), leftover rows (all heads)
        RC = kt.shape[0]
        r = s0 if g4 < G else t4
        while r < s1:
            r1 = min(s1, r + RC)
            widen_rows(kp, st, r, r1, kt)
            for g in range(G):
                if g < g4 and r1 <= t4:
                    continue
                qg = qs[g]
                for t in range(max(r, t4) if g < g4 else r, r1):
                    row = kt[t - r]
                    a = qg[0] - qg[0]
                    for d in range(D):
                        a += qg[d] * row[d]
                    S[g, c0 + t - s0] = a
            r = r1


@njit(cache=True, fastmath=FAST)
def qk_int8(qs, kp, st, s0, s1, S, c0):
    """S[g, c0 + t - s0] = qs[g] . (kp[t] * its group scales) for t in [s0, s1), straight from the int8 rows
    (`dot4_i8`: 4 rows per pass, the scale applied once per row group; for G < 4 query heads per kv head, where
    widening a tile first would be re-read by too few heads). qs [G, D], kp [page_size, D] int8, st the page
    tile's scales (`scales_f32`), S [G, block]."""
    G = qs.shape[0]
    D = qs.shape[1]
    full = D // GROUP
    NG = -(-D // GROUP)
    for g in range(G):
        qg = qs[g]
        Sg = S[g]
        t = s0
        c = c0
        while t + 4 <= s1:
            r = dot4_i8(qg, kp, t, st, NG, full)
            Sg[c] = r[0]
            Sg[c + 1] = r[1]
            Sg[c + 2] = r[2]
            Sg[c + 3] = r[3]
            t += 4
            c += 4
        while t < s1:
            row = kp[t]
            a = qg[0] - qg[0]
            for k in range(full):
                part = qg[0] - qg[0]
                for d in range(k * GROUP, k * GROUP + GROUP):
                    part += qg[d] * np.float32(row[d])
                a += part * st[t * NG + k]
            Sg[c] = a
            t += 1
            c += 1
        if full < NG:                                    # a short last group
            for t in range(s0, s1):
                row = kp[t]
                part = qg[0] - qg[0]
                for d in range(full * GROUP, D):
                    part += qg[d] * np.float32(row[d])
                Sg[c0 + t - s0] += part * st[t * NG + full]


@njit(cache=True, fastmath=FAST)
def widen_block(pool, scales, pages, h, b0, nb, nbp, dst):
    """dst[j, :width] = the int8 rows of kv head h at absolute positions b0 + j (j < nb) of the sequence with page
    row `pages`, each value times its group's scale (float32); rows nb..nbp-1 zero. The tiled multi-query
    kernel's K/V block (a tile-local scratch: the pool is read directly, never copied dequantized). Each page's
    run of scales is converted to float32 in one vectorised pass (`h2f_all`: one conversion at a time where it
    is used would chain them through a register merge), then whole groups are widened by `widen32`, a short last
    group element by element. pool [num_pages, num_kv_heads, page_size, width] int8, scales [num_pages,
    num_kv_heads, page_size, ceil(width / 32)] uint16 (float16 bits), dst [>= nbp, >= width] float32."""
    P = pool.shape[2]
    W = pool.shape[3]
    NG = scales.shape[3]
    full = W // GROUP
    st = np.empty(min(nb, P) * NG, np.float32)
    t = b0
    j = 0
    while j < nb:
        pg = t // P
        s0 = t - pg * P
        s1 = min(P, s0 + nb - j)
        tile = pool[pages[pg], h]
        h2f_all(scales[pages[pg], h, s0:s1], st)
        for s in range(s0, s1):
            src = tile[s]
            out = dst[j + s - s0]
            k = (s - s0) * NG
            for g in range(full):
                widen32(src, g * GROUP, out, g * GROUP, st[k + g])
            if full < NG:
                sc = st[k + full]
                for d in range(full * GROUP, W):
                    out[d] = np.float32(src[d]) * sc
        j += s1 - s0
        t += s1 - s0
    for jj in range(nb, nbp):
        row = dst[jj]
        for d in range(W):
            row[d] = 0.0
