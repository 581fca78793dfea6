"""Serving (issue 18 §4): `decode.serve.Engine` against padded static `generate()` + DynamicCache and transformers'
continuous batching, each (system) in a fresh process (`benchmarks.serve_run`) on one saved random-weight Llama
and one KV budget; output tokens/s, TTFT / ITL p50 / p99 and peak RSS sit in extra_info. The full comparison
(every workload, bf16, vLLM) is `python -m benchmarks.serve` (docs/serving.md).

--quick (CI): a tiny model, 4 short requests arriving as a Poisson stream with mixed output lengths, the engine
and the static baseline.
"""
import importlib.util
import json

import pytest

from . import common
from .serve import MODEL, QUICK_MODEL, make_checkpoint
from .serve_workload import make_workload
from .test_generation import run_module

pytestmark = pytest.mark.skipif(
    not all(importlib.util.find_spec(m) for m in ("torch", "transformers")) or
    importlib.util.find_spec("decode.serve") is None, reason="needs the hf extra and decode.serve")


def pytest_generate_tests(metafunc):
    if "serve_system" in metafunc.fixturenames:
        quick = metafunc.config.getoption("--quick")
        metafunc.parametrize("serve_system", ["engine", "static"] if quick else ["engine", "hf_cb", "static"])


@pytest.fixture(scope="module")
def serve_setup(quick, tmp_path_factory):
    base = tmp_path_factory.mktemp("serve")
    dims, layers = (QUICK_MODEL, 2) if quick else (MODEL, 2)
    ckpt = make_checkpoint(base, "float32", layers, dims)
    if quick:
        work = make_workload("poisson_mixed", requests=4, vocab=dims["vocab_size"], prompt_median=32,
                             prompt_min=8, prompt_max=64, rate=20.0)
        for r in work:
            r["max_tokens"] = min(r["max_tokens"], 10)
    else:
        work = make_workload("burst", requests=16, vocab=dims["vocab_size"], new=32, prompt_median=256,
                             prompt_min=64, prompt_max=1024)
    wfile = base / "workload.json"
    wfile.write_text(json.dumps(work))
    return ckpt, wfile, work


def test_serve(benchmark, quick, serve_setup, serve_system):
    ckpt, wfile, work = serve_setup
    result = {}

    def run():
        result.update(run_module("benchmarks.serve_run", "--system", serve_system, "--checkpoint", str(ckpt),
                                 "--workload", str(wfile), "--kv-budget", str(64 << 20), timeout=1800))

    benchmark.group = "serve"
    common.pedantic(benchmark, run, rounds=1, iterations=1)
    if not result:                                   # --benchmark-disable still calls run once
        run()
    benchmark.extra_info.update({k: v for k, v in result.items() if not isinstance(v, (list, dict))})
    assert result["incomplete"] == [], f"{serve_system}: requests without all their tokens {result['incomplete']}"
    assert result["output_tokens"] == sum(r["max_tokens"] for r in work)
    assert 0 <= result["ttft_p50_s"] <= result["ttft_p99_s"]
    assert 0 <= result["itl_p50_s"] <= result["itl_p99_s"]
    assert result["peak_rss_bytes"] > 0
