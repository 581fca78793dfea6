"""The int8 row loader (int8 values + float16 group scales, `kvcache.quant`'s format) over one page tile of one kv
head: int8 rows widened with their group scales into float32 rows (the per-query kernel's widened chunks and
the tiled kernel's K/V blocks, `block_rows_int8`), and the per-query kernel's score and value passes per
query-head group (`score_rows_int8`: `qk_int8` G < 4, `qk4_int8` G 4-7, widened G >= 8; `value_rows_int8`:
`pv_folded` G < 4, `pv_int8` G >= 4; CPUs without AVX-512 widen from smaller groups: `DIRECT_BELOW`,
`WIDEN_FROM`). Shapes in each docstring; `decode.kernels.loaders` dispatches to them. Scales come as the tile's
float32 conversion ``st [page_size * ceil(width / 32)]`` (`loaders.tile_scales`).
"""
import numpy as np
from numba import njit

from .blocks import pv, qk, store4, store44
from .int8_simd import GROUP, dot4_i8, dot44_i8, h2f_all, pv1_i8, pv4_i8, widen32
from .simd import FAST
from .vector_ir import WIDE

# Scores straight from the int8 rows below DIRECT_BELOW heads per kv head, by the int8 4-head blocks from there
# below WIDEN_FROM, else over one widened chunk that every head reads (the float blocks). The int8 blocks keep 32
# lanes a row (4 of AVX2's 16 256-bit registers, 2 of AVX-512's 32), so without AVX-512 they spill: there the
# widened chunk wins from G = 2 (A/B on a Zen 3, one thread: G = 2 0.89-0.97x, G = 4 0.76-0.89x the time; G = 1
# 1.04-1.14x, so kept direct).
DIRECT_BELOW = 4 if WIDE else 2
WIDEN_FROM = 8 if WIDE else 4


@njit(cache=True, fastmath=FAST)
def widen_rows(src, st, r0, r1, dst):
    """dst[t - r0, d] = src[t, d] * st[t * G + d // 32] for t in [r0, r1): int8 rows and their group scales
    (`loaders.tile_scales` of the page tile) -> float32 (exact: 8 x 11 significant bits). src [page_size, D] int8,
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
    scales (`loaders.tile_scales`), acc [G, Dv] float32."""
    Dv = acc.shape[1]
    full, NG = Dv // GROUP, -(-Dv // GROUP)
    for g in range(acc.shape[0]):
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
    kv head. G < `WIDEN_FROM` (8; 4 without AVX-512): `pv4_i8` keeps 4 heads x 32 lanes in registers over the rows
    and converts each int8 value vector once per 4 heads (scale applied to the vector, shared by the 4 heads); from
    there (every head), leftover heads and a short last group: a widened tile per chunk (`widen_rows`, converted
    once for all heads). S [G, block], vp [page_size, Dv] int8, st the page tile's scales, acc [G, Dv], vt [CHUNK,
    Dv] float32 scratch."""
    G = acc.shape[0]
    Dv = acc.shape[1]
    full = Dv // GROUP
    NG = -(-Dv // GROUP)
    RC = vt.shape[0]
    if G >= WIDEN_FROM or full == 0:    # from there, one widened tile per chunk converts less (measured)
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
    (`widen_rows` + `blocks.qk`, the float register blocks), a short last group element by element. kt [CHUNK, D]
    float32 scratch."""
    G = qs.shape[0]
    D = qs.shape[1]
    full = D // GROUP
    NG = -(-D // GROUP)
    g4 = G - G % 4
    t4 = s0 + (s1 - s0) // 4 * 4
    for g in range(0, g4, 4):
        S0, S1, S2, S3 = S[g], S[g + 1], S[g + 2], S[g + 3]
        c = c0
        for t in range(s0, t4, 4):
            store44(S0, S1, S2, S3, c, dot44_i8(qs, g, kp, t, st, NG, full))
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
    RC = kt.shape[0]
    r = s0
    while g4 < G and r < t4:                             # leftover heads, rows s0..t4: widened chunks
        r1 = min(t4, r + RC)
        widen_rows(kp, st, r, r1, kt)
        qk(qs[g4:], kt, 0, r1 - r, S[g4:], c0 + r - s0)
        r = r1
    if t4 < s1:                                          # leftover rows (< 4), every head
        widen_rows(kp, st, t4, s1, kt)
        qk(qs, kt, 0, s1 - t4, S, c0 + t4 - s0)


@njit(cache=True, fastmath=FAST)
def qk_int8(qs, kp, st, s0, s1, S, c0):
    """S[g, c0 + t - s0] = qs[g] . (kp[t] * its group scales) for t in [s0, s1), straight from the int8 rows
    (`dot4_i8`: 4 rows per pass, the scale applied once per row group; for G < 4 query heads per kv head, where
    widening a tile first would be re-read by too few heads). qs [G, D], kp [page_size, D] int8, st the page
    tile's scales (`loaders.tile_scales`), S [G, block]."""
    D = qs.shape[1]
    full, NG = D // GROUP, -(-D // GROUP)
    for g in range(qs.shape[0]):
        qg = qs[g]
        Sg = S[g]
        t = s0
        c = c0
        while t + 4 <= s1:
            store4(Sg, c, dot4_i8(qg, kp, t, st, NG, full), 0)
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
def block_rows_int8(tile, scales, s0, s1, dst, j, st):
    """dst[j + s - s0, :width] = int8 rows s0..s1-1 of a page tile [page_size, width], each value times its group's
    scale (float32; scales [page_size, ceil(width / 32)] uint16 float16 bits, converted in one vectorised pass
    into st, `h2f_all`): the tiled kernel's K/V block rows, read from the pool (no dequantized copy of it)."""
    W = tile.shape[1]
    NG = scales.shape[1]
    full = W // GROUP
    h2f_all(scales[s0:s1], st)
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


@njit(cache=True, fastmath=FAST)
def score_rows_int8(qh, kp, st, r0, r1, Sh, c, kt):
    """Scores of qh [G, D] (float32) against int8 rows r0..r1-1 of kp with the tile's scales st (float32): G <
    `DIRECT_BELOW` straight from the int8 rows (`qk_int8`), then below `WIDEN_FROM` 4 x 4 blocks (`qk4_int8`), else
    a widened chunk (`widen_rows`, kt [>= r1 - r0, D]) reused by every head (`blocks.qk`)."""
    G = qh.shape[0]
    if G < DIRECT_BELOW:
        qk_int8(qh, kp, st, r0, r1, Sh, c)
    elif G < WIDEN_FROM and qh.shape[1] >= GROUP:
        qk4_int8(qh, kp, st, r0, r1, Sh, c, kt)
    else:
        widen_rows(kp, st, r0, r1, kt)
        qk(qh, kt, 0, r1 - r0, Sh, c)


@njit(cache=True, fastmath=FAST)
def value_rows_int8(Sh, c, vp, st, r0, r1, ah, vt):
    """ah[g, :] += sum_t Sh[g, c + t - r0] * (vp[t] * its scales): G < 4 the scale folded into the weight
    (`pv_folded`), else `pv_int8` (vt [>= r1 - r0, Dv] scratch)."""
    if ah.shape[0] < 4:
        pv_folded(Sh, c, vp, st, r0, r1, ah)
    else:
        pv_int8(Sh, c, vp, st, r0, r1, ah, vt)
