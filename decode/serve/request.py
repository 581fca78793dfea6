"""One request's state inside the engine: its tokens, how many of them are in the pool, its decoder (a pool
sequence) while it runs, and its stop conditions.

``tokens = prompt + output``; ``num_computed`` of them have K/V in the pool. A running request computes
``tokens[num_computed:]`` (a prompt chunk, the remaining prompt, or the one token sampled last), and samples a
new token when the step's chunk reaches the end of ``tokens``. Preemption (recomputation) frees the decoder
and sets ``num_computed`` to 0; re-admission starts from the longest cached prefix of all its tokens.
"""
from .output_text import OutputText
from .params import RequestOutput, SamplingParams

WAITING, RUNNING, FINISHED = "waiting", "running", "finished"


class Request:
    """A request from `Engine.add_request` to its end (finished, or aborted)."""

    def __init__(self, request_id: str, prompt: list, params: SamplingParams, arrival_time: float,
                 text: OutputText | None, generator):
        self.request_id = request_id
        self.prompt = prompt
        self.params = params
        self.arrival_time = arrival_time
        self.text = text                        # None without a tokenizer
        self.generator = generator              # the request's own torch.Generator (seeded), else None
        self.tokens = list(prompt)
        self.output: list[int] = []
        self.num_computed = 0
        self.decoder = None
        self.status = WAITING
        self.num_cached_tokens = None           # the prefix hit at the first admission
        self.num_preempted = 0                  # tokens it had in the pool when last preempted
        self.first_token_time = None
        self.finish_reason = None
        self.stop_reason = None
        self.new_tokens: list[int] = []         # sampled in the current step

    @property
    def num_to_compute(self) -> int:
        return len(self.tokens) - self.num_computed

    def append(self, token: int, now: float) -> None:
        self.output.append(token)
        self.tokens.append(token)
        self.new_tokens.append(token)
        if self.first_token_time is None:
            self.first_token_time = now
        if self.text is not None:
            self.text.add(token)

    def check_stop(self, eos_ids: frozenset, max_model_len: int) -> bool:
        """After `append`: set finish_reason / stop_reason if the last token ends the request."""
        token, params = self.output[-1], self.params
        if token in params.stop_token_ids:
            self.finish_reason, self.stop_reason = "stop", token
        elif not params.ignore_eos and token in eos_ids:
            self.finish_reason = "stop"
        elif self.text is not None and self.text.stopped_by is not None:
            self.finish_reason, self.stop_reason = "stop", self.text.stopped_by
        elif len(self.output) >= params.max_tokens or len(self.tokens) >= max_model_len:
            self.finish_reason = "length"
        return self.finish_reason is not None

    def make_output(self) -> RequestOutput:
        """This step's `RequestOutput` (clears the step's new tokens)."""
        finished = self.finish_reason is not None
        delta = text = None
        if self.text is not None:
            if finished:
                self.text.flush()
            delta = self.text.delta(finished)
            text = self.text.text
        new, self.new_tokens = self.new_tokens, []
        return RequestOutput(request_id=self.request_id, prompt_token_ids=self.prompt, new_token_ids=new,
                             output_token_ids=list(self.output), text=text, text_delta=delta, finished=finished,
                             finish_reason=self.finish_reason, stop_reason=self.stop_reason,
                             num_prompt_tokens=len(self.prompt), num_cached_tokens=self.num_cached_tokens or 0,
                             first_token_time=self.first_token_time, arrival_time=self.arrival_time)
