"""`Decoder`: one sequence of a paged KV cache, decoded a token (or a block of tokens) at a time.

    dec = Decoder(num_q_heads=32, num_kv_heads=8, head_dim=128, dtype="float32", page_size=16, max_tokens=4096)
    out = dec.step(q, k, v)        # q [num_q_heads, head_dim] -> [num_q_heads, head_dim_v]
    outs = dec.extend(q, k, v)     # q [T, num_q_heads, head_dim] -> [T, num_q_heads, head_dim_v]

Every call validates all of its input before the cache changes; after any error the decoder and its pool are
exactly as before. Inputs must be finite (after the cast to the storage dtype) and bounded in magnitude
(`decode.inputs.magnitude_limits`: |k|, |v| < 2**48 for float32 compute) so that no score overflows
(`decode.inputs`). Query ``i`` of a call sits at absolute position ``length + i`` and reads keys at positions
``<= length + i`` (and ``> position - window`` with a sliding window).
"""

import numpy as np

from kvcache import KVCache
from kvcache.checks import check_int

from . import window as _window
from .attention_plan import attend_token, pools_of
from .decoder_transaction import DecoderTransaction
from .inputs import (check_cache, check_decoder_args, check_single_layer, check_tokens, check_truncate, checks_for,
                     num_tokens_of)


class Decoder:
    """Decode one sequence over a paged KV cache.

    Parameters
    ----------
    num_q_heads, num_kv_heads, head_dim : int   num_q_heads must be a multiple of num_kv_heads (GQA / MQA)
    head_dim_v : int or None                    V head size (None: head_dim)
    dtype : "float16" | "float32" | "float64" | "int8" | "bfloat16"   storage dtype; outputs are float32
                                                (float64 for float64); int8 quantizes on write (`kvcache.quant`),
                                                bfloat16 rounds to nearest even (`kvcache.bf16`)
    page_size, max_tokens : int                 a private pool of ceil(max_tokens / page_size) pages
    scale : float or None                       score scale (None: 1 / sqrt(head_dim))
    window : int or None                        sliding window: position p reads keys in (p - window, p];
                                                pages wholly before every future window go back to the pool
    num_layers : int                            layers in the private pool (steps of several layers go
                                                through `transaction`)
    """

    def __init__(self, num_q_heads, num_kv_heads, head_dim, head_dim_v=None, dtype="float32", page_size=16,
                 max_tokens=4096, *, scale=None, window=None, num_layers=1):
        cache = KVCache(num_kv_heads=num_kv_heads, head_dim=head_dim, head_dim_v=head_dim_v, dtype=dtype,
                        page_size=page_size, max_tokens=max_tokens, num_layers=num_layers)
        self._attach(cache, cache.create_sequence, num_q_heads, scale, window)

    @classmethod
    def on_cache(cls, cache: KVCache, num_q_heads, *, scale=None, window=None) -> "Decoder":
        """A decoder of a new, empty sequence in an existing (shared) ``cache`` (continuous batching)."""
        check_cache(cache)
        self = cls.__new__(cls)
        self._attach(cache, cache.create_sequence, num_q_heads, scale, window)
        return self

    @classmethod
    def from_prefix(cls, cache: KVCache, num_q_heads, token_ids, *, namespace=None, scale=None,
                    window=None) -> tuple["Decoder", int]:
        """A decoder of a new sequence holding the longest prefix of ``token_ids [N]`` cached in ``cache`` (a
        `KVCache` with ``prefix_caching=True``), in whole pages, at most N - 1 tokens. Returns ``(decoder,
        num_hit)``: the remaining ``token_ids[num_hit:]`` are still to be computed (``extend(..., token_ids=
        token_ids[num_hit:])``)."""
        check_cache(cache)
        self, hit = cls.__new__(cls), []

        def new_seq():
            match = cache.match_prefix(token_ids, namespace=namespace)
            hit.append(match.num_tokens)
            return match.seq
        self._attach(cache, new_seq, num_q_heads, scale, window)
        return self, hit[0]

    @classmethod
    def on_sequence(cls, cache: KVCache, seq: int, num_q_heads, *, scale=None, window=None) -> "Decoder":
        """A decoder of the existing sequence ``seq`` of ``cache`` (a loaded snapshot's, say)."""
        check_cache(cache)
        cache.length(seq)                                        # names a bad id
        self = cls.__new__(cls)
        self._attach(cache, lambda: seq, num_q_heads, scale, window)
        return self

    def _attach(self, cache: KVCache, new_seq, num_q_heads, scale, window) -> None:
        """Check the arguments, then take the sequence ``new_seq()`` (so a bad argument leaves the cache as it was)."""
        num_q_heads, scale, self.window = check_decoder_args(cache.config, num_q_heads, scale, window)
        self.cache, self.seq = cache, new_seq()
        self.num_q_heads = num_q_heads
        self.scale = scale
        self._inputs = checks_for(self)            # the checks of this decoder's inputs (`decode.inputs`)
        self._pools = pools_of(cache)              # per-layer page views (`decode.attention_plan`)

    # -- state --------------------------------------------------------------------------------------------
    @property
    def config(self):
        return self.cache.config

    @property
    def length(self) -> int:
        """Tokens in the cache (the absolute position of the next token)."""
        return self.cache.length(self.seq)

    def kv(self, layer: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """Dense copies ``K [length, num_kv_heads, head_dim]``, ``V [length, num_kv_heads, head_dim_v]`` in the
        storage dtype (int8: dequantized to float32; bfloat16: widened to float32, exact; from `first_position`
        on, once a sliding window released older pages)."""
        return self.cache.gather(self.seq, layer)

    # -- single-layer API ---------------------------------------------------------------------------------
    def step(self, q, k, v, *, token_ids=None) -> np.ndarray:
        """Append one token's ``k [num_kv_heads, head_dim]``, ``v [num_kv_heads, head_dim_v]`` at position
        `length`, then return ``[num_q_heads, head_dim_v]``: ``q [num_q_heads, head_dim]`` attending over
        positions ``0 .. length`` (the new token included). ``token_ids``: the token's id (an int or ``[1]``),
        for prefix caching.

        The lean path: one jitted input check, the cache's single-token slot, the write and one kernel call."""
        check_single_layer(self.config, "step")
        q, k, v = self._inputs.token(q, k, v)
        token = self.cache.transaction(self.seq, token_ids=token_ids)
        try:
            out = attend_token(self, self._pools, token, 0, q, k, v)[0]
            token.commit()
        except BaseException:
            token.rollback()
            raise
        if self.window:
            _window.release_after_commit(self)
        return out

    def extend(self, q, k, v, *, token_ids=None) -> np.ndarray:
        """Append T tokens and attend with T queries: ``q [T, num_q_heads, head_dim]``,
        ``k [T, num_kv_heads, head_dim]``, ``v [T, num_kv_heads, head_dim_v]`` -> ``[T, num_q_heads, head_dim_v]``.
        Query i sits at position ``start + i`` (start = `length` before the call) and reads keys ``<= start + i``.
        ``token_ids [T]`` (optional): the tokens' ids, for prefix caching."""
        check_single_layer(self.config, "extend")
        count = num_tokens_of(k)
        checked = check_tokens([self], [count], q, k, v)              # every input checked before any reservation
        with self.transaction(count, token_ids=token_ids) as tx:
            return tx.extend(0, *checked, checked=True)

    def append(self, k, v, *, token_ids=None) -> None:
        """Append T tokens of K/V with no query (a prefill computed elsewhere): ``k [T, num_kv_heads, head_dim]``;
        ``token_ids [T]`` (optional) for prefix caching."""
        check_single_layer(self.config, "append")
        count = num_tokens_of(k)
        _, k, v = check_tokens([self], [count], None, k, v)          # checked before any reservation
        with self.transaction(count, token_ids=token_ids) as tx:
            tx.append(0, k, v, checked=True)

    # -- all layers ---------------------------------------------------------------------------------------
    def transaction(self, num_tokens: int = 1, *, token_ids=None) -> "DecoderTransaction":
        """Reserve ``num_tokens`` positions in every layer; write and attend layer by layer inside it::

            with dec.transaction(1) as tx:
                for layer in range(num_layers):
                    out = tx.step(layer, q[layer], k[layer], v[layer])

        The tokens become visible (``length`` grows) when the block exits normally; on any exception every
        layer's write is undone. ``token_ids [num_tokens]`` (optional): the tokens' ids, for prefix caching."""
        ids = None if token_ids is None else {self.seq: token_ids}
        return DecoderTransaction([self], {self.seq: check_int("num_tokens", num_tokens)}, ids)

    def truncate(self, n: int) -> None:
        """Prefix invalidation: keep positions ``[0, n)``; later appends write from ``n``."""
        n = check_truncate(n, self.length, self.window, self.cache.pool.first_position(self.seq))
        self.cache.truncate(self.seq, n)

    def fork(self) -> "Decoder":
        """A decoder of a new sequence sharing this one's pages (copy-on-write); both then go their own way."""
        child = type(self).__new__(type(self))
        child._attach(self.cache, lambda: self.cache.fork(self.seq), self.num_q_heads, self.scale, self.window or None)
        return child

    def free(self) -> None:
        """Give this sequence's pages back to the pool; the decoder is unusable afterwards."""
        self.cache.free(self.seq)

