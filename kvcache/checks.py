"""Every argument check of `kvcache`: each error names the argument, what was expected and what was given.

The cache's operations call these before anything changes (and before any capacity check), so a failed call
leaves the cache as it was. What is here: integers and bounds (`check_int`), the storage format
(`check_storage_dtype`), K/V arrays (`check_kv`: float dtype, shape, then the pool's storage check), the cast to
a float storage dtype (`cast_to_storage`), token ids and namespaces, a transaction's counts and sequence lists,
the cache's constructor options. Not here: a snapshot file's own format (`kvcache.snapshot_checks`), state
errors of an object in the wrong state (an open transaction, a closed group: where that state lives).
"""
import numbers
from typing import Callable

import numpy as np

from . import bf16, quant
from .errors import ScaleOverflowError
from .jit_store import to_f16, writable

STORAGE_DTYPES = (np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64), np.dtype(np.int8))
BFLOAT16 = "bfloat16"              # no numpy dtype: the pool holds uint16 bits (`kvcache.bf16`)
STORAGE_NAMES = tuple(d.name for d in STORAGE_DTYPES) + (BFLOAT16,)

_F16, _F32 = np.dtype(np.float16), np.dtype(np.float32)


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


def check_pool_size(num_pages, max_tokens, page_size: int) -> int:
    """The number of pages from exactly one of ``num_pages`` / ``max_tokens`` (rounded up to whole pages of the
    checked ``page_size``)."""
    if (num_pages is None) == (max_tokens is None):
        raise ValueError(f"num_pages/max_tokens: expected exactly one of them, "
                         f"got num_pages={num_pages!r}, max_tokens={max_tokens!r}")
    if num_pages is None:
        return -(-check_int("max_tokens", max_tokens, minimum=1) // page_size)
    return check_int("num_pages", num_pages, minimum=1)


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
    if np.dtype(dtype) == _F16 and array.dtype == _F32:       # NumPy's cast, bit for bit, ~6x faster here
        cast, bad = to_f16(array)
        if not bad:
            return cast
    else:
        with np.errstate(over="ignore", invalid="ignore"):
            cast = array.astype(dtype, copy=False)
    if not all_finite(cast):
        index, _ = first_nonfinite(cast)
        raise_not_storable(name, array[index], index, dtype, np.finfo(dtype).max)
    return cast


def check_storable(cfg, name: str, x: np.ndarray) -> np.ndarray:
    """A float array ``x`` validated for the storage of a pool of layout ``cfg``: cast to the storage dtype
    (finite after the cast; bfloat16: its uint16 bits, `check_bf16_storable`), or for int8 checked finite and
    within `kvcache.quant.MAX_ABS` (`check_quantizable`) and returned as given (the write quantizes)."""
    if cfg.quantized:
        check_quantizable(name, x)
        return x
    if cfg.bfloat16:
        return check_bf16_storable(name, x)
    return cast_to_storage(name, x, cfg.dtype)


def check_quantizable(name: str, x: np.ndarray) -> None:
    """ValueError unless every element of ``x`` is finite; `ScaleOverflowError` (a ValueError) naming the first
    element with ``|x| > kvcache.quant.MAX_ABS`` (its group's float16 scale would overflow)."""
    limit = quant.MAX_ABS if float(np.finfo(x.dtype).max) > quant.MAX_ABS else np.inf   # float16 input: never
    with np.errstate(invalid="ignore"):
        bad = ~(np.abs(x) <= limit)                                     # NaN too
    if bad.any():
        index = tuple(int(i) for i in np.argwhere(bad)[0])
        value = x[index]
        if not np.isfinite(value):
            raise ValueError(f"{name}: expected finite values, got {value} at index {index}")
        raise ScaleOverflowError(
            f"{name}: expected |x| <= {quant.MAX_ABS:.0f} in int8 storage (a float16 scale per {quant.GROUP_SIZE} "
            f"values holds max|x| / {quant.QMAX} <= 65504), got {value} at index {index}")


def check_bf16_storable(name: str, x: np.ndarray) -> np.ndarray:
    """The bfloat16 bits of the float array ``x``; ValueError naming ``name``, the element and its value for a
    non-finite input or a finite one that rounds to inf in bfloat16 (``|x| >= bf16.OVERFLOW`` after float32)."""
    bits, bad = bf16.round_bits(x)
    if bad >= 0:                                                # inf or NaN after the rounding
        index = tuple(int(i) for i in np.unravel_index(bad, bits.shape))
        raise_not_storable(name, x[index], index, "bfloat16", f"{bf16.MAX:.8g}")
    return bits


def raise_not_storable(name: str, original, index: tuple, storage, limit) -> None:
    """The ValueError for the element ``original`` at ``index`` of ``name`` that is not finite in ``storage``:
    non-finite itself, or finite but beyond the storage format's largest value ``limit``."""
    if np.isfinite(original):
        raise ValueError(f"{name}: expected values finite in {storage} storage (|x| <= {limit}), got {original} "
                         f"at index {index}")
    raise ValueError(f"{name}: expected finite values, got {original} at index {index}")


def check_kv(cfg, storable, k, v, num_tokens: int | None = None, *, layered: bool = True):
    """K/V for a pool of layout ``cfg`` (`kvcache.config.CacheConfig`): real float arrays of the right shape,
    then ``storable(name, x)`` (the pool's storage check: cast, finite after it) on each.

    ``layered``: ``k [num_layers, T, num_kv_heads, head_dim]`` (``[T, ...]`` accepted for one layer); otherwise
    one layer's ``k [T, num_kv_heads, head_dim]``. ``v`` likewise with ``head_dim_v``. ``num_tokens``: the T
    expected (None: k's)."""
    k, v = writable(as_float_array("k", k)), writable(as_float_array("v", v))   # for the jitted stores
    if layered and k.ndim == 3 and cfg.num_layers == 1:
        k, v = k[None], v[None] if v.ndim == 3 else v
    lead, labels = ((cfg.num_layers,), "[num_layers, T, num_kv_heads, ") if layered else ((), "[T, num_kv_heads, ")
    if num_tokens is None:
        if k.ndim != len(lead) + 3:                    # no T to show: name it
            shape = ", ".join(map(str, lead + ("T", cfg.num_kv_heads, cfg.head_dim)))
            raise ValueError(f"k: expected shape {labels}head_dim] = ({shape}), got {k.shape}")
        num_tokens = k.shape[len(lead)]
    check_shape("k", k, lead + (num_tokens, cfg.num_kv_heads, cfg.head_dim), labels + "head_dim]")
    check_shape("v", v, lead + (num_tokens, cfg.num_kv_heads, cfg.head_dim_v), labels + "head_dim_v]")
    return storable("k", k), storable("v", v)


TOKEN_DTYPE = np.dtype("<i4")          # token ids as hashed and stored: int32 little-endian, 0 <= id < 2**31


def check_token_ids(name: str, token_ids, count: int | None = None) -> np.ndarray:
    """``token_ids`` as ``int32 [count]`` (1-D integers in ``[0, 2**31)``; ``count`` None: any length >= 1)."""
    array = np.asarray(token_ids)
    if count is None and array.size == 0:
        raise ValueError(f"{name}: expected at least one token id, got none")
    if array.dtype.kind not in "iu" and not (array.size == 0 and array.ndim == 1):
        raise TypeError(f"{name}: expected integer token ids, got dtype {array.dtype}")
    if array.ndim != 1:
        raise ValueError(f"{name}: expected a 1-D array of token ids, got shape {array.shape}")
    if count is not None and len(array) != count:
        raise ValueError(f"{name}: expected {count} token ids (one per appended token), got {len(array)}")
    if len(array) and (array.min() < 0 or array.max() > np.iinfo(np.int32).max):
        bad = array[(array < 0) | (array > np.iinfo(np.int32).max)][0]
        raise ValueError(f"{name}: expected token ids in [0, {np.iinfo(np.int32).max}], got {bad}")
    return array.astype(TOKEN_DTYPE, copy=False)


def check_token_ids_of(token_ids, num_tokens: dict[int, int]) -> dict:
    """``token_ids`` (None or ``{seq: ids}`` for some of ``num_tokens``' sequences) as ``{seq: int32 [count]}``."""
    if token_ids is None:
        return {}
    if not isinstance(token_ids, dict):
        raise TypeError(f"token_ids: expected a dict {{seq: token ids}}, got {type(token_ids).__name__}")
    checked = {}
    for seq, ids in token_ids.items():
        if seq not in num_tokens:
            raise ValueError(f"token_ids: expected keys among the transaction's sequences {sorted(num_tokens)}, "
                             f"got {seq!r}")
        checked[int(seq)] = check_token_ids(f"token_ids[{seq}]", ids, num_tokens[seq])
    return checked


def check_one_token_id(token_id) -> np.ndarray:
    """The id of one appended token (an int or ``[1]``) as ``int32 [1]``."""
    return check_token_ids("token_ids", np.atleast_1d(token_id), 1)


def check_token_id_each(token_ids, seqs: list[int]) -> list | None:
    """One token id per sequence of ``seqs``: None, or ``{seq: id}`` for some of them -> a list aligned with
    ``seqs`` of ``int32 [1]`` or None."""
    if token_ids is None:
        return None
    if not isinstance(token_ids, dict):
        raise TypeError(f"token_ids: expected a dict {{seq: token id}}, got {type(token_ids).__name__}")
    ids = check_token_ids_of({seq: np.atleast_1d(i) for seq, i in token_ids.items()}, dict.fromkeys(seqs, 1))
    return [ids.get(seq) for seq in seqs]


def check_namespace(name: str, namespace) -> str:
    if not isinstance(namespace, str):
        raise TypeError(f"{name}: expected a str, got {type(namespace).__name__} {namespace!r}")
    return namespace


def check_live_seq(seq, sequences: dict):
    """``sequences[seq]``: TypeError unless ``seq`` is an integer id (not bool), ValueError unless it is live."""
    if isinstance(seq, (bool, np.bool_)) or not isinstance(seq, (int, np.integer)):
        raise TypeError(f"seq: expected an integer sequence id, got {type(seq).__name__} {seq!r}")
    try:
        return sequences[int(seq)]
    except KeyError:
        raise ValueError(f"seq: expected a live sequence id {sorted(sequences)}, got {seq} "
                         f"(freed or never created)") from None


def check_one_of(name: str, value, options: list, what: str) -> int:
    """The index of ``value`` in ``options`` (ValueError naming ``what`` they are otherwise)."""
    try:
        return options.index(value)
    except ValueError:
        raise ValueError(f"{name}: expected one of {what} {options}, got {value!r}") from None


def check_counts(num_tokens: dict, lookup: Callable) -> dict[int, int]:
    """``{seq: count}`` with live ids (``lookup(seq)`` raises the named error of a bad one) and counts >= 0."""
    checked = {}
    for seq, count in num_tokens.items():
        lookup(seq)
        checked[int(seq)] = check_int(f"num_tokens[{seq}]", count)
    return checked


def check_seq_list(name: str, seqs, lookup: Callable) -> list[int]:
    """A non-empty list (or tuple) of distinct live sequence ids (``lookup(seq)`` raises for a bad one)."""
    if not isinstance(seqs, (list, tuple)) or not seqs:
        raise TypeError(f"{name}: expected a non-empty list of sequence ids, got {seqs!r}")
    if not all(type(seq) is int for seq in seqs):       # plain ints: the reservation looks them up
        for seq in seqs:
            lookup(seq)                                 # names a bad id
    if len(set(seqs)) != len(seqs):
        raise ValueError(f"{name}: expected distinct sequence ids, got {list(seqs)}")
    return [int(seq) for seq in seqs]


def check_cache_options(prefix_caching, namespace, prefix_salt) -> str:
    """`KVCache`'s own options (the pool's layout is `CacheConfig.build`'s); returns the namespace."""
    if not isinstance(prefix_caching, (bool, np.bool_)):
        raise TypeError(f"prefix_caching: expected a bool, got {type(prefix_caching).__name__} {prefix_caching!r}")
    namespace = check_namespace("namespace", namespace)
    if prefix_salt is not None and (not isinstance(prefix_salt, bytes) or len(prefix_salt) < 8):
        raise TypeError(f"prefix_salt: expected None or bytes of length >= 8, got {prefix_salt!r}")
    return namespace


def check_instance(name: str, value, cls: type, what: str, *, none_ok: bool = False):
    """``value`` if it is a ``cls`` (or None with ``none_ok``); TypeError saying ``what`` was expected."""
    if not (isinstance(value, cls) or (none_ok and value is None)):
        raise TypeError(f"{name}: expected {what}, got {type(value).__name__}")
    return value


def check_ids_among(name: str, ids, known: set[int]) -> set[int]:
    """``ids`` (an iterable of integers) as a set, every one of them in ``known``."""
    checked = {check_int(f"{name}[]", seq) for seq in ids}
    if not checked <= known:
        raise ValueError(f"{name}: expected ids among the snapshot's {sorted(known)}, got {sorted(checked - known)} "
                         f"not in it")
    return checked
