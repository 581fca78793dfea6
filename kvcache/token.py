"""The lean path for the commonest append: one token of one sequence (a decode step).

Same guarantees as `Transaction` (validated input, all layers or none, exact rollback, the same fault points)
at a fraction of its Python overhead: when the token fits in the sequence's own last page, no page is
allocated and nothing is journaled except the few bytes each write overwrites. It reaches the cache's state
only through the `kvcache.seam.AppendSeam` the cache hands it.
"""
from typing import TYPE_CHECKING

import numpy as np

from .checks import check_int
from .journal import Journal
from .seam import AppendSeam

if TYPE_CHECKING:
    from .cache import KVCache


class TokenWrite:
    """One reserved slot at position ``length`` of ``seq``; `write` each layer, then `commit` (or `rollback`)."""

    __slots__ = ("cache", "seq", "_seam", "_s", "position", "page", "offset", "_journal", "_saved", "_written",
                 "_token_ids", "_rows", "_num_layers", "state")

    def __init__(self, cache: "KVCache", seam: AppendSeam, seq: int, token_id=None):
        self.cache, self.seq, self._seam = cache, seq, seam
        self._saved: list = []              # (view, old bytes): the slot's rows in every layer, saved at the first write
        self._rows = None                   # the slot in every layer (`PagePool.slot_rows`)
        self._num_layers = cache.config.num_layers
        self._written = 0
        self._token_ids = None if token_id is None else {seq: token_id}     # int32 [1], checked by the cache
        with seam.lock:
            s = self._s = seam.idle_sequence(seq)
            size = cache.config.page_size
            self.position = s.length
            if s.length % size == 0 or seam.needs_copy(int(s.table[s.num_logical_pages - 1])):
                self._journal = Journal()                  # a new page, or a copy-on-write of a shared one
                try:
                    seam.reserve({seq: 1}, self._journal)
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
        dtype; int8: within `kvcache.quant.MAX_ABS`): the write into the pool casts (or quantizes) them.
        The first write saves the slot's bytes in every layer (one copy), each write then stores one layer."""
        try:
            if self.state != "open":
                self._require_open()
            if type(layer) is not int or not 0 <= layer < self._num_layers:
                layer = check_int("layer", layer, maximum=self._num_layers - 1)
            slot = self._rows
            if slot is None:
                slot = self._seam.slot_rows(self.page, self.offset)
                self._saved = [(view, view.copy()) for view in slot[0]]
                self._rows = slot
            self._seam.write_token(slot, layer, k, v)
            self._written |= 1 << layer
        except BaseException:
            self.rollback()
            raise

    def pages(self) -> np.ndarray:
        """``int32 [num_logical_pages]``: the page table including the reserved slot's page."""
        return self._s.pages()

    def commit(self) -> None:
        self._require_open()
        try:
            if self._written != (1 << self._num_layers) - 1:
                raise ValueError(f"commit: expected every layer written, got layer mask {self._written:b}")
            with self._seam.lock:
                self._seam.publish({self.seq: 1}, {self.seq: self.position}, self._token_ids)
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
        with self._seam.lock:
            for dst, saved in reversed(self._saved):
                dst[...] = saved
            if self._journal is not None:
                self._journal.rollback()
            self._s.busy = False
        self.state = "rolled back"
