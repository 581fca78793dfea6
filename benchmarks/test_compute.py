"""What limits the decode step where it stays below the page-walk ceiling (benchmarks/test_walk.py): its compute
time, measured where memory does not matter.

    hot step   `Decoder.step` of each walk shape (32 q heads, head_dim 128; MHA / GQA-8, float32 / float16, pages of
               16 and 64) on ONE layer whose K/V (<= 16 MiB) stays in the 32 MiB last-level cache, at two contexts
               n_small = 16 and n_hot; the slope (t(n_hot) - t(16)) / (n_hot - 16) is the step's compute time per
               token with the per-call cost taken out.

The report (`benchmarks.report`) sets `compute_s_per_token * N` beside the cold step of N tokens and the page walk
of its pages: a step that takes about walk + compute, rather than max(walk, compute), does not overlap its
arithmetic with its memory reads, and no traversal change can bring it to the walk's time.
"""
from __future__ import annotations

import numpy as np
import pytest

from . import common
from .common import Data, Shape
from .impls import EngineStep

HOT_BYTES = 16 * common.MiB
SMALL = 16


def _cases(quick):
    if quick:
        return [(Shape(8, kv, 32, 300, dt), p) for kv in (8, 2) for dt, p in (("float32", 16), ("float16", 64))]
    return [(Shape(32, kv, 128, 4096, dt), p) for kv in (32, 8) for dt in ("float32", "float16") for p in (16, 64)]


def pytest_generate_tests(metafunc):
    if "compute_case" in metafunc.fixturenames:
        cases = _cases(metafunc.config.getoption("--quick"))
        metafunc.parametrize("compute_case", cases, ids=[f"{s.label.rsplit('-n', 1)[0]}-{s.dtype}-P{p}"
                                                          for s, p in cases])


def _hot_context(shape: Shape) -> int:
    per_token = shape.kv_bytes // shape.context
    return int(min(shape.context, HOT_BYTES // per_token))


def _hot_step(shape: Shape, page: int, rounds: int):
    data = Data(shape, 1)
    engine = EngineStep(data, page_size=page)
    engine.build()
    common.check_close(f"hot step {shape.label}", engine.call(0), data.reference(0), shape.dtype)
    times = []
    for _ in range(rounds):
        engine.setup(0)
        times.append(common.time_calls(engine.call, [(0,)]))
    engine.free()
    return float(np.median(times))


@pytest.mark.kernel
def test_step_compute(benchmark, quick, warm_engine, compute_case):
    shape, page = compute_case
    n_hot = _hot_context(shape)
    hot = Shape(shape.num_q_heads, shape.num_kv_heads, shape.head_dim, n_hot, shape.dtype)
    small = Shape(shape.num_q_heads, shape.num_kv_heads, shape.head_dim, SMALL, shape.dtype)
    rounds = 3 if quick else 61
    t_small = _hot_step(small, page, rounds)
    data = Data(hot, 1)
    engine = EngineStep(data, page_size=page)
    engine.build()

    def setup():
        engine.setup(0)
        return (0,), {}

    for _ in range(3):                                   # the pages into the cache
        setup()
        engine.call(0)
    benchmark.group = f"compute {shape.label.rsplit('-n', 1)[0]}-{'fp16' if shape.dtype == 'float16' else 'fp32'}"
    common.pedantic(benchmark, engine.call, setup=setup, rounds=rounds, iterations=1, warmup_rounds=0)
    stats = getattr(getattr(benchmark, "stats", None), "stats", None)
    if stats is None:                                    # --benchmark-disable (CI): nothing was timed
        engine.free()
        return
    t_hot = stats.median
    per_token = max(0.0, (t_hot - t_small) / (n_hot - SMALL))
    benchmark.extra_info.update({"impl": "engine_step_hot", "page_size": page, "hot_context": n_hot,
                                 "small_context": SMALL, "hot_s": t_hot, "small_s": t_small,
                                 "compute_s_per_token": per_token, "walk_shape_prefix": shape.label.rsplit("-n", 1)[0],
                                 **{k: v for k, v in shape.info().items() if k not in ("context", "shape")}})
    engine.free()
