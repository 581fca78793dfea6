"""What transformers' cache protocol asks of a `PagedCache`'s rows in the pool, one pool sequence per batch row;
each operation runs in one pool group (every row or none) and changes nothing when it raises.

    truncate(pool, seqs, lengths, window)           crop: every row back to its length (refused below a window's
                                                    released positions)
    release_window(pool, seqs, window)              give back the pages no future query of a sliding window reads
    row_index(rows, count, name) -> int64 [n]       a row index, checked
    select(pool, seqs, rows) -> seqs                beams / batch selection: row i takes row ``rows[i]``'s tokens
                                                    (pages shared, copied on a later write)
    prompt_arrays(input_ids, attention_mask) -> (ids, mask)   a prompt, checked
    match(pool, ids, mask) -> (seqs, columns)       prefix reuse: new rows from the pool's cached prefixes
    free(pool, seqs)                                every row's sequence back to the pool

``pool`` is the `kvcache.KVCache`, ``seqs`` the rows' sequence ids (row order).
"""
import numpy as np
import torch


def truncate(pool, seqs, lengths, window: int) -> None:
    """Every row ``seqs[i]`` back to ``lengths[i]`` tokens (``window``: the layers' sliding window, 0 none)."""
    for seq, n in zip(seqs, lengths):
        first, needed = pool.pool.first_position(seq), max(0, int(n) - window + 1) if window else 0
        if needed < first:
            raise ValueError(f"tokens_to_remove: the sliding window already released positions < {first} of a "
                             f"row, so it cannot go back to length {n} (call activate_past_recording() before "
                             f"forwards that may be cropped)")
    with pool.group():
        for seq, n in zip(seqs, lengths):
            pool.truncate(seq, int(n))


def release_window(pool, seqs, window: int) -> None:
    """When every layer slides (``window`` > 0), give back the pages no future query can read."""
    if not window or seqs is None:
        return
    with pool.group():
        for seq in seqs:
            keep_from = pool.length(seq) - window + 1
            if keep_from > pool.pool.first_position(seq):
                pool.release_before(seq, keep_from)


def _array(x) -> np.ndarray:
    """A tensor (any device) or array-like as a numpy array."""
    return np.asarray(x.detach().cpu() if isinstance(x, torch.Tensor) else x)


def row_index(rows, count: int, name: str) -> np.ndarray:
    """``rows`` (a tensor or array-like) as int64 ``[n]`` of rows in ``[0, count)``; ValueError naming ``name``."""
    rows = _array(rows)
    if rows.ndim != 1 or rows.dtype.kind not in "iu" or (rows.size and not (0 <= rows.min() and rows.max() < count)):
        raise ValueError(f"{name}: expected a 1-d integer index of rows in [0, {count}), got "
                         f"{rows.tolist() if rows.size < 20 else rows}")
    return rows.astype(np.int64)


def select(pool, seqs: list, rows: np.ndarray) -> list:
    """The sequences of the new rows: row i takes the tokens of old row ``rows[i]`` (`row_index`). An old row's
    sequence goes as is to one new row taking it (the same row if it does), the others fork it; old rows nobody
    takes are freed."""
    rows = rows.tolist()
    owner = {}                                       # old row -> the new row that takes its sequence as is
    for new, src in enumerate(rows):
        if new == src:
            owner.setdefault(src, new)
    for new, src in enumerate(rows):
        owner.setdefault(src, new)
    with pool.group():                               # every fork and free, or none
        out = [seqs[src] if owner[src] == new else pool.fork(seqs[src]) for new, src in enumerate(rows)]
        for row, seq in enumerate(seqs):
            if row not in owner:
                pool.free(seq)
    return out


def prompt_arrays(input_ids, attention_mask) -> tuple:
    """``(ids int [B, L], mask bool [B, L])`` of a prompt (tensors or array-likes; no mask: every column real)."""
    ids = _array(input_ids)
    if ids.ndim != 2 or ids.dtype.kind not in "iu" or ids.shape[1] < 1:
        raise ValueError(f"input_ids: expected integer ids [batch, length >= 1], got {ids.dtype} {ids.shape}")
    mask = np.ones(ids.shape, dtype=bool) if attention_mask is None else _array(attention_mask).astype(bool)
    if mask.shape != ids.shape:
        raise ValueError(f"attention_mask: expected shape {ids.shape} (input_ids'), got {mask.shape}")
    return ids, mask


def match(pool, ids: np.ndarray, mask: np.ndarray) -> tuple:
    """``(seqs, columns)``: a new sequence per row holding the longest prefix of its real tokens the pool has
    cached, cut to the same number of columns for every row (transformers counts columns), at most ``L - 1``."""
    real_before = np.concatenate([np.zeros((len(ids), 1), np.int64), np.cumsum(mask, axis=1)], axis=1)
    with pool.group():                               # every row's match, or none
        matches = [pool.match_prefix(row[keep]) if keep.any() else None for row, keep in zip(ids, mask)]
        hits = np.array([0 if m is None else m.num_tokens for m in matches])
        columns = ids.shape[1] - 1
        while columns > 0 and (real_before[:, columns] > hits).any():
            columns -= 1
        seqs = []
        for row, found in enumerate(matches):
            seq = pool.create_sequence() if found is None else found.seq
            pool.truncate(seq, int(real_before[row, columns]))
            seqs.append(seq)
    return seqs, columns


def free(pool, seqs) -> None:
    with pool.group():
        for seq in seqs:
            pool.free(seq)
