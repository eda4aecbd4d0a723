"""Workers that share one vLLM server agree on its pause: it runs only while none of them holds it paused.

A vLLM server has one pause for everyone. The sync protocol pauses each worker before any loads and resumes none
before every one acked, so the workers of one sync agree; but a worker that is slow to read its control stream may
resume the server for sync N after another worker paused it for sync N+1 and started loading, and tokens would be
generated under half-loaded weights with the old label. So each worker's pause is recorded in a set of holders
(`{ns}:server:ID:pausers`, ID from the server's URL), and a resume reaches the server only when the set is empty.
Pause and resume calls are made under a short Redis lock (`...:lock`), so a resume cannot slip between another
worker's record and its pause. A holder whose worker's heartbeat is gone (the worker died paused) no longer counts.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Awaitable, Callable
from typing import cast

import redis

from pipeline.wire import Keys

LOCK_TIMEOUT_S = 30.0
"""A lock left by a worker that died holding it expires after this long."""

LOCK_WAIT_S = 60.0


class SharedPause:
    """One worker's view of a server's pause holders: `pause(call)` and `resume(call)` wrap the HTTP calls."""

    def __init__(self, client: redis.Redis, ns: str, url: str, holder: str) -> None:
        keys = Keys(ns)
        server = hashlib.sha1(url.rstrip("/").encode()).hexdigest()[:12]
        self.pausers = f"{keys.server_prefix}{server}:pausers"
        # not thread-local: acquired and released on different threads of `asyncio.to_thread`
        self._lock = client.lock(f"{keys.server_prefix}{server}:lock", timeout=LOCK_TIMEOUT_S, thread_local=False)
        self._redis = client
        self._keys = keys
        self.holder = holder

    async def pause(self, call: Callable[[], Awaitable[object]]) -> None:
        """Record this worker as a holder, then pause the server (`call`)."""
        await self._locked(self._pause, call)

    async def resume(self, call: Callable[[], Awaitable[object]]) -> bool:
        """Drop this worker's hold; resume the server (`call`) only if no live worker holds it. True if it did."""
        return await self._locked(self._resume, call)

    async def _pause(self, call: Callable[[], Awaitable[object]]) -> bool:
        await asyncio.to_thread(self._redis.sadd, self.pausers, self.holder)
        await call()
        return True

    async def _resume(self, call: Callable[[], Awaitable[object]]) -> bool:
        await asyncio.to_thread(self._redis.srem, self.pausers, self.holder)
        if await asyncio.to_thread(self._live_holders):
            return False
        await call()
        return True

    def _live_holders(self) -> list[str]:
        """Holders whose worker still heartbeats; the others are dropped from the set."""
        holders = [h.decode() for h in cast("set[bytes]", self._redis.smembers(self.pausers))]  # no decode_responses
        dead = [h for h in holders if not self._redis.exists(self._keys.worker(h))]
        if dead:
            self._redis.srem(self.pausers, *dead)
        return [h for h in holders if h not in dead]

    async def _locked(
        self, step: Callable[[Callable[[], Awaitable[object]]], Awaitable[bool]], call: Callable[[], Awaitable[object]]
    ) -> bool:
        if not await asyncio.to_thread(self._lock.acquire, blocking_timeout=LOCK_WAIT_S):
            raise TimeoutError(f"no hold of {self.pausers} within {LOCK_WAIT_S:.0f} s (another worker holds its lock)")
        try:
            return await step(call)
        finally:
            await asyncio.to_thread(self._lock.release)
