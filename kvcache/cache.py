"""`KVCache`: one preallocated pool of K/V pages shared by many sequences.

Storage per layer: ``k: [num_pages, num_kv_heads, page_size, head_dim]``,
``v: [num_pages, num_kv_heads, page_size, head_dim_v]``, one array each for all layers (allocated once, never
grown or copied). All layers share one page table per sequence: a token's slot is the same page and offset in
every layer.

Failure guarantee: every mutating operation validates its arguments first, then records the inverse of each
change in a journal; on any exception (bad input, `CacheFullError`, an injected fault) the journal is
replayed, so lengths, page tables, reference counts, the free list (its order too) and every byte of the pool
are exactly what they were.

Threads: one re-entrant lock guards all metadata (allocator, page tables, lengths). Different threads may
append to, truncate, fork or free *different* sequences concurrently; K/V bytes are written outside the lock,
into pages a transaction owns exclusively (copy-on-write made sure of it). A sequence with an open
transaction refuses every other mutation (`RuntimeError`). Not safe: reading a sequence (gather, attention)
while another thread truncates or frees that same sequence.
"""
import hashlib
import threading
from collections import Counter

import numpy as np

from .allocator import PageAllocator
from .checks import as_float_array, check_int, check_shape
from .config import CacheConfig
from .faults import no_fault
from .journal import Journal
from .sequence import Sequence
from .storage import PagePool
from .token import TokenWrite
from .transaction import Transaction


class KVCache:
    """A paged KV cache.

    Parameters
    ----------
    num_layers, num_kv_heads, head_dim : int
    head_dim_v : int or None      V head size (None: same as head_dim)
    dtype : "float16" | "float32" | "float64" | "int8"   storage dtype (int8: quantized on write with a
                                  float16 scale per 32 values, `kvcache.quant`; reads dequantize)
    page_size : int               tokens per page
    num_pages / max_tokens : int  pool size (give exactly one; max_tokens is rounded up to whole pages)
    """

    def __init__(self, *, num_kv_heads, head_dim, head_dim_v=None, num_layers=1, dtype="float32", page_size=16,
                 num_pages=None, max_tokens=None):
        self.config = cfg = CacheConfig.build(num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=head_dim,
                                              head_dim_v=head_dim_v, page_size=page_size, num_pages=num_pages,
                                              max_tokens=max_tokens, dtype=dtype)
        self._pool = PagePool(cfg)                 # the page arrays (values, int8 scales) and their byte operations
        self._k, self._v = self._pool.k, self._pool.v
        self.allocator = PageAllocator(cfg.num_pages)
        self._sequences: dict[int, Sequence] = {}
        self._next_id = 0
        self._lock = threading.RLock()
        self.fault_hook = no_fault

    # -- fault hook (tests) ------------------------------------------------------------------------------
    @property
    def fault_hook(self):
        return self._fault_hook

    @fault_hook.setter
    def fault_hook(self, hook) -> None:
        self._fault_hook = hook
        self.allocator.fault_hook = hook

    # -- read-only views ----------------------------------------------------------------------------------
    def k_pages(self, layer: int = 0) -> np.ndarray:
        """``[num_pages, num_kv_heads, page_size, head_dim]`` K pages of ``layer`` (a view; do not write)."""
        return self._k[check_int("layer", layer, maximum=self.config.num_layers - 1)]

    def v_pages(self, layer: int = 0) -> np.ndarray:
        """``[num_pages, num_kv_heads, page_size, head_dim_v]`` V pages of ``layer`` (a view; do not write)."""
        return self._v[check_int("layer", layer, maximum=self.config.num_layers - 1)]

    def k_scales(self, layer: int = 0) -> np.ndarray | None:
        """int8 storage: ``float16 [num_pages, num_kv_heads, page_size, ceil(head_dim / 32)]`` K scales of
        ``layer`` (a view; do not write); None for the float dtypes."""
        layer = check_int("layer", layer, maximum=self.config.num_layers - 1)
        return None if self._pool.k_scales is None else self._pool.k_scales[layer]

    def v_scales(self, layer: int = 0) -> np.ndarray | None:
        """int8 storage: ``float16 [num_pages, num_kv_heads, page_size, ceil(head_dim_v / 32)]`` V scales of
        ``layer`` (a view; do not write); None for the float dtypes."""
        layer = check_int("layer", layer, maximum=self.config.num_layers - 1)
        return None if self._pool.v_scales is None else self._pool.v_scales[layer]

    @property
    def page_arrays(self) -> tuple[np.ndarray, ...]:
        """Every preallocated page array, all layers: ``(k, v)``, and for int8 ``(k, v, k_scales, v_scales)``
        (read-only use: memory accounting)."""
        return self._pool.arrays

    @property
    def num_free_pages(self) -> int:
        return self.allocator.num_free_pages

    @property
    def pool_nbytes(self) -> int:
        """Bytes of the preallocated K and V page arrays (int8: and their scales), all layers (virtual size:
        lazily backed by the OS)."""
        return self._pool.nbytes

    @property
    def sequences(self) -> tuple[int, ...]:
        return tuple(self._sequences)

    def length(self, seq: int) -> int:
        return self._sequence(seq).length

    def page_table(self, seq: int) -> np.ndarray:
        """``int32 [ceil(length / page_size)]`` physical page of each logical page (-1: released)."""
        return self._sequence(seq).pages()

    def first_position(self, seq: int) -> int:
        """The first position whose K/V is still held (> 0 once a sliding window released pages)."""
        return self._sequence(seq).first_live_page * self.config.page_size

    # -- sequences ----------------------------------------------------------------------------------------
    def create_sequence(self) -> int:
        """A new empty sequence; returns its id."""
        with self._lock:
            seq, self._next_id = self._next_id, self._next_id + 1
            self._sequences[seq] = Sequence()
            return seq

    def _sequence(self, seq) -> Sequence:
        if isinstance(seq, (bool, np.bool_)) or not isinstance(seq, (int, np.integer)):
            raise TypeError(f"seq: expected an integer sequence id, got {type(seq).__name__} {seq!r}")
        try:
            return self._sequences[int(seq)]
        except KeyError:
            raise ValueError(f"seq: expected a live sequence id {sorted(self._sequences)}, got {seq} "
                             f"(freed or never created)") from None

    def _idle_sequence(self, seq) -> Sequence:
        s = self._sequence(seq)
        if s.busy:
            raise RuntimeError(f"seq: expected a sequence with no open transaction, got {seq} (in a transaction)")
        return s

    # -- append -------------------------------------------------------------------------------------------
    def check_kv(self, k, v, num_tokens: int | None = None, *, layered: bool = True):
        """Validate K/V and cast them to the storage dtype (finite after the cast); for int8 storage check them
        finite and within `kvcache.quant.MAX_ABS` (`ScaleOverflowError`) and keep them float (writes quantize).

        ``layered``: ``k [num_layers, T, num_kv_heads, head_dim]`` (``[T, ...]`` accepted for one layer);
        otherwise one layer's ``k [T, num_kv_heads, head_dim]``. ``v`` likewise with ``head_dim_v``.
        """
        cfg = self.config
        k, v = as_float_array("k", k), as_float_array("v", v)
        if layered and k.ndim == 3 and cfg.num_layers == 1:
            k, v = k[None], v[None] if v.ndim == 3 else v
        lead, labels = ((cfg.num_layers,), "[num_layers, T, num_kv_heads, ") if layered else ((), "[T, num_kv_heads, ")
        if num_tokens is None:
            if k.ndim != len(lead) + 3:                    # no T to show: name it
                shape = ", ".join(map(str, lead + ("T", cfg.num_kv_heads, cfg.head_dim)))
                raise ValueError(f"k: expected shape {labels}head_dim] = ({shape}), got {k.shape}")
            num_tokens = k.shape[len(lead)]
        check_shape("k", k, lead + (num_tokens, cfg.num_kv_heads, cfg.head_dim), labels + "head_dim]")
        check_shape("v", v, lead + (num_tokens, cfg.num_kv_heads, cfg.head_dim_v), labels + "head_dim_v]")
        return self._pool.check("k", k), self._pool.check("v", v)

    def append(self, seq: int, k, v) -> None:
        """Append T tokens to ``seq`` in every layer: ``k [num_layers, T, num_kv_heads, head_dim]``,
        ``v [num_layers, T, num_kv_heads, head_dim_v]`` (the leading axis may be dropped for one layer)."""
        k, v = self.check_kv(k, v)
        with self.transaction({seq: k.shape[1]}) as tx:
            for layer in range(self.config.num_layers):
                tx.write(layer, seq, k[layer], v[layer], checked=True)

    def transaction(self, num_tokens) -> Transaction:
        """Begin a `Transaction` appending ``num_tokens[seq]`` tokens to each sequence (a dict, or a sequence
        id for one token). Pages are reserved now: `CacheFullError` (and every argument error) is raised
        here, with nothing changed."""
        if not isinstance(num_tokens, dict):
            self._sequence(num_tokens)                # names a bad id (an unhashable one too) before it is a key
            num_tokens = {num_tokens: 1}
        checked = {}
        for seq, count in num_tokens.items():
            self._sequence(seq)
            checked[int(seq)] = check_int(f"num_tokens[{seq}]", count)
        return Transaction(self, checked).begin()

    def begin_token(self, seq: int) -> "TokenWrite":
        """Reserve position `length` of ``seq`` for one token (the decode-step path); see `TokenWrite`."""
        return TokenWrite(self, seq)

    def _reserve(self, num_tokens: dict[int, int], journal: Journal) -> None:
        """Take every page the new tokens need, copy-on-write a shared partial last page; mark busy."""
        cfg, alloc = self.config, self.allocator
        plans = []
        for seq, count in num_tokens.items():
            s = self._idle_sequence(seq)
            new_logical = cfg.pages_for(s.length + count)
            shared_tail = (count > 0 and s.length % cfg.page_size != 0
                           and alloc.ref_count(int(s.table[s.num_logical_pages - 1])) > 1)
            plans.append((seq, s, new_logical, shared_tail))
        needed = sum(new - s.num_logical_pages + cow for _, s, new, cow in plans)
        ever = needed <= alloc.num_free_pages or self._could_ever_fit(plans)
        pages = alloc.allocate(needed, could_ever_fit=ever, what="append")
        journal.record(lambda: alloc.unallocate(pages))
        fresh = iter(pages)
        for seq, s, new_logical, shared_tail in plans:
            s.busy = True
            journal.record(lambda s=s: setattr(s, "busy", False))
            if shared_tail:
                self._copy_on_write(s, s.num_logical_pages - 1, next(fresh), journal)
            old_count = s.num_logical_pages
            s.reserve_table(new_logical)
            s.table[old_count:new_logical] = [next(fresh) for _ in range(new_logical - old_count)]
            s.num_logical_pages = new_logical
            journal.record(lambda s=s, n=old_count: setattr(s, "num_logical_pages", n))

    def _could_ever_fit(self, plans) -> bool:
        """Whether a request fits once every other sequence is freed: the distinct pages its sequences hold (pages
        shared by forked siblings count once), their new pages, and the copies a partial last page shared among
        them still needs (one shared only with other sequences needs none once those are gone)."""
        holders = Counter(page for _, s, _, _ in plans for page in s.live_pages().tolist())
        new = sum(new_logical - s.num_logical_pages for _, s, new_logical, _ in plans)
        copies = sum(1 for _, s, _, cow in plans if cow and holders[int(s.table[s.num_logical_pages - 1])] > 1)
        return len(holders) + new + copies <= self.config.num_pages

    def _copy_on_write(self, s: Sequence, logical: int, new_page: int, journal: Journal) -> None:
        """Give ``s`` a private copy (all layers) of its shared page at ``logical``."""
        old_page = int(s.table[logical])
        self._fault_hook("cow_copy")
        self._pool.copy_page(old_page, new_page, journal)
        s.table[logical] = new_page
        journal.record(lambda: s.table.__setitem__(logical, old_page))
        # Keep the reference to the old page until commit: a rollback points ``s`` back at it, so nobody else
        # may write into it (or free and reuse it) while the transaction is open.
        s.held.append(old_page)
        journal.record(s.held.pop)

    def _write(self, layer: int, seq: int, start: int, k: np.ndarray, v: np.ndarray, journal: Journal) -> None:
        """Write ``k [T, H, D]``, ``v [T, H, Dv]`` at positions ``start ..`` of ``seq`` in ``layer``, a page
        chunk at a time, saving the overwritten bytes."""
        size, table = self.config.page_size, self._sequences[seq].table
        done, total = 0, k.shape[0]
        while done < total:
            position = start + done
            offset = position % size
            count = min(size - offset, total - done)
            self._pool.write(layer, table[position // size], offset, k[done:done + count].swapaxes(0, 1),
                             v[done:done + count].swapaxes(0, 1), self._fault_hook, journal)   # [H, count, D]
            done += count

    def _publish(self, num_tokens: dict[int, int], start: dict[int, int]) -> None:
        self._fault_hook("publish")
        for seq, count in num_tokens.items():
            s = self._sequences[seq]
            s.length = start[seq] + count
            s.busy = False
            for page in s.held:
                self.allocator.decref(page)
            s.held.clear()

    # -- truncate, fork, free, release --------------------------------------------------------------------
    def truncate(self, seq: int, n: int) -> None:
        """Keep tokens ``[0, n)`` of ``seq``; pages no longer needed go back to the pool."""
        with self._lock:
            s = self._idle_sequence(seq)
            n = check_int("n", n, minimum=self.first_position(seq), maximum=s.length)
            keep = self.config.pages_for(n)
            self._atomically(lambda journal: self._drop_pages(s, keep, journal),
                             lambda: setattr(s, "length", n))

    def fork(self, seq: int) -> int:
        """A new sequence sharing every page of ``seq`` (reference counts; no K/V copied). Writing into a shared
        page later copies that page first, so neither sees the other's writes."""
        with self._lock:
            child = self._idle_sequence(seq).copy_for_fork()
            new_id = self._next_id

            def share(journal):
                for page in child.live_pages().tolist():
                    self._fault_hook("fork_incref")
                    self.allocator.incref(page)
                    journal.record(lambda page=page: self.allocator.decref(page))

            def register():
                self._sequences[new_id] = child
                self._next_id = new_id + 1
            self._atomically(share, register)
            return new_id

    def free(self, seq: int) -> None:
        """Return every page of ``seq`` to the pool and forget the sequence."""
        with self._lock:
            s = self._idle_sequence(seq)
            self._atomically(lambda journal: self._drop_pages(s, s.first_live_page, journal),
                             lambda: self._sequences.pop(int(seq)))

    def release_before(self, seq: int, position: int) -> int:
        """Give back the pages of ``seq`` that hold only positions ``< position`` (sliding window); their
        page-table entries become -1. Returns the number of pages released."""
        with self._lock:
            s = self._idle_sequence(seq)
            position = check_int("position", position, maximum=s.length)
            first = max(s.first_live_page, min(position // self.config.page_size, s.num_logical_pages))

            def release(journal):
                for logical in range(s.first_live_page, first):
                    self._release_entry(s, logical, journal)
            old_first = s.first_live_page
            self._atomically(release, lambda: setattr(s, "first_live_page", first))
            return first - old_first

    def _drop_pages(self, s: Sequence, keep: int, journal: Journal) -> None:
        """Decref logical pages ``keep ..`` of ``s`` (newest first) and shorten its page table."""
        for logical in range(s.num_logical_pages - 1, max(keep, s.first_live_page) - 1, -1):
            self._release_entry(s, logical, journal)
        old_count = s.num_logical_pages
        s.num_logical_pages = min(keep, old_count)
        journal.record(lambda: setattr(s, "num_logical_pages", old_count))

    def _release_entry(self, s: Sequence, logical: int, journal: Journal) -> None:
        page = int(s.table[logical])
        self._fault_hook("decref")
        freed = self.allocator.decref(page)
        journal.record(lambda: self.allocator.undo_decref(page, freed))
        s.table[logical] = -1
        journal.record(lambda: s.table.__setitem__(logical, page))

    def _atomically(self, change, publish) -> None:
        """Run ``change(journal)``, then the fault point "publish", then ``publish()``; undo all on failure."""
        journal = Journal()
        try:
            change(journal)
            self._fault_hook("publish")
        except BaseException:
            journal.rollback()
            raise
        publish()

    # -- reading ------------------------------------------------------------------------------------------
    def gather(self, seq: int, layer: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """Dense copies of what ``seq`` can read in ``layer``: ``K [length - first, num_kv_heads, head_dim]``,
        ``V [length - first, num_kv_heads, head_dim_v]`` for positions ``first = first_position(seq) ..
        length - 1``, in the storage dtype (int8: dequantized to float32)."""
        layer = check_int("layer", layer, maximum=self.config.num_layers - 1)
        with self._lock:
            s = self._sequence(seq)
            pages = s.table[s.first_live_page: self.config.pages_for(s.length)]
            count = s.length - s.first_live_page * self.config.page_size
        return self._pool.dense(layer, pages, count)

    # -- checking -----------------------------------------------------------------------------------------
    def check_invariants(self) -> None:
        """AssertionError unless the allocator's invariants hold for the page tables and every sequence's
        table matches its length."""
        with self._lock:
            cfg = self.config
            tables = [s.live_pages().tolist() + s.held for s in self._sequences.values()]
            self.allocator.check_invariants(tables)
            for seq, s in self._sequences.items():
                if not s.busy:
                    assert s.num_logical_pages == cfg.pages_for(s.length), (
                        f"seq {seq}: {s.num_logical_pages} pages for length {s.length}")
                assert (s.table[: s.first_live_page] == -1).all(), f"seq {seq}: released entries not -1"
                live = s.live_pages()
                assert ((live >= 0) & (live < cfg.num_pages)).all(), f"seq {seq}: page ids out of range {live}"

    def fingerprint(self) -> str:
        """sha256 over every pool byte (int8: the scales too) and all metadata (free list order, ref counts,
        tables, lengths)."""
        h = hashlib.sha256()
        with self._lock:
            self._pool.update_hash(h)
            h.update(repr((self.allocator.free_list(), self.allocator.ref_counts(), self._next_id)).encode())
            for seq, s in sorted(self._sequences.items()):
                h.update(repr((seq, s.length, s.first_live_page, s.busy, s.pages().tolist(), s.held)).encode())
        return h.hexdigest()
