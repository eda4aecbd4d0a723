"""Group commit for a worker's publishes: what finishes while a publish is on the wire goes out together.

A worker finishes prompts one by one, each published (with its entry's ack) by one script call. At thousands of
rollouts a second a round trip per prompt leaves both the worker and Redis waiting on each other. So at most
`senders` pipelines are on the wire at a time, and every prompt finished meanwhile waits for one and goes in the
next (`Streams.publish_many`), at most `max_batch` together. A lone publish goes at once, as before: batching adds
no wait, only coalesces what is waiting anyway. Each prompt keeps its own atomic script, so the guarantees are
those of `Streams.publish_rollouts` (tested in `tests/test_streams.py`).

Batches are kept small (16 prompts) and several are on the wire at once, so that Redis always has one to run while
the worker encodes the next and builds what comes after: with 64 a batch, a worker's whole window (256 samples in
flight: 64 prompts of 4) went out as one pipeline, and the worker and Redis took turns, each idle while the other
worked (`rollouts bench-broker` on 2 cores: ~12k rollouts/s published; 16 a batch and 4 senders: ~17-18k/s, ~20k/s
with `Streams._pipelined`; see the README's broker path).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

from pipeline.streams import Entry, Publish, Streams
from pipeline.wire import Partial, Rollout


class Publisher:
    """`await publisher.publish(...)` is `Streams.publish_rollouts` for asyncio code, batched with its neighbours."""

    def __init__(self, streams: Streams, max_batch: int = 16, senders: int = 4) -> None:
        self.streams = streams
        self.max_batch = max_batch
        self.senders = senders
        """Batches on the wire at once (a connection each): while Redis runs one, the next is encoded."""
        self._threads = ThreadPoolExecutor(senders, thread_name_prefix="publisher")
        """A thread a sender, not the event loop's default executor: the worker's other blocking calls (its reads of
        work and of its bell block up to a second each, its heartbeats) share that one, and publishes must neither
        queue behind them nor hold them up."""
        self._waiting: list[tuple[Publish, asyncio.Future[int]]] = []
        self._sending: set[asyncio.Task[None]] = set()
        self.batches = 0
        """Pipelines sent so far (publishes / batches: how much coalescing happened)."""

    async def publish(
        self,
        rollouts: Sequence[Rollout],
        source: Entry,
        partials: Sequence[Partial] = (),
        reply_to: str | None = None,
    ) -> int:
        """Publish and ack, atomically for this entry; returns what `Streams.publish_rollouts` returns, or raises
        what it raises (a Redis error for this entry, a lost connection for its whole batch)."""
        done: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self._waiting.append((Publish(rollouts, source, partials, reply_to), done))
        if len(self._sending) < self.senders:
            self._sending.add(asyncio.create_task(self._send()))
        return await done

    async def _send(self) -> None:
        """Send what waits, a batch at a time, until nothing does.

        A sender leaves `_sending` in the same step in which it finds nothing waiting. A done-callback would do it
        a step later, after the callers it answered have run: a caller that published again at once would see
        every sender busy and wait for ever with none left to send it."""
        batch: list[tuple[Publish, asyncio.Future[int]]] = []
        me = asyncio.current_task()
        try:
            while self._waiting:
                batch, self._waiting = self._waiting[: self.max_batch], self._waiting[self.max_batch :]
                self.batches += 1
                try:
                    results = await asyncio.get_running_loop().run_in_executor(
                        self._threads, self.streams.publish_many, [p for p, _ in batch]
                    )
                except Exception as exc:  # the connection: no entry of the batch is known to be done
                    results = [exc] * len(batch)
                for (_, done), result in zip(batch, results, strict=True):
                    if done.done():  # its caller was cancelled (a drain that timed out)
                        continue
                    if isinstance(result, Exception):
                        done.set_exception(result)
                    else:
                        done.set_result(result)
        except asyncio.CancelledError:  # the loop is closing: nobody waits for ever
            left, self._waiting = batch + self._waiting, []
            for _, done in left:
                done.cancel()
            raise
        finally:
            self._sending.discard(me)  # type: ignore[arg-type]
