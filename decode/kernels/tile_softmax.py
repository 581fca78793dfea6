"""The online softmax of a block of scores laid out keys x columns (q heads of a decode query, `amx_decode`; rows
of a tile, `tiled`), the step between the two tile products of the AMX paths, 16 columns to a 512-bit vector in
LLVM IR.

A decode query's scores come off the AMX tiles as ST [keys, columns], column p * G + g holding part p of q head g
(`amx_decode`). Per block the heads' maxima, the weights exp((s - max) * scale) and their sums are taken over
whole rows of heads: each row is one vector op per 16 heads, where numba's own loops over a row of 16 or 32 heads
(runtime trip counts, vectorised 32 lanes at a time) ran mostly in their scalar remainders.

    sum_parts_max(ST, W, red, nb, G, parts, g0)  W[j, g0:g0+16] = the sum over parts of ST's columns (j < nb),
                                                 red[0, g0:g0+16] = their maxima over j
    head_parts(W, red, nb, nbp, G, scale, PA)    the weights exp((W - red[2]) * scale) of 16 keys x 16 heads at a
                                                 time, transposed in registers and split into three exact parts,
                                                 PA's rows p G + g; red[1] = their sums in key order
    block_softmax(npq, G, nb, nbp, ST, W, PA, red, m, l, O, first, scale)
                                                 the whole step: the two above and the running max / sum update
                                                 (O's rows rescaled)

The tiled kernel's blocks (`tiled.attend_tile` where the PV product runs on the tiles: scores ST [keys, rows],
unscaled, straight off the tiles):
    block_max(ST, sc, nb, Rp, mx)                mx[r] = max(mx[r], sc * the column maximum of ST[:nb, r])
    weight_parts(ST, sc, nb, nbp, Rp, Rs, m, l, PA, masked, jlo, jhi)
                                                 the weights exp(fma(ST, sc, -m)) of 16 rows x 16 keys at a time,
                                                 transposed in registers and split into three exact bfloat16 parts
                                                 PA[p, r, j] (the PV tiles' A operand); l += their sums in key order

The exp is `simd.exp_inline`'s polynomial (Cody-Waite reduction, degree 6, arguments clamped at -87), the same
operations lane by lane; each has a plain-Python twin for NUMBA_DISABLE_JIT.
"""
import numpy as np
from numba import njit, types

from .bf16_dot import high, split3
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


def head_parts(W, red, nb, nbp, G, scale, PA):
    """PA[p * G + g, j] = the bfloat16 bits of part p (`bf16_dot.split3`, exact) of the weight exp_inline((W[j, g]
    - red[2, g]) * scale) for g < G, j < nb, and 0 for nb <= j < nbp; red[1, g] = the weights' sum over j in key
    order (g < W's columns: those past G are scratch). W [>= nbp, G16] keys x heads; PA int16 [>= 3 G, >= nbp]."""
    for g in range(W.shape[1]):
        s = np.float32(0.0)
        for j in range(nbp):
            e = np.float32(exp_inline((W[j, g] - red[2, g]) * scale)) if j < nb else np.float32(0.0)
            s = s + e
            if g < G:
                a, b, c = split3(e, np.float32(e).view(np.uint32))
                PA[g, j] = high(a)
                PA[G + g, j] = high(b)
                PA[2 * G + g, j] = high(c)
        red[1, g] = s


def block_softmax(npq, G, nb, nbp, ST, W, PA, red, m, l, O, first, scale):
    """The scores of a block, ST [nb, npq G columns] (part p of head g in column p G + g), summed over the parts
    into W [nb, G16] (keys x heads, G16 = G rounded up to 16: whole vectors of heads; the columns past G are
    scratch), the online-softmax update (`blocks.softmax_block`'s: unscaled running max m, sums l, O's rows p G + g
    rescaled when head g's max grew), then the weights exp((W - m) * scale) split into their three exact parts,
    PA's rows p G + g (`head_parts`: keys nb..nbp zero). red [3, G16]: scratch rows (block max, block sums, the max
    used)."""
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
    head_parts(W, red, nb, nbp, G, scale, PA)
    for g in range(G):
        l[g] += red[1, g]


def block_max(ST, sc, nb, Rp, mx):
    """mx[r] = max(mx[r], sc * max over j < nb of ST[j, r]) for r < Rp (a multiple of 16): the block's scaled
    column maxima (sc > 0 and rounding is monotonic, so the same value as the maximum of the scaled scores)."""
    for r in range(Rp):
        x = ST[0, r]
        for j in range(1, nb):
            x = max(x, ST[j, r])
        mx[r] = max(mx[r], x * sc)


def weight_parts(ST, sc, nb, nbp, Rp, Rs, m, l, PA, masked, jlo, jhi):
    """PA[p, r, j] = the bfloat16 bits of part p (`bf16_dot.split3`: hi, mid, lo by truncation, summing exactly
    to the weight) of the weight exp_inline(fma(ST[j, r], sc, -m[r])) for r < Rp, j < nb (``masked``: only where
    jlo[r] <= j <= jhi[r], else 0; m[r] is the maximum over those keys); 0 for nb <= j < nbp and for Rp <= r < Rs.
    l[r] += the weights, in key order. ST [>= nbp, >= Rs] float32 (keys x rows: a block's scores, unscaled), m
    [>= Rp] the rows' new running maxima (of the scaled scores), PA int16 [3, >= Rs, >= nbp], jlo / jhi int32 [>=
    Rp]; Rp, Rs, nbp multiples of 16. The score scale, the online softmax's exp pass, P's transposition and its
    split in one pass (the PV tiles' A operand)."""
    for r in range(Rs):
        s = l[r] if r < Rp else np.float32(0.0)
        for j in range(nbp):
            e = np.float32(0.0)
            if (r < Rp) & (j < nb):
                d = np.float32(np.float64(ST[j, r]) * np.float64(sc) - np.float64(m[r]))   # ~ the fma
                if not masked:
                    e = exp_inline(d)
                elif (j >= jlo[r]) & (j <= jhi[r]):
                    e = exp_inline(d)
            a, b, c = split3(e, np.float32(e).view(np.uint32))
            PA[0, r, j] = high(a)
            PA[1, r, j] = high(b)
            PA[2, r, j] = high(c)
            s = s + e
        if r < Rp:
            l[r] = s


def run_block_max(ST, sc, nb, Rp, mx):
    """`block_max` called as the tiled kernel calls it (its IR under the JIT): for tests."""
    block_max(ST, sc, nb, Rp, mx)


def run_weight_parts(ST, sc, nb, nbp, Rp, Rs, m, l, PA, masked, jlo, jhi):
    """`weight_parts` called as the tiled kernel calls it (from jitted code: its IR under the JIT): for tests."""
    weight_parts(ST, sc, nb, nbp, Rp, Rs, m, l, PA, masked, jlo, jhi)


if JIT:
    from llvmlite import ir as _ir
    from numba.core import cgutils as _cg
    from numba.extending import intrinsic, overload

    from .simd import EXPF_CONSTANTS
    from .vector_ir import split3_ir, transpose16_ir

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

    _I16V = _ir.VectorType(_ir.IntType(16), LANES)
    _S16 = _ir.Constant(_VI, [16] * LANES)

    def _split_store(builder, x, ptrs):
        """The three exact bfloat16 parts of the 16 lanes of x (`bf16_dot.split3`), stored at ptrs (16 x int16)."""
        for bits, ptr in zip(split3_ir(builder, x), ptrs):
            builder.store(builder.trunc(builder.lshr(bits, _S16), _I16V), ptr, align=2)

    def _is_vec_f32(a):
        return isinstance(a, types.Array) and a.dtype == types.float32 and a.ndim == 1

    def _broadcast(builder, x):
        v = builder.insert_element(_ir.Constant(_VF, None), x, _ir.Constant(_ir.IntType(32), 0))
        return builder.shuffle_vector(v, _ir.Constant(_VF, None), _ir.Constant(_VI, [0] * LANES))

    @intrinsic
    def _block_max_ir(typingctx, ST, sc, nb, Rp, mx):
        if not (_is_f32_2d(ST) and sc == types.float32 and _is_vec_f32(mx)):
            return None

        def codegen(context, builder, sig, args):
            st, stc = _rows(context, builder, sig.args[0], args[0])
            sc = _broadcast(builder, args[1])
            nb, Rp = (context.cast(builder, a, t, types.int64) for a, t in zip(args[2:4], sig.args[2:4]))
            mx_ = context.make_array(sig.args[4])(context, builder, args[4]).data
            sixteen = _ir.Constant(_I64, LANES)
            wide = _ir.Constant(_I64, 8 * LANES)

            def fold(acc, j, r0):
                x = builder.load(_vptr(builder, st, builder.add(builder.mul(j, stc), r0)), align=4)
                builder.store(_vcall(builder, "llvm.maxnum.v16f32", builder.load(acc), x), acc)

            def finish(acc, r0):
                p = _vptr(builder, mx_, r0)
                builder.store(_vcall(builder, "llvm.maxnum.v16f32", builder.load(p, align=4),
                                     builder.fmul(builder.load(acc), sc)), p, align=4)

            # 128 columns at a time (each key row's 512 bytes in turn: a contiguous stream), then 16 at a time
            groups = builder.sdiv(Rp, wide)
            with _cg.for_range(builder, groups) as gl:
                c0 = builder.mul(gl.index, wide)
                accs = [_cg.alloca_once_value(builder, _splat(-3.4028234663852886e38)) for _ in range(8)]
                with _cg.for_range(builder, nb) as loop:
                    for u in range(8):
                        fold(accs[u], loop.index, builder.add(c0, _ir.Constant(_I64, u * LANES)))
                for u in range(8):
                    finish(accs[u], builder.add(c0, _ir.Constant(_I64, u * LANES)))
            done = builder.mul(groups, wide)
            with _cg.for_range(builder, builder.sdiv(builder.sub(Rp, done), sixteen)) as rl:
                r0 = builder.add(done, builder.mul(rl.index, sixteen))
                acc = _cg.alloca_once_value(builder, _splat(-3.4028234663852886e38))
                with _cg.for_range(builder, nb) as loop:
                    fold(acc, loop.index, r0)
                finish(acc, r0)
            return context.get_dummy_value()
        return types.void(ST, sc, nb, Rp, mx), codegen

    @overload(block_max, inline="always")
    def _block_max_ov(ST, sc, nb, Rp, mx):
        if ST.dtype == types.float32:
            return lambda ST, sc, nb, Rp, mx: _block_max_ir(ST, sc, nb, Rp, mx)
        return lambda ST, sc, nb, Rp, mx: None              # other compute dtypes never reach it

    def _is_vec_i32(a):
        return isinstance(a, types.Array) and a.dtype == types.int32 and a.ndim == 1

    def _weights(builder, st, stc, sc, r0, j0, nb, mv, acc, bounds):
        """The 16 x 16 weights of keys j0.. (one vector of rows r0.. each; the exp of fma(score, sc, -max)),
        summed into acc in key order; bounds: None (unmasked) or the rows' (jlo, jhi) vectors."""
        es = []
        for i in range(LANES):
            j = builder.add(j0, _ir.Constant(_I64, i))
            x = builder.load(_vptr(builder, st, builder.add(builder.mul(j, stc), r0)), align=4)
            d = _vcall(builder, "llvm.fma.v16f32", x, sc, builder.fneg(mv))
            keep = builder.icmp_signed("<", j, nb)
            if bounds is not None:          # keys outside may score above m (exp -> inf): selected away
                jv = builder.trunc(j, _ir.IntType(32))
                jv = builder.shuffle_vector(builder.insert_element(_ir.Constant(_VI, None), jv,
                                                                   _ir.Constant(_ir.IntType(32), 0)),
                                            _ir.Constant(_VI, None), _ir.Constant(_VI, [0] * LANES))
                inside = builder.and_(builder.icmp_signed(">=", jv, bounds[0]),
                                      builder.icmp_signed("<=", jv, bounds[1]))
                e = builder.select(inside, _exp_ir(builder, d), _splat(0.0))
                e = builder.select(keep, e, _splat(0.0))
            else:
                e = builder.select(keep, _exp_ir(builder, d), _splat(0.0))
            builder.store(builder.fadd(builder.load(acc), e), acc)
            es.append(e)
        return es

    @intrinsic
    def _weight_parts_ir(typingctx, ST, sc, nb, nbp, Rp, Rs, m, l, PA, masked, jlo, jhi):
        if not (_is_f32_2d(ST) and sc == types.float32 and _is_vec_f32(m) and _is_vec_f32(l) and isinstance(PA, types.Array)
                and PA.dtype == types.int16 and PA.ndim == 3 and PA.layout == "C" and _is_vec_i32(jlo)
                and _is_vec_i32(jhi)):
            return None

        def codegen(context, builder, sig, args):
            st, stc = _rows(context, builder, sig.args[0], args[0])
            sc = _broadcast(builder, args[1])
            nb, nbp, Rp, Rs = (context.cast(builder, a, t, types.int64) for a, t in zip(args[2:6], sig.args[2:6]))
            m_ = context.make_array(sig.args[6])(context, builder, args[6]).data
            l_ = context.make_array(sig.args[7])(context, builder, args[7]).data
            pa = context.make_array(sig.args[8])(context, builder, args[8])
            masked_ = context.cast(builder, args[9], sig.args[9], types.boolean)
            jlo_ = context.make_array(sig.args[10])(context, builder, args[10]).data
            jhi_ = context.make_array(sig.args[11])(context, builder, args[11]).data
            vi_ptr = _VI.as_pointer()
            _, prow, pcol = _cg.unpack_tuple(builder, pa.shape, 3)
            plane = builder.mul(prow, pcol)
            i16p = _I16V.as_pointer()
            sixteen = _ir.Constant(_I64, LANES)

            def parts_at(r, j):
                o = builder.add(builder.mul(r, pcol), j)
                return [builder.bitcast(builder.gep(pa.data, [builder.add(o, builder.mul(_ir.Constant(_I64, p),
                                                                                         plane))]), i16p)
                        for p in range(3)]

            with _cg.for_range(builder, builder.sdiv(Rp, sixteen)) as rl:
                r0 = builder.mul(rl.index, sixteen)
                mv = builder.load(_vptr(builder, m_, r0), align=4)
                acc = _cg.alloca_once_value(builder, builder.load(_vptr(builder, l_, r0), align=4))
                bounds = [builder.load(builder.bitcast(builder.gep(b, [r0]), vi_ptr), align=4) for b in (jlo_, jhi_)]
                with _cg.for_range(builder, builder.sdiv(nbp, sixteen)) as jl:
                    j0 = builder.mul(jl.index, sixteen)
                    with builder.if_else(masked_) as (with_mask, without):
                        with with_mask:
                            es = _weights(builder, st, stc, sc, r0, j0, nb, mv, acc, bounds)
                            for k, t in enumerate(transpose16_ir(builder, es)):
                                _split_store(builder, t, parts_at(builder.add(r0, _ir.Constant(_I64, k)), j0))
                        with without:
                            es = _weights(builder, st, stc, sc, r0, j0, nb, mv, acc, None)
                            for k, t in enumerate(transpose16_ir(builder, es)):
                                _split_store(builder, t, parts_at(builder.add(r0, _ir.Constant(_I64, k)), j0))
                builder.store(builder.load(acc), _vptr(builder, l_, r0), align=4)
            zero = _ir.Constant(_I16V, [0] * LANES)
            with _cg.for_range(builder, builder.sub(Rs, Rp)) as rl:
                r = builder.add(Rp, rl.index)
                with _cg.for_range(builder, builder.sdiv(nbp, sixteen)) as jl:
                    for ptr in parts_at(r, builder.mul(jl.index, sixteen)):
                        builder.store(zero, ptr, align=2)
            return context.get_dummy_value()
        return types.void(ST, sc, nb, nbp, Rp, Rs, m, l, PA, masked, jlo, jhi), codegen

    @overload(weight_parts, inline="always")
    def _weight_parts_ov(ST, sc, nb, nbp, Rp, Rs, m, l, PA, masked, jlo, jhi):
        if ST.dtype == types.float32:
            return lambda ST, sc, nb, nbp, Rp, Rs, m, l, PA, masked, jlo, jhi: _weight_parts_ir(
                ST, sc, nb, nbp, Rp, Rs, m, l, PA, masked, jlo, jhi)
        return lambda ST, sc, nb, nbp, Rp, Rs, m, l, PA, masked, jlo, jhi: None   # other compute dtypes never reach it


    @overload(sum_parts_max, inline="always")
    def _sum_parts_max_ov(ST, W, red, nb, G, parts, g0):
        return lambda ST, W, red, nb, G, parts, g0: _sum_parts_max_ir(ST, W, red, nb, G, parts, g0)

    @intrinsic
    def _head_parts_ir(typingctx, W, red, nb, nbp, G, scale, PA):
        if not (_is_f32_2d(W) and _is_f32_2d(red) and scale == types.float32 and isinstance(PA, types.Array)
                and PA.dtype == types.int16 and PA.ndim == 2 and PA.layout == "C"):
            return None

        def codegen(context, builder, sig, args):
            w, wc = _rows(context, builder, sig.args[0], args[0])
            red_, rc = _rows(context, builder, sig.args[1], args[1])
            nb, nbp, G = (context.cast(builder, a, t, types.int64) for a, t in zip(args[2:5], sig.args[2:5]))
            sc = _broadcast(builder, args[5])
            pa = context.make_array(sig.args[6])(context, builder, args[6])
            pcol = _cg.unpack_tuple(builder, pa.shape, 2)[1]
            i16p = _I16V.as_pointer()
            sixteen = _ir.Constant(_I64, LANES)
            with _cg.for_range(builder, builder.sdiv(wc, sixteen)) as gl:
                g0 = builder.mul(gl.index, sixteen)
                mv = builder.load(_vptr(builder, red_, builder.add(builder.add(rc, rc), g0)), align=4)
                acc = _cg.alloca_once_value(builder, _splat(0.0))
                with _cg.for_range(builder, builder.sdiv(nbp, sixteen)) as jl:
                    j0 = builder.mul(jl.index, sixteen)
                    es = []
                    for i in range(LANES):
                        j = builder.add(j0, _ir.Constant(_I64, i))
                        x = builder.load(_vptr(builder, w, builder.add(builder.mul(j, wc), g0)), align=4)
                        e = _exp_ir(builder, builder.fmul(builder.fsub(x, mv), sc))
                        e = builder.select(builder.icmp_signed("<", j, nb), e, _splat(0.0))
                        builder.store(builder.fadd(builder.load(acc), e), acc)
                        es.append(e)
                    for k, t in enumerate(transpose16_ir(builder, es)):
                        g = builder.add(g0, _ir.Constant(_I64, k))
                        with builder.if_then(builder.icmp_signed("<", g, G)):
                            ptrs = [builder.bitcast(builder.gep(pa.data, [builder.add(builder.mul(
                                builder.add(builder.mul(_ir.Constant(_I64, p), G), g), pcol), j0)]), i16p)
                                for p in range(3)]
                            _split_store(builder, t, ptrs)
                builder.store(builder.load(acc), _vptr(builder, red_, builder.add(rc, g0)), align=4)
            return context.get_dummy_value()
        return types.void(W, red, nb, nbp, G, scale, PA), codegen

    @overload(head_parts, inline="always")
    def _head_parts_ov(W, red, nb, nbp, G, scale, PA):
        return lambda W, red, nb, nbp, G, scale, PA: _head_parts_ir(W, red, nb, nbp, G, scale, PA)

    block_softmax = njit(cache=True, fastmath=EXP_FLAGS)(block_softmax)
    run_weight_parts = njit(cache=True)(run_weight_parts)
    run_block_max = njit(cache=True)(run_block_max)
