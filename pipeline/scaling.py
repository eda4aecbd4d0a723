"""How many workers the queue needs now: what an autoscaler sizes the fleet by (`rollouts_workers_needed`).

From one `top` snapshot (`pipeline.top.snapshot`), so that any number of exporters agree and none holds state:

- **waiting**: entries no worker has taken, the `generators` group's lag on `{ns}:prompts` and `{ns}:partials`
  (Redis >= 7 reports it; on 6.2 the need is not known and no sample is given, as for the lag itself);
- **held**: entries the workers hold (running, or taken and waiting for room), from their heartbeats' `held`;
- **per worker**: the entries one worker holds at most, its heartbeat's `held + room` (room: what it could take now;
  `--max-inflight` and `--max-inflight-tokens` set it), averaged over the live workers.

`needed = ceil((waiting + held) / per_worker)`: the workers that would hold all the work there is now, each as much as
it takes. With no live worker there is nothing to measure a worker by: 1 while work waits, else 0. An autoscaler
clamps it to its own minimum and maximum (KEDA's `minReplicaCount`/`maxReplicaCount`). Work a trainer has yet to submit
does not count: admission lets it in as the policy moves on, and it shows up as waiting entries then.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from pipeline.wire import GENERATORS

SOURCES = ("prompts", "partials")
"""The streams whose entries wait for a worker (a worker's inbox is its own: it counts in what the worker holds)."""


@dataclass(frozen=True)
class Need:
    waiting: int
    """Entries no worker has taken."""
    held: int
    """Entries the live workers hold."""
    per_worker: float | None
    """The entries a live worker holds at most (`held + room`), averaged; None with no live worker."""
    workers: int
    """Live workers."""

    @property
    def needed(self) -> int:
        """Workers that would hold all the work there is now."""
        work = self.waiting + self.held
        if not work:
            return 0
        if not self.per_worker:
            return max(1, self.workers)
        return math.ceil(work / self.per_worker)


def need(snap: dict[str, Any]) -> Need | None:
    """The fleet's need from a `top` snapshot; None where a stream's lag is unknown (Redis 6.2)."""
    waiting = 0
    for name in SOURCES:
        group = snap["streams"].get(name, {}).get("groups", {}).get(GENERATORS)
        if group is None:
            continue  # no such stream yet: nothing waits on it
        if group["lag"] is None:
            return None
        waiting += int(group["lag"])
    beats = list(snap["workers"].values())
    held = sum(_int(beat.get("held")) for beat in beats)
    sizes = [_int(beat.get("held")) + _int(beat.get("room")) for beat in beats]
    per_worker = sum(sizes) / len(sizes) if sizes and sum(sizes) else None
    return Need(waiting=waiting, held=held, per_worker=per_worker, workers=len(beats))


def _int(value: Any) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        return 0
