"""`Server`: one Engine behind the OpenAI-compatible app, run by uvicorn.

    server = Server(engine, ServedModel(("my-model",), False, "checkpoint DIR"), host="127.0.0.1", port=8000)
    server.run()                     # blocking, main thread: SIGINT/SIGTERM shut down gracefully, returns 0
    server.start()                   # or: in a background thread (tests); server.url; server.stop()

Shutdown (a signal, or `stop`): the server stops admitting (new requests get 503), stops accepting connections,
lets running requests finish for up to ``grace_s`` seconds, cancels what is left (its requests are aborted and
their pages freed), stops the engine loop, and — for a signal — returns normally, so the process exits 0
(uvicorn would otherwise re-raise the signal after its graceful shutdown).
"""
from __future__ import annotations

import contextlib
import signal
import socket
import threading
import time

import uvicorn

from .routes import ServedModel, build_app
from .engine_loop import EngineLoop
from .metrics import ServerMetrics

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class _Uvicorn(uvicorn.Server):
    """uvicorn.Server whose signal handling stops our admission first and never re-raises the signal."""

    def __init__(self, config, on_exit):
        super().__init__(config)
        self._on_exit = on_exit

    @contextlib.contextmanager
    def capture_signals(self):
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        original = {sig: signal.signal(sig, self.handle_exit) for sig in SIGNALS}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)

    def handle_exit(self, sig, frame) -> None:
        self._on_exit()
        super().handle_exit(sig, frame)


class Server:
    def __init__(self, engine, served: ServedModel, host: str = "127.0.0.1", port: int = 8000,
                 grace_s: float = 30.0, log_level: str = "info"):
        self.metrics = ServerMetrics()
        self.loop = EngineLoop(engine, self.metrics)
        self.metrics.bind(self.loop.stats)
        self.app = build_app(self.loop, served, self.metrics)
        self.served, self.host, self.grace_s = served, host, grace_s
        self._socket = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._socket.bind((host, port))           # port 0: a free port, chosen now (see .port)
        self.port = self._socket.getsockname()[1]
        config = uvicorn.Config(self.app, log_level=log_level, lifespan="off", access_log=False,
                                timeout_graceful_shutdown=grace_s)
        self._uvicorn = _Uvicorn(config, self.loop.close_admission)
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def run(self) -> int:
        """Serve until SIGINT/SIGTERM (or `stop` from another thread); returns 0 after a graceful shutdown."""
        self.loop.start()
        try:
            self._uvicorn.run(sockets=[self._socket])
        finally:
            self.loop.stop(grace_s=0.0)          # uvicorn already waited grace_s for the running requests
            self._socket.close()
        return 0

    def start(self, timeout_s: float = 60.0) -> "Server":
        """Serve from a background thread; returns once uvicorn listens."""
        self._thread = threading.Thread(target=self.run, name="kvengine-http", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._uvicorn.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the server did not start within {timeout_s} s")
            time.sleep(0.01)
        return self

    def stop(self, timeout_s: float = 60.0) -> None:
        """What a signal does, from another thread: stop admitting, finish or abort, join."""
        self.loop.close_admission()
        self._uvicorn.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                raise RuntimeError(f"the server did not stop within {timeout_s} s")
