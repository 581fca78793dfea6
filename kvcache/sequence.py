"""A sequence: its page table (physical page ids in logical order) and its explicit length.

Lengths are tracked, never inferred from data. Outside a transaction ``num_logical_pages == ceil(length /
page_size)``; entries before ``first_live_page`` are -1 (released by a sliding window).

Token ids (optional): ``tokens[:num_known]`` are the ids of positions ``0 .. num_known - 1`` (``num_known <=
length``; an append without ids stops the known run). ``chain[i]`` is the prefix-index entry that holds exactly
the content of logical page ``i`` after its chain (or None when none does); with prefix caching
``len(chain) == num_known // page_size``.
"""
import numpy as np


class Sequence:
    __slots__ = ("length", "table", "num_logical_pages", "first_live_page", "busy", "held", "tokens", "num_known",
                 "chain", "namespace")

    def __init__(self, table: np.ndarray | None = None, length: int = 0, first_live_page: int = 0):
        self.table = np.full(4, -1, dtype=np.int32) if table is None else table   # capacity grows by doubling
        self.num_logical_pages = 0 if table is None else len(table)
        self.length = length
        self.first_live_page = first_live_page
        self.busy = False        # a transaction is open on it
        self.held: list[int] = []  # pages an open transaction copied-on-write away from; released at commit
        self.tokens = np.zeros(0, dtype="<i4")   # token ids; capacity grows by doubling
        self.num_known = 0
        self.chain: list = []
        self.namespace = ""

    def pages(self) -> np.ndarray:
        """``int32 [num_logical_pages]``: a view of the page table (-1 for released pages)."""
        return self.table[: self.num_logical_pages]

    def live_pages(self) -> np.ndarray:
        return self.table[self.first_live_page: self.num_logical_pages]

    def reserve_table(self, num_logical_pages: int) -> None:
        """Make room for ``num_logical_pages`` entries (amortised O(1) growth; contents kept)."""
        if num_logical_pages > len(self.table):
            grown = np.full(max(num_logical_pages, 2 * len(self.table)), -1, dtype=np.int32)
            grown[: self.num_logical_pages] = self.pages()
            self.table = grown

    def known_tokens(self) -> np.ndarray:
        """``int32 [num_known]``: the known token ids (a view)."""
        return self.tokens[: self.num_known]

    def store_tokens(self, start: int, token_ids: np.ndarray) -> None:
        """Write ``token_ids`` at positions ``start ..`` of the buffer (beyond ``num_known``: not yet visible)."""
        end = start + len(token_ids)
        if end > len(self.tokens):
            grown = np.zeros(max(end, 2 * len(self.tokens), 16), dtype="<i4")
            grown[: self.num_known] = self.known_tokens()
            self.tokens = grown
        self.tokens[start:end] = token_ids

    def copy_for_fork(self) -> "Sequence":
        child = Sequence(self.pages().copy(), self.length, self.first_live_page)
        child.tokens, child.num_known = self.known_tokens().copy(), self.num_known
        child.chain, child.namespace = list(self.chain), self.namespace
        return child
