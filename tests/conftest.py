"""Suite-wide options and markers.

--reduced-grid   smaller parameter grids (used by the NUMBA_DISABLE_JIT / NUMBA_BOUNDSCHECK passes)
--run-slow       also run tests marked `slow` (the long forms of the reliability suite)
"""
import pytest


def pytest_addoption(parser):
    parser.addoption("--reduced-grid", action="store_true", help="smaller parameter grids")
    parser.addoption("--run-slow", action="store_true", help="run tests marked slow")


def pytest_configure(config):
    config.addinivalue_line("markers", "kernel: exercises the jitted kernels (rerun without JIT / with bounds checks)")
    config.addinivalue_line("markers", "slow: long-running; needs --run-slow")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--run-slow"):
        return
    skip = pytest.mark.skip(reason="long form: pass --run-slow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def reduced_grid(request) -> bool:
    return request.config.getoption("--reduced-grid")
