"""The model runner: one packed forward per step, no padding.

The scheduled tokens of every request go in as one row, ``input_ids [1, N]`` with ``position_ids [1, N]``
(each token's absolute position in its own sequence, so RoPE is the model's own), inside one
`decode.batch_transaction` over the requests' decoders: every layer's attention writes its K/V into the pool
and attends with one kernel call (`decode.serve.packed_attention`); the transaction commits after the forward,
so a step's tokens land in every layer or in none. Only the rows that are sampled go through the LM head
(``logits_to_keep``).
"""
import inspect

import numba
import numpy as np
import torch

from decode import batch_transaction
from decode.hf.plan import PARALLEL_QUERIES, check_kernel_threads

from .packed_attention import PackedForward, active


class ModelRunner:
    """Runs ``model`` (a transformers causal LM whose attention implementation is "kvengine") over a
    `decode.serve.pages.PagePool`.

    kernel_threads: numba threads of the attention kernel for forwards of fewer than
    `decode.hf.plan.PARALLEL_QUERIES` tokens (decode steps): an int, None (numba's setting) or "auto" (the
    default, as in `decode.hf.PagedCache`: numba's setting on CPUs with AMX, 1 elsewhere, where torch's OpenMP
    threads keep spinning after each op and take the cores numba's threads would wait for; docs/serving.md).

    torch's thread count is restored after every forward: numba's OpenMP threading layer, at its first parallel
    launch, sets the OpenMP thread count of the process, and torch shares that libgomp (a process that had set
    torch to 1 thread ran it on 2 from then on: at the issue's model 1963 vs 453 ms per decode step, measured)."""

    def __init__(self, model, pool, kernel_threads: int | None | str = "auto"):
        self.model = model
        self.pool = pool
        self.kernel_threads = check_kernel_threads(kernel_threads)
        self.compute = torch.float64 if pool.cache.config.dtype == np.float64 else torch.float32
        self.num_layers = pool.cache.config.num_layers
        self.keeps_logits = "logits_to_keep" in inspect.signature(model.forward).parameters
        self.forwards = 0

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
        torch_threads = torch.get_num_threads()
        tx = batch_transaction([r.decoder for r in batch.requests], num_tokens=list(batch.counts),
                               token_ids=token_ids)
        try:
            logits = self._run(tx, ids, positions, last)
            tx.commit()
        except BaseException:
            tx.rollback()
            raise
        finally:
            if torch.get_num_threads() != torch_threads:     # numba's OpenMP layer, at its first launch, sets
                torch.set_num_threads(torch_threads)         # the OpenMP thread count torch shares (one libgomp)
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
