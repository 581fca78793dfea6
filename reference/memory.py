"""Raw KV-cache payload size: the formula the document uses, nothing allocated.

    bytes = layers * batch * tokens * kv_heads * (head_dim + head_dim_v) * bytes_per_element

which is ``2 * layers * batch * tokens * kv_heads * head_dim * bytes_per_element`` when K and V share a
head dimension.  It counts the K/V elements only: no page-table metadata, allocator slack, activations
or weights.  Paging changes how these bytes are allocated, not how many there are; GQA/MQA shrink the
number of KV heads.
"""
from __future__ import annotations

import numbers

__all__ = ["GIB", "kv_bytes", "gib", "parameter_bytes"]

GIB = 1024 ** 3


def _positive_int(name: str, value, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name}: expected an int, got {value!r} of type {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name}: expected an int >= {minimum}, got {value}")
    return int(value)


def kv_bytes(layers: int, batch: int, tokens: int, kv_heads: int, head_dim: int, bytes_per_element: int,
             head_dim_v: int | None = None) -> int:
    """Bytes of raw K and V for a whole model.

    Parameters
    ----------
    layers, batch, tokens, kv_heads : int
        ``tokens`` may be 0 (an empty cache); the others are >= 1.
    head_dim : int
        Per-head dimension of K.
    bytes_per_element : int
        2 for float16/bfloat16, 4 for float32, ...
    head_dim_v : int, optional
        Per-head dimension of V; defaults to ``head_dim``.

    Returns
    -------
    int
        ``layers * batch * tokens * kv_heads * (head_dim + head_dim_v) * bytes_per_element``.
    """
    layers = _positive_int("layers", layers)
    batch = _positive_int("batch", batch)
    tokens = _positive_int("tokens", tokens, minimum=0)
    kv_heads = _positive_int("kv_heads", kv_heads)
    head_dim = _positive_int("head_dim", head_dim)
    bytes_per_element = _positive_int("bytes_per_element", bytes_per_element)
    head_dim_v = head_dim if head_dim_v is None else _positive_int("head_dim_v", head_dim_v)
    return layers * batch * tokens * kv_heads * (head_dim + head_dim_v) * bytes_per_element


def parameter_bytes(parameters: int, bytes_per_element: int) -> int:
    """Raw bytes of ``parameters`` weights of ``bytes_per_element`` bytes each."""
    return _positive_int("parameters", parameters) * _positive_int("bytes_per_element", bytes_per_element)


def gib(num_bytes: int) -> float:
    """``num_bytes / 2**30``."""
    return num_bytes / GIB
