"""Score in the stage's own process, on a few threads: the default, for cheap reward functions.

A thread cannot be stopped: a call that outlives `timeout_s` gives its group a reward error at
once, but goes on holding one of the threads. Reward code that may hang belongs on RQ, whose
workers kill a job at its timeout.

A reward function's first call in this process runs alone (and first calls of different functions one after
another): it imports the reward module and whatever that imports lazily, inside the call (`from transformers
import AutoTokenizer` in a function, a tokenizer behind `functools.cache`). A package imported for the first time
on several threads at once can fail: transformers' lazy module has its submodules imported by each thread, Python's
import machinery breaks the resulting cross-thread wait on module locks by handing one thread a module still
half initialized, and the call fails with `ImportError: cannot import name 'AutoTokenizer' from 'transformers'`
(seen at the default `--threads 4`). Once a function has been called, its calls run in parallel.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from consumers.scoring.backend import Outcome
from consumers.scoring.job import RolloutView, score_group

_first_calls = threading.Lock()
"""Held by a reward function's first call in this process (imports are the process's, not a backend's)."""
_called: set[str] = set()
"""Reward functions (import paths) called once in this process: their imports are done."""


def score_first_call_alone(reward_fn: str, rollouts: list[RolloutView], wait_s: float) -> dict[str, Any]:
    """`score_group`, the first call of each `reward_fn` under `_first_calls` (see the module's doc). A first call
    that takes longer than `wait_s` (the scoring timeout: its group has failed by then) stops holding the others."""
    if reward_fn not in _called:
        alone = _first_calls.acquire(timeout=wait_s)
        try:
            if reward_fn not in _called:  # still not called once: this call is the first
                result = score_group(reward_fn, rollouts)
                _called.add(reward_fn)
                return result
        finally:
            if alone:
                _first_calls.release()
    return score_group(reward_fn, rollouts)


class InlineBackend:
    def __init__(self, timeout_s: float, threads: int) -> None:
        self.mode = "inline"
        self.timeout_s = timeout_s
        self._pool = ThreadPoolExecutor(max_workers=max(1, threads), thread_name_prefix="reward")
        self._running: dict[str, tuple[Future[dict[str, Any]], float]] = {}
        self._timed_out = 0

    def submit(self, key: str, reward_fn: str, rollouts: list[RolloutView]) -> None:
        future = self._pool.submit(score_first_call_alone, reward_fn, rollouts, self.timeout_s)
        self._running[key] = (future, time.monotonic())

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
