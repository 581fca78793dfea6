"""The online softmax of a block of scores laid out keys x q heads (`amx_decode`'s step between its two tile
products), 16 heads to a 512-bit vector in LLVM IR.

A decode query's scores come off the AMX tiles as ST [keys, columns], column p * G + g holding part p of q head g
(`amx_decode`). Per block the heads' maxima, the weights exp((s - max) * scale) and their sums are taken over
whole rows of heads: each row is one vector op per 16 heads, where numba's own loops over a row of 16 or 32 heads
(runtime trip counts, vectorised 32 lanes at a time) ran mostly in their scalar remainders.

    sum_parts_max(ST, W, red, nb, G, parts, g0)  W[j, g0:g0+16] = the sum over parts of ST's columns (j < nb),
                                                 red[0, g0:g0+16] = their maxima over j
    exp_rows(W, red, nb, nbp, g0, scale)         W[j, g0:g0+16] <- exp((W - red[2]) * scale) (j < nb, zero to
                                                 nbp), red[1, g0:g0+16] = their sums in key order
    block_softmax(npq, G, nb, nbp, ST, W, S, off, red, m, l, O, first, scale)
                                                 the whole step: the two above, the running max / sum update (O's
                                                 rows rescaled), W^T into S

The exp is `simd.exp_inline`'s polynomial (Cody-Waite reduction, degree 6, arguments clamped at -87), the same
operations lane by lane; each has a plain-Python twin for NUMBA_DISABLE_JIT.
"""
import numpy as np
from numba import njit, types

from .gemm import transpose_rows
from .simd import EXP_FLAGS, JIT, exp, exp_inline

LANES = 16          # heads per vector (W's columns are a multiple of it)


def sum_parts_max(ST, W, red, nb, G, parts, g0):
    """W[j, g0 + i] = ST[j, g0 + i] (+ ST[j, G + g0 + i] + ST[j, 2 G + g0 + i] where parts == 3), left to right,
    for j < nb (>= 1) and i < 16; red[0, g0 + i] = max over j of W[j, g0 + i]."""
    for i in range(LANES):
        g = g0 + i
        for j in range(nb):
            x = ST[j, g]
            if parts == 3:
                x = x + ST[j, G + g] + ST[j, 2 * G + g]
            W[j, g] = x
            red[0, g] = x if j == 0 else max(red[0, g], x)


def exp_rows(W, red, nb, nbp, g0, scale):
    """W[j, g0 + i] <- exp_inline((W[j, g0 + i] - red[2, g0 + i]) * scale) for j < nb, 0 for nb <= j < nbp;
    red[1, g0 + i] = the sum of the new values over j, in key order (i < 16)."""
    for i in range(LANES):
        g = g0 + i
        s = np.float32(0.0)
        for j in range(nb):
            e = exp_inline((W[j, g] - red[2, g]) * scale)
            W[j, g] = e
            s = s + e
        for j in range(nb, nbp):
            W[j, g] = 0.0
        red[1, g] = s


def block_softmax(npq, G, nb, nbp, ST, W, S, off, red, m, l, O, first, scale):
    """The scores of a block, ST [nb, npq G columns] (part p of head g in column p G + g), summed over the parts
    into W [nb, G16] (keys x heads, G16 = G rounded up to 16: whole vectors of heads; the columns past G are
    scratch), the online-softmax update (`blocks.softmax_block`'s: unscaled running max m, sums l, O's rows p G + g
    rescaled when head g's max grew), W <- exp((W - m) * scale), then W^T into S [G16, nbp] (16 x 16 transposes;
    keys nb..nbp zero). red [3, G16]: scratch rows (block max, block sums, the max used)."""
    GP = W.shape[1]
    Dv = O.shape[1]
    for g0 in range(0, GP, LANES):
        sum_parts_max(ST, W, red, nb, G, npq, g0)
    for g in range(G):
        mb = red[0, g]
        if first:
            m[g] = mb
            l[g] = 0.0
        elif mb > m[g]:
            alpha = exp((m[g] - mb) * scale)
            for p in range(3):
                for d in range(Dv):
                    O[p * G + g, d] *= alpha
            l[g] *= alpha
            m[g] = mb
        red[2, g] = m[g]
    for g in range(G, GP):
        red[2, g] = red[0, g]
    for g0 in range(0, GP, LANES):
        exp_rows(W, red, nb, nbp, g0, scale)
    for g in range(G):
        l[g] += red[1, g]
    transpose_rows(W, nbp, GP, off, S)


if JIT:
    from llvmlite import ir as _ir
    from numba.core import cgutils as _cg
    from numba.extending import intrinsic, overload

    from .simd import EXPF_CONSTANTS

    _EXP_MIN, _LOG2E, _LN2_HI, _LN2_LO, _POLY = EXPF_CONSTANTS

    _F32 = _ir.FloatType()
    _VF = _ir.VectorType(_F32, LANES)
    _VI = _ir.VectorType(_ir.IntType(32), LANES)
    _I64 = _ir.IntType(64)

    def _splat(x):
        return _ir.Constant(_VF, [float(x)] * LANES)

    def _vcall(builder, name, *args):
        fn = _cg.get_or_insert_function(builder.module, _ir.FunctionType(_VF, [_VF] * len(args)), name)
        return builder.call(fn, list(args))

    def _exp_ir(builder, x):
        """`simd._expf_body` on 16 lanes (its operations in its order)."""
        x = _vcall(builder, "llvm.maxnum.v16f32", x, _splat(_EXP_MIN))
        n = _vcall(builder, "llvm.floor.v16f32", builder.fadd(builder.fmul(x, _splat(_LOG2E)), _splat(0.5)))
        r = builder.fsub(x, builder.fmul(n, _splat(_LN2_HI)))
        r = builder.fsub(r, builder.fmul(n, _splat(_LN2_LO)))
        p = builder.fadd(builder.fmul(_splat(_POLY[0]), r), _splat(_POLY[1]))
        for c in _POLY[2:]:
            p = builder.fadd(builder.fmul(p, r), _splat(c))
        y = builder.fadd(builder.fadd(builder.fmul(p, builder.fmul(r, r)), r), _splat(1.0))
        e = builder.shl(builder.add(builder.fptosi(n, _VI), _ir.Constant(_VI, [127] * LANES)),
                        _ir.Constant(_VI, [23] * LANES))
        return builder.fmul(y, builder.bitcast(e, _VF))

    def _rows(context, builder, aryty, arr):
        """(data pointer, row length) of a C-contiguous 2-D float32 array."""
        ary = context.make_array(aryty)(context, builder, arr)
        return ary.data, _cg.unpack_tuple(builder, ary.shape, 2)[1]

    def _vptr(builder, base, off):
        return builder.bitcast(builder.gep(base, [off]), _VF.as_pointer())

    def _is_f32_2d(a):
        return isinstance(a, types.Array) and a.dtype == types.float32 and a.ndim == 2 and a.layout == "C"

    def _sum_loop(builder, st, stc, w, wc, red, nb, G, g0, parts):
        mx = _cg.alloca_once_value(builder, _splat(-3.4028234663852886e38))
        with _cg.for_range(builder, nb) as loop:
            row = builder.add(builder.mul(loop.index, stc), g0)
            x = builder.load(_vptr(builder, st, row), align=4)
            if parts == 3:
                x = builder.fadd(x, builder.load(_vptr(builder, st, builder.add(row, G)), align=4))
                x = builder.fadd(x, builder.load(_vptr(builder, st, builder.add(row, builder.add(G, G))), align=4))
            builder.store(x, _vptr(builder, w, builder.add(builder.mul(loop.index, wc), g0)), align=4)
            builder.store(_vcall(builder, "llvm.maxnum.v16f32", builder.load(mx), x), mx)
        builder.store(builder.load(mx), _vptr(builder, red, g0), align=4)

    @intrinsic
    def _sum_parts_max_ir(typingctx, ST, W, red, nb, G, parts, g0):
        if not (_is_f32_2d(ST) and _is_f32_2d(W) and _is_f32_2d(red)):
            return None

        def codegen(context, builder, sig, args):
            st, stc = _rows(context, builder, sig.args[0], args[0])
            w, wc = _rows(context, builder, sig.args[1], args[1])
            red_, _ = _rows(context, builder, sig.args[2], args[2])
            nb, G_, parts_, g0_ = (context.cast(builder, a, t, types.int64) for a, t in zip(args[3:], sig.args[3:]))
            three = builder.icmp_signed("==", parts_, _ir.Constant(_I64, 3))
            with builder.if_else(three) as (sum3, copy1):
                with sum3:
                    _sum_loop(builder, st, stc, w, wc, red_, nb, G_, g0_, 3)
                with copy1:
                    _sum_loop(builder, st, stc, w, wc, red_, nb, G_, g0_, 1)
            return context.get_dummy_value()
        return types.void(ST, W, red, nb, G, parts, g0), codegen

    @intrinsic
    def _exp_rows_ir(typingctx, W, red, nb, nbp, g0, scale):
        if not (_is_f32_2d(W) and _is_f32_2d(red) and scale == types.float32):
            return None

        def codegen(context, builder, sig, args):
            w, wc = _rows(context, builder, sig.args[0], args[0])
            red_, rc = _rows(context, builder, sig.args[1], args[1])
            nb, nbp, g0_ = (context.cast(builder, a, t, types.int64) for a, t in zip(args[2:5], sig.args[2:5]))
            sc = builder.insert_element(_ir.Constant(_VF, None), args[5], _ir.Constant(_ir.IntType(32), 0))
            sc = builder.shuffle_vector(sc, _ir.Constant(_VF, None), _ir.Constant(_VI, [0] * LANES))
            m = builder.load(_vptr(builder, red_, builder.add(builder.add(rc, rc), g0_)), align=4)
            acc = _cg.alloca_once_value(builder, _splat(0.0))
            with _cg.for_range(builder, nb) as loop:
                p = _vptr(builder, w, builder.add(builder.mul(loop.index, wc), g0_))
                e = _exp_ir(builder, builder.fmul(builder.fsub(builder.load(p, align=4), m), sc))
                builder.store(e, p, align=4)
                builder.store(builder.fadd(builder.load(acc), e), acc)
            with _cg.for_range(builder, builder.sub(nbp, nb)) as loop:
                j = builder.add(nb, loop.index)
                builder.store(_splat(0.0), _vptr(builder, w, builder.add(builder.mul(j, wc), g0_)), align=4)
            builder.store(builder.load(acc), _vptr(builder, red_, builder.add(rc, g0_)), align=4)
            return context.get_dummy_value()
        return types.void(W, red, nb, nbp, g0, scale), codegen

    @overload(sum_parts_max, inline="always")
    def _sum_parts_max_ov(ST, W, red, nb, G, parts, g0):
        return lambda ST, W, red, nb, G, parts, g0: _sum_parts_max_ir(ST, W, red, nb, G, parts, g0)

    @overload(exp_rows, inline="always")
    def _exp_rows_ov(W, red, nb, nbp, g0, scale):
        return lambda W, red, nb, nbp, g0, scale: _exp_rows_ir(W, red, nb, nbp, g0, scale)

    block_softmax = njit(cache=True, fastmath=EXP_FLAGS)(block_softmax)
