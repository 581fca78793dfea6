"""The tiled kernel's block steps on AMX tiles (`amx_tiles`) for bfloat16 pages: a tile's q split into parts, the
score block with the GEMM's epilogue, and the PV block with its operands prepared.

A float32 q is split exactly into bfloat16 parts (hi + mid + lo, by truncation as in `bf16_dot`: every normal
float32 is their exact sum); a bfloat16 q (a bfloat16 model's) has one. The softmax's weights P are split the same
way (three parts, always; rows x keys, as the softmax step writes them: `tile_softmax.weight_parts`); value rows
are paired (two keys per 32-bit element, the B layout). So both products are of exact bfloat16 parts, every
product exact in float32 and the only roundings float32 additions, as on the widened path, in the tile unit's
order (head_dim, or the keys, in chunks of 32, each chunk's parts in turn): other bits than the other paths'
(still deterministic: the same on every call and thread count).

    pack_parts(QT, R, Rp, QA)     QT [D, >= Rp] float32 (a tile's queries, columns R.. zero) -> QA int16 [3 * D / 2,
                                  2 * cols] (part p, pair k, column r, element e at [p * D / 2 + k, 2 r + e]);
                                  returns how many parts are nonzero (1-3)
    amx_block(...)                the score block: keys staged where not read in place, the tile GEMM, then `gemm`'s
                                  SCALE / COLMAX epilogue
    value_scratch(...)            the PV block's buffers (empty where the tiles do not take PV)
    value_pairs(...)              a block's value rows in pairs (the PV tiles' B operand; the decode tiles' too)
    amx_values(...)               the PV block: O rescaled, value rows paired, the tile GEMM over the weights' parts
                                  (`tile_softmax.weight_parts` writes them)
    scores_reference(...)         the score GEMM's NumPy twin (the same products; float64 sums: a test oracle)
"""
import numpy as np
from numba import njit, types

from .amx_tiles import HOST, amx_pv, amx_scores, in_place
from .bf16_dot import split3
from .gemm import COLMAX, SCALE
from .simd import FAST, JIT, zeros64


def pack_parts(QT, R, Rp, QA):
    """QA[p * D / 2 + k, 2 r + e] = the bfloat16 bits of part p of QT[2k + e, r] (r < Rp; columns R.. of QT zero;
    QA's columns from Rp zero); returns the number of nonzero parts (1-3). The parts: `bf16_dot.split3`."""
    D = QT.shape[0]
    half = D // 2
    bits = QT.view(np.uint32)
    packed = QA.view(np.uint32)
    hm = np.uint32(0xFFFF0000)
    s16 = np.uint32(16)
    m1 = np.uint32(0)
    m2 = np.uint32(0)
    for k in range(half):
        x0 = QT[2 * k]
        x1 = QT[2 * k + 1]
        u0 = bits[2 * k]
        u1 = bits[2 * k + 1]
        d0 = packed[k]
        d1 = packed[half + k]
        d2 = packed[2 * half + k]
        for r in range(Rp):
            a0, b0, c0 = split3(x0[r], u0[r])
            a1, b1, c1 = split3(x1[r], u1[r])
            d0[r] = (a0 >> s16) | a1
            d1[r] = (b0 >> s16) | (b1 & hm)
            d2[r] = (c0 >> s16) | (c1 & hm)
            m1 |= (b0 | b1) & np.uint32(0x7FFFFFFF)
            m2 |= (c0 | c1) & np.uint32(0x7FFFFFFF)
        for r in range(Rp, packed.shape[1]):
            d0[r] = 0
            d1[r] = 0
            d2[r] = 0
    return 3 if m2 else (2 if m1 else 1)


def amx_block(k_pages, pages, h, b0, nb, Kt, QA, parts, ST, Rp, flags, sc, mx, cfg):
    """ST[:nb, :Rp] = the rows of kv head h at absolute positions b0.. (bfloat16 pages) . the tile's q parts QA, on
    the tiles; then the score GEMM's epilogue (`gemm`'s SCALE: times sc; COLMAX: mx[r] = max(mx[r], ST[j, r] over
    j < nb)). Rows of ST from nb to nb rounded up to 32: scores of zero keys or of slots past the block (never
    read)."""
    stage_keys(k_pages, pages, h, b0, nb, Kt)
    amx_scores(k_pages, pages, h, b0, nb, Kt, QA, parts, ST, -(-Rp // 32) * 32, cfg)
    scale = (flags & SCALE) != 0
    colmax = (flags & COLMAX) != 0
    for j in range(nb):
        row = ST[j]
        if scale:
            for r in range(Rp):
                row[r] *= sc
        if colmax:
            for r in range(Rp):
                mx[r] = max(mx[r], row[r])


def stage_keys(k_pages, pages, h, b0, nb, Kt):
    """Kt[g:g + 16] = the keys b0 + g.. of every 16-key group the tiles do not read in place (`in_place`), rows past
    nb zero."""
    P = k_pages.shape[2]
    D = k_pages.shape[3]
    for g in range(0, -(-nb // 32) * 32, 16):
        if in_place(P, b0, g, nb):
            continue
        for j in range(g, g + 16):
            dst = Kt[j]
            if j < nb:
                t = b0 + j
                src = k_pages[pages[t // P], h, t % P]
                for d in range(D):
                    dst[d] = src[d]
            else:
                for d in range(D):
                    dst[d] = 0


def value_scratch(v_pages, O, block, rows, dot):
    """The PV tiles' buffers ``pv`` for a tile of up to ``rows`` rows (a multiple of 32): PA int16 [3, rows, block +
    32] (the weights' bfloat16 parts, `tile_softmax.weight_parts`), VB uint32 [(block + 32) / 2, Dv] (value rows in
    pairs); both empty where the tiles do not take PV (dot != 2, pages not bfloat16, O not float32, Dv not a
    multiple of 32)."""
    if v_pages.dtype == np.int16 and O.dtype == np.float32:
        return _pv_buffers(v_pages.shape[3], block, rows, dot)
    return _pv_buffers(0, 0, 0, 0)


def _pv_buffers(Dv, block, rows, dot):
    """`value_scratch`'s buffers (the PV tiles apply: dot 2, Dv a positive multiple of 32), else empty ones."""
    if dot == 2 and Dv > 0 and Dv % 32 == 0:
        n = block + 32
        return (zeros64(3 * rows, n, np.zeros(0, np.int16)).reshape((3, rows, n)),
                zeros64(n // 2, Dv, np.zeros(0, np.uint32)))
    return np.zeros((0, 0, 0), np.int16), np.zeros((0, 0), np.uint32)


def pair32(src, ia, ib, dst, io):
    """dst[io + i] = src[ia + i] (low half) | src[ib + i] (high half) for i < 32 (bfloat16 bits of two value rows
    of a flat pool; dst flat uint32). In IR: two 32 x 16-bit loads, two interleaving shuffles, two stores."""
    for i in range(32):
        dst[io + i] = np.uint32(np.uint16(src[ia + i])) | (np.uint32(np.uint16(src[ib + i])) << np.uint32(16))


def value_pairs(v_pages, pages, h, b0, nb, VB):
    """VB[k, d] = value rows 2k (low half) and 2k + 1 (high half) of kv head h at absolute positions b0.. (bfloat16
    bits; rows from nb to nb rounded up to 32 zero; Dv a multiple of 32): the B operand of the PV tiles (both AMX
    paths), by `pair32` on flat views. The rows are followed page by page."""
    H = v_pages.shape[1]
    P = v_pages.shape[2]
    Dv = v_pages.shape[3]
    src = v_pages.reshape(-1)
    dst = VB.reshape(-1)
    j = b0 // P                 # the page (index into `pages`) and slot of the next row
    s = b0 - j * P
    for k in range(-(-nb // 32) * 16):
        io = k * Dv
        left = nb - 2 * k
        if left >= 2:
            ia = ((pages[j] * H + h) * P + s) * Dv
            s += 1
            if s == P:
                j += 1
                s = 0
            ib = ((pages[j] * H + h) * P + s) * Dv
            s += 1
            if s == P:
                j += 1
                s = 0
            for d0 in range(0, Dv, 32):
                pair32(src, ia + d0, ib + d0, dst, io + d0)
        elif left == 1:
            ia = ((pages[j] * H + h) * P + s) * Dv
            for d in range(Dv):
                dst[io + d] = np.uint32(np.uint16(src[ia + d]))
        else:
            for d in range(Dv):
                dst[io + d] = 0


def amx_values(v_pages, pages, h, b0, nb, Rp, O, pv, rescale, alpha, cfg):
    """O[:Rp, :Dv] (times alpha[r] first where ``rescale``; rows whose alpha is 1 are left as they are) += P . V
    on the tiles: P the block's weights as pv's PA holds them (three exact bfloat16 parts, rows x keys, keys nb..
    zero: `tile_softmax.weight_parts`), V the block's bfloat16 rows (paired into pv's VB). O has at least Rp
    rounded up to 32 rows."""
    Dv = v_pages.shape[3]
    nbp = -(-nb // 32) * 32
    Rs = -(-Rp // 32) * 32
    if rescale:
        for r in range(Rp):
            a = alpha[r]
            if a != 1.0:
                row = O[r]
                for d in range(Dv):
                    row[d] *= a
    PA, VB = pv
    value_pairs(v_pages, pages, h, b0, nb, VB)
    amx_pv(PA, 3, VB, O, Rs, nbp, Dv, False, cfg)


def scores_reference(Kt, QA, parts, nbp, Rp):
    """ST[:nbp, :Rp] as `amx_scores` computes it (the same exact products; summed in float64): NumPy."""
    D = Kt.shape[1]
    half = D // 2
    k = (Kt[:nbp].view(np.uint16).astype(np.uint32) << np.uint32(16)).view(np.float32).astype(np.float64)
    out = np.zeros((nbp, Rp))
    for p in range(parts):
        pairs = QA[p * half:(p + 1) * half, :2 * Rp].view(np.uint16).astype(np.uint32) << np.uint32(16)
        q = pairs.view(np.float32).reshape(half, Rp, 2).transpose(0, 2, 1).reshape(D, Rp).astype(np.float64)
        out += k @ q
    return out


if JIT:
    from llvmlite import ir as _ir
    from numba.core import cgutils as _cg
    from numba.extending import intrinsic, overload

    from .vector_ir import split3_ir

    stage_keys = njit(cache=True)(stage_keys)
    _pv_buffers = njit(cache=True)(_pv_buffers)

    @intrinsic
    def _pair32_ir(typingctx, src, ia, ib, dst, io):
        if not (isinstance(src, types.Array) and src.dtype == types.int16 and isinstance(dst, types.Array)
                and dst.dtype == types.uint32):
            return None

        def codegen(context, builder, sig, args):
            i16x32 = _ir.VectorType(_ir.IntType(16), 32)
            base = context.make_array(sig.args[0])(context, builder, args[0]).data
            rows = []
            for k in (1, 2):
                o = context.cast(builder, args[k], sig.args[k], types.int64)
                rows.append(builder.load(builder.bitcast(builder.gep(base, [o]), i16x32.as_pointer()), align=2))
            out = context.make_array(sig.args[3])(context, builder, args[3]).data
            o = context.cast(builder, args[4], sig.args[4], types.int64)
            for half in (0, 1):
                mask = [x for i in range(16) for x in (16 * half + i, 32 + 16 * half + i)]
                v = builder.shuffle_vector(rows[0], rows[1], _ir.Constant(_ir.VectorType(_ir.IntType(32), 32), mask))
                ptr = builder.gep(out, [builder.add(o, _ir.Constant(_ir.IntType(64), 16 * half))])
                builder.store(v, builder.bitcast(ptr, i16x32.as_pointer()), align=4)
            return context.get_dummy_value()
        return types.void(src, ia, ib, dst, io), codegen

    @overload(pair32, inline="always")
    def _pair32_ov(src, ia, ib, dst, io):
        return lambda src, ia, ib, dst, io: _pair32_ir(src, ia, ib, dst, io)

    _F32X16 = _ir.VectorType(_ir.FloatType(), 16)
    _I32X16 = _ir.VectorType(_ir.IntType(32), 16)
    _I16X16 = _ir.VectorType(_ir.IntType(16), 16)
    _I16X32 = _ir.VectorType(_ir.IntType(16), 32)

    @intrinsic
    def _pack_parts_ir(typingctx, QT, Rp, QA):
        if not (isinstance(QT, types.Array) and QT.dtype == types.float32 and QT.ndim == 2 and QT.layout == "C"
                and isinstance(QA, types.Array) and QA.dtype == types.int16 and QA.ndim == 2 and QA.layout == "C"):
            return None

        def codegen(context, builder, sig, args):
            i64 = _ir.IntType(64)
            qt = context.make_array(sig.args[0])(context, builder, args[0])
            qa = context.make_array(sig.args[2])(context, builder, args[2])
            D, qc = _cg.unpack_tuple(builder, qt.shape, 2)
            rows, ac = _cg.unpack_tuple(builder, qa.shape, 2)
            Rp = context.cast(builder, args[1], sig.args[1], types.int64)
            half = builder.sdiv(D, _ir.Constant(i64, 2))
            c16 = _ir.Constant(i64, 16)
            s16 = _ir.Constant(_I32X16, [16] * 16)
            weave = _ir.Constant(_ir.VectorType(_ir.IntType(32), 32), [x for i in range(16) for x in (i, 16 + i)])
            zero = _ir.Constant(_I32X16, [0] * 16)
            m1 = _cg.alloca_once_value(builder, zero)
            m2 = _cg.alloca_once_value(builder, zero)
            with _cg.for_range(builder, half) as kl:
                k = kl.index
                with _cg.for_range(builder, builder.sdiv(Rp, c16)) as rl:
                    r0 = builder.mul(rl.index, c16)
                    sp = []
                    for e in (0, 1):
                        row = builder.add(builder.mul(k, _ir.Constant(i64, 2)), _ir.Constant(i64, e))
                        ptr = builder.gep(qt.data, [builder.add(builder.mul(row, qc), r0)])
                        sp.append(split3_ir(builder, builder.load(builder.bitcast(ptr, _F32X16.as_pointer()), align=4)))
                    builder.store(builder.or_(builder.load(m1), builder.or_(sp[0][1], sp[1][1])), m1)
                    builder.store(builder.or_(builder.load(m2), builder.or_(sp[0][2], sp[1][2])), m2)
                    for p in range(3):
                        lo, hi = (builder.trunc(builder.lshr(sp[e][p], s16), _I16X16) for e in (0, 1))
                        row = builder.add(builder.mul(_ir.Constant(i64, p), half), k)
                        ptr = builder.gep(qa.data, [builder.add(builder.mul(row, ac), builder.add(r0, r0))])
                        builder.store(builder.shuffle_vector(lo, hi, weave), builder.bitcast(ptr, _I16X32.as_pointer()),
                                      align=2)
            zeros = _ir.Constant(_I16X32, [0] * 32)
            tail = builder.sdiv(builder.sub(ac, builder.add(Rp, Rp)), _ir.Constant(i64, 32))
            with _cg.for_range(builder, rows) as rl:
                with _cg.for_range(builder, tail) as cl:
                    o = builder.add(builder.add(Rp, Rp), builder.mul(cl.index, _ir.Constant(i64, 32)))
                    ptr = builder.gep(qa.data, [builder.add(builder.mul(rl.index, ac), o)])
                    builder.store(zeros, builder.bitcast(ptr, _I16X32.as_pointer()), align=2)
            absmask = _ir.Constant(_I32X16, [0x7FFFFFFF] * 16)

            def any_bits(acc):
                fn = _cg.get_or_insert_function(builder.module, _ir.FunctionType(_ir.IntType(32), [_I32X16]),
                                                "llvm.vector.reduce.or.v16i32")
                v = builder.call(fn, [builder.and_(builder.load(acc), absmask)])
                return builder.icmp_unsigned("!=", v, _ir.Constant(_ir.IntType(32), 0))
            two = builder.select(any_bits(m1), _ir.Constant(i64, 2), _ir.Constant(i64, 1))
            return builder.select(any_bits(m2), _ir.Constant(i64, 3), two)
        return types.int64(QT, Rp, QA), codegen

    @overload(pack_parts, inline="always")
    def _pack_parts_ov(QT, R, Rp, QA):
        if QT.dtype == types.float32 and QA.dtype == types.int16:
            return lambda QT, R, Rp, QA: _pack_parts_ir(QT, Rp, QA)
        return lambda QT, R, Rp, QA: 0

    value_pairs = njit(cache=True)(value_pairs)
    _amx_block_jit = njit(cache=True, fastmath=FAST)(amx_block) if HOST else None

    @overload(amx_block, inline="always")
    def _amx_block_ov(k_pages, pages, h, b0, nb, Kt, QA, parts, ST, Rp, flags, sc, mx, cfg):
        if HOST and k_pages.dtype == types.int16 and ST.dtype == types.float32:
            return lambda k_pages, pages, h, b0, nb, Kt, QA, parts, ST, Rp, flags, sc, mx, cfg: _amx_block_jit(
                k_pages, pages, h, b0, nb, Kt, QA, parts, ST, Rp, flags, sc, mx, cfg)
        return lambda k_pages, pages, h, b0, nb, Kt, QA, parts, ST, Rp, flags, sc, mx, cfg: None

    _amx_values_jit = njit(cache=True, fastmath=FAST)(amx_values) if HOST else None

    @overload(amx_values, inline="always")
    def _amx_values_ov(v_pages, pages, h, b0, nb, Rp, O, pv, rescale, alpha, cfg):
        if HOST and v_pages.dtype == types.int16 and O.dtype == types.float32:
            return lambda v_pages, pages, h, b0, nb, Rp, O, pv, rescale, alpha, cfg: _amx_values_jit(
                v_pages, pages, h, b0, nb, Rp, O, pv, rescale, alpha, cfg)
        return lambda v_pages, pages, h, b0, nb, Rp, O, pv, rescale, alpha, cfg: None

    @overload(value_scratch)
    def _value_scratch_ov(v_pages, O, block, rows, dot):
        if v_pages.dtype == types.int16 and O.dtype == types.float32:
            return lambda v_pages, O, block, rows, dot: _pv_buffers(v_pages.shape[3], block, rows, dot)
        return lambda v_pages, O, block, rows, dot: _pv_buffers(0, 0, 0, 0)
