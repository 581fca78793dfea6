"""Input validation of the `Decoder` paths: one decoder's checks (`InputChecks`), the ragged / per-decoder
forms of a batch (`check_tokens`), and the API's other arguments (the cache, heads, scale and window of a
`Decoder`; the decoders, counts and token ids of a batch).

Where else decode checks input: `decode.attention.paged_decode_attention` (the kernel entry's checked wrapper,
whose one-pass check's codes are `decode.kernels.input_check.CheckCode`) and `decode.partial` (context
sharding's partial attention and merge, the same kind of wrapper); state errors (a transaction used after it
ended, a window's released positions) are raised where that state lives.

Every check runs before anything is reserved; errors are ``"name: expected ..., got ..."`` naming the
caller's argument (and, for the list form of a batch, its element: ``q[1]: ...``). Inputs must be finite
(after the cast to the storage dtype) and bounded in magnitude (`magnitude_limits`).

The decode step, `batch_step` and the multi-token calls (extend, prefill, append, the ragged batch) check
finiteness and magnitude with one jitted call (`first_bad_input`) instead of NumPy reductions per array; only a
bad input takes the per-array checks, which name it. The limit makes "finite after the cast to the storage
dtype" checkable before casting: a float32 input bound for float16 storage must satisfy |x| < 65520 (values from
65520 up round to inf in float16).

`magnitude_limits` bounds the inputs so that the kernel's arithmetic cannot overflow: finite q and k whose scores
exceed the compute dtype made the fastmath kernel return NaN, raise ZeroDivisionError, or return finite garbage.
"""
import math
import numbers
import weakref

import numpy as np
from numba import njit

from kvcache import KVCache, quant
from kvcache.checks import as_float_array, cast_to_storage, check_int, check_shape
from kvcache.jit_store import writable

from .attention_plan import compute_dtype


FLOAT16_OVERFLOW = 65520.0                      # smallest magnitude that rounds to inf in float16
FLOAT32_OVERFLOW = 3.4028235677973366e38     # float32 max + half an ulp: the smallest float64 that rounds to inf


@njit(cache=True, nogil=True)
def _finite_below(x, limit):
    """Whether every ``|x| < limit`` (False for NaN too); no early exit, so the loop vectorises (4x faster on a
    decode step's q/k/v than stopping at the first bad element, which the caller then looks up by NumPy)."""
    flat = x.ravel()
    ok = True
    for i in range(flat.size):
        ok &= abs(flat[i]) < limit
    return ok


@njit(cache=True, nogil=True)
def first_bad_input(q, k, v, q_limit, kv_limit):
    """0 / 1 / 2 for the first of q / k / v that is not finite or reaches its limit in magnitude, else -1."""
    if not _finite_below(q, q_limit):
        return 0
    if not _finite_below(k, kv_limit):
        return 1
    if not _finite_below(v, kv_limit):
        return 2
    return -1


def overflow_limit(input_dtype: np.dtype, storage_dtype: np.dtype) -> float:
    """Magnitude from which a value of ``input_dtype`` becomes inf in ``storage_dtype`` (int8: from which its
    group's float16 scale would overflow, just above `kvcache.quant.MAX_ABS`)."""
    if storage_dtype == quant.VALUE_DTYPE:
        return float(np.nextafter(quant.MAX_ABS, np.inf))
    if storage_dtype.itemsize >= input_dtype.itemsize:
        return np.inf
    return FLOAT16_OVERFLOW if storage_dtype == np.float16 else FLOAT32_OVERFLOW


def magnitude_limits(compute_dtype: np.dtype, head_dim: int, scale: float) -> tuple[float, float]:
    """``(q_limit, kv_limit)``: with every ``|q| < q_limit`` and every ``|k|, |v| < kv_limit`` each score
    ``q.k * scale`` (every partial sum, in any order) stays below a quarter of the compute dtype's largest value,
    so score differences are finite too, and each weighted sum of V stays below ``tokens * kv_limit``.

    With E = 128 (float32 compute) or 1024 (float64): kv_limit = 2**(E/2 - 16) (2.8e14 for float32; float16
    storage never gets there) and q_limit = 2**(E/2 + 14) / (head_dim * scale), so that
    head_dim * (q_limit * scale) * kv_limit = 2**(E - 2)."""
    e = 128 if compute_dtype == np.float32 else 1024
    with np.errstate(over="ignore"):
        q_limit = math.ldexp(1.0, e // 2 + 14) / (head_dim * scale) if head_dim * scale > 0 else math.inf
    return q_limit, math.ldexp(1.0, e // 2 - 16)


def check_magnitude(name: str, x: np.ndarray, limit: float, compute_dtype: np.dtype) -> None:
    """ValueError naming the first element of ``x`` (finite already) with ``|x| >= limit``."""
    if x.size and limit < math.inf and not float(np.abs(x).max()) < limit:      # compared in float64
        index = tuple(int(i) for i in np.argwhere(np.abs(x).astype(np.float64) >= limit)[0])
        raise ValueError(f"{name}: expected |x| < {limit:.6g} (scores q.k * scale and the weighted sums of v must "
                         f"stay finite in {compute_dtype}), got {x[index]} at index {index}")


# input dtypes the jitted check takes (numba types neither float16 nor long double nor byte-swapped arrays)
_JIT_FLOATS = frozenset((np.dtype(np.float32), np.dtype(np.float64)))


class InputChecks:
    """The checks of one decoder's inputs: shapes from the cache's config and ``num_q_heads``, the working
    precision ``q_dtype`` (float64 for float64 storage, else float32) and the magnitude limits for ``scale``."""

    def __init__(self, cache, num_q_heads: int, scale: float):
        cfg = cache.config
        self.cache, self.num_q_heads = cache, num_q_heads
        self.q_dtype = compute_dtype(cfg.dtype)
        self.q_limit, self.kv_limit = magnitude_limits(self.q_dtype, cfg.head_dim, scale)
        self._limits = {}                                        # (q, k, v dtypes) -> limits of the jitted check
        self.q_shape = (num_q_heads, cfg.head_dim)               # one token: [num_q_heads, head_dim]
        self.k_shape = (cfg.num_kv_heads, cfg.head_dim)          # [num_kv_heads, head_dim]
        self.v_shape = (cfg.num_kv_heads, cfg.head_dim_v)        # [num_kv_heads, head_dim_v]

    def token(self, q, k, v):
        """One token's q/k/v checked (shape, float dtype, finite; k/v finite after the cast to storage; magnitudes
        within the compute dtype's safe range); q converted to the working precision."""
        if not (type(q) is type(k) is type(v) is np.ndarray and q.shape == self.q_shape
                and k.shape == self.k_shape and v.shape == self.v_shape
                and q.dtype in _JIT_FLOATS and k.dtype in _JIT_FLOATS and v.dtype in _JIT_FLOATS):
            return self.token_slowly(q, k, v)
        # a read-only array would compile the jitted check and the pool's store again: copied (`writable`)
        q, k, v = writable(q), writable(k), writable(v)
        limits = self._limits.get((q.dtype, k.dtype, v.dtype)) or self.input_limits(q.dtype, k.dtype, v.dtype)
        if first_bad_input(q, k, v, *limits) >= 0:
            return self.token_slowly(q, k, v)                     # raises, naming the element
        # k/v stay in the caller's dtype: the write into the pool casts them (the limits made the cast safe)
        return q if q.dtype == self.q_dtype and q.flags.c_contiguous else np.ascontiguousarray(q, self.q_dtype), k, v

    def tokens(self, q, k, v, count: int):
        """``count`` tokens: one of each of ``count`` sequences, or ``count`` consecutive tokens of one (an extend,
        a prefill): ``q [count, num_q_heads, head_dim]`` (or None: an append without queries), ``k [count,
        num_kv_heads, head_dim]``, ``v [count, num_kv_heads, head_dim_v]`` checked as by `query` and `kv`, in one
        jitted pass when they are arrays of those shapes and of float32/float64; otherwise, or to name the bad
        argument and element (``q: ... at index (t, h, d)``), by `query` and `kv`. Returns q in the working
        precision (C-contiguous; None if q is); k/v in the caller's float dtype (the write into the pool casts
        them: the limits made the cast safe) or cast to storage. The one pass replaced two NumPy reductions per
        array (finite, then the magnitude) that took 2.2 of a 512-token float32 prefill's 19.5 ms here."""
        if (type(k) is type(v) is np.ndarray and k.dtype in _JIT_FLOATS and v.dtype in _JIT_FLOATS
                and k.shape == (count,) + self.k_shape and v.shape == (count,) + self.v_shape
                and (q is None or (type(q) is np.ndarray and q.dtype in _JIT_FLOATS
                                   and q.shape == (count,) + self.q_shape))):
            q, k, v = writable(q), writable(k), writable(v)             # as in `token`
            qc = k[:0] if q is None else q                              # no queries: an empty q passes
            limits = self._limits.get((qc.dtype, k.dtype, v.dtype)) or self.input_limits(qc.dtype, k.dtype, v.dtype)
            if first_bad_input(qc, k, v, *limits) < 0:
                if q is not None and (q.dtype != self.q_dtype or not q.flags.c_contiguous):
                    q = np.ascontiguousarray(q, self.q_dtype)
                return q, k, v
        q = None if q is None else self.query(q, count)
        return (q, *self.kv(k, v, count))

    def input_limits(self, q_dtype, k_dtype, v_dtype) -> tuple[float, float]:
        """Magnitude limits of the jitted check for these input dtypes: finite after the cast (`overflow_limit`)
        and within the compute dtype's safe range (`magnitude_limits`); memoised per dtype triple."""
        kv_dtype = k_dtype if k_dtype.itemsize >= v_dtype.itemsize else v_dtype
        limits = (min(overflow_limit(q_dtype, self.q_dtype), self.q_limit),
                  min(overflow_limit(kv_dtype, self.cache.config.dtype), self.kv_limit))
        self._limits[(q_dtype, k_dtype, v_dtype)] = limits
        return limits

    def token_slowly(self, q, k, v):
        """`token` for any input: converts, then names the first bad argument and element."""
        q, k, v = as_float_array("q", q), as_float_array("k", k), as_float_array("v", v)
        check_shape("q", q, self.q_shape, "[num_q_heads, head_dim]")
        check_shape("k", k, self.k_shape, "[num_kv_heads, head_dim]")
        check_shape("v", v, self.v_shape, "[num_kv_heads, head_dim_v]")
        given = q, k, v                                # errors name the caller's values at the caller's [H, D] index
        q = cast_to_storage("q", q, self.q_dtype)
        k, v = self.cache.pool.check_storable("k", k), self.cache.pool.check_storable("v", v)
        check_magnitude("q", given[0], self.q_limit, self.q_dtype)
        self.kv_magnitude(*given[1:])
        return np.ascontiguousarray(q), k, v

    def kv_magnitude(self, k, v) -> None:
        check_magnitude("k", k, self.kv_limit, self.q_dtype)
        check_magnitude("v", v, self.kv_limit, self.q_dtype)

    def kv(self, k, v, num_tokens: int):
        """``k [T, num_kv_heads, head_dim]``, ``v [T, num_kv_heads, head_dim_v]`` validated (`KVCache.check_kv`,
        then the magnitude limits) and cast to the storage dtype."""
        given = np.asarray(k), np.asarray(v)
        k, v = self.cache.pool.check_kv(*given, num_tokens, layered=False)
        self.kv_magnitude(*given)                     # float arrays of the right shape by now; named as given
        return k, v

    def query(self, q, num_tokens: int) -> np.ndarray:
        """``q [T, num_q_heads, head_dim]`` validated (float, finite) and cast to the working precision."""
        given = q = as_float_array("q", q)
        check_shape("q", q, (num_tokens, self.num_q_heads, self.cache.config.head_dim), "[T, num_q_heads, head_dim]")
        q = cast_to_storage("q", q, self.q_dtype)
        check_magnitude("q", given, self.q_limit, self.q_dtype)
        return np.ascontiguousarray(q)


_CHECKS = weakref.WeakKeyDictionary()          # cache -> {(num_q_heads, scale): InputChecks}


def checks_for(decoder) -> InputChecks:
    """The input checks of ``decoder`` (a `decode.Decoder`): one `InputChecks` per cache, num_q_heads and scale,
    made once and shared by every decoder with those settings (what `DecoderTransaction`, `batch_step` and
    `decode.distributed` check a decoder's tokens with)."""
    per_cache = _CHECKS.get(decoder.cache)
    if per_cache is None:
        per_cache = _CHECKS.setdefault(decoder.cache, {})
    key = (decoder.num_q_heads, decoder.scale)
    checks = per_cache.get(key)
    if checks is None:
        checks = per_cache.setdefault(key, InputChecks(decoder.cache, decoder.num_q_heads, decoder.scale))
    return checks


def check_single_layer(config, what: str) -> None:
    """ValueError unless the pool has one layer (the single-layer calls; several layers go through transactions)."""
    if config.num_layers != 1:
        raise ValueError(f"{what}: expected a one-layer cache (use transaction() for several layers), "
                         f"got num_layers={config.num_layers}")


def num_tokens_of(k) -> int:
    """T of ``k [T, num_kv_heads, head_dim]`` (ValueError naming k for another number of axes)."""
    shape = np.shape(k)
    if len(shape) != 3:
        raise ValueError(f"k: expected shape [T, num_kv_heads, head_dim], got {shape}")
    return shape[0]


def check_tokens(decoders, counts, q, k, v):
    """Validate new tokens of ``decoders`` (``counts[b]`` for decoder b): ragged arrays or one array per
    decoder, as in `DecoderTransaction.extend`; q may be None -> ragged ``q [N, num_q_heads, head_dim]``
    (working precision; None if q is), ``k``, ``v`` (storage dtype). Errors of the list form name the element
    (``q[1]: ...``), of the ragged form the ragged index."""
    checks = checks_for(decoders[0])
    if not any(isinstance(x, (list, tuple)) for x in (q, k, v)):
        q, k, v = checks.tokens(q, k, v, sum(counts))
        pool = decoders[0].cache.pool          # rounded to storage once, whole (the write's pages are strided views)
        return q, pool.stored(k), pool.stored(v)
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
                parts[0].append(checks.query(q[b], count))
            kb, vb = checks.kv(k[b], v[b], count)
        except (TypeError, ValueError) as e:
            msg = str(e)
            raise type(e)(f"{msg[0]}[{b}]{msg[1:]}" if msg[1:2] == ":" else msg) from None
        parts[1].append(kb)
        parts[2].append(vb)
    return tuple(np.concatenate(p) if p else None for p in parts)


def split_ragged(x: np.ndarray, counts) -> list:
    """``x [sum(counts), ...]`` -> a list of ``[counts[b], ...]`` views."""
    return np.split(x, np.cumsum(counts)[:-1])


# -- the API's other arguments ------------------------------------------------------------------------------
def check_cache(cache) -> KVCache:
    if not isinstance(cache, KVCache):
        raise TypeError(f"cache: expected a kvcache.KVCache, got {type(cache).__name__}")
    return cache


def check_decoder_args(config, num_q_heads, scale, window) -> tuple[int, float, int]:
    """A decoder's ``(num_q_heads, scale, window)`` over a pool of layout ``config``: num_q_heads a multiple of
    num_kv_heads, scale a finite float > 0 (None: 1 / sqrt(head_dim)), window >= 1 (None: 0, no window)."""
    num_q_heads = check_int("num_q_heads", num_q_heads, minimum=1)
    if num_q_heads % config.num_kv_heads:
        raise ValueError(f"num_q_heads: expected a multiple of num_kv_heads={config.num_kv_heads}, got {num_q_heads}")
    if scale is None:
        scale = 1.0 / np.sqrt(config.head_dim)
    elif isinstance(scale, (bool, np.bool_)) or not isinstance(scale, numbers.Real):
        raise TypeError(f"scale: expected a finite float > 0, got {type(scale).__name__} {scale!r}")
    elif not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"scale: expected a finite float > 0, got {scale!r}")
    return num_q_heads, float(scale), 0 if window is None else check_int("window", window, minimum=1)


def check_truncate(n, length: int, window: int, first: int) -> int:
    """``Decoder.truncate``'s ``n`` in ``[0, length]``; with a sliding window (``window`` > 0) also no shorter
    than the window still reads (positions before ``first`` were released)."""
    n = check_int("n", n, maximum=length)
    if window and max(0, n - window + 1) < first:
        raise ValueError(f"n: expected >= {first + window - 1} (K/V before position {first} was released by the "
                         f"sliding window), got {n}")
    return n


def check_decoders(decoders, decoder_type: type) -> list:
    """A batch's ``decoders``: a non-empty list (or tuple) of ``decoder_type`` over one cache, with one
    num_q_heads / scale / window and distinct sequences."""
    decoders = list(decoders) if isinstance(decoders, (list, tuple)) else decoders
    if not isinstance(decoders, list) or not decoders or not all(isinstance(d, decoder_type) for d in decoders):
        raise TypeError(f"decoders: expected a non-empty list of Decoder, got {decoders!r}")
    first = decoders[0]
    for d in decoders[1:]:
        if d.cache is not first.cache:
            raise ValueError("decoders: expected decoders sharing one cache (Decoder.on_cache), got several caches")
        mine, theirs = (d.num_q_heads, d.scale, d.window), (first.num_q_heads, first.scale, first.window)
        if mine != theirs:
            raise ValueError(f"decoders: expected one num_q_heads/scale/window, got {theirs} and {mine}")
    seqs = [d.seq for d in decoders]
    if len(set(seqs)) != len(seqs):
        raise ValueError(f"decoders: expected distinct sequences, got sequence ids {seqs}")
    return decoders


def check_batch_counts(decoders, num_tokens) -> dict:
    """``{seq: count}`` of a batch: one each (``num_tokens`` None) or ``num_tokens[b] >= 0`` for decoder b."""
    if num_tokens is None:
        return {d.seq: 1 for d in decoders}
    if isinstance(num_tokens, np.ndarray):
        num_tokens = num_tokens.tolist()
    if not isinstance(num_tokens, (list, tuple)) or len(num_tokens) != len(decoders):
        raise ValueError(f"num_tokens: expected {len(decoders)} token counts (one per decoder), got {num_tokens!r}")
    return {d.seq: check_int(f"num_tokens[{b}]", n) for b, (d, n) in enumerate(zip(decoders, num_tokens))}


def list_counts(decoders, k) -> list[int]:
    """The token counts of a batch's list form: T_b of each ``k[b] [T_b, num_kv_heads, head_dim]``."""
    if not isinstance(k, (list, tuple)):
        raise TypeError(f"k: expected a list of arrays (one per decoder) or num_tokens with ragged arrays, "
                        f"got {type(k).__name__} and num_tokens=None")
    if len(k) != len(decoders):
        raise ValueError(f"k: expected {len(decoders)} arrays (one per decoder), got {len(k)}")
    shapes = [np.shape(x) for x in k]
    for b, shape in enumerate(shapes):
        if len(shape) != 3:
            raise ValueError(f"k[{b}]: expected shape [T, num_kv_heads, head_dim], got {shape}")
    return [shape[0] for shape in shapes]


def check_batch_token_ids(decoders, counts: dict, one_each: bool, token_ids):
    """A batch's ``token_ids`` as {seq: ids} (None stays None): one id per decoder (``one_each``), else one
    ``[T_b]`` array per decoder or a ragged ``[N]`` array (see `decode.batch.batch_transaction`)."""
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
