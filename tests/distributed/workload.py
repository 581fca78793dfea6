"""A random workload run side by side on a sharded decoder (or pool sequences) and single-process `Decoder`s:
steps, extends, appends, multi-layer transactions, forks, truncates and frees, with every output and the
gathered K/V compared after each operation.

``exact``: outputs must be equal bit for bit (head and sequence sharding); otherwise (context sharding) each
output is compared with the float64 reference on the K/V as stored, within TOL (atol + rtol * |ref|), the
tolerance of tests/decode/test_decoder.py. The K/V bytes must be equal in every case.
"""
import numpy as np

from reference.dense import decode_reference

TOL = {"float64": (1e-13, 1e-13), "float32": (2e-6, 2e-5), "float16": (2e-6, 2e-5)}
MAX_FORKS = 3

# Seconds a worker call may take in these tests (the library's default is 60 s). Under CI the Ray workers' first
# calls can compile a kernel signature cold while pytest-xdist and the background stages share the 2 cores;
# that took > 60 s once (both workers 'lost'). The timeout itself is tested with its own small value.
CALL_TIMEOUT_S = 600.0


def draw(rng, tokens, heads, kv_heads, dim, dim_v):
    return (rng.standard_normal((tokens, heads, dim)), rng.standard_normal((tokens, kv_heads, dim)),
            rng.standard_normal((tokens, kv_heads, dim_v)))


class Workload:
    """Pairs ``(sharded, single)`` of sequences; ``fork(pair)`` makes a new pair."""

    def __init__(self, rng, pairs, *, exact: bool, max_length: int, pool=None, max_pairs: int = MAX_FORKS):
        self.rng, self.pairs, self.exact, self.max_length = rng, list(pairs), exact, max_length
        self.max_pairs = max_pairs
        self.pool = pool
        if pool is not None:
            from decode import batch_step, batch_transaction
            self.batch_step, self.batch_transaction = batch_step, batch_transaction
        single = self.pairs[0][1]
        cfg = single.config
        self.layers, self.dtype = cfg.num_layers, cfg.dtype.name
        self.shape = (single.num_q_heads, cfg.num_kv_heads, cfg.head_dim, cfg.head_dim_v)
        self.counts = {}

    # -- comparisons ------------------------------------------------------------------------------------
    def compare(self, got, want, single, queries, start, layer):
        assert got.shape == want.shape and got.dtype == want.dtype, (got.shape, want.shape, got.dtype, want.dtype)
        if self.exact:
            assert np.array_equal(got, want), f"max diff {np.abs(got - want).max()}"
            return
        k, v = single.kv(layer)
        q = np.asarray(queries, dtype=got.dtype).astype(np.float64).reshape((-1,) + got.shape[-2:-1] + (k.shape[2],))
        ref = decode_reference(q, k.astype(np.float64), v.astype(np.float64), query_start=start)
        atol, rtol = TOL[self.dtype]
        err = np.abs(got.reshape(ref.shape) - ref)
        assert (err <= atol + rtol * np.abs(ref)).all(), f"context error {err.max():.3g} over the budget"

    def compare_state(self):
        for sharded, single in self.pairs:
            assert sharded.length == single.length
            for layer in range(self.layers):
                for a, b in zip(sharded.kv(layer), single.kv(layer)):
                    assert a.dtype == b.dtype and np.array_equal(a, b)

    # -- operations -------------------------------------------------------------------------------------
    def run(self, operations: int) -> dict:
        ops = ["step", "step", "extend", "append", "fork", "truncate", "free"] if self.layers == 1 else \
              ["tx_step", "tx_step", "tx_extend", "tx_append", "fork", "truncate", "free"]
        if self.pool is not None:
            ops = ops + ["batch", "batch"]
        for i in range(operations):
            op = ops[self.rng.integers(len(ops))]
            pair = self.pairs[self.rng.integers(len(self.pairs))]
            if pair[1].length > self.max_length - 6:
                op = "truncate"
            getattr(self, op)(*pair)
            self.counts[op] = self.counts.get(op, 0) + 1
            if i % 4 == 3:
                self.compare_state()
        self.compare_state()
        return self.counts

    def step(self, sharded, single):
        q, k, v = (x[0] for x in draw(self.rng, 1, *self.shape))
        start = single.length
        self.compare(sharded.step(q, k, v), single.step(q, k, v), single, q, start, 0)

    def extend(self, sharded, single):
        q, k, v = draw(self.rng, int(self.rng.integers(1, 5)), *self.shape)
        start = single.length
        self.compare(sharded.extend(q, k, v), single.extend(q, k, v), single, q, start, 0)

    def append(self, sharded, single):
        _, k, v = draw(self.rng, int(self.rng.integers(1, 4)), *self.shape)
        sharded.append(k, v)
        single.append(k, v)

    def tx_step(self, sharded, single):
        start = single.length
        results = []
        with sharded.transaction(1) as a, single.transaction(1) as b:
            for layer in range(self.layers):
                q, k, v = (x[0] for x in draw(self.rng, 1, *self.shape))
                results.append((a.step(layer, q, k, v), b.step(layer, q, k, v), q, layer))
        for got, want, q, layer in results:
            self.compare(got, want, single, q, start, layer)

    def batch(self, sharded, single):
        """Pool only: one token for 1-3 distinct sequences in one call (a transaction over the layers)."""
        rows = self.rng.choice(len(self.pairs), size=min(len(self.pairs), int(self.rng.integers(1, 4))),
                               replace=False)
        pairs = [self.pairs[r] for r in rows]
        if any(p[1].length > self.max_length - 6 for p in pairs):
            return
        starts = [p[1].length for p in pairs]
        results = []
        if self.layers == 1:
            q, k, v = draw(self.rng, len(pairs), *self.shape)
            results.append((self.pool.batch_step([p[0] for p in pairs], q, k, v),
                            self.batch_step([p[1] for p in pairs], q, k, v), q, 0))
        else:
            with self.pool.batch_transaction([p[0] for p in pairs]) as a, \
                    self.batch_transaction([p[1] for p in pairs]) as b:
                for layer in range(self.layers):
                    q, k, v = draw(self.rng, len(pairs), *self.shape)
                    results.append((a.step(layer, q, k, v), b.step(layer, q, k, v), q, layer))
        for got, want, q, layer in results:
            for row, (pair, start) in enumerate(zip(pairs, starts)):
                self.compare(got[row], want[row], pair[1], q[row], start, layer)

    def tx_extend(self, sharded, single, kind="extend"):
        count = int(self.rng.integers(1, 4))
        start = single.length
        results = []
        with sharded.transaction(count) as a, single.transaction(count) as b:
            for layer in range(self.layers):
                q, k, v = draw(self.rng, count, *self.shape)
                if kind == "extend":
                    results.append((a.extend(layer, q, k, v), b.extend(layer, q, k, v), q, layer))
                else:
                    a.append(layer, k, v)
                    b.append(layer, k, v)
        for got, want, q, layer in results:
            self.compare(got, want, single, q, start, layer)

    def tx_append(self, sharded, single):
        self.tx_extend(sharded, single, kind="append")

    def fork(self, sharded, single):
        if len(self.pairs) < self.max_pairs:
            self.pairs.append((sharded.fork(), single.fork()))

    def truncate(self, sharded, single):
        n = int(self.rng.integers(0, single.length + 1))
        sharded.truncate(n)
        single.truncate(n)

    def free(self, sharded, single):
        if len(self.pairs) > 1:
            self.pairs.remove((sharded, single))
            sharded.free()
            single.free()
