"""The batched one-token-each path (`batch_step`, a `batch_transaction` of one token each: `kvcache.TokenBatch`,
one scatter per layer, the whole batch validated in one pass) and the jitted float32 -> float16 store.

Metamorphic: batch_step equals a loop of `Decoder.step` on a copy of the same pool, byte for byte in the pool and
in the outputs up to the kernel's summation order (same tolerance as tests/decode/test_decoder.py); every bad
input names its argument and row and leaves the cache's fingerprint unchanged, before capacity is checked.
"""
import numpy as np
import pytest

from decode import Decoder, batch_step, batch_transaction
from kvcache import CacheFullError, KVCache
from kvcache.jit_store import FLOAT16, scatter_kv, scatter_kv_bits, store_token_bits

pytestmark = pytest.mark.kernel          # jitted paths: rerun JIT-free and bounds-checked by CI

TOL = {"float64": (1e-13, 1e-13), "float32": (2e-6, 2e-5), "float16": (2e-6, 2e-5), "int8": (2e-6, 2e-5)}


def pool_pair(dtype, lengths, *, page_size=4, num_layers=1, window=None, fork=False, seed=0):
    """Two identical pools (same appends) with one decoder per entry of ``lengths`` each; with ``fork`` the last
    decoder is a fork of the first (its partial last page shared: the step copies it)."""
    rng = np.random.default_rng(seed)
    history = [(rng.standard_normal((num_layers, n, 2, 8)), rng.standard_normal((num_layers, n, 2, 8)))
               for n in lengths]
    pairs = []
    for _ in range(2):
        cache = KVCache(num_kv_heads=2, head_dim=8, page_size=page_size, num_pages=64, dtype=dtype,
                        num_layers=num_layers)
        decs = [Decoder.on_cache(cache, 4, window=window) for _ in lengths]
        for dec, (k, v) in zip(decs, history):
            cache.append(dec.seq, k, v)
        if fork:
            decs[-1].free()
            decs[-1] = decs[0].fork()
        pairs.append((cache, decs))
    return pairs


def close(got, ref, dtype):
    atol, rtol = TOL[dtype]
    assert (np.abs(got - ref) <= atol + rtol * np.abs(ref)).all()


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64", "int8"])
@pytest.mark.parametrize("fork", [False, True])
def test_batch_step_equals_loop_of_steps(dtype, fork):
    (c1, batch), (c2, loop) = pool_pair(dtype, [3, 4, 7, 8, 1], fork=fork)   # partial and full last pages
    rng = np.random.default_rng(1)
    for _ in range(3):
        q = rng.standard_normal((5, 4, 8)).astype(np.float32)
        k = rng.standard_normal((5, 2, 8)).astype(np.float32)
        v = rng.standard_normal((5, 2, 8)).astype(np.float32)
        out = batch_step(batch, q, k, v)
        ref = np.stack([d.step(q[b], k[b], v[b]) for b, d in enumerate(loop)])
        close(out, ref, dtype)
        assert [d.length for d in batch] == [d.length for d in loop]
        for d1, d2 in zip(batch, loop):
            assert all((x1 == x2).all() for x1, x2 in zip(d1.kv(), d2.kv()))
        # a fork's shared last page: the batch copies it for both holders, the loop for the first only
        assert fork or c1.fingerprint() == c2.fingerprint()
    c1.check_invariants()


def test_batch_transaction_of_several_layers_equals_per_decoder_transactions():
    layers = 3
    (c1, batch), (c2, loop) = pool_pair("float16", [5, 8, 2], num_layers=layers, window=6)
    rng = np.random.default_rng(2)
    for _ in range(4):
        q, k, v = (rng.standard_normal((layers, 3, h, 8)).astype(np.float32) for h in (4, 2, 2))
        with batch_transaction(batch) as tx:
            outs = [tx.step(layer, q[layer], k[layer], v[layer]) for layer in range(layers)]
        for b, dec in enumerate(loop):
            with dec.transaction(1) as t1:
                for layer in range(layers):
                    close(outs[layer][b], t1.step(layer, q[layer, b], k[layer, b], v[layer, b]), "float16")
        assert c1.fingerprint() == c2.fingerprint()
    c1.check_invariants()


@pytest.mark.parametrize("name, row, value, message", [
    ("q", 2, np.nan, "^q: expected finite values, got nan at index \\(2, 1, 3\\)"),
    ("k", 1, np.inf, "^k: expected finite values, got inf at index \\(1, 1, 3\\)"),
    ("v", 3, 1e6, "^v: expected values finite in float16 storage .* at index \\(3, 1, 3\\)"),
    ("q", 0, 1e30, "^q: expected \\|x\\| < .* at index \\(0, 1, 3\\)"),
])
def test_batch_step_bad_row_is_named_before_anything_changes(name, row, value, message):
    (cache, decs), _ = pool_pair("float16", [3, 4, 7, 8])
    rng = np.random.default_rng(3)
    args = {"q": rng.standard_normal((4, 4, 8)), "k": rng.standard_normal((4, 2, 8)),
            "v": rng.standard_normal((4, 2, 8))}
    args[name][row, 1, 3] = value
    before = cache.fingerprint()
    with pytest.raises(ValueError, match=message):
        batch_step(decs, args["q"], args["k"], args["v"])
    assert cache.fingerprint() == before and [d.length for d in decs] == [3, 4, 7, 8]
    with batch_transaction(decs) as tx:                        # per layer inside a transaction: same check
        with pytest.raises(ValueError, match=message):
            tx.step(0, args["q"], args["k"], args["v"])
    assert cache.fingerprint() == before


def test_batch_step_checks_input_before_capacity():
    cache = KVCache(num_kv_heads=2, head_dim=8, page_size=4, num_pages=2)
    decs = [Decoder.on_cache(cache, 4) for _ in range(3)]       # three fresh pages needed, two in the pool
    q, k, v = np.ones((3, 4, 8)), np.ones((3, 2, 8)), np.ones((3, 2, 8))
    k[1, 0, 0] = np.nan
    before = cache.fingerprint()
    with pytest.raises(ValueError, match="^k: expected finite values"):
        batch_step(decs, q, k, v)
    k[1, 0, 0] = 0.0
    with pytest.raises(CacheFullError):
        batch_step(decs, q, k, v)
    assert cache.fingerprint() == before


def test_begin_tokens_refuses_bad_sequence_lists_unchanged():
    cache = KVCache(num_kv_heads=2, head_dim=8, page_size=4, num_pages=8)
    a, b = cache.create_sequence(), cache.create_sequence()
    before = cache.fingerprint()
    with pytest.raises(ValueError, match="^tokens: expected distinct"):
        cache.transaction([a, b, a])
    with pytest.raises(ValueError, match="^seq: expected a live sequence id"):
        cache.transaction([a, 9])
    with pytest.raises(TypeError, match="^tokens: expected a non-empty list"):
        cache.transaction([])
    with pytest.raises(ValueError, match="token_ids"):
        cache.transaction([a, b], token_ids={7: 3})
    tx = cache.transaction([a, b])
    with pytest.raises(RuntimeError, match="^seq: expected a sequence with no open transaction"):
        cache.transaction([b])
    tx.rollback()
    assert cache.fingerprint() == before


def test_step_in_a_multi_token_batch_transaction_is_refused_unchanged():
    (cache, decs), _ = pool_pair("float32", [3, 4])
    before = cache.fingerprint()
    with pytest.raises(ValueError, match="^step: expected a transaction of one new token per decoder"):
        with batch_transaction(decs, [1, 2]) as tx:
            tx.step(0, np.ones((2, 4, 8)), np.ones((2, 2, 8)), np.ones((2, 2, 8)))
    assert cache.fingerprint() == before


def test_float16_stores_are_numpys_cast_bit_for_bit():
    rng = np.random.default_rng(4)
    bits = rng.integers(0, 2 ** 32, size=1 << 14, dtype=np.uint64).astype(np.uint32)
    sweep = np.arange(0x33000000 - 64, 0x38800000 + 64, 4099, dtype=np.uint32)         # subnormal float16s
    edges = np.array([0.0, -0.0, 65504.0, 65519.996, 65520.0, 2 ** -24, 2 ** -25, 3 * 2 ** -26, 2 ** -14,
                      1.0 + 2 ** -11, 1.0 + 3 * 2 ** -11, np.inf, -np.inf, np.nan], dtype=np.float32).view(np.uint32)
    x = np.concatenate([bits, sweep, edges, edges + 1, edges - 1])
    x = x[: len(x) // 16 * 16].reshape(-1, 2, 8)                 # [B, H, D]
    B = x.shape[0]
    with np.errstate(over="ignore", invalid="ignore"):
        ref = x.view(np.float32).astype(np.float16).view(np.uint16)
    nan = np.isnan(x.view(np.float32))
    k16, v16 = np.zeros((B, 2, 3, 8), np.uint16), np.zeros((B, 2, 3, 8), np.uint16)
    old = np.empty_like(ref), np.empty_like(ref)
    scatter_kv_bits(k16, v16, np.arange(B, dtype=np.int64), np.full(B, 2, dtype=np.int64), x, x[::-1].copy(), *old,
                    FLOAT16)
    assert (k16[:, :, 2][~nan] == ref[~nan]).all() and (v16[:, :, 2][~nan[::-1]] == ref[::-1][~nan[::-1]]).all()
    assert np.isnan(k16[:, :, 2][nan].view(np.float16)).all() and not k16[:, :, :2].any() and not old[0].any()
    layers = np.zeros((2, 3, 2, 4, 8), np.uint16), np.zeros((2, 3, 2, 4, 8), np.uint16)
    for b in range(0, B, max(1, B // 50)):                       # the one-token store, on a sample of rows
        store_token_bits(*layers, 1, 2, 3, x[b], x[b], FLOAT16)
        assert (layers[0][1, 2, :, 3][~nan[b]] == ref[b][~nan[b]]).all()
    assert not layers[0][0].any() and not layers[0][1, :2].any() and not layers[0][1, 2, :, :3].any()


@pytest.mark.parametrize("pool_dtype, input_dtype", [("float32", "float32"), ("float32", "float64"),
                                                     ("float64", "float32"), ("float16", "float32")])
def test_jitted_scatter_is_numpys_fancy_assignment(pool_dtype, input_dtype):
    rng = np.random.default_rng(5)
    pages, offsets = np.array([3, 0, 5], dtype=np.int64), np.array([1, 3, 0], dtype=np.int64)
    k_pool = rng.standard_normal((6, 2, 4, 8)).astype(pool_dtype)
    v_pool = rng.standard_normal((6, 2, 4, 5)).astype(pool_dtype)
    k = (rng.standard_normal((3, 2, 8)) * np.exp(rng.uniform(-20, 9, (3, 2, 8)))).astype(input_dtype)
    v = rng.standard_normal((3, 2, 5)).astype(input_dtype)
    want_k, want_v = k_pool.copy(), v_pool.copy()
    want_k[pages, :, offsets], want_v[pages, :, offsets] = k, v
    old_k, old_v = k_pool[pages, :, offsets], v_pool[pages, :, offsets]
    if pool_dtype == "float16":
        got_old = np.empty((3, 2, 8), np.uint16), np.empty((3, 2, 5), np.uint16)
        scatter_kv_bits(k_pool.view(np.uint16), v_pool.view(np.uint16), pages, offsets, k.view(np.uint32),
                        v.view(np.uint32), *got_old, FLOAT16)
        got_old = tuple(x.view(np.float16) for x in got_old)
    else:
        got_old = np.empty((3, 2, 8), pool_dtype), np.empty((3, 2, 5), pool_dtype)
        scatter_kv(k_pool, v_pool, pages, offsets, k, v, *got_old)
    assert k_pool.tobytes() == want_k.tobytes() and v_pool.tobytes() == want_v.tobytes()
    assert got_old[0].tobytes() == old_k.tobytes() and got_old[1].tobytes() == old_v.tobytes()


def test_batch_step_with_token_ids_registers_pages_like_a_loop_of_steps():
    pools = []
    for _ in range(2):
        cache = KVCache(num_kv_heads=2, head_dim=8, page_size=4, num_pages=32, prefix_caching=True,
                        prefix_salt=b"test-salt")
        decs = [Decoder.on_cache(cache, 4) for _ in range(3)]
        for b, dec in enumerate(decs):
            dec.append(np.ones((3 + b, 2, 8)), np.ones((3 + b, 2, 8)), token_ids=np.arange(3 + b) + 10 * b)
        pools.append((cache, decs))
    (c1, batch), (c2, loop) = pools
    rng = np.random.default_rng(6)
    for step in range(3):
        q, k, v = rng.standard_normal((3, 4, 8)), rng.standard_normal((3, 2, 8)), rng.standard_normal((3, 2, 8))
        ids = np.array([100 + step, 200 + step, 300 + step])
        out = batch_step(batch, q, k, v, token_ids=ids)
        ref = np.stack([d.step(q[b], k[b], v[b], token_ids=int(ids[b])) for b, d in enumerate(loop)])
        close(out, ref, "float32")
        assert c1.fingerprint() == c2.fingerprint()                 # same registered pages, chains and ids
    assert len(c1.pool.index.entries()) > 0
    c1.check_invariants()
