"""`simd.touch_pages` (a real one-byte load at every 4 KiB page boundary of a span, so the CPU translates the
page's address ahead of the line prefetches, which a TLB miss drops): it reads nothing outside the rows it is
given, the optimiser keeps its loads, and the per-query kernel, which touches pages ahead along its walk, reads
nothing past the pool's last page. Arrays are placed so that they end where an inaccessible page begins: a read
past them kills the process."""
import ctypes
import mmap

import numpy as np
import pytest
from numba import njit

from decode.attention_plan import BFLOAT16, AttentionPlan
from decode.kernels.simd import JIT, OS_PAGE, touch_pages
from kvcache import bf16

pytestmark = pytest.mark.kernel

_LIBC = ctypes.CDLL(None, use_errno=True)
_KEEP = []        # the guarded mappings live as long as the test process (arrays view them)


def guarded(shape, dtype) -> np.ndarray:
    """A C-contiguous array of ``shape`` whose last byte is followed by a PROT_NONE page."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape)) * dtype.itemsize
    pages = -(-nbytes // OS_PAGE)
    m = mmap.mmap(-1, (pages + 1) * OS_PAGE)
    base = ctypes.addressof(ctypes.c_char.from_buffer(m))
    assert _LIBC.mprotect(ctypes.c_void_p(base + pages * OS_PAGE), OS_PAGE, 0) == 0     # PROT_NONE
    _KEEP.append(m)
    return np.frombuffer(m, dtype=dtype, count=nbytes // dtype.itemsize,
                         offset=pages * OS_PAGE - nbytes).reshape(shape)


@njit(cache=False)
def touch_all(tile, step):
    rows = tile.shape[0] * tile.shape[1] if tile.ndim == 3 else tile.shape[0]
    for r0 in range(0, rows + 1, step):
        for r1 in range(r0, rows + 1, step):
            touch_pages(tile, r0, r1)


@pytest.mark.parametrize("shape, dtype", [((1000, 24), np.float32), ((3, 70, 48), np.uint16),
                                          ((2, 16, 64), np.float32), ((1, 1, 1), np.uint16)])
def test_touching_reads_only_inside_the_rows(shape, dtype):
    tile = guarded(shape, dtype)
    touch_all(tile, 7 if tile.size > 4096 else 1)
    touch_all(tile[-1:], 1)                                    # the last rows alone, up to the guard


@pytest.mark.skipif(not JIT, reason="the loads exist only in the JIT's code")
def test_the_loads_are_kept_by_the_optimiser():
    tile = np.zeros((4096, 16), np.float32)
    touch_all(tile, 4095)
    assert "load atomic i8" in touch_all.inspect_llvm(touch_all.signatures[0])


@pytest.mark.parametrize("storage", ["float32", BFLOAT16])
@pytest.mark.parametrize("num_kv_heads, page_size, head_dim", [(1, 4, 8), (2, 16, 64), (8, 32, 128)])
def test_the_kernel_reads_nothing_past_the_last_page(storage, num_kv_heads, page_size, head_dim):
    """Queries whose walk ends on the pool's last page (its V last: the walk's lookahead runs into the next run,
    which there is K's), over arrays that end at an inaccessible page; the output equals the same call over an
    unguarded copy, bit for bit."""
    rng = np.random.default_rng(num_kv_heads * 100 + page_size)
    num_pages = 6
    shape = (num_pages, num_kv_heads, page_size, head_dim)
    k, v = (rng.standard_normal(shape).astype(np.float32) for _ in range(2))
    if storage == BFLOAT16:
        k, v = bf16.to_bits(k).view(np.int16), bf16.to_bits(v).view(np.int16)
    gk, gv = guarded(shape, k.dtype), guarded(shape, v.dtype)
    gk[...], gv[...] = k, v
    pages = np.array([3, 1, 2, 0, 4, 5], np.int32)          # ends on the last page, 5
    indptr = np.array([0, len(pages)], np.int64)
    length = len(pages) * page_size
    query_pos = np.array([length - 1, length // 2, page_size - 1], np.int64)
    query_seq = np.zeros(3, np.int32)
    q = rng.standard_normal((3, 4 * num_kv_heads, head_dim)).astype(np.float32)
    outs = []
    for kp, vp in ((gk, gv), (k, v)):
        out = np.empty((3, 4 * num_kv_heads, head_dim), np.float32)
        plan = AttentionPlan(query_seq, query_pos, 0, q.shape, vp.shape,
                             BFLOAT16 if storage == BFLOAT16 else np.dtype(storage), tiled=False)
        plan.run(q, kp, vp, pages, indptr, 0.1, 0, out)
        outs.append(out)
    assert np.array_equal(outs[0], outs[1])
