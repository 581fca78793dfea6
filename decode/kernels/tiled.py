"""The tiled multi-query kernel (extend, prefill, speculative verification): runs of consecutive queries of one
sequence attend over its pages with every K/V block loaded once per tile of rows.

A *run* is T >= 1 queries i0..i0+T-1 of one sequence at consecutive positions p0..p0+T-1 (query i0+t reads keys
lo(t)..p0+t, lo = 0 or max(0, p0+t-window+1)). A *tile* is up to `tokens` consecutive queries of a run with the G
query heads of one kv head h: rows r = t*G + g (token-major). Per tile, keys are taken `block` at a time:

    Kb [nb, D] <- the block's K rows (widened by the format's loader, `loaders.block_rows`), ST [nb, R] = Kb @ QT
    (QT [D, R]: the tile's queries, transposed once per tile; accumulated in float32 in chunks of 32 steps of
    head_dim (`gemm.KCHUNK`), or in float64 for precision="highest": every product exact, each score rounded once
    into ST; the scale is applied to the dot products, and the block's column maxima taken, in the GEMM's
    epilogue), the online softmax runs down ST's columns (one per row: exp and sum vectorise over rows),
    O [R, Dv] = alpha * O + P @ Vb with P read as ST transposed (alpha applied as the GEMM loads O).

Both products go through `gemm.gemm_strip` (6- then 4-row x up to 64-column register blocks; the column
strip outermost, so QT's / Vb's strip stays in L1 while the other operand streams), and the next block's K / V
rows are prefetched while the current one is computed. Only blocks that cross the causal diagonal
(or the window's lower edge) are masked; masked entries get weight exactly 0. A unit of work is (run, kv head,
tile, key range [ka, kb)); a unit whose range is a part of the tile's keys (split: fewer units than threads)
stores its partial (max, sum, unnormalised O) in a workspace slot and the parts are merged afterwards.

Layout as in `decode.kernels` (q / out [num_queries, num_q_heads, head_dim(_v)], pages head-major, CSR page
table). runs: int64 [num_runs, 4] = (sequence, first query, count, first position).
units: int64 [num_units, 7] = (run, kv head, first token of the tile in the run, tokens, ka, kb, slot or -1).
items: int64 [num_split, 5] = (run, kv head, first token, tokens, first slot) of split tiles; each tile's parts
occupy consecutive slots in key order, their number in `item_parts`.
"""
import numpy as np
from numba import njit, prange

from .amx_blocks import amx_block, amx_values, pack_parts, value_scratch
from .amx_tiles import HOST as AMX_CODE, tile_config
from .gemm import COLMAX, FRESH, MR, RESCALE, SCALE, gemm_strip, transpose16
from .loaders import block_rows
from .pair_scores import page_piece, pair_scratch, score_strip, tile_pairs
from .simd import EXP_FLAGS, FAST, JIT, exp_inline, prefetch_lines, zeros64
from .tile_softmax import block_max, weight_parts
from .units import merge_rows

NEG = -3.0e38         # "no key yet" running max: finite (fastmath), below every admissible score


@njit(cache=True, fastmath=FAST)
def _load_tile(q, i0, nt, h, G, QT, Rp):
    """QT[d, t*G + g] = q[i0 + t, h*G + g, d]; rows R..Rp-1 zero. In column blocks of 16 rows r (one 64-byte line
    of every QT row, so that the stores stay in L1) from precomputed source offsets (no division in the inner
    loop): the row-by-row transposition took 23-40 us for a 128 x 128 tile, this one ~10."""
    D = q.shape[2]
    Hq = q.shape[1]
    R = nt * G
    qf = q.reshape(-1)
    off = np.empty(16, np.int64)
    for r0 in range(0, R, 16):
        n = min(R, r0 + 16) - r0
        for k in range(n):
            t = (r0 + k) // G
            off[k] = ((i0 + t) * Hq + h * G + r0 + k - t * G) * D
        d16 = D - D % 16 if n == 16 else 0
        for d0 in range(0, d16, 16):        # whole 16 x 16 blocks in registers
            transpose16(qf, off, d0, QT, r0)
        for d in range(d16, D):
            row = QT[d]
            for k in range(n):
                row[r0 + k] = qf[off[k] + d]
    for d in range(D):
        row = QT[d]
        for r in range(R, Rp):
            row[r] = 0.0


@njit(cache=True, fastmath=FAST)
def _copy_block(pool, scales, pages, h, b0, nb, dst, st):
    """dst[j, :width] = the rows of kv head h at absolute positions b0 + j (j < nb) of the sequence with page row
    `pages`, widened by the format's loader (`loaders.block_rows`; int8 pools with their scales, st its float32
    scratch); rows nb..(nb rounded up to MR)-1 set to zero. A tile-local scratch: the pool is read directly."""
    P = pool.shape[2]
    W = pool.shape[3]
    t = b0
    j = 0
    while j < nb:
        pg = t // P
        s0 = t - pg * P
        s1 = min(P, s0 + nb - j)
        block_rows(pool[pages[pg], h], scales, pages[pg], h, s0, s1, dst, j, st)
        j += s1 - s0
        t += s1 - s0
    for jj in range(nb, -(-nb // MR) * MR):
        row = dst[jj]
        for d in range(W):
            row[d] = 0.0


@njit(cache=True, fastmath=FAST)
def _prefetch_block(pool, pages, h, b0, nb):
    """Hint the rows of kv head h at absolute positions b0..b0+nb-1 into the caches (the next block's K or V:
    fetched while the current block is computed, so that `_copy_block` reads them from L2, not from memory)."""
    P = pool.shape[2]
    t = b0
    while t < b0 + nb:
        pg = t // P
        s0 = t - pg * P
        s1 = min(P, s0 + b0 + nb - t)
        prefetch_lines(pool[pages[pg], h], s0, s1)
        t += s1 - s0


def _scores_copied(k_pages, k_scales, pages, h, b0, nb, Kb, st, QT, ST, Rp, LK, flags, sc, mx):
    """ST[:nb] = K rows b0..b0+nb-1 of kv head h @ QT[:, :Rp], through the widened copy Kb (rows up to nb rounded
    up to MR: zero)."""
    D = QT.shape[0]
    nbp = -(-nb // MR) * MR
    _copy_block(k_pages, k_scales, pages, h, b0, nb, Kb, st)
    c = 0
    while c < Rp:            # a column strip of QT stays in L1 while the key rows stream past it
        nv = min(4, (Rp - c) // LK)
        gemm_strip(Kb, D, 1, 0, nbp, QT, c, ST, D, nv, flags, mx, sc, mx, nb)
        c += nv * LK


def _scores_direct(k_pages, k_scales, pages, h, b0, nb, Kb, st, QT, ST, Rp, LK, flags, sc, mx):
    """`_scores_copied` with the score GEMM reading the pool's rows in place, page by page: pages already in the
    accumulation dtype (float32 pages, float32 q.k; QT [D, .]), or bfloat16 pages with QT the tile's q pairs
    (`pair_block`). No copy: a page's piece is rounded up to MR rows inside the page (rows past the piece: scores
    never read; the next piece overwrites them), or, where that would leave the page, copied into Kb
    (`_copy_piece`). Every score is the same chain as through the copy (bitwise the same)."""
    P = k_pages.shape[2]
    c = 0
    while c < Rp:
        nv = min(4, (Rp - c) // LK)
        j = 0
        while j < nb:
            row, s0, n = page_piece(pages, P, b0 + j, nb - j)
            n4 = -(-n // MR) * MR
            if s0 + n4 <= P:
                score_strip(k_pages[row, h, s0:], QT, c, ST[j:], n4, nv, flags, sc, mx, n)
            else:
                _copy_piece(k_pages, k_scales, pages, h, b0 + j, n, Kb, st)
                score_strip(Kb, QT, c, ST[j:], n4, nv, flags, sc, mx, n)
            j += n
        c += nv * LK


def _copy_piece(k_pages, k_scales, pages, h, t, n, dst, st):
    """dst[:n] = the rows of kv head h at positions t.. (one page's piece), rows n..(n rounded up to MR)-1 zero:
    as stored for an int16 dst (bfloat16 bits, the pair path's: `_copy_bits`), else widened (`_copy_block`)."""
    if dst.dtype == np.int16:
        _copy_bits(k_pages, pages, h, t, n, dst)
    else:
        _copy_block(k_pages, k_scales, pages, h, t, n, dst, st)


def _copy_bits(k_pages, pages, h, t, n, dst):
    row, s0, _ = page_piece(pages, k_pages.shape[2], t, n)
    dst[:n] = k_pages[row, h, s0:s0 + n]
    dst[n:-(-n // MR) * MR] = 0


def pair_block(k_pages, k_scales, pages, h, b0, nb, Kp, st, QP, ST, Rp, LK, flags, sc, mx):
    """ST[:nb, :Rp] = the block's K rows (bfloat16 pages, in place) . the tile's q pairs QP (`pair_scores`): the
    in-place walk over pairs (nothing for other pages: the pairs never apply there)."""
    _scores_direct(k_pages, k_scales, pages, h, b0, nb, Kp, st, QP, ST, Rp, LK, flags, sc, mx)


def _values_copied(v_pages, v_scales, pages, h, b0, nb, Vb, st, ST, Rp, O, L, flags, alpha):
    """O[:Rp] += ST[:nb, :Rp]^T @ V rows b0..b0+nb-1 of kv head h, through the widened copy Vb."""
    Dvp = Vb.shape[1]
    _copy_block(v_pages, v_scales, pages, h, b0, nb, Vb, st)
    st_cols = ST.shape[1]
    c = 0
    while c < Dvp:           # a column strip of Vb stays in L1 while the rows of P stream past it
        nv = min(4, (Dvp - c) // L)
        gemm_strip(ST, 1, st_cols, 0, Rp, Vb, c, O, nb, nv, flags, alpha, 1.0, alpha, 0)
        c += nv * L


def _values_direct(v_pages, v_scales, pages, h, b0, nb, Vb, st, ST, Rp, O, L, flags, alpha):
    """`_values_copied` with the PV GEMM reading the pool's rows in place, page by page (pages in the compute
    dtype; head_dim_v a multiple of the lanes): no copy. Each output element is the
    same FMA chain over the keys in order (bitwise the same as through the copy)."""
    Dv = v_pages.shape[3]
    P = v_pages.shape[2]
    st_cols = ST.shape[1]
    for c in range(0, Dv, 4 * L):     # Dv a multiple of L: the strips of `_values_copied`
        nv = min(4, (Dv - c) // L)
        j = 0
        while j < nb:
            row, s0, n = page_piece(pages, P, b0 + j, nb - j)
            gemm_strip(ST[j:], 1, st_cols, 0, Rp, v_pages[row, h, s0:], c, O, n, nv, flags if j == 0 else 0,
                       alpha, 1.0, alpha, 0)
            j += n


def score_block(k_pages, k_scales, pages, h, b0, nb, Kb, st, QT, ST, Rp, LK, flags, sc, mx):
    """ST[:nb, :Rp] = the block's K rows @ QT: in place for pages in the accumulation dtype, else through Kb."""
    if k_scales is None and k_pages.dtype == QT.dtype:
        _scores_direct(k_pages, k_scales, pages, h, b0, nb, Kb, st, QT, ST, Rp, LK, flags, sc, mx)
    else:
        _scores_copied(k_pages, k_scales, pages, h, b0, nb, Kb, st, QT, ST, Rp, LK, flags, sc, mx)


def value_block(v_pages, v_scales, pages, h, b0, nb, Vb, st, ST, Rp, O, L, flags, alpha):
    """O[:Rp] += ST[:nb, :Rp]^T @ the block's V rows: in place for pages in the compute dtype (head_dim_v a
    multiple of the lanes), else through Vb. float16 / bfloat16 pages are widened into Vb once per block: read in
    place they were widened once per 6-row block of the GEMM (Rp / 6 times), 8 more vector ops per 24 FMAs; the
    copy measured 0.93-0.97x the time at 0->512, 0->2048 and 4096+128 (GQA4 d128, one thread, CPU time under load,
    benchmarks.ab_trees)."""
    if v_scales is None and v_pages.shape[3] % L == 0 and v_pages.dtype == O.dtype:
        _values_direct(v_pages, v_scales, pages, h, b0, nb, Vb, st, ST, Rp, O, L, flags, alpha)
    else:
        _values_copied(v_pages, v_scales, pages, h, b0, nb, Vb, st, ST, Rp, O, L, flags, alpha)


if JIT:
    from numba import types
    from numba.extending import overload

    _scores_copied, _scores_direct, _values_copied, _values_direct = (
        njit(cache=True, fastmath=FAST)(f) for f in (_scores_copied, _scores_direct, _values_copied, _values_direct))

    _copy_bits = njit(cache=True)(_copy_bits)

    @overload(_copy_piece, inline="always")
    def _copy_piece_ov(k_pages, k_scales, pages, h, t, n, dst, st):
        if dst.dtype == types.int16:
            return lambda k_pages, k_scales, pages, h, t, n, dst, st: _copy_bits(k_pages, pages, h, t, n, dst)
        return lambda k_pages, k_scales, pages, h, t, n, dst, st: _copy_block(k_pages, k_scales, pages, h, t, n, dst,
                                                                               st)

    @overload(pair_block, inline="always")
    def _pair_block_ov(k_pages, k_scales, pages, h, b0, nb, Kp, st, QP, ST, Rp, LK, flags, sc, mx):
        if k_pages.dtype == types.int16 and ST.dtype == types.float32:
            return lambda k_pages, k_scales, pages, h, b0, nb, Kp, st, QP, ST, Rp, LK, flags, sc, mx: _scores_direct(
                k_pages, k_scales, pages, h, b0, nb, Kp, st, QP, ST, Rp, LK, flags, sc, mx)
        return lambda k_pages, k_scales, pages, h, b0, nb, Kp, st, QP, ST, Rp, LK, flags, sc, mx: None

    def _none(x):
        return x is None or isinstance(x, (types.NoneType, types.Omitted))

    @overload(score_block, inline="always")
    def _score_block_ov(k_pages, k_scales, pages, h, b0, nb, Kb, st, QT, ST, Rp, LK, flags, sc, mx):
        if _none(k_scales) and k_pages.dtype == QT.dtype:
            return lambda k_pages, k_scales, pages, h, b0, nb, Kb, st, QT, ST, Rp, LK, flags, sc, mx: _scores_direct(
                k_pages, k_scales, pages, h, b0, nb, Kb, st, QT, ST, Rp, LK, flags, sc, mx)
        return lambda k_pages, k_scales, pages, h, b0, nb, Kb, st, QT, ST, Rp, LK, flags, sc, mx: _scores_copied(
            k_pages, k_scales, pages, h, b0, nb, Kb, st, QT, ST, Rp, LK, flags, sc, mx)

    @overload(value_block, inline="always")
    def _value_block_ov(v_pages, v_scales, pages, h, b0, nb, Vb, st, ST, Rp, O, L, flags, alpha):
        if _none(v_scales) and v_pages.dtype == O.dtype:
            def impl(v_pages, v_scales, pages, h, b0, nb, Vb, st, ST, Rp, O, L, flags, alpha):
                if v_pages.shape[3] % L == 0:
                    _values_direct(v_pages, v_scales, pages, h, b0, nb, Vb, st, ST, Rp, O, L, flags, alpha)
                else:
                    _values_copied(v_pages, v_scales, pages, h, b0, nb, Vb, st, ST, Rp, O, L, flags, alpha)
            return impl
        return lambda v_pages, v_scales, pages, h, b0, nb, Vb, st, ST, Rp, O, L, flags, alpha: _values_copied(
            v_pages, v_scales, pages, h, b0, nb, Vb, st, ST, Rp, O, L, flags, alpha)


@njit(cache=True, fastmath=EXP_FLAGS, inline="always")
def _new_max(Rp, m, l, alpha):
    """alpha[r] (the rows' new running max on entry) -> exp(old max - new max); m <- the new max, l scaled."""
    for r in range(Rp):
        mn = alpha[r]
        a = exp_inline(m[r] - mn)
        m[r] = mn
        l[r] *= a
        alpha[r] = a


@njit(cache=True, fastmath=EXP_FLAGS, inline="always")
def _masked_max(ST, nb, Rp, b0, rpos, rlo, m, alpha, jlo, jhi, neg, sc):
    """A masked block's row maxima: jlo[r] / jhi[r] = the block keys row r sees (jlo[r]..jhi[r]), alpha[r] =
    max(m[r], sc * ST[j, r] over those j) (sc 1 where ST holds scaled scores already)."""
    for r in range(Rp):
        alpha[r] = m[r]
        jlo[r] = max(-1, min(nb, rlo[r] - b0))
        jhi[r] = max(-1, min(nb, rpos[r] - b0))
    for j in range(nb):
        row = ST[j]
        for r in range(Rp):
            x = row[r] * sc
            x = x if (j >= jlo[r]) & (j <= jhi[r]) else neg
            a = alpha[r]
            alpha[r] = x if x > a else a


@njit(cache=True, fastmath=EXP_FLAGS)
def _softmax_block(ST, nb, Rp, b0, masked, rpos, rlo, m, l, alpha, jlo, jhi, neg):
    """Online softmax over the block's scores ST[:nb, :Rp] (column r = row r of the tile, key b0 + j; already
    scaled by the score GEMM, and unless ``masked`` alpha[r] already holds max(m[r], the block's column max)):
    new running max m, alpha = exp(old max - new max), l = alpha * l + sum of weights, ST <- weights (exactly 0
    where masked). Every loop runs down the rows r (contiguous, no reduction across lanes) so that it
    vectorises: selects, not max() or branches, and the exp inlined. jlo / jhi: int32 scratch [>= Rp] (row r
    sees block keys jlo[r]..jhi[r]); neg: NEG in the compute dtype."""
    z = neg - neg
    if masked:
        _masked_max(ST, nb, Rp, b0, rpos, rlo, m, alpha, jlo, jhi, neg, neg / neg)   # scaled already: sc 1
    _new_max(Rp, m, l, alpha)
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
def attend_tile(q, k_pages, v_pages, k_scales, v_scales, pages, h, G, i0, pos0, nt, ka, kb, window, sc, block,
                QT, Kb, Vb, ST, O, m, l, alpha, rpos, rlo, jlo, jhi, neg, st, dot, QP, Kp, cfg, pv):
    """Unnormalised attention of one tile (queries i0..i0+nt-1 at positions pos0.., kv head h) over the keys in
    [ka, kb) of the sequence with page row `pages` (sc: the score scale in the compute dtype). Leaves m[R], l[R],
    O[R, :Dv] (R = nt * G; rows padded to the vector width are zero queries). Scratch: QT [D, >=Rp] and Kb [>=block+3, D]
    (the score GEMM's accumulation dtype: float32, float64 for precision="highest"), Vb [>=block+3, Dvp] (columns
    Dv..Dvp-1 zero), ST [>=block+3, >=Rp], O [>=Rp, Dvp], m / l / alpha / rpos / rlo / jlo / jhi [>=Rp]; neg: NEG in the compute dtype.
    k_scales / v_scales: the int8 pools' scales, None for float pools; st: the loader's float32 scratch. dot != 0:
    scores over bfloat16 pairs where the pages are bfloat16 and the tile's q exactly bfloat16 (`pair_scores`; QP /
    Kp its scratch, `pair_scratch`); dot 2: both GEMMs on AMX tiles for bfloat16 pages, any float32 q (`amx_blocks`;
    where PV runs on them, the softmax step scales the scores, takes the block max and writes P's parts:
    `tile_softmax.block_max` / `weight_parts`;
    QP / Kp sized for it, cfg the tile configuration, pv the PV block's buffers, `value_scratch`; ST and
    O then have whole tiles of 32 columns / rows, on 64-byte rows)."""
    Dvp = Vb.shape[1]
    L = 8 if O.itemsize == 8 else 16
    LK = 8 if QT.itemsize == 8 else 16    # lanes of the score GEMM (its accumulation dtype: QT's)
    R = nt * G
    Rp = -(-R // L) * L
    _load_tile(q, i0, nt, h, G, QT, Rp)
    # the tiles (`amx_blocks`: QP sized for them); AMX_CODE is a compile-time False on a CPU without AMX, and numba
    # prunes every branch of theirs (docs/kernel.md, "Compile cache": ~11% of a signature's compile time on Zen 3)
    amx = AMX_CODE and dot == 2 and QP.shape[0] == 3 * (QT.shape[0] // 2) > 0
    parts = pack_parts(QT, R, Rp, QP) if amx else 0
    pairs = not amx and dot != 0 and tile_pairs(QT, R, Rp, QP)
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
        nxt = min(hi, b1 + block) - b1
        _prefetch_block(k_pages, pages, h, b1, nxt)
        masked = (b1 - 1 > rpos[0]) | (b0 < rlo[R - 1])
        if not masked:           # the score GEMM folds the block's column maxima into alpha (from m)
            for r in range(Rp):
                alpha[r] = m[r]
        flags = FRESH | SCALE | (0 if masked else COLMAX)
        pv_tiles = amx and pv[0].shape[0] > 0      # PV on the tiles: the weights go straight into P's parts
        if pv_tiles:                                # (the scale and the block max taken by the softmax step)
            amx_block(k_pages, pages, h, b0, nb, Kp, QP, parts, ST, Rp, FRESH, sc, alpha, cfg)
        elif amx:
            amx_block(k_pages, pages, h, b0, nb, Kp, QP, parts, ST, Rp, flags, sc, alpha, cfg)
        elif pairs:
            pair_block(k_pages, k_scales, pages, h, b0, nb, Kp, st, QP, ST, Rp, LK, flags, sc, alpha)
        else:
            score_block(k_pages, k_scales, pages, h, b0, nb, Kb, st, QT, ST, Rp, LK, flags, sc, alpha)
        if pv_tiles:
            if masked:
                _masked_max(ST, nb, Rp, b0, rpos, rlo, m, alpha, jlo, jhi, neg, sc)
            else:
                block_max(ST, sc, nb, Rp, alpha)
            _new_max(Rp, m, l, alpha)
            weight_parts(ST, sc, nb, -(-nb // 32) * 32, Rp, -(-Rp // 32) * 32, m, l, pv[0], masked, jlo, jhi)
        else:
            _softmax_block(ST, nb, Rp, b0, masked, rpos, rlo, m, l, alpha, jlo, jhi, neg)
        _prefetch_block(v_pages, pages, h, b1, nxt)
        if pv_tiles:
            amx_values(v_pages, pages, h, b0, nb, Rp, O, pv, b0 > lo, alpha, cfg)
        else:
            value_block(v_pages, v_scales, pages, h, b0, nb, Vb, st, ST, Rp, O, L,
                        RESCALE if b0 > lo else 0, alpha)   # O is still zero after the first block: no rescale
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
def tiled_units(q, k_pages, v_pages, k_scales, v_scales, page_indices, page_indptr, runs, units, u0, u1, window,
                scale, block, tokens, out, wm, wl, wacc, acc0, dot):
    """Process units u0..u1-1 with one set of scratch buffers (the serial kernel, and each parallel chunk's
    body). tokens: the most queries per tile (bounds the scratch); block: keys per score tile; acc0: a zero of
    the score GEMM's accumulation dtype (float32; float64 for precision="highest"). int8 pools (float32 q):
    k_scales / v_scales uint16 [num_pages, num_kv_heads, page_size, ceil(width / 32)], else None. dot: 0, or
    scores over bfloat16 pairs where they apply (`attend_tile`)."""
    Hkv = k_pages.shape[1]
    G = q.shape[1] // Hkv
    D = q.shape[2]
    Dv = v_pages.shape[3]
    dt = q.dtype
    L = 8 if q.itemsize == 8 else 16
    Rmax = -(-(tokens * G) // L) * L
    Dvp = -(-Dv // L) * L
    QT = np.full((D, Rmax), acc0)
    QP, Kp = pair_scratch(k_pages, QT, block, dot)
    cfg = tile_config()
    Kb = np.full((block + MR, D), acc0)
    Vb = np.zeros((block + MR, Dvp), dt)
    Rs = -(-Rmax // 32) * 32 if dot == 2 else Rmax    # the AMX tiles' rows (`amx_tiles`): whole tiles of 32
    like = np.zeros(0, dt)
    ST = zeros64(block + 32, Rs, like) if dot == 2 else np.empty((block + MR, Rmax), dt)
    O = zeros64(Rs, Dvp, like) if dot == 2 else np.empty((Rmax, Dvp), dt)
    pv = value_scratch(v_pages, O, block, Rs, dot)
    m = np.empty(Rmax, dt)
    l = np.empty(Rmax, dt)
    alpha = np.empty(Rmax, dt)
    rpos = np.empty(Rmax, np.int64)
    rlo = np.empty(Rmax, np.int64)
    jlo = np.empty(Rmax, np.int32)
    jhi = np.empty(Rmax, np.int32)
    st = np.empty(k_pages.shape[2] * (-(-max(D, Dv) // 32)), np.float32)
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
        attend_tile(q, k_pages, v_pages, k_scales, v_scales, pages, h, G, i0, runs[run, 3] + t0, nt, units[u, 4],
                    units[u, 5], window, sc, block, QT, Kb, Vb, ST, O, m, l, alpha, rpos, rlo, jlo, jhi, neg, st, dot,
                    QP, Kp, cfg, pv)
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
def merge_tiles(runs, items, item_parts, a, b, G, wm, wl, wacc, out):
    """Merge the parts of split tiles a..b-1 into out (`units.merge_rows`, parts in slot = key order; the tile's
    maxima are of scaled scores already)."""
    for it in range(a, b):
        h = items[it, 1]
        i0 = runs[items[it, 0], 1] + items[it, 2]
        for t in range(items[it, 3]):
            merge_rows(wm, wl, wacc, items[it, 4], item_parts[it], t * G, out[i0 + t, h * G:(h + 1) * G], 1.0)


@njit(cache=True, fastmath=FAST)
def _tile_workspace(q, tokens, G, Dv, num_slots):
    R = tokens * G
    return (np.empty((num_slots, R), q.dtype), np.empty((num_slots, R), q.dtype),
            np.empty((num_slots, R, Dv), q.dtype))


@njit(cache=True, fastmath=FAST)
def tiled_serial(q, k_pages, v_pages, k_scales, v_scales, page_indices, page_indptr, runs, units, items,
                 item_parts, num_slots, window, scale, block, tokens, out, acc0, dot):
    """Every unit of `units.plan_tiles` on the calling thread, then the split tiles' merge."""
    G = q.shape[1] // k_pages.shape[1]
    wm, wl, wacc = _tile_workspace(q, tokens, G, v_pages.shape[3], num_slots)
    zero = np.int64(0)               # not the literal 0: the serial and parallel kernels share one compiled body
    tiled_units(q, k_pages, v_pages, k_scales, v_scales, page_indices, page_indptr, runs, units, zero, units.shape[0],
                window, scale, block, tokens, out, wm, wl, wacc, acc0, dot)
    merge_tiles(runs, items, item_parts, zero, items.shape[0], G, wm, wl, wacc, out)
    return out


@njit(parallel=True, cache=True, fastmath=FAST)
def tiled_parallel(q, k_pages, v_pages, k_scales, v_scales, page_indices, page_indptr, runs, units, bounds, items,
                   item_parts, num_slots, window, scale, block, tokens, out, acc0, dot):
    """The units of `units.plan_tiles` on all threads (one prange iteration per chunk: it owns its units' outputs
    and workspace slots), then the split tiles' parts are merged (each tile's in slot order)."""
    G = q.shape[1] // k_pages.shape[1]
    wm, wl, wacc = _tile_workspace(q, tokens, G, v_pages.shape[3], num_slots)
    nch = bounds.shape[0] - 1
    for ck in prange(nch):
        tiled_units(q, k_pages, v_pages, k_scales, v_scales, page_indices, page_indptr, runs, units, bounds[ck],
                    bounds[ck + 1], window, scale, block, tokens, out, wm, wl, wacc, acc0, dot)
    n = items.shape[0]
    if n >= nch:
        for ck in prange(nch):
            merge_tiles(runs, items, item_parts, ck * n // nch, (ck + 1) * n // nch, G, wm, wl, wacc, out)
    else:
        merge_tiles(runs, items, item_parts, np.int64(0), n, G, wm, wl, wacc, out)
    return out
