"""`PagePool`: the preallocated page arrays of one cache and every byte-level operation on them (checked input
-> stored rows, page copy for copy-on-write, dense reads, hashing), for the float dtypes, bfloat16 and int8.

Arrays (all layers; allocated once with `kvcache.mapped.zeros`, lazily backed by the OS, never grown or moved):

    k:        [num_layers, num_pages, num_kv_heads, page_size, head_dim]      storage dtype (int8 for int8;
                                                                              uint16 bits for bfloat16)
    v:        [num_layers, num_pages, num_kv_heads, page_size, head_dim_v]
    k_scales: [num_layers, num_pages, num_kv_heads, page_size, ceil(head_dim / 32)]    float16, int8 only
    v_scales: [num_layers, num_pages, num_kv_heads, page_size, ceil(head_dim_v / 32)]  float16, int8 only

The scales sit beside the values with the same leading indices, so every operation on a (layer, page, head,
slot) row treats both alike: a write journals and overwrites the values and the scales of its rows, a
copy-on-write copies both, a dense read dequantizes (`kvcache.quant`). bfloat16 (`kvcache.bf16`): every write
rounds float input to the bits (bits given, as `check` returns them, are stored as they are); a dense read
widens to float32 (exact).
"""
import numpy as np

from . import bf16, mapped, quant
from .checks import check_storable
from .config import CacheConfig
from .jit_store import BFLOAT16, FLOAT16, as_f32_bits, scatter_kv, scatter_kv_bits, store_token_bits, to_f16
from .journal import Journal

_F32 = np.dtype(np.float32)
_JIT_FLOATS = (_F32, np.dtype(np.float64))


class PagePool:
    def __init__(self, cfg: CacheConfig):
        self.config = cfg
        self.quantized = cfg.dtype == quant.VALUE_DTYPE
        self.k = mapped.zeros((cfg.num_layers,) + cfg.k_page_shape, cfg.dtype)     # lazily backed by the OS
        self.v = mapped.zeros((cfg.num_layers,) + cfg.v_page_shape, cfg.dtype)
        if self.quantized:
            lead = (cfg.num_layers, cfg.num_pages, cfg.num_kv_heads, cfg.page_size)
            self.k_scales = mapped.zeros(lead + (quant.num_groups(cfg.head_dim),), quant.SCALE_DTYPE)
            self.v_scales = mapped.zeros(lead + (quant.num_groups(cfg.head_dim_v),), quant.SCALE_DTYPE)
            self.arrays = (self.k, self.v, self.k_scales, self.v_scales)
        else:
            self.k_scales = self.v_scales = None
            self.arrays = (self.k, self.v)
        self.bf16 = cfg.bfloat16
        # 16-bit formats: float32 input is rounded and stored by the jitted `kvcache.jit_store`, into the bits
        self.bits = BFLOAT16 if self.bf16 else FLOAT16 if cfg.dtype == np.float16 else None
        self.k16, self.v16 = (self.k.view(np.uint16), self.v.view(np.uint16)) if self.bits is not None else (None, None)

    @property
    def nbytes(self) -> int:
        """Bytes of every page array (values and scales), all layers."""
        return sum(a.nbytes for a in self.arrays)

    def check(self, name: str, x: np.ndarray) -> np.ndarray:
        """``x`` validated for this pool's storage (`kvcache.checks.check_storable`)."""
        return check_storable(self.config, name, x)

    def stored(self, x: np.ndarray) -> np.ndarray:
        """Checked rows as the pool's elements: for bfloat16 float input rounded to its bits (bits pass as they
        are); float32 for float16 storage cast by `jit_store.to_f16`; for the other formats ``x`` itself
        (the assignment casts)."""
        if self.bf16 and x.dtype != bf16.BITS_DTYPE:
            return bf16.to_bits(x)
        if self.bits == FLOAT16 and x.dtype == _F32:
            return to_f16(x)[0]
        return x

    def write(self, layer: int, page: int, offset: int, k, v, fault_hook, journal: Journal | None = None,
              saved: list | None = None) -> None:
        """Store ``k [H, count, D]`` and ``v [H, count, Dv]`` (checked) at slots ``offset ..`` of ``page``.
        Before each of K and V the fault point "write_k" / "write_v" is passed; the overwritten bytes (values
        and scales) go to ``journal`` or, as (view, copy) pairs, to the list ``saved``."""
        count = k.shape[1]
        for name, values, scales, src in (("write_k", self.k, self.k_scales, k),
                                          ("write_v", self.v, self.v_scales, v)):
            fault_hook(name)
            targets = [values[layer, page, :, offset:offset + count]]                 # [H, count, D]
            if scales is not None:
                stored, scale = quant.quantize(src)
                targets.append(scales[layer, page, :, offset:offset + count])         # [H, count, G]
                sources = (stored, scale)
            else:
                sources = (self.stored(src),)
            for dst in targets:
                if journal is not None:
                    journal.save_bytes(dst)
                else:
                    saved.append((dst, dst.copy()))
            for dst, data in zip(targets, sources):
                dst[...] = data

    def slot_rows(self, page: int, offset: int) -> tuple:
        """One token's slot in every layer: ``(views, page, offset)`` with ``views`` the ``[num_layers,
        num_kv_heads, width]`` rows of slot ``offset`` of ``page`` in every array (k, v; int8: k_scales,
        v_scales too), to save and write (`write_token`)."""
        return tuple(array[:, page, :, offset] for array in self.arrays), int(page), int(offset)

    def write_token(self, slot: tuple, layer: int, k: np.ndarray, v: np.ndarray, fault_hook) -> None:
        """Store one token's checked ``k [num_kv_heads, head_dim]``, ``v [num_kv_heads, head_dim_v]`` into
        ``layer`` of ``slot`` (`slot_rows`), passing the fault points "write_k" / "write_v" first; the caller
        saved the slot's bytes. float32 into float16 or bfloat16 storage: one jitted store of both."""
        rows = slot[0]
        fault_hook("write_k")
        if (self.bits is not None and k.dtype == _F32 and v.dtype == _F32 and k.flags.c_contiguous
                and v.flags.c_contiguous):
            fault_hook("write_v")
            store_token_bits(self.k16, self.v16, layer, slot[1], slot[2], k.view(np.uint32), v.view(np.uint32),
                             self.bits)
            return
        if self.quantized:
            rows[0][layer], rows[2][layer] = quant.quantize(k)
            fault_hook("write_v")
            rows[1][layer], rows[3][layer] = quant.quantize(v)
        else:
            rows[0][layer] = self.stored(k)
            fault_hook("write_v")
            rows[1][layer] = self.stored(v)

    def write_rows(self, layer: int, pages: np.ndarray, offsets: np.ndarray, k: np.ndarray, v: np.ndarray,
                   fault_hook, saved: list) -> None:
        """Store one token per row: ``k [B, num_kv_heads, head_dim]``, ``v [B, num_kv_heads, head_dim_v]``
        (checked) at slot ``offsets[b]`` of ``pages[b]`` (distinct slots), in one scatter per array. Before
        each of K and V the fault point "write_k" / "write_v" is passed; ``(array, pages, offsets, old rows)``
        go to ``saved`` (`restore_rows` puts them back)."""
        if self.bits is not None:
            kb, vb = as_f32_bits(k), as_f32_bits(v)
            if kb is not None and vb is not None:              # float32 -> float16 / bfloat16: one jitted scatter
                _scatter_saving(scatter_kv_bits, self.k16[layer], self.v16[layer], pages, offsets, kb, vb,
                                fault_hook, saved, self.bits)
                return
        if self.bf16:                                          # bits (or rounded to them): one jitted scatter
            _scatter_saving(scatter_kv, self.k[layer], self.v[layer], pages, offsets, self.stored(k),
                            self.stored(v), fault_hook, saved)
            return
        if not self.quantized and self.bits is None and k.dtype in _JIT_FLOATS and v.dtype in _JIT_FLOATS:
            _scatter_saving(scatter_kv, self.k[layer], self.v[layer], pages, offsets, k, v, fault_hook, saved)
            return
        for name, values, scales, src in (("write_k", self.k, self.k_scales, k),
                                          ("write_v", self.v, self.v_scales, v)):
            fault_hook(name)
            pairs = (((values[layer], src),) if scales is None
                     else tuple(zip((values[layer], scales[layer]), quant.quantize(src))))
            for array, data in pairs:                                  # array [num_pages, H, page_size, X]
                saved.append((array, pages, offsets, array[pages, :, offsets]))     # [B, H, X]
                array[pages, :, offsets] = data

    @staticmethod
    def restore_rows(saved: list) -> None:
        """Undo `write_rows` (newest first)."""
        for array, pages, offsets, old in reversed(saved):
            array[pages, :, offsets] = old

    def copy_page(self, old_page: int, new_page: int, journal: Journal) -> None:
        """Copy every array's ``[:, old_page]`` onto ``[:, new_page]`` (all layers), journaled."""
        for array in self.arrays:
            journal.save_bytes(array[:, new_page])
            array[:, new_page] = array[:, old_page]

    def clear_pages(self, pages: list[int]) -> None:
        """Zero every array's ``[:, page]`` of each of ``pages`` (free pages, whose bytes nobody needs back), a run
        of consecutive pages at a time. A memset, not ``MADV_DONTNEED``: the pages stay resident, so the next
        prefill into them takes no page faults (measured: giving them back made that prefill 1.4-1.8x slower)."""
        for first, stop in _runs(sorted(pages)):
            for array in self.arrays:
                array[:, first:stop] = 0

    def dense(self, layer: int, pages: np.ndarray, count: int) -> tuple[np.ndarray, np.ndarray]:
        """``K [count, H, D]``, ``V [count, H, Dv]`` of the first ``count`` slots of ``pages`` in ``layer``:
        copies in the storage dtype, dequantized float32 for int8, widened float32 (exact) for bfloat16."""
        if self.bf16:
            return tuple(bf16.to_float32(_dense(values[layer, pages], count)) for values in (self.k, self.v))
        if not self.quantized:
            return _dense(self.k[layer, pages], count), _dense(self.v[layer, pages], count)
        return tuple(quant.dequantize(_dense(values[layer, pages], count), _dense(scales[layer, pages], count))
                     for values, scales in ((self.k, self.k_scales), (self.v, self.v_scales)))

    def update_hash(self, h) -> None:
        for array in self.arrays:
            h.update(array.tobytes())


def _runs(pages: list[int]):
    """``(first, stop)`` of each run of consecutive ids in the sorted distinct ``pages``."""
    start = 0
    for i in range(1, len(pages) + 1):
        if i == len(pages) or pages[i] != pages[i - 1] + 1:
            yield pages[start], pages[i - 1] + 1
            start = i


def _dense(pages: np.ndarray, count: int) -> np.ndarray:
    n, heads, size, dim = pages.shape                                        # [n, H, page_size, D]
    return pages.transpose(0, 2, 1, 3).reshape(n * size, heads, dim)[:count].copy()   # [tokens, H, D]


def _scatter_saving(scatter, k_dst, v_dst, pages, offsets, k, v, fault_hook, saved: list, *extra) -> None:
    """One jitted ``scatter`` of the rows ``k`` / ``v`` (in the pool's element type, or float32 bits for
    `scatter_kv_bits`, whose format is in ``extra``) to slot ``offsets[b]`` of ``pages[b]``, the overwritten rows
    kept in ``saved`` for `restore_rows`; the fault points "write_k" and "write_v" are passed first."""
    fault_hook("write_k")
    fault_hook("write_v")
    k_old, v_old = np.empty(k.shape, k_dst.dtype), np.empty(v.shape, v_dst.dtype)
    saved.append((k_dst, pages, offsets, k_old))
    saved.append((v_dst, pages, offsets, v_old))
    scatter(k_dst, v_dst, pages, offsets, k, v, k_old, v_old, *extra)
