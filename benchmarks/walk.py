"""The page-walk read ceiling: the machine's rate for reading the very pages a decode step reads, the way the
kernel reads them (issue 9).

`page_walk` reads, with the kernel's threads, every page of one or more page-table rows in page-table order,
each thread a contiguous range of the pages, all kv heads of each page (a page's K for all heads is one
contiguous run of the head-major pool, then its V). Nothing is computed but a sum, so its time is what memory
allows for exactly those bytes; `Decoder.step` / `batch_step` are judged against it, measured in alternation
with their timed rounds (the machine's memory state changes within minutes).
"""
from __future__ import annotations

import time

import numpy as np
from numba import njit, prange


@njit(parallel=True, fastmath=True, cache=True)
def _walk(k_pages, v_pages, pages, nthreads, zero):
    """Sum of the K and V of ``pages [n]`` (physical page ids), thread c reading pages[c*n/T:(c+1)*n/T]; each
    page as two contiguous runs [num_kv_heads * page_size * head_dim] (K, then V). ``zero`` sets the
    accumulator: float32 for float32 pages, uint32 for 16-bit pages read as uint16 (an integer sum)."""
    n = pages.shape[0]
    part = np.full(nthreads, zero)
    for c in prange(nthreads):
        s = zero
        for j in range(c * n // nthreads, (c + 1) * n // nthreads):
            kp = k_pages[pages[j]].reshape(-1)
            for i in range(kp.shape[0]):
                s += kp[i]
            vp = v_pages[pages[j]].reshape(-1)
            for i in range(vp.shape[0]):
                s += vp[i]
        part[c] = s
    return part.sum()


def page_walk(k_pages: np.ndarray, v_pages: np.ndarray, pages: np.ndarray) -> float:
    """Read ``pages`` (int32 physical ids, the concatenated page-table rows) of ``k_pages / v_pages
    [num_pages, num_kv_heads, page_size, head_dim]`` (float32, or 16-bit: float16, bfloat16's uint16 bits) with the
    kernel's thread count; returns the seconds taken."""
    import numba

    nthreads = numba.get_num_threads()
    pages = np.ascontiguousarray(pages, dtype=np.int32)
    t0 = time.perf_counter()
    if k_pages.dtype.itemsize == 2:
        _walk(k_pages.view(np.uint16), v_pages.view(np.uint16), pages, nthreads, np.uint32(0))
    else:
        _walk(k_pages, v_pages, pages, nthreads, np.float32(0.0))
    return time.perf_counter() - t0


def walked_bytes(k_pages: np.ndarray, v_pages: np.ndarray, pages: np.ndarray) -> int:
    """Bytes `page_walk` reads for ``pages``: each page's K and V, all kv heads."""
    return len(pages) * (k_pages[0].nbytes + v_pages[0].nbytes)


class WalkCeiling:
    """Page-walk timings collected round by round beside a benchmark's timed calls: ``measure(k, v, pages,
    nbytes)`` once per round (untimed for pytest-benchmark), then `record` puts the median rate and the step's
    fraction of it into ``extra_info``."""

    def __init__(self):
        self.seconds: list[float] = []
        self.nbytes = 0

    def measure(self, k_pages, v_pages, pages, nbytes: int) -> None:
        self.nbytes = nbytes
        self.seconds.append(page_walk(k_pages, v_pages, pages))

    def record(self, benchmark, per_call: int = 1) -> None:
        if not self.seconds:
            return
        walk_s = float(np.median(self.seconds))
        info = {"walk_seconds": walk_s, "walk_gb_per_s": self.nbytes / walk_s / 1e9, "walk_rounds": len(self.seconds)}
        stats = getattr(getattr(benchmark, "stats", None), "stats", None)
        if stats is not None and stats.median > 0:
            info["frac_walk"] = walk_s / (stats.median / per_call)
        benchmark.extra_info.update(info)
