"""The one background thread that owns the (single-threaded) Engine.

HTTP handlers never touch the engine: `EngineLoop.submit` / `abort` / `call` put a command on a thread-safe
queue; the loop thread drains the queue, then runs one ``engine.step()`` and hands each RequestOutput to its
request's sink (a callable; the HTTP side's sink forwards it into an asyncio queue with
``call_soon_threadsafe``). An abort is applied before the next step, so an aborted request's pages are free
within one step. When the engine has nothing to do the thread blocks on the queue (no busy loop).

Stopping (`stop`): no new request is admitted; running ones are stepped to completion until ``grace_s`` has
passed; whatever remains is aborted and its sink told so; the thread exits.

Failure: if ``engine.step()`` raises, the loop logs it, hands every open request an `EngineFailed` (HTTP 500
naming the error), stops admitting (`error` is set; /health answers 503) and exits: never a plausible answer
from an engine in an unknown state.
"""
from __future__ import annotations

import concurrent.futures
import logging
import queue
import threading
import time
from dataclasses import dataclass

LOG = logging.getLogger("kvengine.serve")
ABORTED = "aborted"              # what a sink receives when the server aborts its request (shutdown)


class EngineFailed(RuntimeError):
    """engine.step() raised: every open request is failed with this, the loop stops."""


@dataclass
class _Tracked:
    sink: object
    arrival: float
    final_only: bool = False                   # deliver only the finished output (a whole, non-streamed response)
    last_token: float | None = None


class EngineLoop:
    def __init__(self, engine, metrics=None, idle_wait_s: float = 0.5):
        self.engine = engine
        self.metrics = metrics
        self._idle_wait_s = idle_wait_s
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._closed = False                       # set (under _lock) once the thread no longer reads commands
        self._lock = threading.Lock()
        self._requests: dict[str, _Tracked] = {}
        self._admitting = True
        self._stop_deadline: float | None = None
        self._thread = threading.Thread(target=self._run, name="kvengine-engine-loop", daemon=True)
        self.error: BaseException | None = None
        self.counts = {"added": 0, "rejected": 0, "finished": 0, "aborted": 0, "steps": 0}
        self.latest_stats: dict = dict(engine.stats())

    # ---- called from any thread ----------------------------------------------------------------------------
    def start(self) -> "EngineLoop":
        self._thread.start()
        return self

    @property
    def admitting(self) -> bool:
        return self._admitting and self.error is None and self._thread.is_alive()

    def close_admission(self) -> None:
        """From now on `admitting` is False (the HTTP side answers 503); running requests go on."""
        self._admitting = False

    def submit(self, prompt_token_ids, params, request_id: str, sink,
               final_only: bool = False) -> concurrent.futures.Future:
        """Queue an add_request; the future resolves to the request id, or raises what add_request raised.
        ``sink(output)`` gets every RequestOutput of the request (only the finished one with ``final_only``)."""
        return self._put("add", (list(prompt_token_ids), params, request_id, sink, final_only))

    def abort(self, request_id: str) -> concurrent.futures.Future:
        return self._put("abort", request_id)

    def call(self, fn) -> concurrent.futures.Future:
        """Run ``fn(engine)`` on the loop thread (between steps); the future holds its result."""
        return self._put("call", fn)

    def _put(self, command, arg) -> concurrent.futures.Future:
        future = concurrent.futures.Future()
        with self._lock:
            if self._closed:
                future.set_exception(ShuttingDown("the engine loop has stopped"))
            else:
                self._commands.put((command, arg, future))
        return future

    def stop(self, grace_s: float = 30.0, join_timeout_s: float | None = None) -> None:
        """Stop admitting, finish running requests for up to ``grace_s``, abort the rest, join the thread."""
        self._admitting = False
        self._put("stop", grace_s)
        if self._thread.is_alive():
            self._thread.join(join_timeout_s)

    def stats(self) -> dict:
        """The engine's stats as of the end of the last step (or command), plus the loop's request counts."""
        return {**self.latest_stats, **{f"loop_{k}": v for k, v in self.counts.items()},
                "loop_open_requests": len(self._requests)}

    # ---- the loop thread -----------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                busy = self.engine.has_unfinished_requests()
                if not self._drain(block=not busy):
                    break
                if self.engine.has_unfinished_requests():
                    self._step()
                self.latest_stats = dict(self.engine.stats())
        except Exception as exc:                   # noqa: BLE001 - logged, reported to every open request
            self.error = exc
            LOG.exception("the engine loop failed; every open request is failed and nothing more is admitted")
            for tracked in list(self._requests.values()):
                self._deliver(tracked.sink, EngineFailed(f"engine loop failed: {exc!r}"))
            self._requests.clear()
        finally:
            self._fail_queued()

    def _drain(self, block: bool) -> bool:
        """Apply the queued commands; block for the first one when idle. False once it is time to exit."""
        while True:
            if self._stop_deadline is not None:
                if not self._requests or time.monotonic() >= self._stop_deadline:
                    self._abort_all()
                    return False
                block = False
            try:
                command, arg, future = self._commands.get(block=block, timeout=self._idle_wait_s if block else None)
            except queue.Empty:
                if block:
                    continue
                return True
            block = False
            self._apply(command, arg, future)

    def _apply(self, command, arg, future) -> None:
        try:
            if command == "add":
                result = self._add(*arg)
            elif command == "abort":
                result = self._abort(arg)
            elif command == "call":
                result = arg(self.engine)
            else:                                  # stop
                self._admitting = False
                self._stop_deadline = time.monotonic() + arg
                result = None
        except Exception as exc:                   # noqa: BLE001 - handed to the caller
            future.set_exception(exc)
        else:
            future.set_result(result)

    def _add(self, prompt_token_ids, params, request_id, sink, final_only) -> str:
        if self._stop_deadline is not None:
            raise ShuttingDown("the server is shutting down; no new requests are admitted")
        try:
            rid = self.engine.add_request(prompt_token_ids, params, request_id=request_id)
        except ValueError:
            self.counts["rejected"] += 1
            raise
        self.counts["added"] += 1
        self._requests[rid] = _Tracked(sink, time.monotonic(), final_only)
        return rid

    def _abort(self, request_id: str) -> bool:
        tracked = self._requests.pop(request_id, None)
        if tracked is None:
            return False                           # already finished (or never admitted)
        self.counts["aborted"] += 1
        if self.metrics is not None:
            self.metrics.observe_finished("abort")
        return bool(self.engine.abort(request_id))

    def _abort_all(self) -> None:
        for rid in list(self._requests):
            sink = self._requests[rid].sink
            self._abort(rid)
            self._deliver(sink, ABORTED)

    def _step(self) -> None:
        outputs = self.engine.step()
        self.counts["steps"] += 1
        now, batches = time.monotonic(), {}
        for out in outputs:
            tracked = self._requests.get(out.request_id)
            if tracked is None:                    # aborted meanwhile: nobody listens
                continue
            if out.new_token_ids and self.metrics is not None:
                self.metrics.observe_tokens(now, tracked.arrival, tracked.last_token, len(out.new_token_ids))
            if out.new_token_ids:
                tracked.last_token = now
            if out.finished:
                del self._requests[out.request_id]
                self.counts["finished"] += 1
                if self.metrics is not None:
                    self.metrics.observe_finished(out.finish_reason)
            if out.finished or not tracked.final_only:
                self._collect(batches, tracked.sink, out)
        for channel, pairs in batches.items():     # one wake-up per event loop per step, not one per token
            self._deliver(channel.deliver, pairs)

    def _collect(self, batches: dict, sink, item) -> None:
        """A sink with a ``channel`` (see `Channel`) is batched with the others of its channel; a plain
        callable is called at once."""
        channel = getattr(sink, "channel", None)
        if channel is None:
            self._deliver(sink, item)
        else:
            batches.setdefault(channel, []).append((sink, item))

    @staticmethod
    def _deliver(sink, item) -> None:
        try:
            sink(item)
        except Exception:                          # noqa: BLE001 - a listener gone away must not stop the loop
            pass


    def _fail_queued(self) -> None:
        """After the loop ends, no command waits forever."""
        with self._lock:
            self._closed = True
        while True:
            try:
                command, arg, future = self._commands.get_nowait()
            except queue.Empty:
                return
            if future is not None and not future.done():
                future.set_exception(ShuttingDown("the server is shutting down; no new requests are admitted"))


class ShuttingDown(RuntimeError):
    """A request (or command) that arrived after stop()."""


class Channel:
    """Hands items to sinks that live on one asyncio event loop: one ``call_soon_threadsafe`` per batch."""

    def __init__(self, event_loop):
        self.event_loop = event_loop

    def deliver(self, pairs) -> None:
        self.event_loop.call_soon_threadsafe(_put_all, pairs)


def _put_all(pairs) -> None:
    for sink, item in pairs:
        sink.put(item)


class ChannelSink:
    """A sink for `EngineLoop.submit`: ``put(item)`` runs on the channel's event loop (e.g. an asyncio queue's
    ``put_nowait``); calling the sink delivers one item on its own."""

    def __init__(self, channel: Channel, put):
        self.channel, self.put = channel, put

    def __call__(self, item) -> None:
        self.channel.deliver([(self, item)])
