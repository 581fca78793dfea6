"""The one-pass input check of a multi-token call (`decode.inputs.InputChecks.tokens`: extend, prefill, append
and the ragged batch): it takes what the per-array checks took, refuses what they refused with the same named
error and leaves the cache byte for byte unchanged, and the write casts what it let through exactly as the
per-array casts did (float16: NumPy's rounding, bit for bit; bfloat16: nearest-even bits)."""
import importlib.util
from pathlib import Path

import numpy as np
import pytest

from decode import Decoder
from kvcache import KVCache

_spec = importlib.util.spec_from_file_location("decode_kernel_naive_inputs", Path(__file__).with_name("naive.py"))
naive = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(naive)

EDGES = np.array([0.0, -0.0, 65504.0, 65519.996, -65519.996, 2 ** -24, 2 ** -25, 3 * 2 ** -26, 1.0 + 2 ** -11,
                  1.0 + 3 * 2 ** -11, 1e-30, 6e4], dtype=np.float32)


def _decoder(dtype, tokens=40):
    cache = KVCache(num_kv_heads=2, head_dim=8, dtype=dtype, page_size=4, max_tokens=tokens + 8)
    return cache, Decoder.on_cache(cache, 4)


def _inputs(rng, T, input_dtype=np.float32):
    x = rng.standard_normal((3, T, 2, 8)) * 10.0 ** rng.integers(-6, 4, (3, T, 2, 8))
    x.reshape(-1)[: EDGES.size] = EDGES
    q = rng.standard_normal((T, 4, 8)).astype(input_dtype)
    return q, x[1].astype(input_dtype), x[2][:, :, ::-1].astype(input_dtype)      # v: a non-contiguous view


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("input_dtype", [np.float32, np.float64])
def test_extend_and_append_store_the_per_array_casts(dtype, input_dtype):
    rng = np.random.default_rng(11)
    cache, dec = _decoder(dtype)
    q, k, v = _inputs(rng, 21, input_dtype)
    dec.extend(q, k, v)
    q2, k2, v2 = _inputs(rng, 6, input_dtype)
    dec.append(k2, v2)
    gk, gv = cache.gather(dec.seq)
    for got, want in ((gk, np.concatenate([k, k2])), (gv, np.concatenate([v, v2]))):
        if dtype == "bfloat16":
            assert (naive.bf16_bits(got) == naive.bf16_bits(want)).all()   # widened bits: the stored ones, exactly
        else:
            assert (np.asarray(got, dtype) == want.astype(dtype)).all()
    assert dec.length == 27


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("name, index, value, match", [
    ("k", (3, 1, 5), np.nan, r"k: expected finite values, got nan at index \(3, 1, 5\)"),
    ("v", (20, 0, 0), np.inf, r"v: expected finite values, got inf at index \(20, 0, 0\)"),
    ("q", (7, 2, 1), np.nan, r"q: expected finite values, got nan at index \(7, 2, 1\)"),
    ("k", (9, 0, 3), 65520.0, r"k: expected .*65520"),
])
def test_bad_input_is_named_and_changes_nothing(dtype, name, index, value, match):
    if value == 65520.0 and dtype != "float16":
        value, match = 3e38, r"k: expected \|x\| < "          # finite in float32 / bfloat16: the magnitude limit
    rng = np.random.default_rng(12)
    cache, dec = _decoder(dtype)
    dec.extend(*_inputs(rng, 5))
    before = cache.fingerprint()
    q, k, v = (x.copy() for x in _inputs(rng, 21))
    {"q": q, "k": k, "v": v}[name][index] = value
    with pytest.raises(ValueError, match=match):
        dec.extend(q, k, v)
    if name != "q":
        with pytest.raises(ValueError, match=match):
            dec.append(k, v)
    assert cache.fingerprint() == before and dec.length == 5
