"""Prometheus metrics on a private registry (several servers can live in one process, e.g. in tests).

Names follow vLLM's where one exists (`*_total` counters, `*_seconds` histograms) under the `ninfer_`
prefix. Counters are bumped by the scheduler thread; gauges are set after every engine step.
"""
from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
                    1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)


class ServerMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self):
        r = self.registry = CollectorRegistry(auto_describe=True)
        self.running = Gauge("ninfer_requests_running", "Requests in the engine (decoding or prefilling)", registry=r)
        self.waiting = Gauge("ninfer_requests_waiting", "Requests admitted to the queue, not yet in the engine",
                             registry=r)
        self.requests = Counter("ninfer_requests", "Finished requests by finish reason", ["finish_reason"],
                                registry=r)
        self.errors = Counter("ninfer_request_errors", "Requests answered with an error status (4xx/5xx), by status",
                                ["status"], registry=r)
        self.prompt_tokens = Counter("ninfer_prompt_tokens", "Prompt tokens of requests that entered the engine "
                                     "(image tokens included)", registry=r)
        self.image_tokens = Counter("ninfer_image_tokens", "Image (vision) tokens of requests that entered the "
                                    "engine; also counted in ninfer_prompt_tokens", registry=r)
        self.images = Counter("ninfer_images", "Images of requests that entered the engine", registry=r)
        self.generation_tokens = Counter("ninfer_generation_tokens", "Generated tokens", registry=r)
        self.ttft = Histogram("ninfer_time_to_first_token_seconds", "Arrival to first generated token",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("ninfer_inter_token_latency_seconds", "Time between generated tokens",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("ninfer_request_latency_seconds", "Arrival to finish", buckets=_LATENCY_BUCKETS,
                             registry=r)
        self.kv_pages_total = Gauge("ninfer_kv_pages_total", "Pages in the shared KV pool", registry=r)
        self.kv_pages_used = Gauge("ninfer_kv_pages_used", "KV pages held by sequences", registry=r)
        self.kv_pages_reserved = Gauge("ninfer_kv_pages_reserved", "KV pages reserved by admitted requests",
                                       registry=r)
        self.kv_usage = Gauge("ninfer_kv_usage_ratio", "Used / total KV pages", registry=r)
        self.spec_drafted = Counter("ninfer_spec_decode_drafted_tokens", "MTP draft tokens proposed", registry=r)
        self.spec_accepted = Counter("ninfer_spec_decode_accepted_tokens", "MTP draft tokens accepted", registry=r)
        self.spec_pos_drafted = Counter("ninfer_spec_decode_drafted_tokens_per_pos",
                                        "MTP draft tokens proposed at draft position", ["position"], registry=r)
        self.spec_pos_accepted = Counter("ninfer_spec_decode_accepted_tokens_per_pos",
                                         "MTP draft tokens accepted at draft position", ["position"], registry=r)

        self.prefix_queries = Counter("ninfer_prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                                      registry=r)
        self.prefix_hits = Counter("ninfer_prefix_cache_hits", "Prompt tokens resumed from the prefix cache",
                                   registry=r)

    def set_kv(self, total: int, used: int, reserved: int) -> None:
        self.kv_pages_total.set(total)
        self.kv_pages_used.set(used)
        self.kv_pages_reserved.set(reserved)
        self.kv_usage.set(used / total if total else 0.0)

    def add_spec(self, drafted: int, accepted: int, per_pos_drafted, per_pos_accepted) -> None:
        """Increments (not totals); per-position lists are indexed from draft position 0."""
        if drafted:
            self.spec_drafted.inc(drafted)
        if accepted:
            self.spec_accepted.inc(accepted)
        for i, n in enumerate(per_pos_drafted):
            if n:
                self.spec_pos_drafted.labels(position=str(i)).inc(n)
        for i, n in enumerate(per_pos_accepted):
            if n:
                self.spec_pos_accepted.labels(position=str(i)).inc(n)

    def render(self) -> bytes:
        return generate_latest(self.registry)
