"""Bad input gets exactly the single-process error, in the driver, before anything is sent to a worker.

The checks are not re-implemented: every call is first made by real `decode.Decoder` objects with the same
configuration on a scratch pool in the driver (one page, plus one page per row for batches), then undone (the
scratch sequences are truncated back to 0). The exception a bad input raises is therefore the single-process
one, type and message. Cost per call: the checks plus one kernel call over one token per row (tens of us).

Calls whose single-process checks need a pool as large as the request (a T-token transaction) use the
Decoder's checks, the ones `DecoderTransaction` runs (`InputChecks.query`, `InputChecks.kv` of `checks_for(decoder)`,
`kvcache.checks.check_int("layer", ...)`), in the same order.
"""
import numpy as np

from decode import Decoder, batch_step, batch_transaction
from decode.inputs import checks_for
from kvcache import KVCache
from kvcache.checks import check_int
from kvcache.config import CacheConfig


class Validator:
    """Scratch decoders of one configuration (the `Decoder` arguments)."""

    def __init__(self, num_q_heads, num_kv_heads, head_dim, head_dim_v, dtype, page_size, max_tokens, *, scale,
                 window, num_layers):
        # the full-size configuration is checked without allocating it (Decoder's own errors for bad arguments)
        full = CacheConfig.build(num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=head_dim,
                                 head_dim_v=head_dim_v, page_size=page_size, max_tokens=max_tokens, dtype=dtype)
        if full.quantized or full.bfloat16:
            raise ValueError(f"dtype: expected float16, float32 or float64 for decode.distributed (int8 and "
                             f"bfloat16 storage are not sharded), got {dtype!r}")
        self.decoder = Decoder(num_q_heads, num_kv_heads, head_dim, head_dim_v, dtype, page_size,
                               max_tokens=page_size, scale=scale, window=window, num_layers=num_layers)
        self.config = self.decoder.config
        self.num_layers = num_layers
        self._batches: dict[int, list[Decoder]] = {}

    # -- whole calls ----------------------------------------------------------------------------------------
    def step(self, q, k, v) -> None:
        """`Decoder.step`'s checks (the scratch decoder takes the token, then lets it go)."""
        self.decoder.step(q, k, v)
        self.decoder.truncate(0)

    def num_tokens(self, k) -> int:
        """T of ``k [T, num_kv_heads, head_dim]`` as `Decoder.extend` / `append` read it."""
        shape = np.shape(k)
        if len(shape) != 3:
            raise ValueError(f"k: expected shape [T, num_kv_heads, head_dim], got {shape}")
        return shape[0]

    def single_layer(self, what: str) -> None:
        if self.num_layers != 1:
            raise ValueError(f"{what}: expected a one-layer cache (use transaction() for several layers), "
                             f"got num_layers={self.num_layers}")

    def batch_step(self, q, k, v) -> None:
        """`decode.batch_step`'s checks for ``len(q)`` rows (or one row given as ``[num_q_heads, head_dim]``)."""
        decoders = self._batch(1 if np.ndim(q) == 2 else len(q))
        batch_step(decoders, q, k, v)
        for d in decoders:
            d.truncate(0)

    def _batch(self, rows: int) -> list[Decoder]:
        if rows not in self._batches:
            cache = KVCache(num_kv_heads=self.config.num_kv_heads, head_dim=self.config.head_dim,
                            head_dim_v=self.config.head_dim_v, dtype=self.config.dtype,
                            page_size=self.config.page_size, num_pages=max(1, rows), num_layers=self.num_layers)
            d = self.decoder
            self._batches[rows] = [Decoder.on_cache(cache, d.num_q_heads, scale=d.scale, window=d.window or None)
                                   for _ in range(rows)]
        return self._batches[rows]

    # -- transactions ---------------------------------------------------------------------------------------
    def open(self, num_tokens: int, rows: int = 0):
        """A scratch transaction mirroring a one-token one (``rows`` > 0: a batch of that many sequences), or
        None for a T-token transaction (checked with the public checks, `layer`)."""
        if rows:
            return batch_transaction(self._batch(rows))
        return self.decoder.transaction(num_tokens) if num_tokens == 1 else None

    def layer(self, scratch, kind: str, num_tokens: int, layer, q, k, v) -> None:
        """The checks of ``tx.<kind>(layer, ...)`` inside a ``num_tokens`` transaction; ``scratch`` from `open`."""
        if scratch is not None:
            if kind == "append":
                scratch.append(layer, k, v)
            else:
                getattr(scratch, kind)(layer, q, k, v)
            return
        if kind == "step":
            raise ValueError(f"step: expected a one-token transaction (use extend for several tokens), "
                             f"got num_tokens={num_tokens}")
        if kind == "extend":
            checks_for(self.decoder).query(q, num_tokens)
        checks_for(self.decoder).kv(k, v, num_tokens)
        check_int("layer", layer, maximum=self.num_layers - 1)

    def finish(self, scratch, commit: bool) -> None:
        """End a scratch transaction: commit (raising the single-process error when a layer is missing) and let
        the tokens go, or roll back."""
        if scratch is None:
            return
        if commit:
            scratch.commit()
            for d in scratch.decoders:
                d.truncate(0)
        else:
            scratch.rollback()

    def check_layer(self, layer) -> int:
        return check_int("layer", layer, maximum=self.num_layers - 1)
