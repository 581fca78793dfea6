"""Which columns of a batch row are real tokens: the bookkeeping between transformers' view of a cache (every
row has ``columns`` positions, pads included) and the pool's (a row's sequence holds only its real tokens).

    real: bool [batch, columns]     True where the column holds a token that is in the pool

A row's pool length is ``real[row].sum()``; a new token's pool position is the count of real columns before it.
"""
import numpy as np


class RowColumns:
    """``real [batch, columns]`` with amortised O(1) growth in columns."""

    def __init__(self, batch: int = 0):
        self._real = np.zeros((batch, 64), dtype=bool)
        self.columns = 0

    @property
    def batch(self) -> int:
        return self._real.shape[0]

    @property
    def real(self) -> np.ndarray:
        """``bool [batch, columns]`` (a view)."""
        return self._real[:, : self.columns]

    def lengths(self) -> np.ndarray:
        """``int64 [batch]``: real tokens of each row (its pool length)."""
        return self.real.sum(axis=1, dtype=np.int64)

    def lengths_after_crop(self, columns: int) -> np.ndarray:
        """``int64 [batch]``: each row's pool length once only the first ``columns`` columns are kept."""
        return self._real[:, :columns].sum(axis=1, dtype=np.int64)

    def extend(self, new_real: np.ndarray) -> None:
        """Append the columns ``new_real [batch, T]``."""
        batch, count = new_real.shape
        if self.columns + count > self._real.shape[1]:
            grown = np.zeros((batch, max(2 * self._real.shape[1], self.columns + count)), dtype=bool)
            grown[:, : self.columns] = self.real
            self._real = grown
        self._real[:, self.columns: self.columns + count] = new_real
        self.columns += count

    def crop(self, columns: int) -> None:
        self._real[:, columns: self.columns] = False
        self.columns = columns

    def select(self, rows: np.ndarray) -> "RowColumns":
        """A new `RowColumns` whose row i is row ``rows[i]`` of this one."""
        out = RowColumns.__new__(RowColumns)
        out._real = self._real[rows].copy()
        out.columns = self.columns
        return out

    def copy(self) -> "RowColumns":
        return self.select(np.arange(self.batch))
