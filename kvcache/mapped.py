"""Arrays on anonymous memory mappings of their own: zero, backed by the OS page by page as they are first
written, and given back to it (unmapped) when the array dies.

    zeros(shape, dtype) -> np.ndarray

``np.zeros`` gives that only while malloc maps the block itself: glibc raises its mmap threshold to the size of
every mapped block freed (up to 32 MiB), after which a block of that size comes from its heap, is cleared by
``memset`` (every page resident at once, used or not) and, once freed, stays resident in the heap. A page pool,
most of it unused until tokens arrive, and a large temporary, whose pages should leave with it, are allocated
here instead.
"""
import mmap

import numpy as np


def zeros(shape, dtype) -> np.ndarray:
    """A zero array of ``shape`` and ``dtype`` on a mapping of its own (writable; no page resident until used)."""
    dtype = np.dtype(dtype)
    shape = tuple(int(n) for n in (shape if isinstance(shape, (tuple, list)) else (shape,)))
    count = int(np.prod(shape, dtype=np.int64))
    if count == 0:
        return np.zeros(shape, dtype)
    return np.frombuffer(mmap.mmap(-1, count * dtype.itemsize), dtype=dtype, count=count).reshape(shape)
