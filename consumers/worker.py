"""The consumer worker: read work, keep many samples in flight on one engine, publish rollouts.

One asyncio loop per worker. Redis calls run on threads through the synchronous stream
layer; the engine runs its own compute. What the loop guarantees:
- many requests in flight at once, so that the engine's batching stays full;
- `{ns}:partials` is read before `{ns}:prompts`;
- a prompt is acked in the same atomic step that publishes its rollouts (at-least-once);
- work held by a worker that stopped beating is claimed by the others;
- bad input never stops the loop: undecodable entries become dead letters, requests the
  engine refuses become `finish_reason=error` rollouts.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import time
from dataclasses import dataclass

import numpy as np

from consumers.engine import Engine, EngineClosedError, EngineInputError, Generation
from pipeline.streams import Entry, Streams
from pipeline.wire import Prompt, Rollout, WireError

log = logging.getLogger(__name__)


def default_worker_name() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


@dataclass
class WorkerSettings:
    max_inflight: int = 256
    """Samples in flight on the engine at once."""
    block_ms: int = 1000
    """How long one read waits for new work."""
    heartbeat_s: float = 1.0
    """Heartbeat period; in-flight entries are touched at the same pace."""
    heartbeat_ttl_s: float = 5.0
    """A worker whose heartbeat is older than this is shown as gone."""
    claim_idle_ms: int = 10_000
    """Work untouched for this long belongs to a dead worker and is claimed."""
    max_deliveries: int = 5
    """An entry handed out more often than this (it keeps killing workers) becomes a dead letter."""
    trim_every_s: float = 10.0
    drain_timeout_s: float = 30.0
    """On stop, how long to let in-flight work finish; the rest stays pending for other workers."""


class Worker:
    def __init__(
        self, streams: Streams, engine: Engine, name: str | None = None, settings: WorkerSettings | None = None
    ):
        self.streams = streams
        self.engine = engine
        self.name = name or default_worker_name()
        self.settings = settings or WorkerSettings()
        self.status = "starting"
        self.failure: str | None = None
        """Why the worker stopped on its own (its engine died); None after a requested stop."""
        self.published = 0
        self.generated_tokens = 0
        self._inflight: dict[tuple[str, bytes], Entry] = {}
        self._inflight_samples = 0
        self._mean_n = 1.0
        self._room = asyncio.Event()
        self._stopping = asyncio.Event()
        self._tasks: set[asyncio.Task] = set()
        self._started = time.time()
        self._tokens_per_s = 0.0

    def stop(self) -> None:
        """Ask the worker to stop taking work and drain; safe to call from a signal handler in the loop."""
        self._stopping.set()
        self._room.set()

    async def run(self) -> None:
        await asyncio.to_thread(self.streams.ensure_groups)
        await self.engine.start()
        self.status = "serving"
        upkeep = asyncio.create_task(self._upkeep())
        try:
            await self._read_loop()
            self.status = "stopping"
            await self._beat()
            await self._drain()
        finally:
            upkeep.cancel()
            await self.engine.shutdown()
            await asyncio.to_thread(self.streams.forget_worker, self.name)

    # -- reading ------------------------------------------------------------------------------

    async def _read_loop(self) -> None:
        while not self._stopping.is_set():
            free = self.settings.max_inflight - self._inflight_samples
            if free <= 0:
                self._room.clear()
                await self._room.wait()
                continue
            count = max(1, int(free / self._mean_n))
            entries = await asyncio.to_thread(self.streams.read_work, self.name, count, self.settings.block_ms)
            # fakeredis (and a BLOCK that timed out) answer an empty read: just read again.
            for entry in entries:
                self._start(entry)

    def _start(self, entry: Entry) -> None:
        task = asyncio.create_task(self._serve(entry))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _drain(self) -> None:
        if not self._tasks:
            return
        _done, pending = await asyncio.wait(list(self._tasks), timeout=self.settings.drain_timeout_s)
        for task in pending:
            task.cancel()
        if pending:
            log.warning("%s: %d prompts left unfinished; they stay pending for other workers", self.name, len(pending))

    # -- serving one entry --------------------------------------------------------------------

    async def _serve(self, entry: Entry) -> None:
        try:
            prompt = Prompt.from_fields(entry.fields)
        except WireError as exc:
            log.warning("%s: dead letter %s: %s", self.name, entry.id, exc)
            await asyncio.to_thread(self.streams.dead_letter, entry, str(exc), "decode")
            return
        self._mean_n = 0.9 * self._mean_n + 0.1 * prompt.n
        self._inflight[entry.stream, entry.id] = entry
        self._inflight_samples += prompt.n
        try:
            rollouts = await asyncio.gather(*(self._generate_sample(prompt, k, entry) for k in range(prompt.n)))
            published = await asyncio.to_thread(self.streams.publish_rollouts, rollouts, entry)
            if published > 0:
                self.published += published
        except EngineClosedError as exc:
            # The engine is gone: stop, so that a supervisor restarts us and the others claim our work.
            if not self._stopping.is_set():
                log.error("%s: %s; stopping, prompt %s stays pending", self.name, exc, prompt.id)
                self.failure = str(exc)
                self.stop()
        except Exception:
            # Not the prompt's fault (a failed engine step, Redis gone): leave it pending for a retry elsewhere.
            log.exception("%s: prompt %s failed; it stays pending", self.name, prompt.id)
        finally:
            del self._inflight[entry.stream, entry.id]
            self._inflight_samples -= prompt.n
            self._room.set()

    async def _generate_sample(self, prompt: Prompt, sample: int, entry: Entry) -> Rollout:
        sampling = prompt.sampling
        if sampling.seed is not None:
            sampling = sampling.model_copy(update={"seed": sampling.seed + sample})
        started = time.time()
        version = self.engine.version
        error = None
        try:
            # Keyed by entry, not prompt id: a resubmitted prompt id may be in flight here twice.
            request_id = f"{prompt.id}@{entry.id.decode()}:{sample}"
            generation = await self.engine.generate(request_id, prompt.tokens, sampling)
        except EngineInputError as exc:
            error = str(exc)
            empty = np.zeros(0, dtype=np.int32)
            generation = Generation(empty, empty.astype(np.float32), "error", [])
        self.generated_tokens += len(generation.tokens)
        finished = time.time()
        spans = generation.spans or [(version, 0, len(generation.tokens))]
        return Rollout(
            prompt_id=prompt.id,
            sample=sample,
            n=prompt.n,
            version=spans[0][0],
            version_end=spans[-1][0],
            finish_reason=generation.finish_reason,
            worker=self.name,
            prompt_tokens=prompt.tokens,
            tokens=generation.tokens,
            logprobs=generation.logprobs,
            spans=spans if generation.tokens.size else [],
            meta=prompt.meta,
            timing={"queued_s": max(0.0, started - prompt.ts), "generate_s": finished - started, "finished": finished},
            error=error,
        )

    # -- upkeep: heartbeat, keep own work, claim abandoned work, trim -------------------------

    async def _upkeep(self) -> None:
        last_trim = 0.0
        last_tokens, last_time = 0, time.monotonic()
        while True:
            now = time.monotonic()
            self._tokens_per_s = (self.generated_tokens - last_tokens) / max(now - last_time, 1e-6)
            last_tokens, last_time = self.generated_tokens, now
            try:
                await self._beat()
                if self._inflight:
                    await asyncio.to_thread(self.streams.touch, self.name, list(self._inflight.values()))
                if not self._stopping.is_set():
                    await self._claim_abandoned()
                if now - last_trim > self.settings.trim_every_s:
                    last_trim = now
                    for stream in (self.streams.keys.prompts, self.streams.keys.partials):
                        await asyncio.to_thread(self.streams.trim_consumed, stream)
            except Exception:
                log.exception("%s: upkeep failed; retrying", self.name)
            await asyncio.sleep(self.settings.heartbeat_s)

    async def _beat(self) -> None:
        status = {
            "status": self.status,
            "engine": self.engine.name,
            "version": self.engine.version,
            "inflight": self._inflight_samples,
            "published": self.published,
            "tokens_per_s": round(self._tokens_per_s, 1),
            "started": round(self._started, 3),
            "ts": round(time.time(), 3),
        }
        await asyncio.to_thread(self.streams.heartbeat, self.name, status, self.settings.heartbeat_ttl_s)

    async def _claim_abandoned(self) -> None:
        free = self.settings.max_inflight - self._inflight_samples
        if free <= 0:
            return
        count = max(1, int(free / self._mean_n))
        claimed = await asyncio.to_thread(self.streams.claim_abandoned, self.name, self.settings.claim_idle_ms, count)
        for entry in claimed:
            if (entry.stream, entry.id) in self._inflight:
                continue  # ours already (we stalled past the idle limit): keep serving it once
            deliveries = await asyncio.to_thread(self.streams.delivery_count, entry)
            if deliveries > self.settings.max_deliveries:
                reason = f"handed out {deliveries} times without finishing (limit {self.settings.max_deliveries})"
                await asyncio.to_thread(self.streams.dead_letter, entry, reason, "deliver")
                continue
            log.info("%s: claimed abandoned %s %s", self.name, entry.stream, entry.id)
            self._start(entry)


def run_worker(streams: Streams, engine: Engine, name: str | None, settings: WorkerSettings) -> Worker:
    """Run a worker until SIGINT/SIGTERM, then drain and stop the engine."""
    worker = Worker(streams, engine, name, settings)

    async def main() -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, worker.stop)
        await worker.run()

    asyncio.run(main())
    return worker
