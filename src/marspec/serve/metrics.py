"""Prometheus metrics of the server: HTTP requests, generations, tokens and acceptance (tau)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
TAU_BUCKETS = (1.0, 1.25, 1.5, 2.0, 2.5, 3.0, 4.0, 5.0, 6.0, 8.0, 12.0)
CONTENT_TYPE = CONTENT_TYPE_LATEST


class ServerMetrics:
    """All of one server's metrics, in a registry of their own: two apps in one process (tests) must not
    share counters, and prometheus_client's global registry would make them collide."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter(
            "marspec_requests",
            "HTTP requests answered, by endpoint and status code.",
            ["endpoint", "status"],
            registry=r,
        )
        self.request_latency = Histogram(
            "marspec_request_latency_seconds",
            "From a request's arrival to the last byte of its response.",
            ["endpoint"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.time_to_first_token = Histogram(
            "marspec_time_to_first_token_seconds",
            "From a request's arrival to its first text, queue included.",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.queue_wait = Histogram(
            "marspec_queue_wait_seconds",
            "Time a request waited for the model.",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.generations = Counter(
            "marspec_generations",
            "Generations by outcome: completed, timed_out (stopped at the time limit), cancelled_disconnect, "
            "cancelled_shutdown, cancelled_refused (another choice of its request was refused: queue full), "
            "rejected (bad input found by the model side) or failed (server error).",
            ["outcome"],
            registry=r,
        )
        self.prompt_tokens = Counter("marspec_prompt_tokens", "Prompt tokens of generations.", registry=r)
        self.completion_tokens = Counter(
            "marspec_completion_tokens", "Tokens generated (completed and timed-out generations).", registry=r
        )
        self.target_forwards = Counter(
            "marspec_target_forwards",
            "Target verification forwards of completed generations; their tokens (EOS included) per "
            "forward is tau.",
            registry=r,
        )
        self.draft_tokens = Counter("marspec_draft_tokens", "Draft tokens proposed.", registry=r)
        self.accepted_tokens = Counter(
            "marspec_accepted_draft_tokens",
            "Draft tokens accepted, by kind: exact (the target's top choice) or relaxed (MARS: the "
            "target's runner-up at a near-tie).",
            ["kind"],
            registry=r,
        )
        self.rejected_steps = Counter(
            "marspec_rejected_steps", "Verification steps that rejected a draft token.", registry=r
        )
        self.tau = Histogram(
            "marspec_tau",
            "Mean accepted length (tokens per target forward) of each completed generation.",
            buckets=TAU_BUCKETS,
            registry=r,
        )
        self.queue_depth = Gauge("marspec_queue_depth", "Requests waiting for the model.", registry=r)
        self.busy = Gauge("marspec_busy", "1 while the model is generating, else 0.", registry=r)
        self.batch_size = Gauge(
            "marspec_batch_size", "Requests being decoded together (continuous batching).", registry=r
        )
        self.batch_peak = Gauge(
            "marspec_batch_peak",
            "The most requests one target forward has served since the start.",
            registry=r,
        )

    def track(
        self,
        queue_depth: Callable[[], int],
        busy: Callable[[], bool],
        batch_size: Callable[[], int],
        batch_peak: Callable[[], int],
    ) -> None:
        """Read the queue and batch gauges from the engine at scrape time, so they can never drift."""
        self.queue_depth.set_function(lambda: float(queue_depth()))
        self.busy.set_function(lambda: float(busy()))
        self.batch_size.set_function(lambda: float(batch_size()))
        self.batch_peak.set_function(lambda: float(batch_peak()))

    def observe_generation(
        self, outcome: str, prompt_tokens: int, completion_tokens: int, stats: dict[str, Any] | None
    ) -> None:
        """Count one generation that left the worker; ``stats`` is ``GenerationStats.to_dict()`` when the
        generation ran to its end."""
        self.generations.labels(outcome=outcome).inc()
        self.prompt_tokens.inc(prompt_tokens)
        self.completion_tokens.inc(completion_tokens)
        if stats is None:
            return
        self.target_forwards.inc(stats["target_forwards"])
        self.draft_tokens.inc(stats["drafted"])
        self.accepted_tokens.labels(kind="exact").inc(stats["accepted_exact"])
        self.accepted_tokens.labels(kind="relaxed").inc(stats["accepted_relaxed"])
        self.rejected_steps.inc(stats["rejected"])
        if stats["target_forwards"]:
            self.tau.observe(stats["tau"])

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)
