"""Jitted building blocks over one page tile of one kv head: scores of a query-head group against key rows, the
weighted sum of value rows, the online-softmax update, the scaled query load, normalisation and the split-K merge.
Rows are taken as 1-D views and inner loops run over range(n) so that LLVM sees non-negative indices (no
wraparound select) and vectorises them."""
import math

import numpy as np
from numba import njit

from .simd import FAST, dot14, dot44, exp, ld, prefetch_lines, pv1, pv4


@njit(cache=True, fastmath=FAST)
def qk(qs, kp, s0, s1, S, c0):
    """S[g, c0 + t - s0] = qs[g] . kp[t] for t in [s0, s1).  qs: [G, D], kp: [page_size, D] storage.
    Blocks of 4 query heads x 4 keys (groups >= 4) or 1 x 4 (`dot44` / `dot14`: each key row loaded once per
    block, the 16 or 4 dot products reduced together), leftover keys one at a time, accumulated in qs's dtype.
    float64 qs (the decode kernel, every storage dtype): all of head_dim in float64, every product exact (K
    widened exactly), each score its exact value rounded once into S (up to ~head_dim * 2**-53 relative): the
    float32-score floor. float32 qs (the int8 kernel's widened tiles): the first D - D % 32 elements in float32,
    the rest (all of head_dim < 32) in a final float64 pass."""
    G = qs.shape[0]
    D = qs.shape[1]
    n = D if qs.itemsize == 8 else D - D % 32
    z = qs[0, 0] - qs[0, 0]
    g = 0
    while g + 4 <= G:
        S0 = S[g]
        S1 = S[g + 1]
        S2 = S[g + 2]
        S3 = S[g + 3]
        t = s0
        c = c0
        while t + 4 <= s1:
            r = dot44(qs, g, kp, t, n)
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
            t += 4
            c += 4
        while t < s1:
            k0 = kp[t]
            q0 = qs[g]
            q1 = qs[g + 1]
            q2 = qs[g + 2]
            q3 = qs[g + 3]
            a0 = z
            a1 = z
            a2 = z
            a3 = z
            for d in range(n):
                y = ld(k0[d])
                a0 += q0[d] * y
                a1 += q1[d] * y
                a2 += q2[d] * y
                a3 += q3[d] * y
            S0[c] = a0
            S1[c] = a1
            S2[c] = a2
            S3[c] = a3
            t += 1
            c += 1
        g += 4
    while g < G:
        Sg = S[g]
        q0 = qs[g]
        t = s0
        c = c0
        while t + 4 <= s1:
            r = dot14(qs, g, kp, t, n)
            Sg[c] = r[0]
            Sg[c + 1] = r[1]
            Sg[c + 2] = r[2]
            Sg[c + 3] = r[3]
            t += 4
            c += 4
        while t < s1:
            k0 = kp[t]
            a0 = z
            for d in range(n):
                a0 += q0[d] * ld(k0[d])
            Sg[c] = a0
            t += 1
            c += 1
        g += 1
    if n < D:                      # the tail (all of head_dim < 32) in float64: exact products, one rounding
        for g in range(G):
            q0 = qs[g]
            Sg = S[g]
            for t in range(s0, s1):
                k0 = kp[t]
                a0 = 0.0
                for d in range(n, D):
                    a0 += np.float64(q0[d]) * np.float64(ld(k0[d]))
                Sg[c0 + t - s0] += a0


@njit(cache=True, fastmath=FAST)
def pv(S, c0, vp, s0, s1, acc):
    """acc[g, :] += sum_t S[g, c0 + t - s0] * vp[t, :] for t in [s0, s1).
    Groups of 4 query heads: `pv4` keeps 4 heads x 32 accumulator lanes in registers over all the rows of the
    chunk (each value vector loaded once per four heads); other heads `pv1` (one head, 32 lanes in registers).
    head_dim_v beyond the last multiple of 32 in a final pass."""
    G = acc.shape[0]
    Dv = acc.shape[1]
    n = Dv - Dv % 32
    if n > 0:
        g = 0
        while g + 4 <= G:
            pv4(S, g, c0, vp, s0, s1, acc, n)
            g += 4
        while g < G:
            pv1(S, g, c0, vp, s0, s1, acc, n)
            g += 1
    if n < Dv:
        for g in range(G):
            ag = acc[g]
            w = S[g]
            for t in range(s0, s1):
                v0 = vp[t]
                w0 = w[c0 + t - s0]
                for d in range(n, Dv):
                    ag[d] += w0 * ld(v0[d])


@njit(cache=True, fastmath=FAST)
def prefetch_rows(tile, s0, s1):
    """Prefetch rows [s0, s1) of a page tile [page_size, head_dim], one hint per 64-byte line."""
    prefetch_lines(tile, s0, s1)


@njit(cache=True, fastmath=FAST)
def softmax_block(S, nb, m, l, acc, first, scale):
    """Online-softmax update with the block's unscaled scores S[:, :nb] (q.k): new running max (unscaled), rescale
    (once per block, only when the max grew), S <- exp((S - max) * scale), running sum += sum(S). The difference
    is taken before the scale multiplies it, so near-maximal scores keep their exact gap."""
    G = S.shape[0]
    Dv = acc.shape[1]
    for g in range(G):
        Sg = S[g]
        mb = Sg[0]
        for c in range(1, nb):
            mb = max(mb, Sg[c])
        ag = acc[g]
        z = mb - mb
        if first:
            mg = mb
            lg = z
            for d in range(Dv):
                ag[d] = z
        else:
            mg = m[g]
            lg = l[g]
            if mb > mg:
                alpha = exp((mg - mb) * scale)
                for d in range(Dv):
                    ag[d] *= alpha
                lg *= alpha
                mg = mb
        s = z
        for c in range(nb):
            p = exp((Sg[c] - mg) * scale)
            Sg[c] = p
            s += p
        m[g] = mg
        l[g] = lg + s


@njit(cache=True, fastmath=FAST)
def load_group(q, i, h, scale, qs):
    """qs[g, :] = q[i, h*G + g, :] * scale (one rounding; the int8 kernel's pre-scaled query)."""
    G = qs.shape[0]
    D = qs.shape[1]
    for g in range(G):
        src = q[i, h * G + g]
        dst = qs[g]
        for d in range(D):
            dst[d] = src[d] * scale


@njit(cache=True)
def unit_range(units, u, query_pos, window):
    """Work unit ``u`` as (query, lo, hi, workspace slot): row ``u`` of a plan's ``units [U, 4]``
    (`decode.plan_units`), or, with no plan (``units`` empty: the serial kernels), query ``u`` over its whole
    visible range ``lo..p`` (lo = 0, or p - window + 1 with a window) with slot -1 (normalise into out)."""
    if units.shape[0] == 0:
        hi = query_pos[u] + 1
        return u, (max(0, hi - window) if window > 0 else 0), hi, -1
    return units[u, 0], units[u, 1], units[u, 2], units[u, 3]


@njit(cache=True, fastmath=FAST)
def load_heads(qi, qs):
    """qs[h, g, :] = qi[h*G + g, :].  qi: [num_q_heads, head_dim], qs: [num_kv_heads, G, head_dim] (the scale is
    applied to score differences in `softmax_block`, not to q: no rounding of q)."""
    H = qs.shape[0]
    G = qs.shape[1]
    D = qs.shape[2]
    for h in range(H):
        for g in range(G):
            src = qi[h * G + g]
            dst = qs[h, g]
            for d in range(D):
                dst[d] = src[d]


@njit(cache=True, fastmath=FAST)
def normalise(acc, l, dst):
    """dst[g, :] = acc[g, :] / l[g]  (l >= 1: the maximum contributes exp(0))."""
    G = acc.shape[0]
    Dv = acc.shape[1]
    for g in range(G):
        inv = 1.0 / l[g]
        ag = acc[g]
        og = dst[g]
        for d in range(Dv):
            og[d] = ag[d] * inv


@njit(cache=True, fastmath=FAST)
def combine_heads(wm, wl, wacc, w0, n, dst, scale):
    """Merge n partial results (unscaled max, sum, unnormalised output) stored at slots w0..w0+n-1 into dst.
    wm, wl: [slots, num_kv_heads, G], wacc: [slots, num_kv_heads, G, head_dim_v], dst: [num_q_heads, head_dim_v]
    (query head h*G + g)."""
    H = wm.shape[1]
    G = wm.shape[2]
    Dv = dst.shape[1]
    for h in range(H):
        for g in range(G):
            mx = wm[w0, h, g]
            for s in range(1, n):
                mx = max(mx, wm[w0 + s, h, g])
            og = dst[h * G + g]
            tot = 0.0
            for d in range(Dv):
                og[d] = 0.0
            for s in range(n):
                f = math.exp((np.float64(wm[w0 + s, h, g]) - mx) * scale)  # float64: cheap, keep it exact
                tot += f * wl[w0 + s, h, g]
                src = wacc[w0 + s, h, g]
                for d in range(Dv):
                    og[d] += f * src[d]
            inv = 1.0 / tot
            for d in range(Dv):
                og[d] *= inv


@njit(cache=True, fastmath=FAST)
def combine(wm, wl, wacc, w0, n, dst):
    """Merge n partial results (max of pre-scaled scores, sum, unnormalised output) stored at w0..w0+n-1 into
    dst[G, Dv] (the int8 kernel's layout: wm, wl [slots, G], wacc [slots, G, Dv])."""
    G = dst.shape[0]
    Dv = dst.shape[1]
    for g in range(G):
        mx = wm[w0, g]
        for s in range(1, n):
            mx = max(mx, wm[w0 + s, g])
        og = dst[g]
        tot = 0.0
        for d in range(Dv):
            og[d] = 0.0
        for s in range(n):
            f = math.exp(wm[w0 + s, g] - mx)  # float64: the merge is cheap, keep it exact
            tot += f * wl[w0 + s, g]
            src = wacc[w0 + s, g]
            for d in range(Dv):
                og[d] += f * src[d]
        inv = 1.0 / tot
        for d in range(Dv):
            og[d] *= inv
