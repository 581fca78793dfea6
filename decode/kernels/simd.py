"""Scalar and SIMD helpers shared by the kernels: storage element loads (float16 bits -> float32), prefetch hints,
page touches (`touch_pages`), exact 2**n, a polynomial exp, and LLVM-IR register blocks (4x4 / 1x4 dot products,
4-head and 1-head PV accumulation).
Each has a plain-Python twin used under NUMBA_DISABLE_JIT and a typed implementation for the JIT."""
import math

import numpy as np

from . import cachedir  # noqa: F401  (numba's cache directory is settled before any decorator runs)

from numba import njit, types
from numba.core import config as _nb_config
from numba.extending import intrinsic, overload

JIT = not _nb_config.DISABLE_JIT
# fastmath flags of every kernel: FMA contraction, no inf / NaN (no -inf sentinels), no signed zeros. No "reassoc"
# (nor "arcp" / "afn"): with it LLVM may order a function's float operations differently in each module it is
# optimised in (alone, or re-optimised inside a caller), and which copy a call binds to depends on what the
# process compiled or loaded from numba's cache, so a fresh process and one with a warm cache gave different bits
# (tests/decode/test_determinism.py::test_more_threads_than_cores_and_fresh_compile_equals_cache_load).
FAST = {"nnan", "ninf", "nsz", "contract"}
EXP_FLAGS = FAST  # exp needs no reassoc either: it would undo the Cody-Waite split

# --------------------------------------------------------------------------------------------------------------
# scalar helpers: element load (float16 bits -> float32), exact 2**n, polynomial exp
# Each has a plain-Python body used under NUMBA_DISABLE_JIT and a typed implementation for the JIT.
# --------------------------------------------------------------------------------------------------------------


def ld(x):
    """Storage element -> compute value, exactly: uint16 = float16 bits, int16 = bfloat16 bits (widened by a 16-bit
    shift into a float32's high half), floats pass through."""
    if isinstance(x, np.uint16):
        return np.float32(x.view(np.float16))
    if isinstance(x, np.int16):
        return (np.uint32(x.view(np.uint16)) << np.uint32(16)).view(np.float32)
    return x


def prefetch(row, i):
    """Hint: the cache line holding row[i] will be read soon (no-op without the JIT)."""
    return None


def prefetch_lines(tile, r0, r1):
    """Hint: rows [r0, r1) of a C-contiguous tile (rows = its last axis: a [rows, head_dim] tile or a whole page
    [num_kv_heads, page_size, head_dim] as num_kv_heads * page_size rows) will be read soon, one hint per
    64-byte line of the contiguous span (no views, no per-row work; a no-op without the JIT)."""
    return None


OS_PAGE = 4096      # bytes of the memory pages whose address translations `touch_pages` requests


def touch_pages(tile, r0, r1):
    """Read one byte at every `OS_PAGE` boundary inside rows [r0, r1) of a C-contiguous tile (as `prefetch_lines`
    counts rows), and at the span's first byte: a real load, which makes the CPU translate the page's address
    (a TLB miss walks the page tables while the kernel goes on), where a prefetch hint that misses the TLB is
    dropped. Touched further ahead than `prefetch_lines` hints, a page's translation is there when its lines are
    hinted. Nothing outside the rows is read; a no-op without the JIT."""
    return None


def borrow(a):
    """``a`` (an array, or None) without its reference count: the same data, shape and strides, no owner (numba's
    meminfo NULL, as for a global constant array), so that views of it and calls taking it increment and decrement
    nothing (a locked instruction each, up to ~16% of a decode step's time at 1 thread). Only for the duration of a
    call whose caller owns ``a``: a kernel borrows its arguments at entry. Without the JIT: ``a`` itself."""
    return a


def pow2(n):
    """2.0**n as float32 for an integral float32 n in [-126, 127]."""
    return np.float32(np.ldexp(np.float32(1.0), int(n)))


if JIT:
    from llvmlite import ir as _ir

    @intrinsic
    def _bits2f(typingctx, x):
        """float16 bits (uint16) or bfloat16 bits (int16) -> float32, exactly."""
        if x not in (types.uint16, types.int16):
            return None

        def codegen(context, builder, sig, args):
            if sig.args[0] == types.uint16:
                return builder.fpext(builder.bitcast(args[0], _ir.HalfType()), _ir.FloatType())
            i32 = _ir.IntType(32)
            return builder.bitcast(builder.shl(builder.zext(args[0], i32), _ir.Constant(i32, 16)), _ir.FloatType())

        return types.float32(x), codegen

    @intrinsic
    def _pow2_intrinsic(typingctx, n):
        if n != types.float32:
            return None

        def codegen(context, builder, sig, args):
            i32 = _ir.IntType(32)
            e = builder.add(builder.fptosi(args[0], i32), _ir.Constant(i32, 127))
            return builder.bitcast(builder.shl(e, _ir.Constant(i32, 23)), _ir.FloatType())

        return types.float32(types.float32), codegen

    @intrinsic
    def _prefetch_intrinsic(typingctx, row, i):
        if not isinstance(row, types.Array) or not isinstance(i, types.Integer):
            return None

        def codegen(context, builder, sig, args):
            from numba.core import cgutils
            ary = context.make_array(sig.args[0])(context, builder, args[0])
            i8p = _ir.IntType(8).as_pointer()
            i32 = _ir.IntType(32)
            fn = cgutils.get_or_insert_function(builder.module, _ir.FunctionType(_ir.VoidType(), [i8p, i32, i32, i32]),
                                                "llvm.prefetch.p0")
            ptr = builder.bitcast(builder.gep(ary.data, [args[1]]), i8p)
            builder.call(fn, [ptr, _ir.Constant(i32, 0), _ir.Constant(i32, 2), _ir.Constant(i32, 1)])
            return context.get_dummy_value()

        return types.void(row, i), codegen

    @overload(prefetch)
    def _prefetch_ov(row, i):
        return lambda row, i: _prefetch_intrinsic(row, i)

    def _span_bytes(context, builder, sig, args):
        """(data pointer as i8*, first byte offset, end byte offset) of rows [r0, r1) of a C-contiguous tile, whose
        rows are its last axis."""
        from numba.core import cgutils
        aty = sig.args[0]
        ary = context.make_array(aty)(context, builder, args[0])
        cols = cgutils.unpack_tuple(builder, ary.shape, aty.ndim)[aty.ndim - 1]
        i64 = _ir.IntType(64)
        item = _ir.Constant(i64, context.get_abi_sizeof(context.get_data_type(aty.dtype)))
        a = context.cast(builder, args[1], sig.args[1], types.int64)
        b = context.cast(builder, args[2], sig.args[2], types.int64)
        base = builder.bitcast(ary.data, _ir.IntType(8).as_pointer())
        return base, builder.mul(builder.mul(a, cols), item), builder.mul(builder.mul(b, cols), item)

    def _span_intrinsic(emit):
        """An intrinsic ``(tile, r0, r1) -> None`` over the bytes of rows [r0, r1) of a tile of >= 2 dimensions,
        whose code is ``emit(builder, base, lo, hi)`` (`_span_bytes`)."""
        def typer(typingctx, tile, r0, r1):
            if not (isinstance(tile, types.Array) and tile.ndim >= 2 and isinstance(r0, types.Integer)
                    and isinstance(r1, types.Integer)):
                return None

            def codegen(context, builder, sig, args):
                emit(builder, *_span_bytes(context, builder, sig, args))
                return context.get_dummy_value()

            return types.void(tile, r0, r1), codegen
        typer.__name__ = typer.__qualname__ = emit.__name__
        return intrinsic(typer)

    def _emit_prefetch_lines(builder, base, lo, hi):
        """One prefetch hint (read, into L2) per 64-byte line of the span."""
        from numba.core import cgutils
        i32 = _ir.IntType(32)
        hint = _ir.FunctionType(_ir.VoidType(), [base.type, i32, i32, i32])
        fn = cgutils.get_or_insert_function(builder.module, hint, "llvm.prefetch.p0")
        read, l2, data = _ir.Constant(i32, 0), _ir.Constant(i32, 2), _ir.Constant(i32, 1)
        with cgutils.for_range_slice(builder, lo, hi, _ir.Constant(_ir.IntType(64), 64)) as (off, _):
            builder.call(fn, [builder.gep(base, [off]), read, l2, data])

    def _emit_touch_pages(builder, base, lo, hi):
        """One byte loaded at the span's start and at every `OS_PAGE` boundary inside it."""
        from numba.core import cgutils
        i64 = _ir.IntType(64)
        start = builder.ptrtoint(base, i64)
        lo = builder.add(start, lo)                                                      # the span's bytes [lo, hi)
        hi = builder.add(start, hi)
        first = builder.and_(builder.add(lo, _ir.Constant(i64, OS_PAGE - 1)), _ir.Constant(i64, ~(OS_PAGE - 1)))
        with builder.if_then(builder.icmp_unsigned("<", lo, hi)):
            # a monotonic atomic load: a plain load in the machine code, which the optimiser may not delete
            builder.load_atomic(builder.inttoptr(lo, base.type), "monotonic", 1)
            with cgutils.for_range_slice(builder, first, hi, _ir.Constant(i64, OS_PAGE)) as (addr, _):
                builder.load_atomic(builder.inttoptr(addr, base.type), "monotonic", 1)

    _prefetch_lines_intrinsic = _span_intrinsic(_emit_prefetch_lines)
    _touch_pages_intrinsic = _span_intrinsic(_emit_touch_pages)

    @overload(prefetch_lines)
    def _prefetch_lines_ov(tile, r0, r1):
        return lambda tile, r0, r1: _prefetch_lines_intrinsic(tile, r0, r1)

    @overload(touch_pages)
    def _touch_pages_ov(tile, r0, r1):
        return lambda tile, r0, r1: _touch_pages_intrinsic(tile, r0, r1)

    @overload(ld)
    def _ld_ov(x):
        if x in (types.uint16, types.int16):
            return lambda x: _bits2f(x)
        if isinstance(x, types.Float):
            return lambda x: x
        return None

    @intrinsic
    def _borrow_intrinsic(typingctx, a):
        if not isinstance(a, types.Array):
            return None

        def codegen(context, builder, sig, args):
            ary = context.make_array(sig.args[0])(context, builder, args[0])
            ary.meminfo = context.get_constant_null(types.MemInfoPointer(types.voidptr))
            ary.parent = context.get_constant_null(types.pyobject)
            return ary._getvalue()

        return a(a), codegen

    @overload(borrow, inline="always")
    def _borrow_ov(a):
        if isinstance(a, types.Array):
            return lambda a: _borrow_intrinsic(a)
        return lambda a: a

    @overload(pow2)
    def _pow2_ov(n):
        if n == types.float32:
            return lambda n: _pow2_intrinsic(n)
        return None


# --------------------------------------------------------------------------------------------------------------
# vector micro-kernels written directly in LLVM IR (the register blocks LLVM cannot derive from scalar loops:
# several dot products reduced together by one butterfly of shuffles instead of one horizontal sum each, and
# PV accumulators kept in registers over a whole chunk of value rows). Each has a plain-NumPy twin for
# NUMBA_DISABLE_JIT. Vectors are 16 float32 or 8 float64 lanes. The dot blocks take any `n` (a last, masked
# vector for n % lanes); the PV blocks process `n` (a multiple of 32) elements, the callers handle the tail.
# --------------------------------------------------------------------------------------------------------------


def row_f(x):
    """A storage row as compute values (NumPy; used by the no-JIT twins): float16 / bfloat16 bits widened."""
    if x.dtype == np.uint16:
        return x.view(np.float16).astype(np.float32)
    if x.dtype == np.int16:
        return (x.view(np.uint16).astype(np.uint32) << np.uint32(16)).view(np.float32)
    return x


def dot44(qs, g, kp, t, n, last):
    """16 dot products qs[g + a, :n] . kp[min(t + b, last), :n] (a, b < 4), a-major, accumulated in qs's dtype
    (float64 qs: the key rows are widened exactly, every product is exact and the sums carry ~2**-53 relative
    error). Rows past ``last`` repeat row ``last`` (a short last block: every key through the same lanes)."""
    return tuple(_dot(qs[g + a, :n], row_f(kp[min(t + b, last), :n])) for a in range(4) for b in range(4))


def dot14(qs, g, kp, t, n, last):
    """4 dot products qs[g, :n] . kp[min(t + b, last), :n] (b < 4)."""
    return tuple(_dot(qs[g, :n], row_f(kp[min(t + b, last), :n])) for b in range(4))


def _dot(x, y):
    """x . y in x's dtype, summed as the IR blocks do: per lane of a 16 (float32) or 8 (float64) lane vector in
    order, then the lanes pairwise (their butterfly)."""
    lanes = 8 if x.dtype == np.float64 else 16
    acc = np.zeros(lanes, x.dtype)
    for i in range(0, len(x), lanes):
        k = min(lanes, len(x) - i)
        acc[:k] += x[i:i + k] * y[i:i + k].astype(x.dtype)
    while len(acc) > 1:
        acc = acc[: len(acc) // 2] + acc[len(acc) // 2:]
    return x.dtype.type(acc[0])


def lane_max(x, n):
    """max(x[0], ..., x[n-1]) (n >= 1) of a 1-D float array: one vector of running maxima over whole vectors, the
    lanes, then the last n % lanes in order (a maximum of exact values is exact in any order)."""
    return x.dtype.type(np.max(x[:n]))


def lane_sum(x, n):
    """x[0] + ... + x[n-1] of a 1-D float array in a fixed order that needs no reassociation: one running sum per
    lane of a 16 (float32) / 8 (float64) lane vector over whole vectors, the lanes added pairwise (halves), then
    the last n % lanes in order."""
    lanes = 8 if x.dtype == np.float64 else 16
    full = n - n % lanes
    acc = np.zeros(lanes, x.dtype)
    for i in range(0, full, lanes):
        acc += x[i:i + lanes]
    while len(acc) > 1:
        acc = acc[: len(acc) // 2] + acc[len(acc) // 2:]
    s = acc[0]
    for i in range(full, n):
        s += x[i]
    return x.dtype.type(s)


def pv4(S, g, c, vp, t0, t1, acc, n):
    """acc[g + a, :n] += sum_t S[g + a, c + t - t0] * vp[t, :n] over t in [t0, t1), a < 4."""
    V = row_f(vp[t0:t1, :n])
    for a in range(4):
        acc[g + a, :n] += S[g + a, c:c + t1 - t0] @ V


def pv1(S, g, c, vp, t0, t1, acc, n):
    """acc[g, :n] += sum_t S[g, c + t - t0] * vp[t, :n] over t in [t0, t1) (one head)."""
    acc[g, :n] += S[g, c:c + t1 - t0] @ row_f(vp[t0:t1, :n])


if JIT:
    from numba.core import cgutils as _cg

    _I32 = _ir.IntType(32)
    _I64 = _ir.IntType(64)

    def _lanes(nbty):
        return 8 if nbty == types.float64 else 16

    def _row(context, builder, aryty, arr, row):
        """Pointer to element [row, 0] of a C-contiguous 2-D array."""
        ary = context.make_array(aryty)(context, builder, arr)
        cols = _cg.unpack_tuple(builder, ary.shape, 2)[1]
        return builder.gep(ary.data, [builder.mul(row, cols)])

    def _widen(builder, x, storage, lanes, vt):
        """A loaded <lanes x storage> vector as <lanes x compute>, exactly: float16 bits (uint16) by fpext,
        bfloat16 bits (int16) by a 16-bit shift into float32's high half, float32 into float64 by fpext."""
        if storage == types.uint16:
            x = builder.fpext(builder.bitcast(x, _ir.VectorType(_ir.HalfType(), lanes)), vt)
        elif storage == types.int16:
            wide = builder.shl(builder.zext(x, _ir.VectorType(_I32, lanes)),
                               _ir.Constant(_ir.VectorType(_I32, lanes), [16] * lanes))
            x = builder.bitcast(wide, _ir.VectorType(_ir.FloatType(), lanes))
        if x.type != vt:
            x = builder.fpext(x, vt)
        return x

    def _vload(context, builder, ptr, storage, lanes, vt):
        """<lanes x compute> from ptr (storage element type), widened exactly (`_widen`)."""
        ety = context.get_value_type(storage)
        x = builder.load(builder.bitcast(ptr, _ir.VectorType(ety, lanes).as_pointer()), align=storage.bitwidth // 8)
        return _widen(builder, x, storage, lanes, vt)

    vload_ir = _vload     # public: the multi-query GEMM's widening row loads (decode.kernels.gemm)

    def lane_mask(builder, n, lanes):
        """The <lanes x i1> mask of the lanes below ``n`` (an i64): a masked load's tail of a row."""
        lane_ids = _ir.Constant(_ir.VectorType(_I64, lanes), list(range(lanes)))
        splat = builder.insert_element(_ir.Constant(_ir.VectorType(_I64, lanes), None), n, _ir.Constant(_I32, 0))
        splat = builder.shuffle_vector(splat, _ir.Constant(_ir.VectorType(_I64, lanes), None),
                                       _ir.Constant(_ir.VectorType(_I32, lanes), [0] * lanes))
        return builder.icmp_signed("<", lane_ids, splat)

    def _vload_masked(context, builder, ptr, storage, lanes, vt, mask):
        """`_vload` of the lanes where mask is set (the others read nothing and are zero)."""
        ety = context.get_value_type(storage)
        it = _ir.VectorType(ety, lanes)
        name = "llvm.masked.load.v%d%s.p0" % (lanes, {16: "i16", 32: "f32", 64: "f64"}[storage.bitwidth])
        fn = _cg.get_or_insert_function(builder.module, _ir.FunctionType(it, [it.as_pointer(), _I32, mask.type, it]),
                                        name)
        x = builder.call(fn, [builder.bitcast(ptr, it.as_pointer()), _ir.Constant(_I32, storage.bitwidth // 8), mask,
                              _ir.Constant(it, None)])
        return _widen(builder, x, storage, lanes, vt)

    def fadd_ordered(builder, a, b):
        """a + b that numba's fastmath pass leaves alone: it adds its flags (reassoc among them) only to float
        instructions that carry none, and these carry "nsz". The blocks are inlined into fastmath kernels (numba
        IR), where reassociated sums could be reordered differently in each caller (serial vs parallel kernel:
        other bits on another thread count); the blocks' order is the NumPy twins'."""
        return builder.fadd(a, b, flags=("nsz",))

    def _fma(builder, vt, lanes):
        name = "llvm.fma.v%d%s" % (lanes, "f64" if lanes == 8 else "f32")
        return _cg.get_or_insert_function(builder.module, _ir.FunctionType(vt, [vt, vt, vt]), name)

    def reduce_many_ir(builder, accs, lanes):
        """Sums of n accumulators (<lanes x T>, n a power of two) by a butterfly of shuffles: each stage halves
        the lanes per partial sum and doubles the sums per vector (n - 1 shuffle pairs instead of n reductions)."""
        vs = list(accs)
        labels = [[i] * lanes for i in range(len(vs))]
        width = lanes
        while len(vs) > 1 and width > 1:
            half = width // 2
            nv, nl = [], []
            for (a, la), (b, lb) in zip(zip(vs[0::2], labels[0::2]), zip(vs[1::2], labels[1::2])):
                lo, hi, lab = [], [], []
                for blk in range(0, lanes, width):
                    lo += [blk + i for i in range(half)] + [lanes + blk + i for i in range(half)]
                    hi += [blk + half + i for i in range(half)] + [lanes + blk + half + i for i in range(half)]
                    lab += [la[blk]] * half + [lb[blk]] * half
                nv.append(fadd_ordered(builder,
                                       builder.shuffle_vector(a, b, _ir.Constant(_ir.VectorType(_I32, lanes), lo)),
                                       builder.shuffle_vector(a, b, _ir.Constant(_ir.VectorType(_I32, lanes), hi))))
                nl.append(lab)
            vs, labels, width = nv, nl, half
        out = [None] * len(accs)
        for v, lab in zip(vs, labels):
            cur = lanes
            w = width
            while w > 1:
                half = w // 2
                lo, hi, nlab = [], [], []
                for blk in range(0, cur, w):
                    lo += [blk + i for i in range(half)]
                    hi += [blk + half + i for i in range(half)]
                    nlab += [lab[blk]] * half
                v = fadd_ordered(builder, builder.shuffle_vector(v, v, _ir.Constant(_ir.VectorType(_I32, len(lo)), lo)),
                                 builder.shuffle_vector(v, v, _ir.Constant(_ir.VectorType(_I32, len(hi)), hi)))
                lab, cur, w = nlab, len(lo), half
            for lane, k in enumerate(lab):
                out[k] = builder.extract_element(v, _ir.Constant(_I32, lane))
        return out

    def widen_halves_ir(builder, acc):
        """<16 x float> -> <8 x double>: its low and high halves widened exactly and added (one rounding)."""
        dv = _ir.VectorType(_ir.DoubleType(), 8)
        lo = builder.shuffle_vector(acc, acc, _ir.Constant(_ir.VectorType(_I32, 8), list(range(8))))
        hi = builder.shuffle_vector(acc, acc, _ir.Constant(_ir.VectorType(_I32, 8), list(range(8, 16))))
        return fadd_ordered(builder, builder.fpext(lo, dv), builder.fpext(hi, dv))

    def bf16_pairs_ir(builder, x):
        """<16 x i32> holding 32 bfloat16 (element 2j in the low half of lane j) -> (<16 x float> of the even
        elements, <16 x float> of the odd ones), exactly: a 16-bit shift, and a mask of the high halves."""
        i32v = _ir.VectorType(_I32, 16)
        fv = _ir.VectorType(_ir.FloatType(), 16)
        even = builder.shl(x, _ir.Constant(i32v, [16] * 16))
        odd = builder.and_(x, _ir.Constant(i32v, [0xFFFF0000 - (1 << 32)] * 16))
        return builder.bitcast(even, fv), builder.bitcast(odd, fv)

    def deinterleave_ir(builder, a0, a1):
        """32 lanes as two 16-lane vectors -> (the even lanes, the odd lanes)."""
        even = _ir.Constant(_ir.VectorType(_I32, 16), list(range(0, 32, 2)))
        odd = _ir.Constant(_ir.VectorType(_I32, 16), list(range(1, 32, 2)))
        return builder.shuffle_vector(a0, a1, even), builder.shuffle_vector(a0, a1, odd)

    def interleave_ir(builder, even, odd):
        """The inverse of `deinterleave_ir`."""
        lo = _ir.Constant(_ir.VectorType(_I32, 16), [j // 2 + (16 if j % 2 else 0) for j in range(16)])
        hi = _ir.Constant(_ir.VectorType(_I32, 16), [8 + j // 2 + (16 if j % 2 else 0) for j in range(16)])
        return builder.shuffle_vector(even, odd, lo), builder.shuffle_vector(even, odd, hi)

    def _make_dot(ng, nt):
        def typer(typingctx, qs, g, kp, t, n, last):
            if not (isinstance(qs, types.Array) and isinstance(kp, types.Array) and qs.ndim == 2 and kp.ndim == 2
                    and isinstance(qs.dtype, types.Float)):
                return None

            def codegen(context, builder, sig, args):
                qty, _, kty, _, _, _ = sig.args
                lanes = _lanes(qty.dtype)
                ft = context.get_value_type(qty.dtype)
                vt = _ir.VectorType(ft, lanes)
                g_, t_, n_, last_ = (context.cast(builder, args[i], sig.args[i], types.int64) for i in (1, 3, 4, 5))
                qrows = [_row(context, builder, qty, args[0], builder.add(g_, _ir.Constant(_I64, a))) for a in range(ng)]
                kidx = [builder.add(t_, _ir.Constant(_I64, b)) for b in range(nt)]
                kidx = [builder.select(builder.icmp_signed(">", k, last_), last_, k) for k in kidx]
                krows = [_row(context, builder, kty, args[2], k) for k in kidx]
                slots = [_cg.alloca_once_value(builder, _ir.Constant(vt, None)) for _ in range(ng * nt)]
                fma = _fma(builder, vt, lanes)
                rem = builder.srem(n_, _ir.Constant(_I64, lanes))
                full = builder.sub(n_, rem)

                def step(i, load):
                    qv = [load(builder.gep(r, [i]), qty.dtype) for r in qrows]
                    kv = [load(builder.gep(r, [i]), kty.dtype) for r in krows]
                    for a in range(ng):
                        for b in range(nt):
                            sl = slots[a * nt + b]
                            builder.store(builder.call(fma, [qv[a], kv[b], builder.load(sl)]), sl)

                with _cg.for_range_slice(builder, _ir.Constant(_I64, 0), full, _ir.Constant(_I64, lanes)) as (i, _):
                    step(i, lambda ptr, st: _vload(context, builder, ptr, st, lanes, vt))
                with builder.if_then(builder.icmp_signed(">", rem, _ir.Constant(_I64, 0)), likely=False):
                    mask = lane_mask(builder, rem, lanes)
                    step(full, lambda ptr, st: _vload_masked(context, builder, ptr, st, lanes, vt, mask))
                sums = reduce_many_ir(builder, [builder.load(sl) for sl in slots], lanes)
                return context.make_tuple(builder, sig.return_type, sums)

            return types.UniTuple(qs.dtype, ng * nt)(qs, g, kp, t, n, last), codegen
        return intrinsic(typer)

    def _make_pv(ng, nvec):
        def typer(typingctx, S, g, c, vp, t0, t1, acc, n):
            if not (isinstance(S, types.Array) and isinstance(vp, types.Array) and isinstance(acc, types.Array)):
                return None

            def codegen(context, builder, sig, args):
                sty, _, _, vty, _, _, aty, _ = sig.args
                lanes = _lanes(aty.dtype)
                ft = context.get_value_type(aty.dtype)
                vt = _ir.VectorType(ft, lanes)
                g_, c_, t0_, t1_, n_ = (context.cast(builder, args[i], sig.args[i], types.int64) for i in (1, 2, 4, 5, 7))
                arows = [_row(context, builder, aty, args[6], builder.add(g_, _ir.Constant(_I64, a))) for a in range(ng)]
                srows = [builder.gep(_row(context, builder, sty, args[0], builder.add(g_, _ir.Constant(_I64, a))),
                                     [builder.sub(c_, t0_)]) for a in range(ng)]
                vary = context.make_array(vty)(context, builder, args[3])
                vcols = _cg.unpack_tuple(builder, vary.shape, 2)[1]
                slots = [_cg.alloca_once(builder, vt) for _ in range(ng * nvec)]
                fma = _fma(builder, vt, lanes)
                strip = lanes * nvec
                # bfloat16 values: the 32 accumulator lanes of a strip held as (even dims, odd dims) over the rows
                # (the same FMAs, in the same order, as widening each row: no shuffle per row)
                pairs = vty.dtype == types.int16 and lanes == 16 and nvec == 2
                with _cg.for_range_slice(builder, _ir.Constant(_I64, 0), n_, _ir.Constant(_I64, strip)) as (d, _):
                    for a in range(ng):
                        ptrs = [builder.gep(arows[a], [builder.add(d, _ir.Constant(_I64, k * lanes))]) for k in range(nvec)]
                        av = [builder.load(builder.bitcast(p, vt.as_pointer()), align=4) for p in ptrs]
                        if pairs:
                            av = deinterleave_ir(builder, *av)
                        for k in range(nvec):
                            builder.store(av[k], slots[a * nvec + k])
                    with _cg.for_range_slice(builder, t0_, t1_, _ir.Constant(_I64, 1)) as (t, _):
                        vrow = builder.gep(vary.data, [builder.add(builder.mul(t, vcols), d)])
                        if pairs:       # 32 bfloat16 as 16 x i32: even elements by a shift, odd ones by a mask
                            x = builder.load(builder.bitcast(vrow, _ir.VectorType(_I32, 16).as_pointer()), align=2)
                            vv = list(bf16_pairs_ir(builder, x))
                        else:
                            vv = [_vload(context, builder, builder.gep(vrow, [_ir.Constant(_I64, k * lanes)]),
                                         vty.dtype, lanes, vt) for k in range(nvec)]
                        for a in range(ng):
                            w = builder.load(builder.gep(srows[a], [t]))
                            wv = builder.shuffle_vector(builder.insert_element(_ir.Constant(vt, None), w, _ir.Constant(_I32, 0)),
                                                        _ir.Constant(vt, None), _ir.Constant(_ir.VectorType(_I32, lanes), [0] * lanes))
                            for k in range(nvec):
                                sl = slots[a * nvec + k]
                                builder.store(builder.call(fma, [wv, vv[k], builder.load(sl)]), sl)
                    for a in range(ng):
                        av = [builder.load(slots[a * nvec + k]) for k in range(nvec)]
                        if pairs:
                            av = interleave_ir(builder, *av)
                        for k in range(nvec):
                            p = builder.gep(arows[a], [builder.add(d, _ir.Constant(_I64, k * lanes))])
                            builder.store(av[k], builder.bitcast(p, vt.as_pointer()), align=4)
                return context.get_dummy_value()

            return types.void(S, g, c, vp, t0, t1, acc, n), codegen
        return intrinsic(typer)

    def _make_lane_reduce(kind):
        """`lane_max` / `lane_sum` in IR: <lanes x T> running maxima (compare and select) or sums (`fadd_ordered`)
        over whole vectors, the halves combined down to one lane, then the tail in order."""
        def typer(typingctx, x, n):
            if not (isinstance(x, types.Array) and x.ndim == 1 and isinstance(x.dtype, types.Float)
                    and isinstance(n, types.Integer)):
                return None

            def codegen(context, builder, sig, args):
                xty = sig.args[0]
                lanes = _lanes(xty.dtype)
                ft = context.get_value_type(xty.dtype)
                vt = _ir.VectorType(ft, lanes)
                data = context.make_array(xty)(context, builder, args[0]).data
                n_ = context.cast(builder, args[1], sig.args[1], types.int64)
                rem = builder.srem(n_, _ir.Constant(_I64, lanes))
                full = builder.sub(n_, rem)
                if kind == "max":
                    x0 = builder.load(data)
                    init = builder.shuffle_vector(builder.insert_element(_ir.Constant(vt, None), x0, _ir.Constant(_I32, 0)),
                                                  _ir.Constant(vt, None), _ir.Constant(_ir.VectorType(_I32, lanes), [0] * lanes))

                    def vop(a, b):                  # a > b ? a : b, x86's maxps
                        return builder.select(builder.fcmp_ordered(">", a, b), a, b)
                    sop = vop
                else:
                    init = _ir.Constant(vt, None)

                    def vop(a, b):
                        return fadd_ordered(builder, a, b)
                    sop = vop
                acc = _cg.alloca_once_value(builder, init)
                with _cg.for_range_slice(builder, _ir.Constant(_I64, 0), full, _ir.Constant(_I64, lanes)) as (i, _):
                    v = builder.load(builder.bitcast(builder.gep(data, [i]), vt.as_pointer()), align=xty.dtype.bitwidth // 8)
                    builder.store(vop(builder.load(acc), v), acc)
                v = builder.load(acc)
                w = lanes
                while w > 1:
                    half = w // 2
                    lo = builder.shuffle_vector(v, v, _ir.Constant(_ir.VectorType(_I32, half), list(range(half))))
                    hi = builder.shuffle_vector(v, v, _ir.Constant(_ir.VectorType(_I32, half), list(range(half, w))))
                    v = vop(lo, hi)
                    w = half
                res = _cg.alloca_once_value(builder, builder.extract_element(v, _ir.Constant(_I32, 0)))
                with _cg.for_range_slice(builder, full, n_, _ir.Constant(_I64, 1)) as (i, _):
                    builder.store(sop(builder.load(res), builder.load(builder.gep(data, [i]))), res)
                return builder.load(res)

            return x.dtype(x, n), codegen
        return intrinsic(typer)

    _lane_max_ir = _make_lane_reduce("max")
    _lane_sum_ir = _make_lane_reduce("sum")

    @overload(lane_max, inline="always")
    def _lane_max_ov(x, n):
        return lambda x, n: _lane_max_ir(x, n)

    @overload(lane_sum, inline="always")
    def _lane_sum_ov(x, n):
        return lambda x, n: _lane_sum_ir(x, n)

    _dot44_ir = _make_dot(4, 4)
    _dot14_ir = _make_dot(1, 4)
    _pv4_ir = _make_pv(4, 2)
    _pv1_ir = _make_pv(1, 2)

    @overload(dot44, inline="always")
    def _dot44_ov(qs, g, kp, t, n, last):
        return lambda qs, g, kp, t, n, last: _dot44_ir(qs, g, kp, t, n, last)

    @overload(dot14, inline="always")
    def _dot14_ov(qs, g, kp, t, n, last):
        return lambda qs, g, kp, t, n, last: _dot14_ir(qs, g, kp, t, n, last)

    @overload(pv4)
    def _pv4_ov(S, g, c, vp, t0, t1, acc, n):
        return lambda S, g, c, vp, t0, t1, acc, n: _pv4_ir(S, g, c, vp, t0, t1, acc, n)

    @overload(pv1)
    def _pv1_ov(S, g, c, vp, t0, t1, acc, n):
        return lambda S, g, c, vp, t0, t1, acc, n: _pv1_ir(S, g, c, vp, t0, t1, acc, n)


_LOG2E_F = np.float32(1.44269504088896341)
_LN2_HI_F = np.float32(0.693359375)
_LN2_LO_F = np.float32(-2.12194440e-4)
_EXP_MIN_F = np.float32(-87.0)
_HALF_F = np.float32(0.5)
_ONE_F = np.float32(1.0)
_C0_F = np.float32(1.9875691500e-4)
_C1_F = np.float32(1.3981999507e-3)
_C2_F = np.float32(8.3334519073e-3)
_C3_F = np.float32(4.1665795894e-2)
_C4_F = np.float32(1.6666665459e-1)
_C5_F = np.float32(5.0000001201e-1)


def _expf_body(x):
    """exp(x) for float32 x <= 0 (Cephes expf: Cody-Waite reduction + degree-6 polynomial, ~1e-7 relative).
    Arguments below -87 are clamped (result ~1e-38: negligible next to the running maximum's weight 1)."""
    x = max(x, _EXP_MIN_F)
    n = np.floor(x * _LOG2E_F + _HALF_F)
    r = x - n * _LN2_HI_F
    r = r - n * _LN2_LO_F
    p = _C0_F * r + _C1_F
    p = p * r + _C2_F
    p = p * r + _C3_F
    p = p * r + _C4_F
    p = p * r + _C5_F
    y = p * (r * r) + r + _ONE_F
    return y * pow2(n)


def exp(x):
    """exp of a non-positive score difference: polynomial in float32, libm exp in float64."""
    if isinstance(x, np.float32):
        return _expf_body(x)
    return math.exp(x)


if JIT:
    _expf_jit = njit(cache=True, fastmath=EXP_FLAGS)(_expf_body)

    @overload(exp)
    def _exp_ov(x):
        if x == types.float32:
            return lambda x: _expf_jit(x)
        if x == types.float64:
            return lambda x: math.exp(x)
        return None


def exp_inline(x):
    """`exp`, inlined into the caller (numba IR) so that a loop calling it vectorises; the caller must compile
    with EXP_FLAGS (no reassociation: it would undo the Cody-Waite split)."""
    return exp(x)


if JIT:
    @overload(exp_inline, inline="always")
    def _exp_inline_ov(x):
        if x == types.float32:
            return _expf_body
        if x == types.float64:
            return lambda x: math.exp(x)
        return None
