"""Checking a `CacheCore`: its invariants (tests, the reliability driver) and its fingerprint (a sha256 over every
pool byte and all metadata: what "the cache is unchanged after a failure" is compared by)."""
import hashlib

from .core import CacheCore
from .sequence import Sequence


def check_invariants(core: CacheCore) -> None:
    """AssertionError unless the allocator's invariants hold for the page tables and every sequence's table
    matches its length."""
    cfg = core.config
    tables = [s.live_pages().tolist() + s.held for s in core.sequences.values()]
    core.allocator.check_invariants(tables)
    parked = set(core.allocator.parked())
    if core.index is not None:
        core.index.check_invariants({p for table in tables for p in table if p >= 0}, parked)
    else:
        assert not parked, f"pages parked without prefix caching: {sorted(parked)}"
    for seq, s in core.sequences.items():
        check_tokens(core, seq, s)
        if not s.busy:
            assert s.num_logical_pages == cfg.pages_for(s.length), (
                f"seq {seq}: {s.num_logical_pages} pages for length {s.length}")
        assert (s.table[: s.first_live_page] == -1).all(), f"seq {seq}: released entries not -1"
        live = s.live_pages()
        assert ((live >= 0) & (live < cfg.num_pages)).all(), f"seq {seq}: page ids out of range {live}"


def check_tokens(core: CacheCore, seq: int, s: Sequence) -> None:
    """The token ids and prefix chain of ``s`` agree with its length and the prefix index."""
    size, index = core.config.page_size, core.index
    assert 0 <= s.num_known <= s.length or s.busy, f"seq {seq}: {s.num_known} known token ids, length {s.length}"
    if index is None:
        assert not s.chain, f"seq {seq}: a prefix chain without prefix caching"
        return
    assert len(s.chain) == s.num_known // size, f"seq {seq}: chain of {len(s.chain)} for {s.num_known} known ids"
    for logical, entry in enumerate(s.chain):
        if index.alive(entry):
            assert entry.tokens == s.tokens[logical * size:(logical + 1) * size].tobytes(), (
                f"seq {seq}: page {logical}'s chain entry holds other tokens (stale)")
            parent = s.chain[logical - 1] if logical else index.root(s.namespace)
            assert entry.parent is parent, f"seq {seq}: page {logical}'s chain entry has another parent"


def filled_slots(core: CacheCore) -> dict[int, int]:
    """page -> slots ``[0, n)`` some holder has written (cached registered pages: all)."""
    size, filled = core.config.page_size, {}
    for page in core.allocator.parked():
        filled[page] = size
    for s in core.sequences.values():
        for logical in range(s.first_live_page, s.num_logical_pages):
            page = int(s.table[logical])
            filled[page] = max(filled.get(page, 0), min(size, s.length - logical * size))
    return filled


def fingerprint(core: CacheCore, include_free_pages: bool = True) -> str:
    """See `KVCache.fingerprint`; the caller holds the lock."""
    h = hashlib.sha256()
    if include_free_pages:
        core.pool.update_hash(h)
    else:
        for page, filled in sorted(filled_slots(core).items()):
            h.update(repr((page, filled)).encode())
            for array in core.pool.arrays:
                h.update(array[:, page, :, :filled].tobytes())
    alloc, index = core.allocator, core.index
    h.update(repr((alloc.free_list(), alloc.ref_counts(), core.next_id, sorted(alloc.parked()),
                   core.namespace)).encode())
    if index is not None:
        h.update(repr(index.state()).encode())
    for seq, s in sorted(core.sequences.items()):
        chain = [e.key if index.alive(e) else None for e in s.chain] if index else []
        h.update(repr((seq, s.length, s.first_live_page, s.busy, s.pages().tolist(), s.held, s.namespace,
                       s.known_tokens().tobytes(), chain)).encode())
    return h.hexdigest()
