"""Several decoders of one shared pool in one kernel call per layer: `batch_transaction`, `batch_extend`
(each decoder its own number of new tokens) and `batch_step` (continuous batching: one token each).

Everything is validated before any page is reserved; all or none of the tokens land.
"""
import numpy as np

from kvcache.checks import check_int

from .decoder import Decoder
from .inputs import check_single_layer, check_tokens, split_ragged
from .decoder_transaction import DecoderTransaction


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
    check_single_layer(decoders[0].config, "batch_extend")
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
    check_single_layer(decoders[0].config, "batch_step")
    q, k, v = decoders[0].inputs.tokens(q, k, v, len(decoders))     # everything checked before any reservation
    counts = _check_counts(decoders, None)
    with DecoderTransaction(decoders, counts, _token_ids(decoders, counts, True, token_ids)) as tx:
        return tx.step(0, q, k, v, checked=True)
