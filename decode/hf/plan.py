"""One forward pass through the paged pool, planned once and run per layer (FlashInfer's plan / run): which new
tokens are real, their pool positions, the page tables and the kernels' plans (`decode.attention_plan.
AttentionPlan`, one per query chunk and window) are computed and validated when the forward begins; each layer
then only checks its own tensors, writes its K/V and runs the plans, inside one append transaction (a
`kvcache.Transaction`; a `TokenBatch` for a decode step, one new token per row), so a
forward's tokens land in every layer or in none.

Shapes (named dimensions; B = batch rows, T = new columns of this forward, N = real new tokens, Q = queries):
    query  [B, num_q_heads, T, head_dim]      torch, as the model's attention module hands it over
    key    [B, num_kv_heads, T, head_dim]     the *new* states only (PagedCache.update returns them as given)
    new_real  bool [B, T]                     True where the new column is a real token (False: padding)

Row b's queries are its columns from its first real token on (every column when it holds tokens already), in
row order: ``query_seq int32 [Q]`` (the row: its CSR row of the page tables), ``query_pos int64 [Q]`` (the
position of the last real token at or before the column). Pad columns: their K/V are never stored, and a pad
query with no real token at or before it in its row returns zeros; a pad query after real tokens (right or inner
padding of a full-attention model) attends them all, as sdpa and eager compute it (only the key of the pad
itself is masked), so a right-padded row's last column gives the same next token as theirs.

Memory: the queries are attended in chunks (`decode.hf.query_chunks`) whose q / output copies and split-K
workspace stay within a few MiB (the copies' buffers are made once a forward, at its first layer, and given back at
its end); K/V go to the pool from views of the model's tensors (bfloat16 into bfloat16 pages as their bits, no
conversion at all).
"""
import math
import numbers

import numba
import numpy as np
import torch

from decode import attention_plan
from decode.attention_plan import AttentionPlan, pools_of, raise_released, routes_tiled
from decode.kernels.input_check import CheckCode, check_inputs

from . import heap, layer_tensors, query_chunks
from .token_column import TORCH_OF, TokenColumn

# forwards with at least this many real queries (prefills) run the kernel on numba's threads: long enough that
# torch's spinning OpenMP threads have gone idle (measured: a 4096-token prefill on 2 cores 16.2 s single-threaded
# vs 11.8 s for sdpa; decode-sized calls are 5-20x slower on 2 threads, see docs/transformers.md)
PARALLEL_QUERIES = 256

# forwards with at least this many real tokens give malloc's free heap back after each layer's attention
# (`heap.trim`). Measured (bfloat16 Llama, 8 layers, 2 threads, peak RSS growth of one generate(), trim / none):
# 4096 tokens 263 / 292 MiB, 2048 122-133 / 174-178, 1024 49-52 / 60-70, 512 21 / 20; at 512 the trim (and the
# re-faulting of what it returned) cost 9% of the prefill (1.21 vs 1.11 s, alternated in one process), above it
# within the run-to-run spread
TRIM_TOKENS = 1024

_F32_LIMIT = 3.4028235677973366e38   # float32 max + half an ulp: the smallest float64 that rounds to inf
_NO_Q = np.zeros(0, dtype=np.float32)
_PLAIN = {"float16": torch.float16, "float32": torch.float32, "float64": torch.float64}   # storage -> same dtype


def auto_kernel_threads() -> int | None:
    """What ``kernel_threads="auto"`` (the default of `decode.hf.PagedCache` and of the server's runner) means on
    this CPU: numba's setting (None) where it has AMX (`decode.attention_plan.AMX_CPU`), 1 elsewhere. Measured
    (docs/transformers.md, docs/serving.md): on the Intel guest with AMX a second kernel thread shortened decode
    steps 6-10% at 4096 tokens and 512 x 8 (a 16-request server step 11%) and did not slow torch's ops beside it;
    on the Zen 4 guest it slowed StaticCache's steps in the same process 1.37-1.5x (torch's and numba's OpenMP
    workers spinning on the same two cores)."""
    return None if attention_plan.AMX_CPU else 1


def check_kernel_threads(value) -> int | None:
    """``kernel_threads`` as `PagedCache` and the server's runner take it: "auto" (`auto_kernel_threads`), None or
    an int >= 1; anything else a ValueError naming it."""
    if isinstance(value, str) and value == "auto":
        return auto_kernel_threads()
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"kernel_threads: expected None, 'auto' or an int >= 1, got {value!r}")
    return value


class ForwardPlan:
    """Reserve the new tokens of every row, then `run_layer` for each layer, then `commit` (or `rollback`).

    Parameters
    ----------
    pool : kvcache.KVCache       the shared pool
    seqs : list[int]             the pool sequence of each batch row
    new_real : bool [B, T]
    kernel_threads : int or None numba threads for forwards of fewer than `PARALLEL_QUERIES` real tokens: 1 plans
                                 serial kernel calls (numba's count untouched), more are set at the first layer
                                 and given back at `commit` / `rollback`
    token_ids : int [B, T] or None   the columns' token ids (prefix caching registers the real ones)
    columns : dict or None       where decode steps' `TokenColumn` buffers are kept between forwards (the
                                 caller's, one per cache: a forward only overwrites them)

    Attributes: ``num_tokens`` (N), ``plans_made`` (`AttentionPlan`s built: one per chunk and window).
    """

    def __init__(self, pool, seqs, new_real: np.ndarray, kernel_threads: int | None = 1, token_ids=None,
                 columns: dict | None = None):
        self.pool, self.seqs, self.new_real = pool, seqs, new_real
        self.batch, self.width = new_real.shape
        starts = np.array([pool.length(s) for s in seqs], dtype=np.int64)      # pool length of each row
        ids = None if token_ids is None else {s: token_ids[b][new_real[b]] for b, s in enumerate(seqs)}
        # one new token in every row (a decode step): a `kvcache.TokenBatch`, one scatter per layer for all rows
        self.one_each = self.width == 1 and bool(new_real.all())
        if self.one_each:                                                      # CacheFullError: nothing changed
            self.tx = pool.transaction(list(seqs), token_ids=ids)
            counts = upto = None
        else:
            counts = new_real.sum(axis=1, dtype=np.int64)                      # [B]
            upto = starts[:, None] + np.cumsum(new_real, axis=1, dtype=np.int64)   # [B, T] real tokens through t
            self.tx = pool.transaction({s: int(c) for s, c in zip(seqs, counts)}, token_ids=ids)
        try:
            self._tables(starts, counts, upto)
        except BaseException:
            self.tx.rollback()
            raise
        self.pools = pools_of(pool)                    # kernel views of the pages, made once per pool
        self.compute = self.pools.compute
        self.plans_made = 0
        # the kernel's numba threads: None (numba's count as it is), 1 (serial plans: numba's count untouched) or
        # more (set at the first layer, given back at commit / rollback)
        self.kernel_threads = (None if kernel_threads is None or self.num_tokens >= PARALLEL_QUERIES
                               else min(kernel_threads, numba.config.NUMBA_NUM_THREADS))
        self._plans = {}                  # window -> [(chunk, AttentionPlan)]
        self._shape = None                # (num_q_heads, head_dim) of the first layer's q: the plans'
        self._most = 0                    # queries of the largest chunk (the size of the q / out buffers)
        self._threads = None              # numba's thread count before this forward set the kernel's
        self._column = None               # a decode step's `TokenColumn` (one column per row, one chunk)
        self._q_buf = self._out_buf = None   # q / out copies (not a decode step's), kept for the forward
        self._columns = {} if columns is None else columns      # TokenColumns by shape, kept across forwards

    # -- planning (once per forward) --------------------------------------------------------------------------
    def _tables(self, starts, counts, upto) -> None:
        self.page_indices, self.page_indptr = self.tx.indices, self.tx.indptr   # int32 [pages], int64 [B + 1]
        if self.one_each:                  # a decode step: row b's one query at its new token, position starts[b]
            self.num_tokens, self._counts, self._kv_rows = self.batch, None, None
            self.first = np.zeros(self.batch, dtype=np.int64)
            self.query_seq, self.query_pos = np.arange(self.batch, dtype=np.int32), starts
            self.padded = self.pad_first = False
            return
        self.num_tokens = int(counts.sum())                                    # N: real new tokens
        attends = upto > 0                                                     # [B, T] columns with a query
        self.first = np.where(attends.any(axis=1), attends.argmax(axis=1), self.width).astype(np.int64)   # [B]
        rows = np.flatnonzero(attends.reshape(-1))                             # [Q] into B * T, row order
        self.query_seq = (rows // self.width).astype(np.int32)                 # [Q]
        self.query_pos = upto.reshape(-1)[rows] - 1                            # [Q] its last real key
        self._counts, self._kv_rows = counts, None
        self.padded = not bool(self.new_real.all())
        self.pad_first = bool(self.first.any())                              # pad queries before a first token

    @property
    def plans(self) -> list:
        """Every `AttentionPlan` this forward has made (one per chunk and window), in the order made."""
        return [plan for made in self._plans.values() for _, plan in made]

    @property
    def column(self) -> TokenColumn | None:
        """A decode step's `TokenColumn` (its q / output buffers; set at the first layer), else None."""
        return self._column

    @property
    def kv_rows(self) -> list:
        """``[(b, seq, columns)]`` of the rows with new tokens: ``columns`` a slice of the real columns, or an int64
        index tensor when pads lie between them. Made at first use (a decode step writes every row at once and
        never asks)."""
        if self._kv_rows is None:
            rows = []
            counts = self.new_real.sum(axis=1) if self._counts is None else self._counts
            for b in np.flatnonzero(counts):
                real = np.flatnonzero(self.new_real[b])
                lo, hi = int(real[0]), int(real[-1]) + 1
                columns = slice(lo, hi) if hi - lo == len(real) else torch.from_numpy(real)
                rows.append((int(b), self.seqs[b], columns))
            self._kv_rows = rows
        return self._kv_rows

    def _check_tables(self, window: int) -> None:
        """The page tables against the pool and the positions against the tables (`check_inputs`, no q), once per
        window: a query reading a released page is refused (`raise_released`) before anything is written."""
        cfg = self.pool.config
        code, bad = check_inputs(_NO_Q, math.inf, self.page_indices, self.page_indptr, self.query_seq,
                                 self.query_pos, cfg.num_pages, cfg.page_size, window)
        if code == CheckCode.FREED_PAGE:
            p = int(self.query_pos[bad])
            raise_released(self.pool, self.seqs[self.query_seq[bad]], max(0, p - window + 1) if window else 0, p)
        if code:
            raise RuntimeError(f"page tables: expected the forward's tables to match the pool, got "
                               f"{CheckCode(code).name} at index {bad} (a bug: please report it)")

    def _plan(self, window: int) -> list:
        """The plans of ``window``'s layers: one `AttentionPlan` per chunk (made under the kernel's thread count)."""
        if window not in self._plans:
            self._check_tables(window)
            num_q_heads, head_dim = self._shape
            v_shape = self.pools.v_shape
            plans = []
            for chunk in self._chunks:
                b0, b1, t0, t1, q0 = chunk
                q1 = q0 + (b1 - b0) * (t1 - t0)
                plans.append((chunk, AttentionPlan(self.query_seq[q0:q1], self.query_pos[q0:q1], window,
                                                   (q1 - q0, num_q_heads, head_dim), v_shape, self.pools.storage,
                                                   threads=1 if self.kernel_threads == 1 else None)))
            self.plans_made += len(plans)
            self._plans[window] = plans
        return self._plans[window]

    def _first_layer(self, query) -> None:
        """Fix the plans' q shape and cut the queries into chunks (`query_chunks`), with their buffers."""
        cfg = self.pool.config
        num_q_heads = query.shape[1] if isinstance(query, torch.Tensor) and query.ndim == 4 else 0
        layer_tensors.check_query(query, self.batch, self.width, num_q_heads, cfg.head_dim)
        if num_q_heads < 1 or num_q_heads % cfg.num_kv_heads:
            raise ValueError(f"query: expected num_q_heads a positive multiple of num_kv_heads={cfg.num_kv_heads}, "
                             f"got shape {tuple(query.shape)}")
        self._shape = (num_q_heads, cfg.head_dim)
        dv = cfg.head_dim_v
        single = not routes_tiled(self.width, num_q_heads // cfg.num_kv_heads, cfg.head_dim, self.pools.storage)
        limit = query_chunks.chunk_limit(int(self.query_pos.max(initial=0)), num_q_heads, cfg.head_dim, dv,
                                         num_q_heads // cfg.num_kv_heads, self.compute.itemsize, single=single)
        self._chunks = query_chunks.chunks(self.first, self.width, limit)
        self._most = max(((b1 - b0) * (t1 - t0) for b0, b1, t0, t1, _ in self._chunks), default=0)
        if self.one_each and len(self._chunks) == 1:
            shape = (self.batch, num_q_heads, cfg.head_dim, dv, self.compute)
            self._column = self._columns.get(shape)
            if self._column is None:
                self._column = self._columns[shape] = TokenColumn(*shape)

    # -- one layer --------------------------------------------------------------------------------------------
    def run_layer(self, layer: int, query, key, value, scale, window: int) -> torch.Tensor:
        """Check ``layer``'s tensors, plan its window (once per forward: at the window's first layer), write the
        layer's new K/V of every row, attend every query over its row's pages and return ``[B, T, num_q_heads,
        head_dim_v]`` in ``query``'s dtype (zeros for pad queries before a row's first token). A bad tensor
        raises before anything is written."""
        if self._shape is None:
            self._first_layer(query)
        self._check_shapes(query, key, value)
        if self._column is not None:                                   # a decode step: checked in one call
            q = self._column.query(query)
            k, v = self._token_kv(key, value)
            if not layer_tensors.arrays_finite(q, k, v):
                self._check_finite(query, key, value)                  # names the value
        else:
            self._check_finite(query, key, value)
        scale = self._scale(scale)
        if self._threads is None and self.kernel_threads is not None and self.kernel_threads > 1:
            self._threads = numba.get_num_threads()     # given back at commit / rollback (`_restore_threads`)
            numba.set_num_threads(self.kernel_threads)
        plans = self._plan(window)
        if self._column is not None:
            self._write_token(layer, key, value, k, v)
            return self._attend_column(plans[0][1], layer, q, query.dtype, scale, window)
        self._write(layer, key, value)
        out = self._attend(plans, layer, query, scale, window)
        if self.num_tokens >= TRIM_TOKENS:
            heap.trim()                     # a prefill's freed temporaries leave RSS before the MLP (`heap`)
        return out

    def _check_shapes(self, query, key, value) -> None:
        """What may change between layers: the tensors' shapes and dtypes."""
        cfg = self.pool.config
        num_q_heads, head_dim = self._shape
        layer_tensors.check_query(query, self.batch, self.width, num_q_heads, head_dim)
        for name, x, dim in (("key", key, cfg.head_dim), ("value", value, cfg.head_dim_v)):
            layer_tensors.check_kv_dtype(name, x)
            if tuple(x.shape) != (self.batch, cfg.num_kv_heads, self.width, dim):
                raise ValueError(f"{name}: expected shape [batch, num_kv_heads, new, head_dim] = "
                                 f"{(self.batch, cfg.num_kv_heads, self.width, dim)}, got {tuple(x.shape)}")

    def _check_finite(self, query, key, value) -> None:
        """ValueError naming the first value of q, k or v (its real rows) that is not finite (q: or that overflows
        the float32 compute dtype)."""
        narrowing = query.dtype == torch.float64 and self.compute == np.float32
        layer_tensors.check_finite("query", query, _F32_LIMIT if narrowing else None)
        rows = [(b, columns) for b, _, columns in self.kv_rows] if self.padded else None
        layer_tensors.check_finite("key", key, rows=rows)
        layer_tensors.check_finite("value", value, rows=rows)

    def _scale(self, scale) -> float:
        """The scale (1 / sqrt(head_dim) for None), checked."""
        if scale is None:
            return 1.0 / math.sqrt(self._shape[1])
        if isinstance(scale, bool) or not isinstance(scale, numbers.Real) or not 0.0 < scale < math.inf:
            raise ValueError(f"scaling: expected a finite float > 0 (or None), got {scale!r}")
        return float(scale)

    def _token_kv(self, key, value) -> tuple:
        """A decode step's new K and V of every row ``[B, H, D]`` as the pool takes them (bfloat16 into bfloat16
        pages: their bits)."""
        bits = self.pool.config.storage == "bfloat16"
        return (layer_tensors.token_rows(key, bits and key.dtype == torch.bfloat16),
                layer_tensors.token_rows(value, bits and value.dtype == torch.bfloat16))

    def _write_token(self, layer: int, key, value, k, v) -> None:
        """A decode step's ``k, v [B, H, D]`` (`_token_kv`, checked finite) into the transaction: one write of
        every row; the pool casts to its storage and refuses values that overflow it."""
        storage = self.pool.config.storage
        # bfloat16 bits, or already the pool's own float dtype: nothing for the pool's check to cast or refuse
        same = _PLAIN.get(storage) is key.dtype and key.dtype is value.dtype
        if not (k.dtype == np.uint16 and v.dtype == np.uint16) and not same:
            k, v = self.pool.pool.check_kv(k, v, self.batch, layered=False)
        self.tx.write(layer, k, v)

    def _write(self, layer: int, key, value) -> None:
        """Every row's real new K/V into the transaction (checked: finite above; the pool casts to its storage and
        refuses values that overflow it)."""
        if self.one_each:
            self._write_token(layer, key, value, *self._token_kv(key, value))
            return
        bits = self.pool.config.storage == "bfloat16"
        for b, seq, columns in self.kv_rows:
            k_bits, v_bits = bits and key.dtype == torch.bfloat16, bits and value.dtype == torch.bfloat16
            k = layer_tensors.kv_rows(key, b, columns, k_bits)
            v = layer_tensors.kv_rows(value, b, columns, v_bits)
            self.tx.write(layer, seq, k, v, checked=k_bits and v_bits)

    def _attend(self, plans: list, layer: int, query, scale: float, window: int) -> torch.Tensor:
        num_q_heads = self._shape[0]
        dv = self.pool.config.head_dim_v
        out_t = (torch.zeros if self.pad_first else torch.empty)((self.batch, self.width, num_q_heads, dv),
                                                                 dtype=query.dtype)         # [B, T, Hq, Dv]
        direct_out = out_t.dtype == TORCH_OF[self.compute]
        # q / out copies in the compute dtype: made at the first layer that needs them and kept for the forward's
        # layers (a mapping made and unmapped per layer cost its page faults every layer: 4 MiB ~2.9 ms here), given
        # back to the OS at its commit / rollback
        q_buf = self._q_buf
        out_buf = None if direct_out else self._out_buf
        if out_buf is None and not direct_out:
            out_buf = self._out_buf = query_chunks.scratch((self._most, num_q_heads, dv), self.compute)
        pools = self.pools
        k_run, v_run, k_scales, v_scales = (pools.k_run[layer], pools.v_run[layer], pools.k_scales[layer],
                                            pools.v_scales[layer])
        for chunk, plan in plans:
            n = plan.out_shape[0]
            q_view = layer_tensors.chunk_view(query, chunk, True)                          # [rows, cols, Hq, D]
            if q_view.dtype == TORCH_OF[self.compute] and q_view.is_contiguous():
                q = q_view.numpy().reshape(n, num_q_heads, -1)
            else:
                if q_buf is None:
                    q_buf = self._q_buf = query_chunks.scratch((self._most,) + self._shape, self.compute)
                q = q_buf[:n]
                torch.from_numpy(q).view(q_view.shape).copy_(q_view)
            o_view = layer_tensors.chunk_view(out_t, chunk, False)                          # [rows, cols, Hq, Dv]
            out = o_view.numpy().reshape(n, num_q_heads, dv) if direct_out else out_buf[:n]
            plan.run(q, k_run, v_run, self.page_indices, self.page_indptr, scale, window, out, k_scales, v_scales)
            if not direct_out:
                o_view.copy_(torch.from_numpy(out).view(o_view.shape))
        return out_t

    def _attend_column(self, plan, layer: int, q, dtype, scale: float, window: int) -> torch.Tensor:
        """A decode step's attention (`TokenColumn`): ``q [B, Hq, D]`` in the compute dtype, out ``[B, 1, Hq, Dv]``
        in ``dtype``."""
        pools, column = self.pools, self._column
        out = column.output(dtype)
        plan.run(q, pools.k_run[layer], pools.v_run[layer], self.page_indices, self.page_indptr, scale, window,
                 out, pools.k_scales[layer], pools.v_scales[layer])
        return column.result(out, dtype)

    def commit(self) -> None:
        self._end()
        self.tx.commit()

    def rollback(self) -> None:
        self._end()
        self.tx.rollback()

    def _end(self) -> None:
        self._q_buf = self._out_buf = None          # the buffers' mappings go back to the OS
        self._restore_threads()

    def _restore_threads(self) -> None:
        """numba's thread count as it was before the first layer: the kernel's count holds for the whole forward
        (setting it per layer cost ~40 µs a layer of a decode step, between the model's GEMMs)."""
        if self._threads is not None:
            threads, self._threads = self._threads, None
            numba.set_num_threads(threads)

