"""Building the engine's parts from its arguments: the model (a local checkpoint directory, loaded offline, or
a model object), its tokenizer, the dtypes, the attention shape and scale, and the pool size from a memory
budget ("2GiB", "512MiB", an int of bytes) or a token count.
"""
import os
import re

import torch

from decode.hf import UnsupportedFeatureError, layout_of

from .packed_attention import ATTN_IMPLEMENTATION

MODEL_DTYPES = {"float32": torch.float32, "float64": torch.float64, "float16": torch.float16,
                "bfloat16": torch.bfloat16}
POOL_DTYPES = ("float16", "float32", "float64", "int8")       # what kvcache stores ("bfloat16" not yet)
_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000 ** 2, "mb": 1000 ** 2, "g": 1000 ** 3, "gb": 1000 ** 3,
          "t": 1000 ** 4, "tb": 1000 ** 4, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}


def parse_memory(name: str, value) -> int:
    """Bytes of ``value``: an int, or a string like "2GiB", "512MiB", "1.5GB" (binary KiB/MiB/GiB/TiB, decimal
    KB/MB/GB/TB)."""
    if isinstance(value, bool):
        raise TypeError(f"{name}: expected an int of bytes or a string like '2GiB', got bool")
    if isinstance(value, int):
        if value < 1:
            raise ValueError(f"{name}: expected a positive number of bytes, got {value}")
        return value
    if not isinstance(value, str):
        raise TypeError(f"{name}: expected an int of bytes or a string like '2GiB', got {type(value).__name__}")
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", value)
    unit = match and match.group(2).lower()
    if not match or unit not in _UNITS:
        raise ValueError(f"{name}: expected bytes like '2GiB', '512MiB', '1.5GB' or an int, got {value!r}")
    nbytes = int(float(match.group(1)) * _UNITS[unit])
    if nbytes < 1:
        raise ValueError(f"{name}: expected a positive size, got {value!r}")
    return nbytes


def load_model(model, dtype: str):
    """``(model, name)``: ``model`` loaded from a local directory (offline) or taken as given, switched to the
    engine's attention implementation, in eval mode and in ``dtype`` ("auto": as stored / as given)."""
    if dtype != "auto" and dtype not in MODEL_DTYPES:
        raise ValueError(f"dtype: expected 'auto' or one of {sorted(MODEL_DTYPES)}, got {dtype!r}")
    if isinstance(model, (str, os.PathLike)):
        from transformers import AutoModelForCausalLM

        path = os.fspath(model)
        if not os.path.isdir(path):
            raise ValueError(f"model: expected a local checkpoint directory or a model object, got {path!r} "
                             f"(not a directory)")
        loaded = AutoModelForCausalLM.from_pretrained(path, dtype=dtype if dtype == "auto" else MODEL_DTYPES[dtype],
                                                      attn_implementation=ATTN_IMPLEMENTATION, local_files_only=True)
        name = path
    elif isinstance(model, torch.nn.Module) and hasattr(model, "config"):
        loaded = model if dtype == "auto" else model.to(MODEL_DTYPES[dtype])
        loaded.set_attn_implementation(ATTN_IMPLEMENTATION)
        name = getattr(model.config, "name_or_path", "") or type(model).__name__
    else:
        raise TypeError(f"model: expected a local checkpoint directory or a transformers model, got "
                        f"{type(model).__name__}")
    return loaded.eval(), name


def load_tokenizer(tokenizer, model):
    """The tokenizer given, one loaded from ``tokenizer`` (a directory), from the model's directory when the
    model was given as one, else None."""
    if tokenizer is not None and not isinstance(tokenizer, (str, os.PathLike)):
        return tokenizer
    path = tokenizer if tokenizer is not None else (model if isinstance(model, (str, os.PathLike)) else None)
    if path is None:
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(os.fspath(path), local_files_only=True)
    except (OSError, ValueError):
        if tokenizer is not None:
            raise
        return None                                       # a checkpoint without a tokenizer: token ids only


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def pool_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> str:
    """The pool's storage dtype: "auto" follows the model's dtype where the pool stores it, else float32."""
    if kv_cache_dtype == "auto":
        name = dtype_name(model_dtype)
        return name if name in POOL_DTYPES else "float32"
    if kv_cache_dtype not in POOL_DTYPES:
        raise ValueError(f"kv_cache_dtype: expected 'auto' or one of {list(POOL_DTYPES)}, got {kv_cache_dtype!r}")
    return kv_cache_dtype


def attention_shape(model):
    """`decode.hf.ModelLayout` of ``model``; refuses (UnsupportedFeatureError) what the engine cannot compute."""
    layout = layout_of(model.config)
    if any(layout.windows):
        raise UnsupportedFeatureError(f"sliding-window layers (windows {sorted(set(layout.windows))}): the engine "
                                      f"serves full-attention models only")
    return layout


def attention_scale(model, head_dim: int) -> float:
    """The score scale of the model's attention layers (``module.scaling``); one value for all layers."""
    scales = {float(m.scaling) for m in model.modules() if hasattr(m, "layer_idx") and hasattr(m, "scaling")}
    if len(scales) > 1:
        raise UnsupportedFeatureError(f"per-layer attention scales {sorted(scales)}: the engine attends every layer "
                                      f"with one scale")
    return scales.pop() if scales else head_dim ** -0.5


def eos_ids(model, tokenizer) -> frozenset:
    """The model's end-of-sequence token ids (generation config, config, tokenizer)."""
    found = set()
    for source in (getattr(model, "generation_config", None), model.config, tokenizer):
        value = getattr(source, "eos_token_id", None) if source is not None else None
        if value is None:
            continue
        found.update([value] if isinstance(value, int) else list(value))
    return frozenset(int(v) for v in found)
