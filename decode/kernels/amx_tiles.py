"""The tiled kernel's score GEMM on Intel AMX tiles (`tdpbf16ps`), for bfloat16 pages.

Where the CPU has AMX-BF16 (and the OS grants the tile state), ST = K @ QT of `tiled.attend_tile` runs on tile
multiplies: C [16 keys, 16 rows] += A [16 keys, 32 bfloat16 of head_dim] . B [16 pairs of head_dim, 16 rows, 2],
1024 bfloat16 products per instruction against 32 for `vdpbf16ps`. A float32 q is split exactly into bfloat16 parts
(hi + mid + lo, by truncation as in `bf16_dot`: every normal float32 is their exact sum); a bfloat16 q (a bfloat16
model's) has one. Every product of two bfloat16 is exact in float32, so a score's only roundings are its float32
additions, as on the widened path; the sums are taken in the tile unit's order (head_dim in chunks of 32,
each chunk's parts in turn), so the bits differ from the other paths' (still deterministic: the same on every call and thread count).
The unit reads bfloat16 subnormals as zero and flushes subnormal float32 results (|x| < 2**-126): far below the
1e-6 budget.

    HOST                          the compilation target has amx-tile and amx-bf16 (no AMX IR is emitted without)
    usable() -> bool              HOST, the OS granted the tile state (`arch_prctl`), $KVENGINE_AMX is not "0"
    tile_config() -> uint8 [64]   the tile configuration every call loads: 8 tiles of 16 rows x 64 bytes
    (every tile operand's rows start on a 64-byte boundary: `simd.zeros64`)
    pack_parts(QT, R, Rp, QA)     QT [D, >= Rp] float32 (a tile's queries, columns R.. zero) -> QA int16 [3 * D / 2,
                                  2 * cols] (part p, pair k, column r, element e at [p * D / 2 + k, 2 r + e]);
                                  returns how many parts are nonzero (1-3)
    amx_scores(k_pages, pages, h, b0, nb, Kt, QA, parts, ST, Rp, cfg)
                                  ST[:nb rounded up to 32, :Rp] = the block's keys (in place where whole 16-key
                                  groups lie in a page, else staged in Kt) . the parts' columns (Rp, D multiples of 32)
    scores_reference(...)         its NumPy twin (the same products; float64 sums: a test oracle, not its bits)
"""
import ctypes
import os

import numpy as np
from numba import njit, types
from numba.core import config as _nb_config

from .bf16_dot import f2u as _f2u, high as _high, u2f as _u2f
from .gemm import COLMAX, SCALE, transpose16
from .pair_scores import page_piece
from .simd import JIT, zeros64

ENV = "KVENGINE_AMX"            # "0": never use the tiles (A/B measurements, tests of the other paths)
ARCH_REQ_XCOMP_PERM = 0x1023
XFEATURE_XTILEDATA = 18
SYS_ARCH_PRCTL = 158            # x86-64


def _host_has_amx() -> bool:
    """The compilation target has amx-tile and amx-bf16: the host's features, or NUMBA_CPU_FEATURES when set."""
    if _nb_config.CPU_FEATURES is not None:
        feats = _nb_config.CPU_FEATURES.split(",")
        return "+amx-tile" in feats and "+amx-bf16" in feats
    try:
        from llvmlite import binding
        f = binding.get_host_cpu_features()
        return bool(f.get("amx-tile", False) and f.get("amx-bf16", False))
    except Exception:           # noqa: BLE001  (no feature query: assume none)
        return False


HOST = JIT and _host_has_amx()
_GRANTED = None


def _request_tiles() -> bool:
    """Ask Linux for the AMX tile data state (once per process; every thread then may use it)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.syscall(SYS_ARCH_PRCTL, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0
    except Exception:           # noqa: BLE001  (not Linux / no syscall: no tiles)
        return False


def usable() -> bool:
    """Whether the tiled kernel may run its scores on AMX tiles in this process."""
    global _GRANTED
    if not HOST or os.environ.get(ENV, "") == "0":
        return False
    if _GRANTED is None:
        _GRANTED = _request_tiles()
    return _GRANTED


def tile_config():
    """Palette 1, tiles 0-7 each 16 rows of 64 bytes (C: 16 float32, A / B: 32 bfloat16)."""
    cfg = np.zeros(64, np.uint8)
    cfg[0] = 1
    for t in range(8):
        cfg[16 + 2 * t] = 64        # bytes per row (uint16, little-endian)
        cfg[48 + t] = 16            # rows
    return cfg


def pack_parts(QT, R, Rp, QA):
    """QA[p * D / 2 + k, 2 r + e] = the bfloat16 bits of part p of QT[2k + e, r] (r < Rp; columns R.. of QT zero;
    QA's columns from Rp zero); returns the number of nonzero parts (1-3). The parts by truncation: hi = the
    high half, mid = the high half of x - hi, lo = x - hi - mid (exact)."""
    D = QT.shape[0]
    half = D // 2
    bits = QT.view(np.uint32)
    packed = QA.view(np.uint32)
    hm = np.uint32(0xFFFF0000)
    s16 = np.uint32(16)
    m1 = np.uint32(0)
    m2 = np.uint32(0)
    for k in range(half):
        x0 = QT[2 * k]
        x1 = QT[2 * k + 1]
        u0 = bits[2 * k]
        u1 = bits[2 * k + 1]
        d0 = packed[k]
        d1 = packed[half + k]
        d2 = packed[2 * half + k]
        for r in range(Rp):
            a0 = u0[r] & hm
            a1 = u1[r] & hm
            r0 = x0[r] - _u2f(a0)
            r1 = x1[r] - _u2f(a1)
            b0 = _f2u(r0)
            b1 = _f2u(r1)
            c0 = _f2u(r0 - _u2f(b0 & hm))
            c1 = _f2u(r1 - _u2f(b1 & hm))
            d0[r] = (a0 >> s16) | a1
            d1[r] = (b0 >> s16) | (b1 & hm)
            d2[r] = (c0 >> s16) | (c1 & hm)
            m1 |= (b0 | b1) & np.uint32(0x7FFFFFFF)
            m2 |= (c0 | c1) & np.uint32(0x7FFFFFFF)
        for r in range(Rp, packed.shape[1]):
            d0[r] = 0
            d1[r] = 0
            d2[r] = 0
    return 3 if m2 else (2 if m1 else 1)


def amx_block(k_pages, pages, h, b0, nb, Kt, QA, parts, ST, Rp, flags, sc, mx, cfg):
    """ST[:nb, :Rp] = the rows of kv head h at absolute positions b0.. (bfloat16 pages) . the tile's q parts QA, on
    the tiles; then the score GEMM's epilogue (`gemm`'s SCALE: times sc; COLMAX: mx[r] = max(mx[r], ST[j, r] over
    j < nb)). Rows of ST from nb to nb rounded up to 32: scores of zero keys or of slots past the block (never
    read)."""
    stage_keys(k_pages, pages, h, b0, nb, Kt)
    amx_scores(k_pages, pages, h, b0, nb, Kt, QA, parts, ST, -(-Rp // 32) * 32, cfg)
    scale = (flags & SCALE) != 0
    colmax = (flags & COLMAX) != 0
    for j in range(nb):
        row = ST[j]
        if scale:
            for r in range(Rp):
                row[r] *= sc
        if colmax:
            for r in range(Rp):
                mx[r] = max(mx[r], row[r])


def in_place(P, b0, g, nb):
    """Whether the 16 keys b0 + g.. are read by the tiles in place: whole, inside one page, at a 16-row offset
    (rows on 64-byte boundaries: the pools' pages are)."""
    return P % 16 == 0 and b0 % 16 == 0 and g + 16 <= nb


def stage_keys(k_pages, pages, h, b0, nb, Kt):
    """Kt[g:g + 16] = the keys b0 + g.. of every 16-key group the tiles do not read in place (`in_place`), rows past
    nb zero."""
    P = k_pages.shape[2]
    D = k_pages.shape[3]
    for g in range(0, -(-nb // 32) * 32, 16):
        if in_place(P, b0, g, nb):
            continue
        for j in range(g, g + 16):
            dst = Kt[j]
            if j < nb:
                t = b0 + j
                src = k_pages[pages[t // P], h, t % P]
                for d in range(D):
                    dst[d] = src[d]
            else:
                for d in range(D):
                    dst[d] = 0


def value_scratch(v_pages, O, block, rows, dot):
    """The PV tiles' buffers for a tile of up to ``rows`` rows (a multiple of 32): PT float32 [rows, block + 32] (P
    transposed), PA int16 [3, rows, block + 32] (its bfloat16 parts), VB uint32 [(block + 32) / 2, Dv] (value rows
    in pairs); empty ones where the tiles do not take PV (dot != 2, pages not bfloat16, O not float32, Dv not a
    multiple of 32)."""
    Dv = v_pages.shape[3]
    if dot == 2 and v_pages.dtype == np.int16 and O.dtype == np.float32 and Dv % 32 == 0:
        n = block + 32
        return (np.zeros((rows, n), np.float32), zeros64(3 * rows, n, np.zeros(0, np.int16)).reshape((3, rows, n)),
                zeros64(n // 2, Dv, np.zeros(0, np.uint32)))
    return np.zeros((0, 0), np.float32), np.zeros((0, 0, 0), np.int16), np.zeros((0, 0), np.uint32)


def split_rows(PT, rows, n, PA):
    """PA[p, r, j] = the bfloat16 bits of part p of PT[r, j] (r < rows, j < n; the split of `pack_parts`): three
    parts, always (a weight is seldom a bfloat16; a zero part adds exact zeros)."""
    hm = np.uint32(0xFFFF0000)
    bits = PT.view(np.uint32)
    for r in range(rows):
        x = PT[r]
        u = bits[r]
        d0 = PA[0, r]
        d1 = PA[1, r]
        d2 = PA[2, r]
        for j in range(n):
            a = u[j] & hm
            r1 = x[j] - _u2f(a)
            b = _f2u(r1)
            c = _f2u(r1 - _u2f(b & hm))
            d0[j] = _high(a)
            d1[j] = _high(b)
            d2[j] = _high(c)
    return 3


def value_pairs(v_pages, pages, h, b0, nb, VB):
    """VB[k, d] = value rows 2k (low half) and 2k + 1 (high half) of kv head h at absolute positions b0.. (bfloat16
    bits), rows from nb to nb rounded up to 32 zero: the B operand of the PV tiles."""
    P = v_pages.shape[2]
    Dv = v_pages.shape[3]
    lo = np.uint32(0xFFFF)
    s16 = np.uint32(16)
    j = 0
    while j < nb:
        row, s0, n = page_piece(pages, P, b0 + j, nb - j)
        tile = v_pages[row, h]
        for s in range(n):
            jj = j + s
            src = tile[s0 + s]
            dst = VB[jj // 2]
            if jj % 2 == 0:
                for d in range(Dv):
                    dst[d] = np.uint32(src[d]) & lo
            else:
                for d in range(Dv):
                    dst[d] |= (np.uint32(src[d]) & lo) << s16
        j += n
    for k in range((nb + 1) // 2, -(-nb // 32) * 16):
        dst = VB[k]
        for d in range(Dv):
            dst[d] = 0


def amx_values(v_pages, pages, h, b0, nb, ST, Rp, O, PT, PA, VB, rescale, alpha, cfg):
    """O[:Rp, :Dv] (times alpha[r] first where ``rescale``) += P . V on the tiles, P = ST[:nb, :Rp] (keys x rows,
    the softmax's weights) split exactly into bfloat16 parts, V the block's bfloat16 rows. ST's rows nb.. are set
    to zero; O has at least Rp rounded up to 32 rows."""
    Dv = v_pages.shape[3]
    nbp = -(-nb // 32) * 32
    Rs = -(-Rp // 32) * 32
    if rescale:
        for r in range(Rp):
            a = alpha[r]
            row = O[r]
            for d in range(Dv):
                row[d] *= a
    cols = ST.shape[1]
    for j in range(nb, nbp):
        row = ST[j]
        for r in range(Rs):
            row[r] = 0.0
    flat = ST.reshape(-1)
    off = np.empty(16, np.int64)
    for j0 in range(0, nbp, 16):
        for k in range(16):
            off[k] = (j0 + k) * cols
        for c0 in range(0, Rs, 16):
            transpose16(flat, off, c0, PT, j0)
    parts = split_rows(PT, Rs, nbp, PA)
    value_pairs(v_pages, pages, h, b0, nb, VB)
    amx_pv(PA, parts, VB, O, Rs, nbp, Dv, cfg)


def amx_pv(PA, parts, VB, O, Rs, nbp, Dv, cfg):
    """O[:Rs, :Dv] += sum over parts of PA[p, :Rs, :nbp] . VB's pairs (C: O's 16 x 16 blocks)."""
    raise RuntimeError("amx_pv: this process cannot use AMX tiles (amx_tiles.usable() is False)")


def scores_reference(Kt, QA, parts, nbp, Rp):
    """ST[:nbp, :Rp] as `amx_scores` computes it (the same exact products; summed in float64): NumPy."""
    D = Kt.shape[1]
    half = D // 2
    k = (Kt[:nbp].view(np.uint16).astype(np.uint32) << np.uint32(16)).view(np.float32).astype(np.float64)
    out = np.zeros((nbp, Rp))
    for p in range(parts):
        pairs = QA[p * half:(p + 1) * half, :2 * Rp].view(np.uint16).astype(np.uint32) << np.uint32(16)
        q = pairs.view(np.float32).reshape(half, Rp, 2).transpose(0, 2, 1).reshape(D, Rp).astype(np.float64)
        out += k @ q
    return out


def amx_scores(k_pages, pages, h, b0, nb, Kt, QA, parts, ST, Rp, cfg):
    """ST[:nbp, :Rp] (nbp: nb rounded up to 32) = the keys b0.. of kv head h (in place, or staged in Kt:
    `stage_keys`) . the parts' columns (float32, the tile unit's sums). No AMX: refuse by name."""
    raise RuntimeError("amx_scores: this process cannot use AMX tiles (amx_tiles.usable() is False)")


if JIT:
    from llvmlite import ir as _ir
    from numba.core import cgutils as _cg
    from numba.extending import intrinsic, overload

    _I8 = _ir.IntType(8)
    _I64 = _ir.IntType(64)
    _PTR = _I8.as_pointer()
    tile_config = njit(cache=True)(tile_config)
    _pack_parts_jit = njit(cache=True)(pack_parts)      # no fastmath: x - hi must be the exact difference

    def _call(builder, name, argtys, args):
        fnty = _ir.FunctionType(_ir.VoidType(), argtys)
        builder.call(_cg.get_or_insert_function(builder.module, fnty, name), args)

    @intrinsic
    def _ldtilecfg(typingctx, cfg):
        if not HOST:
            return None

        def codegen(context, builder, sig, args):
            a = context.make_array(sig.args[0])(context, builder, args[0])
            _call(builder, "llvm.x86.ldtilecfg", [_PTR], [builder.bitcast(a.data, _PTR)])
            return context.get_dummy_value()
        return types.void(cfg), codegen

    @intrinsic
    def _tilerelease(typingctx):
        if not HOST:
            return None

        def codegen(context, builder, sig, args):
            _call(builder, "llvm.x86.tilerelease", [], [])
            return context.get_dummy_value()
        return types.void(), codegen

    @intrinsic
    def _tilezero(typingctx, t):
        if not HOST or not isinstance(t, types.IntegerLiteral):
            return None

        def codegen(context, builder, sig, args):
            _call(builder, "llvm.x86.tilezero", [_I8], [_ir.Constant(_I8, sig.args[0].literal_value)])
            return context.get_dummy_value()
        return types.void(t), codegen

    def _tile_memory(name):
        @intrinsic
        def tile_mem(typingctx, t, arr, off, stride):
            if not HOST or not isinstance(t, types.IntegerLiteral) or not isinstance(arr, types.Array):
                return None

            def codegen(context, builder, sig, args):
                a = context.make_array(sig.args[1])(context, builder, args[1])
                o = context.cast(builder, args[2], sig.args[2], types.int64)
                s = context.cast(builder, args[3], sig.args[3], types.int64)
                ptr = builder.bitcast(builder.gep(a.data, [o]), _PTR)
                _call(builder, name, [_I8, _PTR, _I64], [_ir.Constant(_I8, sig.args[0].literal_value), ptr, s])
                return context.get_dummy_value()
            return types.void(t, arr, off, stride), codegen
        return tile_mem

    _tileload = _tile_memory("llvm.x86.tileloadd64")
    _tilestore = _tile_memory("llvm.x86.tilestored64")

    @intrinsic
    def _tdpbf16ps(typingctx, c, a, b):
        if not HOST or not all(isinstance(x, types.IntegerLiteral) for x in (c, a, b)):
            return None

        def codegen(context, builder, sig, args):
            _call(builder, "llvm.x86.tdpbf16ps", [_I8] * 3, [_ir.Constant(_I8, s.literal_value) for s in sig.args])
            return context.get_dummy_value()
        return types.void(c, a, b), codegen

    def _amx_scores_body(k_pages, pages, h, b0, nb, Kt, QA, parts, ST, Rp, cfg):
        H = k_pages.shape[1]
        P = k_pages.shape[2]
        D = k_pages.shape[3]
        half = D // 2
        qc = QA.shape[1]
        sc = ST.shape[1]
        ks = D * 2
        qs = qc * 2
        ss = sc * 4
        _ldtilecfg(cfg)
        for m0 in range(0, -(-nb // 32) * 32, 32):
            t0 = b0 + m0
            t1 = t0 + 16
            pin0 = in_place(P, b0, m0, nb)
            pin1 = in_place(P, b0, m0 + 16, nb)
            k0 = ((pages[t0 // P] * H + h) * P + t0 % P) * D if pin0 else m0 * D
            k1 = ((pages[t1 // P] * H + h) * P + t1 % P) * D if pin1 else (m0 + 16) * D
            for n0 in range(0, Rp, 32):
                _tilezero(0)
                _tilezero(1)
                _tilezero(2)
                _tilezero(3)
                for kb in range(0, D, 32):          # K's two tiles loaded once for every part
                    if pin0:
                        _tileload(4, k_pages, k0 + kb, ks)
                    else:
                        _tileload(4, Kt, k0 + kb, ks)
                    if pin1:
                        _tileload(5, k_pages, k1 + kb, ks)
                    else:
                        _tileload(5, Kt, k1 + kb, ks)
                    for p in range(parts):
                        qrow = (p * half + kb // 2) * qc
                        _tileload(6, QA, qrow + 2 * n0, qs)
                        _tdpbf16ps(0, 4, 6)
                        _tdpbf16ps(2, 5, 6)
                        _tileload(7, QA, qrow + 2 * n0 + 32, qs)
                        _tdpbf16ps(1, 4, 7)
                        _tdpbf16ps(3, 5, 7)
                _tilestore(0, ST, m0 * sc + n0, ss)
                _tilestore(1, ST, m0 * sc + n0 + 16, ss)
                _tilestore(2, ST, (m0 + 16) * sc + n0, ss)
                _tilestore(3, ST, (m0 + 16) * sc + n0 + 16, ss)
        _tilerelease()

    if HOST:
        _amx_scores_jit = njit(cache=True)(_amx_scores_body)

        @overload(amx_scores, inline="always")
        def _amx_scores_ov(k_pages, pages, h, b0, nb, Kt, QA, parts, ST, Rp, cfg):
            return lambda k_pages, pages, h, b0, nb, Kt, QA, parts, ST, Rp, cfg: _amx_scores_jit(
                k_pages, pages, h, b0, nb, Kt, QA, parts, ST, Rp, cfg)
    else:
        @overload(amx_scores, inline="always")
        def _amx_scores_ov(k_pages, pages, h, b0, nb, Kt, QA, parts, ST, Rp, cfg):
            def impl(k_pages, pages, h, b0, nb, Kt, QA, parts, ST, Rp, cfg):
                raise RuntimeError("amx_scores: this build target has no AMX tiles")
            return impl

    @overload(pack_parts, inline="always")
    def _pack_parts_ov(QT, R, Rp, QA):
        if QT.dtype == types.float32 and QA.dtype == types.int16:
            return lambda QT, R, Rp, QA: _pack_parts_jit(QT, R, Rp, QA)
        return lambda QT, R, Rp, QA: 0

    _amx_block_jit = njit(cache=True, fastmath={"nnan", "ninf", "nsz", "contract"})(amx_block) if HOST else None

    @overload(amx_block, inline="always")
    def _amx_block_ov(k_pages, pages, h, b0, nb, Kt, QA, parts, ST, Rp, flags, sc, mx, cfg):
        if HOST and k_pages.dtype == types.int16 and ST.dtype == types.float32:
            return lambda k_pages, pages, h, b0, nb, Kt, QA, parts, ST, Rp, flags, sc, mx, cfg: _amx_block_jit(
                k_pages, pages, h, b0, nb, Kt, QA, parts, ST, Rp, flags, sc, mx, cfg)
        return lambda k_pages, pages, h, b0, nb, Kt, QA, parts, ST, Rp, flags, sc, mx, cfg: None

    def _amx_pv_body(PA, parts, VB, O, Rs, nbp, Dv, cfg):
        oc = O.shape[1]
        pc = PA.shape[2]
        rpp = PA.shape[1] * pc
        o_rs = oc * 4
        pa_rs = pc * 2
        vb_rs = VB.shape[1] * 4
        vc = VB.shape[1]
        _ldtilecfg(cfg)
        for r0 in range(0, Rs, 32):
            for d0 in range(0, Dv, 32):
                _tileload(0, O, r0 * oc + d0, o_rs)
                _tileload(1, O, r0 * oc + d0 + 16, o_rs)
                _tileload(2, O, (r0 + 16) * oc + d0, o_rs)
                _tileload(3, O, (r0 + 16) * oc + d0 + 16, o_rs)
                for kb in range(0, nbp, 32):        # V's two tiles loaded once for every part
                    _tileload(6, VB, (kb // 2) * vc + d0, vb_rs)
                    _tileload(7, VB, (kb // 2) * vc + d0 + 16, vb_rs)
                    for p in range(parts):
                        _tileload(4, PA, p * rpp + r0 * pc + kb, pa_rs)
                        _tdpbf16ps(0, 4, 6)
                        _tdpbf16ps(1, 4, 7)
                        _tileload(5, PA, p * rpp + (r0 + 16) * pc + kb, pa_rs)
                        _tdpbf16ps(2, 5, 6)
                        _tdpbf16ps(3, 5, 7)
                _tilestore(0, O, r0 * oc + d0, o_rs)
                _tilestore(1, O, r0 * oc + d0 + 16, o_rs)
                _tilestore(2, O, (r0 + 16) * oc + d0, o_rs)
                _tilestore(3, O, (r0 + 16) * oc + d0 + 16, o_rs)
        _tilerelease()

    in_place = njit(inline="always")(in_place)
    stage_keys = njit(cache=True)(stage_keys)
    split_rows = njit(cache=True)(split_rows)          # no fastmath: x - hi must be the exact difference
    value_pairs = njit(cache=True)(value_pairs)

    if HOST:
        _amx_pv_jit = njit(cache=True)(_amx_pv_body)

        @overload(amx_pv, inline="always")
        def _amx_pv_ov(PA, parts, VB, O, Rs, nbp, Dv, cfg):
            return lambda PA, parts, VB, O, Rs, nbp, Dv, cfg: _amx_pv_jit(PA, parts, VB, O, Rs, nbp, Dv, cfg)

        _amx_values_jit = njit(cache=True, fastmath={"nnan", "ninf", "nsz", "contract"})(amx_values)

    @overload(amx_values, inline="always")
    def _amx_values_ov(v_pages, pages, h, b0, nb, ST, Rp, O, PT, PA, VB, rescale, alpha, cfg):
        if HOST and v_pages.dtype == types.int16 and O.dtype == types.float32:
            return lambda v_pages, pages, h, b0, nb, ST, Rp, O, PT, PA, VB, rescale, alpha, cfg: _amx_values_jit(
                v_pages, pages, h, b0, nb, ST, Rp, O, PT, PA, VB, rescale, alpha, cfg)
        return lambda v_pages, pages, h, b0, nb, ST, Rp, O, PT, PA, VB, rescale, alpha, cfg: None

    @overload(value_scratch)
    def _value_scratch_ov(v_pages, O, block, rows, dot):
        if v_pages.dtype == types.int16 and O.dtype == types.float32:
            def impl(v_pages, O, block, rows, dot):
                Dv = v_pages.shape[3]
                if dot == 2 and Dv % 32 == 0:
                    n = block + 32
                    return (np.zeros((rows, n), np.float32),
                            zeros64(3 * rows, n, np.zeros(0, np.int16)).reshape((3, rows, n)),
                            zeros64(n // 2, Dv, np.zeros(0, np.uint32)))
                return np.zeros((0, 0), np.float32), np.zeros((0, 0, 0), np.int16), np.zeros((0, 0), np.uint32)
            return impl
        return lambda v_pages, O, block, rows, dot: (np.zeros((0, 0), np.float32), np.zeros((0, 0, 0), np.int16),
                                                     np.zeros((0, 0), np.uint32))
