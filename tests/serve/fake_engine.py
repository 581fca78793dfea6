"""TEMPORARY (development only, until decode.serve.Engine lands): a deterministic stand-in with the Engine API."""
import math
import time
import uuid
from dataclasses import dataclass, field


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop_token_ids: tuple = ()
    stop: tuple = ()
    ignore_eos: bool = False


class RequestRejected(ValueError):
    def __init__(self, message, param=None):
        super().__init__(message)
        self.param = param


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list
    new_token_ids: list
    output_token_ids: list
    text: str
    text_delta: str
    finished: bool
    finish_reason: object
    stop_reason: object
    num_prompt_tokens: int
    num_cached_tokens: int
    first_token_time: float
    arrival_time: float


@dataclass
class _Req:
    rid: str
    prompt: list
    params: SamplingParams
    out: list = field(default_factory=list)
    text: str = ""
    arrival: float = field(default_factory=time.monotonic)


class FakeEngine:
    def __init__(self, model_dir, pages=256, block_size=16, max_model_len=512, max_num_seqs=8, max_tokens=None):
        from transformers import AutoTokenizer
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        if max_tokens:
            pages = max_tokens // block_size
        self.tokenizer, self.block_size, self.max_model_len = tokenizer, block_size, max_model_len
        self.pages_total, self.max_num_seqs = pages, max_num_seqs
        self.model_name, self.model_dtype, self.vocab_size = "fake", "float32", len(tokenizer)
        self.running, self.waiting = {}, []
        self.totals = dict(preemptions_total=0, prefix_cache_hit_tokens_total=0, prompt_tokens_total=0,
                           generation_tokens_total=0)

    def _pages(self, r):
        return math.ceil((len(r.prompt) + len(r.out) + 1) / self.block_size)

    def add_request(self, prompt_token_ids, params, request_id=None):
        if len(prompt_token_ids) + params.max_tokens > self.pages_total * self.block_size:
            raise RequestRejected("prompt: can never fit the pool", "prompt")
        rid = request_id or uuid.uuid4().hex
        self.waiting.append(_Req(rid, list(prompt_token_ids), params))
        self.totals["prompt_tokens_total"] += len(prompt_token_ids)
        return rid

    def abort(self, rid):
        if rid in self.running:
            del self.running[rid]
            return True
        n = len(self.waiting)
        self.waiting = [r for r in self.waiting if r.rid != rid]
        return len(self.waiting) < n

    def has_unfinished_requests(self):
        return bool(self.running or self.waiting)

    def _used(self):
        return sum(self._pages(r) for r in self.running.values())

    def step(self):
        while self.waiting and len(self.running) < self.max_num_seqs and \
                self._used() + self._pages(self.waiting[0]) <= self.pages_total:
            r = self.waiting.pop(0)
            self.running[r.rid] = r
        outs = []
        for r in list(self.running.values()):
            tok = (sum(r.prompt) * 31 + len(r.out) * 7 + (r.params.seed or 0)) % self.vocab_size
            r.out.append(tok)
            self.totals["generation_tokens_total"] += 1
            new_text = self.tokenizer.decode(r.out)
            delta, r.text = new_text[len(r.text):], new_text
            done = len(r.out) >= r.params.max_tokens
            if done:
                del self.running[r.rid]
            outs.append(RequestOutput(r.rid, r.prompt, [tok], list(r.out), r.text, delta, done,
                                      "length" if done else None, None, len(r.prompt), 0, 0.0, r.arrival))
        return outs

    def stats(self):
        return dict(pages_total=self.pages_total, pages_in_use=self._used(), prefix_cached_pages=0,
                    requests_running=len(self.running), requests_waiting=len(self.waiting), **self.totals)

    def check_invariants(self):
        assert self._used() <= self.pages_total
