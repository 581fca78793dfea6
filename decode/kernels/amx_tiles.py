"""Intel AMX tile multiplies (`tdpbf16ps`) for the tiled kernel's two GEMMs over bfloat16 pages, emitted as LLVM
intrinsics (the per-block preparation around them: `amx_blocks`).

Where the CPU has AMX-BF16 and Linux grants the tile state, a tile multiply adds C [16, 16] float32 += A [16, 32
bfloat16] . B [16 pairs, 16, 2 bfloat16]: 1024 bfloat16 products per instruction against 32 for `vdpbf16ps`. Every
product of two bfloat16 is exact in float32; the unit adds them into C in its own order (each pair in turn) and
reads bfloat16 subnormals as zero, flushing subnormal float32 results (|x| < 2**-126, far below the 1e-6 budget).
Every operand's rows start on a 64-byte boundary (`simd.zeros64`; the pools' pages do): an unaligned tile load
measured ~6x slower on the Intel guest. Both GEMMs keep C in 2 x 2 tiles (4 of the 8 tile registers) and load each
A / B tile once for all the parts of the other operand.

    HOST                          the compilation target has amx-tile and amx-bf16 (no AMX IR is emitted without)
    usable() -> bool              HOST, the OS granted the tile state (`arch_prctl`), $KVENGINE_AMX is not "0"
    tile_config() -> uint8 [64]   the tile configuration every call loads: 8 tiles of 16 rows x 64 bytes
    in_place(P, b0, g, nb)        whether keys b0 + g .. + 15 are read from the pages in place
    amx_scores(k_pages, pages, h, b0, nb, Kt, QA, parts, ST, Rp, cfg)
                                  ST[:nb rounded up to 32, :Rp] = the block's keys (in place where whole 16-key
                                  groups lie in a page, else staged in Kt) . the parts' columns QA (Rp, D
                                  multiples of 32; `amx_blocks.pack_parts` lays them out)
    amx_pv(PA, parts, VB, O, Rs, nbp, Dv, init, cfg)
                                  O[:Rs, :Dv] (+)= sum over parts of PA[p, :Rs, :nbp] . VB's key pairs (init: O's
                                  old values are not read, the sums start from zero tiles)
"""
import ctypes
import os

import numpy as np
from numba import njit, types

from kvcache.jit_target import target_has

from .simd import JIT

ENV = "KVENGINE_AMX"            # "0": never use the tiles (A/B measurements, tests of the other paths)
ARCH_REQ_XCOMP_PERM = 0x1023
XFEATURE_XTILEDATA = 18
SYS_ARCH_PRCTL = 158            # x86-64

HOST = JIT and target_has("amx-tile") and target_has("amx-bf16")
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


def in_place(P, b0, g, nb):
    """Whether the 16 keys b0 + g.. are read by the tiles in place: whole, inside one page, at a 16-row offset
    (rows on 64-byte boundaries: the pools' pages are)."""
    return P % 16 == 0 and b0 % 16 == 0 and g + 16 <= nb


def amx_pv(PA, parts, VB, O, Rs, nbp, Dv, init, cfg):
    """O[:Rs, :Dv] += sum over parts of PA[p, :Rs, :nbp] . VB's pairs (C: O's 16 x 16 blocks); init: O[:Rs, :Dv] =
    the sum (O not read)."""
    raise RuntimeError("amx_pv: this process cannot use AMX tiles (amx_tiles.usable() is False)")


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

    @njit(inline="always")
    def _load_quad(C, off, cols, stride):
        """C tiles 0-3 <- the 2 x 2 blocks of 16 x 16 at element offset off of C (cols per row)."""
        _tileload(0, C, off, stride)
        _tileload(1, C, off + 16, stride)
        _tileload(2, C, off + 16 * cols, stride)
        _tileload(3, C, off + 16 * cols + 16, stride)

    @njit(inline="always")
    def _store_quad(C, off, cols, stride):
        """C tiles 0-3 -> the 2 x 2 blocks of `_load_quad`."""
        _tilestore(0, C, off, stride)
        _tilestore(1, C, off + 16, stride)
        _tilestore(2, C, off + 16 * cols, stride)
        _tilestore(3, C, off + 16 * cols + 16, stride)

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
                _store_quad(ST, m0 * sc + n0, sc, ss)
        _tilerelease()

    def _amx_pv_body(PA, parts, VB, O, Rs, nbp, Dv, init, cfg):
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
                if init:
                    _tilezero(0)
                    _tilezero(1)
                    _tilezero(2)
                    _tilezero(3)
                else:
                    _load_quad(O, r0 * oc + d0, oc, o_rs)
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
                _store_quad(O, r0 * oc + d0, oc, o_rs)
        _tilerelease()

    in_place = njit(inline="always")(in_place)

    if HOST:
        _amx_scores_jit = njit(cache=True)(_amx_scores_body)
        _amx_pv_jit = njit(cache=True)(_amx_pv_body)

        @overload(amx_scores, inline="always")
        def _amx_scores_ov(k_pages, pages, h, b0, nb, Kt, QA, parts, ST, Rp, cfg):
            return lambda k_pages, pages, h, b0, nb, Kt, QA, parts, ST, Rp, cfg: _amx_scores_jit(
                k_pages, pages, h, b0, nb, Kt, QA, parts, ST, Rp, cfg)

        @overload(amx_pv, inline="always")
        def _amx_pv_ov(PA, parts, VB, O, Rs, nbp, Dv, init, cfg):
            return lambda PA, parts, VB, O, Rs, nbp, Dv, init, cfg: _amx_pv_jit(PA, parts, VB, O, Rs, nbp, Dv, init,
                                                                                cfg)
    else:
        @overload(amx_scores, inline="always")
        def _amx_scores_ov(k_pages, pages, h, b0, nb, Kt, QA, parts, ST, Rp, cfg):
            def impl(k_pages, pages, h, b0, nb, Kt, QA, parts, ST, Rp, cfg):
                raise RuntimeError("amx_scores: this build target has no AMX tiles")
            return impl

        @overload(amx_pv, inline="always")
        def _amx_pv_ov(PA, parts, VB, O, Rs, nbp, Dv, init, cfg):
            def impl(PA, parts, VB, O, Rs, nbp, Dv, init, cfg):
                raise RuntimeError("amx_pv: this build target has no AMX tiles")
            return impl
