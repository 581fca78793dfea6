"""An undo journal: every change made by a cache operation records its inverse, and a failure replays the
inverses newest-first, so metadata and bytes return exactly to what they were (O(changes), not O(cache))."""
from typing import Callable

import numpy as np


class Journal:
    def __init__(self):
        self._undo: list[Callable[[], None]] = []

    def record(self, undo: Callable[[], None]) -> None:
        self._undo.append(undo)

    def save_bytes(self, view: np.ndarray) -> None:
        """Remember the current contents of ``view`` (a view into a pool array) before it is overwritten."""
        saved = view.copy()
        self._undo.append(lambda: view.__setitem__(Ellipsis, saved))

    def extend(self, other: "Journal") -> None:
        """Take over ``other``'s undo steps (they run after this journal's newer ones, before its older ones)."""
        self._undo.extend(other._undo)
        other._undo.clear()

    def rollback(self) -> None:
        while self._undo:
            self._undo.pop()()

    def clear(self) -> None:
        self._undo.clear()
