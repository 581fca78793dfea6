"""The implementations a decode step is timed with, each over ``layers`` cold layers of identical data.

Every implementation has ``build()`` (untimed: allocate and fill ``layers`` layers of N - 1 tokens),
``setup(layer)`` (untimed: bring the layer back to N - 1 tokens where the step appends), ``call(layer)`` (the
timed step: write token N - 1, attend over N keys) and ``free()``.
"""
from __future__ import annotations

import gc

import numpy as np

from . import common
from .common import Data, Shape


class Impl:
    name = "?"
    description = ""

    def __init__(self, data: Data, page_size: int = common.PAGE_SIZE):
        self.data, self.shape, self.layers = data, data.shape, data.layers
        self.page_size = page_size
        self.extra: dict = {}

    def build(self) -> None: ...

    def setup(self, layer: int) -> None: ...

    def call(self, layer: int): ...

    def free(self) -> None: ...


class EngineStep(Impl):
    """`Decoder.step`: validation, slot reservation, the write, the kernel; one Decoder per layer."""
    name = "engine_step"

    def build(self) -> None:
        from decode import Decoder

        s, d = self.shape, self.data
        self.decs = []
        for layer in range(self.layers):
            dec = Decoder(num_q_heads=s.num_q_heads, num_kv_heads=s.num_kv_heads, head_dim=s.head_dim,
                          dtype=s.dtype, page_size=self.page_size, max_tokens=s.context + self.page_size)
            for _, k, v in d.chunks(layer):
                dec.append(k, v)
            self.decs.append(dec)

    def setup(self, layer: int) -> None:
        dec = self.decs[layer]
        if dec.length == self.shape.context:
            dec.truncate(self.shape.context - 1)

    def call(self, layer: int):
        d = self.data
        return self.decs[layer].step(d.q[layer], d.k_in[layer], d.v_in[layer])

    def free(self) -> None:
        self.decs = []


class EngineKernel(Impl):
    """The validating kernel wrapper `paged_decode_attention` alone, over the engine's pages (token N - 1 written
    beforehand): what the step costs without the cache bookkeeping."""
    name = "engine_kernel"

    def __init__(self, data: Data, engine: EngineStep, page_size: int = common.PAGE_SIZE):
        super().__init__(data, page_size)
        self.engine = engine

    def build(self) -> None:
        from decode.attention import paged_decode_attention

        self.fn = paged_decode_attention
        s, d = self.shape, self.data
        self.args = []
        for layer, dec in enumerate(self.engine.decs):
            if dec.length == s.context - 1:
                dec.step(d.q[layer], d.k_in[layer], d.v_in[layer])
            table = dec.cache.pool.page_table(dec.seq)
            self.args.append((d.q[layer][None], dec.cache.pool.k_pages(0), dec.cache.pool.v_pages(0), table,
                              np.array([0, len(table)], dtype=np.int64), np.zeros(1, dtype=np.int32),
                              np.array([s.context - 1], dtype=np.int64)))
        self.out = np.empty((1, s.num_q_heads, s.head_dim), dtype=np.float32)

    def call(self, layer: int):
        return self.fn(*self.args[layer], scale=self.data.scale, out=self.out)[0]

    def free(self) -> None:
        self.args = []


class NumpyContiguous(Impl):
    """NumPy over a preallocated contiguous cache ``K, V [num_kv_heads, N, head_dim]`` per layer: the new token
    is written into slot N - 1 (no copies), then batched matmul or einsum per kv-head group (whichever was faster
    for the shape in an untimed trial; float16 is upcast in chunks)."""
    name = "numpy_contiguous"

    def build(self) -> None:
        s, d = self.shape, self.data
        self.K, self.V = [], []
        for layer in range(self.layers):
            K = np.empty((s.num_kv_heads, s.context, s.head_dim), dtype=s.dtype)
            V = np.empty_like(K)
            for start, k, v in d.chunks(layer):
                K[:, start:start + len(k)] = k.transpose(1, 0, 2)
                V[:, start:start + len(v)] = v.transpose(1, 0, 2)
            K[:, -1], V[:, -1] = d.k_new[layer], d.v_new[layer]      # the step rewrites it (same values)
            self.K.append(K)
            self.V.append(V)
        self.variant = "matmul"
        self.fn = common.CONTIGUOUS_VARIANTS[self.variant]

    def choose_variant(self, rotation) -> None:
        """Time both NumPy formulations on two layers (untimed for the benchmark) and keep the faster (float32;
        float16 always upcasts per kv head and uses matmul)."""
        best = None
        variants = common.CONTIGUOUS_VARIANTS if self.shape.dtype == "float32" else {"matmul": None}
        for name in variants:                      # float16: einsum's buffered casting measured 5-10x slower
            self.fn = common.CONTIGUOUS_VARIANTS[name]
            layers = [next(rotation) for _ in range(2)]
            t = common.time_calls(self.call, [(layer,) for layer in layers])
            self.extra[f"trial_{name}_s"] = t
            if best is None or t < best[0]:
                best = (t, name)
        self.variant = best[1]
        self.fn = common.CONTIGUOUS_VARIANTS[self.variant]
        self.extra["variant"] = self.variant

    def call(self, layer: int):
        d, n = self.data, self.shape.context - 1
        K, V = self.K[layer], self.V[layer]
        K[:, n] = d.k_new[layer]
        V[:, n] = d.v_new[layer]
        return self.fn(d.q[layer], K, V, d.scale)

    def free(self) -> None:
        self.K, self.V = [], []


class TorchSDPA(Impl):
    """torch.nn.functional.scaled_dot_product_attention(q, K, V, enable_gqa=True) on CPU (2 threads) over the
    same contiguous cache (torch.from_numpy: no copy); the new token is written into slot N - 1 first. float16
    storage runs torch in float16 (the same bytes)."""
    name = "torch_sdpa"

    def __init__(self, data: Data, contiguous: NumpyContiguous, page_size: int = common.PAGE_SIZE, write=True):
        super().__init__(data, page_size)
        self.contiguous, self.write = contiguous, write

    def build(self) -> None:
        import torch
        import torch.nn.functional as F

        torch.set_num_threads(2)
        self.torch, self.sdpa = torch, F.scaled_dot_product_attention
        s, d = self.shape, self.data
        qdt = torch.float16 if s.dtype == "float16" else torch.float32
        self.q = [torch.from_numpy(d.q[layer]).to(qdt).reshape(1, s.num_q_heads, 1, s.head_dim)
                  for layer in range(self.layers)]
        self.k_new = [torch.from_numpy(d.k_new[layer]) for layer in range(self.layers)]
        self.v_new = [torch.from_numpy(d.v_new[layer]) for layer in range(self.layers)]
        self.K = [torch.from_numpy(K)[None] for K in self.contiguous.K]      # [1, kv_heads, N, head_dim]
        self.V = [torch.from_numpy(V)[None] for V in self.contiguous.V]
        self.extra["torch"] = torch.__version__
        self.extra["torch_threads"] = torch.get_num_threads()

    def call(self, layer: int):
        K, V = self.K[layer], self.V[layer]
        if self.write:
            n = self.shape.context - 1
            K[0, :, n] = self.k_new[layer]
            V[0, :, n] = self.v_new[layer]
        return self.sdpa(self.q[layer], K, V, scale=self.data.scale, enable_gqa=True)


class TorchSDPABare(TorchSDPA):
    """A bare torch SDPA call (q, K, V ready as tensors; no cache write): the per-call floor of torch."""
    name = "torch_sdpa_bare"

    def __init__(self, data: Data, contiguous: NumpyContiguous, page_size: int = common.PAGE_SIZE):
        super().__init__(data, contiguous, page_size, write=False)

    def free(self) -> None:
        self.K, self.V, self.q = [], [], []


class NaiveConcat(Impl):
    """The source document's cache: ``K, V [length, num_kv_heads, head_dim]`` grown by np.concatenate at every
    step (a full copy), then NumPy attention (einsum, float16 upcast). Each timed call copies the layer's N - 1
    cached tokens plus the new one into a fresh array, exactly as the naive decode loop does at length N."""
    name = "naive_concat"

    def build(self) -> None:
        s, d = self.shape, self.data
        self.K, self.V = [], []
        for layer in range(self.layers):
            K = np.empty((s.context - 1, s.num_kv_heads, s.head_dim), dtype=s.dtype)
            V = np.empty_like(K)
            for start, k, v in d.chunks(layer):
                K[start:start + len(k)], V[start:start + len(v)] = k, v
            self.K.append(K)
            self.V.append(V)
        self.extra["bytes_copied_per_step"] = self.shape.kv_bytes

    def call(self, layer: int):
        d = self.data
        K = np.concatenate([self.K[layer], d.k_new[layer][None]])
        V = np.concatenate([self.V[layer], d.v_new[layer][None]])
        return common.naive_attention(d.q[layer], K, V, d.scale)

    def free(self) -> None:
        self.K, self.V = [], []


BIG = 256 * common.MiB          # collect cycles explicitly only when this much K/V was just dropped (gc costs ~0.1 s)

IMPL_ORDER = ("engine_step", "engine_kernel", "numpy_contiguous", "torch_sdpa", "naive_concat")
TINY_ORDER = ("engine_step", "engine_kernel", "numpy_contiguous", "torch_sdpa", "torch_sdpa_bare", "naive_concat")


class ShapeState:
    """The data and the live implementations of the shape being benchmarked; implementations are built on first
    use and dropped as soon as the next one that cannot share their memory is built, so one shape at a time (and
    at most two copies of its K/V) is in memory."""

    current: "ShapeState | None" = None

    def __init__(self, shape: Shape, layers: int, page_size: int = common.PAGE_SIZE):
        self.shape, self.layers, self.page_size = shape, layers, page_size
        self.data = Data(shape, layers)
        self.impls: dict[str, Impl] = {}
        self._reference = None

    @classmethod
    def get(cls, shape: Shape, layers: int, page_size: int = common.PAGE_SIZE) -> "ShapeState":
        cur = cls.current
        if cur is None or (cur.shape, cur.layers, cur.page_size) != (shape, layers, page_size):
            if cur is not None:
                cur.close()
                cls.current = None
                if cur.shape.kv_bytes * cur.layers > BIG:
                    gc.collect()
            cls.current = cls(shape, layers, page_size)
        return cls.current

    def reference(self) -> np.ndarray:
        if self._reference is None:
            self._reference = self.data.reference(0)
        return self._reference

    def impl(self, name: str) -> Impl:
        if name in self.impls:
            return self.impls[name]
        keep = {"engine_kernel": {"engine_step"}, "torch_sdpa": {"numpy_contiguous"},
                "torch_sdpa_bare": {"numpy_contiguous"}}.get(name, set())
        freed = False
        for other in list(self.impls):
            if other not in keep:
                self.impls.pop(other).free()
                freed = True
        if freed and self.shape.kv_bytes * self.layers > BIG:
            gc.collect()
        d = self.data
        if name == "engine_step":
            impl = EngineStep(d, self.page_size)
        elif name == "engine_kernel":
            impl = EngineKernel(d, self.impl("engine_step"), self.page_size)
        elif name == "numpy_contiguous":
            impl = NumpyContiguous(d)
        elif name == "torch_sdpa":
            impl = TorchSDPA(d, self.impl("numpy_contiguous"))
        elif name == "torch_sdpa_bare":
            impl = TorchSDPABare(d, self.impl("numpy_contiguous"))
        elif name == "naive_concat":
            impl = NaiveConcat(d)
        else:
            raise ValueError(name)
        impl.build()
        self.impls[name] = impl
        return impl

    def close(self) -> None:
        for impl in self.impls.values():
            impl.free()
        self.impls.clear()
