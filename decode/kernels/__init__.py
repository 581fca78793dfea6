"""Numba kernels for paged attention, split by concern:

    simd.py       scalar and SIMD helpers: float16 loads, prefetch, exact 2**n, polynomial exp, LLVM-IR dot and PV
                  register blocks (each with a plain-Python twin for NUMBA_DISABLE_JIT)
    blocks.py     jitted building blocks over one page tile: q.k scores, p.v accumulation, online-softmax update,
                  normalise, split-K combine
    decode.py     the single-query ("decode") kernel: work units, planning, the parallel driver
    int8.py       the same over int8 pages and their float16 group scales (kvcache.quant's format); its row
                  passes in int8_rows.py, its LLVM-IR micro-kernels in int8_simd.py
    multiquery.py the tiled multi-query kernel (extend, prefill, verification: runs of consecutive queries of one
                  sequence, K/V blocks loaded once per tile of rows; int8 blocks widened with their scales),
                  its planning and parallel driver
    gemm.py       the 4-row register-blocked micro-GEMM in LLVM IR that multiquery.py's tiles run on
    checks.py     the one-pass input check of the validating wrapper

Everything here takes arrays and scalars only: no globals, no objects, no checks. The validating entry point is
`decode.attention.paged_decode_attention`; read `docs/kernel.md` for the algorithm and the measurements.

Layout (per layer):
    q:            [num_queries, num_q_heads, head_dim]              compute dtype (float32 or float64)
    k_pages:      [num_pages, num_kv_heads, page_size, head_dim]    float32 / float64 / uint16 (= float16 bits)
    v_pages:      [num_pages, num_kv_heads, page_size, head_dim_v]  same dtype as k_pages
    page_indices: int32 [total_pages]      CSR pages of every sequence (-1 = freed, never read)
    page_indptr:  int64 [num_seqs + 1]
    query_seq:    int32 [num_queries]      the CSR row of each query
    query_pos:    int64 [num_queries]      absolute position p of each query; it sees keys lo..p
    out:          [num_queries, num_q_heads, head_dim_v]            compute dtype

Compute dtype: float32 for float16 (uint16) and float32 storage, float64 for float64 storage.
"""
from .cachedir import NUMBA_CACHE_FALLBACK  # noqa: F401  (first: settles numba's cache directory)
from .checks import check_inputs  # noqa: F401
from .decode import decode_parallel, decode_units, plan_units  # noqa: F401
from .int8 import int8_parallel, int8_units  # noqa: F401
