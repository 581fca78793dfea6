"""Which columns of a batch row are real tokens: the bookkeeping between transformers' view of a cache (every
row has ``columns`` positions, pads included) and the pool's (a row's sequence holds only its real tokens).

    real: bool [batch, columns]     True where the column holds a token that is in the pool

A row's pool length is ``real[row].sum()``; a new token's pool position is the count of real columns before it.
`check_new_real` checks a forward's padding mask of its new columns against what the pool can hold.
"""
import numpy as np

from .layout import UnsupportedFeatureError


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


def check_new_real(new_real: np.ndarray, batch: int, width: int, held: np.ndarray, sliding: bool) -> None:
    """A forward's padding mask of its new columns ``new_real bool [B, T]`` against the rows' pool lengths
    (``held bool [B]``: a row holds tokens already): its shape, a real token in every row, and with sliding windows
    (``sliding``) no pad after a row's real tokens. Raises ValueError / `UnsupportedFeatureError`."""
    if new_real.shape != (batch, width):
        raise ValueError(f"attention_mask: expected the new columns' padding mask [batch, new] = "
                         f"{(batch, width)}, got {tuple(new_real.shape)}")
    empty = ~held & ~new_real.any(axis=1)
    if empty.any():
        raise UnsupportedFeatureError(f"attention_mask: expected every row to hold a real token, got rows "
                                      f"{np.flatnonzero(empty).tolist()} all padding (nothing to attend: "
                                      f"sdpa returns zeros there, eager NaN)")
    if sliding:
        _refuse_inner_padding(new_real, held)


def _refuse_inner_padding(new_real: np.ndarray, held: np.ndarray) -> None:
    """Sliding windows count columns in transformers (pads included) but pool positions here: the two agree
    only while every pad of a row comes before its first real token (left padding)."""
    seen = held[:, None] | np.logical_or.accumulate(new_real, axis=1)            # [B, T] real token so far
    after_real = ~new_real[:, 1:] & seen[:, :-1]
    if (held & ~new_real[:, 0]).any() or after_real.any():
        raise UnsupportedFeatureError("attention_mask: padding after a row's real tokens with sliding-window "
                                      "layers (the window would span the pad columns); left padding only")
