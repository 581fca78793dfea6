"""Page accounting: a free list, per-page reference counts and parked pages. Knows nothing of K/V or attention.

A page is free (on the free list), referenced (ref count > 0) or parked (ref count 0, kept out of the free
list by its owner: a cached prefix page that may be adopted again, or reclaimed when no free page is left).

Every mutating method has an exact inverse, so a failed operation can be undone in LIFO order and leave the
free list (its order included), the parked set and the reference counts exactly as they were.
"""
import sys
from collections import Counter
from typing import Callable, Iterable

from .errors import CacheFullError
from .faults import no_fault


class PageAllocator:
    """O(1) allocate / free of page ids ``0 .. num_pages - 1``."""

    def __init__(self, num_pages: int, fault_hook: Callable[[str], None] = no_fault):
        self.num_pages = num_pages
        self._free = list(range(num_pages - 1, -1, -1))     # a stack: page 0 is handed out first
        self._refs = [0] * num_pages
        self._parked: set[int] = set()
        self.fault_hook = fault_hook

    @property
    def num_free_pages(self) -> int:
        return len(self._free)

    @property
    def num_parked(self) -> int:
        return len(self._parked)

    def parked(self) -> frozenset[int]:
        return frozenset(self._parked)

    def ref_count(self, page: int) -> int:
        return self._refs[page]

    def allocate(self, count: int, could_ever_fit: bool = True, what: str = "") -> list[int]:
        """Take ``count`` pages (ref count 1 each), all or none; CacheFullError when too few are free."""
        if count > len(self._free):
            raise CacheFullError(count, len(self._free), self.num_pages, could_ever_fit, what)
        pages: list[int] = []
        try:
            for _ in range(count):
                self.fault_hook("allocate")
                page = self._free.pop()
                self._refs[page] = 1
                pages.append(page)
        except BaseException:
            self.unallocate(pages)
            raise
        return pages

    def unallocate(self, pages: list[int]) -> None:
        """Exact inverse of the `allocate` that returned ``pages``."""
        for page in reversed(pages):
            self._refs[page] = 0
            self._free.append(page)

    def incref(self, page: int) -> None:
        self._refs[page] += 1

    def decref(self, page: int) -> bool:
        """Drop one reference; the page returns to the free list when none is left. Returns whether it did."""
        self._refs[page] -= 1
        if self._refs[page] == 0:
            self._free.append(page)
            return True
        return False

    def undo_decref(self, page: int, freed: bool) -> None:
        """Exact inverse of the latest `decref(page)` (which returned ``freed``)."""
        if freed:
            assert self._free[-1] == page, "undo_decref out of LIFO order"
            self._free.pop()
        self._refs[page] += 1

    def park(self, page: int) -> None:
        """Take ``page`` (just freed: the top of the free list) off the free list and keep it parked."""
        assert self._free and self._free[-1] == page and self._refs[page] == 0, f"park: page {page} not just freed"
        self._free.pop()
        self._parked.add(page)

    def reclaim(self, page: int) -> None:
        """A parked ``page`` goes to the top of the free list (exact inverse: `park`)."""
        self._parked.remove(page)
        self._free.append(page)

    def adopt(self, page: int) -> None:
        """Reference a parked ``page`` again (ref count 0 -> 1; exact inverse: `unadopt`)."""
        self._parked.remove(page)
        self._refs[page] = 1

    def unadopt(self, page: int) -> None:
        assert self._refs[page] == 1, f"unadopt: page {page} has ref count {self._refs[page]}"
        self._refs[page] = 0
        self._parked.add(page)

    def reference_all(self, pages: list[int]) -> set[int]:
        """One more reference to each of ``pages`` (distinct); parked ones are adopted. Returns those (for
        `unreference_all`, the exact inverse)."""
        refs, parked = self._refs, self._parked
        adopted = {page for page in pages if refs[page] == 0}
        parked -= adopted
        for page in pages:
            refs[page] += 1
        return adopted

    def unreference_all(self, pages: list[int], adopted: set[int]) -> None:
        refs = self._refs
        for page in pages:
            refs[page] -= 1
        self._parked |= adopted

    def restore(self, free: list[int], refs: list[int], parked: set[int]) -> None:
        """Set the whole state (a snapshot being loaded; validated by the caller)."""
        self._free, self._refs, self._parked = list(free), list(refs), set(parked)

    def free_list(self) -> tuple[int, ...]:
        """The free list in order (for fingerprints and tests)."""
        return tuple(self._free)

    def ref_counts(self) -> tuple[int, ...]:
        return tuple(self._refs)

    def metadata_nbytes(self) -> tuple[int, int]:
        """``(ref counts, free list)``: ``sys.getsizeof`` of the two lists (memory accounting)."""
        return sys.getsizeof(self._refs), sys.getsizeof(self._free)

    def check_invariants(self, page_tables: Iterable[Iterable[int]]) -> None:
        """Raise AssertionError unless free + parked + in use == total, each ref count equals the number of
        page tables holding the page, nothing is both free (or parked) and mapped, and the free list has no
        duplicates."""
        held = Counter(page for table in page_tables for page in table if page >= 0)
        free = set(self._free)
        assert len(free) == len(self._free), f"duplicates in the free list: {sorted(self._free)}"
        assert not free & held.keys(), f"pages both free and mapped: {sorted(free & held.keys())}"
        assert not self._parked & held.keys(), f"pages both parked and mapped: {sorted(self._parked & held.keys())}"
        assert not self._parked & free, f"pages both parked and free: {sorted(self._parked & free)}"
        in_use = [p for p in range(self.num_pages) if self._refs[p] > 0]
        assert len(free) + len(self._parked) + len(in_use) == self.num_pages, (
            f"free {len(free)} + parked {len(self._parked)} + in use {len(in_use)} != total {self.num_pages}")
        for page in range(self.num_pages):
            assert self._refs[page] == held.get(page, 0), (
                f"page {page}: ref count {self._refs[page]} but held by {held.get(page, 0)} page tables")
            assert (self._refs[page] == 0) == (page in free or page in self._parked), (
                f"page {page}: ref count 0 iff free or parked violated")


class AllocatorView:
    """What a `KVCache` shows of its `PageAllocator`: the counts and copies, nothing that changes it."""

    __slots__ = ("_allocator",)

    def __init__(self, allocator: PageAllocator):
        self._allocator = allocator

    @property
    def num_pages(self) -> int:
        return self._allocator.num_pages

    @property
    def num_free_pages(self) -> int:
        """Clean free pages (without the cached prefix pages, see `KVCache.num_free_pages`)."""
        return self._allocator.num_free_pages

    @property
    def num_parked(self) -> int:
        return self._allocator.num_parked

    def ref_count(self, page: int) -> int:
        return self._allocator.ref_count(page)

    def parked(self) -> frozenset[int]:
        return self._allocator.parked()

    def free_list(self) -> tuple[int, ...]:
        return self._allocator.free_list()

    def ref_counts(self) -> tuple[int, ...]:
        return self._allocator.ref_counts()
