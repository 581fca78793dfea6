"""`PoolView` (``KVCache.pool``): what a reader of the pages needs and a cache user does not.

The attention kernels, `decode` and the memory accounting read the page arrays, a sequence's page table and
first held position, and check K/V against the pool's storage format before they hand it over; the scheduler
asks whether a page is shared. All of it lives behind this one view so that `KVCache` itself keeps the user's
operations (sequences, append, truncate, fork, free, gather, snapshots, checks). Nothing here changes the cache:
the arrays are views to read (``kvcache.testing.pool_arrays`` gives tests the writable ones).

    k_pages(layer) / v_pages(layer)          [num_pages, num_kv_heads, page_size, head_dim (head_dim_v)]
    k_scales(layer) / v_scales(layer)        int8: float16 [num_pages, num_kv_heads, page_size, ceil(D / 32)]
    arrays, nbytes                           every page array of every layer, their bytes (virtual size)
    page_table(seq), first_position(seq)     where ``seq``'s K/V lives
    check_kv(k, v, ...), check_storable()    input validated and cast for this pool's storage
    allocator, index, needs_copy(page)       page accounting (read-only), the prefix index, copy-on-write
"""
import numpy as np

from .allocator import AllocatorView
from .checks import check_int, check_kv
from .core import CacheCore


class PoolView:
    """The page pool of one `KVCache`, read-only (see the module docstring)."""

    __slots__ = ("_core", "_pool", "allocator")

    def __init__(self, core: CacheCore):
        self._core, self._pool = core, core.pool
        self.allocator = AllocatorView(core.allocator)   # read-only: ref counts, free pages (tests, the scheduler)

    # -- the arrays ---------------------------------------------------------------------------------------------
    def k_pages(self, layer: int = 0) -> np.ndarray:
        """``[num_pages, num_kv_heads, page_size, head_dim]`` K pages of ``layer`` (a view; do not write)."""
        return self._pool.k[self._layer(layer)]

    def v_pages(self, layer: int = 0) -> np.ndarray:
        """``[num_pages, num_kv_heads, page_size, head_dim_v]`` V pages of ``layer`` (a view; do not write)."""
        return self._pool.v[self._layer(layer)]

    def k_scales(self, layer: int = 0) -> np.ndarray | None:
        """int8 storage: ``float16 [num_pages, num_kv_heads, page_size, ceil(head_dim / 32)]`` K scales of
        ``layer`` (a view; do not write); None for the float dtypes."""
        layer = self._layer(layer)
        return None if self._pool.k_scales is None else self._pool.k_scales[layer]

    def v_scales(self, layer: int = 0) -> np.ndarray | None:
        """int8 storage: ``float16 [num_pages, num_kv_heads, page_size, ceil(head_dim_v / 32)]`` V scales of
        ``layer`` (a view; do not write); None for the float dtypes."""
        layer = self._layer(layer)
        return None if self._pool.v_scales is None else self._pool.v_scales[layer]

    @property
    def arrays(self) -> tuple[np.ndarray, ...]:
        """Every preallocated page array, all layers: ``(k, v)``, and for int8 ``(k, v, k_scales, v_scales)``
        (read-only use: memory accounting)."""
        return self._pool.arrays

    @property
    def nbytes(self) -> int:
        """Bytes of the preallocated K and V page arrays (int8: and their scales), all layers (virtual size:
        lazily backed by the OS)."""
        return self._pool.nbytes

    def _layer(self, layer) -> int:
        return check_int("layer", layer, maximum=self._core.config.num_layers - 1)

    # -- where a sequence lives ---------------------------------------------------------------------------------
    def page_table(self, seq: int) -> np.ndarray:
        """``int32 [ceil(length / page_size)]`` physical page of each logical page of ``seq`` (-1: released)."""
        return self._core.sequence(seq).pages()

    def first_position(self, seq: int) -> int:
        """The first position of ``seq`` whose K/V is still held (> 0 once a sliding window released pages)."""
        return self._core.sequence(seq).first_live_page * self._core.config.page_size

    # -- input for this pool ------------------------------------------------------------------------------------
    def check_kv(self, k, v, num_tokens: int | None = None, *, layered: bool = True):
        """Validate K/V and cast them to the storage dtype (finite after the cast); for int8 storage check them
        finite and within `kvcache.quant.MAX_ABS` (`ScaleOverflowError`) and keep them float (writes quantize).

        ``layered``: ``k [num_layers, T, num_kv_heads, head_dim]`` (``[T, ...]`` accepted for one layer);
        otherwise one layer's ``k [T, num_kv_heads, head_dim]``. ``v`` likewise with ``head_dim_v``.
        """
        return check_kv(self._core.config, self._pool.check, k, v, num_tokens, layered=layered)

    def check_storable(self, name: str, x: np.ndarray) -> np.ndarray:
        """A float array of any shape validated for this pool's storage: cast to the storage dtype (finite after
        the cast), or for int8 checked finite and within `kvcache.quant.MAX_ABS` and returned as given."""
        return self._pool.check(name, x)

    def stored(self, x: np.ndarray) -> np.ndarray:
        """Rows already validated for this pool (magnitudes that stay finite in its storage) as its elements, once
        for a whole multi-token input: bfloat16 bits, float32 rounded to float16 by the jitted cast (bit for bit
        NumPy's), anything else as given (the write's assignment casts, int8 writes quantize)."""
        return self._pool.stored(x)

    # -- page accounting ----------------------------------------------------------------------------------------
    @property
    def index(self):
        """The prefix index (`kvcache.prefix.PrefixIndex`; prefix caching), else None."""
        return self._core.index

    def needs_copy(self, page: int) -> bool:
        """Whether a write into ``page`` copies it first: shared by several sequences, or registered (immutable)."""
        return self._core.needs_copy(check_int("page", page, maximum=self._core.config.num_pages - 1))
