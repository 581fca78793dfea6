"""`ShardedDecoder`: one sequence (and its forks) over several Ray workers, with the `decode.Decoder` contract.

    dec = ShardedDecoder(workers=2, shard="heads", num_q_heads=8, num_kv_heads=2, head_dim=64,
                         dtype="float16", page_size=16, max_tokens=4096, num_layers=1)
    out = dec.step(q, k, v)                  # q [num_q_heads, head_dim] -> [num_q_heads, head_dim_v]
    dec.close()

Every call is checked in the driver first, by the single-process checks (`decode.distributed.validate`), so a
bad input raises the single-process exception and nothing is sent. Then it runs in two phases: each worker
opens its transaction, writes its part and computes (phase 1, one round trip, in parallel); when every worker
answered, the call is decided and its commit travels with the next call to each worker (phase 2,
`Cluster.commit_later`: one round trip per step). If a
worker raises, dies or times out in phase 1, every other worker rolls back, so their pools are byte for byte
as before, and the caller gets the worker's exception or `WorkerLostError`.
"""
import numpy as np

from kvcache import CacheFullError
from kvcache.checks import check_int

from ..decoder_transaction import CommitOnExit
from ..inputs import checks_for
from .cluster import Cluster, raise_first
from .placement import ContextLayout, HeadsLayout
from .validate import Validator

DEFAULT_TIMEOUT_S = 60.0


class Family:
    """What a sharded decoder and its forks (or a pool's sequences) share: the workers, the layout, the
    committed length of every sequence."""

    def __init__(self, cluster_args, layout, settings: dict, timeout: float):
        self.layout, self.settings = layout, settings
        self.lengths: dict[int, int] = {}
        self._next_sid = 0
        timeout = float(timeout)
        if not timeout > 0:
            raise ValueError(f"timeout: expected seconds > 0, got {timeout!r}")
        self.cluster = Cluster(*cluster_args, timeout=timeout, describe=lambda w: layout.describe(w, self.lengths))

    def new_sid(self) -> int:
        sid, self._next_sid = self._next_sid, self._next_sid + 1
        return sid

    def broadcast(self, calls: dict, op: tuple | None) -> dict:
        """Run calls that change no bytes on failure (sequence creation, fork, free); logged when all succeeded."""
        results = self.cluster.call_all(calls)
        if op is not None:
            for w in calls:
                self.cluster.log(w, op)
        return results


class WorkerControls:
    """The worker-level calls of `ShardedDecoder` and `DecoderPool` (both hold ``self._family``, whose
    ``cluster`` owns the actors)."""

    def ping(self, payload=None) -> None:
        """One round trip to every worker in parallel, ``payload`` there and back (what a call costs beyond its
        work: benchmarks/test_distributed.py)."""
        self._family.cluster.ping(payload)

    def worker_states(self, survivors_only: bool = False) -> dict[int, dict]:
        """Per worker: fingerprint of its pool and metadata (``fingerprint``; ``content``: the bytes in use
        only), free pages, pid, open transactions. ``survivors_only``: of the workers not lost."""
        return self._family.cluster.states(survivors_only)

    def checkpoint(self, directory) -> list[str]:
        """Snapshot every worker's pool into ``directory`` (`kvcache.KVCache.save`) and restart the recovery
        logs empty: `recover` then loads the snapshot and replays only what came after. Returns the paths."""
        return self._family.cluster.checkpoint(directory)

    def recover(self) -> list[int]:
        """Rebuild every lost worker: a fresh actor loads the last `checkpoint` (if any) and replays the log of
        what was committed on that worker since; returns their indices. Decoding then resumes with the results
        it would have had."""
        return self._family.cluster.recover()

    def set_fault(self, worker: int, action, argument=None) -> None:
        """Tests: arm a fault on one worker (`decode.distributed.shard.Shard.set_fault`)."""
        self._family.cluster.call_all({worker: ("set_fault", action, argument)})

    def kill_worker(self, worker: int) -> None:
        """Tests: kill one worker now."""
        self._family.cluster.kill(worker)

    @property
    def worker_pids(self) -> list:
        return list(self._family.cluster.pids)

    def close(self) -> None:
        """Kill the workers (every sequence on them ends: a decoder and all its forks, a pool's sequences) and
        wait for their processes to exit."""
        self._family.cluster.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class ShardedSequence:
    """The `decode.Decoder` contract of one sequence whose K/V live on Ray workers (`ShardedDecoder` and its
    forks, `decode.distributed.DecoderPool`'s sequences): step / extend / append / transaction / truncate / fork /
    free / kv / length. ``family``: the workers and lengths it shares with its forks; ``sid``: its id there."""

    @property
    def family(self) -> Family:
        return self._family

    @property
    def sid(self) -> int:
        return self._sid

    @property
    def validator(self) -> Validator:
        """The single-process checks this sequence's calls run first (its own scratch pool)."""
        return self._validator

    # -- construction ---------------------------------------------------------------------------------------
    def _attach(self, family: Family, validator: Validator, sid: int, parent, own: bool = True) -> None:
        """Create sequence ``sid`` on its workers (a fork of ``parent`` when given); ``own``: the family ends
        (its workers are killed) if this fails."""
        self._family, self._validator, self._sid = family, validator, sid
        self.shard = family.layout.name
        try:
            if parent is None:
                family.broadcast({w: ("new_sequence", sid) for w in family.layout.holders(sid)}, ("new_sequence", sid))
            else:
                self._fork_on_workers(parent)
        except BaseException:
            if own:
                family.cluster.close()
            raise
        family.lengths[sid] = family.lengths.get(parent, 0)

    def _fork_on_workers(self, parent: int) -> None:
        cluster, sid = self._family.cluster, self._sid
        calls = {w: ("fork", parent, sid) for w in self._family.layout.holders(parent)}
        results, errors, lost = cluster.gather(calls)
        if errors or lost:                                        # undo the fork where it was made
            cluster.gather({w: ("free", sid) for w in results})
            raise_first(cluster, errors, lost)
        for w in calls:
            cluster.log(w, ("fork", parent, sid))

    @classmethod
    def member(cls, family: Family, validator: Validator, sid: int, parent) -> "ShardedSequence":
        """Sequence ``sid`` of ``family`` (created on its workers; a fork of ``parent`` when given)."""
        self = cls.__new__(cls)
        self._attach(family, validator, sid, parent, own=False)
        return self

    # -- state ----------------------------------------------------------------------------------------------
    @property
    def config(self):
        """The `kvcache.CacheConfig` of the whole (unsharded) cache, except its pool size."""
        return self._validator.config

    @property
    def num_q_heads(self) -> int:
        return self._validator.decoder.num_q_heads

    @property
    def length(self) -> int:
        """Tokens in the sequence (the absolute position of the next token)."""
        return self._family.lengths[self._sid]

    def kv(self, layer: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """Dense copies ``K [length, num_kv_heads, head_dim]``, ``V [length, num_kv_heads, head_dim_v]`` gathered
        from the workers, in the storage dtype."""
        self.require_live()
        layer = self._validator.check_layer(layer)
        calls, axis = self._family.layout.kv_parts(self._family.lengths, self._sid)
        results = self._family.cluster.call_all({w: call + (layer,) for w, call in calls.items()})
        if not results:
            cfg = self.config
            return (np.empty((0, cfg.num_kv_heads, cfg.head_dim), cfg.dtype),
                    np.empty((0, cfg.num_kv_heads, cfg.head_dim_v), cfg.dtype))
        parts = [results[w] for w in sorted(results)]
        return tuple(np.concatenate([p[i] for p in parts], axis=axis) for i in range(2))

    # -- calls ----------------------------------------------------------------------------------------------
    def step(self, q, k, v) -> np.ndarray:
        """`decode.Decoder.step`: ``q [num_q_heads, head_dim]``, ``k [num_kv_heads, head_dim]``,
        ``v [num_kv_heads, head_dim_v]`` -> ``[num_q_heads, head_dim_v]``."""
        self.require_live()
        self._validator.step(q, k, v)
        tx = ShardedTransaction([self], 1, checked=True)
        out = tx.run("step", 0, q, k, v)
        tx.commit()
        return out

    def extend(self, q, k, v) -> np.ndarray:
        """`decode.Decoder.extend`: T tokens, query i at position ``length + i`` -> ``[T, num_q_heads, head_dim_v]``."""
        self.require_live()
        self._validator.single_layer("extend")
        with self.transaction(self._validator.num_tokens(k)) as tx:
            return tx.extend(0, q, k, v)

    def append(self, k, v) -> None:
        """`decode.Decoder.append`: T tokens of K/V with no query."""
        self.require_live()
        self._validator.single_layer("append")
        with self.transaction(self._validator.num_tokens(k)) as tx:
            tx.append(0, k, v)

    def transaction(self, num_tokens: int = 1) -> "ShardedTransaction":
        """`decode.Decoder.transaction`: write and attend layer by layer; every worker commits at the end, or
        every worker rolls back."""
        self.require_live()
        return ShardedTransaction([self], check_int("num_tokens", num_tokens))

    def truncate(self, n: int) -> None:
        """`decode.Decoder.truncate`: keep positions ``[0, n)`` on every worker."""
        self.require_live()
        n = check_int("n", n, maximum=self.length)
        family = self._family
        calls = family.layout.truncations(family.lengths, self._sid, n)
        results, errors, lost = family.cluster.gather(calls)
        if errors and not lost:                     # refused by every worker alike (a sliding-window limit)
            raise_first(family.cluster, errors, {})
        for w in calls:
            if w not in errors:
                family.cluster.log(w, calls[w])
        family.lengths[self._sid] = n
        raise_first(family.cluster, errors, lost, committed=True)

    def fork(self) -> "ShardedSequence":
        """A new sharded sequence sharing this one's pages on every worker (copy-on-write)."""
        self.require_live()
        validator = Validator(**self._family.settings)       # its own scratch pool: forks' transactions overlap
        child = self._family.new_sid()
        self._family.layout.place_fork(self._sid, child)
        return type(self).member(self._family, validator, child, self._sid)

    def free(self) -> None:
        """Give this sequence's pages back on every worker; the decoder is unusable afterwards."""
        self.require_live()
        family = self._family
        family.broadcast({w: ("free", self._sid) for w in family.layout.holders(self._sid)}, ("free", self._sid))
        del family.lengths[self._sid]

    def require_live(self) -> None:
        """RuntimeError for a freed sequence; `WorkerLostError` when a worker holding it is lost."""
        if self._sid not in self._family.lengths and not self._family.cluster.closed:
            raise RuntimeError(f"decoder: expected a live sequence, got sequence {self._sid} freed")
        self._family.cluster.require(self._family.layout.holders(self._sid))


class ShardedDecoder(ShardedSequence, WorkerControls):
    """One sequence of a paged KV cache sharded over ``workers`` Ray workers (see the module docstring).

    Parameters
    ----------
    workers : int                    number of workers (Ray actors); each allocates its own pool
    shard : "heads" | "context"      heads: worker w holds a contiguous subset of the kv heads (at most
                                     num_kv_heads workers); context: worker w holds positions
                                     [w * C, (w + 1) * C) with C = ceil(ceil(max_tokens / page_size) / workers)
                                     pages of page_size tokens
    num_q_heads ... num_layers       as `decode.Decoder` (``window`` only with shard="heads")
    timeout : float                  seconds any worker call may take before the worker is declared lost
    pages_per_worker : int or None   each worker's pool (None: its share, as above; at least that): with
                                     context sharding, forks that diverge copy pages inside each range, so
                                     a fork-heavy use needs pools larger than the ranges
    """

    def __init__(self, workers, shard, num_q_heads, num_kv_heads, head_dim, head_dim_v=None, dtype="float32",
                 page_size=16, max_tokens=4096, *, scale=None, window=None, num_layers=1,
                 timeout=DEFAULT_TIMEOUT_S, pages_per_worker=None):
        workers = check_int("workers", workers, minimum=1)
        if shard not in ("heads", "context"):
            raise ValueError(f"shard: expected 'heads' or 'context', got {shard!r}")
        settings = dict(num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                        head_dim_v=head_dim_v, dtype=dtype, page_size=page_size, max_tokens=max_tokens,
                        scale=scale, window=window, num_layers=num_layers)
        validator = Validator(**settings)                     # the Decoder's errors for bad arguments
        cfg = validator.config
        if shard == "heads" and workers > cfg.num_kv_heads:
            raise ValueError(f"workers: expected at most num_kv_heads={cfg.num_kv_heads} workers for "
                             f"shard='heads', got {workers}")
        if shard == "context" and window is not None:
            raise ValueError(f"window: expected None with shard='context' (a sliding window over sharded "
                             f"positions is not supported), got {window!r}")
        total_pages = cfg.pages_for(max_tokens)
        range_pages = total_pages if shard == "heads" else -(-total_pages // workers)
        pages = range_pages if pages_per_worker is None else check_int("pages_per_worker", pages_per_worker,
                                                                       minimum=range_pages)
        base = dict(num_q_heads=num_q_heads, head_dim=cfg.head_dim, head_dim_v=cfg.head_dim_v, dtype=cfg.dtype.name,
                    page_size=cfg.page_size, num_layers=cfg.num_layers, scale=validator.decoder.scale,
                    window=window)
        group = num_q_heads // cfg.num_kv_heads
        if shard == "heads":
            layout = HeadsLayout(cfg.num_kv_heads, group, workers)
            configs = [dict(base, num_kv_heads=h1 - h0, num_q_heads=(h1 - h0) * group, num_pages=pages)
                       for h0, h1 in layout.ranges]
            kind = "decoders"
        else:
            layout = ContextLayout(range_pages * cfg.page_size, workers, cfg.num_kv_heads)
            configs = [dict(base, num_kv_heads=cfg.num_kv_heads, num_pages=pages) for _ in range(workers)]
            kind = "context"
        family = Family((kind, configs), layout, settings, timeout)
        self._attach(family, validator, family.new_sid(), parent=None)

    # -- workers (the rest: WorkerControls) ---------------------------------------------------------------
    def checkpoint(self, directory) -> list[str]:
        self.require_live()
        return super().checkpoint(directory)
    checkpoint.__doc__ = WorkerControls.checkpoint.__doc__


class ShardedTransaction(CommitOnExit):
    """Tokens of one sharded sequence (or a batch of pool sequences) being written layer by layer on their
    workers; see `ShardedDecoder.transaction`. Errors and their order are those of `decode.DecoderTransaction`."""

    def __init__(self, members: list, num_tokens: int, *, checked: bool = False):
        first = members[0]
        self.members, self.num_tokens = members, num_tokens
        self.family, self.validator = first.family, first.validator
        self.sids = [m.sid for m in members]
        self.start = self.family.lengths[self.sids[0]] if len(members) == 1 else None
        if len(members) == 1 and self.family.layout.name == "context":
            _check_context_capacity(self.family.layout, self.start, num_tokens, first.config)
        self.txid = self.family.cluster.new_txid()
        self.scratch = None if checked else self.validator.open(num_tokens, len(members) if len(members) > 1 else 0)
        self.began: set[int] = set()
        self.parts: dict[int, dict[int, tuple]] = {}            # worker -> layer -> (k, v) written there
        self.layers: set[int] = set()
        self._open = True

    # -- per layer ------------------------------------------------------------------------------------------
    def step(self, layer: int, q, k, v) -> np.ndarray:
        """One token: ``q [num_q_heads, head_dim]`` (or ``[B, ...]`` for a batch) -> ``[num_q_heads, head_dim_v]``."""
        return self._checked("step", layer, q, k, v)

    def extend(self, layer: int, q, k, v) -> np.ndarray:
        """T tokens with T queries -> ``[T, num_q_heads, head_dim_v]``."""
        return self._checked("extend", layer, q, k, v)

    def append(self, layer: int, k, v) -> None:
        """T tokens of K/V with no query."""
        self._checked("append", layer, None, k, v)

    def _checked(self, kind, layer, q, k, v):
        if not self._open:
            raise RuntimeError("transaction: expected an open transaction, got one already finished")
        try:
            self.validator.layer(self.scratch, kind, self.num_tokens, layer, q, k, v)
        except BaseException:
            self.rollback()
            raise
        return self.run(kind, int(layer), q, k, v)

    def run(self, kind: str, layer: int, q, k, v):
        """Phase 1 of one layer on every worker concerned; checked inputs. Any failure rolls back all workers."""
        cfg = self.validator.config
        try:
            single = q is not None and np.ndim(q) == 2
            q = None if q is None else np.ascontiguousarray(q, dtype=checks_for(self.validator.decoder).q_dtype)
            k, v = np.asarray(k, dtype=cfg.dtype), np.asarray(v, dtype=cfg.dtype)
            layout = self.family.layout
            if layout.name == "context" and single:
                q, k, v = q[None], k[None], v[None]             # one token as a block of one
            plan = layout.plan(self.sids, self.start, self.num_tokens, kind)
            calls = {}
            for w, piece in plan.items():
                q_w, k_w, v_w, hi = layout.split(piece, q, k, v, self.start)
                begin = None if w in self.began else (piece.sids, piece.tokens)
                calls[w] = ("run", self.txid, begin, kind, layer, q_w, k_w, v_w, hi)
                self.parts.setdefault(w, {})[layer] = (piece.sids, k_w, v_w)
            self.began.update(calls)
            results, errors, lost = self.family.cluster.gather(calls)
            raise_first(self.family.cluster, errors, lost)
            self.layers.add(layer)
            return layout.merge(plan, results, kind, single and layout.name == "context")
        except BaseException:
            self.rollback()
            raise

    # -- end ------------------------------------------------------------------------------------------------
    def commit(self) -> None:
        """Commit on every worker (a no-op once finished). The outcome is decided here: the commit messages
        are confirmed at the start of the next call."""
        if not self._open:
            return
        try:
            self.validator.finish(self.scratch, commit=True)
            missing = sorted(set(range(self.validator.num_layers)) - self.layers)
            if missing and self.num_tokens:
                raise ValueError(f"commit: expected every layer written, got layers "
                                 f"{ {s: missing for s in self.sids} } missing (seq: layers)")
        except BaseException:
            self.rollback()
            raise
        self._open = False
        cluster = self.family.cluster
        for w, layers in self.parts.items():
            writes = {}
            for layer in sorted(layers):
                sids, k_w, v_w = layers[layer]
                for i, sid in enumerate(sids):
                    rows = _rows_of(k_w, v_w, i, len(sids), self.num_tokens)
                    if len(rows[0]):
                        writes.setdefault(sid, []).append(rows)
            if writes:
                cluster.log(w, ("write", writes))
        for sid in self.sids:
            self.family.lengths[sid] += self.num_tokens
        cluster.commit_later(sorted(self.began), self.txid)

    def rollback(self) -> None:
        """Undo every worker's writes (a no-op once finished)."""
        if not self._open:
            return
        self._open = False
        self.validator.finish(self.scratch, commit=False)
        cluster = self.family.cluster
        alive = [w for w in self.began if w not in cluster.lost]
        if alive:
            cluster.gather({w: ("rollback", self.txid) for w in alive})


def _rows_of(k_w, v_w, i, count, num_tokens):
    """The K/V a worker wrote for its i-th sequence of ``count``: ``[T, H, D]`` in the storage dtype."""
    if count > 1:                                        # a batch: row i is sequence i's one token
        return k_w[i:i + 1], v_w[i:i + 1]
    if k_w.ndim == 2:                                    # one token given as [H, D]
        return k_w[None], v_w[None]
    return k_w, v_w


def _check_context_capacity(layout: ContextLayout, start: int, num_tokens: int, cfg) -> None:
    total = layout.capacity * layout.workers
    if start + num_tokens > total:
        need = cfg.pages_for(start + num_tokens) - cfg.pages_for(start)
        free = (total - cfg.pages_for(start) * cfg.page_size) // cfg.page_size
        raise CacheFullError(need, free, total // cfg.page_size, num_tokens <= total,
                             what=f"context shards (positions {start}..{start + num_tokens - 1} of a "
                                  f"{total}-token sharded sequence)")
