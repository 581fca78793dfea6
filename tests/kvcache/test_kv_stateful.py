"""Hypothesis stateful test: random programs of append / failing append / transactions / truncate / fork /
free / release_before over a small pool (so exhaustion is frequent), checked after every step against a dense
model (Python lists of numpy rows cast to the storage dtype), bit for bit.

Size: max_examples=400 programs x stateful_step_count=50 steps (up to 20,000 rule calls, each followed by the
invariants); about 20-40 s on 2 cores.
"""
import numpy as np
from hypothesis import HealthCheck, event, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import kvcache
from kvcache import CacheFullError
from .kv_helpers import DenseModel, assert_bitwise_equal

MAX_SEQUENCES = 5


class CacheMachine(RuleBasedStateMachine):
    steps_checked = 0                        # invariant checks run (reported by test_zz_report_size)
    @initialize(num_layers=st.integers(1, 2), num_kv_heads=st.integers(1, 2), head_dim=st.integers(1, 3),
                head_dim_v=st.integers(1, 3), page_size=st.integers(1, 4), num_pages=st.integers(4, 8),
                dtype=st.sampled_from(["float16", "float32", "int8", "bfloat16"]), seed=st.integers(0, 2**32 - 1))
    def setup(self, num_layers, num_kv_heads, head_dim, head_dim_v, page_size, num_pages, dtype, seed):
        self.cache = kvcache.KVCache(num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=head_dim,
                                     head_dim_v=head_dim_v, page_size=page_size, num_pages=num_pages, dtype=dtype)
        self.cfg = self.cache.config
        self.model = DenseModel(self.cache)
        self.rng = np.random.default_rng(seed)
        self.seq = self.cache.create_sequence()
        self.model.create(self.seq)

    # -- helpers --------------------------------------------------------------------------------------------
    def pick(self, index: int) -> int:
        seqs = sorted(self.model.k)
        return seqs[index % len(seqs)]

    def kv(self, tokens: int, scale: float = 1.0):
        cfg = self.cfg
        k = self.rng.standard_normal((cfg.num_layers, tokens, cfg.num_kv_heads, cfg.head_dim)) * scale
        v = self.rng.standard_normal((cfg.num_layers, tokens, cfg.num_kv_heads, cfg.head_dim_v)) * scale
        return k, v

    def pages_needed(self, seq: int, tokens: int) -> int:
        """Pages an append of ``tokens`` takes from the free list: new logical pages plus a copy of a shared,
        partially filled tail page (read from the public page table and ref counts)."""
        size, length = self.cfg.page_size, self.model.length(seq)
        return -(-(length + tokens) // size) - -(-length // size) + int(self.shares_tail(seq, tokens))

    def shares_tail(self, seq: int, tokens: int) -> bool:
        """Whether appending to ``seq`` writes into a partially filled page another sequence also holds."""
        length, table = self.model.length(seq), self.cache.pool.page_table(seq)
        return (tokens > 0 and length % self.cfg.page_size != 0
                and self.cache.pool.allocator.ref_count(int(table[-1])) > 1)

    def fails_unchanged(self, call, error, match=None):
        before, free = self.cache.fingerprint(), self.cache.num_free_pages
        try:
            call()
        except error as caught:
            exc = caught
            assert match is None or match in str(exc), str(exc)
        else:
            raise AssertionError(f"expected {error.__name__}")
        assert self.cache.fingerprint() == before, f"a failed {error.__name__} changed the cache"
        assert self.cache.num_free_pages == free
        return exc

    # -- rules ------------------------------------------------------------------------------------------------
    @precondition(lambda self: len(self.model.k) < MAX_SEQUENCES)
    @rule()
    def create(self):
        seq = self.cache.create_sequence()
        self.model.create(seq)

    @precondition(lambda self: self.model.k)
    @rule(index=st.integers(0, 9), tokens=st.integers(1, 6), scale=st.sampled_from([1.0, 1e4]))
    def append(self, index, tokens, scale):
        seq = self.pick(index)
        k, v = self.kv(tokens, scale)
        needed = self.pages_needed(seq, tokens)
        if needed > self.cache.num_free_pages:
            event("append: CacheFullError")
            exc = self.fails_unchanged(lambda: self.cache.append(seq, k, v), CacheFullError)
            assert exc.pages_needed == needed and exc.pages_free == self.cache.num_free_pages
        else:
            if self.shares_tail(seq, tokens):
                event("append: copy-on-write")
            self.cache.append(seq, k, v)
            self.model.append(seq, k, v)

    @precondition(lambda self: self.model.k)
    @rule(index=st.integers(0, 9), tokens=st.integers(1, 4),
          kind=st.sampled_from(["nan", "inf", "shape", "dtype", "overflow", "too_big"]))
    def failing_append(self, index, tokens, kind):
        seq = self.pick(index)
        k, v = self.kv(tokens)
        error, match = ValueError, None
        if kind == "nan":
            v[-1, -1, 0, 0], match = np.nan, "v: expected finite values, got nan"
        elif kind == "inf":
            k[0, 0, -1, -1], match = -np.inf, "k: expected finite values, got -inf"
        elif kind == "shape":
            k, match = k[..., :1, :], "k: expected shape" if self.cfg.num_kv_heads > 1 else None
            if self.cfg.num_kv_heads == 1:
                v, match = v[:, :0], "v: expected shape"
        elif kind == "dtype":
            error, k, match = TypeError, (k * 10).astype(np.int32), "k: expected a real floating-point array"
        elif kind == "overflow":
            k[0, -1, 0, 0] = {np.float16: 1e6, np.int8: 1e7}.get(self.cfg.dtype.type, 1e39)
            match = f"in {self.cfg.storage} storage"
        else:
            k, v = self.kv(self.cfg.num_pages * self.cfg.page_size + 1)
            error, match = CacheFullError, "it can never fit"
        self.fails_unchanged(lambda: self.cache.append(seq, k, v), error, match)

    @precondition(lambda self: len(self.model.k) >= 2)
    @rule(i=st.integers(0, 9), j=st.integers(0, 9), ti=st.integers(0, 3), tj=st.integers(1, 3),
          ending=st.sampled_from(["commit", "raise", "missing_layer", "bad_write"]),
          meanwhile=st.sampled_from([None, None, "append", "truncate_append", "free"]), m=st.integers(0, 9))
    def transaction(self, i, j, ti, tj, ending, meanwhile, m):
        """A two-sequence transaction; ``meanwhile`` works on a third sequence while it is open (which may
        share pages with the two)."""
        a, b = self.pick(i), self.pick(j)
        if a == b:
            b = self.pick(j + 1)
        counts = {a: ti, b: tj}
        needed = self.pages_needed(a, ti) + self.pages_needed(b, tj)
        if needed > self.cache.num_free_pages:
            event("transaction: CacheFullError")
            self.fails_unchanged(lambda: self.cache.transaction(counts), CacheFullError)
            return
        event(f"transaction: {ending}")
        data = {seq: self.kv(count) for seq, count in counts.items()}
        before, free = self.cache.fingerprint(), self.cache.num_free_pages
        layers = self.cfg.num_layers
        # siblings sharing a page with a or b first: they are the ones an open transaction must be safe from
        shared = {int(p) for seq in counts for p in self.cache.pool.page_table(seq) if p >= 0}
        others = sorted((seq for seq in self.model.k if seq not in counts),
                        key=lambda seq: (not shared & set(self.cache.pool.page_table(seq).tolist()), seq))
        if meanwhile and not others:
            meanwhile = None
        try:
            with self.cache.transaction(counts) as tx:
                if meanwhile:
                    self.meanwhile(meanwhile, others[0 if m < 6 else m % len(others)])
                    before = None                  # the third sequence changed: rely on the model
                for layer in range(layers):
                    for seq, (k, v) in data.items():
                        if ending == "missing_layer" and seq == b and layer == layers - 1:
                            continue
                        if ending == "bad_write" and seq == b and layer == layers - 1:
                            k = k.copy()
                            k[layer, 0, 0, 0] = np.nan
                        tx.write(layer, seq, k[layer], v[layer])
                if ending == "raise":
                    raise KeyError("abandon")
        except (KeyError, ValueError):
            assert ending != "commit"
            if before is not None:
                assert self.cache.fingerprint() == before and self.cache.num_free_pages == free
        else:
            assert ending == "commit"
            for seq, (k, v) in data.items():
                self.model.append(seq, k, v)

    def meanwhile(self, what: str, seq: int) -> None:
        event(f"transaction: {what} meanwhile")
        if what == "append":
            self.append(sorted(self.model.k).index(seq), 2, 1.0)
        elif what == "truncate_append":
            self.truncate(sorted(self.model.k).index(seq), 0.3)
            self.append(sorted(self.model.k).index(seq), 2, 1.0)
        else:
            self.cache.free(seq)
            self.model.free(seq)

    @precondition(lambda self: self.model.k)
    @rule(index=st.integers(0, 9), fraction=st.floats(0, 1))
    def truncate(self, index, fraction):
        seq = self.pick(index)
        first, length = self.model.first[seq], self.model.length(seq)
        n = first + int(round(fraction * (length - first)))
        self.cache.truncate(seq, n)
        self.model.truncate(seq, n)

    @precondition(lambda self: self.model.k)
    @rule(index=st.integers(0, 9), beyond=st.integers(1, 3))
    def failing_truncate(self, index, beyond):
        seq = self.pick(index)
        self.fails_unchanged(lambda: self.cache.truncate(seq, self.model.length(seq) + beyond), ValueError,
                             "n: expected an integer in")

    @precondition(lambda self: self.model.k and len(self.model.k) < MAX_SEQUENCES)
    @rule(index=st.integers(0, 9))
    def fork(self, index):
        seq = self.pick(index)
        free = self.cache.num_free_pages
        child = self.cache.fork(seq)
        assert self.cache.num_free_pages == free
        self.model.fork(seq, child)

    @precondition(lambda self: self.model.k and len(self.model.k) < MAX_SEQUENCES)
    @rule(index=st.integers(0, 9), tokens=st.integers(1, 3), child_writes=st.booleans())
    def fork_and_append(self, index, tokens, child_writes):
        """Fork, then append to one of the pair at once: writes into the shared tail page when it is partial."""
        seq = self.pick(index)
        child = self.cache.fork(seq)
        self.model.fork(seq, child)
        self.append(sorted(self.model.k).index(child if child_writes else seq), tokens, 1.0)

    @precondition(lambda self: self.model.k)
    @rule(index=st.integers(0, 9))
    def free(self, index):
        seq = self.pick(index)
        self.cache.free(seq)
        self.model.free(seq)
        self.fails_unchanged(lambda: self.cache.free(seq), ValueError, "freed or never created")
        if not self.model.k:                 # keep one sequence, so every rule stays enabled
            self.create()

    @precondition(lambda self: self.model.k)
    @rule(index=st.integers(0, 9), fraction=st.floats(0, 1))
    def release_before(self, index, fraction):
        seq = self.pick(index)
        position = int(round(fraction * self.model.length(seq)))
        assert self.cache.release_before(seq, position) == self.model.release_before(seq, position)

    # -- checked after every step ----------------------------------------------------------------------------
    @invariant()
    def consistent(self):
        if not hasattr(self, "cache"):
            return
        CacheMachine.steps_checked += 1
        self.cache.check_invariants()
        assert sorted(self.cache.sequences) == sorted(self.model.k)
        for seq in self.model.k:
            assert self.cache.length(seq) == self.model.length(seq)
            assert self.cache.pool.first_position(seq) == self.model.first[seq]
            for layer in range(self.cfg.num_layers):
                k, v = self.cache.gather(seq, layer)
                ek, ev = self.model.dense(seq, layer)
                assert_bitwise_equal(k, ek, f"seq {seq} layer {layer} K")
                assert_bitwise_equal(v, ev, f"seq {seq} layer {layer} V")

    def teardown(self):
        if not hasattr(self, "cache"):
            return
        for seq in list(self.model.k):
            self.cache.free(seq)
        assert self.cache.num_free_pages == self.cfg.num_pages, "pages leaked"
        self.cache.check_invariants()


CacheMachine.TestCase.settings = settings(max_examples=400, stateful_step_count=50, deadline=None,
                                          suppress_health_check=[HealthCheck.too_slow])
TestCacheMachine = CacheMachine.TestCase


def test_zz_report_size():
    """Runs after the machine (file order): prints how many steps were checked."""
    print(f"\nstateful: {CacheMachine.steps_checked} invariant checks over max_examples=400 x "
          f"stateful_step_count=50")
