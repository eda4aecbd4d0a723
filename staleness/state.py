"""`{ns}:state`: the policy version everyone should serve, and whether a weight sync is under way.

Fields (plain text, readable in `redis-cli`): `version` (policy version, 0 at start, +1 per
publish), `epoch` (+1 per weight sync), `paused` (1 while a sync is under way), `weights_uri`
(where `version` can be loaded from), `pending_version` (the version being synced while paused), `asleep` (the
level of the `sleep` the fleet is in, while paused for a colocated trainer's step; 0 or absent: awake).
Each LoRA adapter has a hash of its own with the same fields, `{ns}:adapter:NAME:state` (`Keys.state_of`),
and its name in the set `{ns}:adapters`: its versions, epochs and pauses are its own.
"""

from __future__ import annotations

from dataclasses import dataclass

import redis

from pipeline.codec import as_entries, as_text
from pipeline.wire import Command, Control, Keys


@dataclass(frozen=True)
class PolicyState:
    version: int = 0
    epoch: int = 0
    paused: bool = False
    weights_uri: str = ""
    pending_version: int | None = None
    asleep: int = 0
    """The level of the fleet's `sleep` (`Manager.sleep`): paused, engines asleep, until a sync or `wake`."""


def read_state(client: redis.Redis, keys: Keys, adapter: str | None = None) -> PolicyState:
    """The base model's state, or adapter `adapter`'s (all zeros for one never published)."""
    fields = {as_text(k): as_text(v) for k, v in client.hgetall(keys.state_of(adapter)).items()}
    pending = fields.get("pending_version", "")
    return PolicyState(
        version=int(fields.get("version", 0)),
        epoch=int(fields.get("epoch", 0)),
        paused=fields.get("paused", "0") == "1",
        weights_uri=fields.get("weights_uri", ""),
        pending_version=int(pending) if pending else None,
        asleep=int(fields.get("asleep") or 0),
    )


def weights_command(
    client: redis.Redis,
    keys: Keys,
    epoch: int,
    scan: int = 1000,
    adapter: str | None = None,
    cmds: tuple[Command, ...] = ("weights",),
) -> Control | None:
    """The `weights` command (or one of `cmds`: `("weights", "sleep")` for whichever began the epoch) of `epoch` (of
    the base model, or of `adapter`), searched back from the end of `{ns}:control` (a joiner's catch-up)."""
    for _id, fields in as_entries(client.xrevrange(keys.control, count=scan)):
        command = Control.from_fields(fields)
        if command.cmd in cmds and command.epoch == epoch and command.adapter == (adapter or ""):
            return command
    return None


def adapter_names(client: redis.Redis, keys: Keys) -> list[str]:
    """Every adapter ever published in this namespace (`{ns}:adapters`), sorted."""
    return sorted(as_text(name) for name in client.smembers(keys.adapters))
