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


def _signatures():
    """Every compiled signature of every jitted function of the engine's modules (none without the JIT)."""
    import sys

    from numba.core.registry import CPUDispatcher

    found = set()
    for name, module in list(sys.modules.items()):
        if name.split(".")[0] in ("decode", "kvcache"):
            for f in vars(module).values():
                if isinstance(f, CPUDispatcher):
                    found |= {(f.py_func.__qualname__, str(s)) for s in f.signatures}
    return found


def _frozen(x):
    x = np.array(x)
    x.flags.writeable = False
    return x


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "int8"])
def test_read_only_inputs_compile_nothing_new(dtype):
    """Read-only q / k / v (Ray's object store, `np.broadcast_to`, a memory map) through every writing call
    (`Decoder.step` / `extend` / `append`, `batch_step`, `batch_extend`, `KVCache.append` of one and of several
    tokens) store and return the writeable inputs' bits, and compile no new signature of any jitted function
    (numba types a read-only array apart: the input check and the pool's stores were compiled again)."""
    from decode import batch_extend, batch_step

    def calls(convert):
        rng = np.random.default_rng(29)
        cache = KVCache(num_kv_heads=2, head_dim=64, dtype=dtype, page_size=16, max_tokens=512)
        dec, other = Decoder.on_cache(cache, 4), Decoder.on_cache(cache, 4)
        q = rng.standard_normal((24, 4, 64)).astype(np.float32)
        k = rng.standard_normal((24, 2, 64)).astype(np.float32)
        v = rng.standard_normal((24, 2, 64)).astype(np.float32)
        q, k, v = convert(q), convert(k), convert(v)
        outs = [dec.extend(q[:20], k[:20], v[:20]), dec.step(q[20], k[20], v[20])]
        dec.append(k[:3], v[:3])
        outs.append(batch_step([dec, other], q[:2], k[:2], v[:2]))
        outs.append(batch_extend([dec, other], q[:6], k[:6], v[:6], [2, 4]))
        seq = cache.create_sequence()
        cache.append(seq, k[:5], v[:5])
        cache.append(seq, k[5:6], v[5:6])
        return outs, cache.fingerprint()

    expected = calls(np.array)
    before = _signatures()
    got = calls(_frozen)
    assert _signatures() == before
    assert got[1] == expected[1]
    for a, b in zip(got[0], expected[0]):
        assert np.array_equal(a, b)
