"""`decode.batch_extend` and multi-token `batch_transaction`: several sequences of one pool, each with its own
number of new tokens, in one kernel call; against separate extends, steps and the float64 reference.

Tolerance (float32 storage): 1e-6 + 3x the error of the same computation in plain float32 NumPy.
"""
import numpy as np
import pytest

from decode import Decoder, batch_extend, batch_transaction
from kvcache import CacheFullError, KVCache
from reference.dense import decode_reference

pytestmark = pytest.mark.kernel

HQ, HKV, D, DV = 8, 2, 16, 12


def pool(num_pages=64, layers=1, page_size=4, window=None, lengths=(5, 0, 9), seed=0):
    rng = np.random.default_rng(seed)
    cache = KVCache(num_layers=layers, num_kv_heads=HKV, head_dim=D, head_dim_v=DV, page_size=page_size,
                    num_pages=num_pages)
    decs = [Decoder.on_cache(cache, HQ, window=window) for _ in lengths]
    for dec, n in zip(decs, lengths):
        if n:
            with dec.transaction(n) as tx:
                for layer in range(layers):
                    tx.append(layer, *tokens(rng, n)[1:])
    return cache, decs, rng


def tokens(rng, n):
    return (rng.standard_normal((n, HQ, D)).astype(np.float32), rng.standard_normal((n, HKV, D)).astype(np.float32),
            rng.standard_normal((n, HKV, DV)).astype(np.float32))


def check_against_reference(dec, q, out, layer=0):
    """out [T, HQ, DV] of q [T, HQ, D] = the last T tokens of dec, vs the float64 reference."""
    assert out.shape == (len(q), HQ, DV)
    if not len(q):
        return
    K, V = (x.astype(np.float64) for x in dec.kv(layer))
    first = dec.cache.pool.first_position(dec.seq)
    start = dec.length - len(q)
    if start < first:            # a window released the oldest keys since: judge the queries that need none
        skip = first - start + (dec.window - 1 if dec.window else 0)
        q, out, start = q[skip:], out[skip:], start + skip
        if not len(q):
            return
    ref = decode_reference(q, K, V, start - first, dec.scale, dec.window or None)
    K32, V32 = (np.concatenate([np.zeros((first,) + x.shape[1:]), x]).astype(np.float32)   # released: never read
                for x in (K, V))
    plain = np.empty_like(ref)
    for t in range(len(q)):
        p = start + t
        lo = max(0, p - dec.window + 1) if dec.window else 0
        for h in range(HQ):
            s = (K32[lo:p + 1, h // (HQ // HKV)] @ q[t, h]) * np.float32(dec.scale)
            e = np.exp(s - s.max())
            plain[t, h] = (e @ V32[lo:p + 1, h // (HQ // HKV)]) / e.sum()
    err32 = np.abs(plain - ref).max() if len(q) else 0.0
    assert np.abs(out - ref).max(initial=0.0) <= 1e-6 + 3 * err32


@pytest.mark.parametrize("window", [None, 3])
def test_equals_separate_extends(window):
    counts = [7, 1, 0, 12]
    cache_a, decs_a, rng = pool(lengths=(5, 0, 9, 3), window=window)
    cache_b, decs_b, _ = pool(lengths=(5, 0, 9, 3), window=window)
    batch = [tokens(rng, n) for n in counts]
    outs = batch_extend(decs_a, [b[0] for b in batch], [b[1] for b in batch], [b[2] for b in batch])
    assert [o.shape for o in outs] == [(n, HQ, DV) for n in counts]
    for dec_a, dec_b, (q, k, v), out in zip(decs_a, decs_b, batch, outs):
        sep = dec_b.extend(q, k, v)
        np.testing.assert_allclose(out, sep, rtol=2e-6, atol=2e-6)
        assert dec_a.length == dec_b.length
        check_against_reference(dec_a, q, out)
    for dec_a, dec_b in zip(decs_a, decs_b):
        for x, y in zip(dec_a.kv(), dec_b.kv()):
            assert np.array_equal(x, y)
    assert cache_a.num_free_pages == cache_b.num_free_pages     # (physical pages differ: one reservation here)


def test_ragged_equals_lists():
    counts = [3, 0, 5]
    _, decs_a, rng = pool()
    _, decs_b, _ = pool()
    batch = [tokens(rng, n) for n in counts]
    lists = batch_extend(decs_a, *([b[i] for b in batch] for i in range(3)))
    ragged = batch_extend(decs_b, *(np.concatenate([b[i] for b in batch]) for i in range(3)), num_tokens=counts)
    assert ragged.shape == (sum(counts), HQ, DV)
    assert np.array_equal(np.concatenate(lists), ragged)


def test_extend_equals_steps():
    _, (a,), rng = pool(lengths=(6,))
    _, (b,), _ = pool(lengths=(6,))
    q, k, v = tokens(rng, 20)
    out = a.extend(q, k, v)
    steps = np.stack([b.step(q[t], k[t], v[t]) for t in range(20)])
    np.testing.assert_allclose(out, steps, rtol=2e-6, atol=2e-6)
    check_against_reference(a, q, out)


def test_multi_layer_transaction():
    """batch_transaction(decoders, num_tokens): tx.extend per layer (ragged and lists) == one-layer batch_extend
    of the same layer's data; the tokens land when the block exits."""
    layers, counts = 3, [4, 2, 6]
    cache, decs, rng = pool(layers=layers, lengths=(3, 5, 0))
    data = [[tokens(rng, n) for n in counts] for _ in range(layers)]
    before = [d.length for d in decs]
    with batch_transaction(decs, counts) as tx:
        outs = []
        for layer in range(layers):
            q, k, v = (np.concatenate([b[i] for b in data[layer]]) for i in range(3))
            outs.append(tx.extend(layer, q, k, v) if layer % 2 == 0 else
                        np.concatenate(tx.extend(layer, *([b[i] for b in data[layer]] for i in range(3)))))
            assert [d.length for d in decs] == before
    assert [d.length for d in decs] == [x + n for x, n in zip(before, counts)]
    for layer in range(layers):
        offset = 0
        for dec, (q, _, _), n in zip(decs, data[layer], counts):
            check_against_reference(dec, q, outs[layer][offset:offset + n], layer)
            offset += n


def test_validates_everything_before_reserving():
    """A NaN in the last decoder's q on a full pool is the ValueError naming it, not CacheFullError; nothing
    changes; the same call with good input succeeds once pages are free."""
    cache, decs, rng = pool(num_pages=7, lengths=(5, 3, 9))           # 2 + 1 + 3 of 7 pages: 1 free, 2 needed
    batch = [tokens(rng, n) for n in (4, 2, 1)]
    qs, ks, vs = ([b[i] for b in batch] for i in range(3))
    bad = [x.copy() for x in qs]
    bad[2][0, 1, 3] = np.nan
    before = cache.fingerprint()
    with pytest.raises(ValueError, match=r"^q\[2\]: expected finite"):
        batch_extend(decs, bad, ks, vs)
    assert cache.fingerprint() == before
    with pytest.raises(CacheFullError):
        batch_extend(decs, qs, ks, vs)
    assert cache.fingerprint() == before
    decs[1].truncate(0)                                              # its page goes back to the pool
    before = cache.fingerprint()
    with pytest.raises(ValueError, match=r"^q\[2\]: expected finite"):
        batch_extend(decs, bad, ks, vs)
    assert cache.fingerprint() == before
    outs = batch_extend(decs, qs, ks, vs)
    for dec, q, out in zip(decs, qs, outs):
        check_against_reference(dec, q, out)


@pytest.mark.parametrize("case, error, pattern", [
    ("counts", ValueError, r"^num_tokens: expected 3 token counts"),
    ("negative", ValueError, r"^num_tokens\[1\]: expected an integer >= 0"),
    ("list-length", ValueError, r"^q: expected 3 arrays \(one per decoder\), got 2"),
    ("k-shape", ValueError, r"^k\[1\]: expected shape"),
    ("v-shape", ValueError, r"^v\[0\]: expected shape"),
    ("ragged-total", ValueError, r"^q: expected shape"),
    ("ragged-no-counts", TypeError, r"^k: expected a list of arrays"),
    ("not-decoders", TypeError, r"^decoders: expected a non-empty list of Decoder"),
    ("repeated", ValueError, r"^decoders: expected distinct sequences"),
    ("mixed", TypeError, r"^q: expected a list of 3 arrays"),
])
def test_bad_input_named(case, error, pattern):
    cache, decs, rng = pool()
    batch = [tokens(rng, n) for n in (2, 3, 1)]
    qs, ks, vs = ([b[i] for b in batch] for i in range(3))
    ragged = [np.concatenate(x) for x in (qs, ks, vs)]
    calls = {
        "counts": lambda: batch_extend(decs, *ragged, num_tokens=[2, 3]),
        "negative": lambda: batch_extend(decs, *ragged, num_tokens=[2, -1, 1]),
        "list-length": lambda: batch_extend(decs, qs[:2], ks, vs),
        "k-shape": lambda: batch_extend(decs, qs, [ks[0], ks[1][:, :1], ks[2]], vs),
        "v-shape": lambda: batch_extend(decs, qs, ks, [vs[0][..., :3]] + vs[1:]),
        "ragged-total": lambda: batch_extend(decs, ragged[0][:-1], *ragged[1:], num_tokens=[2, 3, 1]),
        "ragged-no-counts": lambda: batch_extend(decs, *ragged),
        "not-decoders": lambda: batch_extend([decs[0], 7], qs, ks, vs),
        "repeated": lambda: batch_extend([decs[0], decs[1], decs[0]], qs, ks, vs),
        "mixed": lambda: batch_extend(decs, ragged[0], ks, vs),
    }
    before = cache.fingerprint()
    with pytest.raises(error, match=pattern):
        calls[case]()
    assert cache.fingerprint() == before


def test_multi_layer_pool_refused():
    _, decs, rng = pool(layers=2)
    with pytest.raises(ValueError, match=r"^batch_extend: expected a one-layer cache"):
        batch_extend(decs, *([x] for x in tokens(rng, 1)))
