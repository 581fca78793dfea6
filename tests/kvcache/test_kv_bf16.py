"""bfloat16 storage (`kvcache.bf16`): the rounding rule against torch bit for bit and against an independent
float64 oracle, over every class of float32 bit pattern; the jitted stores == the NumPy rule; every append path
of a bfloat16 cache stores the rule's bits; bad input refused before capacity with nothing changed; rollback,
snapshots, prefix keys, memory accounting."""
import json
import struct

import numpy as np
import pytest
from numba import njit

import kvcache
from kvcache import KVCache, bf16
from kvcache.errors import SnapshotConfigError
from kvcache.faults import no_fault
from kvcache.testing import FaultInjector, InjectedFault, set_fault_hook
from kvcache.jit_store import BFLOAT16, scatter_kv_bits, store_token_bits
from decode.app.measure_memory import memory_report
from kvcache.accounting import kv_bytes_formula

# every high half (sign, exponent, 7 mantissa bits) with low halves that decide the rounding: exact (0), just
# above (1), just below / at / just above the tie (0x7fff, 0x8000, 0x8001), the top (0xffff), and random ones
_LOW = np.array([0x0000, 0x0001, 0x4000, 0x7fff, 0x8000, 0x8001, 0xc000, 0xffff], dtype=np.uint32)


def all_classes(seed=0) -> np.ndarray:
    """uint32 float32 bit patterns: every 2**16 high half x `_LOW` and 4 random low halves (2**16 * 12)."""
    high = np.arange(1 << 16, dtype=np.uint32) << 16
    rand = np.random.default_rng(seed).integers(0, 1 << 16, size=(1 << 16, 4), dtype=np.uint32)
    return (high[:, None] | np.concatenate([np.broadcast_to(_LOW, (1 << 16, len(_LOW))), rand], axis=1)).ravel()


def oracle(f32_bits: np.ndarray) -> np.ndarray:
    """Nearest-even bfloat16 of finite float32 values, from the two neighbours in float64 (exact there)."""
    x = f32_bits.view(np.float32).astype(np.float64)
    down = (f32_bits >> 16).astype(np.uint32)                                 # truncation: toward zero
    up = down + 1
    lo, hi = (down << 16).view(np.float32).astype(np.float64), (up << 16).view(np.float32).astype(np.float64)
    with np.errstate(invalid="ignore"):
        d_lo, d_hi = np.abs(x - lo), np.abs(hi - x)                          # hi may be inf: d_hi inf
    take_up = (d_hi < d_lo) | ((d_hi == d_lo) & (down & 1 == 1))
    overflow = (np.abs(x) >= bf16.OVERFLOW)                                  # beyond the tie above MAX: inf
    out = np.where(take_up, up, down).astype(np.uint32)
    out[overflow] = np.where(x[overflow] > 0, 0x7f80, 0xff80)
    return out.astype(np.uint16)


@njit(cache=False)                  # a test helper: no on-disk cache keyed by this module's (changing) name
def _jit_round(bits, out):
    for i in range(bits.shape[0]):
        out[i] = bf16.f32_bits_to_bf16(bits[i])


def test_constants():
    assert bf16.MAX == float.fromhex("0x1.fep127") and bf16.OVERFLOW == float.fromhex("0x1.ffp127")
    assert bf16.to_bits(np.array([bf16.MAX, np.nextafter(np.float32(bf16.OVERFLOW), 0)], np.float32)).tolist() == \
        [0x7f7f, 0x7f7f]
    assert bf16.to_bits(np.array([bf16.OVERFLOW], np.float32)).tolist() == [0x7f80]


def test_rule_equals_the_float64_oracle_on_every_class():
    u = all_classes()
    finite = (u & 0x7f800000) != 0x7f800000
    got = bf16.to_bits(u.view(np.float32))
    assert (got[finite] == oracle(u[finite])).all()
    inf = (u & 0x7fffffff) == 0x7f800000
    assert (got[inf] == (u[inf] >> 16)).all()                                # inf stays inf, sign kept
    assert (got[~finite & ~inf] == bf16.QUIET_NAN).all()
    jitted = np.empty_like(got)
    _jit_round(u, jitted)
    assert jitted.tobytes() == got.tobytes()


def test_special_values():
    cases = [(0.0, 0x0000), (-0.0, 0x8000), (1.0, 0x3f80), (-2.0, 0xc000), ("0x1p-133", 0x0001),
             ("0x1p-134", 0x0000), ("0x1.8p-134", 0x0001), ("-0x1.8p-134", 0x8001),   # the subnormal tie, above it
             ("0x1.01p0", 0x3f80), ("0x1.03p0", 0x3f82),                               # ties to even
             ("0x1.fep127", 0x7f7f), ("0x1.fffffep127", 0x7f80), (np.inf, 0x7f80), (-np.inf, 0xff80)]
    x = np.array([float.fromhex(c) if isinstance(c, str) else c for c, _ in cases], dtype=np.float32)
    assert bf16.to_bits(x).tolist() == [bits for _, bits in cases]
    nans = np.array([0x7fc00000, 0xffc00000, 0x7f800001, 0xff800001, 0x7fffffff], np.uint32).view(np.float32)
    assert bf16.to_bits(nans).tolist() == [bf16.QUIET_NAN] * 5
    widened = bf16.to_float32(np.arange(1 << 16, dtype=np.uint16))
    ok = ~np.isnan(widened)
    assert (bf16.to_bits(widened)[ok] == np.arange(1 << 16)[ok]).all()      # every bfloat16 round-trips
    assert widened.view(np.uint32)[::257].tolist() == (np.arange(0, 1 << 16, 257, dtype=np.uint32) << 16).tolist()


def test_float64_rounds_through_float32_and_float16_exactly():
    rng = np.random.default_rng(3)
    x = np.concatenate([rng.standard_normal(5000) * np.exp(rng.uniform(-300, 300, 5000)),
                        1 + np.arange(-512, 512) * 2.0 ** -30, [1 + 2 ** -8 + 2 ** -30, 3.4e38, 3.5e38, 1e-50]])
    with np.errstate(over="ignore"):
        assert bf16.to_bits(x).tobytes() == bf16.to_bits(x.astype(np.float32)).tobytes()
    assert bf16.to_bits(np.array([1 + 2 ** -8 + 2 ** -30])).tolist() == [0x3f80]   # one rounding would give 0x3f81
    h = np.arange(1 << 16, dtype=np.uint16).view(np.float16)
    assert bf16.to_bits(h).tobytes() == bf16.to_bits(h.astype(np.float32)).tobytes()


def test_matches_torch_bit_for_bit():
    torch = pytest.importorskip("torch")
    u = all_classes(seed=1)
    x = u.view(np.float32)
    nan = np.isnan(x)
    ref = torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    got = bf16.to_bits(x)
    assert (got[~nan] == ref[~nan]).all()
    assert np.isnan(bf16.to_float32(ref[nan])).all()           # torch's vectorised cast: some NaN (0xffff here)
    scalar = [torch.tensor(v).to(torch.bfloat16).view(torch.int16).item() & 0xffff for v in x[nan][:64]]
    assert scalar == got[nan][:64].tolist()                    # c10's scalar rule: 0x7fc0, as ours
    rng = np.random.default_rng(2)
    x64 = np.concatenate([rng.standard_normal(20000) * np.exp(rng.uniform(-100, 100, 20000)),
                          1 + np.arange(-4096, 4096) * 2.0 ** -31, [1 + 2 ** -8 + 2 ** -30, -(1 + 2 ** -8 + 2 ** -30)]])
    ref64 = torch.from_numpy(x64).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    assert bf16.to_bits(x64).tobytes() == ref64.tobytes()       # float64: via float32, as torch
    h = np.arange(1 << 16, dtype=np.uint16).view(np.float16)
    ok = ~np.isnan(h)
    ref16 = torch.from_numpy(h.copy()).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    assert (bf16.to_bits(h)[ok] == ref16[ok]).all()


def test_jitted_stores_equal_the_rule():
    u = all_classes(seed=4)
    u = u[(u & 0x7f800000) != 0x7f800000][: 3000 * 16].reshape(3000, 2, 8)          # [B, H, D] float32 bits
    B = u.shape[0]
    want = bf16.to_bits(u.view(np.float32))
    k16, v16 = np.zeros((B, 2, 3, 8), np.uint16), np.zeros((B, 2, 3, 8), np.uint16)
    old = np.empty(u.shape, np.uint16), np.empty(u.shape, np.uint16)
    scatter_kv_bits(k16, v16, np.arange(B, dtype=np.int64), np.full(B, 1, dtype=np.int64), u, u[::-1].copy(),
                    *old, BFLOAT16)
    assert k16[:, :, 1].tobytes() == want.tobytes() and v16[:, :, 1].tobytes() == want[::-1].tobytes()
    layers = np.zeros((2, 3, 2, 4, 8), np.uint16), np.zeros((2, 3, 2, 4, 8), np.uint16)
    for b in range(0, B, 37):
        store_token_bits(*layers, 1, 2, 3, u[b], u[b], BFLOAT16)
        assert layers[0][1, 2, :, 3].tobytes() == want[b].tobytes()


# -- the cache --------------------------------------------------------------------------------------------------
def make(**kw):
    args = dict(num_layers=2, num_kv_heads=2, head_dim=5, head_dim_v=3, page_size=4, num_pages=8, dtype="bfloat16")
    args.update(kw)
    return KVCache(**args)


def rows(rng, shape, dtype):
    spread = 8 if np.dtype(dtype) == np.float16 else 30                      # magnitudes e**-spread .. e**spread
    return (rng.standard_normal(shape) * np.exp(rng.uniform(-spread, spread, shape))).astype(dtype)


@pytest.mark.parametrize("input_dtype", [np.float32, np.float64, np.float16])
def test_every_append_path_stores_the_rules_bits(input_dtype):
    rng = np.random.default_rng(5)
    cache = make()
    a, b = cache.create_sequence(), cache.create_sequence()
    k, v = rows(rng, (2, 6, 2, 5), input_dtype), rows(rng, (2, 6, 2, 3), input_dtype)
    cache.append(a, k, v)                                            # transaction: a page chunk at a time
    k1, v1 = rows(rng, (2, 2, 5), input_dtype), rows(rng, (2, 2, 3), input_dtype)
    token = cache.transaction(a)                                     # one token (jitted for float32)
    for layer in range(2):
        token.write(layer, k1[layer], v1[layer])
    token.commit()
    kb, vb = rows(rng, (2, 2, 2, 5), input_dtype), rows(rng, (2, 2, 2, 3), input_dtype)
    batch = cache.transaction([a, b])                               # one token each (a jitted scatter)
    for layer in range(2):
        batch.write(layer, kb[layer], vb[layer])
    batch.commit()
    checked = cache.pool.check_kv(kb[:, :1], vb[:, :1])                   # bits from the check are stored as given
    assert checked[0].dtype == np.uint16
    with cache.transaction({b: 1}) as tx:
        for layer in range(2):
            tx.write(layer, b, checked[0][layer], checked[1][layer], checked=True)
    for layer in range(2):
        K, V = cache.gather(a, layer)
        want_k = np.concatenate([k[layer], k1[layer][None], kb[layer][:1]])
        want_v = np.concatenate([v[layer], v1[layer][None], vb[layer][:1]])
        assert K.dtype == np.float32 and K.tobytes() == bf16.to_float32(bf16.to_bits(want_k)).tobytes()
        assert V.tobytes() == bf16.to_float32(bf16.to_bits(want_v)).tobytes()
        K, _ = cache.gather(b, layer)
        assert K.tobytes() == bf16.to_float32(bf16.to_bits(np.stack([kb[layer][1], kb[layer][0]]))).tobytes()
        page = cache.pool.page_table(a)[0]
        assert cache.pool.k_pages(layer)[page, :, 0].tobytes() == bf16.to_bits(k[layer][0]).tobytes()
    cache.check_invariants()


@pytest.mark.parametrize("value, message", [
    (np.nan, r"^k: expected finite values, got nan at index \(1, 0, 1, 2\)$"),
    (np.inf, r"^k: expected finite values, got inf at index \(1, 0, 1, 2\)$"),
    (3.4e38, r"^k: expected values finite in bfloat16 storage \(\|x\| <= 3.3895314e\+38\), got 3.4e\+38 at index "
             r"\(1, 0, 1, 2\)$"),
    (-1e39, r"^k: expected values finite in bfloat16 storage \(\|x\| <= 3.3895314e\+38\), got -1e\+39 at index "
            r"\(1, 0, 1, 2\)$")])
def test_bad_input_is_refused_before_capacity_with_nothing_changed(value, message):
    rng = np.random.default_rng(6)
    cache = make(num_pages=2)
    seq = cache.create_sequence()
    cache.append(seq, rows(rng, (2, 7, 2, 5), np.float64), rows(rng, (2, 7, 2, 3), np.float64))
    before = cache.fingerprint()
    k, v = rows(rng, (2, 9, 2, 5), np.float64), rows(rng, (2, 9, 2, 3), np.float64)   # 9 tokens: no room either
    k[1, 0, 1, 2] = value
    with pytest.raises(ValueError, match=message):
        cache.append(seq, k, v)
    with pytest.raises(ValueError, match=message.replace("(1, 0, 1, 2)", "(0, 1, 2)").replace(r"\(1, 0, 1, 2\)",
                                                                                            r"\(0, 1, 2\)")):
        cache.pool.check_kv(k[1], v[1], layered=False)
    assert cache.fingerprint() == before
    with pytest.raises(kvcache.CacheFullError):
        cache.append(seq, np.ones((2, 9, 2, 5)), np.ones((2, 9, 2, 3)))
    assert cache.fingerprint() == before


def test_fault_at_every_point_restores_every_byte_of_a_reused_pool():
    """Pages that held K/V before (freed, reused) and fresh zero pages alike come back byte for byte."""
    def build():
        rng = np.random.default_rng(7)
        cache = make()
        old = cache.create_sequence()
        cache.append(old, rows(rng, (2, 9, 2, 5), np.float32), rows(rng, (2, 9, 2, 3), np.float32))
        cache.free(old)                                              # 3 pages of old bytes back on the free list
        seq = cache.create_sequence()
        cache.append(seq, rows(rng, (2, 3, 2, 5), np.float32), rows(rng, (2, 3, 2, 3), np.float32))
        child = cache.fork(seq)                                      # shared partial last page: copy-on-write
        return cache, (seq, child, rows(rng, (2, 14, 2, 5), np.float32), rows(rng, (2, 14, 2, 3), np.float32))

    def op(cache, ctx):
        seq, child, k, v = ctx
        with cache.transaction({seq: 10, child: 4}) as tx:
            for layer in range(2):
                tx.write(layer, seq, k[layer, :10], v[layer, :10])
                tx.write(layer, child, k[layer, 10:], v[layer, 10:])
    cache, ctx = build()
    counter = FaultInjector()
    set_fault_hook(cache, counter)
    op(cache, ctx)
    set_fault_hook(cache, no_fault)
    expected = cache.fingerprint()
    assert len(counter.points) > 10
    for i, point in enumerate(counter.points):
        cache, ctx = build()
        before = cache.fingerprint()
        set_fault_hook(cache, FaultInjector(fail_at=i))
        with pytest.raises(InjectedFault):
            op(cache, ctx)
        assert cache.fingerprint() == before, f"fault #{i} at {point!r} changed the cache"
        cache.check_invariants()
        set_fault_hook(cache, no_fault)
        op(cache, ctx)
        assert cache.fingerprint() == expected


def test_snapshot_round_trips_the_bits_and_says_bfloat16(tmp_path):
    rng = np.random.default_rng(8)
    cache = make(prefix_caching=True, num_pages=10)
    a = cache.create_sequence()
    cache.append(a, rows(rng, (2, 9, 2, 5), np.float32), rows(rng, (2, 9, 2, 3), np.float32),
                 token_ids=np.arange(9))
    b = cache.fork(a)
    cache.append(b, rows(rng, (2, 2, 2, 5), np.float64), rows(rng, (2, 2, 2, 3), np.float64))
    path = tmp_path / "bf16.safetensors"
    cache.save(path)
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    assert json.loads(header["__metadata__"]["config"])["dtype"] == "bfloat16"
    assert header["k"]["dtype"] == "U16" and header["v"]["dtype"] == "U16"
    loaded = KVCache.load(path)
    assert loaded.config == cache.config and loaded.config.storage == "bfloat16"
    assert loaded.fingerprint(include_free_pages=False) == cache.fingerprint(include_free_pages=False)
    for seq in (a, b):
        for layer in range(2):
            assert all(x.tobytes() == y.tobytes() for x, y in zip(loaded.gather(seq, layer), cache.gather(seq, layer)))
    other = kvcache.CacheConfig.build(num_layers=2, num_kv_heads=2, head_dim=5, head_dim_v=3, page_size=4,
                                      num_pages=10, dtype="float16")
    with pytest.raises(SnapshotConfigError, match=r"'dtype': \('float16', 'bfloat16'\)"):
        KVCache.load(path, config=other)
    assert loaded.match_prefix(np.arange(9)).num_tokens == 8                 # the prefix index came back


def test_prefix_keys_depend_on_the_storage_format():
    salt = b"0123456789abcdef"
    caches = {dtype: make(dtype=dtype, prefix_caching=True, prefix_salt=salt) for dtype in ("bfloat16", "float16")}
    keys = {dtype: c.pool.index.root("").key for dtype, c in caches.items()}
    assert keys["bfloat16"] != keys["float16"]
    assert make(prefix_caching=True, prefix_salt=salt).pool.index.root("").key == keys["bfloat16"]


def test_memory_two_bytes_per_element():
    cache = make(num_pages=5)
    cfg = cache.config
    assert cache.pool.nbytes == 5 * 4 * cfg.bytes_per_token == 2 * 5 * 4 * 2 * (5 + 3) * 2      # layers, pages, slots, heads, K+V widths, bytes
    assert cfg.bytes_per_token * 7 == kv_bytes_formula(2, 1, 7, 2, 5, 2, head_dim_v=3)
    [row] = memory_report(layers=2, num_q_heads=4, kv_heads=2, tokens=100, head_dim=8, dtype="bfloat16",
                          page_size=16, measure=False)
    assert row["dtype"] == "bfloat16" and row["formula_bytes"] == 2 * 2 * 100 * 2 * 8 * 2 == row["value_bytes"]
    assert row["allocated_bytes"] == 7 * 16 * 2 * 2 * (8 + 8) * 2 and row["scale_bytes"] == 0


@pytest.mark.slow
def test_every_float32_bit_pattern_matches_torch():
    """All 2**32 float32 bit patterns in chunks of 2**24 (a few minutes): every non-NaN equals torch's bits;
    every NaN is 0x7fc0 here and a NaN in torch."""
    torch = pytest.importorskip("torch")
    step = 1 << 24
    for start in range(0, 1 << 32, step):
        x = np.arange(start, start + step, dtype=np.uint64).astype(np.uint32).view(np.float32)
        ours = bf16.to_bits(x)
        ref = torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
        nan = np.isnan(x)
        assert (ours[~nan] == ref[~nan]).all(), f"chunk from {start:#x}"
        assert (ours[nan] == bf16.QUIET_NAN).all() and np.isnan(bf16.to_float32(ref[nan])).all()
