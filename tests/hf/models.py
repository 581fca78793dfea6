"""Tiny random-weight models of each architecture (built from configs, no download) and the two ways of running
them: the reference (DynamicCache + "sdpa"/"eager") and ours (PagedCache + "pagedkv"), same weights."""
import copy

import torch
from transformers import (AutoModelForCausalLM, GPT2Config, LlamaConfig, MistralConfig, Qwen2Config)

import decode.hf  # noqa: F401  (registers "pagedkv")
from decode.hf import PagedCache

VOCAB = 96
_COMMON = dict(vocab_size=VOCAB, eos_token_id=None, bos_token_id=None, pad_token_id=0)


def _llama(**kw):
    base = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                max_position_embeddings=256, **_COMMON)
    return LlamaConfig(**{**base, **kw})


CONFIGS = {
    "llama-mha": lambda: _llama(num_key_value_heads=4),
    "llama-gqa": lambda: _llama(num_attention_heads=8, num_key_value_heads=2),
    "llama-mqa": lambda: _llama(num_key_value_heads=1),
    "llama-head-dim": lambda: _llama(num_key_value_heads=2, head_dim=12),          # head_dim != hidden / heads
    "gpt2": lambda: GPT2Config(n_embd=32, n_layer=3, n_head=4, n_positions=256, scale_attn_by_inverse_layer_idx=True,
                               **_COMMON),
    "mistral-window": lambda: MistralConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                            num_attention_heads=4, num_key_value_heads=2, sliding_window=7,
                                            max_position_embeddings=256, **_COMMON),
    "qwen2": lambda: Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                                 num_key_value_heads=2, use_sliding_window=True, sliding_window=6,
                                 max_window_layers=1, max_position_embeddings=256, **_COMMON),
}
ARCHS = list(CONFIGS)

_MODELS = {}


def model_pair(arch: str, dtype=torch.float32):
    """(reference model with "sdpa", paged model with "pagedkv"): the same weights, eval mode, cached."""
    key = (arch, dtype)
    if key not in _MODELS:
        torch.manual_seed(1234)
        ref = AutoModelForCausalLM.from_config(CONFIGS[arch](), attn_implementation="sdpa").to(dtype).eval()
        paged = copy.deepcopy(ref)
        paged.set_attn_implementation("pagedkv")
        _MODELS[key] = ref, paged
    return _MODELS[key]


def build(config, attn_implementation: str, dtype=torch.float64, seed: int = 1234):
    """A model of ``config`` on ``attn_implementation`` with seeded random weights, eval mode. Built from its own
    copy of the config: transformers' from_config writes the implementation into the config it is given."""
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(copy.deepcopy(config),
                                            attn_implementation=attn_implementation).to(dtype).eval()


def paged_cache(model, dtype="float32", max_tokens=2048, page_size=4):
    return PagedCache(model.config, max_tokens=max_tokens, dtype=dtype, page_size=page_size)


def prompts(batch: int, length: int, seed: int = 0, pad_lengths=None):
    """``input_ids [batch, length]``, ``attention_mask`` with ``pad_lengths[row]`` left pads (pad id 0)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (batch, length), generator=g)
    mask = torch.ones_like(ids)
    for row, pads in enumerate(pad_lengths or []):
        mask[row, :pads] = 0
    ids[mask == 0] = 0
    return ids, mask


def generate(model, ids, mask, cache=None, seed=None, **kw):
    """``model.generate`` returning the dict output with logits; ``seed`` seeds sampling."""
    if seed is not None:
        torch.manual_seed(seed)
    extra = {} if cache is None else {"past_key_values": cache}
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, return_dict_in_generate=True, output_logits=True, **extra,
                              **kw)
