"""Test tooling, never for production code: fault injection, the page allocator itself, and the writable
internals a test paints, corrupts or watches.

    FaultInjector, InjectedFault        make the n-th fault point of an operation fail (`kvcache.faults`)
    PageAllocator                       the page accounting, on its own
    pool_arrays(cache) -> (k, v)        the writable page arrays ``[num_layers, num_pages, num_kv_heads,
                                        page_size, head_dim]`` (sentinels, guard pages)
    allocator(cache) -> PageAllocator   the cache's own allocator (record or wrap `allocate`, corrupt it)
    sequence_record(cache, seq)         the live `kvcache.sequence.Sequence` record (corruption tests)
    lock(cache)                         the cache's re-entrant metadata lock (a consistent look at records)
    set_fault_hook(cache, hook)         call ``hook(point)`` at every fault point of the cache (``no_fault``: none)
    set_free_list(allocator, pages), set_ref_count(allocator, page, count)   corrupt an allocator on purpose
"""
from .allocator import PageAllocator
from .cache import KVCache, core_of
from .errors import InjectedFault
from .faults import FaultInjector, no_fault
from .sequence import Sequence

__all__ = ["FaultInjector", "InjectedFault", "PageAllocator", "no_fault", "pool_arrays", "allocator", "sequence_record",
           "lock", "set_fault_hook", "set_free_list", "set_ref_count"]


def pool_arrays(cache: KVCache) -> tuple:
    """``(k, v)``: the cache's page arrays, all layers, writable."""
    pool = core_of(cache).pool
    return pool.k, pool.v


def allocator(cache: KVCache) -> PageAllocator:
    return core_of(cache).allocator


def sequence_record(cache: KVCache, seq: int) -> Sequence:
    return core_of(cache).sequence(seq)


def lock(cache: KVCache):
    return core_of(cache).lock


def set_fault_hook(cache: KVCache, hook) -> None:
    """Make ``cache`` (and its allocator) call ``hook(point)`` at each fault point (`kvcache.faults`)."""
    core = core_of(cache)
    core.fault_hook = core.allocator.fault_hook = hook


def set_free_list(alloc: PageAllocator, pages) -> None:
    """Replace the free list (order kept) with ``pages``, leaving ref counts and parked pages as they are."""
    alloc.restore(list(pages), list(alloc.ref_counts()), set(alloc.parked()))


def set_ref_count(alloc: PageAllocator, page: int, count: int) -> None:
    refs = list(alloc.ref_counts())
    refs[page] = count
    alloc.restore(list(alloc.free_list()), refs, set(alloc.parked()))
