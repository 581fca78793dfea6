"""Where each part of a call goes: the three shardings as plans of per-worker pieces, and how the pieces'
results are put back together.

    heads     worker w holds kv heads [h0, h1) (and their query heads [h0 * G, h1 * G)) of every layer and
              every sequence; a call sends each worker its heads' slice; outputs are concatenated on the head axis
    context   worker w holds positions [w * C, (w + 1) * C) of every sequence (C = its pool's tokens; tokens go to
              the worker whose range holds their position: the last worker with room); a call sends the query
              to every worker holding keys the query reads, the new tokens to the workers whose range holds
              them, and merges the partial softmax states with the kernel's split-K combine
    sequence  each sequence lives whole on one worker (DecoderPool); a batch sends each worker its rows

A plan is ``{worker: Piece}``; `Piece.begin` is what opens the worker's transaction: ``(sequence ids, tokens
per sequence on that worker)``.
"""
from dataclasses import dataclass

import numpy as np

from decode.partial import merge_partials


@dataclass
class Piece:
    sids: list                      # the sequences this worker takes part for
    tokens: int                     # new tokens per sequence written on this worker
    heads: slice | None = None      # kv-head slice (heads)
    token_rows: slice | None = None  # rows of the call's k/v written here (context)
    rows: list | None = None        # batch rows (sequence)
    offset: int = 0                 # first position held (context)


def split_even(count: int, parts: int) -> list[tuple[int, int]]:
    """``parts`` contiguous ranges covering ``[0, count)``, sizes differing by at most one."""
    return [(w * count // parts, (w + 1) * count // parts) for w in range(parts)]


class HeadsLayout:
    name = "heads"

    def __init__(self, num_kv_heads: int, group: int, workers: int):
        self.ranges = split_even(num_kv_heads, workers)
        self.group = group

    def holders(self, sid) -> list[int]:
        return list(range(len(self.ranges)))

    def place_fork(self, parent, child) -> None:
        """Every worker holds a part of every sequence."""

    def plan(self, sids, start, num_tokens, kind):
        return {w: Piece(list(sids), num_tokens, heads=slice(h0, h1)) for w, (h0, h1) in enumerate(self.ranges)}

    def split(self, piece, q, k, v, start):
        h, g = piece.heads, self.group
        qh = slice(h.start * g, h.stop * g)
        return (None if q is None else np.ascontiguousarray(q[..., qh, :]), np.ascontiguousarray(k[..., h, :]),
                np.ascontiguousarray(v[..., h, :]), None)

    def merge(self, plan, results, kind, single):
        return None if kind == "append" else np.concatenate([results[w] for w in sorted(plan)], axis=-2)

    def kv_parts(self, lengths, sid):
        return {w: ("kv", sid) for w in range(len(self.ranges))}, 1            # concatenated on the head axis

    def truncations(self, lengths, sid, n):
        return {w: ("truncate", sid, n) for w in range(len(self.ranges))}

    def describe(self, w, lengths):
        h0, h1 = self.ranges[w]
        return f"kv heads [{h0}, {h1}) of sequences {sorted(lengths)}"


class ContextLayout:
    name = "context"

    def __init__(self, capacity: int, workers: int, num_kv_heads: int):
        self.capacity, self.workers, self.num_kv_heads = capacity, workers, num_kv_heads

    def holders(self, sid) -> list[int]:
        return list(range(self.workers))

    def place_fork(self, parent, child) -> None:
        """Every worker holds a part of every sequence."""

    def held(self, w: int, length: int) -> tuple[int, int]:
        """The positions ``[a, b)`` of a sequence of ``length`` tokens held by worker w."""
        lo = w * self.capacity
        return lo, max(lo, min(length, lo + self.capacity))

    def plan(self, sids, start, num_tokens, kind):
        (sid,) = sids
        end, c = start + num_tokens, self.capacity
        if kind == "append":
            first, last = (start // c, (end - 1) // c) if num_tokens else (0, -1)
        else:
            first, last = 0, (end - 1) // c
        plan = {}
        for w in range(first, last + 1):
            a, b = max(start, w * c), min(end, (w + 1) * c)
            n = max(0, b - a)
            plan[w] = Piece([sid], n, token_rows=slice(a - start, a - start + n), offset=w * c)
        return plan

    def split(self, piece, q, k, v, start):
        k_w, v_w = k[piece.token_rows], v[piece.token_rows]
        if q is None:
            return None, k_w, v_w, None
        positions = start + np.arange(len(q), dtype=np.int64)
        hi = np.clip(positions + 1 - piece.offset, 0, self.capacity)
        return q, k_w, v_w, hi

    def merge(self, plan, results, kind, single):
        if kind == "append":
            return None
        parts = [results[w] for w in sorted(plan)]
        out = merge_partials(np.stack([p[0] for p in parts]), np.stack([p[1] for p in parts]),
                             np.stack([p[2] for p in parts]), self.num_kv_heads)      # [T, num_q_heads, head_dim_v]
        return out[0] if single else out

    def kv_parts(self, lengths, sid):
        length = lengths[sid]
        return {w: ("kv", sid) for w in range(self.workers) if self.held(w, length)[1] > w * self.capacity}, 0

    def truncations(self, lengths, sid, n):
        calls = {}
        for w in range(self.workers):
            a, b = self.held(w, lengths[sid])
            keep = min(max(n - a, 0), b - a)
            if keep < b - a:
                calls[w] = ("truncate", sid, keep)
        return calls

    def describe(self, w, lengths):
        held = [f"sequence {sid}: positions [{a}, {b})" for sid, length in sorted(lengths.items())
                for a, b in [self.held(w, length)] if b > a]
        lo = w * self.capacity
        return (f"positions [{lo}, {lo + self.capacity}) of every sequence ("
                + ("; ".join(held) if held else "none written yet") + ")")


class SequenceLayout:
    """DecoderPool: ``home[sid]`` is the worker holding sequence sid."""
    name = "sequence"

    def __init__(self, home: dict):
        self.home = home

    def holders(self, sid) -> list[int]:
        return [self.home[sid]]

    def place_fork(self, parent, child) -> None:
        """A fork stays on its parent's worker (it shares the parent's pages there)."""
        self.home[child] = self.home[parent]

    def plan(self, sids, start, num_tokens, kind):
        if len(sids) == 1:                                          # one sequence's call: the whole arrays
            return {self.home[sids[0]]: Piece(list(sids), num_tokens)}
        plan = {}
        for row, sid in enumerate(sids):
            piece = plan.setdefault(self.home[sid], Piece([], num_tokens, rows=[]))
            piece.sids.append(sid)
            piece.rows.append(row)
        return plan

    def split(self, piece, q, k, v, start):
        rows = piece.rows
        if rows is None or rows == list(range(len(k))):
            return q, k, v, None                                   # the whole call (one sequence, or all rows)
        return (None if q is None else q[rows]), k[rows], v[rows], None

    def merge(self, plan, results, kind, single):
        if kind == "append":
            return None
        (w0, p0), = list(plan.items())[:1]
        if p0.rows is None:                                         # one sequence's call
            return results[w0]
        first = next(iter(results.values()))
        out = np.empty((sum(len(p.rows) for p in plan.values()),) + first.shape[1:], dtype=first.dtype)
        for w, piece in plan.items():
            out[piece.rows] = results[w]
        return out

    def kv_parts(self, lengths, sid):
        return {self.home[sid]: ("kv", sid)}, 0

    def truncations(self, lengths, sid, n):
        return {self.home[sid]: ("truncate", sid, n)}

    def describe(self, w, lengths):
        return f"sequences {sorted(s for s in lengths if self.home.get(s) == w)}"
