"""The single-query kernel over int8 pages (`kvcache.quant`): int8 values and float16 group scales read straight
from the pool, no dequantized copy of it.

Layout (per layer):
    q:        [num_queries, num_q_heads, head_dim]          float32
    k_pages:  [num_pages, num_kv_heads, page_size, head_dim]     int8
    k_scales: [num_pages, num_kv_heads, page_size, ceil(head_dim / 32)]    uint16 (= float16 bits)
    v_pages:  [num_pages, num_kv_heads, page_size, head_dim_v]   int8
    v_scales: [num_pages, num_kv_heads, page_size, ceil(head_dim_v / 32)]  uint16
    out:      [num_queries, num_q_heads, head_dim_v]        float32

Work: a unit is (query, key range [lo, hi)) with *all* kv heads: it walks the range a block (~64 tokens, whole
pages) at a time and, inside each page, every kv head in turn, so a thread streams whole contiguous pages
(the access pattern that read 52-55 GB/s with 2 threads where one head across all pages read 17-37 GB/s,
shared/notes/measured-facts.md). Long ranges are cut into units of `split` tokens (flash-decoding) and merged.

Scales (G = query heads per kv head; a page tile's float16 scales are converted once, `scales_f32`):
    K  G < 4:   `dot4_i8`   scores straight from the int8 rows, the group scale applied once per row group
       G 4-7:   `dot44_i8`  4 heads x 4 rows, each row converted and scaled once for the 4 heads
       G >= 8:  `widen_rows` + `qk`  a 16-row chunk widened once with its scales, reused by all G heads
    V  G < 4:   `pv1_i8`    the V scale folded into the softmax weight (p * scale per row group)
       G 4-7:   `pv4_i8`    4 heads x 32 lanes in registers, each value vector converted and scaled once
       G >= 8:  `widen_rows` + `pv`
Scores, softmax and accumulation are float32, as for float16/float32 storage.
"""
import numpy as np
from numba import njit, prange, types
from numba.extending import intrinsic, overload

from .blocks import combine, load_group, normalise, pv, qk, softmax_block, unit_range
from .simd import FAST, JIT, ld

ONE = np.float32(1.0)  # softmax_block's scale: this kernel scales q up front
GROUP = 32            # values per scale (kvcache.quant.GROUP_SIZE; the kernels import nothing of kvcache)
CHUNK = 16            # rows per widened tile


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

    @intrinsic
    def _pv4_i8(typingctx, S, g, c, vp, st, nsg, t0, t1, acc, ng):
        if not (_is(S, types.float32, 2) and _is(vp, types.int8, 2) and _is(st, types.float32, 1)
                and _is(acc, types.float32, 2)
                and all(isinstance(x, types.Integer) for x in (g, c, nsg, t0, t1, ng))):
            return None

        def codegen(context, builder, sig, args):
            i64 = _ir.IntType(64)
            sa = context.make_array(sig.args[0])(context, builder, args[0])
            va = context.make_array(sig.args[3])(context, builder, args[3])
            ta = context.make_array(sig.args[4])(context, builder, args[4])
            aa = context.make_array(sig.args[8])(context, builder, args[8])
            g_, c_, nsg_, t0_, t1_, ng_ = (context.cast(builder, args[i], sig.args[i], types.int64)
                                           for i in (1, 2, 5, 6, 7, 9))
            scols = _cg.unpack_tuple(builder, sa.shape, 2)[1]
            vcols = _cg.unpack_tuple(builder, va.shape, 2)[1]
            acols = _cg.unpack_tuple(builder, aa.shape, 2)[1]
            fma = _cg.get_or_insert_function(builder.module, _ir.FunctionType(_VF, [_VF, _VF, _VF]),
                                             "llvm.fma.v32f32")
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
        if not (_is(S, types.float32, 2) and _is(vp, types.int8, 2) and _is(st, types.float32, 1)
                and _is(acc, types.float32, 2)
                and all(isinstance(x, types.Integer) for x in (g, c, nsg, t0, t1, ng))):
            return None

        def codegen(context, builder, sig, args):
            """Per 32-lane group: the accumulator in registers over all rows; per row one scalar weight
            p * scale and one FMA per 16 lanes on the converted int8 values."""
            i64 = _ir.IntType(64)
            sa = context.make_array(sig.args[0])(context, builder, args[0])
            va = context.make_array(sig.args[3])(context, builder, args[3])
            ta = context.make_array(sig.args[4])(context, builder, args[4])
            aa = context.make_array(sig.args[8])(context, builder, args[8])
            g_, c_, nsg_, t0_, t1_, ng_ = (context.cast(builder, args[i], sig.args[i], types.int64)
                                           for i in (1, 2, 5, 6, 7, 9))
            scols = _cg.unpack_tuple(builder, sa.shape, 2)[1]
            vcols = _cg.unpack_tuple(builder, va.shape, 2)[1]
            acols = _cg.unpack_tuple(builder, aa.shape, 2)[1]
            fma = _cg.get_or_insert_function(builder.module, _ir.FunctionType(_VF, [_VF, _VF, _VF]),
                                             "llvm.fma.v32f32")
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

    def _butterfly(builder, vs):
        """The lane sums of n <16 x float> vectors (n a power of two <= 16), in order: log2(n) stages of shuffle
        pairs (each halves the lanes per partial sum and doubles the sums per vector), then xor shuffles inside the
        last vector (n - 1 shuffle pairs in all where n horizontal sums would take 4 n)."""
        i32 = _ir.IntType(32)
        n = len(vs)
        width = 8
        while len(vs) > 1:
            lo = [start + i for start in range(0, 16, 2 * width) for i in range(width)]
            hi = [x + width for x in lo]
            lo, hi = lo + [16 + x for x in lo], hi + [16 + x for x in hi]
            vs = [builder.fadd(builder.shuffle_vector(a, b, _ir.Constant(_ir.VectorType(i32, 16), lo)),
                               builder.shuffle_vector(a, b, _ir.Constant(_ir.VectorType(i32, 16), hi)))
                  for a, b in zip(vs[0::2], vs[1::2])]
            width //= 2
        v = vs[0]
        span = 16 // n
        while span > 1:
            half = span // 2
            v = builder.fadd(v, builder.shuffle_vector(v, v, _ir.Constant(_ir.VectorType(i32, 16),
                                                                          [i ^ half for i in range(16)])))
            span = half
        return [builder.extract_element(v, _ir.Constant(i32, k * (16 // n))) for k in range(n)]

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
            sums = _butterfly(builder, [builder.load(sl) for sl in slots])
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
            sums = _butterfly(builder, [builder.load(sl) for sl in slots])
            return context.make_tuple(builder, sig.return_type, sums)

        return sig, codegen

    @overload(dot4_i8)
    def _dot4_i8_ov(qv, kp, t, st, nsg, ng):
        return lambda qv, kp, t, st, nsg, ng: _dot4_i8(qv, kp, t, st, nsg, ng)

    @overload(widen32)
    def _widen32_ov(src, i, dst, j, s):
        return lambda src, i, dst, j, s: _widen32(src, i, dst, j, s)


@njit(cache=True, fastmath=FAST)
def scales_f32(scales, st):
    """st[t * G + g] = float32(scales[t, g]) for a whole page tile (scales [page_size, G] uint16 float16 bits),
    one vectorised pass: converting one scale at a time where it is used chains every conversion to the previous
    one through a register merge (vpinsrw; 48 cycles per 128-value row, measured)."""
    h2f_all(scales, st)


@njit(cache=True, fastmath=FAST)
def widen_rows(src, st, r0, r1, dst):
    """dst[t - r0, d] = src[t, d] * st[t * G + d // 32] for t in [r0, r1): int8 rows and their group scales
    (`scales_f32` of the page tile) -> float32 (exact: 8 x 11 significant bits). src [page_size, D] int8,
    dst [>= r1 - r0, D] float32. Whole groups by `widen32`, a short last group element by element."""
    D = src.shape[1]
    full = D // GROUP
    G = -(-D // GROUP)
    for t in range(r0, r1):
        row = src[t]
        out = dst[t - r0]
        for g in range(full):
            widen32(row, g * GROUP, out, g * GROUP, st[t * G + g])
        if full * GROUP < D:
            s = st[t * G + full]
            for d in range(full * GROUP, D):
                out[d] = np.float32(row[d]) * s


@njit(cache=True, fastmath=FAST)
def pv_folded(S, c0, vp, st, s0, s1, acc):
    """acc[g, d] += sum_t (S[g, c0 + t - s0] * scale[t, d // 32]) * vp[t, d] for t in [s0, s1): the V scale folded
    into the softmax weight (one multiply per row group), the int8 values converted inside the FMA pass
    (`pv1_i8`: each 32-lane group's accumulator in registers over all the rows). S [G, block] float32,
    vp [page_size, Dv] int8, st the page tile's
    scales (`scales_f32`), acc [G, Dv] float32."""
    G = acc.shape[0]
    Dv = acc.shape[1]
    full = Dv // GROUP
    NG = -(-Dv // GROUP)
    for g in range(G):
        ag = acc[g]
        w = S[g]
        if full > 0:
            pv1_i8(S, g, c0, vp, st, NG, s0, s1, acc, full)
        if full * GROUP < Dv:                            # a short last group
            for t in range(s0, s1):
                w0 = w[c0 + t - s0] * st[t * NG + full]
                row = vp[t]
                for d in range(full * GROUP, Dv):
                    ag[d] += w0 * np.float32(row[d])


@njit(cache=True, fastmath=FAST)
def pv_int8(S, c0, vp, st, s0, s1, acc, vt):
    """acc[g, :] += sum_t S[g, c0 + t - s0] * (vp[t] * its group scales) for t in [s0, s1), G >= 4 query heads per
    kv head. G < 8: `pv4_i8` keeps 4 heads x 32 lanes in registers over the rows and converts each int8 value
    vector once per 4 heads (scale applied to the vector, shared by the 4 heads); G >= 8 (every head), leftover
    heads and a short last group: a widened tile per chunk (`widen_rows`, converted once for all heads). S [G, block], vp [page_size, Dv] int8, st the page tile's
    scales, acc [G, Dv], vt [CHUNK, Dv] float32 scratch."""
    G = acc.shape[0]
    Dv = acc.shape[1]
    full = Dv // GROUP
    NG = -(-Dv // GROUP)
    RC = vt.shape[0]
    if G >= 8 or full == 0:             # from 8 heads on, one widened tile per chunk converts less (measured)
        r = s0
        while r < s1:
            r1 = min(s1, r + RC)
            widen_rows(vp, st, r, r1, vt)
            pv(S, c0 + r - s0, vt, 0, r1 - r, acc)
            r = r1
        return
    g4 = G - G % 4
    if full > 0:
        for g in range(0, g4, 4):
            pv4_i8(S, g, c0, vp, st, NG, s0, s1, acc, full)
    if g4 < G or full < NG:
        r = s0
        while r < s1:
            r1 = min(s1, r + RC)
            widen_rows(vp, st, r, r1, vt)
            for g in range(G):
                w = S[g]
                ag = acc[g]
                d0 = 0 if g >= g4 else full * GROUP
                for t in range(r, r1):
                    w0 = w[c0 + t - s0]
                    row = vt[t - r]
                    for d in range(d0, Dv):
                        ag[d] += w0 * row[d]
            r = r1


@njit(cache=True, fastmath=FAST)
def qk4_int8(qs, kp, st, s0, s1, S, c0, kt):
    """S[g, c0 + t - s0] = qs[g] . (kp[t] * its group scales) for t in [s0, s1), for 4 to 7 query heads per kv
    head: blocks of 4 heads x 4 rows straight from the int8 rows (`dot44_i8`: each row converted and scaled once
    per 4 heads, 16 dot products reduced by one butterfly); leftover rows and heads through a widened tile
    (`widen_rows` + `qk`), a short last group element by element. kt [CHUNK, D] float32 scratch."""
    G = qs.shape[0]
    D = qs.shape[1]
    full = D // GROUP
    NG = -(-D // GROUP)
    g4 = G - G % 4
    t4 = s0 + (s1 - s0) // 4 * 4
    for g in range(0, g4, 4):
        S0 = S[g]
        S1 = S[g + 1]
        S2 = S[g + 2]
        S3 = S[g + 3]
        c = c0
        for t in range(s0, t4, 4):
            r = dot44_i8(qs, g, kp, t, st, NG, full)
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
            c += 4
    if full < NG:                                        # the short last group of the block rows
        for g in range(g4):
            qg = qs[g]
            for t in range(s0, t4):
                row = kp[t]
                part = qg[0] - qg[0]
                for d in range(full * GROUP, D):
                    part += qg[d] * np.float32(row[d])
                S[g, c0 + t - s0] += part * st[t * NG + full]
    rest_rows = t4 < s1
    if g4 < G or rest_rows:                              # leftover heads (all rows), leftover rows (all heads)
        RC = kt.shape[0]
        r = s0 if g4 < G else t4
        while r < s1:
            r1 = min(s1, r + RC)
            widen_rows(kp, st, r, r1, kt)
            for g in range(G):
                if g < g4 and r1 <= t4:
                    continue
                qg = qs[g]
                for t in range(max(r, t4) if g < g4 else r, r1):
                    row = kt[t - r]
                    a = qg[0] - qg[0]
                    for d in range(D):
                        a += qg[d] * row[d]
                    S[g, c0 + t - s0] = a
            r = r1


@njit(cache=True, fastmath=FAST)
def qk_int8(qs, kp, st, s0, s1, S, c0):
    """S[g, c0 + t - s0] = qs[g] . (kp[t] * its group scales) for t in [s0, s1), straight from the int8 rows
    (`dot4_i8`: 4 rows per pass, the scale applied once per row group; for G < 4 query heads per kv head, where
    widening a tile first would be re-read by too few heads). qs [G, D], kp [page_size, D] int8, st the page
    tile's scales (`scales_f32`), S [G, block]."""
    G = qs.shape[0]
    D = qs.shape[1]
    full = D // GROUP
    NG = -(-D // GROUP)
    for g in range(G):
        qg = qs[g]
        Sg = S[g]
        t = s0
        c = c0
        while t + 4 <= s1:
            r = dot4_i8(qg, kp, t, st, NG, full)
            Sg[c] = r[0]
            Sg[c + 1] = r[1]
            Sg[c + 2] = r[2]
            Sg[c + 3] = r[3]
            t += 4
            c += 4
        while t < s1:
            row = kp[t]
            a = qg[0] - qg[0]
            for k in range(full):
                part = qg[0] - qg[0]
                for d in range(k * GROUP, k * GROUP + GROUP):
                    part += qg[d] * np.float32(row[d])
                a += part * st[t * NG + k]
            Sg[c] = a
            t += 1
            c += 1
        if full < NG:                                    # a short last group
            for t in range(s0, s1):
                row = kp[t]
                part = qg[0] - qg[0]
                for d in range(full * GROUP, D):
                    part += qg[d] * np.float32(row[d])
                Sg[c0 + t - s0] += part * st[t * NG + full]


@njit(cache=True, fastmath=FAST)
def attend_range_int8(qs, kq, ks, vq, vs, pages, lo, hi, block, S, m, l, acc, kt, vt, kst, vst):
    """Unnormalised attention of every query head over positions [lo, hi) of one sequence (`pages`: its row of
    the page table), all kv heads. qs [Hkv, G, D] (scaled queries), S [Hkv, G, block], m, l [Hkv, G],
    acc [Hkv, G, Dv]; kt [CHUNK, D], vt [CHUNK, Dv], kst [page_size * Gk], vst [page_size * Gv] float32 scratch."""
    P = kq.shape[2]
    Hkv = kq.shape[1]
    G = qs.shape[1]
    D = kq.shape[3]
    RC = kt.shape[0]
    first = True
    b0 = lo
    while b0 < hi:
        b1 = min(hi, (b0 // block + 1) * block)
        c = 0
        t = b0
        while t < b1:                                   # scores: page by page, every kv head of the page
            j = t // P
            s0 = t - j * P
            s1 = min(P, b1 - j * P)
            page = pages[j]
            for h in range(Hkv):
                kp = kq[page, h]
                scales_f32(ks[page, h], kst)
                Sh = S[h]
                qh = qs[h]
                if G < 4:
                    qk_int8(qh, kp, kst, s0, s1, Sh, c)
                    continue
                if G < 8 and D >= GROUP:
                    qk4_int8(qh, kp, kst, s0, s1, Sh, c, kt)
                    continue
                r = s0
                while r < s1:
                    r1 = min(s1, r + RC)
                    widen_rows(kp, kst, r, r1, kt)
                    qk(qh, kt, 0, r1 - r, Sh, c + r - s0)
                    r = r1
            c += s1 - s0
            t += s1 - s0
        for h in range(Hkv):
            softmax_block(S[h], c, m[h], l[h], acc[h], first, ONE)   # scores pre-scaled (load_group)
        first = False
        c = 0
        t = b0
        while t < b1:                                   # values, in the same order
            j = t // P
            s0 = t - j * P
            s1 = min(P, b1 - j * P)
            page = pages[j]
            for h in range(Hkv):
                scales_f32(vs[page, h], vst)
                if G < 4:
                    pv_folded(S[h], c, vq[page, h], vst, s0, s1, acc[h])
                else:
                    pv_int8(S[h], c, vq[page, h], vst, s0, s1, acc[h], vt)
            c += s1 - s0
            t += s1 - s0
        b0 = b1


@njit(cache=True, fastmath=FAST)
def int8_units(q, kq, ks, vq, vs, page_indices, page_indptr, query_seq, query_pos, window, scale, out,
               units, u0, u1, block, wm, wl, wacc):
    """Process units u0..u1-1 with one set of scratch buffers. units.shape[0] == 0 (serial): unit u is query u
    over its whole range, normalised into out. Otherwise units[u] = (query, lo, hi, slot): slot < 0 normalises
    into out, else the partial (max, sum, acc) goes to workspace slot ``slot`` (wm, wl [W, Hkv, G], wacc
    [W, Hkv, G, Dv])."""
    Hkv = kq.shape[1]
    G = q.shape[1] // Hkv
    D = q.shape[2]
    Dv = vq.shape[3]
    RC = min(CHUNK, kq.shape[2])
    qs = np.empty((Hkv, G, D), np.float32)
    S = np.empty((Hkv, G, block), np.float32)
    m = np.empty((Hkv, G), np.float32)
    l = np.empty((Hkv, G), np.float32)
    acc = np.empty((Hkv, G, Dv), np.float32)
    kt = np.empty((RC, D), np.float32)
    vt = np.empty((RC, Dv), np.float32)
    kst = np.empty(ks.shape[2] * ks.shape[3], np.float32)
    vst = np.empty(vs.shape[2] * vs.shape[3], np.float32)
    for u in range(u0, u1):
        i, lo, hi, w = unit_range(units, u, query_pos, window)
        s = query_seq[i]
        pages = page_indices[page_indptr[s]:page_indptr[s + 1]]
        for h in range(Hkv):
            load_group(q, i, h, scale, qs[h])
        if w < 0:
            attend_range_int8(qs, kq, ks, vq, vs, pages, lo, hi, block, S, m, l, acc, kt, vt, kst, vst)
            for h in range(Hkv):
                normalise(acc[h], l[h], out[i, h * G:(h + 1) * G])
        else:
            attend_range_int8(qs, kq, ks, vq, vs, pages, lo, hi, block, S, wm[w], wl[w], wacc[w], kt, vt, kst,
                              vst)


@njit(cache=True, fastmath=FAST)
def combine_int8(out, items, a, b, wm, wl, wacc):
    """Merge the split partials of items a..b-1 into out (all query heads of each item's query)."""
    W = wm.shape[0]
    Hq = wm.shape[1] * wm.shape[2]
    m2 = wm.reshape((W, Hq))
    l2 = wl.reshape((W, Hq))
    acc2 = wacc.reshape((W, Hq, wacc.shape[3]))
    for it in range(a, b):
        combine(m2, l2, acc2, items[it, 1], items[it, 2], out[items[it, 0]])


@njit(parallel=True, cache=True, fastmath=FAST)
def int8_parallel(q, kq, ks, vq, vs, page_indices, page_indptr, query_seq, query_pos, window, scale, out,
                  units, bounds, items, num_slots, block):
    """The units of `decode.plan_units` on all threads (one prange iteration per chunk of units, each owning its units'
    outputs and workspace slots), then the split ranges are merged (prange over items when there are enough)."""
    Hkv = kq.shape[1]
    G = q.shape[1] // Hkv
    Dv = vq.shape[3]
    wm = np.empty((num_slots, Hkv, G), np.float32)
    wl = np.empty((num_slots, Hkv, G), np.float32)
    wacc = np.empty((num_slots, Hkv, G, Dv), np.float32)
    nch = bounds.shape[0] - 1
    for ck in prange(nch):
        int8_units(q, kq, ks, vq, vs, page_indices, page_indptr, query_seq, query_pos, window, scale, out,
                   units, bounds[ck], bounds[ck + 1], block, wm, wl, wacc)
    n = items.shape[0]
    if n >= nch and num_slots * Hkv * G * Dv >= 1 << 16:
        for ck in prange(nch):
            combine_int8(out, items, ck * n // nch, (ck + 1) * n // nch, wm, wl, wacc)
    else:
        combine_int8(out, items, 0, n, wm, wl, wacc)
    return out
