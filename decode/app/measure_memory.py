"""`kvengine memory`: resident memory of a `KVCache` measured beside the formula (a program: subprocesses, psutil,
mincore; the accounting it reports is `kvcache.accounting`).

- `memory_report(...)` -- one row (a JSON-friendly dict) per KV-head count: builds a cache of exactly enough
  pages for ``batch x tokens`` in a fresh subprocess and measures its resident memory (RSS) with psutil
  before and after the pages are touched.
- `format_table(rows)` -- the rows as a plain text table.

Only numpy, psutil (imported lazily, for measurements only), the standard library and kvcache are used.
"""
from __future__ import annotations

import gc
import json
import numbers
import os
import subprocess
import sys

import numpy as np

from kvcache import KVCache
from kvcache.accounting import GIB, MIB, attention_kind, cache_memory, kv_bytes_formula, kv_scale_bytes_formula
from kvcache.checks import check_int, check_storage_dtype, storage_array_dtype

__all__ = ["memory_report", "format_table", "resident_in", "mincore_resident"]

# memory kept free when a measurement allocates a pool: the measuring process, its copies and the OS
MARGIN_BYTES = 1 * GIB
MARGIN_FRACTION = 0.10
# tokens per append while touching the pool in a measurement: the input arrays are about this many bytes
FILL_CHUNK_BYTES = 16 * MIB


# -- the report ----------------------------------------------------------------------------------------------
def _rss() -> int:
    import psutil
    return psutil.Process().memory_info().rss


def resident_in(arrays) -> tuple[int, int] | None:
    """(resident bytes of the pages holding ``arrays``, resident bytes in transparent huge pages of the mappings
    holding them) on Linux; None elsewhere. Residency is asked of the kernel per page of the arrays' own address
    ranges (``mincore``), so a small array that malloc placed in the shared heap (an int8 pool's scales next to
    a small MQA pool) is counted for its own pages only, not for the whole heap mapping; the huge-page figure is
    per mapping (/proc/self/smaps), as the kernel reports it."""
    resident = mincore_resident(arrays)
    if resident is None:
        return None
    spans = [(a.ctypes.data, a.ctypes.data + a.nbytes) for a in arrays]
    huge = 0
    inside = False
    try:
        with open("/proc/self/smaps") as smaps:
            for line in smaps:
                field = line.split(None, 1)[0]
                if "-" in field and not field.endswith(":"):               # a mapping's header line
                    lo, hi = (int(x, 16) for x in field.split("-"))
                    inside = any(lo < end and hi > start for start, end in spans)
                elif inside and field == "AnonHugePages:":
                    huge += int(line.split()[1]) * 1024
    except OSError:
        return None
    return resident, huge


def mincore_resident(arrays) -> int | None:
    """Resident bytes of the memory pages spanned by ``arrays`` (each page once), from mincore(2); None where
    it is unavailable (not Linux)."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        mincore = libc.mincore
    except (OSError, AttributeError):
        return None
    mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]
    mincore.restype = ctypes.c_int
    page = os.sysconf("SC_PAGE_SIZE")
    spans = sorted((a.ctypes.data // page * page, -(-(a.ctypes.data + a.nbytes) // page) * page)
                   for a in arrays if a.nbytes)
    merged: list[list[int]] = []
    for lo, hi in spans:                                  # adjacent arrays may share a page: count it once
        if merged and lo <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], hi)
        else:
            merged.append([lo, hi])
    resident = 0
    for lo, hi in merged:
        n = (hi - lo) // page
        vec = (ctypes.c_ubyte * n)()
        if mincore(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), vec) != 0:
            return None
        resident += int((np.frombuffer(vec, dtype=np.uint8) & 1).sum()) * page
    return resident


def _trim_heap() -> None:
    """Give freed heap memory back to the OS (glibc), so RSS shows what is live."""
    gc.collect()
    try:
        import ctypes
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _fill(cache: KVCache, seqs: list, block: np.ndarray, tokens: int, chunk: int, after_first=None) -> None:
    """Append ``tokens`` tokens to each of ``seqs`` from ``block [layers, chunk, kv_heads, head_dim]``: one
    token per sequence first (every layer's first page), ``after_first()``, then ``chunk`` at a time."""
    for seq in seqs:
        cache.append(seq, block[:, :1], block[:, :1])
    if after_first is not None:
        after_first()
    for seq in seqs:
        done = 1
        while done < tokens:
            count = min(chunk, tokens - done)
            cache.append(seq, block[:, :count], block[:, :count])
            done += count


def _warm_up(shape: dict, block: np.ndarray) -> None:
    """The fill's one-time costs before the baseline: the same appends (one token, then a chunk) into a
    throwaway cache of the same layout, deleted again. What stays resident afterwards (code paths run for the
    first time, lazily imported modules, numpy's and the allocator's caches and thresholds) is the measuring
    process's, not the pool's: without this the first real fill bills it to the pool (~2-4 MB measured,
    4.5% of an 83 MiB int8 MQA pool)."""
    chunk = shape["chunk"]
    spare = KVCache(num_layers=shape["layers"], num_kv_heads=shape["kv_heads"], head_dim=shape["head_dim"],
                    dtype=shape["dtype"], page_size=shape["page_size"],
                    num_pages=-(-(chunk + 1) // shape["page_size"]))
    _fill(spare, [spare.create_sequence()], block, chunk + 1, chunk)
    del spare


def _build_and_fill(shape: dict, measure: bool) -> dict:
    """Build the cache of ``shape``, fill ``batch`` sequences with ``tokens`` tokens each by real appends,
    and return `cache_memory` (plus RSS readings when ``measure``; the fill's one-time costs are run first,
    `_warm_up`, so that the baseline holds them). Runs in the measuring subprocess."""
    layers, kv, d, tokens = shape["layers"], shape["kv_heads"], shape["head_dim"], shape["tokens"]
    dtype, chunk = shape["dtype"], shape["chunk"]
    inputs = np.float32 if dtype in ("int8", "bfloat16") else np.dtype(dtype)    # they take float input
    block = np.full((layers, chunk, kv, d), 0.5, dtype=inputs)      # touched now: part of the baseline
    rss = {}
    if measure and tokens:
        _warm_up(shape, block)
    _trim_heap()
    if measure:
        rss["base"] = _rss()
    cache = KVCache(num_layers=layers, num_kv_heads=kv, head_dim=d, dtype=dtype, page_size=shape["page_size"],
                    num_pages=shape["num_pages"])
    if measure:
        rss["untouched"] = _rss()
    seqs = [cache.create_sequence() for _ in range(shape["batch"])]

    def one_token():                                      # every layer's first page touched
        if measure:
            _trim_heap()
            rss["one_token"] = _rss()
    if tokens:
        _fill(cache, seqs, block, tokens, chunk, one_token)
    _trim_heap()
    if measure:
        rss["touched"] = _rss()                           # ``block`` is still alive: it is in the baseline
    del block
    result = {"accounting": cache_memory(cache)}
    if measure:
        result["rss"] = {key: value - rss["base"] for key, value in rss.items() if key != "base"}
        result["pool_resident"] = resident_in(cache.pool.arrays)
    return result


def _peak_rss() -> int:
    """The process's resident high-water mark (VmHWM, Linux); falls back to ru_maxrss."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _naive_concat_peak(shape: dict) -> dict:
    """The naive cache of the source document holding the same tokens: per layer, K and V arrays
    ``[batch * (tokens - 1), kv_heads, head_dim]`` (touched), then one more token appended to every layer by
    ``np.concatenate`` — the old and the new array of a layer are alive together while it copies. Returns the
    RSS increase at the peak (VmHWM) and at the end. Runs in its own fresh subprocess."""
    layers, kv, d = shape["layers"], shape["kv_heads"], shape["head_dim"]
    dtype = storage_array_dtype(shape["dtype"])                       # bfloat16: its bits, the same bytes
    rows = shape["batch"] * shape["tokens"]
    new_token = np.full((1, kv, d), 0.5, dtype=dtype)
    _trim_heap()
    base = _rss()
    keys = [np.full((rows - 1, kv, d), 0.5, dtype=dtype) for _ in range(layers)]
    values = [np.full((rows - 1, kv, d), 0.5, dtype=dtype) for _ in range(layers)]
    before = _rss() - base
    for layer in range(layers):                          # one decode step of the naive cache
        keys[layer] = np.concatenate([keys[layer], new_token])
        values[layer] = np.concatenate([values[layer], new_token])
    return {"naive_before_step": before, "naive_peak": _peak_rss() - base, "naive_end": _rss() - base}


def _measure_in_subprocess(shape: dict, timeout: float) -> dict:
    """Run `_build_and_fill` in a fresh interpreter (isolated RSS) and return its JSON result."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ)
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    proc = subprocess.run([sys.executable, "-m", "decode.app.measure_memory", json.dumps(shape)], env=env,
                          capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"memory measurement of {shape} failed (exit {proc.returncode}):\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _check_fits(shape: dict, pool_bytes: int) -> None:
    import psutil
    available = psutil.virtual_memory().available
    margin = max(MARGIN_BYTES, int(MARGIN_FRACTION * available))
    needed = pool_bytes + 2 * FILL_CHUNK_BYTES
    if needed > available - margin:
        raise ValueError(
            f"kv_heads={shape['kv_heads']}: measuring needs {needed / GIB:.2f} GiB resident (the pool is "
            f"{pool_bytes / GIB:.2f} GiB) but only {available / GIB:.2f} GiB are available and "
            f"{margin / GIB:.2f} GiB are kept free; use a smaller shape or measure=False for formula-only rows")


def memory_report(layers=32, num_q_heads=32, kv_heads=(32, 8, 1), tokens=10_000, head_dim=128, dtype="float16",
                  batch=1, page_size=16, measure=True, timeout=600.0, naive_peak=True) -> list[dict]:
    """One row per entry of ``kv_heads``: the formula, what a `KVCache` sized exactly for ``batch`` sequences
    of ``tokens`` tokens allocates and uses, and (``measure``) its resident memory measured with psutil in a
    fresh subprocess: right after allocation (``rss_untouched_bytes``: ~0, numpy's zeros are lazily backed),
    after one token per sequence (``rss_one_token_bytes``: huge pages), and after every token was appended
    (``rss_touched_bytes``); ``measured_over_formula = rss_touched_bytes / formula_bytes``. The baseline is
    taken after the same appends into a throwaway cache (`_warm_up`: the fill's one-time costs belong to the
    process, not to the pool). On Linux ``pool_resident_bytes`` are the resident bytes of the pool arrays' own
    pages (mincore), ``pool_over_formula`` their ratio to the formula, and ``pool_huge_page_bytes`` the
    transparent huge pages of the mappings holding them (/proc/self/smaps): the RSS increase minus the pool
    is what the filling process itself kept (heap, Python objects).

    With ``measure`` and ``naive_peak``, ``naive_peak_bytes`` is the resident peak of the source document's
    naive cache holding the same tokens (per-layer K/V arrays grown by ``np.concatenate``) during one more
    decode step, measured in its own subprocess: the old and the new array of a layer are alive together.

    Without ``measure`` the accounting comes from a cache of the same page layout with one head of size 1
    (page tables, ref counts and free list depend only on pages, not on head sizes) and the RSS fields are
    None. Raises ValueError for a shape that would not fit in available memory (measure=True), or for bad
    arguments (``kv_heads`` must divide ``num_q_heads``).
    """
    layers, num_q_heads = check_int("layers", layers, minimum=1), check_int("num_q_heads", num_q_heads, minimum=1)
    tokens, head_dim = check_int("tokens", tokens, minimum=0), check_int("head_dim", head_dim, minimum=1)
    batch, page_size = check_int("batch", batch, minimum=1), check_int("page_size", page_size, minimum=1)
    kv_list = _kv_head_counts(kv_heads, num_q_heads)
    storage = check_storage_dtype("dtype", dtype)                    # the format's name
    itemsize = storage_array_dtype(storage).itemsize
    quantized = storage == "int8"
    num_pages = max(1, batch * -(-tokens // page_size))

    def token_bytes(kv):                                 # K and V of one token, all layers (int8: with scales)
        scales = kv_scale_bytes_formula(layers, 1, 1, kv, head_dim) if quantized else 0
        return layers * kv * 2 * head_dim * itemsize + scales

    input_size = 4 if storage in ("int8", "bfloat16") else itemsize
    shapes = [{"layers": layers, "kv_heads": kv, "head_dim": head_dim, "tokens": tokens, "batch": batch,
               "page_size": page_size, "num_pages": num_pages, "dtype": storage,
               "chunk": max(1, min(tokens, FILL_CHUNK_BYTES // (layers * kv * head_dim * input_size)))}
              for kv in kv_list]
    if measure:                                          # refuse before measuring anything
        for shape in shapes:
            _check_fits(shape, num_pages * page_size * token_bytes(shape["kv_heads"]))
    rows = []
    for shape in shapes:
        result, naive = _measure_shape(shape, measure, naive_peak and not quantized, timeout)
        rows.append(_report_row(shape, result, naive, num_q_heads, itemsize, quantized,
                                page_size * token_bytes(shape["kv_heads"]), measure))
    return rows


def _kv_head_counts(kv_heads, num_q_heads: int) -> list[int]:
    """``kv_heads`` (an int or several) checked: at least one, each a divisor of ``num_q_heads``."""
    kv_list = [kv_heads] if isinstance(kv_heads, numbers.Integral) else list(kv_heads)
    if not kv_list:
        raise ValueError("kv_heads: expected at least one KV-head count, got none")
    kv_list = [check_int("kv_heads", kv, minimum=1) for kv in kv_list]
    for kv in kv_list:
        if num_q_heads % kv:
            raise ValueError(f"kv_heads: expected a divisor of num_q_heads={num_q_heads}, got {kv}")
    return kv_list


def _measure_shape(shape: dict, measure: bool, naive_peak: bool, timeout: float) -> tuple[dict, dict]:
    """``(result of _build_and_fill, naive-cache result or {})``: measured in fresh subprocesses, or (no
    ``measure``) the accounting of a cache of the same pages with heads of size 1."""
    if not measure:
        twin = dict(shape, layers=1, kv_heads=1, head_dim=1, chunk=max(shape["chunk"], shape["tokens"] // 1000))
        return _build_and_fill(twin, measure=False), {}
    result = _measure_in_subprocess(shape, timeout)
    naive = _measure_in_subprocess(dict(shape, naive=True), timeout) if naive_peak and shape["tokens"] else {}
    return result, naive          # the naive cache holds floats: no int8 twin (``naive_peak`` is False for int8)


def _report_row(shape: dict, result: dict, naive: dict, num_q_heads: int, itemsize: int, quantized: bool,
                page_bytes: int, measure: bool) -> dict:
    """One row of `memory_report`: the formula, the pool (``page_bytes`` per page, all layers), the measured
    fields."""
    layers, kv, head_dim, tokens, batch = (shape[key] for key in ("layers", "kv_heads", "head_dim", "tokens", "batch"))
    values = kv_bytes_formula(layers, batch, tokens, kv, head_dim, itemsize)
    scales = kv_scale_bytes_formula(layers, batch, tokens, kv, head_dim) if quantized else 0
    formula = values + scales
    used = result["accounting"]["pages_used"] * page_bytes
    rss = result.get("rss", {})
    touched = rss.get("touched")
    pool = result.get("pool_resident") or (None, None)
    return {
        "attention": attention_kind(num_q_heads, kv),
        "kv_heads": kv, "num_q_heads": num_q_heads, "layers": layers, "batch": batch, "tokens": tokens,
        "head_dim": head_dim, "dtype": shape["dtype"], "page_size": shape["page_size"],
        "num_pages": shape["num_pages"],
        "formula_bytes": formula,
        "formula_gib": formula / GIB,
        "value_bytes": values,
        "scale_bytes": scales,
        "scale_overhead": scales / values if values else 0.0,
        "allocated_bytes": shape["num_pages"] * page_bytes,
        "used_bytes": used,
        "tail_waste_bytes": used - formula,
        "metadata_bytes": result["accounting"]["metadata_bytes"],
        "rss_untouched_bytes": rss.get("untouched"),
        "rss_one_token_bytes": rss.get("one_token"),
        "rss_touched_bytes": touched,
        "pool_resident_bytes": pool[0],
        "pool_huge_page_bytes": pool[1],
        "pool_over_formula": (pool[0] / formula) if (pool[0] is not None and formula) else None,
        "measured_over_formula": (touched / formula) if (touched is not None and formula) else None,
        "naive_peak_bytes": naive.get("naive_peak"),
        "naive_peak_over_formula": naive["naive_peak"] / formula if naive and formula else None,
        "measured": bool(measure),
    }


# -- text table -----------------------------------------------------------------------------------------------
def _size(value) -> str:
    if value is None:
        return "-"
    if abs(value) >= GIB:
        return f"{value / GIB:.2f} GiB"
    if abs(value) >= MIB:
        return f"{value / MIB:.1f} MiB"
    if abs(value) >= 1024:
        return f"{value / 1024:.1f} KiB"
    return f"{value} B"


COLUMNS = [
    ("kv_heads", lambda r: f"{r['kv_heads']} ({r['attention']})"),
    ("dtype", lambda r: r["dtype"]),
    ("formula bytes", lambda r: f"{r['formula_bytes']:,}"),
    ("formula", lambda r: _size(r["formula_bytes"])),
    ("of which scales", lambda r: "-" if not r.get("scale_bytes") else
     f"{_size(r['scale_bytes'])} (+{100 * r['scale_overhead']:.2f}%)"),
    ("allocated", lambda r: _size(r["allocated_bytes"])),
    ("used", lambda r: _size(r["used_bytes"])),
    ("tail waste", lambda r: _size(r["tail_waste_bytes"])),
    ("metadata", lambda r: _size(r["metadata_bytes"])),
    ("RSS untouched", lambda r: _size(r["rss_untouched_bytes"])),
    ("RSS 1 token", lambda r: _size(r["rss_one_token_bytes"])),
    ("RSS touched", lambda r: _size(r["rss_touched_bytes"])),
    ("pool resident", lambda r: _size(r["pool_resident_bytes"])),
    ("in huge pages", lambda r: _size(r["pool_huge_page_bytes"])),
    ("pool/formula", lambda r: "-" if r.get("pool_over_formula") is None else f"{r['pool_over_formula']:.4f}"),
    ("measured/formula", lambda r: "-" if r["measured_over_formula"] is None else f"{r['measured_over_formula']:.4f}"),
    ("naive peak", lambda r: _size(r.get("naive_peak_bytes"))),
    ("naive/formula", lambda r: "-" if r.get("naive_peak_over_formula") is None
     else f"{r['naive_peak_over_formula']:.4f}"),
]


def format_table(rows: list[dict]) -> str:
    """The rows of `memory_report` as a plain text table (one line per row, a header and a shape line)."""
    if not rows:
        return "(no rows)"
    cells = [[name for name, _ in COLUMNS]] + [[fmt(row) for _, fmt in COLUMNS] for row in rows]
    widths = [max(len(line[i]) for line in cells) for i in range(len(COLUMNS))]
    lines = ["  ".join(cell.rjust(width) for cell, width in zip(line, widths)) for line in cells]
    lines.insert(1, "  ".join("-" * width for width in widths))
    r = rows[0]
    lines.append(f"shape: layers={r['layers']} num_q_heads={r['num_q_heads']} batch={r['batch']} "
                 f"tokens={r['tokens']} head_dim={r['head_dim']} dtype={'/'.join(dict.fromkeys(row['dtype'] for row in rows))} page_size={r['page_size']} "
                 f"num_pages={r['num_pages']}; RSS columns are increases over the measuring process's baseline")
    return "\n".join(lines)


if __name__ == "__main__":                                # the measuring subprocess: one shape in, JSON out
    _shape = json.loads(sys.argv[1])
    print(json.dumps(_naive_concat_peak(_shape) if _shape.get("naive") else _build_and_fill(_shape, measure=True)))
