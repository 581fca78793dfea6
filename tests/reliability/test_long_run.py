"""The random driver (tests/reliability/driver.py) against the dense model: short runs in the default suite,
10**5 operations behind ``--run-slow`` (their figures are in docs/reliability.md)."""
import json
import os
import subprocess
import sys

import pytest

from .driver import Settings, run

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CONFIGS = {
    "float32": dict(),
    "float16-2-layers-window-5": dict(dtype="float16", layers=2, window=5),
    "float64-mqa-window-1": dict(dtype="float64", num_q_heads=8, num_kv_heads=1, window=1),
    "float32-1-token-pages": dict(page_size=1, num_pages=40, head_dim_v=8),
    "float32-3-layers-8-pages": dict(layers=3, num_pages=8, page_size=8),
}


def check(summary, ops):
    assert summary.operations == ops
    assert summary.divergences == 0 and summary.leaked_pages == 0
    assert summary.outputs_compared > ops // 5
    assert summary.failures_injected > ops // 40
    assert summary.bad_inputs_rejected > ops // 20
    assert summary.cache_full_now + summary.cache_full_never > 0


@pytest.mark.kernel
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_short_run(name, reduced_grid):
    ops = 250 if reduced_grid else 1000
    check(run(Settings(ops=ops, seed=sorted(CONFIGS).index(name), **CONFIGS[name])), ops)


def test_cli_prints_the_summary():
    proc = subprocess.run([sys.executable, "-m", "tests.reliability.driver", "--ops", "150", "--seed", "3",
                           "--dtype", "float16", "--window", "3", "--json"], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout)
    assert summary["operations"] == 150 and summary["divergences"] == 0 and summary["leaked_pages"] == 0
    text = subprocess.run([sys.executable, "-m", "tests.reliability.driver", "--ops", "50"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300).stdout
    for line in ("operations: 50", "divergences: 0", "leaked pages: 0", "failures injected:", "RSS after warm-up"):
        assert line in text


@pytest.mark.slow
@pytest.mark.parametrize("name, seed", [("float32", 0), ("float16-2-layers-window-5", 1)])
def test_long_run(name, seed):
    """10**5 operations; resident memory flat after the warm-up (a tenth of the run)."""
    settings = Settings(ops=100_000, seed=seed, **CONFIGS[name])
    summary = run(settings)
    print(f"\n[{name}]\n{summary.text(settings)}")                # figures for docs/reliability.md (pytest -s)
    check(summary, 100_000)
    assert summary.rss_end_mib - summary.rss_warm_mib < 16, summary
