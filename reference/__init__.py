"""The reference lab: float64 attention, a 50-digit Decimal oracle and the audit of the source document.

Imports only NumPy and the standard library (never ``kvcache`` or ``decode``), so it can judge them.

    from reference import decode_reference, kv_bytes
    python -m reference.audit --out DIR
"""
from .dense import (AttentionResult, attention, attention_context, attention_weights, causal_mask,
                    decode_reference, masked_scores, scaled_scores, softmax_over_keys, visible_mask)
from .memory import kv_bytes
from .naive_cache import NaiveKVCache

__all__ = ["AttentionResult", "NaiveKVCache", "attention", "attention_context", "attention_weights", "causal_mask",
           "decode_reference", "kv_bytes", "masked_scores", "scaled_scores", "softmax_over_keys", "visible_mask"]
