"""kvcache: a preallocated, paged KV cache with transactional append, rollback, truncation and shared prefixes.

Knows nothing of attention; `decode` reads it through this public API: a user's operations on `KVCache`, the page
arrays, page tables and storage checks the kernels need behind ``KVCache.pool`` (`kvcache.pool_view.PoolView`).
The snapshot errors' subclasses are in `kvcache.errors`; test tooling (fault injection and hooks, the allocator,
writable internals) in `kvcache.testing`; every argument check in `kvcache.checks`.
"""
from . import jit_cache  # noqa: F401  (first: cached kernels are stamped with the package's sources)
from .cache import KVCache, PrefixMatch
from .config import CacheConfig
from .errors import CacheFullError, ScaleOverflowError, SnapshotError
from .transaction import AppendTransaction, TokenBatch, TokenWrite, Transaction

__all__ = ["KVCache", "CacheConfig", "PrefixMatch", "CacheFullError", "ScaleOverflowError", "SnapshotError",
           "AppendTransaction", "Transaction", "TokenBatch", "TokenWrite"]
