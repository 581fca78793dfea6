"""The tiled kernel's score GEMM over bfloat16 pairs: where the pages are bfloat16 and a tile's queries are exactly
bfloat16 (a bfloat16 model's q), ST = K @ QT runs on `vdpbf16ps` (`gemm.gemm_strip_bf`: 32 products per
instruction, twice a float32 FMA's) with K's rows read in place, no widened copy. Every product of two bfloat16
is exact in float32, so a score's only roundings are its float32 additions, as on the widened path (the sums are
taken in another order: the odd element of each pair first). A q that is not exactly bfloat16 keeps the widened
path: splitting it into parts would cost more than the instruction saves (`bf16_dot`).

    page_piece(pages, P, t, left)               (page row, first row in it, rows) of the block piece at key t
    pair_scratch(k_pages, QT, block, dot)       (QP int16 [D / 2, 2 * rows], Kp int16 [block + MR, D]): the
                                                tile's q pairs and a key-row scratch; [0, 0] where the pairs
                                                do not apply (pages not bfloat16, q.k not float32, D odd)
    tile_pairs(QT, R, Rp, QP)                   QT's first R columns exactly bfloat16? then QP <- their pairs
    score_strip(A, B, c, C, n4, nv, flags, sc, mx, n)
                                                one strip of a score GEMM: over bfloat16 pairs for B = QP,
                                                float FMAs for B = QT (the tiled kernel's in-place walk,
                                                `tiled.pair_block`, runs both)
"""
import numpy as np
from numba import njit, types
from numba.extending import overload

from .gemm import MR, gemm_strip, gemm_strip_bf
from .simd import FAST, JIT, zeros64


@njit(cache=True)
def page_piece(pages, P, t, left):
    """The piece of a block that starts at key t: (its page's row in the pool, its first row in that page, its
    rows: up to the page's end and at most ``left``)."""
    pg = t // P
    s0 = t - pg * P
    return pages[pg], s0, min(P - s0, left)


def pair_scratch(k_pages, QT, block, dot):
    """The pair path's buffers for a tile of up to QT.shape[1] columns: QP [D / 2, 2 * columns] and Kp [block +
    MR, D] (int16), or empty ones where it does not apply (pages not bfloat16 bits, QT not float32, odd D). dot 2
    with D a multiple of 32 (the AMX tiles, `amx_tiles`): QP [3 * D / 2, 2 * columns rounded up to 32] (three
    parts) and Kp [block + 32, D]."""
    D, cols = QT.shape
    if k_pages.dtype == np.int16 and QT.dtype == np.float32 and D % 2 == 0:
        return _sized(D, cols, block, dot)
    return np.zeros((0, 0), np.int16), np.zeros((0, 0), np.int16)


@njit(cache=True)
def _sized(D, cols, block, dot):
    if dot == 2 and D % 32 == 0:      # tile operands: rows on 64-byte boundaries (`simd.zeros64`)
        like = np.zeros(0, np.int16)
        return zeros64(3 * (D // 2), 2 * (-(-cols // 32) * 32), like), zeros64(block + 32, D, like)
    return np.zeros((D // 2, 2 * cols), np.int16), np.zeros((block + MR, D), np.int16)


def tile_pairs(QT, R, Rp, QP):
    """Whether columns 0..R-1 of QT [D, >= Rp] (a tile's queries, float32) are all exactly bfloat16 (low halves
    zero); if so QP[p, 2r + e] = the bfloat16 bits of QT[2p + e, r] for r < Rp (columns R..Rp-1 of QT are zero).
    False without touching QP where QP is empty (`pair_scratch`)."""
    if QP.shape[0] == 0:
        return False
    bits = QT.view(np.uint32)
    low = np.uint32(0)
    for d in range(QT.shape[0]):
        row = bits[d]
        for r in range(R):
            low |= row[r] & np.uint32(0xFFFF)
    if low != 0:
        return False
    packed = QP.view(np.uint32)             # one uint32 per (pair, column): the even element in the low half
    for p in range(QP.shape[0]):
        even = bits[2 * p]
        odd = bits[2 * p + 1]
        dst = packed[p]
        for r in range(Rp):
            dst[r] = (even[r] >> np.uint32(16)) | (odd[r] & np.uint32(0xFFFF0000))
    return True


def score_strip(A, B, c, C, n4, nv, flags, sc, mx, n):
    """C[:n4, c : c + 16 nv] = the rows A [>= n4, D] . B's columns (a score GEMM of `gemm`, flags / sc / mx as
    there, column maxima over the first n rows): B int16 = the tile's q pairs (`gemm.gemm_strip_bf` over A's
    bfloat16 bits), else QT [D, .] in A's dtype (`gemm.gemm_strip`)."""
    D = A.shape[1]
    if B.dtype == np.int16:
        gemm_strip_bf(A, D, 0, n4, B, c, C, D // 2, nv, flags, sc, mx, n)
    else:
        gemm_strip(A, D, 1, 0, n4, B, c, C, D, nv, flags, mx, sc, mx, n)


if JIT:
    _tile_pairs = njit(cache=True, fastmath=FAST)(tile_pairs)

    def _applies(k_pages, QT):
        return k_pages.dtype == types.int16 and QT.dtype == types.float32

    @overload(pair_scratch)
    def _pair_scratch_ov(k_pages, QT, block, dot):
        if _applies(k_pages, QT):
            def impl(k_pages, QT, block, dot):
                D, cols = QT.shape
                if D % 2 == 0:
                    return _sized(D, cols, block, dot)
                return np.zeros((0, 0), np.int16), np.zeros((0, 0), np.int16)
            return impl
        return lambda k_pages, QT, block, dot: (np.zeros((0, 0), np.int16), np.zeros((0, 0), np.int16))

    @overload(tile_pairs, inline="always")
    def _tile_pairs_ov(QT, R, Rp, QP):
        if QT.dtype == types.float32:
            return lambda QT, R, Rp, QP: _tile_pairs(QT, R, Rp, QP)
        return lambda QT, R, Rp, QP: False

    @overload(score_strip, inline="always")
    def _score_strip_ov(A, B, c, C, n4, nv, flags, sc, mx, n):
        if B.dtype == types.int16:
            def impl(A, B, c, C, n4, nv, flags, sc, mx, n):
                D = A.shape[1]
                gemm_strip_bf(A, D, 0, n4, B, c, C, D // 2, nv, flags, sc, mx, n)
            return impl

        def impl(A, B, c, C, n4, nv, flags, sc, mx, n):
            D = A.shape[1]
            gemm_strip(A, D, 1, 0, n4, B, c, C, D, nv, flags, mx, sc, mx, n)
        return impl
