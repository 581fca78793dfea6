"""LLVM IR building blocks of the kernels' vector code (`register_blocks`, `bf16_dot`, `int8_simd`, `gemm`, and
`simd`'s lane reductions): row pointers, exact widening loads of storage vectors (float16 / bfloat16 bits, float32
into float64), masked tails, ordered adds, FMAs, the butterfly that reduces many accumulators together, and
the bfloat16 pair widening. Functions of an llvmlite ``builder``; they emit code, they compile nothing.

    lanes_of(numba float type) -> 16 (float32) or 8 (float64)
    WIDE                             whether the target has AVX-512's 32 vector registers (else AVX2's 16 of
                                     256 bits: a 16-lane vector takes two, and the blocks hold fewer at once)
    row_ptr_ir(context, builder, aryty, arr, row) -> pointer to element [row, 0] of a C-contiguous 2-D array
    vload_ir / vload_masked_ir(...) -> <lanes x compute> from storage, widened exactly (`widen_ir`)
    reduce_many_ir(builder, accs, lanes) -> the sums of n accumulators (one butterfly of shuffles)
    transpose16_ir(builder, rows) -> 16 vectors of 16 lanes transposed (a 4-stage shuffle network)
    split3_ir(builder, x) -> the bits of `bf16_dot.split3`'s three exact bfloat16 parts of float32 lanes
"""
from llvmlite import ir as _ir
from numba import types
from numba.core import cgutils as _cg

from kvcache.jit_target import target_has

I32 = _ir.IntType(32)
I64 = _ir.IntType(64)
WIDE = target_has("avx512f")


def lanes_of(nbty):
    """Lanes of a 512-bit vector of a numba float type (the compute dtype)."""
    return 8 if nbty == types.float64 else 16


def row_ptr_ir(context, builder, aryty, arr, row):
    """Pointer to element [row, 0] of a C-contiguous 2-D array."""
    ary = context.make_array(aryty)(context, builder, arr)
    cols = _cg.unpack_tuple(builder, ary.shape, 2)[1]
    return builder.gep(ary.data, [builder.mul(row, cols)])


def widen_ir(builder, x, storage, lanes, vt):
    """A loaded <lanes x storage> vector as <lanes x compute>, exactly: float16 bits (uint16) by fpext,
    bfloat16 bits (int16) by a 16-bit shift into float32's high half, float32 into float64 by fpext."""
    if storage == types.uint16:
        x = builder.fpext(builder.bitcast(x, _ir.VectorType(_ir.HalfType(), lanes)), vt)
    elif storage == types.int16:
        wide = builder.shl(builder.zext(x, _ir.VectorType(I32, lanes)),
                           _ir.Constant(_ir.VectorType(I32, lanes), [16] * lanes))
        x = builder.bitcast(wide, _ir.VectorType(_ir.FloatType(), lanes))
    if x.type != vt:
        x = builder.fpext(x, vt)
    return x


def vload_ir(context, builder, ptr, storage, lanes, vt):
    """<lanes x compute> from ptr (storage element type), widened exactly (`widen_ir`)."""
    ety = context.get_value_type(storage)
    x = builder.load(builder.bitcast(ptr, _ir.VectorType(ety, lanes).as_pointer()), align=storage.bitwidth // 8)
    return widen_ir(builder, x, storage, lanes, vt)

def lane_mask(builder, n, lanes):
    """The <lanes x i1> mask of the lanes below ``n`` (an i64): a masked load's tail of a row."""
    lane_ids = _ir.Constant(_ir.VectorType(I64, lanes), list(range(lanes)))
    splat = builder.insert_element(_ir.Constant(_ir.VectorType(I64, lanes), None), n, _ir.Constant(I32, 0))
    splat = builder.shuffle_vector(splat, _ir.Constant(_ir.VectorType(I64, lanes), None),
                                   _ir.Constant(_ir.VectorType(I32, lanes), [0] * lanes))
    return builder.icmp_signed("<", lane_ids, splat)


def vload_masked_ir(context, builder, ptr, storage, lanes, vt, mask):
    """`vload_ir` of the lanes where mask is set (the others read nothing and are zero)."""
    ety = context.get_value_type(storage)
    it = _ir.VectorType(ety, lanes)
    name = "llvm.masked.load.v%d%s.p0" % (lanes, {16: "i16", 32: "f32", 64: "f64"}[storage.bitwidth])
    fn = _cg.get_or_insert_function(builder.module, _ir.FunctionType(it, [it.as_pointer(), I32, mask.type, it]),
                                    name)
    x = builder.call(fn, [builder.bitcast(ptr, it.as_pointer()), _ir.Constant(I32, storage.bitwidth // 8), mask,
                          _ir.Constant(it, None)])
    return widen_ir(builder, x, storage, lanes, vt)


def fadd_ordered(builder, a, b):
    """a + b that numba's fastmath pass leaves alone: it adds its flags (reassoc among them) only to float
    instructions that carry none, and these carry "nsz". The blocks are inlined into fastmath kernels (numba
    IR), where reassociated sums could be reordered differently in each caller (serial vs parallel kernel:
    other bits on another thread count); the blocks' order is the NumPy twins'."""
    return builder.fadd(a, b, flags=("nsz",))


def fma_ir(builder, vt, lanes):
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
                                   builder.shuffle_vector(a, b, _ir.Constant(_ir.VectorType(I32, lanes), lo)),
                                   builder.shuffle_vector(a, b, _ir.Constant(_ir.VectorType(I32, lanes), hi))))
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
            v = fadd_ordered(builder, builder.shuffle_vector(v, v, _ir.Constant(_ir.VectorType(I32, len(lo)), lo)),
                             builder.shuffle_vector(v, v, _ir.Constant(_ir.VectorType(I32, len(hi)), hi)))
            lab, cur, w = nlab, len(lo), half
        for lane, k in enumerate(lab):
            out[k] = builder.extract_element(v, _ir.Constant(I32, lane))
    return out


def widen_halves_ir(builder, acc):
    """<16 x float> -> <8 x double>: its low and high halves widened exactly and added (one rounding)."""
    dv = _ir.VectorType(_ir.DoubleType(), 8)
    lo = builder.shuffle_vector(acc, acc, _ir.Constant(_ir.VectorType(I32, 8), list(range(8))))
    hi = builder.shuffle_vector(acc, acc, _ir.Constant(_ir.VectorType(I32, 8), list(range(8, 16))))
    return fadd_ordered(builder, builder.fpext(lo, dv), builder.fpext(hi, dv))


def bf16_pairs_ir(builder, x):
    """<16 x i32> holding 32 bfloat16 (element 2j in the low half of lane j) -> (<16 x float> of the even
    elements, <16 x float> of the odd ones), exactly: a 16-bit shift, and a mask of the high halves."""
    i32v = _ir.VectorType(I32, 16)
    fv = _ir.VectorType(_ir.FloatType(), 16)
    even = builder.shl(x, _ir.Constant(i32v, [16] * 16))
    odd = builder.and_(x, _ir.Constant(i32v, [0xFFFF0000 - (1 << 32)] * 16))
    return builder.bitcast(even, fv), builder.bitcast(odd, fv)


def transpose16_ir(builder, rows):
    """16 vectors of 16 lanes transposed, out[k][i] = rows[i][k]: four stages, each swapping one bit of the row
    index with the same bit of the lane index (two-source shuffles)."""
    vi = _ir.VectorType(I32, 16)
    for bit in (1, 2, 4, 8):
        new = list(rows)
        for a in range(16):
            if a & bit:
                continue
            b = a | bit
            lo = [j if not j & bit else 16 + (j ^ bit) for j in range(16)]    # a[j] or b[j ^ bit]
            hi = [(j | bit) if not j & bit else 16 + j for j in range(16)]    # a[j | bit] or b[j]
            new[a] = builder.shuffle_vector(rows[a], rows[b], _ir.Constant(vi, lo))
            new[b] = builder.shuffle_vector(rows[a], rows[b], _ir.Constant(vi, hi))
        rows = new
    return rows


def split3_ir(builder, x):
    """`bf16_dot.split3` on a vector of float32 lanes: the int32 bits (hi, r1, r2) of x, r1 = x - hi and r2 = r1 -
    mid (hi / mid: the high halves of x / r1), whose high halves are the three bfloat16 parts (hi + mid + lo == x
    for every normal float). The differences are exact: no flag the kernels compile with (nnan, ninf, nsz,
    contract; never reassoc) can change them."""
    n = x.type.count
    vi = _ir.VectorType(I32, n)
    high = _ir.Constant(vi, [-65536] * n)                   # 0xFFFF0000
    u = builder.bitcast(x, vi)
    r1 = builder.fsub(x, builder.bitcast(builder.and_(u, high), x.type))
    u1 = builder.bitcast(r1, vi)
    u2 = builder.bitcast(builder.fsub(r1, builder.bitcast(builder.and_(u1, high), x.type)), vi)
    return u, u1, u2
