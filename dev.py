#!/usr/bin/env python3
"""One entry point for a fresh clone: builds `.venv`, installs the project into it, then runs a job.

    python3 dev.py demo     # the main job: decode with the engine (see README)
    python3 dev.py audit    # the reference lab's audit of the source document
    python3 dev.py test     # the whole test suite (what CI runs)
    python3 dev.py bench    # the benchmark suite (pytest-benchmark)

Only the Python standard library is used here, so it works before anything is installed.
"""
import hashlib
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent
VENV = ROOT / ".venv"
EXTRAS = "test,plot,demo,compare,hf,distributed,serve"
CONFORMANCE = ROOT.parent / "shared" / "conformance"


def venv_python() -> Path:
    return VENV / ("Scripts/python.exe" if os.name == "nt" else "bin/python")


def run(*cmd, env=None) -> None:
    print("+", " ".join(str(c) for c in cmd), flush=True)
    start = time.monotonic()
    code = subprocess.call([str(c) for c in cmd], cwd=ROOT, env=env)
    print(f"dev.py: {time.monotonic() - start:.0f} s wall, exit code {code}", flush=True)
    if code != 0:
        sys.exit(code)


def ensure_venv() -> Path:
    """Create `.venv` and (re)install the project when pyproject.toml changed since the last install."""
    py = venv_python()
    if not py.exists():
        run(sys.executable, "-m", "venv", VENV)
    stamp = VENV / ".installed"
    digest = hashlib.sha256((ROOT / "pyproject.toml").read_bytes() + EXTRAS.encode()).hexdigest()
    if not stamp.exists() or stamp.read_text() != digest:
        run(py, "-m", "pip", "install", "-q", "--upgrade", "pip")
        run(py, "-m", "pip", "install", "-q", "-e", f".[{EXTRAS}]")
        stamp.write_text(digest)
    return py


def workers() -> int:
    """pytest-xdist processes for the test stages: $TEST_WORKERS (e.g. 2), default 1 (the tests run in the pytest
    process itself). Not yet the default: under -n 2 on a loaded 2-core machine a Ray worker compiling the kernels
    cold missed the distributed runtime's 60 s answer timeout (tests/distributed/test_equivalence)."""
    return int(os.environ.get("TEST_WORKERS") or 1)


def pytest(py: Path, *args, env, spread=True) -> None:
    """pytest -q on `args`; with spread, over `workers()` processes, whole files to a worker (--dist loadfile: a
    file's tests share their compiled kernels and fixtures) unless the caller passed its own -n."""
    cmd = [py, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    n = workers()
    if spread and n > 1 and not any(a == "-n" or str(a).startswith("--numprocesses") for a in args):
        cmd += ["-n", str(n), "--dist", "loadfile"]
    run(*cmd, *args, env=env)


def test(py: Path, extra) -> None:
    env = dict(os.environ)
    pytest(py, *extra, env=env)
    if CONFORMANCE.is_dir():
        pytest(py, "--rootdir", ROOT, CONFORMANCE, env=env, spread=False)
    # the benchmark files run once, untimed, so they never rot
    pytest(py, "benchmarks", "--benchmark-disable", "--quick", env=env)
    # the kernel tests again, without the JIT and with bounds checks, on a reduced grid
    for flag in ("NUMBA_DISABLE_JIT", "NUMBA_BOUNDSCHECK"):
        pytest(py, "-m", "kernel", "--reduced-grid",
               env={**env, flag: "1", "NUMBA_CACHE_DIR": str(ROOT / ".venv" / f"numba-{flag.lower()}")})


def main(argv) -> None:
    job, extra = (argv[0] if argv else "test"), argv[1:]
    py = ensure_venv()
    if job == "test":
        test(py, extra)
    elif job == "bench":
        run(py, "-m", "pytest", "benchmarks", "--benchmark-only", *extra)
    elif job in ("demo", "audit", "memory"):
        run(py, "-m", "decode.app.cli", job, *extra)
    else:
        sys.exit(f"dev.py: unknown job {job!r}; expected one of demo, audit, memory, bench, test")


if __name__ == "__main__":
    main(sys.argv[1:])
