"""`kvengine serve` as a process (127.0.0.1, port 0 = a free port, read back from its log line): SIGTERM lets
the running request finish and exits 0; SIGINT with a short grace aborts what runs and exits 0; without
--model it serves a random-weight model and says so."""
import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx2
import pytest

ROOT = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 240


class ServeProcess:
    def __init__(self, *args):
        env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
        self.proc = subprocess.Popen([sys.executable, "-m", "decode.app.cli", "serve", "--port", "0",
                                      "--log-level", "warning", *args], cwd=ROOT, env=env,
                                     stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
        self.lines: queue.Queue = queue.Queue()
        self.log: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()
        self.banner = self._wait_for("listening on http://")
        self.url = re.search(r"listening on (http://127\.0\.0\.1:\d+)", self.banner).group(1)

    def _read(self):
        for line in self.proc.stderr:
            self.lines.put(line)

    def _wait_for(self, text: str) -> str:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=1)
            except queue.Empty:
                if self.proc.poll() is not None:
                    break
                continue
            self.log.append(line)
            if text in line:
                return line
        self.kill()
        pytest.fail(f"no {text!r} from kvengine serve: {''.join(self.log)}")

    def wait(self, timeout_s: float = 120) -> int:
        try:
            return self.proc.wait(timeout_s)
        finally:
            while not self.lines.empty():
                self.log.append(self.lines.get())

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)


def stream_tokens(url: str, body: dict, first_chunk: threading.Event, result: dict) -> None:
    tokens, last = [], None
    try:
        with httpx2.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    tokens += json.loads(line[6:])["choices"][0].get("token_ids", [])
                    first_chunk.set()
                last = line or last
    except httpx2.HTTPError as exc:
        result["error"] = repr(exc)
    finally:
        first_chunk.set()
        result["tokens"], result["last"] = tokens, last


def run_and_signal(server: ServeProcess, sig, max_tokens: int) -> dict:
    body = {"prompt": list(range(3, 40)), "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    first_chunk, result = threading.Event(), {}
    client = threading.Thread(target=stream_tokens, args=(server.url, body, first_chunk, result))
    client.start()
    assert first_chunk.wait(120), "no first chunk"
    server.proc.send_signal(sig)
    client.join(120)
    assert not client.is_alive()
    return result


def test_sigterm_finishes_the_running_request_and_exits_0(model_dir):
    server = ServeProcess("--model", str(model_dir), "--kv-cache-memory", "8MiB", "--served-model-name", "tiny")
    try:
        assert "tiny" in server.banner
        result = run_and_signal(server, signal.SIGTERM, max_tokens=120)
        assert server.wait() == 0, "".join(server.log)
    finally:
        server.kill()
    assert result["last"] == "data: [DONE]" and len(result["tokens"]) == 120, result
    assert "Traceback" not in "".join(server.log)
    with pytest.raises(httpx2.HTTPError):
        httpx2.get(server.url + "/health", timeout=5)


def test_random_default_is_labelled_and_sigint_with_short_grace_aborts_and_exits_0():
    server = ServeProcess("--kv-cache-memory", "16MiB", "--timeout-graceful-shutdown", "0.5")
    try:
        assert "random-weight" in server.banner and "NOT a trained model" in server.banner
        models = httpx2.get(server.url + "/v1/models", timeout=30).json()["data"]
        assert models[0]["id"] == "kvengine-random-weights" and models[0]["random_weights"] is True
        r = httpx2.post(server.url + "/v1/chat/completions", timeout=120,
                        json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 3
        result = run_and_signal(server, signal.SIGINT, max_tokens=1500)
        assert server.wait() == 0, "".join(server.log)
    finally:
        server.kill()
    assert len(result["tokens"]) < 1500, "the grace period was 0.5 s: the request should have been cut short"
