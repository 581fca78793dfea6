"""`DecoderTransaction`: new tokens of one or more decoders (one pool), written and attended layer by layer.

The cache's append transaction (`KVCache.transaction`, one protocol, the shape fitting the request: one token
each -> a list of sequences, a `TokenWrite` for one decoder; anything larger -> ``{seq: count}``) holds the
slots, positions and page tables; what every layer shares is planned once (`decode.attention_plan`).
"""
import numpy as np

from . import window as _window
from .attention_plan import attend_token, plan_batch, pools_of
from .inputs import check_tokens, checks_for, split_ragged


class CommitOnExit:
    """The with-block of a layer-by-layer transaction: commit on a normal exit, roll back on an exception."""

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.commit()
        else:
            self.rollback()


class DecoderTransaction(CommitOnExit):
    """Tokens of one or more decoders (one pool) being written layer by layer; see `Decoder.transaction`.

    The slots are reserved when the transaction opens (from then on it owns its sequences: no truncate / fork /
    free / other transaction in between), before any layer's input exists; each per-layer call validates its input before it writes. The single-layer calls
    (`Decoder.step` / `extend` / `append`, `batch_extend`, `batch_step`) validate everything before they open
    one. What every layer shares (page tables, positions, the kernel's work partition) is computed by the first
    layer that attends and reused by the others."""

    def __init__(self, decoders: list, num_tokens: dict[int, int], token_ids: dict | None = None):
        self.decoders = decoders
        self.cache = decoders[0].cache
        self.num_tokens = num_tokens
        self._counts = [num_tokens[d.seq] for d in decoders]
        self._plans = {}                # number of queries -> `decode.attention_plan.AttentionPlan`, see `_attend`
        self._token_plan = None         # the one-query path's plan (`attend_token`)
        self._checks = checks_for(decoders[0])   # the decoders' input checks (one num_q_heads / scale)
        self._pools = pools_of(self.cache)       # the pool's per-layer views the kernels read
        # reserve (CacheFullError and bad ids leave everything as it was)
        if self._counts.count(1) == len(self._counts):          # one token each: the slot shapes
            self._tx = self.cache.transaction([d.seq for d in decoders], token_ids=token_ids)
        else:
            self._tx = self.cache.transaction(num_tokens, token_ids=token_ids)
        self._open = True

    def commit(self) -> None:
        """Publish the tokens (every layer must have been written); a no-op once committed."""
        if self._open:
            self._open = False
            self._tx.commit()
            if self.decoders[0].window:
                for d in self.decoders:
                    _window.release_after_commit(d)

    def rollback(self) -> None:
        self._open = False
        self._tx.rollback()

    # -- per layer --------------------------------------------------------------------------------------------
    def append(self, layer: int, k, v, *, checked: bool = False) -> None:
        """Write one layer's K/V of every decoder, no query: ``k`` / ``v`` as in `extend`."""
        def run():
            _, ks, vs = (None, k, v) if checked else self.check_tokens(None, k, v)
            self._tx.write(layer, ks, vs)
        self._guard(run)

    def extend(self, layer: int, q, k, v, *, checked: bool = False):
        """Write one layer's K/V of every decoder and attend with their queries, in one kernel call.

        Ragged form: ``q [N, num_q_heads, head_dim]``, ``k [N, num_kv_heads, head_dim]``,
        ``v [N, num_kv_heads, head_dim_v]`` with N = sum of the decoders' token counts, decoder 0's tokens first
        -> ``[N, num_q_heads, head_dim_v]``. List form: one ``[T_b, ...]`` array per decoder -> a list of
        ``[T_b, num_q_heads, head_dim_v]``. Query t of decoder b sits at position ``start[b] + t``.
        ``checked``: the arrays come from `check_tokens` (ragged, validated, cast) and are not checked again."""
        def run():
            qs, ks, vs = (q, k, v) if checked else self.check_tokens(q, k, v)
            self._tx.write(layer, ks, vs)
            out = self._attend(layer, qs)
            return split_ragged(out, self._counts) if isinstance(q, (list, tuple)) else out
        return self._guard(run)

    def check_tokens(self, q, k, v):
        """`decode.inputs.check_tokens` for this transaction's decoders and token counts."""
        return check_tokens(self.decoders, self._counts, q, k, v)

    @property
    def counts(self) -> list[int]:
        """New tokens of each decoder, in decoder order."""
        return list(self._counts)

    def _query_seq(self) -> np.ndarray:
        """int32 [N]: the page-table row (decoder index) of each ragged query."""
        return np.repeat(np.arange(len(self._counts), dtype=np.int32), self._counts)

    def _query_pos(self) -> np.ndarray:
        """int64 [N]: the absolute position of each ragged query (decoder b's first new position + t)."""
        counts, positions = self._counts, self._tx.positions
        if min(counts) == max(counts) == 1:                          # one query each: the positions themselves
            return positions
        first = np.repeat(positions - np.cumsum([0] + counts[:-1]), counts)
        return first + np.arange(len(first), dtype=np.int64)

    def step(self, layer: int, q, k, v, *, checked: bool = False) -> np.ndarray:
        """One token per decoder: ``q [B, num_q_heads, head_dim]``, ``k [B, num_kv_heads, head_dim]``,
        ``v [B, num_kv_heads, head_dim_v]`` with B = number of decoders (the B axis may be dropped for one
        decoder) -> ``[B, num_q_heads, head_dim_v]``. ``checked``: ``[B, ...]`` arrays validated and cast already
        (`decode.inputs.checks_for(decoder).tokens`)."""
        if (q.ndim if type(q) is np.ndarray else np.ndim(q)) == 2 and self._counts == [1]:
            try:                                    # `_guard`, inlined: the per-layer path of a decode step
                if not self._open:
                    raise RuntimeError("transaction: expected an open transaction, got one already finished")
                q, k, v = self._checks.token(q, k, v)
                out, self._token_plan = attend_token(self.decoders[0], self._pools, self._tx, layer, q, k, v,
                                                     self._token_plan)
                return out
            except BaseException:
                if self._open:
                    self.rollback()
                raise
        return self._guard(lambda: self._step_batch(layer, q, k, v, checked))

    def _step_batch(self, layer, q, k, v, checked: bool = False) -> np.ndarray:
        count = len(self.decoders)
        if not checked:
            q, k, v = self._checks.tokens(q, k, v, count)     # [B, H, D]: one token per sequence
        if any(c != 1 for c in self._counts):
            raise ValueError(f"step: expected a transaction of one new token per decoder, got num_tokens "
                             f"{self._counts} (use extend)")
        self._tx.write(layer, k, v)
        return self._attend(layer, q)

    # -- plumbing ---------------------------------------------------------------------------------------------
    def _guard(self, run):
        """Run one per-layer call; any failure rolls the whole transaction back before it propagates."""
        try:
            if not self._open:
                raise RuntimeError("transaction: expected an open transaction, got one already finished")
            return run()
        except BaseException:
            if self._open:
                self.rollback()
            raise

    def _attend(self, layer, q) -> np.ndarray:
        """One kernel call: ``q [num_queries, num_q_heads, head_dim]`` (the ragged queries) over the decoders'
        page tables. The tables (checked: no released page visible), positions and the work partition are made
        on the first layer and reused."""
        dec = self.decoders[0]
        plan = self._plans.get(len(q))
        if plan is None:
            plan = self._plans[len(q)] = plan_batch(self.cache, self._pools, [d.seq for d in self.decoders],
                                                    self._tx.indices, self._tx.indptr, self._tx.positions,
                                                    self._counts, q.shape,
                                                    dec.window, self._query_seq(), self._query_pos())
        out = np.empty((len(q), dec.num_q_heads, self.cache.config.head_dim_v), dtype=self._pools.compute)
        return plan.run_layer(self._pools, layer, q, dec.scale, dec.window, out)
