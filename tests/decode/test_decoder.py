"""The `Decoder` contract against the float64 reference (reference.dense.decode_reference).

Tolerances (atol + rtol * |ref|), against the reference run on the K/V as stored (rounded to the storage dtype):
float64 storage 1e-13 + 1e-13; float32 and float16 storage (float32 scores and accumulation) 2e-6 + 2e-5.
"""
import numpy as np
import pytest

from decode import Decoder, batch_step
from kvcache import CacheFullError, KVCache
from reference.dense import decode_reference

TOL = {"float64": (1e-13, 1e-13), "float32": (2e-6, 2e-5), "float16": (2e-6, 2e-5)}


def assert_close(got, ref, dtype):
    atol, rtol = TOL[dtype]
    err = np.abs(got - ref)
    bound = atol + rtol * np.abs(ref)
    assert (err <= bound).all(), f"max excess {np.max(err - bound):.3g}, max err {err.max():.3g}"


def make(dtype="float32", **kw):
    args = dict(num_q_heads=4, num_kv_heads=2, head_dim=8, head_dim_v=None, dtype=dtype, page_size=4,
                max_tokens=64)
    args.update(kw)
    return Decoder(**args)


def tokens(rng, count, dec, heads=None):
    cfg = dec.config
    q = rng.standard_normal((count, heads or dec.num_q_heads, cfg.head_dim))
    k = rng.standard_normal((count, cfg.num_kv_heads, cfg.head_dim))
    v = rng.standard_normal((count, cfg.num_kv_heads, cfg.head_dim_v))
    return q, k, v


def stored(x, dtype):
    return np.asarray(x).astype(dtype).astype(np.float64)


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
@pytest.mark.parametrize("num_q_heads,num_kv_heads,head_dim_v", [(4, 4, 8), (4, 2, 3), (8, 1, 5)])
def test_step_by_step_matches_reference(dtype, num_q_heads, num_kv_heads, head_dim_v):
    rng = np.random.default_rng(7)
    dec = make(dtype, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim_v=head_dim_v)
    q, k, v = tokens(rng, 11, dec)
    outs = np.array([dec.step(q[i], k[i], v[i]) for i in range(11)])
    assert outs.dtype == (np.float64 if dtype == "float64" else np.float32)
    assert dec.length == 11
    ref = decode_reference(q, stored(k, dtype), stored(v, dtype), 0)
    assert_close(outs, ref, dtype)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_extend_after_append_matches_reference(dtype):
    rng = np.random.default_rng(3)
    dec = make(dtype)
    q, k, v = tokens(rng, 13, dec)
    dec.append(k[:6], v[:6])
    out = dec.extend(q[6:], k[6:], v[6:])
    assert out.shape == (7, 4, 8)
    assert_close(out, decode_reference(q[6:], stored(k, dtype), stored(v, dtype), 6), dtype)


def test_step_equals_extend_of_one():
    rng = np.random.default_rng(4)
    a, b = make(), make()
    q, k, v = tokens(rng, 9, a)
    for i in range(9):
        np.testing.assert_array_equal(a.step(q[i], k[i], v[i]), b.extend(q[i:i + 1], k[i:i + 1], v[i:i + 1])[0])


def test_custom_scale():
    rng = np.random.default_rng(5)
    dec = make("float64", scale=0.3)
    q, k, v = tokens(rng, 5, dec)
    assert_close(dec.extend(q, k, v), decode_reference(q, k, v, 0, scale=0.3), "float64")


def test_fork_and_diverge_equals_two_fresh_decoders():
    rng = np.random.default_rng(6)
    parent = make("float64")
    q, k, v = tokens(rng, 7, parent)                 # 7 tokens: the last page (size 4) is partly filled
    parent.append(k, v)
    child = parent.fork()
    tails = [tokens(rng, 3, parent) for _ in range(2)]
    for dec, (tq, tk, tv) in zip((parent, child), tails):
        fresh = make("float64")
        fresh.append(k, v)
        np.testing.assert_array_equal(dec.extend(tq, tk, tv), fresh.extend(tq, tk, tv))
        np.testing.assert_array_equal(dec.kv()[0], fresh.kv()[0])
    parent.cache.check_invariants()


def test_truncate_then_reappend_equals_fresh():
    rng = np.random.default_rng(8)
    dec = make("float64")
    q, k, v = tokens(rng, 10, dec)
    dec.append(k, v)
    dec.truncate(5)
    assert dec.length == 5
    q2, k2, v2 = tokens(rng, 4, dec)
    fresh = make("float64")
    fresh.append(k[:5], v[:5])
    np.testing.assert_array_equal(dec.extend(q2, k2, v2), fresh.extend(q2, k2, v2))
    dec.cache.check_invariants()


def test_kv_returns_storage_dtype_copies():
    rng = np.random.default_rng(9)
    dec = make("float16")
    _, k, v = tokens(rng, 5, dec)
    dec.append(k, v)
    K, V = dec.kv()
    assert K.dtype == np.float16 and K.shape == (5, 2, 8)
    np.testing.assert_array_equal(K, k.astype(np.float16))
    np.testing.assert_array_equal(V, v.astype(np.float16))


# -- failures change nothing --------------------------------------------------------------------------------

def failing_calls(dec, rng):
    q, k, v = tokens(rng, 1, dec)
    nan_k = k[0].copy(); nan_k[1, 2] = np.nan
    inf_q = q[0].copy(); inf_q[-1, -1] = np.inf
    return [
        (ValueError, "k", lambda: dec.step(q[0], nan_k, v[0])),
        (ValueError, "q", lambda: dec.step(inf_q, k[0], v[0])),
        (ValueError, "k", lambda: dec.step(q[0], k[0][:, :5], v[0])),
        (ValueError, "q", lambda: dec.step(q[0][:3], k[0], v[0])),
        (TypeError, "q", lambda: dec.step(q[0].astype(int), k[0], v[0])),
        (TypeError, "v", lambda: dec.step(q[0], k[0], v[0].astype(complex))),
        (ValueError, "q", lambda: dec.extend(q[:, :3], k, v)),
        (ValueError, "n", lambda: dec.truncate(dec.length + 1)),
        (TypeError, "n", lambda: dec.truncate(True)),
        (ValueError, "k", lambda: dec.append(k[0], v[0])),
    ]


@pytest.mark.parametrize("index", range(10))
def test_failed_call_leaves_cache_byte_identical(index):
    rng = np.random.default_rng(10)
    dec = make("float32")
    _, k, v = tokens(rng, 6, dec)
    dec.append(k, v)
    before = dec.cache.fingerprint()
    error, name, call = failing_calls(dec, rng)[index]
    with pytest.raises(error) as info:
        call()
    assert str(info.value).startswith(f"{name}:") and "expected" in str(info.value) and "got" in str(info.value)
    assert dec.cache.fingerprint() == before


def test_float16_overflow_rejected():
    dec = make("float16")
    k = np.ones((2, 8)); k[0, 0] = 1e6
    before = dec.cache.fingerprint()
    with pytest.raises(ValueError, match="float16"):
        dec.step(np.ones((4, 8)), k, np.ones((2, 8)))
    assert dec.length == 0 and dec.cache.fingerprint() == before


def test_full_pool_raises_and_freeing_makes_it_fit():
    rng = np.random.default_rng(11)
    cache = KVCache(num_kv_heads=2, head_dim=8, page_size=4, num_pages=3)
    a, b = Decoder.on_cache(cache, 4), Decoder.on_cache(cache, 4)
    _, k, v = tokens(rng, 8, a)
    a.append(k, v)
    q1, k1, v1 = tokens(rng, 5, b)
    before = cache.fingerprint()
    with pytest.raises(CacheFullError) as info:
        b.extend(q1, k1, v1)
    assert info.value.could_ever_fit and info.value.pages_needed == 2 and info.value.pages_free == 1
    assert cache.fingerprint() == before
    a.free()
    assert b.extend(q1, k1, v1).shape == (5, 4, 8)


@pytest.mark.parametrize("call,bad", [(c, b) for c in ("extend", "append", "step", "batch_step", "batch_extend")
                                      for b in "qkv" if (c, b) != ("append", "q")])
def test_bad_input_on_a_full_pool_is_named_before_capacity(call, bad):
    """Every input is validated before a slot is reserved: a NaN on a full pool is the ValueError naming the
    NaN (not CacheFullError), and the cache is byte for byte unchanged."""
    from decode import batch_extend
    rng = np.random.default_rng(13)
    cache = KVCache(num_kv_heads=2, head_dim=8, page_size=4, num_pages=2)
    a, b = Decoder.on_cache(cache, 4), Decoder.on_cache(cache, 4)
    _, k, v = tokens(rng, 8, a)
    a.append(k, v)                                        # the pool is full: any new token would not fit
    count = 1 if call in ("step", "batch_step") else 3
    q, k, v = tokens(rng, count, b)
    {"q": q, "k": k, "v": v}[bad][count - 1, 1, 2] = np.nan
    before = cache.fingerprint()
    with pytest.raises(ValueError, match=rf"^{bad}(\[0\])?: expected finite values, got nan"):
        if call == "extend":
            b.extend(q, k, v)
        elif call == "append":
            b.append(k, v)
        elif call == "step":
            b.step(q[0], k[0], v[0])
        elif call == "batch_step":
            batch_step([b], q, k, v)
        else:
            batch_extend([b], [q], [k], [v])
    assert cache.fingerprint() == before and b.length == 0
    with pytest.raises(CacheFullError):                   # the same call with clean input: the pool is full
        b.extend(*tokens(rng, 3, b))
    assert cache.fingerprint() == before


# -- sliding window ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("window", [1, 3, 4, 9])
def test_sliding_window_matches_reference_and_releases_pages(window):
    rng = np.random.default_rng(12)
    dec = make("float64", window=window, max_tokens=16)       # 4 pages: without release 30 tokens cannot fit
    q, k, v = tokens(rng, 30, dec)
    outs = np.array([dec.step(q[i], k[i], v[i]) for i in range(30)])
    assert_close(outs, decode_reference(q, k, v, 0, window=window), "float64")
    held = dec.config.num_pages - dec.cache.num_free_pages
    assert held <= -(-window // 4) + 1
    dec.cache.check_invariants()


def test_window_truncate_before_released_positions_is_rejected():
    rng = np.random.default_rng(13)
    dec = make("float64", window=2, max_tokens=32)
    q, k, v = tokens(rng, 12, dec)
    dec.extend(q, k, v)
    first = dec.cache.pool.first_position(dec.seq)
    assert first > 0
    before = dec.cache.fingerprint()
    with pytest.raises(ValueError, match="n: expected >="):
        dec.truncate(first)
    assert dec.cache.fingerprint() == before
    dec.truncate(11)
    q2, k2, v2 = tokens(rng, 1, dec)
    K = np.concatenate([k[:11], k2]); V = np.concatenate([v[:11], v2])
    assert_close(dec.extend(q2, k2, v2), decode_reference(q2, K, V, 11, window=2), "float64")


# -- shared pool: batched step and layer-by-layer transactions ----------------------------------------------

def test_batch_step_matches_individual_decoders():
    rng = np.random.default_rng(14)
    cache = KVCache(num_kv_heads=2, head_dim=8, page_size=4, num_pages=40, dtype="float64")
    decs = [Decoder.on_cache(cache, 4) for _ in range(5)]
    history = []
    for i, d in enumerate(decs):
        _, k, v = tokens(rng, 3 * i + 1, d)
        d.append(k, v)
        history.append((k, v))
    q, k, v = tokens(rng, 5, decs[0])
    out = batch_step(decs, q, k, v)
    for i, d in enumerate(decs):
        K = np.concatenate([history[i][0], k[i:i + 1]]); V = np.concatenate([history[i][1], v[i:i + 1]])
        assert_close(out[i:i + 1], decode_reference(q[i:i + 1], K, V, len(K) - 1), "float64")
        assert d.length == len(K)
    cache.check_invariants()


def test_batch_step_failure_changes_nothing():
    rng = np.random.default_rng(15)
    cache = KVCache(num_kv_heads=2, head_dim=8, page_size=4, num_pages=8)
    decs = [Decoder.on_cache(cache, 4) for _ in range(3)]
    q, k, v = tokens(rng, 3, decs[0])
    v[2, 0, 0] = np.nan
    before = cache.fingerprint()
    with pytest.raises(ValueError, match="^v:"):
        batch_step(decs, q, k, v)
    assert cache.fingerprint() == before
    with pytest.raises(ValueError, match="distinct"):
        batch_step([decs[0], decs[0]], q[:2], k[:2], v[:2])


def test_multi_layer_transaction_matches_reference_per_layer():
    rng = np.random.default_rng(16)
    layers = 3
    dec = make("float64", num_layers=layers)
    Ks, Vs = [[] for _ in range(layers)], [[] for _ in range(layers)]
    for t in range(6):
        with dec.transaction(1) as tx:
            for layer in range(layers):
                q, k, v = tokens(rng, 1, dec)
                Ks[layer].append(k); Vs[layer].append(v)
                out = tx.step(layer, q[0], k[0], v[0])
                K, V = np.concatenate(Ks[layer]), np.concatenate(Vs[layer])
                assert_close(out[None], decode_reference(q, K, V, t), "float64")
        assert dec.length == t + 1
    for layer in range(layers):
        np.testing.assert_array_equal(dec.kv(layer)[0], np.concatenate(Ks[layer]))


def test_multi_layer_transaction_failing_midway_changes_nothing():
    rng = np.random.default_rng(17)
    dec = make("float32", num_layers=3)
    with dec.transaction(2) as tx:
        for layer in range(3):
            q, k, v = tokens(rng, 2, dec)
            tx.extend(layer, q, k, v)
    before = dec.cache.fingerprint()
    with pytest.raises(ValueError, match="^k:"):
        with dec.transaction(1) as tx:
            for layer in range(3):
                q, k, v = tokens(rng, 1, dec)
                if layer == 2:
                    k[0, 0, 0] = np.nan
                tx.step(layer, q[0], k[0], v[0])
    assert dec.cache.fingerprint() == before and dec.length == 2
    with pytest.raises(ValueError, match="every layer"):
        with dec.transaction(1) as tx:
            q, k, v = tokens(rng, 1, dec)
            tx.step(0, q[0], k[0], v[0])
    assert dec.cache.fingerprint() == before


def test_constructor_errors_name_the_argument():
    with pytest.raises(ValueError, match="num_q_heads: expected a multiple of num_kv_heads=2, got 3"):
        make(num_q_heads=3)
    with pytest.raises(TypeError, match="dtype"):
        make(dtype="int16")
    with pytest.raises(ValueError, match="page_size"):
        make(page_size=0)
    with pytest.raises(ValueError, match="scale"):
        make(scale=-1.0)
    with pytest.raises(ValueError, match="window"):
        make(window=0)


def test_tx_step_inside_a_multi_token_transaction_is_rejected_and_changes_nothing():
    dec = make("float32", num_layers=2)
    before = dec.cache.fingerprint()
    with pytest.raises(ValueError, match="^q: expected shape"):
        with dec.transaction(2) as tx:                       # step is one token per decoder: use extend here
            tx.step(0, np.ones((4, 8)), np.ones((2, 8)), np.ones((2, 8)))
    assert dec.cache.fingerprint() == before and dec.length == 0
