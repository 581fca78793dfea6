"""``GET /metrics``: Prometheus text (prometheus_client), one registry per server.

Gauges and counters are read from the engine loop's latest stats snapshot at scrape time (the engine is never
touched from the HTTP thread); the two latency histograms are observed by the loop thread as tokens come out:

    kvengine_pages_total, kvengine_pages_in_use, kvengine_prefix_cached_pages          gauges (pages)
    kvengine_requests_running, kvengine_requests_waiting                               gauges
    kvengine_preemptions_total, kvengine_prefix_cache_hit_tokens_total,
    kvengine_prompt_tokens_total, kvengine_generation_tokens_total                     counters (engine totals)
    kvengine_requests_total{finish_reason}, kvengine_requests_rejected_total           counters (server)
    kvengine_time_to_first_token_seconds, kvengine_inter_token_latency_seconds         histograms
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
GAUGES = {"pages_total": "KV pages in the pool", "pages_in_use": "KV pages referenced (requests or prefix cache)",
          "prefix_cached_pages": "KV pages held by the prefix cache",
          "requests_running": "requests scheduled in the running batch",
          "requests_waiting": "requests admitted but waiting (or preempted)"}
COUNTERS = {"preemptions": "requests preempted because the pool ran out",
            "prefix_cache_hit_tokens": "prompt tokens served from the prefix cache",
            "prompt_tokens": "prompt tokens admitted", "generation_tokens": "tokens generated"}
TTFT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class _EngineStats:
    """A custom collector: the engine loop's stats snapshot as gauges and counters."""

    def __init__(self, stats_fn):
        self._stats_fn = stats_fn

    def collect(self):
        stats = self._stats_fn()
        for name, doc in GAUGES.items():
            yield GaugeMetricFamily(f"kvengine_{name}", doc, value=stats.get(name, 0))
        for name, doc in COUNTERS.items():
            yield CounterMetricFamily(f"kvengine_{name}", doc, value=stats.get(f"{name}_total", 0))


class ServerMetrics:
    def __init__(self, stats_fn=lambda: {}):
        self.registry = CollectorRegistry()
        self.ttft = Histogram("kvengine_time_to_first_token_seconds", "arrival to first generated token",
                              buckets=TTFT_BUCKETS, registry=self.registry)
        self.itl = Histogram("kvengine_inter_token_latency_seconds", "time between a request's consecutive tokens",
                             buckets=ITL_BUCKETS, registry=self.registry)
        self.finished = Counter("kvengine_requests", "requests ended, by finish reason", ["finish_reason"],
                                registry=self.registry)
        self.rejected = Counter("kvengine_requests_rejected", "requests refused with HTTP 4xx",
                                registry=self.registry)
        self._engine = _EngineStats(stats_fn)
        self.registry.register(self._engine)

    def bind(self, stats_fn) -> None:
        self._engine._stats_fn = stats_fn

    def observe_tokens(self, now: float, arrival: float, last_token: float | None, count: int) -> None:
        """``count`` tokens of one request came out at ``now`` (loop thread)."""
        if last_token is None:
            self.ttft.observe(now - arrival)
            count -= 1
            last_token = now
        for _ in range(count):                     # a step that yields k tokens: k gaps of (now - last) / k
            self.itl.observe((now - last_token) / max(count, 1))

    def observe_finished(self, reason) -> None:
        self.finished.labels(finish_reason=str(reason)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
