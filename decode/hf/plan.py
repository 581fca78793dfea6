"""One forward pass through the paged pool: a plan computed once (which new tokens are real, their pool
positions, the page tables) and run per layer (write the layer's K/V, one kernel call), inside one
`kvcache.Transaction`, so a forward's tokens land in every layer or in none.

Shapes (named dimensions; B = batch rows, T = new columns of this forward, N = real new tokens):
    query  [B, num_q_heads, T, head_dim]      torch, as the model's attention module hands it over
    key    [B, num_kv_heads, T, head_dim]     the *new* states only (PagedCache.update returns them as given)
    new_real  bool [B, T]                     True where the new column is a real token (False: padding)

Pad columns: their K/V are never stored, and a pad query with no real token at or before it in its row returns
zeros; a pad query after real tokens (right or inner padding of a full-attention model) attends them all, as
sdpa and eager compute it (only the key of the pad itself is masked), so a right-padded row's last column gives
the same next token as theirs.
"""
import numba
import numpy as np
import torch

from decode.attention import paged_decode_attention

from .page_dtype import kernels_take_storage

# forwards with at least this many real queries (prefills) run the kernel on numba's threads: long enough that
# torch's spinning OpenMP threads have gone idle (measured: a 4096-token prefill on 2 cores 16.2 s single-threaded
# vs 11.8 s for sdpa; decode-sized calls are 5-20x slower on 2 threads, see docs/transformers.md)
PARALLEL_QUERIES = 256


_TAKES_STORAGE = kernels_take_storage()


def _storage_kwargs(cfg) -> dict:
    """``storage=`` for kernels that take it (bfloat16 pages are uint16 bits only the storage name tells apart)."""
    return {"storage": cfg.storage} if _TAKES_STORAGE else {}


class ForwardPlan:
    """Reserve the new tokens of every row, then `run_layer` for each layer, then `commit` (or `rollback`).

    Parameters
    ----------
    pool : kvcache.KVCache       the shared pool
    seqs : list[int]             the pool sequence of each batch row
    new_real : bool [B, T]
    token_ids : int [B, T] or None   the columns' token ids (prefix caching registers the real ones)
    """

    def __init__(self, pool, seqs, new_real: np.ndarray, kernel_threads: int | None = 1, token_ids=None):
        self.pool = pool
        self.kernel_threads = kernel_threads
        self.new_real = new_real
        batch, width = new_real.shape
        self.batch, self.width = batch, width
        counts = new_real.sum(axis=1, dtype=np.int64)                          # [B]
        starts = np.array([pool.length(s) for s in seqs], dtype=np.int64)      # pool length of each row
        upto = starts[:, None] + np.cumsum(new_real, axis=1, dtype=np.int64)   # [B, T] real tokens through t
        ids = None if token_ids is None else {s: token_ids[b][new_real[b]] for b, s in enumerate(seqs)}
        self.tx = pool.transaction({s: int(c) for s, c in zip(seqs, counts)}, token_ids=ids)  # CacheFullError:
        # nothing changed
        try:
            self._tables(seqs, counts, upto)
        except BaseException:
            self.tx.rollback()
            raise
        self.seqs = seqs
        self.layers_written = 0

    def _tables(self, seqs, counts, upto) -> None:
        tables = [self.tx.pages(s) for s in seqs]
        self.page_indptr = np.zeros(self.batch + 1, dtype=np.int64)            # [B + 1]
        self.page_indptr[1:] = np.cumsum([len(t) for t in tables])
        self.page_indices = (np.concatenate(tables) if tables else np.zeros(0)).astype(np.int32)
        offsets = np.zeros(self.batch + 1, dtype=np.int64)                     # [B + 1] real-token offsets
        offsets[1:] = np.cumsum(counts)
        self.num_queries = int(offsets[-1])                                    # N: real new tokens
        self.row_slices = [(int(seqs[b]), int(offsets[b]), int(offsets[b + 1]))
                           for b in range(self.batch) if counts[b]]
        cells = self.batch * self.width
        attends = np.flatnonzero((self.new_real | (upto > 0)).reshape(-1))    # [Q] into B * T: computed queries
        self.query_seq = (attends // self.width).astype(np.int32)                         # [Q]
        self.query_pos = upto.reshape(-1)[attends] - 1                                    # [Q] its last real key
        real = np.flatnonzero(self.new_real.reshape(-1))                                  # [N] into B * T
        self.kv_index = None if len(real) == cells else torch.from_numpy(real)
        self.q_index = None if len(attends) == cells else torch.from_numpy(attends)

    @staticmethod
    def _rows(x: torch.Tensor, dtype: torch.dtype, index) -> np.ndarray:
        """``x [B, H, T, D]`` -> the tokens ``index`` (into B * T; None: all) ``[n, H, D]`` as numpy ``dtype``."""
        b, h, t, d = x.shape
        rows = x.detach().transpose(1, 2).reshape(b * t, h, d)                 # [B * T, H, D]
        if index is not None:
            rows = rows.index_select(0, index)                                 # [n, H, D]
        return rows.to(dtype).contiguous().numpy()

    def run_layer(self, layer: int, query, key, value, scale, window: int) -> torch.Tensor:
        """Write ``layer``'s new K/V of every row, attend every real query over its row's pages (one kernel
        call) and return ``[B, T, num_q_heads, head_dim_v]`` in ``query``'s dtype (zeros for pad queries)."""
        cfg = self.pool.config
        compute = torch.float64 if cfg.dtype == np.float64 else torch.float32
        kv_dtype = torch.float64 if key.dtype == torch.float64 else torch.float32
        k, v = self._rows(key, kv_dtype, self.kv_index), self._rows(value, kv_dtype, self.kv_index)  # [N, Hkv, D]
        for seq, start, stop in self.row_slices:
            self.tx.write(layer, seq, k[start:stop], v[start:stop])
        self.layers_written += 1
        q = self._rows(query, compute, self.q_index)                                      # [Q, Hq, D]
        threads = numba.get_num_threads()
        if self.kernel_threads is not None and self.num_queries < PARALLEL_QUERIES:
            numba.set_num_threads(min(self.kernel_threads, numba.config.NUMBA_NUM_THREADS))
        pool = self.pool.pool                     # the KVCache's page arrays (`kvcache.pool_view.PoolView`)
        try:
            out = paged_decode_attention(q, pool.k_pages(layer), pool.v_pages(layer), self.page_indices,
                                         self.page_indptr, self.query_seq, self.query_pos, scale=scale,
                                         window=window, k_scales=pool.k_scales(layer),
                                         v_scales=pool.v_scales(layer), **_storage_kwargs(cfg))  # [Q, Hq, Dv]
        finally:
            numba.set_num_threads(threads)
        result = torch.from_numpy(out).to(query.dtype)
        b, t = self.batch, self.width
        if self.q_index is None:
            return result.reshape(b, t, *result.shape[1:])                                # [B, T, Hq, Dv]
        full = result.new_zeros((b * t,) + tuple(result.shape[1:]))                       # [B * T, Hq, Dv]
        full.index_copy_(0, self.q_index, result)
        return full.reshape(b, t, *result.shape[1:])

    def commit(self) -> None:
        self.tx.commit()

    def rollback(self) -> None:
        self.tx.rollback()
