"""Score in the stage's own process, on a few threads: the default, for cheap reward functions.

A thread cannot be stopped: a call that outlives `timeout_s` gives its group a reward error at
once, but goes on holding one of the threads. Reward code that may hang belongs on RQ, whose
workers kill a job at its timeout.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from consumers.scoring.backend import Outcome
from consumers.scoring.job import RolloutView, score_group


class InlineBackend:
    def __init__(self, timeout_s: float, threads: int) -> None:
        self.mode = "inline"
        self.timeout_s = timeout_s
        self._pool = ThreadPoolExecutor(max_workers=max(1, threads), thread_name_prefix="reward")
        self._running: dict[str, tuple[Future[dict[str, Any]], float]] = {}
        self._timed_out = 0

    def submit(self, key: str, reward_fn: str, rollouts: list[RolloutView]) -> None:
        self._running[key] = (self._pool.submit(score_group, reward_fn, rollouts), time.monotonic())

    def poll(self) -> list[Outcome]:
        now = time.monotonic()
        done = []
        for key, (future, started) in list(self._running.items()):
            if future.done():
                result = future.result()
                done.append(Outcome(key, rewards=result.get("rewards"), error=result.get("error")))
            elif now - started > self.timeout_s:
                self._timed_out += 1
                done.append(Outcome(key, error=f"timed out after {self.timeout_s:g} s (inline scoring)"))
            else:
                continue
            del self._running[key]
        return done

    def stats(self) -> dict[str, Any]:
        return {"running": len(self._running), "retries": 0, "timed_out": self._timed_out}

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
