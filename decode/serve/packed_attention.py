"""The engine's attention implementation ("kvengine"): every layer's attention of a packed forward is one
`decode.DecoderTransaction.extend` call over the ragged batch (per-sequence page tables and positions).

transformers calls ``packed_attention(module, query, key, value, attention_mask, scaling, dropout, **kwargs)``
with ``query [1, num_q_heads, N, head_dim]``, ``key`` / ``value [1, num_kv_heads, N, head_dim]`` (the N packed
new tokens of every scheduled request, RoPE applied from their own position_ids) and expects
``([1, N, num_q_heads, head_dim_v], None)``. No mask function is registered under the name, so transformers
builds no mask at all; the kernels mask by each query's absolute position in its own sequence. The forward
being run (`PackedForward`, set by `decode.serve.runner`) reaches the call through a context variable:
transformers passes no cache object to attention functions.
"""
import contextlib
import contextvars

import numpy as np
import torch
from transformers import AttentionInterface

from decode.hf import UnsupportedFeatureError

ATTN_IMPLEMENTATION = "kvengine"

_FORWARD = contextvars.ContextVar("kvengine_forward", default=None)

# kwargs that change the scores in ways the kernels do not compute
_REFUSED_KWARGS = {"softcap": "attention logit soft-capping", "s_aux": "attention sinks", "sinks": "attention sinks",
                   "position_bias": "additive position biases", "alibi": "ALiBi position biases",
                   "sliding_window": "sliding-window attention"}


class PackedForward:
    """One forward's open `decode.DecoderTransaction` and the dtypes of its tensors.

    tx : the transaction over the scheduled requests' decoders (ragged counts)
    scale : the scale the decoders attend with (the model's ``module.scaling`` must equal it)
    """

    def __init__(self, tx, scale: float, compute: torch.dtype):
        self.tx, self.scale, self.compute = tx, scale, compute
        self.num_tokens = sum(tx.counts)
        self.layers = 0

    def rows(self, x: torch.Tensor) -> np.ndarray:
        """``x [1, H, N, D]`` -> ``[N, H, D]`` numpy in the pool's compute dtype."""
        return x[0].transpose(0, 1).to(self.compute).contiguous().numpy()

    def attend(self, layer: int, query, key, value) -> torch.Tensor:
        out = self.tx.extend(layer, self.rows(query), self.rows(key), self.rows(value), checked=False)
        self.layers += 1
        return torch.from_numpy(out).to(query.dtype)[None]           # [1, N, num_q_heads, head_dim_v]


def _refusal(module, query, key, attention_mask, scaling, dropout, kwargs, forward: PackedForward) -> str | None:
    """What of this call the engine cannot compute exactly (the message), or None."""
    refused = [f"{name}: the engine computes plain causal softmax attention, got {feature}"
               for name, feature in _REFUSED_KWARGS.items() if kwargs.get(name)]
    self_attention = not getattr(module, "is_cross_attention", False) and key.shape[2] == query.shape[2]
    checks = (
        (self_attention and getattr(module, "is_causal", True),
         "cross-attention / non-causal attention: the engine attends causally over its own cached K/V only"),
        (not dropout, f"dropout: the engine is for inference (model.eval()), got dropout={dropout}"),
        (attention_mask is None, f"attention_mask: the engine masks by position, got a prepared mask "
                                 f"{tuple(getattr(attention_mask, 'shape', ()))}"),
        (scaling is None or float(scaling) == forward.scale,
         f"scaling: the engine's decoders attend with scale {forward.scale}, layer "
         f"{getattr(module, 'layer_idx', None)} asks for {scaling} (per-layer scales)"),
    )
    refused += [message for ok, message in checks if not ok]
    return refused[0] if refused else None


def packed_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """One layer's attention of the packed forward now running (see the module docstring)."""
    forward = _FORWARD.get()
    if forward is None:
        raise TypeError(f"attn_implementation={ATTN_IMPLEMENTATION!r}: expected a forward run by decode.serve.Engine "
                        f"(Engine.step), got a call outside it")
    refused = _refusal(module, query, key, attention_mask, scaling, dropout, kwargs, forward)
    if refused:
        raise UnsupportedFeatureError(refused)
    if query.shape[0] != 1 or query.shape[2] != forward.num_tokens:
        raise ValueError(f"query: expected [1, num_q_heads, {forward.num_tokens}, head_dim] (the packed tokens), got "
                         f"{tuple(query.shape)}")
    return forward.attend(module.layer_idx, query, key, value), None


@contextlib.contextmanager
def active(forward: PackedForward):
    """``with active(forward): model(...)``: the attention calls inside see ``forward``."""
    token = _FORWARD.set(forward)
    try:
        yield forward
    finally:
        _FORWARD.reset(token)


def register(name: str = ATTN_IMPLEMENTATION) -> str:
    """Register `packed_attention` under ``name`` (class-wide; no mask function, so no mask is built)."""
    AttentionInterface.register(name, packed_attention)
    return name


register()
