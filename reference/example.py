"""The source document's fixed 3-token example (projected Q/K/V, not embeddings of a trained model).

Three positions 0, 1, 2; ``head_dim = 4`` for Q/K and ``head_dim_v = 2`` for V.  The arrays are rebuilt
on every call so no caller can mutate a shared copy.
"""
from __future__ import annotations

import numpy as np

__all__ = ["example_q", "example_k", "example_v", "example_qkv"]


def example_q() -> np.ndarray:
    """Queries, float64 ``[3, 4]``."""
    return np.array([[1.0, 0.5, -0.2, 0.1],
                     [-0.5, 1.2, 0.8, -0.4],
                     [0.2, -0.1, 1.5, 0.9]], dtype=np.float64)


def example_k() -> np.ndarray:
    """Keys, float64 ``[3, 4]``."""
    return np.array([[0.8, 0.4, -0.3, 0.0],
                     [-0.2, 1.0, 0.5, -0.1],
                     [0.1, -0.2, 1.1, 0.7]], dtype=np.float64)


def example_v() -> np.ndarray:
    """Values, float64 ``[3, 2]``."""
    return np.array([[1.0, 0.0], [0.0, 1.0], [-1.0, -1.0]], dtype=np.float64)


def example_qkv() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(q [3, 4], k [3, 4], v [3, 2])``."""
    return example_q(), example_k(), example_v()
