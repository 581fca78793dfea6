"""The cache side of appending: reserve the pages new tokens need, write their K/V, publish the new lengths.

`append_seam(core)` hands these to `Transaction` and `TokenWrite` as a `kvcache.seam.AppendSeam` (see there for
the contract of each call).
"""
from collections import Counter
from functools import partial

import numpy as np

from .core import CacheCore
from .journal import Journal
from .seam import AppendSeam
from .sequence import Sequence


def append_seam(core: CacheCore) -> AppendSeam:
    """The seam of ``core`` for its transactions and token writes."""
    return AppendSeam(lock=core.lock, idle_sequence=core.idle_sequence, sequence=core.sequence,
                      needs_copy=core.needs_copy, reserve=partial(reserve, core), write=partial(write, core),
                      write_slot=partial(write_slot, core), publish=partial(publish, core), fault=core.fault)


def reserve(core: CacheCore, num_tokens: dict[int, int], journal: Journal) -> None:
    """Take every page the new tokens need, copy-on-write a shared partial last page; mark busy."""
    cfg = core.config
    plans = []
    for seq, count in num_tokens.items():
        s = core.idle_sequence(seq)
        new_logical = cfg.pages_for(s.length + count)
        shared_tail = (count > 0 and s.length % cfg.page_size != 0
                       and core.needs_copy(int(s.table[s.num_logical_pages - 1])))
        plans.append((seq, s, new_logical, shared_tail))
    needed = sum(new - s.num_logical_pages + cow for _, s, new, cow in plans)
    ever = needed <= core.num_free_pages or could_ever_fit(core, plans)
    fresh = iter(core.take_pages(needed, ever, "append", journal))
    for seq, s, new_logical, shared_tail in plans:
        s.busy = True
        journal.record(lambda s=s: setattr(s, "busy", False))
        if shared_tail:
            core.copy_on_write(s, s.num_logical_pages - 1, next(fresh), journal)
        old_count = s.num_logical_pages
        s.reserve_table(new_logical)
        s.table[old_count:new_logical] = [next(fresh) for _ in range(new_logical - old_count)]
        s.num_logical_pages = new_logical
        journal.record(lambda s=s, n=old_count: setattr(s, "num_logical_pages", n))


def could_ever_fit(core: CacheCore, plans) -> bool:
    """Whether a request fits once every other sequence is freed: the distinct pages its sequences hold (pages
    shared by forked siblings count once), their new pages, and the copies a partial last page shared among
    them still needs (one shared only with other sequences needs none once those are gone)."""
    holders = Counter(page for _, s, _, _ in plans for page in s.live_pages().tolist())
    new = sum(new_logical - s.num_logical_pages for _, s, new_logical, _ in plans)
    copies = sum(1 for _, s, _, cow in plans if cow and holders[int(s.table[s.num_logical_pages - 1])] > 1)
    return len(holders) + new + copies <= core.config.num_pages


def write(core: CacheCore, layer: int, seq: int, start: int, k: np.ndarray, v: np.ndarray, journal: Journal) -> None:
    """Write ``k [T, H, D]``, ``v [T, H, Dv]`` at positions ``start ..`` of ``seq`` in ``layer``, a page
    chunk at a time, saving the overwritten bytes."""
    size, table = core.config.page_size, core.sequences[seq].table
    done, total = 0, k.shape[0]
    while done < total:
        position = start + done
        offset = position % size
        count = min(size - offset, total - done)
        core.pool.write(layer, table[position // size], offset, k[done:done + count].swapaxes(0, 1),
                        v[done:done + count].swapaxes(0, 1), core.fault_hook, journal)   # [H, count, D]
        done += count


def write_slot(core: CacheCore, layer: int, page: int, offset: int, k: np.ndarray, v: np.ndarray, saved: list) -> None:
    """Write one token's ``k [num_kv_heads, head_dim]``, ``v [num_kv_heads, head_dim_v]`` at ``(page, offset)``
    of ``layer``, appending ``(view, old bytes)`` to ``saved``."""
    core.pool.write(layer, page, offset, k[:, None], v[:, None], core.fault_hook,
                    saved=saved)                                       # [num_kv_heads, 1, head_dim]


def publish(core: CacheCore, num_tokens: dict[int, int], start: dict[int, int], token_ids: dict | None = None) -> None:
    """Commit: store token ids, register pages that became full with known ids, the fault point "publish",
    then the lengths (nothing after the fault point can fail)."""
    journal, known = Journal(), {}
    try:
        for seq, count in num_tokens.items():
            s, ids = core.sequences[seq], (token_ids or {}).get(seq)
            known[seq] = start[seq] + count if ids is not None and s.num_known == start[seq] else s.num_known
            if ids is not None:
                s.store_tokens(start[seq], ids)                  # beyond num_known: not visible yet
            if core.index is not None:
                register_full_pages(core, s, known[seq], journal)
        core.fault_hook("publish")
    except BaseException:
        journal.rollback()
        raise
    for seq, count in num_tokens.items():
        s = core.sequences[seq]
        s.length, s.num_known = start[seq] + count, known[seq]
        s.busy = False
        for page in s.held:
            core.decref(page, None)
        s.held.clear()


def register_full_pages(core: CacheCore, s: Sequence, known: int, journal: Journal) -> None:
    """Extend ``s.chain`` over every page full of known token ids; register each page whose content no
    entry holds yet (an entry holding it already becomes the chain's link: a duplicate page stays private)."""
    index, size = core.index, core.config.page_size
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
