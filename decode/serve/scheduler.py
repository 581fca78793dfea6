"""Scheduling, vLLM V1 style: one token budget per step shared by decodes and chunked prefills.

Each `schedule` takes the running requests in admission order, each with as many of its pending tokens as the
budget (``max_num_batched_tokens``) leaves (a decode: its one sampled token; a partly computed prompt: the
next chunk), then admits waiting requests (first come, first served; at most ``max_num_seqs`` running), each
only when the pages for its next chunk exist. When a running request's next tokens need pages the pool does
not have, the most recently admitted running request is preempted (its pages released; it goes back to the
front of the waiting queue and is recomputed on re-admission, from the longest cached prefix of its prompt
and output so far); no request is admitted in a step that preempted. A preempted request loses nothing:
its tokens stay with it.
"""
from collections import deque

from .request import FINISHED, RUNNING, WAITING


class ScheduledBatch:
    """What one step computes: ``requests[b]`` gets ``counts[b]`` of its pending tokens (all of them > 0)."""

    __slots__ = ("requests", "counts")

    def __init__(self):
        self.requests, self.counts = [], []

    def add(self, request, count: int) -> None:
        self.requests.append(request)
        self.counts.append(count)

    def __len__(self) -> int:
        return len(self.requests)

    @property
    def num_tokens(self) -> int:
        return sum(self.counts)


class Scheduler:
    """Waiting queue, running list, admission and preemption over a `decode.serve.pages.PagePool`."""

    def __init__(self, pool, max_num_batched_tokens: int, max_num_seqs: int):
        self.pool = pool
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.waiting: deque = deque()
        self.running: list = []
        self.preemptions_total = 0
        self.prefix_cache_hit_tokens_total = 0
        self.prompt_tokens_total = 0
        self.recomputed_tokens_total = 0        # tokens computed again after a preemption (not found cached)

    def add(self, request) -> None:
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # -- one step ---------------------------------------------------------------------------------------------
    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget, promised = self.max_num_batched_tokens, 0
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            count = min(request.num_to_compute, budget)
            need = self.pool.new_pages(request, count)
            fits, preempted_now = self._make_room(request, need + promised)
            preempted |= preempted_now
            if not fits:
                break                                  # it preempted itself (and everything admitted after it)
            batch.add(request, count)
            budget -= count
            promised += need
            i += 1
        if not preempted:
            self._admit(batch, budget, promised)
        return batch

    def _make_room(self, request, pages: int) -> tuple[bool, bool]:
        """Preempt the most recently admitted running requests until ``pages`` are available; returns (whether
        ``request`` is still running, whether anything was preempted)."""
        preempted = False
        while pages > self.pool.available:
            victim = self.running[-1]
            self.preempt(victim)
            preempted = True
            if victim is request:
                return False, True
        return True, preempted

    def _admit(self, batch: ScheduledBatch, budget: int, promised: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            hit = self.pool.attach(request)
            count = min(request.num_to_compute, budget)
            need = self.pool.new_pages(request, count)
            if need + promised > self.pool.available:
                self.pool.detach(request)              # its pages come next step (or after others finish)
                return
            self.waiting.popleft()
            request.status = RUNNING
            self.running.append(request)
            if request.num_cached_tokens is None:      # first admission (not a resumption after preemption)
                request.num_cached_tokens = hit
                self.prefix_cache_hit_tokens_total += hit
                self.prompt_tokens_total += len(request.prompt)
            else:
                self.recomputed_tokens_total += max(0, request.num_preempted - hit)
            batch.add(request, count)
            budget -= count
            promised += need

    # -- leaving ----------------------------------------------------------------------------------------------
    def preempt(self, request) -> None:
        """Release ``request``'s pages and put it at the front of the waiting queue (recomputed later)."""
        self.running.remove(request)
        request.num_preempted = request.num_computed
        self.pool.detach(request)
        request.status = WAITING
        self.waiting.appendleft(request)
        self.preemptions_total += 1

    def finish(self, request) -> None:
        """``request`` is done (finished or aborted): out of the queues, pages released."""
        if request.status == RUNNING:
            self.running.remove(request)
        elif request.status == WAITING:
            self.waiting.remove(request)
        self.pool.detach(request)
        request.status = FINISHED

    def attached(self) -> list:
        """Requests holding a pool sequence (the running ones)."""
        return list(self.running)
