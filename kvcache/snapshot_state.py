"""A `CacheCore` to and from the `kvcache.snapshot.CacheState` a snapshot file holds (`KVCache.save` / `load`)."""
import numpy as np

from . import snapshot
from .core import CacheCore
from .prefix import Entry, PrefixIndex
from .sequence import Sequence

_NAMES = ("k", "v", "k_scales", "v_scales")          # the page arrays by snapshot tensor name (int8: the scales)


def capture(core: CacheCore) -> snapshot.CacheState:
    """The state of ``core`` (caller holds the lock; no transaction open); only the pages in use."""
    index, alloc = core.index, core.allocator
    entries = index.entries() if index is not None else []
    number = {id(e): i for i, e in enumerate(entries)}

    def link(entry) -> int:
        return number[id(entry)] if index.alive(entry) and entry.page >= 0 else (-1 if entry.page < 0 else -2)
    entry_states = [snapshot.EntryState(e.page, e.key, link(e.parent), e.parent.key, e.tokens, e.namespace)
                    for e in entries]
    seqs = [snapshot.SequenceState(seq, s.length, s.first_live_page, s.pages().copy(), s.known_tokens().copy(),
                                   [number[id(e)] if index.alive(e) else -1 for e in s.chain], s.namespace)
            for seq, s in sorted(core.sequences.items())]
    used = np.asarray(sorted(set(range(core.config.num_pages)) - set(alloc.free_list())), dtype=np.int32)
    return snapshot.CacheState(
        config=core.config, prefix_caching=index is not None, namespace=core.namespace, salt=core.salt,
        next_id=core.next_id, free_list=list(alloc.free_list()), ref_counts=list(alloc.ref_counts()),
        eviction_order=index.eviction_order() if index is not None else [], used_pages=used,
        pools={name: pages_of(array, used) for name, array in named_arrays(core).items()}, sequences=seqs,
        entries=entry_states)


def pages_of(array: np.ndarray, pages: np.ndarray) -> np.ndarray:
    """``array[:, pages]``; a view when ``pages`` is ``0 .. n - 1`` (no copy of a full pool)."""
    if len(pages) and pages[0] == 0 and pages[-1] == len(pages) - 1:
        return array[:, : len(pages)]
    return array[:, pages]


def named_arrays(core: CacheCore) -> dict[str, np.ndarray]:
    """The page arrays by snapshot tensor name: k, v (int8: k_scales, v_scales too)."""
    return dict(zip(_NAMES, core.pool.arrays))


def restore(core: CacheCore, state: snapshot.CacheState) -> None:
    """Set a fresh ``core`` to a validated ``state``."""
    used = state.used_pages
    contiguous = len(used) and used[0] == 0 and used[-1] == len(used) - 1
    for name, array in named_arrays(core).items():
        if contiguous:
            array[:, : len(used)] = state.pools[name]
        else:
            array[:, used] = state.pools[name]
    core.salt, core.next_id = state.salt, state.next_id
    core.allocator.restore(state.free_list, state.ref_counts, set(state.eviction_order))
    entries = []
    if state.prefix_caching:
        core.index = index = PrefixIndex(core.salt, repr(core.config))
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
        core.sequences[s.seq] = seq
