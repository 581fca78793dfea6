"""One decode step, cold: every implementation on the same data, shape by shape.

Grid: 32 query heads, head_dim 128, kv heads 32 / 8 / 1 (MHA / GQA / MQA), contexts 512 / 4096 / 32768, float32
and float16 storage. Each shape has one cache per layer and enough layers that all of them together hold
>= 1 GiB of K/V (2 at 32768 x MHA x fp32, where one layer alone is 1 GiB; at most 1024); every timed round is one
step of the next layer in rotation, so the step's K/V comes from DRAM, as in a real model's forward pass.
"""
import pytest

from . import common
from .impls import IMPL_ORDER, ShapeState


def pytest_generate_tests(metafunc):
    if "case" in metafunc.fixturenames:
        quick = metafunc.config.getoption("--quick")
        cases = [(shape, impl) for shape in common.grid_shapes(quick) for impl in IMPL_ORDER]
        metafunc.parametrize("case", cases, ids=[f"{s.label}-{i}" for s, i in cases])


def run_step_benchmark(benchmark, ceilings, quick, shape, impl_name, page_size=common.PAGE_SIZE, group=None,
                       layers=None, budget=1.0, max_rounds=5000):
    """Build (untimed), check against the float64 reference, size the rounds, then time one layer per round.
    ``layers`` None: enough for a cold cache (`common.layers_for`); 1: hot (per-call overhead)."""
    if impl_name.startswith("torch"):
        pytest.importorskip("torch")
    cold = layers is None
    layers = common.layers_for(shape, quick) if cold else layers
    ceil = ceilings.near(f"{shape.label} page {page_size}") if cold else ceilings
    state = ShapeState.get(shape, layers, page_size)
    impl = state.impl(impl_name)
    rotation = common.Rotation(layers)

    # correctness first: layer 0's output against the float64 reference of the same bytes
    impl.setup(0)
    check_s = common.time_calls(lambda: common.check_close(f"{impl_name} {shape.label}", _as_numpy(impl.call(0)),
                                                           state.reference(), shape.dtype), [()])
    if impl_name == "numpy_contiguous":
        impl.choose_variant(rotation)

    def setup():
        layer = next(rotation)
        impl.setup(layer)
        return (layer,), {}

    # warm-up (untimed; also sizes the rounds): three layers
    trial = []
    if check_s > 0.5:                              # slow baselines (0.5-3 s a call): the checked call warmed up
        trial.append(check_s)
    while len(trial) < 3:
        (layer,), _ = setup()
        trial.append(common.time_calls(impl.call, [(layer,)]))
        if trial[-1] > 0.3:
            break
    per_call = sorted(trial)[len(trial) // 2]
    minimum = 5 if per_call < 0.2 else (3 if per_call < 1.0 else 2)
    rounds = 1 if quick else common.choose_rounds(per_call, budget=budget, minimum=minimum, maximum=max_rounds)
    benchmark.group = group or f"step {shape.label}"
    common.pedantic(benchmark, impl.call, setup=setup, rounds=rounds, iterations=1, warmup_rounds=0)
    common.record(benchmark, ceil, shape.kv_bytes, shape.flops, impl=impl_name, layers=layers,
                  page_size=page_size, cold_bytes=layers * shape.kv_bytes, rounds=rounds,
                  description=type(impl).__doc__.split("\n\n")[0].replace("\n", " "),
                  **shape.info(), **impl.extra)


def _as_numpy(x):
    if type(x).__module__.startswith("torch"):
        return x.float().numpy()
    return x


@pytest.mark.kernel
def test_decode_step(benchmark, ceilings, quick, warm_engine, case):
    shape, impl_name = case
    run_step_benchmark(benchmark, ceilings, quick, shape, impl_name)
