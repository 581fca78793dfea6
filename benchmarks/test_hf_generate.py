"""generate() of a random-weight Llama: PagedCache + "pagedkv" vs DynamicCache + "sdpa" (transformers' default),
each in a fresh process (`benchmarks.hf_generate`): prefill time, per-token decode time, peak RSS growth, and a
prompt cache copied for 8 requests. The ratios of a whole run come from `python -m benchmarks.hf_compare`
(docs/transformers.md); here each (case, implementation) is one benchmark whose figures sit in extra_info.

Targets (issue 10): decode >= 1.3x faster at 4096 tokens, prefill no slower, peak RSS no higher, forks copy
no pool bytes. --quick: a tiny model, one case (CI).
"""
import importlib.util

import pytest

from . import common
from .hf_compare import CASES, IMPLS, QUICK_CASES, run_case

pytestmark = pytest.mark.skipif(not all(importlib.util.find_spec(m) for m in ("torch", "transformers")),
                                reason="needs the hf extra (torch, transformers)")


def pytest_generate_tests(metafunc):
    if "hf_case" in metafunc.fixturenames:
        quick = metafunc.config.getoption("--quick")
        cases = [(case, impl) for case in (QUICK_CASES[:1] if quick else CASES) for impl in IMPLS]
        metafunc.parametrize("hf_case", cases, ids=[f"{c[0]}-{impl}" for c, impl in cases])


def test_hf_generate(benchmark, quick, hf_case):
    case, impl = hf_case
    result = {}

    def run():
        result.update(run_case(case, impl, quick))

    benchmark.group = f"hf generate {case[0]}"
    common.pedantic(benchmark, run, rounds=1, iterations=1)
    if not result:                                   # --benchmark-disable still calls run once
        run()
    benchmark.extra_info.update({k: v for k, v in result.items() if k not in ("new_tokens", "decode_s_all")})
    assert len(result["new_tokens"]) == case[2] and len(result["new_tokens"][0]) == case[3]
    if impl == "paged":
        assert result["kernel_calls"] > 0
        if case[4]:
            assert result["fork_pages_taken"] == 0            # copies share the prompt's pages
