"""`PagePool`: the preallocated page arrays of one cache and every byte-level operation on them (checked input
-> stored rows, page copy for copy-on-write, dense reads, hashing), for the float dtypes and int8.

Arrays (all layers; allocated once with ``np.zeros``, lazily backed by the OS, never grown or moved):

    k:        [num_layers, num_pages, num_kv_heads, page_size, head_dim]      storage dtype (int8 for int8)
    v:        [num_layers, num_pages, num_kv_heads, page_size, head_dim_v]
    k_scales: [num_layers, num_pages, num_kv_heads, page_size, ceil(head_dim / 32)]    float16, int8 only
    v_scales: [num_layers, num_pages, num_kv_heads, page_size, ceil(head_dim_v / 32)]  float16, int8 only

The scales sit beside the values with the same leading indices, so every operation on a (layer, page, head,
slot) row treats both alike: a write journals and overwrites the values and the scales of its rows, a
copy-on-write copies both, a dense read dequantizes (`kvcache.quant`).
"""
import numpy as np

from . import quant
from .checks import cast_to_storage
from .config import CacheConfig
from .journal import Journal


class PagePool:
    def __init__(self, cfg: CacheConfig):
        self.config = cfg
        self.quantized = cfg.dtype == quant.VALUE_DTYPE
        self.k = np.zeros((cfg.num_layers,) + cfg.k_page_shape, dtype=cfg.dtype)   # lazily backed by the OS
        self.v = np.zeros((cfg.num_layers,) + cfg.v_page_shape, dtype=cfg.dtype)
        if self.quantized:
            lead = (cfg.num_layers, cfg.num_pages, cfg.num_kv_heads, cfg.page_size)
            self.k_scales = np.zeros(lead + (quant.num_groups(cfg.head_dim),), dtype=quant.SCALE_DTYPE)
            self.v_scales = np.zeros(lead + (quant.num_groups(cfg.head_dim_v),), dtype=quant.SCALE_DTYPE)
            self.arrays = (self.k, self.v, self.k_scales, self.v_scales)
        else:
            self.k_scales = self.v_scales = None
            self.arrays = (self.k, self.v)

    @property
    def nbytes(self) -> int:
        """Bytes of every page array (values and scales), all layers."""
        return sum(a.nbytes for a in self.arrays)

    def check(self, name: str, x: np.ndarray) -> np.ndarray:
        """A float array validated for storage: cast to the storage dtype (finite after the cast), or for int8
        checked finite and within `quant.MAX_ABS` and returned as given (the write quantizes)."""
        if self.quantized:
            quant.check_quantizable(name, x)
            return x
        return cast_to_storage(name, x, self.config.dtype)

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
                sources = (src,)
            for dst in targets:
                if journal is not None:
                    journal.save_bytes(dst)
                else:
                    saved.append((dst, dst.copy()))
            for dst, data in zip(targets, sources):
                dst[...] = data

    def copy_page(self, old_page: int, new_page: int, journal: Journal) -> None:
        """Copy every array's ``[:, old_page]`` onto ``[:, new_page]`` (all layers), journaled."""
        for array in self.arrays:
            journal.save_bytes(array[:, new_page])
            array[:, new_page] = array[:, old_page]

    def dense(self, layer: int, pages: np.ndarray, count: int) -> tuple[np.ndarray, np.ndarray]:
        """``K [count, H, D]``, ``V [count, H, Dv]`` of the first ``count`` slots of ``pages`` in ``layer``:
        copies in the storage dtype, or dequantized float32 for int8."""
        if not self.quantized:
            return _dense(self.k[layer, pages], count), _dense(self.v[layer, pages], count)
        return tuple(quant.dequantize(_dense(values[layer, pages], count), _dense(scales[layer, pages], count))
                     for values, scales in ((self.k, self.k_scales), (self.v, self.v_scales)))

    def update_hash(self, h) -> None:
        for array in self.arrays:
            h.update(array.tobytes())


def _dense(pages: np.ndarray, count: int) -> np.ndarray:
    n, heads, size, dim = pages.shape                                        # [n, H, page_size, D]
    return pages.transpose(0, 2, 1, 3).reshape(n * size, heads, dim)[:count].copy()   # [tokens, H, D]
