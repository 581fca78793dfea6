"""Shared helpers of the kvcache tests: a plain dense model of what each sequence holds, and checks.

The dense model keeps, per sequence, Python lists of numpy rows (one ``[num_kv_heads, head_dim]`` row per
token and layer), already cast to the storage dtype (int8: quantized and dequantized to float32 by the rule of
`kvcache.quant`, one row at a time; bfloat16: rounded by `kvcache.bf16` and widened to float32), plus the first position still held (sliding window).
It knows nothing of pages: comparing `KVCache.gather` with it checks the paging bit for bit.
"""
import numpy as np
import pytest

import kvcache
from kvcache import bf16, quant
from kvcache.faults import no_fault
from kvcache.testing import FaultInjector, InjectedFault, set_fault_hook


def make_cache(*, num_layers=1, num_kv_heads=2, head_dim=3, head_dim_v=None, page_size=4, num_pages=8,
               dtype="float32") -> kvcache.KVCache:
    return kvcache.KVCache(num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=head_dim,
                           head_dim_v=head_dim_v, page_size=page_size, num_pages=num_pages, dtype=dtype)


def random_kv(cache: kvcache.KVCache, tokens: int, rng: np.random.Generator, scale: float = 1.0):
    """float64 ``k [num_layers, T, H, D]``, ``v [num_layers, T, H, Dv]``."""
    cfg = cache.config
    k = rng.standard_normal((cfg.num_layers, tokens, cfg.num_kv_heads, cfg.head_dim)) * scale
    v = rng.standard_normal((cfg.num_layers, tokens, cfg.num_kv_heads, cfg.head_dim_v)) * scale
    return k, v


class DenseModel:
    """seq -> per-layer lists of K rows and V rows (storage dtype) and the first held position."""

    def __init__(self, cache: kvcache.KVCache):
        self.cfg = cache.config
        self.k: dict[int, list[list[np.ndarray]]] = {}
        self.v: dict[int, list[list[np.ndarray]]] = {}
        self.first: dict[int, int] = {}

    def create(self, seq: int) -> None:
        self.k[seq] = [[] for _ in range(self.cfg.num_layers)]
        self.v[seq] = [[] for _ in range(self.cfg.num_layers)]
        self.first[seq] = 0

    def length(self, seq: int) -> int:
        return len(self.k[seq][0])

    def append(self, seq: int, k: np.ndarray, v: np.ndarray) -> None:
        """``k [num_layers, T, H, D]`` (any float dtype; cast here like the cache does)."""
        for layer in range(self.cfg.num_layers):
            self.k[seq][layer].extend(self._stored(np.asarray(k[layer])))
            self.v[seq][layer].extend(self._stored(np.asarray(v[layer])))

    def _stored(self, rows: np.ndarray) -> np.ndarray:
        """What the cache gives back for ``rows [T, H, D]``: cast to the storage dtype, or for int8 each
        ``[H, D]`` row quantized on its own and dequantized to float32; bfloat16: rounded, widened to float32."""
        if self.cfg.bfloat16:
            return bf16.to_float32(bf16.to_bits(rows))
        if self.cfg.quantized:
            return np.array([quant.dequantize(*quant.quantize(row)) for row in rows], dtype=np.float32)
        return rows.astype(self.cfg.dtype)

    def truncate(self, seq: int, n: int) -> None:
        for layer in range(self.cfg.num_layers):
            del self.k[seq][layer][n:]
            del self.v[seq][layer][n:]

    def fork(self, seq: int, child: int) -> None:
        self.k[child] = [list(rows) for rows in self.k[seq]]
        self.v[child] = [list(rows) for rows in self.v[seq]]
        self.first[child] = self.first[seq]

    def free(self, seq: int) -> None:
        del self.k[seq], self.v[seq], self.first[seq]

    def release_before(self, seq: int, position: int) -> int:
        """The cache's rule: whole pages holding only positions < position go; returns pages released."""
        size = self.cfg.page_size
        old = self.first[seq] // size
        pages = -(-self.length(seq) // size)
        new = max(old, min(position // size, pages))
        self.first[seq] = new * size
        return new - old

    def dense(self, seq: int, layer: int):
        cfg = self.cfg
        first = self.first[seq]
        k_rows, v_rows = self.k[seq][layer][first:], self.v[seq][layer][first:]
        dtype = np.float32 if cfg.quantized or cfg.bfloat16 else cfg.dtype          # what gather gives back
        k = np.array(k_rows, dtype=dtype).reshape(len(k_rows), cfg.num_kv_heads, cfg.head_dim)
        v = np.array(v_rows, dtype=dtype).reshape(len(v_rows), cfg.num_kv_heads, cfg.head_dim_v)
        return k, v


def assert_bitwise_equal(actual: np.ndarray, expected: np.ndarray, what: str = "") -> None:
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    assert actual.tobytes() == expected.tobytes(), f"{what}: bytes differ\n{actual}\n!=\n{expected}"


def assert_matches_model(cache: kvcache.KVCache, model: DenseModel, seqs=None) -> None:
    """Every sequence's length, first position and gathered K/V (all layers) equal the model bit for bit."""
    for seq in (model.k if seqs is None else seqs):
        assert cache.length(seq) == model.length(seq), f"seq {seq}: length"
        assert cache.pool.first_position(seq) == model.first[seq], f"seq {seq}: first position"
        for layer in range(cache.config.num_layers):
            k, v = cache.gather(seq, layer)
            ek, ev = model.dense(seq, layer)
            assert_bitwise_equal(k, ek, f"seq {seq} layer {layer} K")
            assert_bitwise_equal(v, ev, f"seq {seq} layer {layer} V")


def assert_fails_unchanged(cache: kvcache.KVCache, call, error, match=None):
    """``call()`` raises ``error`` (message matching ``match``) and leaves every pool byte and all metadata
    (fingerprint) and the free-page count exactly as they were. Returns the exception info."""
    before, free = cache.fingerprint(), cache.num_free_pages
    with pytest.raises(error, match=match) as info:
        call()
    assert cache.fingerprint() == before, f"{error.__name__} changed the cache"
    assert cache.num_free_pages == free
    cache.check_invariants()
    return info


def enumerate_faults(build, op):
    """Fault injection at every point of ``op(cache, ctx)`` (``build() -> (cache, ctx)`` makes a fresh identical
    cache): a counting run lists the points, then each one fails in turn (InjectedFault, the cache unchanged,
    invariants hold) and a retry without faults equals the clean run. Returns the list of fault points."""
    cache, ctx = build()
    counter = FaultInjector()
    set_fault_hook(cache, counter)
    op(cache, ctx)
    set_fault_hook(cache, no_fault)
    expected = cache.fingerprint()
    cache.check_invariants()
    points = list(counter.points)
    assert points, "the operation passed no fault point"
    for i, point in enumerate(points):
        cache, ctx = build()
        before, free = cache.fingerprint(), cache.num_free_pages
        set_fault_hook(cache, FaultInjector(fail_at=i))
        with pytest.raises(InjectedFault, match=f"^injected fault #{i} at '{point}'$"):
            op(cache, ctx)
        assert cache.fingerprint() == before, f"fault #{i} at {point!r} changed the cache"
        assert cache.num_free_pages == free
        cache.check_invariants()
        set_fault_hook(cache, no_fault)
        op(cache, ctx)
        assert cache.fingerprint() == expected, f"retry after fault #{i} at {point!r} differs from a clean run"
        cache.check_invariants()
    return points
