"""Page accounting over the engine's one shared pool (nano-vllm's block manager, vLLM's kv_cache_manager):
how many pages a request's next chunk takes, attaching a request to a pool sequence (from the longest cached
prefix of its tokens), releasing it, the pool's counters and the invariant check.

A page is *clean free*, *cached* (registered by prefix caching, referenced by no sequence, evictable, least
recently released first) or *referenced*. What an append can take is clean + cached (`available`); "pages in
use" is referenced + cached, so when no request runs, pages in use == prefix-cached pages.
"""
from decode import Decoder
from kvcache import KVCache


class PagePool:
    """The engine's `kvcache.KVCache` (all layers) and the page arithmetic of the scheduler.

    Parameters
    ----------
    num_layers, num_kv_heads, head_dim, num_q_heads : the model's attention shape
    num_pages, page_size : pool size
    dtype : storage dtype ("float16" | "float32" | "float64" | "int8")
    prefix_caching : register full pages by token ids; admissions start from the longest cached prefix
    scale : the attention score scale of the model's layers
    namespace : prefix namespace (the model's name: two models never share pages)
    """

    def __init__(self, *, num_layers, num_kv_heads, head_dim, num_q_heads, num_pages, page_size, dtype,
                 prefix_caching, scale, namespace=""):
        self.cache = KVCache(num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype,
                             page_size=page_size, num_pages=num_pages, prefix_caching=prefix_caching,
                             namespace=namespace)
        self.page_size = page_size
        self.num_pages = num_pages
        self.num_q_heads = num_q_heads
        self.scale = scale
        self.prefix_caching = prefix_caching

    # -- arithmetic -------------------------------------------------------------------------------------------
    def pages_for(self, tokens: int) -> int:
        return -(-tokens // self.page_size)

    @property
    def available(self) -> int:
        """Pages an append can take now: clean free + cached (evictable)."""
        return self.cache.num_free_pages

    def new_pages(self, request, count: int) -> int:
        """Pages appending ``count`` tokens to ``request``'s sequence takes from the pool: the pages its new
        length spills into, plus one copy-on-write copy when its partly filled last page is shared or
        registered (never the case for the engine's own sequences, counted so the arithmetic stays exact)."""
        length = request.num_computed
        need = self.pages_for(length + count) - self.pages_for(length)
        if length % self.page_size and request.decoder is not None:
            last = int(self.cache.pool.page_table(request.decoder.seq)[length // self.page_size])
            need += int(self.cache.pool.needs_copy(last))
        return need

    # -- sequences --------------------------------------------------------------------------------------------
    def attach(self, request) -> int:
        """Give ``request`` a pool sequence holding the longest cached prefix of its tokens (whole pages, at
        most all but one token); returns the number of tokens reused. Cached pages it reuses are adopted
        (referenced), none copied."""
        if self.prefix_caching:
            decoder, hit = Decoder.from_prefix(self.cache, self.num_q_heads, request.tokens, scale=self.scale)
        else:
            decoder, hit = Decoder.on_cache(self.cache, self.num_q_heads, scale=self.scale), 0
        request.decoder, request.num_computed = decoder, hit
        return hit

    def detach(self, request) -> None:
        """Give ``request``'s pages back (its registered pages stay cached); it then holds nothing."""
        if request.decoder is not None:
            decoder, request.decoder = request.decoder, None
            decoder.free()
        request.num_computed = 0

    # -- counters, checks -------------------------------------------------------------------------------------
    def stats(self) -> dict:
        clean = self.cache.pool.allocator.num_free_pages
        return {"pages_total": self.num_pages, "pages_in_use": self.num_pages - clean,
                "prefix_cached_pages": self.cache.num_cached_pages}

    def check_invariants(self, attached: list) -> None:
        """AssertionError unless the pool's own invariants hold, its sequences are exactly the attached
        requests' and each holds ``num_computed`` tokens."""
        self.cache.check_invariants()
        seqs = {r.decoder.seq: r for r in attached}
        assert set(self.cache.sequences) == set(seqs), (
            f"pool sequences {sorted(self.cache.sequences)} != the attached requests' {sorted(seqs)}")
        for seq, r in seqs.items():
            assert self.cache.length(seq) == r.num_computed, (
                f"request {r.request_id}: pool length {self.cache.length(seq)} != num_computed {r.num_computed}")
