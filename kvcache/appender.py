"""`Appender`: the cache side of appending, one object per cache: reserve the slots new tokens need, write their
K/V, publish the new lengths. Every append transaction (`kvcache.transaction`) reaches the cache's state through
it and nothing else.

Reserving records every change in a `Journal` (CacheFullError with nothing changed); writes save the bytes they
overwrite (in the journal, or as saved rows for the one-token-each shapes); `publish` is the commit: token ids,
prefix registration, the fault point "publish", then the lengths, after which nothing can fail.
"""
from collections import Counter

import numpy as np

from .checks import check_kv
from .core import CacheCore
from .journal import Journal
from .sequence import Sequence


class Appender:
    """The append operations of one `CacheCore` (``core.lock`` guards every metadata change; callers hold it
    around `reserve` / `reserve_slots` and `publish`)."""

    __slots__ = ("core", "config", "lock", "pool")

    def __init__(self, core: CacheCore):
        self.core, self.config, self.lock, self.pool = core, core.config, core.lock, core.pool

    # -- sequences --------------------------------------------------------------------------------------------
    def sequence(self, seq) -> Sequence:
        """The live sequence ``seq``, busy or not (TypeError / ValueError for a bad id)."""
        return self.core.sequence(seq)

    def fault(self, point: str) -> None:
        self.core.fault_hook(point)

    def check_kv(self, k, v, num_tokens: int | None = None, *, layered: bool = True):
        """`kvcache.checks.check_kv` for this cache's pool."""
        return check_kv(self.config, self.pool.check, k, v, num_tokens, layered=layered)

    # -- reserving ------------------------------------------------------------------------------------------
    def reserve(self, num_tokens: dict[int, int], journal: Journal) -> list[Sequence]:
        """Take every page the new tokens need (one allocation for the request), copy-on-write a shared partial
        last page, mark the sequences busy; every change goes to ``journal``. Returns the sequences, in the
        order of ``num_tokens``."""
        core, cfg = self.core, self.config
        plans = []
        for seq, count in num_tokens.items():
            s = core.idle_sequence(seq)
            new_logical = cfg.pages_for(s.length + count)
            shared_tail = (count > 0 and s.length % cfg.page_size != 0
                           and core.needs_copy(int(s.table[s.num_logical_pages - 1])))
            plans.append((s, new_logical, shared_tail))
        needed = sum(new - s.num_logical_pages + cow for s, new, cow in plans)
        ever = needed <= core.num_free_pages or self._could_ever_fit(plans)
        fresh = iter(core.take_pages(needed, ever, "append", journal))
        for s, new_logical, shared_tail in plans:
            s.busy = True
            journal.record(lambda s=s: setattr(s, "busy", False))
            if shared_tail:
                core.copy_on_write(s, s.num_logical_pages - 1, next(fresh), journal)
            old_count = s.num_logical_pages
            s.reserve_table(new_logical)
            s.table[old_count:new_logical] = [next(fresh) for _ in range(new_logical - old_count)]
            s.num_logical_pages = new_logical
            journal.record(lambda s=s, n=old_count: setattr(s, "num_logical_pages", n))
        return [s for s, _, _ in plans]

    def reserve_slots(self, seqs: list[int]) -> tuple[list[Sequence], Journal | None]:
        """One token's slot at position ``length`` of each of ``seqs`` (distinct), the lean way: only the
        sequences whose last page is full (or shared: copy-on-write) take a page; the others are just marked
        busy. Returns the sequences and the journal of the reservation (None when no page was taken)."""
        core = self.core
        sequences = core.idle_sequences(seqs)
        need = {seq: 1 for seq, s in zip(seqs, sequences) if self.needs_page(s)}
        journal = None
        if need:
            if len(need) < len(seqs) and len(need) > core.num_free_pages:
                need = dict.fromkeys(seqs, 1)   # the whole request's CacheFullError (could-ever-fit counts all)
            journal = self.reserve_journaled(need)[1]
        for s in sequences:
            s.busy = True
        return sequences, journal

    def reserve_slot(self, seq) -> tuple[Sequence, Journal | None]:
        """`reserve_slots` of one sequence (the decode step: one lookup; no page, no journal unless needed)."""
        s = self.core.idle_sequence(seq)
        if self.needs_page(s):
            return s, self.reserve_journaled({seq: 1})[1]
        s.busy = True
        return s, None

    def needs_page(self, s: Sequence) -> bool:
        """Whether one more token of ``s`` takes a page: its last page is full, or shared (copy-on-write)."""
        return s.length % self.config.page_size == 0 or self.core.needs_copy(int(s.table[s.num_logical_pages - 1]))

    def reserve_journaled(self, num_tokens: dict[int, int]) -> tuple[list[Sequence], Journal]:
        """`reserve` into a new journal, undone before the exception propagates; returns (sequences, journal)."""
        journal = Journal()
        try:
            return self.reserve(num_tokens, journal), journal
        except BaseException:
            journal.rollback()
            raise

    def _could_ever_fit(self, plans) -> bool:
        """Whether a request fits once every other sequence is freed: the distinct pages its sequences hold
        (pages shared by forked siblings count once), their new pages, and the copies a partial last page shared
        among them still needs (one shared only with other sequences needs none once those are gone)."""
        holders = Counter(page for s, _, _ in plans for page in s.live_pages().tolist())
        new = sum(new_logical - s.num_logical_pages for s, new_logical, _ in plans)
        copies = sum(1 for s, _, cow in plans if cow and holders[int(s.table[s.num_logical_pages - 1])] > 1)
        return len(holders) + new + copies <= self.config.num_pages

    # -- writing --------------------------------------------------------------------------------------------
    def write(self, layer: int, s: Sequence, start: int, k: np.ndarray, v: np.ndarray, journal: Journal) -> None:
        """Store checked ``k [T, num_kv_heads, head_dim]``, ``v [T, num_kv_heads, head_dim_v]`` at positions
        ``start ..`` of ``s`` in ``layer``, a page chunk at a time, the overwritten bytes saved in ``journal``."""
        size, table, pool, hook = self.config.page_size, s.table, self.pool, self.core.fault_hook
        done, total = 0, k.shape[0]
        while done < total:
            position = start + done
            offset = position % size
            count = min(size - offset, total - done)
            pool.write(layer, table[position // size], offset, k[done:done + count].swapaxes(0, 1),
                       v[done:done + count].swapaxes(0, 1), hook, journal)        # [H, count, D]
            done += count

    def slot_rows(self, page: int, offset: int) -> tuple:
        """One slot in every layer (`PagePool.slot_rows`): ``(views, page, offset)``, to save, then `write_token`."""
        return self.pool.slot_rows(page, offset)

    def write_token(self, slot: tuple, layer: int, k: np.ndarray, v: np.ndarray) -> None:
        """Store one token's checked ``k [num_kv_heads, head_dim]``, ``v [num_kv_heads, head_dim_v]`` in
        ``layer`` of ``slot`` (`slot_rows`; the caller saved its bytes)."""
        self.pool.write_token(slot, layer, k, v, self.core.fault_hook)

    def write_rows(self, layer: int, pages: np.ndarray, offsets: np.ndarray, k: np.ndarray, v: np.ndarray,
                   saved: list) -> None:
        """Store one token per row, checked ``k [B, num_kv_heads, head_dim]`` at slot ``offsets[b]`` of
        ``pages[b]`` (one scatter per array), the old rows appended to ``saved`` (`restore_rows` undoes it)."""
        self.pool.write_rows(layer, pages, offsets, k, v, self.core.fault_hook, saved)

    def restore_rows(self, saved: list) -> None:
        self.pool.restore_rows(saved)

    # -- publishing -----------------------------------------------------------------------------------------
    def publish(self, sequences: list[Sequence], counts: list[int], starts: list[int],
                token_ids: list | None = None) -> None:
        """The commit of ``counts[b]`` tokens of ``sequences[b]`` written from ``starts[b]`` on: store the token
        ids (``token_ids[b]`` or None), register pages that became full with known ids (prefix caching), the
        fault point "publish", then the new lengths (nothing after the fault point can fail); a failure before
        the lengths change undoes its own work."""
        core = self.core
        journal, known = Journal(), []
        try:
            for b, s in enumerate(sequences):
                ids = None if token_ids is None else token_ids[b]
                start = starts[b]
                known.append(start + counts[b] if ids is not None and s.num_known == start else s.num_known)
                if ids is not None:
                    s.store_tokens(start, ids)                  # beyond num_known: not visible yet
                if core.index is not None:
                    self._register_full_pages(s, known[b], journal)
            core.fault_hook("publish")
        except BaseException:
            journal.rollback()
            raise
        for b, s in enumerate(sequences):
            s.length, s.num_known = starts[b] + counts[b], known[b]
            s.busy = False
            for page in s.held:
                core.decref(page, None)
            s.held.clear()
        core.clear_freed()

    def _register_full_pages(self, s: Sequence, known: int, journal: Journal) -> None:
        """Extend ``s.chain`` over every page full of known token ids; register each page whose content no entry
        holds yet (an entry holding it already becomes the chain's link: a duplicate page stays private)."""
        core, index, size = self.core, self.core.index, self.config.page_size
        while len(s.chain) < known // size:
            logical = len(s.chain)
            parent = s.chain[logical - 1] if logical else index.root(s.namespace)
            tokens = s.tokens[logical * size:(logical + 1) * size].tobytes()
            entry = None
            if index.alive(parent):
                entry = index.lookup(parent, tokens)
                page = int(s.table[logical])
                if entry is None and page >= 0 and not index.holds(page):
                    core.fault_hook("register")
                    entry = index.register(parent, tokens, page)
                    if entry is not None:
                        journal.record(lambda entry=entry: index.unregister(entry))
            s.chain.append(entry)
            journal.record(s.chain.pop)
