"""The batched decode step's append: one token of each of several sequences (continuous batching).

Same guarantees as `Transaction` (all layers or none, exact rollback, the same fault points) with no Python
loop per sequence in the per-layer path: the slots are reserved once (a page is taken only by the sequences
whose last page is full or shared), each layer's K/V of every sequence is stored with one scatter per array
(`PagePool.write_rows`), and the page tables are handed out as one CSR array. It reaches the cache's state only
through the `kvcache.seam.AppendSeam` the cache hands it.
"""
from typing import TYPE_CHECKING

import numpy as np

from .checks import check_int
from .journal import Journal
from .seam import AppendSeam

if TYPE_CHECKING:
    from .cache import KVCache


class TokenBatch:
    """One reserved slot at position ``length`` of each of ``seqs`` (distinct); `write` each layer with
    ``k [B, num_kv_heads, head_dim]``, ``v [B, num_kv_heads, head_dim_v]``, then `commit` (or `rollback`).

    ``positions int64 [B]``: each slot's position; ``indices int32``, ``indptr int64 [B + 1]``: the sequences'
    page tables (reserved pages included) in CSR form; ``pages int32 [B]``, ``offsets int64 [B]``: the slots."""

    __slots__ = ("cache", "seqs", "_seam", "_sequences", "positions", "indices", "indptr", "pages", "offsets",
                 "_journal", "_saved", "_written", "_num_layers", "_token_ids", "state")

    def __init__(self, cache: "KVCache", seam: AppendSeam, seqs: list[int], token_ids: dict | None = None):
        self.cache, self.seqs, self._seam = cache, list(seqs), seam
        self._saved: list = []
        self._written = 0
        self._num_layers = cache.config.num_layers
        self._token_ids = token_ids or None           # {seq: int32 [1]}, checked by the cache
        size = cache.config.page_size
        with seam.lock:
            sequences = seam.idle_sequences(self.seqs)
            # a sequence whose token needs a page (its last is full) or a private copy of a shared last page
            need = {seq: 1 for seq, s in zip(self.seqs, sequences)
                    if s.length % size == 0 or seam.needs_copy(int(s.table[s.num_logical_pages - 1]))}
            self._journal = journal = Journal()
            try:
                if need:
                    reserve = need if len(need) == len(self.seqs) else self._reserve_needed(need, sequences)
                    seam.reserve(reserve, journal)
            except BaseException:
                journal.rollback()
                raise
            for s in sequences:
                s.busy = True
        self._sequences = sequences
        self.positions = np.array([s.length for s in sequences], dtype=np.int64)
        tables = [s.pages() for s in sequences]
        self.indices = np.concatenate(tables) if len(tables) > 1 else tables[0].copy()
        self.indptr = np.zeros(len(tables) + 1, dtype=np.int64)
        np.cumsum([len(t) for t in tables], out=self.indptr[1:])
        self.offsets = self.positions % size
        self.pages = self.indices[self.indptr[:-1] + self.positions // size]
        self.state = "open"

    def _reserve_needed(self, need: dict, sequences) -> dict:
        """``need`` when the pool has the pages; else every sequence (the reservation then raises the
        `CacheFullError` the whole request gets from `KVCache.transaction`, whose could-ever-fit counts them all)."""
        if len(need) <= self.cache.num_free_pages:                # one page each: a fresh one or a copy
            return need
        return {seq: 1 for seq in self.seqs}

    def write(self, layer: int, k: np.ndarray, v: np.ndarray) -> None:
        """Store ``k [B, num_kv_heads, head_dim]``, ``v [B, num_kv_heads, head_dim_v]`` (row b: sequence
        ``seqs[b]``) in ``layer``; a failure rolls the batch back. They must be validated already (shape, float
        dtype, finite once cast to the storage dtype; int8: within `kvcache.quant.MAX_ABS`)."""
        try:
            if self.state != "open":
                self._require_open()
            if type(layer) is not int or not 0 <= layer < self._num_layers:
                layer = check_int("layer", layer, maximum=self._num_layers - 1)
            self._seam.write_rows(layer, self.pages, self.offsets, k, v, self._saved)
            self._written |= 1 << layer
        except BaseException:
            self.rollback()
            raise

    def commit(self) -> None:
        self._require_open()
        try:
            if self._written != (1 << self._num_layers) - 1:
                raise ValueError(f"commit: expected every layer written, got layer mask {self._written:b}")
            with self._seam.lock:
                self._seam.publish(dict.fromkeys(self.seqs, 1), dict(zip(self.seqs, self.positions.tolist())),
                                   self._token_ids)
        except BaseException:
            self.rollback()
            raise
        self._saved = []
        self.state = "committed"

    def _require_open(self) -> None:
        if self.state != "open":               # its slots (or fresh pages) may belong to someone else by now
            raise RuntimeError(f"tokens: expected an open token batch, got one that is {self.state}")

    def rollback(self) -> None:
        if self.state != "open":
            return
        with self._seam.lock:
            self._seam.restore_rows(self._saved)
            self._journal.rollback()
            for s in self._sequences:
                s.busy = False
        self.state = "rolled back"
