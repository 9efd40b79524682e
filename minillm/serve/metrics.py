"""The server's ``/metrics``: the engine's load and latencies in Prometheus' text format.

Names follow vLLM's (``vllm:`` becomes ``minillm:``), so a Grafana board built for one reads the
other. Latencies are the engine's own (``RequestMetrics``: arrival at the front end to the step
that produced the token); a client sees them plus the network and the HTTP layer.
"""

from __future__ import annotations

from typing import Any, Optional

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest

disable_created_metrics()  # no "*_created" timestamp series beside each counter (as vLLM does)

# Seconds; fine at the low end, where a small model on a CPU lives.
LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)


class PrometheusStatLogger:
    """Counters and histograms fed by every step (``record``); gauges set at each scrape.

    Every series carries one label, the model's name, so each is bound to it once here and the
    step loop only adds to it (``finished`` has a second label, the finish reason)."""

    def __init__(self, model_name: str, registry: CollectorRegistry | None = None):
        self.registry = registry if registry is not None else CollectorRegistry()
        self.model_name = model_name

        def series(kind: type, name: str, doc: str, **kwargs: Any) -> Any:
            family = kind(name, doc, ["model_name"], registry=self.registry, **kwargs)
            return family.labels(model_name=model_name)  # exists from the start, at 0

        def latency(name: str, doc: str) -> Any:
            return series(Histogram, name, doc, buckets=LATENCY_BUCKETS)

        # --- load, set when /metrics is read ---
        self.running = series(Gauge, "minillm:num_requests_running", "Requests in the running batch")
        self.waiting = series(Gauge, "minillm:num_requests_waiting", "Requests in the queue (not running)")
        self.swapped = series(Gauge, "minillm:num_requests_swapped", "Requests whose KV sits in host memory")
        self.kv_usage = series(Gauge, "minillm:kv_cache_usage_perc", "Fraction of KV blocks in use (1 = full)")
        # --- per step ---
        self.steps = series(Counter, "minillm:num_steps", "Engine steps")
        self.preemptions = series(Counter, "minillm:num_preemptions", "Preemptions (recompute or swap)")
        self.prompt_tokens = series(Counter, "minillm:prompt_tokens", "Prompt tokens of finished requests")
        self.generation_tokens = series(Counter, "minillm:generation_tokens", "Generated tokens")
        self.finished = Counter(
            "minillm:request_finished",
            "Finished requests by finish reason (n>1: one)",
            ["model_name", "finished_reason"],
            registry=self.registry,
        )
        # --- per finished request (the engine's clock) ---
        self.ttft = latency("minillm:time_to_first_token_seconds", "Time to first token (engine)")
        self.tpot = latency("minillm:time_per_output_token_seconds", "Time per output token after the first (engine)")
        self.e2e = latency("minillm:e2e_request_latency_seconds", "Arrival to last token (engine)")
        self.queue = latency("minillm:request_queue_time_seconds", "Arrival to first scheduled (engine)")

    def record(self, record: Optional[Any], stats: Any) -> None:
        """One pass of ``AsyncLLM``'s step loop: its StepRecord (None when it only applied aborts)
        and its ``IterationStats``. A request counts once, when it ends, however many completions
        (``n``) it has; generated tokens are those handed to the streams, so their total is the sum
        of the responses' ``usage.completion_tokens``."""
        if record is not None:
            self.steps.inc()
            if record.preempted:
                self.preemptions.inc(len(record.preempted))
        if stats.num_generation_tokens:
            self.generation_tokens.inc(stats.num_generation_tokens)
        for m in stats.finished_requests:
            self.finished.labels(model_name=self.model_name, finished_reason=m.finish_reason).inc()
            if m.finish_reason in ("rejected", "abort"):
                continue
            self.prompt_tokens.inc(m.num_prompt_tokens)
            for hist, value in (
                (self.ttft, m.ttft),
                (self.tpot, m.tpot),
                (self.e2e, m.e2e_latency),
                (self.queue, m.queue_wait),
            ):
                if value is not None:
                    hist.observe(value)

    def set_load(self, load: dict) -> None:
        """The gauges, from ``AsyncLLM.load()``."""
        self.running.set(load["running"])
        self.waiting.set(load["waiting"])
        self.swapped.set(load["swapped"])
        self.kv_usage.set(load["kv_usage"])

    def render(self) -> bytes:
        return generate_latest(self.registry)
