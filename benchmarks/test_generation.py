"""Whole generations and fresh processes, each in its own subprocess (so peak memory and start-up are its own).

* generation: T = 4096 tokens one by one, MHA (32 heads, head_dim 128, float32), the naive concat cache vs the
  engine: total time, peak RSS, and the naive cache's O(T^2) copying per 512-token window.
* first step: a fresh process with a warm numba cache: import, build a decoder, first `Decoder.step`.

The timed round is the whole subprocess (interpreter start included); the numbers that matter are measured
inside it and stored in extra_info (total_s, peak_rss_bytes, windows, first_step_s, ...).
"""
import json
import os
import subprocess
import sys

import pytest

from . import common
from .conftest import ROOT


def run_module(module: str, *args: str, timeout: float = 900) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    proc = subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(f"{module} {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def generation_args(quick):
    if quick:
        return ["--tokens", "96", "--heads", "4", "--head-dim", "32", "--window", "32"]
    return ["--tokens", "4096", "--heads", "32", "--head-dim", "128", "--window", "512"]


@pytest.mark.parametrize("impl", ["naive", "engine"])
def test_generation(benchmark, quick, warm_engine, impl):
    """T tokens, one `step` each: naive np.concatenate cache vs the paged engine (fresh process each)."""
    result = {}

    def run():
        result.update(run_module("benchmarks.generate", "--impl", impl, *generation_args(quick)))

    benchmark.group = "generation"
    common.pedantic(benchmark, run, rounds=1, iterations=1)
    if not result:                                   # --benchmark-disable still calls run once
        run()
    benchmark.extra_info.update(result)
    benchmark.extra_info["impl"] = f"{impl}_generation"
    assert result["tokens"] == int(generation_args(quick)[1])


def test_first_step(benchmark, quick, warm_engine):
    """First `Decoder.step` of a fresh process whose numba cache is warm (a first process warmed it)."""
    args = ["--heads", "8", "--kv-heads", "2", "--head-dim", "32", "--context", "64"] if quick else []
    warmup = run_module("benchmarks.first_step", *args)           # fills the cache if it was cold
    runs = []

    def run():
        runs.append(run_module("benchmarks.first_step", *args))

    benchmark.group = "first step (fresh process)"
    common.pedantic(benchmark, run, rounds=1 if quick else 5, iterations=1)
    if not runs:
        run()
    runs.sort(key=lambda r: r["first_step_s"])
    median = runs[len(runs) // 2]
    benchmark.extra_info.update(median)                            # the run with the median first step
    benchmark.extra_info["first_step_s_all"] = [r["first_step_s"] for r in runs]
    benchmark.extra_info["import_plus_first_step_s_all"] = sorted(r["import_s"] + r["first_step_s"] for r in runs)
    benchmark.extra_info["impl"] = "engine_first_step"
    benchmark.extra_info["warming_process"] = warmup
