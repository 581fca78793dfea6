"""Sequence lifecycle on a `CacheCore`: truncate, fork (copy-on-write sharing), free, sliding-window release,
and starting a sequence from a cached prefix (`match_prefix`).

Each operation validates its arguments, then changes the state through a journal (`CacheCore.atomically`): on
any failure every change is undone. The caller (`KVCache`) holds the lock.
"""
import numpy as np

from .checks import check_int
from .core import CacheCore
from .journal import Journal
from .sequence import Sequence


def truncate(core: CacheCore, seq: int, n: int) -> None:
    """Keep tokens ``[0, n)`` of ``seq`` (n from its first held position to its length)."""
    s = core.idle_sequence(seq)
    n = check_int("n", n, minimum=s.first_live_page * core.config.page_size, maximum=s.length)
    keep = core.config.pages_for(n)
    old = s.length, s.num_known, list(s.chain)

    def publish():
        s.length, s.num_known = n, min(s.num_known, n)
        del s.chain[n // core.config.page_size:]            # the records of pages [n // page_size, ..)

    def unpublish():
        s.length, s.num_known = old[0], old[1]
        s.chain[:] = old[2]
    core.atomically(lambda journal: drop_pages(core, s, keep, journal), publish, unpublish)


def fork(core: CacheCore, seq: int) -> int:
    """A new sequence sharing every page of ``seq`` (reference counts; no K/V copied); returns its id."""
    child = core.idle_sequence(seq).copy_for_fork()
    new_id = core.next_id

    def share(journal):
        for page in child.live_pages().tolist():
            core.fault_hook("fork_incref")
            core.allocator.incref(page)
            journal.record(lambda page=page: core.allocator.decref(page))

    def register():
        core.sequences[new_id] = child
        core.next_id = new_id + 1
    core.atomically(share, register, lambda: core.forget_created(new_id))
    return new_id


def free(core: CacheCore, seq: int) -> None:
    """Return every page of ``seq`` to the pool and forget the sequence."""
    s = core.idle_sequence(seq)
    core.atomically(lambda journal: drop_pages(core, s, s.first_live_page, journal),
                    lambda: core.sequences.pop(int(seq)), lambda: core.sequences.__setitem__(int(seq), s))


def release_before(core: CacheCore, seq: int, position: int) -> int:
    """Give back the pages of ``seq`` that hold only positions ``< position``; returns how many."""
    s = core.idle_sequence(seq)
    position = check_int("position", position, maximum=s.length)
    first = max(s.first_live_page, min(position // core.config.page_size, s.num_logical_pages))

    def release(journal):
        for logical in range(s.first_live_page, first):
            release_entry(core, s, logical, journal)
    old_first = s.first_live_page
    core.atomically(release, lambda: setattr(s, "first_live_page", first),
                    lambda: setattr(s, "first_live_page", old_first))
    return first - old_first


def drop_pages(core: CacheCore, s: Sequence, keep: int, journal: Journal) -> None:
    """Decref logical pages ``keep ..`` of ``s`` (newest first) and shorten its page table."""
    for logical in range(s.num_logical_pages - 1, max(keep, s.first_live_page) - 1, -1):
        release_entry(core, s, logical, journal)
    old_count = s.num_logical_pages
    s.num_logical_pages = min(keep, old_count)
    journal.record(lambda: setattr(s, "num_logical_pages", old_count))


def release_entry(core: CacheCore, s: Sequence, logical: int, journal: Journal) -> None:
    """Drop ``s``'s reference to its logical page ``logical``; the entry becomes -1."""
    page = int(s.table[logical])
    core.fault_hook("decref")
    core.decref(page, journal)
    s.table[logical] = -1
    journal.record(lambda: s.table.__setitem__(logical, page))


def match_prefix(core: CacheCore, ids: np.ndarray, namespace: str) -> tuple[int, int]:
    """A new sequence holding the longest cached prefix of checked ``ids [N]`` in whole pages, at most N - 1
    tokens; its pages are adopted (reference counts). Returns ``(seq, num_tokens)``."""
    size = core.config.page_size
    entries = core.index.walk(namespace, ids.tobytes(), (len(ids) - 1) // size, size * ids.itemsize)
    hit = len(entries) * size
    s = Sequence(np.array([e.page for e in entries], dtype=np.int32), hit)
    s.store_tokens(0, ids[:hit])
    s.num_known, s.chain, s.namespace = hit, entries, namespace
    new_id = core.next_id

    def register():
        core.sequences[new_id] = s
        core.next_id = new_id + 1
    core.atomically(lambda journal: adopt(core, [e.page for e in entries], journal), register,
                    lambda: core.forget_created(new_id))
    return new_id, hit


def adopt(core: CacheCore, pages: list[int], journal: Journal) -> None:
    """Take one reference to each of ``pages`` (registered); a cached one leaves the evictable set."""
    core.fault_hook("match")
    if not pages:
        return
    core.fault_hook("adopt")
    alloc, index = core.allocator, core.index
    adopted = alloc.reference_all(pages)
    stamps = [(page, index.unpark(page)) for page in adopted]

    def undo():
        alloc.unreference_all(pages, adopted)
        for page, stamp in stamps:
            index.park(page, stamp)
    journal.record(undo)
