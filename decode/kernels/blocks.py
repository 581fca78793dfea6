"""Jitted building blocks over one page tile of one kv head: scores of a query-head group against key rows, the
weighted sum of value rows, the online-softmax update, normalisation and the split-K merge.
Rows are taken as 1-D views and inner loops run over range(n) so that LLVM sees non-negative indices (no
wraparound select) and vectorises them."""
import math

from numba import njit

from .simd import FAST, dot14, dot44, exp, ld, prefetch, pv4


@njit(cache=True, fastmath=FAST)
def qk(qs, kp, s0, s1, S, c0):
    """S[g, c0 + t - s0] = qs[g] . kp[t] for t in [s0, s1).  qs: [G, D] compute dtype, kp: [page_size, D] storage.
    Blocks of 4 query heads x 4 keys (groups >= 4) or 1 x 4 (`dot44` / `dot14`: each key row loaded once per
    block, the 16 or 4 dot products reduced together); leftover keys one at a time; head_dim beyond the last
    multiple of 32 in a final pass."""
    G = qs.shape[0]
    D = qs.shape[1]
    n = D - D % 32
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
    if n < D:
        for g in range(G):
            q0 = qs[g]
            Sg = S[g]
            for t in range(s0, s1):
                k0 = kp[t]
                a0 = z
                for d in range(n, D):
                    a0 += q0[d] * ld(k0[d])
                Sg[c0 + t - s0] += a0


@njit(cache=True, fastmath=FAST)
def pv(S, c0, vp, s0, s1, acc):
    """acc[g, :] += sum_t S[g, c0 + t - s0] * vp[t, :] for t in [s0, s1).
    Groups of 4 query heads: `pv4` keeps 4 heads x 32 accumulator lanes in registers over all the rows of the
    chunk (each value vector loaded once per four heads). Other heads: 8 value rows at a time (one accumulator
    load/store per 8 rows). head_dim_v beyond the last multiple of 32 in a final pass."""
    G = acc.shape[0]
    Dv = acc.shape[1]
    n = Dv - Dv % 32
    g = 0
    if n > 0:
        while g + 4 <= G:
            pv4(S, g, c0, vp, s0, s1, acc, n)
            g += 4
        if n < Dv:
            for h in range(g):
                ah = acc[h]
                w = S[h]
                for t in range(s0, s1):
                    v0 = vp[t]
                    w0 = w[c0 + t - s0]
                    for d in range(n, Dv):
                        ah[d] += w0 * ld(v0[d])
    while g < G:
        ag = acc[g]
        w = S[g]
        t = s0
        c = c0
        while t + 8 <= s1:
            v0 = vp[t]
            v1 = vp[t + 1]
            v2 = vp[t + 2]
            v3 = vp[t + 3]
            v4 = vp[t + 4]
            v5 = vp[t + 5]
            v6 = vp[t + 6]
            v7 = vp[t + 7]
            w0 = w[c]
            w1 = w[c + 1]
            w2 = w[c + 2]
            w3 = w[c + 3]
            w4 = w[c + 4]
            w5 = w[c + 5]
            w6 = w[c + 6]
            w7 = w[c + 7]
            for d in range(Dv):
                ag[d] += ((w0 * ld(v0[d]) + w1 * ld(v1[d])) + (w2 * ld(v2[d]) + w3 * ld(v3[d]))) + \
                         ((w4 * ld(v4[d]) + w5 * ld(v5[d])) + (w6 * ld(v6[d]) + w7 * ld(v7[d])))
            t += 8
            c += 8
        while t < s1:
            v0 = vp[t]
            w0 = w[c]
            for d in range(Dv):
                ag[d] += w0 * ld(v0[d])
            t += 1
            c += 1
        g += 1


@njit(cache=True, fastmath=FAST)
def prefetch_rows(tile, s0, s1):
    """Prefetch rows [s0, s1) of a page tile, one hint per 64-byte line."""
    step = max(1, 64 // tile.itemsize)
    for t in range(s0, s1):
        row = tile[t]
        for d in range(0, row.shape[0], step):
            prefetch(row, d)


@njit(cache=True, fastmath=FAST)
def softmax_block(S, nb, m, l, acc, first):
    """Online-softmax update with the block's scores S[:, :nb]: new running max, rescale (once per block, only
    when the max grew), S <- exp(S - max), running sum += sum(S)."""
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
                alpha = exp(mg - mb)
                for d in range(Dv):
                    ag[d] *= alpha
                lg *= alpha
                mg = mb
        s = z
        for c in range(nb):
            p = exp(Sg[c] - mg)
            Sg[c] = p
            s += p
        m[g] = mg
        l[g] = lg + s


@njit(cache=True, fastmath=FAST)
def prefetch_span(pool, pages, h, p0, p1):
    """Prefetch the rows of kv head h holding absolute positions [p0, p1) of the sequence with page row `pages`."""
    P = pool.shape[2]
    t = p0
    while t < p1:
        j = t // P
        s0 = t - j * P
        s1 = min(P, p1 - j * P)
        prefetch_rows(pool[pages[j], h], s0, s1)
        t += s1 - s0



@njit(cache=True, fastmath=FAST)
def load_group(q, i, h, scale, qs):
    """qs[g, :] = q[i, h*G + g, :] * scale (one rounding)."""
    G = qs.shape[0]
    D = qs.shape[1]
    for g in range(G):
        src = q[i, h * G + g]
        dst = qs[g]
        for d in range(D):
            dst[d] = src[d] * scale


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
def combine(wm, wl, wacc, w0, n, dst):
    """Merge n partial results (max, sum, unnormalised output) stored at w0..w0+n-1 into dst[G, Dv]."""
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
