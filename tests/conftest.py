"""Suite-wide options and markers.

--reduced-grid   smaller parameter grids (used by the NUMBA_DISABLE_JIT / NUMBA_BOUNDSCHECK passes)
--run-slow       also run tests marked `slow` (the long forms of the reliability suite)

Under pytest-xdist with --dist loadfile (what `dev.py test` uses) a unit of work is a test file, except that all of
tests/distributed is one unit (`pytest_xdist_make_scheduler` below).

Hypothesis: under CI (CI=true) the examples are derandomized (a fixed seed per test), so that a CI run is
reproducible and a rare draw cannot fail one submission and pass the next; locally every run draws anew and
saves failures in .hypothesis/ (HYPOTHESIS_PROFILE=ci reproduces CI's draws).
"""
import os

import pytest
from hypothesis import settings

settings.register_profile("ci", derandomize=True, database=None, print_blob=True)
settings.register_profile("dev", print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE") or ("ci" if os.environ.get("CI") else "dev"))


def pytest_addoption(parser):
    parser.addoption("--reduced-grid", action="store_true", help="smaller parameter grids")
    parser.addoption("--run-slow", action="store_true", help="run tests marked slow")


def pytest_configure(config):
    config.addinivalue_line("markers", "kernel: exercises the jitted kernels (rerun without JIT / with bounds checks)")
    config.addinivalue_line("markers", "slow: long-running; needs --run-slow")


def pytest_collection_modifyitems(config, items):
    if os.environ.get("PYTEST_XDIST_WORKER"):
        # Ray tests last: by then the other files have compiled the kernels into numba's on-disk cache, and the
        # Ray workers (fresh processes) load them instead of compiling cold against their call timeout
        items.sort(key=lambda item: item.nodeid.startswith("tests/distributed/"))
    if config.getoption("--run-slow"):
        return
    skip = pytest.mark.skip(reason="long form: pass --run-slow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def reduced_grid(request) -> bool:
    return request.config.getoption("--reduced-grid")


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """--dist loadfile, except that every Ray test (tests/distributed) goes to one worker, so that one local Ray
    instance runs at a time and never competes with a second one for the cores (its workers' first calls have a
    timeout). A scheduler instead of `xdist_group` marks: pytest-xdist 3.8 renames the node ids of grouped tests
    through an attribute that pytest 9 no longer has, so --dist loadgroup groups nothing there."""
    if config.getoption("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class FilesWithRayTogether(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            scope = super()._split_scope(nodeid)
            return "tests/distributed" if scope.startswith("tests/distributed/") else scope

    return FilesWithRayTogether(config, log)

