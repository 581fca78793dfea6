"""`CacheCore`: the state of a `KVCache` and the page bookkeeping every mutating operation shares.

The cache's modules (`kvcache.appender`, `kvcache.lifecycle`, `kvcache.integrity`, `kvcache.snapshot_state`) work on
one `CacheCore` through its public names below; `KVCache` is the facade over them. Nothing here validates user
input: the callers did. Every change is recorded in a `Journal` by the caller's rules (see `kvcache.cache`).

State: ``config``, ``pool`` (`PagePool`: the page arrays), ``allocator``, ``sequences`` ({id: `Sequence`}),
``next_id``, ``lock`` (re-entrant, guards all metadata), ``index`` (`PrefixIndex` or None), ``namespace``,
``salt``, ``fault_hook`` (a callable of a fault point's name; tests), ``group`` (the open `kvcache.group.OpGroup`
or None).
"""
import threading

from .allocator import PageAllocator
from .checks import check_live_seq
from .config import CacheConfig
from .errors import CacheFullError
from .faults import no_fault
from .journal import Journal
from .sequence import Sequence
from .storage import PagePool


class CacheCore:
    def __init__(self, cfg: CacheConfig, index, namespace: str, salt: bytes):
        self.config = cfg
        self.pool = PagePool(cfg)
        self.allocator = PageAllocator(cfg.num_pages)
        self.sequences: dict[int, Sequence] = {}
        self.next_id = 0
        self.lock = threading.RLock()
        self.index = index
        self.namespace = namespace
        self.salt = salt
        self.fault_hook = no_fault
        self.group = None
        self.freed: list[int] = []      # pages freed since the last `clear_freed` (see there)

    def fault(self, point: str) -> None:
        """The fault point ``point`` (the current hook decides whether it raises)."""
        self.fault_hook(point)

    # -- sequences ----------------------------------------------------------------------------------------
    def sequence(self, seq) -> Sequence:
        """The live sequence ``seq`` (`kvcache.checks.check_live_seq`: TypeError for a non-integer id, ValueError
        for an unknown one)."""
        s = self.sequences.get(seq) if type(seq) is int else None     # the common case: one dict lookup
        return s if s is not None else check_live_seq(seq, self.sequences)

    def idle_sequence(self, seq) -> Sequence:
        """`sequence`, and RuntimeError if it has an open transaction."""
        s = self.sequence(seq)
        if s.busy:
            raise RuntimeError(f"seq: expected a sequence with no open transaction, got {seq} (in a transaction)")
        return s

    def idle_sequences(self, seqs: list) -> list[Sequence]:
        """`idle_sequence` of each of ``seqs``: one dict lookup each for plain int ids of idle sequences, else the
        one-by-one checks (which raise the named error of the first bad id)."""
        table = self.sequences
        found = None
        if all(type(seq) is int for seq in seqs):
            try:
                found = [table[seq] for seq in seqs]
            except KeyError:
                pass
        if found is None or any(s.busy for s in found):
            return [self.idle_sequence(seq) for seq in seqs]
        return found

    # -- pages --------------------------------------------------------------------------------------------
    @property
    def num_free_pages(self) -> int:
        """Pages an append can take: clean free pages plus cached (evictable) prefix pages."""
        return self.allocator.num_free_pages + self.allocator.num_parked

    def needs_copy(self, page: int) -> bool:
        """A write into ``page`` must copy it first: shared with another sequence, or registered (immutable)."""
        return self.allocator.ref_count(page) > 1 or (self.index is not None and self.index.holds(page))

    def take_pages(self, count: int, could_ever_fit: bool, what: str, journal: Journal) -> list[int]:
        """``count`` pages: clean free pages first, then cached prefix pages evicted oldest first."""
        alloc = self.allocator
        available = alloc.num_free_pages + alloc.num_parked
        if count > available:
            raise CacheFullError(count, available, self.config.num_pages, could_ever_fit, what)
        for _ in range(count - alloc.num_free_pages):
            self.evict_one(journal)
        pages = alloc.allocate(count, could_ever_fit=could_ever_fit, what=what)
        journal.record(lambda: alloc.unallocate(pages))
        return pages

    def evict_one(self, journal: Journal) -> None:
        """Unregister the least recently released cached page and put it on the free list."""
        self.fault_hook("evict")
        entry, stamp = self.index.evict_oldest()
        self.allocator.reclaim(entry.page)
        journal.record(lambda: (self.allocator.park(entry.page), self.index.restore_evicted(entry, stamp)))

    def decref(self, page: int, journal: Journal | None) -> None:
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
        elif freed:
            self.freed.append(page)

    def clear_freed(self) -> None:
        """Zero the bytes of the pages freed by finished operations that are still free, once no open group can
        take a free back (a no-op while ``group`` is open or nothing was freed): a later write into such a page
        finds zeros, which the journal records without a copy (`Journal.save_bytes`), so a prefill into recycled
        pages saves nothing. The pages stay resident (`PagePool.clear_pages`). A page a rollback took back since
        (referenced or parked again) keeps its bytes."""
        if not self.freed or self.group is not None:
            return
        alloc, pages = self.allocator, self.freed
        self.freed = []
        parked = alloc.parked() if alloc.num_parked else ()
        free = [page for page in set(pages) if alloc.ref_count(page) == 0 and page not in parked]
        if free:
            self.pool.clear_pages(free)

    def copy_on_write(self, s: Sequence, logical: int, new_page: int, journal: Journal) -> None:
        """Give ``s`` a private copy (all layers) of its shared page at ``logical``."""
        old_page = int(s.table[logical])
        self.fault_hook("cow_copy")
        self.pool.copy_page(old_page, new_page, journal)
        s.table[logical] = new_page
        journal.record(lambda: s.table.__setitem__(logical, old_page))
        # Keep the reference to the old page until commit: a rollback points ``s`` back at it, so nobody else
        # may write into it (or free and reuse it) while the transaction is open.
        s.held.append(old_page)
        journal.record(s.held.pop)

    def atomically(self, change, publish, unpublish=None) -> None:
        """Run ``change(journal)``, then the fault point "publish", then ``publish()``; undo all on failure.
        Inside an open `OpGroup` the undo steps (and ``unpublish``, the inverse of ``publish``) go to the group."""
        journal = Journal()
        try:
            change(journal)
            self.fault_hook("publish")
        except BaseException:
            journal.rollback()
            raise
        publish()
        self.keep_for_group(journal, unpublish)
        self.clear_freed()

    def keep_for_group(self, journal: Journal | None, undo=None) -> None:
        """Hand a finished operation's undo steps to the `OpGroup` open in this thread, if any."""
        group = self.group
        if group is None or group.thread != threading.get_ident():
            return
        if journal is not None:
            group.journal.extend(journal)
        if undo is not None:
            group.journal.record(undo)

    def forget_created(self, seq: int) -> None:
        """Inverse of creating ``seq`` (by create_sequence, fork or match_prefix, its pages already given back):
        drop it, and give its id back when no id was handed out after it."""
        del self.sequences[seq]
        if self.next_id == seq + 1:
            self.next_id = seq
