"""The frozen layout of a cache pool."""
from dataclasses import dataclass

import numpy as np

from . import quant
from .checks import BFLOAT16, check_int, check_pool_size, check_storage_dtype, storage_array_dtype


@dataclass(frozen=True)
class CacheConfig:
    """Layout of one pool: every layer has K pages ``[num_pages, num_kv_heads, page_size, head_dim]`` and
    V pages ``[num_pages, num_kv_heads, page_size, head_dim_v]`` of element type ``dtype`` in the storage format
    ``storage`` (its name: "float16", "float32", "float64", "int8" or "bfloat16"; ``dtype`` is the numpy dtype of
    that name, or uint16 for bfloat16, whose pool holds the bits, `kvcache.bf16`; int8: plus float16 scale
    arrays ``[num_pages, num_kv_heads, page_size, ceil(head_dim / 32)]``, see `kvcache.quant`).

    The head-major page layout (heads outside tokens) keeps each head's keys of a page contiguous, so the
    decode kernel streams ``page_size * head_dim`` elements per (page, head); it measured 1.3-2.5x faster
    than the token-major ``[num_pages, page_size, num_kv_heads, head_dim]`` (docs/kernel.md).
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    head_dim_v: int
    page_size: int
    num_pages: int
    dtype: np.dtype
    storage: str

    @classmethod
    def build(cls, *, num_layers=1, num_kv_heads, head_dim, head_dim_v=None, page_size=16, num_pages=None,
              max_tokens=None, dtype="float32") -> "CacheConfig":
        """Check every argument; ``num_pages`` or ``max_tokens`` (rounded up to whole pages) sizes the pool."""
        page_size = check_int("page_size", page_size, minimum=1)
        num_pages = check_pool_size(num_pages, max_tokens, page_size)
        head_dim = check_int("head_dim", head_dim, minimum=1)
        return cls(num_layers=check_int("num_layers", num_layers, minimum=1),
                   num_kv_heads=check_int("num_kv_heads", num_kv_heads, minimum=1),
                   head_dim=head_dim,
                   head_dim_v=head_dim if head_dim_v is None else check_int("head_dim_v", head_dim_v, minimum=1),
                   page_size=page_size,
                   num_pages=num_pages,
                   dtype=storage_array_dtype(storage := check_storage_dtype("dtype", dtype)), storage=storage)

    @property
    def k_page_shape(self) -> tuple:
        """``[num_pages, num_kv_heads, page_size, head_dim]`` of one layer."""
        return (self.num_pages, self.num_kv_heads, self.page_size, self.head_dim)

    @property
    def v_page_shape(self) -> tuple:
        """``[num_pages, num_kv_heads, page_size, head_dim_v]`` of one layer."""
        return (self.num_pages, self.num_kv_heads, self.page_size, self.head_dim_v)

    @property
    def quantized(self) -> bool:
        """int8 storage: values plus float16 scales per 32 values (`kvcache.quant`)."""
        return self.dtype == quant.VALUE_DTYPE

    @property
    def bfloat16(self) -> bool:
        """bfloat16 storage: uint16 bits of the inputs rounded to nearest even (`kvcache.bf16`)."""
        return self.storage == BFLOAT16

    @property
    def scale_bytes_per_token(self) -> int:
        """Bytes of the int8 scales of one token over all layers (0 for the float dtypes): one float16 per
        group of 32 values of each kv head's K row and V row."""
        if not self.quantized:
            return 0
        groups = quant.num_groups(self.head_dim) + quant.num_groups(self.head_dim_v)
        return self.num_layers * self.num_kv_heads * groups * quant.SCALE_DTYPE.itemsize

    @property
    def bytes_per_token(self) -> int:
        """K and V bytes of one token over all layers (int8: the values plus their scales)."""
        return (self.num_layers * self.num_kv_heads * (self.head_dim + self.head_dim_v)
                * self.dtype.itemsize) + self.scale_bytes_per_token

    @property
    def bytes_per_page(self) -> int:
        """K and V bytes of one page over all layers."""
        return self.bytes_per_token * self.page_size

    def element_offset(self, layer: int, page: int, head: int, slot: int, dim: int, *, v: bool = False) -> int:
        """The layout contract: flat index of K element ``[layer, page, head, slot, dim]`` (V with ``v=True``) in
        the C-ordered pool array ``[num_layers, num_pages, num_kv_heads, page_size, head_dim (or head_dim_v)]``.

        A Python int (never wraps): times ``dtype.itemsize`` it is the byte offset, past 2**31 for any pool over
        2 GiB. Readers must index with 64-bit integers (numpy and numba index with intp); an int32 offset would
        wrap and read another page's K/V."""
        width = self.head_dim_v if v else self.head_dim
        layer = check_int("layer", layer, maximum=self.num_layers - 1)
        page = check_int("page", page, maximum=self.num_pages - 1)
        head = check_int("head", head, maximum=self.num_kv_heads - 1)
        slot = check_int("slot", slot, maximum=self.page_size - 1)
        dim = check_int("dim", dim, maximum=width - 1)
        return (((layer * self.num_pages + page) * self.num_kv_heads + head) * self.page_size + slot) * width + dim

    def pages_for(self, tokens: int) -> int:
        """Pages that hold ``tokens`` tokens (ceil division)."""
        return -(-tokens // self.page_size)
