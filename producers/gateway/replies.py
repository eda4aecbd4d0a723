"""A gateway replica's reply stream: the rollouts of the prompts it queued, handed to the calls waiting on them.

Workers publish the rollouts of a prompt with `reply_to=NAME` to `{ns}:replies:NAME` (in the same atomic
step that acks the prompt, like any rollout). One reader per replica follows that stream, resolves the
call waiting on each prompt once all its `n` samples are in, and deletes what it read. A reply nobody
waits for any more (its call timed out) is deleted too. The stream expires an hour after the replica last
read it, so a replica that was killed leaves nothing behind for long (one that stops deletes it at once).
"""

from __future__ import annotations

import asyncio
import logging
import time

from pipeline.streams import ReplyReader
from pipeline.wire import Rollout, WireError

log = logging.getLogger(__name__)


class _Waiting:
    def __init__(self, n: int, future: asyncio.Future[list[Rollout]]) -> None:
        self.n = n
        self.future = future
        self.samples: dict[int, Rollout] = {}


class Replies:
    def __init__(self, replies: ReplyReader, gateway: str, block_ms: int = 1000, ttl_s: int = 3600) -> None:
        self.reader = replies
        self.gateway = gateway
        self.block_ms = block_ms
        self.ttl_s = ttl_s
        self._waiting: dict[str, _Waiting] = {}
        self._task: asyncio.Task[None] | None = None

    def expect(self, prompt_id: str, n: int) -> asyncio.Future[list[Rollout]]:
        """A future of the prompt's `n` rollouts in sample order; call before queueing the prompt."""
        future: asyncio.Future[list[Rollout]] = asyncio.get_running_loop().create_future()
        self._waiting[prompt_id] = _Waiting(n, future)
        return future

    def forget(self, prompt_id: str) -> None:
        self._waiting.pop(prompt_id, None)

    def start(self) -> None:
        self._task = asyncio.create_task(self._follow())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await asyncio.to_thread(self.reader.redis.delete, self.reader.keys.replies(self.gateway))

    async def _follow(self) -> None:
        after = b"0"  # the stream is this replica's own: whatever is on it is for us
        key, renewed = self.reader.keys.replies(self.gateway), 0.0
        while True:
            try:
                due = time.monotonic() - renewed > self.ttl_s / 10
                if due and await asyncio.to_thread(self.reader.redis.expire, key, self.ttl_s):
                    renewed = time.monotonic()  # (the stream exists once a worker replied)
                entries = await asyncio.to_thread(self.reader.read_replies, self.gateway, after, self.block_ms)
            except Exception:
                log.exception("reading replies failed; retrying")
                await asyncio.sleep(1.0)
                continue
            for entry in entries:
                after = entry.id
                self._file(entry.fields)
            if entries:
                await asyncio.to_thread(self.reader.delete_replies, self.gateway, [e.id for e in entries])

    def _file(self, fields: dict[bytes, bytes]) -> None:
        try:
            rollout = Rollout.from_fields(fields)
        except WireError as exc:
            log.warning("dropping a reply that breaks the contract: %s", exc)
            return
        waiting = self._waiting.get(rollout.prompt_id)
        if waiting is None or waiting.future.done():
            return  # its call gave up (timed out) or has it already (a redelivered duplicate)
        waiting.samples[rollout.sample] = rollout
        if len(waiting.samples) == waiting.n:
            waiting.future.set_result([waiting.samples[k] for k in sorted(waiting.samples)])
