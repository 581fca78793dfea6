"""Routing of short runs (issue 20, "routing"): one sequence extending by T tokens over a cached context, the
kernel call alone as `AttentionPlan` routes it (`route_min_run`) against the same call forced through the
per-query kernel and through the tiled kernel (`benchmarks.routing.Scene`; the plan made once, outside the
timing, as a forward makes it once for every layer).

Shapes: 32 q heads, head_dim 128, page 16, float32 / bfloat16, context 4096, T = 3 / 4 / 8 / 16 at groups 1, 4 and
32, on the session's thread count (quick: context 64, T = 2 / 3 / 8, groups 1 and 8, 8 q heads, head_dim 32).
Every call is checked against the float64 reference before it is timed. Beside the routed row, an *interleaved*
measurement (rounds of per-query, tiled, routed back to back, `benchmarks.routing.interleaved`) records
``alt_routed_over_best`` (routed time / the faster forced kernel, per round, median): the target is <= 1 within
noise. The full table of docs/kernel.md ("Routing") comes from ``python -m benchmarks.routing``.
"""
import numpy as np
import pytest

from . import common
from .routing import ROUTES, Scene, interleaved


def cases(quick):
    """(context, T, num_q_heads, num_kv_heads, head_dim, storage)."""
    if quick:
        return [(64, T, 8, 8 // g, 32, "float32") for g in (1, 8) for T in (2, 3, 8)]
    return [(4096, T, 32, 32 // g, 128, st) for st in ("float32", "bfloat16") for g in (1, 4, 32)
            for T in (3, 4, 8, 16)]


def label(c) -> str:
    context, T, hq, hkv, d, st = c
    return f"q{hq}kv{hkv}d{d}-{context}+{T}-{st}"


def pytest_generate_tests(metafunc):
    if "route_case" in metafunc.fixturenames:
        params = [(c, r) for c in cases(metafunc.config.getoption("--quick")) for r in ROUTES]
        metafunc.parametrize("route_case", params, ids=[f"{label(c)}-{r}" for c, r in params])


_SCENES: dict = {}


def scene_of(c) -> Scene:
    if c not in _SCENES:
        _SCENES.clear()
        _SCENES[c] = Scene(c[0], c[1], c[2], c[3], c[4], c[5], 16)
    return _SCENES[c]


def reference(scene: Scene) -> np.ndarray:
    """float64 outputs [T, hq, d] of the scene's queries over the stored (rounded) K/V."""
    from kvcache import bf16

    def dense(pages):
        x = bf16.to_float32(pages) if scene.storage == "bfloat16" else pages
        x = x[scene.indices]                                   # logical page order
        return x.transpose(0, 2, 1, 3).reshape(-1, x.shape[1], x.shape[3]).astype(np.float64)
    K, V = dense(scene.k_pages), dense(scene.v_pages)
    T, hq, _ = scene.q.shape
    g = hq // K.shape[1]
    out = np.empty(scene.q.shape)
    for t in range(T):
        p = int(scene.query_pos[t])
        for h in range(hq):
            s = (K[:p + 1, h // g] @ scene.q[t, h].astype(np.float64)) * scene.scale
            w = np.exp(s - s.max())
            out[t, h] = (w / w.sum()) @ V[:p + 1, h // g]
    return out


@pytest.mark.kernel
def test_routing(benchmark, ceilings, quick, warm_engine, route_case):
    c, route = route_case
    context, T, hq, hkv, d, storage = c
    scene = scene_of(c)
    call = scene.call(route)
    common.check_close(f"{route} {label(c)}", call().copy(), reference(scene), storage)
    per_call = common.time_calls(call, [()] * 3)
    rounds = 1 if quick else common.choose_rounds(per_call, budget=0.5, minimum=5, maximum=2000)
    benchmark.group = f"routing {label(c)}"
    common.pedantic(benchmark, call, rounds=rounds, iterations=1, warmup_rounds=0 if quick else 1)
    if route == "routed":
        times = interleaved({r: scene.call(r) for r in ROUTES}, 1 if quick else 15)
        pq, ti, ro = (np.array(times[r]) for r in ROUTES)
        benchmark.extra_info.update({
            "alt_per_query_s": float(np.median(pq)), "alt_tiled_s": float(np.median(ti)),
            "alt_routed_s": float(np.median(ro)), "alt_tiled_over_per_query": float(np.median(ti / pq)),
            "alt_routed_over_best": float(np.median(ro / np.minimum(pq, ti)))})
    itemsize = 2 if storage == "bfloat16" else np.dtype(storage).itemsize
    keys = T * context + T * (T + 1) // 2
    common.record(benchmark, ceilings, 2 * (context + T) * hkv * d * itemsize, 4 * hq * d * keys, impl=route,
                  op="extend", start=context, tokens=T, num_q_heads=hq, num_kv_heads=hkv, group=hq // hkv,
                  head_dim=d, dtype=storage, page_size=16, routed_tiled=scene.tiled_routed(), shape=label(c),
                  rounds=rounds)
