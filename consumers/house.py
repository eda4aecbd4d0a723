"""What every room of a worker shares (`House`), and the worker as its rooms see it (`Stoppable`).

`Worker` (`consumers.worker`) builds one `House` and hands it to each room (`TakeBudget` aside, which owns no Redis
and no engine): its name, settings, streams, engine slot, serving state and metrics, and the worker itself, which a
room only ever stops. A room takes the house and the few parts of its own (prime-rl's orchestrator hands its parts
over the same way), never the worker whole.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from consumers.lifecycle import EngineSlot
    from consumers.metrics import WorkerMetrics
    from consumers.serving import ServingState
    from consumers.settings import WorkerSettings
    from pipeline.streams import Streams


class Stoppable(Protocol):
    """The worker, as its rooms see it: something to stop, saying why."""

    failure: str | None
    """Why the worker stopped on its own; None after a requested stop."""

    def stop(self, drain: bool = True, grace_s: float | None = None) -> None: ...


@dataclass(frozen=True)
class House:
    """One worker's shared parts, handed to each of its rooms."""

    name: str
    settings: WorkerSettings
    streams: Streams
    slot: EngineSlot
    state: ServingState
    metrics: WorkerMetrics
    worker: Stoppable
