"""What a gateway replica knows, as Prometheus metrics on its own `/metrics` route.

Calls by route and HTTP status, their seconds, the calls waiting now (for an answer, or for a weight
sync's resume before they are queued), sessions finished, and cached prompt tokens against prompt
tokens (the prefix-cache hit rate of the replica's turns). Labelled with the namespace and replica.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

CALL_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
"""Seconds of one call, queue and generation included: milliseconds on the tiny model, minutes for long turns."""


class GatewayMetrics:
    def __init__(self, ns: str, gateway: str) -> None:
        self.registry = CollectorRegistry()
        labels, self._values = ["ns", "gateway"], [ns, gateway]
        self.calls = Counter(
            "rollouts_gateway_calls", "Calls answered, by route and HTTP status.", [*labels, "route", "status"],
            registry=self.registry,
        )  # fmt: skip
        self.seconds = Histogram(
            "rollouts_gateway_call_seconds", "Seconds from a call's arrival to its answer, by route.",
            [*labels, "route"], registry=self.registry, buckets=CALL_BUCKETS,
        )  # fmt: skip
        self.waiting = Gauge(
            "rollouts_gateway_waiting_calls",
            "Calls waiting now: for their answer (answer), or for a weight sync's resume before being queued (resume).",
            [*labels, "on"], registry=self.registry,
        )  # fmt: skip
        self.finished = Counter(
            "rollouts_gateway_finished_sessions", "Sessions finished (trajectories sent to the trainer).", labels,
            registry=self.registry,
        ).labels(*self._values)  # fmt: skip
        tokens = Counter(
            "rollouts_gateway_prompt_tokens", "Prompt tokens of the turns answered, and those the engine had cached.",
            [*labels, "kind"], registry=self.registry,
        )  # fmt: skip
        self.prompt_tokens, self.cached_tokens = (
            tokens.labels(*self._values, "all"),
            tokens.labels(*self._values, "cached"),
        )
        for on in ("answer", "resume"):
            self.waiting.labels(*self._values, on)

    def call(self, route: str, status: int, seconds: float) -> None:
        self.calls.labels(*self._values, route, str(status)).inc()
        self.seconds.labels(*self._values, route).observe(seconds)

    def wait(self, on: str) -> Gauge:
        """The gauge of calls waiting `on` "answer" or "resume" (use `.track_inprogress()`)."""
        return self.waiting.labels(*self._values, on)
