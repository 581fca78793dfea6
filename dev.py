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
from pathlib import Path

ROOT = Path(__file__).resolve().parent
VENV = ROOT / ".venv"
EXTRAS = "test,plot,demo,compare,hf,distributed,serve"
CONFORMANCE = ROOT.parent / "shared" / "conformance"


def venv_python() -> Path:
    return VENV / ("Scripts/python.exe" if os.name == "nt" else "bin/python")


def run(*cmd, env=None) -> None:
    print("+", " ".join(str(c) for c in cmd), flush=True)
    code = subprocess.call([str(c) for c in cmd], cwd=ROOT, env=env)
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


def test(py: Path, extra) -> None:
    env = dict(os.environ)
    run(py, "-m", "pytest", "-q", "-p", "no:cacheprovider", *extra, env=env)
    if CONFORMANCE.is_dir():
        run(py, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", ROOT, CONFORMANCE, env=env)
    # the benchmark files run once, untimed, so they never rot
    run(py, "-m", "pytest", "-q", "-p", "no:cacheprovider", "benchmarks", "--benchmark-disable", "--quick", env=env)
    # the kernel tests again, without the JIT and with bounds checks, on a reduced grid
    for flag in ("NUMBA_DISABLE_JIT", "NUMBA_BOUNDSCHECK"):
        run(py, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "kernel", "--reduced-grid",
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
