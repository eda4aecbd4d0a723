"""The trainer's reader: rollouts from the group `trainer` on `{ns}:rollouts`, and their acks."""

from __future__ import annotations

from collections.abc import Sequence

from pipeline.streams.base import Entry, StreamBase
from pipeline.wire import TRAINER


class RolloutReader(StreamBase):
    """A trainer's consumer of `{ns}:rollouts`."""

    def read_rollouts(
        self, consumer: str, count: int, block_ms: int | None, pending: bool = False, after: bytes = b"0"
    ) -> list[Entry]:
        """New rollouts for `consumer`; with `pending`, those it was handed before but never acked, after
        the id `after` (page through them by passing the last id read: they stay pending until acked).
        Pending entries deleted meanwhile are acked (`StreamBase.read_group`)."""
        return self.read_group(self.keys.rollouts, TRAINER, consumer, count, block_ms, after if pending else None)

    def ack_rollouts(self, ids: Sequence[bytes]) -> None:
        if ids:
            self.redis.xack(self.keys.rollouts, TRAINER, *ids)
