"""A gateway's reader of its reply stream, `{ns}:replies:{name}`: the rollouts of the prompts it queued."""

from __future__ import annotations

from collections.abc import Sequence

from pipeline.streams.base import Entry, StreamBase


class ReplyReader(StreamBase):
    """One gateway's replies, read without a group (one reader, which deletes what it has answered with)."""

    def read_replies(self, gateway: str, after: bytes, block_ms: int | None) -> list[Entry]:
        """Rollouts on `gateway`'s reply stream after `after`."""
        return [e for e in self.read({self.keys.replies(gateway): after}, 512, block_ms) if e.fields]

    def delete_replies(self, gateway: str, ids: Sequence[bytes]) -> None:
        if ids:
            self.redis.xdel(self.keys.replies(gateway), *ids)
