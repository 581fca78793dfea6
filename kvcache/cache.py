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
(`kvcache.lifecycle`), invariants and fingerprints (`kvcache.integrity`), snapshot state (`kvcache.snapshot_state`).
"""
import os
from typing import NamedTuple

import numpy as np

from . import integrity, lifecycle, snapshot, snapshot_state
from .allocator import AllocatorView
from .appender import Appender
from .checks import check_int
from .config import CacheConfig
from .core import CacheCore
from .group import OpGroup
from .prefix import PrefixIndex, check_namespace, check_token_ids
from .sequence import Sequence
from .transaction import TokenBatch, TokenWrite, Transaction


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
        if not isinstance(prefix_caching, (bool, np.bool_)):
            raise TypeError(f"prefix_caching: expected a bool, got {type(prefix_caching).__name__} {prefix_caching!r}")
        namespace = check_namespace("namespace", namespace)
        if prefix_salt is not None and (not isinstance(prefix_salt, bytes) or len(prefix_salt) < 8):
            raise TypeError(f"prefix_salt: expected None or bytes of length >= 8, got {prefix_salt!r}")
        self.config = cfg = CacheConfig.build(num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=head_dim,
                                              head_dim_v=head_dim_v, page_size=page_size, num_pages=num_pages,
                                              max_tokens=max_tokens, dtype=dtype)
        salt = os.urandom(16) if prefix_salt is None else prefix_salt
        self._core = core = CacheCore(cfg, PrefixIndex(salt, repr(cfg)) if prefix_caching else None, namespace, salt)
        self._pool = core.pool                     # the page arrays (values, int8 scales) and their byte operations
        self._lock = core.lock
        self.allocator = AllocatorView(core.allocator)   # read-only: ref counts, free pages (tests, the scheduler)
        self._appender = Appender(core)

    @property
    def index(self) -> PrefixIndex | None:
        """The prefix index (prefix caching), else None."""
        return self._core.index

    @property
    def namespace(self) -> str:
        return self._core.namespace

    @property
    def prefix_caching(self) -> bool:
        return self._core.index is not None

    # -- fault hook (tests) ------------------------------------------------------------------------------
    @property
    def fault_hook(self):
        return self._core.fault_hook

    @fault_hook.setter
    def fault_hook(self, hook) -> None:
        self._core.fault_hook = hook
        self._core.allocator.fault_hook = hook

    # -- read-only views ----------------------------------------------------------------------------------
    def k_pages(self, layer: int = 0) -> np.ndarray:
        """``[num_pages, num_kv_heads, page_size, head_dim]`` K pages of ``layer`` (a view; do not write)."""
        return self._pool.k[check_int("layer", layer, maximum=self.config.num_layers - 1)]

    def v_pages(self, layer: int = 0) -> np.ndarray:
        """``[num_pages, num_kv_heads, page_size, head_dim_v]`` V pages of ``layer`` (a view; do not write)."""
        return self._pool.v[check_int("layer", layer, maximum=self.config.num_layers - 1)]

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
        return self._core.num_free_pages

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
        return tuple(self._core.sequences)

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
    def check_kv(self, k, v, num_tokens: int | None = None, *, layered: bool = True):
        """Validate K/V and cast them to the storage dtype (finite after the cast); for int8 storage check them
        finite and within `kvcache.quant.MAX_ABS` (`ScaleOverflowError`) and keep them float (writes quantize).

        ``layered``: ``k [num_layers, T, num_kv_heads, head_dim]`` (``[T, ...]`` accepted for one layer);
        otherwise one layer's ``k [T, num_kv_heads, head_dim]``. ``v`` likewise with ``head_dim_v``.
        """
        return self._appender.check_kv(k, v, num_tokens, layered=layered)

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
        return Transaction(self._appender, checked, self._check_token_ids(token_ids, checked))

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
        ids = None if token_id is None else [check_token_ids("token_id", np.atleast_1d(token_id), 1)]
        return TokenWrite(self._appender, [seq], ids)

    def begin_tokens(self, seqs, *, token_ids=None) -> TokenBatch:
        """Reserve position `length` of each of ``seqs`` (distinct sequence ids) for one token each (the batched
        decode step); see `TokenBatch`. ``token_ids`` (optional): ``{seq: id}`` for some or all of them, for
        prefix caching. `CacheFullError` (and every argument error, checked first) with nothing changed."""
        if type(seqs) is list and len(seqs) == 1 and token_ids is None:     # the decode step: no more to check
            return TokenWrite(self._appender, seqs)
        if not isinstance(seqs, (list, tuple)) or not seqs:
            raise TypeError(f"seqs: expected a non-empty list of sequence ids, got {seqs!r}")
        if not all(type(seq) is int for seq in seqs):         # plain ints: their ids are checked by `TokenBatch`
            for seq in seqs:
                self._sequence(seq)                           # names a bad id
        if len(set(seqs)) != len(seqs):
            raise ValueError(f"seqs: expected distinct sequence ids, got {list(seqs)}")
        ids = None
        if token_ids is not None:
            if not isinstance(token_ids, dict):
                raise TypeError(f"token_ids: expected a dict {{seq: token id}}, got {type(token_ids).__name__}")
            ids = self._check_token_ids({seq: np.atleast_1d(i) for seq, i in token_ids.items()},
                                        dict.fromkeys(map(int, seqs), 1))
        seqs = [int(seq) for seq in seqs]
        if ids is not None:
            ids = [ids.get(seq) for seq in seqs]
        return (TokenWrite if len(seqs) == 1 else TokenBatch)(self._appender, seqs, ids)

    # -- prefix reuse -------------------------------------------------------------------------------------
    def match_prefix(self, token_ids, *, namespace=None) -> PrefixMatch:
        """A new sequence holding the longest cached prefix of ``token_ids [N]`` in whole pages, at most N - 1
        tokens (one is always left to compute); its pages are adopted (reference counts), none copied.
        Returns ``PrefixMatch(seq, num_tokens)``; append the remaining ``N - num_tokens`` tokens to ``seq``."""
        if self.index is None:
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
        return self._pool.dense(layer, pages, count)

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
