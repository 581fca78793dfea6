"""Which storage dtype a `PagedCache` keeps its pages in: what the user gave (a name, a numpy dtype or a torch
dtype), else the model's dtype (a bfloat16 model gets bfloat16 pages, a float16 one float16 pages).

    storage_name(dtype) -> "float16" | "bfloat16" | "float32" | "float64" | "int8" | None
    for_model(torch_dtype) -> the default storage name for a model computing in ``torch_dtype``
    config_dtype(config) -> the torch dtype a config records (from_pretrained / from_config(dtype=...)), or None
"""
import numpy as np
import torch

from kvcache import KVCache

_TORCH = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32", torch.float64: "float64"}
_NAMES = ("float16", "bfloat16", "float32", "float64", "int8")


def storage_name(dtype) -> str | None:
    """The storage name of ``dtype`` (None stays None: follow the model). TypeError names what is accepted."""
    if dtype is None:
        return None
    if isinstance(dtype, torch.dtype):
        if dtype in _TORCH:
            return _TORCH[dtype]
    elif isinstance(dtype, str):
        if dtype in _NAMES:
            return dtype
    else:
        try:
            name = np.dtype(dtype).name
        except TypeError:
            name = None
        if name in _NAMES:
            return name
    raise TypeError(f"dtype: expected None (the model's dtype), one of {', '.join(_NAMES)} (names, numpy dtypes) or "
                    f"torch.float16 / torch.bfloat16 / torch.float32 / torch.float64, got {dtype!r}")


def for_model(torch_dtype: torch.dtype) -> str:
    """The default storage of a model computing in ``torch_dtype``: the same dtype (a bfloat16 model gets bfloat16
    pages, its K/V stored exactly); float32 for anything else."""
    return _TORCH.get(torch_dtype, "float32")


def pool_for_model(pool: KVCache, model_dtype: torch.dtype, rebuild: bool = True) -> KVCache:
    """``pool`` (built before the model's dtype was known), or an empty pool of the same shape in the model's
    default storage. ValueError when they differ and ``pool`` is in use (rows made by match_prefix) or
    ``rebuild`` is False."""
    name = for_model(model_dtype)
    cfg = pool.config
    if name == cfg.storage:
        return pool
    if not rebuild or pool.sequences or pool.num_cached_pages:
        raise ValueError(f"dtype: expected an explicit dtype for a cache used before its first forward "
                         f"(match_prefix), got None; the pool holds {cfg.storage} pages and the model computes in "
                         f"{model_dtype}: build PagedCache(..., dtype={model_dtype})")
    return KVCache(num_layers=cfg.num_layers, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, dtype=name,
                   page_size=cfg.page_size, num_pages=cfg.num_pages, prefix_caching=pool.prefix_caching,
                   namespace=pool.namespace)


def config_dtype(config) -> torch.dtype | None:
    """``config.dtype`` when it names a floating torch dtype (set by from_pretrained / from_config(dtype=...)),
    else None (a model built then moved with ``.to(dtype)`` keeps None: its dtype is known at the first forward)."""
    value = getattr(config, "dtype", None)
    if isinstance(value, str):
        value = getattr(torch, value, None)
    return value if isinstance(value, torch.dtype) and value in _TORCH else None
