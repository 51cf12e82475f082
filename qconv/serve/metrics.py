"""Server metrics through prometheus_client, in a registry of the server's own (no global registry): written by the
scheduler thread and the HTTP handlers, rendered by /metrics."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)


class Metrics:
    def __init__(self):
        r = self.registry = CollectorRegistry()
        self.requests = Counter("qconv_requests", "Finished requests by finish reason.", ["status"], registry=r)
        self.rejected = Counter(
            "qconv_rejected_requests", "Requests refused with an HTTP error, by status.", ["code"], registry=r
        )
        self.prompt_tokens = Counter("qconv_prompt_tokens", "Prompt tokens prefilled.", registry=r)
        self.generation_tokens = Counter("qconv_generation_tokens", "Tokens generated.", registry=r)
        self.decode_steps = Counter("qconv_decode_steps", "Batched decode forward passes.", registry=r)
        self.step_tokens = Counter(
            "qconv_step_tokens", "Tokens produced by decode steps (batch x accepted).", registry=r
        )
        self.drafts = Counter(
            "qconv_spec_drafts", "Decode rows that verified a non-empty draft (vLLM's num_drafts).", registry=r
        )
        self.draft_tokens = Counter("qconv_spec_draft_tokens", "Speculative draft tokens proposed.", registry=r)
        self.accepted_tokens = Counter("qconv_spec_accepted_tokens", "Speculative draft tokens accepted.", registry=r)
        self.queue_depth = Gauge("qconv_queue_depth", "Requests waiting for a slot.", registry=r)
        self.running = Gauge("qconv_running_requests", "Requests in the running batch.", registry=r)
        Gauge("qconv_tokens_per_step", "Mean tokens produced per decode step.", registry=r).set_function(
            lambda: self._ratio("qconv_step_tokens_total", "qconv_decode_steps_total")
        )
        Gauge("qconv_spec_acceptance_rate", "Accepted / proposed draft tokens.", registry=r).set_function(
            lambda: self._ratio("qconv_spec_accepted_tokens_total", "qconv_spec_draft_tokens_total")
        )
        self.e2e = Histogram(
            "qconv_request_latency_seconds", "End-to-end request latency.", registry=r, buckets=LATENCY_BUCKETS
        )
        self.ttft = Histogram(
            "qconv_time_to_first_token_seconds",
            "Time from arrival to the first token.",
            registry=r,
            buckets=LATENCY_BUCKETS,
        )
        self.batch = Histogram("qconv_batch_size", "Rows per decode step.", registry=r, buckets=BATCH_BUCKETS)

    def value(self, sample: str, **labels: str) -> float:
        return self.registry.get_sample_value(sample, labels) or 0.0

    def _ratio(self, num: str, den: str) -> float:
        d = self.value(den)
        return self.value(num) / d if d else 0.0

    def finished(self, status: str, latency: float) -> None:
        self.requests.labels(status=status).inc()
        self.e2e.observe(latency)

    def reject(self, http_status: int) -> None:
        self.rejected.labels(code=str(http_status)).inc()

    def step(self, batch: int, tokens: int) -> None:
        self.decode_steps.inc()
        self.step_tokens.inc(tokens)
        self.batch.observe(batch)

    def render(self) -> bytes:
        return generate_latest(self.registry)
