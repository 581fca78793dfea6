"""The model runner: one packed forward per step, no padding.

The scheduled tokens of every request go in as one row, ``input_ids [1, N]`` with ``position_ids [1, N]``
(each token's absolute position in its own sequence, so RoPE is the model's own), inside one
`decode.batch_transaction` over the requests' decoders: every layer's attention writes its K/V into the pool
and attends with one kernel call (`decode.serve.packed_attention`); the transaction commits after the forward,
so a step's tokens land in every layer or in none. Only the rows that are sampled go through the LM head
(``logits_to_keep``).
"""
import inspect
import os

import numba
import numpy as np
import torch

from decode import batch_transaction
from decode.hf.plan import PARALLEL_QUERIES

from .packed_attention import PackedForward, active


def prefer_workqueue() -> str:
    """Use numba's own "workqueue" thread pool rather than its OpenMP layer, unless a parallel kernel already
    ran (the layer is then fixed) or ``NUMBA_THREADING_LAYER`` says otherwise; returns the layer chosen.

    numba's OpenMP layer loads the system libgomp next to torch's bundled one; once its threads exist, small
    torch ops of the same process slowed by ~100x (torch.argmax of [32, 4000]: 0.25 ms -> 20-27 ms, measured
    here, reproducible) and an engine decode step of a small model by 4x (72 vs 18 ms); the kernels run as
    fast on either layer (a 2 x 1024-token batch_extend: 182-201 vs 185-191 ms). workqueue terminates the
    process when parallel kernels are launched from several threads at once: the engine launches them from its
    one thread; a program that also runs kernels from other threads sets NUMBA_THREADING_LAYER=omp."""
    try:
        return numba.threading_layer()                   # already initialized: nothing to choose any more
    except ValueError:
        pass
    if not os.environ.get("NUMBA_THREADING_LAYER"):
        numba.config.THREADING_LAYER = "workqueue"
    return numba.config.THREADING_LAYER


class ModelRunner:
    """Runs ``model`` (a transformers causal LM whose attention implementation is "kvengine") over a
    `decode.serve.pages.PagePool`.

    kernel_threads: numba threads of the attention kernel for forwards of fewer than
    `decode.hf.plan.PARALLEL_QUERIES` tokens (decode steps); 1 by default, as in `decode.hf.PagedCache`
    (torch's OpenMP threads keep spinning after each op and take the cores numba's threads would wait for)."""

    def __init__(self, model, pool, kernel_threads: int | None = 1):
        self.model = model
        self.pool = pool
        self.kernel_threads = kernel_threads
        self.compute = torch.float64 if pool.cache.config.dtype == np.float64 else torch.float32
        self.num_layers = pool.cache.config.num_layers
        self.keeps_logits = "logits_to_keep" in inspect.signature(model.forward).parameters
        self.forwards = 0
        self.threading_layer = prefer_workqueue()

    def inputs(self, batch) -> tuple[list, list, list, list]:
        """(token ids [N], positions [N], per-request id arrays, indices of the sampled rows) of ``batch``."""
        ids, positions, per_request, last = [], [], [], []
        offset = 0
        for request, count in zip(batch.requests, batch.counts):
            start = request.num_computed
            chunk = request.tokens[start:start + count]
            ids.extend(chunk)
            positions.extend(range(start, start + count))
            per_request.append(np.asarray(chunk, dtype=np.int64))
            offset += count
            if start + count == len(request.tokens):
                last.append(offset - 1)
        return ids, positions, per_request, last

    def forward(self, batch) -> torch.Tensor:
        """Compute ``batch`` (a `decode.serve.scheduler.ScheduledBatch`) and advance each request's
        ``num_computed``; returns float32 logits ``[R, vocab]`` of the R requests whose chunk reaches the end of
        their tokens (in batch order): the ones that sample a token this step."""
        ids, positions, per_request, last = self.inputs(batch)
        token_ids = per_request if self.pool.prefix_caching else None
        tx = batch_transaction([r.decoder for r in batch.requests], num_tokens=list(batch.counts),
                               token_ids=token_ids)
        try:
            logits = self._run(tx, ids, positions, last)
            tx.commit()
        except BaseException:
            tx.rollback()
            raise
        for request, count in zip(batch.requests, batch.counts):
            request.num_computed += count
        self.forwards += 1
        return logits

    def _run(self, tx, ids, positions, last) -> torch.Tensor:
        forward = PackedForward(tx, self.pool.scale, self.compute)
        input_ids = torch.tensor([ids], dtype=torch.long)
        position_ids = torch.tensor([positions], dtype=torch.long)
        keep = torch.tensor(last, dtype=torch.long)
        extra = {"logits_to_keep": keep} if self.keeps_logits else {}
        threads = numba.get_num_threads()
        if self.kernel_threads is not None and len(ids) < PARALLEL_QUERIES:
            numba.set_num_threads(min(self.kernel_threads, numba.config.NUMBA_NUM_THREADS))
        try:
            with active(forward), torch.inference_mode():
                out = self.model(input_ids=input_ids, position_ids=position_ids, use_cache=False, **extra)
        finally:
            numba.set_num_threads(threads)
        if forward.layers != self.num_layers:
            raise RuntimeError(f"forward: expected {self.num_layers} attention calls (one per layer), got "
                               f"{forward.layers}: a layer bypassed the engine's attention")
        logits = out.logits[0]
        if not self.keeps_logits:
            logits = logits[keep]
        return logits.to(torch.float32)                    # as generate() does before choosing a token
