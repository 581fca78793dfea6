"""KV memory accounting: the formula and what a `KVCache` allocates and uses (no measuring here: the resident
memory measurement, `memory_report`, is a program, `decode.app.measure_memory`).

    formula bytes = layers * batch * tokens * kv_heads * (head_dim + head_dim_v) * bytes_per_element
                  = 2 * layers * batch * tokens * kv_heads * head_dim * bytes_per_element   (head_dim_v == head_dim)

bytes_per_element: 8 float64, 4 float32, 2 float16 and bfloat16 (`kvcache.bf16`: uint16 bits), 1 int8. int8
storage (`kvcache.quant`) stores 1 byte per element plus a float16 scale per 32 values of each row:

    scale bytes   = layers * batch * tokens * kv_heads * (ceil(head_dim / 32) + ceil(head_dim_v / 32)) * 2
    formula bytes = the formula above with bytes_per_element = 1, plus the scale bytes  (6.25% at head_dim 128)

- `kv_bytes_formula` -- the formula above (an int); `kv_scale_bytes_formula` -- the int8 scale bytes.
- `cache_memory(cache)` -- accounting of one live cache (a dict of ints): formula bytes of the tokens it holds,
  allocated pool bytes, bytes in used pages, tail-page waste, metadata estimate.
- `attention_kind(num_q_heads, kv_heads)` -- "MHA", "GQA-<n>" or "MQA".

Shared pages (forks) are counted once: ``formula_bytes`` of `cache_memory` is over *distinct* stored tokens
(a token slot of a page shared by several sequences counts once), so ``used = formula + tail waste`` holds
exactly; ``logical_tokens`` / ``formula_bytes_logical`` give the per-sequence sum a cache without sharing
would need.
"""
from __future__ import annotations

import sys

from .cache import KVCache, core_of
from .checks import check_instance, check_int

__all__ = ["GIB", "MIB", "kv_bytes_formula", "kv_scale_bytes_formula", "cache_memory", "attention_kind"]

GIB = 1024 ** 3
MIB = 1024 ** 2


def kv_bytes_formula(layers: int, batch: int, tokens: int, kv_heads: int, head_dim: int, bytes_per_element: int,
                     head_dim_v: int | None = None) -> int:
    """``layers * batch * tokens * kv_heads * (head_dim + head_dim_v) * bytes_per_element`` (``tokens`` may
    be 0; ``head_dim_v`` defaults to ``head_dim``, giving the familiar ``2 * ...``)."""
    layers, batch = check_int("layers", layers, minimum=1), check_int("batch", batch, minimum=1)
    tokens, kv_heads = check_int("tokens", tokens, minimum=0), check_int("kv_heads", kv_heads, minimum=1)
    head_dim = check_int("head_dim", head_dim, minimum=1)
    head_dim_v = head_dim if head_dim_v is None else check_int("head_dim_v", head_dim_v, minimum=1)
    bytes_per_element = check_int("bytes_per_element", bytes_per_element, minimum=1)
    return layers * batch * tokens * kv_heads * (head_dim + head_dim_v) * bytes_per_element


def kv_scale_bytes_formula(layers: int, batch: int, tokens: int, kv_heads: int, head_dim: int,
                           head_dim_v: int | None = None) -> int:
    """Bytes of the float16 scales of int8 storage: ``layers * batch * tokens * kv_heads * (ceil(head_dim / 32)
    + ceil(head_dim_v / 32)) * 2`` (one scale per 32 values of each K and V row, `kvcache.quant`)."""
    from . import quant

    layers, batch = check_int("layers", layers, minimum=1), check_int("batch", batch, minimum=1)
    tokens, kv_heads = check_int("tokens", tokens, minimum=0), check_int("kv_heads", kv_heads, minimum=1)
    head_dim = check_int("head_dim", head_dim, minimum=1)
    head_dim_v = head_dim if head_dim_v is None else check_int("head_dim_v", head_dim_v, minimum=1)
    groups = quant.num_groups(head_dim) + quant.num_groups(head_dim_v)
    return layers * batch * tokens * kv_heads * groups * quant.SCALE_DTYPE.itemsize


def attention_kind(num_q_heads: int, kv_heads: int) -> str:
    """"MHA" (as many KV heads as query heads), "MQA" (one), otherwise "GQA-<kv_heads>"."""
    if kv_heads == num_q_heads:
        return "MHA"
    return "MQA" if kv_heads == 1 else f"GQA-{kv_heads}"


# -- one live cache -----------------------------------------------------------------------------------------
def cache_memory(cache: KVCache) -> dict:
    """Accounting of ``cache`` now (all ints, bytes unless named otherwise).

    ``formula_bytes``          formula over the distinct token slots held (shared pages counted once)
    ``formula_bytes_logical``  formula over the sum of the sequences' held tokens (what no sharing would need)
    ``allocated_bytes``        the preallocated K/V arrays (``KVCache.pool.nbytes``; virtual, lazily backed)
    ``used_bytes``             pages taken from the free list (mapped by sequences or reserved by open
                               transactions) x bytes per page
    ``tail_waste_bytes``       ``used_bytes - formula_bytes``: slots of used pages that hold no token (mostly
                               the unfilled end of each sequence's last page; also reserved, uncommitted slots)
    ``cached_bytes``           prefix caching: registered pages no sequence holds (kept for reuse, evictable)
    ``free_bytes``             ``allocated_bytes - used_bytes - cached_bytes``
    ``metadata_bytes``         estimate of the bookkeeping: page tables, ref counts, free list, sequence records
                               (``sys.getsizeof`` of the containers and ``nbytes`` of the arrays; the int
                               objects in Python lists are not counted separately)
    """
    check_instance("cache", cache, KVCache, "a KVCache")
    cfg, core = cache.config, core_of(cache)
    with core.lock:                                         # one consistent snapshot
        alloc = core.allocator
        sequences = dict(core.sequences)
        page_fill: dict[int, int] = {}                      # page -> slots holding a token, over all holders
        logical_tokens = 0
        page_tables = 0
        for s in sequences.values():
            logical_tokens += s.length - s.first_live_page * cfg.page_size
            for logical in range(s.first_live_page, cfg.pages_for(s.length)):
                page = int(s.table[logical])
                fill = min(cfg.page_size, s.length - logical * cfg.page_size)
                page_fill[page] = max(page_fill.get(page, 0), fill)
            page_tables += sys.getsizeof(s) + s.table.nbytes + sys.getsizeof(s.held)
        pages_free = alloc.num_free_pages
        pages_cached = alloc.num_parked
        ref_counts, free_list = alloc.metadata_nbytes()
        registry = sys.getsizeof(core.sequences)
    pages_used = cfg.num_pages - pages_free - pages_cached
    distinct_tokens = sum(page_fill.values())
    formula = distinct_tokens * cfg.bytes_per_token
    used = pages_used * cfg.bytes_per_page
    allocated = cache.pool.nbytes
    return {
        "num_sequences": len(sequences),
        "logical_tokens": logical_tokens,
        "distinct_tokens": distinct_tokens,
        "bytes_per_token": cfg.bytes_per_token,
        "num_pages": cfg.num_pages,
        "pages_used": pages_used,
        "pages_free": pages_free,
        "pages_cached": pages_cached,
        "formula_bytes": formula,
        "formula_bytes_logical": logical_tokens * cfg.bytes_per_token,
        "allocated_bytes": allocated,
        "used_bytes": used,
        "tail_waste_bytes": used - formula,
        "cached_bytes": pages_cached * cfg.bytes_per_page,
        "free_bytes": allocated - used - pages_cached * cfg.bytes_per_page,
        "metadata_bytes": page_tables + ref_counts + free_list + registry,
        "metadata_detail": {"page_tables": page_tables, "ref_counts": ref_counts, "free_list": free_list,
                            "sequence_registry": registry},
    }
