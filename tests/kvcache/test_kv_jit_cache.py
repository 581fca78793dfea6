"""`kvcache.jit_cache`: a cached kernel is compiled again when a module it calls into changes, not only its own
file (numba's stamp), for the packages registered with it; others are cached as numba does."""
import json
import os
import subprocess
import sys
import textwrap

import pytest
from numba.core import config

from kvcache import jit_cache

pytestmark = pytest.mark.skipif(config.DISABLE_JIT, reason="nothing is compiled, nothing cached")

RUN = ("import json, pkg.kern as k; v = k.kern(); s = k.kern.stats; "
       "print(json.dumps([v, sum(s.cache_hits.values()), sum(s.cache_misses.values())]))")


def _package(tmp_path, stamped):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    init = "import os\nfrom kvcache import jit_cache\njit_cache.register(os.path.dirname(__file__))\n"
    (pkg / "__init__.py").write_text(init if stamped else "")
    (pkg / "kern.py").write_text(textwrap.dedent("""\
        from numba import njit
        from .helper import value

        @njit(cache=True)
        def kern():
            return value()
        """))
    (pkg / "dynamic.py").write_text(textwrap.dedent("""\
        import ctypes
        import ctypes.util

        from numba import njit

        cos = ctypes.CDLL(ctypes.util.find_library("m")).cos
        cos.argtypes, cos.restype = [ctypes.c_double], ctypes.c_double

        @njit(cache=True)
        def uncachable(x):
            return cos(x)
        """))
    _helper(tmp_path, 1)
    return pkg


def _helper(tmp_path, n):
    (tmp_path / "pkg" / "helper.py").write_text(f"from numba import njit\n\n\n@njit\ndef value():\n    return {n}\n")


def _run(tmp_path):
    """(value, cache hits, cache misses) of kern() in a fresh process."""
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_CACHE_DIR"}
    out = subprocess.run([sys.executable, "-c", RUN], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    return tuple(json.loads(out.stdout.strip().splitlines()[-1]))


def test_locator_installed():
    assert jit_cache.INSTALLED
    here = os.path.join(os.path.dirname(jit_cache.__file__), "cache.py")
    assert jit_cache.package_stamp(here) is not None
    assert jit_cache.package_stamp(os.path.abspath(__file__)) is None


def test_a_changed_callee_recompiles_the_kernel(tmp_path):
    _package(tmp_path, stamped=True)
    assert _run(tmp_path) == (1, 0, 1)          # compiled, written to the cache
    assert _run(tmp_path) == (1, 1, 0)          # loaded from it
    _helper(tmp_path, 2)                         # kern.py unchanged: numba's own stamp would match
    assert _run(tmp_path) == (2, 0, 1)          # the old entry is not loaded
    assert _run(tmp_path) == (2, 1, 0)


def test_stamp_follows_the_sources(tmp_path):
    pkg = _package(tmp_path, stamped=False)
    jit_cache.register(str(pkg))
    try:
        first = jit_cache.package_stamp(str(pkg / "kern.py"))
        assert jit_cache.package_stamp(str(pkg / "helper.py")) == first
        _helper(tmp_path, 2)
        jit_cache.register(str(pkg))             # a new process computes the stamp afresh
        assert jit_cache.package_stamp(str(pkg / "kern.py")) != first
    finally:
        jit_cache.unregister(str(pkg))


def test_a_kernel_numba_cannot_cache_still_runs(tmp_path):
    """A function of a registered package that numba will not cache (a ctypes pointer is a dynamic global; so are
    the bounds checks' error messages under NUMBA_BOUNDSCHECK=1) runs, with numba's warning naming its file."""
    _package(tmp_path, stamped=True)
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_CACHE_DIR"}
    code = "import math, pkg.dynamic as d; print(d.uncachable(0.5) == math.cos(0.5))"
    out = subprocess.run([sys.executable, "-W", "always", "-c", code], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "True"
    assert "Cannot cache" in out.stderr and "dynamic.py" in out.stderr
