"""`Decoder`: one sequence of a paged KV cache, decoded a token (or a block of tokens) at a time.

    dec = Decoder(num_q_heads=32, num_kv_heads=8, head_dim=128, dtype="float32", page_size=16, max_tokens=4096)
    out = dec.step(q, k, v)        # q [num_q_heads, head_dim] -> [num_q_heads, head_dim_v]
    outs = dec.extend(q, k, v)     # q [T, num_q_heads, head_dim] -> [T, num_q_heads, head_dim_v]

Every call validates all of its input before the cache changes; after any error the decoder and its pool are
exactly as before. Inputs must be finite (after the cast to the storage dtype) and bounded in magnitude
(`decode._validate.magnitude_limits`: |k|, |v| < 2**48 for float32 compute) so that no score overflows. Query ``i`` of a call sits at absolute position ``length + i`` and reads keys at positions
``<= length + i`` (and ``> position - window`` with a sliding window).
"""
import math
import numbers

import numpy as np

from kvcache import KVCache
from kvcache.checks import as_float_array, cast_to_storage, check_int, check_shape

from ._validate import check_magnitude, first_bad_input, magnitude_limits, overflow_limit
from .attention import _paged_decode_attention_unchecked, plan_decode
from .multiquery import RunsPlan

# input dtypes the jitted check takes (numba types neither float16 nor long double nor byte-swapped arrays)
_JIT_FLOATS = frozenset((np.dtype(np.float32), np.dtype(np.float64)))


class Decoder:
    """Decode one sequence over a paged KV cache.

    Parameters
    ----------
    num_q_heads, num_kv_heads, head_dim : int   num_q_heads must be a multiple of num_kv_heads (GQA / MQA)
    head_dim_v : int or None                    V head size (None: head_dim)
    dtype : "float16" | "float32" | "float64" | "int8"   storage dtype; outputs are float32 (float64 for
                                                float64); int8 quantizes on write (`kvcache.quant`)
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
        if not isinstance(cache, KVCache):
            raise TypeError(f"cache: expected a kvcache.KVCache, got {type(cache).__name__}")
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
        if not isinstance(cache, KVCache):
            raise TypeError(f"cache: expected a kvcache.KVCache, got {type(cache).__name__}")
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
        if not isinstance(cache, KVCache):
            raise TypeError(f"cache: expected a kvcache.KVCache, got {type(cache).__name__}")
        cache.length(seq)                                        # names a bad id
        self = cls.__new__(cls)
        self._attach(cache, lambda: seq, num_q_heads, scale, window)
        return self

    def _attach(self, cache: KVCache, new_seq, num_q_heads, scale, window) -> None:
        """Check the arguments, then take the sequence ``new_seq()`` (so a bad argument leaves the cache as it was)."""
        cfg = cache.config
        num_q_heads = check_int("num_q_heads", num_q_heads, minimum=1)
        if num_q_heads % cfg.num_kv_heads:
            raise ValueError(f"num_q_heads: expected a multiple of num_kv_heads={cfg.num_kv_heads}, got {num_q_heads}")
        if scale is None:
            scale = 1.0 / np.sqrt(cfg.head_dim)
        elif isinstance(scale, (bool, np.bool_)) or not isinstance(scale, numbers.Real):
            raise TypeError(f"scale: expected a finite float > 0, got {type(scale).__name__} {scale!r}")
        elif not math.isfinite(scale) or scale <= 0:
            raise ValueError(f"scale: expected a finite float > 0, got {scale!r}")
        self.window = 0 if window is None else check_int("window", window, minimum=1)
        self.cache, self.seq = cache, new_seq()
        self.num_q_heads = num_q_heads
        self.scale = float(scale)
        self.q_dtype = np.dtype(np.float64 if cfg.dtype == np.float64 else np.float32)
        self._q_limit, self._kv_limit = magnitude_limits(self.q_dtype, cfg.head_dim, self.scale)
        self._limits = {}                                        # (q, k, v dtypes) -> limits of the jitted check
        self._q_shape = (num_q_heads, cfg.head_dim)
        self._k_shape = (cfg.num_kv_heads, cfg.head_dim)
        self._v_shape = (cfg.num_kv_heads, cfg.head_dim_v)
        self._query_seq1 = np.zeros(1, dtype=np.int32)          # kernel arguments of `step`, reused
        self._out_shape1 = (1, num_q_heads, cfg.head_dim_v)
        self._q_plan_shape = (1, num_q_heads, cfg.head_dim)
        self._k_pages = [cache.k_pages(layer) for layer in range(cfg.num_layers)]   # views; the pool never moves
        self._v_pages = [cache.v_pages(layer) for layer in range(cfg.num_layers)]
        self._k_scales = [cache.k_scales(layer) for layer in range(cfg.num_layers)]   # int8 only, else None
        self._v_scales = [cache.v_scales(layer) for layer in range(cfg.num_layers)]

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
        storage dtype (int8: dequantized to float32; from `first_position` on, once a sliding window released
        older pages)."""
        return self.cache.gather(self.seq, layer)

    # -- single-layer API ---------------------------------------------------------------------------------
    def step(self, q, k, v, *, token_ids=None) -> np.ndarray:
        """Append one token's ``k [num_kv_heads, head_dim]``, ``v [num_kv_heads, head_dim_v]`` at position
        `length`, then return ``[num_q_heads, head_dim_v]``: ``q [num_q_heads, head_dim]`` attending over
        positions ``0 .. length`` (the new token included). ``token_ids``: the token's id (an int or ``[1]``),
        for prefix caching.

        The lean path: one jitted input check, the cache's single-token slot, the write and one kernel call."""
        self._single_layer("step")
        q, k, v = self._check_token(q, k, v)
        token = self.cache.begin_token(self.seq, token_id=token_ids)
        try:
            out = self._attend_token(token, 0, q, k, v)[0]
            token.commit()
        except BaseException:
            token.rollback()
            raise
        if self.window:
            self._release_after_commit()
        return out

    def extend(self, q, k, v, *, token_ids=None) -> np.ndarray:
        """Append T tokens and attend with T queries: ``q [T, num_q_heads, head_dim]``,
        ``k [T, num_kv_heads, head_dim]``, ``v [T, num_kv_heads, head_dim_v]`` -> ``[T, num_q_heads, head_dim_v]``.
        Query i sits at position ``start + i`` (start = `length` before the call) and reads keys ``<= start + i``.
        ``token_ids [T]`` (optional): the tokens' ids, for prefix caching."""
        self._single_layer("extend")
        count = self._num_tokens(k)
        checked = check_tokens([self], [count], q, k, v)              # every input checked before any reservation
        with self.transaction(count, token_ids=token_ids) as tx:
            return tx.extend(0, *checked, checked=True)

    def append(self, k, v, *, token_ids=None) -> None:
        """Append T tokens of K/V with no query (a prefill computed elsewhere): ``k [T, num_kv_heads, head_dim]``;
        ``token_ids [T]`` (optional) for prefix caching."""
        self._single_layer("append")
        count = self._num_tokens(k)
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
        n = check_int("n", n, maximum=self.length)
        if self.window:
            needed = max(0, n - self.window + 1)
            if needed < self.cache.first_position(self.seq):
                raise ValueError(f"n: expected >= {self.cache.first_position(self.seq) + self.window - 1} "
                                 f"(K/V before position {self.cache.first_position(self.seq)} was released by the "
                                 f"sliding window), got {n}")
        self.cache.truncate(self.seq, n)

    def fork(self) -> "Decoder":
        """A decoder of a new sequence sharing this one's pages (copy-on-write); both then go their own way."""
        child = type(self).__new__(type(self))
        child._attach(self.cache, lambda: self.cache.fork(self.seq), self.num_q_heads, self.scale, self.window or None)
        return child

    def free(self) -> None:
        """Give this sequence's pages back to the pool; the decoder is unusable afterwards."""
        self.cache.free(self.seq)

    def _release_outside_window(self) -> None:
        """With a sliding window, give back the pages no future query can read (positions < length - window + 1)."""
        if self.window and self.length - self.window + 1 > self.cache.first_position(self.seq):
            self.cache.release_before(self.seq, self.length - self.window + 1)

    def _release_after_commit(self) -> None:
        """`_release_outside_window` once the tokens are committed: a failure now would report a failed call
        that changed the cache, so it is absorbed; the release is atomic (nothing was given back) and the next
        commit retries it."""
        try:
            self._release_outside_window()
        except Exception:
            pass

    def _attend_token(self, token, layer: int, q, k, v, plan=None) -> tuple[np.ndarray, tuple]:
        """Write one token's checked ``k``/``v`` into ``token``'s slot (`kvcache.TokenWrite`) in ``layer`` and
        attend with ``q [num_q_heads, head_dim]`` over positions ``.. token.position``.
        Returns ``(out [num_q_heads, head_dim_v], plan)``; ``plan`` (`_token_plan`) is computed on the first layer
        of a token and passed back in for the others."""
        token.write(layer, k, v)
        if plan is None:
            plan = self._token_plan(token)
        indices, indptr, qpos, decode_plan = plan
        out = np.empty(self._out_shape1, dtype=self.q_dtype)
        if decode_plan is None:                                   # int8 pages: their own kernel entry
            _paged_decode_attention_unchecked(q[None], self._k_pages[layer], self._v_pages[layer], indices, indptr,
                                              self._query_seq1, qpos, self.scale, self.window, out,
                                              k_scales=self._k_scales[layer], v_scales=self._v_scales[layer])
        else:
            decode_plan.run(q[None], self._k_pages[layer], self._v_pages[layer], indices, indptr, self._query_seq1,
                            qpos, self.scale, self.window, out)
        return out[0], plan

    def _token_plan(self, token) -> tuple:
        """What every layer of one token shares: ``(page table int32, indptr int64 [2], position int64 [1],
        DecodePlan or None for int8)``, checked once (no released page is visible)."""
        indices, position = token.pages(), token.position
        first = max(0, position - self.window + 1) if self.window else 0
        if indices[first // self.config.page_size] < 0:
            raise_released(self.cache, self.seq, first, position)
        indptr = np.array([0, len(indices)], dtype=np.int64)
        qpos = np.array([position], dtype=np.int64)
        if self._k_scales[0] is not None:
            return indices, indptr, qpos, None
        return indices, indptr, qpos, plan_decode(qpos, self.window, self._q_plan_shape, self._v_pages[0])

    # -- checks -------------------------------------------------------------------------------------------
    def _single_layer(self, what: str) -> None:
        if self.config.num_layers != 1:
            raise ValueError(f"{what}: expected a one-layer cache (use transaction() for several layers), "
                             f"got num_layers={self.config.num_layers}")

    def _num_tokens(self, k) -> int:
        shape = np.shape(k)
        if len(shape) != 3:
            raise ValueError(f"k: expected shape [T, num_kv_heads, head_dim], got {shape}")
        return shape[0]

    def _check_token(self, q, k, v):
        """One token's q/k/v checked (shape, float dtype, finite; k/v finite after the cast to storage; magnitudes
        within the compute dtype's safe range); q converted to the working precision."""
        if not (type(q) is type(k) is type(v) is np.ndarray and q.shape == self._q_shape
                and k.shape == self._k_shape and v.shape == self._v_shape
                and q.dtype in _JIT_FLOATS and k.dtype in _JIT_FLOATS and v.dtype in _JIT_FLOATS):
            return self._check_token_slowly(q, k, v)
        limits = self._limits.get((q.dtype, k.dtype, v.dtype)) or self._input_limits(q.dtype, k.dtype, v.dtype)
        if first_bad_input(q, k, v, *limits) >= 0:
            return self._check_token_slowly(q, k, v)                  # raises, naming the element
        # k/v stay in the caller's dtype: the write into the pool casts them (the limits made the cast safe)
        return q if q.dtype == self.q_dtype and q.flags.c_contiguous else np.ascontiguousarray(q, self.q_dtype), k, v

    def _input_limits(self, q_dtype, k_dtype, v_dtype) -> tuple[float, float]:
        """Magnitude limits of the jitted check for these input dtypes: finite after the cast (`overflow_limit`)
        and within the compute dtype's safe range (`magnitude_limits`); memoised per dtype triple."""
        kv_dtype = k_dtype if k_dtype.itemsize >= v_dtype.itemsize else v_dtype
        limits = (min(overflow_limit(q_dtype, self.q_dtype), self._q_limit),
                  min(overflow_limit(kv_dtype, self.config.dtype), self._kv_limit))
        self._limits[(q_dtype, k_dtype, v_dtype)] = limits
        return limits

    def _check_token_slowly(self, q, k, v):
        q, k, v = as_float_array("q", q), as_float_array("k", k), as_float_array("v", v)
        check_shape("q", q, self._q_shape, "[num_q_heads, head_dim]")
        check_shape("k", k, self._k_shape, "[num_kv_heads, head_dim]")
        check_shape("v", v, self._v_shape, "[num_kv_heads, head_dim_v]")
        given = q, k, v                                # errors name the caller's values at the caller's [H, D] index
        q = cast_to_storage("q", q, self.q_dtype)
        k, v = self.cache.check_storable("k", k), self.cache.check_storable("v", v)
        check_magnitude("q", given[0], self._q_limit, self.q_dtype)
        self._check_kv_magnitude(*given[1:])
        return np.ascontiguousarray(q), k, v

    def _check_kv_magnitude(self, k, v) -> None:
        check_magnitude("k", k, self._kv_limit, self.q_dtype)
        check_magnitude("v", v, self._kv_limit, self.q_dtype)

    def check_kv(self, k, v, num_tokens: int):
        """``k [T, num_kv_heads, head_dim]``, ``v [T, num_kv_heads, head_dim_v]`` validated (`KVCache.check_kv`,
        then the magnitude limits) and cast to the storage dtype."""
        given = np.asarray(k), np.asarray(v)
        k, v = self.cache.check_kv(*given, num_tokens, layered=False)
        self._check_kv_magnitude(*given)              # float arrays of the right shape by now; named as given
        return k, v

    def check_query(self, q, num_tokens: int) -> np.ndarray:
        """``q [T, num_q_heads, head_dim]`` validated (float, finite) and cast to the working precision."""
        given = q = as_float_array("q", q)
        check_shape("q", q, (num_tokens, self.num_q_heads, self.config.head_dim), "[T, num_q_heads, head_dim]")
        q = cast_to_storage("q", q, self.q_dtype)
        check_magnitude("q", given, self._q_limit, self.q_dtype)
        return np.ascontiguousarray(q)


class DecoderTransaction:
    """Tokens of one or more decoders (one pool) being written layer by layer; see `Decoder.transaction`.

    One token of one decoder goes through the cache's lean single-token path (`KVCache.begin_token`);
    anything larger through a general `kvcache.Transaction`. The slots are reserved when the transaction opens
    (from then on it owns its sequences: no truncate / fork / free / other transaction in between), before any
    layer's input exists; each per-layer call validates its input before it writes. The single-layer calls
    (`Decoder.step` / `extend` / `append`, `batch_extend`, `batch_step`) validate everything before they open
    one. What every layer shares (page tables, positions, the kernel's work partition) is computed by the first
    layer that attends and reused by the others."""

    def __init__(self, decoders: list[Decoder], num_tokens: dict[int, int], token_ids: dict | None = None):
        self.decoders = decoders
        self.cache = decoders[0].cache
        self.num_tokens = num_tokens
        self._single_token = len(decoders) == 1 and num_tokens[decoders[0].seq] == 1
        self._plans = {}                # number of queries -> (indices, indptr, DecodePlan or None), see `_attend`
        self._token_plan = None         # the one-token path's `Decoder._token_plan`
        if self._single_token:          # reserve (CacheFullError and bad ids leave everything as it was)
            self._tx = self.cache.begin_token(decoders[0].seq, token_id=(token_ids or {}).get(decoders[0].seq))
            self.start = [self._tx.position]
        else:
            self._tx = self.cache.transaction(num_tokens, token_ids=token_ids)
            self.start = [self._tx.start[d.seq] for d in decoders]
        self._open = True

    def __enter__(self) -> "DecoderTransaction":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.commit()
        else:
            self.rollback()

    def commit(self) -> None:
        """Publish the tokens (every layer must have been written); a no-op once committed."""
        if self._open:
            self._open = False
            self._tx.commit()
            if self.decoders[0].window:
                for d in self.decoders:
                    d._release_after_commit()

    def rollback(self) -> None:
        self._open = False
        self._tx.rollback()

    # -- per layer --------------------------------------------------------------------------------------------
    def append(self, layer: int, k, v, *, checked: bool = False) -> None:
        """Write one layer's K/V of every decoder, no query: ``k`` / ``v`` as in `extend`."""
        def run():
            _, ks, vs = (None, k, v) if checked else self.check_tokens(None, k, v)
            self._write_all(layer, ks, vs)
        self._guard(run)

    def extend(self, layer: int, q, k, v, *, checked: bool = False):
        """Write one layer's K/V of every decoder and attend with their queries, in one kernel call.

        Ragged form: ``q [N, num_q_heads, head_dim]``, ``k [N, num_kv_heads, head_dim]``,
        ``v [N, num_kv_heads, head_dim_v]`` with N = sum of the decoders' token counts, decoder 0's tokens first
        -> ``[N, num_q_heads, head_dim_v]``. List form: one ``[T_b, ...]`` array per decoder -> a list of
        ``[T_b, num_q_heads, head_dim_v]``. Query t of decoder b sits at position ``start[b] + t``.
        ``checked``: the arrays come from `check_tokens` (ragged, validated, cast) and are not checked again."""
        def run():
            qs, ks, vs = (q, k, v) if checked else self.check_tokens(q, k, v)
            self._write_all(layer, ks, vs)
            out = self._attend(layer, qs, self._query_seq(), self._query_pos())
            return split_ragged(out, self.counts) if isinstance(q, (list, tuple)) else out
        return self._guard(run)

    def check_tokens(self, q, k, v):
        """`check_tokens` for this transaction's decoders and token counts."""
        return check_tokens(self.decoders, self.counts, q, k, v)

    @property
    def counts(self) -> list[int]:
        """New tokens of each decoder, in decoder order."""
        return [self.num_tokens[d.seq] for d in self.decoders]

    def _write_all(self, layer: int, k: np.ndarray, v: np.ndarray) -> None:
        """Store checked ragged ``k [N, H, D]``, ``v [N, H, Dv]`` (storage dtype), decoder by decoder."""
        offset = 0
        for b, count in enumerate(self.counts):
            self._write(layer, b, k[offset:offset + count], v[offset:offset + count])
            offset += count

    def _query_seq(self) -> np.ndarray:
        """int32 [N]: the page-table row (decoder index) of each ragged query."""
        return np.repeat(np.arange(len(self.decoders), dtype=np.int32), self.counts)

    def _query_pos(self) -> np.ndarray:
        """int64 [N]: the absolute position of each ragged query (decoder b's start + t)."""
        counts = self.counts
        if len(counts) == 1:
            return np.arange(self.start[0], self.start[0] + counts[0], dtype=np.int64)
        return np.concatenate([np.arange(s, s + c, dtype=np.int64) for s, c in zip(self.start, counts)])

    def step(self, layer: int, q, k, v) -> np.ndarray:
        """One token per decoder: ``q [B, num_q_heads, head_dim]``, ``k [B, num_kv_heads, head_dim]``,
        ``v [B, num_kv_heads, head_dim_v]`` with B = number of decoders (the B axis may be dropped for one
        decoder) -> ``[B, num_q_heads, head_dim_v]``."""
        if self._single_token and np.ndim(q) == 2:
            return self._guard(lambda: self._step_one(layer, q, k, v))
        return self._guard(lambda: self._step_batch(layer, q, k, v))

    def _step_one(self, layer, q, k, v) -> np.ndarray:
        dec = self.decoders[0]
        q, k, v = dec._check_token(q, k, v)
        out, self._token_plan = dec._attend_token(self._tx, layer, q, k, v, self._token_plan)
        return out

    def _step_batch(self, layer, q, k, v, checked: bool = False) -> np.ndarray:
        count = len(self.decoders)
        if not checked:
            q = self.decoders[0].check_query(q, count)
            k, v = self.decoders[0].check_kv(k, v, count)               # [B, H, D]: one token per sequence
        for i in range(count):
            self._write(layer, i, k[i:i + 1], v[i:i + 1])
        return self._attend(layer, q, np.arange(count, dtype=np.int32), np.array(self.start, dtype=np.int64))

    # -- plumbing ---------------------------------------------------------------------------------------------
    def _guard(self, run):
        """Run one per-layer call; any failure rolls the whole transaction back before it propagates."""
        try:
            if not self._open:
                raise RuntimeError("transaction: expected an open transaction, got one already finished")
            return run()
        except BaseException:
            if self._open:
                self.rollback()
            raise

    def _write(self, layer: int, index: int, k: np.ndarray, v: np.ndarray) -> None:
        """Store checked ``k [T, H, D]``, ``v [T, H, Dv]`` (storage dtype) of decoder ``index`` in ``layer``."""
        if self._single_token:
            self._tx.write(layer, k[0], v[0])
        else:
            self._tx.write(layer, self.decoders[index].seq, k, v, checked=True)

    def _pages(self, index: int) -> np.ndarray:
        return self._tx.pages() if self._single_token else self._tx.pages(self.decoders[index].seq)

    def _attend(self, layer, q, query_seq, query_pos) -> np.ndarray:
        """One kernel call: ``q [num_queries, num_q_heads, head_dim]`` over the decoders' page tables. The tables
        (checked: no released page visible) and the work partition are made on the first layer and reused."""
        dec = self.decoders[0]
        plan = self._plans.get(len(q))
        if plan is None:
            plan = self._plans[len(q)] = self._plan(q, query_seq, query_pos)
        indices, indptr, decode_plan = plan
        out = np.empty((len(q), dec.num_q_heads, self.cache.config.head_dim_v), dtype=dec.q_dtype)
        if decode_plan is None:
            _paged_decode_attention_unchecked(q, dec._k_pages[layer], dec._v_pages[layer], indices, indptr,
                                              query_seq, query_pos, dec.scale, dec.window, out,
                                              k_scales=dec._k_scales[layer], v_scales=dec._v_scales[layer])
        else:
            decode_plan.run(q, dec._k_pages[layer], dec._v_pages[layer], indices, indptr, query_seq, query_pos,
                            dec.scale, dec.window, out)
        return out

    def _plan(self, q, query_seq, query_pos) -> tuple:
        """``(indices int32, indptr int64, plan)``: plan a DecodePlan (one query per sequence), a RunsPlan (the tiled multi-query
        kernel's runs and partition) when every query is in a run of several queries of one sequence; None where
        the wrapper decides per call (int8 pages, a mix of runs and single queries)."""
        dec = self.decoders[0]
        tables = [self._pages(i) for i in range(len(self.decoders))]
        size = self.cache.config.page_size
        for i, table in enumerate(tables):        # every decoder's first query reads from lo on (if it has one)
            first = max(0, self.start[i] - dec.window + 1) if dec.window else 0
            if len(q) and self.num_tokens[self.decoders[i].seq] and table[first // size] < 0:
                raise_released(self.cache, self.decoders[i].seq, first, self.start[i])
        if len(tables) == 1:
            indices, indptr = tables[0], np.array([0, len(tables[0])], dtype=np.int64)
        else:
            indices = np.concatenate(tables)
            indptr = np.zeros(len(tables) + 1, dtype=np.int64)
            np.cumsum([len(t) for t in tables], out=indptr[1:])
        one_per_sequence = len(q) <= len(self.decoders) and max(self.counts) <= 1
        if dec._k_scales[0] is not None or not len(q):
            return indices, indptr, None
        if one_per_sequence:
            return indices, indptr, plan_decode(query_pos, dec.window, q.shape, dec._v_pages[0])
        runs = RunsPlan(query_seq, query_pos, dec.window, q.shape, dec._v_pages[0])
        return indices, indptr, (runs if len(runs.rest) == 0 else None)


def raise_released(cache: KVCache, seq: int, first: int, position: int):
    """Raise: the query at ``position`` would read positions ``first ..`` of which some were given back by
    `KVCache.release_before` (a -1 in the page table; the unchecked kernel would index the pool with it)."""
    raise ValueError(f"seq: expected K/V held for positions {first}..{position} (read by the query at position "
                     f"{position}), got positions < {cache.first_position(seq)} released (KVCache.release_before)")


def check_tokens(decoders, counts, q, k, v):
    """Validate new tokens of ``decoders`` (``counts[b]`` for decoder b): ragged arrays or one array per
    decoder, as in `DecoderTransaction.extend`; q may be None -> ragged ``q [N, num_q_heads, head_dim]``
    (working precision; None if q is), ``k``, ``v`` (storage dtype). Errors of the list form name the element
    (``q[1]: ...``), of the ragged form the ragged index."""
    dec = decoders[0]
    if not any(isinstance(x, (list, tuple)) for x in (q, k, v)):
        total = sum(counts)
        return (None if q is None else dec.check_query(q, total)), *dec.check_kv(k, v, total)
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x is None and name == "q":
            continue
        if not isinstance(x, (list, tuple)):
            raise TypeError(f"{name}: expected a list of {len(counts)} arrays (one per decoder, like the other "
                            f"inputs), got {type(x).__name__}")
        if len(x) != len(counts):
            raise ValueError(f"{name}: expected {len(counts)} arrays (one per decoder), got {len(x)}")
    parts = ([], [], [])
    for b, count in enumerate(counts):
        try:
            if q is not None:
                parts[0].append(dec.check_query(q[b], count))
            kb, vb = dec.check_kv(k[b], v[b], count)
        except (TypeError, ValueError) as e:
            msg = str(e)
            raise type(e)(f"{msg[0]}[{b}]{msg[1:]}" if msg[1:2] == ":" else msg) from None
        parts[1].append(kb)
        parts[2].append(vb)
    return tuple(np.concatenate(p) if p else None for p in parts)


def split_ragged(x: np.ndarray, counts) -> list:
    """``x [sum(counts), ...]`` -> a list of ``[counts[b], ...]`` views."""
    return np.split(x, np.cumsum(counts)[:-1])


def batch_transaction(decoders, num_tokens=None, *, token_ids=None) -> DecoderTransaction:
    """New tokens for each of ``decoders`` (distinct sequences of one shared pool), written layer by layer:
    one each (``num_tokens`` None: ``tx.step(layer, q, k, v)`` decodes all of them in one kernel call) or
    ``num_tokens[b]`` >= 0 for decoder b (``tx.extend(layer, q, k, v)``, ragged or lists, see
    `DecoderTransaction.extend`). Every page is reserved here; all or none of the tokens land.
    ``token_ids`` (optional, for prefix caching): one id per decoder (``[B]``) for one token each, else one
    ``[T_b]`` array per decoder or a ragged ``[N]`` array."""
    decoders = _check_decoders(decoders)
    counts = _check_counts(decoders, num_tokens)
    return DecoderTransaction(decoders, counts, _token_ids(decoders, counts, num_tokens is None, token_ids))


def _token_ids(decoders, counts: dict, one_each: bool, token_ids):
    """``token_ids`` as {seq: ids} (None stays None); see `batch_transaction`."""
    if token_ids is None:
        return None
    seqs = [d.seq for d in decoders]
    if one_each:
        if np.ndim(token_ids) != 1 or len(token_ids) != len(seqs):
            raise ValueError(f"token_ids: expected one token id per decoder ({len(seqs)}), got shape "
                             f"{np.shape(token_ids)}")
        return {seq: [token_ids[i]] for i, seq in enumerate(seqs)}
    sizes = [counts[seq] for seq in seqs]
    if isinstance(token_ids, (list, tuple)):
        if len(token_ids) != len(seqs):
            raise ValueError(f"token_ids: expected {len(seqs)} id arrays (one per decoder), got {len(token_ids)}")
        for b, (ids, n) in enumerate(zip(token_ids, sizes)):
            if np.ndim(ids) != 1 or len(ids) != n:
                raise ValueError(f"token_ids[{b}]: expected {n} token ids, got shape {np.shape(ids)}")
        return dict(zip(seqs, token_ids))
    if np.ndim(token_ids) != 1 or len(token_ids) != sum(sizes):
        raise ValueError(f"token_ids: expected {sum(sizes)} token ids (ragged, decoder 0's first), got shape "
                         f"{np.shape(token_ids)}")
    return dict(zip(seqs, split_ragged(np.asarray(token_ids), sizes)))


def _check_decoders(decoders) -> list:
    decoders = list(decoders) if isinstance(decoders, (list, tuple)) else decoders
    if not isinstance(decoders, list) or not decoders or not all(isinstance(d, Decoder) for d in decoders):
        raise TypeError(f"decoders: expected a non-empty list of Decoder, got {decoders!r}")
    first = decoders[0]
    for d in decoders[1:]:
        if d.cache is not first.cache:
            raise ValueError("decoders: expected decoders sharing one cache (Decoder.on_cache), got several caches")
        if (d.num_q_heads, d.scale, d.window) != (first.num_q_heads, first.scale, first.window):
            raise ValueError(f"decoders: expected one num_q_heads/scale/window, got "
                             f"{(first.num_q_heads, first.scale, first.window)} and {(d.num_q_heads, d.scale, d.window)}")
    seqs = [d.seq for d in decoders]
    if len(set(seqs)) != len(seqs):
        raise ValueError(f"decoders: expected distinct sequences, got sequence ids {seqs}")
    return decoders


def _check_counts(decoders, num_tokens) -> dict:
    if num_tokens is None:
        return {d.seq: 1 for d in decoders}
    if isinstance(num_tokens, np.ndarray):
        num_tokens = num_tokens.tolist()
    if not isinstance(num_tokens, (list, tuple)) or len(num_tokens) != len(decoders):
        raise ValueError(f"num_tokens: expected {len(decoders)} token counts (one per decoder), got {num_tokens!r}")
    return {d.seq: check_int(f"num_tokens[{b}]", n) for b, (d, n) in enumerate(zip(decoders, num_tokens))}


def batch_extend(decoders, q, k, v, num_tokens=None, *, token_ids=None):
    """Append each decoder's own number of new tokens and attend with their queries, in one kernel call
    (batched prefill, speculative verification of several sequences) on a one-layer pool.

    List form (``num_tokens`` None): ``q[b] [T_b, num_q_heads, head_dim]``, ``k[b] [T_b, num_kv_heads,
    head_dim]``, ``v[b] [T_b, num_kv_heads, head_dim_v]`` -> a list of ``[T_b, num_q_heads, head_dim_v]``.
    Ragged form: ``q [N, num_q_heads, head_dim]`` etc. with ``num_tokens = [T_0, T_1, ...]`` (N = their sum,
    decoder 0's tokens first) -> ``[N, num_q_heads, head_dim_v]``. Query t of decoder b sits at position
    ``length_b + t``. Everything is validated before any page is reserved; all or none of the tokens land.
    ``token_ids`` (optional, for prefix caching): one ``[T_b]`` array per decoder or a ragged ``[N]`` array.
    Several layers: `batch_transaction(decoders, num_tokens)` and ``tx.extend(layer, ...)``."""
    decoders = _check_decoders(decoders)
    decoders[0]._single_layer("batch_extend")
    if num_tokens is None:
        if not isinstance(k, (list, tuple)):
            raise TypeError(f"k: expected a list of arrays (one per decoder) or num_tokens with ragged arrays, "
                            f"got {type(k).__name__} and num_tokens=None")
        if len(k) != len(decoders):
            raise ValueError(f"k: expected {len(decoders)} arrays (one per decoder), got {len(k)}")
        shapes = [np.shape(x) for x in k]
        for b, shape in enumerate(shapes):
            if len(shape) != 3:
                raise ValueError(f"k[{b}]: expected shape [T, num_kv_heads, head_dim], got {shape}")
        num_tokens_ = [shape[0] for shape in shapes]
    else:
        num_tokens_ = num_tokens
    counts = _check_counts(decoders, num_tokens_)
    ids = _token_ids(decoders, counts, False, token_ids)
    checked = check_tokens(decoders, list(counts.values()), q, k, v)       # before anything is reserved
    with DecoderTransaction(decoders, counts, ids) as tx:
        out = tx.extend(0, *checked, checked=True)
    return split_ragged(out, tx.counts) if num_tokens is None else out


def batch_step(decoders, q, k, v, *, token_ids=None) -> np.ndarray:
    """Continuous batching on a one-layer pool: append one token to each decoder and attend, in one kernel call.

    ``q [B, num_q_heads, head_dim]``, ``k [B, num_kv_heads, head_dim]``, ``v [B, num_kv_heads, head_dim_v]``
    -> ``[B, num_q_heads, head_dim_v]``; row b is decoder b's query at its own position (lengths may differ).
    """
    decoders = _check_decoders(decoders)
    decoders[0]._single_layer("batch_step")
    q = decoders[0].check_query(q, len(decoders))                   # everything checked before any reservation
    k, v = decoders[0].check_kv(k, v, len(decoders))
    with batch_transaction(decoders, token_ids=token_ids) as tx:
        return tx._guard(lambda: tx._step_batch(0, q, k, v, checked=True))
