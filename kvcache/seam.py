"""`AppendSeam`: the one internal interface between a `KVCache` and its append paths (`Transaction`,
`TokenWrite`).

The cache builds one seam of bound methods at construction and hands it to every transaction and token write;
they reach the cache's state only through it (never through the cache's private names). The contract of each
call:

``lock``                                      the cache's re-entrant metadata lock (hold it around reserve and
                                              publish)
``idle_sequence(seq) -> Sequence``            the live sequence with no open transaction (ValueError/TypeError
                                              for a bad id, RuntimeError for a busy one)
``idle_sequences(seqs) -> list[Sequence]``    `idle_sequence` of each (one dict lookup each when all are fine)
``sequence(seq) -> Sequence``                 the live sequence, busy or not
``needs_copy(page) -> bool``                  whether a write into ``page`` must copy it first (shared with
                                              another sequence, or registered in the prefix index: immutable)
``reserve(num_tokens, journal)``              take every page the new tokens need (copy-on-write of a shared
                                              partial last page), mark the sequences busy; every change is
                                              recorded in ``journal``; CacheFullError with nothing changed
``write(layer, seq, start, k, v, journal)``   store ``k [T, num_kv_heads, head_dim]``, ``v [T, ..., head_dim_v]``
                                              (storage dtype, checked) at positions ``start ..`` of ``seq``,
                                              saving the overwritten bytes in ``journal``
``slot_rows(page, offset) -> slot``           one slot in every layer: ``(views, page, offset)``, the views
                                              ``[num_layers, num_kv_heads, width]`` of every page array (k, v;
                                              int8: the scales too) to save, see `PagePool.slot_rows`
``write_token(slot, layer, k, v)``            store one token's ``k [num_kv_heads, head_dim]``, ``v`` into
                                              ``layer`` of ``slot`` (the caller saved its bytes)
``write_rows(layer, pages, offsets, k, v, saved)``  store one token per row ``k [B, num_kv_heads, head_dim]``
                                              at slot ``offsets[b]`` of ``pages[b]``, saving the old rows in
                                              ``saved``; ``restore_rows(saved)`` undoes it
``publish(num_tokens, start, token_ids)``     the commit: register pages that became full with known token ids
                                              (prefix caching), then the fault point "publish", then the new
                                              lengths; a failure before the lengths change undoes its own work
``fault(point)``                              the cache's current fault hook (tests)
"""
from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True, slots=True)
class AppendSeam:
    lock: object
    idle_sequence: Callable
    idle_sequences: Callable
    sequence: Callable
    needs_copy: Callable
    reserve: Callable
    write: Callable
    slot_rows: Callable
    write_token: Callable
    write_rows: Callable
    restore_rows: Callable
    publish: Callable
    fault: Callable
