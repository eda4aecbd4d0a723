"""The narrow interface between the scoring stage and where reward functions run, and its factory.

A backend takes groups (`submit`) and hands back what became of them (`poll`): rewards, or an
error that becomes `reward_error`. It owns timeouts and retries, so the stage never waits on a
group for ever: every submitted group comes back exactly once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Protocol

import redis

from consumers.scoring.job import RolloutView

Mode = Literal["inline", "rq"]


@dataclass
class Outcome:
    key: str
    """What `submit` was given (the group's prompt id)."""
    rewards: list[float | None] | None = None
    error: str | None = None


class ScoringBackend(Protocol):
    mode: str
    """`inline` or `rq:QUEUE`, for the scorer's status."""

    def submit(self, key: str, reward_fn: str, rollouts: list[RolloutView]) -> None: ...

    def poll(self) -> list[Outcome]:
        """Groups finished (scored, failed for good, or timed out) since the last poll."""
        ...

    def stats(self) -> dict[str, Any]:
        """Numbers for the scorer's status hash: `running`, `retries`, and what else the backend knows."""
        ...

    def close(self) -> None: ...


def make_backend(
    mode: Mode,
    *,
    connection: redis.Redis,
    queue: str = "rewards",
    timeout_s: float = 60.0,
    attempts: int = 3,
    threads: int = 4,
) -> ScoringBackend:
    """`inline`: threads of this process. `rq`: jobs on `queue` in the Redis of `connection` (JSON, no pickle)."""
    if timeout_s <= 0:
        raise ValueError(f"the scoring timeout must be > 0 s, got {timeout_s}")
    if mode == "inline":
        from consumers.scoring.inline import InlineBackend

        return InlineBackend(timeout_s=timeout_s, threads=threads)
    if mode == "rq":
        if attempts < 1:
            raise ValueError(f"attempts must be >= 1, got {attempts}")
        from consumers.scoring.rq_backend import RQBackend

        return RQBackend(connection, queue, timeout_s=timeout_s, attempts=attempts)
    raise ValueError(f"unknown scoring mode {mode!r}: inline or rq")
