"""An undo journal: every change made by a cache operation records its inverse, and a failure replays the
inverses newest-first, so metadata and bytes return exactly to what they were (O(changes), not O(cache)).

Bytes no token ever used need no copy: the pool is allocated zeroed (`kvcache.mapped.zeros`), and a page freed
by a finished operation is zeroed again (`CacheCore.clear_freed`, once no open group can take the free back), so
the slots of a free page hold zero bits, and their undo is to write zeros back. `save_bytes` checks that (one read
of the view) instead of trusting any bookkeeping, so a prefill into fresh or recycled pages keeps no copy of what
it overwrites, while a write over bytes someone left there (a cached prefix page evicted for it, a page freed inside
a group still open, the slots past a truncated length in a kept page, a test's painted sentinel) still saves
them."""
from typing import Callable

import numpy as np

_ZEROS: dict[int, bytes] = {}                # zero bytes by length (the few chunk and page sizes of a pool)


def _zeros(n: int) -> bytes:
    zeros = _ZEROS.get(n)
    if zeros is None:
        if len(_ZEROS) >= 64:
            _ZEROS.clear()
        zeros = _ZEROS[n] = bytes(n)
    return zeros


class Journal:
    def __init__(self):
        self._undo: list[Callable[[], None]] = []

    def record(self, undo: Callable[[], None]) -> None:
        self._undo.append(undo)

    def save_bytes(self, view: np.ndarray) -> None:
        """Remember the current contents of ``view`` (a view into a pool array) before it is overwritten: its
        bytes, or nothing but "zeros" when every one of them is zero."""
        data = view.tobytes()                    # one transient copy; comparing it is ~8x faster than view.any()
        if data == _zeros(len(data)):
            self._undo.append(lambda: view.fill(0))
            return
        self._undo.append(lambda: view.__setitem__(Ellipsis, np.frombuffer(data, view.dtype).reshape(view.shape)))

    def extend(self, other: "Journal") -> None:
        """Take over ``other``'s undo steps (they run after this journal's newer ones, before its older ones)."""
        self._undo.extend(other._undo)
        other._undo.clear()

    def rollback(self) -> None:
        while self._undo:
            self._undo.pop()()

    def clear(self) -> None:
        self._undo.clear()
