"""Per-call overhead: a whole decode step at 1..64 tokens (8 query heads, 2 kv heads, head_dim 64), hot.

Target (issue 5): `Decoder.step` at <= 16 tokens under 15 us, and below a bare torch SDPA call.
"""
import pytest

from . import common
from .impls import TINY_ORDER
from .test_decode_step import run_step_benchmark


def pytest_generate_tests(metafunc):
    if "tiny_case" in metafunc.fixturenames:
        quick = metafunc.config.getoption("--quick")
        cases = [(shape, impl) for shape in common.tiny_shapes(quick) for impl in TINY_ORDER]
        metafunc.parametrize("tiny_case", cases, ids=[f"{s.label}-{i}" for s, i in cases])


@pytest.mark.kernel
def test_tiny_step(benchmark, ceilings, quick, warm_engine, tiny_case):
    shape, impl_name = tiny_case
    run_step_benchmark(benchmark, ceilings, quick, shape, impl_name, layers=1, budget=0.6, max_rounds=20000,
                       group=f"tiny {shape.label}")
