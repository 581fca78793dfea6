"""Numba kernels for paged single-query ("decode") attention.

Everything here takes arrays and scalars only: no globals, no objects, no checks. The validating entry point is
`decode.attention.paged_decode_attention`; read `docs/kernel.md` for the algorithm and the measurements.

Layout (per layer):
    q:            [num_queries, num_q_heads, head_dim]              compute dtype (float32 or float64)
    k_pages:      [num_pages, num_kv_heads, page_size, head_dim]    float32 / float64 / uint16 (= float16 bits)
    v_pages:      [num_pages, num_kv_heads, page_size, head_dim_v]  same dtype as k_pages
    page_indices: int32 [total_pages]      CSR pages of every sequence (-1 = freed, never read)
    page_indptr:  int64 [num_seqs + 1]
    query_seq:    int32 [num_queries]      the CSR row of each query
    query_pos:    int64 [num_queries]      absolute position p of each query; it sees keys lo..p
    out:          [num_queries, num_q_heads, head_dim_v]            compute dtype

Compute dtype: float32 for float16 (uint16) and float32 storage, float64 for float64 storage.
"""
import math
import os
import tempfile

import numpy as np


def _writable_dir(path):
    try:
        os.makedirs(path, exist_ok=True)
        tempfile.TemporaryFile(dir=path).close()
        return True
    except OSError:
        return False


def _configure_cache_dir():
    """`cache=True` writes next to this file (`__pycache__`). When that is impossible (read-only install) and the
    user set no NUMBA_CACHE_DIR, point numba at a per-user cache directory instead, before any decorator runs."""
    if os.environ.get("NUMBA_CACHE_DIR"):
        return None
    if _writable_dir(os.path.join(os.path.dirname(os.path.abspath(__file__)), "__pycache__")):
        return None
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    uid = os.getuid() if hasattr(os, "getuid") else os.getpid()
    for cand in (os.path.join(base, "pagedkv", "numba"),
                 os.path.join(tempfile.gettempdir(), "pagedkv-numba-%s" % uid)):
        if _writable_dir(cand):
            os.environ["NUMBA_CACHE_DIR"] = cand
            from numba.core import config as _config
            _config.CACHE_DIR = cand
            return cand
    return None


NUMBA_CACHE_FALLBACK = _configure_cache_dir()

from numba import njit, prange, types  # noqa: E402  (after the cache directory is settled)
from numba.core import config as _nb_config  # noqa: E402
from numba.extending import intrinsic, overload  # noqa: E402

_JIT = not _nb_config.DISABLE_JIT
_FAST = True  # fastmath: reassociation + FMA contraction; nothing here produces inf or NaN (no -inf sentinels)
_EXP_FLAGS = {"nnan", "ninf", "nsz", "contract"}  # no reassoc: it would undo the Cody-Waite split

# --------------------------------------------------------------------------------------------------------------
# scalar helpers: element load (float16 bits -> float32), exact 2**n, polynomial exp
# Each has a plain-Python body used under NUMBA_DISABLE_JIT and a typed implementation for the JIT.
# --------------------------------------------------------------------------------------------------------------


def _ld(x):
    """Storage element -> compute value (float16 bits are widened exactly; floats pass through)."""
    if isinstance(x, np.uint16):
        return np.float32(x.view(np.float16))
    return x


def _prefetch(row, i):
    """Hint: the cache line holding row[i] will be read soon (no-op without the JIT)."""
    return None


def _pow2(n):
    """2.0**n as float32 for an integral float32 n in [-126, 127]."""
    return np.float32(np.ldexp(np.float32(1.0), int(n)))


if _JIT:
    from llvmlite import ir as _ir

    @intrinsic
    def _h2f(typingctx, x):
        if x != types.uint16:
            return None

        def codegen(context, builder, sig, args):
            return builder.fpext(builder.bitcast(args[0], _ir.HalfType()), _ir.FloatType())

        return types.float32(types.uint16), codegen

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

    @overload(_prefetch)
    def _prefetch_ov(row, i):
        return lambda row, i: _prefetch_intrinsic(row, i)

    @overload(_ld)
    def _ld_ov(x):
        if x == types.uint16:
            return lambda x: _h2f(x)
        if isinstance(x, types.Float):
            return lambda x: x
        return None

    @overload(_pow2)
    def _pow2_ov(n):
        if n == types.float32:
            return lambda n: _pow2_intrinsic(n)
        return None


# --------------------------------------------------------------------------------------------------------------
# vector micro-kernels written directly in LLVM IR (the register blocks LLVM cannot derive from scalar loops:
# several dot products reduced together by one butterfly of shuffles instead of one horizontal sum each, and
# PV accumulators kept in registers over a whole chunk of value rows). Each has a plain-NumPy twin for
# NUMBA_DISABLE_JIT. Vectors are 16 float32 or 8 float64 lanes; `n` (a multiple of 32) elements are processed,
# the callers handle the tail.
# --------------------------------------------------------------------------------------------------------------


def _row_f(x):
    """A storage row as compute values (NumPy; used by the no-JIT twins)."""
    return x.view(np.float16).astype(np.float32) if x.dtype == np.uint16 else x


def _dot44(qs, g, kp, t, n):
    """16 dot products qs[g + a, :n] . kp[t + b, :n] (a, b < 4), a-major."""
    return tuple(np.dot(qs[g + a, :n], _row_f(kp[t + b, :n])) for a in range(4) for b in range(4))


def _dot14(qs, g, kp, t, n):
    """4 dot products qs[g, :n] . kp[t + b, :n] (b < 4)."""
    return tuple(np.dot(qs[g, :n], _row_f(kp[t + b, :n])) for b in range(4))


def _pv4(S, g, c, vp, t0, t1, acc, n):
    """acc[g + a, :n] += sum_t S[g + a, c + t - t0] * vp[t, :n] over t in [t0, t1), a < 4."""
    V = _row_f(vp[t0:t1, :n])
    for a in range(4):
        acc[g + a, :n] += S[g + a, c:c + t1 - t0] @ V


if _JIT:
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

    def _vload(context, builder, ptr, storage, lanes, vt):
        """<lanes x compute> from ptr (storage element type); float16 bits are widened exactly."""
        ety = context.get_value_type(storage)
        x = builder.load(builder.bitcast(ptr, _ir.VectorType(ety, lanes).as_pointer()), align=storage.bitwidth // 8)
        if storage == types.uint16:
            x = builder.fpext(builder.bitcast(x, _ir.VectorType(_ir.HalfType(), lanes)), vt)
        return x

    def _fma(builder, vt, lanes):
        name = "llvm.fma.v%d%s" % (lanes, "f64" if lanes == 8 else "f32")
        return _cg.get_or_insert_function(builder.module, _ir.FunctionType(vt, [vt, vt, vt]), name)

    def _reduce_many(builder, accs, lanes):
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
                nv.append(builder.fadd(builder.shuffle_vector(a, b, _ir.Constant(_ir.VectorType(_I32, lanes), lo)),
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
                v = builder.fadd(builder.shuffle_vector(v, v, _ir.Constant(_ir.VectorType(_I32, len(lo)), lo)),
                                 builder.shuffle_vector(v, v, _ir.Constant(_ir.VectorType(_I32, len(hi)), hi)))
                lab, cur, w = nlab, len(lo), half
            for lane, k in enumerate(lab):
                out[k] = builder.extract_element(v, _ir.Constant(_I32, lane))
        return out

    def _make_dot(ng, nt):
        def typer(typingctx, qs, g, kp, t, n):
            if not (isinstance(qs, types.Array) and isinstance(kp, types.Array) and qs.ndim == 2 and kp.ndim == 2
                    and isinstance(qs.dtype, types.Float)):
                return None

            def codegen(context, builder, sig, args):
                qty, _, kty, _, _ = sig.args
                lanes = _lanes(qty.dtype)
                ft = context.get_value_type(qty.dtype)
                vt = _ir.VectorType(ft, lanes)
                g_, t_, n_ = (context.cast(builder, args[i], sig.args[i], types.int64) for i in (1, 3, 4))
                qrows = [_row(context, builder, qty, args[0], builder.add(g_, _ir.Constant(_I64, a))) for a in range(ng)]
                krows = [_row(context, builder, kty, args[2], builder.add(t_, _ir.Constant(_I64, b))) for b in range(nt)]
                slots = [_cg.alloca_once_value(builder, _ir.Constant(vt, None)) for _ in range(ng * nt)]
                fma = _fma(builder, vt, lanes)
                with _cg.for_range_slice(builder, _ir.Constant(_I64, 0), n_, _ir.Constant(_I64, lanes)) as (i, _):
                    qv = [_vload(context, builder, builder.gep(r, [i]), qty.dtype, lanes, vt) for r in qrows]
                    kv = [_vload(context, builder, builder.gep(r, [i]), kty.dtype, lanes, vt) for r in krows]
                    for a in range(ng):
                        for b in range(nt):
                            sl = slots[a * nt + b]
                            builder.store(builder.call(fma, [qv[a], kv[b], builder.load(sl)]), sl)
                sums = _reduce_many(builder, [builder.load(sl) for sl in slots], lanes)
                return context.make_tuple(builder, sig.return_type, sums)

            return types.UniTuple(qs.dtype, ng * nt)(qs, g, kp, t, n), codegen
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
                with _cg.for_range_slice(builder, _ir.Constant(_I64, 0), n_, _ir.Constant(_I64, strip)) as (d, _):
                    for a in range(ng):
                        for k in range(nvec):
                            p = builder.gep(arows[a], [builder.add(d, _ir.Constant(_I64, k * lanes))])
                            builder.store(builder.load(builder.bitcast(p, vt.as_pointer()), align=4), slots[a * nvec + k])
                    with _cg.for_range_slice(builder, t0_, t1_, _ir.Constant(_I64, 1)) as (t, _):
                        vrow = builder.gep(vary.data, [builder.add(builder.mul(t, vcols), d)])
                        vv = [_vload(context, builder, builder.gep(vrow, [_ir.Constant(_I64, k * lanes)]), vty.dtype,
                                     lanes, vt) for k in range(nvec)]
                        for a in range(ng):
                            w = builder.load(builder.gep(srows[a], [t]))
                            wv = builder.shuffle_vector(builder.insert_element(_ir.Constant(vt, None), w, _ir.Constant(_I32, 0)),
                                                        _ir.Constant(vt, None), _ir.Constant(_ir.VectorType(_I32, lanes), [0] * lanes))
                            for k in range(nvec):
                                sl = slots[a * nvec + k]
                                builder.store(builder.call(fma, [wv, vv[k], builder.load(sl)]), sl)
                    for a in range(ng):
                        for k in range(nvec):
                            p = builder.gep(arows[a], [builder.add(d, _ir.Constant(_I64, k * lanes))])
                            builder.store(builder.load(slots[a * nvec + k]), builder.bitcast(p, vt.as_pointer()), align=4)
                return context.get_dummy_value()

            return types.void(S, g, c, vp, t0, t1, acc, n), codegen
        return intrinsic(typer)

    _dot44_ir = _make_dot(4, 4)
    _dot14_ir = _make_dot(1, 4)
    _pv4_ir = _make_pv(4, 2)

    @overload(_dot44)
    def _dot44_ov(qs, g, kp, t, n):
        return lambda qs, g, kp, t, n: _dot44_ir(qs, g, kp, t, n)

    @overload(_dot14)
    def _dot14_ov(qs, g, kp, t, n):
        return lambda qs, g, kp, t, n: _dot14_ir(qs, g, kp, t, n)

    @overload(_pv4)
    def _pv4_ov(S, g, c, vp, t0, t1, acc, n):
        return lambda S, g, c, vp, t0, t1, acc, n: _pv4_ir(S, g, c, vp, t0, t1, acc, n)


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
    return y * _pow2(n)


def _exp(x):
    """exp of a non-positive score difference: polynomial in float32, libm exp in float64."""
    if isinstance(x, np.float32):
        return _expf_body(x)
    return math.exp(x)


if _JIT:
    _expf_jit = njit(cache=True, fastmath=_EXP_FLAGS)(_expf_body)

    @overload(_exp)
    def _exp_ov(x):
        if x == types.float32:
            return lambda x: _expf_jit(x)
        if x == types.float64:
            return lambda x: math.exp(x)
        return None


# --------------------------------------------------------------------------------------------------------------
# micro-kernels. Rows are taken as 1-D views and inner loops run over range(n) so that LLVM sees non-negative
# indices (no wraparound select) and vectorises them.
# --------------------------------------------------------------------------------------------------------------


@njit(cache=True, fastmath=_FAST)
def _qk(qs, kp, s0, s1, S, c0):
    """S[g, c0 + t - s0] = qs[g] . kp[t] for t in [s0, s1).  qs: [G, D] compute dtype, kp: [page_size, D] storage.
    Blocks of 4 query heads x 4 keys (groups >= 4) or 1 x 4 (`_dot44` / `_dot14`: each key row loaded once per
    block, the 16 or 4 dot products reduced together); leftover keys one at a time; head_dim beyond the last
    multiple of 32 in a final pass."""
    G = qs.shape[0]
    D = qs.shape[1]
    n = D - D % 32
    z = qs[0, 0] - qs[0, 0]
    g = 0
    while g + 4 <= G:
        S0 = S[g]
        S1 = S[g + 1]
        S2 = S[g + 2]
        S3 = S[g + 3]
        t = s0
        c = c0
        while t + 4 <= s1:
            r = _dot44(qs, g, kp, t, n)
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
            t += 4
            c += 4
        while t < s1:
            k0 = kp[t]
            q0 = qs[g]
            q1 = qs[g + 1]
            q2 = qs[g + 2]
            q3 = qs[g + 3]
            a0 = z
            a1 = z
            a2 = z
            a3 = z
            for d in range(n):
                y = _ld(k0[d])
                a0 += q0[d] * y
                a1 += q1[d] * y
                a2 += q2[d] * y
                a3 += q3[d] * y
            S0[c] = a0
            S1[c] = a1
            S2[c] = a2
            S3[c] = a3
            t += 1
            c += 1
        g += 4
    while g < G:
        Sg = S[g]
        q0 = qs[g]
        t = s0
        c = c0
        while t + 4 <= s1:
            r = _dot14(qs, g, kp, t, n)
            Sg[c] = r[0]
            Sg[c + 1] = r[1]
            Sg[c + 2] = r[2]
            Sg[c + 3] = r[3]
            t += 4
            c += 4
        while t < s1:
            k0 = kp[t]
            a0 = z
            for d in range(n):
                a0 += q0[d] * _ld(k0[d])
            Sg[c] = a0
            t += 1
            c += 1
        g += 1
    if n < D:
        for g in range(G):
            q0 = qs[g]
            Sg = S[g]
            for t in range(s0, s1):
                k0 = kp[t]
                a0 = z
                for d in range(n, D):
                    a0 += q0[d] * _ld(k0[d])
                Sg[c0 + t - s0] += a0


@njit(cache=True, fastmath=_FAST)
def _pv(S, c0, vp, s0, s1, acc):
    """acc[g, :] += sum_t S[g, c0 + t - s0] * vp[t, :] for t in [s0, s1).
    Groups of 4 query heads: `_pv4` keeps 4 heads x 32 accumulator lanes in registers over all the rows of the
    chunk (each value vector loaded once per four heads). Other heads: 8 value rows at a time (one accumulator
    load/store per 8 rows). head_dim_v beyond the last multiple of 32 in a final pass."""
    G = acc.shape[0]
    Dv = acc.shape[1]
    n = Dv - Dv % 32
    g = 0
    if n > 0:
        while g + 4 <= G:
            _pv4(S, g, c0, vp, s0, s1, acc, n)
            g += 4
        if n < Dv:
            for h in range(g):
                ah = acc[h]
                w = S[h]
                for t in range(s0, s1):
                    v0 = vp[t]
                    w0 = w[c0 + t - s0]
                    for d in range(n, Dv):
                        ah[d] += w0 * _ld(v0[d])
    while g < G:
        ag = acc[g]
        w = S[g]
        t = s0
        c = c0
        while t + 8 <= s1:
            v0 = vp[t]
            v1 = vp[t + 1]
            v2 = vp[t + 2]
            v3 = vp[t + 3]
            v4 = vp[t + 4]
            v5 = vp[t + 5]
            v6 = vp[t + 6]
            v7 = vp[t + 7]
            w0 = w[c]
            w1 = w[c + 1]
            w2 = w[c + 2]
            w3 = w[c + 3]
            w4 = w[c + 4]
            w5 = w[c + 5]
            w6 = w[c + 6]
            w7 = w[c + 7]
            for d in range(Dv):
                ag[d] += ((w0 * _ld(v0[d]) + w1 * _ld(v1[d])) + (w2 * _ld(v2[d]) + w3 * _ld(v3[d]))) + \
                         ((w4 * _ld(v4[d]) + w5 * _ld(v5[d])) + (w6 * _ld(v6[d]) + w7 * _ld(v7[d])))
            t += 8
            c += 8
        while t < s1:
            v0 = vp[t]
            w0 = w[c]
            for d in range(Dv):
                ag[d] += w0 * _ld(v0[d])
            t += 1
            c += 1
        g += 1


@njit(cache=True, fastmath=_FAST)
def _prefetch_rows(tile, s0, s1):
    """Prefetch rows [s0, s1) of a page tile, one hint per 64-byte line."""
    step = max(1, 64 // tile.itemsize)
    for t in range(s0, s1):
        row = tile[t]
        for d in range(0, row.shape[0], step):
            _prefetch(row, d)


@njit(cache=True, fastmath=_FAST)
def _softmax_block(S, nb, m, l, acc, first):
    """Online-softmax update with the block's scores S[:, :nb]: new running max, rescale (once per block, only
    when the max grew), S <- exp(S - max), running sum += sum(S)."""
    G = S.shape[0]
    Dv = acc.shape[1]
    for g in range(G):
        Sg = S[g]
        mb = Sg[0]
        for c in range(1, nb):
            mb = max(mb, Sg[c])
        ag = acc[g]
        z = mb - mb
        if first:
            mg = mb
            lg = z
            for d in range(Dv):
                ag[d] = z
        else:
            mg = m[g]
            lg = l[g]
            if mb > mg:
                alpha = _exp(mg - mb)
                for d in range(Dv):
                    ag[d] *= alpha
                lg *= alpha
                mg = mb
        s = z
        for c in range(nb):
            p = _exp(Sg[c] - mg)
            Sg[c] = p
            s += p
        m[g] = mg
        l[g] = lg + s


@njit(cache=True, fastmath=_FAST)
def _prefetch_span(pool, pages, h, p0, p1):
    """Prefetch the rows of kv head h holding absolute positions [p0, p1) of the sequence with page row `pages`."""
    P = pool.shape[2]
    t = p0
    while t < p1:
        j = t // P
        s0 = t - j * P
        s1 = min(P, p1 - j * P)
        _prefetch_rows(pool[pages[j], h], s0, s1)
        t += s1 - s0


@njit(cache=True, fastmath=_FAST)
def _attend(qs, k_pages, v_pages, pages, h, lo, hi, block, S, m, l, acc):
    """Unnormalised attention of the query-head group qs ([G, D], already scaled) over the keys at absolute
    positions [lo, hi) of one sequence (`pages`: its row of the page table), kv head h.
    Leaves the running max m[G], running sum l[G] and the unnormalised output acc[G, Dv].

    Keys are taken `block` at a time (block is a multiple of page_size, blocks aligned to absolute positions),
    each page tile in chunks of 4-16 rows. Software prefetch runs one phase ahead: while the scores of a
    chunk are computed its V rows are requested, while a V chunk is applied the K rows at the same offset of the
    next block are requested (the hardware prefetchers do not follow several rows read in lockstep)."""
    P = k_pages.shape[2]
    # rows per chunk: ~4 KiB of K for small groups (memory bound), 16 rows for groups >= 8 (compute bound)
    RC = 16 if qs.shape[0] >= 8 else min(16, max(4, 4096 // (k_pages.shape[3] * k_pages.itemsize)))
    first = True
    b0 = lo
    while b0 < hi:
        b1 = min(hi, (b0 // block + 1) * block)
        n1 = min(hi, (b1 // block + 1) * block)
        c = 0
        t = b0
        while t < b1:
            j = t // P
            s0 = t - j * P
            s1 = min(P, b1 - j * P)
            kp = k_pages[pages[j], h]
            vp = v_pages[pages[j], h]
            r = s0
            while r < s1:
                r1 = min(s1, r + RC)
                _prefetch_rows(vp, r, r1)
                _qk(qs, kp, r, r1, S, c + r - s0)
                r = r1
            c += s1 - s0
            t += s1 - s0
        _softmax_block(S, c, m, l, acc, first)
        first = False
        c = 0
        t = b0
        while t < b1:
            j = t // P
            s0 = t - j * P
            s1 = min(P, b1 - j * P)
            vp = v_pages[pages[j], h]
            r = s0
            while r < s1:
                r1 = min(s1, r + RC)
                q0 = b1 + c + r - s0
                _prefetch_span(k_pages, pages, h, q0, min(n1, q0 + r1 - r))
                _pv(S, c + r - s0, vp, r, r1, acc)
                r = r1
            c += s1 - s0
            t += s1 - s0
        b0 = b1


@njit(cache=True, fastmath=_FAST)
def _load_group(q, i, h, scale, qs):
    """qs[g, :] = q[i, h*G + g, :] * scale (one rounding)."""
    G = qs.shape[0]
    D = qs.shape[1]
    for g in range(G):
        src = q[i, h * G + g]
        dst = qs[g]
        for d in range(D):
            dst[d] = src[d] * scale


@njit(cache=True, fastmath=_FAST)
def _normalise(acc, l, dst):
    """dst[g, :] = acc[g, :] / l[g]  (l >= 1: the maximum contributes exp(0))."""
    G = acc.shape[0]
    Dv = acc.shape[1]
    for g in range(G):
        inv = 1.0 / l[g]
        ag = acc[g]
        og = dst[g]
        for d in range(Dv):
            og[d] = ag[d] * inv


@njit(cache=True, fastmath=_FAST)
def _combine(wm, wl, wacc, w0, n, dst):
    """Merge n partial results (max, sum, unnormalised output) stored at w0..w0+n-1 into dst[G, Dv]."""
    G = dst.shape[0]
    Dv = dst.shape[1]
    for g in range(G):
        mx = wm[w0, g]
        for s in range(1, n):
            mx = max(mx, wm[w0 + s, g])
        og = dst[g]
        tot = 0.0
        for d in range(Dv):
            og[d] = 0.0
        for s in range(n):
            f = math.exp(wm[w0 + s, g] - mx)  # float64: the merge is cheap, keep it exact
            tot += f * wl[w0 + s, g]
            src = wacc[w0 + s, g]
            for d in range(Dv):
                og[d] += f * src[d]
        inv = 1.0 / tot
        for d in range(Dv):
            og[d] *= inv


@njit(cache=True, fastmath=_FAST)
def decode_units(q, k_pages, v_pages, page_indices, page_indptr, query_seq, query_pos, window, scale, out,
               units, u0, u1, block, wm, wl, wacc):
    """Process work units u0..u1-1 with one set of scratch buffers (the serial kernel, and the body of each
    parallel chunk). block: keys per online-softmax block (whole pages, ~64 tokens).

    units.shape[0] == 0 (serial): unit u is query u // num_kv_heads, kv head u % num_kv_heads, its whole range.
    Otherwise unit u is the row units[u] = (query, kv head, lo, hi, slot): keys [lo, hi); slot < 0: the unit
    covers the whole range, normalise into out; else store the partial (max, sum, acc) at workspace slot."""
    Hkv = k_pages.shape[1]
    G = q.shape[1] // Hkv
    D = q.shape[2]
    P = k_pages.shape[2]
    Dv = v_pages.shape[3]
    qs = np.empty((G, D), q.dtype)
    S = np.empty((G, block), q.dtype)
    m = np.empty(G, q.dtype)
    l = np.empty(G, q.dtype)
    acc = np.empty((G, Dv), q.dtype)
    serial = units.shape[0] == 0
    for u in range(u0, u1):
        if serial:
            i = u // Hkv
            h = u - i * Hkv
            hi = query_pos[i] + 1
            lo = max(0, hi - window) if window > 0 else 0
            w = -1
        else:
            i = units[u, 0]
            h = units[u, 1]
            lo = units[u, 2]
            hi = units[u, 3]
            w = units[u, 4]
        s = query_seq[i]
        pages = page_indices[page_indptr[s]:page_indptr[s + 1]]
        _load_group(q, i, h, scale, qs)
        if w < 0:
            _attend(qs, k_pages, v_pages, pages, h, lo, hi, block, S, m, l, acc)
            _normalise(acc, l, out[i, h * G:(h + 1) * G])
        else:
            _attend(qs, k_pages, v_pages, pages, h, lo, hi, block, S, wm[w], wl[w], wacc[w])


@njit(cache=True, fastmath=_FAST)
def _combine_items(out, G, items, a, b, wm, wl, wacc):
    for it in range(a, b):
        h = items[it, 1]
        _combine(wm, wl, wacc, items[it, 2], items[it, 3], out[items[it, 0], h * G:(h + 1) * G])


@njit(cache=True)
def check_inputs(q_flat, q_limit, page_indices, page_indptr, query_seq, query_pos, num_pages, page_size, window):
    """Validation for the wrapper (the kernels never check anything), one pass over each array.
    Returns (code, index) of the first problem, code 0 = none:
    1 page_indptr not non-decreasing within [0, len(page_indices)] (index: the entry),
    2 a page_indices entry outside [-1, num_pages), 3 query_seq outside [0, num_seqs),
    4 query_pos outside [0, pages of the sequence * page_size), 5 a visible position on a -1 page (index: query),
    6 a non-finite q (flat index), 7 a q value with |x| >= q_limit (it would overflow the compute dtype)."""
    n_bad = 0
    for i in range(q_flat.shape[0]):          # branch-free count (vectorised), then locate if needed
        n_bad += 0 if abs(q_flat[i]) < q_limit else 1
    if n_bad:
        big = -1
        for i in range(q_flat.shape[0]):
            x = q_flat[i]
            if not (abs(x) < q_limit):
                if x != x or abs(x) == np.inf:
                    return 6, i
                if big < 0:
                    big = i
        return 7, big
    n = page_indices.shape[0]
    num_seqs = page_indptr.shape[0] - 1
    prev = 0
    for s in range(num_seqs + 1):
        x = page_indptr[s]
        if x < prev or x > n:
            return 1, s
        prev = x
    neg = 0
    for j in range(n):
        x = page_indices[j]
        if x < -1 or x >= num_pages:
            return 2, j
        if x < 0:
            neg += 1
    nq = query_seq.shape[0]
    for i in range(nq):
        s = query_seq[i]
        if s < 0 or s >= num_seqs:
            return 3, i
    for i in range(nq):
        s = query_seq[i]
        p = query_pos[i]
        if p < 0 or p >= (page_indptr[s + 1] - page_indptr[s]) * page_size:
            return 4, i
    if neg:
        cneg = np.empty(n + 1, np.int64)     # prefix count of freed entries
        cneg[0] = 0
        for j in range(n):
            cneg[j + 1] = cneg[j] + (1 if page_indices[j] < 0 else 0)
        for i in range(nq):
            s = query_seq[i]
            p = query_pos[i]
            lo = max(0, p - window + 1) if window > 0 else 0
            if cneg[page_indptr[s] + p // page_size + 1] - cneg[page_indptr[s] + lo // page_size] > 0:
                return 5, i
    return 0, 0


@njit(cache=True)
def plan_units(query_pos, window, num_kv_heads, split, nchunks):
    """Cut every (query, kv head) key range at absolute multiples of `split` tokens into units and balance the
    units over `nchunks` contiguous chunks by cost (tokens + 16 per unit).

    Returns units [U, 5] = (query, kv head, lo, hi, workspace slot or -1 when the range is not split),
    bounds [nchunks + 1] (chunk c = units bounds[c]..bounds[c+1]-1), items [n_split, 4] = (query, kv head,
    first slot, number of slots) of the split ranges, and the number of workspace slots."""
    nq = query_pos.shape[0]
    C = split
    U = 0
    n_items = 0
    W = 0
    for i in range(nq):
        hi = query_pos[i] + 1
        lo = max(0, hi - window) if window > 0 else 0
        n = (hi - 1) // C - lo // C + 1
        U += n * num_kv_heads
        if n > 1:
            n_items += num_kv_heads
            W += n * num_kv_heads
    units = np.empty((U, 5), np.int64)
    items = np.empty((n_items, 4), np.int64)
    u = 0
    w = 0
    it = 0
    total = 0
    for i in range(nq):
        hi = query_pos[i] + 1
        lo = max(0, hi - window) if window > 0 else 0
        n = (hi - 1) // C - lo // C + 1
        for h in range(num_kv_heads):
            if n > 1:
                items[it, 0] = i
                items[it, 1] = h
                items[it, 2] = w
                items[it, 3] = n
                it += 1
            for j in range(n):
                a = max(lo, (lo // C + j) * C)
                b = min(hi, (lo // C + j + 1) * C)
                units[u, 0] = i
                units[u, 1] = h
                units[u, 2] = a
                units[u, 3] = b
                if n > 1:
                    units[u, 4] = w
                    w += 1
                else:
                    units[u, 4] = -1
                total += b - a + 16
                u += 1
    nch = max(1, nchunks)
    bounds = np.empty(nch + 1, np.int64)
    bounds[0] = 0
    cum = 0
    c = 1
    for u in range(U):
        cost = units[u, 3] - units[u, 2] + 16
        mid2 = 2 * cum + cost  # twice the unit's cost midpoint: unit u goes to chunk floor(mid * nch / total)
        while c < nch and mid2 * nch > 2 * c * total:
            bounds[c] = u
            c += 1
        cum += cost
    while c <= nch:
        bounds[c] = U
        c += 1
    return units, bounds, items, W


@njit(parallel=True, cache=True, fastmath=_FAST)
def decode_parallel(q, k_pages, v_pages, page_indices, page_indptr, query_seq, query_pos, scale, window, out,
                    units, bounds, items, num_slots, block):
    """The units of `plan_units` on all threads: one prange iteration per chunk of units (each owns its units'
    outputs and workspace slots), then the split ranges are merged (prange over items when there are enough)."""
    Hkv = k_pages.shape[1]
    G = q.shape[1] // Hkv
    Dv = v_pages.shape[3]
    wm = np.empty((num_slots, G), q.dtype)
    wl = np.empty((num_slots, G), q.dtype)
    wacc = np.empty((num_slots, G, Dv), q.dtype)
    nch = bounds.shape[0] - 1
    for ck in prange(nch):
        decode_units(q, k_pages, v_pages, page_indices, page_indptr, query_seq, query_pos, window, scale, out,
                     units, bounds[ck], bounds[ck + 1], block, wm, wl, wacc)
    n = items.shape[0]
    if n >= nch and num_slots * G * Dv >= 1 << 16:
        for ck in prange(nch):
            _combine_items(out, G, items, ck * n // nch, (ck + 1) * n // nch, wm, wl, wacc)
    else:
        _combine_items(out, G, items, 0, n, wm, wl, wacc)
    return out
