"""A client that goes away mid-request gets its request aborted and its pages back (streamed and not)."""
import json
import queue
import socket
import time

import httpx2

from .harness import completion_body, engine_call, engine_stats, pace_steps, wait_idle


PROMPT = list(range(3, 60))      # 57 tokens: 4 pages of 16
PACE_S = 0.02                    # 400 paced steps take >= 8 s: the checks below run mid-request


def _holding(server) -> bool:
    """One request runs and holds its pages (the prefix cache may count its full pages as cached too, so the
    check is on pages in use, not on in-use minus cached)."""
    stats = engine_stats(server)
    return stats["requests_running"] == 1 and stats["pages_in_use"] >= 4


def test_stream_disconnect_aborts_and_frees_the_pages(start_server):
    server = start_server()
    pace_steps(server, PACE_S)
    body = completion_body(PROMPT, 400, stream=True)
    received = 0
    with httpx2.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        # the iterator is held: a `for` over a bare `r.iter_lines()` closes it at the `break`, and with it (httpcore
        # closes its stream on GeneratorExit) the connection, so the server could abort before the check below
        lines = r.iter_lines()
        for line in lines:
            received += line.startswith("data: {")
            if received == 3:
                break
        assert _holding(server), (engine_stats(server), server.loop.stats())  # mid-stream: running, holding pages
        lines.close()
    stats = wait_idle(server, timeout_s=20)        # the connection is closed: abort, pages back
    loop = server.loop.stats()
    assert stats["pages_in_use"] == stats["prefix_cached_pages"] and stats["requests_running"] == 0, (stats, loop)
    assert loop["loop_aborted"] == 1 and loop["loop_finished"] == 0 and loop["loop_open_requests"] == 0, (stats, loop)
    assert stats["generation_tokens_total"] < 400, (stats, loop)  # it did not run on to the end


def test_non_stream_disconnect_aborts_and_frees_the_pages(start_server):
    server = start_server()
    pace_steps(server, PACE_S)
    data = json.dumps(completion_body(PROMPT, 400)).encode()
    request = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
               f"Content-Length: {len(data)}\r\n\r\n").encode() + data
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall(request)
        deadline = time.monotonic() + 30
        while not _holding(server):                # bounded: wait until it runs
            assert time.monotonic() < deadline, engine_stats(server)
            time.sleep(0.01)
    stats = wait_idle(server, timeout_s=20)
    assert stats["pages_in_use"] == stats["prefix_cached_pages"] and stats["requests_running"] == 0
    assert server.loop.stats()["loop_aborted"] == 1
    assert stats["generation_tokens_total"] < 400


def test_an_abort_frees_the_pages_before_the_next_step(start_server):
    from decode.serve import SamplingParams

    server = start_server()
    pace_steps(server, PACE_S)
    outputs = queue.Queue()
    params = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)
    assert server.loop.submit(PROMPT, params, "long-one", outputs.put).result(30) == "long-one"
    assert outputs.get(timeout=60).new_token_ids            # it runs and holds pages
    assert _holding(server)
    assert server.loop.abort("long-one").result(30) is True
    steps_at_abort = server.loop.stats()["loop_steps"]
    stats, steps = engine_call(server, lambda engine: (dict(engine.stats()), server.loop.counts["steps"]))
    assert steps == steps_at_abort                           # no step ran in between
    assert stats["pages_in_use"] == stats["prefix_cached_pages"] and stats["requests_running"] == 0
    assert server.loop.abort("long-one").result(30) is False  # already gone


def test_an_engine_failure_fails_loudly(model_dir):
    """step() raising: the open request gets HTTP 500 naming the error, /health turns 503, new requests 503."""
    from decode.serve import Engine
    from decode.serve.http import ServedModel, Server

    engine = Engine(str(model_dir), max_tokens=4096)
    server = Server(engine, ServedModel(("m",), True, "test"), port=0, log_level="critical").start()
    try:
        def broken_step():
            raise RuntimeError("injected step failure")
        server.loop.call(lambda e: setattr(e, "step", broken_step)).result(30)
        r = httpx2.post(server.url + "/v1/completions", json={"prompt": [5, 6], "max_tokens": 3}, timeout=60)
        assert r.status_code == 500 and "injected step failure" in r.json()["error"]["message"]
        assert httpx2.get(server.url + "/health", timeout=30).status_code == 503
        r = httpx2.post(server.url + "/v1/completions", json={"prompt": [5, 6], "max_tokens": 3}, timeout=60)
        assert r.status_code == 503
    finally:
        server.stop()
