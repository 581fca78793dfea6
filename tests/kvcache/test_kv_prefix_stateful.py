"""Hypothesis stateful test of prefix caching against a model that recomputes from scratch.

K/V of position p is a pure function of (namespace, token ids 0 .. p) -- what a transformer computes -- so a
correct cache, reusing pages or not, holds exactly ``kv(namespace, tokens[:p + 1])`` at every position. Rules:
requests that start from `match_prefix` (prompts sharing system prompts, over a 3-token alphabet so contents
collide often), appends with and without token ids, truncate-and-replace, fork, free, all over a pool small
enough that cached pages are evicted often. After every rule: every sequence's gathered K/V equals the
recomputation bit for bit (no stale page is ever read); `check_invariants` (clean free + cached + referenced ==
num_pages, the index agrees with the allocator, chains hold their tokens); the eviction order equals a model
LRU updated from the observable events (pages released in order, adopted, evicted oldest first); a failed
call changed nothing. At teardown everything is freed: no page is referenced (zero leaks) and an allocation of
the whole pool evicts every cached page.

Size: max_examples=60 x 30 steps (about 20-40 s on 2 cores); the `slow` form runs 600.
"""
import numpy as np
import pytest
from hypothesis import HealthCheck, event, settings, strategies as st
from hypothesis.stateful import (RuleBasedStateMachine, initialize, invariant, precondition, rule,
                                 run_state_machine_as_test)

import kvcache
from kvcache import CacheFullError

SYSTEM = [[0, 1, 2, 0, 1, 2, 2, 1, 0, 0], [2, 2, 1, 0, 1, 1, 0, 2]]
NAMESPACES = ["model-a", "model-b"]


class PrefixMachine(RuleBasedStateMachine):
    @initialize(num_layers=st.integers(1, 2), page_size=st.integers(1, 3), num_pages=st.integers(8, 20),
                dtype=st.sampled_from(["float32", "float16"]))
    def setup(self, num_layers, page_size, num_pages, dtype):
        self.cache = kvcache.KVCache(num_layers=num_layers, num_kv_heads=1, head_dim=2, head_dim_v=1,
                                     page_size=page_size, num_pages=num_pages, dtype=dtype, prefix_caching=True)
        self.cfg = self.cache.config
        self.tokens: dict[int, list[int]] = {}          # seq -> every token id it holds (the model)
        self.namespace: dict[int, str] = {}
        self.lru: list[int] = []                        # the model's eviction order
        self.rows = {}

    # -- the model ------------------------------------------------------------------------------------------------
    def kv_row(self, namespace: str, prefix: tuple):
        """``k [num_layers, 1, 2]``, ``v [num_layers, 1, 1]`` of the last token of ``prefix``."""
        key = (namespace, prefix)
        if key not in self.rows:
            rng = np.random.default_rng(abs(hash(key)) % 2**63)
            self.rows[key] = (rng.standard_normal((self.cfg.num_layers, 1, 2)),
                              rng.standard_normal((self.cfg.num_layers, 1, 1)))
        return self.rows[key]

    def kv(self, namespace: str, tokens: list[int], start: int):
        """``k [num_layers, T, 1, 2]``, ``v [num_layers, T, 1, 1]`` of positions ``start ..`` of ``tokens``."""
        rows = [self.kv_row(namespace, tuple(tokens[:p + 1])) for p in range(start, len(tokens))]
        return (np.stack([r[0] for r in rows], axis=1), np.stack([r[1] for r in rows], axis=1))

    def pick(self, index: int) -> int:
        seqs = sorted(self.tokens)
        return seqs[index % len(seqs)]

    def refs(self, page: int) -> int:
        return self.cache.pool.allocator.ref_count(page)

    def park_released(self, pages_newest_first, registered_before):
        for page in pages_newest_first:
            if page in registered_before and self.refs(page) == 0 and page not in self.lru:
                self.lru.append(page)

    def registered(self, pages) -> set:
        return {int(p) for p in pages if p >= 0 and self.cache.pool.index.holds(int(p))}

    def unchanged_after(self, call, error):
        before = self.cache.fingerprint()
        with pytest.raises(error):
            call()
        assert self.cache.fingerprint() == before, f"a failed call ({error.__name__}) changed the cache"

    def append(self, seq: int, new_tokens: list[int], with_ids: bool) -> bool:
        """Append through the cache and the model, predicting evictions and copy-on-write parking."""
        cache, size = self.cache, self.cfg.page_size
        old = self.tokens[seq]
        tokens = old + new_tokens
        k, v = self.kv(self.namespace[seq], tokens, len(old))
        table = cache.pool.page_table(seq)
        tail = int(table[-1]) if len(table) else -1
        copies = int(len(old) % size != 0 and (self.refs(tail) > 1 or cache.pool.index.holds(tail)))
        needed = -(-len(tokens) // size) - -(-len(old) // size) + copies
        if needed > cache.num_free_pages:
            event("append: CacheFullError")
            self.unchanged_after(lambda: cache.append(seq, k, v, token_ids=new_tokens if with_ids else None),
                                 CacheFullError)
            return False
        evicted = max(0, needed - cache.pool.allocator.num_free_pages)
        if evicted:
            event("append: evicts")
        registered_tail = self.registered([tail])
        cache.append(seq, k, v, token_ids=new_tokens if with_ids else None)
        del self.lru[:evicted]
        if copies:
            event("append: copy-on-write" + (" of a registered page" if registered_tail else ""))
            self.park_released([tail], registered_tail)
        self.tokens[seq] = tokens
        return True

    # -- rules ----------------------------------------------------------------------------------------------------
    @precondition(lambda self: len(self.tokens) < 5)
    @rule(system=st.sampled_from([0, 0, 1, 2]), cut=st.integers(3, 10), suffix=st.lists(st.integers(0, 2), max_size=3),
          ns=st.sampled_from([0, 0, 0, 1]))
    def request(self, system, cut, suffix, ns):
        """A new request: match its prompt, then compute the rest with token ids."""
        prompt = (SYSTEM[system][:cut] if system < 2 else []) + suffix
        if not prompt:
            prompt = [1]
        namespace = NAMESPACES[ns] if system < 2 else NAMESPACES[0]
        match = self.cache.match_prefix(prompt, namespace=namespace)
        hit = match.num_tokens
        assert hit % self.cfg.page_size == 0 and hit <= len(prompt) - 1
        event(f"request: hit {'>0' if hit else '0'}")
        self.tokens[match.seq], self.namespace[match.seq] = prompt[:hit], namespace
        adopted = set(self.cache.pool.page_table(match.seq).tolist())
        self.lru = [page for page in self.lru if page not in adopted]
        self.check_kv(match.seq)                     # the hit pages hold exactly the recomputed K/V
        self.append(match.seq, prompt[hit:], with_ids=True)

    @precondition(lambda self: self.tokens)
    @rule(index=st.integers(0, 9), new=st.lists(st.integers(0, 2), min_size=1, max_size=5),
          with_ids=st.sampled_from([True, True, False]))
    def extend(self, index, new, with_ids):
        self.append(self.pick(index), new, with_ids)

    @precondition(lambda self: self.tokens)
    @rule(index=st.integers(0, 9), cut=st.integers(0, 8), new=st.lists(st.integers(0, 2), max_size=4))
    def truncate_and_replace(self, index, cut, new):
        seq = self.pick(index)
        n = max(0, len(self.tokens[seq]) - cut)
        table = self.cache.pool.page_table(seq).copy()
        registered = self.registered(table)
        self.cache.truncate(seq, n)
        self.park_released([int(p) for p in table[self.cfg.pages_for(n):][::-1]], registered)
        self.tokens[seq] = self.tokens[seq][:n]
        if new:
            self.append(seq, new, with_ids=True)

    @precondition(lambda self: self.tokens and len(self.tokens) < 5)
    @rule(index=st.integers(0, 9))
    def fork(self, index):
        seq = self.pick(index)
        child = self.cache.fork(seq)
        self.tokens[child], self.namespace[child] = list(self.tokens[seq]), self.namespace[seq]

    @precondition(lambda self: self.tokens)
    @rule(index=st.integers(0, 9))
    def free(self, index):
        seq = self.pick(index)
        table = self.cache.pool.page_table(seq).copy()
        registered = self.registered(table)
        self.cache.free(seq)
        self.park_released([int(p) for p in table[::-1]], registered)
        del self.tokens[seq], self.namespace[seq]

    @rule(bad=st.sampled_from(["float ids", "negative id", "2-D ids", "empty", "namespace"]))
    def bad_match(self, bad):
        ids, error, kwargs = {"float ids": ([1.0, 2.0], TypeError), "negative id": ([0, -1], ValueError),
                              "2-D ids": ([[0, 1]], ValueError), "empty": ([], ValueError),
                              "namespace": ([0, 1], TypeError)}[bad] + ({},)
        if bad == "namespace":
            kwargs = {"namespace": 3}
        self.unchanged_after(lambda: self.cache.match_prefix(ids, **kwargs), error)

    # -- checks ---------------------------------------------------------------------------------------------------
    def check_kv(self, seq: int) -> None:
        tokens = self.tokens[seq]
        assert self.cache.length(seq) == len(tokens)
        if not tokens:
            return
        k, v = self.kv(self.namespace[seq], tokens, 0)
        dtype = self.cfg.dtype
        for layer in range(self.cfg.num_layers):
            gk, gv = self.cache.gather(seq, layer)
            assert gk.tobytes() == k[layer].astype(dtype).tobytes(), f"seq {seq}: K differs from a recomputation"
            assert gv.tobytes() == v[layer].astype(dtype).tobytes(), f"seq {seq}: V differs from a recomputation"

    @invariant()
    def consistent(self):
        if not hasattr(self, "cache"):
            return
        cache = self.cache
        cache.check_invariants()
        for seq in self.tokens:
            self.check_kv(seq)
        assert cache.pool.index.eviction_order() == self.lru, f"eviction order {cache.pool.index.eviction_order()} != {self.lru}"
        referenced = sum(1 for page in range(self.cfg.num_pages) if self.refs(page) > 0)
        assert cache.pool.allocator.num_free_pages + cache.num_cached_pages + referenced == self.cfg.num_pages

    def teardown(self):
        if not hasattr(self, "cache"):
            return
        cache = self.cache
        for seq in list(self.tokens):
            cache.free(seq)
        cache.check_invariants()
        assert all(self.refs(page) == 0 for page in range(self.cfg.num_pages)), "a page leaked"
        everything = cache.create_sequence()
        total = self.cfg.num_pages * self.cfg.page_size
        cache.append(everything, np.zeros((self.cfg.num_layers, total, 1, 2)), np.zeros((self.cfg.num_layers, total, 1, 1)))
        assert cache.num_cached_pages == 0 and cache.num_free_pages == 0
        cache.free(everything)
        assert cache.num_free_pages == self.cfg.num_pages


SETTINGS = dict(stateful_step_count=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def test_prefix_stateful():
    run_state_machine_as_test(PrefixMachine, settings=settings(max_examples=60, **SETTINGS))


@pytest.mark.slow
def test_prefix_stateful_long():
    run_state_machine_as_test(PrefixMachine, settings=settings(max_examples=600, **SETTINGS))
