"""`Engine`: continuous batching of a transformers causal LM over one paged pool (the library; no HTTP here).

    engine = Engine("path/to/checkpoint", kv_cache_memory="2GiB")
    rid = engine.add_request(prompt_token_ids, SamplingParams(max_tokens=64, temperature=0))
    while engine.has_unfinished_requests():
        for out in engine.step():             # one scheduling iteration = one packed model forward
            ...

Single-threaded: every method must be called from one thread (a server runs one loop thread that calls
`step` and funnels `add_request` / `abort` into that thread). The parts: `decode.serve.pages` (page
accounting), `decode.serve.scheduler` (admission, packing, preemption), `decode.serve.runner` (the packed
forward), `decode.serve.sampler` (token choice), `decode.serve.output_text` (detokenization, stop strings).
"""
import itertools
import time

import torch

from kvcache import CacheConfig

from .loading import (attention_scale, attention_shape, dtype_name, eos_ids, load_model, load_tokenizer,
                      parse_memory, pool_dtype)
from .output_text import OutputText
from .pages import PagePool
from .params import RequestOutput, RequestRejected, SamplingParams
from .request import FINISHED, Request
from .runner import ModelRunner
from .sampler import Sampler
from .scheduler import Scheduler

DEFAULT_KV_CACHE_MEMORY = 1 << 30        # when neither kv_cache_memory nor max_tokens is given (capped, see below)


def _positive(name, value):
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}: expected an int >= 1, got {value!r}")
    return value


class Engine:
    """Continuous batching over one paged KV pool; see the module docstring and docs/serving.md.

    Parameters
    ----------
    model : a local checkpoint directory (loaded offline with AutoModelForCausalLM / AutoTokenizer) or a
            transformers causal LM object (its attention implementation is switched to "kvengine")
    tokenizer : a tokenizer, a directory, or None (the model directory's tokenizer if it has one; without one,
            prompts are token ids, outputs have no text and stop strings are refused)
    kv_cache_memory : pool budget, "2GiB" / "512MiB" / int bytes (or ``max_tokens``: pool tokens); neither:
            min(1 GiB, max_num_seqs x max_model_len tokens)
    block_size : tokens per page
    kv_cache_dtype : "auto" (the model's dtype where the pool stores it, else float32), "float32", "float16",
            "float64", "int8"
    dtype : the model's dtype, "auto" (as stored / as given), "float32", "float64", "float16", "bfloat16"
    enable_prefix_caching : reuse cached pages of identical prompt prefixes (whole pages)
    max_num_batched_tokens : tokens per step (decodes + prefill chunks)
    max_num_seqs : running requests at most
    max_model_len : prompt + output tokens per request (default: the model's max_position_embeddings, capped
            at what the pool holds); a larger value than the pool holds is refused
    seed : seed of the generator shared by sampled requests without a seed of their own
    """

    def __init__(self, model, tokenizer=None, *, kv_cache_memory=None, max_tokens=None, block_size=16,
                 kv_cache_dtype="auto", dtype="auto", enable_prefix_caching=True, max_num_batched_tokens=2048,
                 max_num_seqs=64, max_model_len=None, seed=None):
        _positive("block_size", block_size)
        _positive("max_num_batched_tokens", max_num_batched_tokens)
        _positive("max_num_seqs", max_num_seqs)
        if max_num_batched_tokens < max_num_seqs:          # else the first running requests take every step's
            raise ValueError(f"max_num_batched_tokens: expected >= max_num_seqs ({max_num_seqs}), so that every "
                             f"running request decodes each step, got {max_num_batched_tokens}")   # budget (as vLLM)
        if kv_cache_memory is not None and max_tokens is not None:
            raise ValueError(f"kv_cache_memory/max_tokens: expected at most one of them, got kv_cache_memory="
                             f"{kv_cache_memory!r} and max_tokens={max_tokens!r}")
        if not isinstance(enable_prefix_caching, bool):
            raise TypeError(f"enable_prefix_caching: expected a bool, got {enable_prefix_caching!r}")
        self.model, self.model_name = load_model(model, dtype)
        self.tokenizer = load_tokenizer(tokenizer, model)
        param = next(self.model.parameters())
        self.model_dtype = dtype_name(param.dtype)
        layout = attention_shape(self.model)
        storage = pool_dtype(kv_cache_dtype, param.dtype)
        self.vocab_size = int(self.model.get_input_embeddings().num_embeddings)
        num_pages, self.max_model_len = self._sizes(layout, storage, block_size, kv_cache_memory, max_tokens,
                                                    max_model_len, max_num_seqs)
        self.pool = PagePool(num_layers=layout.num_layers, num_kv_heads=layout.num_kv_heads,
                             head_dim=layout.head_dim, num_q_heads=layout.num_q_heads, num_pages=num_pages,
                             page_size=block_size, dtype=storage, prefix_caching=enable_prefix_caching,
                             scale=attention_scale(self.model, layout.head_dim), namespace=str(self.model_name))
        self.kv_cache_dtype = storage
        self.pool_tokens = num_pages * block_size
        self.scheduler = Scheduler(self.pool, max_num_batched_tokens, max_num_seqs)
        self.runner = ModelRunner(self.model, self.pool)
        self.sampler = Sampler(seed)
        self.eos_token_ids = eos_ids(self.model, self.tokenizer)
        self._requests: dict[str, Request] = {}
        self._undelivered: list[RequestOutput] = []     # outputs made while generate()/stream() ran steps
        self._ids = itertools.count()
        self.generation_tokens_total = 0

    def _sizes(self, layout, storage, block_size, kv_cache_memory, max_tokens, max_model_len, max_num_seqs):
        """(pool pages, max_model_len) from the budget and the model's context."""
        bytes_per_token = CacheConfig.build(num_layers=layout.num_layers, num_kv_heads=layout.num_kv_heads,
                                            head_dim=layout.head_dim, page_size=block_size, num_pages=1,
                                            dtype=storage).bytes_per_token          # int8: its scales included
        context = int(getattr(self.model.config, "max_position_embeddings", 0) or 2048)
        if max_model_len is not None:
            context = _positive("max_model_len", max_model_len)
        if max_tokens is not None:
            tokens = _positive("max_tokens", max_tokens)
        elif kv_cache_memory is not None:
            tokens = parse_memory("kv_cache_memory", kv_cache_memory) // bytes_per_token
        else:
            tokens = min(DEFAULT_KV_CACHE_MEMORY // bytes_per_token, max_num_seqs * context)
        num_pages = tokens // block_size
        if num_pages < 1:
            raise ValueError(f"kv_cache_memory/max_tokens: expected room for at least one page of {block_size} tokens "
                             f"({block_size * bytes_per_token} bytes), got {tokens} tokens")
        capacity = num_pages * block_size
        if max_model_len is None:
            return num_pages, min(context, capacity)
        if context > capacity:
            raise ValueError(f"max_model_len: expected at most {capacity} tokens (what the pool of {num_pages} pages "
                             f"x {block_size} holds), got {context}; give more kv_cache_memory or a smaller "
                             f"max_model_len")
        return num_pages, context

    # -- requests ---------------------------------------------------------------------------------------------
    def add_request(self, prompt_token_ids, params: SamplingParams, request_id: str | None = None) -> str:
        """Queue a request; returns its id. Everything is validated first: `RequestRejected` (a ValueError,
        ``.param`` the field) with nothing changed, for a bad or duplicate id, bad params, a prompt that is
        empty, has ids outside the vocabulary, or is longer than ``max_model_len`` - 1 (one token must be left
        to generate), stop strings without a tokenizer."""
        prompt = self._check_prompt(prompt_token_ids)
        if not isinstance(params, SamplingParams):
            raise RequestRejected("params", f"expected a SamplingParams, got {type(params).__name__}")
        if params.stop and self.tokenizer is None:
            raise RequestRejected("stop", "expected no stop strings: the engine has no tokenizer to detokenize with")
        if request_id is None:
            request_id = f"req-{next(self._ids)}"
            while request_id in self._requests:
                request_id = f"req-{next(self._ids)}"
        elif not isinstance(request_id, str) or not request_id:
            raise RequestRejected("request_id", f"expected a non-empty str or None, got {request_id!r}")
        elif request_id in self._requests:
            raise RequestRejected("request_id", f"expected an id not in use, got {request_id!r} (still running)")
        generator = None
        if params.seed is not None and not params.greedy:
            generator = torch.Generator().manual_seed(params.seed)
        text = None if self.tokenizer is None else OutputText(self.tokenizer, params.stop)
        request = Request(request_id, prompt, params, time.monotonic(), text, generator)
        self._requests[request_id] = request
        self.scheduler.add(request)
        return request_id

    def _check_prompt(self, prompt_token_ids) -> list:
        if isinstance(prompt_token_ids, (str, bytes)) or not hasattr(prompt_token_ids, "__len__"):
            raise RequestRejected("prompt_token_ids", f"expected a list of token ids, got "
                                                      f"{type(prompt_token_ids).__name__}")
        prompt = list(prompt_token_ids)
        if not prompt:
            raise RequestRejected("prompt_token_ids", "expected at least one token id, got an empty prompt")
        if len(prompt) >= self.max_model_len:
            raise RequestRejected("prompt_token_ids", f"expected at most {self.max_model_len - 1} tokens (max_model_len "
                                                      f"{self.max_model_len}, at most the pool's {self.pool_tokens} "
                                                      f"tokens, leaves room for one generated token), got "
                                                      f"{len(prompt)}")
        for i, token in enumerate(prompt):
            if isinstance(token, bool) or not hasattr(token, "__index__") or not 0 <= token < self.vocab_size:
                raise RequestRejected("prompt_token_ids", f"expected token ids in [0, {self.vocab_size}), got "
                                                          f"{token!r} at index {i}")
        return [int(t) for t in prompt]

    def abort(self, request_id: str) -> bool:
        """Stop a request now: its pages are released at once; the next `step` reports it finished with
        finish_reason "abort". False if no such request is running or waiting."""
        request = self._requests.pop(request_id, None)
        if request is None:
            return False
        self.scheduler.finish(request)
        request.finish_reason = "abort"
        self._undelivered.append(request.make_output())
        return True

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # -- one step ---------------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One scheduling iteration (one packed forward): the outputs of every request that got a token or
        finished (aborted ones included), plus any made while `generate` / `stream` ran steps.

        If the forward raises, its K/V writes are rolled back and every request keeps the tokens it had (the
        pool is byte-identical but for the step's admissions and preemptions, which stand); the next step
        retries."""
        batch = self.scheduler.schedule()
        logits = self.runner.forward(batch) if len(batch) else None       # (a failure keeps undelivered outputs)
        outputs, self._undelivered = self._undelivered, []
        if logits is None:
            return outputs
        sampled = [r for r in batch.requests if r.num_to_compute == 0]
        tokens = self.sampler.sample(logits, sampled) if sampled else []
        now = time.monotonic()
        for request, token in zip(sampled, tokens):
            request.append(token, now)
            if request.check_stop(self.eos_token_ids, self.max_model_len):
                self.scheduler.finish(request)
                del self._requests[request.request_id]
            outputs.append(request.make_output())
        self.generation_tokens_total += len(tokens)
        return outputs

    # -- conveniences -----------------------------------------------------------------------------------------
    def generate(self, prompts, params) -> list[RequestOutput]:
        """Run ``prompts`` (token-id lists, or strings with a tokenizer) to completion; the final output of
        each, in order (like vLLM's ``LLM.generate``). ``params``: one SamplingParams or one per prompt.
        Outputs of other requests produced meanwhile are kept for the next `step`."""
        prompts = list(prompts)
        params = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(params) != len(prompts):
            raise RequestRejected("params", f"expected one SamplingParams or {len(prompts)}, got {len(params)}")
        ids = [self.add_request(self._encode(p), sp) for p, sp in zip(prompts, params)]
        final = self._run_until(set(ids))
        return [final[i] for i in ids]

    def stream(self, prompt_token_ids, params: SamplingParams):
        """Yield the request's `RequestOutput` of every step that gave it a token, the last one finished (runs
        steps; other requests' outputs are kept for the next `step`). Closing the generator early aborts it."""
        request_id = self.add_request(self._encode(prompt_token_ids), params)
        finished = False
        try:
            while not finished:
                outputs = self._step_for({request_id})
                for out in outputs:
                    finished = finished or out.finished
                    yield out
        finally:
            if not finished:
                self.abort(request_id)
                self._undelivered = [o for o in self._undelivered if o.request_id != request_id]

    def _encode(self, prompt) -> list:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise RequestRejected("prompt", "expected token ids: the engine has no tokenizer for text prompts")
            return self.tokenizer.encode(prompt)
        return prompt

    def _step_for(self, ids: set) -> list[RequestOutput]:
        """One `step`; returns the outputs of ``ids`` and keeps the others for the next `step`."""
        mine, others = [], []
        for out in self.step():
            (mine if out.request_id in ids else others).append(out)
        self._undelivered.extend(others)
        return mine

    def _run_until(self, ids: set) -> dict:
        final, pending = {}, set(ids)
        while pending:
            if not self.has_unfinished_requests() and not self._undelivered:
                raise RuntimeError(f"requests {sorted(pending)} are neither running, waiting nor finished")
            for out in self._step_for(pending):
                if out.finished:
                    final[out.request_id] = out
                    pending.discard(out.request_id)
        return final

    # -- state ------------------------------------------------------------------------------------------------
    def stats(self) -> dict:
        """Pool and request counters (see docs/serving.md); ``recomputed_tokens_total``: tokens preempted
        requests had to compute again on re-admission (those not found in the prefix cache)."""
        s = self.scheduler
        return {**self.pool.stats(), "requests_running": len(s.running), "requests_waiting": len(s.waiting),
                "preemptions_total": s.preemptions_total,
                "prefix_cache_hit_tokens_total": s.prefix_cache_hit_tokens_total,
                "prompt_tokens_total": s.prompt_tokens_total, "generation_tokens_total": self.generation_tokens_total,
                "recomputed_tokens_total": s.recomputed_tokens_total}

    def check_invariants(self) -> None:
        """AssertionError unless the pool's invariants hold, its sequences are exactly the running requests',
        and, when no request is running, pages in use == prefix-cached pages."""
        running = self.scheduler.attached()
        self.pool.check_invariants(running)
        assert all(r.status != FINISHED for r in self._requests.values()), "a finished request is still listed"
        if not running:
            stats = self.pool.stats()
            assert stats["pages_in_use"] == stats["prefix_cached_pages"], (
                f"idle pool: pages in use {stats['pages_in_use']} != prefix-cached pages "
                f"{stats['prefix_cached_pages']}")
