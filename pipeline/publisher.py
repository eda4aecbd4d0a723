"""Group commit for a worker's publishes: what finishes while a publish is on the wire goes out together.

A worker finishes prompts one by one, each published (with its entry's ack) by one script call. At thousands of
rollouts a second a round trip per prompt leaves both the worker and Redis waiting on each other. So at most
`senders` pipelines are on the wire at a time, and every prompt finished meanwhile waits for one and goes in the
next (`Writer.publish_many`), at most `max_batch` together. A lone publish goes at once, as before: batching adds
no wait, only coalesces what is waiting anyway. Each prompt keeps its own atomic script, so the guarantees are
those of `Writer.publish_rollouts` (tested in `tests/pipeline/test_streams.py`).

Batches are kept small (16 prompts) and several are on the wire at once, so that Redis always has one to run while
the worker encodes the next and builds what comes after: with large batches a worker's whole window goes out as one
pipeline, and the worker and Redis take turns, each idle while the other works (`rollouts-bench bench-broker`
measures the publish path).

The batches are packed on the event loop and pipelined on one asyncio connection of the publisher's own
(`pipeline.pipelined`), not handed to threads on the sync client (a hand-off and a GIL tug of war a batch). A client
whose connections are not redis-py's (fakeredis) publishes through `Writer.publish_many` on the publisher's threads.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, cast

import hiredis

from pipeline.connections import async_retry, async_twin, socket_timeout_s
from pipeline.durability import STALE, NotDurableError
from pipeline.pipelined import PipelinedConnection
from pipeline.streams import Entry, Publish, Writer, publish_results, script_unknown
from pipeline.wire import Partial, Rollout


class Publisher:
    """`await publisher.publish(...)` is `Writer.publish_rollouts` for asyncio code, batched with its neighbours."""

    def __init__(self, writer: Writer, max_batch: int = 16, senders: int = 4) -> None:
        self.writer = writer
        self.max_batch = max_batch
        self.senders = senders
        """Batches on the wire at once: while Redis runs one, the next is encoded."""
        self._twin = async_twin(writer.redis)
        self._pipe: tuple[asyncio.AbstractEventLoop, PipelinedConnection] | None = None
        self._threads = None if self._twin else ThreadPoolExecutor(senders, thread_name_prefix="publisher")
        """A sender a thread, for a client that has no asyncio twin (fakeredis): not the event loop's default
        executor, which the worker's blocking reads of work and of its bell (up to a second each) and its heartbeats
        share: publishes must neither queue behind them nor hold them up."""
        self._waiting: list[tuple[Publish, asyncio.Future[int]]] = []
        self._sending: set[asyncio.Task[None]] = set()
        self._on_wire = 0
        """Batches sent and not yet answered."""
        self.batches = 0
        """Pipelines sent so far (publishes / batches: how much coalescing happened)."""
        self.timings: list[tuple[float, float]] | None = None
        """Set to a list to record each publish as `(wall time, milliseconds of its batch on the wire)`: client-side
        latency, which includes this process's own queueing (`rollouts scale`)."""

    async def publish(
        self,
        rollouts: Sequence[Rollout],
        source: Entry,
        partials: Sequence[Partial] = (),
        reply_to: str | None = None,
    ) -> int:
        """Publish and ack, atomically for this entry; returns what `Writer.publish_rollouts` returns, or raises
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
                size = self._batch_size(len(self._waiting))
                batch, self._waiting = self._waiting[:size], self._waiting[size:]
                self.batches += 1
                started = time.perf_counter()
                self._on_wire += 1
                try:
                    results = await self._publish_many([p for p, _ in batch])
                except Exception as exc:  # the connection: no entry of the batch is known to be done
                    results = [exc] * len(batch)
                finally:
                    self._on_wire -= 1
                if self.timings is not None:
                    self.timings += [(time.time(), (time.perf_counter() - started) * 1000)] * len(batch)
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
            self._sending.discard(me)

    def _batch_size(self, waiting: int) -> int:
        """The next batch: what waits shared evenly among the senders with no batch on the wire, at most `max_batch`.

        A burst that finds the wire idle (vLLM's last step of a batch ends ~100 samples at once) then goes out in
        pieces, the first on the wire while the worker encodes the next, so that the trainer reads and decodes the
        first while the worker is still at the rest. Taken whole, at `max_batch`, the first piece would leave only once
        16 prompts were encoded, and the trainer's last read would wait for the largest piece. Under steady load a
        sender comes back with the others still on the wire and takes a whole batch: smaller ones there cost
        throughput."""
        idle = self.senders - self._on_wire
        return min(self.max_batch, -(-waiting // idle))

    async def _publish_many(self, publishes: list[Publish]) -> list[int | Exception]:
        """`Writer.publish_many`, on the publisher's asyncio connection when it has one."""
        loop = asyncio.get_running_loop()
        if self._threads is not None:
            return await loop.run_in_executor(self._threads, self.writer.publish_many, publishes)
        pipe = self._pipeline(loop)
        commands = self.writer.publish_commands(publishes)
        replies: list[Any] = await self._call(pipe, commands)
        if unknown := script_unknown(replies):  # Redis restarted or its scripts were flushed: those ran nothing
            await asyncio.to_thread(self.writer.load_publish)  # rare: behind the worker's other calls is fine
            for i, reply in zip(unknown, await self._call(pipe, [commands[i] for i in unknown]), strict=True):
                replies[i] = reply
        return publish_results(replies)

    async def _call(self, pipe: PipelinedConnection, commands: list[bytes]) -> list[Any]:
        """`commands`' replies, once as durable as the client's mode asks (`pipeline.durability`): the mode's wait goes
        after them on the same connection, and a short count waits again while that connection lives (up to the
        mode's patience); a new connection, or patience run out, sends them all again (a publish already made writes
        nothing the second time), with the client's retry policy."""
        durability = self.writer.durability
        if not durability.waits:
            return await pipe.call(commands)
        wait = cast(bytes, hiredis.pack_command(durability.wait_args()))

        async def durable() -> list[Any]:
            deadline = time.monotonic() + durability.patience_s
            replies = await pipe.call([*commands, wait])
            made, reply = pipe.connections, replies.pop()
            named_primary = getattr(pipe.connection, "named_primary", None)  # behind Sentinel
            while True:
                try:
                    durability.check(reply)
                    if named_primary is not None and not await named_primary():
                        raise NotDurableError(STALE)
                    return replies
                except NotDurableError:
                    if isinstance(reply, Exception) or time.monotonic() >= deadline:
                        raise
                    if named_primary is not None and not await named_primary():  # no use waiting on a stale primary
                        raise
                (reply,) = await pipe.call([wait])
                if pipe.connections != made:  # the wait went on a new connection: it says nothing of the writes
                    raise NotDurableError("the connection was lost while waiting for the acknowledgements")

        async def again(_error: Exception) -> None:
            await pipe.close()  # the next try connects anew: to the primary the Sentinels name now, behind them

        replies: list[Any] = await async_retry(self.writer.redis).call_with_retry(durable, again)
        return replies

    def _pipeline(self, loop: asyncio.AbstractEventLoop) -> PipelinedConnection:
        """The connection of this event loop (a publisher used from a second `asyncio.run` gets a new one)."""
        if self._pipe is None or self._pipe[0] is not loop:
            assert self._twin is not None
            client = self.writer.redis
            self._pipe = (loop, PipelinedConnection(self._twin, async_retry(client), socket_timeout_s(client)))
        return self._pipe[1]

    async def close(self) -> None:
        """Close the publisher's connection. Call it once nothing waits: a batch still on the wire would fail."""
        if self._pipe is not None:
            await self._pipe[1].close()
            self._pipe = None
