"""The simplest possible KV cache: validate, then ``np.concatenate``.

Every append copies the whole history, so this is a correctness yardstick, not an inference server.
Its one promise is transactional: an append that fails validation leaves the stored K/V byte-identical.
"""
from __future__ import annotations

import numbers

import numpy as np

from .dense import check_float_array

__all__ = ["NaiveKVCache"]


class NaiveKVCache:
    """K/V history of one sequence, grown by concatenation.

    Parameters
    ----------
    num_kv_heads, head_dim : int
        Shape of one token's K: ``[num_kv_heads, head_dim]``.
    head_dim_v : int, optional
        Per-head dimension of V; defaults to ``head_dim``.

    Attributes
    ----------
    k : ndarray, float64, [length, num_kv_heads, head_dim]
    v : ndarray, float64, [length, num_kv_heads, head_dim_v]
    """

    def __init__(self, num_kv_heads: int, head_dim: int, head_dim_v: int | None = None):
        for name, value in (("num_kv_heads", num_kv_heads), ("head_dim", head_dim),
                            ("head_dim_v", head_dim if head_dim_v is None else head_dim_v)):
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
                raise ValueError(f"{name}: expected an int >= 1, got {value!r}")
        head_dim_v = head_dim if head_dim_v is None else head_dim_v
        self.k = np.empty((0, int(num_kv_heads), int(head_dim)), dtype=np.float64)
        self.v = np.empty((0, int(num_kv_heads), int(head_dim_v)), dtype=np.float64)

    @property
    def length(self) -> int:
        """Number of cached tokens (the ``query_start`` of the next appended block)."""
        return self.k.shape[0]

    def append(self, k, v) -> int:
        """Append ``T`` tokens; all checks run before anything is stored.

        Parameters
        ----------
        k : array_like, float, [T, num_kv_heads, head_dim]
        v : array_like, float, [T, num_kv_heads, head_dim_v]

        Returns
        -------
        int
            The position of the first appended token (the length before the append).

        Raises
        ------
        TypeError, ValueError
            Non-float dtype, non-finite values, or a shape that does not match the cache.
        """
        k = check_float_array("k", k)
        v = check_float_array("v", v)
        if k.ndim != 3 or k.shape[1:] != self.k.shape[1:]:
            raise ValueError(f"k: expected shape [T, {self.k.shape[1]}, {self.k.shape[2]}], got {k.shape}")
        if v.ndim != 3 or v.shape[1:] != self.v.shape[1:]:
            raise ValueError(f"v: expected shape [T, {self.v.shape[1]}, {self.v.shape[2]}], got {v.shape}")
        if v.shape[0] != k.shape[0]:
            raise ValueError(f"v: expected {k.shape[0]} tokens like k, got {v.shape[0]}")
        start = self.length
        self.k = np.concatenate([self.k, k], axis=0)
        self.v = np.concatenate([self.v, v], axis=0)
        return start
