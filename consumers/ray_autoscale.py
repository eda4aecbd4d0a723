"""Ray workers that follow the queue: `rollouts launch --ray ADDRESS --autoscale MIN:MAX`.

Every few seconds the launcher reads what the queue needs (`pipeline.scaling.need`, the exporter's
`rollouts_workers_needed`), asks its `ScalePolicy` for a target within MIN..MAX, and then:

- tells Ray's autoscaler the shapes the target needs (`ray.autoscaler.sdk.request_resources`, one bundle a worker:
  its CPUs and all its GPUs together, since a worker's placement group is packed on one node), so that a cluster with
  an autoscaler adds the nodes; the request stands until the next one, and is withdrawn when the launcher ends;
- asks for the placement groups of the workers it lacks and starts each worker's actor once its group is placed
  (as the cluster has room: at once, or when the autoscaler's node comes up);
- after the need has stayed lower for the cool-down, drains the surplus (the highest indexes; groups not placed yet
  go first): a drained worker finishes what it holds, takes nothing more, and ends with its group.

Each change is one line through `say`: the need, the target and why.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable
from typing import Any

from ray.autoscaler.sdk import request_resources
from ray.util.placement_group import PlacementGroup, placement_group_table, remove_placement_group

from consumers.ray_launcher import (
    ACTOR_PREFIX,
    FAILED,
    READY_STATUSES,
    LaunchError,
    LaunchSpec,
    actor_info,
    actor_name,
    actor_names,
    place,
    start_actor,
    stop,
)
from pipeline.codec import as_text
from pipeline.scaling import Decision, ScalePolicy, need
from pipeline.streams import Streams
from pipeline.top import snapshot


def worker_shape(spec: LaunchSpec) -> dict[str, float]:
    """The resources one worker takes on one node: what the autoscaler is asked for, a worker a bundle."""
    return {"CPU": float(spec.cpus)} | ({"GPU": float(spec.gpus)} if spec.gpus else {})


class RayAutoscaler:
    """The launcher's loop, one `tick` at a time (the pipeline's Ray namespace must be connected)."""

    def __init__(
        self,
        spec: LaunchSpec,
        streams: Streams,
        policy: ScalePolicy,
        say: Callable[[str], None],
        drain_timeout_s: float = 60.0,
    ) -> None:
        self.spec, self.streams, self.policy, self.say = spec, streams, policy, say
        self.drain_timeout_s = drain_timeout_s
        self.placing: dict[str, PlacementGroup] = {}
        """Groups asked for and not placed yet, by actor name."""
        self.requested: int | None = None
        """Workers whose shapes Ray's autoscaler was last asked for."""
        self.started: dict[str, Any] = {}
        """Actors this loop started that have not served yet, by name (only a handle tells why one died on start)."""
        self._last = ("", -1)

    def tick(self, now: float) -> Decision:
        running = actor_names()
        self._check_started()
        current = len(running) + len(self.placing)
        fleet = need(snapshot(self.streams))
        decision = self.policy.decide(None if fleet is None else fleet.needed, current, now)
        if decision.target != self.requested:
            request_resources(bundles=[worker_shape(self.spec)] * decision.target)
            self.requested = decision.target
        if (decision.why.split(" for ")[0], decision.target) != self._last:  # a cool-down's count is not news
            needed = "unknown" if fleet is None else fleet.needed
            self.say(f"autoscale: need {needed}, target {decision.target} of {current} workers: {decision.why}")
            self._last = (decision.why.split(" for ")[0], decision.target)
        if decision.target > current:
            self._grow(decision.target - current, running)
        elif decision.target < current:
            self._shrink(current - decision.target, running)
        self._start_placed()
        return decision

    def _grow(self, count: int, running: list[str]) -> None:
        taken = set(running) | set(self.placing)
        free = (index for index in range(len(taken) + count) if actor_name(index) not in taken)
        for index in [next(free) for _ in range(count)]:
            self.placing[actor_name(index)] = place(self.spec, actor_name(index))

    def _shrink(self, count: int, running: list[str]) -> None:
        for name in sorted(self.placing, key=_index, reverse=True)[:count]:
            remove_placement_group(self.placing.pop(name))
            count -= 1
        surplus = sorted(running, key=_index, reverse=True)[:count]
        if surplus:
            stopped = stop(surplus, self.drain_timeout_s)
            for name in surplus:
                self.started.pop(name, None)
            workers = ", ".join(self.spec.worker_name(_index(name)) for name in stopped)
            self.say(f"autoscale: drained {workers or 'none'}")

    def _start_placed(self) -> None:
        for name, group in list(self.placing.items()):
            if placement_group_table(group).get("state") == "CREATED":
                self.started[name] = start_actor(self.spec, _index(name), group)
                del self.placing[name]
                self.say(f"autoscale: started {name} ({self.spec.worker_name(_index(name))})")

    def _check_started(self) -> None:
        """A worker this loop started that fails before it ever serves (its heartbeat says `failed`, or its actor died
        in `__init__`) has a setting no restart fixes: stop here rather than start it again and again."""
        for name in list(self.started):
            worker = self.spec.worker_name(_index(name))
            reply = self.streams.redis.hmget(self.streams.keys.worker(worker), ["status", "failure"])
            status, failure = (None if value is None else as_text(value) for value in reply)
            if status in READY_STATUSES:
                del self.started[name]  # serving once: Ray restarts it from now on
            elif status == FAILED:
                stop([name])
                raise LaunchError(f"{worker} could not start: {failure}")
        infos = actor_info(self.started, timeout_s=0.5) if self.started else {}
        for name, info in infos.items():
            if info["actor"] in ("dead", "gone"):
                stop([name])  # its placement group
                raise LaunchError(f"{self.spec.worker_name(_index(name))} could not start: {info.get('failure')}")

    def close(self) -> None:
        """Withdraw the request from Ray's autoscaler and the groups not placed yet; the workers keep running."""
        for group in self.placing.values():
            remove_placement_group(group)
        self.placing.clear()
        request_resources(bundles=[])


def run(scaler: RayAutoscaler, interval_s: float = 2.0) -> None:
    """Tick until Ctrl-C (or SIGTERM). The signal only sets a flag that the loop reads between ticks: raised inside a
    tick, a `KeyboardInterrupt` could land in Ray's client, which may swallow it, and the loop would never end."""
    stopping = threading.Event()
    handled = (signal.SIGINT, signal.SIGTERM)
    in_main = threading.current_thread() is threading.main_thread()
    previous = {sig: signal.signal(sig, lambda *_: stopping.set()) for sig in handled} if in_main else {}
    try:
        while not stopping.is_set():
            scaler.tick(time.monotonic())
            stopping.wait(interval_s)
    except KeyboardInterrupt:  # off the main thread, where no handler could be set
        pass
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        scaler.close()


def _index(name: str) -> int:
    return int(name.removeprefix(ACTOR_PREFIX))
