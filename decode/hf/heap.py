"""Giving malloc's free heap memory back to the OS after a prefill layer's attention (glibc only).

    trim() -> bool      ``malloc_trim(0)``; False where there is no glibc

A prefill's transient buffers (the kernels' split-K workspace, the checks' masks, numpy and torch temporaries
below glibc's dynamic mmap threshold, which grows to the size of every large block freed, up to 32 MiB) are freed
into malloc's heap, which keeps them resident; the MLP that follows the attention then maps its own activations
beside them, and the forward's peak RSS holds both. Trimming after the attention of a forward of many tokens
returns them first (measured on a bfloat16 Llama, 4096 x 1: the gap to StaticCache was this retained heap; it
costs ~0.1-1 ms a layer against a prefill's seconds). Forwards of fewer than `decode.hf.plan.TRIM_TOKENS` real
tokens never trim (decode steps, short prompts: there the freed heap is reused by the next layer and the trim only
costs time, see its comment).
"""
import ctypes
import ctypes.util

_TRIM = None
try:
    _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    _TRIM = _libc.malloc_trim
    _TRIM.argtypes, _TRIM.restype = [ctypes.c_size_t], ctypes.c_int
except (OSError, AttributeError):        # not glibc (musl, macOS): nothing to trim
    _TRIM = None


def trim() -> bool:
    """Return malloc's free heap pages to the OS (``malloc_trim(0)``); False where there is no glibc."""
    if _TRIM is None:
        return False
    _TRIM(0)
    return True
