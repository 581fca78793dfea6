"""Several decoders of one shared pool in one kernel call per layer: `batch_transaction`, `batch_extend`
(each decoder its own number of new tokens) and `batch_step` (continuous batching: one token each).

Everything is validated before any page is reserved; all or none of the tokens land.
"""
import numpy as np

from .decoder import Decoder
from .inputs import (check_batch_counts, check_batch_token_ids, check_decoders, check_single_layer, check_tokens,
                     checks_for, list_counts, split_ragged)
from .decoder_transaction import DecoderTransaction


def batch_transaction(decoders, num_tokens=None, *, token_ids=None) -> DecoderTransaction:
    """New tokens for each of ``decoders`` (distinct sequences of one shared pool), written layer by layer:
    one each (``num_tokens`` None: ``tx.step(layer, q, k, v)`` decodes all of them in one kernel call) or
    ``num_tokens[b]`` >= 0 for decoder b (``tx.extend(layer, q, k, v)``, ragged or lists, see
    `DecoderTransaction.extend`). Every page is reserved here; all or none of the tokens land.
    ``token_ids`` (optional, for prefix caching): one id per decoder (``[B]``) for one token each, else one
    ``[T_b]`` array per decoder or a ragged ``[N]`` array."""
    decoders = check_decoders(decoders, Decoder)
    counts = check_batch_counts(decoders, num_tokens)
    return DecoderTransaction(decoders, counts, check_batch_token_ids(decoders, counts, num_tokens is None, token_ids))


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
    decoders = check_decoders(decoders, Decoder)
    check_single_layer(decoders[0].config, "batch_extend")
    counts = check_batch_counts(decoders, list_counts(decoders, k) if num_tokens is None else num_tokens)
    ids = check_batch_token_ids(decoders, counts, False, token_ids)
    checked = check_tokens(decoders, list(counts.values()), q, k, v)       # before anything is reserved
    with DecoderTransaction(decoders, counts, ids) as tx:
        out = tx.extend(0, *checked, checked=True)
    return split_ragged(out, tx.counts) if num_tokens is None else out


def batch_step(decoders, q, k, v, *, token_ids=None) -> np.ndarray:
    """Continuous batching on a one-layer pool: append one token to each decoder and attend, in one kernel call.

    ``q [B, num_q_heads, head_dim]``, ``k [B, num_kv_heads, head_dim]``, ``v [B, num_kv_heads, head_dim_v]``
    -> ``[B, num_q_heads, head_dim_v]``; row b is decoder b's query at its own position (lengths may differ).
    """
    decoders = check_decoders(decoders, Decoder)
    check_single_layer(decoders[0].config, "batch_step")
    q, k, v = checks_for(decoders[0]).tokens(q, k, v, len(decoders))     # everything checked before any reservation
    counts = check_batch_counts(decoders, None)
    with DecoderTransaction(decoders, counts, check_batch_token_ids(decoders, counts, True, token_ids)) as tx:
        return tx.step(0, q, k, v, checked=True)
