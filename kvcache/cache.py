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

Modules: the state and shared page bookkeeping (`kvcache.core`), appends (the cache side: `kvcache.appender`;
the transaction protocol and its three shapes: `kvcache.transaction`), truncate / fork / free / release / prefix reuse
(`kvcache.lifecycle`), invariants and fingerprints (`kvcache.integrity`), snapshot state (`kvcache.snapshot_state`),
the page-level view ``cache.pool`` (`kvcache.pool_view`), the argument checks (`kvcache.checks`).
"""
import os
from typing import NamedTuple

import numpy as np

from . import integrity, lifecycle, snapshot, snapshot_state
from .appender import Appender
from .checks import (check_cache_options, check_counts, check_ids_among, check_instance, check_int, check_namespace,
                     check_one_token_id, check_seq_list, check_token_id_each, check_token_ids, check_token_ids_of)
from .config import CacheConfig
from .core import CacheCore
from .group import OpGroup
from .pool_view import PoolView
from .prefix import PrefixIndex
from .sequence import Sequence
from .transaction import AppendTransaction, TokenBatch, TokenWrite, Transaction


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
    dtype : "float16" | "float32" | "float64" | "int8" | "bfloat16"   storage dtype (int8: quantized on write
                                  with a float16 scale per 32 values, `kvcache.quant`; reads dequantize;
                                  bfloat16: rounded to nearest even, pages of uint16 bits, `kvcache.bf16`;
                                  reads widen to float32)
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
        namespace = check_cache_options(prefix_caching, namespace, prefix_salt)
        self.config = cfg = CacheConfig.build(num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=head_dim,
                                              head_dim_v=head_dim_v, page_size=page_size, num_pages=num_pages,
                                              max_tokens=max_tokens, dtype=dtype)
        salt = os.urandom(16) if prefix_salt is None else prefix_salt
        self._core = core = CacheCore(cfg, PrefixIndex(salt, repr(cfg)) if prefix_caching else None, namespace, salt)
        self._lock = core.lock
        self.pool = PoolView(core)       # the page arrays, page tables, input checks: kernels, decode, accounting
        self._appender = Appender(core)

    @property
    def namespace(self) -> str:
        return self._core.namespace

    @property
    def prefix_caching(self) -> bool:
        return self._core.index is not None

    @property
    def num_free_pages(self) -> int:
        """Pages an append can take: clean free pages plus cached (evictable) prefix pages."""
        return self._core.num_free_pages

    @property
    def num_cached_pages(self) -> int:
        """Registered pages no sequence references (evictable, kept for `match_prefix`)."""
        return self._core.allocator.num_parked

    @property
    def sequences(self) -> tuple[int, ...]:
        return tuple(self._core.sequences)

    def length(self, seq: int) -> int:
        return self._sequence(seq).length

    # -- sequences ----------------------------------------------------------------------------------------
    def create_sequence(self, *, namespace=None) -> int:
        """A new empty sequence (in ``namespace``, default the cache's); returns its id."""
        core = self._core
        namespace = core.namespace if namespace is None else check_namespace("namespace", namespace)
        with self._lock:
            seq, core.next_id = core.next_id, core.next_id + 1
            core.sequences[seq] = s = Sequence()
            s.namespace = namespace
            core.keep_for_group(None, lambda: core.forget_created(seq))
            return seq

    def group(self, *, span_calls: bool = False) -> OpGroup:
        """Sequence operations undone together (`kvcache.group.OpGroup`): ``with cache.group(): ...`` rolls
        back every create_sequence / fork / free / truncate / release_before / match_prefix of the block if it
        raises, sequence-id counter included. ``span_calls=True``: the group stays open across blocks until
        ``close()`` or ``rollback()``."""
        return OpGroup(self._core, span_calls)

    def token_ids(self, seq: int) -> np.ndarray:
        """``int32 [num_known]``: the token ids known for positions ``0 ..`` of ``seq`` (a copy)."""
        with self._lock:
            return self._sequence(seq).known_tokens().copy()

    def _sequence(self, seq):
        return self._core.sequence(seq)

    # -- append -------------------------------------------------------------------------------------------
    def append(self, seq: int, k, v, *, token_ids=None) -> None:
        """Append T tokens to ``seq`` in every layer: ``k [num_layers, T, num_kv_heads, head_dim]``,
        ``v [num_layers, T, num_kv_heads, head_dim_v]`` (the leading axis may be dropped for one layer);
        ``token_ids [T]`` (optional) the tokens' ids, for prefix caching."""
        k, v = self.pool.check_kv(k, v)
        ids = None if token_ids is None else {seq: token_ids}
        with self.transaction({seq: k.shape[1]}, token_ids=ids) as tx:
            for layer in range(self.config.num_layers):
                tx.write(layer, seq, k[layer], v[layer], checked=True)

    def transaction(self, tokens, *, token_ids=None) -> AppendTransaction:
        """Begin an append transaction (`kvcache.transaction`: one protocol, the shape ``tokens`` asks for):

            {seq: count, ...}   ``count`` tokens of each sequence (`Transaction`); ``token_ids``: ``{seq: int
                                ids [count]}`` for some or all of them
            [seq, ...]          one token of each of these distinct sequences (`TokenBatch`; the batched decode
                                step); ``token_ids``: ``{seq: id}`` for some or all of them
            seq                 one token of one sequence (`TokenWrite`; the decode step); ``token_ids``: its id
                                (an int or ``[1]``)

        ``token_ids`` are for prefix caching. Pages are reserved now: `CacheFullError` (and every argument error,
        checked first) is raised here, with nothing changed."""
        if isinstance(tokens, dict):
            counts = check_counts(tokens, self._sequence)
            return Transaction(self._appender, counts, check_token_ids_of(token_ids, counts))
        if isinstance(tokens, (list, tuple)):
            return self._one_token_each(tokens, token_ids)
        if type(tokens) is not int:
            self._sequence(tokens)                    # names a bad id (an unhashable one too)
            tokens = int(tokens)
        return TokenWrite(self._appender, [tokens], None if token_ids is None else [check_one_token_id(token_ids)])

    def _one_token_each(self, seqs, token_ids) -> TokenBatch:
        if type(seqs) is list and len(seqs) == 1 and token_ids is None:     # the decode step: no more to check
            return TokenWrite(self._appender, seqs)
        seqs = check_seq_list("tokens", seqs, self._sequence)
        ids = check_token_id_each(token_ids, seqs)
        return (TokenWrite if len(seqs) == 1 else TokenBatch)(self._appender, seqs, ids)

    # -- prefix reuse -------------------------------------------------------------------------------------
    def match_prefix(self, token_ids, *, namespace=None) -> PrefixMatch:
        """A new sequence holding the longest cached prefix of ``token_ids [N]`` in whole pages, at most N - 1
        tokens (one is always left to compute); its pages are adopted (reference counts), none copied.
        Returns ``PrefixMatch(seq, num_tokens)``; append the remaining ``N - num_tokens`` tokens to ``seq``."""
        if self._core.index is None:
            raise ValueError("match_prefix: expected a cache built with prefix_caching=True, got prefix_caching=False")
        ids = check_token_ids("token_ids", token_ids)
        namespace = self.namespace if namespace is None else check_namespace("namespace", namespace)
        with self._lock:
            return PrefixMatch(*lifecycle.match_prefix(self._core, ids, namespace))

    # -- truncate, fork, free, release --------------------------------------------------------------------
    def truncate(self, seq: int, n: int) -> None:
        """Keep tokens ``[0, n)`` of ``seq``; pages no longer needed go back to the pool."""
        with self._lock:
            lifecycle.truncate(self._core, seq, n)

    def fork(self, seq: int) -> int:
        """A new sequence sharing every page of ``seq`` (reference counts; no K/V copied). Writing into a shared
        page later copies that page first, so neither sees the other's writes."""
        with self._lock:
            return lifecycle.fork(self._core, seq)

    def free(self, seq: int) -> None:
        """Return every page of ``seq`` to the pool and forget the sequence."""
        with self._lock:
            lifecycle.free(self._core, seq)

    def release_before(self, seq: int, position: int) -> int:
        """Give back the pages of ``seq`` that hold only positions ``< position`` (sliding window); their
        page-table entries become -1. Returns the number of pages released."""
        with self._lock:
            return lifecycle.release_before(self._core, seq, position)

    # -- reading ------------------------------------------------------------------------------------------
    def gather(self, seq: int, layer: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """Dense copies of what ``seq`` can read in ``layer``: ``K [length - first, num_kv_heads, head_dim]``,
        ``V [length - first, num_kv_heads, head_dim_v]`` for positions ``first = first_position(seq) ..
        length - 1``, in the storage dtype (int8: dequantized to float32; bfloat16: widened to float32, exact)."""
        layer = check_int("layer", layer, maximum=self.config.num_layers - 1)
        with self._lock:
            s = self._sequence(seq)
            pages = s.table[s.first_live_page: self.config.pages_for(s.length)]
            count = s.length - s.first_live_page * self.config.page_size
        return self._core.pool.dense(layer, pages, count)

    # -- snapshots ----------------------------------------------------------------------------------------
    def save(self, path) -> int:
        """Write the whole cache to ``path`` (safetensors, atomically; `kvcache.snapshot`): only the pages in
        use. Refused (RuntimeError) while a transaction is open. Returns the file size in bytes."""
        with self._lock:
            busy = [seq for seq, s in self._core.sequences.items() if s.busy]
            if busy:
                raise RuntimeError(f"save: expected no open transaction, got sequences {busy} in transactions")
            state = snapshot_state.capture(self._core)
            return snapshot.write(path, state, self._core.fault_hook)

    @classmethod
    def load(cls, path, *, sequences=None, config: CacheConfig | None = None) -> "KVCache":
        """A cache rebuilt from a snapshot ``path``, validated in full before anything is built (a
        `kvcache.errors.SnapshotError` subclass names what is wrong and where). ``config``: the expected
        `CacheConfig` (`SnapshotConfigError` otherwise). ``sequences``: keep only these ids (the others are
        freed as by `free`, in id order). With every sequence the cache has the saved cache's
        ``fingerprint(include_free_pages=False)``."""
        check_instance("config", config, CacheConfig, "a kvcache.CacheConfig or None", none_ok=True)
        state = snapshot.read(path, config)
        saved_ids = {s.seq for s in state.sequences}
        keep = saved_ids if sequences is None else check_ids_among("sequences", sequences, saved_ids)
        cfg = state.config
        cache = cls(num_layers=cfg.num_layers, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                    head_dim_v=cfg.head_dim_v, page_size=cfg.page_size, num_pages=cfg.num_pages, dtype=cfg.storage,
                    prefix_caching=state.prefix_caching, namespace=state.namespace)
        snapshot_state.restore(cache._core, state)
        for seq in sorted(saved_ids - keep):
            cache.free(seq)
        return cache

    # -- checking -----------------------------------------------------------------------------------------
    def check_invariants(self) -> None:
        """AssertionError unless the allocator's invariants hold for the page tables and every sequence's
        table matches its length."""
        with self._lock:
            integrity.check_invariants(self._core)

    def fingerprint(self, *, include_free_pages: bool = True) -> str:
        """sha256 over the pool bytes (int8: the scales too) and all metadata (free list order, ref counts, tables, lengths, token ids,
        prefix chains, the prefix index and its eviction order). ``include_free_pages=False``: only the bytes
        of the slots in use (positions below a holder's length; cached pages whole), what a snapshot keeps and
        the next operations can read (a new page's unwritten slots hold whatever was there before)."""
        with self._lock:
            return integrity.fingerprint(self._core, include_free_pages)


def core_of(cache: KVCache) -> CacheCore:
    """The state behind ``cache`` (`kvcache.core.CacheCore`: sequences, allocator, lock, pool), for the package's
    own modules that read it whole (`kvcache.accounting`) and for `kvcache.testing`; not the user API."""
    return cache._core
