"""The lean path for the commonest append: one token of one sequence (a decode step).

Same guarantees as `Transaction` (validated input, all layers or none, exact rollback, the same fault points)
at a fraction of its Python overhead: when the token fits in the sequence's own last page, no page is
allocated and nothing is journaled except the few bytes each write overwrites.
"""
from typing import TYPE_CHECKING

import numpy as np

from .checks import check_int
from .journal import Journal

if TYPE_CHECKING:
    from .cache import KVCache


class TokenWrite:
    """One reserved slot at position ``length`` of ``seq``; `write` each layer, then `commit` (or `rollback`)."""

    __slots__ = ("cache", "seq", "_s", "position", "page", "offset", "_journal", "_saved", "_written", "state")

    def __init__(self, cache: "KVCache", seq: int):
        self.cache, self.seq = cache, seq
        self._saved: list = []
        self._written = 0
        with cache._lock:
            s = self._s = cache._idle_sequence(seq)
            size = cache.config.page_size
            self.position = s.length
            if s.length % size == 0 or cache.allocator.ref_count(int(s.table[s.num_logical_pages - 1])) > 1:
                self._journal = Journal()                  # a new page, or a copy-on-write of a shared one
                try:
                    cache._reserve({seq: 1}, self._journal)
                except BaseException:
                    self._journal.rollback()
                    raise
            else:
                self._journal = None
                s.busy = True
            self.page = int(s.table[self.position // size])
            self.offset = self.position % size
        self.state = "open"

    def write(self, layer: int, k: np.ndarray, v: np.ndarray) -> None:
        """Store ``k [num_kv_heads, head_dim]``, ``v [num_kv_heads, head_dim_v]`` in ``layer``; a failure rolls
        the token back. They must be validated already (shape, float dtype, finite once cast to the storage
        dtype; int8: within `kvcache.quant.MAX_ABS`): the write into the pool casts (or quantizes) them."""
        cache = self.cache
        try:
            self._require_open()
            if type(layer) is not int or not 0 <= layer < cache.config.num_layers:
                layer = check_int("layer", layer, maximum=cache.config.num_layers - 1)
            cache._pool.write(layer, self.page, self.offset, k[:, None], v[:, None], cache._fault_hook,
                              saved=self._saved)                          # [num_kv_heads, 1, head_dim]
            self._written |= 1 << layer
        except BaseException:
            self.rollback()
            raise

    def pages(self) -> np.ndarray:
        """``int32 [num_logical_pages]``: the page table including the reserved slot's page."""
        return self._s.pages()

    def commit(self) -> None:
        self._require_open()
        cache = self.cache
        try:
            if self._written != (1 << cache.config.num_layers) - 1:
                raise ValueError(f"commit: expected every layer written, got layer mask {self._written:b}")
            with cache._lock:
                cache._publish({self.seq: 1}, {self.seq: self.position})
        except BaseException:
            self.rollback()
            raise
        self.state = "committed"

    def _require_open(self) -> None:
        if self.state != "open":               # its slot (or fresh page) may belong to someone else by now
            raise RuntimeError(f"token: expected an open token write, got one that is {self.state}")

    def rollback(self) -> None:
        if self.state != "open":
            return
        with self.cache._lock:
            for dst, saved in reversed(self._saved):
                dst[...] = saved
            if self._journal is not None:
                self._journal.rollback()
            self._s.busy = False
        self.state = "rolled back"
