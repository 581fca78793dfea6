"""The demo's model: a small random-weight decoder-only transformer in NumPy, and the three ways it attends.

`TinyTransformer`: token embedding -> ``layers`` x [RMSNorm -> GQA attention with RoPE at absolute positions ->
residual -> RMSNorm -> SwiGLU MLP -> residual] -> RMSNorm -> LM head. It is a model, not engine code: the engine
only sees its q/k/v through the ``attend(layer, q, k, v)`` callback of `TinyTransformer.forward`. Used by
`kvengine demo` (`decode.app.demo`), its tests, and the prefix-caching chat benchmark.

``cfg`` is any object with the model fields ``vocab, d_model, layers, num_q_heads, num_kv_heads, head_dim, d_ff,
seed`` (`decode.app.demo.DemoConfig` has them).

The three ways of attending: `engine_forward` (a `Decoder`, one transaction per call), `naive_forward` (the
document's ``np.concatenate`` cache with float64 NumPy attention) and `reference_logits` (no cache at all: one
float64 pass with dense causal attention).
"""
from __future__ import annotations

import math
import time

import numpy as np

from reference.dense import attention_context
from reference.naive_cache import NaiveKVCache

from decode import Decoder

LOGIT_SCALE = 4.0      # standard deviation of the logits (the LM head's scale)
BRANCH = 0.5           # each residual branch adds ~0.5 of the stream's rms


class TinyTransformer:
    """Random-weight decoder-only transformer; ``forward`` takes an ``attend(layer, q, k, v) -> context``
    callback, so one set of code serves the engine, the naive cache, the draft and the no-cache reference.

    Shapes: ``q [T, num_q_heads, head_dim]``, ``k, v [T, num_kv_heads, head_dim]`` (after RoPE, at absolute
    positions ``start .. start + T - 1``), context ``[T, num_q_heads, head_dim]``.
    """

    def __init__(self, cfg, dtype=np.float32):
        rng = np.random.default_rng(cfg.seed)
        self.cfg, self.dtype = cfg, np.dtype(dtype)
        d, hq, hkv, hd, f = cfg.d_model, cfg.num_q_heads, cfg.num_kv_heads, cfg.head_dim, cfg.d_ff
        branch = BRANCH                                  # each residual branch adds ~0.5 of the stream's rms
        qk_gain = 1.5                                 # scores q.k / sqrt(head_dim) with std ~2: peaked, not one-hot

        def normal(shape, std):
            return rng.standard_normal(shape) * std

        w = {"embed": normal((cfg.vocab, d), 1.0),
             "final_norm": 1.0 + normal(d, 0.1),
             "lm_head": normal((d, cfg.vocab), LOGIT_SCALE / math.sqrt(d))}
        for layer in range(cfg.layers):
            w.update({
                f"{layer}.attn_norm": 1.0 + normal(d, 0.1),
                f"{layer}.wq": normal((d, hq * hd), qk_gain / math.sqrt(d)),
                f"{layer}.wk": normal((d, hkv * hd), qk_gain / math.sqrt(d)),
                f"{layer}.wv": normal((d, hkv * hd), 1.0 / math.sqrt(d)),
                f"{layer}.wo": normal((hq * hd, d), branch / math.sqrt(hq * hd)),
                f"{layer}.mlp_norm": 1.0 + normal(d, 0.1),
                f"{layer}.w_gate": normal((d, f), 1.0 / math.sqrt(d)),
                f"{layer}.w_up": normal((d, f), 1.0 / math.sqrt(d)),
                f"{layer}.w_down": normal((f, d), 2 * branch / math.sqrt(f)),
            })
        self.master = w                                                     # float64
        self.w = {name: a.astype(self.dtype) for name, a in w.items()}
        self.inv_freq = 10000.0 ** (-np.arange(0, hd, 2) / hd)             # RoPE, float64 [head_dim / 2]
        self.num_parameters = sum(a.size for a in w.values())

    def astype(self, dtype) -> "TinyTransformer":
        """The same weights, arithmetic in ``dtype``."""
        other = object.__new__(TinyTransformer)
        other.__dict__.update(self.__dict__)
        other.dtype = np.dtype(dtype)
        other.w = {name: a.astype(other.dtype) for name, a in self.master.items()}
        return other

    def quantized(self, bits: int) -> "TinyTransformer":
        """The draft model: every weight matrix rounded to ``bits``-bit integers with one scale per output
        column (symmetric, 2**(bits-1) - 1 levels each side); norms kept as they are."""
        other = self.astype(self.dtype)
        levels = 2 ** (bits - 1) - 1
        master = {}
        for name, a in self.master.items():
            if a.ndim == 2:
                step = np.abs(a).max(axis=0, keepdims=True) / levels
                a = np.round(a / step) * step
            master[name] = a
        other.master = master
        other.w = {name: a.astype(other.dtype) for name, a in master.items()}
        return other

    def _rms_norm(self, x, gain):
        ms = np.mean(np.square(x), axis=-1, keepdims=True)
        return x / np.sqrt(ms + self.dtype.type(1e-6)) * gain

    def _rope(self, x, positions):
        """Rotate-half RoPE of ``x [T, H, head_dim]`` at absolute ``positions [T]`` (angles in float64)."""
        angles = positions[:, None].astype(np.float64) * self.inv_freq[None, :]      # [T, head_dim / 2]
        cos = np.cos(angles)[:, None, :].astype(self.dtype)
        sin = np.sin(angles)[:, None, :].astype(self.dtype)
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
        return np.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)

    def forward(self, tokens, start: int, attend) -> np.ndarray:
        """Logits ``[T, vocab]`` of ``tokens [T]`` at positions ``start ..``."""
        cfg, w = self.cfg, self.w
        tokens = np.asarray(tokens, dtype=np.int64)
        positions = np.arange(start, start + len(tokens))
        x = w["embed"][tokens]                                                       # [T, d_model]
        for layer in range(cfg.layers):
            h = self._rms_norm(x, w[f"{layer}.attn_norm"])
            q = self._rope((h @ w[f"{layer}.wq"]).reshape(len(tokens), cfg.num_q_heads, cfg.head_dim), positions)
            k = self._rope((h @ w[f"{layer}.wk"]).reshape(len(tokens), cfg.num_kv_heads, cfg.head_dim), positions)
            v = (h @ w[f"{layer}.wv"]).reshape(len(tokens), cfg.num_kv_heads, cfg.head_dim)
            ctx = np.asarray(attend(layer, q, k, v), dtype=self.dtype)
            x = x + ctx.reshape(len(tokens), -1) @ w[f"{layer}.wo"]
            h = self._rms_norm(x, w[f"{layer}.mlp_norm"])
            gate = h @ w[f"{layer}.w_gate"]
            x = x + (gate / (1 + np.exp(-gate)) * (h @ w[f"{layer}.w_up"])) @ w[f"{layer}.w_down"]
        return self._rms_norm(x, w["final_norm"]) @ w["lm_head"]


# ----------------------------------------------------------------------------------------------------------
# the three ways of attending: engine, naive concat cache, no cache at all
# ----------------------------------------------------------------------------------------------------------

def engine_forward(model, dec: Decoder, tokens, timer=None) -> np.ndarray:
    """Append ``tokens`` to ``dec`` in one transaction (``extend`` for several, ``step`` for one) -> logits."""
    tokens = list(tokens)
    single = len(tokens) == 1

    def attend(layer, q, k, v):
        t0 = time.perf_counter()
        out = tx.step(layer, q[0], k[0], v[0])[None] if single else tx.extend(layer, q, k, v)
        if timer is not None:
            timer[0] += time.perf_counter() - t0
        return out

    start = dec.length
    with dec.transaction(len(tokens)) as tx:
        return model.forward(tokens, start, attend)


def naive_attention(q, k_all, v_all, start: int) -> np.ndarray:
    """float64 GQA attention of ``q [T, Hq, D]`` at positions ``start ..`` over ``k_all [L, Hkv, D]``."""
    t, hq, d = q.shape
    hkv = k_all.shape[1]
    qg = q.astype(np.float64).reshape(t, hkv, hq // hkv, d)
    scores = np.einsum("thgd,lhd->thgl", qg, k_all) / math.sqrt(d)
    if t > 1:
        visible = np.arange(k_all.shape[0])[None, :] <= (start + np.arange(t))[:, None]        # [T, L]
        scores = np.where(visible[:, None, None, :], scores, -np.inf)
    scores -= scores.max(axis=-1, keepdims=True)
    weights = np.exp(scores)
    weights /= weights.sum(axis=-1, keepdims=True)
    return np.einsum("thgl,lhd->thgd", weights, v_all).reshape(t, hq, d)


def naive_forward(model, caches: list[NaiveKVCache], tokens, storage, timer=None) -> np.ndarray:
    """The yardstick: per layer a `NaiveKVCache` (``np.concatenate`` per append) holding K/V rounded to the
    storage dtype, float64 NumPy attention."""
    def attend(layer, q, k, v):
        t0 = time.perf_counter()
        cache = caches[layer]
        start = cache.append(k.astype(storage), v.astype(storage))
        out = naive_attention(q, cache.k, cache.v, start)
        if timer is not None:
            timer[0] += time.perf_counter() - t0
        return out

    return model.forward(tokens, caches[0].length, attend)


def reference_logits(model64, tokens) -> np.ndarray:
    """No cache at all: one float64 forward pass over the whole sequence, dense causal attention
    (`reference.dense.attention_context`, query i reads keys <= i), GQA by repeating the KV heads."""
    group = model64.cfg.num_q_heads // model64.cfg.num_kv_heads

    def attend(layer, q, k, v):
        qh = q.transpose(1, 0, 2)[None]                                     # [1, Hq, L, D]
        kh = np.repeat(k, group, axis=1).transpose(1, 0, 2)[None]
        vh = np.repeat(v, group, axis=1).transpose(1, 0, 2)[None]
        return attention_context(qh, kh, vh, query_start=0)[0].transpose(1, 0, 2)

    return model64.forward(tokens, 0, attend)
