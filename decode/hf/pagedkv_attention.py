"""The "pagedkv" attention implementation and its mask function, as transformers calls them.

    paged_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs)
        query [B, num_q_heads, T, head_dim], key/value [B, num_kv_heads, T, head_dim] (the new states, as
        `PagedCache.update` returned them) -> (out [B, T, num_q_heads, head_dim_v], None)
    paged_mask(batch_size, q_length, kv_length, q_offset, kv_offset, mask_function, attention_mask, ...)
        -> None (no padding) or bool [B, T]: which new columns are real tokens

The mask function checks that the model asks for what the kernels compute (causal, optionally a sliding
window), then passes on only the padding of the new columns; the kernels mask by absolute position.
"""
import torch

from . import handoff
from .layout import UnsupportedFeatureError, check_supported

try:                                   # how transformers 5.23 records output_attentions=True for every model
    from transformers.utils.output_capturing import _active_collector
except ImportError:                    # pragma: no cover - another transformers version
    _active_collector = None

# kwargs that change the scores in ways the kernels do not compute
_REFUSED_KWARGS = {
    "softcap": "attention logit soft-capping",
    "s_aux": "attention sinks",
    "sinks": "attention sinks",
    "position_bias": "additive position biases",
    "alibi": "ALiBi position biases",
}


def _flag(module, name: str, default: bool):
    """``getattr(module, name, default)`` for a plain attribute of the module or its class, without
    `torch.nn.Module.__getattr__`'s search and exception when neither has it (~2 µs a miss, per layer)."""
    found = module.__dict__.get(name, _MISSING)
    if found is not _MISSING:
        return found
    return getattr(module, name) if hasattr(type(module), name) else default     # a class attribute or property


_MISSING = object()


def _outputs_attentions(kwargs) -> bool:
    if kwargs.get("output_attentions"):
        return True
    collected = _active_collector.get() if _active_collector is not None else None
    return isinstance(collected, dict) and "attentions" in collected


def _refuse(module, query, key, attention_mask, dropout, kwargs) -> None:
    """UnsupportedFeatureError naming the first feature of this call the kernels cannot compute exactly."""
    if not _REFUSED_KWARGS.keys().isdisjoint(kwargs):
        for name, feature in _REFUSED_KWARGS.items():
            if kwargs.get(name) is not None:
                raise UnsupportedFeatureError(f"{name}: pagedkv computes plain softmax attention, got {feature}")
    if _outputs_attentions(kwargs):
        raise UnsupportedFeatureError("output_attentions=True: the kernels never form the attention weights "
                                      "(use attn_implementation='eager' to inspect them)")
    if _flag(module, "is_cross_attention", False) or not _flag(module, "is_causal", True) \
            or key.shape[2] != query.shape[2]:
        raise UnsupportedFeatureError("cross-attention / non-causal attention: pagedkv attends causally over the "
                                      "cached self-attention K/V only")
    if dropout:
        raise UnsupportedFeatureError(f"dropout: pagedkv is for inference (model.eval()), got dropout={dropout}")
    if query.requires_grad:
        raise UnsupportedFeatureError("autograd: pagedkv does not backpropagate; run under torch.no_grad() or "
                                      "torch.inference_mode()")
    if attention_mask is not None and (not isinstance(attention_mask, torch.Tensor) or attention_mask.ndim != 2
                                       or attention_mask.dtype != torch.bool):
        shape = tuple(attention_mask.shape) if hasattr(attention_mask, "shape") else type(attention_mask).__name__
        raise UnsupportedFeatureError(f"attention_mask: pagedkv takes 2-D padding masks, got {shape} (a prepared "
                                      f"4-D / additive mask cannot be computed exactly by the kernels)")


def paged_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Attention of one layer through the paged pool (registered as "pagedkv")."""
    layer = getattr(module, "layer_idx", None)
    given = handoff.take(layer)
    if given is None or layer == 0:    # later layers of a forward: the cache checked the config at layer 0
        check_supported(module.config)
    if given is None or key is not given.pending_key or value is not given.pending_value:
        raise TypeError(f"past_key_values: attn_implementation='pagedkv' expected a decode.hf.PagedCache whose "
                        f"update() ran for layer {layer} just before and handed over these K/V, got "
                        f"none (a DynamicCache, StaticCache, "
                        f"cache_implementation=... or use_cache=False does not reach the paged pool: pass "
                        f"past_key_values=PagedCache(model.config, max_tokens=...) and use_cache=True)")
    key, value = given.key, given.value
    _refuse(module, query, key, attention_mask, dropout, kwargs)
    new_real = None if attention_mask is None else attention_mask.detach().cpu().numpy()
    window = int(kwargs.get("sliding_window") or 0)
    out = given.cache.attend(layer, module.config, query, key, value, new_real, scaling, window)
    return out, None


def _check_mask_function(mask_function, batch_size, q_length, kv_length, q_offset, kv_offset, local_size) -> None:
    """Refuse mask functions other than causal (and sliding-window causal of ``local_size``): they are evaluated
    on this forward's index grid and compared with the pattern the kernels apply."""
    from transformers.masking_utils import causal_mask_function

    if mask_function is causal_mask_function and local_size is None:
        return
    b = torch.arange(batch_size)[:, None, None, None]
    h = torch.zeros(1, dtype=torch.long)[None, :, None, None]
    q = (torch.arange(q_length) + q_offset)[None, None, :, None]
    kv = (torch.arange(kv_length) + kv_offset)[None, None, None, :]
    expected = kv <= q
    if local_size is not None:
        expected = expected & (kv > q - local_size)
    try:
        got = mask_function(b, h, q, kv)
        same = bool(torch.equal(torch.broadcast_to(got, (batch_size, 1, q_length, kv_length)),
                                torch.broadcast_to(expected, (batch_size, 1, q_length, kv_length))))
    except Exception:
        same = False
    if not same:
        raise UnsupportedFeatureError("mask_function: pagedkv computes causal (optionally sliding-window) "
                                      "attention only, got a different pattern (or_mask_function / "
                                      "and_mask_function, block_sequence_ids, bidirectional or chunked masks)")


def paged_mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, mask_function=None, attention_mask=None,
               local_size=None, **kwargs):
    """The mask function of "pagedkv": None (no padding) or ``bool [batch_size, q_length]``, True where a new
    column is a real token. ``attention_mask`` is transformers' 2-D padding mask ``[batch, past + new]``."""
    if mask_function is not None:
        _check_mask_function(mask_function, batch_size, q_length, kv_length, q_offset, kv_offset, local_size)
    if attention_mask is None:
        return None
    expected = (batch_size, int(q_offset) + q_length)
    if tuple(attention_mask.shape) != expected:
        raise ValueError(f"attention_mask: expected a 2-D padding mask [batch, past + new] = {expected}, got "
                         f"{tuple(attention_mask.shape)}")
    new = attention_mask[:, int(q_offset):].to(torch.bool)
    return None if bool(new.all()) else new
