"""The stream layer, by role: what each side of the wire contract does with the streams of one namespace.

- `StreamBase` (`base`): the client, the keys, the Lua scripts, the consumer groups, plain and group reads, dead
  letters: what every role shares.
- `WorkReader` (`work`): a worker's reads (partials, its inbox, prompts), its leftovers, claims and touches, and the
  marks of entries started alone.
- `Writer` (`writer`): prompts onto the streams, and rollouts published with their source acked, deduped.
- `RolloutReader` (`training`): the trainer's reads and acks on `{ns}:rollouts`.
- `ReplyReader` (`replies`): a gateway's reads and deletes on its reply stream.
- `ScoringStreams` (`scoring`): the scoring stage's reads, its lease, and forwarding scored rollouts.
- `trim_consumed` (`trim`): dropping what every group has finished with.

`Streams` composes them over one client (one set of scripts) for the processes that play several roles, with the
worker registry (`streams.registry`, `pipeline.registry`) and the control stream with its doorbells
(`streams.control`, `pipeline.control`), mechanisms of their own; a process that plays one role makes that role
alone. It keeps, for a transition, the few calls that callers not yet moved make on it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import redis
from redis.commands.core import Script

from pipeline.control import ControlStream
from pipeline.registry import Registry
from pipeline.streams.base import BLOCK_MARGIN_MS, SCRIPTS, Entry, StreamBase, entries_from_reply
from pipeline.streams.replies import ReplyReader
from pipeline.streams.scoring import ScoringStreams
from pipeline.streams.training import RolloutReader
from pipeline.streams.trim import TRIM_CHUNK, trim_consumed
from pipeline.streams.work import ALONE_TTL_S, WorkReader
from pipeline.streams.writer import DEDUPE_BUCKETS, Publish, Writer, publish_results, script_unknown
from pipeline.wire import Prompt, Rollout

__all__ = [
    "ALONE_TTL_S",
    "BLOCK_MARGIN_MS",
    "DEDUPE_BUCKETS",
    "SCRIPTS",
    "TRIM_CHUNK",
    "Entry",
    "Publish",
    "ReplyReader",
    "RolloutReader",
    "ScoringStreams",
    "StreamBase",
    "Streams",
    "WorkReader",
    "Writer",
    "entries_from_reply",
    "publish_results",
    "script_unknown",
    "trim_consumed",
]


class Streams(StreamBase):
    """Every role over one client: `work`, `writer`, `trainer`, `replies`, `scoring`, plus `registry` and `control`."""

    def __init__(
        self, client: redis.Redis, ns: str, dedupe_ttl_s: int = 86_400, scripts: Mapping[str, Script] | None = None
    ) -> None:
        super().__init__(client, ns, scripts)
        scripts = self.scripts
        self.work = WorkReader(client, ns, scripts)
        """A worker's reads, claims and marks."""
        self.writer = Writer(client, ns, scripts, dedupe_ttl_s)
        """Prompts in, rollouts published."""
        self.trainer = RolloutReader(client, ns, scripts)
        """The trainer's reads and acks of `{ns}:rollouts`."""
        self.replies = ReplyReader(client, ns, scripts)
        """A gateway's reply stream."""
        self.scoring = ScoringStreams(client, ns, scripts)
        """The scoring stage's group, lease and forwards."""
        self.registry = Registry(client, self.keys, scripts["rehome"], scripts["beat"])
        """The workers: heartbeats, who lives, rehoming a departed worker's inbox."""
        self.control = ControlStream(self)
        """The control stream and the workers' doorbells."""

    # -- for a transition: what callers not yet moved to a role still call here (the system tests, the docs' own
    # example of a name of ours); new code calls the role ---------------------------------------------------------

    def add_prompts(self, prompts: Sequence[Prompt]) -> list[bytes]:
        """`Writer.add_prompts`."""
        return self.writer.add_prompts(prompts)

    def add_rollouts(self, rollouts: Sequence[Rollout]) -> int:
        """`Writer.add_rollouts`."""
        return self.writer.add_rollouts(rollouts)

    def read_work(self, consumer: str, count: int, block_ms: int | None) -> list[Entry]:
        """`WorkReader.read_work`."""
        return self.work.read_work(consumer, count, block_ms)

    def ensure_scoring_group(self) -> None:
        """`ScoringStreams.ensure_scoring_group`."""
        self.scoring.ensure_scoring_group()

    def trim_consumed(self, stream: str) -> int:
        """`trim_consumed` on this client."""
        return trim_consumed(self.redis, stream)
