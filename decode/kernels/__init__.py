"""Numba kernels for paged attention: one skeleton per kernel family, one row loader per storage format.

    units.py      work units of both families (key ranges cut at absolute positions), `balance` over threads,
                  the split-K merge (`merge_rows`), runs of consecutive queries (`find_runs`)
    per_query.py  the per-query ("decode") kernel: page walk, units body, serial and parallel drivers
    tiled.py      the tiled multi-query kernel (extend, prefill, verification: runs of consecutive queries of one
                  sequence, K/V blocks loaded once per tile of rows), its units body and drivers
    loaders.py    the row loaders (float32, float64, float16 bits, bfloat16 bits, int8 + float16 scales) both
                  skeletons call per page tile; int8's pieces in int8_rows.py / int8_simd.py
    blocks.py     jitted building blocks over one page tile: q.k scores (one block loop for every dot, the dot
                  chosen at compile time), p.v accumulation, online-softmax update, query load, normalise
    bf16_dot.py   bfloat16 pages by vdpbf16ps: q split exactly into bfloat16 parts, the 4 x 4 / 1 x 4 dot blocks
    pair_scores.py the tiled kernel's score GEMM over bfloat16 pairs (vdpbf16ps) for a tile whose q is exactly
                  bfloat16
    amx_tiles.py  Intel AMX tile multiplies (tdpbf16ps, LLVM intrinsics) for the tiled kernel's two GEMMs over
                  bfloat16 pages, where the CPU has AMX-BF16 and the OS grants the tile state
    amx_blocks.py the tiled kernel's block steps around them: q / weights split into exact bfloat16 parts, keys
                  staged, value rows paired, the score epilogue
    amx_decode.py the per-query kernel's walk on the tiles for groups of >= 16 q heads per kv head: the parts as
                  columns / rows, value rows paired by an IR interleave
    tile_softmax.py its online softmax over a block of scores laid out keys x heads, 16 heads per 512-bit vector
                  in LLVM IR
    simd.py       scalar and SIMD helpers: element loads, prefetch hints and page touches (address translations
                  ahead of the hints), borrowed arrays, exact 2**n, lane reductions, polynomial exp (each with a
                  plain-Python twin for NUMBA_DISABLE_JIT), zero arrays on 64-byte rows
    register_blocks.py the LLVM-IR dot (4 x 4, 1 x 4) and PV (4-head, 1-head) register blocks, with NumPy twins
    vector_ir.py  the LLVM IR the vector code is built of: widening loads, masked tails, ordered adds, FMAs, the
                  butterfly reduction of many accumulators, the bfloat16 pair widening
    gemm.py       the 4- / 6-row register-blocked micro-GEMMs in LLVM IR that tiled.py's tiles run on (float32 /
                  float64 FMAs; bfloat16 pairs by vdpbf16ps, `gemm_strip_bf`)
    input_check.py the one-pass input check of the validating wrapper (its codes: `CheckCode`)
    cachedir.py   where numba's on-disk cache goes (imported first)

Everything here takes arrays and scalars only: no globals, no objects, no checks. Planning (which kernel, which
units) is `decode.attention_plan`; the validating entry point is `decode.attention.paged_decode_attention`;
read `docs/kernel.md` for the algorithm and the measurements.

Layout (per layer):
    q:            [num_queries, num_q_heads, head_dim]              compute dtype (float32 or float64)
    k_pages:      [num_pages, num_kv_heads, page_size, head_dim]    float32 / float64 / uint16 (float16 bits) /
                                                                    int16 (bfloat16 bits) / int8 (+ scales)
    v_pages:      [num_pages, num_kv_heads, page_size, head_dim_v]  same dtype as k_pages
    page_indices: int32 [total_pages]      CSR pages of every sequence (-1 = freed, never read)
    page_indptr:  int64 [num_seqs + 1]
    query_seq:    int32 [num_queries]      the CSR row of each query
    query_pos:    int64 [num_queries]      absolute position p of each query; it sees keys lo..p
    out:          [num_queries, num_q_heads, head_dim_v]            compute dtype

Compute dtype: float32 for every storage format but float64 (float64).
"""
from .cachedir import NUMBA_CACHE_FALLBACK  # noqa: F401  (first: settles numba's cache directory)
