"""The manager's metrics: every weight sync on `{ns}:control`, whoever drove it, served on `--metrics-port`.

A sync is usually driven by the trainer's process (`publish_weights`), not by `rollouts manager`;
but every sync leaves its `weights` and `resume` commands, each stamped with `ts`, on the control
stream, and every eviction a `stop` that names one worker. So the manager, always running, follows
that stream and observes each sync once: the stall is `resume.ts - weights.ts` of one epoch (from
the command going out to generation going on). Syncs it finished itself (their driver died) are
counted apart. Each sync (its start and its end), eviction and sleep it observes is also logged, at info.
"""

from __future__ import annotations

import logging

from prometheus_client import CollectorRegistry, Counter, Histogram

from pipeline.control import CONTROL_BATCH
from pipeline.streams import Streams
from pipeline.wire import Control, WireError
from staleness.state import weights_command

log = logging.getLogger(__name__)

SYNC_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
"""Seconds: tens of ms for a small model on one host, up to an ack deadline (or an abandoned sync)."""


class SyncMetrics:
    """Follows `{ns}:control` from where it stands when created; call `poll()` now and then."""

    def __init__(self, streams: Streams, registry: CollectorRegistry | None = None) -> None:
        self.streams = streams
        self.registry = registry if registry is not None else CollectorRegistry()
        ns = streams.keys.ns

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, ["ns"], registry=self.registry).labels(ns)

        self._syncs = counter("rollouts_manager_syncs", "Weight syncs concluded (a resume on the control stream).")
        self._evictions = counter("rollouts_manager_evictions", "Workers stopped for missing an ack deadline.")
        self._abandoned = counter("rollouts_manager_abandoned_syncs", "Syncs whose driver died, finished here.")
        self._stall = Histogram(
            "rollouts_manager_sync_stall_seconds", "Weight sync stall: the weights command to the resume.", ["ns"],
            registry=self.registry, buckets=SYNC_BUCKETS,
        ).labels(ns)  # fmt: skip
        self._after = streams.control.last_id()
        self._begun: dict[tuple[str, int], float] = {}
        """`weights` command time by (adapter, epoch) (each adapter counts its own epochs), until its resume comes."""

    def poll(self) -> None:
        """Observe the control commands that came since the last poll."""
        while True:
            entries = self.streams.control.read(self._after, None)
            for entry in entries:
                self._after = entry.id
                try:
                    command = Control.from_fields(entry.fields)
                except WireError:
                    continue  # a worker ignores it too
                self._observe(command)
            if len(entries) < CONTROL_BATCH:  # else there is more to read at once
                return

    def _observe(self, command: Control) -> None:
        of = f" of adapter {command.adapter}" if command.adapter else ""
        if command.cmd == "weights":
            self._begun[command.adapter, command.epoch] = command.ts
            log.info("sync %d%s began: version %d from %s (pause: %s)", command.epoch, of, command.version,
                     command.uri, command.mode)  # fmt: skip
        elif command.cmd == "sleep":
            log.info("sleep %d began: level %d (pause: %s)", command.epoch, command.level, command.mode)
        elif command.cmd == "stop" and command.worker:
            self._evictions.inc()
            log.warning("worker %s evicted: it did not ack in time (its work goes to the others)", command.worker)
        elif command.cmd == "stop":
            log.warning("every worker told to stop")
        elif command.cmd == "resume":
            begun = self._begun.pop((command.adapter, command.epoch), None)
            if begun is None:  # begun before this manager started
                adapter = command.adapter or None
                weights = weights_command(self.streams.redis, self.streams.keys, command.epoch, adapter=adapter)
                begun = weights.ts if weights is not None else None
            self._syncs.inc()
            stall = max(0.0, command.ts - begun) if begun is not None else None
            if stall is not None:
                self._stall.observe(stall)
            log.info("sync %d%s done: the workers resume at version %d%s", command.epoch, of, command.version,
                     f" after a stall of {stall:.3f} s" if stall is not None else "")  # fmt: skip

    def abandoned(self) -> None:
        """This manager finished a sync whose driver died. Its evictions and its resume are on the control stream
        already: they are read first, so that a scrape that shows the abandoned sync shows them too."""
        self.poll()
        self._abandoned.inc()
