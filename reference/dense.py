"""Dense float64 scaled dot-product attention: the reference every other implementation is judged by.

Shapes (named dimensions)
-------------------------
Single head::

    q: [Lq, head_dim]   k: [Lk, head_dim]   v: [Lk, head_dim_v]
    scores, masked scores, weights: [Lq, Lk]     context: [Lq, head_dim_v]

Batched (``B`` sequences, ``H`` heads)::

    q: [B, H, Lq, head_dim]   k: [B, H, Lk, head_dim]   v: [B, H, Lk, head_dim_v]
    scores, masked scores, weights: [B, H, Lq, Lk]   context: [B, H, Lq, head_dim_v]

Mask convention
---------------
Visibility is built from *absolute* positions.  The queries form a block whose first query sits at
absolute position ``query_start``; query ``i`` of the block (absolute position ``query_start + i``) may
read key ``j`` iff ``j <= query_start + i``.  An optional boolean ``key_padding_mask`` (True = the key is
real and may be attended) is combined with the causal rule by logical AND.  A query row left with no
visible key is rejected with ``ValueError``; it is never turned into NaN or zeros.

Everything is computed in float64 whatever the input float dtype.  Batched transposes use
``swapaxes(-1, -2)``; ``.T`` would reverse all four axes of a batched tensor.
"""
from __future__ import annotations

import math
import numbers
from typing import NamedTuple

import numpy as np

__all__ = [
    "AttentionResult",
    "attention",
    "attention_context",
    "attention_weights",
    "causal_mask",
    "check_float_array",
    "check_query_start",
    "decode_reference",
    "masked_scores",
    "scaled_scores",
    "softmax_over_keys",
    "visible_mask",
]

FLOAT_DTYPES = (np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64))


class AttentionResult(NamedTuple):
    """Every intermediate of one attention computation (float64).

    Attributes
    ----------
    scores : ndarray, [..., Lq, Lk]
        ``q @ k.swapaxes(-1, -2) * scale``.
    masked_scores : ndarray, [..., Lq, Lk]
        ``scores`` where visible, ``-inf`` elsewhere.
    weights : ndarray, [..., Lq, Lk]
        Softmax of ``masked_scores`` over the key axis; exactly 0 at masked keys.
    context : ndarray, [..., Lq, head_dim_v]
        ``weights @ v``.
    """

    scores: np.ndarray
    masked_scores: np.ndarray
    weights: np.ndarray
    context: np.ndarray


# ----------------------------------------------------------------------------------------------
# input checks
# ----------------------------------------------------------------------------------------------

def _format_index(index) -> str:
    return "(" + ", ".join(str(int(i)) for i in index) + ("," if len(index) == 1 else "") + ")"


def check_float_array(name: str, x, allow_neg_inf: bool = False) -> np.ndarray:
    """Return ``x`` as a float64 array after checking its dtype and values.

    Parameters
    ----------
    name : str
        Argument name used in error messages.
    x : array_like
        Must have dtype float16, float32 or float64.
    allow_neg_inf : bool
        Accept ``-inf`` entries (masked scores); NaN and ``+inf`` are still rejected.

    Returns
    -------
    ndarray
        A float64 copy of ``x``.

    Raises
    ------
    TypeError
        For any non-float dtype (int, bool, complex, object, ...).
    ValueError
        For a non-finite value, naming its index.
    """
    arr = np.asarray(x)
    if arr.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name}: expected a float dtype (float16, float32 or float64), got {arr.dtype}")
    bad = np.isnan(arr) | (np.isposinf(arr) if allow_neg_inf else ~np.isfinite(arr))
    if bad.any():
        index = tuple(np.argwhere(bad)[0])
        what = "finite values or -inf" if allow_neg_inf else "finite values"
        raise ValueError(f"{name}: expected {what}, got {float(arr[index])!r} at index {_format_index(index)}")
    return arr.astype(np.float64, copy=True)


def check_query_start(query_start, num_queries: int, num_keys: int) -> int:
    """Check that a block of ``num_queries`` queries starting at ``query_start`` fits ``num_keys`` keys.

    Returns
    -------
    int
        ``query_start`` as a Python int.

    Raises
    ------
    ValueError
        If ``query_start`` is a bool, not an integer, negative, or ``query_start + num_queries > num_keys``.
    """
    if isinstance(query_start, (bool, np.bool_)) or not isinstance(query_start, numbers.Integral):
        raise ValueError(f"query_start: expected a non-negative int, got {query_start!r} "
                         f"of type {type(query_start).__name__}")
    query_start = int(query_start)
    if query_start < 0:
        raise ValueError(f"query_start: expected a non-negative int, got {query_start}")
    if query_start + num_queries > num_keys:
        raise ValueError(f"query_start: expected query_start + Lq <= Lk = {num_keys}, "
                         f"got {query_start} + {num_queries} = {query_start + num_queries}")
    return query_start


def _check_scale(scale, head_dim: int) -> float:
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(scale, (bool, np.bool_)) or not isinstance(scale, numbers.Real):
        raise TypeError(f"scale: expected None or a real number, got {scale!r} of type {type(scale).__name__}")
    scale = float(scale)
    if not (math.isfinite(scale) and scale > 0.0):
        raise ValueError(f"scale: expected a finite positive number, got {scale!r}")
    return scale


def _check_qk(q, k):
    """Validate q and k; return float64 copies with matching ndim, leading dims and head_dim."""
    q = check_float_array("q", q)
    if q.ndim not in (2, 4):
        raise ValueError("q: expected 2 dimensions [Lq, head_dim] or 4 dimensions "
                         f"[B, H, Lq, head_dim], got shape {q.shape}")
    k = check_float_array("k", k)
    if k.ndim != q.ndim:
        raise ValueError(f"k: expected {q.ndim} dimensions like q, got shape {k.shape}")
    if k.shape[:-2] != q.shape[:-2]:
        raise ValueError(f"k: expected leading dimensions (B, H) = {q.shape[:-2]} like q, got {k.shape[:-2]}")
    if k.shape[-1] != q.shape[-1]:
        raise ValueError(f"k: expected head_dim {q.shape[-1]} (q's last axis), got {k.shape[-1]}")
    for name, arr in (("q", q), ("k", k)):
        if min(arr.shape) < 1:
            raise ValueError(f"{name}: expected every dimension >= 1, got shape {arr.shape}")
    return q, k


def _check_v(v, k) -> np.ndarray:
    v = check_float_array("v", v)
    if v.ndim != k.ndim:
        raise ValueError(f"v: expected {k.ndim} dimensions like k, got shape {v.shape}")
    if v.shape[:-2] != k.shape[:-2]:
        raise ValueError(f"v: expected leading dimensions (B, H) = {k.shape[:-2]} like k, got {v.shape[:-2]}")
    if v.shape[-2] != k.shape[-2]:
        raise ValueError(f"v: expected {k.shape[-2]} keys (k's axis -2), got {v.shape[-2]}")
    if v.shape[-1] < 1:
        raise ValueError(f"v: expected head_dim_v >= 1, got shape {v.shape}")
    return v


# ----------------------------------------------------------------------------------------------
# masks
# ----------------------------------------------------------------------------------------------

def causal_mask(num_queries: int, num_keys: int, query_start: int) -> np.ndarray:
    """Causal visibility from absolute positions.

    Parameters
    ----------
    num_queries, num_keys : int
        ``Lq`` and ``Lk``.
    query_start : int
        Absolute position of query 0 (for a full-prefix cache: the number of tokens already cached).

    Returns
    -------
    ndarray of bool, [Lq, Lk]
        ``allow[i, j] = j <= query_start + i``.
    """
    query_start = check_query_start(query_start, num_queries, num_keys)
    query_positions = query_start + np.arange(num_queries)
    key_positions = np.arange(num_keys)
    return key_positions[None, :] <= query_positions[:, None]


def visible_mask(num_queries: int, num_keys: int, query_start: int = 0, key_padding_mask=None,
                 batch: int | None = None) -> np.ndarray:
    """Causal mask AND key padding mask; rejects any query row with no visible key.

    Parameters
    ----------
    num_queries, num_keys, query_start
        See :func:`causal_mask`.
    key_padding_mask : array_like of bool, [Lk] or [B, Lk] or [1, Lk], optional
        True = the key is real and may be attended.  ``[B, Lk]`` needs ``batch``.
    batch : int, optional
        ``B`` for batched inputs; None for a single head.

    Returns
    -------
    ndarray of bool
        ``[Lq, Lk]`` for a single head, ``[B, 1, Lq, Lk]`` (broadcast over heads) when ``batch`` is given.
    """
    allow = causal_mask(num_queries, num_keys, query_start)
    if batch is not None:
        allow = np.broadcast_to(allow, (batch, 1, num_queries, num_keys))
    if key_padding_mask is not None:
        pad = np.asarray(key_padding_mask)
        if pad.dtype != np.bool_:
            raise TypeError(f"key_padding_mask: expected dtype bool (True = key may be attended), got {pad.dtype}")
        if batch is None:
            if pad.shape != (num_keys,):
                raise ValueError(f"key_padding_mask: expected shape ({num_keys},), got {pad.shape}")
        else:
            if pad.shape not in ((num_keys,), (1, num_keys), (batch, num_keys)):
                raise ValueError(f"key_padding_mask: expected shape ({num_keys},) or ({batch}, {num_keys}), "
                                 f"got {pad.shape}")
            pad = pad.reshape(-1, 1, 1, num_keys)
        allow = allow & pad
    empty = ~allow.any(axis=-1)
    if empty.any():
        index = tuple(np.argwhere(empty)[0])
        row = index[-1]
        raise ValueError(f"key_padding_mask: expected at least one visible key for every query row, got 0 for "
                         f"query row {_format_index(index)} (absolute position {int(query_start) + int(row)})")
    return np.array(allow)


# ----------------------------------------------------------------------------------------------
# the computation
# ----------------------------------------------------------------------------------------------

def scaled_scores(q, k, scale=None) -> np.ndarray:
    """``q @ k.swapaxes(-1, -2) * scale``, unmasked.

    Parameters
    ----------
    q : array_like, [Lq, head_dim] or [B, H, Lq, head_dim]
    k : array_like, [Lk, head_dim] or [B, H, Lk, head_dim]
    scale : float, optional
        Defaults to ``1 / sqrt(head_dim)``.

    Returns
    -------
    ndarray, float64, [Lq, Lk] or [B, H, Lq, Lk]
    """
    q, k = _check_qk(q, k)
    scale = _check_scale(scale, q.shape[-1])
    return (q @ k.swapaxes(-1, -2)) * scale


def masked_scores(q, k, query_start: int = 0, key_padding_mask=None, scale=None) -> np.ndarray:
    """Scaled scores with ``-inf`` where the key is not visible.

    Parameters
    ----------
    q, k, scale
        See :func:`scaled_scores`.
    query_start : int
        Absolute position of query 0; query ``i`` reads keys ``j <= query_start + i``.
    key_padding_mask : array_like of bool, [Lk] (or [B, Lk] when batched), optional
        True = key may be attended.

    Returns
    -------
    ndarray, float64, [..., Lq, Lk]
    """
    scores = scaled_scores(q, k, scale)
    batch = scores.shape[0] if scores.ndim == 4 else None
    allow = visible_mask(scores.shape[-2], scores.shape[-1], query_start, key_padding_mask, batch)
    return np.where(allow, scores, -np.inf)


def softmax_over_keys(masked) -> np.ndarray:
    """Softmax along the last (key) axis; ``-inf`` entries get exactly 0 weight.

    Parameters
    ----------
    masked : array_like, float, [..., Lq, Lk]
        Scores with ``-inf`` at masked keys.

    Returns
    -------
    ndarray, float64, [..., Lq, Lk]

    Raises
    ------
    ValueError
        If a row has no finite entry (a fully masked query), or contains NaN / ``+inf``.
    """
    masked = check_float_array("masked_scores", masked, allow_neg_inf=True)
    if masked.ndim < 1 or masked.shape[-1] < 1:
        raise ValueError(f"masked_scores: expected at least one key axis entry, got shape {masked.shape}")
    empty = ~np.isfinite(masked).any(axis=-1)
    if empty.any():
        index = tuple(np.argwhere(empty)[0])
        raise ValueError("masked_scores: expected at least one visible (finite) key per query row, "
                         f"got none in row {_format_index(index)}")
    shifted = masked - masked.max(axis=-1, keepdims=True)
    exps = np.exp(shifted)
    return exps / exps.sum(axis=-1, keepdims=True)


def attention_weights(q, k, query_start: int = 0, key_padding_mask=None, scale=None) -> np.ndarray:
    """Attention weights ``softmax(masked_scores, axis=keys)``, float64 ``[..., Lq, Lk]``.

    See :func:`masked_scores` for the parameters.
    """
    return softmax_over_keys(masked_scores(q, k, query_start, key_padding_mask, scale))


def attention(q, k, v, query_start: int = 0, key_padding_mask=None, scale=None) -> AttentionResult:
    """Scores, masked scores, weights and context in one pass.

    Parameters
    ----------
    q : array_like, [Lq, head_dim] or [B, H, Lq, head_dim]
    k : array_like, [Lk, head_dim] or [B, H, Lk, head_dim]
    v : array_like, [Lk, head_dim_v] or [B, H, Lk, head_dim_v]
    query_start : int
        Absolute position of query 0.  ``query_start + Lq <= Lk``.
    key_padding_mask : array_like of bool, [Lk] (or [B, Lk] when batched), optional
        True = key may be attended; combined with the causal rule by AND.
    scale : float, optional
        Defaults to ``1 / sqrt(head_dim)``.

    Returns
    -------
    AttentionResult
    """
    q, k = _check_qk(q, k)
    v = _check_v(v, k)
    scale = _check_scale(scale, q.shape[-1])
    scores = (q @ k.swapaxes(-1, -2)) * scale
    batch = scores.shape[0] if scores.ndim == 4 else None
    allow = visible_mask(scores.shape[-2], scores.shape[-1], query_start, key_padding_mask, batch)
    masked = np.where(allow, scores, -np.inf)
    weights = softmax_over_keys(masked)
    return AttentionResult(scores, masked, weights, weights @ v)


def attention_context(q, k, v, query_start: int = 0, key_padding_mask=None, scale=None) -> np.ndarray:
    """Context ``weights @ v``, float64 ``[Lq, head_dim_v]`` or ``[B, H, Lq, head_dim_v]``.

    See :func:`attention` for the parameters.
    """
    return attention(q, k, v, query_start, key_padding_mask, scale).context


# ----------------------------------------------------------------------------------------------
# decode-shaped reference (grouped-query attention)
# ----------------------------------------------------------------------------------------------

def _check_window(window) -> int | None:
    if window is None:
        return None
    if isinstance(window, (bool, np.bool_)) or not isinstance(window, numbers.Integral) or int(window) < 1:
        raise ValueError(f"window: expected None or an int >= 1, got {window!r}")
    return int(window)


def decode_reference(q, k, v, query_start: int, scale=None, window=None) -> np.ndarray:
    """Grouped-query attention for a block of new tokens reading a cache, in float64 loops.

    Query ``t`` sits at absolute position ``p = query_start + t`` and reads the keys at positions
    ``(p - window, p]`` (all positions ``<= p`` when ``window`` is None).  Query head ``h`` reads
    KV head ``h // (num_q_heads // num_kv_heads)``.

    Parameters
    ----------
    q : array_like, float, [T, num_q_heads, head_dim]
    k : array_like, float, [L, num_kv_heads, head_dim]
        Keys by absolute position (the cache contents, including the T new tokens).
    v : array_like, float, [L, num_kv_heads, head_dim_v]
    query_start : int
        Absolute position of query 0; ``query_start + T <= L``.
    scale : float, optional
        Defaults to ``1 / sqrt(head_dim)``.
    window : int, optional
        Sliding-window length (>= 1); None = attend to every earlier position.

    Returns
    -------
    ndarray, float64, [T, num_q_heads, head_dim_v]
    """
    q = check_float_array("q", q)
    k = check_float_array("k", k)
    v = check_float_array("v", v)
    if q.ndim != 3:
        raise ValueError(f"q: expected 3 dimensions [T, num_q_heads, head_dim], got shape {q.shape}")
    if k.ndim != 3:
        raise ValueError(f"k: expected 3 dimensions [L, num_kv_heads, head_dim], got shape {k.shape}")
    if v.ndim != 3:
        raise ValueError(f"v: expected 3 dimensions [L, num_kv_heads, head_dim_v], got shape {v.shape}")
    for name, arr in (("q", q), ("k", k), ("v", v)):
        if min(arr.shape) < 1:
            raise ValueError(f"{name}: expected every dimension >= 1, got shape {arr.shape}")
    num_tokens, num_q_heads, head_dim = q.shape
    length, num_kv_heads, _ = k.shape
    if k.shape[2] != head_dim:
        raise ValueError(f"k: expected head_dim {head_dim} (q's last axis), got {k.shape[2]}")
    if v.shape[:2] != k.shape[:2]:
        raise ValueError(f"v: expected [L, num_kv_heads] = {k.shape[:2]} like k, got {v.shape[:2]}")
    if num_q_heads % num_kv_heads != 0:
        raise ValueError(f"q: expected num_q_heads divisible by num_kv_heads = {num_kv_heads}, got {num_q_heads}")
    query_start = check_query_start(query_start, num_tokens, length)
    scale = _check_scale(scale, head_dim)
    window = _check_window(window)

    group = num_q_heads // num_kv_heads
    out = np.empty((num_tokens, num_q_heads, v.shape[2]), dtype=np.float64)
    for t in range(num_tokens):
        p = query_start + t
        first = 0 if window is None else max(0, p - window + 1)
        for h in range(num_q_heads):
            g = h // group
            s = (k[first:p + 1, g, :] @ q[t, h, :]) * scale
            w = np.exp(s - s.max())
            w /= w.sum()
            out[t, h, :] = w @ v[first:p + 1, g, :]
    return out
