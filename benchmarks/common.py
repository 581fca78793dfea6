"""Shared pieces of the benchmark suite: shapes, the machine's measured ceilings, the baselines, the cold
multi-layer workloads and the per-benchmark metrics (see docs/benchmarks.md).

Everything here is plain NumPy / Numba; torch is imported lazily and only by the torch baseline.
"""
from __future__ import annotations

import itertools
import math
import os
import time
from dataclasses import dataclass

import numpy as np
from numba import njit, prange

GiB = 1 << 30
MiB = 1 << 20

# Pages of 64 tokens: the kernel works in 64-token blocks and 64 measured 10-15% faster than 16
# (shared/notes/measured-facts.md). The Decoder default (16) is measured separately (test_operations.py).
PAGE_SIZE = 64

# "Cold" as a real model runs: one decoder per layer, stepped in rotation, and enough layers that the K/V of all
# of them is far larger than the last-level cache, so every step streams its layer's K/V from DRAM.
COLD_BYTES = GiB
MIN_LAYERS = 2
MAX_LAYERS = 1024
QUICK_COLD_BYTES = 4 * MiB


# ----------------------------------------------------------------------------------------------------------------
# shapes
# ----------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Shape:
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    context: int            # keys attended by the step (the new token included)
    dtype: str              # storage dtype: "float32" | "float16"

    @property
    def itemsize(self) -> int:
        return np.dtype(self.dtype).itemsize

    @property
    def group(self) -> int:
        return self.num_q_heads // self.num_kv_heads

    @property
    def attention(self) -> str:
        if self.num_kv_heads == self.num_q_heads:
            return "MHA"
        return "MQA" if self.num_kv_heads == 1 else "GQA"

    @property
    def kv_bytes(self) -> int:
        """K and V bytes one step must read (one layer)."""
        return self.context * self.num_kv_heads * 2 * self.head_dim * self.itemsize

    @property
    def flops(self) -> int:
        """q.K and p.V multiply-adds of one step: 4 * num_q_heads * N * head_dim."""
        return 4 * self.num_q_heads * self.context * self.head_dim

    @property
    def label(self) -> str:
        return (f"{self.attention}-q{self.num_q_heads}kv{self.num_kv_heads}d{self.head_dim}"
                f"-n{self.context}-{'fp16' if self.dtype == 'float16' else 'fp32'}")

    def info(self) -> dict:
        return {"num_q_heads": self.num_q_heads, "num_kv_heads": self.num_kv_heads, "head_dim": self.head_dim,
                "context": self.context, "dtype": self.dtype, "attention": self.attention, "shape": self.label}


def grid_shapes(quick: bool) -> list[Shape]:
    """The main grid: 32 query heads, head_dim 128, kv heads 32/8/1, contexts 512/4096/32768, fp32 and fp16.
    --quick: a few small shapes of the same kinds."""
    if quick:
        return [Shape(8, kv, 32, n, dt) for kv in (8, 2, 1) for n in (64, 300) for dt in ("float32", "float16")]
    return [Shape(32, kv, 128, n, dt) for kv in (32, 8, 1) for n in (512, 4096, 32768)
            for dt in ("float32", "float16")]


def tiny_shapes(quick: bool) -> list[Shape]:
    """Per-call overhead: 8 q heads / 2 kv heads, head_dim 64, 1..64 tokens."""
    contexts = (1, 16) if quick else (1, 4, 16, 64)
    return [Shape(8, 2, 64, n, "float32") for n in contexts]


def layers_for(shape: Shape, quick: bool) -> int:
    target = QUICK_COLD_BYTES if quick else COLD_BYTES
    return int(min(MAX_LAYERS, max(MIN_LAYERS, math.ceil(target / shape.kv_bytes))))


# ----------------------------------------------------------------------------------------------------------------
# the machine's ceilings, measured inside the session
# ----------------------------------------------------------------------------------------------------------------
@njit(parallel=True, fastmath=True, cache=True)
def _stream_sum(rows):
    """float32 sum of ``rows [R, 4096]``, one row per prange iteration (the inner loop over a 1-D row vectorises;
    a loop over a computed index range did not, and measured 4 GB/s instead of 25)."""
    part = np.zeros(rows.shape[0], dtype=np.float32)
    for r in prange(rows.shape[0]):
        row = rows[r]
        s = np.float32(0.0)
        for i in range(row.size):
            s += row[i]
        part[r] = s
    return part.sum()


def measure_read_bandwidth(nbytes: int = GiB, repeats: int = 7, threads: int = 2) -> dict:
    """Streaming read rate (bytes/s): a numba prange float32 sum over ``nbytes`` on ``threads`` threads,
    median of ``repeats`` (the array is touched once before timing)."""
    import numba

    numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
    a = np.ones(nbytes // 4, dtype=np.float32).reshape(-1, 4096)
    _stream_sum(a)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        _stream_sum(a)
        times.append(time.perf_counter() - t0)
    del a
    med = float(np.median(times))
    return {"read_bw": nbytes / med, "read_bw_best": nbytes / min(times), "read_bw_bytes": nbytes,
            "read_bw_threads": numba.get_num_threads(), "read_bw_samples": [nbytes / t for t in times]}


def measure_matmul_rate(n: int = 2048, repeats: int = 5) -> dict:
    """numpy float32 matmul rate (FLOP/s) of ``n x n x n``, median of ``repeats``."""
    rng = np.random.default_rng(0)
    a = rng.standard_normal((n, n), dtype=np.float32)
    b = rng.standard_normal((n, n), dtype=np.float32)
    c = a @ b
    np.matmul(a, b, out=c)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.matmul(a, b, out=c)
        times.append(time.perf_counter() - t0)
    flops = 2.0 * n ** 3
    med = float(np.median(times))
    return {"matmul_rate": flops / med, "matmul_rate_best": flops / min(times), "matmul_n": n,
            "matmul_samples": [flops / t for t in times]}


class Ceilings(dict):
    """The session's ceilings (``read_bw``, ``matmul_rate``, measured once at the start) plus `near`: the same two
    probes, smaller, re-measured right before each group of benchmarks (one shape), so the fractions of a group
    are relative to what the machine could do at that moment (other jobs share these 2 cores; the session-start
    bandwidth and the one at the end differed by up to 2x)."""

    def __init__(self, session: dict, quick: bool):
        super().__init__(session)
        self.quick = quick
        self._key, self._near = None, None

    def near(self, key) -> dict:
        if self.quick:
            return dict(self, probe="session")
        if key != self._key:
            bw = measure_read_bandwidth(nbytes=512 * MiB, repeats=5)
            mm = measure_matmul_rate(n=2048, repeats=3)
            self._near = {"read_bw": bw["read_bw"], "matmul_rate": mm["matmul_rate"], "probe": f"before {key}",
                          "session_read_bw": self["read_bw"], "session_matmul_rate": self["matmul_rate"]}
            self._key = key
        return dict(self._near)


def metrics(seconds: float, kv_bytes: float, flops: float, ceilings: dict) -> dict:
    """Effective rates and their fractions of the session's ceilings; roofline bound = max(bytes / read_bw,
    flops / matmul_rate), fraction_of_roofline = bound / measured time."""
    bw, mm = ceilings["read_bw"], ceilings["matmul_rate"]
    bound = max(kv_bytes / bw, flops / mm)
    return {
        "seconds": seconds,
        "gb_per_s": kv_bytes / seconds / 1e9,
        "gflop_per_s": flops / seconds / 1e9,
        "frac_bandwidth": kv_bytes / seconds / bw,
        "frac_matmul": flops / seconds / mm,
        "roofline_s": bound,
        "bound": "bandwidth" if kv_bytes / bw >= flops / mm else "compute",
        "fraction_of_roofline": bound / seconds,
    }


def record(benchmark, ceilings: dict, kv_bytes: float, flops: float, per_call: int = 1, **info) -> None:
    """Store the shape/implementation info and, when the benchmark was timed, the metrics of its median
    (divided by ``per_call`` when one timed call covers several steps)."""
    benchmark.extra_info.update(info)
    benchmark.extra_info.update({"kv_bytes": int(kv_bytes), "flops": int(flops), "per_call": per_call,
                                 "read_bw": ceilings["read_bw"], "matmul_rate": ceilings["matmul_rate"]})
    for key in ("probe", "session_read_bw", "session_matmul_rate"):
        if key in ceilings:
            benchmark.extra_info[key] = ceilings[key]
    stats = getattr(getattr(benchmark, "stats", None), "stats", None)
    if stats is not None and stats.median > 0:
        benchmark.extra_info.update(metrics(stats.median / per_call, kv_bytes, flops, ceilings))


# ----------------------------------------------------------------------------------------------------------------
# attention baselines (one query token, GQA by reshaping q to [kv_heads, group, head_dim])
# ----------------------------------------------------------------------------------------------------------------
def _softmax_rows(s: np.ndarray) -> np.ndarray:
    s -= s.max(axis=-1, keepdims=True)
    np.exp(s, out=s)
    s /= s.sum(axis=-1, keepdims=True)
    return s


def naive_attention(q: np.ndarray, K: np.ndarray, V: np.ndarray, scale: float) -> np.ndarray:
    """The source document's way: ``K, V [N, num_kv_heads, head_dim]`` (token-major, as np.concatenate grows
    them), scores = q K^T * scale, softmax, weights V; float16 storage is upcast first."""
    if K.dtype != np.float32:
        K, V = K.astype(np.float32), V.astype(np.float32)
    h, g = K.shape[1], q.shape[0] // K.shape[1]
    qg = q.reshape(h, g, -1)
    s = np.einsum("hgd,nhd->hgn", qg, K) * np.float32(scale)
    p = _softmax_rows(s)
    return np.einsum("hgn,nhd->hgd", p, V).reshape(q.shape[0], -1)


def contiguous_attention_matmul(q, K, V, scale):
    """NumPy over a contiguous cache ``K, V [num_kv_heads, N, head_dim]``: batched matmul per kv head with q
    reshaped to ``[num_kv_heads, group, head_dim]``. float16 storage is upcast one kv head at a time."""
    h, g = K.shape[0], q.shape[0] // K.shape[0]
    qg = q.reshape(h, g, -1) * np.float32(scale)
    if K.dtype == np.float32:
        p = _softmax_rows(np.matmul(qg, K.transpose(0, 2, 1)))              # [h, g, N]
        return np.matmul(p, V).reshape(q.shape[0], -1)
    out = np.empty((h, g, V.shape[2]), dtype=np.float32)
    for i in range(h):
        Kf, Vf = K[i].astype(np.float32), V[i].astype(np.float32)
        p = _softmax_rows(qg[i] @ Kf.T)
        np.matmul(p, Vf, out=out[i])
    return out.reshape(q.shape[0], -1)


def contiguous_attention_einsum(q, K, V, scale):
    """The same with np.einsum (unoptimised einsum streams K once with its own inner loop; float16 is cast in
    buffered chunks by the iterator)."""
    h, g = K.shape[0], q.shape[0] // K.shape[0]
    qg = q.reshape(h, g, -1) * np.float32(scale)
    s = np.einsum("hgd,hnd->hgn", qg, K, dtype=np.float32, casting="same_kind")
    p = _softmax_rows(s)
    return np.einsum("hgn,hnd->hgd", p, V, dtype=np.float32, casting="same_kind").reshape(q.shape[0], -1)


CONTIGUOUS_VARIANTS = {"matmul": contiguous_attention_matmul, "einsum": contiguous_attention_einsum}


def reference_attention(q: np.ndarray, K: np.ndarray, V: np.ndarray, scale: float) -> np.ndarray:
    """float64 check value; ``K, V [N, num_kv_heads, head_dim]``."""
    h, g = K.shape[1], q.shape[0] // K.shape[1]
    out = np.empty((q.shape[0], V.shape[2]))
    for i in range(h):
        Kh, Vh = K[:, i].astype(np.float64), V[:, i].astype(np.float64)
        s = (q[i * g:(i + 1) * g].astype(np.float64) @ Kh.T) * scale
        s = np.exp(s - s.max(axis=1, keepdims=True))
        out[i * g:(i + 1) * g] = (s / s.sum(axis=1, keepdims=True)) @ Vh
    return out


# ----------------------------------------------------------------------------------------------------------------
# the data: identical K/V, queries and new tokens for every implementation
# ----------------------------------------------------------------------------------------------------------------
class Data:
    """Deterministic K/V for ``layers`` layers of ``shape``: tokens come in chunks drawn from a small bank of
    random chunks (the values do not change the timings; building 1 GiB of fresh random numbers per shape
    would), so every implementation is filled with the same bytes.

    ``q[l] [num_q_heads, head_dim]`` float32, ``k_new[l]``, ``v_new[l] [num_kv_heads, head_dim]`` storage dtype:
    the step's query and the token appended at position N - 1 (``k_in``, ``v_in``: the same values in float32,
    what the engine is given, as a model's projections are)."""

    CHUNK = 256
    BANK = 8

    def __init__(self, shape: Shape, layers: int, seed: int = 0):
        self.shape, self.layers = shape, layers
        rng = np.random.default_rng(seed)
        s, dt = shape, np.dtype(shape.dtype)
        bank = min(self.BANK, max(1, -(-(layers * max(shape.context - 1, 1)) // self.CHUNK)))
        dims = (bank, self.CHUNK, s.num_kv_heads, s.head_dim)
        self.k_bank = rng.standard_normal(dims, dtype=np.float32).astype(dt)
        self.v_bank = rng.standard_normal(dims, dtype=np.float32).astype(dt)
        self.q = rng.standard_normal((layers, s.num_q_heads, s.head_dim), dtype=np.float32)
        self.k_new = rng.standard_normal((layers, s.num_kv_heads, s.head_dim), dtype=np.float32).astype(dt)
        self.v_new = rng.standard_normal((layers, s.num_kv_heads, s.head_dim), dtype=np.float32).astype(dt)
        # the same new token as a model produces it (float32, cast to the storage dtype by the engine)
        self.k_in, self.v_in = self.k_new.astype(np.float32), self.v_new.astype(np.float32)
        # per-layer lists of views: indexing them inside a timed call costs a list lookup, not a view creation
        for name in ("q", "k_new", "v_new", "k_in", "v_in"):
            setattr(self, name, list(getattr(self, name)))
        self.scale = 1.0 / math.sqrt(s.head_dim)

    def chunks(self, layer: int, count: int | None = None):
        """Yield ``(start, k [n, num_kv_heads, head_dim], v)`` covering positions ``0 .. count - 1``
        (default N - 1: everything before the step's own token)."""
        count = self.shape.context - 1 if count is None else count
        for i, start in enumerate(range(0, count, self.CHUNK)):
            j = (layer * 3 + i) % len(self.k_bank)
            n = min(self.CHUNK, count - start)
            yield start, self.k_bank[j, :n], self.v_bank[j, :n]

    def dense(self, layer: int) -> tuple[np.ndarray, np.ndarray]:
        """``K, V [N, num_kv_heads, head_dim]`` of ``layer`` with the new token last (storage dtype)."""
        s = self.shape
        K = np.empty((s.context, s.num_kv_heads, s.head_dim), dtype=s.dtype)
        V = np.empty_like(K)
        for start, k, v in self.chunks(layer):
            K[start:start + len(k)], V[start:start + len(k)] = k, v
        K[-1], V[-1] = self.k_new[layer], self.v_new[layer]
        return K, V

    def reference(self, layer: int = 0) -> np.ndarray:
        K, V = self.dense(layer)
        return reference_attention(self.q[layer], K, V, self.scale)


def check_close(name: str, got, expected: np.ndarray, dtype: str) -> None:
    """Every implementation must compute the same thing before its timing counts."""
    got = np.asarray(got, dtype=np.float64).reshape(expected.shape)
    tol = 2e-3 if dtype == "float16" else 2e-4
    err = float(np.max(np.abs(got - expected)))
    if not err <= tol * max(1.0, float(np.max(np.abs(expected)))):
        raise AssertionError(f"{name}: max abs error {err:.3g} vs the float64 reference (tolerance {tol:g})")


class Rotation:
    """Layer index for each timed call: 0, 1, .., layers - 1, 0, .. (so a layer is revisited only after every
    other layer's K/V went through the cache)."""

    def __init__(self, layers: int):
        self.layers = layers
        self._it = itertools.cycle(range(layers))

    def __next__(self) -> int:
        return next(self._it)


# ----------------------------------------------------------------------------------------------------------------
# other processes: the machine has 2 cores and is shared; every timing records how much CPU others used meanwhile
# ----------------------------------------------------------------------------------------------------------------
DISTURBED_CORES = 0.2       # others used more than this many cores on average during a timing: "disturbed"


def _machine_busy_s():
    """(busy, steal) CPU seconds of the whole machine so far (/proc/stat), or None off Linux."""
    try:
        with open("/proc/stat") as f:
            vals = [int(x) for x in f.readline().split()[1:9]]
    except (OSError, ValueError):
        return None
    user, nice, system, idle, iowait, irq, softirq, steal = vals
    hz = os.sysconf("SC_CLK_TCK")
    return (user + nice + system + irq + softirq) / hz, steal / hz


def _own_cpu_s() -> float:
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


class OtherLoad:
    """Context manager: ``others`` = CPU cores used on average by every other process while the block ran
    (machine busy time minus this process's and its waited children's), ``steal`` = cores the hypervisor took;
    None for blocks shorter than 0.25 s (the kernel counts in 10 ms ticks)."""

    def __enter__(self):
        self.others = self.steal = None
        self._m0, self._own0, self._t0 = _machine_busy_s(), _own_cpu_s(), time.perf_counter()
        return self

    def __exit__(self, *exc):
        m1, own1, wall = _machine_busy_s(), _own_cpu_s(), time.perf_counter() - self._t0
        if self._m0 is not None and m1 is not None and wall >= 0.25:       # /proc/stat counts 10 ms ticks
            self.others = max(0.0, ((m1[0] - self._m0[0]) - (own1 - self._own0)) / wall)
            self.steal = max(0.0, (m1[1] - self._m0[1]) / wall)
        return False


def pedantic(benchmark, target, **kwargs):
    """`benchmark.pedantic` that also records the other processes' CPU use during the timing
    (extra_info ``other_cpu_cores``, ``steal_cores``, ``disturbed``)."""
    with OtherLoad() as load:
        result = benchmark.pedantic(target, **kwargs)
    if load.others is not None:
        benchmark.extra_info.update({"other_cpu_cores": load.others, "steal_cores": load.steal,
                                     "disturbed": load.others > DISTURBED_CORES})
    return result


def write_results(text: str, payload: dict, out_json=None, out_markdown=None) -> None:
    """Print a comparison's tables; save its JSON and its markdown where asked (the peer / serving drivers)."""
    import json

    print(text)
    if out_json:
        with open(out_json, "w") as f:
            json.dump(payload, f, indent=1)
    if out_markdown:
        with open(out_markdown, "w") as f:
            f.write(text + "\n")


def choose_rounds(seconds_per_call: float, budget: float, minimum: int = 5, maximum: int = 5000) -> int:
    return int(min(maximum, max(minimum, budget / max(seconds_per_call, 1e-7))))


def time_calls(fn, args_list) -> float:
    """Median wall time of ``fn(*args)`` over ``args_list`` (used to size the rounds and pick variants)."""
    times = []
    for args in args_list:
        t0 = time.perf_counter()
        fn(*args)
        times.append(time.perf_counter() - t0)
    return float(np.median(times))
