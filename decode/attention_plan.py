"""Plan once, run per layer (FlashInfer's plan / run): the one place that decides how an attention call is computed.

An `AttentionPlan` is made from the queries' sequences and positions and the shapes, for every batch shape
(one query per sequence, runs of consecutive queries of one sequence, a mix of both; every storage format,
int8 included), and reused by every layer that attends with the same positions (a multi-layer token, batch
step or extend). Runs of >= `route_min_run(group, head_dim, storage)` queries, bar a measured length
(`route_rule`, `ROUTE_MIN_RUN`), go to the tiled kernel (`decode.kernels.tiled`), the other queries to the
per-query kernel (`decode.kernels.per_query`).

Determinism (docs/kernel.md): key ranges are cut at absolute multiples of a piece length that depends on the
model's shapes, the page size and whether the AMX tiles run (`SPLIT_TOKENS`, `AMX_SPLIT_TOKENS`,
`TILED_SPLIT`), never on the thread count or on the other queries of the call; threads only decide who computes
a unit, and partial states are merged in key order. So a sequence's output is bitwise the same alone, in any
batch, on any number of threads, with any page placement.

Also here, each in one place: the compute-dtype rule (`compute_dtype`), the accumulation dtype of q.k
(`accumulator`), the kernels' view of a storage format (`kernel_view`: float16 pages as uint16, bfloat16 bits as
int16, int8 scales as uint16) and CSR page tables (`csr`). The decoder side of a plan (page tables of a token or
a batch, checked once against released pages) is `plan_token` / `plan_batch` over `LayerPools`.

    plan = AttentionPlan(query_seq, query_pos, window, q_shape, v_shape, storage)
    plan.run(q, k_run, v_run, page_indices, page_indptr, scale, window, out, k_scales=None, v_scales=None)
"""
import weakref

import numba
import numpy as np

from kvcache.jit_store import writable
from kvcache.jit_target import target_has

from .kernels import amx_decode, amx_tiles, bf16_dot
from .kernels.per_query import query_parallel, query_serial
from .kernels.tiled import tiled_parallel, tiled_serial
from .kernels.units import find_runs, plan_tiles, plan_units

# per-query kernel (measured, docs/kernel.md)
SERIAL_WORK = 1 << 19        # visible tokens * num_q_heads * (head_dim + head_dim_v) below this: no threads
SPLIT_TOKENS = 256           # key ranges are cut at absolute multiples of this (rounded up to whole blocks):
                             # the same for every head count, so a head-sharded worker cuts as one process does
AMX_SPLIT_TOKENS = 1024      # ... and of this where the AMX tiles take the queries (`amx_decode.shapes_fit`): each
                             # piece costs a merge slot and a first block; MQA-32768 hot, 2 threads, 1.69 -> 1.43 ms
BLOCK_TOKENS = 64            # keys per online-softmax block (rounded down to whole pages, at least one page)
PREFETCH_BYTES = 4096        # software prefetch distance along the walk of K and V runs
# tiled kernel
MIN_RUN = 3                  # run length from which formats without a measured `ROUTE_MIN_RUN` are tiled
TILE_ROWS = 128              # (query, q head) rows per tile: tokens per tile = max(1, TILE_ROWS // group)
TILE_BLOCK = 128             # keys per score tile
TILED_SERIAL_WORK = 1 << 20  # rows x visible keys x (head_dim + head_dim_v) below this: no threads
TILED_SPLIT = 1024           # a tile's keys are cut at absolute multiples of this (a multiple of TILE_BLOCK)
TILED_WHOLE = 4              # ... unless its run has this many tiles per kv head or more (never with split_tokens)

PRECISIONS = ("default", "highest")
WIDE_HEAD_DIM = 64           # q.k of shorter heads is accumulated in float64 (`accumulator`)
BFLOAT16 = "bfloat16"        # the storage format without a numpy dtype: uint16 bits (`kvcache.bf16`)
_KERNEL_VIEW = {np.dtype(np.float16): np.dtype(np.uint16)}
_NO_UNITS = np.empty((0, 4), dtype=np.int64)
_NO_SKIP = np.empty(0, dtype=np.int64)
_NO_ITEMS = np.empty((0, 3), dtype=np.int64)


def compute_dtype(storage) -> np.dtype:
    """Dtype of q, scores, softmax and output for a storage format (a numpy dtype or "bfloat16"): float64 for
    float64 storage, float32 for every other."""
    if isinstance(storage, str) and storage == BFLOAT16:
        return np.dtype(np.float32)
    return np.dtype(np.float64) if np.dtype(storage) == np.float64 else np.dtype(np.float32)


def accumulator(compute: np.dtype, precision: str = "default", head_dim: int = WIDE_HEAD_DIM):
    """A zero of the q.k accumulation dtype (a type parameter of the kernels): float32 like every peer, float64
    for float64 storage, precision="highest" (each score its exact value rounded once into float32) or a
    head_dim below WIDE_HEAD_DIM (docs/kernel.md: there a float32 sum's final butterfly dominates its error and
    the budget's sqrt(head_dim) allowance is small; q.k is a small part of the work)."""
    if compute == np.float64 or precision == "highest" or head_dim < WIDE_HEAD_DIM:
        return np.float64(0.0)
    return np.float32(0.0)


_PLAN_ACC = {}                  # (storage, precision, wide head) -> `plan_accumulator`'s zero


def plan_accumulator(storage, precision: str = "default", head_dim: int = WIDE_HEAD_DIM):
    """The kernels' q.k accumulation zero for a storage format (`accumulator` of its `compute_dtype`; float32 for
    int8, whose micro-kernels accumulate in float32), remembered per format: a plan is made per decode step."""
    key = (storage, precision, head_dim >= WIDE_HEAD_DIM)
    acc0 = _PLAN_ACC.get(key)
    if acc0 is None:
        acc0 = np.float32(0.0) if k_int8(storage) else accumulator(compute_dtype(storage), precision, head_dim)
        _PLAN_ACC[key] = acc0
    return acc0


# Routing (issue 20; docs/kernel.md, "Routing"): the shortest run of one sequence's consecutive queries that the
# tiled kernel takes, by (storage, head_dim) and group (num_q_heads / num_kv_heads): ((smallest group, run
# length), ...), a group taking the entry of the largest listed group <= it; a head_dim the entry of the largest
# listed head_dim <= it; a third element lists run lengths above the first that still go to the per-query
# kernel (T = 5 at G = 4 pads 20 rows to 32, T = 3 at G = 8 24 rows to 32: the tiled kernel loses there again
# after winning at the shorter run that fills its rows).
# Measured on the Zen 4 guest twice: 2026-12-04 after the tiled kernel's bfloat16 pairs and 2026-12-05 (main at
# eb7baed) (`python -m benchmarks.routing --contexts 512,4096 --tokens 2,3,4,5,6,7 --groups 1,2,4,8,16 --head-dims
# 64,128 --threads 1`, and for bfloat16 pages again with `--q-dtype bfloat16`: 32 q heads, page 16, one numba
# thread, CPU time of interleaved calls, median of 15 per-round ratios; benchmarks/results/routing-zen4-2026-12-0
# {4,5}*.jsonl). Each length is the one whose worst loss (routed / faster kernel, over both runs, both contexts and,
# for bfloat16 pages, both q dtypes) is least. Lengths (worst loss left over both runs):
#   d128 float32   G1 5 (1.09), G2 4 (1.15), G4 4 not 5 (1.05), G8 2 not 3 (1.06), G16+ 2 (1.00)
#   d128 float16   G1 7 (1.04), G2 5 (1.00), G4 4 not 5 (1.00), G8 2 not 3 (1.04), G16+ 2 (1.00)
#   d128 bfloat16  G1 6 (1.21), G2 4 (1.20), G4 4 not 5 (1.12), G8+ 2 (1.06)
#   d64  float32   G1 5 (1.08), G2 4 (1.00), G4 3 (1.05), G8+ 2 (1.05)
#   d64  float16   G1 6 (1.04), G2 5 (1.13), G4 4 (1.07), G8+ 2 (1.00)
#   d64  bfloat16  G1 6 (1.13), G2 4 (1.06), G4 3 (1.09), G8+ 2 (1.00)
# (the 2026-12-05 run changed only G8 at d128 float32 / float16, from 4: 1.17 / 1.11 left there). A single query
# (a decode step) is never tiled, although at G >= 16 bfloat16 (and d64) the tiled kernel won
# there too (0.52-0.98): decode steps keep their kernel. Short runs lose in the tiled kernel because a tile's
# rows (tokens x group) are padded to 16 lanes, while the per-query kernel shares each K/V row among the group's
# heads too. int8 pages: measured on the Intel guest with AMX only (2026-12-07, the command above with `--storages
# int8`, twice; benchmarks/results/routing-intel-amx-2026-12-07-int8{,-b}.jsonl), where MIN_RUN (3, unmeasured
# until then) lost up to 2.02x (d128 G1 runs of 3-6 tiled); taken on every CPU with AVX-512 (without it:
# `ROUTE_MIN_RUN_AVX2`):
#   d128 int8      G1 7 (1.00), G2 4 (1.00), G4 3 (1.04), G8+ 2 (1.01)
#   d64  int8      G1 5 (1.00), G2 4 (1.05), G4 3 (1.00), G8+ 2 (1.00)
# Head dims below 64 (q.k in float64) and float64 storage: MIN_RUN (not measured).
ROUTE_MIN_RUN = {
    ("float32", 64): ((1, 5), (2, 4), (4, 3), (8, 2)),
    ("float16", 64): ((1, 6), (2, 5), (4, 4), (8, 2)),
    (BFLOAT16, 64): ((1, 6), (2, 4), (4, 3), (8, 2)),
    ("float32", 128): ((1, 5), (2, 4), (4, 4, (5,)), (8, 2, (3,)), (16, 2)),
    ("float16", 128): ((1, 7), (2, 5), (4, 4, (5,)), (8, 2, (3,)), (16, 2)),
    (BFLOAT16, 128): ((1, 6), (2, 4), (4, 4, (5,)), (8, 2)),
    ("int8", 64): ((1, 5), (2, 4), (4, 3), (8, 2)),
    ("int8", 128): ((1, 7), (2, 4), (4, 3), (8, 2)),
}

# bfloat16 pages where the tiled kernel runs on AMX tiles (`kernels.amx_tiles.usable`): its rows are padded to 32
# and its products take other costs, so the lengths differ. Measured on the 2-vCPU Intel guest with AMX (2026-12-06,
# main at 0095f0d; the same command, `--storages bfloat16`, both q dtypes; benchmarks/results/routing-intel-amx-
# 2026-12-06*.jsonl), lengths (worst loss): d128 G1 6 (1.09), G2 5 (1.00), G4 4 (1.08), G8 3 (1.00), G16+ 2 (1.00);
# d64 G1 7 (1.06), G2 6 (1.04), G4 5 (1.08), G8 3 (1.00), G16+ 2 (1.00). Re-measured for G16 / G32 once decode
# queries of those groups ran on the tiles faster (2026-12-07, main at c392bca, `--groups 16,32 --tokens 2,3,4,5`,
# contexts 512 / 2048 / 4096; routing-intel-amx-2026-12-07-c392bca.jsonl): d64 G32 runs of 2-3 now lose tiled
# (tiled / per-query 1.04-1.14 at T = 2, 1.00-1.13 at T = 3), so d64 G32+ 4 (1.10). Re-measured after the tiled
# kernel's fused softmax step (2026-12-07, main at c608548, `--groups 1,2,4,8,16 --tokens 2,3,4,5,6,7` and `--groups
# 32 --tokens 2,3,4,5`, both q dtypes; routing-intel-amx-2026-12-07-bf16{,q,-g32}-c608548.jsonl), where the lengths
# above lost up to 1.75x (d128 G1 T5: tiled / per-query 0.57): d128 G1 4 (1.09), G2 3 (1.00), G4 3 (1.00), G8+ 2
# (1.00); d64 G1 5 (1.01), G2 4 (1.06), G4 3 (1.00), G8+ 2 (1.00; G32 runs of 2 now 0.85-0.95 tiled).
ROUTE_MIN_RUN_AMX = {
    64: ((1, 5), (2, 4), (4, 3), (8, 2)),
    128: ((1, 4), (2, 3), (8, 2)),
}

# float32 / float16 pages on a CPU with AMX (`AMX_CPU`: Intel Sapphire Rapids and later, two 512-bit FMA units a
# core, on which the tiled kernel's GEMM blocks gain more over the per-query kernel than on the Zen 4 guest's 256-bit
# units: there `ROUTE_MIN_RUN` lost up to 1.85x, d128 float32 G1 runs of 3-4 left to the per-query kernel).
# Measured on the 2-vCPU Intel guest with AMX twice (2026-12-07, main at 3e1de90, the command above with `--groups
# 1,2,4,8,16 --storages float32,float16`; benchmarks/results/routing-intel-amx-2026-12-07-f32f16{,-b}.jsonl), each
# length the one whose worst loss over both runs and both contexts is least:
#   d128 float32   G1 3 (1.13), G2 3 (1.00), G4 3 (1.00), G8+ 2 (1.00)
#   d128 float16   G1 5 (1.17), G2 4 (1.00), G4 4 not 5 (1.03), G8 4 (1.03), G16+ 2 (1.00)
#   d64  float32   G1 4 (1.00), G2 3 (1.00), G4 3 (1.00), G8+ 2 (1.00)
#   d64  float16   G1 6 (1.08), G2 4 (1.00), G4 4 (1.02), G8+ 2 (1.00)
# A property of the CPU, not of `amx_tiles.usable()`: $KVENGINE_AMX=0 does not change these formats' kernels.
ROUTE_MIN_RUN_AMX_CPU = {
    ("float32", 64): ((1, 4), (2, 3), (8, 2)),
    ("float16", 64): ((1, 6), (2, 4), (8, 2)),
    ("float32", 128): ((1, 3), (8, 2)),
    ("float16", 128): ((1, 5), (2, 4), (4, 4, (5,)), (8, 4), (16, 2)),
}
AMX_CPU = target_has("amx-tile") and target_has("amx-bf16")

# Every format on a CPU without AVX-512 (`AVX512` False: AVX2, where the kernels' register blocks take their AVX2
# shapes, `kernels.vector_ir.WIDE`). Measured on the 2-vCPU AMD EPYC Zen 3 guest twice (2026-12-07, main at b766105,
# kernels compiled afresh: the runs of 0210c6b, benchmarks/results/routing-zen3-2026-12-07-avx2-{f32f16,bf16-int8}
# {,-b,-after}.jsonl, were taken in a tree whose numba cache still held kernels compiled before the AVX2 blocks,
# `kvcache.jit_cache`), `python -m benchmarks.routing --contexts 512,4096 --tokens 2,3,4,5,6,7 --groups 1,2,4,8,16
# --head-dims 64,128 --threads 1 --rounds 15 --storages float32,float16` and `--storages bfloat16,int8`, the two
# processes side by side; benchmarks/results/routing-zen3-2026-12-07-avx2-fresh-{f32f16,bf16-int8}{,-b}.jsonl), each
# length the one whose worst loss over both runs and both contexts is least. Lengths (worst loss):
#   d128 float32   G1 5 (1.23), G2 4 (1.18), G4 3 (1.17), G8+ 2 (1.09)
#   d128 float16   G1 6 (1.22), G2 4 (1.17), G4 3 (1.20), G8 2 not 3 (1.05), G16+ 2 (1.00)
#   d128 bfloat16  G1 6 (1.29), G2 4 (1.11), G4 3 (1.07), G8+ 2 (1.00)
#   d128 int8      G1 5 (1.00), G2 4 (1.02), G4 3 (1.00), G8+ 2 (1.00)
#   d64  float32   G1 5 (1.10), G2 4 (1.27), G4 3 (1.00), G8+ 2 (1.00)
#   d64  float16   G1 6 (1.17), G2 4 (1.00), G4 3 (1.01), G8+ 2 (1.00)
#   d64  bfloat16  G1 6 (1.08), G2 4 (1.00), G4 3 (1.00), G8+ 2 (1.00)
#   d64  int8      G1 4 (1.07), G2 3 (1.00), G4+ 2 (1.00)
# The losses left are G = 1 / 2 / 4 runs of 3-6 that the tiled kernel wins at context 4096 and loses at 512 (the
# rule reads no context). The fresh runs moved three lengths of the stale ones (float16 d64 G1 5 -> 6, float32
# d128 G1 4 -> 5, float16 d128 G8 skips 3).
ROUTE_MIN_RUN_AVX2 = {
    ("float32", 64): ((1, 5), (2, 4), (4, 3), (8, 2)),
    ("float16", 64): ((1, 6), (2, 4), (4, 3), (8, 2)),
    (BFLOAT16, 64): ((1, 6), (2, 4), (4, 3), (8, 2)),
    ("int8", 64): ((1, 4), (2, 3), (4, 2)),
    ("float32", 128): ((1, 5), (2, 4), (4, 3), (8, 2)),
    ("float16", 128): ((1, 6), (2, 4), (4, 3), (8, 2, (3,)), (16, 2)),
    (BFLOAT16, 128): ((1, 6), (2, 4), (4, 3), (8, 2)),
    ("int8", 128): ((1, 5), (2, 4), (4, 3), (8, 2)),
}
AVX512 = target_has("avx512f")


def _skipped(entry) -> tuple:
    """The run lengths a `ROUTE_MIN_RUN` entry leaves to the per-query kernel above its length (its third
    element, if any)."""
    return tuple(entry[2]) if len(entry) > 2 else ()


_TABLES = (*ROUTE_MIN_RUN.values(), *ROUTE_MIN_RUN_AMX.values(), *ROUTE_MIN_RUN_AMX_CPU.values(),
           *ROUTE_MIN_RUN_AVX2.values())
LONGEST_MIN_RUN = max([MIN_RUN] + [e[1] for table in _TABLES for e in table])   # any shapes' bound
SHORTEST_MIN_RUN = min([MIN_RUN] + [e[1] for table in _TABLES for e in table])  # fewer queries: none is tiled
# a skipped length lies below it: from LONGEST_MIN_RUN on every shape's run is tiled (`decode.hf.query_chunks`)
assert all(x < LONGEST_MIN_RUN for table in _TABLES for e in table for x in _skipped(e))


def route_rule(group: int, head_dim: int, storage) -> tuple[int, tuple]:
    """(min_run, skip): runs of one sequence's consecutive queries of >= min_run queries, other than the lengths
    in skip, go to the tiled kernel; the others to the per-query kernel (`ROUTE_MIN_RUN`; `ROUTE_MIN_RUN_AMX` for
    bfloat16 pages where the tiles run, `ROUTE_MIN_RUN_AMX_CPU` for float32 / float16 pages on a CPU with AMX,
    `ROUTE_MIN_RUN_AVX2` on a CPU without AVX-512; MIN_RUN and no skip where a table has no entry). A function of
    the shapes (and of the CPU and whether the process runs AMX tiles) only (never of the thread count, the
    context length, q or the other queries of a call), so a sequence is routed the same alone and in any batch
    (docs/kernel.md, "Determinism"). Remembered per shapes and what the choice of table reads (a plan is made per
    batch step)."""
    tiles = amx_tiles.usable()
    key = (group, head_dim, storage, tiles, AMX_CPU, AVX512, id(ROUTE_MIN_RUN), id(ROUTE_MIN_RUN_AMX),
           id(ROUTE_MIN_RUN_AMX_CPU), id(ROUTE_MIN_RUN_AVX2))
    rule = _RULES.get(key)
    if rule is None:
        rule = _RULES[key] = _route_rule(group, head_dim, storage, tiles)
    return rule


_RULES = {}                     # `route_rule`'s answers


def _route_rule(group: int, head_dim: int, storage, tiles: bool) -> tuple[int, tuple]:
    name = BFLOAT16 if isinstance(storage, str) and storage == BFLOAT16 else np.dtype(storage).name
    table = ROUTE_MIN_RUN
    if name == BFLOAT16 and tiles:
        table = {(BFLOAT16, d): e for d, e in ROUTE_MIN_RUN_AMX.items()}
    elif AMX_CPU and any(fmt == name for fmt, _ in ROUTE_MIN_RUN_AMX_CPU):
        table = ROUTE_MIN_RUN_AMX_CPU
    elif not AVX512:
        table = ROUTE_MIN_RUN_AVX2
    dims = [d for (fmt, d) in table if fmt == name and d <= head_dim]
    if not dims:
        return MIN_RUN, ()
    rule = (MIN_RUN, ())
    for entry in table[name, max(dims)]:
        if group >= entry[0]:
            rule = (entry[1], _skipped(entry))
    return rule


def route_min_run(group: int, head_dim: int, storage) -> int:
    """The shortest run the tiled kernel takes (`route_rule`)."""
    return route_rule(group, head_dim, storage)[0]


def routes_tiled(T: int, group: int, head_dim: int, storage) -> bool:
    """Whether a run of T queries goes to the tiled kernel (`route_rule`)."""
    min_run, skip = route_rule(group, head_dim, storage)
    return T >= min_run and T not in skip


def k_int8(storage) -> bool:
    """Whether a storage format (numpy dtype or name) is int8."""
    return not isinstance(storage, str) and np.dtype(storage) == np.int8


def kernel_view(pages, storage=None):
    """The pages (or int8 scales) as the kernels read them (`decode.kernels.loaders`): float16 as its uint16 bits,
    bfloat16 (storage="bfloat16", uint16 bits) as int16, everything else as is; None stays None."""
    if pages is None:
        return None
    if storage == BFLOAT16:
        return pages.view(np.int16)
    return pages.view(_KERNEL_VIEW[pages.dtype]) if pages.dtype in _KERNEL_VIEW else pages


def csr(tables: list) -> tuple[np.ndarray, np.ndarray]:
    """Page tables ``[int32 [n_b]]`` -> ``(indices int32 [sum n_b], indptr int64 [B + 1])``."""
    if len(tables) == 1:
        return tables[0], np.array([0, len(tables[0])], dtype=np.int64)
    indptr = np.zeros(len(tables) + 1, dtype=np.int64)
    np.cumsum([len(t) for t in tables], out=indptr[1:])
    indices = np.concatenate(tables).astype(np.int32, copy=False) if tables else np.zeros(0, np.int32)
    return indices, indptr


def visible_work(query_pos, window) -> int:
    """Keys read over all queries (each query reads min(p + 1, window) keys)."""
    if len(query_pos) == 1:
        p1 = int(query_pos[0]) + 1
        return min(p1, window) if window else p1
    if window:
        return int(np.minimum(query_pos + 1, window).sum())
    return int(query_pos.sum()) + len(query_pos)


def any_cut(query_pos, window, split) -> bool:
    """Whether some query's visible keys ``[max(p + 1 - window, 0), p]`` cross a multiple of ``split``."""
    if len(query_pos) == 0:
        return False
    if len(query_pos) == 1:                          # a decode step: in Python integers
        hi = int(query_pos[0]) + 1
        return (hi - 1) // split != (max(hi - window, 0) // split if window else 0)
    if not window:                                   # keys from 0: cut once a query sits at or past split
        return int(query_pos.max()) >= split
    hi = query_pos + 1
    return bool(((hi - 1) // split != np.maximum(hi - window, 0) // split).any())


class QueryPlan:
    """The per-query kernel's units for queries at ``query_pos``: serial (`query_serial` on the calling thread)
    or parallel (`query_parallel`), units [U, 4] = (query, lo, hi, slot) cut at absolute multiples of
    ``split`` tokens (`units.plan_units`; empty when no query is cut and the call is serial: one unit per query),
    bounds [chunks + 1], items [n_split, 3]. block: keys per online-softmax block; ahead: prefetch distance;
    dot: the vdpbf16ps mode for bfloat16 pages (`bf16_dot.plan_mode`), with `amx_decode.FLAG` where the AMX tiles
    run (`amx_tiles.usable`: bfloat16 pages of >= `amx_decode.MIN_GROUP` q heads per kv head take them). tiles:
    whether the storage, precision and shapes suit them (the caller knows those): with FLAG set, pieces of
    `AMX_SPLIT_TOKENS`."""

    __slots__ = ("serial", "block", "ahead", "split", "units", "bounds", "items", "num_slots", "acc0", "dot")

    def __init__(self, query_pos, window, num_q_heads, head_dim, head_dim_v, page_size, acc0, *, mode=0,
                 split_tokens=0, threads=None, tiles=False):
        self.block = block = page_size * max(1, BLOCK_TOKENS // page_size)
        self.ahead = PREFETCH_BYTES
        self.acc0 = acc0
        self.dot = bf16_dot.plan_mode() | (amx_decode.FLAG if amx_tiles.usable() else 0)
        width = num_q_heads * (head_dim + head_dim_v)
        amx = tiles and (self.dot & amx_decode.FLAG) != 0
        split = split_tokens if split_tokens > 0 else (AMX_SPLIT_TOKENS if amx else SPLIT_TOKENS)
        self.split = split = -(-split // block) * block
        nthreads = threads               # numba's count (None) is read only where the work could take threads
        if mode == 1 or (mode == 0 and visible_work(query_pos, window) * width < SERIAL_WORK):
            self.serial = True
        else:
            nthreads = numba.get_num_threads() if threads is None else threads
            self.serial = mode == 0 and nthreads < 2
        cut = any_cut(query_pos, window, split)
        if self.serial and not cut:
            self.units, self.bounds, self.items, self.num_slots = _NO_UNITS, None, _NO_ITEMS, 0
        else:
            self.units, self.bounds, self.items, self.num_slots = plan_units(query_pos, window, split,
                                                                             1 if self.serial else nthreads)
        if not self.serial and self.units.shape[0] < 2 and mode == 0:
            self.serial = True                                           # a single unit: no threads

    def run(self, q, k_pages, v_pages, k_scales, v_scales, page_indices, page_indptr, query_seq, query_pos, scale,
            window, out):
        """One layer over kernel views of the pages (`kernel_view`); the positions must be the plan's."""
        q = writable(q)
        if self.serial:
            return query_serial(q, k_pages, v_pages, k_scales, v_scales, page_indices, page_indptr, query_seq,
                                query_pos, scale, window, out, self.units, self.items, self.num_slots, self.block,
                                self.ahead, self.acc0, self.dot)
        return query_parallel(q, k_pages, v_pages, k_scales, v_scales, page_indices, page_indptr, query_seq,
                              query_pos, scale, window, out, self.units, self.bounds, self.items, self.num_slots,
                              self.block, self.ahead, self.acc0, self.dot)


class TilePlan:
    """The tiled kernel's units for ``runs`` [n, 4] = (sequence, first query, count, first position) with
    ``keys`` visible keys over their queries (`units.find_runs`): tiles of ``tokens`` queries, each tile's keys
    cut at absolute multiples of ``split`` (`units.plan_tiles`), serial or on all threads."""

    __slots__ = ("runs", "serial", "tokens", "units", "bounds", "items", "parts", "slots", "acc0", "dot")

    def __init__(self, runs, keys, window, num_q_heads, num_kv_heads, head_dim, head_dim_v, acc0, *, mode=0,
                 split_tokens=0, threads=None):
        self.runs, self.acc0 = runs, acc0
        self.dot = 2 if amx_tiles.usable() else bf16_dot.tile_mode()    # 2: scores on AMX tiles (bfloat16 pages)
        group = num_q_heads // num_kv_heads
        self.tokens = tokens = max(1, TILE_ROWS // group)
        nthreads = numba.get_num_threads() if threads is None else threads
        work = keys * num_q_heads * (head_dim + head_dim_v)
        self.serial = mode == 1 or (mode == 0 and (work < TILED_SERIAL_WORK or nthreads < 2))
        split = split_tokens if split_tokens > 0 else TILED_SPLIT
        self.units, self.bounds, self.items, self.parts, self.slots = plan_tiles(
            runs, num_kv_heads, group, window, tokens, split, 1 if self.serial else 4 * nthreads,
            0 if split_tokens > 0 else TILED_WHOLE)

    def run(self, q, k_pages, v_pages, k_scales, v_scales, page_indices, page_indptr, scale, window, out):
        """One layer: out[i] of every query i in a run (kernel views of the pages; the plan's positions)."""
        q = writable(q)
        if self.serial:
            return tiled_serial(q, k_pages, v_pages, k_scales, v_scales, page_indices, page_indptr, self.runs,
                                self.units, self.items, self.parts, self.slots, window, scale, TILE_BLOCK,
                                self.tokens, out, self.acc0, self.dot)
        return tiled_parallel(q, k_pages, v_pages, k_scales, v_scales, page_indices, page_indptr, self.runs,
                              self.units, self.bounds, self.items, self.parts, self.slots, window, scale, TILE_BLOCK,
                              self.tokens, out, self.acc0, self.dot)


class AttentionPlan:
    """How one call (or every layer of a forward) is computed: ``tiles`` (a `TilePlan` for the runs, or None),
    ``rest`` (int64 indices of the queries outside runs, None when that is every query) and ``single`` (a
    `QueryPlan` for them, or None). ``indices`` / ``indptr``: the page tables, when the plan holds them
    (`plan_token`, `plan_batch`); ``out_shape``: (N, num_q_heads, head_dim_v).

    q_shape = (num_queries, num_q_heads, head_dim); v_shape = v_pages.shape; storage: the format's numpy dtype or
    "bfloat16"; precision: "default" (q.k in float32) or "highest" (in float64; not for int8). mode (tests,
    tuning): 0 choose, 1 serial, 2 parallel; split_tokens > 0 forces pieces of that many tokens; tiled=False
    sends every query to the per-query kernel; min_run (None: `route_rule` of the shapes) forces the run length
    from which runs are tiled, with no length skipped (1: every run; tests and `benchmarks.routing`); threads: the
    thread count to plan for (None: numba's count now; 1 plans serial calls, which run on the calling thread
    whatever numba's count is when they run: no `numba.set_num_threads` round trip for a serial forward)."""

    __slots__ = ("tiles", "rest", "single", "query_seq", "query_pos", "indices", "indptr", "out_shape")

    def __init__(self, query_seq, query_pos, window, q_shape, v_shape, storage, *, precision="default", mode=0,
                 split_tokens=0, tiled=True, min_run=None, threads=None):
        num_queries, num_q_heads, head_dim = q_shape
        _, num_kv_heads, page_size, head_dim_v = v_shape
        skip = ()
        if min_run is None:
            # fewer queries than any shapes' shortest run (a decode step): none is tiled whatever the rule says
            min_run, skip = (SHORTEST_MIN_RUN, ()) if num_queries < SHORTEST_MIN_RUN else route_rule(
                num_q_heads // num_kv_heads, head_dim, storage)
        self.query_seq, self.query_pos = query_seq, query_pos
        self.indices = self.indptr = None
        self.out_shape = (num_queries, num_q_heads, head_dim_v)
        acc0 = plan_accumulator(storage, precision, head_dim)
        self.tiles, self.rest, self.single = None, None, None
        if tiled and num_queries >= min_run:
            runs, rest, keys = find_runs(query_seq, query_pos, min_run, np.array(skip, np.int64), window)
            if len(runs):
                self.tiles = TilePlan(runs, keys, window, num_q_heads, num_kv_heads, head_dim, head_dim_v, acc0,
                                      mode=mode, split_tokens=split_tokens, threads=threads)
                self.rest = rest
        rest_pos = query_pos if self.rest is None else query_pos[self.rest]
        if len(rest_pos):
            tiles = (isinstance(storage, str) and storage == BFLOAT16 and acc0.dtype == np.float32
                     and amx_decode.shapes_fit(num_q_heads // num_kv_heads, head_dim, head_dim_v))
            self.single = QueryPlan(rest_pos, window, num_q_heads, head_dim, head_dim_v, page_size, acc0, mode=mode,
                                    split_tokens=split_tokens, threads=threads, tiles=tiles)

    def run(self, q, k_pages, v_pages, page_indices, page_indptr, scale, window, out, k_scales=None, v_scales=None):
        """One layer: ``out [N, num_q_heads, head_dim_v]`` of ``q [N, num_q_heads, head_dim]`` (checked, compute
        dtype, C-contiguous) over kernel views of the pages (`kernel_view`). Returns out."""
        if self.tiles is not None:
            self.tiles.run(q, k_pages, v_pages, k_scales, v_scales, page_indices, page_indptr, scale, window, out)
        if self.single is None:
            return out
        if self.rest is None:
            return self.single.run(q, k_pages, v_pages, k_scales, v_scales, page_indices, page_indptr,
                                   self.query_seq, self.query_pos, scale, window, out)
        rest = self.rest
        sub = np.empty((len(rest),) + out.shape[1:], out.dtype)
        self.single.run(np.ascontiguousarray(q[rest]), k_pages, v_pages, k_scales, v_scales, page_indices,
                        page_indptr, self.query_seq[rest], self.query_pos[rest], scale, window, sub)
        out[rest] = sub
        return out

    def run_layer(self, pools, layer: int, q, scale: float, window: int, out):
        """`run` over ``layer`` of `LayerPools` with the plan's own page tables."""
        return self.run(q, pools.k_run[layer], pools.v_run[layer], self.indices, self.indptr, scale, window, out,
                        pools.k_scales[layer], pools.v_scales[layer])


def attend_unchecked(q, k_pages, v_pages, page_indices, page_indptr, query_seq, query_pos, scale, window, out, *,
                     k_scales=None, v_scales=None, storage=None, precision="default", mode=0, split_tokens=0,
                     tiled=True):
    """Plan and run one call with no checks, for callers that validated already (`decode.attention` and the
    benchmarks). Requires: q C-contiguous in the compute dtype, pages as stored (float16, bfloat16 bits with
    storage="bfloat16", int8 with float16 scales), page_indices int32, page_indptr / query_pos int64, query_seq
    int32, out a C-contiguous [num_queries, num_q_heads, head_dim_v] array of the compute dtype; every visible
    position backed by a valid page. Options as `AttentionPlan`. Returns out."""
    storage = storage if storage is not None else k_pages.dtype
    plan = AttentionPlan(query_seq, query_pos, window, q.shape, v_pages.shape, storage, precision=precision,
                         mode=mode, split_tokens=split_tokens, tiled=tiled)
    return plan.run(q, kernel_view(k_pages, storage), kernel_view(v_pages, storage), page_indices, page_indptr,
                    scale, window, out, kernel_view(k_scales), kernel_view(v_scales))


class LayerPools:
    """Per-layer views of a cache's pages as the kernels read them (`kernel_view`): ``k_run[layer]`` /
    ``v_run[layer]`` [num_pages, num_kv_heads, page_size, head_dim(_v)], int8 scales ``k_scales[layer]`` /
    ``v_scales[layer]`` (uint16; None for floats); ``storage``: the format; ``compute``: its compute dtype."""

    __slots__ = ("k_run", "v_run", "k_scales", "v_scales", "int8", "storage", "compute", "v_shape")

    def __init__(self, cache):
        config = cache.config
        self.storage = BFLOAT16 if getattr(config, "storage", None) == BFLOAT16 else config.dtype
        layers = range(config.num_layers)
        self.k_run = [kernel_view(cache.pool.k_pages(layer), self.storage) for layer in layers]
        self.v_run = [kernel_view(cache.pool.v_pages(layer), self.storage) for layer in layers]
        self.k_scales = [kernel_view(cache.pool.k_scales(layer)) for layer in layers]
        self.v_scales = [kernel_view(cache.pool.v_scales(layer)) for layer in layers]
        self.int8 = self.k_scales[0] is not None
        self.compute = compute_dtype(self.storage)
        self.v_shape = self.v_run[0].shape


_POOLS = weakref.WeakKeyDictionary()            # cache -> its LayerPools


def pools_of(cache) -> LayerPools:
    """The `LayerPools` of ``cache``, made once per cache (its page arrays never move) and shared by every
    decoder over it."""
    pools = _POOLS.get(cache)
    if pools is None:
        pools = _POOLS.setdefault(cache, LayerPools(cache))
    return pools


_QUERY_SEQ1 = np.zeros(1, dtype=np.int32)          # one query of CSR row 0 (read only)


def plan_token(cache, pools: LayerPools, seq: int, pages: np.ndarray, position: int, num_q_heads: int,
               window: int, precision: str = "default") -> AttentionPlan:
    """The plan of one query at ``position`` of ``seq`` over its page table ``pages int32`` (reserved slot
    included); ValueError if the query would read a released page."""
    first = max(0, position - window + 1) if window else 0
    if pages[first // cache.config.page_size] < 0:
        raise_released(cache, seq, first, position)
    qpos = np.array([position], dtype=np.int64)
    plan = AttentionPlan(_QUERY_SEQ1, qpos, window, (1, num_q_heads, cache.config.head_dim), pools.v_shape,
                         pools.storage, precision=precision)
    plan.indices, plan.indptr = pages, np.array([0, len(pages)], dtype=np.int64)
    return plan


def plan_batch(cache, pools: LayerPools, seqs: list, indices: np.ndarray, indptr: np.ndarray, start: list,
               counts: list, q_shape: tuple, window: int, query_seq: np.ndarray, query_pos: np.ndarray,
               precision: str = "default") -> AttentionPlan:
    """The plan of ``q_shape = (N, num_q_heads, head_dim)`` ragged queries (``counts[b]`` of sequence ``seqs[b]``
    from position ``start[b]`` on) over the page tables ``indices`` / ``indptr`` (CSR, row b: ``seqs[b]``), every
    batch shape and storage format. ValueError if a sequence's first query would read a released page."""
    if q_shape[0]:
        check_held(cache, seqs, indices, indptr, np.asarray(start, dtype=np.int64), np.asarray(counts) > 0, window)
    plan = AttentionPlan(query_seq, query_pos, window, q_shape, pools.v_shape, pools.storage, precision=precision)
    plan.indices, plan.indptr = indices, indptr
    return plan


def check_held(cache, seqs: list, indices: np.ndarray, indptr: np.ndarray, start: np.ndarray, reads: np.ndarray,
               window: int) -> None:
    """ValueError (`raise_released`) for the first row b with ``reads[b]`` whose first query (at ``start[b]``)
    would read a page released by `KVCache.release_before` (-1); one vectorised pass over the rows."""
    rows = np.flatnonzero(reads)
    first = np.maximum(start[rows] - window + 1, 0) if window else np.zeros(len(rows), dtype=np.int64)
    bad = np.flatnonzero(indices[indptr[rows] + first // cache.config.page_size] < 0)
    if len(bad):
        b = int(rows[bad[0]])
        raise_released(cache, seqs[b], int(first[bad[0]]), int(start[b]))


def attend_token(decoder, pools: LayerPools, token, layer: int, q, k, v, plan: AttentionPlan | None = None):
    """Write one token's checked ``k``/``v`` into ``token``'s slot (`kvcache.TokenWrite`) in ``layer`` and
    attend with ``q [num_q_heads, head_dim]`` (working precision) over positions ``.. token.positions[0]`` of
    ``decoder``'s sequence; ``pools``: its cache's (`pools_of`). Returns ``(out [num_q_heads, head_dim_v],
    plan)``; ``plan`` is made on the first layer of a token (`plan_token`) and passed back in for the others."""
    token.write(layer, k, v)
    if plan is None:
        plan = plan_token(decoder.cache, pools, decoder.seq, token.pages(), int(token.positions[0]),
                          decoder.num_q_heads, decoder.window)
    out = np.empty(plan.out_shape, dtype=pools.compute)
    return plan.run_layer(pools, layer, q[None], decoder.scale, decoder.window, out)[0], plan


def raise_released(cache, seq: int, first: int, position: int):
    """Raise: the query at ``position`` would read positions ``first ..`` of which some were given back by
    `KVCache.release_before` (a -1 in the page table; the unchecked kernel would index the pool with it)."""
    raise ValueError(f"seq: expected K/V held for positions {first}..{position} (read by the query at position "
                     f"{position}), got positions < {cache.pool.first_position(seq)} released (KVCache.release_before)")


def attend_runs(q, k_pages, v_pages, page_indices, page_indptr, query_seq, query_pos, scale, window, out, *,
                k_scales=None, v_scales=None, storage=None, precision="default", mode=0, split_tokens=0,
                min_run=MIN_RUN):
    """The tiled kernel alone: out[i] of every query i in a run of >= min_run queries; returns the indices
    (int64) of the other queries, which it leaves untouched. Arguments as `attend_unchecked`."""
    storage = storage if storage is not None else k_pages.dtype
    runs, rest, keys = find_runs(query_seq, query_pos, min_run, _NO_SKIP, window)
    if len(runs):
        _, num_q_heads, head_dim = q.shape
        acc0 = plan_accumulator(storage, precision, head_dim)
        plan = TilePlan(runs, keys, window, num_q_heads, v_pages.shape[1], head_dim, v_pages.shape[3], acc0,
                        mode=mode, split_tokens=split_tokens)
        plan.run(q, kernel_view(k_pages, storage), kernel_view(v_pages, storage), kernel_view(k_scales),
                 kernel_view(v_scales), page_indices, page_indptr, scale, window, out)
    return rest
