"""`KVCache`: one preallocated pool of K/V pages shared by many sequences.

Storage per layer: ``k: [num_pages, num_kv_heads, page_size, head_dim]``,
``v: [num_pages, num_kv_heads, page_size, head_dim_v]``, one array each for all layers (allocated once, never
grown or copied). All layers share one page table per sequence: a token's slot is the same page and offset in
every layer.

Failure guarantee: every mutating operation validates its arguments first, then records the inverse of each
change in a journal; on any exception (bad input, `CacheFullError`, an injected fault) the journal is
replayed, so lengths, page tables, reference counts, the free list (its order too) and every byte of the pool
are exactly what they were.

Prefix caching (``prefix_caching=True``): appends may carry the token ids of their positions; every page that
becomes full with known ids is registered in a `kvcache.prefix.PrefixIndex` and becomes immutable (a later
write into it copies it first); `match_prefix` starts a sequence from the longest registered prefix, adopting
its pages. Registered pages nobody references stay cached (evictable, least recently released first) and are
reclaimed only when no clean free page is left. Snapshots: `save` / `load` (`kvcache.snapshot`).

Threads: one re-entrant lock guards all metadata (allocator, page tables, lengths). Different threads may
append to, truncate, fork or free *different* sequences concurrently; K/V bytes are written outside the lock,
into pages a transaction owns exclusively (copy-on-write made sure of it). A sequence with an open
transaction refuses every other mutation (`RuntimeError`). Not safe: reading a sequence (gather, attention)
while another thread truncates or frees that same sequence.
"""
import hashlib
import os
import threading
from collections import Counter
from typing import NamedTuple

import numpy as np

from .allocator import PageAllocator
from .checks import as_float_array, check_int, check_shape
from .config import CacheConfig
from .errors import CacheFullError
from .faults import no_fault
from .journal import Journal
from .prefix import Entry, PrefixIndex, check_namespace, check_token_ids
from . import snapshot
from .seam import AppendSeam
from .sequence import Sequence
from .storage import PagePool
from .token import TokenWrite
from .transaction import Transaction


class PrefixMatch(NamedTuple):
    """What `KVCache.match_prefix` returns: the new sequence and how many of its tokens came from the cache."""
    seq: int
    num_tokens: int


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
    prefix_caching : bool         register full pages by their token ids and reuse them (`match_prefix`)
    namespace : str               the default namespace of new sequences (model fingerprint, adapter, tenant):
                                  pages are shared only within one namespace
    prefix_salt : bytes or None   the key chain's salt (None: 16 random bytes); give one only to reproduce
                                  keys (tests), never one a tenant could know
    """

    def __init__(self, *, num_kv_heads, head_dim, head_dim_v=None, num_layers=1, dtype="float32", page_size=16,
                 num_pages=None, max_tokens=None, prefix_caching=False, namespace="", prefix_salt=None):
        if not isinstance(prefix_caching, (bool, np.bool_)):
            raise TypeError(f"prefix_caching: expected a bool, got {type(prefix_caching).__name__} {prefix_caching!r}")
        namespace = check_namespace("namespace", namespace)
        if prefix_salt is not None and (not isinstance(prefix_salt, bytes) or len(prefix_salt) < 8):
            raise TypeError(f"prefix_salt: expected None or bytes of length >= 8, got {prefix_salt!r}")
        self.config = cfg = CacheConfig.build(num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=head_dim,
                                              head_dim_v=head_dim_v, page_size=page_size, num_pages=num_pages,
                                              max_tokens=max_tokens, dtype=dtype)
        self._pool = PagePool(cfg)                 # the page arrays (values, int8 scales) and their byte operations
        self._k, self._v = self._pool.k, self._pool.v
        self.allocator = PageAllocator(cfg.num_pages)
        self._sequences: dict[int, Sequence] = {}
        self._next_id = 0
        self._lock = threading.RLock()
        self.namespace = namespace
        self._salt = os.urandom(16) if prefix_salt is None else prefix_salt
        self.index = PrefixIndex(self._salt, repr(cfg)) if prefix_caching else None
        self.fault_hook = no_fault
        self._seam = AppendSeam(lock=self._lock, idle_sequence=self._idle_sequence, sequence=self._sequence,
                                needs_copy=self._needs_copy, reserve=self._reserve, write=self._write,
                                write_slot=self._write_slot, publish=self._publish, fault=self._fault)

    @property
    def prefix_caching(self) -> bool:
        return self.index is not None

    # -- fault hook (tests) ------------------------------------------------------------------------------
    @property
    def fault_hook(self):
        return self._fault_hook

    @fault_hook.setter
    def fault_hook(self, hook) -> None:
        self._fault_hook = hook
        self.allocator.fault_hook = hook

    def _fault(self, point: str) -> None:
        self._fault_hook(point)

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
        """Pages an append can take: clean free pages plus cached (evictable) prefix pages."""
        return self.allocator.num_free_pages + self.allocator.num_parked

    @property
    def num_cached_pages(self) -> int:
        """Registered pages no sequence references (evictable, kept for `match_prefix`)."""
        return self.allocator.num_parked

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
    def create_sequence(self, *, namespace=None) -> int:
        """A new empty sequence (in ``namespace``, default the cache's); returns its id."""
        namespace = self.namespace if namespace is None else check_namespace("namespace", namespace)
        with self._lock:
            seq, self._next_id = self._next_id, self._next_id + 1
            self._sequences[seq] = s = Sequence()
            s.namespace = namespace
            return seq

    def token_ids(self, seq: int) -> np.ndarray:
        """``int32 [num_known]``: the token ids known for positions ``0 ..`` of ``seq`` (a copy)."""
        with self._lock:
            return self._sequence(seq).known_tokens().copy()

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

    def check_storable(self, name: str, x: np.ndarray) -> np.ndarray:
        """A float array of any shape validated for this pool's storage: cast to the storage dtype (finite after
        the cast), or for int8 checked finite and within `kvcache.quant.MAX_ABS` and returned as given."""
        return self._pool.check(name, x)

    def append(self, seq: int, k, v, *, token_ids=None) -> None:
        """Append T tokens to ``seq`` in every layer: ``k [num_layers, T, num_kv_heads, head_dim]``,
        ``v [num_layers, T, num_kv_heads, head_dim_v]`` (the leading axis may be dropped for one layer);
        ``token_ids [T]`` (optional) the tokens' ids, for prefix caching."""
        k, v = self.check_kv(k, v)
        ids = None if token_ids is None else {seq: token_ids}
        with self.transaction({seq: k.shape[1]}, token_ids=ids) as tx:
            for layer in range(self.config.num_layers):
                tx.write(layer, seq, k[layer], v[layer], checked=True)

    def transaction(self, num_tokens, *, token_ids=None) -> Transaction:
        """Begin a `Transaction` appending ``num_tokens[seq]`` tokens to each sequence (a dict, or a sequence
        id for one token). ``token_ids`` (optional): ``{seq: int ids [num_tokens[seq]]}`` for some or all of
        them (for one sequence id: its ids). Pages are reserved now: `CacheFullError` (and every argument
        error, checked first) is raised here, with nothing changed."""
        if not isinstance(num_tokens, dict):
            self._sequence(num_tokens)                # names a bad id (an unhashable one too) before it is a key
            if token_ids is not None and not isinstance(token_ids, dict):
                token_ids = {num_tokens: np.atleast_1d(token_ids) if np.ndim(token_ids) == 0 else token_ids}
            num_tokens = {num_tokens: 1}
        checked = {}
        for seq, count in num_tokens.items():
            self._sequence(seq)
            checked[int(seq)] = check_int(f"num_tokens[{seq}]", count)
        return Transaction(self, self._seam, checked, self._check_token_ids(token_ids, checked)).begin()

    def _check_token_ids(self, token_ids, num_tokens: dict[int, int]) -> dict:
        if token_ids is None:
            return {}
        if not isinstance(token_ids, dict):
            raise TypeError(f"token_ids: expected a dict {{seq: token ids}}, got {type(token_ids).__name__}")
        checked = {}
        for seq, ids in token_ids.items():
            if seq not in num_tokens:
                raise ValueError(f"token_ids: expected keys among the transaction's sequences {sorted(num_tokens)}, "
                                 f"got {seq!r}")
            checked[int(seq)] = check_token_ids(f"token_ids[{seq}]", ids, num_tokens[seq])
        return checked

    def begin_token(self, seq: int, *, token_id=None) -> "TokenWrite":
        """Reserve position `length` of ``seq`` for one token (the decode-step path); see `TokenWrite`.
        ``token_id`` (optional): the token's id, for prefix caching."""
        ids = None if token_id is None else check_token_ids("token_id", np.atleast_1d(token_id), 1)
        return TokenWrite(self, self._seam, seq, ids)

    def _needs_copy(self, page: int) -> bool:
        """A write into ``page`` must copy it first: shared with another sequence, or registered (immutable)."""
        return self.allocator.ref_count(page) > 1 or (self.index is not None and self.index.holds(page))

    def _reserve(self, num_tokens: dict[int, int], journal: Journal) -> None:
        """Take every page the new tokens need, copy-on-write a shared partial last page; mark busy."""
        cfg, alloc = self.config, self.allocator
        plans = []
        for seq, count in num_tokens.items():
            s = self._idle_sequence(seq)
            new_logical = cfg.pages_for(s.length + count)
            shared_tail = (count > 0 and s.length % cfg.page_size != 0
                           and self._needs_copy(int(s.table[s.num_logical_pages - 1])))
            plans.append((seq, s, new_logical, shared_tail))
        needed = sum(new - s.num_logical_pages + cow for _, s, new, cow in plans)
        ever = needed <= self.num_free_pages or self._could_ever_fit(plans)
        fresh = iter(self._take_pages(needed, ever, "append", journal))
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

    def _take_pages(self, count: int, could_ever_fit: bool, what: str, journal: Journal) -> list[int]:
        """``count`` pages: clean free pages first, then cached prefix pages evicted oldest first."""
        alloc = self.allocator
        available = alloc.num_free_pages + alloc.num_parked
        if count > available:
            raise CacheFullError(count, available, self.config.num_pages, could_ever_fit, what)
        for _ in range(count - alloc.num_free_pages):
            self._evict_one(journal)
        pages = alloc.allocate(count, could_ever_fit=could_ever_fit, what=what)
        journal.record(lambda: alloc.unallocate(pages))
        return pages

    def _evict_one(self, journal: Journal) -> None:
        """Unregister the least recently released cached page and put it on the free list."""
        self._fault_hook("evict")
        entry, stamp = self.index.evict_oldest()
        self.allocator.reclaim(entry.page)
        journal.record(lambda: (self.allocator.park(entry.page), self.index.restore_evicted(entry, stamp)))

    def _decref(self, page: int, journal: Journal | None) -> None:
        """Drop one reference to ``page``; a registered page nobody holds any more is parked (cached)."""
        alloc = self.allocator
        freed = alloc.decref(page)
        if journal is not None:
            journal.record(lambda: alloc.undo_decref(page, freed))
        if freed and self.index is not None and self.index.holds(page):
            alloc.park(page)
            self.index.park(page)
            if journal is not None:
                journal.record(lambda: (self.index.unpark(page), alloc.reclaim(page)))

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

    def _write_slot(self, layer: int, page: int, offset: int, k: np.ndarray, v: np.ndarray, saved: list) -> None:
        """Write one token's ``k [num_kv_heads, head_dim]``, ``v [num_kv_heads, head_dim_v]`` at ``(page, offset)``
        of ``layer``, appending ``(view, old bytes)`` to ``saved``."""
        self._pool.write(layer, page, offset, k[:, None], v[:, None], self._fault_hook,
                         saved=saved)                                       # [num_kv_heads, 1, head_dim]

    def _publish(self, num_tokens: dict[int, int], start: dict[int, int], token_ids: dict | None = None) -> None:
        """Commit: store token ids, register pages that became full with known ids, the fault point "publish",
        then the lengths (nothing after the fault point can fail)."""
        journal, known = Journal(), {}
        try:
            for seq, count in num_tokens.items():
                s, ids = self._sequences[seq], (token_ids or {}).get(seq)
                known[seq] = start[seq] + count if ids is not None and s.num_known == start[seq] else s.num_known
                if ids is not None:
                    s.store_tokens(start[seq], ids)                  # beyond num_known: not visible yet
                if self.index is not None:
                    self._register_full_pages(s, known[seq], journal)
            self._fault_hook("publish")
        except BaseException:
            journal.rollback()
            raise
        for seq, count in num_tokens.items():
            s = self._sequences[seq]
            s.length, s.num_known = start[seq] + count, known[seq]
            s.busy = False
            for page in s.held:
                self._decref(page, None)
            s.held.clear()

    def _register_full_pages(self, s: Sequence, known: int, journal: Journal) -> None:
        """Extend ``s.chain`` over every page full of known token ids; register each page whose content no
        entry holds yet (an entry holding it already becomes the chain's link: a duplicate page stays private)."""
        index, size = self.index, self.config.page_size
        while len(s.chain) < known // size:
            logical = len(s.chain)
            parent = s.chain[logical - 1] if logical else index.root(s.namespace)
            tokens = s.tokens[logical * size:(logical + 1) * size].tobytes()
            entry = None
            if index.alive(parent):
                entry = index.lookup(parent, tokens)
                page = int(s.table[logical])
                if entry is None and page >= 0 and not index.holds(page):
                    self._fault_hook("register")
                    entry = index.register(parent, tokens, page)
                    if entry is not None:
                        journal.record(lambda entry=entry: index.unregister(entry))
            s.chain.append(entry)
            journal.record(s.chain.pop)

    # -- prefix reuse -------------------------------------------------------------------------------------
    def match_prefix(self, token_ids, *, namespace=None) -> PrefixMatch:
        """A new sequence holding the longest cached prefix of ``token_ids [N]`` in whole pages, at most N - 1
        tokens (one is always left to compute); its pages are adopted (reference counts), none copied.
        Returns ``PrefixMatch(seq, num_tokens)``; append the remaining ``N - num_tokens`` tokens to ``seq``."""
        if self.index is None:
            raise ValueError("match_prefix: expected a cache built with prefix_caching=True, got prefix_caching=False")
        ids = check_token_ids("token_ids", token_ids)
        namespace = self.namespace if namespace is None else check_namespace("namespace", namespace)
        size = self.config.page_size
        with self._lock:
            entries = self.index.walk(namespace, ids.tobytes(), (len(ids) - 1) // size, size * ids.itemsize)
            hit = len(entries) * size
            s = Sequence(np.array([e.page for e in entries], dtype=np.int32), hit)
            s.store_tokens(0, ids[:hit])
            s.num_known, s.chain, s.namespace = hit, entries, namespace
            new_id = self._next_id

            def register():
                self._sequences[new_id] = s
                self._next_id = new_id + 1
            self._atomically(lambda journal: self._adopt([e.page for e in entries], journal), register)
            return PrefixMatch(new_id, hit)

    def _adopt(self, pages: list[int], journal: Journal) -> None:
        """Take one reference to each of ``pages`` (registered); a cached one leaves the evictable set."""
        self._fault_hook("match")
        if not pages:
            return
        self._fault_hook("adopt")
        alloc, index = self.allocator, self.index
        adopted = alloc.reference_all(pages)
        stamps = [(page, index.unpark(page)) for page in adopted]

        def undo():
            alloc.unreference_all(pages, adopted)
            for page, stamp in stamps:
                index.park(page, stamp)
        journal.record(undo)

    # -- truncate, fork, free, release --------------------------------------------------------------------
    def truncate(self, seq: int, n: int) -> None:
        """Keep tokens ``[0, n)`` of ``seq``; pages no longer needed go back to the pool."""
        with self._lock:
            s = self._idle_sequence(seq)
            n = check_int("n", n, minimum=self.first_position(seq), maximum=s.length)
            keep = self.config.pages_for(n)

            def publish():
                s.length, s.num_known = n, min(s.num_known, n)
                del s.chain[n // self.config.page_size:]            # the records of pages [n // page_size, ..)
            self._atomically(lambda journal: self._drop_pages(s, keep, journal), publish)

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
        self._decref(page, journal)
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

    # -- snapshots ----------------------------------------------------------------------------------------
    def save(self, path) -> int:
        """Write the whole cache to ``path`` (safetensors, atomically; `kvcache.snapshot`): only the pages in
        use. Refused (RuntimeError) while a transaction is open. Returns the file size in bytes."""
        with self._lock:
            busy = [seq for seq, s in self._sequences.items() if s.busy]
            if busy:
                raise RuntimeError(f"save: expected no open transaction, got sequences {busy} in transactions")
            state = self._state()
            return snapshot.write(path, state, self._fault_hook)

    @classmethod
    def load(cls, path, *, sequences=None, config: CacheConfig | None = None) -> "KVCache":
        """A cache rebuilt from a snapshot ``path``, validated in full before anything is built (a
        `kvcache.errors.SnapshotError` subclass names what is wrong and where). ``config``: the expected
        `CacheConfig` (`SnapshotConfigError` otherwise). ``sequences``: keep only these ids (the others are
        freed as by `free`, in id order). With every sequence the cache has the saved cache's
        ``fingerprint(include_free_pages=False)``."""
        if config is not None and not isinstance(config, CacheConfig):
            raise TypeError(f"config: expected a kvcache.CacheConfig or None, got {type(config).__name__}")
        state = snapshot.read(path, config)
        saved_ids = {s.seq for s in state.sequences}
        keep = saved_ids if sequences is None else {int(check_int("sequences[]", seq)) for seq in sequences}
        if not keep <= saved_ids:
            raise ValueError(f"sequences: expected ids among the snapshot's {sorted(saved_ids)}, "
                             f"got {sorted(keep - saved_ids)} not in it")
        cfg = state.config
        cache = cls(num_layers=cfg.num_layers, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                    head_dim_v=cfg.head_dim_v, page_size=cfg.page_size, num_pages=cfg.num_pages, dtype=cfg.dtype,
                    prefix_caching=state.prefix_caching, namespace=state.namespace)
        cache._restore(state)
        for seq in sorted(saved_ids - keep):
            cache.free(seq)
        return cache

    def _state(self) -> "snapshot.CacheState":
        index, alloc = self.index, self.allocator
        entries = index.entries() if index is not None else []
        number = {id(e): i for i, e in enumerate(entries)}

        def link(entry) -> int:
            return number[id(entry)] if index.alive(entry) and entry.page >= 0 else (-1 if entry.page < 0 else -2)
        entry_states = [snapshot.EntryState(e.page, e.key, link(e.parent), e.parent.key, e.tokens, e.namespace)
                        for e in entries]
        seqs = [snapshot.SequenceState(seq, s.length, s.first_live_page, s.pages().copy(), s.known_tokens().copy(),
                                       [number[id(e)] if index.alive(e) else -1 for e in s.chain], s.namespace)
                for seq, s in sorted(self._sequences.items())]
        used = np.asarray(sorted(set(range(self.config.num_pages)) - set(alloc.free_list())), dtype=np.int32)
        return snapshot.CacheState(
            config=self.config, prefix_caching=index is not None, namespace=self.namespace, salt=self._salt,
            next_id=self._next_id, free_list=list(alloc.free_list()), ref_counts=list(alloc.ref_counts()),
            eviction_order=index.eviction_order() if index is not None else [], used_pages=used,
            pools={name: self._pages_of(array, used) for name, array in self._named_arrays().items()}, sequences=seqs,
            entries=entry_states)

    @staticmethod
    def _pages_of(array: np.ndarray, pages: np.ndarray) -> np.ndarray:
        """``array[:, pages]``; a view when ``pages`` is ``0 .. n - 1`` (no copy of a full pool)."""
        if len(pages) and pages[0] == 0 and pages[-1] == len(pages) - 1:
            return array[:, : len(pages)]
        return array[:, pages]

    def _named_arrays(self) -> dict[str, np.ndarray]:
        """The page arrays by snapshot tensor name: k, v (int8: k_scales, v_scales too)."""
        names = ("k", "v", "k_scales", "v_scales")
        return dict(zip(names, self._pool.arrays))

    def _restore(self, state: "snapshot.CacheState") -> None:
        """Set this fresh cache to a validated ``state``."""
        used = state.used_pages
        contiguous = len(used) and used[0] == 0 and used[-1] == len(used) - 1
        for name, array in self._named_arrays().items():
            if contiguous:
                array[:, : len(used)] = state.pools[name]
            else:
                array[:, used] = state.pools[name]
        self._salt, self._next_id = state.salt, state.next_id
        self.allocator.restore(state.free_list, state.ref_counts, set(state.eviction_order))
        entries = []
        if state.prefix_caching:
            self.index = index = PrefixIndex(self._salt, repr(self.config))
            entries = [Entry(e.key, None, e.tokens, e.page, e.namespace) for e in state.entries]
            for entry, e in zip(entries, state.entries):
                entry.parent = (index.root(e.namespace) if e.parent == -1 else entries[e.parent] if e.parent >= 0
                                else Entry(e.parent_key, None, b"", -2, e.namespace))    # evicted: no walk reaches it
            index.restore(entries, state.eviction_order)
        for s in state.sequences:
            seq = Sequence(s.table.copy(), s.length, s.first_live_page)
            seq.store_tokens(0, s.tokens)
            seq.num_known, seq.namespace = len(s.tokens), s.namespace
            seq.chain = [entries[i] if i >= 0 else None for i in s.chain]
            self._sequences[s.seq] = seq

    # -- checking -----------------------------------------------------------------------------------------
    def check_invariants(self) -> None:
        """AssertionError unless the allocator's invariants hold for the page tables and every sequence's
        table matches its length."""
        with self._lock:
            cfg = self.config
            tables = [s.live_pages().tolist() + s.held for s in self._sequences.values()]
            self.allocator.check_invariants(tables)
            parked = set(self.allocator.parked())
            if self.index is not None:
                self.index.check_invariants({p for table in tables for p in table if p >= 0}, parked)
            else:
                assert not parked, f"pages parked without prefix caching: {sorted(parked)}"
            for seq, s in self._sequences.items():
                self._check_tokens(seq, s)
                if not s.busy:
                    assert s.num_logical_pages == cfg.pages_for(s.length), (
                        f"seq {seq}: {s.num_logical_pages} pages for length {s.length}")
                assert (s.table[: s.first_live_page] == -1).all(), f"seq {seq}: released entries not -1"
                live = s.live_pages()
                assert ((live >= 0) & (live < cfg.num_pages)).all(), f"seq {seq}: page ids out of range {live}"

    def _check_tokens(self, seq: int, s: Sequence) -> None:
        size = self.config.page_size
        assert 0 <= s.num_known <= s.length or s.busy, f"seq {seq}: {s.num_known} known token ids, length {s.length}"
        if self.index is None:
            assert not s.chain, f"seq {seq}: a prefix chain without prefix caching"
            return
        assert len(s.chain) == s.num_known // size, f"seq {seq}: chain of {len(s.chain)} for {s.num_known} known ids"
        for logical, entry in enumerate(s.chain):
            if self.index.alive(entry):
                assert entry.tokens == s.tokens[logical * size:(logical + 1) * size].tobytes(), (
                    f"seq {seq}: page {logical}'s chain entry holds other tokens (stale)")
                parent = s.chain[logical - 1] if logical else self.index.root(s.namespace)
                assert entry.parent is parent, f"seq {seq}: page {logical}'s chain entry has another parent"

    def _filled_slots(self) -> dict[int, int]:
        """page -> slots ``[0, n)`` some holder has written (cached registered pages: all)."""
        size, filled = self.config.page_size, {}
        for page in self.allocator.parked():
            filled[page] = size
        for s in self._sequences.values():
            for logical in range(s.first_live_page, s.num_logical_pages):
                page = int(s.table[logical])
                filled[page] = max(filled.get(page, 0), min(size, s.length - logical * size))
        return filled

    def fingerprint(self, *, include_free_pages: bool = True) -> str:
        """sha256 over the pool bytes (int8: the scales too) and all metadata (free list order, ref counts, tables, lengths, token ids,
        prefix chains, the prefix index and its eviction order). ``include_free_pages=False``: only the bytes
        of the slots in use (positions below a holder's length; cached pages whole), what a snapshot keeps and
        the next operations can read (a new page's unwritten slots hold whatever was there before)."""
        h = hashlib.sha256()
        with self._lock:
            if include_free_pages:
                self._pool.update_hash(h)
            else:
                for page, filled in sorted(self._filled_slots().items()):
                    h.update(repr((page, filled)).encode())
                    for array in self._pool.arrays:
                        h.update(array[:, page, :, :filled].tobytes())
            h.update(repr((self.allocator.free_list(), self.allocator.ref_counts(), self._next_id,
                           sorted(self.allocator.parked()), self.namespace)).encode())
            if self.index is not None:
                h.update(repr(self.index.state()).encode())
            for seq, s in sorted(self._sequences.items()):
                chain = [e.key if self.index.alive(e) else None for e in s.chain] if self.index else []
                h.update(repr((seq, s.length, s.first_live_page, s.busy, s.pages().tolist(), s.held, s.namespace,
                               s.known_tokens().tobytes(), chain)).encode())
        return h.hexdigest()
