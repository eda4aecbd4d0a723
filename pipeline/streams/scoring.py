"""The scoring stage's side: the group `scorers` on `{ns}:scoring`, its lease, and forwarding scored rollouts."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pipeline.streams.base import Entry, StreamBase
from pipeline.streams.writer import append_fields
from pipeline.wire import SCORER, SCORERS, Rollout


class ScoringStreams(StreamBase):
    """What a scorer reads and writes (and what `top` asks of it: whether one is alive)."""

    def ensure_scoring_group(self) -> None:
        """The scoring stage's consumer group on `{ns}:scoring`, from the stream's start (so nothing
        workers published before the first scorer started is missed)."""
        self.ensure_group(self.keys.scoring, SCORERS)

    def scorer_alive(self) -> bool:
        """Whether a scoring stage reads `{ns}:scoring` now: its leader holds `{ns}:scorer:lease`, renewed every step
        and gone `--lease-s` after the leader stops (the scorer's heartbeat)."""
        return bool(self.redis.exists(self.keys.scorer_lease))

    def read_scoring(self, count: int, block_ms: int | None, pending_after: bytes | None = None) -> list[Entry]:
        """Rollouts awaiting a reward; with `pending_after` (`b"0"` for the first page), those the scorer
        (any holder of the lease) took and never forwarded. Deleted pending entries are acked."""
        return self.read_group(self.keys.scoring, SCORERS, SCORER, count, block_ms, pending_after)

    def forward_scored(self, rollouts: Sequence[Rollout], read: Sequence[bytes]) -> int:
        """Ack the `{ns}:scoring` entries `read` and add the scored `rollouts` to `{ns}:rollouts`, atomically.

        Returns the rollouts added, or -1 when none of `read` was pending any more (nothing written).
        """
        args: list[Any] = [SCORERS, len(read), *read]
        for rollout in rollouts:
            append_fields(args, rollout.to_fields())
        return int(self.scripts["forward"](keys=[self.keys.rollouts, self.keys.scoring], args=args))
