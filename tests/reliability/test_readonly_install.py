"""An install into a location the process cannot write still imports and decodes: numba's ``cache=True`` cannot
write next to the modules, so `decode.kernels` points numba at a per-user cache directory before any kernel is
compiled (tests/decode/test_kernels.py checks the choice itself; this runs the whole thing in a fresh process).

The packages are copied to a temporary directory and made unwritable: ``chmod a-w`` everywhere and, because root
ignores permission bits (as in many containers), a regular *file* named ``__pycache__`` in each package, which no
one can create a directory over. The child process imports from the copy with no NUMBA_CACHE_DIR, decodes
(a float16 pool, step and extend) against the float64 reference, and reports where numba cached.
It runs twice: the second run must load what the first one compiled. Nothing may be written inside the copy.
"""
import json
import os
import shutil
import stat
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CHILD = textwrap.dedent("""
    import json, os, sys
    import numpy as np
    import numba
    import decode
    from decode import Decoder, kernels as _kernels
    from reference.dense import decode_reference
    assert os.path.dirname(decode.__file__).startswith(sys.argv[1]), decode.__file__
    rng = np.random.default_rng(0)
    worst = 0.0
    for dtype in ("float16",):
        dec = Decoder(4, 2, 16, dtype=dtype, page_size=4, max_tokens=64)
        q, k, v = rng.standard_normal((12, 4, 16)), rng.standard_normal((12, 2, 16)), rng.standard_normal((12, 2, 16))
        outs = [dec.step(q[i], k[i], v[i]) for i in range(7)] + list(dec.extend(q[7:], k[7:], v[7:]))
        ref = decode_reference(q, k.astype(dtype), v.astype(dtype), 0)
        worst = max(worst, float(np.max(np.abs(np.array(outs) - ref))))
    print(json.dumps({"fallback": _kernels.NUMBA_CACHE_FALLBACK, "numba_cache_dir": numba.config.CACHE_DIR,
                      "worst_error": worst}))
""")


def snapshot(tree):
    return sorted((os.path.relpath(os.path.join(d, f), tree), os.stat(os.path.join(d, f)).st_mtime_ns)
                  for d, _, files in os.walk(tree) for f in files)


def make_unwritable(tree):
    packages = [d for d, _, files in os.walk(tree) if "__init__.py" in files]     # decode/kernels too
    for package in packages:
        with open(os.path.join(package, "__pycache__"), "w") as blocker:
            blocker.write("a file, so that no __pycache__ directory can be made here\n")
    for d, dirs, files in os.walk(tree, topdown=False):
        for f in files:
            os.chmod(os.path.join(d, f), stat.S_IRUSR | stat.S_IRGRP | stat.S_IROTH)
        os.chmod(d, stat.S_IRUSR | stat.S_IXUSR | stat.S_IRGRP | stat.S_IXGRP | stat.S_IROTH | stat.S_IXOTH)


def make_writable(tree):
    for d, _, files in os.walk(tree):
        os.chmod(d, stat.S_IRWXU)
        for f in files:
            os.chmod(os.path.join(d, f), stat.S_IRUSR | stat.S_IWUSR)


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX permissions")
def test_read_only_install_imports_and_decodes(tmp_path):
    site = tmp_path / "site"
    for name in ("kvcache", "decode", "reference"):
        shutil.copytree(os.path.join(ROOT, name), site / name,
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.nbi", "*.nbc"))
    xdg = tmp_path / "xdg"
    make_unwritable(site)
    try:
        before = snapshot(site)
        env = {k: v for k, v in os.environ.items() if not k.startswith("NUMBA_") and k != "PYTHONPATH"}
        env.update(PYTHONPATH=str(site), XDG_CACHE_HOME=str(xdg))
        results = []
        for _ in range(2):
            proc = subprocess.run([sys.executable, "-c", CHILD, str(site)], env=env, cwd=str(tmp_path),
                                  capture_output=True, text=True, timeout=600)
            assert proc.returncode == 0, proc.stderr[-3000:]
            results.append(json.loads(proc.stdout.strip().splitlines()[-1]))
        expected = str(xdg / "pagedkv" / "numba")
        for result in results:
            assert result["fallback"] == expected and result["numba_cache_dir"] == expected
            assert result["worst_error"] < 1e-4
        cached = [f for _, _, files in os.walk(expected) for f in files]
        assert any(f.endswith(".nbi") for f in cached) and any(f.endswith(".nbc") for f in cached)
        assert snapshot(site) == before, "something was written inside the read-only install"
    finally:
        make_writable(site)
