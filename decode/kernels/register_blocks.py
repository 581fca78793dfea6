"""Vector micro-kernels written directly in LLVM IR: the register blocks LLVM cannot derive from scalar loops
(several dot products reduced together by one butterfly of shuffles instead of one horizontal sum each, and PV
accumulators kept in registers over a whole chunk of value rows). Each has a plain-NumPy twin for
NUMBA_DISABLE_JIT. Vectors are 16 float32 or 8 float64 lanes (`vector_ir`). The dot blocks take any `n` (a last,
masked vector for n % lanes); the PV blocks process `n` (a multiple of 32) elements, the callers handle the tail.

    dot44(qs, g, kp, t, n, last) -> 16 dot products (4 query heads x 4 key rows)
    dot14(qs, g, kp, t, n, last) -> 4 (1 head x 4 rows)
    pv4 / pv1(S, g, c, vp, t0, t1, acc, n)   acc[g + a, :n] += weights . value rows (4 heads / 1 head)
    in_pairs(vp, acc) / unpair(x, n)         bfloat16 values keep acc's lanes in the pair order / back to dims
    pair_rows(vp, t0, t1, dst)               bfloat16 value rows widened into float32 rows in the pair order
    pair_dim(k)                              the dim lane k of the pair order holds
    row_f(x)                                 a storage row as compute values (NumPy; the twins' widening)
    testing_blocks(per_head)                 dot44 / pv4 with AVX-512's or AVX2's passes, for tests

On a target with AVX-512 the 4-head blocks take every head in one pass over the rows (16 / 8 of its 32 registers
of sums); without it (`vector_ir.WIDE` False: AVX2's 16 256-bit registers, two per 16-lane vector) `_dot44` one
head per pass, `_pv4` two (`head_groups`, `PV_HEADS`), each sum the same chain (the same bits) either way.
"""
import numpy as np
from numba import njit
from numba.extending import intrinsic, overload

from .simd import JIT, ld


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


def pv4(S, g, c, vp, t0, t1, acc, n):
    """acc[g + a, :n] += sum_t S[g + a, c + t - t0] * vp[t, :n] over t in [t0, t1), a < 4 (acc's lanes in the pair
    order where `in_pairs`)."""
    for a in range(4):
        pv1(S, g + a, c, vp, t0, t1, acc, n)


def pv1(S, g, c, vp, t0, t1, acc, n):
    """acc[g, :n] += sum_t S[g, c + t - t0] * vp[t, :n] over t in [t0, t1) (one head; acc's lanes in the pair order
    where `in_pairs`)."""
    add = S[g, c:c + t1 - t0] @ row_f(vp[t0:t1, :n])
    if in_pairs(vp, acc):
        add = add[pair_dim(np.arange(n))]                                 # dims -> the pair order
    acc[g, :n] += add


def in_pairs(vp, acc):
    """Whether the PV blocks keep ``acc``'s lanes, strip by strip of 32 (the first ``n``, a multiple of 32, that
    they process), in the pair order: lanes 0-15 of a strip hold its even dims, 16-31 its odd dims, the order a
    bfloat16 value row's pairs widen into (by a shift and a mask, `vector_ir.bf16_pairs_ir`). So for bfloat16
    values (int16 bits) into float32 accumulators; whoever reads the accumulators' lanes by dim takes them back
    with `unpair` (the online softmax only scales whole rows)."""
    return vp.dtype == np.int16 and acc.dtype == np.float32


@njit(cache=True, inline="always")
def pair_dim(k):
    """The dim that lane ``k`` of the pair order holds (`in_pairs`): its strip's first dim + 2 * (k mod 16) + 1 for
    the strip's upper 16 lanes. Elementwise over an integer array too (the NumPy twins)."""
    return (k - k % 32) + 2 * (k % 16) + (k // 16) % 2


@njit(cache=True)
def unpair(x, n):
    """The first ``n`` lanes (a multiple of 32) of every row of ``x`` [rows, width] from the pair order (`in_pairs`)
    back to dims, in place."""
    tmp = np.empty(32, x.dtype)
    for r in range(x.shape[0]):
        row = x[r]
        for s in range(0, n, 32):
            for j in range(32):
                tmp[j] = row[s + j]
            for j in range(32):
                row[s + pair_dim(j)] = tmp[j]


def pair_rows(vp, t0, t1, dst):
    """dst[t - t0, :] = value row t of vp (bfloat16 bits, int16) as float32 (t in [t0, t1)), each whole strip of 32
    lanes in the pair order (`in_pairs`: PV over these rows leaves its accumulators in the order PV over vp
    itself would), the last ``width % 32`` by dim."""
    n = vp.shape[1] - vp.shape[1] % 32
    rows = row_f(vp[t0:t1])
    dst[:t1 - t0, :n] = rows[:, :n][:, pair_dim(np.arange(n))]
    dst[:t1 - t0, n:] = rows[:, n:]


if JIT:
    from llvmlite import ir as _ir
    from numba import types
    from numba.core import cgutils as _cg

    from .vector_ir import (I32, I64, WIDE, bf16_pairs_ir, fma_ir, lane_mask, lanes_of, reduce_many_ir,
                            row_ptr_ir, vload_ir, vload_masked_ir)

    PV_HEADS = 2     # heads a `_pv4` pass takes on AVX2 (2 heads x 2 vectors: 8 ymm of sums, 4 more for a value
                     # row): the per-query kernel took 0.86-1.01x (median ~0.93) the time of one head a pass at
                     # G = 4 / 8 (in-process A/B on the Zen 3 guest, bitwise the same outputs)

    def head_groups(ng, per_head=None, narrow=1):
        """The heads a block's passes take: all at once where the target has AVX-512's 32 registers, else `narrow`
        per pass (AVX2's 16: 4 heads' accumulators would spill; the per-query kernel took up to 1.5x longer at G >= 4
        on a Zen 3). per_head: force one (True) or the other (False) choice, for tests."""
        if per_head is None:
            per_head = not WIDE
        return [range(a, min(ng, a + narrow)) for a in range(0, ng, narrow)] if per_head else [range(ng)]

    def _make_dot(ng, nt, per_head=None):
        def typer(typingctx, qs, g, kp, t, n, last):
            if not (isinstance(qs, types.Array) and isinstance(kp, types.Array) and qs.ndim == 2 and kp.ndim == 2
                    and isinstance(qs.dtype, types.Float)):
                return None

            def codegen(context, builder, sig, args):
                qty, _, kty, _, _, _ = sig.args
                lanes = lanes_of(qty.dtype)
                ft = context.get_value_type(qty.dtype)
                vt = _ir.VectorType(ft, lanes)
                g_, t_, n_, last_ = (context.cast(builder, args[i], sig.args[i], types.int64) for i in (1, 3, 4, 5))
                qrows = [row_ptr_ir(context, builder, qty, args[0], builder.add(g_, _ir.Constant(I64, a))) for a in range(ng)]
                kidx = [builder.add(t_, _ir.Constant(I64, b)) for b in range(nt)]
                kidx = [builder.select(builder.icmp_signed(">", k, last_), last_, k) for k in kidx]
                krows = [row_ptr_ir(context, builder, kty, args[2], k) for k in kidx]
                slots = [_cg.alloca_once_value(builder, _ir.Constant(vt, None)) for _ in range(ng * nt)]
                fma = fma_ir(builder, vt, lanes)
                rem = builder.srem(n_, _ir.Constant(I64, lanes))
                full = builder.sub(n_, rem)

                def step(i, load, heads):
                    qv = {a: load(builder.gep(qrows[a], [i]), qty.dtype) for a in heads}
                    kv = [load(builder.gep(r, [i]), kty.dtype) for r in krows]
                    for a in heads:
                        for b in range(nt):
                            sl = slots[a * nt + b]
                            builder.store(builder.call(fma, [qv[a], kv[b], builder.load(sl)]), sl)

                # AVX-512: every head's sums in one pass (4 x 4 sums: 16 of the 32 registers); AVX2 (`WIDE` False:
                # 16 registers, a 16-lane vector takes two): a pass per head. Each sum is the same chain either way.
                for heads in head_groups(ng, per_head):
                    with _cg.for_range_slice(builder, _ir.Constant(I64, 0), full, _ir.Constant(I64, lanes)) as (i, _):
                        step(i, lambda ptr, st: vload_ir(context, builder, ptr, st, lanes, vt), heads)
                    with builder.if_then(builder.icmp_signed(">", rem, _ir.Constant(I64, 0)), likely=False):
                        mask = lane_mask(builder, rem, lanes)
                        step(full, lambda ptr, st: vload_masked_ir(context, builder, ptr, st, lanes, vt, mask), heads)
                sums = reduce_many_ir(builder, [builder.load(sl) for sl in slots], lanes)
                return context.make_tuple(builder, sig.return_type, sums)

            return types.UniTuple(qs.dtype, ng * nt)(qs, g, kp, t, n, last), codegen
        return intrinsic(typer)

    def _make_pv(ng, nvec, per_head=None):
        def typer(typingctx, S, g, c, vp, t0, t1, acc, n):
            if not (isinstance(S, types.Array) and isinstance(vp, types.Array) and isinstance(acc, types.Array)):
                return None

            def codegen(context, builder, sig, args):
                sty, _, _, vty, _, _, aty, _ = sig.args
                lanes = lanes_of(aty.dtype)
                ft = context.get_value_type(aty.dtype)
                vt = _ir.VectorType(ft, lanes)
                g_, c_, t0_, t1_, n_ = (context.cast(builder, args[i], sig.args[i], types.int64) for i in (1, 2, 4, 5, 7))
                arows = [row_ptr_ir(context, builder, aty, args[6], builder.add(g_, _ir.Constant(I64, a))) for a in range(ng)]
                srows = [builder.gep(row_ptr_ir(context, builder, sty, args[0], builder.add(g_, _ir.Constant(I64, a))),
                                     [builder.sub(c_, t0_)]) for a in range(ng)]
                vary = context.make_array(vty)(context, builder, args[3])
                vcols = _cg.unpack_tuple(builder, vary.shape, 2)[1]
                slots = [_cg.alloca_once(builder, vt) for _ in range(ng * nvec)]
                fma = fma_ir(builder, vt, lanes)
                strip = lanes * nvec
                # bfloat16 values: the 32 accumulator lanes of a strip are kept in the pair order (`in_pairs`: even
                # dims, then odd dims), the order a row's pairs widen into (the same FMAs, in the same order, as
                # widening each row: no shuffle per row, nor per call)
                pairs = vty.dtype == types.int16 and lanes == 16 and nvec == 2
                splat = _ir.Constant(_ir.VectorType(I32, lanes), [0] * lanes)

                def one_pass(heads, d):
                    """acc[g + a, d : d + strip] += the rows' weighted sum for the heads a in ``heads``."""
                    for a in heads:
                        ptrs = [builder.gep(arows[a], [builder.add(d, _ir.Constant(I64, k * lanes))])
                                for k in range(nvec)]
                        av = [builder.load(builder.bitcast(p, vt.as_pointer()), align=4) for p in ptrs]
                        for k in range(nvec):
                            builder.store(av[k], slots[a * nvec + k])
                    with _cg.for_range_slice(builder, t0_, t1_, _ir.Constant(I64, 1)) as (t, _):
                        vrow = builder.gep(vary.data, [builder.add(builder.mul(t, vcols), d)])
                        if pairs:       # 32 bfloat16 as 16 x i32: even elements by a shift, odd ones by a mask
                            x = builder.load(builder.bitcast(vrow, _ir.VectorType(I32, 16).as_pointer()), align=2)
                            vv = list(bf16_pairs_ir(builder, x))
                        else:
                            vv = [vload_ir(context, builder, builder.gep(vrow, [_ir.Constant(I64, k * lanes)]),
                                           vty.dtype, lanes, vt) for k in range(nvec)]
                        for a in heads:
                            w = builder.load(builder.gep(srows[a], [t]))
                            wv = builder.shuffle_vector(builder.insert_element(_ir.Constant(vt, None), w,
                                                                               _ir.Constant(I32, 0)),
                                                        _ir.Constant(vt, None), splat)
                            for k in range(nvec):
                                sl = slots[a * nvec + k]
                                builder.store(builder.call(fma, [wv, vv[k], builder.load(sl)]), sl)
                    for a in heads:
                        av = [builder.load(slots[a * nvec + k]) for k in range(nvec)]
                        for k in range(nvec):
                            p = builder.gep(arows[a], [builder.add(d, _ir.Constant(I64, k * lanes))])
                            builder.store(av[k], builder.bitcast(p, vt.as_pointer()), align=4)

                with _cg.for_range_slice(builder, _ir.Constant(I64, 0), n_, _ir.Constant(I64, strip)) as (d, _):
                    # AVX-512: every head over one pass of the value rows (4 x 2 vectors: 8 of the 32 registers);
                    # AVX2: two heads a pass (`PV_HEADS`: 8 of the 16 registers). The same chains either way.
                    for heads in head_groups(ng, per_head, PV_HEADS):
                        one_pass(heads, d)
                return context.get_dummy_value()

            return types.void(S, g, c, vp, t0, t1, acc, n), codegen
        return intrinsic(typer)


    _dot44_ir = _make_dot(4, 4)
    _dot14_ir = _make_dot(1, 4)
    _pv4_ir = _make_pv(4, 2)
    _pv1_ir = _make_pv(1, 2)
    _forced = {p: (_make_dot(4, 4, p), _make_pv(4, 2, p)) for p in (False, True)}   # `testing_blocks`

    @overload(dot44, inline="always")
    def _dot44_ov(qs, g, kp, t, n, last):
        return lambda qs, g, kp, t, n, last: _dot44_ir(qs, g, kp, t, n, last)

    @overload(dot14, inline="always")
    def _dot14_ov(qs, g, kp, t, n, last):
        return lambda qs, g, kp, t, n, last: _dot14_ir(qs, g, kp, t, n, last)

    @overload(pv4)
    def _pv4_ov(S, g, c, vp, t0, t1, acc, n):
        return lambda S, g, c, vp, t0, t1, acc, n: _pv4_ir(S, g, c, vp, t0, t1, acc, n)

    @overload(in_pairs)
    def _in_pairs_ov(vp, acc):
        answer = (isinstance(vp, types.Array) and vp.dtype == types.int16 and isinstance(acc, types.Array)
                  and acc.dtype == types.float32)
        return lambda vp, acc: answer

    @overload(pv1)
    def _pv1_ov(S, g, c, vp, t0, t1, acc, n):
        return lambda S, g, c, vp, t0, t1, acc, n: _pv1_ir(S, g, c, vp, t0, t1, acc, n)

    @intrinsic
    def _pair_strips_ir(typingctx, vp, t0, t1, dst):
        """Rows [t0, t1) of vp (int16 bfloat16 bits), their whole strips of 32, into dst's rows from 0 (float32)."""
        if not (isinstance(vp, types.Array) and isinstance(dst, types.Array) and vp.dtype == types.int16
                and dst.dtype == types.float32):
            return None

        def codegen(context, builder, sig, args):
            vty, _, _, dty = sig.args
            t0_, t1_ = (context.cast(builder, args[i], sig.args[i], types.int64) for i in (1, 2))
            vary = context.make_array(vty)(context, builder, args[0])
            vcols = _cg.unpack_tuple(builder, vary.shape, 2)[1]
            n = builder.sub(vcols, builder.srem(vcols, _ir.Constant(I64, 32)))
            fv = _ir.VectorType(_ir.FloatType(), 16)
            with _cg.for_range_slice(builder, t0_, t1_, _ir.Constant(I64, 1)) as (t, _):
                src = builder.gep(vary.data, [builder.mul(t, vcols)])
                out = row_ptr_ir(context, builder, dty, args[3], builder.sub(t, t0_))
                with _cg.for_range_slice(builder, _ir.Constant(I64, 0), n, _ir.Constant(I64, 32)) as (d, _):
                    x = builder.load(builder.bitcast(builder.gep(src, [d]), _ir.VectorType(I32, 16).as_pointer()),
                                     align=2)
                    even, odd = bf16_pairs_ir(builder, x)
                    builder.store(even, builder.bitcast(builder.gep(out, [d]), fv.as_pointer()), align=4)
                    builder.store(odd, builder.bitcast(builder.gep(out, [builder.add(d, _ir.Constant(I64, 16))]),
                                                       fv.as_pointer()), align=4)
            return context.get_dummy_value()

        return types.void(vp, t0, t1, dst), codegen

    @overload(pair_rows, inline="always")
    def _pair_rows_ov(vp, t0, t1, dst):
        def impl(vp, t0, t1, dst):
            _pair_strips_ir(vp, t0, t1, dst)
            W = vp.shape[1]
            for t in range(t0, t1):
                src = vp[t]
                row = dst[t - t0]
                for d in range(W - W % 32, W):
                    row[d] = ld(src[d])
        return impl


def testing_blocks(per_head: bool):
    """(dot44, pv4) as jitted callables for tests, compiled with the heads in one pass (per_head=False, AVX-512's
    blocks) or AVX2's passes (True: one head a pass for dot44, `PV_HEADS` for pv4), whatever the CPU: dot44(qs,
    g, kp, t, n, last) -> an array [16]; pv4(S, g, c, vp, t0, t1, acc, n) adds into acc. Without the JIT: the twins."""
    if not JIT:
        return (lambda *a: np.array(dot44(*a))), pv4
    d44, p4 = _forced[per_head]

    @njit
    def dot(qs, g, kp, t, n, last):
        r = d44(qs, g, kp, t, n, last)
        out = np.empty(16, qs.dtype)
        for i in range(16):
            out[i] = r[i]
        return out

    @njit
    def pv(S, g, c, vp, t0, t1, acc, n):
        p4(S, g, c, vp, t0, t1, acc, n)
    return dot, pv
