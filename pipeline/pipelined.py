"""Batches of commands pipelined on one asyncio connection: each batch is written as soon as it is given, while the
replies of the batches before it are still on their way, and every batch gets its own replies back, in order.

Why: a worker publishes from its event loop. Handed to threads (a thread a batch, on the sync client), each batch
would cost the loop a hand-off and the GIL a tug of war with the threads, and a thread could only send its next
batch once its last one was answered. Here the loop packs a batch and writes it, and goes on;
Redis is never without a batch to run while the worker makes the next one, over a single connection.

Commands go out in writes of up to `WRITE_BYTES` (`writes`): small ones joined, large ones by themselves. Handed
the batch as a list, Python 3.11's socket transport joins it into one bytes object first, and such large short-lived
copies slow the rest of the process (a trainer client in the same process too). A write a command, though, is a
`send` a command, which costs more than the joining for short rollouts.

Order: writes go out one batch at a time (an `asyncio.Lock` serves them first come, first served), and each batch
reads its replies only once the batch written before it has read its own (`_turn`), so batch k reads the k-th
group of replies. A batch that fails with the connection (lost, timed out, cancelled mid-read) closes it, so that
the batches behind it, which share its socket, fail too rather than read replies that are not theirs; each is
then sent again on a new connection, with the client's retry policy (`connections.async_retry`): the same promise
as redis-py's pipeline retried after a lost connection, a command may run twice. A batch not written, or not
answered, within the client's socket timeout fails the same way (`TimeoutError`, which the retry policy retries).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import redis
from redis.asyncio.connection import AbstractConnection
from redis.asyncio.retry import Retry

WRITE_BYTES = 64 * 1024
"""Commands smaller than this are joined into writes of up to this size; larger ones are written alone."""


def writes(commands: list[bytes], limit: int = WRITE_BYTES) -> list[bytes]:
    """`commands` as the writes that send them, in order: runs of small ones joined, each large one alone."""
    runs: list[list[bytes]] = []
    size = 0
    for command in commands:
        if not runs or size + len(command) > limit:
            runs.append([])
            size = 0
        runs[-1].append(command)
        size += len(command)
    return [b"".join(run) for run in runs]  # a run of one is that command itself, not a copy


class PipelinedConnection:
    """`await pipe.call(packed)`: the replies of `packed` (commands packed by `hiredis.pack_command`), an error reply
    as its `ResponseError` in its place. Lives on one event loop."""

    def __init__(self, make: Callable[[], AbstractConnection], retry: Retry, timeout_s: float | None) -> None:
        self._make = make
        self._retry = retry
        self._timeout_s = timeout_s
        """How long a batch may take to be written, and then to be answered (the sync client's socket timeout)."""
        self._connection: AbstractConnection | None = None
        self.connections = 0
        """Connections made so far: a caller that sees it unchanged across two calls knows they shared one."""
        self._writing = asyncio.Lock()
        self._turn: asyncio.Future[None] | None = None
        """Done once the batch written last has read its replies (or given up on them)."""

    @property
    def connection(self) -> AbstractConnection | None:
        """The connection the next batch goes on, if one is open."""
        return self._connection

    async def call(self, commands: list[bytes]) -> list[Any]:
        return await self._retry.call_with_retry(lambda: self._exchange(commands), self._failed)

    async def close(self) -> None:
        if self._connection is not None:
            connection, self._connection = self._connection, None
            await connection.disconnect()

    async def _exchange(self, commands: list[bytes]) -> list[Any]:
        done = asyncio.get_running_loop().create_future()
        connection = None
        try:
            async with self._writing:
                if self._connection is None:
                    self._connection = self._make()  # connected by its first write
                    self.connections += 1
                connection = self._connection
                async with asyncio.timeout(self._timeout_s):
                    for write in writes(commands):  # not the list at once: Python 3.11's transport joins it all
                        await connection.send_packed_command(write, check_health=False)
                before, self._turn = self._turn, done
            if before is not None:
                await asyncio.wait([before])  # not `await before`: our cancellation must not cancel it
            async with asyncio.timeout(self._timeout_s):
                return await self._read(connection, len(commands))
        except BaseException:
            await self._drop(connection)
            raise
        finally:
            if not done.done():
                done.set_result(None)

    @staticmethod
    async def _read(connection: AbstractConnection, count: int) -> list[Any]:
        replies: list[Any] = []
        for _ in range(count):
            try:
                replies.append(await connection.read_response())
            except redis.ResponseError as exc:  # this command's error: the next replies are still read
                replies.append(exc)
        return replies

    async def _drop(self, connection: AbstractConnection | None) -> None:
        """Close `connection` (replies may be left unread on it): the batches behind on it fail, and the next batch
        gets a new one."""
        if connection is None:
            return
        if self._connection is connection:
            self._connection = None
        await connection.disconnect(nowait=True)

    async def _failed(self, error: Exception) -> None:
        """The retry's hook: the connection is dropped already (`_exchange`)."""
