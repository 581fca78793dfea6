"""How many pages a `generate()` call can need, and what a pool that ran out should have been.

The pool holds every row's real tokens (pads are never stored) in whole pages; beam search forks rows
(``batch * num_beams`` of them) whose pages are shared until a write copies the shared partly filled page, and
the copied-from page is held until the forward commits. So a call generating up to ``max_length`` columns
(prompt + new tokens) needs at most, over all rows together::

    pages = batch * num_beams * (ceil(max_length / page_size) + 1)

(the + 1: one copied-on-write page per row during a forward). Assisted decoding and prompt lookup verify their
candidates within ``max_length``; their rejected tokens are cropped, so they need no more.
"""
import math

from kvcache import CacheFullError


def pages_for_generate(batch_size: int, max_length: int, page_size: int, num_beams: int = 1) -> int:
    """Pages a `generate()` call of ``batch_size`` rows, ``num_beams`` beams, up to ``max_length`` columns needs."""
    for name, value in (("batch_size", batch_size), ("max_length", max_length), ("page_size", page_size),
                        ("num_beams", num_beams)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}: expected an int >= 1, got {value!r}")
    return batch_size * num_beams * (math.ceil(max_length / page_size) + 1)


def explain_full(err: CacheFullError, *, page_size: int, rows: int, columns: int, prompt_columns: int,
                 forward_columns: int, pages_used: int) -> CacheFullError:
    """A `CacheFullError` with the same figures, saying in tokens what ran out and what would fit."""
    generated = max(0, columns - prompt_columns)
    fit_pages = pages_used + err.pages_needed
    what = (f"PagedCache: after {generated} generated token(s) per row ({rows} rows, {columns} columns incl. a "
            f"{prompt_columns}-column prompt), a forward of {forward_columns} column(s) does not fit the pool "
            f"(max_tokens = num_pages * page_size = {err.num_pages * page_size}); this forward needs max_tokens >= "
            f"{fit_pages * page_size}. Size the cache for the whole call with PagedCache.for_generate(config, "
            f"batch_size, max_length, num_beams=...) (max_tokens counts every row and beam; pads are not stored)")
    return CacheFullError(err.pages_needed, err.pages_free, err.num_pages, err.could_ever_fit, what)
