"""Options and session fixtures of the benchmark suite (the root tests/conftest.py is not loaded here).

    pytest benchmarks --benchmark-only                          the full suite (~10 minutes)
    pytest benchmarks --benchmark-only --benchmark-json=F.json  ... saved for `python -m benchmarks.report F.json`
    pytest benchmarks --benchmark-disable --quick               CI: small shapes, every benchmark run once

--quick   small shapes, a tiny generation, small ceiling measurements (runs in well under a minute)
"""
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:                       # `decode`, `kvcache` importable without an install
    sys.path.insert(0, str(ROOT))

from benchmarks import common  # noqa: E402

_CEILINGS: dict = {}
_WARMUP: dict = {}


def pytest_addoption(parser):
    parser.addoption("--quick", action="store_true",
                     help="benchmarks: small shapes only (CI runs them once with --benchmark-disable)")


def pytest_configure(config):
    config.addinivalue_line("markers", "kernel: exercises the jitted kernels")


@pytest.fixture(scope="session")
def quick(request) -> bool:
    return bool(request.config.getoption("--quick"))


@pytest.fixture(scope="session")
def ceilings(quick) -> "common.Ceilings":
    """The machine's read bandwidth (numba prange sum, 2 threads, ~1 GiB, median of 7) and numpy float32
    matmul rate (2048^3, median of 5), measured once at the start of the session; ``ceilings.near(key)`` probes
    both again (512 MiB, 2048^3) before each group of cold benchmarks, and the fractions of that group are
    relative to the probe, so they survive a noisy shared machine."""
    if not _CEILINGS:
        t0 = time.perf_counter()
        bw = common.measure_read_bandwidth(nbytes=(64 * common.MiB if quick else common.GiB),
                                           repeats=3 if quick else 7)
        mm = common.measure_matmul_rate(n=512 if quick else 2048, repeats=3 if quick else 5)
        _CEILINGS.update(bw)
        _CEILINGS.update(mm)
        _CEILINGS["measured_at"] = "session start"
        _CEILINGS["loadavg"] = os.getloadavg() if hasattr(os, "getloadavg") else None
        _CEILINGS["measure_seconds"] = time.perf_counter() - t0
    return common.Ceilings(_CEILINGS, quick)


@pytest.fixture(scope="session")
def warm_engine() -> dict:
    """Compile (or load from the numba cache) every kernel signature the suite uses, outside all timings:
    float32 and float16 storage, the serial and the parallel path, one and several queries."""
    if not _WARMUP:
        from decode import Decoder, batch_step
        from decode.attention import paged_decode_attention

        t0 = time.perf_counter()
        rng = np.random.default_rng(1)
        for dtype in ("float32", "float16"):
            for n, heads in ((8, 2), (600, 8)):                     # tiny: serial; bigger: parallel
                dec = Decoder(num_q_heads=8, num_kv_heads=heads, head_dim=64, dtype=dtype,
                              page_size=common.PAGE_SIZE, max_tokens=n + 64)
                kv = rng.standard_normal((n, heads, 64), dtype=np.float32)
                dec.append(kv, kv)
                for _ in range(3):
                    dec.step(rng.standard_normal((8, 64), dtype=np.float32), kv[0], kv[0])
                dec.extend(rng.standard_normal((2, 8, 64), dtype=np.float32), kv[:2], kv[:2])
                cache = dec.cache
                table = cache.pool.page_table(dec.seq)
                paged_decode_attention(rng.standard_normal((1, 8, 64), dtype=np.float32), cache.pool.k_pages(0),
                                       cache.pool.v_pages(0), table, np.array([0, len(table)]), np.zeros(1, np.int32),
                                       np.array([dec.length - 1]))
            from kvcache import KVCache

            pool = KVCache(num_kv_heads=8, head_dim=64, dtype=dtype, page_size=common.PAGE_SIZE, max_tokens=512)
            decs = [Decoder.on_cache(pool, 8) for _ in range(2)]
            batch_step(decs, rng.standard_normal((2, 8, 64), dtype=np.float32),
                       np.zeros((2, 8, 64), np.float32), np.zeros((2, 8, 64), np.float32))
        _WARMUP["seconds"] = time.perf_counter() - t0
    return _WARMUP


def _versions() -> dict:
    import numba

    out = {"python": platform.python_version(), "numpy": np.__version__, "numba": numba.__version__,
           "numba_threads": numba.get_num_threads()}
    try:
        import pytest_benchmark

        out["pytest_benchmark"] = pytest_benchmark.__version__
    except Exception:                                   # pragma: no cover
        pass
    if "torch" in sys.modules:
        out["torch"] = sys.modules["torch"].__version__
    return out


def _cpu() -> dict:
    info = {"machine": platform.machine(), "cpus": os.cpu_count()}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["model"] = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    for index in range(4):
        base = Path(f"/sys/devices/system/cpu/cpu0/cache/index{index}")
        try:
            level = (base / "level").read_text().strip()
            info[f"L{level}{'d' if (base / 'type').read_text().strip() == 'Data' else ''}"] = \
                (base / "size").read_text().strip()
        except OSError:
            pass
    try:
        import psutil

        info["memory_gib"] = round(psutil.virtual_memory().total / common.GiB, 1)
    except Exception:                                   # pragma: no cover
        pass
    return info


def pytest_benchmark_update_json(config, benchmarks, output_json):
    """Save the session's ceilings (and a second measurement at the end, to show the drift), the CPU, the
    versions and the suite's knobs with the results; `benchmarks/report/` reads them."""
    quick = bool(config.getoption("--quick"))
    extra = {"ceilings_start": dict(_CEILINGS), "cpu": _cpu(), "versions": _versions(), "quick": quick,
             "page_size": common.PAGE_SIZE, "cold_bytes": common.QUICK_COLD_BYTES if quick else common.COLD_BYTES,
             "warmup": dict(_WARMUP), "date": time.strftime("%Y-%m-%d %H:%M:%S %z"),
             "loadavg_end": os.getloadavg() if hasattr(os, "getloadavg") else None}
    if _CEILINGS and not quick:
        end = common.measure_read_bandwidth(nbytes=common.GiB)
        end.update(common.measure_matmul_rate())
        extra["ceilings_end"] = end
    output_json["pagedkv"] = extra
