"""A worker's settings, each default and each bound derived from another defined once (rq's `defaults.py`): the
`rollouts worker` and `rollouts launch` options take their defaults from here, and `WorkerSettings.for_process`
derives what a worker process of its own needs from its flags."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal, get_args

NOTICE_POLL_S = 0.5
"""How often a worker looks for its `notice_file`."""
ABORT_RETRY_S = 0.2
"""How often a drain that ends what still runs asks the engine again (a sample between two requests is missed once)."""
JoinFrom = Literal["auto", "peer", "store", "sync"]
"""Where a worker that starts mid-run takes the current version (`WorkerSettings.join_from`)."""
JOIN_FROM: tuple[str, ...] = get_args(JoinFrom)
PEER_ANSWER_S = 10.0
"""How long a joining worker waits for a peer's answer past the peer's `share_window_s`, and then for each step of its
push, before it tries the next fallback."""
HEARTBEAT_TTL_PERIODS = 5
"""A heartbeat lives at least this many heartbeat periods (`WorkerSettings.for_process`)."""
DEAD_AFTER_PERIODS = 2.5
"""A worker silent for this many heartbeat periods (and `WorkerSettings.dead_after_s` at least) is dead to the
others: its work is taken over."""


@dataclass
class WorkerSettings:
    max_inflight: int | None = None
    """Samples in flight on the engine at once. None: as many as the engine decodes at once (`Engine.max_batch`: the
    torch and synthetic engines' rows, vLLM's `max_num_seqs`), or 256 where it does not say. Taking more only queues
    them inside the engine: they finish no sooner, and an abort pause ends and queues them all again. An entry of more
    samples than this runs alone."""
    max_inflight_tokens: int | None = None
    """Tokens in flight at once, each sample counted as its prompt + `max_tokens` (the most it can hold), so that long
    samples do not oversubscribe the engine. None: the engine's (`Engine.max_batch_tokens`: vLLM's KV cache in tokens,
    once started; no limit on the other engines); 0: no limit. An entry larger than this runs alone."""
    block_ms: int = 1000
    """How long one read waits for new work."""
    heartbeat_s: float = 1.0
    """Heartbeat period; in-flight entries are touched at the same pace."""
    heartbeat_ttl_s: float = 5.0
    """A worker whose heartbeat is older than this is shown as gone."""
    claim_idle_ms: int = 10_000
    """Work untouched for this long is claimed, whoever holds it (a worker that lives but stopped touching it)."""
    dead_after_s: float = 2.5
    """A worker whose heartbeat has been silent this long is dead to the fleet: its work is taken over (each heartbeat
    moves its deadline on `{ns}:beats`, so that each worker is judged by its own). More than two heartbeat periods."""
    apart_after: int = 3
    """An entry handed out this many times without finishing (it died with its worker twice) runs apart: beside fresh
    work, but never beside another such entry. A claim takes a dead worker's oldest entries first, so without this the
    entries a poison prompt's death took along would be handed on with it, and die with it, again and again."""
    max_deliveries: int = 5
    """An entry handed out this many times without finishing runs alone: its worker first finishes what it runs, then
    starts it with nothing beside it and takes nothing else until it ends. Handed out again after `alone_tries` runs
    alone (each time the worker that ran only that entry died or hung), it is a dead letter: the entry kills what
    runs it. So an entry that merely sat with workers that died is not dead-lettered for their deaths."""
    alone_tries: int = 2
    """Runs alone that must each end with their worker's death before an entry is a dead letter: one such death may
    be another fault's (in a fleet under frequent faults, some runs alone are struck by chance), two in a row seldom
    are."""
    trim_every_s: float = 10.0
    drain_timeout_s: float = 30.0
    """On stop, how long in-flight work may run to its end. What still runs then is ended with its tokens so far and
    each unfinished sample goes to `{ns}:partials` with its entry's ack (`Worker.stop`), where any worker continues it:
    nothing finished is generated again."""
    grace_s: float | None = None
    """A stop's deadline, from the notice (SIGTERM, `rollouts drain`, the `notice_file`) to the process's exit, as a
    preemptible machine gives it (a spot VM's ~30 s, a pod's `terminationGracePeriodSeconds`): the drain ends
    `hand_off_s` before it (and before `drain_timeout_s`), so that the hand-off and the engine's shutdown fit inside
    it. None: no deadline (the drain runs `drain_timeout_s`)."""
    hand_off_s: float = 3.0
    """What a deadline keeps, after the drain, for ending what still runs, publishing it to `{ns}:partials` and shutting
    the engine down (at most half the deadline)."""
    notice_file: str | None = None
    """A file whose appearance is a stop notice, with `grace_s`'s deadline (a preemption notice that a node agent
    writes, e.g. from a cloud's metadata endpoint); looked for every `NOTICE_POLL_S`."""
    dedupe_ttl_s: int = 86_400
    """How long a published rollout id is remembered (a bit in `{ns}:published:{size}:{bucket}`): the same id from
    another entry (a prompt submitted twice, a replay) within it is not published again. Every worker of a namespace
    should use the same value."""
    join_from: JoinFrom = "auto"
    """Where a worker that starts mid-run takes the current version. `auto`: from a live worker that holds it and can
    send it (a peer: GPU to GPU over NCCL, host to host over gloo), else from where it is stored (`fs://`, `redis://`,
    `ipc://`), else it awaits the next sync (`awaiting weights`, as under `nccl://`, which stores nothing). `peer`: a
    peer, else the next sync; `store`: the store, else the next sync; `sync`: the next sync (`consumers.peer`)."""
    share_window_s: float = 0.5
    """As a peer: the requests of joiners that arrive this long after the first are served by the same push (an
    autoscaler that adds workers at once: their engines come up within about this much of each other)."""
    lazy: bool = False
    """Start the engine when the first work arrives, not at launch (`consumers.lifecycle`)."""
    release_after_s: float | None = None
    """Shut the engine down after this many seconds without work, and start it again on demand; None: never."""
    hand_off_partials: bool = False
    """What an `abort` pause does with the samples it interrupts. False: this worker continues each itself after the
    resume (its tokens so far stay in memory; the prompt stays pending here, so a worker that dies meanwhile loses
    only those tokens: the prompt is claimed and generated again). True: each goes to `{ns}:partials` with the
    entry's ack at the pause, durable, and any worker continues it. A worker that stops before its resume hands its
    interrupted samples off either way."""
    freeze_heap: bool = False
    """Freeze the process's heap (`gc.freeze`) each time the engine has started, so that Python's full collections
    skip what the engine holds (`consumers.lifecycle.freeze_heap`: a full collection over vLLM's objects stalls the
    event loop). Process-wide: for a process that is the worker's own, as `rollouts worker` and
    `rollouts launch` set it; a worker run inside another program leaves that program's collector alone."""

    @property
    def read_block_ms(self) -> int:
        """How long a worker's read waits for new work: `block_ms`, at most half a heartbeat, so that a waiting
        worker looks for a dead worker's work as often as a busy one (`WorkReader.claim_abandoned`)."""
        return max(1, min(self.block_ms, int(self.heartbeat_s * 500)))

    @property
    def take_horizon_ms(self) -> int:
        """How long a worker that said it has room (a take, a heartbeat) counts as one (`WorkReader.take`): two of its
        reads' waits and two heartbeat periods, so a worker waiting for work is counted even when a loaded machine
        holds its read and its heartbeat back a period, and a stopped one soon is not."""
        return 2 * self.read_block_ms + int(2 * self.heartbeat_s * 1000)

    @classmethod
    def for_process(cls, **flags: Any) -> WorkerSettings:
        """The settings of a worker process of its own (`rollouts worker`, a `rollouts launch` actor) from its flags
        (`WorkerSettings` fields by name): a heartbeat lives at least `HEARTBEAT_TTL_PERIODS` periods, a worker
        silent for `DEAD_AFTER_PERIODS` is dead to the others, a blocking read waits at most one period (a worker asked
        to beat every 0.3 s stops within 0.3 s, not the default read's 1 s), and the process's heap is frozen after
        each engine start (`freeze_heap`). `TypeError` for a flag that is no field."""
        settings = cls(**flags)
        if settings.share_window_s < 0:
            raise ValueError(f"share_window_s must be >= 0, got {settings.share_window_s}")
        if settings.join_from not in JOIN_FROM:
            raise ValueError(f"join_from must be one of {', '.join(JOIN_FROM)}, got {settings.join_from!r}")
        beat = settings.heartbeat_s
        return dataclasses.replace(
            settings,
            block_ms=max(1, min(settings.block_ms, round(beat * 1000))),
            heartbeat_ttl_s=max(settings.heartbeat_ttl_s, HEARTBEAT_TTL_PERIODS * beat),
            dead_after_s=max(settings.dead_after_s, DEAD_AFTER_PERIODS * beat),
            freeze_heap=True,
        )


DEFAULTS = WorkerSettings()
"""Every default in one place: what the CLI's worker options show and fall back to."""
