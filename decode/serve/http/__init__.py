"""`kvengine serve`'s HTTP layer: an OpenAI-compatible server (FastAPI + uvicorn + prometheus_client) over one
`decode.serve.Engine`, driven by one background engine-loop thread. Needs the ``serve`` extra.

    from decode.serve.http import Server, ServedModel
    Server(engine, ServedModel(("name",), random_weights=False, description="...")).run()

Modules: protocol (request validation, response JSON; no FastAPI), engine_loop (the thread that owns the
engine), metrics (Prometheus), routes (the FastAPI app and its routes), server (uvicorn, signals, a background-thread mode for tests).
"""
from .routes import ServedModel, build_app
from .engine_loop import EngineLoop
from .metrics import ServerMetrics
from .protocol import APIError
from .server import Server

__all__ = ["Server", "ServedModel", "EngineLoop", "ServerMetrics", "APIError", "build_app"]
