"""Token transactions: reserve slots for new tokens of one or more sequences, write them layer by layer, then
publish the new lengths at once; on any failure every change is undone.

Order of work: `begin` reserves every page the tokens need (one allocation for the whole request, plus a
copy-on-write copy of a shared, partially filled last page); `write` stores one layer's K/V of one sequence
(saving the bytes it overwrites); `commit` checks every layer was written and publishes the lengths (and
registers pages that became full with known token ids, under prefix caching).

A transaction reaches the cache's state only through the `kvcache.seam.AppendSeam` the cache hands it.
"""
from typing import TYPE_CHECKING

import numpy as np

from .checks import check_int
from .journal import Journal
from .seam import AppendSeam

if TYPE_CHECKING:
    from .cache import KVCache


class Transaction:
    """Append ``num_tokens[seq]`` tokens to each sequence, all layers, atomically.

    Use as a context manager: commit on normal exit, rollback on any exception::

        with cache.transaction({seq: 1}) as tx:
            for layer in range(cache.config.num_layers):
                tx.write(layer, seq, k[layer], v[layer])     # k: [T, num_kv_heads, head_dim]
    """

    def __init__(self, cache: "KVCache", seam: AppendSeam, num_tokens: dict[int, int], token_ids: dict | None = None):
        self.cache, self._seam = cache, seam
        self.num_tokens = dict(num_tokens)
        self.token_ids = dict(token_ids or {})       # seq -> int32 [num_tokens[seq]] (checked by the cache)
        self.start = {}                      # seq -> length before the transaction (= first new position)
        self._written = {}                   # seq -> bool [num_layers]
        self._journal = Journal()
        self.state = "new"

    # -- lifecycle ---------------------------------------------------------------------------------------
    def begin(self) -> "Transaction":
        seam = self._seam
        with seam.lock:
            try:
                seam.reserve(self.num_tokens, self._journal)
                for seq in self.num_tokens:
                    self.start[seq] = seam.sequence(seq).length
                    self._written[seq] = np.zeros(self.cache.config.num_layers, dtype=bool)
            except BaseException:
                self._journal.rollback()
                raise
        self.state = "open"
        return self

    def write(self, layer: int, seq: int, k, v, *, checked: bool = False) -> None:
        """Store one layer's K/V of ``seq``: ``k [T, num_kv_heads, head_dim]``, ``v [T, num_kv_heads, head_dim_v]``.

        Inputs are validated (shape, float dtype, finite after casting to the storage dtype) unless
        ``checked`` says the caller already did so (arrays already cast). Any failure rolls back the whole
        transaction before the exception propagates.
        """
        self._require_open()
        try:
            if seq not in self.num_tokens:
                raise ValueError(f"seq: expected one of the transaction's sequences {sorted(self.num_tokens)}, "
                                 f"got {seq!r}")
            layer = check_int("layer", layer, maximum=self.cache.config.num_layers - 1)
            if not checked:
                k, v = self.cache.check_kv(k, v, self.num_tokens[seq], layered=False)
            self._seam.write(layer, seq, self.start[seq], k, v, self._journal)
            self._written[seq][layer] = True
        except BaseException:
            self.rollback()
            raise

    def commit(self) -> None:
        self._require_open()
        try:
            missing = {s: np.flatnonzero(~w).tolist() for s, w in self._written.items() if not w.all()}
            if missing:
                raise ValueError(f"commit: expected every layer written, got layers {missing} missing (seq: layers)")
            with self._seam.lock:
                self._seam.publish(self.num_tokens, self.start, self.token_ids)
        except BaseException:
            self.rollback()
            raise
        self._journal.clear()
        self.state = "committed"

    def rollback(self) -> None:
        if self.state != "open":
            return
        with self._seam.lock:
            self._journal.rollback()
            for seq in self.num_tokens:
                self._seam.sequence(seq).busy = False
        self.state = "rolled back"

    def __enter__(self) -> "Transaction":
        return self if self.state == "open" else self.begin()

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            if self.state != "committed":        # an explicit commit() inside the block is fine
                self.commit()
        else:
            self.rollback()

    # -- views for attention inside the transaction ----------------------------------------------------------
    def pages(self, seq: int) -> np.ndarray:
        """``int32 [num_logical_pages]``: the page table including the reserved pages."""
        return self._seam.sequence(seq).pages()

    def _require_open(self) -> None:
        if self.state != "open":
            raise RuntimeError(f"transaction: expected an open transaction, got one that is {self.state}")
