"""The validating wrapper's one-pass input check (the kernels themselves never check anything)."""
from enum import IntEnum

import numpy as np
from numba import njit

from . import cachedir  # noqa: F401


class CheckCode(IntEnum):
    """What `check_inputs` found (its first return value; the jitted code returns the plain integers)."""
    OK = 0
    BAD_INDPTR = 1          # page_indptr not non-decreasing within [0, len(page_indices)] (index: the entry)
    BAD_PAGE = 2            # a page_indices entry outside [-1, num_pages)
    BAD_SEQ = 3             # a query_seq entry outside [0, num_seqs)
    BAD_POSITION = 4        # a query_pos outside [0, pages of the sequence * page_size)
    FREED_PAGE = 5          # a visible position on a -1 page (index: the query)
    NOT_FINITE = 6          # a non-finite q (flat index)
    TOO_LARGE = 7           # a q value with |x| >= q_limit (it would overflow the compute dtype)


@njit(cache=True)
def check_inputs(q_flat, q_limit, page_indices, page_indptr, query_seq, query_pos, num_pages, page_size, window):
    """Validation for the wrapper (the kernels never check anything), one pass over each array.
    Returns (code, index) of the first problem: the integer of a `CheckCode` (0 = none)."""
    n_bad = 0
    for i in range(q_flat.shape[0]):          # branch-free count (vectorised), then locate if needed
        n_bad += 0 if abs(q_flat[i]) < q_limit else 1
    if n_bad:
        big = -1
        for i in range(q_flat.shape[0]):
            x = q_flat[i]
            if not (abs(x) < q_limit):
                if x != x or abs(x) == np.inf:
                    return 6, i
                if big < 0:
                    big = i
        return 7, big
    n = page_indices.shape[0]
    num_seqs = page_indptr.shape[0] - 1
    prev = 0
    for s in range(num_seqs + 1):
        x = page_indptr[s]
        if x < prev or x > n:
            return 1, s
        prev = x
    neg = 0
    for j in range(n):
        x = page_indices[j]
        if x < -1 or x >= num_pages:
            return 2, j
        if x < 0:
            neg += 1
    nq = query_seq.shape[0]
    for i in range(nq):
        s = query_seq[i]
        if s < 0 or s >= num_seqs:
            return 3, i
    for i in range(nq):
        s = query_seq[i]
        p = query_pos[i]
        if p < 0 or p >= (page_indptr[s + 1] - page_indptr[s]) * page_size:
            return 4, i
    if neg:
        cneg = np.empty(n + 1, np.int64)     # prefix count of freed entries
        cneg[0] = 0
        for j in range(n):
            cneg[j + 1] = cneg[j] + (1 if page_indices[j] < 0 else 0)
        for i in range(nq):
            s = query_seq[i]
            p = query_pos[i]
            lo = max(0, p - window + 1) if window > 0 else 0
            if cneg[page_indptr[s] + p // page_size + 1] - cneg[page_indptr[s] + lo // page_size] > 0:
                return 5, i
    return 0, 0
