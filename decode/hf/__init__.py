"""transformers integration: `PagedCache` (a `transformers.Cache` over one paged pool) and the "pagedkv"
attention implementation (our kernels over the page tables), registered on import.

    import decode.hf
    from decode.hf import PagedCache

    model = AutoModelForCausalLM.from_config(config, attn_implementation="pagedkv")
    cache = PagedCache(model.config, max_tokens=8192, dtype="float32", page_size=16)
    out = model.generate(input_ids, attention_mask=mask, past_key_values=cache, max_new_tokens=64)

Needs the ``hf`` extra (torch, transformers); ``import decode`` never imports them. See docs/transformers.md.
"""
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from .pagedkv_attention import paged_attention, paged_mask
from .paged_cache import PagedCache
from .handoff import PagedAttentionRequired
from .layout import ModelLayout, UnsupportedFeatureError, layout_of

ATTN_IMPLEMENTATION = "pagedkv"


def register(name: str = ATTN_IMPLEMENTATION) -> str:
    """Register the attention implementation and its mask function under ``name`` (class-wide, so every model
    constructed afterwards accepts ``attn_implementation=name``). Done for "pagedkv" on import."""
    AttentionInterface.register(name, paged_attention)
    AttentionMaskInterface.register(name, paged_mask)
    return name


register()

__all__ = ["PagedCache", "PagedAttentionRequired", "ModelLayout", "UnsupportedFeatureError", "layout_of", "register",
           "ATTN_IMPLEMENTATION"]
