"""`DecoderPool`: many sequences spread over Ray workers (sequence sharding), each worker owning whole decoders.

    pool = DecoderPool(workers=2, num_q_heads=8, num_kv_heads=2, head_dim=64, max_tokens=8192)
    a, b = pool.new_sequence(), pool.new_sequence()        # placed on the least loaded worker
    outs = pool.batch_step([a, b], q, k, v)                # one call per worker, all in parallel
    c = a.fork()                                           # stays on a's worker (shares its pages)
    pool.close()

A sequence (`PooledSequence`) has the whole `decode.Decoder` contract (step / extend / append / transaction /
truncate / fork / kv / length / free). `batch_step` and `batch_transaction` are those of `decode` across
workers: all rows land or none (two phases: every worker prepares its rows, then every worker commits).
"""
from kvcache.checks import check_int

from .placement import SequenceLayout
from .sharded import DEFAULT_TIMEOUT_S, Family, ShardedSequence, ShardedTransaction, WorkerControls
from .validate import Validator


class PooledSequence(ShardedSequence):
    """One sequence of a `DecoderPool`, living whole on one worker (`worker`); it ends with `free` (the workers
    are the pool's: `DecoderPool.close`, `kill_worker`, `recover`)."""

    @property
    def worker(self) -> int:
        return self.family.layout.home[self.sid]


class DecoderPool(WorkerControls):
    """Sequences on ``workers`` Ray workers; each worker's pool holds ceil(ceil(max_tokens / page_size) /
    workers) pages (``max_tokens`` is the pool's total). Other parameters as `decode.Decoder`."""

    def __init__(self, workers, num_q_heads, num_kv_heads, head_dim, head_dim_v=None, dtype="float32",
                 page_size=16, max_tokens=4096, *, scale=None, window=None, num_layers=1,
                 timeout=DEFAULT_TIMEOUT_S):
        workers = check_int("workers", workers, minimum=1)
        self._settings = dict(num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                              head_dim_v=head_dim_v, dtype=dtype, page_size=page_size, max_tokens=max_tokens,
                              scale=scale, window=window, num_layers=num_layers)
        self._validator = Validator(**self._settings)
        cfg = self._validator.config
        pages = -(-cfg.pages_for(max_tokens) // workers)
        config = dict(num_q_heads=num_q_heads, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                      head_dim_v=cfg.head_dim_v, dtype=cfg.dtype.name, page_size=cfg.page_size,
                      num_layers=cfg.num_layers, scale=self._validator.decoder.scale, window=window, num_pages=pages)
        self._family = Family(("decoders", [config] * workers), SequenceLayout({}), self._settings, timeout)
        self.workers = workers

    @property
    def sequences(self) -> list[int]:
        """Ids of the live sequences."""
        return sorted(self._family.lengths)

    def new_sequence(self) -> PooledSequence:
        """A new empty sequence on the live worker holding the fewest sequences (the lowest index on a tie)."""
        cluster = self._family.cluster
        alive = [w for w in range(self.workers) if w not in cluster.lost]
        cluster.require(alive or None)                 # raises only when every worker is lost
        home = self._family.layout.home
        load = {w: 0 for w in alive}
        for sid in self._family.lengths:
            if home[sid] in load:
                load[home[sid]] += 1
        sid = self._family.new_sid()
        home[sid] = min(alive, key=lambda w: (load[w], w))
        return PooledSequence.member(self._family, Validator(**self._settings), sid, None)

    def batch_step(self, seqs, q, k, v):
        """`decode.batch_step` over pool sequences (on any workers): ``q [B, num_q_heads, head_dim]``,
        ``k [B, num_kv_heads, head_dim]``, ``v [B, num_kv_heads, head_dim_v]`` -> ``[B, num_q_heads, head_dim_v]``;
        one call per worker holding rows, all in parallel; all rows land or none."""
        self._validator.single_layer("batch_step")
        seqs = self._members(seqs)
        self._validator.batch_step(q, k, v)
        tx = ShardedTransaction(seqs, 1, checked=True)
        out = tx.run("step", 0, q, k, v)
        tx.commit()
        return out

    def batch_transaction(self, seqs) -> ShardedTransaction:
        """`decode.batch_transaction`: one token for each sequence, written layer by layer with
        ``tx.step(layer, q, k, v)``; every worker commits at the end or every worker rolls back."""
        return ShardedTransaction(self._members(seqs), 1)

    def _members(self, seqs) -> list:
        seqs = list(seqs)
        if not seqs or not all(isinstance(s, PooledSequence) and s.family is self._family for s in seqs):
            raise TypeError(f"seqs: expected a non-empty list of this pool's sequences, got {seqs!r}")
        ids = [s.sid for s in seqs]
        if len(set(ids)) != len(ids):
            raise ValueError(f"seqs: expected distinct sequences, got sequence ids {ids}")
        for s in seqs:
            s.require_live()
        return seqs
