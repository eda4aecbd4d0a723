"""Where a session's turns run: the worker whose KV cache holds its prefix.

- `sticky` (the default): the first turn goes to the least-loaded live worker (fewest live session pins,
  then fewest samples in flight by its heartbeat), and every later turn to the same worker while it lives
  (`lua/pin.lua`, atomic, so replicas agree). What prime-rl converged on (#3563).
- `hash`: `crc32(session) % workers` over the live workers, recomputed every turn: sticky while membership
  holds still, reshuffled when a worker joins or leaves (prime-rl #3255, SkyRL #1791). A baseline.
- `random`: any live worker each turn: what a session-less call gets. A baseline.
"""

from __future__ import annotations

import random
import zlib
from typing import Literal

from producers.gateway.sessions import SessionStore

Placement = Literal["sticky", "hash", "random"]
PLACEMENTS: tuple[Placement, ...] = ("sticky", "hash", "random")
SERVING = ("serving", "paused", "idle", "starting", "released")
"""Heartbeat statuses of a worker that takes (or, after a sync or its engine's start, will take) its inbox's work:
a `--lazy` worker without an engine (`idle`, `released`) starts it for the first turn sent to it."""


def candidates(workers: dict[str, dict[str, str]]) -> dict[str, int]:
    """Live workers that can take a session's turn, with their samples in flight."""
    found = {}
    for name, beat in workers.items():
        if beat.get("status") in SERVING:
            try:
                found[name] = int(beat.get("inflight") or 0)
            except ValueError:
                found[name] = 0
    return found


def place(policy: Placement, store: SessionStore, session_id: str, workers: dict[str, int]) -> str:
    """The worker for this turn of `session_id` among `workers` (non-empty), recorded as the session's pin."""
    if policy == "sticky":
        return store.pin(session_id, workers)
    names = sorted(workers)
    chosen = names[zlib.crc32(session_id.encode()) % len(names)] if policy == "hash" else random.choice(names)
    store.place(session_id, chosen)
    return chosen
