"""A naive, obviously-correct oracle for the kernel tests. Imports nothing from the package.

`gather` turns the paged layout into dense per-sequence K/V (the test's own page walk); `attention64` is a plain
float64 softmax over the visible positions; `attention_working` is the same plain NumPy computation at a working
precision (float32), used to size tolerances: the kernel must be within a small multiple of its error (or of
the error that rounding the exact scores to float32 alone causes, which at large score magnitudes is the floor).
"""
import numpy as np


def gather(pages, page_indices, page_indptr, seq, length):
    """Dense ``[length, num_kv_heads, dim]`` copy (storage dtype) of positions 0..length-1 of sequence ``seq``.
    Positions on freed (-1) pages are NaN. Position t is row t % page_size of the sequence's page t // page_size."""
    _, num_kv_heads, page_size, dim = pages.shape
    out = np.full((length, num_kv_heads, dim), np.nan, dtype=pages.dtype)
    row = page_indices[page_indptr[seq]:page_indptr[seq + 1]]
    t = np.arange(length)
    page = row[t // page_size]
    live = page >= 0
    out[live] = pages[page[live], :, t[live] % page_size, :]
    return out


def bf16_bits(x):
    """float32 -> bfloat16 bits (uint16), round to nearest even (finite inputs; NaN stays NaN): the tests' own
    rounding, independent of `kvcache.bf16`."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def bf16_values(bits):
    """bfloat16 bits (uint16) -> their float32 values (exact)."""
    return (np.asarray(bits).astype(np.uint32) << 16).view(np.float32)


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
    for kvh in range(num_kv_heads):
        k = K[:, kvh, :].astype(dtype)
        v = V[:, kvh, :].astype(dtype)
        for h in range(kvh * group, (kvh + 1) * group):
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
    for i, (K, V, lo, p) in enumerate(_dense(k_pages, v_pages, page_indices, page_indptr, query_seq, query_pos,
                                             window)):
        out[i] = _attend(q[i], K[lo:p + 1], V[lo:p + 1], scale, dtype, score_dtype)
    return out


def _dense(k_pages, v_pages, page_indices, page_indptr, query_seq, query_pos, window):
    """Per query i: (K, V, lo, p), its sequence's dense K/V (`gather`, once per sequence, up to the sequence's
    last queried position) and its visible range lo..p."""
    seqs = [int(s) for s in query_seq]
    last = {}
    for s, p in zip(seqs, query_pos):
        last[s] = max(last.get(s, -1), int(p))
    dense = {s: (gather(k_pages, page_indices, page_indptr, s, n + 1), gather(v_pages, page_indices, page_indptr, s,
                                                                                 n + 1)) for s, n in last.items()}
    for s, p in zip(seqs, query_pos):
        p = int(p)
        yield dense[s][0], dense[s][1], visible(p, window), p


# -- the float32 accuracy budget (DEVELOPERS.md, issue 20) -------------------------------------------------------
ATOL, FACTOR = 1e-6, 3.0


def torch_decode(q, k_pages, v_pages, page_indices, page_indptr, query_seq, query_pos, scale, window):
    """`decode` computed by torch SDPA in float32 (one call per query over its dense K/V), or None when torch is
    not importable (it comes with the hf extra)."""
    try:
        import torch
    except ImportError:
        return None
    out = np.empty((q.shape[0], q.shape[1], v_pages.shape[3]), dtype=np.float32)
    for i, (K, V, lo, p) in enumerate(_dense(k_pages, v_pages, page_indices, page_indptr, query_seq, query_pos,
                                             window)):
        K, V = K[lo:p + 1].astype(np.float32), V[lo:p + 1].astype(np.float32)
        qt = torch.from_numpy(np.ascontiguousarray(q[i], dtype=np.float32))[None, :, None, :]
        kt = torch.from_numpy(np.ascontiguousarray(K.transpose(1, 0, 2)))[None]
        vt = torch.from_numpy(np.ascontiguousarray(V.transpose(1, 0, 2)))[None]
        with torch.no_grad():
            o = torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, scale=float(scale), enable_gqa=True)
        out[i] = o[0, :, 0, :].numpy()
    return out


def budget(q, k_pages, v_pages, page_indices, page_indptr, query_seq, query_pos, scale, window, ref=None):
    """The allowed max error of a float32-score result against the float64 oracle ``ref`` (computed if None):
    ``1e-6 + 3 x max(plain NumPy float32 error, torch SDPA float32 error, sqrt(head_dim) x the float32-score
    floor)``, the floor being the error of the oracle with each exact score q.k rounded once to float32.
    Pages: the stored values as floats (float16 / bfloat16 / int8 storage: the dequantized K/V)."""
    args = (q, k_pages, v_pages, page_indices, page_indptr, query_seq, query_pos, scale, window)
    ref = decode(*args) if ref is None else ref
    errors = [np.abs(decode(*args, dtype=np.float32) - ref).max(),
              np.sqrt(q.shape[2]) * np.abs(decode(*args, score_dtype=np.float32) - ref).max()]
    plain_torch = torch_decode(*args)
    if plain_torch is not None:
        errors.append(np.abs(plain_torch - ref).max())
    return ATOL + FACTOR * max(errors)


def check_bf16(out, q, kb, vb, page_indices, page_indptr, query_seq, query_pos, scale, window):
    """Assert ``out`` (float32) is finite and within `budget` of the float64 oracle over bfloat16 pages given as
    bits (kb / vb uint16)."""
    args = (q, bf16_values(kb), bf16_values(vb), page_indices, page_indptr, query_seq, query_pos, scale, window)
    ref = decode(*args)
    err = np.abs(out - ref).max()
    allowed = budget(*args, ref=ref)
    assert np.isfinite(out).all() and err <= allowed, f"max error {err:.3g} (allowed {allowed:.3g})"


def budget_dense(q, K, V, start, scale, window, ref=None):
    """`budget` for queries q [T, Hq, D] at positions start.. of one sequence with dense K, V [n, Hkv, .]."""
    n = K.shape[0]
    pages = np.arange(n, dtype=np.int32)
    return budget(q, K[:, :, None, :], V[:, :, None, :], pages, np.array([0, n]), np.zeros(len(q), np.int32),
                  start + np.arange(len(q)), scale, window, ref)
