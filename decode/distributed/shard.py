"""What one worker holds and does: a `kvcache.KVCache` allocated in the worker, the decoders of its sequences,
and the prepared (open, uncommitted) transactions of the two-phase protocol. Plain Python: the Ray actor
(`decode.distributed.cluster.ShardServer`) only forwards calls to a `Shard`, so the same code runs (and is tested)
in-process.

Two kinds of shard:
    "decoders"  each sequence is a `decode.Decoder` on the shard's pool (head sharding: the pool holds a subset
                of the kv heads; sequence sharding: whole sequences). Calls run the Decoder's own transaction,
                so the outputs are the single-process ones bit for bit.
    "context"   each sequence holds a contiguous range of positions (local positions 0 ..); a call writes the
                tokens that fall in the range and returns the partial softmax state (`decode.partial`) of the
                queries over the local keys, for the caller to merge.

Protocol of one call (a step, or one layer of a transaction): ``run(txid, begin, kind, layer, ...)`` opens the
transaction on its first layer (``begin`` given), writes and computes, and leaves it open; ``commit(txid)`` or
``rollback(txid)`` ends it. An exception inside ``run`` rolls the shard's transaction back before it propagates.
"""
import os
import time

import numba
import numpy as np

from decode import Decoder, batch_transaction
from decode.partial import partial_attention
from kvcache import KVCache
from kvcache.errors import InjectedFault
from kvcache.faults import FaultInjector, no_fault
from kvcache.jit_store import writable
from kvcache.testing import set_fault_hook


class Shard:
    """One worker's state. ``config``: KVCache arguments (num_kv_heads, head_dim, head_dim_v, dtype, page_size,
    num_pages, num_layers) plus num_q_heads, scale, window."""

    def __init__(self, kind: str, config: dict):
        if kind not in ("decoders", "context"):
            raise ValueError(f"kind: expected 'decoders' or 'context', got {kind!r}")
        self.kind = kind
        self.num_q_heads, self.scale, self.window = config["num_q_heads"], config["scale"], config["window"]
        self.cache = KVCache(num_kv_heads=config["num_kv_heads"], head_dim=config["head_dim"],
                             head_dim_v=config["head_dim_v"], dtype=config["dtype"], page_size=config["page_size"],
                             num_pages=config["num_pages"], num_layers=config["num_layers"])
        self.decoders: dict[int, Decoder] = {}                   # global sequence id -> its decoder here
        self.open: dict[int, tuple] = {}                         # txid -> (transaction, sequence ids)
        self.fault = None                                        # (action, argument), see set_fault

    # -- sequences ------------------------------------------------------------------------------------------
    def new_sequence(self, sid: int) -> None:
        self.decoders[sid] = Decoder.on_cache(self.cache, self.num_q_heads, scale=self.scale, window=self.window)

    def fork(self, parent: int, child: int) -> None:
        self.decoders[child] = self.decoders[parent].fork()

    def free(self, sid: int) -> None:
        self.decoders.pop(sid).free()

    def truncate(self, sid: int, n: int) -> None:
        self.decoders[sid].truncate(n)

    def length(self, sid: int) -> int:
        return self.decoders[sid].length

    def kv(self, sid: int, layer: int):
        return self.decoders[sid].kv(layer)

    def ping(self, payload):
        """Return ``payload`` (a round trip, for measurements)."""
        return payload

    def state(self) -> dict:
        """Fingerprint of the pool and its metadata, free pages, pid, numba threads (tests and diagnostics)."""
        return {"fingerprint": self.cache.fingerprint(), "free_pages": self.cache.num_free_pages,
                "content": self.cache.fingerprint(include_free_pages=False), "pid": os.getpid(),
                "open": sorted(self.open), "threads": numba.get_num_threads()}

    # -- two-phase calls ------------------------------------------------------------------------------------
    def run(self, txid: int, begin, kind: str, layer: int, q, k, v, query_hi=None):
        """One layer of transaction ``txid``; ``begin = (sequence ids, tokens per sequence)`` on its first layer.

        "decoders": ``kind`` is "step" / "extend" / "append" (the DecoderTransaction method) on the decoders of
        ``begin``'s sequences; returns the output (None for append).
        "context": one sequence; k/v are this shard's part of the new tokens (T_local of them, maybe 0); with
        q given, returns the partial state ``(m, l, acc)`` of q over the local keys ``0 .. query_hi[i]-1``."""
        q, k, v = (None if x is None else writable(x) for x in (q, k, v))   # the object store's are read-only
        try:
            if begin is not None:
                self._begin(txid, *begin)
            tx, sids = self.open[txid]
            if self.kind == "decoders":
                out = getattr(tx, kind)(layer, q, k, v) if kind != "append" else tx.append(layer, k, v)
            else:
                out = self._context_layer(tx, sids[0], layer, q, k, v, query_hi)
            self._fault_point("run")
            return out
        except BaseException:
            self.rollback(txid)
            raise

    def _begin(self, txid: int, sids, num_tokens: int) -> None:
        if txid in self.open:
            raise RuntimeError(f"txid: expected a new transaction id, got {txid} (open)")
        self._arm_injector()
        decoders = [self.decoders[s] for s in sids]
        if self.kind == "context":
            seq = decoders[0].seq
            tx = self.cache.transaction({seq: num_tokens}) if num_tokens else None
        elif len(decoders) == 1:
            tx = decoders[0].transaction(num_tokens)
        else:
            tx = batch_transaction(decoders)
        self.open[txid] = (tx, list(sids))

    def _context_layer(self, tx, sid, layer, q, k, v, query_hi):
        seq = self.decoders[sid].seq
        if tx is not None:
            tx.write(layer, seq, k, v, checked=True)
        if q is None:
            return None
        pages = tx.pages(seq) if tx is not None else self.cache.pool.page_table(seq)
        hi = np.asarray(query_hi, dtype=np.int64)
        return partial_attention(q, self.cache.pool.k_pages(layer), self.cache.pool.v_pages(layer), pages,
                                 np.zeros_like(hi), hi, self.scale)

    def commit(self, txid: int) -> None:
        tx, _ = self.open.pop(txid)
        self._fault_point("commit")
        try:
            if tx is not None:
                tx.commit()
        finally:
            set_fault_hook(self.cache, no_fault)

    def rollback(self, txid: int) -> None:
        """End ``txid`` undoing its writes (a no-op for an unknown or finished id)."""
        entry = self.open.pop(txid, None)
        if entry is not None and entry[0] is not None:
            entry[0].rollback()
        set_fault_hook(self.cache, no_fault)

    # -- recovery -------------------------------------------------------------------------------------------
    def save(self, path: str) -> dict:
        """Snapshot the pool to ``path`` (`kvcache.KVCache.save`); returns ``{sequence id: cache sequence}``."""
        self.cache.save(path)
        return {sid: d.seq for sid, d in self.decoders.items()}

    def restore(self, path: str, sequences: dict) -> None:
        """Replace the pool by the snapshot ``path`` (`kvcache.KVCache.load`, checked against this shard's
        configuration) and re-attach the decoders of ``sequences`` (from `save`)."""
        cache = KVCache.load(path, config=self.cache.config)
        self.cache, self.open = cache, {}
        self.decoders = {sid: Decoder.on_sequence(cache, seq, self.num_q_heads, scale=self.scale, window=self.window)
                         for sid, seq in sequences.items()}

    def replay(self, ops) -> None:
        """Re-apply committed operations (`decode.distributed.cluster.Cluster` logs them): the same writes of
        the same storage-dtype K/V in the same order give the same bytes at every position."""
        for op in ops:
            name = op[0]
            if name == "write":                       # ("write", {sid: [(k, v) per layer]})
                for sid, layers in op[1].items():
                    if self.kind == "context":
                        seq = self.decoders[sid].seq
                        with self.cache.transaction({seq: len(layers[0][0])}) as tx:
                            for layer, (k, v) in enumerate(layers):
                                tx.write(layer, seq, k, v, checked=True)
                    else:
                        with self.decoders[sid].transaction(len(layers[0][0])) as tx:
                            for layer, (k, v) in enumerate(layers):
                                tx.append(layer, k, v)
            else:
                getattr(self, name)(*op[1:])

    # -- fault hooks (tests) --------------------------------------------------------------------------------
    def set_fault(self, action: str | None, argument=None) -> None:
        """Make the next call fail on purpose: ``("hold", (path, seconds))`` writes ``path`` and sleeps inside
        `run` (the step is held open: its writes are made, nothing is committed); ``("exit_in_run", None)`` /
        ``("exit_in_commit", None)`` end the process there; ``("inject", i)`` installs a
        `kvcache.faults.FaultInjector(fail_at=i)` on the pool for the next transaction (an error raised inside
        the worker), ``("inject_at", point)`` fails at the first fault point of that name; None clears it."""
        self.fault = None if action is None else (action, argument)

    def _arm_injector(self) -> None:
        if self.fault and self.fault[0] in ("inject", "inject_at"):
            action, argument = self.fault
            set_fault_hook(self.cache, FaultInjector(fail_at=argument) if action == "inject" else _FailAt(argument))
            self.fault = None

    def _fault_point(self, where: str) -> None:
        if not self.fault:
            return
        action, argument = self.fault
        if action == "hold" and where == "run":
            self.fault = None
            path, seconds = argument
            with open(path + ".tmp", "w") as f:       # published whole: a watcher never reads it half written
                f.write(str(os.getpid()))
            os.replace(path + ".tmp", path)
            time.sleep(seconds)
        elif action == f"exit_in_{where}":
            os._exit(17)


class _FailAt:
    """A fault hook raising `InjectedFault` at the first fault point named ``point``."""

    def __init__(self, point: str):
        self.point = point

    def __call__(self, point: str) -> None:
        if point == self.point:
            raise InjectedFault(f"injected fault at {point!r}")
