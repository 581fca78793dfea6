"""32-lane int8 micro-kernels for the int8 kernels (the int8 row loader, `decode.kernels.int8_rows`), in LLVM IR,
each with a plain-NumPy twin used under NUMBA_DISABLE_JIT:

    widen32   one scale group of int8 values -> float32 times its scale
    h2f_all   a page tile's float16 scales -> float32 in one vectorised pass
    pv4_i8    4 heads x 32 accumulator lanes over value rows (each row converted and scaled once for 4 heads)
    pv1_i8    one head, the V scale folded into the softmax weight
    dot44_i8  4 heads x 4 key rows of dot products (each row converted and scaled once per 4 heads)
    dot4_i8   one head x 4 key rows, the group scale applied once per row group

Layouts in each docstring (int8 rows [page_size, width], scales as float32 [page_size * groups] per page tile).
"""
import numpy as np
from numba import types
from numba.extending import intrinsic, overload

from .simd import JIT

if JIT:
    from .vector_ir import reduce_many_ir, widen_halves_ir

GROUP = 32            # values per scale (kvcache.quant.GROUP_SIZE; the kernels import nothing of kvcache)


# --------------------------------------------------------------------------------------------------------------
# 32-lane int8 micro-kernels in LLVM IR (one scale group): LLVM does not vectorise a 32-iteration loop itself
# (a constant trip count is unrolled completely and left scalar; a run-time one of 32 falls into the scalar
# remainder of a 64-wide vector loop). Plain-NumPy twins for NUMBA_DISABLE_JIT.
# --------------------------------------------------------------------------------------------------------------
def widen32(src, i, dst, j, s):
    """dst[j:j+32] = float32(src[i:i+32]) * s: src 1-D int8, dst 1-D float32, s float32."""
    dst[j:j + GROUP] = src[i:i + GROUP].astype(np.float32) * np.float32(s)


def h2f_all(src, dst):
    """dst[:n] = float32(float16 bits of src) for every element of the C-contiguous 2-D uint16 src (n its size)."""
    n = src.size
    dst[:n] = src.reshape(n).view(np.float16).astype(np.float32)


def pv4_i8(S, g, c, vp, st, nsg, t0, t1, acc, ng):
    """acc[g + a, :ng*32] += sum_t S[g + a, c + t - t0] * (vp[t, :ng*32] * its group scales) over t in [t0, t1),
    a < 4: S [G, block] float32, vp [page_size, Dv] int8, st 1-D float32 page-tile scales (row stride nsg),
    acc [G, Dv] float32."""
    n = ng * GROUP
    for t in range(t0, t1):
        row = vp[t, :n].astype(np.float32) * np.repeat(st[t * nsg:t * nsg + ng], GROUP)
        for a in range(4):
            acc[g + a, :n] += S[g + a, c + t - t0] * row


def pv1_i8(S, g, c, vp, st, nsg, t0, t1, acc, ng):
    """acc[g, :ng*32] += sum_t (S[g, c + t - t0] * scale[t, d // 32]) * vp[t, :ng*32] over t in [t0, t1): the V
    scale folded into the softmax weight, one head. Arguments as `pv4_i8`."""
    n = ng * GROUP
    for t in range(t0, t1):
        w = np.repeat(S[g, c + t - t0] * st[t * nsg:t * nsg + ng], GROUP)
        acc[g, :n] += w * vp[t, :n].astype(np.float32)


def dot44_i8(qs, g, kp, t, st, nsg, ng):
    """16 scores qs[g + a] . (kp[t + b] * its group scales) over the first ng groups (a, b < 4), a-major:
    qs [G, D] float32, kp [page_size, D] int8, st 1-D float32 page-tile scales (row stride nsg)."""
    n = ng * GROUP
    rows = [kp[t + b, :n].astype(np.float32) * np.repeat(st[(t + b) * nsg:(t + b) * nsg + ng], GROUP)
            for b in range(4)]
    return tuple(np.float32(np.dot(qs[g + a, :n], rows[b])) for a in range(4) for b in range(4))


def dot4_i8(qv, kp, t, st, nsg, ng):
    """4 scores sum_d qv[d] * kp[t + r, d] * st[(t + r) * nsg + d // 32] over the first ng groups of 32 (r < 4):
    qv 1-D float32, kp 2-D int8, st 1-D float32 (the page tile's scales, `scales_f32`)."""
    n = ng * GROUP
    out = []
    for r in range(4):
        scale = np.repeat(st[(t + r) * nsg:(t + r) * nsg + ng], GROUP)
        out.append(np.float32(np.dot(qv[:n], kp[t + r, :n].astype(np.float32) * scale)))
    return tuple(out)


if JIT:
    from llvmlite import ir as _ir
    from numba.core import cgutils as _cg

    _V16 = _ir.VectorType(_ir.FloatType(), 16)
    _V16I8 = _ir.VectorType(_ir.IntType(8), 16)
    _V16I32 = _ir.VectorType(_ir.IntType(32), 16)
    _V8 = _ir.VectorType(_ir.IntType(8), GROUP)
    _V32 = _ir.VectorType(_ir.IntType(32), GROUP)
    _VF = _ir.VectorType(_ir.FloatType(), GROUP)

    def _splat(builder, x):
        v = builder.insert_element(_ir.Constant(_VF, _ir.Undefined), x, _ir.Constant(_ir.IntType(32), 0))
        return builder.shuffle_vector(v, v, _ir.Constant(_V32, [0] * GROUP))

    def _load_i8(builder, ptr):
        x = builder.load(builder.bitcast(ptr, _V8.as_pointer()), align=1)
        return builder.sitofp(builder.sext(x, _V32), _VF)

    def _is(ty, dtype, ndim):
        return isinstance(ty, types.Array) and ty.dtype == dtype and ty.ndim == ndim and ty.layout == "C"

    @intrinsic
    def _widen32(typingctx, src, i, dst, j, s):
        if not (_is(src, types.int8, 1) and _is(dst, types.float32, 1) and s == types.float32
                and isinstance(i, types.Integer) and isinstance(j, types.Integer)):
            return None

        def codegen(context, builder, sig, args):
            a = context.make_array(sig.args[0])(context, builder, args[0])
            d = context.make_array(sig.args[2])(context, builder, args[2])
            x = builder.fmul(_load_i8(builder, builder.gep(a.data, [args[1]])), _splat(builder, args[4]))
            builder.store(x, builder.bitcast(builder.gep(d.data, [args[3]]), _VF.as_pointer()), align=4)
            return context.get_dummy_value()

        return types.void(src, i, dst, j, s), codegen

    _V16H = _ir.VectorType(_ir.IntType(16), 16)
    _V16F = _ir.VectorType(_ir.FloatType(), 16)

    @intrinsic
    def _h2f_all(typingctx, src, dst):
        if not (_is(src, types.uint16, 2) and _is(dst, types.float32, 1)):
            return None

        def codegen(context, builder, sig, args):
            sa = context.make_array(sig.args[0])(context, builder, args[0])
            da = context.make_array(sig.args[1])(context, builder, args[1])
            i64 = _ir.IntType(64)
            rows, cols = _cg.unpack_tuple(builder, sa.shape, 2)
            n = builder.mul(rows, cols)
            vec_end = builder.and_(n, _ir.Constant(i64, -16))
            with _cg.for_range_slice(builder, _ir.Constant(i64, 0), vec_end, _ir.Constant(i64, 16)) as (i, _):
                x = builder.load(builder.bitcast(builder.gep(sa.data, [i]), _V16H.as_pointer()), align=2)
                y = builder.fpext(builder.bitcast(x, _ir.VectorType(_ir.HalfType(), 16)), _V16F)
                builder.store(y, builder.bitcast(builder.gep(da.data, [i]), _V16F.as_pointer()), align=4)
            with _cg.for_range_slice(builder, vec_end, n, _ir.Constant(i64, 1)) as (i, _):
                x = builder.load(builder.gep(sa.data, [i]))
                y = builder.fpext(builder.bitcast(x, _ir.HalfType()), _ir.FloatType())
                builder.store(y, builder.gep(da.data, [i]))
            return context.get_dummy_value()

        return types.void(src, dst), codegen

    @overload(h2f_all)
    def _h2f_all_ov(src, dst):
        return lambda src, dst: _h2f_all(src, dst)

    def _pv_types(S, g, c, vp, st, nsg, t0, t1, acc, ng):
        return (_is(S, types.float32, 2) and _is(vp, types.int8, 2) and _is(st, types.float32, 1)
                and _is(acc, types.float32, 2) and all(isinstance(x, types.Integer) for x in (g, c, nsg, t0, t1, ng)))

    def _pv_args(context, builder, sig, args):
        """The PV blocks' operands: arrays S, vp, st, acc; the integers g, c, nsg, t0, t1, ng as int64; the row
        lengths of S, vp and acc; llvm.fma on 32 floats."""
        arrays = [context.make_array(sig.args[i])(context, builder, args[i]) for i in (0, 3, 4, 8)]
        ints = tuple(context.cast(builder, args[i], sig.args[i], types.int64) for i in (1, 2, 5, 6, 7, 9))
        cols = tuple(_cg.unpack_tuple(builder, arrays[i].shape, 2)[1] for i in (0, 1, 3))
        fma = _cg.get_or_insert_function(builder.module, _ir.FunctionType(_VF, [_VF, _VF, _VF]), "llvm.fma.v32f32")
        return (*arrays, ints, cols, fma)

    @intrinsic
    def _pv4_i8(typingctx, S, g, c, vp, st, nsg, t0, t1, acc, ng):
        if not _pv_types(S, g, c, vp, st, nsg, t0, t1, acc, ng):
            return None

        def codegen(context, builder, sig, args):
            i64 = _ir.IntType(64)
            sa, va, ta, aa, (g_, c_, nsg_, t0_, t1_, ng_), (scols, vcols, acols), fma = _pv_args(context, builder,
                                                                                                  sig, args)
            heads = [builder.add(g_, _ir.Constant(i64, a)) for a in range(4)]
            slots = [_cg.alloca_once(builder, _VF) for _ in range(4)]
            with _cg.for_range_slice(builder, _ir.Constant(i64, 0), ng_, _ir.Constant(i64, 1)) as (grp, _):
                d = builder.mul(grp, _ir.Constant(i64, GROUP))
                aptrs = [builder.bitcast(builder.gep(aa.data, [builder.add(builder.mul(h, acols), d)]),
                                         _VF.as_pointer()) for h in heads]
                for sl, p in zip(slots, aptrs):
                    builder.store(builder.load(p, align=4), sl)
                with _cg.for_range_slice(builder, t0_, t1_, _ir.Constant(i64, 1)) as (t, _):
                    x = _load_i8(builder, builder.gep(va.data, [builder.add(builder.mul(t, vcols), d)]))
                    scale = builder.load(builder.gep(ta.data, [builder.add(builder.mul(t, nsg_), grp)]))
                    x = builder.fmul(x, _splat(builder, scale))
                    col = builder.add(c_, builder.sub(t, t0_))
                    for h, sl in zip(heads, slots):
                        w = builder.load(builder.gep(sa.data, [builder.add(builder.mul(h, scols), col)]))
                        builder.store(builder.call(fma, [_splat(builder, w), x, builder.load(sl)]), sl)
                for sl, p in zip(slots, aptrs):
                    builder.store(builder.load(sl), p, align=4)
            return context.get_dummy_value()

        return types.void(S, g, c, vp, st, nsg, t0, t1, acc, ng), codegen

    @intrinsic
    def _pv1_i8(typingctx, S, g, c, vp, st, nsg, t0, t1, acc, ng):
        if not _pv_types(S, g, c, vp, st, nsg, t0, t1, acc, ng):
            return None

        def codegen(context, builder, sig, args):
            """Per 32-lane group: the accumulator in registers over all rows; per row one scalar weight
            p * scale and one FMA per 16 lanes on the converted int8 values."""
            i64 = _ir.IntType(64)
            sa, va, ta, aa, (g_, c_, nsg_, t0_, t1_, ng_), (scols, vcols, acols), fma = _pv_args(context, builder,
                                                                                                  sig, args)
            srow = builder.gep(sa.data, [builder.sub(builder.add(builder.mul(g_, scols), c_), t0_)])
            slot = _cg.alloca_once(builder, _VF)
            with _cg.for_range_slice(builder, _ir.Constant(i64, 0), ng_, _ir.Constant(i64, 1)) as (grp, _):
                d = builder.mul(grp, _ir.Constant(i64, GROUP))
                ap = builder.bitcast(builder.gep(aa.data, [builder.add(builder.mul(g_, acols), d)]), _VF.as_pointer())
                builder.store(builder.load(ap, align=4), slot)
                with _cg.for_range_slice(builder, t0_, t1_, _ir.Constant(i64, 1)) as (t, _):
                    x = _load_i8(builder, builder.gep(va.data, [builder.add(builder.mul(t, vcols), d)]))
                    scale = builder.load(builder.gep(ta.data, [builder.add(builder.mul(t, nsg_), grp)]))
                    w = builder.fmul(builder.load(builder.gep(srow, [t])), scale)
                    builder.store(builder.call(fma, [_splat(builder, w), x, builder.load(slot)]), slot)
                builder.store(builder.load(slot), ap, align=4)
            return context.get_dummy_value()

        return types.void(S, g, c, vp, st, nsg, t0, t1, acc, ng), codegen

    @overload(pv1_i8)
    def _pv1_i8_ov(S, g, c, vp, st, nsg, t0, t1, acc, ng):
        return lambda S, g, c, vp, st, nsg, t0, t1, acc, ng: _pv1_i8(S, g, c, vp, st, nsg, t0, t1, acc, ng)

    @overload(pv4_i8)
    def _pv4_i8_ov(S, g, c, vp, st, nsg, t0, t1, acc, ng):
        return lambda S, g, c, vp, st, nsg, t0, t1, acc, ng: _pv4_i8(S, g, c, vp, st, nsg, t0, t1, acc, ng)

    @intrinsic
    def _dot44_i8(typingctx, qs, g, kp, t, st, nsg, ng):
        if not (_is(qs, types.float32, 2) and _is(kp, types.int8, 2) and _is(st, types.float32, 1)
                and all(isinstance(x, types.Integer) for x in (g, t, nsg, ng))):
            return None
        sig = types.UniTuple(types.float32, 16)(qs, g, kp, t, st, nsg, ng)

        def codegen(context, builder, sig, args):
            i64 = _ir.IntType(64)
            qa = context.make_array(sig.args[0])(context, builder, args[0])
            ka = context.make_array(sig.args[2])(context, builder, args[2])
            sa = context.make_array(sig.args[4])(context, builder, args[4])
            g_, t_, nsg_, ng_ = (context.cast(builder, args[i], sig.args[i], types.int64) for i in (1, 3, 5, 6))
            qcols = _cg.unpack_tuple(builder, qa.shape, 2)[1]
            kcols = _cg.unpack_tuple(builder, ka.shape, 2)[1]
            fma = _cg.get_or_insert_function(builder.module, _ir.FunctionType(_V16, [_V16, _V16, _V16]),
                                             "llvm.fma.v16f32")
            qrows = [builder.gep(qa.data, [builder.mul(builder.add(g_, _ir.Constant(i64, a)), qcols)])
                     for a in range(4)]
            krows = [builder.add(t_, _ir.Constant(i64, b)) for b in range(4)]
            kptrs = [builder.gep(ka.data, [builder.mul(r, kcols)]) for r in krows]
            slots = [_cg.alloca_once_value(builder, _ir.Constant(_V16, [0.0] * 16)) for _ in range(16)]
            with _cg.for_range_slice(builder, _ir.Constant(i64, 0), ng_, _ir.Constant(i64, 1)) as (grp, _):
                scales = []
                for r in krows:
                    x = builder.load(builder.gep(sa.data, [builder.add(builder.mul(r, nsg_), grp)]))
                    v = builder.insert_element(_ir.Constant(_V16, _ir.Undefined), x, _ir.Constant(_ir.IntType(32), 0))
                    scales.append(builder.shuffle_vector(v, v, _ir.Constant(_V16I32, [0] * 16)))
                for half in range(2):
                    d = builder.add(builder.mul(grp, _ir.Constant(i64, GROUP)), _ir.Constant(i64, 16 * half))
                    qv = [builder.load(builder.bitcast(builder.gep(p, [d]), _V16.as_pointer()), align=4)
                          for p in qrows]
                    kv = []
                    for p, sc in zip(kptrs, scales):
                        x = builder.load(builder.bitcast(builder.gep(p, [d]), _V16I8.as_pointer()), align=1)
                        kv.append(builder.fmul(builder.sitofp(builder.sext(x, _V16I32), _V16), sc))
                    for a in range(4):
                        for b in range(4):
                            sl = slots[a * 4 + b]
                            builder.store(builder.call(fma, [qv[a], kv[b], builder.load(sl)]), sl)
            accs = [widen_halves_ir(builder, builder.load(sl)) for sl in slots]       # lane sums in float64
            sums = [builder.fptrunc(x, _ir.FloatType()) for x in reduce_many_ir(builder, accs, 8)]
            return context.make_tuple(builder, sig.return_type, sums)

        return sig, codegen

    @overload(dot44_i8)
    def _dot44_i8_ov(qs, g, kp, t, st, nsg, ng):
        return lambda qs, g, kp, t, st, nsg, ng: _dot44_i8(qs, g, kp, t, st, nsg, ng)

    @intrinsic
    def _dot4_i8(typingctx, qv, kp, t, st, nsg, ng):
        if not (_is(qv, types.float32, 1) and _is(kp, types.int8, 2) and _is(st, types.float32, 1)
                and all(isinstance(x, types.Integer) for x in (t, nsg, ng))):
            return None
        sig = types.UniTuple(types.float32, 4)(qv, kp, t, st, nsg, ng)

        def codegen(context, builder, sig, args):
            """Per group and row: the unscaled 32-lane partial (one multiply, one FMA over the two halves), then
            one FMA with the group scale into the row's 16-lane accumulator; 4 rows reduced by one butterfly."""
            i64 = _ir.IntType(64)
            qa = context.make_array(sig.args[0])(context, builder, args[0])
            ka = context.make_array(sig.args[1])(context, builder, args[1])
            sa = context.make_array(sig.args[3])(context, builder, args[3])
            t_, nsg_, ng_ = (context.cast(builder, args[i], sig.args[i], types.int64) for i in (2, 4, 5))
            cols = _cg.unpack_tuple(builder, ka.shape, 2)[1]
            fma = _cg.get_or_insert_function(builder.module, _ir.FunctionType(_V16, [_V16, _V16, _V16]),
                                             "llvm.fma.v16f32")
            rows = [builder.add(t_, _ir.Constant(i64, r)) for r in range(4)]
            kptrs = [builder.gep(ka.data, [builder.mul(r, cols)]) for r in rows]
            slots = [_cg.alloca_once_value(builder, _ir.Constant(_V16, [0.0] * 16)) for _ in range(4)]
            with _cg.for_range_slice(builder, _ir.Constant(i64, 0), ng_, _ir.Constant(i64, 1)) as (grp, _):
                d0 = builder.mul(grp, _ir.Constant(i64, GROUP))
                d1 = builder.add(d0, _ir.Constant(i64, 16))
                q0 = builder.load(builder.bitcast(builder.gep(qa.data, [d0]), _V16.as_pointer()), align=4)
                q1 = builder.load(builder.bitcast(builder.gep(qa.data, [d1]), _V16.as_pointer()), align=4)
                for r, p, sl in zip(rows, kptrs, slots):
                    k0, k1 = (builder.sitofp(builder.sext(builder.load(builder.bitcast(builder.gep(p, [d]),
                                                                                          _V16I8.as_pointer()),
                                                                         align=1), _V16I32), _V16)
                              for d in (d0, d1))
                    part = builder.call(fma, [k1, q1, builder.fmul(k0, q0)])
                    x = builder.load(builder.gep(sa.data, [builder.add(builder.mul(r, nsg_), grp)]))
                    v = builder.insert_element(_ir.Constant(_V16, _ir.Undefined), x, _ir.Constant(_ir.IntType(32), 0))
                    scale = builder.shuffle_vector(v, v, _ir.Constant(_V16I32, [0] * 16))
                    builder.store(builder.call(fma, [part, scale, builder.load(sl)]), sl)
            accs = [widen_halves_ir(builder, builder.load(sl)) for sl in slots]       # lane sums in float64
            sums = [builder.fptrunc(x, _ir.FloatType()) for x in reduce_many_ir(builder, accs, 8)]
            return context.make_tuple(builder, sig.return_type, sums)

        return sig, codegen

    @overload(dot4_i8)
    def _dot4_i8_ov(qv, kp, t, st, nsg, ng):
        return lambda qv, kp, t, st, nsg, ng: _dot4_i8(qv, kp, t, st, nsg, ng)

    @overload(widen32)
    def _widen32_ov(src, i, dst, j, s):
        return lambda src, i, dst, j, s: _widen32(src, i, dst, j, s)
