"""A decode step's per-layer tensor glue: one new column per row, in one chunk (`decode.hf.plan.ForwardPlan`
with every row adding one token). The buffers and the torch views of them are made once per cache and shape (the
cache keeps them between forwards: each forward only overwrites them), so a layer costs one copy of q in and one
conversion of the output back (the plan checks q, k and v in one jitted call,
`layer_tensors.arrays_finite`); between the
model's GEMMs each Python step costs several times its standalone time (measured: the per-layer glue of a
bfloat16 decode step was ~400 µs against ~90 µs standalone).

    column = TokenColumn(batch, num_q_heads, head_dim, head_dim_v, compute)
    q = column.query(query)                   numpy [B, Hq, D] in the compute dtype (a view when it can be)
    out = column.output(dtype)                numpy [B, Hq, Dv] for the kernel
    column.result(out, dtype) -> torch [B, 1, Hq, Dv] in ``dtype``

Shapes as transformers hands them over: query ``[B, Hq, 1, D]``, key / value ``[B, H, 1, D]``.
"""
import numpy as np
import torch

TORCH_OF = {np.dtype(np.float32): torch.float32, np.dtype(np.float64): torch.float64}   # compute dtype -> torch


class TokenColumn:
    """The q and output buffers of a decode step (compute dtype), with torch views of them; no tensor handed out
    is a view of them, so the next layer or forward may overwrite them."""

    def __init__(self, batch: int, num_q_heads: int, head_dim: int, head_dim_v: int, compute: np.dtype):
        self.compute = compute
        self._q = np.empty((batch, num_q_heads, head_dim), compute)
        self._out = np.empty((batch, num_q_heads, head_dim_v), compute)
        self._q_in = torch.from_numpy(self._q).view(batch, num_q_heads, 1, head_dim)      # query's shape
        self._out_t = torch.from_numpy(self._out).view(batch, 1, num_q_heads, head_dim_v)  # the output's

    def query(self, query: torch.Tensor) -> np.ndarray:
        """q ``[B, Hq, D]`` in the compute dtype: a view of a contiguous query of that dtype, else a copy in the
        forward's buffer (which the next layer overwrites)."""
        if query.dtype is TORCH_OF.get(self.compute) and query.is_contiguous():
            return query.numpy().reshape(self._q.shape)
        self._q_in.copy_(query)
        return self._q

    def output(self, dtype: torch.dtype) -> np.ndarray:
        """The kernel's output ``[B, Hq, Dv]`` for a layer whose output is in ``dtype``: a new array when that is
        the compute dtype (the layer's tensor is then a view of it), else the forward's buffer."""
        return np.empty_like(self._out) if dtype is TORCH_OF.get(self.compute) else self._out

    def result(self, out: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
        """The layer's ``[B, 1, Hq, Dv]`` output in ``dtype`` from `output`'s array (a new tensor each layer: the
        model may keep it)."""
        if out is self._out:
            return self._out_t.to(dtype)
        return torch.from_numpy(out).view(self._out_t.shape)
