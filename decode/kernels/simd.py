"""Scalar and SIMD helpers shared by the kernels: storage element loads (float16 bits -> float32), prefetch hints,
page touches (`touch_pages`), borrowed arrays, exact 2**n, the softmax block's lane reductions (`lane_max`,
`lane_sum`) and a polynomial exp (the dot / PV register blocks are `register_blocks`, the IR they are built of
`vector_ir`).
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


def zeros64(rows, cols, like):
    """A zero array [rows, cols] of like's dtype whose first element lies on a 64-byte boundary (a tile's rows must:
    an unaligned tile load measured ~6x slower), C-contiguous."""
    n = rows * cols
    flat = np.zeros(n + 64 // like.itemsize, like.dtype)
    off = (-flat.ctypes.data % 64) // like.itemsize
    return flat[off:off + n].reshape((rows, cols))


if JIT:
    zeros64 = njit(cache=True)(zeros64)
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


if JIT:
    from numba.core import cgutils as _cg

    from .vector_ir import I32, I64, fadd_ordered, lanes_of

    def _make_lane_reduce(kind):
        """`lane_max` / `lane_sum` in IR: <lanes x T> running maxima (compare and select) or sums (`fadd_ordered`)
        over whole vectors, the halves combined down to one lane, then the tail in order."""
        def typer(typingctx, x, n):
            if not (isinstance(x, types.Array) and x.ndim == 1 and isinstance(x.dtype, types.Float)
                    and isinstance(n, types.Integer)):
                return None

            def codegen(context, builder, sig, args):
                xty = sig.args[0]
                lanes = lanes_of(xty.dtype)
                ft = context.get_value_type(xty.dtype)
                vt = _ir.VectorType(ft, lanes)
                data = context.make_array(xty)(context, builder, args[0]).data
                n_ = context.cast(builder, args[1], sig.args[1], types.int64)
                rem = builder.srem(n_, _ir.Constant(I64, lanes))
                full = builder.sub(n_, rem)
                if kind == "max":
                    x0 = builder.load(data)
                    init = builder.shuffle_vector(builder.insert_element(_ir.Constant(vt, None), x0, _ir.Constant(I32, 0)),
                                                  _ir.Constant(vt, None), _ir.Constant(_ir.VectorType(I32, lanes), [0] * lanes))

                    def vop(a, b):                  # a > b ? a : b, x86's maxps
                        return builder.select(builder.fcmp_ordered(">", a, b), a, b)
                    sop = vop
                else:
                    init = _ir.Constant(vt, None)

                    def vop(a, b):
                        return fadd_ordered(builder, a, b)
                    sop = vop
                acc = _cg.alloca_once_value(builder, init)
                with _cg.for_range_slice(builder, _ir.Constant(I64, 0), full, _ir.Constant(I64, lanes)) as (i, _):
                    v = builder.load(builder.bitcast(builder.gep(data, [i]), vt.as_pointer()), align=xty.dtype.bitwidth // 8)
                    builder.store(vop(builder.load(acc), v), acc)
                v = builder.load(acc)
                w = lanes
                while w > 1:
                    half = w // 2
                    lo = builder.shuffle_vector(v, v, _ir.Constant(_ir.VectorType(I32, half), list(range(half))))
                    hi = builder.shuffle_vector(v, v, _ir.Constant(_ir.VectorType(I32, half), list(range(half, w))))
                    v = vop(lo, hi)
                    w = half
                res = _cg.alloca_once_value(builder, builder.extract_element(v, _ir.Constant(I32, 0)))
                with _cg.for_range_slice(builder, full, n_, _ir.Constant(I64, 1)) as (i, _):
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
# the float32 exp's constants, for code that emits the same polynomial itself (`tile_softmax`'s IR): the clamp,
# log2(e), ln 2's two halves, the polynomial's coefficients C0..C5
EXPF_CONSTANTS = (_EXP_MIN_F, _LOG2E_F, _LN2_HI_F, _LN2_LO_F, (_C0_F, _C1_F, _C2_F, _C3_F, _C4_F, _C5_F))


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

