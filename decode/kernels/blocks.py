"""Jitted building blocks over one page tile of one kv head: scores of a query-head group against key rows (one
block loop for every dot: float32 / float64 q by `simd`'s blocks, q's bfloat16 parts by `bf16_dot`'s), the
weighted sum of value rows, the online-softmax update, the query load and normalisation (the split-K merge is
`units.merge_rows`).
Rows are taken as 1-D views and inner loops run over range(n) so that LLVM sees non-negative indices (no
wraparound select) and vectorises them."""
from numba import njit

from .bf16_dot import dot14_bf, dot44_bf
from .register_blocks import dot14, dot44, pair_dim, pv1, pv4
from .simd import FAST, JIT, exp, lane_max, lane_sum, ld


@njit(cache=True, fastmath=FAST)
def store4(Sg, c, r, k):
    """Sg[c:c+4] = r[k:k+4] (four results of a register block)."""
    Sg[c] = r[k]
    Sg[c + 1] = r[k + 1]
    Sg[c + 2] = r[k + 2]
    Sg[c + 3] = r[k + 3]


@njit(cache=True, fastmath=FAST)
def store44(S0, S1, S2, S3, c, r):
    """S_a[c:c+4] = r[4a:4a+4] for a < 4 (the 16 results of a 4 heads x 4 rows block, head-major; the row views
    are made once by the caller: a view per block costs a reference-count increment and decrement)."""
    store4(S0, c, r, 0)
    store4(S1, c, r, 4)
    store4(S2, c, r, 8)
    store4(S3, c, r, 12)


@njit(cache=True, fastmath=FAST)
def store_some(S, g, heads, c, r, keys):
    """S[g + a, c + b] = r[4a + b] for a < heads, b < keys (a short last block of a register block's results)."""
    for a in range(heads):
        for b in range(keys):
            S[g + a, c + b] = r[4 * a + b]


def dot44_q(q, g, parts, kp, t, n, last):
    """The 4 heads x 4 keys block of `qk` for q as given: parts None, q itself in the accumulation dtype
    (`register_blocks.dot44`); else q as `bf16_dot.split_query` prepared it, its first ``parts`` bfloat16 parts (int16) or its
    float32 halves (`bf16_dot.dot44_bf`). Chosen at compile time by the type of ``parts``."""
    if parts is None:
        return dot44(q, g, kp, t, n, last)
    return dot44_bf(q, g, parts, kp, t, n, last)


def dot14_q(q, g, parts, kp, t, n, last):
    """The 1 head x 4 keys block of `qk` (`register_blocks.dot14` / `bf16_dot.dot14_bf`, as `dot44_q`)."""
    if parts is None:
        return dot14(q, g, kp, t, n, last)
    return dot14_bf(q, g, parts, kp, t, n, last)


if JIT:
    from numba import types
    from numba.extending import overload

    def _plain(parts):
        return parts is None or isinstance(parts, (types.NoneType, types.Omitted))

    @overload(dot44_q, inline="always")
    def _dot44_q_ov(q, g, parts, kp, t, n, last):
        if _plain(parts):
            return lambda q, g, parts, kp, t, n, last: dot44(q, g, kp, t, n, last)
        return lambda q, g, parts, kp, t, n, last: dot44_bf(q, g, parts, kp, t, n, last)

    @overload(dot14_q, inline="always")
    def _dot14_q_ov(q, g, parts, kp, t, n, last):
        if _plain(parts):
            return lambda q, g, parts, kp, t, n, last: dot14(q, g, kp, t, n, last)
        return lambda q, g, parts, kp, t, n, last: dot14_bf(q, g, parts, kp, t, n, last)


@njit(cache=True, fastmath=FAST)
def qk(qs, kp, s0, s1, S, c0, parts=None):
    """S[g, c0 + t - s0] = qs[g] . kp[t] for t in [s0, s1), over the first D = kp.shape[1] elements of each row.
    kp: [page_size, D] storage rows (any format `ld` widens). qs: parts None, [G, D] in the accumulation dtype
    (float32, or float64 for precision="highest": K widened exactly, every product exact, each score rounded once
    into S); for bfloat16 pages q as `bf16_dot.split_query` prepared it (parts > 0: [G, 3 * Dp] int16 bfloat16
    parts, vdpbf16ps; parts 1 with float32 [G, Dp]: its (even, odd) halves). One block loop for every dot: blocks
    of 4 query heads x 4 keys (groups >= 4) or 1 x 4 (`dot44_q` / `dot14_q`: each key row loaded once per block,
    the 16 or 4 dot products reduced together); a short last block repeats the last row, so every score is
    summed the same way."""
    G = qs.shape[0]
    D = kp.shape[1]
    g = 0
    while g + 4 <= G:
        S0, S1, S2, S3 = S[g], S[g + 1], S[g + 2], S[g + 3]
        t = s0
        c = c0
        while t + 4 <= s1:
            store44(S0, S1, S2, S3, c, dot44_q(qs, g, parts, kp, t, D, s1 - 1))
            t += 4
            c += 4
        if t < s1:
            store_some(S, g, 4, c, dot44_q(qs, g, parts, kp, t, D, s1 - 1), s1 - t)
        g += 4
    while g < G:
        Sg = S[g]
        t = s0
        c = c0
        while t + 4 <= s1:
            store4(Sg, c, dot14_q(qs, g, parts, kp, t, D, s1 - 1), 0)
            t += 4
            c += 4
        if t < s1:
            store_some(S, g, 1, c, dot14_q(qs, g, parts, kp, t, D, s1 - 1), s1 - t)
        g += 1


@njit(cache=True, fastmath=FAST)
def pv(S, c0, vp, s0, s1, acc):
    """acc[g, :] += sum_t S[g, c0 + t - s0] * vp[t, :] for t in [s0, s1).
    Groups of 4 query heads: `pv4` keeps 4 heads x 32 accumulator lanes in registers over all the rows of the
    chunk (each value vector loaded once per four heads); other heads `pv1` (one head, 32 lanes in registers).
    head_dim_v beyond the last multiple of 32 in a final pass. bfloat16 values into float32: acc's lanes below
    that multiple are in the pair order (`register_blocks.in_pairs`)."""
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
def softmax_block(S, nb, m, l, acc, first, scale):
    """Online-softmax update with the block's unscaled scores S[:, :nb] (q.k): new running max (unscaled), rescale
    (once per block, only when the max grew), S <- exp((S - max) * scale), running sum += sum(S). The difference
    is taken before the scale multiplies it, so near-maximal scores keep their exact gap."""
    G = S.shape[0]
    Dv = acc.shape[1]
    for g in range(G):
        Sg = S[g]
        mb = lane_max(Sg, nb)
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
        for c in range(nb):
            Sg[c] = exp((Sg[c] - mg) * scale)
        m[g] = mg
        l[g] = lg + lane_sum(Sg, nb)


@njit(cache=True)
def unit_range(units, u, query_pos, window):
    """Work unit ``u`` as (query, lo, hi, workspace slot): row ``u`` of a plan's ``units [U, 4]``
    (`units.plan_units`), or, with no plan (``units`` empty: the serial kernels), query ``u`` over its whole
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
def normalise(acc, l, dst, pairs):
    """dst[g, :] = acc[g, :] / l[g]  (l >= 1: the maximum contributes exp(0)); pairs: acc's first lanes (whole
    strips of 32) are in the pair order (`register_blocks.in_pairs`), written to dst by dim."""
    G = acc.shape[0]
    Dv = acc.shape[1]
    n = Dv - Dv % 32 if pairs else 0
    for g in range(G):
        inv = 1.0 / l[g]
        ag = acc[g]
        og = dst[g]
        for k in range(n):
            og[pair_dim(k)] = ag[k] * inv
        for d in range(n, Dv):
            og[d] = ag[d] * inv


