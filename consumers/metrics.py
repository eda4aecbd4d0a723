"""What only a worker process knows, as Prometheus metrics: latencies, tokens, errors, sync stalls.

The fleet's view (stream depths, versions, heartbeats) comes from `rollouts exporter`; this is the
rest, served on `rollouts worker --metrics-port`. Each worker has a registry of its own, so that a
process (a test) may hold several. The worker calls one method per event; nothing here reads Redis.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 60.0, 120.0, 300.0, 600.0)
"""Seconds for one sample: milliseconds on the tiny model, minutes for long reasoning rollouts."""
TOKEN_BUCKETS = tuple(float(2**i) for i in range(16))
"""Tokens per sample: 1 to 32768, powers of two."""
SYNC_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
"""Seconds of a weight sync: tens of ms for a small model on one host, up to the ack deadline."""
START_BUCKETS = (0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0)
"""Seconds of an engine's cold start (and loading the current version): ~1 s for torch on a tiny model, ~20 s for
vLLM on a CPU, minutes for a large model."""
FINISH_REASONS = ("stop", "length", "abort", "error")


class WorkerMetrics:
    """The worker's counters and histograms, labelled with its namespace and name."""

    def __init__(self, ns: str, worker: str, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        names, values = ["ns", "worker"], [ns, worker]

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(name, doc, [*names, *extra], registry=self.registry)

        def histogram(name: str, doc: str, buckets: tuple[float, ...], extra: tuple[str, ...] = ()) -> Histogram:
            return Histogram(name, doc, [*names, *extra], registry=self.registry, buckets=buckets)

        latency = histogram(
            "rollouts_generation_seconds",
            "Seconds one engine call took for one sample (or its continuation), by finish reason.",
            LATENCY_BUCKETS,
            ("finish_reason",),
        )
        tokens = histogram(
            "rollouts_generation_tokens", "Tokens one engine call generated for one sample.", TOKEN_BUCKETS
        )
        self._latency = {reason: latency.labels(*values, reason) for reason in FINISH_REASONS}
        self._latency_family = latency
        self._values = values
        self._tokens_per_sample = tokens.labels(*values)
        self._tokens = counter("rollouts_generated_tokens", "Tokens generated.").labels(*values)
        self._errors = counter(
            "rollouts_error_rollouts", "Samples that ended with finish_reason=error (the engine refused the prompt)."
        ).labels(*values)
        self._published = counter("rollouts_published_rollouts", "Rollouts published.").labels(*values)
        self._dead = counter(
            "rollouts_dead_letters", "Entries sent to {ns}:dead: decode (bad input), deliver (kept killing workers).",
            ("stage",),
        )  # fmt: skip
        for stage in ("decode", "deliver"):
            self._dead.labels(*values, stage)
        self._failed = counter(
            "rollouts_failed_prompts", "Prompts that failed here (not their fault) and stay pending for a retry."
        ).labels(*values)
        self._stall = histogram(
            "rollouts_sync_stall_seconds", "Weight sync as this worker saw it: pause to resumed.", SYNC_BUCKETS
        ).labels(*values)
        self._pause = histogram(
            "rollouts_sync_pause_seconds", "Seconds the engine took to pause for a weight sync.", SYNC_BUCKETS
        ).labels(*values)
        self._load = histogram(
            "rollouts_weight_load_seconds", "Seconds to load a new policy version and ack it.", SYNC_BUCKETS
        ).labels(*values)
        self._adapter_loads = counter(
            "rollouts_adapter_loads", "LoRA adapters loaded into the engine: on demand (a request) or by a sync.",
            ("why",),
        )  # fmt: skip
        self._adapter_evictions = counter(
            "rollouts_adapter_evictions", "Idle LoRA adapters evicted to make room for another (--max-loras)."
        ).labels(*values)
        self._adapter_stall = histogram(
            "rollouts_adapter_sync_stall_seconds",
            "One adapter's weight sync as this worker saw it: its pause to its resume (other adapters go on).",
            SYNC_BUCKETS,
        ).labels(*values)

        starts = counter(
            "rollouts_engine_starts", "Engine starts: at launch, or on demand (--lazy, or after a release).", ("why",)
        )
        self._starts = {why: starts.labels(*values, why) for why in ("launch", "demand")}
        self._start_seconds = histogram(
            "rollouts_engine_start_seconds", "Seconds from an engine start to serving the current version.",
            START_BUCKETS,
        ).labels(*values)  # fmt: skip
        self._releases = counter(
            "rollouts_engine_releases", "Engines shut down after --release-after-s seconds without work."
        ).labels(*values)
        self._up = Gauge(
            "rollouts_engine_up", "1 while the worker holds a started engine, 0 while idle or released.", names,
            registry=self.registry,
        ).labels(*values)  # fmt: skip

    def engine_started(self, why: str, seconds: float) -> None:
        """The engine started (`launch` or `demand`) and serves the current version `seconds` later."""
        self._starts[why].inc()
        self._start_seconds.observe(seconds)
        self._up.set(1)

    def engine_released(self) -> None:
        self._releases.inc()
        self._up.set(0)

    def generated(self, seconds: float, tokens: int, finish_reason: str) -> None:
        """One engine call for one sample ended (a sample continued from a partial counts again)."""
        child = self._latency.get(finish_reason) or self._latency_family.labels(*self._values, finish_reason)
        child.observe(seconds)
        self._tokens_per_sample.observe(tokens)
        self._tokens.inc(tokens)
        if finish_reason == "error":
            self._errors.inc()

    def published(self, rollouts: int) -> None:
        self._published.inc(rollouts)

    def dead_letter(self, stage: str) -> None:
        self._dead.labels(*self._values, stage).inc()

    def prompt_failed(self) -> None:
        self._failed.inc()

    def synced(self, pause_s: float, load_s: float) -> None:
        """The engine paused in `pause_s` and loaded (and acked) the new version in `load_s`."""
        self._pause.observe(pause_s)
        self._load.observe(load_s)

    def resumed(self, stall_s: float) -> None:
        """Generation goes on `stall_s` after the pause for the sync began."""
        self._stall.observe(stall_s)

    def adapter_loaded(self, why: str) -> None:
        """An adapter was loaded: `demand` (a request needed it) or `sync` (its new version, where it was held)."""
        self._adapter_loads.labels(*self._values, why).inc()

    def adapter_evicted(self) -> None:
        self._adapter_evictions.inc()

    def adapter_resumed(self, stall_s: float) -> None:
        self._adapter_stall.observe(stall_s)
