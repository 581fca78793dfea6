"""The prefix index: full pages registered under a sha256 key chain, found only by exact content, and the
cached pages no sequence holds, evictable least recently released first. Knows nothing of K/V or attention.

Keys: ``key(page i) = sha256(key(page i - 1) || token ids of page i as int32 little-endian)``; the root key
(page -1) is ``sha256(format version, a random per-cache salt, the cache config and storage format, the
caller's namespace, the start position 0)``. Two sequences share a page only if the same tokens follow the
same chain under the same namespace in the same cache.

Lookups never trust a hash: every entry keeps its registered children by their token bytes (a radix tree of
whole pages), so `lookup(parent, tokens)` compares the token ids exactly and only below the very entry the walk
came from (the parent is checked by identity, not by key); a colliding key can cost a hit (a page not
registered) but never serve K/V computed after other tokens. An entry whose parent was evicted stays valid for
the sequences holding its page, but no walk reaches it again (a re-registered parent is a new entry with no
children).

Every mutating method has an exact inverse (for the cache's journal): `register`/`unregister`,
`park`/`unpark`, `evict_oldest`/`restore_evicted`. The eviction order is the order pages were parked (a
sequence releases its pages newest first, so a chain's tail goes before its head, as in vLLM).
"""
import hashlib
import heapq
import json


FORMAT_VERSION = 1


def page_key(parent: bytes, tokens: bytes) -> bytes:
    """The key of a page: ``sha256(parent key || token bytes)`` (32 bytes)."""
    return hashlib.sha256(parent + tokens).digest()


def root_key(salt: bytes, config_text: str, namespace: str) -> bytes:
    """The key chain's root for one cache (salt, config and storage format) and namespace, start position 0."""
    header = json.dumps({"format": "pagedkv-prefix", "version": FORMAT_VERSION, "config": config_text,
                         "namespace": namespace, "start_position": 0}, sort_keys=True).encode()
    return hashlib.sha256(salt + header).digest()


class Entry:
    """A registered page: its ``key``, ``parent`` entry (a root entry for a sequence's first page), the page's
    ``tokens`` (bytes, `checks.TOKEN_DTYPE`) and physical ``page`` (-1 for a root)."""

    __slots__ = ("key", "parent", "tokens", "page", "namespace", "children")

    def __init__(self, key: bytes, parent, tokens: bytes, page: int, namespace: str):
        self.key, self.parent, self.tokens, self.page, self.namespace = key, parent, tokens, page, namespace
        self.children: dict[bytes, "Entry"] = {}                # registered children by their token bytes


class PrefixIndex:
    """Entries by key, by page and as children of their parents; the evictable pages with their park stamps."""

    def __init__(self, salt: bytes, config_text: str, hash_page=page_key):
        self.salt, self.config_text, self.hash_page = salt, config_text, hash_page
        self._roots: dict[str, Entry] = {}
        self._by_key: dict[bytes, Entry] = {}
        self._by_page: dict[int, Entry] = {}
        self._stamps: dict[int, int] = {}             # evictable page -> park stamp (smaller: older)
        self._heap: list[tuple[int, int]] = []        # (stamp, page), lazily pruned
        self._next_stamp = 0

    # -- chain ------------------------------------------------------------------------------------------------
    def root(self, namespace: str) -> Entry:
        """The root entry of ``namespace`` (made on first use; roots are derived, not state)."""
        entry = self._roots.get(namespace)
        if entry is None:
            key = root_key(self.salt, self.config_text, namespace)
            entry = self._roots[namespace] = Entry(key, None, b"", -1, namespace)
        return entry

    def lookup(self, parent: Entry, tokens: bytes) -> Entry | None:
        """The registered child of ``parent`` holding exactly ``tokens``, or None."""
        return parent.children.get(tokens)

    def alive(self, entry: Entry | None) -> bool:
        """Whether ``entry`` is a root or still registered (not evicted)."""
        return entry is not None and (entry.page < 0 or self._by_page.get(entry.page) is entry)

    def holds(self, page: int) -> bool:
        """Whether ``page`` is registered (immutable: a write into it copies first)."""
        return page in self._by_page

    def walk(self, namespace: str, token_bytes: bytes, num_pages: int, page_bytes: int) -> list[Entry]:
        """The longest run of registered entries for the first ``num_pages`` pages of ``token_bytes``."""
        entry, found = self.root(namespace), []
        append = found.append
        for offset in range(0, num_pages * page_bytes, page_bytes):
            entry = entry.children.get(token_bytes[offset:offset + page_bytes])
            if entry is None:
                break
            append(entry)
        return found

    # -- registration -----------------------------------------------------------------------------------------
    def register(self, parent: Entry, tokens: bytes, page: int) -> Entry | None:
        """Register ``page`` (full, holding ``tokens`` after ``parent``'s chain); None, with nothing changed,
        when the key is already taken (a duplicate or a hash collision): the page then stays private."""
        key = self.hash_page(parent.key, tokens)
        if key in self._by_key or tokens in parent.children or page in self._by_page:
            return None
        entry = Entry(key, parent, tokens, page, parent.namespace)
        self._by_key[key] = parent.children[tokens] = self._by_page[page] = entry
        return entry

    def unregister(self, entry: Entry) -> None:
        """Exact inverse of the `register` that returned ``entry``."""
        del self._by_key[entry.key], entry.parent.children[entry.tokens], self._by_page[entry.page]

    # -- evictable pages --------------------------------------------------------------------------------------
    @property
    def num_evictable(self) -> int:
        return len(self._stamps)

    def park(self, page: int, stamp: int | None = None) -> None:
        """``page`` (registered, no longer referenced) becomes the newest evictable page."""
        if stamp is None:
            stamp, self._next_stamp = self._next_stamp, self._next_stamp + 1
        self._stamps[page] = stamp
        heapq.heappush(self._heap, (stamp, page))
        if len(self._heap) > 2 * len(self._stamps) + 64:           # drop stale heap items (no logical change)
            self._heap = [(s, p) for p, s in self._stamps.items()]
            heapq.heapify(self._heap)

    def unpark(self, page: int) -> int:
        """``page`` is referenced again (adopted by a match); returns its stamp for `park(page, stamp)`."""
        return self._stamps.pop(page)

    def evict_oldest(self) -> tuple[Entry, int]:
        """Unregister the least recently parked page; returns ``(entry, stamp)`` for `restore_evicted`."""
        while True:
            stamp, page = heapq.heappop(self._heap)
            if self._stamps.get(page) == stamp:
                break
        del self._stamps[page]
        entry = self._by_page[page]
        self.unregister(entry)
        return entry, stamp

    def restore_evicted(self, entry: Entry, stamp: int) -> None:
        """Exact inverse of the `evict_oldest` that returned ``(entry, stamp)``."""
        self._by_key[entry.key] = entry.parent.children[entry.tokens] = self._by_page[entry.page] = entry
        self.park(entry.page, stamp)

    def restore(self, entries: list[Entry], eviction_order: list[int]) -> None:
        """Set the whole index (a snapshot being loaded; validated by the caller): entries, then the evictable
        pages in eviction order."""
        for entry in entries:
            self._by_key[entry.key] = entry.parent.children[entry.tokens] = self._by_page[entry.page] = entry
        for page in eviction_order:
            self.park(page)

    # -- views ------------------------------------------------------------------------------------------------
    def eviction_order(self) -> list[int]:
        """Evictable pages, the next to be evicted first."""
        return sorted(self._stamps, key=self._stamps.__getitem__)

    def entries(self) -> list[Entry]:
        """Registered entries in page order."""
        return [self._by_page[page] for page in sorted(self._by_page)]

    def state(self) -> tuple:
        """Everything that decides future behaviour (for fingerprints): entries (page, key, parent key, parent
        alive, tokens, namespace) and the eviction order."""
        return (tuple((e.page, e.key, e.parent.key, self.alive(e.parent), e.tokens, e.namespace)
                      for e in self.entries()), tuple(self.eviction_order()))

    def check_invariants(self, referenced: set[int], parked: set[int]) -> None:
        """AssertionError unless the three maps agree, evictable pages == the allocator's parked pages, and
        every registered page is referenced or evictable."""
        assert len(self._by_key) == len(self._by_page), "index maps differ in size"
        for page, entry in self._by_page.items():
            assert entry.page == page and self._by_key[entry.key] is entry, f"page {page}: index maps disagree"
            assert entry.parent.children.get(entry.tokens) is entry, f"page {page}: not its parent's child"
            assert page in referenced or page in parked, f"page {page}: registered but neither held nor evictable"
        assert set(self._stamps) == parked, (
            f"evictable pages {sorted(self._stamps)} != allocator's parked pages {sorted(parked)}")
        assert not parked & referenced, f"pages both referenced and evictable: {sorted(parked & referenced)}"
