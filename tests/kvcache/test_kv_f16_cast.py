"""float32 -> float16 storage casts (`kvcache.checks.cast_to_storage`'s jitted path, `kvcache.jit_store`): bit for
bit NumPy's ``astype(np.float16)`` on every class of input, and a value beyond float16 refused by name."""
import numpy as np
import pytest

from kvcache.checks import cast_to_storage
from numba import njit

from kvcache.jit_store import f16_bits_arith, f16_round_flat


def _bit_sweep() -> np.ndarray:
    """float32 bit patterns around every float16 boundary (subnormals, ties, the top of the range) and random."""
    rng = np.random.default_rng(11)
    edges = np.array([0x33000000, 0x33000001, 0x337fffff, 0x38800000, 0x387fffff, 0x477fe000, 0x477fefff,
                      0x477ff000, 0x3f801000, 0x3f803000, 0x3f800fff, 0x00000001, 0x7f7fffff], dtype=np.uint32)
    near = (edges[:, None] + np.arange(-40, 41, dtype=np.int64)[None, :]).astype(np.uint32).reshape(-1)
    exps = (np.arange(90, 150, dtype=np.uint32)[:, None] << 23) | rng.integers(0, 1 << 23, (60, 500),
                                                                               dtype=np.uint32)
    signs = np.concatenate([near, exps.reshape(-1), rng.integers(0, 1 << 32, 20000, dtype=np.uint32)])
    return np.concatenate([signs, signs | np.uint32(0x80000000)])


def test_jitted_cast_is_numpys_bit_for_bit():
    u = _bit_sweep()
    f = u.view(np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        ref = f.astype(np.float16).view(np.uint16)
    out = np.empty(u.shape, np.uint16)
    assert f16_round_flat(u, out) == bool((np.abs(f) >= 65520).any() or np.isnan(f).any())
    nan = np.isnan(f)
    assert (out[~nan] == ref[~nan]).all()
    assert ((out[nan] & 0x7fff) == 0x7e00).all()


@njit
def _arith_all(u, out):
    for i in range(u.shape[0]):
        out[i] = f16_bits_arith(u[i])


def test_integer_twin_is_numpys_bit_for_bit():
    """The integer-arithmetic cast (what runs without the JIT, and what the hardware cast was checked against over
    every float32 pattern) on the same sweep."""
    u = _bit_sweep()
    f = u.view(np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        ref = f.astype(np.float16).view(np.uint16)
    out = np.empty(u.shape, np.uint16)
    _arith_all(u, out)
    nan = np.isnan(f)
    assert (out[~nan] == ref[~nan]).all()
    assert ((out[nan] & 0x7fff) == 0x7e00).all()


def test_cast_to_storage_matches_numpy_and_refuses_overflow():
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((5, 3, 16)) * 10.0 ** rng.integers(-9, 5, (5, 3, 16))).astype(np.float32)
    got = cast_to_storage("k", x.swapaxes(0, 1), np.dtype(np.float16))     # a non-contiguous view too
    assert got.dtype == np.float16 and got.shape == (3, 5, 16)
    assert (got.view(np.uint16) == x.swapaxes(0, 1).astype(np.float16).view(np.uint16)).all()
    x[2, 1, 7] = 65520.0                                                    # rounds to inf in float16
    with pytest.raises(ValueError, match=r"k: expected values finite in float16 storage .*65520.0 at index "
                                         r"\(2, 1, 7\)"):
        cast_to_storage("k", x, np.dtype(np.float16))
    x[2, 1, 7] = np.nan
    with pytest.raises(ValueError, match=r"k: expected finite values, got nan at index \(2, 1, 7\)"):
        cast_to_storage("k", x, np.dtype(np.float16))
