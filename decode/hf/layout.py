"""What a transformers model config means for the paged pool: layers, KV heads, head sizes, per-layer windows,
and the features our kernels cannot compute exactly (refused by name, never approximated).

Imports transformers only for `get_layer_types_and_kwargs` (the rule transformers itself uses to decide which
layers slide), so our reading of a config is the same as `DynamicCache(config=...)`'s.
"""
from dataclasses import dataclass

from transformers.cache_utils import get_layer_types_and_kwargs

_SUPPORTED_LAYER_TYPES = ("full_attention", "sliding_attention")


class UnsupportedFeatureError(NotImplementedError):
    """A model feature the paged kernels cannot compute exactly (the message names it and says why)."""


@dataclass(frozen=True)
class ModelLayout:
    """The attention shape of a decoder-only model, as the paged pool stores it.

    ``windows[layer]`` is the sliding window of that layer (query at position p reads keys in (p - window, p]),
    0 for full attention.
    """

    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    windows: tuple

    @property
    def release_window(self) -> int:
        """The window after which pages may go back to the pool: the widest window when *every* layer slides,
        else 0 (a full-attention layer reads the whole history)."""
        return max(self.windows) if self.windows and min(self.windows) > 0 else 0

    def describe(self) -> str:
        return (f"{self.num_layers} layers, {self.num_q_heads} q / {self.num_kv_heads} kv heads, head_dim "
                f"{self.head_dim}, windows {sorted(set(self.windows))}")


def refusals(config) -> list[str]:
    """Names (with the reason) of the features of ``config`` the kernels cannot compute exactly."""
    found = []
    for name in ("attn_logit_softcapping",):
        if getattr(config, name, None) not in (None, 0, 0.0):
            found.append(f"attention logit soft-capping ({name}={getattr(config, name)}): the kernels apply "
                         f"no tanh cap to the scores")
    if getattr(config, "alibi", False) or getattr(config, "position_embedding_type", None) == "alibi":
        found.append("ALiBi position biases: the kernels add no bias to the scores")
    if getattr(config, "is_encoder_decoder", False) or getattr(config, "add_cross_attention", False):
        found.append("cross-attention (encoder-decoder): the paged pool holds self-attention K/V only")
    if not getattr(config, "is_causal", True):
        found.append("bidirectional attention (is_causal=False): the kernels mask by position p >= key")
    return found


def check_supported(config) -> None:
    """UnsupportedFeatureError naming every feature of ``config`` the kernels cannot compute exactly."""
    found = refusals(config)
    if found:
        raise UnsupportedFeatureError("pagedkv cannot run this model exactly: " + "; ".join(found))


# the config attributes `layout_of` reads (a change in any of them means another layout)
_LAYOUT_ATTRIBUTES = ("num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_size",
                      "layer_types", "sliding_window", "use_sliding_window", "max_window_layers",
                      "attn_logit_softcapping", "is_encoder_decoder", "add_cross_attention", "is_causal",
                      "n_layer", "n_head", "n_embd")


def layout_key(config) -> tuple:
    """A cheap key of ``config``: its identity and the values `layout_of` reads (lists copied as tuples)."""
    return (id(config),) + tuple(tuple(v) if isinstance(v, list) else v
                                 for v in (getattr(config, name, None) for name in _LAYOUT_ATTRIBUTES))


def layout_of(config) -> ModelLayout:
    """The `ModelLayout` of a transformers (decoder) config; refuses what `check_supported` refuses and layer
    types other than full / sliding attention (chunked, linear, ...)."""
    config = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    check_supported(config)
    num_q_heads = int(config.num_attention_heads)
    num_kv_heads = getattr(config, "num_key_value_heads", None) or num_q_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_q_heads
    layer_types, layer_kwargs = get_layer_types_and_kwargs(config)
    layer_types = list(layer_types)[: config.num_hidden_layers]
    bad = sorted(set(layer_types) - set(_SUPPORTED_LAYER_TYPES))
    if bad:
        raise UnsupportedFeatureError(f"config.layer_types: pagedkv computes {_SUPPORTED_LAYER_TYPES} layers "
                                      f"only, got {bad}")
    windows = tuple(int(kw.get("sliding_window") or 0) if kind == "sliding_attention" else 0
                    for kind, kw in zip(layer_types, layer_kwargs))
    return ModelLayout(num_layers=int(config.num_hidden_layers), num_q_heads=num_q_heads,
                       num_kv_heads=int(num_kv_heads), head_dim=int(head_dim), windows=windows)
