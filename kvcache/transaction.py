"""Append transactions: new tokens of one or more sequences reserved, written layer by layer, then published at
once; on any failure every change is undone. One protocol (`AppendTransaction`), three shapes:

    Transaction   any number of tokens per sequence (prefill, speculative, mixed batches): journaled writes
    TokenBatch    one token each of several sequences (the batched decode step): one scatter per layer and array
    TokenWrite    the TokenBatch of one sequence (the decode step): the slot's bytes saved once for all layers

What every shape offers:

    seqs list[int], counts list[int]                   the sequences and their new tokens
    positions int64 [B]                                each sequence's first new position (its length before)
    indices int32 [total_pages], indptr int64 [B + 1]  the page tables in CSR form, reserved pages included
    pages(seq) -> int32 [num_logical_pages]            one sequence's row of them (seq may be left out for one)
    write(layer, k, v)                                 one layer of every sequence, ragged: checked (storage
                                                       dtype) k [N, num_kv_heads, head_dim], v [N, ..., head_dim_v]
                                                       with N = sum(counts), sequence 0's rows first
    commit() / rollback(), state, with-block           commit needs every layer written

`Transaction` also writes one sequence at a time, validating: ``write(layer, seq, k, v, checked=False)``.
Pages are reserved when the shape is built (`KVCache.transaction`, `begin_tokens`, `begin_token`): from then on
it owns its sequences. A transaction reaches the cache only through its `kvcache.appender.Appender`.
"""
import numpy as np

from .appender import Appender
from .checks import check_int


class AppendTransaction:
    """The protocol and the open / committed / rolled-back state machine the three shapes share."""

    __slots__ = ("seqs", "counts", "state", "_appender", "_sequences", "_starts", "_token_ids", "_num_layers",
                 "_written", "_positions", "_tables")
    _names = ("transaction", "transaction")           # (argument, what) in the state errors

    def __init__(self, appender: Appender, seqs: list[int], counts: list[int], token_ids: list | None):
        self._appender = appender
        self.seqs, self.counts = seqs, counts
        self._token_ids = token_ids                   # aligned with seqs: int32 ids or None each; or None
        self._num_layers = appender.config.num_layers
        self._written = 0                             # bit l: layer l written for every sequence
        self._positions = self._tables = None
        self.state = "new"

    # -- facts --------------------------------------------------------------------------------------------------
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
        if seq not in self.seqs:
            raise ValueError(f"seq: expected one of the transaction's sequences {self.seqs}, got {seq!r}")
        return self._sequences[self.seqs.index(seq)].pages()

    def _csr(self) -> tuple:
        if self._tables is None:
            tables = [s.pages() for s in self._sequences]
            indptr = np.zeros(len(tables) + 1, dtype=np.int64)
            np.cumsum([len(t) for t in tables], out=indptr[1:])
            self._tables = (np.concatenate(tables) if len(tables) > 1 else tables[0].copy()), indptr
        return self._tables

    # -- writing --------------------------------------------------------------------------------------------
    def write(self, layer: int, k: np.ndarray, v: np.ndarray) -> None:
        """Store one layer of every sequence: checked ragged ``k [N, num_kv_heads, head_dim]``, ``v [N,
        num_kv_heads, head_dim_v]`` (`KVCache.check_kv` with ``layered=False``); a failure rolls the whole
        transaction back."""
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

    def _store(self, layer: int, k: np.ndarray, v: np.ndarray) -> None:
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

    def _layer_masks(self):
        """``(seq, written-layer bit mask)`` of each sequence."""
        return ((seq, self._written) for seq in self.seqs)

    def _check_written(self) -> None:
        full, layers = (1 << self._num_layers) - 1, range(self._num_layers)
        missing = {seq: [l for l in layers if not mask >> l & 1] for seq, mask in self._layer_masks() if mask != full}
        if missing:
            raise ValueError(f"commit: expected every layer written, got layers {missing} missing (seq: layers)")

    def _undo(self) -> None:
        raise NotImplementedError

    def _forget_saved(self) -> None:
        raise NotImplementedError

    def _require_open(self) -> None:
        if self.state != "open":                 # its slots (or fresh pages) may belong to someone else by now
            name, what = self._names
            raise RuntimeError(f"{name}: expected an open {what}, got one that is {self.state}")

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            if self.state != "committed":        # an explicit commit() inside the block is fine
                self.commit()
        else:
            self.rollback()


class Transaction(AppendTransaction):
    """Append ``num_tokens[seq]`` tokens to each sequence, all layers, atomically (`KVCache.transaction`)::

        with cache.transaction({seq: 1}) as tx:
            for layer in range(cache.config.num_layers):
                tx.write(layer, seq, k[layer], v[layer])     # k: [T, num_kv_heads, head_dim]
    """

    __slots__ = ("num_tokens", "_journal", "_seq_written")

    def __init__(self, appender: Appender, num_tokens: dict[int, int], token_ids: dict | None = None):
        seqs = list(num_tokens)
        super().__init__(appender, seqs, [num_tokens[s] for s in seqs],
                         [token_ids.get(s) for s in seqs] if token_ids else None)
        self.num_tokens = dict(num_tokens)
        self._seq_written = dict.fromkeys(seqs, 0)
        with appender.lock:
            self._sequences, self._journal = appender.reserve_journaled(self.num_tokens)
        self._starts = [s.length for s in self._sequences]
        self.state = "open"

    def write(self, layer: int, *args, checked: bool = False) -> None:
        """``write(layer, k, v)``: the protocol's ragged write of every sequence (checked arrays).
        ``write(layer, seq, k, v)``: one layer of ``seq``, ``k [T, num_kv_heads, head_dim]``, ``v [T,
        num_kv_heads, head_dim_v]``, validated (shape, float dtype, finite after the cast to the storage dtype)
        unless ``checked`` says the caller did. Any failure rolls back the whole transaction."""
        if len(args) == 2:
            return super().write(layer, *args)
        seq, k, v = args
        self._require_open()
        try:
            if seq not in self._seq_written:
                raise ValueError(f"seq: expected one of the transaction's sequences {sorted(self.num_tokens)}, "
                                 f"got {seq!r}")
            layer = check_int("layer", layer, maximum=self._num_layers - 1)
            b = self.seqs.index(seq)
            if not checked:
                k, v = self._appender.check_kv(k, v, self.counts[b], layered=False)
            self._appender.write(layer, self._sequences[b], self._starts[b], k, v, self._journal)
            self._seq_written[seq] |= 1 << layer
        except BaseException:
            self.rollback()
            raise

    def _store(self, layer: int, k: np.ndarray, v: np.ndarray) -> None:
        offset = 0
        for s, start, count in zip(self._sequences, self._starts, self.counts):
            self._appender.write(layer, s, start, k[offset:offset + count], v[offset:offset + count], self._journal)
            offset += count

    def _layer_masks(self):
        return ((seq, self._written | mask) for seq, mask in self._seq_written.items())

    def _undo(self) -> None:
        self._journal.rollback()

    def _forget_saved(self) -> None:
        self._journal.clear()


class TokenBatch(AppendTransaction):
    """One token at position ``length`` of each of ``seqs`` (distinct; `KVCache.begin_tokens`): no Python loop
    per sequence in the per-layer path (one scatter per array, `PagePool.write_rows`). ``slot_pages int32 [B]``,
    ``slot_offsets int64 [B]``: each token's slot."""

    __slots__ = ("slot_pages", "slot_offsets", "_journal", "_saved")
    _names = ("tokens", "token batch")

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

    def _undo(self) -> None:
        self._appender.restore_rows(self._saved)
        if self._journal is not None:
            self._journal.rollback()

    def _forget_saved(self) -> None:
        self._saved = []


class TokenWrite(TokenBatch):
    """The token batch of one sequence (`KVCache.begin_token`): when the token fits in the sequence's own last
    page nothing is allocated or journaled; the first write saves the slot's bytes in every layer (one copy),
    each write then stores one layer's ``k [num_kv_heads, head_dim]`` (or ``[1, num_kv_heads, head_dim]``)."""

    __slots__ = ("_slot", "_page", "_offset")
    _names = ("token", "token write")

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

    def write(self, layer: int, k: np.ndarray, v: np.ndarray) -> None:
        """`AppendTransaction.write` with the store inlined (the decode step's per-layer path): checked ``k
        [num_kv_heads, head_dim]`` (or ``[1, num_kv_heads, head_dim]``), ``v`` likewise."""
        try:
            if self.state != "open":
                self._require_open()
            if type(layer) is not int or not 0 <= layer < self._num_layers:
                layer = check_int("layer", layer, maximum=self._num_layers - 1)
            slot = self._slot
            if slot is None:
                slot = self._slot = self._appender.slot_rows(self._page, self._offset)
                self._saved = [(view, view.copy()) for view in slot[0]]
            self._appender.write_token(slot, layer, k[0] if k.ndim == 3 else k, v[0] if v.ndim == 3 else v)
            self._written |= 1 << layer
        except BaseException:
            self.rollback()
            raise

    def _undo(self) -> None:
        for dst, saved in reversed(self._saved):
            dst[...] = saved
        if self._journal is not None:
            self._journal.rollback()
