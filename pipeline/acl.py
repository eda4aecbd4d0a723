"""Who may do what: Redis ACL rules per role, limited to one namespace's keys.

Every role gets its namespace's keys only (`{ns}:*`, never another namespace's), no dangerous or admin
command (`FLUSHALL`, `CONFIG`, `KEYS`, `DEBUG`, ...), and no pub/sub channel. Beyond that:

- `worker`: reads and writes its work (prompts, partials, its inbox, scoring, rollouts, replies, publish dedupe,
  dead letters, heartbeats, the registry and the fleet's sets (`ready`, `ready:held`, `beats`), the marks of entries
  run alone (`alone:*`), its model's layout in `layouts`); reads **only** `state`, `control` and its
  doorbells (`bell:*`), `weights:*` and the adapters' (`adapters`, `adapter:*`): a worker must never move a policy
  version, pause a sync or replace weights.
- `trainer`, `manager`, `gateway`: the whole namespace (admission writes `state`, syncs write `control`,
  the gateway's trajectories are counted in `state`).
- `scorer`: the whole namespace and RQ's keys (`rq:*`): the scoring stage, its RQ queue, the score-workers.
- `inspector`: reads the whole namespace with read commands only: `rollouts top`, `rollouts exporter`, a person
  with `redis-cli`.

Read-only keys need Redis 7 (key permissions `%R~`): on Redis 6.2 the `worker` role is refused (it could write
`state`), and the `inspector` is read-only by its commands alone. Passwords go in as SHA-256 hashes (`#...`), so the
rules can be printed, logged or kept in a file without the password in them.
"""

from __future__ import annotations

import hashlib
import re

from pipeline.wire import Keys

ROLES = ("worker", "trainer", "manager", "gateway", "scorer", "inspector")
BASE = ["resetkeys", "resetchannels", "-@all"]
WRITER_COMMANDS = ["+@read", "+@write", "+@stream", "+@hash", "+@set", "+@sortedset", "+@string", "+@keyspace"]
WRITER_COMMANDS += ["+@scripting", "+@connection", "+@transaction", "-@dangerous", "-@admin", "+info", "+ping"]
WRITER_COMMANDS += ["+cluster|slots", "+time"]
READER_COMMANDS = ["+@read", "+@connection", "-@dangerous", "-@admin", "+info", "+ping", "+cluster|slots"]
"""Later rules win: `INFO` (the version check) is in `@dangerous`, so it is allowed again after; `CLUSTER SLOTS`
finds the node of a namespace on a Redis Cluster (`connections.connect`); `TIME` is Redis's clock, which the fleet's
scripts read (`lua/share.lua`, `beat.lua`, `claim.lua`)."""
WORKER_WRITES: tuple[str, ...] = ("prompts", "partials", "inbox:*", "scoring", "rollouts", "replies:*", "published:*")
WORKER_WRITES += ("dead", "worker:*", "workers", "ready", "ready:held", "beats", "server:*", "layouts", "alone:*")
WORKER_READS = ("state", "control", "bell:*", "weights:*", "adapters", "adapter:*")
"""Each LoRA adapter's state and weights (`{ns}:adapter:NAME:...`) are read-only to workers, as the base model's."""


def pattern(ns: str, suffix: str) -> str:
    """A key pattern of the namespace: its glob characters escaped, `suffix` as given (it may end in `*`)."""
    return re.sub(r"([*?\[\]\\])", r"\\\1", "{" + Keys(ns).ns + "}") + ":" + suffix


def password_hash(password: str) -> str:
    return "#" + hashlib.sha256(password.encode()).hexdigest()


def acl_rules(ns: str, role: str, password: str, redis_7: bool = True) -> list[str]:
    """The `ACL SETUSER <user>` arguments that give `role` its rights on namespace `ns`."""
    if role not in ROLES:
        raise ValueError(f"unknown role {role!r}; choose one of {', '.join(ROLES)}")
    if not password:
        raise ValueError("a user needs a password (an empty one would let anybody in as this role)")
    rules = ["reset", "on", password_hash(password), *BASE]
    if role == "inspector":
        return [*rules, *READER_COMMANDS, f"%R~{pattern(ns, '*')}" if redis_7 else f"~{pattern(ns, '*')}"]
    rules += WRITER_COMMANDS
    if role == "worker":
        if not redis_7:
            raise ValueError(
                "Redis 6.2 cannot make {ns}:state read-only for a worker (key permissions came in Redis 7.0): "
                "upgrade Redis, or give workers the trainer role"
            )
        rules += [f"~{pattern(ns, key)}" for key in WORKER_WRITES]
        return rules + [f"%R~{pattern(ns, key)}" for key in WORKER_READS]
    rules.append(f"~{pattern(ns, '*')}")
    if role == "scorer":
        rules += ["~rq:*", "&rq:*", "+@pubsub"]  # RQ's queues, jobs and workers; its workers listen on rq:pubsub:*
    return rules
