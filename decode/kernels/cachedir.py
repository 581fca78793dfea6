"""Where numba caches the compiled kernels (imported before any kernel module is decorated)."""
import os
import tempfile


def writable_dir(path):
    try:
        os.makedirs(path, exist_ok=True)
        tempfile.TemporaryFile(dir=path).close()
        return True
    except OSError:
        return False


def configure_cache_dir():
    """`cache=True` writes next to this file (`__pycache__`). When that is impossible (read-only install) and the
    user set no NUMBA_CACHE_DIR, point numba at a per-user cache directory instead, before any decorator runs."""
    if os.environ.get("NUMBA_CACHE_DIR"):
        return None
    if writable_dir(os.path.join(os.path.dirname(os.path.abspath(__file__)), "__pycache__")):
        return None
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    uid = os.getuid() if hasattr(os, "getuid") else os.getpid()
    for cand in (os.path.join(base, "pagedkv", "numba"),
                 os.path.join(tempfile.gettempdir(), "pagedkv-numba-%s" % uid)):
        if writable_dir(cand):
            os.environ["NUMBA_CACHE_DIR"] = cand
            from numba.core import config as _config
            _config.CACHE_DIR = cand
            return cand
    return None


NUMBA_CACHE_FALLBACK = configure_cache_dir()
