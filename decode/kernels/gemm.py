"""Register-blocked micro-GEMMs for the multi-query kernel: a strip of C rows, accumulated over k in blocks of
6 (then 4) rows x `nv` vectors, each B row (a contiguous vector strip) loaded once per block of A rows and A's
elements broadcast.

    gemm_strip(A, a_rs, a_cs, i0, i1, B, c0, C, nk, nv, init, rsc, sc, mx, imax)
        C[i, c0 : c0 + nv * LANES] (=|+=) sum_{k < nk} A_flat[i * a_rs + k * a_cs] * B[k, c0 : ...]
        for i0 <= i < i1 (i1 - i0 a multiple of MR = 4). init: flags, FRESH starts from zero, else from C;
        RESCALE multiplies C's old row i by rsc[i] first; SCALE multiplies the finished C by sc; COLMAX folds
        the finished rows i < imax into the column maxima mx[c0 : ...] (rsc, mx: 1-D arrays of C's dtype).
    gemm4(A, a_rs, a_cs, i0, B, c0, C, nk, nv, init, rsc, sc, mx, imax)     the same for the 4 rows i0..i0+3
    gemm_strip_bf(A, a_rs, i0, i1, B, c0, C, nk, nv, init, sc, mx, imax)     a fresh C over bfloat16 pairs
        (`vdpbf16ps`: A's rows and B's pairs int16 bfloat16 bits, C float32; `pair_scores`)
    testing_strip(wide, dtype)                                   `gemm_strip` with AVX-512's or AVX2's blocks
    transpose16(qf, off, d0, QT, r0)                                          a 16 x 16 transposed copy
    transpose_rows(src, n, width, off, dst)                                   dst[c, j] = src[j, c] by 16 x 16s

The flags are the online softmax's element passes folded into the GEMMs' prologue / epilogue, where C's block
is in registers or L1 anyway: O's rescale by alpha before P @ V adds to it, the score scale and the block's
running max after q.K^T. Each is the same one rounding as the separate pass it replaces (a product in C's
dtype; a max), so the results are bitwise those of the passes.

A (any 2-D C-contiguous array, addressed flat with element strides a_rs / a_cs, so the same block serves A and
A transposed) and B [nk.., cols] C-contiguous arrays of the accumulation dtype (A's = B's), C [rows, cols]
C-contiguous, float32 or float64: float32 C with float64 A / B accumulates in float64 and rounds once into C (the
multi-query kernel's exact scores). LANES = 16 for float32, 8 for float64 accumulation; nv in 1..4. A block's mr x
nv accumulators (mr = 6: 24 of the 32 zmm registers) stay in registers over the whole k loop: per k, nv vector loads
and mr broadcasts feed mr x nv FMAs (6 x 4: 10 loads per 24 FMAs; 4 x 4: 8 per 16). Every element of C is one FMA
chain over k in order, whatever the block it falls in, so the blocking never changes a bit of the result. On a
target without AVX-512 (`vector_ir.WIDE` False: AVX2's 16 256-bit registers, two per 16-lane vector) the strip takes
6 rows x one vector at a time (12 registers of sums), column by column. A fresh C (init & FRESH, the multi-query
kernel's score GEMM) of the accumulation dtype is summed in chunks of `KCHUNK` = 32 steps of k, each started from
zero and added into C: one FMA chain over all of head_dim rounds at the magnitude of the running score at every step
and came out up to 1.3x over the accuracy budget at head_dim 128, |q.k| ~ 3000
(tests/decode/test_int8_kernel.py::test_score_magnitudes); chunks of 32 took it to <= 0.33x. C += ... (no FRESH, the
PV GEMM) and a narrower C (a float64 sum rounded once into float32) stay one chain. The caller keeps every touched
element inside the arrays (pads rows to 4 and columns to LANES). The plain-NumPy twins run under NUMBA_DISABLE_JIT
(the same chunks).
"""
import numpy as np

from . import cachedir  # noqa: F401
from .register_blocks import row_f

from numba import types
from numba.core import config as _nb_config
from numba.extending import intrinsic, overload

JIT = not _nb_config.DISABLE_JIT
MR = 4          # rows of A (and C) per block
KCHUNK = 32     # steps of k per partial sum of a fresh C (init): the chains stay short (module docstring)
FRESH = 1       # init flags: C = A @ B (in KCHUNK chunks), else C += A @ B
RESCALE = 2     # C[i, :] *= rsc[i] first (the online softmax's rescale of O, folded into the P @ V GEMM)
SCALE = 4       # C *= sc at the end (the score scale, applied to the finished dot products)
COLMAX = 8      # mx[c] = max(mx[c], C[i, c] over rows i < imax) at the end (the softmax's block max)


def lanes(dtype) -> int:
    """Vector lanes of the compute dtype (one 512-bit register)."""
    return 8 if np.dtype(dtype) == np.float64 else 16


def gemm4(A, a_rs, a_cs, i0, B, c0, C, nk, nv, init, rsc, sc, mx, imax):
    """NumPy twin (see the module docstring)."""
    n = nv * lanes(A.dtype)
    B = row_f(B)
    flat = A.reshape(-1)
    rows = np.array([[flat[(i0 + a) * a_rs + k * a_cs] for k in range(nk)] for a in range(MR)], dtype=B.dtype)
    blk = C[i0:i0 + MR, c0:c0 + n]
    if init & RESCALE:
        blk *= rsc[i0:i0 + MR, None]
    if not init & FRESH:
        blk += rows.reshape(MR, nk) @ B[:nk, c0:c0 + n] if nk else 0
    else:
        step = KCHUNK if C.dtype == B.dtype else max(nk, 1)
        acc = np.zeros((MR, n), C.dtype)
        for k0 in range(0, nk, step):
            acc += (rows[:, k0:k0 + step] @ B[k0:min(nk, k0 + step), c0:c0 + n]).astype(C.dtype)
        blk[:] = acc
    if init & SCALE:
        blk *= C.dtype.type(sc)
    if init & COLMAX:
        for a in range(min(MR, imax - i0)):
            mx[c0:c0 + n] = np.maximum(mx[c0:c0 + n], blk[a])


def gemm_strip(A, a_rs, a_cs, i0, i1, B, c0, C, nk, nv, init, rsc, sc, mx, imax):
    """NumPy twin (see the module docstring)."""
    for i in range(i0, i1, MR):
        gemm4(A, a_rs, a_cs, i, B, c0, C, nk, nv, init, rsc, sc, mx, imax)


def _widen_bits(bits):
    """bfloat16 bits (int16 / uint16) -> float32, exactly."""
    return (bits.view(np.uint16).astype(np.uint32) << np.uint32(16)).view(np.float32)


def gemm_strip_bf(A, a_rs, i0, i1, B, c0, C, nk, nv, init, sc, mx, imax):
    """C[i, c0 : c0 + nv * 16] = sum_{p < nk} A_flat[i * a_rs + 2p + e] * B[p, 2 * (c0 + j) + e] (e = 0, 1) for i0 <=
    i < i1: the score GEMM over bfloat16 pairs (`vdpbf16ps`). A int16 bfloat16 bits (key rows: a pair is two
    adjacent elements of a row), B int16 [nk.., 2 * cols] (row p: each column's pair p, even element first), C
    float32. Always fresh (summed from zero in chunks of KCHUNK / 2 pairs, each added into C); init's SCALE and
    COLMAX as for `gemm_strip`. Each step adds the odd product, then the even one, to the float32 sum (the
    instruction's order; each product of two bfloat16 is exact). NumPy twin (the JIT: LLVM IR, `vdpbf16ps` where
    the CPU has avx512bf16, else its emulation by a shift, a mask and two FMAs: the same sums)."""
    n = nv * 16
    flat = A.reshape(-1)
    rows = np.stack([_widen_bits(flat[i * a_rs:i * a_rs + 2 * nk]) for i in range(i0, i1)])
    b = _widen_bits(np.ascontiguousarray(B[:nk, 2 * c0:2 * (c0 + n)])).reshape(nk, n, 2)
    out = C[i0:i1, c0:c0 + n]
    half = KCHUNK // 2
    for p0 in range(0, max(nk, 1), half):
        acc = np.zeros((i1 - i0, n), np.float32)
        for p in range(p0, min(nk, p0 + half)):
            acc = acc + rows[:, 2 * p + 1, None] * b[p, :, 1]
            acc = acc + rows[:, 2 * p, None] * b[p, :, 0]
        out[:] = acc if p0 == 0 else out + acc
    if init & SCALE:
        out *= np.float32(sc)
    if init & COLMAX:
        for a in range(min(i1 - i0, imax - i0)):
            mx[c0:c0 + n] = np.maximum(mx[c0:c0 + n], out[a])


if JIT:
    from llvmlite import ir as _ir
    from numba.core import cgutils as _cg

    from . import bf16_dot
    from .vector_ir import WIDE, transpose16_ir, vload_ir

    _I64 = _ir.IntType(64)
    _I32 = _ir.IntType(32)
    _WIDENED = (types.uint16, types.int16)     # B rows of float16 / bfloat16 bits, widened exactly as loaded

    def _data_and_cols(context, builder, aryty, arr):
        ary = context.make_array(aryty)(context, builder, arr)
        return ary.data, _cg.unpack_tuple(builder, ary.shape, 2)[1]

    def _store_chunk(builder, c_ptrs, slots, k0, narrow, ct, zero):
        """A chunk's sums into C (the first chunk stores, the others add; a narrower C takes the one rounded
        sum), and the accumulators zeroed for the next chunk."""
        first = builder.icmp_signed("==", k0, _ir.Constant(_I64, 0))
        for p, sl in zip(c_ptrs, slots):
            x = builder.load(sl)
            if narrow:
                builder.store(builder.fptrunc(x, ct), p, align=4)
            else:
                x = builder.select(first, x, builder.fadd(builder.load(p, align=4), x))
                builder.store(x, p, align=4)
                builder.store(zero, sl)

    def _epilogue(builder, flag, c_ptrs, sc_, mx_data, c0_, i0_, imax_, nv, mr, L, ct, bcast):
        """SCALE: the finished C block times sc; COLMAX: its rows below imax folded into the column maxima mx."""
        with builder.if_then(flag(SCALE)):
            scv = bcast(sc_, ct)
            for p in c_ptrs:
                builder.store(builder.fmul(builder.load(p, align=4), scv), p, align=4)
        with builder.if_then(flag(COLMAX)):
            for v in range(nv):
                mp = builder.bitcast(builder.gep(mx_data, [builder.add(c0_, _ir.Constant(_I64, v * L))]),
                                     ct.as_pointer())
                mv = builder.load(mp, align=4)
                for a in range(mr):
                    x = builder.load(c_ptrs[a * nv + v], align=4)
                    ok = builder.icmp_signed("<", builder.add(i0_, _ir.Constant(_I64, a)), imax_)
                    take = builder.and_(bcast(ok, _ir.VectorType(_ir.IntType(1), L)),
                                        builder.fcmp_ordered(">", x, mv))
                    mv = builder.select(take, x, mv)
                builder.store(mv, mp, align=4)

    def _make_gemm(nv, mr=MR):
        def typer(typingctx, A, a_rs, a_cs, i0, B, c0, C, nk, init, rsc, sc, mx, imax):
            if not (isinstance(A, types.Array) and isinstance(B, types.Array) and isinstance(C, types.Array)
                    and isinstance(A.dtype, types.Float) and isinstance(C.dtype, types.Float)
                    and C.dtype.bitwidth <= A.dtype.bitwidth
                    and (A.dtype == B.dtype or (A.dtype == types.float32 and B.dtype in _WIDENED))
                    and isinstance(rsc, types.Array) and rsc.dtype == C.dtype
                    and isinstance(mx, types.Array) and mx.dtype == C.dtype and isinstance(sc, types.Number)):
                return None

            def codegen(context, builder, sig, args):
                aty, bty, cty = sig.args[0], sig.args[4], sig.args[6]
                L = 8 if aty.dtype == types.float64 else 16
                vt = _ir.VectorType(context.get_value_type(aty.dtype), L)
                ct = _ir.VectorType(context.get_value_type(cty.dtype), L)      # C's vectors (narrower: rounded)
                narrow = ct != vt
                rs, cs, i0_, c0_, nk_ = (context.cast(builder, args[i], sig.args[i], types.int64)
                                         for i in (1, 2, 3, 5, 7))
                init_ = context.cast(builder, args[8], sig.args[8], types.int64)
                a_data, _ = _data_and_cols(context, builder, sig.args[0], args[0])
                b_data, b_cols = _data_and_cols(context, builder, sig.args[4], args[4])
                c_data, c_cols = _data_and_cols(context, builder, sig.args[6], args[6])
                fma = _cg.get_or_insert_function(builder.module, _ir.FunctionType(vt, [vt, vt, vt]),
                                                 "llvm.fma.v%d%s" % (L, "f64" if L == 8 else "f32"))
                zero = _ir.Constant(vt, [0.0] * L)

                def flag(f):
                    return builder.icmp_signed("!=", builder.and_(init_, _ir.Constant(_I64, f)), _ir.Constant(_I64, 0))
                is_init = flag(FRESH)
                imax_ = context.cast(builder, args[12], sig.args[12], types.int64)
                rsc_data = context.make_array(sig.args[9])(context, builder, args[9]).data
                mx_data = context.make_array(sig.args[11])(context, builder, args[11]).data
                sc_ = context.cast(builder, args[10], sig.args[10], cty.dtype)
                a_rows = [builder.gep(a_data, [builder.mul(builder.add(i0_, _ir.Constant(_I64, a)), rs)])
                          for a in range(mr)]
                c_ptrs = []
                slots = []
                for a in range(mr):
                    crow = builder.gep(c_data, [builder.add(builder.mul(builder.add(i0_, _ir.Constant(_I64, a)),
                                                                        c_cols), c0_)])
                    for v in range(nv):
                        p = builder.bitcast(builder.gep(crow, [_ir.Constant(_I64, v * L)]), ct.as_pointer())
                        c_ptrs.append(p)
                        old = builder.load(p, align=4)
                        slots.append(_cg.alloca_once_value(builder, builder.select(
                            is_init, zero, builder.fpext(old, vt) if narrow else old)))
                splat = _ir.Constant(_ir.VectorType(_I32, L), [0] * L)

                def bcast(x, t):
                    return builder.shuffle_vector(builder.insert_element(_ir.Constant(t, None), x,
                                                                         _ir.Constant(_I32, 0)),
                                                  _ir.Constant(t, None), splat)
                with builder.if_then(flag(RESCALE)):       # C's old rows times rsc (a fresh C ignores them)
                    for a in range(mr):
                        f = builder.load(builder.gep(rsc_data, [builder.add(i0_, _ir.Constant(_I64, a))]))
                        f = bcast(builder.fpext(f, vt.element) if narrow else f, vt)
                        for v in range(nv):
                            sl = slots[a * nv + v]
                            builder.store(builder.fmul(builder.load(sl), f), sl)
                one = _ir.Constant(_I64, 1)
                # chunks of KCHUNK steps of k when init (a fresh C: the score GEMM), each summed from zero and
                # added into C; one chain over all of k otherwise (C += ..., the PV GEMM) or when C is narrower
                # (a wide sum rounded once into C)
                step = nk_ if narrow else builder.select(is_init, _ir.Constant(_I64, KCHUNK), nk_)
                step = builder.select(builder.icmp_signed(">", step, one), step, one)
                stop = builder.select(builder.icmp_signed(">", nk_, one), nk_, one)   # one pass even when nk == 0
                with _cg.for_range_slice(builder, _ir.Constant(_I64, 0), stop, step) as (k0, _):
                    k1 = builder.add(k0, step)
                    k1 = builder.select(builder.icmp_signed("<", k1, nk_), k1, nk_)
                    with _cg.for_range_slice(builder, k0, k1, one) as (k, _):
                        brow = builder.gep(b_data, [builder.add(builder.mul(k, b_cols), c0_)])
                        bv = [vload_ir(context, builder, builder.gep(brow, [_ir.Constant(_I64, v * L)]), bty.dtype,
                                       L, vt) for v in range(nv)]
                        koff = builder.mul(k, cs)
                        for a in range(mr):
                            x = builder.load(builder.gep(a_rows[a], [koff]))
                            xv = builder.shuffle_vector(builder.insert_element(_ir.Constant(vt, None), x,
                                                                               _ir.Constant(_I32, 0)),
                                                        _ir.Constant(vt, None), splat)
                            for v in range(nv):
                                sl = slots[a * nv + v]
                                builder.store(builder.call(fma, [xv, bv[v], builder.load(sl)]), sl)
                    _store_chunk(builder, c_ptrs, slots, k0, narrow, ct, zero)
                _epilogue(builder, flag, c_ptrs, sc_, mx_data, c0_, i0_, imax_, nv, mr, L, ct, bcast)
                return context.get_dummy_value()

            return types.void(A, a_rs, a_cs, i0, B, c0, C, nk, init, rsc, sc, mx, imax), codegen
        return intrinsic(typer)

    def _make_gemm_bf(nv, mr, native=None):
        """`gemm_strip_bf`'s register block: mr rows x nv vectors of 16 float32 sums; per pair step nv loads of
        B (32 bfloat16: 16 columns' pairs), mr 32-bit broadcasts of A's pairs, mr x nv `vdpbf16ps`."""
        def typer(typingctx, A, a_rs, i0, B, c0, C, nk, init, sc, mx, imax):
            if not (isinstance(A, types.Array) and A.dtype == types.int16 and isinstance(B, types.Array)
                    and B.dtype == types.int16 and isinstance(C, types.Array) and C.dtype == types.float32
                    and isinstance(mx, types.Array) and mx.dtype == types.float32 and isinstance(sc, types.Number)):
                return None

            def codegen(context, builder, sig, args):
                L = 16
                vt = _ir.VectorType(_ir.FloatType(), L)
                i32v = _ir.VectorType(_I32, L)
                rs, i0_, c0_, nk_, init_, imax_ = (context.cast(builder, args[i], sig.args[i], types.int64)
                                                   for i in (1, 2, 4, 6, 7, 10))
                a_data, _ = _data_and_cols(context, builder, sig.args[0], args[0])
                b_data, b_cols = _data_and_cols(context, builder, sig.args[3], args[3])
                c_data, c_cols = _data_and_cols(context, builder, sig.args[5], args[5])
                mx_data = context.make_array(sig.args[9])(context, builder, args[9]).data
                sc_ = context.cast(builder, args[8], sig.args[8], types.float32)
                dp = bf16_dot.vdpbf16ps_ir(builder) if native is None else bf16_dot.vdpbf16ps_ir(builder, native)
                zero = _ir.Constant(vt, [0.0] * L)
                splat = _ir.Constant(i32v, [0] * L)

                def flag(f):
                    return builder.icmp_signed("!=", builder.and_(init_, _ir.Constant(_I64, f)), _ir.Constant(_I64, 0))

                def bcast(x, t):
                    return builder.shuffle_vector(builder.insert_element(_ir.Constant(t, None), x,
                                                                         _ir.Constant(_I32, 0)),
                                                  _ir.Constant(t, None), splat)
                a_rows = [builder.bitcast(builder.gep(a_data, [builder.mul(builder.add(i0_, _ir.Constant(_I64, a)),
                                                                              rs)]), _I32.as_pointer())
                          for a in range(mr)]
                c_ptrs, slots = [], []
                for a in range(mr):
                    crow = builder.gep(c_data, [builder.add(builder.mul(builder.add(i0_, _ir.Constant(_I64, a)),
                                                                        c_cols), c0_)])
                    for v in range(nv):
                        c_ptrs.append(builder.bitcast(builder.gep(crow, [_ir.Constant(_I64, v * L)]), vt.as_pointer()))
                        slots.append(_cg.alloca_once_value(builder, zero))
                one = _ir.Constant(_I64, 1)
                step = _ir.Constant(_I64, KCHUNK // 2)
                stop = builder.select(builder.icmp_signed(">", nk_, one), nk_, one)   # one pass even when nk == 0
                b0 = builder.mul(c0_, _ir.Constant(_I64, 2))
                with _cg.for_range_slice(builder, _ir.Constant(_I64, 0), stop, step) as (k0, _):
                    k1 = builder.add(k0, step)
                    k1 = builder.select(builder.icmp_signed("<", k1, nk_), k1, nk_)
                    with _cg.for_range_slice(builder, k0, k1, one) as (k, _):
                        brow = builder.gep(b_data, [builder.add(builder.mul(k, b_cols), b0)])
                        bv = [builder.load(builder.bitcast(builder.gep(brow, [_ir.Constant(_I64, 2 * v * L)]),
                                                           bf16_dot.I16X.as_pointer()), align=2) for v in range(nv)]
                        for a in range(mr):
                            x = builder.load(builder.gep(a_rows[a], [k]), align=2)
                            xv = builder.bitcast(bcast(x, i32v), bf16_dot.I16X)
                            for v in range(nv):
                                sl = slots[a * nv + v]
                                builder.store(dp(builder.load(sl), xv, bv[v]), sl)
                    _store_chunk(builder, c_ptrs, slots, k0, False, vt, zero)
                _epilogue(builder, flag, c_ptrs, sc_, mx_data, c0_, i0_, imax_, nv, mr, L, vt, bcast)
                return context.get_dummy_value()

            return types.void(A, a_rs, i0, B, c0, C, nk, init, sc, mx, imax), codegen
        return intrinsic(typer)

    _g1, _g2, _g3, _g4 = (_make_gemm(nv) for nv in (1, 2, 3, 4))
    _b1, _b2, _b3, _b4 = (_make_gemm_bf(nv, MR) for nv in (1, 2, 3, 4))
    _c1, _c2, _c3, _c4 = (_make_gemm_bf(nv, 6) for nv in (1, 2, 3, 4))

    @overload(gemm_strip_bf)
    def _gemm_strip_bf_ov(A, a_rs, i0, i1, B, c0, C, nk, nv, init, sc, mx, imax):
        def impl(A, a_rs, i0, i1, B, c0, C, nk, nv, init, sc, mx, imax):
            i6 = i0 + (i1 - i0) // 12 * 12        # blocks of 6 rows up to here: the rest, a multiple of 4
            if nv >= 4:
                for i in range(i0, i6, 6):
                    _c4(A, a_rs, i, B, c0, C, nk, init, sc, mx, imax)
                for i in range(i6, i1, MR):
                    _b4(A, a_rs, i, B, c0, C, nk, init, sc, mx, imax)
            elif nv == 3:
                for i in range(i0, i6, 6):
                    _c3(A, a_rs, i, B, c0, C, nk, init, sc, mx, imax)
                for i in range(i6, i1, MR):
                    _b3(A, a_rs, i, B, c0, C, nk, init, sc, mx, imax)
            elif nv == 2:
                for i in range(i0, i6, 6):
                    _c2(A, a_rs, i, B, c0, C, nk, init, sc, mx, imax)
                for i in range(i6, i1, MR):
                    _b2(A, a_rs, i, B, c0, C, nk, init, sc, mx, imax)
            else:
                for i in range(i0, i6, 6):
                    _c1(A, a_rs, i, B, c0, C, nk, init, sc, mx, imax)
                for i in range(i6, i1, MR):
                    _b1(A, a_rs, i, B, c0, C, nk, init, sc, mx, imax)
        return impl
    _h1, _h2, _h3, _h4 = (_make_gemm(nv, 6) for nv in (1, 2, 3, 4))

    @overload(gemm4)
    def _gemm4_ov(A, a_rs, a_cs, i0, B, c0, C, nk, nv, init, rsc, sc, mx, imax):
        def impl(A, a_rs, a_cs, i0, B, c0, C, nk, nv, init, rsc, sc, mx, imax):
            if nv >= 4:
                _g4(A, a_rs, a_cs, i0, B, c0, C, nk, init, rsc, sc, mx, imax)
            elif nv == 3:
                _g3(A, a_rs, a_cs, i0, B, c0, C, nk, init, rsc, sc, mx, imax)
            elif nv == 2:
                _g2(A, a_rs, a_cs, i0, B, c0, C, nk, init, rsc, sc, mx, imax)
            else:
                _g1(A, a_rs, a_cs, i0, B, c0, C, nk, init, rsc, sc, mx, imax)
        return impl

    def _strip(wide, L):
        """`gemm_strip`'s body: with AVX-512 (wide) blocks of 6, then 4, rows x nv vectors; with AVX2's 16 256-bit
        registers 6 rows x one 16-lane vector (two registers each: 12 sums), a column strip at a time (the wide
        blocks would spill: the tiled kernel took 1.3-2.7x longer on a Zen 3). Every element of C is the same FMA
        chain either way (bitwise the same C)."""
        def impl(A, a_rs, a_cs, i0, i1, B, c0, C, nk, nv, init, rsc, sc, mx, imax):
            i6 = i0 + (i1 - i0) // 12 * 12        # blocks of 6 rows up to here: the rest, a multiple of 4
            if not wide:
                for v in range(nv):
                    for i in range(i0, i6, 6):
                        _h1(A, a_rs, a_cs, i, B, c0 + v * L, C, nk, init, rsc, sc, mx, imax)
                    for i in range(i6, i1, MR):
                        _g1(A, a_rs, a_cs, i, B, c0 + v * L, C, nk, init, rsc, sc, mx, imax)
            elif nv >= 4:
                for i in range(i0, i6, 6):
                    _h4(A, a_rs, a_cs, i, B, c0, C, nk, init, rsc, sc, mx, imax)
                for i in range(i6, i1, MR):
                    _g4(A, a_rs, a_cs, i, B, c0, C, nk, init, rsc, sc, mx, imax)
            elif nv == 3:
                for i in range(i0, i6, 6):
                    _h3(A, a_rs, a_cs, i, B, c0, C, nk, init, rsc, sc, mx, imax)
                for i in range(i6, i1, MR):
                    _g3(A, a_rs, a_cs, i, B, c0, C, nk, init, rsc, sc, mx, imax)
            elif nv == 2:
                for i in range(i0, i6, 6):
                    _h2(A, a_rs, a_cs, i, B, c0, C, nk, init, rsc, sc, mx, imax)
                for i in range(i6, i1, MR):
                    _g2(A, a_rs, a_cs, i, B, c0, C, nk, init, rsc, sc, mx, imax)
            else:
                for i in range(i0, i6, 6):
                    _h1(A, a_rs, a_cs, i, B, c0, C, nk, init, rsc, sc, mx, imax)
                for i in range(i6, i1, MR):
                    _g1(A, a_rs, a_cs, i, B, c0, C, nk, init, rsc, sc, mx, imax)
        return impl

    @overload(gemm_strip)
    def _gemm_strip_ov(A, a_rs, a_cs, i0, i1, B, c0, C, nk, nv, init, rsc, sc, mx, imax):
        return _strip(WIDE, lanes(np.float64 if A.dtype == types.float64 else np.float32))


def testing_strip(wide: bool, dtype=np.float32):
    """`gemm_strip` as a jitted callable with the blocks of an AVX-512 target (wide=True) or of an AVX2 one, for A
    / B of ``dtype``, for tests (both compile on any x86-64 CPU with FMA). Without the JIT: the NumPy twin."""
    if not JIT:
        return gemm_strip
    return __import__("numba").njit(_strip(wide, lanes(dtype)))


def testing_block_bf(emulated: bool = False):
    """`gemm_strip_bf`'s 4-row x 1-vector register block as a jitted callable ``(A, a_rs, i0, B, c0, C, nk, init,
    sc, mx, imax)``, for tests: the kernel's (`vdpbf16ps` where the CPU has it), or (emulated=True) the shift and
    two FMAs that machines without avx512bf16 compile. Without the JIT: the NumPy twin's rows i0..i0+3."""
    if not JIT:
        return lambda A, a_rs, i0, B, c0, C, nk, init, sc, mx, imax: gemm_strip_bf(
            A, a_rs, i0, i0 + MR, B, c0, C, nk, 1, init, sc, mx, imax)
    block = _make_gemm_bf(1, MR, native=False) if emulated else _b1

    @__import__("numba").njit
    def run(A, a_rs, i0, B, c0, C, nk, init, sc, mx, imax):
        block(A, a_rs, i0, B, c0, C, nk, init, sc, mx, imax)
    return run


def transpose16(qf, off, d0, QT, r0):
    """QT[d0 + j, r0 + k] = qf[off[k] + d0 + j] for j, k < 16: a 16 x 16 block of the multi-query kernel's q
    tile, transposed (exact copies). float32 qf and QT: sixteen 16-lane row loads, a 4-stage shuffle network in
    registers, sixteen row stores (the element loop stores 16 scattered lines per source row); other dtypes:
    the element loop. The caller keeps every touched element inside the arrays."""
    for j in range(16):
        row = QT[d0 + j]
        for k in range(16):
            row[r0 + k] = qf[off[k] + d0 + j]


def transpose_rows(src, n, width, off, dst):
    """dst[c, j] = src[j, c] for j < n, c < width (both multiples of 16; src [>= n, >= width] C-contiguous, dst
    [>= width, >= n]): 16 x 16 blocks by `transpose16`, off its int64 [16] scratch."""
    flat = src.reshape(-1)
    cols = src.shape[1]
    for j0 in range(0, n, 16):
        for k in range(16):
            off[k] = (j0 + k) * cols
        for c0 in range(0, width, 16):
            transpose16(flat, off, c0, dst, j0)


if JIT:
    _transpose16_loop = __import__("numba").njit(cache=True)(transpose16)

    @intrinsic
    def _transpose16_ir(typingctx, qf, off, d0, QT, r0):
        if not (isinstance(qf, types.Array) and isinstance(QT, types.Array) and qf.dtype == types.float32
                and QT.dtype == types.float32 and isinstance(off, types.Array) and off.dtype == types.int64):
            return None

        def codegen(context, builder, sig, args):
            d0_, r0_ = (context.cast(builder, args[i], sig.args[i], types.int64) for i in (2, 4))
            src = context.make_array(sig.args[0])(context, builder, args[0]).data
            offs = context.make_array(sig.args[1])(context, builder, args[1]).data
            q_data, q_cols = _data_and_cols(context, builder, sig.args[3], args[3])
            vt = _ir.VectorType(_ir.FloatType(), 16)
            rows = []
            for k in range(16):
                o = builder.add(builder.load(builder.gep(offs, [_ir.Constant(_I64, k)])), d0_)
                rows.append(builder.load(builder.bitcast(builder.gep(src, [o]), vt.as_pointer()), align=4))
            rows = transpose16_ir(builder, rows)
            for j in range(16):
                p = builder.gep(q_data, [builder.add(builder.mul(builder.add(d0_, _ir.Constant(_I64, j)), q_cols),
                                                     r0_)])
                builder.store(rows[j], builder.bitcast(p, vt.as_pointer()), align=4)
            return context.get_dummy_value()

        return types.void(qf, off, d0, QT, r0), codegen

    @overload(transpose16)
    def _transpose16_ov(qf, off, d0, QT, r0):
        if qf.dtype == types.float32 and QT.dtype == types.float32:
            return lambda qf, off, d0, QT, r0: _transpose16_ir(qf, off, d0, QT, r0)
        return lambda qf, off, d0, QT, r0: _transpose16_loop(qf, off, d0, QT, r0)

    transpose_rows = __import__("numba").njit(cache=True)(transpose_rows)
