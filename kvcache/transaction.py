"""Append transactions: new tokens of one or more sequences reserved, written layer by layer, then published at
once; on any failure every change is undone. One protocol (`AppendTransaction`), three shapes, all opened by
`KVCache.transaction`, whose argument picks the shape:

    transaction({seq: T, ...}) -> Transaction   any number of tokens per sequence (prefill, speculative, mixed
                                                batches): journaled writes
    transaction([seq, ...])    -> TokenBatch    one token each of several sequences (the batched decode step):
                                                one scatter per layer and array
    transaction(seq)           -> TokenWrite    one token of one sequence (the decode step): the slot's bytes
                                                saved once for all layers

What every shape offers:

    seqs list[int], counts list[int], num_tokens {seq: count}   the sequences and their new tokens
    positions int64 [B]                                each sequence's first new position (its length before)
    indices int32 [total_pages], indptr int64 [B + 1]  the page tables in CSR form, reserved pages included
    pages(seq) -> int32 [num_logical_pages]            one sequence's row of them (seq may be left out for one)
    write(layer, k, v)                                 one layer of every sequence, ragged: checked (storage
                                                       dtype) k [N, num_kv_heads, head_dim], v [N, ..., head_dim_v]
                                                       with N = sum(counts), sequence 0's rows first
    write(layer, seq, k, v, checked=False)             one layer of one sequence, validated unless ``checked``
    commit() / rollback(), state, with-block           commit needs every layer of every sequence written

Pages are reserved when the shape is built: from then on it owns its sequences. A transaction reaches the cache
only through its `kvcache.appender.Appender`.
"""
import numpy as np

from .appender import Appender
from .checks import check_int, check_one_of


class AppendTransaction:
    """The protocol and the open / committed / rolled-back state machine the three shapes share."""

    __slots__ = ("seqs", "counts", "state", "_appender", "_sequences", "_starts", "_token_ids", "_num_layers",
                 "_written", "_seq_written", "_positions", "_tables")

    def __init__(self, appender: Appender, seqs: list[int], counts: list[int], token_ids: list | None):
        self._appender = appender
        self.seqs, self.counts = seqs, counts
        self._token_ids = token_ids                   # aligned with seqs: int32 ids or None each; or None
        self._num_layers = appender.config.num_layers
        self._written = 0                             # bit l: layer l written for every sequence
        self._seq_written = [0] * len(seqs)           # bit l of [b]: layer l written for sequence b alone
        self._positions = self._tables = None
        self.state = "new"

    # -- facts --------------------------------------------------------------------------------------------------
    @property
    def num_tokens(self) -> dict[int, int]:
        """``{seq: new tokens}``."""
        return dict(zip(self.seqs, self.counts))

    @property
    def positions(self) -> np.ndarray:
        """``int64 [B]``: each sequence's first new position."""
        if self._positions is None:
            self._positions = np.array(self._starts, dtype=np.int64)
        return self._positions

    @property
    def indices(self) -> np.ndarray:
        """``int32 [total_pages]``: the sequences' page tables (reserved pages included), concatenated."""
        return self._csr()[0]

    @property
    def indptr(self) -> np.ndarray:
        """``int64 [B + 1]``: row b of `indices` is ``indices[indptr[b]:indptr[b + 1]]``."""
        return self._csr()[1]

    def pages(self, seq=None) -> np.ndarray:
        """``int32 [num_logical_pages]``: the page table of ``seq`` (default: the only sequence), reserved pages
        included."""
        if seq is None and len(self.seqs) == 1:
            return self._sequences[0].pages()
        return self._sequences[check_one_of("seq", seq, self.seqs, "the transaction's sequences")].pages()

    def _csr(self) -> tuple:
        if self._tables is None:
            tables = [s.pages() for s in self._sequences]
            indptr = np.zeros(len(tables) + 1, dtype=np.int64)
            np.cumsum([len(t) for t in tables], out=indptr[1:])
            self._tables = (np.concatenate(tables) if len(tables) > 1 else tables[0].copy()), indptr
        return self._tables

    # -- writing --------------------------------------------------------------------------------------------
    def write(self, layer: int, *args, checked: bool = False) -> None:
        """``write(layer, k, v)``: one layer of every sequence, checked ragged ``k [N, num_kv_heads, head_dim]``,
        ``v [N, num_kv_heads, head_dim_v]`` (`PoolView.check_kv` with ``layered=False``).
        ``write(layer, seq, k, v)``: one layer of ``seq``, ``k [T, num_kv_heads, head_dim]``, ``v [T,
        num_kv_heads, head_dim_v]``, validated (shape, float dtype, finite after the cast to the storage dtype)
        unless ``checked`` says the caller did. Any failure rolls back the whole transaction."""
        if len(args) == 3:
            return self._write_one(layer, *args, checked)
        k, v = args
        try:
            if self.state != "open":
                self._require_open()
            if type(layer) is not int or not 0 <= layer < self._num_layers:
                layer = check_int("layer", layer, maximum=self._num_layers - 1)
            self._store(layer, k, v)
            self._written |= 1 << layer
        except BaseException:
            self.rollback()
            raise

    def _write_one(self, layer, seq, k, v, checked: bool) -> None:
        self._require_open()
        try:
            b = check_one_of("seq", seq, self.seqs, "the transaction's sequences")
            layer = check_int("layer", layer, maximum=self._num_layers - 1)
            if not checked:
                k, v = self._appender.check_kv(k, v, self.counts[b], layered=False)
            self._store_one(layer, b, k, v)
            self._seq_written[b] |= 1 << layer
        except BaseException:
            self.rollback()
            raise

    def _store(self, layer: int, k: np.ndarray, v: np.ndarray) -> None:
        """Every sequence's rows of ``layer`` (ragged, checked)."""
        raise NotImplementedError

    def _store_one(self, layer: int, b: int, k: np.ndarray, v: np.ndarray) -> None:
        """Sequence ``b``'s rows of ``layer`` (checked)."""
        raise NotImplementedError

    # -- ending ---------------------------------------------------------------------------------------------
    def commit(self) -> None:
        """Publish the new lengths (and token ids); every layer must have been written."""
        self._require_open()
        try:
            if self._written != (1 << self._num_layers) - 1:
                self._check_written()
            with self._appender.lock:
                self._appender.publish(self._sequences, self.counts, self._starts, self._token_ids)
        except BaseException:
            self.rollback()
            raise
        self._forget_saved()
        self.state = "committed"

    def rollback(self) -> None:
        """Undo everything (a no-op unless open)."""
        if self.state != "open":
            return
        with self._appender.lock:
            self._undo()
            for s in self._sequences:
                s.busy = False
        self.state = "rolled back"

    def _check_written(self) -> None:
        full, layers = (1 << self._num_layers) - 1, range(self._num_layers)
        masks = ((seq, self._written | mask) for seq, mask in zip(self.seqs, self._seq_written))
        missing = {seq: [l for l in layers if not mask >> l & 1] for seq, mask in masks if mask != full}
        if missing:
            raise ValueError(f"commit: expected every layer written, got layers {missing} missing (seq: layers)")

    def _undo(self) -> None:
        raise NotImplementedError

    def _forget_saved(self) -> None:
        raise NotImplementedError

    def _require_open(self) -> None:
        if self.state != "open":                 # its slots (or fresh pages) may belong to someone else by now
            raise RuntimeError(f"transaction: expected an open transaction, got one that is {self.state}")

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            if self.state != "committed":        # an explicit commit() inside the block is fine
                self.commit()
        else:
            self.rollback()


class Transaction(AppendTransaction):
    """Append ``num_tokens[seq]`` tokens to each sequence, all layers, atomically (`KVCache.transaction` of a
    dict)::

        with cache.transaction({seq: T}) as tx:
            for layer in range(cache.config.num_layers):
                tx.write(layer, seq, k[layer], v[layer])     # k: [T, num_kv_heads, head_dim]
    """

    __slots__ = ("_journal",)

    def __init__(self, appender: Appender, num_tokens: dict[int, int], token_ids: dict | None = None):
        seqs = list(num_tokens)
        super().__init__(appender, seqs, [num_tokens[s] for s in seqs],
                         [token_ids.get(s) for s in seqs] if token_ids else None)
        with appender.lock:
            self._sequences, self._journal = appender.reserve_journaled(dict(num_tokens))
        self._starts = [s.length for s in self._sequences]
        self.state = "open"

    def _store(self, layer: int, k: np.ndarray, v: np.ndarray) -> None:
        offset = 0
        for b, count in enumerate(self.counts):
            self._store_one(layer, b, k[offset:offset + count], v[offset:offset + count])
            offset += count

    def _store_one(self, layer: int, b: int, k: np.ndarray, v: np.ndarray) -> None:
        self._appender.write(layer, self._sequences[b], self._starts[b], k, v, self._journal)

    def _undo(self) -> None:
        self._journal.rollback()

    def _forget_saved(self) -> None:
        self._journal.clear()


class TokenBatch(AppendTransaction):
    """One token at position ``length`` of each of ``seqs`` (distinct; `KVCache.transaction` of a list): no Python loop
    per sequence in the per-layer path (one scatter per array, `PagePool.write_rows`). ``slot_pages int32 [B]``,
    ``slot_offsets int64 [B]``: each token's slot."""

    __slots__ = ("slot_pages", "slot_offsets", "_journal", "_saved")

    def __init__(self, appender: Appender, seqs: list[int], token_ids: list | None = None):
        super().__init__(appender, seqs, [1] * len(seqs), token_ids)
        self._saved: list = []
        with appender.lock:
            self._sequences, self._journal = appender.reserve_slots(seqs)
        self._starts = [s.length for s in self._sequences]
        self._locate_slots()
        self.state = "open"

    def _locate_slots(self) -> None:
        size = self._appender.config.page_size
        positions = self.positions
        self.slot_offsets = positions % size
        self.slot_pages = self.indices[self.indptr[:-1] + positions // size]

    def _store(self, layer: int, k: np.ndarray, v: np.ndarray) -> None:
        self._appender.write_rows(layer, self.slot_pages, self.slot_offsets, k, v, self._saved)

    def _store_one(self, layer: int, b: int, k: np.ndarray, v: np.ndarray) -> None:
        self._appender.write_rows(layer, self.slot_pages[b:b + 1], self.slot_offsets[b:b + 1], k, v, self._saved)

    def _undo(self) -> None:
        self._appender.restore_rows(self._saved)
        if self._journal is not None:
            self._journal.rollback()

    def _forget_saved(self) -> None:
        self._saved = []


class TokenWrite(TokenBatch):
    """The token batch of one sequence (`KVCache.transaction` of one id): when the token fits in the sequence's own last
    page nothing is allocated or journaled; the first write saves the slot's bytes in every layer (one copy),
    each write then stores one layer's ``k [num_kv_heads, head_dim]`` (or ``[1, num_kv_heads, head_dim]``)."""

    __slots__ = ("_slot", "_page", "_offset")

    def __init__(self, appender: Appender, seqs: list[int], token_ids: list | None = None):
        AppendTransaction.__init__(self, appender, seqs, [1], token_ids)
        self._saved, self._slot = [], None            # the slot in every layer, taken at the first write
        with appender.lock:
            s, self._journal = appender.reserve_slot(seqs[0])
        self._sequences, self._starts = [s], [s.length]
        size = appender.config.page_size
        self._page, self._offset = int(s.table[s.length // size]), s.length % size
        self.state = "open"

    @property
    def slot_pages(self) -> np.ndarray:
        return np.array([self._page], dtype=np.int32)

    @property
    def slot_offsets(self) -> np.ndarray:
        return np.array([self._offset], dtype=np.int64)

    def write(self, layer: int, k, v, *rest, checked: bool = False) -> None:
        """`AppendTransaction.write` with the store inlined (the decode step's per-layer path): checked ``k
        [num_kv_heads, head_dim]`` (or ``[1, num_kv_heads, head_dim]``), ``v`` likewise; ``write(layer, seq, k,
        v, checked=False)`` as in every shape."""
        if rest:
            return self._write_one(layer, k, v, rest[0], checked)
        try:
            if self.state != "open":
                self._require_open()
            if type(layer) is not int or not 0 <= layer < self._num_layers:
                layer = check_int("layer", layer, maximum=self._num_layers - 1)
            self._write_slot(layer, k[0] if k.ndim == 3 else k, v[0] if v.ndim == 3 else v)
            self._written |= 1 << layer
        except BaseException:
            self.rollback()
            raise

    def _write_slot(self, layer: int, k: np.ndarray, v: np.ndarray) -> None:
        slot = self._slot
        if slot is None:
            slot = self._slot = self._appender.slot_rows(self._page, self._offset)
            self._saved = [(view, view.copy()) for view in slot[0]]
        self._appender.write_token(slot, layer, k, v)

    def _store_one(self, layer: int, b: int, k: np.ndarray, v: np.ndarray) -> None:
        self._write_slot(layer, k[0], v[0])

    def _undo(self) -> None:
        for dst, saved in reversed(self._saved):
            dst[...] = saved
        if self._journal is not None:
            self._journal.rollback()
