"""`Decoder(dtype="int8")`: every path (step, extend, append, transactions, batch_step, fork, truncate, sliding
window) against the float64 reference run on the dequantized K/V the cache holds (`Decoder.kv`), and every
failure (non-finite input, a scale overflow, a full pool) leaving the pool byte for byte as it was.

Tolerance: 2e-6 + 2e-5 * |ref| (that of float32 / float16 storage: float32 scores and accumulation).
"""
import numpy as np
import pytest

from decode import Decoder, batch_step
from kvcache import CacheFullError, ScaleOverflowError, quant
from reference.dense import decode_reference

ATOL, RTOL = 2e-6, 2e-5


def assert_close(got, ref):
    err = np.abs(got - ref)
    bound = ATOL + RTOL * np.abs(ref)
    assert (err <= bound).all(), f"max excess {np.max(err - bound):.3g}, max err {err.max():.3g}"


def make(**kw):
    args = dict(num_q_heads=4, num_kv_heads=2, head_dim=40, head_dim_v=None, dtype="int8", page_size=4,
                max_tokens=64)
    args.update(kw)
    return Decoder(**args)


def tokens(rng, count, dec, scale=1.0):
    cfg = dec.config
    return (rng.standard_normal((count, dec.num_q_heads, cfg.head_dim)),
            rng.standard_normal((count, cfg.num_kv_heads, cfg.head_dim)) * scale,
            rng.standard_normal((count, cfg.num_kv_heads, cfg.head_dim_v)) * scale)


def dequantized(x):
    return quant.dequantize(*quant.quantize(np.asarray(x, dtype=np.float64)), np.float64)


@pytest.mark.parametrize("num_q_heads,num_kv_heads,head_dim,head_dim_v", [(4, 4, 32, 32), (4, 2, 40, 33),
                                                                         (8, 1, 64, 5), (8, 2, 128, 128)])
def test_step_by_step_matches_reference_on_the_dequantized_kv(num_q_heads, num_kv_heads, head_dim, head_dim_v):
    rng = np.random.default_rng(1)
    dec = make(num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, head_dim_v=head_dim_v)
    q, k, v = tokens(rng, 11, dec)
    outs = np.array([dec.step(q[i].astype(np.float32), k[i].astype(np.float32), v[i]) for i in range(11)])
    assert outs.dtype == np.float32 and dec.length == 11
    K, V = dec.kv()
    assert K.dtype == V.dtype == np.float32
    np.testing.assert_array_equal(K, dequantized(k))            # each row quantized on its own, on write
    np.testing.assert_array_equal(V, dequantized(v))
    assert_close(outs, decode_reference(q, K.astype(np.float64), V.astype(np.float64), 0))


def test_extend_append_and_step_paths_store_the_same_bytes_and_agree():
    rng = np.random.default_rng(2)
    q, k, v = tokens(rng, 13, make())
    a, b = make(), make()
    a.append(k[:5], v[:5])
    out_a = a.extend(q[5:], k[5:], v[5:])
    steps = [b.step(q[i], k[i], v[i]) for i in range(13)]
    assert a.cache.fingerprint() == b.cache.fingerprint()      # values, scales and metadata
    K, V = a.kv()
    assert_close(out_a, decode_reference(q[5:], K.astype(np.float64), V.astype(np.float64), 5))
    assert_close(np.array(steps[5:]), out_a)


def test_fork_truncate_and_window():
    rng = np.random.default_rng(3)
    q, k, v = tokens(rng, 30, make(max_tokens=128), scale=3.0)
    parent = make(max_tokens=128)
    parent.append(k[:10], v[:10])
    child = parent.fork()
    out_c = child.extend(q[10:14], k[10:14], v[10:14])              # copy-on-write of the shared tail page
    out_p = parent.extend(q[10:12], k[14:16], v[14:16])
    Kc, Vc = child.kv()
    Kp, Vp = parent.kv()
    np.testing.assert_array_equal(Kc[:10], Kp[:10])
    assert_close(out_c, decode_reference(q[10:14], Kc.astype(np.float64), Vc.astype(np.float64), 10))
    assert_close(out_p, decode_reference(q[10:12], Kp.astype(np.float64), Vp.astype(np.float64), 10))
    child.truncate(3)
    again = child.extend(q[3:6], k[20:23], v[20:23])
    fresh = make(max_tokens=128)
    fresh.append(k[:3], v[:3])
    assert again.tobytes() == fresh.extend(q[3:6], k[20:23], v[20:23]).tobytes()

    win = make(window=6, max_tokens=128)
    outs = np.array([win.step(q[i], k[i], v[i]) for i in range(30)])
    assert win.cache.pool.first_position(win.seq) > 0
    full = make(max_tokens=128)
    full.append(k, v)
    K, V = full.kv()
    assert_close(outs, decode_reference(q, K.astype(np.float64), V.astype(np.float64), 0, window=6))


def test_batch_step_and_multi_layer_transaction():
    rng = np.random.default_rng(4)
    base = make(max_tokens=256)
    decs = [Decoder.on_cache(base.cache, 4) for _ in range(3)]
    for i, d in enumerate(decs):
        d.append(*tokens(rng, 3 + 5 * i, d)[1:])
    q, k, v = tokens(rng, 3, base)
    out = batch_step(decs, q, k, v)
    for i, d in enumerate(decs):
        K, V = d.kv()
        assert_close(out[i], decode_reference(q[i:i + 1], K.astype(np.float64), V.astype(np.float64),
                                              d.length - 1)[0])

    dec = make(num_layers=3)
    outs, queries = [], []
    for step in range(6):
        with dec.transaction(1) as tx:
            for layer in range(3):
                q, k, v = tokens(rng, 1, dec, scale=10.0 ** (layer - 1))
                outs.append(tx.step(layer, q[0], k[0], v[0]))
                queries.append(q[0])
    assert dec.length == 6
    for layer in range(3):
        K, V = (x.astype(np.float64) for x in dec.kv(layer))
        q = np.array(queries[layer::3])
        assert_close(np.array(outs[layer::3]), decode_reference(q, K, V, 0))


@pytest.mark.parametrize("where, value, error, match", [
    ("k", 1e7, ScaleOverflowError, r"^k: expected \|x\| <= 8319008 in int8 storage"),
    ("v", -2e7, ScaleOverflowError, r"^v: expected \|x\| <= 8319008 in int8 storage"),
    ("k", np.nan, ValueError, "^k: expected finite values, got nan"),
    ("v", np.inf, ValueError, "^v: expected finite values, got inf"),
])
@pytest.mark.parametrize("path", ["step", "step_float32", "extend", "append", "batch_step"])
def test_bad_input_changes_nothing(where, value, error, match, path):
    rng = np.random.default_rng(5)
    dec = make()
    dec.append(*tokens(rng, 4, dec)[1:])                  # the next token lands in a fresh page
    before = dec.cache.fingerprint()
    q, k, v = tokens(rng, 2, dec)
    (k if where == "k" else v)[-1, 1, 7] = value
    with pytest.raises(error, match=match):
        if path == "step":
            dec.step(q[-1], k[-1], v[-1])
        elif path == "step_float32":                       # the jitted check's limit
            dec.step(q[-1].astype(np.float32), k[-1].astype(np.float32), v[-1].astype(np.float32))
        elif path == "extend":
            dec.extend(q, k, v)
        elif path == "append":
            dec.append(k, v)
        else:
            other = Decoder.on_cache(dec.cache, 4)
            before = dec.cache.fingerprint()
            batch_step([dec, other], q, k, v)
    assert dec.cache.fingerprint() == before


def test_largest_accepted_value_and_full_pool():
    rng = np.random.default_rng(6)
    dec = make(max_tokens=8)
    q, k, v = tokens(rng, 9, dec)
    k[0, 0, 0] = quant.MAX_ABS                              # accepted: its scale is exactly 65504
    dec.step(q[0].astype(np.float32), k[0].astype(np.float32), v[0])
    assert float(dec.cache.pool.k_scales()[dec.cache.pool.page_table(dec.seq)[0], 0, 0, 0]) == 65504.0
    dec.append(k[1:8], v[1:8])
    before = dec.cache.fingerprint()
    with pytest.raises(CacheFullError):
        dec.step(q[8], k[8], v[8])
    assert dec.cache.fingerprint() == before
