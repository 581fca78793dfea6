#!/usr/bin/env python3
"""One entry point for a fresh clone: builds `.venv`, installs the project into it, then runs a job.

    python3 dev.py demo     # the main job: decode with the engine (see README)
    python3 dev.py audit    # the reference lab's audit of the source document
    python3 dev.py test     # the whole test suite (what CI runs); TEST_WORKERS=1 runs its stages one by one
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
# tests that compile cold into a numba cache of their own (~40-60 s each): run in the background chain (`stages`)
SELF_CONTAINED = "tests/reliability/test_readonly_install.py"
FRESH_COMPILE = "tests/decode/test_determinism.py::test_more_threads_than_cores_and_fresh_compile_equals_cache_load"


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
    """Processes for `dev.py test`: $TEST_WORKERS, default the CPUs this process may use (at most 4).
    With 1 every stage runs after the other in one pytest process each (the old, serial CI)."""
    if os.environ.get("TEST_WORKERS"):
        return max(1, int(os.environ["TEST_WORKERS"]))
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(4, cpus))


class Stage:
    """One pytest run of `dev.py test`: a name, its arguments, the environment changes it needs."""

    def __init__(self, name, *args, env=None, spread=False, warm=False):
        """warm: waits until the first foreground stage has filled numba's cache (its Ray workers' first calls
        have a timeout and must not compile cold)."""
        self.name, self.args, self.env, self.spread = name, [str(a) for a in args], dict(env or {}), spread
        self.warm = warm
        self.seconds, self.code = None, None

    def command(self, py: Path, n: int) -> list:
        cmd = [str(py), "-m", "pytest", "-q", "-p", "no:cacheprovider"]
        if self.spread and n > 1 and not any(a == "-n" or a.startswith("--numprocesses") for a in self.args):
            # whole files to a worker (a file's tests share compiled kernels and fixtures); tests/conftest.py keeps
            # all of tests/distributed on one worker (one Ray instance at a time)
            cmd += ["-n", str(n), "--dist", "loadfile"]
        return cmd + self.args

    def run(self, py: Path, n: int, log=None) -> int:
        """Run to completion; output to the console, or to `log` (a file) when given. Returns the exit code."""
        cmd = self.command(py, n)
        print(f"+ [{self.name}] " + " ".join(cmd), flush=True)
        start = time.monotonic()
        env = {**os.environ, **self.env}
        if log is None:
            self.code = subprocess.call(cmd, cwd=ROOT, env=env)
        else:
            with open(log, "w") as out:
                self.code = subprocess.call(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
        self.seconds = time.monotonic() - start
        print(f"dev.py: [{self.name}] {self.seconds:.0f} s wall, exit code {self.code}", flush=True)
        return self.code


def stages(extra) -> tuple[list, list]:
    """Two chains of stages, `(foreground, background)`, that run side by side; each chain in order.

    foreground: the kernel tests (`-m kernel`, full grid) in one process, which also compiles the kernels into
    numba's on-disk cache, then the rest of the suite spread over the workers, which loads them from that cache
    (and so do its fresh processes: CLI and server subprocesses, Ray workers). With `extra` pytest arguments the
    foreground is just `pytest extra` over the workers.
    background: the kernel tests on the reduced grid with NUMBA_BOUNDSCHECK=1 (built at NUMBA_OPT=0) and with
    NUMBA_DISABLE_JIT=1 (each with its own numba cache: bounds-checked code must not be loaded by the other runs),
    the shared conformance suite, the two tests that compile cold into caches of their own (the read-only install,
    and the fresh-compile vs cache-load determinism test: deselected from the foreground's kernel tests), and the
    benchmark files once, untimed (so they never rot)."""
    if extra:
        foreground = [Stage("tests", *extra, spread=True)]
    else:
        foreground = [Stage("kernel tests", "-m", "kernel", "tests", f"--deselect={FRESH_COMPILE}"),
                      Stage("tests", "-m", "not kernel", "tests", f"--ignore={SELF_CONTAINED}", spread=True)]
    background = []
    for flag in ("NUMBA_BOUNDSCHECK", "NUMBA_DISABLE_JIT"):
        env = {flag: "1", "NUMBA_CACHE_DIR": str(VENV / f"numba-{flag.lower()}")}
        if flag == "NUMBA_BOUNDSCHECK":
            # the bounds checks are emitted as numba lowers each index, before LLVM optimises; LLVM's -O0 keeps every
            # one of them and skips the passes that took most of this stage's compile time (the optimised build is
            # what the foreground kernel tests run)
            env["NUMBA_OPT"] = "0"
        background.append(Stage(f"kernel tests {flag}=1", "-m", "kernel", "--reduced-grid", env=env))
    if CONFORMANCE.is_dir():
        background.append(Stage("conformance", "--rootdir", ROOT, CONFORMANCE))
    if not extra:
        # each compiles cold into a cache of its own (~40 s and ~50 s), so they need nothing of the foreground's:
        # they run here, while the foreground's kernel tests still hold one core, not beside the spread stage and
        # the benchmarks (the chain was idle ~80 s there, waiting for the foreground's cache)
        background.append(Stage("self-contained compiles", SELF_CONTAINED, FRESH_COMPILE))
    background.append(Stage("benchmarks", "benchmarks", "--benchmark-disable", "--quick", warm=True))
    return foreground, background


def test(py: Path, extra) -> None:
    """Every stage of `stages`; with more than one worker the background chain runs in a thread beside the
    foreground one (its output goes to .venv/logs and is printed after the foreground's; a status line per stage
    is printed when it ends). Exit code: the first failed stage's."""
    n = workers()
    foreground, background = stages(extra)
    start = time.monotonic()
    if n == 1:
        for stage in foreground + background:
            stage.run(py, n)
    else:
        import threading
        logs = VENV / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        paths = [logs / f"stage-{i}.log" for i in range(len(background))]
        cached = threading.Event()                                 # the first foreground stage has ended

        def chain():
            for stage, path in zip(background, paths):
                if stage.warm:
                    cached.wait()
                stage.run(py, n, log=path)

        side = threading.Thread(target=chain, daemon=True)
        side.start()
        for stage in foreground:
            stage.run(py, n)
            cached.set()
        side.join()
        for stage, path in zip(background, paths):
            print(f"---- [{stage.name}] output ----\n{path.read_text()}---- end of [{stage.name}] ----", flush=True)
    print(f"dev.py test: {time.monotonic() - start:.0f} s wall with {n} worker(s)", flush=True)
    for stage in foreground + background:
        print(f"  {stage.name:<34} {stage.seconds:7.0f} s  exit {stage.code}", flush=True)
    failed = [s.code for s in foreground + background if s.code != 0]
    if failed:
        sys.exit(failed[0])


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
