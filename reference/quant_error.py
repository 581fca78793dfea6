"""Error budget of quantized K/V storage, in float64 NumPy (imports nothing of ours): the attention output of one
query over K/V stored in a format, against the output over the unquantized K/V.

Formats, each a pure function ``x [..., head_dim] float64 -> what a reader of that storage gets back``:

- `int8_rows_rounded_up` -- the engine's int8 format re-derived here independently (issue 11): a float16 scale
  per 32 values of each row, ``max|x| / 127`` rounded UP to a float16, values ``rint(x / scale)`` with the
  stored scale.
- `q8_0` -- llama.cpp's q8_0 block (ggml ``quantize_row_q8_0_ref``): ``d = max|x| / 127`` in float32,
  values ``roundf(x * (1 / d))`` with the *unrounded* d, d stored as float16; read back as ``q * fp16(d)``.
- `float16` -- plain float16 storage, for scale.

Data (`make_case`): 32 query heads, 8 kv heads, head_dim 128, 4096 tokens, one query at the last position;
q, K, V independent N(0, 1); ``outliers=True`` multiplies 8 of the 128 key channels (the same 8 for every kv
head and token, chosen by the seed) by 6, the per-channel key outliers KIVI / KVQuant describe.
Metric: relative L2 error ``||out - ref||_2 / ||ref||_2`` over all heads' outputs.

    python -m reference.quant_error          the table of docs/int8.md (seeds 0..4)
"""
from __future__ import annotations

import numpy as np

GROUP = 32
OUTLIER_CHANNELS = 8
OUTLIER_FACTOR = 6.0


def _groups(x: np.ndarray) -> np.ndarray:
    d = x.shape[-1]
    assert d % GROUP == 0, "head_dim: expected a multiple of 32 here"
    return x.reshape(x.shape[:-1] + (d // GROUP, GROUP))


def int8_rows_rounded_up(x: np.ndarray) -> np.ndarray:
    g = _groups(np.asarray(x, dtype=np.float64))
    exact = np.abs(g).max(axis=-1, keepdims=True) / 127.0
    scale = exact.astype(np.float16)
    low = scale.astype(np.float64) < exact
    scale[low] = np.nextafter(scale[low], np.float16(np.inf))
    step = scale.astype(np.float64)
    q = np.zeros_like(g)
    np.divide(g, step, out=q, where=step > 0)
    q = np.rint(q)
    assert np.abs(q).max() <= 127
    return (q * step).reshape(x.shape)


def q8_0(x: np.ndarray) -> np.ndarray:
    g = _groups(np.asarray(x, dtype=np.float32))
    d = (np.abs(g).max(axis=-1, keepdims=True) / np.float32(127.0)).astype(np.float32)
    inv = np.zeros_like(d)
    np.divide(np.float32(1.0), d, out=inv, where=d > 0)
    y = g * inv                                                       # float32, as the C code
    q = np.clip(np.sign(y) * np.floor(np.abs(y) + np.float32(0.5)), -128, 127)   # roundf: half away from zero
    return (q.astype(np.float64) * d.astype(np.float16).astype(np.float64)).reshape(x.shape)


def float16(x: np.ndarray) -> np.ndarray:
    return np.asarray(x).astype(np.float16).astype(np.float64)


FORMATS = {"int8 (engine rule, scale rounded up)": int8_rows_rounded_up, "llama.cpp q8_0": q8_0,
           "float16": float16}


def make_case(seed: int, outliers: bool, num_q_heads=32, num_kv_heads=8, head_dim=128, tokens=4096):
    """``q [num_q_heads, head_dim]``, ``K, V [tokens, num_kv_heads, head_dim]`` float64 (see the module doc)."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((num_q_heads, head_dim))
    K = rng.standard_normal((tokens, num_kv_heads, head_dim))
    V = rng.standard_normal((tokens, num_kv_heads, head_dim))
    if outliers:
        K[..., rng.choice(head_dim, OUTLIER_CHANNELS, replace=False)] *= OUTLIER_FACTOR
    return q, K, V


def attention(q: np.ndarray, K: np.ndarray, V: np.ndarray) -> np.ndarray:
    """float64 ``[num_q_heads, head_dim_v]``: softmax(q K^T / sqrt(d)) V, query head h on kv head h // group."""
    num_q_heads, d = q.shape
    group = num_q_heads // K.shape[1]
    out = np.empty((num_q_heads, V.shape[2]))
    for h in range(num_q_heads):
        s = K[:, h // group] @ q[h] / np.sqrt(d)
        w = np.exp(s - s.max())
        out[h] = (w @ V[:, h // group]) / w.sum()
    return out


def relative_l2(out: np.ndarray, ref: np.ndarray) -> float:
    return float(np.linalg.norm(np.asarray(out, dtype=np.float64) - ref) / np.linalg.norm(ref))


def format_errors(seed: int, outliers: bool) -> dict[str, float]:
    """Relative L2 error of every format of `FORMATS` on one case."""
    q, K, V = make_case(seed, outliers)
    ref = attention(q, K, V)
    return {name: relative_l2(attention(q, fmt(K), fmt(V)), ref) for name, fmt in FORMATS.items()}


def table(seeds=range(5)) -> str:
    lines = ["| format | N(0,1): mean | max | outlier key channels: mean | max |", "|---|---|---|---|---|"]
    runs = {o: [format_errors(s, o) for s in seeds] for o in (False, True)}
    for name in FORMATS:
        cells = []
        for o in (False, True):
            errs = [r[name] for r in runs[o]]
            cells += [f"{np.mean(errs):.2e}", f"{np.max(errs):.2e}"]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(table())
