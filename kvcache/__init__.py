"""kvcache: a preallocated, paged KV cache with transactional append, rollback, truncation and shared prefixes.

Knows nothing of attention; `decode` reads it through this public API.
"""
from .allocator import PageAllocator
from .cache import KVCache
from .config import CacheConfig
from .cache import PrefixMatch
from .errors import (CacheFullError, InjectedFault, ScaleOverflowError, SnapshotChecksumError, SnapshotConfigError,
                     SnapshotCorruptError, SnapshotError, SnapshotFormatError, SnapshotInconsistentError,
                     SnapshotRangeError, SnapshotTruncatedError, SnapshotVersionError)
from .faults import FaultInjector
from .transaction import Transaction

__all__ = ["KVCache", "CacheConfig", "CacheFullError", "InjectedFault", "FaultInjector", "PageAllocator",
           "PrefixMatch", "ScaleOverflowError", "Transaction", "SnapshotError", "SnapshotTruncatedError",
           "SnapshotCorruptError", "SnapshotChecksumError", "SnapshotVersionError", "SnapshotConfigError",
           "SnapshotFormatError", "SnapshotRangeError", "SnapshotInconsistentError"]
