"""A sequence: its page table (physical page ids in logical order) and its explicit length.

Lengths are tracked, never inferred from data. Outside a transaction ``num_logical_pages == ceil(length /
page_size)``; entries before ``first_live_page`` are -1 (released by a sliding window).
"""
import numpy as np


class Sequence:
    __slots__ = ("length", "table", "num_logical_pages", "first_live_page", "busy", "held")

    def __init__(self, table: np.ndarray | None = None, length: int = 0, first_live_page: int = 0):
        self.table = np.full(4, -1, dtype=np.int32) if table is None else table   # capacity grows by doubling
        self.num_logical_pages = 0 if table is None else len(table)
        self.length = length
        self.first_live_page = first_live_page
        self.busy = False        # a transaction is open on it
        self.held: list[int] = []  # pages an open transaction copied-on-write away from; released at commit

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

    def copy_for_fork(self) -> "Sequence":
        return Sequence(self.pages().copy(), self.length, self.first_live_page)
