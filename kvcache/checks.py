"""Argument checks shared by the cache and the decoder: each error names the argument, expected and given."""
import numbers

import numpy as np

STORAGE_DTYPES = (np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64), np.dtype(np.int8))
BFLOAT16 = "bfloat16"              # no numpy dtype: the pool holds uint16 bits (`kvcache.bf16`)
STORAGE_NAMES = tuple(d.name for d in STORAGE_DTYPES) + (BFLOAT16,)


def check_int(name: str, value, *, minimum: int = 0, maximum: int | None = None) -> int:
    """Return ``value`` as int if it is an integer (not bool) in ``[minimum, maximum]``."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name}: expected an integer, got {type(value).__name__} {value!r}")
    value = int(value)
    if value < minimum or (maximum is not None and value > maximum):
        bounds = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
        raise ValueError(f"{name}: expected an integer {bounds}, got {value}")
    return value


def check_storage_dtype(name: str, dtype) -> str:
    """The storage format's name for "float16" / "float32" / "float64" / "int8" (or the numpy types) and
    "bfloat16"; int8 is the quantized format of `kvcache.quant`, bfloat16 the rounding of `kvcache.bf16`
    (inputs stay float for both)."""
    if isinstance(dtype, str) and dtype == BFLOAT16:
        return BFLOAT16
    try:
        resolved = None if dtype is None else np.dtype(dtype)    # np.dtype(None) would be float64
    except TypeError:
        resolved = None
    # not `resolved not in STORAGE_DTYPES`: `np.dtype("float64") == None` is True, so None would pass
    if resolved is None or not any(resolved == d for d in STORAGE_DTYPES):
        raise TypeError(f"{name}: expected one of {', '.join(STORAGE_NAMES)}, got {dtype!r}")
    return resolved.name


def storage_array_dtype(storage: str) -> np.dtype:
    """The element dtype of a pool of the storage format ``storage`` (a checked name): uint16 for bfloat16,
    else the dtype of that name."""
    return np.dtype(np.uint16) if storage == BFLOAT16 else np.dtype(storage)


def as_float_array(name: str, value) -> np.ndarray:
    """``value`` as an ndarray of a real floating dtype; TypeError for int, bool, complex, object, str."""
    array = np.asarray(value)
    if array.dtype.kind != "f":
        raise TypeError(f"{name}: expected a real floating-point array, got dtype {array.dtype}")
    return array


def check_shape(name: str, array: np.ndarray, expected: tuple, labels: str) -> None:
    """Raise ValueError unless ``array.shape == expected`` (``labels`` names the dimensions)."""
    if array.shape != expected:
        raise ValueError(f"{name}: expected shape {labels} = {expected}, got {array.shape}")


def first_nonfinite(array: np.ndarray):
    """Index tuple and value of the first non-finite element, or None."""
    bad = np.argwhere(~np.isfinite(array))
    if len(bad) == 0:
        return None
    index = tuple(int(i) for i in bad[0])
    return index, array[index]


def all_finite(array: np.ndarray, chunk: int = 1 << 18) -> bool:
    """Whether every element is finite; a C-contiguous array is tested ``chunk`` elements at a time, so the test's
    mask is never larger than that (a prefill's input is tens of MiB)."""
    if not array.flags.c_contiguous or array.size <= chunk:
        return bool(np.isfinite(array).all())
    flat = array.reshape(-1)
    return all(np.isfinite(flat[i:i + chunk]).all() for i in range(0, flat.size, chunk))


def cast_to_storage(name: str, array: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """Cast ``array`` to the storage dtype and reject anything not finite *after* the cast.

    A finite float64 such as 1e6 becomes inf in float16: that is rejected here, naming the original value.
    """
    with np.errstate(over="ignore", invalid="ignore"):
        cast = array.astype(dtype, copy=False)
    if not all_finite(cast):
        index, _ = first_nonfinite(cast)
        raise_not_storable(name, array[index], index, dtype, np.finfo(dtype).max)
    return cast


def raise_not_storable(name: str, original, index: tuple, storage, limit) -> None:
    """The ValueError for the element ``original`` at ``index`` of ``name`` that is not finite in ``storage``:
    non-finite itself, or finite but beyond the storage format's largest value ``limit``."""
    if np.isfinite(original):
        raise ValueError(f"{name}: expected values finite in {storage} storage (|x| <= {limit}), got {original} "
                         f"at index {index}")
    raise ValueError(f"{name}: expected finite values, got {original} at index {index}")
