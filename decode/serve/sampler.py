"""Choosing each request's next token from its float32 logits row.

Greedy rows (temperature 0) take the argmax (the first of equal maxima, as torch.argmax), in one numpy call
for all of them. Sampled rows go one by one:
logits / temperature, then top-k, then top-p (transformers' warper order), softmax, and one draw from the
request's own generator when it has a seed (so its tokens do not depend on what else is in the batch), else
from the engine's shared generator.
"""
import torch


def filter_top_k(logits: torch.Tensor, k: int) -> torch.Tensor:
    """``logits [V]`` with all but the k largest set to -inf (k = -1 or >= V: unchanged)."""
    if k < 0 or k >= logits.shape[-1]:
        return logits
    threshold = torch.topk(logits, k).values[-1]
    return logits.masked_fill(logits < threshold, float("-inf"))


def filter_top_p(logits: torch.Tensor, p: float) -> torch.Tensor:
    """``logits [V]`` keeping the smallest set of most likely tokens whose probability reaches p (at least one)."""
    if p >= 1.0:
        return logits
    ordered, order = torch.sort(logits, descending=True)
    probs = torch.softmax(ordered, dim=-1)
    before = torch.cumsum(probs, dim=-1) - probs            # probability of the tokens ranked above each
    drop = before >= p
    drop[0] = False
    return logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))


class Sampler:
    """``sample(logits [R, V], requests) -> R token ids``; ``seed``: the shared generator's seed."""

    def __init__(self, seed: int | None = None):
        self.generator = torch.Generator()
        if seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(seed)

    def sample(self, logits: torch.Tensor, requests: list) -> list[int]:
        tokens = [0] * len(requests)
        greedy = [i for i, r in enumerate(requests) if r.params.greedy]
        if greedy:
            rows = logits.numpy()                           # numpy: no thread pool to wait for (a 2-thread
            rows = rows if len(greedy) == len(requests) else rows[greedy]      # torch argmax did, under load)
            for i, token in zip(greedy, rows.argmax(axis=-1).tolist()):
                tokens[i] = token
        for i, request in enumerate(requests):
            if not request.params.greedy:
                tokens[i] = self._draw(logits[i], request)
        return tokens

    def _draw(self, row: torch.Tensor, request) -> int:
        params = request.params
        row = filter_top_p(filter_top_k(row / params.temperature, params.top_k), params.top_p)
        probs = torch.softmax(row, dim=-1)
        generator = request.generator if request.generator is not None else self.generator
        return int(torch.multinomial(probs, 1, generator=generator))
