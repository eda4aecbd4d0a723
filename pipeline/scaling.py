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

`ScalePolicy` turns the need over time into a fleet size for a launcher that scales itself (`rollouts launch --ray
--autoscale MIN:MAX`): up at once, down after a cool-down.
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


@dataclass(frozen=True)
class Decision:
    target: int
    """Workers to run now."""
    why: str
    """One line: what moved the target, or what holds it."""


class ScalePolicy:
    """The fleet's size from its need over time, within `minimum..maximum`: up at once, down only after the need
    has stayed lower for `cooldown_s` (then to the most it needed during that time), never below `minimum`.

    Pure (need and clock in, target out), so that any launcher can drive it: `rollouts launch --ray --autoscale`.
    """

    def __init__(self, minimum: int, maximum: int, cooldown_s: float = 30.0) -> None:
        if not 0 <= minimum <= maximum or maximum < 1:
            raise ValueError(f"need 0 <= minimum <= maximum and maximum >= 1, not {minimum}..{maximum}")
        self.minimum, self.maximum, self.cooldown_s = minimum, maximum, cooldown_s
        self._low_since: float | None = None
        self._low_peak = 0

    def decide(self, needed: int | None, current: int, now: float) -> Decision:
        """The target for `current` workers when the queue needs `needed` (None: not known, keep the size)."""
        if needed is None:
            self._low_since = None
            return Decision(self._clamp(current), "need unknown (Redis < 7): size kept")
        wanted = self._clamp(needed)
        bounds = f" (within {self.minimum}..{self.maximum})"
        if wanted >= current:
            self._low_since = None
            if wanted == current:
                return Decision(current, "steady")
            return Decision(wanted, f"need {needed} above {current} workers{bounds}")
        if self._low_since is None:
            self._low_since, self._low_peak = now, wanted
        self._low_peak = max(self._low_peak, wanted)
        waited = now - self._low_since
        if waited < self.cooldown_s:
            return Decision(current, f"need {needed} below {current} workers for {waited:.0f} of {self.cooldown_s:g} s")
        self._low_since = None
        return Decision(self._low_peak, f"need stayed below {current} workers for {self.cooldown_s:g} s{bounds}")

    def _clamp(self, workers: int) -> int:
        return min(self.maximum, max(self.minimum, workers))
