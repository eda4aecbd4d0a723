"""An engine on an event loop in its own thread, for tests that drive it from plain synchronous code.

vLLM's output handler (and the engines' futures) run on that loop between the test's calls.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class Served:
    """One engine on its own loop thread; `run` waits for a coroutine with a deadline."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="engine-test-loop", daemon=True)
        self.thread.start()
        self.engine_pids: set[int] = set()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 120) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        self.loop.close()


async def wait_until_async(predicate: Callable[[], bool], timeout: float = 30.0) -> None:
    """Poll a condition with a deadline while the engine makes progress on this loop."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "condition not met before the deadline"
        await asyncio.sleep(0.002)  # the poll interval of this deadline wait, not a wait on its own
