"""The server tests need the serve and hf extras; skipped without them. Every server is started on a free
loopback port by the test that uses it and stopped after it; after every test the pool is checked: pages in use
equal the prefix cache's held pages, nothing is running or waiting, and the engine's invariant check passes."""
import importlib.util

import pytest

NEEDED = ("fastapi", "uvicorn", "prometheus_client", "openai", "psutil", "torch", "transformers")
MINE = ["test_server*.py", "test_make_model.py"]
collect_ignore_glob = [] if all(importlib.util.find_spec(m) for m in NEEDED) else MINE


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    """A tiny random float64 Llama checkpoint with a trained BPE tokenizer (kvengine make-model's code)."""
    from decode.app.make_model import ModelSpec, make_model

    return make_model(tmp_path_factory.mktemp("tiny-f64"),
                      ModelSpec(layers=2, hidden=64, heads=4, kv_heads=2, vocab=400, max_position=512,
                                dtype="float64", seed=7))


@pytest.fixture
def start_server(model_dir):
    """start_server(**engine_kwargs) -> a running `Server`; stopped (and its pool checked) after the test."""
    from .harness import check_pool_idle, start

    servers = []

    def _start(**engine_kwargs):
        server = start(model_dir, **engine_kwargs)
        servers.append(server)
        return server

    yield _start
    for server in servers:
        try:
            check_pool_idle(server)
        finally:
            server.stop()


@pytest.fixture(scope="module")
def server(model_dir):
    """One server shared by a module's tests (default engine settings); its pool is checked after each test by
    the `pool_checked` fixture."""
    from .harness import check_pool_idle, start

    srv = start(model_dir)
    try:
        yield srv
        check_pool_idle(srv)
    finally:
        srv.stop()


@pytest.fixture
def pool_checked(server):
    yield server
    from .harness import check_pool_idle

    check_pool_idle(server)


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """The tiny test model's matmuls on one thread: on a loaded 2-core machine, torch's 2-thread OpenMP pool
    measured 30-90x slower per call than one thread (a [400, 64] x [64, 128] float64 linear: ~0.6 ms vs 32-56 ms);
    restored after the module."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
