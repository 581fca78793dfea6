"""Scores over bfloat16 pages with AVX512-BF16 `vdpbf16ps` (32 bfloat16 products summed pairwise into 16 float32
lanes per instruction, twice the products of a float32 FMA and no widening of the key rows).

The query is split exactly into bfloat16 parts by truncation: hi = the high half of each float32, mid = the high
half of q - hi, lo = q - hi - mid (8 + 8 + 8 significand bits: q = hi + mid + lo exactly for every normal float32).
A bfloat16 model's q has zero low halves: one part. A product of two bfloat16 is exact in float32, so a score's
only roundings are its float32 additions, as on the widen-and-FMA path (`register_blocks.dot44`). vdpbf16ps reads bfloat16
subnormals as zero and flushes subnormal float32 sums to zero (|x| < 2**-126, far below the 1e-6 budget).

How a query's scores are computed (`mode`, a run-time argument of the per-query kernel, set by the plan from
`plan_mode`; a run-time value, so one compiled kernel serves every mode and numba's cache never holds a stale
choice):
    0  `register_blocks.dot44` / `dot14` on q itself (key rows widened by zero-extension and a shift); the
       default where the CPU has AMX (`default_mode`)
    1  vdpbf16ps where q is exactly bfloat16 (one part) and a kv head has >= MIN_GROUP q heads; otherwise as 0
       (measured: below 4 heads the 1 x 4 block is latency-bound and vdpbf16ps loses; a float32 q would need 3
       parts, each as costly as the shift path's FMAs); the default elsewhere
    2  vdpbf16ps for every query (2 or 3 parts where q is not bfloat16)
    3  two FMAs per pair of lanes over q's float32 (even, odd) halves, key rows widened by a shift and a mask
       (no shuffle); measured no faster than 0, kept as an option
A part that is zero adds exact zeros, so a bfloat16 q gets the same bits in modes 1 and 2.

    split_query(qi, qb, qf, mode) -> parts  one query q [Hq, D] float32 -> qb [H, G, 3 * Dp] int16 parts (Dp = D
                                            rounded up to 32, zero padded; parts 1-3) or qf [H, G, Dp] float32
                                            halves (parts -1); 0: mode 0 / not bfloat16 pages
    dot44_bf / dot14_bf                     the register blocks (4 heads x 4 keys, 1 x 4), LLVM IR; NumPy twins:
                                            `blocks.qk`'s loop runs them (qb int16 parts, or qf float32 halves
                                            with parts 1) as it runs `register_blocks.dot44` / `dot14` on q itself

Without avx512bf16 (`HOST` False) the IR blocks compute the same sums with a 16-bit shift / mask and two FMAs
per pair of lanes (`native=False`, bit for bit the instruction's sums); the plan keeps such machines on mode 0.
"""
import os

import numpy as np
from numba import njit, types
from numba.extending import intrinsic, overload

from kvcache.jit_target import target_has

from .simd import JIT

LANES = 32                      # bfloat16 elements per 512-bit vector
PARTS = 3                       # bfloat16 parts of a float32 q (8 significand bits each)
MODE_ENV = "KVENGINE_BF16_DOT"  # "0" - "3": override the default mode at import (A/B measurements)
DEFAULT_MODE = 1                # where the CPU has no AMX (the Zen 4 guest: vdpbf16ps measured faster there)
AMX_MODE = 0                    # where it has (the Intel guest: the shift path 2-10% faster, `default_mode`)
MIN_GROUP = 4                   # mode 1: q heads per kv head from which vdpbf16ps pays (the 4 x 4 block; measured)
HOST = target_has("avx512bf16")    # the compilation target has AVX512-BF16 (NUMBA_CPU_FEATURES, else the host's;
                                   # never under a NUMBA_CPU_NAME alone: `kvcache.jit_target.target_has`)
AMX_HOST = target_has("amx-bf16")  # the CPU has AMX-BF16 (`default_mode`)


def env_mode() -> int | None:
    """The mode ``$KVENGINE_BF16_DOT`` sets ("0" - "3"; unset or empty: None, the CPU's `default_mode`)."""
    raw = os.environ.get(MODE_ENV, "")
    if raw not in ("", "0", "1", "2", "3"):
        raise ValueError(f"{MODE_ENV}: expected 0, 1, 2 or 3, got {raw!r}")
    return int(raw) if raw else None


MODE = env_mode()               # the mode plans use where the CPU has avx512bf16; None: `default_mode` (tests set
                                # it, as $KVENGINE_BF16_DOT does at import)


def default_mode() -> int:
    """The mode where neither `MODE` nor the environment chose one: AMX_MODE where the CPU has AMX-BF16
    (AMX_HOST), else DEFAULT_MODE. On the Intel guest with AMX, a bfloat16 q's scores by the shift path (0)
    measured 2-10% faster than by vdpbf16ps (1) over GQA-8 decode and batched decode (2 threads, 4096 and 32768
    tokens, 64 x 256 and 32 x 1024, modes alternated twice; one thread 1.37 -> 1.30 ms a step at 4096 tokens, also
    at G 8 and head_dim 64), where on the Zen 4 guest (no AMX) vdpbf16ps was the faster (`MIN_GROUP`'s
    measurement). Likely why: that Intel core retires two 512-bit FMAs a cycle (7 a ns measured, docs/kernel.md),
    so the widening vdpbf16ps saves is cheap there. The queries the AMX tiles take do not use the mode."""
    return AMX_MODE if AMX_HOST else DEFAULT_MODE


def plan_mode() -> int:
    """The mode a plan passes to the kernel: `MODE` (``$KVENGINE_BF16_DOT`` at import, or as set), else
    `default_mode()`, where the CPU has avx512bf16; 0 elsewhere."""
    if not HOST:
        return 0
    return default_mode() if MODE is None else MODE


def tile_mode() -> int:
    """The tiled kernel's choice (`pair_scores`): 1 (scores over bfloat16 pairs for tiles whose q is exactly
    bfloat16) where the plan's mode takes vdpbf16ps (1 or 2), else 0 (the widened path)."""
    return 1 if plan_mode() in (1, 2) else 0


def padded(head_dim: int) -> int:
    """Elements per part in a query buffer: head_dim rounded up to whole vectors."""
    return -(-head_dim // LANES) * LANES


# --------------------------------------------------------------------------------------------------------------
# the query split
# --------------------------------------------------------------------------------------------------------------
def _split_body(qf, qu, qb, Dp):
    """qb[r, p * Dp + d] = part p of qf[r, d] (bits as int16) for rows r; returns how many parts are nonzero (1-3).
    qf [R, D] float32, qu its uint32 view; qb [R, 3 * Dp] int16, zero beyond D."""
    R, D = qf.shape
    m1 = np.uint32(0)
    m2 = np.uint32(0)
    for r in range(R):
        x, u, dst = qf[r], qu[r], qb[r]
        for d in range(D):
            _, u1, u2 = split3(x[d], u[d])
            dst[d] = _high(u[d])
            dst[Dp + d] = _high(u1)
            dst[2 * Dp + d] = _high(u2)
            m1 |= u1 & np.uint32(0x7FFFFFFF)
            m2 |= u2 & np.uint32(0x7FFFFFFF)
    return 3 if m2 else (2 if m1 else 1)


def split3(x, u):
    """The exact split of one float32 ``x`` (``u``: its bits) into bfloat16 parts by truncation: (hi, mid, lo) as
    uint32 bits whose high halves are the parts (hi = x's high half, mid = that of x - hi, lo = x - hi - mid, whose
    low half is zero: hi + mid + lo == x for every normal float32). No fastmath around it: x - hi must be exact."""
    hi = u & np.uint32(0xFFFF0000)
    r1 = x - _u2f(hi)
    u1 = _f2u(r1)
    return hi, u1, _f2u(r1 - _u2f(u1 & np.uint32(0xFFFF0000)))


def _high(u):
    """The high half of uint32 bits as int16 (the same 16 bits)."""
    return np.int16(np.int32(u >> np.uint32(16)) - (np.int32(u >> np.uint32(31)) << 16))


def _exact_body(qu):
    """Whether every element of the uint32 view qu [R, D] of a float32 array is a bfloat16 (low halves zero)."""
    R, D = qu.shape
    low = np.uint32(0)
    for r in range(R):
        row = qu[r]
        for d in range(D):
            low |= row[d] & np.uint32(0xFFFF)
    return low == 0


def split_query(qi, qb, qf, mode):
    """Prepare one query qi [Hq, D] float32 for the scores over bfloat16 pages; qb [H, G, 3 * Dp] int16, qf [H, G,
    Dp] float32 (H * G = Hq; empty: pages not bfloat16 or q.k not in float32). Returns what the scores use:
    1-3: that many bfloat16 parts in qb (vdpbf16ps); -1: q's float32 (even, odd) halves in qf (two FMAs per
    pair); 0: neither (`register_blocks.dot44` on q itself)."""
    if mode == 0 or qb.size == 0:
        return 0
    if mode == 3:
        _pairs(qi, qf.reshape((qi.shape[0], qf.shape[2])))
        return -1
    qu = qi.view(np.uint32)
    if mode == 1 and (qb.shape[1] < MIN_GROUP or not _exact(qu)):
        return 0
    if _exact(qu):
        _hi(qu, qb.reshape((qi.shape[0], qb.shape[2])))
        return 1
    return _split(qi, qu, qb.reshape((qi.shape[0], qb.shape[2])), qb.shape[2] // PARTS)


def _hi_body(qu, qb):
    """qb[r, :D] = the high halves of the uint32 view qu [R, D] (q exactly bfloat16: its one part)."""
    R, D = qu.shape
    for r in range(R):
        src, dst = qu[r], qb[r]
        for d in range(D):
            dst[d] = _high(src[d])


def q_buffers(k_pages, qs):
    """The buffers of `split_query` for qs [H, G, D]: (int16 [H, G, 3 * Dp], float32 [H, G, Dp]) for bfloat16
    pages (int16 bits) and float32 q.k, else empty ones [H, 0, 0] (indexable per kv head, never read)."""
    H, G, D = qs.shape
    if k_pages.dtype == np.int16 and qs.dtype == np.float32:
        return np.zeros((H, G, PARTS * padded(D)), np.int16), np.zeros((H, G, padded(D)), np.float32)
    return np.zeros((H, 0, 0), np.int16), np.zeros((H, 0, 0), np.float32)


def _pairs_body(qi, qf):
    """qf[r, i + j] = qi[r, i + 2j], qf[r, i + 16 + j] = qi[r, i + 2j + 1] for each block of 32 at i (j < 16), zero
    beyond D: the order `_dp_pairs` reads."""
    R, D = qi.shape
    half = LANES // 2
    full = D - D % LANES
    for r in range(R):
        src, dst = qi[r], qf[r]
        for i in range(0, full, LANES):
            for j in range(half):
                dst[i + j] = src[i + 2 * j]
                dst[i + half + j] = src[i + 2 * j + 1]
        for d in range(full, D):
            j = d - full
            dst[full + j // 2 + half * (j % 2)] = src[d]


def _unpair(row):
    """The inverse of `_pairs_body` on one padded row (NumPy)."""
    out = np.empty_like(row)
    for i in range(0, len(row), LANES):
        out[i:i + LANES:2] = row[i:i + LANES // 2]
        out[i + 1:i + LANES:2] = row[i + LANES // 2:i + LANES]
    return out


def _f2u(x):
    return np.float32(x).view(np.uint32)


def _u2f(u):
    return np.uint32(u).view(np.float32)


if JIT:
    from llvmlite import ir as _ir

    @intrinsic
    def _f2u_ir(typingctx, x):
        if x != types.float32:
            return None
        return types.uint32(x), lambda context, builder, sig, args: builder.bitcast(args[0], _ir.IntType(32))

    @intrinsic
    def _u2f_ir(typingctx, u):
        """The low 32 bits of an unsigned integer as a float32 (numba widens uint32 arithmetic to uint64)."""
        if not isinstance(u, types.Integer) or u.bitwidth < 32:
            return None

        def codegen(context, builder, sig, args):
            x = args[0] if sig.args[0].bitwidth == 32 else builder.trunc(args[0], _ir.IntType(32))
            return builder.bitcast(x, _ir.FloatType())
        return types.float32(u), codegen

    @overload(_f2u, inline="always")
    def _f2u_ov(x):
        return lambda x: _f2u_ir(x)

    @overload(_u2f, inline="always")
    def _u2f_ov(u):
        return lambda u: _u2f_ir(u)

    _high = njit(inline="always")(_high)
    split3 = njit(inline="always")(split3)
    _split = njit(cache=True)(_split_body)          # no fastmath: q - hi must be the exact difference
    _exact = njit(cache=True)(_exact_body)
    _pairs = njit(cache=True)(_pairs_body)
    _hi = njit(cache=True)(_hi_body)

    @overload(split_query)
    def _split_query_ov(qi, qb, qf, mode):
        if qi.dtype != types.float32:                   # float64 q (float64 storage): never bfloat16 pages
            return lambda qi, qb, qf, mode: 0
        return split_query          # its body compiles as is (it calls only jitted helpers)

    @overload(q_buffers)
    def _q_buffers_ov(k_pages, qs):
        if k_pages.dtype == types.int16 and qs.dtype == types.float32:
            def impl(k_pages, qs):
                H, G, D = qs.shape
                Dp = -(-D // LANES) * LANES
                return np.zeros((H, G, PARTS * Dp), np.int16), np.zeros((H, G, Dp), np.float32)
            return impl
        return lambda k_pages, qs: (np.zeros((qs.shape[0], 0, 0), np.int16),
                                    np.zeros((qs.shape[0], 0, 0), np.float32))
else:
    _split, _exact, _pairs, _hi = _split_body, _exact_body, _pairs_body, _hi_body

high = _high        # the high half of uint32 bits as int16 (public: `amx_tiles` packs parts with it)
exactly_bf16 = _exact   # whether a float32 array's uint32 view [R, D] holds bfloat16 values only (`amx_decode`)


# --------------------------------------------------------------------------------------------------------------
# register blocks: NumPy twins (the lane order of the IR: per 16-lane accumulator, odd then even element of each
# pair, parts in order; then the lanes pairwise)
# --------------------------------------------------------------------------------------------------------------
def _widen(bits):
    return (bits.view(np.uint16).astype(np.uint32) << np.uint32(16)).view(np.float32)


def _dot_bf(qrow, parts, krow, n):
    m = -(-n // LANES) * LANES
    k = np.zeros(m, np.float32)
    k[:n] = _widen(krow[:n])
    acc = np.zeros(16, np.float32)
    if qrow.dtype == np.float32:                    # float32 halves: each step an FMA (one rounding)
        prod = _unpair(qrow)[:m].astype(np.float64) * k
        for i in range(0, m, LANES):
            acc = (acc + prod[i + 1:i + LANES:2]).astype(np.float32)
            acc = (acc + prod[i:i + LANES:2]).astype(np.float32)
        return _butterfly(acc)
    Dp = qrow.shape[0] // PARTS
    for p in range(parts):
        q = np.zeros(m, np.float32)
        q[:n] = _widen(qrow[p * Dp:p * Dp + n])
        prod = q * k                                # exact: 8 x 8 significand bits
        for i in range(0, m, LANES):
            acc = (acc + prod[i + 1:i + LANES:2]) + prod[i:i + LANES:2]
    return _butterfly(acc)


def _butterfly(acc):
    while len(acc) > 1:
        acc = acc[: len(acc) // 2] + acc[len(acc) // 2:]
    return np.float32(acc[0])


def dot44_bf(qb, g, parts, kp, t, n, last):
    """16 scores q[g + a] . kp[min(t + b, last), :n] (a, b < 4), a-major: qb [G, 3 * Dp] int16 parts (the first
    ``parts`` used) or [G, Dp] float32 (even, odd) halves (parts 1), kp [page_size, D] int16 bfloat16 bits."""
    return tuple(_dot_bf(qb[g + a], parts, kp[min(t + b, last)], n) for a in range(4) for b in range(4))


def dot14_bf(qb, g, parts, kp, t, n, last):
    """4 scores q[g] . kp[min(t + b, last), :n] (b < 4)."""
    return tuple(_dot_bf(qb[g], parts, kp[min(t + b, last)], n) for b in range(4))


if JIT:
    from numba.core import cgutils as _cg

    from .vector_ir import bf16_pairs_ir, lane_mask, reduce_many_ir

    _I16 = _ir.IntType(16)
    _I32 = _ir.IntType(32)
    _I64 = _ir.IntType(64)
    _F16X = _ir.VectorType(_ir.FloatType(), 16)
    _I16X = _ir.VectorType(_I16, LANES)
    _I32X = _ir.VectorType(_I32, 16)

    class _BFloat(_ir.types.Type):
        """LLVM's ``bfloat`` (llvmlite.ir has no such type; the IR is text)."""
        null = "0.0"
        intrinsic_name = "bf16"

        def __str__(self):
            return "bfloat"

        def __eq__(self, other):
            return isinstance(other, _BFloat)

        def __hash__(self):
            return hash(_BFloat)

    _BF16X = _ir.VectorType(_BFloat(), LANES)

    def _dp_native(builder):
        fn = _cg.get_or_insert_function(builder.module, _ir.FunctionType(_F16X, [_F16X, _BF16X, _BF16X]),
                                        "llvm.x86.avx512bf16.dpbf16ps.512")
        return lambda acc, q, k: builder.call(fn, [acc, builder.bitcast(q, _BF16X), builder.bitcast(k, _BF16X)])

    def _dp_pairs(builder):
        """acc[i] += q[2i+1] * k[2i+1], then += q[2i] * k[2i], by two FMAs: q as its (even, odd) float32 halves,
        k as 32 bfloat16 (element 2i is the low half of 32-bit lane i: shifted up, a float32; element 2i+1 its high
        half, masked)."""
        fma = _cg.get_or_insert_function(builder.module, _ir.FunctionType(_F16X, [_F16X] * 3), "llvm.fma.v16f32")

        def dp(acc, q, k):
            qe, qo = q
            ke, ko = bf16_pairs_ir(builder, builder.bitcast(k, _I32X))
            return builder.call(fma, [qe, ke, builder.call(fma, [qo, ko, acc])])
        return dp

    def _dp_emulated(builder):
        """vdpbf16ps by `_dp_pairs` (both operands bfloat16)."""
        pairs = _dp_pairs(builder)
        return lambda acc, q, k: pairs(acc, bf16_pairs_ir(builder, builder.bitcast(q, _I32X)), k)

    I16X = _I16X

    def vdpbf16ps_ir(builder, native=HOST):
        """``dp(acc, a, b)``: acc (<16 x float>) plus the pairwise products of a and b (<32 x i16> bfloat16 bits),
        the odd product added first: `vdpbf16ps` where the target has avx512bf16, else its emulation (a shift, a
        mask and two FMAs; the same sums). For the other kernels' register blocks (`gemm.gemm_strip_bf`)."""
        return (_dp_native if native else _dp_emulated)(builder)

    def _make_dot_bf(ng, nt, native):
        def typer(typingctx, qb, g, parts, kp, t, n, last):
            if not (isinstance(qb, types.Array) and isinstance(kp, types.Array) and qb.ndim == 2 and kp.ndim == 2
                    and qb.dtype in (types.int16, types.float32) and kp.dtype == types.int16):
                return None
            f32q = qb.dtype == types.float32        # q as float32 (even, odd) halves (`split_query`, parts -1)

            def codegen(context, builder, sig, args):
                qty, _, _, kty = sig.args[:4]
                g_, p_, t_, n_, last_ = (context.cast(builder, args[i], sig.args[i], types.int64)
                                         for i in (1, 2, 4, 5, 6))
                qary = context.make_array(qty)(context, builder, args[0])
                qcols = _cg.unpack_tuple(builder, qary.shape, 2)[1]
                dp_ = qcols if f32q else builder.sdiv(qcols, _ir.Constant(_I64, PARTS))
                qrows = [builder.gep(qary.data, [builder.mul(builder.add(g_, _ir.Constant(_I64, a)), qcols)])
                         for a in range(ng)]
                kary = context.make_array(kty)(context, builder, args[3])
                kcols = _cg.unpack_tuple(builder, kary.shape, 2)[1]
                kidx = [builder.add(t_, _ir.Constant(_I64, b)) for b in range(nt)]
                kidx = [builder.select(builder.icmp_signed(">", k, last_), last_, k) for k in kidx]
                krows = [builder.gep(kary.data, [builder.mul(k, kcols)]) for k in kidx]
                slots = [_cg.alloca_once_value(builder, _ir.Constant(_F16X, None)) for _ in range(ng * nt)]
                dp = (_dp_pairs if f32q else _dp_native if native else _dp_emulated)(builder)
                rem = builder.srem(n_, _ir.Constant(_I64, LANES))
                full = builder.sub(n_, rem)
                mask = lane_mask(builder, rem, LANES)
                mload = _cg.get_or_insert_function(
                    builder.module, _ir.FunctionType(_I16X, [_I16X.as_pointer(), _I32, mask.type, _I16X]),
                    "llvm.masked.load.v32i16.p0")

                def plain(ptr):
                    return builder.load(builder.bitcast(ptr, _I16X.as_pointer()), align=2)

                def masked(ptr):
                    return builder.call(mload, [builder.bitcast(ptr, _I16X.as_pointer()), _ir.Constant(_I32, 2), mask,
                                                _ir.Constant(_I16X, None)])

                with _cg.for_range_slice(builder, _ir.Constant(_I64, 0), p_, _ir.Constant(_I64, 1)) as (p, _):
                    off = builder.mul(p, dp_)
                    qp = [builder.gep(r, [off]) for r in qrows]

                    def qload(ptr):                                        # zero padded to whole vectors
                        if not f32q:
                            return plain(ptr)
                        fp = builder.bitcast(ptr, _F16X.as_pointer())
                        return builder.load(fp, align=4), builder.load(builder.gep(fp, [_ir.Constant(_I64, 1)]), align=4)

                    def step(i, kload):
                        qv = [qload(builder.gep(r, [i])) for r in qp]
                        kv = [kload(builder.gep(r, [i])) for r in krows]
                        for a in range(ng):
                            for b in range(nt):
                                sl = slots[a * nt + b]
                                builder.store(dp(builder.load(sl), qv[a], kv[b]), sl)

                    with _cg.for_range_slice(builder, _ir.Constant(_I64, 0), full, _ir.Constant(_I64, LANES)) as (i, _):
                        step(i, plain)
                    with builder.if_then(builder.icmp_signed(">", rem, _ir.Constant(_I64, 0)), likely=False):
                        step(full, masked)
                sums = reduce_many_ir(builder, [builder.load(sl) for sl in slots], 16)
                return context.make_tuple(builder, sig.return_type, sums)

            return types.UniTuple(types.float32, ng * nt)(qb, g, parts, kp, t, n, last), codegen
        return intrinsic(typer)

    _dot44_ir = _make_dot_bf(4, 4, HOST)
    _dot14_ir = _make_dot_bf(1, 4, HOST)
    # the emulation, for the test that it matches the instruction bit for bit (`testing_emulated_blocks`)
    _dot44_emu = _make_dot_bf(4, 4, False)
    _dot14_emu = _make_dot_bf(1, 4, False)

    @overload(dot44_bf, inline="always")
    def _dot44_bf_ov(qb, g, parts, kp, t, n, last):
        return lambda qb, g, parts, kp, t, n, last: _dot44_ir(qb, g, parts, kp, t, n, last)

    @overload(dot14_bf, inline="always")
    def _dot14_bf_ov(qb, g, parts, kp, t, n, last):
        return lambda qb, g, parts, kp, t, n, last: _dot14_ir(qb, g, parts, kp, t, n, last)


def testing_blocks(emulated: bool = False):
    """(dot44, dot14) as jitted callables returning float32 arrays [16] / [4], for tests: the kernel's blocks, or
    (emulated=True) the shift-and-FMA emulation that machines without avx512bf16 compile. Without the JIT: the
    twins."""
    if not JIT:
        return (lambda *a: np.array(dot44_bf(*a), np.float32)), (lambda *a: np.array(dot14_bf(*a), np.float32))
    d44, d14 = (_dot44_emu, _dot14_emu) if emulated else (_dot44_ir, _dot14_ir)

    def as_array(block, size):
        @njit
        def f(qb, g, parts, kp, t, n, last):
            r = block(qb, g, parts, kp, t, n, last)
            out = np.empty(size, np.float32)
            for i in range(size):
                out[i] = r[i]
            return out
        return f
    return as_array(d44, 16), as_array(d14, 4)
