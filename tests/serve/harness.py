"""Helpers of the server tests: start a server on a free loopback port, ask the engine things between steps,
wait (bounded) for the pool to go idle, read /metrics."""
import re
import time

import httpx2

from decode.serve import Engine
from decode.serve.http import ServedModel, Server

MODEL_NAME = "tiny-f64"


def start(model_dir, **engine_kwargs) -> Server:
    engine_kwargs.setdefault("max_tokens", 8192)
    engine = Engine(str(model_dir), **engine_kwargs)
    return Server(engine, ServedModel((MODEL_NAME,), True, "test model"), host="127.0.0.1", port=0,
                  log_level="warning").start()


def engine_call(server: Server, fn, timeout_s: float = 30.0):
    """``fn(engine)`` run on the engine-loop thread (between steps)."""
    return server.loop.call(fn).result(timeout_s)


def pace_steps(server: Server, seconds: float) -> None:
    """Every later ``engine.step()`` sleeps ``seconds`` after it returns (the GIL released), so a test that
    must see a request mid-run is not outrun by the engine thread: unpaced, the tiny model can finish 400
    tokens before a loaded machine schedules the test's client thread again."""
    def install(engine):
        step = engine.step

        def paced_step():
            outputs = step()
            time.sleep(seconds)
            return outputs
        engine.step = paced_step
    engine_call(server, install)


def engine_stats(server: Server) -> dict:
    return engine_call(server, lambda engine: dict(engine.stats()))


def wait_idle(server: Server, timeout_s: float = 30.0) -> dict:
    """Bounded wait until nothing runs or waits and only the prefix cache holds pages."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = engine_stats(server)
        idle = (stats["requests_running"] == 0 and stats["requests_waiting"] == 0
                and stats["pages_in_use"] == stats["prefix_cached_pages"])
        if idle or time.monotonic() > deadline:
            return stats
        time.sleep(0.02)


def check_pool_idle(server: Server) -> None:
    stats = wait_idle(server)
    assert stats["requests_running"] == 0 and stats["requests_waiting"] == 0, stats
    assert stats["pages_in_use"] == stats["prefix_cached_pages"], stats
    engine_call(server, lambda engine: engine.check_invariants())
    assert server.loop.stats()["loop_open_requests"] == 0


def metric(server: Server, name: str) -> float:
    text = httpx2.get(server.url + "/metrics", timeout=30).text
    match = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
    assert match, f"{name} not in /metrics"
    return float(match.group(1))


def completion_body(prompt, max_tokens, **extra) -> dict:
    return {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "return_token_ids": True, **extra}
