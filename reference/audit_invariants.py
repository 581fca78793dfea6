"""The audit's parts that check invariants the document states without a figure: batched attention equals the
per-head loop (and the oracle) and ignores padded and future keys (section 5), a change to future K/V leaves
earlier outputs bit-identical (sections 5 and 7), a failed append leaves the cache byte-identical, and every
illegal input is refused with a message naming the argument (sections 4 and 5).
"""
from __future__ import annotations

import numpy as np

from . import dense, oracle
from .audit_checks import TOL_ROUNDOFF, Section, at_most, equal
from .example import example_qkv
from .naive_cache import NaiveKVCache

def batch_inputs(seed: int = 42, batch: int = 2, heads: int = 3, length: int = 7, head_dim: int = 4,
                 head_dim_v: int = 5) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The batch case: ``q, k [B, H, L, head_dim]`` and ``v [B, H, L, head_dim_v]``, standard normal,
    drawn in the order q, k, v from ``np.random.default_rng(seed)``."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((batch, heads, length, head_dim))
    k = rng.standard_normal((batch, heads, length, head_dim))
    v = rng.standard_normal((batch, heads, length, head_dim_v))
    return q, k, v


def section_batch() -> Section:
    """Section 5: B=2, H=3, L=7, dk=4, dv=5, seed 42, batched vs per-head loops (and the oracle)."""
    s = Section()
    q, k, v = batch_inputs()
    batched = dense.attention(q, k, v)
    loop_err = np.zeros(q.shape[:3])
    oracle_err = np.zeros(q.shape[:3])
    rows = []
    weight_err = 0.0
    for b in range(q.shape[0]):
        for h in range(q.shape[1]):
            single = dense.attention(q[b, h], k[b, h], v[b, h])
            weight_err = max(weight_err, float(np.abs(batched.weights[b, h] - single.weights).max()))
            loop_err[b, h] = np.abs(batched.context[b, h] - single.context).max(axis=-1)
            exact = np.array(oracle.to_float_matrix(oracle.oracle_context(q[b, h], k[b, h], v[b, h])))
            oracle_err[b, h] = np.abs(batched.context[b, h] - exact).max(axis=-1)
            for t in range(q.shape[2]):
                rows.append([b, h, t] + [float(x) for x in batched.context[b, h, t]]
                            + [loop_err[b, h, t], oracle_err[b, h, t]])
    header = ["batch", "head", "position"] + [f"out_{c}" for c in range(v.shape[-1])] + \
             ["abs_err_vs_loop", "abs_err_vs_oracle"]
    s.tables["batch.csv"] = (header, rows)

    sec = "batch"
    s.checks.append(equal(sec, "context shape [B, H, L, dv]", str(batched.context.shape), "(2, 3, 7, 5)"))
    s.checks.append(at_most(sec, "batched vs per-head loop, context (max abs)", loop_err.max(), TOL_ROUNDOFF))
    s.checks.append(at_most(sec, "batched vs per-head loop, weights (max abs)", weight_err, TOL_ROUNDOFF))
    s.checks.append(at_most(sec, "batched vs Decimal oracle, context (max abs)", oracle_err.max(), 1e-14))

    # padding: batch 0 hides key 3, batch 1 hides keys 5 and 6
    pad = np.ones((2, 7), dtype=bool)
    pad[0, 3] = False
    pad[1, 5:] = False
    padded = dense.attention(q, k, v, key_padding_mask=pad)
    pad_err = max(float(np.abs(padded.context[b, h] - dense.attention(q[b, h], k[b, h], v[b, h],
                                                                      key_padding_mask=pad[b]).context).max())
                  for b in range(2) for h in range(3))
    s.checks.append(at_most(sec, "batched [B, Lk] padding mask vs per-head loop (max abs)", pad_err, TOL_ROUNDOFF))
    s.checks.append(equal(sec, "padded keys get exactly 0 weight",
                          bool(np.all(padded.weights[0, :, :, 3] == 0) and np.all(padded.weights[1, :, :, 5:] == 0)),
                          True))

    # future K/V at positions >= 4 do not move outputs 0..3
    k2, v2 = k.copy(), v.copy()
    k2[:, :, 4:] += 3.0
    v2[:, :, 4:] -= 5.0
    moved = dense.attention(q, k2, v2)
    s.checks.append(equal(sec, "future K/V (positions >= 4) change: outputs 0..3 bit-identical",
                          moved.context[:, :, :4].tobytes() == batched.context[:, :, :4].tobytes(), True))
    return s


def section_visibility() -> Section:
    """Section 5/7: changing future K/V, or only the last V, leaves earlier outputs bit-identical."""
    s = Section()
    q, k, v = example_qkv()
    base = dense.attention(q, k, v).context
    k_future, v_future = k.copy(), v.copy()
    k_future[2] = [5.0, -4.0, 3.0, 2.0]
    v_future[2] = [7.0, 9.0]
    future = dense.attention(q, k_future, v_future).context
    v_last = v.copy()
    v_last[2] = [2.0, 3.0]
    last = dense.attention(q, k, v_last).context

    rows = []
    for case, ctx in (("baseline", base), ("future K/V changed", future), ("last V changed", last)):
        for i in range(3):
            rows.append([case, i] + [float(x) for x in ctx[i]] + [ctx[i].tobytes() != base[i].tobytes()])
    s.tables["visibility.csv"] = (["case", "query", "out_0", "out_1", "differs_from_baseline"], rows)

    sec = "visibility"
    s.checks.append(equal(sec, "future K/V changed: outputs 0, 1 bit-identical",
                          future[:2].tobytes() == base[:2].tobytes(), True))
    s.checks.append(equal(sec, "last V changed: outputs 0, 1 bit-identical",
                          last[:2].tobytes() == base[:2].tobytes(), True))
    s.checks.append(equal(sec, "last V changed: output 2 does change", bool(np.any(last[2] != base[2])), True,
                          "the edit is visible where it should be"))
    return s


def section_append_failure() -> Section:
    """Section 5: a failed append leaves the cached K/V byte-identical."""
    s = Section()
    _, k, v = example_qkv()
    cache = NaiveKVCache(num_kv_heads=1, head_dim=4, head_dim_v=2)
    cache.append(k[:2, None, :], v[:2, None, :])
    before = (cache.k.tobytes(), cache.v.tobytes(), cache.length)
    nan_v = v[2:, None, :].copy()
    nan_v[0, 0, 1] = np.nan
    cases = [("wrong K shape", k[2:, None, :3], v[2:, None, :]),
             ("NaN in new V", k[2:, None, :], nan_v),
             ("inf in new K", np.full((1, 1, 4), np.inf), v[2:, None, :]),
             ("K/V token counts differ", k[1:, None, :], v[2:, None, :])]
    rows = []
    sec = "append"
    for case, new_k, new_v in cases:
        try:
            cache.append(new_k, new_v)
            raised = "none"
        except (TypeError, ValueError) as exc:
            raised = type(exc).__name__
        unchanged = (cache.k.tobytes(), cache.v.tobytes(), cache.length) == before
        rows.append([case, raised, unchanged, cache.length])
        s.checks.append(equal(sec, f"{case}: append rejected", raised, "ValueError"))
        s.checks.append(equal(sec, f"{case}: K/V byte-identical afterwards", unchanged, True))
    s.tables["cache_append.csv"] = (["case", "raised", "kv_unchanged", "length_after"], rows)
    return s


def _rejection_cases() -> list:
    """(case, expected exception type, argument named by the message, callable)."""
    q, k, v = example_qkv()

    def with_value(arr, index, value):
        arr = arr.copy()
        arr[index] = value
        return arr

    q4 = np.zeros((2, 3, 3, 4))
    return [
        ("NaN in q", ValueError, "q", lambda: dense.attention(with_value(q, (1, 2), np.nan), k, v)),
        ("inf in k", ValueError, "k", lambda: dense.attention(q, with_value(k, (0, 1), np.inf), v)),
        ("-inf in v", ValueError, "v", lambda: dense.attention(q, k, with_value(v, (2, 0), -np.inf))),
        ("fully masked query row", ValueError, "key_padding_mask",
         lambda: dense.attention(q, k, v, key_padding_mask=np.array([False, True, True]))),
        ("all -inf row of masked scores", ValueError, "masked_scores",
         lambda: dense.softmax_over_keys(np.array([[0.0, -np.inf], [-np.inf, -np.inf]]))),
        ("q with 1 dimension", ValueError, "q", lambda: dense.attention(q[0], k, v)),
        ("q/k head_dim mismatch", ValueError, "k", lambda: dense.attention(q, k[:, :3], v)),
        ("k/v length mismatch", ValueError, "v", lambda: dense.attention(q, k, v[:2])),
        ("batched head count mismatch", ValueError, "k",
         lambda: dense.attention(q4, np.zeros((2, 2, 3, 4)), np.zeros((2, 2, 3, 2)))),
        ("negative query_start", ValueError, "query_start", lambda: dense.attention(q, k, v, query_start=-1)),
        ("non-integer query_start", ValueError, "query_start", lambda: dense.attention(q[2:], k, v, query_start=2.0)),
        ("bool query_start", ValueError, "query_start", lambda: dense.attention(q[2:], k, v, query_start=True)),
        ("query_start + Lq > Lk", ValueError, "query_start", lambda: dense.attention(q[1:], k, v, query_start=2)),
        ("int dtype", TypeError, "q", lambda: dense.attention(q.astype(np.int64), k, v)),
        ("bool dtype", TypeError, "k", lambda: dense.attention(q, k > 0, v)),
        ("complex dtype", TypeError, "v", lambda: dense.attention(q, k, v.astype(np.complex128))),
        ("object dtype", TypeError, "q", lambda: dense.attention(q.astype(object), k, v)),
        ("non-bool padding mask", TypeError, "key_padding_mask",
         lambda: dense.attention(q, k, v, key_padding_mask=np.array([1, 1, 1]))),
        ("padding mask shape", ValueError, "key_padding_mask",
         lambda: dense.attention(q, k, v, key_padding_mask=np.array([True, True]))),
        ("non-positive scale", ValueError, "scale", lambda: dense.attention(q, k, v, scale=0.0)),
        ("decode: num_q_heads not a multiple of num_kv_heads", ValueError, "q",
         lambda: dense.decode_reference(np.zeros((1, 3, 4)), np.zeros((3, 2, 4)), np.zeros((3, 2, 2)), 2)),
        ("decode: window 0", ValueError, "window",
         lambda: dense.decode_reference(np.zeros((1, 2, 4)), np.zeros((3, 1, 4)), np.zeros((3, 1, 2)), 2, window=0)),
    ]


def section_rejections() -> Section:
    """Section 4/5: every illegal input raises, and the message names the argument, expected and got."""
    s = Section()
    rows = []
    messages = {}
    for case, expected_type, argument, call in _rejection_cases():
        try:
            call()
            raised, message = "none", ""
        except Exception as exc:  # noqa: BLE001 - the audit records whatever happened
            raised, message = type(exc).__name__, str(exc)
        well_formed = message.startswith(f"{argument}: expected") and ", got " in message
        ok = raised == expected_type.__name__ and well_formed
        rows.append([case, expected_type.__name__, raised, argument, well_formed])
        messages[case] = message
        s.checks.append(equal("rejections", f"{case}: {expected_type.__name__} naming '{argument}'", ok, True,
                              "message in audit.json details"))
    s.tables["rejections.csv"] = (["case", "expected_error", "raised", "argument", "message_names_argument"], rows)
    s.details["messages"] = messages
    return s
