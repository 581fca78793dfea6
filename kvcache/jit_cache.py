"""numba's on-disk cache, made to notice when a kernel's callees change.

numba keys a cached kernel on the content of the file that defines it, and on nothing else: a kernel whose
helpers (register blocks, loaders, constants it reads as globals) live in other modules is loaded from the cache
after those modules changed, compiled from the old helpers. A tree edited or updated in place (`git pull` of a
change to one helper module) then runs old machine code, silently: on the Zen 3 guest the per-query kernel's
cache still held the register blocks of before an AVX2 change, 2.3x slower than their source (a GQA-8 decode
step of 512 tokens, 0.74 ms against 0.31 freshly compiled); a helper whose meaning changed would have given other
results.

`register(package_dir, deps)` (each package, before its first decorator runs: `kvcache/__init__.py`,
`decode/__init__.py`) puts a locator in front of numba's: for a function defined under a registered package it
answers with numba's own locator (the same cache directory, file names and disambiguator) whose source stamp
also carries a hash of every ``.py`` file of the package and of the packages it depends on. numba compares the
stamp with the one its index was written with, so a change anywhere in those files discards the old entries and
the kernel is compiled again. Functions outside the registered packages are cached as numba would.

    register(package_dir, deps=())   stamp the package's kernels with its own and its dependencies' sources
    unregister(package_dir)          undo it (tests)
    package_stamp(path) -> str       that hash for a file (None outside the registered packages)
    INSTALLED                        whether numba's cache took the locator (a test checks it)
"""
import hashlib
import os

from numba.core import caching as _caching

_ROOTS = {}          # package directory -> the directories its stamp covers (itself first)
_STAMPS = {}         # package directory -> hash of the .py files under its covered directories


def _source_hash(dirs):
    """sha256 over the relative path and bytes of every .py file under ``dirs``, in sorted order."""
    h = hashlib.sha256()
    for top in dirs:
        files = []
        for base, subdirs, names in os.walk(top):
            subdirs[:] = sorted(d for d in subdirs if d != "__pycache__")
            files += [os.path.join(base, n) for n in names if n.endswith(".py")]
        for path in sorted(files):
            h.update(os.path.relpath(path, os.path.dirname(top)).encode() + b"\0")
            with open(path, "rb") as f:
                h.update(f.read())
            h.update(b"\0")
    return h.hexdigest()


def _root_of(path):
    """The registered package directory that holds ``path`` (the innermost), or None."""
    path = os.path.realpath(path)
    best = None
    for root in _ROOTS:
        if path.startswith(root + os.sep) and (best is None or len(root) > len(best)):
            best = root
    return best


def package_stamp(path):
    """The hash of the sources a kernel defined in file ``path`` is compiled from (its package's and its
    dependencies' .py files), computed once per process; None outside the registered packages."""
    root = _root_of(path)
    if root is None:
        return None
    if root not in _STAMPS:
        _STAMPS[root] = _source_hash(_ROOTS[root])
    return _STAMPS[root]


def register(package_dir, deps=()):
    """Stamp the cached kernels defined under ``package_dir`` with its sources and those of ``deps`` (package
    directories). Call before the package's first `cache=True` decorator runs."""
    root = os.path.realpath(package_dir)
    _ROOTS[root] = [root] + [os.path.realpath(d) for d in deps]
    _STAMPS.pop(root, None)


def unregister(package_dir):
    """Undo `register` (for tests)."""
    root = os.path.realpath(package_dir)
    _ROOTS.pop(root, None)
    _STAMPS.pop(root, None)


class _StampedLocator:
    """numba's locator for a function of a registered package, with the package's stamp added to the source's (the
    interface of numba's `_CacheLocator`, whose methods it forwards; not a subclass: no private name of numba's is
    needed to import this module)."""

    def __init__(self, base, stamp):
        self._base = base
        self._stamp = stamp

    def __getattr__(self, name):
        # what numba reads of its locators beyond the interface (`_py_file`, for the warning on a function it
        # cannot cache) comes from the base locator
        base = self.__dict__.get("_base")
        if base is None:
            raise AttributeError(name)
        return getattr(base, name)

    def ensure_cache_path(self):
        self._base.ensure_cache_path()

    def get_cache_path(self):
        return self._base.get_cache_path()

    def get_source_stamp(self):
        return (self._base.get_source_stamp(), self._stamp)

    def get_disambiguator(self):
        return self._base.get_disambiguator()

    @classmethod
    def from_function(cls, py_func, py_file):
        stamp = package_stamp(py_file)
        if stamp is None:
            return None
        for other in _locator_list():
            if other is cls:
                continue
            base = other.from_function(py_func, py_file)
            if base is not None:
                return cls(base, stamp)
        return None


def _locator_list():
    """numba's list of locator classes, tried in order (`CacheImpl._locator_classes`, `_CacheImpl` in older
    releases), or None."""
    impl = getattr(_caching, "CacheImpl", None) or getattr(_caching, "_CacheImpl", None)
    classes = getattr(impl, "_locator_classes", None)
    return classes if isinstance(classes, list) else None


def _install():
    classes = _locator_list()
    if classes is None:
        return False
    if _StampedLocator not in classes:
        classes.insert(0, _StampedLocator)
    return True


INSTALLED = _install()
register(os.path.dirname(__file__))
