"""Row loaders: the one place where the kernels' skeletons (`per_query`, `tiled`) meet a storage format.

A format is how a page row is read into compute values. The element type of the pages as handed to the kernels
selects it at compile time (`simd.ld` for one element, `vector_ir.widen_ir` for a vector: both exact):

    float32 / float64   as stored
    uint16              float16 bits (pages stored as float16, viewed as uint16)
    int16               bfloat16 bits (pages stored as uint16 bfloat16 bits, viewed as int16: a tag, the bits
                        are unchanged; widened as uint32(bits) << 16 viewed as float32)
    int8 + scales       int8 values with float16 group scales (`kvcache.quant`): ``scales`` is an array

The three loaders below are what a skeleton calls per page tile; each dispatches on ``scales`` (None for the
float formats, the uint16 scale bits for int8) by overload at compile time, the Python bodies being the
NUMBA_DISABLE_JIT twins. A new float-like format is a new element type in `simd.ld` / `vector_ir.widen_ir`; a new
scaled format is a new branch here. Shapes: ``kp`` / ``vp`` [page_size, width] rows of one kv head of one page,
``st`` float32 scratch [page_size * ceil(width / 32)] (the tile's scales), ``kt`` / ``vt`` float32 scratch
[chunk rows, width] (``kt`` in the q.k accumulation dtype: a large query-head group takes the chunk's key rows
widened once, `wide_group`; ``vt``: its 16-bit float value rows likewise, `wide_values`).

    tile_scales(scales, page, h, st)                      int8: st <- the page tile's scales as float32
    score_rows(qh, qb, qf, parts, kp, st, scales, r0, r1, Sh, c, kt)
                                          Sh[g, c + t - r0] = q[g] . row t (t in [r0, r1)): `blocks.qk` on qh, or
                                          for bfloat16 pages on q's bfloat16 parts qb (parts > 0) or float32
                                          halves qf (parts -1) (`bf16_dot.split_query`); int8: `int8_rows`
    value_rows(Sh, c, vp, st, scales, r0, r1, ah, vt)     ah[g, :] += Sh[g, c + t - r0] * row t (16-bit rows of
                                          a large group into float32 accumulators: widened once into vt first,
                                          `wide_values`)
    block_rows(tile, scales, page, h, s0, s1, dst, j, st) dst[j + s - s0, :width] = row s   (tiled K/V blocks)
"""
import numpy as np

from .blocks import pv, qk
from .int8_rows import block_rows_int8, score_rows_int8, value_rows_int8
from .int8_simd import h2f_all
from .register_blocks import pair_rows
from .simd import JIT, ld


def tile_scales(scales, page, h, st):
    """int8: st[t * G + g] = float32(scales[page, h, t, g]) (the whole page tile, one vectorised pass); floats:
    nothing."""
    if scales is not None:
        h2f_all(scales[page, h], st)


def score_rows(qh, qb, qf, parts, kp, st, scales, r0, r1, Sh, c, kt):
    """Scores of the query-head group against rows r0..r1-1 of kp (any format): of qh [G, D] itself, or for
    bfloat16 pages of q as `bf16_dot.split_query` prepared it (parts > 0: its bfloat16 parts qb [G, 3 * Dp],
    vdpbf16ps; parts -1: its float32 halves qf [G, Dp], two FMAs per pair; 0: qh); a large group over rows
    narrower than qh (float64 qh over float32 / float16, float32 qh over float16): the rows widened once into kt
    first (`_widen_once`: the same scores)."""
    if scales is not None:
        score_rows_int8(qh, kp, st, r0, r1, Sh, c, kt)
    elif parts > 0 and kp.dtype == np.int16:
        qk(qb, kp, r0, r1, Sh, c, parts)
    elif parts < 0 and kp.dtype == np.int16:
        qk(qf, kp, r0, r1, Sh, c, 1)
    elif _widen_once(qh, kp, kt, r0, r1):
        _float_block_rows(kp, r0, r1, kt, 0)
        qk(qh, kt, 0, r1 - r0, Sh, c)
    else:
        qk(qh, kp, r0, r1, Sh, c)


def wide_group(acc_itemsize, itemsize):
    """Query heads per kv head from which q.k accumulated in ``acc_itemsize`` bytes (8: float64, 4: float32) widens
    a chunk of key rows of ``itemsize`` bytes once: float64 over float32 pages 16 (a widening of one conversion
    saved 4 times), over float16 8 (one of two conversions saved twice); float32 over float16 or bfloat16 32
    (measured on the Zen 4 guest, one thread, 4096 rows of d 128 by chunks of 16, q.k alone, ms: float16 G = 32
    0.424 -> 0.405-0.414, G = 16 0.442 -> 0.432-0.448, G = 8 0.45 -> 0.49; bfloat16 G = 32 0.424 -> 0.408-0.415,
    G = 16 0.43 -> 0.435-0.452). Below that, the store and reload of the widened rows cost what they save."""
    if acc_itemsize == 4:
        return 32
    return 16 if itemsize == 4 else 8


def _widen_once(qh, kp, kt, r0, r1):
    """Whether the scores of a large query-head group take the chunk's key rows widened once into the scratch kt
    (float64 q.k, precision="highest", over float32 or float16 rows; float32 q.k over float16 or bfloat16 rows: the
    latter where q is not split into bfloat16 parts or halves, `bf16_dot` mode 0), instead of each
    4-head block of `qk` widening them again (the conversions, with the FMAs on the same two ports, bound that
    loop); the same products summed in the same order either way: the scores keep their bits."""
    return (kt.dtype == qh.dtype and kp.dtype != qh.dtype and kp.dtype not in _NOT_WIDENED[qh.itemsize]
            and qh.shape[0] >= wide_group(qh.itemsize, kp.itemsize) and r1 - r0 <= kt.shape[0])


# key rows a q.k accumulation dtype (by itemsize) never widens once: float64 rows, and for float64 q.k bfloat16
# rows (widened by a shift, as cheap as a reload)
_NOT_WIDENED = {8: (np.float64, np.int16), 4: (np.float64,)}


def key_scratch(scales, rows, width, qs):
    """The ``kt`` scratch of `score_rows`, uninitialised: float32 for int8 (its scaled tiles), else in the q.k
    accumulation dtype (that of qs, the query rows as the dot reads them)."""
    if scales is not None:
        return np.empty((rows, width), np.float32)
    return np.empty((rows, width), qs.dtype)


def wide_values(bfloat16):
    """Query heads per kv head from which 16-bit float value rows (bfloat16 True: int16 bits; False: float16) are
    widened once per chunk into the float32 scratch before PV, rather than by each of `pv`'s 4-head blocks (a
    float16 row's conversions share the FMAs' ports; a bfloat16 row's shift and mask are cheaper). Measured on the
    Zen 4 guest (one thread, 4096 rows of d 128 by chunks of 16, PV alone, ms): float16 G = 32 0.42 -> 0.36,
    G = 16 0.42 -> 0.39, G = 8 0.42 -> 0.45; bfloat16 G = 32 0.37 -> 0.36, G = 16 0.37 -> 0.38."""
    return 32 if bfloat16 else 16


def _wide_values(vp, ah, vt, r0, r1):
    """Whether `value_rows` widens the chunk's 16-bit float value rows once into vt (float32; bfloat16 in the pair
    order, `register_blocks.pair_rows`) and runs PV over those: the same products summed in the same order as PV
    over the rows themselves (the widening is exact), so the same bits."""
    return (vp.dtype in (np.uint16, np.int16) and ah.dtype == np.float32 and vt.dtype == np.float32
            and ah.shape[0] >= wide_values(vp.dtype == np.int16) and r1 - r0 <= vt.shape[0])


def value_rows(Sh, c, vp, st, scales, r0, r1, ah, vt):
    """The weighted sum of rows r0..r1-1 of vp (any format) into ah [G, Dv]."""
    if scales is not None:
        value_rows_int8(Sh, c, vp, st, r0, r1, ah, vt)
    elif _wide_values(vp, ah, vt, r0, r1):
        _widen_values(vp, r0, r1, vt)
        pv(Sh, c, vt, 0, r1 - r0, ah)
    else:
        pv(Sh, c, vp, r0, r1, ah)


def _widen_values(vp, r0, r1, vt):
    if vp.dtype == np.int16:
        pair_rows(vp, r0, r1, vt)
    else:
        _float_block_rows(vp, r0, r1, vt, 0)


def _float_block_rows(tile, s0, s1, dst, j):
    W = tile.shape[1]
    for s in range(s0, s1):
        src = tile[s]
        row = dst[j + s - s0]
        for d in range(W):
            row[d] = ld(src[d])


def block_rows(tile, scales, page, h, s0, s1, dst, j, st):
    """dst[j + s - s0, :width] = rows s0..s1-1 of the page tile (page, h) in dst's dtype (int8: times their group
    scales, float32)."""
    if scales is None:
        _float_block_rows(tile, s0, s1, dst, j)
    else:
        block_rows_int8(tile, scales[page, h], s0, s1, dst, j, st)


if JIT:
    from numba import njit, types
    from numba.extending import overload

    from .simd import FAST

    _float_block_rows = njit(cache=True, fastmath=FAST)(_float_block_rows)

    def _floats(scales):
        return scales is None or isinstance(scales, (types.NoneType, types.Omitted))

    @overload(tile_scales, inline="always")
    def _tile_scales_ov(scales, page, h, st):
        if _floats(scales):
            return lambda scales, page, h, st: None
        return lambda scales, page, h, st: h2f_all(scales[page, h], st)

    @overload(score_rows, inline="always")
    def _score_rows_ov(qh, qb, qf, parts, kp, st, scales, r0, r1, Sh, c, kt):
        if not _floats(scales):
            return lambda qh, qb, qf, parts, kp, st, scales, r0, r1, Sh, c, kt: score_rows_int8(qh, kp, st, r0, r1,
                                                                                                 Sh, c, kt)
        if kt.dtype == qh.dtype and kp.dtype != qh.dtype and kp.dtype not in (types.float64, types.int16):
            wide = wide_group(qh.dtype.bitwidth // 8, kp.dtype.bitwidth // 8)

            def widened(qh, qb, qf, parts, kp, st, scales, r0, r1, Sh, c, kt):
                if qh.shape[0] >= wide and r1 - r0 <= kt.shape[0]:
                    _float_block_rows(kp, r0, r1, kt, 0)
                    qk(qh, kt, 0, r1 - r0, Sh, c)
                else:
                    qk(qh, kp, r0, r1, Sh, c)
            return widened
        if kp.dtype != types.int16:
            return lambda qh, qb, qf, parts, kp, st, scales, r0, r1, Sh, c, kt: qk(qh, kp, r0, r1, Sh, c)

        widen = qh.dtype == kt.dtype == types.float32
        wide = wide_group(4, 2)

        def bf16_pages(qh, qb, qf, parts, kp, st, scales, r0, r1, Sh, c, kt):
            if parts > 0:
                qk(qb, kp, r0, r1, Sh, c, parts)
            elif parts < 0:
                qk(qf, kp, r0, r1, Sh, c, 1)
            elif widen and qh.shape[0] >= wide and r1 - r0 <= kt.shape[0]:
                _float_block_rows(kp, r0, r1, kt, 0)
                qk(qh, kt, 0, r1 - r0, Sh, c)
            else:
                qk(qh, kp, r0, r1, Sh, c)
        return bf16_pages

    @overload(key_scratch, inline="always")
    def _key_scratch_ov(scales, rows, width, qs):
        if _floats(scales):
            return lambda scales, rows, width, qs: np.empty((rows, width), qs.dtype)
        return lambda scales, rows, width, qs: np.empty((rows, width), np.float32)

    @overload(value_rows, inline="always")
    def _value_rows_ov(Sh, c, vp, st, scales, r0, r1, ah, vt):
        if _floats(scales) and vp.dtype in (types.uint16, types.int16) and ah.dtype == vt.dtype == types.float32:
            pairs = vp.dtype == types.int16
            wide = wide_values(pairs)

            def widened(Sh, c, vp, st, scales, r0, r1, ah, vt):
                if ah.shape[0] >= wide and r1 - r0 <= vt.shape[0]:
                    if pairs:
                        pair_rows(vp, r0, r1, vt)
                    else:
                        _float_block_rows(vp, r0, r1, vt, 0)
                    pv(Sh, c, vt, 0, r1 - r0, ah)
                else:
                    pv(Sh, c, vp, r0, r1, ah)
            return widened
        if _floats(scales):
            return lambda Sh, c, vp, st, scales, r0, r1, ah, vt: pv(Sh, c, vp, r0, r1, ah)
        return lambda Sh, c, vp, st, scales, r0, r1, ah, vt: value_rows_int8(Sh, c, vp, st, r0, r1, ah, vt)

    @overload(block_rows, inline="always")
    def _block_rows_ov(tile, scales, page, h, s0, s1, dst, j, st):
        if _floats(scales):
            return lambda tile, scales, page, h, s0, s1, dst, j, st: _float_block_rows(tile, s0, s1, dst, j)
        return lambda tile, scales, page, h, s0, s1, dst, j, st: block_rows_int8(tile, scales[page, h], s0, s1,
                                                                                dst, j, st)
