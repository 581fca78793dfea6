"""The `Decoder` contract at bfloat16 storage, beside float16 (the other 16-bit format: the same tests on both):
outputs against a float64 oracle on the stored K/V, metamorphic relations that hold bit for bit, batch == loop,
failed calls and injected faults change nothing, snapshots and prefix caching continue where the original would.
"""
import numpy as np
import pytest

from decode import Decoder, batch_extend, batch_step
from kvcache import CacheFullError, KVCache, bf16
from kvcache.faults import no_fault
from kvcache.testing import FaultInjector, InjectedFault, set_fault_hook

DTYPES = ["float16", "bfloat16"]


def stored(x, dtype):
    """What the pool keeps of ``x``, as float64."""
    x = np.asarray(x)
    if dtype == "bfloat16":
        return bf16.to_float32(bf16.to_bits(x)).astype(np.float64)
    return x.astype(dtype).astype(np.float64)


def attend(q, K, V, start, scale, dtype=np.float64):
    """q [T, Hq, D]; K [L, Hkv, D]; V [L, Hkv, Dv]; query t at position start + t, in ``dtype`` throughout."""
    q, K, V = (np.asarray(a, dtype) for a in (q, K, V))
    T, Hq, _ = q.shape
    g = Hq // K.shape[1]
    out = np.empty((T, Hq, V.shape[2]), dtype)
    for t in range(T):
        for h in range(Hq):
            s = K[: start + t + 1, h // g] @ q[t, h] * dtype(scale)
            w = np.exp(s - s.max())
            out[t, h] = (w / w.sum()) @ V[: start + t + 1, h // g]
    return out


def assert_within_budget(got, q, K, V, start, scale):
    """The accuracy rule on the stored K/V: within 1e-6 + 3 x the plain NumPy float32 error."""
    exact = attend(q, K, V, start, scale)
    budget = 1e-6 + 3 * np.abs(attend(q, K, V, start, scale, np.float32) - exact).max()
    assert np.abs(got - exact).max() <= budget


def make(dtype, **kw):
    args = dict(num_q_heads=4, num_kv_heads=2, head_dim=8, head_dim_v=6, dtype=dtype, page_size=4, max_tokens=64)
    args.update(kw)
    return Decoder(**args)


def draw(rng, T, hq=4, hkv=2, d=8, dv=6, lead=()):
    return (rng.standard_normal(lead + (T, hq, d)).astype(np.float32),
            rng.standard_normal(lead + (T, hkv, d)).astype(np.float32),
            rng.standard_normal(lead + (T, hkv, dv)).astype(np.float32))


@pytest.mark.parametrize("dtype", DTYPES)
def test_step_extend_append_truncate_fork_against_the_oracle(dtype):
    rng = np.random.default_rng(1)
    dec = make(dtype)
    scale = 8 ** -0.5
    q, k, v = draw(rng, 12)
    dec.append(k[:5], v[:5])
    out = dec.extend(q[5:9], k[5:9], v[5:9])
    assert out.dtype == np.float32 and out.shape == (4, 4, 6)
    K, V = stored(k, dtype), stored(v, dtype)
    assert_within_budget(out, q[5:9], K[:9], V[:9], 5, scale)
    Kc, Vc = dec.kv()
    assert Kc.dtype == (np.float32 if dtype == "bfloat16" else np.float16)       # bfloat16 widened, exact
    assert (Kc.astype(np.float64) == K[:9]).all() and (Vc.astype(np.float64) == V[:9]).all()
    dec.truncate(6)
    child = dec.fork()
    got = child.step(q[9], k[9], v[9])
    K2, V2 = np.concatenate([K[:6], K[9:10]]), np.concatenate([V[:6], V[9:10]])
    assert_within_budget(got[None], q[9:10], K2, V2, 6, scale)
    got = dec.step(q[10], k[10], v[10])
    K3, V3 = np.concatenate([K[:6], K[10:11]]), np.concatenate([V[:6], V[10:11]])
    assert_within_budget(got[None], q[10:11], K3, V3, 6, scale)
    assert dec.length == child.length == 7


@pytest.mark.parametrize("dtype", DTYPES)
def test_metamorphic_relations_hold_bit_for_bit(dtype):
    """Scaling k by 2 and q by 1/2 leaves every score (so every output bit) as it was; scaling v by 2 doubles
    every output bit for bit (powers of two are exact in both 16-bit formats, away from their range ends)."""
    rng = np.random.default_rng(2)
    q, k, v = draw(rng, 11)
    base, scaled_qk, scaled_v = make(dtype), make(dtype), make(dtype)
    outs = [base.extend(q, k, v), scaled_qk.extend(q * 0.5, k * 2, v), scaled_v.extend(q, k, v * 2)]
    assert outs[1].tobytes() == outs[0].tobytes()
    assert (outs[2] / 2).tobytes() == outs[0].tobytes()
    q1, k1, v1 = draw(rng, 1)
    steps = [base.step(q1[0], k1[0], v1[0]), scaled_qk.step(q1[0] * 0.5, k1[0] * 2, v1[0]),
             scaled_v.step(q1[0], k1[0], v1[0] * 2)]
    assert steps[1].tobytes() == steps[0].tobytes() and (steps[2] / 2).tobytes() == steps[0].tobytes()


@pytest.mark.parametrize("dtype", DTYPES)
def test_batch_step_and_batch_extend_equal_loops(dtype):
    rng = np.random.default_rng(3)
    pools = []
    for _ in range(2):
        cache = KVCache(num_kv_heads=2, head_dim=8, head_dim_v=6, page_size=4, num_pages=64, dtype=dtype)
        pools.append((cache, [Decoder.on_cache(cache, 4) for _ in range(3)]))
    history = [draw(rng, n) for n in (3, 8, 5)]
    for cache, decs in pools:
        for dec, (_, k, v) in zip(decs, history):
            dec.append(k, v)
    (c1, batch), (c2, loop) = pools
    q, k, v = (x[:, 0] for x in draw(rng, 1, lead=(3,)))
    out = batch_step(batch, q, k, v)
    ref = np.stack([d.step(q[b], k[b], v[b]) for b, d in enumerate(loop)])
    np.testing.assert_allclose(out, ref, rtol=0, atol=2e-6)
    assert c1.fingerprint() == c2.fingerprint()
    news = [draw(rng, n) for n in (4, 1, 6)]
    outs = batch_extend(batch, [x[0] for x in news], [x[1] for x in news], [x[2] for x in news])
    for o, d, (qb, kb, vb) in zip(outs, loop, news):
        np.testing.assert_allclose(o, d.extend(qb, kb, vb), rtol=0, atol=2e-6)
    assert c1.fingerprint() == c2.fingerprint()
    for d in batch:                                              # and against the oracle
        qd, kd, vd = draw(rng, 1)
        out = d.step(qd[0], kd[0], vd[0])
        K, V = d.kv()
        assert_within_budget(out[None], qd, K, V, len(K) - 1, 8 ** -0.5)


@pytest.mark.parametrize("dtype", DTYPES)
def test_failed_calls_change_nothing(dtype):
    rng = np.random.default_rng(4)
    dec = make(dtype, max_tokens=8)
    q, k, v = draw(rng, 8)
    dec.append(k[:7], v[:7])
    before = dec.cache.fingerprint()
    bad = k[7].copy()
    bad[1, 3] = np.nan
    with pytest.raises(ValueError, match=r"^k: expected finite values, got nan at index \(1, 3\)"):
        dec.step(q[7], bad, v[7])
    bad[1, 3] = 3.4e38                                          # finite in float32, inf in both 16-bit formats
    with pytest.raises(ValueError, match=r"^k: expected "):
        dec.step(q[7], bad, v[7])
    with pytest.raises(ValueError, match="^k: expected shape"):
        dec.step(q[7], k[7, :, :5], v[7])
    with pytest.raises(CacheFullError):
        dec.extend(q[:2], k[:2], v[:2])
    with pytest.raises(ValueError, match=r"^v: expected finite values"):       # bad input before capacity
        dec.extend(q[:2], k[:2], np.full_like(v[:2], np.inf))
    assert dec.cache.fingerprint() == before and dec.length == 7
    dec.step(q[7], k[7], v[7])
    assert dec.length == 8


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", ["step", "extend"])
def test_a_fault_at_every_point_changes_nothing(dtype, op):
    def build():
        rng = np.random.default_rng(5)
        cache = KVCache(num_layers=2, num_kv_heads=2, head_dim=8, head_dim_v=6, page_size=4, num_pages=16,
                        dtype=dtype)
        old = Decoder.on_cache(cache, 4)
        with old.transaction(9) as tx:                        # pages with old bytes, then freed: reused below
            for layer, (q, k, v) in enumerate(zip(*draw(rng, 9, lead=(2,)))):
                tx.extend(layer, q, k, v)
        old.free()
        dec = Decoder.on_cache(cache, 4)
        with dec.transaction(3) as tx:
            for layer, (q, k, v) in enumerate(zip(*draw(rng, 3, lead=(2,)))):
                tx.extend(layer, q, k, v)
        return cache, dec.fork(), draw(rng, 6, lead=(2,))

    def run(dec, inputs):
        q, k, v = inputs
        count = 1 if op == "step" else 6
        with dec.transaction(count) as tx:                    # two layers, the fork's shared page copied
            return [tx.step(layer, q[layer, 0], k[layer, 0], v[layer, 0]) if count == 1
                    else tx.extend(layer, q[layer], k[layer], v[layer]) for layer in range(2)]

    cache, dec, inputs = build()
    counter = FaultInjector()
    set_fault_hook(cache, counter)
    expected = run(dec, inputs)
    set_fault_hook(cache, no_fault)
    expected_fp = cache.fingerprint()
    assert "write_k" in counter.points and "cow_copy" in counter.points
    for i, point in enumerate(counter.points):
        cache, dec, inputs = build()
        before = cache.fingerprint()
        set_fault_hook(cache, FaultInjector(fail_at=i))
        with pytest.raises(InjectedFault):
            run(dec, inputs)
        assert cache.fingerprint() == before, f"fault #{i} at {point!r} changed the cache"
        set_fault_hook(cache, no_fault)
        again = run(dec, inputs)
        assert all(a.tobytes() == b.tobytes() for a, b in zip(again, expected)) and cache.fingerprint() == expected_fp


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_loaded_snapshot_continues_bit_for_bit(dtype, tmp_path):
    rng = np.random.default_rng(6)
    dec = make(dtype)
    q, k, v = draw(rng, 10)
    dec.extend(q[:9], k[:9], v[:9])
    dec.cache.save(tmp_path / "c.safetensors")
    loaded = Decoder.on_sequence(KVCache.load(tmp_path / "c.safetensors"), dec.seq, 4)
    assert loaded.cache.config.storage == dtype
    assert loaded.step(q[9], k[9], v[9]).tobytes() == dec.step(q[9], k[9], v[9]).tobytes()
    assert all(a.tobytes() == b.tobytes() for a, b in zip(loaded.kv(), dec.kv()))


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_prefix_hit_computes_what_the_full_prompt_computes(dtype):
    rng = np.random.default_rng(7)
    cache = KVCache(num_kv_heads=2, head_dim=8, head_dim_v=6, page_size=4, num_pages=32, dtype=dtype,
                    prefix_caching=True)
    ids = np.arange(100, 111)
    q, k, v = draw(rng, 11)
    first = Decoder.on_cache(cache, 4)
    full = first.extend(q, k, v, token_ids=ids)
    second, hit = Decoder.from_prefix(cache, 4, ids)
    assert hit == 8
    rest = second.extend(q[hit:], k[hit:], v[hit:], token_ids=ids[hit:])
    np.testing.assert_allclose(rest, full[hit:], rtol=0, atol=2e-6)
    assert all(a.tobytes() == b.tobytes() for a, b in zip(second.kv(), first.kv()))
    assert (second.cache.pool.page_table(second.seq)[:2] == first.cache.pool.page_table(first.seq)[:2]).all()   # adopted
