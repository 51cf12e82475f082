"""Server metrics in the Prometheus text format (counters, gauges, histograms), with no global registry: one
`Metrics` per server, written by the scheduler thread and read by /metrics (plain int/float updates under the GIL)."""

from __future__ import annotations

import bisect
import threading
from dataclasses import dataclass, field

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)


@dataclass
class Histogram:
    buckets: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    n: int = 0

    def __post_init__(self):
        self.counts = [0] * (len(self.buckets) + 1)

    def observe(self, v: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, v)] += 1
        self.total += v
        self.n += 1

    def render(self, name: str) -> list[str]:
        out, acc = [], 0
        for b, c in zip(self.buckets, self.counts):
            acc += c
            out.append(f'{name}_bucket{{le="{b:g}"}} {acc}')
        out += [f'{name}_bucket{{le="+Inf"}} {self.n}', f"{name}_sum {self.total:.6f}", f"{name}_count {self.n}"]
        return out


@dataclass
class Metrics:
    requests: dict[str, int] = field(default_factory=dict)  # finish status -> count
    rejected: dict[str, int] = field(default_factory=dict)  # HTTP status -> count
    prompt_tokens: int = 0
    generation_tokens: int = 0
    decode_steps: int = 0  # batched forward passes that produced tokens
    step_tokens: int = 0  # tokens produced by those steps (tokens/step = step_tokens / decode_steps)
    draft_tokens: int = 0  # speculative drafts proposed / accepted (acceptance = accepted / draft)
    accepted_tokens: int = 0
    queue_depth: int = 0
    running: int = 0
    e2e: Histogram = field(default_factory=lambda: Histogram(LATENCY_BUCKETS))
    ttft: Histogram = field(default_factory=lambda: Histogram(LATENCY_BUCKETS))
    batch: Histogram = field(default_factory=lambda: Histogram(BATCH_BUCKETS))
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def finished(self, status: str, latency: float) -> None:
        with self.lock:
            self.requests[status] = self.requests.get(status, 0) + 1
            self.e2e.observe(latency)

    def reject(self, http_status: int) -> None:
        with self.lock:
            self.rejected[str(http_status)] = self.rejected.get(str(http_status), 0) + 1

    def step(self, batch: int, tokens: int) -> None:
        with self.lock:
            self.decode_steps += 1
            self.step_tokens += tokens
            self.batch.observe(batch)

    def render(self) -> str:
        with self.lock:
            tps = self.step_tokens / self.decode_steps if self.decode_steps else 0.0
            acc = self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0
            table = [  # name, type, help, samples (a plain number: one unlabelled sample)
                ("requests_total", "counter", "Finished requests by finish reason.",
                 [f'qconv_requests_total{{status="{k}"}} {v}' for k, v in sorted(self.requests.items())]),
                ("rejected_requests_total", "counter", "Requests refused with an HTTP error, by status.",
                 [f'qconv_rejected_requests_total{{code="{k}"}} {v}' for k, v in sorted(self.rejected.items())]),
                ("prompt_tokens_total", "counter", "Prompt tokens prefilled.", self.prompt_tokens),
                ("generation_tokens_total", "counter", "Tokens generated.", self.generation_tokens),
                ("decode_steps_total", "counter", "Batched decode forward passes.", self.decode_steps),
                ("tokens_per_step", "gauge", "Mean tokens produced per decode step (batch x accepted).", f"{tps:.4f}"),
                ("spec_draft_tokens_total", "counter", "Speculative draft tokens proposed.", self.draft_tokens),
                ("spec_accepted_tokens_total", "counter", "Speculative draft tokens accepted.", self.accepted_tokens),
                ("spec_acceptance_rate", "gauge", "Accepted / proposed draft tokens.", f"{acc:.4f}"),
                ("queue_depth", "gauge", "Requests waiting for a slot.", self.queue_depth),
                ("running_requests", "gauge", "Requests in the running batch.", self.running),
                ("request_latency_seconds", "histogram", "End-to-end request latency.", self.e2e),
                ("time_to_first_token_seconds", "histogram", "Time from arrival to the first token.", self.ttft),
                ("batch_size", "histogram", "Rows per decode step.", self.batch),
            ]
            lines: list[str] = []
            for name, kind, help_, samples in table:
                name = f"qconv_{name}"
                if isinstance(samples, Histogram):
                    samples = samples.render(name)
                elif not isinstance(samples, list):
                    samples = [f"{name} {samples}"]
                lines += [f"# HELP {name} {help_}", f"# TYPE {name} {kind}", *samples]
            return "\n".join(lines) + "\n"
