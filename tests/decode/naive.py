"""A naive, obviously-correct oracle for the kernel tests. Imports nothing from the package.

`gather` turns the paged layout into dense per-sequence K/V (the test's own page walk); `attention64` is a plain
float64 softmax over the visible positions; `attention_working` is the same plain NumPy computation at a working
precision (float32), used to size tolerances: the kernel must be within a small multiple of its error (or of
the error that rounding the exact scores to float32 alone causes, which at large score magnitudes is the floor).
"""
import numpy as np


def gather(pages, page_indices, page_indptr, seq, length):
    """Dense ``[length, num_kv_heads, dim]`` copy (storage dtype) of positions 0..length-1 of sequence ``seq``.
    Positions on freed (-1) pages are NaN."""
    _, num_kv_heads, page_size, dim = pages.shape
    out = np.full((length, num_kv_heads, dim), np.nan, dtype=pages.dtype)
    row = page_indices[page_indptr[seq]:page_indptr[seq + 1]]
    for t in range(length):
        page = row[t // page_size]
        if page >= 0:
            out[t] = pages[page, :, t % page_size, :]
    return out


def visible(pos, window):
    """First visible position for a query at ``pos``."""
    return 0 if window == 0 else max(0, pos - window + 1)


def _attend(q, K, V, scale, dtype, score_dtype=None):
    """q [num_q_heads, head_dim], K [n, num_kv_heads, head_dim], V [n, num_kv_heads, head_dim_v].
    score_dtype: round the unscaled scores q.k (computed in ``dtype``) to it, then go on in ``dtype``."""
    num_q_heads = q.shape[0]
    num_kv_heads = K.shape[1]
    group = num_q_heads // num_kv_heads
    out = np.empty((num_q_heads, V.shape[2]), dtype=dtype)
    for h in range(num_q_heads):
        kvh = h // group
        k = K[:, kvh, :].astype(dtype)
        v = V[:, kvh, :].astype(dtype)
        raw = k @ q[h].astype(dtype)
        if score_dtype is not None:
            raw = raw.astype(score_dtype).astype(dtype)
        s = raw * dtype(scale)
        e = np.exp(s - s.max())
        out[h] = (e @ v) / e.sum()
    return out


def decode(q, k_pages, v_pages, page_indices, page_indptr, query_seq, query_pos, scale, window, dtype=np.float64,
           score_dtype=None):
    """Reference for `paged_decode_attention`: query i reads positions visible(p)..p of its sequence.
    dtype=float64: the oracle; dtype=float32: plain NumPy at working precision (inputs as stored).
    score_dtype=float32 (with dtype=float64): the oracle with its unscaled scores q.k rounded to float32: the
    error floor of any computation that holds its scores in float32."""
    out = np.empty((q.shape[0], q.shape[1], v_pages.shape[3]), dtype=dtype)
    for i in range(q.shape[0]):
        s, p = int(query_seq[i]), int(query_pos[i])
        lo = visible(p, window)
        K = gather(k_pages, page_indices, page_indptr, s, p + 1)[lo:]
        V = gather(v_pages, page_indices, page_indptr, s, p + 1)[lo:]
        out[i] = _attend(q[i], K, V, scale, dtype, score_dtype)
    return out
