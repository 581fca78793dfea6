"""Serving: `Engine`, continuous batching of a transformers causal LM over one paged KV pool (vLLM V1-style
scheduling: decodes and chunked prefills packed into one forward per step, no padding; preemption by
recomputation; prefix caching), with `SamplingParams` and `RequestOutput`. No HTTP here.

Needs the ``hf`` extra (torch, transformers); ``import decode`` never imports this package. See docs/serving.md.
"""
from .engine import Engine
from .packed_attention import ATTN_IMPLEMENTATION
from .params import RequestOutput, RequestRejected, SamplingParams

__all__ = ["Engine", "SamplingParams", "RequestOutput", "RequestRejected", "ATTN_IMPLEMENTATION"]
