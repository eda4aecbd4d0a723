"""`rollouts exporter`: what Redis knows about one pipeline, as Prometheus metrics for the whole fleet.

Each scrape reads Redis once, through `pipeline.top.snapshot` (what `rollouts top` shows), so the
exporter holds no state and any number of them agree. What only a process knows (latencies, sync
stalls) comes from the `--metrics-port` of the workers and the manager instead.

Conventions: every name starts with `rollouts_`, values are in base units (`_seconds`), counters
end in `_total`, and every sample carries `ns`. A counter read from Redis (a heartbeat's
`generated_tokens`, the scorer's `groups`) restarts from 0 with the process that keeps it, which
Prometheus's `rate()` takes in its stride. A Redis that cannot be reached gives `rollouts_up 0`
and nothing else, never an HTTP error, so that an alert on `rollouts_up == 0` fires.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Iterator
from typing import Any
from wsgiref.simple_server import WSGIServer

import redis
from prometheus_client import start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.gc_collector import GCCollector
from prometheus_client.platform_collector import PlatformCollector
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.registry import Collector, CollectorRegistry

from pipeline.scaling import need
from pipeline.streams import Streams
from pipeline.top import snapshot

log = logging.getLogger(__name__)

WORKER_FIELDS: tuple[tuple[str, str, str, str], ...] = (
    # heartbeat field, metric name, type, help
    ("version", "rollouts_worker_policy_version", "gauge", "Policy version the worker's engine has loaded."),
    ("epoch", "rollouts_worker_sync_epoch", "gauge", "Last weight-sync epoch the worker acked."),
    ("inflight", "rollouts_worker_inflight_samples", "gauge", "Samples in flight on the worker's engine."),
    ("sessions", "rollouts_worker_pinned_sessions", "gauge", "Gateway sessions pinned to the worker now."),
    ("published", "rollouts_worker_published_rollouts", "counter", "Rollouts the worker published since it started."),
    (
        "generated_tokens",
        "rollouts_worker_generated_tokens",
        "counter",
        "Tokens the worker generated since it started.",
    ),
    ("tokens_per_s", "rollouts_worker_tokens_per_second", "gauge", "Tokens/s over the worker's last heartbeat period."),
    ("busy_s", "rollouts_worker_busy_seconds", "counter", "Seconds with samples in flight and not paused for a sync."),
    ("started", "rollouts_worker_start_time_seconds", "gauge", "When the worker started, in unix seconds."),
)

SCORER_FIELDS: tuple[tuple[str, str, str, str], ...] = (
    ("open_groups", "rollouts_scorer_open_groups", "gauge", "Groups the scoring stage holds until they are whole."),
    ("running", "rollouts_scorer_running_groups", "gauge", "Groups whose reward call is running."),
    ("queued", "rollouts_scorer_rq_queued_jobs", "gauge", "Scoring jobs waiting on the RQ queue."),
    ("rq_workers", "rollouts_scorer_rq_workers", "gauge", "RQ workers serving the scoring queue."),
    ("groups", "rollouts_scorer_scored_groups", "counter", "Groups scored and forwarded to the trainer."),
    ("rollouts", "rollouts_scorer_forwarded_rollouts", "counter", "Rollouts forwarded to the trainer."),
    ("reward_errors", "rollouts_scorer_reward_errors", "counter", "Groups forwarded with a reward_error."),
    ("retries", "rollouts_scorer_retries", "counter", "RQ jobs enqueued again (their worker died); leader's count."),
    ("timed_out", "rollouts_scorer_timed_out", "counter", "Inline reward calls past the timeout; leader's count."),
)


NEEDED_DOC = (
    "Workers that would hold all the work there is now: ceil((waiting + held) / the entries a worker holds at most); "
    "what an autoscaler sizes the fleet by (pipeline.scaling)."
)


def _number(value: Any) -> float | None:
    """A heartbeat or state field as a number; None for one that is missing or not a number."""
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


class _Families:
    """Metric families of one scrape, made on first use, every sample labelled with the namespace."""

    def __init__(self, ns: str) -> None:
        self.ns = ns
        self._families: dict[str, CounterMetricFamily | GaugeMetricFamily] = {}

    def add(self, kind: str, name: str, doc: str, value: float | None, **labels: str) -> None:
        if value is None:
            return
        family = self._families.get(name)
        if family is None:
            make = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
            family = self._families[name] = make(name, doc, labels=["ns", *labels])
        family.add_metric([self.ns, *labels.values()], value)

    def __iter__(self) -> Iterator[Metric]:
        return iter(self._families.values())


def families(snap: dict[str, Any]) -> Iterable[Metric]:
    """The fleet's metrics from one `top` snapshot (a dict, so that this is testable without Redis)."""
    out = _Families(snap["ns"])
    for stream, info in snap["streams"].items():
        out.add("gauge", "rollouts_stream_length", "Entries in the stream.", info["length"], stream=stream)
        for group, g in info["groups"].items():
            labels = {"stream": stream, "group": group}
            # `lag` is unknown on Redis 6.2 (and where 7.x cannot tell): no sample rather than a wrong one.
            out.add("gauge", "rollouts_stream_group_lag", "Entries not yet delivered to the group.", g["lag"], **labels)
            out.add("gauge", "rollouts_stream_group_pending", "Entries delivered, not acked.", g["pending"], **labels)
            out.add("gauge", "rollouts_stream_group_consumers", "Consumers in the group.", g["consumers"], **labels)
    p = snap["policy"]
    out.add("gauge", "rollouts_policy_version", "Policy version: 0 at start, +1 per publish.", p["version"])
    out.add("gauge", "rollouts_sync_epoch", "Weight syncs begun (the state's epoch).", p["epoch"])
    out.add("gauge", "rollouts_paused", "1 while a weight sync holds the workers paused.", int(p["paused"]))
    out.add("counter", "rollouts_admission_submitted_samples", "Samples ever admitted.", p["submitted"])
    out.add("counter", "rollouts_admission_stale_samples", "Samples parked as too stale.", p["stale"])
    out.add("gauge", "rollouts_admission_used_samples", "Samples in use: submitted, not parked.", p["used"])
    out.add("gauge", "rollouts_admission_capacity_samples", "(max_staleness + v + 1) * batch_size.", p["capacity"])
    out.add("gauge", "rollouts_admission_free_samples", "Capacity left before submit blocks.", p["free"])
    out.add("gauge", "rollouts_admission_max_staleness", "The staleness bound, in policy versions.", p["max_staleness"])
    out.add("gauge", "rollouts_admission_batch_size_samples", "Samples per training step.", p["batch_size"])
    statuses: dict[str, int] = {}
    for worker, beat in sorted(snap["workers"].items()):
        status = beat.get("status", "unknown")
        statuses[status] = statuses.get(status, 0) + 1
        info_doc = "1 for each live worker, with its status and engine."
        out.add(
            "gauge", "rollouts_worker_info", info_doc, 1, worker=worker, status=status, engine=beat.get("engine", "")
        )
        for field, name, kind, doc in WORKER_FIELDS:
            out.add(kind, name, doc, _number(beat.get(field)), worker=worker)
        beat_ts = _number(beat.get("ts"))
        age = None if beat_ts is None else max(0.0, snap["ts"] - beat_ts)
        out.add(
            "gauge", "rollouts_worker_heartbeat_age_seconds", "Seconds since the last heartbeat.", age, worker=worker
        )
    for status, count in sorted(statuses.items()):
        out.add("gauge", "rollouts_workers", "Live workers (heartbeat not expired) by status.", count, status=status)
    fleet = need(snap)
    if fleet is not None:  # unknown on Redis 6.2 (no lag): no sample rather than a wrong one
        out.add("gauge", "rollouts_workers_needed", NEEDED_DOC, fleet.needed)
        out.add("gauge", "rollouts_entries_waiting", "Entries no worker has taken (prompts, partials).", fleet.waiting)
        out.add("gauge", "rollouts_entries_held", "Entries the live workers hold.", fleet.held)
    scorer = snap.get("scorer") or {}
    if scorer:
        doc = "1 while the scoring stage has a status hash, with its leader and mode."
        out.add("gauge", "rollouts_scorer_info", doc, 1, leader=scorer.get("leader", ""), mode=scorer.get("mode", ""))
        age_doc = "Seconds since the scoring stage's leader last wrote its status."
        out.add("gauge", "rollouts_scorer_status_age_seconds", age_doc, _number(scorer.get("age_s")))
        for field, name, kind, doc in SCORER_FIELDS:
            out.add(kind, name, doc, _number(scorer.get(field)))
    return out


class FleetCollector(Collector):
    """Reads Redis at every scrape (`pipeline.top.snapshot`) and reports the fleet's metrics."""

    def __init__(self, streams: Streams) -> None:
        self.streams = streams

    def collect(self) -> Iterator[Metric]:
        ns = self.streams.keys.ns
        started = time.perf_counter()
        up = GaugeMetricFamily(
            "rollouts_up", "1 if the last scrape read Redis, 0 if Redis was unreachable.", labels=["ns"]
        )
        try:
            snap = snapshot(self.streams)
        except (redis.RedisError, OSError) as exc:
            log.warning("scrape of %s failed: %s", ns, exc)
            up.add_metric([ns], 0)
        else:
            up.add_metric([ns], 1)
            yield from families(snap)
        yield up
        took = GaugeMetricFamily(
            "rollouts_scrape_duration_seconds", "Seconds the scrape spent reading Redis.", labels=["ns"]
        )
        took.add_metric([ns], time.perf_counter() - started)
        yield took


def serve(registry: CollectorRegistry, port: int, addr: str = "0.0.0.0") -> WSGIServer:
    """Serve `registry` on http://addr:port/metrics from a daemon thread (port 0: a free one; OSError if taken)."""
    server, _thread = start_http_server(port, addr, registry=registry)
    return server


def process_registry() -> CollectorRegistry:
    """A registry with the usual `process_*` and `python_*` metrics, for the one a process serves."""
    registry = CollectorRegistry()
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    GCCollector(registry=registry)
    return registry
